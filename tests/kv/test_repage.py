"""Repaging properties: tokens kept, page-aligned sharing kept, nothing wasted, tails zero."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import paged_tensors, snapshots

import hurray_vllm as hv
from hurray_vllm.kv.repage import plan_repage, repage, repage_snapshot

TARGETS = st.sampled_from([1, 2, 3, 4, 5, 8, 16, 24, 32, 128, 256])


def shared_tokens(t: hv.BlockPagedTensor, a: int, b: int) -> int:
    """Tokens at the start of a and b that sit in the very same source slots."""
    pa, pb = t.pages_of(a).tolist(), t.pages_of(b).tolist()
    m = 0
    while m < min(len(pa), len(pb)) and pa[m] == pb[m]:
        m += 1
    return min(m * t.page_size, int(t.seq_lens[a]), int(t.seq_lens[b]))  # type: ignore[index]


@given(paged_tensors(), TARGETS)
def test_repage_properties(t: hv.BlockPagedTensor, size: int) -> None:
    r = repage(t, size)
    assert r.page_size == size
    assert r.validate().ok, r.validate().violations
    lens = t.seq_lens.tolist()  # type: ignore[union-attr]
    # Tokens preserved.
    for s in range(t.num_seqs):
        assert torch.equal(r.to_dense(s).view(torch.uint8), t.to_dense(s).view(torch.uint8))
    # Distinct pages never exceed what the tokens need.
    assert r.num_pages <= sum(-(-n // size) for n in lens)
    # Sharing preserved where the shared prefix covers whole target pages.
    for a in range(t.num_seqs):
        for b in range(a + 1, t.num_seqs):
            whole = shared_tokens(t, a, b) // size
            assert r.pages_of(a)[:whole].tolist() == r.pages_of(b)[:whole].tolist()
    # Slots no sequence uses are zero.
    valid = r.valid_slots()
    raw = r.page_pool.view(torch.uint8).reshape(r.num_pages, size, r.page_bytes // size)
    for p in range(r.num_pages):
        assert not raw[p, int(valid[p]) :].any()


@given(paged_tensors(), TARGETS, TARGETS)
def test_repage_round_trip(t: hv.BlockPagedTensor, a: int, b: int) -> None:
    back = repage(repage(t, a), b)
    for s in range(t.num_seqs):
        assert torch.equal(back.to_dense(s).view(torch.uint8), t.to_dense(s).view(torch.uint8))


@given(snapshots(), TARGETS)
def test_snapshot_repage_shares_one_plan(snap: hv.KVSnapshot, size: int) -> None:
    r = repage_snapshot(snap, size)
    last = snap.roles[-1]  # the value, or the one fused latent
    for i in range(snap.num_layers):
        assert all(torch.equal(t.block_table, r.layer(i)[0].block_table) for t in r.layer(i))
        for s in range(snap.num_seqs):
            assert torch.equal(r[i, last].to_dense(s).view(torch.uint8), snap[i, last].to_dense(s).view(torch.uint8))
    assert r.validate().ok


def test_vllm_cpu_to_fa2_and_back_keeps_prefix_sharing() -> None:
    """128-token pages (vLLM CPU) -> 256 (FA2) -> 16 (vLLM GPU), two sequences sharing 512 tokens."""
    page, heads, dim = 128, 2, 8
    lens = [700, 600]
    table = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 6])
    ptr = torch.tensor([0, 6, 11])
    pool = torch.randn(7, page, heads, dim).to(torch.bfloat16)
    t = hv.BlockPagedTensor(pool, table, ptr, torch.tensor(lens)).zero_unused_slots()
    fa2 = repage(t, 256)
    assert fa2.pages_of(0)[:2].tolist() == fa2.pages_of(1)[:2].tolist()  # 512 shared tokens = 2 pages of 256
    assert fa2.num_pages == 3 + 3 - 2
    small = repage(fa2, 16)
    assert small.sharing().shared_pages == 512 // 16
    for s in range(2):
        assert torch.equal(small.to_dense(s), t.to_dense(s))


def test_repage_needs_lengths() -> None:
    from dataclasses import replace

    t = hv.BlockPagedTensor(torch.zeros(1, 4, 1, 1), torch.tensor([0]), torch.tensor([0, 1]), None)
    with pytest.raises(hv.HurrayFormatError, match="seq_lens"):
        repage(t, 2)
    with pytest.raises(hv.HurrayFormatError, match="page_size"):
        repage(replace(t, seq_lens=torch.tensor([3])), 0)


def _per_block_affine() -> hv.BlockPagedTensor:
    """int8 pages of 4 with one scale per slot (slot p*4+i has scale p*4+i), one sequence of 10 tokens."""
    from hurray_vllm.wire.descriptor import PerBlockAffine

    pool = torch.randint(-100, 100, (3, 4, 1, 2), dtype=torch.int8)
    scales = torch.arange(12, dtype=torch.float32)
    return hv.BlockPagedTensor(
        pool,
        torch.tensor([2, 0, 1]),
        torch.tensor([0, 3]),
        torch.tensor([10]),
        quantization=PerBlockAffine(0, 4, 3),
        quant_buffers=(scales.view(torch.uint8),),
    )


def test_per_slot_scales_move_with_their_slots() -> None:
    from dataclasses import replace

    t = _per_block_affine()
    assert t.validate().ok
    r = repage(t, 8)
    assert r.quantization == replace(t.quantization, block_size=8)  # type: ignore[arg-type]
    new_scales = r.quant_buffers[0].view(torch.float32)
    # Token k of the sequence: source slot table[k // 4] * 4 + k % 4.
    src = [int(t.block_table[k // 4]) * 4 + k % 4 for k in range(10)]
    dst = [int(r.block_table[k // 8]) * 8 + k % 8 for k in range(10)]
    assert [float(new_scales[d]) for d in dst] == [float(s) for s in src]
    assert r.validate().ok


def _filled(shape: tuple[int, ...], dtype: torch.dtype, byte: int = 0x5A) -> torch.Tensor:
    """A pool of ``shape`` whose every byte is ``byte`` (a sentinel that works for every dtype)."""
    out = torch.empty(shape, dtype=dtype)
    out.view(torch.uint8).fill_(byte)
    return out


@given(paged_tensors(), TARGETS, st.integers(0, 3))
def test_repage_into_a_preallocated_pool_equals_a_fresh_one(t: hv.BlockPagedTensor, size: int, spare: int) -> None:
    fresh = repage(t, size)
    out = _filled((fresh.num_pages + spare, size, t.num_heads, t.head_dim), t.dtype)
    into = repage(t, size, out=out)
    assert fresh.num_pages == 0 or into.page_pool.data_ptr() == out.data_ptr()
    assert torch.equal(into.page_pool.view(torch.uint8), fresh.page_pool.view(torch.uint8))
    assert torch.equal(into.block_table, fresh.block_table)
    # Pages past the import are not touched.
    assert bool((out[fresh.num_pages :].view(torch.uint8) == 0x5A).all())


def test_repage_refuses_an_out_pool_that_does_not_fit() -> None:
    t = hv.BlockPagedTensor(
        torch.randn(3, 4, 2, 8, dtype=torch.bfloat16),
        torch.tensor([0, 1, 2]),
        torch.tensor([0, 3]),
        torch.tensor([10]),
        "key",
        0,
    )
    cases = {
        "too few pages": torch.empty(1, 8, 2, 8, dtype=torch.bfloat16),
        "page shape": torch.empty(4, 8, 2, 4, dtype=torch.bfloat16),
        "dtype": torch.empty(4, 8, 2, 8, dtype=torch.float16),
    }
    for why, out in cases.items():
        with pytest.raises(hv.HurrayFormatError) as err:
            repage(t, 8, out=out)
        assert err.value.field == "out", why


def test_repage_refuses_a_sequence_short_of_pages_instead_of_reading_the_next_ones() -> None:
    # Sequence 0 needs 3 pages of 4 for 10 tokens but owns 1: its tokens 4.. must not come from sequence 1's pages.
    t = hv.BlockPagedTensor(
        torch.randn(4, 4, 1, 8), torch.tensor([0, 3, 2]), torch.tensor([0, 1, 3]), torch.tensor([10, 8])
    )
    with pytest.raises(hv.HurrayFormatError) as err:
        repage(t, 8)
    assert err.value.field == "seq_lens.pages"


def test_an_import_larger_than_the_devices_memory_is_refused_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slots bound the expansion, not its bytes: every layer's new pools are counted against the memory there is.

    Refused as the readers refuse what memory cannot hold (OSError ENOMEM): the machine's limit, not a verdict on
    the data.
    """
    import errno

    import hurray_vllm.kv.repage as rp
    from hurray_vllm.adapters import transformers as tfa
    from hurray_vllm.adapters.flash_attn import to_flash_attn_all
    from hurray_vllm.adapters.flashinfer import to_flashinfer_all

    pages = 32
    bt, ptr, lens = torch.arange(pages), torch.tensor([0, pages]), torch.tensor([4 * pages])
    t = hv.BlockPagedTensor(torch.randn(pages, 4, 2, 8), bt, ptr, lens, "key", 0)
    v = hv.BlockPagedTensor(torch.randn(pages, 4, 2, 8), bt, ptr, lens, "value", 0)
    snap = hv.KVSnapshot(keys=(t,), values=(v,))
    # 128 tokens x 2 heads x 8 dims x 4 bytes = 8 KiB per layer and role: one fits in 12 KiB, both do not.
    monkeypatch.setattr(rp, "device_memory", lambda device: 12 << 10)
    assert repage(t, 8).page_pool.shape == (16, 8, 2, 8)
    for call in (
        lambda: to_flash_attn_all(snap, page_size=256, flavor="fa2", dtype=torch.float16),
        lambda: to_flashinfer_all(snap, page_size=8),
        lambda: tfa.to_dynamic_cache(snap, 0),
        lambda: rp.repage_snapshot(snap, 8),
    ):
        with pytest.raises(OSError, match="GiB in all") as err:
            call()
        assert err.value.errno == errno.ENOMEM
    plan = rp.plan_repage(t.block_table, t.seq_ptr, t.seq_lens, t.page_size, 8, t.num_pages)
    monkeypatch.setattr(rp, "device_memory", lambda device: 4 << 10)
    with pytest.raises(OSError, match="repage plan"):  # the plan's own temporaries, counted first
        repage(t, 8)
    with pytest.raises(OSError, match="repaging layer 0 key"):
        repage(t, 8, plan)
    with pytest.raises(OSError, match="sequence 0 of layer 0 key"):
        tfa.sequence_kv(snap, 0, 0)
    # Where the pools go, they are counted in the output dtype; where they are built, one layer at a time.
    # fp16 results: 2 x 4 KiB where they go; where they are built, a layer's f32 pools (2 x 8 KiB) and their copies.
    room = {"cpu": 20 << 10, "meta": 9 << 10}
    monkeypatch.setattr(rp, "device_memory", lambda device: room[torch.device(device).type])
    with pytest.raises(OSError, match="on cpu"):
        to_flashinfer_all(snap, page_size=8, dtype=torch.float16, device="meta")
    room["cpu"] = 24 << 10
    assert len(to_flashinfer_all(snap, page_size=8, dtype=torch.float16, device="meta")) == 1
    monkeypatch.setattr(rp, "device_memory", lambda device: None)  # unknown: not checked
    assert len(to_flashinfer_all(snap, page_size=8)) == 1


