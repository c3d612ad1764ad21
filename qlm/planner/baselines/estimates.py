"""What the baselines know of a request's cost: service times from the RCT profile and the
estimator's output-length posterior, which learns from every completion."""

from __future__ import annotations

from dataclasses import dataclass, field

from qlm.domain import Request
from qlm.planner.policy import Completion, DispatchContext, InstanceLoad
from qlm.rct.estimator import RCTEstimator
from qlm.rct.profile import HardwareProfile, RctProfile


@dataclass
class ServiceEstimates:
    """Service times from the RCT profile and the estimator's output-length posterior, which
    learns from every completion: what the baselines know of a request's cost."""

    profile: RctProfile
    estimator: RCTEstimator = field(init=False)
    _hardware: dict[tuple[str, str, int], HardwareProfile] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.estimator = RCTEstimator(self.profile)

    def hardware(self, model: str, load: InstanceLoad) -> HardwareProfile:
        key = (model, load.gpu, load.gpu_count)
        hw = self._hardware.get(key)
        if hw is None:
            hw = self._hardware[key] = self.profile.hardware_for(*key)
        return hw

    def output(self, request: Request, generated: int = 0) -> float:
        """Expected output tokens still to generate."""
        return self.estimator.output_moments(request, generated)[0]

    def decode_s(self, request: Request, generated: int, load: InstanceLoad) -> float:
        """Time to decode the expected output at a full batch's pace (``d`` of paper §6)."""
        return (
            self.output(request, generated) * self.hardware(request.model, load).decode_per_token_s
        )

    def service_s(self, request: Request, generated: int, load: InstanceLoad) -> float:
        """Prefill plus decode of the request on ``load``, once it runs: its latency with no wait."""
        hw = self.hardware(request.model, load)
        return hw.prefill_s(request.input_tokens + generated) + self.decode_s(
            request, generated, load
        )

    def work_s(self, request: Request, generated: int, load: InstanceLoad) -> float:
        """Seconds of a saturated instance the request takes (prompt work and its share of the
        decode throughput): what admitting it costs the others."""
        hw = self.hardware(request.model, load)
        prompt = (request.input_tokens + generated) * hw.input_token_work_s
        return prompt + self.output(request, generated) / hw.throughput_tps

    def observe(self, completion: Completion) -> None:
        self.estimator.observe(completion.request, output_tokens=completion.output_tokens)


class LearnsOutput:
    """``Policy.learn_output`` for the policies that estimate service times."""

    estimates: ServiceEstimates

    def learn_output(self, request: Request, output_tokens: int) -> bool:
        self.estimates.estimator.observe(request, output_tokens=output_tokens)
        return True


def serving(ctx: DispatchContext, model: str) -> list[InstanceLoad]:
    """Instances up and serving ``model`` (all serving it if none is up)."""
    able = [i for i in ctx.instances if model in i.models]
    return [i for i in able if i.up] or able
