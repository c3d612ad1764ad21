"""What ``vllm serve``'s HTTP API answers, and how ``VllmEngine`` (``qlm.engines.vllm``) reads it:
the endpoint of a request, the server-sent events of a stream and the parts of each event (text,
token ids, tool-call deltas, finish reason), vLLM's refusals (the context's room, error bodies),
its request ids, and the ``/metrics`` families (KV capacity, CPU offloading, per-model values)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import httpx

from qlm.engines.base import EngineRequest, FinishReason

FINISH: dict[str, FinishReason] = {
    "length": "length",
    "stop": "stop",
    "abort": "abort",
    "tool_calls": "tool_calls",
}


COMPLETIONS = "/v1/completions"


CHAT = "/v1/chat/completions"


def endpoint_path(request: EngineRequest) -> str:
    """The endpoint of a request: a chat's messages go to the chat endpoint, so that vLLM
    applies the model's chat template; a prompt (or a replay's filler) to completions."""
    return COMPLETIONS if request.messages is None else CHAT


def choice_text(choice: Any) -> str:
    """The text of one choice of either endpoint: ``text`` (completions), ``delta.content`` (a
    chat stream chunk) or ``message.content`` (a chat answer). A chat's other parts (the first
    chunk's ``role``, a reasoning parser's ``reasoning``) are not the answer's text."""
    if not isinstance(choice, dict):
        return ""
    if "text" in choice:
        return str(choice["text"] or "")
    part = choice.get("delta") or choice.get("message") or {}
    return str(part.get("content") or "") if isinstance(part, dict) else ""


