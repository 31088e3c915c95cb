"""The PyTorch reference attention against PyTorch's own attention kernels.

``hurray_vllm.adapters.reference.paged_attention`` stands in for flash-attn on the
CPU, so its semantics (GQA head mapping, bottom-right causal alignment for
queries over a longer cache, the page walk) are checked here against
``scaled_dot_product_attention`` over each sequence's dense K/V: the math
backend on the CPU, and on CUDA the FlashAttention-2 kernel PyTorch ships,
which also runs the reference on the device.
"""

from __future__ import annotations

import pytest
import torch
from synthetic import make_snapshot
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention

from hurray_vllm.adapters.flash_attn import to_flash_attn
from hurray_vllm.adapters.reference import paged_attention

#: A shared prefix, a shared partial tail, lengths off the page size.
LENS = [300, 300, 513, 37]
SHARES = [0, 100, 1, 0]
HEADS_K, GROUP, DIM = 2, 3, 64


def _check(device: str, backend: SDPBackend, seqlen_q: int, dtype: torch.dtype, tol: float) -> None:
    """``dtype`` is the cache's; the math backend gets float32 copies (the reference accumulates in float32)."""
    exact = backend == SDPBackend.MATH
    snap = make_snapshot(LENS, SHARES, 16, heads=HEADS_K, dim=DIM, dtype=dtype, layers=1)
    cache = to_flash_attn(snap, 0, page_size=256, device=device)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn((len(LENS), seqlen_q, HEADS_K * GROUP, DIM), generator=gen).to(dtype).to(device)
    got = paged_attention(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.block_table)
    assert got.device.type == device
    for b, n in enumerate(LENS):
        # Query head h reads KV head h // GROUP (flash-attn's GQA mapping).
        k = snap.keys[0].to_dense(b).to(device).repeat_interleave(GROUP, dim=1)
        v = snap.values[0].to_dense(b).to(device).repeat_interleave(GROUP, dim=1)
        qb = q[b].transpose(0, 1).unsqueeze(0)  # [1, H, seqlen_q, D]
        if exact:
            qb, k, v = qb.float(), k.float(), v.float()
        mask = causal_lower_right(seqlen_q, n) if seqlen_q > 1 else None
        with sdpa_kernel(backend):
            want = scaled_dot_product_attention(
                qb, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), attn_mask=mask
            )
        want = want[0].transpose(0, 1)  # [seqlen_q, H, D]
        err = (got[b].float() - want.float()).abs().max().item()
        scale = max(want.float().abs().max().item(), 1.0)
        assert err <= tol * scale, f"sequence {b}: max |reference - sdpa| = {err} (output scale {scale})"


@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_reference_matches_sdpa_on_cpu(seqlen_q: int) -> None:
    _check("cpu", SDPBackend.MATH, seqlen_q, torch.bfloat16, 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seqlen_q", [1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_on_cuda_matches_flash_sdpa(seqlen_q: int, dtype: torch.dtype) -> None:
    _check("cuda", SDPBackend.FLASH_ATTENTION, seqlen_q, dtype, 2e-2 if dtype == torch.bfloat16 else 4e-3)
