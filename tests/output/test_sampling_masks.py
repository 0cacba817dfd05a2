"""SamplingMasks (the CSR form of per-token kept sets) and SamplingBitmaps against plain-list references."""

from __future__ import annotations

import base64
from itertools import pairwise

import msgspec
import numpy as np
import orjson
import pytest

from fastdeploy.common.request import EngineOutputs, RequestDelta
from fastdeploy.common.sampling_masks import (
    SamplingBitmaps,
    SamplingMasks,
    bitmap_rows,
    bitmap_width,
    concat_masks,
    encode_buffers,
    logz_buffer,
    logz_values,
    split_runs,
)
from fastdeploy.entrypoints.openai.formatting import ServedChoice, bitmaps_json, extra_fields
from fastdeploy.output.output_processor import OutputChunk
from tests.bitmaps import bitmap_array, bitmap_lists

MASKS = [[3, 10], None, [12], [0, 1, 2, 49151], None]


def random_masks(rng: np.random.Generator, n: int) -> list[list[int] | None]:
    out: list[list[int] | None] = []
    for _ in range(n):
        size = int(rng.integers(0, 50))
        out.append(sorted(rng.choice(49152, size, replace=False).tolist()) if size else None)
    return out


def test_from_lists_round_trip_and_null_rows():
    masks = SamplingMasks.from_lists(MASKS)
    assert len(masks) == 5 and masks.num_ids == 7
    assert masks.to_lists() == MASKS
    assert masks.row_lengths().tolist() == [2, 0, 1, 4, 0]
    assert masks.offsets_array().tolist() == [0, 2, 2, 3, 7, 7]
    # little-endian int32 bytes, whatever the host order
    assert bytes(masks.ids[:8]) == (3).to_bytes(4, "little") + (10).to_bytes(4, "little")


def test_empty_run():
    empties = (SamplingMasks(), SamplingMasks.from_lists([]), concat_masks([]), SamplingMasks.from_lists(MASKS).head(0))
    for empty in empties:
        assert len(empty) == 0 and empty.num_ids == 0
        assert empty.to_lists() == []
        assert empty.offsets_array().tolist() == [0]


def test_split_runs_rebases_consecutive_runs_of_frame_views():
    offsets = np.array([0, 2, 2, 3, 7, 7], dtype="<i4")
    ids = np.array([3, 10, 12, 0, 1, 2, 49151], dtype="<i4")
    for counts in ([5], [0, 5], [2, 0, 3], [1, 1, 1, 1, 1], [0, 2, 2, 0, 1, 0], [3, 2, 0]):
        runs = split_runs(offsets, ids, counts)
        bounds = np.cumsum([0] + counts).tolist()
        assert [r.to_lists() for r in runs] == [MASKS[a:b] for a, b in pairwise(bounds)]
        assert all(r.offsets_array()[0] == 0 for r in runs)
        assert concat_masks(runs) == SamplingMasks.from_lists(MASKS)
    # offsets that do not start at 0 (a slice of a larger CSR)
    tail = split_runs(offsets[2:] + 100, np.concatenate([np.zeros(102, "<i4"), ids[2:]]), [1, 2])
    assert [r.to_lists() for r in tail] == [MASKS[2:3], MASKS[3:5]]
    assert split_runs(offsets[:1], ids[:0], []) == []
    assert [r.to_lists() for r in split_runs(offsets[:1], ids[:0], [0, 0])] == [[], []]


def test_concat_matches_list_concatenation():
    rng = np.random.default_rng(0)
    runs = [random_masks(rng, int(n)) for n in (3, 0, 1, 7, 0, 2)]
    got = concat_masks([SamplingMasks.from_lists(r) for r in runs])
    assert got.to_lists() == [m for r in runs for m in r]
    assert len(got) == sum(len(r) for r in runs)
    single = SamplingMasks.from_lists(runs[0])
    assert concat_masks([single]) == single


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 9])
def test_head_matches_list_slice(n: int):
    masks = SamplingMasks.from_lists(MASKS)
    cut = masks.head(n)
    assert cut.to_lists() == MASKS[:n]
    assert len(cut) == len(MASKS[:n])
    assert cut.num_ids == sum(len(m) for m in MASKS[:n] if m)


