"""The state each controller publishes: whether it is the active one, and a snapshot of its
virtual queues, instances and counters, which the API and the CLI read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select

from qlm.store.base import StoreBase
from qlm.store.models import ControllerStateModel
from qlm.store.rows import ControllerStateRow


class ControllerStates(StoreBase):
    """The controllers' published states."""

    def put_controller_state(
        self, name: str, *, active: bool, snapshot: Mapping[str, Any], stopped: bool = False
    ) -> None:
        """Publish controller ``name``'s state (replacing what it published before).
        ``stopped``: its last publication, as it stops cleanly — readers then know it is gone,
        not late; publishing again (a restart under the same name) clears it."""
        now = self._clock()
        values = {
            "active": active,
            "updated_at": now,
            "snapshot": dict(snapshot),
            "stopped_at": now if stopped else None,
        }
        stmt = (
            self._insert(ControllerStateModel)
            .values(name=name, **values)
            .on_conflict_do_update(index_elements=[ControllerStateModel.name], set_=values)
        )
        with self._tx(f"publish the state of controller {name!r}", write=True) as session:
            session.execute(stmt)

    def controller_states(self) -> list[ControllerStateRow]:
        """Every controller's last published state, the most recent first."""
        query = select(ControllerStateModel).order_by(ControllerStateModel.updated_at.desc())
        with self._tx("read controller states") as session:
            return [
                ControllerStateRow(m.name, m.active, m.updated_at, dict(m.snapshot), m.stopped_at)
                for m in session.scalars(query)
            ]
