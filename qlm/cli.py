"""The ``qlm`` command. ``QLMError`` becomes one red line and exit code 1, here and only here."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from qlm.engines.perf_model import default_catalog
from qlm.errors import QLMError
from qlm.ops import ops_app
from qlm.planner import POLICIES, PlannerConfig, create_policy
from qlm.rct.output_model import NIG
from qlm.rct.profile import HardwareProfile, RctProfile, dump_profile, parse_profile
from qlm.rct.profiling import profile_sim_hardware, profile_workload
from qlm.settings import get_settings, rct_profile
from qlm.sim.cluster import SimResult, simulate
from qlm.sim.instances import parse_instances
from qlm.sim.metrics import write_outputs
from qlm.sim.traces import load_lengths, load_trace, scale_rate, synthetic, window
from qlm.sim.workload import PRESETS, create_workload

if TYPE_CHECKING:
    from qlm.engines.profiling import ServerSettings

app = typer.Typer(
    help="QLM: queue management for LLM serving with SLOs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts contain [brackets] that are not markup
)
console = Console()
err_console = Console(stderr=True)

T = TypeVar("T")


def _fail(message: str) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _guard(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except QLMError as exc:
        _fail(str(exc))


def run_simulation(
    *,
    trace: str,
    workload: str,
    instances: str,
    policy: str,
    seed: int,
    start_s: float,
    duration_s: float | None,
    rate_scale: float,
    slo_scale: float,
    synthetic_rate: float | None,
    arrival: Literal["poisson", "gamma"],
    cv: float,
    show_progress: bool,
    planner: PlannerConfig | None = None,
) -> SimResult:
    """The service behind ``qlm simulate`` and ``qlm demo``; ``planner``: the ``qlm`` policy's
    settings (default: ``PlannerConfig.for_simulation()``)."""
    if synthetic_rate is not None:
        if duration_s is None:
            raise QLMError("--duration is required with --rate (a synthetic workload)")
        tr = synthetic(
            load_lengths(trace),
            rate=synthetic_rate,
            duration_s=duration_s,
            arrival=arrival,
            cv=cv,
            seed=seed,
        )
    else:
        tr = load_trace(trace, seed=seed)
        if rate_scale != 1.0:
            tr = scale_rate(tr, rate_scale)
        if start_s > 0 or duration_s is not None:
            end = start_s + duration_s if duration_s is not None else tr.duration_s + 1.0
            tr = window(tr, start_s, end)
    requests = create_workload(workload, tr, seed=seed, slo_scale=slo_scale)
    specs = parse_instances(instances)
    pol = create_policy(
        policy,
        profile=rct_profile(get_settings()),
        planner=planner or PlannerConfig.for_simulation(),
    )
    if not show_progress:
        return _with_plans(simulate(requests, specs, pol), pol)
    with Progress(
        TextColumn("[bold]simulating[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task("sim", total=len(requests))
        result = simulate(
            requests, specs, pol, progress=lambda done, _total: bar.update(task, completed=done)
        )
    return _with_plans(result, pol)


def _with_plans(result: SimResult, policy: object) -> SimResult:
    """Add what the planner did (``qlm`` only) to the summary: plans, their status, the groups
    left at risk and the scale-up signal (capacity needed to meet every SLO)."""
    plans = getattr(policy, "plans", None)
    if plans:
        needed = [p.capacity_needed for p in plans]
        result.summary["planner"] = {
            "plans": len(plans),
            "status": {st: sum(p.status == st for p in plans) for st in {p.status for p in plans}},
            "plans_with_groups_at_risk": sum(bool(p.at_risk) for p in plans),
            "max_capacity_needed": None
            if any(c is None for c in needed)
            else max(c for c in needed if c is not None),
            "solve_s_total": sum(p.solve_s for p in plans),
        }
    return result


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "-"
    if pct:
        return f"{100 * x:.1f} %"
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def print_summary(result: SimResult, command: str) -> None:
    s = result.summary
    kinds: dict[str, int] = {}
    for i in result.instances:
        gpus = f"{i.gpu_count}x{i.gpu}" if i.gpu_count > 1 else i.gpu
        key = f"{gpus} {'+'.join(i.models)}"
        kinds[key] = kinds.get(key, 0) + 1
    inst = ", ".join(f"{n} × {k}" for k, n in kinds.items())
    table = Table(title=f"QLM simulation — policy {result.policy}", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("instances", inst)
    table.add_row(
        "requests (finished / failed)", f"{s['requests']} ({s['finished']} / {s['failed']})"
    )
    table.add_row("[bold]SLO attainment[/]", f"[bold]{_fmt(s['slo_attainment'], pct=True)}[/]")
    for title, key in (
        ("class", "slo_attainment_by_class"),
        ("tier", "slo_attainment_by_tier"),
        ("model", "slo_attainment_by_model"),
    ):
        if len(s[key]) > 1:
            for name, v in s[key].items():
                table.add_row(
                    f"  {title} {name} ({v['requests']})", _fmt(v["slo_attainment"], pct=True)
                )
    table.add_row("throughput (req/s)", _fmt(s["throughput_rps"]))
    table.add_row("throughput (output tok/s)", _fmt(s["throughput_output_tps"]))
    for label, key in (("TTFT", "ttft_s"), ("end-to-end", "e2e_s"), ("queueing", "queue_s")):
        p = s[key]
        table.add_row(
            f"{label} p50 / p90 / p99 (s)", " / ".join(_fmt(p[k]) for k in ("p50", "p90", "p99"))
        )
    table.add_row("preemptions", str(s["preemptions"]))
    table.add_row("model switches", str(s["model_switches"]))
    table.add_row("GPU memory utilisation (mean)", _fmt(s.get("gpu_memory_utilization"), pct=True))
    table.add_row("simulated makespan (s)", _fmt(s["makespan_s"]))
    plan = s.get("planner")
    if plan:
        table.add_row(
            "plans (with groups at risk)", f"{plan['plans']} ({plan['plans_with_groups_at_risk']})"
        )
        need = plan["max_capacity_needed"]
        table.add_row(
            "capacity needed for every SLO (max)",
            "beyond 64x" if need is None else f"{need:.2f}x",
        )
    console.print(table)
    console.print(f"[dim]reproduce: {escape(command)}[/]", highlight=False, soft_wrap=True)


def _command_line(ctx: typer.Context) -> str:
    """The command that reproduces this run: every option that shapes the result, spelled out."""
    parts = ["qlm", ctx.info_name or ""]
    for param in ctx.command.params:
        if param.param_type_name != "option" or param.name in {"as_json", "out", "progress"}:
            continue
        value = ctx.params.get(param.name or "")
        always = param.name in {"trace", "workload", "instances", "policy", "seed"}
        if value is None or value is False or (value == param.default and not always):
            continue
        flag = max(param.opts, key=len)
        parts.append(flag if value is True else f"{flag} {shlex.quote(str(value))}")
    return " ".join(parts)


@app.command("simulate")
def simulate_cmd(
    ctx: typer.Context,
    trace: Annotated[
        str,
        typer.Option(
            help="Trace name (azure-conv, azure-code, mooncake-conversation, mooncake-synthetic) or file; with --rate, a length sample (sharegpt, arxiv or file)."
        ),
    ] = "azure-conv",
    workload: Annotated[
        str,
        typer.Option(
            help=f"How models, SLO classes and tiers are assigned: {', '.join(PRESETS)} (docs/workloads.md)."
        ),
    ] = "default",
    instances: Annotated[
        str,
        typer.Option(
            help="Fleet, e.g. 2xA100:llama-3-8b,1xH100/2:llama-2-70b (COUNTxGPU[/GPUS]:MODEL[+MODEL])."
        ),
    ] = "2xA100:llama-3-8b",
    policy: Annotated[
        str, typer.Option(help=f"Scheduling policy: {', '.join(POLICIES)}.")
    ] = "fcfs",
    seed: Annotated[
        int, typer.Option(help="Seed of every random choice; same seed, same result.")
    ] = 0,
    start: Annotated[float, typer.Option(help="Start of the trace window (s).")] = 0.0,
    duration: Annotated[
        float | None, typer.Option(help="Length of the trace window (s); whole trace if unset.")
    ] = None,
    rate_scale: Annotated[float, typer.Option(help="Multiply the trace's arrival rate.")] = 1.0,
    slo_scale: Annotated[float, typer.Option(help="Multiply every SLO.")] = 1.0,
    rate: Annotated[
        float | None,
        typer.Option(help="Synthetic arrivals at this rate (req/s), lengths sampled from --trace."),
    ] = None,
    arrival: Annotated[
        str, typer.Option(help="Synthetic arrival process: poisson or gamma.")
    ] = "poisson",
    cv: Annotated[
        float, typer.Option(help="Coefficient of variation of gamma inter-arrivals (> 1: bursty).")
    ] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    out: Annotated[
        Path | None, typer.Option(help="Write requests.csv and summary.json here.")
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Replay a trace or synthetic workload on simulated vLLM instances under a policy."""
    if arrival not in ("poisson", "gamma"):
        _fail(f"--arrival must be poisson or gamma, got {arrival!r}")
    arrival_kind: Literal["poisson", "gamma"] = "gamma" if arrival == "gamma" else "poisson"
    result = _guard(
        lambda: run_simulation(
            trace=trace,
            workload=workload,
            instances=instances,
            policy=policy,
            seed=seed,
            start_s=start,
            duration_s=duration,
            rate_scale=rate_scale,
            slo_scale=slo_scale,
            synthetic_rate=rate,
            arrival=arrival_kind,
            cv=cv,
            show_progress=progress and not as_json and sys.stderr.isatty(),
            planner=_sim_planner(),
        )
    )
    _emit(result, ctx, as_json=as_json, out=out)


