"""Every rule of the block-paged layout (and the descriptor rules around it).

Rules come in two strengths. *Structural* rules protect the reader itself
(a page pool whose byte size does not match its shape cannot be viewed as a
tensor), so they hold in every mode. The others are the spec's MUSTs and
SHOULDs that a permissive reader may waive (``block-paged.md`` § Storage
Invariants: "...MUST reject descriptors that violate them, unless operating
in permissive mode"): reserved bytes, unknown roles and tags, a shard
section, quantization placement. The spec would let a permissive reader skip
the seq_ptr ordering rules too; hurray-vllm keeps all three seq_ptr rules
structural (see ``docs/format.md`` § 3 (j)).

Page ids are bounds-checked in both modes whenever the block table is at
hand (``block_table.page_id`` is structural): only the record-level tools
(``inspect``, ``convert``) carry such a table along, without reading through it.
"""

from __future__ import annotations

import functools
import math
import struct
import weakref
from dataclasses import dataclass

import torch

from ..errors import HurrayFormatError, Violation
from . import dtypes
from .descriptor import (
    KV_ROLES,
    LAYOUT_BLOCK_PAGED,
    LAYOUT_COMPOSITE,
    BlockPagedFields,
    PerBlockAffine,
    PerChannelAffine,
    PerTensorAffine,
    RawQuantization,
    TensorDescriptor,
    decode_descriptor,
)

__all__ = [
    "INDEX_DTYPES",
    "LENGTH_DTYPES",
    "Checked",
    "validate_descriptor",
    "validate_index_buffers",
    "raise_if",
    "check_own",
    "decode_checked",
]

_STRUCTURAL = frozenset(
    {
        "rank",
        "page_size",
        "num_pages",
        "buffer_count",
        "page_pool.byte_size",
        "block_table.byte_size",
        "seq_ptr.byte_size",
        "quantization.buffer_index",
        "quantization.scales.byte_size",
        "quantization.zero_points.byte_size",
        "block_table.page_id",
        "block_table.dtype",
        "seq_ptr.dtype",
        "seq_ptr.first",
        "seq_ptr.non_decreasing",
        "seq_ptr.last",
        "shape.heads",
        "seq_lens.count",
        "seq_lens.dtype",
        "seq_lens.pages",
        "seq_lens.total",
        "shape.total_tokens",
        "type_tag",
        "composite.buffer_count",
        # Not waived: versioning.md has a reader refuse flag bits it does not know (pyhurray does,
        # in every mode); metadata.md has a reader refuse a shard out of its parent; block-paged.md
        # has it refuse a shard on a block-paged tensor, which nothing here could read.
        "flags.reserved",
        "shard",
        "shard.bounds",
        # Not a rule of a descriptor but of reading its data: check_own (what from_wire and the
        # row-major readers call) adds it; validate_descriptor, which descriptor tools use, does not.
        "quantization.unsupported",
        # Not rules of a descriptor, but of a snapshot in memory, which the snapshot reader refuses (or
        # would read otherwise) in every mode: layer i saying another layer, a header json cannot write.
        "layer_index",
        "snapshot.meta",
    }
)

#: What sequence lengths may be held as: integers that torch compares and sums (its uint16..uint64 lack
#: those ops), never bool, and never floating point (a length of 3.5 tokens is not written as 3.5).
LENGTH_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})

#: What block tables and seq_ptr may be held as in memory: the index types torch's gathers and scatters take.
#: A narrower one (int16) makes ``page * page_size`` wrap in its own dtype, a float one is no page id at all.
INDEX_DTYPES = frozenset({torch.int32, torch.int64})


#: torch sizes and strides are int64: an extent above this cannot be viewed, however few bytes back it.
_MAX_DIM = (1 << 63) - 1

#: Device tags: 0x00 CPU, 0x01-0x08 the standard accelerators, 0xF0-0xFE private; the rest is
#: reserved (0xFF permanently). pyhurray refuses a reserved tag as it decodes.
_STANDARD_DEVICES = range(0x00, 0x09)
_PRIVATE_DEVICES = range(0xF0, 0xFF)
_DEVICE_CPU = 0x00

# Valid storage types per scheme (quantization/*.md § Valid Storage Types).
_BLOCK_STORAGE = frozenset({0x10, 0x11, 0x48, 0x49, 0x4A, 0x4B})
_AFFINE_STORAGE = _BLOCK_STORAGE | {0x12, 0x13, 0x14, 0x15}
_SIGNED_STORAGE = frozenset({0x10, 0x12, 0x14, 0x48, 0x4A})


@dataclass(frozen=True)
class Checked:
    """Result of validation: every violation found, and whether it blocks.

    ``unreadable`` holds what stopped parsing altogether (bad magic,
    truncation, a corrupt index); it blocks in every mode.
    """

    violations: tuple[Violation, ...]
    permissive: bool
    unreadable: tuple[Violation, ...] = ()

    @property
    def errors(self) -> tuple[Violation, ...]:
        """The blocking violations: all (permissive: the structural ones only), then :attr:`unreadable`."""
        if not self.permissive:
            return self.violations + self.unreadable
        return tuple(v for v in self.violations if v.invariant in _STRUCTURAL) + self.unreadable

    @property
    def ok(self) -> bool:
        """Whether nothing blocks."""
        return not self.errors


