"""Data-parallel replicas: what the router costs per request, and throughput with N replicas.

    python benchmarks/data_parallel.py                           # CPU, a small random Qwen2
    python benchmarks/data_parallel.py --model DIR --load-format dummy --device cuda --replicas 1 2 \\
        --backend ray                                            # N GPUs of one machine

1. Router overhead: one engine reached directly (`AsyncEngineClient`) against the same engine
   behind a one-replica `ReplicaSet` (the data-parallel path), alternating, --requests
   sequential requests of one token each; the difference of the median latencies is what
   routing adds to a request. Also the time of one routing decision (`ReplicaSet.pick`) with
   --outstanding requests in flight over 8 replicas.
2. Throughput: for each N in --replicas, N replicas under --clients concurrent clients of
   --max-tokens greedy tokens each; output tok/s and the ratio to one replica.
3. Prefix affinity (`--affinity-chats K`, 0 to skip): two replicas under K multi-turn chats run
   side by side, each turn resending its whole conversation; the router as it is against the
   same router without affinity (least outstanding tokens alone). Prefix cache hits (tokens,
   summed over the replicas) and wall time.

Writes benchmarks/results/data_parallel.json and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402


def engine_config(args: argparse.Namespace):
    from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                        guided_decoding_backend="off", cache=CacheConfig(num_blocks=args.num_kv_blocks),
                        scheduler=SchedulerConfig(max_num_seqs=max(8, args.clients), max_model_len=512,
                                                  max_num_batched_tokens=2048))


def request(i: int, max_tokens: int):
    from fastdeploy.common.request import EngineRequest
    from fastdeploy.common.sampling_params import SamplingParams

    return EngineRequest(f"b{i}-{time.monotonic_ns()}", [11 + i % 50, 7, 19, 23, 5],
                         SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


async def one_request_s(client, i: int) -> float:
    start = time.perf_counter()
    async for _ in client.generate(request(i, 1)):
        pass
    return time.perf_counter() - start


async def router_overhead(args: argparse.Namespace) -> dict:
    from fastdeploy.engine.engine_client import AsyncEngineClient
    from fastdeploy.engine.replicas import ReplicaSet

    config = engine_config(args)
    direct, routed = AsyncEngineClient(config), ReplicaSet(config, 1)
    await asyncio.gather(direct.start(), routed.start())
    try:
        for client in (direct, routed):  # warm up both
            for i in range(5):
                await one_request_s(client, i)
        times: dict[str, list[float]] = {"direct": [], "routed": []}
        for i in range(args.requests):
            for name, client in (("direct", direct), ("routed", routed))[:: 1 if i % 2 else -1]:
                times[name].append(await one_request_s(client, i))
    finally:
        await asyncio.gather(direct.shutdown(), routed.shutdown())
    picks = ReplicaSet(config, 8)  # never started: routing decisions only
    for r in picks.replicas:
        r.client.limits = direct.limits  # a client with limits counts as live
    for k in range(args.outstanding):
        picks.replicas[k % 8].outstanding[f"o{k}"] = 100 + k
    start = time.perf_counter()
    for i in range(2000):
        picks.pick(request(i, 16))
    pick_us = (time.perf_counter() - start) / 2000 * 1e6
    direct_ms, routed_ms = (statistics.median(times[k]) * 1e3 for k in ("direct", "routed"))
    return {"direct_median_ms": direct_ms, "routed_median_ms": routed_ms, "overhead_ms": routed_ms - direct_ms,
            "pick_us": pick_us, "requests": args.requests}


def least_load_only(replica_set_type):
    """The router without prefix affinity: the same choice minus the sticky prompt starts (the
    samples of one prompt in flight still go together)."""

    class LeastLoadOnly(replica_set_type):
        def pick(self, request, exclude=frozenset()):
            self._affinity.clear()
            return super().pick(request, exclude)

    return LeastLoadOnly


async def affinity(args: argparse.Namespace, sticky: bool) -> dict:
    """K conversations side by side, --affinity-turns turns each: a 96-token system prompt of
    its own, then per turn a 16-token question and a --max-tokens answer, all resent next turn
    (the default random model's context is 256 tokens)."""
    from fastdeploy.common.request import EngineRequest
    from fastdeploy.common.sampling_params import SamplingParams
    from fastdeploy.engine.replicas import ReplicaSet

    config = engine_config(args)
    group = (ReplicaSet if sticky else least_load_only(ReplicaSet))(config, 2, backend=args.backend)
    await group.start()
    try:
        async def chat(c: int) -> None:
            history = [(c * 37 + i * 11) % 500 + 3 for i in range(96)]
            for turn in range(args.affinity_turns):
                history += [(c * 13 + turn * 7 + i) % 500 + 3 for i in range(16)]
                params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
                request = EngineRequest(f"chat{c}-{turn}-{time.monotonic_ns()}", list(history), params)
                async for delta in group.generate(request):
                    if delta.error is not None:
                        raise RuntimeError(delta.error)
                    history += delta.token_ids

        start = time.perf_counter()
        await asyncio.gather(*(chat(c) for c in range(args.affinity_chats)))
        wall = time.perf_counter() - start
        await asyncio.sleep(1.5)  # the engines' counters arrive with their next report
        queries = sum(r.client.prefix_cache_queries for r in group.replicas)
        hits = sum(r.client.prefix_cache_hits for r in group.replicas)
    finally:
        await group.shutdown()
    return {"router": "affinity" if sticky else "least load only", "chats": args.affinity_chats,
            "turns": args.affinity_turns, "prompt_tokens": queries, "cache_hit_tokens": hits,
            "hit_rate": hits / queries if queries else 0.0, "wall_s": wall}


async def throughput(args: argparse.Namespace, replicas: int) -> dict:
    from fastdeploy.engine.replicas import ReplicaSet

    config = engine_config(args)
    group = ReplicaSet(config, replicas, backend=args.backend)
    await group.start()
    try:
        async def client_loop(c: int) -> int:
            tokens = 0
            for r in range(args.requests_per_client):
                async for delta in group.generate(request(c * 1000 + r, args.max_tokens)):
                    tokens += len(delta.token_ids)
            return tokens

        await asyncio.gather(*(client_loop(c) for c in range(args.clients)))  # warm-up
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(client_loop(c) for c in range(args.clients))))
        wall = time.perf_counter() - start
    finally:
        await group.shutdown()
    return {"replicas": replicas, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: a small random Qwen2 made here)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend", choices=["mp", "ray"], default="mp")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=100, help="sequential one-token requests per side")
    ap.add_argument("--outstanding", type=int, default=256, help="requests in flight for the pick timing")
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--affinity-chats", type=int, default=8, help="conversations of the affinity part (0: skip)")
    ap.add_argument("--affinity-turns", type=int, default=3)
    ap.add_argument("--name", default="data_parallel")
    args = ap.parse_args()
    if args.model is None:
        from tests.random_qwen2 import save_random_qwen2

        args.model = save_random_qwen2(Path(tempfile.mkdtemp(prefix="dp-bench-")), vocab_size=512)
    info = machine_info()
    print_machine(info)
    overhead = asyncio.run(router_overhead(args))
    print({k: round(v, 3) for k, v in overhead.items()})
    rows = [asyncio.run(throughput(args, n)) for n in args.replicas]
    for row in rows:
        row["ratio"] = row["tok_s"] / rows[0]["tok_s"]
    print_table(rows, ["replicas", "tokens", "wall_s", "tok_s", "ratio"])
    routing = [asyncio.run(affinity(args, sticky)) for sticky in (True, False)] if args.affinity_chats else []
    if routing:
        print_table(routing, ["router", "chats", "turns", "prompt_tokens", "cache_hit_tokens", "hit_rate", "wall_s"])
    path = write_json(args.name, {"machine": info, "args": vars(args), "router": overhead, "throughput": rows,
                                  "affinity": routing})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([str(r["replicas"]) for r in rows], [r["tok_s"] for r in rows], color="#4c72b0")
    ax.set_xlabel("replicas", fontsize=8)
    ax.set_ylabel("output tok/s", fontsize=8)
    ax.set_title(f"router adds {overhead['overhead_ms']:.2f} ms per request", fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path(args.name), dpi=120)
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()
