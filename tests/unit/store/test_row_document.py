"""The row document ``add_requests_async`` sends PostgreSQL: written by a template, it is the text
``json.dumps`` writes for the rows' values (nested JSON columns keep that text in the store)."""

from __future__ import annotations

import json
import math
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.domain import Tier
from qlm.store import ingest
from qlm.store.rows import NewRequest
from tests.contract.test_store import new_request


class _Float(float):
    pass


class _Text(str):
    pass


def dumped(news: list[Any]) -> str:
    """The general path: ``json.dumps`` of a dict of each row's values."""
    return json.dumps([ingest._given_values(n) for n in news])


USUAL = [
    new_request(0),
    new_request(
        1,
        prompt='héllo 😀 "quoted" \\ back\nslash\t\x00\u2028',
        sampling={"temperature": 0.7, "seed": 2**70, "echo": True, "n": None, "x": False},
        slo_ttft_s=2.5,
        submitted_at=1_767_000_000.123456,
        tier=Tier.INTERACTIVE,
        slo_class="chät",
        labels=(("team", "t1"), ("zone", "é")),
        idempotency_key="kéy",
    ),
    new_request(
        2,
        messages=[{"role": "user", "content": "hi ü", "name": None}],
        sampling={"stop": ["\n"], "tools": [{"type": "function"}], "response_format": {}},
        tier=2,
    ),
    new_request(3, prompt="", sampling=MappingProxyType({"top_p": 1e-07}), slo_e2e_s=1e16),
    new_request(4, labels=(("a", "1"), ("a", "2"), ("b", "ß"))),  # a key twice: the last wins
]
"""Rows of every usual kind: each is written by the template (``_row_document``)."""
UNUSUAL = [
    new_request(5, slo_e2e_s=30, submitted_at=100),  # ints as floats
    new_request(6, slo_e2e_s=_Float(3.5)),
    new_request(7, prompt=_Text("x")),
    new_request(8, max_tokens=Tier.BATCH),
    new_request(9, sampling={"temperature": float("nan")}),
    new_request(10, sampling={1: "key not a string", "b": _Float(0.5)}),
]
"""Rows of values of other types, written (in whole or in part) by ``json.dumps``."""


@pytest.mark.parametrize("new", USUAL + UNUSUAL, ids=lambda n: n.id)
def test_the_template_writes_the_text_json_dumps_writes(new: NewRequest) -> None:
    assert ingest._rows_document([new]) == dumped([new])
    assert ingest._row_document(new) == json.dumps(ingest._given_values(new))


def test_a_batch_is_the_list_of_its_rows() -> None:
    news = USUAL + UNUSUAL
    assert ingest._rows_document(news) == dumped(news)
    assert json.loads(ingest._rows_document(news))[2]["messages"][0]["content"] == "hi ü"


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=4),
    st.sampled_from(
        [math.nan, math.inf, -0.0, 1e300, 5e-324, 2**80, _Float(1.0), _Text("t"), *Tier]
    ),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=2),
    st.dictionaries(st.one_of(st.text(max_size=2), st.integers()), SCALARS, max_size=3),
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "id": st.one_of(st.text(), VALUES),
    "tenant": st.one_of(st.text(), VALUES),
    "model": st.one_of(st.text(), VALUES),
    "slo_class": st.one_of(st.text(), VALUES),
    "prompt": st.one_of(st.none(), st.text(), VALUES),
    "messages": st.one_of(st.none(), st.lists(VALUES, max_size=2)),
    "prompt_tokens": st.one_of(st.integers(), VALUES),
    "max_tokens": st.one_of(st.integers(), VALUES),
    "sampling": st.dictionaries(st.one_of(st.text(max_size=3), SCALARS), VALUES, max_size=3),
    "slo_e2e_s": st.one_of(st.floats(), VALUES),
    "slo_ttft_s": st.one_of(st.none(), st.floats(), VALUES),
    "tier": st.one_of(st.sampled_from(list(Tier)), st.integers(), VALUES),
    "labels": st.lists(
        st.tuples(st.one_of(st.text(max_size=2), SCALARS), st.one_of(st.text(), SCALARS)),
        max_size=3,
    ).map(tuple),
    "idempotency_key": st.one_of(st.none(), st.text(), VALUES),
    "submitted_at": st.one_of(st.floats(), VALUES),
}


def _outcome(write: Any, new: Any) -> Any:
    """What ``write`` gives for ``new``: its text, or the type of the error it raises."""
    try:
        return write(new)
    except (ValueError, TypeError, OverflowError) as exc:
        return type(exc)


@settings(max_examples=2000, deadline=None)
@given(st.data())
def test_the_template_writes_what_json_dumps_writes_for_any_values(data: st.DataObject) -> None:
    """Any values of any type, in any field (a ``NewRequest`` checks none): the same text as
    ``json.dumps``, or the same error."""
    usual = {name: getattr(USUAL[1], name) for name in FIELDS}
    changed = data.draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3))
    values = usual | {name: data.draw(FIELDS[name], label=name) for name in changed}
    for name in ("sampling", "labels"):  # drawn every time: mostly flat, so the template writes
        values[name] = data.draw(FIELDS[name], label=name)
    new = SimpleNamespace(**values)
    assert _outcome(ingest._row_document, new) == _outcome(
        lambda n: json.dumps(ingest._given_values(n)), new
    )
