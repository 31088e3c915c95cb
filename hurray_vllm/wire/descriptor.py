"""Hurray tensor descriptors: frozen data model and the binary codec.

The wire format is ``metadata.md`` of the Hurray specification::

    [fixed header 20] [shape u64*rank] [byte_offset u64] [layout fields]
    [buffer table] [quantization?] [shard?] [statistics?] [extension type?]
    [composite member?]

``decode`` is *structural*: it refuses only what cannot be parsed at all
(bad magic, truncation, a length that lies, a layout whose fields it cannot
size). Everything that parses but breaks a rule (non-zero reserved bytes,
an unknown kv_role, a shard on a block-paged tensor...) is kept in the
decoded object so that :func:`hurray_vllm.containers.check` can report it by name,
and so that permissive readers and ``convert`` can carry it over unchanged.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace

from ..errors import HurrayArgumentError, HurrayFormatError

__all__ = [
    "MAGIC",
    "LAYOUT_ROW_MAJOR",
    "LAYOUT_BLOCK_PAGED",
    "LAYOUT_COMPOSITE",
    "BufferHandle",
    "BlockPagedFields",
    "CompositeFields",
    "RawLayoutFields",
    "PerTensorAffine",
    "PerChannelAffine",
    "PerBlockAffine",
    "RawQuantization",
    "Quantization",
    "Shard",
    "TensorDescriptor",
    "encode_descriptor",
    "decode_descriptor",
    "peek_descriptor_length",
    "encode_quantization",
    "decode_quantization",
]

MAGIC = b"HRRY"
VERSION_MAJOR = 1
VERSION_MINOR = 0
FIXED_HEADER_LEN = 20
#: No rank-3 descriptor comes near this; it bounds what a reader allocates
#: for a descriptor before it has validated anything.
MAX_DESCRIPTOR_LEN = 1 << 20
MAX_RANK = 64

LAYOUT_ROW_MAJOR = 0x01
LAYOUT_COL_MAJOR = 0x02
LAYOUT_STRIDED = 0x03
LAYOUT_TILED = 0x04
LAYOUT_MORTON = 0x05
LAYOUT_COO = 0x06
LAYOUT_CSR = 0x07
LAYOUT_CSC = 0x08
LAYOUT_CSF = 0x09
LAYOUT_BLOCK_PAGED = 0x0A
LAYOUT_COMPOSITE = 0x0B
LAYOUT_HILBERT = 0x40

FLAG_HAS_QUANTIZATION = 1 << 0
FLAG_HAS_SHARD = 1 << 1
FLAG_HAS_EXTENSION_TYPE = 1 << 2
FLAG_HAS_STATISTICS = 1 << 3
FLAG_HAS_COMPOSITE_MEMBER = 1 << 4
KNOWN_FLAGS = 0x1F

KV_ROLES = {0x00: "key", 0x01: "value", 0x02: "fused"}
KV_ROLE_TAGS = {v: k for k, v in KV_ROLES.items()}
INDEX_TYPES = {0x00: "uint32", 0x01: "uint64"}
INDEX_TYPE_TAGS = {v: k for k, v in INDEX_TYPES.items()}
LAYER_INDEX_NONE = 0xFFFFFFFF
COMPOSITION_RULES = {0x01: "partition", 0x02: "overlay", 0x03: "group"}
COMPOSITION_RULE_TAGS = {v: k for k, v in COMPOSITION_RULES.items()}
NO_BUFFER = 0xFFFFFFFF


@dataclass(frozen=True)
class BufferHandle:
    """One 16-byte buffer-table row: size, alignment and placement."""

    byte_size: int
    alignment: int = 64
    device_tag: int = 0
    sync_mode: int = 0
    memory_class: int = 0
    reserved: int = 0


@dataclass(frozen=True)
class BlockPagedFields:
    """The 32 layout-specific bytes of a block-paged (0x0A) descriptor.

    ``kv_role_tag`` and ``index_type_tag`` are the raw wire bytes so that
    unknown values survive decoding and are reported by validation.
    """

    page_size: int
    num_pages: int
    num_seqs: int
    kv_role_tag: int = 0x00
    layer_index: int | None = None
    index_type_tag: int = 0x00
    paged_axis: int = 0
    reserved: bytes = bytes(6)

    @property
    def kv_role(self) -> str:
        """The KV role's name (``"key"``, ``"value"``...), or the tag in hex when unknown."""
        return KV_ROLES.get(self.kv_role_tag, f"0x{self.kv_role_tag:02X}")

    @property
    def index_type(self) -> str:
        """The block-index type's name (``"uint32"``, ``"uint64"``), or the tag in hex when unknown."""
        return INDEX_TYPES.get(self.index_type_tag, f"0x{self.index_type_tag:02X}")

    @property
    def index_bytes(self) -> int:
        """Bytes per block-table and seq_ptr entry: 8 for uint64, else 4."""
        return 8 if self.index_type_tag == 0x01 else 4


