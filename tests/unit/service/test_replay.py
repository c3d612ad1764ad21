"""A replayed trace request as the service records it: under the replay tenant, labelled with
its run and its SLO class (the simulator's per-class tenants are not the service's clients)."""

from __future__ import annotations

from qlm.domain import SLO, Request, Tier
from qlm.service.replay import REPLAY_TENANT, to_message


def test_a_replayed_request_lands_in_the_replay_tenant_with_its_class_as_a_label() -> None:
    request = Request(
        id="r000001",
        model="m",
        input_tokens=100,
        max_tokens=50,
        arrival_s=3.0,
        slo=SLO(e2e_s=20.0, ttft_s=2.0),
        tier=Tier.INTERACTIVE,
        tenant="chat",
        slo_class="chat",
        labels=(("kind", "mega"),),
    )
    msg = to_message(request, 1000.0, "run1")
    assert msg.tenant == REPLAY_TENANT == "replay"
    assert msg.labels == {"replay": "run1", "class": "chat", "kind": "mega"}
    assert (msg.id, msg.submitted_at, msg.slo_e2e_s, msg.slo_ttft_s, msg.tier) == (
        "run1-r000001", 1000.0, 20.0, 2.0, int(Tier.INTERACTIVE),
    )  # fmt: skip
