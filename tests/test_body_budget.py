"""The budget of request-body bytes the server holds at once (--max-request-bytes-in-flight): slow
clients that fill it make a further body a 503 with Retry-After, a small request still fits, and every
byte comes back however a request ends.

The budget object and the guard are driven directly (hang-ups and deadlines on a fake ASGI connection);
the rest is a real `python -m minisgl` driven by raw sockets, as tests/test_hostile.py drives it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_hostile import _assert_error, _post
from test_server import Server, _wait_metrics

from minisgl.server.guard import BodyBudget, HttpLimits, RequestGuard, release_body

MAX_BODY = 1_000_000
BUDGET = 2_500_000  # two largest bodies and half of a third
READ_TIMEOUT_S = 3  # the stalled client's 408 comes after this
HELD = "minisgl_request_body_bytes_held"


# ---- the budget ----------------------------------------------------------------------------------------------
def test_a_lease_holds_what_it_grows_to_and_gives_it_all_back_once() -> None:
    budget = BodyBudget(100)
    a, b = budget.lease(), budget.lease()
    assert a.grow_to(30) and a.grow_to(60) and a.grow_to(50)  # a smaller size keeps what it holds
    assert b.grow_to(40)
    assert budget.held == 100
    a.release()
    a.release()  # the route, then the guard: the bytes come back once
    assert budget.held == 40
    b.release()
    assert budget.held == 0


def test_a_lease_past_the_limit_is_refused_and_keeps_what_it_held() -> None:
    budget = BodyBudget(100)
    a, b = budget.lease(), budget.lease()
    assert a.grow_to(70) and b.grow_to(20)
    assert not b.grow_to(31)
    assert budget.held == 90 and b.bytes == 20
    assert b.grow_to(30)  # exactly the limit fits
    b.release()
    assert budget.held == 70
    assert not b.grow_to(10)  # a released lease takes nothing more
    a.release()
    assert budget.held == 0


# ---- the guard, on a fake connection ---------------------------------------------------------------------------
class _Connection:
    """One request as the guard sees it: its messages come from a queue the test fills."""

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.scope = {"type": "http", "method": "POST", "path": "/x", "headers": headers}
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        return await self.messages.get()

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def body(self, data: bytes, more: bool = False) -> None:
        self.messages.put_nowait({"type": "http.request", "body": data, "more_body": more})

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.sent if m["type"] == "http.response.start"), None)


def _length(n: int) -> list[tuple[bytes, bytes]]:
    return [(b"content-length", str(n).encode())]


async def _until(done: Callable[[], bool]) -> None:
    while not done():
        await asyncio.sleep(0.001)


def _guard(app: Any, budget: BodyBudget, read_timeout_s: float = 5.0) -> RequestGuard:
    return RequestGuard(app, HttpLimits(100, read_timeout_s, budget.limit), budget)


async def _parsing_app(scope: Any, receive: Any, send: Any) -> None:
    """What every route does: take the body, parse it (here: fail to), give its bytes back."""
    try:
        await receive()
        await asyncio.sleep(0.01)
        raise ValueError("not JSON")
    except ValueError:
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
    finally:
        release_body(scope)


async def _failing_app(scope: Any, receive: Any, send: Any) -> None:
    raise RuntimeError("a bug")


async def _unread_app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def test_the_guard_gives_back_every_byte_however_a_request_ends() -> None:
    async def run() -> None:
        budget = BodyBudget(200)
        # a hang-up mid-body, beside a request still reading, which keeps its bytes
        hangs_up, reading = _Connection(_length(60)), _Connection([])  # the second is chunked
        tasks = [
            asyncio.create_task(_guard(_unread_app, budget)(c.scope, c.receive, c.send))
            for c in (hangs_up, reading)
        ]
        hangs_up.body(b"a" * 30, more=True)
        reading.body(b"b" * 50, more=True)
        await _until(lambda: budget.held == 110)
        hangs_up.messages.put_nowait({"type": "http.disconnect"})
        await tasks[0]
        assert budget.held == 50 and hangs_up.status is None
        reading.body(b"b" * 10)
        await tasks[1]
        assert budget.held == 0 and reading.status == 404  # a route that never read its body
        # a parse error: the route and then the guard give the bytes back, once
        for app, status in [(_parsing_app, 400), (_failing_app, 500)]:
            c = _Connection(_length(100))
            c.body(b"x" * 100)
            await _guard(app, budget)(c.scope, c.receive, c.send)
            assert (c.status, budget.held) == (status, 0)
        # a body that stops arriving: 408
        c = _Connection(_length(100))
        c.body(b"x", more=True)
        await _guard(_unread_app, budget, read_timeout_s=0.05)(c.scope, c.receive, c.send)
        assert (c.status, budget.held) == (408, 0)

    asyncio.run(run())


def test_the_guard_refuses_a_body_over_the_budget_before_it_is_read_or_as_it_arrives() -> None:
    async def run() -> None:
        budget = BodyBudget(150)
        holder = budget.lease()
        assert holder.grow_to(100)
        declared = _Connection(_length(60))
        await _guard(_unread_app, budget)(declared.scope, declared.receive, declared.send)
        assert declared.status == 503 and declared.messages.empty()  # nothing was asked of the client
        headers = dict(declared.sent[0]["headers"])
        assert headers[b"retry-after"] == b"1"
        assert json.loads(declared.sent[1]["body"])["error"]["code"] == "server_busy"
        chunked = _Connection([])
        chunked.body(b"x" * 50, more=True)
        chunked.body(b"x", more=True)
        await _guard(_unread_app, budget)(chunked.scope, chunked.receive, chunked.send)
        assert chunked.status == 503 and budget.held == 100
        holder.release()
        assert budget.held == 0

    asyncio.run(run())


# ---- every route, through the app ----------------------------------------------------------------------------
class _RecordingClient:
    """An EngineClient stand-in that records the bytes of bodies held when a call reaches the engine."""

    failure = None

    def __init__(self) -> None:
        self.app: Any = None
        self.held_at_engine: list[int] = []

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def submit(self, msgs: Any, request_id: str | None = None) -> Any:
        self.held_at_engine.append(self.app.state.bodies.held)
        raise RuntimeError("stop here")

    async def tokens(self, msg: Any) -> Any:
        return self.submit([msg])


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "a"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
        ("/generate", {"text": "a"}),
        ("/tokenize", {"prompt": "a"}),
        ("/detokenize", {"tokens": [1]}),
    ],
)
def test_every_route_gives_its_body_bytes_back_once_parsed_before_the_engine_has_the_call(
    path: str, body: dict[str, Any]
) -> None:
    from fastapi.testclient import TestClient

    from minisgl.server.api_server import create_app
    from minisgl.server.client import ServeInfo

    client = _RecordingClient()
    app = create_app(ServeInfo("m", None, 512), lambda: client, HttpLimits(1 << 20, 5.0, 1 << 20))  # type: ignore[arg-type, return-value]
    client.app = app
    padded = json.dumps(body).encode() + b" " * 100_000  # large enough to be parsed off the event loop
    with TestClient(app, raise_server_exceptions=False) as http:
        assert http.post(path, content=padded).status_code == 500  # the stand-in stops it there
        assert http.post(path, content=b"not JSON").status_code == 400
    assert client.held_at_engine == [0]
    assert app.state.bodies.held == 0


# ---- a real server --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model: Callable[[str], str]) -> Iterator[Server]:
    s = Server(
        [
            "--model",
            tiny_model("llama"),
            "--dtype",
            "float32",
            "--max-request-bytes",
            str(MAX_BODY),
            "--max-request-bytes-in-flight",
            str(BUDGET),
            "--read-timeout",
            str(READ_TIMEOUT_S),
        ]
    )
    yield s
    s.stop()


def _valid_body(size: int) -> bytes:
    """A completion request of exactly `size` bytes (spaces fill it)."""
    start = b'{"prompt": "hello", "max_tokens": 2'
    return start + b" " * (size - len(start) - 1) + b"}"


def _start(server: Server, body: bytes, sent: int, chunked: bool = False) -> socket.socket:
    """A connection that has sent a request's head and the first `sent` bytes of `body`, and stalls."""
    sock = socket.create_connection((server.host, server.port))
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % len(body)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s\r\n\r\n" % framing
    )
    if sent:
        sock.sendall(body[:sent])
    return sock


