"""Float64 reference for the kept set and logZ of one row: the definition tests hold the sampler to.

Deliberately plain (Python loops over sorted tokens): readability over speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# Decision margins this close to zero count as ties: the sampler's float64 sums
# use a different summation order, so they may round the other way.
TIE_TOL = 1e-12


@dataclass
class ReferenceKeptSet:
    """Kept set of one row.

    ids: sorted int64 vocabulary ids kept. logz: log of their softmax mass.
    ambiguous: ids whose membership depends on how an exact tie at a boundary is
    broken (equal logits across the top-k / top-p cut, or a top-p / min-p margin
    within TIE_TOL); an implementation may differ from ``ids`` only on these.
    """

    ids: np.ndarray
    logz: float
    ambiguous: set[int] = field(default_factory=set)


def _softmax64(x: np.ndarray) -> np.ndarray:
    m = np.max(x)
    e = np.exp(x - m)
    return e / e.sum()


def reference_kept_set(
    processed_logits: np.ndarray,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
) -> ReferenceKeptSet:
    """Kept set of one row.

    Args:
        processed_logits: [V] logits after bias, bitmask and penalties (float32
            values; computed on in float64). -inf entries are disallowed tokens.
        temperature: 0 (or less) = greedy: kept set {argmax (first on ties)} and
            logz = log p_argmax under temperature 1.
        top_k: 0 = off. top_p: 1 = off. min_p: 0 = off.

    Semantics: p = softmax(logits / T). Sort descending. top-k keeps the first k.
    top-p renormalises the top-k mass to q and keeps token i (in sorted order) iff
    sum_{j<i} q_j < top_p; the top token always survives. min-p keeps p_i >=
    min_p * p_max. Tokens with logit -inf are never kept. logz = log sum_kept p.
    """
    x = np.asarray(processed_logits, dtype=np.float64)
    v = x.shape[0]
    if temperature <= 0:
        i = int(np.argmax(x))
        logz = float(x[i] - (np.max(x) + math.log(np.exp(x - np.max(x)).sum())))
        ties = set(np.flatnonzero(x == x[i]).tolist()) if np.count_nonzero(x == x[i]) > 1 else set()
        return ReferenceKeptSet(np.array([i], dtype=np.int64), logz, ties)

    x = x / np.float64(temperature)
    p = _softmax64(x)
    order = np.argsort(-x, kind="stable")
    k = v if top_k <= 0 else min(int(top_k), v)

    # Walk the sorted list; the kept tokens form a prefix of it.
    topk_mass = float(np.sum(p[order[:k]]))
    p_max = float(p[order[0]])
    min_p_thr = float(min_p) * p_max
    top_p = float(top_p)
    kept: list[int] = []
    margin_ties: set[int] = set()
    cum = 0.0
    n_prefix = 0
    for j in range(k):
        tok = int(order[j])
        q = float(p[tok]) / topk_mass
        # top_p >= 1 is "off": rounding of the running sum to 1.0 must not cut the tail.
        ok_p = j == 0 or top_p >= 1.0 or cum < top_p
        if j > 0 and top_p < 1.0 and abs(cum - top_p) <= TIE_TOL:
            margin_ties.add(tok)
        ok_min = float(p[tok]) >= min_p_thr
        if min_p > 0 and abs(float(p[tok]) - min_p_thr) <= TIE_TOL * p_max:
            margin_ties.add(tok)
        if not (ok_p and ok_min):
            break
        n_prefix += 1
        if np.isfinite(x[tok]):
            kept.append(tok)
        cum += q

    ambiguous = set(margin_ties)
    # Equal logits straddling the cut: which of them are kept depends on sort order.
    if 0 < n_prefix < v:
        last, first_out = x[order[n_prefix - 1]], x[order[n_prefix]]
        if last == first_out and np.isfinite(last):
            ambiguous |= set(np.flatnonzero(x == last).tolist())
    ids = np.array(sorted(kept), dtype=np.int64)
    mass = sum(float(p[t]) for t in kept)
    logz = math.log(mass) if mass > 0 else float("-inf")
    return ReferenceKeptSet(ids, logz, ambiguous)
