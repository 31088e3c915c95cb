"""The worker's load path without an engine: what it holds while it writes, what it checks first, how it fails.

* A load holds one layer's pages at a time: an fp8 chunk's pages are
  dequantized (float32, four times their size) and a chunk stored in pages
  of another size repaged only as each layer is written, not all of them
  before the first write. Everything the data decides is still checked
  before the first block is touched; memory running out half-way fails the
  load, reported as vLLM expects.
* A load whose engine blocks do not match its chunks' pages is refused
  before the first write, per KV cache group (a sliding-window group's
  table counts vLLM's null blocks).
* A model of several KV cache groups loads asynchronously whatever the
  executor (vLLM 0.32 stops the engine on a failed block of such a model):
  a worker in the scheduler's process still writes the chunks handed over,
  and a load it fails fails the request alone.
"""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import connector_parts
import pytest
import torch
from bare_worker import CHUNK, bare_worker, cpu_worker, stored_at_tp, two_chunks
from conftest import require

import hurray_vllm as hv
from hurray_vllm.adapters.vllm.cache import EngineCache, write_blocks
from hurray_vllm.adapters.vllm.export import SequenceState, export_snapshot
from hurray_vllm.adapters.vllm.layouts import LogicalBHNC
from hurray_vllm.chunks.keys import chunks_of, namespace_of
from hurray_vllm.chunks.store import DirectoryStore, store_snapshot
from hurray_vllm.kv.repage import repage_snapshot

H, D, PAGE = 2, 16, 4  # chunks of CHUNK (8) tokens stored from blocks of PAGE
SCALES = [(0.5, 0.25), (0.75, 1.5)]  # an fp8 cache's per-layer (k, v) scales


@pytest.fixture
def worker_mod() -> ModuleType:
    require("vllm")
    import hurray_vllm.adapters.vllm.connector.worker as w
    from hurray_vllm.adapters.vllm.connector.metadata import forget_verified_chunks

    forget_verified_chunks()
    return w


def _cache(block: int, *, fp8: bool, blocks: int = 8) -> EngineCache:
    """A GPU backend's logical ``[B, H, N, 2*D]`` cache of 2 layers (on the CPU), fp8 with :data:`SCALES` or bf16."""
    return EngineCache(
        caches=[torch.zeros((blocks, H, block, 2 * D), dtype=torch.uint8 if fp8 else torch.bfloat16) for _ in "ab"],
        layer_names=["l0", "l1"],
        layout=LogicalBHNC(D),
        layout_name=LogicalBHNC(D).name,
        storage_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
        model_dtype=torch.bfloat16,
        kv_cache_dtype="fp8" if fp8 else "auto",
        kv_scales=SCALES if fp8 else None,
        fingerprint=hv.ModelFingerprint("LlamaForCausalLM", 2, H, D, "float8_e4m3" if fp8 else "bfloat16"),
        block_size=block,
        engine="vllm test",
    )


def _stored(tmp_path: Path, *, fp8: bool) -> tuple[DirectoryStore, str, list[str], EngineCache]:
    """Two chunks (16 tokens) computed into blocks 1-4 of a cache of blocks of :data:`PAGE`, stored."""
    src = _cache(PAGE, fp8=fp8)
    gen = torch.Generator().manual_seed(3)
    for layer in range(2):
        k, v = ((torch.randn((4, PAGE, H, D), generator=gen) * 2).to(torch.bfloat16) for _ in "kv")
        write_blocks(src, layer, torch.tensor([1, 2, 3, 4]), k, v)
    seq = SequenceState("r", [1, 2, 3, 4], 2 * CHUNK, list(range(100, 101 + 2 * CHUNK)))
    snap = export_snapshot(src.caches, src.layout, [seq], **src.export_options())
    assert snap.fingerprint is not None and (snap.kv_scales is not None) is fp8
    store = DirectoryStore(tmp_path / "store")
    assert store_snapshot(store, snap, CHUNK) == 2
    return store, namespace_of(snap.fingerprint), [k for k, _ in chunks_of(snap, CHUNK)], src


def _task(store: DirectoryStore, ns: str, keys: list[str], blocks: list[int], **kw: Any) -> Any:
    from hurray_vllm.adapters.vllm.connector.metadata import LoadTask

    parts = [store.parts(ns, k, H) for k in keys]
    verified = [[(p.name, p.heads.start, p.heads.stop, p.identity) for p in ps] for ps in parts if ps is not None]
    tokens = [list(range(100 + c * CHUNK, 100 + (c + 1) * CHUNK)) for c in range(2)]
    return LoadTask("r", keys, tokens, blocks, verified, **kw)


