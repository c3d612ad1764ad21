"""What the controller service shows of itself: its snapshot as JSON-ready data (its role,
virtual queues, instances, counters, the latest plan) and which waiting requests' stored predictions to rewrite
(``PredictionWrites``). ``ControllerService`` publishes both every ``publish_s``, less often
under a backlog (``publish_wait``)."""

from __future__ import annotations

import heapq
import math
from collections import Counter
from operator import attrgetter, itemgetter
from typing import Any, Literal

from qlm.domain import PlanRecord
from qlm.virtual_queues import QueueSnapshot, VirtualQueuesSnapshot

PREDICTION_SLACK_S = 1.0
PREDICTION_SLACK_FRACTION = 0.05
"""A waiting request's stored prediction is rewritten only when its risk flips or it moves by
more than ``PREDICTION_SLACK_S`` or this fraction of the time still to go, whichever is more: a
backlog of 100,000 requests would otherwise be rewritten after every plan, while a client
polling a request due in an hour gains nothing from a correction of a minute."""

LISTED_REQUESTS = 5000
"""How many waiting requests a snapshot names, at most, for ``qlm ops group`` (``_queue_dict``):
every one while the queues hold no more; beyond, each group names its first
``max(LISTED_PER_GROUP, LISTED_REQUESTS // groups)`` members, so that a backlog of 100,000
requests does not publish 3 MB of ids every second."""
LISTED_PER_GROUP = 4

PUBLISH_SHARE = 0.1
"""The largest share of the event loop's time that publishing the snapshot and the predictions
may take (``publish_wait``): both walk every waiting request (100,000 under a backlog being
taken over), and the control steps and the intake need the loop."""
PUBLISH_MAX_S = 5.0
"""The longest ``publish_wait`` makes it wait, whatever publishing costs: half the API's default
``controller_stale_s`` (10 s), past which ``/readyz`` says no active controller publishes."""

Role = Literal["starting", "active", "standby", "stopping"]
"""Where a controller stands (``ControllerService.role``): taking the leader lock, leading,
waiting behind another controller that leads, stopping."""

Prediction = tuple[float | None, bool]
"""A waiting request's predicted completion (None: not predicted) and whether it is at risk."""


class PredictionWrites:
    """The predictions as last written to the store, and which to write next."""

    def __init__(self) -> None:
        self.written: dict[str, Prediction] = {}

    def forget(self, request_id: str) -> None:
        """It is no longer waiting (its outcome is recorded, or another controller has it)."""
        self.written.pop(request_id, None)

    def to_write(self, queues: VirtualQueuesSnapshot | None, limit: int) -> dict[str, Prediction]:
        """The waiting requests whose stored prediction moved (``_moved``), at most ``limit``
        of them, the most moved first (new ones and risk flips before all; among equals the
        oldest request): under a large backlog every re-plan moves most predictions, and
        rewriting all of them each second would hold the store from recording new deliveries.
        The rest are written at the next publishes. Counted as written."""
        if queues is None:
            return {}
        written = self.written
        moved: list[tuple[float, float, str, Prediction]] = []
        for q in queues.queues:
            for g in q.groups:
                value = (g.predicted_completion_s, g.at_risk)
                # A group's requests were mostly written together, with one value: ``_moved``
                # once per value written, the pass over them in C where it can be (100,000
                # waiting requests each publish).
                olds = list(map(written.get, map(_ID, g.requests)))
                if olds and olds.count(olds[0]) == len(olds):
                    how_far = _moved(olds[0], value, queues.at_s)
                    if how_far > 1.0:
                        moved += [(how_far, -r.arrival_s, r.id, value) for r in g.requests]
                    continue
                far: dict[Prediction | None, float] = {}
                for req, old in zip(g.requests, olds, strict=True):
                    if old in far:
                        how_far = far[old]
                    else:
                        how_far = far[old] = _moved(old, value, queues.at_s)
                    if how_far > 1.0:
                        moved.append((how_far, -req.arrival_s, req.id, value))
        if len(moved) > limit:  # (ties: the oldest request first)
            moved = heapq.nlargest(limit, moved, key=_HOW_FAR)
        out = {rid: value for _, _, rid, value in moved}
        written.update(out)
        return out


