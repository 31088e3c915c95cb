"""Reference attention over paged KV caches, in plain PyTorch.

:func:`paged_attention` computes what flash-attn's ``flash_attn_with_kvcache``
computes for a paged cache (FlashAttention-2 and -3 share the semantics): it
is the oracle the CPU tests compare the importers against, and a fallback
that runs anywhere PyTorch runs (slowly: it materialises the scores).
:func:`dense_attention` is the same mathematics over one sequence's plain,
contiguous keys and values, the ground truth the paged path is checked
against.

Semantics shared with flash-attn:

* grouped-query attention: query head ``h`` reads KV head
  ``h // (nheads // nheads_k)``;
* the causal mask is aligned to the bottom right: query ``i`` of
  ``seqlen_q`` attends keys ``j <= i + seqlen_k - seqlen_q``; a query row
  that sees no key at all returns zeros;
* a sliding window ``window_size=(left, right)`` is aligned the same way:
  query ``i`` attends keys ``i + seqlen_k - seqlen_q - left <= j <= i +
  seqlen_k - seqlen_q + right`` (``-1``: unbounded on that side; ``causal``
  sets ``right`` to 0);
* ``softcap > 0`` caps the scaled scores, ``softcap * tanh(scores / softcap)``,
  before the mask and the softmax;
* new keys and values passed as ``k``/``v`` are first written into the cache
  *in place* at positions ``cache_seqlens[b] ...``, then attended;
* float8 inputs are scaled by per-(sequence, KV head) descale factors, as in
  FlashAttention-3, and then give a bfloat16 output.

All arithmetic is float32 whatever the storage dtype, so the reference is
more accurate than any kernel it checks.
"""

from __future__ import annotations

import math

import torch

from ..errors import HurrayArgumentError
from ..kv.repage import overlaps
from ._common import FP8_DTYPES as _FP8

