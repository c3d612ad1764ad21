"""One ``Settings`` object for every process, read from the environment (prefix ``QLM_``, nested
sections with ``__``, e.g. ``QLM_DEMO__TRACE=azure-code``). Built by ``get_settings()``, never at
import, so tests construct their own."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from qlm.errors import ConfigError


class DemoSettings(BaseModel):
    """The main job on embedded defaults: a short replay of a real trace on simulated instances."""

    trace: str = "azure-conv"
    workload: str = "wb"
    instances: str = "2xA100:llama-3-8b"
    policy: str = "fcfs"
    duration_s: float = Field(default=300.0, gt=0)
    rate_scale: float = Field(default=3.0, gt=0)
    seed: int = 0


class ControllerSettings(BaseModel):
    """The controller service (``qlm controller``, ``qlm serve``)."""

    policy: str = "qlm"
    name: str | None = None  # default: host-pid
    sim_instances: str = "2xA100:llama-3-8b"  # in-process simulated instances without a file
    sim_time_scale: float = Field(default=1.0, gt=0)
    tick_s: float = Field(default=0.25, gt=0)
    health_interval_s: float = Field(default=1.0, gt=0)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="QLM_", env_nested_delimiter="__", extra="ignore", frozen=True
    )

    log_level: str = "INFO"
    broker_url: str | None = None
    """``QLM_BROKER_URL``: ``amqp://user:password@host:5672/vhost``; unset: the in-process queue."""
    database_url: str | None = None
    """``QLM_DATABASE_URL``: ``postgresql+psycopg://...`` or ``sqlite:///path``; unset:
    ``sqlite:///qlm.db`` in the working directory."""
    instances_file: Path | None = None
    """``QLM_INSTANCES_FILE``: the serving instances (TOML); unset: simulated in-process."""
    controller: ControllerSettings = ControllerSettings()
    demo: DemoSettings = DemoSettings()


def get_settings() -> Settings:
    """Read the settings; a bad value stops with one line naming the setting."""
    try:
        return Settings()
    except ValidationError as exc:
        err = exc.errors()[0]
        where = "QLM_" + "__".join(str(p).upper() for p in err["loc"])
        raise ConfigError(f"setting {where}: {err['msg']}") from None