def test_a_batch_declaring_more_slots_than_the_budget_is_refused_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pages may repeat: one page read by a long sequence is a tiny file that declares many slots."""
    import hurray_vllm.kv.repage as rp
    from hurray_vllm.adapters.flash_attn import to_flash_attn

    pages = 64
    bt, ptr, lens = torch.zeros(pages, dtype=torch.int64), torch.tensor([0, pages]), torch.tensor([4 * pages])
    t = hv.BlockPagedTensor(torch.randn(1, 4, 1, 8), bt, ptr, lens, "key", 0)
    snap = hv.KVSnapshot(keys=(t,), values=(hv.BlockPagedTensor(torch.randn(1, 4, 1, 8), bt, ptr, lens, "value", 0),))
    monkeypatch.setattr(rp, "MAX_IMPORT_SLOTS", 100)
    with pytest.raises(hv.HurrayFormatError, match="MAX_IMPORT_SLOTS"):
        repage(t, 8)  # 256 token slots
    with pytest.raises(hv.HurrayFormatError, match="MAX_IMPORT_SLOTS"):
        to_flash_attn(snap, 0, page_size=8, flavor="fa3")  # repaged: 256 token slots
    monkeypatch.setattr(rp, "MAX_IMPORT_SLOTS", 1 << 28)
    assert int(repage(t, 8).seq_lens[0]) == 4 * pages  # within the budget: repaged as before


def _two_page_sizes() -> hv.KVSnapshot:
    """Layer 0 in pages of 4 and layer 1 in pages of 8, through one block table object (the format allows it)."""
    bt, ptr, lens = torch.tensor([0, 1]), torch.tensor([0, 1, 2]), torch.tensor([3, 2])

    def layer(ps: int, i: int) -> tuple[hv.BlockPagedTensor, hv.BlockPagedTensor]:
        pool = torch.arange(2 * ps, dtype=torch.float32).view(2, ps, 1, 1) + 100 * i
        return hv.BlockPagedTensor(pool, bt, ptr, lens, "key", i), hv.BlockPagedTensor(
            pool + 50, bt, ptr, lens, "value", i
        )

    return hv.KVSnapshot.from_layers([layer(4, 0), layer(8, 1)], token_ids=((1, 2, 3), (4, 5)))


@pytest.mark.parametrize("size", [2, 4])
def test_repage_snapshot_repages_every_layer_by_its_own_page_size(size: int) -> None:
    """Each layer's pages are read with their own size: layer 1 was left as it was (target = layer 0's page
    size) or read through layer 0's plan (one block table object), and gave other tokens."""
    snap = _two_page_sizes()
    out = repage_snapshot(snap, size)
    assert [t.page_size for t in out.tensors()] == [size] * 4
    for a, b in zip(snap.tensors(), out.tensors(), strict=True):
        for s in range(2):
            assert torch.equal(a.to_dense(s), b.to_dense(s))


