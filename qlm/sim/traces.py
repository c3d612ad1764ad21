"""Request traces: load the shipped production traces (or a file) and transform them.

A ``Trace`` is when requests arrive and how long they are: nothing else. ``qlm.sim.workload`` turns one
into ``Request`` objects by assigning models and SLO classes.

Named traces ship in ``qlm/data/traces/`` (see its README for provenance and licences):

========================  ==========================================================================
``azure-code``            Azure LLM inference trace 2023, coding service (8,819 requests, 57 min)
``azure-conv``            same, conversation service (19,366 requests, 58 min)
``mooncake-conversation`` Kimi production sample, Mooncake FAST'25 (12,031 requests, 59 min)
``mooncake-synthetic``    public data sets with Poisson arrivals, Mooncake FAST'25 (3,993, 17 min)
========================  ==========================================================================

and two length samples without timestamps: ``sharegpt`` and ``arxiv`` (``load_lengths``).

Files are recognised by their content, not their name:

- Azure CSV: header ``TIMESTAMP,ContextTokens,GeneratedTokens``, timestamps
  ``YYYY-MM-DD HH:MM:SS[.fraction]`` (the fraction may have any number of digits; the 2023 trace has 7);
- Mooncake JSON lines: ``timestamp`` (ms), ``input_length``, ``output_length`` (other keys ignored);
- normalized CSV: header ``arrival_s,input_tokens,output_tokens`` (what ``write_trace`` writes);
- length CSV (``load_lengths`` only): ``num_prefill_tokens,num_decode_tokens`` (sarathi-serve / vidur).

Every loaded trace is sorted by arrival (stable, so ties keep file order) and re-zeroed at its first
request. Mooncake's production traces quantise arrivals into ~3 s buckets (about ten requests share
each timestamp); replaying them as given would fire each bucket as one burst. ``load_trace`` detects
such quantisation and spreads the requests of each bucket uniformly over it (see ``load_trace``).

Transforms (``scale_rate``, ``window``, ``head``) return new traces; nothing here mutates a trace, and a
trace's arrays are read-only.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from qlm.errors import WorkloadError

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

TRACES: dict[str, str] = {
    "azure-code": "azure2023/AzureLLMInferenceTrace_code.csv",
    "azure-conv": "azure2023/AzureLLMInferenceTrace_conv.csv",
    "mooncake-conversation": "mooncake/conversation_trace.jsonl",
    "mooncake-synthetic": "mooncake/synthetic_trace.jsonl",
}
"""Named traces shipped with QLM: name -> path under ``qlm/data/traces/``."""

LENGTHS: dict[str, str] = {
    "sharegpt": "sharegpt_lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "arxiv_lengths/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
}
"""Named length samples (no timestamps) shipped with QLM: name -> path under ``qlm/data/traces/``."""

# A trace is bucketed when most requests share a timestamp with others and the distinct timestamps
# are at least this far apart (median gap): Mooncake conversation has 1,180 distinct timestamps for
# 12,031 requests, 2.997-3.003 s apart; Mooncake synthetic (Poisson) has 3,982 for 3,993.
_MIN_BUCKET_S = 1.0

_AZURE_COLUMNS = ("timestamp", "contexttokens", "generatedtokens")
_NORMALIZED_COLUMNS = ("arrival_s", "input_tokens", "output_tokens")
_LENGTH_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")


def _frozen(values: npt.ArrayLike, dtype: type[np.generic]) -> npt.NDArray[np.generic]:
    array = np.array(values, dtype=dtype)  # always a copy, so the caller's array stays theirs
    array.setflags(write=False)
    return array


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class Trace:
    """Arrival times and token lengths of a sequence of requests.

    ``arrival_s`` is in seconds since the first request: sorted, first element 0. The token arrays are
    ``int64`` and non-negative. All three arrays are read-only copies of what was passed in.
    """

    name: str
    arrival_s: FloatArray
    input_tokens: IntArray
    output_tokens: IntArray

    def __post_init__(self) -> None:
        arrival = _frozen(self.arrival_s, np.float64)
        inputs = _frozen(self.input_tokens, np.int64)
        outputs = _frozen(self.output_tokens, np.int64)
        if not (arrival.ndim == inputs.ndim == outputs.ndim == 1):
            raise WorkloadError(f"trace {self.name!r}: arrays must be one-dimensional")
        if not len(arrival) == len(inputs) == len(outputs):
            raise WorkloadError(
                f"trace {self.name!r}: arrays differ in length "
                f"(arrival_s {len(arrival)}, input_tokens {len(inputs)}, "
                f"output_tokens {len(outputs)})"
            )
        if len(arrival):
            if not np.all(np.isfinite(arrival)):
                raise WorkloadError(f"trace {self.name!r}: arrival_s has a non-finite value")
            if arrival[0] != 0.0:
                raise WorkloadError(f"trace {self.name!r}: first arrival is {arrival[0]}, not 0")
            if np.any(np.diff(arrival) < 0):
                raise WorkloadError(f"trace {self.name!r}: arrival_s is not sorted")
            if inputs.min() < 0 or outputs.min() < 0:
                raise WorkloadError(f"trace {self.name!r}: token counts must be >= 0")
        object.__setattr__(self, "arrival_s", arrival)
        object.__setattr__(self, "input_tokens", inputs)
        object.__setattr__(self, "output_tokens", outputs)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def __repr__(self) -> str:
        return (
            f"Trace(name={self.name!r}, requests={len(self)}, "
            f"duration_s={self.duration_s:.1f}, rate={self.rate:.3f})"
        )

    @property
    def duration_s(self) -> float:
        """Time from the first to the last arrival (0 for fewer than two requests)."""
        return float(self.arrival_s[-1]) if len(self) else 0.0

    @property
    def rate(self) -> float:
        """Mean arrival rate in requests per second: ``len / duration_s`` (0 when the span is 0)."""
        return len(self) / self.duration_s if self.duration_s > 0 else 0.0


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class LengthSample:
    """Input and output lengths without timestamps, to sample request sizes from.

    Unpacks as ``input_tokens, output_tokens = load_lengths("sharegpt")``.
    """

    name: str
    input_tokens: IntArray
    output_tokens: IntArray

    def __post_init__(self) -> None:
        inputs = _frozen(self.input_tokens, np.int64)
        outputs = _frozen(self.output_tokens, np.int64)
        if inputs.ndim != 1 or inputs.shape != outputs.shape:
            raise WorkloadError(
                f"length sample {self.name!r}: input_tokens and output_tokens must be 1-D arrays "
                f"of equal length (got shapes {inputs.shape} and {outputs.shape})"
            )
        if len(inputs) and (inputs.min() < 0 or outputs.min() < 0):
            raise WorkloadError(f"length sample {self.name!r}: token counts must be >= 0")
        object.__setattr__(self, "input_tokens", inputs)
        object.__setattr__(self, "output_tokens", outputs)

    def __len__(self) -> int:
        return len(self.input_tokens)

    def __iter__(self) -> Iterator[IntArray]:
        yield self.input_tokens
        yield self.output_tokens

    def __repr__(self) -> str:
        return f"LengthSample(name={self.name!r}, requests={len(self)})"


# --- Loading ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Parsed:
    """A file's rows before sorting and re-zeroing; ``arrival_s`` is None for length-only files."""

    arrival_s: FloatArray | None
    input_tokens: IntArray
    output_tokens: IntArray


