"""A request group's load as the RCT estimator sums it (paper Eq. 5): its size, deadlines,
prompt tokens and expected output tokens (sums and its last request's), one group at a time
(``GroupLoad``) or many as arrays (``GroupLoads``). ``GroupLoader`` computes them under the
current output beliefs, keeping what does not depend on the beliefs while a group is unchanged.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from qlm.domain import Request
from qlm.rct.beliefs import MomentsKey, OutputBeliefs
from qlm.rct.output_model import LengthHistogram, cap_moments
from qlm.rct.tuning import GROUP_SUMS_MAX


@dataclass(frozen=True, slots=True)
class GroupLoad:
    """Aggregated work of one request group, in the order its requests will be served."""

    group_id: str
    model: str
    size: int
    earliest_deadline_s: float
    input_tokens: int  # sum over the group
    output_mean: float  # sum of the requests' expected outputs
    output_var: float  # sum of their variances
    last_output_mean: float  # the last request's expected output (Eq. 5)
    last_output_var: float
    last_input_tokens: int
    earliest_ttft_deadline_s: float = math.inf  # of the requests with a TTFT SLO (inf: none)
    first_input_tokens: int = 0  # the prompt of the request served first


@dataclass(frozen=True, slots=True)
class GroupSums:
    """What ``GroupLoader.load`` needs of a group's requests besides the beliefs: prompt tokens, the
    earliest deadline and TTFT deadline, and how many requests share each belief lookup (one
    request of each)."""

    inputs: int
    earliest: float
    lookups: tuple[tuple[Request, int], ...]
    earliest_ttft: float = math.inf


def group_sums(requests: Sequence[Request], key: Callable[[Request], Hashable]) -> GroupSums:
    inputs, earliest, earliest_ttft = 0, math.inf, math.inf
    counts: dict[Hashable, list[Any]] = {}
    for r in requests:
        k = key(r)
        entry = counts.get(k)
        if entry is None:
            counts[k] = [r, 1]
        else:
            entry[1] += 1
        inputs += r.input_tokens
        deadline = r.arrival_s + r.slo.e2e_s  # (Request.deadline_s)
        if deadline < earliest:
            earliest = deadline
        if r.slo.ttft_s is not None and r.arrival_s + r.slo.ttft_s < earliest_ttft:
            earliest_ttft = r.arrival_s + r.slo.ttft_s
    return GroupSums(inputs, earliest, tuple((r, n) for r, n in counts.values()), earliest_ttft)


@dataclass(frozen=True, slots=True)
class GroupLoads:
    """``GroupLoad`` of many groups as arrays, one entry per group in the order asked
    (``GroupLoader.loads``)."""

    models: tuple[str, ...]
    size: npt.NDArray[np.int64]
    earliest_deadline_s: npt.NDArray[np.float64]
    input_tokens: npt.NDArray[np.float64]
    output_mean: npt.NDArray[np.float64]
    output_var: npt.NDArray[np.float64]
    last_output_mean: npt.NDArray[np.float64]
    last_output_var: npt.NDArray[np.float64]
    last_input_tokens: npt.NDArray[np.float64]
    earliest_ttft_deadline_s: npt.NDArray[np.float64]
    first_input_tokens: npt.NDArray[np.float64]
    group_ids: tuple[str, ...] = ()

    def take(self, index: Sequence[int] | npt.NDArray[np.int64]) -> GroupLoads:
        """The groups at ``index`` (e.g. one virtual queue's, in its order)."""
        at = np.asarray(index, np.int64)
        return GroupLoads(
            models=tuple(self.models[k] for k in at.tolist()),
            size=self.size[at],
            earliest_deadline_s=self.earliest_deadline_s[at],
            input_tokens=self.input_tokens[at],
            output_mean=self.output_mean[at],
            output_var=self.output_var[at],
            last_output_mean=self.last_output_mean[at],
            last_output_var=self.last_output_var[at],
            last_input_tokens=self.last_input_tokens[at],
            earliest_ttft_deadline_s=self.earliest_ttft_deadline_s[at],
            first_input_tokens=self.first_input_tokens[at],
            group_ids=tuple(self.group_ids[k] for k in at.tolist()) if self.group_ids else (),
        )


def as_loads(groups: Sequence[GroupLoad]) -> GroupLoads:
    """``GroupLoad``s as arrays."""
    return GroupLoads(
        models=tuple(g.model for g in groups),
        size=np.array([g.size for g in groups], np.int64),
        earliest_deadline_s=np.array([g.earliest_deadline_s for g in groups], np.float64),
        input_tokens=np.array([g.input_tokens for g in groups], np.float64),
        output_mean=np.array([g.output_mean for g in groups], np.float64),
        output_var=np.array([g.output_var for g in groups], np.float64),
        last_output_mean=np.array([g.last_output_mean for g in groups], np.float64),
        last_output_var=np.array([g.last_output_var for g in groups], np.float64),
        last_input_tokens=np.array([g.last_input_tokens for g in groups], np.float64),
        earliest_ttft_deadline_s=np.array([g.earliest_ttft_deadline_s for g in groups], np.float64),
        first_input_tokens=np.array([g.first_input_tokens for g in groups], np.float64),
        group_ids=tuple(g.group_id for g in groups),
    )


@dataclass(frozen=True, slots=True)
class LoadRow:
    """A group's ``GroupSums`` ready for arrays: its belief lookups as ids into the
    estimator's registry (``GroupLoader._lookup_ids``) with their counts, and the id of its last
    request's lookup."""

    model: str
    lookups: npt.NDArray[np.int64]
    counts: npt.NDArray[np.float64]
    last: int
    values: tuple[float, ...]  # size, earliest, inputs, last input, earliest TTFT, first input


@dataclass
class LoadTable:
    """What ``GroupLoader.loads`` keeps of each group while it is unchanged, one row
    (slot) per group: its belief lookups (ids into the estimator's registry, with their counts,
    padded with count 0), its last request's lookup, its sums that do not depend on the beliefs
    (``LoadRow.values``) and its model. A plan gathers the rows of its groups; only a group
    whose snapshot changed is written again, and an ended group's slot is reused."""

    slot_of: dict[str, int] = field(default_factory=dict)
    snapshot: list[Sequence[Request] | None] = field(default_factory=list)
    model: list[str] = field(default_factory=list)
    free: list[int] = field(default_factory=list)
    length: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    last: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    ids: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros((0, 1), np.int64))
    counts: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros((0, 1)))
    values: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros((0, 6)))

    def hit(self, gid: str, requests: Sequence[Request]) -> int | None:
        """The slot of ``gid`` if it holds this very snapshot."""
        slot = self.slot_of.get(gid)
        if slot is not None and self.snapshot[slot] is requests:
            return slot
        return None

    def put(self, gid: str, requests: Sequence[Request], row: LoadRow) -> int:
        """Write ``gid``'s row (a list snapshot, which may change in place, is never a hit)."""
        slot = self.slot_of.get(gid)
        if slot is None:
            slot = self.free.pop() if self.free else self._grow()
            self.slot_of[gid] = slot
        n = len(row.lookups)
        if n > self.ids.shape[1]:
            wider = max(n, 2 * self.ids.shape[1])
            pad = ((0, 0), (0, wider - self.ids.shape[1]))
            self.ids = np.pad(self.ids, pad)
            self.counts = np.pad(self.counts, pad)
        self.ids[slot, :n] = row.lookups
        self.ids[slot, n:] = 0
        self.counts[slot, :n] = row.counts
        self.counts[slot, n:] = 0.0
        self.length[slot] = n
        self.last[slot] = row.last
        self.values[slot] = row.values
        self.model[slot] = row.model
        self.snapshot[slot] = requests if isinstance(requests, tuple) else None
        return slot

    def _grow(self) -> int:
        slot = len(self.snapshot)
        if slot == len(self.length):
            more = max(64, slot)
            self.length = np.concatenate((self.length, np.zeros(more, np.int64)))
            self.last = np.concatenate((self.last, np.zeros(more, np.int64)))
            self.ids = np.concatenate((self.ids, np.zeros((more, self.ids.shape[1]), np.int64)))
            self.counts = np.concatenate((self.counts, np.zeros((more, self.counts.shape[1]))))
            self.values = np.concatenate((self.values, np.zeros((more, 6))))
        self.snapshot.append(None)
        self.model.append("")
        return slot

    def drop(self, gid: str) -> None:
        slot = self.slot_of.pop(gid, None)
        if slot is not None:
            self.snapshot[slot] = None
            self.free.append(slot)

    def clear(self) -> None:
        self.slot_of.clear()
        self.free = list(range(len(self.snapshot)))[::-1]
        self.snapshot = [None] * len(self.snapshot)