def test_msgpack_round_trip_inside_a_delta():
    rng = np.random.default_rng(1)
    lists = random_masks(rng, 40)
    delta = RequestDelta("r-0", list(range(40)), sampling_mask=SamplingMasks.from_lists(lists),
                         logz=logz_buffer(np.full(40, -0.5, dtype=np.float32)))
    raw = msgspec.msgpack.Encoder(enc_hook=encode_buffers).encode(EngineOutputs([delta, RequestDelta("r-1", [5])]))
    back = msgspec.msgpack.decode(raw, type=EngineOutputs)
    assert back.deltas[0].sampling_mask.to_lists() == lists
    assert back.deltas[0].sampling_mask == delta.sampling_mask
    assert logz_values(back.deltas[0].logz) == [-0.5] * 40
    assert back.deltas[1].sampling_mask is None
    # the ids and offsets travel as binary blobs, byte for byte
    assert delta.sampling_mask.ids in raw and delta.sampling_mask.offsets in raw


def decode_bitmap(text: str, vocab_size: int) -> list[int]:
    """The kept ids of one base64 bitmap, exactly as docs/sampling.md tells users to decode it."""
    bits = np.unpackbits(np.frombuffer(base64.b64decode(text), dtype=np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size]).tolist()


@pytest.mark.parametrize("vocab_size", [49152, 151936, 13, 1])
def test_bitmaps_hold_the_same_sets_as_the_ids(vocab_size: int):
    rng = np.random.default_rng(vocab_size)
    lists = []
    for i in range(30):
        size = int(rng.integers(0, min(vocab_size, 3000) + 1)) if i % 5 else 0
        lists.append(sorted(rng.choice(vocab_size, size, replace=False).tolist()) if size else None)
    lists.append(list(range(vocab_size)))  # every id kept, the last bit included
    bitmaps = bitmap_rows(bitmap_array(lists, vocab_size))
    assert bitmaps.width == bitmap_width(vocab_size) == -(-vocab_size // 8)
    assert len(bitmaps) == len(lists)
    assert bitmap_lists(bitmaps) == lists
    encoded = orjson.loads(orjson.dumps(bitmaps_json(bitmaps)))
    for text, want in zip(encoded, lists, strict=True):
        if want is None:
            assert text is None
            continue
        raw = base64.b64decode(text, validate=True)
        assert len(raw) == bitmap_width(vocab_size)
        assert base64.b64encode(raw).decode() == text  # standard alphabet, padded
        assert decode_bitmap(text, vocab_size) == want


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 9])
def test_bitmap_head_and_concat_match_list_slices(n: int):
    bitmaps = bitmap_rows(bitmap_array(MASKS, 49152))
    assert bitmap_lists(bitmaps.head(n)) == MASKS[:n]
    assert len(bitmaps.head(n)) == len(MASKS[:n])
    parts = [bitmaps.head(2), bitmap_rows(bitmap_array(MASKS[2:], 49152))]
    assert bitmap_lists(concat_masks(parts)) == MASKS
    assert concat_masks(parts).owned() == bitmaps


def test_bitmaps_round_trip_inside_a_delta_beside_ids():
    bitmaps = bitmap_rows(bitmap_array(MASKS, 49152))
    deltas = [RequestDelta("r-0", list(range(5)), sampling_mask=bitmaps),
              RequestDelta("r-1", list(range(5)), sampling_mask=SamplingMasks.from_lists(MASKS))]
    raw = msgspec.msgpack.Encoder(enc_hook=encode_buffers).encode(EngineOutputs(deltas))
    back = msgspec.msgpack.decode(raw, type=EngineOutputs)
    assert isinstance(back.deltas[0].sampling_mask, SamplingBitmaps)
    assert back.deltas[0].sampling_mask == bitmaps
    assert isinstance(back.deltas[1].sampling_mask, SamplingMasks)
    assert back.deltas[1].sampling_mask.to_lists() == MASKS
    # 3 non-null rows of 6,144 bytes travel as one binary blob
    assert len(bitmaps.bits) == 3 * 6144 and bytes(bitmaps.bits) in raw


