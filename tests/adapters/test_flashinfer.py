"""The FlashInfer importer, its argument checker and its reference decode, on the CPU.

Ground truth is always the snapshot itself: each sequence's K/V from
``BlockPagedTensor.to_dense`` and, for attention, a dense float32 softmax
written out here (GQA by ``repeat_interleave`` of the KV heads).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import snapshots
from synthetic import make_flashinfer_snapshot as make_snapshot

from hurray_vllm import HurrayArgumentError, HurrayFormatError, ImportArgumentError, KVSnapshot
from hurray_vllm.adapters.flashinfer import (
    FlashInferCache,
    check_flashinfer_args,
    plan_flashinfer,
    plan_flashinfer_repage,
    reference_decode,
    to_flashinfer,
    to_flashinfer_all,
)
from hurray_vllm.kv.repage import plan_repage
from hurray_vllm.wire.descriptor import PerTensorAffine

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
LAYOUTS = ["NHD", "HND"]


# ── ground truth ─────────────────────────────────────────────────────────────


def dense_kv(snap: KVSnapshot, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``seq``'s real K and V values ``[n, H, D]`` (float32 for float8 sources)."""
    k, v = snap.keys[layer].to_dense(seq), snap.values[layer].to_dense(seq)
    if k.dtype in FP8:
        ks, vs = snap.kv_scales[layer] if snap.kv_scales else (1.0, 1.0)
        return k.float() * ks, v.float() * vs
    return k, v


def dense_attention(q: torch.Tensor, snap: KVSnapshot, layer: int) -> torch.Tensor:
    """float32 ``[batch, Hq, D]``: softmax(q K^T / sqrt(D)) V per sequence, 0 for empty ones."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for s in range(snap.num_seqs):
        k, v = (x.float() for x in dense_kv(snap, layer, s))
        if k.shape[0] == 0:
            continue
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,nhd->hn", q[s].float(), k) / math.sqrt(q.shape[-1])
        out[s] = torch.einsum("hn,nhd->hd", torch.softmax(logits, dim=-1), v)
    return out


def rebuild(cache: FlashInferCache, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``seq``'s K and V ``[n, H, D]`` read back from the CSR arrays alone."""
    lo, hi = int(cache.paged_kv_indptr[seq]), int(cache.paged_kv_indptr[seq + 1])
    last = int(cache.paged_kv_last_page_len[seq])
    n = 0 if hi == lo else (hi - lo - 1) * cache.page_size + last
    pages = cache.paged_kv_indices[lo:hi].long()
    out = []
    for pool in (cache.k_cache, cache.v_cache):
        if cache.kv_layout == "HND":
            pool = pool.transpose(1, 2)
        out.append(pool[pages].reshape(-1, cache.num_kv_heads, cache.head_dim)[:n])
    return out[0], out[1]


# ── the import: layouts, page sizes, repaging ────────────────────────────────


@settings(max_examples=20)
@given(
    snap=snapshots(latent=False, states=False),
    kv_layout=st.sampled_from(LAYOUTS),
    combined=st.booleans(),
    page_size=st.sampled_from([None, 1, 3, 16]),
)
def test_rebuilt_sequences_equal_to_dense(
    snap: KVSnapshot, kv_layout: str, combined: bool, page_size: int | None
) -> None:
    plan = plan_flashinfer(snap, page_size) if page_size else None
    for layer in range(snap.num_layers):
        cache = to_flashinfer(snap, layer, page_size=page_size, kv_layout=kv_layout, combined=combined, plan=plan)
        cache.check(strict_dtypes=False)
        assert cache.combined == combined and cache.layer == layer
        assert cache.page_size == (page_size or snap.page_size)
        assert cache.seq_lens.tolist() == snap.seq_lens
        assert cache.k_cache.is_contiguous() or combined
        for t in (cache.paged_kv_indptr, cache.paged_kv_indices, cache.paged_kv_last_page_len):
            assert t.dtype == torch.int32
        lens = torch.tensor(snap.seq_lens, dtype=torch.int32)
        last = cache.paged_kv_last_page_len
        assert bool(((last >= 1) & (last <= cache.page_size))[lens > 0].all())
        assert bool((last[lens == 0] == 0).all())
        for s in range(snap.num_seqs):
            k, v = rebuild(cache, s)
            dk, dv = dense_kv(snap, layer, s)
            assert torch.equal(k, dk) and torch.equal(v, dv)


@settings(max_examples=20)
@given(snap=snapshots(latent=False, states=False), page_size=st.sampled_from([2, 5]))
def test_shared_plan_equals_per_layer_plan(snap: KVSnapshot, page_size: int) -> None:
    plan = plan_flashinfer(snap, page_size)
    for layer in range(snap.num_layers):
        a = to_flashinfer(snap, layer, page_size=page_size, plan=plan)
        b = to_flashinfer(snap, layer, page_size=page_size)
        assert torch.equal(a.paged_kv_indices, b.paged_kv_indices)
        assert torch.equal(a.paged_kv_indptr, b.paged_kv_indptr)
        assert torch.equal(a.k_cache.view(torch.uint8), b.k_cache.view(torch.uint8))
        assert torch.equal(a.v_cache.view(torch.uint8), b.v_cache.view(torch.uint8))


def test_repaging_keeps_a_shared_prefix_shared() -> None:
    snap = make_snapshot([12, 9, 5], page_size=4)  # sequences 1 and 2 reuse sequence 0's page 0
    cache = to_flashinfer(snap, 0, page_size=2)
    first = [int(cache.paged_kv_indices[int(cache.paged_kv_indptr[s])]) for s in range(3)]
    assert first[0] == first[1] == first[2]
    assert cache.paged_kv_last_page_len.tolist() == [2, 1, 1]


def test_same_page_size_is_zero_copy_for_nhd_tuples() -> None:
    snap = make_snapshot([7, 3])
    cache = to_flashinfer(snap, 1, page_size=snap.page_size)
    assert cache.k_cache.data_ptr() == snap.keys[1].page_pool.data_ptr()
    assert cache.v_cache.data_ptr() == snap.values[1].page_pool.data_ptr()


