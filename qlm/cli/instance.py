"""``qlm instance``: real serving instances — ``vllm serve`` started with the flags QLM needs
(``qlm.engines.vllm``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any

import typer

from qlm.cli.common import fail, guard

if TYPE_CHECKING:
    from qlm.engines.vllm_launch import ColocatedServer, VllmCommand

instance_app = typer.Typer(
    help="Real serving instances (vLLM) for QLM.", no_args_is_help=True, rich_markup_mode=None
)


@instance_app.command("launch")
def instance_launch_cmd(
    model: Annotated[
        list[str],
        typer.Option(
            help="Model to serve (Hugging Face id or local path). Give it once per model to "
            "start one GPU's servers for warm starts: one per model, on --port, --port + 1, "
            "..., each in sleep mode and put to sleep before the next starts."
        ),
    ],
    port: Annotated[int, typer.Option(help="Port of the vLLM server.")] = 8000,
    host: Annotated[
        str | None, typer.Option(help="Address to bind (vLLM's default if unset).")
    ] = None,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(help="Name QLM and clients use for the model (once per --model)."),
    ] = None,
    gpu_share: Annotated[
        float,
        typer.Option(
            help="With several models: each server's --gpu-memory-utilization, the share of the "
            "GPU it takes when it is the one awake."
        ),
    ] = 0.85,
    sleep_mode: Annotated[
        bool,
        typer.Option(
            "--sleep-mode", help="Enable sleep mode (warm starts; needs the dev-mode endpoints)."
        ),
    ] = False,
    dev_mode: Annotated[
        bool,
        typer.Option(
            "--dev-mode/--no-dev-mode",
            help="Serve vLLM's dev-mode endpoints (VLLM_SERVER_DEV_MODE=1): /abort_requests "
            "(frees an evicted request at once), /server_info (max_num_seqs), /sleep. They "
            "take no API key: keep the server reachable by QLM only.",
        ),
    ] = True,
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
    python: Annotated[
        str | None,
        typer.Option(
            help="Python of vLLM's environment: start `python -m "
            "vllm.entrypoints.openai.api_server` with it (default: `vllm serve` where that "
            "command works, else this module with the Python beside it or QLM's)."
        ),
    ] = None,
    print_only: Annotated[
        bool, typer.Option("--print-only", help="Print the command instead of running it.")
    ] = False,
) -> None:
    """Start `vllm serve` with the flags QLM needs (priority scheduling, request-id headers,
    sleep mode, CPU KV offloading, tool calling). Where the `vllm` command does not work
    (vLLM's CPU build), `python -m vllm.entrypoints.openai.api_server` instead. With several
    --model: one GPU's servers, one per model, started one at a time and each put to sleep
    (level 1) before the next starts; then it prints the instances file's `servers` table."""
    import os
    import subprocess

    from qlm.engines.vllm import VLLM_VERSION
    from qlm.engines.vllm_launch import vllm_launcher, vllm_serve_command

    if len(model) > 1:
        _launch_colocated(
            model,
            port=port,
            host=host,
            served_model_names=served_model_name or (),
            gpu_share=gpu_share,
            flags={
                "dev_mode": dev_mode,
                "kv_offload_gb": kv_offload_gb,
                "tool_call_parser": tool_call_parser,
                "stream_interval": stream_interval,
            },
            python=python,
            print_only=print_only,
        )
        return
    if served_model_name and len(served_model_name) > 1:
        fail("--served-model-name: give one per --model (1)")

    def command_with(interpreter: str | None) -> VllmCommand:
        return guard(
            lambda: vllm_serve_command(
                model[0],
                port=port,
                host=host,
                served_model_name=served_model_name[0] if served_model_name else None,
                sleep_mode=sleep_mode,
                dev_mode=dev_mode,
                kv_offload_gb=kv_offload_gb,
                tool_call_parser=tool_call_parser,
                stream_interval=stream_interval,
                python=interpreter,
            )
        )

    if print_only:
        sys.stdout.write(command_with(python).shell() + "\n")
        return
    launcher = vllm_launcher(python)
    if launcher is None:
        sys.stdout.write(command_with(python).shell() + "\n")
        fail(
            f"vLLM is not installed; install it (pip install 'qlm[vllm]', tested with {VLLM_VERSION}) and run the command above"
        )
    command = command_with(launcher[1])
    env = {**os.environ, **dict(command.env)}
    raise typer.Exit(subprocess.call(list(command.argv), env=env))


def _launch_colocated(
    models: list[str],
    *,
    port: int,
    host: str | None,
    served_model_names: Sequence[str],
    gpu_share: float,
    flags: dict[str, Any],
    python: str | None,
    print_only: bool,
) -> None:
    """One GPU's servers, one per model (``qlm instance launch --model A --model B ...``)."""
    from qlm.engines.vllm import VLLM_VERSION
    from qlm.engines.vllm_launch import (
        colocated_servers,
        servers_entry,
        start_asleep,
        stop_all,
        vllm_launcher,
    )

    def servers_with(interpreter: str | None) -> list[ColocatedServer]:
        return guard(
            lambda: colocated_servers(
                models, port=port, host=host, served_model_names=served_model_names,
                gpu_share=gpu_share, python=interpreter, **flags,
            )
        )  # fmt: skip

    if print_only:
        servers = servers_with(python)
        for s in servers:
            sys.stdout.write(s.command.shell() + "\n")
        sys.stdout.write("# one at a time, each put to sleep (POST /sleep?level=1) first\n")
        sys.stdout.write(f"# {servers_entry(servers)}\n")
        return
    launcher = vllm_launcher(python)
    if launcher is None:
        for s in servers_with(python):
            sys.stdout.write(s.command.shell() + "\n")
        fail(
            f"vLLM is not installed; install it (pip install 'qlm[vllm]', tested with "
            f"{VLLM_VERSION}) and run the commands above"
        )
    servers = servers_with(launcher[1])

    def say(line: str) -> None:
        sys.stderr.write(line + "\n")

    procs = guard(lambda: start_asleep(servers, say=say))
    sys.stdout.write(servers_entry(servers) + "\n")
    sys.stdout.flush()
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(1.0)
        gone = next(p for p in procs if p.returncode is not None)
        sys.stderr.write(f"the server at {servers[procs.index(gone)].url} exited with "
                         f"{gone.returncode}: stopping the others\n")  # fmt: skip
    finally:
        stop_all(procs)
    raise typer.Exit(gone.returncode or 1)
