"""Runs one step on the device: inputs → model → logits → sampler → packed frame.

A step runs in two halves. `launch` queues the step's device work (on CUDA without waiting
for the device) and returns an `InFlightStep`; `finish` waits once for the packed frame and
does the host's bookkeeping (grammars, outputs). With asynchronous scheduling the next step's
`launch` comes before this one's `finish`, and the frame is packed on a stream beside the
compute stream. What the frame need not wait for, the MTP drafts for the next step, runs in
`after_frame`, once the frame is on its way (at the next `launch` at the latest).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from fastdeploy.common.config import EngineConfig, ModelConfig, pipelines_steps, resolve_dtype
from fastdeploy.common.step_frame import FrameBuffer, StepFrame, pack_step_frame, shorten_step_frame
from fastdeploy.common.step_input import IN_FLIGHT_TOKEN, ChunkInput, NewSequence, StepInput, WorkerEvents
from fastdeploy.distributed.parallel_state import all_reduce_min, broadcast_from_first, destroy_tensor_parallel
from fastdeploy.distributed.shard import local_config
from fastdeploy.model_executor.cuda_graph import CudaGraphRunner
from fastdeploy.model_executor.layers.attention import allocate_kv_caches
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata
from fastdeploy.model_executor.layers.sample.metadata import SamplerOutput
from fastdeploy.model_executor.layers.sample.sampler import UNSETTLED_TOKEN, Sampler
from fastdeploy.model_executor.model_loader import get_model, tokenizer_path
from fastdeploy.ops.step_packer import PackedStep, StepPacker, choose_packer
from fastdeploy.spec_decode import ngram_device
from fastdeploy.spec_decode.guided_drafts import trim_drafts_to_grammar
from fastdeploy.spec_decode.ngram_proposer import NgramProposer
from fastdeploy.worker import input_prep, slot_layout, verify_kernels
from fastdeploy.worker.graph_capture import DecodeShape, capture_decode_graphs, uses_graphs
from fastdeploy.worker.guided_runtime import GuidedRuntime
from fastdeploy.worker.in_flight_step import InFlightStep, QueuedSampling, SampledTokens
from fastdeploy.worker.kv_cache_sizing import num_kv_blocks
from fastdeploy.worker.mtp_step import MTPStep
from fastdeploy.worker.sequence_state import WorkerSequence
from fastdeploy.worker.startup_timing import StartupTimes
from fastdeploy.worker.step_output import StepOutput
from fastdeploy.worker.tp_startup import PlanChannel, StartupGate, start_tensor_parallel
from fastdeploy.worker.verify_kernels import VerifiedSlots
from fastdeploy.worker.warmup import PendingSampler, SamplerWarmUp, start_sampler_compile, warmed_up_sampler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["ModelRunner", "WorkerInfo", "WorkerSequence"]


@dataclass
class WorkerInfo:
    """What the engine learns from the worker once it is up."""

    num_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: list[int]
    max_position_embeddings: int


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, dist_init_file: str | None = None,
                 check_ranks: Callable[[], None] | None = None) -> None:
        """`rank`, `dist_init_file`: this worker's place in a tensor-parallel group of
        `config.tensor_parallel_size` processes (rank 0 samples and talks to the engine).
        `check_ranks` (rank 0): raises once another rank of the group has died."""
        self.config = config
        times = StartupTimes()
        gate = StartupGate(dist_init_file, rank, config.tensor_parallel_size, check_ranks)
        with times.phase("tensor parallel"):
            gate.reach("join")
            self.device = start_tensor_parallel(config, rank, dist_init_file)
            # Made before the collectives below, so every follower is connected when rank 0 first sends.
            self._plans = PlanChannel(dist_init_file)
        self.dtype = _DTYPES[resolve_dtype(config.dtype, config.device)]
        torch.manual_seed(config.seed)
        with times.phase("weights"):
            self.model, self.model_config = get_model(
                config.model, config.load_format, dtype=self.dtype, device=str(self.device), seed=config.seed
            )
        # The sampler's slowest kernels compile in the background while the KV cache and the
        # CUDA graphs are set up (rank 0 samples).
        compiling = start_sampler_compile(self.model_config.vocab_size, self.device) if rank == 0 else []
        # This rank's share of the attention heads: what its KV cache holds.
        cache_model_config = local_config(self.model_config, config.tensor_parallel_size)
        self.block_size = config.cache.block_size
        gate.reach("weights")  # the slowest, likeliest phase to fail: before the next collective
        with times.phase("KV cache"):
            # Every rank must agree on the pool the engine hands out block ids from.
            self.num_blocks = all_reduce_min(config.cache.num_blocks or num_kv_blocks(
                self.model, cache_model_config, config, self.dtype, self.device
            ))
            # One spare block past the engine's pool: padded rows of a captured decode batch write there.
            self.kv_caches = allocate_kv_caches(cache_model_config, self.num_blocks + 1, self.block_size,
                                                self.dtype, self.device)
        gate.reach("kv-cache")  # the largest allocation: before the warm-up's collectives
        shape = DecodeShape.of(config, self.num_blocks)
        use_graphs = uses_graphs(config, self.device)
        self.cuda_graphs: CudaGraphRunner | None = None
        if use_graphs:
            with times.phase("CUDA graphs"):
                self.cuda_graphs = capture_decode_graphs(self.model, self.kv_caches, shape)
        self.sampler = Sampler(self.device)
        # Chosen once: the packer for the device the sampler's output lives on (rank 0 samples).
        self.packer: StepPacker | None = choose_packer(self.device) if rank == 0 else None
        spec = config.speculative
        self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) \
            if spec is not None and spec.method == "ngram" else None
        # n-gram drafting for a step sent ahead (one GPU, steps pipelined): the context on the
        # device, every computed token at its cache slot (the spare block's too).
        self.token_history: ngram_device.TokenHistory | None = None
        if self.proposer is not None and config.tensor_parallel_size == 1 and pipelines_steps(config):
            self.token_history = ngram_device.TokenHistory((self.num_blocks + 1) * self.block_size, self.device)
        self.mtp: MTPStep | None = None
        if spec is not None and spec.method == "mtp":
            with times.phase("MTP head"):
                self.mtp = MTPStep(config, self.model, self.model_config, self.dtype, self.device, self.num_blocks,
                                   shape, use_graphs, self.cuda_graphs)
        if spec is not None and self.device.type == "cuda":
            # Compiled now (or read from Triton's cache), not at a verify step's launch mid-serving.
            with times.phase("speculation kernels"):
                verify_kernels.warm_up(self.device)
                if self.token_history is not None:
                    ngram_device.warm_up(self.token_history, spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.sequences: dict[int, WorkerSequence] = {}
        # Asynchronous scheduling: the last step's sampled tokens (a step scheduled ahead of its
        # frame reads its in-flight tokens there), steps launched so far, the latest of them,
        # and the stream frames are packed on while a later step runs.
        self._last_sampled: SampledTokens | None = None
        self._launches = 0
        self._latest: InFlightStep | None = None
        self._frame_side_stream: torch.cuda.Stream | None = None
        # A step finished early whose redraw changed a token the step being launched read.
        self._redrawn_ahead: tuple[SampledTokens, set[int]] | None = None
        # A verify step finished early: the tokens each sequence accepted, which move the chunks
        # of the step being launched on.
        self._accepted_ahead: dict[int, int] | None = None
        # Work of the last finished step that its frame does not wait for (MTP drafting for the
        # next step): `after_frame` runs it once the frame is on its way, `launch` at the latest.
        self._after_frame: Callable[[], None] | None = None
        self._after_frame_error: BaseException | None = None
        self._next_draft_cap: int | None = None  # drafts the step after the running one may take
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        self._metadata_cache = input_prep.SamplingMetadataCache()  # a decode batch's unchanged sampling inputs
        # Called with a step finished early, inside the launch of the step behind it (a grammar
        # or a penalty reads its tokens): the worker process sends its frame from there, so the
        # engine takes it in while this rank still fills bitmasks and launches the sampler.
        self.on_finished_early: Callable[[InFlightStep], None] | None = None
        self.guided: GuidedRuntime | None = None
        if config.guided_decoding_backend != "off":
            with times.phase("grammar runtime"):
                self.guided = GuidedRuntime(tokenizer_path(config.model, config.tokenizer),
                                            self.model_config.vocab_size, list(self.model_config.eos_token_ids),
                                            config.grammar_compile_timeout_s, config.grammar_cache_mb * 1024 * 1024,
                                            config.reasoning_parser, backend=config.guided_decoding_backend)
        # The Triton kept-set path while it still compiles (a fresh machine): the worker serves on
        # the torch path meanwhile, and `launch` switches once it is ready.
        self._pending_sampler: PendingSampler | None = None
        if rank == 0:  # the rank that samples
            with times.phase("sampler warm-up"):
                warm_up = SamplerWarmUp(self.model_config.vocab_size, self.device,
                                        self.config.enable_keep_sampling_mask, self.config.logprobs_mode)
                self.sampler, self._pending_sampler = warmed_up_sampler(compiling, warm_up)
        logger.info("rank %d: %s", rank, times.summary())

    @property
    def info(self) -> WorkerInfo:
        mc: ModelConfig = self.model_config
        return WorkerInfo(self.num_blocks, self.block_size, mc.vocab_size, list(mc.eos_token_ids),
                          mc.max_position_embeddings)

    def execute(self, step: StepInput) -> StepOutput:
        """Run one step; return its packed frame and its non-token events."""
        return self.finish(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: StepInput) -> InFlightStep:
        """Queue one step's work; `finish` waits for it.

        On CUDA everything up to the frame's copy to the host is queued without waiting for the
        device, so the caller's thread is free while the model runs (the engine cuts the last
        step's sampling masks in that time). With asynchronous scheduling the next step is
        launched before this one is finished (at most one step ahead); its in-flight tokens are
        this step's sampled tokens, read on the device.
        """
        self.after_frame()
        if self._pending_sampler is not None:
            self._take_compiled_sampler(self._pending_sampler)
        if self._after_frame_error is not None:
            error, self._after_frame_error = self._after_frame_error, None
            raise RuntimeError("the last step's drafting failed") from error
        self._next_draft_cap = step.next_draft_cap if step.next_draft_cap >= 0 else None
        events = self._take_step_input(step)
        if self._frame_side_stream is not None:
            # A frame packed beside the compute stream may still be read there (its mask ids):
            # this step's kernels, which may reuse that frame's freed memory, come after.
            torch.cuda.current_stream(self.device).wait_stream(self._frame_side_stream)
        self._launches += 1
        predecessor, self._last_sampled = self._last_sampled, None
        launched = self._launch_chunks(step, events, predecessor, self._latest)
        self._latest = launched
        return launched

    def _take_compiled_sampler(self, pending: PendingSampler) -> None:
        """Switches to the Triton kept-set sampler once it has compiled. Between steps: a step's
        `leaves_unsettled` and its draw come from one sampler; a step still in flight (drawn on
        the torch path, every set settled) needs no redraw."""
        compiled = pending.poll()
        if compiled is not None:
            self.sampler = compiled
        if compiled is not None or pending.given_up:
            self._pending_sampler = None

    def _launch_chunks(self, step: StepInput, events: WorkerEvents, predecessor: SampledTokens | None,
                       ahead: InFlightStep | None = None) -> InFlightStep:
        """The step's device work; in-flight tokens come from `predecessor`, the sampled tokens
        of `ahead`, the step launched before it (still running when the engine schedules ahead)."""
        if not step.chunks:
            return InFlightStep(events, finished=StepOutput(pack_step_frame(_empty_frame(step.message_id)), events))
        drafts = self._propose_drafts(step.chunks, predecessor)
        if drafts and self.guided is not None:
            trim_drafts_to_grammar(self.guided.states, drafts)
            drafts = {seq_id: d for seq_id, d in drafts.items() if d}
        # Drafts only extend decode chunks, which the step lists first: the decode prefix stays one.
        chunks = [input_prep.with_draft(c, drafts[c.seq_id]) if c.seq_id in drafts else c for c in step.chunks]
        seq_ids = [c.seq_id for c in chunks if c.sample]
        slot_drafts = [drafts.get(seq_id, []) for seq_id in seq_ids]
        self._plans.send(chunks, drafts)
        input_ids, positions, attn_metadata, sample_rows = input_prep.prepare_inputs(
            chunks, drafts, self.block_size, self.device)
        in_flight = input_prep.in_flight_slots(chunks, drafts)
        device_drafts = None  # the drafts verified here, where the host has only their number
        num_proposed = None  # per sampled sequence, of those: the real ones (n-gram lookups may come up short)
        if in_flight:
            if predecessor is None:
                raise RuntimeError("a step computes in-flight tokens, but the step before it sampled none")
            widths = [len(drafts.get(seq_id, ())) for _, seq_id in in_flight]
            device_drafts, proposed = predecessor.place(input_ids, positions, attn_metadata, in_flight, widths,
                                                        seq_ids, self.device)
            broadcast_from_first(input_ids)  # the other ranks' plan has placeholders there
            if proposed is not None and self.token_history is not None:
                num_proposed = _to_host(proposed)
        hidden = self._forward(input_ids, positions, attn_metadata)
        if not seq_ids:
            if self.mtp is not None:
                self.mtp.feed(chunks, hidden, {}, drafts, self.sequences, self._next_draft_cap)
            return InFlightStep(events, finished=StepOutput(pack_step_frame(_empty_frame(step.message_id)), events))
        # Everything up to the pack is queued on the device without waiting for it: the host
        # builds the sampler's inputs and fills the grammar bitmask while the GPU runs the model.
        logits = self._logits(hidden, sample_rows)
        states = [self.sequences[seq_id] for seq_id in seq_ids]
        sampled_states = input_prep.slot_states(states, slot_drafts) if drafts else states
        penalised = any(s.params.has_penalties for s in states)
        # Without penalties the metadata reads none of the tokens the step ahead samples: it is
        # built now, while the device still runs that step. (A grammar's bitmask, which reads
        # them too, is filled after.)
        metadata = None if penalised else self._metadata_cache.get(sampled_states, self.config.logprobs_mode,
                                                                    self.device)
        if ahead is not None and ahead.unfinished and (penalised or self._tracks_grammar(seq_ids)):
            # A grammar to advance or a penalty history to extend: the step ahead is finished
            # now, while the device runs this step's forward pass, instead of after it.
            ahead.finished = self.finish(ahead)
            accepted, self._accepted_ahead = self._accepted_ahead, None
            if accepted is not None:
                chunks = _moved_on(chunks, drafts, accepted)
            if self.on_finished_early is not None:
                self.on_finished_early(ahead)
            redraw, self._redrawn_ahead = self._redrawn_ahead, None
            if redraw is not None and any(seq_id in redraw[1] for _, seq_id in in_flight):
                # The forward pass read a token that was drawn again: run it again (rare). The
                # redraw ran on the frame stream.
                if self._frame_side_stream is not None:
                    torch.cuda.current_stream(self.device).wait_stream(self._frame_side_stream)
                self._plans.send(chunks, drafts)  # the other ranks run the forward pass again too
                redraw[0].fill(input_ids, in_flight, self.device)
                broadcast_from_first(input_ids)
                hidden = self._forward(input_ids, positions, attn_metadata)
                logits = self._logits(hidden, sample_rows)
        if metadata is None:
            metadata = input_prep.sampling_metadata(sampled_states, self.config.logprobs_mode, self.device)
        metadata.token_bitmask = self._bitmask(seq_ids, slot_drafts, bool(drafts))
        assert metadata.row_groups is not None  # sampling_metadata always splits the rows
        next_cap = self._next_draft_cap if self._next_draft_cap is not None else self.num_speculative_tokens
        # A step sent ahead of this one's frame that verifies (or takes drafts made from) these
        # tokens cannot be run again if one is drawn again: such a step settles its kept sets now.
        truncating = bool(metadata.row_groups.host[1])
        drafts_on_device = self.mtp is not None or self.token_history is not None
        settle = truncating and step.followed and (bool(drafts) or (drafts_on_device and next_cap > 0))
        may_redraw = not settle and truncating and self.sampler.leaves_unsettled
        rng_states = [g.get_state() if g is not None else None for g in metadata.generators] if may_redraw else []
        sampled = self.sampler(logits, metadata, settle_kept_sets=settle)
        verified = None
        if not drafts:  # what a step scheduled ahead of this one's frame reads as its in-flight tokens
            self._last_sampled = SampledTokens(seq_ids, sampled.sampled_token_ids)
        elif step.followed:  # ... moved on by the drafts each sequence accepts, found on the device
            verified = slot_layout.verify(slot_drafts, sampled.sampled_token_ids, device_drafts)
            self._last_sampled = SampledTokens(seq_ids, verified.newest, advance=verified.advance)
        drafts_ahead = step.followed and drafts_on_device and (bool(drafts) or next_cap > 0)
        if drafts_ahead:
            # The engine follows only a pure decode step so (every row sampled, in order).
            assert not attn_metadata.prefills and len(sample_rows) == input_ids.shape[0], \
                "a followed step that verifies or drafts decodes only"
        if self.mtp is not None and step.followed:
            # The next step runs before this one's tokens reach the host (and may overwrite its
            # hidden states): the MTP module takes this step in now, its tokens from the device.
            assert self._last_sampled is not None
            if drafts_ahead:
                starts = list(itertools.accumulate((len(d) + 1 for d in slot_drafts), initial=0))[:-1]
                self._last_sampled.drafts = self.mtp.draft_in_flight(
                    chunks, self.sequences, hidden, positions, attn_metadata, sampled.sampled_token_ids, seq_ids,
                    starts, None if verified is None else verified.accepted, next_cap)
            else:
                self.mtp.feed_in_flight(chunks, hidden, self._last_sampled, self.sequences, attn_metadata)
        elif self.token_history is not None and drafts_ahead and next_cap > 0:
            # The next step's n-gram drafts, from the context on the device (its newest token too).
            assert self._last_sampled is not None
            self._last_sampled.drafts = self._ngram_drafts_ahead(positions, attn_metadata, self._last_sampled.tokens,
                                                                 verified, next_cap)
        done = None
        if step.followed and self.device.type == "cuda":  # the next step launches before this one's frame
            done = torch.cuda.Event()
            done.record()
        return InFlightStep(events, QueuedSampling(step.message_id, chunks, drafts, seq_ids, slot_drafts, states,
                                                   hidden, logits, metadata, may_redraw, rng_states, sampled,
                                                   step, self._launches, done, device_drafts, verified,
                                                   num_proposed))

    @torch.inference_mode()
    def finish(self, step: InFlightStep) -> StepOutput:
        """The launched step's output: the step's one wait for the device (the frame's copy),
        then its tokens go to the grammars, the sequences and the MTP module."""
        if step.finished is not None:
            return step.finished
        q, events = step.sampling, step.events
        assert q is not None and q.sampled is not None, "a step is finished once"
        sampled, q.sampled = q.sampled, None
        # A step launched after this one is queued behind it on the compute stream: the frame
        # is packed on a stream of its own, after this step's sampler only. That step is the
        # successor once it has sampled (launched in full); while it is still being launched
        # (finishing this one early, `_launch_chunks`), it re-reads a redrawn token itself.
        behind = self._launches > q.launch_index
        successor = self._latest if behind and self._latest is not step else None
        relaunch: tuple[SampledTokens, set[int]] | None = None
        with self._frame_stream(q.sampled_event if behind else None):
            packed = self._pack(q, sampled, q.verified)
            del sampled
            tokens = packed.frame.token_ids.tolist()
            if q.may_redraw and UNSETTLED_TOKEN in tokens:
                # Rare: a token was drawn from a kept set the GPU kernel could not settle. Sample
                # the step again with every set settled, from the same seeded generator states,
                # so seeded requests still draw what they would have drawn in any batch.
                unsettled = [seq_id for seq_id, token in zip(q.seq_ids, tokens, strict=True)
                             if token == UNSETTLED_TOKEN]
                # A step launched behind this one has drawn from these generators already; the
                # redraw (which draws as much noise as the first draw) must not rewind them.
                advanced = [g.get_state() if g is not None and behind else None
                            for g in q.metadata.generators]
                _restore_generators(q.metadata.generators, q.rng_states)
                redrawn = self.sampler(q.logits, q.metadata, settle_kept_sets=True)
                _restore_generators(q.metadata.generators, advanced)
                packed = self._pack(q, redrawn)
                tokens = packed.frame.token_ids.tolist()
                if behind:
                    relaunch = SampledTokens(q.seq_ids, redrawn.sampled_token_ids), set(unsettled)
        if relaunch is not None:
            if successor is not None:
                self._relaunch(successor, *relaunch)
            else:
                self._redrawn_ahead = relaunch
        counts = packed.frame.num_tokens.tolist()
        slot_starts = list(itertools.accumulate(counts, initial=0))
        runs = [tokens[start:start + n] for start, n in zip(slot_starts, counts, strict=False)]
        result: FrameBuffer = packed.buffer
        pending = packed.mask_ids_pending
        if self.guided is not None:
            # A grammar that completes inside a run ends it there; rare, so the packed frame is
            # shortened on the host rather than packed again on the device.
            kept = self.guided.accept(q.seq_ids, runs, events)
            if kept != counts:
                if pending is not None:
                    pending.synchronize()
                    pending = None
                result = pack_step_frame(shorten_step_frame(packed.frame, kept))
                runs = [run[:n] for run, n in zip(runs, kept, strict=True)]
                counts = kept
        for state, run in zip(q.states, runs, strict=True):
            state.output_token_ids.extend(run)
        if q.drafts and q.step.followed:
            accepted = dict(zip(q.seq_ids, counts, strict=True))
            if successor is not None:
                if successor.sampling is not None:
                    successor.sampling.chunks = _moved_on(successor.sampling.chunks, successor.sampling.drafts,
                                                          accepted)
            else:  # finished early, inside the successor's launch: that launch moves its chunks on
                self._accepted_ahead = accepted
        if q.drafts:
            # Drafts looked up on the device may come up short: only the real ones count.
            proposed = [len(d) for d in q.slot_drafts] if q.num_proposed is None else q.num_proposed.tolist()
            events.num_verified_sequences = sum(1 for n in proposed if n)
            events.num_draft_tokens = sum(proposed)
            events.num_accepted_draft_tokens = sum(len(run) - 1 for run, n in zip(runs, proposed, strict=True) if n)
        if self.mtp is not None and not q.step.followed:  # a followed step fed it at launch
            # After the frame: the host's share of drafting (inputs of each MTP pass) then runs
            # while the engine takes in the frame, and the passes while it schedules.
            self._after_frame = functools.partial(
                self.mtp.feed, q.chunks, q.hidden, dict(zip(q.seq_ids, counts, strict=True)), q.drafts,
                self.sequences, self._next_draft_cap)
        return StepOutput(result, events, pending, packed.mask_bits)

    def _logits(self, hidden: torch.Tensor, sample_rows: list[int]) -> torch.Tensor:
        """float32 logits of the sampled rows."""
        return self.model.compute_logits(input_prep.sampled_rows(hidden, sample_rows, self.device)).float()

    def _tracks_grammar(self, seq_ids: list[int]) -> bool:
        """Whether a sampled row's grammar advances by the sequence's last token (on the host)."""
        return self.guided is not None and any(self.guided.tracks(seq_id) for seq_id in seq_ids)

    def _frame_stream(self, after: torch.cuda.Event | None) -> contextlib.AbstractContextManager:
        """Where a frame is packed: the current stream, or (`after` given) the frame stream,
        once `after` is reached on the compute stream."""
        if after is None:
            return contextlib.nullcontext()
        if self._frame_side_stream is None:
            self._frame_side_stream = torch.cuda.Stream(self.device)
        self._frame_side_stream.wait_event(after)
        return torch.cuda.stream(self._frame_side_stream)

    def _relaunch(self, successor: InFlightStep, tokens: SampledTokens, redrawn: set[int]) -> None:
        """Run the launched successor again if it read a token that was drawn again (`redrawn`
        sequences) as an in-flight token: same inputs, same K/V slots, and each seeded
        generator back where it was before its first run."""
        q = successor.sampling
        if q is None or not any(seq_id in redrawn for _, seq_id in input_prep.in_flight_slots(q.chunks, q.drafts)):
            return
        # A redrawn row truncates, so the successor, which samples it too, kept its generators' states.
        assert q.may_redraw, "a successor of a redrawn row records its generator states"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        _restore_generators(q.metadata.generators, q.rng_states)
        again = self._launch_chunks(q.step, successor.events, tokens)
        assert again.sampling is not None
        again.sampling.launch_index = q.launch_index
        successor.sampling = again.sampling

    def after_frame(self) -> None:
        """Run the finished step's work that its frame did not wait for. A failure surfaces at
        the next `launch`, which fails that step."""
        work, self._after_frame = self._after_frame, None
        if work is None:
            return
        try:
            with torch.inference_mode():
                work()
        except Exception as exc:  # noqa: BLE001 - re-raised by the next launch
            self._after_frame_error = exc

    def _pack(self, q: QueuedSampling, sampled: SamplerOutput,
              verified: VerifiedSlots | None = None) -> PackedStep:
        """`verified`: the accept counts of `sampled`, found at launch (a redraw finds its own)."""
        assert self.packer is not None, "only the sampling rank packs"
        return self.packer.pack(slot_layout.step_slots(q.message_id, q.seq_ids, q.slot_drafts, sampled,
                                                       q.device_drafts, verified))

    def _take_step_input(self, step: StepInput) -> WorkerEvents:
        """The step's sequence and grammar bookkeeping, before any chunk runs."""
        events = WorkerEvents()
        for seq_id in step.freed_seq_ids:
            self.sequences.pop(seq_id, None)
            if self.guided is not None:
                self.guided.free(seq_id)
        for new in step.new_sequences:
            self._register(new)
        if self.guided is not None:
            for request in step.grammar_requests:
                self.guided.request(request.seq_id, request.spec)
            self.guided.poll(events)
        elif step.grammar_requests:
            events.grammar_failed.extend([r.seq_id, "structured output is disabled on this server"]
                                         for r in step.grammar_requests)
        return events

    def _register(self, new: NewSequence) -> None:
        generator = None
        if new.params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(new.params.seed)
        self.sequences[new.seq_id] = WorkerSequence(
            new.prompt_token_ids, new.params, new.return_sampling_mask, generator, new.sampling_mask_bitmap
        )
        if self.guided is not None:
            self.guided.on_prompt(new.seq_id, new.prompt_token_ids)

    def follow(self) -> bool:
        """Ranks > 0: run the forward passes rank 0 plans, taking part in their collectives.
        Returns False when rank 0 says stop."""
        plan = self._plans.receive()
        if plan is None:
            return False
        with torch.inference_mode():
            input_ids, positions, attn_metadata, sample_rows = input_prep.prepare_inputs(
                plan.chunks, plan.drafts, self.block_size, self.device)
            if input_prep.in_flight_slots(plan.chunks, plan.drafts):  # tokens only rank 0 sampled, from rank 0
                broadcast_from_first(input_ids)
            hidden = self._forward(input_ids, positions, attn_metadata)
            if sample_rows:
                self.model.compute_logits(input_prep.sampled_rows(hidden, sample_rows, self.device))
        return True

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the step's tokens; on CUDA only queued (a graph replay or eager kernels)."""
        if self.token_history is not None:  # before any later step of these sequences reads it
            self.token_history.write(attn_metadata.slot_mapping, input_ids)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(input_ids.shape[0], attn_metadata):
            return self.cuda_graphs.run(input_ids, positions, attn_metadata)
        return self.model(input_ids, positions, attn_metadata, self.kv_caches)

    def _bitmask(self, seq_ids: list[int], slot_drafts: list[list[int]], drafted: bool) -> torch.Tensor | None:
        """The step's grammar bitmask on the device (None when no row is constrained).

        Filled on the host after the forward pass was queued, so on a GPU the fill overlaps the
        model; the pinned copy does not wait for the GPU either."""
        if self.guided is None:
            return None
        bitmask = self.guided.bitmask(seq_ids, slot_drafts if drafted else None, pinned=self.device.type == "cuda")
        if bitmask is None or self.device.type != "cuda":
            return bitmask
        return bitmask.to(self.device, non_blocking=True)

    def _propose_drafts(self, chunks: list[ChunkInput], predecessor: SampledTokens | None) -> dict[int, list[int]]:
        """Draft tokens per decoding sequence that has lookahead slots reserved (non-empty only).
        Drafts the step before made on the device (MTP, or n-gram lookup; that step still running)
        are placeholders here, written on the device (`SampledTokens.place`); only sequences in
        flight have them."""
        drafts = {}
        if self.mtp is not None:
            self.mtp.take_drafts(self.sequences)
        if predecessor is not None and predecessor.drafts is not None:
            width = predecessor.drafts.shape[1]
            return {c.seq_id: [0] * min(c.num_lookahead, width) for c in chunks
                    if c.num_lookahead > 0 and c.token_ids[-1] == IN_FLIGHT_TOKEN}
        for chunk in chunks:
            # A sequence in flight without drafts from the device: its context is not on the host.
            if chunk.num_lookahead <= 0 or chunk.token_ids[-1] == IN_FLIGHT_TOKEN:
                continue
            state = self.sequences[chunk.seq_id]
            if self.mtp is not None:
                draft = state.pending_drafts[: chunk.num_lookahead]
            elif self.proposer is not None:
                context = np.array(state.prompt_token_ids + state.output_token_ids, dtype=np.int64)
                draft = self.proposer.propose(context, chunk.num_lookahead)
            else:
                draft = []
            if draft:
                drafts[chunk.seq_id] = list(draft)
        return drafts

    def _ngram_drafts_ahead(self, positions: torch.Tensor, meta: AttentionMetadata, newest: torch.Tensor,
                            verified: VerifiedSlots | None, cap: int) -> torch.Tensor:
        """`cap` n-gram drafts per sequence of a pure decode step sent with a successor (int64
        [B, cap], on the device): each sequence's context runs to the token after its last
        accepted row (`newest`), whose position is its first row's plus the tokens it accepted."""
        spec = self.config.speculative
        assert self.token_history is not None and spec is not None
        first_rows = None if verified is None else verified.rows[:, 0]  # on the device already
        return ngram_device.propose_after_step(self.token_history, meta.decode_block_tables, self.block_size,
                                               positions, first_rows, None if verified is None else verified.accepted,
                                               newest, spec.prompt_lookup_min, spec.prompt_lookup_max, cap)

    def shutdown(self) -> None:
        """Leave the tensor-parallel group (every rank calls this; rank 0 first releases the
        other ranks' `follow` loops). The CUDA graphs go first: graphs holding captured NCCL
        collectives keep a communicator from tearing down (pytorch/pytorch#115388)."""
        self._plans.release_followers()
        self._plans.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.cuda_graphs = None
        self._after_frame = None
        self.mtp = None
        # The KV cache and the last steps' tensors go now too, not whenever the last reference
        # to this runner does: an engine made next in this process sizes its KV cache by the
        # device's free memory.
        self.kv_caches = []
        self._last_sampled = self._latest = self._redrawn_ahead = None
        self._metadata_cache = input_prep.SamplingMetadataCache()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        destroy_tensor_parallel()


def _moved_on(chunks: list[ChunkInput], drafts: dict[int, list[int]], counts: dict[int, int]) -> list[ChunkInput]:
    """Where the successor of a verify step really ran: each of its in-flight sequences one
    position further on per draft that step accepted (the device moved them at launch; the
    host's chunks learn it with the frame), for the work that reads them after its own frame."""
    moved = {seq_id for _, seq_id in input_prep.in_flight_slots(chunks, drafts)}
    return [msgspec.structs.replace(c, start=c.start + counts[c.seq_id] - 1)
            if c.seq_id in moved and c.seq_id in counts else c for c in chunks]


def _to_host(values: torch.Tensor) -> torch.Tensor:
    """A copy on the host, queued without waiting on CUDA (complete once a later wait on the
    stream is); read it only after such a wait."""
    if values.device.type != "cuda":
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host


def _restore_generators(generators: list[torch.Generator | None], states: list[torch.Tensor | None]) -> None:
    """Put each seeded row's generator back to its saved state (rows without either are left)."""
    for g, state in zip(generators, states, strict=True):
        if g is not None and state is not None:
            g.set_state(state)


def _empty_frame(message_id: int) -> StepFrame:
    return StepFrame(message_id, np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64))
