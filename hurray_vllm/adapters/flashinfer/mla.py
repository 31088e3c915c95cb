"""FlashInfer's MLA paged API: an MLA snapshot's layer as ``ckv_cache`` and ``kpe_cache`` page pools.

``flashinfer.mla.BatchMLAPagedAttentionWrapper`` keeps the latent in two
pools, ``ckv_cache [num_pages, page_size, kv_lora_rank]`` and ``kpe_cache
[num_pages, page_size, qk_rope_head_dim]``, addressed by CSR page lists
(``kv_indptr``, ``kv_indices``) and per-request token counts
(``kv_len_arr``) that ``plan()`` takes; ``run(q_nope, q_pe, ckv_cache,
kpe_cache)`` then attends them. A fused snapshot layer is exactly the two
pools side by side along the last axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import HurrayFormatError, integer_arg
from ...kv.repage import plan_repage, repage
from ...kv.snapshot import KVSnapshot
from .._common import (
    INT32_MAX,
    check_conversion,
    check_csr,
    check_layer,
    check_one_structure,
    check_pool_values,
    convert_latent,
    layer_scales,
)

__all__ = ["FlashInferMLACache", "to_flashinfer_mla"]


@dataclass(frozen=True, eq=False)
class FlashInferMLACache:
    """One layer's latent, as ``BatchMLAPagedAttentionWrapper.plan``/``run`` take it.

    Attributes:
        ckv_cache: ``[num_pages, page_size, kv_lora_rank]``, contiguous: the compressed KV.
        kpe_cache: ``[num_pages, page_size, rope_dim]``, contiguous: the rotated k_pe.
        kv_indptr: int32 ``[batch + 1]``: request ``b``'s pages are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
        kv_indices: int32 ``[kv_indptr[-1]]``, page ids in token order.
        kv_len_arr: int32 ``[batch]``, tokens per request.
        page_size: tokens per page.
        layer: the snapshot layer it came from.
    """

    ckv_cache: torch.Tensor
    kpe_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len_arr: torch.Tensor
    page_size: int
    layer: int


def to_flashinfer_mla(
    snapshot: KVSnapshot,
    layer: int,
    *,
    page_size: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> FlashInferMLACache:
    """Layer ``layer`` of an MLA snapshot as FlashInfer's two MLA page pools and their index arrays.

    Args:
        snapshot: a fused snapshot (``snapshot.is_latent``) with known ``seq_lens``.
        layer: the layer to import.
        page_size: tokens per page (default: the snapshot's; FlashInfer's MLA
            kernels take any page size, 1 included).
        dtype: the pools' dtype (default: the snapshot's; fp8 latents are
            dequantized with the layer's scale into bfloat16 unless asked
            otherwise). A float32 latent stays float32 by default, and
            ``dtype=torch.float32`` is accepted: the PyTorch reference
            computes with such pools, but FlashInfer's MLA ``plan()`` takes
            ``kv_data_type`` float16, bfloat16 or float8_e4m3fn only, so pass
            ``dtype=torch.bfloat16`` (or ``torch.float16``) for the kernel.
            A float8 ``dtype`` is refused: the MLA pools carry no scale, so
            float8 latents are always dequantized, and quantizing needs
            calibrated scales this library does not choose.
        device: where the tensors go (default: the pool's device).

    Returns:
        A :class:`FlashInferMLACache`; prefix sharing is kept (two requests
        may list one page).

    Raises:
        HurrayFormatError: the snapshot holds keys and values, lacks sequence
            lengths, has an inconsistent block structure (the page lists go to
            the kernel as they are, so each sequence must own exactly the
            pages its tokens need, all inside the pool), has ``kv_scales``
            not one pair per layer, a Hurray-quantized latent (field
            ``quantization``) or one not float16, bfloat16, float32 or float8
            (field ``dtype``), or does not fit int32 indices.
        HurrayArgumentError: ``page_size`` is not a positive integer.
        ImportArgumentError: ``layer`` is out of range, or a ``dtype`` that is
            float8 or not floating point (a :class:`HurrayArgumentError`;
            until 0.3 also a :class:`HurrayFormatError`).
        OSError: ``ENOMEM``: the repaged latent pool is larger than the device's memory.

    Example:
        >>> from hurray_vllm import BlockPagedTensor, KVSnapshot, LatentSplit
        >>> pool = torch.randn(3, 16, 1, 576).to(torch.bfloat16)
        >>> t = BlockPagedTensor(pool, torch.tensor([2, 0, 1]), torch.tensor([0, 3]), torch.tensor([40]), "fused", 0)
        >>> mla = to_flashinfer_mla(KVSnapshot.from_layers([(t,)], latent=LatentSplit(512, 64)), 0)
        >>> mla.ckv_cache.shape, mla.kpe_cache.shape, mla.kv_indices.tolist(), mla.kv_len_arr.tolist()
        (torch.Size([3, 16, 512]), torch.Size([3, 16, 64]), [2, 0, 1], [40])
    """
    if not snapshot.is_latent or snapshot.latent is None:
        raise HurrayFormatError(
            "kv_role", "FlashInfer's MLA API reads MLA latents; this snapshot holds keys and values"
        )
    if page_size is not None:
        page_size = integer_arg(page_size, "page_size", 1)  # "64" or 64.0: a bare TypeError or a float page count
    check_layer(snapshot, layer)
    check_one_structure(snapshot, "FlashInfer's MLA API")
    t = snapshot.fused[layer]
    check_pool_values(t, "FlashInfer's MLA API")
    check_conversion(t.dtype, dtype, "FlashInfer's MLA API", keeps_scale=False)
    if t.seq_lens is None:
        raise HurrayFormatError("seq_lens", "the snapshot does not carry sequence lengths; FlashInfer needs kv_len_arr")
    # The checks the K/V importer runs: unrepaged, these arrays are kv_indptr/kv_indices/kv_len_arr as they are.
    check_csr(t)
    scale = layer_scales(snapshot, layer)[0]  # a latent's one scale
    if page_size is not None and page_size != t.page_size:
        plan = plan_repage(t.block_table, t.seq_ptr, t.seq_lens, t.page_size, page_size, t.num_pages)
        t = repage(t, page_size, plan)
    assert t.seq_lens is not None
    if t.num_pages > INT32_MAX or (t.seq_lens.numel() and int(t.seq_lens.max()) > INT32_MAX):
        raise HurrayFormatError("snapshot", "the batch does not fit FlashInfer's int32 indices")
    pool = convert_latent(t.page_pool[:, :, 0], scale, dtype)  # [pages, page_size, C]
    dev = device if device is not None else pool.device
    rank = snapshot.latent.kv_lora_rank
    return FlashInferMLACache(
        ckv_cache=pool[..., :rank].contiguous().to(dev),
        kpe_cache=pool[..., rank:].contiguous().to(dev),
        kv_indptr=t.seq_ptr.to(torch.int32).contiguous().to(dev),
        kv_indices=t.block_table.to(torch.int32).contiguous().to(dev),
        kv_len_arr=t.seq_lens.to(torch.int32).contiguous().to(dev),
        page_size=t.page_size,
        layer=layer,
    )
