"""The one exception type hurray-vllm raises for bad input."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HurrayFormatError", "Violation"]


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
        first = violations[0]
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        prefix = f"{context}: " if context else ""
        return cls(first.invariant, f"{prefix}{first.message}{more}", violations)
