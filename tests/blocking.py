"""Calls that must not block: run on a thread with a deadline, a FIFO let go if one does."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

__all__ = ["within"]


def within(call: Callable[[], object], unblock: Path | None = None, timeout: float = 10.0) -> object:
    """``call()``'s result or the exception it raised, run on a thread: it must finish within ``timeout`` seconds.

    ``unblock``: a FIFO whose reader is let go (a writer opens it) if the call hangs, so that the test ends
    (and the thread with it) instead of leaving a reader blocked for the rest of the suite.
    """
    out: list[object] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # the verdict is the caller's
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        if unblock is not None:
            os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(timeout)
        pytest.fail(f"{call} blocked for {timeout} s")
    return out[0]
