"""The completion-time estimator's tuning constants, in one place.

Each is a weight of prior evidence, a forgetting rate or a bound of the model; none is a setting
an operator changes. ``qlm.rct.calibration`` learns with them per instance, ``qlm.rct.estimator``
predicts with them (docs/estimator.md says what each term of the model is).
"""

from __future__ import annotations

# --- online calibration (qlm.rct.calibration) ---------------------------------------------------

PRIOR_COMPLETIONS = 30.0
"""Weight of the profile in the drain-rate calibration, in completions: the first few
completions, which come in bursts, cannot swing it."""

RATE_FORGETTING = 0.995
"""Weight of the past per completion, for the drain rate, the decode speed and the preemption
rate: about the last 200 completions are remembered."""

PRIOR_DECODE_S = 600.0
"""Weight of the profile in the decode-speed calibration, in seconds of decode; forgotten at
``RATE_FORGETTING`` like the observations, so it fades once they are many."""

SPEED_PRIOR_SD = 0.3
"""Spread of ``log(actual / predicted time per output token)`` before any decode is observed ..."""

SPEED_PRIOR_N = 20.0
"""... worth this many observed decodes."""

SLOPE_PRIOR = 20.0
"""Weight of "predictions come true" (slope 1 of the actual on the predicted departure of the
time per token from the recent mean), in departures of 10 %."""

SLOPE_CENTER_ARRIVALS = 64.0
"""The recent mean of predicted times per token that departures are measured from: an
exponential mean over about this many arrivals."""

PREEMPT_PRIOR = 10.0
"""Weight of "no preemptions" in an instance's preemptions per completed request, in
completions."""

# --- the estimator (qlm.rct.estimator, qlm.rct.beliefs, qlm.rct.loads) --------------------------

FILL_SHARE = 0.75
"""An instance is filling its batch while fewer than this share of the batch it will hold run
(and requests wait to be admitted): such requests learn a decode-speed factor of their own."""

GROUP_SUMS_MAX = 100_000
"""Groups whose sums ``GroupLoader`` (``qlm.rct.loads``) keeps at most (``keep`` prunes them;
past this, nobody did, and they are all dropped)."""

PROMPT_BIN_WIDTH = 0.125
"""With ``by_prompt``, output beliefs are kept per bin of ``log(1 + prompt tokens)``: bins 13 %
wide."""

POOL_STRENGTH = 10.0
"""Weight of the class-wide output belief in a prompt bin's belief, in outputs."""
