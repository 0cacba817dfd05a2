"""Per-request grammar state and the batch bitmask the sampler applies, for either backend."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastdeploy.model_executor.guided_decoding.backend import CompiledGrammar, GrammarBackend, TokenMatcher

__all__ = ["GuidedState", "PinnedBitmasks", "allocate_bitmask", "fill_bitmasks"]


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [rows, ceil(vocab_size / 32)] on CPU, every token allowed (-1 = all 32 bits set)."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


class PinnedBitmasks:
    """Page-locked bitmask rows reused from step to step, for the non-blocking copy to the GPU.

    A fresh pinned tensor each step (allocated, written, copied) cost about 0.9 ms at 64 rows on
    an H100 host, more than the grammar fill itself (about 0.55 ms). Two buffers alternate:
    a step's copy is queued before its sampler, and the worker reads that step's frame (so the
    copy is done) before it fills the bitmask of the step after the next one.
    """

    def __init__(self, vocab_size: int) -> None:
        self.words = -(-vocab_size // 32)
        self._buffers: list[torch.Tensor] = []
        self._next = 0

    def take(self, rows: int) -> torch.Tensor:
        """int32 [rows, ceil(V / 32)], pinned, contents undefined."""
        if not self._buffers or self._buffers[0].shape[0] < rows:
            capacity = max(rows, 2 * self._buffers[0].shape[0] if self._buffers else rows)
            self._buffers = [torch.empty(capacity, self.words, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        buffer = self._buffers[self._next]
        self._next ^= 1
        return buffer[:rows]


class GuidedState:
    """One constrained request's position in its grammar: the backend's matcher plus the
    count of accepted tokens that bounds rollback.

    Not thread-safe; a state is touched by one thread at a time (the bitmask filler or the
    step loop), never both.
    """

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self.backend = compiled.backend.name
        self._matcher = compiled.matcher()
        self.num_accepted = 0  # tokens accepted and not rolled back

    @property
    def token_matcher(self) -> TokenMatcher:
        """The backend's matcher (the batch fill hands a step's matchers to their backend)."""
        return self._matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 [B, ceil(V/32)], CPU, contiguous).

        A terminated state allows only its stop tokens, so a row still in the batch for a
        step after termination samples a harmless eos.
        """
        self._matcher.fill_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar rejects it."""
        ok = self._matcher.accept(int(token_id))
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
    the sampler skips masking altogether. `out`, if given, is a CPU buffer with at least B
    rows, any contents (e.g. `PinnedBitmasks` for a fast host-to-device copy); its first B rows
    are returned. Rows of both backends share one buffer: their layouts are the same.
    """
    if all(s is None for s in states):
        return None
    batch = len(states)
    bitmask = allocate_bitmask(batch, vocab_size) if out is None else out[:batch]
    # Rows by backend, each backend's in one call (a constrained row is written whole); the
    # unconstrained rows of a reused buffer are set to all ones in one indexed fill.
    groups: dict[int, tuple[GrammarBackend, list[TokenMatcher], list[int]]] = {}
    free_rows = []
    for row, state in enumerate(states):
        if state is not None:
            backend = state.compiled.backend
            group = groups.setdefault(id(backend), (backend, [], []))
            group[1].append(state.token_matcher)
            group[2].append(row)
        else:
            free_rows.append(row)
    if out is not None and free_rows:
        bitmask.index_fill_(0, torch.tensor(free_rows), -1)
    for backend, matchers, rows in groups.values():
        backend.fill_rows(matchers, bitmask, rows)
    return bitmask
