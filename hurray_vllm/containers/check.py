"""``hurray_vllm.containers.check``: check anything Hurray against the specification."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import HurrayFormatError, Violation
from ..kv.paged import BlockPagedTensor
from ..kv.snapshot import KVSnapshot
from ..wire.descriptor import TensorDescriptor, decode_descriptor
from ..wire.rules import Checked, validate_descriptor
from .schema import Node, Record, index_tables

__all__ = ["validate"]

Validatable = KVSnapshot | BlockPagedTensor | TensorDescriptor | bytes | bytearray | str | os.PathLike[str]


def validate(obj: Validatable, *, permissive: bool = False) -> Checked:
    """Every violation of the Hurray rules in ``obj``, each named by its invariant.

    ``obj`` may be a :class:`KVSnapshot`, a :class:`BlockPagedTensor`, a
    decoded :class:`TensorDescriptor`, encoded descriptor bytes, or the path
    of a ``.hrry`` file or stream. Strict by default; with
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
        return obj.validate(permissive=permissive)
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
    try:
        tables = index_tables(rec)
    except HurrayFormatError as exc:
        return list(exc.violations)
    bt, sp = tables if tables is not None else (None, None)
    checked = validate_descriptor(rec.descriptor, block_table=bt, seq_ptr=sp, seq_lens=seq_lens, permissive=permissive)
    name = rec.name or "tensor"
    return [Violation(v.invariant, f"{name}: {v.message}") for v in checked.violations]


def _walk(node: Node, permissive: bool, out: list[Violation]) -> None:
    seq_lens = node.pair_seq_lens()
    out.extend(_record_violations(node.record, None, permissive))
    for i, m in enumerate(node.members):
        if m.is_composite:
            _walk(m, permissive, out)
        else:
            out.extend(_record_violations(m.record, seq_lens if i < 2 else None, permissive))


def _validate_path(path: str | os.PathLike[str], permissive: bool) -> Checked:
    from .io import iter_nodes

    out: list[Violation] = []
    unreadable: tuple[Violation, ...] = ()
    try:
        for node in iter_nodes(path, permissive=True):
            _walk(node, permissive, out)
    except HurrayFormatError as exc:
        unreadable = exc.violations
    except OSError as exc:
        unreadable = (Violation("file", str(exc)),)
    return Checked(tuple(out), permissive, unreadable)
