"""MTP drafting inside the worker: after each step, bring the MTP module's K/V up to the
accepted tokens, then draft the next step's tokens greedily and recursively.

Pair j is (target hidden at j-1, token j) and predicts token j+1; position 0 pairs with
a zero hidden state. Each step processes the pairs that became known: for a chunk that
computed positions s..s+v-1 (v = accepted positions), pairs s+1..s+v; pair s was done
the step before. The drafts written past the accepted tokens are overwritten by real
pairs once the target has verified those positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata
from fastdeploy.model_executor.models.mtp import MTPHead
from fastdeploy.worker.step_input import ChunkInput

PrepareInputs = Callable[[list[ChunkInput], dict], tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]]


@dataclass
class MTPWork:
    """One sequence's new pairs this step."""

    seq_id: int
    start: int  # position of the first pair
    tokens: list[int]  # token j of each pair
    hidden_rows: list[int]  # row of hidden j-1 in the step's target hidden states; -1: zeros
    block_ids: list[int]
    draft: bool  # the last pair is the sequence's newest token: draft after it


class MTPProposer:
    def __init__(self, head: MTPHead, target: torch.nn.Module, num_speculative_tokens: int,
                 kv_cache: torch.Tensor, block_size: int, prepare_inputs: PrepareInputs) -> None:
        self.head = head
        self.target = target
        self.num_speculative_tokens = num_speculative_tokens
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.prepare_inputs = prepare_inputs

    def _run(self, chunks: list[ChunkInput], prev_hidden: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        input_ids, positions, meta, sample_rows = self.prepare_inputs(chunks, {})
        embeds = self.target.model.embed_tokens(input_ids)
        out = self.head(embeds, prev_hidden, positions, meta, self.kv_cache, self.target.model.norm)
        return out, sample_rows

    def propose(self, work: list[MTPWork], step_hidden: torch.Tensor) -> dict[int, list[int]]:
        """Update the MTP K/V with `work`; return up to k greedy drafts per drafting sequence."""
        work = [w for w in work if w.tokens]
        if not work:
            return {}
        # Drafting chunks last-token-sampled, so the prefix of single-pair chunks batches as decodes.
        work.sort(key=lambda w: not (w.draft and len(w.tokens) == 1))
        rows = torch.tensor([r for w in work for r in w.hidden_rows], device=step_hidden.device)
        prev = step_hidden[rows.clamp(min=0)]
        prev[rows < 0] = 0
        chunks = [ChunkInput(w.seq_id, w.tokens, w.start, w.block_ids, w.draft) for w in work]
        out, sample_rows = self._run(chunks, prev)
        drafting = [w for w in work if w.draft]
        if not drafting:
            return {}
        hidden = out[torch.tensor(sample_rows, device=out.device)]
        tokens = self.target.compute_logits(hidden).argmax(dim=1)
        drafts = {w.seq_id: [t] for w, t in zip(drafting, tokens.tolist())}
        for r in range(1, self.num_speculative_tokens):
            # Draft r sits at the newest token's position + r; stop where no slot was reserved.
            live = [(i, w) for i, w in enumerate(drafting)
                    if w.start + len(w.tokens) - 1 + r < len(w.block_ids) * self.block_size]
            if not live:
                break
            index = torch.tensor([i for i, _ in live], device=out.device)
            chunks = [ChunkInput(w.seq_id, [drafts[w.seq_id][-1]], w.start + len(w.tokens) - 1 + r, w.block_ids, True)
                      for _, w in live]
            out, _ = self._run(chunks, hidden[index])
            hidden = out
            tokens = self.target.compute_logits(out).argmax(dim=1).tolist()
            drafting = [w for _, w in live]
            for w, t in zip(drafting, tokens):
                drafts[w.seq_id].append(t)
        return drafts
