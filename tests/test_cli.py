"""The first five minutes: every entry point answers an expected failure with one line on stderr and a
conventional exit code (1, 2 for a bad option, 130 after Ctrl-C), help is fast and complete, offline
generation shows its progress and keeps what finished when interrupted, and the server logs each
request and accepts the names it is told to serve under.

The commands run as subprocesses, as a user runs them; Ctrl-C is typed into a pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
from test_server import SERVER_ARGS, Server

from minisgl.core import SamplingParams
from minisgl.llm import LLM, GenerationInterrupted
from minisgl.llm.cli import build_parser as generate_parser
from minisgl.server.args import build_parser as server_parser

TIMEOUT_S = 240  # a loaded 2-core machine needs a while to import torch
ENV = {**os.environ, "MINISGL_LOG_LEVEL": "info"}
MISSING = "/nonexistent/model"


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


def minisgl(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minisgl", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env or ENV,
    )


def one_line_error(out: subprocess.CompletedProcess) -> str:
    """The error line, checked to be all there is on stderr."""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


class Terminal:
    """A command on a pseudo-terminal: what it shows, keys typed into it, its exit code."""

    def __init__(self, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "minisgl", *args]
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            # Ctrl-C as a terminal's user has it, even where this run was started with SIGINT ignored (a
            # background job of a non-interactive shell): an ignored SIGINT would be inherited
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe(cmd[0], cmd, ENV)
        # a terminal of 0 columns (a new pseudo-terminal's) would get an empty progress bar
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        self.shown = ""

    def read_until(self, pattern: str, timeout: float = TIMEOUT_S) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.shown)
            if found:
                return found
            if not self._read(0.5):
                break
        raise AssertionError(f"{pattern!r} did not appear; the terminal showed:\n{self.shown}")

    def _read(self, wait: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], wait)
        if ready:
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # the command has exited and the terminal is closed
                return False
            if not data:
                return False
            self.shown += data.decode(errors="replace")
        return True

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def exit_code(self, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._read(0.2)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                while self._read(0.1):
                    pass
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"the command did not exit; the terminal showed:\n{self.shown}")


# ---- help ----------------------------------------------------------------------------------------
def test_help_answers_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "from minisgl.__main__ import main\n"
        "for argv in (['--help'], ['generate', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]"
    # the top-level usage names both commands
    assert "python -m minisgl [serve] [options]" in out.stdout
    assert "python -m minisgl generate [options] [PROMPT ...]" in out.stdout


@pytest.mark.parametrize("parser", [server_parser, generate_parser], ids=["serve", "generate"])
def test_every_option_has_a_description_and_its_default(parser: Callable[[], Any]) -> None:
    p = parser()
    for action in p._actions:
        if "-h" in action.option_strings:
            continue
        assert action.help and "default" in action.help, f"{action.dest}: {action.help!r}"
    text = " ".join(p.format_help().split())
    if parser is generate_parser:
        for option, default in [("max-tokens", 128), ("temperature", 0.0), ("top-p", 1.0), ("top-k", -1)]:
            assert re.search(rf"--{option} \S+ (?:(?! --).)*?\(default: {default}\)", text), option


# ---- one line and an exit code ----------------------------------------------------------------------
def test_the_command_leaves_without_teardown_but_runs_the_atexit_handlers_and_keeps_its_code() -> None:
    """`python -m minisgl` exits by os._exit after main (no module teardown): an atexit handler still runs, the
    output is flushed, and the exit code is main's."""
    code = (
        "import atexit, runpy, sys\n"
        "atexit.register(lambda: print('handler ran', flush=True))\n"
        "print('before', end='')\n"
        "sys.argv = ['minisgl'] + sys.argv[1:]\n"
        "runpy.run_module('minisgl', run_name='__main__')\n"
        "print('AFTER-MAIN')\n"
    )
    for args, want in ((["generat"], 2), (["generate", "--help"], 0)):
        out = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, env=ENV, timeout=120
        )
        assert out.returncode == want, out.stderr
        assert (
            out.stdout.startswith("before")
            and out.stdout.rstrip().endswith("handler ran")
            and "AFTER-MAIN" not in out.stdout
        )


