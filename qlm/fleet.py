"""A fleet in one line: ``2xA100:llama-3-8b,1xH100/4:llama-2-70b`` — ``qlm simulate
--instances``, and the simulated instances ``qlm serve`` runs without an instances file
(``QLM_CONTROLLER__SIM_INSTANCES``).

Each comma-separated item is ``[COUNTx]GPU[/GPUS_PER_INSTANCE]:MODEL[+MODEL...]``: COUNT instances
(default 1), each with GPUS_PER_INSTANCE GPUs of type GPU (default: the fewest with a shipped
profile for the first model, e.g. 2 for a 70B model on A100), serving the listed models (one
active at a time). Instances are named ``<gpu>-<n>`` in order, e.g. ``a100-0``, ``a100-1``.
"""

from __future__ import annotations

import re

from qlm.domain import InstanceSpec
from qlm.engines.perf_model import HardwareCatalog, default_catalog
from qlm.errors import ConfigError

_ITEM = re.compile(r"^(?:(\d+)\s*[xX]\s*)?([A-Za-z0-9_-]+)(?:/(\d+))?:([A-Za-z0-9_.+-]+)$")


def parse_instances(text: str, catalog: HardwareCatalog | None = None) -> list[InstanceSpec]:
    """Parse the shorthand; every GPU, model and combination is checked against the catalog."""
    catalog = catalog or default_catalog()
    specs: list[InstanceSpec] = []
    counters: dict[str, int] = {}
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise ConfigError("--instances is empty; expected e.g. 2xA100:llama-3-8b")
    for item in items:
        m = _ITEM.match(item)
        if m is None:
            raise ConfigError(
                f"--instances item {item!r} is not COUNTxGPU[/GPUS]:MODEL[+MODEL], "
                "e.g. 2xA100:llama-3-8b"
            )
        count = int(m.group(1) or 1)
        if count < 1:
            raise ConfigError(f"--instances item {item!r}: count must be >= 1")
        gpu = catalog.gpu(m.group(2)).name
        models = tuple(catalog.model(name).name for name in m.group(4).split("+"))
        per = int(m.group(3)) if m.group(3) else catalog.default_gpu_count(models[0], gpu)
        for model in models:
            catalog.perf_model(model, gpu, per)  # raises with the known combinations
        for _ in range(count):
            n = counters.get(gpu, 0)
            counters[gpu] = n + 1
            specs.append(
                InstanceSpec(name=f"{gpu.lower()}-{n}", gpu=gpu, models=models, gpu_count=per)
            )
    return specs
