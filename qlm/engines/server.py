"""A vLLM-compatible HTTP server backed by the simulated engine (``qlm sim-engine serve``).

It answers the part of ``vllm serve``'s API that QLM uses as vLLM 0.32 answers it
(``qlm.engines.vllm.VLLM_VERSION``), with the same paths, fields and formats (docs/engines.md
lists them and the deviations), so that ``VllmEngine`` is tested end to end without a GPU:
``POST /v1/completions`` and ``POST /v1/chat/completions`` (plain and SSE streaming, token ids
with ``return_token_ids``), ``POST /tokenize``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (vLLM's metric names) and, with ``dev_mode`` (vLLM:
``VLLM_SERVER_DEV_MODE=1``), ``GET /server_info``, ``POST /abort_requests``, ``POST /sleep``,
``POST /wake_up``, ``GET /is_sleeping``.

Like ``vllm serve`` before generating, it refuses ``max_tokens`` above the model's context and a
prompt longer than the context (400 in vLLM's words, ``_output_budget``), and lowers
``max_tokens`` to the room the prompt leaves. Under ``--scheduling-policy fcfs`` (vLLM's
default) it refuses a ``priority`` other than 0, as vLLM documents (``PRIORITY_REFUSED``); under
``priority`` it accepts it, but the simulated scheduler stays FCFS (docs/simulator.md).

Output length: with ``ignore_eos`` the request generates exactly ``max_tokens`` tokens. Without
it, the "end of sequence" comes after a length drawn from ``eos_lengths`` (``qlm sim-engine serve``
loads them; by default the shipped ShareGPT output lengths), deterministically from the request
id, capped at ``max_tokens``.

With a ``response_format`` of ``json_object`` or ``json_schema`` the answer is a JSON document
of the schema, which ends the output when complete (the engine writes it:
``qlm.structured``).

Both endpoints run the same generation (``generate``) and stream the same chunks, worded per
endpoint (``AnswerFormat``; the request bodies and the answers' wording are in
``qlm.engines.server_wire``). Tokens are the simulated engine's (``qlm.engines.wallclock``): a
text is one token per whitespace-separated word, each word's id drawn from the word
(``wallclock.tokenize``), and ``/tokenize`` answers the same ids. A chat has no chat template
here: its prompt is its messages' text joined by spaces (``ChatBody.rendered``), tokenized as a
prompt is; the template's own tokens are not counted. So a resumed chat (the partial answer as
its last message) is longer by exactly the tokens generated, as a resumed prompt is, and a
prompt of an earlier request's ``prompt_token_ids`` + the ``token_ids`` it generated counts as
exactly those tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from pydantic import ValidationError

from qlm.engines.base import EngineOutput, EngineRequest, TokenChunk
from qlm.engines.perf_model import HardwareCatalog
from qlm.engines.server_wire import (
    COMPLETION,
    AnswerFormat,
    ChatBody,
    CompletionBody,
    GenerationBody,
    StreamOptions,
    TokenizeBody,
    chat_format,
)
from qlm.engines.vllm_launch import SERVER_KEEPALIVE_S
from qlm.engines.wallclock import (
    LATENCY_BUCKETS,
    VOCAB_SIZE,
    WallClockEngine,
    count_tokens,
    tokenize,
)
from qlm.errors import EngineError, UnknownRequest, check_setting

DISCONNECT_POLL_S = 0.25

SchedulingPolicy = Literal["fcfs", "priority"]
"""vLLM's ``--scheduling-policy`` (``SchedulerPolicy`` in ``vllm/config/scheduler.py``)."""
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")

PRIORITY_REFUSED = "Got priority {priority} but Priority scheduling is not enabled."
"""vLLM's refusal of ``priority`` != 0 by a server without priority scheduling, word for word:
the contract its API documents ("Any priority other than 0 will raise an error if the served model
does not use priority scheduling"), as its V0 engine enforced it (``add_request``). vLLM 0.14's V1
engine does not check: it ignores the priority (vllm-project/vllm#22997). Refusing here keeps the
client's fallback (send again without priority) tested end to end."""


