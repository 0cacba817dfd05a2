"""Failure and shutdown: a killed worker fails requests promptly (a body already going out is cut
short); SIGTERM leaves no processes."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest

BODY = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "return_sampling_mask": False}
# Large bitmap masks: the non-streaming body goes out while the request runs (docs/sampling.md).
PROGRESSIVE = {**BODY, "return_sampling_mask": True, "sampling_mask_format": "bitmap", "temperature": 1.5,
               "top_p": 0.99}


# Each test takes its own server down; the two start together (conftest.py, `ServerLauncher`).
@pytest.fixture
def killed_worker_server(server_launcher):
    yield from server_launcher.serve("killed_worker_server")


@pytest.fixture
def sigterm_server(server_launcher):
    yield from server_launcher.serve("sigterm_server")


def test_killed_worker_fails_in_flight_requests_and_health_then_sigterm_cleans_up(killed_worker_server):
    server = killed_worker_server
    try:
        results: dict[str, tuple[float, object]] = {}

        def non_stream() -> None:
            r = httpx.post(f"{server.base_url}/v1/completions", json=BODY, timeout=60)
            results["non_stream"] = (time.monotonic(), r.status_code, r.json())

        def stream() -> None:
            events = []
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**BODY, "stream": True},
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            results["stream"] = (time.monotonic(), r.status_code, events)

        body_started = threading.Event()

        def progressive() -> None:
            try:
                with httpx.stream("POST", f"{server.base_url}/v1/completions", json=PROGRESSIVE, timeout=60) as r:
                    body_started.set()
                    r.read()
                results["progressive"] = (time.monotonic(), r.status_code, "whole body")
            except httpx.RemoteProtocolError as exc:
                results["progressive"] = (time.monotonic(), r.status_code, str(exc))

        threads = [threading.Thread(target=f) for f in (non_stream, stream, progressive)]
        for t in threads:
            t.start()
        assert body_started.wait(timeout=60), "the bitmap answer's body never started"
        deadline = time.monotonic() + 30
        while server.metrics()["fastdeploy_num_requests_running"] < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        worker = server.worker_process()
        killed_at = time.monotonic()
        worker.kill()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a client hung after the worker died"

        done_at, status, body = results["non_stream"]
        assert done_at - killed_at < 5.0
        assert status == 503 and "error" in body
        done_at, status, events = results["stream"]
        assert done_at - killed_at < 5.0
        assert events[-1] == "[DONE]" and '"error"' in events[-2]
        # Its status went out with the first block: the body is cut short, never completed.
        done_at, status, outcome = results["progressive"]
        assert done_at - killed_at < 5.0
        assert status == 200 and outcome != "whole body"

        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 503
        r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        children = server.descendants()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=20)
        gone, alive = psutil.wait_procs(children, timeout=10)
        server.stop()
    assert not alive, f"processes left after SIGTERM: {alive}"


def test_sigterm_with_requests_in_flight_stops_every_process(sigterm_server):
    server = sigterm_server
    children = server.descendants()
    assert len(children) >= 2  # the engine and the worker
    thread = threading.Thread(
        target=lambda: httpx.post(f"{server.base_url}/v1/completions", json=BODY, timeout=60), daemon=True)
    thread.start()
    time.sleep(2)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) is not None
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"processes left after SIGTERM: {alive}"
