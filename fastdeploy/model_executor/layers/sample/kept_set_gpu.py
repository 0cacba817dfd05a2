"""Kept set (top-k -> top-p -> min-p) as a per-row value threshold, for CUDA: no full sort.

The kept set of a row is a prefix of the row in descending logit order with ties
broken by ascending vocabulary id (a stable sort; see `reference.py`). A prefix is
fully described by two numbers per row: its length ``n`` and its boundary value
``b`` (the float32 logit of its last entry). The kept ids are then

    {i : x_i > b}  ∪  the first ``n - #{x > b}`` ids (ascending) with ``x_i == b``

so the set can be materialised as a boolean [R, V] mask with two compares (and a
cumsum over the equality mask only when a tie straddles the boundary), and
compacted into CSR on the device with one ``nonzero`` (row-major, so ids come out
sorted within each row). Only the kept ids then cross PCIe.

Finding ``(n, b)`` without sorting the vocabulary:

1. Window: ``torch.topk`` (radix select, values only) of the first
   ``W = max(WINDOW, largest top_k <= K_CAP)`` entries per row, decided in float64
   like `truncation._window`. Peaked LM rows (top-p keeping a few hundred tokens,
   top-k <= K_CAP, min-p) resolve here.
2. Rows whose kept set may extend past the window (flat distributions, top_k >
   K_CAP together with top-p) are resolved by bisection on the float32 values,
   all such rows at once. Values are mapped to order-preserving int32 keys, so a
   bisection over keys ends on an exact token value after <= 32 steps:

   * top-k: the k-th largest key = the smallest key t with #{key > t} < k;
   * top-p: the smallest key t with mass{key > t} / Z_k < top_p, where Z_k is
     the top-k mass (exactly k tokens: the ties at the k-th value count only as
     many times as fit), and sums are float64 over exp((x - max) / T);
   * min-p: a threshold on e_i = p_i / p_max >= min_p (a count, no search).

   Since all three rules keep prefixes of the same order, ``n = min(n_k, n_p,
   n_m)`` and ``b`` = the largest of their boundary keys.

Tie rule (documented deviation-free choice): equal logits are ordered by ascending
id, exactly like the float64 reference's stable sort. For top-k and min-p this
reproduces the reference exactly. For top-p, when several tokens share the
boundary value, the number of them kept is ``ceil((top_p - S) / q)`` (S = the
renormalised mass strictly above, q = their common probability), i.e. the
reference's running-sum test evaluated in closed form; the reference marks such
ids ambiguous anyway. All decisions are float64, so the result equals the
reference except where a margin is within rounding (``TIE_TOL``) of zero.

``logz = log(kept mass / total mass)``: kept mass in float64; the total in float64
where a decision needs it (top-p rows without top-k, bisected rows), else a float32
sum (~1e-7 relative), like `truncation.scaled_lse(exact=False)`.

On CUDA the same search runs as one Triton program per row (`triton_kept_set`,
bottom of this file): the torch formulation is launch- and sync-bound on a GPU.
Measured on an H100 (benchmarks/sampler_mask_gpu.py, V = 49152): the kernel beats
the full sort for min-p (0.45 vs 0.8-3.3 ms with CSR) and top-k (B = 256: 2.3 vs
3.5 ms) but not yet for top-p (2.3 vs 0.9 ms at B <= 32; 5.0 vs 3.3 ms at B = 256):
one program per row leaves most SMs idle at small B, and each of the 8 top-p passes
does float64 exp and 16 pivot sums over the whole row. Next steps: split rows over
several programs, and narrow the key range with a count-only search first.

Entry points: `kept_set` (dense mask + logz; CUDA -> this module, CPU -> the
windowed `truncation.kept_window` path), `kept_set_csr` (CSR on the same device),
`fast_kept_set` (Triton on CUDA, else `threshold_kept_set`, this algorithm in
torch on any device: CPU tests run it), and
`kept_set_full_sort` (the vectorised full-sort implementation tests and
benchmarks hold it to).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from fastdeploy.model_executor.layers.sample.truncation import kept_logz, kept_window, scaled_lse

# topk window per row (values only). Rows whose kept set is larger are bisected.
WINDOW = 1024
# Rows with top_k <= K_CAP widen the window to k; larger top_k goes to bisection.
K_CAP = 4096

# FD_SAMPLER_FAST_KEPT_SET: "1" = use the threshold path on every device (tests use
# it to drive the sampler's CUDA branch on CPU), "0" = never, unset = CUDA only.
_ENV_FLAG = "FD_SAMPLER_FAST_KEPT_SET"


def use_fast_path(device: torch.device, uses_top_p: bool = False) -> bool:
    """Whether the sampler computes kept sets with `threshold_kept_set` on ``device``.

    By default only on CUDA and only for batches without top-p: on the H100 the threshold
    search beats the full sort 2-7x for min-p and top-k, but is 1.5-2.5x slower than it
    once top-p is on (see docs/benchmarks.md), so top-p batches keep the sorted window.
    """
    flag = os.environ.get(_ENV_FLAG, "")
    if flag in ("0", "1"):
        return flag == "1"
    return device.type == "cuda" and not uses_top_p


@dataclass
class KeptSet:
    """Kept sets of R rows.

    mask: bool [R, V]. count: int64 [R] (= mask.sum(1)).
    logz: float64 [R], log of the kept mass under softmax(proc / T) (NaN if not computed).
    """

    mask: torch.Tensor
    count: torch.Tensor
    logz: torch.Tensor


# ---------------------------------------------------------------------------------
# order-preserving int32 keys of float32 values


def ordered_key(x: torch.Tensor) -> torch.Tensor:
    """int32 keys with key(a) < key(b) <=> a < b for float32 a, b (no NaN). -0.0 == +0.0."""
    b = (x.float() + 0.0).view(torch.int32)  # + 0.0 folds -0.0 into +0.0
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def key_to_float(k: torch.Tensor) -> torch.Tensor:
    """Inverse of `ordered_key` (the map is an involution on the bit pattern)."""
    k = k.to(torch.int32)
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).view(torch.float32)


NEG_INF_KEY = int(ordered_key(torch.tensor([-math.inf]))[0])


def _bisect_smallest(pred, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest int t in [lo, hi] with pred(t) (int64 [R]); pred monotone, pred(hi) True."""
    iters = int((hi - lo).max()).bit_length() if lo.numel() else 0
    for _ in range(iters):
        mid = (lo + hi) >> 1  # floor, also for negatives
        ok = pred(mid)
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid + 1)
    return hi


