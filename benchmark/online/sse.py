"""A lean HTTP/1.1 client for streamed (server-sent events) JSON answers, on asyncio streams alone.

The benchmark's client must cost far less per chunk than the server it measures: at 256 streams
a GPU server sends tens of thousands of chunks a second, and a client that builds an object per
chunk (the openai package does) would be the bottleneck itself. This one splits bytes and calls
json.loads, nothing more, and needs no package the GPU machine lacks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class HTTPError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status, self.body = status, body


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection without an answer")
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body as it arrives, chunked transfer encoding undone."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                return
            piece = await reader.readexactly(size + 2)
            yield piece[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while piece := await reader.read(65536):
            yield piece


async def request(
    url: str, body: dict[str, Any] | None = None, api_key: str | None = None
) -> AsyncIterator[tuple[int, dict[str, Any] | str]]:
    """POST `body` as JSON (GET without one) and yield (status, event) for each `data:` event of a
    200 stream (the JSON decoded; "[DONE]" as the string), or (status, whole body) for any other answer."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    try:
        payload = json.dumps(body).encode() if body is not None else b""
        head = [
            f"{'POST' if body is not None else 'GET'} {parts.path or '/'} HTTP/1.1",
            f"Host: {parts.netloc}",
            "Connection: close",
            "Accept: text/event-stream, application/json",
        ]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
        if api_key:
            head.append(f"Authorization: Bearer {api_key}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status, headers = await _read_head(reader)
        if status != 200 or not headers.get("content-type", "").startswith("text/event-stream"):
            whole = b"".join([p async for p in _body_pieces(reader, headers)])
            yield status, whole.decode("utf-8", "replace")
            return
        buffer = b""
        async for piece in _body_pieces(reader, headers):
            buffer += piece
            # events end with a blank line; a piece may hold several or part of one
            *events, buffer = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        data = line[5:].strip()
                        yield status, "[DONE]" if data == b"[DONE]" else json.loads(data)
    finally:
        writer.close()


async def get_json(url: str, api_key: str | None = None) -> tuple[int, Any]:
    async for status, answer in request(url, api_key=api_key):
        try:
            return status, json.loads(answer) if isinstance(answer, str) else answer
        except json.JSONDecodeError:
            return status, answer
    raise ConnectionError(f"no answer from {url}")
