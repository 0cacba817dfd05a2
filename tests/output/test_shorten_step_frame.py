"""Shortening a packed step on the host equals packing it with the shorter accept counts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fastdeploy.common.step_frame import shorten_step_frame
from fastdeploy.common.step_slots import gather_step_slots
from tests.ops.test_step_packer import assert_frames_equal, make_slots


@pytest.mark.parametrize("slots", [1, 4])
@pytest.mark.parametrize("top_k, mask", [(None, False), (3, False), (None, True), (5, True)])
def test_shortened_frame_is_the_frame_of_fewer_accepted_tokens(slots, top_k, mask):
    full = make_slots(seed=slots * 10 + (top_k or 0), batch=33, slots=slots, k=-1 if top_k is None else top_k,
                      top_k=top_k, mask=mask)
    rng = np.random.default_rng(1)
    counts = full.accept_counts.numpy()
    kept = np.array([rng.integers(0, c + 1) for c in counts], dtype=np.int32)
    assert (kept < counts).any()
    want = gather_step_slots(dataclasses.replace(full, accept_counts=torch.from_numpy(kept)))
    assert_frames_equal(shorten_step_frame(gather_step_slots(full), kept.tolist()), want)


def test_longer_counts_are_rejected():
    frame = gather_step_slots(make_slots(seed=0, batch=4, slots=2, k=-1, top_k=None, mask=False))
    with pytest.raises(ValueError):
        shorten_step_frame(frame, (frame.num_tokens + 1).tolist())