# ---------------------------------------------------------------------------------
# the threshold algorithm


def _bisect_rows(
    proc: torch.Tensor,
    key: torch.Tensor,
    t64: torch.Tensor,
    ke: torch.Tensor,
    tp: torch.Tensor,
    mp: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n, boundary key, kept mass, total mass) of rows resolved by bisection over the full row.

    proc float32 [F, V], key int32 [F, V]; masses are float64 sums of exp((x - max) / T).
    """
    f, v = proc.shape
    m = proc.max(dim=1, keepdim=True).values.double()
    t1 = t64.unsqueeze(1)
    e = proc.double().sub_(m).div_(t1).exp_()  # float64 [F, V]; -inf -> 0
    z = e.sum(dim=1)
    kmin = key.min(dim=1).values.long()
    kmax = key.max(dim=1).values.long()

    def cnt_gt(t):
        return (key > t.int().unsqueeze(1)).sum(dim=1)

    def mass_gt(t):
        return torch.where(key > t.int().unsqueeze(1), e, 0.0).sum(dim=1)

    def e_at(t):
        return torch.exp((key_to_float(t).double() - m.squeeze(1)) / t64)

    # top-k: the k-th largest key
    has_k = ke < v
    kth = kmin
    zk = z
    if bool(has_k.any()):
        kth = _bisect_smallest(lambda t: (cnt_gt(t) < ke) | ~has_k, kmin, kmax)
        kth = torch.where(has_k, kth, kmin)
        # exactly k tokens' mass: the ties at the k-th value count as many times as fit
        zk = torch.where(has_k, mass_gt(kth) + (ke - cnt_gt(kth)).double() * e_at(kth), z)

    # top-p on the top-k renormalised mass: the boundary can't be below the k-th value
    p_on = tp < 1.0
    n_p = torch.full_like(ke, v)
    t_p = kmin
    if bool(p_on.any()):
        tp_c = torch.where(p_on, tp, torch.ones_like(tp))
        t_p = _bisect_smallest(lambda t: (mass_gt(t) / zk < tp_c) | ~p_on, kth, kmax)
        s = mass_gt(t_p) / zk
        q = e_at(t_p) / zk
        ties = (key == t_p.int().unsqueeze(1)).sum(dim=1)
        # tokens at the boundary value kept by the running-sum test s + r q < top_p
        c = torch.ceil((tp_c - s) / q).nan_to_num(nan=1.0, posinf=float(v)).clamp(1, v).long()
        c = torch.minimum(c, ties).clamp(min=1)
        n_p = torch.where(p_on, cnt_gt(t_p) + c, n_p)
        t_p = torch.where(p_on, t_p, kmin)

    # min-p: p_i / p_max = e_i >= min_p
    mp_on = mp > 0
    n_m = torch.full_like(ke, v)
    t_m = kmin
    if bool(mp_on.any()):
        passes = e >= mp.unsqueeze(1)
        n_m = torch.where(mp_on, passes.sum(dim=1), n_m)
        t_m = torch.where(passes, key, torch.iinfo(torch.int32).max).min(dim=1).values.long()
        t_m = torch.where(n_m == 0, kmax, t_m)
        t_m = torch.where(mp_on, t_m, kmin)

    n = torch.minimum(torch.minimum(ke, n_p), n_m).clamp(min=1)
    bkey = torch.maximum(torch.maximum(kth, t_p), t_m)
    bkey = torch.where(n == 1, kmax, bkey)
    kept = mass_gt(bkey) + (n - cnt_gt(bkey)).double() * e_at(bkey)
    return n, bkey, kept, z


def _mask_from_threshold(key: torch.Tensor, n: torch.Tensor, bkey: torch.Tensor) -> torch.Tensor:
    """bool [R, V]: the first n entries of each row in (value desc, id asc) order; -inf never kept."""
    b = bkey.int().unsqueeze(1)
    mask = key >= b
    cnt = mask.sum(dim=1)
    cut = cnt != n  # a tie straddles the boundary: keep only the first ids of the tied value
    has_ninf = bkey == NEG_INF_KEY
    if bool((cut | has_ninf).any()):
        eq = key == b
        slots = n - (cnt - eq.sum(dim=1))
        mask = (key > b) | (eq & (torch.cumsum(eq, dim=1, dtype=torch.int32) <= slots.unsqueeze(1)))
        mask &= key != NEG_INF_KEY
    return mask


def threshold_kept_set(
    proc: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    want_logz: bool = True,
    window: int = WINDOW,
) -> KeptSet:
    """Kept sets of truncating, non-greedy rows without a full sort (any device).

    Args:
        proc: float32 [R, V] processed logits (before temperature).
        temperature: [R] (> 0). top_k: int64 [R] (0 = off). top_p: [R] (1 = off).
        min_p: [R] (0 = off).
        want_logz: compute logz (else NaN).
        window: topk window width; 0 sends every row to the bisection (tests).
    """
    proc = proc.float()
    r, v = proc.shape
    dev = proc.device
    if r == 0:
        empty = torch.empty(0, v, dtype=torch.bool, device=dev)
        none = torch.empty(0, dtype=torch.int64, device=dev)
        return KeptSet(empty, none, none.double())
    t64 = temperature.to(device=dev, dtype=torch.float64)
    tp = top_p.to(device=dev, dtype=torch.float64)
    mp = min_p.to(device=dev, dtype=torch.float64)
    top_k = top_k.to(device=dev, dtype=torch.int64)
    ke = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    key = ordered_key(proc)

    n = torch.ones(r, dtype=torch.int64, device=dev)
    bkey = torch.zeros(r, dtype=torch.int64, device=dev)
    kept = torch.zeros(r, dtype=torch.float64, device=dev)
    z = torch.full((r,), math.nan, dtype=torch.float64, device=dev)  # total mass, relative to the row max

    fb = torch.ones(r, dtype=torch.bool, device=dev)
    if window > 0:
        w = min(v, max(window, int(torch.where(ke <= K_CAP, ke, 0).max())))
        vals = torch.topk(proc, w, dim=1, largest=True, sorted=True).values
        m = vals[:, :1].double()
        e_w = vals.double().sub_(m).div_(t64.unsqueeze(1)).exp_()  # float64 [R, W]
        j = torch.arange(w, device=dev).unsqueeze(0)
        in_k = j < ke.unsqueeze(1)
        # q's normaliser: the top-k mass (top-k inside the window) or the exact total.
        zk = torch.where(ke <= w, (e_w * in_k).sum(dim=1), torch.full_like(tp, math.nan))
        need_z = (ke >= v) & (tp < 1.0)
        if bool(need_z.any()):
            rows = need_z.nonzero().squeeze(1)
            z[rows] = (proc[rows].double() - m[rows]).div_(t64[rows].unsqueeze(1)).exp_().sum(dim=1)
            zk = torch.where(need_z, z, zk)
        q = e_w / zk.unsqueeze(1)
        cum = torch.cumsum(q, dim=1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
        tp_off = (tp >= 1.0).unsqueeze(1)
        keep = in_k & (tp_off | (before < tp.unsqueeze(1)))
        keep &= (mp <= 0).unsqueeze(1) | (e_w >= mp.unsqueeze(1))
        keep[:, 0] = True
        n_w = keep.sum(dim=1)  # every rule keeps a prefix
        # The entry after the window could still be kept; or top-p needs Z_k of k > W.
        short = (n_w == w) & (w < v) & (ke > w) & ((tp >= 1.0) | (cum[:, -1] < tp))
        fb = short | ((ke > w) & (ke < v) & (tp < 1.0))
        n = n_w
        bkey = ordered_key(vals.gather(1, (n_w - 1).unsqueeze(1)).squeeze(1)).long()
        kept = (e_w * keep).sum(dim=1)

    rows = fb.nonzero().squeeze(1)
    if rows.numel():
        n_f, b_f, kept_f, z_f = _bisect_rows(proc[rows], key[rows], t64[rows], ke[rows], tp[rows], mp[rows])
        n[rows], bkey[rows], kept[rows], z[rows] = n_f, b_f, kept_f, z_f

    mask = _mask_from_threshold(key, n, bkey)
    logz = torch.full((r,), math.nan, dtype=torch.float64, device=dev)
    if want_logz:
        # kept and z are both relative to exp(max / T): logz = log kept - log z.
        missing = torch.isnan(z)
        if bool(missing.any()):
            m32 = proc.max(dim=1, keepdim=True).values
            z32 = torch.exp((proc - m32).div_(temperature.to(dev).float().unsqueeze(1))).sum(dim=1).double()
            z = torch.where(missing, z32, z)
        logz = torch.log(kept) - torch.log(z)
    return KeptSet(mask, mask.sum(dim=1), logz)


# ---------------------------------------------------------------------------------
# full-sort implementation (the vectorised definition tests and benchmarks compare to)


def kept_set_full_sort(
    proc: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> KeptSet:
    """Same kept sets by a stable full sort of every row and a float64 running sum."""
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


# ---------------------------------------------------------------------------------
# entry points


def _kept_set_windowed(proc, temperature, top_k, top_p, min_p, want_logz: bool) -> KeptSet:
    """The CPU path (`truncation.kept_window`) as a dense mask."""
    r, v = proc.shape
    want = torch.ones(r, dtype=torch.bool, device=proc.device) if want_logz else None
    win = kept_window(proc, temperature, top_k, top_p, min_p, want_lse=want)
    mask = torch.zeros(r, v, dtype=torch.bool, device=proc.device)
    keep = win.keep & (win.x > -math.inf)
    if win.idx.numel():
        mask.scatter_(1, win.idx, keep)
    if want_logz:
        logz = kept_logz(win)
    else:
        logz = torch.full((r,), math.nan, dtype=torch.float64, device=proc.device)
    return KeptSet(mask, mask.sum(dim=1), logz)


def fast_kept_set(
    proc: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    want_logz: bool = True,
) -> KeptSet:
    """The threshold kept set: one Triton launch on CUDA, the torch formulation elsewhere."""
    if proc.is_cuda and triton is not None:
        return triton_kept_set(proc, temperature, top_k, top_p, min_p, want_logz)
    return threshold_kept_set(proc, temperature, top_k, top_p, min_p, want_logz=want_logz)


def kept_set(
    proc: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    want_logz: bool = True,
) -> KeptSet:
    """Kept sets as a dense bool mask + float64 logz; threshold path on CUDA, windowed sort on CPU."""
    if use_fast_path(proc.device):
        return fast_kept_set(proc, temperature, top_k, top_p, min_p, want_logz)
    return _kept_set_windowed(proc, temperature, top_k, top_p, min_p, want_logz)


def mask_to_csr(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [R, V] -> (offsets int32 [R+1], ids int32 [M] ascending per row), on mask's device."""
    r = mask.shape[0]
    offsets = torch.zeros(r + 1, dtype=torch.int64, device=mask.device)
    torch.cumsum(mask.sum(dim=1), dim=0, out=offsets[1:])
    ids = mask.nonzero()[:, 1].to(torch.int32)  # row-major: sorted within each row
    return offsets.to(torch.int32), ids


