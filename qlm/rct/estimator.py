"""The request completion time (RCT) estimator, paper §6 (Eqs. 1–5), with distributions.

For a request ``q`` on one instance (Eq. 1): ``C_q = W_q + P(I_q) + O_q · ε · d``.

*Work.* The paper divides the output tokens ahead by the throughput Θ (Eq. 2). Prompt tokens cost
GPU time too — with Azure-conversation prompts (1,155 tokens on average against 211 output tokens)
prefill is most of it — so a request's work is ``I · w_in + O · s / Θ`` seconds of a saturated
instance, ``w_in`` and ``Θ`` measured by hardware profiling. Θ is measured in a full batch of the
profile's requests; ``s = (d(B, K) / B) / (d(B₀, K₀) / B₀)`` carries it to the batch ``B`` the
mix on the instance fills (KV footprint ``K``, per request as the running batch shows it): long
requests fill the KV cache with fewer of them, and each step's time is shared by fewer tokens
(ShareGPT on an A100: 151 requests, ``s`` = 1.9). A running request has only its remaining output
left.

*Waiting* (Eq. 2, for continuous batching). A request does not wait for the running batch to
finish, only for the requests *waiting* ahead of it to be admitted. Those that find a free slot
(of the ``max_num_seqs`` / KV-cache slots the running requests leave) are admitted as fast as
their prompts prefill; the rest one as another completes, at the rate the instance does work. So
``W_q = κ_W · (Σ I · w_in + Σ' O · s / Θ)``: the prompt work of every waiting request ahead, and
the output work of those ahead that had no free slot (0 when none wait). ``κ_W`` (1 until learnt,
kept in [1/4, 4]) is the observed drain rate: seconds between completions while requests wait
for a slot, per second of the work *predicted* for them — not of their actual work: while a
queue builds the short outputs complete first, and their actual work would call the instance
slow. Requests that wait only for the prompts ahead to prefill (slots free) do not count: the
instance is filling its batch then, and completions are few.

*Decode* (Eq. 4): ``O · ε · d`` with ``d = d(B, K) + B · Ī · w_in / Ō``. ``d(B, K)`` is the pure
decode time per token with ``B`` requests running (from a request alone to a full batch, profiled)
whose KV cache holds ``K`` tokens (each step reads all of it; the whole cache once it limits the
batch). An instance receiving more work than it serves is about to fill its batch: ``B`` is then
the full batch, whatever a request finds on arrival (unless requests are pulled) — its slots, or
the ``T / (1 + Ī / Ō)`` requests its token budget per step ``T`` sustains when the prompts that
replace finishing requests take the rest of each step (``_sustained``). The
second term is the prefill of the requests that replace finishing ones: in steady state ``B / (Ō d)``
requests finish per second and as many are admitted, each costing ``Ī · w_in`` of GPU time that
every running request waits through (``Ī``, ``Ō``: mean prompt and output of the mix). ``ε``
(1 until learnt, kept in [1/2, 2]) is learnt online — a factor of its own for requests that
arrive while the batch fills (requests waiting to be admitted, fewer than ``FILL_SHARE`` of the
batch running): then each step also prefills the prompts being admitted, and those slow decodes
must not teach the full batch's factor. With the token budget ``T`` known, such a request's first
``(B_full − B) · Ī / (T − B)`` tokens are counted at ``d(B) + (T − B) · w_in`` (steps full of
prompt chunks), the rest in the full batch. The state an instance is in on arrival says
less about a request's decode than the model makes of it: unsaturated, the batch turns over while
the request runs. So the time per token is regressed toward the mean of what the last ~64
arrivals were told (log scale), by the slope ``β`` of the actual on the predicted departures from
that mean, learnt from completions (1 until they say otherwise; at the end of the ShareGPT
replays 0–0.2, on Azure conv 1).

*Preemption.* With its KV cache full, vLLM preempts the newest running request and later
recomputes what it had computed (usually a prompt being prefilled in chunks: about one prompt
of the mix). From the engine's counter (``EstimatorInstance.preemptions_total``) each instance learns
its preemptions per completed request ``ρ``, and every prompt's work counts ``1 + ρ`` times (the
waiting requests' and the refill's). A completion is judged against the rate it met, not the
one known at its arrival, so that ``κ_W`` and ``ε`` do not learn the preemptions a second time.

*Output lengths* (Eq. 3, made Bayesian): ``O`` has the posterior predictive of the request's
(model, SLO class) — a ``LengthHistogram`` (a Dirichlet over bins of log length whose prior is the
workload profile's ``NIG``; ``shape_free=False`` keeps the location–scale ``NIG`` itself) — capped
at ``max_tokens`` and, for a running request, conditioned on the tokens it already generated.
Requests seen running count as right-censored outputs (longer than what they generated so far)
until they complete: without them the belief learns only from completions, which under a queue
are the short ones first. With ``by_prompt`` each (model, SLO class) also keeps a belief per bin
of prompt length (13 % wide), shrunk toward the class-wide one (``POOL_STRENGTH`` outputs' worth):
templated jobs answer at lengths their prompts announce (Azure conv: 94 % of the requests with
1,020–1,189-token prompts, a quarter of all, answer with more than 300 tokens; 13 % of the
others). Off by default:
the planner does not yet gain from it (experiments/README.md).
Independent requests add means and variances, so ``W_q`` and ``C_q`` are
carried as normal distributions (the central limit with many requests ahead, a moment match with
few).

*Groups* (Eq. 5): a group's completion is the max over its requests; FCFS inside the group makes it
its last request's completion.

*Model switches*: when the model changes along a queue (or differs from the active one) the load
time is added: warm if the model is in CPU memory, cold otherwise.

*Model error*: besides output-length uncertainty the estimator learns, per instance, the spread
of waiting-time errors (added to the start's variance) and the spread of
``log(actual / predicted time per output token)`` request to request (the batch a request decodes
in changes under it; ``P(C ≤ t)`` integrates over it, mean-preserving), so that ``P(C ≤ SLO)`` is
not over-confident.

Pure: no I/O, no clock; ``now`` comes in, observations come in through ``observe``. This
module holds the completion-time model (per request and per virtual queue); the rest is in
modules of its own: what it is shown (``qlm.rct.inputs``), the output-length beliefs and their
moments (``qlm.rct.beliefs``), group loads (``qlm.rct.loads``), the sums over running requests
(``qlm.rct.running``), the batch an instance runs (``qlm.rct.batch``), the distributions it
answers with (``qlm.rct.distribution``), what it learns per instance (``qlm.rct.calibration``)
and its tuning constants (``qlm.rct.tuning``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from qlm.domain import Request
from qlm.rct.batch import context_tokens, output_work_scale, slots_for, sustained_batch
from qlm.rct.beliefs import OutputBeliefs
from qlm.rct.calibration import Calibration, Prediction, shrunk
from qlm.rct.distribution import CompletionDistribution, GroupEstimate, QueueEstimates
from qlm.rct.inputs import EstimatorInstance, Queued
from qlm.rct.loads import GroupLoad, GroupLoader, GroupLoads, as_loads
from qlm.rct.output_model import OutputBelief
from qlm.rct.profile import HardwareProfile, RctProfile
from qlm.rct.running import RunningSums
from qlm.rct.tuning import FILL_SHARE


@dataclass(slots=True)
class _QueueScalars:
    """What ``RCTEstimator.estimate_queues`` needs of one queue besides its groups' arrays: the
    instance's calibration, the sums over its running requests and groups, and per group the
    terms of its model (hardware, batch, Θ in the batch this mix fills, model switch)."""

    instance: EstimatorInstance
    loads: GroupLoads
    n: int = 0
    wf: float = 1.0
    ef: float = 1.0
    redo: float = 1.0
    center: float | None = None
    slope: float = 1.0
    rel_sd: float = 0.0
    n_running: int = 0
    free: int = 0
    refill: float = 0.0
    ctx_per: float = 0.0
    hws: tuple[HardwareProfile, ...] = ()  # by model code
    slots_of: tuple[int, ...] = ()
    model_code: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    w_in: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    theta: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    theta2: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    slots: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    full: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    switch: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    prefill_base: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    prefill_per_token: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))

    def per_token(self, code: int, batch: int, refilling: bool) -> float:
        """Time per output token of a group's last request decoding in ``batch``."""
        hw = self.hws[code]
        dec = hw.decode_s(batch, context_tokens(hw, batch, self.slots_of[code], self.ctx_per))
        return shrunk(
            (dec + (batch * self.refill if refilling else 0.0)) * hw.inefficiency * self.ef,
            self.center,
            self.slope,
        )


