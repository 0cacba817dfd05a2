"""Candidate prefilter of the GPU kept set: shrinks each row to the logits that can be kept.

The row kernel (`kept_set_gpu._kept_set_kernel`) runs one program per row, so its time is
one program's latency over the whole row, several passes long. This module first cuts every
row down with two passes that many programs share (each row split into chunks of CHUNK):

1. `_chunk_histogram_kernel`, per chunk: its max ``m_c``, its float64 normaliser
   ``Σ exp((x - m_c) / T)``, its finite count, and a histogram of the logits' counts on a
   grid of step ``WIDTH * T``. The grid is absolute: a logit's cell is
   ``g(x) = floor(x / (WIDTH * T))`` and bin ``j`` of a chunk holds the logits with
   ``g(x) = g(m_c) - j`` (the last bin, everything lower). Every chunk's bins line up with
   the row's after an integer shift, so no chunk needs the row max first.
2. `_choose_kernel`, per row: the row max and exact normaliser ``Z``, the merged counts, and
   the last row bin ``J`` the search needs for the first rule in effect (the later rules
   work inside its prefix): top-k needs the first ``k`` logits; top-p (without top-k) needs
   ``Z`` less a bound of the mass below ``J`` to reach ``top_p * Z`` (a logit in chunk bin
   ``b`` lies more than ``(b - 1) * WIDTH * T`` below its chunk max, so its count bounds its
   mass); min-p alone keeps ``(M - x) / T <= -ln(min_p)``, two bins of slack for the
   rounding of ``g``. It writes each chunk's exact candidate count before it.
3. `_gather_kernel`, per chunk: the candidates (row bin <= J) in id order at those offsets.

A cell is a monotone function of the logit, so the candidates are exactly the logits above
a value: every count the row kernel takes above its search interval's lower end is the
whole row's count, and equal logits are never split. A row whose candidates exceed ``CAP``,
or whose cut lies past the histogram (flat rows, where top-p keeps much of the vocabulary),
is left to the row kernel on its full row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # pragma: no cover - only on machines with triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means no kernel
    triton = None

BINS = 128  # histogram bins per chunk: the last one holds the logits below (BINS - 1) * WIDTH * T
WIDTH = 0.25  # bin width in units of the temperature
CAP = 16384  # candidates per row the row kernel reads; rows with more use their full row
CHUNK = 2048  # logits per program of the chunk passes (held in registers: one read each)
NUM_WARPS = 4  # of the chunk passes
CHOOSE_CHUNKS = 16  # chunks per [chunks, BINS] tile of the choice
GATHER_BLOCK = 512  # logits per step of the gather (one scan each)
MASS_SLACK = 1e-9  # relative margin on the float64 mass bounds when choosing J for top-p


@dataclass
class Candidates:
    """Rows cut to their candidates, in id order.

    x: float32 [R, CAP] logits, ids: int32 [R, CAP] their vocabulary ids, count: int32 [R].
    row_z: float64 [R], the whole row's sum of exp((x - M) / T); row_finite: int32 [R], its
    finite logits. full_row: int32 [R], 1 for rows searched on their full row (nothing written).
    """

    x: torch.Tensor
    ids: torch.Tensor
    count: torch.Tensor
    row_z: torch.Tensor
    row_finite: torch.Tensor
    full_row: torch.Tensor


if triton is not None:

    @triton.jit
    def _cell(x, scale):
        """floor(x * scale), float32. The gather tests ``x * scale >= ref - lim`` on the same
        product, which for an integer bound is the same as this cell's bin being <= lim."""
        return tl.floor(x * scale)

    @triton.jit
    def _bin(x, ref, scale, BINS: tl.constexpr):
        """Chunk bin of each logit: ref - cell; the last bin holds everything lower and -inf.
        Exact in float32 while |ref| < 2**23 (the choice sends other rows to their full row);
        a rounded difference far below the window still lands in the last bin."""
        j = tl.minimum(ref - _cell(x, scale), BINS - 1.0)
        return tl.where(x > float("-inf"), j, BINS - 1.0).to(tl.int32)

    @triton.jit
    def _scale(t_ptr, row, INV_W: tl.constexpr):
        return INV_W / tl.load(t_ptr + row).to(tl.float32)

    @triton.jit
    def _chunk_histogram_kernel(x_ptr, stride, V, t_ptr, cmax_ptr, cref_ptr, cz_ptr, cfin_ptr, cnt_ptr, S,
                                BINS: tl.constexpr, INV_W: tl.constexpr, CHUNK: tl.constexpr):
        """One read of the chunk: it stays in registers for the max, the bins and the sums."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        o = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride + o, mask=o < V, other=float("-inf"))
        scale = _scale(t_ptr, row, INV_W)
        it64 = 1.0 / tl.load(t_ptr + row).to(tl.float64)
        m = tl.max(x, axis=0)
        ref = _cell(m, scale)
        f = x > float("-inf")
        z = tl.sum(tl.where(f, tl.exp((x.to(tl.float64) - m.to(tl.float64)) * it64), 0.0), axis=0)
        k = row * S + c
        tl.store(cmax_ptr + k, m)
        tl.store(cref_ptr + k, ref)
        tl.store(cz_ptr + k, z)
        tl.store(cfin_ptr + k, tl.sum(f.to(tl.int32), axis=0))
        tl.store(cnt_ptr + k * BINS + tl.arange(0, BINS), tl.histogram(_bin(x, ref, scale, BINS), BINS))

    @triton.jit
    def _choose_kernel(t_ptr, k_ptr, p_ptr, mp_ptr, cmax_ptr, cref_ptr, cz_ptr, cfin_ptr, cnt_ptr,
                       lim_ptr, coff_ptr, count_ptr, z_ptr, fin_ptr, full_ptr, S, CAP,
                       SLACK: tl.constexpr, BINS: tl.constexpr, WIDTH: tl.constexpr, G: tl.constexpr):
        """Per row: the last row bin J the search needs, each chunk's limit (J minus its shift)
        and candidate offset, the candidates' count, the row's normaliser and finite count.
        Chunks are taken G at a time as [G, BINS] tiles.

        Top-p takes the first J whose head mass, the exact normaliser less an upper bound of
        the mass below J, is at least top_p of the normaliser. A logit in chunk bin b lies more
        than (b - 1) * WIDTH * T below its chunk's max, which bounds its mass from its count."""
        row = tl.program_id(0).to(tl.int64)
        it64 = 1.0 / tl.load(t_ptr + row).to(tl.float64)
        jj = tl.arange(0, BINS)
        gg = tl.arange(0, G)
        window = jj < BINS - 1  # the last bin is the chunk's far logits (and -inf)
        # bound of exp((x - m_c) / T) in chunk bin b
        ub = tl.exp(-tl.maximum(jj - 1, 0).to(tl.float64) * WIDTH)
        mx = tl.full((), float("-inf"), tl.float32)
        rref = tl.full((), float("-inf"), tl.float32)
        nfin = tl.zeros((), dtype=tl.int32)
        for g in range(0, S, G):
            cs = g + gg
            ok = cs < S
            mx = tl.maximum(mx, tl.max(tl.load(cmax_ptr + row * S + cs, mask=ok, other=float("-inf")), axis=0))
            rref = tl.maximum(rref, tl.max(tl.load(cref_ptr + row * S + cs, mask=ok, other=float("-inf")), axis=0))
            nfin += tl.sum(tl.load(cfin_ptr + row * S + cs, mask=ok, other=0), axis=0)
        mx64 = mx.to(tl.float64)
        z = tl.zeros((), dtype=tl.float64)
        cnt = tl.zeros([BINS], dtype=tl.int32)  # per row bin (window bins only)
        upper = tl.zeros([BINS], dtype=tl.float64)  # bound of the mass per row bin
        beyond = tl.zeros((), dtype=tl.float64)  # bound of the mass past the row's window
        for g in range(0, S, G):
            cs = g + gg
            k = row * S + cs
            cm = tl.load(cmax_ptr + k, mask=cs < S, other=float("-inf"))
            live = cm > float("-inf")
            wc = tl.where(live, tl.exp((cm.to(tl.float64) - mx64) * it64), 0.0)
            z += tl.sum(tl.where(live, tl.load(cz_ptr + k, mask=live, other=0.0) * wc, 0.0), axis=0)
            shift = tl.minimum(rref - tl.load(cref_ptr + k, mask=live, other=0.0), BINS * 1.0).to(tl.int32)
            shift = tl.where(live, shift, BINS)
            own = tl.load(cnt_ptr + k[:, None] * BINS + jj[None, :], mask=live[:, None], other=0)
            # the far bin also counts the -inf logits: its finite count is what the others leave
            near = tl.sum(tl.where(window[None, :], own, 0), axis=1)
            far = tl.load(cfin_ptr + k, mask=live, other=0) - near
            own = tl.where(window[None, :], own, far[:, None])
            out = (jj[None, :] + shift[:, None]) >= BINS - 1
            beyond += tl.sum(tl.sum(tl.where(out, own.to(tl.float64) * ub[None, :], 0.0), axis=1) * wc, axis=0)
            src = jj[None, :] - shift[:, None]
            take = (src >= 0) & window[None, :] & live[:, None]
            moved = tl.load(cnt_ptr + k[:, None] * BINS + src, mask=take, other=0)
            cnt += tl.sum(moved, axis=0)
            bound = tl.exp(-tl.maximum(src - 1, 0).to(tl.float64) * WIDTH) * wc[:, None]
            upper += tl.sum(moved.to(tl.float64) * bound, axis=0)
        ccnt = tl.cumsum(cnt, axis=0)
        # bound of the mass below row bin J: the later window bins, and everything beyond
        below = tl.sum(upper, axis=0) - tl.cumsum(upper, axis=0) + beyond
        top_k = tl.load(k_ptr + row).to(tl.int32)
        p = tl.load(p_ptr + row).to(tl.float64)
        mp = tl.minimum(tl.load(mp_ptr + row).to(tl.float64), 1.0)
        # first bin meeting each rule (BINS: none within the window)
        j_k = tl.min(tl.where(window & (ccnt >= top_k), jj, BINS), axis=0)
        j_p = tl.min(tl.where(window & ((z - below * (1.0 + SLACK)) >= p * z * (1.0 + SLACK)), jj, BINS), axis=0)
        # min-p keeps (M - x) / T <= -ln(min_p): two bins of slack for the rounding of the cells
        d_mp = -tl.log(tl.maximum(mp, 1e-300)) / WIDTH
        j_m = tl.minimum(tl.ceil(d_mp), BINS * 1.0).to(tl.int32) + 2
        k_on = (top_k > 0) & (top_k < nfin)
        last = tl.where(k_on, j_k, tl.where(p < 1.0, j_p, tl.where(mp > 0.0, j_m, BINS)))
        count = tl.sum(tl.where(jj <= last, cnt, 0), axis=0)
        full = (last >= BINS - 1) | (count > CAP) | (mx == float("-inf")) | (tl.abs(rref) >= 8388608.0)
        base = tl.zeros((), dtype=tl.int32)
        for g in range(0, S, G):
            cs = g + gg
            k = row * S + cs
            cm = tl.load(cmax_ptr + k, mask=cs < S, other=float("-inf"))
            live = (cm > float("-inf")) & (gg * 0 + full.to(tl.int32) == 0)  # vector & vector
            shift = tl.minimum(rref - tl.load(cref_ptr + k, mask=live, other=0.0), BINS * 1.0).to(tl.int32)
            lim = tl.where(live, last - shift, -1)
            tl.store(lim_ptr + k, lim, mask=cs < S)
            own = tl.load(cnt_ptr + k[:, None] * BINS + jj[None, :], mask=live[:, None], other=0)
            n = tl.sum(tl.where(window[None, :] & (jj[None, :] <= lim[:, None]), own, 0), axis=1)
            run = tl.cumsum(n, axis=0)
            tl.store(coff_ptr + k, base + run - n, mask=cs < S)
            base += tl.sum(n, axis=0)
        tl.store(count_ptr + row, tl.where(full, 0, count))
        tl.store(z_ptr + row, z)
        tl.store(fin_ptr + row, nfin)
        tl.store(full_ptr + row, full.to(tl.int32))

    @triton.jit
    def _gather_kernel(x_ptr, stride, V, t_ptr, cref_ptr, lim_ptr, coff_ptr, cx_ptr, cid_ptr, S, CAP,
                       INV_W: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Writes the chunk's candidates after those of the chunks before it (id order)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        k = row * S + c
        lim = tl.load(lim_ptr + k)
        if lim >= 0:
            # bin <= lim  <=>  floor(x * scale) >= ref - lim  <=>  x * scale >= ref - lim
            thr = tl.load(cref_ptr + k) - lim.to(tl.float32)
            scale = _scale(t_ptr, row, INV_W)
            base = tl.load(coff_ptr + k)
            for i in range(0, CHUNK, BLOCK):
                o = c * CHUNK + i + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + row * stride + o, mask=o < V, other=float("-inf"))
                sel = x * scale >= thr
                si = sel.to(tl.int32)
                pos = base + tl.cumsum(si, axis=0) - 1
                tl.store(cx_ptr + row * CAP + pos, x, mask=sel)
                tl.store(cid_ptr + row * CAP + pos, o, mask=sel)
                base += tl.sum(si, axis=0)


