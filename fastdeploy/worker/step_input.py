"""What the engine sends the worker each step (msgpack structs)."""

from __future__ import annotations

import msgspec

from fastdeploy.engine.sampling_params import SamplingParams


class NewSequence(msgspec.Struct, array_like=True):
    """Sent once, the first step a sequence is scheduled; the worker keeps it until freed."""

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    return_sampling_mask: bool


class ChunkInput(msgspec.Struct, array_like=True):
    seq_id: int
    token_ids: list[int]  # the tokens to compute this step
    start: int  # position of token_ids[0]
    block_ids: list[int]  # the sequence's whole block table
    sample: bool  # whether this chunk ends at the sequence's last known token


class StepInput(msgspec.Struct, array_like=True):
    message_id: int
    new_sequences: list[NewSequence]
    chunks: list[ChunkInput]  # decode chunks (one token) first, then prefill chunks
    freed_seq_ids: list[int]  # finished or aborted: drop worker state
