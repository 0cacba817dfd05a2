"""Asynchronous grammar compilation: the grammar backends behind one thread pool and one cache,
polled without blocking by the worker's step loop."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from fastdeploy.common.guided_spec import GuidedSpec
from fastdeploy.model_executor.guided_decoding.backend import CompiledGrammar, GrammarBackend

__all__ = ["GrammarCompileService", "build_backend"]


def build_backend(name: str, tokenizer, vocab_size: int | None = None, stop_token_ids: list[int] | None = None,
                  compiler_threads: int | None = None) -> GrammarBackend:
    """A backend by name for a HF tokenizer.

    vocab_size: the model's logits width, which may exceed len(tokenizer) (padded embedding
        tables); ids past the tokenizer's are then never allowed. None = len(tokenizer).
    stop_token_ids: tokens that end a constrained output; None = the tokenizer's eos.
    """
    if name == "xgrammar":
        from fastdeploy.model_executor.guided_decoding.xgrammar_backend import XGrammarBackend

        return XGrammarBackend.from_tokenizer(tokenizer, vocab_size, stop_token_ids, compiler_threads=compiler_threads)
    if name == "llguidance":
        from fastdeploy.model_executor.guided_decoding.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend.from_tokenizer(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"unknown grammar backend {name!r}")


class _Cache:
    """Compiled grammars by spec, least recently used evicted past a byte budget. Thread-safe:
    the pool's threads fill it while the step loop reads it."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.size_bytes = 0
        self._items: OrderedDict[GuidedSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, spec: GuidedSpec) -> CompiledGrammar | None:
        with self._lock:
            compiled = self._items.get(spec)
            if compiled is not None:
                self._items.move_to_end(spec)
            return compiled

    def put(self, spec: GuidedSpec, compiled: CompiledGrammar) -> None:
        with self._lock:
            if spec in self._items:
                return
            self._items[spec] = compiled
            self.size_bytes += compiled.memory_bytes
            while self.size_bytes > self.limit_bytes and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                self.size_bytes -= old.memory_bytes


@dataclass
class _Job:
    """One compile in flight, shared by every key that asked for the same spec."""

    keys: set[int]
    future: Future | None = None
    started: float | None = None  # set by the pool thread when the compile begins
    timed_out: bool = False


