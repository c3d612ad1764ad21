"""Operators give the estimator their own profile (``qlm profile ...``) with
``QLM_PROFILE_FILE``: merged over the shipped one, read by the controller, ``qlm serve``,
``qlm simulate`` and ``qlm demo``; a file that cannot be used is one line naming the setting."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qlm.cli import app
from qlm.domain import InstanceSpec
from qlm.errors import ConfigError
from qlm.rct.output_model import NIG
from qlm.rct.profile import RctProfile, default_profile, dump_profile
from qlm.service import build_controller
from qlm.service.instances import InstanceConfig
from qlm.settings import ControllerSettings, Settings, get_settings
from qlm.wiring import rct_profile

KEY = ("llama-3-8b", "A100", 1)


def own_profile(path: Path) -> Path:
    """A profile of the operator's own: the A100 measured slower, and a prior of short answers."""
    shipped = default_profile()
    hw = dataclasses.replace(shipped.hardware[KEY], throughput_tps=123.0)
    prior = NIG(mu=3.0, kappa=10.0, alpha=5.0, beta=2.0)
    path.write_text(dump_profile(RctProfile(hardware={KEY: hw}, output_priors={"default": prior})))
    return path


def test_the_profile_file_is_merged_over_the_shipped_one(tmp_path: Path) -> None:
    profile = rct_profile(Settings(profile_file=own_profile(tmp_path / "mine.json")))
    shipped = default_profile()
    assert profile.hardware[KEY].throughput_tps == 123.0  # the operator's entry wins
    assert set(profile.hardware) == set(shipped.hardware)  # and the shipped ones stay
    assert profile.prior("llama-3-8b").mu == 3.0  # the default prior is the operator's
    assert profile.output_priors["sharegpt"] == shipped.output_priors["sharegpt"]
    assert rct_profile(Settings()) == shipped


def test_the_controller_estimates_with_the_profile_file(tmp_path: Path) -> None:
    settings = Settings(profile_file=own_profile(tmp_path / "mine.json"))
    service = build_controller(settings)
    estimator = service.runtime.controller.policy.estimator  # type: ignore[attr-defined]
    assert estimator.profile.hardware[KEY].throughput_tps == 123.0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("{not json", "not valid JSON"),
        ('{"version": 0}', "version"),
        ("", "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
    ],
)
def test_a_profile_file_that_cannot_be_used_is_one_line_naming_the_setting(
    tmp_path: Path, content: str | bytes | None, message: str
) -> None:
    path = tmp_path / "profile.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=f"^setting QLM_PROFILE_FILE: .*{message}"):
        rct_profile(Settings(profile_file=path))
    with pytest.raises(ConfigError, match=r"^setting QLM_PROFILE_FILE"):
        build_controller(Settings(profile_file=path))


def test_a_profile_file_set_to_nothing_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QLM_PROFILE_FILE", "")
    monkeypatch.setenv("QLM_INSTANCES_FILE", " ")
    settings = get_settings()
    assert settings.profile_file is None and settings.instances_file is None


def test_a_profile_is_found_whatever_the_case_of_its_gpu() -> None:
    shipped = default_profile()
    l40s = dataclasses.replace(shipped.hardware[KEY], gpu="L40S")
    assert RctProfile(hardware={l40s.key: l40s}).hardware_for("llama-3-8b", "l40s", 1) == l40s
    # (`qlm profile server --gpu a100` writes the catalog's "A100": tests/integration/
    # test_profile_server.py.)


def test_simulate_reads_the_profile_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QLM_PROFILE_FILE", str(tmp_path / "missing.json"))
    bad = CliRunner().invoke(app, ["simulate", "--duration", "10", "--policy", "qlm", "--json"])
    assert bad.exit_code == 1 and "QLM_PROFILE_FILE" in bad.stderr
    monkeypatch.setenv("QLM_PROFILE_FILE", str(own_profile(tmp_path / "mine.json")))
    good = CliRunner().invoke(app, ["simulate", "--duration", "10", "--policy", "qlm", "--json"])
    assert good.exit_code == 0, good.stderr


@pytest.mark.parametrize("policy", ["qlm", "sedf", "proserve", "shepherd"])
def test_an_instance_the_profile_does_not_cover_stops_an_estimating_controller_at_start(
    policy: str,
) -> None:
    spec = InstanceSpec("odd", "A100", ("llama-3-8b",), gpu_count=3, url="http://127.0.0.1:9")
    odd = InstanceConfig(spec)  # a vLLM server on three A100s: nothing shipped profiles that
    settings = Settings(controller=ControllerSettings(policy=policy))
    with pytest.raises(ConfigError) as err:
        build_controller(settings, configs=[odd])
    message = str(err.value)
    assert message.startswith("instance 'odd': no RCT hardware profile") and "\n" not in message
    assert "qlm profile server --url http://127.0.0.1:9" in message
    assert "QLM_PROFILE_FILE" in message


def test_an_unprofiled_server_is_told_to_profile_the_server_and_nothing_else() -> None:
    """``qlm profile hardware`` measures the simulator, not the server the instance stands for."""
    spec = InstanceSpec("odd", "A100", ("llama-3-8b",), gpu_count=3, url="http://10.0.0.5:8000")
    with pytest.raises(ConfigError) as err:
        build_controller(Settings(), configs=[InstanceConfig(spec, max_num_seqs=64)])
    message = str(err.value)
    assert (
        "profile the server (`qlm profile server --url http://10.0.0.5:8000 --model llama-3-8b "
        "--gpu A100 --gpus 3 --max-num-seqs 64 --out profile.json`) and set "
        "QLM_PROFILE_FILE=profile.json" in message
    )
    assert "profile hardware" not in message
    # one server per model on a GPU: the command names the server of the model not covered
    servers = (("llama-3-8b", "http://10.0.0.6:8001"), ("my-model", "http://10.0.0.6:8002"))
    warm = InstanceSpec("two", "A100", ("llama-3-8b", "my-model"), url=servers[0][1])
    with pytest.raises(ConfigError, match=r"--url http://10\.0\.0\.6:8002 --model my-model "):
        build_controller(Settings(), configs=[InstanceConfig(warm, servers=servers)])


def test_an_unprofiled_simulated_instance_is_told_to_profile_it_on_the_simulator() -> None:
    spec = InstanceSpec("sim", "A10", ("llama-3-8b",), gpu_count=3)  # no url: simulated
    with pytest.raises(ConfigError) as err:
        build_controller(Settings(), configs=[InstanceConfig(spec)])
    message = str(err.value)
    assert message.startswith("instance 'sim': no RCT hardware profile for llama-3-8b on 3xA10; ")
    assert (
        "profile the simulated instance (`qlm profile hardware --model llama-3-8b --gpu A10 "
        "--gpus 3 --out profile.json`) and set QLM_PROFILE_FILE=profile.json" in message
    )
    assert "profile server" not in message and "\n" not in message


@pytest.mark.parametrize("policy", ["fcfs", "fcfs-rr", "edf", "priority"])
def test_a_policy_that_estimates_nothing_needs_no_profile(policy: str) -> None:
    spec = InstanceSpec("odd", "A100", ("llama-3-8b",), gpu_count=3, url="http://127.0.0.1:9")
    settings = Settings(controller=ControllerSettings(policy=policy))
    build_controller(settings, configs=[InstanceConfig(spec)])
