"""The agents on the wall clock: ``AgentRuntime`` applies the controller's decisions to async
engines (simulated instances at 50x real time). Waits poll with a generous deadline; nothing
asserts on elapsed time."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
from builders import make_catalog, make_profile, make_request, simulated_vllm

from qlm.clock import WallClock
from qlm.controller import Controller
from qlm.domain import SLO, Decision, Evict, InstanceSpec, Pull, RequestRecord, RequestStatus
from qlm.engines.base import Engine, EngineOutput, EngineRequest, TokenChunk
from qlm.engines.wallclock import WallClockEngine, count_tokens, filler_text
from qlm.errors import EngineError, EngineTimeout
from qlm.planner import PlannerConfig, create_policy
from qlm.planner.policy import DispatchContext, Policy, PolicyBase
from qlm.service import runtime
from qlm.service.jobs import Job
from qlm.service.runtime import (
    DOWN_AFTER_HEALTH_TIMEOUTS,
    MAX_STREAM_FAILURES,
    AgentRuntime,
    RuntimeListener,
)

SCALE = 50.0


class Recorder(RuntimeListener):
    def __init__(self) -> None:
        self.errors: dict[str, str] = {}
        self.done: dict[str, tuple[RequestRecord, str]] = {}
        self.back: list[tuple[str, int]] = []
        self.dropped: dict[str, int] = {}
        self.cancels: list[tuple[str, int]] = []
        self.changes: list[tuple[str, bool]] = []
        self.sent: list[tuple[str, str]] = []
        self.streamed: list[str] = []  # the text chunks passed on, of whatever request
        self.calls: dict[str, tuple[str, tuple[Any, ...]]] = {}  # finish reason, tool calls
        self.plans: list[Any] = []
        self.marks: list[str] = []  # "stepping" / "stepped", in order

    def stepping(self) -> None:
        self.marks.append("stepping")

    def stepped(self) -> None:
        self.marks.append("stepped")

    def planned(self, plans: Any) -> None:
        self.plans += plans

    def dispatched(self, request_id: str, instance: str, at: float) -> None:
        self.sent.append((request_id, instance))

    def finished(
        self, record: RequestRecord, text: str, finish_reason: str, tool_calls: Any = ()
    ) -> None:
        self.done[record.request.id] = (record, text)
        self.calls[record.request.id] = (finish_reason, tuple(tool_calls))

    def returned(
        self, request_id: str, partial_text: str, partial_tokens: int, *, evicted: bool = False
    ) -> None:
        self.back.append((request_id, partial_tokens))

    def cancelled(self, request_id: str, partial_text: str, tokens: int) -> None:
        self.dropped[request_id] = tokens
        self.cancels.append((request_id, tokens))

    def failed(self, request_id: str, error: str) -> None:
        self.errors[request_id] = error

    def instance_changed(self, name: str, up: bool) -> None:
        self.changes.append((name, up))

    def chunk(self, request_id: str, chunk: TokenChunk) -> None:
        self.streamed.append(chunk.text)


def engine(name: str) -> WallClockEngine:
    return WallClockEngine.from_catalog(name, "m", "G", 1, time_scale=SCALE, catalog=make_catalog())


async def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30.0
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        await asyncio.sleep(0.005)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


class Flaky:
    """An engine that can break like a server whose process died: calls fail, streams cut."""

    def __init__(self, inner: WallClockEngine) -> None:
        self.inner = inner
        self.name = inner.name
        self.broken = False

    def break_(self) -> None:
        self.broken = True
        for rid in self.inner.in_flight():
            self.inner.abort_nowait(rid)

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    async def capabilities(self) -> Any:
        if self.broken:
            raise EngineError(f"{self.name}: connection refused")
        return await self.inner.capabilities()

    async def submit(self, request: EngineRequest, on_chunk: Any = None) -> EngineOutput:
        if self.broken:
            raise EngineError(f"{self.name}: connection refused")
        out = await self.inner.submit(request, on_chunk)
        if self.broken:
            raise EngineError(f"{self.name}: stream cut")
        return out

    async def abort(self, request_id: str) -> EngineOutput:
        if self.broken:
            raise EngineError(f"{self.name}: connection refused")
        return await self.inner.abort(request_id)

    async def health(self) -> bool:
        return not self.broken and await self.inner.health()


def start(policy: Policy, engines: list[Any], recorder: Recorder, **kw: Any) -> AgentRuntime:
    specs = [InstanceSpec(e.name, "G", ("m",)) for e in engines]
    return AgentRuntime(
        Controller(policy, specs),
        engines,
        clock=WallClock(SCALE),
        listener=recorder,
        tick_s=0.02,
        health_interval_s=0.02,
        **kw,
    )


async def streaming_on_i0(rt: AgentRuntime) -> None:
    """Start ``rt``, give it 12 long requests at once and wait until some stream on ``i0``."""
    await rt.start()
    now = rt.clock.now()
    for i in range(12):
        rt.submit(make_request(i, arrival_s=now, replay_output_tokens=400, max_tokens=500))
    await eventually(
        lambda: any(rt.controller.track(r).first_token_s for r in rt.controller.on_instance("i0")),
        "i0 streams",
    )


async def serve_fcfs(e: Any, rec: Recorder, n: int, **fields: Any) -> AgentRuntime:
    """An FCFS runtime over the wrapped engine ``e`` (``e.inner``) given ``n`` requests at once
    (``fields``: theirs), run until every one is over, then stopped and the engine closed."""
    rt = start(create_policy("fcfs"), [e], rec)
    await rt.start()
    now = rt.clock.now()
    for i in range(n):
        rt.submit(make_request(i, arrival_s=now, **fields))
    await eventually(lambda: rt.idle, "every request is over")
    await rt.stop()
    await e.inner.close()
    return rt


def test_requests_run_to_the_end_on_live_engines_under_qlm() -> None:
    async def scenario() -> None:
        rec = Recorder()
        engines = [engine("i0"), engine("i1")]
        policy = create_policy(
            "qlm", profile=make_profile(), planner=PlannerConfig.for_simulation(500)
        )
        rt = start(policy, engines, rec)
        await rt.start()
        now = rt.clock.now()
        for i in range(24):
            rt.submit(make_request(i, arrival_s=now, replay_output_tokens=20 + i, slo=SLO(60.0)))
        await eventually(lambda: rt.idle, "every request finished")
        await rt.stop()
        for e in engines:
            await e.close()
        assert len(rec.done) == 24
        for i in range(24):
            record, text = rec.done[f"r{i:04d}"]
            assert record.status is RequestStatus.FINISHED
            assert record.output_tokens == 20 + i == count_tokens(text)
            assert record.first_token_s is not None and record.finish_s is not None
        assert rec.plans  # the planner ran on the wall clock, and its plans were handed over

    run(scenario)


class EvictOnce(PolicyBase):
    """Pulls everything onto i0 and evicts ``victim`` once it has started."""

    name = "evict-once"

    def __init__(self, victim: str) -> None:
        self.victim = victim
        self.done = False

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        out: list[Decision] = [Pull(r.id, "i0") for r in ctx.arrived]
        if not self.done and self.victim in ctx.started:
            self.done = True
            out.append(Evict(self.victim, "i0"))
        return out


def test_an_evicted_request_resumes_with_its_partial_output_and_the_right_token_count() -> None:
    async def scenario() -> None:
        rec = Recorder()
        e = engine("i0")
        rt = start(EvictOnce("r0000"), [e], rec)
        await rt.start()
        rt.submit(make_request(0, arrival_s=rt.clock.now(), replay_output_tokens=300))
        await eventually(lambda: rt.idle, "the evicted request finished")
        await rt.stop()
        await e.close()
        record, text = rec.done["r0000"]
        assert record.evictions == 1
        assert len(rec.back) == 1 and 0 < rec.back[0][1] < 300
        assert record.output_tokens == 300 == count_tokens(text)  # partial + the rest, once

    run(scenario)


class CountsOnDispatch(Recorder):
    """Takes the runtime's instance states each time a request is sent to its instance."""

    def __init__(self) -> None:
        super().__init__()
        self.runtime: AgentRuntime | None = None
        self.states: list[dict[str, int]] = []

    def dispatched(self, request_id: str, instance: str, at: float) -> None:
        super().dispatched(request_id, instance, at)
        assert self.runtime is not None
        [state] = self.runtime.instance_states()
        self.states.append(dict(state["tokens"]))


