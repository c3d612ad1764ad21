"""The act stage of the QLM policy (``qlm.planner.qlm_policy``): its per-instance agents.

Each instance's agent pulls from the head of its own virtual queue while the instance has room
under the concurrency limit the planner chose (§5 *pull*, *load balancing*: a running request
never migrates), pulls ahead of the plan's order a request that has waited too long or whose
first token would be late, swaps back in what waits in CPU memory, makes room for an urgent head
group (``qlm.agents.make_room``) and warm-starts models (``qlm.agents.plan_tiers``). The agents
keep their books (``qlm.planner.books.AgentBooks``) and follow the admission the last plan chose
(``qlm.planner.books.AdmissionState``); what they change of the virtual queues behind the
planner's back they report in ``Acted``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from qlm.agents.decide import (
    HeadGroup,
    InstanceCosts,
    RunningRequest,
    make_room,
    plan_tiers,
)
from qlm.domain import Decision, ModelTier, Pull, Request, SwapIn, SwapOut
from qlm.groups import Grouper
from qlm.planner.admission import TokenBucket
from qlm.planner.books import AdmissionState, AgentBooks, Inflight
from qlm.planner.budget import Clock
from qlm.planner.config import PlannerConfig
from qlm.planner.policy import InstanceLoad, has_room, prompt_tokens
from qlm.rct.estimator import RCTEstimator
from qlm.rct.inputs import EstimatorInstance, Queued
from qlm.virtual_queues import VirtualQueueSet

MAX_LINE = 64
"""Requests at the head of a queue whose first tokens ``_pull_ahead`` looks after."""


def estimator_instance(load: InstanceLoad) -> EstimatorInstance:
    """An instance's load as the RCT estimator sees it."""
    warm = frozenset(m for m, tier in load.model_tiers if tier is ModelTier.WARM)
    return EstimatorInstance(
        load.name,
        load.gpu,
        load.gpu_count,
        load.active_model,
        warm,
        preemptions_total=load.preemptions_total,
    )


@dataclass(slots=True)
class Acted:
    """What the agents did in one step: their decisions, and what they changed of the virtual
    queues outside the plan, which the policy's own bookkeeping follows."""

    decisions: list[Decision] = field(default_factory=list)
    # A request left its queue out of the plan's order (the starvation guard): the groups
    # changed since the last violation check.
    requeued: bool = False
    # Instances whose queue an agent reordered (a deferred group went behind the admitted ones).
    reordered: set[str] = field(default_factory=set)


