"""The ``.hrry`` random-access file container (``file-format.md``).

Layout: 64-byte header, then per tensor a descriptor (8-byte aligned) and
its buffers (each ``data_buffer_alignment``-aligned), then an optional KV
metadata section, the index (names, offsets, CRC-32C) and a 40-byte trailer.

Writes are single-pass and land atomically (a temporary file renamed over the
target), so a reader never sees half a file. Reads check every offset and
size against the file's real length before allocating or mapping anything.
"""

from __future__ import annotations

import errno
import itertools
import mmap as _mmap
import os
import stat
import struct
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .. import native
from ..errors import HurrayArgumentError, HurrayFormatError
from ..wire.crc32c import crc32c
from ..wire.descriptor import (
    LAYOUT_COMPOSITE,
    MAX_DESCRIPTOR_LEN,
    TensorDescriptor,
    encode_descriptor,
    peek_descriptor_length,
)
from ..wire.rules import decode_checked
from .atomic import atomic_file
from .schema import MAX_BUFFERS, MAX_RECORDS, Record
from .stream import byte_view, check_buffers, read_into, tensor_bytes

__all__ = ["FILE_MAGIC", "write_file", "file_size", "HrryFile", "IndexEntry"]

FILE_MAGIC = b"HRRYFILE"
TRAILER_MAGIC = b"HRRY"
HEADER_LEN = 64
TRAILER_LEN = 40
FLAG_HAS_KV = 1 << 0
FLAG_SORTED_INDEX = 1 << 1
FLAG_HAS_CRC = 1 << 2
DEFAULT_ALIGNMENT = 4096
_MMAP_MIN = 64 << 10
#: Indexes up to this size are remembered (a chunk file's is ~2 KiB), at most :data:`_MEMO_HELD_BYTES` of them.
_MEMO_INDEX_BYTES = 64 << 10
#: What the remembered indexes may hold in all: their bytes, and per row :data:`_ROW_BYTES` and its name.
_MEMO_HELD_BYTES = 4 << 20
#: The memory an index row holds besides its name's string (the :class:`IndexEntry`, its attributes and
#: ints: ~220 bytes measured with tracemalloc, rounded up).
_ROW_BYTES = 320
_KV_STR, _KV_I64, _KV_U64, _KV_F64, _KV_BOOL, _KV_BYTES, _KV_ARRAY = range(1, 8)


def _pad(n: int, align: int) -> int:
    return (-n) % align


@dataclass(frozen=True)
class IndexEntry:
    """One index row: where a named tensor's descriptor and data lie."""

    name: str
    descriptor_offset: int
    descriptor_length: int
    data_offset: int
    data_length: int
    flags: int = 0


# ── KV metadata ─────────────────────────────────────────────────────────────


def _kv_value(v: Any, field: str, item: int | None = None) -> bytes:
    """``v`` encoded as a KV value; :class:`HurrayArgumentError` (``field``) for what no reader would read back.

    ``item``: ``v``'s position in the array being encoded (an array holds scalars only: a reader refuses
    a nested one, so the file would open nowhere).
    """
    where = "" if item is None else f"item {item}: "
    if isinstance(v, bool):
        return struct.pack("<BB", _KV_BOOL, int(v))
    if isinstance(v, int):
        if -(1 << 63) <= v < 1 << 63:
            return struct.pack("<Bq", _KV_I64, v)
        if 0 <= v < 1 << 64:
            return struct.pack("<BQ", _KV_U64, v)
        raise HurrayArgumentError(field, f"{where}{v} fits neither int64 nor uint64")
    if isinstance(v, float):
        return struct.pack("<Bd", _KV_F64, v)
    if isinstance(v, str | bytes | bytearray):
        try:
            b = v.encode() if isinstance(v, str) else bytes(v)
        except UnicodeEncodeError as exc:  # a lone surrogate: no UTF-8 for it
            raise HurrayArgumentError(field, f"{where}a string with no UTF-8 form ({exc.reason})") from None
        if len(b) > 0xFFFFFFFF:
            raise HurrayArgumentError(field, f"{where}{len(b)} bytes, more than a KV value holds (2**32 - 1)")
        return struct.pack("<BI", _KV_STR if isinstance(v, str) else _KV_BYTES, len(b)) + b
    if isinstance(v, list):
        if item is not None:
            raise HurrayArgumentError(field, f"{where}a KV array holds scalars, not arrays")
        items = [_kv_value(x, field, i) for i, x in enumerate(v)]
        tags = {i[0] for i in items}
        if len(tags) > 1:
            raise HurrayArgumentError(
                field, "a KV array must hold one value type (int64 and uint64 count as two, as do int and bool)"
            )
        if len(items) > 0xFFFFFFFF:
            raise HurrayArgumentError(field, f"{len(items)} items, more than a KV array holds (2**32 - 1)")
        tag = tags.pop() if tags else _KV_I64
        return struct.pack("<BBI", _KV_ARRAY, tag, len(items)) + b"".join(i[1:] for i in items)
    raise HurrayArgumentError(
        field, f"{where}unsupported KV value type {type(v).__name__} (str, int, float, bool, bytes or a list of one)"
    )


