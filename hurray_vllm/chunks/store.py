"""A content-addressed store of KV chunks, shared by producers and consumers.

A *chunk* is a fixed number of tokens (``chunk_tokens``, a multiple of
every engine's block size that uses the store) of one sequence, saved as a
one-sequence :class:`KVSnapshot` in a ``.hrry`` file. Its key chains the
hashes of all chunks before it, so a key names a whole prefix: a consumer
finds the longest stored prefix of a prompt by walking keys until one is
missing, and a producer never writes a prefix that is already there.

Keys live in a namespace derived from the model fingerprint, so a snapshot
of another model is never even looked at. Writes are atomic (temp file +
rename): a reader sees a whole chunk or none.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..containers.hrryfile import FILE_MAGIC, HrryFile, file_size, read_whole, write_file
from ..containers.io import PARSE_ERRORS, FileBytes, load_file_bytes, read_error
from ..containers.schema import (
    _MAX_META_BYTES,
    Record,
    SnapshotHeader,
    _dense,
    decode_header,
    group_records,
    is_snapshot_header,
    snapshot_records,
)
from ..errors import HurrayArgumentError, HurrayFormatError
from ..kv.snapshot import KVSnapshot
from ..wire.rules import raise_if

# Re-exported (not in __all__): in 0.1 all of the chunk store lived in this one module.
from .digest import (  # noqa: F401
    DIGEST_KEY,
    DIGEST_MISMATCH,
    ChunkDigest,
    chunk_digest,
    digest_matches,
)
from .keys import (  # noqa: F401
    CHUNK_NAME,
    chunk_keys,
    chunk_layouts,
    chunks_of,
    is_chunk_name,
    namespace_of,
    sequence_seeds,
    slice_key,
    split_slice_key,
    tail_keys,
)
from .prune import PruneReport, take_if_same
from .signing import FleetKeys, sign_chunk
from .verify import check_data, verify_chunk  # noqa: F401

__all__ = [
    "ChunkPart",
    "ChunkReader",
    "ChunkStore",
    "ChunkUses",
    "DirectoryStore",
    "load_chunk",
    "slice_key",
    "split_slice_key",
    "store_snapshot",
]

#: The largest chunk file the store reads, in bytes; a larger one is refused (``HurrayFormatError``, field
#: ``file.size``) before any memory is allocated for it. A chunk of 256 tokens of a 126-layer model with 8 KV
#: heads of 128 bf16 values (Llama 3 405B) is 126 MiB; this leaves room for chunks 30 times that. Without a
#: bound a sparse file of 100 GiB under a key's name would cost its reader 100 GiB of memory.
MAX_CHUNK_FILE_BYTES = 4 << 30

#: What a header read (:func:`read_header`) takes from a chunk file at most, in bytes: its index, its KV section
#: and each descriptor are refused beyond it (``HurrayFormatError``, fields ``file.index``, ``file.kv``,
#: ``<name>.descriptor``) before they are read, and so are the header's records once their descriptors and
#: buffers add up to more. A chunk's header needs a few KiB; this is what a snapshot's metadata may hold
#: (64 MiB), which admits an index of ``MAX_RECORDS`` rows with names of up to 989 bytes (a chunk file's are
#: under 40). Without it, a sparse file of 1 GiB (4 KiB on disk) whose trailer claimed a 1 GiB index cost
#: every header read (a scheduler's, a keyed prune's) 1 GiB of memory and seconds.
MAX_HEADER_READ_BYTES = _MAX_META_BYTES

#: The field of the ``HurrayFormatError`` that :meth:`DirectoryStore.read` raises for a chunk file that is not
#: there (deleted by a prune since the caller's ``stat``, say): a miss, not damage.
MISSING = "store"

#: A chunk file served from a copy in memory is read a byte at most this often, in seconds (:class:`ChunkUses`).
TOUCH_INTERVAL_S = 3600.0


@dataclass(frozen=True)
class ChunkPart:
    """One file of a stored chunk: its name (:func:`slice_key`), the heads it holds, its identity."""

    name: str
    heads: range
    identity: tuple[int, ...]


log = logging.getLogger("hurray_vllm.chunks")


class ChunkStore(Protocol):
    """What a receiver stores into (:class:`DirectoryStore` is one).

    ``put`` must not keep references to the snapshot's page pools after it
    returns: they are views of the receiver's reusable buffers.
    """

    def put(self, namespace: str, key: str, snap: KVSnapshot) -> bool:
        """Store ``snap`` under ``key`` unless it is there already; True if written."""
        ...


@dataclass(frozen=True)
class DirectoryStore:
    """Chunks as ``ROOT/<namespace>/<key>.hrry`` files."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    def path(self, namespace: str, key: str) -> Path:
        """The file that holds (or would hold) chunk ``key`` of ``namespace``.

        Every method of the store names its file here, so each refuses what this refuses.

        Raises:
            HurrayArgumentError: ``namespace`` (field ``namespace``) or ``key`` (field ``key``) is not a name the
                store gives (:func:`~.keys.namespace_of`: hex digits; a key, or a slice's ``<key>.h<a>-<b>``):
                ``..`` or a ``/`` would name a file outside the store.
        """
        # One fullmatch each on the hot path (a whole chunk's key); a slice's name takes is_chunk_name's look.
        if not (isinstance(namespace, str) and CHUNK_NAME.fullmatch(namespace)):
            raise HurrayArgumentError(
                "namespace", f"{namespace!r} is not a chunk store namespace: 1-64 lowercase hex digits (namespace_of)"
            )
        if not (isinstance(key, str) and (CHUNK_NAME.fullmatch(key) or is_chunk_name(key))):
            raise HurrayArgumentError(
                "key",
                f"{key!r} is not a chunk's name: a key of 1-64 lowercase hex digits (chunk_keys), or a slice's "
                "<key>.h<a>-<b> (slice_key), without .hrry",
            )
        return self.root / namespace / f"{key}.hrry"

    def has(self, namespace: str, key: str) -> bool:
        """Whether chunk ``key`` of ``namespace`` is stored."""
        return self.identity(namespace, key) is not None

    def identity(self, namespace: str, key: str) -> tuple[int, ...] | None:
        """What tells this chunk's file from any other: device, inode, size, modification and change times.

        ``None`` if the chunk is not stored (no regular file under its name,
        or the namespace directory is a symbolic link, which :meth:`get` does
        not follow). Chunk files are never rewritten in place (a write is a
        new file renamed or linked to the name), so an equal identity means
        the same bytes (a new file's change time moves once more as its
        temporary name is removed, just after it lands: a look in between
        reads it again, nothing worse). The kernel updates the change time on
        every write, but with a granularity of a few milliseconds: a file
        rewritten in place by another program within that time of being
        looked at, to the same size, keeps its identity.
        """
        return _file_identity(self.path(namespace, key))

    def quarantine(self, namespace: str, key: str, identity: tuple[int, ...]) -> Path | None:
        """Move a damaged chunk file aside (to ``<key>.hrry.bad``) so that the next producer writes it again.

        Only if the file is still the one that was found damaged
        (``identity``, from :meth:`identity`): a good file renamed over it
        in the meantime stays. Returns the new path, or ``None`` if nothing
        was moved. A later ``.bad`` of the same key replaces an earlier one.
        """
        path = self.path(namespace, key)
        now = self.identity(namespace, key)
        if now is None or now != identity:
            return None
        bad = path.with_name(path.name + ".bad")
        # Not os.replace(path, bad): a producer's rename landing after the check above would be moved aside.
        try:
            _check_namespace_dir(path.parent)  # a link swapped in since: nothing outside the store is moved
            return bad if take_if_same(path, identity, bad) else None
        except OSError:
            return None

    def put(self, namespace: str, key: str, snap: KVSnapshot, *, replace: bool = False) -> bool:
        """Store ``snap`` under ``key`` unless it is there already (or ``replace``); True if written.

        ``replace`` renames the new file over a stored one: a reader holds
        the old file or the new, whole (its identity changes, so a verified
        copy of the old one is no longer taken for it). Without it, a copy
        another writer stores while this one writes stays (False): it may hold
        more (linear-attention states, a replace's upgrade), and at tensor
        parallelism > 1 a slice replaced by another engine's would not join
        its set.

        Raises:
            OSError: the file cannot be written. ``filename``: the namespace directory when it, or the
                temporary file in it, cannot be made (``EACCES``, ``ENOSPC``; the store's root if that cannot be
                made) or when it is a symbolic link (``ELOOP``); else the chunk's file (a write's error).
            HurrayArgumentError: a namespace or key that is not the store's (:meth:`path`).
        """
        target = self.path(namespace, key)
        if _file_identity(target) is not None and not replace:
            return False
        target.parent.mkdir(parents=True, exist_ok=True)  # takes a link to a directory as one: checked next
        _check_namespace_dir(target.parent)
        try:
            # No fsync: every reader verifies the chunk checksum, so a file torn by
            # a crash is refused and recomputed; a disk flush per chunk is not worth it.
            # A symbolic link at the name (planted in a shared store) is replaced, not written through.
            write_file(snapshot_records(snap), target, fsync=False, follow_symlinks=False, replace=replace)
        except FileExistsError as exc:
            if replace or exc.filename != os.fspath(target):
                raise
            return False  # stored by another writer since the check above: theirs stays
        except OSError as exc:
            if exc.filename is not None or exc.errno is None:
                raise
            # A write's error (ENOSPC, EIO) names no file: say which, for the operator's log.
            raise OSError(exc.errno, exc.strerror, os.fspath(target)) from exc
        return True

    def size_of(self, snap: KVSnapshot) -> int:
        """The bytes :meth:`put` writes for ``snap`` (its ``.hrry`` file's size), computed without writing."""
        return file_size(snapshot_records(snap))

    def prune(
        self, max_bytes: int, *, stale_temp_s: float = 3600.0, dry_run: bool = False, keys: FleetKeys | None = None
    ) -> PruneReport:
        """Delete the least recently used chunks until the store holds at most ``max_bytes``.

        See :func:`hurray_vllm.chunks.prune.prune`, which this calls.
        """
        from .prune import prune

        return prune(self, max_bytes, stale_temp_s=stale_temp_s, dry_run=dry_run, keys=keys)

    def parts(self, namespace: str, key: str, num_kv_heads: int, *, states: bool = False) -> list[ChunkPart] | None:
        """The files that together hold every KV head of chunk ``key``, or ``None`` if no such set is stored.

        The whole chunk (one file) if it is there; else the slices of one way
        of splitting the heads into equal runs (what producers at tensor
        parallelism 2, 4, 8... write, :func:`hurray_vllm.kv.heads.partitions`).
        A set with a slice missing (a rank that has not written yet, or never
        will) is incomplete: it is never loaded.

        ``states=True``: :meth:`parts_with_states`'s set.
        """
        if states:
            return self.parts_with_states(namespace, key, num_kv_heads)[0]
        return next(self.complete_sets(namespace, key, num_kv_heads), None)

    def parts_with_states(self, namespace: str, key: str, num_kv_heads: int) -> tuple[list[ChunkPart] | None, bool]:
        """A linear-attention hybrid's resume point: :meth:`parts`, preferring a set whose every file carries states.

        Returns the first complete set whose files all carry states, and
        True; else the first complete set, and False (``(None, False)``
        when none is stored). Engines of two TP degrees may each have stored
        the chunk, one without the states (its step ran past the chunk's
        end). Reads the headers of the complete sets' files, once each.
        """
        first = None
        for out in self.complete_sets(namespace, key, num_kv_heads):
            if all(self.has_states(namespace, p.name) for p in out):
                return out, True
            first = first or out
        return first, False

    def complete_sets(self, namespace: str, key: str, num_kv_heads: int) -> Iterator[list[ChunkPart]]:
        """Each stored set of files holding every KV head of chunk ``key`` (see :meth:`parts`), whole file first.

        Lazily: a ``stat`` per file of the sets taken so far (and one per way of splitting the heads that has
        a file missing). A caller that judges the sets by their headers (windows, states) takes the first that
        suits it, not :meth:`parts`' first: engines of two TP degrees, or one rank whose save failed, may have
        left one set that holds less, or slices that do not join.
        """
        for files in chunk_layouts(key, num_kv_heads):
            out = []
            for name, r in files:
                ident = self.identity(namespace, name)
                if ident is None:  # this split is incomplete: no need to look at its other files
                    break
                out.append(ChunkPart(name, r, ident))
            else:
                yield out

    def has_states(self, namespace: str, key: str) -> bool:
        """Whether the stored chunk carries linear-attention states (reads its header only; False if unreadable)."""
        header = self.header(namespace, key)
        return header is not None and header.states is not None

    def header(self, namespace: str, key: str) -> SnapshotHeader | None:
        """The stored chunk's snapshot header, reading its header records only; ``None`` if missing or unreadable.

        What a writer looks at before replacing a copy that holds less (no
        states, less of a sliding window) than its own: a damaged file is
        the reader's to refuse, not this look's. Never raises for what the
        file holds (:func:`read_header`'s errors are ``None`` here); ``None``
        too where the namespace directory is a symbolic link (:meth:`get` refuses it).
        """
        path = self.path(namespace, key)
        try:
            _check_namespace_dir(path.parent)
            return read_header(path)
        except (OSError, HurrayFormatError):
            return None

    def get(self, namespace: str, key: str, *, noatime: bool = False) -> KVSnapshot:
        """The chunk under ``key``, read into memory it owns; :class:`HurrayFormatError` if missing or malformed.

        Not mapped: another program truncating a mapped file kills the reader
        with SIGBUS, even after its digest passed. A read copy is checked and
        used as it was read, whatever happens to the file afterwards.

        Only a regular ``.hrry`` file of at most :data:`MAX_CHUNK_FILE_BYTES`
        is read: a symbolic link at the name, or in place of the namespace
        directory, is not followed (``OSError``), and a pipe put there is
        refused, not waited on.

        ``noatime=True``: leave the file's access time as it was (``O_NOATIME``, for the file's owner): for a
        maintenance read (``fsck``), which is no use of the chunk, while :meth:`prune` ranks chunks by last use.

        Its data is not checked against its digest here: that is the caller's
        check (:func:`load_chunk`), as every consumer and ``fsck`` run it.

        Raises:
            HurrayFormatError: missing (field ``store``), malformed, not a regular file (``file``),
                larger than :data:`MAX_CHUNK_FILE_BYTES` (``file.size``).
            OSError: the file cannot be read (permissions, a symbolic link; ``ENOMEM``: not a verdict on the file).
            HurrayArgumentError: a namespace or key that is not the store's (:meth:`path`).
        """
        return load_chunk(self.read(namespace, key, noatime=noatime))

    def read(self, namespace: str, key: str, *, noatime: bool = False, page_crcs: bool = False) -> FileBytes:
        """The bytes of the chunk file under ``key``, for :func:`load_chunk`.

        What :meth:`get` reads, with its rules and errors for the file (not
        for its contents). ``page_crcs``: checksum each page as it is read,
        for a caller that checks the chunk's CRC-32C digest next
        (:func:`~hurray_vllm.chunks.verify.begin_check_data` with ``read=``),
        which then does not read the pools from memory again. ``noatime``: as :meth:`get`.

        Raises:
            HurrayFormatError: missing (field ``store``), not a regular file (``file``), too large (``file.size``).
            OSError: as :meth:`get`.
        """
        try:
            return _read_chunk(self.path(namespace, key), noatime=noatime, page_crcs=page_crcs)
        except FileNotFoundError:
            raise HurrayFormatError(MISSING, f"no chunk {key} in {self.root}") from None

    def reader(self, namespace: str, keys: Sequence[str], submit: Submit, *, page_crcs: bool = False) -> ChunkReader:
        """A :class:`ChunkReader` of ``keys``, in order, reading ahead with ``submit`` (``page_crcs``: see read)."""
        return ChunkReader(self, namespace, keys, submit, page_crcs=page_crcs)


