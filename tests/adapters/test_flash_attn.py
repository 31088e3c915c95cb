"""flash-attn importer: attention over imported, repaged pages equals attention over the original K/V.

Everything here runs on the CPU: :func:`hurray_vllm.adapters.reference.paged_attention`
stands in for the kernel (``tests/test_gpu_kernels_flash_attn.py`` checks the
kernels against it on CUDA).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic import FP8, make_snapshot

import hurray_vllm as hv
from hurray_vllm.adapters.flash_attn import (
    FLAVORS,
    FlashAttnCache,
    FlashAttnUnavailableError,
    Flavor,
    check_flash_attn_args,
    flash_attn_with_kvcache,
    kernels,
    plan_flash_attn,
    to_flash_attn,
    to_flash_attn_all,
)
from hurray_vllm.adapters.reference import dense_attention, paged_attention
from hurray_vllm.wire.descriptor import PerTensorAffine

FLAVOR_NAMES: list[Flavor] = ["fa2", "fa3", "vllm"]

#: Page sizes each flavor accepts, to draw targets from (the source's own size is added when it fits).
TARGETS = {"fa2": [256, 512], "fa3": [7, 48, 100, 256], "vllm": [16, 48, 256]}


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    """(seq_lens, shared leading pages with the previous sequence, source page size)."""
    page = draw(st.sampled_from([16, 32, 48, 128, 256]))
    n = draw(st.integers(1, 4))
    lens: list[int] = []
    shares: list[int] = []
    for i in range(n):
        if i and draw(st.booleans()) and draw(st.booleans()):
            # An exact duplicate: its partly filled last page is shared too.
            lens.append(lens[-1])
            shares.append(10**6)
            continue
        lens.append(draw(st.integers(0, min(3 * page, 600))))
        shares.append(draw(st.integers(0, 3)))
    return lens, shares, page


def reference_values(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """What the cache holds for original values ``x``, as the float32 the kernel computes with."""
    if x.dtype in FP8:
        real = x.float() * scale
        return real if cache_dtype in FP8 else real.to(cache_dtype).float()
    return x.to(cache_dtype).float()


# ── attention over imported caches equals dense attention over the source ──


@settings(max_examples=40, deadline=None)
@given(batches(), st.data())
def test_imported_attention_matches_dense(batch: tuple[list[int], list[int], int], data: st.DataObject) -> None:
    lens, shares, src_page = batch
    flavor: Flavor = data.draw(st.sampled_from(FLAVOR_NAMES))
    targets = TARGETS[flavor] + ([src_page] if src_page % FLAVORS[flavor].page_multiple == 0 else [])
    page = data.draw(st.sampled_from(targets))
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, *FP8]))
    # fa3 takes e4m3 as stored, with head_dim a multiple of 16.
    dim = 16 if (flavor == "fa3" and dtype == torch.float8_e4m3fn) else data.draw(st.sampled_from([8, 16]))
    heads_k = data.draw(st.integers(1, 2))
    n_new = data.draw(st.integers(0, 5))
    seqlen_q = data.draw(st.sampled_from([1, 2, 4]))
    reserve = n_new + data.draw(st.integers(0, 2))
    snap = make_snapshot(
        lens, shares, src_page, heads=heads_k, dim=dim, dtype=dtype, seed=data.draw(st.integers(0, 999))
    )

    caches = to_flash_attn_all(snap, page_size=page, flavor=flavor, reserve=reserve)
    layer = data.draw(st.integers(0, snap.num_layers - 1))
    cache = caches[layer]
    assert all(c.block_table is caches[0].block_table for c in caches)
    passthrough = flavor == "fa3" and dtype == torch.float8_e4m3fn
    cdtype = dtype if passthrough or dtype not in FP8 else torch.bfloat16
    assert cache.k_cache.dtype == cdtype and cache.page_size == page
    assert cache.block_table.dtype == torch.int32 and cache.block_table.is_contiguous()
    assert cache.cache_seqlens.dtype == torch.int32 and cache.cache_seqlens.tolist() == lens
    assert cache.capacity >= max(lens) + reserve
    assert (cache.k_descale is not None) == passthrough

    gen = torch.Generator().manual_seed(7)
    batch_size, heads = len(lens), 2 * heads_k
    q = torch.randn((batch_size, seqlen_q, heads, dim), generator=gen).to(cdtype)
    k_new = torch.randn((batch_size, n_new, heads_k, dim), generator=gen).to(cdtype) if n_new else None
    v_new = torch.randn((batch_size, n_new, heads_k, dim), generator=gen).to(cdtype) if n_new else None
    q_descale = torch.rand((batch_size, heads_k), generator=gen) + 0.5 if passthrough else None
    check_flash_attn_args(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.cache_seqlens,
        cache.block_table,
        flavor=flavor,
        k=k_new,
        v=v_new,
        q_descale=q_descale,
        k_descale=cache.k_descale,
        v_descale=cache.v_descale,
    )
    out = paged_attention(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.cache_seqlens,
        cache.block_table,
        k=k_new,
        v=v_new,
        q_descale=q_descale,
        k_descale=cache.k_descale,
        v_descale=cache.v_descale,
    )
    assert out.dtype == (torch.bfloat16 if passthrough else cdtype)

    k_scale, v_scale = snap.kv_scales[layer] if snap.kv_scales else (1.0, 1.0)
    for b in range(batch_size):
        keys = reference_values(snap.keys[layer].to_dense(b), k_scale, cdtype)
        values = reference_values(snap.values[layer].to_dense(b), v_scale, cdtype)
        if k_new is not None and v_new is not None:
            keys = torch.cat([keys, k_new[b].float() * (k_scale if passthrough else 1.0)])
            values = torch.cat([values, v_new[b].float() * (v_scale if passthrough else 1.0)])
        qb = q[b].float()
        if q_descale is not None:
            qb = qb * q_descale[b].repeat_interleave(heads // heads_k)[None, :, None]
        want = dense_attention(qb, keys, values, True)
        torch.testing.assert_close(out[b].float(), want, atol=2e-2, rtol=2e-2)

    # The appended tokens are in the cache, and no sequence's append landed in another's pages.
    after = cache.advance(n_new)
    again = paged_attention(
        q,
        after.k_cache,
        after.v_cache,
        after.cache_seqlens,
        after.block_table,
        q_descale=q_descale,
        k_descale=after.k_descale,
        v_descale=after.v_descale,
    )
    torch.testing.assert_close(again.float(), out.float(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("flavor", FLAVOR_NAMES)
def test_the_dense_attention_tolerance_refuses_wrong_pages(flavor: Flavor) -> None:
    """The 2e-2 check of test_imported_attention_matches_dense fails when the block table points at wrong pages."""
    lens = [300, 130, 5]
    snap = make_snapshot(lens, [0, 1, 0], 16, heads=1, dim=16, seed=11)
    cache = to_flash_attn_all(snap, page_size=TARGETS[flavor][-1], flavor=flavor)[0]
    q = torch.randn((len(lens), 1, 2, 16), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)

    def check(block_table: torch.Tensor, b: int) -> None:
        out = paged_attention(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, block_table)
        keys = reference_values(snap.keys[0].to_dense(b), 1.0, torch.bfloat16)
        values = reference_values(snap.values[0].to_dense(b), 1.0, torch.bfloat16)
        want = dense_attention(q[b].float(), keys, values, True)
        torch.testing.assert_close(out[b].float(), want, atol=2e-2, rtol=2e-2)

    wrong = ((cache.block_table + 1) % cache.k_cache.shape[0]).to(cache.block_table.dtype)  # each page id one on
    for b in range(len(lens)):
        check(cache.block_table, b)
        with pytest.raises(AssertionError):
            check(wrong, b)


# ── the importer's structure ─────────────────────────────────────────────────


def shared_tail_snapshot() -> hv.KVSnapshot:
    """Two sequences of 6 tokens over pages of 4, both reading pages [0, 1]: page 1 is a shared, partial tail."""
    return make_snapshot([6, 6, 9], [0, 10, 1], 4, heads=1, dim=8, layers=1, seed=3)


def test_padding_is_page_zero_and_every_id_is_valid() -> None:
    snap = make_snapshot([3, 700, 0, 300], [0, 1, 0, 0], 16, layers=1)
    cache = to_flash_attn(snap, 0)
    table = cache.block_table
    assert table.shape == (4, 3)
    assert int(table.min()) >= 0 and int(table.max()) < cache.num_blocks
    assert table[0, 1:].tolist() == [0, 0] and table[2].tolist() == [0, 0, 0]


def test_all_empty_sequences_still_have_a_page() -> None:
    snap = make_snapshot([0, 0], [0, 0], 16, layers=1, spare_pages=0)
    cache = to_flash_attn(snap, 0, flavor="vllm", page_size=16)
    assert cache.num_blocks == 1 and cache.block_table.tolist() == [[0], [0]]
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    check_flash_attn_args(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.block_table, flavor="vllm")
    out = paged_attention(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.block_table)
    assert not out.any()


def test_reserve_gives_shared_tails_private_pages() -> None:
    snap = shared_tail_snapshot()
    shared = to_flash_attn(snap, 0, page_size=4, flavor="fa3")
    assert shared.block_table[0, :2].tolist() == shared.block_table[1, :2].tolist()
    cache = to_flash_attn(snap, 0, page_size=4, flavor="fa3", reserve=3)
    rows = cache.block_table.tolist()
    assert rows[0][0] == rows[1][0]  # the full page stays shared
    assert len({rows[0][1], rows[1][1], rows[2][1]}) == 3  # the partial tail is not
    before = snap.keys[0].page_pool.clone()
    q = torch.randn(3, 1, 2, 8, dtype=torch.bfloat16)
    k = torch.randn(3, 3, 1, 8, dtype=torch.bfloat16)
    args = (q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.block_table)
    check_flash_attn_args(*args, flavor="fa3", k=k, v=k)
    paged_attention(*args, k=k, v=k)
    assert torch.equal(snap.keys[0].page_pool, before), "appends must not write into the snapshot"


def test_plan_is_reused_and_checked() -> None:
    snap = make_snapshot([40, 17], [0, 1], 16, layers=3)
    plan = plan_flash_attn(snap, page_size=48, flavor="fa3", reserve=2)
    caches = [to_flash_attn(snap, i, plan=plan) for i in range(snap.num_layers)]
    assert all(c.page_size == 48 and c.flavor == "fa3" for c in caches)
    with pytest.raises(hv.HurrayFormatError) as err:
        to_flash_attn(snap, 0, plan=plan, page_size=256)
    assert err.value.field == "plan"
    other = make_snapshot([40], [0], 32, layers=1)
    with pytest.raises(hv.HurrayFormatError) as err:
        to_flash_attn(other, 0, plan=plan)
    assert err.value.field == "plan"


def test_same_page_size_and_dtype_is_zero_copy_unless_room_is_reserved() -> None:
    snap = make_snapshot([40, 17], [0, 0], 48, layers=1)
    cache = to_flash_attn(snap, 0, page_size=48, flavor="fa3")
    assert cache.k_cache.data_ptr() == snap.keys[0].page_pool.data_ptr()
    # Both tails have room for 2 more tokens: no page is added, but the pool is still copied.
    roomy = to_flash_attn(snap, 0, page_size=48, flavor="fa3", reserve=2)
    assert roomy.num_blocks == cache.num_blocks
    assert roomy.k_cache.data_ptr() != snap.keys[0].page_pool.data_ptr()


@pytest.mark.parametrize("head_dim_strided", [False, True])
def test_strided_snapshot_pools_are_imported_contiguous(head_dim_strided: bool) -> None:
    """BlockPagedTensor allows strided pools; the caches handed to flash-attn are contiguous all the same."""

    def pool(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        if head_dim_strided:  # [pages, 16, heads, dim] with dim strided: flash-attn would refuse it
            return torch.randn(3, 16, 8, 2, generator=g).to(torch.float16).transpose(2, 3)
        # head-major pages viewed token-major: dim contiguous, the pool as a whole not
        return torch.randn(3, 2, 16, 8, generator=g).to(torch.float16).transpose(1, 2)

    def paged(p: torch.Tensor, role: str) -> hv.BlockPagedTensor:
        return hv.BlockPagedTensor(p, torch.tensor([0, 1, 2]), torch.tensor([0, 2, 3]), torch.tensor([20, 5]), role, 0)

    kp, vp = pool(1), pool(2)
    snap = hv.KVSnapshot.from_layers([(paged(kp, "key"), paged(vp, "value"))])
    q = torch.randn(2, 1, 4, 8).to(torch.float16)
    for kw in ({}, {"reserve": 3}, {"dtype": torch.bfloat16}):
        cache = to_flash_attn(snap, 0, page_size=16, flavor="vllm", **kw)  # type: ignore[arg-type]
        for got, src in ((cache.k_cache, kp), (cache.v_cache, vp)):
            assert got.is_contiguous(), (kw, got.stride())
            assert torch.equal(got[: src.shape[0]].float(), src.to(got.dtype).float()), kw
        call = (q.to(cache.k_cache.dtype), cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.block_table)
        check_flash_attn_args(*call, flavor="vllm")
    # A contiguous pool is still handed out as it is (no copy).
    dense = hv.KVSnapshot.from_layers([(paged(kp.contiguous(), "key"), paged(vp.contiguous(), "value"))])
    assert to_flash_attn(dense, 0, page_size=16, flavor="vllm").k_cache.data_ptr() == dense.keys[0].page_pool.data_ptr()


@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize(("page", "flavor"), [(16, "vllm"), (256, "fa2")])
def test_importer_rejects_page_ids_outside_the_pool(page: int, flavor: Flavor, into: bool) -> None:
    snap = make_snapshot([40, 17], [0, 0], 16, layers=1)
    broken = replace(snap.keys[0], block_table=snap.keys[0].block_table + 100)
    bad = hv.KVSnapshot(keys=(broken,), values=(replace(snap.values[0], block_table=broken.block_table),))
    out = (torch.zeros(8, page, 2, 16, dtype=torch.bfloat16), torch.zeros(8, page, 2, 16, dtype=torch.bfloat16))
    with pytest.raises(hv.HurrayFormatError) as err:  # repaged (256) too: not an IndexError in the gather
        to_flash_attn(bad, 0, page_size=page, flavor=flavor, out=out if into else None)
    assert err.value.field == "block_table" and not isinstance(err.value, hv.HurrayArgumentError)


def everywhere(snap: hv.KVSnapshot, **changes: object) -> hv.KVSnapshot:
    """``snap`` with every layer's key and value changed alike (still one block structure)."""
    return replace(
        snap,
        keys=tuple(replace(t, **changes) for t in snap.keys),  # type: ignore[arg-type]
        values=tuple(replace(t, **changes) for t in snap.values),  # type: ignore[arg-type]
    )


