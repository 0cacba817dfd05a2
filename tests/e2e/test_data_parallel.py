"""`fastdeploy serve --data-parallel-size 2`: two replicas of the embedded model behind one server."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

from tests.e2e.conftest import MODEL
from tests.e2e.server import RunningServer


def _served_by(metrics: dict[str, float], replica: str) -> float:
    return sum(v for k, v in metrics.items()
               if k.startswith("fastdeploy_requests_total{") and f'replica="{replica}"' in k)


def _health(server: RunningServer) -> httpx.Response:
    return httpx.get(f"{server.base_url}/health", timeout=5)


def test_two_replicas_share_requests_report_per_replica_and_survive_a_dead_engine():
    server = RunningServer("--data-parallel-size", "2", "--max-num-seqs", "8", "--num-kv-blocks", "256")
    try:
        client = server.openai_client()

        def ask(i: int) -> str:
            return client.completions.create(model=MODEL, prompt=f"List {i} colours:", max_tokens=12,
                                             temperature=0, extra_body={"ignore_eos": True}).choices[0].text

        with ThreadPoolExecutor(6) as pool:
            first = list(pool.map(ask, range(6)))
        metrics = server.metrics()
        assert _served_by(metrics, "0") >= 1 and _served_by(metrics, "1") >= 1
        assert _served_by(metrics, "0") + _served_by(metrics, "1") == 6
        assert metrics['fastdeploy_replica_up{replica="0"}'] == metrics['fastdeploy_replica_up{replica="1"}'] == 1
        assert 'fastdeploy_kv_cache_usage_ratio{replica="1"}' in metrics

        engines = [p for p in psutil.Process(server.proc.pid).children() if p.children()]
        assert len(engines) == 2, engines  # each replica's engine process starts its worker
        os.kill(engines[0].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while _health(server).status_code == 200 and not _health(server).content:
            assert time.monotonic() - killed_at < 5, "the dead replica was not seen within 5 s"
            time.sleep(0.1)
        degraded = _health(server)
        assert degraded.status_code == 200 and degraded.json()["status"] == "degraded"
        assert ask(3) == first[3]  # the live replica serves, the same greedy answer
        deadline = time.monotonic() + 180
        while _health(server).content and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _health(server).status_code == 200 and not _health(server).content  # restarted
        assert ask(4) == first[4]
    finally:
        server.stop()
