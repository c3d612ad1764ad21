"""The Bayesian output-length model: NIG conjugate update and capped/conditional log-normal moments."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import integrate, stats

from qlm.errors import ConfigError
from qlm.rct.output_model import (
    HIST_BINS,
    HIST_MAX,
    NIG,
    LengthHistogram,
    _sample_moments,
    cap_moments,
    lognormal_capped_moments,
    lognormal_capped_moments_np,
    pair_moments,
)

PRIOR = NIG(mu=3.0, kappa=2.0, alpha=3.0, beta=4.0)
OUTPUTS = [19, 99, 7]  # log(1 + O) = log 20, log 100, log 8


def textbook_posterior(prior: NIG, outputs: list[int]) -> tuple[float, float, float, float]:
    """Batch NIG posterior (Murphy 2007, "Conjugate Bayesian analysis of the Gaussian
    distribution", eqs. 86-89), with beta in its sum-of-squares form:
    beta_n = beta_0 + (sum x^2 + kappa_0 mu_0^2 - kappa_n mu_n^2) / 2."""
    xs = [math.log(1 + o) for o in outputs]
    n = len(xs)
    kappa_n = prior.kappa + n
    mu_n = (prior.kappa * prior.mu + sum(xs)) / kappa_n
    alpha_n = prior.alpha + n / 2
    beta_n = prior.beta + 0.5 * (
        sum(x * x for x in xs) + prior.kappa * prior.mu**2 - kappa_n * mu_n**2
    )
    return mu_n, kappa_n, alpha_n, beta_n


def params(nig: NIG) -> tuple[float, float, float, float]:
    return (nig.mu, nig.kappa, nig.alpha, nig.beta)


# --- conjugate update ----------------------------------------------------------------------------


def test_the_worked_example_posterior_has_the_textbook_parameters() -> None:
    mu_n, kappa_n, alpha_n, beta_n = textbook_posterior(PRIOR, OUTPUTS)
    # By hand: x = (2.995732, 4.605170, 2.079442), sum 9.680344, sum of squares 34.506081;
    # kappa_n = 2 + 3 = 5, alpha_n = 3 + 3/2 = 4.5, mu_n = (2 * 3 + 9.680344) / 5 = 3.136069,
    # beta_n = 4 + (34.506081 + 2 * 9 - 5 * 3.136069^2) / 2 = 5.665722.
    assert kappa_n == 5.0 and alpha_n == 4.5
    assert mu_n == pytest.approx(3.136069, abs=1e-6)
    assert beta_n == pytest.approx(5.665722, abs=1e-6)


def test_updating_three_times_gives_the_textbook_posterior() -> None:
    post = PRIOR.update(OUTPUTS[0]).update(OUTPUTS[1]).update(OUTPUTS[2])
    assert params(post) == pytest.approx(textbook_posterior(PRIOR, OUTPUTS), rel=1e-12)


def test_a_batch_update_gives_the_textbook_posterior() -> None:
    post = PRIOR.update_many(OUTPUTS)
    assert params(post) == pytest.approx(textbook_posterior(PRIOR, OUTPUTS), rel=1e-12)


def test_updating_one_at_a_time_equals_updating_in_a_batch() -> None:
    rng = np.random.default_rng(7)
    outputs = [int(o) for o in rng.lognormal(mean=5.0, sigma=1.2, size=200)]
    prior = NIG(mu=4.0, kappa=20.0, alpha=11.0, beta=8.0)
    sequential = prior
    for o in outputs:
        sequential = sequential.update(o)
    assert params(sequential) == pytest.approx(params(prior.update_many(outputs)), rel=1e-9)


def test_a_batch_update_with_no_outputs_keeps_the_prior() -> None:
    assert PRIOR.update_many([]) == PRIOR


def test_a_fitted_prior_centres_on_the_sample_log_mean_with_the_sample_log_variance() -> None:
    rng = np.random.default_rng(3)
    outputs = [int(o) for o in rng.lognormal(mean=5.5, sigma=0.9, size=1_000)]
    logs = np.log1p(outputs)
    prior = NIG.fit(outputs, strength=12.0)
    assert prior.mu == pytest.approx(float(logs.mean()), rel=1e-12)
    assert prior.kappa == 12.0
    # The prior's expected variance E[sigma^2] = beta / (alpha - 1) is the sample's log variance.
    assert prior.beta / (prior.alpha - 1) == pytest.approx(float(logs.var(ddof=1)), rel=1e-9)


def test_the_predictive_spread_is_the_student_t_variance() -> None:
    nig = NIG(mu=4.0, kappa=5.0, alpha=3.0, beta=2.0)
    scale = math.sqrt(nig.beta * (nig.kappa + 1) / (nig.alpha * nig.kappa))
    t = stats.t(df=2 * nig.alpha, loc=nig.mu, scale=scale)
    assert nig.predictive_log_sd == pytest.approx(math.sqrt(t.var()), rel=1e-12)


def test_nig_moments_are_the_capped_moments_of_its_predictive() -> None:
    nig = NIG(mu=4.0, kappa=5.0, alpha=3.0, beta=2.0)
    expected = lognormal_capped_moments(nig.mu, nig.predictive_log_sd, cap=300, generated=20)
    assert nig.moments(cap=300, generated=20) == expected


@pytest.mark.parametrize(
    ("mu", "kappa", "alpha", "beta"),
    [
        (4.0, 0.0, 3.0, 1.0),
        (4.0, -1.0, 3.0, 1.0),
        (4.0, 1.0, 1.0, 1.0),  # alpha must exceed 1 for the variance to exist
        (4.0, 1.0, 0.5, 1.0),
        (4.0, 1.0, 3.0, 0.0),
        (4.0, 1.0, 3.0, -2.0),
        (4.0, math.nan, 3.0, 1.0),
    ],
)
def test_invalid_nig_parameters_are_refused(
    mu: float, kappa: float, alpha: float, beta: float
) -> None:
    with pytest.raises(ConfigError, match="NIG needs"):
        NIG(mu=mu, kappa=kappa, alpha=alpha, beta=beta)


def test_fitting_a_prior_needs_two_lengths_and_a_positive_strength() -> None:
    with pytest.raises(ConfigError, match="at least 2"):
        NIG.fit([100])
    with pytest.raises(ConfigError, match="NIG needs"):
        NIG.fit([100, 200], strength=0.0)


# --- capped and conditional log-normal moments ---------------------------------------------------


def monte_carlo(
    mu: float, sd: float, cap: int, generated: int, *, n: int = 200_000, seed: int = 0
) -> tuple[float, float]:
    """Mean and variance of ``min(O, cap) - g`` given ``O >= g``, ``log(1 + O) ~ N(mu, sd^2)``, by
    drawing normals and keeping those at or above ``log(1 + g)`` (rejection)."""
    rng = np.random.default_rng(seed)
    a = math.log1p(generated)
    kept: list[np.ndarray] = []
    count = 0
    while count < n:
        x = rng.normal(mu, sd, n)
        x = x[x >= a]
        kept.append(x)
        count += x.size
    y = np.minimum(np.expm1(np.concatenate(kept)[:n]), cap) - generated
    return float(y.mean()), float(y.var())


MC_CASES = [
    pytest.param(5.0, 1.0, 4096, 0, id="nearly-uncapped"),
    pytest.param(5.0, 1.0, 60, 0, id="cap-below-median"),
    pytest.param(4.0, 1.2, 2000, 100, id="conditional"),
    pytest.param(4.0, 0.8, 150, 80, id="conditional-and-capped"),
    pytest.param(6.0, 0.5, 300, 10, id="conditional-cap-below-median"),
]


@pytest.mark.parametrize(("mu", "sd", "cap", "generated"), MC_CASES)
def test_capped_moments_match_a_monte_carlo(mu: float, sd: float, cap: int, generated: int) -> None:
    mean, var = lognormal_capped_moments(mu, sd, cap=cap, generated=generated)
    mc_mean, mc_var = monte_carlo(mu, sd, cap, generated)
    assert mean == pytest.approx(mc_mean, rel=0.01)
    assert var == pytest.approx(mc_var, rel=0.03)


@pytest.mark.parametrize(("mu", "sd", "cap", "generated"), MC_CASES)
def test_capped_moments_match_numerical_integration(
    mu: float, sd: float, cap: int, generated: int
) -> None:
    a, b = math.log1p(generated), math.log1p(cap)
    mass = stats.norm.sf(a, mu, sd)

    def moment(k: int) -> float:
        def f(x: float) -> float:
            return (min(math.expm1(x), cap) - generated) ** k * stats.norm.pdf(x, mu, sd)

        inside = integrate.quad(f, a, b, epsabs=0, epsrel=1e-12, limit=200)[0]
        above = (cap - generated) ** k * stats.norm.sf(b, mu, sd)
        return (inside + above) / mass

    m1 = moment(1)
    mean, var = lognormal_capped_moments(mu, sd, cap=cap, generated=generated)
    assert mean == pytest.approx(m1, rel=1e-8)
    assert var == pytest.approx(moment(2) - m1 * m1, rel=1e-6)


def test_an_uncapped_request_has_the_log_normal_mean() -> None:
    mean, _ = lognormal_capped_moments(4.0, 0.5, cap=10**9)
    assert mean == pytest.approx(math.exp(4.0 + 0.125) - 1, rel=1e-9)


@pytest.mark.parametrize("generated", [100, 101, 5000])
def test_a_request_that_reached_its_cap_has_nothing_left(generated: int) -> None:
    assert lognormal_capped_moments(4.0, 1.0, cap=100, generated=generated) == (0.0, 0.0)


def test_the_mean_never_exceeds_what_is_left_under_the_cap() -> None:
    for mu, sd, cap, g in itertools.product(
        [0.5, 2.0, 4.0, 6.0, 8.0], [0.05, 0.3, 1.0, 2.5], [1, 7, 100, 1023, 10**6], [0, 1, 50, 900]
    ):
        mean, var = lognormal_capped_moments(mu, sd, cap=cap, generated=g)
        room = max(cap - g, 0)
        assert 0.0 <= mean <= room, (mu, sd, cap, g, mean)
        # A quantity in [0, room] has variance at most room^2 / 4 (Popoviciu).
        assert 0.0 <= var <= room * room / 4 * (1 + 1e-9) + 1e-9, (mu, sd, cap, g, var)


def test_the_vectorised_moments_equal_the_scalar_ones_elementwise() -> None:
    grid = [
        (mu, sd, cap, g)
        for mu, sd, cap, g in itertools.product(
            [1.0, 3.0, 4.5, 6.0], [0.2, 0.7, 1.5], [1, 30, 400, 1023, 10**5], [0, 5, 120, 1023]
        )
        # Keep to where the conditioning event is not vanishingly rare: beyond ~5 standard
        # deviations both versions lose digits to cancellation, in different ways.
        if (math.log1p(g) - mu) / sd < 5
    ]
    mu, sd, cap, g = (np.array(col, dtype=float) for col in zip(*grid, strict=True))
    means, variances = lognormal_capped_moments_np(mu, sd, cap, g)
    scalar = [lognormal_capped_moments(*p[:2], cap=p[2], generated=p[3]) for p in grid]
    np.testing.assert_allclose(means, [s[0] for s in scalar], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(variances, [s[1] for s in scalar], rtol=1e-7, atol=1e-9)


def test_the_vectorised_moments_handle_finished_and_past_belief_requests_like_the_scalar() -> None:
    # cap <= generated (nothing left) and a request far past what the model believed possible.
    grid = [(4.0, 1.0, 100, 100), (4.0, 1.0, 100, 200), (1.0, 0.1, 10**4, 5000)]
    mu, sd, cap, g = (np.array(col, dtype=float) for col in zip(*grid, strict=True))
    means, variances = lognormal_capped_moments_np(mu, sd, cap, g)
    scalar = [lognormal_capped_moments(*p[:2], cap=p[2], generated=p[3]) for p in grid]
    assert means.tolist() == [s[0] for s in scalar]
    assert variances.tolist() == [s[1] for s in scalar]


def test_a_fitted_prior_keeps_the_workloads_own_shape_of_lengths() -> None:
    # A nearly symmetric length distribution, far from log-normal (like ShareGPT's).
    rng = np.random.default_rng(11)
    outputs = [int(x) for x in rng.uniform(300, 600, size=20_000)]
    prior = NIG.fit(outputs, strength=1e6)  # a very confident prior: predictive = the sample
    assert len(prior.shape) == 256
    mean, var = prior.moments(cap=10_000)
    assert mean == pytest.approx(float(np.mean(outputs)), rel=0.01)
    assert math.sqrt(var) == pytest.approx(float(np.std(outputs)), rel=0.03)
    # The chance of finishing within 450 tokens is the sample's, not a log-normal's.
    assert prior.p_remaining_within(450, cap=10_000) == pytest.approx(0.5, abs=0.02)
    assert prior.p_remaining_within(250, cap=10_000) < 0.01
    # Given 500 tokens already generated, at most 100 more are expected.
    rest, _ = prior.moments(cap=10_000, generated=500)
    assert 0 < rest < 100
    assert prior.p_remaining_within(100, cap=10_000, generated=500) == pytest.approx(1.0, abs=0.02)


def test_updates_keep_the_shape_and_move_the_location() -> None:
    prior = NIG.fit([100, 200, 300, 400, 500] * 20, strength=5)
    post = prior.update_many([2000] * 50)
    assert post.shape == prior.shape
    assert post.moments(cap=100_000)[0] > 2 * prior.moments(cap=100_000)[0]


@pytest.mark.parametrize("shaped", [True, False])
def test_moments_for_many_generated_counts_equal_the_one_at_a_time_moments(shaped: bool) -> None:
    rng = np.random.default_rng(5)
    prior = NIG.fit([int(x) for x in rng.lognormal(5, 0.8, size=2_000)], strength=10)
    if not shaped:
        prior = NIG(prior.mu, prior.kappa, prior.alpha, prior.beta)
    generated = np.array([0, 1, 17, 150, 400, 999, 1000, 1500], dtype=float)
    means, variances = prior.moments_many(cap=1000, generated=generated)
    for g, m, v in zip(generated, means, variances, strict=True):
        em, ev = prior.moments(cap=1000, generated=int(g))
        assert m == pytest.approx(em, rel=1e-9, abs=1e-9)
        assert v == pytest.approx(ev, rel=1e-6, abs=1e-6)


# --- the shape-free model -------------------------------------------------------------------------


def bin_of(output: int) -> int:
    return int(math.log1p(output) / math.log1p(HIST_MAX) * HIST_BINS)


def test_a_histogram_prior_holds_the_nig_predictive_worth_kappa_outputs() -> None:
    prior = NIG(mu=math.log1p(200), kappa=20.0, alpha=30.0, beta=0.25 * 29)
    h = LengthHistogram.from_prior(prior)
    assert sum(h.prior) == pytest.approx(20.0)
    assert np.median(h.outputs) == pytest.approx(200, rel=0.06)  # the NIG's median, to a bin
    assert h.p_remaining_within(200, cap=10_000) == pytest.approx(0.5, abs=0.03)


def test_the_dirichlet_update_adds_one_to_the_bin_of_each_output() -> None:
    h = LengthHistogram.from_prior(PRIOR)
    one = h.update(900)
    assert one.prior == h.prior
    assert one.data[bin_of(900)] == 1.0 and sum(one.data) == 1.0
    three = one.update(30).update(900)
    assert three.data[bin_of(900)] == 2.0 and three.data[bin_of(30)] == 1.0
    # The predictive is the normalised counts: prior pseudo-counts plus the three outputs.
    total = sum(h.prior) + 3
    upto = sum(h.prior[: bin_of(30) + 1]) + 1
    assert three.p_remaining_within(
        math.expm1((bin_of(30) + 1) * math.log1p(HIST_MAX) / HIST_BINS), cap=10**6
    ) == pytest.approx(upto / total, abs=0.01)


def test_the_histogram_learns_a_two_humped_mix_a_location_scale_model_cannot() -> None:
    """60 % short answers near 50 tokens, 40 % near 400: the chance of at most 200 tokens is
    0.6; the NIG, updated with the same outputs, puts it far off (it can only move and widen)."""
    rng = np.random.default_rng(0)
    outputs = np.where(rng.random(3000) < 0.6, rng.normal(50, 8, 3000), rng.normal(400, 20, 3000))
    h = LengthHistogram.from_prior(PRIOR)
    nig = PRIOR
    for o in outputs.astype(int):
        h = h.update(int(o))
        nig = nig.update(int(o))
    assert h.p_remaining_within(200, cap=10_000) == pytest.approx(0.6, abs=0.03)
    assert abs(nig.p_remaining_within(200, cap=10_000) - 0.6) > 0.05
    mean, _ = h.moments(cap=10_000)
    assert mean == pytest.approx(0.6 * 50 + 0.4 * 400, rel=0.05)


def test_histogram_moments_respect_the_cap_and_what_was_generated() -> None:
    h = LengthHistogram.from_prior(PRIOR)
    for o in (40, 60, 400, 420):
        h = h.update(o)
    mean, _ = h.moments(cap=100)
    assert 0 < mean <= 100
    assert h.moments(cap=100, generated=100) == (0.0, 0.0)
    left, _ = h.moments(cap=1000, generated=300)  # past the short answers: ~400 in all
    assert 50 < left < 200
    many, _ = h.moments_many(cap=1000, generated=np.array([0.0, 300.0]))
    assert many[1] == pytest.approx(left)
    assert h.p_remaining_within(5, cap=1000, generated=995) == 1.0


def test_sample_moments_by_suffix_sums_equal_the_direct_computation() -> None:
    rng = np.random.default_rng(3)
    outputs = np.sort(rng.lognormal(5.0, 1.0, 256))
    cap = 400
    generated = np.array([0.0, 10.0, 150.0, 399.0, 400.0, 5000.0, float(outputs[-1]) + 1])
    mean, var = _sample_moments(outputs, cap, generated)
    for g, m, v in zip(generated, mean, var, strict=True):
        alive = outputs[outputs >= g]
        if cap <= g:
            assert (m, v) == (0.0, 0.0)
        elif not alive.size:
            assert (m, v) == (min(max(cap - g, 0.0), 1.0), 0.0)
        else:
            left = np.minimum(alive, cap) - g
            assert m == pytest.approx(left.mean(), rel=1e-9)
            assert v == pytest.approx(left.var(), rel=1e-6, abs=1e-6)


def test_running_requests_count_as_outputs_longer_than_what_they_generated() -> None:
    """Right-censoring: a queue's short outputs complete first. Learning from completions alone
    says outputs are short; counting the still-running long ones (known to exceed what they
    generated) recovers how many are short — the Kaplan–Meier step (how far above 100 tokens
    the long ones end, nothing has told yet: the belief above 100 tokens spreads them)."""
    rng = np.random.default_rng(1)
    outputs = np.where(rng.random(2000) < 0.5, 50, 400)
    h = LengthHistogram.from_prior(PRIOR)
    for o in outputs[outputs == 50]:  # every short one finished ...
        h = h.update(int(o))
    running = np.full(int((outputs == 400).sum()), 100.0)  # ... the long ones are at 100 tokens
    assert h.p_remaining_within(100, cap=10_000) > 0.95  # completions alone: nearly all short
    both = h.with_censored(running)
    assert both.p_remaining_within(100, cap=10_000) == pytest.approx(0.5, abs=0.03)
    assert both.moments(cap=10_000)[0] > 1.5 * h.moments(cap=10_000)[0]
    assert sum(both.data) == pytest.approx(len(outputs))  # one count per request
    assert h.with_censored(np.array([])) is h
    # Censored at 0 tokens says nothing about the shape: the probabilities stay.
    np.testing.assert_allclose(
        h.with_censored(np.zeros(50)).probabilities(), h.probabilities(), atol=1e-12
    )


def test_a_subset_belief_follows_the_whole_until_its_own_outputs_outweigh_it() -> None:
    whole = LengthHistogram.from_prior(PRIOR)
    for o in (50, 60, 70):
        whole = whole.update(o)
    empty = whole.conditioned(None, strength=10.0)
    np.testing.assert_allclose(empty.probabilities(), whole.probabilities(), atol=1e-12)
    assert sum(empty.prior) == pytest.approx(10.0)
    counts = np.zeros(HIST_BINS)
    counts[bin_of(900)] = 90.0  # 90 outputs of ~900 tokens against a prior worth 10
    own = whole.conditioned(counts, strength=10.0)
    assert own.p_remaining_within(800, cap=10_000) == pytest.approx(0.1, abs=0.02)


@pytest.mark.parametrize("n", [0, 1, 7, 256])
def test_cap_moments_are_the_one_cap_moments_to_the_last_bit(n: int) -> None:
    rng = np.random.default_rng(n)
    outputs = np.sort(rng.lognormal(5.0, 1.0, n).round())
    caps = np.array([0, 1, 16, 100, 333, 2048, 10**6], np.float64)
    means, variances = cap_moments(outputs, caps)
    for cap, m, v in zip(caps, means, variances, strict=True):
        one_m, one_v = _sample_moments(outputs, int(cap), np.array([0.0]))
        assert (float(m), float(v)) == (float(one_m[0]), float(one_v[0])), cap


@pytest.mark.parametrize("n", [0, 1, 7, 256])
def test_pair_moments_are_the_one_request_moments_to_the_last_bit(n: int) -> None:
    rng = np.random.default_rng(n)
    outputs = np.sort(rng.lognormal(5.0, 1.0, n).round())
    caps = rng.choice([0, 1, 16, 100, 333, 2048, 10**6], 200).astype(np.float64)
    generated = rng.choice([0, 1, 5, 99, 100, 150, 400, 2047, 5000], 200).astype(np.float64)
    means, variances = pair_moments(outputs, caps, generated)
    for cap, g, m, v in zip(caps, generated, means, variances, strict=True):
        one_m, one_v = _sample_moments(outputs, int(cap), np.array([g]))
        assert (float(m), float(v)) == (float(one_m[0]), float(one_v[0])), (cap, g)
