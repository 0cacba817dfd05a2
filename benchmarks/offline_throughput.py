"""Offline generation throughput: fastdeploy vs Hugging Face transformers vs llama.cpp.

    python benchmarks/offline_throughput.py [--batch-sizes 1 8 32] [--max-tokens 64]
                                            [--skip-hf] [--skip-llamacpp] [--threads 2]

All three run the embedded SmolLM2-135M-Instruct GGUF in this process, one after the
other, on the same prompt token ids (every prompt cut to the same length, so padding
never differs between engines), greedy, exactly --max-tokens new tokens per sequence
(EOS ignored). Throughput = batch * max_tokens / wall time of the whole batch, prefill
included, after one short warm-up run per batch size.

- fastdeploy: `LLM.generate` on the batch (continuous batching, all sequences in one step).
- transformers: `model.generate` on one left-padded batch, float32 weights dequantized
  from the GGUF, min_new_tokens = max_new_tokens.
- llama.cpp (llama-cpp-python's C bindings): one context with n_seq_max = batch and one
  `llama_decode` per step over all sequences (the loop of llama.cpp's `batched` example),
  argmax in numpy; batch 1 is a single stream. The high-level `Llama` object has
  n_seq_max = 1, so it cannot decode several sequences at once.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402

TOPICS = [
    "a lighthouse keeper", "a lost umbrella", "the first snow", "a robot gardener", "an old map",
    "a quiet library", "a bridge at night", "a painter's last canvas", "a desert well", "a broken clock",
    "a paper boat", "the moon's shadow", "a mountain village", "a forgotten song", "a train to nowhere",
    "a glass orchard", "a sleeping volcano", "the tallest tree", "a fox in winter", "a violin maker",
    "a night market", "a cloud collector", "the last bookshop", "a frozen lake", "a kite festival",
    "an island lighthouse", "a secret garden", "a copper kettle", "a midnight baker", "a comet's tail",
    "a river pilot", "a sandcastle kingdom",
]
ENGINES = ("fastdeploy", "transformers", "llama.cpp")


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    """n distinct prompts as token ids, all cut to the shortest one's length."""
    token_lists = [tokenizer.encode(f"Write a short story about {t}. Once upon a time,", add_special_tokens=False)
                   for t in TOPICS]
    length = min(len(t) for t in token_lists)
    return [token_lists[i % len(token_lists)][:length] for i in range(n)]


def timed(fn: Callable[[], int]) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - t0


# --- fastdeploy -------------------------------------------------------------------------

def bench_fastdeploy(prompts: list[list[int]], batch_sizes: list[int], max_tokens: int) -> dict[int, tuple[int, float]]:
    from fastdeploy import LLM, SamplingParams

    llm = LLM(max_num_seqs=max(batch_sizes))

    def run(bs: int, n: int) -> int:
        outs = llm.generate(prompts[:bs], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return sum(len(o.outputs[0].token_ids) for o in outs)

    results = {}
    for bs in batch_sizes:
        run(bs, min(8, max_tokens))
        results[bs] = timed(functools.partial(run, bs, max_tokens))
    llm = None  # `run` holds `llm`: unbinding it frees the engine
    return results


# --- transformers -----------------------------------------------------------------------

def bench_hf(gguf: str, prompts: list[list[int]], batch_sizes: list[int],
             max_tokens: int) -> dict[int, tuple[int, float]]:
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad

    def run(bs: int, n: int) -> int:
        batch = prompts[:bs]
        width = max(len(p) for p in batch)
        # Left padding: the new tokens of every row start at the same column.
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=pad)
        return (out.shape[1] - width) * bs

    results = {}
    for bs in batch_sizes:
        run(bs, min(8, max_tokens))
        results[bs] = timed(functools.partial(run, bs, max_tokens))
    model = None  # `run` holds `model`: unbinding it frees the model
    return results


# --- llama.cpp --------------------------------------------------------------------------

def bench_llamacpp(gguf: str, prompts: list[list[int]], batch_sizes: list[int], max_tokens: int,
                   threads: int) -> dict[int, tuple[int, float]]:
    import llama_cpp as lc
    import llama_cpp._logger
    import numpy as np

    llama_cpp._logger.set_verbose(False)  # llama.cpp logs every context it creates; keep errors only
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(gguf.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))

    def run(ctx, bs: int, n: int) -> int:
        batch_prompts = prompts[:bs]
        prompt_len = len(batch_prompts[0])
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)  # forget the previous run's KV
        batch = lc.llama_batch_init(bs * prompt_len, 0, 1)

        def fill(entries: list[tuple[int, int, int, bool]]) -> None:
            batch.n_tokens = len(entries)
            for i, (token, pos, seq, want_logits) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, want_logits

        def argmax(i: int) -> int:
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
            return int(logits.argmax())

        try:
            # Prefill all prompts in one decode; logits only at each prompt's last token.
            fill([(t, p, s, p == prompt_len - 1) for s, toks in enumerate(batch_prompts) for p, t in enumerate(toks)])
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (prefill)")
            nxt = [argmax(s * prompt_len + prompt_len - 1) for s in range(bs)]
            generated = bs
            for step in range(1, n):
                fill([(nxt[s], prompt_len + step - 1, s, True) for s in range(bs)])
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed (decode)")
                nxt = [argmax(s) for s in range(bs)]  # EOS never checked: ignore_eos
                generated += bs
            return generated
        finally:
            lc.llama_batch_free(batch)

    results = {}
    for bs in batch_sizes:
        # The context (KV cache) is allocated outside the timed region, like fastdeploy's KV pool.
        cparams = lc.llama_context_default_params()
        cparams.n_seq_max = bs
        cparams.n_ctx = bs * (len(prompts[0]) + max_tokens + 16)
        cparams.n_batch = cparams.n_ubatch = max(bs * len(prompts[0]), 512)
        cparams.n_threads = cparams.n_threads_batch = threads
        ctx = lc.llama_init_from_model(model, cparams)
        try:
            run(ctx, bs, min(8, max_tokens))
            results[bs] = timed(functools.partial(run, ctx, bs, max_tokens))
        finally:
            lc.llama_free(ctx)
    lc.llama_model_free(model)
    return results