def _sim_planner() -> PlannerConfig:
    """The ``QLM_PLANNER__*`` settings, with the compute budget counted in scored orders so
    that a simulated run is the same on any machine."""
    config = get_settings().planner.planner_config()
    return dataclasses.replace(config, budget=PlannerConfig.for_simulation().budget)


def _emit(result: SimResult, ctx: typer.Context, *, as_json: bool, out: Path | None) -> None:
    command = _command_line(ctx)
    result.summary["command"] = command
    if out is not None:
        paths = write_outputs(out, result.records, result.summary, result.memory)
        if not as_json:
            console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False)
    if as_json:
        sys.stdout.write(json.dumps(result.summary, indent=2, sort_keys=True) + "\n")
    else:
        print_summary(result, command)


@app.command("demo")
def demo_cmd(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """The main job on embedded defaults: a short replay of a real trace on simulated instances.

    Settings come from QLM_DEMO__* (trace, workload, instances, policy, duration_s, rate_scale, seed).
    """

    def run() -> SimResult:
        d = get_settings().demo
        return run_simulation(
            trace=d.trace,
            workload=d.workload,
            instances=d.instances,
            policy=d.policy,
            seed=d.seed,
            start_s=0.0,
            duration_s=d.duration_s,
            rate_scale=d.rate_scale,
            slo_scale=1.0,
            synthetic_rate=None,
            arrival="poisson",
            cv=1.0,
            show_progress=not as_json and sys.stderr.isatty(),
            planner=_sim_planner(),
        )

    result = _guard(run)
    _emit(result, ctx, as_json=as_json, out=None)


QUIET_LOGGERS = ("httpx", "httpcore")
"""Libraries that log every HTTP call at INFO (each stream to vLLM, each health check): shown
only at QLM_LOG_LEVEL=DEBUG."""


def _logging() -> None:
    import logging

    level = logging.getLevelNamesMapping()[_guard(get_settings).log_level]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level > logging.DEBUG:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(max(level, logging.WARNING))


@app.command("controller")
def controller_cmd() -> None:
    """Run the controller service: consume the global queue, plan, drive the instances, record
    outcomes. Configured by QLM_BROKER_URL, QLM_DATABASE_URL, QLM_INSTANCES_FILE and
    QLM_CONTROLLER__* (docs/operations.md); with none set it runs on embedded defaults. A second
    controller on the same broker waits as standby and takes over when the active one stops."""
    import asyncio

    from qlm.service import run_controller

    _logging()
    _guard(lambda: asyncio.run(run_controller(get_settings())))


@app.command("serve")
def serve_cmd(
    replay: Annotated[
        float | None,
        typer.Option(
            help="Replay this many seconds of the demo trace (QLM_DEMO__*) through the service, print SLO attainment and exit."
        ),
    ] = None,
    sim_http: Annotated[
        bool,
        typer.Option(
            "--sim-http",
            help="Run the simulated instances as `qlm sim-engine serve` processes driven over vLLM's HTTP API (QLM_CONTROLLER__SIM_OVER_HTTP).",
        ),
    ] = False,
) -> None:
    """The all-in-one process: controller, agents and the REST API (QLM_API__HOST:QLM_API__PORT,
    default 127.0.0.1:8080) on one queue. With no settings: in-process queue, SQLite (./qlm.db)
    and simulated instances; create a key with `qlm keys create --tenant NAME` (docs/api.md)."""
    import asyncio

    from qlm.service.serve import serve

    _logging()
    settings = get_settings()
    if sim_http:
        controller = settings.controller.model_copy(update={"sim_over_http": True})
        settings = settings.model_copy(update={"controller": controller})
    result = _guard(lambda: asyncio.run(serve(settings, replay_s=replay)))
    if result is not None:
        console.print(
            f"replayed {result.requests} requests in {result.wall_s:.1f} s: "
            f"{result.finished} finished, {result.failed} failed, "
            f"SLO attainment {100 * result.attainment:.1f} %",
            highlight=False,
        )
        flag = " --sim-http" if settings.controller.sim_over_http else ""
        console.print(f"reproduce: qlm serve --replay {replay:g}{flag}", highlight=False)


@app.command("api")
def api_cmd() -> None:
    """Run the REST API alone (a controller runs elsewhere: `qlm controller`), on
    QLM_API__HOST:QLM_API__PORT (default 127.0.0.1:8080). Configured by QLM_BROKER_URL,
    QLM_DATABASE_URL and QLM_API__* (docs/api.md)."""
    from qlm.api.server import run, run_api

    _logging()
    _guard(lambda: run(run_api(get_settings())))


keys_app = typer.Typer(
    help="API keys: one per client, each naming a tenant (docs/api.md).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(keys_app, name="keys")


def _open_store() -> Any:
    from qlm.store import Store

    return Store.open(get_settings().database_url)


@keys_app.command("create")
def keys_create_cmd(
    tenant: Annotated[str, typer.Option(help="The tenant the key acts for.")],
    admin: Annotated[
        bool, typer.Option("--admin", help="May see every tenant and the operator endpoints.")
    ] = False,
    name: Annotated[str, typer.Option(help="A note to tell keys apart.")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Create a key and print it. Only its digest is stored: it cannot be shown again."""
    if not tenant.strip():
        _fail("--tenant must not be empty")

    def create() -> str:
        with _open_store() as store:
            key: str = store.create_api_key(tenant, admin=admin, name=name)
            return key

    key = _guard(create)
    if as_json:
        sys.stdout.write(json.dumps({"key": key, "tenant": tenant, "admin": admin}) + "\n")
        return
    sys.stdout.write(key + "\n")
    err_console.print(
        f"key for tenant {escape(tenant)}{' (admin)' if admin else ''}: shown once, keep it "
        "(send it as 'Authorization: Bearer <key>')",
        highlight=False,
    )


@keys_app.command("list")
def keys_list_cmd(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Every key (without its secret): id, tenant, admin, name, prefix, created, revoked."""

    def listing() -> list[Any]:
        with _open_store() as store:
            keys: list[Any] = store.api_keys(tenant=tenant)
            return keys

    keys = _guard(listing)
    if as_json:
        rows = [
            {
                "id": k.id,
                "tenant": k.tenant,
                "admin": k.admin,
                "name": k.name,
                "prefix": k.prefix,
                "created_at": k.created_at,
                "revoked_at": k.revoked_at,
            }
            for k in keys
        ]
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = Table(title="API keys", title_justify="left")
    for column in ("id", "tenant", "admin", "name", "prefix", "revoked"):
        table.add_column(column)
    for k in keys:
        table.add_row(
            str(k.id),
            escape(k.tenant),
            "yes" if k.admin else "",
            escape(k.name),
            k.prefix + "…",
            "revoked" if k.revoked else "",
        )
    console.print(table)


@keys_app.command("revoke")
def keys_revoke_cmd(
    key_id: Annotated[int, typer.Argument(help="The key's id (qlm keys list).")],
) -> None:
    """Revoke a key: calls with it fail within QLM_API__KEY_CACHE_S seconds."""

    def revoke() -> bool:
        with _open_store() as store:
            done: bool = store.revoke_api_key(key_id)
            return done

    if not _guard(revoke):
        _fail(f"no active key with id {key_id} (qlm keys list)")
    console.print(f"revoked key {key_id}", highlight=False)


profile_app = typer.Typer(
    help="Profile hardware and workloads for the completion-time estimator.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(profile_app, name="profile")

WORKLOAD_PRIORS = ("azure-conv", "azure-code", "mooncake-conversation", "sharegpt", "arxiv")


def _merge_into(out: Path, addition: RctProfile) -> RctProfile:
    merged = (
        parse_profile(out.read_text(encoding="utf-8"), str(out)).merged(addition)
        if out.exists()
        else addition
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_profile(merged), encoding="utf-8")
    return merged


def profile_hardware_service(
    model: str, gpu: str, gpus: int | None, input_tokens: int, output_tokens: int
) -> HardwareProfile:
    catalog = default_catalog()
    count = gpus if gpus is not None else catalog.default_gpu_count(model, gpu)
    perf = catalog.perf_model(model, gpu, count)
    return profile_sim_hardware(perf, input_tokens=input_tokens, output_tokens=output_tokens)


def profile_workload_service(trace: str, name: str) -> tuple[str, NIG]:
    outputs = [int(x) for x in load_lengths(trace).output_tokens]
    return name, profile_workload(outputs)


@profile_app.command("hardware")
def profile_hardware_cmd(
    model: Annotated[str, typer.Option(help="Model, e.g. llama-3-8b.")],
    gpu: Annotated[str, typer.Option(help="GPU type: A10, A100, H100.")],
    out: Annotated[Path, typer.Option(help="Profile file to write or update.")],
    gpus: Annotated[
        int | None, typer.Option(help="GPUs per instance (default: fewest that fit).")
    ] = None,
    input_tokens: Annotated[int, typer.Option(help="Prompt length of the profiling batch.")] = 1024,
    output_tokens: Annotated[int, typer.Option(help="Output length of the profiling batch.")] = 256,
) -> None:
    """Run profiling batches on a simulated instance and fit its hardware parameters."""
    hw = _guard(lambda: profile_hardware_service(model, gpu, gpus, input_tokens, output_tokens))
    _guard(lambda: _merge_into(out, RctProfile(hardware={hw.key: hw})))
    _print_hardware(hw, out)


def profile_server_service(
    url: str,
    model: str,
    gpu: str,
    gpus: int,
    settings: ServerSettings,
    input_tokens: int,
    output_tokens: int,
    time_scale: float,
) -> HardwareProfile:
    from qlm.clock import WallClock
    from qlm.engines.profiling import profile_engine
    from qlm.engines.vllm import VllmEngine

    # A GPU the catalog knows is named as the instances file names it (A100, not a100); any
    # other as given (profiles match GPU names in any case).
    with contextlib.suppress(QLMError):
        gpu = default_catalog().gpu(gpu).name

    async def run() -> HardwareProfile:
        engine = VllmEngine("server", url, model, timeout_s=60.0, tier_timeout_s=1800.0)
        try:
            return await profile_engine(
                engine,
                model=model,
                gpu=gpu,
                gpu_count=gpus,
                settings=settings,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                clock=WallClock(time_scale),
            )
        finally:
            await engine.close()

    return asyncio.run(run())


@profile_app.command("server")
def profile_server_cmd(
    url: Annotated[str, typer.Option(help="The vLLM server, e.g. http://gpu-0:8000.")],
    model: Annotated[str, typer.Option(help="Served model name to profile.")],
    gpu: Annotated[str, typer.Option(help="GPU type the profile is for, e.g. A100.")],
    max_num_seqs: Annotated[
        int, typer.Option(help="The server's --max-num-seqs (its API does not say it).")
    ],
    out: Annotated[Path, typer.Option(help="Profile file to write or update.")],
    gpus: Annotated[int, typer.Option(help="GPUs of the instance.")] = 1,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="The server's --max-num-batched-tokens (0: unknown).")
    ] = 0,
    max_context: Annotated[int, typer.Option(help="The model's context length.")] = 8192,
    warm_load_s: Annotated[
        float | None, typer.Option(help="Wake-up time from sleep level 1 (default: measured).")
    ] = None,
    cold_load_s: Annotated[
        float | None, typer.Option(help="Wake-up time from sleep level 2 (default: measured).")
    ] = None,
    input_tokens: Annotated[int, typer.Option(help="Prompt length of the profiling batch.")] = 1024,
    output_tokens: Annotated[int, typer.Option(help="Output length of the profiling batch.")] = 256,
    time_scale: Annotated[
        float,
        typer.Option(
            help="Server seconds per real second: 1 for vLLM (a simulated server's --time-scale)."
        ),
    ] = 1.0,
) -> None:
    """Run profiling batches on a vLLM server over its HTTP API and fit its hardware parameters
    (prompts are random, so its prefix cache cannot help; a few minutes on a GPU)."""
    from qlm.engines.profiling import ServerSettings

    for name, value in (
        ("--max-num-seqs", max_num_seqs),
        ("--gpus", gpus),
        ("--max-context", max_context),
    ):
        if value < 1:
            _fail(f"{name} must be >= 1, got {value}")
    if max_num_batched_tokens < 0:
        _fail(f"--max-num-batched-tokens must be >= 0 (0: unknown), got {max_num_batched_tokens}")
    if input_tokens < 1 or output_tokens < 4:
        _fail(
            "--input-tokens must be >= 1 and --output-tokens >= 4 (decode time is measured "
            f"between two output lengths), got {input_tokens} and {output_tokens}"
        )
    if time_scale <= 0:
        _fail(f"--time-scale must be > 0, got {time_scale}")
    for name, load in (("--warm-load-s", warm_load_s), ("--cold-load-s", cold_load_s)):
        if load is not None and load < 0:
            _fail(f"{name} must be >= 0, got {load}")
    try:  # KV bytes per token, for swap costs, where the catalog knows the model
        kv_bytes = default_catalog().model(model).kv_bytes_per_token
    except QLMError:
        kv_bytes = 0
    settings = ServerSettings(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_context=max_context,
        warm_load_s=warm_load_s,
        cold_load_s=cold_load_s,
        kv_bytes_per_token=kv_bytes,
    )
    hw = _guard(
        lambda: profile_server_service(
            url, model, gpu, gpus, settings, input_tokens, output_tokens, time_scale
        )
    )
    _guard(lambda: _merge_into(out, RctProfile(hardware={hw.key: hw})))
    _print_hardware(hw, out)


def _print_hardware(hw: HardwareProfile, out: Path) -> None:
    console.print(
        f"{hw.model} on {hw.gpu_count}x{hw.gpu}: prefill {hw.prefill_base_s * 1000:.1f} ms + "
        f"{hw.prefill_per_token_s * 1e6:.1f} µs/token, d {hw.decode_alone_s * 1000:.1f} ms alone / "
        f"{hw.decode_per_token_s * 1000:.1f} ms at batch {hw.saturation_batch:.0f} "
        f"(+{hw.decode_per_ctx_token_s * 1e9:.1f} ms per million tokens of context), "
        f"Θ {hw.throughput_tps:,.0f} tok/s, ε {hw.inefficiency:.3f} -> {out}",
        highlight=False,
        soft_wrap=True,
    )


@profile_app.command("workload")
def profile_workload_cmd(
    trace: Annotated[str, typer.Option(help="Trace or length sample whose output lengths to fit.")],
    out: Annotated[Path, typer.Option(help="Profile file to write or update.")],
    name: Annotated[
        str,
        typer.Option(
            help="Whose prior it is: a model name (that model's requests) or 'default' (every "
            "model without a prior of its own)."
        ),
    ] = "default",
) -> None:
    """Fit the output-length prior of a workload from a trace (the estimator looks a request's
    prior up by its model, then 'default')."""
    if not name:
        _fail("--name must not be empty (a model name or 'default')")
    key, prior = _guard(lambda: profile_workload_service(trace, name))
    _guard(lambda: _merge_into(out, RctProfile(output_priors={key: prior})))
    console.print(
        f"prior {key!r}: log-mean {prior.mu:.3f}, predictive log-sd {prior.predictive_log_sd:.3f} -> {out}",
        highlight=False,
        soft_wrap=True,
    )


@profile_app.command("all")
def profile_all_cmd(
    out: Annotated[Path, typer.Option(help="Profile file to write (replaced).")],
) -> None:
    """Profile every shipped (model, GPU) combination and every shipped workload; this is how
    qlm/data/rct_profile.json is made."""

    def run() -> RctProfile:
        catalog = default_catalog()
        hardware = {}
        for model, gpu, count in sorted(catalog.perf):
            hw = profile_hardware_service(model, gpu, count, 1024, 256)
            hardware[hw.key] = hw
        priors = dict(profile_workload_service(t, t) for t in WORKLOAD_PRIORS)
        priors["default"] = priors["azure-conv"]
        return RctProfile(hardware=hardware, output_priors=priors)

    profile = _guard(run)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_profile(profile), encoding="utf-8")
    console.print(
        f"{len(profile.hardware)} hardware profiles and {len(profile.output_priors)} priors -> {out}",
        highlight=False,
        soft_wrap=True,
    )


sim_engine_app = typer.Typer(
    help="A simulated vLLM instance behind vLLM's HTTP API (docs/engines.md).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(sim_engine_app, name="sim-engine")
app.add_typer(ops_app, name="ops")


@sim_engine_app.command("serve")
def sim_engine_serve_cmd(
    model: Annotated[str, typer.Option(help="Model, e.g. llama-3-8b (the served model name).")],
    gpu: Annotated[str, typer.Option(help="GPU type: A10, A100, H100.")],
    gpus: Annotated[
        int | None, typer.Option(help="GPUs of the instance (default: fewest that fit).")
    ] = None,
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8001,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    time_scale: Annotated[
        float, typer.Option(help="Simulated seconds per real second (> 1: faster than real).")
    ] = 1.0,
    dev_mode: Annotated[
        bool,
        typer.Option(
            "--dev-mode",
            help="Serve /sleep, /wake_up, /is_sleeping (vLLM: VLLM_SERVER_DEV_MODE=1).",
        ),
    ] = False,
    eos_lengths: Annotated[
        str,
        typer.Option(
            help="Without ignore_eos, output lengths come from this length sample (sharegpt, arxiv, a trace or file), or 'max_tokens'."
        ),
    ] = "sharegpt",
    seed: Annotated[int, typer.Option(help="Seed of the output-length draw.")] = 0,
    max_num_seqs: Annotated[
        int | None,
        typer.Option(
            help="Requests run at once (vLLM's --max-num-seqs; default: vLLM's for the GPU)."
        ),
    ] = None,
    scheduling_policy: Annotated[
        str,
        typer.Option(
            help="vLLM's --scheduling-policy: fcfs (its default) refuses a priority other than 0, "
            "as vLLM documents; priority accepts it (QLM sends priorities: use priority)."
        ),
    ] = "fcfs",
    stream_interval: Annotated[
        int,
        typer.Option(
            help="Tokens per streamed chunk after the first (vLLM's --stream-interval; 1: each)."
        ),
    ] = 1,
) -> None:
    """Serve one simulated instance with the same HTTP API as `vllm serve`."""
    from qlm.engines.server import SCHEDULING_POLICIES, SchedulingPolicy, serve

    if time_scale <= 0:
        _fail(f"--time-scale must be > 0, got {time_scale}")
    if max_num_seqs is not None and max_num_seqs < 1:
        _fail(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
    if scheduling_policy not in SCHEDULING_POLICIES:
        _fail(f"--scheduling-policy must be fcfs or priority, got {scheduling_policy!r}")
    if stream_interval < 1:
        _fail(f"--stream-interval must be >= 1, got {stream_interval}")
    policy: SchedulingPolicy = "priority" if scheduling_policy == "priority" else "fcfs"
    err_console.print(
        f"simulated vLLM: {model} on {f'{gpus}x' if gpus else ''}{gpu} at http://{host}:{port} "
        f"(time x{time_scale:g}, {policy} scheduling{', dev mode' if dev_mode else ''})",
        highlight=False,
        soft_wrap=True,
    )
    _guard(
        lambda: serve(
            model=model,
            gpu=gpu,
            gpu_count=gpus,
            host=host,
            port=port,
            time_scale=time_scale,
            dev_mode=dev_mode,
            eos_lengths=eos_lengths,
            seed=seed,
            max_num_seqs=max_num_seqs,
            scheduling_policy=policy,
            stream_interval=stream_interval,
        )
    )


instance_app = typer.Typer(
    help="Real serving instances (vLLM) for QLM.", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(instance_app, name="instance")


@instance_app.command("launch")
def instance_launch_cmd(
    model: Annotated[str, typer.Option(help="Model to serve (Hugging Face id or local path).")],
    port: Annotated[int, typer.Option(help="Port of the vLLM server.")] = 8000,
    host: Annotated[
        str | None, typer.Option(help="Address to bind (vLLM's default if unset).")
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="Name QLM and clients use for the model.")
    ] = None,
    sleep_mode: Annotated[
        bool,
        typer.Option(
            "--sleep-mode", help="Enable sleep mode (warm starts) and the dev-mode endpoints."
        ),
    ] = False,
    kv_offload_gb: Annotated[
        float | None, typer.Option(help="CPU KV-cache offloading buffer in GiB (native backend).")
    ] = None,
    tool_call_parser: Annotated[
        str | None,
        typer.Option(help="vLLM's tool-call parser for the model (hermes, llama3_json, ...)."),
    ] = None,
    stream_interval: Annotated[
        int | None,
        typer.Option(
            help="Tokens vLLM buffers per streamed chunk (--stream-interval): fewer events for "
            "the agents to parse (docs/engines.md)."
        ),
    ] = None,
    print_only: Annotated[
        bool, typer.Option("--print-only", help="Print the command instead of running it.")
    ] = False,
) -> None:
    """Start `vllm serve` with the flags QLM needs (priority scheduling, request-id headers,
    sleep mode, CPU KV offloading, tool calling)."""
    import os
    import subprocess

    from qlm.engines.vllm import VLLM_VERSION, vllm_installed, vllm_serve_command

    command = _guard(
        lambda: vllm_serve_command(
            model,
            port=port,
            host=host,
            served_model_name=served_model_name,
            sleep_mode=sleep_mode,
            kv_offload_gb=kv_offload_gb,
            tool_call_parser=tool_call_parser,
            stream_interval=stream_interval,
        )
    )
    if print_only:
        sys.stdout.write(command.shell() + "\n")
        return
    if not vllm_installed():
        sys.stdout.write(command.shell() + "\n")
        _fail(
            f"vLLM is not installed; install it (pip install 'qlm[vllm]', tested with {VLLM_VERSION}) and run the command above"
        )
    env = {**os.environ, **dict(command.env)}
    raise typer.Exit(subprocess.call(list(command.argv), env=env))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
