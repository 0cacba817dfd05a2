"""Sampling masks through the server: a flag-off and a flag-on server under the same load.

    python benchmarks/serving_mask.py [--clients 16] [--requests-per-client 2] [--max-tokens 64]
                                      [--formats ids bitmap] [--cases peaked flat]
                                      [--rss-requests 2000] [--server-args "..."]

Starts `fastdeploy serve` twice on the same model, once without `--enable-keep-sampling-mask`
and once with it; both stay up and are loaded in turn (one idles while the other runs).
Each server gets the same load per case: `--clients` concurrent clients, each sending
`--requests-per-client` non-streaming `/v1/completions` requests of exactly `--max-tokens`
tokens (EOS ignored, seeded), as an RL rollout does; the flag-on server gets it once per
`sampling_mask_format`. Every run is repeated `--rounds` times, off and on back to back
within a round (in reverse order every other round), and the table gives medians (the ratio: the
median of the rounds' ratios, with their range). Cases:

- peaked: temperature 1.0, top_p 0.9 (a trained model keeps a few to a few hundred ids);
- flat: temperature 1.5, top_p 0.99 (tens of thousands of ids per token on the embedded model).

Per run: output tok/s (completion tokens / wall time of the run, every client's bodies read
in full), the ratio to the flag-off server's tok/s in the same case, kept ids per token and
response bytes per token (from the bodies, parsed after the clock stops), the server's RSS
(API server, engine and worker processes together) after the run, and the CPU time per token
of each of those processes (where the masks' cost lands). `--client-procs P` spreads the clients
over P load-generator processes that start together: a 7B-vocabulary bitmap body is about 6 MB
per 256 tokens, and one Python client process may read them slower than a GPU server writes them.
Phase timing per request (medians in each row, per wave under `waves`; `phase_summary`): sent to
response headers (the server holds the request: queueing, generation, building the answer) and
headers to the whole body read (the transfer); each client's r-th request is wave r. An answer
whose bitmaps fill a block of JSON is written while it runs (docs/sampling.md): its headers come
after the first block and its body read spans the rest of the generation.

`--rss-requests N` then sends N short masked requests (8 tokens, flat case, bitmap and ids
alternating) to the flag-on server and records its RSS before and after: nothing of a
finished request's masks may stay behind.

Writes benchmarks/results/serving_mask.json (or `--name`) and a PNG; with `--gpu-scale-key K`
it also stores the bitmap flat ratio as `mask_server_ratio[K]` in
benchmarks/results/gpu_scale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import os
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np
import orjson
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    engine_processes,
    machine_info,
    png_path,
    print_machine,
    print_table,
    pyplot,
    start_py_spy,
    stop_py_spy,
    tree_rss_mb,
    write_json,
)
from benchmarks.serving import TOPICS, Server, fastdeploy_server  # noqa: E402

CASES = {"peaked": {"temperature": 1.0, "top_p": 0.9}, "flat": {"temperature": 1.5, "top_p": 0.99}}


@dataclass
class LoadStats:
    """What one share of the clients saw: counts summed over its bodies, its clock and CPU."""
    tokens: int            # completion tokens from the bodies' usage
    masks: int             # mask rows in the bodies
    ids: int               # kept ids over those rows (a null row counts the whole vocabulary)
    body_bytes: int
    errors: list[str]
    start: float           # perf_counter (CLOCK_MONOTONIC: one clock for every process here)
    end: float
    cpu_s: float
    # Per answered request: (client, its request number = the wave, sent, headers in, body read),
    # perf_counter times.
    phases: list[tuple[int, int, float, float, float]]


def server_rss_mb(server: Server) -> float:
    """Resident memory of the server and every process it started (engine, worker)."""
    return tree_rss_mb(server.proc.pid)


def process_cpu_s(server: Server) -> dict[str, float]:
    """CPU seconds (user + system) so far of the API server, the engine and the worker(s)."""
    roles = {"api": psutil.Process(server.proc.pid)}
    for engine, workers in engine_processes(server.proc.pid):
        roles["engine"] = engine
        for i, worker in enumerate(workers):
            roles["worker" if i == 0 else f"worker{i}"] = worker
    out = {}
    for role, proc in roles.items():
        times = proc.cpu_times()
        out[role] = times.user + times.system
    return out


def request_body(model: str, index: int, case: str, max_tokens: int, mask_format: str | None) -> dict:
    body = {"model": model, "prompt": f"Request {index}. Write a short story about "
                                      f"{TOPICS[index % len(TOPICS)]}.",
            "max_tokens": max_tokens, "ignore_eos": True, "seed": index, **CASES[case]}
    if mask_format is not None:
        body["sampling_mask_format"] = mask_format
    return body


def kept_ids(mask: list | str | None, vocab_size: int) -> int:
    if mask is None:
        return vocab_size
    if isinstance(mask, str):
        return int(np.unpackbits(np.frombuffer(base64.b64decode(mask), np.uint8)).sum())
    return len(mask)


async def _send_all(base: str, model: str, case: str, mask_format: str | None, clients: range, per_client: int,
                    max_tokens: int, first_index: int
                    ) -> tuple[list[bytes], list[str], float, float, list[tuple[int, int, float, float, float]]]:
    bodies: list[bytes] = []
    errors: list[str] = []
    phases: list[tuple[int, int, float, float, float]] = []

    async def client_loop(client: httpx.AsyncClient, c: int) -> None:
        for r in range(per_client):
            index = first_index + c * per_client + r
            sent = time.perf_counter()
            # Headers first, then the body: a non-streaming answer's headers go out when the
            # server has finished the request and starts writing its body.
            async with client.stream("POST", base + "/v1/completions",
                                     json=request_body(model, index, case, max_tokens, mask_format)) as resp:
                headers = time.perf_counter()
                content = await resp.aread()
            done = time.perf_counter()
            if resp.status_code != 200:
                errors.append(f"HTTP {resp.status_code}: {content[:200]!r}")
                continue
            bodies.append(content)
            phases.append((c, r, sent, headers, done))

    limits = httpx.Limits(max_connections=len(clients) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client, c) for c in clients))
        end = time.perf_counter()
    return bodies, errors, start, end, phases


def load_share(base: str, model: str, case: str, mask_format: str | None, clients: range, per_client: int,
               max_tokens: int, first_index: int, vocab_size: int, start_at: float) -> LoadStats:
    """Run some of the clients to the end, then read their bodies (after the clock stopped)."""
    time.sleep(max(0.0, start_at - time.perf_counter()))
    cpu_before = time.process_time()
    bodies, errors, start, end, phases = asyncio.run(_send_all(base, model, case, mask_format, clients, per_client,
                                                               max_tokens, first_index))
    cpu_s = time.process_time() - cpu_before
    tokens = masks = ids = 0
    for body in bodies:
        parsed = orjson.loads(body)
        tokens += parsed["usage"]["completion_tokens"]
        for choice in parsed["choices"]:
            for mask in choice.get("sampling_mask") or []:
                ids += kept_ids(mask, vocab_size)
                masks += 1
    return LoadStats(tokens, masks, ids, sum(len(b) for b in bodies), errors, start, end, cpu_s, phases)


def phase_summary(phases: list[tuple[int, int, float, float, float]], start: float, wall: float) -> dict:
    """Where a run's time went, per request: `headers_s` from sending it to its response headers
    (queueing, generation and building the answer: the server holds the request), `body_s` from
    the headers to the whole body read (the transfer). Per wave (each client's r-th request;
    clients send theirs one after another): the medians of both, when the wave's requests were
    sent and their headers arrived (seconds from the run's start), and `turnaround_s`, a client's
    time from the previous wave's headers to sending this request (body read and client work:
    no request of that client is at the server). `at_server_share`: the share of client-seconds
    (clients x wall) with a request at the server."""
    if not phases:
        return {}
    clients = len({p[0] for p in phases})
    headers_of = {(c, r): h for c, r, _, h, _ in phases}
    waves = []
    for w in sorted({p[1] for p in phases}):
        mine = [p for p in phases if p[1] == w]
        turn = [s - headers_of[(c, w - 1)] for c, _, s, _, _ in mine if (c, w - 1) in headers_of]
        waves.append({"wave": w, "requests": len(mine),
                      "sent_first_s": min(p[2] for p in mine) - start, "sent_last_s": max(p[2] for p in mine) - start,
                      "headers_s": float(np.median([p[3] - p[2] for p in mine])),
                      "headers_max_s": max(p[3] - p[2] for p in mine),
                      "body_s": float(np.median([p[4] - p[3] for p in mine])),
                      "body_max_s": max(p[4] - p[3] for p in mine),
                      "headers_first_s": min(p[3] for p in mine) - start,
                      "headers_last_s": max(p[3] for p in mine) - start,
                      "done_last_s": max(p[4] for p in mine) - start,
                      "turnaround_s": float(np.median(turn)) if turn else None})
    return {"headers_s": float(np.median([p[3] - p[2] for p in phases])),
            "body_s": float(np.median([p[4] - p[3] for p in phases])),
            "at_server_share": sum(p[3] - p[2] for p in phases) / (clients * wall),
            "body_share": sum(p[4] - p[3] for p in phases) / (clients * wall),
            "waves": [{k: round(v, 4) if isinstance(v, float) else v for k, v in wave.items()} for wave in waves]}


def run_load(server: Server, case: str, mask_format: str | None, clients: int, per_client: int, max_tokens: int,
             first_index: int = 0, vocab_size: int = 49152, client_procs: int = 1) -> LoadStats:
    """`clients` concurrent clients, split over `client_procs` processes that start together, so
    that reading large bodies in the load generator does not become what is measured."""
    shares = [range(p, clients, client_procs) for p in range(min(client_procs, clients))]
    start_at = time.perf_counter() + (0.5 if len(shares) > 1 else 0.0)
    jobs = [(server.base, server.model, case, mask_format, share, per_client, max_tokens, first_index, vocab_size,
             start_at) for share in shares]
    if len(jobs) == 1:
        parts = [load_share(*jobs[0])]
    else:
        with ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("fork")) as pool:
            parts = list(pool.map(load_share, *zip(*jobs, strict=True)))
    return LoadStats(sum(p.tokens for p in parts), sum(p.masks for p in parts), sum(p.ids for p in parts),
                     sum(p.body_bytes for p in parts), [e for p in parts for e in p.errors],
                     min(p.start for p in parts), max(p.end for p in parts), sum(p.cpu_s for p in parts),
                     [ph for p in parts for ph in p.phases])


def start_server(name: str, args: list[str], log_dir: str) -> Server:
    server = fastdeploy_server(name, args)
    server.start(os.path.join(log_dir, f"{name}.log"), timeout_s=900)
    return server


def warm_up(server: Server, cases: list[str], mask_formats: list[str | None], clients: int,
            max_tokens: int) -> None:
    """The measured load's shape once, at full length: every batch size and context length the
    runs reach is compiled (CUDA graphs, Triton kernels) before the clock runs. (With a
    16-token warm-up, the first timed run of the flag-off server was the slowest of its runs in
    every H100 call.)"""
    for case in cases:
        for fmt in mask_formats:
            run_load(server, case, fmt, clients, 1, max_tokens, first_index=10_000)


def rss_check(server: Server, num_requests: int, clients: int) -> dict:
    per_client = num_requests // clients
    before = server_rss_mb(server)
    result_ids = run_load(server, "flat", "ids", clients, per_client // 2, 8, first_index=20_000)
    result_bits = run_load(server, "flat", "bitmap", clients, per_client - per_client // 2, 8,
                           first_index=40_000)
    after = server_rss_mb(server)
    done = (result_ids.tokens + result_bits.tokens) // 8
    return {"requests": done, "errors": len(result_ids.errors) + len(result_bits.errors),
            "rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1),
            "rss_growth_mb": round(after - before, 1)}


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['case']}\n{r['format']}" for r in rows if r["format"] != "off"]
    ratios = [r["ratio"] for r in rows if r["format"] != "off"]
    ax.bar(labels, ratios, color=["#4c72b0" if "ids" in lab else "#dd8452" for lab in labels])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("tok/s, mask on / off", fontsize=8)
    ax.set_title("sampling mask through the server", fontsize=9)
    for x, ratio in enumerate(ratios):
        ax.text(x, ratio, f"{ratio:.2f}", ha="center", va="bottom", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def measure(server: Server, case: str, fmt: str | None, args: argparse.Namespace, profile_path: str | None = None
            ) -> dict:
    """One timed run of the load against one server, with what it cost each process."""
    cpu_before = process_cpu_s(server)
    profiler = start_py_spy(server.proc.pid, profile_path, rate=100) if profile_path else None
    try:
        result = run_load(server, case, fmt, args.clients, args.requests_per_client, args.max_tokens,
                          vocab_size=args.vocab_size, client_procs=args.client_procs)
    finally:
        if profiler is not None:
            stop_py_spy(profiler)
    cpu_after = process_cpu_s(server)
    if result.errors:
        print(f"{case} {fmt}: {len(result.errors)} errors, first: {result.errors[0]}")
    wall = result.end - result.start
    tokens = result.tokens
    return {"case": case, "format": fmt or "off", "tok_s": tokens / wall,
            "ids_per_token": result.ids / result.masks if result.masks else None,
            "bytes_per_token": result.body_bytes / tokens if tokens else None,
            "server_rss_mb": server_rss_mb(server), "wall_s": wall, "tokens": tokens,
            "errors": len(result.errors),
            # The load generator's own CPU, per client process: it reads every body, so it must
            # not be the bottleneck (near 1.0 means it was; raise --client-procs).
            "client_cpu_share": result.cpu_s / wall / min(args.client_procs, args.clients),
            **{f"cpu_ms_per_token_{role}": 1000 * (cpu_after[role] - cpu_before[role]) / max(tokens, 1)
               for role in cpu_after},
            **phase_summary(result.phases, result.start, wall)}


def summarise(runs: list[dict]) -> list[dict]:
    """Per (case, format): medians over the rounds; the ratio is the median of each round's
    on/off ratio (the two runs of a round are back to back, so a slow spell of the machine
    moves both)."""
    rows = []
    keys = list(dict.fromkeys((r["case"], r["format"]) for r in runs))
    for case, fmt in keys:
        mine = [r for r in runs if r["case"] == case and r["format"] == fmt]
        row: dict = {"case": case, "format": fmt, "rounds": len(mine)}
        for field in mine[0]:
            if field not in ("case", "format", "round", "waves") and mine[0][field] is not None:
                row[field] = round(float(np.median([r[field] for r in mine])), 3)
        if "waves" in mine[0]:  # per wave, each field's median over the rounds
            row["waves"] = [{k: v if k in ("wave", "requests") or v is None else
                             round(float(np.median([r["waves"][i][k] for r in mine])), 4) for k, v in wave.items()}
                            for i, wave in enumerate(mine[0]["waves"])]
        if fmt != "off":
            offs = {r["round"]: r["tok_s"] for r in runs if r["case"] == case and r["format"] == "off"}
            ratios = [r["tok_s"] / offs[r["round"]] for r in mine]
            row["ratio"] = round(float(np.median(ratios)), 3)
            row["ratio_min"], row["ratio_max"] = round(min(ratios), 3), round(max(ratios), 3)
        else:
            row["ratio"] = 1.0
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--client-procs", type=int, default=1,
                        help="processes the clients are spread over (large mask bodies need several)")
    parser.add_argument("--rounds", type=int, default=3, help="times each run is repeated, off and on alternating")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--formats", nargs="+", choices=["ids", "bitmap"], default=["ids", "bitmap"])
    parser.add_argument("--rss-requests", type=int, default=0, help="masked requests of the memory check (0: skip)")
    parser.add_argument("--server-args", default="", help="extra `fastdeploy serve` arguments, one string")
    parser.add_argument("--vocab-size", type=int, default=49152, help="logits width (counts null rows)")
    parser.add_argument("--name", default="serving_mask")
    parser.add_argument("--profile-dir", default=None,
                        help="record py-spy stacks (raw, idle included) of the masked server's processes during "
                             "each masked run into this directory; needs py-spy on PATH")
    parser.add_argument("--gpu-scale-key", default=None, help="store the flat bitmap ratio in gpu_scale.json")
    args = parser.parse_args()

    info = machine_info()
    print_machine(info)
    extra = shlex.split(args.server_args)
    log_dir = os.path.join(RESULTS_DIR, "logs")
    os.makedirs(log_dir, exist_ok=True)
    runs: list[dict] = []
    memory = None
    servers: dict[str, Server] = {}
    try:
        # Both servers stay up; a run loads one while the other idles.
        for name, flag in (("off", []), ("on", ["--enable-keep-sampling-mask"])):
            servers[name] = start_server(f"{args.name}-{name}", [*flag, *extra], log_dir)
        warm_up(servers["off"], args.cases, [None], args.clients, args.max_tokens)
        warm_up(servers["on"], args.cases, list(args.formats), args.clients, args.max_tokens)
        for round_index in range(args.rounds):
            for case in args.cases:
                order = [("off", None), *(("on", f) for f in args.formats)]
                # Every other round the other way round, so a machine that speeds up or slows
                # down over a round does not favour one side.
                for name, fmt in order if round_index % 2 == 0 else order[::-1]:
                    profile_path = None
                    if args.profile_dir and fmt is not None:
                        os.makedirs(args.profile_dir, exist_ok=True)
                        profile_path = os.path.join(args.profile_dir, f"{case}_{fmt}_round{round_index}.txt")
                    run = measure(servers[name], case, fmt, args, profile_path)
                    run["round"] = round_index
                    runs.append(run)
                    print({k: round(v, 2) if isinstance(v, float) else v for k, v in run.items() if k != "waves"},
                          flush=True)
        if args.rss_requests:
            memory = rss_check(servers["on"], args.rss_requests, args.clients)
            print("memory:", memory, flush=True)
    finally:
        for server in servers.values():
            server.stop()

    rows = summarise(runs)
    print_table(rows, ["case", "format", "tok_s", "ratio", "ratio_min", "ratio_max", "ids_per_token",
                       "bytes_per_token", "server_rss_mb", "cpu_ms_per_token_api", "cpu_ms_per_token_engine",
                       "cpu_ms_per_token_worker", "client_cpu_share", "errors"])
    print("\nper wave (medians over the rounds; ms):")
    wave_ms = [{"case": r["case"], "format": r["format"], "at_server_share": r.get("at_server_share"),
                "body_share": r.get("body_share"),
                **{k[:-2] + "_ms" if k.endswith("_s") else k: 1000 * v if k.endswith("_s") and v is not None else v
                   for k, v in w.items()}} for r in rows for w in r.get("waves", [])]
    print_table(wave_ms, ["case", "format", "wave", "requests", "sent_first_ms", "sent_last_ms", "headers_ms",
                          "headers_max_ms", "headers_first_ms", "headers_last_ms", "body_ms", "body_max_ms",
                          "done_last_ms", "turnaround_ms", "at_server_share", "body_share"])
    payload = {"machine": info, "clients": args.clients, "client_procs": args.client_procs,
               "requests_per_client": args.requests_per_client,
               "max_tokens": args.max_tokens, "rounds": args.rounds, "server_args": args.server_args,
               "cases": CASES, "summary": rows, "runs": runs, "memory": memory}
    path = write_json(args.name, payload)
    plot(rows, png_path(args.name))
    print(f"wrote {path} and {png_path(args.name)}")
    if args.gpu_scale_key is not None:
        flat = next((r for r in rows if r["case"] == "flat" and r["format"] == "bitmap"), None)
        if flat is not None:
            scale_path = os.path.join(RESULTS_DIR, "gpu_scale.json")
            scale = json.load(open(scale_path)) if os.path.exists(scale_path) else {}
            scale.setdefault("mask_server_ratio", {})[args.gpu_scale_key] = flat["ratio"]
            with open(scale_path, "w") as f:
                json.dump(scale, f, indent=2)


if __name__ == "__main__":
    main()
