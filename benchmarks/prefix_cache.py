"""Prefix caching through the server: the same loads with caching on and off, in one run.

    python benchmarks/prefix_cache.py [--server-args "..."] [--prefix-tokens 1700] [--ttft-trials 3]
                                      [--grpo-prompts 8] [--grpo-n 8] [--grpo-prompt-tokens 512]
                                      [--grpo-max-tokens 32] [--chats 4] [--turns 4] [--concurrency 16]

Starts `fastdeploy serve` twice on the same model (default: the embedded SmolLM2), once as is
(caching on) and once with `--no-enable-prefix-caching`; both stay up and take turns.

- ttft: a streamed request whose prompt is a fresh long prefix (about --prefix-tokens tokens)
  plus a question, then a second one with the same prefix and another question; time to the
  first token of each (the first event with a token id), per trial (medians over
  --ttft-trials); also the time to the first non-empty text (`text_ttft_*`).
- grpo: --grpo-prompts prompts of about --grpo-prompt-tokens tokens, each sampled --grpo-n
  times (`n`, temperature 1), --grpo-max-tokens tokens out (EOS ignored), --concurrency
  requests in flight: output tok/s.
- chat: --chats conversations of --turns turns, run side by side; each turn resends the whole
  conversation (the system prompt, every earlier question and answer) with a new question:
  wall time and mean time to first token.

The GPU figures of the issue (64 prompts of 1,024 tokens, n = 8, 256 tokens; a 4,096-token
prefix) take e.g. `--server-args "qwen7b --load-format dummy --device cuda" --grpo-prompts 64
--grpo-prompt-tokens 1024 --grpo-max-tokens 256 --prefix-tokens 4096 --concurrency 64`.

Writes benchmarks/results/prefix_cache.json (or --name) and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
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

WORDS = ("river stone garden lantern harbor meadow copper violet thunder orchard canyon ember glacier "
         "falcon willow compass anchor prairie beacon summit").split()


def long_text(seed: int, approx_tokens: int) -> str:
    """Plain prose of about `approx_tokens` tokens (about one token per word), distinct per seed."""
    words = [WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(approx_tokens)]
    return f"Document {seed}. " + " ".join(words) + "."


async def first_token_s(client: httpx.AsyncClient, server: Server, prompt: str,
                        max_tokens: int = 4) -> tuple[float, float]:
    """Seconds to the first streamed token (the first event carrying a token id) and to the
    first non-empty text. They differ when a token has no text of its own: a byte of a
    multi-byte character, or, with dummy weights and another model's tokenizer, an id past
    that tokenizer's vocabulary."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}
    start = time.perf_counter()
    first: float | None = None
    first_text: float | None = None
    async with client.stream("POST", server.base + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            now = time.perf_counter() - start
            if first is None and choice.get("token_ids"):
                first = now
            if first_text is None and choice.get("text"):
                first_text = now
    return (float("nan") if first is None else first), (float("nan") if first_text is None else first_text)


async def ttft_load(server: Server, trials: int, prefix_tokens: int, seed0: int) -> dict:
    firsts, repeats, text_firsts, text_repeats = [], [], [], []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for t in range(trials):
            prefix = long_text(seed0 + t, prefix_tokens)
            token_s, text_s = await first_token_s(client, server, prefix + " Question: what is it about?")
            firsts.append(token_s)
            text_firsts.append(text_s)
            token_s, text_s = await first_token_s(client, server, prefix + " Question: who wrote it?")
            repeats.append(token_s)
            text_repeats.append(text_s)
    return {"ttft_first_s": statistics.median(firsts), "ttft_repeat_s": statistics.median(repeats),
            "ttft_ratio": statistics.median(r / f for r, f in zip(repeats, firsts, strict=True)),
            "ttft_trials_s": {"first": firsts, "repeat": repeats},
            "text_ttft_first_s": statistics.median(text_firsts), "text_ttft_repeat_s": statistics.median(text_repeats)}


async def grpo_load(server: Server, args: argparse.Namespace, seed0: int) -> dict:
    limit = asyncio.Semaphore(args.concurrency)
    tokens = 0

    async def group(client: httpx.AsyncClient, p: int) -> None:
        nonlocal tokens
        prompt = long_text(seed0 + p, args.grpo_prompt_tokens) + f" Summarise it, thinking of {TOPICS[p % 10]}."
        body = {"model": server.model, "prompt": prompt, "n": args.grpo_n, "max_tokens": args.grpo_max_tokens,
                "temperature": 1.0, "ignore_eos": True, "seed": p}
        async with limit:
            resp = await client.post(server.base + "/v1/completions", json=body)
        resp.raise_for_status()
        tokens += resp.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0),
                                 limits=httpx.Limits(max_connections=args.concurrency + 4)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(group(client, p) for p in range(args.grpo_prompts)))
        wall = time.perf_counter() - start
    return {"grpo_tokens": tokens, "grpo_wall_s": wall, "grpo_tok_s": tokens / wall}


