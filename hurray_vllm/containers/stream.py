"""The Hurray streaming format: each descriptor followed by its buffers.

There is no framing beyond the descriptors themselves (``interchange.md``):
a reader learns each buffer's size from the descriptor it just read, which is
why every descriptor is validated *before* its buffers are read or any
memory is reserved for them.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import BinaryIO

import torch

from ..errors import HurrayArgumentError, HurrayFormatError
from ..kv.paged import BlockPagedTensor
from ..wire.descriptor import (
    LAYER_INDEX_NONE,
    encode_descriptor,
    layer_index_offset,
    peek_descriptor_length,
)
from ..wire.rules import decode_checked
from .schema import MAX_BUFFERS, MAX_RECORDS, Record, dense_record, layer_records

__all__ = ["write_records", "read_records", "tensor_bytes", "read_into", "byte_view", "check_buffers"]

#: Below this a buffer of a non-seekable stream is allocated whole; above it,
#: memory grows (doubling) with the bytes actually received, so a lying
#: descriptor on a socket makes the reader reserve at most this much, or
#: twice what arrived (three times while one step's copy runs). Small: the
#: reserve is per connection, before a byte of the buffer has arrived; a
#: 64 MiB pool costs four copies of at most 32 MiB on the way.
_GROW_FROM = 4 << 20


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` as a memoryview over its own memory (no copy on CPU)."""
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return byte_view(flat)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 CPU tensor's own memory."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray exports the buffer protocol


def check_buffers(rec: Record, label: str) -> None:
    """Raise :class:`HurrayArgumentError` unless ``rec``'s buffers are those its descriptor declares, in bytes.

    A writer's check of what its caller handed it, before any of the record is written: a buffer
    of another size would desynchronise a stream (every later record read from the wrong bytes)
    and make a file no reader accepts. ``label``: the record's name in the error (``"layers.0.key"``,
    ``"record 3"``); a buffer is ``"<label> buffer <i>"``. One size per buffer: no data is read.
    """
    declared = rec.descriptor.buffers
    if len(rec.buffers) != len(declared):
        raise HurrayArgumentError(label, f"holds {len(rec.buffers)} buffers, its descriptor declares {len(declared)}")
    for i, (t, b) in enumerate(zip(rec.buffers, declared)):
        n = t.numel() * t.element_size()
        if n != b.byte_size:
            raise HurrayArgumentError(f"{label} buffer {i}", f"holds {n} bytes, its descriptor declares {b.byte_size}")


def _write_all(f: BinaryIO, data: bytes | bytearray | memoryview) -> int:
    """Write all of ``data`` to ``f``, however few bytes each ``f.write`` takes; returns its size in bytes.

    A buffered file (``open(path, "wb")``) takes all in one call. A raw one
    (``open(path, "wb", buffering=0)``, ``socket.makefile("wb", buffering=0)``,
    any :class:`io.RawIOBase`) may take fewer and say so in its return
    (Linux's ``write()`` takes at most 0x7ffff000 bytes: a page pool over
    2 GiB always goes short): the rest is written again, as a view (no copy).

    Raises:
        BlockingIOError: ``f`` (an :class:`io.IOBase`) is non-blocking and took nothing (its ``write``
            returned None; a sink that is no ``io`` object and returns no count took it all);
            ``characters_written``: the bytes of ``data`` it took before.
        OSError: ``f.write`` returned a count that is not the bytes it could have taken (0, or more
            than were left), or failed.
    """
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    n = f.write(data)
    if n == size:  # the common case: one call
        return size
    if not isinstance(n, int) and not isinstance(f, io.IOBase):
        # A sink of its own making (a ``write`` that keeps what it is given and returns nothing) took it all:
        # only the io classes promise a count, and only a raw one's None means "would block".
        return size
    view = memoryview(data).cast("B")
    done = 0
    while True:
        if n is None:
            raise BlockingIOError(
                errno.EAGAIN,
                f"the sink would block: it took {done} of {size} bytes, then none (write() returned None); "
                "write to a blocking file, or through a buffered one",
                done,
            )
        if not isinstance(n, int) or not 0 < n <= size - done:
            # 0 would loop for ever; more than was left is no count of these bytes.
            raise OSError(f"the sink's write() returned {n!r} for {size - done} bytes (of {size}): a broken sink")
        done += n
        if done == size:
            return size
        n = f.write(view[done:])


def write_records(records: Iterable[Record], f: BinaryIO) -> int:
    """Write ``records`` to ``f`` as a Hurray stream; returns the bytes written.

    Raises:
        HurrayArgumentError: a record's buffers are not those its descriptor declares (their count or
            a buffer's size, :func:`check_buffers`), before any byte of that record is written.
        OSError: as :func:`_write_all` (a non-blocking sink that would block, a failed write).
    """
    total = 0
    for index, rec in enumerate(records):
        check_buffers(rec, rec.name or f"record {index}")
        total += _write_all(f, encode_descriptor(rec.descriptor))
        for t in rec.buffers:
            total += _write_all(f, tensor_bytes(t))
    return total


