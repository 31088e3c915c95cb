"""The two exception types hurray-vllm raises: bad data, and misuse by the caller.

* :class:`HurrayFormatError`: the *data* is wrong (a descriptor, stream, file,
  chunk or snapshot that is malformed, truncated, inconsistent, unsupported or
  does not fit the model). A consumer may refuse or quarantine such data.
* :class:`HurrayArgumentError`: the *caller* is wrong (a kernel argument, a
  configuration value, an option out of range). Nothing about the data is
  implied: never quarantine a chunk because of one.

Both are ``ValueError`` subclasses with a ``.field`` naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HurrayArgumentError", "HurrayFormatError", "Violation"]


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
