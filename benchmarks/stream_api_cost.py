"""The API server's CPU per streamed chunk, with a worker fast enough that streaming is the load.

    python benchmarks/stream_api_cost.py [--clients 64] [--max-tokens 128] [--rounds 3]

A tiny random Qwen2 (`tests/random_qwen2.py`, 49,152-token vocabulary, the embedded GGUF's
tokenizer) serves `--clients` concurrent streaming chat requests (greedy, EOS ignored) on this
machine. Per round: SSE chunks per second and the CPU seconds of the API, engine and worker
processes; the figure is the API process's CPU microseconds per chunk (what caps a streamed
server once its replicas outrun one API process, docs/distributed.md). The event loop and the
HTTP parser uvicorn picked (uvloop and httptools where installed, else asyncio and h11) are
recorded with the results.

Writes benchmarks/results/stream_api_cost.json (or `--name`) and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402
from benchmarks.serving import Server, fastdeploy_server  # noqa: E402
from benchmarks.serving_mask import process_cpu_s  # noqa: E402


async def _stream(client: httpx.AsyncClient, server: Server, i: int, max_tokens: int) -> int:
    """One streaming chat request; its content chunks."""
    body = {"model": server.model, "messages": [{"role": "user", "content": f"Say something, {i}."}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True}
    chunks = 0
    async with client.stream("POST", server.base + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            chunks += line.startswith("data: ") and line != "data: [DONE]"
    return chunks


async def _load(server: Server, clients: int, max_tokens: int) -> int:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        return sum(await asyncio.gather(*(_stream(client, server, i, max_tokens) for i in range(clients))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="stream_api_cost")
    args = parser.parse_args()

    from fastdeploy.model_executor.model_loader.embedded import embedded_model_path
    from tests.random_qwen2 import save_random_qwen2

    info = machine_info()
    info["event_loop"] = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    info["http"] = "httptools" if importlib.util.find_spec("httptools") else "h11"
    print_machine(info)
    print(f"uvicorn: {info['event_loop']} event loop, {info['http']} parser", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_qwen2(os.path.join(tmp, "model"), vocab_size=49_152)
        server = fastdeploy_server("tiny", [model, "--tokenizer", embedded_model_path(),
                                            "--max-num-seqs", str(args.clients)])
        server.start(os.path.join(tmp, "server.log"), 300.0, 0.5)
        try:
            asyncio.run(_load(server, args.clients, args.max_tokens))  # warm-up
            rows = []
            for r in range(args.rounds):
                before = process_cpu_s(server)
                start = time.perf_counter()
                chunks = asyncio.run(_load(server, args.clients, args.max_tokens))
                wall = time.perf_counter() - start
                cpu = {name: s - before[name] for name, s in process_cpu_s(server).items()}
                rows.append({"round": r, "chunks": chunks, "chunks_per_s": round(chunks / wall, 1),
                             "api_us_per_chunk": round(cpu["api"] / chunks * 1e6, 1),
                             **{f"{name}_cpu_share": round(s / wall, 3) for name, s in cpu.items()}})
                print(rows[-1], flush=True)
        finally:
            server.stop()
    summary = {"api_us_per_chunk": statistics.median(r["api_us_per_chunk"] for r in rows),
               "chunks_per_s": statistics.median(r["chunks_per_s"] for r in rows)}
    print_table(rows, list(rows[0]))
    print(f"median API CPU per chunk: {summary['api_us_per_chunk']:.1f} us")
    path = write_json(args.name, {"machine": info, "args": vars(args), "rows": rows, "summary": summary})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([str(r["round"]) for r in rows], [r["api_us_per_chunk"] for r in rows], color="tab:blue")
    ax.set_xlabel("round")
    ax.set_ylabel("API CPU µs per streamed chunk", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(f"{args.clients} streams, {info['event_loop']} + {info['http']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path(args.name), dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
