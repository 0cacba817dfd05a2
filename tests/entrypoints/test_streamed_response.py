"""A streamed response's generator is closed (its `finally` runs) however the response ends; a
stream the engine refuses at its first step is an error status, not a 200 holding the error."""

from __future__ import annotations

import asyncio

import pytest

from fastdeploy.entrypoints.openai.errors import APIError
from fastdeploy.entrypoints.openai.serving_engine import ChoiceEvent, OpenAIServing
from fastdeploy.entrypoints.openai.streamed_response import StreamedResponse
from fastdeploy.output.output_processor import OutputChunk

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}


async def events(closed: list[str]):
    try:
        for i in range(1000):
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0)
    finally:
        await asyncio.sleep(0)  # clean-up that awaits, as aborting an engine request does
        closed.append("closed")


async def never_disconnects() -> dict:
    await asyncio.Event().wait()
    return {}


def test_a_failed_write_closes_the_generator():
    """The client went away: a write fails (uvicorn raises an OSError) with the generator at a yield."""
    closed: list[str] = []
    writes = 0

    async def send(message: dict) -> None:
        nonlocal writes
        writes += 1
        if writes == 3:
            raise ConnectionResetError("client gone")

    async def main() -> None:
        stream = events(closed)  # held here, so only the response can close it
        with pytest.raises(OSError):
            await StreamedResponse(stream)(SCOPE, never_disconnects, send)
        assert closed == ["closed"]  # before the event loop's shutdown closes what is left

    asyncio.run(main())


def test_a_write_cancelled_while_blocked_closes_the_generator():
    """The response task is cancelled while a write waits (a client that stopped reading)."""
    closed: list[str] = []
    blocked = asyncio.Event()

    async def send(message: dict) -> None:
        if message.get("body"):
            blocked.set()
            await asyncio.Event().wait()

    async def main() -> None:
        stream = events(closed)
        task = asyncio.create_task(StreamedResponse(stream)(SCOPE, never_disconnects, send))
        await asyncio.wait_for(blocked.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert closed == ["closed"]

    asyncio.run(main())


def chunk(text: str, finish_reason: str | None = None, error: str | None = None, status: int = 200) -> OutputChunk:
    return OutputChunk(text, [1] if text else [], None, None, None, finish_reason, None, error, status, 3)


class FakeServing(OpenAIServing):
    """The shared serving code over a scripted engine: `run_choices` yields `script`'s chunks."""

    def __init__(self, script: list[OutputChunk]) -> None:
        self.script = script
        self.closed = False
        self.client = type("Client", (), {"healthy": True})()

    async def run_choices(self, requests):
        try:
            for c in self.script:
                await asyncio.sleep(0)
                yield ChoiceEvent(0, c)
        finally:
            self.closed = True


class Connected:
    async def is_disconnected(self) -> bool:
        return False


def test_a_stream_refused_at_its_first_step_is_an_error_status():
    """A constraint no token can start fails the first step: a 400 before any header (it was a 200
    whose stream held only an error event), the engine requests closed."""
    serving = FakeServing([chunk("", "error", "no token of the model's vocabulary can continue", 400)])

    async def main() -> None:
        with pytest.raises(APIError) as caught:
            await serving.started_choices([], Connected())
        assert caught.value.status == 400 and "no token" in caught.value.message
        assert serving.closed

    asyncio.run(main())


def test_a_started_stream_yields_every_event_and_fails_later_ones_in_the_stream():
    serving = FakeServing([chunk("a"), chunk("b"), chunk("", "error", "worker failed", 500)])

    async def main() -> list[bytes]:
        events = await serving.started_choices([], Connected())
        lines = [line async for line in serving.sse_events(
            events, lambda e: {"text": e.chunk.text}, lambda choices, **extra: {"choices": choices, **extra}, 3, True)]
        assert serving.closed
        return lines

    lines = asyncio.run(main())
    assert lines[:2] == [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n']
    assert b'"worker failed"' in lines[2] and lines[3] == b"data: [DONE]\n\n" and len(lines) == 4
