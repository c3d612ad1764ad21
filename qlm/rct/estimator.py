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

Pure: no I/O, no clock; ``now`` comes in, observations come in through ``observe``. The
distributions it answers with are in ``qlm.rct.distribution``, what it learns per instance in
``qlm.rct.calibration``, its tuning constants in ``qlm.rct.tuning``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from qlm.domain import Request
from qlm.rct.calibration import Calibration, Prediction, shrunk
from qlm.rct.distribution import CompletionDistribution, GroupEstimate, QueueEstimates
from qlm.rct.output_model import (
    HIST_BINS,
    LengthHistogram,
    OutputBelief,
    cap_moments,
    length_bin,
    pair_moments,
)
from qlm.rct.profile import HardwareProfile, RctProfile
from qlm.rct.tuning import FILL_SHARE, GROUP_SUMS_MAX, POOL_STRENGTH, PROMPT_BIN_WIDTH

_MomentsKey = tuple[str, str, int, int, int, int]
"""``output_moments``' cache key: model, SLO class, prompt bin, belief version, cap, generated."""


def prompt_bin(input_tokens: int) -> int:
    """The prompt-length bin whose output belief a request of ``input_tokens`` uses."""
    return int(math.log1p(max(input_tokens, 0)) / PROMPT_BIN_WIDTH)


def _context(hw: HardwareProfile, batch: int, slots: int, per_request: float) -> float:
    """KV footprint (tokens) of a batch of ``batch`` requests of ``per_request`` tokens each. A
    batch the KV cache limits is a full cache: the engine admits until it is, and preempts to
    keep it so as outputs grow."""
    if batch >= slots and slots < hw.max_num_seqs:
        return float(hw.kv_capacity_tokens)
    return min(float(hw.kv_capacity_tokens), batch * per_request)


def _output_work_scale(hw: HardwareProfile, slots: int, per_request: float) -> float:
    """GPU time of an output token in the batch this mix fills, relative to the profile's ``1 / Θ``
    (measured in a batch of the profile's requests): a saturated instance decodes ``B`` tokens
    per step of ``d(B, K)``, and a mix of long requests fills its KV cache with fewer of them.
    (ShareGPT's 2,340 + 439-token requests: 151 to an A100's cache, each output token 1.9× the
    profile's GPU time; Azure conversation's: 1.05×.)"""
    sat = hw.saturation_batch
    if sat <= 0:
        return 1.0
    ref_ctx = sat * hw.decode_ctx_tokens if hw.decode_ctx_tokens > 0 else None
    ref = hw.decode_s(sat, ref_ctx) / sat
    cur = hw.decode_s(slots, _context(hw, slots, slots, per_request)) / slots
    return cur / ref if ref > 0 else 1.0


def _sustained(hw: HardwareProfile, refill: float) -> float:
    """Requests a busy instance keeps running under its token budget per step ``T``: each
    step decodes one token of each of ``B`` requests and prefills the prompts of those that
    replace the finished ones, ``B · Ī / Ō`` tokens, so ``B (1 + Ī / Ō) ≤ T``. (Azure conv's
    1,155-token prompts and 211-token answers on an A100's 2,048: 316, above its 256 slots; in a
    stretch of longer prompts and shorter answers the batch stays near 200.) Unbounded when the
    budget is unknown."""
    budget = hw.max_num_batched_tokens
    if budget <= 0 or hw.input_token_work_s <= 0:
        return math.inf
    return max(1.0, budget / (1.0 + refill / hw.input_token_work_s))


@dataclass(frozen=True, slots=True)
class Queued:
    """A request on an instance, with the output tokens it has generated so far; ``running`` when
    it is in the engine's batch (its prompt is already processed)."""

    request: Request
    generated: int = 0
    running: bool = False


@dataclass(frozen=True, slots=True)
class EstimatorInstance:
    """An instance as the estimator sees it right now: its hardware, the models it holds and
    its engine's preemption counter."""

    name: str
    gpu: str
    gpu_count: int
    active_model: str | None
    warm_models: frozenset[str] = frozenset()
    # The engine's preemption counter (vLLM's ``vllm:num_preemptions_total``); None: not read.
    preemptions_total: int | None = None


@dataclass(frozen=True, slots=True)
class GroupLoad:
    """Aggregated work of one request group, in the order its requests will be served."""

    group_id: str
    model: str
    size: int
    earliest_deadline_s: float
    input_tokens: int  # sum over the group
    output_mean: float  # sum of the requests' expected outputs
    output_var: float  # sum of their variances
    last_output_mean: float  # the last request's expected output (Eq. 5)
    last_output_var: float
    last_input_tokens: int
    earliest_ttft_deadline_s: float = math.inf  # of the requests with a TTFT SLO (inf: none)
    first_input_tokens: int = 0  # the prompt of the request served first


