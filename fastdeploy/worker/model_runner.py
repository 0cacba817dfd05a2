"""Runs one step on the device: inputs → model → logits → sampler → packed frame."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
from collections.abc import Generator
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from fastdeploy.common.config import EngineConfig, ModelConfig, resolve_dtype
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.common.step_frame import FrameBuffer, StepFrame, pack_step_frame, shorten_step_frame
from fastdeploy.common.step_input import ChunkInput, NewSequence, StepInput, WorkerEvents
from fastdeploy.common.step_slots import StepSlots
from fastdeploy.distributed.parallel_state import (
    all_reduce_min,
    broadcast_bytes,
    destroy_tensor_parallel,
    init_tensor_parallel,
    tp_rank,
    tp_size,
)
from fastdeploy.distributed.shard import local_config
from fastdeploy.model_executor.cuda_graph import CudaGraphRunner, DecodeBuffers
from fastdeploy.model_executor.device_inputs import upload, upload_int64
from fastdeploy.model_executor.layers.attention import allocate_kv_caches
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata, PrefillSeq
from fastdeploy.model_executor.layers.sample import kept_set_gpu
from fastdeploy.model_executor.layers.sample.metadata import RowGroups, SamplerOutput, SamplingMetadata
from fastdeploy.model_executor.layers.sample.sampler import UNSETTLED_TOKEN, Sampler
from fastdeploy.model_executor.model_loader import get_model, tokenizer_path
from fastdeploy.model_executor.models.mtp import load_mtp_head, shipped_mtp_head
from fastdeploy.ops.step_packer import (
    pack_step_slots_copying_ids,
    pack_step_slots_split,
    pack_step_slots_tensor,
    unpack_step_frame_op,
)
from fastdeploy.spec_decode.guided_drafts import fill_draft_bitmasks, trim_drafts_to_grammar
from fastdeploy.spec_decode.mtp_pass import MTPPass
from fastdeploy.spec_decode.mtp_proposer import MTPProposer, MTPWork, PendingDrafts
from fastdeploy.spec_decode.ngram_proposer import NgramProposer
from fastdeploy.spec_decode.verification import accept_counts
from fastdeploy.worker.guided_runtime import GuidedRuntime
from fastdeploy.worker.kv_cache_sizing import num_kv_blocks
from fastdeploy.worker.step_output import LaunchedStep, StepOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WorkerSequence:
    """Device-side state the worker keeps for a sequence between steps."""

    prompt_token_ids: list[int]
    params: SamplingParams
    return_sampling_mask: bool
    generator: torch.Generator | None
    sampling_mask_bitmap: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    pending_drafts: list[int] = field(default_factory=list)  # MTP: drafted after the last step


@dataclass
class WorkerInfo:
    """What the engine learns from the worker once it is up."""

    num_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: list[int]
    max_position_embeddings: int


class ForwardPlan(msgspec.Struct, array_like=True):
    """What rank 0 tells the other tensor-parallel ranks to compute this step."""

    chunks: list[ChunkInput]
    drafts: dict[int, list[int]]


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, dist_init_file: str | None = None) -> None:
        """`rank`, `dist_init_file`: this worker's place in a tensor-parallel group of
        `config.tensor_parallel_size` processes (rank 0 samples and talks to the engine)."""
        self.config = config
        self.device = torch.device(config.device)
        tp = config.tensor_parallel_size
        if tp > 1:
            if config.speculative is not None and config.speculative.method == "mtp":
                raise ValueError("MTP speculation does not support --tensor-parallel-size > 1 yet")
            if self.device.type == "cuda":
                self.device = torch.device("cuda", rank)
                torch.cuda.set_device(self.device)
            init_tensor_parallel(rank, tp, dist_init_file, self.device)
        self.dtype = _DTYPES[resolve_dtype(config.dtype, config.device)]
        torch.manual_seed(config.seed)
        self.model, self.model_config = get_model(
            config.model, config.load_format, dtype=self.dtype, device=self.device, seed=config.seed
        )
        # This rank's share of the attention heads: what its KV cache holds.
        cache_model_config = local_config(self.model_config, tp)
        self.block_size = config.cache.block_size
        # Every rank must agree on the pool the engine hands out block ids from.
        self.num_blocks = all_reduce_min(config.cache.num_blocks or num_kv_blocks(
            self.model, cache_model_config, config, self.dtype, self.device
        ))
        # One spare block past the engine's pool: padded rows of a captured decode batch write there.
        self.kv_caches = allocate_kv_caches(cache_model_config, self.num_blocks + 1, self.block_size, self.dtype,
                                            self.device)
        self.cuda_graphs: CudaGraphRunner | None = None
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        # A verifying step has a decode row per slot: 1 + drafts per sequence; so has an MTP catch-up.
        max_decode_rows = config.scheduler.max_num_seqs * (
            1 + (config.speculative.num_speculative_tokens if config.speculative else 0))
        max_blocks_per_seq = -(-config.scheduler.max_model_len // self.block_size)
        pad_slot = self.num_blocks * self.block_size
        if use_graphs:
            self.cuda_graphs = CudaGraphRunner(self.model, self.kv_caches, max_decode_rows, max_blocks_per_seq,
                                               self.block_size, pad_slot)
            self.cuda_graphs.capture()
        self.sampler = Sampler()
        # Masked frames' ids go to the host on this stream, beside the next step's compute.
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._plan_encoder = msgspec.msgpack.Encoder()
        self._plan_decoder = msgspec.msgpack.Decoder(ForwardPlan)
        spec = config.speculative
        self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) \
            if spec is not None and spec.method == "ngram" else None
        self.mtp: MTPProposer | None = None
        if spec is not None and spec.method == "mtp":
            head = load_mtp_head(spec.model or shipped_mtp_head(config.model), self.model_config, self.dtype,
                                 self.device)
            one_layer = dataclasses.replace(self.model_config, num_hidden_layers=1)
            mtp_cache = allocate_kv_caches(one_layer, self.num_blocks + 1, self.block_size, self.dtype, self.device)[0]
            buffers = DecodeBuffers(max_decode_rows, max_blocks_per_seq, self.block_size, pad_slot, self.device) \
                if use_graphs else None
            mtp_pass = MTPPass(head, self.model, mtp_cache, buffers)
            mtp_pass.capture()
            self.mtp = MTPProposer(mtp_pass, spec.num_speculative_tokens, self.block_size, self._prepare_inputs)
        # MTP: the last step's drafts, still on their way to the host, and the sequences they are for.
        self._mtp_pending: tuple[PendingDrafts, list[int]] | None = None
        self.sequences: dict[int, WorkerSequence] = {}
        self.guided: GuidedRuntime | None = None
        if config.guided_decoding_backend != "off":
            self.guided = GuidedRuntime(tokenizer_path(config.model, config.tokenizer), self.model_config.vocab_size,
                                        list(self.model_config.eos_token_ids), config.grammar_compile_timeout_s,
                                        config.grammar_cache_mb * 1024 * 1024, config.reasoning_parser,
                                        backend=config.guided_decoding_backend)
        if rank == 0:  # the rank that samples
            self._warm_up_sampler()

    def _warm_up_sampler(self) -> None:
        """Samples a few made-up rows of every kind once before serving: greedy, truncating
        (peaked and flat logits), plain, with logprobs; with and without sampling masks where
        they are on, and a step of greedy rows alone.

        On CUDA the sampler's Triton kernels compile here instead of inside the first
        requests' steps, and what compiling leaves on the heap is among the start-up objects the
        process then freezes out of the garbage collector's walks (`startup_heap`). Every row has
        a seeded generator of its own: the global random state is left as it was."""
        v = self.model_config.vocab_size
        params = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.95, logprobs=1),
                  SamplingParams(top_p=0.95), SamplingParams(top_k=50, top_p=0.9), SamplingParams()]
        gen = torch.Generator(self.device).manual_seed(0)
        logits = torch.randn(len(params), v, generator=gen, device=self.device) * 4.0
        logits[2] *= 0.1  # flat: its top-p set outgrows the prefilter's candidates
        batches = [(params, False)]
        if self.config.enable_keep_sampling_mask:
            # Masked rows of every kind, and a step whose masked rows are all greedy (no kept sets).
            batches += [(params, True), (params[:1] * 2, True)]
        for rows, mask in batches:
            states = [WorkerSequence([0], p, mask, torch.Generator(self.device).manual_seed(i))
                      for i, p in enumerate(rows)]
            self.sampler(logits[:len(rows)], self._sampling_metadata(states), settle_kept_sets=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def info(self) -> WorkerInfo:
        mc: ModelConfig = self.model_config
        return WorkerInfo(self.num_blocks, self.block_size, mc.vocab_size, list(mc.eos_token_ids),
                          mc.max_position_embeddings)

    def _register(self, new: NewSequence) -> None:
        generator = None
        if new.params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(new.params.seed)
        self.sequences[new.seq_id] = WorkerSequence(
            new.prompt_token_ids, new.params, new.return_sampling_mask, generator, new.sampling_mask_bitmap
        )
        if self.guided is not None:
            self.guided.on_prompt(new.seq_id, new.prompt_token_ids)

    def execute(self, step: StepInput) -> StepOutput:
        """Run one step; return its packed frame and its non-token events."""
        return self.launch(step).result()

    def launch(self, step: StepInput) -> LaunchedStep:
        """Queue one step's work; the returned step's `result()` waits for it.

        On CUDA everything up to the frame's copy to the host is queued without waiting for the
        device, so the caller's thread is free while the model runs (the engine cuts the last
        step's sampling masks in that time). Each step's result must be taken before the next
        step is launched.
        """
        return LaunchedStep(self._step_stages(step))

    @torch.inference_mode()
    def _step_stages(self, step: StepInput) -> Generator[None, None, StepOutput]:
        """One step as a generator that pauses once the step's device work is queued (`LaunchedStep`)."""
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
        if not step.chunks:
            return StepOutput(pack_step_frame(_empty_frame(step.message_id)), events)

        drafts = self._propose_drafts(step.chunks)
        if drafts and self.guided is not None:
            trim_drafts_to_grammar(self.guided.states, drafts)
            drafts = {seq_id: d for seq_id, d in drafts.items() if d}
        # Drafts only extend decode chunks, which the step lists first: the decode prefix stays one.
        chunks = [_with_draft(c, drafts[c.seq_id]) if c.seq_id in drafts else c for c in step.chunks]
        sampled_chunks = [c for c in chunks if c.sample]
        seq_ids = [c.seq_id for c in sampled_chunks]
        slot_drafts = [drafts.get(seq_id, []) for seq_id in seq_ids]
        if tp_size() > 1:
            broadcast_bytes(self._plan_encoder.encode(ForwardPlan(chunks, drafts)))
        input_ids, positions, attn_metadata, sample_rows = self._prepare_inputs(chunks, drafts)
        hidden = self._forward(input_ids, positions, attn_metadata)
        if not sampled_chunks:
            if self.mtp is not None:
                self._mtp_step(chunks, hidden, {}, drafts)
            return StepOutput(pack_step_frame(_empty_frame(step.message_id)), events)
        # Everything up to the pack is queued on the device without waiting for it: the host
        # builds the sampler's inputs and fills the grammar bitmask while the GPU runs the model.
        logits = self.model.compute_logits(_rows(hidden, sample_rows, self.device)).float()
        states = [self.sequences[seq_id] for seq_id in seq_ids]
        metadata = self._sampling_metadata(_slot_states(states, slot_drafts) if drafts else states)
        metadata.token_bitmask = self._bitmask(seq_ids, slot_drafts, bool(drafts))
        # Only the CUDA kept-set kernel can leave a truncating row unsettled; only then may the
        # step be sampled again, and only then are the seeded generators' states worth keeping.
        may_redraw = kept_set_gpu.uses_fast_path(self.device) and bool(metadata.row_groups.host[1])
        rng_states = [g.get_state() if g is not None else None for g in metadata.generators] if may_redraw else []

        def pack(output: SamplerOutput) -> tuple[torch.Tensor, StepFrame, list[int], torch.cuda.Event | None,
                                                 np.ndarray | None]:
            slots = _step_slots(step.message_id, seq_ids, slot_drafts, output)
            pending = None
            bits = _bitmaps_to_host(slots.mask_bits) if slots.mask_bits is not None else None
            if slots.has_mask and slots.token_ids.is_cuda and not drafts:
                # The head of the frame comes back first; the mask ids (most of a masked frame's
                # bytes) cross PCIe later, on a copy engine, beside the next step's kernels.
                packed, frame, pending = pack_step_slots_copying_ids(slots, self._copy_stream)
            elif slots.has_mask and slots.token_ids.is_cuda:
                # Drafts: a kernel gathers the accepted slots' ids behind the head.
                packed = pack_step_slots_split(slots)
                pending = torch.cuda.Event()
                pending.record()
                frame = unpack_step_frame_op(packed)
            else:
                # The step's one synchronisation: the packer's copy of the frame to the host.
                packed = pack_step_slots_tensor(slots)
                frame = unpack_step_frame_op(packed)
            return packed, frame, frame.token_ids.tolist(), pending, bits

        sampled = self.sampler(logits, metadata, settle_kept_sets=False)
        yield  # the step's device work is queued: the caller may use its thread until `result()`
        packed, frame, tokens, pending, bits = pack(sampled)
        del sampled
        if may_redraw and UNSETTLED_TOKEN in tokens:
            # Rare: a token was drawn from a kept set the GPU kernel could not settle. Sample
            # the step again with every set settled, from the same seeded generator states,
            # so seeded requests still draw what they would have drawn in any batch.
            for g, state in zip(metadata.generators, rng_states):
                if g is not None:
                    g.set_state(state)
            packed, frame, tokens, pending, bits = pack(self.sampler(logits, metadata, settle_kept_sets=True))
        counts = frame.num_tokens.tolist()
        slot_starts = list(itertools.accumulate(counts, initial=0))
        runs = [tokens[start:start + n] for start, n in zip(slot_starts, counts)]
        result: FrameBuffer = memoryview(packed.numpy())
        if self.guided is not None:
            # A grammar that completes inside a run ends it there; rare, so the packed frame is
            # shortened on the host rather than packed again on the device.
            kept = self.guided.accept(seq_ids, runs, events)
            if kept != counts:
                if pending is not None:
                    pending.synchronize()
                    pending = None
                result = pack_step_frame(shorten_step_frame(frame, kept))
                runs = [run[:n] for run, n in zip(runs, kept)]
                counts = kept
        for state, run in zip(states, runs):
            state.output_token_ids.extend(run)
        if drafts:
            events.num_verified_sequences = len(drafts)
            events.num_draft_tokens = sum(len(d) for d in slot_drafts)
            events.num_accepted_draft_tokens = sum(len(run) - 1 for run, d in zip(runs, slot_drafts) if d)
        if self.mtp is not None:
            self._mtp_step(chunks, hidden, dict(zip(seq_ids, counts)), drafts)
        return StepOutput(result, events, pending, bits)

    def follow(self) -> bool:
        """Ranks > 0: run the forward passes rank 0 plans, taking part in their collectives.
        Returns False when rank 0 says stop."""
        payload = broadcast_bytes(None)
        if not payload:
            return False
        plan = self._plan_decoder.decode(payload)
        with torch.inference_mode():
            input_ids, positions, attn_metadata, sample_rows = self._prepare_inputs(plan.chunks, plan.drafts)
            hidden = self._forward(input_ids, positions, attn_metadata)
            if sample_rows:
                self.model.compute_logits(_rows(hidden, sample_rows, self.device))
        return True

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the step's tokens; on CUDA only queued (a graph replay or eager kernels)."""
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(input_ids.shape[0], attn_metadata):
            return self.cuda_graphs.run(input_ids, positions, attn_metadata)
        return self.model(input_ids, positions, attn_metadata, self.kv_caches)

    def _bitmask(self, seq_ids: list[int], slot_drafts: list[list[int]], drafted: bool) -> torch.Tensor | None:
        """The step's grammar bitmask on the device (None when no row is constrained).

        Filled on the host after the forward pass was queued, so on a GPU the fill overlaps the
        model; the pinned copy does not wait for the GPU either."""
        if self.guided is None:
            return None
        if drafted:
            bitmask = fill_draft_bitmasks([self.guided.states.get(s) for s in seq_ids], slot_drafts,
                                          self.model_config.vocab_size, pinned=self.device.type == "cuda")
        else:
            bitmask = self.guided.bitmask(seq_ids, pinned=self.device.type == "cuda")
        if bitmask is None or self.device.type != "cuda":
            return bitmask
        return bitmask.to(self.device, non_blocking=True)

    def shutdown(self) -> None:
        """Leave the tensor-parallel group (every rank calls this; rank 0 first releases the
        other ranks' `follow` loops). The CUDA graphs go first: graphs holding captured NCCL
        collectives keep a communicator from tearing down (pytorch/pytorch#115388)."""
        if tp_size() > 1 and tp_rank() == 0:
            broadcast_bytes(b"")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.cuda_graphs = None
        self.mtp = None
        gc.collect()
        destroy_tensor_parallel()

    def _mtp_step(self, chunks: list[ChunkInput], hidden: torch.Tensor, accepted: dict[int, int],
                  drafts: dict[int, list[int]]) -> None:
        """Feed the MTP module this step's new (hidden j-1, token j) pairs; keep its drafts for the next step."""
        work = []
        offset = 0  # flat index of the chunk's first token in `hidden`
        for chunk in chunks:
            n = len(chunk.token_ids)
            start = chunk.start
            # Positions start .. start+valid-1 hold hidden states of tokens that stand.
            valid = n - len(drafts.get(chunk.seq_id, ())) - 1 + accepted.get(chunk.seq_id, 0) if chunk.sample else n
            if valid > 0:
                state = self.sequences[chunk.seq_id]
                first = 0 if start == 0 else start + 1
                newest = start + valid
                last = min(newest, len(chunk.block_ids) * self.block_size - 1)  # only reserved slots
                work.append(MTPWork(
                    chunk.seq_id, first, _token_range(state, first, last + 1),
                    [-1 if j == 0 else offset + j - 1 - start for j in range(first, last + 1)],
                    chunk.block_ids, chunk.sample and last == newest))
            offset += n
        # Read back when the next step needs them: meanwhile the GPU runs the passes.
        self._mtp_pending = (self.mtp.propose(work, hidden), [c.seq_id for c in chunks if c.sample])

    def _take_mtp_drafts(self) -> None:
        """Hand the last step's MTP drafts to their sequences (one wait, one copy already made)."""
        if self._mtp_pending is None:
            return
        pending, seq_ids = self._mtp_pending
        self._mtp_pending = None
        drafts = pending.resolve()
        for seq_id in seq_ids:
            state = self.sequences.get(seq_id)
            if state is not None:  # not freed since
                state.pending_drafts = drafts.get(seq_id, [])

    def _propose_drafts(self, chunks: list[ChunkInput]) -> dict[int, list[int]]:
        """Draft tokens per decoding sequence that has lookahead slots reserved (non-empty only)."""
        drafts = {}
        if self.mtp is not None:
            self._take_mtp_drafts()
        for chunk in chunks:
            if chunk.num_lookahead <= 0:
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

    def _prepare_inputs(
        self, chunks: list[ChunkInput], drafts: dict[int, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        sample_rows: list[int] = []  # flat token index of every sampled slot
        bs = self.block_size
        for chunk in chunks:
            start = len(token_ids)
            n = len(chunk.token_ids)
            token_ids.extend(chunk.token_ids)
            pos = range(chunk.start, chunk.start + n)
            positions.extend(pos)
            slots.extend(chunk.block_ids[p // bs] * bs + p % bs for p in pos)
            context_len = chunk.start + n
            # Decode chunks come first, so decodes form a prefix. A drafted decode is a run of
            # decode rows, row j attending to the cache up to its own position: all of the
            # step's K/V is written before any query reads it, so this is causal attention,
            # and verification steps batch (and replay as CUDA graphs) like plain decodes.
            if chunk.sample and (n == 1 or chunk.seq_id in drafts) and not prefills:
                decode_tables.extend([chunk.block_ids] * n)
                decode_lens.extend(range(chunk.start + 1, context_len + 1))
            else:
                table = torch.tensor(chunk.block_ids[: (context_len + bs - 1) // bs], dtype=torch.long)
                prefills.append(PrefillSeq(start, n, context_len, table))
            if chunk.sample:
                # A drafted chunk samples at its last real token and at every draft.
                num_slots = len(drafts.get(chunk.seq_id, ())) + 1
                sample_rows.extend(range(start + n - num_slots, start + n))
        width = max((len(t) for t in decode_tables), default=0)
        tables = np.zeros((len(decode_tables), width), dtype=np.int64)
        for row, table in enumerate(decode_tables):
            tables[row, : len(table)] = table
        ids_d, positions_d, slots_d, lens_d, tables_d = upload_int64(
            [token_ids, positions, slots, decode_lens, tables], self.device
        )
        metadata = AttentionMetadata(
            slot_mapping=slots_d,
            num_decode_tokens=len(decode_tables),
            decode_block_tables=tables_d.view(len(decode_tables), width),
            decode_context_lens=lens_d,
            prefills=prefills,
            block_size=bs,
        )
        return ids_d, positions_d, metadata, sample_rows

    def _sampling_metadata(self, states: list[WorkerSequence]) -> SamplingMetadata:
        """The sampler's per-row inputs, built on the host and moved in one non-blocking copy."""
        params = [s.params for s in states]
        temperature = np.array([p.temperature for p in params], dtype=np.float32)
        top_k = np.array([p.effective_top_k for p in params], dtype=np.int64)
        top_p = np.array([p.top_p for p in params], dtype=np.float32)
        min_p = np.array([p.min_p for p in params], dtype=np.float32)
        # The row split the sampler would otherwise find with nonzero() on the device.
        greedy = temperature <= 0
        truncated = ~greedy & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))
        groups = [np.flatnonzero(m).astype(np.int64) for m in (greedy, truncated, ~greedy & ~truncated)]
        columns = [temperature, top_k, top_p, min_p, *groups,
                   np.array([p.repetition_penalty for p in params], dtype=np.float32),
                   np.array([p.presence_penalty for p in params], dtype=np.float32),
                   np.array([p.frequency_penalty for p in params], dtype=np.float32)]
        # Optional inputs follow, each present only when some row needs it.
        wants_mask = np.array([s.return_sampling_mask for s in states], dtype=np.bool_)
        wants_bits = wants_mask & np.array([s.sampling_mask_bitmap for s in states], dtype=np.bool_)
        if wants_mask.any():
            slots = np.full(len(states), -1, dtype=np.int32)
            slots[groups[0]] = kept_set_gpu.GREEDY_SLOT
            slots[groups[1]] = np.arange(len(groups[1]), dtype=np.int32)
            columns += [wants_mask, slots]
            if wants_bits.any():
                columns.append(wants_bits)
        histories = None
        if any(p.has_penalties for p in params):
            histories = [_padded([s.prompt_token_ids for s in states]), _padded([s.output_token_ids for s in states])]
            columns.extend(histories)
        bias = [(row, int(token_id), value) for row, p in enumerate(params) for token_id, value in p.logit_bias.items()]
        if bias:
            rows, cols, values = zip(*bias)
            columns += [np.array(rows, np.int64), np.array(cols, np.int64), np.array(values, np.float32)]
        on_device = iter(upload(columns, self.device))
        t, k, p_, m, g_rows, t_rows, p_rows, rep, pres, freq = (next(on_device) for _ in range(10))
        mask, slots = (next(on_device), next(on_device)) if wants_mask.any() else (None, None)
        bitmap_rows = next(on_device) if wants_bits.any() else None
        prompt_ids = output_ids = None
        if histories is not None:
            prompt_ids, output_ids = (next(on_device).view(h.shape) for h in histories)
        bias_rows, bias_cols, bias_values = (next(on_device) for _ in range(3)) if bias else (None, None, None)
        wants_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata(
            temperature=t,
            top_k=k,
            top_p=p_,
            min_p=m,
            repetition_penalty=rep,
            presence_penalty=pres,
            frequency_penalty=freq,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            logit_bias_rows=bias_rows,
            logit_bias_cols=bias_cols,
            logit_bias_values=bias_values,
            generators=[s.generator for s in states],
            max_num_logprobs=max(wants_logprobs, default=-1),
            logprobs_mode=self.config.logprobs_mode,
            return_sampling_mask=mask,
            mask_bitmap_rows=bitmap_rows,
            row_groups=RowGroups(g_rows, t_rows, p_rows, tuple(g.tolist() for g in groups), mask_slots=slots,
                                 truncated_top_k=top_k[groups[1]] if mask is not None else None),
        )


def _padded(rows: list[list[int]]) -> np.ndarray:
    """int64 [len(rows), width], right-padded with -1."""
    width = max(1, max(len(r) for r in rows))
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _rows(hidden: torch.Tensor, sample_rows: list[int], device: torch.device) -> torch.Tensor:
    """hidden[sample_rows]; a decode step samples every row in order and needs no gather."""
    if sample_rows == list(range(hidden.shape[0])):
        return hidden
    index, = upload_int64([sample_rows], device)
    return hidden[index]


def _empty_frame(message_id: int) -> StepFrame:
    return StepFrame(message_id, np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64))


def _with_draft(chunk: ChunkInput, draft: list[int]) -> ChunkInput:
    """The chunk extended by its draft tokens (their K/V goes into the reserved lookahead slots)."""
    return msgspec.structs.replace(chunk, token_ids=chunk.token_ids + draft)


def _slot_states(states: list[WorkerSequence], drafts: list[list[int]]) -> list[WorkerSequence]:
    """One sampler row per verified slot: slot i sees the sequence's output plus its first i drafts,
    so penalties treat a draft exactly as if it had already been generated."""
    rows = []
    for state, draft in zip(states, drafts):
        rows.append(state)
        if state.params.has_penalties:
            rows.extend(dataclasses.replace(state, output_token_ids=state.output_token_ids + draft[:i])
                        for i in range(1, len(draft) + 1))
        else:  # the history is never read for this row: no copies on the per-step path
            rows.extend([state] * len(draft))
    return rows


def _token_range(state: WorkerSequence, start: int, end: int) -> list[int]:
    """Tokens start..end-1 of prompt + output, without building the whole sequence."""
    prompt, output = state.prompt_token_ids, state.output_token_ids
    n = len(prompt)
    if start >= n:
        return output[start - n:end - n]
    return prompt[start:end] + output[:max(0, end - n)]


def _bitmaps_to_host(bits: torch.Tensor) -> np.ndarray:
    """The step's bitmaps on the host. On CUDA the copy is queued into pinned memory ahead of the
    frame's head, so the head's one wait covers it: a blocking copy after the head would be a
    second synchronisation in the step."""
    if not bits.is_cuda:
        return bits.numpy()
    host = torch.empty(bits.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(bits, non_blocking=True)
    return host.numpy()


def _step_slots(message_id: int, seq_ids: list[int], slot_drafts: list[list[int]], out: SamplerOutput) -> StepSlots:
    """The sampler's rows (each sequence's verified slots, one after another) as the [B, S] slot
    layout the packer op reads, with the accept counts decided on the device: a sequence keeps
    its drafts up to the first one its own sample disagrees with, plus that sample. Slots a
    sequence did not verify are padding and never accepted."""
    sampled = out.sampled_token_ids
    device = sampled.device
    batch = len(seq_ids)
    width = 1 + max(len(d) for d in slot_drafts)
    if width == 1:  # no drafts: row b is slot (b, 0), every slot is accepted
        seq_ids_d, = upload_int64([seq_ids], device)
        slots = StepSlots(message_id=message_id, seq_ids=seq_ids_d,
                          accept_counts=torch.ones(batch, dtype=torch.int32, device=device),
                          token_ids=sampled.view(batch, 1),
                          num_logprobs=-1 if out.logprobs is None else out.logprobs.shape[1] - 1)
        if out.logprobs is not None:
            slots.lp_ids, slots.lp_values = out.logprob_token_ids.unsqueeze(1), out.logprobs.unsqueeze(1)
            slots.ranks = out.sampled_token_ranks.view(batch, 1)
        if out.mask_offsets is not None:
            slots.mask_offsets, slots.mask_ids, slots.logz = out.mask_offsets, out.mask_ids, out.logz.view(batch, 1)
        if out.mask_bits is not None:
            slots.mask_bits = out.mask_bits.view(batch, 1, -1)
        return slots
    starts = list(itertools.accumulate((len(d) + 1 for d in slot_drafts), initial=0))[:-1]
    index = np.full((batch, width), -1, dtype=np.int64)
    drafted = np.full((batch, width - 1), -1, dtype=np.int64)  # -1 never equals a sampled token
    for b, (start, draft) in enumerate(zip(starts, slot_drafts)):
        index[b, :len(draft) + 1] = np.arange(start, start + len(draft) + 1)
        drafted[b, :len(draft)] = draft
    seq_ids_d, index_d, drafted_d = upload_int64([seq_ids, index, drafted], device)
    index_d, drafted_d = index_d.view(batch, width), drafted_d.view(batch, width - 1)
    valid = index_d >= 0
    rows = index_d.clamp(min=0)
    tokens = sampled[rows]
    slots = StepSlots(
        message_id=message_id,
        seq_ids=seq_ids_d,
        accept_counts=accept_counts(tokens, drafted_d),
        token_ids=tokens,
        num_logprobs=-1 if out.logprobs is None else out.logprobs.shape[1] - 1,
    )
    if out.logprobs is not None:
        slots.lp_ids, slots.lp_values, slots.ranks = out.logprob_token_ids[rows], out.logprobs[rows], \
            out.sampled_token_ranks[rows]
    if out.mask_offsets is not None:
        # Padding slots get empty CSR rows; real rows keep their order, so mask_ids stay as they are.
        lengths = (out.mask_offsets[1:] - out.mask_offsets[:-1])[rows].masked_fill(~valid, 0)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=device)
        offsets[1:] = lengths.flatten().cumsum(0)
        slots.mask_offsets, slots.mask_ids, slots.logz = offsets, out.mask_ids, out.logz[rows]
    if out.mask_bits is not None:
        slots.mask_bits = out.mask_bits[rows]  # padding slots are never accepted, so never read
    return slots