def load_trace(name_or_path: str | Path, *, seed: int = 0) -> Trace:
    """Load a named trace (``TRACES``) or a trace file in any supported format.

    Bucket spreading: when a trace's timestamps are quantised (at most half as many distinct
    timestamps as requests, a median gap of at least 1 s between distinct timestamps: Mooncake
    conversation's 3 s buckets), the requests of the bucket at time ``t`` get arrivals
    ``t + U[0, w)`` with ``w = min(median gap, gap to the next bucket)``, drawn from
    ``numpy.random.default_rng(seed)``, sorted and given to the bucket's requests in file order. The
    trace's very first request stays at 0. A same ``seed`` gives the same arrivals; traces without
    quantisation ignore ``seed``.

    Raises ``WorkloadError`` naming the trace, file, line or column that is wrong.
    """
    parsed, name = _load(name_or_path)
    if parsed.arrival_s is None:
        raise WorkloadError(
            f"{name_or_path}: a length-only file has no timestamps; load it with load_lengths() "
            "and give it arrivals with synthetic()"
        )
    arrival = parsed.arrival_s
    order = np.argsort(arrival, kind="stable")
    arrival = arrival[order]
    if len(arrival):
        arrival = arrival - arrival[0]
        width = _bucket_width(arrival)
        if width is not None:
            arrival = _spread_buckets(arrival, width, np.random.default_rng(seed))
    return Trace(
        name=name,
        arrival_s=arrival,
        input_tokens=parsed.input_tokens[order],
        output_tokens=parsed.output_tokens[order],
    )


