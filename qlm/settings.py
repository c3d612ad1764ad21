"""One ``Settings`` object for every process, read from the environment (prefix ``QLM_``, nested
sections with ``__``, e.g. ``QLM_DEMO__TRACE=azure-code``). Built by ``get_settings()``, never at
import, so tests construct their own. Values and their validation only: the planner's
configuration and the estimator's profile they stand for are built by ``qlm.wiring``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from qlm.domain import MAX_API_SLO_S, MIN_SLO_S
from qlm.errors import ConfigError


class DemoSettings(BaseModel):
    """The main job on embedded defaults: a short replay of a real trace on simulated instances."""

    trace: str = "azure-conv"
    workload: str = "wb"
    instances: str = "2xA100:llama-3-8b"
    policies: str = "fcfs,qlm"
    """Policies replayed on the same trace and seed, compared side by side (comma-separated)."""
    duration_s: float = Field(default=300.0, gt=0)
    rate_scale: float = Field(default=3.0, gt=0)
    seed: int = 0


class SimSettings(BaseModel):
    """Simulated instances (``QLM_SIM__*``) of ``qlm simulate``, ``qlm demo``, ``qlm sim-engine
    serve`` and the in-process ones of ``qlm serve`` and ``qlm controller`` (docs/simulator.md);
    the commands' flags win."""

    perf_model: str = Field(default="default", min_length=1)
    """Their step times: ``default`` (the fitted profiles), ``splitwise`` (Splitwise's measured
    table) or a CSV file of that table's shape (``--perf-model``)."""
    kv_memory: Literal["vllm", "splitwise"] = "vllm"
    """How their KV cache is sized: vLLM's rule or Splitwise's (``--kv-memory``)."""


class BrokerSettings(BaseModel):
    """Names on the broker (``QLM_BROKER__*``): the defaults match ``broker/definitions.json``;
    tests and side-by-side deployments use their own."""

    queue: str = "qlm.requests"
    dead_letter_exchange: str = "qlm.dlx"
    dead_letter_queue: str = "qlm.dead"
    delivery_limit: int = Field(default=5, ge=1)
    shards: int = Field(default=1, ge=1, le=64)
    """Quorum queues the global queue is split into: a controller holds up to 65,535 waiting
    requests per shard (broker/README.md). Every API replica and controller must agree."""

    def queue_options(self) -> dict[str, Any]:
        """The keyword arguments of ``open_global_queue`` these settings stand for."""
        return self.model_dump()


PolicyName = Literal[
    "fcfs", "fcfs-rr", "edf", "sedf", "priority", "proserve", "shepherd", "qlm", "qlm-rr"
]
"""The policies ``qlm.planner.create_policy`` makes (``qlm.planner.POLICIES``): checked with the
other settings, before a service opens anything."""


class ControllerSettings(BaseModel):
    """The controller service (``qlm controller``, ``qlm serve``)."""

    policy: PolicyName = "qlm"
    name: str | None = None  # default: host-pid
    sim_instances: str = "2xA100:llama-3-8b"  # in-process simulated instances without a file
    sim_time_scale: float = Field(default=1.0, gt=0)
    sim_over_http: bool = False  # simulated instances as `qlm sim-engine serve` processes
    tick_s: float = Field(default=0.25, gt=0)
    health_interval_s: float = Field(default=1.0, gt=0)
    down_after_health_timeouts: int = Field(default=3, ge=1)
    """Health checks in a row an instance may leave unanswered (5 s each) before it is marked
    down: slow is not dead. An instance that answers it is not serving, or refuses the
    connection, is down at once."""
    # On becoming active, the policy learns output lengths from this many of the store's most
    # recent completions (a restarted or failed-over controller; 0: start from the profile).
    history_outputs: int = Field(default=1000, ge=0)
    # Retention: the active controller deletes requests that ended more than this many days
    # ago (with their labels), and plans beyond the latest ``retain_plans``; 0 keeps them all.
    retain_days: float = Field(default=30.0, ge=0)
    retain_plans: int = Field(default=10_000, ge=0)
    # Orphan sweep: a request submitted more than this many seconds ago that has not ended and
    # that no message in the global queue stands for is recorded failed (0: never).
    orphan_after_s: float = Field(default=600.0, ge=0)


TierName = Literal["interactive", "standard", "batch"]


