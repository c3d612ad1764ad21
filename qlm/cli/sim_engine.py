"""``qlm sim-engine``: one simulated vLLM instance behind vLLM's HTTP API
(``qlm.engines.server``)."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from qlm.cli.common import fail, guard
from qlm.cli.logs import configure_logging

log = logging.getLogger(__name__)

sim_engine_app = typer.Typer(
    help="A simulated vLLM instance behind vLLM's HTTP API (docs/engines.md).",
    no_args_is_help=True,
    rich_markup_mode=None,
)


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
    kv_offloading_size: Annotated[
        float | None,
        typer.Option(
            help="vLLM's --kv-offloading-size (GiB): CPU memory that keeps the KV blocks of "
            "ended requests, so a prompt that begins with them is computed only past them "
            "(what QLM's KV swap uses). Default: none."
        ),
    ] = None,
    perf_model: Annotated[
        str | None,
        typer.Option(
            help="Step times: default (the fitted profiles), splitwise (Splitwise's measured table) or a CSV file of its shape. Default: QLM_SIM__PERF_MODEL, else default."
        ),
    ] = None,
    kv_memory: Annotated[
        str | None,
        typer.Option(
            help="How the KV cache is sized: vllm or splitwise. Default: QLM_SIM__KV_MEMORY, else vllm."
        ),
    ] = None,
) -> None:
    """Serve one simulated instance with the same HTTP API as `vllm serve`."""
    from qlm.cli.simulate import sim_catalog
    from qlm.engines.server import SCHEDULING_POLICIES, SchedulingPolicy, serve

    if time_scale <= 0:
        fail(f"--time-scale must be > 0, got {time_scale}")
    if max_num_seqs is not None and max_num_seqs < 1:
        fail(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
    if scheduling_policy not in SCHEDULING_POLICIES:
        fail(f"--scheduling-policy must be fcfs or priority, got {scheduling_policy!r}")
    if stream_interval < 1:
        fail(f"--stream-interval must be >= 1, got {stream_interval}")
    if kv_offloading_size is not None and kv_offloading_size <= 0:
        fail(f"--kv-offloading-size must be > 0, got {kv_offloading_size}")
    policy: SchedulingPolicy = "priority" if scheduling_policy == "priority" else "fcfs"
    from qlm.api.server import bind

    sock = guard(lambda: bind(host, port, settings=("--host", "--port")))
    configure_logging()
    catalog = guard(lambda: sim_catalog(None, perf_model, kv_memory))

    def lengths() -> list[int]:
        """The output lengths a request without ignore_eos ends after (none: at max_tokens)."""
        if eos_lengths == "max_tokens":
            return []
        from qlm.sim.traces import load_lengths

        return [int(x) for x in load_lengths(eos_lengths).output_tokens]

    log.info(
        "simulated vLLM: %s on %s%s at http://%s:%d (time x%g, %s scheduling%s)",
        model,
        f"{gpus}x" if gpus else "",
        gpu,
        host,
        sock.getsockname()[1],
        time_scale,
        policy,
        ", dev mode" if dev_mode else "",
    )
    guard(
        lambda: serve(
            model=model,
            gpu=gpu,
            gpu_count=gpus,
            host=host,
            port=port,
            time_scale=time_scale,
            dev_mode=dev_mode,
            eos_lengths=lengths(),
            seed=seed,
            max_num_seqs=max_num_seqs,
            scheduling_policy=policy,
            stream_interval=stream_interval,
            kv_offloading_gb=kv_offloading_size,
            catalog=catalog,
            sock=sock,
        )
    )
