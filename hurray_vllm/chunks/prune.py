"""Store cleanup: least recently used chunks (prefixes from their ends), damaged files and stale temporary files."""

from __future__ import annotations

import os
import re
import secrets
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import HurrayArgumentError, HurrayFormatError, integer_arg
from .digest import MAC_KEY
from .keys import CHUNK_NAME, PARENT_KEY, is_chunk_name, is_namespace_name, split_slice_key
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
    #: With keys: chunk files no key of the ring signed (unsigned, another fleet's, unreadable), deleted whatever
    #: the size.
    foreign_removed: int = 0
    bad_removed: int = 0
    temp_removed: int = 0
    bytes_removed: int = 0
    #: Paths that could not be read, deleted (permissions) or followed (a symbolic link), with the reason: pruning
    #: went on without them.
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


#: A chunk in the store: its namespace directory and its key (a tensor-parallel chunk's files share it).
_Node = tuple[Path, str]
#: A chunk file as prune judges it: ``(last use, size, path)``.
_File = tuple[float, int, Path]


def prune(
    store: DirectoryStore,
    max_bytes: int,
    *,
    stale_temp_s: float = 3600.0,
    dry_run: bool = False,
    keys: FleetKeys | None = None,
) -> PruneReport:
    """Delete the least recently used chunks until the store holds at most ``max_bytes``, prefixes from their ends.

    Also deletes damaged files moved aside (``*.hrry.bad``) and temporary
    files older than ``stale_temp_s`` seconds (left by writers that died
    mid-write). "Used" is the later of a file's access and modification
    times: with Linux's default ``relatime`` mount option the access time
    moves at most once a day, with ``noatime`` never, and pruning is then
    oldest-written first. Its own reads (and ``fsck``'s) leave access times
    as they were (``O_NOATIME``) where the store's files are this user's.

    What is kept loads. A consumer walks a prompt's chunks in order and
    stops at the first one missing, and producers write and consumers read
    a prefix's chunks in order too, so by its file times alone a prefix's
    first chunk is its least recently used. Each chunk names its parent, the
    chunk before it in its prefix (:data:`~.keys.PARENT_KEY`, in its header;
    a prompt tail's parent is its last whole chunk), so prune ranks a chunk
    by the latest use of it or of any chunk after it, and of chunks so
    ranked the later in a prefix goes first: a chunk is never deleted while
    a chunk naming it as parent is kept (nor when deleting one after it
    failed: a file it could not delete, or one written again since it looked).
    A prefix thus loses its end first, and a head chunk shared by several
    prompts (a system prompt) stays as long as any of them does. A file
    that names no parent (a writer from before parents were recorded, a
    sequence's first chunk), or a parent that is not stored, is ranked by
    its own use; a parent is only a ranking hint, read without checking the
    file (``fsck`` does that). Reading the parents costs one bounded header
    read per chunk file (:func:`~.store.read_header`), made only when
    something is to be deleted or with ``keys``.

    A tensor-parallel chunk (a file per slice of its heads) is kept or
    deleted whole, ranked by its most recently used file; when one of its
    files stays (as above), its files not yet deleted stay with it. Safe while
    engines use the store: a chunk deleted under an engine that mapped it
    stays readable for that engine, and later lookups miss it.
    ``dry_run`` only reports. With ``keys``, chunks that no key of the ring
    signed (unsigned, another fleet's, or unreadable: what a keyed engine
    would refuse) are deleted first, whatever the size; only the key id a
    file names is read, not its MAC checked (``fsck`` does that). A file
    whose header cannot be read (permissions, I/O errors) is no verdict on
    it: it is not deleted as foreign, it is ranked by its own use, and it
    counts toward ``max_bytes``; with ``keys`` it is listed in
    ``report.skipped``. Bytes are file sizes. A namespace or file that
    cannot be read or deleted (permissions, I/O errors), and a symbolic link
    at a namespace's or a chunk's name (never followed), is listed in
    ``report.skipped``, left in place, and the rest is pruned.

    Raises:
        HurrayArgumentError: ``max_bytes`` that is not an integer ``>= 0``
            (a float, nan included, a string, a bool), or ``stale_temp_s``
            under :data:`MIN_STALE_TEMP_S`.
    """
    # nan compared false with every total and deleted nothing; a string failed with a bare TypeError.
    max_bytes = integer_arg(max_bytes, "max_bytes", 0)
    if not stale_temp_s >= MIN_STALE_TEMP_S:
        raise HurrayArgumentError(
            "stale_temp_s",
            f"must be at least {MIN_STALE_TEMP_S:g} s, got {stale_temp_s}: a younger temporary file may belong to a "
            "writer that is still writing it",
        )
    now = time.time()
    files: dict[_Node, list[_File]] = {}
    doomed: list[tuple[str, int, Path, _Node | None]] = []
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
                doomed.append(("bad", st.st_size, Path(entry.path), None))
            elif (temp := _TEMP.fullmatch(name)) is not None and is_chunk_name(temp.group(1)):
                if now - st.st_mtime > stale_temp_s:
                    doomed.append(("temp", st.st_size, Path(entry.path), None))
            elif name.endswith(".hrry") and is_chunk_name(name.removesuffix(".hrry")) and stat.S_ISLNK(st.st_mode):
                # Neither read nor deleted (as fsck leaves it), but listed: the docs say so, and it exits 1.
                skipped.append(f"{entry.path}: a symbolic link, not followed")
            elif (
                name.endswith(".hrry")
                and is_chunk_name(name.removesuffix(".hrry"))
                and entry.is_file(follow_symlinks=False)
            ):
                judged[Path(entry.path)] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                # A tensor-parallel chunk is several files (<key>.h<a>-<b>.hrry): it goes, or stays, whole, by
                # its most recent use; a lone slice would be kept bytes that can never load.
                files.setdefault((ns, _chunk_of(name)), []).append(
                    (max(st.st_atime, st.st_mtime), st.st_size, Path(entry.path))
                )
    foreign = 0
    parents: dict[_Node, str | None] = {}
    if keys is not None:
        # File by file: a chunk's files may come from engines of several TP degrees (the whole file and
        # slices), and an unsigned slice beside a signed whole file takes only itself away.
        ours: dict[_Node, list[_File]] = {}
        for node, group in files.items():
            # None: the file could not be read (listed in skipped), which says nothing about it: it stays.
            looks = [_look(path, keys, skipped) for _, _, path in group]
            doomed.extend(
                ("foreign", size, path, None)
                for (_, size, path), (ok, _) in zip(group, looks, strict=True)
                if ok is False
            )
            foreign += sum(ok is False for ok, _ in looks)
            # An unreadable file is kept, and so counted toward max_bytes (deleting it by size needs no read).
            kept = [f for f, (ok, _) in zip(group, looks, strict=True) if ok is not False]
            if kept:
                ours[node] = kept
                parents[node] = _one_parent(parent for ok, parent in looks if ok is not False)
        files = ours
    total = sum(size for group in files.values() for _, size, _ in group)
    ranked: list[_Node] = []
    link: dict[_Node, _Node] = {}
    if total > max_bytes:  # parents rank what is deleted: neither read nor ranked when nothing is
        if keys is None:
            for node, group in files.items():
                parents[node] = _one_parent(_look(path, None, skipped)[1] for _, _, path in group)
        ranked, link = _ranked(files, parents)
    for node in ranked:
        if total <= max_bytes:
            break
        doomed.extend(("chunk", file_size, path, node) for _, file_size, path in files[node])
        total -= sum(size for _, size, _ in files[node])
    files_kept = sum(len(group) for group in files.values()) + foreign
    report = PruneReport(dry_run=dry_run, bytes_kept=total, chunks_kept=files_kept, skipped=skipped)
    #: Chunks left in place (one of their files was) and the chunks before them: deleting the rest of a chunk's
    #: files would leave a lone slice that can never load, and deleting the chunks before it, an unreachable chunk.
    pinned: set[_Node] = set()
    for kind, size, path, chunk in doomed:
        if chunk is not None and chunk in pinned:
            report.bytes_kept += size
            continue
        if not dry_run:
            try:
                if kind not in ("chunk", "foreign"):
                    path.unlink()
                elif not take_if_same(path, judged[path], None):
                    # Written again since the scan (a producer's rename): a fresh file, not the one judged.
                    report.bytes_kept += size
                    _pin(chunk, link, pinned)
                    continue
            except FileNotFoundError:  # another pruner was first: gone all the same
                pass
            except OSError as exc:
                report.skipped.append(f"{path}: {exc.strerror or exc}")
                if kind in ("chunk", "foreign"):
                    report.bytes_kept += size
                    _pin(chunk, link, pinned)
                continue
        report.add(kind, size)
    return report


