"""Alembic revisions of the store's schema, oldest first."""