class Agents:
    """The per-instance agents of a ``QlmPolicy`` (module docstring), on the policy's books,
    virtual queues, groups, estimator and admission."""

    def __init__(
        self,
        books: AgentBooks,
        admission: AdmissionState,
        queues: VirtualQueueSet,
        grouper: Grouper,
        estimator: RCTEstimator,
        config: PlannerConfig,
        clock: Clock,
    ) -> None:
        """``clock`` (the policy's) bounds a step's pulls when it has a deadline."""
        self.books = books
        self.admission = admission
        self.queues = queues
        self.grouper = grouper
        self.estimator = estimator
        self.config = config
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}  # per instance, paces deferred work
        # Per instance, when a request with a TTFT deadline last waited in its queue.
        self._first_tokens_s: dict[str, float] = {}

    def act(
        self,
        now: float,
        instances: Sequence[InstanceLoad],
        acted: Acted,
        deadline: float = math.inf,
    ) -> None:
        """Per instance: swap back in what waits in CPU memory when it is the most urgent, pull the
        head group's requests while there is room, then make room for the head group if it is at
        risk (``qlm.agents.make_room``). Before ``deadline`` on the policy's clock: each instance
        has its share of the time left (and one pull at least); what does not fit is pulled at
        the next step. What the agents did goes into ``acted`` as they do it."""
        decisions = acted.decisions
        up = [load for load in instances if load.up]
        bounded = math.isfinite(deadline)
        for k, load in enumerate(up):
            until = math.inf
            if bounded:
                now_s = self._clock()
                until = now_s + max(deadline - now_s, 0.0) / (len(up) - k)
            swapped = self.books.swapped.setdefault(load.name, {})
            parked = sum(prompt_tokens(x.request, x.generated) for x in swapped.values())
            limit = self.admission.limits.get(load.name, load.max_running)
            fluid = self.admission.fluids.get(load.name)
            self._buckets.setdefault(load.name, TokenBucket()).refill(
                now, fluid.admission.spare if fluid is not None else 0.0
            )
            inst = replace(
                load,
                max_running=min(load.max_running, limit),
                outstanding_requests=load.outstanding_requests - len(swapped),
                outstanding_tokens=load.outstanding_tokens - parked,
            )
            count, tokens = self._pull_ahead(now, load, inst, acted)
            bound = self._prefill_bound(now, load.name)
            queued = self._unstarted_tokens(load.name) if math.isfinite(bound) else 0
            while not (count and bounded and self._clock() >= until):
                req = self.queues.next_request(inst.name)
                back = min(  # (one of another model waits for its model: ``_tiers``)
                    (x for x in swapped.values() if x.request.model == load.active_model),
                    key=lambda x: x.request.deadline_s,
                    default=None,
                )
                if back is not None and (req is None or back.request.deadline_s <= req.deadline_s):
                    need = prompt_tokens(back.request, back.generated)
                    if not has_room(inst, count, tokens, need):
                        break
                    del swapped[back.request.id]
                    self.books.inflight[inst.name][back.request.id] = back
                    count += 1
                    tokens += need
                    decisions.append(SwapIn(back.request.id, inst.name))
                    continue
                if req is None:
                    break
                need = prompt_tokens(req, self.books.generated.get(req.id, 0))
                if not has_room(inst, count, tokens, need):
                    break
                first = req.slo.ttft_s is not None and req.id not in self.books.generated
                if queued and queued + need > bound and not first:
                    break  # (a first token due is what the bound keeps the engine's queue for)
                verdict = self._may_pull(
                    inst.name, req, idle=inst.outstanding_requests + count == 0
                )
                if verdict is None:
                    acted.reordered.add(inst.name)
                    continue  # a deferred group went behind the admitted ones: a new head
                if not verdict:
                    break
                self.queues.pop_next(inst.name)
                self._remember(now, load, req)
                count += 1
                tokens += need
                queued += need
                self.books.inflight[inst.name][req.id] = Inflight(
                    req, now, self.books.generated.get(req.id, 0)
                )
                decisions.append(Pull(req.id, inst.name))
            free = max(0, inst.max_running - inst.outstanding_requests - count)
            decisions.extend(self._make_room(now, load, free))
            if self.config.agent.warm_start and len(load.models) > 1:
                decisions.extend(self._tiers(load))

    def _prefill_bound(self, now: float, name: str) -> float:
        """The most prompt tokens to keep pulled onto instance ``name`` and not started
        (``AgentConfig.prefill_queue_tokens``): bounded while first tokens are at stake — a
        request with a TTFT deadline waited in its queue within the last rate window — so that
        one pulled ahead is not stuck behind a burst of prompts inside the engine; unbounded
        otherwise (the engine's queue then costs no deadline, and a full queue keeps every
        slot busy)."""
        bound = self.config.agent.prefill_queue_tokens
        seen = self._first_tokens_s.get(name)
        if not bound or seen is None or now - seen > self.config.rate_window_s:
            return math.inf
        return float(bound)

    def _unstarted_tokens(self, name: str) -> int:
        """The prompt tokens pulled onto instance ``name`` that it has not started yet: they
        wait inside the engine, in its order, not the plan's (``AgentConfig.prefill_queue_tokens``
        bounds them)."""
        inflight = self.books.inflight.get(name, {})
        started = self.books.started
        return sum(
            prompt_tokens(x.request, x.generated)
            for rid, x in inflight.items()
            if rid not in started
        )

    def _pull_ahead(
        self, now: float, load: InstanceLoad, inst: InstanceLoad, acted: Acted
    ) -> tuple[int, int]:
        """Pulls that do not wait for the plan's order or for a slot under the concurrency limit;
        how many requests and prompt tokens they took.

        - *Starvation guard* (``PlannerConfig.max_wait_s``): a request that has waited its
          tier's maximum since its arrival is pulled first, oldest first, within the
          concurrency limit (``Pull.overdue`` when the plan would not have pulled it next).
        - *First tokens*: a request among the first ``MAX_LINE`` of the queue whose TTFT
          deadline would pass while it waits for its turn — the requests ahead of it in plan
          order take the slots under the concurrency limit first, and a slot frees at the pace
          the running requests complete (``_slot_waits``) — and can still be met, is pulled now,
          beyond the limit (within the engine's ``max_num_seqs`` and KV cache). The rest keep
          their order. On an instance serving several models only the active model's are."""
        count = tokens = 0
        if self.config.max_wait_s:
            count, tokens = self._pull_overdue(now, load, inst, acted)
        engine = replace(inst, max_running=max(inst.max_running, load.max_running))
        late = self._late_first_tokens(now, load, inst, count)
        for req in late:
            need = prompt_tokens(req)
            if not has_room(engine, count, tokens, need):
                break
            self.queues.remove_request(req.id)
            self._remember(now, load, req)
            count += 1
            tokens += need
            self.books.inflight[inst.name][req.id] = Inflight(req, now, 0)
            acted.decisions.append(Pull(req.id, inst.name))
        return count, tokens

    def _late_first_tokens(
        self, now: float, load: InstanceLoad, inst: InstanceLoad, count: int
    ) -> list[Request]:
        """The requests among the first ``MAX_LINE`` of ``inst``'s queue that would miss their
        TTFT deadline waiting for their turn (``_pull_ahead``), in queue order. ``count``: the
        requests pulled ahead already at this step."""
        late: list[Request] = []
        waits: list[float] | None = None
        ahead = 0  # requests ahead in the queue that stay there
        several = len(load.models) > 1
        for gid in self.queues.queue(inst.name):
            for req in self.grouper.group(gid).requests:
                if ahead + len(late) >= MAX_LINE:
                    return late
                if req.slo.ttft_s is not None:
                    self._first_tokens_s[inst.name] = now
                latest = self._first_token(now, load, req)
                if latest is None or (several and req.model != load.active_model):
                    ahead += 1
                    continue
                # its turn: after the free slots and those ahead of it, as slots free
                free = inst.max_running - inst.outstanding_requests - count - len(late)
                turn = ahead - free
                if turn < 0:
                    ahead += 1  # it gets a free slot at once (the plan's pull)
                    continue
                if waits is None:
                    waits = self._slot_waits(now, load)
                    if not waits:
                        return late  # nothing known of the pace: nothing to jump the line for
                if turn < len(waits) and now + waits[turn] <= latest:
                    ahead += 1
                    continue
                late.append(req)
        return late

    def _first_token(self, now: float, load: InstanceLoad, req: Request) -> float | None:
        """The latest time ``req`` may be pulled for its first token to meet its TTFT deadline
        on ``load`` (its prefill and the decode step it rides); None when it has no TTFT SLO left
        to meet, its group is deferred, or it is too late already."""
        if req.slo.ttft_s is None or req.id in self.books.generated:
            return None
        if self.grouper.group_of(req.id) in self.admission.deferred:
            return None
        hw = self.estimator.profile.hardware_for(req.model, load.gpu, load.gpu_count)
        running = max(len(self.books.inflight.get(load.name, {})), 1)
        latest = req.arrival_s + req.slo.ttft_s - hw.prefill_s(req.input_tokens)
        latest -= hw.decode_s(running) * hw.inefficiency
        return latest if latest >= now else None

    def _pull_overdue(
        self, now: float, load: InstanceLoad, inst: InstanceLoad, acted: Acted
    ) -> tuple[int, int]:
        """The starvation guard of ``_pull_ahead``."""
        limits = self.config.max_wait_s
        overdue: list[Request] = []
        for gid in self.queues.queue(inst.name):
            group = self.grouper.group(gid)
            limit = limits.get(group.tier)
            if limit is None:
                continue
            for r in group.requests:  # (in arrival order)
                if now - r.arrival_s < limit:
                    break
                overdue.append(r)
        count = tokens = 0
        for req in sorted(overdue, key=lambda r: (r.arrival_s, r.id)):
            need = prompt_tokens(req, self.books.generated.get(req.id, 0))
            if not has_room(inst, count, tokens, need):
                break
            head = self.queues.head_group(inst.name)
            of = self.grouper.group_of(req.id)
            promoted = (
                of != head
                or of in self.admission.deferred
                or self.queues.next_request(inst.name) is not req
            )
            self.queues.remove_request(req.id)
            acted.requeued = True
            self._remember(now, load, req)
            count += 1
            tokens += need
            self.books.inflight[inst.name][req.id] = Inflight(
                req, now, self.books.generated.get(req.id, 0)
            )
            acted.decisions.append(Pull(req.id, inst.name, overdue=promoted))
        return count, tokens

    def _slot_waits(self, now: float, load: InstanceLoad) -> list[float]:
        """Seconds until the 1st, 2nd, … slot of the instance frees (a running request
        completes), at the pace of its last ``RECENT_FINISHES`` (``qlm.planner.books``)
        completions (the time since the oldest of them over their number); before it has had 4,
        each running request completes at the rate ``1 / remaining`` (its expected remaining
        output at the batch's time per token), so the k-th completion comes after
        ``k / Σ 1/remaining``."""
        running = self.books.inflight.get(load.name, {})
        n_run = max(len(running), load.outstanding_requests)
        slots = n_run + MAX_LINE  # (the requests pulled meanwhile complete at the same pace)
        recent = self.books.finishes.get(load.name)
        if recent is not None and len(recent) >= 4:
            gap = max(now - recent[0], 0.0) / len(recent)
            return [(k + 1) * gap for k in range(slots)]
        if not running:
            return []  # nothing known of its pace
        eps_f = self.estimator.calibration_factors(load.name)[1]
        rate = 0.0
        for item in running.values():
            hw = self.estimator.profile.hardware_for(item.request.model, load.gpu, load.gpu_count)
            per_token = hw.decode_s(n_run) * hw.inefficiency * eps_f
            done = item.generated + int(max(0.0, now - item.pulled_s) / per_token)
            left, _ = self.estimator.output_moments(
                item.request, min(done, item.request.max_tokens - 1)
            )
            rate += 1.0 / max(left * per_token, per_token)
        return [(k + 1) / rate for k in range(slots)]

    def _remember(self, now: float, load: InstanceLoad, req: Request) -> None:
        """Predict the completion of a request as it is pulled, behind what runs on the
        instance, and keep the prediction: its outcome teaches the estimator's online
        calibration of this instance (``RCTEstimator.observe``), which the plan problem, the
        drain times and making room use. In pull dispatch nothing waits inside the engine, so
        what it learns is the decode speed (ε), with the batch refilled from the virtual queue
        while it holds more work; the profile's Θ stays the planner's. A request pulled again
        (after an eviction) is judged on its latest pull."""
        running = [x.running for x in self.books.inflight.get(load.name, {}).values()]
        instance = estimator_instance(load)
        self.estimator.forget([req.id])
        queued = Queued(req, self.books.generated.get(req.id, 0))
        self.estimator.estimate_requests(
            instance,
            [*running, queued],
            now,
            remember=True,
            only=[-1],
            refilled=self.queues.next_request(load.name) is not None,
        )

    def _may_pull(self, name: str, req: Request, *, idle: bool) -> bool | None:
        """Admitted work is always pulled; deferred work at the pace of the instance's spare
        capacity (``qlm.planner.admission.TokenBucket``), or when the instance runs nothing at
        all (an idle GPU serves whatever waits). A deferred group at the head that
        must wait goes behind the admitted groups queued since the last plan (None: look at the
        new head)."""
        gid = self.grouper.group_of(req.id)
        if gid is None or gid not in self.admission.deferred:
            return True
        fluid = self.admission.fluids.get(name)
        if fluid is None:
            return True
        cost = fluid.cost(req, self.estimator.expected_output(req))
        if self._buckets[name].take(cost):
            return True
        if idle:
            self._buckets[name].level -= cost
            return True
        queue = self.queues.queue(name)
        if any(g not in self.admission.deferred for g in queue):
            self.queues.move_group(gid, name)  # to the tail, behind the admitted ones
            return None
        return False

    def _tiers(self, load: InstanceLoad) -> list[Decision]:
        """Warm start: model tiers from the virtual queue's order, behind the requests already
        sent that have not started (the oldest one's model first: a request waiting in the engine
        for a model that is switched away would wait for its return)."""
        models = [self.grouper.group(g).model for g in self.queues.queue(load.name)]
        tiers = dict(load.model_tiers)
        waiting = [  # sent, not started: they run before anything still in the queue
            x
            for x in self.books.inflight.get(load.name, {}).values()
            if x.request.id not in self.books.started
        ]
        if waiting:
            oldest = min(waiting, key=lambda x: (x.pulled_s, x.request.arrival_s, x.request.id))
            models = [oldest.request.model, *models]
        # A request swapped out to CPU memory resumes only on its model: it stays warm, and
        # becomes active when nothing else waits.
        parked = sorted(
            self.books.swapped.get(load.name, {}).values(), key=lambda x: x.request.deadline_s
        )
        models += [x.request.model for x in parked]
        changes = plan_tiers(
            load.name, models, tiers, dict(load.model_weights_gb), load.cpu_cache_gb
        )
        asked = self.books.asked_active.get(load.name)
        out: list[Decision] = []
        for c in changes:
            if c.tier is ModelTier.ACTIVE:
                if asked == c.model:
                    continue  # already switching to it
                self.books.asked_active[load.name] = c.model
            out.append(c)
        if tiers.get(asked or "") is ModelTier.ACTIVE:
            self.books.asked_active.pop(load.name, None)
        return out

    def _make_room(self, now: float, load: InstanceLoad, free: int) -> list[Decision]:
        """Preempt running requests for what waits at the head when it pays
        (``qlm.agents.make_room``): the head group waiting for slots, or — when the next model to
        run is not the active one — the requests waiting for the running batch to drain before
        the switch."""
        if not (self.config.agent.evict or self.config.agent.swap):
            return []
        inflight = self.books.inflight.get(load.name, {})
        running = {rid: x for rid, x in inflight.items() if rid in self.books.started}
        if not running or load.active_model is None:
            return []
        sent = sorted(
            (x for rid, x in inflight.items() if rid not in self.books.started),
            key=lambda x: (x.pulled_s, x.request.arrival_s, x.request.id),
        )
        gid = self.queues.head_group(load.name)
        group = self.grouper.group(gid) if gid is not None else None
        # The model the instance serves next (``_tiers``): the oldest sent request's, else the
        # head group's.
        target = sent[0].request.model if sent else (group.model if group else None)
        if target is None:
            return []
        switching = target != load.active_model
        weights = self.config.tier_weights
        if switching:
            waiting = [x.request for x in sent if x.request.model == target]
            if group is not None and group.model == target:
                waiting += list(group.requests[: max(0, free)])
            if not waiting:
                return []
            tiers = dict(load.model_tiers)
            hw_t = self.estimator.profile.hardware_for(target, load.gpu, load.gpu_count)
            switch_s = hw_t.warm_load_s if tiers.get(target) is ModelTier.WARM else hw_t.cold_load_s
        else:
            if group is None or group.size <= free:
                return []
            waiting = list(group.requests)
            switch_s = 0.0
        nxt = min(waiting, key=lambda r: r.deadline_s)
        hw = self.estimator.profile.hardware_for(load.active_model, load.gpu, load.gpu_count)
        hw_head = self.estimator.profile.hardware_for(nxt.model, load.gpu, load.gpu_count)
        eps_f = self.estimator.calibration_factors(load.name)[1]
        n_run = len(running)
        mix_in = sum(x.request.input_tokens for x in running.values()) * hw.input_token_work_s
        mix_out = sum(self.estimator.expected_output(x.request) for x in running.values())
        per_token = (
            hw.decode_s(n_run) * hw.inefficiency + n_run * mix_in / max(mix_out, 1.0)
        ) * eps_f
        head_token = per_token if not switching else hw_head.decode_s(len(waiting)) * eps_f
        head = HeadGroup(
            gid or "",
            nxt.deadline_s,
            len(waiting),
            hw_head.prefill_s(nxt.input_tokens) + self.estimator.expected_output(nxt) * head_token,
            weight=max(weights[r.tier] for r in waiting),
            deadlines=tuple(r.deadline_s for r in waiting),
            switching=switching,
            switch_s=switch_s,
        )
        views = []
        for item in running.values():
            began = item.started_s if item.started_s is not None else item.pulled_s
            done = item.generated + int(max(0.0, now - began) / per_token)
            done = min(done, item.request.max_tokens - 1)
            mean, _ = self.estimator.output_moments(item.request, done)
            views.append(
                RunningRequest(
                    item.request,
                    done,
                    mean * per_token,
                    self.books.preemptions.get(item.request.id, 0),
                    weights[item.request.tier],
                )
            )
        fluid = self.admission.fluids.get(load.name)
        costs = InstanceCosts(
            kv_bytes_per_token=hw.kv_bytes_per_token,
            host_link_gbs=load.host_link_gbs,
            swap_free_gb=load.swap_free_gb,
            prefill_base_s=hw.prefill_base_s,
            prefill_per_token_s=hw.prefill_per_token_s,
            gpu_second_value=fluid.admission.threshold if fluid is not None else 0.0,
        )
        out: list[Decision] = []
        for d in make_room(now, load.name, head, free, views, costs, self.config.agent):
            rid = d.request_id
            if isinstance(d, SwapOut):
                self.books.swapped.setdefault(load.name, {})[rid] = inflight.pop(rid)
            self.books.preemptions[rid] = self.books.preemptions.get(rid, 0) + 1
            out.append(d)
        return out
