"""Helpers the paged-KV importers share (flash-attn, FlashInfer, the reference).

Only :mod:`hurray_vllm.errors`, :mod:`hurray_vllm.wire` and
:mod:`hurray_vllm.kv` may be imported here, never another adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import HurrayArgumentError, HurrayFormatError, ImportArgumentError, integer_arg
from ..kv.paged import BlockPagedTensor, made_for
from ..kv.repage import (  # its structure check is what plan_repage runs: an import that does not repage runs it too
    check_budget,
    check_memory,
    check_structure,
    memory_span,
    same_tensor,
)
from ..kv.snapshot import KVSnapshot

__all__ = [
    "FP8_DTYPES",
    "INT32_MAX",
    "POOL_DTYPES",
    "check_conversion",
    "check_csr",
    "check_import_memory",
    "check_layer",
    "check_one_structure",
    "check_pool_values",
    "check_reserve",
    "convert_latent",
    "dequantize",
    "layer_scales",
    "padded_block_table",
    "made_for",
    "refuse_shared_layer_caches",
    "same_tensor",
    "with_extra_pages",
]

#: The float8 storage dtypes: pools in these hold ``value / scale``.
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)

#: The largest page id or token count the kernels' int32 indices hold.
INT32_MAX = 2**31 - 1

#: The pool dtypes the importers read: real values, or float8 ones with the layer's scale (``kv_scales``).
POOL_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, *FP8_DTYPES)


def check_layer(snapshot: KVSnapshot, layer: int) -> int:
    """Raise unless ``layer`` names one of ``snapshot``'s layers; return it as a plain ``int``.

    Args:
        snapshot: the batch being imported.
        layer: the layer index asked for; an integer (numpy's and a 0-d
            integer tensor too, not a bool or a float) with
            ``0 <= layer < snapshot.num_layers``.

    Returns:
        ``layer`` as a plain ``int``.

    Raises:
        ImportArgumentError: with ``field="layer"`` when it is no integer or
            out of range (the caller's index, not the data: a
            :class:`HurrayArgumentError`).
    """
    # A float or a bool would otherwise index the layers with a bare TypeError, or as layer 1 (True).
    layer = integer_arg(layer, "layer", error=ImportArgumentError)
    if not 0 <= layer < snapshot.num_layers:
        raise ImportArgumentError("layer", f"layer {layer} is outside the snapshot's {snapshot.num_layers} layers")
    return layer


def check_one_structure(snapshot: KVSnapshot, what: str) -> None:
    """Refuse a snapshot whose sliding-window layers dropped tokens, where ``what`` reads every page as KV.

    Such a layer's dropped pages are one zero page (``snapshot.windows``):
    a kernel handed them without its window would attend zeros, and a
    planner of one table for all layers would give the full layers the
    windowed layers' pages. A windowed snapshot that dropped nothing is fine.

    A linear-attention hybrid is refused too: its layers are the model's
    attention layers only, and a model whose linear-attention layers need
    their states (``snapshot.states``) cannot run on the KV alone.

    Every layer and role must share one block structure too
    (``snapshot.structure``): the importers plan (and repage) once, from
    layer 0's key, so each tensor's page size, page count, ``block_table``,
    ``seq_ptr`` and ``seq_lens`` must equal that key's, and a layer's value
    pool must have its key pool's shape and dtype (layers may differ from
    each other in heads, head size and dtype: each is imported alone).

    Raises:
        HurrayFormatError: (field ``snapshot.windows``, ``snapshot.states`` or
            ``snapshot.structure``) naming ``what``.
    """
    if snapshot.states is not None:
        raise HurrayFormatError(
            "snapshot.states",
            f"{what} imports attention KV only, but this snapshot's model also has linear-attention layers "
            f"{list(snapshot.states.layers)} whose states it carries (its KV layers are model layers "
            f"{snapshot.states.attention_layers(snapshot.num_layers)}); import it with the transformers adapter "
            "or into vLLM",
        )
    win = snapshot.windows
    if win is not None and snapshot.num_layers and any(start for row in win.kv_start for start in row):
        raise HurrayFormatError(
            "snapshot.windows",
            f"{what} reads every page as KV, but this snapshot's sliding-window layers hold only their windows "
            "(the older pages are zeros); import it with the transformers adapter or into vLLM",
        )
    members = snapshot.layer_members()
    if not members:
        return
    k0 = members[0][0]
    for i, layer in enumerate(members):
        for t in layer:
            # One plan (one block table, one repaging, one page count) serves every layer and role: a
            # tensor paged otherwise would be read through layer 0's key's structure, silently.
            differs = _structure_difference(t, k0)
            if differs is None and (t.page_pool.shape != layer[0].page_pool.shape or t.dtype != layer[0].dtype):
                # A layer's roles become one cache (flash-attn's k_cache/v_cache pair) of one shape and dtype;
                # layers may differ from each other in heads, head size and dtype (each is imported alone).
                differs = (
                    f"page pool {list(t.page_pool.shape)} {t.dtype} (its {layer[0].kv_role}'s is "
                    f"{list(layer[0].page_pool.shape)} {layer[0].dtype})"
                )
            if differs is not None:
                raise HurrayFormatError(
                    "snapshot.structure",
                    f"{what} takes one block structure for every layer and role, but layer {i}'s {t.kv_role} "
                    f"differs in its {differs}; "
                    "import it with the transformers adapter or into vLLM, or rebuild it with one structure",
                )


def _structure_difference(t: BlockPagedTensor, k0: BlockPagedTensor) -> str | None:
    """What of ``t``'s block structure differs from ``k0``'s (``None``: nothing)."""
    if t is k0:
        return None
    if t.page_size != k0.page_size:
        return f"page size ({t.page_size}, layer 0's is {k0.page_size})"
    if t.num_pages != k0.num_pages:
        return f"page count ({t.num_pages}, layer 0's is {k0.num_pages})"
    for name in ("block_table", "seq_ptr", "seq_lens"):
        a, b = getattr(t, name), getattr(k0, name)
        if not same_tensor(a, b):
            return name
    return None


def check_pool_values(t: BlockPagedTensor, kernel: str) -> None:
    """Refuse a pool whose stored numbers are not the values ``kernel`` would attend.

    A Hurray-quantized pool (``t.quantization``) stores integers that become
    values only through its scale and zero point, which no kernel is given:
    cast as they are, an int8 100 with scale 0.01 would be read as 100.0.
    Every importer (flash-attn, FlashInfer, FlashMLA, FlashInfer's MLA API)
    therefore reads only :data:`POOL_DTYPES`, float8 with its per-layer
    ``kv_scales``.

    Args:
        t: a layer's key, value or fused latent.
        kernel: what the import is for, named in the message.

    Raises:
        HurrayFormatError: field ``quantization`` (a Hurray-quantized pool) or
            ``dtype`` (a pool of another dtype: integers, float64, ...).
    """
    what = f"layer {t.layer_index} {t.kv_role}"
    if t.quantization is not None:
        raise HurrayFormatError(
            "quantization",
            f"{what} uses Hurray {type(t.quantization).__name__} quantization, which {kernel} cannot read (it "
            "would take the stored integers for values); dequantize the snapshot first",
        )
    if t.dtype not in POOL_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in POOL_DTYPES)
        raise HurrayFormatError(
            "dtype", f"{what} is a {t.dtype} pool; {kernel} imports {names} pools only: convert the snapshot first"
        )


def check_conversion(src: torch.dtype, dtype: torch.dtype | None, kernel: str, *, keeps_scale: bool = True) -> None:
    """Refuse a ``dtype=`` whose pages could not hold the real values of ``src`` pages.

    Float8 pages mean something only with a scale: one chosen from real
    values (quantizing) needs calibration this library does not do, and
    re-encoding float8 as another float8 type would need a new one. A
    float8 pool may pass through as stored only into a cache that carries
    the layer's scale beside it (``keeps_scale``: FlashInfer's
    ``k_scale``/``v_scale``, FlashAttention-3's descales); the MLA caches
    carry none, so their float8 latents are always dequantized.

    Args:
        src: the stored pool's dtype (one of :data:`POOL_DTYPES`).
        dtype: the cache dtype asked for; ``None`` (the importer's default) is always accepted.
        kernel: what the import is for, named in the message.
        keeps_scale: whether the imported cache carries the layer's scale.

    Raises:
        ImportArgumentError: with ``field="dtype"`` (the caller's option, not the data).
    """
    if dtype is None or (dtype == src and (keeps_scale or src not in FP8_DTYPES)):
        return
    if dtype in FP8_DTYPES:
        if dtype == src:
            raise ImportArgumentError(
                "dtype",
                f"{kernel}'s cache carries no scale, so {src} pages kept as stored would be read without the "
                "layer's kv_scales; leave dtype=None (or pass torch.bfloat16/torch.float16) to dequantize them",
            )
        if src in FP8_DTYPES:
            raise ImportArgumentError("dtype", f"cannot re-encode {src} pages as {dtype}; keep {src} or dequantize")
        raise ImportArgumentError(
            "dtype", f"quantizing {src} pages to {dtype} needs calibrated scales; hurray-vllm does not choose them"
        )
    if dtype not in (*POOL_DTYPES, torch.float64):
        # Integers would truncate the values; other 8-bit floats (float8_e8m0fnu, the fnuz types) have no scale here.
        raise ImportArgumentError(
            "dtype", f"{kernel} pages hold floating-point values (float16, bfloat16, float32, float64), not {dtype}"
        )


def convert_latent(pool: torch.Tensor, scale: float, dtype: torch.dtype | None) -> torch.Tensor:
    """An MLA latent pool in its cache dtype, once :func:`check_conversion` accepted ``dtype``.

    Args:
        pool: the (repaged) fused pool, any shape, one of :data:`POOL_DTYPES`.
        scale: the layer's latent scale (``value = stored * scale`` for float8).
        dtype: the cache dtype; ``None`` keeps the pool's, except that float8
            is dequantized to bfloat16 (the MLA kernels take no float8 latent).

    Returns:
        ``pool`` itself when nothing changes, else a new tensor.
    """
    if pool.dtype in FP8_DTYPES:
        return dequantize(pool, scale).to(dtype or torch.bfloat16)
    return pool if dtype is None else pool.to(dtype)


def check_reserve(reserve: int) -> None:
    """Refuse a ``reserve`` (tokens of room per sequence) no int32 index could address.

    Raises:
        HurrayArgumentError: with ``field="reserve"``: not an integer (a
            float, a string, ``None``, a bool), negative, or more than
            :data:`INT32_MAX` tokens (the caller's option, not the data).
    """
    # A float padded by what it rounds up to (1.5 added a page, 0.5 none), a string failed with a bare TypeError.
    # Not ImportArgumentError: a reserve never was a format error (test_an_oversized_reserve_is_the_callers_error).
    integer_arg(reserve, "reserve")
    if not 0 <= reserve <= INT32_MAX:
        raise HurrayArgumentError(
            "reserve", f"reserve must be 0..{INT32_MAX} tokens (the kernels' int32 positions), got {reserve}"
        )


def layer_scales(snapshot: KVSnapshot, layer: int) -> tuple[float, float]:
    """Layer ``layer``'s ``(k_scale, v_scale)`` (a fused latent's one scale twice); ``(1.0, 1.0)`` without scales.

    Args:
        snapshot: the batch being imported; ``snapshot.kv_scales``, when
            given, must hold one pair per layer.
        layer: a valid layer index (see :func:`check_layer`).

    Raises:
        HurrayFormatError: with ``field="snapshot.kv_scales"``: not one pair per layer.
    """
    if snapshot.kv_scales is None:
        # The snapshot's contract: no scales means an unscaled cache.
        return 1.0, 1.0
    if len(snapshot.kv_scales) != snapshot.num_layers or len(snapshot.kv_scales[layer]) != 2:
        raise HurrayFormatError(
            "snapshot.kv_scales",
            f"{len(snapshot.kv_scales)} scale entries for {snapshot.num_layers} layers; each layer needs one "
            "(k_scale, v_scale) pair: validate() the snapshot",
        )
    ks, vs = snapshot.kv_scales[layer]
    return float(ks), float(vs)


def check_csr(t: BlockPagedTensor) -> torch.Tensor:
    """``t``'s sequence lengths, once its block structure is exactly the pages its tokens need.

    Importers that hand ``block_table``/``seq_ptr``/``seq_lens`` to a kernel
    as CSR arrays (FlashInfer's ``kv_indices``/``kv_indptr``) rely on it: an
    extra page would count as ``page_size`` tokens, a missing one would read
    the next sequence's, and a page id past the pool reads out of bounds.

    Args:
        t: a layer's tensor: ``block_table`` int64 ``[total_pages]``,
            ``seq_ptr`` int64 ``[batch + 1]``, ``seq_lens`` integer ``[batch]``.

    Returns:
        int64 ``[batch]`` sequence lengths on ``t.block_table``'s device.

    Raises:
        HurrayFormatError: no ``seq_lens`` (field ``seq_lens``), ``seq_ptr``
            not starting at 0 and ending at the table's length, lengths that
            are negative or not one per sequence, a sequence with more or fewer
            pages than its tokens need (``seq_lens.pages``), page ids outside
            the pool (``block_table``).
    """
    if t.seq_lens is None:
        raise HurrayFormatError(
            "seq_lens", "the snapshot does not carry sequence lengths, which the kernel's page lists need"
        )
    lens = t.seq_lens.to(device=t.block_table.device, dtype=torch.int64)
    ptr = t.seq_ptr.to(t.block_table.device)
    if ptr.dim() != 1 or ptr.numel() == 0 or int(ptr[0]) != 0 or int(ptr[-1]) != t.block_table.numel():
        raise HurrayFormatError("seq_ptr", "seq_ptr must start at 0 and end at the block table's length")
    counts = ptr[1:] - ptr[:-1]
    if lens.dim() != 1 or lens.numel() != counts.numel() or bool((lens < 0).any()):
        raise HurrayFormatError(
            "seq_lens", f"{lens.numel()} non-negative lengths needed for {counts.numel()} sequences"
        )
    need = (lens + t.page_size - 1) // t.page_size
    if not torch.equal(need, counts):
        s = int(torch.nonzero(need != counts)[0, 0])
        raise HurrayFormatError(
            "seq_lens.pages",
            f"sequence {s} has {int(lens[s])} tokens (needs {int(need[s])} pages of {t.page_size}) "
            f"but owns {int(counts[s])}",
        )
    check_structure(t.block_table, ptr, lens, t.num_pages)
    return lens


def dequantize(pool: torch.Tensor, scale: float) -> torch.Tensor:
    """Real values of a float8 page pool: ``stored.float() * scale``.

    Args:
        pool: a page pool of any shape (the importers pass
            ``[num_pages, page_size, num_kv_heads, head_dim]``), float8 (or any
            floating dtype), any device and layout.
        scale: the per-layer scale (``value = stored * scale``).

    Returns:
        A new float32 tensor of ``pool``'s shape, on ``pool``'s device.
    """
    return pool.float() * float(scale)


def padded_block_table(
    table: torch.Tensor, ptr: torch.Tensor, lens: torch.Tensor, base: int, page: int, reserve: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A flash-attn/FlashMLA style block table for CSR ``table``/``ptr`` over ``base`` pages.

    Args:
        table: int64 ``[total_pages]``, the pages of every sequence in order.
        ptr: int64 ``[batch + 1]``, sequence ``b`` owns ``table[ptr[b]:ptr[b+1]]``.
        lens: int64 ``[batch]``, tokens per sequence.
        base: pages in the pool the table indexes.
        page: tokens per page.
        reserve: tokens of room to leave after every sequence for appends.

    Returns:
        ``(extra_pages, block_table)``: int64 ``[num_extra]`` pages appended
        after the pool (each the pool page it copies, a shared partly filled
        tail made private so appends cannot clobber another sequence, or -1
        for a zero page), and the int64 ``[batch, width]`` table padded with 0.

    Raises:
        HurrayFormatError: an inconsistent structure (``seq_ptr`` not one
            offset more than ``lens`` or out of the table, negative lengths,
            page ids outside the pool), a sequence with fewer pages than its
            tokens need, or more tokens than int32 positions hold.
        HurrayArgumentError: with ``field="reserve"``: ``reserve`` out of
            range, or so large that the padded table would not fit int32
            positions or :data:`~hurray_vllm.kv.repage.MAX_IMPORT_SLOTS`
            where the snapshot alone would.
    """
    check_reserve(reserve)
    dev = table.device
    ptr, lens = ptr.to(dev), lens.to(dev)
    if ptr.dim() != 1 or ptr.numel() != lens.numel() + 1:
        raise HurrayFormatError("seq_ptr", f"{ptr.numel()} offsets for {lens.numel()} sequences; need one more")
    # The checks repaging runs (kv.repage): the indexing below trusts offsets, lengths and page ids.
    check_structure(table, ptr, lens, base)
    batch = int(lens.numel())
    have = ptr[1:] - ptr[:-1]
    use = (lens + page - 1) // page
    short = (have < use).nonzero()
    if short.numel():
        s = int(short[0, 0])
        raise HurrayFormatError(
            "block_table",
            f"sequence {s} has {int(have[s])} pages for {int(lens[s])} tokens of {page}; the snapshot is inconsistent",
        )
    bare = max(1, int(use.max()) if batch else 0)  # columns the tokens alone need
    if bare * page > INT32_MAX:
        raise HurrayFormatError("seq_lens", f"{bare * page} tokens per sequence do not fit the kernels' int32 indices")
    # [batch, width] grows with the longest sequence times the batch, whatever the snapshot's size.
    check_budget(batch * bare, "the padded block table", "block_table")
    need = (lens + reserve + page - 1) // page
    width = max(1, int(need.max()) if batch else 0)
    if width * page > INT32_MAX:
        # The tokens fit (above): the caller's room for appends is what does not.
        raise HurrayArgumentError(
            "reserve",
            f"reserve={reserve} makes {width * page} tokens per sequence, past the kernels' int32 positions; "
            f"reserve at most {INT32_MAX // page * page - int(lens.max())} tokens",
        )
    try:
        check_budget(batch * width, f"the padded block table with reserve={reserve}", "reserve")
    except HurrayFormatError as err:
        raise HurrayArgumentError("reserve", f"{err.violations[0].message}; reserve fewer tokens") from err
    cols = torch.arange(width, device=dev)[None, :]
    in_use = cols < use[:, None]
    bt = torch.zeros(batch, width, dtype=torch.int64, device=dev)
    bt[in_use] = table[(ptr[:-1, None] + cols)[in_use]]
    used = bt[in_use]
    extra = [torch.empty(0, dtype=torch.int64, device=dev)]
    if reserve > 0:
        # Copy-on-write: the first appended token lands in the last page when it is
        # partly filled; if any other covered entry references that page, give the
        # sequence its own copy.
        refs = torch.bincount(used, minlength=max(base, 1))
        tail_col = lens // page
        rows = torch.arange(batch, device=dev)
        tail = bt[rows, tail_col.clamp(max=width - 1)]
        cow = ((lens % page) != 0) & (refs[tail] > 1)
        # When every reference to a page is such a tail (identical sequences), the
        # first of them may keep the original: the others no longer read it.
        tails = torch.bincount(tail[cow], minlength=refs.numel())
        first = torch.full_like(refs, batch)
        first.scatter_reduce_(0, tail[cow], rows[cow], reduce="amin")
        cow &= ~((tails[tail] == refs[tail]) & (first[tail] == rows))
        cow_rows = cow.nonzero().reshape(-1)
        bt[cow_rows, tail_col[cow_rows]] = base + torch.arange(cow_rows.numel(), device=dev)
        extra.append(tail[cow_rows])
        fresh = ~in_use & (cols < need[:, None])
        n_fresh = int(fresh.sum())
        bt[fresh] = base + cow_rows.numel() + torch.arange(n_fresh, device=dev)
        extra.append(torch.full((n_fresh,), -1, dtype=torch.int64, device=dev))
    out = torch.cat(extra)
    if base + out.numel() == 0:
        # Every sequence is empty: one zero page keeps the padding id 0 valid.
        out = torch.full((1,), -1, dtype=torch.int64, device=dev)
    return out, bt


def with_extra_pages(pool: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """``pool`` followed by the extra pages :func:`padded_block_table` planned.

    Args:
        pool: ``[num_pages, ...]`` page pool (any page shape, dtype, device);
            may have no pages.
        extra: int64 ``[num_extra]``: for each page to append, the page of
            ``pool`` it copies, or -1 for a zero page.

    Returns:
        A new ``[num_pages + num_extra, ...]`` tensor on ``pool``'s device,
        or ``pool`` itself when ``extra`` is empty.
    """
    if not extra.numel():
        return pool
    src = extra.to(pool.device)
    # Sized from ``extra``, never from the pool's first page: an empty pool has none to copy the shape of.
    fresh = torch.zeros((int(src.numel()), *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    copied = src >= 0
    fresh[copied] = pool[src[copied]]
    return torch.cat([pool, fresh])


def check_import_memory(
    snapshot: KVSnapshot,
    slots: int,
    out_dtype: Callable[[BlockPagedTensor], torch.dtype],
    device: torch.device | str | None,
) -> None:
    """Refuse an import of every layer whose new pools no device could hold, before the first is allocated.

    The pools of every layer end up on ``device`` together, in their output
    dtype. Each is built where the snapshot lies, one layer at a time: a
    layer converted to another dtype holds its repaged pool besides the
    result until the next layer, so that much is counted there too.

    Args:
        snapshot: the batch being imported.
        slots: token slots of each new pool (pages x page size), the same for every layer and role.
        out_dtype: each tensor's dtype in the new pool.
        device: where the pools go (``None``: where the snapshot lies).

    Raises:
        OSError: ``ENOMEM`` (see :func:`~hurray_vllm.kv.repage.check_memory`).
    """
    tensors = snapshot.tensors()
    if not tensors:
        return
    built = tensors[0].page_pool.device
    target = torch.device(device) if device is not None else built
    results, converting = [], []  # per layer: its new pools' bytes; the repaged pools a conversion holds besides
    for members in snapshot.layer_members():
        values = [(slots * t.num_heads * t.head_dim, t) for t in members]  # each new pool's element count
        results.append(sum(n * out_dtype(t).itemsize for n, t in values))
        converting.append(sum(n * t.page_pool.element_size() for n, t in values if out_dtype(t) != t.dtype))
    what = f"importing {snapshot.num_layers} layers of {slots} token slots"
    if target == built:
        check_memory(sum(results) + max(converting), what, built)
    else:  # built a layer at a time (its pool, and the converted copy), then moved
        check_memory(max(converting) + max(results), what, built)
        check_memory(sum(results), what, target)


def refuse_shared_layer_caches(caches: Sequence[Sequence[torch.Tensor]]) -> None:
    """Refuse ``out=`` caches of two layers that share memory, before any layer is written.

    Each layer's import overwrites its caches' first pages, so a cache that
    another layer also writes (``out=[(k, v)] * num_layers``) would end up
    holding only the last layer's pages. A sweep over the caches sorted by
    address, not a comparison of every pair: a snapshot may have hundreds
    of layers. Spans are :func:`~hurray_vllm.kv.repage.memory_span`'s,
    conservative for strided views, as for the two caches of one layer.

    Args:
        caches: per layer, the tensors its import writes (a ``(k_cache,
            v_cache)`` pair, or one combined tensor); the tensors of one
            layer are not compared with each other (the importers check
            those apart, with their own message).

    Raises:
        HurrayArgumentError: with ``field="out[i]"``, ``i`` the later of two
            layers whose caches may share memory.
    """
    spans = sorted(
        (str(span[0]), span[1], span[2], layer)
        for layer, ts in enumerate(caches)
        for t in ts
        for span in (memory_span(t),)
        if span[1] < span[2]
    )
    # The furthest end so far and its layer, and the furthest end of any other layer (and that layer): a span
    # overlaps an earlier one of another layer exactly when that layer's furthest end passes its start.
    device, top, top_layer, other, other_layer = "", 0, -1, 0, -1
    for dev, start, end, layer in spans:
        if dev != device:
            device, top, top_layer, other, other_layer = dev, 0, -1, 0, -1
        reach, seen = (other, other_layer) if layer == top_layer else (top, top_layer)
        if start < reach:
            first, later = sorted((layer, seen))
            raise HurrayArgumentError(
                f"out[{later}]",
                f"shares memory with out[{first}]: each layer's import overwrites its caches' pages, so the "
                "later layer would overwrite the earlier one's; pass separate caches for every layer",
            )
        if layer == top_layer:
            top = max(top, end)
        elif end > top:
            top, top_layer, other, other_layer = end, layer, top, top_layer
        elif end > other:
            other, other_layer = end, layer