async def chat_load(server: Server, args: argparse.Namespace, seed0: int) -> dict:
    ttfts: list[float] = []

    async def conversation(client: httpx.AsyncClient, c: int) -> None:
        messages = [{"role": "system", "content": long_text(seed0 + c, 300)}]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": f"Question {turn}: say something about {TOPICS[turn]}."})
            body = {"model": server.model, "messages": messages, "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            start = time.perf_counter()
            first, text = None, []
            async with client.stream("POST", server.base + "/v1/chat/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    content = json.loads(line[6:])["choices"][0]["delta"].get("content")
                    if content:  # the first chunk carries only the role
                        first = first if first is not None else time.perf_counter() - start
                        text.append(content)
            ttfts.append(first if first is not None else float("nan"))
            messages.append({"role": "assistant", "content": "".join(text)})

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(conversation(client, c) for c in range(args.chats)))
        wall = time.perf_counter() - start
    return {"chat_wall_s": wall, "chat_mean_ttft_s": statistics.mean(ttfts)}


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    names = [r["caching"] for r in rows]
    for ax, key, title in zip(axes, ("ttft_repeat_s", "grpo_tok_s", "chat_wall_s"),
                              ("TTFT of a repeated prefix (s)", "GRPO load, output tok/s", "multi-turn chat, wall s"),
                              strict=True):
        values = [r[key] for r in rows]
        ax.bar(names, values, color=["#4c72b0", "#dd8452"])
        ax.set_title(title, fontsize=8)
        for x, v in enumerate(values):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server-args", default="", help="extra `fastdeploy serve` arguments, one string")
    ap.add_argument("--prefix-tokens", type=int, default=1700)
    ap.add_argument("--ttft-trials", type=int, default=3)
    ap.add_argument("--grpo-prompts", type=int, default=8)
    ap.add_argument("--grpo-n", type=int, default=8)
    ap.add_argument("--grpo-prompt-tokens", type=int, default=512)
    ap.add_argument("--grpo-max-tokens", type=int, default=32)
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--name", default="prefix_cache")
    args = ap.parse_args()

    info = machine_info()
    print_machine(info)
    extra = shlex.split(args.server_args)
    log_dir = os.path.join(RESULTS_DIR, "logs")
    os.makedirs(log_dir, exist_ok=True)
    servers: dict[str, Server] = {}
    rows = []
    try:
        for name, flag in (("on", []), ("off", ["--no-enable-prefix-caching"])):
            cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli", "serve", "--port", str(port := free_port()),
                   "--max-model-len", str(max(4096, args.prefix_tokens * 2)), *flag, *extra]
            servers[name] = Server(f"{args.name}-{name}", cmd, "/health", {}, port)
            servers[name].start(os.path.join(log_dir, f"{args.name}-{name}.log"), timeout_s=900)
        # Each server sees the same prompts; distinct seeds per load keep the loads from
        # sharing prefixes with each other.
        for name, server in servers.items():
            # A long prompt and a GRPO-shaped burst first, untimed: a server's first long prefill
            # and first batch sizes pay one-time costs (kernel compilation and autotuning).
            asyncio.run(ttft_load(server, 1, args.prefix_tokens, 9000))
            asyncio.run(grpo_load(server, argparse.Namespace(**{**vars(args), "grpo_prompts": 2}), 9500))
            row = {"caching": name}
            row.update(asyncio.run(ttft_load(server, args.ttft_trials, args.prefix_tokens, 1000)))
            row.update(asyncio.run(grpo_load(server, args, 2000)))
            row.update(asyncio.run(chat_load(server, args, 3000)))
            rows.append(row)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    on, off = rows
    summary = {"ttft_repeat_over_first_on": on["ttft_ratio"], "ttft_repeat_on_over_off": on["ttft_repeat_s"]
               / off["ttft_repeat_s"], "grpo_speedup": on["grpo_tok_s"] / off["grpo_tok_s"],
               "chat_speedup": off["chat_wall_s"] / on["chat_wall_s"]}
    print_table(rows, ["caching", "ttft_first_s", "ttft_repeat_s", "ttft_ratio", "grpo_tok_s", "chat_wall_s",
                       "chat_mean_ttft_s"])
    print({k: round(v, 3) for k, v in summary.items()})
    path = write_json(args.name, {"machine": info, "args": vars(args), "rows": rows, "summary": summary})
    plot(rows, png_path(args.name))
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()
