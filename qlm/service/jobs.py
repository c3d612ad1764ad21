"""A request as the engines run it (``Job``): its prompt or chat, sampling parameters and the
output so far, and how that output resumes on an engine after an eviction or a failed instance
(``Job.fill``, ``resume_point``). ``qlm.service.runtime`` sends it; the controller service
makes it from the global queue's message."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from qlm.engines.base import EngineRequest, continued_from_ids
from qlm.structured import resumable


def resume_point(partial: str) -> str:
    """Where a request's output resumes from: its partial output without trailing whitespace.

    A chat resumes with its partial answer as the assistant message to continue, and chat
    templates that trim messages (Llama 3's) drop that whitespace, so the model writes it
    again: "Hello " + " world". A prompt that ends in whitespace also tokenizes unlike any
    text the model wrote (its tokens carry the space before a word). So the whitespace is
    dropped before resuming, and the stream never showed it: the agents pass trailing
    whitespace on only once more text follows. Its tokens stay counted as generated (at most a
    few more than the text holds: ``max_tokens`` is never exceeded)."""
    return partial.rstrip()


@dataclass(slots=True)
class Job:
    """What an engine needs to run a request besides what the controller plans with: the prompt
    text (``None``: filler tokens, for replays), a chat's messages (``prompt`` is then their
    rendering), sampling parameters, and the output so far."""

    prompt: str | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    partial_text: str = ""
    messages: Sequence[Mapping[str, Any]] | None = None
    stream_failures: int = 0  # its streams an instance that still answered failed
    prompt_ids: tuple[int, ...] | None = None
    """The prompt's token ids as the engine made them on the first run (a chat's with its
    template applied), when the engine says them: with ``partial_ids`` the exact context to
    resume from."""
    partial_ids: tuple[int, ...] = ()
    """The token ids of ``partial_text``, when every one of them is known."""
    held: str = ""
    """Trailing whitespace of ``partial_text`` the stream has not shown yet (a resume by token
    ids keeps it, and shows it before the text that follows)."""

    @property
    def has_text(self) -> bool:
        """A prompt or messages the API estimated the tokens of (a replay's filler is exact)."""
        return self.prompt is not None or self.messages is not None

    @property
    def resumable(self) -> bool:
        """Whether output so far can be continued: not under a response format (a grammar
        starts at the answer's first token) nor with tools offered (a call half written is no
        text to go on from): ``qlm.structured.resumable``."""
        return resumable(self.sampling)

    @property
    def exact(self) -> bool:
        """Whether output so far resumes from its token ids (``fill``)."""
        return self.prompt_ids is not None and bool(self.partial_ids)

    def fill(self, request: EngineRequest) -> EngineRequest:
        """``request`` with this job's input. Output so far is resumed, not restarted. Where the
        engine said the tokens of the prompt and of the output so far (``exact``), the request
        goes on from exactly those tokens: a chat too, as a completion of its templated prompt
        (the server applied the template on the first run). Otherwise the output so far
        follows the prompt as text, and a chat gets it as the assistant's message to continue
        (text that re-tokenizes differently, or tokens that decoded to nothing, then make the
        context differ a little). (A job that is not ``resumable`` never keeps output:
        ``AgentRuntime._give_back`` drops it.)"""
        if self.exact:
            assert self.prompt_ids is not None
            filled = replace(request, sampling=tuple(self.sampling.items()))
            return continued_from_ids(filled, self.prompt_ids + self.partial_ids)
        prompt = None if self.prompt is None else self.prompt + self.partial_text
        messages: tuple[Mapping[str, Any], ...] | None = None
        resume = False
        if self.messages is not None:
            messages = tuple(self.messages)
            if self.partial_text:
                messages += ({"role": "assistant", "content": self.partial_text},)
                resume = True
        return replace(
            request,
            prompt=prompt,
            messages=messages,
            continue_final_message=resume,
            sampling=tuple(self.sampling.items()),
        )