def _read_chunk(path: Path, *, noatime: bool = False, page_crcs: bool = False) -> FileBytes:
    """Every byte of the chunk file at ``path`` (:meth:`DirectoryStore.get`'s rules), with ``load``'s errors."""
    try:
        _check_namespace_dir(path.parent)
        return read_whole(
            path, max_bytes=MAX_CHUNK_FILE_BYTES, follow_symlinks=False, page_crcs=page_crcs, noatime=noatime
        )
    except IsADirectoryError:  # open_regular's error for one: here, as a pipe is, a name that holds no chunk file
        raise HurrayFormatError("file", f"{path} is a directory, not a chunk file (not a regular file)") from None
    except (HurrayFormatError, OSError):
        raise
    except (*PARSE_ERRORS, MemoryError) as exc:
        raise read_error(exc, str(path)) from exc


def _check_namespace_dir(directory: Path) -> None:
    """Raise ``OSError`` (``ELOOP``) if the namespace directory ``directory`` is a symbolic link.

    A chunk file is opened without following a link at its own name
    (``O_NOFOLLOW``), which says nothing of the directories above it: a link
    planted in a shared store in place of a namespace directory would have
    chunks read from, and written into, wherever it points (``fsck`` and
    ``prune`` skip such a link too). Refused as a link at the file's name is:
    an ``OSError``, which no consumer takes for damage (nothing is moved
    aside). A missing directory passes: a read finds no file, a write makes
    it. The look and the open after it are two system calls: a link swapped
    in between them is followed.
    """
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "the namespace directory is a symbolic link, not followed", str(directory))


