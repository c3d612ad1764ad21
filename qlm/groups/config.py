"""Settings of request grouping: Algorithm 1's δ, the batch size it multiplies, and when to re-cluster."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qlm.errors import check_setting


@dataclass(frozen=True, slots=True)
class GroupingConfig:
    """How requests are grouped (paper §4, Algorithm 1) and when the groups are rebuilt.

    ``delta`` × ``avg_batch_size`` bounds the size of every group (``max_group_size``). The paper
    chooses δ = 4 (§8.3: δ = 1 decides most finely but costs the planner most, δ = 16 is coarse).
    ``avg_batch_size``: the QLM policy uses 8 (``qlm.planner.config.DEFAULT_GROUPING``; the
    ``QLM_PLANNER__GROUP_*`` settings).

    ``max_clusters_per_model`` bounds the *k* of k-means for one model (its partitions share it in
    proportion to their size). Splitting to the size bound may still create more groups than that:
    the size bound always wins.

    ``slo_ratio``: two requests share a group only if their end-to-end SLOs (and, separately, their
    TTFT SLOs) differ by at most this factor. ``input_ratio``: likewise for ``1 + prompt tokens``
    (a huge value such as 1e9 turns the rule off): prefill is most of a request's cost, and a group is planned
    and admitted as a unit, so its members must cost alike — without the rule k-means put
    4,000-token prompts of the Azure conversation trace into groups of 1,000-token ones.

    Re-clustering (``Grouper.needs_recluster``) is due after ``recluster_interval_s`` with changes,
    when online-classified requests sit ``drift_factor`` times farther from their group's centroid
    than the members did right after the last re-clustering, or when online classification created
    more than ``max_new_group_fraction`` × (groups after the last re-clustering) new groups.

    ``deadline_window``: requests share a group only if their absolute deadlines fall in the same
    slice of ``deadline_window`` × their SLO (0 disables it): a group stays homogeneous in time,
    so the planner's group deadline (its earliest) is true of all its members.

    ``keep_id_overlap``: a new cluster keeps an old group's id when they share at least this fraction
    of the larger of the two. ``kmeans_sample`` and ``kmeans_max_iter`` bound k-means' cost: it is
    fitted on at most that many requests per partition, and every request is then assigned to the
    nearest centre. ``seed`` makes sampling and k-means deterministic.
    """

    delta: float = 4.0
    avg_batch_size: float = 32.0
    max_clusters_per_model: int = 64
    slo_ratio: float = 2.0
    input_ratio: float = 3.0
    recluster_interval_s: float = 30.0
    drift_factor: float = 2.0
    max_new_group_fraction: float = 0.5
    keep_id_overlap: float = 0.5
    deadline_window: float = 0.25
    kmeans_sample: int = 4096
    kmeans_max_iter: int = 300
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.delta > 0, "delta", "> 0", self.delta)
        _check(self.avg_batch_size >= 1, "avg_batch_size", ">= 1", self.avg_batch_size)
        _check(
            self.max_clusters_per_model >= 1,
            "max_clusters_per_model",
            ">= 1",
            self.max_clusters_per_model,
        )
        _check(self.slo_ratio >= 1, "slo_ratio", ">= 1", self.slo_ratio)
        _check(self.input_ratio >= 1, "input_ratio", ">= 1", self.input_ratio)
        _check(
            self.recluster_interval_s > 0, "recluster_interval_s", "> 0", self.recluster_interval_s
        )
        _check(self.drift_factor > 1, "drift_factor", "> 1", self.drift_factor)
        _check(
            self.max_new_group_fraction > 0,
            "max_new_group_fraction",
            "> 0",
            self.max_new_group_fraction,
        )
        _check(self.deadline_window >= 0, "deadline_window", ">= 0", self.deadline_window)
        _check(0 < self.keep_id_overlap <= 1, "keep_id_overlap", "in (0, 1]", self.keep_id_overlap)
        _check(self.kmeans_sample >= 2, "kmeans_sample", ">= 2", self.kmeans_sample)
        _check(self.kmeans_max_iter >= 1, "kmeans_max_iter", ">= 1", self.kmeans_max_iter)

    @property
    def max_log_spread(self) -> tuple[float, float, float]:
        """Bounds on the spread within a group of the bounded features (``BOUNDED_FEATURES``):
        log end-to-end SLO, log TTFT SLO, log prompt length."""
        slo = math.log(self.slo_ratio)
        return (slo, slo, math.log(self.input_ratio))

    @property
    def max_group_size(self) -> int:
        """``floor(delta × avg_batch_size)``, at least 1: no group ever holds more requests."""
        return max(1, math.floor(self.delta * self.avg_batch_size))


def _check(ok: bool, field: str, rule: str, value: float) -> None:
    check_setting(ok, f"grouping.{field}", rule, value)
