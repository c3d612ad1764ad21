"""What the API knows of prompts without a tokenizer: a token estimate and the chat template.

**Tokens.** No tokenizer ships with QLM (they are per model and need downloads), yet the planner
needs each prompt's length. ``estimate_tokens`` uses the common rule of about four characters of
English text per token (OpenAI's published rule of thumb), rounded up, at least one. It is an
estimate for planning, not billing: code and non-Latin scripts run denser. The controller learns
per model how many tokens vLLM counts per estimated token (``Controller.prompt_scale``) and plans
later arrivals with the scaled estimate; the API's answers keep this one.

**Chat.** The messages themselves are kept as sent, in the store and the queue message, and reach
vLLM as ``messages`` on ``/v1/chat/completions``, which applies the model's own chat template.
QLM renders them once more with the ChatML layout (one block per message, then the assistant's
turn opened) only to estimate their tokens, and as the prompt of an engine without a chat API::

    <|im_start|>system
    You are terse.<|im_end|>
    <|im_start|>user
    Hi<|im_end|>
    <|im_start|>assistant
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

CHARS_PER_TOKEN = 4


def estimate_tokens(text: str) -> int:
    """About how many tokens ``text`` is: ``ceil(len / 4)``, at least 1."""
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN or 1  # ceil(len / 4), exactly


def message_text(content: Any) -> str:
    """The text of a message's ``content``: a string, or OpenAI's list of ``{"type": "text"}``
    parts joined (other parts carry no text)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "text":
            texts.append(str(part.get("text", "")))
    return "".join(texts)


def _calls_text(calls: Any) -> str:
    """An assistant turn's tool calls as the template would spell them, near enough: each
    call's name and arguments (JSON) on a line."""
    if not isinstance(calls, list):
        return ""
    lines = []
    for call in calls:
        fn = call.get("function", {}) if isinstance(call, Mapping) else {}
        lines.append(f"\n{fn.get('name', '')}({fn.get('arguments', '')})")
    return "".join(lines)


def render_chat(messages: Iterable[Mapping[str, Any]]) -> str:
    """A chat as one ChatML prompt, for estimates (module docstring)."""
    blocks = [
        f"<|im_start|>{message.get('role', 'user')}\n{message_text(message.get('content'))}"
        f"{_calls_text(message.get('tool_calls'))}<|im_end|>\n"
        for message in messages
    ]
    return "".join(blocks) + "<|im_start|>assistant\n"
