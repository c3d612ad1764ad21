"""A simulated vLLM instance: a discrete-event model of one ``vllm serve`` process.

What it models, after vLLM V1's scheduler (``vllm/v1/core/sched/scheduler.py``):

* **Continuous batching, iteration-level scheduling.** Each iteration first schedules the running
  requests in order (one token per decode, or the next chunk of a prefill), then admits waiting
  requests first-come-first-served while the per-iteration token budget
  (``max_num_batched_tokens``) and ``max_num_seqs`` allow. Prompts longer than the remaining budget
  are prefilled in chunks (chunked prefill). A waiting request that cannot be admitted blocks the
  ones behind it (FCFS: head-of-line).
* **Paged KV cache.** Capacity in blocks of ``block_size`` tokens, sized from GPU memory, the model's
  weights and its KV bytes per token. When a running request cannot get a block for its next token,
  the newest running request is preempted: its blocks are freed, it goes back to the front of the
  waiting queue, and it later recomputes prompt + generated tokens (vLLM V1 recompute preemption).
  No waiting request is admitted in an iteration that preempted.
* **Step time** from a fitted ``PerfModel`` (``perf_model.py``) as a function of the batch.
* **Abort** returns the tokens generated so far. **KV swap** moves a running request's cache to CPU
  memory over the host link and back. **Model tiers**: one model active on the GPU, others warm in
  CPU memory (vLLM sleep level 1) or cold on disk; switching waits for the running batch to drain
  and costs the warm or cold load time.

Time: the engine never reads a clock. Every call takes ``now``; ``next_event_time()`` says when it
next needs ``advance(now)``. A virtual-clock simulator calls it at exactly that time, a wall-clock
driver sleeps until then; the engine behaves the same.

Speed: a run of decode-only iterations in which nothing can change (no prefill, no admissible
waiting request, no pending operation) is computed in closed form as one *macro step*: decode
iteration ``i`` lasts ``d0 + per_ctx_token_ms * B * i`` because each of the ``B`` sequences adds one
token of context (with a measured table, ``d0`` each). Anything that arrives meanwhile (a submit,
an abort, a swap) cuts the macro step at the iteration in progress, so results are those of
stepping one iteration at a time (``tests/unit/engines/test_sim_engine.py`` checks it).
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

from qlm.domain import ModelTier
from qlm.engines.base import EngineEvent, EngineRequest, EngineStats, EventKind
from qlm.engines.perf_model import GB, PerfModel, prefill_pairs
from qlm.errors import ConfigError, EngineError, RequestRejected, UnknownRequest, check_setting


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    """vLLM engine arguments the simulation honours (names as ``vllm serve`` flags).

    ``max_num_seqs`` and ``max_num_batched_tokens`` default to vLLM's online-serving defaults for
    the GPU (see ``for_gpu``). ``model_switching``: ``fcfs`` switches models on its own when the
    oldest waiting request is for another model (several vLLM servers sharing a GPU, served in
    arrival order); ``explicit`` only switches on ``set_model_tier(..., ACTIVE)`` (an agent decides)
    and meanwhile serves the active model's requests, skipping the others. ``fuse_decode=False``
    steps every iteration (the reference the fused runs are tested against). ``max_macro_steps``
    caps how many decode iterations are fused into one event: leave it unset in virtual time, set
    it small on the wall clock to stream tokens steadily.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    activation_gb: float = 1.0
    swap_space_gb: float = 64.0
    cpu_model_cache_gb: float = 256.0
    max_macro_steps: int | None = None
    fuse_decode: bool = True
    model_switching: Literal["fcfs", "explicit"] = "fcfs"
    emit_token_events: bool = False
    kv_capacity_tokens: int | None = None

    def __post_init__(self) -> None:
        rules = (
            ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, ">= 1"),
            ("block_size", self.block_size >= 1, ">= 1"),
            ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]"),
            ("activation_gb", self.activation_gb >= 0, ">= 0"),
            ("swap_space_gb", self.swap_space_gb >= 0, ">= 0"),
            ("cpu_model_cache_gb", self.cpu_model_cache_gb >= 0, ">= 0"),
            (
                "max_macro_steps",
                self.max_macro_steps is None or self.max_macro_steps >= 1,
                ">= 1 or unset",
            ),
        )
        for name, ok, rule in rules:
            check_setting(ok, f"sim engine setting {name}", rule, getattr(self, name))

    @classmethod
    def for_gpu(
        cls, gpu_memory_gb: float, gpu_name: str = "", **overrides: object
    ) -> SimEngineConfig:
        """vLLM V1's online-serving defaults (``get_batch_defaults``): GPUs with >= 70 GiB get 1024
        sequences and an 8192-token budget per iteration — except A100s (vLLM PR #17885) — and
        the others 256 and 2048."""
        big = gpu_memory_gb * GB >= 70 * 1024**3 and "a100" not in gpu_name.lower()
        base: dict[str, object] = {
            "max_num_seqs": 1024 if big else 256,
            "max_num_batched_tokens": 8192 if big else 2048,
        }
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]


