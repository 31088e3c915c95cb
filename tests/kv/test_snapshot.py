"""``KVSnapshot``'s own rules: ``without_drafter`` (the model's layers of a snapshot whose trailing layers are a
drafter's), and the structure every layer and role shares (``validate``, as the readers apply it)."""

from __future__ import annotations

import io
import math
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import snapshots
from synthetic import save_unchecked

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


def _other_lens(t: hv.BlockPagedTensor) -> hv.BlockPagedTensor:
    """``t`` with lengths 5 and 4 instead of 6 and 3: the same pages, so valid on its own."""
    return replace(t, seq_lens=torch.tensor([5, 4]), num_tokens=None)


def test_a_value_whose_seq_lens_differ_from_its_keys_is_a_violation() -> None:
    """A layer group stores the key's seq_lens only: a value's own would be replaced on write, silently."""
    snap = spec_example_snapshot(2)
    bad = replace(snap, values=(snap.values[0], _other_lens(snap.values[1])))
    assert bad.values[1].validate().ok  # nothing wrong with the tensor itself
    found = [v for v in bad.validate().violations if v.invariant == "snapshot.structure"]
    assert len(found) == 1 and "layer 1 value and key differ in seq_lens" in found[0].message
    assert "sequence 0: 5 tokens and 6" in found[0].message


def test_a_layer_whose_seq_lens_differ_from_layer_0s_is_a_violation_and_not_loaded(tmp_path: Path) -> None:
    snap = spec_example_snapshot(3)
    bad = replace(
        snap, keys=(*snap.keys[:2], _other_lens(snap.keys[2])), values=(*snap.values[:2], _other_lens(snap.values[2]))
    )
    found = [v for v in bad.validate().violations if v.invariant == "snapshot.structure"]
    assert [v.message for v in found] == ["layer 2 and layer 0 differ in seq_lens (sequence 0: 5 tokens and 6)"]
    with pytest.raises(hv.HurrayFormatError) as refused:
        hv.save(bad, tmp_path / "bad.hrry")  # nothing load refuses is written
    assert refused.value.field == "snapshot.structure" and not (tmp_path / "bad.hrry").exists()
    save_unchecked(bad, tmp_path / "bad.hrry")  # a writer that does not check: the reader refuses it
    with pytest.raises(HurrayFormatError) as err:
        hv.load(tmp_path / "bad.hrry")
    assert err.value.field == "snapshot.structure"


def test_equal_seq_lens_in_other_tensors_are_one_structure(tmp_path: Path) -> None:
    """Layers of different KV cache groups (a sliding-window hybrid) hold their own tensors of the same lengths."""
    snap = spec_example_snapshot(2)
    lens = torch.tensor([6, 3], dtype=torch.int32)  # another tensor, another dtype: the same lengths
    other = [replace(t, seq_lens=lens.clone()) for t in (snap.keys[1], snap.values[1])]
    same = replace(snap, keys=(snap.keys[0], other[0]), values=(snap.values[0], other[1]))
    assert same.validate().ok
    hv.save(same, tmp_path / "same.hrry")
    assert hv.load(tmp_path / "same.hrry").seq_lens == [6, 3]


@pytest.mark.parametrize(
    "windows",
    [SlidingWindows((64, None, 64, None), ((-1, 0),) * 4), SlidingWindows((0, None, 64, None), ((0, 0),) * 4)],
    ids=["negative start", "window of 0"],
)
def test_validate_refuses_the_windows_the_reader_refuses(windows: SlidingWindows, tmp_path: Path) -> None:
    """validate == load: save() used to write such a file, which load() then refused."""
    snap = replace(_with_drafter(), windows=windows)
    assert not snap.validate().ok
    with pytest.raises(HurrayFormatError):
        hv.save(snap, tmp_path / "w.hrry")


def _invariants(snap: hv.KVSnapshot) -> list[str]:
    return [v.invariant for v in snap.validate().violations]