def encode_kv(kv: dict[str, Any]) -> bytes:
    """A ``.hrry`` file's KV section for ``kv``.

    Raises:
        HurrayArgumentError: ``kv`` is not a dict, a key is not a string of 1..65535 UTF-8 bytes
            (field ``kv``), or a value cannot be written (field ``kv.<key>``).
    """
    if not isinstance(kv, dict):
        raise HurrayArgumentError("kv", f"expected a dict of str keys, not {type(kv).__name__}")
    parts = [struct.pack("<I", len(kv))]
    for k, v in kv.items():
        if not isinstance(k, str):
            raise HurrayArgumentError("kv", f"key {k!r} is not a string")
        try:
            kb = k.encode()
        except UnicodeEncodeError as exc:
            raise HurrayArgumentError("kv", f"key {k!r} has no UTF-8 form ({exc.reason})") from None
        if not 1 <= len(kb) <= 0xFFFF:
            raise HurrayArgumentError("kv", f"key {k!r} must be 1..65535 bytes")
        parts.append(struct.pack("<H", len(kb)) + kb + _kv_value(v, f"kv.{k}"))
    return b"".join(parts)


def _kv_scalar(tag: int, buf: bytes, pos: int) -> tuple[Any, int]:
    def need(n: int) -> None:
        if pos + n > len(buf):
            raise HurrayFormatError("kv", "KV section truncated")

    if tag == _KV_STR or tag == _KV_BYTES:
        need(4)
        (n,) = struct.unpack_from("<I", buf, pos)
        need(4 + n)
        raw = buf[pos + 4 : pos + 4 + n]
        if tag == _KV_BYTES:
            return raw, pos + 4 + n
        try:
            return raw.decode("utf-8"), pos + 4 + n
        except UnicodeDecodeError:
            raise HurrayFormatError("kv", "KV string is not UTF-8") from None
    if tag in (_KV_I64, _KV_U64, _KV_F64):
        need(8)
        fmt = {_KV_I64: "<q", _KV_U64: "<Q", _KV_F64: "<d"}[tag]
        return struct.unpack_from(fmt, buf, pos)[0], pos + 8
    if tag == _KV_BOOL:
        need(1)
        if buf[pos] > 1:
            raise HurrayFormatError("kv", f"bool value 0x{buf[pos]:02X} is neither 0 nor 1")
        return bool(buf[pos]), pos + 1
    raise HurrayFormatError("kv", f"KV value tag 0x{tag:02X} is reserved or unsupported")


def decode_kv(buf: bytes) -> dict[str, Any]:
    if len(buf) < 4:
        raise HurrayFormatError("kv", "KV section shorter than its count")
    (count,) = struct.unpack_from("<I", buf, 0)
    pos = 4
    out: dict[str, Any] = {}
    for _ in range(count):
        if pos + 2 > len(buf):
            raise HurrayFormatError("kv", "KV section truncated")
        (klen,) = struct.unpack_from("<H", buf, pos)
        if klen == 0 or pos + 2 + klen + 1 > len(buf):
            raise HurrayFormatError("kv", "KV key empty or truncated")
        try:
            key = buf[pos + 2 : pos + 2 + klen].decode("utf-8")
        except UnicodeDecodeError:
            raise HurrayFormatError("kv", "KV key is not UTF-8") from None
        if key in out:
            raise HurrayFormatError("kv", f"duplicate KV key {key!r}")
        pos += 2 + klen
        tag = buf[pos]
        pos += 1
        if tag == _KV_ARRAY:
            if pos + 5 > len(buf):
                raise HurrayFormatError("kv", "KV array truncated")
            etag, n = struct.unpack_from("<BI", buf, pos)
            pos += 5
            if not 1 <= etag <= 6:
                raise HurrayFormatError("kv", f"KV array element tag 0x{etag:02X} invalid")
            if n > len(buf) - pos:
                raise HurrayFormatError("kv", "KV array longer than its section")
            items = []
            for _ in range(n):
                v, pos = _kv_scalar(etag, buf, pos)
                items.append(v)
            out[key] = items
        else:
            out[key], pos = _kv_scalar(tag, buf, pos)
    return out


# ── writing ─────────────────────────────────────────────────────────────────


class _Counter:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.pos = 0

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.pos += memoryview(data).nbytes

    def pad_to(self, align: int) -> None:
        n = _pad(self.pos, align)
        if n:
            self.write(bytes(n))