def kept_set_csr(
    proc: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    requested: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR kept sets (offsets int32 [R+1], ids int32 [M]) and logz float32 [R], computed on proc's device.

    Rows with ``requested`` False get an empty row and logz 0.
    """
    ks = kept_set(proc, temperature, top_k, top_p, min_p)
    mask, logz = ks.mask, ks.logz.float()
    if requested is not None:
        req = requested.to(device=proc.device, dtype=torch.bool)
        mask = mask & req.unsqueeze(1)
        logz = torch.where(req, logz, torch.zeros_like(logz))
    offsets, ids = mask_to_csr(mask)
    return offsets, ids, logz


def fill_sampling_mask_dense(
    out,
    proc: torch.Tensor,
    requested: torch.Tensor,
    g_rows: torch.Tensor,
    t_rows: torch.Tensor,
    kept: KeptSet | None,
) -> None:
    """`sampler._fill_sampling_mask` for the threshold path: CSR by one nonzero on the device.

    Truncating rows take ``kept`` (rows of t_rows, in order); greedy rows their argmax,
    with logz the argmax's mass under the temperature-1 softmax. Others: empty, logz 0.
    """
    device = proc.device
    b, v = proc.shape
    logz = torch.zeros(b, dtype=torch.float32, device=device)
    mask = torch.zeros(b, v, dtype=torch.bool, device=device)
    if t_rows.numel():
        sel = requested[t_rows]
        mask[t_rows] = kept.mask & sel.unsqueeze(1)
        logz[t_rows] = torch.where(sel, kept.logz.float(), torch.zeros_like(logz[t_rows]))
    if g_rows.numel():
        rows = g_rows[requested[g_rows]]
        if rows.numel():
            tok = out.sampled_token_ids[rows]
            mask[rows, tok] = True
            x = proc if rows.numel() == b else proc[rows]
            lse = scaled_lse(x, torch.ones(rows.numel(), device=device), exact=False)
            logz[rows] = (x.gather(1, tok.unsqueeze(1)).squeeze(1).double() - lse).float()
    out.mask_offsets, out.mask_ids = mask_to_csr(mask)
    out.logz = logz


# ---------------------------------------------------------------------------------
# Triton: the whole threshold search of a row in one program (CUDA)
#
# The torch formulation above is launch-bound on a GPU (a few hundred small ops and
# several host syncs per call). The kernel runs one program per row, streaming the
# row from L2 in every pass, and replaces binary bisection by a 16-way search: each
# pass evaluates 15 pivots at once, so a 32-bit key range closes in 8 passes. It
# applies the same rules (top-k count, float64 top-p mass on the top-k mass, min-p
# on e = p / p_max, stable tie rule) and writes the mask itself, tie ranks from a
# running count across chunks.

try:  # pragma: no cover - only on machines with triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means no kernel
    triton = None

if triton is not None:

    @triton.jit
    def _tkey(x):
        b = (x + 0.0).to(tl.int32, bitcast=True)
        return b ^ ((b >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _tval(k):
        k32 = k.to(tl.int32)
        return (k32 ^ ((k32 >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _search16(xrow, V, lo, hi, m, t, zk, thresh, USE_MASS: tl.constexpr, BLOCK: tl.constexpr):
        """(t = 1 / temperature.) Smallest key in [lo, hi] with  count(key > .) < thresh  (USE_MASS=False) or
        mass(key > .) / zk < thresh (USE_MASS=True); the predicate holds at hi."""
        offs = tl.arange(0, BLOCK)
        jj = tl.arange(0, 16).to(tl.int64)
        while lo < hi:
            step = (hi - lo + 14) // 15  # >= 1; pivots lo, lo + step, ..., the last one hi
            piv = tl.minimum(lo + jj * step, hi)
            piv32 = piv.to(tl.int32)
            # per-lane accumulators, reduced across the program once per pass
            cnt = tl.zeros([BLOCK, 16], dtype=tl.int32)
            mass = tl.zeros([BLOCK, 16], dtype=tl.float64)
            for start in range(0, V, BLOCK):
                o = start + offs
                valid = o < V
                x = tl.load(xrow + o, mask=valid, other=float("-inf"))
                key = _tkey(x)
                gt = (key[:, None] > piv32[None, :]) & valid[:, None]
                if USE_MASS:
                    e = tl.exp((x.to(tl.float64) - m) * t)
                    mass += tl.where(gt, e[:, None], 0.0)
                else:
                    cnt += gt.to(tl.int32)
            if USE_MASS:
                ok = (tl.sum(mass, axis=0) / zk) < thresh
            else:
                ok = tl.sum(cnt, axis=0).to(tl.int64) < thresh
            ok = ok | (piv == hi)
            j = tl.min(tl.where(ok, jj, 16), axis=0)
            new_hi = tl.sum(tl.where(jj == j, piv, 0), axis=0)
            prev = tl.sum(tl.where(jj == j - 1, piv, 0), axis=0)
            lo = tl.where(j == 0, new_hi, prev + 1)
            hi = new_hi
        return hi

    @triton.jit
    def _above(xrow, V, b, m, t, BLOCK: tl.constexpr):
        """(count, float64 mass) of keys > b, and the count of keys == b. t = 1 / temperature."""
        offs = tl.arange(0, BLOCK)
        b32 = b.to(tl.int32)
        cnt = tl.zeros([BLOCK], dtype=tl.int32)
        eqc = tl.zeros([BLOCK], dtype=tl.int32)
        mass = tl.zeros([BLOCK], dtype=tl.float64)
        for start in range(0, V, BLOCK):
            o = start + offs
            valid = o < V
            x = tl.load(xrow + o, mask=valid, other=float("-inf"))
            key = _tkey(x)
            gt = (key > b32) & valid
            cnt += gt.to(tl.int32)
            eqc += ((key == b32) & valid).to(tl.int32)
            mass += tl.where(gt, tl.exp((x.to(tl.float64) - m) * t), 0.0)
        return tl.sum(cnt, axis=0).to(tl.int64), tl.sum(mass, axis=0), tl.sum(eqc, axis=0).to(tl.int64)

    @triton.jit
    def _kept_set_kernel(
        x_ptr, stride_x, mask_ptr, t_ptr, k_ptr, p_ptr, mp_ptr, n_ptr, kept_ptr, z_ptr, V, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        xrow = x_ptr + row * stride_x
        t = 1.0 / tl.load(t_ptr + row).to(tl.float64)  # e = exp((x - max) * t)
        k = tl.load(k_ptr + row)  # int64, effective (V = off)
        tp = tl.load(p_ptr + row).to(tl.float64)
        mp = tl.load(mp_ptr + row).to(tl.float64)
        vv = tl.load(k_ptr + row) * 0 + V  # V as int64
        offs = tl.arange(0, BLOCK)

        # pass: row max and key range
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        kmn = tl.full([BLOCK], 2147483647, tl.int32)
        kmx = tl.full([BLOCK], -2147483647 - 1, tl.int32)
        for start in range(0, V, BLOCK):
            o = start + offs
            valid = o < V
            x = tl.load(xrow + o, mask=valid, other=float("-inf"))
            key = _tkey(x)
            mx = tl.maximum(mx, x)
            kmn = tl.minimum(kmn, tl.where(valid, key, 2147483647))
            kmx = tl.maximum(kmx, tl.where(valid, key, -2147483647 - 1))
        m = tl.max(mx, axis=0).to(tl.float64)
        kmin = tl.min(kmn, axis=0).to(tl.int64)
        kmax = tl.max(kmx, axis=0).to(tl.int64)

        # total mass (relative to exp(max / T))
        _c0, z, _e0 = _above(xrow, V, kmin - 1, m, t, BLOCK)

        # top-k: k-th largest key = smallest key with count(> key) < k
        kth = kmin
        zk = z
        if k < vv:
            kth = _search16(xrow, V, kmin, kmax, m, t, z, k, False, BLOCK)
            ck, mk, _ek = _above(xrow, V, kth, m, t, BLOCK)
            zk = mk + (k - ck).to(tl.float64) * tl.exp((_tval(kth).to(tl.float64) - m) * t)

        # top-p on the top-k renormalised mass
        n_p = vv
        tpk = kmin
        if tp < 1.0:
            tpk = _search16(xrow, V, kth, kmax, m, t, zk, tp, True, BLOCK)
            cp, mpass, ties = _above(xrow, V, tpk, m, t, BLOCK)
            s = mpass / zk
            q = tl.exp((_tval(tpk).to(tl.float64) - m) * t) / zk
            r = tl.minimum((tp - s) / q, vv.to(tl.float64))  # q == 0 -> inf -> V
            c = r.to(tl.int64)
            c = tl.where(c.to(tl.float64) < r, c + 1, c)  # ceil
            c = tl.maximum(tl.minimum(c, ties), 1)
            n_p = cp + c

        # min-p: e = p / p_max >= min_p
        n_m = vv
        tmk = kmin
        if mp > 0.0:
            cntm = tl.zeros([BLOCK], dtype=tl.int32)
            kmm = tl.full([BLOCK], 2147483647, tl.int32)
            for start in range(0, V, BLOCK):
                o = start + offs
                valid = o < V
                x = tl.load(xrow + o, mask=valid, other=float("-inf"))
                key = _tkey(x)
                ps = (tl.exp((x.to(tl.float64) - m) * t) >= mp) & valid
                cntm += ps.to(tl.int32)
                kmm = tl.minimum(kmm, tl.where(ps, key, 2147483647))
            n_m = tl.sum(cntm, axis=0).to(tl.int64)
            tmk = tl.where(n_m == 0, kmax, tl.min(kmm, axis=0).to(tl.int64))

        n = tl.maximum(tl.minimum(tl.minimum(k, n_p), n_m), 1)
        bk = tl.maximum(tl.maximum(kth, tpk), tmk)
        bk = tl.where(n == 1, kmax, bk)
        cb, mb, _eb = _above(xrow, V, bk, m, t, BLOCK)
        kept = mb + (n - cb).to(tl.float64) * tl.exp((_tval(bk).to(tl.float64) - m) * t)
        tl.store(kept_ptr + row, kept)
        tl.store(z_ptr + row, z)

        # mask: key > b, plus the first (n - cb) ids with key == b; never -inf
        slots = (n - cb).to(tl.int32)
        b32 = bk.to(tl.int32)
        seen = tl.zeros([], dtype=tl.int32)
        total = tl.zeros([], dtype=tl.int32)
        mrow = mask_ptr + row * V
        for start in range(0, V, BLOCK):
            o = start + offs
            valid = o < V
            x = tl.load(xrow + o, mask=valid, other=float("-inf"))
            key = _tkey(x)
            eq = (key == b32) & valid
            rank = seen + tl.cumsum(eq.to(tl.int32), axis=0)
            keep = ((key > b32) | (eq & (rank <= slots))) & valid & (x > float("-inf"))
            tl.store(mrow + o, keep.to(tl.int8), mask=valid)
            seen += tl.sum(eq.to(tl.int32), axis=0)
            total += tl.sum(keep.to(tl.int32), axis=0)
        tl.store(n_ptr + row, total.to(tl.int64))


TRITON_BLOCK = 256


def triton_kept_set(
    proc: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    want_logz: bool = True,
) -> KeptSet:
    """`threshold_kept_set` as one Triton launch (CUDA, or TRITON_INTERPRET=1 on CPU)."""
    proc = proc.float()
    if proc.stride(1) != 1:
        proc = proc.contiguous()
    r, v = proc.shape
    dev = proc.device
    top_k = top_k.to(device=dev, dtype=torch.int64)
    ke = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v)).contiguous()
    mask = torch.empty(r, v, dtype=torch.int8, device=dev)
    count = torch.empty(r, dtype=torch.int64, device=dev)
    kept = torch.empty(r, dtype=torch.float64, device=dev)
    z = torch.empty(r, dtype=torch.float64, device=dev)
    if r:
        _kept_set_kernel[(r,)](
            proc,
            proc.stride(0),
            mask,
            temperature.to(device=dev, dtype=torch.float32).contiguous(),
            ke,
            top_p.to(device=dev, dtype=torch.float32).contiguous(),
            min_p.to(device=dev, dtype=torch.float32).contiguous(),
            count,
            kept,
            z,
            v,
            BLOCK=TRITON_BLOCK,
            num_warps=8,
        )
    logz = torch.log(kept) - torch.log(z) if want_logz else torch.full_like(kept, math.nan)
    return KeptSet(mask.view(torch.bool), count, logz)
