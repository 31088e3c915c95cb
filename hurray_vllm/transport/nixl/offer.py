"""The side channel's offer: a chunk's descriptors and inline buffers, its page pools only announced.

An offer's body (after ``b"HVN1"`` u64 length)::

    u16 len + namespace  u16 len + key  u32 record count
    per record: u32 len + descriptor, then per buffer
                mode 0 + the buffer's bytes  (inline: token ids, block tables, metadata)
             or mode 1                      (remote: a page pool, WRITten by NIXL)

(each mode is one byte).

The receiver decodes it with :func:`parse_offer`, which checks every size
before allocating anything, and assembles the snapshot from it exactly as
it would from a stream.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ...containers.schema import MAX_RECORDS, Record, dense_record, header_records, layer_records, state_records
from ...containers.stream import layer_structure_key, tensor_bytes
from ...errors import HurrayFormatError
from ...kv.snapshot import KVSnapshot
from ...wire.descriptor import (
    LAYER_INDEX_NONE,
    LAYOUT_BLOCK_PAGED,
    TensorDescriptor,
    encode_descriptor,
    layer_index_offset,
)
from ...wire.descriptor import peek_descriptor_length as _peek_len
from ...wire.rules import decode_checked
from ..base import FRAME_MIN_RATE, U16, U32, check_names, parse_address

__all__ = [
    "MAGIC",
    "MAX_OFFER_BYTES",
    "MAX_RECORDS",
    "NOTIF_PREFIX",
    "Offer",
    "encode_offer",
    "encode_snapshot_offer",
    "Landing",
    "assemble_offer",
    "check_offer",
    "pool_offsets",
    "parse_offer",
    "parse_nixl_url",
    "notif_tag",
    "INLINE_ALIGN",
    "POOL_ALIGN",
    "host_bytes",
    "transfer_seconds",
]

MAGIC = b"HVN1"
_INLINE, _REMOTE = 0, 1
_INLINE_BYTE, _REMOTE_BYTE = bytes([_INLINE]), bytes([_REMOTE])
#: Descriptors and inline buffers (token ids, block tables, metadata) of one chunk.
MAX_OFFER_BYTES = 64 << 20
#: The most buffers one record of a chunk has: a block-paged tensor's 3 and two quantization parameter
#: buffers (a dense record has 1, a group head 0). The wire allows 255: each inline one, even of 0 bytes,
#: would become a tensor here, ~25x the offer's size in memory before anything is admitted.
MAX_RECORD_BUFFERS = 5
#: The memory one decoded record may hold besides its inline bytes: its descriptor and :data:`MAX_RECORD_BUFFERS`
#: inline tensors, lists included (~2.1 KiB of resident memory measured for 5 empty buffers, rounded up). An offer
#: of 126-byte records of empty buffers builds ~17x its bytes: :func:`parse_offer` charges this per record first.
RECORD_MEMORY_BYTES = 2560
#: Each page pool starts on such a boundary in the receiver's buffers.
POOL_ALIGN = 4096
#: An inline buffer whose bytes start on such a boundary in the offer's body is a view of the body; any other
#: is copied out (and the copy charged): its record may view it as a wider type (int64, float64, complex128),
#: which torch, numpy and the kernels expect aligned, as every buffer they otherwise get is.
INLINE_ALIGN = 16
#: What an inline buffer's place holds while :func:`parse_offer` checks the rest of the offer.
_PENDING = torch.empty(0, dtype=torch.uint8)
#: Every NIXL notification of this module starts so (``hvn1:<xfer id hex>:<pool index>``).
NOTIF_PREFIX = b"hvn1:"


def parse_nixl_url(url: str) -> tuple[str, int]:
    """``nixl://HOST:PORT`` (the receiver's side channel) -> ``(HOST, PORT)``."""
    return parse_address(url, "nixl")


def notif_tag(xfer_id: int, index: int) -> bytes:
    """The notification that tells the receiver page pool ``index`` of transfer ``xfer_id`` landed."""
    return NOTIF_PREFIX + b"%x:%d" % (xfer_id, index)


