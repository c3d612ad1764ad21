"""Bayesian model of output lengths (paper §6, Eq. 3, made Bayesian).

The length of a request's output is unknown until it finishes. We model ``X = log(1 + O)`` as
normal with unknown mean and variance under a conjugate Normal–Inverse-Gamma prior,
``(μ, σ²) ~ NIG(μ0, κ0, α0, β0)``, fitted from a workload profile (a trace's output lengths) and
updated with every completed request of the same (model, SLO class). Working on the log scale fits
the heavy right tail of real output lengths (Azure conv: mean 211, p99 601; ShareGPT: mean 439)
far better than the paper's plain normal.

Conjugate update after observing ``x`` (one request)::

    κ' = κ + 1,  μ' = (κ μ + x) / κ',  α' = α + 1/2,  β' = β + κ (x − μ)² / (2 κ')

The posterior predictive of a new ``X`` is Student-t with ``2α`` degrees of freedom, location ``μ``
and scale² ``β (κ + 1) / (α κ)``. Real length distributions are not log-normal (ShareGPT's is
nearly symmetric, Azure code's has a spike of very short outputs), so the *shape* of the
predictive is the workload's own: ``X = μ + s · ε`` with ``s`` the predictive standard deviation
and ``ε`` drawn from the standardised log-lengths of the profiled sample (kept as 256 quantiles in
``shape``). The NIG still learns location and scale from every completion; the shape says how the
mass is spread. Without a shape (``shape == ()``), ``ε`` is standard normal and ``O = exp(X) − 1``
is log-normal with closed-form moments. Either way the moments are those of the tokens still to
generate, ``min(O, cap) − g`` given ``O ≥ g``: a request cannot exceed ``max_tokens``, and a running
request has already generated ``g``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from scipy.special import ndtr, ndtri

from qlm.errors import ConfigError

_SQRT2 = math.sqrt(2.0)
SHAPE_POINTS = 256


def _phi(z: float) -> float:
    """Standard normal CDF."""
    return 0.5 * math.erfc(-z / _SQRT2)


@dataclass(frozen=True, slots=True)
class NIG:
    """Normal–Inverse-Gamma belief over the mean and variance of ``log(1 + O)``."""

    mu: float
    kappa: float
    alpha: float
    beta: float
    shape: tuple[float, ...] = ()  # sorted quantiles of the standardised log-lengths, or normal

    def __post_init__(self) -> None:
        if not (self.kappa > 0 and self.alpha > 1 and self.beta > 0):
            raise ConfigError(
                f"NIG needs kappa > 0, alpha > 1, beta > 0; got kappa={self.kappa}, "
                f"alpha={self.alpha}, beta={self.beta}"
            )

    @classmethod
    def fit(cls, outputs: list[int] | tuple[int, ...], *, strength: float = 20.0) -> NIG:
        """Empirical-Bayes prior from a sample of output lengths, worth ``strength`` observations:
        centred on the sample's log mean, with the sample's log variance as its expected variance."""
        if len(outputs) < 2:
            raise ConfigError("fitting an output-length prior needs at least 2 lengths")
        xs = [math.log1p(max(0, o)) for o in outputs]
        n = len(xs)
        mean = sum(xs) / n
        var = max(sum((x - mean) ** 2 for x in xs) / (n - 1), 1e-6)
        alpha = strength / 2 + 1  # > 1 so that the variance exists
        z = (np.asarray(xs) - mean) / math.sqrt(var)
        quantiles = np.quantile(z, (np.arange(SHAPE_POINTS) + 0.5) / SHAPE_POINTS)
        return cls(
            mu=mean,
            kappa=strength,
            alpha=alpha,
            beta=var * (alpha - 1),
            shape=tuple(round(float(q), 6) for q in quantiles),
        )

    def update(self, output_tokens: int) -> NIG:
        """The posterior after one more observed output length (closed form, see module doc)."""
        x = math.log1p(max(0, output_tokens))
        k1 = self.kappa + 1
        return NIG(
            mu=(self.kappa * self.mu + x) / k1,
            kappa=k1,
            alpha=self.alpha + 0.5,
            beta=self.beta + self.kappa * (x - self.mu) ** 2 / (2 * k1),
            shape=self.shape,
        )

    def update_many(self, outputs: list[int]) -> NIG:
        """Batch form of ``update`` (the same result as updating one at a time)."""
        if not outputs:
            return self
        xs = [math.log1p(max(0, o)) for o in outputs]
        n = len(xs)
        xbar = sum(xs) / n
        ss = sum((x - xbar) ** 2 for x in xs)
        kn = self.kappa + n
        return NIG(
            mu=(self.kappa * self.mu + n * xbar) / kn,
            kappa=kn,
            alpha=self.alpha + n / 2,
            beta=self.beta + 0.5 * ss + self.kappa * n * (xbar - self.mu) ** 2 / (2 * kn),
            shape=self.shape,
        )

    @property
    def predictive_log_sd(self) -> float:
        """Standard deviation of the predictive of ``log(1 + O)`` (Student-t variance)."""
        nu = 2 * self.alpha
        scale2 = self.beta * (self.kappa + 1) / (self.alpha * self.kappa)
        return math.sqrt(scale2 * nu / (nu - 2)) if nu > 2 else math.sqrt(scale2 * 3)

    def moments(self, *, cap: int, generated: int = 0) -> tuple[float, float]:
        """Mean and variance of the tokens still to generate, ``min(O, cap) − g``, given ``O ≥ g``
        with ``g = generated`` (0 for a request that has not started)."""
        if not self.shape:
            return lognormal_capped_moments(
                self.mu, self.predictive_log_sd, cap=cap, generated=generated
            )
        if cap <= generated:
            return 0.0, 0.0
        outputs = np.expm1(self.mu + self.predictive_log_sd * np.asarray(self.shape))
        alive = outputs[outputs >= generated]
        if alive.size == 0:
            return min(float(cap - generated), 1.0), 0.0
        remaining = np.minimum(alive, cap) - generated
        return float(remaining.mean()), float(remaining.var())

    def moments_many(
        self, *, cap: int, generated: npt.NDArray[np.float64]
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """``moments`` for many values of ``generated`` at once (same cap), vectorised."""
        g = np.asarray(generated, dtype=np.float64)
        if not self.shape:
            n = g.size
            return lognormal_capped_moments_np(
                np.full(n, self.mu), np.full(n, self.predictive_log_sd), np.full(n, float(cap)), g
            )
        outputs = np.expm1(self.mu + self.predictive_log_sd * np.asarray(self.shape))
        return _sample_moments(outputs, cap, g)

    def p_remaining_within(self, tokens: float, *, cap: int, generated: int = 0) -> float:
        """``P(min(O, cap) − g ≤ tokens | O ≥ g)``: the chance the rest fits in ``tokens``."""
        if tokens < 0:
            return 0.0
        if generated + tokens >= cap:
            return 1.0
        sd = self.predictive_log_sd
        a = (math.log1p(generated) - self.mu) / sd
        b = (math.log1p(generated + tokens) - self.mu) / sd
        if self.shape:
            grid = np.asarray(self.shape)
            probs = (np.arange(len(grid)) + 0.5) / len(grid)
            fa = float(np.interp(a, grid, probs, left=0.0, right=1.0))
            fb = float(np.interp(b, grid, probs, left=0.0, right=1.0))
        else:
            fa, fb = _phi(a), _phi(b)
        tail = 1.0 - fa
        if tail < 1e-12:
            return 1.0
        return min(1.0, max(0.0, (fb - fa) / tail))


def lognormal_capped_moments(
    mu: float, sd: float, *, cap: int, generated: int = 0
) -> tuple[float, float]:
    """Mean and variance of ``min(O, cap) − g`` given ``O ≥ g``, where ``log(1 + O) ~ N(mu, sd²)``.

    With ``Y = 1 + O = e^X``: on ``[a, b) = [log(1 + g), log(1 + cap))`` use the partial moments
    ``E[e^{kX}; a ≤ X < b] = e^{kμ + k²σ²/2} (Φ((b − μ − kσ²)/σ) − Φ((a − μ − kσ²)/σ))``, and above
    ``b`` the value is capped at ``cap``.
    """
    if cap <= generated:
        return 0.0, 0.0
    a = math.log1p(max(generated, 0))
    b = math.log1p(cap)
    s2 = sd * sd
    p_above_a = 1.0 - _phi((a - mu) / sd)
    if p_above_a < 1e-12:
        # Already past everything the model believed possible: expect a little more.
        return min(float(cap - generated), 1.0), 0.0
    p_above_b = 1.0 - _phi((b - mu) / sd)

    def partial(k: int) -> float:
        return math.exp(k * mu + k * k * s2 / 2) * (
            _phi((b - mu - k * s2) / sd) - _phi((a - mu - k * s2) / sd)
        )

    y_cap = 1.0 + cap
    m1 = (partial(1) + y_cap * p_above_b) / p_above_a
    m2 = (partial(2) + y_cap * y_cap * p_above_b) / p_above_a
    var = max(0.0, m2 - m1 * m1)
    mean = m1 - 1.0 - generated
    return max(mean, 0.0), var


def lognormal_capped_moments_np(
    mu: npt.NDArray[np.float64],
    sd: npt.NDArray[np.float64],
    cap: npt.NDArray[np.float64],
    generated: npt.NDArray[np.float64],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Vectorised ``lognormal_capped_moments`` over arrays of requests (same formulas)."""
    a = np.log1p(np.maximum(generated, 0.0))
    b = np.log1p(cap)
    s2 = sd * sd
    p_a = ndtr(-(a - mu) / sd)
    p_b = ndtr(-(b - mu) / sd)
    y_cap = 1.0 + cap
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        part1 = np.exp(mu + s2 / 2) * (ndtr((b - mu - s2) / sd) - ndtr((a - mu - s2) / sd))
        part2 = np.exp(2 * mu + 2 * s2) * (
            ndtr((b - mu - 2 * s2) / sd) - ndtr((a - mu - 2 * s2) / sd)
        )
        m1 = (part1 + y_cap * p_b) / p_a
        m2 = (part2 + y_cap * y_cap * p_b) / p_a
    var = np.maximum(m2 - m1 * m1, 0.0)
    mean = np.maximum(m1 - 1.0 - generated, 0.0)
    degenerate = (p_a < 1e-12) | (cap <= generated)
    mean = np.where(degenerate, np.minimum(np.maximum(cap - generated, 0.0), 1.0), mean)
    var = np.where(degenerate, 0.0, var)
    return mean, var


