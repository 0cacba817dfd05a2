"""Host µs of one `prepare_inputs` call for a decode step, per batch size and drafts per sequence.

    python benchmarks/input_prep_cost.py [--batches 16 64 256] [--drafts 0 1 2 4] [--context 300]
                                         [--calls 400] [--name NAME]

A verify step lays each sequence out as 1 + k decode rows (its newest token, then its drafts),
each row with its block table: on a GPU where a small model's step is the host's (see
`benchmarks/mtp_step_cost.py`), this is part of what a verify step costs beyond a plain one.
Sequences at `--context` tokens and on, 16-token blocks, in-flight tokens as an engine sends
them ahead; CPU tensors (the copy to a GPU is one non-blocking transfer either way). Median and
10th percentile over `--calls` calls after 50 untimed ones. Writes benchmarks/results/<name>.json
and a PNG.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402
from fastdeploy.common.step_input import IN_FLIGHT_TOKEN, ChunkInput  # noqa: E402
from fastdeploy.worker.input_prep import prepare_inputs  # noqa: E402

BLOCK_SIZE = 16


def decode_step(batch: int, drafts: int, context: int) -> tuple[list[ChunkInput], dict[int, list[int]]]:
    """`batch` sequences, each its in-flight newest token plus `drafts` drafts."""
    chunks, drafted = [], {}
    for s in range(batch):
        start = context + s
        num_blocks = (start + drafts + 1) // BLOCK_SIZE + 2
        table = list(range(s * 64, s * 64 + num_blocks))
        chunks.append(ChunkInput(s, [IN_FLIGHT_TOKEN] + [5] * drafts, start, table, True, drafts))
        if drafts:
            drafted[s] = [5] * drafts
    return chunks, drafted


def time_calls(batch: int, drafts: int, context: int, calls: int) -> tuple[float, float]:
    chunks, drafted = decode_step(batch, drafts, context)
    device = torch.device("cpu")
    for _ in range(50):
        prepare_inputs(chunks, drafted, BLOCK_SIZE, device)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        prepare_inputs(chunks, drafted, BLOCK_SIZE, device)
        times.append(time.perf_counter() - start)
    times.sort()
    return 1e6 * times[len(times) // 2], 1e6 * times[len(times) // 10]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--drafts", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--name", default="input_prep_cost")
    args = ap.parse_args()
    info = machine_info()
    print_machine(info)
    rows = []
    for batch in args.batches:
        for drafts in args.drafts:
            median, p10 = time_calls(batch, drafts, args.context, args.calls)
            rows.append({"batch": batch, "drafts": drafts, "rows": batch * (1 + drafts),
                         "median_us": round(median, 1), "p10_us": round(p10, 1)})
    print_table(rows, list(rows[0]))
    path = write_json(args.name, {"machine": info, "args": vars(args), "rows": rows})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for batch in args.batches:
        mine = [r for r in rows if r["batch"] == batch]
        ax.plot([r["drafts"] for r in mine], [r["median_us"] for r in mine], marker="o", label=f"{batch} sequences")
    ax.set_xlabel("drafts per sequence")
    ax.set_ylabel("µs per prepare_inputs call (median)")
    ax.legend()
    fig.savefig(png_path(args.name), dpi=120, bbox_inches="tight")
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()
