"""What a run measured: SLO attainment, throughput, latency percentiles, queueing, model swaps and
GPU-memory utilisation. Pure functions over request records, so a production run's records (from
the store) are summarised by the same code as a simulated one's."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qlm.domain import RequestRecord, RequestStatus

PERCENTILES = (50, 90, 99)


class MemoryTimeline:
    """Time-weighted GPU-memory utilisation per instance, in fixed bins for plotting."""

    def __init__(self, instances: Sequence[str], *, bin_s: float) -> None:
        if bin_s <= 0:
            raise ValueError(f"bin_s must be > 0, got {bin_s}")
        self.instances = tuple(instances)
        self.bin_s = bin_s
        self._last: list[tuple[float, float]] = [(0.0, 0.0) for _ in instances]
        self._area = [0.0 for _ in instances]
        self._bins: list[dict[int, float]] = [defaultdict(float) for _ in instances]
        self.start_s = 0.0
        self.end_s = 0.0

    def begin(self, t: float, fractions: Sequence[float]) -> None:
        """The run starts at ``t`` with these utilisations (weights already resident count)."""
        self.start_s = t
        self._last = [(t, f) for f in fractions]

    def observe(self, idx: int, t: float, fraction: float) -> None:
        """The instance's utilisation is ``fraction`` from ``t`` on."""
        t0, f0 = self._last[idx]
        if t > t0:
            self._accumulate(idx, t0, t, f0)
        self._last[idx] = (max(t, t0), fraction)

    def _accumulate(self, idx: int, t0: float, t1: float, f: float) -> None:
        self._area[idx] += f * (t1 - t0)
        if f == 0.0:
            return
        bins = self._bins[idx]
        b = int(t0 // self.bin_s)
        while t0 < t1:
            edge = min(t1, (b + 1) * self.bin_s)
            bins[b] += f * (edge - t0)
            t0, b = edge, b + 1

    def close(self, t: float) -> None:
        for idx, (t0, f0) in enumerate(self._last):
            if t > t0:
                self._accumulate(idx, t0, t, f0)
            self._last[idx] = (t, f0)
        self.end_s = t

    def mean(self, idx: int) -> float:
        span = self.end_s - self.start_s
        return self._area[idx] / span if span > 0 else 0.0

    def series(self, idx: int) -> list[tuple[float, float]]:
        """(bin start, mean utilisation over the part of the bin inside the run), every bin."""
        if self.end_s <= self.start_s:
            return []
        first = int(self.start_s // self.bin_s)
        last = int(np.ceil(self.end_s / self.bin_s))
        bins = self._bins[idx]
        out = []
        for b in range(first, last):
            lo = max(b * self.bin_s, self.start_s)
            hi = min((b + 1) * self.bin_s, self.end_s)
            if hi > lo:
                out.append((b * self.bin_s, bins.get(b, 0.0) / (hi - lo)))
        return out


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        empty: dict[str, float | None] = {f"p{p}": None for p in PERCENTILES}
        empty["mean"] = None
        return empty
    arr = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}
    out["mean"] = float(arr.mean())
    return out


def _attainment_by(
    records: Sequence[RequestRecord], key: Callable[[RequestRecord], str]
) -> dict[str, dict[str, float]]:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[key(r)].append(r)
    return {
        k: {
            "requests": len(rs),
            "slo_attainment": sum(r.slo_met for r in rs) / len(rs),
        }
        for k, rs in sorted(groups.items())
    }


def ttft_met(record: RequestRecord) -> bool | None:
    """Whether the request had its first token within its TTFT SLO (None: it has none)."""
    slo = record.request.slo.ttft_s
    if slo is None:
        return None
    return record.ttft_s is not None and record.ttft_s <= slo


def _with_ttft_attainment(
    by_class: dict[str, dict[str, float]], records: Sequence[RequestRecord]
) -> dict[str, dict[str, float]]:
    """``ttft_attainment`` of each class some of whose requests have a TTFT SLO: the share of
    those requests that had their first token in time (a request that never did missed it)."""
    judged: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        met = ttft_met(r)
        if met is not None:
            judged[r.request.slo_class].append(met)
    for name, hits in judged.items():
        by_class[name]["ttft_requests"] = len(hits)
        by_class[name]["ttft_attainment"] = sum(hits) / len(hits)
    return by_class


def summarize(
    records: Sequence[RequestRecord],
    *,
    model_switches: dict[str, int] | None = None,
    memory: MemoryTimeline | None = None,
) -> dict[str, Any]:
    """The summary of a run; every number is computed from ``records`` (and the timeline)."""
    n = len(records)
    finished = [r for r in records if r.status is RequestStatus.FINISHED]
    first_arrival = min((r.request.arrival_s for r in records), default=0.0)
    last_finish = max((r.finish_s for r in finished if r.finish_s is not None), default=0.0)
    makespan = max(0.0, last_finish - first_arrival)
    out_tokens = sum(r.output_tokens for r in finished)
    summary: dict[str, Any] = {
        "requests": n,
        "finished": len(finished),
        "failed": sum(r.status is RequestStatus.FAILED for r in records),
        "slo_attainment": (sum(r.slo_met for r in records) / n) if n else None,
        "slo_attainment_by_class": _with_ttft_attainment(
            _attainment_by(records, lambda r: r.request.slo_class), records
        ),
        "slo_attainment_by_tier": _attainment_by(records, lambda r: r.request.tier.name.lower()),
        "slo_attainment_by_model": _attainment_by(records, lambda r: r.request.model),
        "makespan_s": makespan,
        "throughput_rps": len(finished) / makespan if makespan > 0 else None,
        "throughput_output_tps": out_tokens / makespan if makespan > 0 else None,
        "ttft_s": percentiles([r.ttft_s for r in finished if r.ttft_s is not None]),
        "e2e_s": percentiles([r.e2e_s for r in finished if r.e2e_s is not None]),
        "queue_s": percentiles([r.queue_s for r in finished if r.queue_s is not None]),
        "preemptions": sum(r.preemptions for r in records),
        "evictions": sum(r.evictions for r in records),
        "swaps": sum(r.swaps for r in records),
        "model_switches": sum((model_switches or {}).values()),
        "model_switches_by_instance": dict(model_switches or {}),
    }
    if memory is not None:
        per = {name: memory.mean(i) for i, name in enumerate(memory.instances)}
        summary["gpu_memory_utilization_by_instance"] = per
        summary["gpu_memory_utilization"] = sum(per.values()) / len(per) if per else None
    return summary


CSV_FIELDS = (
    "id",
    "model",
    "slo_class",
    "tier",
    "tenant",
    "instance",
    "status",
    "arrival_s",
    "dispatch_s",
    "scheduled_s",
    "first_token_s",
    "finish_s",
    "input_tokens",
    "output_tokens",
    "slo_e2e_s",
    "slo_ttft_s",
    "slo_met",
    "preemptions",
    "evictions",
    "swaps",
)


def record_row(r: RequestRecord) -> dict[str, object]:
    req = r.request
    return {
        "id": req.id,
        "model": req.model,
        "slo_class": req.slo_class,
        "tier": req.tier.name.lower(),
        "tenant": req.tenant,
        "instance": r.instance,
        "status": r.status.name.lower(),
        "arrival_s": req.arrival_s,
        "dispatch_s": r.dispatch_s,
        "scheduled_s": r.scheduled_s,
        "first_token_s": r.first_token_s,
        "finish_s": r.finish_s,
        "input_tokens": req.input_tokens,
        "output_tokens": r.output_tokens,
        "slo_e2e_s": req.slo.e2e_s,
        "slo_ttft_s": req.slo.ttft_s,
        "slo_met": r.slo_met,
        "preemptions": r.preemptions,
        "evictions": r.evictions,
        "swaps": r.swaps,
    }


def write_outputs(
    out_dir: Path,
    records: Iterable[RequestRecord],
    summary: dict[str, Any],
    memory: MemoryTimeline | None = None,
) -> list[Path]:
    """Write ``requests.csv`` (one row per request), ``summary.json`` and, given a timeline,
    ``memory.csv`` (GPU memory utilisation per instance per bin); return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out_dir / "requests.csv", out_dir / "summary.json"
    written = [csv_path, json_path]
    if memory is not None:
        mem_path = out_dir / "memory.csv"
        with mem_path.open("w", newline="", encoding="utf-8") as fh:
            rows = csv.writer(fh)
            rows.writerow(["instance", "t_s", "gpu_memory_utilization"])
            for idx, name in enumerate(memory.instances):
                for t, frac in memory.series(idx):
                    rows.writerow([name, f"{t:.1f}", f"{frac:.4f}"])
        written.append(mem_path)
    with csv_path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in records:
            writer.writerow(record_row(r))
    json_path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return written
