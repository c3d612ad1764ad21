"""The executor's rules: the engine operations each decision becomes, the fallbacks, the counts."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from qlm.agents.executor import (
    DONE,
    Abort,
    ChangeTier,
    Done,
    Executor,
    Fail,
    Forget,
    Operation,
    Outcome,
    Refused,
    Submit,
    Swap,
)
from qlm.domain import Decision, Evict, ModelTier, Pull, Reject, SetModelTier, SwapIn, SwapOut

NO = Refused("no")


def carry_out(
    executor: Executor, decision: Decision, answer: Callable[[Operation], Outcome]
) -> list[Operation]:
    """Every operation ``decision`` becomes when the engine answers each with ``answer``."""
    done: list[Operation] = []
    execution = executor.execute(decision)
    op = execution.next()
    while op is not None:
        done.append(op)
        op = execution.next(answer(op))
    return done


def accept(op: Operation) -> Outcome:
    return DONE


def refuse(op: Operation) -> Outcome:
    return NO


def test_a_pull_is_submitted_and_fails_the_request_when_refused() -> None:
    ex = Executor()
    assert carry_out(ex, Pull("r1", "i0"), accept) == [Submit("r1", "i0")]
    assert carry_out(ex, Pull("r1", "i0"), lambda op: Refused("too long")) == [
        Submit("r1", "i0"),
        Fail("r1", "too long"),
    ]
    assert (ex.evictions, ex.swaps, ex.model_switches) == (0, 0, 0)


def test_an_eviction_is_an_abort_counted_when_sent() -> None:
    ex = Executor()
    execution = ex.execute(Evict("r1", "i0"))
    assert execution.next() == Abort("r1", "i0")
    assert ex.evictions == 1  # while the abort is under way
    assert execution.next(DONE) is None


@pytest.mark.parametrize("decision", [SwapOut("r1", "i0"), SwapIn("r1", "i0")])
def test_a_refused_swap_becomes_an_eviction(decision: SwapOut | SwapIn) -> None:
    ex = Executor()
    out = isinstance(decision, SwapOut)
    assert carry_out(ex, decision, refuse) == [Swap("r1", "i0", out), Abort("r1", "i0")]
    assert (ex.evictions, ex.swaps) == (1, 0)


def test_a_swap_out_the_engine_accepted_counts_a_swap_and_a_swap_in_none() -> None:
    ex = Executor()
    assert carry_out(ex, SwapOut("r1", "i0"), accept) == [Swap("r1", "i0", True)]
    assert carry_out(ex, SwapIn("r1", "i0"), accept) == [Swap("r1", "i0", False)]
    assert (ex.evictions, ex.swaps) == (0, 1)


def test_a_refused_tier_change_is_skipped_and_a_switch_counted_only_when_made() -> None:
    ex = Executor()
    change = SetModelTier("i0", "m1", ModelTier.ACTIVE)
    assert carry_out(ex, change, refuse) == [ChangeTier("i0", "m1", ModelTier.ACTIVE)]
    assert carry_out(ex, change, accept) == [ChangeTier("i0", "m1", ModelTier.ACTIVE)]
    assert ex.model_switches == 0  # active already: no switch
    carry_out(ex, change, lambda op: Done(switched=True))
    assert ex.model_switches == 1


def test_a_rejected_request_is_forgotten_without_an_engine() -> None:
    ex = Executor()
    assert carry_out(ex, Reject("r1", "poison"), accept) == [Forget("r1", "poison")]