BOS_TEXT = "<s>"
"""The text of ``wallclock.BOS_ID``, the one token of an empty text."""


def _error(
    status: int, message: str, kind: str = "BadRequestError", param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}},
        status_code=status,
    )


class _Refused(Exception):
    """A request vLLM refuses before generating (400), in its words, and the parameter."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def _validation(message: str, param: str, value: object) -> _Refused:
    """vLLM's ``VLLMValidationError``: its message ends naming the parameter and its value."""
    return _Refused(f"{message} (parameter={param}, value={value})", param)


def _output_budget(
    max_model_len: int, prompt_tokens: int, *, tokenized: bool, limit: int | None, param: str
) -> int:
    """The tokens a generation may write, as vLLM 0.32 decides before generating, or
    ``_Refused`` in its words: ``max_tokens`` (``param``: the chat's name of it) above the
    context (``TokenizeParams``), a prompt longer than the context (``_token_len_check``; a text
    is tokenized up to one token past the context, so its count stops there, "at least"), then
    ``limit`` lowered to the room the prompt leaves (``get_max_tokens``; None: all of it), which
    must be at least 1 (``SamplingParams``)."""
    if limit is not None and limit > max_model_len:
        raise _validation(
            f"{param}={limit} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param,
            limit,
        )
    if prompt_tokens > max_model_len:
        count = min(prompt_tokens, max_model_len + 1) if tokenized else prompt_tokens
        at_least = "at least " if count == max_model_len + 1 else ""
        raise _validation(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {at_least}{count} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            count,
        )
    room = max_model_len - prompt_tokens
    budget = room if limit is None else min(room, limit)
    if budget < 1:
        raise _validation(f"max_tokens must be at least 1, got {budget}.", "max_tokens", budget)
    return budget


def _out_of_vocabulary(prompt: str | Sequence[int]) -> str | None:
    """vLLM's refusal of a token-id prompt with an id its vocabulary does not have."""
    if isinstance(prompt, str):
        return None
    bad = next((t for t in prompt if t >= VOCAB_SIZE), None)
    return None if bad is None else f"Token id {bad} is out of vocabulary"


async def _error_stream(message: str) -> AsyncIterator[str]:
    """A failure inside a stream, as vLLM's stream generators send it: one ``error`` event in the
    200 response, then ``[DONE]``."""
    error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
    yield f"data: {json.dumps({'error': error})}\n\n"
    yield "data: [DONE]\n\n"


def _eos_length(request_id: str, max_tokens: int, lengths: Sequence[int], seed: int) -> int:
    if not lengths:
        return max_tokens
    i = zlib.crc32(f"{seed}:{request_id}".encode()) % len(lengths)
    return max(1, min(max_tokens, int(lengths[i])))


SLEEP_WAIT_POLL_S = 0.01
"""How often ``/sleep?mode=wait`` looks whether the requests in flight have finished."""


