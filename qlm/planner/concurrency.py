"""The QLM policy's concurrency choice: per instance, a steady-state fluid model of the work that
keeps arriving at each concurrency limit it may run (``FluidModels``), the limit whose admitted
work meets the most weighted SLOs per second (``choose_limits``), and the admission verdict at
that limit (``Fluid``: what the cost-aware admission defers)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from qlm.domain import Request
from qlm.planner.admission import Admission, admit
from qlm.planner.arrivals import ArrivalWindow, ClassKey, class_of
from qlm.planner.budget import Deadline
from qlm.planner.config import PlannerConfig
from qlm.planner.family import ProblemFamily
from qlm.planner.policy import InstanceLoad
from qlm.planner.program import FloatArray
from qlm.rct.beliefs import prompt_bin
from qlm.rct.estimator import RCTEstimator
from qlm.rct.profile import HardwareProfile


@dataclass(frozen=True, slots=True)
class Fluid:
    """The fluid model of one instance at one concurrency limit: the admission verdict and what
    a request of each class is worth and costs there."""

    admission: Admission
    class_value: dict[ClassKey, float]  # tier weight × P(meet SLO) of the class
    class_output: dict[ClassKey, float]  # mean output of the class's recent arrivals
    per_output_s: dict[str, float]  # GPU-seconds per output token, per model
    per_input_s: dict[str, float]  # GPU-seconds per prompt token, per model
    rate: float = math.inf  # requests per second served with the instance busy, at this mix
    arriving: float = 0.0  # requests per second arriving for the instance (its share)

    def cost(self, req: Request, output: float) -> float:
        key = class_of(req)
        out = self.class_output.get(key, output)
        return req.input_tokens * self.per_input_s.get(
            req.model, 0.0
        ) + out * self.per_output_s.get(req.model, 0.0)

    def density(self, requests: Sequence[Request], output: float) -> float | None:
        """Value per GPU-second of a group (None when its class has not arrived lately)."""
        key = class_of(requests[0])
        value = self.class_value.get(key)
        if value is None:
            return None
        cost = sum(self.cost(r, output) for r in requests) / len(requests)
        return value / max(cost, 1e-12)

    def densities(
        self,
        groups: Sequence[tuple[str, Sequence[Request]]],
        outputs: Sequence[float],
        prompts: PromptRows,
    ) -> list[float | None]:
        """``density`` of each of ``groups`` (id, requests; ``outputs``: each one's expected
        output), in one
        numpy pass over their requests: the same numbers as ``density``, to the last bit (each
        request's cost in the same operations, summed in order)."""
        out: list[float | None] = [None] * len(groups)
        todo: list[int] = []
        rows: list[FloatArray] = []
        per_in: list[float] = []
        per_out: list[float] = []
        output: list[float] = []
        values: list[float] = []
        for k, (gid, requests) in enumerate(groups):
            key = class_of(requests[0])
            value = self.class_value.get(key)
            if value is None:
                continue
            inputs, uniform = prompts.row(gid, requests)
            if not uniform:  # (requests of several classes: each its own class's output)
                out[k] = self.density(requests, outputs[k])
                continue
            model = requests[0].model
            todo.append(k)
            rows.append(inputs)
            per_in.append(self.per_input_s.get(model, 0.0))
            per_out.append(self.per_output_s.get(model, 0.0))
            output.append(self.class_output.get(key, outputs[k]))
            values.append(value)
        if not todo:
            return out
        lengths = np.array([len(r) for r in rows], np.int64)
        matrix = np.zeros((len(rows), int(lengths.max())))
        col = np.arange(matrix.shape[1])
        present = col[None, :] < lengths[:, None]
        matrix[present] = np.concatenate(rows)
        costs = matrix * np.array(per_in)[:, None] + (np.array(output) * np.array(per_out))[:, None]
        costs[~present] = 0.0
        # (a running total along each row, as ``sum`` adds: trailing zeros change nothing)
        mean = np.cumsum(costs, axis=1)[:, -1] / lengths
        density = np.array(values) / np.maximum(mean, 1e-12)
        for k, d in zip(todo, density.tolist(), strict=True):
            out[k] = d
        return out


class PromptRows:
    """Per request group, its requests' prompt lengths (and whether they are all of one class),
    kept while the group is unchanged (the grouper hands out the same tuple until it changes) and
    forgotten with the groups ``keep`` is not given."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[Sequence[Request], FloatArray, bool]] = {}

    def row(self, gid: str, requests: Sequence[Request]) -> tuple[FloatArray, bool]:
        hit = self._rows.get(gid)
        if hit is not None and hit[0] is requests:
            return hit[1], hit[2]
        inputs = np.array([r.input_tokens for r in requests], np.float64)
        key = class_of(requests[0])
        uniform = all(class_of(r) == key for r in requests)
        if isinstance(requests, tuple):  # (a list may change in place: not kept)
            self._rows[gid] = (requests, inputs, uniform)
        return inputs, uniform

    def keep(self, group_ids: Iterable[str]) -> None:
        """Forget the rows of groups not in ``group_ids`` (those that ended)."""
        keep = set(group_ids)
        for gid in [g for g in self._rows if g not in keep]:
            del self._rows[gid]


CLASS_SAMPLE = 256
"""Recent arrivals of a request class whose lengths give the class's means (``FluidModels``)."""

FLUID_SHARE = 0.25
"""The share of the budget within which the concurrency choice re-evaluates instances (the least
recently evaluated first; the others keep their last evaluation), before the search."""


def pick_limit(
    values: Mapping[int, float],
    current: int | None,
    hysteresis: float,
    rates: Mapping[int, float] | None = None,
    tolerance: float = 0.0,
    arriving: float = 0.0,
) -> int:
    """The concurrency limit worth the most (the smallest of equals), unless ``current`` is
    within ``hysteresis`` (a fraction) of it: a change costs a transient the values do not see.
    With ``rates`` and ``arriving`` (requests per second served at each limit, and arriving),
    ``current`` stays only while it serves what arrives: one that does not defers work the
    limit worth the most may serve, and the backlog it leaves is not in the values.

    With ``tolerance`` (and each limit's ``rates``), the limit that serves the most among those
    worth within ``tolerance`` of the most (``current`` within ``tolerance`` + ``hysteresis``):
    values that close are within the fluid model's noise, and what a smaller batch does not
    serve waits, which its steady-state value does not see."""
    if not values:
        raise ValueError("no concurrency limit to choose from")
    limits = sorted(values)
    best = limits[0]
    for b in limits[1:]:
        if values[b] > values[best] * (1 + 1e-9):
            best = b
    if tolerance and rates is not None:
        top = values[best]
        near = [
            b
            for b in limits
            if values[b] >= top * (1.0 - tolerance - (hysteresis if b == current else 0.0))
        ]
        return max(near, key=lambda b: (rates[b], -b))
    if current is not None and rates is not None and rates.get(current, math.inf) < arriving:
        return best  # (it falls behind: no transient to spare it)
    threshold = values[best] * (1.0 - hysteresis)
    if current is not None and values.get(current, -math.inf) >= threshold:
        return current
    return best


class ServedWork:
    """Per instance, the GPU-seconds the fluid model charges for the requests it completed
    (``Fluid.cost`` at the limit it ran them at) while every slot of its concurrency limit was
    taken, per second of that time, over the last ``window_s`` (``ratio``): how far the fluid
    model's rates are from what the instance serves — 1 as modelled, above 1 when it serves more
    (its decode steps carry prompt chunks the model charges apart). Counted in work, not
    requests, so that serving cheap requests first does not read as speed."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # Per instance: (step time, seconds it was full since the last step, work completed then)
        self._steps: dict[str, deque[tuple[float, float, float]]] = {}
        self._last: dict[str, tuple[float, bool]] = {}  # per instance: last step, full then

    def step(self, instance: str, now: float, full: bool, work_s: float) -> None:
        """A control step at ``now``: ``work_s`` completed on ``instance`` since the last one
        (counted if it was full then), and whether it is full now."""
        last = self._last.get(instance)
        self._last[instance] = (now, full)
        if last is None or not last[1] or now <= last[0]:
            return
        steps = self._steps.setdefault(instance, deque())
        steps.append((now, now - last[0], work_s))
        while steps[0][0] < now - self.window_s:
            steps.popleft()

    def ratio(self, instance: str, now: float, least_s: float) -> float:
        """Modelled work completed per second full on ``instance`` within the window; 1.0 while
        it was full for less than ``least_s`` of it."""
        steps = self._steps.get(instance)
        while steps and steps[0][0] < now - self.window_s:
            steps.popleft()
        if not steps:
            return 1.0
        full = sum(s[1] for s in steps)
        work = sum(s[2] for s in steps)
        return work / full if full >= least_s and work > 0 else 1.0

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the instances not in ``keep``."""
        names = set(keep)
        for book in (self._steps, self._last):
            for name in [n for n in book if n not in names]:
                del book[name]


def output_token_work_s(hw: HardwareProfile, limit: int, eps_f: float) -> float:
    """GPU-seconds the fluid model charges an output token at concurrency ``limit``: the decode
    step's time at that batch (the profile's inefficiency and the instance's learnt decode
    factor ``eps_f`` applied), shared by the ``limit`` requests it advances."""
    return hw.decode_s(limit) * hw.inefficiency * eps_f / limit


def serving_count(family: ProblemFamily, model: str) -> int:
    """How many of ``family``'s instances serve ``model`` (1 at least): the share of its
    arrivals each of them is taken to get."""
    return max(1, sum(model in i.models for i in family.instances))


def choose_limits(
    family: ProblemFamily,
    fluid: Sequence[dict[int, Fluid] | None],
    choice: Sequence[int],
    current: Mapping[str, int],
    hysteresis: float,
    throughput_floor: float = 0.0,
    keep_up: Mapping[str, float] | None = None,
    tolerance: float = 0.0,
    served: Mapping[str, float] | None = None,
) -> list[int]:
    """Each instance's concurrency limit: the one whose admitted work meets the most
    expected weighted SLOs per second (``FluidModels.evaluate``; ``choice`` where it has no
    fluid model), among the limits that keep up. A plan judged only on today's queue
    would pick a small batch that looks fast and then drown in what keeps arriving; this
    judges the stream instead. The ``current`` limit is kept unless another is worth
    more than ``hysteresis`` more: every change costs a transient (a lower limit
    waits for running requests to drain, a higher one admits a burst of prompts whose prefills
    slow every running request), which the steady-state model does not see; without it the
    choice flips with the noise of the arrival window (measured on W_B at 1.8×: 74.2 % of
    SLOs met without hysteresis, 76.5 % with 5 %, 75.1 % with 15 %).

    ``throughput_floor`` keeps up: only limits that serve at least that share of ``keep_up``
    (per instance, requests per second: those arriving plus the rate that clears its queue
    within a rate window) — or, when no limit serves that many, of the most any limit serves
    (at the arriving mix, the instance busy) — are chosen from; the limit in use needs
    ``1 − hysteresis`` of it. A smaller batch meets more SLOs of what it serves and serves fewer
    requests; below the arrival rate the rest waits, and the backlog grows. 0 chooses by SLOs
    met alone.

    ``tolerance`` (``pick_limit``): for an instance in a sustained overload (one ``keep_up``
    names) while the limit worth the most leaves work deferred, the one that serves the most
    among those worth within ``tolerance`` of it.

    ``served``: per instance, how much more than its fluid rates it serves (``ServedWork``):
    the floor compares the rates it scales (1 where absent)."""
    out: list[int] = []
    for inst, fluids, limit in zip(family.instances, fluid, choice, strict=True):
        if fluids is None:
            out.append(limit)
            continue
        scale = (served or {}).get(inst.name, 1.0)
        top = max(f.rate for f in fluids.values()) * scale
        need = throughput_floor * min((keep_up or {}).get(inst.name, 0.0), top)
        now = current.get(inst.name)
        allowed = {
            b: f
            for b, f in fluids.items()
            if f.rate * scale >= need * (1.0 - hysteresis if b == now else 1.0)
        }
        values = {b: f.admission.value for b, f in allowed.items()}
        rates = {b: f.rate * scale for b, f in allowed.items()}
        arriving = max(f.arriving for f in allowed.values())
        # (throughput counts only in a sustained overload — the instance has something to
        # keep up with — while the best limit leaves work deferred)
        top = pick_limit(values, None, 0.0)
        overload = inst.name in (keep_up or {}) and allowed[top].admission.threshold > 0
        tol = tolerance if overload else 0.0
        out.append(pick_limit(values, now, hysteresis, rates, tol, arriving))
    return out


class FluidModels:
    """Each instance's fluid models (``evaluate``), re-evaluated in turn when a plan's budget
    is short; an instance's last evaluation stands until its turn."""

    def __init__(self, estimator: RCTEstimator, config: PlannerConfig) -> None:
        self.estimator = estimator
        self.config = config
        # Per instance: the plan that last evaluated its fluid model, and that evaluation.
        self._last: dict[str, tuple[int, dict[int, Fluid] | None]] = {}

    def evaluate(
        self,
        now: float,
        family: ProblemFamily,
        instances: Sequence[InstanceLoad],
        arrivals: ArrivalWindow,
        plan: int,
        deadline: Deadline | None = None,
    ) -> list[dict[int, Fluid] | None]:
        """Per instance and concurrency limit, a steady-state fluid model of what keeps arriving
        (the last ``rate_window_s`` of ``arrivals``; None for an instance none of it is for). A larger batch
        serves more requests per second and serves each one slower. For a limit ``b``, a request
        costs ``input × w_in + output × decode_s(b) / b`` GPU-seconds (its class's mean output)
        and its class (model, tier, SLO) meets its SLO alone with probability
        ``P(output × (decode_s(b) + b × refill) + prefill ≤ SLO)`` (the output posterior).
        Requests are admitted by value per GPU-second up to ``max_utilisation`` of the instance
        (``qlm.planner.admission``); the model gives the expected weighted SLOs met per second
        (which limit to use) and the value density below which work is deferred.

        Instances are evaluated the least recently evaluated first (one never evaluated before
        the others), one at least; once ``deadline`` is spent the others keep their last
        evaluation, or have none until their turn (their limit stays, their admission defers
        nothing)."""
        horizon = self.config.rate_window_s
        window = arrivals
        window.expire(now - horizon)
        span = max(min(horizon, now - window.first_s), 1.0)
        classes = window.classes()
        means: dict[ClassKey, tuple[float, float]] = {}
        # The output belief depends on the prompt's length: one request of each prompt bin
        # stands for the class's recent arrivals in it, weighted by their share.
        mix: dict[ClassKey, list[tuple[Request, float]]] = {}
        for key in classes:
            recent = window.recent(key)  # enough for a mean; bounded under a backlog
            means[key] = (
                sum(r.input_tokens for r in recent) / len(recent),
                sum(self.estimator.expected_output(r) for r in recent) / len(recent),
            )
            by_bin: dict[int, list[Request]] = {}
            for r in recent:
                by_bin.setdefault(prompt_bin(r.input_tokens), []).append(r)
            mix[key] = [(rs[-1], len(rs) / len(recent)) for rs in by_bin.values()]
        out: list[dict[int, Fluid] | None] = [None] * len(family.instances)
        # Instances alike in models, hardware, limits and learnt decode speed have the same
        # fluid model: computed once (a fleet of replicas, before their speeds part).
        alike: dict[tuple[object, ...], dict[int, Fluid] | None] = {}
        loads = {i.name: i for i in instances}
        self._last = {i.name: self._last[i.name] for i in family.instances if i.name in self._last}
        turn = sorted(
            range(len(family.instances)),
            key=lambda g: (self._last.get(family.instances[g].name, (-1, None))[0], g),
        )
        for k, g in enumerate(turn):
            inst, limits = family.instances[g], family.batches[g]
            ld = loads[inst.name]
            eps_f = self.estimator.calibration_factors(inst.name)[1]  # decode as observed
            same = (inst.models, ld.gpu, ld.gpu_count, limits, eps_f)
            if same in alike:
                out[g] = alike[same]
                self._last[inst.name] = (plan, out[g])
                continue
            if k > 0 and deadline is not None and deadline.spent():
                last = self._last.get(inst.name, (-1, None))[1]
                if last is not None and set(last) != set(limits):
                    last = None
                out[g] = last  # (None until its turn comes: its limit stays, nothing deferred)
                continue
            serving = {m: serving_count(family, m) for m in inst.models}
            keys = [k for k in classes if k[0] in inst.models]
            if not keys:
                out[g] = alike.setdefault(same, None)
                self._last[inst.name] = (plan, None)
                continue
            hws = {
                m: self.estimator.profile.hardware_for(m, ld.gpu, ld.gpu_count) for m in inst.models
            }
            # One row per class and prompt length, standing for its arrivals in the window.
            lengths = [window.counts(k) for k in keys]
            row = np.repeat(np.arange(len(keys)), [len(c) for c in lengths])
            inputs = np.array([n for c in lengths for n in c], np.float64)
            arrived = np.array([a for c in lengths for a in c.values()], np.float64)
            w_in = np.array([hws[k[0]].input_token_work_s for k in keys])[row]
            weights = arrived / np.array([span * serving[k[0]] for k in keys])[row]
            outputs = np.array([means[k][1] for k in keys])
            prompt_work = float(np.sum(inputs * w_in * weights))
            output_rate = float(np.sum(outputs[row] * weights))
            refill = prompt_work / max(output_rate, 1e-9)
            per_input = {m: hw.input_token_work_s for m, hw in hws.items()}
            fluids: dict[int, Fluid] = {}
            for b in limits:
                per_output = {m: output_token_work_s(hw, b, eps_f) for m, hw in hws.items()}
                per_out = np.array([per_output[k[0]] for k in keys])[row]
                costs = inputs * w_in + outputs[row] * per_out
                refill_b = refill
                # The refill is the prompt work of what is served: with deferral on, the
                # admitted work's, which depends on the SLOs the refill lets classes meet —
                # one more round settles it.
                for _ in range(2 if self.config.defer_expensive else 1):
                    class_value: dict[ClassKey, float] = {}
                    for key in keys:
                        model, tier, slo = key
                        hw = hws[model]
                        dec = hw.decode_s(b) * hw.inefficiency
                        per_token = (dec + b * refill_b) * eps_f
                        budget = (slo - hw.prefill_s(means[key][0])) / per_token
                        p_meet = sum(
                            share
                            * self.estimator.posterior(r).p_remaining_within(
                                budget, cap=r.max_tokens
                            )
                            for r, share in mix[key]
                        )
                        class_value[key] = self.config.tier_weights[tier] * p_meet
                    values = np.array([class_value[k] for k in keys])[row]
                    admission = admit(values, costs, weights, self.config.max_utilisation)
                    if not admission.threshold:
                        break
                    kept = values >= admission.threshold * costs
                    refill_b = float(np.sum((inputs * w_in * weights)[kept])) / max(
                        float(np.sum((outputs[row] * weights)[kept])), 1e-9
                    )
                mean_cost = float(np.sum(costs * weights)) / max(float(np.sum(weights)), 1e-12)
                fluids[b] = Fluid(
                    admission,
                    class_value,
                    {k: means[k][1] for k in keys},
                    per_output,
                    per_input,
                    1.0 / max(mean_cost, 1e-12),
                    float(np.sum(weights)),
                )
            out[g] = alike.setdefault(same, fluids)
            self._last[inst.name] = (plan, fluids)
        return out
