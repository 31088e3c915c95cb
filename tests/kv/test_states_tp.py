"""Linear-attention states split across tensor-parallel ranks: shares, joins, files and refusals (no engine).

A gated delta net's conv state holds its query, key and value channels and
vLLM gives rank ``r`` of ``tp`` the ``r``-th share of each; its recurrent
state is split by value heads. A snapshot slice of KV heads ``a .. b - 1``
of ``n`` carries the share ``a / n .. b / n`` of the states.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import same_snapshot, same_states
from synthetic import save_unchecked

import hurray_vllm as hv
from hurray_vllm.containers.schema import decode_header, snapshot_metadata
from hurray_vllm.kv.heads import concat_heads, select_heads
from hurray_vllm.kv.states import join_states, state_split

K_HEADS, V_HEADS, K_DIM, V_DIM = 4, 8, 4, 2  # key_dim 16, value_dim 16: conv 48 channels


def _states(seqs: int = 2, layers: int = 3, seed: int = 0, k_heads: int = K_HEADS) -> hv.RecurrentStates:
    gen = torch.Generator().manual_seed(seed)
    conv = 2 * k_heads * K_DIM + V_HEADS * V_DIM
    tensors = tuple(
        (
            torch.randn(seqs, 3, conv, generator=gen).to(torch.bfloat16),
            torch.randn(seqs, V_HEADS, K_DIM, V_DIM, generator=gen),
        )
        for _ in range(layers)
    )
    return hv.RecurrentStates("gdn_attn", tuple(range(layers)), ("conv", "ssm"), (6, 3)[:seqs], tensors)


def _vllm_share(states: hv.RecurrentStates, rank: int, tp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What vLLM's rank ``rank`` holds, built the way its weight loader shards: each of q, k, v channels apart."""
    key_dim, value_dim = K_HEADS * K_DIM, V_HEADS * V_DIM
    out = []
    for conv, ssm in states.tensors:
        q, k, v = conv.split([key_dim, key_dim, value_dim], dim=-1)
        mine = [x.chunk(tp, dim=-1)[rank] for x in (q, k, v)]
        out.append((torch.cat(mine, dim=-1), ssm.chunk(tp, dim=1)[rank]))
    return out


def _hybrid_snapshot() -> hv.KVSnapshot:
    from hurray_vllm.app.demo import spec_example_snapshot

    snap = spec_example_snapshot(num_layers=2)  # 2 KV heads, sequences of 6 and 3 tokens
    heads = snap.tensors()[0].num_heads
    return replace(
        snap,
        states=_states(),
        fingerprint=hv.ModelFingerprint("Qwen3NextForCausalLM", 2, heads, snap.tensors()[0].head_dim, "float16"),
    )


def test_the_split_of_a_gated_delta_net_follows_its_channels() -> None:
    assert state_split("gdn_attn", "", [(3, 48), (8, 4, 2)]) == ((1, (16, 16, 16)), (0, (8,)))
    assert state_split("mamba2", "", [(3, 48), (8, 4, 2)]) is None  # unknown kinds do not split
    assert state_split("gdn_attn", "vllm-cuda-SD", [(3, 48), (8, 4, 2)]) is None  # nor engine-private layouts
    assert state_split("gdn_attn", "", [(3, 15), (8, 1, 1)]) is None  # q and k channels would be uneven


@pytest.mark.parametrize("tp", [2, 4])
def test_a_rank_share_is_what_vllm_gives_that_rank(tp: int) -> None:
    whole = _states()
    for rank in range(tp):
        share = whole.take(rank, rank + 1, tp)
        assert share.part == (rank, rank + 1, tp) and share.whole_shapes == whole.shapes
        assert not share.violations() and not share.mismatches(whole) and not whole.mismatches(share)
        for (conv, ssm), (want_conv, want_ssm) in zip(share.tensors, _vllm_share(whole, rank, tp), strict=True):
            assert torch.equal(conv, want_conv) and torch.equal(ssm, want_ssm)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]), st.integers(0, 3))
def test_shares_regroup_between_any_two_degrees(source_tp: int, dest_tp: int, rank: int) -> None:
    """A destination rank's share, joined from the source ranks' shares that overlap it, is its own share."""
    whole = _states()
    rank %= dest_tp
    shares = [whole.take(r, r + 1, source_tp) for r in range(source_tp)]
    lo, hi = rank / dest_tp, (rank + 1) / dest_tp
    overlapping = [s for r, s in enumerate(shares) if r / source_tp < hi and (r + 1) / source_tp > lo]
    got = join_states(overlapping)
    want = whole.take(rank, rank + 1, dest_tp)
    narrowed = got.take(rank, rank + 1, dest_tp)
    assert same_states(narrowed, want)
    assert same_states(join_states([whole.take(r, r + 1, dest_tp) for r in range(dest_tp)]), whole)


