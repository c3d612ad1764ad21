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

Several models on one GPU with warm starts: one vLLM server per model, each started in sleep
mode (``qlm instance launch --sleep-mode``), driven as one instance (``ColocatedEngine``: one
server awake, the others asleep — level 1, weights in CPU memory, is a warm model)::

    [[instances]]
    name = "a100-1"
    gpu = "A100"
    servers = { "llama-3-8b" = "http://10.0.0.6:8001", "llama-2-13b" = "http://10.0.0.6:8002" }
    cpu_cache_gb = 64                # optional: CPU memory for warm models' weights (default:
                                     # all of them; in-process: the simulator's)
    weights_gb = { "my-model" = 15 } # optional: weights of a model without a shipped profile

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
from qlm.engines.colocated import ColocatedEngine
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
    servers: tuple[tuple[str, str], ...] = ()
    """One server per model on the GPU (model, URL), driven as one instance; empty: ``url``."""
    cpu_cache_gb: float | None = None
    """CPU memory for warm models' weights (None: the default, ``cpu_caches``)."""
    weights_gb: tuple[tuple[str, float], ...] = ()
    """Weights of models without a shipped profile."""

    @property
    def remote(self) -> bool:
        return bool(self.spec.url)


_KNOWN = {
    "name", "url", "gpu", "models", "gpu_count", "max_num_seqs", "servers", "cpu_cache_gb",
    "weights_gb",
}  # fmt: skip


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
    servers = _servers(where, entry)
    if servers:
        entry = {"models": [m for m, _ in servers], **entry}
        if "url" in entry:
            raise ConfigError(f"{where}: give either url or servers, not both")
        if entry["models"] != [m for m, _ in servers]:
            raise ConfigError(f"{where}.models: must be the servers' models, in their order")
    for field in ("name", "gpu", "models"):
        if field not in entry:
            raise ConfigError(f"{where}: missing field {field!r}")
    name, gpu, models = entry["name"], entry["gpu"], entry["models"]
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name: must be a non-empty string")
    if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
        raise ConfigError(f"{where}.models: must be a non-empty list of model names")
    url = servers[0][1] if servers else entry.get("url", "")
    if not isinstance(url, str) or (url and not url.startswith(("http://", "https://"))):
        raise ConfigError(f"{where}.url: must be an http(s) URL, got {url!r}")
    cpu_cache_gb = entry.get("cpu_cache_gb")
    if cpu_cache_gb is not None and (
        isinstance(cpu_cache_gb, bool)
        or not isinstance(cpu_cache_gb, int | float)
        or cpu_cache_gb < 0
    ):
        raise ConfigError(f"{where}.cpu_cache_gb: must be a number >= 0, got {cpu_cache_gb!r}")
    weights = entry.get("weights_gb", {})
    if not isinstance(weights, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in weights.values()
    ):
        raise ConfigError(f"{where}.weights_gb: must be a table of model = GB (> 0)")
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
    return InstanceConfig(
        spec,
        max_num_seqs,
        servers=servers,
        cpu_cache_gb=None if cpu_cache_gb is None else float(cpu_cache_gb),
        weights_gb=tuple((str(m), float(v)) for m, v in weights.items()),
    )


def _servers(where: str, entry: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The ``servers`` table (model = URL), two at least, checked."""
    servers = entry.get("servers")
    if servers is None:
        return ()
    if not isinstance(servers, dict) or len(servers) < 2:
        raise ConfigError(f"{where}.servers: must be a table of two or more model = URL")
    for model, url in servers.items():
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.servers.{model}: must be an http(s) URL, got {url!r}")
    return tuple(servers.items())


def default_instances(
    shorthand: str = "2xA100:llama-3-8b", catalog: HardwareCatalog | None = None
) -> list[InstanceConfig]:
    """In-process simulated instances from the ``qlm simulate`` shorthand (on ``catalog``'s
    hardware and models; None: the shipped catalog)."""
    return [InstanceConfig(spec) for spec in parse_instances(shorthand, catalog)]


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
        if config.servers:
            seqs = config.max_num_seqs
            members = {
                m: VllmEngine(f"{spec.name}/{m}", url, (m,), max_num_seqs=seqs)
                for m, url in config.servers
            }
            engines.append(ColocatedEngine(spec.name, members))
            continue
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


def model_weights(
    configs: Sequence[InstanceConfig], catalog: HardwareCatalog | None = None
) -> dict[str, tuple[tuple[str, float], ...]]:
    """Each instance's models with the GB of their weights (the instances file's
    ``weights_gb``, else the shipped profile's; a model with neither is left out): what the
    agents plan warm starts with (which models fit in CPU memory)."""
    catalog = catalog or default_catalog()
    out = {}
    for c in configs:
        given = dict(c.weights_gb)
        sizes = []
        for m in c.spec.models:
            if m in given:
                sizes.append((m, given[m]))
                continue
            try:
                sizes.append((m, catalog.model(m).weights_gb))
            except ConfigError:
                continue
        out[c.spec.name] = tuple(sizes)
    return out


def cpu_caches(
    configs: Sequence[InstanceConfig], catalog: HardwareCatalog | None = None
) -> dict[str, float]:
    """Each instance's CPU memory for warm models' weights: the instances file's
    ``cpu_cache_gb``; else, for colocated servers, room for every model (each sleeps at level 1),
    for a simulated instance the simulator's, and for a single server none (it serves one
    model: nothing to keep warm)."""
    weights = model_weights(configs, catalog)
    out = {}
    for c in configs:
        if c.cpu_cache_gb is not None:
            out[c.spec.name] = c.cpu_cache_gb
        elif c.servers:
            out[c.spec.name] = sum(gb for _, gb in weights[c.spec.name])
        elif not c.remote:
            out[c.spec.name] = SimEngineConfig().cpu_model_cache_gb
        else:
            out[c.spec.name] = 0.0
    return out


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