def test_layers_of_other_head_geometry_or_dtype_are_a_structure_violation() -> None:
    """Every layer (and role) holds the model's heads x head_dim of one dtype; page sizes may differ."""
    snap = spec_example_snapshot(2)
    assert snap.validate().ok
    k1, v1 = snap.keys[1], snap.values[1]
    fewer = replace(snap, keys=(snap.keys[0], replace(k1, page_pool=k1.page_pool[:, :, :1])))
    fewer = replace(fewer, values=(snap.values[0], replace(v1, page_pool=v1.page_pool[:, :, :1])))
    assert "snapshot.structure" in _invariants(fewer)
    wider = snap.with_layers(
        [snap.layer(0), tuple(replace(t, page_pool=t.page_pool.repeat(1, 1, 1, 2)) for t in snap.layer(1))]
    )
    assert "snapshot.structure" in _invariants(replace(wider, fingerprint=None))
    as_f32 = replace(snap, values=(snap.values[0], replace(v1, page_pool=v1.page_pool.float())))  # value != key dtype
    found = [v for v in as_f32.validate().violations if v.invariant == "snapshot.structure"]
    assert found and "layer 1 value" in found[0].message


def test_a_fingerprint_of_other_heads_than_the_pools_is_a_violation() -> None:
    snap = spec_example_snapshot(2)
    fp = snap.fingerprint
    assert fp is not None and (fp.num_kv_heads, fp.head_dim) == (snap.keys[0].num_heads, snap.keys[0].head_dim)
    for bad in (replace(fp, num_kv_heads=fp.num_kv_heads + 2), replace(fp, head_dim=fp.head_dim * 2)):
        assert "snapshot.fingerprint" in _invariants(replace(snap, fingerprint=bad))
    # A slice of the heads holds fewer than the model's: its total is what the fingerprint names.
    from hurray_vllm.kv.heads import select_heads

    assert select_heads(snap, range(1, 2)).validate().ok
    # An MLA latent: one "head" of kv_lora_rank + rope values, as its fingerprint says.
    t = snap.keys[0]
    lat = hv.LatentSplit(12, 4)
    fused = [
        (replace(t, page_pool=torch.zeros(t.num_pages, t.page_size, 1, 16), kv_role="fused", layer_index=i),)
        for i in range(2)
    ]
    mla = hv.KVSnapshot.from_layers(
        fused, latent=lat, fingerprint=replace(fp, num_kv_heads=1, head_dim=16, num_layers=2)
    )
    assert mla.validate().ok, mla.validate().violations
    assert "snapshot.fingerprint" in _invariants(replace(mla, fingerprint=fp))


def test_a_pool_that_is_not_four_dimensional_is_a_violation_not_a_crash() -> None:
    snap = spec_example_snapshot(2)
    flat = replace(snap.keys[1], page_pool=snap.keys[1].page_pool.flatten(2))
    bad = replace(snap, keys=(snap.keys[0], flat))
    assert "rank" in _invariants(bad)
    assert "rank" in _invariants(replace(bad, heads=hv.HeadRange(0, 2, 2)))  # the head-slice check reads heads too


# ── what validate passes, the readers load ────────────────────────────────────

#: Where save() is asked to write what it must refuse (so nothing is ever written there).
_NOWHERE = Path(tempfile.gettempdir()) / "hurray-vllm-refused.hrrs"


def _reads_back(snap: hv.KVSnapshot) -> hv.KVSnapshot | None:
    """``snap`` written as a stream without save()'s checks and read back; None when either side refuses."""
    buf = io.BytesIO()
    try:
        hv.write_stream(snap, buf)
        return hv.read_stream(io.BytesIO(buf.getvalue()))
    except (HurrayFormatError, TypeError, ValueError):  # the writer's json.dumps raises the bare ones
        return None


