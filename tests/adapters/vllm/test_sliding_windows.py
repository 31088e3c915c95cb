"""Sliding-window hybrids without an engine: freed (null) blocks, per-group plans, the windows on the wire."""

from __future__ import annotations

import io

import pytest
import torch

import hurray_vllm as hv
from hurray_vllm.adapters.vllm.export import SequenceState, export_snapshot, export_stream, plan_batch
from hurray_vllm.adapters.vllm.layouts import LogicalBHNC
from hurray_vllm.chunks import chunks_of
from hurray_vllm.containers.io import read_stream

BLOCK, HEADS, DIM = 4, 2, 8


def _caches(layers: int, blocks: int) -> list[torch.Tensor]:
    """vLLM 0.32's logical [B, H, N, 2*D] caches, every value distinct (block, head, slot, element)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn((blocks, HEADS, BLOCK, 2 * DIM), generator=gen).to(torch.bfloat16) for _ in range(layers)]


def _seqs() -> list[SequenceState]:
    # Layer groups: 0 = sliding window of 6 (its first blocks freed), 1 = full attention.
    a = SequenceState("a", [1, 2, 3, 4], 15, list(range(16)), group_block_ids=([0, 0, 7, 8], [1, 2, 3, 4]))
    b = SequenceState("b", [1, 5], 7, list(range(8)), group_block_ids=([0, 9], [1, 5]))
    return [a, b]


def test_freed_blocks_become_one_zero_page_and_the_window_says_where_tokens_start() -> None:
    caches = _caches(3, 12)
    snap = export_snapshot(
        caches, LogicalBHNC(DIM), _seqs(), block_size=BLOCK, layer_groups=[0, 1, 0], group_windows=[6, None]
    )
    assert snap.windows == hv.SlidingWindows((6, None, 6), ((8, 4), (0, 0), (8, 4)))
    assert snap.validate().ok
    full, sliding = snap[1, "key"], snap[0, "key"]
    assert full.num_pages == 5 and sliding.num_pages == 4  # 3 held pages and one zero page
    for s, (start, n) in enumerate(((8, 15), (4, 7))):
        dense = sliding.to_dense(s).float()
        assert not dense[:start].any()  # what the engine freed reads as zeros
        engine = caches[0][..., :DIM].transpose(1, 2)  # [B, N, H, D]
        ids = _seqs()[s].group_block_ids[0]
        want = torch.cat([engine[i] for i in ids]).float()[:n]
        assert torch.equal(dense[start:], want[start:])
    plan = plan_batch([replace_ids(s, 0) for s in _seqs()], BLOCK, holes=True)
    assert plan.kv_start == (8, 4)


def replace_ids(s: SequenceState, g: int) -> SequenceState:
    from dataclasses import replace

    return replace(s, block_ids=s.group_block_ids[g])


def test_windows_survive_every_container_and_the_stream_export(tmp_path) -> None:  # type: ignore[no-untyped-def]
    caches = _caches(2, 12)
    opts = {"block_size": BLOCK, "layer_groups": [0, 1], "group_windows": [6, None]}
    snap = export_snapshot(caches, LogicalBHNC(DIM), _seqs(), **opts)  # type: ignore[arg-type]
    for name in ("s.hrry", "s.hrrs", "s.safetensors"):
        hv.save(snap, tmp_path / name)
        back = hv.load(tmp_path / name)
        assert back.windows == snap.windows and hv.validate(tmp_path / name).ok
        assert torch.equal(back[0, "value"].page_pool, snap[0, "value"].page_pool)
    buf = io.BytesIO()
    export_stream(buf, caches, LogicalBHNC(DIM), _seqs(), **opts)  # type: ignore[arg-type]
    buf.seek(0)
    streamed = read_stream(buf)
    assert streamed.windows == snap.windows
    assert all(torch.equal(x.page_pool, y.page_pool) for x, y in zip(streamed.tensors(), snap.tensors(), strict=True))
    assert snap.select([1]).windows == hv.SlidingWindows((6, None), ((4,), (0,)))


def test_chunks_of_a_windowed_snapshot_say_what_each_chunk_holds() -> None:
    snap = export_snapshot(
        _caches(2, 12), LogicalBHNC(DIM), _seqs(), block_size=BLOCK, layer_groups=[0, 1], group_windows=[6, None]
    )
    snap = hv.KVSnapshot(
        **{**snap.__dict__, "fingerprint": hv.ModelFingerprint("Gemma3ForCausalLM", 2, HEADS, DIM, "bfloat16")}
    )
    chunks = chunks_of(snap, 8)  # "a": 1 whole chunk of 8 (tokens 0..7), "b": none
    assert len(chunks) == 1
    ((_, chunk),) = chunks
    assert chunk.windows == hv.SlidingWindows((6, None), ((8,), (0,)))  # the sliding layer holds none of it
    assert chunk.validate().ok


def test_a_null_block_between_held_ones_is_refused() -> None:
    seq = SequenceState("x", [1, 2, 3], 12, list(range(12)), group_block_ids=([3, 0, 4], [1, 2, 3]))
    with pytest.raises(hv.HurrayFormatError, match="block_ids"):
        export_snapshot(_caches(1, 8), LogicalBHNC(DIM), [seq], block_size=BLOCK, layer_groups=[0], group_windows=[6])


def test_windows_that_do_not_fit_the_snapshot_are_refused() -> None:
    snap = export_snapshot(
        _caches(2, 12), LogicalBHNC(DIM), _seqs(), block_size=BLOCK, layer_groups=[0, 1], group_windows=[6, None]
    )
    from dataclasses import replace

    for bad in (
        hv.SlidingWindows((6,), ((8, 4),)),  # one layer short
        hv.SlidingWindows((6, None), ((8, 4), (1, 0))),  # a full layer that does not start at 0
        hv.SlidingWindows((6, None), ((99, 4), (0, 0))),  # past the sequence's end
    ):
        assert not replace(snap, windows=bad).validate().ok
    with pytest.raises(hv.HurrayFormatError, match="windows"):
        hv.SlidingWindows.from_json({"sizes": [0], "kv_start": [[0]]})


def test_importers_that_read_every_page_refuse_dropped_windows() -> None:
    """flash-attn and FlashInfer would attend the zero page as KV (or give full layers the windowed pages)."""
    from hurray_vllm.adapters.flash_attn import plan_flash_attn
    from hurray_vllm.adapters.flashinfer import to_flashinfer, to_flashinfer_all

    snap = export_snapshot(
        _caches(2, 12), LogicalBHNC(DIM), _seqs(), block_size=BLOCK, layer_groups=[0, 1], group_windows=[6, None]
    )
    for importer in (
        lambda: plan_flash_attn(snap, page_size=16, flavor="vllm"),
        lambda: to_flashinfer_all(snap),
        lambda: to_flashinfer(snap, 1),
    ):
        with pytest.raises(hv.HurrayFormatError, match=r"snapshot\.windows"):
            importer()


def test_repaging_and_compaction_plan_each_block_structure_apart() -> None:
    """The windowed layers hold other pages than the full ones: one plan each, every token kept."""
    from hurray_vllm.kv.repage import repage_snapshot

    snap = export_snapshot(
        _caches(3, 12), LogicalBHNC(DIM), _seqs(), block_size=BLOCK, layer_groups=[0, 1, 0], group_windows=[6, None]
    )
    for other in (repage_snapshot(snap, 8), repage_snapshot(snap, 1), snap.select([1]), snap.select([0]).compact()):
        assert other.validate().ok
        for layer in range(3):
            for role in ("key", "value"):
                for s in range(other.num_seqs):
                    src = snap.request_ids.index(other.request_ids[s])
                    assert torch.equal(other[layer, role].to_dense(s), snap[layer, role].to_dense(src))


def test_in_copied_blocks_a_windowed_groups_block_0_is_real_kv() -> None:
    """``reserved_blocks=()`` (caches of copied blocks) holds with several groups too: block 0 is no hole.

    Before, the groups' plans ignored it: a windowed group's leading block 0 became a zero page (its real KV
    lost, the window starting past it) and a full group's block 0 was refused as vLLM's null block.
    """
    caches = _caches(2, 3)
    seq = SequenceState("c", [0, 1], 8, list(range(8)), group_block_ids=([0, 1], [0, 1]))
    snap = export_snapshot(
        caches,
        LogicalBHNC(DIM),
        [seq],
        block_size=BLOCK,
        reserved_blocks=(),
        layer_groups=[0, 1],
        group_windows=[6, None],
    )
    assert snap.windows is not None and snap.windows.kv_start == ((0,), (0,))
    for layer in (0, 1):
        engine = caches[layer][..., :DIM].transpose(1, 2)  # [B, N, H, D]
        assert torch.equal(snap[layer, "key"].to_dense(0), torch.cat([engine[0], engine[1]]))


def test_only_reserved_blocks_are_a_windowed_groups_holes() -> None:
    """The connector's staged copies start with a copy of the null block, reserved as in the engine's cache;
    a caller naming another reserved block has that one's leading uses become the zero page."""
    caches = _caches(1, 6)
    seq = SequenceState("s", [1, 2, 3], 12, list(range(12)), group_block_ids=([5, 0, 3],))
    snap = export_snapshot(
        caches, LogicalBHNC(DIM), [seq], block_size=BLOCK, reserved_blocks=(5,), layer_groups=[0], group_windows=[6]
    )
    assert snap.windows is not None and snap.windows.kv_start == ((4,),)
    dense = snap[0, "key"].to_dense(0)
    engine = caches[0][..., :DIM].transpose(1, 2)
    assert not dense[:4].any() and torch.equal(dense[4:], torch.cat([engine[0], engine[3]]))
    with pytest.raises(hv.HurrayFormatError, match=r"reserved block \[5\] after held ones") as err:
        bad = SequenceState("t", [1, 2], 8, list(range(8)), group_block_ids=([0, 5],))
        export_snapshot(
            caches, LogicalBHNC(DIM), [bad], block_size=BLOCK, reserved_blocks=(5,), layer_groups=[0], group_windows=[6]
        )
    assert err.value.field == "block_ids"
