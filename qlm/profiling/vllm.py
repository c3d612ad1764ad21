"""Hardware profiling of a vLLM server over its HTTP API, on the wall clock: the parameters
``qlm.profiling.sim`` measures on the simulated engine, measured through the API an agent uses
(docs/estimator.md, "Profiles"). Nothing is streamed. A run's time is the server's own
measure where it exports one (vLLM's ``vllm:e2e_request_latency_seconds``: from a request's
arrival to its last token), so neither the round trips nor a busy client host are measured;
otherwise, and for the saturating batch (whose requests end one after another), it is from
sending the requests to the last answer.

1. a request alone at several prompt lengths with one output token, each length a few times
   (the shortest run counts: a disturbance only lengthens one): the prefill line
   ``P(I) = a + b·I`` (the HTTP round trip lands in ``a``); while the line does not rise (a
   busy host: disturbances longer than the prompts' differences) each length runs a few times
   more, up to ``PREFILL_ROUNDS`` rounds; a line that still does not rise is an error, not a
   profile;
2. a request alone generating ``O`` and ``O / 2`` tokens after a prompt of the profiling length,
   and after one four times as long: the time per token alone (the difference of the two over
   ``O / 2``), and what a token of context adds to a decode step;
3. one full batch (as many requests as the KV cache holds at once), twice, generating ``O`` and
   ``O / 2``: the time per token at that batch, ``d``, from the difference;
4. one saturating batch (1.5× that, submitted together) run to the end: ``Θ`` is its output
   tokens per second once the prompt work is taken out; ``ε`` is 1 plus the share of its time
   spent recomputing the prompts of the requests the engine preempted (its counter says how
   many; about a prompt each).

Every prompt is different random token ids, so that a server's prefix cache (on by default in
vLLM V1) cannot serve one request's prompt from another's. What the API does not tell is given
(``ServerSettings``): ``max_num_seqs`` and ``max_num_batched_tokens``; load times are measured
with sleep mode where the server has it (``--enable-sleep-mode``, ``VLLM_SERVER_DEV_MODE=1``).
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
from dataclasses import dataclass

from qlm.clock import WallClock
from qlm.domain import ModelTier
from qlm.engines.base import EngineRequest
from qlm.engines.vllm import VllmEngine
from qlm.errors import ConfigError, EngineError
from qlm.rct.fit import PREFILL_LENGTHS, fit_line
from qlm.rct.profile import HardwareProfile

TOKEN_IDS = (1000, 30000)  # random prompt ids from here for a server without /tokenize
DECODE_TRIES = 3  # pairs of runs a decode time per token is measured from, at most
PREFILL_TRIES = 3  # runs of each prompt length; the shortest is the prefill's time
PREFILL_ROUNDS = 4  # of PREFILL_TRIES runs each, at most: another while the line does not rise
PLAUSIBLE_SHARE = 0.02  # of the longer run that its extra output must take to be believed
SERVED_READS = 20  # reads of the server's latency counts after a run, until they count it
SERVED_READ_S = 0.05


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """What a vLLM server's API does not tell: its scheduler settings, and load times to use when
    it has no sleep mode to measure them with (seconds; ``None``: measure, or fail if it cannot)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 0  # 0: unknown
    max_context: int | None = None  # longest prompt + output to profile with (None: 8,192)
    warm_load_s: float | None = None
    cold_load_s: float | None = None
    kv_bytes_per_token: int = 0  # for KV swap costs (vLLM has no per-request swap); 0: unknown


class _Prompts:
    """Distinct random prompts (seeded: a profile run is repeatable) of ids the server's
    vocabulary has (``VllmEngine.token_ids``: its ``/tokenize``; else ``TOKEN_IDS``)."""

    def __init__(self, model: str, seed: int, ids: tuple[int, ...] = ()) -> None:
        self.model = model
        self._rng = random.Random(seed)
        self._n = 0
        self._ids = ids

    def _id(self) -> int:
        return self._rng.choice(self._ids) if self._ids else self._rng.randrange(*TOKEN_IDS)

    def request(self, prompt: int, output: int) -> EngineRequest:
        self._n += 1
        ids = tuple(self._id() for _ in range(prompt))
        return EngineRequest(
            f"profile-{self._n}", self.model, prompt, max_tokens=output, output_tokens=output,
            prompt=ids,
        )  # fmt: skip


