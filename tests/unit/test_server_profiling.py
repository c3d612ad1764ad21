"""``qlm profile server`` measures decode time as the difference of two runs; on a disturbed
server that difference is noise. It runs the pair again, and refuses to write a decode time
that is no time at all (the estimator would take decoding for free)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from qlm.engines import profiling
from qlm.engines.base import EngineCapabilities
from qlm.errors import EngineError

MODEL = "m"


class FakeServer:
    """Answers every run at once; ``profiling._makespan`` is replaced by a script of times."""

    name = "fake"

    async def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities((MODEL,), 8, 100_000, False, False, False)

    async def stats(self) -> Any:
        return SimpleNamespace(preemptions_total=0)


def scripted(monkeypatch: pytest.MonkeyPatch, decode_runs: Iterator[float]) -> list[int]:
    """Prefill runs (output 1) take 0.1 s; a decode run's time comes from ``decode_runs``."""
    asked: list[int] = []

    async def makespan(engine: Any, clock: Any, prompts: Any, n: int, p: int, o: int) -> float:
        asked.append(o)
        return 0.1 if o == 1 else next(decode_runs)

    monkeypatch.setattr(profiling, "_makespan", makespan)
    return asked


def run() -> Any:
    settings = profiling.ServerSettings(max_num_seqs=8, warm_load_s=1.0, cold_load_s=2.0)
    return asyncio.run(
        profiling.profile_engine(
            FakeServer(),  # type: ignore[arg-type]
            model=MODEL,
            gpu="A100",
            settings=settings,
            input_tokens=100,
            output_tokens=64,
        )
    )


def test_a_pair_that_shows_no_decode_time_is_run_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Alone: (longer, shorter) = (1.0, 1.05) is noise, then (2.0, 1.0) is believed: 1 s / 32.
    # The long-prompt pair, the batch pair and the oversubscribed run follow.
    times = iter([1.0, 1.05, 2.0, 1.0, 3.0, 1.5, 4.0, 2.0, 6.0])
    asked = scripted(monkeypatch, times)
    hw = run()
    assert hw.decode_alone_s == pytest.approx(1.0 / 32)
    assert hw.decode_per_token_s == pytest.approx(2.0 / 32)
    assert asked.count(64) == 5 and asked.count(32) == 4  # one pair more than without the noise


@pytest.mark.parametrize("shorter", [1.2, 0.9999])  # slower, or hardly faster, than the longer
def test_no_decode_time_after_every_try_is_an_error(
    monkeypatch: pytest.MonkeyPatch, shorter: float
) -> None:
    scripted(monkeypatch, iter([1.0, shorter] * profiling.DECODE_TRIES))
    with pytest.raises(EngineError, match=r"decode time could not be measured .* 3 tries"):
        run()
