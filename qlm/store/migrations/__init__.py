"""Alembic migrations of the store, shipped inside the package so an installed QLM can migrate
(``Store.migrate()``); ``alembic -c qlm/store/migrations/alembic.ini ...`` works from a checkout."""