def load_lengths(name_or_path: str | Path) -> LengthSample:
    """Load a named length sample (``LENGTHS``), the lengths of a named trace, or those of a file.

    A file may be a length CSV or any trace format (its timestamps are then ignored).
    """
    parsed, name = _load(name_or_path)
    return LengthSample(
        name=name, input_tokens=parsed.input_tokens, output_tokens=parsed.output_tokens
    )


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write a trace as a normalized CSV (``arrival_s,input_tokens,output_tokens``, µs resolution)."""
    lines = ["arrival_s,input_tokens,output_tokens"]
    lines += [
        f"{a:.6f},{i},{o}"
        for a, i, o in zip(
            trace.arrival_s.tolist(),
            trace.input_tokens.tolist(),
            trace.output_tokens.tolist(),
            strict=True,
        )
    ]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def _load(name_or_path: str | Path) -> tuple[_Parsed, str]:
    key = str(name_or_path)
    if key in TRACES:
        return _load_shipped(TRACES[key]), key
    if key in LENGTHS:
        return _load_shipped(LENGTHS[key]), key
    path = Path(name_or_path)
    if not path.is_file():
        known = ", ".join([*TRACES, *LENGTHS])
        raise WorkloadError(f"unknown trace {key!r}: not a file, nor a known name ({known})")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{path}: cannot read trace file: {exc}") from exc
    return _parse(text, str(path)), path.stem


@cache
def _load_shipped(relative: str) -> _Parsed:
    # Cached: shipped files never change and parsed arrays are read-only, so sharing them is safe.
    text = resources.files("qlm").joinpath("data/traces", relative).read_text(encoding="utf-8-sig")
    return _parse(text, f"qlm/data/traces/{relative}")


def _parse(text: str, source: str) -> _Parsed:
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if not first:
        raise WorkloadError(f"{source}: file is empty")
    if first.startswith("{"):
        return _parse_mooncake(text, source)
    header = [column.strip().lower() for column in next(csv.reader([first]))]
    if all(column in header for column in _AZURE_COLUMNS):
        return _parse_azure(text, source)
    if all(column in header for column in _NORMALIZED_COLUMNS):
        return _parse_normalized(text, source)
    if all(column in header for column in _LENGTH_COLUMNS):
        return _parse_lengths(text, source)
    raise WorkloadError(
        f"{source}: unrecognised trace format (first line {first[:80]!r}); expected JSON lines with "
        "timestamp/input_length/output_length, or a CSV with columns "
        "TIMESTAMP,ContextTokens,GeneratedTokens or arrival_s,input_tokens,output_tokens "
        "or num_prefill_tokens,num_decode_tokens"
    )


def _read_csv(text: str, source: str, wanted: tuple[str, ...]) -> tuple[list[list[str]], list[int]]:
    """The wanted columns (in ``wanted`` order) of every non-empty row, and each row's line number."""
    reader = csv.reader(io.StringIO(text))
    header = [column.strip().lower() for column in next(reader)]
    index = [header.index(column) for column in wanted]
    columns: list[list[str]] = [[] for _ in wanted]
    line_numbers: list[int] = []
    for row in reader:
        if not row or not "".join(row).strip():
            continue
        if len(row) != len(header):
            raise WorkloadError(
                f"{source}: line {reader.line_num}: {len(row)} fields, header has {len(header)}"
            )
        for values, i in zip(columns, index, strict=True):
            values.append(row[i])
        line_numbers.append(reader.line_num)
    return columns, line_numbers


def _numbers(
    values: list[str], dtype: type[np.generic], column: str, source: str, lines: list[int]
) -> npt.NDArray[np.generic]:
    try:
        return np.array(values, dtype=np.str_).astype(dtype)
    except ValueError:
        pass
    # Slow path, only on bad input: find the offending row to name it.
    for value, line in zip(values, lines, strict=True):
        try:
            np.array([value], dtype=np.str_).astype(dtype)
        except ValueError:
            kind = "an integer" if dtype is np.int64 else "a number"
            raise WorkloadError(
                f"{source}: line {line}: column {column!r} is {value!r}, not {kind}"
            ) from None
    raise WorkloadError(f"{source}: column {column!r} cannot be parsed")  # pragma: no cover


def _tokens(values: list[str], column: str, source: str, lines: list[int]) -> IntArray:
    tokens = np.asarray(_numbers(values, np.int64, column, source, lines), dtype=np.int64)
    if len(tokens) and tokens.min() < 0:
        line = lines[int(np.argmin(tokens))]
        raise WorkloadError(f"{source}: line {line}: column {column!r} is negative")
    return tokens


