"""plan_batch (array and dict code) against the generic tensor definitions it must agree with."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hurray_vllm import BlockPagedTensor, HurrayFormatError
from hurray_vllm.adapters.vllm import SequenceState
from hurray_vllm.adapters.vllm.export import GatherBuffers, _kv_pair, _zero_tails, plan_batch
from hurray_vllm.kv.paged import plan_compaction


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[SequenceState], int]:
    """Sequences over a small pool, so block ids repeat (shared prefixes, shared partial pages)."""
    bs = draw(st.sampled_from([1, 2, 16, 32]))
    seqs = []
    for i in range(draw(st.integers(0, 6))):
        n = draw(st.integers(0, 5 * bs))
        need = -(-n // bs)
        blocks = draw(st.lists(st.integers(1, 12), min_size=need, max_size=need + 2))
        seqs.append(SequenceState(f"r{i}", blocks, n, list(range(n + draw(st.integers(0, 3))))))
    return seqs, bs


@given(batches())
def test_plan_batch_matches_the_tensor_definitions(batch: tuple[list[SequenceState], int]) -> None:
    seqs, bs = batch
    plan = plan_batch(seqs, bs)
    table = torch.tensor([b for s in seqs for b in s.block_ids[: -(-s.num_computed // bs)]], dtype=torch.int64)
    ref = plan_compaction(table, int(table.max()) + 1 if table.numel() else 0)
    assert torch.equal(plan.keep, ref.keep)
    assert torch.equal(plan.block_table, ref.block_table)
    lens = [s.num_computed for s in seqs]
    assert plan.seq_lens.tolist() == lens
    assert plan.seq_ptr.tolist() == [
        0,
        *torch.tensor([-(-n // bs) for n in lens], dtype=torch.int64).cumsum(0).tolist(),
    ]
    probe = BlockPagedTensor(torch.empty(plan.keep.numel(), bs, 0, 0), plan.block_table, plan.seq_ptr, plan.seq_lens)
    valid = probe.valid_slots()
    assert torch.equal(plan.valid, valid)
    assert list(plan.tails) == [(p, int(valid[p])) for p in range(valid.numel()) if valid[p] < bs]
    for t in (plan.keep, plan.block_table, plan.seq_ptr, plan.seq_lens):
        assert t.dtype == torch.int64


@pytest.mark.parametrize(
    ("seq", "field", "words"),
    [
        (SequenceState("a", [3, 0], 20, list(range(20))), "block_ids", "reserved block [0]"),
        (SequenceState("a", [3], 20, list(range(20))), "block_ids", "need 2 blocks"),
        (SequenceState("a", [3, -4], 20, list(range(20))), "block_ids", "negative block id"),
        (SequenceState("a", [3, "x"], 20, list(range(20))), "block_ids", "must be integers"),  # type: ignore[list-item]
        (SequenceState("a", [3], 5, list(range(4))), "num_computed", "4 token ids"),
    ],
)
def test_plan_batch_refuses_bad_sequences(seq: SequenceState, field: str, words: str) -> None:
    with pytest.raises(HurrayFormatError, match=re.escape(words)) as info:
        plan_batch([SequenceState("ok", [1], 3, [1, 2, 3]), seq], 16)
    assert info.value.field == field


def test_plan_batch_with_sparse_huge_ids_allocates_nothing_by_id() -> None:
    """A stray huge id takes the sorting path: no lookup table sized by the id."""
    seqs = [SequenceState("a", [2**40, 7, 2**40 + 1], 40, list(range(40))), SequenceState("b", [7], 3, [1, 2, 3])]
    plan = plan_batch(seqs, 16)
    assert plan.keep.tolist() == [2**40, 7, 2**40 + 1]
    assert plan.block_table.tolist() == [0, 1, 2, 1]
    assert plan.tails == ((2, 8),)


@given(batches())
def test_zeroing_tails_by_index_equals_per_page(batch: tuple[list[SequenceState], int]) -> None:
    """The device path (one index_fill_ per pool) zeroes exactly what the per-page memsets zero."""
    seqs, bs = batch
    plan = plan_batch(seqs, bs)
    pools = [torch.randn(plan.keep.numel(), bs, 2, 32) for _ in range(2)]
    a = [p.clone() for p in pools]
    b = [p.clone() for p in pools]
    # Adjacent pools (GatherBuffers lays K and V out so when the size allows): one fill for both.
    c = GatherBuffers().take(tuple(pools[0].shape), pools[0].dtype, pools[0].device)
    assert _kv_pair(*c) is not None  # 256-byte slots: V starts right after K
    for dst, src in zip(c, pools, strict=True):
        dst.copy_(src)
    _zero_tails(plan, a, {}, by_index=False)
    _zero_tails(plan, b, {}, by_index=True)
    _zero_tails(plan, c, {}, by_index=True)
    for x, y, z in zip(a, b, c, strict=True):
        assert torch.equal(x, y)
        assert torch.equal(x, z)
    for page, start in plan.tails:
        assert not a[0][page, start:].any() and a[0][page, :start].all()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_zeroing_tails_by_index_takes_every_float_format(dtype: torch.dtype) -> None:
    """fp8 pools too: index_fill_ has no float8 kernels, so the fill goes through the bytes."""
    plan = plan_batch([SequenceState("a", [3, 5], 20, list(range(20)))], 16)
    pools = [torch.full((2, 16, 2, 8), 1.5).to(dtype) for _ in range(2)]
    _zero_tails(plan, pools, {}, by_index=True)
    for pool in pools:
        assert not pool[1, 4:].float().any() and (pool[1, :4].float() == 1.5).all() and (pool[0].float() == 1.5).all()


def test_block_ids_past_the_cache_are_a_named_error_in_every_layout() -> None:
    """Not a bare IndexError (the packed CPU layout checked its ids, the token-major ones did not)."""
    from hurray_vllm.adapters.vllm.export import export_snapshot
    from hurray_vllm.adapters.vllm.layouts import CpuPacked, LogicalBHNC, MLALatent

    seq = [SequenceState("a", [3, 9], 20, list(range(20)))]  # block 9 of a cache of 4
    for layout, cache in (
        (LogicalBHNC(8), torch.zeros(4, 2, 16, 16)),
        (MLALatent(8), torch.zeros(4, 16, 8)),
        (CpuPacked("vec", 8), torch.zeros(4, 2, 16, 16)),
    ):
        with pytest.raises(HurrayFormatError) as exc:
            export_snapshot([cache], layout, seq, block_size=16)
        assert exc.value.field == "block_ids"