def _blocks(block: int) -> list[int]:
    return [5, 2, 7, 1][: 2 * CHUNK // block]


def _as_before(store: DirectoryStore, ns: str, keys: list[str], block: int, fp8: bool) -> EngineCache:
    """The cache the load wrote before it built pages lazily: each chunk repaged whole, every layer's
    pages dequantized up front (``pool.float() * scale``), then written."""
    ref = _cache(block, fp8=fp8)
    per = CHUNK // block
    for c, key in enumerate(keys):
        chunk = repage_snapshot(store.get(ns, key), block)
        ids = torch.tensor(_blocks(block)[c * per : (c + 1) * per])
        for layer in range(2):
            pools = []
            for t in chunk.layer(layer):
                ptr = t.seq_ptr.tolist()
                pools.append(t.page_pool[t.block_table[ptr[0] : ptr[1]]])
            if chunk.kv_scales is not None:
                pools = [p.float() * s for p, s in zip(pools, chunk.kv_scales[layer], strict=True)]
            write_blocks(ref, layer, ids, *pools)
    return ref


@pytest.mark.parametrize(
    ("fp8", "block"),
    [(True, PAGE), (True, 2 * PAGE), (False, 2 * PAGE)],
    ids=["fp8", "fp8-repaged", "bf16-repaged"],
)
def test_a_load_holds_one_layers_pages_at_a_time_and_writes_the_same_bytes(
    worker_mod: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fp8: bool, block: int
) -> None:
    """Before, every layer of every chunk was dequantized (and repaged) before the first write and held until
    the last: a 70B fp8 model loading 32k tokens held ~20 GiB of float32 at once."""
    store, ns, keys, src = _stored(tmp_path, fp8=fp8)
    dst = _cache(block, fp8=fp8)
    w = bare_worker(store, ns, dst.fingerprint, dst, CHUNK)
    held: list[weakref.ref[torch.Tensor]] = []  # the memory of every write's pages so far
    live: list[int] = []  # at each write: how many earlier writes' pages are still alive
    real = worker_mod.write_blocks

    def spy(ec: EngineCache, layer: int, ids: torch.Tensor, *pools: torch.Tensor, heads: Any = None) -> None:
        live.append(sum(r() is not None for r in held))
        assert all(p.dtype == (torch.float32 if fp8 else torch.bfloat16) for p in pools)
        # The tensor owning the memory: a view of a repaged pool keeps the whole pool alive.
        held.extend(weakref.ref(p if p._base is None else p._base) for p in pools)
        real(ec, layer, ids, *pools, heads=heads)

    monkeypatch.setattr(worker_mod, "write_blocks", spy)
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata

    w.start_load_kv(HurrayConnectorMetadata(loads=[_task(store, ns, keys, _blocks(block))]))
    assert not w.get_block_ids_with_load_errors() and w.stats.chunks_loaded == 2
    assert len(live) == 4 and live == [0, 0, 0, 0]  # 2 layers x 2 chunks, each freed before the next is built
    ref = _as_before(store, ns, keys, block, fp8)
    assert all(torch.equal(a, b) for a, b in zip(dst.caches, ref.caches, strict=True))
    ids = torch.tensor(_blocks(block))
    for layer in range(2):  # and what was computed, token for token (fp8: quantized again with the same scales)
        got = dst.layout.gather(dst.caches[layer], ids)
        want = src.layout.gather(src.caches[layer], torch.tensor([1, 2, 3, 4]))
        for g, x in zip(got, want, strict=True):
            assert torch.equal(g.reshape(2 * CHUNK, H, D), x.reshape(2 * CHUNK, H, D)), layer


@pytest.mark.parametrize("report", [False, True])
def test_memory_running_out_between_writes_fails_the_load_as_vllm_expects(
    worker_mod: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report: bool
) -> None:
    """Repaging (and dequantizing) happens between the writes, after every check: running out of memory
    there leaves a part of the load written, and is reported as a failed load, never as loaded."""
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata

    store, ns, keys, _ = _stored(tmp_path, fp8=True)
    dst = _cache(2 * PAGE, fp8=True)
    w = bare_worker(store, ns, dst.fingerprint, dst, CHUNK)
    events: list[str] = []
    real_repage, real_write = worker_mod.repage_into, worker_mod.write_blocks

    def repage(*args: Any) -> None:
        events.append("repage")
        if events.count("repage") > 2:  # the second write's keys
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        real_repage(*args)

    def write(*args: Any, **kwargs: Any) -> None:
        events.append("write")
        real_write(*args, **kwargs)

    monkeypatch.setattr(worker_mod, "repage_into", repage)
    monkeypatch.setattr(worker_mod, "write_blocks", write)
    w.start_load_kv(HurrayConnectorMetadata(loads=[_task(store, ns, keys, _blocks(2 * PAGE), report=report)]))
    # Lazily: a layer is repaged (its keys, then its values) as it is written, after the plan (which repages
    # nothing).
    assert events == ["repage", "repage", "write", "repage"]
    assert dst.caches[0].any()  # the first write happened: only a report keeps vLLM from reading it
    assert w.stats.loads_failed == 1 and w.stats.chunks_loaded == 0
    if report:  # the request fails alone (a model of several KV cache groups takes nothing else)
        assert w.get_transfer_results() == ({"r"}, {"r"}) and not w.get_block_ids_with_load_errors()
    else:
        assert w.get_block_ids_with_load_errors() == set(_blocks(2 * PAGE)) and w._failed_steps == 1


def _plan(w: Any, task: Any) -> Any:
    ec = w._ec
    return w._plan_writes(ec, task, [w._chunk_for_load(ec, task, c) for c in range(len(task.keys))])


@pytest.mark.parametrize("blocks", [[5, 2, 7], [5, 2, 7, 1, 3]], ids=["short", "long"])
def test_engine_blocks_that_do_not_match_the_pages_are_refused_before_any_write(
    worker_mod: ModuleType, tmp_path: Path, blocks: list[int]
) -> None:
    """Before, a short table was caught only inside the writes (after earlier layers were written), and on a
    quantized CPU cache handed vLLM's op fewer slots than values."""
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata

    store, ns, keys, _ = stored_at_tp(tmp_path, 1)
    w = cpu_worker(store, ns)
    task = _task(store, ns, keys, blocks)
    with pytest.raises(hv.HurrayFormatError, match="4 blocks") as err:
        _plan(w, task)
    assert err.value.field == "block_ids"
    w.start_load_kv(HurrayConnectorMetadata(loads=[task]))
    assert w.get_block_ids_with_load_errors() == set(blocks) and not any(c.any() for c in w._ec.caches)
    # A local prefix-cache hit inside the first chunk: its skipped block is not among the engine blocks.
    assert len(_plan(w, dataclasses.replace(task, block_ids=[2, 7, 1], skip_blocks=1))) == 2 * 2


def test_a_sliding_window_groups_table_counts_its_null_blocks(worker_mod: ModuleType, tmp_path: Path) -> None:
    """Out of its window a group's blocks are vLLM's null block 0, kept in the table: nothing is written there.
    A table without them (null blocks dropped) no longer lines up with the pages, and is refused."""
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    w = cpu_worker(store, ns)
    w._layer_groups, w._windows = {"l0": 0, "l1": 1}, (8, None)
    groups = [[0, 0, 7, 1], [6, 2, 5, 4]]
    bad = _task(store, ns, keys, groups[0], groups=[[7, 1], groups[1]])
    with pytest.raises(hv.HurrayFormatError, match="group 0 has 2") as err:
        _plan(w, bad)
    assert err.value.field == "block_ids"
    task = _task(store, ns, keys, groups[0], groups=groups, report=True)
    w.start_load_kv(HurrayConnectorMetadata(loads=[task]))
    assert w.get_transfer_results() == ({"r"}, set())
    ec = w._ec
    k, _ = ec.layout.gather(ec.caches[0], torch.tensor([7, 1]))  # the window's pages only
    assert torch.equal(k, snap.layer(0)[0].page_pool[2:])
    k, _ = ec.layout.gather(ec.caches[1], torch.tensor(groups[1]))  # every page
    assert torch.equal(k, snap.layer(1)[0].page_pool)


def _output() -> SimpleNamespace:
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={})


