"""Joining snapshots split by KV heads (tensor-parallel ranks), including replicated heads (no engine)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import hurray_vllm as hv
from hurray_vllm.kv.heads import concat_heads, distinct_ranks, rank_heads


def _shard(snap: hv.KVSnapshot, heads: range) -> hv.KVSnapshot:
    layers = [
        tuple(replace(t, page_pool=t.page_pool[:, :, heads.start : heads.stop]) for t in m)
        for m in snap.layer_members()
    ]
    return snap.with_layers(layers)


def test_ranks_hold_runs_of_heads_or_replicas() -> None:
    assert [rank_heads(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert distinct_ranks(2, 4) == [0, 2] and distinct_ranks(1, 8) == [0]
    with pytest.raises(hv.HurrayFormatError):
        rank_heads(6, 4, 0)


@pytest.mark.parametrize(("heads", "tp"), [(2, 2), (4, 2), (2, 4), (1, 2)])
def test_joining_every_ranks_shard_gives_the_whole_snapshot_back(heads: int, tp: int) -> None:
    from synthetic import make_snapshot

    whole = make_snapshot([6, 3], [0, 1], 4, heads=heads, dim=8)
    shards = [_shard(whole, rank_heads(heads, tp, r)) for r in range(tp)]
    joined = concat_heads([shards[r] for r in distinct_ranks(heads, tp)])
    for x, y in zip(joined.tensors(), whole.tensors(), strict=True):
        assert torch.equal(x.page_pool, y.page_pool) and torch.equal(x.block_table, y.block_table)


def test_parts_of_another_batch_are_refused() -> None:
    from synthetic import make_snapshot

    a = make_snapshot([6, 3], [0, 1], 4, heads=2, dim=8)
    b = make_snapshot([5, 3], [0, 1], 4, heads=2, dim=8)
    with pytest.raises(hv.HurrayFormatError, match="another batch"):
        concat_heads([_shard(a, range(0, 1)), _shard(b, range(1, 2))])
