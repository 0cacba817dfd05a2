"""A server with two API processes (`--api-server-count 2`) in front of one engine: both accept on
the one port, each request's tokens reach the process that serves it (and only that one), the
counters on /metrics are the sums of both, and when an API process dies the launcher stops the
whole server, leaving no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import psutil
import pytest

from fastdeploy.entrypoints.openai.api_server import make_parser, run_server

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [f"Name a colour and a number, please ({i})." for i in range(8)]


@pytest.fixture
def api_processes_server(server_launcher):
    yield from server_launcher.serve("api_processes_server")


def _api_processes(server) -> list[psutil.Process]:
    """The launcher's children that accept on the server's port."""
    found = []
    for child in psutil.Process(server.proc.pid).children():
        try:
            if any(c.laddr.port == server.port and c.status == psutil.CONN_LISTEN for c in child.net_connections()):
                found.append(child)
        except psutil.Error:
            pass
    return found


async def _stream_text(client: openai.AsyncOpenAI, prompt: str) -> str:
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=24, temperature=0, stream=True)
    return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])


def test_two_api_processes_serve_every_stream_whole_and_sum_their_counters(api_processes_server):
    server = api_processes_server
    api = _api_processes(server)
    assert len(api) == 2, [p.cmdline() for p in psutil.Process(server.proc.pid).children()]
    before = [p.cpu_times().user + p.cpu_times().system for p in api]

    async def load() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120, max_retries=0)
        alone = [await _stream_text(client, p) for p in PROMPTS]  # one at a time
        together = await asyncio.gather(*(_stream_text(client, p) for p in PROMPTS * 4))  # 32 at once
        return alone, together

    alone, together = asyncio.run(load())
    assert all(alone)
    # Greedy: each of the 32 concurrent streams holds exactly its own prompt's answer.
    assert together == alone * 4
    used = [p.cpu_times().user + p.cpu_times().system - b for p, b in zip(api, before, strict=True)]
    assert all(u > 0.05 for u in used), used  # both processes served streams
    metrics = server.metrics()
    finished = sum(v for k, v in metrics.items() if k.startswith("fastdeploy_requests_total{"))
    assert finished == len(PROMPTS) * 5, metrics
    deadline = time.monotonic() + 10  # the engines' gauges: from the engine's once-a-second report
    while server.metrics()["fastdeploy_num_requests_running"] != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.metrics()["fastdeploy_num_requests_running"] == 0

    # One API process dies: the launcher stops the server and every process in it.
    descendants = psutil.Process(server.proc.pid).children(recursive=True)
    os.kill(api[1].pid, signal.SIGKILL)
    assert server.proc.wait(timeout=60) == 1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                              for p in descendants):
        time.sleep(0.2)
    assert not [p.pid for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert "API process 1 exited; stopping the server" in server.log_text()


@pytest.mark.parametrize("argv, message", [
    (["--api-server-count", "0"], "--api-server-count must be at least 1"),
    (["--api-server-count", "2", "--data-parallel-size", "2", "--data-parallel-backend", "ray"],
     "use --data-parallel-backend mp"),
])
def test_api_server_count_refuses_what_it_cannot_run(argv, message):
    with pytest.raises(SystemExit, match=message):
        run_server(make_parser().parse_args(argv))
