"""Calling the installed kernel: FA2, FA3 or vLLM's fork, after checking the call."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ...errors import HurrayArgumentError
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
        ``[batch, seqlen_q, nheads, head_dim]`` (bfloat16 for fp8 inputs); with
        ``return_softmax_lse=True``, ``(out, softmax_lse)`` as the kernel returns them
        (for vllm: float32 ``[batch, nheads, seqlen_q]``, also through the varlen fallback).

    Raises:
        HurrayArgumentError: When the arguments break the kernel's contract (for a vllm fork without
            ``flash_attn_with_kvcache``, also a keyword its ``flash_attn_varlen_func`` does not take, or
            ``num_splits > 1`` on FA2), before ``k``/``v`` are written. If the kernel refuses the call
            (raises), the caches are left as they were.
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
) -> Any:
    """Run vLLM's fork: its ``flash_attn_with_kvcache`` if it has one, else append and ``flash_attn_varlen_func``.

    Returns what ``flash_attn_with_kvcache`` returns: ``out``, or ``(out, softmax_lse)`` with
    ``return_softmax_lse=True`` (``softmax_lse`` float32 ``[batch, nheads, seqlen_q]``).
    """
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
    # Newer forks (since vllm-project/flash-attention#107) keep only the varlen entry point: append first,
    # then attend with per-sequence key counts (seqused_k), which is the same computation.
    varlen: Callable[..., Any] = mod.flash_attn_varlen_func
    # Everything that can be refused is refused before the append writes the caches.
    _check_varlen_kwargs(varlen, common)
    seqlens = cache.cache_seqlens
    restore: Callable[[], None] | None = None
    if k is not None and v is not None:
        restore = _saved_slots(cache, int(k.shape[1]))
        append_kv_(cache.k_cache, cache.v_cache, cache.block_table, seqlens, k, v)
        seqlens = seqlens + int(k.shape[1])
    batch, seqlen_q, nheads, head_dim = q.shape
    cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
    try:
        res = varlen(
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
    except BaseException:
        # The kernel must see the new tokens, so they are written first; a refused call takes them back,
        # as flash_attn_with_kvcache (which checks before it appends) leaves the caches.
        if restore is not None:
            restore()
        raise
    if common.get("return_softmax_lse"):
        out, lse = res
        # varlen's softmax_lse is [nheads, total_q] with total_q = batch * seqlen_q in q's order (the
        # regrouped one-query decode is transposed back by the kernel); flash_attn_with_kvcache's is
        # [batch, nheads, seqlen_q].
        lse = lse.reshape(nheads, batch, seqlen_q).transpose(0, 1).contiguous()
        return out.reshape(batch, seqlen_q, nheads, head_dim), lse
    return res.reshape(batch, seqlen_q, nheads, head_dim)


def _check_varlen_kwargs(varlen: Callable[..., Any], common: dict[str, Any]) -> None:
    """Refuse, before anything is written, the keyword arguments ``flash_attn_varlen_func`` would refuse."""
    try:
        params = inspect.signature(varlen).parameters
    except (TypeError, ValueError):  # no Python signature: leave the kwargs to the kernel
        params = None
    if params is not None and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        for name in common:
            if name not in params:
                hint = "; apply the rotary embedding to q and k before the call" if name.startswith("rotary") else ""
                raise HurrayArgumentError(
                    name,
                    f"vllm.vllm_flash_attn.flash_attn_varlen_func (this fork's only paged entry point) takes no "
                    f"{name}; drop it{hint}",
                )
    # The fork's FA2 path raises NotImplementedError for num_splits > 1 (and mha_varlen_fwd refuses it for a
    # paged cache); FA3 (fa_version=3) takes it.
    num_splits = common.get("num_splits")
    if num_splits is not None and int(num_splits) > 1 and common.get("fa_version", 2) != 3:
        raise HurrayArgumentError(
            "num_splits",
            f"vllm.vllm_flash_attn.flash_attn_varlen_func's FA2 kernel does not support num_splits > 1 "
            f"(got {num_splits}); leave num_splits at 0, or pass fa_version=3 on Hopper",
        )


def _saved_slots(cache: FlashAttnCache, seqlen_new: int) -> Callable[[], None]:
    """Copy the cache slots an append of ``seqlen_new`` tokens overwrites; the result puts them back.

    The contract checked already that every slot is a page of the cache and that no two sequences
    write the same page, so the slots are distinct and putting them back is exact.
    """
    k_cache, v_cache = cache.k_cache, cache.v_cache
    if seqlen_new == 0:
        return lambda: None
    page, dev = int(k_cache.shape[1]), k_cache.device
    lens = cache.cache_seqlens.to(dev, torch.int64)
    pos = lens[:, None] + torch.arange(seqlen_new, device=dev)[None, :]
    pages = cache.block_table.to(dev, torch.int64).gather(1, pos // page).reshape(-1)
    offs = (pos % page).reshape(-1)
    old_k, old_v = k_cache[pages, offs], v_cache[pages, offs]  # advanced indexing: copies

    def restore() -> None:
        k_cache[pages, offs] = old_k
        v_cache[pages, offs] = old_v

    return restore


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
