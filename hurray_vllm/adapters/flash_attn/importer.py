"""Planning and importing: a snapshot's layers as the page pools and block table the kernel reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ...errors import HurrayArgumentError, HurrayFormatError, ImportArgumentError
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
    check_import_memory,
    check_layer,
    check_one_structure,
    check_pool_values,
    check_reserve,
    dequantize,
    layer_scales,
    made_for,
    padded_block_table,
    refuse_shared_layer_caches,
    with_extra_pages,
)
from .flavors import FLAVORS, Flavor, FlavorLimits, check_head_dim, check_page_size, flavor_limits

__all__ = ["FlashAttnCache", "FlashAttnPlan", "plan_flash_attn", "to_flash_attn", "to_flash_attn_all"]


@dataclass(frozen=True, eq=False)
class FlashAttnCache:
    """One layer's paged KV cache, ready for ``flash_attn_with_kvcache``.

    Attributes:
        k_cache: ``[num_blocks, page_size, nheads_k, head_dim]``, contiguous,
            float16/bfloat16 (float8_e4m3fn for an fa3 passthrough). flash-attn
            writes appended keys into it in place.
        v_cache: ``[num_blocks, page_size, nheads_k, head_dim]``, like ``k_cache``.
        block_table: int32 ``[batch, max_num_blocks_per_seq]``, contiguous.
            Entries past the pages a sequence covers are 0, always a valid
            page (see :func:`plan_flash_attn`).
        cache_seqlens: int32 ``[batch]``, tokens in the cache per sequence.
        k_descale: float32 ``[batch, nheads_k]`` for float8 caches (fa3):
            stored key times descale is the real key; ``None`` otherwise.
        v_descale: float32 ``[batch, nheads_k]``, likewise for values.
        flavor: the kernel build the cache was shaped for.
        layer: the snapshot layer it came from.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    flavor: Flavor = "fa2"
    layer: int | None = None

    @property
    def num_blocks(self) -> int:
        """Number of pages in each pool (``k_cache.shape[0]``)."""
        return int(self.k_cache.shape[0])

    @property
    def page_size(self) -> int:
        """Tokens per page (``k_cache.shape[1]``)."""
        return int(self.k_cache.shape[1])

    @property
    def num_kv_heads(self) -> int:
        """Number of KV heads (``nheads_k``)."""
        return int(self.k_cache.shape[2])

    @property
    def head_dim(self) -> int:
        """Head size, the pools' last dimension."""
        return int(self.k_cache.shape[3])

    @property
    def batch_size(self) -> int:
        """Number of sequences in the batch (rows of ``block_table``)."""
        return int(self.block_table.shape[0])

    @property
    def capacity(self) -> int:
        """Tokens per sequence the block table can address (``max_num_blocks_per_seq * page_size``)."""
        return int(self.block_table.shape[1]) * self.page_size

    def advance(self, n: int) -> FlashAttnCache:
        """The same cache with ``n`` more tokens per sequence (after appending ``k``/``v`` of ``n`` tokens)."""
        return replace(self, cache_seqlens=self.cache_seqlens + n)

    def kwargs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments for the flavor's ``flash_attn_with_kvcache`` (block/page table name, descales)."""
        table = "page_table" if self.flavor == "fa3" else "block_table"
        out = {"cache_seqlens": self.cache_seqlens, table: self.block_table}
        if self.k_descale is not None and self.v_descale is not None:
            out.update(k_descale=self.k_descale, v_descale=self.v_descale)
        return out


@dataclass(frozen=True)
class FlashAttnPlan:
    """The block structure of an imported batch, shared by every layer and role.

    Attributes:
        flavor: the kernel build the plan was checked against.
        page_size: the target page size.
        src_page_size: the snapshot's page size.
        reserve: tokens of room left after every sequence for appends.
        repage: the slot gather from the snapshot's pages, or ``None`` when
            the page sizes already agree (the pool is then used as is).
        base_pages: pages of the (repaged) pool; they keep their ids.
        extra_pages: int64 ``[num_extra]``: the pages appended after them,
            each the pool page it copies (a shared tail page made private so
            an append cannot clobber another sequence) or -1 for a zero page.
        block_table: int32 ``[batch, max_num_blocks_per_seq]``, contiguous,
            padded with 0.
        cache_seqlens: int32 ``[batch]``.
    """

    flavor: Flavor
    page_size: int
    src_page_size: int
    reserve: int
    repage: RepagePlan | None
    base_pages: int
    extra_pages: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    #: The snapshot's own block table the plan was made from (checked when the plan is reused).
    src_block_table: torch.Tensor | None = None
    #: The snapshot's own ``seq_ptr`` (int64 ``[batch + 1]``), checked alike: one block table split
    #: differently between the sequences is another batch, whose pages the plan's table would misplace.
    src_seq_ptr: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        """Pages each imported pool has: the base pages plus the extra ones."""
        return self.base_pages + int(self.extra_pages.numel())

    @property
    def batch_size(self) -> int:
        """Number of sequences in the batch."""
        return int(self.cache_seqlens.numel())


