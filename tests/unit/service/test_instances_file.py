"""The instances file (``QLM_INSTANCES_FILE``): each bad entry is one line naming the file and
the field, and changes nothing; a server's GPU may be any name its profile is looked up by."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from qlm.engines.colocated import ColocatedEngine
from qlm.errors import ConfigError
from qlm.rct.profile import RctProfile, default_profile, dump_profile
from qlm.service import build_controller
from qlm.service.instances import (
    build_engines,
    cpu_caches,
    host_links,
    load_instances,
    model_weights,
)
from qlm.settings import Settings

GOOD = """
[[instances]]
name = "a100-0"
url = "http://10.0.0.5:8000"
gpu = "a100"
models = ["llama-3-8b"]
max_num_seqs = 128

[[instances]]
name = "sim-0"
gpu = "H100"
models = ["llama-3-8b", "llama-2-7b"]
"""


COLOCATED = """
[[instances]]
name = "g0"
gpu = "A100"
servers = { 'm' = 'http://h:1', 'n' = 'http://h:2' }
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "instances.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_good_file_is_read_with_its_defaults(tmp_path: Path) -> None:
    server, sim = load_instances(write(tmp_path, GOOD))
    assert (server.spec.name, server.spec.gpu, server.spec.gpu_count) == ("a100-0", "A100", 1)
    assert server.remote and server.max_num_seqs == 128
    assert not sim.remote and sim.spec.models == ("llama-3-8b", "llama-2-7b")


def test_colocated_servers_are_one_instance_with_the_memory_for_warm_models(
    tmp_path: Path,
) -> None:
    """One vLLM server per model on one GPU: one instance serving every model, driven by a
    ``ColocatedEngine``; warm starts are planned with the models' weights (shipped profiles, or
    given) and the CPU memory for them (given, else room for all)."""
    text = COLOCATED.replace("'m'", "'llama-3-8b'").replace("'n'", "'my-model'")
    text += "weights_gb = { 'my-model' = 10.5 }\n"
    (config,) = load_instances(write(tmp_path, text))
    assert config.spec.models == ("llama-3-8b", "my-model") and config.remote
    assert config.servers == (("llama-3-8b", "http://h:1"), ("my-model", "http://h:2"))
    (engine,) = build_engines([config])
    assert isinstance(engine, ColocatedEngine) and engine.models == ("llama-3-8b", "my-model")
    assert [s.base_url for s in engine.servers.values()] == ["http://h:1", "http://h:2"]
    weights = model_weights([config])["g0"]
    assert weights[1] == ("my-model", 10.5) and weights[0][0] == "llama-3-8b" and weights[0][1] > 0
    assert cpu_caches([config]) == {"g0": pytest.approx(weights[0][1] + 10.5)}
    (given,) = load_instances(write(tmp_path, text + "cpu_cache_gb = 4\n"))
    assert cpu_caches([given]) == {"g0": 4.0}
    single, sim = load_instances(write(tmp_path, GOOD))
    assert cpu_caches([single, sim])["a100-0"] == 0.0  # one model per server: nothing warm
    assert cpu_caches([single, sim])["sim-0"] > 0  # the simulator's CPU model cache


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[[instances]]\nname = 'x'\ngpu = 'A100'\n", "instances[0]: missing field 'models'"),
        (GOOD + "\n[[instances]]\nname = 'y'\ngpu = 'A100'\nmodels = []\n", "instances[2].models"),
        ("[[instances]]\nname = 'x'\ngpu = 'A100'\nmodels = ['m']\nspeed = 2\n", "'speed'"),
        ("[[instances]]\nname = 'x'\nurl = 'ftp://h'\ngpu = 'A100'\nmodels = ['m']\n", ".url"),
        ("[[instances]]\nname = 'x'\ngpu = 'B200'\nmodels = ['llama-3-8b']\n", ".gpu: unknown GPU"),
        ("[[instances]]\nname = 'x'\ngpu = 'A100'\nmodels = ['m']\ngpu_count = 0\n", "gpu_count"),
        (GOOD.replace("sim-0", "a100-0"), "duplicate instance name 'a100-0'"),
        ("instances = 3\n", "at least one [[instances]]"),
        ("[[instances]\n", "instances file"),
        (COLOCATED + "url = 'http://h:1'\n", "either url or servers"),
        (
            COLOCATED.replace("'n' = 'http://h:2'", "'n' = 'h:2'"),
            ".servers.n: must be an http(s) URL",
        ),
        (COLOCATED.replace(", 'n' = 'http://h:2'", ""), ".servers: must be a table of two"),
        (COLOCATED + "models = ['n', 'm']\n", ".models: must be the servers' models"),
        (COLOCATED + "cpu_cache_gb = -1\n", ".cpu_cache_gb"),
        (COLOCATED + "weights_gb = { m = 0 }\n", ".weights_gb"),
    ],
)
def test_a_bad_entry_is_one_line_naming_the_field(tmp_path: Path, text: str, named: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_instances(path)
    message = str(err.value)
    assert named in message and str(path) in message and "\n" not in message


def test_a_server_on_a_gpu_the_simulator_does_not_know_runs_once_profiled(
    tmp_path: Path,
) -> None:
    text = "[[instances]]\nname = 'l40s-0'\nurl = 'http://10.0.0.7:8000'\ngpu = 'L40S'\n"
    path = write(tmp_path, text + "models = ['llama-3-8b']\n")
    (config,) = load_instances(path)
    assert (config.spec.gpu, config.spec.gpu_count) == ("L40S", 1)
    assert host_links([config]) == {"l40s-0": 0.0}  # no swap cost known (vLLM has no swap API)
    with pytest.raises(ConfigError, match=r"^instance 'l40s-0': no RCT hardware profile .*L40S"):
        build_controller(Settings(instances_file=path))
    a100 = default_profile().hardware[("llama-3-8b", "A100", 1)]
    mine = dataclasses.replace(a100, gpu="L40S", throughput_tps=1234.0)
    profile = tmp_path / "profile.json"
    profile.write_text(dump_profile(RctProfile(hardware={mine.key: mine})), encoding="utf-8")
    service = build_controller(Settings(instances_file=path, profile_file=profile))
    estimator = service.runtime.controller.policy.estimator  # type: ignore[attr-defined]
    assert estimator.profile.hardware_for("llama-3-8b", "L40S", 1).throughput_tps == 1234.0


def test_in_process_instances_run_on_the_performance_model_the_settings_name() -> None:
    """``QLM_SIM__PERF_MODEL`` reaches the controller's in-process simulated instances as it
    reaches ``qlm simulate``: their step times, and the estimator's profile of them."""
    from qlm.engines.perf_table import load_catalog
    from qlm.engines.wallclock import WallClockEngine

    fleet = {"sim_instances": "1xH100/8:llama-2-70b"}
    with pytest.raises(ConfigError, match="llama-2-70b"):  # not in the shipped profiles
        build_controller(Settings(controller=fleet))
    service = build_controller(Settings(controller=fleet, sim={"perf_model": "splitwise"}))
    runtime = service.runtime
    [instance] = runtime._instances.values()
    assert isinstance(instance.engine, WallClockEngine)
    expected = load_catalog("splitwise").perf_model("llama-2-70b", "H100", 8)
    assert instance.engine.sim.perf_models == {"llama-2-70b": expected}
    estimator = runtime.controller.policy.estimator  # type: ignore[attr-defined]
    assert estimator.profile.hardware_for("llama-2-70b", "H100", 8).gpu_count == 8
