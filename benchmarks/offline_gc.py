"""The cyclic garbage collector's pauses during a long offline generation.

    python benchmarks/offline_gc.py [--batch 16] [--max-tokens 4096] [--logprobs 5] [--device cpu]

`LLM.generate` on a small random Llama (the embedded tokenizer; greedy, EOS ignored), timed
with `benchmarks.common.CollectorWatch`: how many collections of each generation ran and how long they took.
A long generation with logprobs keeps many objects alive (an entry per token and per top-k
alternative); those the collector tracks make it run more often, and its full passes walk all
of them and every other tracked object in the process (the engine's modules, the tokenizer,
torch). `--rounds` timed runs after an untimed warm-up.

Writes benchmarks/results/<name>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import CollectorWatch, machine_info, print_machine, print_table, write_json  # noqa: E402
from benchmarks.mtp_step_cost import _fill  # noqa: E402
from benchmarks.verify_step import SMOLLM2_135M  # noqa: E402
from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.model_executor.model_loader.embedded import embedded_model_path  # noqa: E402

WATCH = CollectorWatch()


def tiny_model(out: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in SMOLLM2_135M.items() if k not in ("architectures", "model_type", "torch_dtype")}
    cfg.update(tie_word_embeddings=False, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    _fill(model, 0.02)
    model.save_pretrained(out)
    return out


def timed(llm: LLM, batch: int, params: SamplingParams) -> dict:
    prompts = [{"prompt_token_ids": list(range(100 + 7 * b, 140 + 7 * b))} for b in range(batch)]
    counts, seconds = WATCH.snapshot()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    counts_after, seconds_after = WATCH.snapshot()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"wall_s": round(wall, 3), "tokens": tokens,
            "collections": [b - a for a, b in zip(counts, counts_after, strict=True)],
            "collector_ms": [round(1e3 * (b - a), 1) for a, b in zip(seconds, seconds_after, strict=True)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="offline_gc")
    args = ap.parse_args()
    info = machine_info()
    print_machine(info)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(tiny_model(tmp), device=args.device, max_num_seqs=args.batch, num_kv_blocks=4096,
                  guided_decoding_backend="off", tokenizer=embedded_model_path(), dtype="float32")
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=args.logprobs)
        llm.generate([{"prompt_token_ids": [5] * 40}], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1))
        for round_ in range(args.rounds):
            rows.append({"round": round_, **timed(llm, args.batch, params)})
            print(rows[-1], flush=True)
        llm.engine.shutdown()
    print_table(rows, list(rows[0]))
    print(write_json(args.name, {"machine": info, "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