@pytest.mark.parametrize("kv_layout", LAYOUTS)
def test_combined_tensor_layout(kv_layout: str) -> None:
    snap = make_snapshot([7, 3], heads=3, dim=8, page_size=4)
    cache = to_flashinfer(snap, 0, kv_layout=kv_layout, combined=True)
    assert isinstance(cache.paged_kv_cache, torch.Tensor)
    pages = snap.keys[0].num_pages
    expected = [pages, 2, 4, 3, 8] if kv_layout == "NHD" else [pages, 2, 3, 4, 8]
    assert list(cache.paged_kv_cache.shape) == expected
    assert cache.paged_kv_cache.is_contiguous()
    assert (cache.num_kv_heads, cache.head_dim, cache.page_size, cache.num_pages) == (3, 8, 4, pages)


def test_empty_sequences_get_no_pages_and_last_page_len_zero() -> None:
    snap = make_snapshot([5, 0, 8, 0])
    cache = to_flashinfer(snap, 0)
    assert cache.paged_kv_indptr.tolist() == [0, 2, 2, 4, 4]
    assert cache.paged_kv_last_page_len.tolist() == [1, 0, 4, 0]
    cache.check()
    q = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    out = reference_decode(q, cache)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[3], torch.zeros_like(out[3]))
    torch.testing.assert_close(out.float(), dense_attention(q, snap, 0), atol=2e-3, rtol=2e-3)
    _refuses_wrong_pages(q, cache, dense_attention(q, snap, 0), seqs=[0, 2], atol=2e-3)


def test_empty_batch() -> None:
    snap = make_snapshot([])
    cache = to_flashinfer(snap, 0, page_size=3)
    assert cache.batch_size == 0 and cache.paged_kv_indptr.tolist() == [0]
    assert reference_decode(torch.empty(0, 2, 8, dtype=torch.float16), cache).shape == (0, 2, 8)


def test_dtype_and_device_on_request() -> None:
    snap = make_snapshot([6, 2], dtype=torch.float32)
    cache = to_flashinfer(snap, 0, dtype=torch.bfloat16, device="cpu", kv_layout="HND")
    assert cache.dtype == torch.bfloat16 and cache.device == torch.device("cpu")
    cache.check(torch.randn(2, 4, 8, dtype=torch.bfloat16))
    k, _ = rebuild(cache, 0)
    assert torch.equal(k, snap.keys[0].to_dense(0).to(torch.bfloat16))


# ── reference decode ─────────────────────────────────────────────────────────


@settings(max_examples=20)
@given(
    snap=snapshots(latent=False, states=False),
    kv_layout=st.sampled_from(LAYOUTS),
    combined=st.booleans(),
    page_size=st.sampled_from([None, 1, 3, 8]),
    group=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_reference_decode_equals_dense_attention(
    snap: KVSnapshot, kv_layout: str, combined: bool, page_size: int | None, group: int, seed: int
) -> None:
    heads, dim = snap.keys[0].num_heads, snap.keys[0].head_dim
    q = torch.randn(snap.num_seqs, heads * group, dim, generator=torch.Generator().manual_seed(seed))
    for layer in range(snap.num_layers):
        cache = to_flashinfer(snap, layer, page_size=page_size, kv_layout=kv_layout, combined=combined)
        out = reference_decode(q, cache)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out, dense_attention(q, snap, layer), atol=1e-4, rtol=1e-4)


def test_reference_decode_fp16_query_and_options() -> None:
    snap = make_snapshot([9, 4, 1], heads=2, dim=16)
    cache = to_flashinfer(snap, 1, kv_layout="HND")
    q = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    out = reference_decode(q, cache)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), dense_attention(q, snap, 1), atol=2e-3, rtol=2e-3)
    _refuses_wrong_pages(q, cache, dense_attention(q, snap, 1), seqs=[0, 1, 2], atol=2e-3)
    assert reference_decode(q, cache, out_dtype=torch.float32).dtype == torch.float32
    # sm_scale and soft capping change the result; a huge cap changes nothing.
    assert not torch.allclose(reference_decode(q, cache, sm_scale=0.01).float(), out.float())
    torch.testing.assert_close(reference_decode(q, cache, logits_soft_cap=1e6), out)
    capped = reference_decode(q, cache, logits_soft_cap=0.5)
    assert not torch.allclose(capped.float(), out.float(), atol=1e-3)


def _refuses_wrong_pages(q: torch.Tensor, cache: Any, want: torch.Tensor, *, seqs: list[int], atol: float) -> None:
    """The tolerance a test accepted ``cache`` with refuses it with every page id one page on (wrong KV)."""
    wrong = replace(cache, paged_kv_indices=((cache.paged_kv_indices + 1) % cache.num_pages).to(torch.int32))
    bad = reference_decode(q, wrong).float()
    for s in seqs:
        with pytest.raises(AssertionError):
            torch.testing.assert_close(bad[s], want[s], atol=atol, rtol=atol)


# ── float8 ───────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_dequantized_with_the_layer_scales(fp8: torch.dtype) -> None:
    scales = ((0.5, 0.25), (2.0, 3.0))
    snap = make_snapshot([10, 3], dtype=fp8, kv_scales=scales)
    for layer, (ks, vs) in enumerate(scales):
        cache = to_flashinfer(snap, layer)
        assert cache.dtype == torch.float32 and cache.k_scale is None and cache.run_kwargs() == {}
        assert torch.equal(cache.k_cache, snap.keys[layer].page_pool.float() * ks)
        assert torch.equal(cache.v_cache, snap.values[layer].page_pool.float() * vs)
        half = to_flashinfer(snap, layer, dtype=torch.float16, page_size=3)
        assert half.dtype == torch.float16
        k, v = rebuild(half, 0)
        dk, dv = dense_kv(snap, layer, 0)
        assert torch.equal(k, dk.to(torch.float16)) and torch.equal(v, dv.to(torch.float16))


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_passthrough_reports_the_scales(fp8: torch.dtype) -> None:
    snap = make_snapshot([10, 3], dtype=fp8, kv_scales=((0.5, 0.25), (2.0, 3.0)))
    cache = to_flashinfer(snap, 1, dtype=fp8, kv_layout="HND", combined=True)
    assert cache.dtype == fp8 and (cache.k_scale, cache.v_scale) == (2.0, 3.0)
    assert cache.run_kwargs() == {"k_scale": 2.0, "v_scale": 3.0}
    assert cache.plan_dtypes(torch.bfloat16) == {"q_data_type": torch.bfloat16, "kv_data_type": fp8}
    with pytest.raises(HurrayArgumentError) as exc:
        cache.plan_dtypes()
    assert exc.value.field == "q_data_type"
    k, _ = rebuild(cache, 0)
    assert torch.equal(k.view(torch.uint8), snap.keys[1].to_dense(0).view(torch.uint8))
    q = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    cache.check(q)
    # The reference applies the scales FlashInfer's run() would get.
    torch.testing.assert_close(reference_decode(q, cache).float(), dense_attention(q, snap, 1), atol=2e-2, rtol=2e-2)
    _refuses_wrong_pages(q, cache, dense_attention(q, snap, 1), seqs=[0, 1], atol=2e-2)
    unscaled = reference_decode(q, cache, k_scale=1.0, v_scale=1.0).float()
    assert not torch.allclose(unscaled, dense_attention(q, snap, 1), atol=2e-2)


