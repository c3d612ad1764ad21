"""The API's pure parts and its store additions: token estimate, chat template, admission from
the plan, the token bucket, key lookups, the submission writer, and ``Store.add_requests`` /
``delete_requests``."""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import threading
import time
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from qlm.api import intake
from qlm.api.auth import Authenticator
from qlm.api.control import assess
from qlm.api.limits import QueuedCounter, RateLimiter, retry_after
from qlm.api.prompts import estimate_tokens, render_chat
from qlm.api.schemas.common import MAX_JSON_DEPTH, SHALLOW, clean_text, shallow
from qlm.api.schemas.native import SubmitIn
from qlm.api.submission import Submitter
from qlm.cli import app
from qlm.domain import RequestStatus
from qlm.global_queue import MemoryGlobalQueue, QueuedRequest, QueueUnavailable
from qlm.settings import ApiSettings
from qlm.store import NewRequest, Store, StoreError
from tests.unit.api.test_api import busy_snapshot


def new(i: int, **kw: Any) -> NewRequest:
    fields: dict[str, Any] = {
        "id": f"req_{i}",
        "tenant": "acme",
        "model": "m",
        "prompt_tokens": 3,
        "max_tokens": 8,
        "slo_e2e_s": 30.0,
        "submitted_at": 100.0 + i,
        "labels": (("k", str(i)),),
    }
    return NewRequest(**(fields | kw))


def test_tokens_are_estimated_at_four_characters_each() -> None:
    assert [estimate_tokens(t) for t in ("", "a", "abcd", "abcde")] == [1, 1, 1, 2]
    for n in [*range(64), 4095, 4096, 4097, 10**6 + 1]:
        assert estimate_tokens("x" * n) == max(1, math.ceil(n / 4))


def test_request_ids_are_24_hex_digits_of_96_random_bits() -> None:
    for seed in range(50):
        intake._IDS.seed(seed)
        got = intake.new_id()
        intake._IDS.seed(seed)
        assert got == f"req_{intake._IDS.getrandbits(96):024x}"
    intake._IDS.seed(secrets.randbits(128))


@pytest.mark.parametrize(
    ("text", "refused"),
    [("plain", None), ("été ☃ 😀", None), ("a\x00b", "NUL"), ("a\ud800b", "surrogates")],
)
def test_text_is_refused_with_a_nul_or_a_lone_surrogate(text: str, refused: str | None) -> None:
    if refused is None:
        assert clean_text(text) is text
    else:
        with pytest.raises(ValueError, match=refused):
            clean_text(text)


def test_chat_is_rendered_with_chatml_and_text_parts_are_joined() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert render_chat(messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    )


def test_admission_compares_the_work_due_earlier_with_the_deadline() -> None:
    now = 1000.0
    snap = busy_snapshot(now)  # work due at now+5 completes at now+100 on i0
    assert not assess(snap, model="m", deadline_at=now + 30, now=now).feasible
    late = assess(snap, model="m", deadline_at=now + 300, now=now)
    assert late.feasible and late.predicted_start_at == now + 100
    assert assess(None, model="m", deadline_at=now + 1, now=now).feasible
    assert assess(snap, model="other", deadline_at=now + 1, now=now).feasible
    snap["instances"][0]["draining"] = True
    verdict = assess(snap, model="m", deadline_at=now + 300, now=now)
    assert not verdict.feasible and "draining" in verdict.reason


def test_the_token_bucket_refills_at_its_rate() -> None:
    t = [0.0]
    bucket = RateLimiter(2.0, 2, clock=lambda: t[0])
    assert [bucket.take("a"), bucket.take("a")] == [0.0, 0.0]
    assert bucket.take("a") == 0.5 and bucket.take("b") == 0.0
    t[0] = 0.5
    assert bucket.take("a") == 0.0
    assert retry_after(0.01) == "1" and retry_after(2.2) == "3"


