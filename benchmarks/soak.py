"""Soak: many concurrent mixed-feature streams, some clients hanging up mid-stream, several rounds.

    python benchmarks/soak.py [--streams 256] [--rounds 3] [--disconnect 0.1] [--max-tokens 32]
                              [--max-num-seqs 64]

Starts a server with sampling masks and n-gram speculation, then sends rounds of
`--streams` concurrent streaming requests, each one of five kinds: greedy chat with
logprobs, sampled chat with sampling masks, greedy chat constrained to a JSON schema,
greedy completions with stop strings, seeded chat with n = 2. A `--disconnect` share
of the clients closes its connection after the third chunk. After each round it checks:

- every request not hung up on ended with a finish reason on each choice, no error and `[DONE]`;
- the server drained: no request running or waiting, KV cache usage 0;
- the API server's, engine's and worker's resident memory (summed), per round;

and at the end: the RSS of the last round within 10 % of the round before it, and each
greedy request's text equal to the same request sent alone. Exit status 1 on a failed check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import tree_rss_mb  # noqa: E402

KINDS = ("greedy_logprobs", "sampled_mask", "greedy_json", "greedy_stop", "seeded_n2")
JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"]}
TOPICS = ["a lighthouse", "a lost umbrella", "the first snow", "a robot gardener", "an old map", "a quiet library",
          "a bridge at night", "a paper boat", "a desert well", "a broken clock", "a red kite", "a night train"]
RSS_TOLERANCE = 0.10


@dataclass
class Spec:
    """One request of a round: the same specs are sent every round."""

    index: int
    kind: str
    path: str
    body: dict
    greedy: bool
    hang_up_after: int | None  # chunks read before the client closes its connection; None: read to the end

    @property
    def choices(self) -> int:
        return self.body.get("n", 1)


@dataclass
class Outcome:
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    error: str | None = None
    done: bool = False
    hung_up: bool = False


def make_specs(streams: int, disconnect: float, max_tokens: int) -> list[Spec]:
    # Exactly that share hangs up, drawn the same every run and scattered over the kinds.
    hang_ups = set(random.Random(0).sample(range(streams), round(streams * disconnect)))
    specs = []
    for i in range(streams):
        kind = KINDS[i % len(KINDS)]
        topic = TOPICS[i % len(TOPICS)]
        chat = [{"role": "user", "content": f"Write two sentences about {topic} (request {i})."}]
        base = {"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        if kind == "greedy_logprobs":
            path, body = "/v1/chat/completions", {"messages": chat, "temperature": 0, "logprobs": True,
                                                  "top_logprobs": 3}
        elif kind == "sampled_mask":
            path, body = "/v1/chat/completions", {"messages": chat, "temperature": 0.8, "top_k": 40, "seed": i,
                                                  "return_sampling_mask": True}
        elif kind == "greedy_json":
            path, body = "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"Give a JSON record for a person who likes {topic}."}],
                "temperature": 0, "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "person", "schema": JSON_SCHEMA}}}
        elif kind == "greedy_stop":
            path, body = "/v1/completions", {"prompt": f"A list of facts about {topic}:\n1.", "temperature": 0,
                                             "stop": ["\n3.", "###"]}
        else:
            path, body = "/v1/chat/completions", {"messages": chat, "temperature": 0.7, "seed": 1000 + i, "n": 2}
        hang_up = 3 if i in hang_ups else None
        specs.append(Spec(i, kind, path, {**base, **body}, kind.startswith("greedy"), hang_up))
    return specs


async def run_one(client: httpx.AsyncClient, base_url: str, spec: Spec) -> Outcome:
    out = Outcome()
    chunks = 0
    try:
        async with client.stream("POST", base_url + spec.path, json=spec.body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = json.dumps(event["error"])[:300]
                    continue
                for choice in event.get("choices", []):
                    i = choice["index"]
                    text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                    out.texts[i] = out.texts.get(i, "") + (text or "")
                    out.finish.setdefault(i, None)
                    if choice.get("finish_reason") is not None:
                        out.finish[i] = choice["finish_reason"]
                chunks += 1
                if spec.hang_up_after is not None and chunks >= spec.hang_up_after:
                    out.hung_up = True
                    return out  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def failure(spec: Spec, out: Outcome) -> str | None:
    """Why a request that was read to its end did not complete, or None."""
    if out.hung_up:
        return None
    if out.error is not None:
        return out.error
    if not out.done:
        return "no [DONE]"
    if sorted(out.finish) != list(range(spec.choices)) or any(r is None for r in out.finish.values()):
        return f"choices without a finish reason: {out.finish}"
    return None


async def run_round(base_url: str, headers: dict, specs: list[Spec], concurrency: int) -> list[Outcome]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(900.0), limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def gated(spec: Spec) -> Outcome:
            async with gate:
                return await run_one(client, base_url, spec)

        return await asyncio.gather(*(gated(s) for s in specs))


def server_metrics(base_url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def wait_drained(base_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The metrics once nothing runs, waits or holds KV blocks (or at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server_metrics(base_url)
        if (m["fastdeploy_num_requests_running"] == 0 and m["fastdeploy_num_requests_waiting"] == 0
                and m["fastdeploy_kv_cache_usage_ratio"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


@dataclass
class SoakReport:
    rounds: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def soak(base_url: str, api_key: str | None, server_pid: int, specs: list[Spec], rounds: int,
         concurrency: int | None = None) -> SoakReport:
    """Run `rounds` rounds of `specs` and every check of the module docstring."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    concurrency = concurrency or len(specs)
    report = SoakReport()
    greedy = [s for s in specs if s.greedy]
    # Reference: each greedy request alone, read to its end.
    alone_specs = [Spec(s.index, s.kind, s.path, s.body, True, None) for s in greedy]
    alone_outcomes = asyncio.run(run_round(base_url, headers, alone_specs, 1))
    alone = {s.index: o for s, o in zip(alone_specs, alone_outcomes, strict=True)}
    for s in alone_specs:
        if (why := failure(s, alone[s.index])) is not None:
            report.failures.append(f"alone #{s.index} ({s.kind}): {why}")
    for r in range(rounds):
        started = time.monotonic()
        outcomes = asyncio.run(run_round(base_url, headers, specs, concurrency))
        wall = time.monotonic() - started
        for spec, out in zip(specs, outcomes, strict=True):
            if (why := failure(spec, out)) is not None:
                report.failures.append(f"round {r + 1} #{spec.index} ({spec.kind}): {why}")
            elif spec.greedy and not out.hung_up and out.texts != alone[spec.index].texts:
                report.failures.append(f"round {r + 1} #{spec.index} ({spec.kind}): greedy text differs from the "
                                       f"request alone: {out.texts!r} vs {alone[spec.index].texts!r}")
        m = wait_drained(base_url)
        if m["fastdeploy_num_requests_running"] or m["fastdeploy_num_requests_waiting"] \
                or m["fastdeploy_kv_cache_usage_ratio"]:
            report.failures.append(f"round {r + 1}: not drained: running {m['fastdeploy_num_requests_running']}, "
                                   f"waiting {m['fastdeploy_num_requests_waiting']}, "
                                   f"KV usage {m['fastdeploy_kv_cache_usage_ratio']}")
        report.rounds.append({"round": r + 1, "streams": len(specs), "wall_s": round(wall, 1),
                              "hung_up": sum(o.hung_up for o in outcomes),
                              "completed": sum(o.done and not o.hung_up for o in outcomes),
                              "rss_mb": round(tree_rss_mb(server_pid), 1)})
    if rounds >= 3:
        before, last = report.rounds[-2]["rss_mb"], report.rounds[-1]["rss_mb"]
        if abs(last - before) > RSS_TOLERANCE * before:
            report.failures.append(f"RSS moved from {before} MiB to {last} MiB between the last two rounds "
                                   f"(more than {RSS_TOLERANCE:.0%})")
    return report


def main() -> None:
    from benchmarks.common import free_port, machine_info, print_machine, print_table, write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--disconnect", type=float, default=0.1, help="share of clients that hang up mid-stream")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    # A SIGTERM unwinds like an exception, so that the server started below is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))

    port = free_port()
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli", "serve", "--port", str(port),
           "--enable-keep-sampling-mask", "--max-num-seqs", str(args.max_num_seqs),
           "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4})]
    base_url = f"http://127.0.0.1:{port}"
    import subprocess

    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(results, exist_ok=True)
    log = open(os.path.join(results, "soak_server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start; see {log.name}")
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        info = machine_info()
        print_machine(info)
        specs = make_specs(args.streams, args.disconnect, args.max_tokens)
        report = soak(base_url, None, proc.pid, specs, args.rounds)
        print_table(report.rounds, ["round", "streams", "wall_s", "completed", "hung_up", "rss_mb"])
        for line in report.failures[:50]:
            print("FAIL", line)
        print("all checks passed" if report.ok else f"{len(report.failures)} failed checks")
        write_json("soak", {"machine": info, "args": vars(args), "rounds": report.rounds,
                            "failures": report.failures})
    finally:
        proc.terminate()
        proc.wait(30)
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
