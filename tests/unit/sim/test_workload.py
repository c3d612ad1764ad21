"""Turning traces into requests: the documented rules and the W_A / W_B / W_C presets."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from qlm.domain import Request, Tier
from qlm.errors import WorkloadError
from qlm.sim.traces import Trace, head, load_trace
from qlm.sim.workload import (
    MegaPrompts,
    ModelShare,
    SLOClass,
    WorkloadSpec,
    build_requests,
    create_workload,
    exact_counts,
    model_context,
    parse_ttft_slo,
    preset_spec,
    repeated,
)


def make_trace(n: int = 1000, *, input_tokens: int = 500, output_tokens: int = 100) -> Trace:
    return Trace(
        name="t",
        arrival_s=np.arange(n, dtype=np.float64) * 0.5,
        input_tokens=np.full(n, input_tokens),
        output_tokens=np.full(n, output_tokens),
    )


def make_spec(**overrides: object) -> WorkloadSpec:
    fields: dict[str, object] = {
        "name": "test",
        "models": (ModelShare("llama-2-7b", 1.0, 4096),),
        "slo_classes": (SLOClass("only", 30.0, Tier.STANDARD, 1.0),),
    }
    fields.update(overrides)
    return WorkloadSpec(**fields)  # type: ignore[arg-type]


def shares(requests: list[Request], field: str) -> dict[str, float]:
    counts = Counter(getattr(r, field) for r in requests)
    return {k: v / len(requests) for k, v in counts.items()}


# --- Presets ----------------------------------------------------------------------------------


def test_default_workload_is_one_model_and_one_slo_class() -> None:
    requests = create_workload("default", make_trace(10))
    assert {r.model for r in requests} == {"llama-3-8b"}
    assert {(r.slo_class, r.slo.e2e_s, r.tier, r.tenant) for r in requests} == {
        ("default", 60.0, Tier.STANDARD, "default")
    }
    assert [r.id for r in requests[:3]] == ["r000000", "r000001", "r000002"]


def test_wa_has_more_than_half_tail_models() -> None:
    spec = preset_spec("wa")
    uniform = 1 / len(spec.models)
    tails = [m for m in spec.models if m.share < uniform]
    assert len(tails) / len(spec.models) > 0.5
    assert {m.name for m in spec.models} <= {
        "llama-3-8b",
        "llama-2-7b",
        "llama-2-13b",
        "llama-2-70b",
    }


def test_wa_gives_each_model_exactly_its_documented_share() -> None:
    requests = create_workload("wa", make_trace(1000), seed=3)
    assert Counter(r.model for r in requests) == {
        "llama-3-8b": 700,
        "llama-2-7b": 150,
        "llama-2-13b": 100,
        "llama-2-70b": 50,
    }


def test_wa_splits_interactive_and_batch_classes_evenly() -> None:
    requests = create_workload("wa", make_trace(1000), seed=3)
    classes = {r.slo_class: (r.slo.e2e_s, r.tier, r.tenant) for r in requests}
    assert classes == {
        "interactive": (20.0, Tier.INTERACTIVE, "interactive"),
        "batch": (300.0, Tier.BATCH, "batch"),
    }
    assert classes["interactive"][0] < 30.0  # the paper's latency-sensitive bound
    assert shares(requests, "slo_class") == {"interactive": 0.5, "batch": 0.5}


def test_wa_mixes_models_and_classes_independently() -> None:
    requests = create_workload("wa", make_trace(4000), seed=1)
    head_model = [r for r in requests if r.model == "llama-3-8b"]
    interactive = sum(r.slo_class == "interactive" for r in head_model) / len(head_model)
    assert 0.45 < interactive < 0.55


def test_wb_is_one_model_with_three_slo_classes() -> None:
    requests = create_workload("wb", make_trace(1000), seed=2)
    assert {r.model for r in requests} == {"llama-3-8b"}
    assert shares(requests, "slo_class") == {"interactive": 0.4, "standard": 0.3, "batch": 0.3}
    tiers = {r.slo_class: r.tier for r in requests}
    assert tiers == {
        "interactive": Tier.INTERACTIVE,
        "standard": Tier.STANDARD,
        "batch": Tier.BATCH,
    }


def test_wc_adds_one_percent_mega_prompts_filling_the_context() -> None:
    trace = make_trace(2000)
    requests = create_workload("wc", trace, seed=5)
    mega = [r for r in requests if ("kind", "mega") in r.labels]
    assert len(mega) == 20
    assert len(requests) == 2020
    for r in mega:
        context = model_context(r.model)
        assert r.input_tokens == context * 3 // 4
        assert r.max_tokens == r.replay_output_tokens == context // 4
        assert r.slo_class == "batch" and r.tier is Tier.BATCH
        assert 0 <= r.arrival_s < trace.duration_s
        assert r.id.startswith("m")


def test_wc_regular_requests_are_exactly_those_of_wa() -> None:
    trace = make_trace(500)
    wa = create_workload("wa", trace, seed=8)
    wc = create_workload("wc", trace, seed=8)
    assert [r for r in wc if not r.labels] == wa


def test_mega_share_sets_the_number_of_mega_prompts() -> None:
    requests = create_workload("wc", make_trace(1000), mega_share=0.05)
    assert sum(r.id.startswith("m") for r in requests) == 50


def test_requests_come_sorted_by_arrival() -> None:
    requests = create_workload("wc", make_trace(1000), seed=4)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)


def test_slo_scale_multiplies_every_slo() -> None:
    requests = create_workload("wb", make_trace(100), slo_scale=3.0)
    assert {r.slo.e2e_s for r in requests} == {60.0, 180.0, 900.0}


def test_interactive_share_rescales_the_other_classes() -> None:
    requests = create_workload("wb", make_trace(1000), interactive_share=0.8)
    assert shares(requests, "slo_class") == {"interactive": 0.8, "standard": 0.1, "batch": 0.1}


def test_tail_share_sets_the_tail_models_total_share() -> None:
    requests = create_workload("wa", make_trace(1200), tail_share=0.6)
    assert Counter(r.model for r in requests) == {
        "llama-3-8b": 480,
        "llama-2-7b": 360,
        "llama-2-13b": 240,
        "llama-2-70b": 120,
    }


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("wd", {}, "unknown workload 'wd'; known: default, wa, wb, wc"),
        ("wb", {"tail_share": 0.2}, "tail_share applies to wa and wc only"),
        ("wa", {"mega_share": 0.2}, "mega_share applies to wc only"),
        ("default", {"interactive_share": 0.5}, "no 'interactive' class"),
        ("wa", {"slo_scale": 0.0}, "slo_scale must be > 0"),
    ],
)
def test_bad_preset_arguments_are_named(name: str, kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        create_workload(name, make_trace(10), **kwargs)  # type: ignore[arg-type]


# --- Determinism ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["wa", "wb", "wc"])
def test_same_seed_gives_the_same_requests_and_another_seed_does_not(name: str) -> None:
    trace = head(load_trace("azure-conv"), 2000)
    first = create_workload(name, trace, seed=42)
    again = create_workload(name, trace, seed=42)
    other = create_workload(name, trace, seed=43)
    assert first == again
    assert first != other


def test_request_fields_are_plain_python_numbers() -> None:
    request = create_workload("wa", make_trace(5))[0]
    assert type(request.input_tokens) is int
    assert type(request.max_tokens) is int
    assert type(request.arrival_s) is float


# --- Lengths, caps and clamping ---------------------------------------------------------------


def test_max_tokens_defaults_to_the_traces_largest_output() -> None:
    trace = Trace(
        "t", np.array([0.0, 1.0, 2.0]), np.array([100, 100, 100]), np.array([10, 1000, 50])
    )
    requests = build_requests(trace, make_spec())
    assert [r.max_tokens for r in requests] == [1000, 1000, 1000]
    assert [r.replay_output_tokens for r in requests] == [10, 1000, 50]


def test_max_tokens_is_limited_by_the_context_left_after_the_input() -> None:
    trace = make_trace(3, input_tokens=3500, output_tokens=100)
    requests = build_requests(trace, make_spec(max_tokens=2000))
    assert {r.max_tokens for r in requests} == {4096 - 3500}


def test_max_tokens_is_never_below_the_true_output() -> None:
    requests = build_requests(make_trace(3, output_tokens=300), make_spec(max_tokens=200))
    assert {r.max_tokens for r in requests} == {300}


def test_azure_conv_caps_are_1000_and_cover_every_output() -> None:
    requests = create_workload("default", load_trace("azure-conv"))
    assert max(r.max_tokens for r in requests) == 1000
    assert all(r.output_tokens_to_generate == r.replay_output_tokens for r in requests)


@pytest.mark.parametrize(
    ("input_tokens", "output_tokens", "kept_input", "kept_output"),
    [
        (10_000, 500, 3596, 500),  # the input is truncated first
        (100, 5000, 1, 4095),  # only an output alone too long for the context is cut
        (0, 0, 1, 1),  # empty lengths become one token
    ],
)
def test_lengths_are_clamped_to_the_model_context(
    input_tokens: int, output_tokens: int, kept_input: int, kept_output: int
) -> None:
    trace = make_trace(1, input_tokens=input_tokens, output_tokens=output_tokens)
    (request,) = build_requests(trace, make_spec())
    assert (request.input_tokens, request.replay_output_tokens) == (kept_input, kept_output)
    assert request.input_tokens + request.max_tokens <= 4096


def test_every_preset_request_fits_its_model_context() -> None:
    requests = create_workload("wc", load_trace("mooncake-conversation"), seed=1)
    for r in requests:
        assert r.input_tokens + r.max_tokens <= model_context(r.model)


def test_tenant_defaults_to_the_slo_class_name_unless_set() -> None:
    spec = make_spec(
        slo_classes=(
            SLOClass("chat", 20.0, Tier.INTERACTIVE, 0.5),
            SLOClass("jobs", 600.0, Tier.BATCH, 0.5, tenant="acme"),
        )
    )
    tenants = {(r.slo_class, r.tenant) for r in build_requests(make_trace(10), spec)}
    assert tenants == {("chat", "chat"), ("jobs", "acme")}


def test_ttft_is_scaled_with_the_e2e_slo() -> None:
    spec = make_spec(
        slo_classes=(SLOClass("chat", 20.0, Tier.INTERACTIVE, 1.0, ttft_s=2.0),), slo_scale=2.0
    )
    (request,) = build_requests(make_trace(1), spec)
    assert (request.slo.e2e_s, request.slo.ttft_s) == (40.0, 4.0)


def test_empty_trace_gives_no_requests() -> None:
    assert create_workload("wc", make_trace(0)) == []


# --- Spec validation --------------------------------------------------------------------------


def test_shares_must_sum_to_one_and_the_error_shows_them() -> None:
    with pytest.raises(WorkloadError, match=r"sum to 1, got 0\.9.*'a': 0\.5"):
        make_spec(models=(ModelShare("a", 0.5, 4096), ModelShare("b", 0.4, 4096)))


def test_mega_prompts_must_use_a_known_slo_class() -> None:
    with pytest.raises(WorkloadError, match="'batch', which is not one of"):
        make_spec(mega=MegaPrompts(share=0.1))


def test_an_slo_class_with_ttft_above_e2e_is_rejected_by_name() -> None:
    with pytest.raises(WorkloadError, match="SLO class 'chat'"):
        SLOClass("chat", 10.0, Tier.INTERACTIVE, 1.0, ttft_s=20.0)


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 1001])
def test_exact_counts_add_up_and_follow_the_shares(n: int) -> None:
    counts = exact_counts([0.7, 0.15, 0.1, 0.05], n)
    assert sum(counts) == n
    for count, share in zip(counts, [0.7, 0.15, 0.1, 0.05], strict=True):
        assert abs(count - share * n) < 1


def test_ttft_slos_are_set_per_class_in_any_workload_and_scaled_like_every_slo() -> None:
    requests = create_workload(
        "wb", make_trace(100), slo_scale=2.0, ttft_slo={"interactive": 1.5, "batch": 30.0}
    )
    ttft = {r.slo_class: r.slo.ttft_s for r in requests}
    assert ttft == {"interactive": 3.0, "standard": None, "batch": 60.0}
    plain = create_workload("wb", make_trace(100), slo_scale=2.0)
    assert [r.id for r in plain] == [r.id for r in requests]  # nothing else changes
    assert all(r.slo.ttft_s is None for r in plain)


def test_ttft_slos_name_classes_of_the_workload_and_fit_in_their_end_to_end_slo() -> None:
    with pytest.raises(WorkloadError, match="no SLO class 'chat' in this workload"):
        preset_spec("wb", ttft_slo={"chat": 1.0})
    with pytest.raises(WorkloadError, match="longer than the class's end-to-end SLO"):
        preset_spec("wb", ttft_slo={"interactive": 25.0})


def test_ttft_slo_text_is_class_equals_seconds_separated_by_commas() -> None:
    assert parse_ttft_slo("interactive=1.5") == {"interactive": 1.5}
    assert parse_ttft_slo(" interactive = 1.5 , standard=5") == {
        "interactive": 1.5,
        "standard": 5.0,
    }
    for text, needle in {
        "interactive": "expected CLASS=SECONDS",
        "=2": "expected CLASS=SECONDS",
        "interactive=": "expected CLASS=SECONDS",
        "interactive=soon": "not a number of seconds",
        "interactive=0": "seconds must be > 0",
        "interactive=-1": "seconds must be > 0",
        "interactive=nan": "seconds must be > 0",
        "a=1,a=2": "given twice",
    }.items():
        with pytest.raises(WorkloadError, match=needle):
            parse_ttft_slo(text)


def test_a_single_model_preset_serves_the_fleets_models_when_it_lacks_its_own() -> None:
    from qlm.sim.workload import preset_spec

    assert [m.name for m in preset_spec("default", fleet_models=["llama-3-8b", "x"]).models] == [
        "llama-3-8b"
    ]
    spec = preset_spec("wb", fleet_models=["llama-2-70b", "llama-2-7b", "llama-2-70b"])
    assert [(m.name, m.share, m.max_context) for m in spec.models] == [
        ("llama-2-70b", 0.5, 4096),
        ("llama-2-7b", 0.5, 4096),
    ]


def test_a_repeated_backlog_has_fresh_ids_and_arrived_over_the_last_minute() -> None:
    base = create_workload("wb", make_trace(3), seed=0)
    backlog = repeated(base, 7, now=100.0, tag="q")
    assert [r.id for r in backlog[:4]] == [f"q0-{base[0].id}", f"q0-{base[1].id}",
                                           f"q0-{base[2].id}", f"q1-{base[0].id}"]  # fmt: skip
    assert len({r.id for r in backlog}) == 7
    assert [r.input_tokens for r in backlog] == [base[k % 3].input_tokens for k in range(7)]
    assert all(40.0 <= r.arrival_s < 100.0 for r in backlog)
    assert backlog[0].arrival_s == 40.0
