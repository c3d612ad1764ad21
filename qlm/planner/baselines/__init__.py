"""Baseline policies, as the systems QLM is compared with behave.

``FcfsDispatch`` is a fleet of vLLM servers behind an ordinary load balancer: every request is sent
to an instance the moment it arrives (round-robin, or to the instance with the fewest outstanding
requests), and each instance serves its own queue first-come-first-served. Nothing is held back,
reordered or evicted: head-of-line blocking is left to happen, which is what QLM is measured against.

The others hold requests in their own queues and let instances pull (``qlm.planner.queued``), each
ordering and placing them as its paper does: ``EdfPolicy`` (QLM §8), ``SlackEdfPolicy`` (FlowPrefill
§5.2), ``PriorityPolicy`` (QLLM §3.2), ``ProservePolicy`` (PROSERVE §4.2–4.3) and ``ShepherdPolicy``
(as QLM §8 describes SHEPHERD). Where a paper acts inside the engine (prefill chunks, expert layers)
only its request-level part is reproduced: the engine stays vLLM. Output lengths come from the RCT
estimator (a policy never sees a request's true length; ``estimates``); ``create_baseline`` builds one
by name. A module each: ``fcfs``, ``edf`` (with S-EDF), ``priority``, ``proserve``, ``shepherd``.
"""

from __future__ import annotations

from dataclasses import dataclass

from qlm.planner.baselines.edf import EdfPolicy, SlackEdfPolicy
from qlm.planner.baselines.fcfs import FcfsDispatch
from qlm.planner.baselines.priority import PriorityPolicy
from qlm.planner.baselines.proserve import ProservePolicy
from qlm.planner.baselines.shepherd import ShepherdPolicy
from qlm.planner.policy import Policy
from qlm.rct.profile import RctProfile, default_profile


@dataclass(frozen=True, slots=True)
class BaselineConfig:
    """Every baseline's parameters (``QLM_BASELINES__*``): PROSERVE's (``ProservePolicy``), the
    priority policy's preemption, SHEPHERD's batch size (None: its own rule at each round),
    batches planned at once and ILP time limit."""

    priority_preempt: bool = True
    proserve_alpha: float = 0.9
    proserve_mu: float = 0.1
    proserve_lam: float = 0.7
    proserve_gamma: float = 1.0
    shepherd_batch_size: int | None = None
    shepherd_max_batches: int = 4
    shepherd_time_limit_s: float = 0.25


def create_baseline(
    name: str, *, profile: RctProfile | None = None, config: BaselineConfig | None = None
) -> Policy | None:
    """The baseline called ``name`` (``None`` if there is none) with ``config``'s parameters;
    ``profile`` defaults to the shipped RCT profile, for the policies that estimate service
    times."""
    c = config or BaselineConfig()
    if name == "fcfs":
        return FcfsDispatch(dispatch="least-loaded")
    if name == "fcfs-rr":
        return FcfsDispatch(dispatch="round-robin")
    if name == "edf":
        return EdfPolicy()
    if name == "priority":
        return PriorityPolicy(preempt=c.priority_preempt)
    if name in ("sedf", "proserve", "shepherd"):
        profile = profile or default_profile()
        if name == "sedf":
            return SlackEdfPolicy(profile)
        if name == "proserve":
            return ProservePolicy(
                profile,
                alpha=c.proserve_alpha,
                mu=c.proserve_mu,
                lam=c.proserve_lam,
                gamma=c.proserve_gamma,
            )
        return ShepherdPolicy(
            profile,
            batch_size=c.shepherd_batch_size,
            max_batches=c.shepherd_max_batches,
            time_limit_s=c.shepherd_time_limit_s,
        )
    return None
