"""The chat shell: replies stream in, the conversation carries over turns, /reset and /exit work.

One test drives ChatShell through prompt_toolkit's pipe input against the real scheduler and
tokenizer processes; another starts `python -m minisgl --shell` in a pseudo-terminal."""

from __future__ import annotations

import asyncio
import os
import pty
import re
import select
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import pytest
import torch
from prompt_toolkit import PromptSession
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.server.args import parse_args
from minisgl.server.client import EngineClient, ServeInfo
from minisgl.server.launch import ServerProcesses
from minisgl.server.shell import ChatShell
from minisgl.tokenizer.reasoning import reasoning_format

PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
T = TypeVar("T")


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def processes(model_dir: str) -> Iterator[tuple[ServerProcesses, ServeInfo]]:
    args = parse_args(["--shell", "--model", model_dir, "--dtype", "float32", "--max-running-req", "8"])
    procs = ServerProcesses(args)
    try:
        model = procs.start()
        yield procs, ServeInfo(args.model_name, args.model, model.limits.max_seq_len)
    finally:
        procs.stop()


class Recorder:
    """A text stream that remembers every write, to see that a reply arrives in pieces."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        return "".join(self.writes)


async def _drive(shell: ChatShell, pipe: object, lines: list[str], timeout: float = 60) -> None:
    """Type each line once the shell has answered the one before; fail if an answer takes over `timeout` s."""
    task = asyncio.create_task(shell.run())
    for line in lines:
        turns = len(shell.history)
        pipe.send_text(line + "\r")  # type: ignore[attr-defined]
        if line.startswith("/"):
            await asyncio.sleep(0.2)
            continue
        deadline = time.monotonic() + timeout
        while len(shell.history) < turns + 2 and not task.done():
            if time.monotonic() > deadline:
                task.cancel()
                raise AssertionError(f"the shell did not answer {line!r} within {timeout:g} s")
            await asyncio.sleep(0.02)
    try:
        await asyncio.wait_for(task, timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"the shell was still running {timeout:g} s after {lines[-1]!r}") from None


async def _with_input(procs: ServerProcesses, body: Callable[..., Awaitable[T]]) -> T:
    """body(client, session, pipe): a client of the processes, and a prompt session typed into through the pipe."""
    client = EngineClient(procs.addrs.requests, procs.addrs.replies)
    client.start()
    try:
        with create_pipe_input() as pipe:
            session: PromptSession = PromptSession(input=pipe, output=DummyOutput())
            return await body(client, session, pipe)
    finally:
        client.close()


def test_shell_streams_replies_keeps_history_and_resets(
    processes: tuple[ServerProcesses, ServeInfo], model_dir: str
) -> None:
    procs, info = processes
    llm = LLM(model_dir, dtype=torch.float32, max_running_req=8)
    first = [{"role": "user", "content": "hello world"}]
    reply1 = llm.chat([first], PARAMS)[0]["text"]
    second = [*first, {"role": "assistant", "content": reply1}, {"role": "user", "content": "and then?"}]
    reply2 = llm.chat([second], PARAMS)[0]["text"]
    llm.shutdown()

    out = Recorder()

    async def run(client: EngineClient, session: PromptSession, pipe: Any) -> tuple[list[Any], ChatShell]:
        shell = ChatShell(client, info, session, out, PARAMS)  # type: ignore[arg-type]
        await _drive(shell, pipe, ["hello world", "and then?", "/exit"])
        history = list(shell.history)
        shell = ChatShell(client, info, session, out, PARAMS)  # type: ignore[arg-type]
        await _drive(shell, pipe, ["hello world", "/reset", "hello world", "/nope", "/exit"])
        return history, shell

    history, shell = asyncio.run(_with_input(procs, run))
    assert history == [*second, {"role": "assistant", "content": reply2}]
    # after /reset the same question gets the first answer again: the history is gone
    assert shell.history == [*first, {"role": "assistant", "content": reply1}]
    assert out.text.count(reply1) >= 3 and reply2 in out.text
    assert "(new conversation)" in out.text and "unknown command /nope" in out.text
    pieces = [w for w in out.writes if w and w in reply1]
    assert len(pieces) > 1  # the reply was written as it streamed, not at once


def test_shell_shows_the_reasoning_apart_and_keeps_only_the_answer(
    processes: tuple[ServerProcesses, ServeInfo],
) -> None:
    procs, info = processes
    info = replace(info, reasoning=reasoning_format("qwen3"))
    # the tiny model made to think, then answer
    params = SamplingParams(max_tokens=60, regex=r"<think>\nHm, 2\.\n</think>\n\nTwo\.")
    out = Recorder()

    async def run(client: EngineClient, session: PromptSession, pipe: Any) -> ChatShell:
        shell = ChatShell(client, info, session, out, params)  # type: ignore[arg-type]
        await _drive(shell, pipe, ["one plus one?", "/exit"])
        return shell

    shell = asyncio.run(_with_input(procs, run))
    assert shell.history[-1] == {"role": "assistant", "content": "Two."}
    assert "(thinking: Hm, 2.)\nTwo.\n" in out.text


def _read_until(fd: int, pattern: str, timeout: float) -> str:
    out = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                out += os.read(fd, 4096).decode(errors="replace")
            except OSError:
                break
            if re.search(pattern, out):
                return out
    raise AssertionError(f"{pattern!r} did not appear; the terminal showed:\n{out}")


def _exit_code(pid: int, timeout: float) -> int:
    """The exit code of child `pid`; one still running after `timeout` s is killed and the test fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the shell was still running {timeout:g} s after /exit; killed it")


def test_shell_command_runs_in_a_terminal_and_exits_cleanly(model_dir: str) -> None:
    cmd = [sys.executable, "-m", "minisgl", "--shell", "--model", model_dir, "--dtype", "float32"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: the shell, on the pseudo-terminal
        os.execvpe(cmd[0], cmd, {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1"})
    try:
        # the banner, then the prompt (drawn with escape sequences, so only its ">" is looked for)
        _read_until(fd, r"chatting with llama\w*\. /reset[^\n]*\n[\s\S]*>", 240)
        os.write(fd, b"/exit\r")
        assert _exit_code(pid, 60) == 0
    finally:
        os.close(fd)
