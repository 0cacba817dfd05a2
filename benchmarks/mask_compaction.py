"""Device time of the sampling mask's CSR compaction (`kept_set_gpu.compact`) by launch shape.

    python benchmarks/mask_compaction.py [--batches 1 32 64 256] [--vocabs 49152 151936] [--calls 20]

The compaction writes every row's kept ids, ascending, from its kept bounds: one read of
the row's logits (or of its prefilter candidates) and one write of its ids. Rows are
drawn as N(0, s^2) logits with top_p = 0.95: s = 4 ("peaked": a few hundred ids kept,
read from the prefilter's candidates), s = 1 ("flat": ~74 % of the vocabulary kept) and
s = 0.3 ("near-uniform": ~91 %, what dummy weights give). Launch shapes, as
(programs per row, logits per loop step, warps):

* before: (1, 1024, 4), the shape before the split;
* rows: (1, 4096, 8), one program per row;
* split: (up to 16, 2048, 8), about two programs per SM over a small batch;
* chosen: what `kept_set_gpu._compact_split` picks for the batch.

device_us is one call's device time with `--calls` calls queued behind a sleep kernel
(so the host's launch time is not in it), median of 5. floor_us is the bytes read and
written at the device's copy bandwidth (`common.copy_bandwidth`, a 1 GiB device-to-device copy).
Needs CUDA. Writes benchmarks/results/mask_compaction.json and .png.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import (  # noqa: E402
    copy_bandwidth,
    finish_bar_axis,
    machine_with_device,
    png_path,
    print_table,
    pyplot,
    queued_device_ms,
    write_json,
)
from fastdeploy.model_executor.layers.sample import kept_set_gpu, kept_set_mask_kernels  # noqa: E402
from tests.layers.sample.kept_set_csr import offsets_of  # noqa: E402

SCALES = {"peaked": 4.0, "flat": 1.0, "near-uniform": 0.3}


def shapes(rows: int, v: int, device: torch.device) -> dict[str, tuple[int, int, int]]:
    split_parts = kept_set_gpu._compact_parts(rows, v, device)
    chosen = (*kept_set_gpu._compact_split(rows, v, device), kept_set_gpu.COMPACT_WARPS_PER_PROGRAM)
    return {"before": (1, 1024, 4), "rows": (1, 4096, 8), "split": (split_parts, 2048, 8), "chosen": chosen}


def compact(x: torch.Tensor, bounds: kept_set_gpu.KeptBounds, offsets: torch.Tensor, total: int,
            launch: tuple[int, int, int]) -> torch.Tensor:
    """`kept_set_gpu.compact` with the launch shape (programs per row, logits per loop step, warps)
    given instead of `_compact_split`'s choice."""
    r, v = x.shape
    ids = torch.empty(total, dtype=torch.int32, device=x.device)
    if not (r and total):
        return ids
    pf = bounds.candidates
    if pf is None:
        args = (x, offsets, 0, offsets, offsets)
    else:
        args = (pf.x, pf.ids, pf.x.shape[1], pf.count, kept_set_gpu.candidate_rows(pf))
    parts, block, warps = launch
    chunk = triton.cdiv(triton.cdiv(v, parts), block) * block
    kept_set_mask_kernels._compact_kernel[(r, parts)](x, x.stride(0), v, bounds.value, bounds.last_id, offsets, ids,
                                                      *args, chunk, CANDIDATE_ROWS=pf is not None, BLOCK=block,
                                                      num_warps=warps)
    return ids


def device_ms(fn, calls: int) -> float:
    """Median of 5 `queued_device_ms` measurements."""
    return statistics.median(queued_device_ms(fn, calls) for _ in range(5))


def plot(rows: list[dict], names: list[str], device_name: str, path: str) -> None:
    plt = pyplot()
    kinds = list(dict.fromkeys(r["logits"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 3.8))
    axes = list(axes) if len(kinds) > 1 else [axes]
    for ax, kind in zip(axes, kinds, strict=True):
        sel = [r for r in rows if r["logits"] == kind]
        xs = range(len(sel))
        width = 0.8 / (len(names) + 1)
        for i, name in enumerate(names + ["floor"]):
            ax.bar([x + (i - len(names) / 2) * width for x in xs], [r[f"{name}_us"] for r in sel], width, label=name)
        ax.set_xticks(list(xs), [f"B={r['batch']}\nV={r['vocab']}" for r in sel], fontsize=7)
        ax.set_title(kind, fontsize=9)
        finish_bar_axis(ax, f"device µs per compaction ({device_name})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64, 256])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--logits", nargs="+", default=list(SCALES), choices=list(SCALES))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--name", default="mask_compaction")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and kept_set_gpu.uses_fast_path(torch.device("cuda"))):
        sys.exit("mask_compaction.py needs CUDA and Triton")
    device = torch.device("cuda")
    info, device_name = machine_with_device(device, 2)
    bandwidth = copy_bandwidth("cuda", 1 << 30)
    print(f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows, names = [], list(shapes(1, 1, device))
    for kind in args.logits:
        for v in args.vocabs:
            for b in args.batches:
                gen = torch.Generator(device=device).manual_seed(b)
                x = torch.randn(b, v, device=device, generator=gen) * SCALES[kind]
                ones, zeros = torch.ones(b, device=device), torch.zeros(b, device=device)
                bounds = kept_set_gpu.kept_bounds(x, ones, torch.zeros(b, dtype=torch.int64, device=device),
                                                  torch.full((b,), 0.95, device=device), zeros)
                offsets = offsets_of(bounds.count)
                total = int(offsets[-1])
                reference = compact(x, bounds, offsets, total, launch=(1, 1024, 4))
                row = {"logits": kind, "batch": b, "vocab": v, "ids_per_row": total // b}
                for name, launch in shapes(b, v, device).items():
                    out = compact(x, bounds, offsets, total, launch=launch)
                    if not torch.equal(out, reference):
                        raise AssertionError(f"{name} {launch} wrote other ids than the reference launch")
                    call = functools.partial(compact, x, bounds, offsets, total, launch=launch)
                    row[f"{name}_us"] = 1e3 * device_ms(call, args.calls)
                    row[f"{name}_launch"] = list(launch)
                read = b * v * 4 if bounds.candidates is None else int(bounds.candidates.full_row.sum()) * v * 4
                row["floor_us"] = (read + total * 4) / bandwidth * 1e6
                row["speedup_chosen_vs_before"] = row["before_us"] / row["chosen_us"]
                rows.append(row)
                print(f"{kind} B={b} V={v}: " + "  ".join(f"{n} {row[f'{n}_us']:.1f}" for n in names)
                      + f"  floor {row['floor_us']:.1f} us", flush=True)
    print_table(rows, ["logits", "batch", "vocab", "ids_per_row", *[f"{n}_us" for n in names], "floor_us",
                       "speedup_chosen_vs_before"])
    print(write_json(args.name, {"benchmark": "mask_compaction", "machine": info, "args": vars(args),
                                 "copy_bandwidth_bytes_per_s": bandwidth, "rows": rows}))
    plot(rows, names, device_name, png_path(args.name))
    print(png_path(args.name))


if __name__ == "__main__":
    main()
