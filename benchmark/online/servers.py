"""The servers a benchmark measures: started here (and stopped with every child), or already running."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sse import get_json

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


@dataclass
class Target:
    name: str
    kind: str  # "minisgl", "llama.cpp" or "other": how a request fixes its output length
    base_url: str
    model: str
    # the served model's folder (None: the embedded model), for servers that report no token counts
    model_path: str | None = None

    def count_tokens(self, text: str) -> int:
        return len(_tokenizer(self.model_path).encode(text, add_special_tokens=False))


@functools.cache
def _tokenizer(path: str | None) -> Any:
    from minisgl.utils.hf import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(path))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base_url: str, proc: subprocess.Popen | None, timeout: float, log: str | None = None) -> str:
    """The served model's name, once /health answers 200 (or, on a server without /health, /v1/models);
    a failure shows the end of the server's output file `log`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"the server exited with code {proc.returncode} before it was ready{_log_tail(log)}"
            )
        try:
            status, _ = asyncio.run(get_json(f"{base_url}/health"))
            if status in (200, 404):
                status, models = asyncio.run(get_json(f"{base_url}/v1/models"))
                if status == 200:
                    return models["data"][0]["id"]
        except (OSError, ValueError):
            pass
        time.sleep(1)
    raise RuntimeError(f"the server at {base_url} was not ready within {timeout:.0f} s{_log_tail(log)}")


def server_command(kind: str, port: int, args: argparse.Namespace) -> list[str]:
    if kind == "minisgl":
        return [sys.executable, "-m", "minisgl", "--port", str(port), *shlex.split(args.minisgl_args)]
    if kind == "llama.cpp":
        from minisgl.models.gguf import default_model_path

        # llama-cpp-python's server decodes one request at a time (it has no parallel slots); its
        # threads are minisgl's (MINISGL_CPU_THREADS, else torch's choice), for prompts and tokens alike
        threads = str(args.llama_cpp_threads or minisgl_threads())
        return [
            args.llama_cpp_python,
            "-m",
            "llama_cpp.server",
            "--model",
            args.llama_cpp_model or default_model_path(),
            "--port",
            str(port),
            "--n_ctx",
            "4096",
            "--n_threads",
            threads,
            "--n_threads_batch",
            threads,
            # logits of the last prompt token only (the default keeps every position's), and the fused
            # attention llama.cpp picks by itself when it is not the server
            "--logits_all",
            "False",
            "--flash_attn",
            "True",
            "--verbose",
            "False",
            # by default a new request cuts off the one being streamed; queue them instead
            "--interrupt_requests",
            "False",
        ]
    raise ValueError(f"unknown server {kind!r}; use minisgl or llama.cpp")


def minisgl_threads() -> int:
    """The torch threads a minisgl server started from this environment uses on the CPU."""
    import torch

    return int(os.environ.get("MINISGL_CPU_THREADS") or 0) or torch.get_num_threads()


def _group_members(pgid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # fields[0] is the state, [2] the process group
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry))
    return found


def stop(proc: subprocess.Popen, grace: float = 60) -> None:
    """SIGINT (the server's own shutdown), then SIGKILL to whatever of its process group is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            print(f"the server (pid {proc.pid}) did not stop within {grace:.0f} s; killing it", flush=True)
    deadline = time.monotonic() + 10
    while (left := _group_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        print(f"killing {len(left)} process(es) the server left behind: {left}", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _log_tail(path: str | None, lines: int = 30) -> str:
    if path is None:
        return ""
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return "\n--- the server's last output ---\n" + "".join(f.readlines()[-lines:])
    return ""


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def started_servers(args: argparse.Namespace, model_path: str | None) -> Iterator[list[Target]]:
    """The targets to measure: --base-url, or every server of --servers, started (in their own process
    group, inheriting this environment with the repository on PYTHONPATH) and stopped at the end."""
    if args.base_url:
        base_url = args.base_url.rstrip("/")
        yield [
            Target(args.name, "other", base_url, wait_ready(base_url, None, args.startup_timeout), model_path)
        ]
        return
    # `timeout` and the device's job control stop a run with SIGTERM: stop the servers then too
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    procs: list[subprocess.Popen] = []
    try:
        targets = []
        for kind in args.servers.split(","):
            port = _free_port()
            base_url = f"http://127.0.0.1:{port}"
            log = f"{args.server_log}.{kind}" if args.server_log else tempfile.mktemp(suffix=f".{kind}.log")
            with open(log, "w") as out:
                procs.append(
                    subprocess.Popen(
                        server_command(kind, port, args),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                )
            print(f"started {kind} (pid {procs[-1].pid}, output in {log})", flush=True)
            model = wait_ready(base_url, procs[-1], args.startup_timeout, log)
            path = model_path if kind == "minisgl" else None
            targets.append(Target(kind, kind, base_url, model, path))
        yield targets
    finally:
        for proc in procs:
            stop(proc)
        signal.signal(signal.SIGTERM, previous)