@dataclass
class GroupLoader:
    """``GroupLoad``s of request groups under ``beliefs``: what a group's requests sum to
    besides the beliefs is kept while the group is unchanged (the grouper hands out the same
    snapshot), so a plan after a completion, which moves the beliefs, does not walk every
    waiting request again."""

    beliefs: OutputBeliefs
    # Per group id, its requests (the grouper's snapshot: the same tuple while the group is
    # unchanged) and their sums that do not depend on the beliefs (``load``).
    _sums: dict[str, tuple[Sequence[Request], GroupSums]] = field(default_factory=dict, init=False)
    # The same for ``loads``: per group its ``LoadRow``, and the belief lookups' ids
    # (with a request of each to look its moments up with).
    _rows: LoadTable = field(default_factory=LoadTable, init=False)
    _lookup_ids: dict[Hashable, int] = field(default_factory=dict, init=False)
    _lookup_requests: list[Request] = field(default_factory=list, init=False)
    _lookup_keys: list[tuple[str, str, int, int]] = field(default_factory=list, init=False)

    def load(self, group_id: str, requests: Sequence[Request]) -> GroupLoad:
        """Aggregate a group's requests (FCFS order) into the sums the queue estimate needs."""
        if not requests:
            raise ValueError(f"group {group_id} is empty")
        # Requests of one group mostly share a belief: their moments are looked up once per
        # (class, prompt bin, cap), and the counts are kept while the group is unchanged (the
        # grouper hands out the same snapshot), so a plan after a completion, which moves the
        # beliefs, does not walk every waiting request again.
        hit = self._sums.get(group_id)
        if hit is not None and hit[0] is requests:
            sums = hit[1]
        else:
            sums = group_sums(requests, self._lookup_key)
            if isinstance(requests, tuple):  # (a list may change in place: not kept)
                if len(self._sums) >= GROUP_SUMS_MAX:  # nobody called keep
                    self._sums.clear()
                self._sums[group_id] = (requests, sums)
        o_mean = o_var = 0.0
        for r, count in sums.lookups:
            m, v = self.beliefs.output_moments(r)
            o_mean += count * m
            o_var += count * v
        inputs, earliest = sums.inputs, sums.earliest
        last = requests[-1]
        lm, lv = self.beliefs.output_moments(last)
        return GroupLoad(
            group_id=group_id,
            model=requests[0].model,
            size=len(requests),
            earliest_deadline_s=earliest,
            input_tokens=inputs,
            output_mean=o_mean,
            output_var=o_var,
            last_output_mean=lm,
            last_output_var=lv,
            last_input_tokens=last.input_tokens,
            earliest_ttft_deadline_s=sums.earliest_ttft,
            first_input_tokens=requests[0].input_tokens,
        )

    def _lookup_key(self, r: Request) -> tuple[str, str, int, int]:
        return (r.model, r.slo_class, self.beliefs.bin_of(r), r.max_tokens)

    def loads(self, groups: Sequence[tuple[str, Sequence[Request]]]) -> GroupLoads:
        """``load`` of each of ``groups`` (id, requests in FCFS order), as arrays: the
        same numbers to the last bit (each group's moments summed in the same order). What a
        group's requests sum to besides the beliefs is kept while the group is unchanged (rows
        of ``LoadTable``: a plan gathers them and writes only the groups that changed), and
        the moments are looked up once per belief, the misses priced every cap at once."""
        table = self._rows
        if len(self._lookup_requests) > GROUP_SUMS_MAX or len(table.slot_of) >= GROUP_SUMS_MAX:
            table.clear()  # (rows hold ids into the registry; nobody called keep)
            self._lookup_ids.clear()
            self._lookup_requests.clear()
            self._lookup_keys.clear()
        n = len(groups)
        slots = np.empty(n, np.int64)
        for i, (gid, requests) in enumerate(groups):
            slot = table.hit(gid, requests)
            if slot is None:
                slot = table.put(gid, requests, self._row(gid, requests))
            slots[i] = slot
        lengths = table.length[slots]
        width = max(int(lengths.max(initial=1)), 1)
        ids = table.ids[slots, :width]
        counts = table.counts[slots, :width]
        present = np.arange(width)[None, :] < lengths[:, None]
        last = table.last[slots]
        used = np.unique(np.concatenate([ids[present], last]))
        mean = np.zeros(len(self._lookup_requests))
        var = np.zeros(len(self._lookup_requests))
        self._fill_moments(used.tolist(), mean, var)
        # (running totals along each row, as ``load`` adds: padding adds 0 × a moment)
        o_mean = np.cumsum(counts * mean[ids], axis=1)[:, -1] if n else np.zeros(0)
        o_var = np.cumsum(counts * var[ids], axis=1)[:, -1] if n else np.zeros(0)
        values = table.values[slots]
        models = table.model
        return GroupLoads(
            models=tuple([models[s] for s in slots.tolist()]),
            size=values[:, 0].astype(np.int64),
            earliest_deadline_s=values[:, 1],
            input_tokens=values[:, 2],
            output_mean=o_mean,
            output_var=o_var,
            last_output_mean=mean[last],
            last_output_var=var[last],
            last_input_tokens=values[:, 3],
            earliest_ttft_deadline_s=values[:, 4],
            first_input_tokens=values[:, 5],
            group_ids=tuple(gid for gid, _ in groups),
        )

    def _fill_moments(
        self, ids: list[int], mean: npt.NDArray[np.float64], var: npt.NDArray[np.float64]
    ) -> None:
        """``mean[k], var[k] = output_moments(_lookup_requests[k])`` for each of ``ids``: from
        the cache, and the misses (all of them after a completion moved a belief) priced per
        belief, every cap at once (``cap_moments``, the same numbers)."""
        moments, versions, keys = self.beliefs.moments, self.beliefs.versions, self._lookup_keys
        if len(moments) > 100_000:
            moments.clear()
        misses: dict[tuple[str, str, int, int], list[tuple[int, MomentsKey]]] = {}
        beliefs: dict[tuple[str, str, int, int], LengthHistogram] = {}
        for k in ids:
            model, cls, ib, cap = keys[k]
            key = (model, cls, ib, versions.get((model, cls), 0), cap, 0)
            hit = moments.get(key)
            if hit is not None:
                mean[k], var[k] = hit
                continue
            belief = key[:4]  # (model, class, prompt bin, version): one posterior
            missed = misses.get(belief)
            if missed is None:
                post = self.beliefs.posterior(self._lookup_requests[k])
                if not isinstance(post, LengthHistogram):
                    mean[k], var[k] = self.beliefs.output_moments(self._lookup_requests[k])
                    continue
                beliefs[belief] = post
                missed = misses[belief] = []
            missed.append((k, key))
        for belief, ks in misses.items():
            caps = np.array([key[4] for _, key in ks], np.float64)
            means, variances = cap_moments(beliefs[belief].outputs, caps)
            for (k, key), m, v in zip(ks, means.tolist(), variances.tolist(), strict=True):
                mean[k], var[k] = m, v
                moments[key] = (m, v)

    def _row(self, gid: str, requests: Sequence[Request]) -> LoadRow:
        if not requests:
            raise ValueError(f"group {gid} is empty")
        sums = group_sums(requests, self._lookup_key)
        last = requests[-1]
        return LoadRow(
            requests[0].model,
            np.array([self._lookup_id(r) for r, _ in sums.lookups], np.int64),
            np.array([float(count) for _, count in sums.lookups]),
            self._lookup_id(last),
            (
                len(requests),
                sums.earliest,
                sums.inputs,
                last.input_tokens,
                sums.earliest_ttft,
                requests[0].input_tokens,
            ),
        )

    def _lookup_id(self, r: Request) -> int:
        """The id of ``r``'s belief lookup (its moments with nothing generated yet)."""
        key = self._lookup_key(r)
        k = self._lookup_ids.get(key)
        if k is None:
            k = self._lookup_ids[key] = len(self._lookup_requests)
            self._lookup_requests.append(r)
            self._lookup_keys.append(key)
        return k

    def keep(self, group_ids: Iterable[str]) -> None:
        """Forget the sums of groups not in ``group_ids`` (those that ended): a planner calls
        it with the groups it plans, so that what ``load`` and ``loads`` keep stays that size."""
        keep = set(group_ids)
        for gid in [g for g in self._sums if g not in keep]:
            del self._sums[gid]
        for gid in [g for g in self._rows.slot_of if g not in keep]:
            self._rows.drop(gid)
