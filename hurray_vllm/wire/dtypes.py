"""Hurray element type tags and their torch counterparts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import HurrayArgumentError, HurrayFormatError

__all__ = ["ElementType", "aligned_bytes", "element_type", "from_torch", "from_tag", "torch_dtype", "widen_index"]


@dataclass(frozen=True)
class ElementType:
    """A Hurray element type (``element-types.md``).

    ``bits`` is the storage width of one element. 1-, 2- and 4-bit types pack
    ``8 // bits`` elements per byte; the 6-bit floats pack four elements into
    three bytes.
    """

    name: str
    tag: int
    bits: int
    torch: torch.dtype | None

    def nbytes(self, count: int) -> int:
        """Bytes needed to store ``count`` elements of this type."""
        if self.bits >= 8:
            return count * (self.bits // 8)
        if self.bits == 6:
            # Four elements share three bytes and a partial group still takes all three:
            # pyhurray sizes float6 buffers so, and bit-tight sizing rejects its files.
            return (count + 3) // 4 * 3
        per_byte = 8 // self.bits
        return (count + per_byte - 1) // per_byte


_TYPES = (
    ElementType("float16", 0x01, 16, torch.float16),
    ElementType("bfloat16", 0x02, 16, torch.bfloat16),
    ElementType("float32", 0x03, 32, torch.float32),
    ElementType("float64", 0x04, 64, torch.float64),
    ElementType("int8", 0x10, 8, torch.int8),
    ElementType("uint8", 0x11, 8, torch.uint8),
    ElementType("int16", 0x12, 16, torch.int16),
    ElementType("uint16", 0x13, 16, torch.uint16),
    ElementType("int32", 0x14, 32, torch.int32),
    ElementType("uint32", 0x15, 32, torch.uint32),
    ElementType("int64", 0x16, 64, torch.int64),
    ElementType("uint64", 0x17, 64, torch.uint64),
    ElementType("bool", 0x20, 1, None),
    ElementType("complex64", 0x50, 64, torch.complex64),
    ElementType("complex128", 0x51, 128, torch.complex128),
    ElementType("int4", 0x48, 4, None),
    ElementType("uint4", 0x49, 4, None),
    ElementType("int2", 0x4A, 2, None),
    ElementType("uint2", 0x4B, 2, None),
    ElementType("float8_e4m3", 0x40, 8, torch.float8_e4m3fn),
    ElementType("float8_e5m2", 0x41, 8, torch.float8_e5m2),
    ElementType("float8_e8m0", 0x42, 8, getattr(torch, "float8_e8m0fnu", None)),
    ElementType("float4_e2m1", 0x43, 4, None),
    ElementType("float6_e2m3", 0x44, 6, None),
    ElementType("float6_e3m2", 0x45, 6, None),
    ElementType("float128", 0x46, 128, None),
)
_BY_TAG = {t.tag: t for t in _TYPES}
_BY_NAME = {t.name: t for t in _TYPES}
_BY_TORCH = {t.torch: t for t in _TYPES if t.torch is not None}


def from_tag(tag: int) -> ElementType:
    """The element type for a wire ``type_tag``; unknown tags raise."""
    try:
        return _BY_TAG[tag]
    except KeyError:
        raise HurrayFormatError("type_tag", f"unknown element type tag 0x{tag:02X}") from None


def is_known_tag(tag: int) -> bool:
    return tag in _BY_TAG


def element_type(name: str) -> ElementType:
    """The element type called ``name`` (``"bfloat16"``, ``"float8_e4m3"``...)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise HurrayFormatError("type_tag", f"unknown element type name {name!r}") from None


def from_torch(dtype: torch.dtype, *, argument: str | None = None) -> ElementType:
    """The Hurray element type that stores ``dtype`` bit for bit.

    Args:
        dtype: The torch dtype.
        argument: Where a caller passed ``dtype`` (a writer's tensor, ``"dtype"``): a dtype without
            an element type is then :class:`HurrayArgumentError` naming it. Without it the error is
            :class:`HurrayFormatError` (field ``type_tag``): tensors read from data meet this function too
            (a safetensors file's pool of bools), and such data is what is wrong.

    Raises:
        HurrayFormatError: ``dtype`` has no Hurray element type (``argument`` not given).
        HurrayArgumentError: the same, ``argument`` given.
    """
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        if argument is not None:
            raise HurrayArgumentError(argument, f"torch dtype {dtype} has no Hurray element type") from None
        raise HurrayFormatError("type_tag", f"torch dtype {dtype} has no Hurray element type") from None


def torch_dtype(tag: int) -> torch.dtype:
    """The torch dtype for a wire ``type_tag``; raises for types torch cannot hold."""
    et = from_tag(tag)
    if et.torch is None:
        raise HurrayFormatError("type_tag", f"element type {et.name} has no torch dtype")
    return et.torch


def aligned_bytes(raw: torch.Tensor, width: int) -> torch.Tensor:
    """``raw`` (uint8) ready for ``.view()`` as a ``width``-byte type: itself, or a contiguous copy.

    torch views a uint8 tensor as a wider type only where its storage offset is a multiple of
    the width (a slice of a file's bytes at offset 133, say): such a slice is copied instead.
    """
    if raw.is_contiguous() and raw.storage_offset() * raw.element_size() % width == 0:
        return raw
    return torch.empty_like(raw, memory_format=torch.contiguous_format).copy_(raw)


def widen_index(raw: torch.Tensor, wire: torch.dtype, name: str = "block_table.page_id") -> torch.Tensor:
    """An index buffer's bytes as int64 values.

    Args:
        raw: uint8 ``[n * width]``, the buffer as stored (little-endian).
        wire: ``torch.uint32`` or ``torch.uint64``, the descriptor's index type.
        name: the invariant a uint64 value above ``2**63 - 1`` breaks, named in the error:
            ``"block_table.page_id"`` for a block table (no pool has that many pages),
            ``"seq_ptr.last"`` for sequence pointers (no block table has that many entries).
            Both are structural, so a permissive read refuses such a value as validation does.

    Returns:
        int64 ``[n]``. uint32 values are zero-extended; a uint64 value
        above ``2**63 - 1`` (no int64 holds it) raises :class:`HurrayFormatError` naming ``name``.
    """
    if raw.numel() == 0:
        return torch.empty(0, dtype=torch.int64)
    raw = aligned_bytes(raw, 4 if wire == torch.uint32 else 8)
    if wire == torch.uint32:
        return raw.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = raw.view(torch.int64).clone()
    if bool((out < 0).any()):  # >= 2**63 as uint64
        raise HurrayFormatError(name, f"uint64 index {int(out[out < 0][0]) + (1 << 64)} above 2**63 - 1")
    return out
