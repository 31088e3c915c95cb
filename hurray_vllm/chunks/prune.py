"""Store cleanup: least recently used chunks, damaged files and stale temporary files."""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import HurrayArgumentError, HurrayFormatError
from .digest import MAC_KEY
from .keys import is_chunk_name, is_namespace_name, split_slice_key
from .signing import FleetKeys, parse_mac

if TYPE_CHECKING:
    from .store import DirectoryStore

__all__ = ["PruneReport", "prune"]


def take_if_same(path: Path, identity: tuple[int, ...], dest: Path | None) -> bool:
    """Move the file at ``path`` to ``dest`` (``None``: delete it) only if it is the file ``identity`` names.

    ``identity`` starts ``(st_dev, st_ino, st_size, st_mtime_ns)`` (as :meth:`DirectoryStore.identity`).
    The file is first renamed to a private temporary name, which takes whatever file is under ``path``
    *now* and nothing else, and then checked: a producer's file renamed over the judged one at any time
    before is put back, not deleted or moved aside. (Checking ``path`` and then renaming it leaves a
    window in which the fresh file is the one acted on.) Returns whether it was moved or deleted.

    Raises:
        OSError: ``path`` could not be renamed (gone meanwhile: ``FileNotFoundError``; permissions).
    """
    held = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")  # a stale temp file if we die here
    os.rename(path, held)
    try:
        st = os.lstat(held)
        same = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == tuple(identity[:4])  # rename moved ctime
    except OSError:
        same = False
    try:
        if same:
            if dest is None:
                os.unlink(held)
            else:
                os.replace(held, dest)
            return True
        try:  # not the file judged: back under its name, unless an even newer one is there by now
            os.link(held, path)
        except FileExistsError:
            pass
        except OSError:  # no hard links here: a rename (over a newer copy of the same chunk at worst)
            os.replace(held, path)
            return False
        os.unlink(held)
    except OSError:
        pass
    return False


@dataclass
class PruneReport:
    """What :meth:`DirectoryStore.prune` deleted (or would delete, with ``dry_run``)."""

    dry_run: bool
    bytes_kept: int
    #: Chunk files kept and removed (a tensor-parallel chunk is a file per slice).
    chunks_kept: int
    chunks_removed: int = 0
    #: With keys: chunk files no key of the ring signed (unsigned, another fleet's, unreadable), deleted first.
    foreign_removed: int = 0
    bad_removed: int = 0
    temp_removed: int = 0
    bytes_removed: int = 0
    #: Paths that could not be read or deleted (permissions), with the reason: pruning went on without them.
    skipped: list[str] = field(default_factory=list)

    def add(self, kind: str, size: int) -> None:
        """Count a deleted file of ``size`` bytes: ``kind`` is ``"chunk"``, ``"bad"`` (moved aside) or else a temp."""
        if kind in ("chunk", "foreign"):
            self.chunks_removed += 1
            self.chunks_kept -= 1
            self.foreign_removed += kind == "foreign"
        elif kind == "bad":
            self.bad_removed += 1
        else:
            self.temp_removed += 1
        self.bytes_removed += size


#: A chunk file's temporary name while it is written (``containers.atomic``): ``.<name>.hrry.<random>.tmp``.
_TEMP = re.compile(r"\.(.+)\.hrry\.[^.]+\.tmp")
#: Temporary files younger than this are never deleted: their writer may be alive (a chunk writes in < 1 s).
MIN_STALE_TEMP_S = 60.0


