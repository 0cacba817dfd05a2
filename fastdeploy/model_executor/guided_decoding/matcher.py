"""Per-request grammar state and the batch bitmask the sampler applies."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

__all__ = ["GuidedState", "fill_bitmasks"]


def _bit(i: int) -> int:
    """Bit i of an int32 word as a signed int32 value (bit 31 is the sign bit)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


class GuidedState:
    """One constrained request's position in its grammar (wraps xgrammar.GrammarMatcher).

    Not thread-safe; a state is touched by one thread at a time (the bitmask filler or the
    step loop), never both.
    """

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        *,
        max_rollback_tokens: int = -1,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        """
        max_rollback_tokens: how far `rollback` may go (speculative decoding rolls back
            rejected drafts). xgrammar 0.2.8 ignores it: rollback is always unlimited.
        stop_token_ids: override the tokens that complete the grammar (default: the
            TokenizerInfo's stop tokens, i.e. eos).
        """
        self.compiled = compiled
        self.max_rollback_tokens = max_rollback_tokens
        self._matcher = xgr.GrammarMatcher(
            compiled, override_stop_tokens=stop_token_ids, max_rollback_tokens=max_rollback_tokens
        )
        self.num_accepted = 0  # tokens accepted and not rolled back

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 [B, ceil(V/32)], CPU).

        A terminated state (xgrammar raises on it) allows only its stop tokens, so a row
        still in the batch for a step after termination samples a harmless eos.
        """
        if self._matcher.is_terminated():
            bitmask[row].zero_()
            for t in self._matcher.stop_token_ids:
                bitmask[row, t // 32] |= _bit(t % 32)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar rejects it."""
        ok = self._matcher.accept_token(int(token_id))
        if ok:
            self.num_accepted += 1
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Accept tokens in order until one is rejected; returns how many were accepted
        (a speculative draft's grammar-valid prefix)."""
        n = 0
        for t in token_ids:
            if not self.accept(t):
                break
            n += 1
        return n

    def accept_string(self, text: str) -> bool:
        """Advance by raw text (no tokenization; for tests and jump-forward)."""
        return self._matcher.accept_string(text)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens <= 0:
            return
        if num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens, only {self.num_accepted} accepted")
        self._matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: finish with reason "stop"."""
        return self._matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """The text so far is a complete match (a stop token would now be accepted)."""
        return self._matcher.is_completed()

    def reset(self) -> None:
        self._matcher.reset()
        self.num_accepted = 0


def fill_bitmasks(
    states: Sequence[GuidedState | None], vocab_size: int, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The step's token bitmask: int32 [B, ceil(vocab_size / 32)] on CPU, bit set = allowed.

    Rows of None (unconstrained) states are all ones; None when no row is constrained, so
    the sampler skips masking altogether. `out`, if given, is a preallocated CPU buffer with
    at least B rows (e.g. pinned memory for a fast host-to-device copy); its first B rows
    are returned.
    """
    if all(s is None for s in states):
        return None
    batch = len(states)
    if out is None:
        bitmask = xgr.allocate_token_bitmask(batch, vocab_size)
    else:
        bitmask = out[:batch]
        bitmask.fill_(-1)  # -1 = all 32 bits set
    for row, state in enumerate(states):
        if state is not None:
            state.fill_bitmask(bitmask, row)
    return bitmask
