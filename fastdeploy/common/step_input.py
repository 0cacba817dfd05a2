"""What the engine sends the worker each step (msgpack structs)."""

from __future__ import annotations

import msgspec

from fastdeploy.common.guided_spec import GuidedSpec
from fastdeploy.common.sampling_params import SamplingParams

# A chunk's token that the step before it is still sampling (asynchronous scheduling): the
# worker takes it from that step's sampler output on the device.
IN_FLIGHT_TOKEN = -1


class NewSequence(msgspec.Struct, array_like=True):
    """Sent once, the first step a sequence is scheduled; the worker keeps it until freed."""

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    return_sampling_mask: bool
    sampling_mask_bitmap: bool = False  # the kept sets go out as bitmaps


class ChunkInput(msgspec.Struct, array_like=True):
    seq_id: int
    token_ids: list[int]  # the tokens to compute this step; the last may be IN_FLIGHT_TOKEN
    start: int  # position of token_ids[0]
    block_ids: list[int]  # the sequence's whole block table
    sample: bool  # whether this chunk ends at the sequence's last known token
    num_lookahead: int = 0  # speculative decoding: KV slots reserved for up to this many drafts
    # The positions before `start` came from the prefix cache (the sequence's first chunk since
    # admission): the MTP module's first pair takes the stored hidden state of position start - 1.
    after_cache_hit: bool = False


class GrammarRequest(msgspec.Struct, array_like=True):
    """Sent when a constrained sequence arrives, before it is scheduled, so it compiles meanwhile."""

    seq_id: int
    spec: GuidedSpec


class StepInput(msgspec.Struct, array_like=True):
    message_id: int
    new_sequences: list[NewSequence]
    chunks: list[ChunkInput]  # decode chunks (one token) first, then prefill chunks
    freed_seq_ids: list[int]  # finished or aborted: drop worker state
    grammar_requests: list[GrammarRequest] = []
    # Speculative decoding: the most drafts a sequence gets in the step after this one (-1: the
    # configured number). A draft model drafting after this step drafts no more than that.
    next_draft_cap: int = -1
    # Asynchronous scheduling: the engine sends the next step before it waits for this one's
    # frame, so the worker launches that one first and the device never waits for the engine.
    followed: bool = False


class WorkerEvents(msgspec.Struct, array_like=True):
    """Per-step news that is not a token: travels as the second part of the step's reply."""

    grammar_ready: list[int] = []
    grammar_failed: list[list] = []  # [seq_id, message]
    grammar_terminated: list[int] = []  # the grammar is complete: finish with "stop"
    seq_errors: list[list] = []  # [seq_id, message]: fail that sequence only
    # Speculative decoding this step: draft tokens verified, and how many of them were accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_verified_sequences: int = 0  # sequences that verified at least one draft

    def __bool__(self) -> bool:
        return bool(self.grammar_ready or self.grammar_failed or self.grammar_terminated or self.seq_errors)