def _ranked(
    files: dict[_Node, list[_File]], parents: dict[_Node, str | None]
) -> tuple[list[_Node], dict[_Node, _Node]]:
    """The chunks of ``files`` in the order prune deletes them, and the parent links it followed.

    A chunk's rank is the latest use of it or of any chunk below it (its
    children's ranks), then the deeper in its prefix first, then the
    smaller: a chunk always comes after every chunk naming it as parent.
    Only links to a chunk in ``files`` of the same namespace count; a cycle
    (crafted or corrupt parents) is cut where it is found.
    """
    link = {
        node: (node[0], parent)
        for node, parent in parents.items()
        if parent is not None and parent != node[1] and (node[0], parent) in files
    }
    depth: dict[_Node, int] = {}
    for start in sorted(files):
        path: list[_Node] = []
        on_path: set[_Node] = set()
        node = start
        while node not in depth:
            up = link.get(node)
            if node in on_path:  # back where this walk went through: a cycle, cut here
                del link[node]
                depth[node] = 0
                break
            if up is None:
                depth[node] = 0
                break
            on_path.add(node)
            path.append(node)
            node = up
        for node in reversed(path):
            if node not in depth:
                depth[node] = depth[link[node]] + 1
    used = {node: max(t for t, _, _ in group) for node, group in files.items()}
    size = {node: sum(s for _, s, _ in group) for node, group in files.items()}
    for node in sorted(files, key=depth.__getitem__, reverse=True):  # children before their parent
        up = link.get(node)
        if up is not None and used[node] > used[up]:
            used[up] = used[node]
    return sorted(files, key=lambda n: (used[n], -depth[n], size[n])), link


