"""The RCT estimator on hand-made profiles: waiting, prefill, decode, model switches, groups,
learning from completions, and the profile file; plus one profile of the real simulated engine."""

from __future__ import annotations

import copy
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import numpy as np
import pytest

from qlm.domain import SLO, Request
from qlm.engines.perf_model import default_catalog
from qlm.errors import ConfigError
from qlm.profiling.sim import profile_sim_hardware
from qlm.rct.batch import sustained_batch
from qlm.rct.distribution import CompletionDistribution
from qlm.rct.estimator import RCTEstimator
from qlm.rct.inputs import EstimatorInstance, Queued
from qlm.rct.output_model import HIST_BINS, NIG, LengthHistogram, length_bin
from qlm.rct.profile import HardwareProfile, RctProfile, dump_profile, parse_profile
from qlm.rct.tuning import POOL_STRENGTH, PREEMPT_PRIOR, RATE_FORGETTING, SPEED_PRIOR_SD
from tests.builders import make_hardware, make_request

NOW = 100.0
PRIOR = NIG(mu=4.0, kappa=20.0, alpha=11.0, beta=5.0)  # outputs of ~70 tokens
KV = {"decode_per_ctx_token_s": 1e-7, "decode_ctx_tokens": 1000.0}
"""A profile whose decode steps cost 0.1 µs more per token of context in the batch."""


def hardware(model: str = "m", **overrides: Any) -> HardwareProfile:
    """The builders' hand-made profile with an inefficiency ε of 1.2 (so ε shows in results)."""
    return make_hardware(model, **({"inefficiency": 1.2} | overrides))


def token_work(hw: HardwareProfile, batch: int) -> float:
    """GPU time of an output token in a batch of ``batch``: the profile's 1 / Θ, measured in its
    full batch, scaled by the time per token per request of this batch against that one."""
    per_token_per_request = hw.decode_s(batch) / batch
    return per_token_per_request / (hw.decode_per_token_s / hw.saturation_batch) / hw.throughput_tps


def estimator(**overrides: Any) -> RCTEstimator:
    """Models ``m`` and ``n`` with the same hardware profile and the same output prior."""
    hw = {h.key: h for h in (hardware("m", **overrides), hardware("n", **overrides))}
    return RCTEstimator(RctProfile(hardware=hw, output_priors={"default": PRIOR}))


def instance(active: str | None = "m", warm: frozenset[str] = frozenset()) -> EstimatorInstance:
    return EstimatorInstance("i0", "G", 1, active, warm)


def waiting(requests: list[Request]) -> list[Queued]:
    return [Queued(r) for r in requests]


# --- single requests -----------------------------------------------------------------------------


def assert_same_load(loads: Any, k: int, one: Any) -> None:
    """Row ``k`` of ``group_loads``' arrays equals ``one`` (a ``group_load``) to the last bit."""
    assert loads.models[k] == one.model
    assert loads.size[k] == one.size
    for name in (
        "earliest_deadline_s", "input_tokens", "output_mean", "output_var",
        "last_output_mean", "last_output_var", "last_input_tokens",
        "earliest_ttft_deadline_s", "first_input_tokens",
    ):  # fmt: skip
        assert float(getattr(loads, name)[k]) == float(getattr(one, name)), name


def test_a_request_on_an_empty_instance_takes_its_prefill_plus_its_expected_decode() -> None:
    est = estimator()
    hw = hardware()
    req = make_request(0, input_tokens=2000)
    m, _ = est.output_moments(req)
    (only,) = est.estimate_requests(instance(), waiting([req]), NOW)
    expected = NOW + hw.prefill_s(2000) + m * hw.decode_alone_s * hw.inefficiency
    assert only.mean == pytest.approx(expected, rel=1e-9)


def test_a_request_behind_waiting_requests_waits_for_their_prompt_and_output_work() -> None:
    # One request at a time (max_num_seqs=1): decode speed is the same at every position, so the
    # difference between positions is the waiting time alone.
    est = estimator(max_num_seqs=1)
    hw = hardware()
    reqs = [make_request(i, input_tokens=1000) for i in range(3)]
    first, _, third = est.estimate_requests(instance(), waiting(reqs), NOW)
    m, _ = est.output_moments(reqs[0])
    # One request at a time: an output token costs a whole step, d(1) = decode_alone_s, against
    # the d(8) / 8 of the full batch of the profile's requests in which Θ was measured.
    work_each = 1000 * hw.input_token_work_s + m * token_work(hw, 1)
    # Decode starts after the waiting work (the decode itself also slows down while others
    # wait to be admitted, so compare the starts).
    assert third.start_mean - first.start_mean == pytest.approx(2 * work_each, rel=1e-9)
    assert third.mean - third.start_mean > first.mean - first.start_mean


def test_output_work_is_counted_in_the_batch_a_long_mix_fills() -> None:
    # Deep in a queue each request waits for the work of the one ahead of it. Requests of 20,000
    # prompt tokens fill the 100,000-token KV cache four at a time, not eight: each step makes
    # four output tokens in d(4) instead of eight in d(8), so an output token costs more GPU time
    # than the profile's 1 / Θ (measured in full batches of its own, shorter, requests).
    est = estimator()
    hw = hardware()

    def gap(input_tokens: int) -> tuple[float, float]:
        reqs = [make_request(i, input_tokens=input_tokens) for i in range(30)]
        ests = est.estimate_requests(instance(), waiting(reqs), NOW)
        m, _ = est.output_moments(reqs[0])
        return ests[21].start_mean - ests[20].start_mean, m

    short_gap, m = gap(1000)  # eight fit: the profile's own batch
    assert short_gap == pytest.approx(1000 * hw.input_token_work_s + m / hw.throughput_tps)
    long_gap, m = gap(20_000)
    slots = int(hw.kv_capacity_tokens / (20_000 + m))
    assert slots == 4
    assert token_work(hw, slots) * hw.throughput_tps == pytest.approx(1.238, abs=1e-3)
    expected = 20_000 * hw.input_token_work_s + m * token_work(hw, slots)
    assert long_gap == pytest.approx(expected, rel=1e-9)


def test_output_work_follows_the_kv_footprint_the_running_batch_shows() -> None:
    # max_num_seqs, not the cache, limits the batch: every decode step reads the running
    # requests' KV cache, so a batch of long contexts makes each output token cost more. The
    # footprint per request is read from the running batch (prompt + tokens generated), not from
    # the expected outputs of the queue.
    est = estimator(kv_capacity_tokens=10_000_000, **KV)
    hw = hardware(kv_capacity_tokens=10_000_000, **KV)

    def gap(running_prompt: int) -> float:
        running = [
            Queued(make_request(100 + i, input_tokens=running_prompt), generated=50, running=True)
            for i in range(8)
        ]
        reqs = [make_request(i, input_tokens=1000) for i in range(30)]
        ests = est.estimate_requests(instance(), [*running, *waiting(reqs)], NOW)
        return ests[8 + 21].start_mean - ests[8 + 20].start_mean

    m, _ = est.output_moments(make_request(0, input_tokens=1000))
    ref = hw.decode_s(8, 8 * 1000.0) / 8  # the profile's batch: 8 requests of 1,000 tokens
    for prompt in (950, 7950):
        per_token = hw.decode_s(8, 8 * (prompt + 50.0)) / 8 / ref / hw.throughput_tps
        assert gap(prompt) == pytest.approx(1000 * hw.input_token_work_s + m * per_token)
    assert gap(7950) > gap(950)


def test_requests_behind_running_ones_only_do_not_wait() -> None:
    # No prompt work and a flat decode speed: completion is exactly prefill + decode.
    est = estimator(input_token_work_s=0.0, saturation_batch=1.0)
    hw = hardware()
    running = [Queued(make_request(i), generated=30, running=True) for i in range(2)]
    req = make_request(2, input_tokens=500)
    *_, behind_running = est.estimate_requests(instance(), [*running, Queued(req)], NOW)
    m, _ = est.output_moments(req)
    decode = m * hw.decode_per_token_s * hw.inefficiency
    assert behind_running.mean == pytest.approx(NOW + hw.prefill_s(500) + decode, rel=1e-9)

    # The same request behind the same two requests, still waiting and with no free slot, waits
    # for their work.
    full = estimator(input_token_work_s=0.0, saturation_batch=1.0, max_num_seqs=1)
    ahead = [make_request(i) for i in range(2)]
    *_, behind_waiting = full.estimate_requests(instance(), waiting([*ahead, req]), NOW)
    work_ahead = sum(full.output_moments(r)[0] for r in ahead) / hw.throughput_tps
    assert behind_waiting.start_mean - behind_running.start_mean == pytest.approx(
        work_ahead, rel=1e-9
    )


