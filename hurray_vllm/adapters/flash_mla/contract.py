"""The argument checks ``flash_mla_with_kvcache`` makes (FlashMLA's ``csrc/api/dense_decode.h``), in Python."""

from __future__ import annotations

import torch

from ...errors import HurrayArgumentError

__all__ = ["FLASH_MLA_HEAD_DIM", "FLASH_MLA_HEAD_DIM_V", "FLASH_MLA_PAGE", "check_flash_mla_args"]

#: Tokens per page the kernel takes (``page_block_size == 64``).
FLASH_MLA_PAGE = 64
#: The latent width it takes: kv_lora_rank 512 + rope 64.
FLASH_MLA_HEAD_DIM = 576
#: Every ``head_size_k`` the dense decode takes: the latent with its rope part, or the compressed KV alone.
_HEAD_DIMS = (FLASH_MLA_HEAD_DIM, 512)
#: The value width: the compressed KV (kv_lora_rank).
FLASH_MLA_HEAD_DIM_V = 512
_DTYPES = (torch.bfloat16, torch.float16)


def check_flash_mla_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
) -> None:
    """Refuse a call FlashMLA would refuse (or read out of bounds with), naming the argument.

    Args:
        q: ``[batch, seqlen_q, num_heads_q, head_dim]``, ``batch >= 1``, ``head_dim`` 576
            (or 512: no rope part), bfloat16 or float16, last dim contiguous.
        k_cache: ``[num_blocks, 64, num_heads_k, head_dim]`` in ``q``'s dtype, last dim
            contiguous; ``num_heads_k >= 1`` divides ``num_heads_q``.
        block_table: int32 ``[batch, max_num_blocks_per_seq]``, last dim contiguous; every
            entry that covers ``cache_seqlens[b]`` tokens is a page of ``k_cache``.
        cache_seqlens: int32 ``[batch]``, contiguous, ``>= 1``. FlashMLA's dense
            decode runs zero-length sequences since deepseek-ai/FlashMLA#150
            (commit 082094b, January 2026), but older builds fail on them
            (deepseek-ai/FlashMLA#11), so this check stays conservative and
            refuses them.
        head_dim_v: 512.

    Raises:
        HurrayArgumentError: with ``field`` the argument that breaks the contract.
    """
    if q.dim() != 4:
        raise HurrayArgumentError("q", f"expected [batch, seqlen_q, heads, head_dim], got {list(q.shape)}")
    if q.dtype not in _DTYPES:
        raise HurrayArgumentError("q", f"FlashMLA takes bfloat16 or float16 queries, not {q.dtype}")
    if k_cache.dtype != q.dtype:
        raise HurrayArgumentError("k_cache", f"k_cache is {k_cache.dtype} but q is {q.dtype}: they must match")
    for name, t in (("q", q), ("k_cache", k_cache), ("block_table", block_table)):
        if t.stride(-1) != 1:
            raise HurrayArgumentError(name, f"{name} must have a contiguous last dimension")
        if t.device != q.device:
            raise HurrayArgumentError(name, f"{name} is on {t.device}, q on {q.device}")
    if cache_seqlens.device != q.device:
        raise HurrayArgumentError("cache_seqlens", f"cache_seqlens is on {cache_seqlens.device}, q on {q.device}")
    batch, _, heads_q, head_dim = q.shape
    if batch <= 0:
        raise HurrayArgumentError("q", "batch size must be positive")
    if head_dim not in _HEAD_DIMS:
        raise HurrayArgumentError(
            "q", f"head_dim must be {FLASH_MLA_HEAD_DIM} (kv_lora_rank 512 + rope 64) or 512, not {head_dim}"
        )
    if head_dim_v != FLASH_MLA_HEAD_DIM_V:
        raise HurrayArgumentError("head_dim_v", f"head_dim_v must be {FLASH_MLA_HEAD_DIM_V}, not {head_dim_v}")
    if k_cache.dim() != 4 or k_cache.shape[1] != FLASH_MLA_PAGE or k_cache.shape[3] != head_dim:
        raise HurrayArgumentError(
            "k_cache", f"expected [num_blocks, {FLASH_MLA_PAGE}, heads_k, {head_dim}], got {list(k_cache.shape)}"
        )
    heads_k = k_cache.shape[2]
    if heads_k == 0:
        raise HurrayArgumentError("k_cache", "k_cache has no heads (num_heads_k == 0)")
    if heads_q % heads_k:
        raise HurrayArgumentError("q", f"{heads_q} query heads are not a multiple of {heads_k} KV heads")
    for name, t in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if t.dtype != torch.int32:
            raise HurrayArgumentError(name, f"{name} must be int32, not {t.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise HurrayArgumentError(
            "block_table", f"expected [{batch}, max_num_blocks_per_seq], got {list(block_table.shape)}"
        )
    if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != batch:
        raise HurrayArgumentError("cache_seqlens", f"expected [{batch}], got {list(cache_seqlens.shape)}")
    if not cache_seqlens.is_contiguous():
        raise HurrayArgumentError("cache_seqlens", "cache_seqlens must be contiguous")
    lens = cache_seqlens.to(torch.int64).cpu()
    if bool((lens < 0).any()):
        raise HurrayArgumentError("cache_seqlens", "sequence lengths must be >= 0")
    empty = (lens == 0).nonzero()
    if empty.numel():
        raise HurrayArgumentError(
            "cache_seqlens",
            f"cache_seqlens[{int(empty[0, 0])}] is 0: FlashMLA builds before deepseek-ai/FlashMLA#150 (commit "
            "082094b, January 2026) fail on zero-length sequences (deepseek-ai/FlashMLA#11), so this check refuses "
            "them; drop empty sequences from the batch",
        )
    need = (lens + FLASH_MLA_PAGE - 1) // FLASH_MLA_PAGE
    if (int(need.max()) if need.numel() else 0) > block_table.shape[1]:
        raise HurrayArgumentError("block_table", "a sequence needs more pages than its block-table row holds")
    table = block_table.to(torch.int64).cpu()
    covered = torch.arange(block_table.shape[1])[None, :] < need[:, None]
    used = table[covered]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= k_cache.shape[0]):
        raise HurrayArgumentError("block_table", f"entries must name pages of k_cache (0..{k_cache.shape[0] - 1})")
