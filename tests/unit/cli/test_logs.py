"""How the service processes log (``qlm.cli.logs``): ``QLM_LOG_FORMAT=json`` makes each line one
JSON object (a logger's output parsed line by line, and a whole ``qlm serve`` process's); an
unknown format stops every service command with one line naming the setting."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import qlm
from qlm.cli import app
from qlm.cli.logs import QUIET_LOGGERS, setup_logging

runner = CliRunner()


@pytest.fixture
def root_logging() -> Iterator[None]:
    """The root logger's handlers and level, and the quiet loggers' levels, put back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    quiet = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, was in quiet.items():
            logging.getLogger(name).setLevel(was)
        logging.captureWarnings(False)


def records(stream: io.StringIO) -> list[dict[str, object]]:
    lines = stream.getvalue().splitlines()
    assert all(line.strip() for line in lines)
    return [json.loads(line) for line in lines]


@pytest.mark.usefixtures("root_logging")
def test_json_logs_are_one_object_per_line_with_the_records_own_fields() -> None:
    out = io.StringIO()
    setup_logging("INFO", "json", stream=out)
    log = logging.getLogger("qlm.test")
    log.debug("below the level")
    log.info("request %s done", "r1", extra={"request_id": "r1", "e2e_s": 1.5, "ok": None})
    log.warning("two\nlines")
    try:
        raise ValueError("broken")
    except ValueError:
        log.exception("it failed")
    logging.getLogger("uvicorn.error").info(
        "Started server process [%d]", 7, extra={"color_message": "\x1b[1mStarted\x1b[0m"}
    )
    first, second, third, fourth = records(out)
    assert set(first) == {"time", "level", "logger", "message", "request_id", "e2e_s", "ok"}
    assert first["level"] == "INFO" and first["logger"] == "qlm.test"
    assert first["message"] == "request r1 done"
    assert (first["request_id"], first["e2e_s"], first["ok"]) == ("r1", 1.5, None)
    assert str(first["time"]).endswith("Z") and "T" in str(first["time"])
    assert second["message"] == "two\nlines"  # escaped: still one line
    assert third["level"] == "ERROR" and "ValueError: broken" in str(third["exception"])
    assert "Traceback" in str(third["exception"])
    assert fourth == {
        "time": fourth["time"],
        "level": "INFO",
        "logger": "uvicorn.error",
        "message": "Started server process [7]",
    }  # without uvicorn's coloured copy


@pytest.mark.usefixtures("root_logging")
def test_a_command_that_stops_on_an_error_logs_it_as_json_once_it_logs_json() -> None:
    import typer

    from qlm.cli.common import fail

    out = io.StringIO()
    setup_logging("INFO", "json", stream=out)
    with pytest.raises(typer.Exit):
        fail("QLM_API__HOST/QLM_API__PORT: cannot listen on 127.0.0.1:8080: in use")
    [record] = records(out)
    assert record["level"] == "CRITICAL" and record["logger"] == "qlm.cli"
    assert (
        record["message"]
        == "error: QLM_API__HOST/QLM_API__PORT: cannot listen on 127.0.0.1:8080: in use"
    )


@pytest.mark.usefixtures("root_logging")
def test_text_logs_read_as_before_and_http_clients_log_each_call_only_at_debug() -> None:
    out = io.StringIO()
    setup_logging("INFO", "text", stream=out)
    logging.getLogger("qlm.test").info("hello", extra={"request_id": "r1"})
    assert out.getvalue().endswith(" INFO qlm.test: hello\n")
    assert {logging.getLogger(n).level for n in QUIET_LOGGERS} == {logging.WARNING}
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)
    setup_logging("DEBUG", "text", stream=out)
    assert {logging.getLogger(n).level for n in QUIET_LOGGERS} == {logging.NOTSET}


@pytest.mark.parametrize(
    "command",
    [
        ["controller"],
        ["api"],
        ["serve"],
        ["sim-engine", "serve", "--model", "llama-3-8b", "--gpu", "A100"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_an_unknown_log_format_stops_a_service_with_one_line_naming_it(
    command: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QLM_LOG_FORMAT", "xml")
    monkeypatch.setattr("qlm.engines.server.serve", lambda **_: pytest.fail("it served"))
    result = runner.invoke(app, command)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1
    assert lines == ["error: setting QLM_LOG_FORMAT: Input should be 'text' or 'json'"]


def test_a_qlm_serve_process_logs_only_json_lines(tmp_path: Path) -> None:
    """A whole process — start-up, migrations, the engines, the planner (HiGHS included), a
    replay, shutting down — writes nothing on stderr but JSON lines, one of them for each
    request's outcome."""
    here = str(Path(qlm.__file__).resolve().parents[1])  # the qlm under test, not another
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
        "QLM_LOG_FORMAT": "json",
        "QLM_DATABASE_URL": f"sqlite:///{tmp_path / 'qlm.db'}",
        "QLM_CONTROLLER__SIM_TIME_SCALE": "20",
        "PYTHONUNBUFFERED": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "qlm.cli", "serve", "--replay", "20"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("replayed ")
    lines = done.stderr.splitlines()
    assert lines
    for line in lines:
        doc = json.loads(line)
        assert {"time", "level", "logger", "message"} <= set(doc), line
    docs = [json.loads(line) for line in lines]
    assert {"qlm.service.serve", "qlm.service.runtime"} <= {d["logger"] for d in docs}
    # One line per request outcome the controller recorded.
    replayed = int(done.stdout.split()[1])
    outcomes = [d for d in docs if d["logger"] == "qlm.outcomes"]
    assert len(outcomes) == len({d["request_id"] for d in outcomes}) == replayed > 0
    # Where the replay stands, as it goes: the last line once every request is done.
    progress = [d for d in docs if d["message"].startswith("replay: ")]
    assert progress and progress[-1]["done"] == progress[-1]["total"] == replayed
    for d in outcomes:
        assert d["status"] in ("finished", "failed") and d["e2e_s"] >= 0, d
        assert d["message"].startswith(f"request {d['request_id']} {d['status']}: tenant="), d


@pytest.mark.usefixtures("root_logging")
def test_set_up_takes_back_the_levels_an_earlier_server_in_the_process_set() -> None:
    import uvicorn

    uvicorn.Config(app=None, log_level="warning", log_config=None).configure_logging()
    assert logging.getLogger("uvicorn.error").level == logging.WARNING
    out = io.StringIO()
    setup_logging("INFO", "json", stream=out)
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 7)
    [record] = records(out)
    assert record["logger"] == "uvicorn.error" and record["message"] == "Started server process [7]"
