"""The operator CLI, ``qlm ops``: what a running QLM's admin endpoints show, as tables — virtual
queues with their groups, groups, instances, plans, controllers, one request — and the steering
they allow (drain, undrain); ``qlm ops report`` is the SLO-attainment report a nightly job runs
(docs/operations.md), computed by ``qlm.reports``. It talks to the REST API with an admin key
(``qlm keys create --tenant ops --admin``); ``--json`` prints what the API answered instead of
tables.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

ops_app = typer.Typer(
    help="Inspect and steer a running QLM through its admin endpoints (docs/operations.md).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
console = Console(soft_wrap=True, highlight=False)
err_console = Console(stderr=True, soft_wrap=True, highlight=False)


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
        _fail(f"cannot reach QLM at {target.url} ({type(exc).__name__}: {exc})")
    if resp.status_code >= 400:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:200]
        hint = (
            " (give an admin key: --key or QLM_API_KEY)" if resp.status_code in (401, 403) else ""
        )
        _fail(f"{method} {path} answered {resp.status_code}: {message}{hint}")
    return resp.json()


def _target(ctx: typer.Context) -> Target:
    target = ctx.obj
    assert isinstance(target, Target)
    return target


@ops_app.callback()
def ops_main(
    ctx: typer.Context,
    url: Annotated[
        str, typer.Option(envvar="QLM_URL", help="The QLM REST API (QLM_URL).")
    ] = "http://127.0.0.1:8080",
    key: Annotated[
        str | None, typer.Option(envvar="QLM_API_KEY", help="An admin API key (QLM_API_KEY).")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the API's JSON instead of tables.")
    ] = False,
) -> None:
    """Inspect and steer a running QLM through its admin endpoints."""
    if not re.match(r"^https?://", url):
        _fail(f"--url must start with http:// or https://, got {url!r}")
    ctx.obj = Target(url.rstrip("/"), key, as_json)


def _print_json(data: Any) -> None:
    console.print(json.dumps(data, indent=2, sort_keys=True), markup=False)


def _fetch(
    ctx: typer.Context, method: str, path: str, params: Mapping[str, Any] | None = None
) -> Any:
    """The API's answer; None once printed as it is (``--json``)."""
    target = _target(ctx)
    doc = _call(target, method, path, params)
    if target.raw:
        _print_json(doc)
        return None
    return doc


def _in(at: float | None, now: float | None) -> str:
    """A time as seconds from ``now`` ("in 12 s", "3 s ago")."""
    if at is None or now is None:
        return "-"
    d = at - now
    return f"in {d:,.0f} s" if d >= 0 else f"{-d:,.0f} s ago"


def _p(p: float | None) -> str:
    return "-" if p is None else f"{p:.2f}"


def _group_table(title: str, groups: Sequence[Mapping[str, Any]], now: float | None) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("queue", "pos", "group", "model", "tier", "size", "deadline", "completion"):
        table.add_column(col, justify="right" if col in ("pos", "size") else "left")
    table.add_column("P(meet SLO)", justify="right")
    table.add_column("at risk")
    for g in groups:
        table.add_row(
            str(g.get("instance") or "-"),
            str(g.get("position", "-")),
            str(g["id"]),
            str(g["model"]),
            str(g["tier"]),
            str(g["size"]),
            _in(g.get("earliest_deadline_at"), now),
            _in(g.get("predicted_completion_at"), now),
            _p(g.get("p_meet_slo")),
            "yes" if g.get("at_risk") else "",
        )
    return table


def _stale(doc: Mapping[str, Any]) -> str:
    at = doc.get("at")
    if at is None:
        return "no controller has published its state yet"
    return f"controller {doc.get('controller')}, state of {time.time() - at:,.1f} s ago"


@ops_app.command("queues")
def queues_cmd(ctx: typer.Context) -> None:
    """The virtual queue of every instance: its groups in order, their predicted completion and
    risk."""
    doc = _fetch(ctx, "GET", "/v1/admin/queues")
    if doc is None:
        return
    console.print(f"{_stale(doc)}; policy {doc.get('policy') or '-'}")
    now = doc.get("at")
    for q in doc["queues"]:
        title = (
            f"{q['instance']}: {q['size']} requests in {len(q['groups'])} groups, "
            f"{q['at_risk_requests']} at risk, drained {_in(q.get('predicted_drain_at'), now)}"
        )
        if q["groups"]:
            console.print(_group_table(title, q["groups"], now))
        else:
            console.print(f"{title}: empty")
    if not doc["queues"]:
        console.print("no virtual queues")


@ops_app.command("groups")
def groups_cmd(
    ctx: typer.Context,
    at_risk: Annotated[bool, typer.Option("--at-risk", help="Only groups at risk.")] = False,
) -> None:
    """Every request group, across the virtual queues."""
    doc = _fetch(ctx, "GET", "/v1/admin/groups", {"at_risk": True} if at_risk else None)
    if doc is None:
        return
    console.print(_stale(doc))
    console.print(_group_table(f"{len(doc['data'])} groups", doc["data"], doc.get("at")))


