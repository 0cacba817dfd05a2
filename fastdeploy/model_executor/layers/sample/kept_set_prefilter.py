"""Candidate prefilter of the GPU kept set: shrinks each row to the logits that can be kept.

The row kernel (`kept_set_gpu._kept_set_kernel`) runs one program per row, so its time is
one program's latency over the whole row, several passes long. This module first cuts every
row down with passes that many programs share (each row split into chunks):

1. the row max ``M`` (per-chunk maxima, then a reduction);
2. a histogram of ``d = (M - x) / T`` in buckets of ``WIDTH`` (exact integer counts);
3. per row, the last bucket ``J`` the search needs, from the counts alone, for the first
   rule in effect (the later ones work inside its kept prefix): top-k needs the first ``k``
   logits; top-p (without top-k) needs buckets whose mass, bounded below by
   ``count * e^-(j+1)W``, reaches ``top_p`` times the row's mass, bounded above by
   ``count * e^-jW``; min-p alone keeps ``d <= -ln(min_p)``;
4. the logits of buckets ``<= J`` are written in id order (a stable compaction), and the
   mass and count of the rest are summed (float64), since the row kernel's normaliser and
   top-k test cover the whole row.

The bucket of a logit is a monotone function of its value, so the candidates are exactly the
logits above a value: every count the row kernel takes above its search interval's lower end
is the whole row's count. A row whose candidates exceed ``CAP`` (flat rows, where top-p keeps
most of the vocabulary) is left to the row kernel on its full row.
"""

from __future__ import annotations

import math
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
# Relative slack on the float32 bucket bounds of the masses (d is computed in float32).
MASS_SLACK = 1e-4


