"""The three builds of flash-attn's paged kernel and their limits (``FLAVORS``), and the checks they share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ...errors import HurrayArgumentError, HurrayFormatError, ImportArgumentError, integer_arg
from .._common import FP8_DTYPES as _FP8

__all__ = ["Flavor", "FlavorLimits", "FLAVORS", "HALF_DTYPES", "flavor_limits", "check_page_size", "check_head_dim"]

Flavor = Literal["fa2", "fa3", "vllm"]


HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FlavorLimits:
    """What one build of ``flash_attn_with_kvcache`` accepts for a paged cache.

    Attributes:
        name: ``"fa2"``, ``"fa3"`` or ``"vllm"``.
        kernel: the Python entry point, for messages.
        page_multiple: ``page_block_size`` must be a multiple of this.
        dtypes: accepted dtypes of ``q`` (and so of the caches).
        max_head_dim: the largest head dimension.
        head_dim_multiple: required divisor of ``head_dim`` for 16-bit inputs
            (1: any; FlashAttention-2's ``mha_fwd_kvcache`` pads odd sizes itself).
        fp8_head_dim_multiple: the same for float8 inputs.
        descales: whether the kernel takes ``q/k/v_descale`` (fp8 only).
    """

    name: str
    kernel: str
    page_multiple: int
    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int
    head_dim_multiple: int
    fp8_head_dim_multiple: int
    descales: bool


FLAVORS: dict[str, FlavorLimits] = {
    # csrc/flash_attn/flash_api.cpp mha_fwd_kvcache (v2.8): "Paged KV cache block size must be divisible by 256".
    "fa2": FlavorLimits("fa2", "flash_attn.flash_attn_with_kvcache", 256, HALF_DTYPES, 256, 1, 1, False),
    # hopper/flash_api.cpp mha_fwd: any page size; "head_size should be a multiple of 8" (16 for e4m3).
    "fa3": FlavorLimits(
        "fa3",
        "flash_attn_interface.flash_attn_with_kvcache",
        1,
        (*HALF_DTYPES, torch.float8_e4m3fn),
        256,
        8,
        16,
        True,
    ),
    # vllm-project/flash-attention csrc: "Paged KV cache block size must be divisible by 16". The fork's Python
    # API no longer has flash_attn_with_kvcache (the padding mha_fwd_kvcache) since its PR #107: the paged call
    # is flash_attn_varlen_func, whose mha_varlen_fwd requires "a head_size that is a multiple of 8".
    "vllm": FlavorLimits("vllm", "vllm.vllm_flash_attn", 16, HALF_DTYPES, 256, 8, 8, False),
}


def flavor_limits(flavor: str) -> FlavorLimits:
    """The limits of ``flavor``; :class:`HurrayArgumentError` names the flavors there are."""
    try:
        return FLAVORS[flavor]
    except KeyError:
        raise HurrayArgumentError("flavor", f"unknown flavor {flavor!r}; use one of {sorted(FLAVORS)}") from None


def check_page_size(page: int, lim: FlavorLimits, field: str) -> None:
    """Refuse a page size the build's kernel does not take (``field`` names the argument).

    Raises:
        ImportArgumentError: ``page`` is not an integer (``"256"`` failed with a bare ``TypeError``; ``256.0``
            passed here and went on as a float page size where the snapshot's pages had that size).
        HurrayArgumentError: a size the kernel refuses.
    """
    integer_arg(page, field, error=ImportArgumentError)
    if page <= 0 or page % lim.page_multiple:
        raise HurrayArgumentError(
            field,
            f"{lim.kernel} needs a paged KV block size divisible by {lim.page_multiple}, got {page}; "
            f"import with page_size={max(lim.page_multiple, 256)}",
        )


def check_head_dim(
    head_dim: int,
    lim: FlavorLimits,
    dtype: torch.dtype,
    field: str,
    error: type[HurrayFormatError] | type[HurrayArgumentError] = HurrayFormatError,
) -> None:
    """Refuse a head size the build (and, for fp8, the dtype) does not take."""
    # A snapshot's head_dim that the kernel refuses is a data error; q's is the caller's.
    if head_dim > lim.max_head_dim:
        raise error(field, f"{lim.kernel} supports head_dim at most {lim.max_head_dim}, got {head_dim}")
    multiple = lim.fp8_head_dim_multiple if dtype in _FP8 else lim.head_dim_multiple
    if head_dim % multiple:
        raise error(field, f"{lim.kernel} needs head_dim a multiple of {multiple} for {dtype}, got {head_dim}")