def choice_calls(choice: Any) -> list[dict[str, Any]]:
    """The tool-call deltas of a chat stream chunk's choice (``delta.tool_calls``)."""
    delta = choice.get("delta") if isinstance(choice, dict) else None
    calls = delta.get("tool_calls") if isinstance(delta, dict) else None
    return [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


_CONTEXT = re.compile(r"maximum context length is (\d+) tokens")


_INPUT = re.compile(
    r"has (\d+) input tokens|\((\d+) in the (?:messages|prompt)"
    r"|contains (?:at least )?(\d+) input tokens"
)


def context_room(message: str) -> int | None:
    """The output tokens the context has room for, from vLLM's refusal of a prompt plus
    ``max_tokens`` longer than ``max_model_len`` (0.14: "... maximum context length is N tokens
    and your request has P input tokens ..."; before: "... N tokens. However, you requested M
    tokens (P in the messages, K in the completion)"), or of a prompt that leaves no room at
    all (0.32: "... N tokens. However, your prompt contains [at least] P input tokens, which
    exceeds this limit even without any output tokens ..."; 0.32 clamps ``max_tokens`` to the
    room instead of refusing it), or None if it is not such a refusal."""
    limit, given = _CONTEXT.search(message), _INPUT.search(message)
    if limit is None or given is None:
        return None
    return int(limit.group(1)) - int(next(g for g in given.groups() if g is not None))


def engine_request_id(request: EngineRequest, wire_id: str) -> str:
    """vLLM's own id of a request sent with ``X-Request-Id: wire_id``, which
    ``/abort_requests`` wants: ``cmpl-<id>-0`` (a completion; ``-<n>`` numbers its prompts) or
    ``chatcmpl-<id>`` (a chat)."""
    return f"cmpl-{wire_id}-0" if request.messages is None else f"chatcmpl-{wire_id}"


async def sse_data(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The ``data:`` fields of a server-sent event stream, as bytes, up to ``[DONE]``. Lines
    are split here, in bytes (a newline byte never occurs inside a UTF-8 character), rather
    than through httpx's text and line decoders: a stream has one event per token, and their
    layers were most of what reading it cost."""
    rest = b""
    async for piece in resp.aiter_bytes():
        lines = (rest + piece).split(b"\n") if rest else piece.split(b"\n")
        rest = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield data
    if rest.startswith(b"data:"):  # (a last line without its newline)
        data = rest[5:].strip()
        if data != b"[DONE]":
            yield data


EventParts = tuple[
    str, tuple[int, ...] | None, tuple[int, ...] | None, list[dict[str, Any]], object
]
"""What ``VllmEngine._take`` reads of an SSE event: its text, its new tokens' ids, the prompt's
ids, its tool-call deltas and its finish reason (None without one)."""


def event_parts(event: dict[str, Any], choices: list[Any]) -> EventParts:
    """``EventParts`` of any event of either endpoint, its choices (``choices``) in order."""
    text = "".join(choice_text(c) for c in choices)
    ids = ids_of(c.get("token_ids") for c in choices)
    prompt_ids = ids_of(
        [event.get("prompt_token_ids"), *(c.get("prompt_token_ids") for c in choices)]
    )
    calls = [d for c in choices for d in choice_calls(c)]
    raw = next((c.get("finish_reason") for c in choices if c.get("finish_reason")), None)
    return text, ids, prompt_ids, calls, raw


def one_token(event: dict[str, Any], choices: object) -> EventParts | None:
    """``EventParts`` of the event most of a completion's stream is made of — one choice with
    its text and token ids, no prompt ids, no tool calls — read without ``event_parts``'s
    general walk (the same parts); None for any other event."""
    if type(choices) is not list or len(choices) != 1 or event.get("prompt_token_ids") is not None:
        return None
    choice = choices[0]
    if (
        type(choice) is not dict
        or "text" not in choice
        or "delta" in choice
        or choice.get("prompt_token_ids") is not None
    ):
        return None
    ids = choice.get("token_ids")
    if ids is not None and type(ids) is not list:
        return None
    text = str(choice["text"] or "")
    new = None if ids is None else tuple([int(t) for t in ids])
    return text, new, None, [], choice.get("finish_reason") or None


def ids_of(lists: Iterable[object]) -> tuple[int, ...] | None:
    """The token ids of the lists given, in order (None for a chunk that carries none)."""
    out: list[int] = []
    seen = False
    for ids in lists:
        if isinstance(ids, list):
            seen = True
            out.extend(int(t) for t in ids)
    return tuple(out) if seen else None


def dig(data: Any, *keys: str) -> Any:
    """``data[k1][k2]...``, or None where a level is missing or not a mapping."""
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def metric_values(
    families: dict[str, list[tuple[dict[str, str], float]]], name: str, models: Sequence[str]
) -> list[float]:
    """Sample values of ``name`` for our models (all engines of a data-parallel server). vLLM
    labels them with the first of its served model names only: when none carries one of
    ``models`` (the instance is known by another of its names), all of them are the server's."""
    samples = families.get(name, [])
    ours = [v for labels, v in samples if labels.get("model_name", models[0]) in models]
    return ours or [v for _, v in samples]


def cache_capacity_tokens(families: dict[str, list[tuple[dict[str, str], float]]]) -> int | None:
    """KV capacity from ``vllm:cache_config_info`` (num_gpu_blocks x block_size), if known. With
    data parallelism every engine's sample carries the blocks of all of them (vLLM sums them at
    startup, ``wait_for_engine_startup``): one sample, not their sum."""
    best = 0
    for labels, _ in families.get("vllm:cache_config_info", []):
        try:
            best = max(best, int(labels["num_gpu_blocks"]) * int(labels["block_size"]))
        except (KeyError, ValueError):
            return None
    return best or None


def offload_gb(families: dict[str, list[tuple[dict[str, str], float]]]) -> float | None:
    """The CPU memory (GiB) of vLLM's KV offloading (``--kv-offloading-size``), from
    ``vllm:cache_config_info``, when it is on with prefix caching: where a parked request's KV
    cache waits (``VllmEngine.swap_out``). None without it: a parked request's blocks would stay
    only as long as the GPU cache does not need them — for the room a preemption makes, not
    long — so the planner is not offered KV swap there."""
    for labels, _ in families.get("vllm:cache_config_info", []):
        if labels.get("enable_prefix_caching") != "True":
            return None
        try:
            size = float(labels.get("kv_offloading_size", "None"))
        except ValueError:
            return None
        return size if size > 0 else None
    return None


def error_text(body: object) -> str:
    """The message of a vLLM error body, ``{"error": {"message", ...}}`` or ``{"message"}``."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
    return str(body)[:300]


def error_message(resp: httpx.Response) -> str:
    """The error message of a vLLM error body (either of its JSON shapes), else the raw text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300] or resp.reason_phrase
    if isinstance(body, dict) and "detail" in body and "error" not in body:
        return str(body["detail"])
    return error_text(body)
