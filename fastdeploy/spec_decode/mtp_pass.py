"""One pass of the MTP module: rows (token j, hidden j-1) in; hidden j and the greedy draft for
j+1 out, both left on the device.

A pure decode batch (every row attends to the MTP cache up to its own position) replays a
CUDA graph captured per padded batch size, like the target's decode steps; prefill and mixed
passes, passes past the captured sizes, `--enforce-eager` and CPU run eagerly.

`fill` is the pass for a step after which no drafts are taken (the draft policy's cap 0): it
writes the rows' K/V into the MTP cache, which later drafts attend to, and skips the draft
itself, whose vocabulary projection costs most of a pass on a small model (its own graphs).
A step without drafts sent ahead skips even that: its pairs are kept by slot and filled in
when the sequence next drafts (`fastdeploy/spec_decode/mtp_gaps.py`).
"""

from __future__ import annotations

import functools

import torch

from fastdeploy.model_executor.cuda_graph import CudaGraphRunner, DecodeBuffers, GraphRunner, capture_sizes
from fastdeploy.model_executor.device_inputs import upload_int64
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata
from fastdeploy.model_executor.models.llama import LlamaForCausalLM
from fastdeploy.model_executor.models.mtp import MTPHead


class MTPPass:
    def __init__(self, head: MTPHead, target: LlamaForCausalLM, kv_cache: torch.Tensor,
                 buffers: DecodeBuffers | None = None, decode: CudaGraphRunner | None = None,
                 num_drafts: int = 0) -> None:
        """`buffers`: the graphs' fixed inputs (CUDA); None runs every pass eagerly. `decode`:
        the target's captured decode steps, which `draft_after_decode` follows with up to
        `num_drafts` drafts."""
        self.head = head
        self.target = target
        self.kv_cache = kv_cache
        self.buffers = buffers
        self.graphs: GraphRunner[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.fill_graphs: GraphRunner[torch.Tensor] | None = None
        self.decode = decode
        if buffers is not None:
            weight = target.model.embed_tokens.weight
            self.prev_hidden = torch.zeros(buffers.capacity, target.config.hidden_size, dtype=weight.dtype,
                                           device=weight.device)
            self.graphs = GraphRunner(self._graph_forward, capture_sizes(buffers.capacity), "MTP")
            self.fill_graphs = GraphRunner(self._graph_fill, capture_sizes(buffers.capacity), "MTP cache fill")
        # Per draft cap: the passes that draft for a step sent ahead, after a decode step replayed.
        self.draft_graphs: dict[int, GraphRunner[torch.Tensor]] = {}
        if decode is not None:
            device = decode.buffers.input_ids.device
            # The tokens a decode step sampled, copied here: the sampler's output moves per step.
            self.sampled_ids = torch.zeros(decode.buffers.capacity, dtype=torch.long, device=device)
            # Per drafting sequence: its first row in the step, the tokens it accepted there, and
            # whether the entry is one (rows past the step's sequences are padding).
            self.run_starts = torch.zeros(decode.buffers.capacity, dtype=torch.long, device=device)
            self.run_accepted = torch.ones(decode.buffers.capacity, dtype=torch.long, device=device)
            self.run_live = torch.zeros(decode.buffers.capacity, dtype=torch.bool, device=device)
            for cap in range(1, num_drafts + 1):
                self.draft_graphs[cap] = GraphRunner(functools.partial(self._graph_draft_after_decode, cap=cap),
                                                     decode.graphs.sizes, f"MTP drafts after decode (cap {cap})")

    def capture(self) -> None:
        if self.graphs is not None and self.fill_graphs is not None:
            self.graphs.capture()
            self.fill_graphs.capture()
        for graphs in self.draft_graphs.values():
            graphs.capture()

    def _hidden(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        embeds = self.target.model.embed_tokens(input_ids)
        return self.head(embeds, prev_hidden, positions, meta, self.kv_cache, self.target.model.norm)

    def _draft(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden).argmax(dim=1)

    def _graph_forward(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.buffers
        assert b is not None, "graphs are captured only with buffers"
        hidden = self._hidden(b.input_ids[:batch], self.prev_hidden[:batch], b.positions[:batch], b.metadata(batch))
        # Every row drafts: the rows that matter vary per step while the graph is fixed, and at
        # these sizes the extra rows of the head's GEMM cost less than a second graph would.
        return hidden, self._draft(hidden)

    def _graph_fill(self, batch: int) -> torch.Tensor:
        b = self.buffers
        assert b is not None, "graphs are captured only with buffers"
        return self._hidden(b.input_ids[:batch], self.prev_hidden[:batch], b.positions[:batch], b.metadata(batch))

    def _graph_draft_after_decode(self, batch: int, cap: int) -> torch.Tensor:
        """`draft_chain` over a decode step of `batch` rows the target replayed, read from its
        graph buffers; padding entries attend to nothing and write to the spare slot."""
        decode = self.decode
        assert decode is not None, "captured only after the target's decode graphs"
        t = decode.buffers
        live = self.run_live[:batch]
        rows = torch.where(live, self.run_starts[:batch] + self.run_accepted[:batch] - 1, 0)
        return self.draft_chain(self.sampled_ids[:batch], decode.graphs.outputs[batch], t.positions[:batch],
                                t.context_lens[:batch], t.block_tables[:batch], t.block_size, rows, live, cap,
                                t.pad_slot)

    def draft_chain(self, row_tokens: torch.Tensor, step_hidden: torch.Tensor, positions: torch.Tensor,
                    context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                    rows: torch.Tensor | None, live: torch.Tensor | None, cap: int, pad_slot: int = -1
                    ) -> torch.Tensor:
        """`cap` drafts for each sequence of a decode step (its rows at `positions`, with
        `context_lens` and `block_tables`): the pair p+1 of every row (its hidden state and the
        token sampled there), then each sequence drafts from its row in `rows` (None: every row
        is one sequence's), and again from each draft. `live` (None: all): which entries of
        `rows` are sequences; the others attend to nothing and write to `pad_slot`. Eager ops
        only: `_graph_draft_after_decode` captures them. int64 [len(rows), cap]."""
        positions, meta = next_position_metadata(positions, context_lens, block_tables, block_size, pad_slot)
        # An unsettled row's negative marker is clamped, as `SampledTokens.fill` does.
        hidden = self._hidden(row_tokens.clamp(min=0), step_hidden, positions, meta)
        lens, tables = meta.decode_context_lens, meta.decode_block_tables
        if rows is not None:
            hidden, positions = hidden.index_select(0, rows), positions.index_select(0, rows)
            lens, tables = lens.index_select(0, rows), tables.index_select(0, rows)
        if live is not None:
            lens = torch.where(live, lens, 0)
        drafted = self._draft(hidden)
        drafts = [drafted]
        for _ in range(1, cap):
            positions, pass_meta = next_position_metadata(positions, lens, tables, block_size, pad_slot)
            lens = pass_meta.decode_context_lens
            hidden = self._hidden(drafted, hidden, positions, pass_meta)
            drafted = self._draft(hidden)
            drafts.append(drafted)
        return torch.stack(drafts, dim=1)

    def drafts_after_decode_graph(self, num_rows: int, meta: AttentionMetadata) -> bool:
        """Whether the target ran a decode step of `num_rows` rows (and `meta`) as a graph that
        `draft_after_decode` has passes for."""
        return bool(self.draft_graphs) and self.decode is not None and self.decode.can_run(num_rows, meta)

    def draft_after_decode(self, row_tokens: torch.Tensor, starts: list[int], accepted: torch.Tensor | None,
                           cap: int) -> torch.Tensor:
        """`cap` drafts (int64 [len(starts), cap], fresh) for each sequence of the decode step the
        target just replayed (`drafts_after_decode_graph`): `row_tokens`, the token sampled at each
        of its rows; `starts`, each sequence's first row; `accepted`, the tokens each accepted
        there (on the device; None: one each)."""
        assert self.decode is not None
        n, b = row_tokens.shape[0], len(starts)
        batch = self.decode.graphs.padded_size(n)
        self.sampled_ids[:n].copy_(row_tokens)
        starts_d, live_d = upload_int64([starts + [0] * (batch - b), [1] * b + [0] * (batch - b)],
                                        row_tokens.device)
        self.run_starts[:batch].copy_(starts_d)
        self.run_live[:batch].copy_(live_d)
        if accepted is None:
            self.run_accepted[:b].fill_(1)
        else:
            self.run_accepted[:b].copy_(accepted)
        return self.draft_graphs[cap].replay(batch)[:b].clone()

    def fill(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> None:
        """The rows' K/V into the MTP cache, as `__call__` writes them, and nothing drafted."""
        n = input_ids.shape[0]
        if self.fill_graphs is not None and self.buffers is not None and self.buffers.fits(n, meta):
            batch = self.fill_graphs.padded_size(n)
            self.buffers.load(input_ids, positions, meta, batch)
            self.prev_hidden[:n].copy_(prev_hidden)
            self.fill_graphs.replay(batch)
            return
        self._hidden(input_ids, prev_hidden, positions, meta)

    def __call__(
        self,
        input_ids: torch.Tensor,  # int64 [n]: token j per row
        prev_hidden: torch.Tensor,  # [n, H]: hidden j-1 per row (target's or the MTP module's)
        positions: torch.Tensor,  # int64 [n]: j
        meta: AttentionMetadata,
        draft_rows: torch.Tensor | None,  # int64 [d]: the rows whose drafts are wanted; None: all
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [d, H], draft tokens int64 [d]) of `draft_rows`, in fresh tensors that the next
        pass does not overwrite."""
        n = input_ids.shape[0]
        if self.graphs is not None and self.buffers is not None and self.buffers.fits(n, meta):
            batch = self.graphs.padded_size(n)
            self.buffers.load(input_ids, positions, meta, batch)
            self.prev_hidden[:n].copy_(prev_hidden)
            hidden, tokens = self.graphs.replay(batch)
            if draft_rows is None:
                return hidden[:n].clone(), tokens[:n].clone()
            return hidden.index_select(0, draft_rows), tokens.index_select(0, draft_rows)
        hidden = self._hidden(input_ids, prev_hidden, positions, meta)
        if draft_rows is not None:
            hidden = hidden.index_select(0, draft_rows)
        if hidden.shape[0] == 0:  # a pass that only fills the MTP cache
            return hidden, torch.zeros(0, dtype=torch.long, device=hidden.device)
        return hidden, self._draft(hidden)


def next_position_metadata(positions: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                           block_size: int, pad_slot: int = -1) -> tuple[torch.Tensor, AttentionMetadata]:
    """The positions and attention metadata of pair p+1 for each row of a decode step at p: the
    same blocks, one more token of context, the slot of p+1 read from the row's block table on
    the device. A real row's next position lies in its reserved blocks (the caller checks that
    on the host), so its table entry there is loaded. Rows of length 0 (a graph's padding) write
    to `pad_slot` and attend to nothing, as in the target's step."""
    shifted = positions + 1
    live = context_lens > 0
    column = (shifted // block_size).clamp(max=block_tables.shape[1] - 1).unsqueeze(1)
    slots = torch.where(live, block_tables.gather(1, column).squeeze(1) * block_size + shifted % block_size, pad_slot)
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=positions.shape[0], decode_block_tables=block_tables,
                             decode_context_lens=torch.where(live, context_lens + 1, 0), prefills=[],
                             block_size=block_size)
    return shifted, meta
