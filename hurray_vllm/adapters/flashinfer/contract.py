"""FlashInfer's argument rules, mirrored from its source and checked before anything reaches CUDA."""

from __future__ import annotations

import torch

from ...errors import HurrayArgumentError
from .._common import FP8_DTYPES as _FP8
from .cache import KERNEL_KV_DTYPES, LAYOUTS, PagedKVCache

__all__ = ["check_flashinfer_args"]


def check_flashinfer_args(
    paged_kv_indptr: torch.Tensor,
    paged_kv_indices: torch.Tensor,
    paged_kv_last_page_len: torch.Tensor,
    paged_kv_cache: PagedKVCache,
    *,
    kv_layout: str = "NHD",
    page_size: int | None = None,
    num_qo_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    q: torch.Tensor | None = None,
    qo_indptr: torch.Tensor | None = None,
    q_data_type: torch.dtype | None = None,
    kv_data_type: torch.dtype | None = None,
    strict_dtypes: bool = True,
    use_tensor_cores: bool = False,
) -> None:
    """Raise if these arguments break what FlashInfer's paged wrappers expect.

    Mirrors ``BatchDecodeWithPagedKVCacheWrapper.plan``/``run`` (and, with
    ``qo_indptr``, ``BatchPrefillWithPagedKVCacheWrapper.plan``/``run``).
    FlashInfer itself checks little of this on the host: a wrong index reads
    out of bounds on the device, which is why it is checked here.

    Args:
        paged_kv_indptr: int32 ``[batch_size + 1]``, contiguous, ``[0] == 0``,
            non-decreasing, ``[-1] == paged_kv_indices.numel()``; any device.
        paged_kv_indices: int32 ``[paged_kv_indptr[-1]]``, contiguous, every
            id in ``[0, num_pages)``; any device.
        paged_kv_last_page_len: int32 ``[batch_size]``, contiguous;
            ``1..page_size`` for a request with pages, ``0`` for one without
            (see the module docstring); any device.
        paged_kv_cache: ``(k_cache, v_cache)``, two 4-D tensors of one shape,
            dtype, strides and device, ``[num_pages, page_size, num_kv_heads,
            head_dim]`` for ``"NHD"`` or ``[num_pages, num_kv_heads,
            page_size, head_dim]`` for ``"HND"``; or one 5-D tensor
            ``[num_pages, 2, ...]``. Last dimension contiguous.
        kv_layout: ``"NHD"`` or ``"HND"``, the wrapper's layout.
        page_size: the page size given to ``plan``, checked against the
            cache's shape when given.
        num_kv_heads: the KV head count given to ``plan``, checked against
            the cache's shape when given.
        head_dim: the head size given to ``plan``, checked against the
            cache's shape when given.
        num_qo_heads: query heads, a positive multiple of the KV heads;
            taken from ``q`` when omitted.
        q: decode: ``[batch_size, num_qo_heads, head_dim]``; prefill (with
            ``qo_indptr``): ``[qo_indptr[-1], num_qo_heads, head_dim]``, last
            dimension contiguous; on the cache's device.
        qo_indptr: int32 ``[batch_size + 1]``, contiguous, ``[0] == 0``,
            non-decreasing (prefill only).
        q_data_type: the query dtype given to ``plan``, checked against ``q``
            (without ``q``, against the cache dtype like a query's).
        kv_data_type: the cache dtype given to ``plan``, checked against the
            cache.
        strict_dtypes: also require dtypes FlashInfer has kernels for: a
            float16, bfloat16 or float8 cache; a float16/bfloat16 query equal
            to the cache dtype (or, for a float8 cache, float16, bfloat16 or
            the cache's float8 type). ``False`` accepts any floating dtype
            (what :func:`reference_decode` computes with).
        use_tensor_cores: the decode wrapper's ``use_tensor_cores``. Without
            it (the default), decode (no ``qo_indptr``) runs the CUDA-core
            kernel, which has instances for ``num_qo_heads / num_kv_heads``
            in 1, 2, 3, 4, 6, 8 only; the tensor-core (prefill) kernels take
            any group size.

    Raises:
        HurrayArgumentError: the first broken rule; ``field`` names the argument.
    """
    if kv_layout not in LAYOUTS:
        raise HurrayArgumentError("kv_layout", f"must be 'NHD' or 'HND', got {kv_layout!r}")
    k_cache, _ = _check_cache(paged_kv_cache)
    if kv_layout == "NHD":
        num_pages, cache_page_size, cache_heads, cache_dim = k_cache.shape
    else:
        num_pages, cache_heads, cache_page_size, cache_dim = k_cache.shape
    for name, given, actual in (
        ("page_size", page_size, cache_page_size),
        ("num_kv_heads", num_kv_heads, cache_heads),
        ("head_dim", head_dim, cache_dim),
    ):
        if given is not None and given != actual:
            raise HurrayArgumentError(
                name, f"{name}={given} but the {kv_layout} cache {list(k_cache.shape)} has {actual}"
            )
    if cache_page_size <= 0 or cache_heads <= 0 or cache_dim <= 0:
        raise HurrayArgumentError("paged_kv_cache", f"empty page, head or head_dim axis in {list(k_cache.shape)}")

    kv_dtype = k_cache.dtype
    if kv_data_type is not None and kv_data_type != kv_dtype:
        raise HurrayArgumentError("kv_data_type", f"kv_data_type={kv_data_type} but the cache is {kv_dtype}")
    if not kv_dtype.is_floating_point:
        raise HurrayArgumentError("paged_kv_cache", f"cache dtype {kv_dtype} is not floating point")
    if strict_dtypes and kv_dtype not in KERNEL_KV_DTYPES:
        raise HurrayArgumentError(
            "paged_kv_cache",
            f"FlashInfer has no paged kernels for {kv_dtype} caches (float16, bfloat16, float8_e4m3fn, float8_e5m2)",
        )

    indptr = _index_array("paged_kv_indptr", paged_kv_indptr)
    indices = _index_array("paged_kv_indices", paged_kv_indices)
    last = _index_array("paged_kv_last_page_len", paged_kv_last_page_len)
    if indptr.numel() < 1:
        raise HurrayArgumentError("paged_kv_indptr", "needs batch_size + 1 >= 1 entries")
    batch = indptr.numel() - 1
    _check_indptr("paged_kv_indptr", indptr)
    if int(indptr[-1]) != indices.numel():
        raise HurrayArgumentError(
            "paged_kv_indptr", f"ends at {int(indptr[-1])} but paged_kv_indices has {indices.numel()} entries"
        )
    if indices.numel() and not (0 <= int(indices.min()) and int(indices.max()) < num_pages):
        raise HurrayArgumentError(
            "paged_kv_indices",
            f"page ids span [{int(indices.min())}, {int(indices.max())}], the cache has {num_pages} pages",
        )
    if last.numel() != batch:
        raise HurrayArgumentError("paged_kv_last_page_len", f"{last.numel()} entries for a batch of {batch}")
    pages = (indptr[1:] - indptr[:-1]).to(last.device)
    has = pages > 0
    bad = (has & ((last < 1) | (last > cache_page_size))) | (~has & (last != 0))
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0, 0])
        rule = f"1..{cache_page_size}" if bool(has[b]) else "0 (the request has no pages)"
        raise HurrayArgumentError(
            "paged_kv_last_page_len", f"request {b} has last_page_len {int(last[b])}, must be {rule}"
        )

    if qo_indptr is not None:
        qo = _index_array("qo_indptr", qo_indptr)
        if qo.numel() != batch + 1:
            raise HurrayArgumentError("qo_indptr", f"{qo.numel()} entries, the batch needs {batch + 1}")
        _check_indptr("qo_indptr", qo)
    if q is None:
        if num_qo_heads is not None:
            _check_group(num_qo_heads, cache_heads, decode_cuda_cores=qo_indptr is None and not use_tensor_cores)
        if q_data_type is not None:
            _check_q_dtype("q_data_type", q_data_type, kv_dtype, strict_dtypes)
        return
    if q.dim() != 3:
        raise HurrayArgumentError("q", f"must be [tokens, num_qo_heads, head_dim], got {list(q.shape)}")
    rows = batch if qo_indptr is None else int(qo_indptr[-1])
    if q.shape[0] != rows or q.shape[2] != cache_dim:
        want = "batch_size" if qo_indptr is None else "qo_indptr[-1]"
        raise HurrayArgumentError(
            "q", f"shape {list(q.shape)}, expected [{rows} ({want}), num_qo_heads, {cache_dim} (head_dim)]"
        )
    if num_qo_heads is not None and q.shape[1] != num_qo_heads:
        raise HurrayArgumentError("num_qo_heads", f"num_qo_heads={num_qo_heads} but q has {q.shape[1]} heads")
    _check_group(int(q.shape[1]), cache_heads, decode_cuda_cores=qo_indptr is None and not use_tensor_cores)
    if q.stride(-1) != 1:
        # The kernels take only q's token and head strides and load head_dim as one dense vector: any other
        # layout reads other elements (past the tensor's end, too) with no error on the host.
        raise HurrayArgumentError(
            "q",
            f"head_dim must be q's contiguous (stride 1) dimension, q has strides {q.stride()}; pass q.contiguous()",
        )
    if q.device != k_cache.device:
        raise HurrayArgumentError("q", f"q is on {q.device}, the cache on {k_cache.device}")
    if q_data_type is not None and q_data_type != q.dtype:
        raise HurrayArgumentError("q_data_type", f"q_data_type={q_data_type} but q is {q.dtype}")
    _check_q_dtype("q", q.dtype, kv_dtype, strict_dtypes)