def prefilter(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor) -> Candidates:
    """Candidates of each row of x (float32 [R, V], unit stride): three launches, no host sync."""
    r, v = x.shape
    dev = x.device
    s = triton.cdiv(v, CHUNK)
    grid = (r, s)
    t = temperature.float().contiguous()
    inv_w = 1.0 / WIDTH
    cmax = torch.empty(r, s, dtype=torch.float32, device=dev)
    cref = torch.empty(r, s, dtype=torch.float32, device=dev)
    cz = torch.empty(r, s, dtype=torch.float64, device=dev)
    cfin = torch.empty(r, s, dtype=torch.int32, device=dev)
    cnt = torch.empty(r, s, BINS, dtype=torch.int32, device=dev)
    _chunk_histogram_kernel[grid](x, x.stride(0), v, t, cmax, cref, cz, cfin, cnt, s, BINS=BINS, INV_W=inv_w,
                                  CHUNK=CHUNK, num_warps=NUM_WARPS)
    lim = torch.empty(r, s, dtype=torch.int32, device=dev)
    coff = torch.empty(r, s, dtype=torch.int32, device=dev)
    count = torch.empty(r, dtype=torch.int32, device=dev)
    row_z = torch.empty(r, dtype=torch.float64, device=dev)
    row_fin = torch.empty(r, dtype=torch.int32, device=dev)
    full = torch.empty(r, dtype=torch.int32, device=dev)
    _choose_kernel[(r,)](t, top_k, top_p, min_p, cmax, cref, cz, cfin, cnt, lim, coff, count, row_z, row_fin,
                         full, s, CAP, SLACK=MASS_SLACK, BINS=BINS, WIDTH=WIDTH, G=CHOOSE_CHUNKS, num_warps=4)
    cx = torch.empty(r, CAP, dtype=torch.float32, device=dev)
    cid = torch.empty(r, CAP, dtype=torch.int32, device=dev)
    _gather_kernel[grid](x, x.stride(0), v, t, cref, lim, coff, cx, cid, s, CAP, INV_W=inv_w, CHUNK=CHUNK,
                         BLOCK=min(GATHER_BLOCK, CHUNK), num_warps=4)
    return Candidates(cx, cid, count, row_z, row_fin, full)
