"""``qlm simulate`` and ``qlm demo``: a replay on simulated instances (``qlm.sim.run``), its
summary printed as a table or JSON, and the command line that reproduces it."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.markup import escape

from qlm.cli.common import console, err_console, fail, guard

if TYPE_CHECKING:
    from qlm.engines.perf_model import HardwareCatalog
    from qlm.planner import BaselineConfig, PlannerConfig
    from qlm.rct.profile import RctProfile
    from qlm.sim.cluster import SimResult
    from qlm.sim.run import Simulation

POLICIES = ("fcfs", "fcfs-rr", "edf", "sedf", "priority", "proserve", "shepherd", "qlm", "qlm-rr")
"""``qlm.planner.POLICIES``, named here so that ``qlm --help`` does not import the planner
(tests/unit/cli/test_cli.py checks that they agree)."""

PRESETS = ("default", "wa", "wb", "wc")
"""``qlm.sim.workload.PRESETS``, named here for the same reason."""


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "-"
    if pct:
        return f"{100 * x:.1f} %"
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def print_summary(result: SimResult, command: str) -> None:
    from rich.table import Table

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
    for name, v in s["slo_attainment_by_class"].items():
        if "ttft_attainment" in v:
            table.add_row(
                f"  TTFT SLO met, class {name} ({v['ttft_requests']})",
                _fmt(v["ttft_attainment"], pct=True),
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
        if "max_wait_promoted" in plan:
            table.add_row("served ahead of the plan (maximum wait)", str(plan["max_wait_promoted"]))
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
    ttft_slo: Annotated[
        str | None,
        typer.Option(
            help="Time-to-first-token SLOs by SLO class, e.g. interactive=1.5,standard=5 (seconds; scaled by --slo-scale)."
        ),
    ] = None,
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
    perf_model: Annotated[
        str | None,
        typer.Option(
            help="Step times of the simulated instances: default (the fitted profiles), splitwise (Splitwise's measured table) or a CSV file of its shape (docs/simulator.md). Default: QLM_SIM__PERF_MODEL, else default."
        ),
    ] = None,
    kv_memory: Annotated[
        str | None,
        typer.Option(
            help="How the KV cache is sized: vllm or splitwise (Splitwise's rule). Default: QLM_SIM__KV_MEMORY, else vllm."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    out: Annotated[
        Path | None, typer.Option(help="Write requests.csv and summary.json here.")
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Replay a trace or synthetic workload on simulated vLLM instances under a policy."""
    if arrival not in ("poisson", "gamma"):
        fail(f"--arrival must be poisson or gamma, got {arrival!r}")
    arrival_kind: Literal["poisson", "gamma"] = "gamma" if arrival == "gamma" else "poisson"
    from qlm.errors import WorkloadError
    from qlm.sim.run import prepare_simulation
    from qlm.sim.workload import parse_ttft_slo

    try:
        ttft = None if ttft_slo is None else parse_ttft_slo(ttft_slo)
    except WorkloadError as exc:
        fail(f"--ttft-slo: {exc}")

    catalog = guard(lambda: sim_catalog(ctx, perf_model, kv_memory))
    result = guard(
        lambda: _run(
            lambda: prepare_simulation(
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
                profile=_fleet_profile(instances, catalog),
                planner=_sim_planner(),
                baselines=_baselines(),
                ttft_slo=ttft,
                catalog=catalog,
            ),
            show_progress=progress and not as_json and sys.stderr.isatty(),
        )
    )
    _emit(result, ctx, as_json=as_json, out=out)


