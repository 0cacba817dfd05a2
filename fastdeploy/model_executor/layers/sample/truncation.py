"""Kept set of top-k / top-p / min-p truncation, vectorised over rows.

The decisions (which tokens survive) are computed in float64 from the float32
processed logits, so that they agree with the float64 reference
(`reference.py`) everywhere except at exact ties: a float32 cumulative sum over
49k tokens would flip top-p boundary decisions within ~1e-6 of ``top_p`` often
enough to matter for RL trainers that replay the kept set.
"""

from __future__ import annotations

import torch


def truncation_flags(top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """bool [B]: rows with any truncation (top_k > 0, top_p < 1 or min_p > 0)."""
    return (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)


def kept_set(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens kept by top-k, then top-p (on the top-k renormalised mass), then min-p.

    Args:
        scaled: float64 [R, V], processed logits divided by temperature.
        top_k: int64 [R] (0 = off), top_p: float [R] (1 = off), min_p: float [R] (0 = off).
    Returns:
        keep: bool [R, V]; -inf tokens are never kept; the top token always is.
        lse: float64 [R], logsumexp of ``scaled`` (log of the softmax normaliser).
    """
    r, v = scaled.shape
    device = scaled.device
    lse = torch.logsumexp(scaled, dim=1)
    keep = scaled > float("-inf")
    if r == 0:
        return keep, lse

    top_p64 = top_p.to(torch.float64)
    k_eff = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    needs_sort = (k_eff < v) | (top_p64 < 1.0)
    if bool(needs_sort.any()):
        rows = needs_sort.nonzero().squeeze(1)
        xs = scaled.index_select(0, rows)
        ke = k_eff.index_select(0, rows)
        # Only the first max(k) sorted entries can matter unless some row has top-p
        # without top-k; a partial top-k selection is far cheaper than a full sort.
        width = int(ke.max())
        if width < v:
            vals, idx = torch.topk(xs, width, dim=1, largest=True, sorted=True)
        else:
            vals, idx = torch.sort(xs, dim=1, descending=True)
        p = torch.exp(vals - lse.index_select(0, rows).unsqueeze(1))
        in_k = torch.arange(vals.shape[1], device=device).unsqueeze(0) < ke.unsqueeze(1)
        q = torch.where(in_k, p, torch.zeros_like(p))
        q = q / q.sum(dim=1, keepdim=True)
        cum = torch.cumsum(q, dim=1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
        tp = top_p64.index_select(0, rows).unsqueeze(1)
        # top_p >= 1 is "off": a running sum that rounds to 1.0 must not cut the tail.
        keep_sorted = in_k & ((before < tp) | (tp >= 1.0))
        keep_sorted[:, 0] = True
        keep_kp = torch.zeros(rows.numel(), v, dtype=torch.bool, device=device)
        keep_kp.scatter_(1, idx, keep_sorted)
        keep[rows] &= keep_kp

    min_p64 = min_p.to(torch.float64)
    if bool((min_p64 > 0).any()):
        # Compared as probabilities, like the reference: p_i >= min_p * p_max.
        p = torch.exp(scaled - lse.unsqueeze(1))
        p_max = p.max(dim=1, keepdim=True).values
        keep &= p >= min_p64.unsqueeze(1) * p_max

    # Degenerate rows (everything -inf) still need one token so the draw is inside the set.
    empty = ~keep.any(dim=1)
    if bool(empty.any()):
        er = empty.nonzero().squeeze(1)
        keep[er, scaled.index_select(0, er).argmax(dim=1)] = True
    return keep, lse


def kept_logz(scaled: torch.Tensor, keep: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """float64 [R]: log of the softmax mass of the kept set, ``log sum_{i in keep} p_i``."""
    masked = scaled.masked_fill(~keep, float("-inf"))
    return torch.logsumexp(masked, dim=1) - lse
