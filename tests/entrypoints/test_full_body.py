"""A non-streaming answer written while its choices run holds the same JSON as the whole body,
goes out as the choices' bitmap blocks fill, and is cut short (never completed) on a failure."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import orjson
import pytest

from fastdeploy.common.sampling_masks import bitmap_rows
from fastdeploy.entrypoints.openai import formatting
from fastdeploy.entrypoints.openai.errors import APIError
from fastdeploy.entrypoints.openai.formatting import ServedChoice, extra_fields, json_response, usage
from fastdeploy.entrypoints.openai.full_body import BodyLayout, ProgressiveBody
from fastdeploy.entrypoints.openai.serving_engine import ChoiceEvent
from fastdeploy.entrypoints.openai.streamed_response import BodyCut, StreamedResponse
from fastdeploy.output.output_processor import OutputChunk
from tests.bitmaps import bitmap_array

VOCAB = 152064
SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}


def layout() -> BodyLayout:
    def render_choice(i: int, c: ServedChoice, splices) -> dict:
        return {"index": i, "text": c.text, "finish_reason": c.finish_reason, **extra_fields(c, True, splices)}

    def render_tail(choices: list[ServedChoice]) -> dict:
        return {"usage": usage(3, sum(len(c.token_ids) for c in choices))}

    return BodyLayout({"id": "cmpl-1", "object": "text_completion", "model": "m"}, render_choice, render_tail)


def chunks(rng: np.random.Generator, n_tokens: int, finish: str = "length") -> list[OutputChunk]:
    """One choice's chunks of 1 to 3 tokens, a null row among them, the last one finishing."""
    out = []
    start = 0
    while start < n_tokens:
        size = min(int(rng.integers(1, 4)), n_tokens - start)
        lists = [sorted(rng.choice(VOCAB, 40, replace=False).tolist()) for _ in range(size)]
        if start == 2:
            lists[0] = None
        done = start + size == n_tokens
        out.append(OutputChunk(f"t{start}", list(range(start, start + size)), None,
                               bitmap_rows(bitmap_array(lists, VOCAB)), [-0.5] * size,
                               finish if done else None, None, None, 500, 3))
        start += size
    return out


def interleaved(per_choice: list[list[OutputChunk]], order: list[int]) -> list[ChoiceEvent]:
    """The choices' chunks in one stream, taking the next chunk of choice `order[k % len(order)]`."""
    pending = [list(c) for c in per_choice]
    events = []
    k = 0
    while any(pending):
        index = order[k % len(order)]
        k += 1
        if pending[index]:
            events.append(ChoiceEvent(index, pending[index].pop(0)))
    return events


async def feed(events: list[ChoiceEvent], sent: list[int]):
    for event in events:
        sent.append(event.index)
        yield event
        await asyncio.sleep(0)


def whole_body(per_choice: list[list[OutputChunk]]) -> dict:
    choices = [ServedChoice(i) for i in range(len(per_choice))]
    for choice, chunk_list in zip(choices, per_choice, strict=True):
        for chunk in chunk_list:
            choice.add(chunk)
    splices: list[list[bytes]] = []
    response = json_response(layout().body(choices, splices), splices=splices)
    return orjson.loads(b"".join(response.parts))


def run_progressive(events: list[ChoiceEvent], n: int, head: int) -> tuple[list[bytes], list[int]]:
    """The first `head` events go to the choices before the body starts (as `full_response`
    does until the first block fills); returns the parts and, per part, how many events were
    read when it went out."""
    choices = [ServedChoice(i) for i in range(n)]
    for event in events[:head]:
        choices[event.index].add(event.chunk)
    sent: list[int] = []

    async def main() -> tuple[list[bytes], list[int]]:
        body = ProgressiveBody(layout(), choices, feed(events[head:], sent), lambda c: APIError(500, c.error or ""))
        parts, read = [], []
        async for part in body.parts():
            parts.append(part)
            read.append(head + len(sent))
        return parts, read

    return asyncio.run(main())


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 1, 0, 2]])
def test_the_progressive_body_is_the_whole_body(monkeypatch, order):
    monkeypatch.setattr(formatting, "MASK_BLOCK_BYTES", 60_000)  # about three tokens a block
    rng = np.random.default_rng(len(order))
    per_choice = [chunks(rng, n) for n in (14, 9, 17)]
    events = interleaved(per_choice, order)
    parts, read = run_progressive(events, 3, head=4)
    assert orjson.loads(b"".join(parts)) == whole_body(per_choice)
    # Choice 0's blocks went out before its last chunk arrived, not all at the end.
    last_of_choice0 = max(k for k, e in enumerate(events) if e.index == 0)
    assert sum(len(p) for p, r in zip(parts, read, strict=True) if r <= last_of_choice0) > 200_000


def test_a_choice_without_tokens_is_written_whole(monkeypatch):
    monkeypatch.setattr(formatting, "MASK_BLOCK_BYTES", 60_000)
    rng = np.random.default_rng(5)
    per_choice = [chunks(rng, 12), [OutputChunk("", [], None, None, None, "abort", None, None, 500, 3)]]
    events = interleaved(per_choice, [0, 1])
    parts, _ = run_progressive(events, 2, head=1)
    body = orjson.loads(b"".join(parts))
    assert body == whole_body(per_choice)
    assert "sampling_mask" not in body["choices"][1] and body["choices"][1]["finish_reason"] == "abort"


def test_a_failure_after_the_status_cuts_the_body(monkeypatch, caplog):
    """A choice that fails once the body is going out: the response never sends its last body
    message (so the server closes the connection mid-body), logs why, and closes the events."""
    monkeypatch.setattr(formatting, "MASK_BLOCK_BYTES", 60_000)
    rng = np.random.default_rng(7)
    good = chunks(rng, 12)
    failed = OutputChunk("", [], None, None, None, "error", None, "worker fault", 500, 3)
    events = [ChoiceEvent(0, c) for c in good[:-1]] + [ChoiceEvent(1, failed), ChoiceEvent(0, good[-1])]
    choices = [ServedChoice(0), ServedChoice(1)]
    closed: list[str] = []

    async def source():
        try:
            for event in events[1:]:
                yield event
        finally:
            closed.append("closed")

    choices[0].add(events[0].chunk)
    messages: list[dict] = []

    async def send(message: dict) -> None:
        messages.append(message)

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}

    async def main() -> None:
        body = ProgressiveBody(layout(), choices, source(), lambda c: APIError(c.error_status, c.error or ""))
        await StreamedResponse(body.parts(), media_type="application/json")(SCOPE, receive, send)

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    assert len(b"".join(m.get("body", b"") for m in messages)) > 100_000  # blocks went out first
    assert all(m.get("more_body", True) for m in messages[1:])  # never completed
    assert "500 worker fault" in caplog.text
    assert closed == ["closed"]


def test_body_cut_propagates_from_the_parts():
    choices = [ServedChoice(0)]

    async def nothing():
        return
        yield

    async def main() -> None:
        body = ProgressiveBody(layout(), choices, nothing(), lambda c: APIError(500, ""))
        async for _ in body.parts():
            pass

    with pytest.raises(BodyCut, match="stopped before they finished"):
        asyncio.run(main())
