"""Helpers the paged-KV importers share (flash-attn, FlashInfer, the reference).

Only :mod:`hurray_vllm.errors`, :mod:`hurray_vllm.wire` and
:mod:`hurray_vllm.kv` may be imported here, never another adapter.
"""

from __future__ import annotations

import torch

from ..errors import HurrayFormatError
from ..kv.snapshot import KVSnapshot

__all__ = ["FP8_DTYPES", "INT32_MAX", "check_layer", "dequantize"]

#: The float8 storage dtypes: pools in these hold ``value / scale``.
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)

#: The largest page id or token count the kernels' int32 indices hold.
INT32_MAX = 2**31 - 1


def check_layer(snapshot: KVSnapshot, layer: int) -> None:
    """Raise unless ``layer`` names one of ``snapshot``'s layers.

    Args:
        snapshot: the batch being imported.
        layer: the layer index asked for; must satisfy
            ``0 <= layer < snapshot.num_layers``.

    Raises:
        HurrayFormatError: with ``field="layer"`` when it is out of range.
    """
    if not 0 <= layer < snapshot.num_layers:
        raise HurrayFormatError("layer", f"layer {layer} is outside the snapshot's {snapshot.num_layers} layers")


def dequantize(pool: torch.Tensor, scale: float) -> torch.Tensor:
    """Real values of a float8 page pool: ``stored.float() * scale``.

    Args:
        pool: a page pool of any shape (the importers pass
            ``[num_pages, page_size, num_kv_heads, head_dim]``), float8 (or any
            floating dtype), any device and layout.
        scale: the per-layer scale (``value = stored * scale``).

    Returns:
        A new float32 tensor of ``pool``'s shape, on ``pool``'s device.
    """
    return pool.float() * float(scale)
