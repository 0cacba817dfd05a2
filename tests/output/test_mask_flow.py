"""Sampling masks from a frame to the response, through the real engine-side and caller-side
processors: stop-token and stop-string cuts, accumulation, and the public list form."""

from __future__ import annotations

import msgspec
import numpy as np
import orjson
import pytest

from fastdeploy.common.request import EngineOutputs, RequestDelta
from fastdeploy.common.sampling_masks import SamplingBitmaps, SamplingMasks, encode_buffers, logz_values
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.common.step_frame import StepFrame, pack_step_frame
from fastdeploy.entrypoints.openai.formatting import encode_json, extra_fields
from fastdeploy.output.detokenizer import TokenTexts
from fastdeploy.output.output_processor import CompletionOutput, RequestOutputState
from fastdeploy.output.token_processor import TokenProcessor
from fastdeploy.scheduler.sequence import Sequence
from tests.bitmaps import bitmap_array, bitmap_lists


def processed(processor: TokenProcessor, frame: bytes, sequences: dict[int, Sequence],
              mask_bits: np.ndarray | None = None) -> list[tuple[Sequence, RequestDelta]]:
    """One step as the engine handles it: `apply`, then `attach_masks` (the mask ids are on the host)."""
    applied = processor.apply(frame, sequences, mask_bits=mask_bits)
    processor.attach_masks(applied)
    return applied.results


def frame_of(seq_ids: list[int], tokens: list[list[int]], masks: list[list[list[int] | None]]) -> bytes:
    flat = [m for ms in masks for m in ms]
    csr = SamplingMasks.from_lists(flat)
    return pack_step_frame(StepFrame(
        message_id=1,
        seq_ids=np.array(seq_ids, dtype=np.int64),
        num_tokens=np.array([len(t) for t in tokens], dtype=np.int32),
        token_ids=np.array([t for ts in tokens for t in ts], dtype=np.int64),
        mask_offsets=csr.offsets_array(),
        mask_ids=csr.ids_array(),
        logz=-np.arange(len(flat), dtype=np.float32) / 10,
    ))


def test_token_processor_cuts_masks_at_the_finishing_token_and_drops_opted_out_rows():
    stop = 99
    sequences = {
        1: Sequence(1, "a", [5], SamplingParams(stop_token_ids=[stop]), return_sampling_mask=True),
        2: Sequence(2, "b", [5], SamplingParams(), return_sampling_mask=False),
        3: Sequence(3, "c", [5], SamplingParams(), return_sampling_mask=True),
    }
    masks = [[[1, 2], None, [stop, 100], [7]], [None], []]
    frame = frame_of([1, 2, 3], [[10, 11, stop, 12], [13], []], masks)
    out = {seq.seq_id: delta for seq, delta in processed(TokenProcessor([0], 512), frame, sequences)}
    assert out[1].token_ids == [10, 11, stop] and out[1].finish_reason == "stop"
    assert out[1].sampling_mask.to_lists() == [[1, 2], None, [stop, 100]]
    assert logz_values(out[1].logz) == pytest.approx([0.0, -0.1, -0.2])
    assert out[2].sampling_mask is None and out[2].logz is None
    assert out[3].sampling_mask.to_lists() == [] and logz_values(out[3].logz) == []
    # what the API server receives (encoded as the engine process does)
    raw = msgspec.msgpack.Encoder(enc_hook=encode_buffers).encode(EngineOutputs([out[1]]))
    back = msgspec.msgpack.decode(raw, type=EngineOutputs)
    assert back.deltas[0].sampling_mask.to_lists() == [[1, 2], None, [stop, 100]]


