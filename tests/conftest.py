"""Shared fixtures and the CI rule: integration dependencies fail, never skip, under CI=true."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import prefetch
import pytest
import torch
from hypothesis import HealthCheck, settings
from prefetch import engine_slot
from servers import root_cause, run_group, side_by_side
from tiny_models import build_tiny_llama
from tp_engines import tp_engines  # noqa: F401  (one session fixture for test_tp.py and test_tp_connector.py)

settings.register_profile(
    "default",
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", parent=settings.get_profile("default"), max_examples=60, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") == "true" else "default")

# Every engine the tests start (in this process or a child, which inherits it) keeps its usage statistics to
# itself: the machines have no network, and a report thread per engine costs start-up time for nothing.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


class _LoggerDict(dict[str, Any]):
    """``logging``'s table of loggers, whose ``values()`` is a copy taken under logging's lock.

    pytest (9.2) walks ``logging.Logger.manager.loggerDict.values()`` without that
    lock as it sets up each test's log capture (``catching_logs.__enter__``),
    while the prefetch lanes' threads import modules that create loggers: the
    walk then fails with "dictionary changed size during iteration", and the
    test with it (seen once, 2026-12-07). ``getLogger`` adds loggers under the
    lock, so a copy taken under it is whole.
    """

    def values(self) -> list[Any]:  # type: ignore[override]
        with logging._lock:  # type: ignore[attr-defined]  # the lock getLogger holds while it adds one
            return list(super().values())


with logging._lock:  # type: ignore[attr-defined]
    logging.Logger.manager.loggerDict = _LoggerDict(logging.Logger.manager.loggerDict)


def require(module: str) -> ModuleType:
    """Import ``module``; skip without it locally, fail under CI=true."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{module} is required in CI (make test installs it): {exc}")
        pytest.skip(f"{module} is not installed: {exc}")


def require_kv_cache_dtype(kv_cache_dtype: str, *, block_size: int = 32, head_dim: int = 32) -> None:
    """Skip where vLLM cannot run a ``kv_cache_dtype`` cache on this CPU (fp8 without AVX-512 or AMX).

    That is the hardware, like a missing GPU, not a missing package: the
    skip gives vLLM's own reason (its attention backend's choice, made
    again at engine start).
    """
    require("vllm")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(torch.bfloat16, block_size, head_dim, kv_cache_dtype)
    except NotImplementedError as exc:
        cpu = torch.backends.cpu.get_cpu_capability()
        pytest.skip(f"needs a CPU vLLM runs {kv_cache_dtype} KV caches on: {exc} (this CPU: {cpu})")


@pytest.fixture(scope="session")
def hurray() -> ModuleType:
    """The reference implementation (PyPI pyhurray), used as a test oracle."""
    return require("hurray")


# ── shared real-engine fixtures (session scope: every engine starts once per run) ──

HERE = Path(__file__).parent
#: Engine configurations exported by tests/vllm_engine_run.py: (block_size, kv_cache_dtype).
CONFIGS = {"bf16-32": (32, "auto"), "bf16-64": (64, "auto"), "fp8-32": (32, "fp8")}

#: vLLM's refusal of an fp8 KV cache on a CPU without AVX-512 or AMX (``cpu_attn._get_attn_isa``): the one
#: NotImplementedError of an engine run that skips (the hardware), not fails.
FP8_CPU_REFUSAL = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"


