"""settle_collector: start-up objects frozen, later cycles still collected, young threshold raised."""

import gc
import weakref

import pytest

from fastdeploy.common.startup_heap import YOUNG_COLLECTION_THRESHOLD, settle_collector


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def restore_collector():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_settle_collector_freezes_startup_cycles_and_collects_later_ones(restore_collector):
    before = _cycle()  # garbage only the collector can free
    frozen = settle_collector("test")
    assert before() is None  # collected before the freeze, not frozen with the live objects
    assert frozen == gc.get_freeze_count() > 0
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_THRESHOLD

    later = _cycle()
    gc.collect()
    assert later() is None  # a cycle made after the freeze is still collected
