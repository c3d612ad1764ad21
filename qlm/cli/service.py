"""The commands that run QLM's services: ``qlm controller``, ``qlm serve`` (all in one process)
and ``qlm api`` (``qlm.service``, ``qlm.api.server``)."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from qlm.cli.common import console, fail, guard
from qlm.cli.logs import configure_logging

if TYPE_CHECKING:
    from qlm.settings import Settings


def traced(settings: Settings) -> Settings:
    """Start tracing when ``QLM_TRACING=otel`` (``qlm.tracing``); a missing package or exporter
    stops the command with one line, before it does anything else."""
    if settings.tracing == "otel":
        from qlm import tracing

        guard(tracing.enable)
    return settings


def controller_cmd() -> None:
    """Run the controller service: consume the global queue, plan, drive the instances, record
    outcomes. Configured by QLM_BROKER_URL, QLM_DATABASE_URL, QLM_INSTANCES_FILE and
    QLM_CONTROLLER__* (docs/operations.md); with none set it runs on embedded defaults. A second
    controller on the same broker waits as standby and takes over when the active one stops."""
    from qlm.eventloop import run
    from qlm.service import run_controller
    from qlm.settings import get_settings

    configure_logging()
    settings = traced(get_settings())
    guard(lambda: run(run_controller(settings)))


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
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the replay's summary as JSON (with --replay).")
    ] = False,
) -> None:
    """The all-in-one process: controller, agents and the REST API (QLM_API__HOST:QLM_API__PORT,
    default 127.0.0.1:8080) on one queue. With no settings: in-process queue, SQLite (./qlm.db)
    and simulated instances; create a key with `qlm keys create --tenant NAME` (docs/api.md)."""
    from qlm.eventloop import run
    from qlm.service.serve import serve
    from qlm.settings import get_settings

    if as_json and replay is None:
        fail("--json is for the summary of a replay: give --replay SECONDS too")
    configure_logging()
    settings = traced(get_settings())
    if sim_http:
        controller = settings.controller.model_copy(update={"sim_over_http": True})
        settings = settings.model_copy(update={"controller": controller})
    result = guard(lambda: run(serve(settings, replay_s=replay)))
    if result is None:
        return
    flag = " --sim-http" if settings.controller.sim_over_http else ""
    command = f"qlm serve --replay {replay:g}{flag}"
    if as_json:
        summary = {
            "command": command,
            "requests": result.requests,
            "finished": result.finished,
            "failed": result.failed,
            "slo_met": result.slo_met,
            "slo_attainment": result.attainment,
            "wall_s": result.wall_s,
        }
        sys.stdout.write(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    else:
        console.print(
            f"replayed {result.requests} requests in {result.wall_s:.1f} s: "
            f"{result.finished} finished, {result.failed} failed, "
            f"SLO attainment {100 * result.attainment:.1f} %",
            highlight=False,
        )
        console.print(f"reproduce: {command}", highlight=False)


def api_cmd() -> None:
    """Run the REST API alone (a controller runs elsewhere: `qlm controller`), on
    QLM_API__HOST:QLM_API__PORT (default 127.0.0.1:8080). Configured by QLM_BROKER_URL,
    QLM_DATABASE_URL and QLM_API__* (docs/api.md)."""
    from qlm.api.server import run_api
    from qlm.eventloop import run
    from qlm.settings import get_settings

    configure_logging()
    settings = traced(get_settings())
    guard(lambda: run(run_api(settings)))
