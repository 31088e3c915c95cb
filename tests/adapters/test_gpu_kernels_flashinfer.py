"""Real FlashInfer kernels on imported caches, against :func:`reference_decode`.

Needs CUDA and an importable ``flashinfer``. Without either every test is
skipped with the reason, also under ``CI=true``: FlashInfer is not part of
``make test`` (it needs a matching CUDA toolkit), so its absence is not a
failure. Run with ``pytest -m gpu`` on a CUDA machine with FlashInfer.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch
from synthetic import make_flashinfer_snapshot as make_snapshot

from hurray_vllm import KVSnapshot
from hurray_vllm.adapters.flashinfer import FlashInferCache, plan_flashinfer, reference_decode, to_flashinfer

pytestmark = [pytest.mark.gpu]

WORKSPACE_BYTES = 128 * 1024 * 1024


@pytest.fixture(scope="module")
def flashinfer() -> ModuleType:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        return importlib.import_module("flashinfer")
    except Exception as exc:  # an ImportError, or a CUDA/toolkit mismatch raised at import
        pytest.skip(f"flashinfer is not importable: {exc!r}")


@pytest.fixture(scope="module")
def workspace(flashinfer: ModuleType) -> torch.Tensor:
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")


def snapshot(
    lens: list[int],
    *,
    page_size: int = 16,
    heads: int = 4,
    dim: int = 128,
    dtype: torch.dtype = torch.float16,
    kv_scales: tuple[tuple[float, float], ...] | None = None,
) -> KVSnapshot:
    """A batch whose later sequences share sequence 0's first page (a prefix), pages shuffled, spare pages."""
    return make_snapshot(
        lens,
        page_size=page_size,
        heads=heads,
        dim=dim,
        dtype=dtype,
        kv_scales=kv_scales,
        spare_pages=3,
        shuffle=True,
        scale=1.0,
    )


def decode(
    flashinfer: ModuleType,
    workspace: torch.Tensor,
    cache: FlashInferCache,
    q: torch.Tensor,
    *,
    use_tensor_cores: bool = False,
) -> torch.Tensor:
    cache.check(q)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, cache.kv_layout, use_tensor_cores=use_tensor_cores
    )
    wrapper.plan(*cache.decode_plan_args(q.shape[1]), **cache.plan_dtypes(q.dtype))
    out = wrapper.run(q, cache.paged_kv_cache, **cache.run_kwargs())
    assert isinstance(out, torch.Tensor)
    return out


LENS = [37, 16, 100, 5, 64]


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("combined", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [None, 1, 8, 32])
def test_batch_decode_equals_reference(
    flashinfer: ModuleType,
    workspace: torch.Tensor,
    kv_layout: str,
    combined: bool,
    dtype: torch.dtype,
    page_size: int | None,
) -> None:
    snap = snapshot(LENS, dtype=dtype)
    plan = plan_flashinfer(snap, page_size) if page_size else None
    q = torch.randn(len(LENS), 16, 128, dtype=dtype, device="cuda")  # GQA: 4 query heads per KV head
    for layer in range(snap.num_layers):
        cache = to_flashinfer(
            snap, layer, page_size=page_size, kv_layout=kv_layout, combined=combined, device="cuda", plan=plan
        )
        out = decode(flashinfer, workspace, cache, q)
        torch.testing.assert_close(out, reference_decode(q, cache), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_tensor_core_decode_equals_reference(flashinfer: ModuleType, workspace: torch.Tensor, kv_layout: str) -> None:
    snap = snapshot(LENS, dim=64)
    cache = to_flashinfer(snap, 0, kv_layout=kv_layout, device="cuda")
    q = torch.randn(len(LENS), 8, 64, dtype=torch.float16, device="cuda")
    out = decode(flashinfer, workspace, cache, q, use_tensor_cores=True)
    torch.testing.assert_close(out, reference_decode(q, cache), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_passthrough_with_scales(flashinfer: ModuleType, workspace: torch.Tensor, fp8: torch.dtype) -> None:
    snap = snapshot(LENS, dtype=fp8, kv_scales=((0.5, 2.0), (1.5, 0.25)))
    q = torch.randn(len(LENS), 8, 128, dtype=torch.float16, device="cuda")
    for layer in range(snap.num_layers):
        cache = to_flashinfer(snap, layer, dtype=fp8, device="cuda")
        assert cache.run_kwargs()
        out = decode(flashinfer, workspace, cache, q)
        torch.testing.assert_close(out, reference_decode(q, cache), atol=5e-2, rtol=5e-2)
        # The same layer dequantized on import gives the same attention.
        real = to_flashinfer(snap, layer, dtype=torch.float16, device="cuda")
        out_real = decode(flashinfer, workspace, real, q)
        torch.testing.assert_close(out, out_real, atol=5e-2, rtol=5e-2)


def test_batch_prefill_one_query_per_request_equals_reference(flashinfer: ModuleType, workspace: torch.Tensor) -> None:
    snap = snapshot(LENS)
    cache = to_flashinfer(snap, 1, page_size=8, kv_layout="HND", device="cuda")
    q = torch.randn(len(LENS), 8, 128, dtype=torch.float16, device="cuda")
    qo_indptr = torch.arange(len(LENS) + 1, dtype=torch.int32, device="cuda")
    cache.check(q, qo_indptr=qo_indptr)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, cache.kv_layout)
    wrapper.plan(*cache.prefill_plan_args(qo_indptr, q.shape[1]), causal=False, **cache.plan_dtypes(q.dtype))
    out = wrapper.run(q, cache.paged_kv_cache)
    torch.testing.assert_close(out, reference_decode(q, cache), atol=2e-2, rtol=2e-2)


def test_empty_request_decodes_to_zeros(flashinfer: ModuleType, workspace: torch.Tensor) -> None:
    snap = snapshot([40, 0, 17])
    cache = to_flashinfer(snap, 0, device="cuda")
    assert cache.paged_kv_last_page_len.tolist() == [8, 0, 1]
    q = torch.randn(3, 4, 128, dtype=torch.float16, device="cuda")
    out = decode(flashinfer, workspace, cache, q)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out, reference_decode(q, cache), atol=2e-2, rtol=2e-2)
