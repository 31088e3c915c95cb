"""Recurrent states of linear-attention hybrids: containers, chunks, digests and the refusals (no engine)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from strategies import same_snapshot, same_states, snapshots
from synthetic import save_unchecked

import hurray_vllm as hv
from hurray_vllm.chunks.digest import chunk_digest
from hurray_vllm.chunks.keys import chunks_of
from hurray_vllm.containers.schema import decode_header, snapshot_metadata


def _hybrid(positions: tuple[int, ...] = (6, 3)) -> hv.KVSnapshot:
    from hurray_vllm.app.demo import spec_example_snapshot

    snap = spec_example_snapshot(num_layers=2)  # sequences of 6 and 3 tokens, pages of 4
    gen = torch.Generator().manual_seed(0)
    tensors = tuple(
        (torch.randn(2, 3, 16, generator=gen).to(torch.bfloat16), torch.randn(2, 2, 8, 8, generator=gen))
        for _ in range(3)
    )
    states = hv.RecurrentStates("gdn_attn", (0, 1, 2), ("conv", "ssm"), positions, tensors)
    return replace(snap, states=states, fingerprint=hv.ModelFingerprint("Qwen3NextForCausalLM", 2, 2, 8, "float16"))


@settings(max_examples=30, deadline=None)
@given(snapshots(states=True))
def test_states_round_trip_through_every_container(
    tmp_path_factory: pytest.TempPathFactory, snap: hv.KVSnapshot
) -> None:
    d = tmp_path_factory.mktemp("states")
    for ext in ("hrry", "hrrs", "safetensors"):
        if ext == "safetensors" and any(t.quantization is not None for t in snap.tensors()):
            continue
        hv.save(snap, d / f"s.{ext}")
        back = hv.load(d / f"s.{ext}")
        assert same_snapshot(back, snap), ext
        assert hv.validate(d / f"s.{ext}").ok, ext


def test_attention_layers_are_the_model_layers_the_states_leave() -> None:
    states = _hybrid().states
    assert states is not None
    assert states.attention_layers(2) == [3, 4]
    assert replace(states, layers=(1, 3, 4)).attention_layers(2) == [0, 2]


def test_select_keeps_each_sequence_its_states() -> None:
    snap = _hybrid()
    one = snap.select([1])
    assert one.states is not None and one.states.positions == (3,)
    assert torch.equal(one.states.tensors[2][1][0], snap.states.tensors[2][1][1])  # type: ignore[union-attr]


def test_a_state_goes_with_the_chunk_that_ends_where_it_was_taken() -> None:
    """Chunks of 4 tokens: sequence 0 (6 tokens) has one whole chunk, 0..4; sequence 1 (3 tokens) none."""
    at_four = _hybrid(positions=(4, 3))
    ((_, chunk),) = chunks_of(at_four, 4)
    assert chunk.states is not None and chunk.states.positions == (4,)
    assert torch.equal(chunk.states.tensors[0][0][0], at_four.states.tensors[0][0][0])  # type: ignore[union-attr]
    ((_, elsewhere),) = chunks_of(_hybrid(positions=(6, 3)), 4)
    assert elsewhere.states is None  # taken at token 6, which ends no chunk


def test_a_chunks_states_sit_at_its_end_in_the_prefix_not_at_its_seq_lens(tmp_path: Path) -> None:
    """Not a format rule that states sit at ``seq_lens``: a chunk's sit at its end counted from the start of the
    whole prefix (docs/format.md 2.3c), while its ``seq_lens`` counts its own tokens. A file cannot tell where its
    prefix began (a chunk holds its own tokens only), so validate and load take any position (>= 0) and each
    consumer compares it with the token it resumes at: the scheduler and worker with ``hit * chunk``, the
    transformers importer with the length it imports."""
    from synthetic import make_snapshot

    from hurray_vllm.chunks.keys import namespace_of
    from hurray_vllm.chunks.store import DirectoryStore
    from hurray_vllm.chunks.verify import check_data

    kv = make_snapshot([8, 3], [0, 0], 4, heads=2, dim=8, dtype=torch.float16)
    gen = torch.Generator().manual_seed(1)
    tensors = tuple((torch.randn(2, 3, 16, generator=gen), torch.randn(2, 2, 8, 8, generator=gen)) for _ in range(3))
    snap = replace(
        kv,
        token_ids=(tuple(range(100, 108)), (7, 8, 9)),
        fingerprint=hv.ModelFingerprint("Qwen3NextForCausalLM", 2, 2, 8, "float16"),
        states=hv.RecurrentStates("gdn_attn", (0, 1, 2), ("conv", "ssm"), (8, 3), tensors),
    )
    assert snap.validate().ok  # the whole snapshot's sit at its seq_lens
    (_, first), (key, second) = chunks_of(snap, 4)  # sequence 0's two chunks; sequence 1 (3 tokens) has none
    assert first.states is None and second.states is not None
    assert second.seq_lens == [4] and second.states.positions == (8,)  # tokens 4..8 of the prefix
    assert second.validate().ok and hv.validate(second).ok
    assert second.fingerprint is not None
    ns = namespace_of(second.fingerprint)
    store = DirectoryStore(tmp_path)
    store.put(ns, key, second)
    path = store.path(ns, key)
    assert hv.validate(path).ok
    back = hv.load(path)
    assert back.seq_lens == [4] and back.states is not None and back.states.positions == (8,)
    check_data(store.get(ns, key))  # and a consumer's data check takes it (its resume check is its own)


def test_the_chunk_digest_covers_the_states() -> None:
    snap = _hybrid()
    base = chunk_digest(snap)
    states = snap.states
    assert states is not None
    changed = [[t.clone() for t in layer] for layer in states.tensors]
    changed[2][1][1, 0, 0, 0] += 1
    assert chunk_digest(replace(snap, states=states.with_tensors(changed))) != base
    assert chunk_digest(replace(snap, states=replace(states, positions=(6, 2)))) != base
    assert chunk_digest(replace(snap, states=replace(states, kind="mamba2"))) != base
    assert chunk_digest(replace(snap, states=None)) != base


def test_validate_agrees_with_load_on_inconsistent_states(tmp_path: Path) -> None:
    snap = _hybrid()
    states = snap.states
    assert states is not None
    bad = [
        ("positions", replace(states, positions=(6,))),  # one position for two sequences
        ("layer", replace(states, tensors=states.tensors[:2])),  # two tensors for three layers
        ("shape", states.with_tensors([[states.tensors[0][0][:, :2], states.tensors[0][1]], *states.tensors[1:]])),
    ]
    for what, wrong in bad:
        path = tmp_path / f"{what}.hrry"
        with pytest.raises(hv.HurrayFormatError, match=r"snapshot\.states"):
            hv.save(replace(snap, states=wrong), path)  # what load refuses is not written
        save_unchecked(replace(snap, states=wrong), path)
        with pytest.raises(hv.HurrayFormatError, match=r"snapshot\.states"):
            hv.load(path)
        assert not hv.validate(path).ok, what


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"names": ["conv", "conv"]}, "snapshot.states.names"),
        ({"names": ["not a name"]}, "snapshot.states.names"),
        ({"shapes": [[3, 16]]}, "snapshot.states.shapes"),
        ({"shapes": [[3, -1], [2, 8, 8]]}, "snapshot.states.shapes"),
        ({"dtypes": ["bfloat16", "int4"]}, "snapshot.states.dtypes"),
        ({"layers": [0, 1.5, 2]}, "snapshot.states.layers"),
        ({"positions": "6"}, "snapshot.states.positions"),
    ],
)
def test_a_hostile_states_header_names_the_field(change: dict[str, object], field: str) -> None:
    meta = snapshot_metadata(_hybrid(), 2)
    meta["states"] = {**meta["states"], **change}
    with pytest.raises(hv.HurrayFormatError) as err:
        decode_header(json.dumps(meta))
    assert err.value.field == field


def test_a_truncated_input_without_its_states_is_refused(tmp_path: Path) -> None:
    from hurray_vllm.containers.schema import header_records, layer_records
    from hurray_vllm.containers.stream import write_records

    snap = _hybrid()
    path = tmp_path / "cut.hrrs"
    with open(path, "wb") as f:  # the header announces three state layers; none follows
        write_records(header_records(snap), f)
        for i, members in enumerate(snap.layer_members()):
            write_records(layer_records(i, members), f)
    with pytest.raises(hv.HurrayFormatError, match="truncated"):
        hv.load(path)


def test_states_survive_select_and_repage() -> None:
    from hurray_vllm.kv.repage import repage_snapshot

    snap = _hybrid()
    again = repage_snapshot(snap, 2)
    assert same_states(again.states, snap.states)


def test_validate_in_memory_applies_the_rules_a_file_is_read_with() -> None:
    snap = _hybrid()
    states = snap.states
    assert states is not None
    for wrong in (
        replace(states, names=("conv", "not a name")),
        states.with_tensors([[t.to(torch.int16) for t in layer] for layer in states.tensors]),
        replace(states, positions=(6, -1)),
        replace(states, attention=(0,)),  # overlaps the state layers
    ):
        assert not replace(snap, states=wrong).validate().ok


def test_a_permissive_read_still_refuses_states_of_another_batch(tmp_path: Path) -> None:
    snap = _hybrid()
    one = snap.states.select([0])  # type: ignore[union-attr]
    path = tmp_path / "s.hrry"
    with pytest.raises(hv.HurrayFormatError, match=r"snapshot\.states"):
        hv.save(replace(snap, states=one), path)
    save_unchecked(replace(snap, states=one), path)
    with pytest.raises(hv.HurrayFormatError, match=r"snapshot\.states"):
        hv.load(path, permissive=True)


def test_recorded_attention_layers_and_layout_round_trip(tmp_path: Path) -> None:
    snap = _hybrid()
    states = replace(snap.states, layers=(0, 2, 3), attention=(1, 5), layout="vllm-cuda-SD")
    hv.save(replace(snap, states=states), tmp_path / "s.hrry")
    back = hv.load(tmp_path / "s.hrry").states
    assert back is not None and back.attention == (1, 5) and back.layout == "vllm-cuda-SD"
    assert back.attention_layers(2) == [1, 5]
    assert states.mismatches(back) == []
    assert "layout" in states.mismatches(replace(back, layout=""))[0]
    assert "shapes" in states.mismatches(back.with_tensors([[t[:, :1] for t in lay] for lay in back.tensors]))[0]


def test_block_paged_importers_refuse_a_snapshot_with_states() -> None:
    from hurray_vllm.adapters.flash_attn import to_flash_attn
    from hurray_vllm.adapters.flashinfer import to_flashinfer

    snap = _hybrid()
    for importer in (to_flash_attn, to_flashinfer):
        with pytest.raises(hv.HurrayFormatError, match="linear-attention") as err:
            importer(snap, 0)
        assert err.value.field == "snapshot.states"


@pytest.mark.parametrize(
    "attention",
    [
        (3,),  # one index for two layers: layer 1's KV would go nowhere
        (3, 4, 5),  # three for two
        (4, 3),  # not in model order
        (3, 3),  # twice the same model layer
        (-1, 3),
        (2, 3),  # model layer 2 is a state layer
    ],
)
def test_recorded_attention_layers_are_one_per_layer_in_model_order(tmp_path: Path, attention: tuple[int, ...]) -> None:
    """What validate passes loads, and a recorded list that does not name every layer's model layer is neither."""
    snap = _hybrid()
    bad = replace(snap, states=replace(snap.states, attention=attention))
    assert "snapshot.states.attention_layers" in [v.invariant for v in bad.validate().violations]
    with pytest.raises(hv.HurrayFormatError) as refused:
        hv.save(bad, tmp_path / "bad.hrry")  # nothing load refuses is written
    assert refused.value.field == "snapshot.states.attention_layers" and not (tmp_path / "bad.hrry").exists()
    save_unchecked(bad, tmp_path / "bad.hrry")  # a writer that does not check: the reader refuses it
    with pytest.raises(hv.HurrayFormatError) as err:
        hv.load(tmp_path / "bad.hrry")
    assert err.value.field == "snapshot.states.attention_layers"


