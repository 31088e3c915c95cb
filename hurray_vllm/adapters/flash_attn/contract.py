"""The kernel's argument contract, checked before anything reaches CUDA (``check_flash_attn_args``).

What is mirrored is the C++ side: the checks of ``mha_fwd_kvcache`` (FlashAttention-2, vLLM's fork) and
``mha_fwd`` (FlashAttention-3). The Python entry points in front of them do two things more, and only
the first is mirrored here:

* an int ``cache_seqlens`` is expanded to an int32 ``[batch]`` tensor, and so it is here;
* ``q``, ``k``, ``v`` and ``block_table`` (FA3: ``cache_seqlens`` too) whose last dimension is not
  contiguous are copied into contiguous ones. Here they are refused, deliberately: the compiled
  kernels, called directly, refuse them, and a caller who wants the copy can make it.
"""

from __future__ import annotations

import torch

from ...errors import HurrayArgumentError
from .._common import FP8_DTYPES as _FP8
from .._common import INT32_MAX as _INT32_MAX
from .flavors import Flavor, FlavorLimits, check_head_dim, check_page_size, flavor_limits

__all__ = ["check_flash_attn_args"]


def check_flash_attn_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | int | None,
    block_table: torch.Tensor | None,
    *,
    flavor: Flavor = "fa2",
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
) -> None:
    """Check a paged ``flash_attn_with_kvcache`` call against the kernel's contract.

    Mirrors the C++ checks of ``mha_fwd_kvcache`` (FlashAttention-2 and vLLM's
    fork) and ``mha_fwd`` (FlashAttention-3), plus the ones the kernels leave
    to the caller and get wrong silently: block table entries in range, no
    two sequences appending into one page. Reads ``cache_seqlens`` and
    ``block_table`` (one device sync, like flash-attn's own capacity check).
    Tensors may be on any device, as long as it is the same one.

    Args:
        q: ``[batch, seqlen_q, nheads, head_dim]``, ``batch >= 1``, last dim
            contiguous; float16/bfloat16 (fa3 also float8_e4m3fn).
        k_cache: ``[num_blocks, page_block_size, nheads_k, head_dim]`` in ``q``'s
            dtype, last dim contiguous; ``page_block_size`` a multiple of 256
            (fa2) or 16 (vllm); ``nheads % nheads_k == 0``; ``head_dim <= 256``
            (fa3 and vllm: a multiple of 8; fa3 with fp8: of 16).
        v_cache: Same shape and dtype as ``k_cache``.
        cache_seqlens: int32 ``[batch]``, contiguous, values >= 0; or one int for
            every sequence, as ``flash_attn_with_kvcache`` takes it (checked as
            ``torch.full((batch,), cache_seqlens, dtype=torch.int32)``).
        block_table: int32 ``[batch, max_num_blocks_per_seq]``, last dim contiguous. Every
            entry covering ``cache_seqlens[b] + seqlen_new`` tokens is a page id
            ``< num_blocks``; the rest is padding and is not checked.
        flavor: The kernel build, ``"fa2"``, ``"fa3"`` or ``"vllm"``.
        k: Optional ``[batch, seqlen_new, nheads_k, head_dim]`` in ``q``'s dtype, last dim
            contiguous, given with ``v`` or not at all. The pages it is written to must not
            be read by another sequence.
        v: Like ``k``, for values.
        cache_batch_idx: Refused: FlashAttention-2 rejects it with a paged cache, and the
            importer and the reference do not model it for the other builds.
        cache_leftpad: Refused, like ``cache_batch_idx``.
        q_descale: Optional float32 ``[batch, nheads_k]``; fa3 with float8 inputs only.
        k_descale: Like ``q_descale``.
        v_descale: Like ``q_descale``.
        window_size: ``(left, right)``, the kernel's sliding window (``-1``: unbounded
            on that side). Only decides whether FA2 regroups a one-query decode (see
            ``k``'s capacity rule); the window itself is the kernel's business.
        alibi_slopes: The kernel's ALiBi slopes, or ``None``. Likewise only decides
            the regrouping; its shape is not checked.

    Raises:
        HurrayArgumentError: Naming the first offending argument (its ``field``).
    """
    lim = flavor_limits(flavor)
    _check_devices(
        q,
        k_cache=k_cache,
        v_cache=v_cache,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        k=k,
        v=v,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        alibi_slopes=alibi_slopes,
    )
    batch, seqlen_q, nheads, head_dim = _check_q(q, lim)
    if isinstance(cache_seqlens, int):
        cache_seqlens = _seqlens_of_int(cache_seqlens, batch, q.device)
    num_blocks, page, nheads_k = _check_caches(q, k_cache, v_cache, lim, nheads, head_dim)
    _refuse_unmodelled(cache_batch_idx, cache_leftpad)
    table, lens, width = _check_index_tensors(block_table, cache_seqlens, batch)
    kernel_seqlen_q = _kernel_seqlen_q(
        lim, seqlen_q, nheads, nheads_k, head_dim, _window(window_size), alibi_slopes is not None
    )
    seqlen_new = _check_new_kv(q, k, v, [batch, -1, nheads_k, head_dim], kernel_seqlen_q, width * page)
    _check_descales(q.dtype, lim, (batch, nheads_k), q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    _check_table_contents(table, lens, seqlen_new, num_blocks, page)


def _check_devices(q: torch.Tensor, **named: torch.Tensor | int | None) -> None:
    """Every tensor on ``q``'s device (first: every later check may read the tensors)."""
    for name, t in named.items():
        # Anything else (an int cache_seqlens) is not on a device; its own check says what it must be.
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise HurrayArgumentError(name, f"{name} is on {t.device} but q is on {q.device}; move it there")


def _check_q(q: torch.Tensor, lim: FlavorLimits) -> tuple[int, int, int, int]:
    """``q``'s rank, dtype, batch and layout; returns ``(batch, seqlen_q, nheads, head_dim)``."""
    if q.dim() != 4:
        raise HurrayArgumentError("q", f"q must be [batch, seqlen_q, nheads, head_dim], got shape {list(q.shape)}")
    if q.dtype not in lim.dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in lim.dtypes)
        raise HurrayArgumentError("q", f"{lim.kernel} supports {names}, not {q.dtype}")
    batch, seqlen_q, nheads, head_dim = (int(x) for x in q.shape)
    if batch <= 0:
        raise HurrayArgumentError("q", "batch size must be positive")
    if q.stride(-1) != 1:
        raise HurrayArgumentError("q", "q must have a contiguous last dimension; pass q.contiguous()")
    return batch, seqlen_q, nheads, head_dim


