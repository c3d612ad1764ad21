"""The instances file (``QLM_INSTANCES_FILE``): each bad entry is one line naming the file and
the field, and changes nothing; a server's GPU may be any name its profile is looked up by."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from qlm.errors import ConfigError
from qlm.rct.profile import RctProfile, default_profile, dump_profile
from qlm.service import build_controller
from qlm.service.instances import host_links, load_instances
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


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "instances.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_good_file_is_read_with_its_defaults(tmp_path: Path) -> None:
    server, sim = load_instances(write(tmp_path, GOOD))
    assert (server.spec.name, server.spec.gpu, server.spec.gpu_count) == ("a100-0", "A100", 1)
    assert server.remote and server.max_num_seqs == 128
    assert not sim.remote and sim.spec.models == ("llama-3-8b", "llama-2-7b")


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