@pytest.mark.parametrize("vocab_size", [49152, 151936])  # rows of 6,144 bytes (3 | width) and 18,992 (not)
@pytest.mark.parametrize("with_null", [False, True])
def test_bitmaps_json_is_one_base64_string_per_row(vocab_size: int, with_null: bool):
    rng = np.random.default_rng(vocab_size + with_null)
    lists = [sorted(rng.choice(vocab_size, int(rng.integers(1, 500)), replace=False).tolist()) for _ in range(7)]
    if with_null:
        lists[3] = None
    bitmaps = bitmap_rows(bitmap_array(lists, vocab_size))
    written = orjson.loads(orjson.dumps({"sampling_mask": bitmaps_json(bitmaps)}))["sampling_mask"]
    assert [None if text is None else decode_bitmap(text, vocab_size) for text in written] == lists
    assert all(text is None or base64.b64encode(base64.b64decode(text)).decode() == text for text in written)
    assert orjson.loads(orjson.dumps(bitmaps_json(bitmaps.head(0)))) == []


@pytest.mark.parametrize("vocab_size", [49152, 151936])
def test_a_served_choice_encodes_bitmaps_as_they_arrive_into_the_same_json(vocab_size: int):
    """A non-streaming choice turns each chunk's bitmaps into JSON items on arrival; the finished
    array equals the one written from the whole run, null rows and empty chunks included."""
    rng = np.random.default_rng(vocab_size)
    lists = [sorted(rng.choice(vocab_size, int(rng.integers(1, 300)), replace=False).tolist()) for _ in range(9)]
    lists[4] = None
    whole = bitmap_rows(bitmap_array(lists, vocab_size))
    choice = ServedChoice(0)
    for lo, hi in [(0, 1), (1, 4), (4, 4), (4, 5), (5, 9)]:  # one token, a run, an empty chunk, a null row
        run = bitmap_rows(bitmap_array(lists[lo:hi], vocab_size)) if hi > lo else whole.head(0)
        choice.add(OutputChunk("", list(range(lo, hi)), None, run, [0.5] * (hi - lo), None, None, None, 500, 3))
    served = orjson.loads(orjson.dumps(extra_fields(choice, False)))
    assert served["sampling_mask"] == orjson.loads(orjson.dumps(bitmaps_json(whole)))
    assert [None if t is None else decode_bitmap(t, vocab_size) for t in served["sampling_mask"]] == lists
    assert served["sampling_logz"] == [0.5] * len(lists)
    empty = ServedChoice(0)
    empty.add(OutputChunk("", [], None, whole.head(0), [], None, None, None, 500, 3))
    assert orjson.loads(orjson.dumps(extra_fields(empty, False)))["sampling_mask"] == []


def test_a_spliced_body_equals_the_joined_one(monkeypatch):
    """Two choices' bitmap arrays written into the body as pieces (blocks of a few tokens here)
    give the same JSON, byte for byte, as the arrays copied into the body."""
    import asyncio

    from fastdeploy.entrypoints.openai import formatting

    monkeypatch.setattr(formatting, "MASK_BLOCK_BYTES", 20_000)
    vocab_size = 152064
    rng = np.random.default_rng(1)
    choices = []
    for index in range(2):
        lists = [sorted(rng.choice(vocab_size, 50, replace=False).tolist()) for _ in range(7)]
        lists[3] = None
        choice = ServedChoice(index)
        for lo, hi in [(0, 1), (1, 2), (2, 5), (5, 7)]:
            run = bitmap_rows(bitmap_array(lists[lo:hi], vocab_size))
            choice.add(OutputChunk("", list(range(lo, hi)), None, run, [0.5] * (hi - lo), None, None, None, 500, 3))
        choices.append(choice)

    def body(splices):
        return {"choices": [{"index": c.index, "text": "\x00 a", **extra_fields(c, True, splices)} for c in choices]}

    joined = formatting.json_response(body(None)).body
    splices: list[list[bytes]] = []
    response = formatting.json_response(body(splices), splices=splices)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(response(None, None, send))
    assert b"".join(m["body"] for m in sent[1:]) == joined
    assert [m["more_body"] for m in sent[1:]] == [True] * (len(sent) - 2) + [False]
    assert int(response.headers["content-length"]) == len(joined)
