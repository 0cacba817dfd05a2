"""Tensor parallelism: decode throughput and greedy tokens at tensor-parallel size 1 vs N.

    python benchmarks/tensor_parallel.py --tp 1 2                 # 8B-shape dummy, bf16, 2 GPUs
    python benchmarks/tensor_parallel.py --device cpu --model CONFIG.json --tp 1 2 --batches 1 4 --dtype float32

Random weights of a bundled config (`--load-format dummy`) through the engine (`EngineCore`,
one process per rank, NCCL on CUDA, gloo on CPU). Each size runs in its own process, so
every run starts from a clean device. For each batch: random prompts of --prompt-len
tokens, greedy, --max-tokens new tokens each; the first step (prefill and the first
token) is timed apart from the decode steps that follow. Dummy weights are drawn per rank,
so sizes differ in their tokens; `tests/distributed/test_tensor_parallel.py` holds real
sharded weights to size 1's tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json


def run_one_size(args: argparse.Namespace, tp: int, nccl_only: bool = False) -> list[dict]:
    """Every batch at one tensor-parallel size, in this process."""
    from fastdeploy.common.request import EngineRequest
    from fastdeploy.common.sampling_params import SamplingParams
    from fastdeploy.engine.args import EngineArgs
    from fastdeploy.engine.engine_core import EngineCore
    from fastdeploy.engine.executor import InProcessExecutor
    from fastdeploy.model_executor.model_loader import resolve_model_path
    from fastdeploy.model_executor.model_loader.dummy_loader import dummy_model_config

    config = EngineArgs(model=args.model, load_format="dummy", device=args.device, dtype=args.dtype,
                        tensor_parallel_size=tp, disable_custom_all_reduce=nccl_only, max_num_seqs=max(args.batches),
                        max_model_len=args.prompt_len + args.max_tokens + 16,
                        max_num_batched_tokens=max(args.batches) * args.prompt_len,
                        guided_decoding_backend="off").create_engine_config()
    core = EngineCore(config, InProcessExecutor(config))
    vocab = dummy_model_config(resolve_model_path(args.model)).vocab_size
    gen = torch.Generator().manual_seed(0)
    counter = iter(range(1 << 30))
    rows = []

    def generate(batch: int, max_tokens: int, watch: Callable[[], AbstractContextManager] = nullcontext
                 ) -> tuple[float, float]:
        """Prefill and first tokens, then the decode steps (under `watch`); wall seconds of each."""
        prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(batch)]
        ids = [f"r{next(counter)}" for _ in prompts]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for rid, prompt in zip(ids, prompts, strict=True):
            core.add_request(EngineRequest(rid, prompt, params))
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        start = time.perf_counter()
        while not all(tokens.values()):
            for delta in core.step():
                tokens[delta.request_id].extend(delta.token_ids)
        first = time.perf_counter()
        with watch():
            while core.has_work():
                for delta in core.step():
                    tokens[delta.request_id].extend(delta.token_ids)
        end = time.perf_counter()
        return first - start, end - first

    try:
        for batch in args.batches:
            generate(batch, 4)  # warm-up: allocations, graphs, kernel compiles
            prefill_s, decode_s = [], []
            for _ in range(args.repeats):
                p, d = generate(batch, args.max_tokens)
                prefill_s.append(p)
                decode_s.append(d)
            decode = statistics.median(decode_s)
            how = "nccl" if nccl_only else ("custom" if tp > 1 else "-")
            rows.append({"tp": tp, "all_reduce": how, "batch": batch,
                         "first_step_ms": statistics.median(prefill_s) * 1e3,
                         "decode_step_ms": decode / (args.max_tokens - 1) * 1e3,
                         "decode_tok_s": batch * (args.max_tokens - 1) / decode})
            print(f"tp={tp} ({rows[-1]['all_reduce']}) batch={batch}: decode {rows[-1]['decode_tok_s']:.1f} tok/s, "
                  f"step {rows[-1]['decode_step_ms']:.2f} ms", flush=True)
            if args.device_timeline and args.device.startswith("cuda"):
                rows[-1].update(device_timeline(lambda w, b=batch: generate(b, args.max_tokens, w),
                                                args.max_tokens - 1))
                row = rows[-1]
                print(f"  rank 0 decode: device busy {row['device_busy_ms']:.2f} ms a step "
                      f"(all-reduce kernels {row['allreduce_ms']:.2f} ms), wall {row['profiled_step_ms']:.2f} ms",
                      flush=True)
                for kernel in row["top_kernels"]:
                    print(f"    {kernel['us_per_step']:8.1f} us  x{kernel['calls_per_step']:5.1f}  {kernel['kernel']}",
                          flush=True)
            if args.host_profile:
                print(host_profile(lambda w, b=batch: generate(b, args.max_tokens, w)), flush=True)
    finally:
        core.shutdown()
    return rows


def device_timeline(run: Callable[[Callable[[], AbstractContextManager]], tuple[float, float]], steps: int,
                    top_kernels: int = 14) -> dict:
    """Rank 0's kernels over the decode steps of one generation: device-busy time a step (the
    union of kernel intervals, so overlapping streams count once) and the all-reduce kernels'
    share (an all-reduce kernel also waits for the slower rank). The rest of the step's wall time
    is the device waiting for the host. `top_kernels`: the kernels that took most device time a step."""
    from torch.profiler import ProfilerActivity, profile

    holder: dict = {}

    @contextmanager
    def watch() -> Iterator[None]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            yield
        holder["prof"] = prof

    _, decode_s = run(watch)
    intervals = sorted((e.time_range.start, e.time_range.end, e.name) for e in holder["prof"].events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy = allreduce = 0.0
    last_end = float("-inf")
    by_kernel: dict[str, list[float]] = {}
    for start, end, name in intervals:
        busy += max(0.0, end - max(start, last_end))
        last_end = max(last_end, end)
        if "allreduce" in name.lower().replace("_", ""):
            allreduce += end - start
        by_kernel.setdefault(name, []).append(end - start)
    top = sorted(by_kernel.items(), key=lambda item: -sum(item[1]))[:top_kernels]
    return {"device_busy_ms": busy / 1e3 / steps, "allreduce_ms": allreduce / 1e3 / steps,
            "profiled_step_ms": decode_s / steps * 1e3,
            "top_kernels": [{"kernel": name[:90], "us_per_step": sum(times) / steps,
                             "calls_per_step": len(times) / steps} for name, times in top]}


def host_profile(run: Callable[[Callable[[], AbstractContextManager]], tuple[float, float]], top: int = 25) -> str:
    """cProfile of rank 0's host over the decode steps of one generation: where the step's
    Python time goes, by own time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()

    @contextmanager
    def watch() -> Iterator[None]:
        profiler.enable()
        try:
            yield
        finally:
            profiler.disable()

    run(watch)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def plot(rows: list[dict], title: str, name: str) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for tp, how in dict.fromkeys((r["tp"], r.get("all_reduce", "-")) for r in rows):
        pts = [r for r in rows if r["tp"] == tp and r.get("all_reduce", "-") == how]
        label = f"tp={tp}" + (f" ({how})" if how != "-" else "")
        ax.plot([r["batch"] for r in pts], [r["decode_tok_s"] for r in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tokens / s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path(name), dpi=120)
    return png_path(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_8b", help="bundled config name or config.json path")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes to compare")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="tensor_parallel")
    parser.add_argument("--device-timeline", action="store_true",
                        help="CUDA: also profile one generation per batch on rank 0 (device-busy ms a step)")
    parser.add_argument("--host-profile", action="store_true",
                        help="also print a cProfile of rank 0's host over one generation's decode steps per batch")
    parser.add_argument("--compare-nccl", action="store_true",
                        help="also run each size > 1 with --disable-custom-all-reduce (NCCL for every all-reduce)")
    parser.add_argument("--only-tp", type=int, default=None, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--only-nccl", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.only_tp is not None:
        with open(args.rows_out, "w") as f:
            json.dump(run_one_size(args, args.only_tp, args.only_nccl), f)
        return

    info = machine_info()
    print_machine(info)
    if args.device.startswith("cuda"):
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    rows: list[dict] = []
    runs = [(tp, False) for tp in args.tp] + [(tp, True) for tp in args.tp if tp > 1 and args.compare_nccl]
    for tp, nccl_only in runs:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        child = [a for a in sys.argv[1:] if a != "--compare-nccl"]
        subprocess.run([sys.executable, __file__, *child, "--only-tp", str(tp), "--rows-out", out,
                        *(["--only-nccl"] if nccl_only else [])], check=True)
        with open(out) as f:
            rows.extend(json.load(f))
        os.unlink(out)

    base = {r["batch"]: r for r in rows if r["tp"] == args.tp[0]}
    for r in rows:
        ref = base[r["batch"]]
        r["speedup"] = r["decode_tok_s"] / ref["decode_tok_s"]
    print_table(rows, ["tp", "all_reduce", "batch", "first_step_ms", "decode_step_ms", "decode_tok_s", "speedup"])
    print(write_json(args.name, {"benchmark": "tensor_parallel", "machine": info, "args": vars(args), "rows": rows}))
    print(plot(rows, f"Tensor parallel decode, {args.model} dummy, {args.dtype}", args.name))


if __name__ == "__main__":
    main()
