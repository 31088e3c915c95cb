"""The .safetensors container: any safetensors reader opens it; it converts back losslessly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _rewritten(tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Path:
    """The spec example as .safetensors, its tensors changed by ``edit`` (its metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    src = tmp_path / "spec.safetensors"
    hv.save(spec_example_snapshot(), src)
    with safe_open(str(src), "pt") as f:
        meta = f.metadata()
    bad = tmp_path / "bad.safetensors"
    save_file(edit(load_file(str(src))), str(bad), metadata=meta)
    return bad


def _pool_as(
    view: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    return lambda t: {**t, "layers.0.key.page_pool": view(t["layers.0.key.page_pool"]).contiguous()}


@pytest.mark.parametrize(
    "edit",
    [
        _pool_as(lambda p: p.view(torch.float32)),  # the same bytes as float32 [5, 4, 2, 4]
        _pool_as(lambda p: p.view(torch.int16)),  # the same shape, another dtype
        _pool_as(lambda p: p.reshape(5, 4, 8, 2)),  # heads and head_dim swapped
    ],
    ids=["float32", "int16", "transposed"],
)
def test_a_page_pool_must_be_the_tensor_its_descriptor_declares(
    tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
) -> None:
    """Found by a review: a pool of the right byte count was reinterpreted as the descriptor's dtype and shape,
    so hurray-vllm read another tensor than every other safetensors reader sees."""
    require("safetensors")
    bad = _rewritten(tmp_path, edit)
    with pytest.raises(hv.HurrayFormatError) as exc:
        hv.load(bad)
    assert exc.value.field == "layers.0.key.page_pool" and "float16 [5, 4, 2, 8]" in str(exc.value)
    assert not hv.validate(bad).ok


@pytest.mark.parametrize(
    ("edit", "field", "says"),
    [
        (lambda t: {k: v for k, v in t.items() if k != "token_ptr"}, "snapshot.token_ptr", "no token_ptr"),
        (lambda t: {k: v for k, v in t.items() if k != "token_ids"}, "snapshot.token_ids", "no token_ids"),
        (
            lambda t: {
                **t,
                **{k.replace("layers.0.", "layers.4."): v.clone() for k, v in t.items() if "layers.0." in k},
            },
            "safetensors.tensors",
            "'layers.4.key.block_table'",
        ),
        (lambda t: {**t, "garbage": torch.zeros(3)}, "safetensors.tensors", "'garbage'"),
    ],
    ids=["token_ids_only", "token_ptr_only", "layer_past_num_layers", "stray"],
)
def test_tensors_the_snapshot_does_not_account_for_are_refused_not_dropped(
    tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], field: str, says: str
) -> None:
    """Found by a review: such tensors were silently dropped (token ids lost), and the file called valid."""
    require("safetensors")
    bad = _rewritten(tmp_path, edit)
    with pytest.raises(hv.HurrayFormatError) as exc:
        hv.load(bad)
    assert exc.value.field == field and says in str(exc.value)
    assert not hv.validate(bad).ok


def test_a_stray_tensor_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the snapshot's own tensors are read: a stray one, however large, is named without being loaded."""
    require("safetensors")
    import safetensors

    bad = _rewritten(tmp_path, lambda t: {**t, "huge": torch.zeros(1 << 20, dtype=torch.uint8)})
    real = safetensors.safe_open
    read: list[str] = []

    class Spy:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.f = real(*args, **kwargs)

        def __enter__(self) -> Spy:
            self.f.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.__exit__(*exc)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    with pytest.raises(hv.HurrayFormatError, match="'huge'"):
        hv.load(bad)
    assert "huge" not in read


@pytest.mark.parametrize(
    "fail",
    ["open: MemoryError", "open: os error 12", "get_tensor: MemoryError", "get_tensor: os error 12"],
)
def test_memory_running_out_is_enomem_not_a_verdict_on_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: str
) -> None:
    """Found by a review: out of memory while reading a .safetensors file was a HurrayFormatError, for which a
    consumer moves a good file aside; the other readers raise OSError(ENOMEM) (io.read_error)."""
    require("safetensors")
    import errno

    import safetensors

    path = tmp_path / "s.safetensors"
    hv.save(spec_example_snapshot(), path)
    where, _, what = fail.partition(": ")
    error = MemoryError("Cannot allocate memory") if what == "MemoryError" else None
    real = safetensors.safe_open

    def raise_it() -> None:
        raise error or safetensors.SafetensorError(
            "Error while deserializing header: Cannot allocate memory (os error 12)"
        )

    class Failing:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if where == "open":
                raise_it()
            self.f = real(*args, **kwargs)

        def __enter__(self) -> Failing:
            self.f.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.__exit__(*exc)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def get_tensor(self, name: str) -> torch.Tensor:
            raise_it()
            raise AssertionError

    monkeypatch.setattr(safetensors, "safe_open", Failing)
    with pytest.raises(OSError) as exc:
        hv.load(path)
    assert exc.value.errno == errno.ENOMEM and not isinstance(exc.value, hv.HurrayFormatError)