HIST_BINS = 128  # bins of log(1 + O) from 0 to log(1 + HIST_MAX)
HIST_MAX = 131_072
_HIST_EDGES = np.linspace(0.0, math.log1p(HIST_MAX), HIST_BINS + 1)
_HIST_PROBS = (np.arange(SHAPE_POINTS) + 0.5) / SHAPE_POINTS


@dataclass(frozen=True, slots=True)
class LengthHistogram:
    """A shape-free belief over output lengths: a Dirichlet over ``HIST_BINS`` bins of
    ``log(1 + O)`` (uniform inside a bin), conjugate to observing which bin an output falls in.

    The prior's pseudo-counts are the workload profile's distribution (``from_prior``: the NIG's
    predictive, its shape included) worth ``NIG.kappa`` outputs; each completion adds one count
    to its bin (the Dirichlet update); the predictive is the normalised counts. (Discounting old
    counts, to follow a drifting mix faster, was tried: under load completions lag the arrivals
    they would describe by minutes, and waiting predictions got worse.)

    Why not location–scale: real output lengths are mixtures whose weights drift — Azure
    conversation outputs are short answers plus a spike near 400 tokens whose share moves from
    49 % to 18 % over the trace — and a location–scale model can only answer a smaller share by
    moving the spike, which puts a third of true outputs above its 90th percentile. Moments and probabilities are computed as for ``NIG``: on ``SHAPE_POINTS``
    quantiles of the predictive, capped at ``max_tokens`` and conditioned on what a running
    request has generated."""

    prior: tuple[float, ...]  # pseudo-counts per bin
    data: tuple[float, ...] = ()  # counts of observed outputs per bin (empty: none yet)
    outputs: npt.NDArray[np.float64] = field(  # quantiles of the predictive, in tokens
        default_factory=lambda: np.empty(0), compare=False, repr=False
    )
    log_outputs: npt.NDArray[np.float64] = field(  # the same, as log(1 + O)
        default_factory=lambda: np.empty(0), compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if len(self.prior) != HIST_BINS or (self.data and len(self.data) != HIST_BINS):
            raise ValueError(f"a length histogram has {HIST_BINS} bins")
        counts = np.asarray(self.prior, np.float64)
        if self.data:
            counts = counts + np.asarray(self.data, np.float64)
        total = float(counts.sum())
        if not total > 0:
            raise ValueError("a length histogram needs positive counts")
        cdf = np.concatenate(([0.0], np.cumsum(counts) / total))
        # Quantiles of log(1 + O): the CDF is linear inside each bin (flat where a bin is empty;
        # interp over the strictly increasing part picks the bin a probability falls in).
        keep = np.concatenate(([True], np.diff(cdf) > 0))
        xs = np.interp(_HIST_PROBS, cdf[keep], _HIST_EDGES[keep])
        object.__setattr__(self, "log_outputs", xs)
        object.__setattr__(self, "outputs", np.expm1(xs))

    @classmethod
    def from_prior(cls, prior: NIG) -> LengthHistogram:
        """The profile's belief as pseudo-counts: ``prior.kappa`` outputs spread as its
        predictive (``SHAPE_POINTS`` quantiles of it, or a normal one without a shape)."""
        z = np.asarray(prior.shape) if prior.shape else _normal_quantiles()
        x = np.clip(prior.mu + prior.predictive_log_sd * z, 0.0, _HIST_EDGES[-1] - 1e-9)
        counts = np.histogram(x, bins=_HIST_EDGES)[0].astype(np.float64)
        counts *= prior.kappa / counts.sum()
        return cls(tuple(float(c) for c in counts))

    def update(self, output_tokens: int) -> LengthHistogram:
        """The posterior after one more observed output: its bin's count + 1."""
        data = list(self.data) if self.data else [0.0] * HIST_BINS
        data[length_bin(output_tokens)] += 1.0
        return LengthHistogram(self.prior, tuple(data))

    def probabilities(self) -> npt.NDArray[np.float64]:
        """The predictive probability of each bin."""
        counts = np.asarray(self.prior, np.float64)
        if self.data:
            counts = counts + np.asarray(self.data, np.float64)
        return counts / float(counts.sum())

    def conditioned(
        self, counts: npt.NDArray[np.float64] | None, strength: float
    ) -> LengthHistogram:
        """The belief of a subset of requests (e.g. those with prompts of one length): this
        belief worth ``strength`` outputs as its prior, and the subset's own ``counts`` per
        bin as its data (hierarchical shrinkage: a subset with few outputs yet follows the
        whole; one with many, its own)."""
        prior = tuple(float(v) for v in self.probabilities() * strength)
        data = tuple(float(v) for v in counts) if counts is not None else ()
        return LengthHistogram(prior, data)

    def with_censored(self, generated: npt.ArrayLike) -> LengthHistogram:
        """The belief that also counts requests still running, each known only to exceed the
        tokens it has ``generated`` (right-censored): one expected count spread over the bins
        above that, as the current belief spreads them (one step of the Kaplan–Meier / EM
        estimate).

        Without them the belief is biased short whenever a queue builds up: short outputs
        complete first, so the completions seen so far under-represent the long ones still
        decoding. The counts are not kept: the request adds its true bin when it completes."""
        g = np.asarray(generated, np.float64)
        if g.size == 0:
            return self
        counts = np.asarray(self.prior, np.float64)
        data = np.asarray(self.data, np.float64) if self.data else np.zeros(HIST_BINS)
        p = (counts + data) / float((counts + data).sum())
        x = np.minimum(np.log1p(np.maximum(g, 0.0)), _HIST_EDGES[-1] - 1e-9)
        bins = np.minimum((x / _HIST_EDGES[-1] * HIST_BINS).astype(np.int64), HIST_BINS - 1)
        censored = np.bincount(bins, minlength=HIST_BINS).astype(np.float64)
        tail = np.cumsum(p[::-1])[::-1]  # P(bin ≥ b)
        alive = tail > 1e-12
        spread = p * np.cumsum(np.where(alive, censored / np.where(alive, tail, 1.0), 0.0))
        spread += np.where(alive, 0.0, censored)  # past all the mass: their own bin
        return LengthHistogram(self.prior, tuple(float(v) for v in data + spread))

    def moments(self, *, cap: int, generated: int = 0) -> tuple[float, float]:
        """Mean and variance of the tokens still to generate, ``min(O, cap) − g``, given
        ``O ≥ g``."""
        mean, var = self.moments_many(cap=cap, generated=np.array([float(generated)]))
        return float(mean[0]), float(var[0])

    def moments_many(
        self, *, cap: int, generated: npt.NDArray[np.float64]
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        return _sample_moments(self.outputs, cap, generated)

    def p_remaining_within(self, tokens: float, *, cap: int, generated: int = 0) -> float:
        """``P(min(O, cap) − g ≤ tokens | O ≥ g)``."""
        if tokens < 0:
            return 0.0
        if generated + tokens >= cap:
            return 1.0
        grid = self.log_outputs
        fa = float(np.interp(math.log1p(generated), grid, _HIST_PROBS, left=0.0, right=1.0))
        fb = float(
            np.interp(math.log1p(generated + tokens), grid, _HIST_PROBS, left=0.0, right=1.0)
        )
        tail = 1.0 - fa
        if tail < 1e-12:
            return 1.0
        return min(1.0, max(0.0, (fb - fa) / tail))


def length_bin(output_tokens: int) -> int:
    """The ``LengthHistogram`` bin an output of ``output_tokens`` falls in."""
    x = min(math.log1p(max(0, output_tokens)), float(_HIST_EDGES[-1]) - 1e-9)
    return min(int(x / _HIST_EDGES[-1] * HIST_BINS), HIST_BINS - 1)


def _normal_quantiles() -> npt.NDArray[np.float64]:
    return np.asarray(ndtri(_HIST_PROBS), np.float64)


def _sample_moments(
    outputs: npt.NDArray[np.float64], cap: int, generated: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Moments of ``min(O, cap) − g`` given ``O ≥ g`` over equally likely ``outputs`` (sorted
    ascending), for each ``g`` in ``generated`` (past every one of them: expect a little more).
    Suffix sums over the sorted sample make it O(log n) per ``g``: after a completion changes a
    posterior, every running request's moments are recomputed at once."""
    g = np.asarray(generated, dtype=np.float64)
    capped = np.minimum(outputs, cap)
    s1 = np.concatenate((np.cumsum(capped[::-1])[::-1], [0.0]))
    s2 = np.concatenate((np.cumsum((capped * capped)[::-1])[::-1], [0.0]))
    first = np.searchsorted(outputs, g, side="left")  # the first output ≥ g
    count = len(outputs) - first
    safe = np.maximum(count, 1)
    m1 = s1[first] / safe
    mean = m1 - g
    var = np.maximum(s2[first] / safe - m1 * m1, 0.0)  # min(O, cap) − g varies as min(O, cap)
    none_alive = count == 0
    mean = np.where(none_alive, np.minimum(np.maximum(cap - g, 0.0), 1.0), mean)
    var = np.where(none_alive, 0.0, var)
    done = cap <= g
    return np.where(done, 0.0, mean), np.where(done, 0.0, var)


def cap_moments(
    outputs: npt.NDArray[np.float64], caps: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """``_sample_moments(outputs, cap, [0])`` for each of ``caps`` at once: the moments of a
    request that has generated nothing, for every cap of one belief. The same numbers to the
    last bit (each row's suffix sums add in the same order as the one-cap version's); after a
    completion moves a belief, the waiting requests' many caps are priced together."""
    caps = np.asarray(caps, np.float64)
    n = len(outputs)
    if n == 0 or len(caps) == 0:
        empty = np.zeros(len(caps))
        return (
            np.where(caps <= 0, 0.0, np.minimum(np.maximum(caps, 0.0), 1.0)),
            empty,
        )
    first = int(np.searchsorted(outputs, 0.0, side="left"))  # the first output ≥ 0
    capped = np.minimum(outputs[None, :], caps[:, None])
    # suffix sums from the end, as ``_sample_moments`` takes them; only the one at ``first``
    s1 = np.cumsum(capped[:, ::-1], axis=1)[:, n - 1 - first] if first < n else np.zeros(len(caps))
    s2 = (
        np.cumsum((capped * capped)[:, ::-1], axis=1)[:, n - 1 - first]
        if first < n
        else np.zeros(len(caps))
    )
    count = n - first
    safe = max(count, 1)
    m1 = s1 / safe
    mean = m1 - 0.0
    var = np.maximum(s2 / safe - m1 * m1, 0.0)
    if count == 0:
        mean = np.minimum(np.maximum(caps - 0.0, 0.0), 1.0)
        var = np.zeros(len(caps))
    done = caps <= 0.0
    return np.where(done, 0.0, mean), np.where(done, 0.0, var)


def pair_moments(
    outputs: npt.NDArray[np.float64],
    caps: npt.NDArray[np.float64],
    generated: npt.NDArray[np.float64],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """``_sample_moments(outputs, caps[i], [generated[i]])`` for each pair ``i`` at once: the
    moments of many requests of one belief, each with its own cap and tokens generated (the
    running requests after a completion moved the belief). The same numbers to the last bit: one
    row of suffix sums per distinct cap, added in the same order as the one-cap version's, read
    at each request's first output ≥ ``g``."""
    caps = np.asarray(caps, np.float64)
    g = np.asarray(generated, np.float64)
    n = len(outputs)
    first = np.searchsorted(outputs, g, side="left")  # the first output ≥ g
    count = n - first
    alive = count > 0
    s1 = np.zeros(len(caps))
    s2 = np.zeros(len(caps))
    if n and alive.any():
        uniq, row = np.unique(caps, return_inverse=True)
        capped = np.minimum(outputs[None, :], uniq[:, None])
        col = np.where(alive, n - 1 - first, 0)
        # suffix sums from the end, as ``_sample_moments`` takes them
        s1 = np.where(alive, np.cumsum(capped[:, ::-1], axis=1)[row, col], 0.0)
        s2 = np.where(alive, np.cumsum((capped * capped)[:, ::-1], axis=1)[row, col], 0.0)
    safe = np.maximum(count, 1)
    m1 = s1 / safe
    mean = m1 - g
    var = np.maximum(s2 / safe - m1 * m1, 0.0)
    mean = np.where(alive, mean, np.minimum(np.maximum(caps - g, 0.0), 1.0))
    var = np.where(alive, var, 0.0)
    done = caps <= g
    return np.where(done, 0.0, mean), np.where(done, 0.0, var)


OutputBelief = NIG | LengthHistogram
"""What the estimator believes about a (model, SLO class)'s output lengths."""