def test_fp8_without_scales_is_unscaled() -> None:
    snap = make_snapshot([5], dtype=torch.float8_e4m3fn)
    assert torch.equal(to_flashinfer(snap, 0).k_cache, snap.keys[0].page_pool.float())
    assert to_flashinfer(snap, 0, dtype=torch.float8_e4m3fn).run_kwargs() == {"k_scale": 1.0, "v_scale": 1.0}


def test_fp8_conversions_that_are_refused() -> None:
    fp8 = make_snapshot([5], dtype=torch.float8_e4m3fn, kv_scales=((1.0, 1.0), (1.0, 1.0)))
    with pytest.raises(HurrayFormatError, match="re-encode"):
        to_flashinfer(fp8, 0, dtype=torch.float8_e5m2)
    with pytest.raises(HurrayFormatError, match="calibrated scales"):
        to_flashinfer(make_snapshot([5]), 0, dtype=torch.float8_e4m3fn)
    with pytest.raises(HurrayFormatError, match="floating-point"):
        to_flashinfer(make_snapshot([5]), 0, dtype=torch.int8)
    with pytest.raises(HurrayFormatError) as exc:
        to_flashinfer(replace(fp8, kv_scales=((1.0, 1.0),)), 0)
    assert exc.value.field == "snapshot.kv_scales"


# ── importer errors ──────────────────────────────────────────────────────────


def test_importer_rejects_bad_arguments() -> None:
    snap = make_snapshot([7, 3])
    cases: list[tuple[str, Callable[[], object]]] = [
        ("kv_layout", lambda: to_flashinfer(snap, 0, kv_layout="NDH")),
        ("layer", lambda: to_flashinfer(snap, 2)),
        ("layer", lambda: to_flashinfer(snap, -1)),
        ("page_size", lambda: to_flashinfer(snap, 0, page_size=0)),
        ("plan", lambda: to_flashinfer(snap, 0, page_size=8, plan=plan_flashinfer(snap, 2))),
        ("plan", lambda: to_flashinfer(snap, 0, plan=plan_flashinfer(make_snapshot([7, 4]), 2))),
        ("plan", lambda: to_flashinfer(snap, 0, plan=plan_flashinfer(make_snapshot([7]), 2))),
    ]
    for field, call in cases:
        expected = HurrayArgumentError if field in {"kv_layout", "page_size"} else HurrayFormatError
        with pytest.raises(expected) as exc:
            call()
        assert exc.value.field == field, (field, exc.value)


@pytest.mark.parametrize("into", [False, True])
def test_a_plan_for_another_block_table_or_page_size_is_refused(into: bool) -> None:
    snap = make_snapshot([7, 3], shuffle=True, seed=1)
    same_lens = make_snapshot([7, 3], shuffle=True, seed=2)  # other page ids
    bigger_pages = make_snapshot([7, 3], page_size=8)
    assert not torch.equal(snap.keys[0].block_table, same_lens.keys[0].block_table)
    for other in (same_lens, bigger_pages):
        plan = plan_flashinfer(other, 2)
        assert plan is not None
        out = tuple(torch.zeros(plan.num_pages, 2, 2, 8, dtype=torch.float16) for _ in range(2))
        with pytest.raises(HurrayArgumentError) as exc:  # with out=, nothing after this check would catch it
            to_flashinfer(snap, 0, plan=plan, out=out if into else None)
        assert exc.value.field == "plan"


def restructured(snap: KVSnapshot, **changes: Any) -> KVSnapshot:
    """``snap`` with every layer's key and value changed alike (still one block structure)."""
    return replace(
        snap,
        keys=tuple(replace(t, **changes) for t in snap.keys),
        values=tuple(replace(t, **changes) for t in snap.values),
    )


def test_importer_rejects_snapshots_flashinfer_cannot_describe() -> None:
    snap = make_snapshot([7, 3])
    k = snap.keys[0]
    bad_id = replace(k, block_table=torch.tensor([0, 1, 99]))
    for field, bad in [
        ("seq_lens", restructured(snap, seq_lens=None)),
        ("seq_lens.pages", restructured(snap, seq_lens=torch.tensor([4, 3]))),  # 4 tokens but 2 pages
        ("block_table", restructured(snap, block_table=bad_id.block_table)),
        ("snapshot.structure", replace(snap, keys=(bad_id, *snap.keys[1:]))),
        ("snapshot.structure", replace(snap, keys=(replace(k, seq_lens=None), *snap.keys[1:]))),
    ]:
        with pytest.raises(HurrayFormatError) as exc:
            to_flashinfer(bad, 0)
        assert exc.value.field == field, (field, exc.value)
    ints = replace(
        snap,
        keys=tuple(replace(t, page_pool=t.page_pool.to(torch.int8)) for t in snap.keys),
        values=tuple(replace(t, page_pool=t.page_pool.to(torch.int8)) for t in snap.values),
    )
    with pytest.raises(HurrayFormatError) as exc:
        to_flashinfer(ints, 0)
    assert exc.value.field == "dtype"
    both_bad = replace(snap, keys=(bad_id,), values=(replace(snap.values[0], block_table=bad_id.block_table),))
    with pytest.raises(HurrayFormatError) as exc:
        to_flashinfer(both_bad, 0)
    assert exc.value.field == "block_table"
    with pytest.raises(HurrayFormatError) as exc:
        plan_flashinfer(replace(snap, keys=(), values=()), 2)
    assert exc.value.field == "snapshot.layers"


