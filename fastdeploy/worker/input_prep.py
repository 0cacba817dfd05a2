"""A step's inputs laid out for the device: the forward pass's (token ids, positions, attention
metadata) and the sampler's (`SamplingMetadata`), each built on the host from plain lists and
moved in one non-blocking copy."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import torch

from fastdeploy.common.step_input import IN_FLIGHT_TOKEN, ChunkInput
from fastdeploy.model_executor.device_inputs import upload, upload_int64
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata, PrefillSeq
from fastdeploy.model_executor.layers.sample import kept_set_gpu
from fastdeploy.model_executor.layers.sample.metadata import RowGroups, SamplingMetadata
from fastdeploy.worker.sequence_state import WorkerSequence


def prepare_inputs(
    chunks: list[ChunkInput], drafts: dict[int, list[int]], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """The forward pass's inputs on `device`: token ids, positions, attention metadata, and the
    flat token index of every sampled slot."""
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode_tables: list[list[int]] = []  # per decode chunk: its block table, ...
    table_rows: list[int] = []  # ... and how many decode rows read it (1 + its drafts)
    decode_lens: list[int] = []
    prefills: list[PrefillSeq] = []
    sample_rows: list[int] = []  # flat token index of every sampled slot
    bs = block_size
    for chunk in chunks:
        start = len(token_ids)
        n = len(chunk.token_ids)
        if n == 1 and chunk.sample and not prefills:
            # One decode row without drafts, a busy batch's every row: the general case's
            # ranges and generators cost more than the row's own work.
            p = chunk.start
            token_ids.append(chunk.token_ids[0])
            positions.append(p)
            slots.append(chunk.block_ids[p // bs] * bs + p % bs)
            decode_tables.append(chunk.block_ids)
            table_rows.append(1)
            decode_lens.append(p + 1)
            sample_rows.append(start)
            continue
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
            decode_tables.append(chunk.block_ids)
            table_rows.append(n)
            decode_lens.extend(range(chunk.start + 1, context_len + 1))
        else:
            prefill_table = torch.tensor(chunk.block_ids[: (context_len + bs - 1) // bs], dtype=torch.long)
            prefills.append(PrefillSeq(start, n, context_len, prefill_table))
        if chunk.sample:
            # A drafted chunk samples at its last real token and at every draft.
            num_slots = len(drafts.get(chunk.seq_id, ())) + 1
            sample_rows.extend(range(start + n - num_slots, start + n))
    width = max((len(t) for t in decode_tables), default=0)
    tables = np.zeros((len(decode_tables), width), dtype=np.int64)
    for row, table in enumerate(decode_tables):
        tables[row, : len(table)] = table
    num_decode_rows = len(decode_lens)
    if num_decode_rows != len(decode_tables):  # a drafted chunk's rows share its table: filled once
        tables = np.repeat(tables, table_rows, axis=0)
    ids_d, positions_d, slots_d, lens_d, tables_d = upload_int64(
        [token_ids, positions, slots, decode_lens, tables], device
    )
    metadata = AttentionMetadata(
        slot_mapping=slots_d,
        num_decode_tokens=num_decode_rows,
        decode_block_tables=tables_d.view(num_decode_rows, width),
        decode_context_lens=lens_d,
        prefills=prefills,
        block_size=bs,
    )
    return ids_d, positions_d, metadata, sample_rows


def in_flight_slots(chunks: list[ChunkInput], drafts: dict[int, list[int]] | None = None) -> list[tuple[int, int]]:
    """(flat token index, seq_id) of every in-flight token, in the layout `prepare_inputs`
    gives; only a chunk's last token can be in flight, followed by its drafts where `drafts`
    extended the chunk."""
    slots = []
    flat = 0
    for chunk in chunks:
        flat += len(chunk.token_ids)
        at = len(chunk.token_ids) - 1 - (len(drafts.get(chunk.seq_id, ())) if drafts else 0)
        if at >= 0 and chunk.token_ids[at] == IN_FLIGHT_TOKEN:
            slots.append((flat - len(chunk.token_ids) + at, chunk.seq_id))
    return slots


def sampling_metadata(states: list[WorkerSequence], logprobs_mode: str, device: torch.device) -> SamplingMetadata:
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
    columns: list[np.ndarray] = [temperature, top_k, top_p, min_p, *groups,
               np.array([p.repetition_penalty for p in params], dtype=np.float32),
               np.array([p.presence_penalty for p in params], dtype=np.float32),
               np.array([p.frequency_penalty for p in params], dtype=np.float32)]
    # Optional inputs follow, each present only when some row needs it.
    wants_mask = np.array([s.return_sampling_mask for s in states], dtype=np.bool_)
    wants_bits = wants_mask & np.array([s.sampling_mask_bitmap for s in states], dtype=np.bool_)
    if wants_mask.any():
        host_slots = np.full(len(states), -1, dtype=np.int32)
        host_slots[groups[0]] = kept_set_gpu.GREEDY_SLOT
        host_slots[groups[1]] = np.arange(len(groups[1]), dtype=np.int32)
        columns += [wants_mask, host_slots]
        if wants_bits.any():
            columns.append(wants_bits)
    histories = None
    if any(p.has_penalties for p in params):
        histories = [_padded([s.prompt_token_ids for s in states]), _padded([s.output_token_ids for s in states])]
        columns.extend(histories)
    bias = [(row, int(token_id), value) for row, p in enumerate(params) for token_id, value in p.logit_bias.items()]
    if bias:
        rows, cols, values = zip(*bias, strict=True)
        columns += [np.array(rows, np.int64), np.array(cols, np.int64), np.array(values, np.float32)]
    on_device = iter(upload(columns, device))
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
        logprobs_mode=logprobs_mode,
        return_sampling_mask=mask,
        mask_bitmap_rows=bitmap_rows,
        row_groups=RowGroups(g_rows, t_rows, p_rows, (groups[0].tolist(), groups[1].tolist(), groups[2].tolist()),
                             mask_slots=slots, truncated_top_k=top_k[groups[1]] if mask is not None else None),
    )


class SamplingMetadataCache:
    """The last step's sampling inputs, given again while the same rows (the same sequences, in
    the same order) are sampled: a decode batch usually is, step after step, and then its inputs
    have not changed, so the host neither builds nor copies them. Only for rows without penalties
    (their token histories grow every step); the caller checks that."""

    def __init__(self) -> None:
        self._states: list[WorkerSequence] = []  # held: a freed sequence's id is not reused meanwhile
        self._mode = ""
        self._metadata: SamplingMetadata | None = None

    def get(self, states: list[WorkerSequence], logprobs_mode: str, device: torch.device) -> SamplingMetadata:
        """`sampling_metadata(states, ...)`, as a copy the caller may set fields of (a step's bitmask)."""
        same = (self._metadata is not None and logprobs_mode == self._mode and len(states) == len(self._states)
                and all(a is b for a, b in zip(states, self._states, strict=True)))
        if not same:
            self._metadata = sampling_metadata(states, logprobs_mode, device)
            self._states, self._mode = list(states), logprobs_mode
        assert self._metadata is not None
        return dataclasses.replace(self._metadata)


def _padded(rows: list[list[int]]) -> np.ndarray:
    """int64 [len(rows), width], right-padded with -1."""
    width = max(1, max(len(r) for r in rows))
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def sampled_rows(hidden: torch.Tensor, sample_rows: list[int], device: torch.device) -> torch.Tensor:
    """hidden[sample_rows]; a decode step samples every row in order and needs no gather."""
    if sample_rows == list(range(hidden.shape[0])):
        return hidden
    index, = upload_int64([sample_rows], device)
    return hidden[index]


def with_draft(chunk: ChunkInput, draft: list[int]) -> ChunkInput:
    """The chunk extended by its draft tokens (their K/V goes into the reserved lookahead slots)."""
    return msgspec.structs.replace(chunk, token_ids=chunk.token_ids + draft)


def slot_states(states: list[WorkerSequence], drafts: list[list[int]]) -> list[WorkerSequence]:
    """One sampler row per verified slot: slot i sees the sequence's output plus its first i drafts,
    so penalties treat a draft exactly as if it had already been generated."""
    rows = []
    for state, draft in zip(states, drafts, strict=True):
        rows.append(state)
        if state.params.has_penalties:
            rows.extend(dataclasses.replace(state, output_token_ids=state.output_token_ids + draft[:i])
                        for i in range(1, len(draft) + 1))
        else:  # the history is never read for this row: no copies on the per-step path
            rows.extend([state] * len(draft))
    return rows
