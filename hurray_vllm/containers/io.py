"""The public entry points: save, load, write_stream, read_stream.

Modelled on safetensors: plain data in and out, one exception type
(:class:`HurrayFormatError`) for bad input.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable, Iterator
from io import BytesIO, TextIOBase
from pathlib import Path
from typing import Any, BinaryIO, Literal, NoReturn, get_args

from ..errors import HurrayArgumentError, HurrayFormatError, integer_arg
from ..kv.snapshot import KVSnapshot
from ..wire.rules import raise_if
from .atomic import atomic_file
from .digest import check_digest
from .hrryfile import FILE_MAGIC, FileBytes, HrryFile, open_regular, read_whole, write_file
from .schema import Node, Record, assemble_snapshot, group_records, header_records, snapshot_records, state_records
from .stream import LayerWriter, read_records, write_records
from .template import load_hrry

__all__ = [
    "SUFFIX_FORMATS",
    "Format",
    "save",
    "load",
    "load_file_bytes",
    "read_file",
    "FileBytes",
    "save_records",
    "open_records",
    "iter_nodes",
    "file_kv",
    "write_stream",
    "read_stream",
    "detect_format",
    "read_error",
]

Format = Literal["hrry", "stream", "safetensors"]
_FORMATS: tuple[Format, ...] = get_args(Format)

#: What a parsing bug on malformed input surfaces as (the readers' own checks raise HurrayFormatError first).
PARSE_ERRORS = (
    ValueError,
    TypeError,
    OverflowError,
    IndexError,
    KeyError,
    AttributeError,
    RecursionError,
    RuntimeError,
)


def _reraise(exc: BaseException, what: str) -> NoReturn:
    """Raise :func:`read_error` of ``exc``, chained to it."""
    raise read_error(exc, what) from exc


def read_error(exc: BaseException, what: str) -> OSError | HurrayFormatError:
    """What the readers' boundary makes of ``exc`` (one of :data:`PARSE_ERRORS`, ``MemoryError``, or a library's own).

    An allocation that failed is ``OSError(ENOMEM)``: the machine's state, not
    the input's. A reader must not call a good file malformed because memory
    ran out while it read it; a connector moves malformed chunk files aside,
    and only data errors may do that (an ``OSError`` refuses the chunk and
    leaves it). Anything else is :func:`as_format_error`'s.
    """
    text = str(exc).lower()
    if (
        isinstance(exc, MemoryError)
        or _library_enomem(exc, text)
        or (isinstance(exc, RuntimeError) and "alloc" in text and "memory" in text)
    ):
        return OSError(errno.ENOMEM, f"{what}: out of memory while reading it ({type(exc).__name__}: {exc})")
    return as_format_error(exc, what)


def _library_enomem(exc: BaseException, text: str) -> bool:
    """Whether ``exc`` is a library's own error type (safetensors') for the OS's ENOMEM.

    A Rust library reports it as ``io::Error`` shows it, ``"... (os error 12)"``,
    at the end of its message. Only there, and only in a library's own type: a
    parser's message may quote the input (a safetensors header's ``dtype`` of
    ``"(os error 12)"`` is quoted mid-message), and input must never pass for
    the machine's state.
    """
    return type(exc).__module__ != "builtins" and re.search(rf"\(os error {errno.ENOMEM}\)\s*$", text) is not None


def as_format_error(exc: BaseException, what: str) -> HurrayFormatError:
    """``exc``, raised while reading input, as the one error type bad input gets.

    The readers check what they read and raise :class:`HurrayFormatError`
    themselves; this is the boundary's guarantee for a case they missed: a
    ``TypeError`` from deep inside a library must not reach a caller that
    was promised one error type (nor kill a receiver's thread).
    """
    if isinstance(exc, HurrayFormatError) and not isinstance(exc, HurrayArgumentError):
        return exc
    return HurrayFormatError("input", f"{what}: malformed input ({type(exc).__name__}: {exc})")


#: The format each file suffix is written in (``save``, and ``hurray-vllm convert``'s output).
SUFFIX_FORMATS: dict[str, Format] = {".hrry": "hrry", ".hrrs": "stream", ".safetensors": "safetensors"}
#: The key-value metadata every ``.hrry`` file :func:`save` writes carries.
_FILE_KV = {"hurray_vllm.format_version": 1}


def detect_format(path: str | os.PathLike[str]) -> Format:
    """``"hrry"``, ``"stream"`` or ``"safetensors"`` by the file's magic bytes, not its name.

    Only a regular file is read (:func:`~.hrryfile.open_regular`): a path is opened more than once (format,
    records, metadata), and a pipe would hang or lose its head. A pipe swapped in after a check of the path
    is refused too, not waited on.

    Raises:
        HurrayFormatError: not a regular file (field ``file``), or none of the formats (``magic``).
        OSError: the file cannot be opened.
    """
    try:
        f = open_regular(path)
    except HurrayFormatError:
        raise HurrayFormatError(
            "file",
            f"{path} is not a regular file (a pipe, socket or device?): save it to a file first "
            "(read_stream reads a pipe's stream)",
        ) from None
    with f:
        return _format_of(f.read(9), path)


def _format_of(head: bytes, path: str | os.PathLike[str]) -> Format:
    """The format of a file whose first bytes (at least 9, where it has them) are ``head``."""
    if head[:8] == FILE_MAGIC:
        return "hrry"
    if head[:4] == b"HRRY":
        return "stream"
    if len(head) >= 9 and int.from_bytes(head[:8], "little") < (100 << 20) and head[8:9] == b"{":
        return "safetensors"
    raise HurrayFormatError(
        "magic", f"{path}: neither a Hurray file (HRRYFILE), a Hurray stream (HRRY) nor a safetensors file"
    )


def _format_for_writing(path: str | os.PathLike[str], fmt: Format | None) -> Format:
    if fmt is not None:
        if fmt not in _FORMATS:
            # Else it reached save_records, whose message ("raw records go to .hrry or .hrrs files") names no value.
            raise HurrayArgumentError(
                "format",
                f"unknown format {fmt!r}: use one of {', '.join(map(repr, _FORMATS))} (a .hrrs file is 'stream')",
            )
        return fmt
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIX_FORMATS:
        raise HurrayArgumentError(
            "path", f"cannot tell the format of {os.fspath(path)!r}: use .hrry, .hrrs or .safetensors, or pass format="
        )
    return SUFFIX_FORMATS[suffix]


def save(
    snapshot: KVSnapshot,
    path: str | os.PathLike[str],
    *,
    format: Format | None = None,
    progress: bool = False,
    permissive: bool = False,
) -> int:
    """Write ``snapshot`` to ``path`` (format from the suffix); returns bytes written.

    ``.hrry`` is the random-access file, ``.hrrs`` the stream format,
    ``.safetensors`` a safetensors file any safetensors reader opens. Files
    land atomically: nothing appears at ``path`` until the write completed.

    Args:
        snapshot: What to write (its pools may be on any device; they are copied to the host).
        path: The file; its suffix picks the format unless ``format`` is given.
        format: ``"hrry"``, ``"stream"`` or ``"safetensors"``.
        progress: Show a progress bar on a terminal.
        permissive: Write a snapshot with violations that permissive readers waive (one read with
            ``load(..., permissive=True)``); a permissive load is then needed to read the file back.

    Returns:
        The number of bytes written.

    Raises:
        HurrayArgumentError: an unknown suffix or format.
        HurrayFormatError: ``snapshot`` breaks a rule that :func:`load` would refuse the file for (``field``
            names it; :meth:`KVSnapshot.validate` lists them all), or carries a chunk digest its data does not
            match (``snapshot.digest``: changed since the digest was computed). Nothing is written.
        OSError: the file cannot be written (nothing is left at ``path``).

    Example:
        >>> import hurray_vllm as hv
        >>> from hurray_vllm.app.demo import spec_example_snapshot
        >>> snap = spec_example_snapshot()  # the spec's example: 4 layers, sequences of 6 and 3 tokens
        >>> hv.save(snap, "kv.hrrs")
        7565
        >>> hv.load("kv.hrrs").seq_lens
        [6, 3]
    """
    fmt = _format_for_writing(path, format)
    # What load refuses is not written: a file every reader refuses is worse than an error naming the field now.
    raise_if(snapshot.validate(permissive=permissive), "snapshot")
    check_digest(snapshot)  # load checks a carried chunk digest: a chunk changed since would be refused as damaged
    if fmt == "hrry":
        return save_records(_shown(snapshot_records(snapshot), "save", progress), path, format=fmt, kv=_FILE_KV)
    if fmt == "safetensors":
        from .safetensors import save_safetensors

        return save_safetensors(snapshot, path)
    return save_records(_shown(snapshot_records(snapshot), "save", progress), path, format=fmt)


def _shown(records: Iterator[Record], desc: str, enabled: bool) -> Iterator[Record]:
    """``records`` with a progress bar when asked for (and stderr is a terminal)."""
    if not enabled:
        return records
    from ..progress import progress

    return progress(records, desc=desc)


def save_records(
    records: Iterable[Record],
    path: str | os.PathLike[str],
    *,
    format: Format | None = None,
    kv: dict[str, Any] | None = None,
) -> int:
    """Write raw records (any Hurray descriptors, not only a snapshot's) to a ``.hrry`` or ``.hrrs`` file.

    What :func:`save` does below the snapshot schema, and what
    ``hurray-vllm convert`` uses to carry records over unchanged. The file
    lands atomically (:mod:`~hurray_vllm.containers.atomic`).

    Args:
        records: The records, in file order.
        path: The file to write; its suffix picks the format unless ``format`` is given.
        format: ``"hrry"`` or ``"stream"``.
        kv: ``.hrry`` only: the file's key-value metadata.

    Returns:
        The number of bytes written.
    """
    fmt = _format_for_writing(path, format)
    if fmt == "hrry":
        return write_file(records, path, kv=kv)
    if fmt != "stream":
        raise HurrayArgumentError("format", f"raw records go to .hrry or .hrrs files, not {fmt}")
    with atomic_file(path) as f:
        return write_records(records, f)


def open_records(path: str | os.PathLike[str], *, permissive: bool = False, mmap: bool = False) -> Iterator[Record]:
    """Every record of a Hurray file or stream at ``path``, in write order."""
    return _records(path, detect_format(path), permissive=permissive, mmap=mmap)


def read_file(path: str | os.PathLike[str]) -> FileBytes:
    """Every byte of the file at ``path`` (``hrryfile.read_whole``), for :func:`load_file_bytes`.

    With :func:`load`'s error contract.

    Raises:
        HurrayFormatError: as :func:`load`.
        OSError: the file cannot be read (``FileNotFoundError`` if it is gone; ``ENOMEM`` if memory
            ran out: not a verdict on the file).
    """
    try:
        return read_whole(path)
    except (HurrayFormatError, OSError):
        raise
    except (*PARSE_ERRORS, MemoryError) as exc:
        _reraise(exc, str(path))


def load_file_bytes(data: FileBytes, *, permissive: bool = False, digest: bool = True) -> KVSnapshot:
    """:func:`load` of a ``.hrry`` file or Hurray stream that :func:`read_file` read already.

    For a reader of many files: the next file is read on a helper thread
    (the read releases the GIL) while this one is parsed. Only the bytes read
    are parsed: the file is not opened again (it may have been replaced
    since, by a larger file, a link or a pipe; ``read_whole``'s bounds held
    for what was read). A safetensors file is refused: its reader takes a
    path, not bytes (:func:`load` reads it).

    ``digest=False`` leaves a chunk digest the file carries unchecked, for
    a caller that runs the chunk's data check itself
    (:func:`~hurray_vllm.chunks.verify.begin_check_data`: the digest, or a
    fleet key's MAC instead, on a helper thread): the chunk store's readers.
    Checked here, the pools would be checksummed twice.

    Raises:
        HurrayFormatError: as :func:`load`; a safetensors file (field ``file.magic``).
    """
    fmt = _format_of(bytes(data.view[:9]), data.path)
    if fmt == "safetensors":
        raise HurrayFormatError(
            "file.magic", f"{data.path} is a safetensors file: load() reads it (load_file_bytes reads Hurray files)"
        )
    try:
        if fmt == "stream":
            with BytesIO(data.view) as f:
                snap = assemble_snapshot(
                    group_records(read_records(f, permissive=permissive), permissive=permissive), permissive=permissive
                )
        else:
            with HrryFile(data.path, data=data) as hf:
                snap = load_hrry(hf, permissive=permissive)
        if digest:
            check_digest(snap, data)  # with the page registers of the read, where it computed them
        return snap
    except HurrayFormatError:
        raise
    except (*PARSE_ERRORS, MemoryError) as exc:
        _reraise(exc, str(data.path))


def _records(path: str | os.PathLike[str], fmt: Format, *, permissive: bool, mmap: bool) -> Iterator[Record]:
    if fmt == "hrry":
        with HrryFile(path, mmap=mmap, whole=not mmap) as hf:  # every record is read: the file in one read
            yield from hf.records(permissive=permissive)
    elif fmt == "safetensors":
        from .safetensors import load_safetensors

        yield from snapshot_records(load_safetensors(path, permissive=permissive))
    else:
        with open_regular(path) as f:  # a pipe swapped in since detect_format looked is refused, not waited on
            yield from read_records(f, permissive=permissive)


def load(
    path: str | os.PathLike[str], *, permissive: bool = False, mmap: bool = False, progress: bool = False
) -> KVSnapshot:
    """Read a :class:`KVSnapshot` from a ``.hrry`` file, a Hurray stream or a ``.safetensors`` file.

    The format is recognised by its magic bytes, not the suffix. Every
    descriptor and buffer is checked against the spec before it is used,
    and a chunk's data against the digest it carries (``extra``'s
    ``hurray_vllm.chunk_digest``, :func:`~hurray_vllm.containers.digest.check_digest`),
    as the chunk store's consumers check it; a digest that cannot be checked
    here (an old or unknown one) is no verdict on the data and is passed.

    Args:
        path: The file.
        permissive: Accept what the spec allows but this library would not write
            (only violations that make the data unreadable are refused).
        mmap: Map a ``.hrry`` file's page pools instead of reading them. The pools are then the file's
            pages: if another process truncates the file in place while they are in use, reading one
            kills this process with ``SIGBUS`` (inherent to ``mmap``; :func:`save` replaces a file by
            renaming a new one over it, which a mapping survives).
        progress: Show a progress bar on a terminal.

    Returns:
        The snapshot, its page pools on the host.

    Raises:
        HurrayFormatError: anything malformed; ``.field`` names what, ``.violations`` lists the rules broken.
            ``snapshot.digest``: a chunk whose data does not match its digest (damaged).
        OSError: the file cannot be read.

    Example:
        >>> import hurray_vllm as hv
        >>> from hurray_vllm.app.demo import spec_example_snapshot
        >>> _ = hv.save(spec_example_snapshot(), "kv.hrry")
        >>> snap = hv.load("kv.hrry")
        >>> snap.num_layers, snap[3, "key"].page_pool.shape  # [num_pages, page_size, num_heads, head_dim]
        (4, torch.Size([5, 4, 2, 8]))
        >>> hv.load("kv.hrry", mmap=True).token_ids == snap.token_ids
        True
    """
    fmt = detect_format(path)
    try:
        if fmt == "safetensors":
            from .safetensors import load_safetensors

            snap = load_safetensors(path, permissive=permissive)
        elif fmt == "hrry" and not progress:
            with HrryFile(path, mmap=mmap, whole=not mmap) as hf:  # every record is read: the file in one read
                snap = load_hrry(hf, permissive=permissive)
        else:
            snap = assemble_snapshot(
                group_records(
                    _shown(_records(path, fmt, permissive=permissive, mmap=mmap), "load", progress),
                    permissive=permissive,
                ),
                permissive=permissive,
            )
        # In every mode: damage is no rule the spec lets a reader waive. One pass over the pools, chunks only.
        check_digest(snap)
        return snap
    except HurrayFormatError:
        raise
    except (*PARSE_ERRORS, MemoryError) as exc:
        _reraise(exc, str(path))


def write_stream(snapshot: KVSnapshot, f: BinaryIO, *, permissive: bool = False, check: bool = True) -> int:
    """Write ``snapshot`` to the binary file object ``f`` as a Hurray stream.

    Page pools go from tensor memory straight to ``f.write`` (no copy).
    Returns the number of bytes written. Layers that share their block
    structure are encoded once (:class:`~hurray_vllm.containers.stream.LayerWriter`,
    the same bytes as every record encoded on its own).

    Args:
        snapshot: What to write.
        f: A binary file object open for writing.
        permissive: Write a snapshot with violations that permissive readers waive, as :func:`save`.
        check: ``False`` skips the validation (a transport's per-chunk path, whose chunks the connector
            built and whose receiver validates them anyway: ~3.5 ms of a 32-layer chunk's ~4 ms).

    Raises:
        HurrayFormatError: ``snapshot`` breaks a rule that :func:`read_stream` would refuse it for (``field``
            names it; :meth:`KVSnapshot.validate` lists them all). Nothing is written to ``f``.
    """
    # Checked before the first byte, as save() does: an error halfway leaves the caller's stream holding a
    # partial snapshot, and one written whole that read_stream refuses is found only by the reader.
    if check:
        raise_if(snapshot.validate(permissive=permissive), "snapshot")
    return _write_stream_unchecked(snapshot, f)


def _write_stream_unchecked(snapshot: KVSnapshot, f: BinaryIO) -> int:
    """:func:`write_stream` of a snapshot already validated (for a per-chunk hot path; the reader still checks)."""
    total = write_records(header_records(snapshot), f)
    writer = LayerWriter()
    for i, members in enumerate(snapshot.layer_members()):
        total += writer.write(f, i, members, snapshot.kv_scales[i] if snapshot.kv_scales is not None else None)
    return total + write_records(state_records(snapshot.states), f)


def read_stream(f: BinaryIO, *, permissive: bool = False, limit: int | None = None) -> KVSnapshot:
    """Read one :class:`KVSnapshot` from the binary file object ``f`` (to its end, at most ``limit`` bytes).

    Raises:
        HurrayArgumentError: ``f`` is not a binary file object open for reading (field ``f``), or ``limit`` is
            not an integer >= 0 (field ``limit``).
        HurrayFormatError: anything malformed, truncated or inconsistent.
        OSError: ``f`` cannot be read.
    """
    # The caller's mistakes, refused as such: read on, they were reported as malformed input (a file's fault).
    if not callable(getattr(f, "read", None)) or isinstance(f, TextIOBase):
        raise HurrayArgumentError("f", f"expected a binary file object open for reading, got {type(f).__name__}")
    if limit is not None:
        # 0 is a frame that holds nothing (bad data, not a bad call): the reader refuses its records.
        limit = integer_arg(limit, "limit", 0)
    try:
        return assemble_snapshot(
            group_records(read_records(f, permissive=permissive, limit=limit), permissive=permissive),
            permissive=permissive,
        )
    except HurrayFormatError:
        raise
    except (*PARSE_ERRORS, MemoryError) as exc:
        _reraise(exc, "stream")


def iter_nodes(path: str | os.PathLike[str], *, permissive: bool = False) -> Iterator[Node]:
    """The records of the file at ``path`` grouped into trees: a composite head with its members."""
    return group_records(open_records(path, permissive=permissive), permissive=permissive)


def file_kv(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The KV metadata of a ``.hrry`` file (empty for streams)."""
    if detect_format(path) != "hrry":
        return {}
    with HrryFile(path) as hf:
        return dict(hf.kv)
