"""A body sent while it is produced (server-sent events, or a JSON answer written as its
request runs), its producer closed however the response ends."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)


class BodyCut(Exception):
    """The producer cannot finish a body whose status line is sent already: the connection is
    closed without the body's end, which every HTTP client reports as an incomplete response."""


class StreamedResponse(StreamingResponse):
    """A streamed response that closes its generator when the response ends.

    Starlette stops iterating a stream when the client goes away or a write to it fails, but
    does not close the generator. One left suspended at a `yield` runs its `finally` (which
    aborts the engine requests and frees their KV blocks) only when the garbage collector
    reaches it: seconds or minutes of generating for nobody.
    """

    def __init__(self, parts: AsyncGenerator[bytes, None], media_type: str = "text/event-stream") -> None:
        super().__init__(parts, media_type=media_type)
        self._parts = parts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except BodyCut as exc:
            # Returning without the last body message makes the HTTP server close the connection.
            logger.error("response body cut short: %s", exc)
        finally:
            # Shielded: the response often ends because its task was cancelled, and the
            # generator's clean-up awaits.
            with anyio.CancelScope(shield=True):
                await self._parts.aclose()
