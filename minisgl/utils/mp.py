"""ZMQ queues that carry messages between the server's processes, and the set-up every child process runs.

Each queue is one direction: a PULL socket that binds (its owner lives as long as the server) and
PUSH sockets that connect to it. Messages are the dataclasses of minisgl.message, msgpack-encoded.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any

import zmq
import zmq.asyncio

from minisgl.message.utils import deserialize, serialize

POLL_MS = 500  # a blocking wait wakes this often, so signals are handled promptly


def ipc_addr(folder: str, name: str) -> str:
    return f"ipc://{os.path.join(folder, name)}"


def _socket(ctx: zmq.Context, kind: int, addr: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # closing never waits for a peer that is gone
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)  # never drop or block on bursts
    if kind == zmq.PULL:
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock


class ZmqPushQueue:
    def __init__(self, addr: str) -> None:
        self.socket = _socket(zmq.Context.instance(), zmq.PUSH, addr)

    def put(self, obj: Any) -> None:
        self.socket.send(serialize(obj), copy=False)

    def close(self) -> None:
        self.socket.close()


class ZmqPullQueue:
    def __init__(self, addr: str) -> None:
        self.socket = _socket(zmq.Context.instance(), zmq.PULL, addr)

    def get(self) -> Any:
        """The next message, waiting as long as it takes."""
        while not self.socket.poll(POLL_MS):
            pass
        return deserialize(self.socket.recv())

    def get_nowait(self) -> Any | None:
        try:
            return deserialize(self.socket.recv(zmq.NOBLOCK))
        except zmq.Again:
            return None

    def drain(self) -> list[Any]:
        """Every message that has already arrived."""
        out = []
        while (msg := self.get_nowait()) is not None:
            out.append(msg)
        return out

    def close(self) -> None:
        self.socket.close()


class ZmqAsyncPullQueue:
    """A PULL queue for an asyncio event loop (the API server's)."""

    def __init__(self, addr: str) -> None:
        ctx = zmq.asyncio.Context.shadow(zmq.Context.instance().underlying)
        self.socket = _socket(ctx, zmq.PULL, addr)

    async def get(self) -> Any:
        return deserialize(await self.socket.recv())

    def close(self) -> None:
        self.socket.close()


def release_free_memory() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim; nothing elsewhere).

    Without it a process keeps its peak size for good: the activations of a large batch stay mapped
    after they are freed, and a process's memory cannot be told from a leak.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C does, through every `finally`, instead of killing the process outright."""
    signal.signal(signal.SIGTERM, _raise_exit)


def exit_now(code: int) -> None:
    """End a child process without the interpreter's teardown, which spends seconds collecting torch's
    and transformers' objects when nothing is left to save."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def init_child_process() -> None:
    """Signals of a server child: its parent decides when it stops, and it never outlives the parent."""
    # Ctrl-C in a terminal reaches the whole process group; the parent shuts the children down in order
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_on_sigterm()
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        pr_set_pdeathsig = 1
        # the kernel sends SIGTERM when the parent dies, even by SIGKILL: no orphans
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the call above
            raise SystemExit(0)
