"""What ``qlm profile`` runs: the estimator's profiles measured and written to a profile file.

The measurements are taken by ``qlm.profiling.sim`` (batches on a simulated instance) and
``qlm.profiling.vllm`` (on a vLLM server over HTTP), and fitted by ``qlm.rct.fit``. Here they are
pointed at a catalog entry, a server or a trace, and their results merged into a file
(docs/estimator.md#profiles).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from qlm.domain import InstanceSpec
from qlm.engines.perf_model import HardwareCatalog, default_catalog
from qlm.errors import QLMError
from qlm.profiling.sim import profile_sim_hardware
from qlm.rct.fit import profile_workload
from qlm.rct.output_model import NIG
from qlm.rct.profile import HardwareProfile, RctProfile, dump_profile, parse_profile
from qlm.sim.traces import load_lengths

if TYPE_CHECKING:
    from qlm.profiling.vllm import ServerSettings

WORKLOAD_PRIORS = ("azure-conv", "azure-code", "mooncake-conversation", "sharegpt", "arxiv")
"""The shipped traces and length samples whose priors the shipped profile holds."""


def merge_into(out: Path, addition: RctProfile) -> RctProfile:
    """Write ``addition`` into the profile file ``out`` (its entries over the file's; a new
    file if there is none) and return what the file now holds."""
    merged = (
        parse_profile(out.read_text(encoding="utf-8"), str(out)).merged(addition)
        if out.exists()
        else addition
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_profile(merged), encoding="utf-8")
    return merged


def profile_hardware(
    model: str, gpu: str, gpus: int | None, input_tokens: int, output_tokens: int
) -> HardwareProfile:
    """The hardware profile of a simulated instance of ``model`` on ``gpus`` (default: the
    fewest that fit) ``gpu``s, from profiling batches of the given lengths."""
    catalog = default_catalog()
    count = gpus if gpus is not None else catalog.default_gpu_count(model, gpu)
    perf = catalog.perf_model(model, gpu, count)
    return profile_sim_hardware(perf, input_tokens=input_tokens, output_tokens=output_tokens)


def profile_fleet(specs: Sequence[InstanceSpec], catalog: HardwareCatalog) -> RctProfile:
    """The hardware profile of every (model, GPU, GPU count) of a simulated fleet, measured on
    the catalog's performance models (the batches ``qlm profile all`` runs): what the estimator
    needs when the instances do not run on the shipped ones (``--perf-model``, ``--kv-memory``)."""
    hardware = {}
    for key in sorted({(m, s.gpu, s.gpu_count) for s in specs for m in s.models}):
        hw = profile_sim_hardware(catalog.perf_model(*key), input_tokens=1024, output_tokens=256)
        hardware[hw.key] = hw
    return RctProfile(hardware=hardware)


def simulated_fleet(
    instances: str, perf_model: str = "default", kv_memory: str = "vllm"
) -> tuple[HardwareCatalog | None, list[InstanceSpec], RctProfile]:
    """A fleet shorthand on the performance models named (``--perf-model``, ``--kv-memory``):
    the catalog (None: the shipped one), the instances, and the estimator's profile (the shipped
    one, with the fleet profiled on the chosen models when they are not the shipped ones)."""
    from qlm.engines.perf_table import load_catalog
    from qlm.fleet import parse_instances
    from qlm.rct.profile import default_profile

    if perf_model == "default" and kv_memory == "vllm":
        return None, parse_instances(instances), default_profile()
    catalog = load_catalog(perf_model, kv_memory)
    specs = parse_instances(instances, catalog)
    return catalog, specs, default_profile().merged(profile_fleet(specs, catalog))


def workload_prior(trace: str) -> NIG:
    """The output-length prior fitted from a trace's (or length sample's) output lengths."""
    outputs = [int(x) for x in load_lengths(trace).output_tokens]
    return profile_workload(outputs)


def profile_server(
    url: str,
    model: str,
    gpu: str,
    gpus: int,
    settings: ServerSettings,
    input_tokens: int,
    output_tokens: int,
    time_scale: float,
) -> HardwareProfile:
    """The hardware profile of the vLLM server at ``url`` serving ``model``, measured over its
    HTTP API (``time_scale``: server seconds per real second)."""
    from qlm.clock import WallClock
    from qlm.engines.vllm import VllmEngine
    from qlm.profiling.vllm import profile_engine

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


def profile_shipped() -> RctProfile:
    """Every shipped (model, GPU) combination and every shipped workload: the profile QLM ships
    (``qlm/data/rct_profile.json``)."""
    catalog = default_catalog()
    hardware = {}
    for model, gpu, count in sorted(catalog.perf):
        hw = profile_hardware(model, gpu, count, 1024, 256)
        hardware[hw.key] = hw
    priors = {t: workload_prior(t) for t in WORKLOAD_PRIORS}
    priors["default"] = priors["azure-conv"]
    return RctProfile(hardware=hardware, output_priors=priors)
