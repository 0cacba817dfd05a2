"""A step's arrays travel in one buffer (`upload`): each comes back whole, in its dtype, and starts
on a 16-byte boundary whatever the sizes of the arrays before it. Triton specialises a kernel on
its pointers' 16-byte alignment; an offset that moved with the step's shapes would compile the
kernel again mid-serving."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdeploy.model_executor.device_inputs import upload, upload_int64


def _offsets(views: list[torch.Tensor]) -> list[int]:
    base = views[0].untyped_storage().data_ptr()
    return [v.data_ptr() - base for v in views]


@pytest.mark.parametrize("sizes", [(1, 1, 1), (3, 5, 7), (2, 13, 1), (0, 4, 9), (17, 0, 3)])
def test_each_array_comes_back_whole_and_16_byte_aligned(sizes: tuple[int, int, int]):
    rng = np.random.default_rng(sum(sizes))
    arrays = [rng.integers(-5, 5, sizes[0]).astype(np.int64), rng.integers(0, 9, sizes[1]).astype(np.int32),
              rng.standard_normal(sizes[2]).astype(np.float32), np.arange(sizes[1] % 3 + 1, dtype=np.uint8)]
    views = upload(arrays, torch.device("cpu"))
    for array, view in zip(arrays, views, strict=True):
        assert view.dtype == torch.from_numpy(array[:0]).dtype
        assert view.numpy().tolist() == array.tolist()
    assert all(offset % 16 == 0 for offset in _offsets(views)), _offsets(views)


def test_int64_lists_of_any_lengths_stay_aligned():
    lists = [[1], [2, 3, 4], list(range(7)), [], [9, 8]]
    views = upload_int64(lists, torch.device("cpu"))
    assert [v.tolist() for v in views] == lists
    assert all(v.dtype == torch.int64 for v in views)
    assert all(offset % 16 == 0 for offset in _offsets(views)), _offsets(views)
