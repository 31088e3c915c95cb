"""Shared fixtures and the CI rule: integration dependencies fail, never skip, under CI=true."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings

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