@dataclass(frozen=True)
class CompositeFields:
    """The 8 layout-specific bytes of a composite head (0x0B)."""

    rule_tag: int
    member_count: int
    combine_op: int = 0
    reserved: bytes = bytes(2)

    @property
    def rule(self) -> str:
        """The composition rule's name, or the tag in hex when unknown."""
        return COMPOSITION_RULES.get(self.rule_tag, f"0x{self.rule_tag:02X}")


@dataclass(frozen=True)
class RawLayoutFields:
    """Layout-specific bytes of a layout hurray-vllm carries but does not model."""

    data: bytes = b""


LayoutFields = BlockPagedFields | CompositeFields | RawLayoutFields


@dataclass(frozen=True)
class PerTensorAffine:
    """Scheme 0x01: ``value = scale * (q - zero_point)``, parameters inline."""

    scale: float
    zero_point: int = 0
    scheme_version: int = 1
    flags: int = 0
    reserved: bytes = bytes(4)
    #: Bytes after the scheme's fields when the section is longer (see :func:`decode_quantization`).
    trailing: bytes = b""


@dataclass(frozen=True)
class PerChannelAffine:
    """Scheme 0x02: one float32 scale per slice along ``axis`` (buffer-held)."""

    axis: int
    scale_buffer_index: int
    zero_point_buffer_index: int | None = None
    scale_type_tag: int = 0x03
    scheme_version: int = 1
    flags: int | None = None
    reserved: bytes = bytes(3)
    #: Bytes after the scheme's fields when the section is longer (see :func:`decode_quantization`).
    trailing: bytes = b""

    @property
    def symmetric(self) -> bool:
        """Whether the scales have no zero points (``value = scale * q``)."""
        return self.zero_point_buffer_index is None


@dataclass(frozen=True)
class PerBlockAffine:
    """Scheme 0x03: one scale per ``block_size`` elements along ``axis``.

    On a block-paged tensor ``axis`` must be 0 and ``block_size`` must equal
    ``page_size``: the scales are then per page slot (``num_pages*page_size``
    entries) and travel through the block table with the values.
    """

    axis: int
    block_size: int
    scale_buffer_index: int
    zero_point_buffer_index: int | None = None
    scale_type_tag: int = 0x03
    scheme_version: int = 1
    flags: int | None = None
    reserved: bytes = bytes(3)
    #: Bytes after the scheme's fields when the section is longer (see :func:`decode_quantization`).
    trailing: bytes = b""

    @property
    def symmetric(self) -> bool:
        """Whether the scales have no zero points (``value = scale * q``)."""
        return self.zero_point_buffer_index is None


@dataclass(frozen=True)
class RawQuantization:
    """A quantization section whose scheme hurray-vllm does not model."""

    data: bytes

    @property
    def scheme_tag(self) -> int:
        """The scheme tag, the payload's first byte (0 when empty)."""
        return self.data[0] if self.data else 0


Quantization = PerTensorAffine | PerChannelAffine | PerBlockAffine | RawQuantization


@dataclass(frozen=True)
class Shard:
    """Shard section: the full tensor's shape and this shard's offset in it."""

    parent_shape: tuple[int, ...]
    shard_offset: tuple[int, ...]


