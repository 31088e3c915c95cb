"""Bounded, typed decoding of the JSON metadata inputs carry (snapshot headers, safetensors metadata).

Every reader of metadata goes through :func:`loads_bounded` and
:class:`Fields`, so that malformed or hostile metadata fails one way, with a
:class:`~hurray_vllm.errors.HurrayFormatError` naming the field, and never
as a ``TypeError``, ``OverflowError`` or ``RecursionError`` from deep inside
a constructor:

* :func:`loads_bounded` refuses ``NaN``/``Infinity``, floats that overflow,
  integers longer than 20 digits, nesting deeper than :data:`MAX_DEPTH`,
  and anything that is not UTF-8 JSON;
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
from typing import Any

from ..errors import HurrayFormatError

__all__ = ["MAX_DEPTH", "Fields", "loads_bounded"]

#: The deepest nesting of arrays and objects accepted (hurray-vllm writes at most 3).
MAX_DEPTH = 32
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


def loads_bounded(raw: bytes | str, field: str) -> Any:
    """Parse UTF-8 JSON with every size and value bounded; :class:`HurrayFormatError` (``field``) otherwise."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
        value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise HurrayFormatError(field, f"JSON nested deeper than {MAX_DEPTH} levels") from None
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
