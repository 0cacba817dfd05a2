"""Keeps the cyclic garbage collector out of a long-lived process's decode steps.

A serving process builds hundreds of thousands of objects at start-up (the model's modules,
tokenizer tables, compiled kernels' metadata) that live as long as it does. Python's full
(generation 2) collection walks all of them every time it runs: 150-290 ms, measured, in
the middle of a decode step, stalling every stream. `gc.freeze()` moves them to a
permanent generation that no collection visits; objects made later are collected as usual.

Young collections are the other cost: at the default threshold (700 tracked objects alive
since the last pass) a decode step at batch 256 ran about three of them, 0.3-0.4 ms of a
16 ms step on the H100 (benchmarks/step_phases.py). A step's objects (deltas, token lists,
frame views) die by reference counting within a step or two, so with a threshold above
what a step keeps alive the young generation rarely fills, and a cycle still gets collected
once that many objects pile up.
"""

from __future__ import annotations

import atexit
import gc
import logging

logger = logging.getLogger(__name__)

# Tracked objects alive since the last young collection that start the next one. A step of
# 256 sequences keeps a few thousand alive at a time; the default is 700.
YOUNG_COLLECTION_THRESHOLD = 10_000


def settle_collector(process: str) -> int:
    """Collect once, freeze what survives, and raise the young collection threshold; returns
    how many objects were frozen.

    Only for processes that live as long as what they built (a frozen object is never
    freed by the cyclic collector). Unfrozen at exit, so teardown code that checks for
    leaked objects (nanobind's, in Triton) sees a normal heap.
    """
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD)
    frozen = gc.get_freeze_count()
    logger.info("%s: %d start-up objects frozen out of garbage collection", process, frozen)
    return frozen
