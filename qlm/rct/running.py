"""The sums over an instance's running requests that the RCT estimator's queue estimates
start from (tokens, expected rest, prompt work, output tokens), kept per instance so that the
same running requests are summed again without walking them: only the beliefs that moved are
priced again and only the requests whose noting was undone are noted again.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from qlm.domain import Request
from qlm.rct.beliefs import Misses, OutputBeliefs
from qlm.rct.inputs import EstimatorInstance, Queued
from qlm.rct.output_model import LengthHistogram, pair_moments
from qlm.rct.tuning import PROMPT_BIN_WIDTH


@dataclass(slots=True)
class RunningState:
    """An instance's running requests as ``RunningSums.sums`` last summed them: per
    request its prompt, tokens generated, prompt work per token and expected rest, and the
    distinct (belief, cap, generated) it is priced under, so that the same requests are summed
    again without walking them: only the beliefs that moved are priced again (every pair of a
    belief at once) and only the requests whose noting was undone are noted again."""

    items: Sequence[Queued]
    signature: tuple[Any, ...]
    position: dict[str, int]  # request id -> place in ``items``
    noted: int  # the inflight log's length (all there were) once they were noted
    inputs: npt.NDArray[np.float64]
    generated: npt.NDArray[np.float64]
    prompt_work: npt.NDArray[np.float64]  # prompt tokens × work per token
    beliefs: list[tuple[str, str, int]]  # (model, class, prompt bin) ...
    belief_request: list[Request]  # ... a request of each ...
    versions: tuple[int, ...]  # ... and the version its pairs were priced at
    pair_of: npt.NDArray[np.int64]  # per request, its pair
    pair_belief: npt.NDArray[np.int64]
    pair_cap: npt.NDArray[np.float64]
    pair_gen: npt.NDArray[np.float64]
    pair_mean: npt.NDArray[np.float64]


@dataclass
class RunningSums:
    """Per instance, its running requests as ``sums`` last summed them under ``beliefs``."""

    beliefs: OutputBeliefs
    _states: dict[str, RunningState] = field(default_factory=dict, init=False)

    def sums(
        self, instance: EstimatorInstance, running: Sequence[Queued]
    ) -> tuple[float, float, float, float]:
        """Over the running requests of ``instance``, added in their order: tokens (prompt,
        generated and expected rest), the expected rest alone, prompt work and output tokens
        (generated and expected rest). Notes each running request and what it generated (the
        censored outputs ``observe`` counts), as ``OutputBeliefs.prefetch`` does. The same requests
        as the last time (the same ``Queued`` objects, in order) are summed from what was kept
        of them (``RunningState``): the same numbers."""
        if not running:
            return 0.0, 0.0, 0.0, 0.0
        self.beliefs.censor_all()
        state = self._kept(instance, running)
        if state is None or not self._kept_sums(state):
            state = self._states[instance.name] = self._walk(
                instance, running, self._signature(instance)
            )
        mean = state.pair_mean[state.pair_of]
        g = state.generated
        # (running totals, as a loop adds them one request at a time)
        return (
            float(np.cumsum(state.inputs + g + mean)[-1]),
            float(np.cumsum(mean)[-1]),
            float(np.cumsum(state.prompt_work)[-1]),
            float(np.cumsum(g + mean)[-1]),
        )

    def _signature(self, instance: EstimatorInstance) -> tuple[Any, ...]:
        return (id(self.beliefs.profile), self.beliefs.by_prompt, instance.gpu, instance.gpu_count)

    def _kept(self, instance: EstimatorInstance, running: Sequence[Queued]) -> RunningState | None:
        """What is kept of ``instance``'s running requests if they are the same as then."""
        state = self._states.get(instance.name)
        if (
            state is None
            or state.signature != self._signature(instance)
            or len(state.items) != len(running)
            or not all(map(operator.is_, state.items, running))
        ):
            return None
        return state

    def reprice_kept(
        self, queues: Sequence[tuple[EstimatorInstance, Any, Sequence[Queued]]]
    ) -> None:
        """Before ``RCTEstimator.estimate_queues`` sums each queue's running requests: the pairs of every
        belief that moved, over every queue whose running requests are kept, priced in one
        ``pair_moments`` call per belief (not one per queue). Without ``by_prompt`` only: the
        class-wide belief a version prices is the same whichever queue reads it first (with it,
        a prompt bin's is built when first read, from the running requests noted by then)."""
        if self.beliefs.by_prompt or not any(running for _, _, running in queues):
            return
        self.beliefs.censor_all()  # (as the first queue with running requests would)
        stale: dict[tuple[str, str, int, int], list[tuple[RunningState, int]]] = {}
        for instance, _, running in queues:
            state = self._kept(instance, running) if running else None
            if state is None:
                continue
            self._renote(state)
            for b, (m, c, ib) in enumerate(state.beliefs):
                version = self.beliefs.versions.get((m, c), 0)
                if version != state.versions[b]:
                    stale.setdefault((m, c, ib, version), []).append((state, b))
        for (_, _, _, version), users in stale.items():
            first, b0 = users[0]
            post = self.beliefs.posterior(first.belief_request[b0])
            if not isinstance(post, LengthHistogram):
                continue  # (left as it was: ``_kept_sums`` walks those requests)
            ats = [np.flatnonzero(state.pair_belief == b) for state, b in users]
            means, _ = pair_moments(
                post.outputs,
                np.concatenate(
                    [state.pair_cap[at] for (state, _), at in zip(users, ats, strict=True)]
                ),
                np.concatenate(
                    [state.pair_gen[at] for (state, _), at in zip(users, ats, strict=True)]
                ),
            )
            start = 0
            for (state, b), at in zip(users, ats, strict=True):
                state.pair_mean[at] = means[start : start + len(at)]
                start += len(at)
                state.versions = (*state.versions[:b], version, *state.versions[b + 1 :])

    def _renote(self, state: RunningState) -> None:
        """Note again the requests of ``state`` whose entry in ``inflight`` changed since."""
        log, start = self.beliefs.inflight_log, self.beliefs.inflight_log_start
        changed = (
            range(len(state.items))
            if state.noted < start
            else [state.position[r] for r in log[state.noted - start :] if r in state.position]
        )
        for k in changed:
            item = state.items[k]
            if item.running:
                self.beliefs.note_running(
                    item.request, self.beliefs.bin_of(item.request), item.generated
                )
        state.noted = self.beliefs.inflight_log_start + len(self.beliefs.inflight_log)

    def _kept_sums(self, state: RunningState) -> bool:
        """Bring what ``state`` keeps up to date: note again the requests whose entry in
        ``inflight`` changed since, price again the pairs of the beliefs that moved. False if a
        belief is not shape-free (walk the requests instead)."""
        self._renote(state)
        versions = tuple(self.beliefs.versions.get((m, c), 0) for m, c, _ in state.beliefs)
        if versions == state.versions:
            return True
        for b, version in enumerate(versions):
            if version == state.versions[b]:
                continue
            post = self.beliefs.posterior(state.belief_request[b])
            if not isinstance(post, LengthHistogram):
                return False
            at = np.flatnonzero(state.pair_belief == b)
            means, _ = pair_moments(post.outputs, state.pair_cap[at], state.pair_gen[at])
            state.pair_mean[at] = means
        state.versions = versions
        return True

    def _walk(
        self, instance: EstimatorInstance, running: Sequence[Queued], signature: tuple[Any, ...]
    ) -> RunningState:
        """``RunningState`` of ``running``, walking every request: notes the running ones and
        looks their moments up, the misses priced per belief at once."""
        moments, inflight, by_prompt = (
            self.beliefs.moments,
            self.beliefs.inflight,
            self.beliefs.by_prompt,
        )
        if len(moments) > 100_000:
            moments.clear()
        inputs: list[int] = []
        generated: list[int] = []
        prompt_work: list[float] = []
        position: dict[str, int] = {}
        classes: dict[tuple[str, str], tuple[int, float]] = {}  # version, prompt work per token
        belief_of: dict[tuple[str, str, int], int] = {}
        belief_request: list[Request] = []
        pair_index: dict[tuple[int, int, int], int] = {}
        pair_of: list[int] = []
        pairs: list[tuple[int, int, int]] = []  # belief, cap, generated
        pair_request: list[Request] = []  # a request of each pair
        misses: Misses = {}
        for k, item in enumerate(running):
            req = item.request
            model, cls, gen = req.model, req.slo_class, item.generated
            known = classes.get((model, cls))
            if known is None:
                hw = self.beliefs.profile.hardware_for(model, instance.gpu, instance.gpu_count)
                known = classes[(model, cls)] = (
                    self.beliefs.versions.get((model, cls), 0),
                    hw.input_token_work_s,
                )
            # prompt_bin, inlined (one bin for all without by_prompt)
            ib = int(math.log1p(req.input_tokens) / PROMPT_BIN_WIDTH) if by_prompt else 0
            if item.running:  # (_note_running, inlined)
                seen = inflight.get((model, cls, ib))
                if seen is None:
                    seen = inflight[(model, cls, ib)] = {}
                if seen.get(req.id) != gen:
                    seen[req.id] = gen
                    self.beliefs.logged(req.id)
            b = belief_of.get((model, cls, ib))
            if b is None:
                b = belief_of[(model, cls, ib)] = len(belief_request)
                belief_request.append(req)
            pair = (b, req.max_tokens, gen)
            p = pair_index.get(pair)
            if p is None:
                p = pair_index[pair] = len(pairs)
                pairs.append(pair)
                pair_request.append(req)
                if (model, cls, ib, known[0], req.max_tokens, gen) not in moments:
                    misses.setdefault((model, cls, ib, known[0]), {})[(req.max_tokens, gen)] = req
            pair_of.append(p)
            position[req.id] = k
            inputs.append(req.input_tokens)
            generated.append(gen)
            prompt_work.append(req.input_tokens * known[1])
        if misses:
            self.beliefs.price(misses)
        beliefs = list(belief_of)
        versions = tuple(self.beliefs.versions.get((m, c), 0) for m, c, _ in beliefs)
        pair_mean = np.empty(len(pairs))
        for p, (b, cap, gen) in enumerate(pairs):
            m, c, ib = beliefs[b]
            hit = moments.get((m, c, ib, versions[b], cap, gen))
            pair_mean[p] = (
                hit[0] if hit is not None else self.beliefs.output_moments(pair_request[p], gen)[0]
            )
        table = np.array(pairs, np.int64).reshape(-1, 3)
        return RunningState(
            items=tuple(running),
            signature=signature,
            position=position,
            noted=self.beliefs.inflight_log_start + len(self.beliefs.inflight_log),
            inputs=np.array(inputs, np.float64),
            generated=np.array(generated, np.float64),
            prompt_work=np.array(prompt_work),
            beliefs=beliefs,
            belief_request=belief_request,
            versions=versions,
            pair_of=np.array(pair_of, np.int64),
            pair_belief=table[:, 0],
            pair_cap=table[:, 1].astype(np.float64),
            pair_gen=table[:, 2].astype(np.float64),
            pair_mean=pair_mean,
        )