def load_chunk(data: FileBytes) -> KVSnapshot:
    """The chunk :meth:`DirectoryStore.read` read; a file of another format is refused (the store writes ``.hrry``).

    ``load_file_bytes`` would take a stream too: the store holds ``.hrry`` files only.
    The chunk's digest is not checked here: every consumer runs the data check
    itself (:func:`~hurray_vllm.chunks.verify.begin_check_data`: the digest, or
    with a fleet key the MAC instead, on a helper thread), and one pass over the
    pools is enough.

    Raises:
        HurrayFormatError: as :meth:`DirectoryStore.get` for a malformed file.
    """
    if bytes(data.view[:8]) != FILE_MAGIC:
        raise HurrayFormatError("file.magic", f"{data.path} is not a Hurray file (HRRYFILE)")
    return load_file_bytes(data, digest=False)


def read_header(path: Path, *, noatime: bool = False) -> SnapshotHeader | None:
    """The snapshot header of the chunk file at ``path``, reading its header records only.

    ``None`` if the file's first record is not a snapshot header. Checked
    as ``load`` checks it (the metadata record's layout, type and size);
    the index, each record and all of them together are bounded
    (:data:`MAX_HEADER_READ_BYTES`) before their bytes are read (a header's
    records are small), and the file is read, not mapped (no SIGBUS when
    another program truncates it). A symbolic link is not followed; a pipe
    is refused, not waited on. ``noatime``: as :meth:`DirectoryStore.get`
    (a keyed prune's look at the signer).

    Raises:
        HurrayFormatError: the file is malformed (``.field`` names what).
        OSError: the file cannot be read (``FileNotFoundError`` if missing; ``ENOMEM``: not a verdict on it).
    """
    try:
        with HrryFile(path, follow_symlinks=False, noatime=noatime, max_section_bytes=MAX_HEADER_READ_BYTES) as hf:
            node = next(group_records(_bounded_records(hf)), None)
            if node is None or not is_snapshot_header(node):
                return None
            raw = _dense(node.members[0], torch.uint8, "snapshot.meta")
            if raw.numel() > _MAX_META_BYTES:
                raise HurrayFormatError("snapshot.meta", f"{raw.numel()} bytes of metadata is implausible")
            return decode_header(bytes(raw.numpy()))
    except (HurrayFormatError, OSError):
        raise
    except (*PARSE_ERRORS, MemoryError) as exc:
        raise read_error(exc, str(path)) from exc


