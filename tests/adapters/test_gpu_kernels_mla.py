"""Real MLA kernels (FlashMLA, FlashInfer's MLA wrapper) on imported latents, against the reference.

Needs CUDA and the kernel package (``flash_mla``; ``flashinfer``). Without
them every test is skipped with the reason, also under ``CI=true``: neither
is part of ``make test`` (they need a matching CUDA toolkit and, for
FlashMLA, a Hopper GPU). Run with ``pytest -m gpu`` on such a machine.
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType

import pytest
import torch
from synthetic import latent_snapshot

from hurray_vllm.adapters.flash_mla import flash_mla_with_kvcache, to_flash_mla
from hurray_vllm.adapters.flashinfer import to_flashinfer_mla
from hurray_vllm.adapters.reference import mla_paged_decode

pytestmark = [pytest.mark.gpu]
LENS = [300, 130, 1]


def _module(name: str) -> ModuleType:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        return importlib.import_module(name)
    except Exception as exc:  # an ImportError, or a CUDA/toolkit mismatch raised at import
        pytest.skip(f"{name} is not importable: {exc!r}")


def test_flash_mla_equals_the_reference() -> None:
    _module("flash_mla")
    snap = latent_snapshot(LENS)
    cache = to_flash_mla(snap, 0, device="cuda")
    q = torch.randn(len(LENS), 1, 16, 576, device="cuda").to(torch.bfloat16)
    out, _ = flash_mla_with_kvcache(q, cache)
    want = mla_paged_decode(q, cache.k_cache, cache.block_table, cache.cache_seqlens, head_dim_v=512)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_flashinfer_mla_equals_the_reference() -> None:
    flashinfer = _module("flashinfer")
    snap = latent_snapshot(LENS)
    mla = to_flashinfer_mla(snap, 0, device="cuda")
    heads = 16
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.int8, device="cuda"))
    qo_indptr = torch.arange(len(LENS) + 1, dtype=torch.int32, device="cuda")
    wrapper.plan(
        qo_indptr,
        mla.kv_indptr,
        mla.kv_indices,
        mla.kv_len_arr,
        heads,
        512,
        64,
        mla.page_size,
        False,
        1 / math.sqrt(576),
        torch.bfloat16,
        torch.bfloat16,
    )
    q = torch.randn(len(LENS), heads, 576, device="cuda").to(torch.bfloat16)
    out = wrapper.run(q[..., :512].contiguous(), q[..., 512:].contiguous(), mla.ckv_cache, mla.kpe_cache)
    cache = to_flash_mla(snap, 0, device="cuda")  # the same latent in one pool, for the reference
    want = mla_paged_decode(q[:, None], cache.k_cache, cache.block_table, cache.cache_seqlens, head_dim_v=512)
    torch.testing.assert_close(out.float(), want[:, 0], rtol=2e-2, atol=2e-2)