def test_waiting_requests_that_find_free_slots_cost_only_their_prefill() -> None:
    # A burst into an instance with free slots: each is admitted as soon as the prompts ahead of
    # it are prefilled; nobody waits for anyone's decode.
    est = estimator()
    hw = hardware()
    reqs = [make_request(i, input_tokens=1000) for i in range(3)]
    first, _, third = est.estimate_requests(instance(), waiting(reqs), NOW)
    assert third.start_mean - first.start_mean == pytest.approx(
        2 * 1000 * hw.input_token_work_s, rel=1e-9
    )
    # Two slots: the third needs one of the two ahead to finish (its output work too).
    two = estimator(max_num_seqs=2)
    first, _, third = two.estimate_requests(instance(), waiting(reqs), NOW)
    m, _ = two.output_moments(reqs[1])
    assert third.start_mean - first.start_mean == pytest.approx(
        2 * 1000 * hw.input_token_work_s + m * token_work(hw, 2), rel=1e-9
    )


def test_a_request_pulled_from_a_backlog_decodes_while_the_batch_is_refilled() -> None:
    """Pull dispatch: nothing waits in the engine, but a virtual queue keeps the batch full;
    each step then also prefills the requests that replace finished ones (the refill)."""
    est = estimator()
    hw = hardware()
    running = [Queued(make_request(i, input_tokens=800), running=True) for i in range(3)]
    req = make_request(3, input_tokens=800)
    queue = [*running, Queued(req)]
    (alone,) = est.estimate_requests(instance(), queue, NOW, only=[-1])
    (refilled,) = est.estimate_requests(instance(), queue, NOW, only=[-1], refilled=True)
    m, _ = est.output_moments(req)
    refill = 4 * 800 * hw.input_token_work_s / (4 * m)  # prompt work per output token of the mix
    assert alone.per_token_s == pytest.approx(hw.decode_s(4) * hw.inefficiency, rel=1e-9)
    assert refilled.per_token_s == pytest.approx(
        (hw.decode_s(4) + 4 * refill) * hw.inefficiency, rel=1e-9
    )
    assert refilled.start_mean == alone.start_mean  # it waits for nothing either way


def test_a_queue_extending_the_last_one_is_estimated_as_if_scanned_afresh() -> None:
    """The agents predict every pull behind the running requests; the estimator rescans only
    what changed since the instance's last queue (a longer queue, another request at some
    place, tokens generated, a model switched to), and answers exactly as a fresh scan would."""
    reqs = [
        make_request(i, input_tokens=100 + 37 * i, model="n" if i % 5 == 4 else "m")
        for i in range(12)
    ]

    def queue(k: int, generated: int = 0) -> list[Queued]:
        return [Queued(r, generated, running=True) for r in reqs[:k]] + [Queued(reqs[k])]

    steps: list[tuple[list[Queued], EstimatorInstance]] = [
        (queue(3), instance()),
        (queue(4), instance()),  # one more pulled: the scan goes on
        (queue(7), instance()),
        (queue(5), instance()),  # shorter: cut back
        (queue(6, generated=9), instance()),  # tokens generated since: scanned again
        (queue(6, generated=9), instance(active="n")),  # another model active
        ([Queued(reqs[2]), *queue(4)], instance()),  # another request first
    ]
    est = estimator()
    for k, (q, view) in enumerate(steps):
        got = est.estimate_requests(view, q, NOW)
        assert got == estimator().estimate_requests(view, q, NOW), f"step {k}"
    # A completion changes the beliefs: nothing scanned before is reused.
    q, view = queue(4), instance()
    before = est.estimate_requests(view, q, NOW)
    est.observe(reqs[0], output_tokens=900)
    unscanned = copy.deepcopy(est)
    unscanned._scans.clear()
    after = est.estimate_requests(view, q, NOW)
    assert after != before
    assert after == unscanned.estimate_requests(view, q, NOW)

    # A running request forgotten (cancelled) and seen running again is noted again: the
    # censored outputs the next completion counts include it.
    def noted() -> set[str]:
        return {rid for seen in est.beliefs.inflight.values() for rid in seen}

    assert reqs[1].id in noted()
    est.forget([reqs[1].id])
    assert reqs[1].id not in noted()
    est.estimate_requests(view, q, NOW)
    assert reqs[1].id in noted()


def preempting(est: RCTEstimator, completions: int, per_completion: int, start: int = 0) -> int:
    """``completions`` requests nothing was predicted for finish on i0, the engine's counter
    (read before each) going up by ``per_completion`` each time; returns the counter."""
    count = start
    est.watch(replace(instance(), preemptions_total=count))
    for k in range(completions):
        count += per_completion
        est.watch(replace(instance(), preemptions_total=count))
        done = make_request(90_000 + k, model="n", input_tokens=800)  # m's outputs unlearnt
        est.observe(done, output_tokens=50, finish_s=float(k), instance="i0")
    return count


def test_preemptions_the_engine_reports_are_priced_as_prompts_recomputed() -> None:
    """vLLM preempts the newest request when its KV cache is full and later recomputes what it
    had computed (about a prompt): each preemption per completion is one more prompt of prefill
    in the steps that refill the batch, and in the work of the requests waiting ahead."""
    est = estimator()
    hw = hardware()
    running = [Queued(make_request(i, input_tokens=800), running=True) for i in range(3)]
    req = make_request(3, input_tokens=800)
    queue = [*running, Queued(req)]
    (before,) = est.estimate_requests(instance(), queue, NOW, only=[-1], refilled=True)
    preempting(est, 40, 1)  # one preemption per completion
    done = (1 - RATE_FORGETTING**40) / (1 - RATE_FORGETTING)  # completions, forgotten
    rate = done / (done + PREEMPT_PRIOR)
    view = replace(instance(), preemptions_total=40)
    (after,) = est.estimate_requests(view, queue, NOW, only=[-1], refilled=True)
    m, _ = est.output_moments(req)
    refill = 800 * hw.input_token_work_s / m
    assert before.per_token_s == pytest.approx(
        (hw.decode_s(4) + 4 * refill) * hw.inefficiency, rel=1e-9
    )
    assert after.per_token_s == pytest.approx(
        (hw.decode_s(4) + 4 * refill * (1 + rate)) * hw.inefficiency, rel=1e-9
    )
    # Waiting: the prompt work of the requests ahead grows by the same share.
    reqs = [make_request(10 + i, input_tokens=1000) for i in range(3)]
    fresh = estimator(max_num_seqs=1)
    first, _, third = fresh.estimate_requests(instance(), waiting(reqs), NOW)
    preempting(fresh, 40, 1)
    first2, _, third2 = fresh.estimate_requests(view, waiting(reqs), NOW)
    grown = (third2.start_mean - first2.start_mean) - (third.start_mean - first.start_mean)
    assert grown == pytest.approx(2 * 1000 * hw.input_token_work_s * rate, rel=1e-9)


def test_an_engine_counter_that_starts_again_is_counted_from_there() -> None:
    est = estimator()
    preempting(est, 10, 0, start=500)  # a restarted controller meets an old count: not its own
    assert est.preemption_rate("i0") == 0.0
    preempting(est, 10, 2, start=0)  # the engine restarted: its counter starts again
    assert 0.0 < est.preemption_rate("i0") <= 1.0  # never negative, two per completion


