"""Files that appear whole or not at all: one temp-file-and-rename helper for every writer.

Every container writer (``save`` in each format, ``hurray-vllm convert``,
the chunk store) goes through :func:`atomic_path`, so they agree on what a
reader can see and on the file's permissions:

* the data goes to a uniquely named temporary file (``.<name>.<random>.tmp``)
  in the target's directory, then is renamed over the target: a reader sees
  the old file, or the new one complete, never a part;
* a new file gets the mode ``open()`` would give it (``0666`` less the umask),
  not ``mkstemp``'s ``0600``: the target may be shared with other users'
  engines, and the umask is the operator's way to say otherwise (the
  kernel applies it as the file is created: reading the umask would set
  it, for every thread of the process, for a moment);
* a file that replaces a regular file keeps that file's mode, and its owner
  and group where the process may set them, as ``open(path, "wb")`` would
  keep them: a private (``0600``) file must not come back world-readable.
  The temporary file has them before any data is written to it;
* ``follow_symlinks=False`` (the chunk store) replaces a symbolic link at
  the target's name with the file; by default (``convert``, ``save``) the
  link's target is replaced, as ``open()`` would write through it;
* ``fsync=True`` (the default) flushes the data, then the directory entry,
  so the file survives a power loss once the call returns; the chunk store
  passes ``False`` because every reader verifies a checksum and recomputes
  a torn chunk;
* ``replace=False`` (the chunk store's put) lands the file only where no
  regular file is: it is published as a hard link to the temporary file,
  which fails if another writer's file appeared after any check (a rename
  would replace it), and the temporary name is removed after;
* on any error, the temporary file is removed and the target is untouched.

``hurray-vllm prune`` deletes temporary files older than an hour, left by
writers that died mid-write: they match ``.*.tmp``. (One left between a
``replace=False`` file's link and the unlink of its temporary name is a
second name of the published file: deleting it takes nothing from it.)
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_path", "atomic_file"]


def _create_temp(target: Path, like: os.stat_result | None = None) -> tuple[Path, int, os.stat_result]:
    """A new, empty temporary file beside ``target``, and the descriptor that created it, open for writing.

    The data goes through that descriptor (:func:`atomic_file`), or the file is left owner-writable until
    it is complete (:func:`atomic_path`, whose writer opens it by name): under a umask such as ``0o222`` the
    kernel creates the file read-only, as ``open()`` would, and a second ``open`` for writing is refused.

    Args:
        target: The file the temporary file will be renamed to.
        like: The regular file it replaces: the temporary file gets its mode, and its owner and group where
            this process may set them. ``None``: the mode ``open()`` gives (0666 less the umask).

    Returns:
        The temporary file's path; a descriptor open for writing on it (the caller closes it); and whose
        mode, owner and group it must have once written (``like``, or what the kernel gave it).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
        try:
            # Owner-only until it has the replaced file's owner and mode: never wider than that file, even briefly.
            fd = os.open(tmp, flags, 0o600 if like is not None else 0o666)
        except FileExistsError:  # another writer's name: draw again
            continue
        except OSError as exc:  # name the directory the user gave, not the temporary name
            raise OSError(exc.errno, exc.strerror, os.fspath(target.parent)) from None
        try:
            # What the file lands with: the replaced file's owner and mode, or what the kernel gave a new one (umask).
            final = like if like is not None else os.fstat(fd)
            # Writable by its owner while it is written (a read-only target, or a umask without the owner's write
            # bit, would refuse a writer that opens it by name), never wider than ``final`` for anyone else: it
            # gets ``final``'s exact mode at the end.
            writing = stat.S_IMODE(final.st_mode) | stat.S_IRUSR | stat.S_IWUSR
            if like is not None or writing != stat.S_IMODE(final.st_mode):
                _keep_owner_and_mode(fd if os.chmod in os.supports_fd else tmp, final, writing)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return tmp, fd, final
    raise FileExistsError(errno.EEXIST, "no free temporary file name", os.fspath(target.parent))


