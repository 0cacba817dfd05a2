"""Decode speed-up of speculative decoding on a repetitive task (rewrite a given JSON or code block).

    python benchmarks/speculative.py [--device cpu|cuda] [--batch-sizes 1 16] [--max-tokens 192]
                                     [--spec '{"method": "ngram", "num_speculative_tokens": 4}'] [--rounds 3]

The embedded SmolLM2-135M-Instruct copies a JSON record or a code block it is given
(greedy, EOS honoured), once without speculation and once with --spec, on the same
prompts. Rounds alternate baseline and speculative runs so a noisy machine hurts both
alike; the median over rounds is reported, with how many outputs are token-identical.
Throughput = generated tokens / wall time of the batch, prefill included, after one warm-up round.

The output-path part of the speculative-decoding measurements (packed frame vs a fixed
layout) is `benchmarks/output_packing.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402
from fastdeploy import LLM, SamplingParams  # noqa: E402

NAMES = ["Alice Smith", "Bob Jones", "Chen Wei", "Dana Kaur", "Emil Novak", "Fatima Zahra", "Goran Ilic",
         "Hana Sato"]
CITIES = ["Paris", "Lagos", "Lima", "Oslo", "Pune", "Quito", "Riga", "Seoul"]
PROMPT_KINDS = ("short", "long")
LONG_RECORDS = 4  # records in a "long" prompt's array


def _record(i: int) -> str:
    return json.dumps({
        "id": 1000 + i, "name": NAMES[i % 8], "city": CITIES[(3 * i) % 8], "age": 20 + (7 * i) % 50,
        "email": f"{NAMES[i % 8].split()[0].lower()}{i}@example.com",
        "tags": ["admin", "editor", "viewer"][: 1 + i % 3],
        "address": {"street": f"{10 + i} Main Street", "zip": f"{75000 + 13 * i}"}, "active": i % 2 == 0,
    })


def _records(i: int, count: int) -> str:
    return json.dumps([json.loads(_record(i + j)) for j in range(count)])


def _code(i: int) -> str:
    return (f"def scale_{i}(values, factor={i + 2}):\n    result = []\n    for value in values:\n"
            f"        result.append(value * factor)\n    return result\n\n\n"
            f"def total_{i}(values):\n    total = 0\n    for value in values:\n        total += value\n"
            f"    return total\n")


def prompts(n: int, kind: str = "short") -> list[list[dict]]:
    """`n` copying requests. "short": a JSON record or a code block to repeat (greedy answers of
    33-82 tokens on the embedded model; past them, with EOS ignored, it writes text nothing in
    the prompt predicts). "long": a JSON array of four records to repeat (answers of 220-330
    tokens, so a 256-token measurement is nearly all copying)."""
    if kind not in PROMPT_KINDS:
        raise ValueError(f"prompt kind {kind!r}: one of {', '.join(PROMPT_KINDS)}")
    out = []
    for i in range(n):
        if kind == "long":
            text = f"Repeat this JSON exactly, with no comment:\n{_records(i, LONG_RECORDS)}"
        elif i % 2 == 0:
            text = f"Repeat this JSON exactly, with no comment:\n{_record(i)}"
        else:
            text = f"Rewrite this Python code exactly as it is:\n```python\n{_code(i)}```"
        out.append([{"role": "user", "content": text}])
    return out


def timed(llm: LLM, conversations: list[list[dict]], params: SamplingParams) -> tuple[float, int, list]:
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    return wall, sum(len(t) for t in tokens), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF directory; default: the embedded model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                          '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default=None, help="result file name (default: speculative_<method>_<device>)")
    args = parser.parse_args()
    spec = json.loads(args.spec)
    name = args.name or f"speculative_{spec['method']}_{args.device.split(':')[0]}"
    info = machine_info()
    print_machine(info)

    common = dict(model=args.model, device=args.device, max_num_seqs=max(args.batch_sizes), max_model_len=1024)
    if args.device.startswith("cuda"):
        common["num_kv_blocks"] = 4096  # two engines share the device: a fixed pool each, not "all that is free"
    engines = {"baseline": LLM(**common), "speculative": LLM(**common, speculative_config=spec)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    for batch in args.batch_sizes:
        conversations = prompts(batch)
        for llm in engines.values():  # warm-up: first-use costs (allocation, graphs) out of the timing
            llm.chat(conversations[:1], SamplingParams(temperature=0, max_tokens=8))
        walls: dict[str, list[float]] = {k: [] for k in engines}
        tokens: dict[str, list] = {}
        stats = engines["speculative"].engine.spec_stats
        drafted0, accepted0, verified0 = stats.num_draft_tokens, stats.num_accepted_draft_tokens, \
            stats.num_verified_sequences
        for _ in range(args.rounds):
            for kind, llm in engines.items():
                wall, count, tokens[kind] = timed(llm, conversations, params)
                walls[kind].append(wall)
        # Greedy speculation gives the baseline's tokens up to float rounding: in float32 they are
        # identical; in bf16 a near-tie can flip where the verifying pass groups tokens differently.
        same = sum(a == b for a, b in zip(tokens["baseline"], tokens["speculative"], strict=True))
        generated = sum(len(t) for t in tokens["baseline"])
        base_tps = generated / statistics.median(walls["baseline"])
        spec_tps = sum(len(t) for t in tokens["speculative"]) / statistics.median(walls["speculative"])
        drafted = stats.num_draft_tokens - drafted0
        accepted = stats.num_accepted_draft_tokens - accepted0
        verified = stats.num_verified_sequences - verified0
        rows.append({
            "batch": batch, "tokens": generated, "baseline tok/s": base_tps, "speculative tok/s": spec_tps,
            "speed-up": spec_tps / base_tps, "acceptance": accepted / max(1, drafted),
            "accepted/step": 1 + accepted / max(1, verified),
            "baseline s": statistics.median(walls["baseline"]),
            "speculative s": statistics.median(walls["speculative"]),
            "identical outputs": f"{same}/{batch}",
        })
        print_table(rows[-1:], list(rows[-1]))
    print()
    print_table(rows, list(rows[0]))
    path = write_json(name, {"machine": info, "device": args.device, "spec": spec, "max_tokens": args.max_tokens,
                             "rounds": args.rounds, "rows": rows})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["baseline tok/s"] for r in rows], 0.4, label="no speculation")
    ax.bar([i + 0.2 for i in x], [r["speculative tok/s"] for r in rows], 0.4, label=f"{spec['method']} speculation")
    ax.set_xticks(list(x), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("tokens / s")
    ax.set_title(f"Copy JSON / code, greedy, {args.device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path(name), dpi=120)
    print(f"wrote {path} and {png_path(name)}")


if __name__ == "__main__":
    main()
