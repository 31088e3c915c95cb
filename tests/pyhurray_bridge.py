"""Build pyhurray (reference implementation) objects from ours, for byte comparisons."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from hurray_vllm import BlockPagedTensor
from hurray_vllm.wire import dtypes
from hurray_vllm.wire.descriptor import PerBlockAffine, PerChannelAffine, PerTensorAffine


def ref_dtype(hurray: ModuleType, dtype: torch.dtype) -> Any:
    return getattr(hurray.dtype, dtypes.from_torch(dtype).name)


def ref_quant(hurray: ModuleType, q: object) -> Any:
    if q is None:
        return None
    if isinstance(q, PerTensorAffine):
        return hurray.PerTensorAffine(q.scale, q.zero_point)
    if isinstance(q, PerBlockAffine):
        st = {1: hurray.float16, 2: hurray.bfloat16, 3: hurray.float32}[q.scale_type_tag]
        if q.zero_point_buffer_index is None:
            return hurray.PerBlockAffine.symmetric(q.axis, q.block_size, q.scale_buffer_index, st)
        return hurray.PerBlockAffine.asymmetric(
            q.axis, q.block_size, q.scale_buffer_index, q.zero_point_buffer_index, st
        )
    if isinstance(q, PerChannelAffine):
        if q.zero_point_buffer_index is None:
            return hurray.PerChannelAffine.symmetric(axis=q.axis, scale_buffer_index=q.scale_buffer_index)
        return hurray.PerChannelAffine.asymmetric(
            axis=q.axis, scale_buffer_index=q.scale_buffer_index, zero_point_buffer_index=q.zero_point_buffer_index
        )
    raise TypeError(q)


def to_reference(hurray: ModuleType, t: BlockPagedTensor) -> Any:
    """The same tensor built by pyhurray (which copies every buffer into bytes)."""
    bufs = [bytes(b.contiguous().view(torch.uint8).reshape(-1).numpy()) for b in t.wire_buffers()]
    return hurray.Tensor(
        bufs[0],
        ref_dtype(hurray, t.dtype),
        list(t.shape),
        aux_buffers=bufs[1:],
        layout=hurray.BlockPagedLayout(
            page_size=t.page_size,
            num_pages=t.num_pages,
            paged_axis=0,
            num_seqs=t.num_seqs,
            kv_role=t.kv_role,
            layer_index=t.layer_index,
            block_table_index_type=t.index_type,
        ),
        quantization=ref_quant(hurray, t.quantization),
    )
