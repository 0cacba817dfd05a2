"""Host time of a step's sampling inputs: built and copied (`sampling_metadata`) against given
again by `SamplingMetadataCache` when a decode step samples the same rows as the step before.

    python benchmarks/sampling_metadata_cost.py [--device cpu|cuda] [--batches 1 16 64] [--calls 2000]

Per batch and parameter mix (greedy; temperature 0.8 with top-p 0.9): microseconds per call of
each path on the host (on CUDA the built path includes its pinned staging buffer and the
non-blocking copy's launch). Writes benchmarks/results/sampling_metadata_cost.json and a PNG.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import (  # noqa: E402
    finish_bar_axis,
    machine_info,
    png_path,
    print_machine,
    print_table,
    pyplot,
    write_json,
)
from fastdeploy.common.sampling_params import SamplingParams  # noqa: E402
from fastdeploy.worker.input_prep import SamplingMetadataCache, sampling_metadata  # noqa: E402
from fastdeploy.worker.sequence_state import WorkerSequence  # noqa: E402

MIXES = {"greedy": SamplingParams(temperature=0.0), "top_p": SamplingParams(temperature=0.8, top_p=0.9)}


def per_call_us(fn, calls: int, device: torch.device) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--name", default="sampling_metadata_cost")
    args = ap.parse_args()
    device = torch.device(args.device)
    info = machine_info()
    print_machine(info)
    rows = []
    for batch in args.batches:
        for mix, params in MIXES.items():
            states = [WorkerSequence([1, 2, 3], params, False, None) for _ in range(batch)]
            cache = SamplingMetadataCache()
            built = per_call_us(lambda s=states: sampling_metadata(s, "raw_logprobs", device), args.calls, device)
            reused = per_call_us(lambda s=states, c=cache: c.get(s, "raw_logprobs", device), args.calls, device)
            rows.append({"batch": batch, "params": mix, "built_us": built, "reused_us": reused})
    print_table(rows, ["batch", "params", "built_us", "reused_us"])
    path = write_json(args.name, {"machine": info, "args": vars(args), "rows": rows})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['params']} B={r['batch']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["built_us"] for r in rows], 0.4, label="built and copied")
    ax.bar([x + 0.2 for x in xs], [r["reused_us"] for r in rows], 0.4, label="given again")
    ax.set_xticks(list(xs), labels, fontsize=7, rotation=20)
    finish_bar_axis(ax, "host µs per step")
    fig.savefig(png_path(args.name), dpi=120, bbox_inches="tight")
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()