def publish_wait(publish_s: float, spent_s: float) -> float:
    """How long to wait for the next publish after one that took ``spent_s`` of the event
    loop: ``publish_s``, or longer, so that publishing takes at most ``PUBLISH_SHARE`` of it,
    up to ``PUBLISH_MAX_S``."""
    return max(publish_s, min(spent_s / PUBLISH_SHARE, PUBLISH_MAX_S))


def _moved(old: Prediction | None, new: Prediction, now: float) -> float:
    """How far a waiting request's prediction moved since it was written, in slacks (> 1: it
    is rewritten); infinite for a new one, a risk flip or a prediction appearing."""
    if old is None or old[1] != new[1] or (old[0] is None) != (new[0] is None):
        return math.inf
    if old[0] is None or new[0] is None:
        return 0.0
    slack = max(PREDICTION_SLACK_S, PREDICTION_SLACK_FRACTION * (new[0] - now))
    return abs(old[0] - new[0]) / slack


def snapshot_dict(
    controller: str,
    at: float,
    policy: str,
    queues: VirtualQueuesSnapshot | None,
    instances: list[dict[str, Any]],
    counters: dict[str, int],
    plan: PlanRecord | None,
    *,
    role: Role | None = None,
) -> dict[str, Any]:
    """A controller's snapshot as JSON-ready data (``ControllerService.snapshot``), with its
    ``role`` when given."""
    listed = LISTED_REQUESTS
    if queues is not None:
        groups = sum(len(q.groups) for q in queues.queues)
        if sum(g.size for q in queues.queues for g in q.groups) > listed:
            listed = max(LISTED_PER_GROUP, LISTED_REQUESTS // max(groups, 1))
    return {
        "controller": controller,
        "role": role,
        "at": at,
        "policy": policy,
        "queues": [] if queues is None else [_queue_dict(q, at, listed) for q in queues.queues],
        "instances": instances,
        "counters": counters,
        "plan": None if plan is None else _plan_dict(plan),
    }


def _queue_dict(q: QueueSnapshot, at: float, listed: int) -> dict[str, Any]:
    """One virtual queue; each group with its tenants (requests per tenant), its latest
    deadline, how many of its requests are past their deadline at ``at`` (``missed``) and the
    ids of its first ``listed`` requests in FCFS order. One pass over each group's requests,
    in C where it can be: a snapshot of 100,000 waiting requests, taken every second, spends
    ~40 ms of CPU here (the prediction writes' pass over them, ~80 ms)."""
    groups = []
    for g in q.groups:
        deadlines = list(map(_DEADLINE, g.requests))
        missed = 0 if g.earliest_deadline_s >= at else sum(d < at for d in deadlines)
        groups.append(
            {
                "id": g.id,
                "model": g.model,
                "size": g.size,
                "tier": g.tier.name.lower(),
                "slo_class": g.slo_class,
                "earliest_deadline_at": g.earliest_deadline_s,
                "latest_deadline_at": max(deadlines, default=None),
                "predicted_completion_at": g.predicted_completion_s,
                "p_meet_slo": g.p_meet_slo,
                "at_risk": g.at_risk,
                "deferred": g.deferred,
                "missed": missed,
                "tenants": dict(Counter(map(_TENANT, g.requests)).most_common()),
                "request_ids": list(map(_ID, g.requests[:listed])),
            }
        )
    return {"instance": q.instance, "predicted_drain_at": q.predicted_drain_s, "groups": groups}


_DEADLINE = attrgetter("deadline_s")
_TENANT = attrgetter("tenant")
_ID = attrgetter("id")
_HOW_FAR = itemgetter(0, 1)  # of a moved prediction: how far it moved, then how old it is


def _plan_dict(record: PlanRecord) -> dict[str, Any]:
    return {
        "at": record.at_s,
        "trigger": record.trigger,
        "groups": record.groups,
        "status": record.status,
        "method": record.method,
        "objective": record.objective,
        "edf_objective": record.edf_objective,
        "at_risk": list(record.at_risk),
        "capacity_needed": record.capacity_needed,
        "solve_s": record.solve_s,
        "concurrency": dict(record.concurrency),
        "deferred": record.deferred,
    }
