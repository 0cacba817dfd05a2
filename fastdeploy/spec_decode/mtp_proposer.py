"""MTP drafting inside the worker: after each step, bring the MTP module's K/V up to the
accepted tokens, then draft the next step's tokens greedily and recursively.

Pair j is (target hidden at j-1, token j) and predicts token j+1; position 0 pairs with
a zero hidden state. Each step processes the pairs that became known: for a chunk that
computed positions s..s+v-1 (v = accepted positions), pairs s+1..s+v; pair s was done
the step before. The drafts written past the accepted tokens are overwritten by real
pairs once the target has verified those positions.

A step's MTP work is one pass over every sequence's new pairs (its first draft included),
then one pass per further draft. A decoding sequence's new pairs (at most 1 + k) are decode
rows, each attending to the MTP cache up to its own position as the target's verification
rows do, so a step of decodes makes every pass a pure decode batch that replays as a CUDA
graph (`MTPPass`). Draft tokens stay on the device from pass to pass; the host reads them
once, when the next step needs them (`PendingDrafts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastdeploy.common.step_input import ChunkInput
from fastdeploy.model_executor.device_inputs import upload_int64
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata
from fastdeploy.spec_decode.mtp_pass import MTPPass

PrepareInputs = Callable[[list[ChunkInput], dict], tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]]
# Writes the in-flight token of each (input row, seq_id) slot into the input ids, on the device.
FillInFlight = Callable[[torch.Tensor, list[tuple[int, int]]], None]


@dataclass
class MTPWork:
    """One sequence's new pairs this step."""

    seq_id: int
    start: int  # position of the first pair
    tokens: list[int]  # token j of each pair
    hidden_rows: list[int]  # row of hidden j-1 in the step's target hidden states; -1: zeros
    block_ids: list[int]
    draft: bool  # the last pair is the sequence's newest token: draft after it
    # The last pair's token is still on the device (its entry in `tokens` is a placeholder).
    in_flight: bool = False
    # >= 0: the first pair's hidden state is the one kept at this KV slot (`PairStore.hidden`),
    # not a row of the step's (a chunk after a prefix-cache hit: the position before it was not
    # computed in this step).
    stored_hidden_slot: int = -1


@dataclass
class PendingDrafts:
    """A step's drafts on their way to the host, in one copy; `resolve` waits for it."""

    seq_ids: list[list[int]]  # per pass, the sequences that drafted in it, in row order
    tokens: torch.Tensor  # int64: every pass's drafts one after another, on the host
    ready: torch.cuda.Event | None = None  # CUDA: recorded after the copy was queued

    def resolve(self) -> dict[int, list[int]]:
        """Draft tokens per drafting sequence, in draft order."""
        if self.ready is not None:
            self.ready.synchronize()
        values = iter(self.tokens.tolist())
        drafts: dict[int, list[int]] = {}
        for ids in self.seq_ids:
            for seq_id in ids:
                drafts.setdefault(seq_id, []).append(next(values))
        return drafts


# The drafts of a step that drafted none: one object for every such step (they are read, never
# changed), so steps without drafts allocate no tensor for them.
NO_DRAFTS = PendingDrafts([], torch.zeros(0, dtype=torch.long))


