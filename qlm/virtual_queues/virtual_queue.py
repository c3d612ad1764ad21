"""Virtual queues (paper §4): per instance, the order in which its request groups are served.

A virtual queue holds group *ids*, never requests: the requests live in the ``Grouper`` (and, in
production, their one durable replica in the broker). So a queue can be rebuilt, reordered or handed
to another instance without copying or losing a request, and, because a request is in exactly one
group and a group in at most one queue, no queue ever holds a request twice.

Groups disappear from the grouper when they empty or are re-clustered away; the queues forget them
lazily (on the next read of that queue) or at once through ``sync`` and ``remove_request``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from qlm.domain import Request, Tier
from qlm.errors import VirtualQueueError
from qlm.groups import Grouper, ReclusterResult


class GroupPrediction(NamedTuple):
    """What the planner's model predicts of a group's completion (its last request's) where it
    waits: mean and standard deviation, and the probability that it meets its SLO."""

    mean_s: float
    std_s: float
    p_meet_slo: float


@dataclass(frozen=True, slots=True)
class GroupSnapshot:
    """One group at one position of a virtual queue, for the CLI and the API.

    The prediction fields are set only when ``snapshot`` was given a prediction for this group;
    ``slo_risk`` is ``1 - p_meet_slo``, and ``at_risk`` says ``p_meet_slo`` is below the Δ
    ``snapshot`` was given (the planner's chance constraint); ``deferred`` says the latest
    plan's admission put it behind the others. ``requests`` are its members in FCFS order.
    """

    id: str
    position: int
    model: str
    tier: Tier
    slo_class: str
    size: int
    earliest_deadline_s: float
    predicted_completion_s: float | None = None
    predicted_completion_std_s: float | None = None
    p_meet_slo: float | None = None
    slo_risk: float | None = None
    at_risk: bool = False
    deferred: bool = False
    requests: tuple[Request, ...] = field(default=(), repr=False, compare=False)


UNASSIGNED = "(unassigned)"
"""What snapshots call the groups in no virtual queue: new ones, or those of an instance that
went down, until the planner places them."""


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """One instance's virtual queue, head first; ``predicted_drain_s``: when the planner's model
    expects it to be empty (None when not predicted)."""

    instance: str
    groups: tuple[GroupSnapshot, ...]
    predicted_drain_s: float | None = None

    @property
    def requests(self) -> int:
        return sum(g.size for g in self.groups)


class VirtualQueueSet:
    """One virtual queue per instance over the groups of one ``Grouper``.

    Invariants, checked on every change: a group is in at most one queue and at most once in it;
    every queued id names a live group (dead ones are dropped before any read). New groups start
    unassigned (``unassigned()``) until the planner places them. Errors are ``VirtualQueueError``
    naming the instance and group; a failed call changes nothing.
    """

    def __init__(self, grouper: Grouper) -> None:
        self._grouper = grouper
        self._queues: dict[str, list[str]] = {}
        self._where: dict[str, str] = {}  # group id -> instance

    # --- instances -----------------------------------------------------------------------------

    def add_instance(self, name: str) -> None:
        if name in self._queues:
            raise VirtualQueueError(f"instance {name!r} already has a virtual queue")
        self._queues[name] = []

    def drop_instance(self, name: str) -> list[str]:
        """Remove the instance (it failed or left); return every group it held, head first.

        The returned groups are unassigned: the planner places them on other queues (§4, fault
        isolation). Their requests were never copied, so nothing is lost.
        """
        queue = self._live(name)
        del self._queues[name]
        for gid in queue:
            del self._where[gid]
        return queue

    def instances(self) -> tuple[str, ...]:
        return tuple(self._queues)

    # --- order ---------------------------------------------------------------------------------

    def set_order(self, name: str, group_ids: Sequence[str]) -> None:
        """Make ``group_ids`` the whole queue of ``name``, head first.

        Groups it held before and not listed become unassigned. Every id must name a live group that
        is unassigned or already in this queue, at most once.
        """
        self.set_orders({name: group_ids})

    def set_orders(self, orders: Mapping[str, Sequence[str]]) -> None:
        """``set_order`` for several instances at once, applied atomically (a planner's whole plan).

        Groups may move between the instances named; a group still in another instance's queue
        raises.
        """
        for name in orders:
            self._live(name)
        if not self._orders_valid(orders):
            self._check_orders(orders)  # (raises, naming the first wrong group)
        for name in orders:
            for gid in self._queues[name]:
                del self._where[gid]
        for name, gids in orders.items():
            self._queues[name] = list(gids)
            self._where.update(dict.fromkeys(gids, name))

    def _orders_valid(self, orders: Mapping[str, Sequence[str]]) -> bool:
        """Whether ``set_orders`` may apply ``orders``: every group live, ordered once, and
        held (if at all) by an instance in ``orders`` — checked on all ids at once."""
        ids = [gid for gids in orders.values() for gid in gids]
        unique = set(ids)
        holders = set(map(self._where.get, ids))
        holders.discard(None)
        return (
            len(unique) == len(ids)
            and self._grouper.has_groups(unique)
            and all(h in orders for h in holders)
        )

    def _check_orders(self, orders: Mapping[str, Sequence[str]]) -> None:
        """``set_orders``' checks one group after the other: raises at the first that fails."""
        seen: dict[str, str] = {}
        for name, gids in orders.items():
            for gid in gids:
                self._check_group(gid)
                if gid in seen:
                    where = "twice" if seen[gid] == name else f"for {seen[gid]!r} and {name!r}"
                    raise VirtualQueueError(f"group {gid} is ordered {where}")
                seen[gid] = name
                holder = self._where.get(gid)
                if holder is not None and holder not in orders:
                    raise VirtualQueueError(
                        f"group {gid} is in the virtual queue of {holder!r}; move it with "
                        f"move_group or reorder {holder!r} in the same call"
                    )

    def assign(self, gid: str, name: str, position: int | None = None) -> None:
        """Put an unassigned group into ``name``'s queue at ``position`` (default: the tail)."""
        self._check_group(gid)
        queue = self._live(name)
        holder = self._where.get(gid)
        if holder is not None:
            raise VirtualQueueError(
                f"group {gid} is already in the virtual queue of {holder!r}; use move_group"
            )
        queue.insert(self._position(name, queue, position), gid)
        self._where[gid] = name

    def move_group(self, gid: str, to: str, position: int | None = None) -> None:
        """Move a group (queued anywhere, or unassigned) to ``position`` of ``to``'s queue.

        ``position`` counts in the target queue without the group (default: the tail).
        """
        self._check_group(gid)
        target = self._live(to)
        holder = self._where.get(gid)
        if holder == to:
            rest = [g for g in target if g != gid]
            rest.insert(self._position(to, rest, position), gid)
            target[:] = rest
            return
        index = self._position(to, target, position)
        if holder is not None:
            self._queues[holder].remove(gid)
        target.insert(index, gid)
        self._where[gid] = to

    def unassign(self, gid: str) -> None:
        """Take a group out of its queue (it stays in the grouper, unassigned)."""
        holder = self._where.pop(gid, None)
        if holder is not None:
            self._queues[holder].remove(gid)

    # --- reading -------------------------------------------------------------------------------

    def queue(self, name: str) -> tuple[str, ...]:
        return tuple(self._live(name))

    def instance_of(self, gid: str) -> str | None:
        holder = self._where.get(gid)
        if holder is not None and not self._grouper.has_group(gid):
            self._forget(gid)
            return None
        return holder

    def unassigned(self) -> list[str]:
        """Live groups in no queue (new ones, or handed back by ``drop_instance``), oldest id first."""
        for name in self._queues:
            self._live(name)
        return [gid for gid in self._grouper.group_ids() if gid not in self._where]

    def head_group(self, name: str) -> str | None:
        """The group ``name`` serves next, or None if its queue is empty."""
        queue = self._queue(name)
        while queue and not self._grouper.has_group(queue[0]):
            del self._where[queue.pop(0)]
        return queue[0] if queue else None

    def next_request(self, name: str) -> Request | None:
        """The request ``name`` serves next: the head group's oldest (groups are never empty)."""
        gid = self.head_group(name)
        return None if gid is None else self._grouper.peek(gid)

    def pop_next(self, name: str) -> Request | None:
        """Take ``next_request`` out of its group (it is being dispatched) and return it."""
        gid = self.head_group(name)
        if gid is None:
            return None
        request = self._grouper.pop(gid)
        if not self._grouper.has_group(gid):
            self._forget(gid)
        return request

    def remove_request(self, request_id: str) -> str | None:
        """A request finished or was cancelled: take it out; return its group id (None if unknown)."""
        gid = self._grouper.remove(request_id)
        if gid is not None and not self._grouper.has_group(gid):
            self._forget(gid)
        return gid

    def sync(self, result: ReclusterResult) -> None:
        """After ``Grouper.recluster``: drop the ids it removed; created ids stay unassigned."""
        for gid in result.removed:
            self._forget(gid)
        for name in self._queues:
            self._live(name)

    def snapshot(
        self,
        predictions: Mapping[str, GroupPrediction] | None = None,
        drain: Mapping[str, float] | None = None,
        delta: float | None = None,
        deferred: Collection[str] = (),
    ) -> list[QueueSnapshot]:
        """Every queue, head first, as plain data; ``predictions`` (by group id) fill the
        prediction fields of the groups they name, ``drain`` (by instance) each queue's
        ``predicted_drain_s``, a group whose ``p_meet_slo`` is below ``delta`` is at risk, and
        the groups ``deferred`` names are marked so.
        The groups in no queue (new, or handed back by an instance that went down) come last,
        oldest first, as a queue named ``UNASSIGNED``, when there are any."""
        predictions = predictions or {}
        drain = drain or {}
        result = [
            QueueSnapshot(
                name, self._rows(self._live(name), predictions, delta, deferred), drain.get(name)
            )
            for name in self._queues
        ]
        waiting = self._rows(self.unassigned(), predictions, delta, deferred)
        if waiting:
            result.append(QueueSnapshot(UNASSIGNED, waiting, None))
        return result

    def _rows(
        self,
        gids: list[str],
        predictions: Mapping[str, GroupPrediction],
        delta: float | None,
        deferred: Collection[str],
    ) -> tuple[GroupSnapshot, ...]:
        rows = []
        for position, gid in enumerate(gids):
            group = self._grouper.group(gid)
            prediction = predictions.get(gid)
            mean, std, p = prediction if prediction is not None else (None, None, None)
            rows.append(
                GroupSnapshot(
                    id=gid,
                    position=position,
                    model=group.model,
                    tier=group.tier,
                    slo_class=group.slo_class,
                    size=group.size,
                    earliest_deadline_s=group.earliest_deadline_s,
                    predicted_completion_s=mean,
                    predicted_completion_std_s=std,
                    p_meet_slo=p,
                    slo_risk=None if p is None else 1.0 - p,
                    at_risk=p is not None and delta is not None and p < delta,
                    deferred=gid in deferred,
                    requests=group.requests,
                )
            )
        return tuple(rows)

    def check(self) -> None:
        """Assert the invariants (for tests and debugging); ``VirtualQueueError`` if one is broken."""
        held: dict[str, str] = {}
        for name, queue in self._queues.items():
            for gid in queue:
                if gid in held:
                    raise VirtualQueueError(f"group {gid} is in {held[gid]!r} and in {name!r}")
                held[gid] = name
        if held != self._where:
            raise VirtualQueueError("the group -> instance index disagrees with the queues")

    # --- internals -----------------------------------------------------------------------------

    def _queue(self, name: str) -> list[str]:
        queue = self._queues.get(name)
        if queue is None:
            known = ", ".join(repr(n) for n in self._queues) or "none"
            raise VirtualQueueError(f"unknown instance {name!r} (known: {known})")
        return queue

    def _live(self, name: str) -> list[str]:
        """The queue of ``name`` without groups the grouper no longer has."""
        queue = self._queue(name)
        if not self._grouper.has_groups(queue):
            has = self._grouper.has_group
            self._forget_all(gid for gid in queue if not has(gid))
        return queue

    def _check_group(self, gid: str) -> None:
        if not self._grouper.has_group(gid):
            raise VirtualQueueError(
                f"unknown group {gid!r} (emptied, re-clustered away or never created)"
            )

    def _position(self, name: str, queue: list[str], position: int | None) -> int:
        if position is None:
            return len(queue)
        if not 0 <= position <= len(queue):
            raise VirtualQueueError(
                f"position {position} is outside the virtual queue of {name!r} (0..{len(queue)})"
            )
        return position

    def _forget(self, gid: str) -> None:
        holder = self._where.pop(gid, None)
        if holder is not None:
            self._queues[holder].remove(gid)

    def _forget_all(self, gids: Iterable[str]) -> None:
        for gid in list(gids):
            self._forget(gid)


@dataclass(frozen=True, slots=True)
class VirtualQueuesSnapshot:
    """Every virtual queue at ``at_s`` with what the planner's model predicts of it: for the
    operator endpoints, the metrics and the predictions a client reads, never for decisions.
    ``delta`` is the chance constraint's Δ that ``GroupSnapshot.at_risk`` was judged against."""

    at_s: float
    delta: float
    queues: tuple[QueueSnapshot, ...]
