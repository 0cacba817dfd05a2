"""Structured output on the embedded model: constrained vs unconstrained decode, and validity.

    python benchmarks/guided.py [--batch-sizes 1 16] [--max-tokens 64] [--schemas 24]

1. Throughput: the same chat prompts decoded greedily with and without a JSON-schema
   constraint, compared as tokens per second. Unconstrained rows ignore EOS and run to
   --max-tokens; constrained rows end when their JSON closes (the grammar finishes the
   request). The schema is compiled during the warm-up, so this measures per-step cost.
2. Validity: one request per shared JSONSchemaBench schema (the first --schemas, in
   name order, all in one batch), temperature 0, up to 512 tokens; each finished output
   is validated against its schema with `jsonschema`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema  # noqa: E402

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402
from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.model_executor.guided_decoding.spec import GuidedSpec  # noqa: E402

JSB = Path(__file__).resolve().parents[2] / "shared" / "eval" / "jsonschemabench"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
          "required": ["name", "age", "city"]}


def throughput(llm: LLM, batch_sizes: list[int], max_tokens: int) -> list[dict]:
    spec = GuidedSpec("json_schema", json.dumps(PERSON))
    rows = []
    for bs in batch_sizes:
        chats = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(bs)]
        for label, guided in (("unconstrained", None), ("json_schema", spec)):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, guided=guided)
            llm.chat(chats, SamplingParams(temperature=0, max_tokens=4, guided=guided))  # warm-up + compile
            start = time.perf_counter()
            outs = llm.chat(chats, params)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append({"batch": bs, "mode": label, "tokens": tokens, "seconds": round(seconds, 2),
                         "tok_s": round(tokens / seconds, 1)})
        rows[-1]["vs_unconstrained"] = round(rows[-1]["tok_s"] / rows[-2]["tok_s"], 3)
    return rows


def validity(llm: LLM, num_schemas: int) -> dict:
    files = sorted(JSB.glob("*.json"))[:num_schemas]
    schemas = [json.loads(f.read_text())["schema"] for f in files]
    chats = [[{"role": "user", "content": f"Reply with one JSON value for this schema:\n{json.dumps(s)[:1500]}"}]
             for s in schemas]
    params = [SamplingParams(temperature=0, max_tokens=512, guided=GuidedSpec("json_schema", json.dumps(s)))
              for s in schemas]
    outs = llm.chat(chats, params)
    counts = {"schemas": len(files), "finished": 0, "valid": 0, "length": 0, "error": 0}
    for schema, out in zip(schemas, outs):
        o = out.outputs[0]
        if o.finish_reason == "stop":
            counts["finished"] += 1
            try:
                jsonschema.validate(json.loads(o.text), schema)
                counts["valid"] += 1
            except (json.JSONDecodeError, jsonschema.ValidationError, jsonschema.SchemaError):
                pass
        elif o.finish_reason == "length":
            counts["length"] += 1
        else:
            counts["error"] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--schemas", type=int, default=24)
    args = parser.parse_args()
    info = machine_info()
    print_machine(info)
    llm = LLM(max_num_seqs=max(max(args.batch_sizes), args.schemas))
    rows = throughput(llm, args.batch_sizes, args.max_tokens)
    print_table(rows, ["batch", "mode", "tokens", "seconds", "tok_s", "vs_unconstrained"])
    counts = validity(llm, args.schemas) if JSB.is_dir() else None
    if counts:
        print(f"validity over {counts['schemas']} schemas: {counts['valid']} valid of {counts['finished']} finished "
              f"({counts['length']} hit max_tokens, {counts['error']} failed)")
    print(write_json("guided", {"benchmark": "guided", "machine": info, "args": vars(args), "throughput": rows,
                                "validity": counts}))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("unconstrained", "json_schema"):
        pts = [r for r in rows if r["mode"] == mode]
        ax.plot([r["batch"] for r in pts], [r["tok_s"] for r in pts], marker="o", label=mode)
    ax.set_xlabel("batch")
    ax.set_ylabel("tokens / s")
    ax.set_title("Constrained vs unconstrained decode (embedded model, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path("guided"))
    print(png_path("guided"))


if __name__ == "__main__":
    main()
