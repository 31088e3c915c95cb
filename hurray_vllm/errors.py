"""The two exception types hurray-vllm raises: bad data, and misuse by the caller.

* :class:`HurrayFormatError`: the *data* is wrong (a descriptor, stream, file,
  chunk or snapshot that is malformed, truncated, inconsistent, unsupported or
  does not fit the model). A consumer may refuse or quarantine such data.
* :class:`HurrayArgumentError`: the *caller* is wrong (a kernel argument, a
  configuration value, an option out of range, an importer's ``layer``,
  ``page_size``, ``dtype=``, ``plan`` or ``out=``). Nothing about the data is
  implied: never quarantine a chunk because of one.

Both are ``ValueError`` subclasses with a ``.field`` naming what is wrong.

Compatibility: the importers (flash-attn, FlashInfer, FlashMLA and
:mod:`hurray_vllm.kv.repage`) raised :class:`HurrayFormatError` for some
caller errors in 0.1 (a ``plan`` made for another snapshot, ``out=`` caches
that do not fit, a ``dtype=`` the kernel does not take). They now raise
:class:`ImportArgumentError`, a :class:`HurrayArgumentError` that is also a
:class:`HurrayFormatError` so that ``except HurrayFormatError`` written
against 0.1 still catches them. That second base goes away in 0.3: catch
:class:`HurrayArgumentError` for these. Code that tells the two apart must
test :class:`HurrayArgumentError` first (``isinstance(exc, HurrayFormatError)
and not isinstance(exc, HurrayArgumentError)`` is a data error).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HurrayArgumentError", "HurrayFormatError", "ImportArgumentError", "Violation"]


@dataclass(frozen=True)
class Violation:
    """One broken rule of the Hurray format.

    ``invariant`` is a stable, dotted name (``"seq_ptr.non_decreasing"``,
    ``"block_paged.reserved"``) that tests and tools can match on;
    ``message`` says what was found and what was expected.
    """

    invariant: str
    message: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}"


class HurrayFormatError(ValueError):
    """Malformed, truncated, inconsistent or unsupported Hurray data.

    Every failure caused by the *input* (a descriptor, stream, file, snapshot
    or engine that does not match) is raised as this type, never as a bare
    ``struct.error``, ``IndexError`` or ``RuntimeError``.

    Attributes:
        field: the descriptor field or invariant the error is about
            (for example ``"seq_ptr"`` or ``"file.trailer_magic"``).
        violations: every rule found broken, when the error comes from
            validation; a single entry otherwise.
    """

    def __init__(self, field: str, message: str, violations: Sequence[Violation] | None = None) -> None:
        self.field = field
        self.violations: tuple[Violation, ...] = tuple(violations) if violations else (Violation(field, message),)
        super().__init__(f"{field}: {message}")

    @classmethod
    def from_violations(cls, violations: Sequence[Violation], context: str = "") -> HurrayFormatError:
        """The error for ``violations`` (at least one): named after the first, its message prefixed with ``context``."""
        first = violations[0]
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        prefix = f"{context}: " if context else ""
        return cls(first.invariant, f"{prefix}{first.message}{more}", violations)


class HurrayArgumentError(ValueError):
    """A caller passed something hurray-vllm cannot use: fix the call, not the data.

    Raised for kernel arguments that do not fit (shapes, dtypes, devices, page
    sizes a kernel refuses), configuration values (``kv_connector_extra_config``,
    command-line options) and options out of range. Data errors are
    :class:`HurrayFormatError`.

    Attributes:
        field: the argument or option the error is about (``"page_size"``,
            ``"hurray_chunk_tokens"``, ``"block_table"``).

    Example:
        >>> raise HurrayArgumentError("page_size", "must be positive, not 0")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ...
        hurray_vllm.errors.HurrayArgumentError: page_size: must be positive, not 0
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class ImportArgumentError(HurrayArgumentError, HurrayFormatError):
    """A caller error an importer reports: fix the call, not the data; catch :class:`HurrayArgumentError`.

    Raised for an importer's arguments that do not fit the snapshot: a
    ``layer`` out of range, a ``plan`` made for another snapshot (or other
    options), ``out=`` caches of the wrong count, kind, shape, size, dtype or
    device, a ``dtype=`` the kernel does not take, a non-positive target
    ``page_size``.

    It is *also* a :class:`HurrayFormatError` only for compatibility with
    callers written against 0.1, where these were format errors; it stops
    being one in 0.3. Nothing about the data is implied: code that
    quarantines data must exclude :class:`HurrayArgumentError` first.

    Attributes:
        field: the argument the error is about (``"out"``, ``"out[1][0]"``,
            ``"plan"``, ``"dtype"``, ``"layer"``).
        violations: one entry (``field``, the message), as a
            :class:`HurrayFormatError` from outside validation has.

    Example:
        >>> err = ImportArgumentError("plan", "the plan was made for another snapshot")
        >>> isinstance(err, HurrayArgumentError), isinstance(err, HurrayFormatError), err.field
        (True, True, 'plan')
    """

    def __init__(self, field: str, message: str) -> None:
        # Both bases' __init__ call super().__init__ with their own signatures,
        # so neither can run inside this MRO: set what each promises here.
        self.field = field
        self.violations: tuple[Violation, ...] = (Violation(field, message),)
        ValueError.__init__(self, f"{field}: {message}")


def plain_int(value: object) -> int:
    """``value`` as a plain ``int``: an int or an integer scalar (numpy's, a 0-d integer tensor).

    Raises:
        TypeError: a bool (an int to Python, never a count or a token id), a float, a string or anything else.
    """
    if isinstance(value, bool):
        raise TypeError(f"a bool is not a whole number here: {value!r}")
    return operator.index(value)  # type: ignore[arg-type]


def integer_arg(
    value: object, field: str, minimum: int | None = None, error: type[HurrayArgumentError] = HurrayArgumentError
) -> int:
    """An argument as a plain ``int`` (:func:`plain_int`) of at least ``minimum``; else ``error`` naming ``field``.

    Here, the leaf every layer imports, so that a caller's whole-number argument is checked one way everywhere
    (the importers' ``page_size`` as much as ``migrate()``'s ``max_tokens``).

    A float or a string would otherwise fail later with a bare ``TypeError``, or, compared and counted
    against, act as the next integer up (``max_new_tokens=2.5`` ran 3 steps).
    """
    try:
        count = plain_int(value)
    except TypeError:
        count = None
    if count is None or (minimum is not None and count < minimum):
        least = f" >= {minimum}" if minimum is not None else ""
        raise error(field, f"must be an integer{least}, not {value!r}")
    return count
