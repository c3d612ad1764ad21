"""The plan problem of the waiting groups at every concurrency limit an instance may run
(``ProblemFamily``, built by ``build_family``): the QLM policy picks one limit per instance
(``qlm.planner.concurrency``) and hands that problem to the solver (``qlm.planner.solve``)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np
import numpy.typing as npt

from qlm.domain import Request, Tier
from qlm.planner.config import PlannerConfig
from qlm.planner.policy import InstanceLoad
from qlm.planner.program import FloatArray, GroupTable, PlanInstance, PlanProblem, padded_empty
from qlm.rct.estimator import RCTEstimator
from qlm.rct.profile import HardwareProfile

BATCH_CHOICES = (16, 32, 64, 96, 128, 192, 256, 384, 512)
"""Concurrency limits the planner considers for an instance (capped by its ``max_num_seqs``)."""


@dataclass(frozen=True)
class ProblemFamily:
    """The plan problem at every concurrency limit the planner may choose per instance.

    With ``b`` requests running, decode runs at ``decode_s(b)`` per step for all ``b`` (the
    profile), so a group's fluid work is its prompt work plus ``output × decode_s(b) / b``; its last
    request's latency floor is its prefill plus ``output × (decode_s(b) + b × refill)``, where
    ``refill`` is the prompt work per output token of the waiting mix (chunked prefill shares each
    step with decode). A larger ``b`` drains faster and makes every request slower: the trade-off
    the planner settles per instance.

    When some group has a TTFT deadline, the problem predicts first tokens too: a group's first
    request is pulled when a slot of the ``b`` frees, ``lead = (b − 1) / 2 × w̄`` before its
    fluid start (the other slots hold half a request's work ``w̄`` each on average, ``w̄`` the
    waiting requests' mean fluid work on the instance), not before ``now_s``, and has its first
    token after its prefill and the decode step it rides (``first``).
    """

    groups: GroupTable
    instances: tuple[PlanInstance, ...]
    batches: tuple[tuple[int, ...], ...]  # per instance, the limits it may use
    delta: float
    scenarios: _Scenarios
    speeds: tuple[_Speed, ...]  # per instance
    now_s: float = -math.inf  # the earliest a request is pulled (TTFT)
    pinned: tuple[int, ...] = ()  # per group, the instance it must stay on (-1: any); () none
    _terms: dict[tuple[_Speed, int], tuple[FloatArray, FloatArray]] = field(
        default_factory=dict, compare=False, repr=False
    )
    _first: dict[tuple[_Speed, int], tuple[FloatArray, float]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def has_ttft(self) -> bool:
        """Whether some group has a TTFT deadline (the problem then predicts first tokens)."""
        return bool(np.isfinite(self.groups.ttft_deadline_s).any())

    def first_terms(self, g: int, b: int) -> tuple[FloatArray, float]:
        """Instance ``g``'s ``(first, lead)`` at limit ``b``: per group, seconds from pulling its
        first request to its first token, and how long before a group's fluid start its first
        request is pulled."""
        key = (self.speeds[g], b)
        out = self._first.get(key)
        if out is None:
            work, _ = self.terms(g, b)
            out = self._first[key] = self.scenarios.first_terms(self.speeds[g], b, work)
        return out

    def terms(self, g: int, b: int) -> tuple[FloatArray, FloatArray]:
        """Instance ``g``'s ``(work, floor)`` per group and scenario, ``(n, S)`` each, at limit
        ``b``: computed when first asked (a plan asks for one limit per instance) and shared by
        the instances alike in hardware and calibration."""
        key = (self.speeds[g], b)
        out = self._terms.get(key)
        if out is None:
            out = self._terms[key] = self.scenarios.terms(self.speeds[g], b)
        return out

    def problem(self, choice: Sequence[int]) -> PlanProblem:
        """The problem with instance ``g`` limited to ``choice[g]`` running requests."""
        n, q = len(self.groups), len(self.instances)
        s_count = self.scenarios.count
        proc = padded_empty(n, q, s_count)
        floor = padded_empty(n, q, s_count)
        for g, b in enumerate(choice):
            proc[:, g], floor[:, g] = self.terms(g, b)
        if self.pinned:  # a pinned group is eligible on its instance only
            pins = np.asarray(self.pinned)
            elsewhere = (pins[:, None] >= 0) & (pins[:, None] != np.arange(q)[None, :])
            proc[elsewhere] = np.inf
            floor[elsewhere] = np.inf
        if not self.has_ttft:
            return PlanProblem(self.groups, self.instances, proc, floor, delta=self.delta)
        first = np.empty((n, q))
        lead = np.empty(q)
        for g, b in enumerate(choice):
            first[:, g], lead[g] = self.first_terms(g, b)
        return PlanProblem(
            self.groups,
            self.instances,
            proc,
            floor,
            delta=self.delta,
            first=first,
            lead=lead,
            now_s=self.now_s,
        )


@dataclass(frozen=True)
class _Speed:
    """What an instance's terms depend on: its models' hardware profiles and its calibration."""

    hardware: tuple[tuple[str, HardwareProfile], ...]
    wait_f: float
    eps_f: float


@dataclass(frozen=True, eq=False)
class _Scenarios:
    """The waiting groups' lengths, drawn once per family (``(n, S)`` output scenarios)."""

    models: npt.NDArray[np.str_]
    inputs: FloatArray
    last_inputs: FloatArray
    out_mean: FloatArray
    out_s: FloatArray
    last_s: FloatArray
    first_inputs: FloatArray  # the prompt of each group's first request
    sizes: FloatArray  # requests per group
    _bases: dict[
        tuple[str, HardwareProfile, int],
        tuple[npt.NDArray[np.intp], FloatArray, FloatArray, FloatArray],
    ] = field(default_factory=dict, compare=False, repr=False)

    @property
    def count(self) -> int:
        return int(self.out_s.shape[1])

    def terms(self, speed: _Speed, b: int) -> tuple[FloatArray, FloatArray]:
        n, s_count = self.out_s.shape
        if len(speed.hardware) == 1:  # (the common case: no row left at inf, none to scatter)
            m, hw = speed.hardware[0]
            rows, work, prefill, decode = self._base(m, hw, b)
            if len(rows) == n:
                return work * speed.wait_f, prefill + decode * speed.eps_f
        p_arr = np.full((n, s_count), np.inf)
        f_arr = np.full((n, s_count), np.inf)
        for m, hw in speed.hardware:
            rows, work, prefill, decode = self._base(m, hw, b)
            if not len(rows):
                continue
            p_arr[rows] = work * speed.wait_f
            f_arr[rows] = prefill + decode * speed.eps_f
        return p_arr, f_arr

    def _base(
        self, m: str, hw: HardwareProfile, b: int
    ) -> tuple[npt.NDArray[np.intp], FloatArray, FloatArray, FloatArray]:
        """What ``terms`` computes for model ``m``'s groups on ``hw`` at limit ``b`` before the
        instance's calibration multiplies it: shared by every instance with that hardware (their
        calibrations differ). Rows, fluid work, prefill of the last request, its decode."""
        key = (m, hw, b)
        hit = self._bases.get(key)
        if hit is not None:
            return hit
        rows = np.flatnonzero(self.models == m)
        w_in = hw.input_token_work_s
        refill = w_in * self.inputs[rows].sum() / max(float(self.out_mean[rows].sum()), 1.0)
        dec = hw.decode_s(b) * hw.inefficiency
        out = self._bases[key] = (
            rows,
            self.inputs[rows, None] * w_in + self.out_s[rows] * dec / b,
            (hw.prefill_base_s + hw.prefill_per_token_s * self.last_inputs[rows])[:, None],
            self.last_s[rows] * (dec + b * refill),
        )
        return out

    def first_terms(self, speed: _Speed, b: int, work: FloatArray) -> tuple[FloatArray, float]:
        """``(first, lead)`` at limit ``b`` (``ProblemFamily.first_terms``), ``work`` the
        groups' fluid work there (``terms``)."""
        first = np.full(len(self.sizes), np.inf)
        served = np.isfinite(work[:, 0])
        for m, hw in speed.hardware:
            rows = np.flatnonzero(self.models == m)
            step = hw.decode_s(b) * hw.inefficiency * speed.eps_f
            first[rows] = (
                hw.prefill_base_s + hw.prefill_per_token_s * self.first_inputs[rows] + step
            )
        requests = float(self.sizes[served].sum())
        mean_work = float(work[served].mean(axis=1).sum()) / requests if requests else 0.0
        return first, (b - 1) / 2 * mean_work


class WaitingGroups(Sequence[tuple[str, Sequence[Request], Tier]]):
    """Waiting groups as three columns — ids, requests in FCFS order, tiers — for
    ``build_family``: a sequence of ``(id, requests, tier)`` that holds three lists instead of a
    tuple per group (at 18,000 groups those tuples outlive the young garbage collections and
    bring on full ones)."""

    __slots__ = ("ids", "requests", "tiers")

    def __init__(
        self, ids: list[str], requests: list[Sequence[Request]], tiers: list[Tier]
    ) -> None:
        if not len(ids) == len(requests) == len(tiers):
            raise ValueError("ids, requests and tiers must have one entry per group")
        self.ids = ids
        self.requests = requests
        self.tiers = tiers

    @classmethod
    def of(cls, groups: Sequence[tuple[str, Sequence[Request], Tier]]) -> WaitingGroups:
        """The columns of ``groups`` (itself when it is columns already)."""
        if isinstance(groups, WaitingGroups):
            return groups
        return cls([g[0] for g in groups], [g[1] for g in groups], [g[2] for g in groups])

    def append(self, gid: str, requests: Sequence[Request], tier: Tier) -> None:
        self.ids.append(gid)
        self.requests.append(requests)
        self.tiers.append(tier)

    def pairs(self) -> _Pairs:
        """``(id, requests)`` per group, as ``RCTEstimator.group_loads`` reads them."""
        return _Pairs(self.ids, self.requests)

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> tuple[str, Sequence[Request], Tier]: ...

    @overload
    def __getitem__(self, i: slice) -> list[tuple[str, Sequence[Request], Tier]]: ...

    def __getitem__(
        self, i: int | slice
    ) -> tuple[str, Sequence[Request], Tier] | list[tuple[str, Sequence[Request], Tier]]:
        if isinstance(i, slice):
            return list(zip(self.ids[i], self.requests[i], self.tiers[i], strict=True))
        return self.ids[i], self.requests[i], self.tiers[i]

    def __iter__(self) -> Iterator[tuple[str, Sequence[Request], Tier]]:
        return zip(self.ids, self.requests, self.tiers, strict=True)


class _Pairs(Sequence[tuple[str, Sequence[Request]]]):
    """Two columns read as a sequence of pairs, made one at a time."""

    __slots__ = ("_ids", "_requests")

    def __init__(self, ids: list[str], requests: list[Sequence[Request]]) -> None:
        self._ids = ids
        self._requests = requests

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, i: int) -> tuple[str, Sequence[Request]]: ...

    @overload
    def __getitem__(self, i: slice) -> list[tuple[str, Sequence[Request]]]: ...

    def __getitem__(
        self, i: int | slice
    ) -> tuple[str, Sequence[Request]] | list[tuple[str, Sequence[Request]]]:
        if isinstance(i, slice):
            return list(zip(self._ids[i], self._requests[i], strict=True))
        return self._ids[i], self._requests[i]

    def __iter__(self) -> Iterator[tuple[str, Sequence[Request]]]:
        return zip(self._ids, self._requests, strict=True)