def test_every_layer_and_role_must_share_layer_0s_structure() -> None:
    snap = make_snapshot([40, 17], [0, 0], 16, layers=2)
    k0, v0, v1 = snap.keys[0], snap.values[0], snap.values[1]
    cases = {
        "value's block_table": replace(snap, values=(replace(v0, block_table=v0.block_table.flip(0)), v1)),
        "seq_lens": replace(snap, values=(v0, replace(v1, seq_lens=torch.tensor([39, 17])))),
        "seq_ptr": replace(snap, values=(v0, replace(v1, seq_ptr=torch.tensor([0, 2, 4])))),
        "page count": replace(snap, values=(v0, replace(v1, page_pool=torch.cat([v1.page_pool, v1.page_pool])))),
        "value's dtype": replace(snap, values=(replace(v0, page_pool=v0.page_pool.half()), v1)),
    }
    for why, bad in cases.items():
        with pytest.raises(hv.HurrayFormatError) as err:
            to_flash_attn(bad, 0, page_size=16, flavor="vllm")
        assert err.value.field == "snapshot.structure", why
    # Layers may differ from each other in heads (each is imported alone), not a layer's key from its value.
    wide = make_snapshot([40, 17], [0, 0], 16, layers=1, heads=4, seed=1)
    mixed = hv.KVSnapshot(
        keys=(k0, replace(wide.keys[0], block_table=k0.block_table)),
        values=(v0, replace(wide.values[0], block_table=k0.block_table)),
    )
    assert [c.num_kv_heads for c in to_flash_attn_all(mixed, page_size=16, flavor="vllm")] == [2, 4]


