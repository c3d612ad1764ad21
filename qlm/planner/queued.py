"""Pull-based dispatch: a policy holds requests in its own queues and instances pull from them.

``QueuedPolicy`` is the shared machinery of the baselines that hold requests back (EDF, S-EDF,
priority, PROSERVE, SHEPHERD). A subclass says *where* a request waits (``route``: one instance's
queue, or the global queue of its model that every instance serving the model pulls from) and in
*what order* (``key``: smaller first); the base keeps the queues as heaps and, at every step, lets
the instances pull their most urgent waiting request while they have room (``has_room``), the
least loaded instance first so that a global queue spreads a burst evenly.

Entries are never searched for: re-keying a request (``requeue``) pushes a new entry and leaves the
old one stale, skipped when it reaches the top. Every operation is O(log n) in the waiting requests.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from qlm.domain import Decision, Evict, Pull, Request
from qlm.planner.policy import (
    Completion,
    DispatchContext,
    InstanceLoad,
    PolicyBase,
    has_room,
    prompt_tokens,
)

Key = tuple[float, ...]


def instance_queue(instance: str) -> str:
    """Name of the queue only ``instance`` pulls from."""
    return f"instance:{instance}"


def model_queue(model: str) -> str:
    """Name of the global queue every instance serving ``model`` pulls from."""
    return f"model:{model}"


@dataclass(slots=True)
class Step:
    """One ``decide`` call in progress: the decisions so far and what they changed on each instance
    that the instance loads in the context do not show yet."""

    loads: dict[str, InstanceLoad]
    decisions: list[Decision] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=dict)  # pulled minus evicted, per instance
    tokens: dict[str, int] = field(default_factory=dict)
    pulled: set[str] = field(default_factory=set)

    def room(self, instance: str, request_tokens: int) -> bool:
        load = self.loads[instance]
        return has_room(
            load, self.requests.get(instance, 0), self.tokens.get(instance, 0), request_tokens
        )

    def running(self, instance: str) -> int:
        """Requests the instance has once this step's decisions are applied."""
        return self.loads[instance].outstanding_requests + self.requests.get(instance, 0)

    def add(self, instance: str, requests: int, tokens: int) -> None:
        self.requests[instance] = self.requests.get(instance, 0) + requests
        self.tokens[instance] = self.tokens.get(instance, 0) + tokens


