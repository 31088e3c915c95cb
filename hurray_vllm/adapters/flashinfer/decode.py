"""What FlashInfer's batch decode returns, computed in float32 on any device (the reference)."""

from __future__ import annotations

import math

import torch

from .cache import FlashInferCache

__all__ = ["reference_decode"]


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
        cache: the paged KV (checked with ``strict_dtypes=False`` and
            ``use_tensor_cores=True``: any group size).
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
    # Any group size: the tensor-core decode computes the same for the sizes the CUDA-core one lacks.
    cache.check(q, strict_dtypes=False, use_tensor_cores=True)
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
