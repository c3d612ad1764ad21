"""The official ``openai`` Python client, unchanged, against QLM's OpenAI-compatible endpoints
served by uvicorn on a free port, with a controller service and simulated instances in process:
it completes, streams, lists models, answers structured output (``response_format``) and tool calls, and its
SLO fields (extra body fields and headers) reach the store."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import openai
import pydantic
import pytest

from qlm.api import create_app
from qlm.api.server import ApiServer
from qlm.engines.wallclock import count_tokens
from qlm.global_queue import MemoryBroker, MemoryGlobalQueue
from qlm.settings import Settings
from qlm.store import Store
from tests.unit.service.test_controller_service import make_service


def test_the_openai_client_completes_streams_and_sends_slo_fields() -> None:
    async def main() -> None:
        store = Store.open("sqlite://")
        broker = MemoryBroker()
        service = make_service(store, broker, policy="edf")
        await service.start()
        key = store.create_api_key("acme")
        app = create_app(
            Settings(),
            queue=MemoryGlobalQueue(broker=broker),
            store=store,
            controller=service,
            clock=service.runtime.clock.now,
        )
        server = ApiServer(app, host="127.0.0.1", port=0, log_level="warning")
        await server.start()
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
        try:
            models = await client.models.list()
            assert [m.id for m in models.data] == ["m"]

            completion = await client.completions.create(
                model="m",
                prompt="The queue in front of the GPUs",
                max_tokens=7,
                temperature=0.0,
                extra_body={
                    "slo_seconds": 120,
                    "tier": "interactive",
                    "labels": {"app": "docs"},
                },
                extra_headers={"x-qlm-ttft-slo-seconds": "10"},
            )
            assert completion.object == "text_completion"
            assert count_tokens(completion.choices[0].text) == 7
            assert completion.choices[0].finish_reason == "length"
            assert completion.usage is not None and completion.usage.completion_tokens == 7
            row = store.get(completion.id.removeprefix("cmpl-"))
            assert row is not None and row.tenant == "acme"
            assert (row.slo_e2e_s, row.slo_ttft_s, row.tier.name) == (120, 10, "INTERACTIVE")
            assert dict(row.labels) == {"app": "docs"} and row.sampling == {"temperature": 0.0}
            # The outcome rides along: no second call to learn whether the SLOs were met.
            assert completion.model_extra is not None
            assert completion.model_extra["qlm"] == {
                "request_id": row.id,
                "deadline_at": row.deadline_at,
                "slo_met": True,
                "ttft_met": True,
                "queue_seconds": pytest.approx(
                    (row.dispatched_at or 0) - row.submitted_at, abs=1e-3
                ),
            }
            raw = await client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
            )
            assert raw.headers["x-qlm-slo-met"] == "true" and "x-qlm-ttft-met" not in raw.headers
            assert float(raw.headers["x-qlm-queue-seconds"]) >= 0
            answered_raw = raw.parse()
            assert answered_raw.model_extra is not None
            assert answered_raw.model_extra["qlm"]["request_id"] == raw.headers["x-qlm-request-id"]

            chat = await client.chat.completions.create(
                model="m",
                messages=[
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Say something."},
                ],
                max_tokens=5,
                extra_headers={"x-qlm-slo-seconds": "90", "x-llm-d-slo-ttft-ms": "2500"},
            )
            assert chat.choices[0].message.role == "assistant"
            assert count_tokens(chat.choices[0].message.content or "") == 5
            row = store.get(chat.id.removeprefix("chatcmpl-"))
            assert row is not None and (row.slo_e2e_s, row.slo_ttft_s) == (90, 2.5)
            assert row.messages is not None and row.messages[0]["content"] == "You are terse."

            stream = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "A long story, please."}],
                max_tokens=120,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"tier": "batch", "slo_seconds": 600},
            )
            pieces: list[str] = []
            reasons: list[str | None] = []
            usage = None
            outcomes = []
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                outcomes.append((chunk.model_extra or {}).get("qlm"))
                for choice in chunk.choices:
                    pieces.append(choice.delta.content or "")
                    reasons.append(choice.finish_reason)
            assert count_tokens("".join(pieces)) == 120
            assert sum(bool(p) for p in pieces) > 1  # streamed as generated, not in one piece
            assert reasons[-1] == "length" and usage is not None and usage.completion_tokens == 120
            *during, last = outcomes  # the last chunk (usage) carries the outcome
            assert not any(during) and last is not None and last["slo_met"] is True

            text_stream = await client.completions.create(
                model="m", prompt="Count", max_tokens=20, stream=True
            )
            text = "".join([c.choices[0].text async for c in text_stream if c.choices])
            assert count_tokens(text) == 20

            schema = {
                "type": "object",
                "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
                "required": ["title", "year"],
            }
            structured = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "A book, as JSON."}],
                max_tokens=30,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "book", "schema": schema, "strict": True},
                },
            )
            book = json.loads(structured.choices[0].message.content or "")
            assert set(book) == {"title", "year"} and isinstance(book["year"], int)
            assert structured.choices[0].finish_reason == "stop"
            row = store.get(structured.id.removeprefix("chatcmpl-"))
            assert row is not None and row.sampling["response_format"]["json_schema"]["strict"]

            class Author(pydantic.BaseModel):
                name: str
                born: int | None = None

            class Book(pydantic.BaseModel):
                title: str
                authors: list[Author]
                kind: Literal["novel", "essay"]

            parsed = await client.chat.completions.parse(  # the client's strict schema
                model="m", messages=[{"role": "user", "content": "A book."}], response_format=Book
            )
            book_out = parsed.choices[0].message.parsed
            assert isinstance(book_out, Book) and book_out.kind == "novel" and book_out.authors

            tools: list[Any] = [
                {
                    "type": "function",
                    "function": {
                        "name": "weather",
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                            "required": ["city"],
                        },
                    },
                }
            ]
            ask: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
            called = await client.chat.completions.create(
                model="m", messages=ask, tools=tools, max_tokens=30
            )
            assert called.choices[0].finish_reason == "tool_calls"
            message = called.choices[0].message
            assert message.content is None and message.tool_calls is not None
            (call,) = message.tool_calls
            assert call.function.name == "weather"
            assert set(json.loads(call.function.arguments)) == {"city"}
            streamed = await client.chat.completions.create(
                model="m", messages=ask, tools=tools, max_tokens=30, stream=True
            )
            deltas = [c.choices[0].delta async for c in streamed if c.choices]
            parts = [t for d in deltas for t in d.tool_calls or ()]
            assert [p.function.name for p in parts if p.function] == ["weather"]
            answered = [
                *ask,
                message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": -3}'},
            ]
            final = await client.chat.completions.create(
                model="m", messages=answered, tools=tools, max_tokens=5
            )
            assert final.choices[0].finish_reason == "length"
            assert count_tokens(final.choices[0].message.content or "") == 5

            with pytest.raises(openai.UnprocessableEntityError) as bad:
                await client.completions.create(
                    model="m", prompt="x", max_tokens=4, extra_headers={"x-qlm-tier": "vip"}
                )
            assert bad.value.body["param"] == "x-qlm-tier"  # type: ignore[index]
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="gpt-4o", prompt="x", max_tokens=4)
            with pytest.raises(openai.AuthenticationError):
                await openai.AsyncOpenAI(
                    base_url=f"{server.url}/v1", api_key="qlm_wrong", max_retries=0
                ).models.list()
        finally:
            await client.close()
            await server.stop()
            await service.stop()
            store.close()

    asyncio.run(main())