def test_preemptions_met_after_a_prediction_are_not_learnt_as_a_slow_decode() -> None:
    """A request predicted before the engine started preempting decodes in steps that
    recompute preempted prompts. Judged against the prediction it got, its decode would teach
    ε the preemptions, which the preemption rate already prices: counted twice."""
    est = estimator()
    hw = hardware()
    running = [Queued(make_request(i, input_tokens=800), running=True) for i in range(3)]
    req = make_request(3, input_tokens=800)
    est.estimate_requests(
        instance(), [*running, Queued(req)], NOW, only=[-1], refilled=True, remember=True
    )
    preempting(est, 40, 1)
    rate = est.preemption_rate("i0")
    assert rate > 0.5
    m, _ = est.output_moments(req)
    refill = 800 * hw.input_token_work_s / m
    per_token = (hw.decode_s(4) + 4 * refill * (1 + rate)) * hw.inefficiency  # as it decoded
    est.observe(req, output_tokens=101, first_token_s=NOW + 1, finish_s=NOW + 1 + 100 * per_token)
    assert est.calibration_factors("i0")[1] == pytest.approx(1.0, rel=1e-9)


def test_a_model_switch_along_the_queue_adds_the_warm_or_cold_load_time() -> None:
    est = estimator()
    hw = hardware()
    same = [make_request(i) for i in range(3)]
    switching = [same[0], *(replace(r, model="n") for r in same[1:])]
    base = [e.mean for e in est.estimate_requests(instance("m"), waiting(same), NOW)]
    warm = [
        e.mean
        for e in est.estimate_requests(instance("m", frozenset({"n"})), waiting(switching), NOW)
    ]
    cold = [e.mean for e in est.estimate_requests(instance("m"), waiting(switching), NOW)]
    # The first request needs no switch; the second pays the load; the third waits through it too.
    assert [w - b for w, b in zip(warm, base, strict=True)] == pytest.approx(
        [0.0, hw.warm_load_s, hw.warm_load_s], abs=1e-9
    )
    assert [c - b for c, b in zip(cold, base, strict=True)] == pytest.approx(
        [0.0, hw.cold_load_s, hw.cold_load_s], abs=1e-9
    )


def test_an_instance_with_no_active_model_loads_the_first_one() -> None:
    est = estimator()
    reqs = waiting([make_request(0)])
    (loaded,) = est.estimate_requests(instance("m"), reqs, NOW)
    (idle,) = est.estimate_requests(instance(None), reqs, NOW)
    assert idle.mean - loaded.mean == pytest.approx(hardware().cold_load_s, rel=1e-9)


def test_a_request_with_max_tokens_5_predicts_at_most_5_tokens_of_decode() -> None:
    est = estimator(input_token_work_s=0.0, saturation_batch=1.0)
    hw = hardware()
    short = make_request(0, max_tokens=5, input_tokens=300)
    long = make_request(1, max_tokens=1000, input_tokens=300)
    assert 0 < est.expected_output(short) <= 5 < est.expected_output(long)
    (capped,) = est.estimate_requests(instance(), waiting([short]), NOW)
    decode = capped.mean - NOW - hw.prefill_s(300)
    assert 0 < decode <= 5 * hw.decode_per_token_s * hw.inefficiency * (1 + 1e-12)


def test_a_running_request_near_its_cap_has_few_tokens_left() -> None:
    est = estimator()
    req = make_request(0, max_tokens=100)
    m, v = est.output_moments(req, generated=97)
    assert 0 < m <= 3 and 0 <= v <= 3 * 3 / 4
    assert est.output_moments(req, generated=100) == (0.0, 0.0)


def test_p_before_of_a_request_follows_its_skewed_output_distribution() -> None:
    est = estimator()
    reqs = waiting([make_request(i) for i in range(5)])
    last = est.estimate_requests(instance(), reqs, NOW)[-1]
    assert last.std > 0
    for q in (0.1, 0.5, 0.9):
        assert last.p_before(last.quantile(q)) == pytest.approx(q, abs=1e-6)
    # Output lengths are right-skewed: the median completes before the mean.
    assert last.quantile(0.5) < last.mean
    times = [
        last.quantile(0.02) + k * (last.quantile(0.98) - last.quantile(0.02)) / 32
        for k in range(33)
    ]
    ps = [last.p_before(t) for t in times]
    assert all(a < b for a, b in itertools.pairwise(ps))
    assert last.p_before(last.start_mean - 10 * last.start_sd) == 0.0


def test_p_before_of_a_group_is_normal_around_its_mean() -> None:
    group = CompletionDistribution(mean=100.0, var=25.0)
    assert group.p_before(100.0) == pytest.approx(0.5, abs=1e-12)
    assert group.p_before(group.quantile(0.9)) == pytest.approx(0.9, abs=1e-6)


def test_a_certain_completion_is_met_exactly_from_its_time_on() -> None:
    sure = CompletionDistribution(mean=10.0, var=0.0)
    assert sure.p_before(9.999) == 0.0 and sure.p_before(10.0) == 1.0


# --- groups --------------------------------------------------------------------------------------


def test_a_group_load_sums_its_requests_and_keeps_its_last_one() -> None:
    est = estimator()
    reqs = [
        make_request(0, input_tokens=100, max_tokens=20, arrival_s=5.0, slo=SLO(e2e_s=40.0)),
        make_request(1, input_tokens=800, max_tokens=1000, arrival_s=6.0, slo=SLO(e2e_s=10.0)),
        make_request(2, input_tokens=3000, max_tokens=60, arrival_s=7.0, slo=SLO(e2e_s=30.0)),
    ]
    moments = [est.output_moments(r) for r in reqs]
    load = est.group_load("g1", reqs)
    assert (load.group_id, load.model, load.size) == ("g1", "m", 3)
    assert load.earliest_deadline_s == 16.0
    assert load.input_tokens == 3900 and load.last_input_tokens == 3000
    assert load.output_mean == pytest.approx(sum(m for m, _ in moments), rel=1e-12)
    assert load.output_var == pytest.approx(sum(v for _, v in moments), rel=1e-12)
    assert (load.last_output_mean, load.last_output_var) == moments[2]
    # Capped requests differ, so the sum is not just size x one request's moments.
    assert moments[0][0] < moments[2][0] < moments[1][0]


def test_a_group_load_follows_the_beliefs_and_the_members_of_an_unchanged_snapshot() -> None:
    est = estimator()
    members = tuple(make_request(i, max_tokens=100 + 300 * (i % 2)) for i in range(6))
    before = est.group_load("g1", members)
    est.observe(make_request(99), output_tokens=5)  # the beliefs move, the group does not
    after = est.group_load("g1", members)
    fresh = estimator()
    fresh.observe(make_request(99), output_tokens=5)
    assert after == fresh.group_load("g1", members)  # as if summed from scratch
    assert after.output_mean != before.output_mean
    by_request = [est.output_moments(r) for r in members]  # requests sharing a belief count each
    assert after.output_mean == pytest.approx(sum(m for m, _ in by_request), rel=1e-12)
    assert after.output_var == pytest.approx(sum(v for _, v in by_request), rel=1e-12)
    grown = (*members, make_request(6, input_tokens=777, arrival_s=-50.0))
    assert est.group_load("g1", grown) == fresh.group_load("g1", grown)  # a new snapshot
    est.keep_group_loads(["g2"])  # g1 ended: what was kept for it goes
    assert est.group_load("g1", grown) == fresh.group_load("g1", grown)


def test_group_load_walks_a_snapshot_once_until_its_group_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import qlm.rct.loads as module

    walked: list[int] = []
    real = module.group_sums

    def counting(requests: Any, key: Any) -> Any:
        walked.append(len(requests))
        return real(requests, key)

    monkeypatch.setattr(module, "group_sums", counting)
    est = estimator()
    members = tuple(make_request(i) for i in range(4))
    for _ in range(3):
        est.group_load("g1", members)
        est.observe(make_request(50), output_tokens=7)
    assert walked == [4]  # the beliefs moved twice; the requests were walked once
    est.group_load("g1", list(members))  # a list may change in place: walked, not kept
    est.keep_group_loads(["g1"])
    est.group_load("g1", members)
    assert walked == [4, 4]
    est.keep_group_loads([])  # g1 ended
    est.group_load("g1", members)
    assert walked == [4, 4, 4]