class OffloadTier:
    """vLLM's CPU KV offloading (``--kv-offloading-size``) as this server models it: the token
    ids of every request that ended (finished or aborted: vLLM stores each computed block to CPU
    memory as it goes) are kept, the least recently used dropped first, within ``gb`` of KV
    memory; a later prompt that begins with whole blocks of one is computed only past them —
    vLLM loads those blocks from CPU memory instead (here that takes no time) — and at least
    its last token is computed, as in vLLM. ``queries`` and ``hits`` count prompt tokens, as
    vLLM's ``vllm:external_prefix_cache_queries`` / ``_hits`` do."""

    def __init__(self, gb: float, kv_bytes_per_token: float, block_size: int) -> None:
        self.gb = gb
        self.block_size = block_size
        self.capacity_tokens = int(gb * 2**30 / kv_bytes_per_token)
        self.kept: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.held = 0  # tokens kept
        self.queries = 0
        self.hits = 0

    def lookup(self, prompt: Sequence[int]) -> int:
        """The prompt's tokens found in whole kept blocks (counted as queried and hit)."""
        best, match = 0, None
        for ids in self.kept:
            n = 0
            for a, b in zip(ids, prompt, strict=False):
                if a != b:
                    break
                n += 1
            if n > best:
                best, match = n, ids
        hit = min(best, len(prompt) - 1) // self.block_size * self.block_size
        if match is not None and hit:
            self.kept.move_to_end(match)
        self.queries += len(prompt)
        self.hits += hit
        return hit

    def store(self, ids: tuple[int, ...]) -> None:
        """Keep these tokens' blocks (whole blocks only), dropping the oldest to make room."""
        ids = ids[: len(ids) // self.block_size * self.block_size]
        if not ids or len(ids) > self.capacity_tokens:
            return
        if ids in self.kept:
            self.kept.move_to_end(ids)
            return
        self.kept[ids] = None
        self.held += len(ids)
        while self.held > self.capacity_tokens:
            old, _ = self.kept.popitem(last=False)
            self.held -= len(old)

    def store_output(self, prompt: tuple[int, ...], done: asyncio.Future[EngineOutput]) -> None:
        """Keep a request that ended: its prompt's ids and those of what it wrote."""
        if done.cancelled() or done.exception() is not None:
            return
        out = done.result()
        written = tokenize(out.text) if out.text else []
        if len(written) == out.tokens:  # (a structured answer's pieces do not count back)
            self.store((*prompt, *written))


class _SimCollector(Collector):
    """vLLM's gauges and counters, read from the engine at scrape time."""

    def __init__(
        self, engine: WallClockEngine, model: str, offload: OffloadTier | None = None
    ) -> None:
        self.engine = engine
        self.model = model
        self.offload = offload

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats_nowait()
        labels, values = ["model_name", "engine"], [self.model, "0"]
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, float(value))
            yield gauge
        # vLLM 0.32: awake = 1 while awake; asleep, weights_offloaded = 1 (level 1) or
        # discard_all = 1 (level 2)
        level = self.engine.sleep_level
        sleep_state = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            labels=[*labels, "sleep_state"],
        )
        for state, on in (("awake", level is None), ("weights_offloaded", level == 1),
                          ("discard_all", level == 2)):  # fmt: skip
            sleep_state.add_metric([*values, state], float(on))
        yield sleep_state
        counter = CounterMetricFamily(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            labels=labels,
        )
        counter.add_metric(values, float(stats.preemptions_total))
        yield counter
        hist = self.engine.latencies
        latency = HistogramMetricFamily(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels=labels,
        )
        bounds = [*(str(b) for b in LATENCY_BUCKETS), "+Inf"]
        latency.add_metric(
            values, list(zip(bounds, map(float, hist.counts), strict=True)), hist.total
        )
        yield latency
        cfg = self.engine.sim.config
        blocks = self.engine.sim.token_capacity() // cfg.block_size
        info = {
            "block_size": str(cfg.block_size),
            "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
            "num_gpu_blocks": str(blocks),
            "engine": "0",
        }
        if self.offload is not None:
            info["enable_prefix_caching"] = "True"  # (the offloading tier's)
            info["kv_offloading_size"] = f"{self.offload.gb:g}"
            info["kv_offloading_backend"] = "native"
            for name, value, doc in (
                ("vllm:external_prefix_cache_queries", self.offload.queries,
                 "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens."),
                ("vllm:external_prefix_cache_hits", self.offload.hits,
                 "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens."),
            ):  # fmt: skip
                counter = CounterMetricFamily(name, doc, labels=labels)
                counter.add_metric(values, float(value))
                yield counter
        gauge = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        gauge.add_metric(list(info.values()), 1.0)
        yield gauge


WEIGHTS_EMPTY = (
    "the model's weights were discarded by sleep level 2 and not reloaded: wake with "
    'tags=weights, POST /collective_rpc {"method": "reload_weights"}, then tags=kv_cache'
)


