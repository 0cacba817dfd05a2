"""Running totals of speculative decoding, kept by the engine and shown in /metrics."""

from __future__ import annotations

import msgspec

from fastdeploy.common.step_input import WorkerEvents


class SpecDecodeStats(msgspec.Struct, array_like=True):
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_draft_tokens: int = 0  # drafts accepted
    num_verified_sequences: int = 0  # sequence-steps that verified at least one draft

    def add(self, events: WorkerEvents) -> None:
        self.num_draft_tokens += events.num_draft_tokens
        self.num_accepted_draft_tokens += events.num_accepted_draft_tokens
        self.num_verified_sequences += events.num_verified_sequences

    @staticmethod
    def total(parts: list[SpecDecodeStats | None]) -> SpecDecodeStats:
        """The sum of several engines' (or one replica's successive engines') totals."""
        out = SpecDecodeStats()
        for part in parts:
            if part is not None:
                out.num_draft_tokens += part.num_draft_tokens
                out.num_accepted_draft_tokens += part.num_accepted_draft_tokens
                out.num_verified_sequences += part.num_verified_sequences
        return out

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / max(1, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per sequence per verifying step: accepted drafts + the one sampled token."""
        return 1.0 + self.num_accepted_draft_tokens / max(1, self.num_verified_sequences)