def build_family(
    groups: Sequence[tuple[str, Sequence[Request], Tier]],
    instances: Sequence[InstanceLoad],
    ready_s: Mapping[str, float],
    estimator: RCTEstimator,
    config: PlannerConfig,
    rng: np.random.Generator,
    now: float | None = None,
    pinned: Mapping[str, str] | None = None,
) -> ProblemFamily:
    """The plan problems of the waiting groups (id, requests in FCFS order, tier) on the up
    instances, with scenarios of each group's output drawn from the estimator's posterior.
    ``now``: the earliest a request can be pulled (default: the earliest ``ready_s``);
    ``pinned``: groups that must stay on an instance (by name; one that is not up: any)."""
    up = [i for i in instances if i.up]
    columns = WaitingGroups.of(groups)
    n, s_count = len(columns), config.scenarios
    z_total = rng.standard_normal((n, s_count))
    z_last = rng.standard_normal((n, s_count))
    loads = estimator.group_loads(columns.pairs())
    tier_weights = config.tier_weights
    plan_groups = GroupTable(
        columns.ids,
        loads.models,
        loads.earliest_deadline_s,
        # (a Python product per group, as PlanGroup's weight was: the same numbers)
        np.array(
            [
                tier_weights[tier] * size
                for tier, size in zip(columns.tiers, loads.size.tolist(), strict=True)
            ],
            np.float64,
        ),
        loads.earliest_ttft_deadline_s,
    )
    out_s = np.maximum(
        loads.output_mean[:, None] + np.sqrt(loads.output_var)[:, None] * z_total, 0.0
    )  # (n, S)
    last_s = np.maximum(
        loads.last_output_mean[:, None] + np.sqrt(loads.last_output_var)[:, None] * z_last, 1.0
    )
    models = np.array(loads.models)
    inputs = loads.input_tokens
    last_inputs = loads.last_input_tokens
    first_inputs = loads.first_input_tokens
    sizes = loads.size.astype(np.float64)
    scenarios = _Scenarios(
        models, inputs, last_inputs, loads.output_mean, out_s, last_s, first_inputs, sizes
    )
    batches: list[tuple[int, ...]] = []
    speeds: list[_Speed] = []
    plan_instances: list[PlanInstance] = []
    for inst in up:
        wait_f, eps_f = estimator.calibration_factors(inst.name)
        limits = tuple(
            sorted({b for b in BATCH_CHOICES if b < inst.max_running} | {inst.max_running})
        )
        batches.append(limits)
        hws = {m: estimator.profile.hardware_for(m, inst.gpu, inst.gpu_count) for m in inst.models}
        speeds.append(_Speed(tuple(hws.items()), wait_f, eps_f))
        switch = {m: 0.0 if m == inst.active_model else hws[m].warm_load_s for m in inst.models}
        plan_instances.append(
            PlanInstance(inst.name, inst.models, inst.active_model, ready_s[inst.name], switch)
        )
    return ProblemFamily(
        plan_groups,
        tuple(plan_instances),
        tuple(batches),
        config.delta,
        scenarios,
        tuple(speeds),
        min(ready_s.values(), default=0.0) if now is None else now,
        _pins(columns.ids, up, pinned) if pinned is not None else (),
    )


def _pins(
    ids: Sequence[str], up: Sequence[InstanceLoad], pinned: Mapping[str, str]
) -> tuple[int, ...]:
    where = {inst.name: q for q, inst in enumerate(up)}
    return tuple(where.get(pinned.get(gid, ""), -1) for gid in ids)
