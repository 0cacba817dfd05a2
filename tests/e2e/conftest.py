from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.e2e.server import RunningServer

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
SPEC_API_KEY = "spec-key"
# Every decoding sequence drafts 4 tokens a step (not the adaptive policy), so what the tests
# check of drafting and acceptance does not hang on what the policy learned from earlier traffic
# (the soak's short answers, which rarely match the prompt, teach it to stop drafting).
SPEC_CONFIG = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})

# Every server the e2e tests share, by the fixture that hands it out: (arguments, API key).
SERVERS = {
    "server": (("--max-num-seqs", "40", "--max-model-len", "1024", "--num-kv-blocks", "2048"), API_KEY),
    "reasoning_server": (("--reasoning-parser", "think", "--max-num-seqs", "4", "--max-model-len", "512",
                          "--num-kv-blocks", "128"), API_KEY),
    # Steps overlapped as on CUDA (asynchronous scheduling): masks, n > 1, JSON mode and bad
    # input through an engine that sends each step before it reads the one ahead.
    "mask_server": (("--enable-keep-sampling-mask", "--max-num-seqs", "16", "--num-kv-blocks", "512",
                     "--async-scheduling", "on"), None),
    "spec_server": (("--max-num-seqs", "8", "--max-model-len", "1024", "--enable-keep-sampling-mask",
                     "--speculative-config", SPEC_CONFIG), SPEC_API_KEY),
    # MTP with steps overlapped as on CUDA: verify steps and their drafts sent ahead.
    "mtp_server": (("--max-num-seqs", "4", "--max-model-len", "1024", "--enable-keep-sampling-mask",
                    "--num-kv-blocks", "256", "--async-scheduling", "on", "--speculative-config",
                    json.dumps({"method": "mtp", "num_speculative_tokens": 2})), None),
    # n-gram (adaptive) with steps overlapped: its verify steps sent ahead, lookups on the device.
    "ngram_ahead_server": (("--max-num-seqs", "4", "--max-model-len", "1024", "--enable-keep-sampling-mask",
                            "--num-kv-blocks", "256", "--async-scheduling", "on", "--speculative-config",
                            json.dumps({"method": "ngram", "num_speculative_tokens": 3})), None),
    # test_lifecycle.py: one server per test, each taken down by its test.
    "killed_worker_server": (("--max-num-seqs", "8", "--enable-keep-sampling-mask"), None),
    "sigterm_server": (("--max-num-seqs", "4"), None),
    # test_api_processes.py: two API processes in front of one engine; the test takes it down.
    "api_processes_server": (("--api-server-count", "2", "--max-num-seqs", "16", "--num-kv-blocks", "512"), None),
}
# A start-up keeps about one core busy: servers of one group start together, in pairs, and the
# tests run once every server of the pair is healthy (nothing else is starting beside them).
GROUPS = [("killed_worker_server", "sigterm_server"), ("server", "reasoning_server"), ("mask_server", "spec_server"),
          ("api_processes_server",), ("mtp_server", "ngram_ahead_server")]


class ServerLauncher:
    """Starts each server the selected tests need when the first of its group is asked for,
    together with the rest of its group; `take` hands one over to the fixture that stops it."""

    def __init__(self, needed: set[str]) -> None:
        self.needed = needed
        self.ready: dict[str, RunningServer] = {}
        self.failed: dict[str, BaseException] = {}

    def take(self, name: str) -> RunningServer:
        if name not in self.ready and name not in self.failed:
            group = next(g for g in GROUPS if name in g)
            batch = [n for n in group if n == name or (n in self.needed and n not in self.ready)]
            started = {}
            for n in batch:
                args, api_key = SERVERS[n]
                try:
                    started[n] = RunningServer(*args, api_key=api_key, wait=False)
                except BaseException as exc:  # noqa: BLE001 - reported by its own fixture
                    self.failed[n] = exc
            for n, srv in started.items():
                try:
                    srv.wait_ready()
                    self.ready[n] = srv
                except BaseException as exc:  # noqa: BLE001 - reported by its own fixture
                    self.failed[n] = exc
        if name in self.failed:
            raise self.failed.pop(name)
        return self.ready.pop(name)

    def serve(self, name: str) -> Iterator[RunningServer]:
        """A fixture's body: the server `name`, stopped when the fixture ends."""
        srv = self.take(name)
        yield srv
        srv.stop()

    def stop_all(self) -> None:
        for srv in self.ready.values():
            srv.stop()
        self.ready.clear()


@pytest.fixture(scope="package")
def server_launcher(request):
    needed = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    launcher = ServerLauncher(needed)
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="package")
def server(server_launcher):
    yield from server_launcher.serve("server")


@pytest.fixture(scope="package")
def spec_server(server_launcher):
    """ngram drafts, 4 a step, with sampling masks: test_soak.py and test_speculative.py."""
    yield from server_launcher.serve("spec_server")


@pytest.fixture(scope="package")
def mtp_server(server_launcher):
    """MTP (the shipped head, adaptive) with asynchronous scheduling and sampling masks."""
    yield from server_launcher.serve("mtp_server")


@pytest.fixture(scope="package")
def ngram_ahead_server(server_launcher):
    """n-gram (adaptive, 3 drafts) with asynchronous scheduling and sampling masks."""
    yield from server_launcher.serve("ngram_ahead_server")


@pytest.fixture(scope="package")
def client(server):
    return server.openai_client()


@pytest.fixture
def async_client(server):
    """A fresh client per test: its connection pool belongs to the test's own event loop."""
    import openai

    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, timeout=300, max_retries=0)