@dataclass(slots=True)
class _Scan:
    """Per-request terms of a queue scanned in order (``RCTEstimator._scan``), kept per
    instance so that a queue extending the last one is scanned from where that one ended."""

    signature: tuple[Any, ...]  # what the terms depend on besides the requests
    keys: list[tuple[Request, int, bool]] = field(default_factory=list)
    hws: list[HardwareProfile] = field(default_factory=list)
    switch: list[float] = field(default_factory=list)  # model load before the request
    work_in: list[float] = field(default_factory=list)  # prefill work, before recomputation
    work_out: list[float] = field(default_factory=list)
    work_var: list[float] = field(default_factory=list)
    own: list[float] = field(default_factory=list)  # prefill time (0 for running requests)
    out_mean: list[float] = field(default_factory=list)
    out_var: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    mix_prompt: list[float] = field(default_factory=list)  # prompt work of each request
    mix_output: list[float] = field(default_factory=list)  # its generated + expected output
    live_ctx: list[int] = field(default_factory=list)  # context if running (else 0)
    n_running: int = 0
    model: str | None = None  # the model after the last request

    def truncate(self, length: int, active_model: str | None) -> None:
        for terms in (
            self.keys, self.hws, self.switch, self.work_in, self.work_out, self.work_var,
            self.own, self.out_mean, self.out_var, self.tokens, self.mix_prompt, self.mix_output,
            self.live_ctx,
        ):  # fmt: skip
            del terms[length:]
        self.n_running = sum(1 for _, _, running in self.keys if running)
        self.model = self.hws[-1].model if self.hws else active_model


