"""Garbage-collector passes the sampling mask adds to the engine's token processing.

    python benchmarks/mask_gc.py [--batch 256] [--ids-per-token 100000] [--steps 64] [--reps 3]
        [--hold]

One "run" is --steps calls of `TokenProcessor.process` on the same packed frame of --batch
sequences (one token each), with every sequence asking for its sampling mask or none of them,
after `gc.freeze()` of everything built before. Per run: wall ms, and the collections of each
generation with the time spent in them (`gc.callbacks`). --hold keeps every step's deltas
alive until the run ends, as a server does until it has written them; by default they are
dropped after each step, as the offline benchmark does. Then, with the collector off,
apply_us and attach_us: the median µs per step of the two stages of `process`
(`TokenProcessor.apply`, `TokenProcessor.attach_masks`) over --stage-calls calls.

Writes benchmarks/results/mask_gc.json and .png.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import CollectorWatch, machine_with_device, png_path, print_table, pyplot, write_json  # noqa: E402
from fastdeploy.common.sampling_params import SamplingParams  # noqa: E402
from fastdeploy.common.step_slots import StepSlots  # noqa: E402
from fastdeploy.ops.step_packer import CpuOpPacker  # noqa: E402
from fastdeploy.output.token_processor import TokenProcessor  # noqa: E402
from fastdeploy.scheduler.sequence import Sequence  # noqa: E402


def packed_frame(batch: int, ids_per_token: int, mask: bool) -> memoryview:
    slots = StepSlots(message_id=1, seq_ids=torch.arange(batch), accept_counts=torch.ones(batch, dtype=torch.int32),
                      token_ids=torch.randint(3, 1000, (batch, 1)), num_logprobs=-1)
    if mask:
        slots.mask_offsets = torch.arange(batch + 1, dtype=torch.int32) * ids_per_token
        slots.mask_ids = torch.randint(0, 150_000, (batch * ids_per_token,), dtype=torch.int32)
        slots.logz = torch.zeros(batch, 1)
    return CpuOpPacker().pack(slots).buffer


def run(frame: memoryview, batch: int, steps: int, mask: bool, hold: bool, watch: CollectorWatch) -> dict:
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    sequences = {i: Sequence(i, f"r{i}", list(range(16)), params, 0.0, return_sampling_mask=mask)
                 for i in range(batch)}
    processor = TokenProcessor([2], 10**6)
    held = []
    count0, seconds0 = watch.snapshot()
    t0 = time.perf_counter()
    for _ in range(steps):
        applied = processor.apply(frame, sequences)  # what the engine does with each step
        processor.attach_masks(applied)
        results = applied.results
        if hold:
            held.append(results)
    ms = (time.perf_counter() - t0) * 1e3
    count, seconds = watch.snapshot()
    passes = [n - n0 for n, n0 in zip(count, count0, strict=True)]
    return {"ms": ms, "gen0": passes[0], "gen1": passes[1], "gen2": passes[2],
            "gc_ms": (sum(seconds) - sum(seconds0)) * 1e3}


def stage_us(frame: memoryview, batch: int, mask: bool, calls: int) -> tuple[float, float]:
    """Median µs of `TokenProcessor.apply` and of `attach_masks` per step, the collector off
    (the two stages' own cost, which the engine places apart: see token_processor.py)."""
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    sequences = {i: Sequence(i, f"r{i}", list(range(16)), params, 0.0, return_sampling_mask=mask)
                 for i in range(batch)}
    processor = TokenProcessor([2], 10**6)
    apply_s, attach_s = [], []
    gc.disable()
    try:
        for call in range(calls + 50):  # 50 warm-up calls
            if call % 50 == 0:
                for seq in sequences.values():
                    seq.output_token_ids.clear()
            t0 = time.perf_counter()
            applied = processor.apply(frame, sequences)
            t1 = time.perf_counter()
            processor.attach_masks(applied)
            t2 = time.perf_counter()
            if call >= 50:
                apply_s.append(t1 - t0)
                attach_s.append(t2 - t1)
    finally:
        gc.enable()
    return 1e6 * statistics.median(apply_s), 1e6 * statistics.median(attach_s)


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    labels = ["mask off", "mask on"]
    for ax, key, title in ((axes[0], "gen0", "young collections per run"), (axes[1], "ms", "ms per run")):
        ax.bar(labels, [next(r[key] for r in rows if r["mask"] == m) for m in (False, True)], color=["C0", "C1"])
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ids-per-token", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hold", action="store_true", help="keep every step's deltas until the run ends")
    ap.add_argument("--stage-calls", type=int, default=350,
                    help="calls timed per side for apply_us / attach_us (collector off)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="mask_gc")
    args = ap.parse_args()
    info, _ = machine_with_device(torch.device("cpu"), args.threads)
    frames = {mask: packed_frame(args.batch, args.ids_per_token, mask) for mask in (False, True)}
    watch = CollectorWatch()
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # a normal heap for teardown code that looks for leaks (Triton's)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.reps):
        for mask in (False, True):
            runs[mask].append(run(frames[mask], args.batch, args.steps, mask, args.hold, watch))
    rows = []
    for mask in (False, True):
        row = {"mask": mask, "batch": args.batch, "steps": args.steps, "hold": args.hold}
        for key in ("ms", "gen0", "gen1", "gen2", "gc_ms"):
            row[key] = statistics.median(r[key] for r in runs[mask])
        row["apply_us"], row["attach_us"] = stage_us(frames[mask], args.batch, mask, args.stage_calls)
        rows.append(row)
    print_table(rows, ["mask", "batch", "steps", "hold", "ms", "gen0", "gen1", "gen2", "gc_ms", "apply_us",
                       "attach_us"])
    print(write_json(args.name, {"benchmark": "mask_gc", "machine": info, "args": vars(args), "rows": rows,
                                 "runs": {str(m): r for m, r in runs.items()}}))
    plot(rows, png_path(args.name))
    print(png_path(args.name))


if __name__ == "__main__":
    main()