def test_a_plan_made_for_other_sequences_is_refused() -> None:
    from hurray_vllm.kv.repage import plan_repage

    a = hv.BlockPagedTensor(
        torch.randn(2, 4, 1, 1), torch.tensor([0, 1]), torch.tensor([0, 1, 2]), torch.tensor([3, 4])
    )
    c = hv.BlockPagedTensor(
        torch.randn(6, 4, 1, 1), torch.tensor([1, 0]), torch.tensor([0, 1, 2]), torch.tensor([2, 3])
    )
    other = plan_repage(c.block_table, c.seq_ptr, c.seq_lens, 4, 2)  # as many sequences, other lengths
    with pytest.raises(hv.ImportArgumentError, match="another snapshot"):
        repage(a, 2, other)
    wide = hv.BlockPagedTensor(torch.randn(2, 8, 1, 1), a.block_table, a.seq_ptr, a.seq_lens)
    with pytest.raises(hv.ImportArgumentError, match="pages of 4"):  # made for pages of 4, applied to pages of 8
        repage(wide, 2, plan_repage(a.block_table, a.seq_ptr, a.seq_lens, 4, 2))


@pytest.mark.parametrize(
    ("table", "ptr", "lens", "field"),
    [
        ([0, 1], [0, 1, 2], [-2, 3], "seq_lens"),
        ([0, 1], [0, 2, 1], [3, 0], "seq_ptr"),
        ([0], [0, 1, 2], [1, 1], "seq_ptr"),
        ([0, 7], [0, 1, 2], [3, 3], "block_table"),  # page 7 of a pool of 2
        ([0, -1], [0, 1, 2], [3, 3], "block_table"),  # would read as unused slots: zeros
    ],
    ids=["negative length", "decreasing offsets", "offsets past the table", "page past the pool", "negative page"],
)
def test_an_inconsistent_block_structure_is_a_named_error(
    table: list[int], ptr: list[int], lens: list[int], field: str
) -> None:
    t = hv.BlockPagedTensor(torch.randn(2, 4, 1, 1), torch.tensor(table), torch.tensor(ptr), torch.tensor(lens))
    with pytest.raises(hv.HurrayFormatError) as exc:
        repage(t, 2)
    assert exc.value.field == field


