"""Decode step time of the GPU model runner vs the weight-streaming floor and `transformers.generate`.

    python benchmarks/gpu_decode.py [--model llama3_8b] [--batches 1 16 64 256] [--prompt-len 128]

Random weights of a bundled config (`--load-format dummy`), bfloat16, on one CUDA GPU:

- floor: bytes of the weights one decode step reads (every parameter but the embedding
  table, which is only gathered) over the device's copy bandwidth, measured here with a
  large device-to-device copy (bytes read + bytes written per second);
- fastdeploy: the median wall time of `ModelRunner.execute` for a decode step (forward,
  logits, greedy sampler, packed frame, its host sync included), with CUDA graphs and eager,
  and the forward alone (`graph_forward_ms`: replays of the captured graph, CUDA events);
- fastdeploy pipelined (`*_pipelined_step_ms`, the engine's steps on CUDA): step s + 1 is
  launched, its tokens read from step s's sampler on the device, before step s is finished
  (asynchronous scheduling), so the host's share of a step overlaps the device's; tokens/s and
  `pipelined_vs_floor` use it;
- `--profile-steps N`: N more steps of each kind under torch.profiler: device busy and idle
  per step, kernel time by family and the largest kernels;
- transformers: `LlamaForCausalLM(config)` in bfloat16 with random weights, `generate`
  greedy; per-token time from two runs of different lengths, so the prefill cancels;
- prefill: tokens per second of one `max_num_batched_tokens` prefill step.

Writes benchmarks/results/gpu_decode.json and .png. `--plot-only` redraws the PNG from the JSON.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import copy_bandwidth, device_profile, machine_info, png_path, print_table, pyplot, write_json  # noqa: E402

NAME = "gpu_decode"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    embed = model.model.embed_tokens.weight
    tied = getattr(model, "lm_head", None) is None
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # A tied head reads the embedding matrix as its weight: then it is streamed after all.
    return total if tied else total - embed.numel() * embed.element_size()


def graph_replay_ms(graphs, batch: int, repeats: int = 20) -> float:
    """The model forward alone: replays of the captured graph on the last step's inputs (median)."""
    runner = graphs.graphs
    size = runner.padded_size(batch)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.replay(size)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_fastdeploy(args: argparse.Namespace) -> tuple[dict, list[dict], list[dict]]:
    from fastdeploy.common.sampling_params import SamplingParams
    from fastdeploy.common.step_input import IN_FLIGHT_TOKEN, ChunkInput, NewSequence, StepInput
    from fastdeploy.engine.args import EngineArgs
    from fastdeploy.worker.model_runner import ModelRunner

    max_batch = max(args.batches)
    engine_args = EngineArgs(model=args.model, load_format="dummy", device=args.device, max_num_seqs=max_batch,
                             max_model_len=args.max_model_len, max_num_batched_tokens=args.prefill_tokens,
                             guided_decoding_backend="off")
    t0 = time.perf_counter()
    runner = ModelRunner(engine_args.create_engine_config())
    sync(args.device)
    setup_s = time.perf_counter() - t0
    bs = runner.block_size
    blocks_per_seq = -(-args.max_model_len // bs)
    if blocks_per_seq * max_batch > runner.num_blocks:
        raise SystemExit(f"KV pool of {runner.num_blocks} blocks is too small for batch {max_batch}")
    info = {
        "weight_bytes_streamed": streamed_weight_bytes(runner.model),
        "num_kv_blocks": runner.num_blocks,
        "kv_cache_gib": sum(c.numel() * c.element_size() for c in runner.kv_caches) / 2**30,
        "setup_s_load_profile_capture": setup_s,
        "capture_sizes": runner.cuda_graphs.sizes if runner.cuda_graphs is not None else None,
    }
    params = SamplingParams(temperature=0.0, max_tokens=None)
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    message = iter(range(1, 1 << 30))
    seq_counter = iter(range(1 << 30))

    # Block tables by row; rows of a shared-prefix group point at their first row's prompt blocks.
    tables: dict[int, list[int]] = {}

    def table(slot: int) -> list[int]:
        return tables.get(slot) or list(range(slot * blocks_per_seq, (slot + 1) * blocks_per_seq))

    def prefill(batch: int, prompt_len: int, share: int = 1) -> tuple[list[int], float]:
        """New sequences in slots 0..batch-1, prefilled in steps of at most prefill_tokens. With
        `share` > 1 rows come in groups of `share` with one prompt, as the engine's prefix cache
        admits a prompt's n samples: the first row computes it, the others point at its full
        blocks (all but the last, which each row computes itself) and start after them."""
        ids = [next(seq_counter) for _ in range(batch)]
        prompts = torch.randint(vocab, (batch, prompt_len), generator=gen).tolist()
        tables.clear()
        shared = (prompt_len - 1) // bs if share > 1 else 0
        starts = [0] * batch
        for i in range(batch):
            lead = i - i % share
            prompts[i] = prompts[lead]
            if i != lead:
                own = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
                tables[i] = table(lead)[:shared] + own[shared:]
                starts[i] = shared * bs
        per_step = max(1, args.prefill_tokens // prompt_len)
        seconds = 0.0
        # Group leaders first: the other rows read their KV.
        order = [i for i in range(batch) if starts[i] == 0] + [i for i in range(batch) if starts[i] > 0]
        for lo in range(0, batch, per_step):
            rows_now = order[lo:lo + per_step]
            step = StepInput(next(message), [NewSequence(ids[i], prompts[i], params, False) for i in rows_now],
                             [ChunkInput(ids[i], prompts[i][starts[i]:], starts[i], table(i), True)
                              for i in rows_now], [])
            t = time.perf_counter()
            runner.execute(step)
            seconds += time.perf_counter() - t
        return ids, seconds

    def decode_times(ids: list[int], start: int, steps: int) -> list[float]:
        times = []
        for s in range(steps):
            chunks = [ChunkInput(seq, [1 + (s + i) % 1000], start + s, table(i), True) for i, seq in enumerate(ids)]
            t = time.perf_counter()
            runner.execute(StepInput(next(message), [], chunks, []))
            times.append(time.perf_counter() - t)
        return times

    def pipelined_decode_times(ids: list[int], start: int, steps: int) -> list[float]:
        """Steady steps as the engine runs them with asynchronous scheduling: step s + 1 is
        launched (its tokens taken from step s's sampler on the device) before step s is
        finished; each time covers one launch and one finish."""
        def step_input(s: int) -> StepInput:
            tokens = [[1 + (s + i) % 1000] if s == 0 else [IN_FLIGHT_TOKEN] for i in range(len(ids))]
            return StepInput(next(message), [], [ChunkInput(seq, tokens[i], start + s, table(i), True)
                                                 for i, seq in enumerate(ids)], [], followed=True)

        inputs = [step_input(s) for s in range(steps + 1)]
        times = []
        previous = runner.launch(inputs[0])
        for step in inputs[1:]:
            t = time.perf_counter()
            launched = runner.launch(step)
            runner.finish(previous)
            times.append(time.perf_counter() - t)
            previous = launched
        runner.finish(previous)
        return times

    def profiled(run_steps, steps: int) -> dict:
        """`steps` decode steps under the torch profiler: where the device's time goes per step."""
        sync(args.device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            walls = run_steps()
            sync(args.device)
        return {"step_ms_under_profiler": 1e3 * statistics.median(walls),
                **device_profile(profiler.events(), steps)}

    def free(ids: list[int]) -> None:
        runner.execute(StepInput(next(message), [], [], ids))

    # Prefill throughput: one full step of fresh prompts (the first run compiles; time the second).
    prefill_rows = []
    for prompt_len in (args.prefill_len,):
        batch = max(1, args.prefill_tokens // prompt_len)
        for _ in range(2):
            ids, seconds = prefill(batch, prompt_len)
            free(ids)
        prefill_rows.append({"prompt_len": prompt_len, "batch": batch, "tokens": batch * prompt_len,
                             "seconds": seconds, "tokens_per_s": batch * prompt_len / seconds})

    rows = []
    graphs = runner.cuda_graphs
    profile_steps = getattr(args, "profile_steps", 0) if args.device.startswith("cuda") else 0
    modes = ("eager",) if graphs is None else ("graph",) if args.skip_eager else ("graph", "eager")
    for batch, share in [(b, s) for b in args.batches for s in args.share_prefix]:
        row = {"batch": batch, "context_len": args.prompt_len + args.warmup + 2 * args.steps + 1}
        if share > 1:
            row["share_prefix"] = share
        for mode in modes:
            runner.cuda_graphs = graphs if mode == "graph" else None
            ids, _ = prefill(batch, args.prompt_len, share)
            decode_times(ids, args.prompt_len, args.warmup)
            times = decode_times(ids, args.prompt_len + args.warmup, args.steps)
            pipelined = pipelined_decode_times(ids, args.prompt_len + args.warmup + args.steps, args.steps)
            row[f"{mode}_pipelined_step_ms"] = 1e3 * statistics.median(pipelined)
            if mode == "graph":
                row["graph_forward_ms"] = graph_replay_ms(graphs, batch)
            if profile_steps:
                row[f"{mode}_profile"] = profiled(functools.partial(
                    decode_times, ids, args.prompt_len + args.warmup + 2 * args.steps + 1, profile_steps),
                    profile_steps)
                # Its window holds one step more: the first launch, finished after the loop.
                row[f"{mode}_pipelined_profile"] = profiled(functools.partial(
                    pipelined_decode_times, ids, args.prompt_len + args.warmup + 2 * args.steps + profile_steps + 1,
                    profile_steps), profile_steps + 1)
            free(ids)
            row[f"{mode}_step_ms"] = 1e3 * statistics.median(times)
        runner.cuda_graphs = graphs
        rows.append(row)
    runner = graphs = None  # the closures above hold `runner`: unbinding it frees the model
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return info, rows, prefill_rows


def bench_transformers(args: argparse.Namespace, batches: list[int]) -> tuple[dict[int, float], str]:
    """Median per-token time of HF generate (ms) per batch size."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastdeploy.model_executor.model_loader import resolve_model_path

    with open(resolve_model_path(args.model)) as f:
        config = LlamaConfig(**json.load(f))
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    gen = torch.Generator(device=args.device).manual_seed(0)
    out = {}
    for batch in batches:
        ids = torch.randint(config.vocab_size, (batch, args.prompt_len), device=args.device, generator=gen)

        def run(new_tokens: int, ids: torch.Tensor = ids) -> float:
            sync(args.device)
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            sync(args.device)
            return time.perf_counter() - t

        run(4)  # warm-up
        short, long = args.hf_tokens // 4, args.hf_tokens
        t_short = statistics.median(run(short) for _ in range(2))
        t_long = statistics.median(run(long) for _ in range(2))
        out[batch] = 1e3 * (t_long - t_short) / (long - short)
        print(f"transformers batch {batch}: {out[batch]:.2f} ms/token", flush=True)
    model = None  # `run` holds `model`: unbinding it frees the model
    gc.collect()
    return out, transformers.__version__


def step_ms(row: dict) -> float:
    """The decode step as the engine runs it: steps overlapped (asynchronous scheduling), CUDA
    graphs where they were captured."""
    return row.get("graph_pipelined_step_ms") or row["eager_pipelined_step_ms"]


def print_profiles(rows: list[dict]) -> None:
    """Per profiled batch and mode: device busy / idle per step, ms by kernel family, top kernels."""
    for row in rows:
        for mode in ("graph", "graph_pipelined", "eager", "eager_pipelined"):
            profile = row.get(f"{mode}_profile")
            if profile is None:
                continue
            print(f"\n# batch {row['batch']}, prefix shared by {row.get('share_prefix', 1)}, {mode}: "
                  f"step {profile['step_ms_under_profiler']:.2f} ms under the "
                  f"profiler, device busy {profile['busy_ms']:.2f} ms, idle {profile['idle_ms']:.2f} ms")
            for family, ms in profile["families_ms"].items():
                print(f"  {ms:8.3f} ms  {family}")
            for name, ms in list(profile["kernels_ms"].items())[:10]:
                print(f"    {ms:8.3f} ms  {name}")


def plot(payload: dict) -> str:
    plt = pyplot()
    rows = [r for r in payload["decode"] if "share_prefix" not in r]  # the shared-prefix rows are in the table
    batches = [r["batch"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if rows[0].get("graph_step_ms") is not None:
        ax1.plot(batches, [r["graph_step_ms"] for r in rows], "o-", label="fastdeploy step, CUDA graphs")
        ax1.plot(batches, [r["graph_forward_ms"] for r in rows], "o:", label="fastdeploy forward (graph replay)")
        ax1.plot(batches, [r["graph_pipelined_step_ms"] for r in rows], "d-",
                 label="fastdeploy step, graphs, steps overlapped")
    if rows[0].get("eager_step_ms") is not None:
        ax1.plot(batches, [r["eager_step_ms"] for r in rows], "s--", label="fastdeploy step, eager")
    if rows[0].get("hf_ms_per_token") is not None:
        ax1.plot(batches, [r["hf_ms_per_token"] for r in rows], "^-", label="transformers.generate")
    ax1.axhline(payload["floor_ms"], color="gray", ls=":", label="weight-streaming floor")
    ax1.set(xscale="log", yscale="log", xlabel="batch", ylabel="ms per decode step",
            title=f"{payload['model']} bf16, {payload['device']}")
    ax1.legend(fontsize=8)
    ax2.plot(batches, [r["tokens_per_s"] for r in rows], "o-", label="fastdeploy")
    if rows[0].get("hf_tokens_per_s") is not None:
        ax2.plot(batches, [r["hf_tokens_per_s"] for r in rows], "^-", label="transformers.generate")
    ax2.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s", title="decode throughput")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path = png_path(NAME)
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_8b", help="bundled config name or config.json path")
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the same steps as a quick smoke test")
    parser.add_argument("--copy-gib", type=float, default=4.0, help="size of the bandwidth-measuring copy")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=128, help="context before the timed decode steps")
    parser.add_argument("--warmup", type=int, default=4, help="untimed decode steps per batch and mode")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per batch and mode")
    parser.add_argument("--max-model-len", type=int, default=512, help="also sizes each sequence's block table")
    parser.add_argument("--prefill-tokens", type=int, default=8192, help="tokens of the timed prefill step")
    parser.add_argument("--prefill-len", type=int, default=512, help="prompt length in the prefill step")
    parser.add_argument("--hf-tokens", type=int, default=32, help="new tokens of the longer generate run")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="CUDA: profile this many more decode steps per batch and mode (torch.profiler) and "
                             "print where the device's time goes")
    parser.add_argument("--share-prefix", type=int, nargs="+", default=[1],
                        help="also run each batch with rows in groups of N sharing one prompt's KV blocks "
                             "(a prompt's n samples under prefix caching); 1 = no sharing")
    parser.add_argument("--skip-eager", action="store_true", help="CUDA graphs only")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    args = parser.parse_args()
    if args.plot_only:
        with open(os.path.join(os.path.dirname(png_path(NAME)), f"{NAME}.json")) as f:
            print(plot(json.load(f)))
        return

    bandwidth = copy_bandwidth(args.device, int(args.copy_gib * 2**30))
    info, rows, prefill_rows = bench_fastdeploy(args)
    hf, hf_version = ({}, None) if args.skip_hf else bench_transformers(args, args.batches)
    floor_ms = 1e3 * info["weight_bytes_streamed"] / bandwidth
    for row in rows:
        best = row.get("graph_step_ms") or row["eager_step_ms"]
        row["floor_ms"] = floor_ms
        row["vs_floor"] = best / floor_ms
        row["pipelined_vs_floor"] = step_ms(row) / floor_ms
        row["tokens_per_s"] = 1e3 * row["batch"] / step_ms(row)
        row["hf_ms_per_token"] = hf.get(row["batch"])
        if row["hf_ms_per_token"] is not None:
            row["hf_tokens_per_s"] = 1e3 * row["batch"] / row["hf_ms_per_token"]
            row["speedup_vs_hf"] = row["hf_ms_per_token"] / step_ms(row)
    payload = {
        "machine": machine_info(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "model": args.model,
        "dtype": "bfloat16",
        "transformers_version": hf_version,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "floor_ms": floor_ms,
        **info,
        "settings": vars(args),
        "decode": rows,
        "prefill": prefill_rows,
    }
    print(f"# {payload['device']}  copy bandwidth {bandwidth / 1e12:.2f} TB/s  "
          f"weights streamed {info['weight_bytes_streamed'] / 1e9:.2f} GB  floor {floor_ms:.2f} ms  "
          f"KV pool {info['num_kv_blocks']} blocks ({info['kv_cache_gib']:.1f} GiB)")
    print_table(rows, ["batch", "share_prefix", "context_len", "floor_ms", "graph_forward_ms", "graph_step_ms",
                       "vs_floor", "graph_pipelined_step_ms", "pipelined_vs_floor", "eager_step_ms",
                       "eager_pipelined_step_ms", "hf_ms_per_token", "speedup_vs_hf", "tokens_per_s"])
    print_table(prefill_rows, ["prompt_len", "batch", "tokens", "seconds", "tokens_per_s"])
    print_profiles(rows)
    print(write_json(NAME, payload))
    try:
        print(plot(payload))
    except ImportError:
        print("matplotlib missing: run with --plot-only where it is installed")


if __name__ == "__main__":
    main()