def plan_flash_attn(
    snapshot: KVSnapshot, *, page_size: int = 256, flavor: Flavor = "fa2", reserve: int = 0
) -> FlashAttnPlan:
    """Plan importing ``snapshot`` as flash-attn paged caches (once for all layers).

    Args:
        snapshot: At least one layer, one sequence, and known ``seq_lens``.
        page_size: Target ``page_block_size``; must suit ``flavor`` (fa2: multiple of
            256, vllm: multiple of 16, fa3: any positive size).
        flavor: The kernel build, ``"fa2"``, ``"fa3"`` or ``"vllm"``.
        reserve: Tokens of room to leave after every sequence, for ``k``/``v`` appends.
            A sequence whose partly filled last page is shared (prefix sharing,
            or two identical sequences) gets a private copy of it so that appends
            of one sequence never land in another's pages.

    Returns:
        The :class:`FlashAttnPlan`.

    Raises:
        HurrayArgumentError: ``page_size`` the flavor refuses, an unknown
            ``flavor``, a ``reserve`` that is negative or, added to the
            longest sequence, past int32 positions.
        HurrayFormatError: the snapshot's data: no layers, sequences or
            ``seq_lens``, MLA latents, dropped sliding-window pages or
            linear-attention states, layers or roles of other block
            structures, an inconsistent block table (page ids outside the
            pool included), more pages or tokens than int32 indices hold.

    Notes:
        The block table is padded with page 0 (the plan makes sure a page 0
        exists). flash-attn only dereferences entries that cover
        ``cache_seqlens + seqlen_new``, but a valid id keeps any speculative read
        in bounds, and 0 needs no per-row value (a row with no page has no "last
        page" to repeat). This is also what vLLM does with its null block 0.
    """
    lim = flavor_limits(flavor)
    check_page_size(page_size, lim, "page_size")
    check_reserve(reserve)
    snapshot.require_kv("flash_attn_with_kvcache")
    check_one_structure(snapshot, "flash_attn_with_kvcache")
    if not snapshot.keys:
        raise HurrayFormatError("snapshot", "the snapshot has no layers; nothing to import")
    k0 = snapshot.keys[0]
    if k0.seq_lens is None:
        raise HurrayFormatError(
            "seq_lens", "the snapshot does not carry sequence lengths; flash-attn needs cache_seqlens"
        )
    if k0.num_seqs == 0:
        raise HurrayFormatError("snapshot", "the snapshot has no sequences; flash-attn needs batch >= 1")
    if k0.page_size == page_size:
        rp = None
        table, ptr, lens, base = k0.block_table, k0.seq_ptr, k0.seq_lens, k0.num_pages
    else:
        # num_pages: a page id past the pool is the snapshot's error here, before any gather reads it.
        rp = plan_repage(k0.block_table, k0.seq_ptr, k0.seq_lens, k0.page_size, page_size, k0.num_pages)
        table, ptr, lens, base = rp.block_table, rp.seq_ptr, rp.seq_lens, rp.num_pages
    extra, bt = padded_block_table(table, ptr, lens, base, page_size, reserve)
    num_blocks = base + int(extra.numel())
    longest = int(lens.max()) + reserve
    if num_blocks > _INT32_MAX or longest > _INT32_MAX:
        raise HurrayFormatError(
            "snapshot", f"{num_blocks} pages / {longest} tokens do not fit flash-attn's int32 indices"
        )
    return FlashAttnPlan(
        flavor=flavor,
        page_size=page_size,
        src_page_size=k0.page_size,
        reserve=reserve,
        repage=rp,
        base_pages=base,
        extra_pages=extra,
        block_table=bt.to(torch.int32).contiguous(),
        cache_seqlens=lens.to(torch.int32).contiguous(),
        src_block_table=k0.block_table,
        src_seq_ptr=k0.seq_ptr,
    )


