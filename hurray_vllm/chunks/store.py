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

import hashlib
import os
import stat
import time
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .. import native
from ..containers.hrryfile import write_file
from ..containers.io import load
from ..containers.schema import snapshot_records
from ..containers.stream import byte_view
from ..errors import HurrayFormatError
from ..kv.snapshot import KVSnapshot, ModelFingerprint

__all__ = [
    "PruneReport",
    "chunk_keys",
    "namespace_of",
    "DirectoryStore",
    "chunk_digest",
    "digest_matches",
    "verify_chunk",
    "store_snapshot",
    "chunks_of",
]

DIGEST_KEY = "hurray_vllm.chunk_digest"
DIGEST_MISMATCH = "chunk data does not match its digest (corrupt transfer?)"


def namespace_of(fp: ModelFingerprint) -> str:
    """A short, stable name for everything one model's caches may share."""
    h = hashlib.blake2b(digest_size=8)
    for part in (fp.architecture, fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.dtype, fp.weights_digest or ""):
        h.update(f"{part}\x00".encode())
    return h.hexdigest()


def chunk_keys(token_ids: Sequence[int], chunk_tokens: int, namespace: str) -> list[str]:
    """Keys of the whole chunks of ``token_ids``; key ``i`` covers tokens ``[0, (i+1)*chunk_tokens)``."""
    keys = []
    prev = namespace.encode()
    for i in range(len(token_ids) // chunk_tokens):
        chunk = token_ids[i * chunk_tokens : (i + 1) * chunk_tokens]
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(array("q", chunk).tobytes())  # int64, native order: the bytes torch.int64 would give
        prev = h.digest()
        keys.append(h.hexdigest())
    return keys


class ChunkDigest:
    """Incremental chunk checksum over the page pools, in snapshot order.

    Two algorithms, named in the digest string (``"<algorithm>:<8 hex>"``):

    * ``crc32c`` (CRC-32C, Castagnoli): computed by the native kernels
      (:mod:`hurray_vllm.native`, the SSE4.2 ``crc32`` instruction where the
      CPU has it), about 3.5x faster than zlib here. The default wherever
      the native kernels load.
    * ``crc32`` (zlib's CRC-32): the fallback writers use without them.

    It guards against damaged transfers and files, not against an adversary
    (run transports on a trusted network), and runs several times faster
    than a cryptographic hash, which would dominate the cost of moving a
    chunk. Both release the GIL, so a receiver can checksum pools that
    landed while others are still arriving.
    """

    ALGORITHMS = ("crc32c", "crc32")

    def __init__(self, algorithm: str | None = None) -> None:
        if algorithm is None:
            algorithm = "crc32c" if native.library() is not None else "crc32"
        if algorithm not in self.ALGORITHMS:
            raise HurrayFormatError("snapshot.digest", f"unknown chunk digest algorithm {algorithm!r}")
        if algorithm == "crc32c" and native.library() is None:
            raise HurrayFormatError(
                "snapshot.digest",
                f"the chunk is checksummed with CRC-32C, which needs the native kernels: {native.unavailable_reason()}",
            )
        self.algorithm = algorithm
        self._crc = 0

    @classmethod
    def like(cls, digest: object) -> ChunkDigest:
        """A digest of the algorithm ``digest`` (a stored digest string) names, to check it."""
        if not isinstance(digest, str) or ":" not in digest:
            raise HurrayFormatError("snapshot.digest", "chunk carries no digest")
        return cls(digest.partition(":")[0])

    def update(self, data: bytes | memoryview) -> None:
        if self.algorithm == "crc32c":
            crc = native.crc32c(data, self._crc)
            assert crc is not None  # checked in __init__
            self._crc = crc
        else:
            self._crc = zlib.crc32(data, self._crc)

    def update_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Add the bytes of contiguous CPU ``tensors``, in order; one native call for CRC-32C."""
        if self.algorithm == "crc32c":
            crc = native.crc32c_tensors(tensors, self._crc)
            assert crc is not None  # checked in __init__
            self._crc = crc
            return
        for t in tensors:
            if t.numel():
                self.update(byte_view(t.reshape(-1).view(torch.uint8)))

    def hexdigest(self) -> str:
        return f"{self.algorithm}:{self._crc:08x}"


def chunk_digest(snap: KVSnapshot, algorithm: str | None = None) -> str:
    """The :class:`ChunkDigest` of every page pool of ``snap``: catches corruption the container cannot see."""
    d = ChunkDigest(algorithm)
    d.update_tensors([t.page_pool.contiguous().cpu() for t in (*snap.keys, *snap.values)])
    return d.hexdigest()


def digest_matches(snap: KVSnapshot) -> bool:
    """Whether ``snap``'s stored digest matches its pools (raises if the algorithm cannot run here)."""
    want = snap.extra.get(DIGEST_KEY)
    return want == chunk_digest(snap, ChunkDigest.like(want).algorithm)


def verify_chunk(snap: KVSnapshot, fp: ModelFingerprint, tokens: Sequence[int], *, digest: bool = True) -> None:
    """Raise :class:`HurrayFormatError` unless ``snap`` is this model's KV of exactly ``tokens``.

    ``digest=False`` leaves out the data checksum (the caller runs
    :func:`digest_matches` itself, e.g. on another thread).
    """
    if snap.fingerprint is None:
        raise HurrayFormatError("snapshot.fingerprint", "chunk carries no model fingerprint")
    diffs = snap.fingerprint.mismatches(fp)
    if diffs:
        raise HurrayFormatError("snapshot.fingerprint", "chunk is from another model: " + "; ".join(diffs))
    if snap.num_seqs != 1 or snap.seq_lens != [len(tokens)]:
        raise HurrayFormatError("seq_lens", f"chunk holds {snap.seq_lens} tokens, expected [{len(tokens)}]")
    if list(snap.token_ids[0][: len(tokens)]) != list(tokens):
        raise HurrayFormatError("snapshot.token_ids", "chunk holds other tokens than its key promises")
    if digest and not digest_matches(snap):
        raise HurrayFormatError("snapshot.digest", DIGEST_MISMATCH)


@dataclass
class PruneReport:
    """What :meth:`DirectoryStore.prune` deleted (or would delete, with ``dry_run``)."""

    dry_run: bool
    bytes_kept: int
    chunks_kept: int
    chunks_removed: int = 0
    bad_removed: int = 0
    temp_removed: int = 0
    bytes_removed: int = 0

    def add(self, kind: str, size: int) -> None:
        if kind == "chunk":
            self.chunks_removed += 1
            self.chunks_kept -= 1
        elif kind == "bad":
            self.bad_removed += 1
        else:
            self.temp_removed += 1
        self.bytes_removed += size


@dataclass(frozen=True)
class DirectoryStore:
    """Chunks as ``ROOT/<namespace>/<key>.hrry`` files."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    def path(self, namespace: str, key: str) -> Path:
        return self.root / namespace / f"{key}.hrry"

    def has(self, namespace: str, key: str) -> bool:
        return self.identity(namespace, key) is not None

    def identity(self, namespace: str, key: str) -> tuple[int, ...] | None:
        """What tells this chunk's file from any other: device, inode, size, modification and change times.

        ``None`` if the chunk is not stored (no regular file under its
        name). Chunk files are never rewritten in place (a write is a new
        file renamed over the name), so an equal identity means the same
        bytes. The kernel updates the change time on
        every write, but with a granularity of a few milliseconds: a file
        rewritten in place by another program within that time of being
        looked at, to the same size, keeps its identity.
        """
        try:
            st = os.stat(self.path(namespace, key))
        except OSError:  # missing, or unreadable: either way not loadable
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def quarantine(self, namespace: str, key: str, identity: tuple[int, ...]) -> Path | None:
        """Move a damaged chunk file aside (to ``<key>.hrry.bad``) so that the next producer writes it again.

        Only if the file is still the one that was found damaged
        (``identity``, from :meth:`identity`): a good file renamed over it
        in the meantime stays. Returns the new path, or ``None`` if nothing
        was moved. A later ``.bad`` of the same key replaces an earlier one.
        """
        path = self.path(namespace, key)
        if self.identity(namespace, key) != identity:
            return None
        bad = path.with_name(path.name + ".bad")
        try:
            os.replace(path, bad)
        except OSError:
            return None
        return bad

    def put(self, namespace: str, key: str, snap: KVSnapshot) -> bool:
        """Store ``snap`` under ``key`` unless it is there already; True if written."""
        target = self.path(namespace, key)
        if target.is_file():
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        # No fsync: every reader verifies the chunk checksum, so a file torn by
        # a crash is refused and recomputed; a disk flush per chunk is not worth it.
        write_file(snapshot_records(snap), target, fsync=False)
        return True

    def prune(self, max_bytes: int, *, stale_temp_s: float = 3600.0, dry_run: bool = False) -> PruneReport:
        """Delete the least recently used chunks until the store holds at most ``max_bytes``.

        Also deletes damaged files moved aside (``*.hrry.bad``) and temporary
        files older than ``stale_temp_s`` seconds (left by writers that died
        mid-write). "Used" is the later of a file's access and modification
        times: with Linux's default ``relatime`` mount option the access time
        moves at most once a day, with ``noatime`` never, and pruning is then
        oldest-written first. A prefix's later chunks are never used more
        recently than its earlier ones (a load walks the chunks in order and
        stops at the first missing one), so its tail goes first. Safe while
        engines use the store: a chunk deleted under an engine that mapped it
        stays readable for that engine, and later lookups miss it.
        ``dry_run`` only reports. Bytes are file sizes.
        """
        if max_bytes < 0:
            raise HurrayFormatError("max_bytes", f"must be >= 0, got {max_bytes}")
        now = time.time()
        chunks: list[tuple[float, int, Path]] = []
        doomed: list[tuple[str, int, Path]] = []
        for ns in sorted(p for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []:
            for entry in os.scandir(ns):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                name = entry.name
                if name.endswith(".hrry.bad"):
                    doomed.append(("bad", st.st_size, Path(entry.path)))
                elif name.startswith(".") and name.endswith(".tmp"):
                    if now - st.st_mtime > stale_temp_s:
                        doomed.append(("temp", st.st_size, Path(entry.path)))
                elif name.endswith(".hrry") and entry.is_file(follow_symlinks=False):
                    chunks.append((max(st.st_atime, st.st_mtime), st.st_size, Path(entry.path)))
        chunks.sort()
        total = sum(size for _, size, _ in chunks)
        for _, size, path in chunks:
            if total <= max_bytes:
                break
            doomed.append(("chunk", size, path))
            total -= size
        report = PruneReport(dry_run=dry_run, bytes_kept=total, chunks_kept=len(chunks))
        for kind, size, path in doomed:
            if not dry_run:
                try:
                    path.unlink()
                except FileNotFoundError:  # another pruner was first: gone all the same
                    pass
            report.add(kind, size)
        return report

    def get(self, namespace: str, key: str) -> KVSnapshot:
        """The chunk under ``key``; raises :class:`HurrayFormatError` if missing or malformed."""
        path = self.path(namespace, key)
        try:
            return load(path, mmap=True)
        except FileNotFoundError:
            raise HurrayFormatError("store", f"no chunk {key} in {self.root}") from None


def chunks_of(snap: KVSnapshot, chunk_tokens: int) -> list[tuple[str, KVSnapshot]]:
    """Every whole chunk of every sequence of ``snap``, keyed as a connector would key it.

    ``chunk_tokens`` must be a multiple of the snapshot's page size. Only
    tokens with KV count; a sequence's last partial chunk is left out.
    """
    if snap.fingerprint is None:
        raise HurrayFormatError(
            "snapshot.fingerprint", "chunks are namespaced by model: the snapshot needs a fingerprint"
        )
    if not snap.keys:
        return []
    ps = snap.page_size
    if chunk_tokens % ps:
        raise HurrayFormatError("chunk_tokens", f"{chunk_tokens} is not a multiple of the page size {ps}")
    ns = namespace_of(snap.fingerprint)
    per = chunk_tokens // ps
    out = []
    lens = snap.seq_lens
    for s in range(snap.num_seqs):
        tokens = list(snap.token_ids[s][: lens[s]])
        pages = snap.keys[0].pages_of(s)
        for c, key in enumerate(chunk_keys(tokens, chunk_tokens, ns)):
            table = pages[c * per : (c + 1) * per]
            ptr = torch.tensor([0, per])
            n = torch.tensor([chunk_tokens])
            keys = tuple(replace(k, block_table=table, seq_ptr=ptr, seq_lens=n, num_tokens=None) for k in snap.keys)
            values = tuple(replace(v, block_table=table, seq_ptr=ptr, seq_lens=n, num_tokens=None) for v in snap.values)
            chunk = replace(
                snap,
                keys=keys,
                values=values,
                token_ids=(tuple(tokens[c * chunk_tokens : (c + 1) * chunk_tokens]),),
                request_ids=(snap.request_ids[s],) if snap.request_ids else None,
            ).compact()
            out.append((key, replace(chunk, extra={**chunk.extra, DIGEST_KEY: chunk_digest(chunk)})))
    return out


def store_snapshot(store: DirectoryStore, snap: KVSnapshot, chunk_tokens: int) -> int:
    """Put ``snap``'s whole chunks into ``store`` for engines running HurrayConnector; returns chunks written.

    This is how a snapshot is imported into another vLLM engine: the
    engine's connector finds the chunks by prefix when the sequences arrive.
    """
    assert snap.fingerprint is not None or not snap.keys
    written = 0
    for key, chunk in chunks_of(snap, chunk_tokens):
        assert chunk.fingerprint is not None
        written += store.put(namespace_of(chunk.fingerprint), key, chunk)
    return written