@ops_app.command("instances")
def instances_cmd(ctx: typer.Context) -> None:
    """Instances: state, health, models and their tiers, load."""
    doc = _fetch(ctx, "GET", "/v1/admin/instances")
    if doc is None:
        return
    table = Table(title=f"{len(doc['data'])} instances", title_justify="left")
    for col in ("name", "state", "health", "gpu", "models (tier)", "running", "url"):
        table.add_column(col, justify="right" if col == "running" else "left")
    for i in doc["data"]:
        tiers = i.get("tiers") or {}
        models = ", ".join(f"{m} ({tiers.get(m, '?')})" for m in i["models"])
        up = i.get("up")
        running = "-" if i.get("outstanding") is None else str(i["outstanding"])
        if i.get("max_running"):
            running += f" / {i['max_running']}"
        table.add_row(
            i["name"],
            i["state"],
            "-" if up is None else ("up" if up else "DOWN"),
            f"{i['gpu_count']}x{i['gpu']}",
            models,
            running,
            i.get("url") or "(in process)",
        )
    console.print(table)


def _steer(ctx: typer.Context, name: str, action: str) -> None:
    doc = _fetch(ctx, "POST", f"/v1/admin/instances/{name}/{action}")
    if doc is None:
        return
    console.print(f"{doc['name']}: {doc['state']}")


@ops_app.command("drain")
def drain_cmd(
    ctx: typer.Context, name: Annotated[str, typer.Argument(help="Instance name.")]
) -> None:
    """Stop pulling new work onto an instance; what it runs finishes."""
    _steer(ctx, name, "drain")


@ops_app.command("undrain")
def undrain_cmd(
    ctx: typer.Context, name: Annotated[str, typer.Argument(help="Instance name.")]
) -> None:
    """Let a drained instance take work again."""
    _steer(ctx, name, "undrain")


@ops_app.command("plans")
def plans_cmd(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="How many, newest first.")] = 20,
) -> None:
    """Recent plans: why each ran, how it was solved, what it gained over EDF, what stays at
    risk."""
    doc = _fetch(ctx, "GET", "/v1/admin/plans", {"limit": limit})
    if doc is None:
        return
    table = Table(title=f"{len(doc['data'])} plans, newest first", title_justify="left")
    for col in ("id", "age", "controller", "trigger", "groups", "method", "status"):
        table.add_column(col, justify="right" if col in ("id", "groups") else "left")
    for col in ("violation", "EDF's", "solve", "at risk", "deferred"):
        table.add_column(col, justify="right")
    now = time.time()
    for p in doc["data"]:
        table.add_row(
            str(p["id"]),
            f"{now - p['at']:,.0f} s",
            p["controller"],
            p["trigger"],
            str(p["groups"]),
            p["method"],
            p["status"],
            f"{p['objective']:.3g}",
            f"{p['edf_objective']:.3g}",
            f"{p['solve_s'] * 1000:,.0f} ms",
            str(len(p["at_risk"])),
            str(p.get("deferred", 0)),
        )
    console.print(table)


@ops_app.command("controllers")
def controllers_cmd(ctx: typer.Context) -> None:
    """Controllers: which one is active, and how fresh its published state is."""
    doc = _fetch(ctx, "GET", "/v1/admin/controllers")
    if doc is None:
        return
    if not doc["data"]:
        console.print("no controller has published its state yet")
        return
    table = Table(title="controllers", title_justify="left")
    for col in ("name", "role", "state age"):
        table.add_column(col)
    for c in doc["data"]:
        role = "active" if c["active"] else "stopped" if c.get("stopped_at") else "standby"
        table.add_row(c["name"], role, f"{c['age_s']:,.1f} s")
    console.print(table)


@ops_app.command("request")
def request_cmd(
    ctx: typer.Context, request_id: Annotated[str, typer.Argument(help="Request id.")]
) -> None:
    """One request: where it is, its SLO and whether it met it."""
    doc = _fetch(ctx, "GET", f"/v1/requests/{request_id}")
    if doc is None:
        return
    sub = doc["submitted_at"]

    def rel(key: str) -> str:
        at = doc.get(key)
        return "-" if at is None else f"+{at - sub:,.2f} s"

    table = Table(title=f"request {doc['id']}", title_justify="left", show_header=False)
    table.add_column("field")
    table.add_column("value")
    met = doc.get("slo_met")
    rows = [
        ("status", doc["status"] + (f" ({doc['error']})" if doc.get("error") else "")),
        ("tenant / model / tier", f"{doc['tenant']} / {doc['model']} / {doc['tier']}"),
        ("SLO", f"{doc['slo_seconds']:g} s" + _ttft(doc.get("ttft_slo_seconds"))),
        ("submitted", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(sub))),
        ("dispatched / first token / finished", " / ".join(
            rel(k) for k in ("dispatched_at", "first_token_at", "finished_at"))),
        ("predicted completion", rel("predicted_completion_at")
            + (" (at risk)" if doc.get("at_risk") else "")),
        ("instance", doc.get("instance") or "-"),
        ("evictions / swaps / attempts", f"{doc['evictions']} / {doc['swaps']} / {doc['attempts']}"),
        ("SLO met", "-" if met is None else ("yes" if met else "NO")),
    ]  # fmt: skip
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


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
) -> None:
    """SLO attainment of the requests submitted in a span: overall and by tier, SLO class,
    tenant and model, over the span and across days against a target, latency percentiles,
    the worst-served tenants and why requests missed (what a nightly job runs:
    `qlm ops report --out slo-$(date +%F).html`)."""
    from qlm.reports import FORMATS, build, markdown, page, tables

    target_ = _target(ctx)
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
            for i, col in enumerate(t.columns):
                table.add_column(
                    col, justify="left" if i == 0 or col == "what it means" else "right"
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