def _keep_owner_and_mode(file: int | Path, like: os.stat_result, mode: int | None = None) -> None:
    """Give ``file`` (a descriptor or a path) the owner and group of ``like``, as far as allowed, and its mode.

    The owner first: changing it may clear the set-user-ID and set-group-ID bits, which the mode then
    restores. An owner or group this process may not give (``EPERM``: another user's file) stays its own.

    Args:
        file: A descriptor, or a path (not followed if a link: the temporary files are created ``O_NOFOLLOW``).
        like: Whose owner, group and mode to copy.
        mode: The permission bits to give instead of ``like``'s.
    """
    if hasattr(os, "chown"):
        try:
            os.chown(file, like.st_uid, like.st_gid)
        except PermissionError:  # another user's file: its group may still be one of this process's
            with contextlib.suppress(PermissionError):
                os.chown(file, -1, like.st_gid)
    os.chmod(file, stat.S_IMODE(like.st_mode) if mode is None else mode)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a directory that cannot be opened (some platforms): the data is synced already
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _target(path: str | os.PathLike[str], follow_symlinks: bool) -> tuple[Path, os.stat_result | None]:
    """The file to replace (through a symbolic link where ``follow_symlinks``), and the regular file it is now."""
    target = Path(path)
    try:
        # Through a symlink by default: its target is what is replaced.
        old: os.stat_result | None = os.stat(target, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        old = None
    mode = old.st_mode if old is not None else None
    if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISLNK(mode):
        # Renaming over a directory fails late; over /dev/stdout or a FIFO it would replace the device entry.
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory (give a file path to write)", os.fspath(path))
        raise OSError(errno.EINVAL, "not a regular file (a device, pipe or socket): give a file path", os.fspath(path))
    if follow_symlinks and target.is_symlink():
        target = Path(os.path.realpath(target))
    # A link replaced itself (follow_symlinks=False) has no mode worth keeping: the file gets the umask's.
    return target, old if old is not None and stat.S_ISREG(old.st_mode) else None


def _settle(file: int | Path, final: os.stat_result) -> None:
    """Give ``file`` (a descriptor or the temporary path) ``final``'s mode, owner and group, if it has others yet.

    Not yet final: owner-writable while written, or a writer that made its own file (safetensors: 0600).
    """
    now = os.stat(file)
    if (stat.S_IMODE(now.st_mode), now.st_uid, now.st_gid) != (
        stat.S_IMODE(final.st_mode),
        final.st_uid,
        final.st_gid,
    ):
        _keep_owner_and_mode(file, final)


def _fsync_path(tmp: Path) -> None:
    """Flush the file at ``tmp`` (written by a writer that opened it by name) to disk."""
    cloexec = getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(tmp, os.O_WRONLY | cloexec)  # no O_TRUNC: the data stays
    except PermissionError:  # a writer that made its own read-only file: Linux syncs through any descriptor
        fd = os.open(tmp, os.O_RDONLY | cloexec)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: What ``os.link`` raises where the file system has no hard links (FAT: ``EPERM``; some FUSE and network file
#: systems: ``ENOTSUP``/``EOPNOTSUPP``/``ENOSYS``), or will not make this one (``EXDEV``, ``EMLINK``).
_NO_HARD_LINK = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV, errno.EMLINK})


