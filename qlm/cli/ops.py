"""The operator CLI, ``qlm ops``: what a running QLM's admin endpoints show, as tables — virtual
queues with their groups (``--watch`` redraws them), groups and one group's requests and
tenants, instances and the requests each runs, plans, controllers, one request — and the
steering they allow (drain, undrain); ``qlm ops report`` is the SLO-attainment report a nightly
job runs (docs/operations.md), computed by ``qlm.reports``. It talks to the REST API with an
admin key (``qlm keys create --tenant ops --admin``); ``--json``, before or after the command,
prints what the API answered instead of tables. Every number is printed with its unit.

The tables are built by pure functions of the API's answer (``queues_view``, ``group_view``,
...), so that their wording is tested without a server.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console, RenderableType
from rich.table import Table

ops_app = typer.Typer(
    help="Inspect and steer a running QLM through its admin endpoints (docs/operations.md).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
console = Console(soft_wrap=True, highlight=False)
err_console = Console(stderr=True, soft_wrap=True, highlight=False)

JsonOption = Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of tables.")]


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    key: str | None
    raw: bool


def _fail(message: str) -> NoReturn:
    err_console.print(f"error: {message}", markup=False)
    raise typer.Exit(1)


def _call(target: Target, method: str, path: str, params: Mapping[str, Any] | None = None) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {target.key}"} if target.key else {}
    try:
        with httpx.Client(base_url=target.url, timeout=30.0) as c:
            resp = c.request(method, path, params=params, headers=headers)
    except httpx.HTTPError as exc:
        _fail(
            f"cannot reach QLM at {target.url} ({type(exc).__name__}: {exc}); is `qlm serve` "
            "or `qlm api` running there? Give its address with --url or QLM_URL"
        )
    if resp.status_code >= 400:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:200]
        hint = " (give an admin key: --key or QLM_KEY)" if resp.status_code in (401, 403) else ""
        _fail(f"{method} {path} answered {resp.status_code}: {message}{hint}")
    return resp.json()


def _target(ctx: typer.Context, as_json: bool = False) -> Target:
    target = ctx.obj
    assert isinstance(target, Target)
    return Target(target.url, target.key, True) if as_json else target


DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def default_url(env: Mapping[str, str]) -> str:
    """Where ``qlm serve`` and ``qlm api`` listen with the same environment: ``QLM_API__HOST``
    and ``QLM_API__PORT`` (read here without the settings, which are slow to import), a
    wildcard host reached on the loopback address."""
    host = env.get("QLM_API__HOST", "").strip() or DEFAULT_HOST
    port = env.get("QLM_API__PORT", "").strip() or str(DEFAULT_PORT)
    if host in ("0.0.0.0", "::", "[::]"):
        host = DEFAULT_HOST
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


@ops_app.callback()
def ops_main(
    ctx: typer.Context,
    url: Annotated[
        str | None,
        typer.Option(
            envvar="QLM_URL",
            help="The QLM REST API (QLM_URL; default: where qlm serve and qlm api listen, "
            "http://127.0.0.1:8080 unless QLM_API__HOST or QLM_API__PORT say otherwise).",
            show_default=False,
        ),
    ] = None,
    key: Annotated[
        str | None,
        typer.Option(
            envvar=["QLM_KEY", "QLM_API_KEY"],
            help="An admin API key (QLM_KEY; QLM_API_KEY is read too).",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Inspect and steer a running QLM through its admin endpoints."""
    url = url or default_url(os.environ)
    if not re.match(r"^https?://", url):
        _fail(f"--url (QLM_URL) must start with http:// or https://, got {url!r}")
    ctx.obj = Target(url.rstrip("/"), key or None, as_json)


def _print_json(data: Any) -> None:
    console.print(json.dumps(data, indent=2, sort_keys=True), markup=False)


def _fetch(
    ctx: typer.Context,
    method: str,
    path: str,
    params: Mapping[str, Any] | None = None,
    as_json: bool = False,
) -> Any:
    """The API's answer; None once printed as it is (``--json``)."""
    target = _target(ctx, as_json)
    doc = _call(target, method, path, params)
    if target.raw:
        _print_json(doc)
        return None
    return doc


def _show(views: Sequence[RenderableType]) -> None:
    for view in views:
        console.print(view)


