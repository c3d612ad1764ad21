"""`qlm serve --replay --sim-http`: a real trace replayed through the service, the simulated
instances being `qlm sim-engine serve` processes driven over vLLM's HTTP API."""

from __future__ import annotations

import asyncio
from pathlib import Path

from qlm.domain import RequestStatus
from qlm.service.serve import serve
from qlm.settings import ControllerSettings, DemoSettings, Settings
from qlm.store import Store


def test_a_trace_replay_through_the_service_over_http(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'qlm.db'}"
    settings = Settings(
        database_url=db,
        controller=ControllerSettings(sim_over_http=True, sim_time_scale=10.0, tick_s=0.05),
        demo=DemoSettings(rate_scale=3.0),
    )
    result = asyncio.run(serve(settings, replay_s=10.0))
    assert result is not None and result.requests > 0
    assert result.finished == result.requests and result.failed == 0
    store = Store.open(db)
    rows, _ = store.list_requests(limit=1000)
    assert len(rows) == result.requests
    assert all(r.status is RequestStatus.FINISHED and r.output_text for r in rows)
    assert {r.instance for r in rows} <= {"a100-0", "a100-1"}
    store.close()