def _remaining(f: BinaryIO) -> int | None:
    """Bytes left in ``f`` when its size is known, else ``None`` (buffers then grow as their bytes arrive).

    Known for bytes in memory (:class:`io.BytesIO`) and for a regular file read as it is
    (:class:`io.FileIO`, or a buffered reader over one). Not for any other object with a
    ``fileno()``: a ``gzip.open(...)``, a tar member or a file opened at an offset has one, but
    its descriptor's size is not the size of the stream it reads (a gzip file's is its compressed
    size, and a valid stream was refused as data cut short).
    """
    try:
        if isinstance(f, io.BytesIO):
            return len(f.getbuffer()) - f.tell()
        raw = f.raw if isinstance(f, io.BufferedReader | io.BufferedRandom) else f
        if not isinstance(raw, io.FileIO) or not f.seekable():
            return None
        st = os.fstat(raw.fileno())
        return st.st_size - f.tell() if stat.S_ISREG(st.st_mode) else None
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        return None


def read_into(f: BinaryIO, mv: memoryview, what: str) -> None:
    """Fill ``mv`` from ``f`` exactly; a short read is a truncation error."""
    got = 0
    n = mv.nbytes
    readinto = getattr(f, "readinto", None)
    while got < n:
        if readinto is not None:
            k = readinto(mv[got:])
        else:
            chunk = f.read(n - got)
            k = len(chunk) if chunk else 0
            mv[got : got + k] = chunk
        if not k:
            raise HurrayFormatError(what, f"stream ends after {got} of {n} bytes")
        got += k


def _read_buffer(f: BinaryIO, size: int, remaining: int | None, what: str) -> torch.Tensor:
    if remaining is not None and size > remaining:
        raise HurrayFormatError(what, f"declares {size} bytes but only {remaining} remain in the input")
    if remaining is not None or size <= _GROW_FROM:
        out = torch.empty(size, dtype=torch.uint8)
        if size:
            read_into(f, byte_view(out), what)
        return out
    buf = torch.empty(_GROW_FROM, dtype=torch.uint8)
    filled = 0
    while filled < size:
        if filled == buf.numel():
            bigger = torch.empty(min(size, 2 * buf.numel()), dtype=torch.uint8)
            bigger[:filled].copy_(buf)
            buf = bigger
        end = buf.numel()
        read_into(f, byte_view(buf)[filled:end], what)
        filled = end
    return buf