async def _makespan(
    engine: VllmEngine,
    clock: WallClock,
    prompts: _Prompts,
    n: int,
    prompt: int,
    output: int,
    *,
    served: bool = False,
) -> float:
    """Send ``n`` requests together; the time until the last answer. ``served``: the mean time
    the server itself measured for them (``VllmEngine.latency_totals``), where it says — so
    the round trips, and a client host's or the server's event loop falling behind, are not
    measured; the client's measure otherwise (or when another client's request ended
    meanwhile, or the server's counts lag)."""
    before = await engine.latency_totals() if served else None
    requests = [prompts.request(prompt, output) for _ in range(n)]
    t0 = clock.now()
    outs = await asyncio.gather(*(engine.complete(r) for r in requests))
    elapsed = clock.now() - t0
    for r, out in zip(requests, outs, strict=True):
        if out.tokens != r.tokens_to_generate:
            raise EngineError(
                f"{engine.name}: a profiling request generated {out.tokens} tokens, not "
                f"{r.tokens_to_generate} (ignore_eos not honoured?)"
            )
    if before is None:
        return elapsed
    for _ in range(SERVED_READS):  # the server may count a request just after answering it
        after = await engine.latency_totals()
        if after is None or after[1] - before[1] > n:
            return elapsed
        if after[1] - before[1] == n:
            return (after[0] - before[0]) / n
        await asyncio.sleep(SERVED_READ_S)
    return elapsed


