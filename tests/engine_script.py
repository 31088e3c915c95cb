"""Running one of the tests' engine scripts (``tests/*_run.py``) in a process of its own.

vLLM engines are expensive to start and do not like sharing a process: each
configuration runs once, in a subprocess, and the tests read the
``result.json`` it writes. A failure shows the engine's root cause
(:func:`servers.root_cause`), not vLLM's shutdown noise.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import servers
from prefetch import engine_slot

__all__ = ["run_engine_script", "run_phases"]

TESTS = Path(__file__).resolve().parent


def run_engine_script(
    script: str, args: Sequence[str], out: Path, what: str, *, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``tests/<script> *args`` (which writes ``out/result.json``); its result, with ``"dir"`` = ``out``.

    Fails the test, naming ``what`` and the engine's root cause, if the script fails.
    """
    out.mkdir(parents=True, exist_ok=True)
    # A multi-rank CPU engine binds its ranks to cores (vLLM refuses to start without): one rank per bound core.
    ranks = (env or {}).get("VLLM_CPU_OMP_THREADS_BIND", "").count("|") + 1
    with engine_slot(ranks):
        proc = servers.run_group(  # killed with its ranks on a timeout; one process: forked (tests/zygote.py)
            [sys.executable, str(TESTS / script), *args],
            timeout=900,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]), **(env or {})},
        )
    if proc.returncode:
        pytest.fail(f"{what} failed:\n{servers.root_cause(proc.stderr)}")
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    result["dir"] = out
    return result


def run_phases(tmp: Path, name: str, tp: int, phases: list[dict[str, Any]], **config: Any) -> dict[str, Any]:
    """Run ``hybrid_tp_run.py``: the model at ``tmp / "model"`` on the store ``tmp / "store"``, in ``phases``.

    ``config``: the script's other settings (``block``, ``chunk``, ``max_model_len``, ``kv_cache_dtype``,
    ``async_scheduling``).
    At TP > 1 the ranks are bound one per core, round robin (two per core on a 2-core machine at TP = 4).
    """
    cfg = {"model": str(tmp / "model"), "store": str(tmp / "store"), "tp": tp, **config, "phases": phases}
    (tmp / f"{name}.json").write_text(json.dumps(cfg))
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))} if tp > 1 else {}
    return run_engine_script(
        "hybrid_tp_run.py", [str(tmp / f"{name}.json"), str(tmp / name)], tmp / name, f"TP={tp} {name}", env=env
    )
