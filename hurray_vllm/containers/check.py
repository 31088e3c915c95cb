"""``hurray_vllm.containers.check``: check anything Hurray against the specification."""

from __future__ import annotations

import itertools
import os
from collections.abc import Generator, Iterator
from pathlib import Path

import torch

from ..errors import HurrayFormatError, Violation
from ..kv.paged import BlockPagedTensor
from ..kv.snapshot import KVSnapshot
from ..wire.descriptor import LAYOUT_BLOCK_PAGED, LAYOUT_ROW_MAJOR, TensorDescriptor, decode_descriptor
from ..wire.rules import Checked, validate_descriptor
from .digest import check_digest
from .schema import FORMAT_NAME, MAX_COMPOSITE_DEPTH, Node, Record, claims_snapshot, index_tables

__all__ = ["validate"]

Validatable = KVSnapshot | BlockPagedTensor | TensorDescriptor | bytes | bytearray | str | os.PathLike[str]


def validate(obj: Validatable, *, permissive: bool = False) -> Checked:
    """Every violation of the Hurray rules in ``obj``, each named by its invariant.

    ``obj`` may be a :class:`KVSnapshot`, a :class:`BlockPagedTensor`, a
    decoded :class:`TensorDescriptor`, encoded descriptor bytes, or the path
    of a ``.hrry`` file, stream or ``.safetensors`` file (KV in a file is ok
    exactly when :func:`~hurray_vllm.load` reads it; a snapshot exactly when
    :func:`~hurray_vllm.save` writes it: a chunk whose data does not match
    the digest it carries is neither, ``snapshot.digest``, as the chunk
    store's consumers refuse it). Strict by default; with
    ``permissive=True`` only violations that make the data unreadable count
    as errors (``Checked.errors``), the rest stay listed in
    ``Checked.violations``.

    Nothing is raised for invalid input: look at ``result.ok``.

    Args:
        obj: What to check.
        permissive: Count only violations that make the data unreadable as errors.

    Returns:
        A :class:`Checked`: ``ok``, ``errors`` and every ``violations`` entry (invariant and message).

    Example:
        >>> import hurray_vllm as hv
        >>> from hurray_vllm.app.demo import spec_example_snapshot
        >>> _ = hv.save(spec_example_snapshot(), "kv.hrry")
        >>> hv.validate("kv.hrry").ok
        True
        >>> hv.validate(b"not a descriptor").ok
        False
    """
    if isinstance(obj, KVSnapshot):
        checked = obj.validate(permissive=permissive)
        if checked.ok:
            # What save() refuses too: ok here is a snapshot save() writes and load() reads back.
            try:
                check_digest(obj)
            except HurrayFormatError as exc:
                return Checked(checked.violations, permissive, exc.violations)
        return checked
    if isinstance(obj, BlockPagedTensor):
        return obj.validate(permissive=permissive)
    if isinstance(obj, TensorDescriptor):
        return validate_descriptor(obj, permissive=permissive)
    if isinstance(obj, (bytes, bytearray)):
        try:
            return validate_descriptor(decode_descriptor(obj), permissive=permissive)
        except HurrayFormatError as exc:
            return Checked((), permissive, exc.violations)
    if isinstance(obj, (str, Path, os.PathLike)):
        return _validate_path(obj, permissive)
    raise TypeError(f"cannot validate a {type(obj).__name__}")


def _record_violations(rec: Record, seq_lens: torch.Tensor | None, permissive: bool) -> list[Violation]:
    name = rec.name or "tensor"
    try:
        tables = index_tables(rec)
    except HurrayFormatError as exc:
        # An index no int64 holds (a structural rule): the descriptor's own rules are still reported.
        own = validate_descriptor(rec.descriptor, permissive=permissive).violations
        return [Violation(v.invariant, f"{name}: {v.message}") for v in (*own, *exc.violations)]
    bt, sp = tables if tables is not None else (None, None)
    checked = validate_descriptor(rec.descriptor, block_table=bt, seq_ptr=sp, seq_lens=seq_lens, permissive=permissive)
    return [Violation(v.invariant, f"{name}: {v.message}") for v in checked.violations]


def _walk(node: Node, permissive: bool, out: list[Violation]) -> None:
    seq_lens = node.pair_seq_lens()
    out.extend(_record_violations(node.record, None, permissive))
    for m in node.members:
        if m.is_composite:
            _walk(m, permissive, out)
        else:
            paged = m.record.descriptor.layout_tag == LAYOUT_BLOCK_PAGED
            out.extend(_record_violations(m.record, seq_lens if paged else None, permissive))


def _snapshot_like(node: Node) -> bool:
    """Whether ``node`` or any node inside it is KV: claims to be part of a snapshot, or is block-paged.

    Only :func:`load` can call such data valid: a block-paged key without
    its value, or a layer missing, breaks no record's own rules. A group whose
    member count was raised swallows the header and every layer: only a look
    inside finds that it holds a snapshot that ``load`` refuses. (Nesting is
    bounded by the reader.)
    """
    if claims_snapshot(node) or node.record.descriptor.layout_tag == LAYOUT_BLOCK_PAGED:
        return True
    return any(_snapshot_like(m) for m in node.members)