def _check_cache(cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(cache, torch.Tensor):
        if cache.dim() != 5 or cache.shape[1] != 2:
            raise HurrayArgumentError(
                "paged_kv_cache", f"a single cache tensor must be [num_pages, 2, ...] (5-D), got {list(cache.shape)}"
            )
        k, v = cache[:, 0], cache[:, 1]
    elif isinstance(cache, tuple) and len(cache) == 2 and all(isinstance(t, torch.Tensor) for t in cache):
        k, v = cache
        if k.dim() != 4:
            raise HurrayArgumentError("paged_kv_cache", f"k_cache must be 4-D, got {list(k.shape)}")
        if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
            raise HurrayArgumentError(
                "paged_kv_cache",
                f"k_cache {list(k.shape)} {k.dtype} {k.device} and v_cache {list(v.shape)} {v.dtype} {v.device} differ",
            )
    else:
        raise HurrayArgumentError("paged_kv_cache", "must be a tensor or a (k_cache, v_cache) tuple of tensors")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise HurrayArgumentError("paged_kv_cache", "head_dim must be the contiguous (stride 1) dimension")
    if k.stride() != v.stride():
        # The kernels take one set of strides for both pools: TORCH_CHECK(k_strides == v_strides) in their run().
        raise HurrayArgumentError(
            "paged_kv_cache",
            f"k_cache strides {k.stride()} and v_cache strides {v.stride()} differ; FlashInfer requires identical "
            "k/v strides: pass two caches of one layout (for example both .contiguous())",
        )
    return k, v


def _index_array(name: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise HurrayArgumentError(name, f"must be an int32 tensor, got {got}")
    if t.dim() != 1:
        raise HurrayArgumentError(name, f"must be 1-D, got shape {list(t.shape)}")
    if not t.is_contiguous():
        # plan() hands the kernels data_ptr(): a strided view would be read as if it were dense.
        raise HurrayArgumentError(name, f"must be contiguous, has stride {t.stride()}; pass {name}.contiguous()")
    return t


def _check_indptr(name: str, indptr: torch.Tensor) -> None:
    if int(indptr[0]) != 0:
        raise HurrayArgumentError(name, f"must start at 0, starts at {int(indptr[0])}")
    if indptr.numel() > 1 and bool((indptr[1:] < indptr[:-1]).any()):
        raise HurrayArgumentError(name, "must be non-decreasing")


#: GQA group sizes the CUDA-core decode kernel is compiled for (DISPATCH_GQA_GROUP_SIZE in
#: include/flashinfer/utils.cuh); BatchDecodeWithPagedKVCacheWrapper.plan fails with "Unsupported group_size"
#: for any other unless use_tensor_cores=True.
DECODE_GQA_GROUP_SIZES = (1, 2, 3, 4, 6, 8)


def _check_group(num_qo_heads: int, num_kv_heads: int, *, decode_cuda_cores: bool) -> None:
    if num_qo_heads <= 0 or num_qo_heads % num_kv_heads:
        raise HurrayArgumentError(
            "num_qo_heads", f"{num_qo_heads} query heads is not a positive multiple of {num_kv_heads} KV heads"
        )
    group = num_qo_heads // num_kv_heads
    if decode_cuda_cores and group not in DECODE_GQA_GROUP_SIZES:
        raise HurrayArgumentError(
            "num_qo_heads",
            f"{num_qo_heads} query heads over {num_kv_heads} KV heads is a group size of {group}; FlashInfer's "
            f"CUDA-core decode kernel only has group sizes {', '.join(map(str, DECODE_GQA_GROUP_SIZES))}: create "
            "BatchDecodeWithPagedKVCacheWrapper(..., use_tensor_cores=True) and check with "
            "check_flashinfer_args(..., use_tensor_cores=True)",
        )


def _check_q_dtype(field: str, q_dtype: torch.dtype, kv_dtype: torch.dtype, strict: bool) -> None:
    if not q_dtype.is_floating_point:
        raise HurrayArgumentError(field, f"query dtype {q_dtype} is not floating point")
    if not strict:
        return
    allowed = (torch.float16, torch.bfloat16, kv_dtype) if kv_dtype in _FP8 else (kv_dtype,)
    if q_dtype not in allowed:
        raise HurrayArgumentError(
            field, f"query dtype {q_dtype} with a {kv_dtype} cache; FlashInfer expects {' or '.join(map(str, allowed))}"
        )
