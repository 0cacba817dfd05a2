"""A streamed response's generator is closed (its `finally` runs) however the response ends."""

from __future__ import annotations

import asyncio

import pytest

from fastdeploy.entrypoints.openai.streamed_response import StreamedResponse

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
