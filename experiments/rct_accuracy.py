"""Accuracy of the RCT estimator (paper §8.3, "RCT estimator accuracy").

Replays two workloads under FCFS (vLLM's behaviour: least-loaded dispatch, FCFS in each engine) on
simulated A100 and on simulated H100 instances. At each request's arrival — the moment it is
dispatched — the estimator predicts its completion time from what production would know: the
instance's running batch (with the tokens each request generated so far) and its waiting queue, the
profile, and the output-length posterior; never the true output lengths. Completions feed the
estimator online (posterior and calibration) as they happen, so every prediction uses only the past.

Workloads (the output-length prior is always fitted on data the evaluation does not replay), both
heavy enough that queues form — the regime the estimator exists for:
- ``azure-conv``: minutes 10–25 of the Azure conversation trace at ``--azure-rate`` × its rate;
  the prior is fitted on its first 10 minutes;
- ``sharegpt``: ``--sharegpt-duration`` seconds of Poisson arrivals at ``--sharegpt-rate`` req/s with
  lengths sampled from one half of the ShareGPT length file; the prior is fitted on the other half.
On H100 both rates are multiplied by 2.5 (an H100 serves about 2.5× an A100 here).
Both use the W_B SLO classes (interactive 20 s, standard 60 s, batch 300 s), so the predicted
``P(meet SLO)`` spans the whole range.

Arrivals do not stop at the end of the measured window: ``--tail`` seconds more follow it (Azure:
the trace after its first 10 minutes taken as a loop, never reaching into the window; ShareGPT:
more Poisson arrivals) and are served but neither predicted nor measured, so the window's last
requests decode in a batch that keeps being refilled, as a running service's would, not in one
draining because the replay ran out. The replay stops when every measured request has finished.
Each window starts cold (empty instances, an estimator that has learnt nothing) unless
``--warmup`` seconds of arrivals precede it (taken the same way; predicted and learnt from, not
measured).

Prints R² of predicted vs actual end-to-end latency, the ceiling of that R² for any estimator that
does not know output lengths (actual time to first token and time per token, every output replaced
by the mean output), R² of the waiting part alone (arrival to first scheduled), the calibration
of the output-length model alone (where each true output falls in the predictive the estimator
used for it, by decile: 10 % each when calibrated), and a calibration table (predicted
``P(meet SLO)`` in deciles vs the observed frequency, with a 95 % interval of each pooled
decile's gap that counts requests arriving within ``--cluster-s`` seconds of one replay as one
cluster, since they share their errors). ``--prior window`` (a diagnostic, not a result) fits
the output-length prior on the measured window's own outputs. Writes ``experiments/results/rct_accuracy.json``
and ``rct_accuracy.png`` (scatter plots).

Reproduce: .venv/bin/python experiments/rct_accuracy.py
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.stats import t as student_t
from stamp import write_result

from qlm.domain import Request, RequestRecord
from qlm.engines.perf_model import default_catalog
from qlm.engines.sim import SimEngine
from qlm.fleet import parse_instances
from qlm.planner import create_policy
from qlm.profiling.sim import profile_sim_hardware
from qlm.rct.estimator import RCTEstimator
from qlm.rct.fit import profile_workload
from qlm.rct.inputs import EstimatorInstance, Queued
from qlm.rct.profile import RctProfile
from qlm.sim.cluster import ClusterSimulation
from qlm.sim.traces import (
    LengthSample,
    Trace,
    load_lengths,
    load_trace,
    scale_rate,
    synthetic,
    window,
)
from qlm.sim.workload import create_workload

R2_TARGET, CAL_TOLERANCE, CAL_MIN_N = 0.95, 0.10, 50
TAIL_S = 300.0  # arrivals go on this long after the measured window (until its requests finish)
WARMUP_S = 0.0  # and start this long before it (0: the window starts cold)


@dataclass
class Recorder:
    """Predicts at dispatch (through the production estimator), learns at completion."""

    estimator: RCTEstimator
    views: dict[str, EstimatorInstance]
    requests: dict[str, Request]
    predicted: dict[str, tuple[float, float]] = field(default_factory=dict)  # id -> (mean, p)
    predicted_wait: dict[str, float] = field(default_factory=dict)
    output_pit: dict[str, float] = field(default_factory=dict)  # P(O <= o | belief at dispatch)
    actual_wait: dict[str, float] = field(default_factory=dict)
    decode: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    actual: dict[str, float] = field(default_factory=dict)
    met: dict[str, bool] = field(default_factory=dict)
    scored: frozenset[str] | None = None  # the measured requests (None: all of them)
    tail: frozenset[str] = frozenset()  # arrivals after every measured one: not predicted
    pending: set[str] = field(default_factory=set)  # measured ones not finished yet

    def __post_init__(self) -> None:
        self.pending = set(self.scored or ())

    def view(self, engine: SimEngine) -> EstimatorInstance:
        """The instance as an agent sees it now (with the engine's preemption counter)."""
        return dataclasses.replace(
            self.views[engine.name], preemptions_total=engine.preemptions_total
        )

    def on_dispatch(self, now: float, request: Request, engine: SimEngine) -> None:
        if request.id in self.tail:
            # A tail request arrives after every measured one has been predicted: what the
            # estimator would learn from it could only change predictions nobody measures.
            self.estimator.watch(self.view(engine))
            return
        queue = [
            Queued(self.requests[rid], generated, running)
            for rid, generated, running in engine.queue_view()
        ]
        estimates = self.estimator.estimate_requests(
            self.view(engine), queue, now, remember=True, only=[-1]
        )
        est = estimates[-1]  # the request just dispatched is the last in FCFS order
        self.predicted[request.id] = (
            est.mean - request.arrival_s,
            est.p_before(request.deadline_s),
        )
        self.predicted_wait[request.id] = self.estimator.predicted_wait(request.id)
        if est.output is not None and request.replay_output_tokens is not None:
            # Where the true output falls in the predictive the estimator used: uniform on [0, 1]
            # when the output-length model is calibrated (probability integral transform).
            self.output_pit[request.id] = est.output.p_remaining_within(
                request.replay_output_tokens, cap=request.max_tokens
            )

    def on_finish(self, record: RequestRecord) -> None:
        req = record.request
        self.estimator.observe(
            req,
            output_tokens=record.output_tokens,
            scheduled_s=record.scheduled_s,
            first_token_s=record.first_token_s,
            finish_s=record.finish_s,
            instance=record.instance or None,
        )
        self.met[req.id] = record.slo_met
        if record.e2e_s is not None:
            self.actual[req.id] = record.e2e_s
        if record.queue_s is not None:
            self.actual_wait[req.id] = record.queue_s
        if record.first_token_s is not None and record.finish_s is not None:
            per_token = (record.finish_s - record.first_token_s) / max(record.output_tokens - 1, 1)
            self.decode[req.id] = (
                record.first_token_s - req.arrival_s,
                per_token,
                record.output_tokens,
            )
        self.pending.discard(req.id)
        if self.scored is not None and not self.pending:
            raise ReplayDone


class ReplayDone(Exception):
    """Every scored request has finished: what the tail's requests do next is not measured."""


def run_case(
    name: str,
    requests: list[Request],
    prior_outputs: list[int],
    fleet: str,
    *,
    tail: list[Request] | None = None,
    warmup: list[Request] | None = None,
    by_prompt: bool = False,
) -> dict[str, object]:
    """Replay ``warmup``, ``requests`` and ``tail`` and measure the estimator on ``requests``.
    The warm-up's arrivals bring instances and estimator to the state a running service would
    be in when the window starts (predicted and learnt from, not measured); the tail's keep
    arriving after it, so that its last requests are served as the trace would go on, not by a
    draining instance. The replay stops once every measured request has finished."""
    specs = parse_instances(fleet)
    catalog = default_catalog()
    hardware = {}
    for spec in specs:
        for model in spec.models:
            hw = profile_sim_hardware(catalog.perf_model(model, spec.gpu, spec.gpu_count))
            hardware[hw.key] = hw
    profile = RctProfile(
        hardware=hardware, output_priors={"default": profile_workload(prior_outputs)}
    )
    views = {
        s.name: EstimatorInstance(s.name, s.gpu, s.gpu_count, active_model=s.models[0])
        for s in specs
    }
    estimator = RCTEstimator(profile, by_prompt=by_prompt)
    tail, warmup = tail or [], warmup or []
    replay = [*warmup, *requests, *tail]
    recorder = Recorder(
        estimator,
        views,
        {r.id: r for r in replay},
        scored=frozenset(r.id for r in requests),
        tail=frozenset(r.id for r in tail),
    )
    sim = ClusterSimulation(specs, create_policy("fcfs"), observer=recorder)
    with contextlib.suppress(ReplayDone):
        sim.run(replay)
    scored = {r.id for r in requests}
    met = recorder.met
    ids = [rid for rid in recorder.actual if rid in recorder.predicted and rid in scored]
    pred = np.array([recorder.predicted[i][0] for i in ids])
    act = np.array([recorder.actual[i] for i in ids])
    p = np.array([recorder.predicted[i][1] for i in ids])
    obs = np.array([met[i] for i in ids], dtype=float)
    r2 = r_squared(pred, act)
    wait_pred = np.array([recorder.predicted_wait[i] for i in ids])
    wait_act = np.array([recorder.actual_wait[i] for i in ids])
    r2_wait = r_squared(wait_pred, wait_act)
    # The best any estimator that does not know output lengths could do: the actual time to the
    # first token and the actual time per token, with every output replaced by the mean output.
    ttft_a = np.array([recorder.decode[i][0] for i in ids])
    per_tok = np.array([recorder.decode[i][1] for i in ids])
    outs = np.array([recorder.decode[i][2] for i in ids])
    r2_ceiling = r_squared(ttft_a + (outs.mean() - 1) * per_tok, act)
    rows = calibration_rows(p, obs)
    pit = np.array([recorder.output_pit[i] for i in ids if i in recorder.output_pit])
    pit_deciles = (np.histogram(pit, bins=np.linspace(0, 1, 11))[0] / max(len(pit), 1)).tolist()
    return {
        "case": name,
        "fleet": fleet,
        "requests": len(ids),
        "r2": r2,
        "r2_wait": r2_wait,
        "r2_ceiling_unknown_output": r2_ceiling,
        "mean_wait_s": float(wait_act.mean()),
        "mean_abs_error_s": float(np.mean(np.abs(act - pred))),
        "mean_latency_s": float(act.mean()),
        "slo_attainment": float(np.mean([met.get(r.id, False) for r in requests])),
        "tail_requests": len(tail),
        "warmup_requests": len(warmup),
        "calibration": rows,
        "output_pit_deciles": pit_deciles,
        "deciles_off": deciles_off(rows),
        "_pred": pred,
        "_act": act,
        "_p": p,
        "_met": obs,
        "_arrival": np.array([recorder.requests[i].arrival_s for i in ids]),
    }


def calibration_rows(p: np.ndarray, met: np.ndarray) -> list[dict[str, object]]:  # type: ignore[type-arg]
    """Predicted ``P(meet SLO)`` in deciles against the observed frequency of meeting it."""
    rows: list[dict[str, object]] = []
    for lo in np.arange(0.0, 1.0, 0.1):
        sel = (p >= lo) & ((p < lo + 0.1) if lo < 0.9 else (p <= 1.0))
        n = int(sel.sum())
        rows.append(
            {
                "bin": f"{lo:.1f}-{lo + 0.1:.1f}",
                "n": n,
                "predicted": float(p[sel].mean()) if n else None,
                "observed": float(met[sel].mean()) if n else None,
            }
        )
    return rows


def deciles_off(rows: list[dict[str, object]]) -> int:
    """Deciles of at least ``CAL_MIN_N`` requests off by more than ``CAL_TOLERANCE``."""
    return sum(
        1
        for r in rows
        if r["n"] >= CAL_MIN_N  # type: ignore[operator]
        and abs(r["predicted"] - r["observed"]) > CAL_TOLERANCE  # type: ignore[operator]
    )


def r_squared(pred: np.ndarray, act: np.ndarray) -> float:  # type: ignore[type-arg]
    return 1 - float(np.sum((act - pred) ** 2) / np.sum((act - act.mean()) ** 2))


def _after(requests: list[Request], at_s: float, prefix: str = "") -> list[Request]:
    """``requests`` moved ``at_s`` later, with ids of their own when ``prefix`` is given."""
    return [
        dataclasses.replace(
            r, id=f"{prefix}-{r.id}" if prefix else r.id, arrival_s=r.arrival_s + at_s
        )
        for r in requests
    ]


MIX_HALF_S = 150.0  # ``--azure-mix real-time``: lengths drawn from within this of their moment


def _real_time_mix(trace: Trace, part: Trace, at_s: float, rate: float, seed: int) -> Trace:
    """``part`` (arrivals re-zeroed, on the trace's clock; its first replayed ``at_s`` seconds
    after the window's first arrival) with each request's lengths replaced by those of a
    request drawn from the trace within ``MIX_HALF_S`` of the window's first arrival plus its
    replay time: the arrivals compressed by ``rate`` as before, but the mix drifting only as
    fast as the trace's own did (compressed, 15 minutes of drift pass in 900 / rate seconds).
    Never drawn from the prior's first 600 s."""
    src = at_s + part.arrival_s / rate
    times = trace.arrival_s
    floor = int(np.searchsorted(times, 600.0))
    lo = np.maximum(np.searchsorted(times, src - MIX_HALF_S), floor)
    hi = np.maximum(np.searchsorted(times, src + MIX_HALF_S), lo + 1)
    rng = np.random.default_rng(seed)
    idx = np.minimum(lo + (rng.random(len(src)) * (hi - lo)).astype(int), len(times) - 1)
    return Trace(
        name=f"{part.name} mix at real time",
        arrival_s=part.arrival_s,
        input_tokens=trace.input_tokens[idx],
        output_tokens=trace.output_tokens[idx],
    )


def _loop(
    trace: Trace,
    lo: float,
    hi: float,
    rate: float,
    t0: float,
    seed: int,
    prefix: str,
    real_time_mix: bool = False,
) -> list[Request]:
    """The requests arriving in ``[lo, hi)`` of the trace after its first 600 s taken as a loop
    (``lo`` below 600 s or ``hi`` past the trace's end wrap around), at ``(t - t0) / rate`` on
    the replay's clock; W_B classes drawn with ``seed`` (one more per wrap). ``real_time_mix``:
    lengths as ``_real_time_mix`` draws them."""
    begin, end = 600.0, float(trace.arrival_s[-1]) + 1.0
    period = end - begin
    out: list[Request] = []
    a, i = lo, 0
    while a < hi:
        real = begin + (a - begin) % period  # where ``a`` falls in the trace
        b = min(hi, a + (end - real))
        part = window(trace, real, real + (b - a)) if b > a else None
        if part is not None and len(part):
            first = float(trace.arrival_s[np.searchsorted(trace.arrival_s, real)])
            at_s = (a + (first - real) - t0) / rate
            if real_time_mix:
                part = _real_time_mix(trace, part, t0 + at_s, rate, seed + 1000 * i + 7)
            reqs = create_workload("wb", scale_rate(part, rate), seed=seed + 1000 * i)
            out += _after(reqs, at_s, f"{prefix}{i}")
        a, i = b, i + 1
    return out


def azure_case(
    rate: float,
    end_s: float = 1500.0,
    sample: int = 0,
    tail_s: float = 0.0,
    warmup_s: float = 0.0,
    real_time_mix: bool = False,
) -> tuple[list[Request], list[Request], list[Request], list[int]]:
    """Sample ``k`` replays the ``k``-th window of the trace after its first 10 minutes (the
    prior's), each as long as ``600 s .. end_s``; the W_B classes are drawn with seed ``k``.
    ``real_time_mix``: the lengths as ``_real_time_mix`` draws them (seed ``k``).

    Returns the ``warmup_s`` seconds of arrivals (at the replay's rate) that precede the window
    in the trace, the window's requests, the ``tail_s`` seconds that follow it — the trace after
    its first 600 s taken as a loop, never reaching into the window — and the outputs the prior
    is fitted on. The first arrival is at 0."""
    trace = load_trace("azure-conv")
    prior = window(trace, 0.0, 600.0)
    length = end_s - 600.0
    start = 600.0 + sample * length
    last = float(np.max(trace.arrival_s))
    if start + length > last + 1.0:
        raise SystemExit(
            f"--samples: window {start:g}-{start + length:g} s is past the trace's end ({last:.0f} s)"
        )
    measured = window(trace, start, start + length)
    t0 = float(trace.arrival_s[np.searchsorted(trace.arrival_s, start)])
    if real_time_mix and len(measured):
        measured = _real_time_mix(trace, measured, t0, rate, 7 + sample)
    requests = create_workload("wb", scale_rate(measured, rate), seed=sample)
    if not requests:
        return [], [], [], [int(x) for x in prior.output_tokens]
    room = last + 1.0 - 600.0 - length  # trace seconds outside the window
    before = min(warmup_s * rate, room / 2)
    after = min(tail_s * rate, room - before)
    tail = _loop(
        trace,
        start + length,
        start + length + after,
        rate,
        t0,
        1000 + sample,
        "tail",
        real_time_mix,
    )
    warm = _loop(trace, start - before, start, rate, t0, 5000 + sample, "warm", real_time_mix)
    shift = -warm[0].arrival_s if warm else 0.0
    warm, requests, tail = (_after(part, shift) for part in (warm, requests, tail))
    return warm, requests, tail, [int(x) for x in prior.output_tokens]


def sharegpt_case(
    rate: float, duration_s: float, sample: int = 0, tail_s: float = 0.0, warmup_s: float = 0.0
) -> tuple[list[Request], list[Request], list[Request], list[int]]:
    """Sample ``k`` draws arrivals, lengths (from the test half) and W_B classes with seed ``k``;
    the ``tail_s`` seconds of arrivals after them with seed ``1000 + k`` and the ``warmup_s``
    seconds before them with seed ``5000 + k``. Returned as ``azure_case``'s."""
    lengths = load_lengths("sharegpt")
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(lengths.input_tokens))
    half = len(idx) // 2
    fit, test = idx[:half], idx[half:]
    sample_ = LengthSample("sharegpt-test", lengths.input_tokens[test], lengths.output_tokens[test])
    trace = synthetic(sample_, rate=rate, duration_s=duration_s, seed=sample)
    requests = create_workload("wb", trace, seed=sample)
    tail: list[Request] = []
    if tail_s > 0 and requests:
        more = synthetic(sample_, rate=rate, duration_s=tail_s, seed=1000 + sample)
        gap = float(np.random.default_rng(2000 + sample).exponential(1.0 / rate))
        at = requests[-1].arrival_s + gap
        tail = _after(create_workload("wb", more, seed=1000 + sample), at, "tail")
    warm: list[Request] = []
    if warmup_s > 0 and requests:
        before = synthetic(sample_, rate=rate, duration_s=warmup_s, seed=5000 + sample)
        warm = _after(create_workload("wb", before, seed=5000 + sample), 0.0, "warm")
        gap = float(np.random.default_rng(6000 + sample).exponential(1.0 / rate))
        at = warm[-1].arrival_s + gap
        requests, tail = _after(requests, at), _after(tail, at)
    return warm, requests, tail, [int(x) for x in lengths.output_tokens[fit]]


