"""Shared fixtures and the CI rule: integration dependencies fail, never skip, under CI=true."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from tiny_models import build_tiny_llama

settings.register_profile(
    "default",
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", parent=settings.get_profile("default"), max_examples=60, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") == "true" else "default")


def require(module: str) -> ModuleType:
    """Import ``module``; skip without it locally, fail under CI=true."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{module} is required in CI (make test installs it): {exc}")
        pytest.skip(f"{module} is not installed: {exc}")


@pytest.fixture(scope="session")
def hurray() -> ModuleType:
    """The reference implementation (PyPI pyhurray), used as a test oracle."""
    return require("hurray")


# ── shared real-engine fixtures (session scope: every engine starts once per run) ──

HERE = Path(__file__).parent
#: Engine configurations exported by tests/vllm_engine_run.py: (block_size, kv_cache_dtype).
CONFIGS = {"bf16-32": (32, "auto"), "bf16-64": (64, "auto"), "fp8-32": (32, "fp8")}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require("transformers")
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def engine_runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """One engine per configuration, each in its own process, run once per session."""
    require("vllm")
    runs = {}
    for name, (block_size, kv_dtype) in CONFIGS.items():
        out = tmp_path_factory.mktemp(f"engine-{name}")
        proc = subprocess.run(
            [sys.executable, str(HERE / "vllm_engine_run.py"), str(tiny_model), str(out), str(block_size), kv_dtype],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PYTHONPATH": str(HERE.parent)},
        )
        if proc.returncode:
            pytest.fail(f"vLLM engine {name} failed:\n{proc.stderr[-4000:]}")
        runs[name] = (out, json.loads((out / "result.json").read_text()))
    return runs


@pytest.fixture(scope="session")
def hf_model(tiny_model: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).eval()
