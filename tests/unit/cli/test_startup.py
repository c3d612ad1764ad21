"""Starting a service that cannot run: one line naming the problem, the setting and what to do,
exit code 1, and nothing written before the process knows it can run (no ``./qlm.db``).

Each case runs the real command in a process of its own, so that every line it would show
counts (logging, uvicorn, Python's warnings), in an empty working directory. Nothing here needs
a server: the store and the broker are addresses where nothing listens (port 1)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

NO_STORE = "postgresql+psycopg://postgres:secret@127.0.0.1:1/test"
NO_BROKER = "amqp://guest:secret@127.0.0.1:1/"


def start(
    command: str | list[str], cwd: Path, env: dict[str, str], *, before: str = ""
) -> subprocess.CompletedProcess[str]:
    """``qlm COMMAND`` in ``cwd`` with ``env`` over the QLM_* settings' defaults (the API on
    any free port); ``before``: Python run first, in the same process."""
    args = [command] if isinstance(command, str) else command
    code = f"import sys\n{before}\nfrom qlm.cli import main\nsys.argv = ['qlm', *{args!r}]\nmain()"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("QLM_")}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**clean, "QLM_API__PORT": "0", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line the command printed (stdout and stderr together), having exited 1."""
    printed = result.stdout + result.stderr
    assert result.returncode == 1 and len(printed.splitlines()) == 1, printed
    return printed.strip()


@pytest.fixture
def listener() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def broker_for(command: str, request: pytest.FixtureRequest) -> dict[str, str]:
    """What ``command`` needs of the broker to get past it: ``api`` and ``controller`` a real
    RabbitMQ (they share the global queue with other processes), ``serve`` nothing."""
    if command == "serve":
        return {}
    return {"QLM_BROKER_URL": request.getfixturevalue("amqp_url")}


@pytest.mark.parametrize("command", ["api", "controller", "serve"])
def test_a_store_that_cannot_be_reached_is_one_line(
    command: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    pytest.importorskip("psycopg")  # without it: the next test
    env = {"QLM_DATABASE_URL": NO_STORE, **broker_for(command, request)}
    line = one_line(start(command, tmp_path, env))
    assert line.startswith(
        "error: cannot reach the store at postgresql+psycopg://postgres:***@127.0.0.1:1/test: "
    )
    assert line.endswith("Connection refused; is PostgreSQL running there? (QLM_DATABASE_URL)")
    assert "secret" not in line
    assert list(tmp_path.iterdir()) == []


def test_a_postgresql_url_without_the_postgres_extra_is_one_line_naming_it(
    tmp_path: Path,
) -> None:
    result = start(
        "serve", tmp_path, {"QLM_DATABASE_URL": NO_STORE}, before="sys.modules['psycopg'] = None"
    )
    line = one_line(result)
    assert line.startswith("error: QLM_DATABASE_URL is a PostgreSQL URL but its driver, psycopg 3")
    assert line.endswith("pip install 'qlm[postgres]'")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["api", "controller", "serve"])
def test_a_broker_that_cannot_be_reached_is_one_line_and_nothing_is_written(
    command: str, tmp_path: Path
) -> None:
    """An API must not take requests it cannot make durable, and a controller has nothing to
    serve: both stop, before they open the store (an SQLite file would be created)."""
    line = one_line(start(command, tmp_path, {"QLM_BROKER_URL": NO_BROKER}))
    assert line == (
        "error: cannot reach the broker at amqp://guest:***@127.0.0.1:1/: Connection refused; "
        "is RabbitMQ running there? (QLM_BROKER_URL)"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["api", "controller"])
def test_without_a_broker_url_api_and_controller_stop_with_one_line(
    command: str, tmp_path: Path
) -> None:
    """Their in-process queue would be one no other process reads: an API would accept
    requests no controller could serve, and lose them when it stops."""
    line = one_line(start(command, tmp_path, {}))
    assert line.startswith(f"error: setting QLM_BROKER_URL: not set; `qlm {command}` shares")
    assert line.endswith("runs the API and a controller in one process on an in-process queue")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["api", "serve"])