@pytest.mark.parametrize(
    ("why", "changes", "field"),
    [
        ("offsets past the table", {"seq_ptr": torch.tensor([0, 3, 9])}, "seq_ptr"),
        ("a length too many", {"seq_lens": torch.tensor([40, 17, 1])}, "seq_ptr"),
        ("a negative length", {"seq_lens": torch.tensor([40, -17])}, "seq_lens"),
    ],
)
def test_an_inconsistent_structure_is_refused_without_repaging(
    why: str, changes: dict[str, object], field: str
) -> None:
    snap = everywhere(make_snapshot([40, 17], [0, 0], 16, layers=1), **changes)
    with pytest.raises(hv.HurrayFormatError) as err:  # page sizes agree: nothing is repaged
        to_flash_attn(snap, 0, page_size=16, flavor="vllm")
    assert err.value.field == field, why


def test_short_kv_scales_are_the_snapshots_error() -> None:
    snap = make_snapshot([40, 17], [0, 0], 16, dtype=torch.float8_e4m3fn, layers=2)
    bad = replace(snap, kv_scales=snap.kv_scales[:1])  # type: ignore[index]
    with pytest.raises(hv.HurrayFormatError) as err:
        to_flash_attn(bad, 1, page_size=16, flavor="vllm")
    assert err.value.field == "snapshot.kv_scales"


def test_an_oversized_reserve_is_the_callers_error() -> None:
    snap = make_snapshot([40, 17], [0, 0], 16, layers=1)
    for reserve in (2**31, 2**31 - 10):  # past int32 alone; past int32 with the 40 tokens
        with pytest.raises(hv.HurrayArgumentError) as err:
            plan_flash_attn(snap, reserve=reserve)
        assert err.value.field == "reserve" and not isinstance(err.value, hv.HurrayFormatError)


@pytest.mark.parametrize("reserve", [1.5, 0.5, float("nan"), "1", None, True])
def test_a_reserve_that_is_not_an_integer_is_refused(reserve: object) -> None:
    """1.5 tokens of room added a page and 0.5 none; "1" and None failed with a bare TypeError."""
    snap = make_snapshot([256, 17], [0, 0], 16, layers=1)
    with pytest.raises(hv.HurrayArgumentError) as err:
        plan_flash_attn(snap, page_size=256, reserve=reserve)  # type: ignore[arg-type]
    assert err.value.field == "reserve" and not isinstance(err.value, hv.HurrayFormatError)


@pytest.mark.parametrize("page_size", ["256", 256.0])
def test_a_page_size_that_is_not_an_integer_is_refused(page_size: object) -> None:
    """ "256" failed with a bare TypeError; 256.0 on a snapshot of pages of 256 went on as a float page size."""
    for pages in (16, 256):
        snap = make_snapshot([256, 17], [0, 0], pages, layers=1)
        with pytest.raises(hv.ImportArgumentError) as err:
            plan_flash_attn(snap, page_size=page_size)  # type: ignore[arg-type]
        assert err.value.field == "page_size"
        with pytest.raises(hv.ImportArgumentError) as err:
            to_flash_attn(snap, 0, page_size=page_size)  # type: ignore[arg-type]
        assert err.value.field == "page_size"


def test_import_in_place_is_refused_with_room_reserved() -> None:
    snap = make_snapshot([40, 17], [0, 0], 48, layers=1)
    k, v = snap.keys[0].page_pool, snap.values[0].page_pool
    assert to_flash_attn(snap, 0, page_size=48, flavor="fa3", out=(k, v)).k_cache is k  # in place: allowed
    plan = plan_flash_attn(snap, page_size=48, flavor="fa3", reserve=2)
    assert not plan.extra_pages.numel()  # both tails have room: no page is added
    with pytest.raises(hv.HurrayArgumentError) as err:
        to_flash_attn(snap, 0, plan=plan, out=(k, v))
    assert err.value.field == "out[0]"