def _check_caches(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lim: FlavorLimits, nheads: int, head_dim: int
) -> tuple[int, int, int]:
    """The page pools' shapes, dtypes and layout against ``q``; returns ``(num_blocks, page_size, nheads_k)``."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4:
            raise HurrayArgumentError(
                name, f"{name} must be [num_blocks, page_block_size, nheads_k, head_dim], got shape {list(c.shape)}"
            )
        if c.dtype != q.dtype:
            raise HurrayArgumentError(name, f"{name} is {c.dtype} but q is {q.dtype}; caches must be in q's dtype")
        if c.stride(-1) != 1:
            raise HurrayArgumentError(name, f"{name} must have a contiguous last dimension; pass {name}.contiguous()")
    if v_cache.shape != k_cache.shape:
        raise HurrayArgumentError(
            "v_cache", f"v_cache has shape {list(v_cache.shape)} but k_cache has {list(k_cache.shape)}"
        )
    num_blocks, page, nheads_k, head_dim_k = (int(x) for x in k_cache.shape)
    if head_dim_k != head_dim:
        raise HurrayArgumentError("k_cache", f"k_cache has head_dim {head_dim_k} but q has {head_dim}")
    check_page_size(page, lim, "k_cache")
    check_head_dim(head_dim, lim, q.dtype, "q", HurrayArgumentError)
    if nheads_k == 0 or nheads % nheads_k:
        raise HurrayArgumentError(
            "q", f"the number of heads in key/value ({nheads_k}) must divide the number of heads in q ({nheads})"
        )
    return num_blocks, page, nheads_k


def _refuse_unmodelled(cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None) -> None:
    """Arguments a paged cache does not take (FlashAttention-2 rejects them; nothing here models them)."""
    if cache_batch_idx is not None:
        raise HurrayArgumentError(
            "cache_batch_idx", "a paged KV cache does not support cache_batch_idx; reorder block_table rows instead"
        )
    if cache_leftpad is not None:
        raise HurrayArgumentError(
            "cache_leftpad", "a paged KV cache does not support cache_leftpad; start every sequence at position 0"
        )


def _check_index_tensors(
    block_table: torch.Tensor | None, cache_seqlens: torch.Tensor | None, batch: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``block_table`` and ``cache_seqlens``: present, int32, shaped by ``batch``; returns them and the width."""
    if block_table is None:
        raise HurrayArgumentError("block_table", "a paged KV cache needs block_table (page_table for fa3)")
    if block_table.dtype != torch.int32:
        raise HurrayArgumentError("block_table", f"block_table must have dtype torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise HurrayArgumentError(
            "block_table",
            f"block_table must be [batch={batch}, max_num_blocks_per_seq], got shape {list(block_table.shape)}",
        )
    if block_table.stride(-1) != 1:
        raise HurrayArgumentError(
            "block_table", "block_table must have a contiguous last dimension; pass block_table.contiguous()"
        )

    if cache_seqlens is None:
        raise HurrayArgumentError("cache_seqlens", "a paged KV cache needs cache_seqlens (int32 [batch])")
    if not isinstance(cache_seqlens, torch.Tensor):
        raise HurrayArgumentError(
            "cache_seqlens",
            f"cache_seqlens must be an int32 [batch] tensor or an int, got {type(cache_seqlens).__name__}",
        )
    if cache_seqlens.dtype != torch.int32:
        raise HurrayArgumentError(
            "cache_seqlens", f"cache_seqlens must have dtype torch.int32, got {cache_seqlens.dtype}"
        )
    if tuple(cache_seqlens.shape) != (batch,):
        raise HurrayArgumentError(
            "cache_seqlens", f"cache_seqlens must have shape [batch={batch}], got {list(cache_seqlens.shape)}"
        )
    if not cache_seqlens.is_contiguous():
        raise HurrayArgumentError("cache_seqlens", "cache_seqlens must be contiguous; pass cache_seqlens.contiguous()")
    return block_table, cache_seqlens, int(block_table.shape[1])