def test_a_short_attention_list_is_refused_where_layers_are_placed() -> None:
    """An importer that places layers by the recorded indices refuses a list shorter than the layers."""
    states = replace(_hybrid().states, attention=(3,))
    with pytest.raises(hv.HurrayFormatError) as err:
        states.attention_layers(2)
    assert err.value.field == "snapshot.states.attention_layers"
    assert states.attention_layers(1) == [3]


def test_without_drafter_keeps_the_attention_indices_of_the_models_layers() -> None:
    from hurray_vllm.kv.snapshot import TARGET_LAYERS

    snap = _hybrid()
    drafter = replace(snap.keys[1], layer_index=2), replace(snap.values[1], layer_index=2)
    both = snap.with_layers(
        [*snap.layer_members(), drafter],
        states=replace(snap.states, attention=(3, 4, 5)),
        fingerprint=replace(snap.fingerprint, num_layers=3),
        extra={TARGET_LAYERS: 2},
    )
    assert both.validate().ok
    model = both.without_drafter()
    assert model.states is not None and model.states.attention == (3, 4) and model.validate().ok


def test_a_head_range_of_no_heads_is_a_violation_beside_states_not_a_crash() -> None:
    """The states' part is compared with the head slice only when the slice is one a reader accepts."""
    snap = replace(_hybrid(), heads=hv.HeadRange(0, 2, 0), fingerprint=None)
    assert [v.invariant for v in snap.validate().violations] == ["snapshot.heads.total"]
