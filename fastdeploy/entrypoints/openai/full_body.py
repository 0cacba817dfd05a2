"""The body of a non-streaming answer: its layout, written whole once every choice has finished,
or, when its bitmap masks are large, while the choices still run.

An answer with bitmap masks is megabytes (6.5 MB for 256 tokens at a 7B vocabulary), and an RL
batch's requests end together: written at the end, every client waits for its body behind the
others' while the GPU idles. So once the first choice's bitmaps fill a block
(`formatting.MASK_BLOCK_BYTES` of JSON), the status line goes out and the body follows the
generation: the choices in order, each one's bitmap array block by block as it fills, its other
fields (text, logprobs, finish reason) when it finishes, then usage. The JSON is the same as the
whole body's but for the order of keys (`sampling_mask` comes first in its choice).

A failure after that point cannot change the status: the body is cut short (the connection is
closed without the body's end) and the error is logged. Before it, and in every answer without a
full block of bitmaps, a failed choice is an error status as usual.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from fastdeploy.entrypoints.openai.errors import APIError
from fastdeploy.entrypoints.openai.formatting import ServedChoice, encode_json
from fastdeploy.entrypoints.openai.streamed_response import BodyCut

# One choice's JSON object, `splices` as in `formatting.extra_fields` (None: no splices).
ChoiceRenderer = Callable[[int, ServedChoice, list[list[bytes]] | None], dict]


@dataclass
class BodyLayout:
    """How an endpoint lays out its answer: `envelope` holds the fields before "choices" (id,
    object, created, model), `render_choice` one choice, `render_tail` the fields after
    "choices" (usage, ...) from the finished choices."""

    envelope: dict
    render_choice: ChoiceRenderer
    render_tail: Callable[[list[ServedChoice]], dict]

    def body(self, choices: list[ServedChoice], splices: list[list[bytes]] | None) -> dict:
        return {**self.envelope, "choices": [self.render_choice(i, c, splices) for i, c in enumerate(choices)],
                **self.render_tail(choices)}


class ProgressiveBody:
    """Writes a layout's JSON while its choices run. `events` yields the rest of their chunks
    (`ChoiceEvent`s; each choice already holds what came before), `failure` turns a failed choice
    into its error."""

    def __init__(self, layout: BodyLayout, choices: list[ServedChoice], events: AsyncIterator,
                 failure: Callable[[ServedChoice], APIError]) -> None:
        self.layout = layout
        self.choices = choices
        self.events = events
        self.failure = failure
        self._turn = 0  # the choice being written: every one before it is written whole
        self._opened = False  # the turn's choice has its head and bitmap array started

    async def parts(self) -> AsyncGenerator[bytes, None]:
        envelope = encode_json(self.layout.envelope)
        yield envelope[:-1] + b',"choices":['  # the envelope is never empty
        for part in self._ready():
            yield part
        try:
            async for event in self.events:
                choice = self.choices[event.index]
                choice.add(event.chunk)
                if choice.finish_reason == "error":
                    raise self.failure(choice)
                for part in self._ready():
                    yield part
        except APIError as exc:
            raise BodyCut(f"{exc.status} {exc.message}") from exc
        if self._turn < len(self.choices):
            raise BodyCut("the choices stopped before they finished")
        tail = encode_json(self.layout.render_tail(self.choices))
        yield b"]," + tail[1:]  # the tail holds usage at least

    def _ready(self) -> list[bytes]:
        """What can be written now, in order: the turn's bitmap blocks, and each finished choice's
        other fields, moving the turn on."""
        parts: list[bytes] = []
        while self._turn < len(self.choices):
            choice = self.choices[self._turn]
            done = choice.finish_reason is not None
            comma = b"," if self._turn else b""
            if not self._opened and choice.bitmaps:
                parts.append(comma + b'{"index":%d,"sampling_mask":' % self._turn)
                self._opened = True
            if self._opened:
                parts += choice.take_mask_json(final=done)
            if not done:
                break
            fields = self.layout.render_choice(self._turn, choice, None)
            if self._opened:
                del fields["index"]  # written with the head; the array is out, so no sampling_mask
                parts.append(b"," + encode_json(fields)[1:])
            else:  # a choice without bitmaps (it drew no token): written whole
                parts.append(comma + encode_json(fields))
            self._turn += 1
            self._opened = False
        return parts