def test_a_header_quoting_an_os_error_is_still_a_data_error(tmp_path: Path) -> None:
    """Out-of-memory is recognised only where the library reports it, never in input the error quotes."""
    require("safetensors")
    import json
    import struct

    header = json.dumps({"a": {"dtype": "(os error 12)", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(hv.HurrayFormatError) as exc:
        hv.load(path)
    assert exc.value.field == "safetensors"


def test_without_the_safetensors_package_the_install_is_wrong_not_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: a missing package was a HurrayFormatError, `convert x.hrry y.safetensors` "invalid input"."""
    require("safetensors")
    import sys

    written = tmp_path / "s.safetensors"
    hv.save(spec_example_snapshot(), written)
    hv.save(spec_example_snapshot(), tmp_path / "s.hrry")
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # as if not installed
    for call in (lambda: hv.save(spec_example_snapshot(), tmp_path / "t.safetensors"), lambda: hv.load(written)):
        with pytest.raises(hv.HurrayArgumentError) as exc:
            call()
        assert exc.value.field == "safetensors" and "pip install 'hurray-vllm[safetensors]'" in str(exc.value)
        assert isinstance(exc.value, hv.HurrayFormatError)  # as 0.1 raised it: ImportArgumentError
    assert main(["convert", "-q", str(tmp_path / "s.hrry"), str(tmp_path / "u.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "invalid input" not in err and "hurray-vllm[safetensors]" in err, err
    for command in ("inspect", "validate"):
        assert main([command, str(written)]) == 2
        captured = capsys.readouterr()
        assert "hurray-vllm[safetensors]" in captured.err and "invalid" not in captured.out + captured.err, captured


def _with_metadata(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """The spec example as .safetensors, its descriptors (the metadata's JSON) changed by ``edit``."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    src = tmp_path / "spec.safetensors"
    hv.save(spec_example_snapshot(), src)
    with safe_open(str(src), "pt") as f:
        meta = f.metadata()
    descriptors = json.loads(meta["descriptors"])
    edit(descriptors)
    bad = tmp_path / "bad.safetensors"
    save_file(load_file(str(src)), str(bad), metadata={**meta, "descriptors": json.dumps(descriptors)})
    return bad


def _swap_roles(d: dict[str, Any]) -> None:
    d["layers.0.key"], d["layers.0.value"] = d["layers.0.value"], d["layers.0.key"]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda t: _with_metadata(t, _swap_roles), "kv_role"),
        (
            lambda t: _rewritten(t, lambda x: {**x, "layers.0.value.seq_lens": torch.tensor([5, 4])}),
            "snapshot.structure",
        ),
    ],
    ids=["roles_swapped", "value_seq_lens_differ"],
)
def test_what_no_other_container_carries_is_refused_even_permissively(
    tmp_path: Path, edit: Callable[[Path], Path], field: str
) -> None:
    """Found by a review: a permissive read waived these, loading a layer's pools swapped (key and value
    descriptors exchanged) or a value's own lengths, which a .hrry file or stream cannot hold."""
    require("safetensors")
    bad = edit(tmp_path)
    for permissive in (False, True):
        with pytest.raises(hv.HurrayFormatError) as exc:
            hv.load(bad, permissive=permissive)
        assert exc.value.field == field
        checked = hv.validate(bad, permissive=permissive)
        assert [v.invariant for v in checked.errors][:1] == [field]


def test_a_uint32_page_index_of_2_to_the_32_is_refused_not_wrapped_to_page_0(tmp_path: Path) -> None:
    """[2^32, 1, 0] as uint32 wire bytes is [0, 1, 0]: the file would load as the table it does not hold."""
    require("safetensors")

    def table(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        assert t["layers.0.key.block_table"].tolist() == [0, 1, 0]
        return {**t, "layers.0.key.block_table": torch.tensor([1 << 32, 1, 0])}

    bad = _rewritten(tmp_path, table)
    with pytest.raises(hv.HurrayFormatError, match=r"\[0, 4294967295\] for uint32") as exc:
        hv.load(bad)
    assert exc.value.field == "layers.0.key.block_table"
    assert not hv.validate(bad).ok
