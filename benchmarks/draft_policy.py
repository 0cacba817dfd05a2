"""What the draft policy's accounting gives in process: adaptive speculation against the same
engine held without drafts (its floor) and the engine without speculation.

    python benchmarks/draft_policy.py [--device cuda] [--batches 16 64] [--methods ngram mtp]
                                      [--variants untold held0 fixed fixed_in_turn] [--log-steps] [--prompts short|long]
                                      [--max-tokens 256] [--rounds 5] [--name draft_policy]
                                      [--model PATH --load-format dummy --tokenizer DIR]

Per batch and method, engines on `speculative.py`'s copying prompts (greedy, 256 tokens, EOS
ignored): `off` (no speculation), `{method}` (the draft policy as it is), and per `--variants`
(default: untold held0) `{method}_untold` (the policy not told which steps drafted for their
successor, as before that accounting: the step holding a verify step's launch counted as cap
0's), `{method}_held0` (the policy held at cap 0: what speculation costs a step that drafts
nothing), `{method}_fixed` (`"adaptive": false`: every step takes all drafts, sent ahead where
steps overlap) and `{method}_fixed_in_turn` (the same with `async_scheduling="off"`). Rounds
alternate the engines' order; a figure is the median over rounds of tokens per second, and the
table gives each engine's ratio to `off`. Beside them, the policy's own figures for the batch's
class (cap 0's step, each cap's tokens per sequence per second), what it chose, and the timed
rounds' steps (how many; of them sent ahead, with a prefill chunk, verifying drafts).
`--log-steps` also keeps every step the policy observed in the timed rounds (rows, cap, tokens,
ms, sent ahead, the next step takes drafts). The embedded model by default (`mtp` needs its
shipped head); `--model` with `--load-format dummy` runs any config.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402
from benchmarks.speculative import prompts, timed  # noqa: E402
from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.scheduler.draft_policy import DraftPolicy  # noqa: E402

SPECS: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "mtp": {"method": "mtp", "num_speculative_tokens": 2},
}


def untold(policy: DraftPolicy) -> None:
    """The policy's accounting before it was told which steps drafted for their successor."""
    observe = policy.observe

    def observe_untold(*args: Any, **kwargs: Any) -> None:
        kwargs.pop("drafted_next", None)
        observe(*args, **kwargs)

    policy.observe = observe_untold  # type: ignore[method-assign]


def held_at_zero(policy: DraftPolicy) -> None:
    policy.cap = lambda num_rows: 0  # type: ignore[method-assign]


def engines(args: argparse.Namespace, batch: int) -> dict[str, LLM]:
    common: dict[str, Any] = {"device": args.device, "max_num_seqs": batch, "guided_decoding_backend": "off",
                              "num_kv_blocks": args.num_kv_blocks, "load_format": args.load_format,
                              "tokenizer": args.tokenizer}
    built = {"off": LLM(args.model, **common)}
    for method in args.methods:
        for variant in ["", *(f"_{v}" for v in args.variants)]:
            spec = SPECS[method] if not variant.startswith("_fixed") else {**SPECS[method], "adaptive": False}
            turn = {"async_scheduling": "off"} if variant == "_fixed_in_turn" else {}
            llm = built[method + variant] = LLM(args.model, speculative_config=spec, **common, **turn)
            policy = llm.engine.draft_policy
            if variant == "_untold":
                untold(policy)
            elif variant == "_held0":
                held_at_zero(policy)
    return built


def log_steps(llm: LLM) -> list[list[float]]:
    """Every step the engine's policy observes from now on: [rows, cap, tokens, ms, sent ahead,
    the next step takes drafts]."""
    policy = llm.engine.draft_policy
    observe = policy.observe
    log: list[list[float]] = []

    def logged(num_rows: int, cap: int, num_tokens: int, seconds: float, sent_ahead: bool = False,
               drafted_next: bool = False) -> None:
        log.append([num_rows, cap, num_tokens, round(seconds * 1e3, 3), int(sent_ahead), int(drafted_next)])
        observe(num_rows, cap, num_tokens, seconds, sent_ahead, drafted_next=drafted_next)

    policy.observe = logged  # type: ignore[method-assign]
    return log


