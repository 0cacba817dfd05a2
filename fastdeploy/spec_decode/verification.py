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


def accepted_counts(sampled: list[int], drafts: list[list[int]]) -> list[int]:
    """Tokens accepted per sequence (1..len(draft)+1); `sampled` holds 1 + len(d) slots per sequence."""
    counts = []
    offset = 0
    for draft in drafts:
        n = 0
        while n < len(draft) and sampled[offset + n] == draft[n]:
            n += 1
        counts.append(n + 1)
        offset += len(draft) + 1
    return counts
