"""End-to-end decode speed of MTP speculation (the shipped head) vs no speculation.

    python benchmarks/speculative_mtp.py --device cpu  --batches 1 16 --repeats 3
    python benchmarks/speculative_mtp.py --device cuda --batches 1 16 --repeats 3

The embedded SmolLM2-135M-Instruct answers held-out chat prompts (`tools/mtp_prompts.py`;
`--prompts copy`: its held-out requests to repeat a record, code or passage, whose answers copy
their context) greedily, `--max-tokens` tokens at most; every configuration produces the same tokens
(greedy speculation is exact), so time per generated token compares like with like. A run
is one `LLM.chat` over `batch` prompts, prefill of the short prompts included. All engines
are built first; the runs are interleaved (round-robin over configurations, `--repeats`
rounds) and the median of each is reported, so a shared CPU's load drifts into all of them
alike. On CUDA every engine replays CUDA graphs for decode steps and MTP passes; `--eager`
adds the non-speculative engine without graphs, `--mtp-eager` the MTP engines with the MTP
module's passes eager (the target's steps still replay graphs).

Writes benchmarks/results/speculative_mtp_<device>.json and .png (`_copy` added with `--prompts copy`).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import machine_info, png_path, print_table, pyplot, write_json
from fastdeploy import LLM, SamplingParams
from tools.mtp_prompts import HELD_OUT, as_chat

NAME = "speculative_mtp"


def engines(device: str, max_num_seqs: int, draft_tokens: list[int], eager: bool, mtp_eager: bool,
            head: str | None, num_kv_blocks: int | None) -> dict[str, LLM]:
    common = {"device": device, "max_num_seqs": max_num_seqs, "guided_decoding_backend": "off",
              "num_kv_blocks": num_kv_blocks}
    built = {"off": LLM(**common)}
    if eager and device.startswith("cuda"):
        built["off-eager"] = LLM(enforce_eager=True, **common)
    for k in draft_tokens:
        spec = {"method": "mtp", "num_speculative_tokens": k, **({"model": head} if head else {})}
        built[f"mtp-k{k}"] = LLM(speculative_config=spec, **common)
        if mtp_eager and device.startswith("cuda"):
            llm = LLM(speculative_config=spec, **common)
            llm.engine.executor.runner.mtp.mtp_pass.graphs = None  # every MTP pass runs eagerly
            built[f"mtp-k{k}-eager-mtp"] = llm
    return built


def timed_run(llm: LLM, prompts: list[str], max_tokens: int, device: str) -> tuple[float, int, list[list[int]]]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.chat(as_chat(prompts), SamplingParams(temperature=0, max_tokens=max_tokens))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return seconds, sum(len(t) for t in tokens), tokens


def run(args: argparse.Namespace) -> dict:
    prompts_all = HELD_OUT[args.prompts](max(args.batches) + 8)
    blocks = args.num_kv_blocks or (2048 if args.device.startswith("cuda") else None)
    built = engines(args.device, max(args.batches), args.draft_tokens, args.eager, args.mtp_eager, args.head,
                    blocks)
    for llm in built.values():  # warm-up: first-call compilation and allocator growth stay out
        timed_run(llm, prompts_all[-2:], 16, args.device)
    times: dict[tuple[str, int], list[float]] = {(n, b): [] for n in built for b in args.batches}
    counts: dict[tuple[str, int], int] = {}
    reference: dict[int, list[list[int]]] = {}
    identical = True
    for _ in range(args.repeats):
        for batch in args.batches:
            for name, llm in built.items():
                seconds, n, tokens = timed_run(llm, prompts_all[:batch], args.max_tokens, args.device)
                times[(name, batch)].append(seconds)
                counts[(name, batch)] = n
                identical &= reference.setdefault(batch, tokens) == tokens
    rows = []
    for batch in args.batches:
        base = statistics.median(times[("off", batch)])
        for name, llm in built.items():
            med = statistics.median(times[(name, batch)])
            stats = llm.engine.spec_stats
            rows.append({
                "config": name, "batch": batch, "median_s": med, "runs_s": times[(name, batch)],
                "tokens": counts[(name, batch)], "tokens_per_s": counts[(name, batch)] / med,
                "speedup": base / med,
                # over all of this engine's runs (every batch size, warm-up included)
                "mean_accepted_length": stats.mean_accepted_length if name.startswith("mtp") else None,
            })
    del built
    gc.collect()
    return {"rows": rows, "greedy_outputs_identical": identical}


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    rows = result["rows"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4))
    for ax, batch in zip(axes if len(batches) > 1 else [axes], batches, strict=True):
        sel = [next(r for r in rows if r["config"] == c and r["batch"] == batch) for c in configs]
        bars = ax.bar(configs, [r["tokens_per_s"] for r in sel], color="tab:blue")
        for bar, r in zip(bars, sel, strict=True):
            ax.annotate(f"{r['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=9)
        ax.set_title(f"batch {batch}")
        ax.set_ylabel("generated tokens / s")
    fig.suptitle(f"MTP speculation vs none, SmolLM2-135M, {result['device_name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", choices=sorted(HELD_OUT), default="chat", help="held-out chat or copy requests")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="CUDA: add the non-speculative engine without graphs")
    p.add_argument("--mtp-eager", action="store_true",
                   help="CUDA: add each MTP engine with the MTP module's passes eager (no MTP graphs)")
    p.add_argument("--head", default=None, help="MTP head directory (default: the shipped head)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per engine (default: 2048 on CUDA, where several engines share the GPU)")
    args = p.parse_args()
    result = run(args)
    result["machine"] = machine_info()
    result["device_name"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else result["machine"]["cpu"]
    result["settings"] = vars(args)
    print(f"# {result['device_name']}; greedy outputs identical across configurations: "
          f"{result['greedy_outputs_identical']}")
    print_table(result["rows"], ["config", "batch", "median_s", "tokens", "tokens_per_s", "speedup",
                                 "mean_accepted_length"])
    name = f"{NAME}_{args.device.split(':')[0]}" + ("_copy" if args.prompts == "copy" else "")
    print(write_json(name, result))
    plot(result, png_path(name))


if __name__ == "__main__":
    main()
