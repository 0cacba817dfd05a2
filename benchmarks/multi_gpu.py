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
   - TP=2 (`--tensor-parallel-size 2`);
   - with --pair, two separate one-replica servers (GPU 0 and GPU 1) loaded at once, each by
     --clients clients: what two replicas give with nothing shared (no common API process), the
     ceiling DP=2 is measured against.
   --dp-backend picks Ray (default) or mp for the DP rows. Output tok/s of each; the ratios
   DP=2 / one replica and TP=2 / TP=1; the CPU share of each server process during each load
   (API server, engines, workers; an engine under Ray is not the API server's descendant, so
   under Ray only the API server's share is known), and each replica's running and waiting
   sequences sampled from /metrics every 0.2 s. --profile-dir: py-spy records every server
   process during the streamed loads of the servers named by --profile-servers.

Targets (issue: two-GPU scaling): DP=2 aggregate >= 1.9x one replica; TP=2 >= 1.6x at batch 64
and >= 1.3x at batch 1. Writes benchmarks/results/multi_gpu.json and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    engine_processes,
    free_port,
    machine_info,
    png_path,
    print_machine,
    print_table,
    pyplot,
    start_py_spy,
    stop_py_spy,
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
    try:
        tokens = asyncio.run(client_share(base, model, client_ids, per_client, max_tokens, stream))
    except Exception as exc:  # noqa: BLE001 - the parent raises it (it would otherwise wait for a result)
        results.put(repr(exc))
        return
    results.put((tokens, start, time.perf_counter()))


def server_processes(servers: list[Server]) -> dict[str, psutil.Process]:
    """role -> process: each server's API process, engines and workers; roles carry the server's index."""
    roles: dict[str, psutil.Process] = {}
    for s_index, server in enumerate(servers):
        roles[f"s{s_index}.api"] = psutil.Process(server.proc.pid)  # the launcher, with --api-server-count > 1
        api_index = 0
        for child in psutil.Process(server.proc.pid).children():
            with contextlib.suppress(psutil.Error):
                if "spawn_main" in " ".join(child.cmdline()) and not child.children():
                    roles[f"s{s_index}.api{api_index}"] = child  # one of several API processes
                    api_index += 1
        for e_index, (engine, workers) in enumerate(engine_processes(server.proc.pid)):
            roles[f"s{s_index}.engine{e_index}"] = engine
            for w_index, worker in enumerate(workers):
                roles[f"s{s_index}.engine{e_index}.worker{w_index}"] = worker
    return roles


def cpu_seconds(roles: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for role, proc in roles.items():
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            out[role] = times.user + times.system
    return out


def start_profile(servers: list[Server], directory: str, name: str) -> list[subprocess.Popen]:
    os.makedirs(directory, exist_ok=True)
    return [start_py_spy(server.proc.pid, os.path.join(directory, f"{name}_s{i}.txt"), rate=50)
            for i, server in enumerate(servers)]


class ReplicaWatch:
    """Each server's per-replica running and waiting sequences (its /metrics gauges) every
    `period_s` during a load, on a thread: whether a replica ran short of work or queued."""

    def __init__(self, servers: list[Server], period_s: float = 0.2) -> None:
        self.servers, self.period_s = servers, period_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ReplicaWatch:
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(self.period_s):
                sample: dict[str, Any] = {"t": round(time.perf_counter() - self._started, 2)}
                for i, server in enumerate(self.servers):
                    with contextlib.suppress(httpx.HTTPError):
                        for line in client.get(server.base + "/metrics").text.splitlines():
                            for gauge, short in (("fastdeploy_num_requests_running", "running"),
                                                 ("fastdeploy_num_requests_waiting", "waiting")):
                                if line.startswith(gauge):
                                    name, value = line.rsplit(" ", 1)
                                    replica = name.split('replica="')[1].split('"')[0] if "replica=" in name else "0"
                                    sample[f"s{i}.r{replica}.{short}"] = float(value)
                self.samples.append(sample)


def load(servers: list[Server], clients: int, per_client: int, max_tokens: int, stream: bool, processes: int,
         profile: tuple[str, str] | None = None) -> dict:
    """`clients` concurrent clients per server, spread over `processes` client processes per server,
    so that parsing thousands of stream events a second is not the client's ceiling; output tok/s
    over the wall time from the common start to the last answer, and each server process's CPU
    share. `profile`: (directory, name) of py-spy records taken during the load."""
    ctx = mp.get_context("spawn")
    processes = max(1, min(processes, clients))
    barrier, results = ctx.Barrier(len(servers) * processes + 1), ctx.Queue()
    shares = [list(range(clients))[i::processes] for i in range(processes)]
    procs = [ctx.Process(target=_client_process, args=(server.base, server.model, share, per_client, max_tokens,
                                                       stream, barrier, results))
             for server in servers for share in shares]
    for proc in procs:
        proc.start()
    roles = server_processes(servers)
    barrier.wait(timeout=120)
    profilers = start_profile(servers, *profile) if profile else []
    cpu_start = cpu_seconds(roles)
    wall_start = time.perf_counter()
    with ReplicaWatch(servers) as watch:
        rows = [results.get(timeout=1800) for _ in procs]
    failed = [row for row in rows if isinstance(row, str)]
    if failed:
        raise RuntimeError(f"a client process failed: {failed[0]}")
    wall = time.perf_counter() - wall_start
    cpu_end = cpu_seconds(roles)
    for profiler in profilers:
        stop_py_spy(profiler)
    for proc in procs:
        proc.join(timeout=30)
    tokens = sum(r[0] for r in rows)
    span = max(r[2] for r in rows) - min(r[1] for r in rows)
    shares_by_role = {role: round((cpu_end[role] - cpu_start[role]) / wall, 3) for role in cpu_end if role in cpu_start}
    return {"tokens": tokens, "wall_s": span, "tok_s": tokens / span,
            # The busiest API process (with several, the launcher is the idle root).
            "api_cpu_share": max([v for k, v in shares_by_role.items() if k.startswith("s0.api")] or [float("nan")]),
            "cpu_share": shares_by_role,
            "replica_samples": watch.samples, "replica_summary": replica_summary(watch.samples)}


def replica_summary(samples: list[dict[str, Any]]) -> dict[str, str]:
    """gauge -> "mean / max" over the load's samples."""
    keys = sorted({k for sample in samples for k in sample if k != "t"})
    out = {}
    for key in keys:
        values = [sample[key] for sample in samples if key in sample]
        out[key] = f"{sum(values) / len(values):.1f} / {max(values):.0f}"
    return out


def server_run(args: argparse.Namespace, name: str, extra: list[str], clients: int, copies: int = 1) -> list[dict]:
    """`clients` concurrent clients against one server (`copies` = 2: against each of two
    separate servers, on GPU 0 and GPU 1); --max-num-seqs is a replica's share."""
    per_replica = clients // 2 if "--data-parallel-size" in extra else clients
    servers = []
    os.makedirs(os.path.join(RESULTS_DIR, "logs"), exist_ok=True)
    for copy in range(copies):
        port = free_port()
        cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli", "serve", args.model, "--load-format", "dummy",
               "--device", args.device, "--dtype", args.dtype, "--port", str(port),
               "--max-num-seqs", str(max(per_replica, 8)), *shlex.split(args.server_args), *extra]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(copy)} if copies > 1 else None
        servers.append(Server(f"{args.name}-{name}-{copy}", cmd, "/health", {}, port, env=env))
    rows = []
    try:
        for copy, server in enumerate(servers):
            server.start(os.path.join(RESULTS_DIR, "logs", f"{args.name}-{name}-{copy}.log"), timeout_s=1200)
        load(servers, clients, 1, 8, True, args.client_processes)  # every batch size compiled first
        for repeat in range(args.repeats):
            for mode in args.modes:
                profile = ((args.profile_dir, f"{args.name}_{name}_{mode}")
                           if args.profile_dir and name in args.profile_servers and repeat == 0 else None)
                row = load(servers, clients, args.server_requests, args.server_tokens, mode == "stream",
                           args.client_processes, profile)
                rows.append({"server": name, "mode": mode, "repeat": repeat, "clients": clients * copies,
                             "dp_backend": args.dp_backend if "--data-parallel-size" in extra else None, **row})
                print(f"{name} {mode}: {row['tok_s']:.0f} tok/s, CPU shares {row['cpu_share']}, "
                      f"running / waiting (mean / max) {row['replica_summary']}", flush=True)
    finally:
        for server in servers:
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
    ap.add_argument("--repeats", type=int, default=1, help="loads of each mode per server (the ratios: medians)")
    ap.add_argument("--pair", action="store_true",
                    help="also two separate one-replica servers (GPU 0, GPU 1) loaded at once, --clients each")
    ap.add_argument("--dp-backend", choices=["ray", "mp"], default="ray", help="the DP rows' replica backend")
    ap.add_argument("--dp-api-servers", type=int, default=1,
                    help="--api-server-count of the DP rows (more than 1 needs --dp-backend mp)")
    ap.add_argument("--servers", nargs="+", default=None,
                    help="run only these server rows (one_replica, dp2, dp2_double_load, two_servers, tp2)")
    ap.add_argument("--profile-dir", default=None, help="py-spy records of --profile-servers' loads go here")
    ap.add_argument("--profile-servers", nargs="+", default=["dp2_double_load"])
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
    dp = ["--data-parallel-size", "2", "--data-parallel-backend", args.dp_backend,
          "--api-server-count", str(args.dp_api_servers)]
    # (extra arguments, clients per server, servers): DP=2 under the same load, and (weak
    # scaling) under the one replica's load on each replica; two separate servers as loaded.
    servers = {"one_replica": ([], args.clients, 1), "dp2": (dp, args.clients, 1),
               "dp2_double_load": (dp, 2 * args.clients, 1), "two_servers": ([], args.clients, 2),
               "tp2": (["--tensor-parallel-size", "2"], args.clients, 1)}
    chosen = args.servers or [name for name in servers if (name != "dp2_double_load" or args.dp_double_load)
                              and (name != "two_servers" or args.pair)]
    for name in [] if args.skip_servers else chosen:
        extra, clients, copies = servers[name]
        # Written after every part, so a run cut short keeps what it measured.
        write_json(args.name, {"machine": info, "args": vars(args), "in_process_tp": tp_rows,
                               "server": server_rows, "summary": summary})
        server_rows.extend(server_run(args, name, extra, clients, copies))
    for mode in [] if args.skip_servers else args.modes:
        tok_s = {name: statistics.median(r["tok_s"] for r in server_rows if r["mode"] == mode and r["server"] == name)
                 for name in {r["server"] for r in server_rows}}
        for name in ("dp2", "dp2_double_load", "two_servers", "tp2"):
            if name in tok_s and "one_replica" in tok_s:
                summary[f"server_{mode}_{name}_over_{'tp1' if name == 'tp2' else 'one'}"] = (
                    tok_s[name] / tok_s["one_replica"])
    if tp_rows:
        print_table(tp_rows, [k for k in tp_rows[0] if not isinstance(tp_rows[0][k], (list, dict))])
    if server_rows:
        print_table(server_rows, ["server", "mode", "repeat", "tokens", "wall_s", "tok_s", "api_cpu_share"])
    print({k: round(v, 3) for k, v in summary.items()})
    path = write_json(args.name, {"machine": info, "args": vars(args), "in_process_tp": tp_rows,
                                  "server": server_rows, "summary": summary})
    plot(tp_rows, server_rows, png_path(args.name))
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()
