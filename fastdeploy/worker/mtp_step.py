"""The MTP speculative step: after each step the MTP module takes in the step's new (hidden j-1,
token j) pairs and drafts the next step's tokens, which reach the host when that step asks."""

from __future__ import annotations

import dataclasses
import functools

import torch

from fastdeploy.common.config import EngineConfig, ModelConfig
from fastdeploy.common.step_input import ChunkInput
from fastdeploy.model_executor.cuda_graph import CudaGraphRunner, DecodeBuffers
from fastdeploy.model_executor.device_inputs import upload_int64
from fastdeploy.model_executor.layers.attention import allocate_kv_caches
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata
from fastdeploy.model_executor.models.llama import LlamaForCausalLM
from fastdeploy.model_executor.models.mtp import load_mtp_head, shipped_mtp_head
from fastdeploy.spec_decode.mtp_gaps import PairStore, split_gaps
from fastdeploy.spec_decode.mtp_pass import MTPPass, next_position_metadata
from fastdeploy.spec_decode.mtp_proposer import NO_DRAFTS, MTPProposer, MTPWork, PendingDrafts
from fastdeploy.worker.graph_capture import DecodeShape
from fastdeploy.worker.in_flight_step import SampledTokens
from fastdeploy.worker.input_prep import prepare_inputs
from fastdeploy.worker.sequence_state import WorkerSequence


