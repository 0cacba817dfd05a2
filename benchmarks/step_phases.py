"""Where a decode step's time goes on the host, phase by phase, with the sampling mask on vs off.

    python benchmarks/step_phases.py [--device cpu|cuda] [--model embedded|PATH --load-format dummy
        --dtype bfloat16] [--batches 8 64] [--steps 40] [--reps 3] [--mask-format ids|bitmap]

One in-process engine started with --enable-keep-sampling-mask decodes a batch of requests
that ask for the mask, then one whose requests opt out, alternating, --reps times each.
Every engine and worker phase of each steady decode step (the first 3 and last 2 steps of a
run are left out) is timed on the host with `time.perf_counter` around the function that
does it: no profiler, so the step keeps its own timing. A phase that waits for the device
("wait" in its name) includes that wait; phases nest (the sampler's mask fill lies inside
the sampler; the worker's phases inside "execute: launch" and "execute: finish", between
which the engine cuts the previous step's masks when the step runs beside it, on a GPU).
The start-up heap is frozen out
of garbage collection first, as the serving processes do.

Per phase: ms per step in the median run (by step wall time), with the garbage collector's
time inside the steps as phases of their own ("gc: generation N"). Per run: the median and
the mean step wall time, which differ when some steps stall.

With --device-timeline (CUDA), one more run per side and batch decodes under the torch
profiler, and its steady steps are read off the device's own timeline: per step, the time
the compute stream is busy, the time the copy stream (the mask ids' transfer) is busy, the
union of the two, and the device's idle time (the host's serial part of the step), plus the
kernels whose device time the mask adds.

Writes benchmarks/results/step_phases_<device>.json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CollectorWatch, device_profile, machine_with_device, png_path, print_table, pyplot, write_json

WARMUP_STEPS = 3
TAIL_STEPS = 2


def phase_targets() -> list[tuple[object, str, str]]:
    """(owner, attribute, phase label): the functions timed, engine side first."""
    from fastdeploy.model_executor.layers.sample import kept_set_gpu, kept_set_torch, kept_set_triton
    from fastdeploy.ops import step_packer
    from fastdeploy.output import token_processor
    from fastdeploy.scheduler import scheduler
    from fastdeploy.worker import input_prep, model_runner, slot_layout, step_output

    return [
        (scheduler.Scheduler, "schedule", "engine: schedule"),
        (token_processor.TokenProcessor, "apply", "engine: token processor (tokens)"),
        (token_processor.TokenProcessor, "attach_masks", "engine: token processor (masks)"),
        (step_output.StepOutput, "wait_mask_ids", "engine: wait for mask ids"),
        (model_runner.ModelRunner, "launch", "execute: launch"),
        (model_runner.ModelRunner, "finish", "execute: finish (wait frame)"),
        (input_prep, "prepare_inputs", "worker: prepare inputs"),
        (model_runner.ModelRunner, "_forward", "worker: forward (on CUDA the launch)"),
        (input_prep, "sampling_metadata", "worker: sampling metadata"),
        (model_runner.Sampler, "__call__", "worker: sampler"),
        (kept_set_gpu, "fill_sampling_mask_dense", "worker: sampler: mask fill (CUDA)"),
        (kept_set_triton, "pack_bits", "worker: sampler: pack bitmaps"),
        (kept_set_torch, "pack_bits", "worker: sampler: pack bitmaps"),
        (token_processor, "bitmap_rows", "engine: token processor: bitmap rows"),
        (slot_layout, "step_slots", "worker: slot layout"),
        (step_packer.CpuOpPacker, "pack", "worker: pack (C++ op)"),
        (step_packer.CudaOpPacker, "pack", "worker: pack (wait frame, or its head)"),
        (step_packer, "unpack_step_frame", "worker: unpack"),
        (token_processor, "unpack_step_frame", "engine: unpack"),
    ]


@contextlib.contextmanager
def timed_phases(totals: dict[str, float]) -> Iterator[None]:
    """Adds each phase's host seconds to `totals` while inside; restores the functions after."""
    saved = []
    for owner, name, label in phase_targets():
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, _timed(original, label, totals))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _timed(fn: Callable, label: str, totals: dict[str, float]) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start

    return wrapper