def test_fp8_dequantized_for_fa2_and_passed_through_for_fa3() -> None:
    snap = make_snapshot([300, 20], [0, 0], 256, dtype=torch.float8_e4m3fn, layers=2)
    k_scale, v_scale = snap.kv_scales[1]  # type: ignore[index]
    fa2 = to_flash_attn(snap, 1)
    assert fa2.k_cache.dtype == torch.bfloat16 and fa2.k_descale is None
    assert torch.equal(fa2.k_cache, (snap.keys[1].page_pool.float() * k_scale).to(torch.bfloat16))
    half = to_flash_attn(snap, 1, dtype=torch.float16)
    assert torch.equal(half.v_cache, (snap.values[1].page_pool.float() * v_scale).to(torch.float16))
    fa3 = to_flash_attn(snap, 1, flavor="fa3")
    assert fa3.k_cache.dtype == torch.float8_e4m3fn
    assert fa3.k_descale is not None and fa3.v_descale is not None
    assert fa3.k_descale.dtype == torch.float32 and fa3.k_descale.shape == (2, 2)
    assert torch.all(fa3.k_descale == k_scale) and torch.all(fa3.v_descale == v_scale)
    assert set(fa3.kwargs()) == {"cache_seqlens", "page_table", "k_descale", "v_descale"}
    e5m2 = make_snapshot([30], [0], 16, dtype=torch.float8_e5m2, layers=1)
    assert to_flash_attn(e5m2, 0, flavor="fa3").k_cache.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "dtype", "field"),
    [
        ({"flavor": "fa2", "page_size": 128}, torch.bfloat16, "page_size"),
        ({"flavor": "vllm", "page_size": 24}, torch.bfloat16, "page_size"),
        ({"flavor": "fa3", "page_size": 0}, torch.bfloat16, "page_size"),
        ({"flavor": "fa4"}, torch.bfloat16, "flavor"),
        ({}, torch.float32, "dtype"),
        ({}, torch.int8, "dtype"),
        ({"dtype": torch.float8_e4m3fn}, torch.bfloat16, "dtype"),
        ({"flavor": "fa3", "dtype": torch.float8_e4m3fn}, torch.bfloat16, "dtype"),
        ({"reserve": -1}, torch.bfloat16, "reserve"),
    ],
)
def test_importer_rejects(kwargs: dict[str, object], dtype: torch.dtype, field: str) -> None:
    snap = make_snapshot([20, 5], [0, 0], 16, dtype=dtype, layers=1)
    # Options out of range are the caller's error; a pool the kernel cannot take is the data's.
    expected = hv.HurrayArgumentError if field in {"page_size", "flavor", "reserve"} else hv.HurrayFormatError
    with pytest.raises(expected) as err:
        to_flash_attn(snap, 0, **kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_importer_rejects_bad_layer_and_head_dim() -> None:
    snap = make_snapshot([20], [0], 16, layers=1)
    with pytest.raises(hv.HurrayFormatError) as err:
        to_flash_attn(snap, 1)
    assert err.value.field == "layer"
    wide = make_snapshot([20], [0], 16, dim=264, layers=1)
    with pytest.raises(hv.HurrayFormatError) as err:
        to_flash_attn(wide, 0)
    assert err.value.field == "head_dim"
    odd = make_snapshot([20], [0], 16, dim=12, layers=1)
    with pytest.raises(hv.HurrayFormatError) as err:
        to_flash_attn(odd, 0, flavor="fa3")
    assert err.value.field == "head_dim"
    assert to_flash_attn(odd, 0, flavor="fa2").head_dim == 12  # FA2 pads odd head sizes itself


def test_vllm_flavor_needs_head_dim_a_multiple_of_8() -> None:
    """vLLM's fork only has flash_attn_varlen_func, whose mha_varlen_fwd requires head_size % 8 == 0."""
    odd = make_snapshot([20, 5], [0, 0], 16, dim=12, layers=1)
    with pytest.raises(hv.HurrayFormatError) as fmt:
        to_flash_attn(odd, 0, flavor="vllm", page_size=16)
    assert fmt.value.field == "head_dim"
    cache = torch.zeros(4, 16, 2, 12, dtype=torch.bfloat16)
    q = torch.randn(2, 1, 4, 12, dtype=torch.bfloat16)
    lens, table = torch.tensor([20, 5], dtype=torch.int32), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(hv.HurrayArgumentError, match="head_dim a multiple of 8") as err:
        check_flash_attn_args(q, cache, cache.clone(), lens, table, flavor="vllm")
    assert err.value.field == "q"


# ── the contract checker ─────────────────────────────────────────────────────


def valid_call(flavor: str = "fa2", dtype: torch.dtype = torch.bfloat16) -> dict[str, object]:
    """A call check_flash_attn_args accepts: batch 2, 4 query heads over 2 KV heads, head_dim 16, 2 appends."""
    page = 256 if flavor == "fa2" else 16
    snap = make_snapshot([20, 300], [0, 0], 16, dtype=dtype, layers=1)
    cache = to_flash_attn(snap, 0, page_size=page, flavor=flavor, reserve=2)  # type: ignore[arg-type]
    cdtype = cache.k_cache.dtype
    return {
        "q": torch.randn(2, 2, 4, 16).to(cdtype),
        "k_cache": cache.k_cache,
        "v_cache": cache.v_cache,
        "cache_seqlens": cache.cache_seqlens,
        "block_table": cache.block_table,
        "flavor": flavor,
        "k": torch.randn(2, 2, 2, 16).to(cdtype),
        "v": torch.randn(2, 2, 2, 16).to(cdtype),
        "k_descale": cache.k_descale,
        "v_descale": cache.v_descale,
    }


def strided_last(t: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
    view = wide[..., ::2]
    view.copy_(t)
    return view


def on_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def shared_write(c: dict[str, object]) -> None:
    """Both sequences read sequence 1's pages, so both append into its partly filled last page."""
    table = c["block_table"]
    assert isinstance(table, torch.Tensor)
    c["block_table"] = table[1].expand(2, -1).contiguous()
    c["cache_seqlens"] = torch.tensor([300, 300], dtype=torch.int32)


def narrow_head_dim(c: dict[str, object], dim: int) -> None:
    for name in ("q", "k_cache", "v_cache", "k", "v"):
        c[name] = c[name][..., :dim].contiguous()  # type: ignore[index]


def _both_caches(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, object]], None]:
    def mutate(c: dict[str, object]) -> None:
        c["k_cache"] = fn(c["k_cache"])  # type: ignore[arg-type]
        c["v_cache"] = fn(c["v_cache"])  # type: ignore[arg-type]

    return mutate


def _set(name: str, fn: Callable[[torch.Tensor], object]) -> Callable[[dict[str, object]], None]:
    def mutate(c: dict[str, object]) -> None:
        c[name] = fn(c[name])  # type: ignore[arg-type]

    return mutate


def _put(name: str, value: Callable[[], object]) -> Callable[[dict[str, object]], None]:
    def mutate(c: dict[str, object]) -> None:
        c[name] = value()

    return mutate


