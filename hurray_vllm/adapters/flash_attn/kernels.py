"""Calling the installed kernel: FA2, FA3 or vLLM's fork, after checking the call."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..reference import append_kv_
from .contract import check_flash_attn_args
from .importer import FlashAttnCache

__all__ = ["FlashAttnUnavailableError", "flash_attn_with_kvcache"]


class FlashAttnUnavailableError(RuntimeError):
    """No flash-attn kernel can run this call here (no CUDA, or the package is missing)."""


def flash_attn_with_kvcache(
    q: torch.Tensor,
    cache: FlashAttnCache,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    q_descale: torch.Tensor | None = None,
    **kw: Any,
) -> torch.Tensor:
    """Check the contract, then run the installed flash-attn kernel of ``cache.flavor``.

    Args:
        q: ``[batch, seqlen_q, nheads, head_dim]`` on CUDA, in the caches' dtype
            (for an fp8 fa3 cache: float8_e4m3fn, with ``q_descale``).
        cache: From :func:`to_flash_attn`, on ``q``'s device.
        k: Optional ``[batch, seqlen_new, nheads_k, head_dim]`` new tokens, written into
            ``cache``'s pools in place (use ``cache.advance(seqlen_new)`` next).
        v: Like ``k``, for values.
        softmax_scale: ``1 / sqrt(head_dim)`` by default.
        causal: Bottom-right causal mask. ``True`` by default (flash-attn's is ``False``).
        q_descale: Optional float32 ``[batch, nheads_k]``, fa3 fp8 only.
        **kw: Passed to the kernel unchanged (``window_size``, ``softcap``, ``num_splits``...);
            the reference implements ``window_size`` and ``softcap`` (``num_splits`` changes
            only how the kernel works), not ``alibi_slopes``, ``rotary_*``,
            ``cache_batch_idx`` or ``cache_leftpad``. ``cache_batch_idx``, ``cache_leftpad``,
            ``window_size`` and ``alibi_slopes`` go to :func:`check_flash_attn_args` as well
            (the first two are refused).

    Returns:
        ``[batch, seqlen_q, nheads, head_dim]`` (bfloat16 for fp8 inputs).

    Raises:
        HurrayArgumentError: When the arguments break the kernel's contract.
        FlashAttnUnavailableError: When the tensors are not on CUDA or the flavor's package is missing;
            :func:`hurray_vllm.adapters.reference.paged_attention` computes the same on any device
            (with the same ``window_size`` and ``softcap``; see ``**kw``).
    """
    check_flash_attn_args(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.cache_seqlens,
        cache.block_table,
        flavor=cache.flavor,
        k=k,
        v=v,
        q_descale=q_descale,
        k_descale=cache.k_descale,
        v_descale=cache.v_descale,
        # What the kernel gets must pass the checks too: the refused arguments, and the ones that decide
        # whether FA2 regroups a one-query decode (the capacity the appends are checked against).
        cache_batch_idx=kw.get("cache_batch_idx"),
        cache_leftpad=kw.get("cache_leftpad"),
        window_size=kw.get("window_size", (-1, -1)),
        alibi_slopes=kw.get("alibi_slopes"),
    )
    if q.device.type != "cuda":
        raise FlashAttnUnavailableError(
            f"flash-attn runs on CUDA only and q is on {q.device}; "
            "hurray_vllm.adapters.reference.paged_attention(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, "
            "cache.block_table, ...) is the reference that runs anywhere"
        )
    common: dict[str, Any] = {"softmax_scale": softmax_scale, "causal": causal, **kw}
    if cache.flavor == "fa2":
        fa2 = _import("fa2", "flash_attn")
        return fa2.flash_attn_with_kvcache(
            q,
            cache.k_cache,
            cache.v_cache,
            k=k,
            v=v,
            cache_seqlens=cache.cache_seqlens,
            block_table=cache.block_table,
            **common,
        )
    if cache.flavor == "fa3":
        fa3 = _import("fa3", "flash_attn_interface", "flash_attn_3.flash_attn_interface")
        out = fa3.flash_attn_with_kvcache(
            q,
            cache.k_cache,
            cache.v_cache,
            k=k,
            v=v,
            cache_seqlens=cache.cache_seqlens,
            page_table=cache.block_table,
            q_descale=q_descale,
            k_descale=cache.k_descale,
            v_descale=cache.v_descale,
            **common,
        )
        # Some FA3 releases return (out, softmax_lse) even when it was not asked for.
        return out[0] if isinstance(out, tuple) and not kw.get("return_softmax_lse") else out
    return _run_vllm(q, cache, k, v, common)


def _run_vllm(
    q: torch.Tensor, cache: FlashAttnCache, k: torch.Tensor | None, v: torch.Tensor | None, common: dict[str, Any]
) -> torch.Tensor:
    mod = _import("vllm", "vllm.vllm_flash_attn", "vllm_flash_attn")
    with_kvcache: Callable[..., torch.Tensor] | None = getattr(mod, "flash_attn_with_kvcache", None)
    if with_kvcache is not None:
        return with_kvcache(
            q,
            cache.k_cache,
            cache.v_cache,
            k=k,
            v=v,
            cache_seqlens=cache.cache_seqlens,
            block_table=cache.block_table,
            **common,
        )
    # Newer forks keep only the varlen entry point: append first, then attend
    # with per-sequence key counts (seqused_k), which is the same computation.
    seqlens = cache.cache_seqlens
    if k is not None and v is not None:
        append_kv_(cache.k_cache, cache.v_cache, cache.block_table, seqlens, k, v)
        seqlens = seqlens + int(k.shape[1])
    batch, seqlen_q, nheads, head_dim = q.shape
    cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
    out = mod.flash_attn_varlen_func(
        q.reshape(batch * seqlen_q, nheads, head_dim),
        cache.k_cache,
        cache.v_cache,
        max_seqlen_q=seqlen_q,
        cu_seqlens_q=cu_q,
        max_seqlen_k=int(seqlens.max()),
        seqused_k=seqlens.to(torch.int32),
        block_table=cache.block_table,
        **common,
    )
    return out.reshape(batch, seqlen_q, nheads, head_dim)


def _import(flavor: str, *modules: str) -> ModuleType:
    errors = []
    for name in modules:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise FlashAttnUnavailableError(
        f"no {flavor} kernel is installed ({'; '.join(errors)}); install it on a CUDA machine, or use "
        "hurray_vllm.adapters.reference.paged_attention as the CPU reference"
    )
