"""Fault injection over the whole service, with faults chosen by a seed.

Two ``qlm controller`` processes (one leads, one stands by), two ``qlm api`` processes and three
``qlm sim-engine serve`` engines share a RabbitMQ global queue (names of this test's own) and a
PostgreSQL schema (of its own). Clients submit a bounded load of requests with SLOs over HTTP
through both APIs (each with an Idempotency-Key; a failed submission is retried, on the other
API first; a few accepted ones are sent again at once, as by a client whose answer was lost),
cancel a few, and poll every result while the run goes on. Meanwhile faults chosen
by ``random.Random(seed)`` strike: ``kill -9`` of the leading controller, of an API and of an
engine (each restarted, the engine and the API on their ports), and broker connection cuts
(``rabbitmqctl close_connection`` of the connections this test's processes named — each is
``qlm-<role> <queue> (pid N)`` — so no other user of the broker is disturbed).

It asserts that every accepted request (the API answered 202) ends exactly once — finished,
failed with a reason, or cancelled; that no output has more tokens than asked; that no
request's result changes after it was first reported final; that the queues are empty at the
end and no process died unasked. It prints the figures: accepted, faults by kind, lost,
duplicated, the longest client-visible outage (every API refusing submissions) and each
take-over time (a leader's kill to the next recorded outcome).

The seed comes from ``QLM_CHAOS_SEED`` (default ``DEFAULT_SEED``); the schedule is printed with
it. Reproduce a run with ``QLM_CHAOS_SEED=N .venv/bin/pytest tests/e2e/test_chaos.py -s``: the
same faults strike in the same order (their exact moments, and so their effects, vary with the
machine). The processes' logs are kept in the test's ``tmp_path`` (printed). Waits poll
conditions with generous deadlines; nothing asserts on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from services import (
    START_S,
    broker_connections,
    broker_names,
    close_connections,
    free_port,
    output,
    postgres_schema,
    queue_messages,
    rabbitmqctl,
    start_api,
    start_process,
    start_sim_engine,
    stop,
)

from qlm.domain import RequestStatus
from qlm.store import RequestRow, Store

pytestmark = [
    pytest.mark.slow,
    pytest.mark.rabbitmq,
    pytest.mark.postgres,
    pytest.mark.timeout(900),  # a run takes 2-3 minutes on 2 cores; slower when shared
]

DEFAULT_SEED = 1
MODEL = "llama-3-8b"
ENGINES = 3
ENGINE_TIME_SCALE = 0.5  # slower than real time: requests last seconds, faults land mid-run
REQUESTS = 600
LOAD_S = 60.0  # submissions spread over this long
MIN_GAP_S = 5.0  # between the scheduled moments of two faults
CANCEL_SHARE = 0.05
RESEND_SHARE = 0.03
SUBMIT_GIVE_UP_S = 120.0  # a client retries a submission this long before giving up
HTTP_TIMEOUT_S = 15.0
POLL_S = 1.0
DRAIN_S = 300.0  # generous: only a stuck request takes this long
SETTLE_S = 60.0
TENANT = "chaos"

KINDS = ("kill-leader", "kill-api", "kill-engine", "cut-broker")
CUT_TARGETS = ("leader", "standby", "api", "all")
FINAL = {"finished", "failed", "cancelled"}
NAME = re.compile(r"^qlm-(?P<role>\S+) (?P<queue>\S+) \(pid (?P<pid>\d+)\)$")


def chaos_seed() -> int:
    raw = os.environ.get("QLM_CHAOS_SEED", "").strip()
    return int(raw) if raw else DEFAULT_SEED


# --- what the seed decides -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float  # after the load started (later if its target is still being restarted)
    kind: str
    target: str  # leader, api0, engine2, or for a cut: leader, standby, api1, all
    pause_s: float  # between a kill and the restart

    def __str__(self) -> str:
        pause = f", restart after {self.pause_s:g} s" if self.kind != "cut-broker" else ""
        return f"t+{self.at_s:5.1f} s  {self.kind} {self.target}{pause}"


def fault_schedule(rng: random.Random) -> list[Fault]:
    """Each kind once, and up to two more of any kind, in a random order at random moments of
    the load (at least ``MIN_GAP_S`` apart)."""
    kinds = [*KINDS, *(rng.choice(KINDS) for _ in range(rng.randint(0, 2)))]
    rng.shuffle(kinds)
    start, end = 0.08 * LOAD_S, 0.7 * LOAD_S  # each restart takes a while: end in the load
    span = end - start - (len(kinds) - 1) * MIN_GAP_S
    offsets = sorted(rng.uniform(0.0, span) for _ in kinds)
    faults = []
    for i, (offset, kind) in enumerate(zip(offsets, kinds, strict=True)):
        if kind == "kill-api":
            target = f"api{rng.randrange(2)}"
        elif kind == "kill-engine":
            target = f"engine{rng.randrange(ENGINES)}"
        elif kind == "cut-broker":
            target = rng.choice(CUT_TARGETS)
            if target == "api":
                target = f"api{rng.randrange(2)}"
        else:
            target = "leader"
        at = round(start + offset + i * MIN_GAP_S, 1)
        faults.append(Fault(at, kind, target, round(rng.uniform(0.5, 4.0), 1)))
    return faults


@dataclass(frozen=True, slots=True)
class Planned:
    """One client request: when it is submitted, to which API first, and whether (and how
    long after its acceptance) the client cancels it."""

    key: str  # its Idempotency-Key
    at_s: float
    api: int
    body: dict[str, Any]
    cancel_after_s: float | None
    resend: bool  # submitted again at once with the same Idempotency-Key


def workload(rng: random.Random, seed: int) -> list[Planned]:
    times = sorted(rng.uniform(0.0, LOAD_S) for _ in range(REQUESTS))
    planned = []
    for i, at in enumerate(times):
        tier = rng.choice(("interactive", "standard", "batch"))
        slo = {
            "interactive": rng.uniform(10.0, 30.0),
            "standard": rng.uniform(30.0, 300.0),
            "batch": rng.uniform(300.0, 3600.0),
        }[tier]
        key = f"chaos-{seed}-{i:04d}"
        body: dict[str, Any] = {
            "model": MODEL,
            "prompt": " ".join(
                rng.choice(("alpha", "beta", "gamma")) for _ in range(rng.randint(4, 400))
            ),
            "max_tokens": rng.randint(8, 256),
            "slo_seconds": round(slo, 2),
            "tier": tier,
            "labels": {"chaos": str(seed), "key": key},
        }
        if rng.random() < 0.3:
            body["ttft_slo_seconds"] = round(min(slo, rng.uniform(1.0, 10.0)), 2)
        cancel = round(rng.uniform(0.0, 2.0), 2) if rng.random() < CANCEL_SHARE else None
        resend = rng.random() < RESEND_SHARE
        planned.append(Planned(key, round(at, 3), i % 2, body, cancel, resend))
    return planned


# --- the service -----------------------------------------------------------------------------


class Service:
    """The processes of one run, restartable; every process ever started is kept for its log."""

    def __init__(self, env: dict[str, str], logs: Path, store: Store, seed: int) -> None:
        self.env = env
        self.logs = logs
        self.store = store
        self.seed = seed
        self.engine_ports = [free_port() for _ in range(ENGINES)]
        self.api_ports = [free_port() for _ in range(2)]
        self.engines: list[subprocess.Popen[bytes] | None] = [None] * ENGINES
        self.apis: list[subprocess.Popen[bytes] | None] = [None, None]
        self.controllers: dict[str, subprocess.Popen[bytes]] = {}
        self.started: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._controllers_started = 0

    @property
    def api_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.api_ports]

    def instances_toml(self) -> str:
        return "".join(
            f'[[instances]]\nname = "e{i}"\nurl = "http://127.0.0.1:{port}"\ngpu = "A100"\n'
            f'models = ["{MODEL}"]\n\n'
            for i, port in enumerate(self.engine_ports)
        )

    def start_engine(self, i: int) -> None:
        proc, _ = start_sim_engine(
            time_scale=ENGINE_TIME_SCALE,
            extra=("--seed", str(self.seed + i)),
            port=self.engine_ports[i],
            log_path=self.logs / f"engine{i}.log",
        )
        self.engines[i] = proc
        self.started.append((f"engine{i}", proc))

    def start_api(self, i: int) -> None:
        proc, _ = start_api(self.env, self.api_ports[i], log_path=self.logs / f"api{i}.log")
        self.apis[i] = proc
        self.started.append((f"api{i}", proc))

    def start_controller(self) -> str:
        name = f"c{self._controllers_started}"
        self._controllers_started += 1
        proc = start_process(
            ["controller"],
            {**self.env, "QLM_CONTROLLER__NAME": name},
            log_path=self.logs / f"{name}.log",
        )
        self.controllers[name] = proc
        self.started.append((name, proc))
        self.wait(
            lambda: any(s.name == name for s in self.store.controller_states()),
            f"controller {name} publishes its state",
            START_S,
        )
        return name

    def leader(self, timeout_s: float = START_S) -> str:
        """The controller that leads: alive, and the one (most recently) publishing an active
        state."""
        found: list[str] = []

        def one_leads() -> bool:
            now = time.time()
            active = [
                s
                for s in self.store.controller_states()
                if s.active
                and now - s.updated_at < 5.0
                and s.name in self.controllers
                and self.controllers[s.name].poll() is None
            ]
            found[:] = [s.name for s in sorted(active, key=lambda s: -s.updated_at)]
            return len(found) == 1

        try:
            self.wait(one_leads, "exactly one controller leads", timeout_s)
        except pytest.fail.Exception:
            if not found:
                raise
        return found[0]

    def wait(self, check: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout_s:g} s waiting until {what}\n{self.tails()}")
            time.sleep(0.2)

    def alive(self) -> list[tuple[str, subprocess.Popen[bytes]]]:
        procs = [(f"engine{i}", p) for i, p in enumerate(self.engines) if p is not None]
        procs += [(f"api{i}", p) for i, p in enumerate(self.apis) if p is not None]
        return procs + list(self.controllers.items())

    def tails(self, chars: int = 2500) -> str:
        return "\n".join(
            f"--- {name} (pid {p.pid}, exit {p.poll()}) ---\n{output(p)[-chars:]}"
            for name, p in self.started
        )

    def stop_all(self) -> None:
        for _, proc in self.started:
            stop(proc)


def kill(proc: subprocess.Popen[bytes]) -> float:
    """``kill -9``; the moment it was sent."""
    at = time.time()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return at


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Record:
    """What the clients saw."""

    attempts: list[tuple[int, float, bool]] = field(default_factory=list)  # api, when, accepted
    accepted: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # key: ids
    gave_up: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # a 4xx other than 429: the test is wrong
    first_final: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    final_seen_at: dict[str, float] = field(default_factory=dict)
    changed: list[str] = field(default_factory=list)
    cancels: Counter[str] = field(default_factory=Counter)
    faults: list[str] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    t0: float = 0.0  # when the load began
    replayed: int = 0  # 202s that were an earlier attempt's request (Idempotency-Key)
    resent: int = 0  # accepted submissions sent again on purpose
    lost: int = 0
    duplicated: int = 0
    kills_of_leader: list[float] = field(default_factory=list)

    def observe(self, item: dict[str, Any], asked_at: float) -> None:
        """A request as an API reported it, to a call sent at ``asked_at``: remember its first
        final result, and note any later report that differs (a final result must never
        change, nor go back to running). Only a call sent after the first final result came
        back is compared: one sent before may have read the store before it (a list crossing
        a cancel's answer)."""
        rid = item["id"]
        output = item.get("output") or {}
        seen = (item["status"], output.get("text", ""), int(output.get("tokens", 0)))
        first = self.first_final.get(rid)
        if first is None:
            if seen[0] in FINAL:
                self.first_final[rid] = seen
                self.final_seen_at[rid] = time.time()
        elif seen != first and asked_at > self.final_seen_at[rid]:
            self.changed.append(
                f"{rid}: first {first[0]} {first[2]} tokens, later {seen[0]} {seen[2]}"
            )


async def run_clients(
    service: Service, planned: list[Planned], record: Record, key: str, t0: float
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    urls = service.api_urls
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=40)
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, headers=headers, limits=limits) as http:

        async def call(api: int, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
            try:
                return await http.request(method, urls[api] + path, **kwargs)
            except httpx.HTTPError:
                return None

        async def post(p: Planned, api: int) -> str | None:
            """Submit until an API accepts (the other API first after a failure); the id."""
            give_up = time.monotonic() + SUBMIT_GIVE_UP_S
            backoff = 0.1
            while True:
                answer = await call(
                    api, "POST", "/v1/requests", json=p.body, headers={"Idempotency-Key": p.key}
                )
                ok = answer is not None and answer.status_code in (200, 202)
                record.attempts.append((api, time.time(), ok))
                if ok and answer is not None:
                    answered = answer.json()
                    record.accepted[p.key].add(answered["id"])
                    record.replayed += bool(answered.get("replayed"))
                    return str(answered["id"])
                if (
                    answer is not None
                    and 400 <= answer.status_code < 500
                    and answer.status_code != 429
                ):
                    record.refused.append(f"{p.key}: {answer.status_code} {answer.text[:300]}")
                    return None
                if time.monotonic() > give_up:
                    record.gave_up.append(p.key)
                    return None
                api = 1 - api
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)

        async def submit(p: Planned) -> None:
            await asyncio.sleep(max(0.0, t0 + p.at_s - time.time()))
            rid = await post(p, p.api)
            if rid is None:
                return
            if p.resend:  # as a client whose answer was lost: the same call to the other API
                record.resent += 1
                await post(p, 1 - p.api)
            api = p.api
            if p.cancel_after_s is None:
                return
            await asyncio.sleep(p.cancel_after_s)
            give_up = time.monotonic() + SUBMIT_GIVE_UP_S
            while time.monotonic() < give_up:
                asked_at = time.time()
                answer = await call(api, "DELETE", f"/v1/requests/{rid}")
                if answer is not None and answer.status_code in (200, 202, 409):
                    record.cancels[str(answer.status_code)] += 1
                    if answer.status_code == 200:
                        record.observe(answer.json(), asked_at)  # cancelled: final
                    return
                if answer is not None and 400 <= answer.status_code < 500:
                    record.refused.append(f"cancel {rid}: {answer.status_code} {answer.text[:300]}")
                    return
                api = 1 - api
                await asyncio.sleep(0.5)
            record.cancels["gave up"] += 1

        await asyncio.gather(*(submit(p) for p in planned))


