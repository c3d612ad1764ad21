"""Alembic's entry point for the store's migrations.

``Store.migrate()`` hands over its own connection (``config.attributes["connection"]``), so the
migration runs on the store's engine: its SQLite set-up, its in-memory database, its PostgreSQL
``search_path``. The ``alembic`` command line gets its URL from ``QLM_DATABASE_URL`` instead.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection

from qlm.store.database import DEFAULT_PATH, SETTING, make_engine, parse_url
from qlm.store.models import Base

config = context.config


def _run(connection: Connection) -> None:
    # SQLite alters tables by copying them ("batch" mode); PostgreSQL alters in place.
    batch = connection.dialect.name == "sqlite"
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=batch,
        transactional_ddl=True,  # true of SQLite too, as the store's engine BEGINs itself
    )
    with context.begin_transaction():
        context.run_migrations()


def _url() -> str:
    return os.environ.get(SETTING) or f"sqlite:///{DEFAULT_PATH}"


def run_offline() -> None:
    url = parse_url(_url())
    context.configure(
        url=url,
        target_metadata=Base.metadata,
        literal_binds=True,
        transactional_ddl=True,
        render_as_batch=url.get_backend_name() == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if isinstance(connection, Connection):
        _run(connection)
        return
    engine = make_engine(parse_url(_url()))
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if config.config_file_name is not None and "connection" not in config.attributes:
    fileConfig(config.config_file_name)  # CLI use only: never reconfigure a server's logging

if context.is_offline_mode():
    run_offline()
else:
    run_online()
