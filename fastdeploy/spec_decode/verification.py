"""Which drafted tokens a step accepts.

Every slot of a verified sequence is sampled from the target distribution at that
position (the ordinary sampler: bias, bitmask, penalties, temperature, top-k/top-p/
min-p kept set, seeded draw). A draft is accepted while it equals the token sampled at
its slot; the first mismatch, or the slot after the last draft, contributes the
sampled token itself.

This is rejection sampling for proposals that put all their mass on one token (n-gram
and greedy MTP drafts): the draft d is accepted with probability p(d), and on
rejection the sampled token is distributed as p restricted to tokens != d,
renormalised, which is exactly the residual max(p - q, 0) of rejection sampling with
q = one-hot(d). The output therefore follows the truncated target distribution
exactly, and greedy rows reduce to "longest matching prefix + one bonus token".
"""

from __future__ import annotations

import numpy as np
import torch


def accept_counts(tokens: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """Tokens accepted per sequence, on the tensors' device (no host sync).

    tokens: int64 [B, S], the token sampled at each of a sequence's slots; drafted: int64
    [B, S - 1], the draft at each slot, -1 where a sequence has fewer drafts (-1 never equals a
    sampled token). Returns int32 [B]: 1 + the length of the prefix where draft and sample agree.
    """
    agree = (tokens[:, :-1] == drafted).to(torch.int32)
    return (1 + agree.cumprod(dim=1).sum(dim=1)).to(torch.int32)


def accepted_counts(sampled: list[int], drafts: list[list[int]]) -> list[int]:
    """`accept_counts` over host lists; `sampled` holds 1 + len(d) slots per sequence, one after another."""
    width = 1 + max((len(d) for d in drafts), default=0)
    tokens = np.full((len(drafts), width), -1, dtype=np.int64)
    drafted = np.full((len(drafts), width - 1), -1, dtype=np.int64)
    offset = 0
    for b, draft in enumerate(drafts):
        tokens[b, :len(draft) + 1] = sampled[offset:offset + len(draft) + 1]
        drafted[b, :len(draft)] = draft
        offset += len(draft) + 1
    return accept_counts(torch.from_numpy(tokens), torch.from_numpy(drafted)).tolist()