def to_flash_attn(
    snapshot: KVSnapshot,
    layer: int,
    *,
    page_size: int | None = None,
    flavor: Flavor | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    plan: FlashAttnPlan | None = None,
    reserve: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> FlashAttnCache:
    """Layer ``layer`` of ``snapshot`` as a flash-attn paged cache.

    Args:
        snapshot: The batch; its pools may be on any device.
        layer: ``0 <= layer < snapshot.num_layers``.
        page_size: Target page size, 256 by default (valid for every flavor). The
            snapshot is repaged when its page size differs.
        flavor: The kernel build, ``"fa2"`` (default), ``"fa3"`` or ``"vllm"``.
        device: Where the result goes; moved once, at the end. Repaging runs on the
            snapshot's device, so a CUDA snapshot never visits the host.
        dtype: Cache dtype. ``None`` keeps float16/bfloat16 pools, keeps
            float8_e4m3fn pools for fa3 (with descales), and dequantizes any
            other float8 pool (``stored.float() * scale``, the snapshot's
            ``kv_scales``, 1 when absent) to bfloat16. float32 pools need an
            explicit ``torch.bfloat16`` or ``torch.float16``.
        plan: From :func:`plan_flash_attn` for this snapshot, to share the block
            structure across layers; ``page_size``, ``flavor`` and ``reserve``
            then default to the plan's and must agree with it.
        reserve: Tokens of room per sequence for appends (0 by default); see
            :func:`plan_flash_attn`.
        out: ``(k_cache, v_cache)``, preallocated caches to import into, each
            ``[num_blocks, page_size, nheads_k, head_dim]`` with ``num_blocks >=
            plan.num_blocks``, in the cache dtype (see ``dtype``), contiguous, on
            ``device`` when that is given. Pages ``0 .. plan.num_blocks - 1`` are
            overwritten, the rest is left as it is, and the returned cache holds
            these very tensors. Reusing one pair across imports (or an engine's
            own cache) saves faulting in new memory, which on a CPU costs about
            twice the copy itself.

    Returns:
        A :class:`FlashAttnCache`. With ``out``, its tensors. Otherwise, with
        ``reserve=0`` and nothing to repage, convert or move, the caches are the
        snapshot's own pools (no copy) where those are contiguous; else fresh,
        contiguous tensors.

    Raises:
        ImportArgumentError: a :class:`HurrayArgumentError` (and, until 0.3,
            a :class:`HurrayFormatError`) for the call: ``layer`` out of
            range, a ``plan`` made for another snapshot or disagreeing with
            ``page_size``/``flavor``/``reserve``, a ``dtype`` the flavor does
            not take (or none where the stored dtype needs one), ``out`` that
            is not a pair of tensors or has the wrong shape, pages, dtype or
            device, or whose two caches differ in pages.
        HurrayArgumentError: the options of :func:`plan_flash_attn`; ``out``
            whose caches share memory with each other or with the snapshot's
            pools (its own pools, page for page, are taken only where nothing
            is repaged, converted or added, and ``reserve=0``: an append
            would write into the snapshot), or lack a contiguous last
            dimension.
        HurrayFormatError: the snapshot's data (see :func:`plan_flash_attn`),
            a Hurray-quantized or non-float pool, a ``head_dim`` the flavor
            refuses, ``kv_scales`` not one pair per layer.
        OSError: ``ENOMEM``: the repaged pool is larger than the device's
            memory (:func:`~hurray_vllm.kv.repage.check_memory`).

    Example:
        Import layer 0 with room for 16 decoded tokens, check the call as
        flash-attn would, and attend with the pure-PyTorch reference (on a
        GPU, ``flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache,
        cache_seqlens=cache.cache_seqlens, block_table=cache.block_table)``):

        >>> import torch
        >>> from hurray_vllm.adapters.flash_attn import check_flash_attn_args, plan_flash_attn, to_flash_attn
        >>> from hurray_vllm.adapters.reference import paged_attention
        >>> from hurray_vllm.app.demo import spec_example_snapshot
        >>> snap = spec_example_snapshot()  # sequences of 6 and 3 tokens, 2 KV heads of 8, float16
        >>> plan = plan_flash_attn(snap, page_size=256, flavor="fa2", reserve=16)
        >>> cache = to_flash_attn(snap, 0, plan=plan)
        >>> cache.k_cache.shape  # [num_blocks, page_size, nheads_k, head_dim]
        torch.Size([2, 256, 2, 8])
        >>> cache.block_table.dtype, cache.cache_seqlens.tolist()  # int32 [batch, max_num_blocks_per_seq]
        (torch.int32, [6, 3])
        >>> q = torch.randn(2, 1, 2, 8, dtype=torch.float16)  # [batch, seqlen_q, nheads, head_dim]
        >>> check_flash_attn_args(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.block_table)
        >>> paged_attention(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.block_table).shape
        torch.Size([2, 1, 2, 8])
    """
    plan = _resolve_plan(snapshot, plan, page_size, flavor, reserve)
    check_layer(snapshot, layer)
    checked = _check_layer(snapshot, layer, plan, dtype, device, out, "out")
    return _import_layer(snapshot, layer, plan, device, out, checked)


def _import_layer(
    snapshot: KVSnapshot,
    layer: int,
    plan: FlashAttnPlan,
    device: torch.device | str | None,
    out: tuple[torch.Tensor, torch.Tensor] | None,
    checked: tuple[torch.dtype, bool, tuple[float, float]],
) -> FlashAttnCache:
    """Layer ``layer`` imported as :func:`to_flash_attn` does, once :func:`_check_layer` returned ``checked``."""
    kt, vt = snapshot.keys[layer], snapshot.values[layer]
    out_dtype, passthrough, (k_scale, v_scale) = checked
    if out is not None:
        k_cache = _layer_into(kt, plan, out_dtype, passthrough, k_scale, out[0], "out[0]")
        v_cache = _layer_into(vt, plan, out_dtype, passthrough, v_scale, out[1], "out[1]")
    else:
        k_cache = _convert(_layer_pool(kt, plan), out_dtype, passthrough, k_scale)
        v_cache = _convert(_layer_pool(vt, plan), out_dtype, passthrough, v_scale)
    dev = torch.device(device) if device is not None else k_cache.device
    k_descale = v_descale = None
    if passthrough and kt.dtype in _FP8:
        shape = (plan.batch_size, kt.num_heads)
        k_descale = torch.full(shape, float(k_scale), dtype=torch.float32, device=dev)
        v_descale = torch.full(shape, float(v_scale), dtype=torch.float32, device=dev)
    return FlashAttnCache(
        k_cache=k_cache.to(dev),
        v_cache=v_cache.to(dev),
        block_table=plan.block_table.to(dev),
        cache_seqlens=plan.cache_seqlens.to(dev),
        k_descale=k_descale,
        v_descale=v_descale,
        flavor=plan.flavor,
        layer=layer,
    )


def to_flash_attn_all(
    snapshot: KVSnapshot,
    *,
    page_size: int = 256,
    flavor: Flavor = "fa2",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    reserve: int = 0,
    out: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[FlashAttnCache, ...]:
    """Every layer of ``snapshot`` (see :func:`to_flash_attn`), planned once.

    The layers share one ``block_table`` and one ``cache_seqlens`` tensor.
    ``out``, when given, holds one preallocated ``(k_cache, v_cache)`` pair
    per layer (see :func:`to_flash_attn`).

    Every layer is checked (its pools, ``head_dim`` and scales, ``dtype``
    and its ``out`` pair) before the first is imported, so an error leaves
    every ``out`` cache as it was.

    Raises:
        ImportArgumentError: ``out`` without one pair per layer, or any
            error :func:`to_flash_attn` reports as one.
        HurrayArgumentError: as for :func:`to_flash_attn`; ``out[i]`` whose
            caches share memory with another layer's (``out=[(k, v)] *
            num_layers``: every layer would overwrite the one before).
        HurrayFormatError: as for :func:`to_flash_attn`.
        OSError: ``ENOMEM``: every layer's new pools together are larger
            than the device's memory, before the first is built.
    """
    if out is not None and len(out) != snapshot.num_layers:
        raise ImportArgumentError("out", f"has {len(out)} cache pairs for {snapshot.num_layers} layers")
    plan = plan_flash_attn(snapshot, page_size=page_size, flavor=flavor, reserve=reserve)
    dev = torch.device(device) if device is not None else None
    # Every layer (its pools, head_dim, scales, dtype= and caches) is checked before the first is imported:
    # a layer refused late would leave the out= caches of the layers before it half written.
    checked = [
        _check_layer(snapshot, i, plan, dtype, dev, None if out is None else out[i], f"out[{i}]")
        for i in range(snapshot.num_layers)
    ]
    if out is not None:
        # Each pair was checked on its own above; one pair given for two layers is written twice.
        refuse_shared_layer_caches(out)
    else:
        lim = FLAVORS[plan.flavor]
        check_import_memory(snapshot, plan.num_blocks * plan.page_size, lambda t: _target_dtype(t, lim, dtype)[0], dev)
    if dev is not None:
        plan = replace(plan, block_table=plan.block_table.to(dev), cache_seqlens=plan.cache_seqlens.to(dev))
    return tuple(  # checked above: not again per layer (the out= overlap check walks every pool)
        _import_layer(snapshot, i, plan, dev, None if out is None else out[i], checked[i])
        for i in range(snapshot.num_layers)
    )


def _resolve_plan(
    snapshot: KVSnapshot,
    plan: FlashAttnPlan | None,
    page_size: int | None,
    flavor: Flavor | None,
    reserve: int | None,
) -> FlashAttnPlan:
    if plan is None:
        return plan_flash_attn(
            snapshot,
            page_size=256 if page_size is None else page_size,
            flavor="fa2" if flavor is None else flavor,
            reserve=0 if reserve is None else reserve,
        )
    asked = {"page_size": page_size, "flavor": flavor, "reserve": reserve}
    for name, value in asked.items():
        if value is not None and value != getattr(plan, name):
            raise ImportArgumentError(
                "plan", f"the plan has {name}={getattr(plan, name)!r} but {value!r} was asked; drop one of them"
            )
    k0 = snapshot.keys[0] if snapshot.keys else None
    if (
        k0 is None
        or k0.page_size != plan.src_page_size
        or k0.num_seqs != plan.batch_size
        or (plan.repage is None and k0.num_pages != plan.base_pages)
        or k0.seq_lens is None
        or not torch.equal(plan.cache_seqlens.to(k0.seq_lens.device), k0.seq_lens.to(torch.int32))
        or not made_for(k0.block_table, plan.src_block_table)
        or not made_for(k0.seq_ptr, plan.src_seq_ptr)
    ):
        raise ImportArgumentError("plan", "the plan was made for another snapshot; call plan_flash_attn on this one")
    return plan


def _check_layer(
    snapshot: KVSnapshot,
    layer: int,
    plan: FlashAttnPlan,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    out: tuple[torch.Tensor, torch.Tensor] | None,
    field: str,
) -> tuple[torch.dtype, bool, tuple[float, float]]:
    """Every check of importing ``layer`` (into ``out``), none of which writes anything.

    Returns:
        ``(cache dtype, whether the stored values pass through, (k_scale, v_scale))``.
    """
    lim = FLAVORS[plan.flavor]
    kt = snapshot.keys[layer]
    # The value pool shares the key's dtype (check_one_structure), not necessarily its quantization.
    check_pool_values(snapshot.values[layer], "flash-attn")
    out_dtype, passthrough = _target_dtype(kt, lim, dtype)
    check_head_dim(kt.head_dim, lim, out_dtype, "head_dim")
    scales = layer_scales(snapshot, layer)
    if out is not None:
        _check_out(snapshot, layer, plan, out_dtype, passthrough, device, out, field)
    return out_dtype, passthrough, scales


def _target_dtype(t: BlockPagedTensor, lim: FlavorLimits, dtype: torch.dtype | None) -> tuple[torch.dtype, bool]:
    """(cache dtype, whether the stored values pass through unchanged)."""
    check_pool_values(t, "flash-attn")
    src = t.dtype
    if dtype is None:
        if src in lim.dtypes:
            return src, True
        if src in _FP8:
            return torch.bfloat16, False
        # The stored dtype is valid data; the call needs a dtype= the kernel takes.
        raise ImportArgumentError(
            "dtype", f"{lim.kernel} does not take {src} caches; pass dtype=torch.bfloat16 or torch.float16"
        )
    if dtype not in lim.dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in lim.dtypes)
        raise ImportArgumentError("dtype", f"{lim.kernel} takes {names}, not {dtype}")
    # fa3's descales carry the layer's scale: a float8 pool may pass through, never be made or re-encoded.
    check_conversion(src, dtype, lim.kernel)
    return dtype, src == dtype


def _check_out(
    snapshot: KVSnapshot,
    layer: int,
    plan: FlashAttnPlan,
    dtype: torch.dtype,
    passthrough: bool,
    device: torch.device | str | None,
    pair: object,
    field: str,
) -> None:
    """Refuse a ``(k_cache, v_cache)`` pair for ``layer`` before anything is written into it."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(o, torch.Tensor) for o in pair):
        raise ImportArgumentError(field, "must be a (k_cache, v_cache) pair of tensors")
    if device is not None and not all(on_device(o, device) for o in pair):
        raise ImportArgumentError(field, f"is on {pair[0].device}/{pair[1].device}, device= asks for {device}")
    kt = snapshot.keys[layer]
    for i, o in enumerate(pair):
        check_out_pool(o, plan.num_blocks, (plan.page_size, kt.num_heads, kt.head_dim), dtype, f"{field}[{i}]")
        if o.numel() and o.stride(-1) != 1:
            raise HurrayArgumentError(f"{field}[{i}]", f"needs a contiguous last dimension, has strides {o.stride()}")
    if pair[0].shape[0] != pair[1].shape[0]:
        # flash-attn checks v_cache against k_cache's shape (num_blocks included).
        raise ImportArgumentError(
            field,
            f"k_cache has {pair[0].shape[0]} pages and v_cache {pair[1].shape[0]}; flash-attn takes two caches "
            "of one shape: allocate them alike",
        )
    if overlaps(pair[0], pair[1]):
        raise HurrayArgumentError(field, "k_cache and v_cache share memory; pass two separate caches")
    in_place = plan.repage is None and passthrough and not plan.extra_pages.numel()
    for i, o in enumerate(pair):
        own = (kt, snapshot.values[layer])[i]

        def itself(t: BlockPagedTensor, o: torch.Tensor = o, own: BlockPagedTensor = own) -> bool:
            # Its own pool, page for page: an import in place (nothing to move).
            p = t.page_pool
            return in_place and t is own and o.data_ptr() == p.data_ptr() and o.stride() == p.stride()

        if plan.reserve and itself(own):
            # Room for appends is room in the snapshot's own pages: the caller's appends would change it.
            raise HurrayArgumentError(
                f"{field}[{i}]",
                f"is the snapshot's own layer {layer} {own.kv_role} pool, but reserve={plan.reserve} leaves room "
                "for appends, which would write into the snapshot; import into other memory, or with reserve=0",
            )
        refuse_pool_overlap(snapshot, o, f"{field}[{i}]", allow=itself)


def _layer_pool(t: BlockPagedTensor, plan: FlashAttnPlan) -> torch.Tensor:
    pool = repage(t, plan.page_size, plan.repage).page_pool if plan.repage is not None else t.page_pool
    if not plan.extra_pages.numel():
        # With room reserved, appends write into the pool: never into the snapshot's own. The copy is dense
        # (clone() would keep a strided pool's strides, see _convert).
        return pool.clone(memory_format=torch.contiguous_format) if plan.reserve and plan.repage is None else pool
    return with_extra_pages(pool, plan.extra_pages)


def _layer_into(
    t: BlockPagedTensor,
    plan: FlashAttnPlan,
    dtype: torch.dtype,
    passthrough: bool,
    scale: float,
    dst: torch.Tensor,
    field: str,
) -> torch.Tensor:
    """Write the layer's pages (repaged, converted, with the plan's extra pages) into ``dst``."""
    check_out_pool(dst, plan.num_blocks, (plan.page_size, t.num_heads, t.head_dim), dtype, field)
    base = dst[: plan.base_pages]
    if passthrough:
        repage_into(t, plan.repage, base)
    else:
        pool = repage(t, plan.page_size, plan.repage).page_pool if plan.repage is not None else t.page_pool
        base.copy_(_convert(pool, dtype, False, scale))
    if plan.extra_pages.numel():
        src = plan.extra_pages.to(dst.device)
        copied = (src >= 0).nonzero().reshape(-1)
        # Through bytes: index_copy_ has no float8 kernels.
        tail = dst[plan.base_pages : plan.num_blocks].view(torch.uint8)
        tail.zero_()
        if copied.numel():
            tail.index_copy_(0, copied, dst.view(torch.uint8).index_select(0, src[copied]))
    return dst


def _convert(pool: torch.Tensor, dtype: torch.dtype, passthrough: bool, scale: float) -> torch.Tensor:
    """``pool`` in ``dtype``, contiguous: the snapshot's own pool only where it already is.

    A snapshot may hold strided pools (``BlockPagedTensor`` allows any view), and ``clone``/``to`` keep
    strides, but FA2 and FA3 require ``k_cache.stride(-1) == 1`` and :class:`FlashAttnCache` promises
    contiguous caches.
    """
    if passthrough:
        return pool.contiguous()  # no copy when it already is
    if pool.dtype in _FP8:
        return dequantize(pool, scale).to(dtype, memory_format=torch.contiguous_format)
    return pool.to(dtype, memory_format=torch.contiguous_format)