class QueuedPolicy(PolicyBase):
    """Holds every request it is given in a heap and pulls it when an instance has room.

    Subclasses override ``key`` and, when they need to, ``route`` (default: the model's global
    queue), ``refresh`` (re-key requests whose urgency changed with time, before pulling),
    ``pull`` (a different pull loop), and ``on_pull`` / ``on_finish`` (their own bookkeeping).
    """

    name = "queued"

    def __init__(self) -> None:
        self._queues: dict[str, list[tuple[Key, int, str]]] = {}
        self._live: dict[str, tuple[str, int]] = {}  # waiting request -> (queue, seq) of its entry
        self._seq = 0
        self.requests: dict[str, Request] = {}  # waiting or in flight
        self.generated: dict[str, int] = {}  # output tokens a resumed request keeps
        self.inflight: dict[str, dict[str, int]] = {}  # instance -> request -> tokens, pull order

    # --- hooks -----------------------------------------------------------------------------------

    def route(self, request: Request, ctx: DispatchContext) -> str:
        """The queue ``request`` waits in (called once per arrival, resumptions included)."""
        return model_queue(request.model)

    def key(self, request: Request, ctx: DispatchContext) -> Key:
        """Order inside a queue, smaller first; ties are first-come-first-served."""
        raise NotImplementedError

    def refresh(self, ctx: DispatchContext) -> None:
        """Called after arrivals are queued and before pulling."""

    def on_pull(self, request: Request, instance: str, ctx: DispatchContext) -> None:
        """Called for each request pulled onto ``instance``."""

    def on_finish(self, completion: Completion) -> None:
        """Called for each completion, after the in-flight bookkeeping."""

    def on_return(self, request: Request) -> None:
        """Called for a request that came back from an instance (evicted, or its instance
        failed), after the in-flight bookkeeping."""

    # --- the step --------------------------------------------------------------------------------

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        for c in ctx.finished:
            self.inflight.get(c.instance, {}).pop(c.request.id, None)
            self.requests.pop(c.request.id, None)
            self.generated.pop(c.request.id, None)
            self.on_finish(c)
        for rid in ctx.cancelled:
            for sent in self.inflight.values():
                if sent.pop(rid, None) is not None and rid in self.requests:
                    self.on_return(self.requests[rid])
            self._live.pop(rid, None)  # its queue entry goes stale
            self.requests.pop(rid, None)
            self.generated.pop(rid, None)
        generated = dict(ctx.generated)
        for req in ctx.arrived:
            for sent in self.inflight.values():
                if sent.pop(req.id, None) is not None:
                    self.on_return(req)
            self.generated[req.id] = generated.get(req.id, 0)
            self.push(req, self.route(req, ctx), self.key(req, ctx))
        self.refresh(ctx)
        step = Step({load.name: load for load in ctx.instances})
        self.pull(ctx, step)
        return step.decisions

    def pull(self, ctx: DispatchContext, step: Step) -> None:
        """Each instance with room takes the most urgent head among the queues it pulls from
        (its own and its models' global ones), least loaded instance first. An instance whose best
        head does not fit stops: nothing overtakes the head of a queue."""
        order = [(step.running(i.name), i.name) for i in ctx.instances if i.up]
        heapq.heapify(order)
        while order:
            _, name = heapq.heappop(order)
            best: tuple[Key, int, str, str] | None = None
            for queue in self._sources(step.loads[name]):
                head = self._head(queue)
                if head is not None and (best is None or head[:2] < best[:2]):
                    best = (*head, queue)
            if best is None:
                continue
            request = self.requests[best[2]]
            if not step.room(name, self.tokens(request)):
                continue
            self.pop(best[3])
            self.pull_onto(step, request, name, ctx)
            heapq.heappush(order, (step.running(name), name))

    # --- queue operations ------------------------------------------------------------------------

    def push(self, request: Request, queue: str, key: Key) -> None:
        self._seq += 1
        self.requests[request.id] = request
        self._live[request.id] = (queue, self._seq)
        heapq.heappush(self._queues.setdefault(queue, []), (key, self._seq, request.id))

    def requeue(self, request_id: str, key: Key) -> None:
        """Give a waiting request a new key in its queue (its old entry goes stale)."""
        queue, _ = self._live[request_id]
        self.push(self.requests[request_id], queue, key)

    def waiting(self, request_id: str) -> bool:
        return request_id in self._live

    def peek(self, queue: str) -> str | None:
        head = self._head(queue)
        return None if head is None else head[2]

    def peek_many(self, queue: str, n: int) -> list[Request]:
        """The first ``n`` waiting requests of ``queue``, in order, left in place."""
        live = (e for e in self._queues.get(queue, ()) if self._live.get(e[2]) == (queue, e[1]))
        return [self.requests[rid] for _, _, rid in heapq.nsmallest(n, live)]

    def pop(self, queue: str) -> Request:
        """Remove and return the head of ``queue`` (which must not be empty)."""
        self._head(queue)
        _, _, request_id = heapq.heappop(self._queues[queue])
        del self._live[request_id]
        return self.requests[request_id]

    def queues(self) -> list[str]:
        """Names of the queues that hold waiting requests."""
        return [q for q in self._queues if self._head(q) is not None]

    def tokens(self, request: Request) -> int:
        return prompt_tokens(request, self.generated.get(request.id, 0))

    def pull_onto(self, step: Step, request: Request, instance: str, ctx: DispatchContext) -> None:
        """Emit ``Pull`` for a request already popped from its queue."""
        tokens = self.tokens(request)
        step.decisions.append(Pull(request.id, instance))
        step.add(instance, 1, tokens)
        step.pulled.add(request.id)
        self.inflight.setdefault(instance, {})[request.id] = tokens
        self.on_pull(request, instance, ctx)

    def evict(self, step: Step, request_id: str, instance: str) -> None:
        """Emit ``Evict``; the request comes back through ``ctx.arrived`` with its output."""
        tokens = self.inflight[instance].pop(request_id)
        step.decisions.append(Evict(request_id, instance))
        step.add(instance, -1, -tokens)

    def _sources(self, load: InstanceLoad) -> list[str]:
        return [instance_queue(load.name), *(model_queue(m) for m in load.models)]

    def _head(self, queue: str) -> tuple[Key, int, str] | None:
        heap = self._queues.get(queue)
        while heap:
            key, seq, request_id = heap[0]
            if self._live.get(request_id) == (queue, seq):
                return key, seq, request_id
            heapq.heappop(heap)
        return None
