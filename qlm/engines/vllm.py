"""The ``Engine`` of a real instance: an HTTP client of ``vllm serve`` (docs/engines.md).

Every endpoint, field, flag and metric name here was checked against vLLM 0.32.0 (``VLLM_VERSION``;
its CPU build is run by tests/vllm/) and 0.14.0; docs/engines.md records what was checked and where.

* ``submit``: ``POST /v1/completions`` with ``stream: true``, the request's ``priority`` (the
  server runs ``--scheduling-policy priority``; lower runs first) and an ``X-Request-Id`` header.
  ``stream_options.continuous_usage_stats`` puts the running ``completion_tokens`` in every chunk,
  so the token count is the server's, not a guess from the text. A replayed request
  (``output_tokens`` set) is sent ``ignore_eos`` with ``max_tokens`` = its true length; one
  without prompt text gets ``filler_prompt`` token ids, of the server's vocabulary
  (``/tokenize``). A chat (``messages`` set) goes to
  ``POST /v1/chat/completions`` instead, so that vLLM applies the model's own chat template; the
  same fields, streaming and errors, text in ``delta.content``. Resumed, it ends with the partial
  answer as an assistant message, sent ``continue_final_message`` (and
  ``add_generation_prompt: false``: vLLM refuses both) so the model continues it.
* ``complete``: the same request unstreamed (``qlm profile server``).
* ``abort``: closing the stream. vLLM aborts a streaming request whose client disconnects.
  Where ``POST /abort_requests`` is served (vLLM 0.32 in dev mode) it is also sent vLLM's own id
  of the request (``cmpl-<id>-0``, ``chatcmpl-<id>``), which frees it at once.
* ``capabilities``: also reads dev mode's ``/server_info`` (``max_num_seqs``, whether sleep mode
  is on) and probes sleep for real (``probe_sleep``): the endpoints answer without it.
* ``stats``: ``GET /metrics`` (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc``, ``vllm:num_preemptions_total``, ``vllm:cache_config_info``).
* ``set_model_tier``: sleep mode (``POST /sleep?level=1|2&mode=wait``, ``POST /wake_up``), which
  needs ``VLLM_SERVER_DEV_MODE=1`` and ``--enable-sleep-mode``.
* ``swap_out`` / ``swap_in``: vLLM has no per-request KV swap API (its CPU KV offloading is a
  cache the engine manages itself): they raise ``UnsupportedOperation``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from qlm.domain import ModelTier
from qlm.engines.base import (
    ChunkCallback,
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    TokenChunk,
    UnsupportedOperation,
    continued_from_ids,
)
from qlm.engines.vllm_wire import (
    FINISH,
    cache_capacity_tokens,
    choice_text,
    context_room,
    dig,
    endpoint_path,
    engine_request_id,
    error_message,
    error_text,
    event_parts,
    metric_values,
    offload_gb,
    one_token,
    sse_data,
)
from qlm.errors import EngineError, EngineTimeout, RequestRejected, UnknownRequest

VLLM_VERSION = "0.32.0"
"""The vLLM release whose API this client and ``qlm sim-engine serve`` follow."""

log = logging.getLogger(__name__)

PRIORITY_OFF = "Priority scheduling is not enabled"
"""vLLM's answer to a request with ``priority`` != 0 when the server runs FCFS scheduling ("Got
priority N but Priority scheduling is not enabled."), as its API documents and its V0 engine
answered. vLLM's V1 engine (0.14, 0.32) does not refuse: it ignores the priority (vllm#22997)."""

FILLER_TOKEN_ID = 1000
"""Token id of the synthetic prompt sent for a request without prompt text to a server that
does not say which ids its vocabulary has (no ``/tokenize``); only the prompt's length matters
to a replay."""
FILLER_IDS = (FILLER_TOKEN_ID, 30_000)  # ids drawn from there without the server's own
FILLER_HEAD = 16  # the tokens that make each synthetic prompt its own (inside any KV block)
TOKEN_SAMPLE = " ".join(
    ["the of and to in is that it for on with as was at by an be this from or have not are"]
    + [chr(c) for c in range(33, 127)]
)
"""Text whose tokens are the ids QLM builds synthetic prompts from: the server's ``/tokenize``
turns it into ids of its own vocabulary, whatever its size (a random id may lie outside it:
vLLM answers "Token id N is out of vocabulary")."""


