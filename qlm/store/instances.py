"""The serving instances the store knows: recorded and updated by the controllers (state,
health, where each model's weights are), drained by an operator, listed for the API."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import case, delete, select, update

from qlm.domain import InstanceSpec, ModelTier
from qlm.store.base import StoreBase, _rowcount
from qlm.store.models import InstanceModel
from qlm.store.rows import InstanceRow, InstanceState


class Instances(StoreBase):
    """The store's instances."""

    def upsert_instance(
        self,
        spec: InstanceSpec,
        *,
        state: InstanceState = InstanceState.UP,
        model_tiers: Mapping[str, ModelTier] | None = None,
        keep_draining: bool = False,
    ) -> InstanceRow:
        """Record an instance or update it in place; ``model_tiers`` None keeps the known tiers;
        ``keep_draining`` keeps an operator's drain of a known instance (in the same statement,
        so a drain made concurrently is never lost)."""
        now = self._clock()
        values: dict[str, Any] = {
            "url": spec.url,
            "gpu": spec.gpu,
            "gpu_count": spec.gpu_count,
            "models": list(spec.models),
            "state": state.value,
            "updated_at": now,
        }
        if model_tiers is not None:
            values["model_tiers"] = _tier_names(model_tiers)
        upsert = self._insert(InstanceModel).values(name=spec.name, **{"model_tiers": {}, **values})
        on_conflict = dict(values)
        if keep_draining:
            draining = InstanceState.DRAINING.value
            on_conflict["state"] = case(
                (InstanceModel.state == draining, draining), else_=upsert.excluded.state
            )
        stmt = upsert.on_conflict_do_update(index_elements=[InstanceModel.name], set_=on_conflict)
        with self._tx(f"record instance {spec.name!r}", write=True) as session:
            session.execute(stmt)
            model = session.get(InstanceModel, spec.name, populate_existing=True)
            assert model is not None  # just written in this transaction
            return _instance_row(model)

    def set_instance_state(self, name: str, state: InstanceState) -> bool:
        """Mark an instance up, down or draining; False when it is unknown."""
        return self._update_instance(name, state=state.value)

    def set_instance_health(self, name: str, up: bool) -> bool:
        """Record that a controller found an instance up or down, in one statement that keeps
        an operator's drain (a read-then-write would lose a drain made in between); False when
        the instance is unknown or draining."""
        stmt = (
            update(InstanceModel)
            .where(InstanceModel.name == name)
            .where(InstanceModel.state != InstanceState.DRAINING.value)
            .values(
                state=(InstanceState.UP if up else InstanceState.DOWN).value,
                updated_at=self._clock(),
            )
        )
        with self._tx(f"update instance {name!r}", write=True) as session:
            return _rowcount(session.execute(stmt)) > 0

    def set_model_tiers(self, name: str, model_tiers: Mapping[str, ModelTier]) -> bool:
        """Where each model's weights are on the instance now; False when it is unknown."""
        return self._update_instance(name, model_tiers=_tier_names(model_tiers))

    def remove_instance(self, name: str) -> bool:
        """Forget an instance (its requests keep its name); False when it was unknown."""
        with self._tx(f"remove instance {name!r}", write=True) as session:
            result = session.execute(delete(InstanceModel).where(InstanceModel.name == name))
            return _rowcount(result) > 0

    def instances(self) -> list[InstanceRow]:
        """Every known instance, by name."""
        with self._tx("list instances") as session:
            models = session.scalars(select(InstanceModel).order_by(InstanceModel.name))
            return [_instance_row(m) for m in models]

    def _update_instance(self, name: str, **values: Any) -> bool:
        stmt = (
            update(InstanceModel)
            .where(InstanceModel.name == name)
            .values(**values, updated_at=self._clock())
        )
        with self._tx(f"update instance {name!r}", write=True) as session:
            return _rowcount(session.execute(stmt)) > 0


def _tier_names(tiers: Mapping[str, ModelTier]) -> dict[str, str]:
    return {model: tier.name.lower() for model, tier in tiers.items()}


def _instance_row(m: InstanceModel) -> InstanceRow:
    return InstanceRow(
        name=m.name,
        url=m.url,
        gpu=m.gpu,
        gpu_count=m.gpu_count,
        models=tuple(m.models),
        state=InstanceState(m.state),
        model_tiers={model: ModelTier[tier.upper()] for model, tier in m.model_tiers.items()},
        updated_at=m.updated_at,
    )