@pytest.fixture(autouse=True)
def _prefetch_engines(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """At the first real-engine test, start the lanes of ``tests/prefetch.py`` on the engine chains ahead."""
    if request.node.get_closest_marker("vllm") is not None:
        prefetch.start(request.session.items, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require("transformers")
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


class EngineRuns(dict[str, tuple[Path, dict[str, Any]]]):
    """Engine runs by configuration name: the first time one is asked for, all of them run (side by side).

    A configuration this CPU cannot run (vLLM refuses fp8 KV caches without
    AVX-512 or AMX) skips the tests that ask for it, with vLLM's reason: that
    is the hardware, like a missing GPU, not a missing package.
    """

    def __init__(self, model: Path, tmp: pytest.TempPathFactory) -> None:
        super().__init__()
        self.model, self.tmp = model, tmp
        self.failed: dict[str, str] = {}
        self.unsupported: dict[str, str] = {}

    def __missing__(self, name: str) -> tuple[Path, dict[str, Any]]:
        if name not in self.failed and name not in self.unsupported:
            # Every configuration not run yet, side by side: the suite asks for each of them.
            pending = [n for n in CONFIGS if n not in self.failed and n not in self.unsupported and n not in self]
            for other, outcome in side_by_side({n: (lambda n=n: self._run(n)) for n in pending}).items():
                if isinstance(outcome, tuple):
                    self[other] = outcome
        if name in self.failed:
            pytest.fail(self.failed[name])
        if name in self.unsupported:
            pytest.skip(f"needs a CPU vLLM runs {name} on: {self.unsupported[name]}")
        return self[name]

    def _run(self, name: str) -> tuple[Path, dict[str, Any]] | None:
        """One configuration's engine run; None where it failed (``failed``) or this CPU cannot run it."""
        block_size, kv_dtype = CONFIGS[name]
        out = self.tmp.mktemp(f"engine-{name}")
        with engine_slot():
            proc = run_group(  # on a timeout, its EngineCore is killed with it
                [
                    sys.executable,
                    str(HERE / "vllm_engine_run.py"),
                    str(self.model),
                    str(out),
                    str(block_size),
                    kv_dtype,
                ],
                timeout=900,
                env={**os.environ, "PYTHONPATH": str(HERE.parent)},
            )
        if proc.returncode:
            self.failed[name] = f"vLLM engine {name} failed:\n{root_cause(proc.stderr)}"
            return None
        result = json.loads((out / "result.json").read_text())
        if "unsupported" in result:
            # Only the documented refusal is the hardware's (docs/testing.md): an fp8 cache on a CPU without
            # AVX-512 or AMX. Any other NotImplementedError, and any for a bf16 run, is a failure.
            if kv_dtype.startswith("fp8") and FP8_CPU_REFUSAL in result["unsupported"]:
                self.unsupported[name] = result["unsupported"]
            else:
                self.failed[name] = f"vLLM refused engine {name}: {result['unsupported']}"
            return None
        ISAS_SEEN[name] = result["isa"]
        return out, result


#: Configuration name -> the CPU attention ISA vLLM chose for it, reported at the end of the run.
ISAS_SEEN: dict[str, str] = {}


@pytest.fixture(scope="session")
def engine_runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineRuns:
    """Engine runs per configuration (:data:`CONFIGS`), each started once per session when first used."""
    require("vllm")
    return EngineRuns(tiny_model, tmp_path_factory)


#: (seconds, fixture, scope, first test that asked for it) of every fixture whose set-up took a while.
FIXTURE_SETUPS: list[tuple[float, str, str, str]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Any:
    """Time each fixture's set-up: engines and fleets dominate the suite, and CI allows it 30 minutes."""
    start = time.monotonic()
    yield
    took = time.monotonic() - start
    if took >= 5.0:  # engines and servers, not the many cheap fixtures
        FIXTURE_SETUPS.append((took, fixturedef.argname, fixturedef.scope, request.node.nodeid))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say which CPU attention ISA vLLM ran, which near-ties the margin rule accepted, and the slowest set-ups."""
    from margins import NEAR_TIES

    if FIXTURE_SETUPS:
        # Nested fixtures count in each of theirs: read it as where the time goes, not a sum.
        terminalreporter.section("slowest fixture set-ups (engines and fleets: the suite's budget)")
        for took, name, scope, nodeid in sorted(FIXTURE_SETUPS, reverse=True)[:25]:
            terminalreporter.write_line(f"{took:7.1f}s {scope:8} {name}  (first for {nodeid})")

    if ISAS_SEEN:
        import torch

        runs = ", ".join(f"{name}: {isa}" for name, isa in sorted(ISAS_SEEN.items()))
        terminalreporter.write_line(f"vLLM CPU attention ISA ({torch.backends.cpu.get_cpu_capability()} CPU): {runs}")
    if NEAR_TIES:
        terminalreporter.section("near-ties accepted by the margin rule (tests/margins.py)")
        for line in NEAR_TIES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def hf_model(tiny_model: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).eval()
