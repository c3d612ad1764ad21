"""Request groups (paper §4, Algorithm 1): k-means over request features, split to δ × batch size,
online classification of new requests, re-clustering that keeps group ids stable.

See ``docs/groups.md``. Pure: no I/O, no clock.
"""

from __future__ import annotations

from qlm.groups.config import GroupingConfig
from qlm.groups.features import (
    DEFAULT_OUTPUT_TOKENS,
    FEATURES,
    WEIGHTS,
    GroupKey,
    PredictOutput,
    default_predict_output,
)
from qlm.groups.grouper import Grouper, ReclusterResult, RequestGroup

__all__ = [
    "DEFAULT_OUTPUT_TOKENS",
    "FEATURES",
    "WEIGHTS",
    "GroupKey",
    "Grouper",
    "GroupingConfig",
    "PredictOutput",
    "ReclusterResult",
    "RequestGroup",
    "default_predict_output",
]
