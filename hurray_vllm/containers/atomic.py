"""Files that appear whole or not at all: one temp-file-and-rename helper for every writer.

Every container writer (``save`` in each format, ``hurray-vllm convert``,
the chunk store) goes through :func:`atomic_path`, so they agree on what a
reader can see and on the file's permissions:

* the data goes to a uniquely named temporary file (``.<name>.<random>.tmp``)
  in the target's directory, then is renamed over the target: a reader sees
  the old file, or the new one complete, never a part;
* the file gets the mode ``open()`` would give it (``0666`` less the umask),
  not ``mkstemp``'s ``0600``: the target may be shared with other users'
  engines, and the umask is the operator's way to say otherwise (the
  kernel applies it as the file is created: reading the umask would set
  it, for every thread of the process, for a moment);
* ``follow_symlinks=False`` (the chunk store) replaces a symbolic link at
  the target's name with the file; by default (``convert``, ``save``) the
  link's target is replaced, as ``open()`` would write through it;
* ``fsync=True`` (the default) flushes the data, then the directory entry,
  so the file survives a power loss once the call returns; the chunk store
  passes ``False`` because every reader verifies a checksum and recomputes
  a torn chunk;
* on any error, the temporary file is removed and the target is untouched.

``hurray-vllm prune`` deletes temporary files older than an hour, left by
writers that died mid-write: they match ``.*.tmp``.
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


def _create_temp(target: Path) -> Path:
    """A new, empty temporary file beside ``target``, created with the mode ``open()`` gives (0666 less the umask)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:  # another writer's name: draw again
            continue
        except OSError as exc:  # name the directory the user gave, not the temporary name
            raise OSError(exc.errno, exc.strerror, os.fspath(target.parent)) from None
        os.close(fd)
        return tmp
    raise FileExistsError(errno.EEXIST, "no free temporary file name", os.fspath(target.parent))


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


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, fsync: bool = True, follow_symlinks: bool = True) -> Iterator[Path]:
    """A temporary path to write; renamed to ``path`` when the block ends without an error.

    For writers that take a file name (safetensors' ``save_file``). The
    temporary file exists (empty) when the block starts.

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
    target = Path(path)
    try:
        # Through a symlink by default: its target is what is replaced.
        mode = os.stat(target, follow_symlinks=follow_symlinks).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISLNK(mode):
        # Renaming over a directory fails late; over /dev/stdout or a FIFO it would replace the device entry.
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory (give a file path to write)", os.fspath(path))
        raise OSError(errno.EINVAL, "not a regular file (a device, pipe or socket): give a file path", os.fspath(path))
    if follow_symlinks and target.is_symlink():
        target = Path(os.path.realpath(target))
    directory = target.parent
    tmp = _create_temp(target)
    try:
        mode = stat.S_IMODE(os.stat(tmp).st_mode)  # what the kernel gave it, from the umask
        yield tmp
        if stat.S_IMODE(os.stat(tmp).st_mode) != mode:  # a writer that made its own file (safetensors: 0600)
            os.chmod(tmp, mode)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(directory)


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike[str], *, fsync: bool = True, follow_symlinks: bool = True
) -> Iterator[BinaryIO]:
    """A binary file to write; it replaces ``path`` when the block ends without an error.

    Args:
        path: The file to create or replace.
        fsync: Flush the data and the directory entry to disk before returning.
        follow_symlinks: As for :func:`atomic_path`.

    Example:
        >>> import pathlib, tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> with atomic_file(d / "x.bin") as f:
        ...     _ = f.write(b"whole")
        >>> (d / "x.bin").read_bytes()
        b'whole'
    """
    with atomic_path(path, fsync=False, follow_symlinks=follow_symlinks) as tmp:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    if fsync:
        _fsync_dir(Path(path).parent)