def create_app(
    engine: WallClockEngine,
    *,
    dev_mode: bool = False,
    eos_lengths: Sequence[int] = (),
    seed: int = 0,
    scheduling_policy: SchedulingPolicy = "fcfs",
    stream_interval: int = 1,
    kv_offloading_gb: float | None = None,
) -> FastAPI:
    """The HTTP face of one simulated instance. The engine's driver runs in the app's lifespan.
    ``kv_offloading_gb``: vLLM's ``--kv-offloading-size`` (``OffloadTier``).
    ``scheduling_policy`` is vLLM's ``--scheduling-policy``, with its default: under ``fcfs`` a
    ``priority`` other than 0 is refused (``PRIORITY_REFUSED``). QLM sends priorities, so whatever
    serves it passes ``priority``, as ``vllm serve`` for QLM gets ``--scheduling-policy priority``."""
    ok = scheduling_policy in SCHEDULING_POLICIES
    check_setting(ok, "scheduling_policy", "fcfs or priority", scheduling_policy)
    check_setting(stream_interval >= 1, "stream_interval", ">= 1", stream_interval)
    models = tuple(engine.sim.perf_models)
    max_model_len = {m: pm.model.max_context for m, pm in engine.sim.perf_models.items()}
    started = int(time.time())
    # Level-2 sleep: reload_weights seen since, and weights woken without it (answers refused).
    weights = {"reloaded": False, "empty": False}
    offload = None
    if kv_offloading_gb is not None:
        check_setting(kv_offloading_gb > 0, "kv_offloading_gb", "> 0", kv_offloading_gb)
        pm = next(iter(engine.sim.perf_models.values()))
        offload = OffloadTier(
            kv_offloading_gb, pm.model.kv_bytes_per_token, engine.sim.config.block_size
        )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.close()

    app = FastAPI(title=f"QLM simulated vLLM ({', '.join(models)})", lifespan=lifespan)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SimCollector(engine, models[0], offload))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if await engine.health() else 503)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        cards = [
            {
                "id": m,
                "object": "model",
                "created": started,
                "owned_by": "vllm",
                "root": m,
                "parent": None,
                "max_model_len": max_model_len[m],
            }
            for m in models
        ]
        return {"object": "list", "data": cards}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def unknown_model(model: str) -> JSONResponse:
        message = f"The model `{model}` does not exist. Valid aliases: {', '.join(models)}."
        return _error(404, message, "NotFoundError", "model")

    # vLLM's own id of each request running (what /abort_requests takes) -> the engine's id
    live: dict[str, tuple[str, asyncio.Future[EngineOutput]]] = {}

    def track(vllm_id: str, rid: str, done: asyncio.Future[EngineOutput]) -> None:
        live[vllm_id] = (rid, done)

        def forget(_: object) -> None:
            if live.get(vllm_id, (None, None))[1] is done:
                del live[vllm_id]

        done.add_done_callback(forget)

    async def generate(
        request: Request,
        body: GenerationBody,
        prompt: str | list[int],
        limit: tuple[int | None, str],
        fmt: AnswerFormat,
    ) -> Response:
        """Run one request of either endpoint: ``prompt`` as this server reads it (a chat's
        rendered), ``limit`` the output tokens asked for (None: the rest of the context) and the
        name of the parameter that asked."""
        model = body.model or models[0]
        if model not in models:
            return unknown_model(model)
        prompt_tokens = count_tokens(prompt)
        try:
            max_tokens = _output_budget(
                max_model_len[model],
                prompt_tokens,
                tokenized=isinstance(prompt, str),
                limit=limit[0],
                param=limit[1],
            )
        except _Refused as exc:
            return _error(400, exc.message, param=exc.param)
        if engine.is_sleeping:
            return _error(503, "the engine is sleeping", "ServiceUnavailableError")
        if weights["empty"]:
            return _error(500, WEIGHTS_EMPTY, "InternalServerError")
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        refused = _out_of_vocabulary(prompt)
        if body.priority and scheduling_policy != "priority":
            refused = PRIORITY_REFUSED.format(priority=body.priority)
        if refused is not None:
            # Refused by the engine once the request is parsed: a 400, or inside a stream (already
            # answered 200) an error event, as vLLM's stream generators report any failure.
            if body.stream:
                events = _error_stream(refused)
                return StreamingResponse(events, media_type="text/event-stream", headers=headers)
            return _error(400, refused)
        output = max_tokens if body.ignore_eos else _eos_length(rid, max_tokens, eos_lengths, seed)
        ids = None if offload is None else tokenize(prompt) if isinstance(prompt, str) else prompt
        cached = 0 if offload is None or ids is None else offload.lookup(ids)
        req = EngineRequest(
            request_id=rid,
            model=model,
            prompt_tokens=prompt_tokens - cached,  # computed; the rest loaded from CPU memory
            max_tokens=max_tokens,
            priority=body.priority,
            output_tokens=output,
            sampling=body.sampling(),
            messages=body.message_dicts() if isinstance(body, ChatBody) else None,
        )
        chunks: asyncio.Queue[TokenChunk] = asyncio.Queue()
        try:
            done = engine.start_request(req, chunks.put_nowait)
        except EngineError as exc:
            return _error(400, str(exc))
        # vLLM numbers the prompts of one completion request (``-0``: its only one)
        track(fmt.id_prefix + rid + ("-0" if fmt.role is None else ""), rid, done)
        if offload is not None and ids is not None:
            done.add_done_callback(functools.partial(offload.store_output, tuple(ids)))
        prompt_ids: list[int] | None = None
        if body.return_token_ids:
            prompt_ids = tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        meta = {
            "id": fmt.id_prefix + rid,
            "object": fmt.chunk_object if body.stream else fmt.answer_object,
            "created": int(time.time()),
            "model": model,
        }
        if body.stream:
            events = _stream(
                engine,
                request,
                req,
                chunks,
                meta,
                body.stream_options,
                fmt,
                stream_interval,
                prompt_ids=prompt_ids,
                prompt_tokens=prompt_tokens,
            )
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        result = await _wait_or_abort(engine, request, rid, done)
        if result is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        choice = fmt.choice(
            result.text,
            result.finish_reason,
            stream=False,
            calls=result.tool_calls,
            token_ids=None if prompt_ids is None else _drained_ids(chunks),
            prompt_ids=prompt_ids,
        )
        answer = {**meta, "choices": [choice], "usage": _usage(prompt_tokens, result.tokens)}
        if fmt.role is not None:
            answer["prompt_token_ids"] = prompt_ids
        return JSONResponse(answer, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = CompletionBody.model_validate(await request.json())
        except (ValidationError, json.JSONDecodeError) as exc:
            return _error(400, str(exc))
        if isinstance(body.prompt, list) and not body.prompt:
            return _error(400, "You must pass at least one prompt")
        if body.prompt == "":
            message = "Either prompt or prompt_embeds must be provided and non-empty."
            return _error(400, f"{message} (parameter=prompt)", param="prompt")
        limit = (body.max_tokens, "max_tokens")
        return await generate(request, body, body.prompt, limit, COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = ChatBody.model_validate(await request.json())
        except (ValidationError, json.JSONDecodeError) as exc:
            return _error(400, str(exc))
        fmt = chat_format(body.role())
        return await generate(request, body, body.rendered(), body.output_limit(), fmt)

    @app.post("/tokenize")
    async def tokenize_prompt(request: Request) -> Response:
        """vLLM's ``/tokenize`` of a prompt or of a chat, by this server's tokens (a chat
        rendered as its generations render it), so the count is the one it generates with."""
        try:
            body = TokenizeBody.model_validate(await request.json())
        except (ValidationError, json.JSONDecodeError) as exc:
            return _error(400, str(exc))
        model = body.model or models[0]
        if model not in models:
            return unknown_model(model)
        text = body.text()
        ids = tokenize(text)
        strs = (text.split() or [BOS_TEXT]) if body.return_token_strs else None
        answer = {"count": len(ids), "max_model_len": max_model_len[model], "tokens": ids}
        return JSONResponse(answer | {"token_strs": strs})

    if dev_mode:

        @app.post("/sleep")
        async def sleep(
            level: Annotated[int, Query(ge=0, le=2)] = 1,
            mode: Annotated[Literal["abort", "wait", "keep"], Query()] = "abort",
        ) -> Response:
            """vLLM 0.32: ``mode`` says what becomes of the requests in flight — ``abort`` (the
            default) aborts them (their answers end ``abort``), ``wait`` lets them finish
            first; ``keep`` (vLLM pauses them until the wake-up) is not simulated: with
            requests in flight it is refused (409). Level 0 (pause only) is not simulated."""
            if level == 0:
                return _error(400, "sleep level 0 (pause only) is not simulated; use 1 or 2")
            if mode == "abort":
                for rid, _ in list(live.values()):
                    _abort_quietly(engine, rid)
            elif mode == "wait":
                while engine.sim.queue_view():
                    await asyncio.sleep(SLEEP_WAIT_POLL_S)
            try:
                engine.sleep(level)
            except EngineError as exc:
                return _error(409, str(exc))
            return JSONResponse({"status": "sleeping", "level": level})

        @app.post("/wake_up")
        async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:
            # vLLM: level 2 discarded the weights; waking reallocates them empty, and they are
            # loaded in place by POST /collective_rpc reload_weights (between a wake_up of
            # tags=weights and one of tags=kv_cache). Woken without that, vLLM answers
            # nonsense; this server answers 500 (``WEIGHTS_EMPTY``) so that the mistake shows.
            if tags and "kv_cache" not in tags:  # weights memory back; nothing to simulate
                return JSONResponse({"status": "sleeping", "tags": tags})
            if engine.sleep_level == 2 and not weights["reloaded"]:
                weights["empty"] = True
            weights["reloaded"] = False
            await engine.wake_up()
            return JSONResponse({"status": "awake", "tags": tags})

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request) -> Response:
            try:
                body = await request.json()
            except json.JSONDecodeError as exc:
                return _error(400, f"JSON decode error: {exc}")
            if not isinstance(body, dict) or body.get("method") != "reload_weights":
                return _error(400, "the simulated server runs only method reload_weights")
            if engine.sleep_level == 2:
                weights["reloaded"] = True
            weights["empty"] = False
            return JSONResponse({"results": [None]})

        @app.get("/is_sleeping")
        async def is_sleeping() -> dict[str, bool]:
            return {"is_sleeping": engine.is_sleeping}

        @app.get("/server_info")
        async def server_info(
            config_format: Annotated[Literal["text", "json"], Query()] = "text",
        ) -> dict[str, Any]:
            """vLLM's configuration as this server runs it: the fields of vLLM's ``VllmConfig``
            that the simulated engine has, with its values (JSON, or vLLM's one-line text)."""
            config = _vllm_config(engine, scheduling_policy, stream_interval, offload)
            shown = config if config_format == "json" else _config_text(config)
            return {"vllm_config": shown, "vllm_env": {}, "system_env": {}}

        @app.post("/abort_requests")
        async def abort_requests(request: Request) -> Response:
            """vLLM 0.32's RL router: abort by vLLM's own ids (``cmpl-<id>-0``, ``chatcmpl-<id>``;
            another id aborts nothing), or, without ids, everything running. It answers how many
            ids it was given (without: how many it aborted)."""
            try:
                body = await request.json()
            except json.JSONDecodeError:
                return _error(400, "Invalid JSON format", "Bad Request")
            if not isinstance(body, dict):
                return _error(400, "Request body must be a JSON object", "Bad Request")
            given = body.get("request_ids")
            if given and not isinstance(given, (list, str)):
                return _error(400, "request_ids must be a list of request ids", "Bad Request")
            ids = ([given] if isinstance(given, str) else list(given)) if given else list(live)
            for vllm_id in ids:
                held = live.get(str(vllm_id))
                if held is not None:
                    _abort_quietly(engine, held[0])
            return JSONResponse({"status": "aborted", "aborted": len(given or ids)})

    return app


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


async def _wait_or_abort(
    engine: WallClockEngine, request: Request, rid: str, done: asyncio.Future[EngineOutput]
) -> EngineOutput | None:
    """The request's output, or ``None`` after aborting it because the client disconnected."""
    try:
        while True:
            finished, _ = await asyncio.wait({done}, timeout=DISCONNECT_POLL_S)
            if finished:
                return done.result()
            if await request.is_disconnected():
                _abort_quietly(engine, rid)
                return None
    except asyncio.CancelledError:
        _abort_quietly(engine, rid)
        raise


def _abort_quietly(engine: WallClockEngine, rid: str) -> None:
    with contextlib.suppress(UnknownRequest):  # it had finished
        engine.abort_nowait(rid)


async def _stream(
    engine: WallClockEngine,
    request: Request,
    req: EngineRequest,
    chunks: asyncio.Queue[TokenChunk],
    meta: dict[str, Any],
    options: StreamOptions | None,
    fmt: AnswerFormat = COMPLETION,
    interval: int = 1,
    *,
    prompt_ids: Sequence[int] | None = None,
    prompt_tokens: int | None = None,
) -> AsyncIterator[str]:
    """SSE events as vLLM sends them; aborts the engine request if the client goes away.
    ``interval`` > 1 (vLLM's ``--stream-interval``): the first token goes at once, then the
    tokens wait until ``interval`` of them (or the end) make one event. ``prompt_ids`` (asked
    for with ``return_token_ids``): the prompt's ids go on the first event (``AnswerFormat``) and
    every event says its new tokens' ids."""
    prompt_count = req.prompt_tokens if prompt_tokens is None else prompt_tokens
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options and options.continuous_usage_stats)
    finished = False
    held: list[TokenChunk] = []
    sent_tokens = 0
    first_event = True  # (of the tokens: a chat's opening says the role before)
    try:
        opening = fmt.opening()
        if opening is not None:
            first: dict[str, Any] = {**meta, "choices": [opening]}
            if continuous:
                first["usage"] = _usage(prompt_count, 0)
            first["prompt_token_ids"] = None if prompt_ids is None else list(prompt_ids)
            yield f"data: {json.dumps(first)}\n\n"
        while True:
            try:
                async with asyncio.timeout(DISCONNECT_POLL_S):
                    chunk = await chunks.get()
            except TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            held.append(chunk)
            due = sent_tokens == 0 or chunk.tokens - sent_tokens >= interval
            if not (due or chunk.finish_reason is not None):
                continue
            chunk, held = _merged(held), []
            ids = None if prompt_ids is None else (chunk.token_ids or ())
            choice = fmt.choice(
                chunk.text,
                chunk.finish_reason,
                stream=True,
                calls=chunk.calls,
                token_ids=ids,
                prompt_ids=prompt_ids if first_event else None,
            )
            sent_tokens, first_event = chunk.tokens, False
            event: dict[str, Any] = {**meta, "choices": [choice]}
            if continuous:
                event["usage"] = _usage(prompt_count, chunk.tokens)
            yield f"data: {json.dumps(event)}\n\n"
            if chunk.finish_reason is not None:
                finished = True
                if include_usage:
                    last = {**meta, "choices": [], "usage": _usage(prompt_count, chunk.tokens)}
                    yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"
                return
    finally:
        if not finished:
            _abort_quietly(engine, req.request_id)


