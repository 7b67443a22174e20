"""What the HTTP front end enforces before a route sees a request, so that no client can hold the
server's memory, sockets or event loop:

- a body over `max_request_bytes` is refused with 413, from its Content-Length before it is read, or
  as soon as the bytes received pass the limit;
- the bodies held at once, read or being read and not yet parsed, take at most
  `max_request_bytes_in_flight` bytes (`BodyBudget`): a body that would pass it is refused with 503 and
  a Retry-After, from its Content-Length before it is read, or as its bytes arrive;
- a request's headers must arrive within `read_timeout_s` of the connection opening (or of the first
  byte of the next request on a kept-alive connection), else the connection is closed; its body must
  arrive within `read_timeout_s` of its headers, plus a second for every `BODY_MIN_RATE` bytes received
  (a large body sent steadily is read whole, however slow the client's machine; a trickle is not:
  Apache's `RequestReadTimeout ... MinRate` rule), else the answer is 408;
- a kept-alive connection idle for `keep_alive_s` is closed (uvicorn's own timer);
- an unexpected exception is logged with its traceback and answered with a JSON 500 that says nothing
  of the server's internals.

Every refusal is an OpenAI-style error body. uvicorn has no timer for slow headers, so its h11
protocol is extended with one (`h11_protocol`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from minisgl.server.protocol import APIError
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]

# Bytes a second of body that earn a second more to send the rest: at 4 MiB, the default limit, a
# steady client has 64 s more; one that trickles a byte a second gains nothing.
BODY_MIN_RATE = 64 << 10


# What a client refused for a full body budget is told to wait: a body sent at network speed is read in
# well under a second, and the slow ones that fill the budget are cut off at --read-timeout.
BUSY_RETRY_AFTER_S = 1

_LEASE = "minisgl.body_lease"  # the scope key of the request's BodyLease


@dataclass(frozen=True)
class HttpLimits:
    max_request_bytes: int
    read_timeout_s: float
    max_request_bytes_in_flight: int
    keep_alive_s: int = 5  # uvicorn's default, stated here so the limits are read in one place


class BodyBudget:
    """The bytes of request bodies the server holds at once: read or being read, and not yet parsed into
    a request. Each body takes its bytes through a `BodyLease` before they are read and gives them all
    back once, however its request ends. Used from the event loop alone, so it needs no lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def lease(self) -> BodyLease:
        return BodyLease(self)


class BodyLease:
    """One request's share of a `BodyBudget`."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.bytes = 0
        self.released = False

    def grow_to(self, size: int) -> bool:
        """Hold `size` bytes in all; False, holding what it held, where the budget has no room for them."""
        more = size - self.bytes
        if more <= 0:
            return True
        if self.released or self.budget.held + more > self.budget.limit:
            return False
        self.budget.held += more
        self.bytes = size
        return True

    def release(self) -> None:
        """Give every byte back; a second call (the route, then the guard) gives nothing."""
        if not self.released:
            self.released = True
            self.budget.held -= self.bytes
            self.bytes = 0


def release_body(scope: Scope) -> None:
    """The route has parsed the request's body (or failed to): its bytes leave the body budget."""
    lease = scope.get(_LEASE)
    if lease is not None:
        lease.release()


class RequestGuard:
    """ASGI middleware: reads the body whole (within the size, time and budget limits) before the app
    runs, and turns an exception that escapes the app into a JSON 500."""

    def __init__(self, app: Any, limits: HttpLimits, budget: BodyBudget) -> None:
        self.app, self.limits, self.budget = app, limits, budget

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        lease = scope[_LEASE] = self.budget.lease()
        try:
            await self._serve(scope, receive, send, lease)
        finally:
            # whatever ended the request: a refusal, a hang-up, a timeout, an exception, or a route that
            # never parsed its body
            lease.release()

    async def _serve(self, scope: Scope, receive: Any, send: Any, lease: BodyLease) -> None:
        body = await self._read_body(scope, receive, send, lease)
        if body is None:
            return  # refused, or the client went away
        # handed on once and not kept here, so that the bytes go once the route has parsed them
        unread = [body]
        del body

        async def replay() -> Message:
            if not unread:
                return await receive()  # from here on only http.disconnect can come
            return {"type": "http.request", "body": unread.pop(), "more_body": False}

        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, replay, tracked_send)
        except Exception:
            logger.exception(f"{scope['method']} {scope['path']} failed")
            if not started:
                error = APIError(
                    "the server failed to handle this request", None, "internal_error", 500, "server_error"
                )
                await send_error(send, error)

    async def _read_body(self, scope: Scope, receive: Any, send: Any, lease: BodyLease) -> bytes | None:
        limit = self.limits.max_request_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"")
        # a length of more digits than any limit is refused without reading it as a number
        if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
            size = int(declared) if len(declared) <= 18 else limit
            await send_error(send, _too_large(size, limit, at_least=len(declared) > 18))
            return None
        # a declared length is held before the first byte is read; a chunked body as its bytes arrive
        if declared.isdigit() and not lease.grow_to(int(declared)):
            await _send_busy(send, self.budget, int(declared))
            return None
        start = time.monotonic()
        chunks, size = [], 0
        while True:
            allowed = self.limits.read_timeout_s + size / BODY_MIN_RATE
            try:
                message = await asyncio.wait_for(receive(), max(0.0, start + allowed - time.monotonic()))
            except asyncio.TimeoutError:
                error = APIError(
                    f"the request body did not arrive within {allowed:.3g} s ({self.limits.read_timeout_s:g} s,"
                    f" and 1 s more for every {BODY_MIN_RATE} bytes received: {size} were)",
                    None,
                    "request_timeout",
                    408,
                )
                await send_error(send, error)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await send_error(send, _too_large(size, limit, at_least=True))
                return None
            if not lease.grow_to(size):
                await _send_busy(send, self.budget, size - lease.bytes)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    more = "more than " if at_least else ""
    return APIError(
        f"the request body has {more}{size} bytes; this server takes at most {limit} (--max-request-bytes)",
        None,
        "request_too_large",
        413,
    )


async def _send_busy(send: Any, budget: BodyBudget, more: int) -> None:
    error = APIError(
        f"the server is holding {budget.held} bytes of request bodies, and {more} more would pass its "
        f"limit of {budget.limit} (--max-request-bytes-in-flight); retry after {BUSY_RETRY_AFTER_S} s, "
        "or send a smaller body",
        None,
        "server_busy",
        503,
        "server_error",
    )
    await send_error(send, error, [(b"retry-after", str(BUSY_RETRY_AFTER_S).encode())])


async def send_error(send: Any, error: APIError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Send `error` as the whole response and close the connection (the rest of the body is not read);
    `headers` go with it."""
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *(headers or []),
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def h11_protocol(read_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for a request's headers."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                self._arm()  # part of a request's head: its deadline runs from its first byte
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(read_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.transport.close()

    return HeaderTimeoutProtocol
