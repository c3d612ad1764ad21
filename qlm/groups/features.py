"""What makes two requests similar: the feature vector k-means and online classification compare.

A request's partition key ``(model, tier, slo_class, deadline window)`` is matched exactly: groups
never mix models, priority tiers, SLO classes or deadlines more than a window apart. Inside a partition, four numeric features (natural logarithms, so a
factor counts the same at every size):

=====================  ======  ===============================================================
feature                weight  value
=====================  ======  ===============================================================
``log_e2e_slo``        2       ``log(slo.e2e_s)``
``log_ttft_slo``       1       ``log(slo.ttft_s)``, or ``log(slo.e2e_s)`` without a TTFT SLO
``log_input_tokens``   1       ``log(1 + input_tokens)``
``log_output_tokens``  1       ``log(1 + predicted output)``, the prediction clamped to
                               ``[1, max_tokens]``
=====================  ======  ===============================================================

Besides the partition, three features are bounded within a group (hard rules, see ``Grouper``):
the SLOs spread by at most ``slo_ratio`` and the prompt lengths by at most ``input_ratio``. Prompt
length is most of what a request costs (prefill), so a group's members cost alike and the planner
and cost-aware admission (``qlm.planner.admission``) can judge a group by its mean.

Each feature is divided by its standard deviation over the waiting requests (at least
``MIN_SCALE``, so a feature that barely varies is not blown up; ``DEFAULT_SCALE`` before the first
re-clustering), then multiplied by its weight. Deadlines weigh double: requests whose SLOs differ by
a factor ``slo_ratio`` are never grouped anyway (a hard rule, see ``Grouper``), and among compatible
ones a group should be as homogeneous in deadline as in length, because the planner orders whole
groups by their earliest deadline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from qlm.domain import Request, Tier

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

GroupKey = tuple[str, Tier, str, int]
"""Partition of a request: (model, tier, slo_class, deadline window), matched exactly."""

PredictOutput = Callable[[Request], float]
"""Predicted output tokens of a waiting request (the estimator plugs in its posterior mean)."""

FEATURES = ("log_e2e_slo", "log_ttft_slo", "log_input_tokens", "log_output_tokens")
WEIGHTS: FloatArray = np.array([2.0, 1.0, 1.0, 1.0])
MIN_SCALE = 0.5
DEFAULT_SCALE: FloatArray = np.ones(len(FEATURES))
BOUNDED_FEATURES = 3
"""The first three features are bounded within a group: the two SLOs by ``slo_ratio``, the prompt
length by ``input_ratio`` (``GroupingConfig``)."""

DEFAULT_OUTPUT_TOKENS = 256
"""Output length guessed before the estimator knows better: between the mean outputs of the Azure
conversation trace (211 tokens) and ShareGPT (439)."""


def default_predict_output(request: Request) -> float:
    """``min(max_tokens, DEFAULT_OUTPUT_TOKENS)``: all a policy may know without a fitted model."""
    return float(min(request.max_tokens, DEFAULT_OUTPUT_TOKENS))


def predict_outputs(
    predict_output: PredictOutput, requests: Iterable[Request], caps: FloatArray
) -> FloatArray:
    """``predict_output`` of many requests (``caps``: their ``max_tokens``), called in their
    order; ``default_predict_output``'s from ``caps`` at once, the same numbers."""
    if predict_output is default_predict_output:
        result: FloatArray = np.minimum(caps, float(DEFAULT_OUTPUT_TOKENS))
        return result
    return np.fromiter(map(predict_output, requests), np.float64, len(caps))


def group_key(request: Request, deadline_window: float = 0.0) -> GroupKey:
    """``(model, tier, slo_class, window)``: ``window`` numbers the slice of absolute deadlines,
    each ``deadline_window`` × the request's SLO wide, that its deadline falls in (0 when
    ``deadline_window`` is 0). Requests that arrive far apart in time then never share a group:
    a group is ordered by its earliest deadline, and an old member must not drag new ones with it
    (or a hopeless old one hide feasible new ones)."""
    window = 0
    if deadline_window > 0:
        window = math.floor(request.deadline_s / (deadline_window * request.slo.e2e_s))
    return (request.model, request.tier, request.slo_class, window)