def _pin(node: _Node | None, link: dict[_Node, _Node], pinned: set[_Node]) -> None:
    """Keep ``node``'s other files and every chunk before it in its prefix (``node`` stays, at least in part).

    Its other files: a tensor-parallel chunk is kept or deleted whole, so deleting stops at its first file that
    stays. The chunks before it: deleting them would strand it.
    """
    if node is None:
        return
    pinned.add(node)
    up = link.get(node)
    while up is not None and up not in pinned:
        pinned.add(up)
        up = link.get(up)


def _one_parent(parents: Iterable[str | None]) -> str | None:
    """The parent a chunk's files name (slices of one chunk name the same); ``None`` if none, or they disagree."""
    named = {p for p in parents if p is not None}
    return named.pop() if len(named) == 1 else None


def _look(path: Path, keys: FleetKeys | None, skipped: list[str]) -> tuple[bool | None, str | None]:
    """``(signed, parent)`` of the chunk file at ``path``: one read of its header records.

    ``signed``: whether it names a key of ``keys`` as its signer (its MAC is
    not checked here); ``None`` without ``keys``. ``parent``: the key it
    names as its parent (:data:`~.keys.PARENT_KEY`), if it names one that
    can be a key.

    Reads its header records only, not mapped (a file truncated meanwhile
    cannot SIGBUS the pruner). A malformed file, or one that names no key,
    is not signed: a keyed engine refuses it. ``(None, None)``, with the
    reason appended to ``skipped`` where ``keys`` are given, when the file
    cannot be read (permissions, an I/O error, memory running out): that is
    no verdict on the file (:func:`~hurray_vllm.containers.io.read_error`),
    so it is not deleted as foreign. Read without moving its access time:
    this look is no use of the chunk, and a moved time would rank it
    freshest in the next prune.
    """
    from . import store

    try:
        header = store.read_header(path, noatime=True)
    except FileNotFoundError:  # deleted since the scan (another pruner): nothing to skip, nothing to judge
        return None, None
    except OSError as exc:
        if keys is not None:
            skipped.append(f"{path}: {exc.strerror or exc}")
        return None, None
    except HurrayFormatError:
        return (False if keys is not None else None), None
    if header is None:
        return (False if keys is not None else None), None
    parent = header.extra.get(PARENT_KEY)
    if not isinstance(parent, str) or CHUNK_NAME.fullmatch(parent) is None:
        parent = None
    if keys is None:
        return None, parent
    try:
        key_id, _, _ = parse_mac(header.extra.get(MAC_KEY))
    except (HurrayFormatError, ValueError):
        return False, parent
    return key_id in keys.ids, parent


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
