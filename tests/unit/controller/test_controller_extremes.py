"""Property: the QLM policy, driven through the controller by extreme but valid requests, takes
every step and ends every request — none is rejected as poison.

SLOs from the API's minimum to 10^9 s, TTFT SLOs, max_tokens from 1 to the context, prompts
from 1 token to the context, many tenants, tiers and SLO classes, arrivals on the service's clock
(seconds since 1970, where a tiny SLO divides a large deadline) or from 0.
"""

from __future__ import annotations

from builders import make_catalog, make_profile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlm.domain import MIN_SLO_S, SLO, InstanceSpec, Request, RequestStatus, Tier
from qlm.planner import PlannerConfig, QlmPolicy
from qlm.sim.cluster import ClusterSimulation

CONTEXT = 8192  # the test catalog's models
INSTANCES = [InstanceSpec("i0", "G", ("m", "n")), InstanceSpec("i1", "G", ("m",))]

slos = st.one_of(
    st.sampled_from([MIN_SLO_S, 0.05, 1.0, 30.0, 3600.0, 1e9]),
    st.floats(min_value=MIN_SLO_S, max_value=1e9, allow_nan=False, allow_infinity=False),
)


@st.composite
def request_fields(draw: st.DrawFn) -> dict[str, object]:
    e2e = draw(slos)
    ttft = draw(
        st.one_of(
            st.none(),
            st.floats(min_value=MIN_SLO_S, max_value=1.0).map(lambda f: max(MIN_SLO_S, f * e2e)),
        )
    )
    prompt = draw(st.one_of(st.sampled_from([1, CONTEXT - 1]), st.integers(1, CONTEXT - 1)))
    room = CONTEXT - prompt
    max_tokens = draw(st.one_of(st.sampled_from([1, room]), st.integers(1, room)))
    return {
        "slo": SLO(e2e_s=e2e, ttft_s=None if ttft is None else min(ttft, e2e)),
        "input_tokens": prompt,
        "max_tokens": max_tokens,
        "replay_output_tokens": draw(st.integers(1, max_tokens)),
        "tier": draw(st.sampled_from(list(Tier))),
        "tenant": f"t{draw(st.integers(0, 40))}",
        "slo_class": draw(st.sampled_from(["default", "interactive", "batch", "c3"])),
        "model": draw(st.sampled_from(["m", "n"])),
        "gap": draw(st.sampled_from([0.0, 0.0, 1e-6, 0.5, 30.0])),
    }


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    fields=st.lists(request_fields(), min_size=1, max_size=40),
    start=st.sampled_from([0.0, 1.7e9]),
)
def test_extreme_valid_requests_all_end_and_none_is_poison(
    fields: list[dict[str, object]], start: float
) -> None:
    requests = []
    t = start
    for i, f in enumerate(fields):
        t += float(f.pop("gap"))  # type: ignore[arg-type]
        requests.append(Request(id=f"x{i}", arrival_s=t, **f))  # type: ignore[arg-type]
    policy = QlmPolicy(
        make_profile(), config=PlannerConfig.for_simulation(2000), measure_solve_time=False
    )
    sim = ClusterSimulation(INSTANCES, policy, catalog=make_catalog())
    result = sim.run(requests)  # every step completes: nothing raised
    assert len(result.records) == len(requests)
    for record in result.records:
        track = sim.controller.track(record.request.id)
        assert "could not be planned" not in track.error, track.error
        assert record.status is RequestStatus.FINISHED, (record.status, track.error)
        assert record.output_tokens == record.request.replay_output_tokens