def group_keys(
    bases: Sequence[tuple[str, Tier, str]],
    base: IntArray,
    arrival: FloatArray,
    e2e: FloatArray,
    deadline_window: float = 0.0,
) -> tuple[list[GroupKey], IntArray]:
    """``group_key`` of many requests at once, given as arrays: request ``i`` has ``(model, tier,
    slo_class)`` ``bases[base[i]]``, ``arrival_s`` ``arrival[i]`` and end-to-end SLO ``e2e[i]``.
    Returns the distinct keys, sorted, and the index of each request's key among them. The
    windows are computed with the same floating-point operations as ``group_key``'s."""
    n = len(base)
    if deadline_window > 0:
        window = np.floor((arrival + e2e) / (deadline_window * e2e)).astype(np.int64)
    else:
        window = np.zeros(n, dtype=np.int64)
    low = int(window.min()) if n else 0
    span = (int(window.max()) - low + 1) if n else 1
    combos, codes = np.unique(base * span + (window - low), return_inverse=True)
    found = [(*bases[int(c) // span], int(c) % span + low) for c in combos]
    keys = sorted(found)
    rank = {key: i for i, key in enumerate(keys)}
    remap = np.array([rank[key] for key in found], dtype=np.int64)
    return keys, remap[codes.reshape(-1)]


def raw_features(request: Request, predict_output: PredictOutput) -> FloatArray:
    """The unscaled feature vector of one request (natural-log units)."""
    slo = request.slo
    ttft = slo.e2e_s if slo.ttft_s is None else slo.ttft_s
    output = min(max(predict_output(request), 1.0), float(request.max_tokens))
    return np.array(
        [math.log(slo.e2e_s), math.log(ttft), math.log1p(request.input_tokens), math.log1p(output)]
    )


def raw_feature_matrix(
    e2e: FloatArray, ttft: FloatArray, inputs: FloatArray, caps: FloatArray, predicted: FloatArray
) -> FloatArray:
    """``raw_features`` of many requests at once, one row each, from arrays of their end-to-end
    and TTFT SLOs (the end-to-end one when they have none), prompt tokens, ``max_tokens`` and
    predicted output tokens."""
    output = np.minimum(np.maximum(predicted, 1.0), caps)
    return np.column_stack([np.log(e2e), np.log(ttft), np.log1p(inputs), np.log1p(output)])


def fit_multipliers(raw: FloatArray) -> FloatArray:
    """Per-feature ``weight / max(std, MIN_SCALE)`` over the rows of ``raw``: the space k-means uses."""
    if len(raw) < 2:
        return WEIGHTS / DEFAULT_SCALE
    result: FloatArray = WEIGHTS / np.maximum(raw.std(axis=0), MIN_SCALE)
    return result


def predicted_output(raw: FloatArray) -> FloatArray:
    """The (clamped) predicted output tokens back from rows of raw features."""
    result: FloatArray = np.expm1(raw[..., 3])
    return result


def fnv1a(ids: Sequence[str]) -> tuple[npt.NDArray[np.uint64], IntArray]:
    """FNV-1a over the characters of each id, and the number of characters (as numpy counts
    them: trailing NULs dropped)."""
    chars_of = np.array(ids, dtype=np.str_)
    width = chars_of.dtype.itemsize // 4
    chars = np.ascontiguousarray(chars_of).view(np.uint32).reshape(len(ids), width)
    lengths = np.char.str_len(chars_of).astype(np.int64)
    h = np.full(len(ids), _FNV_OFFSET, dtype=np.uint64)
    for j in range(width):
        on = j < lengths
        h[on] = (h[on] ^ chars[on, j].astype(np.uint64)) * _FNV_PRIME
    return h, lengths


def stable_hash(hashes: npt.NDArray[np.uint64], lengths: IntArray) -> npt.NDArray[np.uint64]:
    """FNV-1a over the characters of each id padded with NULs to the longest id's length, from
    ``fnv1a`` of the ids: the same ids hash the same in every process."""
    width = max(int(lengths.max()) if len(lengths) else 0, 1)
    powers = np.ones(width + 1, dtype=np.uint64)
    np.cumprod(np.full(width, _FNV_PRIME, dtype=np.uint64), out=powers[1:])  # modulo 2**64
    result: npt.NDArray[np.uint64] = hashes * powers[width - lengths]  # a NUL only multiplies
    return result


_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