def _parse_azure(text: str, source: str) -> _Parsed:
    (stamps, context, generated), lines = _read_csv(text, source, _AZURE_COLUMNS)
    days = np.empty(len(stamps), dtype=np.int64)
    seconds = np.empty(len(stamps), dtype=np.float64)
    day_numbers: dict[str, int] = {}
    for i, stamp in enumerate(stamps):
        # "2023-11-16 18:17:03.9799600": datetime.fromisoformat rejects 7 fraction digits before
        # Python 3.11 and is slower; splitting by hand takes any number of digits.
        date, _, clock = stamp.strip().replace("T", " ").partition(" ")
        try:
            day = day_numbers.get(date)
            if day is None:
                day = day_numbers[date] = dt.date.fromisoformat(date).toordinal()
            hours, minutes, secs = clock.split(":")
            days[i] = day
            seconds[i] = int(hours) * 3600 + int(minutes) * 60 + float(secs)
        except ValueError:
            raise WorkloadError(
                f"{source}: line {lines[i]}: TIMESTAMP {stamp!r} is not 'YYYY-MM-DD HH:MM:SS.f'"
            ) from None
    # Days and seconds stay apart until the first day is subtracted, so the float keeps sub-µs
    # resolution (seconds since year 1 in one float64 would only resolve ~10 µs).
    arrival = (days - (days.min() if len(days) else 0)) * 86400.0 + seconds
    return _Parsed(
        arrival_s=arrival,
        input_tokens=_tokens(context, "ContextTokens", source, lines),
        output_tokens=_tokens(generated, "GeneratedTokens", source, lines),
    )


def _parse_normalized(text: str, source: str) -> _Parsed:
    (arrival, inputs, outputs), lines = _read_csv(text, source, _NORMALIZED_COLUMNS)
    arrival_s = np.asarray(_numbers(arrival, np.float64, "arrival_s", source, lines), np.float64)
    if len(arrival_s) and not np.all(np.isfinite(arrival_s)):
        line = lines[int(np.argmin(np.isfinite(arrival_s)))]
        raise WorkloadError(f"{source}: line {line}: column 'arrival_s' is not finite")
    return _Parsed(
        arrival_s=arrival_s,
        input_tokens=_tokens(inputs, "input_tokens", source, lines),
        output_tokens=_tokens(outputs, "output_tokens", source, lines),
    )


def _parse_lengths(text: str, source: str) -> _Parsed:
    (inputs, outputs), lines = _read_csv(text, source, _LENGTH_COLUMNS)
    return _Parsed(
        arrival_s=None,
        input_tokens=_tokens(inputs, "num_prefill_tokens", source, lines),
        output_tokens=_tokens(outputs, "num_decode_tokens", source, lines),
    )


def _parse_mooncake(text: str, source: str) -> _Parsed:
    stamps: list[int] = []
    inputs: list[int] = []
    outputs: list[int] = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{source}: line {line_number}: not JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise WorkloadError(f"{source}: line {line_number}: not a JSON object")
        for key, values in zip(_MOONCAKE_KEYS, (stamps, inputs, outputs), strict=True):
            value = record.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise WorkloadError(
                    f"{source}: line {line_number}: {key!r} must be a non-negative integer, "
                    f"got {value!r}"
                )
            values.append(value)
    return _Parsed(
        arrival_s=np.array(stamps, dtype=np.float64) / 1000.0,
        input_tokens=np.array(inputs, dtype=np.int64),
        output_tokens=np.array(outputs, dtype=np.int64),
    )


def _bucket_width(arrival: FloatArray) -> float | None:
    """The bucket width of a quantised, sorted arrival array, or None when it is not quantised."""
    distinct = np.unique(arrival)
    if len(distinct) < 2 or len(distinct) > len(arrival) / 2:
        return None
    width = float(np.median(np.diff(distinct)))
    return width if width >= _MIN_BUCKET_S else None


def _spread_buckets(arrival: FloatArray, width: float, rng: np.random.Generator) -> FloatArray:
    starts, bucket = np.unique(arrival, return_inverse=True)
    widths = np.minimum(np.append(np.diff(starts), width), width)
    offsets = rng.uniform(0.0, 1.0, size=len(arrival))
    # Sort the offsets within each bucket (arrival is sorted, so buckets are contiguous runs).
    offsets = offsets[np.lexsort((offsets, bucket))]
    spread = np.asarray(starts[bucket] + offsets * widths[bucket], dtype=np.float64)
    spread[0] = arrival[0]  # the trace's time origin stays at 0
    return spread


# --- Transforms ---------------------------------------------------------------------------------


def scale_rate(trace: Trace, factor: float) -> Trace:
    """The same requests arriving ``factor`` times as fast (timestamps divided by ``factor``)."""
    if not (math.isfinite(factor) and factor > 0):
        raise WorkloadError(f"scale_rate: factor must be a positive number, got {factor}")
    return Trace(
        name=f"{trace.name} rate*{factor:g}",
        arrival_s=trace.arrival_s / factor,
        input_tokens=trace.input_tokens,
        output_tokens=trace.output_tokens,
    )


