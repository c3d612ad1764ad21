"""Structured output (``response_format``): the API checks it and passes it on, the simulated
engine writes a JSON document of the schema, and a structured answer that is interrupted starts
over instead of being continued (a grammar starts at the answer's first token)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from builders import make_request

from qlm.domain import RequestStatus
from qlm.engines.base import EngineRequest
from qlm.errors import EngineError, RequestRejected
from qlm.global_queue.message import MessageError, QueuedRequest
from qlm.service.hub import ResultEvent
from qlm.service.jobs import Job
from qlm.structured import SchemaUnsupported, document_pieces, resumable, schema_problem
from tests.unit.api.test_api import FakeController, Harness, busy_snapshot, error, published
from tests.unit.api.test_api import run as run_api
from tests.unit.service.test_agent_runtime import (
    EvictOnce,
    Recorder,
    Seen,
    engine,
    eventually,
    run,
    start,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 18},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2},
        "home": {"$ref": "#/$defs/place"},
        "ok": {"type": "boolean"},
        "note": {"anyOf": [{"type": "null"}, {"type": "string"}]},
    },
    "required": ["name", "age"],
    "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def words(text: str) -> int:
    return len(text.split())


# --- the documents ----------------------------------------------------------------------------


def test_a_document_follows_its_schema_and_grows_its_strings_to_the_length_asked() -> None:
    smallest = document_pieces(FORMAT, 1)
    doc = json.loads("".join(smallest))
    assert doc == {
        "name": "tok",
        "age": 18,
        "tags": ["a", "a"],
        "home": {"city": "tok"},
        "ok": True,
        "note": None,
    }
    for target in (len(smallest), len(smallest) + 1, 200):
        pieces = document_pieces(FORMAT, target)
        assert len(pieces) == target
        grown = json.loads("".join(pieces))
        assert {k: v for k, v in grown.items() if k not in ("name", "home")} == {
            k: v for k, v in doc.items() if k not in ("name", "home")
        }
        assert words(grown["name"]) + words(grown["home"]["city"]) == target - len(smallest) + 2


def test_a_document_without_strings_ends_at_its_smallest_and_json_object_is_an_object() -> None:
    numbers = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
    assert document_pieces(numbers, 50) == ["0"]
    pieces = document_pieces({"type": "json_object"}, 9)
    assert len(pieces) == 9 and isinstance(json.loads("".join(pieces)), dict)


def test_schema_problems_name_where_they_are() -> None:
    assert schema_problem(PERSON) is None
    assert schema_problem({"type": "strin"}) == (
        "/type: 'strin' is not a JSON Schema type "
        "(array, boolean, integer, null, number, object, string)"
    )
    bad = {"type": "object", "properties": {"a": {"items": {"type": "text"}}}}
    assert (schema_problem(bad) or "").startswith("/properties/a/items/type: 'text'")
    assert "references inside" in (schema_problem({"$ref": "https://x/s.json"}) or "")
    assert (schema_problem({"required": "a"}) or "").startswith("/required:")
    assert (schema_problem({"anyOf": []}) or "").startswith("/anyOf:")


def test_only_a_text_format_leaves_an_answer_resumable() -> None:
    assert resumable({}) and resumable({"response_format": {"type": "text"}})
    assert not resumable({"response_format": {"type": "json_object"}})
    assert not resumable({"temperature": 0.5, "response_format": FORMAT})


# --- the API --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response_format", "param", "fragment"),
    [
        ({"type": "xml"}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
        ({"type": "json_schema"}, "response_format", "json_schema is given with type"),
        ({"type": "json_object", "json_schema": FORMAT["json_schema"]}, "response_format", ""),
        (
            {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
            "response_format.json_schema.name",
            "pattern",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}},
            "response_format.json_schema.schema",
            "/type: 'strin'",
        ),
    ],
)
def test_a_bad_response_format_is_refused_naming_the_field(
    response_format: dict[str, Any], param: str, fragment: str
) -> None:
    async def scenario(h: Harness) -> None:
        r = await h.submit(response_format=response_format)
        assert r.status_code == 422, r.text
        err = error(r)
        assert err["param"] == param and fragment in err["message"], err
        chat = await h.client.post(
            "/v1/chat/completions",
            json={
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": response_format,
            },
            headers=h.auth(),
        )
        assert chat.status_code == 422 and error(chat)["param"] == param
        assert published(h.queue) == [] and h.store.list_requests()[0] == []

    run_api(scenario)


def test_a_response_format_reaches_the_queue_and_the_store_and_text_is_the_default() -> None:
    async def scenario(h: Harness) -> None:
        r = await h.submit(response_format=FORMAT, temperature=0.0)
        assert r.status_code == 202, r.text
        plain = await h.submit(response_format={"type": "text"})
        assert plain.status_code == 202, plain.text
        sent = {m.id: m for m in published(h.queue)}
        assert sent[r.json()["id"]].sampling == {"temperature": 0.0, "response_format": FORMAT}
        assert sent[plain.json()["id"]].sampling == {}
        row = h.store.get(r.json()["id"])
        assert row is not None and row.sampling["response_format"] == FORMAT

    run_api(scenario)


def test_a_queue_message_carries_a_format_object_and_nothing_else_as_an_object() -> None:
    msg = QueuedRequest(
        id="r1",
        model="m",
        prompt_tokens=3,
        max_tokens=10,
        slo_e2e_s=60.0,
        submitted_at=1.0,
        sampling={"response_format": FORMAT},
    )
    assert QueuedRequest.decode(msg.encode()).sampling == {"response_format": FORMAT}
    body = json.loads(msg.encode())
    body["sampling"] = {"seed": {"a": 1}}
    with pytest.raises(MessageError, match=r"sampling\.seed"):
        QueuedRequest.decode(json.dumps(body).encode())
    body["sampling"] = {"response_format": "json"}
    with pytest.raises(MessageError, match=r"sampling\.response_format"):
        QueuedRequest.decode(json.dumps(body).encode())


# --- the simulated engine and the agents ------------------------------------------------------


def test_the_simulated_engine_answers_a_document_complete_within_max_tokens_or_cut() -> None:
    async def scenario() -> None:
        e = engine("i0")
        sampling = (("response_format", FORMAT),)
        try:
            whole = await e.submit(EngineRequest("a", "m", 10, 100, sampling=sampling))
            assert whole.finish_reason == "stop" and whole.tokens == 99
            assert json.loads(whole.text)["age"] == 18
            cut = await e.submit(EngineRequest("b", "m", 10, 8, sampling=sampling))
            assert cut.finish_reason == "length" and cut.tokens == 8
            assert cut.text == "".join(document_pieces(FORMAT, 1)[:8])
            with pytest.raises(json.JSONDecodeError):
                json.loads(cut.text)
            remote = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "x"}}}
            with pytest.raises(EngineError, match=r"\$ref 'x'"):
                e.start_request(
                    EngineRequest("c", "m", 10, 8, sampling=(("response_format", remote),))
                )
        finally:
            await e.close()

    run(scenario)


def test_an_evicted_structured_answer_starts_over_instead_of_being_continued() -> None:
    async def scenario() -> None:
        rec = Recorder()
        e = Seen(engine("i0"))
        rt = start(EvictOnce("r0000"), [e], rec)
        await rt.start()
        messages = [{"role": "user", "content": "Who is it?"}]
        job = Job(prompt="...", messages=messages, sampling={"response_format": FORMAT})
        rt.submit(make_request(0, arrival_s=rt.clock.now(), replay_output_tokens=300), job)
        await eventually(lambda: rt.idle, "the evicted answer finished")
        await rt.stop()
        await e.inner.close()
        first, again = e.requests
        assert rec.back == [("r0000", 0)]  # back with no output kept
        assert again.messages == tuple(messages) and not again.continue_final_message
        assert (again.max_tokens, again.output_tokens) == (first.max_tokens, first.output_tokens)
        assert (again.prompt_tokens, again.resumed_tokens) == (first.prompt_tokens, 0)
        record, text = rec.done["r0000"]
        assert json.loads(text)["age"] == 18  # one document, not a piece and a whole
        assert len("".join(rec.streamed)) > len(text)  # the first try had generated some
        assert record.evictions == 1 and record.output_tokens == 300

    run(scenario)


# --- streams that see the answer start over ---------------------------------------------------


async def _stream_until_watched(h: Harness, controller: FakeController, path: str) -> Any:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Who?"}]}
    body |= {"response_format": FORMAT, "slo_seconds": 3600}
    if path == "/v1/chat/completions":
        post = h.client.post(path, json=body | {"stream": True}, headers=h.auth())
    else:
        post = h.client.post(path, json=body | {"max_tokens": 50}, headers=h.auth())
    task = asyncio.create_task(post)
    while not (rows := h.store.list_requests()[0]):
        await asyncio.sleep(0.01)
    return task, rows[0].id


def test_a_chat_stream_that_showed_part_of_a_restarted_answer_ends_in_an_error_at_once() -> None:
    controller = FakeController(busy_snapshot(1000.0))

    async def scenario(h: Harness) -> None:
        post, rid = await _stream_until_watched(h, controller, "/v1/chat/completions")
        while not controller.hub.watched(rid):
            await asyncio.sleep(0.01)
        controller.hub.publish(ResultEvent(rid, '{"name": "', 2))
        controller.hub.publish(ResultEvent(rid, "", 0, restarted=True))
        r = await post  # no final event was published: the restart alone ended the stream
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "stream_restarted" and "generated again" in err["message"]
        row = h.store.get(rid)
        assert row is not None and row.status is RequestStatus.QUEUED  # not cancelled

    run_api(scenario, controller=controller, clock=lambda: 1000.0)


def test_a_chat_stream_restarted_before_any_text_streams_the_whole_answer() -> None:
    controller = FakeController(busy_snapshot(1000.0))

    async def scenario(h: Harness) -> None:
        post, rid = await _stream_until_watched(h, controller, "/v1/chat/completions")
        while not controller.hub.watched(rid):
            await asyncio.sleep(0.01)
        answer = '{"name": "Ada"}'
        controller.hub.publish(ResultEvent(rid, "", 0, restarted=True))
        controller.hub.publish(ResultEvent(rid, answer, 5))
        h.store.record_outcome(
            rid, status=RequestStatus.FINISHED, at=1000.0, output_text=answer, output_tokens=5
        )
        controller.hub.publish(ResultEvent(rid, "", 0, done=True, status=RequestStatus.FINISHED))
        r = await post
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:7] == "{"]
        assert not any("error" in e for e in events)
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        assert json.loads(text) == {"name": "Ada"}

    run_api(scenario, controller=controller, clock=lambda: 1000.0)


def test_the_native_event_stream_tells_its_client_to_drop_the_text_so_far() -> None:
    controller = FakeController(busy_snapshot(1000.0))

    async def scenario(h: Harness) -> None:
        _, rid = await _stream_until_watched(h, controller, "/v1/requests")
        events = asyncio.create_task(h.client.get(f"/v1/requests/{rid}/events", headers=h.auth()))
        while not controller.hub.watched(rid):
            await asyncio.sleep(0.01)
        controller.hub.publish(ResultEvent(rid, '{"na', 2))
        controller.hub.publish(ResultEvent(rid, "", 0, restarted=True))
        h.store.record_outcome(
            rid, status=RequestStatus.FINISHED, at=1000.0, output_text="{}", output_tokens=1
        )
        controller.hub.publish(ResultEvent(rid, "", 0, done=True, status=RequestStatus.FINISHED))
        r = await events
        names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        # The answer after the restart was not streamed: it comes from the store before done.
        assert names == ["token", "restart", "token", "done"]
        assert 'event: token\ndata: {"text":"{}","tokens":1}' in r.text

    run_api(scenario, controller=controller, clock=lambda: 1000.0)


@pytest.mark.parametrize("name", ["structured_outputs", "guided_json", "guided_choice"])
def test_vllms_own_constraints_are_refused_not_dropped(name: str) -> None:
    async def scenario(h: Harness) -> None:
        r = await h.client.post(
            "/v1/completions",
            json={"model": "m", "prompt": "x", name: {"json": {"type": "object"}}},
            headers=h.auth(),
        )
        assert r.status_code == 422 and error(r)["param"] == name
        assert "response_format" in error(r)["message"]
        assert published(h.queue) == []

    run_api(scenario)


def test_a_queued_structured_request_reaches_the_planner_as_not_resumable() -> None:
    fields: dict[str, Any] = {"id": "r", "model": "m", "prompt_tokens": 3, "max_tokens": 9}
    fields |= {"slo_e2e_s": 60.0, "submitted_at": 1.0}
    assert QueuedRequest(**fields).to_request(1.0).resumable
    structured = QueuedRequest(**fields, sampling={"response_format": FORMAT})
    assert not structured.to_request(1.0).resumable


def test_recursive_and_awkward_schemas_have_finite_documents_or_are_the_requests_fault() -> None:
    tree = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["name"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}
    doc = json.loads("".join(document_pieces(fmt, 1)))
    depth = 0
    while doc.get("children"):
        doc, depth = doc["children"][0], depth + 1
    assert 1 <= depth <= 4  # optional parts written while shallow, then only what is required
    for bad, why in (
        ({"type": "array", "minItems": 10**6}, "more than the 1000"),
        ({"type": "array", "minItems": "x"}, "non-negative integer"),
    ):
        spec = {"type": "json_schema", "json_schema": {"name": "b", "schema": bad}}
        with pytest.raises(SchemaUnsupported, match=why):
            document_pieces(spec, 5)
    assert (schema_problem({"type": "array", "minItems": "x"}) or "").startswith("/minItems")

    async def scenario() -> None:
        e = engine("i0")
        huge = {
            "type": "json_schema",
            "json_schema": {"name": "h", "schema": {"type": "array", "minItems": 10**6}},
        }
        try:
            with pytest.raises(RequestRejected, match="response_format"):  # not the instance's
                e.start_request(
                    EngineRequest("a", "m", 10, 50, sampling=(("response_format", huge),))
                )
            assert await e.health()
        finally:
            await e.close()

    run(scenario)