def plot(cases: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 4.2))
    for ax, c in zip(np.atleast_1d(axes), cases, strict=True):
        pred, act = c["_pred"], c["_act"]
        ax.scatter(pred, act, s=2, alpha=0.3)  # type: ignore[arg-type]
        hi = float(max(np.max(pred), np.max(act)))  # type: ignore[call-overload]
        ax.plot([0, hi], [0, hi], "k--", lw=0.8)
        ax.set_title(f"{c['case']} on {c['fleet']}\nR² = {c['r2']:.3f}", fontsize=9)
        ax.set_xlabel("predicted latency at arrival (s)")
        ax.set_ylabel("actual latency (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(c: dict[str, object], fleet: str) -> None:
    print(
        f"\n{c['case']} on {fleet}: {c['requests']} requests, SLO attainment "
        f"{100 * float(c['slo_attainment']):.1f} %, mean latency {c['mean_latency_s']:.1f} s"  # type: ignore[arg-type]
    )
    print(
        f"  R² = {c['r2']:.3f} (ceiling without knowing outputs: "
        f"{c['r2_ceiling_unknown_output']:.3f}), mean |error| {c['mean_abs_error_s']:.2f} s; "
        f"waiting alone: R² = {c['r2_wait']:.3f}, mean wait {c['mean_wait_s']:.1f} s"
    )
    pit = " ".join(f"{100 * x:.0f}" for x in c["output_pit_deciles"])  # type: ignore[attr-defined]
    print(f"  output lengths: % of true outputs in each decile of their predictive: {pit}")
    print(f"  {'P(meet SLO)':>12} {'n':>6} {'predicted':>10} {'observed':>9}")
    for row in c["calibration"]:  # type: ignore[attr-defined]
        if row["n"]:
            off = row["n"] >= CAL_MIN_N and abs(row["predicted"] - row["observed"]) > CAL_TOLERANCE
            print(
                f"  {row['bin']:>12} {row['n']:>6} {row['predicted']:>10.3f} "
                f"{row['observed']:>9.3f}{'  <-- off by more than 10 points' if off else ''}"
            )


Job = tuple[str, str, float, int, float, float, bool, float, float, str, bool]


def run_job(job: Job) -> dict[str, object]:
    """One replay (in a worker process): ``(fleet, workload, rate, sample, azure_end,
    sharegpt_duration, by_prompt, tail_s, warmup_s, prior, real_time_mix)``."""
    fleet, workload, rate, sample, azure_end, duration, by_prompt, tail_s, warmup_s, source, rtm = (
        job
    )
    if workload == "azure":
        length = azure_end - 600.0
        start = 600.0 + sample * length
        span = f" {start:g}-{start + length:g} s" if (sample or azure_end != 1500.0) else ""
        name = f"azure-conv x{rate:g}{span}" + (" mix at real time" if rtm else "")
        warm, reqs, tail, prior = azure_case(rate, azure_end, sample, tail_s, warmup_s, rtm)
    else:
        warm, reqs, tail, prior = sharegpt_case(rate, duration, sample, tail_s, warmup_s)
        name = f"sharegpt {rate:g} req/s" + (f" seed {sample}" if sample else "")
    if source == "window":  # the oracle diagnostic: the window's own outputs
        prior = [r.output_tokens_to_generate for r in reqs]
    c = run_case(name, reqs, prior, fleet, tail=tail, warmup=warm, by_prompt=by_prompt)
    c["sample"] = sample
    return c


def pooled(
    label: str, fleet: str, runs: list[dict[str, object]], cluster_s: float = 10.0
) -> dict[str, object]:
    """One case's samples together: the calibration table over all their requests, and how much
    each decile's observed frequency moved from sample to sample (its noise in one replay)."""
    p = np.concatenate([c["_p"] for c in runs])  # type: ignore[misc]
    met = np.concatenate([c["_met"] for c in runs])  # type: ignore[misc]
    # Requests that arrive together share their errors (the same batch, the same belief): the
    # clusters of the interval below are the slices of ``cluster_s`` seconds of each replay.
    cluster = np.concatenate(
        [k * 1e6 + np.floor(c["_arrival"] / cluster_s) for k, c in enumerate(runs)]  # type: ignore[operator]
    )
    rows = calibration_rows(p, met)
    for row in rows:
        lo = float(str(row["bin"]).split("-")[0])
        sel = (p >= lo) & ((p < lo + 0.1) if lo < 0.9 else (p <= 1.0))
        row["gap_ci95"] = gap_interval(met[sel] - p[sel], cluster[sel])
    for row in rows:
        lo = float(str(row["bin"]).split("-")[0])
        freqs = []
        for c in runs:
            cp, cm = c["_p"], c["_met"]
            sel = (cp >= lo) & ((cp < lo + 0.1) if lo < 0.9 else (cp <= 1.0))  # type: ignore[operator]
            if sel.sum() >= CAL_MIN_N:
                freqs.append(float(cm[sel].mean()))  # type: ignore[index]
        row["observed_sd_between_samples"] = (
            float(np.std(freqs, ddof=1)) if len(freqs) > 1 else None
        )
    return {
        "case": label,
        "fleet": fleet,
        "samples": len(runs),
        "requests": len(p),
        "r2": [c["r2"] for c in runs],
        "r2_wait": [c["r2_wait"] for c in runs],
        "r2_ceiling_unknown_output": [c["r2_ceiling_unknown_output"] for c in runs],
        "deciles_off_per_sample": [c["deciles_off"] for c in runs],
        "calibration": rows,
        "deciles_off": deciles_off(rows),
        "deciles_off_beyond_noise": deciles_off_beyond_noise(rows),
        "deciles_shown_within": deciles_shown_within(rows),
        "deciles_measured": sum(1 for r in rows if r["n"] >= CAL_MIN_N),  # type: ignore[operator]
    }


def gap_interval(
    residual: np.ndarray,  # type: ignore[type-arg]
    cluster: np.ndarray,  # type: ignore[type-arg]
) -> tuple[float, float] | None:
    """95 % interval of the mean of ``residual`` (observed − predicted) with errors correlated
    inside each cluster and independent between clusters: the cluster-robust (CR1) standard
    error with Student's t on (clusters − 1) degrees of freedom. ``None`` below 2 clusters."""
    if residual.size == 0:
        return None
    ids, inverse = np.unique(cluster, return_inverse=True)
    g = len(ids)
    if g < 2:
        return None
    gap = float(residual.mean())
    sums = np.bincount(inverse, weights=residual - gap, minlength=g)
    se = math.sqrt(g / (g - 1) * float(np.sum(sums**2))) / residual.size
    half = float(student_t.ppf(0.975, g - 1)) * se
    return gap - half, gap + half


def deciles_off_beyond_noise(rows: list[dict[str, object]]) -> int:
    """Deciles off (as ``deciles_off``) whose whole 95 % interval of the gap is outside the
    tolerance too: off by more than the replays' own noise explains."""
    count = 0
    for r in rows:
        ci = r.get("gap_ci95")
        if (
            r["n"] >= CAL_MIN_N  # type: ignore[operator]
            and ci is not None
            and (ci[0] > CAL_TOLERANCE or ci[1] < -CAL_TOLERANCE)  # type: ignore[index]
        ):
            count += 1
    return count


def deciles_shown_within(rows: list[dict[str, object]]) -> int:
    """Deciles of at least ``CAL_MIN_N`` requests whose whole 95 % interval of the gap is
    inside the tolerance: shown calibrated despite the replays' noise."""
    return sum(
        1
        for r in rows
        if r["n"] >= CAL_MIN_N  # type: ignore[operator]
        and r.get("gap_ci95") is not None
        and r["gap_ci95"][0] >= -CAL_TOLERANCE  # type: ignore[index]
        and r["gap_ci95"][1] <= CAL_TOLERANCE  # type: ignore[index]
    )


def report_pooled(c: dict[str, object]) -> None:
    print(
        f"\n{c['case']} on {c['fleet']}, {c['samples']} samples pooled ({c['requests']} requests); "
        f"deciles off per sample: {c['deciles_off_per_sample']}"
    )
    print(
        f"  {'P(meet SLO)':>12} {'n':>6} {'predicted':>10} {'observed':>9} {'sd between samples':>19}"
        f" {'95 % interval of the gap':>25}"
    )
    for row in c["calibration"]:  # type: ignore[attr-defined]
        if row["n"]:
            off = row["n"] >= CAL_MIN_N and abs(row["predicted"] - row["observed"]) > CAL_TOLERANCE
            sd = row["observed_sd_between_samples"]
            ci = row["gap_ci95"]
            band = "" if ci is None else f"{ci[0]:+.3f} .. {ci[1]:+.3f}"  # type: ignore[index]
            print(
                f"  {row['bin']:>12} {row['n']:>6} {row['predicted']:>10.3f} "
                f"{row['observed']:>9.3f} {'' if sd is None else f'{sd:.3f}':>19} {band:>25}"
                f"{'  <-- off by more than 10 points' if off else ''}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--azure-rates", default="3,6,9", help="multiples of the trace's rate")
    parser.add_argument("--sharegpt-rates", default="6,12", help="requests per second")
    parser.add_argument("--sharegpt-duration", type=float, default=400.0)
    parser.add_argument(
        "--azure-end", type=float, default=1500.0, help="end of the replayed Azure window (s)"
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=3,
        help="independent replays per case (Azure: successive windows; ShareGPT: seeds)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="replays run in parallel")
    parser.add_argument("--name", default="rct_accuracy", help="results/<name>.json and .png")
    parser.add_argument("--fleets", default="2xA100:llama-3-8b;2xH100:llama-3-8b")
    parser.add_argument(
        "--by-prompt",
        action="store_true",
        help="output beliefs per prompt-length bin (RCTEstimator(by_prompt=True))",
    )
    parser.add_argument(
        "--tail",
        type=float,
        default=TAIL_S,
        help="seconds of arrivals replayed after each window, not measured (0: arrivals stop)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=WARMUP_S,
        help="seconds of arrivals replayed before each window, not measured (0: a cold start)",
    )
    parser.add_argument(
        "--prior",
        choices=("profile", "window"),
        default="profile",
        help="what the output-length prior is fitted on: the workload profile (data not replayed; "
        "the default) or, as a diagnostic only, the measured window's own outputs (an oracle no "
        "deployment has: it shows what is left once the prior matches the window's mix)",
    )
    parser.add_argument(
        "--azure-mix",
        choices=("compressed", "real-time"),
        default="compressed",
        help="Azure conv's request lengths: as the trace has them (its 15 minutes of drift in "
        "the mix compressed with the arrivals, the default) or drawn from within "
        f"{MIX_HALF_S:g} s of each request's replay time on the trace's own clock (the mix "
        "drifting as fast as the trace's did)",
    )
    parser.add_argument(
        "--cluster-s",
        type=float,
        default=10.0,
        help="requests arriving within this many seconds of one replay count as one cluster "
        "(they share their errors) in the interval of each decile's calibration gap",
    )
    args = parser.parse_args()
    if args.cluster_s <= 0:
        parser.error("--cluster-s must be > 0")
    if args.samples < 1 or args.jobs < 1:
        parser.error("--samples and --jobs must be >= 1")
    if not (args.tail >= 0 and args.warmup >= 0):
        parser.error("--tail and --warmup must be >= 0")
    groups: list[tuple[str, str, list[Job]]] = []
    for fleet in args.fleets.split(";"):
        scale = 1.0 if "A100" in fleet else 2.5  # an H100 serves ~2.5x an A100: load it alike
        for workload, rates in (("azure", args.azure_rates), ("sharegpt", args.sharegpt_rates)):
            for rate in (float(r) * scale for r in rates.split(",") if r.strip()):
                label = (
                    f"azure-conv x{rate:g}" if workload == "azure" else f"sharegpt {rate:g} req/s"
                )
                jobs = [
                    (
                        fleet,
                        workload,
                        rate,
                        k,
                        args.azure_end,
                        args.sharegpt_duration,
                        args.by_prompt,
                        args.tail,
                        args.warmup,
                        args.prior,
                        args.azure_mix == "real-time",
                    )
                    for k in range(args.samples)
                ]
                groups.append((fleet, label, jobs))
    flat = [job for _, _, jobs in groups for job in jobs]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(run_job, flat))
    cases: list[dict[str, object]] = []
    pools: list[dict[str, object]] = []
    heaviest: dict[tuple[str, str], dict[str, object]] = {}
    at = 0
    for fleet, label, jobs in groups:
        runs = results[at : at + len(jobs)]
        at += len(jobs)
        for c in runs:
            report(c, fleet)
        cases.extend(runs)
        pools.append(pooled(label, fleet, runs, args.cluster_s))
        workload = str(jobs[0][1])
        heaviest[(fleet, workload)] = pools[-1]  # the rates run lightest first
        first = runs[0]
        heaviest[(fleet, workload)]["_scatter"] = first
    for c in pools:
        report_pooled(c)
    out = write_result(
        args.name,
        "rct_accuracy.py",
        sys.argv[1:],
        {
            "samples": [{k: v for k, v in c.items() if not k.startswith("_")} for c in cases],
            "pooled": [{k: v for k, v in c.items() if not k.startswith("_")} for c in pools],
        },
        indent=2,
    )
    plot([c["_scatter"] for c in heaviest.values()], out.with_suffix(".png"))  # type: ignore[misc]
    print("\nsummary (R² of latency; of waiting; deciles of ≥ 50 requests off by > 10 points):")
    for c in cases:
        print(
            f"  {c['fleet']:>20} {c['case']:>34}: mean wait {float(c['mean_wait_s']):6.1f} s  "  # type: ignore[arg-type]
            f"R² {float(c['r2']):6.3f} (ceiling {float(c['r2_ceiling_unknown_output']):6.3f})  "  # type: ignore[arg-type]
            f"waiting R² {float(c['r2_wait']):6.3f}  "  # type: ignore[arg-type]
            f"off {c['deciles_off']}"
        )
    off_samples = sum(int(c["deciles_off"]) for c in cases)  # type: ignore[call-overload]
    off_pooled = sum(int(c["deciles_off"]) for c in pools)  # type: ignore[call-overload]
    beyond = sum(int(c["deciles_off_beyond_noise"]) for c in pools)  # type: ignore[call-overload]
    print(
        f"deciles off: {off_samples} over the {len(cases)} single replays, {off_pooled} over the "
        f"{len(pools)} cases with their samples pooled; {beyond} of those pooled with the whole "
        f"95 % interval of the gap (arrival slices of {args.cluster_s:g} s as clusters) off too"
    )
    other = []
    for slice_s in (2.5, 5.0, 20.0, 40.0):  # how much that count depends on the slices
        count, at = 0, 0
        for fleet, label, jobs in groups:
            again = pooled(label, fleet, results[at : at + len(jobs)], slice_s)
            count += int(again["deciles_off_beyond_noise"])  # type: ignore[call-overload]
            at += len(jobs)
        other.append(f"{count} with {slice_s:g} s")
    print(f"  (and {', '.join(other)} slices)")
    within = sum(int(c["deciles_shown_within"]) for c in pools)  # type: ignore[call-overload]
    measured = sum(int(c["deciles_measured"]) for c in pools)  # type: ignore[call-overload]
    print(
        f"deciles pooled whose whole 95 % interval is within {100 * CAL_TOLERANCE:g} points: "
        f"{within} of {measured} (the rest cannot be told apart from the tolerance either way)"
    )
    ok = all(
        min(c["r2"]) >= R2_TARGET and c["deciles_off"] == 0  # type: ignore[call-overload, type-var]
        for c in heaviest.values()
    )
    print(
        f"targets (R² ≥ {R2_TARGET} in every sample and calibrated, pooled, at the heaviest load "
        f"of each workload and fleet): {'met' if ok else 'NOT met'}; wrote {out} and .png"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
