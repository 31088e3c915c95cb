"""The real flash-attn kernels on imported caches agree with the PyTorch reference.

Needs a CUDA device and the kernel package; every test skips with the reason
otherwise (also under CI=true: a CPU runner cannot provide either). Run with
``make test-gpu`` or ``pytest -m gpu`` on a CUDA machine with flash-attn installed.
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType

import pytest
import torch
from synthetic import make_snapshot

from hurray_vllm.adapters.flash_attn import FlashAttnCache, flash_attn_with_kvcache, to_flash_attn
from hurray_vllm.adapters.reference import paged_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: Sequences with a shared prefix, a duplicate (shared partial tail) and an empty one.
LENS = [300, 300, 513, 0, 37]
SHARES = [0, 100, 1, 0, 0]


def kernel(*modules: str) -> ModuleType:
    """The first of ``modules`` that imports; skip (with every import error) when none does."""
    errors = []
    for name in modules:
        try:
            return __import__(name, fromlist=["_"])
        except ImportError as exc:  # a build for another torch fails with ImportError too
            errors.append(f"{name}: {exc}")
    pytest.skip(f"no kernel package: {'; '.join(errors)}")


def on_cpu(cache: FlashAttnCache) -> FlashAttnCache:
    """A host copy, so the reference appends into its own pages."""

    def cpu(t: torch.Tensor) -> torch.Tensor:
        return t.detach().cpu().clone()

    return replace(
        cache,
        k_cache=cpu(cache.k_cache),
        v_cache=cpu(cache.v_cache),
        block_table=cpu(cache.block_table),
        cache_seqlens=cpu(cache.cache_seqlens),
        k_descale=None if cache.k_descale is None else cpu(cache.k_descale),
        v_descale=None if cache.v_descale is None else cpu(cache.v_descale),
    )


def compare(
    cache: FlashAttnCache,
    *,
    seqlen_q: int,
    n_new: int,
    heads_k: int,
    dim: int,
    tol: float,
    q_descale: bool = False,
) -> None:
    """Run the kernel and the reference on copies of ``cache``; outputs and written pages must agree."""
    gen = torch.Generator().manual_seed(11)
    dtype = cache.k_cache.dtype
    batch = cache.batch_size
    q = torch.randn((batch, seqlen_q, 2 * heads_k, dim), generator=gen).to(dtype)
    k = torch.randn((batch, n_new, heads_k, dim), generator=gen).to(dtype) if n_new else None
    v = torch.randn((batch, n_new, heads_k, dim), generator=gen).to(dtype) if n_new else None
    qd = torch.rand((batch, heads_k), generator=gen) + 0.5 if q_descale else None
    ref_cache = on_cpu(cache)
    want = paged_attention(
        q,
        ref_cache.k_cache,
        ref_cache.v_cache,
        ref_cache.cache_seqlens,
        ref_cache.block_table,
        k=k,
        v=v,
        q_descale=qd,
        k_descale=ref_cache.k_descale,
        v_descale=ref_cache.v_descale,
    )
    dev = cache.k_cache.device

    def gpu(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dev)

    got = flash_attn_with_kvcache(q.to(dev), cache, k=gpu(k), v=gpu(v), q_descale=gpu(qd))
    torch.cuda.synchronize()
    err = (got.float().cpu() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= tol * max(scale, 1.0), f"max |kernel - reference| = {err} (output scale {scale})"
    if n_new:
        # Same positions written with the same values: the caches are equal byte for byte.
        assert torch.equal(cache.k_cache.cpu().view(torch.uint8), ref_cache.k_cache.view(torch.uint8))
        assert torch.equal(cache.v_cache.cpu().view(torch.uint8), ref_cache.v_cache.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("seqlen_q", "n_new"), [(1, 0), (1, 1), (4, 4)])
def test_fa2_on_imported_cache(dtype: torch.dtype, seqlen_q: int, n_new: int) -> None:
    kernel("flash_attn")
    snap = make_snapshot(LENS, SHARES, 16, heads=2, dim=128, dtype=dtype, layers=1)
    cache = to_flash_attn(snap, 0, flavor="fa2", page_size=256, device="cuda", reserve=n_new)
    assert cache.k_cache.dtype in (torch.bfloat16, torch.float16)
    compare(cache, seqlen_q=seqlen_q, n_new=n_new, heads_k=2, dim=128, tol=2e-2)


@pytest.mark.parametrize("page_size", [48, 256])
@pytest.mark.parametrize(("seqlen_q", "n_new"), [(1, 0), (4, 4)])
def test_fa3_on_imported_cache(page_size: int, seqlen_q: int, n_new: int) -> None:
    kernel("flash_attn_interface", "flash_attn_3.flash_attn_interface")
    snap = make_snapshot(LENS, SHARES, 16, heads=2, dim=128, dtype=torch.bfloat16, layers=1)
    cache = to_flash_attn(snap, 0, flavor="fa3", page_size=page_size, device="cuda", reserve=n_new)
    compare(cache, seqlen_q=seqlen_q, n_new=n_new, heads_k=2, dim=128, tol=2e-2)


@pytest.mark.parametrize(("seqlen_q", "n_new"), [(1, 0), (4, 4)])
def test_fa3_fp8_passthrough_with_descales(seqlen_q: int, n_new: int) -> None:
    kernel("flash_attn_interface", "flash_attn_3.flash_attn_interface")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FlashAttention-3 runs float8 on Hopper (sm90) or newer only")
    snap = make_snapshot(LENS, SHARES, 16, heads=2, dim=128, dtype=torch.float8_e4m3fn, layers=1)
    cache = to_flash_attn(snap, 0, flavor="fa3", page_size=64, device="cuda", reserve=n_new)
    assert cache.k_cache.dtype == torch.float8_e4m3fn and cache.k_descale is not None
    # The kernel rounds the softmax probabilities to fp8 too: a looser bound than for 16-bit inputs.
    compare(cache, seqlen_q=seqlen_q, n_new=n_new, heads_k=2, dim=128, tol=8e-2, q_descale=True)


@pytest.mark.parametrize(("seqlen_q", "n_new"), [(1, 0), (4, 4)])
def test_vllm_fork_on_imported_cache(seqlen_q: int, n_new: int) -> None:
    kernel("vllm.vllm_flash_attn", "vllm_flash_attn")
    snap = make_snapshot(LENS, SHARES, 32, heads=2, dim=128, dtype=torch.bfloat16, layers=1)
    cache = to_flash_attn(snap, 0, flavor="vllm", page_size=16, device="cuda", reserve=n_new)
    compare(cache, seqlen_q=seqlen_q, n_new=n_new, heads_k=2, dim=128, tol=2e-2)
