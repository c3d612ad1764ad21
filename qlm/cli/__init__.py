"""The ``qlm`` command: one module per sub-app, assembled here in the order ``qlm --help`` lists
them. A command parses its options, calls the service functions of the package that does the
work, and prints; a ``QLMError`` becomes one red line and exit code 1 (``qlm.cli.common.guard``).
Libraries that take long to import (the planner, numpy, SQLAlchemy, FastAPI, httpx) are imported
inside the commands that use them, so that ``qlm --help`` and the light commands start at once.
"""

from __future__ import annotations

import typer

from qlm.cli import instance, keys, ops, profile, service, sim_engine, simulate

app = typer.Typer(
    help="QLM: queue management for LLM serving with SLOs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts contain [brackets] that are not markup
)
app.command("simulate")(simulate.simulate_cmd)
app.command("demo")(simulate.demo_cmd)
app.command("controller")(service.controller_cmd)
app.command("serve")(service.serve_cmd)
app.command("api")(service.api_cmd)
app.add_typer(keys.keys_app, name="keys")
app.add_typer(profile.profile_app, name="profile")
app.add_typer(sim_engine.sim_engine_app, name="sim-engine")
app.add_typer(ops.ops_app, name="ops")
app.add_typer(instance.instance_app, name="instance")


def main() -> None:
    app()
