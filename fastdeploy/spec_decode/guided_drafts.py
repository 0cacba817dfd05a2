"""Grammar checks of speculative drafts: cut drafts the grammar rejects, mask every verified slot."""

from __future__ import annotations

import torch

from fastdeploy.model_executor.guided_decoding.matcher import GuidedState, allocate_bitmask


def trim_drafts_to_grammar(states: dict[int, GuidedState], drafts: dict[int, list[int]]) -> None:
    """Cut each constrained sequence's draft at its first token the grammar rejects (in place).

    A rejected draft token could never be accepted (its slot's bitmask forbids it), so
    verifying it and anything after it would be wasted compute.
    """
    for seq_id, draft in drafts.items():
        state = states.get(seq_id)
        if state is None or not draft:
            continue
        valid = 0 if state.is_terminated else state.accept_tokens(draft)
        state.rollback(valid)
        del draft[valid:]


def fill_draft_bitmasks(states: list[GuidedState | None], drafts: list[list[int]], vocab_size: int,
                        out: torch.Tensor | None = None) -> torch.Tensor | None:
    """int32 [R, ceil(V/32)] with one row per verified slot (1 + len(draft) per sequence).

    Slot i of a sequence is masked by the grammar state after its first i drafts: the
    matcher accepts the drafts one by one while filling, then rolls them all back, so it
    ends where it started. Drafts must already be grammar-valid (trim_drafts_to_grammar).
    out: a CPU buffer with at least R rows, any contents (e.g. `PinnedBitmasks`); its first R
    rows are returned.
    """
    if all(s is None for s in states):
        return None
    rows = sum(len(d) + 1 for d in drafts)
    bitmask = allocate_bitmask(rows, vocab_size) if out is None else out[:rows]  # unconstrained rows: all ones
    row = 0
    for state, draft in zip(states, drafts, strict=True):
        if state is None:
            if out is not None:
                bitmask[row:row + len(draft) + 1].fill_(-1)
            row += len(draft) + 1
            continue
        for token in draft:
            state.fill_bitmask(bitmask, row)
            state.accept(token)
            row += 1
        state.fill_bitmask(bitmask, row)
        row += 1
        state.rollback(len(draft))
    return bitmask
