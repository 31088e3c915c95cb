"""The tensor-parallel engines ``test_tp_connector.py`` and ``test_tp.py`` read: one session fixture, ``tp_engines``.

Seven engine runs of the tiny Llama (and an EAGLE head) at TP = 1 and 2,
at most one TP = 2 engine at a time beside a TP = 1 one (a core per rank):
see ``test_tp_connector.py`` for what each saves and loads. The two savers
also snapshot requests mid-decode for ``test_tp.py`` (``HURRAY_TEST_SNAPSHOT``).
Registered in ``tests/conftest.py``, so both modules share one run.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
from engine_script import run_engine_script
from prefetch import prefetched
from servers import receiver_process, side_by_side
from tiny_models import build_tiny_eagle, build_tiny_llama

from hurray_vllm.chunks import chunk_keys

__all__ = ["tp_engines"]


def _run(
    tmp: Path,
    name: str,
    store: Path,
    tp: int,
    url: str | None = None,
    save_async: bool = False,
    eagle: Path | None = None,
    snapshot: bool = False,
) -> dict[str, Any]:
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))} if tp > 1 else {}
    if save_async:
        env["HURRAY_TEST_SAVE_ASYNC"] = "1"
    if eagle is not None:
        env["HURRAY_TEST_EAGLE"] = str(eagle)
    if snapshot:
        env["HURRAY_TEST_SNAPSHOT"] = "1"
    args = [str(tmp / "model"), str(tmp / name), str(store), str(tp), *([url] if url else [])]
    return run_engine_script("tp_connector_run.py", args, tmp / name, f"TP={tp} engine {name}", env=env)


@pytest.fixture(scope="session")
@prefetched
def tp_engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every engine of both modules; at most one TP = 2 engine at a time, beside a TP = 1 one (a core per rank)."""
    from conftest import require

    require("transformers")
    require("vllm")
    tmp = tmp_path_factory.mktemp("tp-connector")
    build_tiny_llama(tmp / "model")
    head = build_tiny_eagle(tmp / "eagle")
    one, two, eagle = tmp / "store-tp1", tmp / "store-tp2", tmp / "store-eagle"
    pushed1, pushed2 = tmp / "pushed-tp1", tmp / "pushed-tp2"
    runs: dict[str, Any] = {
        "tmp": tmp,
        "stores": {"one": one, "two": two, "pushed1": pushed1, "pushed2": pushed2, "eagle": eagle},
    }
    with (
        receiver_process(pushed1, tmp / "receiver1.log") as url1,
        receiver_process(pushed2, tmp / "receiver2.log") as url2,
    ):
        # The TP = 2 saver with the default background saves: each rank's writer writes and pushes.
        runs |= side_by_side(
            {
                "save2": lambda: _run(tmp, "save2", two, 2, url2, save_async=True, snapshot=True),
                "save1": lambda: _run(tmp, "save1", one, 1, url1, snapshot=True),
            }
        )
    # What the receivers got, beside the shared stores, before the loads (which save what they recompute).
    runs["listings"] = {name: _listing(runs["stores"][name]) for name in ("one", "two", "pushed1", "pushed2")}
    # The loading engines push on what they load: the next hop gets the very files, each once, whichever
    # TP degree wrote them and loads them.
    on21, on12 = tmp / "on-from-load21", tmp / "on-from-load12"
    runs["stores"] |= {"on21": on21, "on12": on12}
    with receiver_process(on21, tmp / "receiver3.log") as url3, receiver_process(on12, tmp / "receiver4.log") as url4:
        runs |= side_by_side(
            {
                "load12": lambda: _run(tmp, "load12", pushed1, 2, url4),
                "load21": lambda: _run(tmp, "load21", pushed2, 1, url3),  # what the TP = 2 ranks pushed over TCP
            }
        )
    runs["eagle-save2"] = _run(tmp, "eagle-save2", eagle, 2, eagle=head)
    for store in (two, eagle):  # one rank's slice of "d"'s second chunk never arrived
        _drop_slice(store, runs["save2"])
    runs |= side_by_side(
        {
            "load22": lambda: _run(tmp, "load22", two, 2),
            "eagle-load1": lambda: _run(tmp, "eagle-load1", eagle, 1, eagle=head),
        }
    )
    return runs


def _listing(store: Path) -> dict[str, str]:
    """A store's chunk files and their digests."""
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest() for p in store.rglob("*.hrry")}


def _drop_slice(store: Path, run: dict[str, Any]) -> None:
    """Delete rank 1's slice of prompt "d"'s second chunk from ``store``."""
    (ns,) = [p.name for p in store.iterdir() if p.is_dir()]
    key = chunk_keys(run["prompts"]["d"], run["chunk_tokens"], ns)[1]
    (store / ns / f"{key}.h1-2.hrry").unlink()