# --- formatting: pure functions of the API's answers ----------------------------------------------


def _in(at: float | None, now: float | None) -> str:
    """A time as seconds from ``now`` ("in 12 s", "3 s ago")."""
    if at is None or now is None:
        return "-"
    d = at - now
    return f"in {d:,.0f} s" if d >= 0 else f"{-d:,.0f} s ago"


def _p(p: float | None) -> str:
    """A probability as a percentage."""
    return "-" if p is None else f"{100.0 * p:.0f} %"


def _n(count: int, unit: str) -> str:
    """``3 requests``, ``1 request``."""
    return f"{count:,} {unit if count == 1 else unit + 's'}"


def risk(group: Mapping[str, Any]) -> str:
    """What a group's risk column says: its requests already past their deadline ("missed"),
    else whether it is predicted to miss its SLO ("at risk"); ", deferred" when the latest
    plan's admission put it behind the others."""
    missed = int(group.get("missed") or 0)
    said = f"{missed:,} missed" if missed else "at risk" if group.get("at_risk") else ""
    if group.get("deferred"):
        said = f"{said}, deferred" if said else "deferred"
    return said


def _group_table(title: str, groups: Sequence[Mapping[str, Any]], now: float | None) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("queue")
    table.add_column("pos", justify="right")
    for col in ("group", "model", "tier"):
        table.add_column(col)
    table.add_column("requests", justify="right")
    table.add_column("deadline (earliest)")
    table.add_column("completion (predicted)")
    table.add_column("P(meet SLO)", justify="right")
    table.add_column("risk")
    for g in groups:
        table.add_row(
            str(g.get("instance") or "-"),
            str(g.get("position", "-")),
            str(g["id"]),
            str(g["model"]),
            str(g["tier"]),
            f"{g['size']:,}",
            _in(g.get("earliest_deadline_at"), now),
            _in(g.get("predicted_completion_at"), now),
            _p(g.get("p_meet_slo")),
            risk(g),
        )
    return table


def _stale(doc: Mapping[str, Any]) -> str:
    at = doc.get("at")
    if at is None:
        return "no controller has published its state yet"
    return f"controller {doc.get('controller')}, state of {time.time() - at:,.1f} s ago"


QUEUES_LEGEND = (
    "at risk: requests not past their deadline in groups the planner's model gives, now, less "
    "than Δ of meeting their SLO; every group in the queue counts, deferred and not yet planned "
    "ones too (qlm ops plans counts groups instead: the planned ones each plan left at risk when "
    "it was made). missed: requests past their deadline. deferred: put behind the others by the "
    "latest plan's admission, served as capacity allows."
)


def queue_title(q: Mapping[str, Any], now: float | None) -> str:
    """``i0: 12 requests in 3 groups; at risk now: 2 groups (1 deferred), 4 requests; missed:
    2 requests; drained in 30 s``: the groups at risk, how many of them the latest plan
    deferred, and their requests not past their deadline yet; then the requests past it."""
    groups = q.get("groups") or []
    missed = int(q.get("missed_requests") or 0)
    risky = [g for g in groups if g.get("at_risk")]
    deferred = sum(1 for g in risky if g.get("deferred"))
    at_risk = sum(int(g["size"]) - int(g.get("missed") or 0) for g in risky)
    return (
        f"{q['instance']}: {_n(int(q['size']), 'request')} in {_n(len(groups), 'group')}; "
        f"at risk now: {_n(len(risky), 'group')} ({deferred:,} deferred), "
        f"{_n(at_risk, 'request')}; missed: {_n(missed, 'request')}; "
        f"drained {_in(q.get('predicted_drain_at'), now)}"
    )


def queues_view(doc: Mapping[str, Any]) -> list[RenderableType]:
    """``GET /v1/admin/queues`` as a line on the state's age, a table per virtual queue and
    the legend of its counts."""
    out: list[RenderableType] = [f"{_stale(doc)}; policy {doc.get('policy') or '-'}"]
    now = doc.get("at")
    for q in doc["queues"]:
        title = queue_title(q, now)
        out.append(_group_table(title, q["groups"], now) if q["groups"] else f"{title}: empty")
    if not doc["queues"]:
        out.append("no virtual queues")
    else:
        out.append(QUEUES_LEGEND)
    return out


