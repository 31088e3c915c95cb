"""A fused (MLA) snapshot's layer as FlashMLA's paged latent cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import HurrayFormatError, integer_arg
from ...kv.repage import plan_repage, repage
from ...kv.snapshot import KVSnapshot
from .._common import (
    INT32_MAX,
    check_conversion,
    check_layer,
    check_one_structure,
    check_pool_values,
    check_reserve,
    convert_latent,
    layer_scales,
    padded_block_table,
    with_extra_pages,
)
from .contract import FLASH_MLA_PAGE

__all__ = ["FlashMLACache", "to_flash_mla"]


@dataclass(frozen=True, eq=False)
class FlashMLACache:
    """One layer's latent cache, ready for ``flash_mla_with_kvcache``.

    Attributes:
        k_cache: ``[num_blocks, page_size, 1, kv_lora_rank + rope_dim]``,
            contiguous: per token the compressed KV, then the rotated k_pe.
        block_table: int32 ``[batch, max_num_blocks_per_seq]``, contiguous,
            padded with page 0.
        cache_seqlens: int32 ``[batch]``.
        head_dim_v: the value width the kernel is given (``kv_lora_rank``).
        layer: the snapshot layer it came from.
    """

    k_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    head_dim_v: int
    layer: int


def to_flash_mla(
    snapshot: KVSnapshot,
    layer: int,
    *,
    page_size: int = FLASH_MLA_PAGE,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    reserve: int = 0,
) -> FlashMLACache:
    """Layer ``layer`` of an MLA snapshot as a FlashMLA paged latent cache.

    Args:
        snapshot: a fused snapshot (``snapshot.is_latent``) with known
            ``seq_lens``, none of them 0: FlashMLA builds before
            deepseek-ai/FlashMLA#150 (commit 082094b, January 2026) fail on
            empty sequences (deepseek-ai/FlashMLA#11), so they are refused,
            on newer builds too; drop them from the batch.
        layer: the layer to import.
        page_size: tokens per page; FlashMLA takes 64 (other sizes suit the
            pure-PyTorch reference and other MLA kernels).
        dtype: the cache dtype (default: the pool's; fp8 latents are
            dequantized with the layer's scale into bfloat16 unless asked
            otherwise). A float32 pool stays float32 by default, which the
            PyTorch reference takes but FlashMLA's kernel does not (it takes
            bfloat16 or float16 only): pass ``dtype=torch.bfloat16`` (or
            ``torch.float16``) for the kernel. A float8 ``dtype`` is refused: the cache carries no
            scale, so float8 latents are always dequantized, and quantizing
            needs calibrated scales this library does not choose.
        device: where the cache goes (default: the pool's device).
        reserve: tokens of room to leave after every sequence for appends.

    Returns:
        A :class:`FlashMLACache`. With ``reserve=0`` and nothing to repage,
        convert, add (no shared partial tail page to make private) or move,
        its ``k_cache`` is the snapshot's own pool (no copy): a kernel's
        appends into it change the snapshot. Else a fresh tensor.

    Raises:
        HurrayFormatError: the snapshot holds keys and values, has no lengths or
            sequences, has an empty sequence (field ``seq_lens``), has an
            inconsistent block structure (page ids outside the pool included)
            or ``kv_scales`` not one pair per layer, has a Hurray-quantized
            latent (field ``quantization``) or one not float16, bfloat16,
            float32 or float8 (field ``dtype``), or does not fit int32 indices.
        HurrayArgumentError: ``page_size`` or ``reserve`` out of range (a
            ``page_size`` that pads the batch past
            :data:`~hurray_vllm.kv.repage.MAX_IMPORT_SLOTS` slots; a
            ``reserve`` that, added to the longest sequence, passes int32 positions).
        ImportArgumentError: ``layer`` is out of range, or a ``dtype`` that is
            float8 or not floating point (a :class:`HurrayArgumentError`;
            until 0.3 also a :class:`HurrayFormatError`).
        OSError: ``ENOMEM``: the repaged latent pool is larger than the device's memory.

    Example:
        >>> from hurray_vllm import BlockPagedTensor, KVSnapshot, LatentSplit
        >>> pool = torch.randn(3, 16, 1, 576).to(torch.bfloat16)
        >>> t = BlockPagedTensor(pool, torch.tensor([0, 1, 2]), torch.tensor([0, 3]), torch.tensor([40]), "fused", 0)
        >>> snap = KVSnapshot.from_layers([(t,)], latent=LatentSplit(512, 64, "deepseek_v3"))
        >>> cache = to_flash_mla(snap, 0)
        >>> cache.k_cache.shape, cache.block_table.tolist(), cache.cache_seqlens.tolist(), cache.head_dim_v
        (torch.Size([1, 64, 1, 576]), [[0]], [40], 512)
    """
    if not snapshot.is_latent or snapshot.latent is None:
        raise HurrayFormatError("kv_role", "FlashMLA reads MLA latents; this snapshot holds keys and values")
    page_size = integer_arg(page_size, "page_size", 1)  # "64" or 64.0: a bare TypeError or a float page count
    check_reserve(reserve)
    check_layer(snapshot, layer)
    check_one_structure(snapshot, "FlashMLA")
    scale = layer_scales(snapshot, layer)[0]  # a latent's one scale
    t = snapshot.fused[layer]
    check_pool_values(t, "FlashMLA")
    check_conversion(t.dtype, dtype, "FlashMLA", keeps_scale=False)
    if t.seq_lens is None:
        raise HurrayFormatError(
            "seq_lens", "the snapshot does not carry sequence lengths; FlashMLA needs cache_seqlens"
        )
    if t.num_seqs == 0:
        raise HurrayFormatError("snapshot", "the snapshot has no sequences; FlashMLA needs batch >= 1")
    empty = (t.seq_lens == 0).nonzero()
    if empty.numel():
        raise HurrayFormatError(
            "seq_lens",
            f"sequence {int(empty[0, 0])} has no tokens: FlashMLA builds before deepseek-ai/FlashMLA#150 (commit "
            "082094b, January 2026) fail on zero-length sequences (cache_seqlens 0, deepseek-ai/FlashMLA#11), so "
            "the import refuses them; drop empty sequences from the batch (KVSnapshot.select) first",
        )
    if t.page_size != page_size:
        # num_pages: a page id past the pool is the snapshot's error here, before the gather reads it.
        plan = plan_repage(t.block_table, t.seq_ptr, t.seq_lens, t.page_size, page_size, t.num_pages)
        t = repage(t, page_size, plan)
    assert t.seq_lens is not None
    extra, table = padded_block_table(t.block_table, t.seq_ptr, t.seq_lens, t.num_pages, page_size, reserve)
    pool = convert_latent(t.page_pool, scale, dtype)
    # Private copies of shared tail pages, fresh zero pages (page 0 of an empty pool included).
    pool = with_extra_pages(pool, extra)
    longest = int(t.seq_lens.max()) if t.seq_lens.numel() else 0
    if pool.shape[0] > INT32_MAX or longest + reserve > INT32_MAX:
        raise HurrayFormatError("snapshot", "the batch does not fit FlashMLA's int32 indices")
    dev = device if device is not None else pool.device
    return FlashMLACache(
        k_cache=pool.contiguous().to(dev),
        block_table=table.to(torch.int32).contiguous().to(dev),
        cache_seqlens=t.seq_lens.to(torch.int32).contiguous().to(dev),
        head_dim_v=snapshot.latent.kv_lora_rank,
        layer=layer,
    )