def sim_catalog(
    ctx: typer.Context | None, perf_model: str | None, kv_memory: str | None
) -> HardwareCatalog | None:
    """The performance models ``--perf-model`` and ``--kv-memory`` name (unset: the
    ``QLM_SIM__*`` settings); None for the shipped ones. The values chosen are written back to
    ``ctx`` so that the reproducing command line spells them out."""
    from qlm.engines.perf_table import load_catalog
    from qlm.settings import get_settings

    sim = get_settings().sim
    perf_model = sim.perf_model if perf_model is None else perf_model
    kv_memory = sim.kv_memory if kv_memory is None else kv_memory
    if ctx is not None:
        ctx.params["perf_model"] = None if perf_model == "default" else perf_model
        ctx.params["kv_memory"] = None if kv_memory == "vllm" else kv_memory
    if perf_model == "default" and kv_memory == "vllm":
        return None
    return load_catalog(perf_model, kv_memory)


def _fleet_profile(instances: str, catalog: HardwareCatalog | None) -> Callable[[], RctProfile]:
    """The estimator's profile: the settings' one; on other performance models than the
    shipped ones, with the fleet's hardware profiled on them (``qlm.profiling.profile_fleet``)."""
    if catalog is None:
        return _settings_profile

    def profile() -> RctProfile:
        from qlm.fleet import parse_instances
        from qlm.profiling import profile_fleet

        fleet = profile_fleet(parse_instances(instances, catalog), catalog)
        return _settings_profile().merged(fleet)

    return profile


def _settings_profile() -> RctProfile:
    """The estimator's profile the settings name (``QLM_PROFILE_FILE`` over the shipped one)."""
    from qlm.settings import get_settings
    from qlm.wiring import rct_profile

    return rct_profile(get_settings())


