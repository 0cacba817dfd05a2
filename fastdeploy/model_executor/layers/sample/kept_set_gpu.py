"""Kept set (top-k -> top-p -> min-p) on the GPU without sorting the vocabulary: the host side.

The kernels live in `kept_set_search_kernels` (the row search) and `kept_set_mask_kernels`
(dense mask, CSR compaction, the sampling mask's row bounds); this module sizes the buffers
and launches them.

The kept set of a row is a prefix of the row in (logit descending, id ascending)
order, the order of the float64 full sort (`truncation.kept_set_full_sort`). A prefix
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
a superset, which `redo_flagged` redoes by the full sort.

Over a vocabulary above ``CAP * PREFILTER_MIN_SHRINK``, `kept_set_prefilter.prefilter` first
cuts each row to its candidates (many programs per row); the row kernel then reads those
(``COMPACT``), with the whole row's normaliser and finite count, and rows left with too many
candidates keep the full-row kernel.

From the boundary, `_compact_kernel` writes the CSR ids straight from the logits, or from a
cut row's candidates (no dense mask), at the offsets of the counts' exclusive cumsum. A
batch of fewer rows than SMs has each full row split into chunks written side by side
(`_compact_split`). The sampler's draw needs the dense mask: `_mask_kernel` writes it in one pass,
without any host sync. For the sampling mask the sampler's CSR covers every row of the batch:
`_mask_rows_kernel` settles each row's bounds (a truncating row's kept prefix, a greedy row's
argmax and its logZ, an empty row otherwise) before the cumsum and the compaction, into a
buffer sized by the caller, so that path reads nothing back.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from fastdeploy.common.devices import multiprocessors
from fastdeploy.model_executor.layers.sample import kept_set_mask_kernels as mask_kernels
from fastdeploy.model_executor.layers.sample import kept_set_prefilter as prefilter_module
from fastdeploy.model_executor.layers.sample import kept_set_search_kernels as search_kernels
from fastdeploy.model_executor.layers.sample.kept_set import GREEDY_SLOT, PLAIN_SLOT
from fastdeploy.model_executor.layers.sample.truncation import KeptSet, kept_set_full_sort

try:  # pragma: no cover - only on machines with triton
    import triton
except Exception:  # noqa: BLE001 - any import failure means no kernel
    triton = None

__all__ = ["GREEDY_SLOT", "GpuKeptSet", "KeptBounds", "compact", "compile_row_search", "dense_mask",
           "fill_sampling_mask_dense", "kept_bounds", "kept_set", "redo_flagged", "uses_fast_path"]

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
BITS_BYTES = 256  # bitmap bytes (8 logits each) per program of the bitmap kernel
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

    bounds: KeptBounds



def kept_bounds(proc: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> KeptBounds:
    """The kernel on any device Triton runs on (CUDA, or CPU tensors under TRITON_INTERPRET=1).

    proc float32 [R, V] processed logits (before temperature); temperature [R] > 0;
    top_k int [R] (0 = off); top_p [R] (1 = off); min_p [R] (0 = off). One launch.
    """
    x = proc if proc.stride(1) == 1 else proc.contiguous()
    r, v = x.shape
    dev = x.device
    failed = torch.empty(r, dtype=torch.int32, device=dev)
    out = KeptBounds(
        value=torch.empty(r, dtype=torch.float32, device=dev),
        last_id=torch.empty(r, dtype=torch.int32, device=dev),
        count=torch.empty(r, dtype=torch.int32, device=dev),
        logz=torch.empty(r, dtype=torch.float64, device=dev),
        failed=failed,
    )
    if r == 0:
        return out
    params = (temperature.contiguous(), top_k.contiguous(), top_p.contiguous(), min_p.contiguous())
    cand = torch.empty(r, CANDIDATES, dtype=torch.int64, device=dev)
    results = (cand, out.value, out.last_id, out.count, out.logz, failed)
    if v <= prefilter_module.CAP * PREFILTER_MIN_SHRINK:
        run_all = torch.zeros(r, dtype=torch.int32, device=dev)
        _row_search(x, params, results, run_all, run_all, out.logz, run_all, run_all, compact=False)
        return out
    # Rows cut to their candidates first (many programs per row); each row is then searched
    # over its candidates, or over its full row where they did not fit.
    pf = prefilter_module.prefilter(x, *params)
    out.candidates = pf
    full = pf.full_row
    _row_search(pf.x, params, results, full, pf.count, pf.row_z, pf.row_finite, pf.ids, compact=True, vocab_size=v)
    _row_search(x, params, results, 1 - full, pf.count, pf.row_z, pf.row_finite, pf.ids, compact=False)
    return out


def _row_search(x: torch.Tensor, params: tuple[torch.Tensor, ...], results: tuple[torch.Tensor, ...],
                skip: torch.Tensor, n: torch.Tensor, row_z: torch.Tensor, row_finite: torch.Tensor,
                ids: torch.Tensor, compact: bool, vocab_size: int | None = None, compile_only: bool = False) -> None:
    """One launch of the row search over x's rows (a prefilter's candidates with `compact`, of a
    `vocab_size` wide row); `compile_only`: compile the kernel for these arguments, launch nothing."""
    v = vocab_size if vocab_size is not None else x.shape[1]
    # Read at each call: tests narrow the module's settings (CANDIDATES, passes) for Triton's interpreter.
    settings = {"C": CANDIDATES, "P": PIVOTS, "DELTA": MASS_DELTA, "SPAN": SPAN, "VALUE_PASSES": VALUE_PASSES,
                "MAX_PASSES": MAX_PASSES, "BLOCK": BLOCK, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES}
    if compact:
        settings.update(BLOCK=COMPACT_BLOCK, num_warps=COMPACT_WARPS)
    args = (x, x.stride(0), v, *params, *results, skip, n, row_z, row_finite, ids, v)
    kernel = search_kernels._kept_set_kernel
    if compile_only:
        kernel.warmup(*args, grid=(x.shape[0],), COMPACT=compact, **settings)
    else:
        kernel[(x.shape[0],)](*args, COMPACT=compact, **settings)


def compile_row_search(vocab_size: int, param_dtypes: tuple[torch.dtype, ...], device: torch.device
                       ) -> list[Future]:
    """Compiles, without launching anything, the row search's two variants (full rows, and a
    prefilter's candidates) for rows `vocab_size` wide and sampling parameters (temperature,
    top_k, top_p, min_p) of `param_dtypes`, the two at once in two threads; returns their
    futures. Triton spends 20-30 s of an H100 host's time on each, mostly in its compiler's
    native passes outside the GIL, so the two overlap each other and the caller's own start-up
    work; at a fresh start, one after the other, they were most of the time to ready. Arguments
    as `kept_bounds` passes them, so its launches find the compiled kernels."""
    def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    params = tuple(empty(1, dtype=d) for d in param_dtypes)
    results = (empty(1, CANDIDATES, dtype=torch.int64), empty(1, dtype=torch.float32), empty(1, dtype=torch.int32),
               empty(1, dtype=torch.int32), empty(1, dtype=torch.float64), empty(1, dtype=torch.int32))
    cap = prefilter_module.CAP
    ints = empty(1, dtype=torch.int32)
    row_z = empty(1, dtype=torch.float64)
    ids = empty(1, cap, dtype=torch.int32)
    launches = [(empty(1, cap, dtype=torch.float32), True, vocab_size),
                (empty(1, vocab_size, dtype=torch.float32), False, None)]
    if vocab_size <= cap * PREFILTER_MIN_SHRINK:
        launches = launches[1:]
    pool = ThreadPoolExecutor(max_workers=len(launches), thread_name_prefix="compile-row-search")
    futures = [pool.submit(_row_search, x, params, results, ints, ints, row_z, ints, ids, compact=compact,
                           vocab_size=width, compile_only=True) for x, compact, width in launches]
    pool.shutdown(wait=False)
    return futures


def dense_mask(proc: torch.Tensor, value: torch.Tensor, last_id: torch.Tensor) -> torch.Tensor:
    """bool [R, V] of the kept prefixes (one launch)."""
    x = proc if proc.stride(1) == 1 else proc.contiguous()
    r, v = x.shape
    mask = torch.empty(r, v, dtype=torch.int8, device=x.device)
    if r:
        mask_kernels._mask_kernel[(r, triton.cdiv(v, MASK_BLOCK))](x, x.stride(0), v, value, last_id, mask,
                                                                    BLOCK=MASK_BLOCK, num_warps=4)
    return mask.view(torch.bool)


def _bounds_of_mask(proc: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, last_id) of kept prefixes given as a dense mask (the full sort's)."""
    value = proc.masked_fill(~mask, math.inf).min(dim=1).values
    ids = torch.arange(proc.shape[1], device=proc.device).expand_as(proc)
    last = torch.where(mask & (proc == value.unsqueeze(1)), ids, -1).max(dim=1).values
    return value.float(), last.to(torch.int32)


