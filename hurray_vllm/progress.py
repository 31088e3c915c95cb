"""Progress bars for long operations: tqdm when installed and wanted, silence otherwise."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["progress"]

T = TypeVar("T")


def progress(items: Iterable[T], *, desc: str, total: int | None = None, quiet: bool = False) -> Iterator[T]:
    """Iterate ``items`` with a progress bar on stderr (only on a terminal, never with ``quiet``)."""
    if quiet or not sys.stderr.isatty():
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield from items
        return
    yield from tqdm(items, desc=desc, total=total, unit="tensor", leave=False)
