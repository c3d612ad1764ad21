"""The waiting requests of a ``Grouper``, one slot each, with what re-clustering reads of them.

A request takes a slot when it is added and gives it back when it leaves. Re-clustering reads
every waiting request at once through their slots — the inputs of its features, its partition,
its FCFS rank and its id's hash are kept in arrays — instead of walking 100,000 request objects.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from qlm.domain import Request, Tier
from qlm.groups.features import (
    FEATURES,
    FloatArray,
    GroupKey,
    IntArray,
    PredictOutput,
    fnv1a,
    group_keys,
    predict_outputs,
    raw_feature_matrix,
    stable_hash,
)

ObjectArray = npt.NDArray[np.object_]


class WaitingRequests:
    """Slots of the waiting requests: ``slot_of`` (by request id), and per slot the request, the
    grouper's group of it (``group``) and its features as last computed (``raw``).

    The remaining columns — SLOs, prompt and ``max_tokens``, arrival, (model, tier, slo_class) —
    are written once, when the request arrives; the hash of its id on the first re-clustering
    that reads it. A freed slot is reused by a later request.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self.slot_of: dict[str, int] = {}
        self.request: ObjectArray = np.full(capacity, None, dtype=object)
        self.group: ObjectArray = np.full(capacity, None, dtype=object)
        self.raw: FloatArray = np.empty((capacity, len(FEATURES)))
        self._e2e: FloatArray = np.empty(capacity)
        self._ttft: FloatArray = np.empty(capacity)  # the end-to-end SLO without a TTFT SLO
        self._inputs: FloatArray = np.empty(capacity)
        self._caps: FloatArray = np.empty(capacity)
        self._arrival: FloatArray = np.empty(capacity)
        self._base: IntArray = np.empty(capacity, dtype=np.int64)  # index in ``_bases``
        self._hash: npt.NDArray[np.uint64] = np.empty(capacity, dtype=np.uint64)
        self._id_len: IntArray = np.full(capacity, -1, dtype=np.int64)  # -1: not hashed yet
        self._bases: dict[tuple[str, Tier, str], int] = {}
        self._free: list[int] = []
        self._used = 0  # slots handed out so far, freed or not

    def __len__(self) -> int:
        return len(self.slot_of)

    def add(self, request: Request, raw: FloatArray, group: Any) -> int:
        """Give ``request`` a slot, with its features and group; return the slot."""
        if self._free:
            slot = self._free.pop()
        else:
            if self._used == len(self.request):
                self._grow()
            slot = self._used
            self._used += 1
        slo = request.slo
        self.slot_of[request.id] = slot
        self.request[slot] = request
        self.group[slot] = group
        self.raw[slot] = raw
        self._e2e[slot] = slo.e2e_s
        self._ttft[slot] = slo.e2e_s if slo.ttft_s is None else slo.ttft_s
        self._inputs[slot] = request.input_tokens
        self._caps[slot] = request.max_tokens
        self._arrival[slot] = request.arrival_s
        base = (request.model, request.tier, request.slo_class)
        self._base[slot] = self._bases.setdefault(base, len(self._bases))
        self._id_len[slot] = -1
        return slot

    def at(self, slot: int) -> Request:
        """The request in ``slot``."""
        request: Request = self.request[slot]
        return request

    def release(self, slot: int) -> Request:
        """Free the slot of a request that left; return the request."""
        request = self.at(slot)
        del self.slot_of[request.id]
        self.request[slot] = None
        self.group[slot] = None
        self._free.append(slot)
        return request

    def features(self, slots: IntArray, predict_output: PredictOutput) -> FloatArray:
        """The raw features of these requests, recomputed with ``predict_output`` (``predict_outputs``:
        called once per request, in the order of ``slots``)."""
        caps = self._caps[slots]
        predicted = predict_outputs(predict_output, self.request[slots], caps)
        return raw_feature_matrix(
            self._e2e[slots], self._ttft[slots], self._inputs[slots], caps, predicted
        )

    def partitions(
        self, slots: IntArray, deadline_window: float
    ) -> tuple[list[GroupKey], IntArray]:
        """``group_keys`` of these requests: their distinct partitions, sorted, and the index of
        each request's."""
        return group_keys(
            list(self._bases),
            self._base[slots],
            self._arrival[slots],
            self._e2e[slots],
            deadline_window,
        )

    def fcfs_order(self, slots: IntArray, partition: IntArray) -> IntArray:
        """Order of these requests by ``partition``, then FCFS (arrival, then id)."""
        arrival = self._arrival[slots]
        order = np.lexsort((arrival, partition))
        same = (np.diff(partition[order]) == 0) & (np.diff(arrival[order]) == 0)
        if same.any():  # requests that arrived at the same instant: by id
            tied = np.flatnonzero(np.append(same, False) | np.insert(same, 0, False))
            run = np.cumsum(np.insert(~same, 0, True))[tied]
            ids = np.array([r.id for r in self.request[slots[order[tied]]]])
            order[tied] = order[tied][np.lexsort((ids, run))]
        return order

    def id_hashes(self, slots: IntArray) -> npt.NDArray[np.uint64]:
        """``stable_hash`` of these requests' ids, over them all."""
        new = slots[self._id_len[slots] < 0]
        if len(new):
            self._hash[new], self._id_len[new] = fnv1a([r.id for r in self.request[new]])
        return stable_hash(self._hash[slots], self._id_len[slots])

    def _grow(self) -> None:
        for name in (
            "request",
            "group",
            "raw",
            "_e2e",
            "_ttft",
            "_inputs",
            "_caps",
            "_arrival",
            "_base",
            "_hash",
            "_id_len",
        ):
            old = getattr(self, name)
            new = np.empty((2 * len(old), *old.shape[1:]), dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