def test_bitmap_and_ids_sequences_of_one_frame_get_the_same_sets():
    stop = 99
    masks = [[[1, 2], None, [stop, 100], [7]], [[3, 49151]], [[0], [5, 6]]]
    tokens = [[10, 11, stop, 12], [13], [14, 15]]
    sequences = {
        1: Sequence(1, "a", [5], SamplingParams(stop_token_ids=[stop]), return_sampling_mask=True,
                    sampling_mask_bitmap=True),
        2: Sequence(2, "b", [5], SamplingParams(), return_sampling_mask=True),
        3: Sequence(3, "c", [5], SamplingParams(), return_sampling_mask=True, sampling_mask_bitmap=True),
    }
    # The worker leaves bitmap rows empty in the CSR and sends their bitmaps beside the frame, one
    # per slot [B, S, V/8] (slot 1 of sequence 2 is padding and never read).
    csr_masks = [[None] * 4, masks[1], [None, None]]
    bits = np.zeros((3, 4, 6144), dtype=np.uint8)
    for b in (0, 2):
        bits[b, :len(masks[b])] = bitmap_array(masks[b], 49152)
    bits[1, 1:] = 255
    out = {seq.seq_id: delta for seq, delta in
           processed(TokenProcessor([0], 512), frame_of([1, 2, 3], tokens, csr_masks), sequences, mask_bits=bits)}
    assert isinstance(out[1].sampling_mask, SamplingBitmaps) and isinstance(out[3].sampling_mask, SamplingBitmaps)
    assert isinstance(out[2].sampling_mask, SamplingMasks)
    assert bitmap_lists(out[1].sampling_mask) == [[1, 2], None, [stop, 100]]  # cut at the stop token
    assert out[2].sampling_mask.to_lists() == [[3, 49151]]
    assert bitmap_lists(out[3].sampling_mask) == [[0], [5, 6]]
    assert logz_values(out[3].logz) == pytest.approx([-0.5, -0.6])
    assert out[1].sampling_mask.width == 6144


@pytest.fixture(scope="module")
def tokenizer(embedded_tokenizer):
    return embedded_tokenizer


def run_deltas(tokenizer, params: SamplingParams, token_runs: list[list[int]],
               mask_runs: list[list[list[int] | None]]) -> tuple[list, CompletionOutput]:
    state = RequestOutputState(params, tokenizer, TokenTexts(tokenizer))
    output = CompletionOutput()
    chunks = []
    sequences = {1: Sequence(1, "r", [5], params, return_sampling_mask=True)}
    for tokens, masks in zip(token_runs, mask_runs, strict=True):
        for _, delta in processed(TokenProcessor([0], 10_000), frame_of([1], [tokens], [masks]), sequences):
            chunk = state.update(delta)
            chunks.append(chunk)
            output.add(chunk)
            if chunk.finish_reason is not None:
                return chunks, output
    return chunks, output


def test_stop_string_inside_a_multi_token_delta_cuts_its_masks(tokenizer):
    tokens = tokenizer.encode("One two. Three four", add_special_tokens=False)
    dot = next(i for i, t in enumerate(tokens) if "." in tokenizer.decode([t]))
    rng = np.random.default_rng(0)
    masks = [sorted(rng.choice(49152, 5, replace=False).tolist() + [t]) if i % 2 == 0 else None
             for i, t in enumerate(tokens)]
    first = 1
    chunks, output = run_deltas(tokenizer, SamplingParams(stop=["."]),
                                [tokens[:first], tokens[first:]], [masks[:first], masks[first:]])
    assert chunks[-1].finish_reason == "stop"
    assert output.token_ids == tokens[:dot + 1]
    assert output.sampling_mask == masks[:dot + 1]
    assert output.sampling_masks.to_lists() == masks[:dot + 1]
    assert len(output.sampling_logz) == dot + 1
    streamed = [m for c in chunks for m in orjson.loads(encode_json(extra_fields(c, True)))["sampling_mask"]]
    assert streamed == masks[:dot + 1]


def test_accumulated_output_equals_the_concatenated_lists(tokenizer):
    rng = np.random.default_rng(1)
    token_runs = [[int(t) for t in rng.integers(100, 30000, n)] for n in (1, 3, 0, 2, 1)]
    mask_runs = [[sorted(rng.choice(49152, 3, replace=False).tolist()) if rng.random() < 0.7 else None
                  for _ in run] for run in token_runs]
    _, output = run_deltas(tokenizer, SamplingParams(), token_runs, mask_runs)
    want = [m for run in mask_runs for m in run]
    assert output.sampling_mask == want
    assert output.sampling_mask is output.sampling_mask  # built once per read-out
    written = orjson.loads(encode_json(extra_fields(output, False)))
    assert written == {"sampling_mask": want, "sampling_logz": output.sampling_logz}
    assert len(output.sampling_logz) == len(want) == len(output.token_ids)


def test_no_mask_requested_reads_none(tokenizer):
    state = RequestOutputState(SamplingParams(), tokenizer, TokenTexts(tokenizer))
    sequences = {1: Sequence(1, "r", [5], SamplingParams(), return_sampling_mask=False)}
    output = CompletionOutput()
    for _, delta in processed(TokenProcessor([0], 512), frame_of([1], [[10, 11]], [[[1], [2]]]), sequences):
        output.add(state.update(delta))
    assert output.sampling_mask is None and output.sampling_masks is None
    assert "sampling_mask" not in extra_fields(output, False)
