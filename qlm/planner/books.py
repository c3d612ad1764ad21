"""What the stages of a QLM policy's step share (``qlm.planner.qlm_policy``).

- The agents' books of the requests sent to each instance (``AgentBooks``): *observe* writes
  completions, starts and cancellations into them, *group* takes a request back out of them when
  an engine hands it back, the planner reads what runs where, and the agents
  (``qlm.planner.act``) write every pull, swap and preemption.
- The admission the last plan chose (``AdmissionState``): each instance's concurrency limit and
  fluid model, and the groups deferred behind the admitted ones. The planner writes it, *group*
  places new groups by it, and the agents pull by it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from qlm.domain import Request
from qlm.planner.concurrency import Fluid
from qlm.rct.inputs import Queued

RECENT_FINISHES = 16
"""Completions per instance whose pace predicts when its next slots free (``qlm.planner.act``)."""


@dataclass(slots=True)
class Inflight:
    """A request sent to an instance's engine (or swapped out of it to CPU memory)."""

    request: Request
    pulled_s: float
    generated: int  # output tokens it had when pulled (resumed after an eviction)
    running: Queued = field(init=False)  # as the estimator sees it behind a new pull
    started_s: float | None = None  # when the engine started it (seen at a step)

    def __post_init__(self) -> None:
        self.running = Queued(self.request, self.generated, running=True)


@dataclass(slots=True)
class AgentBooks:
    """The agents' books: per instance the requests sent to its engine and those swapped out of
    it, and per request what the agents need to know of it while it is sent or back."""

    # Per instance: the requests sent to its engine, and those swapped out to CPU memory.
    inflight: dict[str, dict[str, Inflight]] = field(default_factory=dict)
    swapped: dict[str, dict[str, Inflight]] = field(default_factory=dict)
    # In flight and running in the engine (KV allocated).
    started: set[str] = field(default_factory=set)
    # Output tokens of the requests resumed after an eviction.
    generated: dict[str, int] = field(default_factory=dict)
    # How often the agents preempted each request (``make_room``).
    preemptions: dict[str, int] = field(default_factory=dict)
    # Per instance, its last completion times.
    finishes: dict[str, deque[float]] = field(default_factory=dict)
    # The model each instance was told to activate.
    asked_active: dict[str, str] = field(default_factory=dict)

    def started_at(self, request_ids: Sequence[str], now: float) -> None:
        """Requests the engines started since the last step (seen ``now``)."""
        self.started.update(request_ids)
        if request_ids:
            fresh = set(request_ids)
            for sent in self.inflight.values():
                for rid in fresh.intersection(sent):
                    if sent[rid].started_s is None:
                        sent[rid].started_s = now

    def finished(self, instance: str, request_id: str, finish_s: float) -> None:
        """A request completed on ``instance`` at ``finish_s``: out of the books, its completion
        time kept for the instance's pace."""
        self.finishes.setdefault(instance, deque(maxlen=RECENT_FINISHES)).append(finish_s)
        self.inflight.get(instance, {}).pop(request_id, None)
        self.swapped.get(instance, {}).pop(request_id, None)
        self.generated.pop(request_id, None)
        self.started.discard(request_id)
        self.preemptions.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """A cancelled request: out of the books of whichever instance had it."""
        for sent in (*self.inflight.values(), *self.swapped.values()):
            sent.pop(request_id, None)
        self.generated.pop(request_id, None)
        self.started.discard(request_id)
        self.preemptions.pop(request_id, None)

    def known(self) -> set[str]:
        """The requests the books hold anything of: sent, swapped out, started or resumed. One
        outside it, handed to the policy with no output, leaves the books as they are
        (``take_back`` is a no-op for it and returns False)."""
        out = set(self.started).union(self.generated)
        for sent in (*self.inflight.values(), *self.swapped.values()):
            out.update(sent)
        return out

    def take_back(self, request_id: str, generated: int) -> bool:
        """A request handed to the policy (new, or back from an engine: evicted, its instance
        lost, or restarted) with the ``generated`` output tokens it resumes with (0: it starts
        over, and nothing of an earlier attempt is kept): out of the books of any instance that
        had it. Whether it comes back (sent before, or resumed earlier)."""
        sent_before = [
            s for s in (*self.inflight.values(), *self.swapped.values()) if request_id in s
        ]
        back = bool(sent_before) or request_id in self.generated
        for sent in sent_before:
            sent.pop(request_id, None)  # an evicted request comes back
        self.started.discard(request_id)
        if generated:
            self.generated[request_id] = generated
        else:
            self.generated.pop(request_id, None)
        return back


@dataclass(slots=True)
class AdmissionState:
    """What the last plan chose of each instance's admission (``QlmPolicy.plan``)."""

    # The concurrency limit per instance, chosen by the planner.
    limits: dict[str, int] = field(default_factory=dict)
    # Per instance, its fluid model at its limit (``defer_expensive``).
    fluids: dict[str, Fluid] = field(default_factory=dict)
    # The groups waiting behind all admitted ones.
    deferred: set[str] = field(default_factory=set)
