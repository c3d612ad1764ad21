"""BacklogGC: long-lived objects of a large backlog are exempt from full collections while it is
held, and collected as usual once it drained."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from qlm.errors import ConfigError
from qlm.service.backlog_gc import BacklogGC


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_small_backlog_is_left_to_the_collector() -> None:
    keeper = BacklogGC(min_held=100)
    keeper.taken(99)
    assert not keeper.frozen and gc.get_freeze_count() == 0


def test_a_large_backlog_is_frozen_and_its_cycles_are_collected_once_it_drained() -> None:
    keeper = BacklogGC(min_held=100, unfreeze_below=0.25)
    held = [Cycle() for _ in range(1000)]
    refs = [weakref.ref(c) for c in held]
    keeper.taken(1000)
    assert keeper.frozen and gc.get_freeze_count() >= 1000
    del held
    gc.collect()
    assert all(r() is not None for r in refs)  # frozen: no collection looks at them
    frozen = gc.get_freeze_count()
    keeper.settled(300)  # not yet below a quarter of 1,000
    assert keeper.frozen and gc.get_freeze_count() == frozen
    keeper.settled(249)
    assert not keeper.frozen and keeper.unfreezes == 1 and gc.get_freeze_count() == 0
    gc.collect()
    assert all(r() is None for r in refs)  # collected as usual again


def test_the_peak_is_the_largest_backlog_frozen() -> None:
    keeper = BacklogGC(min_held=10, unfreeze_below=0.5)
    keeper.taken(10)
    keeper.taken(40)
    keeper.settled(25)  # above half of 40
    assert keeper.frozen
    keeper.settled(19)
    assert not keeper.frozen


def test_a_backlog_that_stays_large_is_collected_once_it_turned_over() -> None:
    keeper = BacklogGC(min_held=10, unfreeze_below=0.25)
    keeper.taken(100)
    held = [Cycle() for _ in range(100)]
    refs = [weakref.ref(c) for c in held]
    keeper.taken(100)
    del held  # settled, as garbage cycles (frozen: not collected)
    for _ in range(9):
        keeper.settled(100, released=10)  # as many come in as go out
        keeper.taken(100)
    assert keeper.frozen and all(r() is not None for r in refs)
    keeper.settled(100, released=10)  # 100 settled since the first freeze: turned over once
    assert not keeper.frozen and gc.get_freeze_count() == 0
    assert all(r() is None for r in refs)  # collected at once


def test_young_cyclic_garbage_is_collected_before_a_freeze() -> None:
    keeper = BacklogGC(min_held=1)
    ref = weakref.ref(Cycle())  # garbage already, in the young generation
    keeper.taken(1)
    assert ref() is None


@pytest.mark.parametrize(("min_held", "below"), [(0, 0.5), (10, 0.0), (10, 1.0)])
def test_bad_settings_name_themselves(min_held: int, below: float) -> None:
    with pytest.raises(ConfigError, match="backlog_gc"):
        BacklogGC(min_held=min_held, unfreeze_below=below)
