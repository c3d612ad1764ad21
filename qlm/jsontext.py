"""JSON text written by hand, as the standard library's encoder writes it, for the hot paths that
write a few known shapes per request (the global queue's message, the store's row document).

``json``'s encoder makes its C encoder anew at every call and walks a dict of every field; a
template with each value written by the very function the C encoder writes it with (the ones
below) gives the same text for a fraction of the CPU. A writer here returns ``None`` for a value
it does not write (another type, a float that is not finite), and its caller then takes ``json``
itself: tests compare both on many values.
"""

from __future__ import annotations

from collections.abc import Callable
from json.encoder import encode_basestring, encode_basestring_ascii

STRING = encode_basestring
"""A ``str`` as ``ensure_ascii=False`` writes it (C)."""
ASCII = encode_basestring_ascii
"""A ``str`` as ``ensure_ascii=True`` (``json.dumps``'s default) writes it (C)."""
FLOAT = float.__repr__
"""A finite ``float`` (and only a finite one: ``-INF < x < INF`` is false for NaN too)."""
INT = int.__repr__
"""An ``int``: the number, also for an ``IntEnum`` member."""
INF = float("inf")


def flat_object(
    value: object, string: Callable[[str], str], item_sep: str, key_sep: str
) -> str | None:
    """The JSON text of ``value`` when it is a ``dict`` of ``str`` keys to JSON scalars (a
    string, an exact ``int``, a finite ``float``, a ``bool``, ``None``), with the encoder's
    separators and string writer; ``None`` for anything else (the caller then uses ``json``).
    An exact ``int`` is written by ``str`` (``format``'s shortcut) and a ``float`` by ``repr``,
    as ``INT`` and ``FLOAT`` write them."""
    if type(value) is not dict:
        return None
    if not value:
        return "{}"
    text = "{"
    sep = ""
    for key, item in value.items():
        if type(key) is not str:
            return None
        kind = type(item)
        if kind is str:
            text = f"{text}{sep}{string(key)}{key_sep}{string(item)}"
        elif kind is float:
            if not -INF < item < INF:
                return None
            text = f"{text}{sep}{string(key)}{key_sep}{item!r}"
        elif kind is int:
            text = f"{text}{sep}{string(key)}{key_sep}{item}"
        elif item is None:
            text = f"{text}{sep}{string(key)}{key_sep}null"
        elif item is True:
            text = f"{text}{sep}{string(key)}{key_sep}true"
        elif item is False:
            text = f"{text}{sep}{string(key)}{key_sep}false"
        else:
            return None
        sep = item_sep
    return text + "}"