def _bounded_records(hf: HrryFile) -> Iterator[Record]:
    """``hf``'s records, each refused before its buffers are read if they hold more than a header's record may.

    And once the records read so far, descriptors and buffers, add up to more
    than :data:`MAX_HEADER_READ_BYTES`: a header group of many members, each
    under the bound, would otherwise read as much as the file claims to hold.
    """
    left = MAX_HEADER_READ_BYTES
    for entry in hf.entries:
        left -= entry.descriptor_length
        if left < 0:
            raise HurrayFormatError(entry.name, f"the header's records hold more than {MAX_HEADER_READ_BYTES} bytes")
        size = hf.descriptor(entry).data_bytes
        if size > _MAX_META_BYTES:
            raise HurrayFormatError(entry.name, f"{size} bytes: more than a snapshot header's record holds")
        left -= size
        if left < 0:
            raise HurrayFormatError(entry.name, f"the header's records hold more than {MAX_HEADER_READ_BYTES} bytes")
        yield hf.read(entry)


def _file_identity(path: Path) -> tuple[int, ...] | None:
    """:meth:`DirectoryStore.identity` of the file at ``path``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:  # missing, or unreadable: either way not loadable
        return None
    if not stat.S_ISREG(st.st_mode):  # also a symbolic link: the store writes none, so it is not a chunk
        return None
    # _check_namespace_dir's look, inline (lookups run it per file, per step): after the file's stat, so that a
    # miss (every lookup's last key) costs one system call, a hit two. A link in place of the namespace directory
    # holds nothing: get refuses what it holds.
    try:
        if stat.S_ISLNK(os.lstat(os.path.dirname(path)).st_mode):
            return None
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


#: Runs a call on a helper thread (``ThreadPoolExecutor.submit``).
Submit = Callable[[Callable[[], FileBytes]], "Future[FileBytes]"]


class ChunkReader:
    """Chunk files read in a known order, each file's bytes read on a helper thread while the one before is parsed.

    A consumer reads a prompt's chunks one after another: the read of each
    (a system call, which releases the GIL) overlaps the Python that parses
    the one before, instead of following it. At most one file is read ahead.
    :meth:`get` gives what :meth:`DirectoryStore.get` would; a key asked for
    out of order is read there and then (and reading ahead goes on after it
    if it is one of the keys).

    Example:
        >>> reader = store.reader(ns, [k0, k1, k2], pool.submit)  # doctest: +SKIP
        >>> first = reader.get(k0)  # k1 is read meanwhile  # doctest: +SKIP
    """

    def __init__(
        self, store: DirectoryStore, namespace: str, keys: Sequence[str], submit: Submit, *, page_crcs: bool = False
    ) -> None:
        self._store, self._ns, self._submit, self._page_crcs = store, namespace, submit, page_crcs
        self._keys = list(keys)
        self._next = 0
        self._ahead: tuple[str, Future[FileBytes]] | None = None
        self._read_ahead()

    def _read_ahead(self) -> None:
        if self._next < len(self._keys):
            key = self._keys[self._next]
            self._next += 1
            path = self._store.path(self._ns, key)
            self._ahead = (key, self._submit(functools.partial(_read_chunk, path, page_crcs=self._page_crcs)))
        else:
            self._ahead = None

    def get(self, key: str) -> KVSnapshot:
        """The chunk under ``key``, as :meth:`DirectoryStore.get` reads it; the next key's read starts first.

        Raises:
            HurrayFormatError: as :meth:`DirectoryStore.get`.
            OSError: the file cannot be read.
        """
        return load_chunk(self.read(key))

    def read(self, key: str) -> FileBytes:
        """The bytes of the chunk file under ``key``, as :meth:`DirectoryStore.read` reads them; the next read starts.

        Raises:
            HurrayFormatError: as :meth:`DirectoryStore.read`.
            OSError: the file cannot be read.
        """
        ahead = self._ahead
        if ahead is None or ahead[0] != key:
            if key in self._keys[self._next :]:  # keys were skipped: read ahead from here on again
                self._next = self._keys.index(key, self._next) + 1
                self._read_ahead()
            return self._store.read(self._ns, key, page_crcs=self._page_crcs)
        self._read_ahead()
        try:
            return ahead[1].result()
        except FileNotFoundError:
            raise HurrayFormatError(MISSING, f"no chunk {key} in {self._store.root}") from None


def touch_file(path: Path) -> None:
    """Read one byte of the chunk file at ``path``, so its access time moves as a read's does; errors are ignored.

    Under the mount's rules (``relatime``: at most once a day; ``noatime``:
    never), as any read; not a chunk file's symbolic link, nor through one at
    its namespace's name. Its change time stays (``os.utime`` would move it),
    so identities that include it (:meth:`DirectoryStore.identity`) stay
    valid. A file gone meanwhile, or not a regular file, is left alone: the
    next real read judges it.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        _check_namespace_dir(path.parent)  # as every read: a link in place of the namespace is not followed
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.read(fd, 1)
    except OSError:
        pass
    finally:
        os.close(fd)