def _validate_path(path: str | os.PathLike[str], permissive: bool) -> Checked:
    """Every rule of every record, then, for KV, exactly the checks :func:`load` runs.

    KV (a file with hurray-vllm's header, any block-paged record, or a
    ``.safetensors`` snapshot) that ``validate`` calls ok is KV ``load``
    reads: a stream cut after its first layer, or a lone block-paged key,
    breaks no record's rules, but is no snapshot ``load`` accepts. Other
    Hurray data (row-major descriptors another writer made) is checked
    against the Hurray rules only.
    """
    from .io import detect_format, iter_nodes, load

    out: list[Violation] = []
    unreadable: tuple[Violation, ...] = ()
    snapshot_like = False
    try:
        if detect_format(path) == "safetensors":
            snapshot_like = True  # only hurray-vllm snapshots are read from safetensors
        else:
            for node in iter_nodes(path, permissive=True):
                snapshot_like = snapshot_like or _snapshot_like(node)
                _walk(node, permissive, out)
    except Exception as exc:  # HurrayFormatError, or a reader's bug on malformed input: a finding, not a crash
        unreadable = _unreadable(exc, str(path))
        if snapshot_like or _opens_as_kv(path):
            unreadable = _with_load_verdict(path, permissive, unreadable)
    checked = Checked(tuple(out), permissive, unreadable)
    if checked.ok and snapshot_like:
        try:
            load(path, permissive=permissive, mmap=True)
        except Exception as exc:
            return Checked(tuple(out), permissive, _unreadable(exc, str(path)))
    return checked


def _opens_as_kv(path: str | os.PathLike[str]) -> bool:
    """Whether the file's first tensor says it is KV, or the file breaks before its first tensor.

    What decides whether a walk that failed asks ``load`` for its verdict: the
    walk never saw a group it failed inside whole (a stream's header, whose
    metadata member names the format). A file that breaks before its first
    tensor, ``load`` refuses there too. Another writer's row-major data is
    not asked about: ``load`` would only say that it holds no snapshot.
    Composite heads are read past (nesting is bounded); the pools are mapped,
    not read.
    """
    from .io import open_records

    records: Iterator[Record] = iter(())
    try:
        records = open_records(path, permissive=True, mmap=True)
        for rec in itertools.islice(records, MAX_COMPOSITE_DEPTH + 1):
            if _claims_kv(rec):
                return True
            if not Node(rec).is_composite:
                return False  # its first tensor: another writer's data
        return False
    except Exception:  # HurrayFormatError, OSError, a reader's bug: load has its say on what broke first
        return True
    finally:
        if isinstance(records, Generator):
            records.close()  # the file it opened, now, not when the generator is collected


def _claims_kv(rec: Record) -> bool:
    """Whether ``rec`` on its own says it is part of KV: block-paged, a snapshot's name, or its metadata."""
    d = rec.descriptor
    if d.layout_tag == LAYOUT_BLOCK_PAGED or claims_snapshot(Node(rec)):
        return True
    # A stream has no names: its header's first member holds the metadata JSON, which names the format
    # (what claims_snapshot looks for in a whole header group, which a walk that failed inside it never built).
    if d.layout_tag != LAYOUT_ROW_MAJOR or len(rec.buffers) != 1:
        return False
    head = rec.buffers[0][:256]
    return head.dtype == torch.uint8 and FORMAT_NAME.encode() in bytes(head.numpy())


def _with_load_verdict(
    path: str | os.PathLike[str], permissive: bool, unreadable: tuple[Violation, ...]
) -> tuple[Violation, ...]:
    """``unreadable``, led by what :func:`load` refuses the same KV for (named as ``load`` names it).

    The walk reads descriptors permissively, to list every rule they break: a
    descriptor that breaks a waivable rule and a structural one fails there on
    the structural one only, where a strict ``load`` names the waivable one;
    and ``load`` refuses a header member whose buffer does not hold its shape,
    which the walk reads past, to fail on the bytes after it (``magic``). Only
    for a file the walk found broken: as bounded as ``load`` (the pools mapped,
    not read), and no cost to a good file.
    """
    from .io import load

    try:
        load(path, permissive=permissive, mmap=True)
    except Exception as exc:
        first = _unreadable(exc, str(path))
        return (*first, *(v for v in unreadable if v not in first))
    return unreadable


def _unreadable(exc: Exception, what: str) -> tuple[Violation, ...]:
    """The findings for a file that could not be read: the file's own (``file``: I/O, memory), or the data's."""
    from .io import read_error

    err = exc if isinstance(exc, OSError) else read_error(exc, what)
    return (Violation("file", str(err)),) if isinstance(err, OSError) else err.violations
