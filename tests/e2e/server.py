"""Start and stop a real `fastdeploy serve` process on loopback for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

STARTUP_TIMEOUT_S = 240


_handed_out: set[int] = set()  # ports of servers started here (one may not have bound its port yet)


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


class RunningServer:
    """``RunningServer(*args)`` starts a server and waits until it is healthy; with
    ``wait=False`` it only starts it (`wait_ready` waits), so several can start together."""

    def __init__(self, *args: str, api_key: str | None = None, wait: bool = True) -> None:
        self.port = free_port()
        self.api_key = api_key
        cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli", "serve", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        # The server's output goes to a file the tests can read; FASTDEPLOY_TEST_LOG=1 shows it instead.
        self.log = None if os.environ.get("FASTDEPLOY_TEST_LOG") else tempfile.NamedTemporaryFile(
            "w+", prefix="fastdeploy-server-", suffix=".log")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.started_at = time.monotonic()
        if wait:
            self.wait_ready()

    def openai_client(self):
        """An `openai.OpenAI` client of this server (its API key, or any where none is set)."""
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", timeout=120,
                             max_retries=0)

    def wait_ready(self) -> None:
        deadline = self.started_at + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def worker_process(self) -> psutil.Process:
        """The model worker: the spawned process whose parent is the spawned engine process."""
        for proc in self.descendants():
            parent = proc.parent()
            if "spawn_main" in " ".join(proc.cmdline()) and parent and "spawn_main" in " ".join(parent.cmdline()):
                return proc
        raise LookupError("no worker process found")

    def log_text(self) -> str:
        """Everything the server's processes have logged so far ('' when shown on the console)."""
        if self.log is None:
            return ""
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and " " in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def stop(self, timeout_s: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                for proc in self.descendants():
                    proc.kill()
                self.proc.kill()
                self.proc.wait()
        if self.log:
            self.log.close()
