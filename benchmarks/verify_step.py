"""What a speculative verify step costs against a plain decode step, in process.

    python benchmarks/verify_step.py [--device cuda] [--batches 1 16] [--drafts 4] [--tokens 96]

The embedded SmolLM2-135M shape with random weights (`--model`, a config.json, `--load-format
dummy`), greedy, EOS ignored, one `LLM` per configuration:

- `off_pipelined`: no speculation, steps sent ahead as the engine runs them (CUDA's default);
- `off_in_turn`: no speculation, `--async-scheduling off`;
- `verify`: n-gram speculation with a fixed `--drafts` drafts on every step (the proposer is
  replaced by one that always repeats the last token, so every step verifies the same number
  of drafts whatever the text; random weights repeat tokens, so most drafts are accepted).

Per configuration and batch: milliseconds per engine step (wall time of a `generate` over its
steps, best of `--reps`), tokens per second, and on CUDA (`--device-timeline`) the device's
busy time per step from the profiler: a step whose wall time is well above its device time is
the host's. Writes benchmarks/results/verify_step.json (or `--name`) and a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import (  # noqa: E402
    device_profile,
    finish_bar_axis,
    machine_info,
    png_path,
    print_machine,
    print_table,
    pyplot,
    write_json,
)
from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.model_executor.model_loader.embedded import embedded_model_path  # noqa: E402
from fastdeploy.spec_decode.ngram_proposer import NgramProposer  # noqa: E402

# The embedded model's shape (SmolLM2-135M-Instruct), for random weights.
SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "rms_norm_eps": 1e-05, "rope_theta": 100000.0, "max_position_embeddings": 8192,
                "tie_word_embeddings": True, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
                "model_type": "llama", "hidden_act": "silu", "torch_dtype": "bfloat16"}


def configs(drafts: int) -> dict[str, dict]:
    ngram = {"method": "ngram", "num_speculative_tokens": drafts, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
             "adaptive": False}
    return {"off_pipelined": {}, "off_in_turn": {"async_scheduling": "off"}, "verify": {"speculative_config": ngram}}


def forced_drafts(self: NgramProposer, context, max_drafts: int) -> list[int]:
    return [int(context[-1])] * max_drafts


@contextlib.contextmanager
def counted_steps(llm: LLM) -> Iterator[list[int]]:
    """[engine steps taken] while inside."""
    steps = [0]
    step = llm.engine.step

    def counting(*args, **kwargs):
        steps[0] += 1
        return step(*args, **kwargs)

    llm.engine.step = counting  # type: ignore[method-assign]
    try:
        yield steps
    finally:
        llm.engine.step = step  # type: ignore[method-assign]


def prompts(batch: int) -> list[dict]:
    return [{"prompt_token_ids": list(range(100 + b, 164 + b))} for b in range(batch)]


def measure(llm: LLM, batch: int, tokens: int, reps: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts(batch), params)  # warm-up: every shape the timed runs reach
    best = None
    for _ in range(reps):
        with counted_steps(llm) as steps:
            start = time.perf_counter()
            outputs = llm.generate(prompts(batch), params)
            wall = time.perf_counter() - start
        made = sum(len(o.outputs[0].token_ids) for o in outputs)
        row = {"batch": batch, "steps": steps[0], "ms_per_step": 1e3 * wall / steps[0], "tok_s": made / wall}
        best = row if best is None or row["ms_per_step"] < best["ms_per_step"] else best
    assert best is not None
    return best


def device_ms_per_step(llm: LLM, batch: int, tokens: int) -> float:
    from torch.profiler import ProfilerActivity, profile

    with counted_steps(llm) as steps, profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts(batch), SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return device_profile(prof.events(), steps[0])["busy_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="config.json (default: the embedded model's shape)")
    ap.add_argument("--tokenizer", default=None, help="default: the embedded GGUF's")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device-timeline", action="store_true", help="CUDA: the device's busy time per step")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="KV blocks per engine (default on CUDA: 4096; the run's engines follow one another in one "
                         "process, and sizing by free memory would count the last one's pool)")
    ap.add_argument("--name", default="verify_step")
    args = ap.parse_args()
    info = machine_info()
    print_machine(info)
    NgramProposer.propose = forced_drafts  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = os.path.join(tmp, "config.json")
            with open(model, "w") as f:
                json.dump(SMOLLM2_135M, f)
        rows = []
        blocks = args.num_kv_blocks or (4096 if args.device.startswith("cuda") else None)
        for name, extra in configs(args.drafts).items():
            llm = LLM(model, load_format="dummy", tokenizer=args.tokenizer or embedded_model_path(), device=args.device,
                      max_num_seqs=max(args.batches), guided_decoding_backend="off", num_kv_blocks=blocks,
                      **extra)
            for batch in args.batches:
                row = {"config": name, **measure(llm, batch, args.tokens, args.reps)}
                if args.device_timeline and args.device.startswith("cuda"):
                    row["device_ms_per_step"] = device_ms_per_step(llm, batch, args.tokens // 2)
                rows.append(row)
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            llm.engine.shutdown()
            del llm
    print_table(rows, [k for k in rows[0]])
    path = write_json(args.name, {"machine": info, "args": vars(args), "rows": rows})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(configs(args.drafts))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [next(r["ms_per_step"] for r in rows if r["config"] == name and r["batch"] == b) for b in args.batches]
        ax.bar([x + i * width for x in range(len(args.batches))], values, width, label=name)
    ax.set_xticks([x + width for x in range(len(args.batches))], [f"batch {b}" for b in args.batches])
    finish_bar_axis(ax, "ms per engine step")
    fig.savefig(png_path(args.name), dpi=120, bbox_inches="tight")
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()