def window(trace: Trace, start_s: float, end_s: float) -> Trace:
    """The requests arriving in ``[start_s, end_s)``, re-zeroed at the first of them."""
    if not start_s < end_s:
        raise WorkloadError(f"window: start_s ({start_s}) must be < end_s ({end_s})")
    lo, hi = np.searchsorted(trace.arrival_s, [start_s, end_s], side="left")
    arrival = trace.arrival_s[lo:hi]
    return Trace(
        name=f"{trace.name}[{start_s:g}s:{end_s:g}s]",
        arrival_s=arrival - arrival[0] if len(arrival) else arrival,
        input_tokens=trace.input_tokens[lo:hi],
        output_tokens=trace.output_tokens[lo:hi],
    )


def head(trace: Trace, n: int) -> Trace:
    """The first ``n`` requests (all of them when the trace is shorter)."""
    if n < 0:
        raise WorkloadError(f"head: n must be >= 0, got {n}")
    return Trace(
        name=f"{trace.name}[:{n}]",
        arrival_s=trace.arrival_s[:n],
        input_tokens=trace.input_tokens[:n],
        output_tokens=trace.output_tokens[:n],
    )


def synthetic(
    lengths: LengthSample | Trace,
    *,
    rate: float,
    duration_s: float | None = None,
    n: int | None = None,
    arrival: Literal["poisson", "gamma"] = "poisson",
    cv: float = 1.0,
    seed: int = 0,
) -> Trace:
    """A trace with generated arrivals and lengths drawn from ``lengths``.

    Inter-arrival times are exponential with mean ``1 / rate`` (``"poisson"``), or gamma with the same
    mean and coefficient of variation ``cv`` (``"gamma"``: shape ``1 / cv**2``; ``cv > 1`` is bursty,
    ``cv = 1`` is Poisson). The first request arrives at 0. Give exactly one of ``n`` (that many
    requests) or ``duration_s`` (every arrival before it). Each request's (input, output) pair is drawn
    with replacement from ``lengths`` (pairs stay together). Arrivals and lengths use separate streams
    spawned from ``seed``, so changing the arrival process keeps the drawn lengths.
    """
    if not (math.isfinite(rate) and rate > 0):
        raise WorkloadError(f"synthetic: rate must be a positive number, got {rate}")
    if n is not None and n < 1:
        raise WorkloadError(f"synthetic: n must be >= 1, got {n}")
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
        raise WorkloadError(f"synthetic: duration_s must be a positive number, got {duration_s}")
    if arrival not in ("poisson", "gamma"):
        raise WorkloadError(f"synthetic: arrival must be 'poisson' or 'gamma', got {arrival!r}")
    if not (math.isfinite(cv) and cv > 0):
        raise WorkloadError(f"synthetic: cv must be a positive number, got {cv}")
    if arrival == "poisson" and cv != 1.0:
        raise WorkloadError(
            f"synthetic: poisson arrivals have cv = 1; use arrival='gamma' for {cv}"
        )
    if len(lengths) == 0:
        raise WorkloadError(f"synthetic: length sample {lengths.name!r} is empty")

    arrival_seed, length_seed = np.random.SeedSequence(seed).spawn(2)
    arrival_rng = np.random.default_rng(arrival_seed)
    shape = 1.0 / cv**2

    def gaps(size: int) -> FloatArray:
        if arrival == "poisson":
            return arrival_rng.exponential(1.0 / rate, size=size)
        return arrival_rng.gamma(shape, 1.0 / (rate * shape), size=size)

    if n is not None and duration_s is None:
        times = np.concatenate([[0.0], np.cumsum(gaps(n - 1))])
    elif duration_s is not None and n is None:
        chunk = int(rate * duration_s * 1.1) + 16
        times = np.concatenate([[0.0], np.cumsum(gaps(chunk))])
        while times[-1] < duration_s:
            times = np.concatenate([times, times[-1] + np.cumsum(gaps(chunk))])
        times = times[times < duration_s]
    else:
        raise WorkloadError("synthetic: give exactly one of n and duration_s")

    picks = np.random.default_rng(length_seed).integers(0, len(lengths), size=len(times))
    label = arrival if arrival == "poisson" else f"gamma-cv{cv:g}"
    return Trace(
        name=f"synthetic-{label}-{lengths.name}",
        arrival_s=times,
        input_tokens=lengths.input_tokens[picks],
        output_tokens=lengths.output_tokens[picks],
    )