@dataclass(frozen=True, slots=True)
class _GroupSums:
    """What ``group_load`` needs of a group's requests besides the beliefs: prompt tokens, the
    earliest deadline and TTFT deadline, and how many requests share each belief lookup (one
    request of each)."""

    inputs: int
    earliest: float
    lookups: tuple[tuple[Request, int], ...]
    earliest_ttft: float = math.inf


def _group_sums(requests: Sequence[Request], key: Callable[[Request], Hashable]) -> _GroupSums:
    inputs, earliest, earliest_ttft = 0, math.inf, math.inf
    counts: dict[Hashable, list[Any]] = {}
    for r in requests:
        k = key(r)
        entry = counts.get(k)
        if entry is None:
            counts[k] = [r, 1]
        else:
            entry[1] += 1
        inputs += r.input_tokens
        deadline = r.arrival_s + r.slo.e2e_s  # (Request.deadline_s)
        if deadline < earliest:
            earliest = deadline
        if r.slo.ttft_s is not None and r.arrival_s + r.slo.ttft_s < earliest_ttft:
            earliest_ttft = r.arrival_s + r.slo.ttft_s
    return _GroupSums(inputs, earliest, tuple((r, n) for r, n in counts.values()), earliest_ttft)


@dataclass(frozen=True, slots=True)
class GroupLoads:
    """``GroupLoad`` of many groups as arrays, one entry per group in the order asked
    (``RCTEstimator.group_loads``)."""

    models: tuple[str, ...]
    size: npt.NDArray[np.int64]
    earliest_deadline_s: npt.NDArray[np.float64]
    input_tokens: npt.NDArray[np.float64]
    output_mean: npt.NDArray[np.float64]
    output_var: npt.NDArray[np.float64]
    last_output_mean: npt.NDArray[np.float64]
    last_output_var: npt.NDArray[np.float64]
    last_input_tokens: npt.NDArray[np.float64]
    earliest_ttft_deadline_s: npt.NDArray[np.float64]
    first_input_tokens: npt.NDArray[np.float64]
    group_ids: tuple[str, ...] = ()

    def take(self, index: Sequence[int] | npt.NDArray[np.int64]) -> GroupLoads:
        """The groups at ``index`` (e.g. one virtual queue's, in its order)."""
        at = np.asarray(index, np.int64)
        return GroupLoads(
            models=tuple(self.models[k] for k in at.tolist()),
            size=self.size[at],
            earliest_deadline_s=self.earliest_deadline_s[at],
            input_tokens=self.input_tokens[at],
            output_mean=self.output_mean[at],
            output_var=self.output_var[at],
            last_output_mean=self.last_output_mean[at],
            last_output_var=self.last_output_var[at],
            last_input_tokens=self.last_input_tokens[at],
            earliest_ttft_deadline_s=self.earliest_ttft_deadline_s[at],
            first_input_tokens=self.first_input_tokens[at],
            group_ids=tuple(self.group_ids[k] for k in at.tolist()) if self.group_ids else (),
        )


def _as_loads(groups: Sequence[GroupLoad]) -> GroupLoads:
    """``GroupLoad``s as arrays."""
    return GroupLoads(
        models=tuple(g.model for g in groups),
        size=np.array([g.size for g in groups], np.int64),
        earliest_deadline_s=np.array([g.earliest_deadline_s for g in groups], np.float64),
        input_tokens=np.array([g.input_tokens for g in groups], np.float64),
        output_mean=np.array([g.output_mean for g in groups], np.float64),
        output_var=np.array([g.output_var for g in groups], np.float64),
        last_output_mean=np.array([g.last_output_mean for g in groups], np.float64),
        last_output_var=np.array([g.last_output_var for g in groups], np.float64),
        last_input_tokens=np.array([g.last_input_tokens for g in groups], np.float64),
        earliest_ttft_deadline_s=np.array([g.earliest_ttft_deadline_s for g in groups], np.float64),
        first_input_tokens=np.array([g.first_input_tokens for g in groups], np.float64),
        group_ids=tuple(g.group_id for g in groups),
    )


