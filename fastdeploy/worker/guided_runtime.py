"""The worker's grammar state: asynchronous compiles and one matcher per constrained sequence."""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from fastdeploy.common.guided_spec import GuidedSpec
from fastdeploy.common.step_input import WorkerEvents
from fastdeploy.model_executor.guided_decoding.compiler import GrammarCompileService, build_backend
from fastdeploy.model_executor.guided_decoding.coverage import BACKEND_NAMES
from fastdeploy.model_executor.guided_decoding.matcher import GuidedState, PinnedBitmasks, fill_bitmasks
from fastdeploy.reasoning import EndMarkerDetector, ReasoningParser, get_reasoning_parser
from fastdeploy.spec_decode.guided_drafts import fill_draft_bitmasks

logger = logging.getLogger(__name__)


@dataclass
class _Boot:
    """What loads in the background on the first constrained request."""

    service: GrammarCompileService
    reasoning: ReasoningParser | None


@dataclass
class _Thinking:
    """A compiled grammar waiting for its sequence's end-of-thinking marker."""

    state: GuidedState
    detector: EndMarkerDetector


class GuidedRuntime:
    """Compiles in background threads; the step loop only polls, so no step waits on a compile.

    The tokenizer (needed by both grammar backends) loads in the background on the
    first constrained request: a worker that never sees one never pays for it (loading
    it at start-up took ~6 s of CPU and slowed the first decodes 3x on 2 cores).
    Each spec arrives with its backend already chosen by the engine (select.py).
    """

    def __init__(self, model: str | None, vocab_size: int, stop_token_ids: list[int], timeout_s: float,
                 cache_limit_bytes: int, reasoning_parser: str | None = None, backend: str = "auto") -> None:
        """reasoning_parser: a registered name; constraints then start after its end marker.
        backend: --guided-decoding-backend; "auto" loads both backends."""
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        if reasoning_parser is not None:
            get_reasoning_parser(reasoning_parser)  # an unknown name fails at start-up, not on a request
        backends = BACKEND_NAMES if backend == "auto" else (backend,)
        self._boot_args = (model, vocab_size, stop_token_ids, backends, timeout_s, cache_limit_bytes,
                           reasoning_parser)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-boot")
        self._boot: Future[_Boot] | None = None
        self._unsubmitted: dict[int, GuidedSpec] = {}
        # Grammars in force: the sampler masks these rows (the speculative path reads it too).
        self.states: dict[int, GuidedState] = {}
        # Compiled grammars of sequences still thinking: their rows are not masked yet.
        self._thinking: dict[int, _Thinking] = {}
        self._pinned: PinnedBitmasks | None = None  # made on the first pinned fill (needs CUDA)

    @staticmethod
    def _build(model: str | None, vocab_size: int, stop_token_ids: list[int], backends: tuple[str, ...],
               timeout_s: float, cache_limit_bytes: int, reasoning_parser: str | None) -> _Boot:
        from fastdeploy.model_executor.model_loader import get_tokenizer

        tokenizer = get_tokenizer(model)
        # Half the cores per compile: the other half keeps decoding the unconstrained requests.
        threads = max(1, (os.cpu_count() or 2) // 2)
        built = []
        for name in backends:
            try:
                built.append(build_backend(name, tokenizer, vocab_size, stop_token_ids, threads))
            except Exception as e:  # e.g. a tokenizer one backend cannot read: the other still serves
                if len(backends) == 1:
                    raise
                logger.warning("grammar backend %s is unavailable: %s", name, e)
        if not built:
            raise RuntimeError("no grammar backend could load this model's tokenizer")
        service = GrammarCompileService(built, timeout_s=timeout_s, cache_limit_bytes=cache_limit_bytes)
        reasoning = get_reasoning_parser(reasoning_parser)(tokenizer) if reasoning_parser else None
        return _Boot(service, reasoning)

    def request(self, seq_id: int, spec: GuidedSpec) -> None:
        if self._boot is None:
            self._boot = self._pool.submit(self._build, *self._boot_args)
        self._unsubmitted[seq_id] = spec

    def _booted(self) -> _Boot | None:
        if self._boot is None or not self._boot.done() or self._boot.exception() is not None:
            return None
        return self._boot.result()

    def tracks(self, seq_id: int) -> bool:
        """Whether the sequence's tokens advance a grammar (or watch for the end of thinking)."""
        return seq_id in self.states or seq_id in self._thinking

    def free(self, seq_id: int) -> None:
        self._unsubmitted.pop(seq_id, None)
        self.states.pop(seq_id, None)
        self._thinking.pop(seq_id, None)
        boot = self._booted()
        if boot is not None:
            boot.service.cancel(seq_id)

    def poll(self, events: WorkerEvents) -> None:
        """Start queued compiles once the service is up; record finished ones in `events`."""
        if self._boot is None or not self._boot.done():
            return
        if self._boot.exception() is not None:
            message = f"structured output is unavailable: {self._boot.exception()}"
            events.grammar_failed.extend([seq_id, message] for seq_id in self._unsubmitted)
            self._unsubmitted.clear()
            return
        boot = self._boot.result()
        for seq_id, spec in self._unsubmitted.items():
            boot.service.submit(seq_id, spec)
        self._unsubmitted.clear()
        ready, failed = boot.service.poll()
        for seq_id, compiled in ready.items():
            state = GuidedState(compiled)
            if boot.reasoning is None:
                self.states[seq_id] = state
            else:
                self._thinking[seq_id] = _Thinking(state, boot.reasoning.end_detector())
            events.grammar_ready.append(seq_id)
        events.grammar_failed.extend([seq_id, message] for seq_id, message in failed.items())

    def on_prompt(self, seq_id: int, prompt_token_ids: list[int]) -> None:
        """A sequence's first step: a prompt that already closed thinking puts its grammar in force.

        Its grammar compiled before this (the engine schedules a constrained sequence once
        its grammar is ready), so a thinking sequence is known here.
        """
        boot = self._booted()
        if seq_id in self._thinking and boot is not None and boot.reasoning is not None \
                and boot.reasoning.prompt_ids_close_reasoning(prompt_token_ids):
            self.states[seq_id] = self._thinking.pop(seq_id).state

    def bitmask(self, seq_ids: list[int], slot_drafts: list[list[int]] | None = None, pinned: bool = False
                ) -> torch.Tensor | None:
        """int32 [rows, ceil(V/32)] for the rows sampled this step; None when none is constrained.

        slot_drafts: a verify step's drafts per sequence; then one row per verified slot
        (spec_decode.guided_drafts), else one per sequence.
        pinned: fill reused page-locked rows (`PinnedBitmasks`), which a non-blocking copy takes to
        the GPU without waiting for the GPU's queued work (the step fills this while the forward
        pass runs).
        """
        states = [self.states.get(s) for s in seq_ids]
        if all(s is None for s in states):
            return None
        out = None
        if pinned:
            if self._pinned is None:
                self._pinned = PinnedBitmasks(self.vocab_size)
            out = self._pinned.take(len(states) if slot_drafts is None else sum(len(d) + 1 for d in slot_drafts))
        if slot_drafts is None:
            return fill_bitmasks(states, self.vocab_size, out=out)
        return fill_draft_bitmasks(states, slot_drafts, self.vocab_size, out=out)

    def accept(self, seq_ids: list[int], runs: list[list[int]], events: WorkerEvents) -> list[int]:
        """Advance each sequence's matcher by its accepted tokens (one, or several with speculative
        decoding); returns how many of each run stand: a run ends at the token that completes its
        grammar, or before a token the grammar rejects."""
        counts = []
        for seq_id, run in zip(seq_ids, runs, strict=True):
            state = self.states.get(seq_id)
            n = len(run)
            if state is not None:
                n = self._advance(seq_id, state, run, events, masked=True)
            elif seq_id in self._thinking:
                n = self._think(seq_id, run, events)
            counts.append(n)
        return counts

    def _advance(self, seq_id: int, state: GuidedState, run: list[int], events: WorkerEvents, *,
                 masked: bool) -> int:
        """Feed `run` to the grammar; how many of its tokens stand."""
        for n, token in enumerate(run):
            if not state.accept(token):
                allowed = fill_bitmasks([state], self.vocab_size)  # a constrained row: never None
                if masked and allowed is not None and not bool(allowed.any()):
                    # The constraint allows no token here: it needs text the vocabulary cannot
                    # spell (a character no token starts with). The request's fault, not ours.
                    events.grammar_failed.append([seq_id, "no token of the model's vocabulary can continue the "
                                                          "structured-output constraint at this point"])
                elif masked:
                    # A sampled token outside the bitmask is a bug; it fails this request only.
                    logger.error("grammar rejected token %d of sequence %d", token, seq_id)
                    events.seq_errors.append([seq_id, f"internal error: the grammar rejected sampled token {token}"])
                return n
            if state.is_terminated:
                events.grammar_terminated.append(seq_id)
                return n + 1
        return len(run)

    def _think(self, seq_id: int, run: list[int], events: WorkerEvents) -> int:
        """Watch a thinking sequence's tokens for the end marker; from there on its grammar holds.

        With speculative decoding the marker can end inside a run: the tokens after it were
        drawn without a mask, so the run is cut at the first one the grammar rejects (the
        next step samples that position under the mask) instead of failing the request.
        """
        thinking = self._thinking[seq_id]
        for n, token in enumerate(run, start=1):
            if thinking.detector.feed(token):
                del self._thinking[seq_id]
                self.states[seq_id] = thinking.state
                return n + self._advance(seq_id, thinking.state, run[n:], events, masked=False)
        return len(run)