def test_an_empty_group_has_no_load() -> None:
    with pytest.raises(ValueError, match="g9"):
        estimator().group_load("g9", [])


@pytest.mark.parametrize(
    "kv", [pytest.param({}, id="batch-size"), pytest.param(KV, id="kv-footprint")]
)
@pytest.mark.parametrize("preempted", [0, 1], ids=["no-preemptions", "preempting"])
def test_queue_estimates_of_one_request_groups_agree_with_request_estimates(
    kv: dict[str, float], preempted: int
) -> None:
    est = estimator(**kv)
    preempting(est, 30, preempted)  # the engine preempting once per completion, or never
    running = [Queued(make_request(90 + i), generated=10 * i, running=True) for i in range(2)]
    reqs = [
        make_request(i, input_tokens=n, max_tokens=cap)
        for i, (n, cap) in enumerate([(3000, 1000), (100, 50), (1500, 1000), (50, 400), (800, 200)])
    ]
    per_request = est.estimate_requests(instance(), [*running, *waiting(reqs)], NOW)[2:]
    per_group = est.estimate_queue(
        instance(), [est.group_load(r.id, [r]) for r in reqs], NOW, running=running
    )
    assert [g.group_id for g in per_group] == [r.id for r in reqs]
    # Compare latencies (from now), not absolute times, so that the tolerance means something.
    assert [g.completion.mean - NOW for g in per_group] == pytest.approx(
        [e.mean - NOW for e in per_request], rel=1e-3
    )


def test_queue_estimates_count_free_slots_as_request_estimates_do() -> None:
    # Two free slots behind one running request: a group's first members are admitted at once,
    # later ones wait for the drain — group sums must say what request by request says.
    est = estimator(max_num_seqs=3)
    running = [Queued(make_request(90), generated=5, running=True)]
    first = [make_request(i, input_tokens=700) for i in range(3)]
    second = [make_request(10 + i, input_tokens=300) for i in range(2)]
    per_request = est.estimate_requests(instance(), [*running, *waiting([*first, *second])], NOW)
    per_group = est.estimate_queue(
        instance(),
        [est.group_load("g1", first), est.group_load("g2", second)],
        NOW,
        running=running,
    )
    assert [g.completion.mean - NOW for g in per_group] == pytest.approx(
        [per_request[3].mean - NOW, per_request[5].mean - NOW], rel=1e-3
    )


def test_a_group_completes_with_its_last_request() -> None:
    est = estimator()
    reqs = [
        make_request(i, input_tokens=400 + 100 * i, arrival_s=NOW, slo=SLO(e2e_s=2.0))
        for i in range(4)
    ]
    (group,) = est.estimate_queue(instance(), [est.group_load("g", reqs)], NOW)
    later = est.estimate_queue(
        instance(), [est.group_load("g", reqs[:2]), est.group_load("h", reqs[2:])], NOW
    )
    # Splitting the same requests into two groups in the same order changes nothing for the last.
    assert later[1].completion.mean == pytest.approx(group.completion.mean, rel=1e-9)
    assert later[0].completion.mean < later[1].completion.mean
    assert group.deadline_s == min(r.deadline_s for r in reqs)
    assert 0.0 < group.p_meet_slo < 1.0


def test_queue_estimates_add_the_load_time_when_the_model_changes() -> None:
    est = estimator()
    reqs = [make_request(i) for i in range(2)]
    loads = [est.group_load("a", reqs[:1]), est.group_load("b", reqs[1:])]
    other = [loads[0], replace(loads[1], model="n")]
    base = est.estimate_queue(instance("m", frozenset({"n"})), loads, NOW)
    warm = est.estimate_queue(instance("m", frozenset({"n"})), other, NOW)
    cold = est.estimate_queue(instance("m"), other, NOW)
    hw = hardware()
    assert warm[0].completion.mean == pytest.approx(base[0].completion.mean, rel=1e-12)
    assert warm[1].completion.mean - base[1].completion.mean == pytest.approx(hw.warm_load_s)
    assert cold[1].completion.mean - base[1].completion.mean == pytest.approx(hw.cold_load_s)


# --- learning ------------------------------------------------------------------------------------


def test_a_completion_updates_the_posterior_of_its_model_and_slo_class_only() -> None:
    est = estimator()
    chat = make_request(0, slo_class="chat")
    same_model_other_class = make_request(1)
    other_model_same_class = make_request(2, model="n", slo_class="chat")
    before = est.expected_output(chat)
    est.observe(chat, output_tokens=900)
    prior = LengthHistogram.from_prior(PRIOR)
    assert est.posterior(chat) == prior.update(900)
    assert est.expected_output(make_request(3, slo_class="chat")) > before
    assert est.posterior(same_model_other_class) == prior
    assert est.posterior(other_model_same_class) == prior
    # By prompt length: the class-wide belief learns the output, and so does that of prompts
    # of its length, which leans on the class-wide one (POOL_STRENGTH outputs' worth).
    by_prompt = RCTEstimator(est.profile, by_prompt=True)
    by_prompt.observe(chat, output_tokens=900)
    counts = np.zeros(HIST_BINS)
    counts[length_bin(900)] = 1.0
    assert by_prompt.posterior(chat) == prior.update(900).conditioned(counts, POOL_STRENGTH)
    assert by_prompt.posterior(same_model_other_class) == prior.conditioned(None, POOL_STRENGTH)


def test_outputs_are_learnt_per_prompt_length() -> None:
    """A templated job (1,100-token prompts, 400-token answers) mixed with short chat: each
    request's belief follows requests with prompts of its length, not the blend."""
    est = RCTEstimator(estimator().profile, by_prompt=True)
    for i in range(200):
        long_job = i % 2 == 0
        req = make_request(i, input_tokens=1100 if long_job else 120)
        est.observe(req, output_tokens=400 if long_job else 40)
    templated = est.expected_output(make_request(900, input_tokens=1100))
    chat = est.expected_output(make_request(901, input_tokens=120))
    # 100 outputs of each against the class-wide blend worth POOL_STRENGTH outputs.
    assert templated == pytest.approx(400, rel=0.1)
    assert chat == pytest.approx(40, rel=0.5)
    assert chat < 0.2 * templated
    # A prompt length never seen falls back on the class-wide belief (the blend).
    blend = est.expected_output(make_request(902, input_tokens=5000))
    assert chat < blend < templated
    pooled = RCTEstimator(est.profile)  # the default: one belief per (model, SLO class)
    for i in range(200):
        req = make_request(i, input_tokens=1100 if i % 2 == 0 else 120)
        pooled.observe(req, output_tokens=400 if i % 2 == 0 else 40)
    assert pooled.expected_output(make_request(900, input_tokens=1100)) == pytest.approx(
        pooled.expected_output(make_request(901, input_tokens=120))
    )


def test_requests_seen_running_count_as_censored_outputs_at_the_next_completion() -> None:
    est = estimator()
    running = [Queued(make_request(i), generated=300, running=True) for i in range(50)]
    est.estimate_requests(instance(), running, NOW)  # seen running, 300 tokens in
    before = est.expected_output(make_request(99))
    est.observe(make_request(100), output_tokens=20)  # a short one completes
    # 50 requests known to exceed 300 tokens outweigh one short completion.
    assert est.expected_output(make_request(101)) > before
    without = estimator()
    without.observe(make_request(100), output_tokens=20)
    assert without.expected_output(make_request(101)) < before
    # Once they complete they count once, as what they produced.
    for item in running:
        est.observe(item.request, output_tokens=310)
    assert est.beliefs.inflight[("m", make_request(0).slo_class, 0)] == {}  # one bin: no by_prompt


def test_the_location_scale_model_remains_available() -> None:
    est = RCTEstimator(estimator().profile, shape_free=False)
    chat = make_request(0, slo_class="chat")
    est.observe(chat, output_tokens=900)
    assert est.posterior(chat) == PRIOR.update(900)


SLOW = {"max_num_seqs": 1, "saturation_batch": 1.0, "throughput_tps": 100.0}
"""A profile that runs one request at a time, slowly enough that 30 requests take > 5 s."""


