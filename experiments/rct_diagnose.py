"""Where the RCT estimator's ``P(meet SLO)`` goes wrong, for one case of ``rct_accuracy.py``.

Replays the case exactly as ``rct_accuracy.py`` does and, for every request, recomputes its
predicted ``P(meet SLO)`` with parts of the prediction replaced by what actually happened:

- ``p``: the prediction as made at arrival;
- ``p_start``: with the actual start of decoding (first token), nothing else;
- ``p_speed``: with the actual time per output token, nothing else;
- ``p_both``: with both (what is left is the output-length belief; note that a request's actual
  time per token is correlated with its own output length, so this one is only indicative).

Prints, for each, the calibration deciles (predicted / observed, bins of at least 50 requests, the
number off by more than 10 points), then the predicted and actual time per token over eight
slices of the run (median, the mean log ratio and the decode-speed factor ``ε`` at arrival; the
mean predicted and actual start of decoding after arrival), and the instances' calibration factors at the
end (waiting, decode speed, the slope the time per token is regressed by).

Reproduce: .venv/bin/python experiments/rct_diagnose.py sharegpt 12 --fleet 2xA100:llama-3-8b
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import rct_accuracy as ra

from qlm.domain import Request
from qlm.engines.sim import SimEngine
from qlm.rct.distribution import CompletionDistribution
from qlm.rct.output_model import _phi


@dataclass
class DiagnosingRecorder(ra.Recorder):
    """``rct_accuracy``'s recorder that also keeps each request's whole estimate."""

    estimates: dict[str, tuple[CompletionDistribution, float]] = field(default_factory=dict)
    factors: dict[str, tuple[float, float]] = field(default_factory=dict)  # at arrival

    def on_dispatch(self, now: float, request: Request, engine: SimEngine) -> None:
        super().on_dispatch(now, request, engine)
        if request.id in self.tail:
            return  # a tail request: not predicted
        queue = [
            ra.Queued(self.requests[rid], generated, running)
            for rid, generated, running in engine.queue_view()
        ]
        # Estimating again does not learn anything: the prediction to learn from is remembered.
        (est,) = self.estimator.estimate_requests(self.view(engine), queue, now, only=[-1])
        self.estimates[request.id] = (est, now)
        self.factors[request.id] = self.estimator.calibration_factors(engine.name)


def calibration(p: np.ndarray, met: np.ndarray) -> tuple[int, str]:  # type: ignore[type-arg]
    off, cells = 0, []
    for lo in np.arange(0.0, 1.0, 0.1):
        sel = (p >= lo) & ((p < lo + 0.1) if lo < 0.9 else (p <= 1.0))
        if sel.sum() >= ra.CAL_MIN_N:
            pred, obs = p[sel].mean(), met[sel].mean()
            off += abs(pred - obs) > ra.CAL_TOLERANCE
            cells.append(f"{lo:.1f}:{pred:.2f}/{obs:.2f}")
    return off, " ".join(cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=["azure", "sharegpt"])
    parser.add_argument("rate", type=float, help="× trace rate (azure) or req/s (sharegpt)")
    parser.add_argument("--fleet", default="2xA100:llama-3-8b")
    parser.add_argument("--sharegpt-duration", type=float, default=400.0)
    parser.add_argument("--by-prompt", action="store_true")
    parser.add_argument("--sample", type=int, default=0, help="as rct_accuracy.py's samples")
    parser.add_argument("--tail", type=float, default=ra.TAIL_S, help="as rct_accuracy.py's")
    parser.add_argument("--warmup", type=float, default=ra.WARMUP_S, help="as rct_accuracy.py's")
    parser.add_argument(
        "--azure-mix",
        choices=("compressed", "real-time"),
        default="compressed",
        help="as rct_accuracy.py's",
    )
    args = parser.parse_args()
    if args.workload == "azure":
        warm, requests, tail, prior = ra.azure_case(
            args.rate,
            sample=args.sample,
            tail_s=args.tail,
            warmup_s=args.warmup,
            real_time_mix=args.azure_mix == "real-time",
        )
    else:
        warm, requests, tail, prior = ra.sharegpt_case(
            args.rate, args.sharegpt_duration, args.sample, args.tail, args.warmup
        )
    kept: list[DiagnosingRecorder] = []

    def recorder(*a: object, **k: object) -> DiagnosingRecorder:
        kept.append(DiagnosingRecorder(*a, **k))  # type: ignore[arg-type]
        return kept[-1]

    ra.Recorder = recorder  # type: ignore[misc, assignment]
    ra.run_case(
        args.workload,
        requests,
        prior,
        args.fleet,
        tail=tail,
        warmup=warm,
        by_prompt=args.by_prompt,
    )
    rec = kept[0]
    by_id = {r.id: r for r in requests}
    ids = [i for i in rec.actual if i in rec.estimates and i in rec.decode and i in by_id]
    rows = []
    for rid in ids:
        est, now = rec.estimates[rid]
        ttft, per_token, _ = rec.decode[rid]
        req = by_id[rid]
        start = req.arrival_s + ttft
        rows.append(
            (
                now,
                est.p_before(req.deadline_s),
                dataclasses.replace(est, start_mean=start, start_sd=0.0).p_before(req.deadline_s),
                dataclasses.replace(est, per_token_s=per_token, speed_sd=0.0).p_before(
                    req.deadline_s
                ),
                dataclasses.replace(
                    est, start_mean=start, start_sd=0.0, per_token_s=per_token, speed_sd=0.0
                ).p_before(req.deadline_s),
                rec.actual[rid] <= req.deadline_s - req.arrival_s,
                est.per_token_s,
                per_token,
                rec.factors[rid][1],
                est.start_mean - now,
                start - now,
            )
        )
    a = np.array(rows, dtype=float)
    met = a[:, 5]
    for col, name in ((1, "p"), (2, "p_start"), (3, "p_speed"), (4, "p_both")):
        off, cells = calibration(a[:, col], met)
        print(f"{name:8s} {off} off   {cells}")
    t, pred_pt, act_pt, eps = a[:, 0], a[:, 6], a[:, 7], a[:, 8]
    pred_start, act_start = a[:, 9], a[:, 10]
    log_ratio = np.log(act_pt / pred_pt)
    rms = float(np.sqrt(np.mean(log_ratio**2)))
    print(f"time per token, log(actual / predicted): mean {log_ratio.mean():+.3f}, RMS {rms:.3f}")
    edges = np.linspace(t.min(), t.max(), 9)
    for lo, hi in itertools.pairwise(edges):
        sel = (t >= lo) & (t <= hi if hi == edges[-1] else t < hi)
        if sel.any():
            print(
                f"  arrivals {lo:7.0f}-{hi:7.0f} s  n={int(sel.sum()):5d}  predicted "
                f"{np.median(pred_pt[sel]) * 1000:6.1f} ms  actual "
                f"{np.median(act_pt[sel]) * 1000:6.1f} ms  mean log ratio "
                f"{log_ratio[sel].mean():+.3f}  eps {np.median(eps[sel]):.2f}  start "
                f"{pred_start[sel].mean():6.1f} / {act_start[sel].mean():6.1f} s"
            )
    # Where the actual start and speed fall in the predictive the estimate used for them (PIT
    # deciles, 10 % each when that part is calibrated; the start is normal, the speed log-normal).
    starts = [rec.estimates[rid][0] for rid in ids]
    sd_start = np.array([max(e.start_sd, 1e-9) for e in starts])
    pit_start = np.array(
        [_phi(z) for z in (act_start + t - np.array([e.start_mean for e in starts])) / sd_start]
    )
    sd_speed = np.array([max(e.speed_sd, 1e-9) for e in starts])
    pit_speed = np.array([_phi(z) for z in (log_ratio + sd_speed**2 / 2) / sd_speed])
    for name, pit in (("start", pit_start), ("speed", pit_speed)):
        hist = np.histogram(pit, bins=np.linspace(0, 1, 11))[0] / len(pit) * 100
        print(f"PIT of the actual {name}, % per decile: " + " ".join(f"{h:.0f}" for h in hist))
    for name in rec.views:
        wait_f, eps_f = rec.estimator.calibration_factors(name)
        print(
            f"{name}: waiting factor {wait_f:.3f}, decode-speed factor {eps_f:.3f}, "
            f"speed slope {rec.estimator.speed_slope(name):.2f}"
        )
    print(
        "reproduce: .venv/bin/python experiments/rct_diagnose.py "
        + " ".join(sys.argv[1:] or [args.workload, str(args.rate)])
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
