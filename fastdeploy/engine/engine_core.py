"""The step loop: schedule → execute → process outputs → release finished sequences.

A step's tokens are applied as soon as its frame's head is on the host, so the next step is
scheduled from them. Its masked deltas wait for the next `step()` call when the step runs
beside this thread (a GPU, or a worker process): they get their sampling masks cut from the
frame while that next step runs, so the masks' host work stays out of the device's way; on
CUDA the mask ids cross PCIe then too. No delta of a request overtakes another of the same
request.

With asynchronous scheduling (`pipelines_steps`) step N+1 is scheduled and sent before step
N's frame is read: the sequences step N samples for compute that token in step N+1 as
IN_FLIGHT_TOKEN, which the worker takes from step N's sampler output on the device, so the
device runs N+1 while the engine reads N. A sequence that finishes in step N has computed one
token too many in N+1, which is dropped. A step scheduled ahead never preempts: one that had
to leave a sequence out is followed by a step in turn.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

from fastdeploy.common.config import EngineConfig, pipelines_steps, resolve_dtype
from fastdeploy.common.limits import EngineLimits
from fastdeploy.common.request import EngineRequest, RequestDelta
from fastdeploy.common.sampling_params import ParameterError
from fastdeploy.common.spec_decode_stats import SpecDecodeStats
from fastdeploy.common.step_input import ChunkInput, GrammarRequest, NewSequence, StepInput, WorkerEvents
from fastdeploy.engine.admission import admit_request
from fastdeploy.engine.executor import Executor, PendingStep
from fastdeploy.output.token_processor import AppliedStep, TokenProcessor
from fastdeploy.scheduler.block_manager import BlockManager
from fastdeploy.scheduler.draft_policy import DraftPolicy, FixedDraftCap
from fastdeploy.scheduler.prefix_hash import root_hash
from fastdeploy.scheduler.scheduler import Scheduler, SchedulerStep
from fastdeploy.scheduler.sequence import Sequence
from fastdeploy.worker.step_output import StepOutput


@dataclasses.dataclass
class SubmittedStep:
    """A step sent to the executor whose frame is not read yet."""

    plan: SchedulerStep
    pending: PendingStep
    started: float  # perf_counter when it was scheduled
    num_rows: int  # sequences running when it was scheduled
    draft_cap: int | None
    next_cap: int  # the cap announced with it for the step after it (-1: no draft policy)
    followed: bool  # the next step is sent before this one's frame is read
    ahead: bool = False  # it was sent before the frame of the step before it was read


@dataclasses.dataclass
class DeferredDeltas:
    """Masked deltas of a step, their masks still to be attached; `output` holds the frame
    they will view (and, on CUDA, the completion of its mask ids)."""

    output: StepOutput
    applied: AppliedStep


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        info = executor.info
        self.max_model_len = min(config.scheduler.max_model_len, info.max_position_embeddings)
        spec = config.speculative
        caching = config.cache.enable_prefix_caching
        self._pipelining = pipelines_steps(config)
        # The worker drafts on the device after a step sent with a successor (MTP's module, or
        # n-gram lookup in the context it keeps there), which takes the drafts there: steps with
        # drafts go out ahead too (one GPU: the other ranks' plans lack the drafts).
        self._drafts_ahead = self._pipelining and spec is not None and spec.method in ("mtp", "ngram") \
            and config.tensor_parallel_size == 1
        # Slots past a sampling chunk's rows that drafting for the next step reaches: the MTP
        # module writes one past each draft; n-gram lookup on the device reads the context up to
        # the token after the rows (which the next step writes there).
        beyond = 0
        if spec is not None and spec.method == "mtp":
            beyond = spec.num_speculative_tokens + 1
        elif self._drafts_ahead:
            beyond = 1
        self.block_manager = BlockManager(info.num_blocks, info.block_size, enable_prefix_caching=caching)
        self.scheduler = Scheduler(dataclasses.replace(config.scheduler, max_model_len=self.max_model_len),
                                   self.block_manager, num_lookahead_slots=spec.num_speculative_tokens if spec else 0,
                                   num_draft_model_slots=beyond,
                                   prefix_root=root_hash(str(config.model), resolve_dtype(config.dtype, config.device)),
                                   draft_model_cache=spec is not None and spec.method == "mtp")
        self.spec_stats = SpecDecodeStats()
        self.draft_policy: DraftPolicy | FixedDraftCap | None = None
        if spec is not None:
            self.draft_policy = (DraftPolicy(spec.num_speculative_tokens, pipelined_zero=self._pipelining)
                                 if spec.adaptive else FixedDraftCap(spec.num_speculative_tokens))
        self._announced_cap: int | None = None  # the next step's draft cap, sent with the last step
        self._last_frame_at = 0.0  # perf_counter when the last step's frame was read
        self.token_processor = TokenProcessor(info.eos_token_ids, self.max_model_len)
        self.limits = EngineLimits(self.max_model_len, info.vocab_size, config.max_logprobs,
                                   config.enable_keep_sampling_mask, info.num_blocks * info.block_size,
                                   guided_backend=config.guided_decoding_backend,
                                   disable_any_whitespace=config.guided_decoding_disable_any_whitespace)
        self.sequences: dict[int, Sequence] = {}
        self.by_request_id: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self._message_ids = itertools.count()
        self._on_worker: set[int] = set()  # sequences holding worker state
        self._freed: list[int] = []
        self._grammar_requests: list[GrammarRequest] = []
        self._registered: set[int] = set()  # sequences whose NewSequence the worker has
        self._deferred: DeferredDeltas | None = None
        self._in_flight: SubmittedStep | None = None  # sent, frame not read; the next step goes first

    def validate(self, request: EngineRequest) -> None:
        """Raise ParameterError for a request that must be refused before it is queued."""
        admit_request(self.limits, request)
        if request.request_id in self.by_request_id:
            raise ParameterError(f"request id {request.request_id!r} is already running", "request_id")

    def add_request(self, request: EngineRequest) -> None:
        self.validate(request)
        params = request.params
        wants_mask = self.config.enable_keep_sampling_mask and params.return_sampling_mask is not False
        mask_format = params.sampling_mask_format or self.config.sampling_mask_format
        seq = Sequence(next(self._seq_ids), request.request_id, list(request.prompt_token_ids), params,
                       request.arrival_time, return_sampling_mask=wants_mask,
                       sampling_mask_bitmap=wants_mask and mask_format == "bitmap")
        self.sequences[seq.seq_id] = seq
        self.by_request_id[seq.request_id] = seq
        if params.guided is not None:
            seq.grammar_ready = False
            self._on_worker.add(seq.seq_id)
            self._grammar_requests.append(GrammarRequest(seq.seq_id, params.guided))
        self.scheduler.add(seq)

    def abort(self, request_ids: list[str]) -> list[RequestDelta]:
        deltas = []
        for request_id in request_ids:
            seq = self.by_request_id.get(request_id)
            if seq is not None:
                self._release(seq)
                deltas.append(RequestDelta(request_id, [], finish_reason="abort",
                                           num_prompt_tokens=len(seq.prompt_token_ids)))
        if self._deferred is not None:
            aborted = set(request_ids)
            applied = self._deferred.applied
            applied.masked = [m for m in applied.masked if m.delta.request_id not in aborted]
        return deltas

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._deferred is not None or self._in_flight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        del self.sequences[seq.seq_id]
        del self.by_request_id[seq.request_id]
        self._registered.discard(seq.seq_id)
        if seq.seq_id in self._on_worker:
            self._on_worker.discard(seq.seq_id)
            self._freed.append(seq.seq_id)

    def step(self, emit_early: Callable[[list[RequestDelta]], None] | None = None) -> list[RequestDelta]:
        """Run one step and return its deltas.

        `emit_early`, where given, receives the previous step's masked deltas as soon as this
        step is launched, so that the caller ships them (a step's masks can be megabytes) while
        the worker computes, rather than between this step's end and the next one's launch.
        """
        current, self._in_flight = self._in_flight, None
        if current is None:
            current = self._submit(followed=self._pipelining)
            if current is None:
                return self._take_deferred()
        if current.followed:
            # The next step goes out before this one's frame is read: the tokens this one
            # samples are computed there as in-flight tokens.
            _count_in_flight(current.plan, 1)
            self.scheduler.on_step_done(current.plan)
            self._in_flight = self._submit(followed=self._pipelining, ahead=True)
        # The last step's masked deltas get their masks while this step runs.
        deltas = self._take_deferred()
        if emit_early is not None and deltas:
            emit_early(deltas)
            deltas = []
        output = current.pending.result()
        plan = current.plan
        if current.followed:
            _count_in_flight(plan, -1)
        else:
            self.scheduler.on_step_done(plan)
        events = output.events
        deltas += self._apply_events(events)
        terminated = frozenset(events.grammar_terminated)
        # Whether the step only decoded the sequences running before it: its time measures a
        # draft cap (a prefill chunk's time would not).
        pure_decode = False
        if self.config.speculative is not None and plan.chunks:
            prefill = any(c.num_tokens != 1 or not c.samples for c in plan.chunks)
            self.spec_stats.add(events, current.ahead, prefill)
            pure_decode = not prefill and len(plan.chunks) == current.num_rows
        applied = self.token_processor.apply(output.frame, self.sequences, terminated, output.mask_bits)
        now = time.perf_counter()
        if self.draft_policy is not None and current.draft_cap is not None and pure_decode:
            # A step sent ahead was scheduled while the one before it ran: its share of the
            # time starts where that one's frame was read.
            self.draft_policy.observe(current.num_rows, current.draft_cap,
                                      sum(len(delta.token_ids) for _, delta in applied.results),
                                      now - max(current.started, self._last_frame_at), current.ahead,
                                      drafted_next=current.next_cap > 0)
        self._last_frame_at = now
        for seq, delta in applied.results:
            if delta.finish_reason is not None:
                self._release(seq)
            elif len(delta.token_ids) > 1:
                # Accepted drafts already have their K/V in the cache (written while verifying);
                # only the last accepted token is new.
                seq.num_computed_tokens += len(delta.token_ids) - 1
        if applied.masked and (self.executor.runs_beside_engine or output.mask_ids_pending is not None):
            deltas += applied.unmasked
            self._deferred = DeferredDeltas(output, applied)
        else:
            output.wait_mask_ids()
            self.token_processor.attach_masks(applied)
            deltas += [delta for _, delta in applied.results]
        return deltas

    def _submit(self, followed: bool, ahead: bool = False) -> SubmittedStep | None:
        """Schedule a step and send it; None when there is nothing to send. `ahead`: the step
        before it is still running (it was sent `followed`), so this one is sent whatever it
        holds, even nothing, and preempts nothing."""
        started = time.perf_counter()
        num_rows = len(self.scheduler.running)
        draft_cap = None
        if self.draft_policy is not None:
            # The cap announced with the last step: a draft model drafted that many after it. A
            # step sent ahead verifies drafts only where the step before it was sent so with a
            # cap above 0 (MTP drafting on the device); otherwise that cap was announced as 0.
            draft_cap = self._announced_cap if self._announced_cap is not None else self.draft_policy.cap(num_rows)
        plan = self.scheduler.schedule(draft_cap, may_preempt=not ahead)
        new_sequences = []
        chunks = []
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.seq_id not in self._registered:
                self._registered.add(seq.seq_id)
                self._on_worker.add(seq.seq_id)
                new_sequences.append(NewSequence(seq.seq_id, seq.prompt_token_ids, seq.params,
                                                 seq.return_sampling_mask, seq.sampling_mask_bitmap))
            end = chunk.start + chunk.num_tokens
            chunks.append(ChunkInput(seq.seq_id, seq.token_slice(chunk.start, end), chunk.start,
                                     list(seq.block_ids), chunk.samples, chunk.num_lookahead, chunk.after_cache_hit))
        if not ahead and not chunks and not self._grammar_requests and not self.waiting_for_grammar:
            return None
        next_cap = -1
        if self.draft_policy is not None:
            self._announced_cap = next_cap = self.draft_policy.cap(len(self.scheduler.running))
        # A step scheduled ahead that left a sequence out for want of blocks is followed by
        # one in turn, which may preempt as usual. A step that verifies drafts, or whose
        # successor takes some, is followed only where the worker drafts on the device.
        followed = followed and bool(chunks) and not plan.num_blocked \
            and (self.draft_policy is None or draft_cap == next_cap == 0 or self._drafts_follow(plan))
        step_input = StepInput(next(self._message_ids), new_sequences, chunks, self._freed, self._grammar_requests,
                               next_cap, followed)
        self._freed = []
        self._grammar_requests = []
        return SubmittedStep(plan, self.executor.submit(step_input), started, num_rows, draft_cap, next_cap, followed,
                             ahead)

    def _drafts_follow(self, plan: SchedulerStep) -> bool:
        """Whether a step may be followed by one sent ahead although it verifies drafts or its
        successor takes some (MTP or n-gram on one GPU): the worker then finds the accepted
        drafts, moves the successor's rows on by them and drafts for it, all on the device. Only
        for a pure decode step (drafts are made from decode rows) of sequences without a grammar
        or a penalty (both read the tokens on the host), each with its cache slots reserved as
        far as that step's rows and what is drafted after it may reach."""
        if not self._drafts_ahead:
            return False
        beyond = self.scheduler.num_draft_model_slots
        bs = self.block_manager.block_size
        for chunk in plan.chunks:
            seq = chunk.seq
            if chunk.num_tokens != 1 or not chunk.samples or seq.params.guided is not None \
                    or seq.params.has_penalties:
                return False
            # The newest token, its drafts, and the slots drafting after them reaches.
            reach = chunk.start + seq.num_in_flight_drafts + 1 + chunk.num_lookahead + beyond
            if len(seq.block_ids) * bs < reach:
                return False
        return True

    def _take_deferred(self) -> list[RequestDelta]:
        """The previous step's masked deltas, their masks attached once the ids are on the host.
        On CUDA their copy starts here, with the step that runs now already queued: the copy
        engine moves them beside its kernels, and the host waits for them inside its time."""
        if self._deferred is None:
            return []
        deferred, self._deferred = self._deferred, None
        deferred.output.wait_mask_ids()
        self.token_processor.attach_masks(deferred.applied)
        return [m.delta for m in deferred.applied.masked]

    @property
    def waiting_for_grammar(self) -> bool:
        return any(not seq.grammar_ready for seq in self.scheduler.waiting)

    def _apply_events(self, events: WorkerEvents) -> list[RequestDelta]:
        for seq_id in events.grammar_ready:
            if seq_id in self.sequences:
                self.sequences[seq_id].grammar_ready = True
        deltas = []
        failures = [(seq_id, message, 400) for seq_id, message in events.grammar_failed]
        failures += [(seq_id, message, 500) for seq_id, message in events.seq_errors]
        for seq_id, message, status in failures:
            seq = self.sequences.get(seq_id)
            if seq is not None:
                self._release(seq)
                deltas.append(RequestDelta(seq.request_id, [], finish_reason="error", error=message,
                                           error_status=status, num_prompt_tokens=len(seq.prompt_token_ids)))
        return deltas

    def shutdown(self) -> None:
        self.executor.shutdown()


def _count_in_flight(plan: SchedulerStep, change: int) -> None:
    """A followed step's samples go in flight when it is sent ahead of, and land when its frame is read."""
    for chunk in plan.chunks:
        if chunk.samples:
            chunk.seq.num_in_flight += change
            chunk.seq.num_in_flight_drafts = chunk.num_lookahead if change > 0 else 0

