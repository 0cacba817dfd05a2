"""The step-frame codec over generated frames: every frame round-trips, every truncation is refused."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdeploy.common.step_frame import StepFrame, pack_step_frame, unpack_step_frame

SETTINGS = settings(max_examples=200, deadline=None, database=None)
int64s = st.integers(-(2**63), 2**63 - 1)
float32s = st.floats(width=32, allow_nan=False)


@st.composite
def frames(draw) -> StepFrame:
    batch = draw(st.integers(0, 6))
    counts = draw(st.lists(st.integers(0, 5), min_size=batch, max_size=batch))
    n = sum(counts)
    frame = StepFrame(
        message_id=draw(st.integers(0, 2**62)),
        seq_ids=np.array(draw(st.lists(int64s, min_size=batch, max_size=batch)), dtype=np.int64),
        num_tokens=np.array(counts, dtype=np.int32),
        token_ids=np.array(draw(st.lists(st.integers(0, 2**31), min_size=n, max_size=n)), dtype=np.int64),
    )
    if draw(st.booleans()):
        k = draw(st.integers(0, 20))
        frame.lp_ids = np.array(draw(st.lists(int64s, min_size=n * (k + 1), max_size=n * (k + 1))),
                                dtype=np.int64).reshape(n, k + 1)
        frame.lp_values = np.array(draw(st.lists(float32s, min_size=n * (k + 1), max_size=n * (k + 1))),
                                   dtype=np.float32).reshape(n, k + 1)
        frame.ranks = np.array(draw(st.lists(int64s, min_size=n, max_size=n)), dtype=np.int64)
    if draw(st.booleans()):
        rows = draw(st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=4), min_size=n, max_size=n))
        frame.mask_offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int32)
        frame.mask_ids = np.array([i for r in rows for i in r], dtype=np.int32)
        frame.logz = np.array(draw(st.lists(float32s, min_size=n, max_size=n)), dtype=np.float32)
    return frame


FIELDS = ("seq_ids", "num_tokens", "token_ids", "lp_ids", "lp_values", "ranks", "mask_offsets", "mask_ids", "logz")


@SETTINGS
@given(frames())
def test_every_frame_round_trips(frame):
    packed = pack_step_frame(frame)
    assert len(packed) % 8 == 0
    back = unpack_step_frame(packed)
    assert back.message_id == frame.message_id and back.max_num_logprobs == frame.max_num_logprobs
    for name in FIELDS:
        a, b = getattr(frame, name), getattr(back, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b), name


@SETTINGS
@given(frames(), st.data())
def test_a_truncated_frame_is_refused(frame, data):
    """A cut into any array is a ValueError; only the last array's padding may go missing unnoticed."""
    packed = pack_step_frame(frame)
    cut = data.draw(st.integers(0, len(packed) - 1))
    try:
        back = unpack_step_frame(packed[:cut])
    except ValueError:
        return
    assert len(packed) - cut < 8
    for name in FIELDS:
        if getattr(frame, name) is not None:
            assert np.array_equal(getattr(back, name), getattr(frame, name)), name