def class_figures(llm: LLM, batch: int) -> dict[str, Any]:
    """The policy's figures for the class `batch` sequences fall in."""
    policy = llm.engine.draft_policy
    if policy is None:
        return {}
    details = policy.details()
    key = next((k for k in details if int(k.split("-")[0]) <= batch <= int(k.split("-")[-1])), None)
    return details.get(key, {}) if key else {}


def step_counts(llm: LLM) -> dict[str, int]:
    """The engine's steps so far: how many, and of them sent ahead, with a prefill chunk, verifying
    drafts (counted only with speculation on)."""
    stats = llm.engine.spec_stats
    return {"steps": stats.num_steps, "sent_ahead": stats.num_steps_ahead, "with_prefill": stats.num_steps_with_prefill,
            "verify": stats.num_verify_steps}


def run_batch(args: argparse.Namespace, batch: int) -> list[dict[str, Any]]:
    llms = engines(args, batch)
    conversations = prompts(batch, args.prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in llms.values():  # warm-up at full length
        timed(llm, conversations, params)
    tok_s: dict[str, list[float]] = {name: [] for name in llms}
    names = list(llms)
    steps_before = {name: step_counts(llm) for name, llm in llms.items()}
    logs = {name: log_steps(llm) for name, llm in llms.items()
            if args.log_steps and llm.engine.draft_policy is not None}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, count, _ = timed(llms[name], conversations, params)
            tok_s[name].append(count / wall)
    off = statistics.median(tok_s["off"])
    rows = []
    for name, llm in llms.items():
        figures = class_figures(llm, batch)
        caps = figures.get("caps", {})
        ratios = [a / b for a, b in zip(tok_s[name], tok_s["off"], strict=True)]
        rows.append({"batch": batch, "engine": name, "tok_s": round(statistics.median(tok_s[name]), 1),
                     "vs_off": round(statistics.median(tok_s[name]) / off, 3),
                     "round_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                     "chosen_cap": figures.get("best"),
                     "cap0_step_ms": caps.get("0", {}).get("step_ms"),
                     "cap_rates": {k: v["rate"] for k, v in caps.items()},
                     "zero_before_drafts_step_ms": figures.get("zero_before_drafts_step_ms"),
                     "steps": {k: v - steps_before[name][k] for k, v in step_counts(llm).items()},
                     "tok_s_rounds": [round(x, 1) for x in tok_s[name]]})
        if name in logs:
            rows[-1]["observed"] = logs[name]
    for llm in llms.values():
        llm.engine.shutdown()
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    plt = pyplot()
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        these = [r for r in rows if r["batch"] == batch]
        bars = ax.bar([r["engine"] for r in these], [r["vs_off"] for r in these], color="tab:blue")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"batch {batch}: tok/s / no speculation", fontsize=9)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--methods", nargs="+", choices=sorted(SPECS), default=["ngram", "mtp"])
    p.add_argument("--variants", nargs="*", choices=["untold", "held0", "fixed", "fixed_in_turn"],
                   default=["untold", "held0"], help="engines beside off and the policy as it is (see above)")
    p.add_argument("--log-steps", action="store_true", help="keep every step the policies observe in the rows")
    p.add_argument("--prompts", choices=("short", "long"), default="short",
                   help="speculative.py's copying requests: a record or code block, or a four-record array")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--name", default="draft_policy", help="result file stem")
    args = p.parse_args()
    info = machine_info()
    print_machine(info)
    rows: list[dict[str, Any]] = []
    for batch in args.batches:
        rows += run_batch(args, batch)
        print_table([r for r in rows if r["batch"] == batch],
                    ["batch", "engine", "tok_s", "vs_off", "round_ratio_range", "chosen_cap", "cap0_step_ms",
                     "zero_before_drafts_step_ms", "cap_rates"])
    settings = {k: v for k, v in vars(args).items() if k != "name"}
    path = write_json(args.name, {"machine": info, "settings": settings, "specs": SPECS, "rows": rows})
    plot(rows, png_path(args.name))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
