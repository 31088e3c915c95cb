"""HurrayConnector between engines of different tensor parallelism (CPU, one core per rank), through a store and TCP.

A TP = 2 engine saves each chunk as two slices of one KV head each
(``<key>.h0-1``, ``<key>.h1-2``), in each rank's background writer (the
default); a TP = 1 engine saves whole chunks, synchronously. Each
loads the other's: greedy tokens identical to an unmoved TP = 1 run, every
whole chunk loaded. A slice deleted from the store leaves its chunk
incomplete: never loaded, recomputed.

Both savers also push what they save to a ``hurray-vllm receive`` process
(``hurray_url``; at TP = 2 each rank pushes its own slices). The pushed store
holds the very files of the shared one, byte for byte, and the TP 2 -> 1 and
1 -> 2 loads read the pushed stores: every pair of degrees is covered over
TCP or through a shared directory, on identical bytes. Those two loading
engines push on what they loaded to receivers of their own, each file once.

Prompt "d" shares nothing with the others: one rank's slice of its second
chunk is deleted from the TP = 2 savers' stores that the TP 2 -> 2 load and
the EAGLE engines' TP 2 -> 1 load read. Both load its first chunk only.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from hurray_vllm.chunks import chunk_keys

pytestmark = [pytest.mark.vllm]


def test_a_tp2_engine_saves_one_slice_per_rank(tp_engines: dict[str, Any]) -> None:
    assert tp_engines["save2"]["save_async"] and tp_engines["save2"]["flushed"] == [True, True]
    files = tp_engines["save2"]["files"]
    assert files and all(f.endswith((".h0-1.hrry", ".h1-2.hrry")) for f in files)
    assert {f.removesuffix(".h0-1.hrry") for f in files if ".h0-1" in f} == {
        f.removesuffix(".h1-2.hrry") for f in files if ".h1-2" in f
    }
    assert not any(re.search(r"\.h\d+-\d+\.hrry$", f) for f in tp_engines["save1"]["files"])  # TP = 1: whole


@pytest.mark.parametrize(("shared", "pushed"), [("one", "pushed1"), ("two", "pushed2")])
def test_pushed_chunks_are_the_shared_stores_files_byte_for_byte(
    tp_engines: dict[str, Any], shared: str, pushed: str
) -> None:
    """Every rank's slices (or the TP = 1 engine's chunks) reach the receiver whole and unchanged."""
    a, b = tp_engines["listings"][shared], tp_engines["listings"][pushed]
    assert a and a == b


@pytest.mark.parametrize(("loaded", "on"), [("pushed2", "on21"), ("pushed1", "on12")])
def test_an_engine_pushes_on_the_chunks_it_loaded(tp_engines: dict[str, Any], loaded: str, on: str) -> None:
    """TP = 1 loading TP = 2's slices, and TP = 2 loading whole chunks: the next hop can load each chunk.

    It gets the loading engine's files, byte for byte (the slices, or each whole file from rank 0 alone).
    """
    from hurray_vllm.chunks import DirectoryStore

    a, b = tp_engines["stores"][loaded], tp_engines["stores"][on]
    (ns,) = [p.name for p in a.iterdir() if p.is_dir()]
    prompts, chunk = tp_engines["save1"]["prompts"], tp_engines["save1"]["chunk_tokens"]
    keys = {k for p in prompts.values() for k in chunk_keys(p[: (len(p) - 1) // chunk * chunk], chunk, ns)}
    assert len(keys) == 6  # the whole chunks the prompts load ("b"'s are "a"'s, "c" has none)
    assert all(DirectoryStore(b).parts(ns, k, 2) is not None for k in keys)
    files = sorted(p.relative_to(b) for p in b.rglob("*.hrry"))
    assert {f.name.split(".")[0] for f in files} == keys  # nothing else: the loading engines computed no chunk
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    # Nothing was written again beside what the loading engine found (a whole chunk beside TP = 2's slices):
    # both stores hold the saver's kind of file only.
    slices = loaded == "pushed2"
    for store in (a, b):
        found = [p.name for p in store.rglob("*.hrry") if p.name.split(".")[0] in keys]
        assert found and all(bool(re.search(r"\.h\d+-\d+\.hrry$", n)) == slices for n in found), found


@pytest.mark.parametrize("run", ["load21", "load12", "load22"])
def test_chunks_load_across_tp_degrees_with_identical_tokens(tp_engines: dict[str, Any], run: str) -> None:
    loaded, unmoved = tp_engines[run], tp_engines["save1"]
    assert loaded["outputs"] == unmoved["outputs"]
    # Every whole chunk of the prompt but the last token's: 96 of 100 and 64 of 71 tokens.
    assert loaded["cached"]["a"] == 96 and loaded["cached"]["b"] == 64
    assert loaded["scheduler_stats"]["chunks_refused"] == 0


@pytest.mark.parametrize("run", ["load22", "eagle-load1"])
def test_a_chunk_with_a_slice_missing_is_never_loaded(tp_engines: dict[str, Any], run: str) -> None:
    """At a TP = 2 destination, whose rank 0 holds the slice that is still there, and at a TP = 1 one."""
    loaded = tp_engines[run]
    assert loaded["cached"]["d"] == 32  # chunk 0 only: chunk 1 is incomplete, so nothing after it loads
    unmoved = tp_engines["eagle-save2" if run == "eagle-load1" else "save1"]
    assert loaded["outputs"]["d"] == unmoved["outputs"]["d"]  # recomputed


@pytest.fixture(scope="module")
def eagle_runs(tp_engines: dict[str, Any]) -> dict[str, Any]:
    """An EAGLE engine at TP = 2 saving into a store of its own, then one at TP = 1 loading from it."""
    return {
        "store": tp_engines["stores"]["eagle"],
        "save": tp_engines["eagle-save2"],
        "load": tp_engines["eagle-load1"],
    }


def test_an_eagle_engine_at_tp2_saves_slices_with_the_heads_layer_and_one_at_tp1_loads_them(
    eagle_runs: dict[str, Any],
) -> None:
    """The EAGLE head's layer is split over the ranks like the model's: its KV travels in the same slices."""
    store, save, load = eagle_runs["store"], eagle_runs["save"], eagle_runs["load"]
    assert load["outputs"] == save["outputs"]
    # Every whole chunk, from the TP = 2 slices ("d"'s second chunk lost a slice: see above).
    assert load["cached"] == {"a": 96, "b": 64, "c": 0, "d": 32}
    import hurray_vllm as hv

    (ns,) = [p for p in store.iterdir() if p.is_dir()]
    part = hv.load(next(ns.glob("*.h0-1.hrry")))
    assert part.num_layers == 3 and part[2, "key"].num_heads == 1  # the head's layer, one of two KV heads


def test_snapshot_ranks_of_an_eagle_engine_at_tp2_name_the_models_layers(eagle_runs: dict[str, Any]) -> None:
    """Each rank's file holds its heads of the head's layer too, and says which layers are the model's."""
    import hurray_vllm as hv
    from hurray_vllm.kv.heads import concat_heads
    from hurray_vllm.kv.snapshot import TARGET_LAYERS, HeadRange

    run = eagle_runs["save"]
    live = run["live"]
    assert live["ranks"] == ["ranks/rank0.heads0-1.hrrs", "ranks/rank1.heads1-2.hrrs"]
    slices = [hv.load(run["dir"] / p) for p in live["ranks"]]
    assert [s.heads for s in slices] == [HeadRange(0, 1, 2), HeadRange(1, 2, 2)]
    assert all(s.num_layers == 3 and s.extra[TARGET_LAYERS] == 2 for s in slices)
    whole = hv.load(run["dir"] / live["snap"])
    assert whole.extra[TARGET_LAYERS] == 2
    joined = concat_heads(slices).without_drafter()
    model = whole.without_drafter()
    assert joined.num_layers == model.num_layers == 2 and joined.token_ids == model.token_ids
    for x, y in zip(model.tensors(), joined.tensors(), strict=True):
        assert torch.equal(x.page_pool.view(torch.uint8), y.page_pool.view(torch.uint8))
