"""Kept set of top-k / top-p / min-p truncation, vectorised over rows.

Decisions (which tokens survive) are made in float64 from the float32 processed
logits, so they agree with the float64 reference (tests/layers/sample/kept_set_reference.py) everywhere
except at exact ties: a float32 cumulative sum over 49k tokens would flip top-p
boundary decisions within ~1e-6 of ``top_p`` often enough to matter for RL
trainers that replay the kept set.

Only a sorted *window* of each row is examined in float64. The kept set is always
a prefix of the row sorted by descending logit (every rule is monotone along that
order), so a window of the first W entries decides the row exactly unless the
entry right after the window could still be kept; those rows are redone with a
full sort. Ordering float32 logits before the temperature division gives the
same order as the float64 scaled logits (division by a positive number is
monotone and cannot merge distinct float32 values in float64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Sorted prefixes examined for top-p rows without top-k: FIRST_WINDOW, then
# TOP_P_WINDOW, then a full sort, each only for the rows the previous one left open.
FIRST_WINDOW = 64
TOP_P_WINDOW = 1024


@dataclass
class KeptWindow:
    """Kept sets of R rows as sorted prefixes.

    idx: int64 [R, W] vocabulary ids in descending logit order.
    x: float64 [R, W] scaled logits (processed / temperature) of those ids.
    keep: bool [R, W], a prefix of each row; W = the largest kept count.
    lse: float64 [R], logsumexp of the whole scaled row where computed, NaN elsewhere.
    """

    idx: torch.Tensor
    x: torch.Tensor
    keep: torch.Tensor
    lse: torch.Tensor


@dataclass
class KeptSet:
    """Kept sets of R rows as a dense mask.

    mask: bool [R, V]. count: int64 [R] (= mask.sum(1)).
    logz: float64 [R], log of the kept mass under softmax(proc / T) (NaN if not computed).
    """

    mask: torch.Tensor
    count: torch.Tensor
    logz: torch.Tensor


def take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t[rows], without the copy when ``rows`` is every row in order (rows from nonzero())."""
    return t if rows.numel() == t.shape[0] else t[rows]


