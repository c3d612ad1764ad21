from __future__ import annotations

import pytest

from qlm.clock import VirtualClock, WallClock


def test_the_virtual_clock_moves_only_forward_when_told() -> None:
    clock = VirtualClock(5.0)
    assert clock.now() == 5.0
    clock.advance_to(7.5)
    assert clock.now() == 7.5
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance_to(7.0)


def test_a_sped_up_wall_clock_needs_less_real_sleep_and_none_for_the_past() -> None:
    clock = WallClock(scale=10.0)
    now = clock.now()
    assert clock.seconds_until(now - 100.0) == 0.0
    assert clock.seconds_until(now + 10.0) <= 1.0  # ten clock seconds are one real second
    with pytest.raises(ValueError, match="scale"):
        WallClock(scale=0.0)
