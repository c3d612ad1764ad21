"""The instances a controller drives: an instances file, or simulated ones in-process.

An instances file is TOML, one ``[[instances]]`` table per serving instance::

    [[instances]]
    name = "a100-0"
    url = "http://10.0.0.5:8000"   # vLLM server or `qlm sim-engine serve`; omit: in-process sim
    gpu = "A100"                     # the hardware profile the estimator uses (any name for a
                                     # server: profile it, QLM_PROFILE_FILE; a simulated one
                                     # needs a GPU the simulator knows)
    models = ["llama-3-8b"]          # served model names
    gpu_count = 1                    # optional (default: the fewest GPUs the model fits on)
    max_num_seqs = 256               # optional: vLLM does not export it

Without a file the controller runs the embedded default: in-process simulated instances given by
the ``qlm simulate`` shorthand (``2xA100:llama-3-8b``), on the wall clock.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlm.clock import WallClock
from qlm.domain import InstanceSpec
from qlm.engines.base import Engine
from qlm.engines.perf_model import HardwareCatalog, default_catalog
from qlm.engines.sim import SimEngine, SimEngineConfig
from qlm.engines.vllm import VllmEngine
from qlm.engines.wallclock import WallClockEngine
from qlm.errors import ConfigError
from qlm.fleet import parse_instances


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    """One instance: where it is (``url``; empty: simulated in-process) and what it serves."""

    spec: InstanceSpec
    max_num_seqs: int | None = None

    @property
    def remote(self) -> bool:
        return bool(self.spec.url)


_KNOWN = {"name", "url", "gpu", "models", "gpu_count", "max_num_seqs"}


def load_instances(path: Path, catalog: HardwareCatalog | None = None) -> list[InstanceConfig]:
    """Read an instances file; a bad entry stops with one line naming the file and the field."""
    catalog = catalog or default_catalog()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"instances file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"instances file {path}: not valid TOML ({exc})") from None
    entries = data.get("instances")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"instances file {path}: needs at least one [[instances]] table")
    out = [_entry(path, i, entry, catalog) for i, entry in enumerate(entries)]
    names = [c.spec.name for c in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"instances file {path}: duplicate instance name {dup[0]!r}")
    return out


def _entry(path: Path, i: int, entry: Any, catalog: HardwareCatalog) -> InstanceConfig:
    where = f"instances file {path}, instances[{i}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be a table")
    unknown = sorted(set(entry) - _KNOWN)
    if unknown:
        raise ConfigError(
            f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(_KNOWN))})"
        )
    for field in ("name", "gpu", "models"):
        if field not in entry:
            raise ConfigError(f"{where}: missing field {field!r}")
    name, gpu, models = entry["name"], entry["gpu"], entry["models"]
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name: must be a non-empty string")
    if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
        raise ConfigError(f"{where}.models: must be a non-empty list of model names")
    url = entry.get("url", "")
    if not isinstance(url, str) or (url and not url.startswith(("http://", "https://"))):
        raise ConfigError(f"{where}.url: must be an http(s) URL, got {url!r}")
    if not isinstance(gpu, str) or not gpu:
        raise ConfigError(f"{where}.gpu: must be a non-empty string")
    try:
        gpu_name = catalog.gpu(gpu).name
    except ConfigError as exc:
        if not url:  # simulated: the simulator must know the GPU
            raise ConfigError(f"{where}.gpu: {exc}") from None
        gpu_name = gpu  # a server's GPU: what its profile is looked up by (QLM_PROFILE_FILE)
    count = entry.get("gpu_count")
    if count is not None and (not isinstance(count, int) or count < 1):
        raise ConfigError(f"{where}.gpu_count: must be an integer >= 1, got {count!r}")
    max_num_seqs = entry.get("max_num_seqs")
    if max_num_seqs is not None and (not isinstance(max_num_seqs, int) or max_num_seqs < 1):
        raise ConfigError(f"{where}.max_num_seqs: must be an integer >= 1, got {max_num_seqs!r}")
    if count is None:
        try:
            count = catalog.default_gpu_count(models[0], gpu_name)
        except ConfigError:
            count = 1  # a model without a shipped profile: the estimator says so when it plans
    spec = InstanceSpec(name=name, gpu=gpu_name, models=tuple(models), gpu_count=count, url=url)
    return InstanceConfig(spec, max_num_seqs)


def default_instances(shorthand: str = "2xA100:llama-3-8b") -> list[InstanceConfig]:
    """In-process simulated instances from the ``qlm simulate`` shorthand."""
    return [InstanceConfig(spec) for spec in parse_instances(shorthand)]


def build_engines(
    configs: Sequence[InstanceConfig],
    *,
    time_scale: float = 1.0,
    catalog: HardwareCatalog | None = None,
) -> list[Engine]:
    """An engine per instance: a ``VllmEngine`` for a URL, else a simulated instance on the wall
    clock (``time_scale`` times faster than real time)."""
    catalog = catalog or default_catalog()
    engines: list[Engine] = []
    for config in configs:
        spec = config.spec
        if config.remote:
            engines.append(
                VllmEngine(spec.name, spec.url, spec.models, max_num_seqs=config.max_num_seqs)
            )
            continue
        perf = {m: catalog.perf_model(m, spec.gpu, spec.gpu_count) for m in spec.models}
        gpu = catalog.gpu(spec.gpu)
        overrides: dict[str, Any] = {
            "max_macro_steps": 4,
            "emit_token_events": True,
            "model_switching": "explicit",
        }
        if config.max_num_seqs is not None:
            overrides["max_num_seqs"] = config.max_num_seqs
        sim_config = SimEngineConfig.for_gpu(gpu.memory_gb * spec.gpu_count, gpu.name, **overrides)
        engines.append(
            WallClockEngine(SimEngine(spec.name, perf, sim_config), WallClock(time_scale))
        )
    return engines


def host_links(
    configs: Sequence[InstanceConfig], catalog: HardwareCatalog | None = None
) -> dict[str, float]:
    """GPU <-> CPU bandwidth of each instance's GPU (what KV swap costs)."""
    catalog = catalog or default_catalog()
    links = {}
    for c in configs:
        try:
            links[c.spec.name] = catalog.gpu(c.spec.gpu).host_link_gbs
        except ConfigError:  # a GPU the catalog does not know: no swap cost to tell
            links[c.spec.name] = 0.0
    return links