def test_an_instance_s_state_counts_a_running_request_s_tokens_before_and_since_its_eviction() -> (
    None
):
    """What ``qlm ops running`` shows: the store counts output only when a request ends or is
    evicted, the controller's snapshot as it streams."""

    async def scenario() -> None:
        rec = CountsOnDispatch()
        e = engine("i0")
        rt = rec.runtime = start(EvictOnce("r0000"), [e], rec)
        await rt.start()
        rt.submit(
            make_request(0, arrival_s=rt.clock.now(), replay_output_tokens=7000, max_tokens=7000)
        )
        await eventually(lambda: len(rec.states) == 2, "r0000 was evicted and sent again")
        before = rec.back[0][1]
        assert before > 0 and rec.states == [{"r0000": 0}, {"r0000": before}]

        def tokens() -> int:
            [state] = rt.instance_states()
            return int(state["tokens"].get("r0000", 0))

        await eventually(lambda: tokens() > before, "r0000 streams again")
        assert tokens() < 7000
        await rt.stop()
        await e.close()

    run(scenario)


class Seen:
    """An engine that keeps every request it was asked to run."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.requests: list[EngineRequest] = []

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    async def submit(self, request: EngineRequest, on_chunk: Any = None) -> EngineOutput:
        self.requests.append(request)
        return await self.inner.submit(request, on_chunk)


def test_an_evicted_chat_resumes_as_its_messages_and_the_partial_answer_to_continue() -> None:
    async def scenario() -> None:
        rec = Recorder()
        e = Seen(engine("i0"))
        rt = start(EvictOnce("r0000"), [e], rec)
        await rt.start()
        messages = [{"role": "user", "content": "Tell me a story"}]
        job = Job(prompt="<|im_start|>user ...", messages=messages, sampling={"seed": 7})
        rt.submit(make_request(0, arrival_s=rt.clock.now(), replay_output_tokens=300), job)
        await eventually(lambda: rt.idle, "the evicted chat finished")
        await rt.stop()
        await e.inner.close()
        first, resumed = e.requests
        assert first.messages == tuple(messages) and not first.continue_final_message
        partial = filler_text(rec.back[0][1])  # what it had generated when evicted
        assert resumed.messages == (*messages, {"role": "assistant", "content": partial})
        assert resumed.continue_final_message and resumed.sampling == (("seed", 7),)
        assert resumed.prompt == first.prompt + partial  # for an engine without a chat API
        assert rec.done["r0000"][1] == filler_text(300)  # one whole answer

    run(scenario)


class LlamaLike:
    """An engine whose model writes one fixed answer, ``"tok " * n`` (every token ends with a
    space), behind a chat template that trims messages, as Llama 3's does: resumed, it goes on
    from the trimmed partial answer and so writes the space the trim dropped, as a token of its
    own. Timing and token counts are ``inner``'s."""

    def __init__(self, inner: WallClockEngine, n: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.answer = "tok " * n
        self.requests: list[EngineRequest] = []
        self._pieces: dict[str, list[str]] = {}

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    def _text(self, request_id: str, tokens: int) -> str:
        return "".join(self._pieces[request_id][:tokens])

    async def submit(self, request: EngineRequest, on_chunk: Any = None) -> EngineOutput:
        self.requests.append(request)
        messages = request.messages or ()
        done = messages[-1]["content"].strip() if request.continue_final_message else ""
        assert self.answer.startswith(done)
        rest = self.answer[len(done) :]
        rid = request.request_id
        self._pieces[rid] = re.findall(r"\S+\s*|\s+", rest)
        sent = 0

        def mapped(chunk: TokenChunk) -> None:
            nonlocal sent
            text = self._text(rid, chunk.tokens)[len(self._text(rid, sent)) :]
            sent = chunk.tokens
            on_chunk(replace(chunk, text=text))

        out = await self.inner.submit(request, mapped if on_chunk is not None else None)
        return replace(out, text=self._text(rid, out.tokens))

    async def abort(self, request_id: str) -> EngineOutput:
        out = await self.inner.abort(request_id)
        return replace(out, text=self._text(request_id, out.tokens))


def test_a_chat_resumes_at_its_last_word_so_a_trimming_template_leaves_no_double_space() -> None:
    async def scenario() -> None:
        rec = Recorder()
        e = LlamaLike(engine("i0"), 300)
        rt = start(EvictOnce("r0000"), [e], rec)
        await rt.start()
        job = Job(prompt="...", messages=[{"role": "user", "content": "Count"}])
        rt.submit(make_request(0, arrival_s=rt.clock.now(), replay_output_tokens=300), job)
        await eventually(lambda: rt.idle, "the evicted chat finished")
        await rt.stop()
        await e.inner.close()
        _, resumed = e.requests
        partial = resumed.messages[-1]["content"] if resumed.messages else ""
        assert partial.startswith("tok") and partial == partial.rstrip()  # sent without it
        text = rec.done["r0000"][1]
        assert text.startswith(partial + " tok") and "  " not in text  # one space at the seam
        streamed = "".join(rec.streamed)
        assert text.startswith(streamed) and streamed == streamed.rstrip()  # never unsaid

    run(scenario)


class WithIds:
    """An engine that says its tokens' ids, as vLLM does with ``return_token_ids``: its model
    writes one fixed answer in which every third token is a space and every third decodes to
    nothing, so that no text resume could continue it exactly. A request sent with token ids
    as its prompt must carry the prompt's ids and the answer's so far, and goes on from there.
    Timing and token counts are ``inner``'s."""

    PROMPT = (1, 7, 42)

    def __init__(self, inner: WallClockEngine, n: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.ids = [100 + i for i in range(n)]
        self.pieces = [(f"w{i}", " ", "")[i % 3] for i in range(n)]
        self.requests: list[EngineRequest] = []
        self._done: dict[str, int] = {}

    @property
    def answer(self) -> str:
        return "".join(self.pieces)

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    async def submit(self, request: EngineRequest, on_chunk: Any = None) -> EngineOutput:
        self.requests.append(request)
        rid = request.request_id
        if isinstance(request.prompt, tuple):  # a resume by token ids
            done = len(request.prompt) - len(self.PROMPT)
            assert request.prompt == self.PROMPT + tuple(self.ids[:done])
        else:
            done = 0
        self._done[rid] = done
        sent = 0

        def mapped(chunk: TokenChunk) -> None:
            nonlocal sent
            new = slice(done + sent, done + chunk.tokens)
            on_chunk(
                replace(
                    chunk,
                    text="".join(self.pieces[new]),
                    token_ids=tuple(self.ids[new]),
                    prompt_token_ids=None if done or sent else self.PROMPT,
                )
            )
            sent = chunk.tokens

        out = await self.inner.submit(request, mapped if on_chunk is not None else None)
        return replace(out, text="".join(self.pieces[done : done + out.tokens]))

    async def abort(self, request_id: str) -> EngineOutput:
        out = await self.inner.abort(request_id)
        done = self._done[request_id]
        return replace(out, text="".join(self.pieces[done : done + out.tokens]))


def test_an_evicted_chat_resumes_from_its_token_ids_exactly() -> None:
    """vLLM says the tokens of the prompt (its chat template applied) and of each chunk: an
    evicted chat goes on from exactly those tokens, as a completion, without the chat's own
    parameters; nothing of its answer is dropped or written twice, spaces and tokens that
    decode to nothing included, and the stream shows every character once."""

    async def scenario() -> None:
        rec = Recorder()
        e = WithIds(engine("i0"), 300)
        rt = start(EvictOnce("r0000"), [e], rec)
        await rt.start()
        job = Job(
            prompt="...",
            messages=[{"role": "user", "content": "Count"}],
            sampling={"seed": 7, "logprobs": True, "max_completion_tokens": 300},
        )
        rt.submit(make_request(0, arrival_s=rt.clock.now(), replay_output_tokens=300), job)
        await eventually(lambda: rt.idle, "the evicted chat finished")
        await rt.stop()
        await e.inner.close()
        first, resumed = e.requests
        done = rec.back[0][1]
        assert 0 < done < 300 and first.messages is not None
        assert resumed.prompt == WithIds.PROMPT + tuple(e.ids[:done])
        assert resumed.messages is None and not resumed.continue_final_message
        assert resumed.sampling == (("seed", 7),) and resumed.output_tokens == 300 - done
        record, text = rec.done["r0000"]
        assert text == e.answer and record.output_tokens == 300
        assert "".join(rec.streamed) == e.answer.rstrip()  # (the last space: never followed)

    run(scenario)


class SeesSwapSpace(PolicyBase):
    """FCFS onto i0, keeping the CPU swap space each step saw there."""

    name = "sees-swap-space"

    def __init__(self) -> None:
        self.seen: list[float] = []

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        self.seen += [i.swap_free_gb for i in ctx.instances if i.up]
        return [Pull(r.id, "i0") for r in ctx.arrived]


def test_the_engines_swap_space_reaches_the_policy_so_it_may_swap() -> None:
    """KV swap is offered to the planner where the engine can park KV caches: the CPU memory it
    has left for them, as its stats say (the simulated engine's swap space; vLLM's KV
    offloading size)."""

    async def scenario() -> None:
        policy = SeesSwapSpace()
        e = engine("i0")
        rt = start(policy, [e], Recorder())
        await rt.start()
        rt.submit(make_request(0, arrival_s=rt.clock.now()))
        await eventually(lambda: rt.idle, "the request finished")
        await rt.stop()
        await e.close()
        space = e.sim.config.swap_space_gb
        assert space > 0 and policy.seen and max(policy.seen) == pytest.approx(space)

    run(scenario)


def test_a_failed_engine_loses_nothing_and_rejoins_when_healthy() -> None:
    async def scenario() -> None:
        rec = Recorder()
        flaky, other = Flaky(engine("i0")), engine("i1")
        rt = start(create_policy("fcfs-rr"), [flaky, other], rec)
        await streaming_on_i0(rt)
        flaky.break_()
        await eventually(lambda: ("i0", False) in rec.changes, "i0 is marked down")
        flaky.broken = False
        await eventually(lambda: ("i0", True) in rec.changes[1:], "i0 rejoins")
        await eventually(lambda: rt.idle, "every request finished")
        await rt.stop()
        await flaky.inner.close()
        await other.close()
        records = {rid: r for rid, (r, _) in rec.done.items()}
        assert len(records) == 12
        moved = [r for r in records.values() if r.failovers]
        assert moved
        for rid, (record, text) in rec.done.items():
            assert record.output_tokens == 400 == count_tokens(text), rid

    run(scenario)


def test_cancel_forgets_a_waiting_request_and_aborts_a_running_one() -> None:
    async def scenario() -> None:
        rec = Recorder()
        e = engine("i0")
        rt = start(create_policy("edf"), [e], rec, max_running={"i0": 1})
        await rt.start()
        now = rt.clock.now()
        for i in range(3):
            rt.submit(make_request(i, arrival_s=now + i * 1e-3, replay_output_tokens=200))
        await eventually(lambda: rt.controller.track("r0000").first_token_s is not None, "r0 runs")
        assert await rt.cancel("r0002")  # still waiting
        assert await rt.cancel("r0000")  # running
        assert not await rt.cancel("r0002")  # already over
        await eventually(lambda: rt.idle, "r1 finished")
        await rt.stop()
        await e.close()
        assert set(rec.done) == {"r0001"}
        assert rec.dropped["r0002"] == 0 and 0 < rec.dropped["r0000"] < 200
        assert rt.controller.track("r0000").status is RequestStatus.CANCELLED
        assert rt.controller.outstanding("i0") == 0

    run(scenario)


def test_an_engine_that_never_answers_starts_down_and_gets_nothing() -> None:
    async def scenario() -> None:
        rec = Recorder()
        dead, live = Flaky(engine("i0")), engine("i1")
        dead.broken = True
        rt = start(create_policy("fcfs"), [dead, live], rec)
        await rt.start()
        assert rt.instances_up() == {"i0": False, "i1": True}
        rt.submit(make_request(0, arrival_s=rt.clock.now()), Job(sampling={"temperature": 0}))
        await eventually(lambda: rt.idle, "the request finished")
        await rt.stop()
        await dead.inner.close()
        await live.close()
        assert rec.sent == [("r0000", "i1")]

    run(scenario)


@pytest.mark.parametrize(
    ("over_http", "why"),
    [
        (False, "needs 9200 tokens, more than m's max context 8192"),
        (True, "400: max_tokens=9000 cannot be greater than max_model_len=8192. Please "
               "request fewer output tokens."),
    ],
    ids=["in-process", "vllm-api"],
)  # fmt: skip
def test_a_request_the_engine_rejects_fails_alone_and_the_instance_stays_up(
    over_http: bool, why: str
) -> None:
    """Longer than the model's context: the engine refuses it, in process or as vLLM's API does
    (400, through ``VllmEngine`` to the simulated server). The request fails with that message;
    the instance is not marked down and serves the next one."""

    async def scenario() -> None:
        rec = Recorder()
        e: Engine
        server: WallClockEngine
        if over_http:
            e, server = simulated_vllm("i0")
        else:
            e = server = engine("i0")
        rt = start(create_policy("qlm", profile=make_profile()), [e], rec)
        await rt.start()
        now = rt.clock.now()
        rt.submit(make_request(0, arrival_s=now, max_tokens=9000, replay_output_tokens=9000))
        rt.submit(make_request(1, arrival_s=now, replay_output_tokens=30))
        await eventually(lambda: rt.idle, "both are over")
        await rt.stop()
        await e.close()
        if over_http:
            await server.close()
        assert why in rec.errors["r0000"]
        assert set(rec.done) == {"r0001"}
        assert rt.instances_up() == {"i0": True} and ("i0", False) not in rec.changes
        assert rt.controller.track("r0000").status is RequestStatus.FAILED
        assert rt.controller.outstanding("i0") == 0

    run(scenario)


class Poisoned:
    """An engine that answers its health check but fails every stream of one request (as a
    vLLM server answers 500 for one request, or a proxy cuts one connection), after a few
    tokens of it."""

    def __init__(self, inner: WallClockEngine, poison: str) -> None:
        self.inner = inner
        self.name = inner.name
        self.poison = poison
        self.tries = 0

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    async def submit(self, request: EngineRequest, on_chunk: Any = None) -> EngineOutput:
        if request.request_id != self.poison:
            return await self.inner.submit(request, on_chunk)
        self.tries += 1
        if on_chunk is not None:
            on_chunk(TokenChunk(request.request_id, "tok", 1))
        raise EngineError(f"{self.name}: 500 Internal Server Error")


def test_a_request_whose_streams_keep_failing_fails_alone_and_the_instance_stays_up() -> None:
    async def scenario() -> None:
        rec = Recorder()
        e = Poisoned(engine("i0"), poison="r0003")
        rt = await serve_fcfs(e, rec, 8, replay_output_tokens=40, max_tokens=60)
        assert e.tries == MAX_STREAM_FAILURES  # tried again, then given up
        assert "500 Internal Server Error" in rec.errors["r0003"]
        assert rt.controller.track("r0003").status is RequestStatus.FAILED
        assert set(rec.done) == {f"r{i:04d}" for i in range(8)} - {"r0003"}
        assert ("i0", False) not in rec.changes  # the instance never went down
        assert rt.controller.outstanding("i0") == 0

    run(scenario)


# --- regressions found in review ------------------------------------------------------------


class SlowAbort:
    """An engine whose abort reaches it only after the request finished: the abort answers with
    the final output (as vLLM's and the simulated engine's do)."""

    def __init__(self, inner: WallClockEngine) -> None:
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    async def abort(self, request_id: str) -> EngineOutput:
        return await self.inner.outcome(request_id)


def test_an_eviction_that_arrives_after_the_end_finishes_the_request_once() -> None:
    async def scenario() -> None:
        rec = Recorder()
        e = engine("i0")
        rt = start(EvictOnce("r0000"), [SlowAbort(e)], rec)
        await rt.start()
        rt.submit(
            make_request(0, arrival_s=rt.clock.now(), replay_output_tokens=100, max_tokens=100)
        )
        await eventually(lambda: rt.idle, "the request is over")
        await rt.stop()
        await e.close()
        record, text = rec.done["r0000"]
        assert record.output_tokens == 100 == count_tokens(text)
        assert not rec.back and record.evictions == 0

    run(scenario)


def test_a_cancel_during_an_eviction_ends_the_request_once() -> None:
    async def scenario() -> None:
        rec = Recorder()
        e = engine("i0")
        rt = start(EvictOnce("r0000"), [SlowAbort(e)], rec)
        await rt.start()
        rt.submit(
            make_request(0, arrival_s=rt.clock.now(), replay_output_tokens=300, max_tokens=300)
        )
        await eventually(lambda: rt.evictions == 1, "the eviction is under way")
        assert await rt.cancel("r0000")  # its abort, too, is answered once the request ended
        await eventually(lambda: rt.idle and not rt.operations, "every operation is over")
        await rt.stop()
        await e.close()
        # It ended once, cancelled (the eviction leaves it to the cancel under way), with the
        # output the abort answered: here all of it, as it had ended meanwhile.
        assert rec.cancels == [("r0000", 300)] and not rec.done and not rec.back
        assert rt.controller.outstanding("i0") == 0

    run(scenario)


class GatedAbort:
    """An engine whose first abort (an eviction's) is answered only once ``gate`` is set, and
    then as if the request had ended before the abort reached it."""

    def __init__(self, inner: WallClockEngine) -> None:
        self.inner = inner
        self.name = inner.name
        self.gate = asyncio.Event()
        self.calls = 0

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    async def abort(self, request_id: str) -> EngineOutput:
        self.calls += 1
        if self.calls > 1:
            return await self.inner.abort(request_id)
        await self.gate.wait()
        return EngineOutput(request_id, " old attempt", 2, "stop")


def test_a_release_during_an_eviction_wins_over_the_evictions_late_answer() -> None:
    """The controller lost the lead while evicting a request, released it, led again and got
    it delivered again: the eviction's late answer must not end the new attempt."""

    async def scenario() -> None:
        rec = Recorder()
        e = engine("i0")
        gated = GatedAbort(e)
        rt = start(EvictOnce("r0000"), [gated], rec)
        await rt.start()
        request = make_request(
            0, arrival_s=rt.clock.now(), replay_output_tokens=3000, max_tokens=3000
        )
        rt.submit(request)
        await eventually(lambda: gated.calls == 1, "the eviction is aborting it")
        try:
            assert await rt.release(["r0000"]) == 1
            assert not rt.holds("r0000") and not rt.running("r0000")
            assert rt.submit(request)  # led again: delivered again
        finally:
            gated.gate.set()  # the eviction's abort answers now, late
        await eventually(lambda: rt.idle and not rt.operations, "the new attempt finished")
        await rt.stop()
        await e.close()
        record, text = rec.done["r0000"]
        assert record.output_tokens == 3000 == count_tokens(text) and "old" not in text
        assert not rec.back and not rec.cancels and rt.controller.outstanding("i0") == 0

    run(scenario)


def test_outstanding_counts_return_to_zero_when_everything_finished() -> None:
    async def scenario() -> None:
        rec = Recorder()
        e = engine("i0")
        rt = start(create_policy("fcfs"), [e], rec)
        await rt.start()
        for i in range(12):
            rt.submit(make_request(i, arrival_s=rt.clock.now(), replay_output_tokens=30 + i))
        await eventually(lambda: rt.idle, "all finished")
        await rt.stop()
        await e.close()
        assert rt.controller.outstanding("i0") == 0
        assert rt.controller.outstanding_tokens("i0") == 0  # no drift: KV room stays honest

    run(scenario)


class FailsOnce(PolicyBase):
    """A policy whose first step raises (a solver bug, say) after it has seen its input."""

    name = "fails-once"

    def __init__(self) -> None:
        self.inner = create_policy("fcfs")
        self.failed = False

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        if ctx.arrived and not self.failed:
            self.failed = True
            raise ValueError("transient planner failure")
        return self.inner.decide(ctx)


def test_a_step_that_fails_loses_nothing_and_the_loop_goes_on() -> None:
    async def scenario() -> None:
        rec = Recorder()
        e = engine("i0")
        rt = start(FailsOnce(), [e], rec)
        await rt.start()
        for i in range(3):
            rt.submit(make_request(i, arrival_s=rt.clock.now()))
        await eventually(lambda: rt.idle, "all finished after the failed step")
        await rt.stop()
        await e.close()
        assert set(rec.done) == {"r0000", "r0001", "r0002"}
        # every step, the failed one too, ends what it started (a held queue intake is let go)
        assert rec.marks and rec.marks == ["stepping", "stepped"] * (len(rec.marks) // 2)

    run(scenario)


def test_work_for_a_model_no_live_instance_serves_waits_without_stopping_the_rest() -> None:
    async def scenario() -> None:
        rec = Recorder()
        live = engine("i0")
        dead = Flaky(
            WallClockEngine.from_catalog(
                "i1", "n", "G", 1, time_scale=SCALE, catalog=make_catalog()
            )
        )
        dead.broken = True
        specs = [InstanceSpec("i0", "G", ("m",)), InstanceSpec("i1", "G", ("n",))]
        policy = create_policy(
            "qlm", profile=make_profile(), planner=PlannerConfig.for_simulation(500)
        )
        rt = AgentRuntime(
            Controller(policy, specs),
            [live, dead],
            clock=WallClock(SCALE),
            listener=rec,
            tick_s=0.02,
            health_interval_s=0.02,
        )
        await rt.start()
        now = rt.clock.now()
        rt.submit(make_request(0, arrival_s=now, model="n"))
        for i in range(1, 6):
            rt.submit(make_request(i, arrival_s=now))
        await eventually(lambda: len(rec.done) == 5, "the m requests finished")
        dead.broken = False  # i1 comes up: its request is planned and served
        await eventually(lambda: rt.idle, "the n request finished too")
        await rt.stop()
        await live.close()
        await dead.inner.close()
        assert "r0000" in rec.done

    run(scenario)


class DelayedAbort(SlowAbort):
    """An abort that takes a round trip, as over HTTP."""

    async def abort(self, request_id: str) -> EngineOutput:
        await asyncio.sleep(0.01)
        return await self.inner.abort(request_id)


def test_two_cancels_of_one_request_report_it_once_with_its_partial_output() -> None:
    async def scenario() -> None:
        rec = Recorder()
        e = engine("i0")
        rt = start(create_policy("fcfs"), [DelayedAbort(e)], rec)
        await rt.start()
        rt.submit(
            make_request(0, arrival_s=rt.clock.now(), replay_output_tokens=3000, max_tokens=4000)
        )
        await eventually(lambda: rt.controller.track("r0000").first_token_s is not None, "it runs")
        await asyncio.sleep(0.02)
        first, second = await asyncio.gather(rt.cancel("r0000"), rt.cancel("r0000"))
        await rt.stop()
        await e.close()
        assert sorted([first, second]) == [False, True]
        assert len(rec.cancels) == 1 and rec.cancels[0][1] > 0  # once, with its partial output

    run(scenario)


class Preempting:
    """An engine whose counter says it has preempted ``count`` requests of its own (vLLM's
    ``vllm:num_preemptions_total``)."""

    def __init__(self, inner: WallClockEngine, count: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.count = count

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    async def stats(self) -> Any:
        return replace(await self.inner.stats(), preemptions_total=self.count)


class Watching(PolicyBase):
    """FCFS that records the preemption counters it is shown."""

    name = "watching"

    def __init__(self) -> None:
        self.inner = create_policy("fcfs")
        self.seen: list[int | None] = []

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        self.seen.extend(i.preemptions_total for i in ctx.instances)
        return self.inner.decide(ctx)


def test_the_engines_preemption_counter_reaches_the_policy_and_follows_the_engine() -> None:
    async def scenario() -> None:
        rec = Recorder()
        e = Preempting(engine("i0"), 3)
        policy = Watching()
        rt = start(policy, [e], rec)
        await rt.start()
        await eventually(lambda: 3 in policy.seen, "the counter read at attach reached a step")
        e.count = 11  # the engine preempted more since: the next health check reads it
        await eventually(lambda: 11 in policy.seen, "the new count reached a step")
        await rt.stop()
        await e.inner.close()
        assert None not in policy.seen[policy.seen.index(3) :]

    run(scenario)


class Loads(PolicyBase):
    """FCFS that keeps every instance load it is shown."""

    name = "loads"

    def __init__(self) -> None:
        self.inner = create_policy("fcfs")
        self.seen: list[Any] = []

    def decide(self, ctx: DispatchContext) -> list[Decision]:
        self.seen.extend(ctx.instances)
        return self.inner.decide(ctx)


def test_an_instance_unchanged_between_steps_reaches_the_policy_as_the_same_load() -> None:
    """The controller keeps what it built of a reading while the reading is the same object:
    the runtime hands it the same one while nothing in it changed, and a new one when
    something did."""

    async def scenario() -> None:
        e = Preempting(engine("i0"), 3)
        policy = Loads()
        rt = start(policy, [e], Recorder())
        await rt.start()
        await eventually(
            lambda: sum(s.preemptions_total == 3 for s in policy.seen) >= 5, "steps after attach"
        )
        e.count = 11
        await eventually(lambda: policy.seen[-1].preemptions_total == 11, "the new count")
        await rt.stop()
        await e.inner.close()
        read = [s for s in policy.seen if s.preemptions_total == 3]
        assert all(s is read[0] for s in read)
        assert policy.seen[-1] is not read[0]

    run(scenario)


# --- prompt lengths as the engine counts them --------------------------------------------------


def test_the_controller_learns_how_the_engine_counts_prompts_and_scales_new_arrivals() -> None:
    """The API estimates a prompt's tokens without a tokenizer; vLLM says how many it counted.
    Prompts of 100 words (the simulated server counts words) estimated at 50 tokens teach a
    ratio toward 2, and a request that arrives afterwards is planned with its estimate scaled;
    replays (filler token ids, counted exactly) and resumed output teach nothing."""

    async def scenario() -> None:
        rec = Recorder()
        e, server = simulated_vllm("i0")
        rt = start(create_policy("fcfs"), [e], rec)
        await rt.start()
        now = rt.clock.now()
        assert rt.controller.prompt_scale("m") == 1.0
        for i in range(4):  # replays: the engine's count is the estimate itself
            rt.submit(make_request(i, arrival_s=now, input_tokens=50, replay_output_tokens=5))
        await eventually(lambda: len(rec.done) == 4, "the replays finished")
        assert rt.controller.prompt_scale("m") == 1.0
        text = " ".join(["word"] * 100)
        for i in range(4, 44):
            request = make_request(i, arrival_s=now, input_tokens=50, replay_output_tokens=5)
            rt.submit(request, Job(prompt=text))
        await eventually(lambda: len(rec.done) == 44, "the prompts finished")
        scale = rt.controller.prompt_scale("m")
        # 40 prompts, forgetting 1 % each, against 2,000 tokens of "the estimate is right"
        weight = sum(0.99**k for k in range(40))
        assert scale == pytest.approx((100 * weight + 2000) / (50 * weight + 2000), rel=1e-9)
        late = make_request(99, arrival_s=rt.clock.now(), input_tokens=50, replay_output_tokens=5)
        rt.submit(late, Job(prompt=text))
        assert rt.controller.track("r0099").request.input_tokens == round(50 * scale)
        replay = make_request(98, arrival_s=rt.clock.now(), input_tokens=50, replay_output_tokens=5)
        rt.submit(replay)  # filler token ids: counted exactly, never scaled
        assert rt.controller.track("r0098").request.input_tokens == 50
        await eventually(lambda: len(rec.done) == 46, "the late ones finished")
        # Sent with its scaled estimate, it taught against the API's own: no drift.
        weight = sum(0.99**k for k in range(41))
        assert rt.controller.prompt_scale("m") == pytest.approx(
            (100 * weight + 2000) / (50 * weight + 2000), rel=1e-9
        )
        await rt.stop()
        await e.close()
        await server.close()

    run(scenario)


def test_a_resumed_prompt_teaches_only_its_input_part() -> None:
    controller = Controller(create_policy("fcfs"), [InstanceSpec("i0", "G", ("m",))])
    controller.arrive(make_request(1, input_tokens=50), generated=30, estimated_prompt=True)
    assert controller.engine_request("r0001").resumed_tokens == 30
    controller.observe_prompt("r0001", 80, 130)  # sent: input 50 + 30 resumed; counted 100 + 30
    counted, estimated = 100 + 2000.0, 50 + 2000.0
    assert controller.prompt_scale("m") == pytest.approx(counted / estimated)
    controller.observe_prompt("unknown", 10, 1000)  # nothing it holds: ignored
    assert controller.prompt_scale("m") == pytest.approx(counted / estimated)


class Blank(Seen):
    """An engine whose model writes only spaces (timing and counts are ``inner``'s); it keeps
    every request it was asked to run."""

    async def submit(self, request: EngineRequest, on_chunk: Any = None) -> EngineOutput:
        self.requests.append(request)

        def blank(chunk: TokenChunk) -> None:
            on_chunk(replace(chunk, text=" " * count_tokens(chunk.text)))

        out = await self.inner.submit(request, blank if on_chunk is not None else None)
        return replace(out, text=" " * out.tokens)

    async def abort(self, request_id: str) -> EngineOutput:
        out = await self.inner.abort(request_id)
        return replace(out, text=" " * out.tokens)


def test_a_request_evicted_with_only_whitespace_written_starts_over_with_its_whole_budget() -> None:
    """Resuming drops trailing whitespace (``resume_point``): with nothing else written there
    is nothing to continue, so the request runs again from its first token."""

    async def scenario() -> None:
        rec = Recorder()
        e = Blank(engine("i0"))
        rt = start(EvictOnce("r0000"), [e], rec)
        await rt.start()
        rt.submit(make_request(0, arrival_s=rt.clock.now(), replay_output_tokens=300))
        await eventually(lambda: rt.idle, "the evicted request finished")
        await rt.stop()
        await e.inner.close()
        first, again = e.requests
        assert rec.back == [("r0000", 0)]  # back with nothing kept
        assert (again.max_tokens, again.prompt_tokens, again.resumed_tokens) == (
            first.max_tokens,
            first.prompt_tokens,
            0,
        )
        record, text = rec.done["r0000"]
        assert record.output_tokens == 300 and text == " " * 300

    run(scenario)


# --- slow is not dead -------------------------------------------------------------------------


class Starved:
    """An engine on a CPU-starved host: its next ``silent`` health checks time out, and the next
    ``connect_timeouts`` streams never reach it (their connect timed out); then it answers.
    ``hush`` silences it for good, as a host gone quiet: every check times out and its streams
    hang without another chunk."""

    def __init__(self, inner: WallClockEngine) -> None:
        self.inner = inner
        self.name = inner.name
        self.silent = 0
        self.unanswered = 0  # health checks that timed out, in all
        self.answered = 0  # health checks answered, in all
        self.connect_timeouts = 0
        self.unreached = 0  # streams that never reached it, in all
        self.hushed = asyncio.Event()

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    def hush(self) -> None:
        self.silent = 1 << 30
        self.hushed.set()

    async def health(self) -> bool:
        if self.silent > 0:
            self.silent -= 1
            self.unanswered += 1
            raise EngineTimeout(f"{self.name}: GET /health failed: ReadTimeout('')")
        self.answered += 1
        return await self.inner.health()

    async def submit(self, request: EngineRequest, on_chunk: Any = None) -> EngineOutput:
        if self.connect_timeouts > 0:
            self.connect_timeouts -= 1
            self.unreached += 1
            raise EngineTimeout(
                f"{self.name}: POST /v1/completions failed: ConnectTimeout('')", reached=False
            )

        def passed_on(chunk: TokenChunk) -> None:
            if on_chunk is not None and not self.hushed.is_set():
                on_chunk(chunk)

        run = asyncio.ensure_future(self.inner.submit(request, passed_on))
        quiet = asyncio.ensure_future(self.hushed.wait())
        try:
            await asyncio.wait({run, quiet}, return_when=asyncio.FIRST_COMPLETED)
            if not self.hushed.is_set():
                return run.result()
            await asyncio.Event().wait()  # the stream hangs (streams have no read timeout)
            raise AssertionError("unreachable")
        finally:
            run.cancel()
            quiet.cancel()


def test_an_instance_that_leaves_health_checks_unanswered_fewer_times_than_the_limit_stays_up() -> (
    None
):
    async def scenario() -> None:
        rec = Recorder()
        e = Starved(engine("i0"))
        e.silent = DOWN_AFTER_HEALTH_TIMEOUTS - 1
        rt = start(create_policy("fcfs"), [e], rec)
        await rt.start()
        now = rt.clock.now()
        for i in range(6):
            rt.submit(make_request(i, arrival_s=now, replay_output_tokens=200, max_tokens=300))
        await eventually(lambda: e.answered >= 2, "the instance answers its health check again")
        await eventually(lambda: rt.idle, "every request finished")
        await rt.stop()
        await e.inner.close()
        assert e.unanswered == DOWN_AFTER_HEALTH_TIMEOUTS - 1
        assert ("i0", False) not in rec.changes and rt.instances_up() == {"i0": True}
        assert len(rec.done) == 6 and not rec.errors
        assert not any(record.failovers for record, _ in rec.done.values())

    run(scenario)


class DownWatch(Recorder):
    """Notes how many health checks ``engine`` had left unanswered when it was marked down."""

    def __init__(self, engine: Starved) -> None:
        super().__init__()
        self.engine = engine
        self.unanswered_at_down: int | None = None

    def instance_changed(self, name: str, up: bool) -> None:
        super().instance_changed(name, up)
        if name == self.engine.name and not up:
            self.unanswered_at_down = self.engine.unanswered


@pytest.mark.parametrize("limit", [DOWN_AFTER_HEALTH_TIMEOUTS, 5])
def test_an_instance_silent_for_a_run_of_health_checks_is_down_and_its_requests_move(
    limit: int,
) -> None:
    async def scenario() -> None:
        silent = Starved(engine("i0"))
        rec = DownWatch(silent)
        other = engine("i1")
        rt = start(create_policy("fcfs-rr"), [silent, other], rec, down_after_health_timeouts=limit)
        await streaming_on_i0(rt)
        silent.hush()  # its host stops answering
        await eventually(lambda: ("i0", False) in rec.changes, "i0 is marked down")
        await eventually(lambda: rt.idle, "every request finished")
        await rt.stop()
        await silent.inner.close()
        await other.close()
        assert rec.unanswered_at_down == limit  # not one check sooner
        assert len(rec.done) == 12 and not rec.errors
        assert any(record.failovers for record, _ in rec.done.values())
        for rid, (record, text) in rec.done.items():
            assert record.output_tokens == 400 == count_tokens(text), rid

    run(scenario)


def test_an_instance_that_refuses_its_health_check_is_down_at_once_whatever_the_timeout_limit() -> (
    None
):
    async def scenario() -> None:
        rec = Recorder()
        flaky, other = Flaky(engine("i0")), engine("i1")
        rt = start(
            create_policy("fcfs-rr"), [flaky, other], rec, down_after_health_timeouts=1 << 30
        )
        await rt.start()
        now = rt.clock.now()
        for i in range(8):
            rt.submit(make_request(i, arrival_s=now, replay_output_tokens=400, max_tokens=500))
        await eventually(
            lambda: any(
                rt.controller.track(r).first_token_s for r in rt.controller.on_instance("i0")
            ),
            "i0 streams",
        )
        flaky.break_()  # its process died: connections are refused
        await eventually(lambda: ("i0", False) in rec.changes, "i0 is marked down")
        await eventually(lambda: rt.idle, "every request finished")
        await rt.stop()
        await flaky.inner.close()
        await other.close()
        assert len(rec.done) == 8 and not rec.errors

    run(scenario)


def test_streams_whose_connect_timed_out_go_back_uncounted_and_the_instance_stays_up() -> None:
    """A burst on a starved host: more connects time out than a request may fail streams
    (``MAX_STREAM_FAILURES``), and its health check times out too. Nothing reached the engine,
    so nothing counts against the requests: each goes back, runs once the host answers, and
    the instance is never marked down."""

    async def scenario() -> None:
        rec = Recorder()
        e = Starved(engine("i0"))
        e.connect_timeouts = 4 * MAX_STREAM_FAILURES
        e.silent = 1
        await serve_fcfs(e, rec, 2, replay_output_tokens=40, max_tokens=60)
        assert e.unreached == 4 * MAX_STREAM_FAILURES
        assert set(rec.done) == {"r0000", "r0001"} and not rec.errors
        assert ("i0", False) not in rec.changes

    run(scenario)


class BrokenStreamSlowHealth(Poisoned):
    """A stream breaks (reset) while the instance's health check times out: slow, not dead."""

    def __init__(self, inner: WallClockEngine, poison: str) -> None:
        super().__init__(inner, poison)
        self.silent = True

    async def submit(self, request: EngineRequest, on_chunk: Any = None) -> EngineOutput:
        if request.request_id == self.poison and self.tries:
            return await self.inner.submit(request, on_chunk)  # (broken once)
        return await super().submit(request, on_chunk)

    async def health(self) -> bool:
        if self.silent:
            self.silent = False
            raise EngineTimeout(f"{self.name}: GET /health failed: ReadTimeout('')")
        return bool(await self.inner.health())


def test_a_broken_stream_on_an_instance_slow_to_answer_its_health_goes_back_alone() -> None:
    async def scenario() -> None:
        rec = Recorder()
        e = BrokenStreamSlowHealth(engine("i0"), poison="r0001")
        rt = await serve_fcfs(e, rec, 4, replay_output_tokens=40, max_tokens=60)
        assert e.tries == 1 and not e.silent
        assert len(rec.done) == 4 and not rec.errors
        assert ("i0", False) not in rec.changes
        assert rt.controller.track("r0001").failovers == 1

    run(scenario)


class Stalling(Starved):
    """Its health check holds the controller's event loop (as a long control step does) and then
    times out: the answer may have waited, unread, on the controller's side."""

    async def health(self) -> bool:
        if self.silent > 0:
            time.sleep(0.2)
        return await super().health()


def test_a_health_check_that_timed_out_late_because_the_loop_was_held_is_not_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runtime, "HEALTH_TIMEOUT_S", 0.01)
    monkeypatch.setattr(runtime, "LATE_S", 0.05)

    async def scenario() -> None:
        rec = Recorder()
        e = Stalling(engine("i0"))
        e.silent = 2 * DOWN_AFTER_HEALTH_TIMEOUTS
        rt = start(create_policy("fcfs"), [e], rec)
        await rt.start()
        rt.submit(make_request(0, arrival_s=rt.clock.now(), replay_output_tokens=40))
        await eventually(lambda: e.answered >= 1, "the instance answers its health check again")
        await eventually(lambda: rt.idle, "the request finished")
        await rt.stop()
        await e.inner.close()
        assert e.unanswered == 2 * DOWN_AFTER_HEALTH_TIMEOUTS
        assert ("i0", False) not in rec.changes
        assert set(rec.done) == {"r0000"}

    run(scenario)