class GrammarCompileService:
    """Compiles GuidedSpecs in the background; the caller polls for results.

    Each spec compiles on the backend it names (`spec.backend`; "" = the first backend
    given), behind one ThreadPoolExecutor and one cache of compiled grammars: an identical
    spec compiles once. Both backends release the GIL while compiling, so the step loop
    keeps running. Identical specs in flight at the same time also share one compile.

    Timeouts: neither backend can interrupt a compile, so a compile running longer than
    `timeout_s` is *reported* failed, and its thread runs on to completion in the
    background (the result lands in the cache). Its spec stays marked: a resubmission
    while it still runs fails at once instead of starting a second copy.
    `num_abandoned` counts such threads.

    Not thread-safe: call submit / poll / cancel from one thread (the step loop).
    """

    def __init__(
        self,
        backends: GrammarBackend | Sequence[GrammarBackend],
        *,
        max_workers: int = 2,
        timeout_s: float = 30.0,
        cache_limit_bytes: int = 512 << 20,
    ) -> None:
        """max_workers: grammars compiled concurrently."""
        backends = [backends] if not isinstance(backends, Sequence) else list(backends)
        self.backends: dict[str, GrammarBackend] = {b.name: b for b in backends}
        self.default_backend = backends[0].name
        self.vocab_size: int = backends[0].vocab_size
        if any(b.vocab_size != self.vocab_size for b in backends):
            raise ValueError("grammar backends disagree on the vocabulary size")
        self.timeout_s = timeout_s
        self._cache = _Cache(cache_limit_bytes)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._jobs: dict[GuidedSpec, _Job] = {}
        self._key_spec: dict[int, GuidedSpec] = {}

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None, *, backends: Sequence[str] = ("xgrammar",),
                       stop_token_ids: list[int] | None = None, compiler_threads: int | None = None,
                       **kwargs) -> GrammarCompileService:
        """Build the named backends for a HF tokenizer (see build_backend)."""
        return cls([build_backend(name, tokenizer, vocab_size, stop_token_ids, compiler_threads) for name in backends],
                   **kwargs)

    # -- synchronous -------------------------------------------------------------------

    def _pinned(self, spec: GuidedSpec) -> GuidedSpec:
        """`spec` naming the backend that compiles it: the cache and dedup key."""
        if spec.backend:
            if spec.backend not in self.backends:
                raise ValueError(f"grammar backend {spec.backend!r} is not enabled on this server")
            return spec
        return msgspec.structs.replace(spec, backend=self.default_backend)

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """Compile in the calling thread, through this service's cache. Raises on error."""
        spec = self._pinned(spec)
        compiled = self._cache.get(spec)
        if compiled is None:
            compiled = self.backends[spec.backend].compile(spec)
            self._cache.put(spec, compiled)
        return compiled

    # -- asynchronous ------------------------------------------------------------------

    def submit(self, key: int, spec: GuidedSpec) -> None:
        """Start compiling `spec` for `key` (e.g. a request's slot or id). Never blocks."""
        if key in self._key_spec:
            self.cancel(key)
        self._key_spec[key] = spec
        job = self._jobs.get(spec)
        if job is not None:
            job.keys.add(key)
            return
        job = _Job(keys={key})
        self._jobs[spec] = job
        job.future = self._pool.submit(self._run, job, spec)

    def _run(self, job: _Job, spec: GuidedSpec) -> CompiledGrammar:
        job.started = time.monotonic()
        return self.compile(spec)

    def poll(self) -> tuple[dict[int, CompiledGrammar], dict[int, str]]:
        """(newly compiled grammars by key, newly failed keys with a message). Never blocks.

        Each key is reported once, then forgotten.
        """
        ready: dict[int, CompiledGrammar] = {}
        failed: dict[int, str] = {}
        now = time.monotonic()
        for spec, job in list(self._jobs.items()):
            fut = job.future
            if fut is not None and fut.done():
                del self._jobs[spec]
                if fut.cancelled():
                    continue
                exc = fut.exception()
                for key in job.keys:
                    if exc is None:
                        ready[key] = fut.result()
                    else:
                        failed[key] = f"grammar compilation failed: {exc}"
            elif job.started is not None and now - job.started > self.timeout_s:
                job.timed_out = True
                for key in job.keys:
                    failed[key] = f"grammar compilation timed out after {self.timeout_s:g} s"
            else:
                continue
            for key in job.keys:
                self._key_spec.pop(key, None)
            job.keys.clear()
        return ready, failed

    def cancel(self, key: int) -> None:
        """Forget `key` (request aborted). The compile itself stops only if it has not started
        and no other key waits on the same spec; a started one finishes into the cache."""
        spec = self._key_spec.pop(key, None)
        if spec is None:
            return
        job = self._jobs.get(spec)
        if job is None:
            return
        job.keys.discard(key)
        if not job.keys and not job.timed_out and job.future is not None and job.future.cancel():
            del self._jobs[spec]

    @property
    def num_pending(self) -> int:
        """Keys still waiting for a result."""
        return len(self._key_spec)

    @property
    def num_abandoned(self) -> int:
        """Compiles reported as timed out whose threads are still running."""
        return sum(1 for j in self._jobs.values() if j.timed_out)

    def cache_size_bytes(self) -> int:
        return self._cache.size_bytes

    def shutdown(self) -> None:
        """Drop queued compiles; running ones cannot be interrupted (no backend has a cancel),
        so the threads are not waited for."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._jobs.clear()
        self._key_spec.clear()