INVALID: list[tuple[str, str, Callable[[dict[str, object]], None], str]] = [
    ("unknown flavor", "fa2", _put("flavor", lambda: "fa1"), "flavor"),
    ("q rank", "fa2", _set("q", lambda t: t[0]), "q"),
    ("q dtype", "fa2", _set("q", lambda t: t.float()), "q"),
    ("q fp8 on fa2", "fa2", _set("q", lambda t: t.to(torch.float8_e4m3fn)), "q"),
    ("e5m2 on fa3", "fa3", _set("q", lambda t: t.to(torch.float8_e5m2)), "q"),
    ("empty batch", "fa2", _set("q", lambda t: t[:0]), "q"),
    ("q strided", "fa2", _set("q", strided_last), "q"),
    ("cache dtype", "fa2", _set("k_cache", lambda t: t.half()), "k_cache"),
    ("cache rank", "fa2", _set("k_cache", lambda t: t.flatten(0, 1)), "k_cache"),
    ("cache strided", "fa2", _set("v_cache", strided_last), "v_cache"),
    ("k/v cache shapes", "fa2", _set("v_cache", lambda t: t[:-1]), "v_cache"),
    ("head_dim mismatch", "fa2", _set("q", lambda t: t[..., :8].contiguous()), "k_cache"),
    ("fa2 page 128", "fa2", _both_caches(lambda t: t[:, :128]), "k_cache"),
    ("vllm page 8", "vllm", _both_caches(lambda t: t[:, :8]), "k_cache"),
    ("heads not a multiple", "fa2", _set("q", lambda t: t[:, :, :3].contiguous()), "q"),
    ("cache device", "fa2", _set("k_cache", on_meta), "k_cache"),
    ("cache_batch_idx", "fa2", _put("cache_batch_idx", lambda: torch.arange(2, dtype=torch.int32)), "cache_batch_idx"),
    ("cache_leftpad", "fa3", _put("cache_leftpad", lambda: torch.zeros(2, dtype=torch.int32)), "cache_leftpad"),
    ("no block_table", "fa2", _put("block_table", lambda: None), "block_table"),
    ("block_table int64", "fa2", _set("block_table", lambda t: t.long()), "block_table"),
    ("block_table rows", "fa2", _set("block_table", lambda t: t[:1]), "block_table"),
    ("block_table strided", "fa2", _set("block_table", strided_last), "block_table"),
    ("page id too large", "fa2", _set("block_table", lambda t: t + 1000), "block_table"),
    ("page id negative", "fa2", _set("block_table", lambda t: t - 1000), "block_table"),
    ("append into a shared page", "vllm", shared_write, "block_table"),
    ("no cache_seqlens", "fa2", _put("cache_seqlens", lambda: None), "cache_seqlens"),
    ("cache_seqlens int64", "fa2", _set("cache_seqlens", lambda t: t.long()), "cache_seqlens"),
    ("cache_seqlens shape", "fa2", _set("cache_seqlens", lambda t: t[None]), "cache_seqlens"),
    ("cache_seqlens negative", "fa2", _set("cache_seqlens", lambda t: t - 1000), "cache_seqlens"),
    ("over capacity", "fa2", _set("cache_seqlens", lambda t: t + 255), "cache_seqlens"),
    ("k without v", "fa2", _put("v", lambda: None), "v"),
    ("k dtype", "fa2", _set("k", lambda t: t.half()), "k"),
    ("k heads", "fa2", _set("k", lambda t: t[:, :, :1].contiguous()), "k"),
    ("v length", "fa2", _set("v", lambda t: t[:, :1]), "v"),
    ("descale on fa2", "fa2", _put("k_descale", lambda: torch.ones(2, 2)), "k_descale"),
    ("descale on 16-bit fa3", "fa3", _put("v_descale", lambda: torch.ones(2, 2)), "v_descale"),
]

INVALID_FP8: list[tuple[str, Callable[[dict[str, object]], None], str]] = [
    ("descale shape", _set("k_descale", lambda t: t[:, :1]), "k_descale"),
    ("descale dtype", _set("v_descale", lambda t: t.double()), "v_descale"),
    ("fp8 head_dim 8", lambda c: narrow_head_dim(c, 8), "q"),
]