def test_a_mistyped_command_names_the_commands() -> None:
    out = minisgl("generat", "hello")
    assert out.returncode == 2
    line = one_line_error(out)
    assert "unknown command 'generat'" in line and "did you mean 'generate'?" in line and "serve" in line


@pytest.mark.parametrize(
    "args, says",
    [
        (["--nope"], "unrecognized arguments: --nope"),
        (["generate", "--nope", "hi"], "unrecognized arguments: --nope"),
        (["generate", "--temperature", "-1", "hi"], "temperature"),
        (["--port", "http"], "--port"),
        (["generate", "--logit-bias", "42", "hi"], "ID=VALUE"),
        (["generate", "--logit-bias", "42=101", "hi"], "logit_bias"),
        (["generate", "--max-tokens", "2", "--min-tokens", "3", "hi"], "min_tokens"),
        (["generate", "--chat-template", "{{ messages }}", "hi"], "add --chat"),
        (["generate", "--chat", "--chat-template", "chatml", "hi"], "neither a file nor a Jinja template"),
        (["--chat-template", "{% if %}"], "does not parse"),
    ],
    ids=[
        "serve",
        "generate",
        "sampling",
        "type",
        "logit-bias-form",
        "logit-bias-range",
        "min-tokens",
        "template-without-chat",
        "template-name",
        "template-syntax",
    ],
)
def test_a_bad_option_is_one_line_and_exit_code_2(args: list[str], says: str) -> None:
    out = minisgl(*args)
    assert out.returncode == 2
    line = one_line_error(out)
    assert says in line and "--help" in line


@pytest.mark.parametrize(
    "command", [[], ["--shell"], ["generate", "hello"]], ids=["serve", "shell", "generate"]
)
def test_a_missing_model_is_one_line_naming_it_and_exit_code_1(command: list[str]) -> None:
    out = minisgl(*command, "--model", MISSING)
    assert out.returncode == 1
    line = one_line_error(out)
    assert f"model {MISSING!r} does not exist" in line and ".gguf" in line


def test_the_debug_log_level_adds_the_traceback() -> None:
    out = minisgl("generate", "--model", MISSING, "hello", env={**ENV, "MINISGL_LOG_LEVEL": "debug"})
    assert out.returncode == 1
    assert out.stderr.startswith(f"error: model {MISSING!r} does not exist")
    assert "Traceback (most recent call last)" in out.stderr and "FileNotFoundError" in out.stderr


def test_a_model_that_fails_to_load_in_the_server_is_one_line_without_atexit_noise(tmp_path: Any) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a GGUF file")
    out = minisgl(
        "--model", str(bad), "--port", "0", env={**ENV, "MINISGL_CACHE_DIR": str(tmp_path / "cache")}
    )
    assert out.returncode == 1
    last = out.stderr.splitlines()[-1]
    assert last.startswith(f"error: cannot load {bad}: ") and "GGUF" in last
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr
    # before the error only log lines (the conversion it tried), no second report
    assert all(line.startswith("[") for line in out.stderr.splitlines()[:-1]), out.stderr


