"""Planning and importing: a snapshot's layers narrowed, repaged, converted and laid out for FlashInfer."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from ...errors import HurrayArgumentError, HurrayFormatError, ImportArgumentError, integer_arg
from ...kv.paged import BlockPagedTensor
from ...kv.repage import (
    RepagePlan,
    check_out_pool,
    on_device,
    overlaps,
    plan_repage,
    refuse_pool_overlap,
    repage,
    repage_into,
)
from ...kv.snapshot import KVSnapshot
from .._common import FP8_DTYPES as _FP8
from .._common import INT32_MAX as _INT32_MAX
from .._common import (
    check_conversion,
    check_csr,
    check_import_memory,
    check_layer,
    check_one_structure,
    check_pool_values,
    dequantize,
    layer_scales,
    made_for,
    refuse_shared_layer_caches,
)
from .cache import LAYOUTS, FlashInferCache, PagedKVCache

__all__ = ["plan_flashinfer", "plan_flashinfer_repage", "to_flashinfer", "to_flashinfer_all"]


def plan_flashinfer(snapshot: KVSnapshot, page_size: int) -> RepagePlan | None:
    """The repaging plan every layer of ``snapshot`` shares, for ``page_size``.

    Returns the ``RepagePlan`` (it keeps the source block table, to
    recognise a plan made for another snapshot), or ``None`` when the
    snapshot already has pages of ``page_size`` (nothing to repage). Pass
    the result to :func:`to_flashinfer` as ``plan=`` for each layer so the
    plan is computed once per batch (:func:`to_flashinfer_all` does).

    Raises:
        ImportArgumentError: ``page_size`` is not an integer ``>= 1``.
        HurrayFormatError: the snapshot's data: no layers or ``seq_lens``,
            MLA latents, dropped sliding-window pages or linear-attention
            states, an inconsistent block structure (page ids outside the
            pool included).
    """
    page_size = integer_arg(page_size, "page_size", 1, ImportArgumentError)
    snapshot.require_kv("FlashInfer's paged K/V cache")
    check_one_structure(snapshot, "FlashInfer's paged K/V cache")
    if not snapshot.keys:
        raise HurrayFormatError("snapshot.layers", "the snapshot has no layers")
    k0 = snapshot.keys[0]
    if k0.page_size == page_size:
        return None
    lens = _require_lens(k0)
    return plan_repage(k0.block_table, k0.seq_ptr, lens, k0.page_size, page_size, k0.num_pages)


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
        HurrayArgumentError: ``kv_layout`` out of range, a ``page_size`` not
            an integer ``>= 1`` (an :class:`ImportArgumentError`),
            the ``out`` errors of :func:`to_flashinfer`, and ``out[i]``
            sharing memory with another layer's cache (``out=[(k, v)] *
            num_layers``: every layer would overwrite the one before).
        ImportArgumentError: ``out`` does not hold one cache per layer, or
            any error :func:`to_flashinfer` reports as one. Every layer is
            checked (its pools, lengths, scales, ``dtype`` and ``out`` cache)
            before the first is imported, so an error leaves every ``out``
            cache as it was.
        HurrayFormatError: the snapshot's data does not fit (see
            :func:`to_flashinfer`).
        OSError: ``ENOMEM``: every layer's repaged pools together are larger
            than the device's memory, before the first is built.
    """
    if kv_layout not in LAYOUTS:
        raise HurrayArgumentError("kv_layout", f"must be 'NHD' or 'HND', got {kv_layout!r}")
    if out is not None and len(out) != snapshot.num_layers:
        raise ImportArgumentError("out", f"has {len(out)} caches for {snapshot.num_layers} layers")
    snapshot.require_kv("FlashInfer's paged K/V cache")
    check_one_structure(snapshot, "FlashInfer's paged K/V cache")
    if not snapshot.keys:
        raise HurrayFormatError("snapshot.layers", "the snapshot has no layers")
    if page_size is not None:  # "16" failed with a bare TypeError
        page_size = integer_arg(page_size, "page_size", 1, ImportArgumentError)
    plan = plan_flashinfer(snapshot, page_size) if page_size is not None else None
    # Every layer (its pools, lengths, scales, dtype= and cache) is checked before the first is imported:
    # a layer refused late would leave the out= caches of the layers before it half written.
    sources = []
    for i in range(snapshot.num_layers):
        sources.append(_check_source(snapshot, i, dtype))
        if out is not None:
            k = snapshot.keys[i]
            pages = plan.num_pages if plan is not None else k.num_pages
            _check_out(snapshot, k, plan, dtype, out[i], kv_layout, combined, pages, device)
    if out is not None:
        # Each cache was checked on its own above; one cache given for two layers is written twice.
        refuse_shared_layer_caches([(o,) if isinstance(o, torch.Tensor) else o for o in out])
    if out is None and plan is not None:  # repaged into new pools (without, each layer keeps its own pool's size)
        check_import_memory(snapshot, plan.num_pages * plan.page_size, lambda t: _target_dtype(t.dtype, dtype), device)
    return tuple(  # checked above: not again per layer (check_csr reads the index arrays, a device sync each)
        _import_layer(
            snapshot,
            i,
            None,
            kv_layout,
            combined,
            device,
            dtype,
            plan,
            None if out is None else out[i],
            sources[i],
            False,
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
            the result's dtype, and the device the result goes to; a pair's
            two caches have one shape and identical strides (FlashInfer reads
            both with k_cache's), and head_dim is contiguous. Its first
            pages are overwritten, the rest is left as it is, and the result
            holds ``out`` itself (a ``[k_cache, v_cache]`` list as a tuple of
            its two tensors). A pool reused across imports (or an
            engine's own) saves faulting in new memory, about twice the cost
            of the copy itself on a CPU.

    Returns:
        A :class:`FlashInferCache`. With ``out``, its pages are ``out``.
        Otherwise, without repaging, conversion or layout change, the pages
        are the snapshot's own tensors (no copy), unless the two pools are
        strided differently (or head_dim is not contiguous): both are then
        made contiguous, as FlashInfer needs.

    Raises:
        HurrayArgumentError: ``kv_layout`` is out of range, ``page_size`` is
            not an integer ``>= 1`` (an :class:`ImportArgumentError`);
            ``out`` whose caches share memory with each other or with the
            snapshot's pools, differ in strides, or lack a contiguous
            head_dim.
        ImportArgumentError: a :class:`HurrayArgumentError` (and, until 0.3,
            a :class:`HurrayFormatError`) for the call: ``layer`` out of
            range, a ``plan`` made for another snapshot or another
            ``page_size``, a float8 or non-float ``dtype`` the pages cannot
            be converted to, ``out`` of the wrong kind (a pair, or one tensor
            with ``combined=True``), shape, pages, dtype or device, or a pair
            whose caches differ in pages.
        HurrayFormatError: the snapshot's data: no ``seq_lens``, an
            inconsistent block structure, key and value pools that differ,
            integer or affine-quantized pools, ``kv_scales`` not one pair per
            layer, more pages than int32 indices hold.
        OSError: ``ENOMEM``: the repaged pool is larger than the device's
            memory.

    Example:
        One layer, repaged to 16-token pages in the HND layout, checked as
        FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper.plan`` would, then
        the float32 reference decode:

        >>> import torch
        >>> from hurray_vllm.adapters.flashinfer import plan_flashinfer, reference_decode, to_flashinfer
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
    if kv_layout not in LAYOUTS:
        raise HurrayArgumentError("kv_layout", f"must be 'NHD' or 'HND', got {kv_layout!r}")
    snapshot.require_kv("FlashInfer's paged K/V cache")
    check_one_structure(snapshot, "FlashInfer's paged K/V cache")
    check_layer(snapshot, layer)
    source = _check_source(snapshot, layer, dtype)
    return _import_layer(snapshot, layer, page_size, kv_layout, combined, device, dtype, plan, out, source, True)


def _import_layer(
    snapshot: KVSnapshot,
    layer: int,
    page_size: int | None,
    kv_layout: str,
    combined: bool,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    plan: RepagePlan | None,
    out: PagedKVCache | None,
    source: tuple[torch.Tensor, tuple[float, float]],
    check_out: bool,
) -> FlashInferCache:
    """Layer ``layer`` imported as :func:`to_flashinfer` does, once :func:`_check_source` returned ``source``.

    ``check_out``: whether ``out`` still needs :func:`_check_out` (:func:`to_flashinfer_all` checked it already).
    """
    k, v = snapshot.keys[layer], snapshot.values[layer]
    lens, scales = source

    if page_size is not None:  # "16" failed with a bare TypeError, 16.0 passed where the pages had that size
        page_size = integer_arg(page_size, "page_size", 1, ImportArgumentError)
    if plan is None and page_size is not None and page_size != k.page_size:
        plan = plan_repage(k.block_table, k.seq_ptr, lens, k.page_size, page_size, k.num_pages)
    elif plan is not None:
        if page_size is not None and plan.page_size != page_size:
            raise ImportArgumentError("plan", f"the plan repages to {plan.page_size}, page_size is {page_size}")
        _check_plan(plan, k, lens)
    num_pages = plan.num_pages if plan is not None else k.num_pages
    table = plan.block_table if plan is not None else k.block_table
    ptr = plan.seq_ptr if plan is not None else k.seq_ptr
    ps = plan.page_size if plan is not None else k.page_size
    if num_pages > _INT32_MAX or table.numel() > _INT32_MAX:
        raise HurrayFormatError("paged_kv_indices", "page ids and counts must fit FlashInfer's int32 indices")

    if out is not None:
        if check_out:
            _check_out(snapshot, k, plan, dtype, out, kv_layout, combined, num_pages, device)
        # A [k, v] list passes the checks, but FlashInfer (and FlashInferCache.check) take a tuple or a tensor.
        cache: PagedKVCache = out if isinstance(out, torch.Tensor) else (out[0], out[1])
        k_scale, v_scale = _import_into(k, v, plan, scales, dtype, out, kv_layout, combined, num_pages, device)
    else:
        if plan is not None:
            k, v = repage(k, plan.page_size, plan), repage(v, plan.page_size, plan)
        kp, k_scale = _convert(k.page_pool, scales[0], dtype)
        vp, v_scale = _convert(v.page_pool, scales[1], dtype)
        cache = _arrange(kp, vp, kv_layout, combined)

    last = torch.where(lens > 0, (lens - 1) % ps + 1, torch.zeros_like(lens))
    # Contiguous: FlashInfer's plan() reads these through their data pointers.
    indptr = ptr.to(torch.int32).contiguous()
    indices = table.to(torch.int32).contiguous()
    last_page_len = last.to(torch.int32).contiguous()
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


def _check_source(
    snapshot: KVSnapshot, layer: int, dtype: torch.dtype | None
) -> tuple[torch.Tensor, tuple[float, float]]:
    """The layer's sequence lengths and ``(k_scale, v_scale)``, after the checks the import relies on.

    Key and value share one block structure, pool shape and dtype
    (:func:`~hurray_vllm.adapters._common.check_one_structure`, run first);
    ``dtype`` is checked against the pools here, so that nothing after this
    (the writes into ``out=`` included) can refuse it.
    """
    k, v = snapshot.keys[layer], snapshot.values[layer]
    for t in (k, v):
        check_pool_values(t, "FlashInfer")
    check_conversion(k.dtype, dtype, "FlashInfer")
    scales = layer_scales(snapshot, layer)
    # The CSR arrays are used as they are, so they must describe exactly the
    # pages each sequence needs: an extra page would count as page_size tokens.
    _require_lens(k)
    return check_csr(k), scales


def _check_plan(plan: RepagePlan, k: BlockPagedTensor, lens: torch.Tensor) -> None:
    # A plan for another batch would gather the wrong slots without any error (and with out=, nothing
    # after this checks it again); these checks are cheap and catch a plan reused across snapshots.
    if plan.page_size <= 0 or plan.seq_ptr.numel() != k.seq_ptr.numel():
        raise ImportArgumentError("plan", f"the plan is for {plan.seq_ptr.numel() - 1} sequences, not {k.num_seqs}")
    if plan.src_page_size not in (0, k.page_size):
        raise ImportArgumentError(
            "plan", f"the plan repages pages of {plan.src_page_size}, this snapshot has pages of {k.page_size}"
        )
    if not torch.equal(plan.seq_lens.to(lens.device), lens):
        raise ImportArgumentError("plan", "the plan was made for other sequence lengths")
    if plan.src_slots.numel() and int(plan.src_slots.max()) >= k.num_pages * k.page_size:
        raise ImportArgumentError("plan", "the plan reads slots past this snapshot's page pool")
    if not made_for(k.block_table, plan.src_block_table):
        raise ImportArgumentError(
            "plan", "the plan was made for another block table (another snapshot); call plan_flashinfer on this one"
        )


def _convert(pool: torch.Tensor, scale: float, dtype: torch.dtype | None) -> tuple[torch.Tensor, float | None]:
    """``pool`` in ``dtype``, and the scale FlashInfer must still apply (float8 pass-through)."""
    check_conversion(pool.dtype, dtype, "FlashInfer")  # run before any write too (_check_source)
    if pool.dtype in _FP8:
        if dtype == pool.dtype:
            return pool, scale
        real = dequantize(pool, scale)
        return (real if dtype is None else real.to(dtype)), None
    if dtype is None or dtype == pool.dtype:
        return pool, None
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
    if combined:
        assert isinstance(out, torch.Tensor)
        dsts = [out[:num_pages, 0], out[:num_pages, 1]]
    else:
        dsts = [out[0][:num_pages], out[1][:num_pages]]
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


def _check_out(
    snapshot: KVSnapshot,
    k: BlockPagedTensor,
    plan: RepagePlan | None,
    dtype: torch.dtype | None,
    out: PagedKVCache,
    kv_layout: str,
    combined: bool,
    num_pages: int,
    device: torch.device | str | None,
) -> None:
    """Refuse a cache ``out`` for layer ``k``'s import before anything is written into it."""
    target = _target_dtype(k.dtype, dtype)
    heads, dim = k.num_heads, k.head_dim
    ps = plan.page_size if plan is not None else k.page_size
    page = (ps, heads, dim) if kv_layout == "NHD" else (heads, ps, dim)
    if combined:
        if not isinstance(out, torch.Tensor):
            raise ImportArgumentError("out", "combined=True takes one [num_pages, 2, ...] tensor")
        check_out_pool(out, num_pages, (2, *page), target, "out")
    else:
        if isinstance(out, torch.Tensor) or len(out) != 2:
            raise ImportArgumentError("out", "must be a (k_cache, v_cache) pair of tensors (or pass combined=True)")
        for i, o in enumerate(out):
            check_out_pool(o, num_pages, page, target, f"out[{i}]")
        if out[0].shape[0] != out[1].shape[0]:
            raise ImportArgumentError(
                "out",
                f"k_cache has {out[0].shape[0]} pages and v_cache {out[1].shape[0]}; FlashInfer takes two caches "
                "of one shape: allocate them alike",
            )
        if out[0].stride() != out[1].stride():
            # FlashInfer walks both pools with k_cache's strides (TORCH_CHECK "k/v strides must be identical").
            raise HurrayArgumentError(
                "out",
                f"k_cache has strides {out[0].stride()} and v_cache {out[1].stride()}; FlashInfer needs identical "
                "strides: pass two caches of one layout (both contiguous, or both views of one [P, 2, ...] pool)",
            )
        if overlaps(out[0], out[1]):
            raise HurrayArgumentError("out", "k_cache and v_cache share memory; pass two separate caches")
    pools = out if isinstance(out, tuple | list) else (out,)
    if any(o.numel() and o.stride(-1) != 1 for o in pools):
        raise HurrayArgumentError("out", "FlashInfer needs head_dim to be the contiguous (stride 1) dimension")
    if device is not None and not all(on_device(o, device) for o in pools):
        where = sorted({str(o.device) for o in pools})
        raise ImportArgumentError("out", f"is on {', '.join(where)}, device= asks for {device}")
    for o in pools:
        refuse_pool_overlap(snapshot, o, "out")


def _arrange(k: torch.Tensor, v: torch.Tensor, kv_layout: str, combined: bool) -> PagedKVCache:
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    if combined:
        return torch.stack((k, v), dim=1)  # one copy, contiguous
    if kv_layout == "HND":
        # FlashInfer derives strides from the tensor, but a dense HND pool is
        # what "HND" promises callers that index or copy the pages themselves.
        k, v = k.contiguous(), v.contiguous()
    if k.stride() != v.stride() or k.stride(-1) != 1:
        # Pools passed through as the snapshot holds them may be strided, each its own way. FlashInfer walks
        # both with k_cache's strides ("k/v strides must be identical") and needs head_dim contiguous: make
        # both dense (a clone, not .contiguous(), so that sizes of 1 get canonical strides too).
        k, v = k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format)
    return k, v


def _move(cache: PagedKVCache, device: torch.device | str) -> PagedKVCache:
    if isinstance(cache, torch.Tensor):
        return cache.to(device)
    return cache[0].to(device), cache[1].to(device)