# ── the argument checker ─────────────────────────────────────────────────────


def _good() -> tuple[FlashInferCache, torch.Tensor]:
    cache = to_flashinfer(make_snapshot([7, 3, 0, 4], page_size=4), 0)
    return cache, torch.randn(4, 4, 8, dtype=torch.float16)


def _i32(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


Args = dict[str, Any]

# Each case: (field the error must name, a change to the good arguments).
BAD: list[tuple[str, str, Callable[[Args], None]]] = [
    ("kv_layout", "unknown layout", lambda a: a.update(kv_layout="NHC")),
    ("paged_kv_indptr", "int64 indptr", lambda a: a.update(paged_kv_indptr=a["paged_kv_indptr"].long())),
    ("paged_kv_indices", "int64 indices", lambda a: a.update(paged_kv_indices=a["paged_kv_indices"].long())),
    (
        "paged_kv_last_page_len",
        "int64 last_page_len",
        lambda a: a.update(paged_kv_last_page_len=a["paged_kv_last_page_len"].long()),
    ),
    ("paged_kv_indptr", "2-D indptr", lambda a: a.update(paged_kv_indptr=_i32([0, 2, 3, 3, 4])[None])),
    ("paged_kv_indptr", "list indptr", lambda a: a.update(paged_kv_indptr=[0, 2, 3, 3, 4])),
    ("paged_kv_indptr", "empty indptr", lambda a: a.update(paged_kv_indptr=_i32([]))),
    ("paged_kv_indptr", "not starting at 0", lambda a: a.update(paged_kv_indptr=_i32([1, 2, 3, 3, 4]))),
    ("paged_kv_indptr", "decreasing", lambda a: a.update(paged_kv_indptr=_i32([0, 3, 2, 3, 4]))),
    ("paged_kv_indptr", "end != len(indices)", lambda a: a.update(paged_kv_indptr=_i32([0, 2, 3, 3, 3]))),
    ("paged_kv_indices", "page id >= num_pages", lambda a: a.update(paged_kv_indices=_i32([0, 1, 2, 99]))),
    ("paged_kv_indices", "negative page id", lambda a: a.update(paged_kv_indices=_i32([0, -1, 2, 3]))),
    ("paged_kv_last_page_len", "wrong length", lambda a: a.update(paged_kv_last_page_len=_i32([3, 3, 0]))),
    ("paged_kv_last_page_len", "0 with pages", lambda a: a.update(paged_kv_last_page_len=_i32([0, 3, 0, 4]))),
    ("paged_kv_last_page_len", "> page_size", lambda a: a.update(paged_kv_last_page_len=_i32([3, 5, 0, 4]))),
    ("paged_kv_last_page_len", "nonzero without pages", lambda a: a.update(paged_kv_last_page_len=_i32([3, 3, 1, 4]))),
    ("paged_kv_cache", "3-D pages", lambda a: a.update(paged_kv_cache=tuple(t[0] for t in a["paged_kv_cache"]))),
    ("paged_kv_cache", "k/v shapes differ", lambda a: a.update(paged_kv_cache=(_k(a), _k(a)[:, :2]))),
    ("paged_kv_cache", "k/v dtypes differ", lambda a: a.update(paged_kv_cache=(_k(a), _k(a).float()))),
    ("paged_kv_cache", "not a tensor", lambda a: a.update(paged_kv_cache=[_k(a), _k(a)])),
    ("paged_kv_cache", "4-D single tensor", lambda a: a.update(paged_kv_cache=_k(a))),
    ("paged_kv_cache", "dim 1 of 3", lambda a: a.update(paged_kv_cache=torch.stack([_k(a)] * 3, dim=1))),
    ("paged_kv_cache", "head_dim strided", lambda a: a.update(paged_kv_cache=(_strided(a), _strided(a)))),
    ("paged_kv_cache", "float32 (no kernel)", lambda a: a.update(paged_kv_cache=(_k(a).float(), _k(a).float()))),
    ("paged_kv_cache", "integer pages", lambda a: a.update(paged_kv_cache=(_k(a).short(), _k(a).short()))),
    (
        "page_size",
        "HND cache read as NHD",
        lambda a: a.update(paged_kv_cache=tuple(_hnd(t) for t in _kv(a)), page_size=4),
    ),
    ("page_size", "plan page_size", lambda a: a.update(page_size=16)),
    ("num_kv_heads", "plan num_kv_heads", lambda a: a.update(num_kv_heads=4)),
    ("head_dim", "plan head_dim", lambda a: a.update(head_dim=16)),
    ("kv_data_type", "plan kv dtype", lambda a: a.update(kv_data_type=torch.bfloat16)),
    ("q_data_type", "plan q dtype", lambda a: a.update(q_data_type=torch.bfloat16)),
    ("q", "q 2-D", lambda a: a.update(q=_q(a)[0])),
    ("q", "q batch", lambda a: a.update(q=_q(a)[:3])),
    ("q", "q head_dim", lambda a: a.update(q=torch.zeros(4, 4, 16, dtype=torch.float16))),
    ("num_qo_heads", "heads not a multiple", lambda a: a.update(q=torch.zeros(4, 3, 8, dtype=torch.float16))),
    ("num_qo_heads", "q heads != num_qo_heads", lambda a: a.update(num_qo_heads=8)),
    ("q", "q dtype != cache dtype", lambda a: a.update(q=_q(a).bfloat16())),
    ("q", "q integer", lambda a: a.update(q=_q(a).int())),
    ("qo_indptr", "qo_indptr int64", lambda a: a.update(qo_indptr=torch.tensor([0, 1, 2, 3, 4]))),
    ("qo_indptr", "qo_indptr length", lambda a: a.update(qo_indptr=_i32([0, 1, 2, 4]))),
    ("qo_indptr", "qo_indptr start", lambda a: a.update(qo_indptr=_i32([1, 1, 2, 3, 4]))),
    ("qo_indptr", "qo_indptr decreasing", lambda a: a.update(qo_indptr=_i32([0, 2, 1, 3, 4]))),
    ("q", "q rows != qo_indptr[-1]", lambda a: a.update(qo_indptr=_i32([0, 1, 2, 3, 5]))),
    # FlashInfer walks both pools with k_cache's strides (TORCH_CHECK "k/v strides must be identical").
    ("paged_kv_cache", "k/v strides differ", lambda a: a.update(paged_kv_cache=(_k(a), _restrided(_kv(a)[1])))),
    # plan() reads the index arrays through data_ptr(): a strided view would be read as if dense.
    *(
        (name, f"strided {name}", lambda a, name=name: a.update({name: _strided_1d(a[name])}))
        for name in ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
    ),
    ("qo_indptr", "strided qo_indptr", lambda a: a.update(qo_indptr=_strided_1d(_i32([0, 1, 2, 3, 4])))),
]


def _restrided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values and shape, with other strides (pages stored head-major), head_dim still contiguous."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _strided_1d(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a non-contiguous 1-D view (every other element of a doubled copy)."""
    return torch.stack([t, t], dim=1)[:, 0]


def _kv(a: Args) -> tuple[torch.Tensor, torch.Tensor]:
    kv = a["paged_kv_cache"]
    assert isinstance(kv, tuple)
    return kv


def _k(a: Args) -> torch.Tensor:
    return _kv(a)[0]


def _q(a: Args) -> torch.Tensor:
    q = a["q"]
    assert isinstance(q, torch.Tensor)
    return q


def _hnd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous()


def _strided(a: Args) -> torch.Tensor:
    k = _k(a)
    return torch.zeros(*k.shape[:-1], 2 * k.shape[-1], dtype=k.dtype)[..., ::2]


def _args(cache: FlashInferCache, q: torch.Tensor) -> Args:
    return {
        "paged_kv_indptr": cache.paged_kv_indptr,
        "paged_kv_indices": cache.paged_kv_indices,
        "paged_kv_last_page_len": cache.paged_kv_last_page_len,
        "paged_kv_cache": cache.paged_kv_cache,
        "kv_layout": cache.kv_layout,
        "q": q,
    }


def _call(a: Args) -> None:
    check_flashinfer_args(**a)


def test_checker_accepts_the_good_arguments() -> None:
    cache, q = _good()
    _call(_args(cache, q))
    _call({**_args(cache, q), "page_size": 4, "num_kv_heads": 2, "head_dim": 8, "num_qo_heads": 4})
    _call({**_args(cache, q), "kv_data_type": torch.float16, "q_data_type": torch.float16})
    _call({**_args(cache, q), "qo_indptr": _i32([0, 1, 2, 3, 4])})
    _call({**_args(cache, q), "q": None, "num_qo_heads": 6, "q_data_type": torch.float16})
    # A prefill batch with several queries per request.
    _call({**_args(cache, torch.zeros(9, 4, 8, dtype=torch.float16)), "qo_indptr": _i32([0, 5, 6, 6, 9])})


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
def test_checker_refuses_group_sizes_the_cuda_core_decode_lacks(group: int) -> None:
    """Decode without tensor cores dispatches group sizes 1, 2, 3, 4, 6, 8 only (DISPATCH_GQA_GROUP_SIZE)."""
    cache, _ = _good()  # 2 KV heads
    q = torch.zeros(4, 2 * group, 8, dtype=torch.float16)
    for a in (_args(cache, q), {**_args(cache, q), "q": None, "num_qo_heads": 2 * group}):
        if group in (1, 2, 3, 4, 6, 8):
            _call(a)
        else:
            with pytest.raises(HurrayArgumentError, match="use_tensor_cores=True") as exc:
                _call(a)
            assert exc.value.field == "num_qo_heads"
        _call({**a, "use_tensor_cores": True})
    # Prefill (and decode with use_tensor_cores=True) runs the tensor-core kernels: any group size.
    _call({**_args(cache, q), "qo_indptr": _i32([0, 1, 2, 3, 4])})
    # The reference computes every group size, as the tensor-core decode does.
    assert reference_decode(q, cache).shape == q.shape


@pytest.mark.parametrize(("field", "what", "change"), BAD, ids=[b[1] for b in BAD])
def test_checker_rejects(field: str, what: str, change: Callable[[Args], None]) -> None:
    cache, q = _good()
    a = _args(cache, q)
    change(a)
    with pytest.raises(HurrayArgumentError) as exc:
        _call(a)
    assert exc.value.field == field, f"{what}: {exc.value}"


def test_checker_refuses_a_q_whose_head_dim_is_strided() -> None:
    """FlashInfer reads q through its token and head strides only, head_dim as one dense vector."""
    cache, q = _good()
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)  # q's values, head_dim strided (stride = heads)
    assert transposed.stride(-1) != 1
    for a in (_args(cache, transposed), {**_args(cache, transposed), "qo_indptr": _i32([0, 1, 2, 3, 4])}):
        with pytest.raises(HurrayArgumentError, match=r"q\.contiguous\(\)") as exc:
            _call(a)
        assert exc.value.field == "q"
    with pytest.raises(HurrayArgumentError):
        reference_decode(transposed, cache)  # the reference would compute it right, the kernel would not
    # Token and head strides are the kernel's to take: the query heads of a fused qkv tensor pass as they are.
    qkv = torch.zeros(4, 8, 8, dtype=torch.float16)
    _call(_args(cache, qkv[:, :4]))
    _call(_args(cache, transposed.contiguous()))


