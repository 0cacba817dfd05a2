"""Two GPUs of one host: data parallelism (DP=2 against one replica) and tensor parallelism
(TP=2 against TP=1), in process and through the server, in one run.

    python benchmarks/multi_gpu.py                                # 8B-shape dummy model, 2 GPUs
    python benchmarks/multi_gpu.py --device cpu --model PATH/config.json --dtype float32 \\
        --batches 1 4 --clients 4 --server-tokens 16 --server-args "--tokenizer GGUF_OR_DIR"  # small, on CPU

1. In process: `benchmarks/tensor_parallel.py --tp 1 2` at --batches (decode tok/s per batch).
2. Through the server, --clients clients spread over --client-processes processes (EOS ignored,
   --server-tokens tokens each, --server-requests requests per client), streamed and/or whole
   answers (--modes), one server at a time:
   - one replica, TP=1 (GPU 0);
   - DP=2 over Ray (`--data-parallel-size 2 --data-parallel-backend ray`, one GPU each), under the
     same load and, with --dp-double-load, under twice the clients (each replica loaded as the one);
   - TP=2 (`--tensor-parallel-size 2`).
   Output tok/s of each; the ratios DP=2 / one replica and TP=2 / TP=1.

Targets (issue: two-GPU scaling): DP=2 aggregate >= 1.9x one replica; TP=2 >= 1.6x at batch 64
and >= 1.3x at batch 1. Writes benchmarks/results/multi_gpu.json and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shlex
import subprocess
import sys
import time
from typing import Any

import httpx
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    free_port,
    machine_info,
    png_path,
    print_machine,
    print_table,
    pyplot,
    write_json,
)
from benchmarks.serving import TOPICS, Server  # noqa: E402


def in_process_tp(args: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "tensor_parallel.py"), "--model", args.model,
           "--device", args.device, "--dtype", args.dtype, "--tp", "1", "2", "--batches", *map(str, args.batches),
           "--name", f"{args.name}_tp", *args.tp_args.split()]
    subprocess.run(cmd, check=True)
    with open(os.path.join(RESULTS_DIR, f"{args.name}_tp.json")) as f:
        return json.load(f)["rows"]


async def client_share(base: str, model: str, client_ids: list[int], per_client: int, max_tokens: int,
                       stream: bool) -> int:
    """Output tokens of `client_ids`' requests, each client sending its requests one after another."""
    tokens = 0

    async def client_loop(client: httpx.AsyncClient, c: int) -> None:
        nonlocal tokens
        for r in range(per_client):
            body = {"model": model, "prompt": f"Client {c}, request {r}: a story about {TOPICS[c % 10]}.",
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream,
                    "return_token_ids": True}
            if not stream:
                resp = await client.post(base + "/v1/completions", json=body)
                resp.raise_for_status()
                tokens += resp.json()["usage"]["completion_tokens"]
                continue
            async with client.stream("POST", base + "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        tokens += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])

    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0),
                                 limits=httpx.Limits(max_connections=len(client_ids) + 4)) as client:
        await asyncio.gather(*(client_loop(client, c) for c in client_ids))
    return tokens


def _client_process(base: str, model: str, client_ids: list[int], per_client: int, max_tokens: int, stream: bool,
                    barrier: Any, results: Any) -> None:
    barrier.wait()
    start = time.perf_counter()
    tokens = asyncio.run(client_share(base, model, client_ids, per_client, max_tokens, stream))
    results.put((tokens, start, time.perf_counter()))


def load(server: Server, clients: int, per_client: int, max_tokens: int, stream: bool, processes: int) -> dict:
    """`clients` concurrent clients spread over `processes` client processes, so that parsing
    thousands of stream events a second is not the client's ceiling; output tok/s over the wall
    time from the common start to the last answer, and the API server process's CPU share."""
    ctx = mp.get_context("spawn")
    processes = max(1, min(processes, clients))
    barrier, results = ctx.Barrier(processes + 1), ctx.Queue()
    shares = [list(range(clients))[i::processes] for i in range(processes)]
    procs = [ctx.Process(target=_client_process, args=(server.base, server.model, share, per_client, max_tokens,
                                                       stream, barrier, results)) for share in shares]
    for proc in procs:
        proc.start()
    api = psutil.Process(server.proc.pid) if server.proc is not None else None
    barrier.wait(timeout=120)
    cpu_start = sum(api.cpu_times()[:2]) if api else 0.0
    wall_start = time.perf_counter()
    rows = [results.get(timeout=1800) for _ in procs]
    wall = time.perf_counter() - wall_start
    cpu = (sum(api.cpu_times()[:2]) - cpu_start) if api else float("nan")
    for proc in procs:
        proc.join(timeout=30)
    tokens = sum(r[0] for r in rows)
    span = max(r[2] for r in rows) - min(r[1] for r in rows)
    return {"tokens": tokens, "wall_s": span, "tok_s": tokens / span, "api_cpu_share": cpu / wall}