def test_per_block_affine_pools_repage_only_to_power_of_two_pages() -> None:
    t = _per_block_affine()
    assert repage(t, 8).validate().ok
    for size in (1, 3, 6):
        with pytest.raises(hv.ImportArgumentError, match="powers of two"):
            repage(t, size)


def test_a_plan_made_for_another_block_table_or_seq_ptr_is_refused() -> None:
    """Same lengths and page size, other pages: the plan would silently gather the first tensor's tokens."""
    from hurray_vllm.kv.repage import plan_repage

    lens = torch.tensor([4, 4])
    a = hv.BlockPagedTensor(torch.randn(4, 4, 1, 2), torch.tensor([0, 1]), torch.tensor([0, 1, 2]), lens)
    b = hv.BlockPagedTensor(a.page_pool, torch.tensor([2, 3]), a.seq_ptr, lens)  # same lengths, other pages
    plan = plan_repage(a.block_table, a.seq_ptr, a.seq_lens, 4, 2, a.num_pages)
    with pytest.raises(hv.ImportArgumentError, match="another snapshot"):
        repage(b, 2, plan)
    # One table, one set of lengths, other offsets: sequence 1 reads page 1 in c, page 2 in d. (With equal
    # lengths, valid offsets are equal: each holds a surplus page, which the plan tolerates, but it must not
    # take one for the other.)
    c = hv.BlockPagedTensor(
        torch.randn(3, 4, 1, 2), torch.tensor([0, 1, 2]), torch.tensor([0, 1, 3]), torch.tensor([4, 4])
    )
    d = replace(c, seq_ptr=torch.tensor([0, 2, 3]))
    with pytest.raises(hv.ImportArgumentError, match="another snapshot"):
        repage(d, 2, plan_repage(c.block_table, c.seq_ptr, c.seq_lens, 4, 2))
    # An equal copy of the table (not the very tensor) is the same batch.
    same = repage(replace(a, block_table=a.block_table.clone(), seq_ptr=a.seq_ptr.clone()), 2, plan)
    assert torch.equal(same.to_dense(1), repage(a, 2).to_dense(1))


