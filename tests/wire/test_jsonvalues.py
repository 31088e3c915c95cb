"""Bounded JSON: nesting is refused past MAX_DEPTH whether or not the walk that measures it runs."""

from __future__ import annotations

import pytest

from hurray_vllm.errors import HurrayFormatError
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
