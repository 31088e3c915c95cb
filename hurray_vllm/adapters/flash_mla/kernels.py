"""Calling the installed FlashMLA kernel, after checking the call."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from .contract import check_flash_mla_args
from .importer import FlashMLACache

__all__ = ["FlashMLAUnavailableError", "flash_mla_with_kvcache"]


class FlashMLAUnavailableError(RuntimeError):
    """FlashMLA cannot run this call here (no CUDA, or the ``flash_mla`` package is missing)."""


def flash_mla_with_kvcache(
    q: torch.Tensor, cache: FlashMLACache, *, softmax_scale: float | None = None, causal: bool = False, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the contract, then run ``flash_mla.flash_mla_with_kvcache`` over ``cache``.

    Args:
        q: ``[batch, seqlen_q, num_heads_q, 576]`` on CUDA, in the cache's dtype:
            the absorbed queries (nope part then rope part).
        cache: From :func:`~.importer.to_flash_mla`, on ``q``'s device.
        softmax_scale: The kernel's default (``1 / sqrt(576)``) when ``None``.
        causal: FlashMLA's causal flag (among the ``seqlen_q`` new queries, the last
            ``seqlen_q`` tokens of each sequence: bottom-right aligned).
        **kw: Passed to the kernel unchanged.

    Returns:
        The kernel's ``(out [batch, seqlen_q, num_heads_q, 512], softmax_lse)``.

    Raises:
        HurrayArgumentError: the arguments break the kernel's contract.
        FlashMLAUnavailableError: not on CUDA, or ``flash_mla`` is not installed;
            :func:`hurray_vllm.adapters.reference.mla_paged_decode` (with the same ``causal``)
            computes the same anywhere.
    """
    check_flash_mla_args(q, cache.k_cache, cache.block_table, cache.cache_seqlens, cache.head_dim_v)
    if q.device.type != "cuda":
        raise FlashMLAUnavailableError("FlashMLA runs on CUDA; use adapters.reference.mla_paged_decode elsewhere")
    try:
        fm = importlib.import_module("flash_mla")
    except ImportError as exc:
        raise FlashMLAUnavailableError(f"the flash_mla package is not installed ({exc})") from None
    heads_k = cache.k_cache.shape[2]
    metadata, splits = fm.get_mla_metadata(cache.cache_seqlens, q.shape[1] * q.shape[2] // heads_k, heads_k)
    return fm.flash_mla_with_kvcache(
        q,
        cache.k_cache,
        cache.block_table,
        cache.cache_seqlens,
        cache.head_dim_v,
        metadata,
        splits,
        softmax_scale=softmax_scale,
        causal=causal,
        **kw,
    )
