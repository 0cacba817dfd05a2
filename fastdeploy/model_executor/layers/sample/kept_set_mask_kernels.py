"""Triton kernels that turn kept bounds into kept sets: the sampler's dense mask
(`_mask_kernel`), the CSR ids (`_compact_kernel`), the sampling mask's per-row bounds
(`_mask_rows_kernel`) and its bitmaps (`_bits_kernel`). `kept_set_gpu` launches them.
"""

from __future__ import annotations

try:  # pragma: no cover - only on machines with triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means no kernel
    triton = None

if triton is not None:
    from fastdeploy.model_executor.layers.sample.kept_set_search_kernels import _in_prefix

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
    def _bits_kernel(x_ptr, stride, V, bv_ptr, bid_ptr, want_ptr, bits_ptr, W, BYTES: tl.constexpr):
        """Program (row, part) writes bytes [part * BYTES, (part + 1) * BYTES) of the row's bitmap
        (W = ceil(V / 8) bytes a row): bit i % 8 of byte i // 8 is set iff id i is in the row's kept
        prefix (bv, bid), least significant bit first. A row with want[row] == 0 gets zeros and
        reads no logits."""
        row = tl.program_id(0).to(tl.int64)
        byte = tl.program_id(1) * BYTES + tl.arange(0, BYTES)
        bit = tl.arange(0, 8)
        o = byte[:, None] * 8 + bit[None, :]
        ok = o < tl.where(tl.load(want_ptr + row) != 0, V, 0)
        x = tl.load(x_ptr + row * stride + o, mask=ok, other=float("-inf"))
        keep = _keep(x, o, tl.load(bv_ptr + row), tl.load(bid_ptr + row)) & ok
        packed = tl.sum(keep.to(tl.int32) << bit[None, :], axis=1)
        tl.store(bits_ptr + row * W + byte, packed.to(tl.uint8), mask=byte < W)

    @triton.jit
    def _mask_rows_kernel(x_ptr, stride, V, slot_ptr, req_ptr, tok_ptr,
                          kv_ptr, klast_ptr, kcount_ptr, klogz_ptr, kfail_ptr, kfull_ptr,
                          value_ptr, last_ptr, count_ptr, logz_ptr, src_ptr, off_ptr,
                          GREEDY: tl.constexpr, PLAIN: tl.constexpr, TRUNCATED: tl.constexpr,
                          GUIDED: tl.constexpr, CANDIDATE_ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """One row's kept bounds for the sampling mask's CSR (see `fill_sampling_mask_dense`),
        one program per row of the batch; only a greedy row, or with GUIDED a plain one, reads
        its logits."""
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
        # A plain row under a grammar (GUIDED) keeps its finite logits, the ids the bitmask
        # allowed: bounds (-inf, -1) select exactly those; a row with every id finite is null.
        is_g = req & (s == GREEDY)
        is_p = req & (s == PLAIN) & GUIDED
        tok = tl.load(tok_ptr + row, mask=is_g, other=0)
        xt = tl.load(x_ptr + row * stride + tok, mask=is_g, other=0.0)
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        acc = tl.zeros([BLOCK], tl.float32)
        finite = tl.zeros([BLOCK], tl.int32)
        for i in range(0, tl.where(is_g | is_p, V, 0), BLOCK):
            o = i + offs
            x = tl.load(x_ptr + row * stride + o, mask=o < V, other=float("-inf"))
            finite += (x > float("-inf")).to(tl.int32)
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
        allowed = tl.sum(finite, axis=0)
        is_p = is_p & (allowed < V)
        value = tl.where(is_p, float("-inf"), value)
        count = tl.where(is_p, allowed, count)
        tl.store(value_ptr + row, value)
        tl.store(last_ptr + row, last)
        tl.store(count_ptr + row, count)
        tl.store(logz_ptr + row, logz)
        if row == 0:
            tl.store(off_ptr, 0)
