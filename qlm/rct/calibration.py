"""Online calibration of the completion-time estimator, per instance, from completed requests.

What an instance's profile predicts is corrected by what the instance is seen doing (ratio-of-sums
with exponential forgetting, each shrunk toward the profile by pseudo-evidence):

- ``κ_W``, the drain rate: seconds between completions while requests wait for a slot, per second
  of the work *predicted* for them (not their actual work: while a queue builds the short outputs
  complete first, and their actual work would call the instance slow); kept in [1/4, 4].
- ``ε``, the decode speed: observed over predicted decode time, kept in [1/2, 2]; a factor of its
  own for requests that arrived while the batch filled.
- ``β``, the slope of the actual on the predicted departure of the time per token from what recent
  arrivals were predicted (log scale): how much of a prediction made from the instance's state on
  arrival comes true.
- ``ρ``, preemptions per completed request, from the engine's counter.
- The spreads of waiting-time errors and of ``log(actual / predicted time per output token)``,
  which make ``P(C ≤ SLO)`` not over-confident.

A completion is judged against the prediction made when its request arrived (``Prediction``) and
against the preemption rate it met, not the one known at its arrival, so that ``κ_W`` and ``ε`` do
not learn the preemptions a second time. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from qlm.rct.tuning import (
    PREEMPT_PRIOR,
    PRIOR_COMPLETIONS,
    PRIOR_DECODE_S,
    RATE_FORGETTING,
    SLOPE_CENTER_ARRIVALS,
    SLOPE_PRIOR,
    SPEED_PRIOR_N,
    SPEED_PRIOR_SD,
)


def shrunk(per_token: float, center: float | None, slope: float) -> float:
    """A time per token predicted from the instance's state now, regressed toward the recent
    predictions' mean (log scale) by the slope observed: unsaturated, the batch a request decodes
    in turns over while it runs, and how much of today's departure from the usual lasts is an
    empirical matter (ShareGPT replays: 0–0.2; Azure conv: 1)."""
    if center is None or per_token <= 0 or slope >= 1.0:
        return per_token
    return math.exp(center + slope * (math.log(per_token) - center))


@dataclass(frozen=True, slots=True)
class Prediction:
    """What was predicted for a request when it arrived (``RCTEstimator.estimate_requests`` with
    ``remember``): its completion teaches the calibration against this, not later predictions."""

    instance: str
    wait_raw: float  # work ahead in seconds, before calibration
    d_eff: float  # ε · d from the profile, before calibration
    redo: float  # 1 + the preemption rate it was predicted with ...
    d_prefill: float  # ... and the prefill per token in d_eff it multiplied (refilled prompts)
    per_token_s: float  # the time per output token predicted (calibrated)
    log_raw: float  # log of the time per token before the slope: the regressor ...
    center: float  # ... and the recent mean it departed from
    mean_latency: float
    work_in: float  # its own prompt work (s) and the work per output token (s)
    work_per_output: float
    output_mean: float  # the output it was expected to generate
    filling: bool = False  # arrived while the batch was filling


@dataclass(slots=True)
class Calibration:
    """Online corrections for one instance (ratio-of-sums with exponential forgetting)."""

    wait_obs: float = 0.0
    wait_pred: float = 0.0
    decode_obs: float = 0.0
    decode_pred: float = 0.0
    # The same for requests that arrived while the batch was filling (slots free, others waiting
    # to be admitted): each step then also prefills the prompts being admitted, a regime of its
    # own that must not teach the full batch's factor.
    fill_obs: float = 0.0
    fill_pred: float = 0.0
    fill_prior: float = 1.0
    # Observed log(actual / predicted time per token): count and sum of squares, starting from
    # the prior's pseudo-observations (forgotten like the observations).
    speed_n: float = SPEED_PRIOR_N
    speed_sq: float = SPEED_PRIOR_N * SPEED_PRIOR_SD**2
    n_wait: float = 0.0
    wait_e2: float = 0.0  # sum of squared waiting errors ...
    wait_p2: float = 0.0  # ... and of squared predicted waits
    saturated: bool = False  # had waiting requests at the last estimate

    arrivals: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    # Regression of the actual log time per token on the predicted one, both about the recent
    # predictions' mean (``speed_center``): how much of a prediction's departure from what recent
    # arrivals were told comes true.
    speed_center: float | None = None
    slope_xy: float = 0.0
    slope_xx: float = 0.0

    def arrival_rate(self) -> float:
        """Requests per second recently sent to this instance (0 until a few arrived)."""
        if len(self.arrivals) < 8:
            return 0.0
        span = self.arrivals[-1] - self.arrivals[0]
        return (len(self.arrivals) - 1) / span if span > 0 else 0.0

    last_finish: float | None = None
    work_done: float = 0.0  # profile-seconds of work completed while saturated ...
    busy_time: float = 0.0  # ... the wall time it took ...
    done: float = 0.0  # ... and how many completions that was
    # What is left of the profile's pseudo-evidence on decode speed: forgotten at the rate of the
    # observations (else, where decodes are short, 600 s of profile would outweigh them forever).
    decode_prior: float = 1.0
    # Preemptions per completion: the engine's counter when last read, the preemptions since
    # the last completion, and their sums over completions (forgotten like the drain rate).
    preempt_seen: int | None = None
    preempt_new: float = 0.0
    preempt_sum: float = 0.0
    preempt_done: float = 0.0

    def count_preemptions(self, total: int | None) -> None:
        """Read the engine's preemption counter (a counter that went down is a restarted
        engine: counted from there)."""
        if total is None:
            return
        if self.preempt_seen is not None and total >= self.preempt_seen:
            self.preempt_new += total - self.preempt_seen
        self.preempt_seen = total

    def completed(self) -> None:
        """A request finished on this instance: the preemptions since the last one are its."""
        self.preempt_sum = RATE_FORGETTING * self.preempt_sum + self.preempt_new
        self.preempt_done = RATE_FORGETTING * self.preempt_done + 1.0
        self.preempt_new = 0.0

    def preemption_rate(self) -> float:
        """Preemptions per completed request (0 until the engine is seen preempting). Each one
        throws away what the victim — the newest admitted, usually a prompt being prefilled in
        chunks — had computed, about one prompt of the mix, recomputed when it is readmitted."""
        return (self.preempt_sum + self.preempt_new) / (self.preempt_done + PREEMPT_PRIOR)

    def wait_factor(self) -> float:
        """Seconds per profile-second of work: the observed drain rate of a saturated instance
        (online calibration of Θ and w_in); the ratio of observed to predicted waits before."""
        if self.busy_time > 0 and self.work_done > 0:
            # Shrunk toward the profile (factor 1) by PRIOR_COMPLETIONS of pseudo-evidence,
            # so that the first few completions, which come in bursts, cannot swing it.
            prior = PRIOR_COMPLETIONS * self.work_done / max(self.done, 1e-9)
            ratio = (self.busy_time + prior) / (self.work_done + prior)
            return min(4.0, max(0.25, ratio))
        ratio = self.wait_obs / self.wait_pred if self.wait_pred > 1.0 else 1.0
        return min(4.0, max(0.25, ratio))

    def eps_factor(self, filling: bool = False) -> float:
        """Observed over predicted decode time, shrunk toward 1 (the profile) by
        ``PRIOR_DECODE_S`` seconds of pseudo-evidence: decode speed depends on the load regime,
        and a few early completions must not set it for everyone after them. The pseudo-evidence
        is forgotten like the observations, so it fades once they are many. ``filling``: the
        factor of requests that arrived while the batch filled, learnt from them alone."""
        if filling:
            obs, pred, weight = self.fill_obs, self.fill_pred, self.fill_prior
        else:
            obs, pred, weight = self.decode_obs, self.decode_pred, self.decode_prior
        prior = weight * PRIOR_DECODE_S
        return min(2.0, max(0.5, (obs + prior) / (pred + prior)))

    def speed_slope(self) -> float:
        """Share of a predicted departure from the recent mean that actually happens (1 until
        observations say otherwise: pseudo-evidence of ``SLOPE_PRIOR`` departures of 10 %)."""
        prior = SLOPE_PRIOR * 0.01
        return min(1.0, max(0.0, (self.slope_xy + prior) / (self.slope_xx + prior)))

    def shrink(self) -> tuple[float | None, float]:
        """(centre, slope) for ``shrunk``: what the time per token predicted from the state an
        instance is in now is regressed by toward what recent arrivals were predicted."""
        return self.speed_center, self.speed_slope()

    def speed_sd(self) -> float:
        """Spread of the time per output token around what was predicted for it when the
        request arrived (the batch a request decodes in changes under it, and the calibration
        moves on while it waits): ``SPEED_PRIOR_SD`` until decodes are observed. Root mean
        square, not centred: a bias the calibration has not caught up with is error too."""
        return min(1.0, math.sqrt(max(self.speed_sq / self.speed_n, 0.0)))

    def wait_rel_sd(self) -> float:
        """Relative spread of waiting-time errors seen so far (model error beyond the output
        lengths of the requests ahead); 0.25 until 20 waits were observed."""
        if self.n_wait < 20 or self.wait_p2 <= 0:
            return 0.25
        return min(2.0, math.sqrt(self.wait_e2 / self.wait_p2))

    def note_arrival(self, now: float, log_raw: float, center: float | None) -> None:
        """A request predicted on arrival (to be learnt from): counts toward the arrival rate,
        and its log time per token (before the slope) moves the recent mean ``center`` the
        prediction was made with."""
        self.arrivals.append(now)
        c = log_raw if center is None else center
        self.speed_center = c + (log_raw - c) / SLOPE_CENTER_ARRIVALS

    def completed_unpredicted(self, finish_s: float) -> None:
        """A request nothing was predicted for finished (one in flight when the estimator
        started, e.g. after a controller failover): its work is unknown, so the interval since
        the last completion is not counted, but it ends it."""
        self.completed()
        if self.last_finish is None or finish_s > self.last_finish:
            self.last_finish = finish_s

    def learn(
        self,
        pred: Prediction,
        *,
        arrival_s: float,
        output_tokens: int,
        scheduled_s: float | None,
        first_token_s: float | None,
        finish_s: float | None,
        forgetting: float,
    ) -> None:
        """A request predicted on arrival (``pred``) finished: learn the drain rate, the decode
        speed, the slope and the error spreads from it. ``forgetting``: the weight of the past
        per completion for the waiting and speed-error sums."""
        # Judged against the preemptions it met, not those known when it arrived: else the
        # calibration learns them too, and counts them twice once the rate is known.
        redo = 1.0 + self.preemption_rate()
        self.completed()
        lam = forgetting
        d_eff = pred.d_eff + pred.d_prefill * (redo - pred.redo)
        work_in = pred.work_in * redo / pred.redo
        if finish_s is not None:
            if self.saturated and self.last_finish is not None and finish_s >= self.last_finish:
                # While requests wait, completions happen at the instance's service rate.
                rf = RATE_FORGETTING
                self.done = rf * self.done + 1
                self.work_done = (
                    rf * self.work_done + work_in + pred.output_mean * pred.work_per_output
                )
                self.busy_time = rf * self.busy_time + (finish_s - self.last_finish)
            self.last_finish = (
                finish_s if self.last_finish is None else max(self.last_finish, finish_s)
            )
        if scheduled_s is not None and pred.wait_raw > 0:
            self.wait_obs = lam * self.wait_obs + (scheduled_s - arrival_s)
            self.wait_pred = lam * self.wait_pred + pred.wait_raw
        if first_token_s is not None and finish_s is not None and output_tokens > 1:
            decoding = finish_s - first_token_s
            if pred.filling:
                self.fill_obs = RATE_FORGETTING * self.fill_obs + decoding
                self.fill_pred = RATE_FORGETTING * self.fill_pred + d_eff * (output_tokens - 1)
                self.fill_prior *= RATE_FORGETTING
            else:
                self.decode_obs = RATE_FORGETTING * self.decode_obs + decoding
                self.decode_pred = RATE_FORGETTING * self.decode_pred + d_eff * (output_tokens - 1)
                self.decode_prior *= RATE_FORGETTING
            observed = decoding / (output_tokens - 1)
            if observed > 0 and pred.per_token_s > 0:
                r = math.log(observed / pred.per_token_s)
                self.speed_n = lam * self.speed_n + 1
                self.speed_sq = lam * self.speed_sq + r * r
                dx, dy = pred.log_raw - pred.center, math.log(observed) - pred.center
                self.slope_xy = lam * self.slope_xy + dx * dy
                self.slope_xx = lam * self.slope_xx + dx * dx
        if scheduled_s is not None and pred.wait_raw > 1e-3:
            predicted = pred.wait_raw * self.wait_factor()
            error = scheduled_s - arrival_s - predicted
            self.n_wait = lam * self.n_wait + 1
            self.wait_e2 = lam * self.wait_e2 + error * error
            self.wait_p2 = lam * self.wait_p2 + predicted * predicted