def _watch(
    fetch: Callable[[], Any],
    view: Callable[[Any], list[RenderableType]],
    *,
    raw: bool,
    interval: float,
    count: int | None,
) -> None:
    """Fetch and show every ``interval`` seconds, ``count`` times (until Ctrl-C without): in a
    terminal the screen is redrawn, else each round follows the last (with ``--json`` one JSON
    object per line)."""
    shown = 0
    try:
        while True:
            doc = fetch()
            if raw:
                console.print(json.dumps(doc, sort_keys=True), markup=False)
            else:
                if console.is_terminal:
                    console.clear()
                console.print(f"{time.strftime('%H:%M:%S')}, every {interval:g} s (Ctrl-C to stop)")
                _show(view(doc))
            shown += 1
            if count is not None and shown >= count:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        return


WatchOption = Annotated[
    bool, typer.Option("--watch", "-w", help="Redraw every --interval until Ctrl-C.")
]
IntervalOption = Annotated[
    float, typer.Option(min=0.1, max=3600.0, help="Seconds between redraws (--watch).")
]
CountOption = Annotated[
    int | None, typer.Option(min=1, help="Stop after this many draws (--watch).")
]


def _show_or_watch(
    ctx: typer.Context,
    path: str,
    params: Mapping[str, Any] | None,
    view: Callable[[Any], list[RenderableType]],
    *,
    as_json: bool,
    watch: bool,
    interval: float,
    count: int | None,
) -> None:
    """``GET path`` shown by ``view`` once, or redrawn (``--watch``, or ``--count``)."""
    target = _target(ctx, as_json)
    if watch or count is not None:
        _watch(
            lambda: _call(target, "GET", path, params),
            view,
            raw=target.raw,
            interval=interval,
            count=count,
        )
        return
    doc = _fetch(ctx, "GET", path, params, as_json=as_json)
    if doc is not None:
        _show(view(doc))


@ops_app.command("queues")
def queues_cmd(
    ctx: typer.Context,
    watch: WatchOption = False,
    interval: IntervalOption = 2.0,
    count: CountOption = None,
    as_json: JsonOption = False,
) -> None:
    """The virtual queue of every instance: its groups in order, their predicted completion and
    risk (requests past their deadline: missed)."""
    _show_or_watch(
        ctx, "/v1/admin/queues", None, queues_view,
        as_json=as_json, watch=watch, interval=interval, count=count,
    )  # fmt: skip


def groups_view(doc: Mapping[str, Any]) -> list[RenderableType]:
    """``GET /v1/admin/groups``: the state's age and one table of groups."""
    return [_stale(doc), _group_table(_n(len(doc["data"]), "group"), doc["data"], doc.get("at"))]


@ops_app.command("groups")
def groups_cmd(
    ctx: typer.Context,
    at_risk: Annotated[bool, typer.Option("--at-risk", help="Only groups at risk.")] = False,
    watch: WatchOption = False,
    interval: IntervalOption = 2.0,
    count: CountOption = None,
    as_json: JsonOption = False,
) -> None:
    """Every request group, across the virtual queues, most urgent deadline first (qlm ops
    group ID: one of them)."""
    _show_or_watch(
        ctx, "/v1/admin/groups", {"at_risk": True} if at_risk else None, groups_view,
        as_json=as_json, watch=watch, interval=interval, count=count,
    )  # fmt: skip


def _request_state(r: Mapping[str, Any]) -> str:
    if r.get("missed"):
        return "missed"
    return "at risk" if r.get("at_risk") else ""


