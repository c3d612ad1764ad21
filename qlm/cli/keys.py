"""``qlm keys``: create, list and revoke API keys in the store."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.markup import escape

from qlm.cli.common import console, err_console, fail, guard

keys_app = typer.Typer(
    help="API keys: one per client, each naming a tenant (docs/api.md).",
    no_args_is_help=True,
    rich_markup_mode=None,
)


def _open_store() -> Any:
    from qlm.settings import get_settings
    from qlm.store import Store

    return Store.open(get_settings().database_url)


@keys_app.command("create")
def keys_create_cmd(
    tenant: Annotated[str, typer.Option(help="The tenant the key acts for.")],
    admin: Annotated[
        bool, typer.Option("--admin", help="May see every tenant and the operator endpoints.")
    ] = False,
    name: Annotated[str, typer.Option(help="A note to tell keys apart.")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Create a key and print it. Only its digest is stored: it cannot be shown again."""
    if not tenant.strip():
        fail("--tenant must not be empty")

    def create() -> str:
        with _open_store() as store:
            key: str = store.create_api_key(tenant, admin=admin, name=name)
            return key

    key = guard(create)
    if as_json:
        sys.stdout.write(json.dumps({"key": key, "tenant": tenant, "admin": admin}) + "\n")
        return
    sys.stdout.write(key + "\n")
    err_console.print(
        f"key for tenant {escape(tenant)}{' (admin)' if admin else ''}: shown once, keep it "
        "(send it as 'Authorization: Bearer <key>')",
        highlight=False,
    )


@keys_app.command("list")
def keys_list_cmd(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Every key (without its secret): id, tenant, admin, name, prefix, created, revoked."""

    def listing() -> list[Any]:
        with _open_store() as store:
            keys: list[Any] = store.api_keys(tenant=tenant)
            return keys

    keys = guard(listing)
    if as_json:
        rows = [
            {
                "id": k.id,
                "tenant": k.tenant,
                "admin": k.admin,
                "name": k.name,
                "prefix": k.prefix,
                "created_at": k.created_at,
                "revoked_at": k.revoked_at,
            }
            for k in keys
        ]
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    from rich.table import Table

    table = Table(title="API keys", title_justify="left")
    for column in ("id", "tenant", "admin", "name", "prefix", "revoked"):
        table.add_column(column)
    for k in keys:
        table.add_row(
            str(k.id),
            escape(k.tenant),
            "yes" if k.admin else "",
            escape(k.name),
            k.prefix + "…",
            "revoked" if k.revoked else "",
        )
    console.print(table)


@keys_app.command("revoke")
def keys_revoke_cmd(
    key_id: Annotated[int, typer.Argument(help="The key's id (qlm keys list).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Revoke a key: calls with it fail within QLM_API__KEY_CACHE_S seconds."""

    def revoke() -> bool:
        with _open_store() as store:
            done: bool = store.revoke_api_key(key_id)
            return done

    if not guard(revoke):
        fail(f"no active key with id {key_id} (qlm keys list)")
    if as_json:
        sys.stdout.write(json.dumps({"id": key_id, "revoked": True}) + "\n")
        return
    console.print(f"revoked key {key_id}", highlight=False)
