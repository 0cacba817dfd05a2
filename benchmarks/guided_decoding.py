"""Guided decoding speed over JSONSchemaBench's 230 schemas (xgrammar on CPU).

    python benchmarks/guided_decoding.py [--timeout 30] [--parallel 1] [--out benchmarks/results/guided_decoding.json]

Per schema, in a forked child (see tests/guided_decoding/jsb.py): cold compile time
through GrammarCompileService (submit -> ready), the same spec again (served by
the compile service's cache), and the time of every fill_bitmask call while driving the
schema's test instances token by token. Prints a table, writes JSON and a PNG.
Use --parallel 1 for clean timings (each child uses one compiler thread).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fastdeploy.model_executor.guided_decoding.xgrammar_backend import tokenizer_info_from_hf  # noqa: E402
from fastdeploy.model_executor.model_loader import get_tokenizer  # noqa: E402
from tests.guided_decoding.jsb import load_cases, rates, run_cases  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=30.0, help="per-schema compile budget, s")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "guided_decoding.json"))
    args = ap.parse_args()

    tok = get_tokenizer(None)
    info = tokenizer_info_from_hf(tok)
    cases = load_cases(tok)
    t0 = time.perf_counter()
    results = run_cases(cases, info, timeout_s=args.timeout, parallel=args.parallel, measure_fill=True)
    wall = time.perf_counter() - t0

    ok = [r for r in results if r.status == "ok"]
    cold = [r.compile_s for r in ok]
    cached = [r.cached_s for r in ok]
    fill = [t for r in ok for t in r.fill_s]
    summary = {
        "cold_compile_ms": {"p50": 1e3 * pct(cold, 0.5), "p90": 1e3 * pct(cold, 0.9), "max": 1e3 * max(cold),
                            "mean": 1e3 * statistics.fmean(cold)},
        "cached_compile_ms": {"p50": 1e3 * pct(cached, 0.5), "p99": 1e3 * pct(cached, 0.99), "max": 1e3 * max(cached)},
        "fill_bitmask_us": {"p50": 1e6 * pct(fill, 0.5), "p99": 1e6 * pct(fill, 0.99), "max": 1e6 * max(fill),
                            "tokens": len(fill)},
        "coverage": rates(results),
        "timeout_s": args.timeout,
        "wall_s": wall,
    }
    print(f"{'metric':<22}{'p50':>10}{'p90/p99':>10}{'max':>10}")
    c, k, f = summary["cold_compile_ms"], summary["cached_compile_ms"], summary["fill_bitmask_us"]
    print(f"{'cold compile (ms)':<22}{c['p50']:>10.1f}{c['p90']:>10.1f}{c['max']:>10.1f}   (p90)")
    print(f"{'cached compile (ms)':<22}{k['p50']:>10.3f}{k['p99']:>10.3f}{k['max']:>10.3f}   (p99)")
    print(f"{'fill bitmask (us)':<22}{f['p50']:>10.1f}{f['p99']:>10.1f}{f['max']:>10.1f}   (p99, {f['tokens']} tokens)")
    cov = summary["coverage"]
    print(f"compiled {cov['compiled']}/{cov['schemas']} ({cov['timeouts']} timeouts at {args.timeout:g} s, "
          f"{cov['compile_errors']} errors); valid-accept {cov['valid_accept']:.3f}, "
          f"invalid-reject {cov['invalid_reject']:.3f}; wall {wall:.0f} s")

    payload = {
        "benchmark": "guided_decoding",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "summary": summary,
        "per_schema": [
            {"name": r.name, "status": r.status, "cold_ms": 1e3 * r.compile_s, "cached_ms": 1e3 * r.cached_s,
             "fill_p50_us": 1e6 * pct(r.fill_s, 0.5) if r.fill_s else None, "message": r.message}
            for r in results
        ],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(payload, fh, indent=1)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = sorted(cold)
    a1.plot([1e3 * x for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label="cold")
    xs = sorted(cached)
    a1.plot([1e3 * x for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label="cached")
    a1.set_xscale("log")
    a1.set_xlabel("compile time (ms)")
    a1.set_ylabel("fraction of compiled schemas")
    a1.set_title(f"JSONSchemaBench compile ({len(ok)}/{len(results)} compiled)")
    a1.legend()
    a2.hist([1e6 * t for t in fill], bins=100, log=True)
    a2.set_xlabel("fill_next_token_bitmask (us)")
    a2.set_ylabel("tokens")
    a2.set_title(f"per-token mask fill: p50 {f['p50']:.0f} us, p99 {f['p99']:.0f} us")
    fig.tight_layout()
    png = os.path.splitext(args.out)[0] + ".png"
    fig.savefig(png, dpi=100)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