def redo_flagged(proc, temperature, top_k, top_p, min_p, b: KeptBounds) -> None:
    """Redoes the rows the kernel flagged by the full sort, in place (none on realistic logits)."""
    assert b.failed is not None, "bounds from `kept_bounds` say which rows failed"
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


def candidate_rows(pf: prefilter_module.Candidates) -> torch.Tensor:
    """int32 [R]: each row's own candidate row, or -1 where it was searched on its full row."""
    rows = torch.arange(pf.full_row.shape[0], dtype=torch.int32, device=pf.full_row.device)
    return torch.where(pf.full_row == 0, rows, -1)


def compact(proc: torch.Tensor, b: KeptBounds, offsets: torch.Tensor, total: int,
            candidates: tuple[prefilter_module.Candidates, torch.Tensor] | None = None) -> torch.Tensor:
    """int32 [total] kept ids of every row, ascending, at ``offsets`` (one launch).

    candidates: a prefilter's rows and, per row of ``proc``, the candidate row to read
    (-1: its logits); by default ``b.candidates`` row for row."""
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
    parts, block = _compact_split(r, v, x.device)
    warps = COMPACT_WARPS_PER_PROGRAM
    chunk = triton.cdiv(triton.cdiv(v, parts), block) * block
    mask_kernels._compact_kernel[(r, parts)](x, x.stride(0), v, b.value, b.last_id, offsets, ids, *args, chunk,
                                CANDIDATE_ROWS=candidates is not None, BLOCK=block, num_warps=warps)
    return ids


