"""The import paths of 0.1 still work for one release, and warn."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from servers import ROOT

import hurray_vllm as hv

MOVED = {
    "descriptor": "wire.descriptor",
    "dtypes": "wire.dtypes",
    "validation": "wire.rules",
    "crc32c": "wire.crc32c",
    "paged": "kv.paged",
    "snapshot": "kv.snapshot",
    "repage": "kv.repage",
    "records": "containers.schema",
    "stream": "containers.stream",
    "hrryfile": "containers.hrryfile",
    "safetensors_io": "containers.safetensors",
    "api": "containers.io",
    "store": "chunks.store",
    "transport_nixl": "transport.nixl",
    "attention": "adapters.reference",
    "cli": "app.cli",
    "demo": "app.demo",
}


@pytest.mark.parametrize(("old", "new"), MOVED.items())
def test_an_old_path_warns_and_is_the_new_module(old: str, new: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, f"hurray_vllm.{old}", raising=False)
    if hasattr(hv, old):
        monkeypatch.setattr(hv, old, getattr(hv, old))  # put back what the import rebinds
    with pytest.warns(DeprecationWarning, match=rf"hurray_vllm\.{old} moved to hurray_vllm\.{new}"):
        module = importlib.import_module(f"hurray_vllm.{old}")
    assert module is importlib.import_module(f"hurray_vllm.{new}")


def test_the_old_tcp_names_resolve_from_the_transport_package() -> None:
    from hurray_vllm.transport import tcp

    with pytest.warns(DeprecationWarning, match=r"transport\.tcp\.Receiver"):
        from hurray_vllm.transport import Receiver
    assert Receiver is tcp.Receiver
    with pytest.raises(AttributeError):
        _ = importlib.import_module("hurray_vllm.transport").nothing


def test_the_old_validate_module_stays_callable(monkeypatch: pytest.MonkeyPatch) -> None:
    from hurray_vllm.containers import check

    monkeypatch.delitem(sys.modules, "hurray_vllm.validate", raising=False)
    monkeypatch.setattr(hv, "validate", hv.validate)
    with pytest.warns(DeprecationWarning, match="containers.check"):
        old = importlib.import_module("hurray_vllm.validate")
    assert old.validate is check.validate
    assert callable(hv.validate)  # importing the module rebound the package's name to it
    assert not hv.validate(b"not a stream").ok


def test_the_old_command_line_module_runs() -> None:
    for args in (["-m", "hurray_vllm.cli", "--help"], ["-m", "hurray_vllm", "--help"]):
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 0 and "usage: hurray-vllm" in proc.stdout, proc.stderr


def test_exporter_internals_leave_the_package_namespace() -> None:
    import hurray_vllm.adapters.vllm as hvv
    from hurray_vllm.adapters.vllm import export

    assert "GatherBuffers" not in hvv.__all__ and "plan_batch" not in hvv.__all__
    for name in ("GatherBuffers", "plan_batch"):
        with pytest.warns(DeprecationWarning, match="adapters.vllm.export"):
            assert getattr(hvv, name) is getattr(export, name)