def saturated_run(
    est: RCTEstimator, reqs: list[Request], slowdown: float, start: float = 0.0
) -> float:
    """Predict ``reqs`` as one queue (all waiting: with ``SLOW``, for a slot) at ``start``, then
    let them finish one after another, each ``slowdown`` times the profile's work for it after
    the one before (the work predicted for it: the drain rate is measured against that); returns
    the last finish."""
    est.estimate_requests(instance(), waiting(reqs), start, remember=True)
    hw = hardware(**SLOW)
    predicted = [est.output_moments(r)[0] for r in reqs]
    t = start
    for r, m in zip(reqs, predicted, strict=True):
        t += slowdown * (r.input_tokens * hw.input_token_work_s + m / hw.throughput_tps)
        est.observe(r, output_tokens=r.replay_output_tokens or 1, finish_s=t)
    return t


def test_a_completion_nothing_was_predicted_for_ends_the_measured_interval() -> None:
    """Requests in flight when an estimator starts (a new controller after a failover) complete
    without a prediction. Their time must not be charged to the next predicted completion: that
    would read the instance as draining several times slower than it does."""
    hw = hardware(**SLOW)

    def drain_factor(report_unpredicted: bool) -> float:
        est = estimator(**SLOW)
        reqs = [make_request(i, input_tokens=1000, replay_output_tokens=80) for i in range(200)]
        est.estimate_requests(instance(), waiting(reqs), 0.0, remember=True)
        m = est.output_moments(reqs[0])[0]  # what was predicted for each
        work = 1000 * hw.input_token_work_s + m / hw.throughput_tps
        t = 0.0
        for i, r in enumerate(reqs):
            if i % 2:  # before every other one, a completion nothing was predicted for
                t += 5 * work
                if report_unpredicted:
                    unknown = make_request(10_000 + i, input_tokens=1000)
                    est.observe(unknown, output_tokens=80, finish_s=t, instance="i0")
            t += work  # predicted completions at the predicted pace
            est.observe(r, output_tokens=80, finish_s=t)
        return est.calibration_factors("i0")[0]

    assert drain_factor(report_unpredicted=True) == pytest.approx(1.0, abs=0.05)
    assert drain_factor(report_unpredicted=False) > 2.0


def wait_of_third(est: RCTEstimator) -> tuple[float, float]:
    """Predicted waiting of the third of three identical requests, and the profile's work ahead
    of it (two requests); with ``SLOW`` decode speed is the same at every position."""
    reqs = [make_request(1000 + i, input_tokens=1000) for i in range(3)]
    first, _, third = est.estimate_requests(instance(), waiting(reqs), 0.0)
    hw = hardware(**SLOW)
    m, _ = est.output_moments(reqs[0])
    return third.start_mean - first.start_mean, 2 * (
        1000 * hw.input_token_work_s + m / hw.throughput_tps
    )


def test_completions_of_a_saturated_instance_calibrate_the_waiting_to_the_observed_rate() -> None:
    est = estimator(**SLOW)
    wait, work = wait_of_third(est)
    assert wait == pytest.approx(work, rel=1e-9)  # uncalibrated: the profile's rate
    reqs = [make_request(i, input_tokens=1000, replay_output_tokens=80) for i in range(30)]
    end = saturated_run(est, reqs, slowdown=2.0)  # ~50 s of observed service for ~25 s of work
    early, work = wait_of_third(est)
    # A little evidence moves it part of the way (shrunk toward the profile) ...
    assert work < early < 2.0 * work
    more = [make_request(100 + i, input_tokens=1000, replay_output_tokens=80) for i in range(600)]
    saturated_run(est, more, slowdown=2.0, start=end)
    late, work = wait_of_third(est)
    # ... and enough of it all the way to the observed rate.
    assert late == pytest.approx(2.0 * work, rel=0.1)
    assert late > early


def test_the_drain_rate_is_learnt_only_while_requests_wait_for_a_slot() -> None:
    """Requests that wait only for the prompts ahead of them to prefill (slots are free) say
    nothing about how fast the instance drains a queue: bursts of three into eight free slots,
    however slowly they complete, leave the waiting uncalibrated; into one slot they teach it."""
    roomy, single = estimator(throughput_tps=100.0), estimator(**SLOW)
    for est in (roomy, single):
        t = 0.0
        for b in range(40):
            burst = [
                make_request(3 * b + i, input_tokens=1000, replay_output_tokens=80)
                for i in range(3)
            ]
            t = saturated_run(est, burst, slowdown=2.0, start=t)
    assert roomy.calibration_factors("i0")[0] == 1.0
    assert single.calibration_factors("i0")[0] > 1.2


def test_the_drain_rate_is_measured_against_the_work_that_was_predicted() -> None:
    """While a queue builds, the short outputs complete first: the completions' own work
    understates the work of a typical request. Measured against what was predicted for them
    (the quantity waits are predicted from), completions at the predicted pace leave the
    waiting uncalibrated — measured against their actual outputs they would say 'slow'."""
    est = estimator(**SLOW)
    hw = hardware(**SLOW)
    reqs = [make_request(i, input_tokens=1000) for i in range(400)]
    est.estimate_requests(instance(), waiting(reqs), 0.0, remember=True)
    m, _ = est.output_moments(reqs[0])  # what was predicted for each (before any completion)
    t = 0.0
    for r in reqs:
        t += 1000 * hw.input_token_work_s + m / hw.throughput_tps  # the predicted pace ...
        est.observe(r, output_tokens=3, finish_s=t)  # ... of requests that said little
    wait_f, _ = est.calibration_factors("i0")
    assert wait_f == pytest.approx(1.0, abs=0.02)


def test_decode_speeds_that_vary_request_to_request_widen_the_completion_distribution() -> None:
    """Half the requests decode at 0.6 and half at 1.4 times the predicted time per token: the
    mean is right (ε stays near 1) but a single request's completion is less certain, so the
    chance of finishing by a time far in the model's tail drops."""
    est = estimator()
    for i in range(200):
        r = make_request(i, arrival_s=NOW, input_tokens=500)
        (pred,) = est.estimate_requests(instance(), waiting([r]), NOW, remember=True)
        start = pred.start_mean
        per_token = pred.per_token_s * (0.6 if i % 2 else 1.4)
        est.observe(r, output_tokens=70, first_token_s=start, finish_s=start + 69 * per_token)
    probe = make_request(1000, arrival_s=NOW, input_tokens=500)
    (after,) = est.estimate_requests(instance(), waiting([probe]), NOW)
    assert after.speed_sd == pytest.approx(math.log(1.4 / 0.6) / 2, rel=0.1)
    certain = replace(after, speed_sd=0.0)
    late = certain.quantile(0.95)
    assert after.p_before(late) < certain.p_before(late) - 0.01
    early = certain.quantile(0.05)
    assert after.p_before(early) > certain.p_before(early) + 0.01


def test_decode_speed_is_uncertain_until_decodes_are_observed() -> None:
    """Before any decode completes the time per token is the profile's guess, and a guess is
    uncertain: the spread starts at the prior's, not at 0 (which made the first requests of a
    replay confident about speeds nobody had seen), and narrows as decodes come true."""
    est = estimator()
    first = make_request(0, arrival_s=NOW, input_tokens=500)
    (cold,) = est.estimate_requests(instance(), waiting([first]), NOW)
    assert cold.speed_sd == pytest.approx(SPEED_PRIOR_SD)
    for i in range(300):
        r = make_request(i, arrival_s=NOW, input_tokens=500)
        (pred,) = est.estimate_requests(instance(), waiting([r]), NOW, remember=True)
        start = pred.start_mean
        est.observe(
            r, output_tokens=70, first_token_s=start, finish_s=start + 69 * pred.per_token_s
        )
    (warm,) = est.estimate_requests(instance(), waiting([first]), NOW)
    assert warm.speed_sd < SPEED_PRIOR_SD / 4


