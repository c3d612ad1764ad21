"""``RCTEstimator.estimate_queue`` scans a queue's groups as arrays: the same numbers, to the
last bit, as the scan group by group it replaced (kept here as the reference), on random queues."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest

from qlm.domain import SLO
from qlm.rct.batch import context_tokens, output_work_scale, sustained_batch
from qlm.rct.calibration import shrunk
from qlm.rct.distribution import CompletionDistribution, GroupEstimate
from qlm.rct.estimator import RCTEstimator
from qlm.rct.inputs import EstimatorInstance, Queued
from qlm.rct.loads import GroupLoad
from qlm.rct.output_model import NIG
from qlm.rct.profile import RctProfile
from qlm.rct.tuning import PROMPT_BIN_WIDTH
from tests.builders import make_hardware, make_request

PRIOR = NIG(mu=4.0, kappa=20.0, alpha=11.0, beta=5.0)


def reference(
    est: RCTEstimator,
    instance: EstimatorInstance,
    groups: Sequence[GroupLoad],
    now: float,
    *,
    running: Sequence[Queued] = (),
) -> list[GroupEstimate]:
    """``estimate_queue`` as it was, one group at a time."""
    est._epoch += 1  # (the running requests' tokens noted here may differ from a scan's)
    est.beliefs.prefetch(running)
    est.watch(instance)
    cal = est._cal(instance.name)
    wf, ef = cal.wait_factor(), cal.eps_factor()
    redo = 1.0 + cal.preemption_rate()  # prompts recomputed after preemptions, as for requests
    center, slope = cal.shrink()
    rel_sd = max(cal.wait_rel_sd(), est.min_rel_sd)
    waiting = waiting_var = 0.0  # work of the groups ahead, all of it waiting
    count = 0
    tokens = remaining_running = 0.0
    mix_prompt = mix_output = 0.0
    # Sums over the running requests (the hot loop after a completion: thousands of them).
    work_in: dict[str, float] = {}
    moments, versions, by_prompt = est.beliefs.moments, est.beliefs.versions, est.by_prompt
    for item in running:
        req = item.request
        w_in = work_in.get(req.model)
        if w_in is None:
            hw = est.profile.hardware_for(req.model, instance.gpu, instance.gpu_count)
            w_in = work_in[req.model] = hw.input_token_work_s
        version = versions.get((req.model, req.slo_class), 0)
        # prompt_bin, inlined (one bin for all without by_prompt)
        ib = int(math.log1p(req.input_tokens) / PROMPT_BIN_WIDTH) if by_prompt else 0
        hit = moments.get((req.model, req.slo_class, ib, version, req.max_tokens, item.generated))
        m = hit[0] if hit is not None else est.output_moments(req, item.generated)[0]
        tokens += req.input_tokens + item.generated + m
        remaining_running += m
        mix_prompt += req.input_tokens * w_in
        mix_output += item.generated + m
        count += 1
    n_running = count
    for g in groups:
        hw = est.profile.hardware_for(g.model, instance.gpu, instance.gpu_count)
        mix_prompt += g.input_tokens * hw.input_token_work_s
        mix_output += g.output_mean
    refill = redo * mix_prompt / max(mix_output, 1.0)
    total_tokens = tokens + sum(g.input_tokens + g.output_mean for g in groups)
    total_count = count + sum(g.size for g in groups)
    # Outputs yet to come count half toward the KV footprint over a request's decode.
    remaining = sum(g.output_mean for g in groups) + remaining_running
    ctx_per = (total_tokens - 0.5 * remaining) / max(total_count, 1)
    # The KV footprint per request the batch shows now (prompt and tokens generated so far):
    # what the output work is scaled by (as for requests; the queue's own expected outputs
    # lag a drifting mix).
    footprint = (tokens - remaining_running) / n_running if n_running else ctx_per
    model = instance.active_model
    switches = 0.0
    out: list[GroupEstimate] = []
    # As for requests: the first waiting requests that find a free slot cost only their
    # prefill (their output work is ``exempt``); the rest wait for the drain.
    free: int | None = None
    exempt = exempt_var = 0.0
    theta_by_model: dict[str, float] = {}  # Θ in the batch this mix fills
    for pos, g in enumerate(groups):
        hw = est.profile.hardware_for(g.model, instance.gpu, instance.gpu_count)
        slots = est.slots(hw, total_tokens / max(total_count, 1))
        full = int(min(slots, sustained_batch(hw, refill)))
        if free is None:
            free = max(slots - n_running, 0)
        if g.model != model:
            switches += est._load_s(hw, instance)
            model = g.model
        theta = theta_by_model.get(g.model)
        if theta is None:
            scale = output_work_scale(hw, slots, footprint)
            theta = theta_by_model[g.model] = hw.throughput_tps / scale
        # Everything of the group but its last request ...
        own_out = (g.output_mean - g.last_output_mean) / theta
        w_in = hw.input_token_work_s * redo
        own = (g.input_tokens - g.last_input_tokens) * w_in + own_out
        own_var = (g.output_var - g.last_output_var) / theta**2
        room = max(free - 1 - (count - n_running), 0)  # exempt places left before it
        share = min(room, g.size - 1) / (g.size - 1) if g.size > 1 else 0.0
        before_last = count + g.size - 1  # requests ahead of the group's last request
        wait = (waiting + own - exempt - share * own_out) * wf + switches
        wait_var = (waiting_var + own_var - exempt_var - share * own_var) * wf * wf
        refilling = before_last - n_running >= 1
        batch = min(before_last + 1, full if refilling else slots)
        dec = hw.decode_s(batch, context_tokens(hw, batch, slots, ctx_per))
        d = shrunk(
            (dec + (batch * refill if refilling else 0.0)) * hw.inefficiency * ef, center, slope
        )
        mean = now + wait + hw.prefill_s(g.last_input_tokens) + g.last_output_mean * d
        var = wait_var + (rel_sd * wait) ** 2 + g.last_output_var * d * d
        out.append(
            GroupEstimate(
                g.group_id,
                instance.name,
                pos,
                CompletionDistribution(mean, var),
                g.earliest_deadline_s,
            )
        )
        # ... then the last request itest.
        last_out, last_var = g.last_output_mean / theta, g.last_output_var / theta**2
        waiting += own + g.last_input_tokens * w_in + last_out
        waiting_var += own_var + last_var
        exempt += share * own_out + (last_out if room > g.size - 1 else 0.0)
        exempt_var += share * own_var + (last_var if room > g.size - 1 else 0.0)
        count += g.size
    return out


def _estimator(rng: np.random.Generator, *, shape_free: bool, by_prompt: bool) -> RCTEstimator:
    kv = {"decode_per_ctx_token_s": 1e-7, "decode_ctx_tokens": 1000.0} if rng.random() < 0.5 else {}
    slots = int(rng.choice([3, 16, 256]))
    budget = int(rng.choice([0, 2048]))
    hw = {
        h.key: h
        for h in (
            make_hardware(m, max_num_seqs=slots, max_num_batched_tokens=budget, **kv)
            for m in ("m", "n")
        )
    }
    return RCTEstimator(
        RctProfile(hardware=hw, output_priors={"default": PRIOR}),
        shape_free=shape_free,
        by_prompt=by_prompt,
    )


@pytest.mark.parametrize("seed", range(12))
def test_the_queue_scanned_as_arrays_gives_the_group_by_group_numbers_to_the_last_bit(
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    est = _estimator(rng, shape_free=seed % 3 != 2, by_prompt=seed % 2 == 1)
    inst = EstimatorInstance("i0", "G", 1, "m", frozenset({"n"}) if seed % 4 else frozenset())
    # Beliefs and calibration moved by completions (some predicted, so that ε, κ_W and the
    # slope are learnt) and preemptions counted.
    served = [
        make_request(
            1000 + k,
            input_tokens=int(rng.integers(50, 3000)),
            max_tokens=int(rng.integers(20, 800)),
            slo=SLO(e2e_s=30.0) if k % 2 else SLO(e2e_s=300.0),
        )
        for k in range(40)
    ]
    for k, r in enumerate(served):
        est.estimate_requests(inst, [Queued(r)], float(k), remember=True)
        est.watch(replace(inst, preemptions_total=k // 3))
        est.observe(
            r,
            output_tokens=int(rng.integers(1, r.max_tokens + 1)),
            scheduled_s=k + 0.1,
            first_token_s=k + 0.3,
            finish_s=k + 0.3 + rng.random() * 5,
        )
    running = [
        Queued(
            make_request(
                2000 + k,
                model="m" if k % 5 else "n",
                input_tokens=int(rng.integers(50, 3000)),
                max_tokens=int(rng.choice([300, 500, 1000])),
            ),
            generated=int(rng.integers(0, 300)),
            running=True,
        )
        for k in range(int(rng.choice([0, 1, 2, 40])))
    ]
    groups, named = [], []
    for g in range(int(rng.integers(1, 30))):
        model = "m" if rng.random() < 0.7 else "n"
        members = tuple(
            make_request(
                3000 + 100 * g + k,
                model=model,
                input_tokens=int(rng.integers(20, 4000)),
                max_tokens=int(rng.choice([100, 200, 1000, 4000])),
                slo=SLO(e2e_s=float(rng.choice([20.0, 300.0])), ttft_s=1.5 if k == 0 else None),
            )
            for k in range(int(rng.integers(1, 12)))
        )
        groups.append(est.group_load(f"g{g}", members))
        named.append((f"g{g}", members))
    twin = copy.deepcopy(est)
    now = 77.0
    for step in range(6):  # the same running requests again, or some changed, or completed
        if running and step % 3 == 2:  # one completed (its noting undone), the beliefs moved
            done = running[int(rng.integers(len(running)))].request
            output = int(rng.integers(1, 500))
            est.observe(done, output_tokens=output)
            twin.observe(done, output_tokens=output)
        elif running and step % 3 == 0 and step:  # one generated more (changed in place)
            k = int(rng.integers(len(running)))
            running[k] = replace(running[k], generated=running[k].generated + 1)
        expected = reference(twin, inst, groups, now, running=running)
        got = est.estimate_queue(inst, groups, now, running=running)
        assert got == expected, step
        assert est.beliefs.inflight == twin.beliefs.inflight
    assert len({e.completion.mean for e in got}) == len(groups)  # (not all alike)
    # The aggregates as arrays (what a plan takes), or one queue's part of them: the same.
    # (the beliefs moved since ``groups`` were aggregated: both aggregate again)
    loads = est.group_loads(named)
    groups = [twin.group_load(gid, members) for gid, members in named]
    assert est.estimate_queue(inst, loads, now, running=running) == reference(
        twin, inst, groups, now, running=running
    )
    tail = list(range(len(groups)))[1:]
    assert est.estimate_queue(inst, loads.take(tail), now, running=running) == reference(
        twin, inst, groups[1:], now, running=running
    )


def test_many_queues_at_once_are_each_queue_alone() -> None:
    rng = np.random.default_rng(7)
    est = _estimator(rng, shape_free=True, by_prompt=False)
    queues = []
    for q in range(5):
        inst = EstimatorInstance(f"i{q}", "G", 1, "m" if q % 2 else "n")
        running = [
            Queued(make_request(100 * q + k, input_tokens=300 + k), generated=k, running=True)
            for k in range(q * 3)
        ]
        loads = [
            est.group_load(
                f"q{q}g{g}",
                tuple(
                    make_request(10_000 + 100 * (10 * q + g) + k, input_tokens=100 * (k + 1))
                    for k in range(1 + (g + q) % 4)
                ),
            )
            for g in range(q * 2)  # (the first queue has none)
        ]
        queues.append((inst, loads, running))
    twin = copy.deepcopy(est)
    for step in range(4):  # the same running requests again, a completion between
        together = est.estimate_queues(queues, 50.0)
        assert [q.groups() for q in together] == [
            reference(twin, i, g, 50.0, running=r) for i, g, r in queues
        ], step
        assert together[0].groups() == []
        assert est.beliefs.inflight == twin.beliefs.inflight
        done = queues[1 + step % 4][2][0].request
        est.observe(done, output_tokens=40 + step)
        twin.observe(done, output_tokens=40 + step)