class _Seq:
    """Mutable state of one request inside the engine."""

    __slots__ = (
        "arrival",
        "blocks",
        "computed",
        "first_token_s",
        "generated",
        "model",
        "preemptions",
        "prompt",
        "rid",
        "scheduled",
        "target",
    )

    def __init__(self, req: EngineRequest, now: float) -> None:
        self.rid = req.request_id
        self.model = req.model
        self.prompt = req.prompt_tokens
        self.target = req.tokens_to_generate
        self.generated = 0
        self.computed = 0
        self.blocks = 0
        self.arrival = now
        self.first_token_s: float | None = None
        self.preemptions = 0
        self.scheduled = False

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.generated


@dataclass(slots=True)
class _Step:
    """The iteration (or fused run of decode iterations) in flight."""

    start: float
    end: float
    work: list[tuple[_Seq, int]]  # (sequence, tokens computed for it in this iteration)
    macro_k: int = 0  # > 0: ``macro_k`` fused decode iterations over ``work``
    d0_s: float = 0.0
    slope_s: float = 0.0

    def macro_elapsed(self, j: int) -> float:
        """Time of the first ``j`` fused iterations."""
        return j * self.d0_s + self.slope_s * j * (j - 1) / 2


class SimEngine:
    """One simulated instance serving ``models`` on one GPU type (see the module docstring)."""

    def __init__(
        self,
        name: str,
        perf_models: dict[str, PerfModel],
        config: SimEngineConfig | None = None,
        *,
        initial_tiers: dict[str, ModelTier] | None = None,
    ) -> None:
        if not perf_models:
            raise ConfigError(f"instance {name!r}: a simulated engine needs at least one model")
        self.name = name
        self.perf_models = dict(perf_models)
        first = next(iter(self.perf_models.values()))
        self.config = config or SimEngineConfig.for_gpu(first.gpu.memory_gb, first.gpu.name)
        self._capacity_blocks = {
            model: self._blocks_for(self._capacity_tokens(pm)) for model, pm in perf_models.items()
        }
        self.tiers = self._initial_tiers(initial_tiers)
        self.active_model: str | None = next(
            (m for m, t in self.tiers.items() if t is ModelTier.ACTIVE), None
        )
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.swapped: dict[str, _Seq] = {}
        self._by_id: dict[str, _Seq] = {}
        self._free_blocks = self._capacity_blocks[self.active_model] if self.active_model else 0
        self._swap_out_pending: list[_Seq] = []
        self._swap_in_pending: list[_Seq] = []
        self._switch_to: str | None = None
        self._step: _Step | None = None
        self._loading: tuple[str, float] | None = None  # (model, ready time)
        self._wake_at: float | None = None
        self.preemptions_total = 0
        self.steps_total = 0
        self._fractions: dict[tuple[str, int], float] = {}  # ``_memory_fraction``
        self.model_switches = 0

    def swap_free_gb(self) -> float:
        """CPU swap space left for KV caches."""
        return self._swap_free_gb()

    def token_capacity(self, model: str | None = None) -> int:
        """KV cache capacity in tokens for ``model`` (default: the smallest over its models)."""
        if model is not None:
            return self._capacity_blocks[model] * self.config.block_size
        return min(self._capacity_blocks.values()) * self.config.block_size

    # --- construction helpers ------------------------------------------------------------------

    def _capacity_tokens(self, pm: PerfModel) -> int:
        if self.config.kv_capacity_tokens is not None:
            return self.config.kv_capacity_tokens
        return pm.kv_capacity_tokens(
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            activation_gb=self.config.activation_gb,
        )

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _initial_tiers(self, given: dict[str, ModelTier] | None) -> dict[str, ModelTier]:
        models = list(self.perf_models)
        if given is not None:
            unknown = set(given) - set(models)
            if unknown:
                raise ConfigError(f"instance {self.name!r}: tiers name unknown models {unknown}")
            tiers = {m: given.get(m, ModelTier.COLD) for m in models}
            if sum(t is ModelTier.ACTIVE for t in tiers.values()) > 1:
                raise ConfigError(f"instance {self.name!r}: only one model can be active")
        else:
            # The first model is loaded; the others are warm while the CPU budget lasts.
            tiers = {models[0]: ModelTier.ACTIVE}
            budget = self.config.cpu_model_cache_gb
            for m in models[1:]:
                weights = self.perf_models[m].model.weights_gb
                tiers[m] = ModelTier.WARM if weights <= budget else ModelTier.COLD
                budget -= weights if tiers[m] is ModelTier.WARM else 0
        return tiers

    # --- the engine seam -------------------------------------------------------------------------

    def submit(self, req: EngineRequest, now: float) -> None:
        """Queue a request (FCFS). It joins the batch at the next iteration boundary."""
        if req.request_id in self._by_id:
            raise EngineError(f"{self.name}: request {req.request_id!r} is already in the engine")
        pm = self.perf_models.get(req.model)
        if pm is None:
            raise RequestRejected(
                f"{self.name}: model {req.model!r} is not served here "
                f"(serves {', '.join(self.perf_models)})"
            )
        total = req.prompt_tokens + req.tokens_to_generate
        if total > pm.model.max_context:
            raise RequestRejected(
                f"{self.name}: request {req.request_id!r} needs {total} tokens, more than "
                f"{req.model}'s max context {pm.model.max_context}"
            )
        if self._blocks_for(total) > self._capacity_blocks[req.model]:
            raise RequestRejected(
                f"{self.name}: request {req.request_id!r} needs {total} tokens of KV cache, more "
                f"than the instance holds"
            )
        self._sync(now)
        seq = _Seq(req, now)
        self._by_id[seq.rid] = seq
        self.waiting.append(seq)
        self._kick(now)

    def abort(self, request_id: str, now: float) -> int:
        """Remove a request wherever it is; return the output tokens it had generated by ``now``."""
        seq = self._by_id.get(request_id)
        if seq is None:
            raise UnknownRequest(f"{self.name}: no request {request_id!r}")
        self._sync(now)
        step = self._step
        if step is not None:
            # Iterations of this step that ended by ``now`` count; the one in progress is lost.
            for i, (other, _) in enumerate(step.work):
                if other is seq:
                    if step.macro_k:
                        self._advance_fused(seq, self._macro_steps_done(step, now))
                    del step.work[i]
                    break
        self._forget(seq)
        self._kick(now)
        return seq.generated

    def swap_out(self, request_id: str, now: float) -> None:
        """Move a running request's KV cache to CPU memory at the next iteration boundary."""
        seq = self._require(request_id)
        if seq not in self.running:
            raise EngineError(
                f"{self.name}: request {request_id!r} is not running; cannot swap out"
            )
        need_gb = seq.computed * self.perf_models[seq.model].model.kv_bytes_per_token / GB
        if need_gb > self._swap_free_gb():
            raise EngineError(f"{self.name}: swap space full; cannot swap out {request_id!r}")
        self._sync(now)
        if seq not in self._swap_out_pending:
            self._swap_out_pending.append(seq)
        self._kick(now)

    def swap_in(self, request_id: str, now: float) -> None:
        """Bring a swapped-out request back; it resumes as soon as its blocks fit. A swap-out
        still waiting for the iteration boundary is cancelled instead (it never left)."""
        seq = self._require(request_id)
        if seq in self._swap_out_pending:
            self._sync(now)
            if seq in self._swap_out_pending:
                self._swap_out_pending.remove(seq)
                self._kick(now)
                return
        if seq.rid not in self.swapped:
            raise EngineError(f"{self.name}: request {request_id!r} is not swapped out")
        if seq.model != self.active_model:
            raise EngineError(
                f"{self.name}: cannot swap in {request_id!r}: its model {seq.model!r} is not active"
            )
        self._sync(now)
        if seq not in self._swap_in_pending:
            self._swap_in_pending.append(seq)
        self._kick(now)

    def set_model_tier(self, model: str, tier: ModelTier, now: float) -> None:
        """Warm start / offload / drop a model.

        ``ACTIVE`` switches to it once the running batch has drained (no new request of another model
        is admitted meanwhile). ``WARM`` keeps its weights in CPU memory (the load from disk happens
        in the background and is not modelled as GPU time); ``COLD`` drops them.
        """
        if model not in self.perf_models:
            raise EngineError(f"{self.name}: model {model!r} is not served here")
        self._sync(now)
        if tier is ModelTier.ACTIVE:
            self._switch_to = None if model == self.active_model else model
        elif model == self.active_model:
            raise EngineError(f"{self.name}: cannot offload the active model {model!r}")
        elif tier is ModelTier.WARM and self.tiers[model] is ModelTier.COLD:
            if self.perf_models[model].model.weights_gb > self._cpu_cache_free_gb():
                raise EngineError(f"{self.name}: CPU model cache full; cannot warm {model!r}")
            self.tiers[model] = ModelTier.WARM
        else:
            self.tiers[model] = tier
        self._kick(now)

    def next_event_time(self) -> float | None:
        """When the engine next needs ``advance``: the end of the step or load in flight, or, when
        idle with new work, the time that work arrived (requests submitted at the same instant
        are scheduled together, as vLLM batches requests that arrive before its next step)."""
        if self._loading is not None:
            return self._loading[1]
        if self._step is not None:
            return self._step.end
        return self._wake_at

    def advance(self, now: float) -> list[EngineEvent]:
        """Finish every step and load that ends by ``now``; start the next ones. Returns events."""
        events: list[EngineEvent] = []
        while True:
            t = self.next_event_time()
            if t is None or t > now:
                break
            if self._loading is not None:
                events.extend(self._finish_load())
            elif self._step is not None:
                events.extend(self._finish_step())
            else:
                self._wake_at = None
            self._start_next(t, events)
        return events

    def _used_blocks(self, now: float | None) -> int:
        if self.active_model is None:
            return 0
        used = self._capacity_blocks[self.active_model] - self._free_blocks
        done, _ = self._fused_done(now)
        if done and self._step is not None:
            for seq, _ in self._step.work:
                used += max(0, self._blocks_for(seq.computed + done) - seq.blocks)
        return used

    def stats(self, now: float | None = None) -> EngineStats:
        """Load at ``now`` (default: as of the last iteration boundary)."""
        cap_blocks = self._capacity_blocks[self.active_model] if self.active_model else 0
        used_blocks = self._used_blocks(now)
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting),
            swapped=len(self.swapped),
            kv_used_tokens=used_blocks * self.config.block_size,
            kv_capacity_tokens=cap_blocks * self.config.block_size,
            active_model=self.active_model,
            model_tiers=tuple(self.tiers.items()),
            preemptions_total=self.preemptions_total,
            gpu_memory_used_fraction=self._memory_fraction(used_blocks),
            swap_free_gb=self._swap_free_gb(),
        )

    def gpu_memory_used_fraction(self, now: float | None = None) -> float:
        """Weights of the active model plus the KV blocks in use, over the GPUs' memory."""
        if now is None and self.active_model is not None:  # as of the last iteration boundary
            return self._memory_fraction(
                self._capacity_blocks[self.active_model] - self._free_blocks
            )
        return self._memory_fraction(self._used_blocks(now))

    def _fused_done(self, now: float | None) -> tuple[int, set[int]]:
        """Iterations of the fused run in flight that have ended by ``now``, and who runs them."""
        step = self._step
        if now is None or step is None or not step.macro_k:
            return 0, set()
        return self._macro_steps_done(step, now), {id(seq) for seq, _ in step.work}

    def queue_view(self, now: float | None = None) -> tuple[tuple[str, int, bool], ...]:
        """Every request in service order — the running batch, then the waiting queue (FCFS),
        then swapped-out ones — as (request id, output tokens generated by ``now``, running)."""
        done, fused = self._fused_done(now)
        running = tuple(
            (s.rid, s.generated + (done if id(s) in fused else 0), True) for s in self.running
        )
        waiting = tuple((s.rid, s.generated, False) for s in self.waiting)
        swapped = tuple((s.rid, s.generated, False) for s in self.swapped.values())
        return running + waiting + swapped

    def has_request(self, request_id: str) -> bool:
        return request_id in self._by_id

    def generated_tokens(self, request_id: str, now: float | None = None) -> int:
        """Output tokens generated by ``now`` (default: as of the last iteration boundary)."""
        seq = self._require(request_id)
        done, fused = self._fused_done(now)
        return seq.generated + (done if id(seq) in fused else 0)

    @property
    def idle(self) -> bool:
        return self._step is None and self._loading is None and self._wake_at is None

    # --- internals -------------------------------------------------------------------------------

    def _require(self, request_id: str) -> _Seq:
        seq = self._by_id.get(request_id)
        if seq is None:
            raise UnknownRequest(f"{self.name}: no request {request_id!r}")
        return seq

    def _memory_fraction(self, used_blocks: int) -> float:
        if self.active_model is None:
            return 0.0
        # The simulator reads it at every event: remembered per (model, blocks in use).
        key = (self.active_model, used_blocks)
        fraction = self._fractions.get(key)
        if fraction is None:
            pm = self.perf_models[self.active_model]
            total = pm.gpu.memory_gb * pm.gpu_count
            kv_gb = used_blocks * self.config.block_size * pm.model.kv_bytes_per_token / GB
            fraction = self._fractions[key] = min(1.0, (pm.model.weights_gb + kv_gb) / total)
        return fraction

    def _swap_free_gb(self) -> float:
        if not self.swapped and not self._swap_out_pending:
            return self.config.swap_space_gb - 0 / GB
        used = sum(
            s.computed * self.perf_models[s.model].model.kv_bytes_per_token
            for s in (*self.swapped.values(), *self._swap_out_pending)
        )
        return self.config.swap_space_gb - used / GB

    def _cpu_cache_free_gb(self) -> float:
        used = sum(
            self.perf_models[m].model.weights_gb
            for m, t in self.tiers.items()
            if t is ModelTier.WARM
        )
        return self.config.cpu_model_cache_gb - used

    def _forget(self, seq: _Seq) -> None:
        del self._by_id[seq.rid]
        if seq in self.running:
            self.running.remove(seq)
            self._free_blocks += seq.blocks
        elif seq.rid in self.swapped:
            del self.swapped[seq.rid]
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
            self._free_blocks += seq.blocks
        seq.blocks = 0
        for pending in (self._swap_in_pending, self._swap_out_pending):
            if seq in pending:
                pending.remove(seq)

    def _macro_steps_done(self, step: _Step, now: float) -> int:
        """How many fused iterations of ``step`` have ended by ``now``."""
        elapsed = now - step.start
        if elapsed <= 0:
            return 0
        a, b = step.slope_s / 2, step.d0_s - step.slope_s / 2
        if a > 0:
            j = int((-b + math.sqrt(b * b + 4 * a * elapsed)) / (2 * a))
        else:
            j = int(elapsed / step.d0_s)
        # Correct the float estimate so that elapsed(j) <= now < elapsed(j + 1).
        while j > 0 and step.macro_elapsed(j) > elapsed:
            j -= 1
        while j + 1 <= step.macro_k and step.macro_elapsed(j + 1) <= elapsed:
            j += 1
        return min(j, step.macro_k)

    def _advance_fused(self, seq: _Seq, k: int) -> None:
        """Apply ``k`` fused decode iterations to ``seq``: tokens and their KV blocks."""
        seq.computed += k
        seq.generated += k
        need = self._blocks_for(seq.computed) - seq.blocks
        if need > 0:
            self._free_blocks -= need
            seq.blocks += need

    def _sync(self, now: float) -> None:
        """Every operation happens at ``now``: the caller must have advanced the engine that far
        (events that end before ``now`` would otherwise be applied after the operation)."""
        t = self.next_event_time()
        if t is not None and t < now:
            raise EngineError(
                f"{self.name}: operation at t={now:.6f} but the engine has work ending at "
                f"t={t:.6f}; call advance({now:.6f}) first"
            )
        self._cut(now)

    def _cut(self, now: float) -> None:
        """Something changes at ``now``: end a fused decode run at the iteration in progress."""
        step = self._step
        if step is None or not step.macro_k or now >= step.end:
            return
        keep = self._macro_steps_done(step, now) + 1
        if keep < step.macro_k:
            step.macro_k = keep
            step.end = step.start + step.macro_elapsed(keep)

    def _kick(self, now: float) -> None:
        """An idle engine has new work: it runs its scheduler at ``now`` (in ``advance``)."""
        if self._step is None and self._loading is None and self._wake_at is None:
            self._wake_at = now

    def _finish_load(self) -> list[EngineEvent]:
        assert self._loading is not None
        model, ready = self._loading
        self._loading = None
        self.active_model = model
        self.tiers[model] = ModelTier.ACTIVE
        self._free_blocks = self._capacity_blocks[model]
        return [EngineEvent(EventKind.MODEL_READY, ready, model=model)]

    def _finish_step(self) -> list[EngineEvent]:
        step = self._step
        assert step is not None
        self._step = None
        events: list[EngineEvent] = []
        t = step.end
        if step.macro_k:
            k = step.macro_k
            self.steps_total += k
            bs, emit = self.config.block_size, self.config.emit_token_events
            for seq, _ in step.work:
                # ``_advance_fused``, inline: this runs for every request of every fused run
                seq.computed += k
                seq.generated += k
                need = -(-seq.computed // bs) - seq.blocks
                if need > 0:
                    self._free_blocks -= need
                    seq.blocks += need
                if emit:
                    events.append(EngineEvent(EventKind.TOKENS, t, seq.rid, seq.generated))
                if seq.generated >= seq.target:
                    self._complete(seq, t, events)
            return events
        self.steps_total += 1
        for seq, n in step.work:
            seq.computed += n
            if seq.computed < seq.num_tokens:
                continue  # a prefill chunk that is not the last one samples no token
            seq.generated += 1
            if seq.first_token_s is None:
                seq.first_token_s = t
                events.append(EngineEvent(EventKind.FIRST_TOKEN, t, seq.rid, seq.generated))
            elif self.config.emit_token_events:
                events.append(EngineEvent(EventKind.TOKENS, t, seq.rid, seq.generated))
            if seq.generated >= seq.target:
                self._complete(seq, t, events)
        return events

    def _complete(self, seq: _Seq, t: float, events: list[EngineEvent]) -> None:
        for pending in (self._swap_in_pending, self._swap_out_pending):
            if seq in pending:
                pending.remove(seq)
        self.running.remove(seq)
        self._free_blocks += seq.blocks
        seq.blocks = 0
        del self._by_id[seq.rid]
        events.append(EngineEvent(EventKind.FINISHED, t, seq.rid, seq.generated))

    def _start_next(self, now: float, events: list[EngineEvent]) -> None:
        """Decide what the engine does from ``now``: a model load, an iteration, or nothing."""
        if self._loading is not None or self._step is not None:
            return
        target = self._switch_target()
        if target is not None and not self.running:
            self._begin_load(target, now)
            return
        self._schedule(now, events)

    def _admission_head(self) -> _Seq | None:
        """The next waiting request to admit. FCFS across models: the oldest, if it is for the
        active model (else nobody: the engine drains and switches). Explicit switching: the oldest
        request of the active model (the others wait for their model to be activated)."""
        if self.config.model_switching == "fcfs":
            if self.waiting and self.waiting[0].model == self.active_model:
                return self.waiting[0]
            return None
        return next((s for s in self.waiting if s.model == self.active_model), None)

    def _switch_target(self) -> str | None:
        if self._switch_to is not None and self._switch_to != self.active_model:
            return self._switch_to
        self._switch_to = None
        # FCFS across models: when the oldest waiting request is for another model, drain and switch.
        if (
            self.config.model_switching == "fcfs"
            and self.waiting
            and self.waiting[0].model != self.active_model
        ):
            return self.waiting[0].model
        return None

    def _begin_load(self, model: str, now: float) -> None:
        pm = self.perf_models[model]
        load_s = pm.warm_load_s if self.tiers[model] is ModelTier.WARM else pm.cold_load_s
        old = self.active_model
        self.tiers[model] = ModelTier.ACTIVE  # waking frees its CPU copy (sleep level 1)
        if old is not None:
            # vLLM sleep level 1: weights to CPU memory (if it has room), KV cache discarded.
            self.tiers[old] = ModelTier.COLD
            if self.perf_models[old].model.weights_gb <= self._cpu_cache_free_gb():
                self.tiers[old] = ModelTier.WARM
        self.active_model = None
        self._free_blocks = 0
        self._switch_to = None
        self.model_switches += 1
        self._loading = (model, now + load_s)

    def _schedule(self, now: float, events: list[EngineEvent]) -> None:
        """One scheduler pass (vLLM V1 ``schedule()``); sets ``self._step`` or leaves it idle."""
        model = self.active_model
        if model is None:
            return
        pm = self.perf_models[model]
        cfg = self.config
        extra_s = 0.0
        for seq in self._swap_out_pending:
            extra_s += pm.kv_transfer_s(seq.computed)
            self.running.remove(seq)
            self._free_blocks += seq.blocks
            seq.blocks = 0
            self.swapped[seq.rid] = seq
            events.append(EngineEvent(EventKind.SWAPPED_OUT, now, seq.rid, seq.generated))
        self._swap_out_pending.clear()

        if self._can_fuse():
            k = self._fuse_length()
            if k >= 1:
                self._start_macro(now, extra_s, k)
                return

        budget = cfg.max_num_batched_tokens
        bs = cfg.block_size
        work: list[tuple[_Seq, int]] = []
        preempted = False
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            n = min(seq.prompt + seq.generated - seq.computed, budget)
            if n <= 0:
                i += 1
                continue
            need = max(0, -(-(seq.computed + n) // bs) - seq.blocks)
            while need > self._free_blocks:
                victim = self.running.pop()
                self._preempt(victim, now, events)
                preempted = True
                if victim is seq:
                    break
            else:
                self._free_blocks -= need
                seq.blocks += need
                work.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: nothing behind it remains

        if not preempted:
            for seq in list(self._swap_in_pending):
                if seq.model != model or len(self.running) >= cfg.max_num_seqs:
                    continue
                need = self._blocks_for(seq.computed)
                if need > self._free_blocks:
                    break
                self._free_blocks -= need
                seq.blocks = need
                extra_s += pm.kv_transfer_s(seq.computed)
                self._swap_in_pending.remove(seq)
                del self.swapped[seq.rid]
                self.running.append(seq)
                events.append(EngineEvent(EventKind.SWAPPED_IN, now, seq.rid, seq.generated))
            block_others = self._switch_to is not None
            while budget > 0 and len(self.running) < cfg.max_num_seqs and not block_others:
                head = self._admission_head()
                if head is None:
                    break
                seq = head
                n = min(seq.num_tokens - seq.computed, budget)
                need = self._blocks_for(seq.computed + n) - seq.blocks
                if need > self._free_blocks:
                    break
                self.waiting.remove(seq)
                self._free_blocks -= need
                seq.blocks += need
                self.running.append(seq)
                work.append((seq, n))
                budget -= n
                if not seq.scheduled:
                    seq.scheduled = True
                    events.append(EngineEvent(EventKind.SCHEDULED, now, seq.rid, seq.generated))

        if not work:
            if extra_s > 0 or preempted:  # only swaps or preemptions: the engine goes on
                self._step = _Step(start=now, end=now + extra_s, work=[])
            return
        n_tokens = decode_ctx = 0
        pairs = 0.0
        for seq, n in work:
            n_tokens += n
            if n == 1 and seq.computed >= seq.prompt:
                decode_ctx += seq.computed + 1
            else:
                pairs += prefill_pairs(n, seq.computed)
        ms = pm.step.step_ms(
            n_scheduled=len(work), n_tokens=n_tokens, decode_ctx=decode_ctx, prefill_pairs=pairs
        )
        self._step = _Step(start=now, end=now + extra_s + ms / 1000.0, work=work)

    def _preempt(self, seq: _Seq, now: float, events: list[EngineEvent]) -> None:
        self._free_blocks += seq.blocks
        seq.blocks = 0
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions_total += 1
        self.waiting.appendleft(seq)
        events.append(EngineEvent(EventKind.PREEMPTED, now, seq.rid, seq.generated))

    def _can_fuse(self) -> bool:
        """True when the next iterations are decode-only and nothing can join them."""
        if not self.config.fuse_decode:
            return False
        if not self.running or self._swap_in_pending or self._switch_to is not None:
            return False
        if len(self.running) > self.config.max_num_batched_tokens:
            return False
        for seq in self.running:
            if seq.prompt + seq.generated - seq.computed != 1 or seq.computed < seq.prompt:
                return False
        head = self._admission_head()
        if head is not None and len(self.running) < self.config.max_num_seqs:
            budget = self.config.max_num_batched_tokens - len(self.running)
            n = min(head.num_tokens - head.computed, budget)
            if self._blocks_for(head.computed + n) - head.blocks <= self._free_blocks:
                return False  # it would be admitted in the next iteration
        return True

    def _fuse_length(self) -> int:
        """How many decode iterations can run unchanged: until a request finishes, the KV cache
        runs out, or the configured cap."""
        k = min(seq.target - seq.generated for seq in self.running)
        if self.config.max_macro_steps is not None:
            k = min(k, self.config.max_macro_steps)
        return self._steps_until_kv_full(k)

    def _start_macro(self, now: float, extra_s: float, k: int) -> None:
        running = self.running
        B = len(running)
        pm = self.perf_models[self.active_model or ""]
        # Iteration i (from 0) feeds each sequence's newest token; it attends to computed + 1 + i.
        ctx0 = sum([seq.computed for seq in running]) + B
        d0 = pm.step.step_ms(n_scheduled=B, n_tokens=B, decode_ctx=ctx0, prefill_pairs=0.0) / 1000
        # The blocks of the k iterations are allocated as they end (``_finish_step``, ``abort``):
        # nothing else can allocate during the run, and ``_fuse_length`` checked they are free.
        step = _Step(start=now + extra_s, end=now, work=[(s, 1) for s in running], macro_k=k)
        step.d0_s, step.slope_s = d0, pm.step.decode_slope_ms(B) / 1000
        step.end = step.start + step.macro_elapsed(k)
        self._step = step

    def _steps_until_kv_full(self, cap: int) -> int:
        """Largest k <= ``cap`` such that every running sequence can get blocks for k more
        tokens (0 if none)."""
        bs = self.config.block_size
        free = self._free_blocks
        running = self.running

        def need(k: int) -> int:
            return sum(max(0, -(-(s.computed + k) // bs) - s.blocks) for s in running)

        if need(cap) <= free:  # the usual case: the cache is not the limit
            return cap
        # Blocks needed for k more tokens grow by about B/bs per step; bound, then binary search.
        lo, hi = 0, 1
        while hi <= cap and need(hi) <= free:
            lo, hi = hi, hi * 2
        hi = min(hi, cap)  # need(cap) > free
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if need(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo
