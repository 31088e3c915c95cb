"""Running one of the tests' engine scripts (``tests/*_run.py``) in a process of its own.

vLLM engines are expensive to start and do not like sharing a process: each
configuration runs once, in a subprocess, and the tests read the
``result.json`` it writes. A failure shows the engine's root cause
(:func:`servers.root_cause`), not vLLM's shutdown noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import servers

__all__ = ["run_engine_script"]

TESTS = Path(__file__).resolve().parent


def run_engine_script(
    script: str, args: Sequence[str], out: Path, what: str, *, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``tests/<script> *args`` (which writes ``out/result.json``); its result, with ``"dir"`` = ``out``.

    Fails the test, naming ``what`` and the engine's root cause, if the script fails.
    """
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, str(TESTS / script), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]), **(env or {})},
    )
    if proc.returncode:
        pytest.fail(f"{what} failed:\n{servers.root_cause(proc.stderr)}")
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    result["dir"] = out
    return result
