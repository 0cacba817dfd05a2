"""Engine-side state of one sequence."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.common.step_input import IN_FLIGHT_TOKEN


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int  # engine-unique integer key used in worker frames
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    return_sampling_mask: bool = False
    sampling_mask_bitmap: bool = False  # masks travel as bitmaps (sampling_mask_format "bitmap")
    # False while the worker compiles this sequence's grammar; it is not admitted until then.
    grammar_ready: bool = True
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    # Tokens whose K/V is in the cache; reset to 0 by a recompute preemption.
    num_computed_tokens: int = 0
    # Asynchronous scheduling: tokens a running step samples for this sequence that are not
    # known yet (0 or 1). The next step may compute them, as IN_FLIGHT_TOKEN.
    num_in_flight: int = 0
    # ... and the drafts that step verifies (MTP drafting on the device, steps sent ahead with
    # drafts): each may be accepted, so the next step's rows may sit that many positions further on.
    num_in_flight_drafts: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Prefix caching: the prefix hashes of this sequence's full blocks of known tokens
    # (`prefix_hash.py`), and how many of its blocks are registered in the cache.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens + self.num_in_flight - self.num_computed_tokens

    def tokens_left(self, max_model_len: int) -> int:
        """Tokens the sequence may still take after its known and in-flight ones (max_tokens,
        context length); at 0 the last one it may take is already known or in flight."""
        in_flight = self.num_in_flight + self.num_in_flight_drafts  # at most
        left = max_model_len - self.num_tokens - in_flight
        if self.params.max_tokens is not None:
            left = min(left, self.params.max_tokens - len(self.output_token_ids) - in_flight)
        return left

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids if self.output_token_ids else self.prompt_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1; positions past the known tokens are in flight."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len and end <= self.num_tokens:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        # Slices of each list, not of their concatenation: a decode chunk whose token is in flight
        # (every step under asynchronous scheduling) would copy the whole context per step.
        known = self.prompt_token_ids[start:end] + self.output_token_ids[max(0, start - prompt_len):end - prompt_len]
        return known + [IN_FLIGHT_TOKEN] * (end - start - len(known))