class MaxWaitSettings(BaseModel):
    """The starvation guard's maximum wait per tier, in seconds (``QLM_PLANNER__MAX_WAIT_S__BATCH``
    etc.; unset: no maximum): a request that has waited this long since its arrival is served
    at its instance's next free slot, ahead of the plan's order."""

    interactive: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    standard: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    batch: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class PlannerSettings(BaseModel):
    """The ``qlm`` policy's planner and agents (``QLM_PLANNER__*``; docs/planner.md). Unset
    fields keep ``PlannerConfig``'s defaults (``qlm.wiring.planner_config``)."""

    delta: float = Field(default=0.9, gt=0, lt=1)
    """The chance constraint: a group is safe when ``P(meet SLO) >= delta``."""
    tier_weights: dict[TierName, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    """What meeting one request's SLO is worth, by tier (a JSON object; tiers left out keep the
    planner's default, interactive 2 / standard 1.5 / batch 1). Equal weights: every SLO counts
    alike."""
    budget_s: float = Field(default=0.1, gt=0)
    """Compute time per plan (the best plan found so far is used when it runs out)."""
    period_s: float = Field(default=10.0, gt=0)
    min_interval_s: float = Field(default=1.0, gt=0)
    defer_expensive: bool = True
    """Cost-aware admission: under overload the work of least value per GPU-second waits
    behind the rest (nothing is dropped)."""
    throughput_floor: float = Field(default=0.9, ge=0, le=1)
    """Under a sustained overload (an instance's queue never empty for ``overload_after_s``) the
    concurrency choice keeps each instance serving at least this share of the requests arriving
    per second plus what clears its queue (or of the most any limit serves, when none keeps up):
    0 chooses by SLOs met alone (docs/planner.md)."""
    floor_window_s: float = Field(default=300.0, gt=0)
    """The window the throughput floor counts arrivals and served work over, and clears an
    instance's queue within."""
    overload_after_s: float = Field(default=300.0, gt=0)
    """How long an instance's queue must hold requests at every plan before the throughput
    floor and tolerance apply to it."""
    throughput_tolerance: float = Field(default=0.05, ge=0, lt=1)
    """While an instance's best concurrency limit leaves work deferred, the limits worth within
    this share of the best are alike and the one that serves the most requests per second is
    chosen; 0 chooses by SLOs met alone (docs/planner.md)."""
    max_utilisation: float = Field(default=0.95, gt=0, le=1)
    rate_window_s: float = Field(default=60.0, gt=0)
    choose_concurrency: bool = True
    warm_start: bool = True
    evict: bool = True
    swap: bool = True
    prefill_queue_tokens: int = Field(default=4096, ge=0)
    """The most prompt tokens the agents keep pulled onto an instance and not yet started (0:
    no bound); the rest waits in the virtual queue, in the plan's order."""
    solver: Literal["auto", "cbc", "highs"] = "auto"
    """The MILP's solver (small problems only, docs/planner.md): HiGHS when installed, else CBC."""
    group_delta: float = Field(default=4.0, gt=0, allow_inf_nan=False)
    """δ of the request groups (paper §4): a group holds at most δ × ``group_batch_size``."""
    group_batch_size: float = Field(default=8.0, ge=1, allow_inf_nan=False)
    """The average batch size groups are sized by (smaller groups: finer plans, more planning)."""
    max_wait_s: MaxWaitSettings = Field(default_factory=MaxWaitSettings)
    """The starvation guard, per tier (``MaxWaitSettings``)."""


class BaselineSettings(BaseModel):
    """The baseline policies' parameters (``QLM_BASELINES__*``; docs/planner.md)."""

    priority_preempt: bool = True
    """``priority``: a waiting request of a more urgent tier preempts a running one."""
    proserve_alpha: float = Field(default=0.9, gt=0, le=1)
    proserve_mu: float = Field(default=0.1, ge=0)
    proserve_lam: float = Field(default=0.7, ge=0, le=1)
    proserve_gamma: float = Field(default=1.0, gt=0)
    shepherd_batch_size: Annotated[int | None, BeforeValidator(_unset_if_empty)] = Field(
        default=None, ge=1
    )
    """``shepherd``: a fixed batch size; unset (or empty): SHEPHERD's rule at each round (the size
    whose batch makes the most deadlines per second)."""
    shepherd_max_batches: int = Field(default=4, ge=1)
    shepherd_time_limit_s: float = Field(default=0.25, gt=0)


class ApiSettings(BaseModel):
    """The REST API (``qlm api``, ``qlm serve``): where it listens, who may call it, and the limits
    it enforces (docs/api.md). Rates and limits are per tenant; the token bucket is per replica."""

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    require_keys: bool = True
    """Without keys every call acts as ``default_tenant`` with admin rights: trusted networks only."""
    default_tenant: str = Field(default="default", min_length=1)
    key_cache_s: float = Field(default=5.0, ge=0)
    """How long a looked-up key is trusted without asking the store (so a revocation takes
    effect within this time)."""
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    max_tokens_limit: int = Field(default=32_768, ge=1)
    """The largest ``max_tokens`` a request may ask for (422 above it)."""
    max_prompt_tokens: int = Field(default=131_072, ge=1)
    """The largest estimated prompt (422 above it)."""
    default_max_tokens: int = Field(default=256, ge=1)
    """``max_tokens`` of a request that gives none (native and OpenAI-style alike)."""
    max_labels: int = Field(default=16, ge=0)
    rate_per_s: float = Field(default=200.0, gt=0)
    """Sustained submissions per second per tenant (per API replica), 429 beyond."""
    rate_burst: int = Field(default=400, ge=1)
    max_queued_per_tenant: int = Field(default=10_000, ge=1)
    """Requests a tenant may have queued (429 beyond, from the store's count)."""
    queued_count_ttl_s: float = Field(default=0.5, ge=0)
    """How stale the store's queued count may be before it is counted again (in the background:
    submissions meanwhile are checked against the count it replaces, plus those added locally);
    0: every submission waits for an exact count."""
    interactive_slo_s: float = Field(default=30.0, ge=MIN_SLO_S, le=MAX_API_SLO_S)
    standard_slo_s: float = Field(default=300.0, ge=MIN_SLO_S, le=MAX_API_SLO_S)
    batch_slo_s: float = Field(default=3600.0, ge=MIN_SLO_S, le=MAX_API_SLO_S)
    """End-to-end SLO of a request that gives none, by its tier."""
    default_tier: Literal["interactive", "standard", "batch"] = "standard"
    admission: Literal["accept", "reject"] = "accept"
    """When the plan says a new request cannot meet its SLO: ``accept`` it flagged at risk, or
    ``reject`` it with 503 and the reason."""
    wait_timeout_s: float = Field(default=540.0, gt=0)
    """The longest an OpenAI-style call waits for its result behind the queue (504 after). Below
    the OpenAI clients' own 600 s: a client that gives up first retries, and each retry cancels
    the request before (its disconnect) and queues it again."""
    max_long_poll_s: float = Field(default=60.0, gt=0)
    """The largest ``wait`` of ``GET /v1/requests/{id}``."""
    poll_interval_s: float = Field(default=0.25, gt=0)
    """How often an API without a controller in process asks the store for finished results."""
    controller_stale_s: float = Field(default=10.0, gt=0)
    """``/readyz`` fails when no controller published its state for this long."""
    controller_gone_s: float = Field(default=900.0, gt=0)
    """A controller that published nothing for this long is gone: ``/metrics`` stops reporting
    it (one that stopped cleanly, at once), so a staleness alert on it ends."""
    snapshot_ttl_s: float = Field(default=1.0, ge=0)
    metrics_public: bool = False
    """Serve ``/metrics`` without a key (else admin keys only)."""
    metrics_window_s: float = Field(default=3600.0, gt=0)
    """SLO attainment, per-tenant counts and estimate error cover requests of this window."""
    commit_max_batch: int = Field(default=512, ge=1)
    """Most submissions recorded in one store transaction (group commit)."""
    access_log: bool = False
    """Log every HTTP call (costs throughput at thousands of calls per second)."""

    @model_validator(mode="after")
    def _default_within_limit(self) -> ApiSettings:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens={self.default_max_tokens} exceeds max_tokens_limit="
                f"{self.max_tokens_limit}: every request that gives no max_tokens would be refused"
            )
        return self

    @model_validator(mode="after")
    def _gone_after_stale(self) -> ApiSettings:
        if self.controller_gone_s < self.controller_stale_s:
            raise ValueError(
                f"controller_gone_s={self.controller_gone_s} is below controller_stale_s="
                f"{self.controller_stale_s}: a controller would stop being reported before "
                "it counts as stale"
            )
        return self

    @model_validator(mode="after")
    def _slos_ordered(self) -> ApiSettings:
        if not self.interactive_slo_s <= self.standard_slo_s <= self.batch_slo_s:
            raise ValueError(
                "default SLOs must not decrease with the tier: interactive_slo_s="
                f"{self.interactive_slo_s} <= standard_slo_s={self.standard_slo_s} <= "
                f"batch_slo_s={self.batch_slo_s}"
            )
        return self