def write_file(
    records: Iterable[Record],
    path: str | os.PathLike[str],
    *,
    kv: dict[str, Any] | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
    fsync: bool = True,
    follow_symlinks: bool = True,
    replace: bool = True,
) -> int:
    """Write ``records`` to a ``.hrry`` file at ``path``; returns its size.

    The file appears at ``path`` only once complete (temp file + rename).
    ``fsync=False`` skips forcing the data to disk before the rename: for
    caches whose readers verify a checksum anyway, where durability across
    a power loss is not worth a disk flush per file. ``follow_symlinks`` and
    ``replace`` (``False``: land only where no file is, else
    ``FileExistsError``): see :func:`~hurray_vllm.containers.atomic.atomic_file`.

    Raises:
        HurrayArgumentError: an argument the file cannot hold, before anything is written: ``alignment``
            (a power of two in [4096, 2 MiB]), ``kv`` (:func:`encode_kv`), a record without a name or
            with another's (``name``), a record whose buffers are not those its descriptor declares
            (:func:`~.stream.check_buffers`).
    """
    _check_alignment(alignment)
    with atomic_file(path, fsync=fsync, follow_symlinks=follow_symlinks, replace=replace) as raw:
        size = _write(records, raw, kv, alignment)
    return size


class _Discard:
    def write(self, data: bytes | memoryview) -> None:
        pass


def file_size(
    records: Iterable[Record], *, kv: dict[str, Any] | None = None, alignment: int = DEFAULT_ALIGNMENT
) -> int:
    """The size :func:`write_file` gives ``records``, laid out as it would but written nowhere.

    For a receiver's disk quota: each buffer starts on an ``alignment``
    boundary, so a chunk of many small buffers takes far more room as a
    file than as a stream.
    """
    return _write(records, _Discard(), kv, alignment)  # type: ignore[arg-type]  # only .write is used


def _check_alignment(alignment: int) -> None:
    if (
        not isinstance(alignment, int)
        or isinstance(alignment, bool)
        or not 4096 <= alignment <= 2 << 20
        or alignment & (alignment - 1)
    ):
        raise HurrayArgumentError("alignment", f"{alignment!r} is not a power of two in [4096, 2 MiB]")


def _write(records: Iterable[Record], raw: BinaryIO, kv: dict[str, Any] | None, alignment: int) -> int:
    _check_alignment(alignment)
    # Before the first record is taken from ``records`` (it may be a generator that cannot be read twice).
    kv_bytes = b"" if kv is None or kv == {} else encode_kv(kv)
    out = _Counter(raw)
    flags = FLAG_HAS_CRC | (FLAG_HAS_KV if kv_bytes else 0)
    out.write(
        b"HRRYFILE"
        + struct.pack("<BBHIIQQ", 1, 0, 0, flags, alignment, HEADER_LEN, 0xFFFFFFFFFFFFFFFF)[:28]
        + bytes(28)
    )
    entries: list[IndexEntry] = []
    seen: set[str] = set()
    for rec in records:
        if not rec.name:
            raise HurrayArgumentError("name", "every tensor in a .hrry file needs a name")
        if rec.name in seen:
            raise HurrayArgumentError("name", f"duplicate tensor name {rec.name!r}")
        seen.add(rec.name)
        check_buffers(rec, rec.name)
        out.pad_to(8)
        desc_off = out.pos
        raw_desc = encode_descriptor(rec.descriptor)
        out.write(raw_desc)
        # A composite head has no buffers: the spec forbids aligning after it.
        if rec.descriptor.layout_tag == LAYOUT_COMPOSITE and not rec.descriptor.buffers:
            entries.append(IndexEntry(rec.name, desc_off, len(raw_desc), out.pos, 0))
            continue
        out.pad_to(alignment)
        data_off = out.pos
        for i, t in enumerate(rec.buffers):
            if i:
                out.pad_to(alignment)
            out.write(tensor_bytes(t))
        entries.append(IndexEntry(rec.name, desc_off, len(raw_desc), data_off, out.pos - data_off))
    kv_off = kv_len = 0
    if kv_bytes:
        out.pad_to(8)
        kv_off, kv_len = out.pos, len(kv_bytes)
        out.write(kv_bytes)
    out.pad_to(8)
    index = [struct.pack("<Q", len(entries))]
    for e in entries:
        nb = e.name.encode()
        index.append(
            struct.pack("<H", len(nb))
            + nb
            + struct.pack("<QIQQI", e.descriptor_offset, e.descriptor_length, e.data_offset, e.data_length, 0)
        )
    index_bytes = b"".join(index)
    index_off = out.pos
    out.write(index_bytes)
    out.write(
        struct.pack("<QQQII", index_off, len(index_bytes), kv_off, kv_len, crc32c(index_bytes))
        + bytes(4)
        + TRAILER_MAGIC
    )
    return out.pos


# ── reading ─────────────────────────────────────────────────────────────────


#: Index rows by value, so that equal rows of two indexes are one object (see :func:`_interned`).
_ENTRIES: dict[IndexEntry, IndexEntry] = {}
_ENTRIES_MAX = 8192
#: Rows with longer names are not interned (a chunk file's are ``layers.<i>.key`` and the like).
_INTERNED_NAME_MAX = 256
_entries_lock = threading.Lock()


