"""Triton kernels of the GPU kept set's row search (`kept_set_gpu` launches them).

`_kept_set_kernel` runs one program per row and finds the last entry of the row's kept prefix
(passes 1-5 of `kept_set_gpu`'s description); the helpers here are also the float-key and
prefix tests the mask kernels (`kept_set_mask_kernels`) share.
"""

from __future__ import annotations

try:  # pragma: no cover - only on machines with triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means no kernel
    triton = None

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
