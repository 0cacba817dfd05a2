"""Where a speculating engine's host time goes, per step, against the engine without speculation.

    python benchmarks/spec_host_profile.py [--method mtp|ngram] [--device cuda] [--batches 16 64]
        [--caps 0 2] [--tokens 192] [--tokenizer DIR] [--top 25] [--name NAME]

On a GPU a small model's step is the host's: `benchmarks/mtp_step_cost.py --device-timeline` has
the embedded model's shape busy on the device for about 1 ms a step while an engine step takes
1.1-2.3 ms without speculation and 1.2-4.6 ms with it. This runs the engines of mtp_step_cost.py
(the same models, prompts and fixed caps) under cProfile, one `generate` per batch and
configuration after an untimed one, and reports each function's own time in microseconds per
engine step, with its difference from the engine without speculation. cProfile slows Python
code more than native code: compare rows with each other, not with the unprofiled step times
(which are printed beside them, best of two unprofiled runs).

Writes benchmarks/results/<name>.json (per batch and configuration: the unprofiled ms per step,
and the `--top` functions by own time, µs per step) and a PNG of the largest differences.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import finish_bar_axis, machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402,I001
from benchmarks.mtp_step_cost import NUM_DRAFTS, add_engine_args, build_engines, cap_policy, prompts  # noqa: E402
from benchmarks.verify_step import counted_steps  # noqa: E402
from fastdeploy import LLM, SamplingParams  # noqa: E402


def _label(key: tuple[str, int, str]) -> str:
    path, line, name = key
    return f"{os.path.basename(path)}:{line}:{name}" if path != "~" else name


def profile_run(llm: LLM, batch: int, tokens: int, callees_of: list[str]
                ) -> tuple[float, dict[str, float], dict[str, float], dict[str, dict[str, float]], int]:
    """(unprofiled ms per step, best of two; own and cumulative µs per step of every function;
    per function named in `callees_of`, the cumulative µs per step of each of its callees;
    steps profiled)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts(batch), params)  # every shape the runs reach, compiled and captured
    best = float("inf")
    for _ in range(2):
        with counted_steps(llm) as steps:
            start = time.perf_counter()
            llm.generate(prompts(batch), params)
            best = min(best, 1e3 * (time.perf_counter() - start) / steps[0])
    profiler = cProfile.Profile()
    with counted_steps(llm) as steps:
        profiler.enable()
        llm.generate(prompts(batch), params)
        profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    own = {_label(key): 1e6 * value[2] / steps[0] for key, value in stats.items()}
    cumulative = {_label(key): 1e6 * value[3] / steps[0] for key, value in stats.items() if "fastdeploy" in key[0]}
    callees: dict[str, dict[str, float]] = {}
    for key, value in stats.items():  # value[4]: the callers of `key`, each with its (.., .., own, cumulative)
        for caller, timing in value[4].items():
            if caller[2] in callees_of:
                callees.setdefault(_label(caller), {})[_label(key)] = round(1e6 * timing[3] / steps[0], 1)
    return best, own, cumulative, callees, steps[0]