def filler_prompt(request_id: str, tokens: int, ids: Sequence[int] | None = None) -> list[int]:
    """The synthetic prompt of a request without prompt text: ``tokens`` ids taken from ``ids``
    (the server's own, ``VllmEngine.token_ids``; default: ``FILLER_IDS``), the first
    ``FILLER_HEAD`` drawn from the request id. vLLM's prefix cache (on by default) hashes the KV
    blocks of a prompt from its first; were every replayed prompt the same filler, each would be
    served from the first one's cached blocks and its prefill would cost next to nothing. The
    same id gets the same prompt (a resumed request still meets its own cached prefix)."""
    rng = random.Random(zlib.crc32(request_id.encode()))
    n = min(tokens, FILLER_HEAD)
    if ids:
        return [rng.choice(ids) for _ in range(n)] + [ids[0]] * (tokens - n)
    head = [rng.randrange(*FILLER_IDS) for _ in range(n)]
    return head + [FILLER_TOKEN_ID] * (tokens - n)


@dataclass(slots=True)
class _Flight:
    request: EngineRequest
    wire_id: str  # the X-Request-Id vLLM gets: the request id, with ".n" from its n-th sending
    parts: list[str] = field(default_factory=list)
    tokens: int = 0
    aborted: bool = False
    task: asyncio.Task[EngineOutput] | None = None
    shortened: bool = False  # sent again with the max_tokens the context had room for
    prompt_ids: tuple[int, ...] | None = None  # the prompt's token ids, until passed on
    # Parking (``swap_out``/``swap_in``): the first sending's prompt ids, every output id so
    # far (None once a chunk came without them), the output tokens before the current stream,
    # the current stream, and the event a parked request waits on.
    first_prompt_ids: tuple[int, ...] | None = None
    ids: list[int] | None = field(default_factory=list)
    base: int = 0
    stream: asyncio.Task[EngineOutput] | None = None
    parked: asyncio.Event | None = None
    origin: EngineRequest = field(init=False)  # as submitted (``request`` may be replaced)

    def __post_init__(self) -> None:
        self.origin = self.request

    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Tool calls by index, assembled from the deltas: id, name, arguments so far."""

    def add_calls(self, deltas: list[dict[str, Any]]) -> None:
        """vLLM streams a call as deltas of one index: its id, type and name once, then its
        arguments in fragments."""
        for delta in deltas:
            index = delta.get("index", len(self.calls))
            call = self.calls.setdefault(
                int(index), {"id": "", "type": "function", "name": "", "arguments": ""}
            )
            if delta.get("id"):
                call["id"] = str(delta["id"])
            fn = delta.get("function") or {}
            if isinstance(fn, dict):
                call["name"] += str(fn.get("name") or "")
                call["arguments"] += str(fn.get("arguments") or "")

    def tool_calls(self) -> tuple[dict[str, Any], ...]:
        return tuple(
            {
                "id": c["id"],
                "type": c["type"],
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for _, c in sorted(self.calls.items())
        )

    def output(self, finish: FinishReason) -> EngineOutput:
        rid = self.request.request_id
        return EngineOutput(rid, "".join(self.parts), self.tokens, finish, self.tool_calls())

    def partial(self) -> EngineOutput:
        return self.output("abort")


MAX_REMEMBERED = 100_000  # request ids remembered as sent (in flight, or aborted and not back)

REJECTED = frozenset({400, 404, 413, 422})
"""Answers that say the request is bad (too long, unknown model, bad parameter), not the server."""


KEEPALIVE_S = 2.0
"""How long an idle connection to a server is kept for reuse: well below the server's own
keep-alive (vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``: 5 s by default, 60 s as ``qlm instance
launch`` starts it). A request written on a connection the server has just closed fails with a
``ReadError`` before any answer; a busy host, slow to write what it took from its pool, makes
that likely when the two times are close."""


OPENING = 32
"""Streams being opened at once per server (connect, request sent, until the answer's headers):
a burst of pulls (a controller taking over a backlog starts hundreds per server in one step)
waits here rather than on connects whose timeouts run out while a busy host serves the others.
The streams that are open are not bounded here (the agent bounds how many run)."""


class VllmEngine:
    """One ``vllm serve`` instance at ``base_url`` serving ``models`` (its served model names)."""

    def __init__(
        self,
        name: str,
        base_url: str,
        models: str | Sequence[str],
        *,
        max_num_seqs: int | None = None,
        timeout_s: float = 10.0,
        tier_timeout_s: float = 300.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.models = (models,) if isinstance(models, str) else tuple(models)
        if not self.models:
            raise EngineError(f"{name} ({self.base_url}): at least one served model is needed")
        self.max_num_seqs = max_num_seqs
        self.timeout_s = timeout_s
        self.tier_timeout_s = tier_timeout_s
        # Every request streaming holds a connection: the agent, not the pool, bounds how many
        # run at once (httpx's default pool of 100 would hold the rest back until they time out).
        # Each connection a stream ends on is kept for the next one (``KEEPALIVE_S``): a new
        # TCP connection per request costs the client and the server a connect each.
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_S
            ),
            transport=transport,
        )
        self._flights: dict[str, _Flight] = {}
        self._opening = asyncio.Semaphore(OPENING)
        self._tiers = {m: ModelTier.ACTIVE for m in self.models}
        self._priority = True  # False once the server said it does not schedule by priority
        # Requests sent and not yet finished here, with how many times: one sent again after an
        # abort gets its own id, as vLLM may still hold the aborted one (it frees it once it
        # notices the closed stream) and refuses an id already running.
        self._sent: dict[str, int] = {}
        self.token_ids: tuple[int, ...] | None = None
        """Ids of the server's vocabulary that synthetic prompts are made of (``/tokenize`` of
        ``TOKEN_SAMPLE``); () when the server has no ``/tokenize``; None until asked."""
        self.sleep_probe = "not probed"
        """Why the server does or does not sleep, as ``capabilities`` found (``probe_sleep``)."""
        self._abort_endpoint = False  # POST /abort_requests is served (dev mode, vLLM >= 0.32)

    def _fail(self, what: str, detail: object) -> EngineError:
        return EngineError(f"{self.name} ({self.base_url}): {what}: {detail}")

    def _failed(self, what: str, exc: httpx.HTTPError) -> EngineError:
        """``exc`` as QLM's error: a timeout is ``EngineTimeout`` (the server may be slow, not
        dead; a connect or pool timeout never reached it), anything else ``EngineError``."""
        message = f"{self.name} ({self.base_url}): {what}: {exc!r}"
        if isinstance(exc, httpx.TimeoutException):
            reached = not isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout)
            return EngineTimeout(message, reached=reached)
        return EngineError(message)

    async def _call(
        self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        try:
            resp = await self._client.request(
                method, path, timeout=timeout or self.timeout_s, **kwargs
            )
        except httpx.HTTPError as exc:
            raise self._failed(f"{method} {path} failed", exc) from exc
        if resp.status_code == 404 and path in (
            "/sleep",
            "/wake_up",
            "/is_sleeping",
            "/collective_rpc",
        ):
            raise self._fail(
                f"{method} {path} is not served",
                "start vLLM with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode",
            )
        if resp.status_code >= 400:
            raise self._fail(f"{method} {path} answered {resp.status_code}", error_message(resp))
        return resp

    # --- the Engine protocol -------------------------------------------------------------------------

    async def capabilities(self) -> EngineCapabilities:
        """What the server serves and can do, asked of it: its models, KV capacity
        (``/metrics``), ``max_num_seqs`` (given, else dev mode's ``/server_info``), whether it
        really sleeps (``probe_sleep``) and whether ``/abort_requests`` is served."""
        cards = (await self._call("GET", "/v1/models")).json().get("data", [])
        served = tuple(str(c["id"]) for c in cards if "id" in c)
        missing = set(self.models) - set(served)
        if missing:
            raise self._fail("models not served", f"{sorted(missing)}; serves {list(served)}")
        families = await self._metrics()
        cap = cache_capacity_tokens(families)
        offload = offload_gb(families)
        info = await self.server_info()
        seqs = self.max_num_seqs
        if seqs is None and info is not None:
            told = dig(info, "scheduler_config", "max_num_seqs")
            seqs = told if isinstance(told, int) and told > 0 else None
        sleep, self.sleep_probe = await self.probe_sleep(info)
        log.info("%s (%s): %s", self.name, self.base_url, self.sleep_probe)
        await self._read_tiers()
        self._abort_endpoint = await self._serves_abort_requests()
        await self.load_token_ids()
        return EngineCapabilities(
            models=self.models,
            max_num_seqs=seqs,
            kv_capacity_tokens=cap,
            supports_sleep=sleep,
            supports_swap=offload is not None,
            supports_abort_endpoint=self._abort_endpoint,
        )

    async def server_info(self) -> dict[str, Any] | None:
        """vLLM's configuration as the server runs it (``GET /server_info?config_format=json``,
        dev mode only: ``vllm_config`` with ``model_config``, ``scheduler_config``,
        ``cache_config``, ``device_config``, ...), or None where it is not served."""
        try:
            resp = await self._call("GET", "/server_info", params={"config_format": "json"})
            config = resp.json().get("vllm_config")
        except (EngineError, ValueError, AttributeError):
            return None
        return config if isinstance(config, dict) else None

    async def probe_sleep(self, info: dict[str, Any] | None = None) -> tuple[bool, str]:
        """Whether the server really sleeps, and why (one sentence). vLLM registers ``/sleep``,
        ``/wake_up`` and ``/is_sleeping`` in dev mode whether or not sleep mode is on, and a
        server without it answers them all (its CPU build logs "sleep mode is not supported on
        CPU, ignore it" and only pauses its scheduler), so the endpoints prove nothing:

        1. ``/is_sleeping`` must be served (dev mode);
        2. where ``/server_info`` says how the server runs, sleep mode must be on
           (``model_config.enable_sleep_mode``, which vLLM accepts only on a platform that has
           it: "Sleep mode is not supported on current platform.");
        3. an idle server is put to sleep (level 1, ``mode=wait``, so nothing in flight is
           aborted, vLLM's default) and woken, ``/is_sleeping`` saying so each time. A busy one
           is not disturbed: it sleeps if step 2 said so, else not (probed again at the next
           attach)."""
        try:
            asleep = bool((await self._call("GET", "/is_sleeping")).json().get("is_sleeping"))
        except (EngineError, ValueError, AttributeError) as exc:
            return False, f"no sleep mode (GET /is_sleeping: {exc})"
        enabled = None if info is None else dig(info, "model_config", "enable_sleep_mode")
        device = None if info is None else dig(info, "device_config", "device")
        on = f" on {device}" if device else ""
        if enabled is False:
            return False, (
                f"no sleep mode: the server runs without --enable-sleep-mode{on} (vLLM accepts "
                "it only where it can sleep; its dev-mode /sleep then only pauses scheduling)"
            )
        if asleep:
            return enabled is True, f"asleep already{on}; sleep mode {'on' if enabled else '?'}"
        stats = await self.stats()
        if stats.running or stats.waiting or self._flights:
            if enabled is True:
                return True, f"sleep mode on{on} (busy: not put to sleep to check)"
            return False, "sleep mode not verified: the server is busy and does not say"
        t = self.tier_timeout_s
        try:
            await self._call("POST", "/sleep", params={"level": 1, "mode": "wait"}, timeout=t)
            slept = await self.is_sleeping()
            await self._call("POST", "/wake_up", timeout=t)
            woke = not await self.is_sleeping()
        except (EngineError, ValueError, AttributeError) as exc:
            with contextlib.suppress(EngineError):
                await self._call("POST", "/wake_up", timeout=t)
            return False, f"no sleep mode: the sleep probe failed ({exc})"
        if not (slept and woke):
            return False, f"no sleep mode: put to sleep it said asleep={slept}, woken awake={woke}"
        return True, f"sleep mode on{on}: slept (level 1) and woke when probed"

    async def _read_tiers(self) -> None:
        """Take the server's sleep state as it is (it may have been put to sleep before QLM
        attached: colocated servers are started one at a time, each put to sleep before the
        next starts): awake is ``ACTIVE``; asleep, vLLM 0.32's ``vllm:engine_sleep_state`` says
        the level (``weights_offloaded`` = 1: level 1, ``WARM``), and a server asleep that does
        not say is taken as ``COLD`` (waking it then follows the level-2 recipe, which also
        wakes a level-1 sleep). Without ``/is_sleeping`` (no dev mode) it is awake."""
        try:
            asleep = await self.is_sleeping()
        except (EngineError, ValueError, AttributeError):
            asleep = False
        tier = ModelTier.ACTIVE
        if asleep:
            samples = (await self._metrics()).get("vllm:engine_sleep_state", [])
            level1 = any(
                v == 1 for lab, v in samples if lab.get("sleep_state") == "weights_offloaded"
            )
            tier = ModelTier.WARM if level1 else ModelTier.COLD
        for m in self.models:
            self._tiers[m] = tier

    async def _serves_abort_requests(self) -> bool:
        """Whether ``POST /abort_requests`` is served (vLLM 0.32 in dev mode): probed with an id
        no request has (an empty list would abort every request)."""
        body = {"request_ids": ["qlm-probe-no-such-request"]}
        try:
            await self._call("POST", "/abort_requests", json=body)
        except EngineError:
            return False
        return True

    async def load_token_ids(self) -> tuple[int, ...]:
        """The ids synthetic prompts are made of (``token_ids``): ``POST /tokenize`` of
        ``TOKEN_SAMPLE`` with the first model, read once; () without ``/tokenize``."""
        if self.token_ids is None:
            body = {"model": self.models[0], "prompt": TOKEN_SAMPLE, "add_special_tokens": False}
            try:
                tokens = (await self._call("POST", "/tokenize", json=body)).json()["tokens"]
                ids = tuple(sorted({int(t) for t in tokens}))
            except (EngineError, ValueError, KeyError, TypeError):
                ids = ()
            self.token_ids = ids
        return self.token_ids

    async def submit(
        self, request: EngineRequest, on_chunk: ChunkCallback | None = None
    ) -> EngineOutput:
        rid = request.request_id
        if rid in self._flights:
            raise self._fail("duplicate request", f"{rid!r} is already in flight")
        if request.prompt is None and request.messages is None and self.token_ids is None:
            await self.load_token_ids()
        n = self._sent.pop(rid, 0) + 1
        self._sent[rid] = n
        while len(self._sent) > MAX_REMEMBERED:
            del self._sent[next(iter(self._sent))]
        flight = _Flight(request, rid if n == 1 else f"{rid}.{n}")
        flight.task = asyncio.create_task(self._stream(flight, on_chunk), name=f"vllm-{rid}")
        self._flights[rid] = flight
        try:
            out = await flight.task
            if not out.aborted:
                self._sent.pop(rid, None)
            return out
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if flight.aborted and (current is None or current.cancelling() == 0):
                return flight.partial()  # ``abort`` closed the stream
            raise
        finally:
            self._flights.pop(rid, None)

    async def complete(self, request: EngineRequest, *, timeout_s: float = 3600.0) -> EngineOutput:
        """Run ``request`` without streaming (one answer when it ends): what profiling uses, so
        that the time it measures is the server's, not the client's parsing of every token."""
        path = endpoint_path(request)
        if request.prompt is None and request.messages is None and self.token_ids is None:
            await self.load_token_ids()
        while True:
            body = self.request_body(request, stream=False)
            try:
                resp = await self._call(
                    "POST",
                    path,
                    json=body,
                    headers={"X-Request-Id": request.request_id},
                    timeout=timeout_s,
                )
                break
            except EngineError as exc:
                if not self._priority_refused(str(exc), body["priority"]):
                    raise
        try:
            data = resp.json()
            choice = data["choices"][0]
            tokens = int(data["usage"]["completion_tokens"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise self._fail(f"POST {path} sent a bad answer", repr(exc)) from exc
        finish = self._finish_reason(choice.get("finish_reason") or "stop", [choice])
        return EngineOutput(request.request_id, choice_text(choice), tokens, finish)

    async def abort(self, request_id: str) -> EngineOutput:
        flight = self._flights.get(request_id)
        if flight is None or flight.task is None:
            raise UnknownRequest(f"{self.name}: no request {request_id!r} in flight")
        task = flight.task
        if not task.done():
            flight.aborted = True
            task.cancel()  # leaves ``client.stream``: the connection closes, vLLM aborts
            await asyncio.wait({task})
            if self._abort_endpoint:  # frees it now, not once vLLM notices the closed stream
                body = {"request_ids": [engine_request_id(flight.request, flight.wire_id)]}
                with contextlib.suppress(EngineError):
                    await self._call("POST", "/abort_requests", json=body)
        if task.cancelled() or task.exception() is not None:
            return flight.partial()
        return task.result()

    async def stats(self) -> EngineStats:
        families = await self._metrics()

        def total(*names: str) -> float:
            return sum(
                v
                for n in names
                for v in metric_values(families, n, self.models)
                if not math.isnan(v)
            )

        kv = metric_values(families, "vllm:kv_cache_usage_perc", self.models) or metric_values(
            families, "vllm:gpu_cache_usage_perc", self.models
        )
        kv_fraction = sum(kv) / len(kv) if kv else 0.0
        cap = cache_capacity_tokens(families) or 0
        offload = offload_gb(families)
        active = next((m for m, t in self._tiers.items() if t is ModelTier.ACTIVE), None)
        return EngineStats(
            running=int(total("vllm:num_requests_running")),
            waiting=int(total("vllm:num_requests_waiting")),
            swapped=0,
            kv_used_tokens=round(kv_fraction * cap),
            kv_capacity_tokens=cap,
            active_model=active,
            model_tiers=tuple(self._tiers.items()),
            preemptions_total=int(total("vllm:num_preemptions_total", "vllm:num_preemptions")),
            gpu_memory_used_fraction=0.0,  # not exported by vLLM
            kv_usage_fraction=kv_fraction,
            sleeping=active is None,
            swap_free_gb=offload,
        )

    async def set_model_tier(self, model: str, tier: ModelTier) -> ModelTier:
        if model not in self.models:
            raise self._fail("unknown model", f"{model!r}; serves {list(self.models)}")
        if tier is ModelTier.ACTIVE and self._tiers.get(model) is ModelTier.COLD:
            # Level 2 discarded the weights: reallocate them, load them in place, then the KV
            # cache (vLLM's sleep-mode recipe; a bare wake_up would run on empty weights).
            t = self.tier_timeout_s
            await self._call("POST", "/wake_up", params={"tags": "weights"}, timeout=t)
            await self._call(
                "POST", "/collective_rpc", json={"method": "reload_weights"}, timeout=t
            )
            await self._call("POST", "/wake_up", params={"tags": "kv_cache"}, timeout=t)
        elif tier is ModelTier.ACTIVE:
            await self._call("POST", "/wake_up", timeout=self.tier_timeout_s)
        elif tier is ModelTier.WARM and self._tiers.get(model) is ModelTier.COLD:
            # Asleep at level 2, the weights are gone: vLLM cannot bring them back to CPU
            # memory without waking (which needs the GPU memory another model holds). It stays
            # cold, and is woken by the level-2 recipe above (a level-1 sleep asked now would
            # change nothing, and a bare wake_up would then run on empty weights).
            log.debug("%s: %s stays asleep at level 2 (cannot be warmed asleep)", self.name, model)
            return ModelTier.COLD
        else:
            level = 1 if tier is ModelTier.WARM else 2
            # vLLM >= 0.32 aborts what is in flight unless told to wait (``mode``; older
            # servers ignore it): the agent sleeps only a drained instance, and loses nothing.
            params = {"level": level, "mode": "wait"}
            await self._call("POST", "/sleep", params=params, timeout=self.tier_timeout_s)
        for m in self.models:  # one vLLM process: all its served names sleep and wake together
            self._tiers[m] = tier
        return tier

    async def is_sleeping(self) -> bool:
        return bool((await self._call("GET", "/is_sleeping")).json().get("is_sleeping"))

    async def swap_out(self, request_id: str) -> None:
        """Park a running request: its stream ends (vLLM frees its place in the batch; its KV
        blocks stay in vLLM's prefix cache, and with CPU KV offloading, ``--kv-offloading-size``,
        in CPU memory when the GPU needs the room) while ``submit`` goes on waiting;
        ``swap_in`` sends it again as a completion of exactly the prompt's token ids and those
        it wrote, which vLLM finds in its cache instead of computing them again. vLLM has no
        per-request swap API: this is the swap its cache makes possible. Refused
        (``UnsupportedOperation``: evict instead) when the server did not say the request's
        token ids (vLLM before 0.10.2) or it is writing a tool call."""
        flight = self._flights.get(request_id)
        if flight is None or flight.task is None:
            raise UnknownRequest(f"{self.name}: no request {request_id!r} in flight")
        if flight.parked is not None:
            return
        if flight.first_prompt_ids is None or flight.ids is None or flight.calls:
            raise UnsupportedOperation(
                f"{self.name}: {request_id!r} cannot be parked: the server did not say all its "
                "token ids (vLLM 0.10.2 or later does); evict it instead"
            )
        stream = flight.stream
        if stream is None or stream.done():
            return  # it ended meanwhile: ``submit`` returns its output
        flight.parked = asyncio.Event()
        stream.cancel()
        await asyncio.wait({stream})
        if not stream.cancelled():
            flight.parked = None  # it ended before the cancel reached it
            return
        if self._abort_endpoint:  # frees it now, not once vLLM notices the closed stream
            body = {"request_ids": [engine_request_id(flight.request, flight.wire_id)]}
            with contextlib.suppress(EngineError):
                await self._call("POST", "/abort_requests", json=body)

    async def swap_in(self, request_id: str) -> None:
        """Send a parked request again (``swap_out``)."""
        flight = self._flights.get(request_id)
        if flight is None or flight.parked is None:
            raise UnknownRequest(f"{self.name}: no request {request_id!r} parked")
        flight.parked.set()

    def _unparked(self, flight: _Flight) -> EngineRequest | None:
        """The request to send for a parked one: a completion of its prompt's and output's
        token ids, for what is left to write, under a new wire id; None when not every token id
        is known."""
        if (
            flight.first_prompt_ids is None
            or flight.ids is None
            or len(flight.ids) != flight.tokens
        ):
            return None
        origin = flight.origin
        ids = flight.first_prompt_ids + tuple(flight.ids)
        done = flight.tokens
        rid = origin.request_id
        n = self._sent.pop(rid, 1) + 1
        self._sent[rid] = n
        flight.wire_id, flight.base = f"{rid}.{n}", done
        return replace(
            continued_from_ids(origin, ids),
            max_tokens=origin.max_tokens - done,
            output_tokens=None if origin.output_tokens is None else origin.output_tokens - done,
            resumed_tokens=0,
        )

    async def health(self) -> bool:
        """True when ``/health`` answers 200; False when it answers otherwise or the server
        cannot be reached (connection refused or reset); ``EngineTimeout`` when it does not
        answer in time."""
        try:
            resp = await self._client.get("/health")
        except httpx.TimeoutException as exc:
            raise self._failed("GET /health failed", exc) from exc
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def close(self) -> None:
        for rid in list(self._flights):
            with contextlib.suppress(UnknownRequest):
                await self.abort(rid)
        await self._client.aclose()

    # --- internals -----------------------------------------------------------------------------------

    def request_body(self, request: EngineRequest, *, stream: bool = True) -> dict[str, Any]:
        """The JSON this client sends vLLM for ``request`` (to ``/v1/completions`` or
        ``/v1/chat/completions``), streamed or not. A chat sends ``max_tokens``:
        vLLM's chat endpoint reads it whenever ``max_completion_tokens`` (its newer name, which
        older servers ignore) is absent, so it is dropped from the sampling parameters."""
        body: dict[str, Any] = dict(request.sampling)
        body |= {
            "model": request.model,
            "max_tokens": request.max_tokens,
            "priority": request.priority if self._priority else 0,
            "stream": stream,
            # the prompt's and each chunk's token ids (vLLM 0.10.2 on; older servers ignore
            # it): an interrupted request resumes from exactly its tokens
            "return_token_ids": True,
        }
        if stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        if request.messages is not None:
            body.pop("max_completion_tokens", None)
            body["messages"] = [dict(m) for m in request.messages]
            if request.continue_final_message:
                body |= {"continue_final_message": True, "add_generation_prompt": False}
        elif isinstance(request.prompt, tuple):
            body["prompt"] = list(request.prompt)
        elif request.prompt is not None:
            body["prompt"] = request.prompt
        else:
            body["prompt"] = filler_prompt(
                request.request_id, request.prompt_tokens, self.token_ids
            )
        if request.output_tokens is not None:
            body["max_tokens"] = request.tokens_to_generate
            body["ignore_eos"] = True
        return body

    def _priority_refused(self, message: str, sent_priority: int) -> bool:
        """True (and priorities off from now on) when the server refused a request's priority
        because it schedules FCFS: the request is sent again without it. QLM's order does not
        depend on it (requests are pulled in plan order); it only orders what waits inside vLLM."""
        if PRIORITY_OFF not in message or not sent_priority:
            return False
        if self._priority:
            self._priority = False
            log.warning(
                "%s (%s) schedules FCFS: requests are sent without priority (start vLLM with "
                "--scheduling-policy priority, as `qlm instance launch` does, to use it)",
                self.name,
                self.base_url,
            )
        return True

    async def _stream(self, flight: _Flight, on_chunk: ChunkCallback | None) -> EngineOutput:
        while True:
            sent = flight.request.priority if self._priority else 0
            flight.stream = asyncio.create_task(self._stream_once(flight, on_chunk))
            try:
                return await flight.stream
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if flight.parked is None or (current is not None and current.cancelling()):
                    raise
                await flight.parked.wait()  # (an abort meanwhile cancels this wait)
                resumed = self._unparked(flight)
                if resumed is None:  # its tokens are not all known: it ends, aborted
                    flight.aborted = True
                    return flight.partial()
                if resumed.tokens_to_generate <= 0:
                    return flight.output("length")
                flight.request, flight.parked = resumed, None
                continue
            except RequestRejected as exc:
                if self._priority_refused(str(exc), sent):
                    continue
                request = flight.request
                room = context_room(str(exc)) if request.resumed_tokens else None
                if flight.shortened or room is None or not 1 <= room < request.max_tokens:
                    raise
                log.info(
                    "%s: %s resumed past the context (its partial output re-tokenized longer); "
                    "sent again with max_tokens %d instead of %d",
                    self.name,
                    request.request_id,
                    room,
                    request.max_tokens,
                )
                flight.request, flight.shortened = replace(request, max_tokens=room), True

    async def _stream_once(self, flight: _Flight, on_chunk: ChunkCallback | None) -> EngineOutput:
        rid = flight.request.request_id
        path = endpoint_path(flight.request)
        what = f"POST {path}"
        timeout = httpx.Timeout(self.timeout_s, read=None)  # a queued request may wait long
        finish: FinishReason | None = None
        try:
            async with contextlib.AsyncExitStack() as stack:
                async with self._opening:
                    resp = await stack.enter_async_context(
                        self._client.stream(
                            "POST",
                            path,
                            json=self.request_body(flight.request),
                            headers={"X-Request-Id": flight.wire_id},
                            timeout=timeout,
                        )
                    )
                if resp.status_code != 200:
                    await resp.aread()
                    detail = f"{what} answered {resp.status_code}"
                    if resp.status_code in REJECTED:  # the request is at fault, not the server
                        raise RequestRejected(str(self._fail(detail, error_message(resp))))
                    raise self._fail(detail, error_message(resp))
                async for data in sse_data(resp):
                    finish = self._take(flight, json.loads(data), on_chunk) or finish
        except httpx.HTTPError as exc:
            raise self._failed(f"{what} failed for {rid!r}", exc) from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise self._fail(f"{what} sent a bad event for {rid!r}", exc) from exc
        if finish is None:
            raise self._fail(f"{what} ended without a finish reason for {rid!r}", "stream cut")
        return flight.output(finish)

    def _take(
        self, flight: _Flight, event: dict[str, Any], on_chunk: ChunkCallback | None
    ) -> FinishReason | None:
        """Apply one SSE event; returns its finish reason if it has one. An error event (vLLM
        sends one inside the 200 stream when generation fails) or a finish reason other than
        length / stop / abort (vLLM's ``error``) fails this request alone, with vLLM's message:
        the server is up."""
        if "error" in event:
            raise RequestRejected(str(self._fail("the stream sent an error", error_text(event))))
        usage = event.get("usage") or {}
        choices = event.get("choices") or []
        text, ids, prompt_ids, calls, raw = one_token(event, choices) or event_parts(event, choices)
        if prompt_ids and flight.base == 0 and flight.first_prompt_ids is None:
            # (a chat says them on its first chunk, which has no token yet)
            flight.prompt_ids = flight.first_prompt_ids = prompt_ids
        if ids is None and (text or calls):
            flight.ids = None
        elif ids is not None and flight.ids is not None:
            flight.ids.extend(ids)
        flight.add_calls(calls)
        finish = self._finish_reason(raw, choices) if raw else None
        if "completion_tokens" in usage:
            tokens = flight.base + int(usage["completion_tokens"])
        else:
            tokens = flight.tokens + (1 if text or calls else 0)
        if not choices:  # the final usage-only event
            flight.tokens = max(flight.tokens, tokens)
            return None
        flight.parts.append(text)
        flight.tokens = max(flight.tokens, tokens)
        if on_chunk is not None and (text or calls or finish or ids):
            prompt = usage.get("prompt_tokens")
            counted = int(prompt) if isinstance(prompt, int) and prompt > 0 else None
            chunk = TokenChunk(
                flight.request.request_id,
                text,
                flight.tokens,
                finish,
                counted,
                tuple(calls),
                token_ids=ids,
                prompt_token_ids=flight.prompt_ids,
            )
            flight.prompt_ids = None
            on_chunk(chunk)
        return finish

    def _finish_reason(self, raw: object, choices: list[Any]) -> FinishReason:
        finish = FINISH.get(str(raw))
        if finish is None:
            stop = next((c.get("stop_reason") for c in choices if c.get("stop_reason")), None)
            detail = f"finish_reason {raw!r}" + (f" ({stop})" if stop else "")
            raise RequestRejected(str(self._fail("the request ended in error", detail)))
        return finish

    async def latency_totals(self) -> tuple[float, int] | None:
        """The server's own measure of its finished requests: the sum of their end-to-end
        latencies (seconds, from arrival to the last token, as the server timed them) and their
        count, from ``vllm:e2e_request_latency_seconds``; None when it does not export it."""
        families = await self._metrics()
        sums = metric_values(families, "vllm:e2e_request_latency_seconds_sum", self.models)
        counts = metric_values(families, "vllm:e2e_request_latency_seconds_count", self.models)
        if not sums or not counts:
            return None
        return sum(sums), round(sum(counts))

    async def _metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        text = (await self._call("GET", "/metrics")).text
        families: dict[str, list[tuple[dict[str, str], float]]] = {}
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    families.setdefault(sample.name, []).append((sample.labels, sample.value))
        except ValueError as exc:
            raise self._fail("GET /metrics is not Prometheus text", exc) from exc
        return families
