"""Algorithm 1 of the paper over each partition (one model, tier, SLO class and deadline window):
k-means, then split; every partition of a re-clustering in one call, numpy over all of them.

Requests are given as rows in FCFS order (arrival, then id) within each partition, partitions one
after the other, so within a partition a row's index is its FCFS rank and every group lists its
rows in ascending order, which is FCFS order.

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
id: the same requests form the sample each time), ``inits`` (the previous centres: k-means starts where
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
import sklearn
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
    bounds: IntArray,
    *,
    max_group_size: int,
    k_caps: Sequence[int],
    max_log_spread: Sequence[float],
    sample: int,
    max_iter: int,
    seed: int,
    sample_key: npt.NDArray[np.uint64] | None = None,
    anchors: IntArray | None = None,
    inits: Sequence[FloatArray | None] | None = None,
) -> tuple[IntArray, list[FloatArray | None]]:
    """Algorithm 1 over every partition at once: rows ``bounds[p]:bounds[p + 1]`` are partition
    ``p``, in FCFS order, with ``k_caps[p]`` and previous centres ``inits[p]``.

    Returns the group of every row, groups numbered by their oldest row (so partition by
    partition); and each partition's k-means centres (largest cluster first; None when k = 1) to
    warm-start the next call.

    ``sample_key``, ``anchors`` and ``inits`` make re-clustering stable: rows with the smallest
    ``sample_key`` form the k-means sample, ``inits`` (previous centres) start k-means, and a split
    prefers to cut where ``anchors`` (the rows' previous groups) change.
    """
    n = len(points)
    labels = np.zeros(n, dtype=np.int64)  # cluster of every row, numbered across partitions
    centres: list[FloatArray | None] = []
    clusters = 0
    for p, (lo, hi) in enumerate(pairwise(bounds.tolist())):
        k = max(1, min(math.ceil((hi - lo) / max_group_size), k_caps[p]))
        fitted = None
        if k > 1:  # most partitions of a re-clustering fit in one group's size: no k-means
            local, fitted = kmeans_labels(
                points[lo:hi],
                k,
                sample=sample,
                max_iter=max_iter,
                seed=seed,
                sample_key=None if sample_key is None else sample_key[lo:hi],
                init=None if inits is None else inits[p],
            )
            labels[lo:hi] = clusters + local
        else:
            labels[lo:hi] = clusters
        clusters += k
        centres.append(fitted)
    rows = np.argsort(labels, kind="stable")  # stable: rows stay FCFS within a cluster
    counts = np.bincount(labels, minlength=clusters)
    rows, starts = split_spread(rows, _starts(counts[counts > 0]), bounded, max_log_spread)
    sizes = np.diff(starts, append=len(rows))
    runs: list[int] = []  # the sizes of the groups, one part after the other
    for start, size in zip(starts.tolist(), sizes.tolist(), strict=True):
        if size <= max_group_size:
            runs.append(size)
        else:
            runs.extend(
                len(run) for run in split_half(rows[start : start + size], max_group_size, anchors)
            )
    run_sizes = np.array(runs, dtype=np.int64)
    oldest = rows[_starts(run_sizes)]
    rank = np.empty(len(runs), dtype=np.int64)
    rank[np.argsort(oldest)] = np.arange(len(runs))
    group = np.empty(n, dtype=np.int64)
    group[rows] = np.repeat(rank, run_sizes)
    return group, centres


def _starts(sizes: IntArray) -> IntArray:
    """Where each of consecutive runs of these sizes starts."""
    starts = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    return starts


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
    k = _distinct_rows(fit, k)
    if k <= 1:
        return zeros, None
    start: FloatArray | str = "k-means++"
    if init is not None and len(init):
        start = _top_up(init[:k], fit, k)
    model = KMeans(
        n_clusters=k, n_init=1, max_iter=max_iter, tol=0.0, random_state=seed, init=start
    )
    # Only around a fit: most partitions of a re-clustering have none. The parameters are valid
    # by construction: scikit-learn need not check them at each of the dozens of fits.
    with single_threaded(), sklearn.config_context(skip_parameter_validation=True):
        centres = np.asarray(model.fit(fit).cluster_centers_, dtype=np.float64)
        labels = nearest(points, centres)
    by_size = np.argsort(-np.bincount(labels, minlength=k), kind="stable")
    rank = np.empty(k, dtype=np.int64)
    rank[by_size] = np.arange(k)
    return rank[labels], centres[by_size]


def _distinct_rows(points: FloatArray, at_most: int) -> int:
    """``min(at_most, number of distinct rows)``. A column with that many distinct values
    answers first: ``np.unique`` over whole rows costs ~50 times one over a column."""
    for column in points.T:
        if len(np.unique(column)) >= at_most:
            return at_most
    return min(at_most, len(np.unique(points, axis=0)))


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


def split_spread(
    rows: IntArray, starts: IntArray, bounded: FloatArray, max_log_spread: Sequence[float]
) -> tuple[IntArray, IntArray]:
    """Cut every cluster — ``rows[starts[c]:starts[c + 1]]``, ascending — at the widest gap of any
    bounded feature (column ``j`` of ``bounded``) that spreads beyond ``max_log_spread[j]``: the
    first such feature, sorted, cut after the first of its widest gaps; each side again until none
    spreads too far. Returns the rows of every part, each part ascending, and where each starts.

    A side of a cut spreads no more than the part it came from, so every cut on feature ``j``
    comes before any on ``j + 1``: the features are taken one at a time, and all parts together.
    A part sorted by the feature is cut into runs of its sorted rows: level by level, each run
    that spreads too far is cut after the first of its widest gaps.
    """
    limits = (np.asarray(max_log_spread, dtype=np.float64) + _EPS).tolist()
    m = len(rows)
    part = np.repeat(np.arange(len(starts)), np.diff(starts, append=m))  # of every row
    parts = len(starts)
    for j, limit in enumerate(limits):
        value = bounded[rows, j]
        lo = np.full(parts, np.inf)
        hi = np.full(parts, -np.inf)
        np.minimum.at(lo, part, value)
        np.maximum.at(hi, part, value)
        wide = np.flatnonzero((hi - lo > limit)[part])  # the rows of the parts to cut
        if not len(wide):
            continue
        order = wide[_sort_within(part[wide], value[wide])]
        ordered, ordered_part = value[order], part[order]
        gaps = np.append(np.diff(ordered), -np.inf)  # gaps[i]: after the i-th; one for the end
        new = np.diff(ordered_part, prepend=-1) != 0
        first = np.flatnonzero(new)  # each part's first and last (sorted) row
        last = np.append(first[1:], len(order)) - 1
        cut = np.zeros(len(order), dtype=np.bool_)  # a cut after the i-th
        while len(first):
            at = _first_widest(gaps, first, last)
            cut[at] = True
            first = np.concatenate([first, at + 1])
            last = np.concatenate([at, last])
            wider = ordered[last] - ordered[first] > limit
            first, last = first[wider], last[wider]
        run = np.cumsum(new | np.roll(cut, 1)) - 1
        part[order] = parts + run
        parts += int(run[-1]) + 1
    order = np.argsort(part, kind="stable")  # stable: rows stay ascending in each part
    sizes = np.bincount(part)
    return rows[order], _starts(sizes[sizes > 0])


def _sort_within(part: IntArray, value: FloatArray) -> IntArray:
    """Order of rows by ``part``, then ``value`` (ties in any order): one sort of integers."""
    rank = np.empty(len(value), dtype=np.int64)
    rank[np.argsort(value)] = np.arange(len(value))
    return np.argsort(part * len(value) + rank)


def _first_widest(gaps: FloatArray, first: IntArray, last: IntArray) -> IntArray:
    """For each run ``first[r]..last[r]`` (two rows or more), the first of its widest gaps."""
    lengths = last - first
    starts = _starts(lengths)
    at = np.arange(int(lengths.sum())) + np.repeat(first - starts, lengths)
    inside = gaps[at]
    widest = np.maximum.reduceat(inside, starts)
    hit = np.flatnonzero(inside == np.repeat(widest, lengths))
    run = np.repeat(np.arange(len(first)), lengths)[hit]
    result: IntArray = at[hit[np.diff(run, prepend=-1) != 0]]
    return result


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
