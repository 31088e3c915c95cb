"""The .safetensors container: any safetensors reader opens it; it converts back losslessly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import require
from hypothesis import given
from strategies import same_snapshot, snapshots

import hurray_vllm as hv
from hurray_vllm.app.cli import main
from hurray_vllm.app.demo import spec_example_snapshot


@given(snapshots())
def test_round_trip(tmp_path_factory: pytest.TempPathFactory, snap: hv.KVSnapshot) -> None:
    require("safetensors")
    path = tmp_path_factory.mktemp("st") / "snap.safetensors"
    hv.save(snap, path)
    assert hv.detect_format(path) == "safetensors"
    assert same_snapshot(snap, hv.load(path))


def test_plain_safetensors_readers_see_named_tensors(tmp_path: Path) -> None:
    st = require("safetensors.torch")
    from safetensors import safe_open

    snap = spec_example_snapshot(num_layers=2)
    hv.save(snap, tmp_path / "s.safetensors")
    tensors = st.load_file(str(tmp_path / "s.safetensors"))
    assert torch.equal(tensors["layers.1.value.page_pool"], snap[1, "value"].page_pool)
    assert tensors["layers.0.key.block_table"].tolist() == [0, 1, 0]
    assert tensors["layers.0.key.seq_lens"].tolist() == [6, 3]
    assert tensors["token_ptr"].tolist() == [0, 7, 11]
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == "hurray-vllm.kv_snapshot"
        assert "layers.0.key" in meta["descriptors"]
        assert f.get_slice("layers.0.key.page_pool").get_shape() == [5, 4, 2, 8]


def test_convert_between_all_formats_and_repage(tmp_path: Path) -> None:
    require("safetensors")
    snap = spec_example_snapshot(num_layers=2)
    hv.save(snap, tmp_path / "s.hrry")
    assert main(["convert", "-q", str(tmp_path / "s.hrry"), str(tmp_path / "s.safetensors")]) == 0
    assert main(["convert", "-q", str(tmp_path / "s.safetensors"), str(tmp_path / "back.hrrs")]) == 0
    assert same_snapshot(hv.load(tmp_path / "back.hrrs"), snap)
    assert main(["convert", "-q", "--page-size", "2", str(tmp_path / "s.hrry"), str(tmp_path / "p2.safetensors")]) == 0
    p2 = hv.load(tmp_path / "p2.safetensors")
    assert p2.page_size == 2
    for s in range(2):
        assert torch.equal(p2[1, "key"].to_dense(s), snap[1, "key"].to_dense(s))
    assert main(["inspect", "-q", str(tmp_path / "p2.safetensors")]) == 0
    assert main(["validate", "-q", str(tmp_path / "p2.safetensors")]) == 0


def test_foreign_safetensors_is_refused(tmp_path: Path) -> None:
    st = require("safetensors.torch")
    st.save_file({"w": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(hv.HurrayFormatError, match="not a hurray-vllm snapshot"):
        hv.load(tmp_path / "model.safetensors")
    (tmp_path / "junk.safetensors").write_bytes((20).to_bytes(8, "little") + b"{not json")
    with pytest.raises(hv.HurrayFormatError):
        hv.load(tmp_path / "junk.safetensors")


def test_a_page_pool_of_no_dimensions_is_named_not_a_torch_error(tmp_path: Path) -> None:
    """load_safetensors has the boundary load has: a 0-d page pool is refused naming it, never a RuntimeError."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from hurray_vllm.containers.safetensors import load_safetensors

    src = tmp_path / "spec.safetensors"
    hv.save(spec_example_snapshot(), src)
    with safe_open(str(src), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(src))
    tensors["layers.0.key.page_pool"] = torch.tensor(1.0, dtype=torch.float16)
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    for read in (lambda: load_safetensors(bad), lambda: hv.load(bad)):
        with pytest.raises(hv.HurrayFormatError) as exc:
            read()
        assert exc.value.field == "layers.0.key.page_pool"
    assert not hv.validate(bad).ok
