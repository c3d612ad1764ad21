"""``qlm profile``: measure the estimator's hardware profiles and workload priors and write
them to a profile file (``qlm.profiling``)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from qlm.cli.common import console, fail, guard

if TYPE_CHECKING:
    from qlm.rct.profile import HardwareProfile

JsonOption = Annotated[
    bool,
    typer.Option("--json", help="Print what was written as JSON (the file's fields) instead."),
]


profile_app = typer.Typer(
    help="Profile hardware and workloads for the completion-time estimator.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


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
    as_json: JsonOption = False,
) -> None:
    """Run profiling batches on a simulated instance and fit its hardware parameters."""
    from qlm.profiling import merge_into, profile_hardware
    from qlm.rct.profile import RctProfile

    hw = guard(lambda: profile_hardware(model, gpu, gpus, input_tokens, output_tokens))
    guard(lambda: merge_into(out, RctProfile(hardware={hw.key: hw})))
    _print_hardware(hw, out, as_json)


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
    as_json: JsonOption = False,
) -> None:
    """Run profiling batches on a vLLM server over its HTTP API and fit its hardware parameters
    (prompts are random, so its prefix cache cannot help; a few minutes on a GPU)."""
    from qlm.engines.perf_model import default_catalog
    from qlm.errors import QLMError
    from qlm.profiling import merge_into, profile_server
    from qlm.profiling.vllm import ServerSettings
    from qlm.rct.profile import RctProfile

    for name, value in (
        ("--max-num-seqs", max_num_seqs),
        ("--gpus", gpus),
        ("--max-context", max_context),
    ):
        if value < 1:
            fail(f"{name} must be >= 1, got {value}")
    if max_num_batched_tokens < 0:
        fail(f"--max-num-batched-tokens must be >= 0 (0: unknown), got {max_num_batched_tokens}")
    if input_tokens < 1 or output_tokens < 4:
        fail(
            "--input-tokens must be >= 1 and --output-tokens >= 4 (decode time is measured "
            f"between two output lengths), got {input_tokens} and {output_tokens}"
        )
    if time_scale <= 0:
        fail(f"--time-scale must be > 0, got {time_scale}")
    for name, load in (("--warm-load-s", warm_load_s), ("--cold-load-s", cold_load_s)):
        if load is not None and load < 0:
            fail(f"{name} must be >= 0, got {load}")
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
    hw = guard(
        lambda: profile_server(
            url, model, gpu, gpus, settings, input_tokens, output_tokens, time_scale
        )
    )
    guard(lambda: merge_into(out, RctProfile(hardware={hw.key: hw})))
    _print_hardware(hw, out, as_json)


def _print_json(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _print_hardware(hw: HardwareProfile, out: Path, as_json: bool) -> None:
    if as_json:
        _print_json({"out": str(out), "hardware": [dataclasses.asdict(hw)]})
        return
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
    as_json: JsonOption = False,
) -> None:
    """Fit the output-length prior of a workload from a trace (the estimator looks a request's
    prior up by its model, then 'default')."""
    if not name:
        fail("--name must not be empty (a model name or 'default')")
    from qlm.profiling import merge_into, workload_prior
    from qlm.rct.profile import RctProfile

    key, prior = name, guard(lambda: workload_prior(trace))
    guard(lambda: merge_into(out, RctProfile(output_priors={key: prior})))
    if as_json:
        _print_json({"out": str(out), "output_priors": {key: dataclasses.asdict(prior)}})
        return
    console.print(
        f"prior {key!r}: log-mean {prior.mu:.3f}, predictive log-sd {prior.predictive_log_sd:.3f} -> {out}",
        highlight=False,
        soft_wrap=True,
    )


@profile_app.command("all")
def profile_all_cmd(
    out: Annotated[Path, typer.Option(help="Profile file to write (replaced).")],
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print what was written as JSON (counts and the file)."),
    ] = False,
) -> None:
    """Profile every shipped (model, GPU) combination and every shipped workload; this is how
    qlm/data/rct_profile.json is made."""

    from qlm.profiling import profile_shipped
    from qlm.rct.profile import dump_profile

    profile = guard(profile_shipped)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_profile(profile), encoding="utf-8")
    if as_json:
        _print_json(
            {
                "out": str(out),
                "hardware": len(profile.hardware),
                "output_priors": len(profile.output_priors),
            }
        )
        return
    console.print(
        f"{len(profile.hardware)} hardware profiles and {len(profile.output_priors)} priors -> {out}",
        highlight=False,
        soft_wrap=True,
    )
