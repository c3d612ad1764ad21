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
from qlm.settings import ControllerSettings, Settings, rct_profile

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
    [(None, "cannot read"), ("{not json", "not valid JSON"), ('{"version": 0}', "version")],
)
def test_a_profile_file_that_cannot_be_used_is_one_line_naming_the_setting(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=f"^setting QLM_PROFILE_FILE: .*{message}"):
        rct_profile(Settings(profile_file=path))
    with pytest.raises(ConfigError, match=r"^setting QLM_PROFILE_FILE"):
        build_controller(Settings(profile_file=path))


def test_simulate_reads_the_profile_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QLM_PROFILE_FILE", str(tmp_path / "missing.json"))
    bad = CliRunner().invoke(app, ["simulate", "--duration", "10", "--policy", "qlm", "--json"])
    assert bad.exit_code == 1 and "QLM_PROFILE_FILE" in bad.stderr
    monkeypatch.setenv("QLM_PROFILE_FILE", str(own_profile(tmp_path / "mine.json")))
    good = CliRunner().invoke(app, ["simulate", "--duration", "10", "--policy", "qlm", "--json"])
    assert good.exit_code == 0, good.stderr


def test_an_instance_the_profile_does_not_cover_stops_the_qlm_controller_at_start() -> None:
    spec = InstanceSpec("odd", "A100", ("llama-3-8b",), gpu_count=3, url="http://127.0.0.1:9")
    odd = InstanceConfig(spec)  # a vLLM server on three A100s: nothing shipped profiles that
    with pytest.raises(
        ConfigError, match=r"^instance 'odd': no RCT hardware profile .*qlm profile"
    ):
        build_controller(Settings(), configs=[odd])
    # A policy that estimates nothing serves it.
    build_controller(Settings(controller=ControllerSettings(policy="fcfs")), configs=[odd])
