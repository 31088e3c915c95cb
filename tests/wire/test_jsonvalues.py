"""Bounded JSON: nesting is refused past MAX_DEPTH whether or not the walk that measures it runs."""

from __future__ import annotations

import pytest

from hurray_vllm.errors import HurrayFormatError
from hurray_vllm.wire import jsonvalues
from hurray_vllm.wire.jsonvalues import MAX_DEPTH, loads_bounded


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_nesting_up_to_the_bound_is_read_and_beyond_it_refused() -> None:
    assert loads_bounded(_nested(MAX_DEPTH), "m") is not None
    assert loads_bounded(_nested(MAX_DEPTH).encode(), "m") is not None
    for text in (_nested(MAX_DEPTH + 1), '{"a": ' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1)):
        with pytest.raises(HurrayFormatError) as err:
            loads_bounded(text, "m")
        assert err.value.field == "m" and "deeper" in str(err.value)


def test_brackets_inside_strings_do_not_make_shallow_json_deep() -> None:
    # More brackets than MAX_DEPTH in the text (the walk runs), none of them nesting.
    value = loads_bounded('{"a": "' + "[{" * 100 + '", "b": [[1], [2]]}', "m")
    assert value["b"] == [[1], [2]]
    # Many sibling containers: more than MAX_DEPTH of them, two levels deep.
    assert len(loads_bounded("[" + ",".join(["{}"] * 100) + "]", "m")) == 100


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"num_layers": 4, "num_layers": 1}', "num_layers"),
        ('{"extra": {"a": 1, "b": 2, "a": 3}}', "a"),
        ('[{"x": [1], "x": [1]}]', "x"),
    ],
)
def test_a_duplicate_key_is_refused_naming_the_field_and_the_key(text: str, key: str) -> None:
    """Found by a review: the last of two members won, silently; a reader that keeps the first sees other data."""
    for raw in (text, text.encode()):
        with pytest.raises(HurrayFormatError) as err:
            loads_bounded(raw, "snapshot.meta")
        assert err.value.field == "snapshot.meta" and repr(key) in str(err.value) and "duplicate" in str(err.value)
    # The same keys in different objects are no duplicate.
    assert loads_bounded('{"a": {"a": 1}, "b": [{"a": 1}, {"a": 2}]}', "m")["b"][1] == {"a": 2}


def test_breadth_is_bounded_before_anything_is_built() -> None:
    """Found by a review: 16 MiB of ``[{},{},...]`` (5.6 million objects) cost +787 MiB and 10 s."""
    import time
    import tracemalloc

    raw = b"[" + b"{}," * (16 * 2**20 // 3) + b"{}]"
    tracemalloc.start()
    try:
        start = time.perf_counter()
        with pytest.raises(HurrayFormatError) as err:
            loads_bounded(raw, "snapshot.meta")
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.field == "snapshot.meta" and "values" in str(err.value)
    assert peak < 3 * len(raw), f"{peak} bytes allocated"  # the text decoded, and nothing per value
    assert elapsed < 2.0, f"{elapsed:.1f} s"
    n = jsonvalues.MAX_VALUES
    for many in ("[" + "1," * n + "1]", "[" + '"ab",' * n + '"ab"]', "[" + "[]," * n + "[]]"):
        with pytest.raises(HurrayFormatError, match="values"):
            loads_bounded(many, "m")


def test_breadth_up_to_the_bound_is_read_and_separators_inside_strings_do_not_count() -> None:
    n = jsonvalues.MAX_VALUES
    assert len(loads_bounded("[" + ",".join(["0"] * (n - 1)) + "]", "m")) == n - 1
    # More commas and brackets than MAX_VALUES, all inside strings: a handful of values.
    text = '{"extra": {"note": "' + ",[{" * n + '", "escaped \\" quote": ",,,"}}'
    assert loads_bounded(text, "m")["extra"]['escaped " quote'] == ",,,"
