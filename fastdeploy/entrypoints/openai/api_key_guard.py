"""ASGI middleware that refuses /v1 requests without the server's API key."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from fastdeploy.entrypoints.openai.errors import APIError


class APIKeyGuard:
    """Answers 401 to an HTTP request under /v1 whose `Authorization` header is not
    `Bearer <api_key>`, before anything reads its body.

    Plain ASGI rather than Starlette's `BaseHTTPMiddleware`: that one relays a streamed
    response through a task and a zero-buffer channel, so a client that goes away while a
    chunk waits in the channel leaves the stream's generator (and its engine request) running.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            response = APIError(401, "invalid or missing API key", "authentication_error", None,
                                "invalid_api_key").response()
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(header, self.expected)