def _merged(chunks: Sequence[TokenChunk]) -> TokenChunk:
    """Consecutive chunks of one request as one: their text and tool-call deltas joined (the
    deltas of one call merged: its id and name, then its arguments), the last count and end."""
    last = chunks[-1]
    if len(chunks) == 1:
        return last
    calls: list[dict[str, Any]] = []
    for chunk in chunks:
        for delta in chunk.calls:
            if calls and calls[-1].get("index") == delta.get("index"):
                fn = calls[-1].setdefault("function", {})
                fn["arguments"] = fn.get("arguments", "") + delta.get("function", {}).get(
                    "arguments", ""
                )
            else:
                calls.append({**delta, "function": dict(delta.get("function", {}))})
    text = "".join(c.text for c in chunks)
    ids: list[int] | None = []
    for chunk in chunks:
        ids = None if ids is None or chunk.token_ids is None else ids + list(chunk.token_ids)
    token_ids = None if ids is None else tuple(ids)
    return replace(last, text=text, calls=tuple(calls), token_ids=token_ids)


def _drained_ids(chunks: asyncio.Queue[TokenChunk]) -> list[int]:
    """The token ids of the chunks queued (an unstreamed answer's, once it has ended)."""
    ids: list[int] = []
    while not chunks.empty():
        ids.extend(chunks.get_nowait().token_ids or ())
    return ids


