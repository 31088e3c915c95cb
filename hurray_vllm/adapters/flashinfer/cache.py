"""The imported cache: a layer's page pool and CSR arrays as FlashInfer's paged wrappers take them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import HurrayArgumentError
from .._common import FP8_DTYPES as _FP8

__all__ = ["FlashInferCache", "PagedKVCache", "LAYOUTS", "KERNEL_KV_DTYPES", "unpack_paged_kv_cache"]


PagedKVCache = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


#: The page layouts FlashInfer's wrappers take (``kv_layout``).
LAYOUTS = ("NHD", "HND")

#: KV dtypes FlashInfer's paged kernels are compiled for
#: (``DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16_FP8`` in ``csrc/tvm_ffi_utils.h``).
KERNEL_KV_DTYPES = (torch.float16, torch.bfloat16, *_FP8)


@dataclass(frozen=True, eq=False)
class FlashInferCache:
    """One layer's KV in the form FlashInfer's paged attention wrappers take.

    Attributes:
        paged_kv_cache: the page pool, either a ``(k_cache, v_cache)`` tuple
            of 4-D tensors, each ``[num_pages, page_size, num_kv_heads,
            head_dim]`` (``kv_layout="NHD"``) or ``[num_pages, num_kv_heads,
            page_size, head_dim]`` (``"HND"``), or one 5-D tensor
            ``[num_pages, 2, ...]`` whose ``[:, 0]`` is the key cache and
            ``[:, 1]`` the value cache. Dtype float16, bfloat16, float8 (with
            ``k_scale``/``v_scale``) or float32 (reference only: FlashInfer
            has no float32 KV kernels). Last dimension contiguous.
        paged_kv_indptr: int32 ``[batch_size + 1]``, starts at 0,
            non-decreasing; request ``b`` owns
            ``paged_kv_indices[paged_kv_indptr[b]:paged_kv_indptr[b + 1]]``.
        paged_kv_indices: int32 ``[paged_kv_indptr[-1]]``, page ids
            ``< num_pages``, in each request's logical order. A page may
            appear in several requests (a shared prefix).
        paged_kv_last_page_len: int32 ``[batch_size]``, tokens in each
            request's last page: ``1..page_size``, or ``0`` for a request
            with no pages.
        kv_layout: ``"NHD"`` or ``"HND"``, as given to the wrapper's
            constructor.
        k_scale, v_scale: for a float8 cache, the per-layer scales
            (``value = stored * scale``) to pass to the wrapper's ``run``
            (``run_kwargs()``); ``None`` when the pages hold real values.
        layer: the snapshot layer this came from, when known.
    """

    paged_kv_cache: PagedKVCache
    paged_kv_indptr: torch.Tensor
    paged_kv_indices: torch.Tensor
    paged_kv_last_page_len: torch.Tensor
    kv_layout: str = "NHD"
    k_scale: float | None = None
    v_scale: float | None = None
    layer: int | None = None

    # ── shape ──────────────────────────────────────────────────────────────

    @property
    def combined(self) -> bool:
        """Whether the cache is one ``[num_pages, 2, ...]`` tensor."""
        return isinstance(self.paged_kv_cache, torch.Tensor)

    @property
    def k_cache(self) -> torch.Tensor:
        """The key pages in :attr:`kv_layout` (a view when combined)."""
        return unpack_paged_kv_cache(self.paged_kv_cache)[0]

    @property
    def v_cache(self) -> torch.Tensor:
        """The value pages in :attr:`kv_layout` (a view when combined)."""
        return unpack_paged_kv_cache(self.paged_kv_cache)[1]

    @property
    def num_pages(self) -> int:
        """Number of pages in the pool."""
        return int(self.k_cache.shape[0])

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return int(self.k_cache.shape[1 if self.kv_layout == "NHD" else 2])

    @property
    def num_kv_heads(self) -> int:
        """Number of KV heads."""
        return int(self.k_cache.shape[2 if self.kv_layout == "NHD" else 1])

    @property
    def head_dim(self) -> int:
        """Head size, the pages' last dimension."""
        return int(self.k_cache.shape[3])

    @property
    def batch_size(self) -> int:
        """Number of requests in the batch."""
        return int(self.paged_kv_last_page_len.numel())

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the cache pages."""
        return self.k_cache.dtype

    @property
    def device(self) -> torch.device:
        """Device the cache pages are on."""
        return self.k_cache.device

    @property
    def seq_lens(self) -> torch.Tensor:
        """int32 ``[batch_size]``: tokens per request, as FlashInfer counts them."""
        pages = self.paged_kv_indptr[1:] - self.paged_kv_indptr[:-1]
        return ((pages - 1).clamp(min=0) * self.page_size + self.paged_kv_last_page_len).to(torch.int32)

    # ── FlashInfer call arguments ──────────────────────────────────────────

    def decode_plan_args(
        self, num_qo_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int, int]:
        """The positional arguments of ``BatchDecodeWithPagedKVCacheWrapper.plan``.

        ``(indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
        head_dim, page_size)``; add ``**plan_dtypes(q_dtype)``.
        """
        return (
            self.paged_kv_indptr,
            self.paged_kv_indices,
            self.paged_kv_last_page_len,
            num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
        )

    def prefill_plan_args(
        self, qo_indptr: torch.Tensor, num_qo_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int, int]:
        """The positional arguments of ``BatchPrefillWithPagedKVCacheWrapper.plan``.

        Args:
            qo_indptr: int32 ``[batch_size + 1]``, starts at 0,
                non-decreasing: request ``b``'s queries are rows
                ``qo_indptr[b]:qo_indptr[b + 1]`` of ``q``.
            num_qo_heads: query heads, a multiple of :attr:`num_kv_heads`.

        Returns ``(qo_indptr, paged_kv_indptr, paged_kv_indices,
        paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim,
        page_size)``; add ``causal=...`` and ``**plan_dtypes(q_dtype)``.
        """
        return (
            qo_indptr,
            self.paged_kv_indptr,
            self.paged_kv_indices,
            self.paged_kv_last_page_len,
            num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
        )

    def plan_dtypes(self, q_dtype: torch.dtype | None = None) -> dict[str, torch.dtype]:
        """``q_data_type`` and ``kv_data_type`` for ``plan``.

        ``q_dtype`` defaults to the cache dtype; a float8 cache needs it
        (the model's float16 or bfloat16).
        """
        if q_dtype is None:
            if self.dtype in _FP8:
                raise HurrayArgumentError(
                    "q_data_type", f"a {self.dtype} cache needs the query dtype (float16 or bfloat16)"
                )
            q_dtype = self.dtype
        return {"q_data_type": q_dtype, "kv_data_type": self.dtype}

    def run_kwargs(self) -> dict[str, float]:
        """``k_scale``/``v_scale`` for the wrapper's ``run`` (empty unless float8)."""
        out: dict[str, float] = {}
        if self.k_scale is not None:
            out["k_scale"] = self.k_scale
        if self.v_scale is not None:
            out["v_scale"] = self.v_scale
        return out

    def check(
        self,
        q: torch.Tensor | None = None,
        *,
        num_qo_heads: int | None = None,
        qo_indptr: torch.Tensor | None = None,
        strict_dtypes: bool = True,
        use_tensor_cores: bool = False,
    ) -> None:
        """:func:`check_flashinfer_args` on this cache (and ``q``, if given)."""
        from .contract import check_flashinfer_args  # the contract module reads this one's types

        check_flashinfer_args(
            self.paged_kv_indptr,
            self.paged_kv_indices,
            self.paged_kv_last_page_len,
            self.paged_kv_cache,
            kv_layout=self.kv_layout,
            num_qo_heads=num_qo_heads,
            q=q,
            qo_indptr=qo_indptr,
            strict_dtypes=strict_dtypes,
            use_tensor_cores=use_tensor_cores,
        )


def unpack_paged_kv_cache(cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_cache, v_cache)`` of a tuple or a combined 5-D pool."""
    # Mirrors flashinfer.utils._unpack_paged_kv_cache: a 5-D tensor splits on dim 1.
    if isinstance(cache, torch.Tensor):
        return cache[:, 0], cache[:, 1]
    return cache[0], cache[1]
