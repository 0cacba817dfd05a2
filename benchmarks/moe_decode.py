"""MoE decode step time on one GPU vs the floor of the bytes it must read (Qwen3-30B-A3B shape).

    python benchmarks/moe_decode.py [--model qwen3_30b_a3b] [--batches 1 64 256] [--prompt-len 128]

Random bf16 weights of a bundled config (`--load-format dummy`), the engine's model runner
with CUDA graphs (fused Triton MoE, `fastdeploy/model_executor/layers/fused_moe.py`):

- floor: what one decode step must read over the device's copy bandwidth (measured with a
  large device-to-device copy): every weight but the embedding table and the experts, the
  experts the step's routing touches (counted per layer in an eager step at the same batch
  and context), and the KV cache of every sequence;
- step: the median wall time of `ModelRunner.execute` for a decode step (forward, logits,
  greedy sampler, packed frame, its host sync), CUDA graphs; forward: replays of the graph;
- moe layer: one layer's fused MoE alone (graph replays queued behind a sleep kernel) against
  the bytes of the experts its routing touches, for random inputs and router logits.

Writes benchmarks/results/moe_decode.json and .png. `--plot-only` redraws the PNG from the JSON.
The weights take ~61 GB at the default shape: an 80 GB H100 holds them with the KV cache for
batch 256 at the default `--max-model-len`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import copy_bandwidth, machine_info, png_path, print_table, pyplot, queued_device_ms, write_json  # noqa: E402
from benchmarks.gpu_decode import graph_replay_ms  # noqa: E402

NAME = "moe_decode"


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_split(model: torch.nn.Module) -> tuple[int, int, int]:
    """(bytes every decode step streams without the experts, bytes of one expert, experts per sparse layer)."""
    from fastdeploy.model_executor.layers.moe import MoEExperts

    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
    if not experts:
        raise SystemExit("the model has no sparse MoE layer")
    expert_bytes = sum(_bytes(p) for m in experts for p in m.parameters())
    embed = _bytes(model.model.embed_tokens.weight) if model.lm_head is not None else 0
    dense = sum(_bytes(p) for p in model.parameters()) - expert_bytes - embed
    one = experts[0]
    return dense, (_bytes(one.w13_weight) + _bytes(one.w2_weight)) // one.num_experts, one.num_experts


def expected_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts per layer if every token picked k experts uniformly at random."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def bench_engine(args: argparse.Namespace, bandwidth: float) -> tuple[dict, list[dict]]:
    from fastdeploy.common.sampling_params import SamplingParams
    from fastdeploy.common.step_input import ChunkInput, NewSequence, StepInput
    from fastdeploy.engine.args import EngineArgs
    from fastdeploy.model_executor.layers.moe import MoEExperts
    from fastdeploy.worker.model_runner import ModelRunner

    max_batch = max(args.batches)
    engine_args = EngineArgs(model=args.model, load_format="dummy", device="cuda", max_num_seqs=max_batch,
                             max_model_len=args.max_model_len, max_num_batched_tokens=args.prefill_tokens,
                             gpu_memory_utilization=args.gpu_memory_utilization, guided_decoding_backend="off")
    t0 = time.perf_counter()
    runner = ModelRunner(engine_args.create_engine_config())
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    config = runner.model_config
    dense_bytes, expert_bytes, num_experts = weight_split(runner.model)
    kv_token_bytes = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
                      * runner.kv_caches[0].element_size())  # fmt: skip
    sparse_layers = sum(config.moe.is_sparse(i) for i in range(config.num_hidden_layers))
    bs = runner.block_size
    blocks_per_seq = -(-args.max_model_len // bs)
    if blocks_per_seq * max_batch > runner.num_blocks:
        raise SystemExit(f"KV pool of {runner.num_blocks} blocks is too small for batch {max_batch}; "
                         "lower --max-model-len")
    info = {"dense_weight_bytes": dense_bytes, "expert_bytes": expert_bytes, "num_experts": num_experts,
            "top_k": config.moe.num_experts_per_tok, "sparse_layers": sparse_layers,
            "kv_bytes_per_token": kv_token_bytes, "num_kv_blocks": runner.num_blocks,
            "setup_s_load_profile_capture": setup_s}  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=None)
    gen = torch.Generator().manual_seed(0)
    message = iter(range(1, 1 << 30))
    seq_counter = iter(range(1 << 30))

    def table(slot: int) -> list[int]:
        return list(range(slot * blocks_per_seq, (slot + 1) * blocks_per_seq))

    def prefill(batch: int) -> list[int]:
        ids = [next(seq_counter) for _ in range(batch)]
        prompts = torch.randint(config.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
        per_step = max(1, args.prefill_tokens // args.prompt_len)
        for lo in range(0, batch, per_step):
            hi = min(batch, lo + per_step)
            new = [NewSequence(ids[i], prompts[i], params, False) for i in range(lo, hi)]
            chunks = [ChunkInput(ids[i], prompts[i], 0, table(i), True) for i in range(lo, hi)]
            runner.execute(StepInput(next(message), new, chunks, []))
        return ids

    def decode(ids: list[int], start: int, steps: int) -> list[float]:
        times = []
        for s in range(steps):
            chunks = [ChunkInput(seq, [1 + (s + i) % 1000], start + s, table(i), True) for i, seq in enumerate(ids)]
            t = time.perf_counter()
            runner.execute(StepInput(next(message), [], chunks, []))
            times.append(time.perf_counter() - t)
        return times

    touched: list[int] = []
    hooks = [m.register_forward_hook(lambda _m, inputs, _out: touched.append(int(inputs[2].unique().numel())))
             for m in runner.model.modules() if isinstance(m, MoEExperts)]  # fmt: skip
    graphs = runner.cuda_graphs
    rows = []
    for batch in args.batches:
        ids = prefill(batch)
        pos = args.prompt_len
        runner.cuda_graphs = None  # one eager step: the hooks see its routing (graph replays run no hooks)
        touched.clear()
        decode(ids, pos, 1)
        runner.cuda_graphs = graphs
        pos += 1
        decode(ids, pos, args.warmup)
        pos += args.warmup
        times = decode(ids, pos, args.steps)
        context = pos + args.steps // 2  # the middle timed step's context
        runner.execute(StepInput(next(message), [], [], ids))
        experts = sum(touched)
        floor_bytes = dense_bytes + experts * expert_bytes + batch * context * kv_token_bytes
        step_ms = 1e3 * statistics.median(times)
        rows.append({
            "batch": batch, "context_len": context, "experts_per_layer": experts / len(touched),
            "experts_uniform": expected_touched(num_experts, config.moe.num_experts_per_tok, batch),
            "floor_gb": floor_bytes / 1e9, "floor_ms": 1e3 * floor_bytes / bandwidth,
            "graph_forward_ms": graph_replay_ms(graphs, batch), "graph_step_ms": step_ms,
            "vs_floor": step_ms / (1e3 * floor_bytes / bandwidth), "tokens_per_s": 1e3 * batch / step_ms,
        })  # fmt: skip
        print(rows[-1], flush=True)
    for h in hooks:
        h.remove()
    layer = next(m for m in runner.model.modules() if isinstance(m, MoEExperts))
    for row in rows:
        row.update(bench_moe_layer(layer, row["batch"], config.hidden_size, config.moe.num_experts_per_tok,
                                   expert_bytes, bandwidth))
    runner = graphs = layer = None  # the closures above hold `runner`: unbinding it frees the model
    gc.collect()
    torch.cuda.empty_cache()
    return info, rows


def bench_moe_layer(layer, batch: int, hidden: int, top_k: int, expert_bytes: int, bandwidth: float) -> dict:
    """One fused MoE layer alone on random rows and router logits, replayed from a CUDA graph."""
    from fastdeploy.model_executor.layers.fused_moe import fused_moe
    from fastdeploy.model_executor.layers.moe import route

    gen = torch.Generator(device="cuda").manual_seed(batch)
    x = torch.randn(batch, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    logits = torch.randn(batch, layer.num_experts, device="cuda", generator=gen, dtype=torch.bfloat16)
    weights, ids = route(logits, top_k, renormalize=True)
    fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids)
    ms = queued_device_ms(graph.replay, calls=50)
    touched = int(ids.unique().numel())
    floor_ms = 1e3 * touched * expert_bytes / bandwidth
    return {"moe_layer_us": 1e3 * ms, "moe_layer_floor_us": 1e3 * floor_ms, "moe_layer_vs_floor": ms / floor_ms,
            "moe_layer_experts": touched}


def plot(payload: dict) -> str:
    plt = pyplot()
    rows = payload["decode"]
    labels = [str(r["batch"]) for r in rows]
    xs = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.27
    ax1.bar([x - width for x in xs], [r["floor_ms"] for r in rows], width, label="floor (bytes / copy bandwidth)")
    ax1.bar(list(xs), [r["graph_forward_ms"] for r in rows], width, label="forward (graph replay)")
    ax1.bar([x + width for x in xs], [r["graph_step_ms"] for r in rows], width, label="engine step")
    ax1.set(xticks=list(xs), xticklabels=labels, xlabel="batch", ylabel="ms per decode step",
            title=f"{payload['model']} bf16, {payload['device']}")
    ax1.legend(fontsize=8)
    ax2.bar([x - width / 2 for x in xs], [r["moe_layer_floor_us"] for r in rows], width,
            label="floor (touched experts)")
    ax2.bar([x + width / 2 for x in xs], [r["moe_layer_us"] for r in rows], width, label="fused MoE layer")
    ax2.set(xticks=list(xs), xticklabels=labels, xlabel="batch", ylabel="us per layer", title="one MoE layer alone")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path = png_path(NAME)
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_30b_a3b", help="bundled config name or config.json path (MoE)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=128, help="context before the timed decode steps")
    parser.add_argument("--warmup", type=int, default=4, help="untimed decode steps per batch")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per batch")
    parser.add_argument("--max-model-len", type=int, default=256, help="also sizes each sequence's block table")
    parser.add_argument("--prefill-tokens", type=int, default=4096, help="token budget of a prefill step")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    parser.add_argument("--copy-gib", type=float, default=4.0, help="size of the bandwidth-measuring copy")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    args = parser.parse_args()
    if args.plot_only:
        with open(os.path.join(os.path.dirname(png_path(NAME)), f"{NAME}.json")) as f:
            print(plot(json.load(f)))
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    bandwidth = copy_bandwidth("cuda", int(args.copy_gib * 2**30))
    info, rows = bench_engine(args, bandwidth)
    payload = {"machine": machine_info(), "device": torch.cuda.get_device_name(), "model": args.model,
               "dtype": "bfloat16", "copy_bandwidth_bytes_per_s": bandwidth, **info, "settings": vars(args),
               "decode": rows}  # fmt: skip
    print(f"# {payload['device']}  copy bandwidth {bandwidth / 1e12:.2f} TB/s  weights without experts "
          f"{info['dense_weight_bytes'] / 1e9:.2f} GB  one expert {info['expert_bytes'] / 1e6:.2f} MB "
          f"x {info['num_experts']} x {info['sparse_layers']} layers")
    print_table(rows, ["batch", "context_len", "experts_per_layer", "experts_uniform", "floor_gb", "floor_ms",
                       "graph_forward_ms", "graph_step_ms", "vs_floor", "tokens_per_s", "moe_layer_us",
                       "moe_layer_floor_us", "moe_layer_vs_floor"])
    print(write_json(NAME, payload))
    try:
        print(plot(payload))
    except ImportError:
        print("matplotlib missing: run with --plot-only where it is installed")


if __name__ == "__main__":
    main()