@dataclass(frozen=True)
class TensorDescriptor:
    """A decoded (or to-be-encoded) Hurray tensor descriptor.

    Plain data: nothing here owns tensor memory. ``layout`` holds the
    layout-specific fields (:class:`BlockPagedFields`, :class:`CompositeFields`
    or the raw bytes of any other layout).
    """

    type_tag: int
    shape: tuple[int, ...]
    layout_tag: int
    layout: LayoutFields = field(default_factory=RawLayoutFields)
    buffers: tuple[BufferHandle, ...] = ()
    byte_offset: int = 0
    quantization: Quantization | None = None
    shard: Shard | None = None
    statistics: bytes | None = None
    extension_type: bytes | None = None
    composite_member: bytes | None = None
    version_major: int = VERSION_MAJOR
    version_minor: int = VERSION_MINOR
    #: Flag bits 5..31 as found on the wire (must be zero; kept for validation).
    reserved_flags: int = 0
    #: Bytes after the last field this reader knows, in a descriptor of a newer minor version
    #: (``versioning.md``: a reader skips them by ``descriptor_length``); written back as found.
    trailing: bytes = b""

    @property
    def flags(self) -> int:
        """The descriptor's flag bits: one per optional section present, plus :attr:`reserved_flags`."""
        f = self.reserved_flags
        if self.quantization is not None:
            f |= FLAG_HAS_QUANTIZATION
        if self.shard is not None:
            f |= FLAG_HAS_SHARD
        if self.extension_type is not None:
            f |= FLAG_HAS_EXTENSION_TYPE
        if self.statistics is not None:
            f |= FLAG_HAS_STATISTICS
        if self.composite_member is not None:
            f |= FLAG_HAS_COMPOSITE_MEMBER
        return f

    @property
    def rank(self) -> int:
        """Number of dimensions of the logical shape."""
        return len(self.shape)

    @property
    def data_bytes(self) -> int:
        """Sum of the buffer sizes (what follows the descriptor in a stream)."""
        return sum(b.byte_size for b in self.buffers)

    @property
    def block_paged(self) -> BlockPagedFields | None:
        """The block-paged fields, or ``None`` for another layout."""
        return self.layout if isinstance(self.layout, BlockPagedFields) else None

    @property
    def composite(self) -> CompositeFields | None:
        """The composite head's fields, or ``None`` for another layout."""
        return self.layout if isinstance(self.layout, CompositeFields) else None

    def with_buffers(self, buffers: tuple[BufferHandle, ...]) -> TensorDescriptor:
        """The same descriptor with ``buffers`` instead."""
        return replace(self, buffers=buffers)


# ── encoding ────────────────────────────────────────────────────────────────


def encode_quantization(q: Quantization) -> bytes:
    """The bytes of a quantization section payload (``quantization.md``)."""
    if isinstance(q, RawQuantization):
        return q.data
    if isinstance(q, PerTensorAffine):
        return struct.pack("<BBHfi", 0x01, q.scheme_version, q.flags, q.scale, q.zero_point) + q.reserved + q.trailing
    if isinstance(q, PerChannelAffine):
        flags = q.flags if q.flags is not None else (1 if q.symmetric else 0)
        zp = NO_BUFFER if q.zero_point_buffer_index is None else q.zero_point_buffer_index
        return (
            struct.pack("<BBHIIIB", 0x02, q.scheme_version, flags, q.axis, q.scale_buffer_index, zp, q.scale_type_tag)
            + q.reserved
            + q.trailing
        )
    if isinstance(q, PerBlockAffine):
        flags = q.flags if q.flags is not None else (1 if q.symmetric else 0)
        zp = NO_BUFFER if q.zero_point_buffer_index is None else q.zero_point_buffer_index
        return (
            struct.pack(
                "<BBHIIIIB",
                0x03,
                q.scheme_version,
                flags,
                q.axis,
                q.block_size,
                q.scale_buffer_index,
                zp,
                q.scale_type_tag,
            )
            + q.reserved
            + q.trailing
        )
    raise TypeError(f"not a quantization descriptor: {q!r}")


