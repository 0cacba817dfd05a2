"""Messages between the API server and the engine (msgpack structs, no pickle)."""

from __future__ import annotations

import msgspec

from fastdeploy.common.limits import EngineLimits
from fastdeploy.common.sampling_masks import ByteBuffer, SamplingBitmaps, SamplingMasks
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.common.spec_decode_stats import SpecDecodeStats


class EngineRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence to generate; `n > 1` is fanned out into several of these by the caller."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0


class AbortRequests(msgspec.Struct, array_like=True, tag=True):
    request_ids: list[str]


class AddRequest(msgspec.Struct, array_like=True, tag=True):
    request: EngineRequest
    client: str  # the identity of the API process's output socket: its deltas go there


EngineInput = AddRequest | AbortRequests


class ClientHello(msgspec.Struct, array_like=True, tag=True):
    """An API process's first message to an engine, on the output socket: the engine answers it
    with `EngineReady` (or `EngineDead`) and from then on sends it its requests' outputs."""

    client: str


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one engine step produced for one request.

    Per-token lists are aligned with `token_ids`. `top_logprob_ids[i][0]` is the
    sampled token; the rest are the top-k. `sampling_mask` holds one row per
    token: CSR ids, or bitmaps when the request asked for them.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[list[float]] | None = None
    logprob_token_ids: list[list[int]] | None = None
    ranks: list[int] | None = None
    sampling_mask: SamplingMasks | SamplingBitmaps | None = None
    # float32 LE [len(token_ids)]: each token's logZ, a byte buffer like the masks' (see
    # fastdeploy/common/sampling_masks.py; `logz_values` gives the floats).
    logz: ByteBuffer | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    error: str | None = None
    # HTTP status the error maps to: 400 for the request's own fault (a grammar that
    # fails to compile), 500 otherwise.
    error_status: int = 500
    num_prompt_tokens: int = 0


class EngineOutputs(msgspec.Struct, array_like=True, tag=True):
    """All deltas of one engine step, sent as one message."""

    deltas: list[RequestDelta]
    # Engine gauges piggy-backed for /metrics.
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    spec_decode: SpecDecodeStats | None = None  # totals since start; None without speculative decoding
    # Prefix caching, tokens since start: looked up at admission, and found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class EngineReady(msgspec.Struct, array_like=True, tag=True):
    """First message from the engine process: the model is loaded and these are its limits."""

    limits: EngineLimits
    worker_pid: int


class EngineDead(msgspec.Struct, array_like=True, tag=True):
    """Last message from an engine process that cannot go on (worker died, failed start)."""

    message: str


EngineMessage = EngineReady | EngineOutputs | EngineDead
