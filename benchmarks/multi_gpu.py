"""Two GPUs of one host: data parallelism (DP=2 against one replica) and tensor parallelism
(TP=2 against TP=1), in process and through the server, in one run.

    python benchmarks/multi_gpu.py                                # 8B-shape dummy model, 2 GPUs
    python benchmarks/multi_gpu.py --device cpu --model PATH/config.json --dtype float32 \\
        --batches 1 4 --clients 4 --server-tokens 16 --server-args "--tokenizer GGUF_OR_DIR"  # small, on CPU

1. In process: `benchmarks/tensor_parallel.py --tp 1 2` at --batches (decode tok/s per batch).
2. Through the server, --clients streaming clients (EOS ignored, --server-tokens tokens each,
   --server-requests requests per client), one server at a time:
   - one replica, TP=1 (GPU 0);
   - DP=2 over Ray (`--data-parallel-size 2 --data-parallel-backend ray`, one GPU each);
   - TP=2 (`--tensor-parallel-size 2`).
   Output tok/s of each; the ratios DP=2 / one replica and TP=2 / TP=1.

Targets (issue: two-GPU scaling): DP=2 aggregate >= 1.9x one replica; TP=2 >= 1.6x at batch 64
and >= 1.3x at batch 1. Writes benchmarks/results/multi_gpu.json and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time

import httpx

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
           "--name", f"{args.name}_tp", *(["--device-timeline"] if args.device.startswith("cuda") else [])]
    subprocess.run(cmd, check=True)
    with open(os.path.join(RESULTS_DIR, f"{args.name}_tp.json")) as f:
        return json.load(f)["rows"]


async def streaming_load(server: Server, clients: int, per_client: int, max_tokens: int) -> dict:
    tokens = 0

    async def client_loop(client: httpx.AsyncClient, c: int) -> None:
        nonlocal tokens
        for r in range(per_client):
            body = {"model": server.model, "prompt": f"Client {c}, request {r}: a story about {TOPICS[c % 10]}.",
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                    "return_token_ids": True}
            async with client.stream("POST", server.base + "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        tokens += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])

    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0),
                                 limits=httpx.Limits(max_connections=clients + 4)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client, c) for c in range(clients)))
        wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def server_run(args: argparse.Namespace, name: str, extra: list[str]) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli", "serve", args.model, "--load-format", "dummy",
           "--device", args.device, "--dtype", args.dtype, "--port", str(port),
           "--max-num-seqs", str(max(args.clients, 8)), *shlex.split(args.server_args), *extra]
    server = Server(f"{args.name}-{name}", cmd, "/health", {}, port)
    os.makedirs(os.path.join(RESULTS_DIR, "logs"), exist_ok=True)
    server.start(os.path.join(RESULTS_DIR, "logs", f"{args.name}-{name}.log"), timeout_s=1200)
    try:
        asyncio.run(streaming_load(server, args.clients, 1, 8))  # every batch size compiled first
        row = asyncio.run(streaming_load(server, args.clients, args.server_requests, args.server_tokens))
    finally:
        server.stop()
    return {"server": name, **row}


def plot(tp_rows: list[dict], server_rows: list[dict], path: str) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for tp in sorted({r["tp"] for r in tp_rows}):
        mine = [r for r in tp_rows if r["tp"] == tp]
        left.plot([r["batch"] for r in mine], [r["decode_tok_s"] for r in mine], marker="o", label=f"TP={tp}")
    left.set_xscale("log", base=2)
    left.set_xlabel("batch", fontsize=8)
    left.set_ylabel("decode tok/s (in process)", fontsize=8)
    if tp_rows:
        left.legend(fontsize=7)
    right.bar([r["server"] for r in server_rows], [r["tok_s"] for r in server_rows], color="#4c72b0")
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
    ap.add_argument("--server-args", default="", help="more `fastdeploy serve` arguments, one string")
    ap.add_argument("--skip-in-process", action="store_true")
    ap.add_argument("--name", default="multi_gpu")
    args = ap.parse_args()

    info = machine_info()
    print_machine(info)
    tp_rows = [] if args.skip_in_process else in_process_tp(args)
    server_rows: list[dict] = []
    summary: dict[str, float] = {}
    for batch in args.batches:
        rows = {r["tp"]: r["decode_tok_s"] for r in tp_rows if r["batch"] == batch}
        if 1 in rows and 2 in rows:
            summary[f"tp2_over_tp1_batch_{batch}"] = rows[2] / rows[1]
    servers = {"one_replica": [], "dp2_ray": ["--data-parallel-size", "2", "--data-parallel-backend", "ray"],
               "tp2": ["--tensor-parallel-size", "2"]}
    for name, extra in servers.items():
        # Written after every part, so a run cut short keeps what it measured.
        write_json(args.name, {"machine": info, "args": vars(args), "in_process_tp": tp_rows,
                               "server": server_rows, "summary": summary})
        server_rows.append(server_run(args, name, extra))
    one, dp, tp2 = (r["tok_s"] for r in server_rows)
    summary.update({"server_dp2_over_one": dp / one, "server_tp2_over_tp1": tp2 / one})
    if tp_rows:
        print_table(tp_rows, [k for k in tp_rows[0] if not isinstance(tp_rows[0][k], (list, dict))])
    print_table(server_rows, ["server", "tokens", "wall_s", "tok_s"])
    print({k: round(v, 3) for k, v in summary.items()})
    path = write_json(args.name, {"machine": info, "args": vars(args), "in_process_tp": tp_rows,
                                  "server": server_rows, "summary": summary})
    plot(tp_rows, server_rows, png_path(args.name))
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()