# The garbage collector's time inside a step goes into that step's phases as "gc: generation N"
# (a collection runs wherever an allocation triggers it).
COLLECTOR = CollectorWatch()


MASK_FORMAT = "ids"  # the masked runs' sampling_mask_format (--mask-format)
TEMPERATURE = 1.0  # the runs' sampling temperature (--temperature)


def add_batch(engine, batch: int, mask: bool, steps: int, top_p: float, seed: int) -> None:
    """Adds `batch` requests of 16 random prompt tokens that decode `steps` steady steps."""
    from fastdeploy.common.request import EngineRequest
    from fastdeploy.common.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + WARMUP_STEPS + TAIL_STEPS, temperature=TEMPERATURE, top_p=top_p,
                            ignore_eos=True, return_sampling_mask=mask, sampling_mask_format=MASK_FORMAT)
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        prompt = torch.randint(100, 30000, (16,), generator=g).tolist()
        engine.add_request(EngineRequest(f"{seed}-{i}", prompt, params, time.time()))


def run_batch(engine, batch: int, mask: bool, steps: int, top_p: float, seed: int) -> dict:
    """One batch decoded to the end; the steady steps' wall times and per-phase host ms."""
    add_batch(engine, batch, mask, steps, top_p, seed)
    walls: list[float] = []
    per_step: list[dict[str, float]] = []
    while engine.has_work():
        totals: dict[str, float] = defaultdict(float)
        _, gc_before = COLLECTOR.snapshot()
        with timed_phases(totals):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        _, gc_after = COLLECTOR.snapshot()
        for generation, (after, before) in enumerate(zip(gc_after, gc_before, strict=True)):
            if after > before:
                totals[f"gc: generation {generation}"] += after - before
        per_step.append(totals)
    # The first steps hold the prefill; the last ones drain the deferred masks.
    steady = slice(WARMUP_STEPS, len(walls) - TAIL_STEPS)
    walls, per_step = walls[steady], per_step[steady]
    labels = sorted({label for totals in per_step for label in totals})
    phases = {label: 1e3 * sum(t.get(label, 0.0) for t in per_step) / len(per_step) for label in labels}
    return {"median_step_ms": 1e3 * statistics.median(walls), "mean_step_ms": 1e3 * statistics.mean(walls),
            "max_step_ms": 1e3 * max(walls), "phases_ms": phases}


def device_timeline(engine, batch: int, mask: bool, steps: int, top_p: float, seed: int) -> dict:
    """One batch decoded to the end, its steady steps profiled: device ms per step by stream
    ("compute" holds the most kernel time), busy (their union), idle, and kernel ms by name."""
    add_batch(engine, batch, mask, steps, top_p, seed)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    for step in range(steps + WARMUP_STEPS + TAIL_STEPS + 1):
        if step == WARMUP_STEPS:
            torch.cuda.synchronize()
            profiler.start()
        engine.step()
        if step == WARMUP_STEPS + steps - 1:
            torch.cuda.synchronize()
            profiler.stop()
    while engine.has_work():
        engine.step()
    profile = device_profile(profiler.events(), steps)
    streams = profile["streams_ms"]
    return {"compute_ms": streams[0] if streams else 0.0, "other_streams_ms": sum(streams[1:]),
            "busy_ms": profile["busy_ms"], "idle_ms": profile["idle_ms"], "kernels_ms": profile["kernels_ms"]}


def print_device_timeline(rows: list[dict]) -> None:
    print_table(rows, ["batch", "mask", "compute_ms", "other_streams_ms", "busy_ms", "idle_ms"])
    for batch in dict.fromkeys(r["batch"] for r in rows):
        on = next(r["kernels_ms"] for r in rows if r["batch"] == batch and r["mask"])
        off = next(r["kernels_ms"] for r in rows if r["batch"] == batch and not r["mask"])
        added = sorted(((on.get(k, 0.0) - off.get(k, 0.0), k) for k in on.keys() | off.keys()), reverse=True)
        print(f"\nB={batch}: device ms per step the mask adds, by kernel (largest 6)")
        for ms, name in added[:6]:
            print(f"  {ms:+8.3f}  {name}")