def raise_if(checked: Checked, context: str = "") -> None:
    """Raise :class:`HurrayFormatError` if ``checked`` has blocking violations."""
    if not checked.violations and not checked.unreadable:  # the common case, on every record read: no tuple built
        return
    if checked.errors:
        raise HurrayFormatError.from_violations(checked.errors, context)


# Readers meet the same descriptor bytes again and again: layer i of every chunk file a
# connector loads, every layer of a stream but for its index. Decoding them and checking a
# descriptor's own rules are pure functions of those bytes, so both are remembered (a few
# hundred bytes per entry, bounded); the buffers are still checked every time.
@functools.lru_cache(maxsize=1024)
def _decode_and_check_memo(raw: bytes, permissive: bool) -> tuple[TensorDescriptor, Checked]:
    d = decode_descriptor(raw)
    return d, validate_descriptor(d, permissive=permissive)


#: Only descriptors this small are remembered: a hostile file of many large ones (extension
#: payloads) would otherwise keep up to 1024 of them alive after it was read.
_MEMO_DESCRIPTOR_BYTES = 4096


def _decode_and_check(raw: bytes, permissive: bool) -> tuple[TensorDescriptor, Checked]:
    if len(raw) <= _MEMO_DESCRIPTOR_BYTES:
        return _decode_and_check_memo(raw, permissive)
    d = decode_descriptor(raw)
    return d, validate_descriptor(d, permissive=permissive)


#: The verdicts decode_checked reached, by the identity of the descriptor it returned, so
#: that check_own on that object (from_wire does it) costs a lookup. An entry holds a weak
#: reference whose callback removes it when the descriptor dies, so a reused id can never
#: find another descriptor's verdict, whatever the callers keep alive.
_VERDICTS: dict[tuple[int, bool], tuple[weakref.ref[TensorDescriptor], Checked]] = {}
_MAX_VERDICTS = 4096


def _remember(d: TensorDescriptor, permissive: bool, checked: Checked) -> None:
    key = (id(d), permissive)
    known = _VERDICTS.get(key)
    if known is not None and known[0]() is d:
        return  # the memo above returned this descriptor before: its verdict is on record

    def forget(ref: weakref.ref[TensorDescriptor]) -> None:
        entry = _VERDICTS.get(key)
        if entry is not None and entry[0] is ref:
            _VERDICTS.pop(key, None)  # readers on several threads: another may have cleared it since

    if len(_VERDICTS) >= _MAX_VERDICTS:  # bounded even while callers keep many descriptors alive
        _VERDICTS.clear()
    _VERDICTS[key] = (weakref.ref(d, forget), checked)


def check_own(d: TensorDescriptor, *, permissive: bool = False) -> Checked:
    """``validate_descriptor(d)`` without buffers, for a reader about to view ``d``'s data.

    Free for a descriptor :func:`decode_checked` returned. Adds what no mode lets a reader
    dereference: a quantization scheme hurray-vllm does not model (``quantization.unsupported``).
    """
    hit = _VERDICTS.get((id(d), permissive))
    checked = hit[1] if hit is not None and hit[0]() is d else validate_descriptor(d, permissive=permissive)
    if isinstance(d.quantization, RawQuantization):
        # quantization.md: a reader that does not model the scheme "MUST NOT dereference the tensor
        # data buffer", permissive or not. Descriptor-level tools (inspect, convert) call
        # validate_descriptor, which leaves this out, and may still carry such a descriptor.
        unsupported = Violation(
            "quantization.unsupported",
            f"scheme 0x{d.quantization.scheme_tag:02X} is not one hurray-vllm models: its data cannot be read",
        )
        return Checked((*checked.violations, unsupported), checked.permissive, checked.unreadable)
    return checked


def decode_checked(raw: bytes | bytearray | memoryview, context: str, *, permissive: bool = False) -> TensorDescriptor:
    """Decode ``raw`` and raise :class:`HurrayFormatError` (naming ``context``) if it breaks a blocking rule."""
    d, checked = _decode_and_check(bytes(raw), permissive)
    _remember(d, permissive, checked)
    raise_if(checked, context)
    return d