class ChunkUses:
    """Marks the chunk files of one namespace used when a copy in memory serves them instead of a read.

    Prune deletes the least recently used chunks by their files' access
    times: a chunk a connector serves from its verified copies (never read
    again) would keep the access time of its first read, and the most used
    prefixes would go first. A use reads one byte of the file
    (:func:`touch_file`) if this object has neither read nor touched it for
    :data:`TOUCH_INTERVAL_S`: a dictionary look-up on every other use.
    Remembers at most ``capacity`` files (the cache it mirrors), the least
    recently marked first out: one forgotten costs one more touch. Not
    thread-safe: one per connector part, used from its thread.
    """

    def __init__(self, store: DirectoryStore, namespace: str, capacity: int) -> None:
        self._store, self._ns, self._capacity = store, namespace, max(capacity, 1)
        self._last: OrderedDict[str, float] = OrderedDict()

    def used(self, key: str, *, read: bool = False) -> None:
        """Chunk file ``key`` served from memory (``read``: read from its file just now, which moved its time)."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < TOUCH_INTERVAL_S:
            return
        self._last[key] = now
        self._last.move_to_end(key)
        if len(self._last) > self._capacity:
            self._last.popitem(last=False)
        if not read:
            touch_file(self._store.path(self._ns, key))


def store_snapshot(
    store: DirectoryStore,
    snap: KVSnapshot,
    chunk_tokens: int,
    *,
    keys: FleetKeys | None = None,
    tails: bool = True,
) -> int:
    """Put ``snap``'s whole chunks into ``store`` for engines running HurrayConnector; returns chunks written.

    ``keys``: sign every chunk (engines with ``hurray_key_file`` load only signed ones).
    ``tails``: also each sequence's whole pages after its last whole chunk, as
    the prompt tail a connector with ``hurray_tails`` saves and loads (models
    of one KV cache group; counted in the return value).

    This is how a snapshot is imported into another vLLM engine: the
    engine's connector finds the chunks by prefix when the sequences arrive.
    A linear-attention hybrid's states go with the chunk ending where they
    were taken; a sequence whose length is not a whole number of chunks
    gets chunks no consumer can resume from, which is logged.

    Raises:
        HurrayFormatError: a snapshot :func:`~hurray_vllm.load` would refuse (the first violation's field names
            it; :meth:`KVSnapshot.validate` lists them all): nothing is stored. Or as :func:`chunks_of` (no
            fingerprint: ``snapshot.fingerprint``; no token ids: ``snapshot.token_ids``).
    """
    # What a reader refuses is not stored: a chunk every engine refuses (fsck: damaged) is worse than an error
    # naming the field now. Here, not in put(): the connector's hot path puts chunks of a validated export.
    raise_if(snap.validate(), "snapshot")
    written = 0
    resumable = 0
    for key, chunk in chunks_of(snap, chunk_tokens, tails=tails):
        assert chunk.fingerprint is not None
        # A slice of the heads (one tensor-parallel rank's) is stored as such: alone it is not the chunk.
        heads = range(chunk.heads.start, chunk.heads.stop) if chunk.heads is not None else None
        ns, name = namespace_of(chunk.fingerprint), slice_key(key, heads)
        written += store.put(ns, name, sign_chunk(chunk, keys, ns, name) if keys is not None else chunk)
        resumable += chunk.states is not None
    # Of the sequences with chunks at all (a request with media has none, by design).
    keyed = snap.num_seqs
    if snap.states is not None and snap.fingerprint is not None:
        keyed = sum(seed is not None for seed in sequence_seeds(snap, namespace_of(snap.fingerprint)))
    if snap.states is not None and resumable < keyed:
        log.warning(
            "hurray: %d of %d sequences have no chunk ending where their linear-attention states were taken "
            "(lengths %s, chunks of %d tokens): a consumer recomputes them",
            keyed - resumable,
            keyed,
            list(snap.states.positions),
            chunk_tokens,
        )
    return written
