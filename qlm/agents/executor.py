"""The executor: what each decision becomes on an engine, the same on both clocks.

A decision (``qlm.domain``) says what the controller wants; an engine offers a few operations.
``Executor.execute`` maps one to the other, one operation at a time, and counts what was done:

=================  ==========================================  ================================
decision           operations                                  when the engine refuses
=================  ==========================================  ================================
``Pull``           ``Submit``: start the request                ``Fail``: the request ends failed
``Evict``          ``Abort``: stop it; it returns with its      —
                   output so far (an eviction)
``SwapOut``        ``Swap(out=True)``: its KV cache to CPU      ``Abort`` (an eviction)
``SwapIn``         ``Swap(out=False)``: its KV cache back       ``Abort`` (an eviction)
``SetModelTier``   ``ChangeTier``                               skipped: the next step plans
                                                                with the tiers as they are
``Reject``         ``Forget``: no engine; the request is        —
                   reported failed and forgotten
=================  ==========================================  ================================

Counted: an eviction when its ``Abort`` is sent (an ``Evict`` or a refused swap), a swap when
the engine accepted a swap-out, a model switch when it accepted making another model active.

The side that owns the engines performs each operation and answers with its ``Outcome``:
``qlm.sim.cluster`` calls simulated engines at once on the virtual clock, and
``qlm.service.runtime`` awaits ``Engine`` calls over HTTP in a task per decision. Pure: no
clock, no engine, no I/O.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

from qlm.domain import (
    Decision,
    Evict,
    ModelTier,
    Pull,
    Reject,
    SetModelTier,
    SwapIn,
    SwapOut,
)

# --- Operations: what the executor asks of the side that owns the engines. --------------------


@dataclass(frozen=True, slots=True)
class Submit:
    """Start a request on an instance (a resumed one as prompt + its output so far)."""

    request_id: str
    instance: str


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop a request on its instance; it returns to the controller, evicted, with the output
    it had generated."""

    request_id: str
    instance: str


@dataclass(frozen=True, slots=True)
class Swap:
    """Move a request's KV cache to CPU memory (``out``) or back to the GPU."""

    request_id: str
    instance: str
    out: bool


@dataclass(frozen=True, slots=True)
class ChangeTier:
    """Move a model's weights on an instance to a tier (warm start, offload, drop)."""

    instance: str
    model: str
    tier: ModelTier


@dataclass(frozen=True, slots=True)
class Fail:
    """End a request failed for ``reason``: its instance refused it. No engine is involved."""

    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Forget:
    """Report a request the controller rejected (``Reject``) failed, and forget it. No engine
    is involved."""

    request_id: str
    reason: str


Operation = Submit | Abort | Swap | ChangeTier | Fail | Forget


# --- Outcomes: what the side answers. ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Done:
    """The engine did it. ``switched``: a ``ChangeTier`` made another model active than the one
    the instance had."""

    switched: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    """The engine refused it, for ``reason``."""

    reason: str


Outcome = Done | Refused

DONE = Done()


class Execution:
    """One decision on its way to an engine: ``next()`` gives the first operation, and
    ``next(outcome)``, told how the engine took the last one, the one after it; None when the
    decision is carried out.

        execution = executor.execute(decision)
        op = execution.next()
        while op is not None:
            op = execution.next(perform(op))
    """

    __slots__ = ("_steps",)

    def __init__(self, steps: Generator[Operation, Outcome, None]) -> None:
        self._steps = steps

    def next(self, outcome: Outcome | None = None) -> Operation | None:
        try:
            if outcome is None:
                return next(self._steps)
            return self._steps.send(outcome)
        except StopIteration:
            return None


class Executor:
    """Maps decisions to engine operations (module docstring) and counts what was done."""

    __slots__ = ("evictions", "model_switches", "swaps")

    def __init__(self) -> None:
        self.evictions = 0
        self.swaps = 0
        self.model_switches = 0

    def execute(self, decision: Decision) -> Execution:
        return Execution(self._steps(decision))

    def _steps(self, decision: Decision) -> Generator[Operation, Outcome, None]:
        if isinstance(decision, Reject):
            yield Forget(decision.request_id, decision.reason)
        elif isinstance(decision, Pull):
            outcome = yield Submit(decision.request_id, decision.instance)
            if isinstance(outcome, Refused):
                yield Fail(decision.request_id, outcome.reason)
        elif isinstance(decision, Evict):
            yield from self._evict(decision.request_id, decision.instance)
        elif isinstance(decision, SwapOut | SwapIn):
            out = isinstance(decision, SwapOut)
            outcome = yield Swap(decision.request_id, decision.instance, out)
            if isinstance(outcome, Refused):  # an engine that cannot swap, no swap space, ...
                yield from self._evict(decision.request_id, decision.instance)
            elif out:
                self.swaps += 1
        elif isinstance(decision, SetModelTier):
            outcome = yield ChangeTier(decision.instance, decision.model, decision.tier)
            if isinstance(outcome, Done) and outcome.switched:
                self.model_switches += 1

    def _evict(self, request_id: str, instance: str) -> Generator[Operation, Outcome, None]:
        self.evictions += 1
        yield Abort(request_id, instance)