def _vllm_config(
    engine: WallClockEngine,
    scheduling_policy: SchedulingPolicy,
    stream_interval: int,
    offload: OffloadTier | None = None,
) -> dict[str, Any]:
    """The sections of vLLM's ``VllmConfig`` (``/server_info``) that the simulated engine has,
    with its values: the model, the KV cache (``num_gpu_blocks`` x ``block_size`` tokens), the
    scheduler (``max_num_seqs``, ``max_num_batched_tokens``), the GPUs. Sleep mode is on: this
    server sleeps in dev mode, where ``/server_info`` is served."""
    model, pm = next(iter(engine.sim.perf_models.items()))
    cfg = engine.sim.config
    capacity = engine.sim.token_capacity()
    return {
        "model_config": {
            "model": model,
            "served_model_name": model,
            "tokenizer": model,
            "max_model_len": pm.model.max_context,
            "enable_sleep_mode": True,
            "skip_tokenizer_init": False,
        },
        "cache_config": {
            "block_size": cfg.block_size,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "enable_prefix_caching": offload is not None,  # only the offloading tier's
            "kv_offloading_size": None if offload is None else offload.gb,
            "kv_offloading_backend": "native",
            "num_gpu_blocks": capacity // cfg.block_size,
            "kv_cache_size_tokens": capacity,
        },
        "parallel_config": {
            "pipeline_parallel_size": 1,
            "tensor_parallel_size": pm.gpu_count,
            "data_parallel_size": 1,
            "world_size": pm.gpu_count,
        },
        "scheduler_config": {
            "runner_type": "generate",
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "max_num_seqs": cfg.max_num_seqs,
            "enable_chunked_prefill": True,
            "policy": scheduling_policy,
            "stream_interval": stream_interval,
        },
        "device_config": {"device": "cuda"},
    }


