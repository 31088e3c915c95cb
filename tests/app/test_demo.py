"""`hurray-vllm demo` (what `make demo` runs): the whole job passes its own checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require
from servers import ROOT, root_cause

pytestmark = [pytest.mark.vllm]


def test_demo_end_to_end(tmp_path: Path) -> None:
    require("vllm")
    require("transformers")
    proc = subprocess.run(
        [sys.executable, "-m", "hurray_vllm.app.cli", "demo", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + root_cause(proc.stderr)
    assert "FAILED" not in proc.stdout
    # The engines' logs went to demo.log, not to the terminal (--verbose shows them).
    assert "WARNING" not in proc.stdout and "Loading weights" not in proc.stderr, proc.stdout + proc.stderr
    assert (tmp_path / "demo.log").is_file() and "native kernels:" in proc.stdout
    for name in ("snapshot.hrry", "snapshot.hrrs", "snapshot.safetensors"):
        assert (tmp_path / name).is_file()
