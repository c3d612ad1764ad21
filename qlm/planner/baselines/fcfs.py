"""``FcfsDispatch``: a fleet of vLLM servers behind an ordinary load balancer, each serving its
own queue first-come-first-served."""

from __future__ import annotations

from typing import Literal

from qlm.domain import Decision, Pull, Request
from qlm.planner.policy import DispatchContext, PolicyBase


class FcfsDispatch(PolicyBase):
    """vLLM's default: dispatch on arrival, FCFS inside each engine."""

    def __init__(self, dispatch: Literal["least-loaded", "round-robin"] = "least-loaded") -> None:
        self.dispatch = dispatch
        self.name = "fcfs" if dispatch == "least-loaded" else "fcfs-rr"
        self._next: dict[str, int] = {}
        self._held: list[Request] = []  # no instance up serves them yet

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        decisions: list[Decision] = []
        added: dict[str, int] = {}
        gone = set(ctx.cancelled)
        waiting, self._held = [r for r in (*self._held, *ctx.arrived) if r.id not in gone], []
        for req in waiting:
            able = [i for i in ctx.instances if req.model in i.models and i.up]
            if not able:
                self._held.append(req)  # retried when an instance serving it is up
                continue
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