def test_calls_that_find_a_key_uncached_together_ask_the_store_once() -> None:
    with Store.open("sqlite://") as store:
        key = store.create_api_key("acme")
        lookups: list[str] = []
        lookup = store.lookup_api_key
        entered = threading.Event()

        def slow_lookup(token: str) -> Any:
            lookups.append(token)
            entered.set()
            time.sleep(0.05)  # all the calls below arrive while it runs
            return lookup(token)

        store.lookup_api_key = slow_lookup  # type: ignore[method-assign]
        auth = Authenticator(store, ApiSettings())

        async def main() -> list[str]:
            principals = await asyncio.gather(*(auth.authenticate(key) for _ in range(20)))
            cached = await auth.authenticate(key)
            return [p.tenant for p in [*principals, cached]]

        assert asyncio.run(main()) == ["acme"] * 21
        assert lookups == [key]


def test_a_cached_key_names_the_principal_the_store_named() -> None:
    from qlm.api.auth import Principal

    with Store.open("sqlite://") as store:
        keys = {
            "acme": store.create_api_key("acme"),
            "ops": store.create_api_key("ops", admin=True),
        }
        lookups: list[str] = []
        lookup = store.lookup_api_key

        def counted(token: str) -> Any:
            lookups.append(token)
            return lookup(token)

        store.lookup_api_key = counted  # type: ignore[method-assign]
        t = [0.0]
        auth = Authenticator(store, ApiSettings(key_cache_s=5), clock=lambda: t[0])

        async def main() -> None:
            for tenant, key in keys.items():
                found = store.lookup_api_key(key)
                assert found is not None
                expected = Principal(tenant, tenant == "ops", found.id)
                assert await auth.authenticate(key) == expected  # asked the store
                t[0] += 4.9
                assert await auth.authenticate(key) == expected  # cached
                t[0] += 0.2
                assert await auth.authenticate(key) == expected  # expired: asked again

        asyncio.run(main())
        assert lookups == [keys["acme"]] * 3 + [keys["ops"]] * 3


def message_of_new(n: NewRequest) -> QueuedRequest:
    return QueuedRequest(
        id=n.id,
        model=n.model,
        prompt_tokens=n.prompt_tokens,
        max_tokens=n.max_tokens,
        slo_e2e_s=n.slo_e2e_s,
        slo_ttft_s=None,
        submitted_at=n.submitted_at,
        tenant=n.tenant,
        prompt="p",
        messages=None,
        sampling={},
        tier=1,
        labels={},
    )


def test_several_batches_in_flight_record_each_request_once_and_publish_it() -> None:
    with Store.open("sqlite://") as store:
        queue = MemoryGlobalQueue()

        async def main() -> list[Any]:
            submitter = Submitter(store, queue, max_batch=4, writers=3)
            submitter.start()
            news = [new(i) for i in range(30)] + [
                new(100 + i, idempotency_key="same") for i in range(5)
            ]
            try:
                results = await asyncio.gather(
                    *(submitter.submit(n, message_of_new(n)) for n in news)
                )
            finally:
                await submitter.close()
            assert submitter.batches >= 30 / 4
            return results

        results = asyncio.run(main())
        assert [r.replayed for r in results[:30]] == [False] * 30
        keyed = results[30:]
        assert len({r.row.id for r in keyed}) == 1 and sum(not r.replayed for r in keyed) == 1
        rows, _ = store.list_requests(limit=100)
        assert len(rows) == 31
        # Replays of a key whose request is still queued are published again (by design).
        ids = {QueuedRequest.decode(s.raw).id for s in queue.broker._ready}
        assert ids == {row.id for row in rows}


