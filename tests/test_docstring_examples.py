"""Every ``>>>`` example in the package's docstrings runs and prints what it says, in a fresh directory.

The examples are the public entry points' documentation (``save``, ``load``,
``validate``, the importers, ``continue_generation``, the transport
factory...): a drifted example is a documentation bug, so it fails here.
Examples that need an engine or a GPU are marked ``# doctest: +SKIP`` and
say which test exercises them instead.
"""

from __future__ import annotations

import doctest
import importlib
import warnings
from pathlib import Path

import pytest
from conftest import require

import hurray_vllm

PACKAGE = Path(hurray_vllm.__file__).parent


def _modules_with_examples() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>>" in path.read_text():
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()

#: Modules whose every example is ``# doctest: +SKIP``: each must still have examples, but none runs here.
#: Any other module must run at least one (a module whose examples all skip would pass without checking any).
ALL_SKIPPED = {
    # snapshot()/snapshot_ranks() need a live vllm.LLM; tests/adapters/vllm/ exercises them on real engines.
    "hurray_vllm.adapters.vllm.engine",
    # ChunkReader's fragment needs a store holding chunks and a thread pool; tests/chunks/test_store.py runs it.
    "hurray_vllm.chunks.store",
}


def test_the_all_skipped_list_names_modules_with_examples() -> None:
    assert ALL_SKIPPED <= set(MODULES), ALL_SKIPPED - set(MODULES)


def test_the_documented_entry_points_have_examples() -> None:
    documented = ["containers.io", "containers.check", "adapters.transformers", "transport"]
    documented += ["adapters.flash_attn.importer", "adapters.flashinfer.importer"]
    documented += ["adapters.vllm.engine", "adapters.vllm.connector.config"]
    for name in documented:
        assert f"hurray_vllm.{name}" in MODULES, name


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # examples write files such as "kv.hrry" where they run
    if name.startswith("hurray_vllm.adapters.vllm"):
        require("vllm")  # a failure, not a skip, in CI
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # third-party deprecation noise is not the example's output
        module = importlib.import_module(name)
        finder = doctest.DocTestFinder(exclude_empty=True)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        tests = [t for t in finder.find(module, name) if t.examples]
        assert tests, f"{name} has no runnable examples"
        for test in tests:
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (output above)"
    if name in ALL_SKIPPED:
        assert sum(len(t.examples) for t in tests) > 0, f"{name} has no examples"
    else:
        assert result.attempted > 0, f"{name}: every example is +SKIP; run one or add it to ALL_SKIPPED with a reason"