def count_syncs(llm: LLM, batch: int, tokens: int) -> dict:
    """CUDA: synchronisations per decode step of one more `generate` (PyTorch's sync debug mode,
    `tests/gpu/sync_count.py`; the packed frame's copy counts one): median, max, and the source
    lines PyTorch saw with how often."""
    from tests.gpu.sync_count import count_step_syncs, steady_decode

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with count_step_syncs(llm.engine.executor.runner) as steps:
        llm.generate(prompts(batch), params)
    decode = steady_decode(steps)
    totals = [s.total for s in decode] or [0]
    sources = collections.Counter(src.split("fastdeploy/", 1)[-1] for s in decode for src in s.sources)
    return {"decode_steps": len(decode), "median": statistics.median(totals), "max": max(totals),
            "sources": dict(sources)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, batches=[16, 64], tokens=192)
    ap.add_argument("--caps", nargs="+", default=["0", str(NUM_DRAFTS)],
                    help='fixed caps, or cap sequences taken in turn such as "0,0,0,0,2"')
    ap.add_argument("--top", type=int, default=25, help="functions kept per configuration, by own time")
    ap.add_argument("--callees", nargs="*", default=["feed_in_flight", "draft_in_flight", "launch", "_submit"],
                    help="functions (by name) whose callees' cumulative times are recorded")
    ap.add_argument("--count-syncs", action="store_true",
                    help="CUDA: also count the host-device synchronisations of each steady decode step")
    ap.add_argument("--name", default="spec_host_profile")
    args = ap.parse_args()
    info = machine_info()
    print_machine(info)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        off, speculating = build_engines(args, tmp)
        for batch in args.batches:
            base_ms, base, cumulative, callees, steps = profile_run(off, batch, args.tokens, args.callees)
            runs.append({"batch": batch, "config": "off", "ms_per_step": base_ms, "steps": steps, "own_us": base,
                         "cum_us": cumulative, "callees": callees})
            if args.count_syncs:
                runs[-1]["syncs"] = count_syncs(off, batch, args.tokens)
            for cap in args.caps:
                speculating.engine.draft_policy = cap_policy(cap)  # type: ignore[assignment]
                ms, own, cumulative, callees, steps = profile_run(speculating, batch, args.tokens, args.callees)
                runs.append({"batch": batch, "config": f"cap{cap}", "ms_per_step": ms, "steps": steps, "own_us": own,
                             "cum_us": cumulative, "callees": callees})
                if args.count_syncs:
                    runs[-1]["syncs"] = count_syncs(speculating, batch, args.tokens)
        for llm in (off, speculating):
            llm.engine.shutdown()
    table = []
    for run in runs:
        base = next(r["own_us"] for r in runs if r["batch"] == run["batch"] and r["config"] == "off")
        top = sorted(run["own_us"].items(), key=lambda kv: kv[1] - base.get(kv[0], 0.0), reverse=True)[:args.top]
        run["top"] = [{"function": f, "us_per_step": round(us, 1), "off_us_per_step": round(base.get(f, 0.0), 1)}
                      for f, us in top]
        run["total_us"] = round(sum(run["own_us"].values()), 1)
        for item in run["top"][:12 if run["config"] != "off" else 0]:
            table.append({"batch": run["batch"], "config": run["config"], "step_ms": round(run["ms_per_step"], 3),
                          "function": item["function"][:70], "us": item["us_per_step"],
                          "off_us": item["off_us_per_step"], "diff": round(item["us_per_step"] -
                                                                           item["off_us_per_step"], 1)})
        base_cum = next(r["cum_us"] for r in runs if r["batch"] == run["batch"] and r["config"] == "off")
        # The engine's own functions by cumulative time, largest difference first: which phase grew.
        grown = sorted(run["cum_us"].items(), key=lambda kv: kv[1] - base_cum.get(kv[0], 0.0), reverse=True)
        run["cum_top"] = [{"function": f, "us_per_step": round(us, 1),
                           "off_us_per_step": round(base_cum.get(f, 0.0), 1)} for f, us in grown[:args.top]]
    for run in runs:  # the JSON keeps the top functions only, once every run was compared with the full off run
        run["own_us"] = {f: round(us, 1) for f, us in sorted(run["own_us"].items(), key=lambda kv: -kv[1])[:args.top]}
        del run["cum_us"]
    print_table(table, list(table[0]) if table else [])
    for run in runs:
        if run["config"] != "off":
            print(f"batch {run['batch']} {run['config']}, cumulative µs per step (off): " + "; ".join(
                f"{i['function']} {i['us_per_step']:.0f} ({i['off_us_per_step']:.0f})" for i in run["cum_top"][:10]))
    for run in runs:
        for caller, calls in run["callees"].items():
            print(f"batch {run['batch']} {run['config']}, callees of {caller} (µs per step): " + "; ".join(
                f"{f} {us:.0f}" for f, us in sorted(calls.items(), key=lambda kv: -kv[1])[:8]))
    for run in runs:
        if "syncs" in run:
            print(f"batch {run['batch']} {run['config']}: synchronisations per decode step {run['syncs']}")
    for run in runs:
        print(f"batch {run['batch']} {run['config']}: {run['ms_per_step']:.3f} ms/step unprofiled, "
              f"{run['total_us'] / 1e3:.3f} ms/step profiled (own time of every function)")
    path = write_json(args.name, {"machine": info, "args": vars(args), "runs": runs})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    worst = [r for r in runs if r["config"] != "off"][-1]
    items = worst["top"][:10][::-1]
    ax.barh([i["function"][:50] for i in items], [i["us_per_step"] - i["off_us_per_step"] for i in items])
    finish_bar_axis(ax, f"µs per step over off ({args.method} {worst['config']}, batch {worst['batch']})")
    fig.savefig(png_path(args.name), dpi=120, bbox_inches="tight")
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()