def test_completions_on_an_unsaturated_instance_leave_the_waiting_uncalibrated() -> None:
    est = estimator(**SLOW)
    hw = hardware(**SLOW)
    t = 0.0
    for i in range(30):
        r = make_request(i, input_tokens=1000, replay_output_tokens=80)
        est.estimate_requests(instance(), waiting([r]), 0.0, remember=True)  # alone: no queue
        t += 2.0 * (1000 * hw.input_token_work_s + 80 / hw.throughput_tps)
        est.observe(r, output_tokens=80, finish_s=t)
    wait, work = wait_of_third(est)
    assert wait == pytest.approx(work, rel=1e-9)


# --- the profile file ----------------------------------------------------------------------------


def test_a_profile_survives_a_json_round_trip() -> None:
    profile = RctProfile(
        hardware={
            h.key: h
            for h in (
                hardware("m", source="hand-made", **KV),
                hardware("n", gpu_count=2, prefill_per_token_s=1 / 3, throughput_tps=1e4 / 7),
            )
        },
        output_priors={"default": PRIOR, "m": NIG(mu=5.1234567891, kappa=3.0, alpha=2.5, beta=0.1)},
    )
    text = dump_profile(profile)
    assert parse_profile(text, "p.json") == profile
    assert dump_profile(parse_profile(text)) == text


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("not json at all", id="not-json"),
        pytest.param("[1, 2]", id="a-list"),
        pytest.param('{"version": 99, "hardware": []}', id="wrong-version"),
        pytest.param('{"version": 1, "hardware": [{"model": "m"}]}', id="missing-fields"),
        pytest.param('{"version": 1, "hardware": [3]}', id="hardware-not-an-object"),
        pytest.param('{"version": 1, "output_priors": []}', id="priors-not-a-mapping"),
        pytest.param(
            '{"version": 1, "output_priors": {"x": {"mu": 1, "kappa": 1, "alpha": 0.5, "beta": 1}}}',
            id="invalid-prior",
        ),
        pytest.param(
            json.dumps({"version": 1, "hardware": [asdict(hardware(throughput_tps=1.0))]}).replace(
                '"throughput_tps": 1.0', '"throughput_tps": 0.0'
            ),
            id="invalid-hardware-value",
        ),
        pytest.param(
            json.dumps(
                {"version": 1, "hardware": [asdict(hardware(max_num_batched_tokens=7))]}
            ).replace('"max_num_batched_tokens": 7', '"max_num_batched_tokens": -1'),
            id="negative-token-budget",
        ),
    ],
)
def test_a_broken_profile_is_refused_naming_its_file(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^/etc/qlm/rct\.json: "):
        parse_profile(text, "/etc/qlm/rct.json")


# --- the real simulated engine -------------------------------------------------------------------


def test_profiling_the_simulated_a100_gives_sane_values() -> None:
    perf = default_catalog().perf_model("llama-3-8b", "A100", 1)
    hw = profile_sim_hardware(perf)
    assert hw.key == ("llama-3-8b", "A100", 1)
    assert hw.max_num_batched_tokens == 2048  # vLLM's online-serving default on an A100
    assert 0 < hw.decode_alone_s < hw.decode_per_token_s
    assert hw.throughput_tps > 0
    per_token_s = perf.step.per_token_ms / 1000
    assert per_token_s / 2 <= hw.prefill_per_token_s <= 2 * per_token_s
    assert hw.max_num_seqs == 256
    assert hw.inefficiency >= 1.0
    assert 0 < hw.warm_load_s < hw.cold_load_s
    # Saturated throughput is about a full batch over the time per token of a full batch.
    assert hw.throughput_tps == pytest.approx(hw.saturation_batch / hw.decode_per_token_s, rel=0.5)
    assert math.isfinite(hw.prefill_base_s) and hw.prefill_base_s >= 0
    # Decode attention: what a token of context adds to a step, measured from two requests
    # decoding alone after prompts of 1,024 and 4,096 tokens.
    assert hw.decode_per_ctx_token_s == pytest.approx(perf.step.per_ctx_token_ms / 1000, rel=0.05)
    assert hw.decode_ctx_tokens == 1024 + 256 / 2


def test_estimating_only_the_newest_request_gives_the_same_answer_as_estimating_all() -> None:
    est = estimator()
    running = [Queued(make_request(i), generated=10 * i, running=True) for i in range(3)]
    queue = [*running, *waiting([make_request(10 + i, input_tokens=300 * i + 1) for i in range(6)])]
    everyone = est.estimate_requests(instance(), queue, NOW)
    assert est.estimate_requests(instance(), queue, NOW, only=[-1]) == [everyone[-1]]
    assert est.estimate_requests(instance(), queue, NOW, only=[0, 4]) == [everyone[0], everyone[4]]


def test_running_requests_of_every_prompt_bin_count_in_the_class_wide_belief() -> None:
    # By prompt length: 50 long-prompt requests run, 300 tokens in, before any of their prompt
    # bin completes; a short-prompt request completes. The class-wide belief (what a prompt
    # length never seen falls back on) still counts the 50.
    est = RCTEstimator(estimator().profile, by_prompt=True)
    running = [
        Queued(make_request(i, input_tokens=1100), generated=300, running=True) for i in range(50)
    ]
    est.estimate_requests(instance(), running, NOW)
    unseen = make_request(99, input_tokens=5000)
    before = est.expected_output(unseen)
    est.observe(make_request(100, input_tokens=120), output_tokens=20)
    assert est.expected_output(unseen) > before


# --- decode speed and the KV footprint -----------------------------------------------------------


def test_decode_time_counts_the_context_of_the_batch_beyond_the_profiles() -> None:
    hw = hardware(**KV)
    # At the profile's own context per request, the batch size alone decides ...
    assert hw.decode_s(4, 4 * 1000.0) == pytest.approx(hw.decode_s(4), rel=1e-12)
    # ... and every token of context beyond it adds its read.
    assert hw.decode_s(2, 50_000.0) == pytest.approx(hw.decode_s(2) + 1e-7 * 48_000, rel=1e-12)
    # A profile without the measurement ignores the context.
    assert hardware().decode_s(2, 50_000.0) == hardware().decode_s(2)


def test_a_batch_that_fills_the_kv_cache_decodes_at_the_speed_of_a_full_cache() -> None:
    est = estimator(**KV)
    hw = hardware(**KV)

    def per_token(prompt: int) -> float:
        running = [Queued(make_request(i, input_tokens=prompt), running=True) for i in range(3)]
        queue = [*running, Queued(make_request(3, input_tokens=prompt))]
        (new,) = est.estimate_requests(instance(), queue, NOW, only=[-1])
        return new.per_token_s

    m, _ = est.output_moments(make_request(0))
    # Short prompts: four requests of ~535 tokens of context each (prompt and half the output).
    short = (hw.decode_s(4) + 1e-7 * (4 * (500 + m / 2) - 4 * 1000)) * hw.inefficiency
    assert per_token(500) == pytest.approx(short, rel=1e-9)
    # Prompts of 20,000 tokens: four of them fill the 100,000-token cache, which then stays full.
    full = (hw.decode_s(4) + 1e-7 * (100_000 - 4 * 1000)) * hw.inefficiency
    assert per_token(20_000) == pytest.approx(full, rel=1e-9)


def test_requests_arriving_faster_than_served_are_predicted_to_decode_in_a_full_batch() -> None:
    """An instance about to saturate: whatever batch a request finds, it decodes in a full one,
    with the prompts of the requests that keep it full interleaved — unless the planner pulls
    requests, and so decides how full the batch gets."""
    est = estimator()
    hw = hardware()
    running = Queued(make_request(0, input_tokens=1000), running=True)
    req = make_request(1, input_tokens=1000)
    (calm,) = est.estimate_requests(instance(), [running, Queued(req)], NOW, only=[-1])
    assert calm.per_token_s == pytest.approx(hw.decode_s(2) * hw.inefficiency, rel=1e-9)
    for k in range(10):  # 100 requests per second, ~0.085 s of work each: 8.5 times too many
        burst = make_request(100 + k, input_tokens=1000)
        est.estimate_requests(instance(), waiting([burst]), NOW + 0.01 * k, remember=True)
    (busy,) = est.estimate_requests(instance(), [running, Queued(req)], NOW + 0.1, only=[-1])
    m, _ = est.output_moments(req)
    refill = 1000 * hw.input_token_work_s / m  # prompt work per output token of the mix
    slots = hw.max_num_seqs
    expected = (hw.decode_s(slots) + slots * refill) * hw.inefficiency
    assert busy.per_token_s == pytest.approx(expected, rel=1e-9)
    # Pulled from a virtual queue, it decodes in the batch the planner keeps: the one it joins.
    (pulled,) = est.estimate_requests(
        instance(), [running, Queued(req)], NOW + 0.1, only=[-1], refilled=True
    )
    assert pulled.per_token_s == pytest.approx(
        (hw.decode_s(2) + 2 * refill) * hw.inefficiency, rel=1e-9
    )


def test_the_decode_speed_calibration_forgets_the_profile_as_evidence_accumulates() -> None:
    """Requests that all decode 1.5 times slower than predicted: the profile's pseudo-evidence
    holds the factor back at first and is forgotten like any old observation after that."""
    est = estimator()
    probe = make_request(0, arrival_s=NOW, input_tokens=500)
    (profile,) = est.estimate_requests(instance(), waiting([probe]), NOW)
    actual = 1.5 * profile.per_token_s  # the instance's true time per token

    def run(n: int, start: int) -> None:
        for i in range(start, start + n):
            r = make_request(i, arrival_s=NOW, input_tokens=500)
            (pred,) = est.estimate_requests(instance(), waiting([r]), NOW, remember=True)
            t0 = pred.start_mean
            est.observe(r, output_tokens=70, first_token_s=t0, finish_s=t0 + 69 * actual)

    run(20, 0)
    _, early = est.calibration_factors("i0")
    assert 1.0 < early < 1.25  # ~15 s of decode observed against 600 s of profile
    run(1500, 20)
    _, late = est.calibration_factors("i0")
    assert late == pytest.approx(1.5, rel=0.02)


def _speed_run(est: RCTEstimator, actual: Callable[[float], float], n: int) -> None:
    """``n`` requests arriving 10 s apart onto an instance running 0 or 40 others, each decoding
    at ``actual(predicted time per token)``."""
    for i in range(n):
        others = [Queued(make_request(10_000 + k), running=True) for k in range(40 * (i % 2))]
        r = make_request(i, arrival_s=NOW + 10 * i, input_tokens=500)
        (pred,) = est.estimate_requests(
            instance(), [*others, Queued(r)], NOW + 10 * i, remember=True, only=[-1]
        )
        t0 = pred.start_mean
        est.observe(
            r, output_tokens=70, first_token_s=t0, finish_s=t0 + 69 * actual(pred.per_token_s)
        )


def _per_token(est: RCTEstimator, running: int) -> float:
    others = [Queued(make_request(20_000 + k), running=True) for k in range(running)]
    probe = make_request(30_000, arrival_s=NOW, input_tokens=500)
    (e,) = est.estimate_requests(instance(), [*others, Queued(probe)], NOW, only=[-1])
    return e.per_token_s


def test_a_departure_from_the_usual_speed_that_never_comes_true_is_regressed_away() -> None:
    """The state on arrival (alone, or behind 40 running requests) predicts different speeds, but
    every request decodes at the same one (the batch turned over while it ran): the estimator
    learns that the departures do not come true and predicts close to the recent mean."""
    est = estimator()
    alone, crowded = _per_token(est, 0), _per_token(est, 40)
    assert crowded > 1.5 * alone  # the profile's prediction from the state
    typical = math.sqrt(alone * crowded)
    _speed_run(est, lambda _: typical, 400)
    shrunk_alone, shrunk_crowded = _per_token(est, 0), _per_token(est, 40)
    assert shrunk_crowded / shrunk_alone < 1.1
    assert alone < shrunk_alone < shrunk_crowded < crowded


def test_departures_that_come_true_are_kept() -> None:
    """Same states, but each request decodes at the speed its state predicted: nothing to regress."""
    est = estimator()
    alone, crowded = _per_token(est, 0), _per_token(est, 40)
    _speed_run(est, lambda predicted: predicted, 400)
    # ε learns nothing (the profile was right); the ratio of the two predictions is untouched.
    assert _per_token(est, 40) / _per_token(est, 0) == pytest.approx(crowded / alone, rel=0.02)


def test_running_requests_all_decode_in_the_batch_they_share() -> None:
    """The first of five running requests decodes in the batch of five, not alone; a request
    admitted behind them in the batch of six."""
    est = estimator()
    hw = hardware()
    queue = [Queued(make_request(k), running=True) for k in range(5)] + waiting([make_request(9)])
    estimates = est.estimate_requests(instance(), queue, NOW)
    for e in estimates[:5]:
        assert e.per_token_s == pytest.approx(
            hw.decode_s(5, 5 * hw.decode_ctx_tokens) * hw.inefficiency, rel=0.05
        )
    assert estimates[5].per_token_s > estimates[0].per_token_s


def test_the_batch_a_token_budget_sustains_is_the_budget_over_one_plus_prompt_per_output() -> None:
    """Azure conv's mix (1,155-token prompts, 211-token answers) on an A100's 2,048 tokens per
    step: each step decodes B tokens and prefills B · 1155 / 211 of the prompts replacing them."""
    hw = hardware(max_num_batched_tokens=2048)
    refill = 1155 * hw.input_token_work_s / 211
    assert sustained_batch(hw, refill) == pytest.approx(2048 / (1 + 1155 / 211), rel=1e-12)
    assert sustained_batch(hardware(), refill) == math.inf  # budget unknown


def test_a_busy_instance_whose_budget_goes_to_prompts_runs_fewer_requests_than_its_slots() -> None:
    """Eight slots, 1,000-token prompts, ~70-token outputs, 64 tokens per step: the budget
    sustains four running requests. With four running and seven waiting, a new request decodes
    in the batch of four (refilled as they finish), not of eight."""
    free_est, tight_est = estimator(), estimator(max_num_batched_tokens=64)
    queue = [Queued(make_request(k, input_tokens=1000), running=True) for k in range(4)]
    queue += waiting([make_request(10 + k, input_tokens=1000) for k in range(7)])
    (free,) = free_est.estimate_requests(instance(), queue, NOW, only=[-1])
    (tight,) = tight_est.estimate_requests(instance(), queue, NOW, only=[-1])
    hw = hardware()
    m, _ = free_est.output_moments(queue[-1].request)
    refill = 1000 * hw.input_token_work_s / m
    assert int(sustained_batch(hardware(max_num_batched_tokens=64), refill)) == 4
    assert free.per_token_s == pytest.approx(
        (hw.decode_s(8) + 8 * refill) * hw.inefficiency, rel=1e-9
    )
    assert tight.per_token_s == pytest.approx(
        (hw.decode_s(4) + 4 * refill) * hw.inefficiency, rel=1e-9
    )


def test_slow_decodes_during_a_fill_teach_the_fill_not_the_full_batch() -> None:
    """Requests that arrive while the batch fills (two of eight slots running, others waiting to
    be admitted) decode 1.5 times slower than the profile says — each step also prefills the
    prompts being admitted. They teach the factor for requests arriving in a fill; the factor of
    the full batch, which the planner uses, stays the profile's."""
    est = estimator()
    running = [Queued(make_request(1000 + k, input_tokens=500), running=True) for k in range(2)]
    ahead = waiting([make_request(2000 + k, input_tokens=500) for k in range(3)])
    probe = make_request(9999, arrival_s=NOW, input_tokens=500)
    (before,) = est.estimate_requests(instance(), [*running, *ahead, Queued(probe)], NOW, only=[-1])
    for i in range(1500):
        r = make_request(i, arrival_s=NOW, input_tokens=500)
        (pred,) = est.estimate_requests(
            instance(), [*running, *ahead, Queued(r)], NOW, remember=True, only=[-1]
        )
        t0 = pred.start_mean
        est.observe(
            r, output_tokens=70, first_token_s=t0, finish_s=t0 + 69 * 1.5 * before.per_token_s
        )
    _, full_batch = est.calibration_factors("i0")
    assert full_batch == pytest.approx(1.0)
    (after,) = est.estimate_requests(instance(), [*running, *ahead, Queued(probe)], NOW, only=[-1])
    assert after.per_token_s == pytest.approx(1.5 * before.per_token_s, rel=0.03)


def test_a_request_admitted_while_the_batch_fills_decodes_its_first_tokens_in_full_steps() -> None:
    """Two of eight slots running, four waiting with 3,000-token prompts, 4,000 tokens per step:
    until the batch is full every step also prefills the prompts being admitted, so the newest
    request's first ``(8 − 6) · 3000 / (4000 − 6)`` tokens take ``d(6) + 3994 · w_in`` each."""
    hw = hardware(max_num_batched_tokens=4000)
    queue = [Queued(make_request(k, input_tokens=3000), running=True) for k in range(2)]
    queue += waiting([make_request(10 + k, input_tokens=3000) for k in range(4)])
    est = estimator(max_num_batched_tokens=4000)
    (e,) = est.estimate_requests(instance(), queue, NOW, only=[-1])
    m, _ = est.output_moments(queue[-1].request)
    steady = hw.decode_s(6) + 6 * 3000 * hw.input_token_work_s / m
    fill_steps = 2 * 3000 / (4000 - 6)
    t_fill = hw.decode_s(6) + (4000 - 6) * hw.input_token_work_s
    expected = steady + fill_steps / m * (t_fill - steady)
    assert e.per_token_s == pytest.approx(expected * hw.inefficiency, rel=1e-9)
    # Unknown budget: no fill steps.
    (plain,) = estimator().estimate_requests(instance(), queue, NOW, only=[-1])
    assert plain.per_token_s == pytest.approx(steady * hw.inefficiency, rel=1e-9)


def test_a_scan_cut_short_by_an_error_is_not_reused() -> None:
    reqs = [make_request(i, input_tokens=100 + 10 * i, model="mmmmn"[i]) for i in range(5)]
    running = [Queued(r, 3, running=True) for r in reqs[:3]]
    est = estimator()
    est.estimate_requests(instance(), running, NOW)
    real = est.beliefs.output_moments

    def failing(request: Request, generated: int = 0) -> tuple[float, float]:
        if request is reqs[3]:
            raise RuntimeError("no belief")
        return real(request, generated)

    est.beliefs.output_moments = failing  # type: ignore[method-assign]
    queue = [*running, Queued(reqs[3]), Queued(reqs[4])]
    with pytest.raises(RuntimeError):
        est.estimate_requests(instance(), queue, NOW)
    del est.beliefs.output_moments
    assert est.estimate_requests(instance(), queue, NOW) == estimator().estimate_requests(
        instance(), queue, NOW
    )


def test_the_censored_belief_built_when_read_is_the_one_built_at_each_completion() -> None:
    """Completions mark the class's belief (with its running requests censored) for rebuilding
    when next read; rebuilding it at every completion instead gives the same estimates through
    any mix of completions, cancellations and new running requests."""
    rng = np.random.default_rng(7)
    reqs = [make_request(i, input_tokens=int(rng.integers(50, 2000))) for i in range(40)]
    lazy, eager = estimator(), estimator()
    running: list[Request] = []
    waiting_reqs = list(reqs)
    for step in range(80):
        for action in rng.integers(0, 3, size=3):  # a few events between two estimates
            if action == 0 and waiting_reqs:
                running.append(waiting_reqs.pop(0))  # starts running
            elif action == 1 and running:
                done = running.pop(int(rng.integers(0, len(running))))
                out = int(rng.integers(1, 900))
                lazy.observe(done, output_tokens=out)
                eager.observe(done, output_tokens=out)
                eager.beliefs.censor_all()
            elif running:
                gone = running.pop(int(rng.integers(0, len(running))))
                lazy.forget([gone.id])
                eager.forget([gone.id])
        queue = [Queued(r, int(rng.integers(0, 50)), running=True) for r in running]
        queue.append(Queued(reqs[-1]))
        assert lazy.estimate_requests(instance(), queue, NOW) == eager.estimate_requests(
            instance(), queue, NOW
        ), f"step {step}"


@pytest.mark.parametrize("by_prompt", [False, True])
def test_group_loads_are_group_load_of_each_group_to_the_last_bit(by_prompt: bool) -> None:
    est = RCTEstimator(estimator().profile, by_prompt=by_prompt)
    # the same beliefs, its own caches: group_load there prices each request's moments alone
    ref = RCTEstimator(estimator().profile, by_prompt=by_prompt)
    rng = np.random.default_rng(7)
    for k in range(40):  # beliefs learnt from completions, so that the moments differ by class
        done = make_request(
            k, slo_class=("a", "b")[k % 2], input_tokens=int(rng.integers(10, 4000))
        )
        output = int(rng.integers(1, 900))
        est.observe(done, output_tokens=output)
        ref.observe(done, output_tokens=output)
    groups = []
    for g in range(12):
        size = int(rng.integers(1, 9))
        requests = tuple(
            make_request(
                100 * g + j,
                slo_class=("a", "b")[g % 2],
                input_tokens=int(rng.integers(10, 4000)),
                max_tokens=int(rng.choice([300, 1000])),
                arrival_s=float(rng.uniform(0, 50)),
                slo=SLO(e2e_s=30.0, ttft_s=None if j % 3 else 2.0),
            )
            for j in range(size)
        )
        groups.append((f"g{g}", requests))
    for _ in range(2):  # computed, then from what is kept
        loads = est.group_loads(groups)
        for k, (gid, requests) in enumerate(groups):
            one = ref.group_load(gid, requests)
            assert_same_load(loads, k, one)
    assert len(est.group_loads([]).size) == 0


@pytest.mark.parametrize("seed", range(4))
def test_group_loads_kept_through_random_churn_are_a_rebuild_to_the_last_bit(seed: int) -> None:
    """Groups grow at the tail, lose their head, end, start, reorder and arrive as lists, and
    completions move the beliefs: what ``group_loads`` keeps per group always gives the numbers
    a fresh estimator with the same beliefs computes from the requests."""
    rng = np.random.default_rng(seed)
    est = RCTEstimator(estimator().profile, by_prompt=seed % 2 == 1)
    beliefs: list[tuple[Request, int]] = []  # the completions, replayed into each fresh one
    serial = iter(range(10**6))

    def request(g: int) -> Request:
        return make_request(
            next(serial),
            slo_class=("a", "b")[g % 2],
            input_tokens=int(rng.integers(10, 4000)),
            max_tokens=int(rng.choice([100, 300, 1000, 2048])),
            arrival_s=float(rng.uniform(0, 50)),
            slo=SLO(e2e_s=30.0, ttft_s=None if rng.random() < 0.7 else 2.0),
        )

    groups: dict[str, tuple[Request, ...]] = {
        f"g{g}": tuple(request(g) for _ in range(int(rng.integers(1, 9)))) for g in range(10)
    }
    made = len(groups)
    for _ in range(25):
        for gid in list(groups):
            change = rng.random()
            if change < 0.2:
                groups[gid] = (*groups[gid], request(int(gid[1:])))
            elif change < 0.35 and len(groups[gid]) > 1:
                groups[gid] = groups[gid][1:]
            elif change < 0.42:
                del groups[gid]
        for _ in range(int(rng.integers(0, 3))):
            groups[f"g{made}"] = tuple(request(made) for _ in range(int(rng.integers(1, 6))))
            made += 1
        if rng.random() < 0.5:
            done = request(int(rng.integers(0, 2)))
            output = int(rng.integers(1, 900))
            est.observe(done, output_tokens=output)
            beliefs.append((done, output))
        order = list(groups)
        rng.shuffle(order)
        named: list[tuple[str, Sequence[Request]]] = [
            (gid, list(groups[gid]) if rng.random() < 0.1 else groups[gid]) for gid in order
        ]
        est.keep_group_loads(order)
        loads = est.group_loads(named)
        fresh = RCTEstimator(estimator().profile, by_prompt=seed % 2 == 1)
        for done, output in beliefs:
            fresh.observe(done, output_tokens=output)
        for k, (gid, requests) in enumerate(named):
            one = fresh.group_load(gid, list(requests))  # (a list: summed from scratch)
            assert loads.group_ids[k] == gid
            assert_same_load(loads, k, one)
