"""Kept set (top-k -> top-p -> min-p) on the GPU without sorting the vocabulary.

The kept set of a row is a prefix of the row in (logit descending, id ascending)
order, the order of the float64 reference's stable sort (`reference.py`). A prefix
is fully described by its last entry: its value ``bv`` and id ``bid``. The kept ids
are then ``{i : x_i > bv} ∪ {i : x_i == bv, i <= bid}`` (never -inf), which one pass
writes as a bool [R, V] mask; CSR compaction on the device (`mask_to_csr`) follows,
so only the kept ids cross PCIe.

Finding the last entry of each rule, every row at once and with several programs
per row (so that a batch of 1 still fills the GPU):

1. Stats: row max ``M`` and smallest finite logit.
2. Top-k (rows with k < #finite): ``K_PASSES`` passes narrow a value interval
   ``(a, b]`` holding the k-th largest value; each pass counts ``#{x > t}`` at 16
   evenly spaced pivots in the interval (counts are exact). A finalise pass then
   gathers the few logits inside ``(a, b]`` (the candidates) with their ids, and the
   float64 mass above ``b``; sorting just the candidates gives the k-th entry and the
   top-k mass ``Z_k`` exactly.
3. Top-p: the same with the mass ``Σ_{x > t} exp((x - M) / T) / Z_k`` at the pivots,
   in float32 (``P_PASSES`` passes). A pivot only moves an end of the interval when
   its estimate is more than ``MASS_MARGIN`` away from ``top_p``, so the true
   boundary stays inside ``(a, b]`` whatever the float32 rounding. The finalise pass
   recomputes the mass above ``b`` in float64, and a float64 running sum over the
   sorted candidates applies the reference's test ``before < top_p`` exactly. The
   search starts at ``M - 50 T`` at the lowest: all tokens below carry less than
   ``V e^-50 < 1e-16`` of the mass, so a float32 ``top_p < 1`` always stops above.
4. Min-p: a value threshold; one pass counts ``exp((x - M) / T) >= min_p`` in float64.

The kept prefix is the shortest of the three. A final pass writes the mask and sums
the kept and the total mass in float64, so ``logZ = log(kept / total)`` matches the
reference to ~1e-15. Rows the search cannot settle (more than ``CANDIDATES``
logits inside the final interval, e.g. thousands of equal logits, or top_p within
the margin of 1) are redone by the full sort; they cost one host sync to detect.

Passes read the row from memory (B·V·4 bytes each, about 50 µs at B = 256, V = 152k
on an H100), against a sort that moves the row many times; see
benchmarks/sampling_mask.py.

Entry points: `kept_set` (dense mask + logz of truncating rows: this path on CUDA,
the windowed sort of `truncation.py` on CPU), `mask_to_csr` and
`fill_sampling_mask_dense` (the sampler's CSR output from a dense kept set).
"""

from __future__ import annotations

import math

import torch

from fastdeploy.model_executor.layers.sample.reference import kept_set_full_sort
from fastdeploy.model_executor.layers.sample.truncation import KeptSet, kept_logz, kept_window, scaled_lse

try:  # pragma: no cover - only on machines with triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means no kernel
    triton = None

PIVOTS = 16  # pivots per search pass: each pass narrows the interval ~16x
K_PASSES = 3
P_PASSES = 3
CANDIDATES = 4096  # logits gathered per row from the final interval
MASS_MARGIN = 1e-4  # float32 mass estimates are within ~2e-5 of the truth (relative)
SPAN = 50.0  # tokens more than SPAN * T below the max carry < V e^-SPAN of the mass
BLOCK = 1024
PASS_BLOCK = 256  # [PASS_BLOCK, PIVOTS] accumulators per program
TARGET_PROGRAMS = 1024  # programs per launch: several per SM on an H100 (132 SMs)


def uses_fast_path(device: torch.device) -> bool:
    """Whether `kept_set` takes the sort-free Triton path on ``device`` (CUDA with Triton)."""
    return device.type == "cuda" and triton is not None


# ---------------------------------------------------------------------------------
# order-preserving int32 keys of float32 values (candidates are sorted by them)


def ordered_key(x: torch.Tensor) -> torch.Tensor:
    """int32 keys with key(a) < key(b) <=> a < b for float32 a, b (no NaN). -0.0 == +0.0."""
    b = (x.float() + 0.0).view(torch.int32)  # + 0.0 folds -0.0 into +0.0
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def key_to_float(k: torch.Tensor) -> torch.Tensor:
    """Inverse of `ordered_key` (the map is an involution on the bit pattern)."""
    k = k.to(torch.int32)
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).view(torch.float32)


