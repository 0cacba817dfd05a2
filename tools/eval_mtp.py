"""Acceptance of an MTP head on held-out prompts: 1, 2 and 3 draft tokens, greedy and sampled.

    python tools/eval_mtp.py                       # the shipped head, embedded model, CPU
    python tools/eval_mtp.py --device cuda --num-prompts 64 --head DIR --json out.json
    python tools/eval_mtp.py --prompts copy --draft-tokens 2 --temperatures 0

`--prompts chat` (default) comes from `tools/mtp_prompts.held_out_prompts`: topics no training
prompt used; `--prompts copy` from `held_out_copy_prompts`: requests to repeat a record, code or
passage drawn apart from training's, whose answers copy their context.
Per setting it runs the engine with `{"method": "mtp", "num_speculative_tokens": k, "adaptive": false}`
(every step drafts k) and reads
`llm.engine.spec_stats`: acceptance rate (accepted drafts / drafts verified) and mean accepted
length (tokens emitted per sequence per verifying step, the sampled token included).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from fastdeploy import LLM, SamplingParams
from tools.mtp_prompts import HELD_OUT, as_chat


def evaluate(model: str | None, head: str | None, device: str, prompts: list[str], k: int, temperature: float,
             max_tokens: int, num_kv_blocks: int | None = None, seed: int = 0) -> dict[str, float]:
    # Every step drafts k: the draft policy would turn drafts off where they do not pay and
    # leave the head's acceptance measured over a few steps only.
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False, **({"model": head} if head else {})}
    llm = LLM(model, device=device, max_num_seqs=len(prompts), guided_decoding_backend="off",
              speculative_config=spec, num_kv_blocks=num_kv_blocks)
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
              for i in range(len(prompts))]
    outputs = llm.chat(as_chat(prompts), params)
    stats = llm.engine.spec_stats
    row = {
        "k": k, "temperature": temperature, "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length, "draft_tokens": stats.num_draft_tokens,
        "accepted_tokens": stats.num_accepted_draft_tokens, "verify_steps": stats.num_verified_sequences,
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
    }
    del llm
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--head", default=None, help="MTP head directory (default: the shipped head)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks of the engine (default on CUDA: 2048 rather than all free memory)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", choices=sorted(HELD_OUT), default="chat", help="held-out chat or copy requests")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    prompts = HELD_OUT[args.prompts](args.num_prompts)
    blocks = args.num_kv_blocks or (2048 if args.device.startswith("cuda") else None)
    print(f"{'temp':>5} {'k':>2} {'acceptance':>10} {'mean_len':>8} {'drafts':>7} {'accepted':>8}")
    rows = []
    for t in args.temperatures:
        for k in args.draft_tokens:
            r = evaluate(args.model, args.head, args.device, prompts, k, t, args.max_tokens, blocks)
            rows.append(r)
            print(f"{r['temperature']:>5.1f} {r['k']:>2} {r['acceptance_rate']:>10.3f} "
                  f"{r['mean_accepted_length']:>8.3f} {r['draft_tokens']:>7} {r['accepted_tokens']:>8}", flush=True)
            if args.json:  # after every row: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"device": args.device, "prompts": args.prompts, "num_prompts": args.num_prompts,
                               "max_tokens": args.max_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
