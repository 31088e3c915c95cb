"""FlashInfer adapter: one snapshot layer as FlashInfer's paged-KV arguments.

FlashInfer's batch attention wrappers (``BatchDecodeWithPagedKVCacheWrapper``,
``BatchPrefillWithPagedKVCacheWrapper``) take a batch's KV as a page pool plus
three int32 CSR arrays: ``paged_kv_indptr`` (pages per request, cumulated),
``paged_kv_indices`` (the page ids, request after request) and
``paged_kv_last_page_len`` (tokens in each request's last page). A Hurray
block-paged tensor is the same structure with int64 indices and explicit
sequence lengths, so importing is mostly a narrowing, plus the optional
repaging, dequantization, layout change and device move FlashInfer needs.

Nothing here imports FlashInfer. Its argument rules are mirrored from its
source (``flashinfer/decode.py``, ``flashinfer/prefill.py``,
``flashinfer/page.py``, ``include/flashinfer/page.cuh``,
``include/flashinfer/attention/state.cuh``) by :func:`check_flashinfer_args`,
and :func:`reference_decode` computes what batch decode returns, so both can
be used on a machine without CUDA.

Empty requests: FlashInfer's kernels read a request's length as
``0`` when it has no pages (``paged_kv_t::get_length``) and its planner as
``max(num_pages - 1, 0) * page_size + last_page_len`` (``get_seq_lens``);
both agree only with ``last_page_len = 0``. An empty sequence is therefore
imported as ``indptr[s] == indptr[s + 1]`` and ``last_page_len[s] == 0``;
decode returns zeros for it (the attention state starts at ``o = 0``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import HurrayArgumentError, HurrayFormatError
from ..kv.paged import BlockPagedTensor
from ..kv.repage import RepagePlan, check_out_pool, on_device, plan_repage, repage, repage_into
from ..kv.snapshot import KVSnapshot
from ._common import FP8_DTYPES as _FP8
from ._common import INT32_MAX as _INT32_MAX
from ._common import check_layer, dequantize

__all__ = [
    "FlashInferCache",
    "check_flashinfer_args",
    "plan_flashinfer",
    "plan_flashinfer_repage",
    "reference_decode",
    "to_flashinfer",
    "to_flashinfer_all",
]

PagedKVCache = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

_LAYOUTS = ("NHD", "HND")
#: KV dtypes FlashInfer's paged kernels are compiled for
#: (``DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16_FP8`` in ``csrc/tvm_ffi_utils.h``).
_KERNEL_KV_DTYPES = (torch.float16, torch.bfloat16, *_FP8)


# ── the imported cache ───────────────────────────────────────────────────────


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
        return _unpack(self.paged_kv_cache)[0]

    @property
    def v_cache(self) -> torch.Tensor:
        """The value pages in :attr:`kv_layout` (a view when combined)."""
        return _unpack(self.paged_kv_cache)[1]

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
    ) -> None:
        """:func:`check_flashinfer_args` on this cache (and ``q``, if given)."""
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
        )


def _unpack(cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    # Mirrors flashinfer.utils._unpack_paged_kv_cache: a 5-D tensor splits on dim 1.
    if isinstance(cache, torch.Tensor):
        return cache[:, 0], cache[:, 1]
    return cache[0], cache[1]


# ── importing ────────────────────────────────────────────────────────────────


def plan_flashinfer(snapshot: KVSnapshot, page_size: int) -> RepagePlan | None:
    """The repaging plan every layer of ``snapshot`` shares, for ``page_size``.

    Returns ``None`` when the snapshot already has pages of ``page_size``
    (nothing to repage). Pass the result to :func:`to_flashinfer` as
    ``plan=`` for each layer so the plan is computed once per batch
    (:func:`to_flashinfer_all` does).
    """
    if not snapshot.keys:
        raise HurrayFormatError("snapshot.layers", "the snapshot has no layers")
    k0 = snapshot.keys[0]
    if k0.page_size == page_size:
        return None
    lens = _require_lens(k0)
    return plan_repage(k0.block_table, k0.seq_ptr, lens, k0.page_size, page_size)


def plan_flashinfer_repage(snapshot: KVSnapshot, page_size: int) -> RepagePlan | None:
    """Deprecated name of :func:`plan_flashinfer` (same arguments, same result)."""
    warnings.warn(
        "plan_flashinfer_repage is deprecated; use plan_flashinfer",
        DeprecationWarning,
        stacklevel=2,
    )
    return plan_flashinfer(snapshot, page_size)


def to_flashinfer_all(
    snapshot: KVSnapshot,
    *,
    page_size: int | None = None,
    kv_layout: str = "NHD",
    combined: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    out: Sequence[PagedKVCache] | None = None,
) -> tuple[FlashInferCache, ...]:
    """Every layer of ``snapshot`` (see :func:`to_flashinfer`), repaging planned once.

    Args:
        snapshot: as for :func:`to_flashinfer`, with at least one layer.
        page_size: FlashInfer's page size for every layer; ``None`` keeps the
            snapshot's. When it differs, the repaging is planned once and
            reused for every layer.
        kv_layout: ``"NHD"`` or ``"HND"``, as for :func:`to_flashinfer`.
        combined: one ``[num_pages, 2, ...]`` tensor per layer instead of a
            ``(k, v)`` tuple, as for :func:`to_flashinfer`.
        device: where every layer's result goes, as for :func:`to_flashinfer`.
        dtype: the page dtype of every layer, as for :func:`to_flashinfer`.
        out: one preallocated cache per layer (see :func:`to_flashinfer`).

    Returns:
        One :class:`FlashInferCache` per layer, in layer order, all built
        from one :func:`plan_flashinfer` plan.

    Raises:
        HurrayArgumentError: ``kv_layout`` or ``page_size`` out of range.
        HurrayFormatError: the snapshot does not fit, or ``out`` does not
            hold one cache per layer.
    """
    if out is not None and len(out) != snapshot.num_layers:
        raise HurrayFormatError("out", f"has {len(out)} caches for {snapshot.num_layers} layers")
    if not snapshot.keys:
        raise HurrayFormatError("snapshot.layers", "the snapshot has no layers")
    if page_size is not None and page_size <= 0:
        raise HurrayArgumentError("page_size", f"must be positive, got {page_size}")
    plan = plan_flashinfer(snapshot, page_size) if page_size is not None else None
    return tuple(
        to_flashinfer(
            snapshot,
            i,
            page_size=page_size if plan is None else None,
            kv_layout=kv_layout,
            combined=combined,
            device=device,
            dtype=dtype,
            plan=plan,
            out=None if out is None else out[i],
        )
        for i in range(snapshot.num_layers)
    )


def to_flashinfer(
    snapshot: KVSnapshot,
    layer: int,
    *,
    page_size: int | None = None,
    kv_layout: str = "NHD",
    combined: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    plan: RepagePlan | None = None,
    out: PagedKVCache | None = None,
) -> FlashInferCache:
    """Layer ``layer`` of ``snapshot`` as FlashInfer paged-KV arguments.

    Args:
        snapshot: a batch with sequence lengths; key and value of ``layer``
            must share one block structure. Its page pools
            (``[num_pages, page_size, num_kv_heads, head_dim]``, contiguous)
            are float16, bfloat16, float32 or float8 (``kv_scales`` give the
            scales, ``None`` meaning 1.0); affine-quantized pools are refused.
        layer: ``0 <= layer < snapshot.num_layers``.
        page_size: FlashInfer's page size; when it differs from the
            snapshot's, the batch is repaged (shared prefixes stay shared
            wherever they cover whole pages). ``None`` keeps the snapshot's
            (or takes ``plan``'s).
        kv_layout: ``"NHD"`` (pages ``[num_pages, page_size, H, D]``) or
            ``"HND"`` (``[num_pages, H, page_size, D]``); the wrapper must be
            constructed with the same.
        combined: one ``[num_pages, 2, ...]`` tensor instead of a
            ``(k, v)`` tuple.
        device: where the result goes, moved last (every intermediate
            stays on the snapshot's device). ``None`` keeps it there.
        dtype: the page dtype. ``None`` keeps the source dtype, except that
            float8 pages are dequantized to float32. A float8 ``dtype``
            equal to the source's passes the pages through unchanged and
            reports the scales in ``k_scale``/``v_scale``; any other
            ``dtype`` gets real values (``stored.float() * scale`` for
            float8 sources). Quantizing to float8 is refused: it needs
            calibrated scales this library does not choose.
        plan: a :class:`RepagePlan` for this snapshot's block structure (from
            :func:`plan_flashinfer`), reused across layers.
        out: a preallocated cache to import into, shaped like the result's
            ``paged_kv_cache`` (a ``(k_cache, v_cache)`` tuple, or one
            ``[num_pages, 2, ...]`` tensor when ``combined``) in
            ``kv_layout``, with at least as many pages as the import needs,
            the result's dtype, and the device the result goes to. Its first
            pages are overwritten, the rest is left as it is, and the result
            holds ``out`` itself. A pool reused across imports (or an
            engine's own) saves faulting in new memory, about twice the cost
            of the copy itself on a CPU.

    Returns:
        A :class:`FlashInferCache`. With ``out``, its pages are ``out``.
        Otherwise, without repaging, conversion or layout change, the pages
        are the snapshot's own tensors (no copy).

    Raises:
        HurrayArgumentError: ``kv_layout`` or ``page_size`` is out of range.
        HurrayFormatError: the snapshot (or ``plan``, ``out``, ``dtype`` for
            its pools) does not fit.

    Example:
        One layer, repaged to 16-token pages in the HND layout, checked as
        FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper.plan`` would, then
        the float32 reference decode:

        >>> import torch
        >>> from hurray_vllm.app.demo import spec_example_snapshot
        >>> snap = spec_example_snapshot()  # sequences of 6 and 3 tokens, 2 KV heads of 8, float16
        >>> plan = plan_flashinfer(snap, 16)
        >>> cache = to_flashinfer(snap, 0, page_size=16, kv_layout="HND", dtype=torch.float16, plan=plan)
        >>> cache.k_cache.shape  # [num_pages, num_kv_heads, page_size, head_dim]
        torch.Size([2, 2, 16, 8])
        >>> cache.paged_kv_indptr  # int32 [batch_size + 1]
        tensor([0, 1, 2], dtype=torch.int32)
        >>> q = torch.randn(2, 2, 8, dtype=torch.float16)  # [batch_size, num_qo_heads, head_dim]
        >>> cache.check(q)
        >>> reference_decode(q, cache).shape
        torch.Size([2, 2, 8])
    """
    if kv_layout not in _LAYOUTS:
        raise HurrayArgumentError("kv_layout", f"must be 'NHD' or 'HND', got {kv_layout!r}")
    check_layer(snapshot, layer)
    k, v = snapshot.keys[layer], snapshot.values[layer]
    lens = _check_source(k, v)
    scales = _layer_scales(snapshot, layer)

    if plan is None and page_size is not None and page_size != k.page_size:
        if page_size <= 0:
            raise HurrayArgumentError("page_size", f"must be positive, got {page_size}")
        plan = plan_repage(k.block_table, k.seq_ptr, lens, k.page_size, page_size)
    elif plan is not None:
        if page_size is not None and plan.page_size != page_size:
            raise HurrayFormatError("plan", f"the plan repages to {plan.page_size}, page_size is {page_size}")
        _check_plan(plan, k, lens)
    num_pages = plan.num_pages if plan is not None else k.num_pages
    table = plan.block_table if plan is not None else k.block_table
    ptr = plan.seq_ptr if plan is not None else k.seq_ptr
    ps = plan.page_size if plan is not None else k.page_size
    if num_pages > _INT32_MAX or table.numel() > _INT32_MAX:
        raise HurrayFormatError("paged_kv_indices", "page ids and counts must fit FlashInfer's int32 indices")

    if out is not None:
        cache: PagedKVCache = out
        k_scale, v_scale = _import_into(k, v, plan, scales, dtype, out, kv_layout, combined, num_pages, device)
    else:
        if plan is not None:
            k, v = repage(k, plan.page_size, plan), repage(v, plan.page_size, plan)
        kp, k_scale = _convert(k.page_pool, scales[0], dtype)
        vp, v_scale = _convert(v.page_pool, scales[1], dtype)
        cache = _arrange(kp, vp, kv_layout, combined)

    last = torch.where(lens > 0, (lens - 1) % ps + 1, torch.zeros_like(lens))
    indptr = ptr.to(torch.int32)
    indices = table.to(torch.int32)
    last_page_len = last.to(torch.int32)
    if device is not None:
        if out is None:
            cache = _move(cache, device)
        indptr, indices, last_page_len = (t.to(device) for t in (indptr, indices, last_page_len))
    return FlashInferCache(
        paged_kv_cache=cache,
        paged_kv_indptr=indptr,
        paged_kv_indices=indices,
        paged_kv_last_page_len=last_page_len,
        kv_layout=kv_layout,
        k_scale=k_scale,
        v_scale=v_scale,
        layer=layer,
    )


def _require_lens(t: BlockPagedTensor) -> torch.Tensor:
    if t.seq_lens is None:
        raise HurrayFormatError(
            "seq_lens", "FlashInfer needs each sequence's length (last_page_len), which this snapshot does not carry"
        )
    return t.seq_lens.to(device=t.block_table.device, dtype=torch.int64)


def _check_source(k: BlockPagedTensor, v: BlockPagedTensor) -> torch.Tensor:
    """The layer's sequence lengths, after the checks the import relies on."""
    lens = _require_lens(k)
    if k.quantization is not None or v.quantization is not None:
        raise HurrayFormatError(
            "quantization", "affine-quantized page pools are not supported; dequantize the snapshot first"
        )
    if k.page_pool.shape != v.page_pool.shape or k.dtype != v.dtype:
        raise HurrayFormatError(
            "snapshot.structure",
            f"key pool {list(k.page_pool.shape)} {k.dtype} and value pool {list(v.page_pool.shape)} {v.dtype} differ",
        )
    if not (torch.equal(k.block_table, v.block_table) and torch.equal(k.seq_ptr, v.seq_ptr)):
        raise HurrayFormatError("snapshot.structure", "key and value have different block tables")
    if not (k.dtype.is_floating_point and k.dtype.itemsize <= 4):
        raise HurrayFormatError("dtype", f"FlashInfer pages hold floating-point values, not {k.dtype}")
    # The CSR arrays are used as they are, so they must describe exactly the
    # pages each sequence needs: an extra page would count as page_size tokens.
    counts = k.seq_ptr[1:] - k.seq_ptr[:-1]
    if k.seq_ptr.numel() == 0 or int(k.seq_ptr[0]) != 0 or int(k.seq_ptr[-1]) != k.block_table.numel():
        raise HurrayFormatError("seq_ptr", "seq_ptr must start at 0 and end at the block table's length")
    if lens.numel() != counts.numel() or bool((lens < 0).any()):
        raise HurrayFormatError(
            "seq_lens", f"{lens.numel()} non-negative lengths needed for {counts.numel()} sequences"
        )
    need = (lens + k.page_size - 1) // k.page_size
    if not torch.equal(need, counts):
        s = int(torch.nonzero(need != counts)[0, 0])
        raise HurrayFormatError(
            "seq_lens.pages",
            f"sequence {s} has {int(lens[s])} tokens (needs {int(need[s])} pages of {k.page_size}) "
            f"but owns {int(counts[s])}",
        )
    if k.block_table.numel() and not (0 <= int(k.block_table.min()) and int(k.block_table.max()) < k.num_pages):
        raise HurrayFormatError("block_table", f"page ids must lie in [0, {k.num_pages})")
    return lens


def _layer_scales(snapshot: KVSnapshot, layer: int) -> tuple[float, float]:
    if snapshot.kv_scales is None:
        # The snapshot's contract: no scales means an unscaled cache.
        return 1.0, 1.0
    if len(snapshot.kv_scales) != snapshot.num_layers:
        raise HurrayFormatError(
            "snapshot.kv_scales", f"{len(snapshot.kv_scales)} scale pairs for {snapshot.num_layers} layers"
        )
    ks, vs = snapshot.kv_scales[layer]
    return float(ks), float(vs)


def _check_plan(plan: RepagePlan, k: BlockPagedTensor, lens: torch.Tensor) -> None:
    # A plan for another batch would gather the wrong slots without any error;
    # these checks are cheap and catch a plan reused across snapshots.
    if plan.page_size <= 0 or plan.seq_ptr.numel() != k.seq_ptr.numel():
        raise HurrayFormatError("plan", f"the plan is for {plan.seq_ptr.numel() - 1} sequences, not {k.num_seqs}")
    if not torch.equal(plan.seq_lens.to(lens.device), lens):
        raise HurrayFormatError("plan", "the plan was made for other sequence lengths")
    if plan.src_slots.numel() and int(plan.src_slots.max()) >= k.num_pages * k.page_size:
        raise HurrayFormatError("plan", "the plan reads slots past this snapshot's page pool")


def _convert(pool: torch.Tensor, scale: float, dtype: torch.dtype | None) -> tuple[torch.Tensor, float | None]:
    """``pool`` in ``dtype``, and the scale FlashInfer must still apply (float8 pass-through)."""
    if pool.dtype in _FP8:
        if dtype == pool.dtype:
            return pool, scale
        if dtype in _FP8:
            raise HurrayFormatError(
                "dtype", f"cannot re-encode {pool.dtype} pages as {dtype}; keep {pool.dtype} or dequantize"
            )
        real = dequantize(pool, scale)
        return (real if dtype is None else real.to(dtype)), None
    if dtype is None or dtype == pool.dtype:
        return pool, None
    if dtype in _FP8:
        raise HurrayFormatError(
            "dtype",
            f"quantizing {pool.dtype} pages to {dtype} needs calibrated scales; hurray-vllm does not choose them",
        )
    if not dtype.is_floating_point:
        raise HurrayFormatError("dtype", f"FlashInfer pages hold floating-point values, not {dtype}")
    return pool.to(dtype), None


def _target_dtype(src: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The page dtype :func:`_convert` produces for ``src`` pages and the asked ``dtype``."""
    if dtype is not None:
        return dtype
    return torch.float32 if src in _FP8 else src


def _import_into(
    k: BlockPagedTensor,
    v: BlockPagedTensor,
    plan: RepagePlan | None,
    scales: tuple[float, float],
    dtype: torch.dtype | None,
    out: PagedKVCache,
    kv_layout: str,
    combined: bool,
    num_pages: int,
    device: torch.device | str | None,
) -> tuple[float | None, float | None]:
    """Write the layer's (repaged, converted) pages into ``out``; the scales FlashInfer must still apply."""
    target = _target_dtype(k.dtype, dtype)
    heads, dim = k.num_heads, k.head_dim
    ps = plan.page_size if plan is not None else k.page_size
    page = (ps, heads, dim) if kv_layout == "NHD" else (heads, ps, dim)
    if combined:
        if not isinstance(out, torch.Tensor):
            raise HurrayFormatError("out", "combined=True takes one [num_pages, 2, ...] tensor")
        check_out_pool(out, num_pages, (2, *page), target, "out")
        dsts = [out[:num_pages, 0], out[:num_pages, 1]]
    else:
        if isinstance(out, torch.Tensor) or len(out) != 2:
            raise HurrayFormatError("out", "must be a (k_cache, v_cache) pair of tensors (or pass combined=True)")
        for i, o in enumerate(out):
            check_out_pool(o, num_pages, page, target, f"out[{i}]")
        dsts = [out[0][:num_pages], out[1][:num_pages]]
    pools = out if isinstance(out, tuple | list) else (out,)
    if device is not None and not all(on_device(o, device) for o in pools):
        where = sorted({str(o.device) for o in pools})
        raise HurrayFormatError("out", f"is on {', '.join(where)}, device= asks for {device}")
    if kv_layout == "HND":
        dsts = [d.transpose(1, 2) for d in dsts]  # NHD views of the HND pages
    result: list[float | None] = []
    for t, scale, dst in ((k, scales[0], dsts[0]), (v, scales[1], dsts[1])):
        if target == t.dtype:
            repage_into(t, plan, dst)
            result.append(scale if t.dtype in _FP8 else None)
        else:
            pool = repage(t, plan.page_size, plan).page_pool if plan is not None else t.page_pool
            converted, left = _convert(pool, scale, target)
            dst.copy_(converted)
            result.append(left)
    return result[0], result[1]


def _arrange(k: torch.Tensor, v: torch.Tensor, kv_layout: str, combined: bool) -> PagedKVCache:
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    if combined:
        return torch.stack((k, v), dim=1)  # one copy, contiguous
    if kv_layout == "HND":
        # FlashInfer derives strides from the tensor, but a dense HND pool is
        # what "HND" promises callers that index or copy the pages themselves.
        k, v = k.contiguous(), v.contiguous()
    return k, v


def _move(cache: PagedKVCache, device: torch.device | str) -> PagedKVCache:
    if isinstance(cache, torch.Tensor):
        return cache.to(device)
    return cache[0].to(device), cache[1].to(device)


# ── the argument contract ────────────────────────────────────────────────────


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
) -> None:
    """Raise if these arguments break what FlashInfer's paged wrappers expect.

    Mirrors ``BatchDecodeWithPagedKVCacheWrapper.plan``/``run`` (and, with
    ``qo_indptr``, ``BatchPrefillWithPagedKVCacheWrapper.plan``/``run``).
    FlashInfer itself checks little of this on the host: a wrong index reads
    out of bounds on the device, which is why it is checked here.

    Args:
        paged_kv_indptr: int32 ``[batch_size + 1]``, ``[0] == 0``,
            non-decreasing, ``[-1] == paged_kv_indices.numel()``; any device.
        paged_kv_indices: int32 ``[paged_kv_indptr[-1]]``, every id in
            ``[0, num_pages)``; any device.
        paged_kv_last_page_len: int32 ``[batch_size]``; ``1..page_size`` for
            a request with pages, ``0`` for one without (see the module
            docstring); any device.
        paged_kv_cache: ``(k_cache, v_cache)``, two 4-D tensors of one shape,
            dtype and device, ``[num_pages, page_size, num_kv_heads,
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
            ``qo_indptr``): ``[qo_indptr[-1], num_qo_heads, head_dim]``; on
            the cache's device.
        qo_indptr: int32 ``[batch_size + 1]``, ``[0] == 0``, non-decreasing
            (prefill only).
        q_data_type: the query dtype given to ``plan``, checked against ``q``
            (without ``q``, against the cache dtype like a query's).
        kv_data_type: the cache dtype given to ``plan``, checked against the
            cache.
        strict_dtypes: also require dtypes FlashInfer has kernels for: a
            float16, bfloat16 or float8 cache; a float16/bfloat16 query equal
            to the cache dtype (or, for a float8 cache, float16, bfloat16 or
            the cache's float8 type). ``False`` accepts any floating dtype
            (what :func:`reference_decode` computes with).

    Raises:
        HurrayArgumentError: the first broken rule; ``field`` names the argument.
    """
    if kv_layout not in _LAYOUTS:
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
    if strict_dtypes and kv_dtype not in _KERNEL_KV_DTYPES:
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
            _check_group(num_qo_heads, cache_heads)
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
    _check_group(int(q.shape[1]), cache_heads)
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
    return k, v


def _index_array(name: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise HurrayArgumentError(name, f"must be an int32 tensor, got {got}")
    if t.dim() != 1:
        raise HurrayArgumentError(name, f"must be 1-D, got shape {list(t.shape)}")
    return t


def _check_indptr(name: str, indptr: torch.Tensor) -> None:
    if int(indptr[0]) != 0:
        raise HurrayArgumentError(name, f"must start at 0, starts at {int(indptr[0])}")
    if indptr.numel() > 1 and bool((indptr[1:] < indptr[:-1]).any()):
        raise HurrayArgumentError(name, "must be non-decreasing")


def _check_group(num_qo_heads: int, num_kv_heads: int) -> None:
    if num_qo_heads <= 0 or num_qo_heads % num_kv_heads:
        raise HurrayArgumentError(
            "num_qo_heads", f"{num_qo_heads} query heads is not a positive multiple of {num_kv_heads} KV heads"
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


# ── reference computation ────────────────────────────────────────────────────


def reference_decode(
    q: torch.Tensor,
    cache: FlashInferCache,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """What FlashInfer's batch decode returns, computed in float32 torch.

    Equals ``wrapper.run(q, cache.paged_kv_cache, **cache.run_kwargs())``
    after ``wrapper.plan(*cache.decode_plan_args(num_qo_heads),
    sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
    **cache.plan_dtypes(q.dtype))`` (no positional encoding, no window),
    up to the kernel's rounding.

    Args:
        q: ``[batch_size, num_qo_heads, head_dim]``, any floating dtype, on
            the cache's device; ``num_qo_heads`` a multiple of the KV heads
            (query head ``h`` reads KV head ``h // (num_qo_heads //
            num_kv_heads)``).
        cache: the paged KV (checked with ``strict_dtypes=False``).
        sm_scale: logits scale, default ``1 / sqrt(head_dim)``.
        logits_soft_cap: if > 0, logits become ``cap * tanh(logits / cap)``.
        k_scale: the logits are multiplied by it, as FlashInfer does for
            float8 caches; default ``cache.k_scale`` (or 1.0).
        v_scale: the output is multiplied by it, as FlashInfer does for
            float8 caches; default ``cache.v_scale`` (or 1.0).
        out_dtype: the output dtype, default ``q.dtype``.

    Returns:
        ``[batch_size, num_qo_heads, head_dim]`` in ``out_dtype``; zeros
        for a request with no tokens.
    """
    cache.check(q, strict_dtypes=False)
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads, ps = cache.num_kv_heads, cache.page_size
    group = num_qo_heads // num_kv_heads
    scale = (1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale) * _or(k_scale, cache.k_scale)
    dev = q.device

    k_nhd, v_nhd = cache.k_cache, cache.v_cache
    if cache.kv_layout == "HND":
        k_nhd, v_nhd = k_nhd.transpose(1, 2), v_nhd.transpose(1, 2)
    lens = cache.seq_lens.to(dev, torch.int64)
    indptr = cache.paged_kv_indptr.to(dev, torch.int64)
    indices = cache.paged_kv_indices.to(dev, torch.int64)
    # Every request padded to the longest; padding is masked out below.
    t_max = int(lens.max()) if batch else 0
    t = torch.arange(t_max, device=dev)
    valid = t[None, :] < lens[:, None]  # [B, T]
    slot = torch.where(valid, indptr[:-1, None] + t[None, :] // ps, torch.zeros_like(valid, dtype=torch.int64))
    pages = indices[slot] if indices.numel() else torch.zeros_like(slot)
    offsets = (t % ps).expand_as(pages)
    keys = k_nhd[pages, offsets].float()  # [B, T, Hkv, D]
    values = v_nhd[pages, offsets].float()

    qg = q.float().reshape(batch, num_kv_heads, group, head_dim)
    logits = torch.einsum("bkgd,btkd->bkgt", qg, keys) * scale
    if logits_soft_cap is not None and logits_soft_cap > 0:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # An empty request's row is all -inf (softmax gives NaN); FlashInfer returns 0.
    probs = torch.where((lens > 0)[:, None, None, None], probs, torch.zeros_like(probs))
    out = torch.einsum("bkgt,btkd->bkgd", probs, values) * _or(v_scale, cache.v_scale)
    return out.reshape(batch, num_qo_heads, head_dim).to(out_dtype or q.dtype)


def _or(x: float | None, y: float | None) -> float:
    if x is not None:
        return x
    return 1.0 if y is None else y