def _common(d: TensorDescriptor, out: list[Violation]) -> None:
    if d.reserved_flags:
        out.append(Violation("flags.reserved", f"reserved flag bits set: 0x{d.reserved_flags:08X}"))
    ext_range = 0xF0 <= d.type_tag <= 0xFE
    if ext_range != (d.extension_type is not None):
        out.append(
            Violation("flags.extension_type", "HAS_EXTENSION_TYPE must be set exactly when type_tag is 0xF0-0xFE")
        )
    if not ext_range and not dtypes.is_known_tag(d.type_tag):
        # Composite heads too: their type_tag may be advisory, but element-types.md has a reader refuse
        # 0x00 and 0xFF and give no meaning to the reserved tags (pyhurray refuses them on any head).
        out.append(Violation("type_tag", f"unknown element type tag 0x{d.type_tag:02X}"))
    if not d.buffers and d.layout_tag not in (LAYOUT_COMPOSITE, LAYOUT_BLOCK_PAGED):  # block-paged: needs 3
        out.append(Violation("buffer_count", "buffer_count is 0; every layout but a composite head needs a buffer"))
    if d.shard is not None:
        for k, (n, off, parent) in enumerate(zip(d.shape, d.shard.shard_offset, d.shard.parent_shape, strict=False)):
            if off + n > parent:  # Python ints: no uint64 wraparound lets an offset near 2**64 pass
                out.append(
                    Violation(
                        "shard.bounds", f"shard out of bounds on dim {k}: offset {off} + size {n} > parent {parent}"
                    )
                )
                break
    for i, b in enumerate(d.buffers):
        if b.alignment == 0 or b.alignment & (b.alignment - 1) or (b.byte_size and b.alignment < 64):
            out.append(
                Violation("buffers.alignment", f"buffer {i} alignment {b.alignment} is not a power of two >= 64")
            )
        if b.reserved:
            out.append(Violation("buffers.reserved", f"buffer {i} reserved byte is 0x{b.reserved:02X}, must be 0"))
        if b.device_tag not in _STANDARD_DEVICES and b.device_tag not in _PRIVATE_DEVICES:
            out.append(Violation("buffers.device_tag", f"buffer {i} device_tag 0x{b.device_tag:02X} is reserved"))
        if b.sync_mode > 0x02:
            out.append(Violation("buffers.sync_mode", f"buffer {i} sync_mode 0x{b.sync_mode:02X} is not 0, 1 or 2"))
        elif b.sync_mode and b.device_tag == _DEVICE_CPU:
            # The events and streams that modes 1 and 2 name are an accelerator's; pyhurray refuses them on CPU.
            out.append(
                Violation("buffers.sync_mode", f"buffer {i} is CPU memory (device_tag 0) with sync_mode {b.sync_mode}")
            )
        if b.memory_class > 0x03:
            out.append(Violation("buffers.memory_class", f"buffer {i} memory_class 0x{b.memory_class:02X} is reserved"))
    if d.buffers:
        if len({b.device_tag for b in d.buffers}) > 1:
            out.append(Violation("buffers.device_tag", "all buffers of one descriptor must share one device_tag"))
        if len({b.memory_class for b in d.buffers}) > 1:
            out.append(Violation("buffers.memory_class", "all buffers of one descriptor must share one memory_class"))
    if d.composite_member is not None and d.layout_tag != LAYOUT_COMPOSITE:
        role = d.composite_member[0]
        if role > 1 or any(d.composite_member[1:]):
            out.append(Violation("composite_member", "member_role must be 0 or 1 with zero reserved bytes"))
    if d.statistics is not None:
        mask = int.from_bytes(d.statistics[:4], "little")
        if mask >> 6:
            out.append(Violation("statistics.computed_mask", f"reserved bits set in 0x{mask:08X}"))
        if any(d.statistics[4:8]) or any(d.statistics[68:72]):
            found = f"{d.statistics[4:8].hex()} and {d.statistics[68:72].hex()}"
            out.append(Violation("statistics.reserved", f"reserved bytes 4-7 and 68-71 must be zero, found {found}"))
    if d.extension_type is not None:
        if any(d.extension_type[10:12]) or any(d.extension_type[18:20]):
            found = f"{d.extension_type[10:12].hex()} and {d.extension_type[18:20].hex()}"
            out.append(
                Violation("extension_type.reserved", f"reserved bytes 10-11 and 18-19 must be zero, found {found}")
            )
        bit_width, packing = _extension_packing(d.extension_type)
        if _packing_for(bit_width) != packing:
            out.append(
                Violation(
                    "extension_type.packing",
                    f"packing_factor {packing} does not fit bit_width {bit_width} "
                    "(1, 2 and 4 bits pack 8, 4 and 2 per byte; 8 bits and up, 1)",
                )
            )


def _extension_packing(section: bytes) -> tuple[int, int]:
    """``(bit_width, packing_factor)`` of a 20-byte extension type section."""
    bit_width, packing = struct.unpack_from("<IB", section)
    return bit_width, packing


def _packing_for(bit_width: int) -> int | None:
    """The one packing factor a bit width admits, or None for a width no packing fits (0, 3, 5-7)."""
    if bit_width in (1, 2, 4):
        return 8 // bit_width
    return 1 if bit_width >= 8 else None