def plot(rows: list[dict], device_name: str, path: str) -> None:
    """Stacked top-level phases per run (nested ones, "a: b: c", the worker's "execute: ..."
    and the collector's "gc: ..." are left out, as the phases they ran in hold them), then the
    rest of the median step."""
    plt = pyplot()
    labels = sorted({label for r in rows for label in r["phases_ms"]
                     if not label.startswith(("execute", "gc:")) and label.count(":") == 1})
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 2.5))
    names = [f"B={r['batch']} mask {'on' if r['mask'] else 'off'}" for r in rows]
    left = [0.0] * len(rows)
    for i, label in enumerate(labels):
        widths = [r["phases_ms"].get(label, 0.0) for r in rows]
        ax.barh(names, widths, 0.7, left=left, label=label, color=plt.cm.tab20(i % 20))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    rest = [max(0.0, r["median_step_ms"] - x) for r, x in zip(rows, left, strict=True)]
    ax.barh(names, rest, 0.7, left=left, label="rest of the step", color="lightgray")
    ax.set_xlabel(f"host ms per steady decode step ({device_name})")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="embedded",
                    help="'embedded' (SmolLM2-135M-Instruct) or a model path / config for --load-format dummy")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[8])
    ap.add_argument("--steps", type=int, default=40, help="steady decode steps per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device-timeline", action="store_true",
                    help="CUDA: also profile one run per side and batch on the device's timeline")
    ap.add_argument("--mask-format", choices=["ids", "bitmap"], default="ids",
                    help="the wire format the masked runs ask for")
    ap.add_argument("--name", default=None, help="result file stem (default step_phases_<device>)")
    args = ap.parse_args()

    from fastdeploy.common.startup_heap import settle_collector
    from fastdeploy.engine.args import EngineArgs
    from fastdeploy.engine.engine_core import EngineCore
    from fastdeploy.engine.executor import InProcessExecutor

    global MASK_FORMAT, TEMPERATURE
    MASK_FORMAT = args.mask_format
    TEMPERATURE = args.temperature
    device = torch.device(args.device)
    info, _ = machine_with_device(device, args.threads)
    max_b = max(args.batches)
    config = EngineArgs(model=None if args.model == "embedded" else args.model, load_format=args.load_format,
                        dtype=args.dtype, device=args.device, max_num_seqs=max_b, max_model_len=512,
                        max_num_batched_tokens=max(2048, 16 * max_b), guided_decoding_backend="off",
                        enable_keep_sampling_mask=True).create_engine_config()
    engine = EngineCore(config, InProcessExecutor(config))
    settle_collector("benchmark")
    seeds = iter(range(10**9))
    rows, timeline = [], []
    for batch in args.batches:
        for mask in (True, False):  # first use of this batch size: graphs, kernels, pinned blocks
            run_batch(engine, batch, mask, 8, args.top_p, next(seeds))
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for _ in range(args.reps):
            for mask in (True, False):
                runs[mask].append(run_batch(engine, batch, mask, args.steps, args.top_p, next(seeds)))
        for mask in (False, True):
            by_wall = sorted(runs[mask], key=lambda r: r["median_step_ms"])
            median_run = by_wall[len(by_wall) // 2]
            rows.append({"batch": batch, "mask": mask, **median_run,
                         "run_median_step_ms": [r["median_step_ms"] for r in runs[mask]]})
        if args.device_timeline and device.type == "cuda":
            for mask in (True, False):
                timeline.append({"batch": batch, "mask": mask,
                                 **device_timeline(engine, batch, mask, args.steps, args.top_p, next(seeds))})
    engine.shutdown()

    print_table(rows, ["batch", "mask", "median_step_ms", "mean_step_ms", "max_step_ms"])
    for row in rows:
        print(f"\nB={row['batch']} mask {'on' if row['mask'] else 'off'}: runs' median step "
              + ", ".join(f"{ms:.2f}" for ms in row["run_median_step_ms"]) + " ms")
        for label, ms in sorted(row["phases_ms"].items()):
            print(f"  {label:<36} {ms:8.3f} ms/step")
    if timeline:
        print_device_timeline(timeline)
    name = args.name or f"step_phases_{device.type}"
    print(write_json(name, {"benchmark": "step_phases", "machine": info, "args": vars(args), "rows": rows,
                            "device_timeline": timeline}))
    plot(rows, info["device"], png_path(name))
    print(png_path(name))


if __name__ == "__main__":
    main()
