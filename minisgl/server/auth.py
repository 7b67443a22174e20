"""API keys: with `--api-key` (or MINISGL_API_KEY) every route but /health needs
`Authorization: Bearer KEY`; any other request is answered 401 in OpenAI's error shape before its body
is read. /health stays open so that a load balancer or a container probe needs no secret.
"""

from __future__ import annotations

import hmac
from typing import Any

from minisgl.server.guard import send_error
from minisgl.server.protocol import APIError

_OPEN_PATHS = frozenset({"/health"})


class ApiKeyGuard:
    """ASGI middleware that refuses a request without the server's key."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        error = APIError(
            "a valid API key is needed: send the header `Authorization: Bearer <key>` with the key the "
            "server was started with (--api-key)",
            None,
            "invalid_api_key",
            401,
        )
        await send_error(send, error)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
                break
        # constant time: how long the comparison takes says nothing about how much of the key matched
        return hmac.compare_digest(given, self._key)
