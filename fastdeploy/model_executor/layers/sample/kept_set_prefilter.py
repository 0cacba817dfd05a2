"""Candidate prefilter of the GPU kept set: shrinks each row to the logits that can be kept.

The row kernel (`kept_set_gpu._kept_set_kernel`) runs one program per row, so its time is
one program's latency over the whole row, several passes long. This module first cuts every
row down with passes that many programs share (each row split into chunks):

1. the row max ``M`` (per-chunk maxima, then a reduction);
2. a histogram of ``d = (M - x) / T`` in buckets of ``WIDTH``: exact integer counts and
   float64 masses ``exp(-d)``;
3. per row, the last bucket ``J`` the search needs, for the first rule in effect (the later
   ones work inside its kept prefix): top-k needs the first ``k`` logits; top-p (without
   top-k) needs buckets holding ``top_p`` of the row's mass, with a margin far above the
   float64 rounding of the sums; min-p alone keeps ``d <= -ln(min_p)``;
4. the logits of buckets ``<= J`` are written in id order (a stable compaction), and the
   mass and count of the rest are summed (float64), since the row kernel's normaliser and
   top-k test cover the whole row.

The bucket of a logit is a monotone function of its value, so the candidates are exactly the
logits above a value: every count the row kernel takes above its search interval's lower end
is the whole row's count. A row whose candidates exceed ``CAP`` (flat rows, where top-p keeps
most of the vocabulary) is left to the row kernel on its full row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # pragma: no cover - only on machines with triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means no kernel
    triton = None

BINS = 128  # histogram bins: BINS - 2 value buckets, one below them, one for -inf / padding
WIDTH = 0.25  # bucket width in units of the temperature
CAP = 16384  # candidates per row the row kernel reads; rows with more use their full row
CHUNK = 8192  # logits per program of the prefilter passes
BLOCK = 1024
MASS_SLACK = 1e-9  # relative margin on the float64 bucket masses when choosing J for top-p
# Prefilter only batches at least this large (below it the row kernel alone is as fast).
MIN_ROWS = 8


@dataclass
class Candidates:
    """Rows cut to their candidates, in id order.

    x: float32 [R, CAP] logits, ids: int32 [R, CAP] their vocabulary ids, count: int32 [R].
    extra_z: float64 [R, S], per chunk, sum of exp((x - M) / T) over the finite logits left out.
    extra_finite: int32 [R, S], per chunk, how many finite logits were left out.
    full_row: int32 [R], 1 for rows too wide for CAP (their candidates are not written).
    """

    x: torch.Tensor
    ids: torch.Tensor
    count: torch.Tensor
    extra_z: torch.Tensor
    extra_finite: torch.Tensor
    full_row: torch.Tensor


if triton is not None:

    @triton.jit
    def _bucket(x, m, it, NB: tl.constexpr, WIDTH: tl.constexpr):
        """Bucket of each logit: floor(d / WIDTH) for d = (m - x) * it, NB beyond the range,
        NB + 1 for -inf. The same float32 arithmetic everywhere keeps it monotone in x."""
        d = (m - x) * it
        j = tl.minimum(d * (1.0 / WIDTH), NB * 1.0).to(tl.int32)
        return tl.where(x > float("-inf"), j, NB + 1)

    @triton.jit
    def _row_max(pmax_ptr, row, S):
        m = tl.full((), float("-inf"), tl.float32)
        for c in range(S):
            m = tl.maximum(m, tl.load(pmax_ptr + row * S + c))
        return m

    @triton.jit
    def _chunk_max_kernel(x_ptr, stride, V, pmax_ptr, S, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        acc = tl.full([BLOCK], float("-inf"), tl.float32)
        for i in range(0, CHUNK, BLOCK):
            o = c * CHUNK + i + offs
            acc = tl.maximum(acc, tl.load(x_ptr + row * stride + o, mask=o < V, other=float("-inf")))
        tl.store(pmax_ptr + row * S + c, tl.max(acc, axis=0))

    @triton.jit
    def _histogram_kernel(x_ptr, stride, V, pmax_ptr, t_ptr, cnt_ptr, mass_ptr, S, NB: tl.constexpr,
                          BINS: tl.constexpr, WIDTH: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Per (row, chunk): counts and float64 masses of each bucket (masses by atomic adds into
        the chunk's own bins; the bucket beyond the range is summed in registers)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        m = _row_max(pmax_ptr, row, S)
        it = 1.0 / tl.load(t_ptr + row).to(tl.float32)
        it64 = 1.0 / tl.load(t_ptr + row).to(tl.float64)
        h = tl.zeros([BINS], dtype=tl.int32)
        far = tl.zeros([BLOCK], dtype=tl.float64)
        bins = mass_ptr + (row * S + c) * BINS
        for i in range(0, CHUNK, BLOCK):
            o = c * CHUNK + i + offs
            x = tl.load(x_ptr + row * stride + o, mask=o < V, other=float("-inf"))
            j = _bucket(x, m, it, NB, WIDTH)
            h += tl.histogram(j, BINS)
            e = tl.exp((x.to(tl.float64) - m.to(tl.float64)) * it64)
            tl.atomic_add(bins + j, e, mask=j < NB, sem="relaxed")
            far += tl.where(j == NB, e, 0.0)
        tl.store(cnt_ptr + (row * S + c) * BINS + tl.arange(0, BINS), h)
        tl.atomic_add(bins + NB, tl.sum(far, axis=0), sem="relaxed")

    @triton.jit
    def _choose_kernel(cnt_ptr, mass_ptr, k_ptr, p_ptr, mp_ptr, last_ptr, count_ptr, full_ptr, S,
                       CAP, SLACK: tl.constexpr, NB: tl.constexpr, BINS: tl.constexpr, WIDTH: tl.constexpr):
        """Per row: the last bucket the row kernel needs, the candidates' count, whether they fit."""
        row = tl.program_id(0).to(tl.int64)
        jb = tl.arange(0, BINS)
        cnt = tl.zeros([BINS], dtype=tl.int32)
        mass = tl.zeros([BINS], dtype=tl.float64)
        for c in range(S):
            cnt += tl.load(cnt_ptr + (row * S + c) * BINS + jb)
            mass += tl.load(mass_ptr + (row * S + c) * BINS + jb)
        value = jb < NB
        cum = tl.cumsum(tl.where(value, cnt, 0), axis=0)
        finite = tl.sum(tl.where(jb <= NB, cnt, 0), axis=0)
        total = tl.sum(tl.where(jb <= NB, mass, 0.0), axis=0)
        cmass = tl.cumsum(tl.where(value, mass, 0.0), axis=0)
        k = tl.load(k_ptr + row).to(tl.int32)
        p = tl.load(p_ptr + row).to(tl.float64)
        mp = tl.minimum(tl.load(mp_ptr + row).to(tl.float64), 1.0)
        k_on = (k > 0) & (k < finite)
        k_last = tl.sum((value & (cum < k)).to(tl.int32), axis=0)
        p_last = tl.sum((value & (cmass * (1.0 - SLACK) < p * total * (1.0 + SLACK))).to(tl.int32), axis=0)
        # d <= -ln(min_p), one bucket of slack for the float32 d
        m_d = -tl.log(tl.maximum(mp, 1e-300)) / WIDTH * (1.0 + 1e-5)
        m_last = tl.minimum(m_d, NB * 1.0).to(tl.int32) + 1
        last = tl.where(k_on, k_last, tl.where(p < 1.0, p_last, tl.where(mp > 0.0, m_last, NB)))
        last = tl.minimum(last, NB)
        count = tl.sum(tl.where(jb <= last, cnt, 0), axis=0)
        tl.store(last_ptr + row, last)
        tl.store(count_ptr + row, count)
        tl.store(full_ptr + row, (count > CAP).to(tl.int32))

    @triton.jit
    def _chunk_count_kernel(x_ptr, stride, V, pmax_ptr, t_ptr, last_ptr, full_ptr, ccnt_ptr, S, NB: tl.constexpr,
                            WIDTH: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        n = tl.zeros((), dtype=tl.int32)
        if tl.load(full_ptr + row) == 0:
            offs = tl.arange(0, BLOCK)
            m = _row_max(pmax_ptr, row, S)
            it = 1.0 / tl.load(t_ptr + row).to(tl.float32)
            last = tl.load(last_ptr + row)
            for i in range(0, CHUNK, BLOCK):
                o = c * CHUNK + i + offs
                x = tl.load(x_ptr + row * stride + o, mask=o < V, other=float("-inf"))
                n += tl.sum((_bucket(x, m, it, NB, WIDTH) <= last).to(tl.int32), axis=0)
        tl.store(ccnt_ptr + row * S + c, n)

    @triton.jit
    def _compact_candidates_kernel(x_ptr, stride, V, pmax_ptr, t_ptr, last_ptr, full_ptr, ccnt_ptr, cx_ptr, cid_ptr,
                                   oz_ptr, of_ptr, S, CAP, NB: tl.constexpr, WIDTH: tl.constexpr,
                                   CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Writes the chunk's candidates after those of the chunks before it (id order), and the
        mass and count of the finite logits it leaves out (per chunk: summed in a fixed order
        later, so the result does not depend on scheduling)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        ez = tl.zeros((), dtype=tl.float64)
        ef = tl.zeros((), dtype=tl.int32)
        if tl.load(full_ptr + row) == 0:
            offs = tl.arange(0, BLOCK)
            m = _row_max(pmax_ptr, row, S)
            it = 1.0 / tl.load(t_ptr + row).to(tl.float32)
            it64 = 1.0 / tl.load(t_ptr + row).to(tl.float64)
            last = tl.load(last_ptr + row)
            base = tl.zeros((), dtype=tl.int32)
            for c2 in range(c):
                base += tl.load(ccnt_ptr + row * S + c2)
            zs = tl.zeros([BLOCK], dtype=tl.float64)
            fs = tl.zeros([BLOCK], dtype=tl.int32)
            for i in range(0, CHUNK, BLOCK):
                o = c * CHUNK + i + offs
                x = tl.load(x_ptr + row * stride + o, mask=o < V, other=float("-inf"))
                j = _bucket(x, m, it, NB, WIDTH)
                sel = j <= last
                si = sel.to(tl.int32)
                pos = base + tl.cumsum(si, axis=0) - 1
                tl.store(cx_ptr + row * CAP + pos, x, mask=sel)
                tl.store(cid_ptr + row * CAP + pos, o, mask=sel)
                base += tl.sum(si, axis=0)
                out = (j > last) & (j <= NB)
                zs += tl.where(out, tl.exp((x.to(tl.float64) - m.to(tl.float64)) * it64), 0.0)
                fs += out.to(tl.int32)
            ez = tl.sum(zs, axis=0)
            ef = tl.sum(fs, axis=0)
        tl.store(oz_ptr + row * S + c, ez)
        tl.store(of_ptr + row * S + c, ef)


def prefilter(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor) -> Candidates:
    """Candidates of each row of x (float32 [R, V], unit stride): five launches, no host sync."""
    r, v = x.shape
    dev = x.device
    s = triton.cdiv(v, CHUNK)
    grid = (r, s)
    t = temperature.float().contiguous()
    nb = BINS - 2
    pmax = torch.empty(r, s, dtype=torch.float32, device=dev)
    _chunk_max_kernel[grid](x, x.stride(0), v, pmax, s, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    cnt = torch.empty(r, s, BINS, dtype=torch.int32, device=dev)
    mass = torch.zeros(r, s, BINS, dtype=torch.float64, device=dev)
    _histogram_kernel[grid](x, x.stride(0), v, pmax, t, cnt, mass, s, NB=nb, BINS=BINS, WIDTH=WIDTH, CHUNK=CHUNK,
                            BLOCK=BLOCK, num_warps=4)
    last = torch.empty(r, dtype=torch.int32, device=dev)
    count = torch.empty(r, dtype=torch.int32, device=dev)
    full = torch.empty(r, dtype=torch.int32, device=dev)
    _choose_kernel[(r,)](cnt, mass, top_k, top_p, min_p, last, count, full, s, CAP,
                         SLACK=MASS_SLACK, NB=nb, BINS=BINS, WIDTH=WIDTH, num_warps=4)
    chunk_count = torch.empty(r, s, dtype=torch.int32, device=dev)
    _chunk_count_kernel[grid](x, x.stride(0), v, pmax, t, last, full, chunk_count, s, NB=nb, WIDTH=WIDTH,
                              CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    cx = torch.empty(r, CAP, dtype=torch.float32, device=dev)
    cid = torch.empty(r, CAP, dtype=torch.int32, device=dev)
    extra_z = torch.empty(r, s, dtype=torch.float64, device=dev)
    extra_finite = torch.empty(r, s, dtype=torch.int32, device=dev)
    _compact_candidates_kernel[grid](x, x.stride(0), v, pmax, t, last, full, chunk_count, cx, cid, extra_z,
                                     extra_finite, s, CAP, NB=nb, WIDTH=WIDTH, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    return Candidates(cx, cid, count, extra_z, extra_finite, full)
