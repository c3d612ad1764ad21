"""The qlm command: simulate and demo, output formats, clear errors."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qlm.cli import app, ops
from qlm.rct.estimator import RCTEstimator
from qlm.rct.inputs import EstimatorInstance, Queued
from qlm.settings import ApiSettings
from tests.builders import make_request

runner = CliRunner()
SHORT = ["--trace", "azure-conv", "--duration", "60", "--instances", "2xA100:llama-3-8b"]


def simulate(*args: str) -> dict[str, object]:
    result = runner.invoke(app, ["simulate", *SHORT, "--json", *args])
    assert result.exit_code == 0, result.output
    summary: dict[str, object] = json.loads(result.stdout)
    return summary


def test_simulate_prints_slo_attainment_of_a_real_trace_window() -> None:
    summary = simulate("--policy", "fcfs")
    assert summary["policy"] == "fcfs"
    assert summary["requests"] == summary["finished"]
    assert 0 < summary["requests"] < 1000  # type: ignore[operator]
    assert 0.0 <= summary["slo_attainment"] <= 1.0  # type: ignore[operator]
    assert "qlm simulate" in str(summary["command"])


def test_simulate_qlm_reports_what_the_planner_did() -> None:
    summary = simulate("--policy", "qlm", "--workload", "wb", "--rate-scale", "3")
    assert summary["requests"] == summary["finished"]
    planner = summary["planner"]
    assert isinstance(planner, dict) and planner["plans"] >= 1
    assert set(planner["status"]) <= {"optimal", "feasible", "heuristic", "fallback"}
    assert "max_capacity_needed" in planner
    assert "planner" not in simulate("--policy", "edf")


def test_the_same_seed_gives_the_same_records_and_another_seed_does_not(tmp_path: Path) -> None:
    def records(seed: int, name: str) -> str:
        out = tmp_path / name
        args = ["simulate", *SHORT, "--workload", "wb", "--rate-scale", "3", "--seed", str(seed)]
        result = runner.invoke(app, [*args, "--out", str(out), "--no-progress"])
        assert result.exit_code == 0, result.output
        return (out / "requests.csv").read_text()

    a, b, c = records(3, "a"), records(3, "b"), records(4, "c")
    assert a == b
    assert a != c


def test_out_writes_one_csv_row_per_request_and_the_summary(tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", *SHORT, "--out", str(tmp_path), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "SLO attainment" in result.stdout
    rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(rows) == summary["requests"]
    assert {r["status"] for r in rows} == {"finished"}
    assert (tmp_path / "memory.csv").exists()


def test_bad_arguments_give_one_line_naming_the_problem_and_exit_1() -> None:
    cases = {
        ("--instances", "2xB200:llama-3-8b"): "unknown GPU 'B200'",
        ("--instances", "2xA100"): "--instances item '2xA100'",
        ("--trace", "nope"): "nope",
        ("--policy", "magic"): "unknown policy 'magic'",
        ("--workload", "wz"): "unknown workload 'wz'",
        ("--instances", "1xA100/1:llama-2-70b"): "no performance profile",
    }
    for args, needle in cases.items():
        result = runner.invoke(app, ["simulate", "--duration", "10", *args])
        assert result.exit_code == 1, (args, result.output)
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and needle in lines[0], (args, result.stderr)


def test_sim_engine_serve_schedules_as_vllm_serve_does(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """fcfs (vLLM's default) unless --scheduling-policy priority; anything else: one line, exit 1."""
    seen: list[str] = []
    monkeypatch.setattr(
        "qlm.engines.server.serve", lambda **kw: seen.append(kw["scheduling_policy"])
    )
    serve = ["sim-engine", "serve", "--model", "llama-3-8b", "--gpu", "A100"]
    assert runner.invoke(app, serve).exit_code == 0
    assert runner.invoke(app, [*serve, "--scheduling-policy", "priority"]).exit_code == 0
    assert seen == ["fcfs", "priority"]
    bad = runner.invoke(app, [*serve, "--scheduling-policy", "lifo"])
    assert bad.exit_code == 1 and "--scheduling-policy must be fcfs or priority" in bad.stderr
    bad = runner.invoke(app, [*serve, "--kv-offloading-size", "0"])
    assert bad.exit_code == 1 and "--kv-offloading-size must be > 0, got 0.0" in bad.stderr


def test_demo_compares_fcfs_and_qlm_on_embedded_defaults_and_reads_its_settings(
    monkeypatch,
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("QLM_DEMO__DURATION_S", "30")
    result = runner.invoke(app, ["demo", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    fcfs, qlm = out["policies"]["fcfs"], out["policies"]["qlm"]
    assert fcfs["requests"] == qlm["requests"] > 0  # the same replay
    assert fcfs["policy"] == "fcfs" and qlm["policy"] == "qlm"
    gain = (qlm["slo_attainment"] - fcfs["slo_attainment"]) * 100
    assert out["difference"]["SLO attainment"] == pytest.approx(gain)
    table = runner.invoke(app, ["demo"])
    assert table.exit_code == 0 and "qlm − fcfs" in table.stdout and " pt" in table.stdout
    for slo_class in fcfs["slo_attainment_by_class"]:  # each class side by side, its difference
        [row] = [line for line in table.stdout.splitlines() if f"class {slo_class} (" in line]
        assert row.count("%") == 2 and row.rstrip("│ ").endswith(" pt"), row
    monkeypatch.setenv("QLM_DEMO__POLICIES", "fcfs")
    alone = json.loads(runner.invoke(app, ["demo", "--json"]).stdout)
    assert list(alone["policies"]) == ["fcfs"] and alone["difference"] == {}
    for bad_value in ("fcfs,lifo", "", "qlm,qlm"):
        monkeypatch.setenv("QLM_DEMO__POLICIES", bad_value)
        bad = runner.invoke(app, ["demo"])
        assert bad.exit_code == 1 and "QLM_DEMO__POLICIES" in bad.stderr
    monkeypatch.setenv("QLM_DEMO__POLICIES", "fcfs")
    monkeypatch.setenv("QLM_DEMO__DURATION_S", "-5")
    bad = runner.invoke(app, ["demo"])
    assert bad.exit_code == 1 and "QLM_DEMO__DURATION_S" in bad.stderr


def test_the_help_names_every_policy_and_workload_preset() -> None:
    """The CLI names them without importing the planner and the workloads (a fast --help)."""
    from qlm.cli import simulate
    from qlm.planner import POLICIES
    from qlm.sim.workload import PRESETS

    assert simulate.POLICIES == POLICIES
    assert simulate.PRESETS == PRESETS


def test_the_cli_imports_no_slow_library_until_a_command_needs_it() -> None:
    """``qlm --help`` and the light commands start at once: the planner (scikit-learn, SciPy),
    numpy, the store, the API and the HTTP client are imported by the commands that use them."""
    code = "import sys, qlm.cli; print(' '.join(sorted(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(run.stdout.split())
    slow = {"numpy", "scipy", "sklearn", "pulp", "sqlalchemy", "alembic", "psycopg"}
    slow |= {"fastapi", "starlette", "uvicorn", "httpx", "pydantic", "pydantic_settings"}
    slow |= {"aio_pika", "aiormq", "pamqp", "prometheus_client", "yaml"}
    qlm_heavy = {"qlm.planner", "qlm.settings", "qlm.store", "qlm.api", "qlm.service"}
    assert not (slow | qlm_heavy) & loaded, sorted((slow | qlm_heavy) & loaded)


def test_help_of_every_command_renders() -> None:
    for args in (["--help"], ["simulate", "--help"], ["demo", "--help"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "Usage" in result.stdout


def test_profile_commands_write_a_profile_the_estimator_loads(tmp_path: Path) -> None:
    from qlm.rct.profile import parse_profile

    out = tmp_path / "profile.json"
    hw = runner.invoke(
        app, ["profile", "hardware", "--model", "llama-3-8b", "--gpu", "H100", "--out", str(out)]
    )
    assert hw.exit_code == 0, hw.output
    wl = runner.invoke(
        app, ["profile", "workload", "--trace", "azure-conv", "--out", str(out), "--json"]
    )
    assert wl.exit_code == 0, wl.output
    profile = parse_profile(out.read_text())
    written = json.loads(wl.stdout)  # what was written, as the file holds it
    assert written["out"] == str(out)
    assert (
        written["output_priors"]["default"]
        == json.loads(out.read_text())["output_priors"]["default"]
    )
    assert ("llama-3-8b", "H100", 1) in profile.hardware
    assert set(profile.output_priors) == {
        "default"
    }  # what a request without a prior of its model uses
    # The file alone serves an estimate (the prior is found for the model's requests).
    estimator = RCTEstimator(profile)
    request = make_request(model="llama-3-8b", replay_output_tokens=None)
    view = EstimatorInstance("h0", "H100", 1, "llama-3-8b")
    (estimate,) = estimator.estimate_requests(view, [Queued(request, 0)], 0.0)
    assert 0 < estimate.mean < request.slo.e2e_s
    assert estimator.expected_output(request) == pytest.approx(
        profile.prior("default").moments(cap=request.max_tokens)[0], rel=0.05
    )
    # A prior for one model's requests.
    mine = runner.invoke(
        app,
        ["profile", "workload", "--trace", "sharegpt", "--name", "llama-3-8b", "--out", str(out)],
    )
    assert mine.exit_code == 0, mine.output
    assert set(parse_profile(out.read_text()).output_priors) == {"default", "llama-3-8b"}
    args = ["profile", "hardware", "--model", "llama-3-8b", "--gpu", "A100", "--json"]
    again = runner.invoke(app, [*args, "--out", str(out)])
    assert again.exit_code == 0, again.output
    [entry] = json.loads(again.stdout)["hardware"]
    assert (entry["model"], entry["gpu"], entry["gpu_count"]) == ("llama-3-8b", "A100", 1)
    assert entry in json.loads(out.read_text())["hardware"]
    bad = runner.invoke(
        app,
        [
            "profile",
            "hardware",
            "--model",
            "llama-2-70b",
            "--gpu",
            "A10",
            "--gpus",
            "1",
            "--out",
            str(out),
        ],
    )
    assert bad.exit_code == 1 and "no performance profile" in bad.stderr


def test_the_shipped_estimator_profile_covers_every_shipped_instance_type() -> None:
    from qlm.engines.perf_model import default_catalog
    from qlm.rct.profile import default_profile

    profile = default_profile()
    assert set(profile.hardware) == set(default_catalog().perf)
    assert "default" in profile.output_priors


def test_the_shipped_estimator_profile_is_what_qlm_profile_all_produces(tmp_path: Path) -> None:
    from importlib import resources

    out = tmp_path / "rct_profile.json"
    result = runner.invoke(app, ["profile", "all", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    shipped = resources.files("qlm").joinpath("data/rct_profile.json").read_text(encoding="utf-8")
    doc = json.loads(shipped)
    assert json.loads(result.stdout) == {
        "out": str(out),
        "hardware": len(doc["hardware"]),
        "output_priors": len(doc["output_priors"]),
    }
    assert out.read_text(encoding="utf-8") == shipped, (
        "regenerate: qlm profile all --out qlm/data/rct_profile.json"
    )


def test_the_log_level_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QLM_LOG_LEVEL", "loud")
    bad = runner.invoke(app, ["controller"])
    assert bad.exit_code == 1 and "setting QLM_LOG_LEVEL: Input should be 'DEBUG'" in bad.stderr


def test_simulate_sets_ttft_slos_per_class_and_reports_their_attainment() -> None:
    summary = simulate("--policy", "fcfs", "--workload", "wb", "--ttft-slo", "interactive=1.5")
    by_class = summary["slo_attainment_by_class"]
    assert isinstance(by_class, dict)
    chat = by_class["interactive"]
    assert chat["ttft_requests"] == chat["requests"] and 0 <= chat["ttft_attainment"] <= 1
    assert "ttft_attainment" not in by_class["batch"]
    assert "--ttft-slo interactive=1.5" in str(summary["command"])
    table = runner.invoke(
        app, ["simulate", *SHORT, "--workload", "wb", "--ttft-slo", "interactive=1.5"]
    )
    assert table.exit_code == 0 and "TTFT SLO met, class interactive" in table.stdout


def test_a_bad_ttft_slo_is_one_line_naming_the_flag() -> None:
    for value, needle in {
        "interactive": "expected CLASS=SECONDS",
        "interactive=0": "seconds must be > 0",
        "chat=1": "no SLO class 'chat'",
        "interactive=25": "longer than the class's end-to-end SLO",
    }.items():
        result = runner.invoke(
            app, ["simulate", "--duration", "10", "--workload", "wb", "--ttft-slo", value]
        )
        assert result.exit_code == 1, (value, result.output)
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "--ttft-slo" in lines[0] and needle in lines[0], result.stderr


def test_simulate_on_splitwise_measurements_with_gpu_counts_the_table_covers() -> None:
    base = ["simulate", "--trace", "azure-conv", "--duration", "30", "--json"]
    fleet = ["--instances", "1xH100/8:llama-2-70b", "--perf-model", "splitwise"]
    result = runner.invoke(app, [*base, *fleet, "--policy", "qlm"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["finished"] == summary["requests"] > 0  # --workload default: the fleet's model
    assert list(summary["slo_attainment_by_model"]) == ["llama-2-70b"]
    assert "--perf-model splitwise" in summary["command"]
    kv = runner.invoke(app, [*base, *fleet, "--kv-memory", "splitwise"])
    assert kv.exit_code == 0, kv.output
    assert "--kv-memory splitwise" in json.loads(kv.stdout)["command"]


def test_simulate_perf_model_from_a_csv_file_and_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = tmp_path / "t.csv"
    table.write_text(
        "model,hardware,tensor_parallel,prompt_size,batch_size,prompt_time,token_time\n"
        "llama-3-8b,A100,1,128,1,20,10\nllama-3-8b,A100,1,8192,1,800,12\n"
    )
    fast = simulate("--perf-model", str(table))
    monkeypatch.setenv("QLM_SIM__PERF_MODEL", str(table))
    assert simulate()["e2e_s"] == fast["e2e_s"]
    assert simulate("--perf-model", "default")["e2e_s"] != fast["e2e_s"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--perf-model", "splitwise"],
            "--perf-model splitwise: no performance profile for llama-3-8b",
        ),
        (["--perf-model", "no-such.csv"], "--perf-model: 'no-such.csv' is neither"),
        (["--kv-memory", "paged"], "--kv-memory must be vllm or splitwise"),
    ],
)
def test_simulate_perf_model_errors_are_one_line(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["simulate", *SHORT, *args])
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_ops_looks_where_serve_and_api_listen_by_default(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("QLM_URL", raising=False)
    seen: list[str] = []
    monkeypatch.setattr(
        ops, "Target", lambda url, key, as_json: seen.append(url) or stop_the_command()
    )
    runner.invoke(app, ["ops", "queues"])
    assert seen == [f"http://{ApiSettings().host}:{ApiSettings().port}"]
    monkeypatch.setenv("QLM_API__PORT", "9001")
    runner.invoke(app, ["ops", "queues"])
    assert seen[-1] == f"http://{ApiSettings().host}:9001"  # what qlm serve reads too
    monkeypatch.setenv("QLM_URL", "http://qlm:80")
    runner.invoke(app, ["ops", "queues"])
    assert seen[-1] == "http://qlm:80"


def test_ops_reaches_a_server_on_every_address_through_the_loopback() -> None:
    assert ops.default_url({"QLM_API__HOST": "0.0.0.0", "QLM_API__PORT": "80"}) == (
        "http://127.0.0.1:80"
    )
    assert ops.default_url({"QLM_API__HOST": "::1"}) == "http://[::1]:8080"
    assert ops.default_url({"QLM_API__HOST": "qlm.internal"}) == "http://qlm.internal:8080"


def stop_the_command() -> None:
    raise SystemExit(0)


def test_serve_replay_prints_its_summary_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    from qlm.service.replay import ReplayResult

    async def replayed(settings: object, *, replay_s: float | None) -> ReplayResult:
        assert replay_s == 12.0
        return ReplayResult(requests=10, finished=9, slo_met=8, failed=1, wall_s=3.5)

    monkeypatch.setattr("qlm.service.serve.serve", replayed)
    monkeypatch.setattr("qlm.cli.service.configure_logging", lambda: None)
    result = runner.invoke(app, ["serve", "--replay", "12", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "command": "qlm serve --replay 12",
        "requests": 10,
        "finished": 9,
        "failed": 1,
        "slo_met": 8,
        "slo_attainment": 0.8,
        "wall_s": 3.5,
    }
    served = runner.invoke(app, ["serve", "--json"])
    assert served.exit_code == 1
    assert served.stderr.strip() == (
        "error: --json is for the summary of a replay: give --replay SECONDS too"
    )


def test_ops_without_a_qlm_to_reach_says_where_it_looked_and_how_to_point_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = 1  # where nothing listens
    monkeypatch.setenv("QLM_URL", f"http://127.0.0.1:{port}")
    result = runner.invoke(app, ["ops", "queues"])
    assert result.exit_code == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: cannot reach QLM at http://127.0.0.1:{port} (ConnectError")
    assert line.endswith(
        "is `qlm serve` or `qlm api` running there? Give its address with --url or QLM_URL"
    )
    monkeypatch.setenv("QLM_URL", f"127.0.0.1:{port}")
    result = runner.invoke(app, ["ops", "queues"])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"error: --url (QLM_URL) must start with http:// or https://, got '127.0.0.1:{port}'"
    )
