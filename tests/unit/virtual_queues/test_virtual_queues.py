"""Virtual queues: ordered group references per instance, FCFS inside a group, fault isolation."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from builders import make_request

from qlm.domain import SLO, Tier
from qlm.errors import VirtualQueueError
from qlm.groups import Grouper, GroupingConfig
from qlm.virtual_queues import VirtualQueueSet

SMALL = GroupingConfig(delta=1.0, avg_batch_size=4, deadline_window=0)  # groups of at most 4


def fleet(*instances: str, config: GroupingConfig = SMALL) -> tuple[Grouper, VirtualQueueSet]:
    grouper = Grouper(config)
    queues = VirtualQueueSet(grouper)
    for name in instances:
        queues.add_instance(name)
    return grouper, queues


def add_requests(grouper: Grouper, ids: range, **overrides: object) -> list[str]:
    """Add requests; return the ids of their groups in order of first appearance."""
    gids = [grouper.add(make_request(i, **overrides), now=float(i)) for i in ids]
    return list(dict.fromkeys(gids))


def test_new_groups_start_unassigned_until_assigned() -> None:
    grouper, queues = fleet("a")
    g1, g2 = add_requests(grouper, range(8))
    assert queues.unassigned() == [g1, g2]
    queues.assign(g2, "a")
    queues.assign(g1, "a", position=0)
    assert queues.queue("a") == (g1, g2)
    assert queues.unassigned() == []
    assert queues.instance_of(g1) == "a"


def test_next_request_is_fcfs_in_the_head_group_then_moves_to_the_next_group() -> None:
    grouper, queues = fleet("a")
    first, second = add_requests(grouper, range(8))
    queues.set_order("a", [second, first])
    assert queues.head_group("a") == second
    assert queues.next_request("a") == make_request(4)
    served = [r.id for r in iter(lambda: queues.pop_next("a"), None)]
    assert served == [f"r{i:04d}" for i in [4, 5, 6, 7, 0, 1, 2, 3]]
    assert queues.queue("a") == ()
    assert queues.next_request("a") is None
    assert len(grouper) == 0


def test_a_dropped_instance_hands_back_all_its_groups_in_order() -> None:
    grouper, queues = fleet("a", "b")
    gids = add_requests(grouper, range(20))
    queues.set_order("a", [gids[3], gids[0], gids[4]])
    queues.set_order("b", [gids[1]])
    assert queues.drop_instance("a") == [gids[3], gids[0], gids[4]]
    assert queues.instances() == ("b",)
    assert queues.unassigned() == [gids[0], gids[2], gids[3], gids[4]]
    assert all(grouper.group(g).size == 4 for g in gids)  # no request lost
    with pytest.raises(VirtualQueueError, match="unknown instance 'a'"):
        queues.queue("a")


def test_a_dropped_instance_forgets_groups_that_emptied_meanwhile() -> None:
    grouper, queues = fleet("a")
    g1, g2 = add_requests(grouper, range(8))
    queues.set_order("a", [g1, g2])
    for i in range(4):
        grouper.remove(f"r{i:04d}")  # directly on the grouper: the queue learns lazily
    assert queues.drop_instance("a") == [g2]


def test_set_order_makes_groups_left_out_unassigned() -> None:
    grouper, queues = fleet("a")
    g1, g2, g3 = add_requests(grouper, range(12))
    queues.set_order("a", [g1, g2, g3])
    queues.set_order("a", [g3, g1])
    assert queues.queue("a") == (g3, g1)
    assert queues.unassigned() == [g2]
    assert queues.instance_of(g2) is None


@pytest.mark.parametrize(
    ("order", "message"),
    [
        (["g1", "g9"], "unknown group 'g9'"),
        (["g1", "g1"], "group g1 is ordered twice"),
        (["g2"], "group g2 is in the virtual queue of 'b'"),
    ],
)
def test_a_bad_order_raises_naming_the_problem_and_changes_nothing(
    order: list[str], message: str
) -> None:
    grouper, queues = fleet("a", "b")
    add_requests(grouper, range(12))
    queues.set_order("a", ["g3"])
    queues.set_order("b", ["g2"])
    with pytest.raises(VirtualQueueError, match=message):
        queues.set_order("a", order)
    assert (queues.queue("a"), queues.queue("b")) == (("g3",), ("g2",))
    queues.check()


def test_ordering_an_unknown_instance_raises_naming_it() -> None:
    grouper, queues = fleet("a")
    add_requests(grouper, range(4))
    with pytest.raises(VirtualQueueError, match=r"unknown instance 'z' \(known: 'a'\)"):
        queues.set_order("z", ["g1"])
    with pytest.raises(VirtualQueueError, match="already has a virtual queue"):
        queues.add_instance("a")


def test_set_orders_moves_groups_between_instances_in_one_step() -> None:
    grouper, queues = fleet("a", "b")
    g1, g2 = add_requests(grouper, range(8))
    queues.set_orders({"a": [g1], "b": [g2]})
    queues.set_orders({"a": [g2], "b": [g1]})
    assert (queues.queue("a"), queues.queue("b")) == ((g2,), (g1,))
    with pytest.raises(VirtualQueueError, match=f"group {g1} is ordered for 'a' and 'b'"):
        queues.set_orders({"a": [g1], "b": [g1]})


def test_assigning_a_group_that_is_already_queued_raises() -> None:
    grouper, queues = fleet("a", "b")
    (g1,) = add_requests(grouper, range(4))
    queues.assign(g1, "a")
    with pytest.raises(
        VirtualQueueError, match=f"group {g1} is already in the virtual queue of 'a'"
    ):
        queues.assign(g1, "b")


def test_move_group_reorders_within_a_queue_and_moves_between_queues() -> None:
    grouper, queues = fleet("a", "b")
    g1, g2, g3 = add_requests(grouper, range(12))
    queues.set_order("a", [g1, g2, g3])
    queues.move_group(g3, "a", 0)
    assert queues.queue("a") == (g3, g1, g2)
    queues.move_group(g1, "b", 0)
    assert (queues.queue("a"), queues.queue("b")) == ((g3, g2), (g1,))
    with pytest.raises(VirtualQueueError, match="position 5 is outside the virtual queue of 'b'"):
        queues.move_group(g2, "b", 5)
    assert queues.queue("a") == (g3, g2)
    queues.check()


def test_removing_a_groups_last_request_takes_the_group_out_of_its_queue() -> None:
    grouper, queues = fleet("a")
    g1, g2 = add_requests(grouper, range(8))
    queues.set_order("a", [g1, g2])
    assert queues.remove_request("r0001") == g1
    for i in (0, 2, 3):
        queues.remove_request(f"r{i:04d}")
    assert queues.queue("a") == (g2,)
    assert queues.remove_request("r0001") is None


def test_sync_after_reclustering_drops_removed_ids_and_leaves_created_ones_unassigned() -> None:
    grouper, queues = fleet(
        "a", config=GroupingConfig(delta=2, avg_batch_size=4, deadline_window=0)
    )
    assert add_requests(grouper, range(10)) == ["g1", "g2"]  # 10 identical requests: 8 + 2
    queues.set_order("a", ["g2", "g1"])
    result = grouper.recluster(now=10)  # 5 + 5: r0-4 keep g1; r5-9 become g3
    assert (result.kept, result.created, result.removed) == (("g1",), ("g3",), ("g2",))
    queues.sync(result)
    assert queues.queue("a") == ("g1",)
    assert queues.unassigned() == ["g3"]
    queues.check()


def test_snapshot_lists_each_queue_with_sizes_deadlines_and_estimates() -> None:
    grouper, queues = fleet("a", "b")
    (g1,) = add_requests(grouper, range(3), slo=SLO(30.0), tier=Tier.INTERACTIVE)
    (g2,) = add_requests(grouper, range(3, 4), model="n")
    queues.set_order("a", [g2, g1])
    snap = queues.snapshot({g1: (12.0, 3.0, 0.9)})
    assert [q.instance for q in snap] == ["a", "b"]
    a, b = snap
    assert b.groups == () and a.requests == 4
    head, second = a.groups
    assert (head.id, head.position, head.model, head.size) == (g2, 0, "n", 1)
    assert head.predicted_completion_s is None and head.slo_risk is None
    assert (second.id, second.position, second.tier, second.slo_class) == (
        g1,
        1,
        Tier.INTERACTIVE,
        "default",
    )
    assert (second.size, second.earliest_deadline_s) == (3, 30.0)
    assert (second.predicted_completion_s, second.predicted_completion_std_s) == (12.0, 3.0)
    assert second.p_meet_slo == 0.9
    assert second.slo_risk == pytest.approx(0.1)
    assert not head.deferred and not second.deferred
    marked = queues.snapshot({g1: (12.0, 3.0, 0.9)}, deferred={g1})
    assert [g.deferred for g in marked[0].groups] == [False, True]


# --- invariants under random operations -------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_no_virtual_queue_ever_holds_a_request_twice_under_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    config = GroupingConfig(delta=2.0, avg_batch_size=3, deadline_window=0)
    grouper = Grouper(config)
    queues = VirtualQueueSet(grouper)
    waiting: set[str] = set()
    names = 0
    next_id = 0

    def new_instance() -> None:
        nonlocal names
        queues.add_instance(f"i{names}")
        names += 1

    for _ in range(3):
        new_instance()

    for step in range(400):
        op = rng.random()
        instances = queues.instances()
        live = grouper.group_ids()
        if op < 0.35:
            r = make_request(
                next_id,
                model=rng.choice("mn"),
                tier=rng.choice(list(Tier)),
                input_tokens=rng.choice([20, 200, 2000]),
                arrival_s=rng.uniform(0, step + 1),
                slo=SLO(rng.choice([10.0, 15.0, 300.0])),
            )
            grouper.add(r, now=step)
            waiting.add(r.id)
            next_id += 1
        elif op < 0.45 and waiting:
            rid = rng.choice(sorted(waiting))
            remover = queues.remove_request if rng.random() < 0.5 else grouper.remove
            assert remover(rid) is not None
            waiting.discard(rid)
        elif op < 0.55 and instances:
            popped = queues.pop_next(rng.choice(instances))
            if popped is not None:
                waiting.remove(popped.id)
        elif op < 0.62:
            queues.sync(grouper.recluster(now=step))
        elif op < 0.72 and live and instances:
            queues.move_group(rng.choice(live), rng.choice(instances), None)
        elif op < 0.80 and instances:
            name = rng.choice(instances)
            pool = list(queues.queue(name)) + queues.unassigned()
            queues.set_order(name, rng.sample(pool, k=rng.randint(0, len(pool))))
        elif op < 0.84 and len(instances) >= 2 and queues.queue(instances[1]):
            before = {name: queues.queue(name) for name in instances}
            stolen = queues.queue(instances[1])[0]  # still in instance 1's queue: refused
            with pytest.raises(VirtualQueueError, match=f"group {stolen} is in the virtual"):
                queues.set_order(instances[0], [*queues.queue(instances[0]), stolen])
            assert {name: queues.queue(name) for name in instances} == before
        elif op < 0.88 and instances and queues.unassigned():
            queues.assign(rng.choice(queues.unassigned()), rng.choice(instances), 0)
        elif op < 0.94 and instances:
            handed_back = queues.drop_instance(rng.choice(instances))
            assert set(handed_back) <= set(queues.unassigned())
        else:
            new_instance()

        queues.check()
        queued = [gid for name in queues.instances() for gid in queues.queue(name)]
        assert len(queued) == len(set(queued)), f"step {step}: a group is queued twice"
        in_queues = Counter(r.id for gid in queued for r in grouper.group(gid).requests)
        assert not [rid for rid, c in in_queues.items() if c > 1], f"step {step}"
        in_groups = Counter(r.id for g in grouper.groups() for r in g.requests)
        assert set(in_groups) == waiting and max(in_groups.values(), default=1) == 1
        assert set(queued) | set(queues.unassigned()) == set(grouper.group_ids())
        for group in grouper.groups():
            assert 1 <= group.size <= config.max_group_size
            assert {(r.model, r.tier) for r in group.requests} == {(group.model, group.tier)}