def _encode_layout(d: TensorDescriptor) -> bytes:
    lay = d.layout
    if isinstance(lay, BlockPagedFields):
        li = LAYER_INDEX_NONE if lay.layer_index is None else lay.layer_index
        return (
            struct.pack(
                "<IQIIBIB",
                lay.page_size,
                lay.num_pages,
                lay.paged_axis,
                lay.num_seqs,
                lay.kv_role_tag,
                li,
                lay.index_type_tag,
            )
            + lay.reserved
        )
    if isinstance(lay, CompositeFields):
        return struct.pack("<BB", lay.rule_tag, lay.combine_op) + lay.reserved + struct.pack("<I", lay.member_count)
    return lay.data


def layer_index_offset(d: TensorDescriptor) -> int:
    """Where the uint32 layer index of block-paged ``d`` lies in ``encode_descriptor(d)``.

    Lets a writer encode one layer's descriptor and patch the index for the
    next layers instead of encoding each (it follows the shape and byte
    offset, inside the layout fields as :func:`_encode_layout` packs them).
    """
    if not isinstance(d.layout, BlockPagedFields):
        raise HurrayFormatError("layout_tag", "only block-paged descriptors carry a layer index")
    return FIXED_HEADER_LEN + 8 * len(d.shape) + 8 + struct.calcsize("<IQIIB")


_U8, _U16, _U32, _U64 = 0xFF, 0xFFFF, 0xFFFFFFFF, (1 << 64) - 1