def _read_upto(f: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes, fewer only at end of input (raw sockets return short reads)."""
    parts = []
    got = 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_records(f: BinaryIO, *, permissive: bool = False, limit: int | None = None) -> Iterator[Record]:
    """Yield each record of the stream ``f``; buffers come back as uint8 tensors.

    Every descriptor is validated before its buffers are read. A stream that
    ends between records ends cleanly; one that ends inside a record raises
    :class:`HurrayFormatError`, and so does one of more than
    :data:`~.schema.MAX_RECORDS` records or :data:`~.schema.MAX_BUFFERS`
    buffers. ``limit``: the bytes ``f`` holds where the caller knows it and
    ``f`` cannot tell (a transport frame's length): a buffer declared past it
    is refused before anything is allocated for it.
    """
    index = 0
    buffer_count = 0
    left = limit
    while True:
        head = _read_upto(f, 10)
        if not head:
            return
        if index >= MAX_RECORDS:
            raise HurrayFormatError("stream", f"more than {MAX_RECORDS} records in one stream")
        if len(head) < 10:
            raise HurrayFormatError("descriptor_length", f"stream ends inside descriptor {index} header")
        length = peek_descriptor_length(head)
        if left is not None and length > left:
            # As the buffers below: what the frame cannot hold is refused before it is read (up to 1 MiB here).
            raise HurrayFormatError(
                "descriptor_length",
                f"descriptor {index} declares {length} bytes but only {max(left, 0)} remain in the frame",
            )
        rest = _read_upto(f, length - 10)
        if len(rest) != length - 10:
            raise HurrayFormatError("descriptor_length", f"stream ends inside descriptor {index}")
        desc = decode_checked(head + rest, f"descriptor {index}", permissive=permissive)
        buffer_count += len(desc.buffers)
        if buffer_count > MAX_BUFFERS:
            # Before its buffers: each costs a tensor (~0.5 KB) for 16 bytes of descriptor, empty or not.
            raise HurrayFormatError(
                "buffer_count", f"descriptor {index} brings the stream past {MAX_BUFFERS} buffers in all"
            )
        remaining = _remaining(f)
        if left is not None:
            left -= length
        buffers = []
        for i, b in enumerate(desc.buffers):
            if left is not None:
                if b.byte_size > left:
                    raise HurrayFormatError(
                        f"descriptor {index} buffer {i}",
                        f"declares {b.byte_size} bytes but only {max(left, 0)} remain in the frame",
                    )
                left -= b.byte_size
            buffers.append(_read_buffer(f, b.byte_size, remaining, f"descriptor {index} buffer {i}"))
            if remaining is not None:
                remaining -= b.byte_size
        yield Record("", desc, buffers)
        index += 1


class Same:
    """An object compared by identity (tensors compare elementwise), kept alive by whoever holds this."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def layer_structure_key(
    members: Sequence[BlockPagedTensor], kv_scales: tuple[float, float] | None
) -> tuple[object, ...] | None:
    """What a layer's group encodes besides its pools, layer index and kv scales.

    Two layers with the same key encode to the same group head, index buffers
    and ``seq_lens`` record, and to block-paged descriptors that differ only
    in their layer index. The index tensors enter the key by identity
    (:class:`Same`), and the key keeps them alive, so it can never compare
    equal to the key of other tensors that reuse their ids. None for
    quantized pools, whose buffers are per layer.
    """
    if any(t.quant_buffers or t.quantization is not None for t in members):
        return None
    return (
        *(Same(x) for t in members for x in (t.block_table, t.seq_ptr, t.seq_lens)),
        *((tuple(t.page_pool.shape), t.dtype, t.index_type, t.kv_role) for t in members),
        kv_scales is None,
    )


class LayerWriter:
    """Writes ``layers.{i}`` groups whose layers share one block structure, encoding it once.

    A streaming export's layers differ only in their pools and layer index:
    the group head, the index buffers and the ``seq_lens`` record are the
    same bytes every time. This writer encodes them for the first layer and
    reuses them while the next layers hold the same index tensors, pool
    shape and dtype; the two block-paged descriptors are encoded once too,
    and each layer patches its layer index into them. The bytes are exactly those of
    ``write_records(layer_records(...))``. It keeps references to the index
    tensors it encoded, so their ids stay valid while it lives.

    Descriptors reach ``f`` as immutable ``bytes``; pools and index buffers,
    as with :func:`write_records`, as memoryviews over the tensors' own
    memory: a sink that keeps them rather than copying sees whatever the
    caller later writes into that memory (a reused export buffer).
    """

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._held: tuple[object, ...] = ()
        self._head = b""
        self._descs: tuple[tuple[bytearray, int], ...] = ()
        self._index: tuple[list[memoryview], ...] = ()
        self._lens = b""

    def write(
        self,
        f: BinaryIO,
        i: int,
        members: Sequence[BlockPagedTensor],
        kv_scales: tuple[float, float] | None = None,
    ) -> int:
        """Write layer ``i``'s group (``members``: ``(key, value)`` or ``(fused,)``) to ``f``; returns the bytes."""
        key = layer_structure_key(members, kv_scales)
        if key is None:
            # Per call: an id-keyed cache is only sound while its tensors live, and nothing holds these.
            return write_records(layer_records(i, members, kv_scales, {}), f)
        if key != self._key:
            self._encode_fixed(i, members, kv_scales, key)
        total = _write_all(f, self._head)
        for t, (raw, at), index in zip(members, self._descs, self._index, strict=True):
            struct.pack_into("<I", raw, at, LAYER_INDEX_NONE if t.layer_index is None else t.layer_index)
            # An immutable copy (a descriptor's few hundred bytes): the next layer patches ``raw`` again, and a
            # sink that keeps what it was given (a list of chunks, a queue) must not see earlier layers change.
            total += _write_all(f, bytes(raw))
            total += _write_all(f, tensor_bytes(t.page_pool))
            for mv in index:
                total += _write_all(f, mv)
        total += _write_all(f, self._lens)
        if kv_scales is not None:
            scales = torch.tensor(kv_scales, dtype=torch.float32)
            total += write_records([dense_record(f"layers.{i}.kv_scales", scales)], f)
        return total

    def _encode_fixed(
        self,
        i: int,
        members: Sequence[BlockPagedTensor],
        kv_scales: tuple[float, float] | None,
        key: tuple[object, ...],
    ) -> None:
        # A fresh narrowing cache: ids from an earlier structure may belong to new tensors by now.
        head, *recs = list(layer_records(i, members, kv_scales, {}))
        tensors, lens = recs[: len(members)], recs[len(members)]
        self._head = encode_descriptor(head.descriptor)
        # Encoded once; each layer patches its index in (the only field that differs).
        self._descs = tuple(
            (bytearray(encode_descriptor(r.descriptor)), layer_index_offset(r.descriptor)) for r in tensors
        )
        self._index = tuple([tensor_bytes(b) for b in r.buffers[1:]] for r in tensors)
        self._lens = encode_descriptor(lens.descriptor) + bytes(tensor_bytes(lens.buffers[0]))
        self._held = tuple(x for t in members for x in (t.block_table, t.seq_ptr, t.seq_lens))
        self._held += tuple(b for r in tensors for b in r.buffers[1:])
        self._key = key