def test_checker_relaxed_dtypes_accept_float32() -> None:
    cache, _ = _good()
    f32 = FlashInferCache(
        (cache.k_cache.float(), cache.v_cache.float()),
        cache.paged_kv_indptr,
        cache.paged_kv_indices,
        cache.paged_kv_last_page_len,
    )
    q = torch.randn(4, 4, 8)
    f32.check(q, strict_dtypes=False)
    with pytest.raises(HurrayArgumentError):
        f32.check(q)


def test_checker_rejects_unplanned_q_and_kv_combinations() -> None:
    cache, _ = _good()
    with pytest.raises(HurrayArgumentError) as exc:
        check_flashinfer_args(
            cache.paged_kv_indptr,
            cache.paged_kv_indices,
            cache.paged_kv_last_page_len,
            cache.paged_kv_cache,
            num_qo_heads=0,
        )
    assert exc.value.field == "num_qo_heads"
    with pytest.raises(HurrayArgumentError) as exc:
        check_flashinfer_args(
            cache.paged_kv_indptr,
            cache.paged_kv_indices,
            cache.paged_kv_last_page_len,
            cache.paged_kv_cache,
            q_data_type=torch.bfloat16,
        )
    assert exc.value.field == "q_data_type"


@settings(max_examples=15)
@given(
    snap=snapshots(latent=False, states=False),
    kv_layout=st.sampled_from(LAYOUTS),
    combined=st.booleans(),
    page_size=st.sampled_from([None, 2, 16]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, None]),
)
def test_checker_accepts_what_the_importer_produces(
    snap: KVSnapshot, kv_layout: str, combined: bool, page_size: int | None, dtype: torch.dtype | None
) -> None:
    src = snap.keys[0].dtype
    if dtype is None and src in FP8:
        dtype = src  # pass-through: FlashInfer's own fp8 path
    cache = to_flashinfer(snap, 0, page_size=page_size, kv_layout=kv_layout, combined=combined, dtype=dtype)
    kv_dtype = cache.dtype
    q_dtype = torch.bfloat16 if kv_dtype in FP8 else kv_dtype
    q = torch.zeros(snap.num_seqs, cache.num_kv_heads * 2, cache.head_dim, dtype=q_dtype)
    strict = kv_dtype != torch.float32
    cache.check(q, strict_dtypes=strict)
    check_flashinfer_args(
        *cache.decode_plan_args(cache.num_kv_heads * 2)[:3],
        cache.paged_kv_cache,
        kv_layout=kv_layout,
        num_qo_heads=cache.num_kv_heads * 2,
        num_kv_heads=cache.num_kv_heads,
        head_dim=cache.head_dim,
        page_size=cache.page_size,
        q=q,
        strict_dtypes=strict,
    )
    qo_indptr = torch.arange(snap.num_seqs + 1, dtype=torch.int32)
    args = cache.prefill_plan_args(qo_indptr, 4)
    want = (qo_indptr, cache.paged_kv_indptr, cache.paged_kv_indices, cache.paged_kv_last_page_len)
    assert all(a is b for a, b in zip(args[:4], want))
    assert args[4:] == (4, cache.num_kv_heads, cache.head_dim, cache.page_size)
    cache.check(q, qo_indptr=qo_indptr, strict_dtypes=strict)