@dataclass
class Candidates:
    """Rows cut to their candidates, in id order.

    x: float32 [R, CAP] logits, ids: int32 [R, CAP] their vocabulary ids, count: int32 [R].
    extra_z: float64 [R], sum of exp((x - M) / T) over the finite logits left out.
    extra_finite: int32 [R], how many finite logits were left out.
    full_row: bool [R], rows too wide for CAP (their candidates are not written).
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
    def _chunk_max_kernel(x_ptr, stride, V, out_ptr, S, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        acc = tl.full([BLOCK], float("-inf"), tl.float32)
        for i in range(0, CHUNK, BLOCK):
            o = c * CHUNK + i + offs
            acc = tl.maximum(acc, tl.load(x_ptr + row * stride + o, mask=o < V, other=float("-inf")))
        tl.store(out_ptr + row * S + c, tl.max(acc, axis=0))

    @triton.jit
    def _histogram_kernel(x_ptr, stride, V, m_ptr, t_ptr, hist_ptr, S, NB: tl.constexpr, BINS: tl.constexpr,
                          WIDTH: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        m = tl.load(m_ptr + row)
        it = 1.0 / tl.load(t_ptr + row).to(tl.float32)
        h = tl.zeros([BINS], dtype=tl.int32)
        for i in range(0, CHUNK, BLOCK):
            o = c * CHUNK + i + offs
            x = tl.load(x_ptr + row * stride + o, mask=o < V, other=float("-inf"))
            h += tl.histogram(_bucket(x, m, it, NB, WIDTH), BINS)
        tl.store(hist_ptr + (row * S + c) * BINS + tl.arange(0, BINS), h)

    @triton.jit
    def _chunk_count_kernel(x_ptr, stride, V, m_ptr, t_ptr, last_ptr, skip_ptr, cnt_ptr, S, NB: tl.constexpr,
                            WIDTH: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        n = tl.zeros((), dtype=tl.int32)
        if tl.load(skip_ptr + row) == 0:
            offs = tl.arange(0, BLOCK)
            m = tl.load(m_ptr + row)
            it = 1.0 / tl.load(t_ptr + row).to(tl.float32)
            last = tl.load(last_ptr + row)
            for i in range(0, CHUNK, BLOCK):
                o = c * CHUNK + i + offs
                x = tl.load(x_ptr + row * stride + o, mask=o < V, other=float("-inf"))
                n += tl.sum((_bucket(x, m, it, NB, WIDTH) <= last).to(tl.int32), axis=0)
        tl.store(cnt_ptr + row * S + c, n)

    @triton.jit
    def _compact_candidates_kernel(x_ptr, stride, V, m_ptr, t_ptr, last_ptr, skip_ptr, start_ptr, cx_ptr, cid_ptr,
                                   ez_ptr, ef_ptr, S, CAP, NB: tl.constexpr, WIDTH: tl.constexpr,
                                   CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        ez = tl.zeros((), dtype=tl.float64)
        ef = tl.zeros((), dtype=tl.int32)
        if tl.load(skip_ptr + row) == 0:
            offs = tl.arange(0, BLOCK)
            m = tl.load(m_ptr + row)
            it = 1.0 / tl.load(t_ptr + row).to(tl.float32)
            it64 = 1.0 / tl.load(t_ptr + row).to(tl.float64)
            last = tl.load(last_ptr + row)
            base = tl.load(start_ptr + row * S + c)
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
                out = (j > last) & (x > float("-inf"))
                zs += tl.where(out, tl.exp((x.to(tl.float64) - m.to(tl.float64)) * it64), 0.0)
                fs += out.to(tl.int32)
            ez = tl.sum(zs, axis=0)
            ef = tl.sum(fs, axis=0)
        tl.store(ez_ptr + row * S + c, ez)
        tl.store(ef_ptr + row * S + c, ef)


def _last_bucket(hist: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """int32 [R]: the last bucket that can hold a kept logit (NB = every finite logit)."""
    nb = BINS - 2
    cnt = hist[:, :nb].double()
    below = hist[:, nb].double()
    cum = cnt.cumsum(dim=1)
    finite = cum[:, -1] + below
    j = torch.arange(nb, device=hist.device, dtype=torch.float64)
    # The row kernel applies the rules in turn, each on the previous one's kept prefix, so the
    # candidates must hold what the first active rule needs: top-k its k logits (top-p then
    # works on their mass), else top-p enough mass for certain, else min-p its threshold.
    k = top_k.to(torch.float64)
    k_on = (k > 0) & (k < finite)
    k_last = (cum < k.unsqueeze(1)).sum(dim=1)  # the first bucket whose running count reaches k
    p = top_p.to(torch.float64)
    low = (cnt * torch.exp(-(j + 1) * WIDTH)).cumsum(dim=1) * (1 - MASS_SLACK)
    high = (cnt * torch.exp(-j * WIDTH)).sum(dim=1) + below * math.exp(-nb * WIDTH)
    p_last = (low < (p * high * (1 + MASS_SLACK)).unsqueeze(1)).sum(dim=1)
    mp = min_p.to(torch.float64).clamp(max=1.0)
    # d <= -ln(min_p), one bucket of slack for the float32 d
    m_last = torch.floor(-torch.log(mp.clamp(min=1e-300)) / WIDTH * (1 + 1e-5)).clamp(max=nb).to(torch.int64) + 1
    last = torch.where(k_on, k_last, torch.where(p < 1, p_last, torch.where(mp > 0, m_last, nb)))
    return last.clamp(max=nb).to(torch.int32)


def prefilter(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor) -> Candidates:
    """Candidates of each row of x (float32 [R, V], unit stride): no host sync."""
    r, v = x.shape
    dev = x.device
    s = triton.cdiv(v, CHUNK)
    grid = (r, s)
    t = temperature.float().contiguous()
    nb = BINS - 2
    part = torch.empty(r, s, dtype=torch.float32, device=dev)
    _chunk_max_kernel[grid](x, x.stride(0), v, part, s, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    m = part.amax(dim=1)
    hist = torch.empty(r, s, BINS, dtype=torch.int32, device=dev)
    _histogram_kernel[grid](x, x.stride(0), v, m, t, hist, s, NB=nb, BINS=BINS, WIDTH=WIDTH, CHUNK=CHUNK,
                            BLOCK=BLOCK, num_warps=4)
    hist = hist.sum(dim=1)
    last = _last_bucket(hist, top_k, top_p, min_p)
    below_last = torch.arange(BINS, device=dev).unsqueeze(0) <= last.unsqueeze(1).long()
    count = (hist * below_last).sum(dim=1)
    full_row = count > CAP
    skip = full_row.to(torch.int32)
    chunk_count = torch.empty(r, s, dtype=torch.int32, device=dev)
    _chunk_count_kernel[grid](x, x.stride(0), v, m, t, last, skip, chunk_count, s, NB=nb, WIDTH=WIDTH,
                              CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    start = (chunk_count.cumsum(dim=1) - chunk_count).to(torch.int32)
    cx = torch.empty(r, CAP, dtype=torch.float32, device=dev)
    cid = torch.empty(r, CAP, dtype=torch.int32, device=dev)
    ez = torch.empty(r, s, dtype=torch.float64, device=dev)
    ef = torch.empty(r, s, dtype=torch.int32, device=dev)
    _compact_candidates_kernel[grid](x, x.stride(0), v, m, t, last, skip, start, cx, cid, ez, ef, s, CAP, NB=nb,
                                     WIDTH=WIDTH, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    return Candidates(cx, cid, count.to(torch.int32), ez.sum(dim=1), ef.sum(dim=1).to(torch.int32), full_row)