def _answer(sock: socket.socket, timeout: float = 30) -> tuple[int, dict[str, str], Any]:
    """(status, headers, JSON body) of the one answer on `sock`, which is then closed."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(rest) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, rest
        rest += chunk
    sock.close()
    return int(lines[0].split(" ", 2)[1]), headers, json.loads(rest)


def _wait_held(server: Server, held: int) -> None:
    assert _wait_metrics(server, lambda m: m[HELD] == held, timeout=10)[HELD] == held


def _assert_busy(status: int, headers: dict[str, str], answer: Any) -> None:
    assert status == 503, answer
    assert int(headers["retry-after"]) >= 1
    _assert_error(answer, None, "server_busy")
    assert answer["error"]["type"] == "server_error"
    message = answer["error"]["message"]
    assert "--max-request-bytes-in-flight" in message and "retry" in message


def test_slow_clients_that_fill_the_budget_make_a_large_body_a_503_and_every_byte_comes_back(
    server: Server,
) -> None:
    # two clients send half of a largest body each and stall: 2,000,000 of the 2,500,000 are held
    full = _valid_body(MAX_BODY)
    finishes = _start(server, full, MAX_BODY // 2)
    hangs_up = _start(server, full, MAX_BODY // 2)
    _wait_held(server, 2 * MAX_BODY)

    # a third largest body is refused from its length, before a byte of it is sent
    _assert_busy(*_answer(_start(server, full, 0)))
    # a chunked body as its bytes pass the 500,000 left: five 100,000-byte chunks fit, one byte more does not
    chunked = _start(server, b"", 0, chunked=True)
    piece = b"x" * 100_000
    chunked.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) * 5 + b"1\r\nx\r\n")
    _assert_busy(*_answer(chunked))
    # a small request fits in what is left
    status, answer, _ = _post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert status == 200, answer
    _wait_held(server, 2 * MAX_BODY)

    # one more stalls with a few bytes sent; the body deadline cuts it off and its bytes come back
    stalls = _start(server, _valid_body(400_000), 10)
    _wait_held(server, 2 * MAX_BODY + 400_000)
    status, _, answer = _answer(stalls)
    assert status == 408
    _assert_error(answer, None, "request_timeout")
    _wait_held(server, 2 * MAX_BODY)

    # a hang-up mid-body gives its bytes back; then a body that does not parse (a 400) fits, and gives
    # its bytes back too
    hangs_up.close()
    _wait_held(server, MAX_BODY)
    broken = _start(server, b"x" * MAX_BODY, MAX_BODY)
    status, _, answer = _answer(broken)
    assert status == 400, answer
    # the first client sends the rest of its body and is answered
    finishes.sendall(full[MAX_BODY // 2 :])
    status, _, answer = _answer(finishes)
    assert status == 200, answer
    _wait_held(server, 0)

    # nothing is held: a largest body goes through again
    status, _, answer = _answer(_start(server, full, MAX_BODY))
    assert status == 200, answer
    _wait_held(server, 0)


def test_a_budget_below_the_largest_body_is_refused_at_start_naming_both_options() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "minisgl",
            "--max-request-bytes",
            "1000",
            "--max-request-bytes-in-flight",
            "999",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--max-request-bytes-in-flight 999" in out.stderr and "--max-request-bytes 1000" in out.stderr