def _unsigned(field: str, value: object, top: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
        raise HurrayArgumentError(field, f"{value!r} is not an integer in 0..{top}")


def _sized(field: str, value: bytes, n: int) -> None:
    if len(value) != n:
        raise HurrayArgumentError(field, f"must be {n} bytes, got {len(value)}")


def _check_quantization(q: Quantization) -> None:
    if isinstance(q, RawQuantization):
        try:
            decode_quantization(q.data)
        except HurrayFormatError as exc:
            raise HurrayArgumentError("quantization", f"raw section cannot be read back: {exc}") from None
        return
    _unsigned("quantization.scheme_version", q.scheme_version, _U8)
    _sized("quantization.reserved", q.reserved, 4 if isinstance(q, PerTensorAffine) else 3)
    if isinstance(q, PerTensorAffine):
        _unsigned("quantization.flags", q.flags, _U16)
        if not isinstance(q.zero_point, int) or not -(1 << 31) <= q.zero_point < 1 << 31:
            raise HurrayArgumentError("quantization.zero_point", f"{q.zero_point!r} is not an int32")
        try:
            struct.pack("<f", q.scale)
        except (OverflowError, struct.error) as exc:
            raise HurrayArgumentError("quantization.scale", f"{q.scale!r} is not a float32: {exc}") from None
        return
    if q.flags is not None:
        _unsigned("quantization.flags", q.flags, _U16)
    _unsigned("quantization.axis", q.axis, _U32)
    _unsigned("quantization.scale_buffer_index", q.scale_buffer_index, _U32)
    if q.zero_point_buffer_index is not None:  # 0xFFFFFFFF is how the wire says None
        _unsigned("quantization.zero_point_buffer_index", q.zero_point_buffer_index, NO_BUFFER - 1)
    _unsigned("quantization.scale_type", q.scale_type_tag, _U8)
    if isinstance(q, PerBlockAffine):
        _unsigned("quantization.block_size", q.block_size, _U32)


def _check_layout(d: TensorDescriptor) -> None:
    lay = d.layout
    if isinstance(lay, BlockPagedFields) != (d.layout_tag == LAYOUT_BLOCK_PAGED) or isinstance(
        lay, CompositeFields
    ) != (d.layout_tag == LAYOUT_COMPOSITE):
        raise HurrayArgumentError("layout_tag", f"0x{d.layout_tag:02X} does not match {type(lay).__name__}")
    if isinstance(lay, BlockPagedFields):
        _unsigned("page_size", lay.page_size, _U32)
        _unsigned("num_pages", lay.num_pages, _U64)
        _unsigned("paged_axis", lay.paged_axis, _U32)
        _unsigned("num_seqs", lay.num_seqs, _U32)
        _unsigned("kv_role", lay.kv_role_tag, _U8)
        if lay.layer_index is not None:  # 0xFFFFFFFF is how the wire says None
            _unsigned("layer_index", lay.layer_index, LAYER_INDEX_NONE - 1)
        _unsigned("block_table_index_type", lay.index_type_tag, _U8)
        _sized("block_paged.reserved", lay.reserved, 6)
    elif isinstance(lay, CompositeFields):
        _unsigned("composite.rule", lay.rule_tag, _U8)
        _unsigned("composite.combine_op", lay.combine_op, _U8)
        _sized("composite.reserved", lay.reserved, 2)
        _unsigned("composite.member_count", lay.member_count, _U32)
    else:
        c = _Cursor(lay.data, 0, len(lay.data))
        try:
            _decode_layout(c, d.layout_tag, len(d.shape))
        except HurrayFormatError as exc:
            raise HurrayArgumentError("layout", f"layout fields cannot be read back: {exc}") from None
        if c.pos != len(lay.data):
            raise HurrayArgumentError("layout", f"{len(lay.data)} bytes of layout fields; the layout reads {c.pos}")


def _check_encodable(d: TensorDescriptor) -> None:
    """What :func:`encode_descriptor` refuses: values the wire cannot hold, or bytes it could not read back."""
    _unsigned("version_major", d.version_major, _U8)
    _unsigned("version_minor", d.version_minor, _U8)
    _unsigned("type_tag", d.type_tag, _U8)
    _unsigned("layout_tag", d.layout_tag, _U8)
    if len(d.shape) > MAX_RANK:
        raise HurrayArgumentError("rank", f"rank {len(d.shape)} exceeds the normative cap of {MAX_RANK}")
    for k, n in enumerate(d.shape):
        _unsigned(f"shape[{k}]", n, _U64)
    _unsigned("byte_offset", d.byte_offset, _U64)
    if not isinstance(d.reserved_flags, int) or d.reserved_flags & KNOWN_FLAGS or not 0 <= d.reserved_flags <= _U32:
        raise HurrayArgumentError("flags.reserved", f"{d.reserved_flags!r} is not within flag bits 5..31")
    _check_layout(d)
    for i, b in enumerate(d.buffers):
        _unsigned(f"buffers[{i}].byte_size", b.byte_size, _U64)
        _unsigned(f"buffers[{i}].alignment", b.alignment, _U32)
        for name in ("device_tag", "sync_mode", "memory_class", "reserved"):
            _unsigned(f"buffers[{i}].{name}", getattr(b, name), _U8)
    if d.quantization is not None:
        _check_quantization(d.quantization)
    if d.shard is not None:
        for name, v in (("parent_shape", d.shard.parent_shape), ("shard_offset", d.shard.shard_offset)):
            if len(v) != len(d.shape):
                raise HurrayArgumentError(f"shard.{name}", f"{len(v)} entries for rank {len(d.shape)}")
            for k, n in enumerate(v):
                _unsigned(f"shard.{name}[{k}]", n, _U64)
    if d.statistics is not None:
        _sized("statistics", d.statistics, 72)
    if d.extension_type is not None:
        _sized("extension_type", d.extension_type, 20)
    if d.composite_member is not None:
        _sized("composite_member", d.composite_member, 16)
    if d.trailing and not (d.version_major == VERSION_MAJOR and d.version_minor > VERSION_MINOR):
        raise HurrayArgumentError(
            "trailing",
            f"trailing bytes are only readable in a descriptor newer than {VERSION_MAJOR}.{VERSION_MINOR}, "
            f"this one is {d.version_major}.{d.version_minor}",
        )


def encode_descriptor(d: TensorDescriptor) -> bytes:
    """Encode ``d`` to its wire bytes, byte-identical to the reference writer.

    Raises:
        HurrayArgumentError: (naming the field) a value the wire cannot hold (a shape above
            2**64-1, a layer index of 0xFFFFFFFF, which the wire reserves for "none"), or a
            section of the wrong length: what would encode bytes no reader can read back.
        HurrayFormatError: (``buffer_count``) more than 255 buffers.
    """
    if len(d.buffers) > 255:
        raise HurrayFormatError("buffer_count", f"{len(d.buffers)} buffers; the wire limit is 255")
    _check_encodable(d)
    parts = [
        struct.pack(f"<{len(d.shape)}Q", *d.shape),
        struct.pack("<Q", d.byte_offset),
        _encode_layout(d),
        struct.pack("<B", len(d.buffers)),
    ]
    for b in d.buffers:
        parts.append(
            struct.pack("<QIBBBB", b.byte_size, b.alignment, b.device_tag, b.sync_mode, b.memory_class, b.reserved)
        )
    if d.quantization is not None:
        q = encode_quantization(d.quantization)
        parts.append(struct.pack("<I", len(q)) + q)
    if d.shard is not None:
        parts.append(struct.pack(f"<{len(d.shape)}Q", *d.shard.parent_shape))
        parts.append(struct.pack(f"<{len(d.shape)}Q", *d.shard.shard_offset))
    if d.statistics is not None:
        parts.append(d.statistics)
    if d.extension_type is not None:
        parts.append(d.extension_type)
    if d.composite_member is not None:
        parts.append(d.composite_member)
    parts.append(d.trailing)
    body = b"".join(parts)
    total = FIXED_HEADER_LEN + len(body)
    if total > _U32:
        raise HurrayArgumentError("descriptor_length", f"{total} bytes do not fit the uint32 descriptor_length")
    header = MAGIC + struct.pack(
        "<BBIIBBI", d.version_major, d.version_minor, total, d.flags, d.type_tag, d.layout_tag, len(d.shape)
    )
    return header + body


# ── decoding ────────────────────────────────────────────────────────────────


class _Cursor:
    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: bytes | memoryview, start: int, end: int) -> None:
        self.buf = buf
        self.pos = start
        self.end = end

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise HurrayFormatError(what, f"descriptor ends before {what} ({n} bytes needed at offset {self.pos})")
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple[int, ...]:
        raw = self.take(struct.calcsize(fmt), what)
        return struct.unpack(fmt, raw)

    def u8(self, what: str) -> int:
        return self.unpack("<B", what)[0]

    def u32(self, what: str) -> int:
        return self.unpack("<I", what)[0]

    def u64(self, what: str) -> int:
        return self.unpack("<Q", what)[0]


