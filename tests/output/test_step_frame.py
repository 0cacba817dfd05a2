"""The reference codec of the packed step frame: layout, round trips, edge sizes."""

import numpy as np
import pytest

from fastdeploy.common.step_frame import (
    HAS_LOGPROBS,
    HAS_MASK,
    META_LEN,
    StepFrame,
    pack_step_frame,
    split_by_sequence,
    unpack_step_frame,
)


def make_frame(rng: np.random.Generator, batch: int, k: int | None, with_mask: bool, max_accept: int = 3) -> StepFrame:
    counts = rng.integers(0, max_accept + 1, size=batch).astype(np.int32)
    n = int(counts.sum())
    frame = StepFrame(
        message_id=int(rng.integers(0, 1 << 40)),
        seq_ids=rng.choice(1 << 30, size=batch, replace=False).astype(np.int64),
        num_tokens=counts,
        token_ids=rng.integers(0, 49152, size=n).astype(np.int64),
    )
    if k is not None:
        frame.lp_ids = rng.integers(0, 49152, size=(n, k + 1)).astype(np.int64)
        frame.lp_values = -rng.random((n, k + 1)).astype(np.float32)
        frame.ranks = rng.integers(1, 100, size=n).astype(np.int64)
    if with_mask:
        sizes = rng.integers(0, 6, size=n)
        frame.mask_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        frame.mask_ids = np.concatenate(
            [np.sort(rng.choice(49152, size=s, replace=False)) for s in sizes] or [np.zeros(0)]
        ).astype(np.int32)
        frame.logz = -rng.random(n).astype(np.float32)
    return frame


def assert_frames_equal(a: StepFrame, b: StepFrame) -> None:
    assert a.message_id == b.message_id
    for name in ("seq_ids", "num_tokens", "token_ids", "lp_ids", "lp_values", "ranks", "mask_offsets", "mask_ids",
                 "logz"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("batch", [0, 1, 7, 256])
@pytest.mark.parametrize("k", [None, 0, 5, 20])
@pytest.mark.parametrize("with_mask", [False, True])
def test_round_trip(batch, k, with_mask):
    rng = np.random.default_rng(batch * 100 + (k or 0) + with_mask)
    frame = make_frame(rng, batch, k, with_mask)
    buf = pack_step_frame(frame)
    assert len(buf) % 8 == 0
    assert_frames_equal(frame, unpack_step_frame(buf))


def test_meta_header_layout():
    rng = np.random.default_rng(0)
    frame = make_frame(rng, 4, k=20, with_mask=True)
    meta = np.frombuffer(pack_step_frame(frame), dtype="<i8", count=META_LEN)
    assert meta[0] == frame.message_id
    assert meta[1] & 0xFF == HAS_LOGPROBS | HAS_MASK
    assert meta[1] >> 8 == 20
    assert meta[2] == 4 and meta[3] == frame.num_tokens.sum() and meta[4] == len(frame.mask_ids)


def test_only_needed_columns_travel():
    rng = np.random.default_rng(1)
    small = len(pack_step_frame(make_frame(np.random.default_rng(1), 8, k=0, with_mask=False)))
    large = len(pack_step_frame(make_frame(rng, 8, k=20, with_mask=False)))
    assert large > small  # k sets the width; it is not a fixed maximum


def test_truncated_frame_is_rejected():
    buf = pack_step_frame(make_frame(np.random.default_rng(2), 3, k=2, with_mask=True))
    with pytest.raises(ValueError):
        unpack_step_frame(buf[: len(buf) - 16])


def test_split_by_sequence_keys_rows_by_seq_id_and_maps_empty_masks_to_null():
    frame = StepFrame(
        message_id=1,
        seq_ids=np.array([42, 7], dtype=np.int64),
        num_tokens=np.array([2, 1], dtype=np.int32),
        token_ids=np.array([10, 11, 12], dtype=np.int64),
        lp_ids=np.array([[10, 3], [11, 4], [12, 5]], dtype=np.int64),
        lp_values=np.array([[-0.5, -0.1], [-0.2, -0.3], [-1.0, -0.9]], dtype=np.float32),
        ranks=np.array([2, 1, 3], dtype=np.int64),
        mask_offsets=np.array([0, 2, 2, 3], dtype=np.int32),
        mask_ids=np.array([3, 10, 12], dtype=np.int32),
        logz=np.array([-0.1, 0.0, -0.2], dtype=np.float32),
    )
    parts = split_by_sequence(unpack_step_frame(pack_step_frame(frame)))
    assert [p.seq_id for p in parts] == [42, 7]
    assert parts[0].token_ids == [10, 11] and parts[1].token_ids == [12]
    assert parts[0].sampling_mask.to_lists() == [[3, 10], None]
    assert parts[1].sampling_mask.to_lists() == [[12]]
    assert parts[0].logprob_token_ids == [[10, 3], [11, 4]]
    assert parts[1].ranks == [3]
