"""CPU decode step of the embedded SmolLM2 GGUF: weights dequantized to float32 vs kept in the file's blocks.

    python benchmarks/cpu_decode.py [--batch-sizes 1 16] [--steps 32] [--context 128] [--threads 2] [--llm]

Every path loads the same Q4_1/Q8_0 file and runs the same model code in this process:

- float32 dense: every weight dequantized to float32 (`get_model(gguf_quantized=False)`).
- bfloat16 dense: every weight dequantized to bfloat16, the whole model in bfloat16.
- GGUF blocks (the CPU default): projections and LM head in the file's Q4_1/Q8_0 blocks
  (`layers/quantized_linear.py`), float32 activations, the fused CPU decode ops.
- GGUF blocks + bfloat16: the same with the model's dtype bfloat16 (norms, attention, KV cache).

A decode step is what the model runner does per step: the forward pass over one new token
per sequence (each with `--context` tokens already in the paged KV cache), the float32
logits and their argmax. All paths stay loaded and take turns, 4 steps at a time, so the load
of a shared machine falls on each alike. tok/s = batch / median step time over `--steps`
steps after warm-up; tok_s_best from the fastest step.
`--llm` also times `LLM.generate` end to end (the default path): 16-token prompts, 64 new
tokens, greedy, EOS ignored, prefill included, after one warm-up call, tok/s = batch * 64 /
wall time. llama.cpp is in benchmarks/cpu_vs_llamacpp.py (through each server) and
benchmarks/offline_throughput.py (in process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402
from fastdeploy.model_executor.layers.attention import allocate_kv_caches  # noqa: E402
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata  # noqa: E402
from fastdeploy.model_executor.model_loader import get_model  # noqa: E402

BLOCK_SIZE = 16
ROUND_STEPS = 4
# name -> (get_model dtype, keep the GGUF's Q4_1/Q8_0 weights in their blocks)
PATHS = {
    "float32 dense": (torch.float32, False),
    "bfloat16 dense": (torch.bfloat16, False),
    "GGUF blocks": (torch.float32, True),
    "GGUF blocks + bfloat16": (torch.bfloat16, True),
}


class DecodeSteps:
    """Decode steps at `batch` sequences of `context` cached tokens on one loaded model."""

    def __init__(self, model, config, dtype: torch.dtype, batch: int, context: int) -> None:
        self.model = model
        blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
        self.caches = allocate_kv_caches(config, batch * blocks_per_seq, BLOCK_SIZE, dtype, "cpu")
        for cache in self.caches:  # cached keys and values of a plausible scale; their values do not change the cost
            cache.normal_(0, 1)
        tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)
        slots = tables[:, context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE
        self.meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=batch, decode_block_tables=tables,
                                      decode_context_lens=torch.full((batch,), context + 1), prefills=[],
                                      block_size=BLOCK_SIZE)  # fmt: skip
        self.ids = torch.randint(0, config.vocab_size, (batch,))
        self.positions = torch.full((batch,), context)

    @torch.inference_mode()
    def run(self, steps: int) -> list[float]:
        """Wall seconds of each of `steps` steps (forward, float32 logits, argmax)."""
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            hidden = self.model(self.ids, self.positions, self.meta, self.caches)
            self.ids = self.model.compute_logits(hidden).argmax(-1)
            times.append(time.perf_counter() - t)
        return times


def llm_tok_s(batch_sizes: list[int], new_tokens: int = 64) -> dict[int, float]:
    """End-to-end `LLM.generate` throughput per batch size (engine, scheduler, sampler included)."""
    from fastdeploy import LLM, SamplingParams

    llm = LLM()
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    result = {}
    for batch in batch_sizes:
        prompts = [[1 + (i * 7 + j) % 1000 for j in range(16)] for i in range(batch)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        t = time.perf_counter()
        llm.generate(prompts, params)
        result[batch] = batch * new_tokens / (time.perf_counter() - t)
    del llm
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paths", nargs="*", choices=list(PATHS), default=list(PATHS))
    parser.add_argument("--llm", action="store_true", help="also time LLM.generate (the CPU default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info()
    print_machine(info)

    # All paths stay loaded and take turns in short rounds, so load from other processes on a
    # shared machine falls on every path alike instead of on whichever ran during a busy spell.
    runs = {}
    for name in args.paths:
        dtype, quantized = PATHS[name]
        model, config = get_model(None, dtype=dtype, gguf_quantized=quantized)
        for batch in args.batch_sizes:
            runs[name, batch] = DecodeSteps(model, config, dtype, batch, args.context)
            runs[name, batch].run(3)  # warm-up
    times: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
    rounds = max(1, args.steps // ROUND_STEPS)
    for _ in range(rounds):
        for key, steps in runs.items():
            times[key] += steps.run(ROUND_STEPS)
    rows = []
    for (name, batch), t in times.items():
        median = statistics.median(t)
        rows.append({"path": name, "batch": batch, "step_ms": median * 1e3, "tok_s": batch / median,
                     "step_ms_min": min(t) * 1e3, "tok_s_best": batch / min(t)})
    base = {r["batch"]: r["tok_s"] for r in rows if r["path"] == "float32 dense"}
    for r in rows:
        r["vs_float32"] = r["tok_s"] / base[r["batch"]] if r["batch"] in base else None
    if rows:
        print_table(rows, ["path", "batch", "step_ms", "step_ms_min", "tok_s", "tok_s_best", "vs_float32"])

    llm_rows = []
    if args.llm:
        for batch, tok_s in llm_tok_s(args.batch_sizes).items():
            llm_rows.append({"LLM": "default (float32, GGUF blocks)", "batch": batch, "tok_s": tok_s})
        print_table(llm_rows, ["LLM", "batch", "tok_s"])
    payload = {"machine": info, "args": vars(args), "rows": rows, "llm": llm_rows}
    print("wrote", write_json("cpu_decode", payload))
    if not args.paths:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.8 / len(args.paths)
    for j, name in enumerate(args.paths):
        values = [next((r["tok_s"] for r in rows if r["path"] == name and r["batch"] == b), 0)
                  for b in args.batch_sizes]
        ax.bar([i + j * width for i in range(len(args.batch_sizes))], values, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(args.batch_sizes))],
                  [f"batch {b}" for b in args.batch_sizes])
    ax.set_ylabel("decode tok/s", fontsize=8)
    ax.set_title(f"SmolLM2-135M Q4_1 GGUF, CPU decode step, {args.threads} threads, context {args.context}",
                 fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path("cpu_decode"), dpi=120)
    print("wrote", png_path("cpu_decode"))


if __name__ == "__main__":
    main()
