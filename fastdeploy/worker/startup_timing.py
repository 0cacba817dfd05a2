"""Where a worker's start-up time goes, phase by phase, for one log line when it is ready.

A server's time to ready is mostly the worker's: weights, KV sizing, CUDA graph capture,
kernel compilation inside the warm-ups. The line names each phase's seconds, so a slow start
points at its cause without a profiler.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StartupTimes:
    def __init__(self) -> None:
        self._began = time.perf_counter()
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def summary(self) -> str:
        total = time.perf_counter() - self._began
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())
        return f"worker ready in {total:.1f} s ({parts})"