def transfer_seconds(timeout: float, nbytes: int) -> float:
    """How long the WRITEs of ``nbytes`` of page pools may take: ``timeout`` plus one second per MiB.

    The receiver's frame rule (:class:`~hurray_vllm.transport.base.ReceiverBase`,
    :data:`~hurray_vllm.transport.base.FRAME_MIN_RATE`), applied by the sender and the
    receiver alike: a flat ``timeout`` would abort every 4 GiB chunk on a link
    slower than 70 MB/s, and the two sides must agree on when a transfer is late.
    """
    return timeout + nbytes / FRAME_MIN_RATE


def host_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t``'s bytes in host memory (a copy only for device or strided tensors)."""
    if t.device.type != "cpu":
        t = t.cpu()  # NIXL can read VRAM too, but only tested on the host: stage it
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class _OfferWriter:
    """The parts of an offer's body, record after record (see the protocol in the module docstring)."""

    def __init__(self, ns: str, key: str) -> None:
        nsb, kb = ns.encode(), key.encode()
        self.parts: list[Any] = [U16.pack(len(nsb)), nsb, U16.pack(len(kb)), kb, b""]
        self.remote: list[torch.Tensor] = []
        self._rank: list[tuple[int, int]] = []
        self._count = 0

    def add(self, rec: Record) -> None:
        raw = encode_descriptor(rec.descriptor)
        self.parts += [U32.pack(len(raw)), raw]
        self._count += 1
        bp = rec.descriptor.block_paged
        for j, t in enumerate(rec.buffers):
            if bp is not None and j == 0 and t.numel() > 0:
                self.parts.append(_REMOTE_BYTE)
                self._announce(bp.kv_role, t)
            else:
                self.parts += [_INLINE_BYTE, tensor_bytes(t)]

    def _announce(self, role: str, pool: torch.Tensor) -> None:
        self._rank.append((1 if role == "value" else 0, len(self.remote)))
        self.remote.append(host_bytes(pool))

    def add_layers(self, snap: KVSnapshot) -> None:
        """Every layer's group; layers that share their block structure (a chunk's do) are encoded once.

        A later layer reuses the first one's parts and patches its layer index
        into its block-paged descriptors (K and V, or one fused latent), as :class:`stream.LayerWriter`
        does for streams: the bytes are those of ``add`` over ``layer_records``.
        """
        index_cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        shared: tuple[object, ...] | None = None
        template: list[Any] = []
        patches: list[tuple[int, int]] = []  # (part index in the template, layer index offset) for key, value
        for i, members in enumerate(snap.layer_members()):
            scales = snap.kv_scales[i] if snap.kv_scales is not None else None
            structure = layer_structure_key(members, scales)
            if structure is not None and structure == shared and all(t.page_pool.numel() for t in members):
                at = len(self.parts)
                self.parts += template
                for (pos, off), t in zip(patches, members, strict=True):
                    raw = bytearray(template[pos])
                    struct.pack_into("<I", raw, off, LAYER_INDEX_NONE if t.layer_index is None else t.layer_index)
                    self.parts[at + pos] = raw
                    self._announce(t.kv_role, t.page_pool)
                self._count += len(members) + 2  # head, members, seq_lens
                if scales is not None:
                    self.add(dense_record(f"layers.{i}.kv_scales", torch.tensor(scales, dtype=torch.float32)))
                continue
            head, *recs = list(layer_records(i, members, scales, index_cache))
            tensors, lens, rest = recs[: len(members)], recs[len(members)], recs[len(members) + 1 :]
            at = len(self.parts)
            self.add(head)
            patches = []
            for rec in tensors:
                patches.append((len(self.parts) + 1 - at, layer_index_offset(rec.descriptor)))
                self.add(rec)
            self.add(lens)
            template = self.parts[at:]
            shared = structure
            for rec in rest:
                self.add(rec)

    def finish(self) -> tuple[list[Any], list[torch.Tensor], list[int]]:
        """(message parts, page pools to WRITE, the order to post them in: keys before values).

        Raises:
            HurrayFormatError: (field ``transport.offer``) the inline part would
                exceed what a receiver accepts (:data:`MAX_OFFER_BYTES`).
        """
        self.parts[4] = U32.pack(self._count)
        inline = sum(len(p) if isinstance(p, (bytes, bytearray)) else memoryview(p).nbytes for p in self.parts)
        if inline > MAX_OFFER_BYTES:
            # Linear-attention states travel inline: a big model's can pass the bound.
            raise HurrayFormatError(
                "transport.offer",
                f"{inline / 2**20:.0f} MiB of descriptors and inline buffers (recurrent states included) exceed "
                f"the {MAX_OFFER_BYTES >> 20} MiB a NIXL receiver accepts; push this model over tcp://",
            )
        return self.parts, self.remote, [i for _, i in sorted(self._rank)]