async def profile_engine(
    engine: VllmEngine,
    *,
    model: str,
    gpu: str,
    gpu_count: int = 1,
    settings: ServerSettings | None = None,
    input_tokens: int = 1024,
    output_tokens: int = 256,
    oversubscribe: float = 1.5,
    clock: WallClock | None = None,
    seed: int = 0,
) -> HardwareProfile:
    """Profile ``model`` served by ``engine`` (module docstring). ``clock``: the time the
    measurements are read in (a sped-up ``WallClock`` for a simulated engine served faster than
    real time); wall seconds by default."""
    cfg = settings or ServerSettings()
    clock = clock or WallClock()
    if output_tokens < 4:
        raise ConfigError("profiling needs output_tokens >= 4 to measure decode time")
    ctx = cfg.max_context or 8192
    if input_tokens + output_tokens > ctx:
        raise ConfigError(f"profile lengths {input_tokens}+{output_tokens} exceed context {ctx}")
    caps = await engine.capabilities()
    if model not in caps.models:
        raise ConfigError(f"{engine.name} does not serve {model!r} (it serves {list(caps.models)})")
    capacity = caps.kv_capacity_tokens
    if not capacity:
        raise EngineError(
            f"{engine.name}: KV cache size unknown (vLLM exports it as vllm:cache_config_info)"
        )
    if not caps.supports_sleep and (cfg.warm_load_s is None or cfg.cold_load_s is None):
        await _load_times(engine, model, False, cfg, clock)  # what to give, before measuring
    prompts = _Prompts(model, seed, await engine.load_token_ids())

    async def span(n: int, prompt: int, output: int) -> float:
        """As the server timed it (its requests run together, so their mean is the span)."""
        return await _makespan(engine, clock, prompts, n, prompt, output, served=True)

    lengths = [n for n in PREFILL_LENGTHS if n + 1 <= ctx]
    ttfts = [math.inf] * len(lengths)
    for _ in range(PREFILL_ROUNDS):  # more runs while the shortest do not rise with the prompt
        for i, n in enumerate(lengths):
            ttfts[i] = min([ttfts[i], *[await span(1, n, 1) for _ in range(PREFILL_TRIES)]])
        b, a = fit_line(lengths, ttfts)
        if b > 0:
            break
    if b <= 0:
        raise EngineError(
            f"{engine.name}: prefill time could not be measured (one request's time at "
            f"{', '.join(f'{n}' for n in lengths)} prompt tokens, the shortest of "
            f"{PREFILL_ROUNDS * PREFILL_TRIES} runs each: {', '.join(f'{t:.4f}' for t in ttfts)}"
            " s, does not grow with the prompt); is another client using the server?"
        )

    half = output_tokens // 2

    async def per_token(n: int, prompt: int) -> tuple[float, float]:
        """Time per output token of ``n`` requests decoding together after ``prompt`` (while
        their context grows from ``prompt + O / 2`` to ``prompt + O``), and the makespan. The
        difference of two runs is noise when the server is disturbed (another client, a slow
        round trip): the pair is run again until the longer run is plausibly longer, then the
        median of the pairs is taken; a decode time that is no time at all is an error, not
        a profile (it would tell the estimator that decoding is free)."""
        diffs, longer = [], 0.0
        for _ in range(DECODE_TRIES):
            longer, shorter = await span(n, prompt, output_tokens), await span(n, prompt, half)
            diffs.append(longer - shorter)
            if diffs[-1] > PLAUSIBLE_SHARE * longer:
                break
        diff = diffs[-1] if diffs[-1] > PLAUSIBLE_SHARE * longer else statistics.median(diffs)
        if diff <= PLAUSIBLE_SHARE * longer:
            raise EngineError(
                f"{engine.name}: decode time could not be measured ({n} request(s) after "
                f"{prompt} prompt tokens took hardly longer to generate {output_tokens} tokens "
                f"than {half} in {len(diffs)} tries: {', '.join(f'{x:+.3f}' for x in diffs)} s of "
                f"{longer:.3f}); is another client using the server? (or raise --output-tokens)"
            )
        return diff / (output_tokens - half), longer

    d_alone, _ = await per_token(1, input_tokens)
    long_prompt = min(4 * input_tokens, ctx - output_tokens)
    per_ctx = 0.0
    if long_prompt > input_tokens:
        d_long, _ = await per_token(1, long_prompt)
        per_ctx = max(0.0, (d_long - d_alone) / (long_prompt - input_tokens))

    concurrent = min(cfg.max_num_seqs, max(1, capacity // (input_tokens + output_tokens)))
    d, _ = await per_token(concurrent, input_tokens)
    n_req = max(2, math.ceil(concurrent * oversubscribe))
    before = (await engine.stats()).preemptions_total
    # more requests than run at once: they end one after another, so the client's span
    makespan = await _makespan(engine, clock, prompts, n_req, input_tokens, output_tokens)
    preempted = (await engine.stats()).preemptions_total - before
    # Each preemption recomputes about a prompt (docs/estimator.md): its share of the time.
    eps = 1.0 + preempted * input_tokens * b / makespan
    prompt_work = n_req * input_tokens * b
    decode_time = max(makespan - prompt_work, 1e-9)
    warm, cold = await _load_times(engine, model, caps.supports_sleep, cfg, clock)
    return HardwareProfile(
        model=model,
        gpu=gpu,
        gpu_count=gpu_count,
        prefill_base_s=max(a, 0.0),
        prefill_per_token_s=b,
        input_token_work_s=b,
        throughput_tps=n_req * output_tokens / decode_time,
        decode_per_token_s=d,
        decode_alone_s=d_alone,
        inefficiency=max(eps, 1.0),
        saturation_batch=float(concurrent),
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        decode_per_ctx_token_s=per_ctx,
        decode_ctx_tokens=input_tokens + 0.75 * output_tokens,
        kv_bytes_per_token=cfg.kv_bytes_per_token,
        kv_capacity_tokens=capacity,
        warm_load_s=warm,
        cold_load_s=cold,
        source=(
            f"{engine.name} over its HTTP API, {n_req} requests of {input_tokens}+{output_tokens} "
            f"tokens ({preempted} preemptions by the engine) and prefill at {len(lengths)} lengths"
        ),
    )


async def _load_times(
    engine: VllmEngine, model: str, sleep: bool, cfg: ServerSettings, clock: WallClock
) -> tuple[float, float]:
    """Warm (sleep level 1 → awake) and cold (level 2 → awake) load times: measured where the
    engine has sleep mode and they were not given."""
    given = (cfg.warm_load_s, cfg.cold_load_s)
    if given[0] is not None and given[1] is not None:
        return given[0], given[1]
    if not sleep:
        raise ConfigError(
            f"{engine.name} has no sleep mode to measure load times with ({engine.sleep_probe}): "
            "give --warm-load-s and --cold-load-s (or serve with --enable-sleep-mode and "
            "VLLM_SERVER_DEV_MODE=1 where vLLM can sleep)"
        )
    measured = []
    for tier in (ModelTier.WARM, ModelTier.COLD):
        await engine.set_model_tier(model, tier)
        t0 = clock.now()
        await engine.set_model_tier(model, ModelTier.ACTIVE)
        measured.append(clock.now() - t0)
    warm = given[0] if given[0] is not None else measured[0]
    cold = given[1] if given[1] is not None else measured[1]
    return warm, cold
