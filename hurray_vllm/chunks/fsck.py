"""Checking a whole chunk store: every chunk file read and verified as a consumer would, damaged ones moved aside.

``hurray-vllm fsck DIR`` runs :func:`fsck`. A consumer verifies each chunk it
is about to load; this checks every file at once, for an operator after a
crash, a full disk or a copy, and can move the damaged ones aside
(``<name>.hrry.bad``) so that producers write them again.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import HurrayFormatError
from .digest import check_named_heads, digest_unverifiable
from .keys import is_chunk_name, namespace_of, split_slice_key
from .prune import namespaces
from .signing import FleetKeys, refusal_kind
from .verify import _check_geometry, _check_token_ids, check_data

if TYPE_CHECKING:
    from .store import DirectoryStore

__all__ = ["FsckReport", "fsck"]


@dataclass
class FsckReport:
    """What :func:`fsck` found: chunk files checked and good, the damaged ones with why, what it moved aside."""

    checked: int = 0
    good: int = 0
    #: ``(path, why)`` for every damaged chunk file.
    damaged: list[tuple[str, str]] = field(default_factory=list)
    #: The damaged files moved aside (``<name>.hrry.bad``), with ``quarantine``.
    moved: list[str] = field(default_factory=list)
    #: With keys: ``(path, why)`` for every chunk file that is unsigned or signed with a key not in the
    #: ring. Not damage (whoever holds that key may load it), never moved aside; this fleet refuses it.
    foreign: list[tuple[str, str]] = field(default_factory=list)
    #: Temporary files a writer left (``.*.tmp``): a write in progress, or one a crash cut short.
    temporary: int = 0
    #: ``(path, why)`` for every chunk file whose checksum cannot be checked here: no digest, an old or
    #: unknown one, or one that needs the native kernels. Consumers refuse them too, but leave them in
    #: place (a newer writer's file may be fine): so does fsck.
    unverified: list[tuple[str, str]] = field(default_factory=list)
    #: ``(path, why)`` for every chunk file, namespace directory or store directory that could not be read
    #: (permissions, I/O errors): its chunks were not checked, so the store is not :attr:`clean`. Not damage
    #: (nothing is moved aside): fix the permissions and run fsck again.
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    #: Paths fsck leaves alone, with the reason: symbolic links (not followed), directories and pipes at a
    #: chunk's name, files of a namespace directory whose names are not a chunk's (not the store's, as
    #: ``prune`` leaves them), a chunk that changed under every read (checked by the next run). No consumer
    #: reads them as chunks: they do not make the store unclean.
    skipped: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """Whether every chunk file was read and is good (and, with keys, signed by one of them)."""
        return not self.damaged and not self.foreign and not self.unverified and not self.unreadable


class _Unverified(Exception):
    """The chunk's checksum cannot be checked here (see :attr:`FsckReport.unverified`)."""


def _why(store: DirectoryStore, ns: str, name: str, keys: FleetKeys | None) -> str | None:
    """Why chunk file ``name`` of namespace ``ns`` is damaged, or ``None`` when a consumer would take it.

    Raises:
        HurrayFormatError: the chunk is unsigned or signed with another key (``keys`` only).
    """
    heads = split_slice_key(name)[1]
    try:
        # Its access time stays: a check is no use of the chunk, and prune ranks chunks by their last use.
        snap = store.get(ns, name, noatime=True)
    except HurrayFormatError as exc:
        return str(exc)
    if snap.fingerprint is None:
        return "snapshot.fingerprint: chunk carries no model fingerprint"
    if namespace_of(snap.fingerprint) != ns:
        return f"snapshot.fingerprint: a chunk of another model (namespace {namespace_of(snap.fingerprint)})"
    if snap.num_seqs != 1:
        return f"seq_lens: a chunk holds one sequence, this file {snap.num_seqs}"
    try:
        # The tokens its KV is of: a consumer checks them against its key, and refuses a file without them.
        _check_token_ids(snap, snap.seq_lens[0])
        check_named_heads(snap, heads)
        # The pools against the file's own fingerprint (the directory's model): every consumer refuses a chunk
        # whose pools disagree with it, and no producer writes over it (the key exists), so it is damage here.
        _check_geometry(snap, snap.fingerprint, heads)
        check_data(snap, keys, ns, name)  # raises for a missing or unknown digest too
    except HurrayFormatError as exc:
        if refusal_kind(exc) in ("unsigned", "other_key"):
            raise
        if digest_unverifiable(exc):  # the consumers' rule: no damage, left in place
            raise _Unverified(str(exc)) from None
        return str(exc)
    return None


