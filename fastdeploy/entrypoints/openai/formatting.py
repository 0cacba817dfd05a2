"""OpenAI JSON shapes for choices, logprobs, sampling masks and usage, and their encoding.

Bodies are encoded by orjson: a sampling mask's id rows go in as numpy views of the CSR,
which orjson writes in C, so no Python int is made per kept id (a token's set can hold
100,000 of them); bitmap rows go in as one pre-encoded JSON array (`orjson.Fragment`) of
base64 strings, built from the bytes without a Python str per token.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pybase64
from fastapi.responses import Response

from fastdeploy.common.sampling_masks import SampledMasks, SamplingBitmaps, byte_view
from fastdeploy.output.output_processor import CompletionOutput, OutputChunk, TokenLogprob

# JSON has no -Infinity: a logprob of -inf (a token outside the kept set, processed logprobs)
# is written as this floor, as vLLM does.
LOGPROB_FLOOR = -9999.0
_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def _logprob(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": _logprob(e.logprob),
                "bytes": e.bytes,
                "top_logprobs": [{"token": t.token, "logprob": _logprob(t.logprob), "bytes": t.bytes}
                                 for t in e.top_logprobs],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: list[TokenLogprob], text_offset: int) -> dict:
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [_logprob(e.logprob) for e in entries],
        "top_logprobs": [{t.token: _logprob(t.logprob) for t in e.top_logprobs} for e in entries],
        "text_offset": offsets,
    }


class ServedChoice(CompletionOutput):
    """A choice of a non-streaming response. Bitmap masks become their JSON items as each chunk
    arrives, while the request still runs: at a 7B vocabulary a 256-token answer's bitmaps are
    6.5 MB of base64, and the requests of an RL batch tend to end together, so encoding them
    all at the end stalls the server's event loop just when the next requests arrive.

    The items are kept as pieces (a token's base64 and the quotes and commas around it), joined
    into blocks of about `MASK_BLOCK_BYTES` as they fill: a token costs one base64 encoding and
    one copy into its block, and the finished array is the blocks as they are, which the
    response writes one after the other (`json_response`'s splices) without joining them. A
    body written while the request runs (`full_body.ProgressiveBody`) takes the blocks as they
    fill instead (`take_mask_json`), so the choice keeps none of them."""

    def __init__(self, index: int) -> None:
        super().__init__(index=index)
        self.bitmaps = False  # the choice's masks are bitmaps (then kept only as JSON pieces)
        self.mask_sent = False  # the whole array went out through `take_mask_json`
        self._mask_opened = False  # its "[" went out
        self._mask_blocks: list[bytes] = []
        self._mask_pieces: list[bytes | memoryview] = []  # not yet in a block
        self._mask_pending = 0  # bytes in `_mask_pieces`
        self._mask_items = 0

    def _keep_masks(self, masks: SampledMasks) -> None:
        if not isinstance(masks, SamplingBitmaps):
            super()._keep_masks(masks)
            return
        self.bitmaps = True
        if not len(masks):
            return
        self._mask_pending += bitmap_pieces(masks, self._mask_pieces, first=self._mask_items == 0)
        self._mask_items += len(masks)
        if self._mask_pending >= MASK_BLOCK_BYTES:
            self._close_block()

    def has_mask_block(self) -> bool:
        """A block of the bitmaps' JSON is full."""
        return bool(self._mask_blocks)

    def take_mask_json(self, final: bool) -> list[bytes]:
        """The bitmaps' JSON array from where the last call stopped: its full blocks ("[" before
        the first), and with `final` (the choice has finished) the rest and "]"."""
        parts = [] if self._mask_opened else [b"["]
        self._mask_opened = True
        if final:
            self._close_block()
        parts += self._mask_blocks
        self._mask_blocks = []
        if final:
            parts.append(b"]")
            self.mask_sent = True
        return parts

    def mask_json_parts(self) -> list[bytes]:
        """The bitmaps' JSON array as consecutive pieces (their concatenation is the array)."""
        self._close_block()
        return [b"[", *self._mask_blocks, b"]"]

    def _close_block(self) -> None:
        if self._mask_pieces:
            self._mask_blocks.append(b"".join(self._mask_pieces))
            self._mask_pieces.clear()
            self._mask_pending = 0


# A marker orjson writes verbatim where a spliced value goes: a raw NUL byte, which orjson's
# own output never holds (it escapes control characters in strings).
_SPLICE_MARK = b"\x00"
_SPLICE = orjson.Fragment(_SPLICE_MARK)
MASK_BLOCK_BYTES = 1 << 20


def extra_fields(chunk_or_choice: CompletionOutput | OutputChunk, return_token_ids: bool,
                 splices: list[list[bytes]] | None = None) -> dict:
    """The fields OpenAI does not have: sampling masks and token ids.

    With `splices`, a served choice's bitmap array is not copied into the body: its pieces are
    appended there and the field holds a marker that `json_response(..., splices)` replaces.
    A choice whose array went out already (`ServedChoice.take_mask_json`) has no such field."""
    extra: dict[str, Any] = {}
    if isinstance(chunk_or_choice, ServedChoice) and chunk_or_choice.bitmaps:
        if not chunk_or_choice.mask_sent:
            parts = chunk_or_choice.mask_json_parts()
            if splices is None:
                extra["sampling_mask"] = orjson.Fragment(b"".join(parts))
            else:
                splices.append(parts)
                extra["sampling_mask"] = _SPLICE
        extra["sampling_logz"] = chunk_or_choice.sampling_logz
    elif (masks := chunk_or_choice.sampling_masks) is not None:
        extra["sampling_mask"] = bitmaps_json(masks) if isinstance(masks, SamplingBitmaps) else masks.id_rows()
        extra["sampling_logz"] = chunk_or_choice.sampling_logz
    if return_token_ids:
        extra["token_ids"] = chunk_or_choice.token_ids
    return extra


def bitmaps_json(bitmaps: SamplingBitmaps) -> orjson.Fragment:
    """The JSON array of a run's bitmaps: one standard padded base64 string per token, null for
    a null row."""
    pieces: list[bytes | memoryview] = [b"["]
    bitmap_pieces(bitmaps, pieces, first=True)
    pieces.append(b"]")
    return orjson.Fragment(b"".join(pieces))


def bitmap_pieces(bitmaps: SamplingBitmaps, pieces: list[bytes | memoryview], first: bool) -> int:
    """Append a run's JSON array items to `pieces` (a comma before each but the array's first
    item), as pieces to be joined once; returns the bytes appended.

    pybase64 (SIMD) encodes about 8x faster than binascii. When every row is a bitmap and a
    row is a whole number of 3-byte groups (152,064 ids: 19,008 bytes), the run is encoded in
    one call and its rows are views of the one string. A memoryview of a msgpack message
    (the API server's decoded delta) is encoded as it lies, without a copy."""
    present = np.frombuffer(bitmaps.present, np.uint8)
    width = bitmaps.width
    size = 0
    if len(present) and width % 3 == 0 and present.all():
        encoded = memoryview(pybase64.b64encode(byte_view(bitmaps.bits)))
        step = width // 3 * 4
        for start in range(0, len(encoded), step):
            pieces += (b'"' if first else b',"', encoded[start:start + step], b'"')
            first = False
        return len(encoded) + 3 * len(present)
    bits = byte_view(bitmaps.bits)
    start = 0
    for flag in present.tolist():
        if flag:
            row = pybase64.b64encode(bits[start:start + width])
            pieces += (b'"' if first else b',"', row, b'"')
            size += len(row) + 3
            start += width
        else:
            pieces.append(b"null" if first else b",null")
            size += 5
        first = False
    return size


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def encode_json(payload: dict) -> bytes:
    return orjson.dumps(payload, option=_JSON_OPTIONS)


def json_response(payload: dict, status_code: int = 200, splices: list[list[bytes]] | None = None) -> Response:
    """The JSON body of `payload`; with `splices` (from `extra_fields`), each marker in it is
    replaced by its pieces, in order, and the body is written part by part (`PartsResponse`)."""
    body = encode_json(payload)
    if not splices:
        return Response(body, status_code=status_code, media_type="application/json")
    between = body.split(_SPLICE_MARK)
    if len(between) != len(splices) + 1:
        raise ValueError(f"{len(splices)} splices for {len(between) - 1} markers")
    parts = [between[0]]
    for pieces, after in zip(splices, between[1:], strict=True):
        parts += pieces
        parts.append(after)
    return PartsResponse(parts, status_code=status_code, media_type="application/json")


class PartsResponse(Response):
    """A body sent as consecutive parts, never joined into one buffer: a non-streaming answer
    with bitmap masks is megabytes, the requests of a batch end together, and every copy of
    every answer would hold the event loop. Large parts are sent one ASGI message each, so
    the server waits for the socket to drain between them instead of buffering the whole
    body; small neighbours are merged (a message costs the HTTP layer a few microseconds)."""

    def __init__(self, parts: list[bytes], status_code: int = 200, media_type: str | None = None) -> None:
        self.parts = _merge_small(parts)
        super().__init__(None, status_code=status_code, media_type=media_type)
        self.headers["content-length"] = str(sum(len(p) for p in self.parts))

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.parts) - 1
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})


def _merge_small(parts: list[bytes], small: int = 64 << 10) -> list[bytes]:
    merged: list[bytes] = []
    run: list[bytes] = []
    for part in parts:
        if len(part) >= small:
            if run:
                merged.append(b"".join(run))
                run = []
            merged.append(part)
        else:
            run.append(part)
    if run or not merged:
        merged.append(b"".join(run))
    return merged


def sse(payload: dict | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else encode_json(payload)
    return b"data: " + data + b"\n\n"