def group_view(doc: Mapping[str, Any]) -> list[RenderableType]:
    """``GET /v1/admin/groups/{id}``: the group, its tenants, its requests."""
    g, now = doc["group"], doc.get("at")
    head = Table(title=f"group {g['id']}", title_justify="left", show_header=False)
    head.add_column("field")
    head.add_column("value")
    tenants = g.get("tenants") or {}
    rows = [
        ("queue / position", f"{g.get('instance') or '-'} / {g.get('position', '-')}"),
        ("model / tier / SLO class", f"{g['model']} / {g['tier']} / {g.get('slo_class') or '-'}"),
        ("requests", f"{g['size']:,} of {_n(len(tenants), 'tenant')}"),
        ("deadlines", f"{_in(g.get('earliest_deadline_at'), now)} (earliest), "
            f"{_in(g.get('latest_deadline_at'), now)} (latest)"),
        ("completion (predicted)", _in(g.get("predicted_completion_at"), now)),
        ("P(meet SLO)", _p(g.get("p_meet_slo"))),
        ("risk", risk(g) or "none"),
    ]  # fmt: skip
    for name, value in rows:
        head.add_row(name, value)
    out: list[RenderableType] = [_stale(doc), head]
    if tenants:
        by_tenant = Table(title="tenants", title_justify="left")
        by_tenant.add_column("tenant")
        by_tenant.add_column("requests", justify="right")
        for tenant, n in tenants.items():
            by_tenant.add_row(tenant, f"{n:,}")
        out.append(by_tenant)
    listed = int(doc.get("listed") or 0)
    shown = "" if listed >= int(g["size"]) else f" (the first {listed:,} of {g['size']:,})"
    out.append(_requests_table(f"requests, FCFS{shown}", doc["requests"], now, running=False))
    return out


def _requests_table(
    title: str, requests: Sequence[Mapping[str, Any]], now: float | None, *, running: bool
) -> Table:
    """Requests waiting in a group, or running on an instance (with their tokens so far and
    their own predicted completion)."""
    table = Table(title=title, title_justify="left")
    # Ids are what an operator copies into the next command: never cut.
    table.add_column("request", min_width=max((len(r["id"]) for r in requests), default=7))
    table.add_column("tenant")
    if not running:
        table.add_column("status")
    table.add_column("running (s)" if running else "waited (s)", justify="right")
    table.add_column("deadline")
    if running:
        table.add_column("completion (predicted while queued)")
        table.add_column("tokens (so far)", justify="right")
    table.add_column("state")
    for r in requests:
        since = r.get("dispatched_at") if running else r.get("submitted_at")
        row = [r["id"], r["tenant"]] + ([] if running else [r["status"]])
        row += [
            "-" if since is None or now is None else f"{now - since:,.1f}",
            _in(r.get("deadline_at"), now),
        ]
        if running:
            row += [_in(r.get("predicted_completion_at"), now), f"{r.get('tokens', 0):,}"]
        table.add_row(*row, _request_state(r))
    return table


@ops_app.command("group")
def group_cmd(
    ctx: typer.Context,
    group_id: Annotated[str, typer.Argument(help="Group id (qlm ops groups).")],
    as_json: JsonOption = False,
) -> None:
    """One group: where it is, its tenants, its requests and their deadlines."""
    doc = _fetch(ctx, "GET", f"/v1/admin/groups/{group_id}", as_json=as_json)
    if doc is not None:
        _show(group_view(doc))


def instances_view(doc: Mapping[str, Any]) -> Table:
    """``GET /v1/admin/instances`` as a table."""
    table = Table(title=_n(len(doc["data"]), "instance"), title_justify="left")
    for col in ("name", "state", "health", "GPUs", "models (tier)"):
        table.add_column(col)
    table.add_column("running / max (requests)", justify="right")
    table.add_column("url")
    for i in doc["data"]:
        tiers = i.get("tiers") or {}
        models = ", ".join(f"{m} ({tiers.get(m, '?')})" for m in i["models"])
        up = i.get("up")
        running = "-" if i.get("outstanding") is None else f"{i['outstanding']:,}"
        if i.get("max_running"):
            running += f" / {i['max_running']:,}"
        table.add_row(
            i["name"],
            i["state"],
            "-" if up is None else ("up" if up else "DOWN"),
            f"{i['gpu_count']}x{i['gpu']}",
            models,
            running,
            i.get("url") or "(in process)",
        )
    return table