def _is_regular(path: Path) -> bool:
    """Whether a regular file is at ``path`` (a symbolic link is not followed)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _exists_error(target: Path) -> FileExistsError:
    return FileExistsError(errno.EEXIST, "a file is there already (written meanwhile), not replaced", os.fspath(target))


def _publish(tmp: Path, target: Path, replace: bool) -> None:
    """Give the complete temporary file ``tmp`` the name ``target``; ``replace=False``: only where no file is.

    Raises:
        FileExistsError: ``replace=False`` and a regular file is at ``target`` (``filename``: ``target``);
            ``tmp`` is left for the caller to remove.
    """
    if replace:
        os.replace(tmp, target)
        return
    try:
        # Unlike a rename, a link fails if the name is taken: a file another writer landed after our check stays.
        os.link(tmp, target)
    except FileExistsError:
        if _is_regular(target):
            raise _exists_error(target) from None
        os.replace(tmp, target)  # a symbolic link (follow_symlinks=False): no file to keep, replaced as before
        return
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINK:
            raise
        # No hard links here: a rename after a last look, which a file landing in between is lost to.
        if _is_regular(target):
            raise _exists_error(target) from None
        os.replace(tmp, target)
        return
    # Published: the temporary name is a second name of the file now. Left behind (a crash, or an unlink that
    # fails), it is a stale temporary file, which prune deletes without taking anything from the target.
    with contextlib.suppress(OSError):
        os.unlink(tmp)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, fsync: bool = True, follow_symlinks: bool = True) -> Iterator[Path]:
    """A temporary path to write; renamed to ``path`` when the block ends without an error.

    For writers that take a file name (safetensors' ``save_file``). The
    temporary file exists (empty) when the block starts, writable by its
    owner; it lands with the mode (and, where allowed, the owner) of the
    regular file it replaces, else the mode ``open()`` gives a new file.

    Args:
        path: The file to create or replace.
        fsync: Flush the data and the directory entry to disk before returning.
        follow_symlinks: A symbolic link at ``path``: replace the file it points to
            (the default), or the link itself (``False``: the chunk store, where a
            link someone else planted must not send a write outside the store).

    Example:
        >>> import pathlib, tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> with atomic_path(d / "x.bin") as tmp:
        ...     _ = tmp.write_bytes(b"whole")
        >>> (d / "x.bin").read_bytes()
        b'whole'
    """
    target, like = _target(path, follow_symlinks)
    tmp, fd, final = _create_temp(target, like)
    os.close(fd)  # the writer opens it by name: it is owner-writable until it is complete
    try:
        yield tmp
        if fsync:
            _fsync_path(tmp)
        _settle(tmp, final)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike[str], *, fsync: bool = True, follow_symlinks: bool = True, replace: bool = True
) -> Iterator[BinaryIO]:
    """A binary file to write; it replaces ``path`` when the block ends without an error.

    The data goes through the descriptor that created the temporary file, never a second ``open``
    of it: under a umask such as ``0o222`` the file is created read-only, as ``open()`` would create
    it, and lands so.

    Args:
        path: The file to create or replace.
        fsync: Flush the data and the directory entry to disk before returning.
        follow_symlinks: As for :func:`atomic_path`.
        replace: Replace a regular file at ``path`` (the default), or land only where none is (``False``:
            the chunk store's put, where a copy another writer stored meanwhile, perhaps holding more, must
            stay). Checked before the temporary file is made, and again atomically as the file lands (a hard
            link, which fails where a name is taken; where the file system has no hard links, a last look
            and a rename). A symbolic link at ``path`` (with ``follow_symlinks=False``) is replaced either way.

    Raises:
        FileExistsError: ``replace=False`` and a regular file is at ``path`` (``filename``: the file); nothing
            is written, no temporary file is left.

    Example:
        >>> import pathlib, tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> with atomic_file(d / "x.bin") as f:
        ...     _ = f.write(b"whole")
        >>> (d / "x.bin").read_bytes()
        b'whole'
    """
    # Syncs the data and then the directory the file was renamed into: through a symbolic link, that is the
    # link target's directory, not the link's.
    target, like = _target(path, follow_symlinks)
    if not replace and like is not None:  # a file there already: not worth writing one that cannot land
        raise _exists_error(target)
    tmp, fd, final = _create_temp(target, like)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(fd)
            _settle(fd if os.chmod in os.supports_fd else tmp, final)
        _publish(tmp, target, replace)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(target.parent)