def encode_offer(ns: str, key: str, records: Iterable[Record]) -> tuple[list[Any], list[torch.Tensor], list[int]]:
    """(message parts, page pools to WRITE, the order to post them in) for any records."""
    w = _OfferWriter(ns, key)
    for rec in records:
        w.add(rec)
    return w.finish()


def encode_snapshot_offer(ns: str, key: str, snap: KVSnapshot) -> tuple[list[Any], list[torch.Tensor], list[int]]:
    """``encode_offer(ns, key, snapshot_records(snap))``, encoding a shared layer structure once."""
    w = _OfferWriter(ns, key)
    for rec in header_records(snap):
        w.add(rec)
    w.add_layers(snap)
    for rec in state_records(snap.states):  # small: inline, with the descriptors
        w.add(rec)
    return w.finish()


class _Cursor:
    def __init__(self, buf: bytearray) -> None:
        self.buf, self.pos = memoryview(buf), 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise HurrayFormatError("transport.offer", f"offer ends inside {what}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return int(self.take(1, what)[0])

    def u16(self, what: str) -> int:
        return int(U16.unpack(self.take(2, what))[0])

    def u32(self, what: str) -> int:
        return int(U32.unpack(self.take(4, what))[0])


@dataclass
class Offer:
    """A decoded offer: the chunk's descriptors, its inline buffers, the sizes of the pools to come by NIXL."""

    ns: str
    key: str
    descriptors: list[TensorDescriptor]
    #: per record, per buffer: an inline uint8 tensor or the index of a remote buffer
    buffers: list[list[torch.Tensor | int]]
    remote_sizes: list[int]


@dataclass
class Landing:
    """Where an offered chunk lands: its snapshot over the pools' memory, and how to check it as it arrives."""

    snapshot: KVSnapshot
    #: the chunk digest string the offer carries, and its algorithm
    digest: str
    algorithm: str
    #: per digest tensor (:func:`~hurray_vllm.chunks.digest.digest_tensors` order): its pool's bytes and the
    #: index of the announced pool it lands in (``None``: an empty pool, nothing to wait for)
    plan: list[tuple[memoryview, int | None]]


def assemble_offer(offer: Offer, views: list[torch.Tensor]) -> Landing:
    """The chunk an offer describes, with ``views`` (one per announced pool, not yet written) as its pools.

    Everything but the pools' bytes is checked here, before any transfer:
    the records form a chunk (as a stream's would), the digest is one this
    version checks, and the announced pools are exactly the snapshot's page
    pools.

    Raises:
        HurrayFormatError: any of those fails.
    """
    snap, want, algorithm, pools = _assemble(offer, views)
    return Landing(snap, want, algorithm, [(tensor_bytes(p), i) for p, i in pools])


def _assemble(
    offer: Offer, views: list[torch.Tensor]
) -> tuple[KVSnapshot, str, str, list[tuple[torch.Tensor, int | None]]]:
    """All of :func:`assemble_offer`'s work but taking views of the pools' bytes.

    Returns the snapshot, its digest and the digest's algorithm, and per digest
    tensor its pool and the index of the announced pool it is (see :class:`Landing`).
    """
    from ...chunks.digest import DIGEST_KEY, ChunkDigest, digest_tensors
    from ...containers.schema import assemble_snapshot, group_records

    records = [
        Record("", d, [views[b] if isinstance(b, int) else b for b in bufs])
        for d, bufs in zip(offer.descriptors, offer.buffers, strict=True)
    ]
    snap = assemble_snapshot(group_records(records))
    want = snap.extra.get(DIGEST_KEY)
    algorithm = ChunkDigest.like(want).algorithm  # refuses a missing or unknown digest before any transfer
    where = {v.data_ptr(): i for i, v in enumerate(views)}
    pools = [
        (t.page_pool, where.get(t.page_pool.data_ptr()) if t.page_pool.numel() else None) for t in digest_tensors(snap)
    ]
    if sorted(i for _, i in pools if i is not None) != list(range(len(views))):
        raise HurrayFormatError("transport.offer", "the announced page pools are not the snapshot's")
    return snap, str(want), algorithm, pools


def check_offer(offer: Offer) -> KVSnapshot:
    """:func:`assemble_offer`'s checks with no memory for the pools: the offered chunk, its pools placeholders.

    The placeholders are on torch's ``meta`` device (shapes, no storage),
    one per announced pool at distinct offsets, so a malformed offer is
    refused before any receive buffer is taken (allocated, registered with
    NIXL) for it. The snapshot returned has everything but its pools' bytes: its
    header (:func:`~hurray_vllm.chunks.digest.digest_header`) can be read, its pools cannot.

    Raises:
        HurrayFormatError: as :func:`assemble_offer`.
    """
    offsets, need = pool_offsets(offer.remote_sizes)  # as in a slab: a pool's alignment decides how it is viewed
    room = torch.empty(need, dtype=torch.uint8, device="meta")
    return _assemble(offer, [room[o : o + n] for o, n in zip(offsets, offer.remote_sizes)])[0]


def pool_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where pools of ``sizes`` bytes lie in a receive buffer (each on a 4 KiB boundary), and the bytes they take."""
    offsets, need = [], 0
    for n in sizes:
        offsets.append(need)
        need += -(-n // POOL_ALIGN) * POOL_ALIGN
    return offsets, need


def parse_offer(body: bytearray, max_remote_bytes: int, charge: Callable[[int], None] | None = None) -> Offer:
    """Decode and validate an offer; every size is checked before anything is allocated.

    ``charge``, when given, is called with the memory the decoded records may hold
    (:data:`RECORD_MEMORY_BYTES` per record, from the record count) before any
    record is decoded, and again with the bytes of the inline buffers it copies
    before it copies them; it refuses the offer by raising.

    ``max_remote_bytes`` (the receiver's ``max_chunk_bytes``) bounds the page pools
    as a receive buffer takes them: each rounded up to :data:`POOL_ALIGN`
    (:func:`pool_offsets`), not the bytes they announce.

    An inline buffer is a view of ``body`` (which it keeps alive) where it
    starts on an :data:`INLINE_ALIGN` boundary and ``body`` is writable;
    others are copied.
    """
    c = _Cursor(body)
    try:
        ns = bytes(c.take(c.u16("namespace"), "namespace")).decode()
        key = bytes(c.take(c.u16("key"), "key")).decode()
    except UnicodeDecodeError:
        raise HurrayFormatError("transport", "namespace and key must be 1-64 lowercase hex digits") from None
    check_names(ns, key)
    n = c.u32("record count")
    if not 0 < n <= MAX_RECORDS:
        raise HurrayFormatError("transport.offer", f"{n} records is not a plausible chunk")
    if charge is not None:
        charge(n * RECORD_MEMORY_BYTES)
    descs: list[TensorDescriptor] = []
    buffers: list[list[torch.Tensor | int]] = []
    remote_sizes: list[int] = []
    remote_total = 0
    # Inline buffers are made once every size is checked: (their record's buffers, index there, offset, size).
    inline: list[tuple[list[torch.Tensor | int], int, int, int]] = []
    # A read-only body (bytes) is not viewed: torch would warn that its tensors could write to it.
    viewable = bool(len(body)) and not memoryview(body).readonly
    base = torch.frombuffer(body, dtype=torch.uint8).data_ptr() if viewable else 0

    def aligned(at: int) -> bool:
        return viewable and (base + at) % INLINE_ALIGN == 0

    copied = 0  # the bytes of the inline buffers copied out of the body
    for i in range(n):
        length = c.u32(f"descriptor {i} length")
        raw = c.take(length, f"descriptor {i}")
        if len(raw) < 10 or _peek_len(raw) != length:
            raise HurrayFormatError("descriptor_length", f"descriptor {i}: framed length {length} does not match")
        desc = decode_checked(raw, f"descriptor {i}")
        if len(desc.buffers) > MAX_RECORD_BUFFERS:
            raise HurrayFormatError(
                "buffer_count",
                f"descriptor {i}: {len(desc.buffers)} buffers; a chunk's records have at most {MAX_RECORD_BUFFERS}",
            )
        bufs: list[torch.Tensor | int] = []
        for j, b in enumerate(desc.buffers):
            mode = c.u8(f"descriptor {i} buffer {j} mode")
            if mode == _INLINE:
                at = c.pos
                c.take(b.byte_size, f"descriptor {i} buffer {j}")
                if b.byte_size:
                    inline.append((bufs, len(bufs), at, b.byte_size))
                    copied += 0 if aligned(at) else b.byte_size
                    bufs.append(_PENDING)  # replaced below
                else:
                    bufs.append(torch.empty(0, dtype=torch.uint8))
            elif mode == _REMOTE:
                # Only page pools travel by NIXL: everything the validation reads is inline.
                if desc.layout_tag != LAYOUT_BLOCK_PAGED or j != 0 or b.byte_size == 0:
                    raise HurrayFormatError("transport.offer", f"descriptor {i} buffer {j} cannot be sent by NIXL")
                # Counted as a receive buffer takes it (pool_offsets): 16,000 pools of 2 bytes would
                # otherwise pass a 64 KiB limit and have some 64 MB allocated and registered for them.
                remote_total += -(-b.byte_size // POOL_ALIGN) * POOL_ALIGN
                if remote_total > max_remote_bytes:
                    raise HurrayFormatError(
                        "transport",
                        f"chunk of at least {remote_total} bytes of page pools (each rounded up to {POOL_ALIGN} bytes, "
                        f"as received) exceeds the limit of {max_remote_bytes} bytes per chunk (max_chunk_bytes; "
                        "hurray-vllm receive --max-chunk): raise it on the receiver, or save smaller chunks "
                        "(hurray_chunk_tokens)",
                    )
                bufs.append(len(remote_sizes))
                remote_sizes.append(b.byte_size)
            else:
                raise HurrayFormatError("transport.offer", f"descriptor {i} buffer {j}: unknown mode {mode}")
        descs.append(desc)
        buffers.append(bufs)
    if c.pos != len(body):
        raise HurrayFormatError("transport.offer", f"{len(body) - c.pos} stray bytes after the last record")
    if charge is not None and copied:
        charge(copied)  # the body stays held as long as the views of it: only the copies are more memory
    while inline:  # each entry let go as its tensor is made: they are not held together
        bufs, j, at, size = inline.pop()
        if aligned(at):
            bufs[j] = torch.frombuffer(body, dtype=torch.uint8, count=size, offset=at)
        else:  # a view off the boundary would be one of a wider type too, once its record views it so
            copy = torch.empty(size, dtype=torch.uint8)
            copy.numpy()[:] = memoryview(body)[at : at + size]
            bufs[j] = copy
    return Offer(ns, key, descs, buffers, remote_sizes)


# ── sender ─────────────────────────────────────────────────────────────────────
