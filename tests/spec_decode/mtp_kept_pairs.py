"""The MTP cache written by steps that fill it after each step, and by steps that keep their
pairs for one later pass (`fastdeploy/spec_decode/mtp_gaps.py`): shared by the CPU test and
its CUDA twin (graphs)."""

from __future__ import annotations

import torch

from fastdeploy.common.step_input import IN_FLIGHT_TOKEN, ChunkInput
from fastdeploy.model_executor.layers.sample.sampler import UNSETTLED_TOKEN
from fastdeploy.spec_decode.mtp_gaps import PairStore, split_gaps
from fastdeploy.spec_decode.mtp_pass import MTPPass, next_position_metadata
from fastdeploy.worker.input_prep import prepare_inputs


def kept_then_taken_in(mtp_pass: MTPPass, steps: int, starts: list[int], tables: list[list[int]], hidden_size: int,
                       vocab: int, device: torch.device, max_rows: int = 1 << 20
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP cache after `steps` decode steps of sequences at `starts` (one row each, random
    hidden states and sampled tokens, an unsettled marker among them): filled step by step as
    the engine did before (`MTPPass.fill` of pair p+1 after each step), and with the pairs kept
    by slot and taken in at the end (`PairStore`), in passes of at most `max_rows` rows
(`split_gaps`). Both caches start equal."""
    bs = mtp_pass.kv_cache.shape[2]  # [2, blocks, block size, heads, dims]
    start_cache = mtp_pass.kv_cache.clone()
    store = PairStore(mtp_pass.kv_cache.shape[1] * bs, hidden_size, mtp_pass.kv_cache.dtype, device)
    written = []
    for keep in (False, True):
        mtp_pass.kv_cache.copy_(start_cache)
        g = torch.Generator().manual_seed(5)  # the same steps both ways
        for t in range(steps):
            chunks = [ChunkInput(s, [IN_FLIGHT_TOKEN], p + t, table, True) for s, (p, table)
                      in enumerate(zip(starts, tables, strict=True))]
            _, positions, meta, _ = prepare_inputs(chunks, {}, bs, device)
            hidden = torch.randn(len(chunks), hidden_size, generator=g).to(device, mtp_pass.kv_cache.dtype)
            tokens = torch.randint(0, vocab, (len(chunks),), generator=g)
            if t == 1:
                tokens[0] = UNSETTLED_TOKEN
            tokens = tokens.to(device)
            if keep:
                store.keep(meta.slot_mapping, hidden, tokens)
            else:
                shifted, next_meta = next_position_metadata(positions, meta.decode_context_lens,
                                                            meta.decode_block_tables, bs)
                mtp_pass.fill(tokens.clamp(min=0), hidden, shifted, next_meta)
        if keep:
            gaps = [(p + steps, steps, table) for p, table in zip(starts, tables, strict=True)]
            for batch in split_gaps(gaps, max_rows):
                mtp_pass.fill(*store.refill_inputs(batch, bs, device))
        written.append(mtp_pass.kv_cache.clone())
    assert not torch.equal(written[0], start_cache)
    return written[0], written[1]
