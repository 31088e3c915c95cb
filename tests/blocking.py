"""Waiting in tests without hanging them: calls run on a thread with a deadline, conditions polled until one."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

__all__ = ["wait_for", "within"]


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


def wait_for(cond: Callable[[], object], seconds: float = 15.0) -> bool:
    """Poll ``cond()`` until it is true or ``seconds`` have passed; whether it became true (asked once more last)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return bool(cond())
