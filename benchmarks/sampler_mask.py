"""Sampler latency on CPU with and without the sampling mask (kept set CSR + logZ).

    python benchmarks/sampler_mask.py [--reps N] [--threads T] [--out benchmarks/results/sampler_mask.json]

Logits are N(0, 4^2) over V = 49152 (SmolLM2's vocabulary): peaked like a real LM,
so top-p rows mostly resolve inside the sorted window. Prints a table, writes JSON
and a PNG plot next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fastdeploy.model_executor.layers.sample.metadata import SamplingMetadata  # noqa: E402
from fastdeploy.model_executor.layers.sample.sampler import Sampler  # noqa: E402

VOCAB = 49152
BATCHES = (1, 32, 256)
CONFIGS = {
    "plain T=1": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "top_k=50 top_p=0.95 T=0.8": dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.0),
    "top_p=0.9 T=1": dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
    "min_p=0.05 T=1": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05),
    "greedy": dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
}


def make_meta(b: int, mask: bool, temperature: float, top_k: int, top_p: float, min_p: float) -> SamplingMetadata:
    """Uniform parameters for all rows, no penalties / bias / logprobs."""
    return SamplingMetadata(
        temperature=torch.full((b,), temperature),
        top_k=torch.full((b,), top_k, dtype=torch.int64),
        top_p=torch.full((b,), top_p),
        min_p=torch.full((b,), min_p),
        repetition_penalty=torch.ones(b),
        presence_penalty=torch.zeros(b),
        frequency_penalty=torch.zeros(b),
        prompt_token_ids=None,
        output_token_ids=None,
        logit_bias_rows=None,
        logit_bias_cols=None,
        logit_bias_values=None,
        generators=[None] * b,
        max_num_logprobs=-1,
        logprobs_mode="raw_logprobs",
        return_sampling_mask=torch.ones(b, dtype=torch.bool) if mask else None,
    )


def time_call(fn, reps: int, budget_s: float = 2.0) -> list[float]:
    """Wall times in ms of `reps` calls after one warm-up (fewer if over budget)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    return times


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CONFIGS), figsize=(4 * len(CONFIGS), 3.6), sharey=True)
    for ax, name in zip(axes, CONFIGS):
        for mask, style in ((False, "o-"), (True, "s--")):
            pts = [(r["batch"], r["median_ms"]) for r in records if r["config"] == name and r["mask"] == mask]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label="with mask" if mask else "no mask")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("batch")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"ms per call (V={VOCAB}, CPU)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    # One thread by default: on a shared 2-core box OpenMP threads that wait on each
    # other under contention turn milliseconds into hundreds of milliseconds.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sampler_mask.json"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sampler = Sampler()
    records = []
    print(f"{'config':<28}{'B':>5}{'no mask ms':>12}{'mask ms':>10}{'overhead':>10}{'kept/row':>10}")
    for name, params in CONFIGS.items():
        for b in BATCHES:
            logits = torch.randn(b, VOCAB) * 4.0
            row = {}
            for mask in (False, True):
                meta = make_meta(b, mask, **params)
                times = time_call(lambda: sampler(logits, meta), args.reps)
                med = statistics.median(times)
                out = sampler(logits, meta)
                kept = float(out.mask_offsets[-1]) / b if mask else None
                row[mask] = med
                records.append(dict(config=name, batch=b, vocab=VOCAB, mask=mask, median_ms=med,
                                    min_ms=min(times), reps=len(times), kept_per_row=kept))
            print(f"{name:<28}{b:>5}{row[False]:>12.2f}{row[True]:>10.2f}"
                  f"{(row[True] / row[False] - 1) * 100:>9.0f}%{records[-1]['kept_per_row']:>10.1f}")

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    env = dict(torch=torch.__version__, threads=torch.get_num_threads(), machine=platform.machine(),
               processor=platform.processor() or platform.machine())
    with open(args.out, "w") as f:
        json.dump(dict(env=env, records=records), f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(records, png)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