def _interned(entry: IndexEntry) -> IndexEntry:
    """The one object of ``entry``'s value.

    Chunk files whose indexes differ in one row (a longer metadata record) then share the other
    rows, and comparing lists of them costs a pointer test per row (:mod:`.template` compares a
    file's rows with those of a file parsed before). A row with a long name (up to 64 KiB) is left
    as it is: the table holds at most :data:`_ENTRIES_MAX` rows, which must not amount to much memory.
    """
    if len(entry.name) > _INTERNED_NAME_MAX:
        return entry
    with _entries_lock:
        got = _ENTRIES.get(entry)
        if got is None:
            if len(_ENTRIES) >= _ENTRIES_MAX:
                _ENTRIES.clear()
            got = _ENTRIES[entry] = entry
        return got


class _IndexMemo:
    """Parsed indexes by their bytes (files of one shape share them), bounded by the memory they hold.

    A count of entries would not bound it: an index of 64 KiB may hold 1,800 rows of two-byte
    names, ~0.4 MB of objects, and 256 of them (parsed from crafted files that fail after their
    index parsed, so it stays remembered) pinned ~120 MB. Each entry costs its bytes, plus
    :data:`_ROW_BYTES` and its name's string per row (:func:`row_bytes`); the least recently used go
    once the total passes :data:`_MEMO_HELD_BYTES`.
    """

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[bytes, int, int, int], tuple[tuple[IndexEntry, ...], int]] = OrderedDict()
        self.cost = 0
        self._lock = threading.Lock()

    def entries(self, index: bytes, index_off: int, first: int, alignment: int) -> tuple[IndexEntry, ...]:
        """:func:`_index_entries` of the arguments, remembered."""
        key = (index, index_off, first, alignment)
        with self._lock:
            got = self._kept.get(key)
            if got is not None:
                self._kept.move_to_end(key)
                return got[0]
        entries = _index_entries(*key)
        cost = len(index) + sum(map(row_bytes, entries))
        with self._lock:
            if key not in self._kept and cost <= _MEMO_HELD_BYTES:
                self._kept[key] = (entries, cost)
                self.cost += cost
                while self.cost > _MEMO_HELD_BYTES:
                    self.cost -= self._kept.popitem(last=False)[1][1]
        return entries

    def clear(self) -> None:
        """Forget every index."""
        with self._lock:
            self._kept.clear()
            self.cost = 0

    def __len__(self) -> int:
        return len(self._kept)


_indexes = _IndexMemo()


def row_bytes(entry: IndexEntry) -> int:
    """The memory ``entry`` holds: :data:`_ROW_BYTES` and its name's string.

    The string's own size, not the name's length: one non-ASCII character stores every character in 2 or 4 bytes.
    """
    return _ROW_BYTES + sys.getsizeof(entry.name)


def _index_entries(index: bytes, index_off: int, first: int, alignment: int) -> tuple[IndexEntry, ...]:
    """The checked rows of an index."""
    if len(index) < 8:
        raise HurrayFormatError("file.index", "index shorter than its count")
    (count,) = struct.unpack_from("<Q", index, 0)
    if count > (len(index) - 8) // 35:
        raise HurrayFormatError("file.index", f"{count} entries cannot fit in {len(index)} index bytes")
    if count > MAX_RECORDS:
        raise HurrayFormatError("file.index", f"{count} entries (at most {MAX_RECORDS})")
    pos = 8
    entries = []
    names: set[str] = set()
    for i in range(count):
        if pos + 2 > len(index):
            raise HurrayFormatError("file.index", f"index truncated at entry {i}")
        (n,) = struct.unpack_from("<H", index, pos)
        if n == 0 or pos + 2 + n + 32 > len(index):
            raise HurrayFormatError("file.index", f"entry {i} name empty or truncated")
        try:
            name = index[pos + 2 : pos + 2 + n].decode("utf-8")
        except UnicodeDecodeError:
            raise HurrayFormatError("file.index", f"entry {i} name is not UTF-8") from None
        if name in names:
            raise HurrayFormatError("file.index", f"duplicate tensor name {name!r}")
        names.add(name)
        d_off, d_len, data_off, data_len, eflags = struct.unpack_from("<QIQQI", index, pos + 2 + n)
        pos += 2 + n + 32
        if eflags:
            raise HurrayFormatError("file.index.flags", f"entry {name!r} has reserved flags 0x{eflags:08X}")
        if d_off < first or d_off + d_len > index_off or d_off % 8:
            raise HurrayFormatError("file.index.descriptor_offset", f"entry {name!r} descriptor is out of place")
        if data_off + data_len > index_off or (data_len and data_off % alignment):
            raise HurrayFormatError("file.index.data_offset", f"entry {name!r} data is out of place")
        # Data inside the header or over its own descriptor would be read as tensor bytes (the CRC
        # can be recomputed): it must lie in the body, clear of the descriptor it belongs to.
        if data_len and (data_off < first or (data_off < d_off + d_len and d_off < data_off + data_len)):
            raise HurrayFormatError(
                "file.index.data_offset", f"entry {name!r} data overlaps the file header or its descriptor"
            )
        entries.append(_interned(IndexEntry(name, d_off, d_len, data_off, data_len)))
    if pos != len(index):
        raise HurrayFormatError("file.index", f"{len(index) - pos} stray bytes after the last entry")
    # No two regions may share bytes: a writer lays each out once, and a file whose entries point at
    # one region many times would read (and copy) it once per entry, far beyond the file's size.
    regions = sorted(
        (off, off + n, e.name)
        for e in entries
        for off, n in ((e.descriptor_offset, e.descriptor_length), (e.data_offset, e.data_length))
        if n
    )
    for (_, end, a), (start, _, b) in itertools.pairwise(regions):
        if start < end:
            raise HurrayFormatError("file.index", f"entries {a!r} and {b!r} overlap in the file")
    # Composite membership is positional in descriptor-offset order.
    entries.sort(key=lambda e: e.descriptor_offset)
    return tuple(entries)