# --- main -------------------------------------------------------------------------------

def plot(rows: list[dict], batch_sizes: list[int], path: str, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(ENGINES)
    for k, engine in enumerate(ENGINES):
        ys = [next((r["tok_s"] for r in rows if r["engine"] == engine and r["batch"] == bs), None) or 0.0
              for bs in batch_sizes]
        bars = ax.bar([i + (k - (len(ENGINES) - 1) / 2) * width for i in range(len(batch_sizes))], ys, width,
                      label=engine)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(batch_sizes)), [str(b) for b in batch_sizes])
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="llama.cpp threads (torch uses its default, %(default)s here)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-llamacpp", action="store_true")
    args = parser.parse_args()

    from fastdeploy.model_executor.model_loader import embedded_model_path, get_tokenizer

    gguf = embedded_model_path()
    prompts = make_prompts(get_tokenizer(None), max(args.batch_sizes))
    info = machine_info()
    print_machine(info)

    # Each engine runs in turn; a failure is recorded and the others still run.
    unavailable: dict[str, str] = {}
    measured: dict[str, dict[int, tuple[int, float]]] = {}
    runners: dict[str, Callable[[], dict[int, tuple[int, float]]]] = {
        "fastdeploy": lambda: bench_fastdeploy(prompts, args.batch_sizes, args.max_tokens),
        "transformers": lambda: bench_hf(gguf, prompts, args.batch_sizes, args.max_tokens),
        "llama.cpp": lambda: bench_llamacpp(gguf, prompts, args.batch_sizes, args.max_tokens, args.threads),
    }
    skipped = {"transformers": args.skip_hf, "llama.cpp": args.skip_llamacpp}
    for engine, runner in runners.items():
        if skipped.get(engine):
            unavailable[engine] = "skipped (flag)"
            continue
        if engine == "llama.cpp" and info["llama_cpp_python"] is None:
            unavailable[engine] = "llama-cpp-python is not installed"
            continue
        print(f"running {engine} ...", flush=True)
        try:
            measured[engine] = runner()
        except Exception as exc:  # keep the other engines' numbers
            traceback.print_exc()
            unavailable[engine] = f"failed: {exc!r}"
        gc.collect()

    rows = []
    for bs in args.batch_sizes:
        for engine in ENGINES:
            if engine in measured:
                tokens, seconds = measured[engine][bs]
                rows.append({"engine": engine, "batch": bs, "tokens": tokens, "seconds": seconds,
                             "tok_s": tokens / seconds})
            else:
                rows.append({"engine": engine, "batch": bs, "tokens": None, "seconds": None, "tok_s": None,
                             "note": unavailable.get(engine)})

    print(f"\nprompt {len(prompts[0])} tokens, {args.max_tokens} new tokens per sequence, greedy, EOS ignored")
    print_table(rows, ["engine", "batch", "tokens", "seconds", "tok_s"])
    for engine, why in unavailable.items():
        print(f"{engine}: unavailable, {why}")

    payload = {
        "benchmark": "offline_throughput",
        "machine": info,
        "settings": {"model": gguf, "prompt_tokens": len(prompts[0]), "max_tokens": args.max_tokens,
                     "batch_sizes": args.batch_sizes, "llamacpp_threads": args.threads},
        "method": {
            "fastdeploy": "LLM.generate on the whole batch, temperature=0, ignore_eos",
            "transformers": "model.generate on one left-padded batch, float32 dequantized GGUF, greedy, "
                            "min_new_tokens=max_new_tokens",
            "llama.cpp": "llama-cpp-python C bindings, one context with n_seq_max=batch, one llama_decode per "
                         "step over all sequences, numpy argmax, EOS ignored",
            "tok_s": "batch * max_tokens / wall time of the batch (prefill included), after a short warm-up",
        },
        "unavailable": unavailable,
        "results": rows,
    }
    print("wrote", write_json("offline_throughput", payload))
    path = png_path("offline_throughput")
    plot(rows, args.batch_sizes, path,
         f"SmolLM2-135M Q4_1 GGUF, {args.max_tokens} new tokens, {info['cpu']} x{info['cores']}")
    print("wrote", path)


if __name__ == "__main__":
    main()