def _compact_split(rows: int, v: int, device: torch.device) -> tuple[int, int]:
    """(programs per row, logits per loop step) of the compaction. On an H100
    (benchmarks/mask_compaction.py) one program per row with 4,096-logit steps is fastest
    from about one row per SM up; fewer rows are split into chunks of 2,048-logit steps,
    about two programs per SM, each recounting the kept logits before its chunk."""
    if rows >= multiprocessors(device):
        return 1, COMPACT_ROW_BLOCK
    return _compact_parts(rows, v, device), COMPACT_PART_BLOCK


def _compact_parts(rows: int, v: int, device: torch.device) -> int:
    """Chunks per row that put about two programs on each SM (at most COMPACT_MAX_PARTS)."""
    parts = min(COMPACT_MAX_PARTS, triton.cdiv(2 * multiprocessors(device), rows), triton.cdiv(v, COMPACT_PART_BLOCK))
    return max(1, parts)


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
    assert b.failed is not None
    if settle and bool(b.failed.any()):
        redo_flagged(proc, temperature, top_k, top_p, min_p, b)
    return GpuKeptSet(dense_mask(proc, b.value, b.last_id), b.count, b.logz, bounds=b)


def fill_sampling_mask_dense(
    out,
    proc: torch.Tensor,
    requested: torch.Tensor,
    slots: torch.Tensor,
    capacity: int,
    kept: GpuKeptSet | None,
    bitmap_rows: torch.Tensor | None = None,
    guided: bool = False,
) -> None:
    """`kept_set_torch.fill_sampling_mask` on CUDA: the CSR compacted from the kept bounds.

    bitmap_rows bool [B]: rows whose kept sets go out as bitmaps (``out.mask_bits``, uint8
    [B, ceil(V/8)], all zero for the other rows), written from the same bounds in one launch;
    they keep their logz and get an empty CSR row.

    slots int32 [B]: a truncating row's index in ``kept`` (>= 0), `GREEDY_SLOT` for a greedy
    row, -1 for a plain one. Truncating rows take their kept set; greedy rows their sampled
    argmax, with logz its mass under the temperature-1 softmax. With ``guided`` (a grammar's
    bitmask in the step) a plain row keeps its finite logits, logz 0, and is empty if every
    logit is finite; other rows are empty with logz 0.
    capacity: an upper bound on the ids of all rows (the caller's, from the shapes and top_k).

    Three launches (the rows' bounds, their cumsum, the compaction; a fourth for bitmaps) and no
    host read: the ids go into a buffer of ``capacity`` ids (``out.mask_ids``; entries past
    ``mask_offsets[-1]`` are unspecified), so the host keeps queueing work while the device
    computes the kept sets.
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
    mask_kernels._mask_rows_kernel[(b,)](x, x.stride(0), v, slots, requested, out.sampled_token_ids, *trunc, full_row,
                            value, last, counts, logz, src, offsets, GREEDY=GREEDY_SLOT, PLAIN=PLAIN_SLOT,
                            TRUNCATED=kb is not None, GUIDED=guided, CANDIDATE_ROWS=pf is not None,
                            BLOCK=2 * BLOCK, num_warps=4)
    if bitmap_rows is not None:
        width = -(-v // 8)
        out.mask_bits = torch.empty(b, width, dtype=torch.uint8, device=dev)
        mask_kernels._bits_kernel[(b, triton.cdiv(width, BITS_BYTES))](x, x.stride(0), v, value, last, bitmap_rows,
                                                                       out.mask_bits, width, BYTES=BITS_BYTES,
                                                                       num_warps=4)
        counts.masked_fill_(bitmap_rows, 0)  # an empty CSR row: the compaction does not read it
    torch.cumsum(counts, dim=0, dtype=torch.int32, out=offsets[1:])
    out.mask_offsets = offsets
    out.mask_ids = compact(x, KeptBounds(value, last, counts, logz), offsets, capacity,
                           (pf, src) if pf is not None else None)
    out.logz = logz
