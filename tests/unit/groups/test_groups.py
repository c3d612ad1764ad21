"""Request groups: Algorithm 1 (k-means, split to δ × batch), online classification, re-clustering."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from builders import make_request

from qlm.domain import SLO, Request, Tier
from qlm.errors import ConfigError, GroupError
from qlm.groups import Grouper, GroupingConfig, clustering, default_predict_output
from qlm.groups import grouper as grouper_module
from qlm.groups.clustering import split_half
from qlm.groups.features import group_key, predict_outputs, raw_features
from qlm.groups.grouper import _fcfs
from qlm.groups.waiting import WaitingRequests

SMALL = GroupingConfig(delta=2.0, avg_batch_size=8, deadline_window=0)
NO_WINDOW = GroupingConfig(
    deadline_window=0
)  # these tests spread arrivals over time  # groups of at most 16


def members(grouper: Grouper, gid: str) -> list[str]:
    return [r.id for r in grouper.group(gid).requests]


def mixed_requests(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        make_request(
            i,
            model=rng.choice(["m", "n", "o"]),
            tier=rng.choice(list(Tier)),
            input_tokens=rng.randint(1, 4000),
            max_tokens=rng.randint(1, 2000),
            arrival_s=rng.uniform(0, 100),
            slo=SLO(e2e_s=rng.choice([10.0, 20.0, 60.0, 300.0])),
        )
        for i in range(n)
    ]


# --- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("delta", 0.0),
        ("delta", float("nan")),
        ("avg_batch_size", 0.5),
        ("max_clusters_per_model", 0),
        ("slo_ratio", 0.9),
        ("input_ratio", 0.5),
        ("recluster_interval_s", 0.0),
        ("drift_factor", 1.0),
        ("max_new_group_fraction", 0.0),
        ("keep_id_overlap", 1.5),
        ("kmeans_sample", 1),
        ("kmeans_max_iter", 0),
    ],
)
def test_invalid_grouping_setting_raises_config_error_naming_the_field(
    field: str, value: float
) -> None:
    with pytest.raises(ConfigError, match=f"grouping.{field} must be"):
        GroupingConfig(**{field: value})  # type: ignore[arg-type]


def test_group_size_bound_is_delta_times_average_batch_size() -> None:
    assert GroupingConfig().max_group_size == 128
    assert GroupingConfig(delta=1.5, avg_batch_size=7).max_group_size == 10
    assert GroupingConfig(delta=0.1, avg_batch_size=1).max_group_size == 1


# --- Algorithm 1 -----------------------------------------------------------------------------


def test_split_half_gives_fcfs_runs_as_repeated_halving_would() -> None:
    parts = split_half(np.arange(40), 16)  # 40 -> 20 + 20 -> 4 x 10
    assert [p.tolist() for p in parts] == [list(range(i, i + 10)) for i in (0, 10, 20, 30)]
    assert [len(p) for p in split_half(np.arange(5), 2)] == [2, 1, 1, 1]  # older side first
    assert [len(p) for p in split_half(np.arange(16), 16)] == [16]


def test_split_half_moves_a_cut_to_a_nearby_boundary_of_the_previous_groups() -> None:
    anchors = np.array([0] * 16 + [1] * 16 + [2] * 8)
    parts = split_half(np.arange(40), 16, anchors)
    # Ideal cuts 10, 20, 30; only 30 has a previous boundary (32) within a quarter run (2).
    assert [(int(p[0]), int(p[-1])) for p in parts] == [(0, 9), (10, 19), (20, 31), (32, 39)]


def test_split_half_respects_the_bound_keeps_fcfs_order_and_is_stable() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        m, bound = int(rng.integers(1, 400)), int(rng.integers(1, 40))
        anchors = np.sort(rng.integers(0, 30, size=m))
        parts = split_half(np.arange(m), bound, anchors)
        assert max(len(p) for p in parts) <= bound and min(len(p) for p in parts) >= 1, (m, bound)
        assert np.concatenate(parts).tolist() == list(range(m))
        own = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
        again = split_half(np.arange(m), bound, own)  # splitting again changes nothing
        assert [p.tolist() for p in again] == [p.tolist() for p in parts], (m, bound)


def test_reclustering_identical_requests_gives_fcfs_runs_within_the_bound() -> None:
    grouper = Grouper(SMALL)
    for i in range(40):
        grouper.add(make_request(i), now=i)  # online: 16 + 16 + 8
    result = grouper.recluster(now=40)  # one cluster of 40: runs of 10, 10, 12, 8
    assert [members(grouper, gid)[0] for gid in grouper.group_ids()] == [
        "r0000",
        "r0020",
        "r0032",
        "r0010",
    ]
    assert (result.kept, result.created, result.removed) == (("g1", "g2", "g3"), ("g4",), ())
    assert members(grouper, "g2") == [f"r{i:04d}" for i in range(20, 32)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_group_respects_delta_times_average_batch_after_reclustering(seed: int) -> None:
    grouper = Grouper(SMALL)
    for r in mixed_requests(600, seed):
        grouper.add(r, now=0)
    grouper.recluster(now=1)
    assert sum(g.size for g in grouper.groups()) == 600
    assert max(g.size for g in grouper.groups()) <= 16


def test_online_classification_fills_groups_only_up_to_the_bound() -> None:
    grouper = Grouper(SMALL)
    for i in range(100):
        grouper.add(make_request(i), now=i)
    assert sorted(g.size for g in grouper.groups()) == [4, 16, 16, 16, 16, 16, 16]


def test_kmeans_separates_short_requests_from_long_ones_of_the_same_class() -> None:
    grouper = Grouper(
        GroupingConfig(delta=4, avg_batch_size=8, deadline_window=0)
    )  # k = ceil(120 / 32) = 4
    for i in range(120):
        if i % 2:
            r = make_request(i, input_tokens=40 + i % 7, max_tokens=32)
        else:
            r = make_request(i, input_tokens=4000 + i, max_tokens=2000)
        grouper.add(r, now=0)
    grouper.recluster(now=1)
    assert len(grouper) >= 2
    for group in grouper.groups():
        assert len({r.input_tokens > 1000 for r in group.requests}) == 1, group.id


def test_short_interactive_and_long_batch_requests_never_share_a_group() -> None:
    grouper = Grouper(NO_WINDOW)
    for i in range(200):
        if i % 2:
            r = make_request(i, tier=Tier.INTERACTIVE, slo=SLO(20.0), input_tokens=100)
        else:
            r = make_request(i, tier=Tier.BATCH, slo=SLO(300.0), input_tokens=3000)
        grouper.add(r, now=0)
    for _ in range(2):  # online, then after re-clustering
        assert len(grouper) == 2
        for group in grouper.groups():
            assert {r.tier for r in group.requests} == {group.tier}
        grouper.recluster(now=1)


def test_requests_with_very_different_deadlines_never_share_a_group() -> None:
    grouper = Grouper(NO_WINDOW)  # same model, tier and class: only the deadline differs
    for i in range(20):
        grouper.add(make_request(i, slo=SLO(10.0 if i % 2 else 600.0)), now=0)
    for _ in range(2):
        assert len(grouper) == 2
        for group in grouper.groups():
            assert len({r.slo.e2e_s for r in group.requests}) == 1
        grouper.recluster(now=1)


def test_deadlines_within_the_slo_ratio_may_share_a_group() -> None:
    grouper = Grouper(GroupingConfig(slo_ratio=2.0, deadline_window=0))
    first = grouper.add(make_request(0, slo=SLO(30.0)), now=0)
    assert grouper.add(make_request(1, slo=SLO(50.0)), now=0) == first
    assert grouper.add(make_request(2, slo=SLO(70.0)), now=0) != first  # 70 / 30 > 2


def test_prompts_within_the_input_ratio_may_share_a_group() -> None:
    grouper = Grouper(GroupingConfig(input_ratio=3.0, deadline_window=0))
    first = grouper.add(make_request(0, input_tokens=1000), now=0)
    assert grouper.add(make_request(1, input_tokens=2500), now=0) == first
    assert grouper.add(make_request(2, input_tokens=4000), now=0) != first  # 4001 / 1001 > 3
    off = Grouper(GroupingConfig(input_ratio=1e9, deadline_window=0))
    first = off.add(make_request(0, input_tokens=10), now=0)
    assert off.add(make_request(1, input_tokens=8000), now=0) == first


@pytest.mark.parametrize("seed", [0, 1])
def test_no_group_spreads_its_prompts_beyond_the_input_ratio(seed: int) -> None:
    rng = random.Random(seed)
    grouper = Grouper(dataclasses.replace(SMALL, input_ratio=2.0))
    for i, r in enumerate(mixed_requests(500, seed)):
        grouper.add(r, now=i)
        if rng.random() < 0.2:
            grouper.remove(f"r{rng.randrange(i + 1):04d}")
    for when in ("online", "reclustered"):
        if when == "reclustered":
            grouper.recluster(now=500)
        for group in grouper.groups():
            sizes = [1 + r.input_tokens for r in group.requests]
            assert max(sizes) / min(sizes) <= 2.0 + 1e-9, (when, group.id, sizes)


@pytest.mark.parametrize("seed", [0, 1])
def test_online_classification_never_mixes_models_tiers_or_slo_classes(seed: int) -> None:
    rng = random.Random(seed)
    grouper = Grouper(SMALL)
    for i, r in enumerate(mixed_requests(500, seed)):
        grouper.add(r, now=i)
        if rng.random() < 0.2:
            grouper.remove(f"r{rng.randrange(i + 1):04d}")
        if i == 250:
            grouper.recluster(now=i)
    for group in grouper.groups():
        assert {(r.model, r.tier, r.slo_class) for r in group.requests} == {
            (group.model, group.tier, group.slo_class)
        }


def test_a_new_request_joins_the_nearest_compatible_group() -> None:
    grouper = Grouper(
        GroupingConfig(delta=4, avg_batch_size=8, deadline_window=0)
    )  # 40 requests: k = 2
    for i in range(40):
        grouper.add(make_request(i, input_tokens=50 if i % 2 else 5000), now=0)
    grouper.recluster(now=1)
    short, long = grouper.group_of("r0001"), grouper.group_of("r0000")
    assert short != long
    assert grouper.add(make_request(100, input_tokens=80), now=2) == short
    assert grouper.add(make_request(101, input_tokens=3000), now=2) == long


def _classify_all(
    monkeypatch: pytest.MonkeyPatch, scalar_rows: int, requests: list[Request], seed: int
) -> tuple[list[str], float]:
    """Every request's group as ``add`` classifies it (some removed and re-clustered between),
    comparing at most ``scalar_rows`` groups in Python floats; and the drift's distance sum."""
    monkeypatch.setattr(grouper_module, "SCALAR_ROWS", scalar_rows)
    rng = random.Random(seed)
    grouper = Grouper(GroupingConfig(delta=2.0, avg_batch_size=4, deadline_window=0.25))
    joined = []
    for k, request in enumerate(requests):
        joined.append(grouper.add(request, now=k))
        if rng.random() < 0.2:
            grouper.remove(rng.choice(requests[: k + 1]).id)
        if k % 150 == 149:
            grouper.recluster(now=k)
    return joined, grouper._online_distance_sum


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_classification_in_python_floats_chooses_as_the_numpy_pass(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    requests = mixed_requests(600, seed)
    numpy_pass = _classify_all(monkeypatch, 0, requests, seed)
    python_floats = _classify_all(monkeypatch, 10**9, requests, seed)
    assert python_floats == numpy_pass


# --- FCFS, membership, summaries ---------------------------------------------------------------


def test_requests_inside_a_group_are_served_first_come_first_served() -> None:
    grouper = Grouper(NO_WINDOW)
    arrivals = [5.0, 1.0, 3.0, 1.0, 4.0]
    for i, t in reversed(list(enumerate(arrivals))):
        gid = grouper.add(make_request(i, arrival_s=t), now=10)
    assert len(grouper) == 1
    assert grouper.peek(gid).id == "r0001"
    served = [grouper.pop(gid).id for _ in arrivals]
    assert served == ["r0001", "r0003", "r0002", "r0004", "r0000"]
    assert len(grouper) == 0


def test_removing_a_groups_last_request_makes_the_group_disappear() -> None:
    grouper = Grouper(NO_WINDOW)
    gid = grouper.add(make_request(0), now=0)
    grouper.add(make_request(1), now=0)
    assert grouper.remove("r0000") == gid
    assert grouper.has_group(gid)
    assert grouper.remove("r0001") == gid
    assert not grouper.has_group(gid)
    assert grouper.remove("r0001") is None
    assert grouper.group_of("r0001") is None
    other = grouper.add(make_request(2), now=1)
    assert grouper.has_groups([other]) and grouper.has_groups([])
    assert not grouper.has_groups([other, gid])
    with pytest.raises(GroupError, match=f"unknown group '{gid}'"):
        grouper.group(gid)


def test_adding_a_waiting_request_again_raises() -> None:
    grouper = Grouper(NO_WINDOW)
    gid = grouper.add(make_request(0), now=0)
    with pytest.raises(GroupError, match=f"already in group {gid}"):
        grouper.add(make_request(0), now=1)


def test_group_summaries_are_what_the_estimator_needs() -> None:
    grouper = Grouper(predict_output=lambda r: r.max_tokens / 2)
    gid = grouper.add(make_request(0, input_tokens=100, max_tokens=40, slo=SLO(30.0, 2.0)), 0)
    grouper.add(make_request(1, input_tokens=300, max_tokens=60, slo=SLO(30.0, 3.0)), 0)
    group = grouper.group(gid)
    assert (group.size, group.input_tokens) == (2, 400)
    assert group.predicted_output_tokens == pytest.approx(50.0)
    assert group.earliest_deadline_s == 30.0  # r0000 arrives at 0 with a 30 s SLO
    assert (group.min_e2e_slo_s, group.min_ttft_slo_s) == (30.0, 2.0)
    assert (group.model, group.tier, group.slo_class) == ("m", Tier.STANDARD, "default")
    assert len(group.centroid) == 4
    assert grouper.group(gid) is group  # cached until the group changes
    grouper.pop(gid)
    assert grouper.group(gid).input_tokens == 300


def test_predicted_output_is_clamped_to_max_tokens() -> None:
    grouper = Grouper(predict_output=lambda r: 10_000.0)
    gid = grouper.add(make_request(0, max_tokens=64), now=0)
    assert grouper.group(gid).predicted_output_tokens == pytest.approx(64.0)
    assert default_predict_output(make_request(0, max_tokens=5000)) == 256.0


# --- re-clustering -----------------------------------------------------------------------------


def test_reclustering_an_unchanged_population_keeps_every_group_id() -> None:
    grouper = Grouper(SMALL)
    for r in mixed_requests(400, seed=3):
        grouper.add(r, now=0)
    grouper.recluster(now=1)
    before = {gid: members(grouper, gid) for gid in grouper.group_ids()}
    result = grouper.recluster(now=2)
    assert (result.created, result.removed) == ((), ())
    assert set(result.kept) == set(before)
    assert {gid: members(grouper, gid) for gid in grouper.group_ids()} == before


def test_reclustering_reports_kept_created_and_removed_ids() -> None:
    grouper = Grouper(SMALL)
    for i in range(20):
        grouper.add(make_request(i), now=i)  # identical: g1 takes 16, g2 the last 4
    assert [g.size for g in grouper.groups()] == [16, 4]
    result = grouper.recluster(now=20)  # one cluster of 20, split into 10 + 10
    # r0-9 are 10 of g1's 16 (>= half of the larger): g1 kept. r10-19 share 6 with g1, 4 with g2:
    # neither reaches half of the larger group, so they form a new group and g2 is gone.
    assert result.kept == ("g1",)
    assert result.created == ("g3",)
    assert result.removed == ("g2",)
    assert members(grouper, "g1") == [f"r{i:04d}" for i in range(10)]
    assert members(grouper, "g3") == [f"r{i:04d}" for i in range(10, 20)]
    assert result.requests == 20


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reclustering_keeps_most_ids_when_a_few_requests_come_and_go(seed: int) -> None:
    rng = random.Random(seed)
    grouper = Grouper(SMALL)
    population = mixed_requests(400, seed=seed)
    for r in population[:380]:
        grouper.add(r, now=0)
    grouper.recluster(now=1)
    old = set(grouper.group_ids())
    for r in population[380:]:  # 5 % arrive, 5 % are dispatched
        grouper.add(r, now=2)
    for _ in range(20):
        grouper.pop(rng.choice(grouper.group_ids()))
    before = set(grouper.group_ids())
    result = grouper.recluster(now=3)
    assert len(result.kept) >= 0.85 * len(old)
    assert set(result.kept) | set(result.removed) == before
    assert set(result.kept) | set(result.created) == set(grouper.group_ids())
    assert not set(result.removed) & set(grouper.group_ids())


def test_a_batch_added_at_once_is_grouped_by_one_reclustering() -> None:
    grouper = Grouper(SMALL)
    result = grouper.add_many([make_request(i) for i in range(40)], now=40)
    # One cluster of 40 identical requests, halved into FCFS runs (no earlier group to prefer).
    assert [members(grouper, gid) for gid in grouper.group_ids()] == [
        [f"r{i:04d}" for i in range(k, k + 10)] for k in (0, 10, 20, 30)
    ]
    assert (result.kept, result.created, result.removed) == ((), grouper.group_ids(), ())
    assert result.requests == 40
    assert not grouper.needs_recluster(now=40)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_batch_added_to_held_groups_keeps_their_ids_and_every_bound(seed: int) -> None:
    grouper = Grouper(SMALL)
    population = mixed_requests(600, seed=seed)
    for r in population[:500]:
        grouper.add(r, now=0)
    grouper.recluster(now=1)
    before = set(grouper.group_ids())
    result = grouper.add_many(population[500:], now=2)
    assert grouper.num_requests == 600
    assert sum(g.size for g in grouper.groups()) == 600
    assert max(g.size for g in grouper.groups()) <= 16
    assert len(result.kept) >= 0.6 * len(before)
    assert set(result.kept) | set(result.removed) == before
    assert set(result.kept) | set(result.created) == set(grouper.group_ids())
    for g in grouper.groups():
        assert {(r.model, r.tier, r.slo_class) for r in g.requests} == {
            (g.model, g.tier, g.slo_class)
        }
        assert list(g.requests) == sorted(g.requests, key=_fcfs)
    for r in population:
        assert r in grouper.group(grouper.group_of(r.id) or "").requests


def test_a_batch_with_a_request_already_waiting_adds_nothing() -> None:
    grouper = Grouper(NO_WINDOW)
    grouper.add(make_request(0), now=0)
    with pytest.raises(GroupError, match="'r0000' is already waiting"):
        grouper.add_many([make_request(1), make_request(0)], now=1)
    with pytest.raises(GroupError, match="'r0002' is already waiting, or comes twice"):
        grouper.add_many([make_request(2), make_request(2)], now=1)
    assert grouper.num_requests == 1
    assert grouper.group_of("r0001") is None


def test_a_batch_whose_reclustering_fails_adds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    grouper = Grouper(NO_WINDOW)
    gid = grouper.add(make_request(0), now=0)

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("k-means failed")

    monkeypatch.setattr(grouper_module, "form_groups", fail)
    with pytest.raises(RuntimeError, match="k-means failed"):
        grouper.add_many([make_request(1), make_request(2)], now=1)
    assert grouper.num_requests == 1
    assert grouper.group_of("r0001") is None
    assert grouper.group_ids() == (gid,)
    monkeypatch.undo()
    grouper.add_many([make_request(1), make_request(2)], now=2)  # its slots are free again
    assert grouper.num_requests == 3


def test_reclustering_is_deterministic() -> None:
    def grouped() -> list[list[str]]:
        grouper = Grouper(SMALL)
        for r in mixed_requests(500, seed=5):
            grouper.add(r, now=0)
        grouper.recluster(now=1)
        return sorted(members(grouper, gid) for gid in grouper.group_ids())

    assert grouped() == grouped()


def test_reclustering_an_empty_grouper_changes_nothing() -> None:
    grouper = Grouper(NO_WINDOW)
    gid = grouper.add(make_request(0), now=0)
    grouper.pop(gid)
    result = grouper.recluster(now=1)
    assert (result.kept, result.created, result.removed, result.requests) == ((), (), (), 0)


def test_reclustering_is_due_after_the_interval_only_when_something_changed() -> None:
    grouper = Grouper(GroupingConfig(recluster_interval_s=30, deadline_window=0))
    assert not grouper.needs_recluster(now=100)
    grouper.add(make_request(0), now=0)
    assert not grouper.needs_recluster(now=29)
    assert grouper.needs_recluster(now=30)
    grouper.recluster(now=30)
    assert not grouper.needs_recluster(now=1000)
    grouper.add(make_request(1), now=31)
    assert not grouper.needs_recluster(now=59)
    assert grouper.needs_recluster(now=60)


def test_reclustering_is_due_when_online_requests_drift_from_their_centroids() -> None:
    grouper = Grouper(NO_WINDOW)
    for i in range(10):
        grouper.add(make_request(i), now=0)
    grouper.recluster(now=0)
    for i in range(10, 41):  # 31 requests three times longer: still compatible, but far
        grouper.add(make_request(i, input_tokens=600), now=1)
    assert len(grouper) == 1
    assert not grouper.needs_recluster(now=1)  # fewer than 32 samples
    grouper.add(make_request(41, input_tokens=600), now=1)
    assert grouper.needs_recluster(now=1)


def test_requests_like_the_members_cause_no_drift() -> None:
    grouper = Grouper(NO_WINDOW)
    for i in range(10):
        grouper.add(make_request(i), now=0)
    grouper.recluster(now=0)
    for i in range(10, 60):
        grouper.add(make_request(i), now=1)
    assert not grouper.needs_recluster(now=1)


def test_reclustering_is_due_when_many_groups_were_created_online() -> None:
    grouper = Grouper(NO_WINDOW)
    for i in range(8):
        grouper.add(make_request(i), now=0)
    grouper.recluster(now=0)  # one group
    for i, model in enumerate(["a", "b", "c"]):
        grouper.add(make_request(10 + i, model=model), now=1)
    assert not grouper.needs_recluster(now=1)  # 3 new groups: fewer than 4
    grouper.add(make_request(20, model="d"), now=1)
    assert grouper.needs_recluster(now=1)


def test_requests_far_apart_in_time_never_share_a_group() -> None:
    grouper = Grouper(GroupingConfig(deadline_window=0.25))  # 30 s SLO: windows of 7.5 s
    early = grouper.add(make_request(0, arrival_s=0.0), now=0.0)
    assert grouper.add(make_request(1, arrival_s=5.0), now=5.0) == early
    late = grouper.add(make_request(2, arrival_s=8.0), now=8.0)
    assert late != early
    grouper.recluster(now=9.0)
    assert {grouper.group_of("r0000"), grouper.group_of("r0001")} != {grouper.group_of("r0002")}
    assert grouper.group_of("r0000") == grouper.group_of("r0001")


def test_the_thread_pools_are_found_when_the_grouper_is_made_not_in_its_first_recluster() -> None:
    clustering._controller.cache_clear()
    Grouper()
    assert clustering._controller.cache_info().currsize == 1


def _split_spread_reference(
    rows: np.ndarray, bounded: np.ndarray, limits: tuple[float, ...]
) -> list[np.ndarray]:
    """The cut ``split_spread`` promises, one part at a time."""
    done, todo = [], [rows]
    while todo:
        part = todo.pop()
        for j, limit in enumerate(limits):
            values = bounded[part, j]
            if values.max() - values.min() > limit + 1e-9:
                order = np.argsort(values, kind="stable")
                cut = int(np.diff(values[order]).argmax()) + 1
                todo.append(np.sort(part[order[cut:]]))
                todo.append(np.sort(part[order[:cut]]))
                break
        else:
            done.append(part)
    return done


@pytest.mark.parametrize("seed", range(40))
def test_split_spread_cuts_every_cluster_as_cutting_one_part_at_a_time_would(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    # Rounded values: ties and equal gaps, where stable order and the first widest gap matter.
    bounded = np.round(rng.normal(size=(n + 5, 3)) * rng.uniform(0.5, 4), int(rng.integers(0, 3)))
    rows = np.sort(rng.choice(n + 5, size=n, replace=False)).astype(np.int64)
    labels = rng.integers(0, int(rng.integers(1, 8)), size=n)
    clusters = [rows[labels == c] for c in np.unique(labels)]
    starts = np.cumsum([0] + [len(c) for c in clusters[:-1]]).astype(np.int64)
    limits = tuple(rng.uniform(0.1, 2.0, size=3).tolist())
    got_rows, got_starts = clustering.split_spread(
        np.concatenate(clusters), starts, bounded, limits
    )
    got = np.split(got_rows, got_starts[1:])
    want = [part for c in clusters for part in _split_spread_reference(c, bounded, limits)]
    assert sorted(g.tolist() for g in got) == sorted(w.tolist() for w in want)
    assert got_rows.dtype == np.int64


def test_partitions_match_group_key_request_by_request() -> None:
    rng = random.Random(3)
    requests = [
        make_request(
            id=f"r{i}",
            model=rng.choice(["a", "b"]),
            tier=rng.choice(list(Tier)),
            slo=SLO(e2e_s=rng.choice([20.0, 60.0, 300.0])),
            arrival_s=rng.uniform(0, 5000),
        )
        for i in range(500)
    ]
    waiting, slots = _waiting(requests)
    for window in (0.0, 0.25):
        keys, codes = waiting.partitions(slots, window)
        assert keys == sorted(keys)
        assert [keys[c] for c in codes] == [group_key(r, window) for r in requests]


def _waiting(requests: list[Request]) -> tuple[WaitingRequests, np.ndarray]:
    """The requests in slots, some of them freed and reused on the way, and their slots."""
    waiting = WaitingRequests(capacity=4)
    for r in requests[:50]:
        waiting.add(dataclasses.replace(r, id=f"gone-{r.id}"), np.zeros(4), None)
    for slot in range(0, 50, 3):
        waiting.release(slot)
    slots = np.array([waiting.add(r, np.zeros(4), None) for r in requests], dtype=np.int64)
    return waiting, slots


def test_fcfs_order_is_by_partition_then_arrival_then_id() -> None:
    rng = random.Random(5)
    requests = [
        make_request(
            id=f"{rng.choice('abc')}{rng.randint(0, 10**6)}-{i}", arrival_s=rng.randint(0, 30)
        )
        for i in range(400)
    ]
    waiting, slots = _waiting(requests)
    partition = np.array([rng.randint(0, 3) for _ in requests], dtype=np.int64)
    order = waiting.fcfs_order(slots, partition)
    want = sorted(range(len(requests)), key=lambda i: (partition[i], *_fcfs(requests[i])))
    assert order.tolist() == want


def test_id_hashes_are_fnv1a_over_the_ids_padded_to_the_longest() -> None:
    rng = random.Random(7)
    requests = [
        make_request(id="".join(rng.choice("ab€9-") for _ in range(rng.randint(0, 24))) + str(i))
        for i in range(300)
    ]
    waiting, slots = _waiting(requests)
    waiting.id_hashes(slots[:100])  # hashed in two batches of different widths
    ids = np.array([r.id for r in requests])
    width = ids.dtype.itemsize // 4
    chars = ids.view(np.uint32).reshape(len(ids), width).astype(np.uint64)
    want = np.full(len(ids), 0xCBF29CE484222325, dtype=np.uint64)
    for j in range(width):
        want = (want ^ chars[:, j]) * np.uint64(0x100000001B3)
    assert waiting.id_hashes(slots).tolist() == want.tolist()


def test_features_of_many_requests_are_those_of_each_request() -> None:
    requests = mixed_requests(300, seed=4)
    requests[0] = dataclasses.replace(requests[0], slo=SLO(e2e_s=20.0, ttft_s=2.0))
    waiting, slots = _waiting(requests)
    many = waiting.features(slots, default_predict_output)
    each = np.array([raw_features(r, default_predict_output) for r in requests])
    np.testing.assert_allclose(many, each, rtol=1e-15)


def test_default_predictions_of_many_requests_are_those_of_each_request() -> None:
    requests = mixed_requests(300, seed=6)
    caps = np.array([float(r.max_tokens) for r in requests])
    want = [default_predict_output(r) for r in requests]
    assert predict_outputs(default_predict_output, requests, caps).tolist() == want
    half = predict_outputs(lambda r: r.max_tokens / 2, requests, caps)
    assert half.tolist() == [r.max_tokens / 2 for r in requests]