def _unset_if_empty(value: object) -> object:
    """A path variable set to nothing (``QLM_PROFILE_FILE=``) is unset, not the current directory."""
    return None if isinstance(value, str) and not value.strip() else value


def _upper(value: object) -> object:
    """A level name in any case, with the aliases Python's logging knows (WARN, FATAL)."""
    if not isinstance(value, str):
        return value
    name = value.upper()
    return {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(name, name)


def _lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="QLM_", env_nested_delimiter="__", extra="ignore", frozen=True
    )

    log_level: Annotated[
        Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], BeforeValidator(_upper)
    ] = "INFO"
    """``QLM_LOG_LEVEL`` (any case); HTTP client libraries log each call only at ``DEBUG``."""
    log_format: Annotated[Literal["text", "json"], BeforeValidator(_lower)] = "text"
    """``QLM_LOG_FORMAT``: ``text``, a line for people to read, or ``json``, one JSON object per
    line (time, level, logger, message and the record's own fields) for a log pipeline to
    parse without patterns. Every service process (``qlm api``, ``controller``, ``serve``,
    ``sim-engine serve``) logs so, the HTTP server's lines too."""
    tracing: Annotated[Literal["off", "otel"], BeforeValidator(_lower)] = "off"
    """``QLM_TRACING``: ``otel`` traces each request's path with OpenTelemetry (the ``otel``
    extra; exporter and resource from the standard ``OTEL_*`` variables: docs/operations.md,
    "Tracing"); ``off``, the default, imports nothing of it."""
    broker_url: str | None = None
    """``QLM_BROKER_URL``: ``amqp://user:password@host:5672/vhost``; unset: the in-process queue."""
    broker: BrokerSettings = BrokerSettings()
    database_url: str | None = None
    """``QLM_DATABASE_URL``: ``postgresql+psycopg://...`` or ``sqlite:///path``; unset:
    ``sqlite:///qlm.db`` in the working directory."""
    instances_file: Annotated[Path | None, BeforeValidator(_unset_if_empty)] = None
    """``QLM_INSTANCES_FILE``: the serving instances (TOML); unset: simulated in-process."""
    profile_file: Annotated[Path | None, BeforeValidator(_unset_if_empty)] = None
    """``QLM_PROFILE_FILE``: an RCT profile written by ``qlm profile`` (your GPUs, your workload's
    output lengths), merged over the shipped one (yours wins on the same key); unset: the
    shipped profile alone."""
    controller: ControllerSettings = ControllerSettings()
    planner: PlannerSettings = PlannerSettings()
    baselines: BaselineSettings = BaselineSettings()
    api: ApiSettings = ApiSettings()
    demo: DemoSettings = DemoSettings()
    sim: SimSettings = SimSettings()

    def require_broker(self, command: str) -> None:
        """Stop ``command`` — a process that shares the global queue with others — with one
        line when ``QLM_BROKER_URL`` is unset: its in-process queue would be one no other
        process reads, and what it accepted would be lost with it."""
        if self.broker_url is None:
            raise ConfigError(
                f"setting QLM_BROKER_URL: not set; {command} shares the global queue with "
                "other processes through RabbitMQ (e.g. amqp://guest:guest@127.0.0.1:5672/%2F); "
                "`qlm serve` runs the API and a controller in one process on an in-process queue"
            )


def get_settings() -> Settings:
    """Read the settings; a bad value stops with one line naming the setting."""
    try:
        return Settings()
    except ValidationError as exc:
        err = exc.errors()[0]
        where = "QLM_" + "__".join(str(p).upper() for p in err["loc"])
        raise ConfigError(f"setting {where}: {err['msg']}") from None