@dataclass(frozen=True, slots=True)
class _GroupRow:
    """A group's ``_GroupSums`` ready for arrays: its belief lookups as ids into the
    estimator's registry (``RCTEstimator._lookup_ids``) with their counts, and the id of its last
    request's lookup."""

    model: str
    lookups: npt.NDArray[np.int64]
    counts: npt.NDArray[np.float64]
    last: int
    values: tuple[float, ...]  # size, earliest, inputs, last input, earliest TTFT, first input


@dataclass
class _GroupTable:
    """What ``RCTEstimator.group_loads`` keeps of each group while it is unchanged, one row
    (slot) per group: its belief lookups (ids into the estimator's registry, with their counts,
    padded with count 0), its last request's lookup, its sums that do not depend on the beliefs
    (``_GroupRow.values``) and its model. A plan gathers the rows of its groups; only a group
    whose snapshot changed is written again, and an ended group's slot is reused."""

    slot_of: dict[str, int] = field(default_factory=dict)
    snapshot: list[Sequence[Request] | None] = field(default_factory=list)
    model: list[str] = field(default_factory=list)
    free: list[int] = field(default_factory=list)
    length: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    last: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    ids: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros((0, 1), np.int64))
    counts: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros((0, 1)))
    values: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros((0, 6)))

    def hit(self, gid: str, requests: Sequence[Request]) -> int | None:
        """The slot of ``gid`` if it holds this very snapshot."""
        slot = self.slot_of.get(gid)
        if slot is not None and self.snapshot[slot] is requests:
            return slot
        return None

    def put(self, gid: str, requests: Sequence[Request], row: _GroupRow) -> int:
        """Write ``gid``'s row (a list snapshot, which may change in place, is never a hit)."""
        slot = self.slot_of.get(gid)
        if slot is None:
            slot = self.free.pop() if self.free else self._grow()
            self.slot_of[gid] = slot
        n = len(row.lookups)
        if n > self.ids.shape[1]:
            wider = max(n, 2 * self.ids.shape[1])
            pad = ((0, 0), (0, wider - self.ids.shape[1]))
            self.ids = np.pad(self.ids, pad)
            self.counts = np.pad(self.counts, pad)
        self.ids[slot, :n] = row.lookups
        self.ids[slot, n:] = 0
        self.counts[slot, :n] = row.counts
        self.counts[slot, n:] = 0.0
        self.length[slot] = n
        self.last[slot] = row.last
        self.values[slot] = row.values
        self.model[slot] = row.model
        self.snapshot[slot] = requests if isinstance(requests, tuple) else None
        return slot

    def _grow(self) -> int:
        slot = len(self.snapshot)
        if slot == len(self.length):
            more = max(64, slot)
            self.length = np.concatenate((self.length, np.zeros(more, np.int64)))
            self.last = np.concatenate((self.last, np.zeros(more, np.int64)))
            self.ids = np.concatenate((self.ids, np.zeros((more, self.ids.shape[1]), np.int64)))
            self.counts = np.concatenate((self.counts, np.zeros((more, self.counts.shape[1]))))
            self.values = np.concatenate((self.values, np.zeros((more, 6))))
        self.snapshot.append(None)
        self.model.append("")
        return slot

    def drop(self, gid: str) -> None:
        slot = self.slot_of.pop(gid, None)
        if slot is not None:
            self.snapshot[slot] = None
            self.free.append(slot)

    def clear(self) -> None:
        self.slot_of.clear()
        self.free = list(range(len(self.snapshot)))[::-1]
        self.snapshot = [None] * len(self.snapshot)


