"""The sampling inputs of a decode batch are built once while the same rows are sampled again,
and built anew as soon as the rows change; every step gets its own copy to set its bitmask on."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.worker.input_prep import SamplingMetadataCache, sampling_metadata
from fastdeploy.worker.sequence_state import WorkerSequence

CPU = torch.device("cpu")


def _states() -> list[WorkerSequence]:
    return [WorkerSequence([1, 2], SamplingParams(temperature=0.0), False, None),
            WorkerSequence([3], SamplingParams(temperature=0.8, top_p=0.9, logit_bias={7: 2.0}), True, None),
            WorkerSequence([4, 5, 6], SamplingParams(temperature=1.0, top_k=20, logprobs=3), False, None)]


def _same_values(a, b) -> None:
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), field.name
        elif field.name != "row_groups":
            assert x == y, field.name
    for x, y in zip(dataclasses.astuple(a.row_groups), dataclasses.astuple(b.row_groups), strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y


def test_the_same_rows_reuse_their_inputs_and_other_rows_rebuild_them():
    states = _states()
    cache = SamplingMetadataCache()
    first = cache.get(states, "raw_logprobs", CPU)
    first.token_bitmask = torch.zeros(3, 4, dtype=torch.int32)  # a step's own field
    again = cache.get(list(states), "raw_logprobs", CPU)
    assert again.temperature is first.temperature and again.token_bitmask is None
    _same_values(again, sampling_metadata(states, "raw_logprobs", CPU))
    # Another order, a row gone, a new sequence, another logprobs mode: built anew, and right.
    for rows, mode in ((states[::-1], "raw_logprobs"), (states[:2], "raw_logprobs"),
                       (states[:2] + _states()[2:], "raw_logprobs"), (states, "processed_logprobs")):
        got = cache.get(rows, mode, CPU)
        assert got.temperature is not first.temperature
        _same_values(got, sampling_metadata(rows, mode, CPU))
