"""What a controller publishes of its virtual queues for operators: each group's tenants,
latest deadline, requests already past their deadline and the ids of its requests, within a
bound on how many ids one snapshot names."""

from __future__ import annotations

from builders import make_request

from qlm.domain import SLO, Tier
from qlm.service.publishing import (
    LISTED_PER_GROUP,
    LISTED_REQUESTS,
    PUBLISH_MAX_S,
    PUBLISH_SHARE,
    publish_wait,
    snapshot_dict,
)
from qlm.virtual_queues import GroupSnapshot, QueueSnapshot, VirtualQueuesSnapshot


def group(gid: str, requests: list, **kw) -> GroupSnapshot:  # type: ignore[type-arg, no-untyped-def]
    earliest = min(r.deadline_s for r in requests)
    return GroupSnapshot(
        gid,
        0,
        "m",
        Tier.STANDARD,
        "default",
        len(requests),
        earliest,
        requests=tuple(requests),
        **kw,
    )


def publish(at: float, *groups: GroupSnapshot) -> list[dict]:  # type: ignore[type-arg]
    snap = VirtualQueuesSnapshot(at, 0.9, (QueueSnapshot("i0", groups),))
    doc = snapshot_dict("c0", at, "qlm", snap, [], {}, None)
    return list(doc["queues"][0]["groups"])


def test_a_group_names_its_tenants_deadlines_and_the_requests_already_past_their_deadline() -> None:
    reqs = [
        make_request(0, arrival_s=0.0, slo=SLO(e2e_s=10.0), tenant="acme"),
        make_request(1, arrival_s=1.0, slo=SLO(e2e_s=100.0), tenant="globex"),
        make_request(2, arrival_s=2.0, slo=SLO(e2e_s=5.0), tenant="acme"),
    ]
    [g] = publish(20.0, group("g1", reqs, p_meet_slo=0.0, at_risk=True))
    assert g["tenants"] == {"acme": 2, "globex": 1}
    assert list(g["tenants"]) == ["acme", "globex"]  # most first
    assert (g["earliest_deadline_at"], g["latest_deadline_at"]) == (7.0, 101.0)
    assert g["missed"] == 2 and g["at_risk"] is True and g["deferred"] is False
    assert g["request_ids"] == ["r0000", "r0001", "r0002"]
    assert g["slo_class"] == "default"
    [early] = publish(0.0, group("g1", reqs))
    assert early["missed"] == 0
    [held] = publish(0.0, group("g1", reqs, deferred=True))
    assert held["deferred"] is True


def test_the_snapshot_says_the_controllers_role() -> None:
    doc = snapshot_dict("c0", 1.0, "qlm", None, [], {}, None, role="starting")
    assert doc["role"] == "starting" and doc["controller"] == "c0"


def test_a_large_backlog_names_only_the_first_requests_of_each_group() -> None:
    size = 50
    groups = [
        group(f"g{k}", [make_request(k * size + i, arrival_s=0.0) for i in range(size)])
        for k in range(LISTED_REQUESTS // size + 1)
    ]
    published = publish(0.0, *groups)
    listed = [len(g["request_ids"]) for g in published]
    per_group = max(LISTED_PER_GROUP, LISTED_REQUESTS // len(groups))
    assert per_group < size and set(listed) == {per_group}
    assert published[0]["request_ids"] == [f"r{i:04d}" for i in range(per_group)]
    # within the bound, every request is named
    assert [len(g["request_ids"]) for g in publish(0.0, *groups[:-1])] == [size] * (len(groups) - 1)


def test_publishing_waits_its_period_unless_it_would_take_more_than_its_share_of_the_loop() -> None:
    assert publish_wait(1.0, 0.01) == 1.0  # a small backlog: every second
    assert publish_wait(1.0, 0.3) == 0.3 / PUBLISH_SHARE  # a large one: less often
    assert publish_wait(1.0, 3.0) == PUBLISH_MAX_S < 10.0  # never stale to /readyz
