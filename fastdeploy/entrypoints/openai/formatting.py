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

from fastdeploy.common.sampling_masks import SampledMasks, SamplingBitmaps
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
    all at the end stalls the server's event loop just when the next requests arrive."""

    def __init__(self, index: int) -> None:
        super().__init__(index=index)
        self.bitmaps = False  # the choice's masks are bitmaps (then kept only as `bitmap_items`)
        self.bitmap_items: list[bytes] = []

    def _keep_masks(self, masks: SampledMasks) -> None:
        if isinstance(masks, SamplingBitmaps):
            self.bitmaps = True
            if len(masks):
                self.bitmap_items.append(bitmap_items(masks))
        else:
            super()._keep_masks(masks)


def extra_fields(chunk_or_choice: CompletionOutput | OutputChunk, return_token_ids: bool) -> dict:
    """The fields OpenAI does not have: sampling masks and token ids."""
    extra: dict[str, Any] = {}
    if isinstance(chunk_or_choice, ServedChoice) and chunk_or_choice.bitmaps:
        extra["sampling_mask"] = orjson.Fragment(b"[" + b",".join(chunk_or_choice.bitmap_items) + b"]")
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
    return orjson.Fragment(b"[" + bitmap_items(bitmaps) + b"]")


def bitmap_items(bitmaps: SamplingBitmaps) -> bytes:
    """A run's bitmaps as JSON array items without the brackets: `"<base64>"` or `null` per
    token, comma-separated.

    pybase64 (SIMD) encodes about 8x faster than binascii, which took 45 µs of the 100 µs a
    152k-vocabulary token cost the server. When every row is a bitmap and a row is a whole
    number of 3-byte groups, the run is encoded in one call and numpy puts the quotes and
    commas between the rows' equal-length strings."""
    present = np.frombuffer(bitmaps.present, np.uint8)
    width = bitmaps.width
    if len(present) and present.all() and width % 3 == 0:
        encoded = np.frombuffer(pybase64.b64encode(bitmaps.bits), np.uint8).reshape(len(present), -1)
        rows = np.empty((len(present), encoded.shape[1] + 3), np.uint8)
        rows[:, 0] = rows[:, -2] = ord('"')
        rows[:, 1:-2] = encoded
        rows[:, -1] = ord(",")
        return rows.tobytes()[:-1]
    bits = memoryview(bitmaps.bits)
    items = []
    start = 0
    for flag in present.tolist():
        if flag:
            items.append(b'"' + pybase64.b64encode(bits[start:start + width]) + b'"')
            start += width
        else:
            items.append(b"null")
    return b",".join(items)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def encode_json(payload: dict) -> bytes:
    return orjson.dumps(payload, option=_JSON_OPTIONS)


def json_response(payload: dict, status_code: int = 200) -> Response:
    return Response(encode_json(payload), status_code=status_code, media_type="application/json")


def sse(payload: dict | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else encode_json(payload)
    return b"data: " + data + b"\n\n"