def test_a_port_in_use_is_one_line_and_exit_code_1(model_dir: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = minisgl("--model", model_dir, "--port", str(port))
    assert out.returncode == 1
    line = one_line_error(out)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line


def test_generate_without_prompts_says_so_at_once_in_a_terminal_and_from_a_pipe() -> None:
    term = Terminal(["generate", "--quiet"])
    term.read_until(r"error: no prompts: pass them as arguments")
    assert term.exit_code(60) == 1
    out = minisgl("generate", stdin="\n  \n")
    assert out.returncode == 1
    assert "no prompts" in one_line_error(out)


# ---- offline generation from the command line -------------------------------------------------------
def test_generate_shows_prompts_shortly_reports_a_failed_prompt_once_and_exits_1(model_dir: str) -> None:
    long_prompt = "word " * 2000  # longer than the tiny model's context of 512
    out = minisgl(
        "generate", "--model", model_dir, "--dtype", "float32", "--max-tokens", "4", "--ignore-eos",
        stdin=f"hello world\n{long_prompt}\n",
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stdout.startswith("### hello world\n") and "[finish_reason=length, 4 tokens]" in out.stdout
    assert "word word" not in out.stdout
    errors = [line for line in out.stderr.splitlines() if "prompt 2" in line or "WARNING" in line]
    assert len(errors) == 1 and errors[0].startswith("error: prompt 2 (word word word")
    assert "the prompt has" in errors[0] and len(errors[0]) < 400  # the prompt is not echoed whole
    assert re.search(r"^2 prompts, 4 tokens in [\d.]+ s", out.stderr, re.M)


def test_generate_prints_each_of_n_completions_under_its_prompt(model_dir: str) -> None:
    out = minisgl(
        "generate", "--model", model_dir, "--dtype", "float32", "--max-tokens", "4", "--ignore-eos", "--n", "2",
        "--temperature", "1", "--seed", "5", stdin="hello world\ngood morning\n",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    headers = [line for line in out.stdout.splitlines() if line.startswith("### ")]
    assert headers == ["### hello world"] * 2 + ["### good morning"] * 2
    assert out.stdout.count("[finish_reason=length, 4 tokens]") == 4


def test_ctrl_c_in_generate_prints_what_finished_and_exits_130(model_dir: str) -> None:
    prompts = [f"story number {i}" for i in range(60)]
    term = Terminal(
        ["generate", "--model", model_dir, "--dtype", "float32", "--max-running-req", "2",
         "--max-tokens", "200", "--ignore-eos", *prompts]
    )  # fmt: skip
    # the progress bar is on by default in a terminal; wait for two prompts to finish
    term.read_until(r"Processed prompts:[^\r\n]*\b([2-9]|[1-5]\d)/60\b")
    term.type(b"\x03")
    assert term.exit_code() == 130
    found = re.search(r"interrupted: (\d+) of 60 prompts finished", term.shown)
    assert found, term.shown
    finished = int(found.group(1))
    assert 2 <= finished < 60
    assert term.shown.count("[finish_reason=length, 200 tokens]") == finished
    assert "Traceback" not in term.shown and "KeyboardInterrupt" not in term.shown


# ---- the offline library ------------------------------------------------------------------------------
def test_llm_with_a_missing_model_raises_file_not_found_saying_what_to_pass() -> None:
    with pytest.raises(FileNotFoundError) as e:
        LLM(MISSING)
    message = str(e.value)
    assert f"{MISSING!r} does not exist" in message and ".gguf" in message and "\n" not in message


def test_generate_shows_a_progress_bar_only_when_asked_or_on_a_terminal(
    model_dir: str, make_llm: Callable[..., LLM], capsys: pytest.CaptureFixture[str]
) -> None:
    llm = make_llm(model_dir)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.generate(["a", "b", "c"], params, use_tqdm=True)
    assert re.search(r"Processed prompts: 100%.*3/3", capsys.readouterr().err)
    llm.generate(["a", "b", "c"], params)  # stderr is not a terminal here
    llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_ctrl_c_in_generate_raises_a_keyboard_interrupt_with_what_finished(
    model_dir: str, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(model_dir, max_running_req=2)
    prompts = [[1, 2, 3 + i] for i in range(6)]
    params = [SamplingParams(max_tokens=2 if i < 2 else 50, ignore_eos=True) for i in range(6)]
    want = llm.generate(prompts, params)
    forward, steps = llm.engine.forward_batch, []

    def interrupted_forward(*args: Any) -> Any:
        steps.append(1)
        if len(steps) == 8:  # the first two prompts are done by now, the others not
            raise KeyboardInterrupt
        return forward(*args)

    llm.engine.forward_batch = interrupted_forward
    with pytest.raises(KeyboardInterrupt) as e:
        llm.generate(prompts, params)
    llm.engine.forward_batch = forward
    assert isinstance(e.value, GenerationInterrupted)
    outs = e.value.outputs

    def tokens(outputs: list[dict[str, Any]]) -> list[tuple[list[int], str]]:
        return [(o["token_ids"], o["finish_reason"]) for o in outputs]

    assert tokens(outs[:2]) == tokens(want[:2]) and all(o["finish_reason"] == "length" for o in outs[:2])
    assert [o["finish_reason"] for o in outs[2:]] == ["abort"] * 4
    assert any(o["token_ids"] for o in outs[2:])  # the running ones keep the tokens they had
    llm.check_integrity()  # every row and page is back
    assert tokens(llm.generate(prompts, params)) == tokens(want)


# ---- the server ---------------------------------------------------------------------------------------
def test_served_model_names_request_log_lines_and_ctrl_c(model_dir: str) -> None:
    s = Server(
        ["--model", model_dir, "--served-model-name", "alias", "other", "--log-requests", *SERVER_ARGS]
    )
    try:
        client = s.client()
        assert [m.id for m in client.models.list().data] == ["alias", "other"]
        for name in ["alias", "other", model_dir]:
            got = client.completions.create(
                model=name, prompt="The capital of France is", max_tokens=3, extra_body={"ignore_eos": True}
            )
            assert got.model == name and got.choices[0].finish_reason == "length"
        with pytest.raises(openai.NotFoundError, match="'alias', 'other'"):
            client.completions.create(model=os.path.basename(model_dir), prompt="x", max_tokens=1)
        line = (
            r"request cmpl-\w+: \d+ prompt tokens \(\d+ cached\), 3 output tokens, first token [\d.]+ s, "
            r"total [\d.]+ s, finish_reason=length, prompt: 'The capital of France is', "
            # the output as Python's repr writes it: in double quotes where it holds a single quote
            r"output: ('.*'|\".*\")"
        )
        assert len(re.findall(line, s.log)) == 3, s.log
    finally:
        code = s.stop(signal.SIGINT)
    assert code == 130
    assert re.search(r"INFO minisgl\.server\.launch\] shutting down", s.log)
    assert "Traceback" not in s.log


def test_the_gpu_memory_share_by_vllms_and_sglangs_names() -> None:
    from minisgl.server.args import parse_args

    vllm = parse_args(["--gpu-memory-utilization", "0.5"])
    assert vllm == parse_args(["--mem-fraction-static", "0.5"]) and vllm.gpu_memory_utilization == 0.5
    assert vllm.scheduler_config("", "").gpu_memory_utilization == 0.5
    assert parse_args([]).scheduler_config("", "").gpu_memory_utilization is None
    for bad in ("0", "1.5", "nan"):
        with pytest.raises(SystemExit):
            parse_args(["--gpu-memory-utilization", bad])


def test_sglangs_and_vllms_option_names_set_the_same_options() -> None:
    from minisgl.llm.cli import build_parser
    from minisgl.server.args import parse_args

    ours = [
        "--max-seq-len",
        "1024",
        "--max-running-req",
        "8",
        "--max-extend-tokens",
        "512",
        "--page-size",
        "16",
    ]
    sglang = ["--context-length", "1024", "--max-running-requests", "8", "--chunked-prefill-size", "512"]
    vllm = [
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "512",
        "--block-size",
        "16",
    ]
    want = parse_args(
        [*ours, "--cache-type", "naive", "--cuda-graph-max-bs", "0", "--model", "m", "--tp-size", "2"]
    )
    for theirs in (
        [
            *sglang,
            "--page-size",
            "16",
            "--disable-radix-cache",
            "--disable-cuda-graph",
            "--model-path",
            "m",
            "--tp",
            "2",
        ],
        [
            *vllm,
            "--no-enable-prefix-caching",
            "--enforce-eager",
            "--model",
            "m",
            "--tensor-parallel-size",
            "2",
        ],
    ):
        assert parse_args(theirs) == want, theirs
    tools = [
        parse_args(["--tool-call-parser", name]).tool_call_parser
        for name in ("hermes", "qwen25", "llama3_json")
    ]
    assert tools == ["qwen", "qwen", "llama3"]
    generate = build_parser().parse_args(
        ["--max-model-len", "100", "--disable-radix-cache", "--max-num-seqs", "3", "x"]
    )
    assert (generate.max_seq_len, generate.cache_type, generate.max_running_req) == (100, "naive", 3)


def test_graphs_both_off_and_sized_is_one_line_and_exit_code_2() -> None:
    out = minisgl("--enforce-eager", "--cuda-graph-max-bs", "8")
    assert out.returncode == 2 and "pick one" in one_line_error(out)
