"""CPU decode through the server: fastdeploy against llama.cpp on the same GGUF, threads and prompts.

    pip install -r requirements-bench.txt        # llama-cpp-python builds llama.cpp (minutes)
    python benchmarks/cpu_vs_llamacpp.py [--threads 2] [--max-tokens 128] [--requests 8] [--rounds 1]

One run, two servers on the embedded SmolLM2-135M-Instruct Q4_1 GGUF, started and measured in
turn (only one is up at a time): llama-cpp-python's server (`--n_threads T`) and fastdeploy as
`make serve` starts it (float32 activations, the GGUF's Q4_1/Q8_0 blocks kept as the file has
them). fastdeploy's torch threads are set to T too. Each server gets a single stream (one
client, --requests requests one after another) and 16 concurrent clients (--requests each);
non-streaming chat, greedy, exactly --max-tokens tokens (EOS ignored), every request with its
own system message. Output tok/s = completion tokens (from each response's usage) / wall time
of the level. With --rounds R the servers take turns R times (a shared machine's slow spells
then fall on both) and each figure is the median of its rounds, the rounds listed beside it.
Non-streaming, as an RL rollout asks; `benchmarks/serving.py` has the streaming comparison.
llama.cpp's server runs with the caller's OMP_WAIT_POLICY, not the PASSIVE that importing
fastdeploy sets (with it, its single stream ran at 25-26 tok/s on an Intel VM, against 38-94
tok/s without).

Targets (the CPU-speed issue): single stream >= 0.67x llama.cpp (stretch 1.0x), 16 concurrent
>= 2x llama.cpp's server. Writes benchmarks/results/cpu_vs_llamacpp.json and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
from benchmarks.serving import TOPICS, Server, llamacpp_server  # noqa: E402

TARGETS = {1: 0.67, 16: 2.0}


def servers(gguf: str, eos: int, threads: int) -> list[Server]:
    llama_port, port = free_port(), free_port()
    fastdeploy = [sys.executable, "-m", "fastdeploy.entrypoints.cli", "serve", gguf, "--max-num-seqs", "16"]
    ignore_eos = {"ignore_eos": True, "return_token_ids": True}
    return [
        llamacpp_server(gguf, eos, threads, llama_port),
        Server("fastdeploy", [*fastdeploy, "--port", str(port)], "/health", ignore_eos, port),
    ]


async def _level(server: Server, clients: int, per_client: int, max_tokens: int) -> dict:
    tokens = 0
    errors: list[str] = []

    async def client_loop(client: httpx.AsyncClient, c: int) -> None:
        nonlocal tokens
        for r in range(per_client):
            index = c * per_client + r
            body = {"model": server.model, "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "system", "content": f"Request {index}. You are a storyteller."},
                                 {"role": "user", "content": f"Write a short story about {TOPICS[index % 10]}."}],
                    **server.extra_body}
            resp = await client.post(server.base + "/v1/chat/completions", json=body)
            if resp.status_code != 200:
                errors.append(f"HTTP {resp.status_code}: {resp.text[:200]}")
                continue
            tokens += resp.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=httpx.Limits(max_connections=clients + 4)) \
            as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client, c) for c in range(clients)))
        wall = time.perf_counter() - start
    return {"server": server.name, "concurrency": clients, "requests": clients * per_client, "failed": len(errors),
            "tokens": tokens, "seconds": wall, "tok_s": tokens / wall, "errors": errors[:3]}


def measure(server: Server, args: argparse.Namespace) -> list[dict]:
    log_path = os.path.join(RESULTS_DIR, f"{args.name}_{server.name.replace(' ', '_')}.log")
    server.start(log_path)
    try:
        asyncio.run(_level(server, 1, 1, 16))  # warm-up
        rows = []
        for clients in (1, 16):
            row = asyncio.run(_level(server, clients, args.requests, args.max_tokens))
            print(f"  {server.name} c={clients}: {row['tok_s']:.1f} tok/s ({row['failed']} failed)", flush=True)
            rows.append(row)
        return rows
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=8, help="requests per client")
    parser.add_argument("--rounds", type=int, default=1, help="times the servers take turns; figures are medians")
    parser.add_argument("--name", default="cpu_vs_llamacpp")
    args = parser.parse_args()

    from fastdeploy.model_executor.model_loader import embedded_model_path, get_tokenizer

    info = machine_info()
    print_machine(info)
    if info["llama_cpp_python"] is None:
        sys.exit("llama-cpp-python is not installed: pip install -r requirements-bench.txt")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # fastdeploy's torch threads (inherited by its processes)
    rounds: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.rounds):
        for server in servers(embedded_model_path(), get_tokenizer(None).eos_token_id, args.threads):
            for row in measure(server, args):
                rounds.setdefault((row["server"], row["concurrency"]), []).append(row)
    rows = []
    for runs in rounds.values():
        row = dict(sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2])  # the median round
        row["rounds_tok_s"] = [r["tok_s"] for r in runs]
        row["failed"] = sum(r["failed"] for r in runs)
        row["errors"] = [e for r in runs for e in r["errors"]][:3]
        rows.append(row)
    base = {r["concurrency"]: r["tok_s"] for r in rows if r["server"] == "llama.cpp" and r["tok_s"]}
    for row in rows:
        # No ratio where llama.cpp served nothing (its failures are in the row's "errors").
        row["vs_llamacpp"] = row["tok_s"] / base[row["concurrency"]] if row["concurrency"] in base else None
        row["target"] = TARGETS[row["concurrency"]] if row["server"] != "llama.cpp" else None
    print_table(rows, ["server", "concurrency", "requests", "failed", "tokens", "seconds", "tok_s", "vs_llamacpp",
                       "target"])
    for row in rows:
        if row["errors"]:
            print(f"{row['server']} c={row['concurrency']} errors: {row['errors']}")
    path = write_json(args.name, {"machine": info, "threads": args.threads, "max_tokens": args.max_tokens,
                                  "requests_per_client": args.requests, "rounds": args.rounds, "targets": TARGETS,
                                  "results": rows})
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, concurrency in zip(axes, (1, 16), strict=True):
        mine = [r for r in rows if r["concurrency"] == concurrency]
        ax.bar([r["server"].replace(" + ", "\n+ ") for r in mine], [r["tok_s"] for r in mine], color="#4c72b0")
        ax.set_title(f"{concurrency} client{'s' if concurrency > 1 else ''}, output tok/s", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(png_path(args.name), dpi=120)
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()