async def poll_results(service: Service, record: Record, key: str, stop: asyncio.Event) -> None:
    """List this tenant's requests through the APIs (alternately) every ``POLL_S`` while the
    run goes on, and once more after ``stop`` is set."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, headers=headers) as http:
        api = 0
        while True:
            last = stop.is_set()
            cursor: str | None = None
            complete = True
            while True:
                params: dict[str, Any] = {"limit": 1000}
                if cursor:
                    params["cursor"] = cursor
                asked_at = time.time()
                try:
                    answer = await http.get(f"{service.api_urls[api]}/v1/requests", params=params)
                except httpx.HTTPError:
                    answer = None
                if answer is None or answer.status_code != 200:
                    complete = False
                    break
                page = answer.json()
                for item in page["data"]:
                    record.observe(item, asked_at)
                cursor = page.get("next_cursor")
                if not cursor:
                    break
            api = 1 - api
            if last and complete:
                return
            if not last:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), POLL_S)
            else:
                await asyncio.sleep(0.5)


def inject(
    service: Service, faults: list[Fault], record: Record, t0: float, ctl: list[str], queue: str
) -> None:
    """Strike each fault at its moment, in a thread. A killed process is restarted after the
    fault's pause in the background. A fault waits for the restart of the process it strikes,
    and a fault on a controller or an API for the restart of any other, so that one of each
    kind is always up (or starting) when a fault strikes: a test of the service, not of how
    long a process takes to start (an API took 20 s on this machine under load)."""
    restarting: dict[str, Future[None]] = {}

    def after(pause_s: float, start: Callable[[], object]) -> None:
        time.sleep(pause_s)
        start()

    def group(target: str) -> str:
        """What a fault on ``target`` waits for."""
        if target in ("leader", "standby"):
            return "controllers"
        return "apis" if target.startswith("api") else target

    def ready(*targets: str) -> None:
        for target in targets:
            pending = restarting.pop(target, None)
            if pending is not None:
                pending.result()

    with ThreadPoolExecutor(4) as pool:
        for fault in faults:
            time.sleep(max(0.0, t0 + fault.at_s - time.time()))
            ready(group(fault.target))
            started = time.time() - t0
            in_flight = len(record.accepted) - len(record.first_final)  # about: a figure
            if fault.kind == "kill-leader":
                name = service.leader()
                record.kills_of_leader.append(kill(service.controllers.pop(name)))
                restarting["controllers"] = pool.submit(
                    after, fault.pause_s, service.start_controller
                )
                what = f"killed leader {name}"
            elif fault.kind == "kill-api":
                i = int(fault.target[3:])
                proc = service.apis[i]
                assert proc is not None
                kill(proc)
                restarting["apis"] = pool.submit(
                    after, fault.pause_s, lambda i=i: service.start_api(i)
                )
                what = f"killed {fault.target}"
            elif fault.kind == "kill-engine":
                i = int(fault.target[6:])
                proc = service.engines[i]
                assert proc is not None
                kill(proc)
                restarting[fault.target] = pool.submit(
                    after, fault.pause_s, lambda i=i: service.start_engine(i)
                )
                what = f"killed {fault.target}"
            else:
                what = cut(service, fault.target, ctl, queue)
            record.kinds[fault.kind] += 1
            record.faults.append(
                f"t+{started:5.1f} s  {fault.kind}: {what} ({in_flight} in flight)"
            )
            print(record.faults[-1], flush=True)
        ready(*list(restarting))


def cut(service: Service, target: str, ctl: list[str], queue: str) -> str:
    """Close, from the broker's side, the connections of ``target``'s processes on this test's
    queue (``all``: every process of the test)."""
    if target == "leader":
        leader = service.leader()
        pids = {service.controllers[leader].pid}
        who = f"leader {leader}"
    elif target == "standby":
        leader = service.leader()
        pids = {p.pid for n, p in service.controllers.items() if n != leader}
        who = "standby " + ",".join(n for n in service.controllers if n != leader)
    elif target.startswith("api"):
        proc = service.apis[int(target[3:])]
        assert proc is not None
        pids = {proc.pid}
        who = target
    else:
        pids = {p.pid for _, p in service.alive()}
        who = "every process"
    ours = []
    for broker_pid, name in broker_connections(ctl):
        named = NAME.match(name)
        if named and named["queue"] == queue and int(named["pid"]) in pids:
            ours.append((broker_pid, named["role"]))
    closed = close_connections(ctl, [pid for pid, _ in ours], "qlm chaos test")
    roles = ",".join(sorted(role for _, role in ours)) or "none"
    return f"closed {closed} connection(s) of {who} ({roles})"


def longest_outage(attempts: list[tuple[int, float, bool]]) -> tuple[float, float]:
    """The longest time during which every API refused submissions, and when it began: each
    API is down from a failed attempt until its next accepted one; the longest overlap of the
    two."""
    spans: list[list[tuple[float, float]]] = []
    end = max((at for _, at, _ in attempts), default=0.0)
    for api in (0, 1):
        down: list[tuple[float, float]] = []
        since: float | None = None
        for _, at, ok in sorted(a for a in attempts if a[0] == api):
            if not ok and since is None:
                since = at
            elif ok and since is not None:
                down.append((since, at))
                since = None
        if since is not None:
            down.append((since, end))
        spans.append(down)
    overlaps = [
        (min(a1, b1) - max(a0, b0), max(a0, b0))
        for a0, a1 in spans[0]
        for b0, b1 in spans[1]
        if max(a0, b0) < min(a1, b1)
    ]
    return max(overlaps, default=(0.0, 0.0))


def all_rows(store: Store) -> list[RequestRow]:
    rows: list[RequestRow] = []
    cursor: str | None = None
    while True:
        page, cursor = store.list_requests(tenant=TENANT, limit=1000, cursor=cursor)
        rows += page
        if cursor is None:
            return rows


def tokens_in(text: str | None) -> int:
    """Output tokens as the simulated engine writes them: whitespace-separated words."""
    return len((text or "").split())


def takeover_times(record: Record, rows: dict[str, RequestRow]) -> list[str]:
    """For each kill of the leader: the time to the next outcome recorded (by the standby)."""
    times = []
    for at in record.kills_of_leader:
        after = [
            r.finished_at
            for r in rows.values()
            if r.status is RequestStatus.FINISHED and r.finished_at and r.finished_at > at
        ]
        times.append(f"{min(after) - at:.1f} s" if after else "none")
    return times


def brief(row: RequestRow | None) -> str:
    if row is None:
        return "not in the store"
    return (
        f"{row.id} {row.status.name.lower()} max_tokens {row.max_tokens} "
        f"output_tokens {row.output_tokens} ({tokens_in(row.output_text)} in its text) "
        f"attempts {row.attempts} evictions {row.evictions} instance {row.instance} "
        f"error {row.error!r}"
    )


def judge(
    record: Record,
    rows: dict[str, RequestRow],
    left: dict[str, tuple[int, int]],
    died: list[str],
) -> tuple[list[str], list[str]]:
    """The figures of a run and what went wrong in it."""
    accepted = {rid for ids in record.accepted.values() for rid in ids}
    lost = sorted(rid for rid in accepted if rid not in rows or not rows[rid].status.is_final)
    twice = {k: sorted(ids) for k, ids in record.accepted.items() if len(ids) > 1}
    changed = list(record.changed)
    for rid, first in record.first_final.items():
        row = rows.get(rid)
        if row is not None:
            now = (row.status.name.lower(), row.output_text or "", row.output_tokens)
            if now != first:
                changed.append(
                    f"{rid}: first {first[0]} {first[2]} tokens, store {now[0]} {now[2]}"
                )
    unseen = sorted(
        rid
        for rid in accepted
        if rid in rows and rows[rid].status.is_final and rid not in record.first_final
    )
    over = [
        brief(r)
        for r in rows.values()
        if r.output_tokens > r.max_tokens or tokens_in(r.output_text) > r.max_tokens
    ]
    miscounted = [brief(r) for r in rows.values() if tokens_in(r.output_text) != r.output_tokens]
    reasonless = [r.id for r in rows.values() if r.status is RequestStatus.FAILED and not r.error]
    unaccepted = [r for r in rows.values() if r.id not in accepted]
    stuck = [r.id for r in unaccepted if not r.status.is_final]
    mine = [rows[rid] for rid in accepted if rid in rows]
    statuses = Counter(r.status.name.lower() for r in mine)
    failures = Counter((r.error or "")[:80] for r in mine if r.status is RequestStatus.FAILED)
    again = sum(r.attempts > 1 for r in mine)
    record.lost = len(lost)
    record.duplicated = len(twice) + len(changed)
    takeovers = takeover_times(record, rows)
    outage, since = longest_outage(record.attempts)
    figures = [
        f"accepted         {len(accepted)} ({dict(statuses)}; {again} dispatched more than once)",
        f"not accepted     {len(record.gave_up)} gave up, {len(record.refused)} refused; "
        f"{record.replayed} answered as an earlier attempt's request "
        f"({record.resent} accepted ones sent again on purpose)",
        f"cancels answered {dict(record.cancels)}",
        f"faults           {dict(record.kinds)}",
        f"lost             {len(lost)}",
        f"duplicated       {record.duplicated} ({len(twice)} keys accepted as two requests, "
        f"{len(changed)} results changed after final)",
        f"over max_tokens  {len(over)}; text and token count differ: {len(miscounted)}",
        f"failed           {dict(failures)}",
        f"unconfirmed      {len(unaccepted)} in the store though no API answered 202 "
        f"({len(stuck)} not final)",
        f"longest outage   {outage:.1f} s (every API refusing)"
        + (f" from t+{since - record.t0:.1f} s" if outage else ""),
        f"take-over        {', '.join(takeovers) or '-'} (leader kill to next outcome)",
        f"queues left      {left} (ready, un-acked)",
    ]
    problems = []
    if record.refused:
        problems.append(f"valid calls refused: {record.refused[:5]}")
    if lost:
        problems.append(
            f"{len(lost)} accepted requests did not end: {[brief(rows.get(r)) for r in lost[:5]]}"
        )
    if twice:
        problems.append(
            f"one Idempotency-Key accepted as several requests: {list(twice.items())[:5]}"
        )
    if changed:
        problems.append(f"results changed after they were reported final: {changed[:5]}")
    if unseen:
        problems.append(f"{len(unseen)} final requests no API reported final: {unseen[:5]}")
    if over:
        problems.append(f"{len(over)} outputs over max_tokens: {over[:5]}")
    if miscounted:
        problems.append(
            f"{len(miscounted)} outputs whose text is not their token count: {miscounted[:5]}"
        )
    if reasonless:
        problems.append(f"failed without a reason: {reasonless[:5]}")
    if stuck:
        problems.append(f"stored requests (not accepted) that did not end: {stuck[:5]}")
    if any(sum(n) for n in left.values()):
        problems.append(f"messages left in the queues: {left}")
    if died:
        problems.append(f"processes died unasked: {died}")
    return figures, problems


@pytest.fixture
def schema_url(postgres_url: str) -> Iterator[str]:
    with postgres_schema(postgres_url) as url:
        yield url


@pytest.fixture
def names(amqp_url: str) -> Iterator[dict[str, str]]:
    with broker_names(amqp_url) as names:
        yield names


def test_faults_chosen_by_a_seed_lose_duplicate_and_change_nothing(
    amqp_url: str, schema_url: str, names: dict[str, str], tmp_path: Path
) -> None:
    began = time.monotonic()
    seed = chaos_seed()
    ctl = rabbitmqctl()
    faults = fault_schedule(random.Random(f"faults-{seed}"))
    planned = workload(random.Random(f"load-{seed}"), seed)
    logs = tmp_path / "logs"
    logs.mkdir()
    print(f"\nchaos seed {seed}: reproduce with")
    print(f"  QLM_CHAOS_SEED={seed} .venv/bin/pytest tests/e2e/test_chaos.py -s")
    print(f"{len(planned)} requests over {LOAD_S:g} s, faults:")
    for fault in faults:
        print(f"  {fault}")
    print(f"logs: {logs}", flush=True)

    store = Store.open(schema_url)
    key = store.create_api_key(TENANT, name="chaos test")
    instances = tmp_path / "instances.toml"
    env = {
        "QLM_BROKER_URL": amqp_url,
        "QLM_BROKER__QUEUE": names["queue"],
        "QLM_BROKER__DEAD_LETTER_EXCHANGE": names["dead_letter_exchange"],
        "QLM_BROKER__DEAD_LETTER_QUEUE": names["dead_letter_queue"],
        "QLM_DATABASE_URL": schema_url,
        "QLM_INSTANCES_FILE": str(instances),
    }
    service = Service(env, logs, store, seed)
    instances.write_text(service.instances_toml())
    record = Record()
    try:
        with ThreadPoolExecutor(ENGINES + 2) as pool:
            for started in [pool.submit(service.start_engine, i) for i in range(ENGINES)]:
                started.result()
            service.start_controller()  # the first consumer leads
            service.start_controller()
            for started in [pool.submit(service.start_api, i) for i in range(2)]:
                started.result()
        service.wait(
            lambda: len(store.instances()) == ENGINES, "the controller knows the engines", START_S
        )
        print(f"service up in {time.monotonic() - began:.0f} s", flush=True)

        async def run() -> None:
            t0 = record.t0 = time.time()
            stop_polling = asyncio.Event()
            poller = asyncio.create_task(poll_results(service, record, key, stop_polling))
            injector = asyncio.create_task(
                asyncio.to_thread(inject, service, faults, record, t0, ctl, names["queue"])
            )
            await run_clients(service, planned, record, key, t0)
            await injector
            accepted = {rid for ids in record.accepted.values() for rid in ids}
            deadline = time.monotonic() + DRAIN_S
            while len(await asyncio.to_thread(store.final_ids, accepted)) < len(accepted):
                if time.monotonic() > deadline or poller.done():
                    break
                await asyncio.sleep(1.0)
            stop_polling.set()
            await asyncio.wait_for(poller, 120.0)

        asyncio.run(run())
        load_done = time.monotonic()

        queues = [names["queue"], names["dead_letter_queue"]]
        deadline = time.monotonic() + SETTLE_S
        left = queue_messages(ctl, queues)
        while any(sum(n) for n in left.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
            left = queue_messages(ctl, queues)

        rows = {row.id: row for row in all_rows(store)}
        died = [f"{name} (exit {p.poll()})" for name, p in service.alive() if p.poll() is not None]
        figures, problems = judge(record, rows, left, died)
        run_s = time.monotonic() - began
        print(f"\nchaos seed {seed}: figures")
        for line in figures:
            print(f"  {line}")
        up_to_drained = load_done - began
        print(
            f"  run              {run_s:.0f} s (until every request ended: {up_to_drained:.0f} s)"
        )
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(record.kinds.items()))
        takeovers = ", ".join(takeover_times(record, rows)) or "-"
        print(
            f"  table row: | {seed} | {len(record.accepted)} | {kinds} | {record.lost} | "
            f"{record.duplicated} | {longest_outage(record.attempts)[0]:.1f} s | {takeovers} | "
            f"{run_s:.0f} s |",
            flush=True,
        )
        if problems:
            pytest.fail(
                f"chaos seed {seed}:\n"
                + "\n".join(problems)
                + "\nfaults:\n"
                + "\n".join(record.faults)
                + f"\nlogs in {logs}\n{service.tails()}"
            )
        assert len(record.accepted) >= len(planned) // 2, "too little load went through to judge"
    finally:
        service.stop_all()
        store.close()