def peek_descriptor_length(head: bytes | memoryview) -> int:
    """Total descriptor length from its first 10 bytes, with the magic checked."""
    if len(head) < 10:
        raise HurrayFormatError("descriptor_length", f"need 10 bytes to read a descriptor header, got {len(head)}")
    if bytes(head[:4]) != MAGIC:
        raise HurrayFormatError("magic", f"expected b'HRRY', found {bytes(head[:4])!r}")
    (length,) = struct.unpack_from("<I", head, 6)
    if length < FIXED_HEADER_LEN:
        raise HurrayFormatError("descriptor_length", f"{length} is below the 20-byte minimum")
    if length > MAX_DESCRIPTOR_LEN:
        raise HurrayFormatError(
            "descriptor_length",
            f"descriptor_length {length} exceeds this reader's {MAX_DESCRIPTOR_LEN}-byte limit for one descriptor",
        )
    return length


def _decode_layout(c: _Cursor, tag: int, rank: int, depth: int = 0) -> LayoutFields:
    if tag in (LAYOUT_ROW_MAJOR, LAYOUT_COL_MAJOR):
        return RawLayoutFields(b"")
    if tag == LAYOUT_BLOCK_PAGED:
        page_size, num_pages, axis, num_seqs, role, layer, idx = c.unpack("<IQIIBIB", "block_paged")
        reserved = c.take(6, "block_paged.reserved")
        return BlockPagedFields(
            page_size=page_size,
            num_pages=num_pages,
            num_seqs=num_seqs,
            kv_role_tag=role,
            layer_index=None if layer == LAYER_INDEX_NONE else layer,
            index_type_tag=idx,
            paged_axis=axis,
            reserved=reserved,
        )
    if tag == LAYOUT_COMPOSITE:
        rule, op = c.unpack("<BB", "composite")
        reserved = c.take(2, "composite.reserved")
        count = c.u32("composite.member_count")
        return CompositeFields(rule_tag=rule, member_count=count, combine_op=op, reserved=reserved)
    start = c.pos
    if tag == LAYOUT_STRIDED:
        c.take(8 * rank, "strided.strides")
    elif tag == LAYOUT_MORTON:
        c.take(4 * rank, "morton.morton_bits")
    elif tag in (LAYOUT_COO, LAYOUT_CSR, LAYOUT_CSC):
        c.take(16, "sparse")
    elif tag == LAYOUT_CSF:
        c.take(8 + 4 * rank + 8, "csf")
    elif tag == LAYOUT_HILBERT:
        c.take(8, "hilbert")
    elif tag == LAYOUT_TILED:
        _skip_tiled(c, rank, depth)
    elif 0xF0 <= tag <= 0xFE:
        c.take(8, "extension_layout_id")
        n = c.u32("extension_data_length")
        c.take(n, "extension_data")
    else:
        raise HurrayFormatError("layout_tag", f"unknown layout tag 0x{tag:02X}; its fields cannot be sized")
    return RawLayoutFields(bytes(c.buf[start : c.pos]))