class _Recycler:
    """Memory of whole-file reads whose last view died, kept for the next read of a similar size.

    Why: a chunk load reads files of a few MiB, hands their pools to a copy
    into the KV cache and drops them. Fresh memory of that size comes from
    the OS page by page (glibc returns a freed heap top): for a prompt of
    eight 8 MiB chunks, 16k page faults cost 30 ms, against 5 ms for the
    reads themselves. Recycled memory is resident already. A buffer comes
    back only once nothing views it (a finalizer on the array its views
    keep alive), so no two snapshots ever share memory.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: dict[int, list[torch.Tensor]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def _size_class(n: int) -> int:
        # Steps of 1/8 to 1/16 of the size: files of one model's chunks share a class, and at
        # most an eighth of a buffer is slack.
        step = 1 << max(0, n.bit_length() - 4)
        return -(-n // step) * step

    def take(self, n: int) -> torch.Tensor:
        """``n`` bytes (uint8, CPU), recycled where a buffer of the same size class is free."""
        if n < _RECYCLE_MIN:  # small: the heap serves it without page faults
            return torch.empty(n, dtype=torch.uint8)
        cls = self._size_class(n)
        with self._lock:
            free = self._free.get(cls)
            if free:
                self._bytes -= cls
                return free.pop()[:n]
        return torch.empty(cls, dtype=torch.uint8)[:n]

    def watch(self, array: Any, data: torch.Tensor) -> None:
        """Take ``data``'s memory back once ``array`` (which every view of it keeps alive) is gone."""
        if data.numel() >= _RECYCLE_MIN:
            weakref.finalize(array, self._give, data).atexit = False

    def _give(self, data: torch.Tensor) -> None:
        base = data._base if data._base is not None else data  # the whole size-class allocation
        cls = base.numel()
        with self._lock:
            if self._bytes + cls <= self.limit:
                self._free.setdefault(cls, []).append(base)
                self._bytes += cls


def _read_whole(f: BinaryIO, size: int, page_crcs: bool = False) -> tuple[memoryview, PageCrcs | None]:
    """The ``size`` bytes of open file ``f``, read in one call into memory of their own (recycled).

    Read first and parse the copy: what is checked is what is used, whatever
    happens to the file afterwards (as with a mapping, without its SIGBUS on
    truncation). ``page_crcs``: also each page's CRC-32C register, computed as
    the read goes (:attr:`FileBytes.page_crcs`), where the native kernels can;
    ``f`` must not have been read from yet (its descriptor is read directly).
    """
    data = _recycler.take(size)
    array = data.numpy()  # every view of the file's memory keeps this alive
    view = memoryview(array).cast("B")  # type: ignore[arg-type]
    _recycler.watch(array, data)
    done = native.read_crc32c_pages(f.fileno(), data) if page_crcs else None
    if done is None:
        read_into(f, view, "file")
        pages = None
    else:
        got, registers = done
        if got < size:
            raise HurrayFormatError("file", f"stream ends after {got} of {size} bytes")
        pages = PageCrcs(data.data_ptr(), size, registers) if registers is not None else None
    if f.read(1):
        raise HurrayFormatError("file", "the file grew while it was read")
    return view, pages


@dataclass(frozen=True, eq=False)
class PageCrcs:
    """The CRC-32C registers a read computed page by page, and the memory they describe.

    ``registers`` (int32, one per whole :data:`~hurray_vllm.native.CRC_PAGE`,
    each from zero) hold for the ``size`` bytes at ``address`` as they were
    read, and for no other memory: a consumer uses them only for a buffer at
    that very address and size (:func:`hurray_vllm.native.crc32c_ranges`).
    """

    address: int
    size: int
    registers: torch.Tensor


@dataclass(frozen=True, eq=False)
class FileBytes:
    """A whole file's bytes, read by :func:`read_whole`, for ``HrryFile(data=...)`` to parse.

    What lets a reader read the next file on a helper thread (the read
    releases the GIL) while it parses this one.
    """

    path: Path
    view: memoryview
    #: The CRC-32C registers of ``view``'s pages, computed while the file was read (``read_whole(page_crcs=True)``):
    #: a chunk's digest check combines them instead of reading its pools from memory again. ``None``: not computed.
    page_crcs: PageCrcs | None = None