@dataclass(slots=True)
class _RunningState:
    """An instance's running requests as ``RCTEstimator._running_sums`` last summed them: per
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
        dec = hw.decode_s(batch, _context(hw, batch, self.slots_of[code], self.ctx_per))
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
    _posteriors: dict[tuple[str, str], OutputBelief] = field(default_factory=dict, init=False)
    by_prompt: bool = False  # output beliefs per prompt-length bin (shape-free only)
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
    _inflight: dict[tuple[str, str, int], dict[str, int]] = field(default_factory=dict, init=False)
    # The ids whose entry in ``_inflight`` changed, in order (``_inflight_log_start``: the
    # position of its first in all there were): a queue's running requests noted before need
    # noting again only where their entry changed since (``_running_sums``).
    _inflight_log: list[str] = field(default_factory=list, init=False)
    _inflight_log_start: int = field(default=0, init=False)
    # Per instance, its running requests as ``estimate_queue`` last summed them.
    _running: dict[str, _RunningState] = field(default_factory=dict, init=False)
    _calibration: dict[str, Calibration] = field(default_factory=dict, init=False)
    _pending: dict[str, Prediction] = field(default_factory=dict, init=False)
    _moments: dict[tuple[str, str, int, int, int, int], tuple[float, float]] = field(
        default_factory=dict, init=False
    )
    _versions: dict[tuple[str, str], int] = field(default_factory=dict, init=False)
    # Classes completed since their censored belief was last built (``_censor``).
    _stale: set[tuple[str, str]] = field(default_factory=set, init=False)
    # Bumped by whatever changes a belief or forgets a running request: the scans below are
    # valid within one epoch.
    _epoch: int = field(default=0, init=False)
    # Per instance, the last queue ``estimate_requests`` scanned: a request pulled behind the
    # running ones (the agents predict every pull) rescans only what was added since.
    _scans: dict[str, _Scan] = field(default_factory=dict, init=False)
    # Per group id, its requests (the grouper's snapshot: the same tuple while the group is
    # unchanged) and their sums that do not depend on the beliefs (``group_load``).
    _group_sums: dict[str, tuple[Sequence[Request], _GroupSums]] = field(
        default_factory=dict, init=False
    )
    # The same for ``group_loads``: per group its ``_GroupRow``, and the belief lookups' ids
    # (with a request of each to look its moments up with).
    _group_rows: _GroupTable = field(default_factory=_GroupTable, init=False)
    _lookup_ids: dict[Hashable, int] = field(default_factory=dict, init=False)
    _lookup_requests: list[Request] = field(default_factory=list, init=False)
    _lookup_keys: list[tuple[str, str, int, int]] = field(default_factory=list, init=False)

    # --- output lengths --------------------------------------------------------------------------

    def posterior(self, request: Request) -> OutputBelief:
        """The output-length belief for ``request``: that of its (model, SLO class) and, with
        ``by_prompt``, of requests with prompts of about its length — completions observed, and
        requests seen running counted as censored outputs (refreshed at each completion)."""
        key = (request.model, request.slo_class)
        pooled = self._pooled(key, request.model)
        if not (self.by_prompt and isinstance(pooled, LengthHistogram)):
            return pooled
        ck = (*key, prompt_bin(request.input_tokens))
        version = self._versions.get(key, 0)
        hit = self._conditional.get(ck)
        if hit is not None and hit[0] == version:
            return hit[1]
        belief = pooled.conditioned(self._bin_counts.get(ck), POOL_STRENGTH)
        inflight = self._inflight.get(ck)
        if inflight:
            belief = belief.with_censored(np.fromiter(inflight.values(), np.float64))
        self._conditional[ck] = (version, belief)
        return belief

    def _bin(self, request: Request) -> int:
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
            for (model, slo_class, _), seen in self._inflight.items()
            if (model, slo_class) == key and seen
        ]
        if running and isinstance(post, LengthHistogram):
            self._effective[key] = post.with_censored(np.concatenate(running))
        else:
            self._effective.pop(key, None)

    def _censor_all(self) -> None:
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
        key = self._moments_key(request, generated)
        hit = self._moments.get(key)
        if hit is None:
            if len(self._moments) > 100_000:
                self._moments.clear()
            post = self.posterior(request)
            hit = self._moments[key] = post.moments(cap=request.max_tokens, generated=generated)
        return hit

    def expected_rests(self, items: Sequence[tuple[Request, int]]) -> list[float]:
        """``output_moments(request, generated)[0]`` of each (request, generated): looked up in
        the cache, the misses priced per belief at once (``_price``: the same numbers) — the
        running requests of every instance, whose tokens generated move between two plans."""
        moments = self._moments
        if len(moments) > 100_000:
            moments.clear()
        keys = [self._moments_key(r, g) for r, g in items]
        misses: dict[tuple[str, str, int, int], dict[tuple[int, int], Request]] = {}
        for (r, g), key in zip(items, keys, strict=True):
            if key not in moments:
                misses.setdefault(key[:4], {})[(key[4], g)] = r
        if misses:
            self._price(misses)
        out: list[float] = []
        for (r, g), key in zip(items, keys, strict=True):
            hit = moments.get(key)
            out.append(hit[0] if hit is not None else self.output_moments(r, g)[0])
        return out

    def _prefetch_moments(self, items: Iterable[Queued]) -> None:
        """Fill the moments cache for many (request, generated) at once: after a completion
        changes a posterior, every running request misses the cache together. Also notes the
        running ones and what they generated (the censored outputs ``observe`` counts): every
        estimate passes through here with the instance's running requests."""
        self._censor_all()
        # per belief (model, class, prompt bin, version): the (cap, generated) pairs missing
        misses: dict[tuple[str, str, int, int], dict[tuple[int, int], Request]] = {}
        moments, versions = self._moments, self._versions
        if len(moments) > 100_000:
            moments.clear()
        for item in items:
            req = item.request
            ib = self._bin(req)
            if item.running:
                self._note_running(req, ib, item.generated)
            belief = (req.model, req.slo_class, ib, versions.get((req.model, req.slo_class), 0))
            if (*belief, req.max_tokens, item.generated) not in moments:
                misses.setdefault(belief, {})[(req.max_tokens, item.generated)] = req
        self._price(misses)

    def _price(
        self, misses: dict[tuple[str, str, int, int], dict[tuple[int, int], Request]]
    ) -> None:
        """Fill the moments cache for the (cap, generated) pairs of each belief (model, class,
        prompt bin, version) that missed it: all of a shape-free belief's at once; a NIG's in
        batches of one cap (the scalar path fills those with fewer than 8)."""
        moments = self._moments
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

    def _note_running(self, req: Request, ib: int, generated: int) -> None:
        """Count ``req`` running with ``generated`` tokens (a censored output for its belief)."""
        seen = self._inflight.setdefault((req.model, req.slo_class, ib), {})
        if seen.get(req.id) != generated:
            seen[req.id] = generated
            self._logged(req.id)

    def _logged(self, request_id: str) -> None:
        """Note that ``request_id``'s entry in ``_inflight`` changed."""
        log = self._inflight_log
        if len(log) >= 100_000:  # (whoever noted before all of it notes again)
            self._inflight_log_start += len(log)
            log.clear()
        log.append(request_id)

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
        self._prefetch_moments(rest)
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
            m, v = self.output_moments(req, item.generated)
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

    def expected_output(self, request: Request) -> float:
        return self.output_moments(request)[0]

    # --- per-request estimates -------------------------------------------------------------------

    def slots(self, hw: HardwareProfile, mean_tokens: float) -> int:
        """How many requests of ``mean_tokens`` (prompt + output) the instance runs at once."""
        by_kv = hw.kv_capacity_tokens / max(mean_tokens, 1.0)
        return max(1, int(min(hw.max_num_seqs, by_kv)))

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
        # spent on the prompts that replace finishing requests (``_sustained``).
        full = int(min(slots, _sustained(hws[0], refill)))
        # KV footprint of a request over its decode (its prompt and half its output, on average).
        ctx_per = float(tokens.mean() - 0.5 * out_mean.mean())
        n_running = scan.n_running
        # Output work in the batch this mix fills (the profile's Θ is for its own requests), at
        # the KV footprint per request the running batch shows now (prompt and tokens generated
        # so far): the queue's expected outputs lag a drifting mix.
        footprint = live_ctx / n_running if n_running else ctx_per
        if len(by_model) == 1:
            factor = np.full(n, _output_work_scale(hws[0], slots, footprint))
        else:
            scales = {m: _output_work_scale(h, slots, footprint) for m, h in by_model.items()}
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
            ctx = _context(hw, batch, slots, ctx_per)
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
                    c_in = _context(hw, b_in, slots, ctx_per)
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
            post = self.posterior(req)
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
        if not requests:
            raise ValueError(f"group {group_id} is empty")
        # Requests of one group mostly share a belief: their moments are looked up once per
        # (class, prompt bin, cap), and the counts are kept while the group is unchanged (the
        # grouper hands out the same snapshot), so a plan after a completion, which moves the
        # beliefs, does not walk every waiting request again.
        hit = self._group_sums.get(group_id)
        if hit is not None and hit[0] is requests:
            sums = hit[1]
        else:
            sums = _group_sums(requests, self._lookup_key)
            if isinstance(requests, tuple):  # (a list may change in place: not kept)
                if len(self._group_sums) >= GROUP_SUMS_MAX:  # nobody called keep_group_loads
                    self._group_sums.clear()
                self._group_sums[group_id] = (requests, sums)
        o_mean = o_var = 0.0
        for r, count in sums.lookups:
            m, v = self.output_moments(r)
            o_mean += count * m
            o_var += count * v
        inputs, earliest = sums.inputs, sums.earliest
        last = requests[-1]
        lm, lv = self.output_moments(last)
        return GroupLoad(
            group_id=group_id,
            model=requests[0].model,
            size=len(requests),
            earliest_deadline_s=earliest,
            input_tokens=inputs,
            output_mean=o_mean,
            output_var=o_var,
            last_output_mean=lm,
            last_output_var=lv,
            last_input_tokens=last.input_tokens,
            earliest_ttft_deadline_s=sums.earliest_ttft,
            first_input_tokens=requests[0].input_tokens,
        )

    def _lookup_key(self, r: Request) -> tuple[str, str, int, int]:
        return (r.model, r.slo_class, self._bin(r), r.max_tokens)

    def group_loads(self, groups: Sequence[tuple[str, Sequence[Request]]]) -> GroupLoads:
        """``group_load`` of each of ``groups`` (id, requests in FCFS order), as arrays: the
        same numbers to the last bit (each group's moments summed in the same order). What a
        group's requests sum to besides the beliefs is kept while the group is unchanged (rows
        of ``_GroupTable``: a plan gathers them and writes only the groups that changed), and
        the moments are looked up once per belief, the misses priced every cap at once."""
        table = self._group_rows
        if len(self._lookup_requests) > GROUP_SUMS_MAX or len(table.slot_of) >= GROUP_SUMS_MAX:
            table.clear()  # (rows hold ids into the registry; nobody called keep_group_loads)
            self._lookup_ids.clear()
            self._lookup_requests.clear()
            self._lookup_keys.clear()
        n = len(groups)
        slots = np.empty(n, np.int64)
        for i, (gid, requests) in enumerate(groups):
            slot = table.hit(gid, requests)
            if slot is None:
                slot = table.put(gid, requests, self._group_row(gid, requests))
            slots[i] = slot
        lengths = table.length[slots]
        width = max(int(lengths.max(initial=1)), 1)
        ids = table.ids[slots, :width]
        counts = table.counts[slots, :width]
        present = np.arange(width)[None, :] < lengths[:, None]
        last = table.last[slots]
        used = np.unique(np.concatenate([ids[present], last]))
        mean = np.zeros(len(self._lookup_requests))
        var = np.zeros(len(self._lookup_requests))
        self._fill_moments(used.tolist(), mean, var)
        # (running totals along each row, as group_load adds: padding adds 0 × a moment)
        o_mean = np.cumsum(counts * mean[ids], axis=1)[:, -1] if n else np.zeros(0)
        o_var = np.cumsum(counts * var[ids], axis=1)[:, -1] if n else np.zeros(0)
        values = table.values[slots]
        models = table.model
        return GroupLoads(
            models=tuple([models[s] for s in slots.tolist()]),
            size=values[:, 0].astype(np.int64),
            earliest_deadline_s=values[:, 1],
            input_tokens=values[:, 2],
            output_mean=o_mean,
            output_var=o_var,
            last_output_mean=mean[last],
            last_output_var=var[last],
            last_input_tokens=values[:, 3],
            earliest_ttft_deadline_s=values[:, 4],
            first_input_tokens=values[:, 5],
            group_ids=tuple(gid for gid, _ in groups),
        )

    def _fill_moments(
        self, ids: list[int], mean: npt.NDArray[np.float64], var: npt.NDArray[np.float64]
    ) -> None:
        """``mean[k], var[k] = output_moments(_lookup_requests[k])`` for each of ``ids``: from
        the cache, and the misses (all of them after a completion moved a belief) priced per
        belief, every cap at once (``cap_moments``, the same numbers)."""
        moments, versions, keys = self._moments, self._versions, self._lookup_keys
        if len(moments) > 100_000:
            moments.clear()
        misses: dict[tuple[str, str, int, int], list[tuple[int, _MomentsKey]]] = {}
        beliefs: dict[tuple[str, str, int, int], LengthHistogram] = {}
        for k in ids:
            model, cls, ib, cap = keys[k]
            key = (model, cls, ib, versions.get((model, cls), 0), cap, 0)
            hit = moments.get(key)
            if hit is not None:
                mean[k], var[k] = hit
                continue
            belief = key[:4]  # (model, class, prompt bin, version): one posterior
            missed = misses.get(belief)
            if missed is None:
                post = self.posterior(self._lookup_requests[k])
                if not isinstance(post, LengthHistogram):
                    mean[k], var[k] = self.output_moments(self._lookup_requests[k])
                    continue
                beliefs[belief] = post
                missed = misses[belief] = []
            missed.append((k, key))
        for belief, ks in misses.items():
            caps = np.array([key[4] for _, key in ks], np.float64)
            means, variances = cap_moments(beliefs[belief].outputs, caps)
            for (k, key), m, v in zip(ks, means.tolist(), variances.tolist(), strict=True):
                mean[k], var[k] = m, v
                moments[key] = (m, v)

    def _moments_key(self, request: Request, generated: int = 0) -> _MomentsKey:
        """``output_moments``' cache key."""
        return (
            request.model,
            request.slo_class,
            self._bin(request),
            self._versions.get((request.model, request.slo_class), 0),
            request.max_tokens,
            generated,
        )

    def _group_row(self, gid: str, requests: Sequence[Request]) -> _GroupRow:
        if not requests:
            raise ValueError(f"group {gid} is empty")
        sums = _group_sums(requests, self._lookup_key)
        last = requests[-1]
        return _GroupRow(
            requests[0].model,
            np.array([self._lookup_id(r) for r, _ in sums.lookups], np.int64),
            np.array([float(count) for _, count in sums.lookups]),
            self._lookup_id(last),
            (
                len(requests),
                sums.earliest,
                sums.inputs,
                last.input_tokens,
                sums.earliest_ttft,
                requests[0].input_tokens,
            ),
        )

    def _lookup_id(self, r: Request) -> int:
        """The id of ``r``'s belief lookup (its moments with nothing generated yet)."""
        key = self._lookup_key(r)
        k = self._lookup_ids.get(key)
        if k is None:
            k = self._lookup_ids[key] = len(self._lookup_requests)
            self._lookup_requests.append(r)
            self._lookup_keys.append(key)
        return k

    def keep_group_loads(self, group_ids: Iterable[str]) -> None:
        """Forget the sums of groups not in ``group_ids`` (those that ended): a planner calls
        it with the groups it plans, so that what ``group_load`` keeps stays that size."""
        keep = set(group_ids)
        for gid in [g for g in self._group_sums if g not in keep]:
            del self._group_sums[gid]
        for gid in [g for g in self._group_rows.slot_of if g not in keep]:
            self._group_rows.drop(gid)

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
        self._reprice_kept(queues)
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
        tokens, remaining_running, mix_prompt, mix_output = self._running_sums(instance, running)
        loads = groups if isinstance(groups, GroupLoads) else _as_loads(groups)
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
        full = [int(min(s, _sustained(hw, refill))) for s, hw in zip(slots, hws, strict=True)]
        theta = [
            hw.throughput_tps / _output_work_scale(hw, s, footprint)
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

    def _running_sums(
        self, instance: EstimatorInstance, running: Sequence[Queued]
    ) -> tuple[float, float, float, float]:
        """Over the running requests of ``instance``, added in their order: tokens (prompt,
        generated and expected rest), the expected rest alone, prompt work and output tokens
        (generated and expected rest). Notes each running request and what it generated (the
        censored outputs ``observe`` counts), as ``_prefetch_moments`` does. The same requests
        as the last time (the same ``Queued`` objects, in order) are summed from what was kept
        of them (``_RunningState``): the same numbers."""
        if not running:
            return 0.0, 0.0, 0.0, 0.0
        self._censor_all()
        state = self._kept(instance, running)
        if state is None or not self._kept_sums(state):
            state = self._running[instance.name] = self._walk_running(
                instance, running, self._running_signature(instance)
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

    def _running_signature(self, instance: EstimatorInstance) -> tuple[Any, ...]:
        return (id(self.profile), self.by_prompt, instance.gpu, instance.gpu_count)

    def _kept(self, instance: EstimatorInstance, running: Sequence[Queued]) -> _RunningState | None:
        """What is kept of ``instance``'s running requests if they are the same as then."""
        state = self._running.get(instance.name)
        if (
            state is None
            or state.signature != self._running_signature(instance)
            or len(state.items) != len(running)
            or not all(map(operator.is_, state.items, running))
        ):
            return None
        return state

    def _reprice_kept(
        self, queues: Sequence[tuple[EstimatorInstance, Any, Sequence[Queued]]]
    ) -> None:
        """Before ``estimate_queues`` sums each queue's running requests: the pairs of every
        belief that moved, over every queue whose running requests are kept, priced in one
        ``pair_moments`` call per belief (not one per queue). Without ``by_prompt`` only: the
        class-wide belief a version prices is the same whichever queue reads it first (with it,
        a prompt bin's is built when first read, from the running requests noted by then)."""
        if self.by_prompt or not any(running for _, _, running in queues):
            return
        self._censor_all()  # (as the first queue with running requests would)
        stale: dict[tuple[str, str, int, int], list[tuple[_RunningState, int]]] = {}
        for instance, _, running in queues:
            state = self._kept(instance, running) if running else None
            if state is None:
                continue
            self._renote(state)
            for b, (m, c, ib) in enumerate(state.beliefs):
                version = self._versions.get((m, c), 0)
                if version != state.versions[b]:
                    stale.setdefault((m, c, ib, version), []).append((state, b))
        for (_, _, _, version), users in stale.items():
            first, b0 = users[0]
            post = self.posterior(first.belief_request[b0])
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

    def _renote(self, state: _RunningState) -> None:
        """Note again the requests of ``state`` whose entry in ``_inflight`` changed since."""
        log, start = self._inflight_log, self._inflight_log_start
        changed = (
            range(len(state.items))
            if state.noted < start
            else [state.position[r] for r in log[state.noted - start :] if r in state.position]
        )
        for k in changed:
            item = state.items[k]
            if item.running:
                self._note_running(item.request, self._bin(item.request), item.generated)
        state.noted = self._inflight_log_start + len(self._inflight_log)

    def _kept_sums(self, state: _RunningState) -> bool:
        """Bring what ``state`` keeps up to date: note again the requests whose entry in
        ``_inflight`` changed since, price again the pairs of the beliefs that moved. False if a
        belief is not shape-free (walk the requests instead)."""
        self._renote(state)
        versions = tuple(self._versions.get((m, c), 0) for m, c, _ in state.beliefs)
        if versions == state.versions:
            return True
        for b, version in enumerate(versions):
            if version == state.versions[b]:
                continue
            post = self.posterior(state.belief_request[b])
            if not isinstance(post, LengthHistogram):
                return False
            at = np.flatnonzero(state.pair_belief == b)
            means, _ = pair_moments(post.outputs, state.pair_cap[at], state.pair_gen[at])
            state.pair_mean[at] = means
        state.versions = versions
        return True

    def _walk_running(
        self, instance: EstimatorInstance, running: Sequence[Queued], signature: tuple[Any, ...]
    ) -> _RunningState:
        """``_RunningState`` of ``running``, walking every request: notes the running ones and
        looks their moments up, the misses priced per belief at once."""
        moments, inflight, by_prompt = self._moments, self._inflight, self.by_prompt
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
        misses: dict[tuple[str, str, int, int], dict[tuple[int, int], Request]] = {}
        for k, item in enumerate(running):
            req = item.request
            model, cls, gen = req.model, req.slo_class, item.generated
            known = classes.get((model, cls))
            if known is None:
                hw = self.profile.hardware_for(model, instance.gpu, instance.gpu_count)
                known = classes[(model, cls)] = (
                    self._versions.get((model, cls), 0),
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
                    self._logged(req.id)
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
            self._price(misses)
        beliefs = list(belief_of)
        versions = tuple(self._versions.get((m, c), 0) for m, c, _ in beliefs)
        pair_mean = np.empty(len(pairs))
        for p, (b, cap, gen) in enumerate(pairs):
            m, c, ib = beliefs[b]
            hit = moments.get((m, c, ib, versions[b], cap, gen))
            pair_mean[p] = (
                hit[0] if hit is not None else self.output_moments(pair_request[p], gen)[0]
            )
        table = np.array(pairs, np.int64).reshape(-1, 3)
        return _RunningState(
            items=tuple(running),
            signature=signature,
            position=position,
            noted=self._inflight_log_start + len(self._inflight_log),
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
        key = (request.model, request.slo_class)
        ck = (*key, self._bin(request))
        self._epoch += 1
        if key not in self._posteriors:  # the prior, on the first observation
            self._pooled(key, request.model)
        post = self._posteriors[key] = self._posteriors[key].update(output_tokens)
        if self._inflight.get(ck, {}).pop(request.id, None) is not None:
            self._logged(request.id)
        if isinstance(post, LengthHistogram):
            counts = self._bin_counts.get(ck)
            if counts is None:
                counts = self._bin_counts[ck] = np.zeros(HIST_BINS)
            counts[length_bin(output_tokens)] += 1.0
            # The belief with the running requests censored is rebuilt when next read (not at
            # each of the many completions a step may bring: one rebuild reads them all).
            self._stale.add(key)
        self._versions[key] = self._versions.get(key, 0) + 1
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
        self._censor_all()
        for rid in request_ids:
            self._pending.pop(rid, None)
            for inflight in self._inflight.values():
                if inflight.pop(rid, None) is not None:
                    self._epoch += 1  # a scan noted it running: scan again
                    self._logged(rid)