def _not_a_file(path: Path) -> str | None:
    """Why the entry at a chunk's name ``path`` is not checked (not a regular file), or ``None`` if it is gone.

    Consumers never read such an entry (a link is not followed, a pipe is
    refused), so it is not damage, and fsck neither follows nor moves it.

    Raises:
        OSError: the entry cannot be looked at (permissions): unreadable, not a verdict on it.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link, not followed"
    if stat.S_ISDIR(mode):
        return "a directory, not a chunk file"
    if not stat.S_ISREG(mode):
        return "not a regular file (a pipe, socket or device), not read"
    return None  # a regular file again: one renamed over the name meanwhile, checked by the next run


def fsck(store: DirectoryStore, *, quarantine: bool = False, keys: FleetKeys | None = None) -> FsckReport:
    """Read and verify every chunk file of ``store``, as a consumer would; optionally move the damaged ones aside.

    Checks each ``<namespace>/<name>.hrry`` named as a chunk: that it parses (the
    spec's rules, the container's CRCs), that its model's namespace is the
    directory it is in, that it holds one sequence and its token ids, and
    the KV heads its name says, that its pools are what its fingerprint
    says (layers, heads, head size, dtype; no quantization: consumers refuse
    it otherwise, and no producer writes over it), and its checksum, or with ``keys`` its MAC (a
    wrong one is damage; an unsigned chunk, or one signed with a key not in
    ``keys``, is listed in ``foreign`` and left in place). What it cannot check without the chunks before
    it: that its key is the hash of its prefix (a consumer checks the tokens).
    Safe while engines use the store: a file is moved aside only if it is
    still the one found damaged. Reads leave the files' access times as they
    were (``O_NOATIME``, where the files are this user's): ``prune`` ranks
    chunks by their last use, and a check is none.

    A file that could not be read (permissions), or a namespace directory that
    could not be listed, is listed in ``unreadable`` and the store is not clean.
    A file whose name is not a chunk's is not the store's: listed in ``skipped``
    and left alone, as ``prune`` leaves it. A chunk that changed while it was
    read (a prune holding it aside, a producer writing it again) is read again,
    not called damaged.

    Example:
        >>> from hurray_vllm.chunks.store import DirectoryStore
        >>> fsck(DirectoryStore("/nonexistent/store")).clean
        True
    """
    report = FsckReport()
    root = Path(store.root)
    listed: list[str] = []
    ns_dirs = namespaces(root, listed)
    # namespaces() lists a symbolic link among them (skipped) and, as "<root>: why", a root it cannot read.
    for entry in listed:
        if entry.startswith(f"{root}: "):
            report.unreadable.append((str(root), entry.removeprefix(f"{root}: ")))
        else:
            report.skipped.append(entry)
    for ns_dir in ns_dirs:
        try:
            names = sorted(os.listdir(ns_dir))
        except OSError as exc:  # its chunks cannot be checked: not clean
            report.unreadable.append((str(ns_dir), exc.strerror or str(exc)))
            continue
        for file in names:
            if file.startswith(".") and file.endswith(".tmp"):
                report.temporary += 1
                continue
            if file.endswith(".hrry.bad") and is_chunk_name(file.removesuffix(".hrry.bad")):
                continue  # moved aside before: the store's, and prune deletes it
            name, ns = file.removesuffix(".hrry"), ns_dir.name
            if not file.endswith(".hrry") or not is_chunk_name(name):
                # Not the store's (an operator's notes, whatever the suffix): never read, never moved, but listed.
                report.skipped.append(
                    f"{ns_dir / file}: not a chunk's name (a key is hex digits, with .h<a>-<b> for a slice), "
                    "not the store's: left alone"
                )
                continue
            _check_one(store, ns, name, ns_dir / file, keys, quarantine, report)
    return report


def _check_one(
    store: DirectoryStore,
    ns: str,
    name: str,
    path: Path,
    keys: FleetKeys | None,
    quarantine: bool,
    report: FsckReport,
) -> None:
    """Check chunk file ``name`` of ``ns`` (at ``path``) into ``report``; quarantine it if damaged and asked to."""
    for _ in range(2):  # a file that changed while it was read is read once more: the new file's verdict
        identity = store.identity(ns, name)
        if identity is None:
            try:
                odd = _not_a_file(path)
            except OSError as exc:
                report.unreadable.append((str(path), exc.strerror or str(exc)))
                return
            if odd is not None:  # nothing a consumer loads, but an operator should hear of it
                report.skipped.append(f"{path}: {odd}")
            return  # else gone meanwhile (pruned)
        try:
            why = _why(store, ns, name, keys)
        except OSError as exc:  # unreadable (permissions): not a verdict on its bytes, but not clean either
            report.unreadable.append((str(path), exc.strerror or str(exc)))
            return
        except HurrayFormatError as exc:  # unsigned, or another fleet's
            report.checked += 1
            report.foreign.append((str(path), str(exc)))
            return
        except _Unverified as exc:
            report.checked += 1
            report.unverified.append((str(path), str(exc)))
            return
        # The read's failure says something about the file only if it is still the one looked at before: a
        # prune holding it aside (and putting it back: the same inode, a new change time), or a producer
        # renaming a new file over it, makes a read find no file or another's bytes.
        if why is None or store.identity(ns, name) == identity:
            break
    else:
        if store.identity(ns, name) is not None:
            report.skipped.append(f"{path}: changed while it was read, twice: not judged (run fsck again)")
        return  # else pruned while it was read
    report.checked += 1
    if why is None:
        report.good += 1
        return
    report.damaged.append((str(path), why))
    if quarantine:
        moved = store.quarantine(ns, name, identity)
        if moved is not None:
            report.moved.append(str(moved))