class MTPProposer:
    def __init__(self, mtp_pass: MTPPass, num_speculative_tokens: int, block_size: int,
                 prepare_inputs: PrepareInputs) -> None:
        self.mtp_pass = mtp_pass
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        self.prepare_inputs = prepare_inputs

    def propose(self, work: list[MTPWork], step_hidden: torch.Tensor, max_drafts: int | None = None,
                fill_in_flight: FillInFlight | None = None, stored_hidden: torch.Tensor | None = None
                ) -> PendingDrafts:
        """Queue the MTP passes that take in `work` and draft up to k tokens per drafting sequence
        (k: `max_drafts` where given, at most the configured number). The first pass runs even
        for k = 0: it brings the module's K/V up to the accepted tokens, which later drafts need;
        for k = 0 it drafts nothing (`MTPPass.fill`). `fill_in_flight`: where work `in_flight`
        reads its last token; `stored_hidden`: the hidden states kept per KV slot, which work with
        a `stored_hidden_slot` reads its first pair's from."""
        device = step_hidden.device
        k = self.num_speculative_tokens
        work = [w for w in work if w.tokens]
        if not work:
            return NO_DRAFTS
        # Decode rows first; longer runs of pairs (prompt chunks) follow as prefills. The runner's
        # `prepare_inputs` lays a sampled chunk listed in its drafts argument out as decode rows.
        work.sort(key=lambda w: len(w.tokens) > 1 + k)
        as_rows: dict[int, list[int]] = {w.seq_id: [] for w in work if len(w.tokens) <= 1 + k}
        chunks = [ChunkInput(w.seq_id, w.tokens, w.start, w.block_ids, w.seq_id in as_rows) for w in work]
        input_ids, positions, meta, _ = self.prepare_inputs(chunks, as_rows)
        drafting, draft_rows, row = [], [], 0
        in_flight: list[tuple[int, int]] = []  # (input row, seq_id)
        stored: list[tuple[int, int]] = []  # (input row, KV slot of its kept hidden state)
        for w in work:
            if w.stored_hidden_slot >= 0:
                stored.append((row, w.stored_hidden_slot))
            row += len(w.tokens)
            if w.draft:
                drafting.append(w)
                draft_rows.append(row - 1)
            if w.in_flight:
                in_flight.append((row - 1, w.seq_id))
        if in_flight:
            assert fill_in_flight is not None, "work reads in-flight tokens that nothing gives"
            fill_in_flight(input_ids, in_flight)
        hidden_rows_d, draft_rows_d = upload_int64([[r for w in work for r in w.hidden_rows], draft_rows], device)
        prev = step_hidden.index_select(0, hidden_rows_d.clamp(min=0))
        prev = torch.where((hidden_rows_d >= 0).unsqueeze(1), prev, 0)
        if stored:
            assert stored_hidden is not None, "work reads kept hidden states that nothing gives"
            rows_d, slots_d = upload_int64([[r for r, _ in stored], [slot for _, slot in stored]], device)
            prev.index_copy_(0, rows_d, stored_hidden.index_select(0, slots_d))
        if max_drafts == 0:
            self.mtp_pass.fill(input_ids, prev, positions, meta)
            return NO_DRAFTS
        hidden, tokens = self.mtp_pass(input_ids, prev, positions, meta, draft_rows_d)
        passes = [tokens]
        seq_ids = [[w.seq_id for w in drafting]]
        further = k if max_drafts is None else min(k, max_drafts)
        for r in range(1, further):
            # Draft r sits at the newest token's position + r; stop where no slot was reserved.
            live = [i for i, w in enumerate(drafting) if _newest(w) + r < len(w.block_ids) * self.block_size]
            if not live:
                break
            if len(live) < len(drafting):
                (index,) = upload_int64([live], device)
                hidden, tokens = hidden.index_select(0, index), tokens.index_select(0, index)
                drafting = [drafting[i] for i in live]
            # The token ids here are placeholders: the pass reads the drafts on the device.
            chunks = [ChunkInput(w.seq_id, [0], _newest(w) + r, w.block_ids, True) for w in drafting]
            _, positions, meta, _ = self.prepare_inputs(chunks, {})
            hidden, tokens = self.mtp_pass(tokens, hidden, positions, meta, None)
            passes.append(tokens)
            seq_ids.append([w.seq_id for w in drafting])
        flat = torch.cat(passes)
        if flat.numel() == 0:
            return PendingDrafts(seq_ids, torch.zeros(0, dtype=torch.long))
        if not flat.is_cuda:
            return PendingDrafts(seq_ids, flat)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return PendingDrafts(seq_ids, host, ready)


def _newest(w: MTPWork) -> int:
    """Position of the sequence's newest token (its last pair)."""
    return w.start + len(w.tokens) - 1
