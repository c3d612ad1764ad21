"""``qlm instance``: real serving instances — ``vllm serve`` started with the flags QLM needs
(``qlm.engines.vllm``)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from qlm.cli.common import fail, guard

if TYPE_CHECKING:
    from qlm.engines.vllm_launch import VllmCommand

instance_app = typer.Typer(
    help="Real serving instances (vLLM) for QLM.", no_args_is_help=True, rich_markup_mode=None
)


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
    (vLLM's CPU build), `python -m vllm.entrypoints.openai.api_server` instead."""
    import os
    import subprocess

    from qlm.engines.vllm import VLLM_VERSION
    from qlm.engines.vllm_launch import vllm_launcher, vllm_serve_command

    def command_with(interpreter: str | None) -> VllmCommand:
        return guard(
            lambda: vllm_serve_command(
                model,
                port=port,
                host=host,
                served_model_name=served_model_name,
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
