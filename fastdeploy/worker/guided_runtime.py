"""The worker's grammar state: asynchronous compiles and one matcher per constrained sequence."""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from fastdeploy.model_executor.guided_decoding.compiler import GrammarCompileService
from fastdeploy.model_executor.guided_decoding.matcher import GuidedState, fill_bitmasks
from fastdeploy.model_executor.guided_decoding.spec import GuidedSpec
from fastdeploy.worker.step_input import WorkerEvents

logger = logging.getLogger(__name__)


class GuidedRuntime:
    """Compiles in background threads; the step loop only polls, so no step waits on a compile.

    The tokenizer (needed for xgrammar's TokenizerInfo) loads in the background on the
    first constrained request: a worker that never sees one never pays for it (loading
    it at start-up took ~6 s of CPU and slowed the first decodes 3x on 2 cores).
    """

    def __init__(self, model: str | None, vocab_size: int, stop_token_ids: list[int], timeout_s: float,
                 cache_limit_bytes: int) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._service_args = (model, vocab_size, timeout_s, cache_limit_bytes)
        self._boot = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-boot")
        self._service: Future[GrammarCompileService] | None = None
        self._unsubmitted: dict[int, GuidedSpec] = {}
        self.states: dict[int, GuidedState] = {}

    @staticmethod
    def _build_service(model: str | None, vocab_size: int, timeout_s: float,
                       cache_limit_bytes: int) -> GrammarCompileService:
        from fastdeploy.model_executor.model_loader import get_tokenizer

        # Half the cores per compile: the other half keeps decoding the unconstrained requests.
        threads = max(1, (os.cpu_count() or 2) // 2)
        return GrammarCompileService.from_tokenizer(get_tokenizer(model), vocab_size, timeout_s=timeout_s,
                                                    cache_limit_bytes=cache_limit_bytes, compiler_threads=threads)

    def request(self, seq_id: int, spec: GuidedSpec) -> None:
        if self._service is None:
            self._service = self._boot.submit(self._build_service, *self._service_args)
        self._unsubmitted[seq_id] = spec

    def _ready_service(self) -> GrammarCompileService | None:
        if self._service is None or not self._service.done() or self._service.exception() is not None:
            return None
        return self._service.result()

    def free(self, seq_id: int) -> None:
        self._unsubmitted.pop(seq_id, None)
        self.states.pop(seq_id, None)
        service = self._ready_service()
        if service is not None:
            service.cancel(seq_id)

    def poll(self, events: WorkerEvents) -> None:
        """Start queued compiles once the service is up; record finished ones in `events`."""
        if self._service is None or not self._service.done():
            return
        if self._service.exception() is not None:
            message = f"structured output is unavailable: {self._service.exception()}"
            events.grammar_failed.extend([seq_id, message] for seq_id in self._unsubmitted)
            self._unsubmitted.clear()
            return
        service = self._service.result()
        for seq_id, spec in self._unsubmitted.items():
            service.submit(seq_id, spec)
        self._unsubmitted.clear()
        ready, failed = service.poll()
        for seq_id, compiled in ready.items():
            self.states[seq_id] = GuidedState(compiled, stop_token_ids=self.stop_token_ids)
            events.grammar_ready.append(seq_id)
        events.grammar_failed.extend([seq_id, message] for seq_id, message in failed.items())

    def bitmask(self, seq_ids: list[int]) -> torch.Tensor | None:
        """int32 [B, ceil(V/32)] for the rows sampled this step; None when none is constrained."""
        return fill_bitmasks([self.states.get(s) for s in seq_ids], self.vocab_size)

    def accept(self, seq_ids: list[int], runs: list[list[int]], events: WorkerEvents) -> list[int]:
        """Advance each sequence's matcher by its accepted tokens (one, or several with speculative
        decoding); returns how many of each run stand: a run ends at the token that completes its
        grammar, or before a token the grammar rejects."""
        counts = []
        for seq_id, run in zip(seq_ids, runs):
            state = self.states.get(seq_id)
            n = len(run)
            if state is not None:
                for n, token in enumerate(run, start=1):
                    if not state.accept(token):
                        # A sampled token outside the bitmask is a bug; it fails this request only.
                        logger.error("grammar rejected token %d of sequence %d", token, seq_id)
                        events.seq_errors.append(
                            [seq_id, f"internal error: the grammar rejected sampled token {token}"])
                        n -= 1
                        break
                    if state.is_terminated:
                        events.grammar_terminated.append(seq_id)
                        break
            counts.append(n)
        return counts
