"""The planning events controllers record (one row per plan: when, why, how it went), listed
newest first for the API and the CLI, and pruned to the latest few."""

from __future__ import annotations

from sqlalchemy import delete, select

from qlm.domain import PlanRecord
from qlm.store.base import StoreBase, _rowcount
from qlm.store.models import PlanModel
from qlm.store.rows import PlanRow


class Plans(StoreBase):
    """The store's plans."""

    def record_plan(self, record: PlanRecord, *, controller: str) -> int:
        """Keep one planning event made by ``controller``; returns its id (increasing)."""
        plan = PlanModel(
            controller=controller,
            at=record.at_s,
            trigger=record.trigger,
            groups=record.groups,
            status=record.status,
            method=record.method,
            objective=record.objective,
            edf_objective=record.edf_objective,
            at_risk=list(record.at_risk),
            capacity_needed=record.capacity_needed,
            solve_s=record.solve_s,
            evaluations=record.evaluations,
            concurrency=dict(record.concurrency),
            deferred=record.deferred,
        )
        with self._tx("record plan", write=True) as session:
            session.add(plan)
            session.flush()
            return plan.id

    def latest_plan(self) -> PlanRow | None:
        plans = self.plans(limit=1)
        return plans[0] if plans else None

    def plans(self, *, limit: int = 50) -> list[PlanRow]:
        """The latest ``limit`` plans, newest first."""
        query = select(PlanModel).order_by(PlanModel.id.desc()).limit(limit)
        with self._tx("list plans") as session:
            return [_plan_row(m) for m in session.scalars(query)]

    def prune_plans(self, *, keep: int) -> int:
        """Delete all but the latest ``keep`` plans; returns how many were deleted."""
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        with self._tx("prune plans", write=True) as session:
            oldest_kept = session.scalars(
                select(PlanModel.id).order_by(PlanModel.id.desc()).offset(max(keep - 1, 0))
            ).first()
            if oldest_kept is None:
                return 0
            cut = PlanModel.id < oldest_kept if keep else PlanModel.id <= oldest_kept
            return _rowcount(session.execute(delete(PlanModel).where(cut)))


def _plan_row(m: PlanModel) -> PlanRow:
    return PlanRow(
        id=m.id,
        controller=m.controller,
        plan=PlanRecord(
            at_s=m.at,
            trigger=m.trigger,
            groups=m.groups,
            status=m.status,
            method=m.method,
            objective=m.objective,
            edf_objective=m.edf_objective,
            at_risk=tuple(m.at_risk),
            capacity_needed=m.capacity_needed,
            solve_s=m.solve_s,
            evaluations=m.evaluations,
            concurrency=dict(m.concurrency),
            deferred=m.deferred,
        ),
    )