def _seqlens_of_int(n: int, batch: int, device: torch.device) -> torch.Tensor:
    """An int ``cache_seqlens`` as the entry points pass it on: int32 ``[batch]``, every entry ``n``."""
    if n < 0:
        raise HurrayArgumentError("cache_seqlens", "cache_seqlens must be >= 0")
    if n > _INT32_MAX:
        raise HurrayArgumentError("cache_seqlens", f"cache_seqlens={n} does not fit the kernel's int32 lengths")
    return torch.full((batch,), n, dtype=torch.int32, device=device)


def _window(window_size: object) -> tuple[int, int]:
    """``window_size`` as ``(left, right)`` ints."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise HurrayArgumentError("window_size", f"window_size must be a (left, right) pair, got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _kernel_seqlen_q(
    lim: FlavorLimits,
    seqlen_q: int,
    nheads: int,
    nheads_k: int,
    head_dim: int,
    window: tuple[int, int],
    alibi: bool,
) -> int:
    """The ``seqlen_q`` the kernel checks appends against, after FA2's single-query GQA rewrite.

    FlashAttention-2 and vLLM's fork (``mha_fwd_kvcache``) run a one-query
    decode with grouped heads as ``nheads / nheads_k`` queries of ``nheads_k``
    heads (``seqlenq_ngroups_swapped``: ``seqlen_q == 1``, ``nheads >
    nheads_k``, ``head_dim % 8 == 0``, both sides of ``window`` negative and
    no ALiBi), before requiring ``seqlen_q <= seqlen_k`` for appends.
    FlashAttention-3's ``mha_fwd`` keeps ``seqlen_q`` as it is.

    The rule is kept for ``"vllm"`` although it is conservative there: newer
    forks (since vllm-project/flash-attention#107) have no
    ``flash_attn_with_kvcache``, and the ``flash_attn_varlen_func`` fallback
    that :func:`~hurray_vllm.adapters.flash_attn.flash_attn_with_kvcache`
    runs for them appends in Python, with no such check. Forks that still
    have ``flash_attn_with_kvcache`` (which that wrapper calls when present,
    and callers may call directly) run ``mha_fwd_kvcache`` with it, and
    which fork is installed is not known here. A call it refuses on a newer
    fork needs only more ``block_table`` columns (``reserve=``).

    Args:
        lim: The flavor's limits (its ``name`` picks FA3's rule).
        seqlen_q: ``q.shape[1]``.
        nheads: ``q.shape[2]``.
        nheads_k: The caches' KV heads.
        head_dim: ``q.shape[3]``.
        window: ``window_size`` as the call gives it. The kernel decides the
            rewrite before it clamps a side ``>= seqlen_k`` to ``-1``, so any
            side ``>= 0`` keeps ``seqlen_q``. (Causal masking of one query is
            dropped without ALiBi, so it never sets the right side here.)
        alibi: whether ``alibi_slopes`` is given.
    """
    grouped = seqlen_q == 1 and nheads > nheads_k and head_dim % 8 == 0
    if lim.name != "fa3" and grouped and window[0] < 0 and window[1] < 0 and not alibi:
        return nheads // nheads_k
    return seqlen_q


def _check_new_kv(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    expect: list[int],
    seqlen_q: int,
    capacity: int,
) -> int:
    """Appended keys and values (both or neither) shaped ``expect`` (``-1``: any length); returns ``seqlen_new``."""
    seqlen_new = 0
    if (k is None) != (v is None):
        missing = "v" if v is None else "k"
        raise HurrayArgumentError(missing, "new keys and values go together: pass both k and v, or neither")
    if k is not None and v is not None:
        expect = [expect[0], int(k.shape[1]) if k.dim() == 4 else -1, *expect[2:]]
        for name, t in (("k", k), ("v", v)):
            if t.dtype != q.dtype:
                raise HurrayArgumentError(name, f"{name} is {t.dtype} but q is {q.dtype}; it must have q's dtype")
            if list(t.shape) != expect:
                raise HurrayArgumentError(
                    name,
                    f"{name} must be [batch, seqlen_new, nheads_k, head_dim] = {expect}, got {list(t.shape)}",
                )
            if t.stride(-1) != 1:
                raise HurrayArgumentError(
                    name, f"{name} must have a contiguous last dimension; pass {name}.contiguous()"
                )
        seqlen_new = int(k.shape[1])
        if seqlen_q > capacity:
            swapped = "" if seqlen_q == q.shape[1] else f": one query's {q.shape[2]} heads run as grouped queries"
            raise HurrayArgumentError(
                "q",
                f"with k/v given, the kernel's seqlen_q ({seqlen_q}{swapped}) must be <= the cache's seqlen "
                f"(max_num_blocks_per_seq * page_block_size = {capacity}); add columns to block_table "
                "(import with reserve=)",
            )
    return seqlen_new


def _check_descales(
    dtype: torch.dtype, lim: FlavorLimits, shape: tuple[int, int], **descales: torch.Tensor | None
) -> None:
    """fp8 descale factors: float32 ``shape`` (``[batch, nheads_k]``), only where the build takes them."""
    if lim.descales:
        for name, d in descales.items():
            if d is None:
                continue
            if dtype not in _FP8:
                raise HurrayArgumentError(
                    name, f"{name} only applies to float8 inputs; the kernel would ignore it for {dtype}"
                )
            if d.dtype != torch.float32 or tuple(d.shape) != shape:
                raise HurrayArgumentError(
                    name, f"{name} must be float32 [batch, nheads_k] = {list(shape)}, got {d.dtype} {list(d.shape)}"
                )
    else:
        for name, d in descales.items():
            if d is not None:
                raise HurrayArgumentError(name, f"{lim.kernel} takes no {name}; dequantize fp8 caches on import")


def _check_table_contents(
    block_table: torch.Tensor, cache_seqlens: torch.Tensor, seqlen_new: int, num_blocks: int, page: int
) -> None:
    """What the kernels index without bounds checks: every covered entry a page, no shared page appended to."""
    width = int(block_table.shape[1])
    # Contents: the kernels index block_table by position without bounds checks.
    lens = cache_seqlens.to(torch.int64)
    if bool((lens < 0).any()):
        raise HurrayArgumentError("cache_seqlens", "cache_seqlens must be >= 0")
    total = lens + seqlen_new
    longest = int(total.max())
    if longest > width * page:
        plus = " + seqlen_new" if seqlen_new else ""
        raise HurrayArgumentError(
            "cache_seqlens",
            f"max(cache_seqlens){plus} (= {longest}) exceeds what block_table addresses "
            f"(max_num_blocks_per_seq * page_block_size = {width * page}); add columns to block_table "
            "(import with reserve=) or the kernel reads out of bounds",
        )
    table = block_table.to(torch.int64)
    cols = torch.arange(width, device=table.device)[None, :]
    covered = cols * page < total[:, None]
    bad = covered & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise HurrayArgumentError(
            "block_table",
            f"block_table[{b}, {j}] = {int(table[b, j])} covers tokens of sequence {b} but is not a page of the "
            f"{num_blocks}-page cache",
        )
    if seqlen_new:
        # An append into a page another sequence reads corrupts it (and races with its own append).
        written = covered & (cols >= (lens // page)[:, None])
        refs = torch.bincount(table[covered], minlength=num_blocks)
        clash = written & (refs[table.clamp(0, max(num_blocks - 1, 0))] > 1)
        if bool(clash.any()):
            b, j = (int(x) for x in clash.nonzero()[0])
            raise HurrayArgumentError(
                "block_table",
                f"the new tokens of sequence {b} go to page {int(table[b, j])}, which another block_table entry "
                "also references; import with reserve= to give every sequence private tail pages",
            )
