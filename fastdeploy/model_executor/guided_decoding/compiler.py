"""Asynchronous grammar compilation: one xgrammar GrammarCompiler (with its cache) behind a
thread pool, polled without blocking by the worker's step loop."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import xgrammar as xgr

from fastdeploy.model_executor.guided_decoding.spec import GuidedSpec, _clean_xgr_error, choice_ebnf

__all__ = ["GrammarCompileService", "compile_spec", "tokenizer_info_from_hf"]


def tokenizer_info_from_hf(tokenizer, vocab_size: int | None = None, stop_token_ids: list[int] | None = None):
    """xgrammar.TokenizerInfo for a HF tokenizer.

    vocab_size: the model's logits width, which may exceed len(tokenizer) (padded embedding
        tables); ids past the tokenizer's are then never allowed. None = len(tokenizer).
    stop_token_ids: tokens that end a constrained output; None = xgrammar's detection
        (the tokenizer's eos).
    """
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size if vocab_size is not None else len(tokenizer), stop_token_ids=stop_token_ids
    )


def compile_spec(
    compiler: xgr.GrammarCompiler,
    spec: GuidedSpec,
    *,
    any_whitespace: bool = True,
    strict_mode: bool = True,
    max_whitespace_cnt: int | None = None,
) -> xgr.CompiledGrammar:
    """Compile `spec` synchronously on `compiler` (hits its cache for a repeated spec).

    Raises whatever xgrammar raises (RuntimeError subclasses) for an invalid spec.
    """
    kind, value = spec.kind, spec.value
    if kind == "json_schema":
        return compiler.compile_json_schema(
            value, any_whitespace=any_whitespace, strict_mode=strict_mode, max_whitespace_cnt=max_whitespace_cnt
        )
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":
        choices = json.loads(value)
        if not choices:
            raise ValueError("guided_choice must not be empty")
        return compiler.compile_grammar(choice_ebnf(choices))
    if kind == "grammar":
        return compiler.compile_grammar(value)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(value)
    raise ValueError(f"unknown guided decoding kind {kind!r}")


@dataclass
class _Job:
    """One compile in flight, shared by every key that asked for the same spec."""

    keys: set[int]
    future: Future | None = None
    started: float | None = None  # set by the pool thread when the compile begins
    timed_out: bool = False


@dataclass
class _Options:
    any_whitespace: bool = True
    strict_mode: bool = True
    max_whitespace_cnt: int | None = None


class GrammarCompileService:
    """Compiles GuidedSpecs in the background; the caller polls for results.

    One GrammarCompiler (xgrammar caches compiled grammars by spec and options, so an
    identical spec compiles once) behind a ThreadPoolExecutor. xgrammar releases the GIL
    while compiling, so the step loop keeps running. Identical specs in flight at the same
    time also share one compile.

    Timeouts: xgrammar cannot interrupt a compile, so a compile running longer than
    `timeout_s` is *reported* failed, and its thread runs on to completion in the
    background (the result lands in the cache). Its spec stays marked: a resubmission
    while it still runs fails at once instead of starting a second copy.
    `num_abandoned` counts such threads.

    Not thread-safe: call submit / poll / cancel from one thread (the step loop).
    """

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        *,
        max_workers: int = 2,
        compiler_threads: int | None = None,
        timeout_s: float = 30.0,
        cache_limit_bytes: int = 512 << 20,
        any_whitespace: bool = True,
        strict_mode: bool = True,
        max_whitespace_cnt: int | None = None,
    ) -> None:
        """
        max_workers: grammars compiled concurrently.
        compiler_threads: xgrammar's own threads per compile (token-mask precomputation).
        any_whitespace / strict_mode / max_whitespace_cnt: JSON-schema options, see
            xgrammar.GrammarCompiler.compile_json_schema. strict_mode=True forbids properties
            and items the schema does not list (additionalProperties defaults to false).
        """
        self.tokenizer_info = tokenizer_info
        self.vocab_size: int = tokenizer_info.vocab_size
        self.timeout_s = timeout_s
        self._options = _Options(any_whitespace, strict_mode, max_whitespace_cnt)
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info,
            max_threads=compiler_threads or min(8, os.cpu_count() or 1),
            cache_enabled=True,
            cache_limit_bytes=cache_limit_bytes,
        )
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._jobs: dict[GuidedSpec, _Job] = {}
        self._key_spec: dict[int, GuidedSpec] = {}

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None, **kwargs) -> "GrammarCompileService":
        """Build from a HF tokenizer; vocab_size = the model's logits width (see tokenizer_info_from_hf)."""
        return cls(tokenizer_info_from_hf(tokenizer, vocab_size), **kwargs)

    # -- synchronous -------------------------------------------------------------------

    def compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        """Compile in the calling thread, with this service's options and cache. Raises on error."""
        o = self._options
        return compile_spec(
            self._compiler,
            spec,
            any_whitespace=o.any_whitespace,
            strict_mode=o.strict_mode,
            max_whitespace_cnt=o.max_whitespace_cnt,
        )

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

    def _run(self, job: _Job, spec: GuidedSpec) -> xgr.CompiledGrammar:
        job.started = time.monotonic()
        return self.compile(spec)

    def poll(self) -> tuple[dict[int, xgr.CompiledGrammar], dict[int, str]]:
        """(newly compiled grammars by key, newly failed keys with a message). Never blocks.

        Each key is reported once, then forgotten.
        """
        ready: dict[int, xgr.CompiledGrammar] = {}
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
                        failed[key] = f"grammar compilation failed: {_clean_xgr_error(exc)}"
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
        return self._compiler.get_cache_size_bytes()

    def shutdown(self) -> None:
        """Drop queued compiles; running ones cannot be interrupted (xgrammar has no cancel),
        so the threads are not waited for."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._jobs.clear()
        self._key_spec.clear()
