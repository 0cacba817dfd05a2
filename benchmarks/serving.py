"""Serving benchmark: streaming chat clients against fastdeploy and llama-cpp-python's server.

    python benchmarks/serving.py [--concurrency 1 4 16 64] [--requests-per-level 64]
                                 [--max-tokens 64] [--time-per-level 120] [--skip-llamacpp]

The script starts each server itself (free port, waits until it answers), runs one
warm-up request, then for each concurrency level C runs C clients in a loop: each sends
streaming `/v1/chat/completions` requests (greedy, exactly --max-tokens tokens, EOS
ignored) until --requests-per-level requests were sent or --time-per-level seconds
passed. Every server it started is stopped at the end.

Per level: output tokens/s = completion tokens of the level / wall time of the level;
TTFT = request sent -> first SSE chunk carrying a token (fastdeploy sends an empty role
chunk first, which is not counted); ITL = gaps between consecutive token-carrying SSE
chunks (per chunk, like vLLM's benchmark_serving). Every request has its own system
message, so no server can reuse a cached prompt prefix of another request.

Both servers load the embedded SmolLM2-135M-Instruct GGUF; llama-cpp-python runs with
--n_threads 2 (or --threads). The load generator runs on the same machine and competes
for the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

# Importing fastdeploy sets OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT (its own processes must not
# spin long on cores other processes need); llama.cpp's OpenMP threads pass many barriers per token
# and run several times slower with PASSIVE, so llama.cpp's server gets the environment the user
# started with.
_USER_OMP_ENV = {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def llamacpp_env() -> dict[str, str]:
    env = dict(os.environ)
    for name, value in _USER_OMP_ENV.items():
        env.pop(name, None)
        if value is not None:
            env[name] = value
    return env


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

TOPICS = ["a lighthouse keeper", "a lost umbrella", "the first snow", "a robot gardener", "an old map",
          "a quiet library", "a bridge at night", "a paper boat", "a desert well", "a broken clock"]


@dataclass
class Server:
    name: str
    cmd: list[str]
    ready_path: str           # GET this until 200
    extra_body: dict          # how this server is told to ignore EOS
    port: int
    proc: subprocess.Popen | None = None
    model: str = ""
    env: dict[str, str] | None = None  # the server's environment; None: this process's
    ready_s: float | None = None  # seconds from launch to the first 200 of ready_path (set by start)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_path: str, timeout_s: float = 300.0, poll_s: float = 1.0) -> None:
        log = open(log_path, "w")
        # Own session: on a hung shutdown we can kill exactly this server's process group.
        launched = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=self.env)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {log_path}")
            try:
                if httpx.get(self.base + self.ready_path, timeout=2).status_code == 200:
                    self.ready_s = time.perf_counter() - launched
                    self.model = httpx.get(self.base + "/v1/models", timeout=5).json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s; see {log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # fastdeploy's server stops its engine and worker on SIGTERM
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def fastdeploy_server(name: str, serve_args: list[str], extra_body: dict | None = None) -> Server:
    """`fastdeploy serve *serve_args` on a free port, not started yet; ready when /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli", "serve", "--port", str(port), *serve_args]
    return Server(name, cmd, "/health", extra_body or {}, port)


def llamacpp_server(gguf: str, eos: int, threads: int, port: int) -> Server:
    """llama-cpp-python's server on `gguf` with `threads` threads, EOS ignored through logit_bias.

    It has no parallel-sequence option: one global lock serialises requests, so concurrent
    clients queue. By default (--interrupt_requests True) a waiting request makes the running
    one stop early; turned off so every request completes. n_ctx 2048 matches fastdeploy's
    --max-model-len."""
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048",
           "--interrupt_requests", "False"]
    return Server("llama.cpp", cmd, "/v1/models", {"logit_bias": {str(eos): -100.0}}, port, env=llamacpp_env())


@dataclass
class RequestResult:
    ok: bool
    tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str | None = None


