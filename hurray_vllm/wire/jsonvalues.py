"""Bounded, typed decoding of the JSON metadata inputs carry (snapshot headers, safetensors metadata).

Every reader of metadata goes through :func:`loads_bounded` and
:class:`Fields`, so that malformed or hostile metadata fails one way, with a
:class:`~hurray_vllm.errors.HurrayFormatError` naming the field, and never
as a ``TypeError``, ``OverflowError`` or ``RecursionError`` from deep inside
a constructor:

* :func:`loads_bounded` refuses ``NaN``/``Infinity``, floats that overflow,
  integers longer than 20 digits, nesting deeper than :data:`MAX_DEPTH`,
  more than :data:`MAX_VALUES` values, an object with a key twice, and
  anything that is not UTF-8 JSON;
* :class:`Fields` reads one object's members with their types checked
  (an ``int`` is never a ``bool`` or a ``float``) and their ranges bounded.

Example:
    >>> f = Fields(loads_bounded(b'{"num_layers": 32, "dtype": "bfloat16"}', "meta"), "meta")
    >>> f.integer("num_layers", hi=1 << 16), f.string("dtype")
    (32, 'bfloat16')
    >>> f.integer("dtype")
    Traceback (most recent call last):
    ...
    hurray_vllm.errors.HurrayFormatError: meta.dtype: expected an integer, found str
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ..errors import HurrayFormatError

__all__ = ["MAX_DEPTH", "MAX_VALUES", "Fields", "loads_bounded"]

#: The deepest nesting of arrays and objects accepted (hurray-vllm writes at most 3).
MAX_DEPTH = 32
#: The most values (numbers, strings, arrays, objects, literals; object keys aside) one text may hold, refused
#: before anything is built. Each costs the parser a Python object: 16 MiB of ``[{},{},...]`` (5.6 million
#: objects) once cost +787 MiB and 10 s; at this bound the worst case (empty objects) is ~150 MB. What
#: hurray-vllm writes holds a few values per sequence and layer at most: ``request_ids`` (one per sequence),
#: ``states.positions`` (one per sequence) and ``windows.kv_start`` (one per layer and sequence, the largest:
#: a 62-layer sliding-window model with 4,096 sequences in one snapshot, far beyond an engine's batch, is
#: 254,000). The bound leaves 4 times that, and a million request ids.
MAX_VALUES = 1 << 20
#: Decimal digits of the longest integer accepted (2^64 has 20).
_MAX_INT_DIGITS = 20
_MISSING: Any = object()


def _int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"the number {text[:40]} overflows a float")
    return x


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class _DuplicateKey(Exception):
    """Raised by the object hook (not a ValueError: the parse's own errors are told apart from it)."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))  # type: ignore[func-returns-value]
    return obj


#: A JSON string, escapes included (``re.DOTALL``: a backslash before any character).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def _values_at_most(text: str) -> int:
    """How many values ``text`` holds at most, if it is JSON (exact but for one more per empty array or object).

    Every value but the outermost is an array's element or an object's member: the first of its
    container, or after a comma. So the values are 1 + the commas + the non-empty containers, commas
    and brackets inside strings aside. Counted on the whole text first (C speed, no copy: strings only
    make it more); only a text over :data:`MAX_VALUES` there is counted again without its strings.
    """
    n = 1 + text.count(",") + text.count("[") + text.count("{")
    if n > MAX_VALUES and '"' in text:
        bare = _STRING.sub("", text)
        n = 1 + bare.count(",") + bare.count("[") + bare.count("{")
    return n


def loads_bounded(raw: bytes | str, field: str) -> Any:
    """Parse UTF-8 JSON with every size and value bounded; :class:`HurrayFormatError` (``field``) otherwise.

    An object with a key twice is refused: which of the two a reader keeps is up to the reader
    (Python's ``json`` the last, others the first), so the data would read one way here and another there.
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
        if _values_at_most(text) > MAX_VALUES:
            raise HurrayFormatError(field, f"JSON of more than {MAX_VALUES} values")
        value = json.loads(
            text, parse_int=_int, parse_float=_float, parse_constant=_constant, object_pairs_hook=_object
        )
    except _DuplicateKey as dup:
        raise HurrayFormatError(field, f"an object has the key {dup.args[0]!r} twice (duplicate key)") from None
    except RecursionError:
        raise HurrayFormatError(field, f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except HurrayFormatError:
        raise
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise HurrayFormatError(field, f"not valid UTF-8 JSON: {exc}") from None
    # A text that opens at most MAX_DEPTH arrays and objects cannot nest deeper: no walk needed.
    if not isinstance(text, str) or text.count("[") + text.count("{") > MAX_DEPTH:
        _check_depth(value, field)
    return value


def _check_depth(value: Any, field: str) -> None:
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > MAX_DEPTH:
                raise HurrayFormatError(field, f"JSON nested deeper than {MAX_DEPTH} levels")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))


def _kind(v: Any) -> str:
    return "null" if v is None else type(v).__name__


class Fields:
    """The members of one JSON object, read with their types and ranges checked.

    Args:
        obj: The decoded value that must be an object (a ``dict`` with string keys).
        field: Its name in error messages (``"snapshot.meta"``); a member ``k`` is ``field.k``.

    Raises:
        HurrayFormatError: ``obj`` is not an object.
    """

    def __init__(self, obj: Any, field: str) -> None:
        if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
            raise HurrayFormatError(field, f"expected a JSON object, found {_kind(obj)}")
        self.obj: dict[str, Any] = obj
        self.field = field

    def _get(self, key: str, default: Any) -> Any:
        if key in self.obj:
            return self.obj[key]
        if default is _MISSING:
            raise HurrayFormatError(f"{self.field}.{key}", "missing")
        return default

    def _fail(self, key: str, message: str) -> HurrayFormatError:
        return HurrayFormatError(f"{self.field}.{key}", message)

    def integer(self, key: str, *, lo: int = 0, hi: int = (1 << 63) - 1, default: Any = _MISSING) -> Any:
        """An integer member in ``[lo, hi]`` (``default`` when absent; required otherwise)."""
        v = self._get(key, default)
        if v is default and default is not _MISSING:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._fail(key, f"expected an integer, found {_kind(v)}")
        if not lo <= v <= hi:
            raise self._fail(key, f"{v} is outside [{lo}, {hi}]")
        return v

    def string(self, key: str, *, max_len: int = 4096, default: Any = _MISSING) -> Any:
        """A string member of at most ``max_len`` characters (``default`` when absent)."""
        v = self._get(key, default)
        if v is default and default is not _MISSING:
            return v
        if not isinstance(v, str):
            raise self._fail(key, f"expected a string, found {_kind(v)}")
        if len(v) > max_len:
            raise self._fail(key, f"a string of {len(v)} characters (at most {max_len})")
        return v

    def optional_obj(self, key: str) -> Fields | None:
        """A nested object member, or None when it is absent or ``null``."""
        v = self.obj.get(key)
        return None if v is None else Fields(v, f"{self.field}.{key}")

    def optional_str_list(self, key: str, *, max_items: int = 1 << 20, max_len: int = 4096) -> tuple[str, ...] | None:
        """A list of strings, or None when absent or ``null``."""
        v = self.obj.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or len(v) > max_items:
            raise self._fail(key, f"expected a list of at most {max_items} strings, found {_kind(v)}")
        for i, x in enumerate(v):
            if not isinstance(x, str) or len(x) > max_len:
                raise self._fail(key, f"item {i}: expected a string of at most {max_len} characters, found {_kind(x)}")
        return tuple(v)

    def optional_dict(self, key: str) -> dict[str, Any]:
        """A free-form object member (its keys strings), ``{}`` when absent or ``null``."""
        v = self.obj.get(key)
        return {} if v is None else dict(Fields(v, f"{self.field}.{key}").obj)
