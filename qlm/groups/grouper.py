"""The owner of the request groups: online classification, FCFS service, re-clustering.

One ``Grouper`` per controller. It holds every waiting request exactly once, each in one group, and
keeps per partition ``(model, tier, slo_class)`` a matrix of group centroids so that a new request is
classified with one numpy pass over the compatible groups. Time comes in as ``now`` arguments.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from qlm.domain import Request, Tier
from qlm.errors import GroupError
from qlm.groups.clustering import form_groups, prepare_threadpools
from qlm.groups.config import GroupingConfig
from qlm.groups.features import (
    BOUNDED_FEATURES,
    DEFAULT_SCALE,
    FEATURES,
    WEIGHTS,
    FloatArray,
    GroupKey,
    IntArray,
    PredictOutput,
    default_predict_output,
    fit_multipliers,
    group_key,
    predicted_output,
    raw_features,
)
from qlm.groups.waiting import WaitingRequests

MIN_DRIFT_SAMPLES = 32
"""Online classifications needed before their distance to the centroid can signal drift."""
DRIFT_FLOOR = 0.1
"""Smallest baseline distance (weighted, standardised units): identical requests give a baseline of
0, and any new request would otherwise look like drift."""
MIN_NEW_GROUPS = 4
"""Groups created online before their number can signal drift."""
SCALAR_ROWS = 16
"""Up to this many groups below the size bound in a request's partition, ``add`` compares them in
Python floats (cheaper than numpy's per-call cost over so few)."""


@dataclass(frozen=True, slots=True)
class RequestGroup:
    """A snapshot of one request group: its waiting requests in FCFS order and cheap summaries.

    Every member has the group's ``model``, ``tier`` and ``slo_class``. ``predicted_output_tokens``
    sums the predictions made when each request was classified (or at the last re-clustering).
    ``centroid`` is the members' mean in the weighted, standardised feature space (``FEATURES``).
    """

    id: str
    model: str
    tier: Tier
    slo_class: str
    requests: tuple[Request, ...]
    input_tokens: int
    predicted_output_tokens: float
    earliest_deadline_s: float
    min_e2e_slo_s: float
    min_ttft_slo_s: float | None
    centroid: tuple[float, ...]
    earliest_ttft_deadline_s: float | None = None  # absolute, of the members with a TTFT SLO

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def due_s(self) -> float:
        """The earliest deadline of any kind: end-to-end, or first token."""
        if self.earliest_ttft_deadline_s is None:
            return self.earliest_deadline_s
        return min(self.earliest_deadline_s, self.earliest_ttft_deadline_s)


@dataclass(frozen=True, slots=True)
class ReclusterResult:
    """What a re-clustering did to group identities: ids kept, newly created, and gone."""

    kept: tuple[str, ...]
    created: tuple[str, ...]
    removed: tuple[str, ...]
    requests: int
    now: float


class _Partition:
    """Centroid matrix of the groups of one (model, tier, slo_class), grown by doubling."""

    __slots__ = ("centroids", "gids", "hi", "lo", "sizes")

    def __init__(self, capacity: int = 8) -> None:
        self.gids: list[str] = []
        self.centroids: FloatArray = np.empty((capacity, len(FEATURES)))
        self.sizes: IntArray = np.empty(capacity, dtype=np.int64)
        self.lo: FloatArray = np.empty(
            (capacity, BOUNDED_FEATURES)
        )  # min bounded features of the members
        self.hi: FloatArray = np.empty(
            (capacity, BOUNDED_FEATURES)
        )  # max bounded features of the members

    def append(self, gid: str) -> int:
        row = len(self.gids)
        if row == len(self.sizes):
            cap = 2 * row
            self.centroids = np.resize(self.centroids, (cap, len(FEATURES)))
            self.sizes = np.resize(self.sizes, cap)
            self.lo = np.resize(self.lo, (cap, BOUNDED_FEATURES))
            self.hi = np.resize(self.hi, (cap, BOUNDED_FEATURES))
        self.gids.append(gid)
        return row

    def delete(self, row: int) -> str | None:
        """Drop a row by moving the last one into it; return the id of the group that moved."""
        last = len(self.gids) - 1
        moved = None
        if row != last:
            self.centroids[row] = self.centroids[last]
            self.sizes[row] = self.sizes[last]
            self.lo[row] = self.lo[last]
            self.hi[row] = self.hi[last]
            moved = self.gids[row] = self.gids[last]
        self.gids.pop()
        return moved


class _Group:
    __slots__ = ("deadlines", "feature_sum", "id", "key", "part", "row", "slots", "view")

    def __init__(self, gid: str, key: GroupKey, part: _Partition, feature_sum: FloatArray) -> None:
        self.id = gid
        self.slots: list[int] = []  # of its requests (``WaitingRequests``), in FCFS order
        self.place(key, part, feature_sum)

    def place(self, key: GroupKey, part: _Partition, feature_sum: FloatArray) -> None:
        """Put the group in the next row of ``part`` (anew, after a re-clustering kept its id)."""
        self.key = key
        self.part = part
        self.row = part.append(self.id)
        self.feature_sum = feature_sum
        self.view: RequestGroup | None = None
        # (earliest end-to-end deadline, earliest first-token deadline or None), while known
        self.deadlines: tuple[float, float | None] | None = None


def _fcfs(request: Request) -> tuple[float, str]:
    return (request.arrival_s, request.id)


class Grouper:
    """Request groups of one controller (paper §4, Algorithm 1), kept up to date request by request.

    Guarantees, whatever the sequence of calls:

    - every waiting request is in exactly one group, and a group is never empty (it disappears);
    - a group never mixes models, tiers (``Tier``) or SLO classes, and its members' end-to-end SLOs
      (and TTFT SLOs) differ by at most ``config.slo_ratio``, and their ``1 + prompt tokens`` by
      at most ``config.input_ratio``;
    - no group holds more than ``config.max_group_size`` requests (δ × average batch size);
    - requests inside a group are served FCFS: by ``arrival_s``, then ``id``;
    - a group id (``g17``) is never reused for another group.

    ``add`` classifies a request online without re-clustering; ``recluster`` re-runs Algorithm 1
    over every waiting request and keeps ids where the new clusters overlap the old groups;
    ``add_many`` adds a batch by one such re-clustering; ``needs_recluster`` says when one is due. ``predict_output`` gives a request's predicted output
    tokens (default ``default_predict_output``); the estimator passes its posterior mean.
    """

    def __init__(
        self,
        config: GroupingConfig | None = None,
        *,
        predict_output: PredictOutput = default_predict_output,
    ) -> None:
        self._config = config if config is not None else GroupingConfig()
        self._predict = predict_output
        prepare_threadpools()  # here, not in the first recluster: it reads the file system
        self._groups: dict[str, _Group] = {}
        self._waiting = WaitingRequests()
        self._parts: dict[GroupKey, _Partition] = {}
        self._centres: dict[GroupKey, FloatArray] = {}  # last k-means centres, raw units
        self._mult: FloatArray = WEIGHTS / DEFAULT_SCALE
        self._max_log_spread = np.array(self._config.max_log_spread)
        self._spread_limits = _spread_limits(self._max_log_spread)
        self._next_id = 1
        self._last_recluster_s: float | None = None
        self._first_change_s: float | None = None
        self._changes = 0
        self._created_online = 0
        self._groups_after_recluster = 0
        self._baseline_distance: float | None = None
        self._online_distance_sum = 0.0
        self._online_distance_n = 0

    # --- reading -------------------------------------------------------------------------------

    @property
    def config(self) -> GroupingConfig:
        return self._config

    def set_config(self, config: GroupingConfig) -> None:
        """Use new settings (e.g. the measured average batch size) from the next call on.

        Groups already larger than a smaller new bound stay so until ``recluster``.
        """
        self._config = config
        self._max_log_spread = np.array(config.max_log_spread)
        self._spread_limits = _spread_limits(self._max_log_spread)

    def __len__(self) -> int:
        """Number of groups."""
        return len(self._groups)

    @property
    def num_requests(self) -> int:
        return len(self._waiting)

    def has_group(self, gid: str) -> bool:
        return gid in self._groups

    def has_groups(self, gids: Iterable[str]) -> bool:
        """Whether every one of ``gids`` names a group (all at once)."""
        return self._groups.keys() >= (gids if isinstance(gids, set) else set(gids))

    def group_ids(self) -> tuple[str, ...]:
        """Ids of every group, oldest id first."""
        return tuple(self._groups)

    def groups(self) -> tuple[RequestGroup, ...]:
        return tuple(self._view(g) for g in self._groups.values())

    def group(self, gid: str) -> RequestGroup:
        """Snapshot of one group (cached until the group changes); ``GroupError`` if unknown."""
        return self._view(self._get(gid))

    def group_of(self, request_id: str) -> str | None:
        slot = self._waiting.slot_of.get(request_id)
        return None if slot is None else self._group_at(slot).id

    def size(self, gid: str) -> int:
        """``group(gid).size``, without building the snapshot."""
        return len(self._get(gid).slots)

    def due(self, gid: str) -> tuple[float, bool]:
        """``group(gid).due_s``, and whether some member has a first-token deadline, without
        building the snapshot (kept up to date as requests join)."""
        group = self._get(gid)
        if group.deadlines is None:
            if group.view is not None:
                view = group.view
                group.deadlines = (view.earliest_deadline_s, view.earliest_ttft_deadline_s)
            else:
                members = self._waiting.request[group.slots]
                group.deadlines = (
                    min(r.deadline_s for r in members),
                    min(
                        (r.arrival_s + r.slo.ttft_s for r in members if r.slo.ttft_s is not None),
                        default=None,
                    ),
                )
        e2e, ttft = group.deadlines
        return (e2e, False) if ttft is None else (min(e2e, ttft), True)

    def peek(self, gid: str) -> Request:
        """The request the group serves next (its oldest)."""
        return self._waiting.at(self._get(gid).slots[0])

    # --- changing ------------------------------------------------------------------------------

    def add(self, request: Request, now: float) -> str:
        """Classify a new request online and return its group's id; never re-clusters.

        It joins the nearest group (Euclidean distance to the centroid) of its partition that is
        below ``max_group_size`` and stays within ``slo_ratio`` of its SLOs and ``input_ratio`` of
        its prompts; when none does, it founds a new group. ``GroupError`` if a request with that
        id is already waiting.
        """
        if request.id in self._waiting.slot_of:
            raise GroupError(
                f"request {request.id!r} is already in group {self.group_of(request.id)}"
            )
        raw = raw_features(request, self._predict)
        x = raw * self._mult
        key = group_key(request, self._config.deadline_window)
        part = self._parts.get(key)
        if part is None:
            part = self._parts[key] = _Partition()
        group: _Group | None = None
        nearest = self._nearest(part, raw, x)
        if nearest is not None:
            row, d2 = nearest
            group = self._groups[part.gids[row]]
            self._online_distance_sum += math.sqrt(d2)
            self._online_distance_n += 1
        if group is None:
            group = self._new_group(key, part, np.zeros(len(FEATURES)))
            self._created_online += 1
        self._insert(group, request, raw)
        if self._changes == 0:
            self._first_change_s = now
        self._changes += 1
        return group.id

    def add_many(self, requests: Sequence[Request], now: float) -> ReclusterResult:
        """Add a batch of new requests and re-cluster every waiting request, the batch with
        them, in one pass of Algorithm 1 (``recluster``) instead of classifying each online:
        what taking over a backlog calls, where one pass over N requests costs far less than N
        classifications. Their groups are those of the re-clustering (ids kept as ``recluster``
        keeps them; a new request never lends one). ``GroupError`` if a request with one of
        these ids is already waiting, or comes twice; nothing is added then, nor if the
        re-clustering fails."""
        ids = [r.id for r in requests]
        known = self._waiting.slot_of
        if len(set(ids)) != len(ids) or any(rid in known for rid in ids):
            twice = next(rid for k, rid in enumerate(ids) if rid in known or rid in ids[:k])
            raise GroupError(f"request {twice!r} is already waiting, or comes twice")
        placeholder = np.zeros(len(FEATURES))  # (the re-clustering computes the features)
        fresh = [self._waiting.add(r, placeholder, None) for r in requests]
        try:
            return self._recluster(now, np.array(fresh, dtype=np.int64))
        except BaseException:
            for slot in fresh:
                if self._waiting.group[slot] is None:  # (not past the point of no return)
                    self._waiting.release(slot)
            raise

    def remove(self, request_id: str) -> str | None:
        """Take a finished, cancelled or dispatched request out; return its group id (None if unknown).

        A group left empty disappears.
        """
        slot = self._waiting.slot_of.get(request_id)
        if slot is None:
            return None
        group = self._group_at(slot)
        group.slots.remove(slot)
        self._detach(group, slot)
        return group.id

    def pop(self, gid: str) -> Request:
        """Take the group's next request (FCFS) out and return it; an emptied group disappears."""
        group = self._get(gid)
        slot = group.slots.pop(0)
        request = self._waiting.at(slot)
        self._detach(group, slot)
        return request

    def needs_recluster(self, now: float) -> bool:
        """Whether ``recluster`` is due: something changed since the last one, and

        - ``recluster_interval_s`` passed since it (or since the first request, before any), or
        - online classification created more than ``max_new_group_fraction`` × (groups right after
          it) new groups (at least ``MIN_NEW_GROUPS``), or
        - requests classified online since (at least ``MIN_DRIFT_SAMPLES``) lie on average more than
          ``drift_factor`` times farther from their group's centroid than members did right after it.
        """
        if not self._waiting or self._changes == 0:
            return False
        cfg = self._config
        since = (
            self._last_recluster_s if self._last_recluster_s is not None else self._first_change_s
        )
        if since is not None and now - since >= cfg.recluster_interval_s:
            return True
        if self._created_online >= MIN_NEW_GROUPS and self._created_online > (
            cfg.max_new_group_fraction * max(self._groups_after_recluster, 1)
        ):
            return True
        if self._baseline_distance is not None and self._online_distance_n >= MIN_DRIFT_SAMPLES:
            mean = self._online_distance_sum / self._online_distance_n
            return mean > cfg.drift_factor * max(self._baseline_distance, DRIFT_FLOOR)
        return False

    def recluster(self, now: float) -> ReclusterResult:
        """Re-run Algorithm 1 over every waiting request and keep group ids where possible.

        Features are recomputed (with the current ``predict_output``) and re-standardised. Per
        partition, k-means and splitting give the new groups; each new group takes the id of the old
        group it shares most members with, when they share at least ``keep_id_overlap`` of the larger
        of the two (greedy, largest overlaps first). The other new groups get new ids, and old ids
        left unmatched are reported removed.
        """
        return self._recluster(now, np.zeros(0, dtype=np.int64))

    def _recluster(self, now: float, fresh: IntArray) -> ReclusterResult:
        """``recluster``, with the requests in slots ``fresh`` (in no group yet: ``add_many``)
        among the waiting ones. Each of them counts as a group of its own whose id no new
        group takes."""
        cfg = self._config
        old = list(self._groups.values())
        n = len(self._waiting)
        held = n - len(fresh)
        # Every waiting request, group after group, each group's in FCFS order, then the fresh
        # ones: rows below.
        slots = np.concatenate(
            (np.fromiter(chain.from_iterable(g.slots for g in old), np.int64, held), fresh)
        )
        old_ids = [g.id for g in old]
        old_sizes = np.fromiter((len(g.slots) for g in old), np.int64, len(old))
        old_code = np.concatenate(
            (
                np.repeat(np.arange(len(old), dtype=np.int64), old_sizes),
                np.arange(len(old), len(old) + len(fresh), dtype=np.int64),
            )
        )
        if n == 0:
            self._reset(now, groups={}, parts={}, baseline=None)
            return ReclusterResult((), (), tuple(old_ids), 0, now)

        raw = self._waiting.features(slots, self._predict)
        mult = fit_multipliers(raw)
        points = raw * mult
        new_code, all_rows, new_keys = self._cluster(slots, raw, mult, old_code)
        groups_n = len(new_keys)
        new_sizes = np.bincount(new_code, minlength=groups_n)
        match = _match(old_code[:held], old_sizes, new_code[:held], new_sizes, cfg.keep_id_overlap)

        ids: list[str] = []
        created: list[str] = []
        for j in range(groups_n):
            if j in match:
                ids.append(old_ids[match[j]])
            else:
                ids.append(self._fresh_id())
                created.append(ids[-1])
        kept_set = {old_ids[i] for i in match.values()}

        sums = np.zeros((groups_n, len(FEATURES)))
        np.add.at(sums, new_code, raw)
        centroids = sums / new_sizes[:, None] * mult
        baseline = float(np.linalg.norm(points - centroids[new_code], axis=1).mean())

        # Each group's rows, one after the other: the bounds of their features in one pass.
        starts = np.zeros(groups_n, dtype=np.int64)
        np.cumsum(new_sizes[:-1], out=starts[1:])
        bounded = raw[all_rows, :BOUNDED_FEATURES]
        lo = np.minimum.reduceat(bounded, starts, axis=0)
        hi = np.maximum.reduceat(bounded, starts, axis=0)
        slot_list = slots[all_rows].tolist()
        begins, ends = starts.tolist(), (starts + new_sizes).tolist()
        groups: dict[str, _Group] = {}
        by_index = np.empty(groups_n, dtype=object)
        placed: dict[GroupKey, tuple[_Partition, list[int]]] = {}
        per_key = Counter(new_keys)
        for j in sorted(range(groups_n), key=lambda j: int(ids[j][1:])):
            key = new_keys[j]
            entry = placed.get(key)
            if entry is None:
                entry = placed[key] = (_Partition(per_key[key]), [])
            part, members = entry
            # A group that keeps its id keeps its object: fewer new objects for the collector.
            if j in match:
                group = old[match[j]]
                group.place(key, part, sums[j])
            else:
                group = _Group(ids[j], key, part, sums[j])
            group.slots = slot_list[begins[j] : ends[j]]
            members.append(j)  # the group's row in its partition: ``group.row``
            groups[group.id] = group
            by_index[j] = group
        parts: dict[GroupKey, _Partition] = {}
        for key, (part, members) in placed.items():
            sel = np.array(members, dtype=np.int64)
            k = len(members)
            part.centroids[:k] = centroids[sel]
            part.sizes[:k] = new_sizes[sel]
            part.lo[:k] = lo[sel]
            part.hi[:k] = hi[sel]
            parts[key] = part
        self._waiting.group[slots] = by_index[new_code]
        self._waiting.raw[slots] = raw
        self._mult = mult
        self._reset(now, groups=groups, parts=parts, baseline=baseline)
        return ReclusterResult(
            kept=tuple(gid for gid in ids if gid in kept_set),
            created=tuple(created),
            removed=tuple(gid for gid in old_ids if gid not in kept_set),
            requests=n,
            now=now,
        )

    # --- internals -----------------------------------------------------------------------------

    def _nearest(
        self, part: _Partition, raw: FloatArray, x: FloatArray
    ) -> tuple[int, float] | None:
        """The row in ``part`` of the group a request joins (``add``: the nearest of those below
        ``max_group_size`` within the spread bounds; features ``raw``, scaled ``x``) and its
        squared distance, or None.

        Up to ``SCALAR_ROWS`` groups below the size bound — a backlog's partitions hold mostly
        full groups — are compared one by one in Python floats, more in one numpy pass over the
        partition. Both make the same float operations (the squared distance summed left to
        right, as numpy sums a row) and take the lowest row among equals: the same choice."""
        n = len(part.gids)
        if not n:
            return None
        open_rows = (part.sizes[:n] < self._config.max_group_size).nonzero()[0]
        if len(open_rows) > SCALAR_ROWS:
            slo = raw[:BOUNDED_FEATURES]
            spread = np.maximum(part.hi[:n], slo) - np.minimum(part.lo[:n], slo)
            ok = (part.sizes[:n] < self._config.max_group_size) & (
                spread <= self._max_log_spread + 1e-9
            ).all(axis=1)
            if not ok.any():
                return None
            diff = part.centroids[:n] - x
            d2 = np.where(ok, (diff * diff).sum(axis=1), np.inf)
            row = int(d2.argmin())
            return row, float(d2[row])
        e, t, p, _ = raw.tolist()
        e_max, t_max, p_max = self._spread_limits
        x0, x1, x2, x3 = x.tolist()
        best: tuple[int, float] | None = None
        for row, (e_hi, t_hi, p_hi), (e_lo, t_lo, p_lo), (c0, c1, c2, c3) in zip(
            open_rows.tolist(),
            part.hi[open_rows].tolist(),
            part.lo[open_rows].tolist(),
            part.centroids[open_rows].tolist(),
            strict=True,
        ):
            if (
                max(e_hi, e) - min(e_lo, e) <= e_max
                and max(t_hi, t) - min(t_lo, t) <= t_max
                and max(p_hi, p) - min(p_lo, p) <= p_max
            ):
                d0, d1, d2, d3 = c0 - x0, c1 - x1, c2 - x2, c3 - x3
                dist = d0 * d0 + d1 * d1 + d2 * d2 + d3 * d3
                if best is None or dist < best[1]:
                    best = (row, dist)
        return best

    def _get(self, gid: str) -> _Group:
        group = self._groups.get(gid)
        if group is None:
            raise GroupError(f"unknown group {gid!r} (emptied, re-clustered away or never created)")
        return group

    def _fresh_id(self) -> str:
        gid = f"g{self._next_id}"
        self._next_id += 1
        return gid

    def _new_group(self, key: GroupKey, part: _Partition, feature_sum: FloatArray) -> _Group:
        group = _Group(self._fresh_id(), key, part, feature_sum)
        self._groups[group.id] = group
        return group

    def _group_at(self, slot: int) -> _Group:
        group: _Group = self._waiting.group[slot]
        return group

    def _insert(self, group: _Group, request: Request, raw: FloatArray) -> None:
        waiting = self._waiting
        slot = waiting.add(request, raw, group)
        members = group.slots
        if not members or _fcfs(request) >= _fcfs(waiting.at(members[-1])):
            members.append(slot)
        else:  # a late or redelivered request: keep FCFS order
            bisect.insort(members, slot, key=lambda s: _fcfs(waiting.at(s)))
        group.feature_sum = group.feature_sum + raw
        part, row = group.part, group.row
        part.centroids[row] = group.feature_sum / len(members) * self._mult
        part.sizes[row] = len(members)
        slo = raw[:BOUNDED_FEATURES]
        if len(members) == 1:
            part.lo[row] = slo
            part.hi[row] = slo
        else:
            np.minimum(part.lo[row], slo, out=part.lo[row])
            np.maximum(part.hi[row], slo, out=part.hi[row])
        group.view = None
        if group.deadlines is not None:
            e2e, ttft = group.deadlines
            if request.slo.ttft_s is not None:
                due = request.arrival_s + request.slo.ttft_s
                ttft = due if ttft is None else min(ttft, due)
            group.deadlines = (min(e2e, request.deadline_s), ttft)

    def _detach(self, group: _Group, slot: int) -> None:
        """Bookkeeping after the request in ``slot`` left ``group.slots``: its slot is freed."""
        raw = self._waiting.raw[slot].copy()
        self._waiting.release(slot)
        self._changes += 1
        part, row = group.part, group.row
        if not group.slots:
            del self._groups[group.id]
            moved = part.delete(row)
            if moved is not None:
                self._groups[moved].row = row
            if not part.gids:
                del self._parts[group.key]
            return
        group.feature_sum = group.feature_sum - raw
        part.centroids[row] = group.feature_sum / len(group.slots) * self._mult
        part.sizes[row] = len(group.slots)
        slo = self._waiting.raw[group.slots, :BOUNDED_FEATURES]
        part.lo[row] = slo.min(axis=0)
        part.hi[row] = slo.max(axis=0)
        group.view = None
        group.deadlines = None

    def _view(self, group: _Group) -> RequestGroup:
        if group.view is None:
            members = tuple(self._waiting.request[group.slots])
            raw = self._waiting.raw[group.slots]
            ttfts = [r.slo.ttft_s for r in members if r.slo.ttft_s is not None]
            ttft_due = [r.arrival_s + r.slo.ttft_s for r in members if r.slo.ttft_s is not None]
            model, tier, slo_class, _ = group.key
            group.view = RequestGroup(
                id=group.id,
                model=model,
                tier=tier,
                slo_class=slo_class,
                requests=members,
                input_tokens=sum(r.input_tokens for r in members),
                predicted_output_tokens=float(predicted_output(raw).sum()),
                earliest_deadline_s=min(r.deadline_s for r in members),
                min_e2e_slo_s=min(r.slo.e2e_s for r in members),
                min_ttft_slo_s=min(ttfts) if ttfts else None,
                centroid=tuple(float(v) for v in group.part.centroids[group.row]),
                earliest_ttft_deadline_s=min(ttft_due) if ttft_due else None,
            )
        return group.view

    def _cluster(
        self, slots: IntArray, raw: FloatArray, mult: FloatArray, old_code: IntArray
    ) -> tuple[IntArray, IntArray, list[GroupKey]]:
        """Algorithm 1 per partition: the new group of every request, groups numbered partition
        by partition (partitions sorted) and by their oldest request; the requests of every group
        in FCFS order, one group after the other; and each group's partition.

        For stable ids, k-means starts from the partition's previous centres, samples the requests
        with the smallest hash of their id, and splits prefer the boundaries of the old groups.
        """
        points = raw * mult
        cfg = self._config
        n = len(slots)
        keys, part_rank = self._waiting.partitions(slots, cfg.deadline_window)
        order = self._waiting.fcfs_order(slots, part_rank)
        bounds = np.searchsorted(part_rank[order], np.arange(len(keys) + 1))
        sizes = np.diff(bounds).tolist()
        per_model: dict[str, int] = {}
        for key, size in zip(keys, sizes, strict=True):
            per_model[key[0]] = per_model.get(key[0], 0) + size
        inits = [self._centres.get(key) for key in keys]
        group, fitted = form_groups(
            points[order],
            raw[order, :BOUNDED_FEATURES],
            bounds,
            max_group_size=cfg.max_group_size,
            k_caps=[
                max(1, round(cfg.max_clusters_per_model * (size / per_model[key[0]])))
                for key, size in zip(keys, sizes, strict=True)
            ],
            max_log_spread=cfg.max_log_spread,
            sample=cfg.kmeans_sample,
            max_iter=cfg.kmeans_max_iter,
            seed=cfg.seed,
            sample_key=self._waiting.id_hashes(slots)[order],
            anchors=old_code[order],
            inits=[None if init is None else init * mult for init in inits],
        )
        # raw units: the next fit may scale differently
        self._centres = {
            key: centres / mult
            for key, centres in zip(keys, fitted, strict=True)
            if centres is not None
        }
        new_code = np.empty(n, dtype=np.int64)
        new_code[order] = group
        group_part = np.empty(int(group.max()) + 1, dtype=np.int64)
        group_part[group] = np.repeat(np.arange(len(keys)), sizes)
        members = order[np.argsort(group, kind="stable")]
        return new_code, members, [keys[p] for p in group_part.tolist()]

    def _reset(
        self,
        now: float,
        *,
        groups: dict[str, _Group],
        parts: dict[GroupKey, _Partition],
        baseline: float | None,
    ) -> None:
        self._groups = groups
        self._parts = parts
        self._baseline_distance = baseline
        self._last_recluster_s = now
        self._first_change_s = None
        self._changes = 0
        self._created_online = 0
        self._groups_after_recluster = len(groups)
        self._online_distance_sum = 0.0
        self._online_distance_n = 0


def _spread_limits(max_log_spread: FloatArray) -> tuple[float, float, float]:
    """The spread bounds as ``add``'s numpy pass compares them (with its 1e-9 of slack)."""
    e, t, p = (max_log_spread + 1e-9).tolist()
    return e, t, p


def _match(
    old_code: IntArray,
    old_sizes: IntArray,
    new_code: IntArray,
    new_sizes: IntArray,
    min_overlap: float,
) -> dict[int, int]:
    """New group index -> old group index whose id it keeps: greedy by overlap, largest first.

    A pair qualifies when it shares at least ``min_overlap`` × the larger group's size.
    """
    if len(old_sizes) == 0:
        return {}
    width = len(new_sizes)
    pairs, counts = np.unique(old_code * width + new_code, return_counts=True)
    olds, news = pairs // width, pairs % width
    need = min_overlap * np.maximum(old_sizes[olds], new_sizes[news])
    good = np.flatnonzero(counts >= need - 1e-9)
    good = good[np.lexsort((news[good], olds[good], -counts[good]))]
    match: dict[int, int] = {}
    taken: set[int] = set()
    for p in good:
        o, j = int(olds[p]), int(news[p])
        if o not in taken and j not in match:
            match[j] = o
            taken.add(o)
    return match