@dataclass
class RCTEstimator:
    """Completion-time distributions for requests and groups; learns from completions."""

    profile: RctProfile
    forgetting: float = 0.99  # weight of the past per observed completion
    min_rel_sd: float = 0.02  # floor on the spread, relative to the latency
    shape_free: bool = True  # output lengths as a LengthHistogram (else the profile's NIG)
    by_prompt: bool = False  # output beliefs per prompt-length bin (shape-free only)
    # Output-length beliefs, the requests seen running and the moments cache.
    beliefs: OutputBeliefs = field(init=False)
    # Group loads under the beliefs, and the sums over each instance's running requests.
    _loads: GroupLoader = field(init=False)
    _running: RunningSums = field(init=False)
    _calibration: dict[str, Calibration] = field(default_factory=dict, init=False)
    _pending: dict[str, Prediction] = field(default_factory=dict, init=False)
    # Bumped by whatever changes a belief or forgets a running request: the scans below are
    # valid within one epoch.
    _epoch: int = field(default=0, init=False)
    # Per instance, the last queue ``estimate_requests`` scanned: a request pulled behind the
    # running ones (the agents predict every pull) rescans only what was added since.
    _scans: dict[str, _Scan] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.beliefs = OutputBeliefs(self.profile, self.shape_free, self.by_prompt)
        self._loads = GroupLoader(self.beliefs)
        self._running = RunningSums(self.beliefs)

    # --- output lengths --------------------------------------------------------------------------

    def posterior(self, request: Request) -> OutputBelief:
        """The output-length belief for ``request`` (``OutputBeliefs.posterior``)."""
        return self.beliefs.posterior(request)

    def output_moments(self, request: Request, generated: int = 0) -> tuple[float, float]:
        """Mean and variance of the output tokens ``request`` still has to generate."""
        return self.beliefs.output_moments(request, generated)

    def expected_rests(self, items: Sequence[tuple[Request, int]]) -> list[float]:
        """``output_moments(request, generated)[0]`` of each (request, generated), the misses
        priced per belief at once (``OutputBeliefs.expected_rests``)."""
        return self.beliefs.expected_rests(items)

    def expected_output(self, request: Request) -> float:
        return self.beliefs.output_moments(request)[0]

    # --- per-request estimates -------------------------------------------------------------------

    def slots(self, hw: HardwareProfile, mean_tokens: float) -> int:
        """How many requests of ``mean_tokens`` (prompt + output) the instance runs at once."""
        return slots_for(hw, mean_tokens)

    def _scan(self, instance: EstimatorInstance, queue: Sequence[Queued]) -> _Scan:
        """The per-request terms of ``queue`` on ``instance``: reused from the last scan of
        the instance as far as the queue is the same (same requests, tokens generated and
        state, in the same order, in the same epoch of the beliefs), computed for the rest."""
        signature = (
            self._epoch,
            id(self.profile),
            instance.active_model,
            instance.gpu,
            instance.gpu_count,
            instance.warm_models,
        )
        scan = self._scans.get(instance.name)
        if scan is None or scan.signature != signature:
            scan = self._scans[instance.name] = _Scan(signature, model=instance.active_model)
        keys = scan.keys
        same = 0
        for (req, generated, running), item in zip(keys, queue, strict=False):
            if req is not item.request or generated != item.generated or running != item.running:
                break
            same += 1
        if same < len(keys):
            scan.truncate(same, instance.active_model)
        if same == len(queue):
            return scan
        rest = queue[same:]
        try:
            self._extend(scan, instance, rest)
        except BaseException:  # half-appended terms must not be reused
            del self._scans[instance.name]
            raise
        return scan

    def _extend(self, scan: _Scan, instance: EstimatorInstance, rest: Sequence[Queued]) -> None:
        self.beliefs.prefetch(rest)
        by_model = {hw.model: hw for hw in scan.hws}
        model = scan.model
        for item in rest:
            req = item.request
            hw = by_model.get(req.model) or by_model.setdefault(
                req.model, self.profile.hardware_for(req.model, instance.gpu, instance.gpu_count)
            )
            scan.hws.append(hw)
            if req.model != model:
                scan.switch.append(self._load_s(hw, instance))
                model = req.model
            else:
                scan.switch.append(0.0)
            m, v = self.beliefs.output_moments(req, item.generated)
            prompt = 0.0 if item.running else req.input_tokens + item.generated
            scan.work_in.append(prompt * hw.input_token_work_s)
            scan.work_out.append(m / hw.throughput_tps)
            scan.work_var.append(v / hw.throughput_tps**2)
            scan.own.append(0.0 if item.running else hw.prefill_s(prompt))
            scan.out_mean.append(m)
            scan.out_var.append(v)
            scan.tokens.append(req.input_tokens + item.generated + m)
            # The mix of whole requests (prompt work per output token) sets the refill cost.
            scan.mix_prompt.append(req.input_tokens * hw.input_token_work_s)
            scan.mix_output.append(item.generated + m)
            scan.live_ctx.append(req.input_tokens + item.generated if item.running else 0)
            scan.n_running += item.running
            scan.keys.append((req, item.generated, item.running))
        scan.model = model

    def estimate_requests(
        self,
        instance: EstimatorInstance,
        queue: Sequence[Queued],
        now: float,
        *,
        remember: bool = False,
        only: Sequence[int] | None = None,
        refilled: bool = False,
    ) -> list[CompletionDistribution]:
        """Completion of every request in ``queue`` (served in that order: running ones first,
        then FCFS), or of those at the positions ``only`` (e.g. ``[-1]`` for a request just
        queued: the sums over the queue are needed anyway, the per-request work is not). With
        ``remember`` the predictions are kept so that ``observe`` can learn. ``refilled``: more
        work waits outside ``queue`` (a virtual queue that pull dispatch feeds the engine from),
        so every slot that frees is refilled at once, as when requests wait in the engine."""
        n = len(queue)
        if n == 0:
            return []
        scan = self._scan(instance, queue)
        self.watch(instance)
        cal = self._cal(instance.name)
        wf, ef = cal.wait_factor(), cal.eps_factor()
        work_in = np.array(scan.work_in)  # prefill work (s of a saturated instance)
        work_out = np.array(scan.work_out)  # output work
        work_var = np.array(scan.work_var)
        own = scan.own  # prefill time (0 for running requests)
        out_mean = np.array(scan.out_mean)
        out_var = scan.out_var
        tokens = np.array(scan.tokens)
        switch = np.array(scan.switch)
        mix_prompt, mix_output = sum(scan.mix_prompt), sum(scan.mix_output)
        live_ctx = sum(scan.live_ctx)
        hws = scan.hws
        by_model = {hw.model: hw for hw in hws}
        slots = self.slots(hws[0], float(tokens.mean()))
        # A preempted request's computed tokens (about a prompt of the mix) are recomputed: each
        # completion costs its prompt and that many more prompts' worth of prefill.
        redo = 1.0 + cal.preemption_rate()
        work_in *= redo
        refill = redo * mix_prompt / max(mix_output, 1.0)
        # The batch a busy instance runs: its slots, or fewer when its token budget per step is
        # spent on the prompts that replace finishing requests (``sustained_batch``).
        full = int(min(slots, sustained_batch(hws[0], refill)))
        # KV footprint of a request over its decode (its prompt and half its output, on average).
        ctx_per = float(tokens.mean() - 0.5 * out_mean.mean())
        n_running = scan.n_running
        # Output work in the batch this mix fills (the profile's Θ is for its own requests), at
        # the KV footprint per request the running batch shows now (prompt and tokens generated
        # so far): the queue's expected outputs lag a drifting mix.
        footprint = live_ctx / n_running if n_running else ctx_per
        if len(by_model) == 1:
            factor = np.full(n, output_work_scale(hws[0], slots, footprint))
        else:
            scales = {m: output_work_scale(h, slots, footprint) for m, h in by_model.items()}
            factor = np.fromiter((scales[h.model] for h in hws), float, n)
        work_out *= factor
        work_var *= factor * factor
        cum_in = np.concatenate(([0.0], np.cumsum(work_in)))
        cum_out = np.concatenate(([0.0], np.cumsum(work_out)))
        cum_var = np.concatenate(([0.0], np.cumsum(work_var)))
        cum_switch = np.cumsum(switch)
        # Waiting requests that find a free slot are admitted as fast as their prompts prefill;
        # the rest wait for running requests to finish (the drain, at the rate of output work).
        free = 0 if refilled else max(slots - n_running, 0)
        drain_from = n_running + max(free - 1, 0)
        cal.saturated = n - n_running - 1 > free  # someone besides the newest waits for a slot
        # Unsaturated, new arrivals' prefills interrupt decoding: the share of time they take.
        # Arriving faster than it serves (ρ ≥ 1), the instance is about to saturate.
        rate = cal.arrival_rate()
        arrival_share = min(0.9, rate * mix_prompt / max(n, 1))
        overloaded = rate * (mix_prompt + mix_output / hws[0].throughput_tps) / max(n, 1) >= 1.0
        wait_rel = cal.wait_rel_sd()
        speed_sd = cal.speed_sd()
        center, slope = cal.shrink()
        filling = not refilled and n - n_running > 1 and n_running < FILL_SHARE * full
        ef_fill = cal.eps_factor(filling=True) if filling else ef
        prompt_tokens = mix_prompt / max(hws[0].input_token_work_s, 1e-12) / n
        out: list[CompletionDistribution] = []
        positions = range(n) if only is None else [i % n for i in only]
        for i in positions:
            item = queue[i]
            hw = hws[i]
            req = item.request
            # Work of the waiting requests ahead (running ones come first in ``queue``).
            first, drained = min(i, n_running), min(i, drain_from)
            wait_raw = float(cum_in[i] - cum_in[first] + cum_out[i] - cum_out[drained])
            var_raw = float(cum_var[i] - cum_var[drained])
            wait = wait_raw * wf + float(cum_switch[i])
            wait_var = var_raw * wf * wf + (wait_rel * wait_raw * wf) ** 2
            # Arriving faster than it serves, the instance fills its batch before long: the
            # request decodes in a full one, whatever it finds on arrival (unless requests are
            # pulled: then the planner, not the arrivals, sets the batch). A running request
            # shares the batch with all the running ones, whatever its place in the queue.
            busy = i - n_running >= 1 or overloaded or refilled
            if overloaded and not refilled:
                batch = full
            else:
                batch = min(max(i + 1, n_running), full if busy else slots)
            ctx = context_tokens(hw, batch, slots, ctx_per)
            # While others wait, admissions go on as requests finish (refill); otherwise new
            # arrivals are admitted as they come.
            d_prefill = 0.0
            if busy:
                d_batch = hw.decode_s(batch, ctx) + batch * refill
                d_prefill = batch * refill / redo
            else:
                d_batch = hw.decode_s(batch, ctx) / (1.0 - arrival_share)
            # Admitted while the batch fills, a request decodes its first tokens in steps that
            # spend the rest of the token budget on the prompts still to be admitted.
            fills = filling and not item.running
            budget = hw.max_num_batched_tokens
            if fills and budget > batch:
                b_in = min(i + 1, full)
                steps = max(full - b_in, 0) * prompt_tokens / (budget - b_in)
                if steps > 0:
                    c_in = context_tokens(hw, b_in, slots, ctx_per)
                    t_fill = hw.decode_s(b_in, c_in) + (budget - b_in) * hw.input_token_work_s
                    share = min(steps / max(float(out_mean[i]), 1.0), 1.0)
                    d_batch += share * (t_fill - d_batch)
                    d_prefill *= 1.0 - share
            d = d_batch * hw.inefficiency
            start = now + wait + float(own[i])
            e_i = ef_fill if fills else ef
            per_token = shrunk(d * e_i, center, slope)
            mean = start + float(out_mean[i]) * per_token
            var = wait_var + float(out_var[i]) * per_token**2
            post = self.beliefs.posterior(req)
            out.append(
                CompletionDistribution(
                    mean,
                    var,
                    start_mean=start,
                    start_sd=math.sqrt(wait_var),
                    output=post,
                    generated=item.generated,
                    cap=req.max_tokens,
                    per_token_s=per_token,
                    speed_sd=speed_sd,
                )
            )
            if remember and not item.running and req.id not in self._pending:
                log_raw = math.log(max(d * e_i, 1e-12))
                cal.note_arrival(now, log_raw, center)
                # Learn from the prediction made when the request arrived, not from later ones.
                self._pending[req.id] = Prediction(
                    instance=instance.name,
                    wait_raw=wait_raw,
                    d_eff=d,
                    redo=redo,
                    d_prefill=d_prefill * hw.inefficiency,
                    per_token_s=per_token,
                    log_raw=log_raw,
                    center=log_raw if center is None else center,
                    mean_latency=mean - now,
                    work_in=redo * (req.input_tokens + item.generated) * hw.input_token_work_s,
                    work_per_output=float(factor[i]) / hw.throughput_tps,
                    output_mean=float(out_mean[i]),
                    filling=fills,
                )
        return out

    def _load_s(self, hw: HardwareProfile, instance: EstimatorInstance) -> float:
        return hw.warm_load_s if hw.model in instance.warm_models else hw.cold_load_s

    def watch(self, instance: EstimatorInstance) -> None:
        """Read what ``instance`` says of its engine (the preemption counter) without
        predicting anything: callers that predict seldom call it as often as they look, so
        that preemptions are counted against the completions they come with."""
        self._cal(instance.name).count_preemptions(instance.preemptions_total)

    def preemption_rate(self, instance: str) -> float:
        """Preemptions per completed request the engine of ``instance`` has been seen making."""
        return self._cal(instance).preemption_rate()

    def calibration_factors(self, instance: str) -> tuple[float, float]:
        """(waiting-time factor, decode-speed factor) learned for ``instance``: how much slower
        than the profile it has drained its queue and decoded (1.0 before any observation)."""
        cal = self._cal(instance)
        return cal.wait_factor(), cal.eps_factor()

    def speed_slope(self, instance: str) -> float:
        """Share of a predicted departure of the time per token from the recent mean that came
        true on ``instance`` (1 before any observation)."""
        return self._cal(instance).speed_slope()

    def _cal(self, instance: str) -> Calibration:
        cal = self._calibration.get(instance)
        if cal is None:
            cal = self._calibration[instance] = Calibration()
        return cal

    # --- groups ----------------------------------------------------------------------------------

    def group_load(self, group_id: str, requests: Sequence[Request]) -> GroupLoad:
        """Aggregate a group's requests (FCFS order) into the sums the queue estimate needs."""
        return self._loads.load(group_id, requests)

    def group_loads(self, groups: Sequence[tuple[str, Sequence[Request]]]) -> GroupLoads:
        """``group_load`` of each of ``groups`` (id, requests in FCFS order), as arrays: the
        same numbers to the last bit (``GroupLoader.loads``)."""
        return self._loads.loads(groups)

    def keep_group_loads(self, group_ids: Iterable[str]) -> None:
        """Forget the sums of groups not in ``group_ids`` (those that ended): a planner calls
        it with the groups it plans, so that what ``group_load`` keeps stays that size."""
        self._loads.keep(group_ids)

    def estimate_queue(
        self,
        instance: EstimatorInstance,
        groups: Sequence[GroupLoad] | GroupLoads,
        now: float,
        *,
        running: Sequence[Queued] = (),
    ) -> list[GroupEstimate]:
        """Completion of each group of a virtual queue, in order, behind the running requests.

        The same model as ``estimate_requests`` at group granularity: a group's last request waits
        for the work of every group ahead and of its own group but itself. ``groups``: their
        ``GroupLoad``s, or their aggregates as arrays (``group_loads``, ``GroupLoads.take``).
        """
        return self.estimate_queues([(instance, groups, running)], now)[0].groups()

    def estimate_queues(
        self,
        queues: Sequence[
            tuple[EstimatorInstance, Sequence[GroupLoad] | GroupLoads, Sequence[Queued]]
        ],
        now: float,
    ) -> list[QueueEstimates]:
        """``estimate_queue`` of each virtual queue (instance, groups in order, running requests),
        all at once: the groups of every queue are scanned as arrays, one row per queue (running
        sums along each row), and the numbers are those of a scan group by group, to the last
        bit."""
        self._running.reprice_kept(queues)
        rows: list[_QueueScalars] = []
        for instance, groups, running in queues:
            rows.append(self._queue_scalars(instance, groups, running))
        out = [
            QueueEstimates(r.instance.name, (), np.zeros(0), np.zeros(0), np.zeros(0)) for r in rows
        ]
        live = [q for q, r in enumerate(rows) if r.n]
        if not live:
            return out
        n_of = np.array([rows[q].n for q in live])
        width = int(n_of.max())
        row = np.repeat(np.arange(len(live)), n_of)  # per group, its queue's row
        col = np.concatenate([np.arange(n) for n in n_of.tolist()])  # and its place in it

        def cat(name: str) -> npt.NDArray[Any]:
            return np.concatenate([getattr(rows[q].loads, name) for q in live])

        def per_group(name: str) -> npt.NDArray[np.float64]:
            return np.concatenate([getattr(rows[q], name) for q in live])

        def per_queue(name: str) -> npt.NDArray[Any]:
            return np.array([getattr(rows[q], name) for q in live])[row]

        def running_sum(x: npt.NDArray[Any], *, inclusive: bool) -> npt.NDArray[Any]:
            """Along each queue, the sum of ``x`` over the groups before (or up to) each."""
            grid = np.zeros((len(live), width + 1), x.dtype)
            grid[row, col + 1] = x
            at: npt.NDArray[Any] = np.cumsum(grid, axis=1)[row, col + 1 if inclusive else col]
            return at

        size = cat("size")
        inputs, out_mean, out_var = cat("input_tokens"), cat("output_mean"), cat("output_var")
        last_mean, last_var = cat("last_output_mean"), cat("last_output_var")
        last_in = cat("last_input_tokens")
        theta, theta2 = per_group("theta"), per_group("theta2")
        wf, n_running, free = per_queue("wf"), per_queue("n_running"), per_queue("free")
        switches = running_sum(per_group("switch"), inclusive=True)
        # Everything of a group but its last request ...
        own_out = (out_mean - last_mean) / theta
        w_in = per_group("w_in") * per_queue("redo")
        own = (inputs - last_in) * w_in + own_out
        own_var = (out_var - last_var) / theta2
        ahead = n_running + running_sum(size, inclusive=False)  # requests ahead of each group
        room = np.maximum(free - 1 - (ahead - n_running), 0)  # exempt places left before it
        many = size > 1
        share = np.where(many, np.minimum(room, size - 1) / np.where(many, size - 1, 1), 0.0)
        before_last = ahead + size - 1  # requests ahead of the group's last request
        # ... then the last request itself: what each group adds for those behind it.
        last_out, last_w = last_mean / theta, last_var / theta2
        whole = room > size - 1
        waiting = running_sum(own + last_in * w_in + last_out, inclusive=False)
        waiting_var = running_sum(own_var + last_w, inclusive=False)
        exempt = running_sum(share * own_out + np.where(whole, last_out, 0.0), inclusive=False)
        exempt_var = running_sum(share * own_var + np.where(whole, last_w, 0.0), inclusive=False)
        wait = (waiting + own - exempt - share * own_out) * wf + switches
        wait_var = (waiting_var + own_var - exempt_var - share * own_var) * wf * wf
        refilling = before_last - n_running >= 1
        batch = np.minimum(
            before_last + 1, np.where(refilling, per_group("full"), per_group("slots"))
        ).astype(np.int64)
        # The time per token of a group's last request depends on the batch it decodes in: a
        # few distinct batches along a queue (it fills, then stays full).
        code = per_group("model_code").astype(np.int64)
        models = int(code.max()) + 1
        top = int(batch.max()) + 1
        key = ((row * models + code) * top + batch) * 2 + refilling  # (one integer per case)
        distinct, which = np.unique(key, return_inverse=True)
        per_token = np.array(
            [
                rows[live[k // 2 // top // models]].per_token(
                    k // 2 // top % models, k // 2 % top, bool(k % 2)
                )
                for k in distinct.tolist()
            ]
        )
        d = per_token[which.reshape(-1)]
        prefill = per_group("prefill_base") + per_group("prefill_per_token") * last_in
        mean = now + wait + prefill + last_mean * d
        var = wait_var + (per_queue("rel_sd") * wait) ** 2 + last_var * d * d
        deadlines = cat("earliest_deadline_s")
        start = 0
        for q, n in zip(live, n_of.tolist(), strict=True):
            at = slice(start, start + n)
            name, ids = rows[q].instance.name, rows[q].loads.group_ids
            out[q] = QueueEstimates(name, ids, mean[at], var[at], deadlines[at])
            start += n
        return out

    def _queue_scalars(
        self,
        instance: EstimatorInstance,
        groups: Sequence[GroupLoad] | GroupLoads,
        running: Sequence[Queued],
    ) -> _QueueScalars:
        """One queue's part of ``estimate_queues``: notes its running requests, reads the
        instance's calibration and sums what the estimates of its groups share."""
        self._epoch += 1  # (the running requests' tokens noted here may differ from a scan's)
        self.watch(instance)
        cal = self._cal(instance.name)
        tokens, remaining_running, mix_prompt, mix_output = self._running.sums(instance, running)
        loads = groups if isinstance(groups, GroupLoads) else as_loads(groups)
        n = len(loads.models)
        if n == 0:
            return _QueueScalars(instance, loads)
        if len(loads.group_ids) != n:
            raise ValueError("estimate_queue needs the groups' ids (GroupLoads.group_ids)")
        wf, ef = cal.wait_factor(), cal.eps_factor()
        redo = 1.0 + cal.preemption_rate()  # prompts recomputed after preemptions, as for requests
        center, slope = cal.shrink()
        rel_sd = max(cal.wait_rel_sd(), self.min_rel_sd)
        n_running = len(running)
        names = tuple(dict.fromkeys(loads.models))
        hws = tuple(self.profile.hardware_for(m, instance.gpu, instance.gpu_count) for m in names)
        if len(names) == 1:
            code = np.zeros(n, np.int64)
        else:
            index = {m: c for c, m in enumerate(names)}
            code = np.array([index[m] for m in loads.models], np.int64)

        def by_model(values: Sequence[float]) -> npt.NDArray[Any]:
            return np.array(values)[code]

        w_in = by_model([hw.input_token_work_s for hw in hws])
        # Sums along the queue, added in its order after the running requests' (as a scan adds).
        mix_prompt = float(np.cumsum(np.concatenate(([mix_prompt], loads.input_tokens * w_in)))[-1])
        mix_output = float(np.cumsum(np.concatenate(([mix_output], loads.output_mean)))[-1])
        refill = redo * mix_prompt / max(mix_output, 1.0)
        total_tokens = tokens + sum((loads.input_tokens + loads.output_mean).tolist())
        total_count = n_running + sum(loads.size.tolist())
        # Outputs yet to come count half toward the KV footprint over a request's decode.
        remaining = sum(loads.output_mean.tolist()) + remaining_running
        ctx_per = (total_tokens - 0.5 * remaining) / max(total_count, 1)
        # The KV footprint per request the batch shows now (prompt and tokens generated so far):
        # what the output work is scaled by (as for requests; the queue's own expected outputs
        # lag a drifting mix).
        footprint = (tokens - remaining_running) / n_running if n_running else ctx_per
        per_request = total_tokens / max(total_count, 1)
        slots = tuple(self.slots(hw, per_request) for hw in hws)
        full = [int(min(s, sustained_batch(hw, refill))) for s, hw in zip(slots, hws, strict=True)]
        theta = [
            hw.throughput_tps / output_work_scale(hw, s, footprint)
            for s, hw in zip(slots, hws, strict=True)
        ]
        # Model switches along the queue: the load time where the model changes.
        switch = np.zeros(n)
        if len(names) == 1:
            if names[0] != instance.active_model:
                switch[0] = self._load_s(hws[0], instance)
        else:
            model = instance.active_model
            for k, m in enumerate(loads.models):
                if m != model:
                    switch[k] = self._load_s(hws[int(code[k])], instance)
                    model = m
        return _QueueScalars(
            instance,
            loads,
            n,
            wf=wf,
            ef=ef,
            redo=redo,
            center=center,
            slope=slope,
            rel_sd=rel_sd,
            n_running=n_running,
            # As for requests: the first waiting requests that find a free slot cost only
            # their prefill (their output work is exempt); the rest wait for the drain.
            free=max(slots[int(code[0])] - n_running, 0),
            refill=refill,
            ctx_per=ctx_per,
            hws=hws,
            slots_of=slots,
            model_code=code,
            w_in=w_in,
            theta=by_model(theta),
            theta2=by_model([t**2 for t in theta]),
            slots=by_model(slots).astype(np.int64),
            full=by_model(full).astype(np.int64),
            switch=switch,
            prefill_base=by_model([hw.prefill_base_s for hw in hws]),
            prefill_per_token=by_model([hw.prefill_per_token_s for hw in hws]),
        )

    # --- learning --------------------------------------------------------------------------------

    def observe(
        self,
        request: Request,
        *,
        output_tokens: int,
        scheduled_s: float | None = None,
        first_token_s: float | None = None,
        finish_s: float | None = None,
        instance: str | None = None,
    ) -> None:
        """A request finished: update the output posterior and, if its completion was predicted
        with ``remember``, the instance's calibration (waiting, decode and error spread).
        ``instance``: where it ran, so that a completion nothing was predicted for (a request in
        flight when this estimator started, e.g. after a controller failover) still ends the
        interval the next completion's service time is measured from."""
        self._epoch += 1
        self.beliefs.observe(request, output_tokens)
        pred = self._pending.pop(request.id, None)
        if pred is None:
            if instance is not None and finish_s is not None:
                self._cal(instance).completed_unpredicted(finish_s)
            return
        self._cal(pred.instance).learn(
            pred,
            arrival_s=request.arrival_s,
            output_tokens=output_tokens,
            scheduled_s=scheduled_s,
            first_token_s=first_token_s,
            finish_s=finish_s,
            forgetting=self.forgetting,
        )

    def predicted_wait(self, request_id: str) -> float:
        """The waiting time predicted (calibrated) for a remembered request when it arrived."""
        pred = self._pending[request_id]
        return pred.wait_raw * self._cal(pred.instance).wait_factor()

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop remembered predictions (cancelled or failed requests)."""
        self.beliefs.censor_all()
        for rid in request_ids:
            self._pending.pop(rid, None)
            if self.beliefs.forget(rid):
                self._epoch += 1  # a scan noted it running: scan again
