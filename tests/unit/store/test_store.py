"""The store without a server: SQLite specifics (file databases, the default file, what the file
holds, migrating an old file), URL configuration and errors, batched statements. What every
backend does is the contract, ``tests/contract/test_store.py``."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import pytest

from qlm.errors import ConfigError
from qlm.store import Store, StoreError
from qlm.store.database import make_engine, parse_url, unreachable
from qlm.store.models import Base
from tests.contract.test_store import new_request, plan_record, race_outcomes


def test_racing_outcomes_on_a_sqlite_file_are_recorded_once(tmp_path: Path) -> None:
    # A file database has one connection per thread (the in-memory one shares a single one).
    with Store.open(f"sqlite:///{tmp_path / 'q.db'}") as store:
        for trial in range(3):
            id = f"race{trial}"
            store.add_request(new_request(trial, id=id))
            recorded = race_outcomes(store, id)
            assert sum(recorded) == 1


def test_open_without_url_uses_the_default_file(tmp_path: Path) -> None:
    path = tmp_path / "state" / "qlm.db"
    with Store.open(None, default_path=path) as store:
        store.add_request(new_request(1))
    with Store.open(None, default_path=path) as store:
        assert store.get("r0001") is not None
    assert store.url == f"sqlite:///{path}"


def test_api_keys_are_stored_only_as_digests(tmp_path: Path) -> None:
    path = tmp_path / "q.db"
    with Store.open(f"sqlite:///{path}") as store:
        key = store.create_api_key("acme", name="ci")
    secret = key.removeprefix("qlm_")
    database = sqlite3.connect(path)
    assert len(database.execute("SELECT * FROM api_keys").fetchall()) == 1
    dump = "\n".join(database.iterdump())
    database.close()
    assert secret not in dump
    assert secret[-20:] not in dump


def test_an_unmigrated_database_says_so() -> None:
    with Store("sqlite://") as store, pytest.raises(StoreError, match="migrate"):
        store.get("r0001")


@pytest.mark.parametrize(
    "url", ["not a url", "mysql://u@h/db", "sqlite+bogus:///x.db", "oracle://a:secret@h/db"]
)
def test_a_bad_url_names_the_setting(url: str) -> None:
    with pytest.raises(ConfigError, match="QLM_DATABASE_URL") as error:
        Store(url)
    assert "secret" not in str(error.value)


@pytest.mark.parametrize("url", ["postgresql://u@h/db", "postgres://u@h/db"])
def test_plain_postgresql_urls_use_psycopg(url: str) -> None:
    assert parse_url(url).drivername == "postgresql+psycopg"


def test_an_unreachable_database_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'missing-dir' / 'q.db'}"
    with pytest.raises(StoreError) as err:
        Store.open(url)
    message = str(err.value)
    assert message.startswith(f"cannot reach the store at {url}: unable to open database file")
    assert "does its directory exist" in message and message.endswith("(QLM_DATABASE_URL)")
    assert not (tmp_path / "missing-dir").exists()


@pytest.mark.parametrize(
    ("reason", "hint"),
    [
        (
            'connection to server at "127.0.0.1", port 1 failed: Connection refused',
            "is PostgreSQL running there?",
        ),
        ('FATAL:  password authentication failed for user "qlm"', "check the user and password"),
        ('FATAL:  role "nobody" does not exist', "check the user and password"),
        ('FATAL:  database "qlm" does not exist', "create the database first"),
        ("failed to resolve host 'db': [Errno -2] Name or service not known", "check the host"),
    ],
)
def test_an_unreachable_postgresql_says_what_to_check(reason: str, hint: str) -> None:
    url = parse_url("postgresql+psycopg://qlm:secret@db:5432/qlm")
    message = unreachable(url, reason)
    assert message == (
        f"cannot reach the store at postgresql+psycopg://qlm:***@db:5432/qlm: {reason}; "
        f"{message.split('; ')[-1]}"
    )
    assert hint in message and message.endswith("(QLM_DATABASE_URL)")


def test_a_postgresql_server_that_is_not_there_stops_the_store_with_one_line() -> None:
    pytest.importorskip("psycopg")
    with pytest.raises(StoreError) as err:
        Store.open("postgresql+psycopg://postgres:secret@127.0.0.1:1/test")  # nothing listens
    message = str(err.value)
    assert message.startswith("cannot reach the store at postgresql+psycopg://postgres:***@")
    assert "refused" in message and "is PostgreSQL running there?" in message
    assert "\n" not in message and "secret" not in message


def test_without_the_postgres_extra_a_postgresql_url_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if psycopg were not installed
    with pytest.raises(ConfigError) as err:
        Store("postgresql://qlm:secret@db/qlm")
    message = str(err.value)
    assert message.startswith("QLM_DATABASE_URL is a PostgreSQL URL but its driver, psycopg 3,")
    assert "pip install 'qlm[postgres]'" in message
    assert "\n" not in message and "secret" not in message


def test_plans_recorded_before_the_deferred_column_read_back_with_zero_deferred(
    tmp_path: Path,
) -> None:
    from alembic import command
    from sqlalchemy import text

    from qlm.store.store import alembic_config

    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = make_engine(parse_url(url))
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, "0002")  # a database from before plans had ``deferred``
        connection.execute(
            text(
                'INSERT INTO plans (controller, at, "trigger", groups, status, method, objective,'
                " edf_objective, at_risk, capacity_needed, solve_s, evaluations, concurrency)"
                " VALUES ('c0', 1.0, 'period', 2, 'heuristic', 'local', 0.5, 0.7, '[]', NULL,"
                " 0.01, 10, '{}')"
            )
        )
    engine.dispose()
    with Store.open(url) as store:  # migrates to the latest revision
        row = store.latest_plan()
        assert row is not None and (row.plan.trigger, row.plan.deferred) == ("period", 0)
        store.record_plan(plan_record(at_s=2.0, deferred=3), controller="c0")
        assert [p.plan.deferred for p in store.plans()] == [3, 0]


def test_batches_are_split_in_power_of_two_runs_and_in_lists_padded() -> None:
    from qlm.store.base import _in, _pieces

    items = list(range(37))
    runs = list(_pieces(items))
    assert [len(r) for r in runs] == [32, 4, 1]
    assert [x for r in runs for x in r] == items
    assert list(_pieces([])) == []
    column = Base.metadata.tables["requests"].c.id
    clause = _in(column, ["a", "b", "c"])
    assert clause.right.value == ["a", "b", "c", "c"]  # padded to 4 with the last id
    assert _in(column, ["a"]).right.value == ["a"]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql+psycopg://qlm@db:5432/qlm", {"connect_timeout": 10}),
        ("postgresql+psycopg://qlm@db:5432/qlm?connect_timeout=3", {}),
    ],
)
def test_a_postgresql_connect_gives_up_after_a_bound_unless_the_url_sets_one(
    url: str, expected: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("psycopg")
    import qlm.store.database as database

    seen: dict[str, object] = {}

    def fake(target: object, **kwargs: object) -> object:
        seen.update(kwargs)
        return object()

    monkeypatch.setattr(database, "create_engine", fake)
    database.make_engine(parse_url(url))
    assert seen["connect_args"] == expected and seen["pool_pre_ping"] is True