def test_joining_refuses_parts_that_do_not_fit() -> None:
    whole = _states()
    a, b = whole.take(0, 1, 2), whole.take(1, 2, 2)
    with pytest.raises(hv.HurrayFormatError, match="consecutive"):
        join_states([b, a])
    with pytest.raises(hv.HurrayFormatError, match="consecutive"):
        join_states([a, replace(b, positions=(7, 3))])  # taken at another token
    with pytest.raises(hv.HurrayFormatError, match="consecutive"):
        join_states([a, _states(k_heads=2).take(1, 2, 2)])  # another geometry
    with pytest.raises(hv.HurrayFormatError, match="outside"):
        a.take(1, 2, 2)
    with pytest.raises(hv.HurrayFormatError, match="do not split"):
        replace(whole, kind="mamba2").take(0, 1, 2)


def test_head_slices_carry_their_share_of_the_states_and_join_back() -> None:
    snap = _hybrid_snapshot()
    parts = [select_heads(snap, range(h, h + 1)) for h in range(2)]
    for h, part in enumerate(parts):
        assert part.states is not None and part.states.part == (h, h + 1, 2)
        assert part.validate().ok
    assert same_snapshot(concat_heads(parts), snap)
    # A slice whose states are another share than its heads is inconsistent.
    wrong = replace(parts[0], states=parts[1].states)
    assert any(v.invariant == "snapshot.states.part" for v in wrong.validate().violations)


@pytest.mark.parametrize("ext", ["hrry", "hrrs", "safetensors"])
def test_a_slice_with_its_share_round_trips_through_every_container(tmp_path: Path, ext: str) -> None:
    part = select_heads(_hybrid_snapshot(), range(1, 2))
    hv.save(part, tmp_path / f"p.{ext}")
    back = hv.load(tmp_path / f"p.{ext}")
    assert back.states is not None and back.states.part == (1, 2, 2)
    assert back.states.split == part.states.split  # type: ignore[union-attr]
    assert same_snapshot(back, part) and hv.validate(tmp_path / f"p.{ext}").ok


def test_a_whole_snapshot_keeps_its_bytes() -> None:
    """No ``split`` or ``part`` unless the states are a share: files of TP = 1 engines read as before."""
    meta = snapshot_metadata(_hybrid_snapshot(), 2)
    assert "split" not in meta["states"] and "part" not in meta["states"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"part": {"start": 1, "stop": 1, "total": 2}}, "snapshot.states.part.stop"),
        ({"part": {"start": 0, "stop": 1, "total": 1}}, "snapshot.states.part.total"),
        ({"part": "half"}, "snapshot.states.part"),
        ({"split": [{"axis": 1, "sections": [16, 16, 16]}]}, "snapshot.states.split"),
        ({"split": [{"axis": 1, "sections": []}, {"axis": 0, "sections": [8]}]}, "snapshot.states.split.sections"),
        ({"split": [{"axis": 9, "sections": [8]}, {"axis": 0, "sections": [8]}]}, "snapshot.states.split.axis"),
        # The same total in other sections would cut other channels: only the kind's own split is read.
        ({"split": [{"axis": 1, "sections": [48]}, {"axis": 0, "sections": [8]}]}, "snapshot.states.split"),
        ({"split": [{"axis": 0, "sections": [3]}, {"axis": 0, "sections": [8]}]}, "snapshot.states.split"),
        ({"part": {"start": 0, "stop": 2, "total": 2}}, "snapshot.states.part"),  # a part that is the whole
        ({"kind": "mamba2"}, "snapshot.states.split"),  # a kind that does not split
    ],
)
def test_a_hostile_share_header_names_the_field(change: dict[str, object], field: str) -> None:
    meta = snapshot_metadata(select_heads(_hybrid_snapshot(), range(1, 2)), 2)
    meta["states"] = {**meta["states"], **change}
    with pytest.raises(hv.HurrayFormatError) as err:
        decode_header(json.dumps(meta))
    assert err.value.field == field


def test_validate_agrees_with_load_on_a_share_of_the_wrong_size(tmp_path: Path) -> None:
    part = select_heads(_hybrid_snapshot(), range(1, 2))
    states = part.states
    assert states is not None
    # The declared sections say a share of 24 conv channels; this one holds 20.
    short = states.with_tensors([[layer[0][..., :20], layer[1]] for layer in states.tensors])
    path = tmp_path / "short.hrry"
    with pytest.raises(hv.HurrayFormatError, match=r"snapshot\.states"):
        hv.save(replace(part, states=short), path)
    save_unchecked(replace(part, states=short), path)
    with pytest.raises(hv.HurrayFormatError, match=r"snapshot\.states"):
        hv.load(path)
    assert not hv.validate(path).ok


def test_header_only_parts_join_and_cut_to_their_declared_shapes() -> None:
    """A header announces a part's shapes before its tensors: joining or cutting headers keeps them right."""
    meta = snapshot_metadata(_hybrid_snapshot(), 2)["states"]
    header = hv.RecurrentStates.from_json(meta)
    halves = [header.take(r, r + 1, 2) for r in range(2)]
    assert [h.shapes for h in halves] == [((3, 24), (4, 4, 2))] * 2
    assert join_states(halves).shapes == header.shapes and join_states(halves).part is None
    assert join_states([header.take(r, r + 1, 4) for r in range(2)]).shapes == halves[0].shapes
    with pytest.raises(hv.HurrayFormatError, match="header-only"):
        join_states([halves[0], _states().take(1, 2, 2)])
