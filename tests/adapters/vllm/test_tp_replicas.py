"""GQA with fewer KV heads than tensor-parallel ranks, synthetically (issue 19).

The tiny CPU models run at TP = 2 with one KV head per rank; vLLM replicates
heads only when ``num_kv_heads < TP`` (2 heads at TP = 4: ranks 0 and 1 hold
head 0, ranks 2 and 3 head 1). Here the connector's worker is driven without
an engine: which ranks save (one per distinct head), and which file and
heads each rank of any TP degree loads from chunks stored at any other, down
to the bytes written into each rank's cache.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from bare_worker import CHUNK, HEADS, cpu_worker, stored_at_tp
from conftest import require

from hurray_vllm.chunks.keys import slice_key
from hurray_vllm.kv.snapshot import HeadRange


@pytest.fixture(scope="module")
def worker_mod() -> ModuleType:
    require("vllm")
    import hurray_vllm.adapters.vllm.connector.worker as w

    return w


def _vllm_config(tp: int, kv_heads: int = HEADS, mla: bool = False) -> SimpleNamespace:
    hf = SimpleNamespace(kv_lora_rank=16, qk_rope_head_dim=8, model_type="deepseek_v2")
    model = SimpleNamespace(get_total_num_kv_heads=lambda: kv_heads, use_mla=mla, hf_config=hf, hf_text_config=hf)
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp), model_config=model)


@pytest.mark.parametrize(
    ("kv_heads", "tp", "mla", "want"),
    [
        (2, 4, False, [((0, 1), True), ((0, 1), False), ((1, 2), True), ((1, 2), False)]),  # replicas
        (2, 2, False, [((0, 1), True), ((1, 2), True)]),
        (8, 4, False, [((0, 2), True), ((2, 4), True), ((4, 6), True), ((6, 8), True)]),
        (1, 2, False, [(None, True), (None, False)]),  # one KV head (MQA) on every rank: saved once, whole
        (1, 4, True, [(None, True), (None, False), (None, False), (None, False)]),  # an MLA latent: the same
    ],
)
def test_one_rank_per_distinct_head_range_saves(
    worker_mod: ModuleType, monkeypatch: pytest.MonkeyPatch, kv_heads: int, tp: int, mla: bool, want: list[Any]
) -> None:
    import vllm.distributed as dist

    from hurray_vllm.adapters.vllm.cache import rank_share

    got = []
    for rank in range(tp):
        monkeypatch.setattr(dist, "get_tensor_model_parallel_rank", lambda rank=rank: rank)
        heads, saves = rank_share(_vllm_config(tp, kv_heads, mla))
        got.append(((heads.start, heads.stop) if heads is not None else None, saves))
        if heads is not None:
            assert heads.total == kv_heads
    assert got == want


@pytest.mark.parametrize("producer_tp", [1, 2, 4])
@pytest.mark.parametrize("consumer_tp", [1, 2, 4])
def test_every_rank_loads_its_heads_from_chunks_stored_at_any_tp(
    worker_mod: ModuleType, tmp_path: Any, producer_tp: int, consumer_tp: int
) -> None:
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, LoadTask
    from hurray_vllm.kv.heads import rank_heads

    store, ns, keys, snap = stored_at_tp(tmp_path, producer_tp)
    parts = [store.parts(ns, k, HEADS) for k in keys]
    assert all(p is not None for p in parts)
    verified = [[(p.name, p.heads.start, p.heads.stop, p.identity) for p in ps] for ps in parts if ps is not None]
    if producer_tp > 1:  # 2 KV heads: at TP 2 and 4 alike, one slice per head, named for it
        assert [v[0] for v in verified[0]] == [slice_key(keys[0], range(0, 1)), slice_key(keys[0], range(1, 2))]
    blocks = [5, 2, 7, 1]  # two chunks of two blocks each, anywhere in the cache
    tokens = [list(snap.token_ids[0][c * CHUNK : (c + 1) * CHUNK]) for c in range(2)]
    for rank in range(consumer_tp):
        heads = rank_heads(HEADS, consumer_tp, rank)
        mine = HeadRange(heads.start, heads.stop, HEADS) if len(heads) < HEADS else None
        w = cpu_worker(store, ns, mine)
        task = LoadTask("r", keys, tokens, blocks, verified)
        w.start_load_kv(HurrayConnectorMetadata(loads=[task]))
        assert not w.get_block_ids_with_load_errors() and w.stats.chunks_loaded == 2
        ec = w._ec
        for layer in range(2):
            k, v = ec.layout.gather(ec.caches[layer], torch.tensor(blocks))  # [4, PAGE, h, DIM]
            want = [t.page_pool[:, :, heads.start : heads.stop] for t in snap.layer(layer)]
            assert torch.equal(k, want[0]) and torch.equal(v, want[1]), (producer_tp, consumer_tp, rank, layer)


def test_a_rank_whose_heads_no_stored_file_holds_refuses_the_load(worker_mod: ModuleType, tmp_path: Any) -> None:
    """Only head 0's slice of a chunk is named in the load: rank 1 of 2 finds nothing for head 1."""
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, LoadTask

    store, ns, keys, snap = stored_at_tp(tmp_path, 2)
    parts = [store.parts(ns, k, HEADS) for k in keys]
    only_first = [[(p.name, p.heads.start, p.heads.stop, p.identity) for p in ps[:1]] for ps in parts if ps]
    w = cpu_worker(store, ns, HeadRange(1, 2, HEADS))
    tokens = [list(snap.token_ids[0][c * CHUNK : (c + 1) * CHUNK]) for c in range(2)]
    w.start_load_kv(HurrayConnectorMetadata(loads=[LoadTask("r", keys, tokens, [5, 2, 7, 1], only_first)]))
    assert w.get_block_ids_with_load_errors() == {5, 2, 7, 1}
    assert not w._ec.caches[0].any()  # nothing written