def read_whole(
    path: str | os.PathLike[str],
    *,
    max_bytes: int | None = None,
    follow_symlinks: bool = True,
    page_crcs: bool = False,
    noatime: bool = False,
) -> FileBytes:
    """Every byte of the file at ``path``, in memory of their own (the recycled buffers ``HrryFile(whole=True)`` uses).

    ``max_bytes``: refuse a larger file before allocating anything (a sparse
    file of 100 GiB costs its reader 100 GiB of memory otherwise).
    ``follow_symlinks=False``: refuse a symbolic link at ``path`` (``OSError``
    ``ELOOP``). Only a regular file is read (:func:`open_regular`).
    ``page_crcs``: checksum each page as it is read (:attr:`FileBytes.page_crcs`),
    for a reader that checks the file's digest next. ``noatime``: see :func:`open_regular`.

    Raises:
        OSError: the file cannot be read (``FileNotFoundError`` if it is gone).
        HurrayFormatError: not a regular file (field ``file``); larger than ``max_bytes``
            (field ``file.size``); the file grew while it was read.
    """
    with open_regular(path, follow_symlinks=follow_symlinks, noatime=noatime) as f:
        size = os.fstat(f.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            raise HurrayFormatError("file.size", f"{os.fspath(path)} holds {size} bytes, more than {max_bytes} allowed")
        view, pages = _read_whole(f, size, page_crcs) if size else (memoryview(b""), None)
    return FileBytes(Path(path), view, pages)


def open_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = True, noatime: bool = False) -> BinaryIO:
    """``open(path, "rb")``, refusing anything but a regular file without blocking on it.

    Opened non-blocking (``O_NONBLOCK``, then set back to blocking): a FIFO
    swapped in at ``path`` after a caller checked it would otherwise block the
    open until a writer appears, forever. ``follow_symlinks=False`` adds
    ``O_NOFOLLOW``. ``noatime=True`` adds ``O_NOATIME`` where the system has it,
    so that the read leaves the file's access time as it was: for maintenance
    reads (``fsck``, a keyed ``prune``), which are no use of the file, while
    ``prune`` ranks chunks by their last use. Only the file's owner (or a
    process with ``CAP_FOWNER``) may ask for it: for anyone else the file is
    opened without it (the kernel refuses the flag with ``EPERM``).

    Raises:
        OSError: ``path`` cannot be opened (``ELOOP``: a symbolic link, with ``follow_symlinks=False``;
            ``IsADirectoryError``: a directory).
        HurrayFormatError: field ``file``: ``path`` is not a regular file (a pipe, socket, device).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = _open_noatime(path, flags) if noatime and hasattr(os, "O_NOATIME") else os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):  # what open() raises for one
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            raise HurrayFormatError("file", f"{os.fspath(path)} is not a regular file (a pipe, socket or device?)")
        if getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _open_noatime(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open(path, flags | O_NOATIME)``, or without ``O_NOATIME`` where the kernel refuses it (not the owner)."""
    try:
        return os.open(path, flags | os.O_NOATIME)
    except PermissionError as exc:
        if exc.errno != errno.EPERM:  # EACCES: no read permission, which a plain open would meet too
            raise
    return os.open(path, flags)


#: Whole-file buffers kept for reuse: at most this many bytes of them lie idle.
_RECYCLE_BYTES = 256 << 20
_RECYCLE_MIN = 256 << 10
_recycler = _Recycler(_RECYCLE_BYTES)