# ---------------------------------------------------------------------------------
# kernels: grid (rows, programs per row); program s reads row[s * chunk : (s + 1) * chunk]

if triton is not None:

    @triton.jit
    def _tkey(x):
        b = (x + 0.0).to(tl.int32, bitcast=True)
        return b ^ ((b >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _stats_kernel(x_ptr, stride, V, chunk, pmax_ptr, pmin_ptr, S, BLOCK: tl.constexpr):
        """Partial max and smallest finite value (+inf if none) of each chunk."""
        row = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        xrow = x_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        mn = tl.full([BLOCK], float("inf"), tl.float32)
        for i in range(0, chunk, BLOCK):
            o = s * chunk + i + offs
            valid = o < V
            x = tl.load(xrow + o, mask=valid, other=float("-inf"))
            mx = tl.maximum(mx, x)
            mn = tl.minimum(mn, tl.where(x > float("-inf"), x, float("inf")))
        tl.store(pmax_ptr + row * S + s, tl.max(mx, axis=0))
        tl.store(pmin_ptr + row * S + s, tl.min(mn, axis=0))

    @triton.jit
    def _pivot_pass_kernel(
        x_ptr, stride, V, chunk, act_ptr, piv_ptr, m_ptr, it_ptr, out_ptr, z_ptr, S,
        MASS: tl.constexpr, WITH_Z: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Per pivot t: #{x > t} (MASS=False) or float32 Σ_{x > t} exp((x - M) / T) (MASS=True).

        WITH_Z also sums the whole chunk's mass in float64 (the exact normaliser).
        """
        row = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        jj = tl.arange(0, P)
        acc = tl.zeros([BLOCK, P], dtype=tl.float32)
        z = tl.zeros([BLOCK], dtype=tl.float64)
        if tl.load(act_ptr + row) != 0:
            xrow = x_ptr + row * stride
            offs = tl.arange(0, BLOCK)
            piv = tl.load(piv_ptr + row * P + jj)
            m = tl.load(m_ptr + row)
            it = tl.load(it_ptr + row)  # 1 / T, float64
            it32 = it.to(tl.float32)
            for i in range(0, chunk, BLOCK):
                o = s * chunk + i + offs
                valid = o < V
                x = tl.load(xrow + o, mask=valid, other=float("-inf"))
                gt = x[:, None] > piv[None, :]
                if MASS:
                    e = tl.exp((x - m) * it32)
                    acc += tl.where(gt, e[:, None], 0.0)
                else:
                    acc += gt.to(tl.float32)
                if WITH_Z:
                    z += tl.exp((x.to(tl.float64) - m.to(tl.float64)) * it)
        tl.store(out_ptr + (row * S + s) * P + jj, tl.sum(acc, axis=0))
        if WITH_Z:
            tl.store(z_ptr + row * S + s, tl.sum(z, axis=0))

    @triton.jit
    def _finalize_kernel(
        x_ptr, stride, V, chunk, act_ptr, a_ptr, b_ptr, m_ptr, it_ptr,
        gt_ptr, mass_ptr, cand_ptr, ncand_ptr, S, C, BLOCK: tl.constexpr,
    ):
        """#{x > b}, float64 mass above b, and the candidates a < x <= b as int64 keys
        (ordered_key(x) << 32 | (V - 1 - id): descending key order = the reference's order)."""
        row = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        cnt = tl.zeros([BLOCK], dtype=tl.int32)
        mass = tl.zeros([BLOCK], dtype=tl.float64)
        if tl.load(act_ptr + row) != 0:
            xrow = x_ptr + row * stride
            offs = tl.arange(0, BLOCK)
            a = tl.load(a_ptr + row)
            b = tl.load(b_ptr + row)
            m = tl.load(m_ptr + row).to(tl.float64)
            it = tl.load(it_ptr + row)
            for i in range(0, chunk, BLOCK):
                o = s * chunk + i + offs
                valid = o < V
                x = tl.load(xrow + o, mask=valid, other=float("-inf"))
                above = x > b
                cnt += above.to(tl.int32)
                mass += tl.where(above, tl.exp((x.to(tl.float64) - m) * it), 0.0)
                sel = (x > a) & (x <= b) & valid
                nsel = tl.sum(sel.to(tl.int32), axis=0)
                if nsel > 0:
                    base = tl.atomic_add(ncand_ptr + row, nsel)
                    pos = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                    key = (_tkey(x).to(tl.int64) << 32) | (V - 1 - o).to(tl.int64)
                    tl.store(cand_ptr + row * C + pos, key, mask=sel & (pos < C))
        tl.store(gt_ptr + row * S + s, tl.sum(cnt, axis=0))
        tl.store(mass_ptr + row * S + s, tl.sum(mass, axis=0))

    @triton.jit
    def _min_p_kernel(x_ptr, stride, V, chunk, mp_ptr, m_ptr, it_ptr, cnt_ptr, low_ptr, S, BLOCK: tl.constexpr):
        """#{exp((x - M) / T) >= min_p} (float64) and the smallest such x, per chunk."""
        row = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        cnt = tl.zeros([BLOCK], dtype=tl.int32)
        low = tl.full([BLOCK], float("inf"), tl.float32)
        mp = tl.load(mp_ptr + row).to(tl.float64)
        if mp > 0.0:
            xrow = x_ptr + row * stride
            offs = tl.arange(0, BLOCK)
            m = tl.load(m_ptr + row).to(tl.float64)
            it = tl.load(it_ptr + row)
            for i in range(0, chunk, BLOCK):
                o = s * chunk + i + offs
                x = tl.load(xrow + o, mask=o < V, other=float("-inf"))
                ok = tl.exp((x.to(tl.float64) - m) * it) >= mp
                cnt += ok.to(tl.int32)
                low = tl.minimum(low, tl.where(ok, x, float("inf")))
        tl.store(cnt_ptr + row * S + s, tl.sum(cnt, axis=0))
        tl.store(low_ptr + row * S + s, tl.min(low, axis=0))

    @triton.jit
    def _mask_kernel(
        x_ptr, stride, V, chunk, bv_ptr, bid_ptr, m_ptr, it_ptr, mask_ptr, cnt_ptr, kept_ptr, z_ptr, S,
        BLOCK: tl.constexpr,
    ):
        """mask = (x > bv) | (x == bv & id <= bid), finite; kept count, float64 kept and total mass."""
        row = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        xrow = x_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        bv = tl.load(bv_ptr + row)
        bid = tl.load(bid_ptr + row)
        m = tl.load(m_ptr + row).to(tl.float64)
        it = tl.load(it_ptr + row)
        cnt = tl.zeros([BLOCK], dtype=tl.int32)
        kept = tl.zeros([BLOCK], dtype=tl.float64)
        z = tl.zeros([BLOCK], dtype=tl.float64)
        for i in range(0, chunk, BLOCK):
            o = s * chunk + i + offs
            valid = o < V
            x = tl.load(xrow + o, mask=valid, other=float("-inf"))
            keep = ((x > bv) | ((x == bv) & (o <= bid))) & (x > float("-inf"))
            tl.store(mask_ptr + row * V + o, keep.to(tl.int8), mask=valid)
            e = tl.exp((x.to(tl.float64) - m) * it)
            cnt += keep.to(tl.int32)
            kept += tl.where(keep, e, 0.0)
            z += e
        tl.store(cnt_ptr + row * S + s, tl.sum(cnt, axis=0))
        tl.store(kept_ptr + row * S + s, tl.sum(kept, axis=0))
        tl.store(z_ptr + row * S + s, tl.sum(z, axis=0))


# ---------------------------------------------------------------------------------
# host side: launches and small per-row torch ops, no host sync until the fallback check


class _Rows:
    """A batch of rows and how it is split into chunks, one program per (row, chunk)."""

    def __init__(self, proc: torch.Tensor, temperature: torch.Tensor):
        self.x = proc if proc.stride(1) == 1 else proc.contiguous()
        self.r, self.v = proc.shape
        self.dev = proc.device
        per_row = max(1, min(triton.cdiv(self.v, BLOCK), triton.cdiv(TARGET_PROGRAMS, max(self.r, 1))))
        self.chunk = triton.cdiv(triton.cdiv(self.v, per_row), BLOCK) * BLOCK
        self.s = triton.cdiv(self.v, self.chunk)
        self.inv_t = (1.0 / temperature.to(device=self.dev, dtype=torch.float64)).contiguous()

    @property
    def grid(self) -> tuple[int, int]:
        return (self.r, self.s)

    def empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((self.r, self.s, *shape) if shape else (self.r, self.s), dtype=dtype, device=self.dev)


def _search(rows: _Rows, act, lo, hi, m, accept, mass: bool, passes: int, want_z: bool = False):
    """Narrow (lo, hi] per active row over ``passes`` pivot passes.

    ``accept(values [R, P], z) -> (hi_ok, lo_ok)``: bool [R, P], pivots that may become the
    new upper / lower end; z is the float64 row mass (want_z: summed in the first pass),
    else None. Returns (lo, hi, z).
    """
    frac = torch.arange(1, PIVOTS + 1, device=rows.dev, dtype=torch.float32) / PIVOTS
    act_i = act.to(torch.int8)
    z = None
    for n in range(passes):
        piv = lo.unsqueeze(1) + (hi - lo).unsqueeze(1) * frac
        piv = torch.minimum(torch.maximum(piv, lo.unsqueeze(1)), hi.unsqueeze(1))
        piv[:, -1] = hi
        piv = piv.contiguous()
        out = rows.empty(PIVOTS, dtype=torch.float32)
        with_z = want_z and n == 0
        pz = rows.empty(dtype=torch.float64) if with_z else out
        _pivot_pass_kernel[rows.grid](
            rows.x, rows.x.stride(0), rows.v, rows.chunk, act_i, piv, m, rows.inv_t, out, pz, rows.s,
            MASS=mass, WITH_Z=with_z, P=PIVOTS, BLOCK=PASS_BLOCK, num_warps=4,
        )
        if with_z:
            z = pz.sum(dim=1)
        vals = out.sum(dim=1, dtype=torch.float64)  # [R, P]
        hi_ok, lo_ok = accept(vals, z)
        hi_ok[:, -1] = True  # hi itself satisfies the invariant
        j_hi = hi_ok.to(torch.int8).argmax(dim=1)  # first acceptable pivot from below
        # lower end: the last lo_ok pivot below j_hi, or the old lo
        below = lo_ok & (torch.arange(PIVOTS, device=rows.dev) < j_hi.unsqueeze(1))
        j_lo = PIVOTS - 1 - below.flip(1).to(torch.int8).argmax(dim=1)
        new_lo = torch.where(below.any(dim=1), piv.gather(1, j_lo.unsqueeze(1)).squeeze(1), lo)
        new_hi = piv.gather(1, j_hi.unsqueeze(1)).squeeze(1)
        lo = torch.where(act, new_lo, lo)
        hi = torch.where(act, new_hi, hi)
    return lo, hi, z


class _Candidates:
    """Finalise pass results: #{x > b}, float64 mass above b, and the sorted candidates."""

    def __init__(self, rows: _Rows, act, a, b, m):
        gt = rows.empty(dtype=torch.int32)
        mass = rows.empty(dtype=torch.float64)
        cand = torch.full((rows.r, CANDIDATES), torch.iinfo(torch.int64).min, dtype=torch.int64, device=rows.dev)
        ncand = torch.zeros(rows.r, dtype=torch.int32, device=rows.dev)
        _finalize_kernel[rows.grid](
            rows.x, rows.x.stride(0), rows.v, rows.chunk, act.to(torch.int8), a, b, m, rows.inv_t,
            gt, mass, cand, ncand, rows.s, CANDIDATES, BLOCK=BLOCK, num_warps=4,
        )
        self.gt = gt.sum(dim=1, dtype=torch.int64)
        self.mass = mass.sum(dim=1)
        self.n = ncand.long()
        self.overflow = act & (self.n > CANDIDATES)
        keys = cand.sort(dim=1, descending=True).values
        self.values = key_to_float((keys >> 32).to(torch.int32))
        self.ids = rows.v - 1 - (keys & 0xFFFFFFFF)
        self.valid = torch.arange(CANDIDATES, device=rows.dev).unsqueeze(0) < self.n.unsqueeze(1)
        # float64 mass of each candidate relative to the row max; 0 for empty slots
        e = torch.exp((self.values.double() - m.double().unsqueeze(1)) * rows.inv_t.unsqueeze(1))
        self.e = torch.where(self.valid, e, 0.0)

    def entry(self, j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(value, id) of candidate j per row (j clamped into the buffer)."""
        j = j.clamp(0, CANDIDATES - 1).unsqueeze(1)
        return self.values.gather(1, j).squeeze(1), self.ids.gather(1, j).squeeze(1)


def _triton_kept_set(proc, temperature, top_k, top_p, min_p, uses_top_p: bool) -> tuple[KeptSet, torch.Tensor]:
    """The sort-free kept set and a bool [R] of rows it could not settle."""
    rows = _Rows(proc.float(), temperature)
    r, v, dev = rows.r, rows.v, rows.dev
    tp = top_p.to(device=dev, dtype=torch.float64)
    mp = min_p.to(device=dev, dtype=torch.float32).contiguous()
    k = top_k.to(device=dev, dtype=torch.int64)
    big = torch.full((r,), v + 1, dtype=torch.int64, device=dev)  # "rule off": longer than any prefix

    pmax = rows.empty(dtype=torch.float32)
    pmin = rows.empty(dtype=torch.float32)
    _stats_kernel[rows.grid](rows.x, rows.x.stride(0), v, rows.chunk, pmax, pmin, rows.s, BLOCK=BLOCK, num_warps=4)
    m = pmax.max(dim=1).values.contiguous()
    finite_min = pmin.min(dim=1).values
    # strictly below every finite logit: #{x > start} = all finite tokens
    start = torch.nextafter(finite_min, torch.full_like(finite_min, -math.inf))
    failed = torch.zeros(r, dtype=torch.bool, device=dev)

    # top-k
    k_on = (k > 0) & (k < v)
    # rows without top-k skip the passes inside the kernels
    lo, hi, _ = _search(
        rows, k_on, start, m.clone(), m,
        lambda cnt, _z: (cnt < k.unsqueeze(1), cnt >= k.unsqueeze(1)), mass=False, passes=K_PASSES,
    )
    cand = _Candidates(rows, k_on, lo.contiguous(), hi.contiguous(), m)
    j = k - cand.gt - 1  # position of the k-th entry among the candidates
    # fewer candidates than needed: k exceeds the finite tokens, so top-k cuts nothing
    k_on = k_on & (j < cand.n)
    failed |= k_on & cand.overflow
    bv_k, bid_k = cand.entry(j)
    in_k = torch.arange(CANDIDATES, device=dev).unsqueeze(0) <= j.unsqueeze(1)
    z_k = cand.mass + (cand.e * in_k).sum(dim=1)  # float64 top-k mass (rows with k_on)
    n_k = torch.where(k_on, k, big)

    # top-p on the top-k renormalised mass
    n_p, bv_p, bid_p = big, m, big
    p_on = tp < 1.0
    if uses_top_p:
        floor = torch.maximum(start, m - SPAN / rows.inv_t.float())
        # with top-k, the boundary is at or above the k-th value
        floor = torch.where(k_on, torch.maximum(floor, torch.nextafter(bv_k, torch.full_like(bv_k, -math.inf))), floor)
        tp_col = tp.unsqueeze(1)

        def accept(mass, z):
            q = mass / torch.where(k_on, z_k, z).unsqueeze(1)
            return q < tp_col - MASS_MARGIN, q >= tp_col + MASS_MARGIN

        lo, hi, z = _search(rows, p_on, floor.contiguous(), m.clone(), m, accept, mass=True, passes=P_PASSES,
                            want_z=True)
        zk = torch.where(k_on, z_k, z)
        cand = _Candidates(rows, p_on, lo.contiguous(), hi.contiguous(), m)
        cum = cand.mass.unsqueeze(1) + torch.cumsum(cand.e, dim=1)  # mass through candidate j
        before = (cum - cand.e) / zk.unsqueeze(1)
        kept = cand.valid & (before < tp_col)
        c = kept.sum(dim=1)
        # all candidates kept while the mass is still short of top_p: boundary below the interval
        short = (c == cand.n) & (cum.gather(1, (cand.n - 1).clamp(0, CANDIDATES - 1).unsqueeze(1)).squeeze(1) / zk < tp)
        failed |= p_on & (cand.overflow | (c == 0) | short)
        bv_p, bid_p = cand.entry(c - 1)
        n_p = torch.where(p_on, cand.gt + c, big)

    # min-p: every tie of the threshold value is kept
    pc = rows.empty(dtype=torch.int32)
    pl = rows.empty(dtype=torch.float32)
    _min_p_kernel[rows.grid](rows.x, rows.x.stride(0), v, rows.chunk, mp, m, rows.inv_t, pc, pl, rows.s,
                             BLOCK=BLOCK, num_warps=4)
    n_m = torch.where(min_p.to(dev) > 0, pc.sum(dim=1, dtype=torch.int64).clamp(min=1), big)
    bv_m = pl.min(dim=1).values

    # the shortest prefix wins; no rule at all keeps every finite token
    n_all = torch.stack([n_k, n_p, n_m], dim=1)
    pick = n_all.argmin(dim=1, keepdim=True)
    none = n_all.min(dim=1).values > v
    bv = torch.stack([bv_k, bv_p, bv_m], dim=1).gather(1, pick).squeeze(1)
    bid = torch.stack([bid_k, bid_p, big], dim=1).gather(1, pick).squeeze(1)
    bv = torch.where(none, torch.full_like(bv, -math.inf), bv).float().contiguous()
    bid = torch.where(none, big, bid).contiguous()

    mask = torch.empty(r, v, dtype=torch.int8, device=dev)
    pcnt = rows.empty(dtype=torch.int32)
    pkept = rows.empty(dtype=torch.float64)
    pz = rows.empty(dtype=torch.float64)
    _mask_kernel[rows.grid](rows.x, rows.x.stride(0), v, rows.chunk, bv, bid, m, rows.inv_t, mask, pcnt, pkept, pz,
                            rows.s, BLOCK=BLOCK, num_warps=4)
    count = pcnt.sum(dim=1, dtype=torch.int64)
    logz = torch.log(pkept.sum(dim=1)) - torch.log(pz.sum(dim=1))
    logz = torch.where(count == 0, -math.inf, logz)  # every logit -inf: nothing can be kept
    return KeptSet(mask.view(torch.bool), count, logz), failed


def _kept_set_windowed(proc, temperature, top_k, top_p, min_p, want_logz: bool) -> KeptSet:
    """The CPU path (`truncation.kept_window`) as a dense mask."""
    r, v = proc.shape
    want = torch.ones(r, dtype=torch.bool, device=proc.device) if want_logz else None
    win = kept_window(proc, temperature, top_k, top_p, min_p, want_lse=want)
    mask = torch.zeros(r, v, dtype=torch.bool, device=proc.device)
    keep = win.keep & (win.x > -math.inf)
    # Index only the kept entries: a row's padding repeats id 0, which a scatter of
    # False could write over a kept id 0.
    rows = torch.arange(r, device=proc.device).unsqueeze(1).expand_as(keep)
    mask[rows[keep], win.idx[keep]] = True
    if want_logz:
        logz = kept_logz(win)
    else:
        logz = torch.full((r,), math.nan, dtype=torch.float64, device=proc.device)
    return KeptSet(mask, mask.sum(dim=1), logz)


def kept_set(
    proc: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    want_logz: bool = True,
    uses_top_p: bool = True,
) -> KeptSet:
    """Kept sets of truncating, non-greedy rows as a dense bool mask + float64 logz.

    Args:
        proc: float32 [R, V] processed logits (before temperature).
        temperature: [R] (> 0). top_k: int64 [R] (0 = off). top_p: [R] (1 = off).
        min_p: [R] (0 = off).
        want_logz: compute logz (else it may be NaN).
        uses_top_p: whether any row has top_p < 1, known on the host
            (`SamplingMetadata.uses_top_p`); False skips the top-p passes.

    CUDA with Triton: the sort-free search above (rows it cannot settle are redone by
    the full sort). Elsewhere: the windowed partial sort of `truncation.kept_window`.
    """
    if proc.shape[0] == 0 or not uses_fast_path(proc.device):
        return _kept_set_windowed(proc, temperature, top_k, top_p, min_p, want_logz)
    ks, failed = _triton_kept_set(proc, temperature, top_k, top_p, min_p, uses_top_p)
    if bool(failed.any()):
        rows = failed.nonzero().squeeze(1)
        fs = kept_set_full_sort(proc[rows], temperature[rows], top_k[rows], top_p[rows], min_p[rows])
        ks.mask[rows], ks.count[rows], ks.logz[rows] = fs.mask, fs.count, fs.logz
    return ks


def mask_to_csr(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [R, V] -> (offsets int32 [R+1], ids int32 [M] ascending per row), on mask's device."""
    r = mask.shape[0]
    offsets = torch.zeros(r + 1, dtype=torch.int64, device=mask.device)
    torch.cumsum(mask.sum(dim=1), dim=0, out=offsets[1:])
    ids = mask.nonzero()[:, 1].to(torch.int32)  # row-major: sorted within each row
    return offsets.to(torch.int32), ids


def fill_sampling_mask_dense(
    out,
    proc: torch.Tensor,
    requested: torch.Tensor,
    g_rows: torch.Tensor,
    t_rows: torch.Tensor,
    kept: KeptSet | None,
) -> None:
    """`sampler._fill_sampling_mask` for a dense kept set: CSR by one nonzero on the device.

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