def test_reference_decode_checks_its_inputs() -> None:
    cache, q = _good()
    with pytest.raises(HurrayArgumentError):
        reference_decode(q[:2], cache)
    with pytest.raises(HurrayArgumentError):
        reference_decode(torch.zeros(4, 3, 8), cache)


def test_plan_helpers() -> None:
    snap = make_snapshot([7, 3])
    assert plan_flashinfer(snap, snap.page_size) is None
    plan = plan_flashinfer(snap, 2)
    assert plan is not None and plan.page_size == 2
    k = snap.keys[0]
    assert k.seq_lens is not None
    ref = plan_repage(k.block_table, k.seq_ptr, k.seq_lens, k.page_size, 2)
    assert torch.equal(plan.src_slots, ref.src_slots)
    cache = to_flashinfer(snap, 0, plan=plan)  # page_size taken from the plan
    assert cache.page_size == 2
    args = cache.decode_plan_args(4)
    assert args[3:] == (4, 2, 8, 2)


def test_plan_flashinfer_repage_is_a_deprecated_alias() -> None:
    snap = make_snapshot([7, 3])
    with pytest.warns(DeprecationWarning, match="plan_flashinfer"):
        old = plan_flashinfer_repage(snap, 2)
    new = plan_flashinfer(snap, 2)
    assert old is not None and new is not None
    assert torch.equal(old.src_slots, new.src_slots) and torch.equal(old.block_table, new.block_table)


@pytest.mark.parametrize("page_size", [None, 2, 3])
def test_to_flashinfer_all_equals_per_layer_imports(page_size: int | None) -> None:
    snap = make_snapshot([7, 3, 0, 4], page_size=4)
    caches = to_flashinfer_all(snap, page_size=page_size, kv_layout="HND")
    assert len(caches) == snap.num_layers
    for i, cache in enumerate(caches):
        one = to_flashinfer(snap, i, page_size=page_size, kv_layout="HND")
        assert cache.layer == i and cache.kv_layout == "HND"
        assert torch.equal(cache.k_cache, one.k_cache) and torch.equal(cache.v_cache, one.v_cache)
        assert torch.equal(cache.paged_kv_indptr, one.paged_kv_indptr)
        assert torch.equal(cache.paged_kv_indices, one.paged_kv_indices)
        assert torch.equal(cache.paged_kv_last_page_len, one.paged_kv_last_page_len)


def test_to_flashinfer_all_into_preallocated_pools() -> None:
    snap = make_snapshot([7, 3], page_size=4)
    first = to_flashinfer_all(snap, page_size=2)
    pools = [(torch.zeros_like(c.k_cache), torch.zeros_like(c.v_cache)) for c in first]
    caches = to_flashinfer_all(snap, page_size=2, out=pools)
    for cache, pool, ref in zip(caches, pools, first, strict=True):
        assert cache.k_cache is pool[0] and torch.equal(cache.k_cache, ref.k_cache)