class HrryFile:
    """An open ``.hrry`` file: its index, KV metadata, and records on demand.

    With ``mmap=True`` buffers are zero-copy views of a private (copy on
    write) mapping. With ``whole=True`` the file is read into memory in one
    call and buffers are views of that memory: for a reader that takes every
    record (a chunk load), one system call instead of one per buffer, and no
    allocation per buffer (a chunk's ~40 reads and allocations cost 1.5 ms
    against 0.3 ms for the one read). Otherwise each buffer is read into a
    fresh tensor when asked for.

    Only a regular file is opened (:func:`open_regular`: a pipe is refused, not
    waited on); ``follow_symlinks=False`` also refuses a symbolic link at ``path``,
    and ``noatime=True`` leaves its access time as it was (:func:`open_regular`).

    ``max_section_bytes``: the most bytes the index, the KV section and each
    descriptor may hold, refused (``HurrayFormatError``, fields ``file.index``,
    ``file.kv``, ``<name>.descriptor``) before they are read. Without it each is
    bounded only by the file's size: a sparse file of 1 GiB (4 KiB on disk)
    whose trailer claims a 1 GiB index costs a reader 1 GiB of memory and
    seconds. For a reader that reads a few records only (a chunk's header).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mmap: bool = False,
        whole: bool = False,
        data: FileBytes | None = None,
        follow_symlinks: bool = True,
        noatime: bool = False,
        max_section_bytes: int | None = None,
    ) -> None:
        self._map: _mmap.mmap | memoryview | None = None
        self._f: BinaryIO | None = None
        self._max_section = max_section_bytes
        if data is not None:  # read whole already, maybe on another thread (read_whole)
            self.path, self._map, self.size = data.path, data.view, len(data.view)
            self._parse()
            return
        self.path = Path(path)
        self._f = open_regular(self.path, follow_symlinks=follow_symlinks, noatime=noatime)
        try:
            self.size = os.fstat(self._f.fileno()).st_size
            if whole and not mmap and self.size:
                self._map = _read_whole(self._f, self.size)[0]
            self._parse()
            if mmap and self.size:
                self._map = _mmap.mmap(self._f.fileno(), 0, access=_mmap.ACCESS_COPY)
        except BaseException:
            self._f.close()
            raise

    def close(self) -> None:
        """Close the file."""
        if self._f is not None:
            self._f.close()

    def __enter__(self) -> HrryFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_at(self, off: int, n: int, what: str, suffix: str = "") -> bytes:
        # The field is ``what + suffix``, joined only when raising: this runs for every record.
        if off < 0 or n < 0 or off + n > self.size:
            raise HurrayFormatError(what + suffix, f"{n} bytes at offset {off} lie outside the {self.size}-byte file")
        if self._map is not None:
            # From the map (or the whole file read): a seek and a read are two system calls, each of
            # which lets another thread take the GIL; inside an engine that cost ~50 us per read.
            return bytes(self._map[off : off + n])  # a mapping's slice is bytes already: no copy
        assert self._f is not None  # only a file read whole has none, and that has its map
        self._f.seek(off)
        data = self._f.read(n)
        if len(data) != n:
            raise HurrayFormatError(what + suffix, "file shrank while reading")
        return data

    def _parse(self) -> None:
        if self.size < HEADER_LEN + TRAILER_LEN:
            raise HurrayFormatError("file", f"{self.size} bytes is too short for a Hurray file")
        header = self._read_at(0, HEADER_LEN, "file.header")
        if header[:8] != FILE_MAGIC:
            raise HurrayFormatError("file.magic", f"expected b'HRRYFILE', found {header[:8]!r}")
        major, _minor, res, flags, align, first = struct.unpack_from("<BBHIIQ", header, 8)
        if major > 1:
            raise HurrayFormatError("file.container_version_major", f"version {major} is newer than 1")
        if res or any(header[36:]):
            raise HurrayFormatError("file.header.reserved", "reserved header bytes must be zero")
        if flags & ~0x7:
            raise HurrayFormatError("file.flags", f"reserved file flag bits set: 0x{flags:08X}")
        if align < 4096 or align > (2 << 20) or align & (align - 1):
            raise HurrayFormatError("file.data_buffer_alignment", f"{align} is not a power of two in [4096, 2 MiB]")
        if first < HEADER_LEN or first % 8:
            raise HurrayFormatError("file.first_descriptor_offset", f"{first} must be >= 64 and 8-byte aligned")
        self.flags, self.alignment, self.first_descriptor_offset = flags, align, first
        trailer = self._read_at(self.size - TRAILER_LEN, TRAILER_LEN, "file.trailer")
        if trailer[36:40] != TRAILER_MAGIC:
            raise HurrayFormatError("file.trailer_magic", "trailer magic is not b'HRRY' (truncated file?)")
        index_off, index_len, kv_off, kv_len, crc = struct.unpack_from("<QQQII", trailer)
        if any(trailer[32:36]):
            raise HurrayFormatError("file.trailer.reserved", "reserved trailer bytes must be zero")
        body_end = self.size - TRAILER_LEN
        if index_off < first or index_off + index_len > body_end:
            raise HurrayFormatError("file.index_offset", f"index [{index_off}, +{index_len}) is outside the file body")
        self._check_section(index_len, "file.index")
        index = self._read_at(index_off, index_len, "file.index")
        if flags & FLAG_HAS_CRC:
            if crc32c(index) != crc:
                raise HurrayFormatError("file.index_crc32c", "index CRC-32C mismatch: the file is corrupt")
        elif crc:
            raise HurrayFormatError("file.index_crc32c", "CRC present but HAS_INDEX_CRC32C is not set")
        self.kv: dict[str, Any] = {}
        if kv_off or kv_len:
            if kv_off < first or kv_off + kv_len > body_end:
                raise HurrayFormatError("file.kv_offset", "KV section lies outside the file body")
            self._check_section(kv_len, "file.kv")
            self.kv = decode_kv(self._read_at(kv_off, kv_len, "file.kv"))
        self.entries = self._parse_index(index, index_off)

    def _check_section(self, n: int, what: str) -> None:
        """Refuse a section of ``n`` bytes beyond ``max_section_bytes``, before reading it (``what``: its field)."""
        if self._max_section is not None and n > self._max_section:
            raise HurrayFormatError(what, f"{n} bytes, more than the {self._max_section} this read of the file allows")

    def _parse_index(self, index: bytes, index_off: int) -> list[IndexEntry]:
        args = (index, index_off, self.first_descriptor_offset, self.alignment)
        # Only small indexes are remembered (a chunk file's is ~2 KiB): the memo keeps its keys' bytes.
        parse = _indexes.entries if len(index) <= _MEMO_INDEX_BYTES else _index_entries
        return list(parse(*args))

    def read(self, entry: IndexEntry, *, permissive: bool = False) -> Record:
        """The record of ``entry``; its descriptor is validated before any buffer."""
        return self._record(entry, self.descriptor(entry, permissive=permissive))

    def _record(self, entry: IndexEntry, desc: TensorDescriptor) -> Record:
        spans = self.buffer_spans(entry, desc)
        return Record(entry.name, desc, [self.buffer(pos, size, entry.name, i) for i, (pos, size) in enumerate(spans)])

    def descriptor(self, entry: IndexEntry, *, permissive: bool = False) -> TensorDescriptor:
        """The decoded descriptor of ``entry``, refused (by name) if it breaks a blocking rule."""
        # Error names are built only when raising: this runs for every record of every file.
        n = entry.descriptor_length
        if self._max_section is not None and n > self._max_section:  # the field's name only when refusing
            self._check_section(n, entry.name + ".descriptor")
        if n > MAX_DESCRIPTOR_LEN:  # as peek_descriptor_length refuses it, but before the bytes are read
            raise HurrayFormatError(
                "descriptor_length",
                f"{entry.name}: the index gives its descriptor {n} bytes, over this reader's "
                f"{MAX_DESCRIPTOR_LEN}-byte limit for one descriptor",
            )
        raw = self._read_at(entry.descriptor_offset, n, entry.name, ".descriptor")
        own = peek_descriptor_length(raw)
        if own != n:
            raise HurrayFormatError(
                "file.index.descriptor_length", f"{entry.name}: the index says {n} bytes, the descriptor {own}"
            )
        return decode_checked(raw, entry.name, permissive=permissive)

    def buffer_spans(self, entry: IndexEntry, desc: TensorDescriptor) -> list[tuple[int, int]]:
        """Where each buffer of ``entry`` lies in the file: ``(offset, size)``, checked against the file and index."""
        spans = []
        pos = entry.data_offset
        end = self.size - TRAILER_LEN
        for i, b in enumerate(desc.buffers):
            if i:
                pos += _pad(pos, self.alignment)
            size = b.byte_size
            if pos + size > end:
                raise HurrayFormatError(
                    f"{entry.name} buffer {i}", f"{size} bytes at {pos} run past the end of the file"
                )
            spans.append((pos, size))
            pos += size
        if desc.buffers and pos - entry.data_offset != entry.data_length:
            raise HurrayFormatError(
                "file.index.data_length",
                f"{entry.name}: buffers need {pos - entry.data_offset} bytes, the index says {entry.data_length}",
            )
        return spans

    def buffer(self, pos: int, size: int, name: str = "", index: int = 0) -> torch.Tensor:
        """The ``size`` bytes at ``pos`` (a span :meth:`buffer_spans` gave) as a uint8 tensor.

        ``name`` and ``index``: the record and buffer, for the error of a file that shrank meanwhile.

        Pools are views of the map (or of the file read whole). Small buffers (block tables,
        seq_ptr, metadata) are copied out of it, so they do not pin the map or share its pages.
        """
        if self._map is not None and size >= _MMAP_MIN:
            return torch.frombuffer(self._map, dtype=torch.uint8, count=size, offset=pos)
        if self._map is not None and size:
            return torch.frombuffer(bytearray(self._map[pos : pos + size]), dtype=torch.uint8)
        t = torch.empty(size, dtype=torch.uint8)
        if size:
            assert self._f is not None  # as in _read_at
            self._f.seek(pos)
            read_into(self._f, byte_view(t), f"{name} buffer {index}")
        return t

    def typed_buffer(self, pos: int, size: int, dtype: torch.dtype) -> torch.Tensor:
        """``buffer(pos, size).view(dtype)`` in one step where the buffer is a view (one tensor fewer)."""
        if self._map is not None and size >= _MMAP_MIN and size % dtype.itemsize == 0:
            return torch.frombuffer(self._map, dtype=dtype, count=size // dtype.itemsize, offset=pos)
        return self.buffer(pos, size).view(dtype)

    @property
    def whole(self) -> memoryview | _mmap.mmap | None:
        """Every byte of the file (read whole or mapped), or ``None`` when buffers are read one by one."""
        return self._map

    def records(self, *, permissive: bool = False) -> Iterator[Record]:
        """Every record of the file, in index order (``permissive`` as for :meth:`read`).

        Refused (:class:`HurrayFormatError`, field ``buffer_count``) before the buffers of the record
        that brings the file past :data:`~.schema.MAX_BUFFERS` buffers are read, as a stream is.
        """
        count = 0
        for e in self.entries:
            desc = self.descriptor(e, permissive=permissive)
            count += len(desc.buffers)
            if count > MAX_BUFFERS:
                raise HurrayFormatError("buffer_count", f"{e.name} brings the file past {MAX_BUFFERS} buffers in all")
            yield self._record(e, desc)
