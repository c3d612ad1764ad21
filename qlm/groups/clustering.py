"""Algorithm 1 of the paper over one partition (one model, tier and SLO class): k-means, then split.

Requests are given as rows in FCFS order (arrival, then id), so a row's index is its FCFS rank and
every group returned lists its rows in ascending order, which is FCFS order.

1. ``k = min(ceil(n / max_group_size), k_cap)``, at least 1 and at most the number of distinct
   points. k-means (scikit-learn ``KMeans``, Lloyd, one initialisation, run to strict convergence or
   ``max_iter``, fixed ``random_state``, one thread) is fitted on at most ``sample`` rows, and every
   row is then assigned to its nearest centre: that bounds the cost for 100,000 requests.
2. A cluster whose bounded features (the SLOs and the prompt length, in logs) spread by more than
   ``max_log_spread`` (``log(slo_ratio)``, ``log(input_ratio)``) is cut at the widest gap of that
   feature, repeatedly: requests with very different deadlines or costs never share a group.
3. ``splitHalf``: a cluster larger than ``max_group_size`` is split into its older and newer halves,
   and those again, until every group respects the bound (``split_half``).

For stable group ids across re-clusterings the caller may pass ``sample_key`` (a hash of the request
id: the same requests form the sample each time), ``init`` (the previous centres: k-means starts where
it ended) and ``anchors`` (each row's previous group: cuts prefer its boundaries). With all three, an
unchanged partition gives exactly the same groups again.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from functools import cache
from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.cluster import KMeans
from threadpoolctl import ThreadpoolController  # type: ignore[import-untyped]

from qlm.groups.features import FloatArray, IntArray

_EPS = 1e-9


def single_threaded() -> Any:
    """Context in which OpenMP and BLAS run one thread.

    The fits are small, and OpenMP threads waiting at barriers for a core busy with other work made a
    9 ms k-means fit take 150 ms on the 2-core development machine.
    """
    return _controller().limit(limits=1)


def prepare_threadpools() -> None:
    """Find the process's OpenMP and BLAS libraries now (once per process): the scan resolves the
    path of every loaded library, ~5 ms on a quiet machine and 8 s seen on a busy disk — inside
    the first control step that reclustered, had it been left to the first fit."""
    _controller()


@cache
def _controller() -> Any:
    return ThreadpoolController()  # scans the loaded libraries: once


def form_groups(
    points: FloatArray,
    bounded: FloatArray,
    *,
    max_group_size: int,
    k_cap: int,
    max_log_spread: Sequence[float],
    sample: int,
    max_iter: int,
    seed: int,
    sample_key: npt.NDArray[np.uint64] | None = None,
    anchors: IntArray | None = None,
    init: FloatArray | None = None,
) -> tuple[list[IntArray], FloatArray | None]:
    """Row indices of each group, every list ascending (FCFS), groups ordered by their oldest row;
    and the k-means centres (largest cluster first; None when k = 1) to warm-start the next call.

    ``sample_key``, ``anchors`` and ``init`` make re-clustering stable: rows with the smallest
    ``sample_key`` form the k-means sample, ``init`` (previous centres) starts k-means, and a split
    prefers to cut where ``anchors`` (the rows' previous groups) change.
    """
    n = len(points)
    if n == 0:
        return [], None
    k = max(1, min(math.ceil(n / max_group_size), k_cap))
    labels, centres = kmeans_labels(
        points, k, sample=sample, max_iter=max_iter, seed=seed, sample_key=sample_key, init=init
    )
    groups: list[IntArray] = []
    for cluster in _clusters(labels):
        for part in split_spread(cluster, bounded, max_log_spread):
            groups.extend(split_half(part, max_group_size, anchors))
    groups.sort(key=lambda g: int(g[0]))
    return groups, centres


def kmeans_labels(
    points: FloatArray,
    k: int,
    *,
    sample: int,
    max_iter: int,
    seed: int,
    sample_key: npt.NDArray[np.uint64] | None = None,
    init: FloatArray | None = None,
) -> tuple[IntArray, FloatArray | None]:
    """Cluster label of every row, and the centres (largest cluster first).

    k-means is fitted on at most ``sample`` rows (those with the smallest ``sample_key``, else a
    seeded random choice), started from ``init`` when given (topped up with the sample rows farthest
    from it, or cut to its first k rows), and every row then goes to its nearest centre.
    """
    n = len(points)
    zeros = np.zeros(n, dtype=np.int64)
    if k <= 1 or n <= 1:
        return zeros, None
    fit = points
    if n > sample:
        if sample_key is not None:
            rows = np.argpartition(sample_key, sample - 1)[:sample]
        else:
            rows = np.random.default_rng(seed).choice(n, size=sample, replace=False)
        fit = points[np.sort(rows)]
    k = min(k, len(np.unique(fit, axis=0)))
    if k <= 1:
        return zeros, None
    start: FloatArray | str = "k-means++"
    if init is not None and len(init):
        start = _top_up(init[:k], fit, k)
    model = KMeans(
        n_clusters=k, n_init=1, max_iter=max_iter, tol=0.0, random_state=seed, init=start
    )
    with single_threaded():  # only around a fit: most partitions of a re-clustering have none
        centres = np.asarray(model.fit(fit).cluster_centers_, dtype=np.float64)
        labels = nearest(points, centres)
    by_size = np.argsort(-np.bincount(labels, minlength=k), kind="stable")
    rank = np.empty(k, dtype=np.int64)
    rank[by_size] = np.arange(k)
    return rank[labels], centres[by_size]


def _top_up(centres: FloatArray, fit: FloatArray, k: int) -> FloatArray:
    """Add the rows of ``fit`` farthest from every centre until there are ``k`` centres."""
    result = centres
    d2 = ((fit[:, None, :] - result[None, :, :]) ** 2).sum(axis=2).min(axis=1)
    while len(result) < k:
        far = fit[int(d2.argmax())]
        result = np.vstack([result, far])
        d2 = np.minimum(d2, ((fit - far) ** 2).sum(axis=1))
    return result


def nearest(points: FloatArray, centres: FloatArray) -> IntArray:
    """Index of the nearest centre (Euclidean) of every row; ties go to the lower index."""
    d2 = (
        (points * points).sum(axis=1)[:, None]
        - 2.0 * points @ centres.T
        + (centres * centres).sum(axis=1)[None, :]
    )
    return np.asarray(d2.argmin(axis=1), dtype=np.int64)


def _clusters(labels: IntArray) -> list[IntArray]:
    order = np.argsort(labels, kind="stable")  # stable: rows stay FCFS within a label
    counts = np.bincount(labels)
    return [c for c in np.split(order, np.cumsum(counts)[:-1]) if len(c)]


def split_spread(
    rows: IntArray, bounded: FloatArray, max_log_spread: Sequence[float]
) -> list[IntArray]:
    """Cut ``rows`` at the widest gap of any bounded feature (column ``j`` of ``bounded``) that
    spreads beyond ``max_log_spread[j]``: the first such feature, sorted stably, cut after the
    first of its widest gaps; each side again until none spreads too far.

    A part of at most ``SMALL_PART`` rows is cut in plain Python (``_split_small``): the same
    comparisons and subtractions of the same floats, without numpy's cost per call, which
    dominates on the thousands of small parts a re-clustering cuts."""
    limits = [limit + _EPS for limit in max_log_spread]
    done: list[IntArray] = []
    todo = [rows]
    while todo:
        part = todo.pop()
        if len(part) <= SMALL_PART:
            done.extend(part[local] for local in _split_small(bounded[part].tolist(), limits))
            continue
        values_all = bounded[part]
        spread = (values_all.max(axis=0) - values_all.min(axis=0)).tolist()
        for j, limit in enumerate(limits):
            if spread[j] > limit:
                values = values_all[:, j]
                order = np.argsort(values, kind="stable")
                cut = int(np.diff(values[order]).argmax()) + 1
                todo.append(np.sort(part[order[cut:]]))
                todo.append(np.sort(part[order[:cut]]))
                break
        else:
            done.append(part)
    return done


SMALL_PART = 48
"""Parts up to this many rows are cut by ``_split_small``."""


def _split_small(values: list[list[float]], limits: list[float]) -> list[list[int]]:
    """``split_spread`` on the rows ``values`` (each a row's bounded features) in plain Python:
    positions of each part, ascending, in the order ``split_spread`` finds them."""
    done: list[list[int]] = []
    todo = [list(range(len(values)))]
    while todo:
        part = todo.pop()
        for j, limit in enumerate(limits):
            column = [values[i][j] for i in part]
            if max(column) - min(column) > limit:
                order = sorted(range(len(part)), key=column.__getitem__)  # stable, as argsort
                ordered = [column[o] for o in order]
                gaps = [b - a for a, b in pairwise(ordered)]
                cut = gaps.index(max(gaps)) + 1  # the first widest gap, as argmax
                todo.append(sorted(part[o] for o in order[cut:]))
                todo.append(sorted(part[o] for o in order[:cut]))
                break
        else:
            done.append(part)
    return done


def split_half(
    rows: IntArray, max_group_size: int, anchors: IntArray | None = None
) -> list[IntArray]:
    """Algorithm 1's ``splitHalf`` until every part fits, as FCFS runs of nearly equal size.

    Halving ``m`` rows ``j = ceil(log2(m / max_group_size))`` times gives ``2**j`` runs: the cuts are
    put at ``ceil(i * m / 2**j)`` at once (the older side takes the odd row).

    With ``anchors`` (each row's previous group), a cut moves to the nearest place where the previous
    group changes, if one lies within a quarter of a run, so that groups that survive a re-clustering
    keep their members; a run that this makes too large is halved again. Re-splitting an unchanged
    cluster gives the same runs: each previous cut is the boundary nearest its own ideal cut.
    """
    m = len(rows)
    if m <= max_group_size:
        return [rows]
    parts = 1 << math.ceil(math.log2(m / max_group_size))
    cuts = [-(-i * m // parts) for i in range(1, parts)]
    window = m // parts // 4
    if anchors is not None and window > 0:
        changes = (np.flatnonzero(np.diff(anchors[rows])) + 1).tolist()
        for c, cut in enumerate(cuts):
            i = bisect.bisect_left(changes, cut)
            near = [changes[j] for j in (i - 1, i) if 0 <= j < len(changes)]
            best = min(near, key=lambda b: (abs(b - cut), b), default=cut)
            if abs(best - cut) <= window:
                cuts[c] = best
    runs = [
        run for run in np.split(rows, cuts) if len(run)
    ]  # 2**j may exceed m when the bound is 1
    return [part for run in runs for part in _halve(run, max_group_size)]


def _halve(rows: IntArray, max_group_size: int) -> list[IntArray]:
    if len(rows) <= max_group_size:
        return [rows]
    half = (len(rows) + 1) // 2
    return _halve(rows[:half], max_group_size) + _halve(rows[half:], max_group_size)