def _skip_tiled(c: _Cursor, rank: int, depth: int) -> None:
    if depth >= 8:
        raise HurrayFormatError("tiled", "tiled layouts nest deeper than 8 levels")
    c.take(8 * rank, "tiled.tile_shape")
    outer, inner = c.unpack("<BB", "tiled.layouts")
    c.take(2, "tiled.reserved")
    if outer == LAYOUT_STRIDED:
        c.take(8 * rank, "tiled.outer_strides")
    if inner == LAYOUT_STRIDED:
        c.take(8 * rank, "tiled.inner_strides")
    elif inner == LAYOUT_TILED:
        _skip_tiled(c, rank, depth + 1)


def _explicit_flags(flags: int, zero_point_index: int) -> int | None:
    """``None`` when the flags are what the zero-point index implies (the canonical form)."""
    return None if flags == (1 if zero_point_index == NO_BUFFER else 0) else flags


def decode_quantization(data: bytes) -> Quantization:
    """Decode a quantization payload; unknown schemes come back raw.

    A section longer than its scheme's fields keeps the extra bytes in ``trailing``:
    pyhurray accepts such a section and writes it back whole, and so must ``convert``,
    or the descriptor it copies would change.
    """
    if len(data) < 4:
        raise HurrayFormatError("quantization", f"section of {len(data)} bytes is shorter than its 4-byte header")
    scheme = data[0]
    try:
        if scheme == 0x01 and len(data) >= 16:
            _, ver, flags, scale, zp = struct.unpack_from("<BBHfi", data)
            return PerTensorAffine(
                scale=scale, zero_point=zp, scheme_version=ver, flags=flags, reserved=data[12:16], trailing=data[16:]
            )
        if scheme == 0x02 and len(data) >= 20:
            _, ver, flags, axis, si, zi, st = struct.unpack_from("<BBHIIIB", data)
            return PerChannelAffine(
                axis=axis,
                scale_buffer_index=si,
                zero_point_buffer_index=None if zi == NO_BUFFER else zi,
                scale_type_tag=st,
                scheme_version=ver,
                flags=_explicit_flags(flags, zi),
                reserved=data[17:20],
                trailing=data[20:],
            )
        if scheme == 0x03 and len(data) >= 24:
            _, ver, flags, axis, bs, si, zi, st = struct.unpack_from("<BBHIIIIB", data)
            return PerBlockAffine(
                axis=axis,
                block_size=bs,
                scale_buffer_index=si,
                zero_point_buffer_index=None if zi == NO_BUFFER else zi,
                scale_type_tag=st,
                scheme_version=ver,
                flags=_explicit_flags(flags, zi),
                reserved=data[21:24],
                trailing=data[24:],
            )
    except struct.error as exc:  # pragma: no cover - lengths are checked above
        raise HurrayFormatError("quantization", str(exc)) from None
    if scheme in (0x01, 0x02, 0x03):
        raise HurrayFormatError("quantization", f"scheme 0x{scheme:02X} section is truncated ({len(data)} bytes)")
    return RawQuantization(bytes(data))