@given(snapshots(), st.data())
def test_layer_i_must_say_layer_i_or_nothing(snap: hv.KVSnapshot, data: st.DataObject) -> None:
    """A reader places a layer by its layer_index: another index loads the layers swapped, or refuses them."""
    said = data.draw(st.lists(st.none() | st.integers(0, 3), min_size=snap.num_layers, max_size=snap.num_layers))
    stamped = snap.with_layers(
        [tuple(replace(t, layer_index=i) for t in members) for i, members in zip(said, snap.layer_members())]
    )
    fine = all(i in (None, pos) for pos, i in enumerate(said))
    for permissive in (False, True):  # the reader refuses or reorders in every mode
        assert stamped.validate(permissive=permissive).ok == fine
    back = _reads_back(stamped)
    if fine:
        assert back is not None
        for a, b in zip(back.tensors(), stamped.tensors(), strict=True):  # in the order they were written
            assert torch.equal(a.page_pool.view(torch.uint8), b.page_pool.view(torch.uint8))
    else:
        assert "layer_index" in {v.invariant for v in stamped.validate().errors}
        with pytest.raises(HurrayFormatError) as err:
            hv.save(stamped, _NOWHERE)
        assert err.value.field == "layer_index"


_DEEP: Any = 1
for _ in range(40):
    _DEEP = [_DEEP]

#: Header members, as (name, what replaces them in the spec's example): each within and past the reader's bounds.
_HEADERS = st.one_of(
    st.tuples(st.just("source"), st.builds(hv.SnapshotSource, st.just("e"), st.just("l"), st.integers(-1, 2))),
    st.tuples(
        st.just("fingerprint"),
        st.builds(
            hv.ModelFingerprint,
            st.integers(250, 260).map("A".__mul__),
            st.just(2),
            st.just(2),
            st.just(8),
            st.integers(60, 70).map("d".__mul__),
            st.none() | st.just("w"),
        ),
    ),
    st.tuples(st.just("request_ids"), st.integers(4090, 4100).map(lambda n: ("r" * n, "s"))),
    st.tuples(
        st.just("extra"),
        st.dictionaries(
            st.sampled_from(["a", "b"]),
            st.sampled_from([1, 1.5, "x", None, [1, {"k": 2}], math.nan, math.inf, 1 << 70, -(1 << 66), _DEEP]),
            max_size=2,
        ),
    ),
)


@given(_HEADERS)
def test_validate_passes_exactly_the_headers_the_reader_loads(header: tuple[str, Any]) -> None:
    name, value = header
    snap = replace(spec_example_snapshot(2), **{name: value})
    back = _reads_back(snap)
    checked = snap.validate()
    assert checked.ok == (back is not None), checked.errors
    if back is None:
        with pytest.raises(HurrayFormatError):  # never a bare TypeError or ValueError
            hv.save(snap, _NOWHERE)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"extra": {"x": object()}}, "snapshot.meta"),  # json cannot write it: save() raised a bare TypeError
        ({"extra": {"x": math.nan}}, "snapshot.meta"),
        ({"extra": {"x": _DEEP}}, "snapshot.meta"),
        ({"extra": {"x": 1 << 70}}, "snapshot.meta"),
        ({"extra": [1]}, "snapshot.meta.extra"),
        ({"source": hv.SnapshotSource("e", "l", 0)}, "snapshot.source.page_size"),
        ({"request_ids": ("r" * 5000, "s")}, "snapshot.meta.request_ids"),
        ({"request_ids": (7, "s")}, "snapshot.meta.request_ids"),
    ],
)
def test_a_header_the_reader_refuses_is_named_by_the_readers_field(changes: dict[str, Any], field: str) -> None:
    snap = replace(spec_example_snapshot(2), **changes)
    assert field in {v.invariant for v in snap.validate().errors}
    with pytest.raises(HurrayFormatError) as err:
        hv.save(snap, _NOWHERE)
    assert err.value.field == field


