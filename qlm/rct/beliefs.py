"""What the RCT estimator believes of output lengths (paper Eq. 3, made Bayesian), and the
moments of the output tokens a request still has to generate under those beliefs.

Per (model, SLO class) a belief: a ``LengthHistogram`` (a Dirichlet over bins of log length
whose prior is the workload profile's ``NIG``; ``shape_free=False`` keeps the location–scale
``NIG`` itself), updated with every completed output. Requests seen running count as
right-censored outputs (longer than what they generated so far) until they complete. With
``by_prompt`` each (model, SLO class) also keeps a belief per bin of prompt length, shrunk
toward the class-wide one (``POOL_STRENGTH`` outputs' worth). A belief's version moves with
each completion; the moments (mean, variance) of a (belief version, cap, tokens generated) are
cached, and the misses priced per belief at once.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from qlm.domain import Request
from qlm.rct.inputs import Queued
from qlm.rct.output_model import (
    HIST_BINS,
    LengthHistogram,
    OutputBelief,
    length_bin,
    pair_moments,
)
from qlm.rct.profile import RctProfile
from qlm.rct.tuning import POOL_STRENGTH, PROMPT_BIN_WIDTH

MomentsKey = tuple[str, str, int, int, int, int]
"""``output_moments``' cache key: model, SLO class, prompt bin, belief version, cap, generated."""

Misses = dict[tuple[str, str, int, int], dict[tuple[int, int], Request]]
"""Per belief (model, class, prompt bin, version), the (cap, generated) pairs missing from the
moments cache, with a request of each."""


def prompt_bin(input_tokens: int) -> int:
    """The prompt-length bin whose output belief a request of ``input_tokens`` uses."""
    return int(math.log1p(max(input_tokens, 0)) / PROMPT_BIN_WIDTH)