def test_lengths_near_the_int64_limit_are_a_named_error_not_an_overflow() -> None:
    from hurray_vllm.kv.repage import MAX_IMPORT_SLOTS, plan_repage

    table, ptr = torch.tensor([0]), torch.tensor([0, 1])
    for n in (2**63 - 1, 2**63 - 3, MAX_IMPORT_SLOTS + 1):  # seq_lens + page_size - 1 wrapped negative: "not short"
        with pytest.raises(hv.HurrayFormatError) as err:
            plan_repage(table, ptr, torch.tensor([n]), 4, 2, 1)
        assert err.value.field in ("seq_lens", "seq_lens.pages")
    # A huge target page size does not overflow the page count either: it is over the slot budget.
    with pytest.raises(hv.HurrayFormatError, match="MAX_IMPORT_SLOTS"):
        plan_repage(table, ptr, torch.tensor([3]), 4, 2**62, 1)


def test_the_plans_own_temporaries_are_counted_before_they_are_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """One page declaring many tokens (prefix sharing): the plan's [slots, page_size] temporaries are refused first."""
    import errno

    import hurray_vllm.kv.repage as rp

    seqs = 64
    table = torch.zeros(seqs * 1024, dtype=torch.int64)  # every sequence reads page 0 again and again
    ptr = torch.arange(seqs + 1) * 1024
    lens = torch.full((seqs,), 1024 * 16)
    monkeypatch.setattr(rp, "device_memory", lambda device: 32 << 20)  # the plan wants 64 B x 1 Mi slots
    built: list[int] = []
    monkeypatch.setattr(rp.torch, "repeat_interleave", lambda *a, **k: built.append(1))
    with pytest.raises(OSError, match="repage plan") as err:
        rp.plan_repage(table, ptr, lens, 16, 16, 1)
    assert err.value.errno == errno.ENOMEM and not built


def test_scales_and_zero_points_in_one_buffer_are_not_repaged() -> None:
    """The rules accept them at one index, but no layout says which bytes are a slot's: refused, not guessed."""
    from dataclasses import replace

    from hurray_vllm.wire.descriptor import PerBlockAffine

    t = _per_block_affine()
    shared = replace(
        t, quantization=PerBlockAffine(0, 4, 3, 3), quant_buffers=(torch.zeros(12 * (4 + 4), dtype=torch.uint8),)
    )
    assert shared.validate().ok
    with pytest.raises(hv.HurrayFormatError) as err:
        repage(shared, 8)
    assert err.value.field == "quantization.buffer_index" and not isinstance(err.value, hv.HurrayArgumentError)


def test_a_page_size_too_large_for_the_batch_is_the_callers_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller's page_size over the slot budget was a data error on seq_lens, as if the snapshot were at fault."""
    import hurray_vllm.kv.repage as rp

    t = hv.BlockPagedTensor(torch.zeros(1, 16, 1, 2), torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([3]))
    for size in (1 << 29, 1 << 40, 2**62):
        with pytest.raises(hv.HurrayArgumentError) as err:
            repage(t, size)
        assert err.value.field == "page_size", size
    # Many short sequences: their tokens fit the budget, the pages the caller asked for do not.
    many = hv.BlockPagedTensor(
        torch.zeros(30, 1, 1, 2), torch.arange(30), torch.arange(31), torch.ones(30, dtype=torch.int64)
    )
    monkeypatch.setattr(rp, "MAX_IMPORT_SLOTS", 100)
    with pytest.raises(hv.HurrayArgumentError) as err:
        repage(many, 8)  # 240 slots for 30 tokens
    assert err.value.field == "page_size"
    # Tokens over the budget whatever the page size: still the data's (test above), not the caller's.
    big = hv.BlockPagedTensor(
        torch.zeros(1, 4, 1, 2), torch.zeros(64, dtype=torch.int64), torch.tensor([0, 64]), torch.tensor([256])
    )
    with pytest.raises(hv.HurrayFormatError) as data_err:
        repage(big, 1 << 20)
    assert data_err.value.field == "seq_lens" and not isinstance(data_err.value, hv.HurrayArgumentError)


