"""Structured output: constrained vs unconstrained decode, per-token mask time, validity.

    python benchmarks/guided.py [--batch-sizes 1 16 64] [--max-tokens 64] [--schemas 0]
    python benchmarks/guided.py --model DIR/config.json --load-format dummy --device cuda \
        --dtype bfloat16 --schemas -1 --name guided_gpu
    python benchmarks/guided.py --batch-sizes --validity-max-tokens 256 --name guided_validity

1. Throughput: the same chat prompts decoded greedily with and without a JSON-schema
   constraint, compared as tokens per second on equal work. Constrained rows end when
   their JSON closes (the grammar finishes the request) or at --max-tokens; each
   unconstrained row then decodes exactly that many tokens, ignoring EOS. The schema is
   compiled during the warm-up, so this measures per-step cost.
2. Mask time: per decode step of a batch, the CPU bitmask fill for every row (driving
   the schema through a valid instance token by token), then the copy to the device and
   the in-place application on [batch, vocab] logits; reported per step and per token.
3. Validity (embedded model only): one request per shared JSONSchemaBench schema (all of
   them with --schemas 0, the first N by name otherwise, -1 skips), batched, temperature
   0, up to --validity-max-tokens tokens; each output that finished is validated against
   its schema with `jsonschema`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json
from fastdeploy import LLM, SamplingParams
from fastdeploy.common.errors import ParameterError
from fastdeploy.model_executor.guided_decoding import (
    GrammarCompileService,
    GuidedSpec,
    GuidedState,
    apply_token_bitmask_inplace,
    fill_bitmasks,
    validate_guided_spec,
)

JSB = Path(__file__).resolve().parents[2] / "shared" / "eval" / "jsonschemabench"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
PERSON_INSTANCE = '{"name": "Ada Lovelace", "age": 36, "city": "London"}'


def throughput(llm: LLM, batch_sizes: list[int], max_tokens: int, repeats: int) -> list[dict]:
    """Constrained vs unconstrained on the same work: each unconstrained row decodes exactly as
    many tokens as its constrained twin did (EOS ignored), so both modes see the same batch
    occupancy step by step and the same prefill; only the grammar's cost differs. Runs
    alternate and the median of `repeats` is kept."""
    spec = GuidedSpec("json_schema", json.dumps(PERSON))
    rows = []
    for bs in batch_sizes:
        chats = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(bs)]
        constrained = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, guided=spec)
        for guided in (None, spec):  # warm-up: graphs, grammar compile
            llm.chat(chats, SamplingParams(temperature=0, max_tokens=4, guided=guided))
        lengths = [len(o.outputs[0].token_ids) for o in llm.chat(chats, constrained)]
        unconstrained = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        seconds: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
        for _ in range(repeats):
            for label, params in (("unconstrained", unconstrained), ("json_schema", constrained)):
                start = time.perf_counter()
                outs = llm.chat(chats, params)
                seconds[label].append(time.perf_counter() - start)
                assert [len(o.outputs[0].token_ids) for o in outs] == lengths, "the two modes must decode equal work"
        for label, times in seconds.items():
            median = statistics.median(times)
            rows.append({"batch": bs, "mode": label, "tokens": sum(lengths), "seconds": round(median, 3),
                         "tok_s": round(sum(lengths) / median, 1)})
        rows[-1]["vs_unconstrained"] = round(rows[-1]["tok_s"] / rows[-2]["tok_s"], 3)
    return rows


def mask_time(llm: LLM, batch_sizes: list[int]) -> list[dict]:
    """Fill (CPU) and apply (device) cost of one step's bitmask, at the model's vocabulary."""
    vocab = llm.engine.executor.info.vocab_size
    device = torch.device(llm.config.device)
    service = GrammarCompileService.from_tokenizer(llm.tokenizer, vocab)
    compiled = service.compile(GuidedSpec("json_schema", json.dumps(PERSON)))
    instance = llm.tokenizer.encode(PERSON_INSTANCE, add_special_tokens=False)
    rows = []
    for bs in batch_sizes:
        states = [GuidedState(compiled) for _ in range(bs)]
        logits = torch.randn(bs, vocab, device=device)
        pinned = torch.empty(bs, (vocab + 31) // 32, dtype=torch.int32).pin_memory() \
            if device.type == "cuda" else None
        fill_ms, apply_ms = [], []
        for token in instance:
            t0 = time.perf_counter()
            bitmask = fill_bitmasks(states, vocab, out=pinned)
            t1 = time.perf_counter()
            apply_token_bitmask_inplace(logits, bitmask.to(device, non_blocking=True))
            if device.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            fill_ms.append((t1 - t0) * 1e3)
            apply_ms.append((t2 - t1) * 1e3)
            for state in states:
                assert state.accept(token), "the instance must match the schema"
        fill, apply = statistics.median(fill_ms), statistics.median(apply_ms)
        rows.append({"batch": bs, "vocab": vocab, "steps": len(instance), "fill_ms": round(fill, 3),
                     "apply_ms": round(apply, 3), "per_token_us": round((fill + apply) * 1e3 / bs, 1)})
    return rows


def validity(llm: LLM, schemas_dir: Path, num_schemas: int, max_tokens: int) -> dict:
    import jsonschema  # only here: GPU runs skip validity and their machines may lack it

    files = sorted(schemas_dir.glob("*.json"))
    files = files[:num_schemas] if num_schemas > 0 else files
    counts = {"schemas": len(files), "max_tokens": max_tokens, "refused": 0, "finished_valid": 0,
              "finished_invalid": 0, "length": 0, "error": 0, "seconds": 0.0, "refusals": [], "invalid": [],
              "errors": []}
    # A schema the server would answer with a 400 (xgrammar cannot build it) is counted, not sent.
    kept = []
    for f in files:
        schema = json.loads(f.read_text())["schema"]
        try:
            validate_guided_spec(GuidedSpec("json_schema", json.dumps(schema)))
            kept.append((f, schema))
        except ParameterError as exc:
            counts["refused"] += 1
            counts["refusals"].append([f.stem, str(exc)[:200]])
    files, schemas = [f for f, _ in kept], [s for _, s in kept]
    chats = [[{"role": "user", "content": f"Reply with one JSON value for this schema:\n{json.dumps(s)[:1500]}"}]
             for s in schemas]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, guided=GuidedSpec("json_schema", json.dumps(s)))
              for s in schemas]
    start = time.perf_counter()
    outs = llm.chat(chats, params)
    for f, schema, out in zip(files, schemas, outs, strict=True):
        o = out.outputs[0]
        if o.finish_reason == "stop":
            try:
                jsonschema.validate(json.loads(o.text), schema)
                counts["finished_valid"] += 1
            except (json.JSONDecodeError, jsonschema.ValidationError, jsonschema.SchemaError) as exc:
                counts["finished_invalid"] += 1
                counts["invalid"].append([f.stem, str(exc).splitlines()[0][:200]])
        elif o.finish_reason == "length":
            counts["length"] += 1
        else:
            counts["error"] += 1
            counts["errors"].append([f.stem, (o.error or "")[:200]])
    counts["seconds"] = round(time.perf_counter() - start, 1)
    return counts


def plot(rows: list[dict], title: str, name: str) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("unconstrained", "json_schema"):
        pts = [r for r in rows if r["mode"] == mode]
        ax.plot([r["batch"] for r in pts], [r["tok_s"] for r in pts], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("tokens / s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path(name))
    return png_path(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 16, 64],
                        help="none: skip throughput and mask time")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--schemas", type=int, default=0, help="0: all shared schemas; -1: skip validity")
    parser.add_argument("--validity-max-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="alternating timed runs per mode and batch")
    parser.add_argument("--schemas-dir", type=Path, default=JSB, help="JSONSchemaBench schema files")
    parser.add_argument("--name", default="guided", help="result file stem under benchmarks/results/")
    args = parser.parse_args()
    info = machine_info()
    print_machine(info)
    llm = LLM(args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
              max_num_seqs=max([*args.batch_sizes, 64]), max_model_len=1024)
    rows = throughput(llm, args.batch_sizes, args.max_tokens, args.repeats)
    masks = mask_time(llm, args.batch_sizes)
    if rows:
        print_table(rows, ["batch", "mode", "tokens", "seconds", "tok_s", "vs_unconstrained"])
        print_table(masks, ["batch", "vocab", "steps", "fill_ms", "apply_ms", "per_token_us"])
    counts = (validity(llm, args.schemas_dir, args.schemas, args.validity_max_tokens)
              if args.schemas >= 0 and args.schemas_dir.is_dir() else None)
    if counts:
        print(f"validity over {counts['schemas']} schemas ({counts['seconds']} s): {counts['refused']} refused (400), "
              f"{counts['finished_valid']} finished and valid, {counts['finished_invalid']} finished but invalid, "
              f"{counts['length']} hit max_tokens, {counts['error']} failed")
    print(write_json(args.name, {"benchmark": "guided", "machine": info,
                                 "args": {**vars(args), "schemas_dir": str(args.schemas_dir)}, "throughput": rows,
                                 "mask_time": masks, "validity": counts}))
    where = "CPU" if args.device == "cpu" else args.device
    if rows:
        print(plot(rows, f"Constrained vs unconstrained decode ({args.model or 'embedded model'}, {where})",
                   args.name))


if __name__ == "__main__":
    main()