def _config_text(config: Mapping[str, Mapping[str, Any]]) -> str:
    """``/server_info``'s default (text) form of the configuration: one line of ``name=value``."""
    return ", ".join(f"{k}={v!r}" for section in config.values() for k, v in section.items())


def serve(
    *,
    model: str,
    gpu: str,
    gpu_count: int | None,
    host: str,
    port: int,
    time_scale: float,
    dev_mode: bool,
    eos_lengths: Sequence[int],
    seed: int,
    max_num_seqs: int | None = None,
    scheduling_policy: SchedulingPolicy = "fcfs",
    stream_interval: int = 1,
    kv_offloading_gb: float | None = None,
    catalog: HardwareCatalog | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Run the server until interrupted (``qlm sim-engine serve``). ``eos_lengths``: the output
    lengths a request without ``ignore_eos`` ends after (drawn per request; empty: at
    ``max_tokens``); ``catalog``: the performance models (default: the shipped ones); ``sock``:
    bound to ``host:port`` already (the command binds it before anything else)."""
    import uvicorn

    engine = WallClockEngine.from_catalog(
        f"sim-{model}-{port}",
        model,
        gpu,
        gpu_count,
        time_scale=time_scale,
        max_num_seqs=max_num_seqs,
        catalog=catalog,
    )
    app = create_app(
        engine,
        dev_mode=dev_mode,
        eos_lengths=eos_lengths,
        seed=seed,
        scheduling_policy=scheduling_policy,
        stream_interval=stream_interval,
        kv_offloading_gb=kv_offloading_gb,
    )
    # Its lines go to the process's handler, in QLM's format (qlm.cli.logs).
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        log_config=None,
        timeout_keep_alive=SERVER_KEEPALIVE_S,  # as QLM starts vLLM (qlm.engines.vllm_launch)
    )
    uvicorn.Server(config).run(sockets=None if sock is None else [sock])
