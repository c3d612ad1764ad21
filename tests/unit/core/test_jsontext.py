"""``qlm.jsontext``: a flat object's text is the text ``json`` writes, or ``None``."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from qlm import jsontext


class _Float(float):
    pass


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(),
    st.sampled_from([math.nan, -math.inf, -0.0, 5e-324, 2**80, _Float(1.0), [1], {"a": 1}]),
)
KEYS = st.one_of(st.text(max_size=3), st.sampled_from([1, 2.5, None, True]))


@settings(max_examples=1000, deadline=None)
@given(st.dictionaries(KEYS, VALUES, max_size=4))
def test_a_flat_object_is_written_as_json_writes_it(value: dict[Any, Any]) -> None:
    compact = jsontext.flat_object(value, jsontext.STRING, ",", ":")
    dumped = jsontext.flat_object(value, jsontext.ASCII, ", ", ": ")
    assert (compact is None) == (dumped is None)
    if compact is not None:
        assert compact == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        assert dumped == json.dumps(value)
    else:  # a key or a value of another kind: some value is not a plain scalar, or a key
        assert not all(
            type(k) is str
            and (type(v) in (str, int, bool) or v is None or type(v) is float)
            and math.isfinite(v if type(v) is float else 0)
            for k, v in value.items()
        )


def test_what_is_not_a_dict_is_not_written() -> None:
    assert jsontext.flat_object([("a", 1)], jsontext.STRING, ",", ":") is None
    assert jsontext.flat_object({}, jsontext.STRING, ",", ":") == "{}"
