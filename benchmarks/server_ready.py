"""Time from `fastdeploy serve` to a 200 from /health, start after start, with the worker's phases.

    python benchmarks/server_ready.py [--starts 2] [--server-args "..."] [--name server_ready]

The first start on a fresh machine pays what later starts find cached (Triton's kernel cache
under ~/.triton, the page cache of the weights); each start after it shows the warm figure.
A start whose sampler began on the torch kept-set path (its Triton kernels still compiling) is
kept up, with a small request a second, until it switches (`--settle-s`), so the next start
finds those kernels compiled.
Every start also records the worker's start-up line (`worker ready in ... (weights ..., KV
cache ..., CUDA graphs ..., sampler warm-up ...)`) and the seconds the API server itself took
before it started the engine. Writes benchmarks/results/<name>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import RESULTS_DIR, free_port, machine_info, print_machine, print_table, write_json  # noqa: E402

READY_LINE = re.compile(r"worker ready in .*")


STARTED_ON_TORCH = "sampling starts on the torch path"
SWITCHED = "switched from the torch to the Triton kept-set path"


def one_start(args: list[str], log_path: str, timeout_s: float, settle_s: float = 0.0) -> dict:
    """Seconds to the first 200 from /health. `settle_s`: a server that started sampling on the
    torch path (its kept-set kernels still compiling: Triton's cache was empty) is kept up, with
    a small request a second, until it switches or `settle_s` passes, so that the kernels it
    compiled are in the cache for the next start (`switch_s`: seconds after ready)."""
    port = free_port()
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli", "serve", "--port", str(port), *args]
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        ready_s = None
        switch_s = None
        try:
            while time.perf_counter() - start < timeout_s and proc.poll() is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        ready_s = time.perf_counter() - start
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
            if ready_s is not None and settle_s > 0 and STARTED_ON_TORCH in open(log_path).read():
                switch_s = settle(port, log_path, settle_s)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = open(log_path).read()
    phases = READY_LINE.search(text)
    return {"ready_s": ready_s, "worker": phases.group(0) if phases else None, "switch_s": switch_s}


def settle(port: int, log_path: str, settle_s: float) -> float | None:
    """Seconds until the server's log says it switched to the Triton kept-set path (None: not
    within `settle_s`); the switch happens between steps, so a small request runs each second."""
    began = time.perf_counter()
    body = {"prompt": "Hi", "max_tokens": 2, "top_p": 0.9}
    while time.perf_counter() - began < settle_s:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
        if SWITCHED in open(log_path).read():
            return time.perf_counter() - began
        time.sleep(1.0)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=2)
    parser.add_argument("--server-args", default="", help="`fastdeploy serve` arguments, one string")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--settle-s", type=float, default=120.0,
                        help="keep a start that began on the torch kept-set path up until it switches (at most this)")
    parser.add_argument("--name", default="server_ready")
    args = parser.parse_args()
    info = machine_info()
    print_machine(info)
    os.makedirs(os.path.join(RESULTS_DIR, "logs"), exist_ok=True)
    rows = []
    for i in range(args.starts):
        row = {"start": i + 1, **one_start(shlex.split(args.server_args),
                                           os.path.join(RESULTS_DIR, "logs", f"{args.name}-{i + 1}.log"),
                                           args.timeout, args.settle_s)}
        print(row, flush=True)
        rows.append(row)
    print_table(rows, ["start", "ready_s", "worker"])
    print("wrote", write_json(args.name, {"machine": info, "server_args": args.server_args, "starts": rows}))


if __name__ == "__main__":
    main()
