"""Structured-output quality per backend over held-out JSONSchemaBench schemas.

    python benchmarks/structured_quality.py [--schemas 24] [--max-tokens 192] [--temperature 0.6]
    python benchmarks/structured_quality.py --schemas 0 --skip-generation --name structured_quality_all
    python benchmarks/structured_quality.py --schemas 0 --settings auto --max-tokens 128 --name structured_quality_auto

For each setting (xgrammar alone, llguidance alone, auto) and each sampled schema of
`shared/eval/jsonschemabench` (every k-th file by name, so every category is in the sample):

1. refused: the server would answer 400 (the keyword it names is recorded);
2. compile time, cold, on a fresh compile service (p50 / p99);
3. mask time per token: one GuidedState driven through the schema's first valid test
   instance, `fill_bitmask` timed at every token;
4. generation with the embedded model (one chat request per accepted schema, batched,
   seeded sampling): finished (grammar complete) or cut by max_tokens; each finished
   output validated with `jsonschema` (valid / invalid); tokens per second, and the same
   prompts unconstrained decoding exactly as many tokens each (EOS ignored).

Prints a table, writes JSON and a PNG to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jsonschema  # noqa: E402

from benchmarks.common import machine_info, png_path, print_machine, print_table, write_json  # noqa: E402
from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.common.errors import ParameterError  # noqa: E402
from fastdeploy.entrypoints.openai.guided_request import guided_spec_from_request
from fastdeploy.model_executor.guided_decoding import (  # noqa: E402
    GrammarCompileService,
    GuidedState,
    allocate_bitmask,
    resolve_guided_spec,
)

JSB = Path(__file__).resolve().parents[2] / "shared" / "eval" / "jsonschemabench"
SETTINGS = ("xgrammar", "llguidance", "auto")


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def sample(n: int) -> list[Path]:
    files = sorted(JSB.glob("*.json"))
    if n <= 0 or n >= len(files):
        return files
    step = len(files) / n
    return [files[int(i * step)] for i in range(n)]


def mask_us_per_token(state: GuidedState, token_ids: list[int], vocab: int) -> list[float]:
    bitmask = allocate_bitmask(1, vocab)
    times = []
    for t in token_ids:
        t0 = time.perf_counter()
        state.fill_bitmask(bitmask, 0)
        times.append((time.perf_counter() - t0) * 1e6)
        if not state.accept(t):
            break
    return times


def measure_setting(setting: str, files: list[Path], llm: LLM, args) -> tuple[dict, list[dict]]:
    tok, vocab = llm.tokenizer, llm.engine.executor.info.vocab_size
    service = GrammarCompileService.from_tokenizer(tok, vocab, backends=("xgrammar", "llguidance"),
                                                   stop_token_ids=list(llm.engine.executor.info.eos_token_ids),
                                                   timeout_s=args.compile_timeout)
    rows, accepted = [], []
    compile_ms, mask_us = [], []
    for path in files:
        data = json.loads(path.read_text())
        row = {"schema": path.stem, "setting": setting}
        try:
            spec = resolve_guided_spec(guided_spec_from_request({"guided_json": data["schema"]}), setting)
        except ParameterError as e:
            message = str(e)
            row.update(status="refused", keyword=message.split("`")[1] if "keyword `" in message else None,
                       message=message[:300])
            rows.append(row)
            continue
        row["backend"] = spec.backend
        t0 = time.perf_counter()
        try:
            compiled = service.compile(spec)
        except Exception as e:  # a compile failure on the worker is a 400 too
            row.update(status="compile_error", message=str(e)[:300])
            rows.append(row)
            continue
        row["compile_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        row["status"] = "compiled"  # until generation says more
        compile_ms.append(row["compile_ms"])
        valid = next((t["data"] for t in data["tests"] if t["valid"]), None)
        if valid is not None:
            times = mask_us_per_token(GuidedState(compiled), tok.encode(json.dumps(valid), add_special_tokens=False),
                                      vocab)
            mask_us.extend(times)
            row["mask_us"] = round(statistics.fmean(times), 1) if times else None
        rows.append(row)
        accepted.append((row, data["schema"], spec))
    service.shutdown()

    if args.skip_generation:
        accepted = []
    chats = [[{"role": "user", "content": f"Reply with one JSON value for this schema:\n{json.dumps(s)[:1500]}"}]
             for _, s, _ in accepted]
    params = [SamplingParams(temperature=args.temperature, top_p=0.95, seed=i, max_tokens=args.max_tokens, guided=spec)
              for i, (_, _, spec) in enumerate(accepted)]
    t0 = time.perf_counter()
    outs = llm.chat(chats, params) if accepted else []
    constrained_s = time.perf_counter() - t0
    lengths = []
    for (row, schema, _), out in zip(accepted, outs, strict=True):
        o = out.outputs[0]
        lengths.append(len(o.token_ids))
        if o.finish_reason != "stop":
            row["status"] = o.finish_reason or "length"
            continue
        try:
            jsonschema.validators.validator_for(schema)(schema).validate(json.loads(o.text))
            row["status"] = "valid"
        except (jsonschema.ValidationError, json.JSONDecodeError) as e:
            row.update(status="invalid", message=str(e)[:300])
        except jsonschema.SchemaError:
            row["status"] = "unjudged"
    free = [SamplingParams(temperature=args.temperature, top_p=0.95, seed=i, max_tokens=max(n, 1), ignore_eos=True)
            for i, n in enumerate(lengths)]
    t0 = time.perf_counter()
    if accepted:
        llm.chat(chats, free)
    free_s = time.perf_counter() - t0

    count = {k: sum(r.get("status") == k for r in rows) for k in ("refused", "compile_error", "compiled", "valid",
                                                                     "invalid", "length", "unjudged")}
    finished = count["valid"] + count["invalid"]
    tokens = sum(lengths)
    summary = {
        "setting": setting, "schemas": len(files), **count, "finished": finished,
        "pass_rate": round(count["valid"] / len(files), 3) if tokens else None,
        "invalid_of_finished": round(count["invalid"] / finished, 3) if finished else None,
        "by_backend": {b: sum(r.get("backend") == b for r in rows) for b in ("xgrammar", "llguidance")},
        "compile_ms_p50": pct(compile_ms, 0.5), "compile_ms_p99": pct(compile_ms, 0.99),
        "mask_us_per_token": round(statistics.fmean(mask_us), 1) if mask_us else None,
        "mask_us_p50": round(pct(mask_us, 0.5), 1) if mask_us else None,
        "tok_s": round(tokens / constrained_s, 1) if tokens else None,
        "unconstrained_tok_s": round(tokens / free_s, 1) if tokens else None,
        "refusal_keywords": sorted({r["keyword"] for r in rows if r.get("keyword")}),
    }
    if summary["tok_s"] and summary["unconstrained_tok_s"]:
        summary["vs_unconstrained"] = round(summary["tok_s"] / summary["unconstrained_tok_s"], 3)
    return summary, rows


def plot(summaries: list[dict], path: str) -> None:
    from benchmarks.common import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    parts = (("valid", "tab:green"), ("invalid", "tab:red"), ("length", "tab:gray"), ("compiled", "tab:blue"),
             ("refused", "tab:orange"), ("compile_error", "tab:purple"))
    bottom = [0] * len(summaries)
    names = [s["setting"] for s in summaries]
    for key, colour in parts:
        values = [s[key] for s in summaries]
        ax.bar(names, values, bottom=bottom, color=colour, label=key)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("schemas")
    ax.set_title(f"JSONSchemaBench sample ({summaries[0]['schemas']} schemas): outcome per backend")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", type=int, default=24, help="sample size; 0 = all 230")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--compile-timeout", type=float, default=60.0)
    ap.add_argument("--skip-generation", action="store_true",
                    help="refusals, compile and mask times only (all 230 schemas fit in minutes on a CPU)")
    ap.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                    help="which backends to measure (auto alone runs all 230 schemas' generation in minutes)")
    ap.add_argument("--name", default="structured_quality")
    args = ap.parse_args()

    info = machine_info()
    print_machine(info)
    files = sample(args.schemas)
    llm = LLM(max_num_seqs=max(8, len(files)), max_model_len=2048)
    summaries, rows = [], []
    for setting in args.settings:
        summary, setting_rows = measure_setting(setting, files, llm, args)
        summaries.append(summary)
        rows.extend(setting_rows)
    print_table(summaries, ["setting", "schemas", "refused", "compile_error", "compiled", "finished", "valid",
                            "invalid", "length", "pass_rate", "compile_ms_p50", "compile_ms_p99", "mask_us_per_token",
                            "mask_us_p50", "tok_s", "unconstrained_tok_s"])
    for s in summaries:
        print(f"{s['setting']}: refusals name {', '.join(s['refusal_keywords']) or 'nothing'}; "
              f"by backend {s['by_backend']}")
    payload = {"benchmark": args.name, "machine": info, "args": vars(args), "summaries": summaries, "rows": rows}
    print("wrote", write_json(args.name, payload))
    try:
        plot(summaries, png_path(args.name))
        print("wrote", png_path(args.name))
    except ImportError:
        print("matplotlib missing: no PNG (pip install -r requirements-bench.txt)")


if __name__ == "__main__":
    main()
