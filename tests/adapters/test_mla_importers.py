"""MLA latents into FlashMLA's and FlashInfer's MLA paged layouts, checked with the PyTorch reference.

FlashMLA and FlashInfer need CUDA: here the importers' output goes through
``reference.mla_paged_decode`` (the absorbed MLA decode both kernels compute)
and through a checker that mirrors FlashMLA's argument checks. The real
kernels run in ``test_gpu_kernels_mla.py`` where CUDA is.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import snapshots
from synthetic import DEEPSEEK, latent_snapshot

import hurray_vllm as hv
from hurray_vllm import BlockPagedTensor, KVSnapshot
from hurray_vllm.adapters.flash_mla import FlashMLACache, check_flash_mla_args, to_flash_mla
from hurray_vllm.adapters.flashinfer import to_flashinfer_mla
from hurray_vllm.adapters.reference import mla_paged_decode
from hurray_vllm.wire.descriptor import PerTensorAffine


def dense_mla(q: torch.Tensor, snap: KVSnapshot, seq: int, head_dim_v: int) -> torch.Tensor:
    """The absorbed attention of one sequence over its dense latent: the ground truth."""
    lat = snap[0, "fused"].to_dense(seq)[:, 0].float()
    if snap.kv_scales is not None:
        lat = lat * snap.kv_scales[0][0]
    scores = torch.einsum("shc,nc->shn", q.float(), lat) / math.sqrt(lat.shape[-1])
    return torch.einsum("shn,nv->shv", scores.softmax(-1), lat[:, :head_dim_v])


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("lens", [[130, 70, 1], [64], [200, 200]])
def test_flash_mla_cache_decodes_like_the_dense_latent(lens: list[int], fp8: bool) -> None:
    snap = latent_snapshot(lens, fp8=fp8)
    cache = to_flash_mla(snap, 0)
    assert cache.k_cache.shape[1:] == (64, 1, 576) and cache.k_cache.dtype == torch.bfloat16
    assert cache.cache_seqlens.tolist() == lens and cache.head_dim_v == 512
    q = torch.randn(len(lens), 1, 16, 576, generator=torch.Generator().manual_seed(len(lens))).to(torch.bfloat16)
    check_flash_mla_args(q, cache.k_cache, cache.block_table, cache.cache_seqlens, cache.head_dim_v)
    out = mla_paged_decode(q, cache.k_cache, cache.block_table, cache.cache_seqlens, head_dim_v=512)
    for s in range(len(lens)):
        want = dense_mla(q[s], snap, s, 512)
        torch.testing.assert_close(out[s], want, rtol=2e-2, atol=2e-2)
    # The same tolerance refuses wrong pages: every block-table entry two pages on (one on can land a
    # one-token sequence on the page holding its shared prefix token: the same KV). [64] has no other page.
    if cache.k_cache.shape[0] == 1:
        return
    wrong = ((cache.block_table + 2) % cache.k_cache.shape[0]).to(cache.block_table.dtype)
    bad = mla_paged_decode(q, cache.k_cache, wrong, cache.cache_seqlens, head_dim_v=512)
    for s in range(len(lens)):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(bad[s], dense_mla(q[s], snap, s, 512), rtol=2e-2, atol=2e-2)


def test_flash_mla_keeps_prefix_sharing_and_reserves_private_tails() -> None:
    snap = latent_snapshot([64, 100], page=64)
    cache = to_flash_mla(snap, 0)
    assert cache.block_table[0, 0] == cache.block_table[1, 0]  # the shared prefix page stays shared
    grown = to_flash_mla(snap, 0, reserve=40)
    assert grown.block_table.shape[1] == 3  # 100 + 40 tokens need 3 pages
    assert grown.k_cache.shape[0] > cache.k_cache.shape[0]  # fresh pages for the appends


def test_flashinfer_mla_pools_split_the_latent() -> None:
    snap = latent_snapshot([130, 70, 1])
    mla = to_flashinfer_mla(snap, 0)
    assert mla.ckv_cache.shape[-1] == 512 and mla.kpe_cache.shape[-1] == 64
    assert mla.kv_len_arr.tolist() == [130, 70, 1] and mla.kv_indptr.dtype == torch.int32
    for s in range(3):
        pages = mla.kv_indices[mla.kv_indptr[s] : mla.kv_indptr[s + 1]].long()
        n = int(mla.kv_len_arr[s])
        ckv = mla.ckv_cache[pages].reshape(-1, 512)[:n]
        kpe = mla.kpe_cache[pages].reshape(-1, 64)[:n]
        assert torch.equal(torch.cat([ckv, kpe], -1), snap[0, "fused"].to_dense(s)[:, 0])
    repaged = to_flashinfer_mla(snap, 0, page_size=1)
    assert repaged.page_size == 1 and int(repaged.kv_indptr[-1]) == 130 + 70 + 1
    assert repaged.kv_indices.unique().numel() == 130 + 70 - 16  # the shared prefix, once


@given(snap=snapshots(latent=True), page=st.sampled_from([1, 3, 64]))
def test_any_latent_snapshot_imports_token_for_token(snap: KVSnapshot, page: int) -> None:
    if snap.num_seqs == 0:
        with pytest.raises(hv.HurrayFormatError, match="no sequences"):
            to_flash_mla(snap, 0)
        return
    empty = 0 in snap.seq_lens  # FlashMLA takes no empty sequence; FlashInfer's MLA API does
    for layer in range(snap.num_layers):
        mla = to_flashinfer_mla(snap, layer, page_size=page)
        if empty:
            with pytest.raises(hv.HurrayFormatError) as err:
                to_flash_mla(snap, layer, page_size=page)
            assert err.value.field == "seq_lens"
        else:
            cache = to_flash_mla(snap, layer, page_size=page)
        t = snap[layer, "fused"]
        for s in range(snap.num_seqs):
            n = snap.seq_lens[s]
            want = t.to_dense(s)[:, 0]
            if snap.kv_scales is not None:
                want = want.float() * snap.kv_scales[layer][0]
            want = want.to(mla.ckv_cache.dtype)
            pages = mla.kv_indices[mla.kv_indptr[s] : mla.kv_indptr[s + 1]].long()
            fused = torch.cat([mla.ckv_cache[pages], mla.kpe_cache[pages]], -1).reshape(-1, t.head_dim)[:n]
            assert torch.equal(fused, want)
            if not empty:
                row = cache.block_table[s, : -(-n // page)].long()
                assert torch.equal(cache.k_cache[row].reshape(-1, t.head_dim)[:n], want)


def test_key_value_snapshots_are_refused_by_the_mla_importers() -> None:
    from synthetic import make_snapshot

    kv = make_snapshot([5], [0], 4)
    for importer in (to_flash_mla, to_flashinfer_mla):
        with pytest.raises(hv.HurrayFormatError, match="kv_role"):
            importer(kv, 0)


def _i32(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def _good() -> tuple[torch.Tensor, FlashMLACache]:
    cache = to_flash_mla(latent_snapshot([100, 30]), 0)
    return torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16), cache


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("q", lambda q, c: (q.float(), c.k_cache, c.block_table, c.cache_seqlens, 512)),
        ("k_cache", lambda q, c: (q, c.k_cache.half(), c.block_table, c.cache_seqlens, 512)),
        ("k_cache", lambda q, c: (q, c.k_cache.reshape(-1, 32, 1, 576), c.block_table, c.cache_seqlens, 512)),
        ("k_cache", lambda q, c: (q[..., :512], c.k_cache, c.block_table, c.cache_seqlens, 512)),
        ("q", lambda q, c: (q[..., :500], c.k_cache[..., :500], c.block_table, c.cache_seqlens, 512)),
        ("q", lambda q, c: (q[:0], c.k_cache, c.block_table[:0], c.cache_seqlens[:0], 512)),
        ("k_cache", lambda q, c: (q, c.k_cache[:, :, :0], c.block_table, c.cache_seqlens, 512)),
        ("cache_seqlens", lambda q, c: (q, c.k_cache, c.block_table, c.cache_seqlens.repeat_interleave(2)[::2], 512)),
        ("head_dim_v", lambda q, c: (q, c.k_cache, c.block_table, c.cache_seqlens, 576)),
        ("block_table", lambda q, c: (q, c.k_cache, c.block_table.long(), c.cache_seqlens, 512)),
        ("block_table", lambda q, c: (q, c.k_cache, c.block_table + 100, c.cache_seqlens, 512)),
        ("block_table", lambda q, c: (q, c.k_cache, c.block_table, c.cache_seqlens + 64, 512)),
        ("cache_seqlens", lambda q, c: (q, c.k_cache, c.block_table, c.cache_seqlens[:1], 512)),
        ("cache_seqlens", lambda q, c: (q, c.k_cache, c.block_table, c.cache_seqlens * _i32([1, 0]), 512)),
        ("q", lambda q, c: (q[:, :, :15], c.k_cache.expand(-1, -1, 2, -1), c.block_table, c.cache_seqlens, 512)),
    ],
)
def test_flash_mla_checker_names_the_argument(field: str, change) -> None:  # type: ignore[no-untyped-def]
    q, cache = _good()
    with pytest.raises(hv.HurrayArgumentError) as err:
        check_flash_mla_args(*change(q, cache))
    assert err.value.field == field


def test_mla_reference_refuses_a_block_table_that_does_not_cover_the_lengths() -> None:
    from hurray_vllm.adapters.reference import mla_paged_decode

    kv, q = torch.randn(4, 4, 1, 16), torch.randn(1, 1, 2, 16)
    for table, lens in (([[0]], [10]), ([[0, 9, 1]], [10]), ([[0, -1, 2]], [10]), ([[0, 1, 2]], [-3])):
        with pytest.raises(hv.HurrayArgumentError):
            mla_paged_decode(q, kv, torch.tensor(table), torch.tensor(lens), head_dim_v=8)


def test_flash_mla_checker_takes_a_latent_without_its_rope_part() -> None:
    q, cache = _good()  # FlashMLA's dense decode takes head_size_k 512 as well as 576
    check_flash_mla_args(
        q[..., :512], cache.k_cache[..., :512].contiguous(), cache.block_table, cache.cache_seqlens, 512
    )


def fused(table: list[int], ptr: list[int], lens: list[int], pages: int = 3, page: int = 16) -> KVSnapshot:
    """One layer of a latent pool of ``pages`` pages over the given (possibly broken) block structure."""
    pool = torch.randn(pages, page, 1, DEEPSEEK.head_dim).to(torch.bfloat16)
    bt, sp, sl = (torch.tensor(x, dtype=torch.int64) for x in (table, ptr, lens))
    return KVSnapshot.from_layers([(BlockPagedTensor(pool, bt, sp, sl, "fused", 0),)], latent=DEEPSEEK)


@pytest.mark.parametrize(
    ("why", "snap", "field"),
    [
        ("a page id past the pool", fused([0, 1, 200], [0, 3], [40]), "block_table"),
        ("offsets past the table", fused([0, 1], [0, 1, 5], [10, 10]), "seq_ptr"),
        ("a length too many", fused([0, 1], [0, 1, 2], [10, 10, 3]), "seq_ptr"),
        ("a negative length", fused([0, 1], [0, 1, 2], [10, -10]), "seq_lens"),
    ],
)
def test_flash_mla_refuses_an_inconsistent_structure(why: str, snap: KVSnapshot, field: str) -> None:
    for page in (16, 64):  # as it is, and repaged
        with pytest.raises(hv.HurrayFormatError) as err:
            to_flash_mla(snap, 0, page_size=page)
        assert err.value.field == field, (why, page)


@pytest.mark.parametrize(
    ("why", "snap", "field"),
    [
        ("a page id past the pool", fused([0, 1, 200], [0, 3], [40]), "block_table"),
        ("a page more than the tokens need", fused([0, 1, 2], [0, 3], [20]), "seq_lens.pages"),
        ("a page fewer", fused([0], [0, 1], [20]), "seq_lens.pages"),
        ("offsets past the table", fused([0, 1], [0, 1, 5], [10, 10]), "seq_ptr"),
        ("a negative length", fused([0, 1], [0, 1, 2], [10, -10]), "seq_lens"),
    ],
)
def test_flashinfer_mla_refuses_what_its_page_lists_cannot_describe(why: str, snap: KVSnapshot, field: str) -> None:
    for page in (None, 64):  # the arrays as they are (FlashInfer reads them raw), and repaged
        with pytest.raises(hv.HurrayFormatError) as err:
            to_flashinfer_mla(snap, 0, page_size=page)
        assert err.value.field == field, (why, page)


@pytest.mark.parametrize("page", [0, 64.0, "64", True])
def test_a_page_size_that_is_no_positive_integer_is_refused_by_both_mla_importers(page: object) -> None:
    """ "64" failed with a bare TypeError in the comparison; 64.0 was taken as a float page count."""
    snap = latent_snapshot([40])
    for importer in (to_flash_mla, to_flashinfer_mla):
        with pytest.raises(hv.HurrayArgumentError) as err:
            importer(snap, 0, page_size=page)  # type: ignore[arg-type]
        assert err.value.field == "page_size", importer


def test_flash_mla_refuses_empty_sequences_naming_the_way_out() -> None:
    """FlashMLA does not support cache_seqlens 0 (deepseek-ai/FlashMLA#11): the importer and checker say so."""
    one_empty = fused([0, 1], [0, 2, 2], [20, 0])
    for snap in (fused([], [0, 0], [0], pages=0, page=64), one_empty):
        for reserve in (0, 10):
            with pytest.raises(hv.HurrayFormatError, match="drop empty sequences") as err:
                to_flash_mla(snap, 0, reserve=reserve)
            assert err.value.field == "seq_lens"
    q, cache = _good()
    with pytest.raises(hv.HurrayArgumentError, match="drop empty sequences") as arg:
        check_flash_mla_args(q, cache.k_cache, cache.block_table, _i32([0, 30]), 512)
    assert arg.value.field == "cache_seqlens"
    # Without them the batch imports; FlashInfer's MLA API takes them (an empty page list, kv_len 0).
    assert to_flash_mla(one_empty.select([0]), 0).cache_seqlens.tolist() == [20]
    assert to_flashinfer_mla(one_empty, 0).kv_len_arr.tolist() == [20, 0]


def quantized(dtype: torch.dtype, quantization: PerTensorAffine | None) -> KVSnapshot:
    """One latent layer of 100s stored as ``dtype`` (with ``quantization`` 0.01: 1.0 each, were it applied)."""
    snap = fused([0, 1], [0, 2], [20])
    t = snap[0, "fused"]
    pool = torch.full(t.page_pool.shape, 100).to(dtype)
    return replace(snap, fused=(replace(t, page_pool=pool, quantization=quantization),))


@pytest.mark.parametrize(
    ("why", "snap", "field"),
    [
        ("int8 with a per-tensor scale", quantized(torch.int8, PerTensorAffine(0.01)), "quantization"),
        ("bfloat16 with a per-tensor scale", quantized(torch.bfloat16, PerTensorAffine(0.01)), "quantization"),
        ("int8 without one", quantized(torch.int8, None), "dtype"),
    ],
)
def test_mla_importers_refuse_latents_whose_stored_numbers_are_not_values(
    why: str, snap: KVSnapshot, field: str
) -> None:
    # Cast as they are, int8 100 with scale 0.01 would become 100.0, not 1.0: refused as the K/V importers do.
    for importer in (to_flash_mla, to_flashinfer_mla):
        for dtype in (None, torch.bfloat16):
            with pytest.raises(hv.HurrayFormatError) as err:
                importer(snap, 0, dtype=dtype)
            assert err.value.field == field, (why, importer, dtype)


def test_mla_importers_refuse_float8_caches_they_could_not_scale() -> None:
    big = quantized(torch.bfloat16, None)
    fp8 = latent_snapshot([40], fp8=True)  # scale 2.0, which an MLA cache has nowhere to keep
    cases = [
        (big, torch.float8_e4m3fn, "calibrated scales"),  # cast without a scale: 448 at most
        (fp8, torch.float8_e4m3fn, "carries no scale"),  # dequantized, then re-cast without the scale
        (fp8, torch.float8_e5m2, "re-encode"),
        (big, torch.int8, "floating-point"),
    ]
    for importer in (to_flash_mla, to_flashinfer_mla):
        for snap, dtype, match in cases:
            with pytest.raises(hv.HurrayArgumentError, match=match) as err:
                importer(snap, 0, dtype=dtype)
            assert err.value.field == "dtype", (importer, dtype)
    # Dequantizing into bfloat16 (the default) or float16 is what they do.
    want = fp8[0, "fused"].to_dense(0)[:, 0].float() * 2.0
    for dtype in (None, torch.float16):
        cache = to_flash_mla(fp8, 0, dtype=dtype)
        got = cache.k_cache[cache.block_table[0].long()].reshape(-1, 576)[:40]
        assert torch.equal(got, want.to(dtype or torch.bfloat16))


def test_mla_causal_reference_equals_a_hand_masked_dense_decode() -> None:
    """FlashMLA's causal flag (seqlen_q > 1): query i of s attends tokens j <= i + n - s, bottom-right aligned."""
    lens = [130, 70, 3]
    snap = latent_snapshot(lens)
    cache = to_flash_mla(snap, 0)
    args = (cache.k_cache, cache.block_table, cache.cache_seqlens)
    s_q, heads = 5, 2
    q = torch.randn(len(lens), s_q, heads, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    got = mla_paged_decode(q, *args, head_dim_v=512, causal=True)
    for b, n in enumerate(lens):
        lat = snap[0, "fused"].to_dense(b)[:, 0].float()
        for i in range(s_q):
            last = i + n - s_q  # the last token query i sees
            if last < 0:  # more queries than tokens: this one sees none, and gives zeros
                assert bool((got[b, i] == 0).all())
                continue
            seen = lat[: last + 1]
            scores = q[b, i].float() @ seen.T / math.sqrt(576)  # [heads, last + 1]
            torch.testing.assert_close(got[b, i], scores.softmax(-1) @ seen[:, :512], rtol=1e-5, atol=1e-5)
    # Without causal every query sees all n tokens; the last query sees them all either way.
    full = mla_paged_decode(q, *args, head_dim_v=512)
    assert not torch.allclose(full[:, :-1], got[:, :-1])
    torch.testing.assert_close(full[:, -1], got[:, -1])
    one = q[:, :1]
    assert torch.equal(
        mla_paged_decode(one, *args, head_dim_v=512, causal=True), mla_paged_decode(one, *args, head_dim_v=512)
    )


def test_mla_importers_refuse_short_kv_scales() -> None:
    t = latent_snapshot([40, 10], fp8=True)[0, "fused"]
    snap = KVSnapshot.from_layers([(t,), (t,)], latent=DEEPSEEK, kv_scales=((2.0, 2.0),))
    for importer in (to_flash_mla, to_flashinfer_mla):
        with pytest.raises(hv.HurrayFormatError) as err:
            importer(snap, 1)
        assert err.value.field == "snapshot.kv_scales"


def test_flash_mla_reserve_past_int32_is_the_callers_error() -> None:
    for reserve in (2**31, 2**31 - 10):
        with pytest.raises(hv.HurrayArgumentError) as err:
            to_flash_mla(latent_snapshot([40]), 0, reserve=reserve)
        assert err.value.field == "reserve" and not isinstance(err.value, hv.HurrayFormatError)


def test_mla_reference_names_the_argument_that_does_not_fit() -> None:
    """A malformed q was reported as kv_cache, and cache_seqlens of the wrong shape as block_table."""
    kv, q, table, lens = torch.randn(4, 4, 1, 16), torch.randn(1, 1, 2, 16), torch.tensor([[0, 1]]), torch.tensor([5])
    for field, args in (
        ("q", (q[0], kv, table, lens)),
        ("q", (q[..., :8], kv, table, lens)),
        ("kv_cache", (q, kv[0], table, lens)),
        ("kv_cache", (q, kv.expand(-1, -1, 2, -1), table, lens)),
        ("block_table", (q, kv, table[0], lens)),
        ("block_table", (q, kv, table.repeat(2, 1), lens)),
        ("cache_seqlens", (q, kv, table, lens.repeat(2))),
        ("cache_seqlens", (q, kv, table, lens[None])),
    ):
        with pytest.raises(hv.HurrayArgumentError) as err:
            mla_paged_decode(*args, head_dim_v=8)
        assert err.value.field == field, args


def test_flash_mla_page_size_too_large_for_the_batch_is_the_callers_error() -> None:
    """It was a data error on seq_lens (HurrayFormatError), though the docstring promised an argument error."""
    with pytest.raises(hv.HurrayArgumentError) as err:
        to_flash_mla(latent_snapshot([40]), 0, page_size=1 << 29)
    assert err.value.field == "page_size"


def test_flash_mla_cache_is_the_snapshots_pool_when_nothing_changes() -> None:
    """As documented: reserve=0, no repaging or conversion: k_cache is the pool (writes change the snapshot)."""
    snap = latent_snapshot([40, 64], page=64)
    pool = snap[0, "fused"].page_pool
    assert to_flash_mla(snap, 0).k_cache.data_ptr() == pool.data_ptr()
    for kwargs in ({"reserve": 1}, {"dtype": torch.float16}, {"page_size": 32}):
        assert to_flash_mla(snap, 0, **kwargs).k_cache.data_ptr() != pool.data_ptr(), kwargs  # type: ignore[arg-type]
    # The dtype rule: float32 stays float32 (the reference takes it, FlashMLA's kernel does not) unless dtype= says.
    t = snap[0, "fused"]
    wide = KVSnapshot.from_layers([(replace(t, page_pool=t.page_pool.float()),)], latent=DEEPSEEK)
    assert to_flash_mla(wide, 0).k_cache.dtype == torch.float32
    assert to_flash_mla(wide, 0, dtype=torch.bfloat16).k_cache.dtype == torch.bfloat16
