"""``qlm profile server`` measures decode time as the difference of two runs; on a disturbed
server that difference is noise. It runs the pair again, and refuses to write a decode time
that is no time at all (the estimator would take decoding for free)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from qlm.engines.base import EngineCapabilities
from qlm.errors import EngineError
from qlm.profiling import vllm as profiling

MODEL = "m"


class FakeServer:
    """Answers every run at once; ``profiling._makespan`` is replaced by a script of times."""

    name = "fake"

    async def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities((MODEL,), 8, 100_000, False, False, False)

    async def stats(self) -> Any:
        return SimpleNamespace(preemptions_total=0)

    async def load_token_ids(self) -> tuple[int, ...]:
        return (5, 6, 7)


def scripted(
    monkeypatch: pytest.MonkeyPatch,
    decode_runs: Iterator[float],
    prefill: Any = lambda prompt, k: 0.1 + 1e-5 * prompt,
) -> list[int]:
    """A prefill run (output 1) takes ``prefill(prompt tokens, its run of that length)``
    seconds (0.1 s plus 10 µs a token); a decode run's time comes from ``decode_runs``."""
    asked: list[int] = []
    runs: dict[int, int] = {}

    async def makespan(
        engine: Any, clock: Any, prompts: Any, n: int, p: int, o: int, **kw: Any
    ) -> float:
        asked.append(o)
        if o == 1:
            runs[p] = runs.get(p, 0) + 1
            return float(prefill(p, runs[p]))
        return next(decode_runs)

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


def test_the_prefill_line_reads_the_shortest_run_of_each_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every length's first run is disturbed (a second longer, the most at the shortest
    prompts, so the runs alone would fall with the prompt): the shortest runs give the line."""
    longest = max(profiling.PREFILL_LENGTHS)

    def prefill(prompt: int, k: int) -> float:
        return 0.1 + 1e-5 * prompt + (2.0 - prompt / longest if k == 1 else 0.0)

    times = iter([2.0, 1.0, 3.0, 1.5, 4.0, 2.0, 6.0])
    scripted(monkeypatch, times, prefill)
    hw = run()
    assert hw.prefill_per_token_s == pytest.approx(1e-5)
    assert hw.prefill_base_s == pytest.approx(0.1)


def test_a_prefill_line_that_does_not_rise_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    scripted(monkeypatch, iter([2.0, 1.0] * 4), lambda prompt, k: 0.1 - 1e-6 * prompt)
    with pytest.raises(EngineError, match=r"prefill time could not be measured .* 12 runs each"):
        run()


def test_prefill_runs_again_while_its_line_does_not_rise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy host: the first two rounds of runs are disturbed, the most at the shortest prompts
    (so they fall with the prompt); the third round's runs are not, and give the line."""
    longest = max(profiling.PREFILL_LENGTHS)
    tries = profiling.PREFILL_TRIES
    runs: dict[int, int] = {}  # prompt length -> its runs so far

    def prefill(prompt: int, k: int) -> float:
        runs[prompt] = k
        return 0.1 + 1e-5 * prompt + (2.0 - prompt / longest if k <= 2 * tries else 0.0)

    scripted(monkeypatch, iter([2.0, 1.0, 3.0, 1.5, 4.0, 2.0, 6.0]), prefill)
    hw = run()
    assert hw.prefill_per_token_s == pytest.approx(1e-5)
    assert hw.prefill_base_s == pytest.approx(0.1)
    assert runs[longest] == 3 * tries  # three rounds, not four


class TimedServer:
    """Answers each request at once; its latency counts (``latency_totals``) come from a
    script, as a server that timed them itself would export them."""

    name = "timed"

    def __init__(self, totals: list[tuple[float, int] | None]) -> None:
        self.totals = totals
        self.reads = 0

    async def latency_totals(self) -> tuple[float, int] | None:
        self.reads += 1
        return self.totals[min(self.reads, len(self.totals)) - 1]

    async def complete(self, request: Any) -> Any:
        n = request.tokens_to_generate
        return SimpleNamespace(tokens=n)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        self.t += 10.0  # the client's span: 10 s between two reads of its clock
        return self.t


def span(server: TimedServer, n: int) -> float:
    prompts = profiling._Prompts(MODEL, 0)
    run = profiling._makespan(server, Clock(), prompts, n, 8, 4, served=True)  # type: ignore[arg-type]
    return asyncio.run(run)


def test_a_run_is_timed_by_the_server_where_it_says_how_long_its_requests_took() -> None:
    # two requests, 3 s and 5 s as the server measured them: 4 s, not the client's 10
    assert span(TimedServer([(100.0, 7), (108.0, 9)]), 2) == pytest.approx(4.0)
    # counted a moment after the answers: read again
    server = TimedServer([(100.0, 7), (100.0, 7), (101.0, 8), (104.0, 9)])
    assert span(server, 2) == pytest.approx(2.0)


def test_the_client_times_a_run_when_the_server_cannot_tell_it_apart() -> None:
    assert span(TimedServer([None]), 2) == 10.0  # no latency histogram exported
    assert span(TimedServer([(100.0, 7), (130.0, 10)]), 2) == 10.0  # another request ended
