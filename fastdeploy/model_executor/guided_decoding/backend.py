"""The one interface both grammar backends (xgrammar, llguidance) implement.

A backend turns a GuidedSpec into a `CompiledGrammar` (slow, done once per spec in the
compile service's threads, cached), and a compiled grammar hands out one `TokenMatcher`
per constrained sequence (cheap). Everything above this interface (the async compile,
the cache, the batch bitmask, reasoning, speculative drafts) is shared.

Bitmask layout, the same for both: int32 [B, ceil(V / 32)], bit v % 32 of word v // 32
set = token v allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fastdeploy.common.guided_spec import GuidedSpec

__all__ = ["CompiledGrammar", "GrammarBackend", "TokenMatcher", "allow_only"]


class TokenMatcher(Protocol):
    """A sequence's position in its grammar. A rejected token leaves it unchanged."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Allowed next tokens into bitmask[row]; only stop tokens once terminated."""

    def accept(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def reset(self) -> None: ...

    def is_terminated(self) -> bool:
        """A stop token was accepted after a complete match."""

    def is_completed(self) -> bool:
        """The text so far is a complete match: a stop token would be accepted now."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar ready for matching; shared by every sequence with the same spec."""

    backend: GrammarBackend
    spec: GuidedSpec
    handle: Any  # the backend's own object (xgrammar.CompiledGrammar, llguidance grammar)
    memory_bytes: int  # what the compile cache charges for keeping it

    def matcher(self) -> TokenMatcher:
        return self.backend.matcher(self)


class GrammarBackend(Protocol):
    name: str
    vocab_size: int  # the model's logits width; bitmask rows cover it
    stop_token_ids: list[int]

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """Compile synchronously. Raises ValueError / RuntimeError for a spec it cannot compile."""

    def matcher(self, compiled: CompiledGrammar) -> TokenMatcher: ...

    def fill_rows(self, matchers: list[TokenMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """`matchers[i].fill_bitmask(bitmask, rows[i])` for every i (matchers of this backend),
        in one call where the backend can."""


def _bit(i: int) -> int:
    """Bit i of an int32 word as a signed int32 value (bit 31 is the sign bit)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def allow_only(bitmask: torch.Tensor, row: int, token_ids: list[int]) -> None:
    """bitmask[row] allows exactly `token_ids` (a terminated grammar allows its stop tokens,
    so a row still in the batch for one more step samples a harmless eos)."""
    bitmask[row].zero_()
    for t in token_ids:
        bitmask[row, t // 32] |= _bit(t % 32)
