"""The recent arrivals the planner's fluid model reads (``qlm.planner.concurrency.FluidModels``), kept as counts.

The fluid model needs, per request class (model, tier, SLO), how many requests of each prompt
length arrived in the last ``rate_window_s`` and a bounded sample of the latest ones (for the
class's mean output). Requests of one class and prompt length are alike to the model, so the
window keeps them as one count: under a backlog of 100,000 requests the model reads a few
thousand rows instead of every request, and nothing is rebuilt per plan (the counts change as
requests arrive and age out).

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import deque

from qlm.domain import Request, Tier

ClassKey = tuple[str, Tier, float]  # (model, tier, end-to-end SLO)


def class_of(req: Request) -> ClassKey:
    return (req.model, req.tier, req.slo.e2e_s)


class ArrivalWindow:
    """Arrivals of the last ``horizon`` seconds: per class, counts per prompt length and the
    latest ``sample`` requests."""

    def __init__(self, sample: int) -> None:
        self._sample = sample
        # Arrival times and requests side by side (not as pairs: at 400,000 arrivals a window of
        # pairs is 400,000 more objects for every full garbage collection to visit).
        self._times: deque[float] = deque()
        self._items: deque[Request] = deque()
        self._counts: dict[ClassKey, dict[int, int]] = {}
        self._recent: dict[ClassKey, deque[Request]] = {}
        self.first_s = float("inf")  # the first arrival ever seen

    def __len__(self) -> int:
        return len(self._items)

    def add(self, now: float, req: Request) -> None:
        if not self._items:
            self.first_s = min(self.first_s, now)
        self._times.append(now)
        self._items.append(req)
        key = class_of(req)
        counts = self._counts.setdefault(key, {})
        counts[req.input_tokens] = counts.get(req.input_tokens, 0) + 1
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = deque(maxlen=self._sample)
        recent.append(req)

    def expire(self, before_s: float) -> None:
        """Forget what arrived before ``before_s``."""
        while self._times and self._times[0] < before_s:
            self._times.popleft()
            req = self._items.popleft()
            key = class_of(req)
            counts = self._counts[key]
            left = counts[req.input_tokens] - 1
            if left:
                counts[req.input_tokens] = left
            else:
                del counts[req.input_tokens]
            recent = self._recent[key]
            if recent and recent[0] is req:  # (else the sample had already let it go)
                recent.popleft()
            if not counts:
                del self._counts[key]
                del self._recent[key]

    def classes(self) -> list[ClassKey]:
        """The classes with arrivals in the window, in the order they first arrived in it."""
        return list(self._counts)

    def counts(self, key: ClassKey) -> dict[int, int]:
        """Arrivals of ``key`` in the window per prompt length (tokens)."""
        return self._counts[key]

    def recent(self, key: ClassKey) -> deque[Request]:
        """The latest arrivals of ``key`` in the window (at most ``sample``), oldest first."""
        return self._recent[key]


class ArrivalRate:
    """Arrivals per model over the last ``horizon`` seconds, as a rate: what the throughput floor
    keeps up with (``qlm.planner.concurrency.choose_limits``). Longer than the fluid model's
    window: a minute of a bursty trace swings by half around its mean, and a floor that follows
    the swings picks large batches for bursts it then serves slower."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._items: deque[tuple[float, str]] = deque()
        self._counts: dict[str, int] = {}
        self.first_s = float("inf")  # the first arrival ever seen

    def add(self, now: float, model: str) -> None:
        self.first_s = min(self.first_s, now)
        self._items.append((now, model))
        self._counts[model] = self._counts.get(model, 0) + 1

    def rates(self, now: float) -> dict[str, float]:
        """Requests per second of each model that arrived in the last ``horizon_s`` (over the
        time since the first arrival while that is shorter, one second at least)."""
        while self._items and self._items[0][0] < now - self.horizon_s:
            _, model = self._items.popleft()
            left = self._counts[model] - 1
            if left:
                self._counts[model] = left
            else:
                del self._counts[model]
        span = max(min(self.horizon_s, now - self.first_s), 1.0)
        return {model: n / span for model, n in self._counts.items()}