@pytest.mark.parametrize(("case", "flavor", "mutate", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_checker_rejects(case: str, flavor: str, mutate: Callable[[dict[str, object]], None], field: str) -> None:
    call = valid_call(flavor)
    check_flash_attn_args(**call)  # type: ignore[arg-type]
    mutate(call)
    with pytest.raises(hv.HurrayArgumentError) as err:
        check_flash_attn_args(**call)  # type: ignore[arg-type]
    assert err.value.field == field, (case, err.value)


@pytest.mark.parametrize(("case", "mutate", "field"), INVALID_FP8, ids=[c[0] for c in INVALID_FP8])
def test_checker_rejects_fp8(case: str, mutate: Callable[[dict[str, object]], None], field: str) -> None:
    call = valid_call("fa3", torch.float8_e4m3fn)
    call["q_descale"] = torch.ones(2, 2)
    check_flash_attn_args(**call)  # type: ignore[arg-type]
    mutate(call)
    with pytest.raises(hv.HurrayArgumentError) as err:
        check_flash_attn_args(**call)  # type: ignore[arg-type]
    assert err.value.field == field, (case, err.value)


def test_checker_takes_an_int_cache_seqlens_as_flash_attn_does() -> None:
    """flash_attn_with_kvcache (FA2, FA3) expands an int cache_seqlens to torch.full((batch,), n, int32)."""
    call = valid_call("vllm")  # block_table rows of 19 pages of 16 (300 tokens + 2 reserved)
    call["cache_seqlens"] = 20
    check_flash_attn_args(**call)  # type: ignore[arg-type]
    for value, why in ((400, r"max\(cache_seqlens\)"), (-1, ">= 0"), (2**31, "int32"), ([20, 300], "an int")):
        call["cache_seqlens"] = value
        with pytest.raises(hv.HurrayArgumentError, match=why) as err:
            check_flash_attn_args(**call)  # type: ignore[arg-type]
        assert err.value.field == "cache_seqlens", value


def test_checker_ignores_padding_past_the_covered_pages() -> None:
    call = valid_call("vllm")
    table = call["block_table"]
    assert isinstance(table, torch.Tensor)
    padded = torch.full((2, table.shape[1] + 3), -7, dtype=torch.int32)
    padded[:, : table.shape[1]] = table
    padded[0, 2:] = 10**6  # sequence 0 covers 22 tokens: 2 pages of 16
    call["block_table"] = padded
    check_flash_attn_args(**call)  # type: ignore[arg-type]


def test_checker_counts_grouped_heads_of_one_query_against_the_cache() -> None:
    def call(flavor: Flavor, page: int = 16, dim: int = 16, appends: bool = True) -> None:
        """One query of page + 1 heads over 1 KV head, appending 1 token to a one-page block table row."""
        cache = torch.zeros(2, page, 1, dim, dtype=torch.bfloat16)
        new = torch.zeros(1, 1, 1, dim, dtype=torch.bfloat16) if appends else None
        q = torch.randn(1, 1, page + 1, dim, dtype=torch.bfloat16)
        lens, table = torch.tensor([3], dtype=torch.int32), torch.tensor([[1]], dtype=torch.int32)
        check_flash_attn_args(q, cache, cache.clone(), lens, table, flavor=flavor, k=new, v=new)

    # FA2 and vLLM's fork run it as page + 1 queries of one head (seqlenq_ngroups_swapped): one too many.
    # (For vllm this is conservative: newer forks' varlen fallback lacks the rule; see _kernel_seqlen_q.)
    for flavor, page in (("fa2", 256), ("vllm", 16)):
        with pytest.raises(hv.HurrayArgumentError) as err:
            call(flavor, page)  # type: ignore[arg-type]
        assert err.value.field == "q"
    call("fa3")  # FA3 keeps seqlen_q = 1
    call("vllm", appends=False)  # the rule is for appends only
    call("fa2", page=256, dim=12)  # head_dim % 8 != 0: the kernel does not regroup


def test_checker_fa2_needs_seqlen_q_within_the_cache_with_appends() -> None:
    call = valid_call("fa2")
    call["q"] = torch.randn(2, 600, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(hv.HurrayArgumentError) as err:
        check_flash_attn_args(**call)  # type: ignore[arg-type]
    assert err.value.field == "q"


def test_wrapper_checks_then_points_to_the_reference_on_cpu() -> None:
    snap = make_snapshot([20, 5], [0, 0], 16, layers=1)
    cache = to_flash_attn(snap, 0)
    with pytest.raises(hv.HurrayArgumentError):
        flash_attn_with_kvcache(torch.randn(2, 1, 4, 16), cache)  # float32 q
    with pytest.raises(FlashAttnUnavailableError, match="paged_attention"):
        flash_attn_with_kvcache(torch.randn(2, 1, 4, 16, dtype=torch.bfloat16), cache)
    assert isinstance(cache.advance(2), FlashAttnCache)
    assert cache.advance(2).cache_seqlens.tolist() == [22, 7]


# ── the reference itself ─────────────────────────────────────────────────────


@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(1, 9), (3, 9), (9, 9)])
def test_dense_attention_matches_sdpa_with_gqa(seqlen_q: int, seqlen_k: int) -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn((seqlen_q, 6, 8), generator=gen)
    k = torch.randn((seqlen_k, 2, 8), generator=gen)
    v = torch.randn((seqlen_k, 2, 8), generator=gen)
    mask = torch.arange(seqlen_k)[None, :] <= torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(dense_attention(q, k, v, True), want)


def test_rows_that_see_no_key_are_zero() -> None:
    q = torch.randn(5, 2, 8)
    k = torch.randn(2, 1, 8)
    out = dense_attention(q, k, k, True)
    assert not out[:3].any() and out[3:].abs().sum() > 0
    assert dense_attention(q, k[:0], k[:0], False).abs().sum() == 0


def test_paged_attention_of_an_empty_batch_is_empty() -> None:
    cache = torch.randn(3, 16, 2, 8)
    none = torch.zeros(0, dtype=torch.int32)
    out = paged_attention(torch.randn(0, 1, 4, 8), cache, cache.clone(), none, none.reshape(0, 1))
    assert out.shape == (0, 1, 4, 8) and out.dtype == torch.float32


def test_paged_attention_rejects_pages_outside_the_cache() -> None:
    snap = make_snapshot([20, 5], [0, 0], 16, layers=1)
    cache = to_flash_attn(snap, 0, page_size=16, flavor="vllm")
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    bad = replace(cache, block_table=cache.block_table.clone().fill_(99))
    with pytest.raises(hv.HurrayArgumentError) as err:
        paged_attention(q, bad.k_cache, bad.v_cache, bad.cache_seqlens, bad.block_table)
    assert err.value.field == "block_table"


@settings(max_examples=40)
@given(
    flavor=st.sampled_from(FLAVOR_NAMES),
    reserve=st.sampled_from([0, 3]),
    dtype=st.sampled_from([torch.bfloat16, torch.float8_e4m3fn]),
    spare=st.integers(0, 2),
    data=st.data(),
)
def test_import_into_preallocated_caches_equals_a_fresh_import(
    flavor: Flavor, reserve: int, dtype: torch.dtype, spare: int, data: st.DataObject
) -> None:
    snap = make_snapshot([40, 17, 33], [0, 2, 1], 16, dtype=dtype, layers=2, seed=data.draw(st.integers(0, 99)))
    page = data.draw(st.sampled_from(TARGETS[flavor]))
    plan = plan_flash_attn(snap, page_size=page, flavor=flavor, reserve=reserve)
    fresh = to_flash_attn_all(snap, page_size=page, flavor=flavor, reserve=reserve)
    shape = (plan.num_blocks + spare, page, 2, 16)
    pools = []
    for f in fresh:
        pair = (torch.empty(shape, dtype=f.k_cache.dtype), torch.empty(shape, dtype=f.k_cache.dtype))
        for p in pair:
            p.view(torch.uint8).fill_(0x5A)
        pools.append(pair)
    into = to_flash_attn_all(snap, page_size=page, flavor=flavor, reserve=reserve, out=pools)
    for f, i, pair in zip(fresh, into, pools, strict=True):
        assert i.k_cache is pair[0] and i.v_cache is pair[1]
        for a, b in ((f.k_cache, i.k_cache), (f.v_cache, i.v_cache)):
            assert torch.equal(a.view(torch.uint8), b[: plan.num_blocks].view(torch.uint8))
            assert bool((b[plan.num_blocks :].view(torch.uint8) == 0x5A).all())
        assert torch.equal(f.block_table, i.block_table)
        assert (f.k_descale is None) == (i.k_descale is None)


def test_import_into_checks_every_cache_before_writing_any() -> None:
    snap = make_snapshot([40, 17], [0, 1], 16, layers=2)
    plan = plan_flash_attn(snap, page_size=256, reserve=8)

    def pool(heads: int = 2) -> torch.Tensor:
        return torch.full((plan.num_blocks, 256, heads, 16), 7.0, dtype=torch.bfloat16)

    strided = torch.full((plan.num_blocks, 16, 2, 256), 7.0, dtype=torch.bfloat16).permute(0, 3, 2, 1)
    for out in ([(pool(), pool()), (pool(), pool(3))], [(pool(), pool()), (pool(), strided)]):
        with pytest.raises((hv.HurrayFormatError, hv.HurrayArgumentError)) as err:
            to_flash_attn_all(snap, page_size=256, reserve=8, out=out)
        assert err.value.field == "out[1][1]"
        assert all(bool((o == 7.0).all()) for pair in out for o in pair), "nothing is written before the checks pass"


def test_import_into_refuses_caches_that_alias_the_snapshot() -> None:
    snap = make_snapshot([40, 17], [0, 1], 16, layers=1)
    k, v = snap.keys[0].page_pool, snap.values[0].page_pool
    before = (k.clone(), v.clone())
    for out in ((v, k), (k, k), (k.view(-1, 32, *k.shape[2:]), v.view(-1, 32, *v.shape[2:]))):
        with pytest.raises(hv.HurrayArgumentError):
            to_flash_attn(snap, 0, page_size=out[0].shape[1], flavor="fa3", out=out)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


def test_a_plan_for_other_lengths_or_pages_is_refused() -> None:
    snap = make_snapshot([40, 17], [0, 1], 16, layers=1)
    other_lens = make_snapshot([33, 20], [0, 1], 16, layers=1)
    for page in (16, 256):
        plan = plan_flash_attn(snap, page_size=page, flavor="fa3")
        with pytest.raises(hv.HurrayFormatError) as err:
            to_flash_attn(other_lens, 0, plan=plan)
        assert err.value.field == "plan"


def test_import_into_refuses_caches_that_do_not_fit() -> None:
    snap = make_snapshot([40, 17], [0, 1], 16, layers=1)
    plan = plan_flash_attn(snap, page_size=256)
    good = torch.empty(plan.num_blocks, 256, 2, 16, dtype=torch.bfloat16)
    cases = {
        "out": ("not a pair", (good,)),
        "out[0]": ("too few pages", (good[:0], good.clone())),
        "out[1]": ("dtype", (good, good.half())),
    }
    for field, (why, out) in cases.items():
        with pytest.raises(hv.HurrayFormatError) as err:
            to_flash_attn(snap, 0, plan=plan, out=out)  # type: ignore[arg-type]
        assert err.value.field == field, why
    with pytest.raises(hv.HurrayFormatError) as err:
        to_flash_attn_all(snap, out=[])
    assert err.value.field == "out"


def two_layers(second: hv.KVSnapshot, **changes: object) -> hv.KVSnapshot:
    """Layer 0 of a [40, 17] batch over pages of 16, then ``second``'s layer 0 (changed) on the same block structure."""
    first = make_snapshot([40, 17], [0, 1], 16, layers=1)
    k0, v0 = first.keys[0], first.values[0]
    k1, v1 = (replace(t, block_table=k0.block_table, layer_index=1) for t in (second.keys[0], second.values[0]))
    k1, v1 = replace(k1, **changes), replace(v1, **changes)  # type: ignore[arg-type]
    return hv.KVSnapshot(keys=(k0, k1), values=(v0, v1))


def test_import_all_into_checks_every_layer_before_writing_any() -> None:
    """A later layer's head_dim, pools or dtype refused after earlier layers were written would leave out= half
    imported: every layer's checks run first."""
    odd = two_layers(make_snapshot([40, 17], [0, 1], 16, layers=1, dim=12))  # fa3 needs multiples of 8
    scaled = two_layers(make_snapshot([40, 17], [0, 1], 16, layers=1), quantization=PerTensorAffine(0.5))
    for snap, field in ((odd, "head_dim"), (scaled, "quantization")):
        plan = plan_flash_attn(snap, page_size=16, flavor="fa3")
        out = [
            tuple(torch.full((plan.num_blocks, 16, 2, t.head_dim), 7.0, dtype=torch.bfloat16) for _ in range(2))
            for t in snap.keys
        ]
        with pytest.raises(hv.HurrayFormatError) as err:
            to_flash_attn_all(snap, page_size=16, flavor="fa3", out=out)  # type: ignore[arg-type]
        assert err.value.field == field
        assert all(bool((o == 7.0).all()) for pair in out for o in pair), "nothing is written before the checks pass"


def test_import_into_refuses_caches_of_two_page_counts() -> None:
    # flash-attn checks v_cache against k_cache's shape, num_blocks included.
    snap = make_snapshot([40, 17], [0, 1], 16, layers=1)
    plan = plan_flash_attn(snap, page_size=256)
    k = torch.zeros(plan.num_blocks, 256, 2, 16, dtype=torch.bfloat16)
    v = torch.zeros(plan.num_blocks + 1, 256, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(hv.HurrayArgumentError) as err:
        to_flash_attn(snap, 0, plan=plan, out=(k, v))
    assert err.value.field == "out" and not bool(k.any())


def split_pages(seq_ptr: list[int]) -> hv.KVSnapshot:
    """Pages 0, 1, 2 (of 16 tokens) split between two sequences of 16 tokens by ``seq_ptr``; same values every time."""
    gen = torch.Generator().manual_seed(0)
    table, ptr, lens = torch.tensor([0, 1, 2]), torch.tensor(seq_ptr), torch.tensor([16, 16])
    k, v = (
        hv.BlockPagedTensor(torch.randn(3, 16, 2, 16, generator=gen).to(torch.bfloat16), table, ptr, lens, role, 0)
        for role in ("key", "value")
    )
    return hv.KVSnapshot(keys=(k,), values=(v,))


@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize("page", [16, 32])
def test_a_plan_for_another_split_of_the_same_pages_is_refused(page: int, into: bool) -> None:
    """Same block table values and lengths, other seq_ptr: the plan's table would give sequence 1 the wrong page
    (as is without repaging; with repaging into out=, repage_into checks nothing)."""
    other, snap = split_pages([0, 2, 3]), split_pages([0, 1, 3])
    plan = plan_flash_attn(other, page_size=page, flavor="fa3")
    k = torch.full((plan.num_blocks, page, 2, 16), 7.0, dtype=torch.bfloat16)
    out = (k, k.clone())
    with pytest.raises(hv.ImportArgumentError) as err:
        to_flash_attn(snap, 0, plan=plan, out=out if into else None)
    assert err.value.field == "plan"
    assert all(bool((o == 7.0).all()) for o in out), "nothing is written"
    to_flash_attn(snap, 0, plan=plan_flash_attn(snap, page_size=page, flavor="fa3"), out=out)  # its own plan


def test_import_all_into_refuses_caches_shared_between_layers() -> None:
    """One pair for every layer: each layer would overwrite the one before, checked before anything is written."""
    snap = make_snapshot([40, 17], [0, 1], 16, layers=3)
    plan = plan_flash_attn(snap, page_size=256)
    shape = (plan.num_blocks, 256, 2, 16)
    pools = [torch.full((2 * plan.num_blocks, *shape[1:]), 7.0, dtype=torch.bfloat16) for _ in range(4)]
    k, v = pools[0][: plan.num_blocks], pools[1][: plan.num_blocks]
    cases = {
        "one pair for every layer": ([(k, v)] * 3, "out[1]"),
        "layer 2's k_cache is layer 0's v_cache": (
            [(k, v), (pools[2], pools[3]), (v, pools[0][plan.num_blocks :])],
            "out[2]",
        ),
        "overlapping views": (
            [(k, v), (pools[0][1 : plan.num_blocks + 1], pools[2]), (pools[3], pools[1][plan.num_blocks :])],
            "out[1]",
        ),
    }
    for why, (out, field) in cases.items():
        with pytest.raises(hv.HurrayArgumentError) as err:
            to_flash_attn_all(snap, page_size=256, out=out)
        assert err.value.field == field, why
        assert all(bool((p == 7.0).all()) for p in pools), f"{why}: nothing is written"
    # Disjoint pages of one buffer are separate caches.
    halves = [(p[: plan.num_blocks], p[plan.num_blocks :]) for p in pools[:3]]
    caches = to_flash_attn_all(snap, page_size=256, out=halves)
    assert all(c.k_cache is pair[0] for c, pair in zip(caches, halves, strict=True))


def test_wrapper_checks_the_arguments_it_passes_to_the_kernel() -> None:
    """cache_leftpad/cache_batch_idx in **kw are refused; window_size/alibi_slopes decide FA2's GQA regrouping."""
    snap = make_snapshot([3, 5], [0, 0], 16, layers=1)
    cache = to_flash_attn(snap, 0, page_size=16, flavor="vllm", reserve=1)
    new = torch.randn(2, 1, 2, 16, dtype=torch.bfloat16)
    few_heads = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    refused: dict[str, Any] = {"cache_leftpad": torch.zeros(2, dtype=torch.int32), "cache_batch_idx": torch.arange(2)}
    for name, value in refused.items():
        with pytest.raises(hv.HurrayArgumentError) as err:
            flash_attn_with_kvcache(few_heads, cache, k=new, v=new, **{name: value})
        assert err.value.field == name
    # 64 heads over 2: regrouped, 32 queries do not fit the 16-token block table...
    many_heads = torch.randn(2, 1, 64, 16, dtype=torch.bfloat16)
    with pytest.raises(hv.HurrayArgumentError) as err:
        flash_attn_with_kvcache(many_heads, cache, k=new, v=new)
    assert err.value.field == "q"
    # ...but a window or ALiBi keeps seqlen_q = 1 (only the device is missing here).
    for kw in ({"window_size": (4, 0)}, {"window_size": (-1, 0)}, {"alibi_slopes": torch.ones(64)}):
        with pytest.raises(FlashAttnUnavailableError):
            flash_attn_with_kvcache(many_heads, cache, k=new, v=new, **kw)
    args = (many_heads, cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.block_table)
    check_flash_attn_args(*args, flavor="vllm", k=new, v=new, window_size=(4, -1))
    check_flash_attn_args(*args, flavor="fa3", k=new, v=new)  # fa3 never regroups
    with pytest.raises(hv.HurrayArgumentError) as err:
        check_flash_attn_args(*args, flavor="vllm", k=new, v=new, window_size=(-1, -1))
    assert err.value.field == "q"
    with pytest.raises(hv.HurrayArgumentError) as err:
        check_flash_attn_args(*args, flavor="vllm", k=new, v=new, window_size=(4,))  # type: ignore[arg-type]
    assert err.value.field == "window_size"


# ── vLLM's fork without flash_attn_with_kvcache: append, then flash_attn_varlen_func ──


def _install_vllm_fork(monkeypatch: pytest.MonkeyPatch, varlen: Callable[..., Any]) -> None:
    """A stand-in for today's ``vllm.vllm_flash_attn``: ``flash_attn_varlen_func`` only."""
    mod = types.ModuleType("vllm.vllm_flash_attn")
    mod.flash_attn_varlen_func = varlen  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", mod)


def _varlen_call() -> tuple[FlashAttnCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A vllm cache with room for 2 new tokens, q of 2 queries (4 heads over 2), and those tokens."""
    snap = make_snapshot([20, 5], [0, 0], 16, layers=1)
    cache = to_flash_attn(snap, 0, flavor="vllm", page_size=16, reserve=2)
    q = torch.randn(2, 2, 4, 16, dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 2, 16, dtype=torch.bfloat16), torch.randn(2, 2, 2, 16, dtype=torch.bfloat16)
    check_flash_attn_args(
        q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.block_table, flavor="vllm", k=k, v=v
    )
    return cache, q, k, v


def _new_tokens_of(cache: FlashAttnCache, pool: torch.Tensor, n: int) -> torch.Tensor:
    """``pool``'s slots for positions ``cache_seqlens[b] .. + n`` of each sequence, ``[batch, n, heads, dim]``."""
    pos = cache.cache_seqlens.long()[:, None] + torch.arange(n)[None, :]
    page = pool.shape[1]
    return pool[cache.block_table.long().gather(1, pos // page), pos % page]


def test_vllm_varlen_fallback_restores_the_cache_when_the_kernel_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.Tensor] = []

    def refusing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        seen.append(k.clone())
        raise RuntimeError("refused by the kernel's host checks")

    _install_vllm_fork(monkeypatch, refusing)
    cache, q, k, v = _varlen_call()
    k_before, v_before = cache.k_cache.clone(), cache.v_cache.clone()
    with pytest.raises(RuntimeError, match="refused by the kernel"):
        kernels._run_vllm(q, cache, k, v, {"softmax_scale": None, "causal": True})
    assert torch.equal(_new_tokens_of(cache, seen[0], 2), k)  # the kernel saw the appended tokens...
    assert torch.equal(cache.k_cache, k_before) and torch.equal(cache.v_cache, v_before)  # ...taken back after

    # A call the kernel accepts keeps them, and attends over cache_seqlens + seqlen_new keys.
    calls: list[dict[str, Any]] = []

    def accepting(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.append(kw)
        return torch.zeros_like(q)

    _install_vllm_fork(monkeypatch, accepting)
    assert kernels._run_vllm(q, cache, k, v, {"causal": True}).shape == q.shape
    assert torch.equal(_new_tokens_of(cache, cache.k_cache, 2), k)
    assert torch.equal(_new_tokens_of(cache, cache.v_cache, 2), v)
    assert calls[0]["seqused_k"].tolist() == [22, 7]


def test_vllm_varlen_fallback_refuses_before_appending(monkeypatch: pytest.MonkeyPatch) -> None:
    """What flash_attn_varlen_func would refuse is refused before k/v are written, without calling it."""

    def varlen(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        max_seqlen_q: int,
        cu_seqlens_q: torch.Tensor,
        max_seqlen_k: int,
        seqused_k: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        block_table: torch.Tensor | None = None,
        return_softmax_lse: bool = False,
        num_splits: int = 0,
        fa_version: int = 2,
    ) -> torch.Tensor:
        raise AssertionError("the kernel must not be called")

    _install_vllm_fork(monkeypatch, varlen)
    cache, q, k, v = _varlen_call()
    k_before = cache.k_cache.clone()
    for kw, field in (({"rotary_cos": torch.zeros(4, 8)}, "rotary_cos"), ({"num_splits": 4}, "num_splits")):
        with pytest.raises(hv.HurrayArgumentError) as err:
            kernels._run_vllm(q, cache, k, v, {"causal": True, **kw})
        assert err.value.field == field
        assert torch.equal(cache.k_cache, k_before)


def test_vllm_varlen_fallback_returns_the_lse_as_flash_attn_with_kvcache(monkeypatch: pytest.MonkeyPatch) -> None:
    """varlen's softmax_lse is [nheads, batch * seqlen_q]; flash_attn_with_kvcache's is [batch, nheads, seqlen_q]."""

    def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
        total_q, nheads, _ = q.shape
        lse = 1000.0 * torch.arange(nheads)[:, None] + torch.arange(total_q)[None, :]  # lse[h, t] = 1000 h + t
        return (q.clone(), lse) if kw.get("return_softmax_lse") else q.clone()

    _install_vllm_fork(monkeypatch, varlen)
    cache, q, k, v = _varlen_call()
    out, lse = kernels._run_vllm(q, cache, k, v, {"causal": True, "return_softmax_lse": True})
    assert torch.equal(out, q)
    batch, seqlen_q, nheads, _ = q.shape
    b, h, s = torch.meshgrid(torch.arange(batch), torch.arange(nheads), torch.arange(seqlen_q), indexing="ij")
    assert torch.equal(lse, (1000.0 * h + b * seqlen_q + s).float())
    assert torch.equal(kernels._run_vllm(q, cache, None, None, {"causal": True}), q)
