"""The streamed (server-sent events) response, closed however it ends."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that closes its generator when the response ends.

    Starlette stops iterating a stream when the client goes away or a write to it fails, but
    does not close the generator. One left suspended at a `yield` runs its `finally` (which
    aborts the engine requests and frees their KV blocks) only when the garbage collector
    reaches it: seconds or minutes of generating for nobody.
    """

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Shielded: the response often ends because its task was cancelled, and the
            # generator's clean-up awaits.
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
