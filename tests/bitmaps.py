"""Reference bitmaps of kept sets for the sampling-mask tests, built and read with numpy."""

from __future__ import annotations

import numpy as np

from fastdeploy.common.sampling_masks import SamplingBitmaps, bitmap_width


def bitmap_lists(bitmaps: SamplingBitmaps) -> list[list[int] | None]:
    return [None if row is None else
            np.flatnonzero(np.unpackbits(np.frombuffer(row, np.uint8), bitorder="little")).tolist()
            for row in bitmaps.rows()]


def bitmap_array(lists: list[list[int] | None], vocab_size: int) -> np.ndarray:
    """uint8 [n, ceil(V/8)]: the worker's form of the kept sets (null rows all zero), built by numpy."""
    flags = np.zeros((len(lists), bitmap_width(vocab_size) * 8), dtype=bool)
    for row, ids in enumerate(lists):
        flags[row, ids or []] = True
    return np.packbits(flags, axis=1, bitorder="little")