class GatedStore:
    """A store whose ``add_requests_async`` writes only once ``gate`` is set, and can fail."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.gate = asyncio.Event()
        self.gate.set()
        self.writing = asyncio.Event()
        self.fail: StoreError | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def add_requests_async(self, news: list[NewRequest]) -> set[str]:
        self.writing.set()
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return await self.store.add_requests_async(news)


def queued_ids(queue: MemoryGlobalQueue) -> set[str]:
    return {QueuedRequest.decode(s.raw).id for s in queue.broker._ready}


def test_a_request_without_a_key_is_published_while_its_row_is_written() -> None:
    with Store.open("sqlite://") as store:
        queue = MemoryGlobalQueue()
        gated = GatedStore(store)

        async def main() -> None:
            submitter = Submitter(gated, queue)  # type: ignore[arg-type]
            submitter.start()
            try:
                # The first batch is committed first (nothing known of the store yet).
                gated.gate.clear()
                first = asyncio.ensure_future(submitter.submit(new(0), message_of_new(new(0))))
                await gated.writing.wait()
                await asyncio.sleep(0)
                assert queued_ids(queue) == set()
                gated.gate.set()
                await first
                # Then a keyless request's message goes out before its commit ends, and its
                # caller waits for both; a keyed one still waits for the commit.
                gated.gate.clear()
                gated.writing.clear()
                keyless = asyncio.ensure_future(submitter.submit(new(1), message_of_new(new(1))))
                keyed_new = new(2, idempotency_key="k")
                keyed = asyncio.ensure_future(
                    submitter.submit(keyed_new, message_of_new(keyed_new))
                )
                async with asyncio.timeout(20):  # committed first, it would never be
                    while "req_1" not in queued_ids(queue):
                        await asyncio.sleep(0)
                assert "req_2" not in queued_ids(queue)
                assert not keyless.done() and store.get("req_1") is None
                gated.gate.set()
                assert not (await keyless).replayed and not (await keyed).replayed
                assert store.get("req_1") is not None
                assert queued_ids(queue) == {"req_0", "req_1", "req_2"}
            finally:
                gated.gate.set()
                await submitter.close()

        asyncio.run(main())


def test_requests_confirmed_while_the_store_fails_are_accepted_then_the_store_goes_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with Store.open("sqlite://") as store:
        queue = MemoryGlobalQueue()
        gated = GatedStore(store)

        async def main() -> None:
            submitter = Submitter(gated, queue)  # type: ignore[arg-type]
            submitter.start()
            try:
                await submitter.submit(new(0), message_of_new(new(0)))
                gated.fail = StoreError("cannot record 2 requests: the database is gone")
                keyed_new = new(2, idempotency_key="k")
                keyless, keyed = await asyncio.gather(
                    submitter.submit(new(1), message_of_new(new(1))),
                    submitter.submit(keyed_new, message_of_new(keyed_new)),
                    return_exceptions=True,
                )
                # The broker holds the keyless one: accepted, the controller records its row.
                assert not isinstance(keyless, BaseException) and not keyless.replayed
                assert isinstance(keyed, StoreError)
                assert queued_ids(queue) == {"req_0", "req_1"}
                assert store.get("req_1") is None
                # While the store keeps failing, nothing more is published.
                with pytest.raises(StoreError):
                    await submitter.submit(new(3), message_of_new(new(3)))
                assert queued_ids(queue) == {"req_0", "req_1"}
                gated.fail = None
                await submitter.submit(new(4), message_of_new(new(4)))
                assert queued_ids(queue) == {"req_0", "req_1", "req_4"}
            finally:
                await submitter.close()

        asyncio.run(main())
        assert "confirmed by the broker while the store failed" in caplog.text


def test_a_batch_cancelled_during_its_commit_leaves_no_caller_waiting() -> None:
    """A keyless request whose message was published is answered by its confirm; a keyed one,
    not published yet, gets 503."""
    with Store.open("sqlite://") as store:
        queue = MemoryGlobalQueue()
        gated = GatedStore(store)

        async def main() -> list[Any]:
            submitter = Submitter(gated, queue)  # type: ignore[arg-type]
            submitter.start()
            try:
                await submitter.submit(new(0), message_of_new(new(0)))
                gated.gate.clear()
                gated.writing.clear()
                keyed_new = new(2, idempotency_key="k")
                calls = [
                    asyncio.ensure_future(submitter.submit(new(1), message_of_new(new(1)))),
                    asyncio.ensure_future(submitter.submit(keyed_new, message_of_new(keyed_new))),
                ]
                await gated.writing.wait()
                for task in list(submitter._writing):
                    task.cancel()
                async with asyncio.timeout(30):  # nobody left waiting
                    return await asyncio.gather(*calls, return_exceptions=True)
            finally:
                gated.gate.set()
                await submitter.close()

        keyless, keyed = asyncio.run(main())
        assert not isinstance(keyless, BaseException) and not keyless.replayed
        assert isinstance(keyed, QueueUnavailable)
        assert queued_ids(queue) == {"req_0", "req_1"}


def test_a_request_published_during_its_commit_and_refused_leaves_no_row() -> None:
    class Refusing(MemoryGlobalQueue):
        async def publish_many(self, messages: Any) -> list[QueueUnavailable | None]:
            return [
                QueueUnavailable("not confirmed") if m.id == "req_1" else None for m in messages
            ]

    with Store.open("sqlite://") as store:
        queue = Refusing()

        async def main() -> list[Any]:
            submitter = Submitter(store, queue)
            submitter.start()
            try:
                await submitter.submit(new(0), message_of_new(new(0)))  # the store goes first
                assert submitter._overlap  # now published during the commit
                return await asyncio.gather(
                    *(submitter.submit(new(i), message_of_new(new(i))) for i in (1, 2)),
                    return_exceptions=True,
                )
            finally:
                await submitter.close()

        refused, taken = asyncio.run(main())
        assert isinstance(refused, QueueUnavailable) and not isinstance(taken, BaseException)
        assert store.get("req_1") is None and store.get("req_2") is not None


def test_a_replay_waiting_on_a_first_call_that_went_away_gets_its_outcome() -> None:
    class Held(MemoryGlobalQueue):
        def __init__(self) -> None:
            super().__init__()
            self.publishing = asyncio.Event()
            self.go = asyncio.Event()

        async def publish_many(self, messages: Any) -> list[QueueUnavailable | None]:
            self.publishing.set()
            await self.go.wait()
            return await super().publish_many(messages)

    with Store.open("sqlite://") as store:

        async def main() -> Any:
            queue = Held()
            submitter = Submitter(store, queue)
            submitter.start()
            try:
                first_new, again_new = new(1, idempotency_key="k"), new(2, idempotency_key="k")
                first = asyncio.ensure_future(
                    submitter.submit(first_new, message_of_new(first_new))
                )
                await queue.publishing.wait()  # recorded; its publish is under way
                again = asyncio.ensure_future(
                    submitter.submit(again_new, message_of_new(again_new))
                )
                async with asyncio.timeout(30):  # until the replay follows the first call
                    while not submitter._inflight["req_1"].followers:
                        await asyncio.sleep(0)
                first.cancel()  # its client went away
                queue.go.set()
                async with asyncio.timeout(30):  # no outcome would leave it waiting
                    return await again
            finally:
                queue.go.set()
                await submitter.close()

        replay = asyncio.run(main())
        assert replay.replayed and replay.row.id == "req_1"


def test_a_stale_queued_count_is_counted_again_while_submissions_go_on() -> None:
    with Store.open("sqlite://") as store:
        counting = threading.Event()
        release = threading.Event()
        answers = iter([5, 8])

        def queued_count(tenant: str) -> int:
            if counting.is_set():
                release.wait(30)
            return next(answers)

        store.queued_count = queued_count  # type: ignore[method-assign]
        now = [0.0]
        counter = QueuedCounter(store, ttl_s=1.0, clock=lambda: now[0])

        async def main() -> list[bool]:
            taken = [await counter.reserve("acme", 10)]  # the first count: waited for (5)
            counting.set()
            now[0] = 2.0  # stale: counted again in the background, held by the store
            taken.append(await counter.reserve("acme", 10))  # checked against the old count
            async with asyncio.timeout(30):
                while "acme" not in counter._refreshing:
                    await asyncio.sleep(0)
            taken += [await counter.reserve("acme", 10) for _ in range(4)]  # 5 + 5 >= 10 last
            release.set()
            async with asyncio.timeout(30):
                while counter._counts["acme"].queued != 8:
                    await asyncio.sleep(0.01)
            # The new count (8) keeps the 3 reserved while the store counted: 8 + 3 >= 10.
            taken.append(await counter.reserve("acme", 10))
            return taken

        assert asyncio.run(main()) == [True, True, True, True, True, False, False]


def test_add_requests_records_a_batch_and_reports_taken_idempotency_keys() -> None:
    with Store.open("sqlite://") as store:
        store.add_request(new(0, idempotency_key="k"))
        created = store.add_requests([new(1), new(2, idempotency_key="k"), new(3)])
        assert created == {"req_1", "req_3"}
        assert store.get("req_2") is None
        row = store.get("req_1")
        assert (
            row is not None and row.status is RequestStatus.QUEUED and row.labels == (("k", "1"),)
        )
        assert store.list_requests(label=("k", "3"))[0][0].id == "req_3"
        assert store.add_requests([]) == set()


def test_delete_requests_removes_only_what_no_controller_touched() -> None:
    with Store.open("sqlite://") as store:
        store.add_requests([new(1), new(2), new(3)])
        store.mark_dispatched("req_2", instance="i0", at=1.0)
        store.cancel("req_3")
        assert store.delete_requests(["req_1", "req_2", "req_3", "nope"]) == 1
        assert store.get("req_1") is None and store.list_requests(label=("k", "1"))[0] == []
        assert store.get("req_2") is not None and store.get("req_3") is not None


def test_keys_are_created_listed_and_revoked_from_the_cli(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("QLM_DATABASE_URL", f"sqlite:///{tmp_path / 'qlm.db'}")
    runner = CliRunner()
    made = runner.invoke(app, ["keys", "create", "--tenant", "acme", "--admin", "--json"])
    assert made.exit_code == 0, made.output
    assert '"tenant": "acme"' in made.stdout and '"admin": true' in made.stdout
    listed = runner.invoke(app, ["keys", "list", "--json"])
    assert '"prefix": "qlm_' in listed.stdout
    revoked = runner.invoke(app, ["keys", "revoke", "1", "--json"])
    assert revoked.exit_code == 0 and json.loads(revoked.stdout) == {"id": 1, "revoked": True}
    assert json.loads(runner.invoke(app, ["keys", "list", "--json"]).stdout)[0]["revoked_at"]
    again = runner.invoke(app, ["keys", "revoke", "1"])
    assert again.exit_code == 1 and "no active key with id 1" in again.output


def test_a_body_whose_text_cannot_nest_too_deep_skips_the_walk_and_a_deep_one_is_refused() -> None:
    shallow_body = b'{"model": "m", "prompt": "[[{{", "max_tokens": 1, "labels": {"a": "b"}}'
    assert shallow(shallow_body)
    assert not shallow(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    # Brackets inside strings count too: such a body is only walked, and still accepted.
    many = json.dumps({"model": "m", "prompt": "[" * 100, "max_tokens": 1}).encode()
    assert not shallow(many)
    assert SubmitIn.model_validate(json.loads(many)).prompt == "[" * 100
    deep: Any = "x"
    for _ in range(MAX_JSON_DEPTH + 1):
        deep = [deep]
    body = {"model": "m", "prompt": "p", "max_tokens": 1, "labels": {"k": deep}}
    with pytest.raises(ValidationError, match="deeper than"):
        SubmitIn.model_validate(body)
    assert SubmitIn.model_validate(body | {"labels": {}}, context=SHALLOW).labels == {}


def test_the_default_slo_is_its_tiers_setting() -> None:
    from types import SimpleNamespace

    from qlm.api.intake import default_slo
    from qlm.domain import Tier

    settings = ApiSettings(interactive_slo_s=5, standard_slo_s=50, batch_slo_s=500)
    ctx: Any = SimpleNamespace(settings=settings)
    for tier, expected in [(Tier.INTERACTIVE, 5.0), (Tier.STANDARD, 50.0), (Tier.BATCH, 500.0)]:
        assert default_slo(ctx, tier) == default_slo(ctx, int(tier)) == expected  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        default_slo(ctx, 3)  # type: ignore[arg-type]


def test_a_submissions_labels_are_recorded_sorted_and_published_as_given() -> None:
    from tests.unit.api.test_api import published, run

    async def scenario(h: Any) -> None:
        for labels in [{}, {"k": "v"}, {"z": "1", "a": "2", "m": "3"}]:
            r = await h.submit(labels=labels)
            assert r.status_code == 202, r.text
            row = h.store.get(r.json()["id"])
            assert row.labels == tuple(sorted(labels.items()))
            assert list(published(h.queue)[-1].labels.items()) == list(labels.items())

    run(scenario)