def truncation_flags(top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """bool [B]: rows with any truncation (top_k > 0, top_p < 1 or min_p > 0)."""
    return (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)


def scaled_lse(proc: torch.Tensor, temperature: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """float64 [R]: logsumexp(proc / T) per row. proc float32 [R, V], temperature [R] > 0.

    exact=True computes in float64 (top-p decisions need ~1e-13 relative accuracy).
    exact=False shifts by the row max in float32 first (``proc - max`` is exact for
    the terms that carry the mass) and is accurate to ~1e-7, ample for reporting logZ.
    """
    if exact:
        x = proc.double().div_(temperature.double().unsqueeze(1))
        return torch.logsumexp(x, dim=1)
    m = proc.max(dim=1, keepdim=True).values
    t = temperature.float().unsqueeze(1)
    s = torch.exp((proc - m).div_(t)).sum(dim=1)  # float32 cascade sum: ~1e-7 relative
    return m.squeeze(1).double() / temperature.double() + torch.log(s.double())


def _window(
    proc: torch.Tensor,
    t64: torch.Tensor,
    ke: torch.Tensor,
    tp: torch.Tensor,
    log_min_p: torch.Tensor,
    lse: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply top-k, top-p, min-p to the first ``width`` sorted entries of each row.

    Args:
        proc: float32 [R, V] processed logits (before temperature).
        t64: float64 [R] temperature (> 0). ke: int64 [R] effective k (V = off).
        tp: float64 [R] top_p. log_min_p: float64 [R] log(min_p) (-inf = off).
        lse: float64 [R] row logsumexp of the scaled logits; only read for rows
            without top-k whose top_p < 1.
        width: entries to examine (<= V).
    Returns:
        idx int64 [R, width], x float64 [R, width], keep bool [R, width] (prefix),
        short bool [R]: rows whose kept set may extend past the window.
    """
    r, v = proc.shape
    if width < v:
        vals, idx = torch.topk(proc, width, dim=1, largest=True, sorted=True)
    else:
        vals, idx = torch.sort(proc, dim=1, descending=True)
    x = vals.double().div_(t64.unsqueeze(1))
    in_k = torch.arange(width, device=proc.device).unsqueeze(0) < ke.unsqueeze(1)
    has_k = (ke < v).unsqueeze(1)
    # q: the top-k renormalised distribution. With top-k it is a softmax over the
    # first k entries (all inside the window); without, the global softmax.
    # lse is NaN where it was not computed (rows with top-k, or top_p = 1 where q is unused).
    glob = torch.where(torch.isnan(lse), x[:, 0], lse)
    shift = torch.where(has_k, x[:, :1], glob.unsqueeze(1))
    q = torch.exp(torch.where(in_k, x - shift, torch.full_like(x, -math.inf)))
    q = torch.where(has_k, q / q.sum(dim=1, keepdim=True), q)
    cum = torch.cumsum(q, dim=1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
    tp1 = tp.unsqueeze(1)
    # top_p >= 1 is "off": a running sum that rounds to 1.0 must not cut the tail.
    keep = in_k & ((before < tp1) | (tp1 >= 1.0))
    # min-p: p_i >= min_p * p_max  <=>  x_i - x_max >= log(min_p).
    keep &= (x - x[:, :1]) >= log_min_p.unsqueeze(1)
    keep &= x > -math.inf
    keep[:, 0] = True  # the top token always survives (also keeps all -inf rows drawable)
    # The entry after the window is kept only if the last one is and the top-p test
    # still passes for it; min-p / -inf can only get stricter further down.
    short = (ke > width) & keep[:, -1] & ((tp >= 1.0) | (cum[:, -1] < tp))
    return idx, x, keep, short


def kept_window(
    proc: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    want_lse: torch.Tensor | None = None,
) -> KeptWindow:
    """Kept sets of truncating, non-greedy rows: top-k, then top-p on the top-k
    renormalised mass, then min-p. -inf tokens are never kept; the top token always is.

    Args:
        proc: float32 [R, V] processed logits (before temperature).
        temperature: float [R] (> 0). top_k: int64 [R] (0 = off).
        top_p: float [R] (1 = off). min_p: float [R] (0 = off).
        want_lse: bool [R] rows whose row logsumexp the caller needs (for logZ).
    """
    r, v = proc.shape
    device = proc.device
    t64 = temperature.to(torch.float64)
    tp = top_p.to(torch.float64)
    ke = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    mp = min_p.to(torch.float64)
    log_min_p = torch.where(mp > 0, torch.log(mp.clamp(min=1e-300)), torch.full_like(mp, -math.inf))

    # The global normaliser: exact for top-p without top-k (it decides membership),
    # approximate where it only serves logZ.
    need_exact = (ke >= v) & (tp < 1.0)
    lse = torch.full((r,), math.nan, dtype=torch.float64, device=device)
    for need, exact in ((need_exact, True), (None if want_lse is None else want_lse & ~need_exact, False)):
        if need is not None and bool(need.any()):
            rows = need.nonzero().squeeze(1)
            lse[rows] = scaled_lse(take_rows(proc, rows), temperature[rows], exact=exact)

    if r == 0:
        empty = torch.empty(0, 0, device=device)
        return KeptWindow(empty.long(), empty.double(), empty.bool(), lse)

    # Window width each row needs: k with top-k; with min-p, one more than the number
    # of tokens that can pass it (a single compare-and-count pass, with a safety
    # margin so it is a superset); otherwise a first guess, widened on demand.
    need = torch.where(ke < v, ke, torch.full_like(ke, FIRST_WINDOW))
    has_mp = (ke >= v) & (mp > 0)
    if bool(has_mp.any()):
        rows = has_mp.nonzero().squeeze(1)
        sub = take_rows(proc, rows)
        m = sub.max(dim=1, keepdim=True).values
        thr = m + (temperature[rows].float() * log_min_p[rows].float()).unsqueeze(1)
        thr = thr - 1e-4 * (1.0 + thr.abs() + m.abs())
        need[rows] = (sub >= thr).sum(dim=1) + 1

    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    pending = torch.arange(r, device=device)
    while pending.numel():
        width = min(int(need[pending].max()), v)
        sub = take_rows(proc, pending)
        idx, x, keep, short = _window(
            sub, t64[pending], ke[pending], tp[pending], log_min_p[pending], lse[pending], width
        )
        done = ~short
        parts.append((pending[done], idx[done], x[done], keep[done]))
        pending = pending[short]
        # Widen: the first guess, then TOP_P_WINDOW, then the full row.
        need[pending] = v if width >= TOP_P_WINDOW else TOP_P_WINDOW

    # Kept sets are prefixes: assemble the passes, trimmed to the longest kept count.
    c = max(int(p[3].sum(dim=1).max()) if p[0].numel() else 0 for p in parts)
    out_idx = torch.zeros(r, c, dtype=torch.int64, device=device)
    out_x = torch.full((r, c), -math.inf, dtype=torch.float64, device=device)
    out_keep = torch.zeros(r, c, dtype=torch.bool, device=device)
    for rows, idx, x, keep in parts:
        w = min(c, idx.shape[1])
        out_idx[rows, :w], out_x[rows, :w], out_keep[rows, :w] = idx[:, :w], x[:, :w], keep[:, :w]
    return KeptWindow(out_idx, out_x, out_keep, lse)


def kept_logz(window: KeptWindow) -> torch.Tensor:
    """float64 [R]: log of the softmax mass of the kept set, ``log sum_{i in keep} p_i``."""
    masked = window.x.masked_fill(~window.keep, -math.inf)
    return torch.logsumexp(masked, dim=1) - window.lse


def kept_set_full_sort(
    proc: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> KeptSet:
    """Kept sets of R rows by a stable full sort of every row and a float64 running sum (any device).

    The vectorised form of the per-row float64 reference (tests/layers/sample/kept_set_reference.py);
    the GPU path redoes the rows its kernel could not settle with it, and tests and benchmarks
    hold the fast paths to it. proc float32 [R, V] (before temperature); temperature > 0.
    """
    proc = proc.float()
    r, v = proc.shape
    dev = proc.device
    t64 = temperature.to(device=dev, dtype=torch.float64).unsqueeze(1)
    tp = top_p.to(device=dev, dtype=torch.float64).unsqueeze(1)
    mp = min_p.to(device=dev, dtype=torch.float64).unsqueeze(1)
    top_k = top_k.to(device=dev, dtype=torch.int64)
    ke = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v)).unsqueeze(1)
    vals, idx = torch.sort(proc, dim=1, descending=True, stable=True)
    e = vals.double().sub_(vals[:, :1].double()).div_(t64).exp_()
    z = e.sum(dim=1)
    in_k = torch.arange(v, device=dev).unsqueeze(0) < ke
    q = e * in_k
    q = q / q.sum(dim=1, keepdim=True)
    cum = torch.cumsum(q, dim=1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
    keep = in_k & ((tp >= 1.0) | (before < tp)) & ((mp <= 0) | (e >= mp))
    keep[:, 0] = True
    keep = keep.cumprod(dim=1).bool()  # prefix (already is; cheap insurance)
    kept = (e * keep).sum(dim=1)
    keep &= vals > -math.inf
    mask = torch.zeros_like(keep).scatter_(1, idx, keep)
    return KeptSet(mask, mask.sum(dim=1), torch.log(kept) - torch.log(z))
