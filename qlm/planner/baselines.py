"""Baseline policies, as the systems QLM is compared with behave.

``FcfsDispatch`` is a fleet of vLLM servers behind an ordinary load balancer: every request is sent
to an instance the moment it arrives (round-robin, or to the instance with the fewest outstanding
requests), and each instance serves its own queue first-come-first-served. Nothing is held back,
reordered or evicted: head-of-line blocking is left to happen, which is what QLM is measured against.
"""

from __future__ import annotations

from typing import Literal

from qlm.domain import Decision, Pull
from qlm.planner.policy import DispatchContext


class FcfsDispatch:
    """vLLM's default: dispatch on arrival, FCFS inside each engine."""

    def __init__(self, dispatch: Literal["least-loaded", "round-robin"] = "least-loaded") -> None:
        self.dispatch = dispatch
        self.name = "fcfs" if dispatch == "least-loaded" else "fcfs-rr"
        self._next: dict[str, int] = {}

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        decisions: list[Decision] = []
        added: dict[str, int] = {}
        for req in ctx.arrived:
            able = [i for i in ctx.instances if req.model in i.models]
            if not able:
                continue  # nobody serves this model: it stays pending and the harness reports it
            if self.dispatch == "round-robin":
                k = self._next.get(req.model, 0)
                target = able[k % len(able)]
                self._next[req.model] = k + 1
            else:
                target = min(
                    able, key=lambda i: (i.outstanding_requests + added.get(i.name, 0), i.name)
                )
            added[target.name] = added.get(target.name, 0) + 1
            decisions.append(Pull(req.id, target.name))
        return decisions
