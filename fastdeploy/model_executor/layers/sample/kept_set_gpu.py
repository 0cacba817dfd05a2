"""Kept set (top-k -> top-p -> min-p) on the GPU without sorting the vocabulary.

The kept set of a row is a prefix of the row in (logit descending, id ascending)
order, the order of the float64 reference's stable sort (`reference.py`). A prefix
is described by its last entry, value ``bv`` and id ``bid``: the kept ids are
``{i : x_i > bv} ∪ {i : x_i == bv, i <= bid}`` (never -inf).

One Triton program per row finds that entry in a few passes over the row, with no
host work in between (`_kept_set_kernel`):

1. Stats: row max ``M``, smallest finite logit, number of finite logits and the
   float64 normaliser ``Z = Σ exp((x - M) / T)`` (online, rescaled per lane).
2. Top-k (k < #finite): passes over the row narrow a value interval ``(a, b]``
   holding the k-th entry by counting ``#{x > t}`` at 16 pivots (exact integer
   counts), until at most ``CANDIDATES`` logits lie in it. For k <= CANDIDATES / 2
   only ``a`` moves, so the gathered logits are the whole top of the row (the window
   of acceptable counts, k..CANDIDATES, is then wide enough for the pivots to land in;
   a narrow one, k close to CANDIDATES, could use up the passes).
3. Top-p on the top-k renormalised mass: the same narrowing with the float32 mass
   above (or, for top_p >= 0.5, below) each pivot; a pivot moves an end only when
   its estimate is more than the relative error bound ``MASS_DELTA`` away from the
   target, so the true boundary stays inside ``(a, b]`` whatever the rounding.
4. Finalisation: the logits inside ``(a, b]`` are gathered (with their ids, as
   int64 keys) into a per-row scratch row, sorted in the program, and the
   reference's test (float64 running sum, ``before < top_p``) picks the entry.
   When the top of the row is gathered, top-p and min-p are decided on it too.
5. Min-p otherwise: one pass counts ``exp((x - M) / T) >= min_p`` in float64.

The pass count adapts per row (usually 3-5 reads of the row), and the kernel
returns the boundary, the kept count and ``logZ`` (float64 throughout). An interval
the pivots cannot split holds one value only (a run of equal logits): the rank in
that run is found by a scan in id order. After ``VALUE_PASSES`` passes the pivots
are spaced evenly in the float32 bit pattern instead of in value, so a search always
ends; a row still unsettled after ``MAX_PASSES`` (no realistic input: the float32
mass bound would have to stall on more than CANDIDATES logits) is flagged and keeps
a superset, which the CSR path (`kept_set_csr`) redoes by the full sort.

Over a vocabulary above ``CAP * PREFILTER_MIN_SHRINK``, `kept_set_prefilter.prefilter` first
cuts each row to its candidates (many programs per row); the row kernel then reads those
(``COMPACT``), with the whole row's normaliser and finite count, and rows left with too many
candidates keep the full-row kernel.

From the boundary, `_compact_kernel` writes the CSR ids straight from the logits, or from a
cut row's candidates (no dense mask), after one exclusive cumsum of the counts and one small
device->host copy (total ids and whether any row was flagged) that sizes the output. A
batch of fewer rows than SMs has each full row split into chunks written side by side
(`_compact_split`). The sampler's draw needs the dense mask: `_mask_kernel` writes it in one pass,
without any host sync. For the sampling mask the sampler's CSR covers every row of the batch:
`_mask_rows_kernel` settles each row's bounds (a truncating row's kept prefix, a greedy row's
argmax and its logZ, an empty row otherwise) before the cumsum and the compaction, into a
buffer sized by the caller, so that path reads nothing back.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from fastdeploy.model_executor.layers.sample import kept_set_prefilter as prefilter_module
from fastdeploy.model_executor.layers.sample.reference import kept_set_full_sort
from fastdeploy.model_executor.layers.sample.truncation import KeptSet

try:  # pragma: no cover - only on machines with triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means no kernel
    triton = None

PIVOTS = 16  # pivots per narrowing pass (including both ends of the interval)
CANDIDATES = 2048  # logits gathered and sorted per row (a power of two: tl.sort)
VALUE_PASSES = 4  # passes with pivots even in value; later passes: even in bit pattern
MAX_PASSES = 16
MASS_DELTA = 1e-4  # bound on the relative error of float32 mass sums (actual: < 3e-5)
SPAN = 50.0  # tokens more than SPAN * T below the max carry < V e^-SPAN of the mass
BLOCK = 512  # logits per loop step of the row kernel
NUM_WARPS = 8
NUM_STAGES = 3  # software pipelining depth of the row loops (Triton's CUDA default)
MASK_BLOCK = 2048  # logits per program of the dense-mask kernel
GREEDY_SLOT = -2  # a greedy row's entry in the sampling mask's row slots (-1: a plain row)
# Launch shape of the row kernel over a prefilter's candidates (rows of at most its CAP).
COMPACT_BLOCK = 256
COMPACT_WARPS = 4
# Launch shapes of the CSR compaction (see `_compact_split`).
COMPACT_ROW_BLOCK = 4096
COMPACT_PART_BLOCK = 2048
COMPACT_MAX_PARTS = 16
COMPACT_WARPS_PER_PROGRAM = 8
# Rows at most this many times the prefilter's candidate cap go straight to the row kernel.
PREFILTER_MIN_SHRINK = 2


def uses_fast_path(device: torch.device) -> bool:
    """Whether `kept_set` takes the sort-free Triton path on ``device`` (CUDA with Triton)."""
    return device.type == "cuda" and triton is not None


@dataclass
class KeptBounds:
    """Kept sets of R rows as prefixes of the (logit desc, id asc) order.

    value: float32 [R] and last_id: int32 [R], the last kept entry (value +inf: none).
    count: int32 [R] kept ids. logz: float64 [R], log of their softmax mass.
    failed: int32 [R], 1 where the row could not be settled (value/last_id keep a superset);
    None for bounds assembled for a compaction, whose unsettled rows are already emptied.
    candidates: the prefilter's rows where it ran (the CSR compaction reads those instead).
    """

    value: torch.Tensor
    last_id: torch.Tensor
    count: torch.Tensor
    logz: torch.Tensor
    failed: torch.Tensor | None = None
    candidates: prefilter_module.Candidates | None = None


@dataclass
class GpuKeptSet(KeptSet):
    """`KeptSet` (dense mask, count, logz) plus the bounds the CSR compaction reads."""

    bounds: KeptBounds | None = None
    params: tuple | None = None  # (proc, temperature, top_k, top_p, min_p): to redo flagged rows


# ---------------------------------------------------------------------------------
# kernels

if triton is not None:

    @triton.jit
    def _fkey(x):
        """float32 -> int32 key with key(a) < key(b) <=> a < b; -0.0 folded into +0.0."""
        b = (x + 0.0).to(tl.int32, bitcast=True)
        return b ^ ((b >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _kfloat(k):
        """Inverse of `_fkey` (the map is an involution on the bit pattern)."""
        return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _prev(v):
        """The largest float32 below v (v finite); below +0.0 is -1e-45, not -0.0."""
        k = _fkey(v) - 1
        k = tl.where(k == -1, -2, k)
        return _kfloat(k)

    @triton.jit
    def _in_prefix(x, o, bv, bid):
        return (x > float("-inf")) & ((x > bv) | ((x == bv) & (o <= bid)))

    @triton.jit
    def _exp64(x, m64, it):
        return tl.exp((x.to(tl.float64) - m64) * it)

    @triton.jit
    def _narrow(xrow, V, a, b, n_a, n_b, bv, bid, m, it32, target, tail, only_a, outside,
                C: tl.constexpr, MASS: tl.constexpr, DELTA: tl.constexpr, VALUE_PASSES: tl.constexpr,
                MAX_PASSES: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr):
        """Narrows (a, b] (n_a, n_b: prefix entries above a, b) around the boundary.

        Count (MASS=False): keeps #{x > b} < target <= #{x > a}. Mass: keeps S(b) < target
        <= S(a) for S(t) the prefix mass above t, or with tail, T(b) > target >= T(a) for
        T(t) the prefix mass at or below t. only_a: b stays. Stops when at most C entries
        lie inside, the interval holds one value (single), or after MAX_PASSES. outside: the
        mass of logits not in this row (left out by the prefilter, all below the interval),
        part of every tail sum.
        """
        jj = tl.arange(0, P)
        offs = tl.arange(0, BLOCK)
        frac = jj.to(tl.float64) / (P - 1)
        n = tl.zeros((), dtype=tl.int32)
        single = tl.zeros((), dtype=tl.int32)
        while (n_a - n_b > C) & (single == 0) & (n < MAX_PASSES):
            lo64 = tl.maximum(a, -3.4028234663852886e38).to(tl.float64)
            pv = (lo64 + (b.to(tl.float64) - lo64) * frac).to(tl.float32)
            ka = _fkey(a).to(tl.int64)
            kb = _fkey(b).to(tl.int64)
            pk = _kfloat((ka + ((kb - ka) * jj) // (P - 1)).to(tl.int32))
            piv = tl.where(n < VALUE_PASSES, pv, pk)
            piv = tl.minimum(tl.maximum(piv, a), b)
            piv = tl.where(jj == 0, a, tl.where(jj == P - 1, b, piv))
            cnt = tl.zeros([BLOCK, P], dtype=tl.int32)
            acc = tl.zeros([BLOCK, P], dtype=tl.float32)
            mn = tl.full([BLOCK], float("inf"), tl.float32)
            mx = tl.full([BLOCK], float("-inf"), tl.float32)
            for i in range(0, V, BLOCK):
                o = i + offs
                x = tl.load(xrow + o, mask=o < V, other=float("-inf"))
                pre = _in_prefix(x, o, bv, bid)
                gt = x[:, None] > piv[None, :]
                cnt += (gt & pre[:, None]).to(tl.int32)
                if MASS:
                    e = tl.where(pre, tl.exp((x - m) * it32), 0.0)
                    acc += tl.where(gt != tail, e[:, None], 0.0)
                inside = pre & (x > a) & (x <= b)
                mn = tl.minimum(mn, tl.where(inside, x, float("inf")))
                mx = tl.maximum(mx, tl.where(inside, x, float("-inf")))
            c = tl.sum(cnt, axis=0)
            if MASS:
                s = tl.sum(acc, axis=0).to(tl.float64) + tl.where(tail, outside, 0.0)
                hi_ok = tl.where(tail, s > target * (1.0 + DELTA), s < target * (1.0 - DELTA))
                lo_ok = tl.where(tail, s <= target * (1.0 - DELTA), s >= target * (1.0 + DELTA))
            else:
                hi_ok = c < target
                lo_ok = c >= target
            hi_ok = (hi_ok & (jj > 0) & (only_a == 0)) | (jj == P - 1)
            j_hi = tl.min(tl.where(hi_ok, jj, P - 1), axis=0)
            j_lo = tl.max(tl.where(lo_ok & (jj < j_hi), jj, 0), axis=0)
            b = tl.max(tl.where(jj == j_hi, piv, float("-inf")), axis=0)
            a = tl.max(tl.where(jj == j_lo, piv, float("-inf")), axis=0)
            n_b = tl.sum(tl.where(jj == j_hi, c, 0), axis=0)
            n_a = tl.sum(tl.where(jj == j_lo, c, 0), axis=0)
            # The old interval's extreme values bound the new one (no entries beyond them).
            lo_v = tl.min(mn, axis=0)
            hi_v = tl.max(mx, axis=0)
            nonempty = lo_v <= hi_v
            b = tl.where(nonempty, tl.minimum(b, hi_v), b)
            a = tl.where(nonempty, tl.maximum(a, _prev(tl.where(nonempty, lo_v, 0.0))), a)
            single = (nonempty & (lo_v == hi_v)).to(tl.int32)
            n += 1
        return a, b, n_a, n_b, single

    @triton.jit
    def _gather(xrow, V, a, b, bv, bid, m64, it, cand_row, STORE: tl.constexpr, BLOCK: tl.constexpr):
        """float64 prefix mass above b; with STORE, the prefix entries in (a, b] as keys
        ``_fkey(x) << 32 | (V - 1 - id)`` (descending key = the reference's order)."""
        offs = tl.arange(0, BLOCK)
        mass = tl.zeros([BLOCK], dtype=tl.float64)
        base = tl.zeros((), dtype=tl.int32)
        for i in range(0, V, BLOCK):
            o = i + offs
            x = tl.load(xrow + o, mask=o < V, other=float("-inf"))
            pre = _in_prefix(x, o, bv, bid)
            mass += tl.where(pre & (x > b), _exp64(x, m64, it), 0.0)
            if STORE:
                sel = pre & (x > a) & (x <= b)
                si = sel.to(tl.int32)
                pos = base + tl.cumsum(si, axis=0) - 1
                key = (_fkey(x).to(tl.int64) << 32) | (V - 1 - o).to(tl.int64)
                tl.store(cand_row + pos, key, mask=sel)
                base += tl.sum(si, axis=0)
        return tl.sum(mass, axis=0)

    @triton.jit
    def _sorted_list(cand_row, n, V, m64, it, C: tl.constexpr):
        """The n gathered keys sorted: values, ids, float64 masses, inclusive cumsum."""
        tl.debug_barrier()  # the gather's stores come from other threads of this program
        jc = tl.arange(0, C)
        pad = tl.full([C], -9223372036854775808, tl.int64)  # sorts last
        keys = tl.where(jc < n, tl.load(cand_row + jc, mask=jc < n, other=0), pad)
        keys = tl.sort(keys, descending=True)
        hi = keys >> 32
        vals = _kfloat(hi.to(tl.int32))
        ids = (V - 1 - (keys - (hi << 32))).to(tl.int32)
        e = tl.where(jc < n, _exp64(vals, m64, it), 0.0)
        return vals, ids, e, tl.cumsum(e, axis=0)

    @triton.jit
    def _pick(vals, ids, cum, j, C: tl.constexpr):
        """(value, id, inclusive cumulative mass) of list entry j."""
        jc = tl.arange(0, C)
        hit = jc == j
        return (tl.max(tl.where(hit, vals, float("-inf")), axis=0),
                tl.max(tl.where(hit, ids, -1), axis=0),
                tl.sum(tl.where(hit, cum, 0.0), axis=0))

    @triton.jit
    def _nth_equal(xrow, V, v, bv, bid, c, BLOCK: tl.constexpr):
        """Id of the c-th (0-based, ascending id) prefix entry equal to v."""
        offs = tl.arange(0, BLOCK)
        run = tl.zeros((), dtype=tl.int32)
        found = tl.full((), -1, tl.int32)
        for i in range(0, V, BLOCK):
            o = i + offs
            x = tl.load(xrow + o, mask=o < V, other=float("-inf"))
            eq = (_in_prefix(x, o, bv, bid) & (x == v)).to(tl.int32)
            cs = run + tl.cumsum(eq, axis=0)
            found = tl.maximum(found, tl.max(tl.where((eq != 0) & (cs == c + 1), o, -1), axis=0))
            run += tl.sum(eq, axis=0)
        return found

    @triton.jit
    def _kept_set_kernel(
        x_ptr, stride, V, t_ptr, k_ptr, p_ptr, mp_ptr, cand_ptr,
        bv_ptr, bid_ptr, cnt_ptr, logz_ptr, fail_ptr, skip_ptr, n_ptr, rz_ptr, rf_ptr, ids_ptr, V_IDS,
        COMPACT: tl.constexpr, C: tl.constexpr, P: tl.constexpr, DELTA: tl.constexpr, SPAN: tl.constexpr,
        VALUE_PASSES: tl.constexpr, MAX_PASSES: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """One row per program; rows with skip != 0 are another launch's. COMPACT: the rows are
        a prefilter's candidates (n per row, ids mapping positions to vocabulary ids, and the
        whole row's normaliser and finite count)."""
        row = tl.program_id(0).to(tl.int64)
        if tl.load(skip_ptr + row) == 0:
            n = tl.load(n_ptr + row) if COMPACT else V
            row_z = tl.load(rz_ptr + row) if COMPACT else tl.zeros((), dtype=tl.float64)
            row_fin = tl.load(rf_ptr + row) if COMPACT else tl.zeros((), dtype=tl.int32)
            _kept_set_row(row, x_ptr, stride, n, t_ptr, k_ptr, p_ptr, mp_ptr, cand_ptr, bv_ptr, bid_ptr, cnt_ptr,
                          logz_ptr, fail_ptr, row_z, row_fin, ids_ptr, V_IDS, COMPACT, C, P, DELTA, SPAN,
                          VALUE_PASSES, MAX_PASSES, BLOCK)

    @triton.jit
    def _kept_set_row(
        row, x_ptr, stride, V, t_ptr, k_ptr, p_ptr, mp_ptr, cand_ptr,
        bv_ptr, bid_ptr, cnt_ptr, logz_ptr, fail_ptr, row_z, row_fin, ids_ptr, V_IDS,
        COMPACT: tl.constexpr, C: tl.constexpr, P: tl.constexpr, DELTA: tl.constexpr, SPAN: tl.constexpr,
        VALUE_PASSES: tl.constexpr, MAX_PASSES: tl.constexpr, BLOCK: tl.constexpr,
    ):
        xrow = x_ptr + row * stride
        cand_row = cand_ptr + row * C
        offs = tl.arange(0, BLOCK)
        it = 1.0 / tl.load(t_ptr + row).to(tl.float64)
        it32 = it.to(tl.float32)
        k = tl.load(k_ptr + row).to(tl.int32)
        tp = tl.load(p_ptr + row).to(tl.float64)
        mp = tl.minimum(tl.load(mp_ptr + row).to(tl.float64), 1.0)

        # 1. stats; Z per lane relative to the lane's running max, rescaled when it grows
        lm = tl.full([BLOCK], float("-inf"), tl.float32)
        lz = tl.zeros([BLOCK], dtype=tl.float64)
        lmin = tl.full([BLOCK], float("inf"), tl.float32)
        lfin = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(0, V, BLOCK):
            o = i + offs
            x = tl.load(xrow + o, mask=o < V, other=float("-inf"))
            fin = x > float("-inf")
            up = x > lm
            d = tl.where(up, lm.to(tl.float64) - x.to(tl.float64), x.to(tl.float64) - lm.to(tl.float64))
            ed = tl.where(fin, tl.exp(d * it), 0.0)
            lz = tl.where(up, lz * ed + 1.0, lz + ed)
            lm = tl.maximum(lm, x)
            lmin = tl.minimum(lmin, tl.where(fin, x, float("inf")))
            lfin += fin.to(tl.int32)
        m = tl.max(lm, axis=0)
        nfin = tl.sum(lfin, axis=0)
        fmin = tl.min(lmin, axis=0)
        m64 = m.to(tl.float64)
        mz = tl.where(nfin > 0, m, 0.0)
        z = tl.sum(tl.where(lm > float("-inf"), lz * _exp64(lm, mz.to(tl.float64), it), 0.0), axis=0)
        if COMPACT:  # row_z is relative to the same max: the row's max is always a candidate
            outside_z = tl.maximum(row_z - z, 0.0)
            z = row_z
            nfin_row = row_fin
        else:
            outside_z = tl.zeros((), dtype=tl.float64)
            nfin_row = nfin

        k_on = (k > 0) & (k < nfin_row)
        p_on = tp < 1.0
        m_on = mp > 0.0
        # the prefix so far: every finite logit
        zero = tl.zeros((), dtype=tl.int32)
        bv = tl.full((), float("-inf"), tl.float32)
        bid = zero - 1
        n_pre = nfin
        mass_pre = z
        zk = z
        failed = zero
        covered = zero  # the sorted scratch row holds the prefix from the top, list_len entries
        list_len = zero
        list_n = zero
        jc = tl.arange(0, C)

        # 2. top-k
        if k_on:
            lower = _prev(fmin)
            a, b, n_a, n_b, single = _narrow(xrow, V, lower, m, nfin, zero, bv, bid, m, it32, k, False,
                                             (k <= C // 2).to(tl.int32), outside_z, C, False, DELTA, VALUE_PASSES,
                                             MAX_PASSES, P, BLOCK)
            if (n_a - n_b > C) & (single == 0):
                # A tie run straddles the k-th entry, so no cut of the top holds between k and C
                # entries: narrow both ends onto the run instead.
                a, b, n_a, n_b, single = _narrow(xrow, V, a, b, n_a, n_b, bv, bid, m, it32, k, False, zero,
                                                 outside_z, C, False, DELTA, VALUE_PASSES, MAX_PASSES, P, BLOCK)
            if n_a - n_b <= C:
                mass_gt = _gather(xrow, V, a, b, bv, bid, m64, it, cand_row, True, BLOCK)
                vals, ids, e, cum = _sorted_list(cand_row, n_a - n_b, V, m64, it, C)
                j = k - n_b - 1
                kv, kid, kc = _pick(vals, ids, cum, j, C)
                zk = mass_gt + kc
                covered = (n_b == 0).to(tl.int32)
                list_len = j + 1
                list_n = n_a - n_b
                bv = kv
                bid = kid
            elif single != 0:
                mass_gt = _gather(xrow, V, a, b, bv, bid, m64, it, cand_row, False, BLOCK)
                c = k - n_b
                bid = _nth_equal(xrow, V, b, bv, bid, c - 1, BLOCK)
                bv = b
                zk = mass_gt + c.to(tl.float64) * _exp64(b, m64, it)
            else:
                failed = zero + 1
                bv = a
            n_pre = k
            mass_pre = zk

        # 3. top-p on the top-k renormalised mass
        if p_on & (failed == 0):
            tgt = tp * zk
            if covered != 0:
                vals, ids, e, cum = _sorted_list(cand_row, list_n, V, m64, it, C)
                keep = (jc < list_len) & (cum - e < tgt)
                c = tl.maximum(tl.sum(keep.to(tl.int32), axis=0), 1)
                pv, pid, pc = _pick(vals, ids, cum, c - 1, C)
                bv = pv
                bid = pid
                n_pre = c
                mass_pre = pc
                list_len = c
            else:
                lower = tl.where(k_on, _prev(bv), tl.maximum(_prev(fmin), m - SPAN / it32))
                # Where SPAN cuts the start above the smallest logit, n_pre (every finite logit)
                # overcounts what lies above it; a count no interval may hold makes the first pass
                # measure it, so nothing is gathered on the overcount.
                n_start = tl.where(k_on, n_pre, tl.where(m - SPAN / it32 >= fmin, n_pre + C + 1, n_pre))
                tail = tp >= 0.5
                target = tl.where(tail, (1.0 - tp) * zk, tgt)
                # Logits left out by the prefilter lie outside a top-k prefix: no part of its tail.
                outside = tl.where(k_on, 0.0, outside_z)
                a, b, n_a, n_b, single = _narrow(xrow, V, lower, m, n_start, zero, bv, bid, m, it32, target, tail,
                                                 zero, outside, C, True, DELTA, VALUE_PASSES, MAX_PASSES, P, BLOCK)
                if n_a - n_b <= C:
                    mass_gt = _gather(xrow, V, a, b, bv, bid, m64, it, cand_row, True, BLOCK)
                    vals, ids, e, cum = _sorted_list(cand_row, n_a - n_b, V, m64, it, C)
                    keep = (jc < n_a - n_b) & (mass_gt + cum - e < tgt)
                    c = tl.maximum(tl.sum(keep.to(tl.int32), axis=0), 1)
                    pv, pid, pc = _pick(vals, ids, cum, c - 1, C)
                    covered = (n_b == 0).to(tl.int32)
                    list_len = c
                    list_n = n_a - n_b
                    bv = pv
                    bid = pid
                    n_pre = n_b + c
                    mass_pre = mass_gt + pc
                elif single != 0:
                    mass_gt = _gather(xrow, V, a, b, bv, bid, m64, it, cand_row, False, BLOCK)
                    ev = _exp64(b, m64, it)
                    # entries of the run kept: j with mass_gt + j * ev < tgt, at least one
                    q = tl.minimum(tl.maximum((tgt - mass_gt) / ev, 0.0), (n_a - n_b).to(tl.float64))
                    c = q.to(tl.int32)
                    c = tl.minimum(tl.maximum(c + (c.to(tl.float64) < q).to(tl.int32), 1), n_a - n_b)
                    bid = _nth_equal(xrow, V, b, bv, bid, c - 1, BLOCK)
                    bv = b
                    n_pre = n_b + c
                    mass_pre = mass_gt + c.to(tl.float64) * ev
                else:
                    failed = zero + 1
                    bv = a
                    bid = zero - 1
                    n_pre = n_a

        # 4. min-p: p_i >= min_p * p_max, every tie of the threshold kept
        if m_on & (failed == 0):
            if covered != 0:
                vals, ids, e, cum = _sorted_list(cand_row, list_n, V, m64, it, C)
                c = tl.maximum(tl.sum(((jc < list_len) & (e >= mp)).to(tl.int32), axis=0), 1)
                pv, pid, pc = _pick(vals, ids, cum, c - 1, C)
                bv = pv
                bid = pid
                n_pre = c
                mass_pre = pc
            else:
                cnt = tl.zeros([BLOCK], dtype=tl.int32)
                kept = tl.zeros([BLOCK], dtype=tl.float64)
                low = tl.full([BLOCK], float("inf"), tl.float32)
                for i in range(0, V, BLOCK):
                    o = i + offs
                    x = tl.load(xrow + o, mask=o < V, other=float("-inf"))
                    e = _exp64(x, m64, it)
                    ok = _in_prefix(x, o, bv, bid) & (e >= mp)
                    cnt += ok.to(tl.int32)
                    kept += tl.where(ok, e, 0.0)
                    low = tl.minimum(low, tl.where(ok, x, float("inf")))
                lv = tl.min(low, axis=0)
                cut = lv > bv
                bid = tl.where(cut, V, bid)
                bv = tl.where(cut, lv, bv)
                n_pre = tl.sum(cnt, axis=0)
                mass_pre = tl.sum(kept, axis=0)

        logz = tl.log(mass_pre) - tl.log(z)
        empty = nfin_row == 0
        if COMPACT:  # positions in the candidate row -> vocabulary ids (V: past every id)
            inside = (bid >= 0) & (bid < V)
            mapped = tl.load(ids_ptr + row * stride + bid, mask=inside, other=0)
            bid = tl.where(inside, mapped, tl.where(bid >= V, V_IDS, bid))
        tl.store(bv_ptr + row, tl.where(empty, float("inf"), bv))
        tl.store(bid_ptr + row, tl.where(empty, -1, bid))
        tl.store(cnt_ptr + row, tl.where(empty, 0, n_pre))
        tl.store(logz_ptr + row, tl.where(empty, float("-inf"), logz))
        tl.store(fail_ptr + row, failed)

    @triton.jit
    def _keep(x, o, bv, bid):
        """The kept prefix; (bv, bid) = (x[tok], tok) with tok the first argmax keeps
        just tok, also for a row of -inf (a greedy row's set is its argmax)."""
        return _in_prefix(x, o, bv, bid) | ((x == bv) & (o == bid))

    @triton.jit
    def _mask_kernel(x_ptr, stride, V, bv_ptr, bid_ptr, mask_ptr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + o, mask=o < V, other=float("-inf"))
        keep = _keep(x, o, tl.load(bv_ptr + row), tl.load(bid_ptr + row))
        tl.store(mask_ptr + row * V + o, keep.to(tl.int8), mask=o < V)

    @triton.jit
    def _compact_kernel(x_ptr, stride, V, bv_ptr, bid_ptr, off_ptr, ids_ptr, cx_ptr, cid_ptr, CAP, n_ptr, src_ptr,
                        CHUNK, CANDIDATE_ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """Writes the kept ids of each row, ascending, at ids[offsets[row]:]. Program (row, part)
        writes the ids of logits [part * CHUNK, (part + 1) * CHUNK), after counting the kept ones
        before its chunk (a read of the row's head, to spread a small batch over the SMs). With
        CANDIDATE_ROWS, a row with src[row] >= 0 is read by part 0 from that row of a prefilter's
        candidates (in id order) instead of its logits. Empty rows are not read."""
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        base = tl.load(off_ptr + row).to(tl.int64)
        if tl.load(off_ptr + row + 1) > base:
            bv = tl.load(bv_ptr + row)
            bid = tl.load(bid_ptr + row)
            offs = tl.arange(0, BLOCK)
            src = tl.load(src_ptr + row).to(tl.int64) if CANDIDATE_ROWS else -1
            if src >= 0:
                if part == 0:
                    n = tl.load(n_ptr + src)
                    for i in range(0, n, BLOCK):
                        q = i + offs
                        x = tl.load(cx_ptr + src * CAP + q, mask=q < n, other=float("-inf"))
                        o = tl.load(cid_ptr + src * CAP + q, mask=q < n, other=0)
                        base = _write_kept(ids_ptr, base, x, o, q < n, bv, bid)
            else:
                lo = part * CHUNK
                before = tl.zeros([BLOCK], dtype=tl.int32)
                for i in range(0, tl.minimum(lo, V), BLOCK):
                    o = i + offs
                    x = tl.load(x_ptr + row * stride + o, mask=o < V, other=float("-inf"))
                    before += (_keep(x, o, bv, bid) & (o < V)).to(tl.int32)
                base += tl.sum(before, axis=0)
                hi = tl.minimum(lo + CHUNK, V)
                for i in range(lo, hi, BLOCK):
                    o = i + offs
                    x = tl.load(x_ptr + row * stride + o, mask=o < hi, other=float("-inf"))
                    base = _write_kept(ids_ptr, base, x, o, o < hi, bv, bid)

    @triton.jit
    def _write_kept(ids_ptr, base, x, o, valid, bv, bid):
        """Writes the ids o of the kept entries among (x, o) from ids[base:]; the next base."""
        keep = _keep(x, o, bv, bid) & valid
        ki = keep.to(tl.int32)
        tl.store(ids_ptr + base + tl.cumsum(ki, axis=0) - 1, o, mask=keep)
        return base + tl.sum(ki, axis=0)

    @triton.jit
    def _mask_rows_kernel(x_ptr, stride, V, slot_ptr, req_ptr, tok_ptr,
                          kv_ptr, klast_ptr, kcount_ptr, klogz_ptr, kfail_ptr, kfull_ptr,
                          value_ptr, last_ptr, count_ptr, logz_ptr, src_ptr, off_ptr,
                          GREEDY: tl.constexpr, TRUNCATED: tl.constexpr, CANDIDATE_ROWS: tl.constexpr,
                          BLOCK: tl.constexpr):
        """One row's kept bounds for the sampling mask's CSR (see `fill_sampling_mask_dense`),
        one program per row of the batch; only a greedy row reads its logits."""
        row = tl.program_id(0).to(tl.int64)
        s = tl.load(slot_ptr + row).to(tl.int64)
        req = tl.load(req_ptr + row) != 0
        value = float("inf")
        last = -1
        count = 0
        logz = 0.0
        if TRUNCATED:
            is_t = req & (s >= 0)
            st = tl.maximum(s, 0)
            settled = is_t & (tl.load(kfail_ptr + st, mask=is_t, other=1) == 0)
            value = tl.where(settled, tl.load(kv_ptr + st, mask=settled, other=0.0), value)
            last = tl.where(settled, tl.load(klast_ptr + st, mask=settled, other=0), last)
            count = tl.where(settled, tl.load(kcount_ptr + st, mask=settled, other=0), count)
            logz = tl.where(is_t, tl.load(klogz_ptr + st, mask=is_t, other=0.0).to(tl.float32), logz)
            if CANDIDATE_ROWS:
                cut = is_t & (tl.load(kfull_ptr + st, mask=is_t, other=1) == 0)
                tl.store(src_ptr + row, tl.where(cut, st, -1).to(tl.int32))
        elif CANDIDATE_ROWS:
            tl.store(src_ptr + row, -1)
        # A greedy row keeps its token (the first argmax); logz = x[tok] - logsumexp(x), from
        # per-lane running maxima and sums over the row (no pass at all for other rows).
        is_g = req & (s == GREEDY)
        tok = tl.load(tok_ptr + row, mask=is_g, other=0)
        xt = tl.load(x_ptr + row * stride + tok, mask=is_g, other=0.0)
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(0, tl.where(is_g, V, 0), BLOCK):
            o = i + offs
            x = tl.load(x_ptr + row * stride + o, mask=o < V, other=float("-inf"))
            m_new = tl.maximum(m, x)
            live = m_new > float("-inf")
            acc = tl.where(live, acc * tl.exp(tl.where(live, m - m_new, 0.0)) + tl.exp(x - m_new), 0.0)
            m = m_new
        top = tl.max(m, axis=0)
        total = tl.sum(tl.where(m > float("-inf"), acc * tl.exp(m - top), 0.0), axis=0)
        value = tl.where(is_g, xt, value)
        last = tl.where(is_g, tok.to(tl.int32), last)
        count = tl.where(is_g, 1, count)
        logz = tl.where(is_g, (xt - top) - tl.log(total), logz)
        tl.store(value_ptr + row, value)
        tl.store(last_ptr + row, last)
        tl.store(count_ptr + row, count)
        tl.store(logz_ptr + row, logz)
        if row == 0:
            tl.store(off_ptr, 0)


# ---------------------------------------------------------------------------------
# host side


def kept_bounds(proc: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> KeptBounds:
    """The kernel on any device Triton runs on (CUDA, or CPU tensors under TRITON_INTERPRET=1).

    proc float32 [R, V] processed logits (before temperature); temperature [R] > 0;
    top_k int [R] (0 = off); top_p [R] (1 = off); min_p [R] (0 = off). One launch.
    """
    x = proc if proc.stride(1) == 1 else proc.contiguous()
    r, v = x.shape
    dev = x.device
    out = KeptBounds(
        value=torch.empty(r, dtype=torch.float32, device=dev),
        last_id=torch.empty(r, dtype=torch.int32, device=dev),
        count=torch.empty(r, dtype=torch.int32, device=dev),
        logz=torch.empty(r, dtype=torch.float64, device=dev),
        failed=torch.empty(r, dtype=torch.int32, device=dev),
    )
    if r == 0:
        return out
    params = (temperature.contiguous(), top_k.contiguous(), top_p.contiguous(), min_p.contiguous())
    cand = torch.empty(r, CANDIDATES, dtype=torch.int64, device=dev)
    results = (cand, out.value, out.last_id, out.count, out.logz, out.failed)
    settings = {"C": CANDIDATES, "P": PIVOTS, "DELTA": MASS_DELTA, "SPAN": SPAN, "VALUE_PASSES": VALUE_PASSES,
                "MAX_PASSES": MAX_PASSES, "BLOCK": BLOCK, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES}
    if v <= prefilter_module.CAP * PREFILTER_MIN_SHRINK:
        run_all = torch.zeros(r, dtype=torch.int32, device=dev)
        _kept_set_kernel[(r,)](x, x.stride(0), v, *params, *results, run_all, run_all, out.logz, run_all, run_all, v,
                               COMPACT=False, **settings)
        return out
    # Rows cut to their candidates first (many programs per row); each row is then searched
    # over its candidates, or over its full row where they did not fit.
    pf = prefilter_module.prefilter(x, *params)
    out.candidates = pf
    full = pf.full_row
    short = {**settings, "BLOCK": COMPACT_BLOCK, "num_warps": COMPACT_WARPS}
    _kept_set_kernel[(r,)](pf.x, pf.x.stride(0), v, *params, *results, full, pf.count, pf.row_z, pf.row_finite,
                           pf.ids, v, COMPACT=True, **short)
    _kept_set_kernel[(r,)](x, x.stride(0), v, *params, *results, 1 - full, pf.count, pf.row_z, pf.row_finite,
                           pf.ids, v, COMPACT=False, **settings)
    return out


def dense_mask(proc: torch.Tensor, value: torch.Tensor, last_id: torch.Tensor) -> torch.Tensor:
    """bool [R, V] of the kept prefixes (one launch)."""
    x = proc if proc.stride(1) == 1 else proc.contiguous()
    r, v = x.shape
    mask = torch.empty(r, v, dtype=torch.int8, device=x.device)
    if r:
        _mask_kernel[(r, triton.cdiv(v, MASK_BLOCK))](x, x.stride(0), v, value, last_id, mask, BLOCK=MASK_BLOCK,
                                                       num_warps=4)
    return mask.view(torch.bool)


def _bounds_of_mask(proc: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, last_id) of kept prefixes given as a dense mask (the full sort's)."""
    value = proc.masked_fill(~mask, math.inf).min(dim=1).values
    ids = torch.arange(proc.shape[1], device=proc.device).expand_as(proc)
    last = torch.where(mask & (proc == value.unsqueeze(1)), ids, -1).max(dim=1).values
    return value.float(), last.to(torch.int32)


def redo_flagged(proc, temperature, top_k, top_p, min_p, b: KeptBounds) -> None:
    """Redoes the rows the kernel flagged by the full sort, in place (none on realistic logits)."""
    rows = b.failed.nonzero().squeeze(1)
    fs = kept_set_full_sort(proc[rows], temperature[rows], top_k[rows], top_p[rows], min_p[rows])
    value, last = _bounds_of_mask(proc[rows], fs.mask)
    empty = fs.count == 0
    b.value[rows] = torch.where(empty, math.inf, value)
    b.last_id[rows] = torch.where(empty, -1, last)
    b.count[rows] = fs.count.to(torch.int32)
    b.logz[rows] = fs.logz
    b.failed[rows] = 0
    if b.candidates is not None:  # the redone sets are described on the full rows
        b.candidates.full_row[rows] = 1


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    """int32 [R+1] exclusive cumsum of counts, on their device (a total below R * V < 2**31)."""
    offsets = torch.zeros(counts.shape[0] + 1, dtype=torch.int32, device=counts.device)
    torch.cumsum(counts, dim=0, dtype=torch.int32, out=offsets[1:])
    return offsets


def _total_and_flagged(offsets: torch.Tensor, failed: torch.Tensor) -> tuple[int, int]:
    """The one device->host copy of the CSR path: ids to allocate, rows flagged."""
    total, flagged = torch.stack([offsets[-1], failed.sum(dtype=torch.int32)]).tolist()
    return total, flagged


def candidate_rows(pf: prefilter_module.Candidates) -> torch.Tensor:
    """int32 [R]: each row's own candidate row, or -1 where it was searched on its full row."""
    rows = torch.arange(pf.full_row.shape[0], dtype=torch.int32, device=pf.full_row.device)
    return torch.where(pf.full_row == 0, rows, -1)


def compact(proc: torch.Tensor, b: KeptBounds, offsets: torch.Tensor, total: int,
            candidates: tuple[prefilter_module.Candidates, torch.Tensor] | None = None,
            launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """int32 [total] kept ids of every row, ascending, at ``offsets`` (one launch).

    candidates: a prefilter's rows and, per row of ``proc``, the candidate row to read
    (-1: its logits); by default ``b.candidates`` row for row.
    launch: (programs per row, logits per loop step, warps) instead of `_compact_split`'s
    choice (benchmarks/mask_compaction.py compares them)."""
    x = proc if proc.stride(1) == 1 else proc.contiguous()
    r, v = x.shape
    ids = torch.empty(total, dtype=torch.int32, device=x.device)
    if not (r and total):
        return ids
    if candidates is None and b.candidates is not None:
        candidates = (b.candidates, candidate_rows(b.candidates))
    if candidates is None:
        args = (x, offsets, 0, offsets, offsets)
    else:
        pf, src = candidates
        args = (pf.x, pf.ids, pf.x.shape[1], pf.count, src)
    parts, block, warps = launch or (*_compact_split(r, v, x.device), COMPACT_WARPS_PER_PROGRAM)
    chunk = triton.cdiv(triton.cdiv(v, parts), block) * block
    _compact_kernel[(r, parts)](x, x.stride(0), v, b.value, b.last_id, offsets, ids, *args, chunk,
                                CANDIDATE_ROWS=candidates is not None, BLOCK=block, num_warps=warps)
    return ids


def _compact_split(rows: int, v: int, device: torch.device) -> tuple[int, int]:
    """(programs per row, logits per loop step) of the compaction. On an H100
    (benchmarks/mask_compaction.py) one program per row with 4,096-logit steps is fastest
    from about one row per SM up; fewer rows are split into chunks of 2,048-logit steps,
    about two programs per SM, each recounting the kept logits before its chunk."""
    if rows >= _multiprocessors(device):
        return 1, COMPACT_ROW_BLOCK
    return _compact_parts(rows, v, device), COMPACT_PART_BLOCK


def _compact_parts(rows: int, v: int, device: torch.device) -> int:
    """Chunks per row that put about two programs on each SM (at most COMPACT_MAX_PARTS)."""
    parts = min(COMPACT_MAX_PARTS, triton.cdiv(2 * _multiprocessors(device), rows), triton.cdiv(v, COMPACT_PART_BLOCK))
    return max(1, parts)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for CPU tensors (Triton's interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def kept_set_csr(proc, temperature, top_k, top_p, min_p) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept sets of truncating, non-greedy rows as CSR on the device: offsets int32 [R+1],
    ids int32 [M] ascending per row, logz float64 [R].

    Two launches, one cumsum and one small device->host copy (sizes the ids).
    """
    b = kept_bounds(proc, temperature, top_k, top_p, min_p)
    offsets = _offsets(b.count)
    total, flagged = _total_and_flagged(offsets, b.failed)
    if flagged:
        redo_flagged(proc, temperature, top_k, top_p, min_p, b)
        offsets = _offsets(b.count)
        total = int(offsets[-1])
    return offsets, compact(proc, b, offsets, total), b.logz


def kept_set(
    proc: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    settle: bool = False,
) -> GpuKeptSet:
    """Kept sets of truncating, non-greedy rows as a dense bool mask + float64 logz (CUDA).

    Two launches. proc: float32 [R, V] processed logits (before temperature). temperature:
    [R] (> 0). top_k: int [R] (0 = off). top_p: [R] (1 = off). min_p: [R] (0 = off).

    A row the kernel could not settle (rare: none in the test grids) keeps a superset of its
    kept set, marked in ``bounds.failed``. Without ``settle`` that is left to the caller, with
    no host sync here; with ``settle`` such rows are redone by the full sort first, at the cost
    of one host read.
    """
    b = kept_bounds(proc, temperature, top_k, top_p, min_p)
    if settle and bool(b.failed.any()):
        redo_flagged(proc, temperature, top_k, top_p, min_p, b)
    return GpuKeptSet(dense_mask(proc, b.value, b.last_id), b.count, b.logz, bounds=b,
                      params=(proc, temperature, top_k, top_p, min_p))


def fill_sampling_mask_dense(
    out,
    proc: torch.Tensor,
    requested: torch.Tensor,
    slots: torch.Tensor,
    capacity: int,
    kept: GpuKeptSet | None,
    skip_rows: torch.Tensor | None = None,
) -> None:
    """`sampler._fill_sampling_mask` on CUDA: the CSR compacted from the kept bounds.

    skip_rows bool [B]: rows that keep their logz but get an empty CSR row (the caller
    writes their kept sets as bitmaps).

    slots int32 [B]: a truncating row's index in ``kept`` (>= 0), `GREEDY_SLOT` for a greedy
    row, -1 for a plain one. Truncating rows take their kept set; greedy rows their sampled
    argmax, with logz its mass under the temperature-1 softmax; other rows are empty with logz 0.
    capacity: an upper bound on the ids of all rows (the caller's, from the shapes and top_k).

    Three launches (the rows' bounds, their cumsum, the compaction) and no host read: the ids
    go into a buffer of ``capacity`` ids (``out.mask_ids``; entries past ``mask_offsets[-1]``
    are unspecified), so the host keeps queueing work while the device computes the kept sets.
    A row the kernel could not settle (``kept.bounds.failed``) gets an empty row here: its
    token is ``UNSETTLED_TOKEN`` and the caller samples the step again with settled sets.
    """
    x = proc if proc.stride(1) == 1 else proc.contiguous()
    b, v = x.shape
    dev = x.device
    value = torch.empty(b, dtype=torch.float32, device=dev)
    last = torch.empty(b, dtype=torch.int32, device=dev)
    counts = torch.empty(b, dtype=torch.int32, device=dev)
    logz = torch.empty(b, dtype=torch.float32, device=dev)
    offsets = torch.empty(b + 1, dtype=torch.int32, device=dev)
    kb = kept.bounds if kept is not None else None
    pf = kb.candidates if kb is not None else None
    src = torch.empty(b, dtype=torch.int32, device=dev) if pf is not None else counts
    # Without truncating rows the kernel reads none of these; any pointers of the types do.
    trunc = (kb.value, kb.last_id, kb.count, kb.logz, kb.failed) if kb is not None else (value, last, counts, logz,
                                                                                           counts)
    full_row = pf.full_row if pf is not None else counts
    _mask_rows_kernel[(b,)](x, x.stride(0), v, slots, requested, out.sampled_token_ids, *trunc, full_row,
                            value, last, counts, logz, src, offsets, GREEDY=GREEDY_SLOT,
                            TRUNCATED=kb is not None, CANDIDATE_ROWS=pf is not None, BLOCK=2 * BLOCK, num_warps=4)
    if skip_rows is not None:
        counts.masked_fill_(skip_rows, 0)  # an empty CSR row: the compaction does not read it
    torch.cumsum(counts, dim=0, dtype=torch.int32, out=offsets[1:])
    out.mask_offsets = offsets
    out.mask_ids = compact(x, KeptBounds(value, last, counts, logz), offsets, capacity,
                           (pf, src) if pf is not None else None)
    out.logz = logz
