"""Greedy answers through the server with and without speculation, token by token, with the margin
where they part.

    python benchmarks/server_exactness.py [--device cuda] [--clients 64] [--requests 128] [--max-tokens 256]

Starts the flag-off embedded server and one per `--specs` configuration (gpu_scale.py's: MTP with
2 drafts, n-gram with 4), sends each `--requests` greedy chat requests (gpu_scale.py's copying
prompts, EOS ignored, `logprobs` with the top 2) from `--clients` clients, and the flag-off server
the same load twice. A greedy answer is a function of the target's logits, so an answer that
parts from flag-off's is either a numerical near-tie (the two top tokens' logprobs closer than the
rounding of a bf16 step whose shape differs: another batch, a verify step's rows) or a defect.
Each parting is reported with its position and the top-2 margin both servers saw there; the
flag-off server against itself gives the floor, what batching alone changes.

Writes benchmarks/results/server_exactness[_<device>].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine_info, print_machine, print_table, write_json  # noqa: E402
from benchmarks.gpu_scale import SPECS, copy_bodies, embedded_serve_args, send_all  # noqa: E402
from benchmarks.serving import Server, fastdeploy_server  # noqa: E402


def token_runs(server: Server, bodies: list[dict], clients: int, timeout_s: float) -> list[list[dict]]:
    """Per request, its tokens with their logprob and top-2 (the OpenAI `logprobs.content` entries)."""
    replies, _ = asyncio.run(asyncio.wait_for(send_all(server, bodies, clients, timeout_s), timeout_s))
    return [r["choices"][0]["logprobs"]["content"] for r in replies]


def margin(entry: dict) -> float | None:
    """Top-1 minus top-2 logprob at one position (None without two alternatives)."""
    top = sorted((t["logprob"] for t in entry.get("top_logprobs") or []), reverse=True)
    return top[0] - top[1] if len(top) >= 2 else None


def partings(reference: list[list[dict]], other: list[list[dict]]) -> list[dict[str, Any]]:
    """For each request whose tokens differ: the first differing position and what each side saw."""
    out = []
    for i, (a, b) in enumerate(zip(reference, other, strict=True)):
        # zip stops at the shorter answer: a length difference alone parts them at its end
        pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x["token"] != y["token"]), None)
        if pos is None and len(a) == len(b):
            continue
        pos = pos if pos is not None else min(len(a), len(b))
        ea, eb = (a[pos] if pos < len(a) else {}), (b[pos] if pos < len(b) else {})
        out.append({"request": i, "position": pos, "tokens": [ea.get("token"), eb.get("token")],
                    "reference_margin": margin(ea) if ea else None, "other_margin": margin(eb) if eb else None,
                    "reference_top2": ea.get("top_logprobs"), "other_top2": eb.get("top_logprobs"),
                    # the logprob each side gave its own token: equal up to rounding on a near-tie
                    "logprobs": [ea.get("logprob"), eb.get("logprob")]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--specs", nargs="+", choices=list(SPECS), default=list(SPECS))
    ap.add_argument("--timeout-s", type=float, default=240.0, help="bound on each load")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    info = machine_info()
    print_machine(info)
    serve = embedded_serve_args(args.device, max(64, args.clients))
    servers = {"off": fastdeploy_server("off", serve)}
    for name in args.specs:
        servers[name] = fastdeploy_server(name, [*serve, "--speculative-config", json.dumps(SPECS[name])])
    bodies = [{**b, "logprobs": True, "top_logprobs": 2} for b in copy_bodies(args.requests, args.max_tokens)]
    logs = tempfile.mkdtemp(prefix="server_exactness_")
    rows, details = [], {}
    try:
        for name, server in servers.items():
            server.start(os.path.join(logs, f"{name}.log"))
        for server in servers.values():  # warm-up: the load's shapes once
            token_runs(server, bodies[:args.clients], args.clients, args.timeout_s)
        runs = {"off": token_runs(servers["off"], bodies, args.clients, args.timeout_s)}
        for name in args.specs:
            runs[name] = token_runs(servers[name], bodies, args.clients, args.timeout_s)
        runs["off_again"] = token_runs(servers["off"], bodies, args.clients, args.timeout_s)
        for name in ["off_again", *args.specs]:
            parted = partings(runs["off"], runs[name])
            details[name] = parted
            margins = [p["reference_margin"] for p in parted if p["reference_margin"] is not None]
            rows.append({"against_off": name, "requests": len(bodies), "identical": len(bodies) - len(parted),
                         "largest_margin_at_parting": max(margins) if margins else None,
                         "positions": ",".join(str(p["position"]) for p in parted) or "-"})
    finally:
        for server in servers.values():
            server.stop()
    print_table(rows, ["against_off", "requests", "identical", "largest_margin_at_parting", "positions"])
    for name, parted in details.items():
        for p in parted:
            print(name, {k: p[k] for k in ("request", "position", "tokens", "reference_margin", "other_margin",
                                           "logprobs")})
    device = args.device.split(":")[0]
    path = write_json(args.name or f"server_exactness_{device}", {
        "machine": info, "settings": vars(args), "specs": {n: SPECS[n] for n in args.specs}, "rows": rows,
        "partings": details})
    print(path)


if __name__ == "__main__":
    main()