@dataclass
class OutputBeliefs:
    """Output-length beliefs per (model, SLO class[, prompt bin]), the requests seen running
    (censored outputs), and the cache of output moments under the beliefs."""

    profile: RctProfile
    shape_free: bool = True  # output lengths as a LengthHistogram (else the profile's NIG)
    by_prompt: bool = False  # output beliefs per prompt-length bin (shape-free only)
    _posteriors: dict[tuple[str, str], OutputBelief] = field(default_factory=dict, init=False)
    # The class-wide belief predictions use: the posterior plus running requests, censored.
    _effective: dict[tuple[str, str], OutputBelief] = field(default_factory=dict, init=False)
    # Per (model, SLO class, prompt bin): counts of observed outputs per length bin ...
    _bin_counts: dict[tuple[str, str, int], npt.NDArray[np.float64]] = field(
        default_factory=dict, init=False
    )
    # ... the belief built from them (with the class version it was built at) ...
    _conditional: dict[tuple[str, str, int], tuple[int, LengthHistogram]] = field(
        default_factory=dict, init=False
    )
    # ... and the requests seen running: id -> tokens generated when last seen.
    inflight: dict[tuple[str, str, int], dict[str, int]] = field(default_factory=dict, init=False)
    # The ids whose entry in ``inflight`` changed, in order (``inflight_log_start``: the
    # position of its first in all there were): a queue's running requests noted before need
    # noting again only where their entry changed since (``qlm.rct.running``).
    inflight_log: list[str] = field(default_factory=list, init=False)
    inflight_log_start: int = field(default=0, init=False)
    moments: dict[MomentsKey, tuple[float, float]] = field(default_factory=dict, init=False)
    # Per (model, SLO class), bumped by each completion: the moments cache is keyed by it.
    versions: dict[tuple[str, str], int] = field(default_factory=dict, init=False)
    # Classes completed since their censored belief was last built (``_censor``).
    _stale: set[tuple[str, str]] = field(default_factory=set, init=False)

    def posterior(self, request: Request) -> OutputBelief:
        """The output-length belief for ``request``: that of its (model, SLO class) and, with
        ``by_prompt``, of requests with prompts of about its length — completions observed, and
        requests seen running counted as censored outputs (refreshed at each completion)."""
        key = (request.model, request.slo_class)
        pooled = self._pooled(key, request.model)
        if not (self.by_prompt and isinstance(pooled, LengthHistogram)):
            return pooled
        ck = (*key, prompt_bin(request.input_tokens))
        version = self.versions.get(key, 0)
        hit = self._conditional.get(ck)
        if hit is not None and hit[0] == version:
            return hit[1]
        belief = pooled.conditioned(self._bin_counts.get(ck), POOL_STRENGTH)
        inflight = self.inflight.get(ck)
        if inflight:
            belief = belief.with_censored(np.fromiter(inflight.values(), np.float64))
        self._conditional[ck] = (version, belief)
        return belief

    def bin_of(self, request: Request) -> int:
        """The prompt bin a request's belief (and its cached moments) is kept under: one for
        all without ``by_prompt``, so that moments are shared and batched across prompts."""
        return prompt_bin(request.input_tokens) if self.by_prompt else 0

    def _censor(self, key: tuple[str, str]) -> None:
        """Rebuild the class-wide belief of ``key`` with its running requests counted as
        censored outputs — every prompt bin's, whether or not one of its requests completed
        yet — as they are now: since its last completion nothing else changed them."""
        self._stale.discard(key)
        post = self._posteriors[key]
        running = [
            np.fromiter(seen.values(), np.float64)
            for (model, slo_class, _), seen in self.inflight.items()
            if (model, slo_class) == key and seen
        ]
        if running and isinstance(post, LengthHistogram):
            self._effective[key] = post.with_censored(np.concatenate(running))
        else:
            self._effective.pop(key, None)

    def censor_all(self) -> None:
        """Before the running requests noted change: the beliefs still owed are built from
        them as they were at their completions."""
        for key in list(self._stale):
            self._censor(key)

    def _pooled(self, key: tuple[str, str], model: str) -> OutputBelief:
        if key in self._stale:
            self._censor(key)
        post = self._effective.get(key)
        if post is None:
            post = self._posteriors.get(key)
        if post is None:
            prior = self.profile.prior(model)
            post = LengthHistogram.from_prior(prior) if self.shape_free else prior
            self._posteriors[key] = post
        return post

    def output_moments(self, request: Request, generated: int = 0) -> tuple[float, float]:
        """Mean and variance of the output tokens ``request`` still has to generate."""
        key = self.moments_key(request, generated)
        hit = self.moments.get(key)
        if hit is None:
            if len(self.moments) > 100_000:
                self.moments.clear()
            post = self.posterior(request)
            hit = self.moments[key] = post.moments(cap=request.max_tokens, generated=generated)
        return hit

    def expected_rests(self, items: Sequence[tuple[Request, int]]) -> list[float]:
        """``output_moments(request, generated)[0]`` of each (request, generated): looked up in
        the cache, the misses priced per belief at once (``price``: the same numbers) — the
        running requests of every instance, whose tokens generated move between two plans."""
        moments = self.moments
        if len(moments) > 100_000:
            moments.clear()
        keys = [self.moments_key(r, g) for r, g in items]
        misses: Misses = {}
        for (r, g), key in zip(items, keys, strict=True):
            if key not in moments:
                misses.setdefault(key[:4], {})[(key[4], g)] = r
        if misses:
            self.price(misses)
        out: list[float] = []
        for (r, g), key in zip(items, keys, strict=True):
            hit = moments.get(key)
            out.append(hit[0] if hit is not None else self.output_moments(r, g)[0])
        return out

    def prefetch(self, items: Iterable[Queued]) -> None:
        """Fill the moments cache for many (request, generated) at once: after a completion
        changes a posterior, every running request misses the cache together. Also notes the
        running ones and what they generated (the censored outputs ``observe`` counts): every
        estimate passes through here with the instance's running requests."""
        self.censor_all()
        # per belief (model, class, prompt bin, version): the (cap, generated) pairs missing
        misses: Misses = {}
        moments, versions = self.moments, self.versions
        if len(moments) > 100_000:
            moments.clear()
        for item in items:
            req = item.request
            ib = self.bin_of(req)
            if item.running:
                self.note_running(req, ib, item.generated)
            belief = (req.model, req.slo_class, ib, versions.get((req.model, req.slo_class), 0))
            if (*belief, req.max_tokens, item.generated) not in moments:
                misses.setdefault(belief, {})[(req.max_tokens, item.generated)] = req
        self.price(misses)

    def price(self, misses: Misses) -> None:
        """Fill the moments cache for the (cap, generated) pairs of each belief (model, class,
        prompt bin, version) that missed it: all of a shape-free belief's at once; a NIG's in
        batches of one cap (the scalar path fills those with fewer than 8)."""
        moments = self.moments
        for belief, pairs in misses.items():
            post = self.posterior(next(iter(pairs.values())))
            if isinstance(post, LengthHistogram):  # every pair of the belief at once
                caps, gens = np.array(list(pairs), np.float64).reshape(-1, 2).T
                means, variances = pair_moments(post.outputs, caps, gens)
                for (cap, g), m, v in zip(pairs, means.tolist(), variances.tolist(), strict=True):
                    moments[(*belief, cap, g)] = (m, v)
                continue
            by_cap: dict[int, list[int]] = {}
            for cap, g in pairs:
                by_cap.setdefault(cap, []).append(g)
            for cap, gens_of in by_cap.items():
                if len(gens_of) < 8:
                    continue  # not worth a batch; the scalar path fills these
                uniq = sorted(set(gens_of))
                means, variances = post.moments_many(cap=cap, generated=np.asarray(uniq, float))
                for g, m, v in zip(uniq, means, variances, strict=True):
                    moments[(*belief, cap, g)] = (float(m), float(v))

    def note_running(self, req: Request, ib: int, generated: int) -> None:
        """Count ``req`` running with ``generated`` tokens (a censored output for its belief)."""
        seen = self.inflight.setdefault((req.model, req.slo_class, ib), {})
        if seen.get(req.id) != generated:
            seen[req.id] = generated
            self.logged(req.id)

    def logged(self, request_id: str) -> None:
        """Note that ``request_id``'s entry in ``inflight`` changed."""
        log = self.inflight_log
        if len(log) >= 100_000:  # (whoever noted before all of it notes again)
            self.inflight_log_start += len(log)
            log.clear()
        log.append(request_id)

    def moments_key(self, request: Request, generated: int = 0) -> MomentsKey:
        """``output_moments``' cache key."""
        return (
            request.model,
            request.slo_class,
            self.bin_of(request),
            self.versions.get((request.model, request.slo_class), 0),
            request.max_tokens,
            generated,
        )

    def observe(self, request: Request, output_tokens: int) -> None:
        """A request finished with ``output_tokens``: update its class's belief (and version)
        and stop counting it running."""
        key = (request.model, request.slo_class)
        ck = (*key, self.bin_of(request))
        if key not in self._posteriors:  # the prior, on the first observation
            self._pooled(key, request.model)
        post = self._posteriors[key] = self._posteriors[key].update(output_tokens)
        if self.inflight.get(ck, {}).pop(request.id, None) is not None:
            self.logged(request.id)
        if isinstance(post, LengthHistogram):
            counts = self._bin_counts.get(ck)
            if counts is None:
                counts = self._bin_counts[ck] = np.zeros(HIST_BINS)
            counts[length_bin(output_tokens)] += 1.0
            # The belief with the running requests censored is rebuilt when next read (not at
            # each of the many completions a step may bring: one rebuild reads them all).
            self._stale.add(key)
        self.versions[key] = self.versions.get(key, 0) + 1

    def forget(self, request_id: str) -> bool:
        """Stop counting ``request_id`` running (cancelled or failed); True if it was."""
        forgot = False
        for inflight in self.inflight.values():
            if inflight.pop(request_id, None) is not None:
                forgot = True
                self.logged(request_id)
        return forgot