async def one_request(client: httpx.AsyncClient, server: Server, index: int, max_tokens: int) -> RequestResult:
    body = {
        "model": server.model,
        "messages": [
            {"role": "system", "content": f"Request {index}. You are a storyteller."},
            {"role": "user", "content": f"Write a short story about {TOPICS[index % len(TOPICS)]}."},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **server.extra_body,
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    chunk_tokens = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", server.base + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return RequestResult(False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return RequestResult(False, error=str(event["error"])[:200])
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                for choice in event.get("choices", []):
                    n = len(choice.get("token_ids") or []) or (1 if choice.get("delta", {}).get("content") else 0)
                    if n:
                        arrivals.append(time.perf_counter())
                        chunk_tokens += n
    except httpx.HTTPError as exc:
        return RequestResult(False, error=repr(exc))
    end = time.perf_counter()
    if not arrivals:
        return RequestResult(False, error="no tokens streamed")
    return RequestResult(True, tokens=usage_tokens or chunk_tokens, ttft=arrivals[0] - start,
                         itls=[b - a for a, b in zip(arrivals, arrivals[1:], strict=False)], latency=end - start)


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no data."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


async def run_level(server: Server, concurrency: int, n_requests: int, max_tokens: int,
                    time_budget: float) -> dict:
    counter = iter(range(n_requests))
    results: list[RequestResult] = []
    start = time.perf_counter()

    async def client_loop(client: httpx.AsyncClient) -> None:
        for index in counter:  # shared iterator: the clients together send n_requests
            if time.perf_counter() - start > time_budget:
                return
            results.append(await one_request(client, server, index, max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    wall = time.perf_counter() - start

    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    itls = [x * 1e3 for r in ok for x in r.itls]
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "server": server.name, "concurrency": concurrency, "requests": len(results), "failed": len(results) - len(ok),
        "short": sum(r.tokens < max_tokens for r in ok),  # ended before max_tokens: should stay 0
        "seconds": wall, "output_tokens": tokens, "tok_s": tokens / wall if wall > 0 else None,
        "req_s": len(ok) / wall if wall > 0 else None,
        "ttft_p50_ms": pct(ttfts, 50), "ttft_p99_ms": pct(ttfts, 99),
        "itl_p50_ms": pct(itls, 50), "itl_p99_ms": pct(itls, 99),
        "errors": errors[:3],
    }


def bench_server(server: Server, args: argparse.Namespace) -> list[dict]:
    log_path = os.path.join(RESULTS_DIR, f"serving_{server.name}.log")
    os.makedirs(RESULTS_DIR, exist_ok=True)
    print(f"starting {server.name}: {' '.join(server.cmd)}", flush=True)
    try:
        server.start(log_path)
        asyncio.run(run_level(server, 1, 1, args.max_tokens, 600))  # warm-up, not recorded
        rows = []
        for c in args.concurrency:
            row = asyncio.run(run_level(server, c, args.requests_per_level, args.max_tokens, args.time_per_level))
            print(f"  {server.name} c={c}: {row['tok_s']:.1f} tok/s, {row['requests']} requests "
                  f"({row['failed']} failed) in {row['seconds']:.1f}s", flush=True)
            rows.append(row)
        return rows
    finally:
        server.stop()


def plot(rows: list[dict], path: str, title: str) -> None:
    plt = pyplot()
    metrics = [("tok_s", "output tokens / s"), ("ttft_p50_ms", "TTFT p50 (ms)"), ("itl_p50_ms", "ITL p50 (ms)")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(13, 3.8))
    for ax, (key, label) in zip(axes, metrics, strict=True):
        for name in dict.fromkeys(r["server"] for r in rows):
            pts = [(r["concurrency"], r[key]) for r in rows if r["server"] == name and r[key] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        ax.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for r in rows})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests-per-level", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--time-per-level", type=float, default=120.0,
                        help="no new request starts after this many seconds of a level")
    parser.add_argument("--threads", type=int, default=2, help="llama-cpp-python server threads")
    parser.add_argument("--skip-llamacpp", action="store_true")
    args = parser.parse_args()

    from fastdeploy.model_executor.model_loader import embedded_model_path, get_tokenizer

    gguf = embedded_model_path()
    info = machine_info()
    print_machine(info)
    eos = get_tokenizer(None).eos_token_id

    servers = []
    port = free_port()
    servers.append(Server(
        "fastdeploy",
        [sys.executable, "-m", "fastdeploy.entrypoints.cli", "serve", gguf, "--port", str(port),
         "--max-num-seqs", str(max(64, max(args.concurrency)))],
        "/health", {"ignore_eos": True, "return_token_ids": True}, port))
    unavailable: dict[str, str] = {}
    if args.skip_llamacpp:
        unavailable["llama.cpp"] = "skipped (flag)"
    elif info["llama_cpp_python"] is None:
        unavailable["llama.cpp"] = "llama-cpp-python is not installed"
    else:
        servers.append(llamacpp_server(gguf, eos, args.threads, free_port()))

    rows: list[dict] = []
    for server in servers:
        try:
            rows += bench_server(server, args)
        except Exception as exc:  # record and go on with the other server
            print(f"{server.name} failed: {exc!r}", flush=True)
            unavailable[server.name] = f"failed: {exc!r}"

    print(f"\n{args.max_tokens} tokens per request, greedy, EOS ignored, "
          f"up to {args.requests_per_level} requests / {args.time_per_level:.0f}s per level")
    print_table(rows, ["server", "concurrency", "requests", "failed", "short", "seconds", "tok_s", "req_s",
                       "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"])
    for name, why in unavailable.items():
        print(f"{name}: unavailable, {why}")
    for r in rows:
        if r["errors"]:
            print(f"{r['server']} c={r['concurrency']} errors: {r['errors']}")

    payload = {
        "benchmark": "serving",
        "machine": info,
        "settings": {"model": gguf, "concurrency": args.concurrency, "requests_per_level": args.requests_per_level,
                     "max_tokens": args.max_tokens, "time_per_level_s": args.time_per_level,
                     "llamacpp_threads": args.threads},
        "commands": {s.name: s.cmd for s in servers},
        "method": {
            "tok_s": "completion tokens of the level / wall time of the level",
            "ttft": "request sent -> first SSE chunk carrying a token",
            "itl": "gap between consecutive token-carrying SSE chunks",
            "llama.cpp": "llama-cpp-python server (python -m llama_cpp.server); it serializes requests "
                         "with a global lock, so concurrent clients queue (--interrupt_requests False); "
                         "EOS ignored via logit_bias",
        },
        "unavailable": unavailable,
        "results": rows,
    }
    print("wrote", write_json("serving", payload))
    path = png_path("serving")
    if rows:
        plot(rows, path, f"streaming chat, {args.max_tokens} tokens/request, {info['cpu']} x{info['cores']}")
        print("wrote", path)


if __name__ == "__main__":
    main()
