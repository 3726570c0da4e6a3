"""freeze_startup_heap: what is alive at the end of startup leaves the collector's passes, garbage does not
survive into the frozen set, and what the role allocates later is still collected."""

import gc
import weakref

import pytest

from asyncrl.heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.partner: "Node | None" = None


def cycle() -> weakref.ref:
    """Two nodes referring to each other, otherwise unreferenced: only the collector frees them."""
    first, second = Node(), Node()
    first.partner, second.partner = second, first
    return weakref.ref(first)


@pytest.fixture
def thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test process is collected as usual


def test_objects_alive_at_startup_leave_the_collectors_passes(thawed):
    survivors = [[index] for index in range(1_000)]  # lists are tracked by the collector
    assert {id(item) for item in survivors} <= {id(obj) for obj in gc.get_objects()}

    frozen = freeze_startup_heap()

    assert frozen == gc.get_freeze_count() >= len(survivors)
    assert {id(item) for item in survivors}.isdisjoint(id(obj) for obj in gc.get_objects())


def test_startup_garbage_is_collected_before_freezing(thawed):
    garbage = cycle()
    gc.disable()  # so that only the helper's own collection can free the cycle
    try:
        freeze_startup_heap()
    finally:
        gc.enable()
    assert garbage() is None


def test_cycles_made_after_the_freeze_are_still_collected_automatically(thawed):
    freeze_startup_heap()
    later = cycle()
    assert later() is not None
    allocations = [[] for _ in range(3 * gc.get_threshold()[0])]  # enough to trigger a young collection
    assert later() is None
    del allocations