class MTPStep:
    """The MTP head, its one-layer KV cache and (on CUDA) its captured passes, and the last
    step's drafts still on their way to the host."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, model_config: ModelConfig,
                 dtype: torch.dtype, device: torch.device, num_blocks: int, shape: DecodeShape,
                 use_graphs: bool, decode_graphs: CudaGraphRunner | None = None) -> None:
        """`decode_graphs`: the target's captured decode steps, which a step without drafts
        sent ahead is filled after in a graph of its own."""
        spec = config.speculative
        assert spec is not None and spec.method == "mtp"
        self.block_size = shape.block_size
        # Prompt blocks' last hidden states are kept only for hits of the prefix cache.
        self.keeps_prompt_block_ends = config.cache.enable_prefix_caching
        # The most rows one pass over kept pairs takes: the largest step the KV sizing measured
        # the activation peak of.
        self.max_refill_rows = config.scheduler.max_num_batched_tokens
        head = load_mtp_head(spec.model or shipped_mtp_head(config.model), model_config, dtype, device)
        one_layer = dataclasses.replace(model_config, num_hidden_layers=1)
        mtp_cache = allocate_kv_caches(one_layer, num_blocks + 1, self.block_size, dtype, device)[0]
        self.pairs = PairStore((num_blocks + 1) * self.block_size, model_config.hidden_size, dtype, device)
        buffers = DecodeBuffers(shape.max_decode_rows, shape.max_blocks_per_seq, self.block_size, shape.pad_slot,
                                device) if use_graphs else None
        self.mtp_pass = MTPPass(head, model, mtp_cache, buffers, decode_graphs, spec.num_speculative_tokens)
        self.mtp_pass.capture()
        self.proposer = MTPProposer(self.mtp_pass, spec.num_speculative_tokens, self.block_size,
                                    functools.partial(prepare_inputs, block_size=self.block_size, device=device))
        # The last step's drafts, still on their way to the host, and the sequences they are for.
        self._pending: tuple[PendingDrafts, list[int]] | None = None

    def feed(self, chunks: list[ChunkInput], hidden: torch.Tensor, accepted: dict[int, int],
             drafts: dict[int, list[int]], sequences: dict[int, WorkerSequence], max_drafts: int | None = None
             ) -> None:
        """Feed the MTP module this step's new (hidden j-1, token j) pairs; keep its drafts (at most
        `max_drafts`, where given) for the next step."""
        self._take_in_kept(chunks, sequences)
        self._keep_prompt_block_ends(chunks, hidden, sequences)
        work = self._work(chunks, accepted, drafts, sequences, in_flight=False)
        # Read back when the next step needs them: meanwhile the GPU runs the passes.
        pending = self.proposer.propose(work, hidden, max_drafts, stored_hidden=self.pairs.hidden)
        self._pending = (pending, [c.seq_id for c in chunks if c.sample])

    def feed_in_flight(self, chunks: list[ChunkInput], hidden: torch.Tensor, sampled: SampledTokens,
                       sequences: dict[int, WorkerSequence], meta: AttentionMetadata) -> None:
        """`feed` for a step without drafts whose successor launches before its tokens reach the
        host (asynchronous scheduling; the engine announces cap 0 for that successor): each
        sampled chunk's newest token is read from `sampled` on the device, and the step's
        hidden states are read now, before the next forward pass reuses their memory.
        `meta`: the step's own attention inputs on the device."""
        seq_ids = list(sampled.seq_ids)
        if not meta.prefills and self._next_slots_reserved(chunks, seq_ids):
            # A pure decode step: its pairs are kept by slot, taken in when the sequence next
            # needs the MTP cache (mtp_gaps.py); one row per sequence, in `seq_ids` order.
            self.pairs.keep(meta.slot_mapping, hidden, sampled.tokens)
            for seq_id in seq_ids:
                state = sequences.get(seq_id)
                if state is not None:  # not freed since
                    state.mtp_gap += 1
        else:
            self._take_in_kept(chunks, sequences)
            self._keep_prompt_block_ends(chunks, hidden, sequences)
            work = self._work(chunks, dict.fromkeys(seq_ids, 1), {}, sequences, in_flight=True)
            self.proposer.propose(work, hidden, 0, functools.partial(sampled.fill, device=hidden.device),
                                  stored_hidden=self.pairs.hidden)
        self._pending = (NO_DRAFTS, seq_ids)

    def draft_in_flight(self, chunks: list[ChunkInput], sequences: dict[int, WorkerSequence], hidden: torch.Tensor,
                        positions: torch.Tensor, meta: AttentionMetadata, row_tokens: torch.Tensor,
                        seq_ids: list[int], starts: list[int], accepted: torch.Tensor | None, cap: int
                        ) -> torch.Tensor | None:
        """`feed` for a pure decode step (a run of decode rows per sequence: its newest token, then
        any drafts it verified) whose successor launches before its tokens reach the host, and
        takes `cap` drafts per sequence from the device: int64 [len(seq_ids), cap] (None for cap 0).

        Every row r of the step (position p, hidden row r, `row_tokens[r]` sampled there) gives the
        pair at p + 1; a sequence's pairs past its accepted tokens are written too, beyond its
        newest token, where the next pass over that sequence writes again before any row reads
        them. Each sequence (its run starting at row `starts[i]`) drafts from its last accepted
        row (`accepted`, on the device; None: one each), then from each draft in turn. After a
        decode graph of the target, all of it replays as one graph; otherwise `positions` and
        `meta`, the step's own inputs on the device, give the passes' inputs."""
        self._pending = (NO_DRAFTS, seq_ids)
        self._take_in_kept(chunks, sequences)
        n = row_tokens.shape[0]
        if cap > 0 and self.mtp_pass.drafts_after_decode_graph(n, meta):
            return self.mtp_pass.draft_after_decode(row_tokens, starts, accepted, cap)
        if cap == 0:
            shifted, next_meta = next_position_metadata(positions, meta.decode_context_lens, meta.decode_block_tables,
                                                        self.block_size)
            # An unsettled marker never reaches here: the step settled its kept sets.
            self.mtp_pass.fill(row_tokens.clamp(min=0), hidden, shifted, next_meta)
            return None
        rows = None
        if accepted is not None:
            rows = upload_int64([starts], hidden.device)[0] + accepted.long() - 1
        return self.mtp_pass.draft_chain(row_tokens, hidden, positions, meta.decode_context_lens,
                                         meta.decode_block_tables, self.block_size, rows, None, cap)

    def _take_in_kept(self, chunks: list[ChunkInput], sequences: dict[int, WorkerSequence]) -> None:
        """Before a pass over `chunks`: the MTP cache's pairs that steps without drafts kept
        aside, for every chunk's sequence that has them, in one pass. A chunk's first row is the
        position after the last kept one: steps that keep pairs have no drafts, so the host's
        positions of the step after them are exact."""
        gaps = []
        for chunk in chunks:
            state = sequences.get(chunk.seq_id)
            if state is None or state.mtp_gap == 0:
                continue
            if chunk.start > 0:  # a chunk from position 0 computes the sequence again (preempted)
                gaps.append((chunk.start, state.mtp_gap, chunk.block_ids))
            state.mtp_gap = 0
        for batch in split_gaps(gaps, self.max_refill_rows):
            tokens, prev_hidden, positions, meta = self.pairs.refill_inputs(batch, self.block_size,
                                                                            self.pairs.hidden.device)
            self.mtp_pass.fill(tokens, prev_hidden, positions, meta)

    def _keep_prompt_block_ends(self, chunks: list[ChunkInput], hidden: torch.Tensor,
                                sequences: dict[int, WorkerSequence]) -> None:
        """Keep the target's hidden state at the last position of every prompt block the step
        computed, at that position's KV slot: a later sequence whose prompt starts with the
        block takes it from the prefix cache, and its first pair after the cached prefix is
        (that hidden state, its own next token). The engine caches prompt blocks only with MTP."""
        if not self.keeps_prompt_block_ends:
            return
        bs = self.block_size
        rows, slots = [], []
        offset = 0  # flat index of the chunk's first token in `hidden`, as in `_work`
        for chunk in chunks:
            state = sequences.get(chunk.seq_id)
            if state is not None and chunk.start < len(state.prompt_token_ids):  # decode rows hold none
                end = min(chunk.start + len(chunk.token_ids), len(state.prompt_token_ids))
                for p in range((chunk.start // bs + 1) * bs - 1, end, bs):
                    rows.append(offset + p - chunk.start)
                    slots.append(self._slot(chunk.block_ids, p))
            offset += len(chunk.token_ids)
        if rows:
            rows_d, slots_d = upload_int64([rows, slots], hidden.device)
            self.pairs.hidden.index_copy_(0, slots_d, hidden.index_select(0, rows_d))

    def _slot(self, block_ids: list[int], position: int) -> int:
        """The KV slot of `position` in a sequence with the block table `block_ids`."""
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _next_slots_reserved(self, chunks: list[ChunkInput], seq_ids: list[int]) -> bool:
        """Whether the step is one token per sampled row, in the sampler's row order (`seq_ids`),
        and every row's next position has a reserved cache slot."""
        if len(chunks) != len(seq_ids):
            return False
        bs = self.block_size
        return all(chunk.seq_id == seq_id and len(chunk.token_ids) == 1 and chunk.start > 0
                   and chunk.start + 1 < len(chunk.block_ids) * bs
                   for chunk, seq_id in zip(chunks, seq_ids, strict=True))

    def _work(self, chunks: list[ChunkInput], accepted: dict[int, int], drafts: dict[int, list[int]],
              sequences: dict[int, WorkerSequence], in_flight: bool) -> list[MTPWork]:
        """The step's new pairs per chunk. `in_flight`: the sampled chunks' newest tokens are
        not on the host yet."""
        work = []
        offset = 0  # flat index of the chunk's first token in `hidden`
        for chunk in chunks:
            n = len(chunk.token_ids)
            start = chunk.start
            # Positions start .. start+valid-1 hold hidden states of tokens that stand.
            valid = n - len(drafts.get(chunk.seq_id, ())) - 1 + accepted.get(chunk.seq_id, 0) if chunk.sample else n
            if valid > 0:
                state = sequences[chunk.seq_id]
                # The pair at `start` came with the step before, which computed position start - 1,
                # unless the prefix cache gave the positions before it: then its hidden state is
                # the one kept for the cached prefix's last position.
                first = 0 if start == 0 else start if chunk.after_cache_hit else start + 1
                stored_slot = self._slot(chunk.block_ids, start - 1) if chunk.after_cache_hit and start > 0 else -1
                newest = start + valid
                last = min(newest, len(chunk.block_ids) * self.block_size - 1)  # only reserved slots
                newest_pair = chunk.sample and last == newest
                on_device = in_flight and newest_pair
                tokens = (state.token_range(first, last) + [0] if on_device  # the placeholder is read on the device
                          else state.token_range(first, last + 1))
                hidden_rows = [-1 if j == 0 else offset + j - 1 - start for j in range(first, last + 1)]
                if stored_slot >= 0:
                    hidden_rows[0] = -1  # read from the kept hidden states instead
                work.append(MTPWork(chunk.seq_id, first, tokens, hidden_rows, chunk.block_ids, newest_pair,
                                    on_device, stored_slot))
            offset += n
        return work

    def take_drafts(self, sequences: dict[int, WorkerSequence]) -> None:
        """Hand the last step's drafts to their sequences (one wait, one copy already made)."""
        if self._pending is None:
            return
        pending, seq_ids = self._pending
        self._pending = None
        drafts = pending.resolve() if pending.seq_ids else {}
        for seq_id in seq_ids:
            state = sequences.get(seq_id)
            if state is not None:  # not freed since
                state.pending_drafts = drafts.get(seq_id, [])
