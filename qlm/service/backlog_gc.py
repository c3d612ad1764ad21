"""Keep Python's full garbage collections out of the control step while a large backlog is held.

A controller holding 100,000 requests keeps millions of live objects (requests, their tracks, group
members, store rows). CPython's oldest generation is collected whenever the objects that survived
into it grew by a quarter, and that collection traverses every one of them: 0.4-0.9 s on the
2-core development machine, on the controller's event loop, usually inside a control step (no
outcome recorded, nothing acked, no state published meanwhile).

``BacklogGC`` freezes what the intake has taken and each control step has made of it (groups,
estimates) once the held backlog is large (``gc.freeze``: the objects alive now are no longer
traversed by any collection; reference counting still frees them when they are dropped), after
collecting the young generations (so that young cyclic garbage is not frozen with it). It
unfreezes when the backlog has shrunk to a fraction of its peak, or when as many requests as the
peak were settled since the first freeze (a backlog that stays large turned over once): cyclic
garbage made while frozen is collected then, by one full collection, run at once, between
control steps — one per turnover of the backlog instead of one per quarter of growth, and what
leaks meanwhile is bounded by one turnover. What a small backlog allocates is collected as usual.
"""

from __future__ import annotations

import gc
import logging

from qlm.errors import check_setting

log = logging.getLogger(__name__)


class BacklogGC:
    """Freeze after each intake batch while at least ``min_held`` requests are held; unfreeze
    once fewer than ``unfreeze_below`` × the largest backlog frozen remain, or once that many
    requests were settled since the first freeze."""

    def __init__(self, min_held: int = 10_000, unfreeze_below: float = 0.25) -> None:
        check_setting(min_held >= 1, "backlog_gc.min_held", ">= 1", min_held)
        ok = 0 < unfreeze_below < 1
        check_setting(ok, "backlog_gc.unfreeze_below", "in (0, 1)", unfreeze_below)
        self.min_held = min_held
        self.unfreeze_below = unfreeze_below
        self.peak = 0  # the largest backlog held while frozen (0: nothing frozen by this)
        self.released = 0  # requests settled since the first freeze
        self.freezes = 0
        self.unfreezes = 0

    @property
    def frozen(self) -> bool:
        return self.peak > 0

    def taken(self, held: int) -> None:
        """An intake batch was taken, or a control step made what it holds of them (groups,
        estimates): ``held`` requests are held now."""
        if held < self.min_held:
            return
        gc.collect(1)  # the young generations: their cyclic garbage is not frozen
        gc.freeze()
        self.freezes += 1
        if not self.frozen:
            log.info("holding %d requests: long-lived objects exempt from full collections", held)
        self.peak = max(self.peak, held)

    def settled(self, held: int, released: int = 0) -> None:
        """``released`` requests were settled: ``held`` remain."""
        if not self.frozen:
            return
        self.released += released
        if held < self.peak * self.unfreeze_below or self.released >= self.peak:
            gc.unfreeze()
            gc.collect()
            self.unfreezes += 1
            log.info(
                "holding %d requests (peak %d, %d settled): a full collection, then as usual",
                held,
                self.peak,
                self.released,
            )
            self.peak = self.released = 0