__all__ = ["append_kv_", "dense_attention", "mla_paged_decode", "paged_attention"]


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    *,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention of one sequence over its dense keys and values.

    Args:
        q: ``[seqlen_q, nheads, head_dim]``, any floating dtype, any strides.
        k: ``[seqlen_k, nheads_k, head_dim]``, any floating dtype;
            ``nheads % nheads_k == 0``.
        v: ``[seqlen_k, nheads_k, head_dim]``, same shape as ``k``.
        causal: Apply the bottom-right aligned causal mask (query ``i`` attends keys
            ``j <= i + seqlen_k - seqlen_q``).
        softmax_scale: Scale of ``q @ k^T`` before the softmax; ``1 / sqrt(head_dim)`` by default.

    Returns:
        ``[seqlen_q, nheads, head_dim]`` in ``q``'s dtype (bfloat16 when ``q``
        is float8), computed in float32. Rows that see no key are zero.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise HurrayArgumentError(
            "q", f"dense_attention takes [T, H, D] tensors, got q{list(q.shape)} k{list(k.shape)} v{list(v.shape)}"
        )
    if k.shape != v.shape:
        raise HurrayArgumentError("v", f"v has shape {list(v.shape)} but k has {list(k.shape)}; they must match")
    _check_heads(q.shape[1], q.shape[2], k.shape[1], k.shape[2])
    seqlen_k = torch.tensor([k.shape[0]], dtype=torch.int64, device=q.device)
    out = _attend(
        q.float().unsqueeze(0),
        k.float().unsqueeze(0).to(q.device),
        v.float().unsqueeze(0).to(q.device),
        seqlen_k,
        causal=causal,
        scale=_scale(softmax_scale, q.shape[-1]),
    )
    return out.squeeze(0).to(_out_dtype(q.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over a paged KV cache, with ``flash_attn_with_kvcache`` semantics.

    Vectorised over the batch: the covered pages of every sequence are
    gathered at once into a ``[batch, max_seqlen_k, nheads_k, head_dim]``
    float32 buffer, so memory grows with ``batch * max_seqlen_k``.

    Args:
        q: ``[batch, seqlen_q, nheads, head_dim]``, float16, bfloat16, float32 or
            float8 (then scaled by ``q_descale``).
        k_cache: ``[num_blocks, page_block_size, nheads_k, head_dim]``, any floating
            dtype (float8 is scaled by ``k_descale``); ``nheads % nheads_k == 0``.
            Modified in place when ``k`` is given.
        v_cache: ``[num_blocks, page_block_size, nheads_k, head_dim]``, same shape and
            dtype as ``k_cache``. Modified in place when ``v`` is given.
        cache_seqlens: ``[batch]``, integer (flash-attn requires int32): tokens already in
            the cache per sequence, before ``k``/``v`` are appended.
        block_table: ``[batch, max_num_blocks_per_seq]``, integer (flash-attn requires
            int32): row ``b`` lists the physical pages of sequence ``b`` in
            logical order. Only the entries that cover
            ``cache_seqlens[b] + seqlen_new`` tokens are read; the rest is padding.
        k: Optional ``[batch, seqlen_new, nheads_k, head_dim]`` in ``k_cache``'s dtype:
            new keys, written at positions ``cache_seqlens[b] ..`` of sequence
            ``b`` before attending (the cache must have room for them). Not
            memory of either cache (a view of one is refused).
        v: Optional ``[batch, seqlen_new, nheads_k, head_dim]``, with ``k``, likewise.
        softmax_scale: Scale of ``q @ k^T``; ``1 / sqrt(head_dim)`` by default.
        causal: Bottom-right aligned causal mask over ``seqlen_k = cache_seqlens[b] +
            seqlen_new``. (flash-attn's own default is ``False``; this one's is
            ``True`` because decoding and chunked prefill need it.)
        window_size: ``(left, right)``, flash-attn's sliding window, aligned
            like the causal mask: query ``i`` attends keys ``j`` with ``j >=
            i + seqlen_k - seqlen_q - left`` (when ``left >= 0``) and ``j <=
            i + seqlen_k - seqlen_q + right`` (when ``right >= 0``; ``causal``
            makes ``right`` 0). ``(-1, -1)``, the default, is no window.
        softcap: flash-attn's logit soft-capping: with ``softcap > 0`` the
            scaled scores become ``softcap * tanh(scores / softcap)`` before
            the mask and the softmax. ``0``, the default, is none.
        q_descale: Optional ``[batch, nheads_k]`` float32, exactly that shape
            (FlashAttention-3 refuses any other; a broadcastable one would scale
            the wrong sequences or heads): the stored value times its descale is
            the real value (FlashAttention-3's fp8 convention; ``q_descale`` is
            per KV head too). ``None`` means 1.
        k_descale: Like ``q_descale``, for ``k_cache``.
        v_descale: Like ``q_descale``, for ``v_cache``.

    Returns:
        ``[batch, seqlen_q, nheads, head_dim]`` in ``q``'s dtype (bfloat16 when
        ``q`` is float8). Rows that see no key are zero.

    Raises:
        HurrayArgumentError: arguments that do not fit together (shapes,
            heads, lengths, block-table entries that are not pages of the
            cache, descales not ``[batch, nheads_k]``, ``k``/``v`` that share
            memory with a cache, ``window_size``, ``softcap``), before
            ``k``/``v`` are written into the cache: a refused call leaves it
            as it was.

    flash-attn's other options (``alibi_slopes``, ``rotary_cos``/``rotary_sin``,
    ``cache_batch_idx``, ``cache_leftpad``) are not implemented here.
    """
    if q.dim() != 4:
        raise HurrayArgumentError("q", f"expected [batch, seqlen_q, nheads, head_dim], got shape {list(q.shape)}")
    _check_caches(k_cache, v_cache)
    batch, _, nheads, head_dim = q.shape
    nheads_k = int(k_cache.shape[2])
    _check_heads(nheads, head_dim, nheads_k, k_cache.shape[3])
    window = _check_window(window_size)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise HurrayArgumentError("softcap", f"must be a finite number >= 0 (0: no capping), got {softcap}")
    for name, descale in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if descale is not None and (not isinstance(descale, torch.Tensor) or descale.shape != (batch, nheads_k)):
            got = list(descale.shape) if isinstance(descale, torch.Tensor) else type(descale).__name__
            raise HurrayArgumentError(
                name, f"expected [batch={batch}, nheads_k={nheads_k}], as FlashAttention-3 takes, got {got}"
            )
    dev = q.device
    seqlen_new = 0
    if (k is None) != (v is None):
        raise HurrayArgumentError("v" if v is None else "k", "pass both k and v to append new tokens, or neither")
    if k is not None and v is not None:
        _check_new_kv(k_cache, v_cache, k, v, batch)
        seqlen_new = int(k.shape[1])
    # Everything is checked before the append: a call refused after writing would leave the
    # caller's cache changed by a call that failed.
    lens, table, ids = _check_paged(k_cache, block_table, cache_seqlens, batch, seqlen_new, dev)
    if batch == 0:
        # Nothing to attend; the gather below cannot shape an empty batch ([0, -1, ...] is ambiguous).
        return torch.empty((0, *q.shape[1:]), dtype=_out_dtype(q.dtype), device=dev)
    if k is not None and v is not None:
        _append_kv(k_cache, v_cache, table, lens, k, v)
    kf = _gather(k_cache, ids, k_descale, batch)
    vf = _gather(v_cache, ids, v_descale, batch)
    qf = q.float()
    if q_descale is not None:
        group = nheads // nheads_k
        qf = qf * q_descale.to(dev, torch.float32).repeat_interleave(group, dim=1)[:, None, :, None]
    scale = _scale(softmax_scale, head_dim)
    out = _attend(qf, kf, vf, lens + seqlen_new, causal=causal, scale=scale, window=window, softcap=softcap)
    return out.to(_out_dtype(q.dtype))


def append_kv_(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write new tokens into a paged cache in place, as ``flash_attn_with_kvcache`` does.

    A page written by two sequences ends with either's token, as in the
    kernel; :func:`hurray_vllm.adapters.flash_attn.check_flash_attn_args`
    refuses such batches.

    Args:
        k_cache: ``[num_blocks, page_block_size, nheads_k, head_dim]``, written in place.
        v_cache: ``[num_blocks, page_block_size, nheads_k, head_dim]``, like ``k_cache``.
        block_table: ``[batch, max_num_blocks_per_seq]``, integer: it must
            cover ``cache_seqlens[b] + seqlen_new`` tokens of sequence ``b``
            with pages of the cache.
        cache_seqlens: ``[batch]``, integer, ``>= 0``: token ``t`` of ``k[b]`` goes to position
            ``cache_seqlens[b] + t`` of sequence ``b``. Not updated.
        k: ``[batch, seqlen_new, nheads_k, head_dim]`` in the caches' dtype, the new keys;
            not memory of either cache.
        v: ``[batch, seqlen_new, nheads_k, head_dim]`` in the caches' dtype, the new values;
            not memory of either cache.

    Raises:
        HurrayArgumentError: arguments that do not fit together, checked as
            :func:`paged_attention` checks them (shapes, lengths, block-table
            entries that are not pages of the cache, ``k``/``v`` that share
            memory with a cache), before anything is written: a refused call
            leaves the caches as they were.
    """
    _check_caches(k_cache, v_cache)
    _check_new_kv(k_cache, v_cache, k, v)
    lens, table, _ = _check_paged(k_cache, block_table, cache_seqlens, int(k.shape[0]), int(k.shape[1]), k_cache.device)
    _append_kv(k_cache, v_cache, table, lens, k, v)


