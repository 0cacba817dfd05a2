"""Running totals of speculative decoding, kept by the engine and shown in /metrics."""

from __future__ import annotations

import msgspec

from fastdeploy.common.step_input import WorkerEvents


class SpecDecodeStats(msgspec.Struct, array_like=True):
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_draft_tokens: int = 0  # drafts accepted
    num_verified_sequences: int = 0  # sequence-steps that verified at least one draft
    # Steps (their frames read), and of those: sent ahead of the frame before them, holding a
    # prefill chunk, verifying drafts. Where a busy server's time goes with speculation on: a
    # step with drafts or a prefill may have to go in turn, which a step without either need not.
    num_steps: int = 0
    num_steps_ahead: int = 0
    num_steps_with_prefill: int = 0
    num_verify_steps: int = 0

    def add(self, events: WorkerEvents, sent_ahead: bool, with_prefill: bool) -> None:
        """One step's frame: its drafts (`events`) and how it ran."""
        self.num_draft_tokens += events.num_draft_tokens
        self.num_accepted_draft_tokens += events.num_accepted_draft_tokens
        self.num_verified_sequences += events.num_verified_sequences
        self.num_steps += 1
        self.num_steps_ahead += sent_ahead
        self.num_steps_with_prefill += with_prefill
        self.num_verify_steps += events.num_verified_sequences > 0

    @staticmethod
    def total(parts: list[SpecDecodeStats | None]) -> SpecDecodeStats:
        """The sum of several engines' (or one replica's successive engines') totals."""
        out = SpecDecodeStats()
        for part in parts:
            if part is not None:
                for name in out.__struct_fields__:
                    setattr(out, name, getattr(out, name) + getattr(part, name))
        return out

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / max(1, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per sequence per verifying step: accepted drafts + the one sampled token."""
        return 1.0 + self.num_accepted_draft_tokens / max(1, self.num_verified_sequences)
