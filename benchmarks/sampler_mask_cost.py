"""What the sampling mask adds to one sampler call: host time, device time and launches.

    python benchmarks/sampler_mask_cost.py [--device cuda|cpu] [--batches 64 256]
        [--vocabs 49152 151936] [--greedy-shares 0 0.1] [--reps 30]

For each batch B, vocabulary V and share of greedy rows (the other rows draw with
top_p = 0.95 from N(0, 4^2) logits), the sampler runs on metadata built by the model
runner's own `_sampling_metadata` (the row split and mask slots the engine hands it),
once with no row asking for the sampling mask and once with every row asking:

* host_ms: the host's time to issue the call (CUDA: the kernels are queued, not waited
  for; CPU: the whole call), median;
* device_ms (CUDA): the device's time for the call with every kernel already queued (a
  sleep kernel ahead of it holds the device until the host has issued the whole call),
  between two events, median;
* kernels (CUDA): the kernels and copies one call puts on the device (torch profiler).

Writes benchmarks/results/sampler_mask_cost_<device>.json and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import (  # noqa: E402
    finish_bar_axis,
    machine_with_device,
    png_path,
    print_table,
    pyplot,
    queued_device_ms,
    write_json,
)
from fastdeploy.common.sampling_params import SamplingParams  # noqa: E402
from fastdeploy.model_executor.layers.sample.metadata import SamplingMetadata  # noqa: E402
from fastdeploy.model_executor.layers.sample.sampler import Sampler  # noqa: E402
from fastdeploy.worker.input_prep import sampling_metadata  # noqa: E402
from fastdeploy.worker.sequence_state import WorkerSequence  # noqa: E402


def runner_metadata(device: torch.device, b: int, greedy_share: float, mask: bool) -> SamplingMetadata:
    """The metadata the model runner builds for B decode rows (greedy rows spread evenly)."""
    n_greedy = round(b * greedy_share)
    greedy = {int(i * b / n_greedy) for i in range(n_greedy)} if n_greedy else set()
    states = [WorkerSequence([1, 2, 3], SamplingParams(temperature=0.0) if r in greedy else SamplingParams(top_p=0.95),
                             mask, None) for r in range(b)]
    runner = SimpleNamespace(device=device, config=SimpleNamespace(logprobs_mode="raw_logprobs"))
    return sampling_metadata(states, runner.config.logprobs_mode, runner.device)


def measure(device: torch.device, logits: torch.Tensor, meta: SamplingMetadata, reps: int) -> dict:
    sampler = Sampler()
    cuda = device.type == "cuda"
    for _ in range(3):
        sampler(logits, meta)
    host, on_device = [], []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sampler(logits, meta)
        host.append((time.perf_counter() - t0) * 1e3)
        if not cuda:
            continue
        on_device.append(queued_device_ms(lambda: sampler(logits, meta)))
    row = {"host_ms": statistics.median(host), "device_ms": None, "kernels": None}
    if cuda:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            sampler(logits, meta)
            torch.cuda.synchronize()
        row["device_ms"] = statistics.median(on_device)
        row["kernels"] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return row


def plot(rows: list[dict], device_name: str, path: str) -> None:
    plt = pyplot()
    keys = [k for k in ("host_ms", "device_ms") if rows and rows[0][f"off_{k}"] is not None]
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 3.8))
    axes = list(axes) if len(keys) > 1 else [axes]
    labels = [f"B={r['batch']}\nV={r['vocab']}\ng={r['greedy_share']}" for r in rows]
    xs = range(len(rows))
    for ax, key in zip(axes, keys, strict=True):
        ax.bar([i - 0.2 for i in xs], [r[f"off_{key}"] for r in rows], 0.4, label="mask off")
        ax.bar([i + 0.2 for i in xs], [r[f"on_{key}"] for r in rows], 0.4, label="mask on")
        ax.set_xticks(list(xs), labels, fontsize=7)
        finish_bar_axis(ax, f"{key.replace('_ms', '')} ms per sampler call ({device_name})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--greedy-shares", type=float, nargs="+", default=[0.0, 0.1])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default=None, help="result file stem (default sampler_mask_cost_<device>)")
    args = ap.parse_args()
    device = torch.device(args.device)
    info, device_name = machine_with_device(device, args.threads)
    rows = []
    for v in args.vocabs:
        for b in args.batches:
            gen = torch.Generator(device=device).manual_seed(0)
            logits = torch.randn(b, v, device=device, generator=gen) * 4.0
            for share in args.greedy_shares:
                off = measure(device, logits, runner_metadata(device, b, share, False), args.reps)
                on = measure(device, logits, runner_metadata(device, b, share, True), args.reps)
                row = {"batch": b, "vocab": v, "greedy_share": share}
                row.update({f"off_{k}": val for k, val in off.items()})
                row.update({f"on_{k}": val for k, val in on.items()})
                row["host_added_ms"] = on["host_ms"] - off["host_ms"]
                row["device_added_ms"] = on["device_ms"] - off["device_ms"] if on["device_ms"] is not None else None
                rows.append(row)
                print(f"B={b} V={v} greedy={share}: host +{row['host_added_ms']:.3f} ms"
                      + (f", device +{row['device_added_ms']:.3f} ms" if row["device_added_ms"] is not None else ""),
                      flush=True)
    print_table(rows, ["batch", "vocab", "greedy_share", "off_host_ms", "on_host_ms", "host_added_ms",
                       "off_device_ms", "on_device_ms", "device_added_ms", "off_kernels", "on_kernels"])
    name = args.name or f"sampler_mask_cost_{device.type}"
    print(write_json(name, {"benchmark": "sampler_mask_cost", "machine": info, "args": vars(args), "rows": rows}))
    plot(rows, device_name, png_path(name))
    print(png_path(name))


if __name__ == "__main__":
    main()
