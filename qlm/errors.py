"""One error root; every failure QLM raises on purpose is a ``QLMError``.

Third-party exceptions are translated at the boundary (``raise EngineError(...) from exc``), so a
caller handles QLM's errors without knowing which library sits underneath.
"""

from __future__ import annotations

import math


class QLMError(Exception):
    """Root of QLM's errors. The CLI prints one red line for it and exits with code 1."""


class ConfigError(QLMError):
    """A setting, file or argument is invalid; the message names it."""


class EngineError(QLMError):
    """A serving engine refused or failed an operation."""


class EngineTimeout(EngineError):
    """The engine did not answer in time (a connect, a write, a health check): slow or
    momentarily starved, which is not dead. ``reached`` is False when the request never got to
    the engine (no connection was made): the engine cannot have failed it."""

    def __init__(self, message: str, *, reached: bool = True) -> None:
        super().__init__(message)
        self.reached = reached


class RequestRejected(EngineError):
    """The engine refused this request (longer than the model's context or the KV cache, a model
    it does not serve, a parameter it rejects): the request fails; the instance is fine."""


class UnknownRequest(EngineError):
    """The engine has no request with that id (finished, aborted, or never submitted)."""


class RequestFailed(QLMError):
    """A policy could not handle one request (its fields broke a computation): raised by the
    policy with everything of its step before that request taken, so the controller rejects
    that request alone and takes the step again without it."""

    def __init__(self, request_id: str, cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_id = request_id
        self.cause = cause


class WorkloadError(QLMError):
    """A trace or workload description cannot be loaded or built."""


class GroupError(QLMError):
    """A request-group operation names an unknown group or request, or adds a request twice."""


class VirtualQueueError(QLMError):
    """A virtual-queue operation is invalid: unknown instance or group, a group in two queues, a bad
    position. The message names the instance and the group."""


def check_setting(ok: bool, name: str, rule: str, value: object) -> None:
    """Raise ``ConfigError("<name> must be <rule>, got <value>")`` unless ``ok``: the one line a
    bad setting gets. NaN fails every rule (all its comparisons are false, but say so anyway)."""
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"{name} must be {rule}, got {value!r}")