def prune(
    store: DirectoryStore,
    max_bytes: int,
    *,
    stale_temp_s: float = 3600.0,
    dry_run: bool = False,
    keys: FleetKeys | None = None,
) -> PruneReport:
    """Delete the least recently used chunks until the store holds at most ``max_bytes``.

    Also deletes damaged files moved aside (``*.hrry.bad``) and temporary
    files older than ``stale_temp_s`` seconds (left by writers that died
    mid-write). "Used" is the later of a file's access and modification
    times: with Linux's default ``relatime`` mount option the access time
    moves at most once a day, with ``noatime`` never, and pruning is then
    oldest-written first. Its own reads (and ``fsck``'s) leave access times
    as they were (``O_NOATIME``) where the store's files are this user's.
    A prefix's later chunks are never used more
    recently than its earlier ones (a load walks the chunks in order and
    stops at the first missing one), so its tail goes first. Safe while
    engines use the store: a chunk deleted under an engine that mapped it
    stays readable for that engine, and later lookups miss it.
    ``dry_run`` only reports. With ``keys``, chunks that no key of the ring
    signed (unsigned, another fleet's, or unreadable: what a keyed engine
    would refuse) are deleted first, whatever the size; only the key id a
    file names is read, not its MAC checked (``fsck`` does that). A file
    that cannot be read is kept, and counted as kept. Bytes are
    file sizes. A namespace or file
    that cannot be read or deleted (permissions, I/O errors) is listed in
    ``report.skipped``, left in place, and the rest is pruned.
    """
    if max_bytes < 0:
        raise HurrayArgumentError("max_bytes", f"must be >= 0, got {max_bytes}")
    if not stale_temp_s >= MIN_STALE_TEMP_S:
        raise HurrayArgumentError(
            "stale_temp_s",
            f"must be at least {MIN_STALE_TEMP_S:g} s, got {stale_temp_s}: a younger temporary file may belong to a "
            "writer that is still writing it",
        )
    now = time.time()
    files: dict[tuple[Path, str], list[tuple[float, int, Path]]] = {}
    chunks: list[tuple[float, int, list[tuple[float, int, Path]]]] = []
    doomed: list[tuple[str, int, Path]] = []
    skipped: list[str] = []
    #: What each chunk file was when it was judged: only that file is deleted, not one renamed over it since.
    judged: dict[Path, tuple[int, int, int, int]] = {}
    for ns in namespaces(store.root, skipped):
        try:
            entries = list(os.scandir(ns))
        except OSError as exc:  # an unreadable namespace: prune the others
            skipped.append(f"{ns}: {exc.strerror or exc}")
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as exc:
                skipped.append(f"{entry.path}: {exc.strerror or exc}")
                continue
            name = entry.name
            # Only what the store itself writes: a directory given by mistake keeps its other files.
            if name.endswith(".hrry.bad") and is_chunk_name(name.removesuffix(".hrry.bad")):
                doomed.append(("bad", st.st_size, Path(entry.path)))
            elif (temp := _TEMP.fullmatch(name)) is not None and is_chunk_name(temp.group(1)):
                if now - st.st_mtime > stale_temp_s:
                    doomed.append(("temp", st.st_size, Path(entry.path)))
            elif (
                name.endswith(".hrry")
                and is_chunk_name(name.removesuffix(".hrry"))
                and entry.is_file(follow_symlinks=False)
            ):
                judged[Path(entry.path)] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                files.setdefault((ns, _chunk_of(name)), []).append(
                    (max(st.st_atime, st.st_mtime), st.st_size, Path(entry.path))
                )
    # A tensor-parallel chunk is several files (<key>.h<a>-<b>.hrry): it goes, or stays, whole, by its
    # most recent use; a lone slice would be kept bytes that can never load.
    for group in files.values():
        chunks.append((max(t for t, _, _ in group), sum(size for _, size, _ in group), group))
    foreign = 0
    if keys is not None:
        # File by file: a chunk's files may come from engines of several TP degrees (the whole file and
        # slices), and an unsigned slice beside a signed whole file takes only itself away.
        ours = []
        for _, _, group in chunks:
            # None: the file could not be read (listed in skipped), which says nothing about it: it stays.
            signed = [_signed_by(path, keys, skipped) for _, _, path in group]
            doomed.extend(
                ("foreign", size, path) for (_, size, path), ok in zip(group, signed, strict=True) if ok is False
            )
            foreign += signed.count(False)
            # An unreadable file is kept, and so counted toward max_bytes (deleting it by size needs no read).
            kept = [f for f, ok in zip(group, signed, strict=True) if ok is not False]
            if kept:
                ours.append((max(t for t, _, _ in kept), sum(size for _, size, _ in kept), kept))
        chunks = ours
    chunks.sort(key=lambda c: (c[0], c[1]))
    total = sum(size for _, size, _ in chunks)
    for _, size, group in chunks:
        if total <= max_bytes:
            break
        doomed.extend(("chunk", file_size, path) for _, file_size, path in group)
        total -= size
    files_kept = sum(len(group) for _, _, group in chunks) + foreign
    report = PruneReport(dry_run=dry_run, bytes_kept=total, chunks_kept=files_kept, skipped=skipped)
    for kind, size, path in doomed:
        if not dry_run:
            try:
                if kind not in ("chunk", "foreign"):
                    path.unlink()
                elif not take_if_same(path, judged[path], None):
                    # Written again since the scan (a producer's rename): a fresh file, not the one judged.
                    report.bytes_kept += size
                    continue
            except FileNotFoundError:  # another pruner was first: gone all the same
                pass
            except OSError as exc:
                report.skipped.append(f"{path}: {exc.strerror or exc}")
                if kind in ("chunk", "foreign"):
                    report.bytes_kept += size
                continue
        report.add(kind, size)
    return report


def _signed_by(path: Path, keys: FleetKeys, skipped: list[str]) -> bool | None:
    """Whether the chunk file at ``path`` names a key of ``keys`` as its signer (its MAC is not checked here).

    Reads its header records only, not mapped (a file truncated meanwhile
    cannot SIGBUS the pruner). A malformed file, or one that names no key,
    is not signed: a keyed engine refuses it. ``None``, with the reason
    appended to ``skipped``, when the file cannot be read (permissions, an
    I/O error, memory running out): that is no verdict on the file
    (:func:`~hurray_vllm.containers.io.read_error`), so it is not deleted as
    foreign. Read without moving its access time: this look is no use of the
    chunk, and a moved time would rank it freshest in the next prune.
    """
    from .store import read_header

    try:
        header = read_header(path, noatime=True)
    except OSError as exc:
        skipped.append(f"{path}: {exc.strerror or exc}")
        return None
    except HurrayFormatError:
        return False
    if header is None:
        return False
    try:
        key_id, _, _ = parse_mac(header.extra.get(MAC_KEY))
    except (HurrayFormatError, ValueError):
        return False
    return key_id in keys.ids


def _chunk_of(name: str) -> str:
    """The chunk a file belongs to: its key, without a tensor-parallel slice's ``.h<a>-<b>``."""
    return split_slice_key(name.removesuffix(".hrry"))[0]


def namespaces(root: Path, skipped: list[str]) -> list[Path]:
    """The store's namespace directories; a symbolic link among them is listed in ``skipped``, not followed.

    Why: prune deletes, and fsck moves, files in what it lists; a link to a
    directory outside the store would hand them files that are not chunks.
    """
    if not root.is_dir():
        return []
    try:
        entries = list(os.scandir(root))
    except OSError as exc:
        skipped.append(f"{root}: {exc.strerror or exc}")
        return []
    out = []
    for entry in entries:
        if not is_namespace_name(entry.name):
            continue  # not the store's (a namespace is hex digits): a directory given by mistake keeps it
        if entry.is_symlink():
            skipped.append(f"{entry.path}: a symbolic link, not followed")
        elif entry.is_dir(follow_symlinks=False):
            out.append(Path(entry.path))
    return sorted(out)