def test_a_narrow_block_table_is_widened_before_its_page_ids_are_multiplied() -> None:
    """page * page_size was computed in the table's dtype: in int16, 3000 * 16 wrapped and repage read zeros."""
    pool = torch.arange(3001 * 16, dtype=torch.float32).reshape(3001, 16, 1, 1)
    wide = hv.BlockPagedTensor(pool, torch.tensor([3000, 1]), torch.tensor([0, 2]), torch.tensor([20]))
    narrow = replace(wide, block_table=wide.block_table.to(torch.int16))
    for size in (8, 5):
        assert torch.equal(repage(narrow, size).to_dense(0), wide.to_dense(0))
        assert torch.equal(repage(narrow, size).page_pool, repage(wide, size).page_pool)
    # A float "table" is not widened into page ids (1.5 would read page 1): refused, naming it.
    for which in ("block_table", "seq_ptr"):
        with pytest.raises(hv.HurrayFormatError) as err:
            repage(replace(wide, **{which: getattr(wide, which).float()}), 8)
        assert err.value.field == f"{which}.dtype"


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_lengths_held_in_any_length_dtype_repage_as_int64_ones(dtype: torch.dtype) -> None:
    """torch has no repeat_interleave for 8- and 16-bit ints, and uint8 wrapped in the ceiling division."""
    pool = torch.arange(16 * 16, dtype=torch.float32).reshape(16, 16, 1, 1)
    lens = torch.tensor([20, 120])
    t = hv.BlockPagedTensor(pool, torch.arange(10), torch.tensor([0, 2, 10]), lens)
    held = replace(t, seq_lens=lens.to(dtype))
    assert held.validate().ok
    for size in (8, 5, 32):
        r, want = repage(held, size), repage(t, size)
        assert torch.equal(r.page_pool, want.page_pool) and torch.equal(r.block_table, want.block_table)
        assert r.seq_lens is not None and r.seq_lens.tolist() == [20, 120] and r.validate().ok
        assert plan_repage(held.block_table, held.seq_ptr, held.seq_lens, 16, size).seq_lens.dtype == torch.int64
    with pytest.raises(hv.HurrayFormatError) as err:
        repage(replace(t, seq_lens=lens.float()), 8)  # 3.5 tokens are not truncated to 3
    assert err.value.field == "seq_lens.dtype"


@pytest.mark.parametrize("size", [8.0, 8.5, "8", True, None])
def test_a_page_size_that_is_not_a_whole_number_is_the_callers_error(size: object) -> None:
    """A float or string page size failed in repeat_interleave or a comparison, naming nothing."""
    t = hv.BlockPagedTensor(
        torch.arange(64, dtype=torch.float32).reshape(4, 16, 1, 1),
        torch.tensor([2, 0]),
        torch.tensor([0, 2]),
        torch.tensor([20]),
    )
    snap = hv.KVSnapshot.from_layers([(t, replace(t, kv_role="value"))])
    calls = (
        lambda: repage(t, size),  # type: ignore[arg-type]
        lambda: plan_repage(t.block_table, t.seq_ptr, t.seq_lens, 16, size),  # type: ignore[arg-type]
        lambda: repage_snapshot(snap, size),  # type: ignore[arg-type]
    )
    for call in calls:
        with pytest.raises(hv.HurrayArgumentError) as err:
            call()
        assert err.value.field == "page_size"


@pytest.mark.parametrize("size", [np.int64(8), torch.tensor(8), 8])
def test_numpy_and_torch_integer_page_sizes_still_repage(size: object) -> None:
    t = hv.BlockPagedTensor(
        torch.arange(64, dtype=torch.float32).reshape(4, 16, 1, 1),
        torch.tensor([2, 0]),
        torch.tensor([0, 2]),
        torch.tensor([20]),
    )
    r = repage(t, size)  # type: ignore[arg-type]
    assert type(r.page_size) is int and r.page_size == 8
    assert torch.equal(r.to_dense(0), t.to_dense(0)) and r.validate().ok