def _run(prepare: Callable[[], Simulation], *, show_progress: bool) -> SimResult:
    """Build the run, then replay it, with a progress bar on stderr if asked."""
    sim = prepare()
    if not show_progress:
        return sim.run()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(
        TextColumn("[bold]simulating[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task("sim", total=len(sim.requests))
        return sim.run(progress=lambda done, _total: bar.update(task, completed=done))


def _sim_planner() -> PlannerConfig:
    """The ``QLM_PLANNER__*`` settings, with the compute budget counted in scored orders so
    that a simulated run is the same on any machine."""
    from qlm.planner import PlannerConfig
    from qlm.settings import get_settings
    from qlm.wiring import planner_config

    config = planner_config(get_settings().planner)
    return dataclasses.replace(config, budget=PlannerConfig.for_simulation().budget)


def _baselines() -> BaselineConfig:
    """The baselines' parameters (``QLM_BASELINES__*``)."""
    from qlm.settings import get_settings
    from qlm.wiring import baseline_config

    return baseline_config(guard(get_settings).baselines)


def _emit(result: SimResult, ctx: typer.Context, *, as_json: bool, out: Path | None) -> None:
    from qlm.sim.metrics import write_outputs

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


def demo_cmd(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summaries as JSON.")] = False,
) -> None:
    """The main job on embedded defaults: a short replay of a real trace on simulated instances,
    under FCFS (what vLLM does alone) and under QLM, on the same seed, side by side.

    Settings come from QLM_DEMO__* (trace, workload, instances, policies, duration_s,
    rate_scale, seed) and QLM_SIM__* (perf_model, kv_memory).
    """

    from qlm.settings import get_settings
    from qlm.sim.run import prepare_simulation

    d = guard(lambda: get_settings().demo)
    policies = [p.strip() for p in d.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if not policies or unknown or len(set(policies)) < len(policies):
        fail(
            f"setting QLM_DEMO__POLICIES: {d.policies!r} is not a comma-separated list of "
            f"distinct policies among {', '.join(POLICIES)}"
        )

    catalog = guard(lambda: sim_catalog(None, None, None))

    def run(policy: str) -> SimResult:
        if not as_json:
            err_console.print(f"replaying under [bold]{policy}[/] ...", highlight=False)
        return _run(
            lambda: prepare_simulation(
                trace=d.trace,
                workload=d.workload,
                instances=d.instances,
                policy=policy,
                seed=d.seed,
                start_s=0.0,
                duration_s=d.duration_s,
                rate_scale=d.rate_scale,
                slo_scale=1.0,
                synthetic_rate=None,
                arrival="poisson",
                cv=1.0,
                profile=_fleet_profile(d.instances, catalog),
                planner=_sim_planner(),
                baselines=_baselines(),
                catalog=catalog,
            ),
            show_progress=not as_json and sys.stderr.isatty(),
        )

    results = [guard(lambda p=p: run(p)) for p in policies]  # type: ignore[misc]
    command = _command_line(ctx)
    if as_json:
        out = {
            "command": command,
            "policies": {r.policy: r.summary for r in results},
            "difference": _difference(results[0].summary, results[-1].summary)
            if len(results) > 1
            else {},
        }
        sys.stdout.write(json.dumps(out, indent=2, sort_keys=True) + "\n")
    else:
        print_comparison(results, command)


def _compared(s: dict[str, Any]) -> list[tuple[str, float | None, str]]:
    """(label, value, unit) of what the demo compares: ``%`` values are shares (0-1)."""
    rows: list[tuple[str, float | None, str]] = [("SLO attainment", s["slo_attainment"], "%")]
    shown: list[list[tuple[int, float | None]]] = []
    for title, key in (("class", "slo_attainment_by_class"), ("tier", "slo_attainment_by_tier")):
        parts = sorted((v["requests"], v["slo_attainment"]) for v in s[key].values())
        if len(s[key]) > 1 and parts not in shown:  # (a workload whose classes are its tiers)
            shown.append(parts)
            for name, v in s[key].items():
                rows.append(
                    (f"  {title} {name} ({v['requests']} requests)", v["slo_attainment"], "%")
                )
    rows += [
        ("throughput (req/s)", s["throughput_rps"], ""),
        ("TTFT p50 (s)", s["ttft_s"]["p50"], "s"),
        ("TTFT p99 (s)", s["ttft_s"]["p99"], "s"),
        ("end-to-end p50 (s)", s["e2e_s"]["p50"], "s"),
        ("end-to-end p99 (s)", s["e2e_s"]["p99"], "s"),
        ("queueing p99 (s)", s["queue_s"]["p99"], "s"),
    ]
    return rows


def _difference(first: dict[str, Any], last: dict[str, Any]) -> dict[str, float | None]:
    """The last policy's figures minus the first's (attainment in percentage points)."""
    out: dict[str, float | None] = {}
    for (label, a, unit), (_, b, _) in zip(_compared(first), _compared(last), strict=True):
        if a is None or b is None:
            out[label.strip()] = None
        else:
            out[label.strip()] = (b - a) * (100.0 if unit == "%" else 1.0)
    return out


def print_comparison(results: Sequence[SimResult], command: str) -> None:
    """The policies' figures side by side (and the last one's difference from the first)."""
    from rich.table import Table

    if len(results) == 1:
        print_summary(results[0], command)
        return
    s0 = results[0].summary
    table = Table(
        title=f"QLM demo — {s0['requests']} requests of a real trace on simulated instances",
        title_justify="left",
    )
    table.add_column("metric")
    for r in results:
        table.add_column(r.policy, justify="right")
    first, last = results[0].policy, results[-1].policy
    table.add_column(f"{last} − {first}", justify="right")
    rows = [_compared(r.summary) for r in results]
    diff = _difference(results[0].summary, results[-1].summary)
    for k, (label, _, unit) in enumerate(rows[0]):
        values = [_fmt(row[k][1], pct=unit == "%") for row in rows]
        d = diff[label.strip()]
        shown = "—" if d is None else f"{d:+.1f} pt" if unit == "%" else f"{d:+.2f}"
        bold = label == "SLO attainment"
        cells = [f"[bold]{v}[/]" if bold else v for v in [*values, shown]]
        table.add_row(f"[bold]{label}[/]" if bold else label, *cells)
    console.print(table)
    console.print(
        "[dim]Same trace, seed and fleet for every policy. fcfs: vLLM's own first-come-first-served "
        "queue; qlm: request groups, the completion-time estimator and the planner.[/]",
        highlight=False,
    )
    console.print(f"[dim]reproduce: {escape(command)}[/]", highlight=False, soft_wrap=True)