@pytest.mark.parametrize("page_size", ["4", 4.0, 2.5, True])
def test_a_page_size_that_is_not_an_integer_is_refused(page_size: object) -> None:
    """ "4" failed with a bare TypeError (comparing it with 0); 4.0 passed where the pages had that size."""
    snap = make_snapshot([7, 3], page_size=4)
    for call in (
        lambda: plan_flashinfer(snap, page_size),  # type: ignore[arg-type]
        lambda: to_flashinfer(snap, 0, page_size=page_size),  # type: ignore[arg-type]
        lambda: to_flashinfer_all(snap, page_size=page_size),  # type: ignore[arg-type]
    ):
        with pytest.raises(ImportArgumentError) as exc:
            call()
        assert exc.value.field == "page_size"


def test_to_flashinfer_all_rejects() -> None:
    snap = make_snapshot([7, 3])
    with pytest.raises(HurrayArgumentError) as arg:
        to_flashinfer_all(snap, page_size=0)
    assert arg.value.field == "page_size"
    with pytest.raises(HurrayArgumentError) as arg:
        to_flashinfer_all(snap, kv_layout="NDH")
    assert arg.value.field == "kv_layout"
    with pytest.raises(HurrayFormatError) as fmt:
        to_flashinfer_all(snap, out=[])
    assert fmt.value.field == "out"
    with pytest.raises(HurrayFormatError) as fmt:
        to_flashinfer_all(replace(snap, keys=(), values=()))
    assert fmt.value.field == "snapshot.layers"


@settings(max_examples=30)
@given(
    snap=snapshots(latent=False, states=False),
    kv_layout=st.sampled_from(LAYOUTS),
    combined=st.booleans(),
    page_size=st.sampled_from([None, 1, 3, 16]),
    dtype=st.sampled_from([None, torch.float32]),
    spare=st.integers(0, 2),
)
def test_import_into_a_preallocated_cache_equals_a_fresh_import(
    snap: KVSnapshot, kv_layout: str, combined: bool, page_size: int | None, dtype: torch.dtype | None, spare: int
) -> None:
    plan = plan_flashinfer(snap, page_size) if page_size else None
    for layer in range(snap.num_layers):
        fresh = to_flashinfer(snap, layer, kv_layout=kv_layout, combined=combined, plan=plan, dtype=dtype)
        pools = [t for t in ((fresh.paged_kv_cache,) if combined else fresh.paged_kv_cache)]  # type: ignore[union-attr]
        out = []
        for t in pools:
            o = torch.empty((t.shape[0] + spare, *t.shape[1:]), dtype=t.dtype)
            o.view(torch.uint8).fill_(0x5A)
            out.append(o)
        into = to_flashinfer(
            snap,
            layer,
            kv_layout=kv_layout,
            combined=combined,
            plan=plan,
            dtype=dtype,
            out=out[0] if combined else (out[0], out[1]),
        )
        got = (into.paged_kv_cache,) if combined else into.paged_kv_cache
        for t, o, g in zip(pools, out, got, strict=True):  # type: ignore[arg-type]
            assert g is o
            n = t.shape[0]
            assert torch.equal(o[:n].view(torch.uint8), t.contiguous().view(torch.uint8))
            assert bool((o[n:].view(torch.uint8) == 0x5A).all())
        assert torch.equal(into.paged_kv_indices, fresh.paged_kv_indices)
        assert torch.equal(into.paged_kv_indptr, fresh.paged_kv_indptr)
        assert torch.equal(into.paged_kv_last_page_len, fresh.paged_kv_last_page_len)
        assert (into.k_scale, into.v_scale) == (fresh.k_scale, fresh.v_scale)


def test_import_into_refuses_a_cache_that_does_not_fit() -> None:
    snap = make_snapshot([12, 9, 5], page_size=4)
    fresh = to_flashinfer(snap, 0)
    k = fresh.k_cache
    cases: list[tuple[dict[str, Any], str]] = [
        ({"out": k}, "out"),  # one tensor without combined
        ({"out": (k, k.float())}, "out[1]"),
        ({"out": (k[:1], k)}, "out[0]"),
        ({"out": (k, k), "kv_layout": "HND"}, "out[0]"),
        ({"out": (k, k), "combined": True}, "out"),
    ]
    for kwargs, field in cases:
        with pytest.raises(HurrayFormatError) as err:
            to_flashinfer(snap, 0, **kwargs)
        assert err.value.field == field, kwargs


@given(snap=snapshots(latent=True))
def test_kv_importers_refuse_mla_latents_naming_the_way_out(snap: KVSnapshot) -> None:
    """A fused MLA latent has no K/V split: FlashInfer's and flash-attn's K/V caches refuse it by field."""
    from hurray_vllm.adapters.flash_attn import to_flash_attn

    for importer in (lambda: to_flashinfer_all(snap), lambda: to_flash_attn(snap, 0, page_size=256)):
        with pytest.raises(HurrayFormatError, match=r"kv_role.*fused MLA latents.*expand_latent"):
            importer()


def test_layers_paged_otherwise_than_layer_0_are_refused_not_read_through_its_table() -> None:
    """The importers plan (and repage) once, from layer 0: a layer whose pages lie in another order would be
    read through layer 0's table, silently wrong. Every importer of one table for all layers refuses it."""
    from hurray_vllm.adapters.flash_attn import to_flash_attn_all

    snap = make_snapshot([20], page_size=16, layers=2)
    k1, v1 = snap.keys[1], snap.values[1]
    swapped = torch.tensor([1, 0])
    other = replace(
        snap,
        keys=(snap.keys[0], replace(k1, block_table=swapped)),
        values=(snap.values[0], replace(v1, block_table=swapped)),
    )
    assert other.validate().ok  # a valid snapshot: each layer is paged its own way
    for imported in (
        lambda: to_flashinfer_all(other),
        lambda: to_flashinfer_all(other, page_size=32),
        lambda: to_flash_attn_all(other, page_size=256),
    ):
        with pytest.raises(HurrayFormatError) as exc:
            imported()
        assert exc.value.field == "snapshot.structure" and "layer 1" in str(exc.value)