@ops_app.command("instances")
def instances_cmd(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """Instances: state, health, models and their tiers, requests running (qlm ops running:
    which)."""
    doc = _fetch(ctx, "GET", "/v1/admin/instances", as_json=as_json)
    if doc is not None:
        console.print(instances_view(doc))


def running_view(doc: Mapping[str, Any]) -> list[RenderableType]:
    """``GET /v1/admin/running``: a table of running requests per instance."""
    out: list[RenderableType] = [_stale(doc)]
    now = doc.get("at")
    for i in doc["data"]:
        limit = f" of {i['max_running']:,}" if i.get("max_running") else ""
        title = f"{i['instance']}: {_n(len(i['requests']), 'request')} running{limit}"
        table = _requests_table(title, i["requests"], now, running=True)
        out.append(table if i["requests"] else title)
    if not doc["data"]:
        out.append("no instances")
    return out


@ops_app.command("running")
def running_cmd(
    ctx: typer.Context,
    instance: Annotated[str | None, typer.Option(help="Only this instance's.")] = None,
    watch: WatchOption = False,
    interval: IntervalOption = 2.0,
    count: CountOption = None,
    as_json: JsonOption = False,
) -> None:
    """The requests each instance runs: tenant, time running, deadline, tokens so far."""
    _show_or_watch(
        ctx, "/v1/admin/running", {"instance": instance} if instance else None, running_view,
        as_json=as_json, watch=watch, interval=interval, count=count,
    )  # fmt: skip


def _steer(ctx: typer.Context, name: str, action: str, as_json: bool) -> None:
    doc = _fetch(ctx, "POST", f"/v1/admin/instances/{name}/{action}", as_json=as_json)
    if doc is None:
        return
    console.print(f"{doc['name']}: {doc['state']}")


@ops_app.command("drain")
def drain_cmd(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Instance name.")],
    as_json: JsonOption = False,
) -> None:
    """Stop pulling new work onto an instance; what it runs finishes."""
    _steer(ctx, name, "drain", as_json)


@ops_app.command("undrain")
def undrain_cmd(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Instance name.")],
    as_json: JsonOption = False,
) -> None:
    """Let a drained instance take work again."""
    _steer(ctx, name, "undrain", as_json)


PLANS_LEGEND = (
    "Each plan as it was made (see age). groups (planned): the groups it ordered and placed; "
    "deferred groups are not among them. violation: the plan's objective, its expected lateness "
    "in seconds (end to end, and to the first token) weighted by tier and requests, plus 10,000 "
    "times that weight for each group short of its chance of meeting its SLO, in proportion to "
    "the shortfall (docs/planner.md); EDF's: the same for plain earliest-deadline-first. "
    "at risk (planned groups): the planned groups it left below that chance. deferred (groups): "
    "groups cost-aware admission put behind the others on their instance, served as capacity "
    "allows, not counted at risk whatever their chance. qlm ops queues counts at risk "
    "otherwise: requests, now, in every queued group, deferred ones included."
)


def plans_view(doc: Mapping[str, Any], now: float) -> list[RenderableType]:
    """``GET /v1/admin/plans`` as a table and the legend of its columns."""
    table = Table(title=f"{_n(len(doc['data']), 'plan')}, newest first", title_justify="left")
    for col in ("id", "age", "controller", "trigger", "groups (planned)", "method", "status"):
        table.add_column(col, justify="right" if col in ("id", "groups (planned)") else "left")
    for col in (
        "violation (s)", "EDF's (s)", "solve", "at risk (planned groups)", "deferred (groups)"
    ):  # fmt: skip
        table.add_column(col, justify="right")
    for p in doc["data"]:
        table.add_row(
            str(p["id"]),
            f"{now - p['at']:,.0f} s",
            p["controller"],
            p["trigger"],
            f"{p['groups']:,}",
            p["method"],
            p["status"],
            f"{p['objective']:,.1f}",
            f"{p['edf_objective']:,.1f}",
            f"{p['solve_s'] * 1000:,.0f} ms",
            f"{len(p['at_risk']):,}",
            f"{p.get('deferred', 0):,}",
        )
    return [table, PLANS_LEGEND]


@ops_app.command("plans")
def plans_cmd(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="How many, newest first.")] = 20,
    as_json: JsonOption = False,
) -> None:
    """Recent plans: why each ran, how it was solved, what it gained over EDF, what stays at
    risk and what it deferred."""
    doc = _fetch(ctx, "GET", "/v1/admin/plans", {"limit": limit}, as_json=as_json)
    if doc is not None:
        _show(plans_view(doc, time.time()))