def test_a_latent_split_or_states_the_reader_refuses_do_not_validate(tmp_path: Path) -> None:
    t = hv.BlockPagedTensor(
        torch.randn(2, 4, 1, 8), torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([6]), "fused", 0
    )
    for lat, field in [
        (hv.LatentSplit(0, 8, "deepseek_v2"), "snapshot.latent.kv_lora_rank"),
        (hv.LatentSplit(4, 4, "x" * 300), "snapshot.latent.family"),
    ]:
        snap = hv.KVSnapshot.from_layers([(t,)], latent=lat, token_ids=(tuple(range(6)),))
        assert [v.invariant for v in snap.validate().errors] == [field]
        save_unchecked(snap, tmp_path / "m.hrry")
        with pytest.raises(HurrayFormatError, match=field):
            hv.load(tmp_path / "m.hrry")
    snap = spec_example_snapshot(2)
    conv, ssm = torch.randn(2, 3, 16), torch.randn(2, 2, 8, 8)
    for states, field in [
        (hv.RecurrentStates("gdn_attn", (0,), ("conv", "ssm"), (1 << 62, 3), ((conv, ssm),)), "positions"),
        (hv.RecurrentStates("gdn_attn", (70000,), ("conv", "ssm"), (6, 3), ((conv, ssm),)), "layers"),
        (hv.RecurrentStates("k" * 300, (0,), ("conv", "ssm"), (6, 3), ((conv, ssm),)), "kind"),
    ]:
        bad = replace(snap, states=states)
        assert f"snapshot.states.{field}" in {v.invariant for v in bad.validate().errors}
        assert _reads_back(bad) is None


def test_a_snapshot_made_of_other_layers_carries_no_chunk_digest_or_mac(tmp_path: Path) -> None:
    """A chunk's digest and MAC are of the layers they were computed over: a snapshot derived from a chunk with
    other layers (repaged, compacted, a slice of its heads, without a drafter) drops them, so that it is saved
    and read back as the snapshot it is, not refused as a damaged chunk (``load`` checks a carried digest)."""
    from synthetic import example_chunk

    from hurray_vllm.chunks.digest import DIGEST_KEY, MAC_KEY, chunk_digest, digest_matches
    from hurray_vllm.chunks.signing import FleetKeys, sign_chunk
    from hurray_vllm.kv.heads import select_heads
    from hurray_vllm.kv.repage import repage_snapshot

    ns, key, chunk = example_chunk()
    noted = replace(chunk, extra={"note": 1})
    noted = replace(noted, extra={**noted.extra, DIGEST_KEY: chunk_digest(noted)})
    signed = sign_chunk(noted, FleetKeys.from_secrets(b"k" * 32), ns, key)
    assert {DIGEST_KEY, MAC_KEY} <= set(signed.extra) and digest_matches(signed)
    derived = {
        "repaged": repage_snapshot(signed, 2),
        "compacted": signed.compact(),
        "heads": select_heads(signed, range(0, 1)),
        "without drafter": replace(signed, extra={**signed.extra, TARGET_LAYERS: 2}).without_drafter(),
    }
    for what, snap in derived.items():
        assert snap.extra == {"note": 1}, what
        hv.save(snap, tmp_path / "d.hrry")
        assert hv.load(tmp_path / "d.hrry").extra == {"note": 1}, what
    assert digest_matches(hv.load(_saved(signed, tmp_path / "c.hrry")))  # the chunk itself keeps them


def _saved(snap: hv.KVSnapshot, path: Path) -> Path:
    hv.save(snap, path)
    return path


def test_select_of_a_generator_selects_its_sequences() -> None:
    """The range check consumed a generator, and the select then took no sequence: a valid 0-sequence snapshot."""
    snap = replace(spec_example_snapshot(2), request_ids=("a", "b"))
    sub = snap.select(s for s in [1])
    assert sub.num_seqs == 1 and sub.request_ids == ("b",) and sub.token_ids == (snap.token_ids[1],)
    assert sub.seq_lens == [snap.seq_lens[1]]


@pytest.mark.parametrize("seq", [True, 1.0, 0.5, "0"])
def test_select_refuses_a_sequence_that_is_not_an_integer(seq: Any) -> None:
    """A bool or a float index was compared and used as one (True as sequence 1); a float then failed in torch."""
    with pytest.raises(hv.HurrayArgumentError) as err:
        spec_example_snapshot(2).select([seq])
    assert err.value.field == "seqs"
