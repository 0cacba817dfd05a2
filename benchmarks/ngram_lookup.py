"""Host n-gram lookup (`NgramProposer.propose`): microseconds per call by context length.

    python benchmarks/ngram_lookup.py [--lengths 100 500 2000 8000] [--calls 2000] [--name NAME]

The host proposer drafts every step that runs in turn (the CPU, tensor parallelism, a request
with a grammar or penalties): one call per drafting sequence. Two kinds of context, 4 drafts,
suffixes of 2-5 tokens (`gpu_scale.py`'s n-gram setting): `random` (ids drawn from the whole
vocabulary: no earlier match, the common case for fresh text) and `repeating` (a 50-token
block over and over: every suffix matches, many times). Best of 5 timings of `--calls` calls.
Writes benchmarks/results/<name>.json and a PNG.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import finish_bar_axis, machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402,I001
from fastdeploy.spec_decode.ngram_proposer import NgramProposer  # noqa: E402

VOCAB = 49152


def contexts(length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    block = rng.integers(0, VOCAB, 50)
    return {"random": rng.integers(0, VOCAB, length),
            "repeating": np.tile(block, -(-length // 50))[:length]}


def time_calls(proposer: NgramProposer, context: np.ndarray, calls: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            proposer.propose(context, 4)
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[100, 500, 2000, 8000])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--name", default="ngram_lookup")
    args = ap.parse_args()
    info = machine_info()
    print_machine(info)
    rng = np.random.default_rng(0)
    proposer = NgramProposer(2, 5)
    rows = []
    for length in args.lengths:
        for kind, context in contexts(length, rng).items():
            rows.append({"length": length, "context": kind, "us_per_call": round(time_calls(proposer, context,
                                                                                           args.calls), 2)})
    print_table(rows, list(rows[0]))
    path = write_json(args.name, {"machine": info, "args": vars(args), "rows": rows})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, kind in enumerate(("random", "repeating")):
        values = [r["us_per_call"] for r in rows if r["context"] == kind]
        ax.bar([x + 0.4 * i for x in range(len(args.lengths))], values, 0.4, label=kind)
    ax.set_xticks([x + 0.2 for x in range(len(args.lengths))], [f"{n} tokens" for n in args.lengths])
    finish_bar_axis(ax, "µs per host n-gram lookup")
    fig.savefig(png_path(args.name), dpi=120, bbox_inches="tight")
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()