def _append_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """:func:`append_kv_` once :func:`_check_paged` accepted ``table`` and ``lens`` (int64) for ``k``/``v``."""
    batch, seqlen_new = int(k.shape[0]), int(k.shape[1])
    if seqlen_new == 0 or batch == 0:
        return
    page = int(k_cache.shape[1])
    dev = k_cache.device
    pos = lens.to(dev)[:, None] + torch.arange(seqlen_new, device=dev)[None, :]
    pages = table.to(dev).gather(1, pos // page).reshape(-1)
    offs = (pos % page).reshape(-1)
    k_cache[pages, offs] = k.reshape(-1, *k.shape[2:]).to(dev)
    v_cache[pages, offs] = v.reshape(-1, *v.shape[2:]).to(dev)


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Refuse caches that are not both ``[num_blocks, page_block_size, nheads_k, head_dim]`` of one shape."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise HurrayArgumentError(
            "k_cache",
            f"k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} must both be "
            "[num_blocks, page_block_size, nheads_k, head_dim]",
        )


def _check_paged(
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    batch: int,
    seqlen_new: int,
    dev: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Refuse a block table and lengths that do not place ``batch`` sequences (+ ``seqlen_new``) in ``k_cache``.

    The checks :func:`paged_attention` and :func:`append_kv_` share. Only the
    block-table entries that cover ``cache_seqlens[b] + seqlen_new`` tokens are
    read; the rest of a row is padding and may hold anything.

    Returns:
        ``(lens, table, ids)`` on ``dev``: ``cache_seqlens`` int64 ``[batch]``,
        ``block_table`` int64 ``[batch, max_num_blocks_per_seq]``, and the
        covered pages int64 ``[batch, npages]`` (0 where not covered).

    Raises:
        HurrayArgumentError: naming ``block_table`` (not ``[batch, n]``, or a
            covered entry that is not a page of the cache) or ``cache_seqlens``
            (not ``[batch]``, negative, or needing more pages than the table has columns).
    """
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise HurrayArgumentError(
            "block_table", f"expected [batch={batch}, max_num_blocks_per_seq], got shape {list(block_table.shape)}"
        )
    if cache_seqlens.shape != (batch,):
        raise HurrayArgumentError("cache_seqlens", f"expected [batch={batch}], got shape {list(cache_seqlens.shape)}")
    lens = cache_seqlens.to(dev, torch.int64)
    table = block_table.to(dev, torch.int64)
    if bool((lens < 0).any()):
        raise HurrayArgumentError("cache_seqlens", "sequence lengths must be >= 0")
    if batch == 0:
        return lens, table, table
    num_blocks, page = int(k_cache.shape[0]), int(k_cache.shape[1])
    total = lens + seqlen_new
    npages = -(-int(total.max()) // page)
    if npages > table.shape[1]:
        raise HurrayArgumentError(
            "cache_seqlens",
            f"a sequence needs {npages} pages of {page} for its tokens and {seqlen_new} new ones, but block_table "
            f"has {table.shape[1]} columns; widen block_table (import with reserve= for appends) or shorten "
            "cache_seqlens",
        )
    covered = torch.arange(npages, device=dev)[None, :] * page < total[:, None]
    ids = torch.where(covered, table[:, :npages], torch.zeros_like(table[:, :npages]))
    bad = covered & ((ids < 0) | (ids >= num_blocks))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise HurrayArgumentError(
            "block_table",
            f"block_table[{b}, {j}] = {int(table[b, j])} is not a page of the {num_blocks}-block cache",
        )
    return lens, table, ids


def _check_new_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int | None = None
) -> None:
    """Refuse new tokens ``k``/``v`` that are not ``[batch, seqlen_new, nheads_k, head_dim]`` in the caches' dtype.

    Or that share memory with either cache: the append writes ``k_cache``
    first, so a ``v`` (or ``k``) viewing it would be read after it changed,
    and torch refuses a write from a view of its own destination halfway.
    """
    if k.dim() != 4:
        raise HurrayArgumentError("k", f"expected [batch, seqlen_new, nheads_k, head_dim], got {list(k.shape)}")
    expect = (k.shape[0] if batch is None else batch, k.shape[1], *k_cache.shape[2:])
    for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if tuple(new.shape) != expect:
            raise HurrayArgumentError(
                name, f"expected [batch, seqlen_new, nheads_k, head_dim] = {list(expect)}, got {list(new.shape)}"
            )
        if new.dtype != cache.dtype:
            raise HurrayArgumentError(name, f"{name} is {new.dtype} but the cache is {cache.dtype}; convert it first")
        for cache_name, written in (("k_cache", k_cache), ("v_cache", v_cache)):
            if overlaps(new, written):
                raise HurrayArgumentError(
                    name, f"{name} shares memory with {cache_name}, which the append writes; pass a copy (clone())"
                )


def _check_window(window_size: tuple[int, int]) -> tuple[int, int]:
    """``window_size`` as ``(left, right)`` ints, each ``>= -1`` (``-1``: unbounded)."""
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise HurrayArgumentError("window_size", f"must be a (left, right) pair of ints, got {window_size!r}") from None
    if left < -1 or right < -1:
        raise HurrayArgumentError("window_size", f"sides must be >= 0, or -1 for unbounded; got {window_size!r}")
    return left, right


def _visible(
    seqlen_q: int, seqlen_k: torch.Tensor, length: int, *, causal: bool, window: tuple[int, int] = (-1, -1)
) -> torch.Tensor:
    """``[B, seqlen_q, length]`` bool: whether query ``i`` of sequence ``b`` attends key ``j``.

    flash-attn's masks, aligned to the bottom right: query ``i`` sits at key
    position ``i + seqlen_k[b] - seqlen_q``; keys past ``seqlen_k[b]`` are
    padding.
    """
    dev = seqlen_k.device
    j = torch.arange(length, device=dev)[None, None, :]
    at = torch.arange(seqlen_q, device=dev)[None, :, None] + (seqlen_k - seqlen_q)[:, None, None]  # [B, Sq, 1]
    mask = j < seqlen_k[:, None, None]
    left, right = window
    if causal:
        right = 0  # as flash-attn does: causal is the window (left, 0)
    if left >= 0:
        mask = mask & (j >= at - left)
    if right >= 0:
        mask = mask & (j <= at + right)
    return mask


def _gather(cache: torch.Tensor, ids: torch.Tensor, descale: torch.Tensor | None, batch: int) -> torch.Tensor:
    """``[batch, npages * page, nheads_k, head_dim]`` float32 from the pages ``ids`` ``[batch, npages]``."""
    # Gather on the cache's device: only the covered pages travel, not the pool.
    pages = cache[ids.to(cache.device)].to(ids.device).float()
    out = pages.reshape(batch, -1, *cache.shape[2:])
    if descale is not None:
        out = out * descale.to(ids.device, torch.float32)[:, None, :, None]
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlen_k: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """float32 attention: q ``[B, Sq, H, D]``, k/v ``[B, L, Hk, D]``, ``seqlen_k[b] <= L`` keys valid."""
    batch, seqlen_q, nheads, head_dim = q.shape
    length, nheads_k = k.shape[1], k.shape[2]
    qg = q.reshape(batch, seqlen_q, nheads_k, nheads // nheads_k, head_dim)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    dev = q.device
    mask = _visible(seqlen_q, seqlen_k.to(dev), length, causal=causal, window=window)
    mask = mask[:, None, None]  # [B, 1, 1, Sq, L]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    # A row with no visible key is all -inf: softmax gives NaN there, flash-attn gives 0.
    probs = torch.where(mask, probs, torch.zeros((), device=dev))
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v)
    return out.reshape(batch, seqlen_q, nheads, head_dim)


def _check_heads(nheads: int, head_dim: int, nheads_k: int, head_dim_k: int) -> None:
    if nheads_k == 0 or nheads % nheads_k:
        raise HurrayArgumentError(
            "q", f"nheads ({nheads}) must be a multiple of the KV heads ({nheads_k}) for grouped-query attention"
        )
    if head_dim != head_dim_k:
        raise HurrayArgumentError("k_cache", f"head_dim of the keys ({head_dim_k}) differs from q's ({head_dim})")


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    # FlashAttention-3 returns bf16 for fp8 inputs; a float8 output would lose the result.
    return torch.bfloat16 if dtype in _FP8 else dtype


def mla_paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    head_dim_v: int,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """MLA decode over a paged latent cache, as FlashMLA and FlashInfer's MLA kernels compute it.

    The absorbed form (DeepSeek-V2 section 2.1.2): every query head attends
    the one latent "head" with all ``C`` values (compressed KV and rotated
    k_pe), and takes the first ``head_dim_v`` values (the compressed KV) as
    its values; the caller applies the absorbed up-projections around it.

    Args:
        q: ``[batch, seqlen_q, nheads, C]`` (``C = kv_lora_rank + rope_dim``),
            any floating dtype: the absorbed queries, nope part then rope part.
        kv_cache: ``[num_blocks, page_block_size, 1, C]``, the latent pool (a
            fused snapshot layer's layout).
        block_table: ``[batch, max_num_blocks_per_seq]``, integer: sequence
            ``b``'s pages in order (entries past its tokens are padding).
        cache_seqlens: ``[batch]``, integer: tokens per sequence.
        head_dim_v: how many leading latent values are the values (``kv_lora_rank``).
        softmax_scale: scale of the scores; ``1 / sqrt(C)`` by default (FlashMLA's
            default; DeepSeek passes ``1 / sqrt(qk_nope + qk_rope)`` instead).
        causal: FlashMLA's ``causal`` flag: the ``seqlen_q`` queries are the
            last ``seqlen_q`` tokens of the ``cache_seqlens[b]`` (speculative
            decoding), and query ``i`` attends keys ``j <= i + cache_seqlens[b]
            - seqlen_q`` (bottom-right aligned, as flash-attn's). With one
            query it changes nothing.

    Returns:
        ``[batch, seqlen_q, nheads, head_dim_v]`` float32. Without ``causal``
        every query row attends all ``cache_seqlens[b]`` tokens; a row that
        sees no token (a sequence with none) gives zeros.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        raise HurrayArgumentError("kv_cache", f"expected a latent cache [N, P, 1, C], got {list(kv_cache.shape)}")
    # The cache fixes C: a query of another width is the query's error.
    if q.dim() != 4 or q.shape[-1] != kv_cache.shape[-1]:
        raise HurrayArgumentError(
            "q", f"expected [batch, seqlen_q, nheads, C={kv_cache.shape[-1]}] (the cache's C), got {list(q.shape)}"
        )
    if not 0 < head_dim_v <= kv_cache.shape[-1]:
        raise HurrayArgumentError("head_dim_v", f"{head_dim_v} is not within the latent's {kv_cache.shape[-1]} values")
    batch, _, _, c = q.shape
    page = kv_cache.shape[1]
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise HurrayArgumentError(
            "block_table", f"expected [batch={batch}, max_num_blocks_per_seq], got shape {list(block_table.shape)}"
        )
    if tuple(cache_seqlens.shape) != (batch,):
        raise HurrayArgumentError("cache_seqlens", f"expected [batch={batch}], got shape {list(cache_seqlens.shape)}")
    lens = cache_seqlens.to(torch.int64).cpu()
    if bool((lens < 0).any()):
        raise HurrayArgumentError("cache_seqlens", "sequence lengths must be >= 0")
    npages = int(-(-lens.max() // page)) if batch else 0
    if npages > block_table.shape[1]:
        raise HurrayArgumentError(
            "cache_seqlens",
            f"a sequence needs {npages} pages of {page} but block_table has {block_table.shape[1]} columns",
        )
    covered = torch.arange(npages)[None, :] * page < lens[:, None]
    ids = block_table[:, :npages].to(torch.int64).cpu()
    if bool((covered & ((ids < 0) | (ids >= kv_cache.shape[0]))).any()):
        raise HurrayArgumentError(
            "block_table", f"a covered entry is not a page of the {kv_cache.shape[0]}-block cache"
        )
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(c)
    out = torch.zeros((*q.shape[:3], head_dim_v), dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(cache_seqlens[b])
        if n == 0:
            continue
        pages = block_table[b, : -(-n // page)].to(torch.int64).to(kv_cache.device)
        lat = kv_cache.index_select(0, pages).reshape(-1, c)[:n].float().to(q.device)  # [n, C]
        scores = torch.einsum("shc,nc->shn", q[b].float(), lat) * scale
        seen = _visible(q.shape[1], torch.tensor([n], device=q.device), n, causal=causal)[0][:, None, :]  # [s, 1, n]
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        # A query that sees no key (more queries than tokens, causal) is all -inf: zeros, not NaN.
        probs = torch.where(seen, probs, torch.zeros((), device=q.device))
        out[b] = torch.einsum("shn,nv->shv", probs, lat[:, :head_dim_v])
    return out