def server_run(args: argparse.Namespace, name: str, extra: list[str], clients: int) -> list[dict]:
    """`clients` concurrent clients against one server; its --max-num-seqs is a replica's share."""
    port = free_port()
    per_replica = clients // 2 if "--data-parallel-size" in extra else clients
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli", "serve", args.model, "--load-format", "dummy",
           "--device", args.device, "--dtype", args.dtype, "--port", str(port),
           "--max-num-seqs", str(max(per_replica, 8)), *shlex.split(args.server_args), *extra]
    server = Server(f"{args.name}-{name}", cmd, "/health", {}, port)
    os.makedirs(os.path.join(RESULTS_DIR, "logs"), exist_ok=True)
    server.start(os.path.join(RESULTS_DIR, "logs", f"{args.name}-{name}.log"), timeout_s=1200)
    rows = []
    try:
        load(server, clients, 1, 8, True, args.client_processes)  # every batch size compiled first
        for mode in args.modes:
            row = load(server, clients, args.server_requests, args.server_tokens, mode == "stream",
                       args.client_processes)
            rows.append({"server": name, "mode": mode, "clients": clients, **row})
            print(f"{name} {mode}: {row['tok_s']:.0f} tok/s, API process CPU {row['api_cpu_share']:.2f}", flush=True)
    finally:
        server.stop()
    return rows


def plot(tp_rows: list[dict], server_rows: list[dict], path: str) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for tp, how in dict.fromkeys((r["tp"], r["all_reduce"]) for r in tp_rows):
        mine = [r for r in tp_rows if r["tp"] == tp and r["all_reduce"] == how]
        left.plot([r["batch"] for r in mine], [r["decode_tok_s"] for r in mine], marker="o",
                  label=f"TP={tp}" + (f" ({how})" if how != "-" else ""))
    left.set_xscale("log", base=2)
    left.set_xlabel("batch", fontsize=8)
    left.set_ylabel("decode tok/s (in process)", fontsize=8)
    if tp_rows:
        left.legend(fontsize=7)
    right.bar([f"{r['server']}\n{r['mode']}" for r in server_rows], [r["tok_s"] for r in server_rows],
              color="#4c72b0")
    right.tick_params(axis="x", labelsize=6)
    right.set_ylabel("server output tok/s", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3_8b", help="bundled config name or model directory")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--server-requests", type=int, default=2, help="requests per client")
    ap.add_argument("--server-tokens", type=int, default=256)
    ap.add_argument("--modes", nargs="+", choices=["stream", "nonstream"], default=["stream", "nonstream"],
                    help="streamed completions (one event a token) and/or whole answers")
    ap.add_argument("--client-processes", type=int, default=8, help="processes the clients are spread over")
    ap.add_argument("--dp-double-load", action="store_true",
                    help="also DP=2 under twice the clients (each replica as loaded as the one replica)")
    ap.add_argument("--server-args", default="", help="more `fastdeploy serve` arguments, one string")
    ap.add_argument("--skip-in-process", action="store_true")
    ap.add_argument("--skip-servers", action="store_true")
    ap.add_argument("--tp-args", default="",
                    help="more benchmarks/tensor_parallel.py arguments, one string (e.g. '--compare-nccl "
                         "--device-timeline --host-profile')")
    ap.add_argument("--name", default="multi_gpu")
    args = ap.parse_args()

    info = machine_info()
    print_machine(info)
    tp_rows = [] if args.skip_in_process else in_process_tp(args)
    server_rows: list[dict] = []
    summary: dict[str, float] = {}
    for batch in args.batches:
        rows = {r["tp"]: r["decode_tok_s"] for r in tp_rows if r["batch"] == batch and r["all_reduce"] != "nccl"}
        if 1 in rows and 2 in rows:
            summary[f"tp2_over_tp1_batch_{batch}"] = rows[2] / rows[1]
    dp = ["--data-parallel-size", "2", "--data-parallel-backend", "ray"]
    # (extra arguments, clients): DP=2 under the same load, and (weak scaling) under the one
    # replica's load on each replica.
    servers = {"one_replica": ([], args.clients), "dp2_ray": (dp, args.clients),
               "dp2_ray_double_load": (dp, 2 * args.clients), "tp2": (["--tensor-parallel-size", "2"], args.clients)}
    if not args.dp_double_load:
        del servers["dp2_ray_double_load"]
    for name, (extra, clients) in ({} if args.skip_servers else servers).items():
        # Written after every part, so a run cut short keeps what it measured.
        write_json(args.name, {"machine": info, "args": vars(args), "in_process_tp": tp_rows,
                               "server": server_rows, "summary": summary})
        server_rows.extend(server_run(args, name, extra, clients))
    for mode in [] if args.skip_servers else args.modes:
        tok_s = {r["server"]: r["tok_s"] for r in server_rows if r["mode"] == mode}
        summary[f"server_{mode}_dp2_over_one"] = tok_s["dp2_ray"] / tok_s["one_replica"]
        summary[f"server_{mode}_tp2_over_tp1"] = tok_s["tp2"] / tok_s["one_replica"]
        if "dp2_ray_double_load" in tok_s:
            summary[f"server_{mode}_dp2_double_load_over_one"] = tok_s["dp2_ray_double_load"] / tok_s["one_replica"]
    if tp_rows:
        print_table(tp_rows, [k for k in tp_rows[0] if not isinstance(tp_rows[0][k], (list, dict))])
    if server_rows:
        print_table(server_rows, ["server", "mode", "tokens", "wall_s", "tok_s", "api_cpu_share"])
    print({k: round(v, 3) for k, v in summary.items()})
    path = write_json(args.name, {"machine": info, "args": vars(args), "in_process_tp": tp_rows,
                                  "server": server_rows, "summary": summary})
    plot(tp_rows, server_rows, png_path(args.name))
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()
