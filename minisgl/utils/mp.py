"""ZMQ queues that carry messages between the server's processes, and the set-up every child process runs.

Each queue is one direction: a PULL socket that binds (its owner lives as long as the server) and
PUSH sockets that connect to it. Messages are the dataclasses of minisgl.message, msgpack-encoded.
"""

from __future__ import annotations

import os
from typing import Any

import zmq
import zmq.asyncio

from minisgl.message.utils import deserialize, serialize

POLL_MS = 500  # a blocking wait wakes this often, so signals are handled promptly
RECONNECT_MS = 5  # how often a PUSH socket retries a peer that has not bound yet


def ipc_addr(folder: str, name: str) -> str:
    return f"ipc://{os.path.join(folder, name)}"


def _socket(ctx: zmq.Context, kind: int, addr: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # closing never waits for a peer that is gone
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)  # never drop or block on bursts
    if kind == zmq.PULL:
        sock.bind(addr)
    else:
        # a PUSH socket that connects before its peer has bound retries on ZMQ's timer, 100 ms by default:
        # the API server binds its reply queue after the workers start, so a request sent the moment the
        # server was ready had its first replies held until the next retry (TTFT 108-129 ms against 37-46)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
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
