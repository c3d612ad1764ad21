"""``fast_init``: the classes it decorates are built exactly as ``@dataclass`` builds them."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import InitVar, dataclass, field
from typing import Any

import pytest

import qlm.api.app  # noqa: F401 - imports every class on the submission path
from qlm.domain import Tier
from qlm.frozen import DECORATED, fast_init
from qlm.global_queue import MessageError, QueuedRequest


def test_every_decorated_class_keeps_the_signature_dataclass_wrote() -> None:
    names = {cls.__name__ for cls in DECORATED}
    assert {"Submission", "NewRequest", "QueuedRequest", "Verdict", "Principal"} <= names
    for cls in DECORATED:
        original = cls.__init__.dataclass_init  # type: ignore[misc]
        assert str(inspect.signature(cls.__init__)) == str(inspect.signature(original)), cls
        assert cls.__init__.__annotations__ == original.__annotations__


def built_both_ways(cls: type, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    quick = cls(*args, **kwargs)
    slow = object.__new__(cls)
    cls.__init__.dataclass_init(slow, *args, **kwargs)  # type: ignore[misc]
    return quick, slow


def same_slots(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert type(x) is type(y) and repr(x) == repr(y), f.name


def sample_args(cls: type) -> list[dict[str, Any]]:
    """Calls of ``cls``: its required fields only, then every field given."""
    values = {int: 3, float: 2.5, str: "s", bool: True}
    required: dict[str, Any] = {}
    every: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        guess = next((v for t, v in values.items() if f.type.startswith(t.__name__)), None)
        if f.type.startswith(("dict", "Mapping")):
            guess = {}
        if f.type.startswith("list"):
            guess = []
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required[f.name] = guess
        every[f.name] = guess
    return [required, every]


def test_every_decorated_class_sets_what_dataclass_sets() -> None:
    for cls in DECORATED:
        if cls is QueuedRequest:
            continue  # its values are checked: below
        for kwargs in sample_args(cls):
            same_slots(*built_both_ways(cls, **kwargs))
            args = list(kwargs.values())
            if args and list(kwargs) == [f.name for f in dataclasses.fields(cls)][: len(args)]:
                same_slots(*built_both_ways(cls, *args))  # positionally


def test_a_queued_request_is_built_and_checked_as_before() -> None:
    given: dict[str, Any] = dict(
        id="r", model="m", prompt_tokens=1, max_tokens=2, slo_e2e_s=3, submitted_at=4.0
    )
    quick, slow = built_both_ways(QueuedRequest, **given, tier=Tier.BATCH)  # made an int
    same_slots(quick, slow)
    assert quick.tier == 2 and type(quick.tier) is int
    other = QueuedRequest(**given)
    assert other.sampling is not quick.sampling and other.labels is not quick.labels
    with pytest.raises(MessageError, match="prompt_tokens"):
        QueuedRequest(**given | {"prompt_tokens": 0})
    with pytest.raises(dataclasses.FrozenInstanceError):
        quick.id = "s"  # type: ignore[misc]


def test_defaults_factories_and_fields_outside_init_are_dataclasses() -> None:
    made: list[int] = []

    def factory() -> list[int]:
        made.append(1)
        return []

    @fast_init
    @dataclass(frozen=True, slots=True)
    class C:
        a: int
        b: list[int] = field(default_factory=factory)
        c: str = "c"
        d: int = field(default=7, init=False)
        e: list[int] = field(default_factory=list, init=False)
        f: int = field(init=False, default=0)

        def __post_init__(self) -> None:
            object.__setattr__(self, "f", self.a + 1)

    quick, slow = built_both_ways(C, 1)
    same_slots(quick, slow)
    assert (quick.d, quick.e, quick.f, len(made)) == (7, [], 2, 2)
    same_slots(*built_both_ways(C, 1, [2], c="x"))
    assert len(made) == 2
    with pytest.raises(TypeError):
        C()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        C(1, [], "c", 4)  # type: ignore[call-arg]


def test_classes_it_cannot_build_alike_are_refused() -> None:
    @dataclass(slots=True)
    class Mutable:
        a: int

    @dataclass(frozen=True)
    class Unslotted:
        a: int

    @dataclass(frozen=True, slots=True)
    class WithInitVar:
        a: int
        b: InitVar[int]

    @dataclass(frozen=True, slots=True, kw_only=True)
    class KeywordOnly:
        a: int

    for cls in (Mutable, Unslotted, WithInitVar, KeywordOnly):
        with pytest.raises(TypeError, match="fast_init"):
            fast_init(cls)
