"""Trace loading (every format), bucket spreading and the transforms of ``qlm.sim.traces``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qlm.errors import WorkloadError
from qlm.sim.traces import (
    LENGTHS,
    TRACES,
    LengthSample,
    Trace,
    head,
    load_lengths,
    load_trace,
    scale_rate,
    synthetic,
    window,
    write_trace,
)

SHARED = Path("/work/shared/data/traces")


def make_trace(arrival: list[float], name: str = "t") -> Trace:
    n = len(arrival)
    return Trace(
        name=name,
        arrival_s=np.array(arrival),
        input_tokens=np.arange(100, 100 + n),
        output_tokens=np.arange(10, 10 + n),
    )


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- Shipped traces -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "requests"),
    [
        ("azure-code", 8819),
        ("azure-conv", 19366),
        ("mooncake-conversation", 12031),
        ("mooncake-synthetic", 3993),
    ],
)
def test_each_shipped_trace_loads_sorted_from_zero(name: str, requests: int) -> None:
    trace = load_trace(name)
    assert len(trace) == requests
    assert trace.name == name
    assert trace.arrival_s[0] == 0.0
    assert np.all(np.diff(trace.arrival_s) >= 0)
    assert trace.input_tokens.dtype == np.int64 and trace.output_tokens.dtype == np.int64
    assert trace.input_tokens.min() >= 1 and trace.output_tokens.min() >= 1


def test_azure_conv_statistics_match_the_data_readme() -> None:
    trace = load_trace("azure-conv")
    assert trace.rate == pytest.approx(5.53, abs=0.01)
    assert trace.output_tokens.max() == 1000
    assert np.median(trace.input_tokens) == 1020


@pytest.mark.parametrize(("name", "requests"), [("sharegpt", 30731), ("arxiv", 28257)])
def test_length_samples_unpack_into_input_and_output_arrays(name: str, requests: int) -> None:
    inputs, outputs = load_lengths(name)
    assert len(inputs) == len(outputs) == requests
    assert inputs.min() >= 1 and outputs.min() >= 1


def test_lengths_of_a_timed_trace_are_its_token_columns() -> None:
    sample = load_lengths("azure-code")
    trace = load_trace("azure-code")
    assert np.array_equal(sample.input_tokens, trace.input_tokens)
    assert np.array_equal(sample.output_tokens, trace.output_tokens)


def test_unknown_trace_name_lists_the_known_ones() -> None:
    with pytest.raises(WorkloadError) as info:
        load_trace("azure-cnv")
    for known in [*TRACES, *LENGTHS]:
        assert known in str(info.value)


def test_a_length_only_file_has_no_arrivals() -> None:
    with pytest.raises(WorkloadError, match="load_lengths"):
        load_trace("sharegpt")


# --- Reproducing the shared normalized CSVs (written independently of this code) -----------------


def read_normalized(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    table = np.loadtxt(SHARED / "normalized" / name, delimiter=",", skiprows=1)
    return table[:, 0], table[:, 1].astype(np.int64), table[:, 2].astype(np.int64)


needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="needs /work/shared (dev only)")


@needs_shared
@pytest.mark.parametrize(
    ("name", "file"),
    [
        ("azure-code", "azure2023_code.csv"),
        ("azure-conv", "azure2023_conv.csv"),
        ("mooncake-synthetic", "mooncake_synthetic.csv"),
    ],
)
def test_shipped_trace_reproduces_the_normalized_csv(name: str, file: str) -> None:
    arrival, inputs, outputs = read_normalized(file)
    trace = load_trace(name)
    assert np.allclose(trace.arrival_s, arrival, rtol=0, atol=1e-6)
    assert np.array_equal(trace.input_tokens, inputs)
    assert np.array_equal(trace.output_tokens, outputs)


@needs_shared
def test_mooncake_conversation_keeps_each_request_inside_its_normalized_bucket() -> None:
    bucket, inputs, outputs = read_normalized("mooncake_conversation.csv")
    trace = load_trace("mooncake-conversation", seed=3)
    assert np.array_equal(trace.input_tokens, inputs)
    assert np.array_equal(trace.output_tokens, outputs)
    assert np.all(trace.arrival_s >= bucket - 1e-9)
    assert np.all(trace.arrival_s < bucket + 3.0)
    # Spread, not left as bursts: nearly every request now has its own arrival time.
    assert len(np.unique(trace.arrival_s)) > 0.99 * len(trace)


# --- File formats ---------------------------------------------------------------------------------


def test_azure_csv_with_seven_digit_fractions_gives_seconds_since_the_first_request(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path / "azure.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.9000000,4808,10\n"
        "2023-11-16 23:59:59.9520000,3180,8\n"
        "2023-11-17 00:00:01.0000001,110,27\n",
    )
    trace = load_trace(path)
    assert trace.name == "azure"
    assert np.allclose(trace.arrival_s, [0.0, 0.052, 1.1000001], rtol=0, atol=1e-9)
    assert trace.input_tokens.tolist() == [4808, 3180, 110]
    assert trace.output_tokens.tolist() == [10, 8, 27]


def test_azure_csv_accepts_any_fraction_length_and_sorts_rows(tmp_path: Path) -> None:
    path = write(
        tmp_path / "azure.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:00:02.5,30,3\n"
        "2023-11-16 18:00:00,10,1\n"
        "2023-11-16T18:00:01.25,20,2\n",
    )
    trace = load_trace(path)
    assert trace.arrival_s.tolist() == [0.0, 1.25, 2.5]
    assert trace.input_tokens.tolist() == [10, 20, 30]


def test_azure_csv_with_a_bad_timestamp_names_the_file_and_line(tmp_path: Path) -> None:
    path = write(
        tmp_path / "azure.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,10,1\nyesterday,20,2\n",
    )
    with pytest.raises(WorkloadError, match=r"azure\.csv: line 3: TIMESTAMP 'yesterday'"):
        load_trace(path)


def test_mooncake_jsonl_timestamps_are_milliseconds(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1]},
        {"timestamp": 1250, "input_length": 7322, "output_length": 490, "hash_ids": [0]},
        {"timestamp": 4000, "input_length": 10, "output_length": 1},
    ]
    path = write(tmp_path / "moon.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    trace = load_trace(path)
    assert trace.arrival_s.tolist() == [0.0, 1.25, 4.0]
    assert trace.input_tokens.tolist() == [6758, 7322, 10]
    assert trace.output_tokens.tolist() == [500, 490, 1]


def test_mooncake_jsonl_with_a_missing_key_names_it_and_the_line(tmp_path: Path) -> None:
    path = write(
        tmp_path / "moon.jsonl",
        '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
        '{"timestamp": 10, "input_length": 5}\n',
    )
    with pytest.raises(WorkloadError, match=r"line 2: 'output_length'"):
        load_trace(path)


def test_written_trace_loads_back_as_a_normalized_csv(tmp_path: Path) -> None:
    original = make_trace([0.0, 0.5, 0.5000015, 7.25])
    path = tmp_path / "trace.csv"
    write_trace(original, path)
    assert path.read_text().splitlines()[0] == "arrival_s,input_tokens,output_tokens"
    loaded = load_trace(path)
    assert np.allclose(loaded.arrival_s, original.arrival_s, rtol=0, atol=1e-6)
    assert np.array_equal(loaded.input_tokens, original.input_tokens)
    assert np.array_equal(loaded.output_tokens, original.output_tokens)


def test_normalized_csv_with_a_non_integer_token_names_the_column_and_line(tmp_path: Path) -> None:
    path = write(
        tmp_path / "n.csv",
        "arrival_s,input_tokens,output_tokens\n0.0,10,1\n1.0,ten,1\n",
    )
    with pytest.raises(WorkloadError, match=r"line 3: column 'input_tokens' is 'ten'"):
        load_trace(path)


def test_length_csv_loads_prefill_and_decode_columns(tmp_path: Path) -> None:
    path = write(
        tmp_path / "lengths.csv",
        "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n74,918,992,0.08\n3,5,8,0.6\n",
    )
    sample = load_lengths(path)
    assert isinstance(sample, LengthSample)
    assert sample.input_tokens.tolist() == [74, 3]
    assert sample.output_tokens.tolist() == [918, 5]


def test_unrecognised_csv_header_lists_the_supported_formats(tmp_path: Path) -> None:
    path = write(tmp_path / "x.csv", "time,prompt,completion\n0,1,2\n")
    with pytest.raises(WorkloadError, match=r"unrecognised trace format.*arrival_s,input_tokens"):
        load_trace(path)


def test_empty_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="empty"):
        load_trace(write(tmp_path / "e.csv", "\n"))


# --- Bucket spreading ----------------------------------------------------------------------------


def quantised_mooncake(tmp_path: Path) -> Path:
    """Twelve requests in four 3 s buckets (the last one alone), as Mooncake conversation."""
    stamps = [0, 0, 0, 0, 3000, 3000, 3000, 5999, 5999, 5999, 5999, 9000]
    lines = [
        json.dumps({"timestamp": t, "input_length": 100 + i, "output_length": 1 + i})
        for i, t in enumerate(stamps)
    ]
    return write(tmp_path / "buckets.jsonl", "\n".join(lines))


def test_bucketed_requests_are_spread_inside_their_bucket_in_file_order(tmp_path: Path) -> None:
    trace = load_trace(quantised_mooncake(tmp_path), seed=7)
    bucket = np.array([0, 0, 0, 0, 3, 3, 3, 5.999, 5.999, 5.999, 5.999, 9.0])
    next_bucket = np.array([3, 3, 3, 3, 5.999, 5.999, 5.999, 9, 9, 9, 9, 12.0])
    assert trace.arrival_s[0] == 0.0
    assert np.all(trace.arrival_s >= bucket)
    assert np.all(trace.arrival_s < next_bucket)
    assert np.all(np.diff(trace.arrival_s) >= 0)
    assert trace.input_tokens.tolist() == list(range(100, 112))  # file order kept
    assert len(np.unique(trace.arrival_s)) == len(trace)


def test_bucket_spreading_is_deterministic_per_seed(tmp_path: Path) -> None:
    path = quantised_mooncake(tmp_path)
    first, again, other = (
        load_trace(path, seed=1),
        load_trace(path, seed=1),
        load_trace(path, seed=2),
    )
    assert np.array_equal(first.arrival_s, again.arrival_s)
    assert not np.array_equal(first.arrival_s, other.arrival_s)


def test_a_trace_without_quantised_timestamps_ignores_the_seed() -> None:
    assert np.array_equal(
        load_trace("mooncake-synthetic", seed=0).arrival_s,
        load_trace("mooncake-synthetic", seed=9).arrival_s,
    )


# --- The Trace type and its transforms -----------------------------------------------------------


def test_trace_arrays_are_read_only_copies() -> None:
    arrival = np.array([0.0, 1.0])
    trace = Trace("t", arrival, np.array([1, 2]), np.array([3, 4]))
    arrival[1] = 5.0
    assert trace.arrival_s[1] == 1.0
    with pytest.raises(ValueError):
        trace.arrival_s[0] = 2.0


@pytest.mark.parametrize(
    ("arrival", "message"),
    [([1.0, 2.0], "first arrival"), ([0.0, 2.0, 1.0], "not sorted")],
)
def test_trace_rejects_arrivals_not_sorted_from_zero(arrival: list[float], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        make_trace(arrival)


def test_trace_rejects_arrays_of_different_lengths() -> None:
    with pytest.raises(WorkloadError, match="differ in length"):
        Trace("t", np.array([0.0, 1.0]), np.array([1]), np.array([1, 2]))


def test_duration_and_rate_span_first_to_last_arrival() -> None:
    trace = make_trace([0.0, 1.0, 2.0, 4.0])
    assert trace.duration_s == 4.0
    assert trace.rate == 1.0
    assert make_trace([]).rate == 0.0


def test_scale_rate_of_two_halves_the_timestamps_and_keeps_the_original() -> None:
    trace = make_trace([0.0, 1.0, 3.0])
    faster = scale_rate(trace, 2.0)
    assert faster.arrival_s.tolist() == [0.0, 0.5, 1.5]
    assert faster.rate == pytest.approx(2 * trace.rate)
    assert np.array_equal(faster.input_tokens, trace.input_tokens)
    assert trace.arrival_s.tolist() == [0.0, 1.0, 3.0]


@pytest.mark.parametrize("factor", [0.0, -1.0, float("inf")])
def test_scale_rate_rejects_non_positive_factors(factor: float) -> None:
    with pytest.raises(WorkloadError, match="factor"):
        scale_rate(make_trace([0.0]), factor)


def test_window_keeps_half_open_interval_and_rezeroes() -> None:
    trace = make_trace([0.0, 1.0, 2.5, 4.0, 5.0])
    cut = window(trace, 1.0, 5.0)
    assert cut.arrival_s.tolist() == [0.0, 1.5, 3.0]
    assert cut.input_tokens.tolist() == [101, 102, 103]
    assert len(window(trace, 5.5, 9.0)) == 0


def test_window_rejects_an_empty_interval() -> None:
    with pytest.raises(WorkloadError, match="start_s"):
        window(make_trace([0.0]), 2.0, 2.0)


def test_head_keeps_the_first_requests() -> None:
    trace = make_trace([0.0, 1.0, 2.0])
    assert head(trace, 2).arrival_s.tolist() == [0.0, 1.0]
    assert len(head(trace, 10)) == 3


# --- Synthetic arrivals --------------------------------------------------------------------------


def interarrival_cv(trace: Trace) -> float:
    gaps = np.diff(trace.arrival_s)
    return float(gaps.std() / gaps.mean())


def test_poisson_arrivals_have_the_requested_rate_and_cv_one() -> None:
    trace = synthetic(load_lengths("sharegpt"), rate=5.0, n=20_000, seed=1)
    assert len(trace) == 20_000
    assert trace.arrival_s[0] == 0.0
    assert trace.rate == pytest.approx(5.0, rel=0.05)
    assert interarrival_cv(trace) == pytest.approx(1.0, abs=0.1)


def test_gamma_arrivals_have_the_requested_burstiness() -> None:
    trace = synthetic(load_lengths("sharegpt"), rate=2.0, n=50_000, arrival="gamma", cv=3.0, seed=1)
    assert trace.rate == pytest.approx(2.0, rel=0.1)
    assert interarrival_cv(trace) == pytest.approx(3.0, rel=0.15)


def test_synthetic_for_a_duration_stops_before_it() -> None:
    trace = synthetic(load_lengths("arxiv"), rate=10.0, duration_s=1000.0, seed=2)
    assert trace.arrival_s[-1] < 1000.0
    assert len(trace) == pytest.approx(10_000, rel=0.05)


def test_synthetic_lengths_are_pairs_drawn_from_the_sample() -> None:
    sample = LengthSample("tiny", np.array([10, 20, 30]), np.array([1, 2, 3]))
    trace = synthetic(sample, rate=1.0, n=300, seed=4)
    assert set(zip(trace.input_tokens.tolist(), trace.output_tokens.tolist(), strict=True)) == {
        (10, 1),
        (20, 2),
        (30, 3),
    }


def test_synthetic_is_deterministic_per_seed() -> None:
    sample = load_lengths("sharegpt")
    first = synthetic(sample, rate=3.0, n=500, arrival="gamma", cv=2.0, seed=11)
    again = synthetic(sample, rate=3.0, n=500, arrival="gamma", cv=2.0, seed=11)
    other = synthetic(sample, rate=3.0, n=500, arrival="gamma", cv=2.0, seed=12)
    assert np.array_equal(first.arrival_s, again.arrival_s)
    assert np.array_equal(first.input_tokens, again.input_tokens)
    assert not np.array_equal(first.arrival_s, other.arrival_s)
    assert not np.array_equal(first.input_tokens, other.input_tokens)


def test_synthetic_lengths_do_not_depend_on_the_arrival_process() -> None:
    sample = load_lengths("sharegpt")
    poisson = synthetic(sample, rate=3.0, n=500, seed=5)
    bursty = synthetic(sample, rate=3.0, n=500, arrival="gamma", cv=4.0, seed=5)
    assert np.array_equal(poisson.input_tokens, bursty.input_tokens)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 1.0}, "exactly one of n and duration_s"),
        ({"rate": 1.0, "n": 5, "duration_s": 9.0}, "exactly one of n and duration_s"),
        ({"rate": 0.0, "n": 5}, "rate"),
        ({"rate": 1.0, "n": 5, "cv": 2.0}, "poisson arrivals have cv = 1"),
        ({"rate": 1.0, "n": 0}, "n must be >= 1"),
    ],
)
def test_synthetic_rejects_inconsistent_arguments(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        synthetic(load_lengths("arxiv"), **kwargs)  # type: ignore[arg-type]
