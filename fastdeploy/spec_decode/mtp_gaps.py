"""The MTP module's inputs of steps without drafts, kept per KV slot and taken in only when a
sequence drafts again.

Drafts read the MTP module's own K/V of every earlier position, so a step after which no
drafts are taken (the draft policy's cap 0) still had to run the module over its rows. On a
host-bound step that pass costs as much as it does on a busy batch: 8-13 % of a plain decode
step of the embedded model on an H200 (`benchmarks/mtp_step_cost.py`), paid on every step of a
load where drafting does not pay. Here such a step only copies what the pass would read, pair
p+1 = (target hidden at p, token sampled at p), into the slot of position p; the first pass
over the sequence that needs the cache (drafts again, or a pass that takes its rows in) first
runs the module over the pairs kept since (`PairStore.refill_inputs`), the batch's sequences
together.

One such pass takes at most a step's worth of rows (`split_gaps`: a long run without drafts is
taken in over several passes, each sequence's earlier pairs first), so it never needs more
memory than the largest step the KV sizing measured.

A pair's token is the sampled one, clamped as `SampledTokens.fill` does (a row whose token is
drawn again later keeps the first draw here, as the filled cache did: drafts, not outputs, can
differ).
"""

from __future__ import annotations

import numpy as np
import torch

from fastdeploy.model_executor.device_inputs import upload_int64
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata

Gap = tuple[int, int, list[int]]  # (position p of the next row, pairs kept before it, block table)


class PairStore:
    """Per KV slot of position p: the target's hidden state at p and the token sampled there."""

    def __init__(self, num_slots: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.hidden = torch.zeros(num_slots, hidden_size, dtype=dtype, device=device)
        self.tokens = torch.zeros(num_slots, dtype=torch.long, device=device)

    @staticmethod
    def bytes_per_slot(hidden_size: int, dtype: torch.dtype) -> int:
        return hidden_size * torch.empty(0, dtype=dtype).element_size() + 8

    def keep(self, slots: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """Row i of a decode step (at the slot `slots[i]`): its hidden state and sampled token."""
        self.hidden.index_copy_(0, slots, hidden)
        self.tokens.index_copy_(0, slots, tokens.clamp(min=0))

    def refill_inputs(self, gaps: list[Gap], block_size: int, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The MTP pass over the kept pairs of `gaps`, (position p of a sequence's next row, L
        pairs kept, its block table) each: pairs p-L+1 .. p as decode rows (each attends to the
        MTP cache up to its own position, earlier pairs of the same pass included).
        Returns (tokens, previous hidden states, positions, metadata)."""
        counts = np.array([n for _, n, _ in gaps], dtype=np.int64)
        ends = np.array([p for p, _, _ in gaps], dtype=np.int64)
        width = max(len(t) for _, _, t in gaps)
        tables = np.zeros((len(gaps), width), dtype=np.int64)
        for i, (_, _, table) in enumerate(gaps):
            tables[i, :len(table)] = table
        owner = np.repeat(np.arange(len(gaps)), counts)
        first_row = np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.repeat(ends - counts + 1, counts) + np.arange(counts.sum()) - first_row
        slots = tables[owner, positions // block_size] * block_size + positions % block_size
        before = positions - 1  # the slot whose kept pair is this position's
        sources = tables[owner, before // block_size] * block_size + before % block_size
        positions_d, slots_d, sources_d, owner_d, tables_d = upload_int64(
            [positions, slots, sources, owner, tables], device)
        meta = AttentionMetadata(slot_mapping=slots_d, num_decode_tokens=int(counts.sum()),
                                 decode_block_tables=tables_d.view(len(gaps), width).index_select(0, owner_d),
                                 decode_context_lens=positions_d + 1, prefills=[], block_size=block_size)
        return (self.tokens.index_select(0, sources_d), self.hidden.index_select(0, sources_d), positions_d, meta)


def split_gaps(gaps: list[Gap], max_rows: int) -> list[list[Gap]]:
    """`gaps` as passes of at most `max_rows` rows; a sequence's pairs, where they do not fit one
    pass, over consecutive passes in position order (a pair attends to the ones before it)."""
    passes: list[list[Gap]] = [[]]
    room = max_rows
    for end, count, table in gaps:
        first = end - count + 1
        while count > 0:
            if room == 0:
                passes.append([])
                room = max_rows
            take = min(count, room)
            passes[-1].append((first + take - 1, take, table))
            first += take
            count -= take
            room -= take
    return [p for p in passes if p]