def decode_descriptor(buf: bytes | bytearray | memoryview, offset: int = 0) -> TensorDescriptor:
    """Decode the descriptor starting at ``buf[offset]``.

    Raises :class:`HurrayFormatError` naming the field when the bytes cannot
    be parsed. Rule violations that still parse are left for
    :func:`hurray_vllm.containers.check` to report.
    """
    view = memoryview(buf) if not isinstance(buf, memoryview) else buf
    length = peek_descriptor_length(view[offset : offset + 10])
    end = offset + length
    if end > len(view):
        raise HurrayFormatError(
            "descriptor_length", f"declares {length} bytes but only {len(view) - offset} are available"
        )
    c = _Cursor(view, offset + 6 + 4, end)
    vmaj_vmin = struct.unpack_from("<BB", view, offset + 4)
    flags, type_tag, layout_tag, rank = c.unpack("<IBBI", "header")
    if vmaj_vmin[0] > VERSION_MAJOR:
        raise HurrayFormatError("version_major", f"descriptor version {vmaj_vmin[0]} is newer than supported 1")
    if rank > MAX_RANK:
        raise HurrayFormatError("rank", f"rank {rank} exceeds the normative cap of {MAX_RANK}")
    shape = c.unpack(f"<{rank}Q", "shape")
    byte_offset = c.u64("byte_offset")
    layout = _decode_layout(c, layout_tag, rank)
    count = c.u8("buffer_count")
    buffers = []
    for i in range(count):
        size, align, dev, sync, mem, res = c.unpack("<QIBBBB", f"buffers[{i}]")
        buffers.append(BufferHandle(size, align, dev, sync, mem, res))
    quant: Quantization | None = None
    if flags & FLAG_HAS_QUANTIZATION:
        qlen = c.u32("quantization_length")
        quant = decode_quantization(c.take(qlen, "quantization"))
    shard = None
    if flags & FLAG_HAS_SHARD:
        parent = c.unpack(f"<{rank}Q", "shard.parent_shape")
        offs = c.unpack(f"<{rank}Q", "shard.shard_offset")
        shard = Shard(tuple(parent), tuple(offs))
    stats = c.take(72, "statistics") if flags & FLAG_HAS_STATISTICS else None
    ext = c.take(20, "extension_type") if flags & FLAG_HAS_EXTENSION_TYPE else None
    member = c.take(16, "composite_member") if flags & FLAG_HAS_COMPOSITE_MEMBER else None
    trailing = b""
    if vmaj_vmin[0] == VERSION_MAJOR and vmaj_vmin[1] > VERSION_MINOR:
        # versioning.md § Reader Behaviour: a reader older in minor version skips what it does not
        # know by descriptor_length; kept, so that convert writes the descriptor back unchanged.
        trailing = c.take(end - c.pos, "trailing")
    elif c.pos != end:
        raise HurrayFormatError(
            "descriptor_length", f"declares {length} bytes but its fields end after {c.pos - offset}"
        )
    return TensorDescriptor(
        type_tag=type_tag,
        shape=tuple(shape),
        layout_tag=layout_tag,
        layout=layout,
        buffers=tuple(buffers),
        byte_offset=byte_offset,
        quantization=quant,
        shard=shard,
        statistics=stats,
        extension_type=ext,
        composite_member=member,
        version_major=vmaj_vmin[0],
        version_minor=vmaj_vmin[1],
        reserved_flags=flags & ~KNOWN_FLAGS,
        trailing=trailing,
    )