def test_a_port_in_use_is_one_line_and_nothing_is_written(
    command: str, tmp_path: Path, listener: int
) -> None:
    """``qlm serve`` used to start its controller first, which recorded itself in the store."""
    env = {"QLM_API__PORT": str(listener)}
    if command == "api":  # (the port is bound before the broker is reached)
        env["QLM_BROKER_URL"] = NO_BROKER
    line = one_line(start(command, tmp_path, env))
    assert line == (
        f"error: port {listener} is in use on 127.0.0.1 (Address already in use: another QLM "
        "or another server listens there); choose another with QLM_API__PORT"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["controller", "serve"])
def test_an_unknown_policy_is_one_line_naming_the_setting_and_nothing_is_written(
    command: str, tmp_path: Path
) -> None:
    line = one_line(start(command, tmp_path, {"QLM_CONTROLLER__POLICY": "lifo"}))
    assert line.startswith("error: setting QLM_CONTROLLER__POLICY: Input should be 'fcfs', ")
    assert line.endswith("'qlm' or 'qlm-rr'")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("command", "setting", "value", "says"),
    [
        (["serve"], "QLM_CONTROLLER__SIM_INSTANCES", "garbage",
         "item 'garbage' is not COUNTxGPU[/GPUS]:MODEL[+MODEL], e.g. 2xA100:llama-3-8b"),
        (["serve"], "QLM_SIM__PERF_MODEL", "nope",
         "'nope' is neither default nor splitwise nor a CSV file"),
        (["serve", "--replay", "10"], "QLM_DEMO__TRACE", "nope", "unknown trace 'nope'"),
        (["serve", "--replay", "10"], "QLM_DEMO__WORKLOAD", "nope", "unknown workload 'nope'"),
    ],
)  # fmt: skip
def test_a_bad_simulation_setting_is_one_line_naming_it_and_nothing_is_written(
    command: list[str], setting: str, value: str, says: str, tmp_path: Path
) -> None:
    line = one_line(start(command, tmp_path, {setting: value}))
    assert line.startswith(f"error: setting {setting}: {says}"), line
    assert list(tmp_path.iterdir()) == []


def test_a_simulated_instance_on_a_port_in_use_is_one_line_naming_the_option(
    tmp_path: Path, listener: int
) -> None:
    args = ["sim-engine", "serve", "--model", "llama-3-8b", "--gpu", "A100"]
    line = one_line(start([*args, "--port", str(listener)], tmp_path, {}))
    assert line == (
        f"error: port {listener} is in use on 127.0.0.1 (Address already in use: another QLM "
        "or another server listens there); choose another with --port"
    )


def test_an_unprofiled_instance_stops_serve_before_the_store_is_opened(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    instances = config / "instances.toml"
    instances.write_text(
        "[[instances]]\nname = 'sim-0'\ngpu = 'A10'\ngpu_count = 3\nmodels = ['llama-3-8b']\n"
    )
    line = one_line(start("serve", tmp_path, {"QLM_INSTANCES_FILE": str(instances)}))
    assert line.startswith(
        "error: instance 'sim-0': no RCT hardware profile for llama-3-8b on 3xA10; profile the "
        "simulated instance (`qlm profile hardware --model llama-3-8b --gpu A10 --gpus 3 "
        "--out profile.json`) and set QLM_PROFILE_FILE=profile.json"
    )
    assert list(tmp_path.iterdir()) == [config]


def test_a_replay_stopped_by_sigterm_stops_its_controller_cleanly(tmp_path: Path) -> None:
    """SIGTERM during ``qlm serve --replay`` stops it as it stops a service: the controller
    publishes its state as stopped, and the command says in one line that the replay did not
    end (exit code 1, no summary)."""
    import signal
    import time

    from qlm.store import Store

    db = tmp_path / "qlm.db"
    code = "from qlm.cli import main\nimport sys\nsys.argv = ['qlm', 'serve', '--replay', '3600']\nmain()"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("QLM_")}
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**clean, "QLM_DATABASE_URL": f"sqlite:///{db}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # until the controller published its state (it is replaying)
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the controller never published its state"
            if db.exists():
                with Store.open(f"sqlite:///{db}") as store:
                    if store.controller_states():
                        break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        printed, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, printed
    assert "the replay was stopped by a signal before it ended" in printed
    with Store.open(f"sqlite:///{db}") as store:
        (state,) = store.controller_states()
    assert state.stopped_at is not None