@pytest.mark.parametrize("backend", ["uni", "external_launcher", "mp", "ray", None])
def test_a_hybrid_loads_asynchronously_whatever_the_executor(backend: str | None) -> None:
    """A worker in the scheduler's process can fail a load too (memory): with several KV cache groups a
    failed block would stop vLLM 0.32's engine, a failed request is recomputed."""
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.config import _async_loads

    cfg = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend, world_size=1))
    assert _async_loads(cfg, SimpleNamespace(kv_cache_groups=[object()] * 2)) is True  # type: ignore[arg-type]
    assert _async_loads(cfg, SimpleNamespace(kv_cache_groups=[object()])) is False  # type: ignore[arg-type]


def test_a_worker_in_the_schedulers_process_loads_a_hybrid_asynchronously_from_what_it_was_handed(
    worker_mod: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's uni executor: the asynchronous load carries the snapshots the scheduler verified to the worker,
    which writes them though the files are gone; a load it then fails fails the request, not its blocks."""
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, forget_verified_chunks
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    vllm_config = connector_parts.vllm_config({"hurray_path": str(tmp_path), "hurray_chunk_tokens": CHUNK}, PAGE)
    vllm_config.parallel_config.distributed_executor_backend = "uni"
    kv = SimpleNamespace(kv_cache_groups=[object(), object()])  # what _async_loads reads of it
    cfg = HurrayConfig.from_vllm(vllm_config, None)  # type: ignore[arg-type]
    from hurray_vllm.adapters.vllm.connector.config import _async_loads

    cfg = dataclasses.replace(
        cfg,
        async_loads=_async_loads(vllm_config, kv),  # type: ignore[arg-type]
        layer_groups={"l0": 0, "l1": 1},
        group_windows=(8, None),
    )
    assert cfg.async_loads and cfg.worker_in_process
    tokens = list(snap.token_ids[0])
    request = SimpleNamespace(request_id="r", all_token_ids=tokens, num_prompt_tokens=len(tokens))
    sched = HurrayScheduler(cfg, store, snap.fingerprint, ns)
    assert sched.get_num_new_matched_tokens(request, 0) == (16, True)  # type: ignore[arg-type]
    groups = ([0, 0, 7, 1, 3], [6, 2, 5, 4, 3])
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: groups), 16)  # type: ignore[arg-type]
    (load,) = sched.build_connector_meta(_output()).loads  # type: ignore[arg-type]
    assert load.report and load.groups == [[0, 0, 7, 1], [6, 2, 5, 4]] and len(load.snaps) == 2
    for f in store.path(ns, keys[0]).parent.iterdir():
        f.unlink()
    forget_verified_chunks()  # nothing to read: only what was handed over

    def worker() -> Any:
        w = cpu_worker(store, ns)
        w._layer_groups, w._windows = cfg.layer_groups, cfg.group_windows
        return w

    w = worker()
    w.start_load_kv(HurrayConnectorMetadata(loads=[load]))
    assert w.get_transfer_results() == ({"r"}, set()) and w.stats.chunks_loaded == 2
    k, _ = w._ec.layout.gather(w._ec.caches[1], torch.tensor([6, 2, 5, 4]))
    assert torch.equal(k, snap.layer(1)[0].page_pool)

    calls: list[int] = []
    real = worker_mod.write_blocks

    def short_of_memory(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) > 1:
            raise torch.OutOfMemoryError("out of memory (a test's)")
        real(*args, **kwargs)

    monkeypatch.setattr(worker_mod, "write_blocks", short_of_memory)
    w = worker()
    w.start_load_kv(HurrayConnectorMetadata(loads=[load]))
    assert w.get_transfer_results() == ({"r"}, {"r"})
    assert not w.get_block_ids_with_load_errors()  # which would stop vLLM's engine for two groups
    sched.update_connector_output({"r"})  # vLLM recomputes it, and the scheduler offers it nothing again
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # type: ignore[arg-type]


@pytest.mark.parametrize("replaced", [False, True], ids=["damaged", "replaced-meanwhile"])
def test_a_file_a_worker_finds_damaged_is_moved_aside_unless_replaced_meanwhile(
    worker_mod: ModuleType, tmp_path: Path, replaced: bool
) -> None:
    """Found by a review: a slice truncated between the lookup and the load was reported but left in place. Its
    set still counted as stored: the recompute's save skipped the chunk, and every later lookup read and refused
    the slice again. Moved aside (the file the worker read: the lookup's identity is gone), the save writes it
    again; a good file renamed over it since the worker read it stays."""
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, LoadTask

    store, ns, keys, snap = stored_at_tp(tmp_path, 2)
    parts = [store.parts(ns, k, H) for k in keys]
    assert all(ps is not None and len(ps) == 2 for ps in parts)
    verified = [[(p.name, p.heads.start, p.heads.stop, p.identity) for p in ps or []] for ps in parts]
    tokens = [list(snap.token_ids[0][c * CHUNK : (c + 1) * CHUNK]) for c in range(2)]
    task = LoadTask("r", keys, tokens, [1, 2, 3, 4], verified)
    damaged = store.path(ns, verified[1][0][0])
    good = damaged.read_bytes()
    damaged.write_bytes(good[: len(good) // 2])  # after the lookup: torn by a full disk, a bad copy
    w = cpu_worker(store, ns)
    if replaced:  # a producer renames a good copy over it after the worker read the torn one
        real = w._store.get

        def get(namespace: str, name: str, **kwargs: Any) -> Any:
            try:
                return real(namespace, name, **kwargs)
            finally:
                if name == damaged.name.removesuffix(".hrry"):
                    fresh = damaged.with_name("fresh")
                    fresh.write_bytes(good)
                    fresh.replace(damaged)

        w._store = SimpleNamespace(get=get, identity=store.identity, quarantine=store.quarantine)
    w.start_load_kv(HurrayConnectorMetadata(loads=[task]))
    assert w.get_block_ids_with_load_errors() == {1, 2, 3, 4} and w.stats.loads_failed == 1
    bad = damaged.with_name(damaged.name + ".bad")
    if replaced:
        assert damaged.read_bytes() == good and not bad.exists() and w.stats.chunks_quarantined == 0
        assert store.parts(ns, keys[1], H) is not None
    else:  # the set is incomplete: the recompute's save writes the chunk again
        assert not damaged.exists() and bad.exists() and w.stats.chunks_quarantined == 1
        assert store.parts(ns, keys[1], H) is None


def test_a_load_skipping_a_prefix_hit_writes_each_page_into_its_own_block(
    worker_mod: ModuleType, tmp_path: Path
) -> None:
    """Found by mutation testing: with a local prefix-cache hit inside the first chunk (``skip_blocks``), each
    chunk's pages must land in the engine blocks after the skipped ones, chunk 0 from its page ``skip`` on and
    every later chunk from its first page. Only the number of writes was checked: blocks shifted by the skip
    (or a later chunk's first page dropped) went unnoticed."""
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    w = cpu_worker(store, ns)
    blocks = [2, 7, 1]  # not contiguous: engine blocks for the snapshot's pages 1..3 (page 0 the engine holds)
    w.start_load_kv(HurrayConnectorMetadata(loads=[_task(store, ns, keys, blocks, skip_blocks=1, report=True)]))
    assert w.get_transfer_results() == ({"r"}, set()) and not w.get_block_ids_with_load_errors()
    ec = w._ec
    for layer in range(2):
        got = ec.layout.gather(ec.caches[layer], torch.tensor(blocks))
        for role, have, t in zip("kv", got, snap.layer(layer), strict=True):
            ptr = t.seq_ptr.tolist()
            want = t.page_pool[t.block_table[ptr[0] : ptr[1]][1:]]
            for i, block in enumerate(blocks):
                assert torch.equal(have[i], want[i]), f"layer {layer} {role}: block {block} lacks page {i + 1}"
    untouched = [b for b in range(8) if b not in blocks]
    assert not any(c[untouched].any() for c in ec.caches)


@pytest.mark.parametrize(("kv_start", "refused"), [(9, True), (8, False)], ids=["inside-a-page", "at-a-page"])
def test_a_chunk_whose_window_starts_inside_a_page_the_engine_keeps_is_refused(
    worker_mod: ModuleType, tmp_path: Path, kv_start: int, refused: bool
) -> None:
    """Found by mutation testing: a sliding-window page counts as held only when it lies wholly at or after the
    chunk's first held token. A page the window starts inside lacks its first tokens' KV: the worker's own plan
    refuses it before any write, where a page it holds from its first token on loads."""
    snap = dataclasses.replace(
        two_chunks(), windows=hv.SlidingWindows((CHUNK, None), ((kv_start,), (0,)))
    )  # the second chunk's layer 0 holds tokens from kv_start - 8 on (page 0 is tokens 0-3)
    store = DirectoryStore(tmp_path / "store")
    assert store_snapshot(store, snap, CHUNK) == 2
    keys = [k for k, _ in chunks_of(snap, CHUNK)]
    assert snap.fingerprint is not None
    ns = namespace_of(snap.fingerprint)
    assert store.get(ns, keys[1]).windows == hv.SlidingWindows((CHUNK, None), ((kv_start - CHUNK,), (0,)))
    w = cpu_worker(store, ns)
    w._layer_groups, w._windows = {"l0": 0, "l1": 1}, (CHUNK, None)
    groups = [[0, 0, 7, 1], [6, 2, 5, 4]]  # layer 0's window: the second chunk's pages (engine blocks 7, 1)
    task = _task(store, ns, keys, groups[0], groups=groups)
    if not refused:
        assert len(_plan(w, task)) == 1 + 2  # layer 0: the second chunk only; layer 1: both
        return
    with pytest.raises(hv.HurrayFormatError, match="lacks sliding-window tokens layer 0 needs") as err:
        _plan(w, task)
    assert err.value.field == "snapshot.windows"


@pytest.mark.parametrize(("taken", "loads"), [(2 * CHUNK, True), (2 * CHUNK - 1, False)], ids=["at-resume", "before"])
def test_a_hybrids_load_whose_last_chunk_holds_states_of_another_token_is_a_load_error(
    worker_mod: ModuleType, tmp_path: Path, caplog: pytest.LogCaptureFixture, taken: int, loads: bool
) -> None:
    """Found by mutation testing: the worker writes the last chunk's linear-attention states only when they were
    taken at the token the load resumes at. A chunk whose states are another token's (a producer's defect,
    consistent with its digest) must fail the load before any block is written, not run the request on from
    the state of another prefix."""
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata
    from hurray_vllm.adapters.vllm.states import StateCache
    from hurray_vllm.chunks.digest import DIGEST_KEY, chunk_digest

    bf16 = torch.bfloat16
    spec = hv.RecurrentStates(
        "gdn_attn", (2,), ("conv", "ssm"), (), declared=(((3, 8), "bfloat16"), ((2, 4, 4), "bfloat16"))
    )
    ones = ((torch.ones(1, 3, 8, dtype=bf16), torch.ones(1, 2, 4, 4, dtype=bf16)),)
    snap = dataclasses.replace(
        two_chunks(), states=dataclasses.replace(spec, positions=(2 * CHUNK,)).with_tensors(ones)
    )
    assert snap.fingerprint is not None
    store, ns = DirectoryStore(tmp_path / "store"), namespace_of(snap.fingerprint)
    chunks = chunks_of(snap, CHUNK)
    for key, chunk in chunks:
        if chunk.states is not None:  # the last chunk's: say they were taken at ``taken``, digest and all
            chunk = dataclasses.replace(chunk, states=dataclasses.replace(chunk.states, positions=(taken,)))
            chunk = dataclasses.replace(chunk, extra={k: v for k, v in chunk.extra.items() if k != DIGEST_KEY})
            chunk = dataclasses.replace(chunk, extra={**chunk.extra, DIGEST_KEY: chunk_digest(chunk)})
        store.put(ns, key, chunk)
    keys = [k for k, _ in chunks]
    assert store.get(ns, keys[1]).states.positions == (taken,)  # type: ignore[union-attr]
    w = cpu_worker(store, ns)
    memory = ((torch.zeros(5, 3, 8, dtype=bf16), torch.zeros(5, 2, 4, 4, dtype=bf16)),)
    w._ec = dataclasses.replace(
        w._ec, states=StateCache(spec, ("model.layers.2.linear_attn",), (1,), memory, ("", ""), 8, "none")
    )
    task = _task(store, ns, keys, [5, 2, 7, 1], resume=2 * CHUNK, state_blocks={1: [3]})
    w.start_load_kv(HurrayConnectorMetadata(loads=[task]))
    if loads:
        assert not w.get_block_ids_with_load_errors() and w.stats.loads_failed == 0
        assert all(bool((t[3] == 1).all()) for t in memory[0])
        return
    assert w.get_block_ids_with_load_errors() == {5, 2, 7, 1, 3} and w.stats.loads_failed == 1
    assert f"holds no states at token {2 * CHUNK}" in caplog.text  # that, not the digest or anything else
    assert not any(t.any() for t in memory[0]) and not any(c.any() for c in w._ec.caches)