class _Writer:
    max_bytes = 1 << 30

    def __init__(self) -> None:
        self.jobs: list[Any] = []

    def wait_for_room(self, nbytes: int) -> None:
        pass

    def submit(self, job: Any, nbytes: int) -> None:
        self.jobs.append(job)


class _States:  # the worker's state layers: only what _save_async looks at before its writer runs
    def gather(self, blocks: Any, positions: Any) -> Any:
        return SimpleNamespace(nbytes=0)


def test_a_rank_rewrites_its_own_slice_without_states_when_its_sibling_slice_is_missing(tmp_path: Path) -> None:
    """The scheduler sees no complete set (rank 1's slice queued, or failed): its task asks for no replace."""
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.metadata import SaveTask
    from hurray_vllm.adapters.vllm.connector.worker import _Staging
    from hurray_vllm.kv.snapshot import HeadRange

    store, ns, keys, snap = stored_at_tp(tmp_path, 2)
    store.path(ns, f"{keys[0]}.h1-2").unlink()  # rank 1's slice: still in its writer's queue, or its write failed
    assert not store.has_states(ns, f"{keys[0]}.h0-1") and store.parts(ns, keys[0], 2) is None
    # The scheduler sees no complete set, so it cannot ask for a replace: the task comes with replace=False.
    task = SaveTask("r", keys[0], list(snap.token_ids[0][:CHUNK]), [1, 2], state_blocks={0: [7]}, state_position=CHUNK)
    for rank in range(2):
        w = cpu_worker(store, ns, HeadRange(rank, rank + 1, 2))
        w._ec = dataclasses.replace(w._ec, states=_States())
        w._inflight, w._sender, w._push_paused_until, w._async = set(), None, 0.0, True
        w._staging, w._writer = _Staging(1 << 30), _Writer()
        w._save(SimpleNamespace(saves=[task]))
        # Both ranks write their slice with the states: none is left without them beside one with them.
        assert len(w._writer.jobs) == 1 and w.stats.chunks_skipped == 0, rank
        assert w._inflight == {f"{keys[0]}.h{rank}-{rank + 1}"}


def _layouts(kv_heads: int) -> list[int]:
    """The TP degrees vLLM runs a model of ``kv_heads`` KV heads at (among 1, 2, 3, 4, 6, 8)."""
    return [
        t for t in (1, 2, 3, 4, 6, 8) if (t <= kv_heads and kv_heads % t == 0) or (t > kv_heads and t % kv_heads == 0)
    ]


@pytest.mark.parametrize("kv_heads", [4, 6, 8])
def test_every_rank_of_any_degree_writes_its_heads_of_many_from_slices_of_any_degree(
    worker_mod: ModuleType, tmp_path: Path, kv_heads: int
) -> None:
    """A rank reads part of a slice (8 heads stored at TP 2, loaded at TP 4), joins slices (TP 4 -> 2), or
    both at once (6 heads, TP 3 -> 2): every rank's cache holds exactly its heads, byte for byte."""
    from bare_worker import two_chunks

    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, LoadTask
    from hurray_vllm.chunks.keys import chunks_of, namespace_of
    from hurray_vllm.chunks.store import DirectoryStore, store_snapshot
    from hurray_vllm.kv.heads import distinct_ranks, rank_heads, select_heads

    snap = two_chunks(kv_heads, seed=kv_heads)
    fp = snap.fingerprint
    assert fp is not None
    ns, keys = namespace_of(fp), [k for k, _ in chunks_of(snap, CHUNK)]
    tokens = [list(snap.token_ids[0][c * CHUNK : (c + 1) * CHUNK]) for c in range(2)]
    blocks = [5, 2, 7, 1]
    for producer in _layouts(kv_heads):
        store = DirectoryStore(tmp_path / f"tp{producer}")
        for r in distinct_ranks(kv_heads, producer):
            heads = rank_heads(kv_heads, producer, r)
            store_snapshot(store, select_heads(snap, heads) if len(heads) < kv_heads else snap, CHUNK)
        parts = [store.parts(ns, k, kv_heads) for k in keys]
        verified = [[(p.name, p.heads.start, p.heads.stop, p.identity) for p in ps or []] for ps in parts]
        assert all(verified), (producer, parts)
        for consumer in _layouts(kv_heads):
            for rank in range(consumer):
                heads = rank_heads(kv_heads, consumer, rank)
                mine = HeadRange(heads.start, heads.stop, kv_heads) if len(heads) < kv_heads else None
                worker = cpu_worker(store, ns, mine, kv_heads)
                ec = worker._ec
                worker.start_load_kv(HurrayConnectorMetadata(loads=[LoadTask("r", keys, tokens, blocks, verified)]))
                where = (producer, consumer, rank)
                assert not worker.get_block_ids_with_load_errors(), where
                for layer in range(2):
                    k, v = ec.layout.gather(ec.caches[layer], torch.tensor(blocks))
                    want = [t.page_pool[:, :, heads.start : heads.stop] for t in snap.layer(layer)]
                    assert torch.equal(k, want[0]) and torch.equal(v, want[1]), where
