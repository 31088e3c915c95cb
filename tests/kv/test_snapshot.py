"""``KVSnapshot.without_drafter``: the model's layers of a snapshot whose trailing layers are a drafter's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import hurray_vllm as hv
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.errors import HurrayFormatError
from hurray_vllm.kv.snapshot import TARGET_LAYERS, SlidingWindows


def _with_drafter() -> hv.KVSnapshot:
    """The spec's example as an engine with a one-layer drafter exports it: four layers, three the model's."""
    snap = spec_example_snapshot(4)
    assert snap.fingerprint is not None
    return replace(
        snap,
        fingerprint=replace(snap.fingerprint, weights_digest="digest of the model's and the drafter's weights"),
        kv_scales=((1.0, 2.0), (3.0, 4.0), (5.0, 6.0), (7.0, 8.0)),
        windows=SlidingWindows((64, None, 64, None), ((0, 0),) * 4),
        extra={TARGET_LAYERS: 3, "other": 1},
    )


def test_without_drafter_keeps_the_models_layers_and_what_goes_with_them(tmp_path: Path) -> None:
    snap = _with_drafter()
    path = tmp_path / "drafter.hrry"
    hv.save(snap, path)
    loaded = hv.load(path)
    assert loaded.extra[TARGET_LAYERS] == 3  # carried in the header's free-form "extra"
    for got in (snap.without_drafter(), loaded.without_drafter()):
        assert got.num_layers == 3
        assert [t.layer_index for t in got.tensors()] == [0, 0, 1, 1, 2, 2]
        assert got.fingerprint is not None and got.fingerprint.num_layers == 3
        assert got.fingerprint.weights_digest is None  # the engine's digest covered the drafter's weights too
        assert got.kv_scales == snap.kv_scales[:3]  # type: ignore[index]
        assert got.windows is not None and got.windows.sizes == (64, None, 64) and len(got.windows.kv_start) == 3
        assert got.extra == {"other": 1}
        got.validate()
    # A snapshot that names no drafter is the model's already.
    plain = spec_example_snapshot(2)
    assert plain.without_drafter() is plain


@pytest.mark.parametrize("value", [0, 5, -1, "3", 3.0, True, None, [3]])
def test_without_drafter_refuses_what_is_not_a_layer_count(value: Any) -> None:
    snap = replace(_with_drafter(), extra={TARGET_LAYERS: value})
    with pytest.raises(HurrayFormatError) as err:
        snap.without_drafter()
    assert err.value.field == f"extra.{TARGET_LAYERS}"