ROLES = {
    "starting": "starting (taking the lead)",
    "active": "active",
    "standby": "standby",
    "stopping": "stopping",
    "stopped": "stopped",
}
CONTROLLERS_LEGEND = (
    "role, as each last published it: starting: taking the global queue's leader lock, not "
    "yet leading; active: leads and serves the queue; standby: waits while another controller "
    "leads; stopped: stopped cleanly. silent: it published nothing for longer than the API's "
    "QLM_API__CONTROLLER_STALE_S, so its role is stale (it hangs, or is dead)."
)


def controller_role(c: Mapping[str, Any]) -> str:
    """What a controller's role column says, ", silent" when its state is stale (an API
    without ``role``: from ``active`` and ``stopped_at``)."""
    role = c.get("role")
    if role is None:
        role = "active" if c["active"] else "stopped" if c.get("stopped_at") else "standby"
    said = ROLES.get(str(role), str(role))
    return f"{said}, silent" if c.get("silent") else said


def controllers_view(doc: Mapping[str, Any]) -> list[RenderableType]:
    """``GET /v1/admin/controllers`` as a table and the legend of its roles."""
    if not doc["data"]:
        return ["no controller has published its state yet"]
    table = Table(title="controllers", title_justify="left")
    for col in ("name", "role", "state age"):
        table.add_column(col)
    for c in doc["data"]:
        table.add_row(c["name"], controller_role(c), f"{c['age_s']:,.1f} s")
    return [table, CONTROLLERS_LEGEND]


@ops_app.command("controllers")
def controllers_cmd(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """Controllers: which one is active (or starting, standby, stopped), and how fresh its
    published state is."""
    doc = _fetch(ctx, "GET", "/v1/admin/controllers", as_json=as_json)
    if doc is not None:
        _show(controllers_view(doc))


def request_view(doc: Mapping[str, Any]) -> Table:
    """``GET /v1/requests/{id}`` as a table: times relative to its submission."""
    sub = doc["submitted_at"]

    def rel(key: str) -> str:
        at = doc.get(key)
        return "-" if at is None else f"+{at - sub:,.2f} s"

    table = Table(title=f"request {doc['id']}", title_justify="left", show_header=False)
    table.add_column("field")
    table.add_column("value")
    met = doc.get("slo_met")
    final = doc["status"] in ("finished", "failed", "cancelled")
    predicted = doc.get("predicted_completion_at")
    late = predicted is not None and not final and predicted > doc["deadline_at"]
    missed = bool(doc.get("missed")) and not final  # (a final one: "SLO met" says it)
    rows = [
        ("status", doc["status"] + (f" ({doc['error']})" if doc.get("error") else "")
            + (", missed: its deadline passed" if missed else "")),
        ("tenant / model / tier", f"{doc['tenant']} / {doc['model']} / {doc['tier']}"),
        ("SLO", f"{doc['slo_seconds']:g} s" + _ttft(doc.get("ttft_slo_seconds"))),
        ("submitted", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(sub))),
        ("deadline", rel("deadline_at")),
        ("dispatched / first token / finished", " / ".join(
            rel(k) for k in ("dispatched_at", "first_token_at", "finished_at"))),
        ("predicted completion", rel("predicted_completion_at")
            + (" (past its deadline)" if late else " (at risk)" if doc.get("at_risk") else "")),
        ("instance", doc.get("instance") or "-"),
        ("evictions / swaps / attempts", f"{doc['evictions']} / {doc['swaps']} / {doc['attempts']}"),
        ("SLO met", ("NO (its deadline passed)" if missed else "-") if met is None
            else ("yes" if met else "NO")),
    ]  # fmt: skip
    for name, value in rows:
        table.add_row(name, value)
    return table


@ops_app.command("request")
def request_cmd(
    ctx: typer.Context,
    request_id: Annotated[str, typer.Argument(help="Request id.")],
    as_json: JsonOption = False,
) -> None:
    """One request: where it is, its SLO and whether it met it."""
    doc = _fetch(ctx, "GET", f"/v1/requests/{request_id}", as_json=as_json)
    if doc is not None:
        console.print(request_view(doc))


def _ttft(ttft: float | None) -> str:
    return "" if ttft is None else f", first token {ttft:g} s"


# --- the SLO report ------------------------------------------------------------------------------

_SPAN = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_span(text: str) -> float:
    """``"24h"`` -> 86,400 seconds (units s, m, h, d)."""
    m = _SPAN.match(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"expected a positive span like 30m, 24h or 7d, got {text!r}")
    return float(m.group(1)) * _UNIT[m.group(2)]