def _pool_bytes(d: TensorDescriptor, count: int) -> tuple[int | None, str]:
    """The page pool's byte size for ``count`` elements and the type named for messages; None when unknowable.

    Extension types (0xF0-0xFE) are sized by their section: packed sub-byte widths round up
    to whole bytes, whole-byte widths take bit_width / 8 bytes each. A width that is neither
    (12 bits, say) or a packing that does not fit it leaves the size open.
    """
    if dtypes.is_known_tag(d.type_tag):
        et = dtypes.from_tag(d.type_tag)
        return et.nbytes(count), et.name
    name = f"extension type 0x{d.type_tag:02X}"
    if d.extension_type is None:
        return None, name
    bit_width, packing = _extension_packing(d.extension_type)
    name = f"{name} ({bit_width}-bit)"
    if _packing_for(bit_width) != packing:
        return None, name
    if bit_width < 8:
        return (count + packing - 1) // packing, name
    if bit_width % 8:
        return None, name
    return count * (bit_width // 8), name


def _composite(d: TensorDescriptor, out: list[Violation]) -> None:
    c = d.composite
    assert c is not None
    if d.buffers:
        out.append(Violation("composite.buffer_count", f"a composite head owns no buffers, found {len(d.buffers)}"))
    if d.byte_offset:
        out.append(Violation("byte_offset", "a composite head's byte_offset must be 0"))
    if c.rule_tag not in (1, 2, 3):
        out.append(Violation("composite.rule", f"unknown composition_rule 0x{c.rule_tag:02X}"))
    elif c.rule_tag == 2 and c.combine_op not in (1, 2):
        out.append(Violation("composite.combine_op", f"overlay needs combine_op 1 or 2, found {c.combine_op}"))
    elif c.rule_tag != 2 and c.combine_op:
        out.append(Violation("composite.combine_op", f"combine_op must be 0 for {c.rule}, found {c.combine_op}"))
    if any(c.reserved):
        out.append(Violation("composite.reserved", "reserved bytes must be zero"))
    if c.member_count == 0xFFFFFFFF:
        out.append(Violation("composite.member_count", "open composites (0xFFFFFFFF) are reserved"))
    if c.rule_tag == 2 and c.member_count == 0:
        out.append(Violation("composite.member_count", "an overlay needs at least its base member"))
    if d.quantization is not None:
        out.append(Violation("composite.quantization", "a composite head holds no data and cannot be quantized"))
    if d.composite_member is not None:
        out.append(Violation("composite.member_section", "a composite head must not carry a Composite Member section"))


def _quant_sizes(d: TensorDescriptor, out: list[Violation]) -> None:
    """The quantization block's rules and the sizes of its parameter buffers."""
    bp = d.block_paged
    assert bp is not None
    q = d.quantization
    if q is None:
        if len(d.buffers) != 3 and len(d.buffers) >= 3:
            out.append(Violation("buffer_count", f"unquantized block-paged tensor has {len(d.buffers)} buffers, not 3"))
        return
    if isinstance(q, RawQuantization):
        tag = q.scheme_tag
        if tag in (0x00, 0xFF) or 0x60 <= tag <= 0xEF:
            out.append(Violation("quantization.scheme_tag", f"scheme tag 0x{tag:02X} is reserved or invalid"))
        else:
            out.append(Violation("quantization.scheme_tag", f"unsupported quantization scheme 0x{tag:02X}"))
        return
    if q.scheme_version != 1:
        # Each scheme's table: scheme_version "MUST be 0x01" (quantization.md: reject one newer than 1;
        # 0 was never defined).
        out.append(Violation("quantization.scheme_version", f"scheme_version must be 1, found {q.scheme_version}"))
    allowed = _BLOCK_STORAGE if isinstance(q, PerBlockAffine) else _AFFINE_STORAGE
    if d.type_tag not in allowed:
        out.append(
            Violation(
                "quantization.storage_type",
                f"type tag 0x{d.type_tag:02X} is not an integer storage type this scheme admits "
                "(fp8 caches travel unquantized with their scales beside them; see docs/format.md)",
            )
        )
    if isinstance(q, PerTensorAffine):
        _per_tensor(d, q, out)
        return
    indices = _affine_header(d, q, out)
    if indices is None:
        return
    entries = _per_channel_entries(d, q, out) if isinstance(q, PerChannelAffine) else _per_block_entries(bp, q, out)
    # Always: what the entries or the scale width leave unknown (a waivable axis or scale type) skips only
    # the sizes that depend on it, never the buffer count or the other sizes (structural in every mode).
    _param_buffer_sizes(d, q, indices, *entries, out)


def _per_tensor(d: TensorDescriptor, q: PerTensorAffine, out: list[Violation]) -> None:
    """Per-tensor affine: a finite non-zero inline scale, nothing reserved, no parameter buffers."""
    try:  # the scale travels as a float32: 1e39 does not fit one, 1e-50 becomes 0
        scale32 = struct.unpack("<f", struct.pack("<f", q.scale))[0]
    except (OverflowError, struct.error, TypeError):
        scale32 = math.inf
    if not math.isfinite(scale32) or scale32 == 0:
        out.append(
            Violation("quantization.scale", f"per-tensor scale must be a finite non-zero float32, got {q.scale}")
        )
    if d.type_tag in _AFFINE_STORAGE and dtypes.is_known_tag(d.type_tag):
        bits = dtypes.from_tag(d.type_tag).bits
        signed = d.type_tag in _SIGNED_STORAGE
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        if not lo <= q.zero_point <= hi:
            out.append(
                Violation(
                    "quantization.zero_point",
                    f"zero_point {q.zero_point} is outside {dtypes.from_tag(d.type_tag).name}'s range [{lo}, {hi}]",
                )
            )
    if q.flags or any(q.reserved):
        out.append(Violation("quantization.reserved", "per-tensor flags and reserved bytes must be zero"))
    if len(d.buffers) != 3:
        out.append(Violation("buffer_count", "per-tensor quantization keeps its parameters inline: 3 buffers"))


def _affine_header(d: TensorDescriptor, q: PerChannelAffine | PerBlockAffine, out: list[Violation]) -> list[int] | None:
    """Flags, reserved bytes and parameter buffer indices; the indices, or None when one names no buffer."""
    if q.flags is not None and q.flags & ~1:
        out.append(Violation("quantization.flags", f"reserved scheme flag bits set: 0x{q.flags:04X}"))
    if any(q.reserved):
        out.append(Violation("quantization.reserved", "reserved bytes must be zero"))
    if q.flags is not None and bool(q.flags & 1) != q.symmetric:
        out.append(
            Violation("quantization.flags", "SYMMETRIC must be set exactly when zero_point_buffer_index is 0xFFFFFFFF")
        )
    indices = [q.scale_buffer_index] + ([] if q.zero_point_buffer_index is None else [q.zero_point_buffer_index])
    for idx in indices:
        if idx < 3 or idx >= len(d.buffers):
            out.append(
                Violation(
                    "quantization.buffer_index",
                    f"parameter buffer index {idx} must name one of buffers 3..{len(d.buffers) - 1}",
                )
            )
            return None
    return indices


def _per_channel_entries(
    d: TensorDescriptor, q: PerChannelAffine, out: list[Violation]
) -> tuple[int | None, int | None]:
    """``(entries, bytes per scale)`` of per-channel parameters; entries None when the axis is out of range."""
    if q.axis == 0:
        out.append(Violation("quantization.axis", "per-channel quantization must not use the paged axis 0"))
    if q.axis >= d.rank:
        out.append(Violation("quantization.axis", f"axis {q.axis} >= rank {d.rank}"))
        return None, 4
    if q.scale_type_tag != 0x03:
        out.append(Violation("quantization.scale_type", "per-channel scales must be float32 (0x03)"))
    return d.shape[q.axis], 4


def _per_block_entries(bp: BlockPagedFields, q: PerBlockAffine, out: list[Violation]) -> tuple[int | None, int | None]:
    """``(entries, bytes per scale)`` of per-page parameters.

    A scale type not allowed is sized by its element type's width where it has a whole-byte one
    (float64: 8), else its width is None (unknown).
    """
    if q.axis != 0:
        msg = f"per-block-affine on a block-paged tensor needs axis 0, got {q.axis}"
        out.append(Violation("quantization.axis", msg))
    if q.block_size != bp.page_size:
        out.append(
            Violation(
                "quantization.block_size",
                f"per-block-affine block_size {q.block_size} must equal page_size {bp.page_size}",
            )
        )
    if q.block_size < 2 or q.block_size & (q.block_size - 1):
        out.append(Violation("quantization.block_size", f"block_size {q.block_size} must be a power of two >= 2"))
    entries = bp.num_pages * bp.page_size
    if q.scale_type_tag not in (0x01, 0x02, 0x03):
        out.append(Violation("quantization.scale_type", f"scale type 0x{q.scale_type_tag:02X} not allowed"))
        known = dtypes.is_known_tag(q.scale_type_tag) and dtypes.from_tag(q.scale_type_tag).bits % 8 == 0
        return entries, dtypes.from_tag(q.scale_type_tag).bits // 8 if known else None
    return entries, 4 if q.scale_type_tag == 0x03 else 2


def _param_buffer_sizes(
    d: TensorDescriptor,
    q: PerChannelAffine | PerBlockAffine,
    indices: list[int],
    entries: int | None,
    scale_bytes: int | None,
    out: list[Violation],
) -> None:
    """The scale and zero-point buffers hold ``entries`` parameters each; the buffer count adds up.

    ``entries`` or ``scale_bytes`` None (unknown: a waivable axis or scale type, reported already):
    the sizes that depend on it are not checked; the others and the buffer count always are.
    """
    if entries is not None:
        _param_sizes(d, q, entries, scale_bytes, out)
    expected_count = 3 + len(set(indices))
    if len(d.buffers) != expected_count:
        out.append(Violation("buffer_count", f"expected {expected_count} buffers, found {len(d.buffers)}"))


def _param_sizes(
    d: TensorDescriptor,
    q: PerChannelAffine | PerBlockAffine,
    entries: int,
    scale_bytes: int | None,
    out: list[Violation],
) -> None:
    """The parameter buffers' sizes for ``entries`` parameters; a scale width of None leaves the scales unsized."""
    scales = d.buffers[q.scale_buffer_index].byte_size
    if q.zero_point_buffer_index == q.scale_buffer_index:
        if scale_bytes is not None and scales != entries * (scale_bytes + 4):
            out.append(
                Violation(
                    "quantization.scales.byte_size",
                    f"shared scale/zero-point buffer holds {scales} bytes; {entries} entries of "
                    f"{scale_bytes} + 4 bytes need {entries * (scale_bytes + 4)}",
                )
            )
    else:
        if scale_bytes is not None and scales != entries * scale_bytes:
            out.append(
                Violation(
                    "quantization.scales.byte_size",
                    f"scales buffer holds {scales} bytes; {entries} entries of {scale_bytes} bytes need "
                    f"{entries * scale_bytes}",
                )
            )
        zp_want = entries * 4  # zero points are int32 whatever the storage type
        if q.zero_point_buffer_index is not None and d.buffers[q.zero_point_buffer_index].byte_size != zp_want:
            out.append(
                Violation(
                    "quantization.zero_points.byte_size",
                    f"zero-point buffer must hold {entries} int32 = {zp_want} bytes",
                )
            )


def _extents(d: TensorDescriptor, bp: BlockPagedFields, out: list[Violation]) -> None:
    """Each extent of the pool's ``[num_pages, page_size, heads, head_dim]`` view fits an int64.

    A pool of num_pages 0 is 0 bytes whatever the other extents say, so the size rule cannot
    catch a head count no tensor can have: the reader's view of the pool would fail instead.
    """
    tokens, heads, dim = d.shape
    if tokens > _MAX_DIM:
        out.append(Violation("shape.total_tokens", f"shape[0] (total tokens) = {tokens} exceeds 2**63-1"))
    if bp.num_pages > _MAX_DIM:
        out.append(Violation("num_pages", f"num_pages = {bp.num_pages} exceeds 2**63-1"))
    for axis, what, n in ((1, "heads", heads), (2, "head_dim", dim)):
        if n > _MAX_DIM:
            out.append(Violation("shape.heads", f"shape[{axis}] ({what}) = {n} exceeds 2**63-1"))
    if heads > _MAX_DIM or dim > _MAX_DIM or bp.num_pages > _MAX_DIM:
        return
    page = bp.page_size * heads * dim
    if page > _MAX_DIM:
        out.append(
            Violation(
                "shape.heads",
                f"a page of page_size*heads*head_dim = {bp.page_size}*{heads}*{dim} elements exceeds 2**63-1",
            )
        )
    elif bp.num_pages * page > _MAX_DIM:
        out.append(
            Violation("num_pages", f"num_pages*page_size*heads*head_dim = {bp.num_pages}*{page} exceeds 2**63-1")
        )


def _block_paged(d: TensorDescriptor, out: list[Violation]) -> None:
    bp = d.block_paged
    assert bp is not None
    if d.rank != 3:
        out.append(Violation("rank", f"a block-paged tensor has rank 3 [tokens, heads, head_dim], found {d.rank}"))
    if bp.paged_axis != 0:
        out.append(Violation("paged_axis", f"paged_axis must be 0, found {bp.paged_axis}"))
    if bp.page_size == 0:
        out.append(Violation("page_size", "page_size must be positive"))
    if d.rank == 3 and (d.shape[1] < 1 or d.shape[2] < 1):
        # No KV at all, and a pool of zero bytes whatever num_pages says: what reads it would size by that.
        out.append(
            Violation("shape.heads", f"a KV tensor has at least one head of at least one element, got {d.shape}")
        )
    if d.rank == 3:
        _extents(d, bp, out)
    if d.byte_offset != 0:
        out.append(Violation("byte_offset", f"block-paged byte_offset must be 0, found {d.byte_offset}"))
    if any(bp.reserved):
        out.append(Violation("block_paged.reserved", f"reserved bytes must be zero, found {bp.reserved.hex()}"))
    if d.shard is not None:
        out.append(Violation("shard", "a block-paged tensor must not carry a shard section"))
    if bp.kv_role_tag not in KV_ROLES:
        out.append(Violation("kv_role", f"unknown kv_role 0x{bp.kv_role_tag:02X}"))
    if bp.index_type_tag not in (0, 1):
        out.append(Violation("block_table_index_type", f"unknown index type 0x{bp.index_type_tag:02X}"))
    if bp.index_type_tag == 0 and bp.num_pages > 0xFFFFFFFF:
        out.append(
            Violation("block_table_index_type", f"uint32 page ids cannot address {bp.num_pages} pages; use uint64")
        )
    if len(d.buffers) < 3:
        out.append(Violation("buffer_count", f"block-paged needs at least 3 buffers, found {len(d.buffers)}"))
        return
    if d.rank == 3 and (dtypes.is_known_tag(d.type_tag) or 0xF0 <= d.type_tag <= 0xFE):
        want, type_name = _pool_bytes(d, bp.num_pages * bp.page_size * d.shape[1] * d.shape[2])
        geometry = f"num_pages*page_size*heads*head_dim = {bp.num_pages}*{bp.page_size}*{d.shape[1]}*{d.shape[2]}"
        if want is None:
            # Not passed silently: nothing here can say what the pool should hold.
            out.append(
                Violation(
                    "page_pool.size_unverifiable",
                    f"page_pool holds {d.buffers[0].byte_size} bytes; {geometry} {type_name} has no size "
                    "without a whole-byte or 1/2/4-bit width and its packing_factor",
                )
            )
        elif d.buffers[0].byte_size != want:
            out.append(
                Violation(
                    "page_pool.byte_size",
                    f"page_pool holds {d.buffers[0].byte_size} bytes; {geometry} {type_name} needs {want}",
                )
            )
    ib = bp.index_bytes
    if d.buffers[1].byte_size % ib:
        out.append(Violation("block_table.byte_size", f"{d.buffers[1].byte_size} bytes is not a multiple of {ib}"))
    if d.buffers[2].byte_size != (bp.num_seqs + 1) * ib:
        out.append(
            Violation(
                "seq_ptr.byte_size",
                f"seq_ptr holds {d.buffers[2].byte_size} bytes; num_seqs+1 = {bp.num_seqs + 1} entries need "
                f"{(bp.num_seqs + 1) * ib}",
            )
        )
    if d.rank == 3 and bp.page_size and d.buffers[1].byte_size % ib == 0:
        logical = d.buffers[1].byte_size // ib
        if d.shape[0] > logical * bp.page_size:
            out.append(
                Violation(
                    "shape.total_tokens",
                    f"shape[0] = {d.shape[0]} tokens do not fit in {logical} logical pages of {bp.page_size}",
                )
            )
    _quant_sizes(d, out)


_SMALL = 4096  # index entries below which validate_index_buffers works on Python lists


def _index_lists(
    d: TensorDescriptor, table: list[int], ptr: list[int], lens: list[int] | None, out: list[Violation]
) -> None:
    """:func:`validate_index_buffers` on lists, with the same violations and messages."""
    bp = d.block_paged
    assert bp is not None
    if ptr and ptr[0] != 0:
        out.append(Violation("seq_ptr.first", f"seq_ptr[0] must be 0, found {ptr[0]}"))
    for s in range(len(ptr) - 1):
        if ptr[s + 1] < ptr[s]:
            out.append(
                Violation("seq_ptr.non_decreasing", f"seq_ptr decreases at sequence {s}: {ptr[s]} > {ptr[s + 1]}")
            )
            break
    if ptr[-1] != len(table):
        out.append(
            Violation("seq_ptr.last", f"seq_ptr[num_seqs] = {ptr[-1]} but the block table has {len(table)} entries")
        )
    for k, page in enumerate(table):
        if page < 0 or page >= bp.num_pages:
            out.append(
                Violation(
                    "block_table.page_id", f"block_table[{k}] = {page} is outside the pool of {bp.num_pages} pages"
                )
            )
            break
    if lens is None:
        return
    if len(lens) != bp.num_seqs:
        out.append(Violation("seq_lens.count", f"{len(lens)} sequence lengths for {bp.num_seqs} sequences"))
        return
    if bp.num_seqs == 0:
        if d.rank and d.shape[0] != 0:
            out.append(Violation("seq_lens.total", f"an empty batch has 0 tokens, shape[0] = {d.shape[0]}"))
        return
    if any(n < 0 for n in lens):
        out.append(Violation("seq_lens.pages", "sequence lengths must be non-negative"))
        return
    if bp.page_size:
        for s, n in enumerate(lens):
            need, have = (n + bp.page_size - 1) // bp.page_size, ptr[s + 1] - ptr[s]
            if need != have:
                out.append(
                    Violation(
                        "seq_lens.pages",
                        f"sequence {s} has {n} tokens (needs {need} pages of {bp.page_size}) "
                        f"but seq_ptr gives it {have}",
                    )
                )
                break
    if d.rank and sum(lens) != d.shape[0]:
        out.append(Violation("seq_lens.total", f"sequence lengths sum to {sum(lens)}, shape[0] is {d.shape[0]}"))


def validate_index_buffers(
    d: TensorDescriptor,
    block_table: torch.Tensor,
    seq_ptr: torch.Tensor,
    seq_lens: torch.Tensor | None,
    out: list[Violation],
) -> None:
    """Storage invariants (1)-(3) on the index buffers, and seq_lens against them."""
    bp = d.block_paged
    assert bp is not None
    # Before any arithmetic, for small and large tables alike: a 2-D table's rows were compared as lists (a
    # TypeError), or, over _SMALL entries, checked flattened and then written so; an empty seq_ptr has no [-1].
    not_vectors = [(name, t) for name, t in (("block_table", block_table), ("seq_ptr", seq_ptr)) if t.dim() != 1]
    if not_vectors:
        out.extend(
            Violation(f"{name}.dtype", f"{name} must be a vector (1-D) of int32 or int64, got shape {list(t.shape)}")
            for name, t in not_vectors
        )
        return
    if not seq_ptr.numel():
        out.append(Violation("seq_ptr.first", "seq_ptr is empty: it holds num_seqs + 1 offsets ([0] for no sequence)"))
        return
    if seq_ptr.numel() != bp.num_seqs + 1:
        return  # already reported as seq_ptr.byte_size
    if seq_lens is not None and seq_lens.dim() != 1:
        out.append(Violation("seq_lens.count", f"sequence lengths must be a vector, got shape {list(seq_lens.shape)}"))
        return
    bad_index = [
        (name, t) for name, t in (("block_table", block_table), ("seq_ptr", seq_ptr)) if t.dtype not in INDEX_DTYPES
    ]
    if bad_index:
        # Read as they are, an int16 table of page ids up to 3000 over pages of 16 repages wrapped slots
        # (page * page_size in int16), and a float one is no page id at all.
        out.extend(
            Violation(f"{name}.dtype", f"{name} must be held as int32 or int64, not {t.dtype}; convert it")
            for name, t in bad_index
        )
        return
    if seq_lens is not None and seq_lens.dtype not in LENGTH_DTYPES:
        # A writer stores them as int64: 3.5 would be written as 3, and its total no longer shape[0].
        out.append(
            Violation(
                "seq_lens.dtype", f"sequence lengths must be integers (int8..int64 or uint8), not {seq_lens.dtype}"
            )
        )
        return
    small = block_table.numel() + seq_ptr.numel() + (seq_lens.numel() if seq_lens is not None else 0) <= _SMALL
    if small and all(t.device.type == "cpu" for t in (block_table, seq_ptr) if t is not None):
        # A chunk or a small batch: the same checks on Python ints are several
        # times faster than a dozen tiny torch ops (loading a chunk runs 16 of these).
        _index_lists(d, block_table.tolist(), seq_ptr.tolist(), None if seq_lens is None else seq_lens.tolist(), out)
        return
    if seq_lens is not None:
        # The arithmetic below in int64, as the Python ints above: in uint8 (a length dtype the rules allow)
        # 250 + 15 wraps to 9, calling a sequence of 250 tokens in no page valid, and a page_size of 256
        # becomes a division by zero.
        seq_lens = seq_lens.to(torch.int64)
    if seq_ptr.numel() and int(seq_ptr[0]) != 0:
        out.append(Violation("seq_ptr.first", f"seq_ptr[0] must be 0, found {int(seq_ptr[0])}"))
    if seq_ptr.numel() > 1 and bool((seq_ptr[1:] < seq_ptr[:-1]).any()):
        s = int(torch.nonzero(seq_ptr[1:] < seq_ptr[:-1])[0, 0])
        out.append(
            Violation(
                "seq_ptr.non_decreasing",
                f"seq_ptr decreases at sequence {s}: {int(seq_ptr[s])} > {int(seq_ptr[s + 1])}",
            )
        )
    if int(seq_ptr[-1]) != block_table.numel():
        out.append(
            Violation(
                "seq_ptr.last",
                f"seq_ptr[num_seqs] = {int(seq_ptr[-1])} but the block table has {block_table.numel()} entries",
            )
        )
    if block_table.numel():
        bad = (block_table < 0) | (block_table >= bp.num_pages)
        if bool(bad.any()):
            k = int(torch.nonzero(bad)[0, 0])
            out.append(
                Violation(
                    "block_table.page_id",
                    f"block_table[{k}] = {int(block_table[k])} is outside the pool of {bp.num_pages} pages",
                )
            )
    if seq_lens is None:
        return
    if seq_lens.numel() != bp.num_seqs:
        out.append(Violation("seq_lens.count", f"{seq_lens.numel()} sequence lengths for {bp.num_seqs} sequences"))
        return
    if bp.num_seqs == 0:
        if d.rank and d.shape[0] != 0:
            out.append(Violation("seq_lens.total", f"an empty batch has 0 tokens, shape[0] = {d.shape[0]}"))
        return
    if bool((seq_lens < 0).any()):
        out.append(Violation("seq_lens.pages", "sequence lengths must be non-negative"))
        return
    if bp.page_size:
        need = (seq_lens + bp.page_size - 1) // bp.page_size
        have = seq_ptr[1:] - seq_ptr[:-1]
        if not torch.equal(need, have):
            s = int(torch.nonzero(need != have)[0, 0])
            out.append(
                Violation(
                    "seq_lens.pages",
                    f"sequence {s} has {int(seq_lens[s])} tokens (needs {int(need[s])} pages of "
                    f"{bp.page_size}) but seq_ptr gives it {int(have[s])}",
                )
            )
    if d.rank and int(seq_lens.sum()) != d.shape[0]:
        out.append(
            Violation("seq_lens.total", f"sequence lengths sum to {int(seq_lens.sum())}, shape[0] is {d.shape[0]}")
        )


def validate_descriptor(
    d: TensorDescriptor,
    *,
    block_table: torch.Tensor | None = None,
    seq_ptr: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    permissive: bool = False,
) -> Checked:
    """Check ``d`` (and, when given, its index buffers and sequence lengths)."""
    out: list[Violation] = []
    _common(d, out)
    if d.layout_tag == LAYOUT_COMPOSITE:
        _composite(d, out)
    elif d.layout_tag == LAYOUT_BLOCK_PAGED:
        _block_paged(d, out)
        sizes_ok = not any(v.invariant.endswith("byte_size") or v.invariant == "buffer_count" for v in out)
        if block_table is not None and seq_ptr is not None and sizes_ok:
            validate_index_buffers(d, block_table, seq_ptr, seq_lens, out)
    return Checked(tuple(out), permissive)
