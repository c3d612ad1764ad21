"""What every ``qlm`` command shares: the consoles, and the edge where a ``QLMError`` becomes one
red line and exit code 1 (here and only here)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from qlm.errors import QLMError

console = Console()
err_console = Console(stderr=True)

T = TypeVar("T")


def fail(message: str) -> NoReturn:
    """Print ``message`` as one red line on stderr and exit 1; once the process logs JSON
    (``QLM_LOG_FORMAT=json``), log it instead, so that its log stays JSON to the last line."""
    from qlm.cli.logs import logs_json

    if logs_json():
        logging.getLogger("qlm.cli").critical("error: %s", message)
    else:
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def guard(fn: Callable[[], T]) -> T:
    """``fn()``; a ``QLMError`` it raises fails the command with its message."""
    try:
        return fn()
    except QLMError as exc:
        fail(str(exc))