def _pages(target: Target, params: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    cursor: str | None = None
    while True:
        page = _call(target, "GET", "/v1/requests", {**params, "limit": 1000} | (
            {"cursor": cursor} if cursor else {}))  # fmt: skip
        yield from page["data"]
        cursor = page.get("next_cursor")
        if not cursor:
            return


_SUFFIX_FORMATS = {".html": "html", ".htm": "html", ".json": "json", ".md": "md"}


@ops_app.command("report")
def report_cmd(
    ctx: typer.Context,
    since: Annotated[
        str, typer.Option(help="Requests submitted in this span before --until: 30m, 24h, 7d.")
    ] = "24h",
    until: Annotated[
        float | None, typer.Option(help="End of the span (unix seconds; default: now).")
    ] = None,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's requests.")] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Write the report to this file (its format from its suffix)."),
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="text (tables), md, html (with charts) or json; default: --out's suffix "
            "(.html, .json, else md), else text.",
        ),
    ] = None,
    target: Annotated[
        float, typer.Option(help="The attainment target the charts and tables compare with.")
    ] = 0.9,
    days: Annotated[
        int,
        typer.Option(
            min=0, max=365, help="Days of attainment before --until for the trend (0: none)."
        ),
    ] = 14,
    as_json: JsonOption = False,
) -> None:
    """SLO attainment of the requests submitted in a span: overall and by tier, SLO class,
    tenant and model, over the span and across days against a target, latency percentiles,
    the worst-served tenants and why requests missed (what a nightly job runs:
    `qlm ops report --out slo-$(date +%F).html`)."""
    from qlm.reports import FORMATS, build, markdown, page, tables

    target_ = _target(ctx, as_json)
    try:
        span = parse_span(since)
    except ValueError as exc:
        _fail(f"--since: {exc}")
    end = time.time() if until is None else until
    if not math.isfinite(end) or end <= 0:
        _fail(f"--until must be a positive unix time, got {until}")
    if not 0 < target <= 1:
        _fail(f"--target must be a fraction in (0, 1], like 0.95, got {target}")
    kind = fmt or ("json" if target_.raw else None)
    if kind is None:
        kind = _SUFFIX_FORMATS.get(out.suffix.lower(), "md") if out is not None else "text"
    if kind not in FORMATS:
        _fail(f"--format must be one of {', '.join(FORMATS)}, got {kind!r}")
    start = max(end - span, 0.0)
    params: dict[str, Any] = {"since": start, "until": end}
    if tenant:
        params["tenant"] = tenant
    requests = list(_pages(target_, params))
    trend: list[Mapping[str, Any]] = []
    whole = min(days, int(end // 86400))  # days that start at or after the epoch
    if whole:
        daily = {"since": end - whole * 86400.0, "until": end, "step": 86400.0}
        trend = _call(target_, "GET", "/v1/admin/attainment", daily | (
            {"tenant": tenant} if tenant else {}))["data"]  # fmt: skip
    window = (
        f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(start))} – "
        f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(end))}"
    )
    title = f"SLO attainment, {window}" + (f", tenant {tenant}" if tenant else "")
    report = build(
        requests, since=start, until=end, target=target, title=title, tenant=tenant, days=trend
    )
    if kind == "text":
        if out is not None:
            _fail("--format text is for the terminal: give --out a .md, .html or .json file")
        console.print(title)
        for t in tables(report):
            table = Table(title=t.title, title_justify="left")
            # Names whole (a narrow terminal wraps the other columns instead), up to 24 wide.
            name_w = min(24, max((len(row[0]) for row in t.rows), default=0))
            for i, col in enumerate(t.columns):
                table.add_column(
                    col,
                    justify="left" if i == 0 or col == "what it means" else "right",
                    min_width=max(name_w, len(col)) if i == 0 else None,
                )
            for row in t.rows:
                table.add_row(*row)
            console.print(table)
        return
    doc = {
        "md": lambda: markdown(report),
        "html": lambda: page(report),
        "json": lambda: json.dumps(report.as_dict(), indent=2, sort_keys=True) + "\n",
    }[kind]()
    if out is None:
        console.file.write(doc)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc, encoding="utf-8")
    err_console.print(f"wrote {out}", markup=False)