def test_import_all_into_checks_every_layer_before_writing_any() -> None:
    """A later layer refused after earlier layers were written would leave out= half imported."""
    snap = make_snapshot([7, 3])
    quantized = replace(
        snap,
        keys=(snap.keys[0], replace(snap.keys[1], quantization=PerTensorAffine(0.5))),
        values=(snap.values[0], replace(snap.values[1], quantization=PerTensorAffine(0.5))),
    )
    # Layers of two dtypes: layer 0's float8 passes through as dtype= asks, layer 1's float16 cannot be quantized.
    fp8 = make_snapshot([7, 3], dtype=torch.float8_e4m3fn, layers=1)
    f16 = make_snapshot([7, 3], layers=1)
    mixed = KVSnapshot(
        keys=(fp8.keys[0], replace(f16.keys[0], layer_index=1)),
        values=(fp8.values[0], replace(f16.values[0], layer_index=1)),
        kv_scales=((1.0, 1.0), (1.0, 1.0)),
    )
    for bad, dtype, field in ((quantized, None, "quantization"), (mixed, torch.float8_e4m3fn, "dtype")):
        out = [tuple(torch.empty(4, 4, 2, 8, dtype=dtype or torch.float16) for _ in range(2)) for _ in range(2)]
        for pair in out:
            for o in pair:
                o.view(torch.uint8).fill_(0x5A)
        with pytest.raises(HurrayFormatError) as exc:
            to_flashinfer_all(bad, dtype=dtype, out=out)  # type: ignore[arg-type]
        assert exc.value.field == field
        assert all(bool((o.view(torch.uint8) == 0x5A).all()) for pair in out for o in pair), "nothing is written"


def test_import_into_refuses_a_pair_flashinfer_cannot_read() -> None:
    snap = make_snapshot([12, 9, 5], page_size=4)
    k = to_flashinfer(snap, 0).k_cache

    def strided_head_dim() -> torch.Tensor:
        return torch.zeros(*k.shape[:-1], 2 * k.shape[-1], dtype=k.dtype)[..., ::2]

    cases = {
        "k/v strides differ (FlashInfer reads both with k's)": (k.clone(), _restrided(k.clone())),
        "k/v page counts differ": (k.clone(), torch.cat([k, k[:1]])),
        "head_dim strided": (strided_head_dim(), strided_head_dim()),
    }
    for why, out in cases.items():
        before = [o.clone() for o in out]
        with pytest.raises(HurrayArgumentError) as exc:
            to_flashinfer(snap, 0, out=out)
        assert exc.value.field == "out", why
        assert all(torch.equal(o, b) for o, b in zip(out, before, strict=True)), f"{why}: nothing is written"


def test_pools_strided_differently_are_made_dense_for_flashinfer() -> None:
    """Passed through as the snapshot holds them, a key pool and a value pool of other strides would be read
    through the key's strides (FlashInfer takes one set): the importer makes both contiguous."""
    snap = make_snapshot([12, 9, 5], page_size=4, layers=1)
    v = snap.values[0]
    odd = replace(snap, values=(replace(v, page_pool=_restrided(v.page_pool)),))
    assert odd.values[0].page_pool.stride() != odd.keys[0].page_pool.stride()
    for combined in (False, True):
        cache = to_flashinfer(odd, 0, combined=combined)
        assert cache.k_cache.stride() == cache.v_cache.stride()
        cache.check(torch.zeros(3, 2, 8, dtype=torch.float16))
        for s in range(3):
            assert torch.equal(rebuild(cache, s)[1], v.to_dense(s))
    assert to_flashinfer(snap, 0).v_cache is v.page_pool  # dense pools stay the snapshot's own (no copy)


@pytest.mark.parametrize("combined", [False, True])
def test_import_all_into_refuses_caches_shared_between_layers(combined: bool) -> None:
    """One cache for every layer: each layer would overwrite the one before, checked before anything is written."""
    snap = make_snapshot([7, 3], layers=3)
    fresh = to_flashinfer(snap, 0, combined=combined)
    pages = fresh.k_cache.shape[0]
    page = (2, *fresh.k_cache.shape[1:]) if combined else tuple(fresh.k_cache.shape[1:])
    pools = [torch.full((2 * pages, *page), 7.0, dtype=fresh.k_cache.dtype) for _ in range(6)]

    def cache(i: int, start: int = 0) -> Any:
        """Layer cache ``i``: pages ``start ..`` of pool ``i`` (and ``i + 3`` for the value pool of a pair)."""
        return (
            pools[i][start : start + pages]
            if combined
            else (pools[i][start : start + pages], pools[i + 3][start : start + pages])
        )

    cases = {
        "one cache for every layer": ([cache(0)] * 3, "out[1]"),
        "layer 2's cache overlaps layer 0's": ([cache(0), cache(1), cache(0, 1)], "out[2]"),
    }
    for why, (out, field) in cases.items():
        with pytest.raises(HurrayArgumentError) as exc:
            to_flashinfer_all(snap, combined=combined, out=out)
        assert exc.value.field == field, why
        assert all(bool((p == 7.0).all()) for p in pools), f"{why}: nothing is written"
    # Disjoint pages of one buffer are separate caches.
    out = [cache(0), cache(0, pages), cache(1)]
    for got, want in zip(to_flashinfer_all(snap, combined=combined, out=out), out, strict=True):
        held = (got.paged_kv_cache,) if combined else got.paged_kv_cache
        assert all(h is w for h, w in zip(held, (want,) if combined else want, strict=True))


def test_import_into_a_list_pair_gives_a_tuple() -> None:
    """FlashInfer (and FlashInferCache.check) take a (k, v) tuple or one tensor, never a list."""
    snap = make_snapshot([7, 3], layers=2)
    fresh = to_flashinfer(snap, 0)
    out = [torch.zeros_like(fresh.k_cache), torch.zeros_like(fresh.v_cache)]
    cache = to_flashinfer(snap, 0, out=out)  # type: ignore[arg-type]
    assert isinstance(cache.paged_kv_cache, tuple)
    assert cache.k_cache is out[0] and cache.v_cache is out[1]
    cache.check()
    lists = [[torch.zeros_like(fresh.k_cache), torch.zeros_like(fresh.v_cache)] for _ in range(2)]
    for c in to_flashinfer_all(snap, out=lists):  # type: ignore[arg-type]
        assert isinstance(c.paged_kv_cache, tuple)
        c.check()
