"""Earliest-deadline-first baselines: QLM's EDF and FlowPrefill's slack-aware EDF."""

from __future__ import annotations

import heapq

from qlm.domain import Request
from qlm.planner.baselines.estimates import LearnsOutput, ServiceEstimates, serving
from qlm.planner.policy import Completion, DispatchContext
from qlm.planner.queued import QueuedPolicy
from qlm.rct.profile import RctProfile


class EdfPolicy(QueuedPolicy):
    """Earliest deadline first: QLM's EDF baseline (QLM §8, "requests are sorted by their SLO
    values"), on the absolute end-to-end deadline so that an old request with a loose SLO is not
    overtaken forever. One global queue per model; any instance serving the model with room pulls
    its head. No eviction or KV swap (QLM §8.2 credits its gain over EDF to choosing between them)."""

    name = "edf"

    def key(self, request: Request, ctx: DispatchContext) -> tuple[float, ...]:
        return (request.deadline_s,)


class SlackEdfPolicy(LearnsOutput, QueuedPolicy):
    """FlowPrefill's slack-aware EDF (FlowPrefill §5.2, Eq. 3): ``priority = sgn(slack) /
    deadline``, ``slack = deadline − now − T̂``, highest priority first.

    Read literally, requests with non-negative slack go first, earliest deadline first; a request
    whose slack went negative (it can no longer make its deadline) drops behind all of them, and
    among those late requests a larger deadline means a larger ``−1/deadline``, so the *latest*
    deadline goes first. Both are kept. FlowPrefill schedules TTFT deadlines with ``T̂`` its
    predicted prefill time; QLM's SLO is end to end, so ``deadline`` is the end-to-end deadline and
    ``T̂`` the predicted prefill plus the expected decode (profile and output posterior), estimated
    when the request is queued, on the fastest instance serving its model. The slack turns negative
    at a known time, so a heap of those times re-keys each request once.

    Not reproduced: FlowPrefill's operator-level preemption of a running prefill and its SLO-aware
    prefill batching (Alg. 1, 2) act inside the engine, which stays vLLM; here S-EDF orders the
    global queue per model that instances pull from, at every arrival and completion (its
    event-driven trigger).
    """

    name = "sedf"

    def __init__(self, profile: RctProfile) -> None:
        super().__init__()
        self.estimates = ServiceEstimates(profile)
        self._turns: list[tuple[float, str]] = []  # (time the slack turns negative, request)
        self._turn_at: dict[str, float] = {}

    def key(self, request: Request, ctx: DispatchContext) -> tuple[float, ...]:
        generated = self.generated.get(request.id, 0)
        able = serving(ctx, request.model)
        service = min((self.estimates.service_s(request, generated, i) for i in able), default=0.0)
        turn = request.deadline_s - service
        if ctx.now > turn:
            return (1.0, -request.deadline_s)
        self._turn_at[request.id] = turn
        heapq.heappush(self._turns, (turn, request.id))
        return (0.0, request.deadline_s)

    def refresh(self, ctx: DispatchContext) -> None:
        while self._turns and self._turns[0][0] < ctx.now:
            turn, request_id = heapq.heappop(self._turns)
            if self._turn_at.get(request_id) != turn:
                continue  # an entry of an earlier stay in the queue
            del self._turn_at[request_id]
            if self.waiting(request_id):
                self.requeue(request_id, (1.0, -self.requests[request_id].deadline_s))

    def on_pull(self, request: Request, instance: str, ctx: DispatchContext) -> None:
        self._turn_at.pop(request.id, None)

    def on_finish(self, completion: Completion) -> None:
        self.estimates.observe(completion)
