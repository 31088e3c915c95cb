"""Loads reported per request (vLLM's asynchronous-load path), and the handoff to a worker in the scheduler's process.

vLLM 0.32 maps blocks a worker failed to load back to requests only for one
KV cache group; with several (sliding-window hybrids) it stops the engine.
For such a model the connector therefore loads through vLLM's asynchronous
path wherever its workers run: the worker reports each request as received
or failed, and vLLM recomputes a failed one. A worker in the scheduler's
process writes the snapshots the scheduler verified, handed over in the load
itself (never pickled), so no file it needs can vanish (it may still run out
of memory: ``test_worker_loads.py``); one in a process of its own reads the
files again. The real-engine test is ``test_hybrid_tp.py``.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from bare_worker import CHUNK, cpu_worker, stored_at_tp
from conftest import require
from connector_parts import vllm_config

BLOCKS = [5, 2, 7, 1]  # two chunks of two blocks each, anywhere in the cache


@pytest.fixture(autouse=True)
def _vllm() -> None:
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.metadata import forget_verified_chunks

    forget_verified_chunks()


def _load(store: Any, ns: str, keys: list[str], snap: Any, *, report: bool, handed: bool = False) -> Any:
    """A load of both chunks as the scheduler plans it (``handed``: with the snapshots it verified)."""
    from hurray_vllm.adapters.vllm.connector.metadata import LoadTask

    parts = [store.parts(ns, k, 2) for k in keys]
    verified = [[(p.name, p.heads.start, p.heads.stop, p.identity) for p in ps] for ps in parts]
    snaps = [[store.get(ns, p.name) for p in ps] for ps in parts] if handed else []
    tokens = [list(snap.token_ids[0][c * CHUNK : (c + 1) * CHUNK]) for c in range(2)]
    return LoadTask("r", keys, tokens, list(BLOCKS), verified, report=report, snaps=snaps)


def _written(w: Any, snap: Any) -> bool:
    ec = w._ec
    for layer in range(2):
        k, v = ec.layout.gather(ec.caches[layer], torch.tensor(BLOCKS))
        if not (torch.equal(k, snap.layer(layer)[0].page_pool) and torch.equal(v, snap.layer(layer)[1].page_pool)):
            return False
    return True


def test_an_async_load_reports_its_request_and_a_vanished_file_fails_it_not_its_blocks(tmp_path: Path) -> None:
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, forget_verified_chunks

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    w = cpu_worker(store, ns)
    w.start_load_kv(HurrayConnectorMetadata(loads=[_load(store, ns, keys, snap, report=True)]))
    assert w.get_transfer_results() == ({"r"}, set()) and w.get_transfer_results() == (set(), set())
    assert not w.get_block_ids_with_load_errors() and _written(w, snap)

    forget_verified_chunks()  # a worker process of its own: it has not seen these files
    w = cpu_worker(store, ns)
    task = _load(store, ns, keys, snap, report=True)
    store.path(ns, keys[1]).unlink()  # a prune between the scheduler's check and this worker's read
    w.start_load_kv(HurrayConnectorMetadata(loads=[task]))
    assert w.get_transfer_results() == ({"r"}, {"r"})  # received (the wait is over) and failed: recompute
    assert not w.get_block_ids_with_load_errors()  # which a model of several KV cache groups cannot take
    assert w.stats.loads_failed == 1 and w.stats.chunks_loaded == 0
    assert not w._ec.caches[0].any()  # nothing written: the first chunk's file was read, not written

    w = cpu_worker(store, ns)  # a synchronous load reports its blocks, as before
    w.start_load_kv(HurrayConnectorMetadata(loads=[dataclasses.replace(task, report=False)]))
    assert w.get_block_ids_with_load_errors() == set(BLOCKS) and w.get_transfer_results() == (set(), set())
    assert w._failed_steps == 1  # and this step's saves are not kept (the forward pass reads those blocks)


def test_a_worker_in_the_schedulers_process_writes_what_it_was_handed(tmp_path: Path) -> None:
    """The handed snapshots are written even when the files are gone and forgotten; pickling drops them."""
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, forget_verified_chunks

    store, ns, keys, snap = stored_at_tp(tmp_path, 2)  # slices: one file per head
    task = _load(store, ns, keys, snap, report=False, handed=True)
    for f in store.path(ns, keys[0]).parent.iterdir():
        f.unlink()
    forget_verified_chunks()  # as if the verified-chunk cache had evicted them meanwhile
    w = cpu_worker(store, ns)
    w.start_load_kv(HurrayConnectorMetadata(loads=[task]))
    assert not w.get_block_ids_with_load_errors() and w.stats.chunks_loaded == 2 and _written(w, snap)

    crossed = pickle.loads(pickle.dumps(HurrayConnectorMetadata(loads=[task]))).loads[0]
    assert crossed.snaps == [] and crossed.parts == task.parts and crossed.keys == task.keys
    assert task.snaps  # the original keeps them


def _output(new: list[Any] | None = None) -> SimpleNamespace:
    """A step's SchedulerOutput, as much of it as the connector reads."""
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=new or [], scheduled_cached_reqs=cached, num_scheduled_tokens={})


def test_the_scheduler_loads_asynchronously_and_offers_a_failed_request_nothing_again(tmp_path: Path) -> None:
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    cfg = HurrayConfig.from_vllm(vllm_config({"hurray_path": str(tmp_path), "hurray_chunk_tokens": CHUNK}, 4), None)  # type: ignore[arg-type]
    request = SimpleNamespace(request_id="r", all_token_ids=list(snap.token_ids[0]), kv_transfer_params=None)
    sched = HurrayScheduler(cfg, store, snap.fingerprint, ns)  # type: ignore[arg-type]
    assert sched.get_num_new_matched_tokens(request, 0) == (16, False)  # one group: synchronous

    sched = HurrayScheduler(dataclasses.replace(cfg, async_loads=True), store, snap.fingerprint, ns)  # type: ignore[arg-type]
    assert sched.get_num_new_matched_tokens(request, 0) == (16, True)
    # Blocks come with the allocation: the request is not scheduled in the step that loads it.
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([*BLOCKS, 3],)), 16)  # type: ignore[arg-type]
    (load,) = sched.build_connector_meta(_output()).loads  # type: ignore[arg-type]
    assert load.report and load.block_ids == BLOCKS and load.keys == keys and len(load.snaps) == 2
    assert not sched.build_connector_meta(_output()).loads  # type: ignore[arg-type]  # handed over once

    sched.update_connector_output({"r"})  # a worker failed it: vLLM recomputes it and asks again
    assert sched.stats.loads_failed == 1
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)


def _scheduler(tmp_path: Path, **config: Any) -> tuple[Any, SimpleNamespace]:
    """A scheduler over the two-chunk store (block size 4, chunks of 8) whose workers run in processes of
    their own (asynchronous loads); and a request for the stored prompt."""
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler

    store, ns, _, snap = stored_at_tp(tmp_path, 2)
    cfg = HurrayConfig.from_vllm(vllm_config({"hurray_path": str(tmp_path), "hurray_chunk_tokens": CHUNK}, 4), None)  # type: ignore[arg-type]
    cfg = dataclasses.replace(cfg, async_loads=True, worker_in_process=False, **config)
    tokens = list(snap.token_ids[0])
    request = SimpleNamespace(
        request_id="r", all_token_ids=tokens, num_prompt_tokens=len(tokens), kv_transfer_params=None
    )
    return HurrayScheduler(cfg, store, snap.fingerprint, ns), request  # type: ignore[arg-type]


def test_an_async_load_after_a_local_hit_inside_a_chunk_fills_every_groups_blocks_after_it(tmp_path: Path) -> None:
    """The engine holds the first block; a sliding-window group's table starts with the null block."""
    sched, request = _scheduler(tmp_path, group_windows=(8, None))
    assert sched.get_num_new_matched_tokens(request, 4) == (12, True)
    groups = ([0, 0, 7, 1, 3], [6, 2, 8, 9, 4])  # what vLLM's hybrid manager holds for the request
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: groups), 12)  # type: ignore[arg-type]
    (load,) = sched.build_connector_meta(_output()).loads  # type: ignore[arg-type]
    assert load.skip_blocks == 1 and load.block_ids == [0, 7, 1] and load.groups == [[0, 7, 1], [2, 8, 9]]
    assert load.snaps == []  # a worker in another process reads the files: nothing to hand over


def test_a_request_waiting_for_a_load_nobody_planned_is_failed_by_the_workers(tmp_path: Path) -> None:
    """Defensive: vLLM would wait forever for a load no worker reports; the workers fail it instead."""
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata

    sched, _ = _scheduler(tmp_path)
    store, ns = sched._store, sched._ns
    stranger = SimpleNamespace(request_id="x", all_token_ids=[1, 2, 3])
    sched.update_state_after_alloc(stranger, SimpleNamespace(get_block_ids=lambda: ([1, 2],)), 8)  # type: ignore[arg-type]
    (load,) = sched.build_connector_meta(_output()).loads  # type: ignore[arg-type]
    assert load.report and not load.keys
    w = cpu_worker(store, ns)
    w.start_load_kv(HurrayConnectorMetadata(loads=[load]))
    assert w.get_transfer_results() == ({"x"}, {"x"}) and not w._ec.caches[0].any()
    sched.update_connector_output({"x"})  # a request the scheduler does not know is not counted
    assert sched.stats.loads_failed == 0


def test_a_failed_request_may_load_again_once_it_runs(tmp_path: Path) -> None:
    """Recomputed after a failed load, then preempted: its next lookup may load (its own saves, say)."""
    sched, request = _scheduler(tmp_path)
    assert sched.get_num_new_matched_tokens(request, 0) == (16, True)
    sched.update_connector_output({"r"})
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False) and sched.stats.loads_failed == 1
    new = SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=0)
    out = _output([new])
    out.num_scheduled_tokens = {"r": 17}
    sched.build_connector_meta(out)  # type: ignore[arg-type]
    assert sched.get_num_new_matched_tokens(request, 0) == (16, True)


def test_a_slice_gone_on_one_rank_fails_the_request_once_in_vllms_aggregate(tmp_path: Path) -> None:
    """TP = 2: rank 0 loads its slice, rank 1 finds its slice gone; vLLM's aggregator reports one failure."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, forget_verified_chunks
    from hurray_vllm.kv.snapshot import HeadRange

    store, ns, keys, snap = stored_at_tp(tmp_path, 2)
    task = _load(store, ns, keys, snap, report=True)
    store.path(ns, f"{keys[1]}.h1-2").unlink()
    outputs = []
    for rank in range(2):
        forget_verified_chunks()  # each rank is a process of its own
        w = cpu_worker(store, ns, HeadRange(rank, rank + 1, 2))
        w.start_load_kv(HurrayConnectorMetadata(loads=[task]))
        received, failed = w.get_transfer_results()
        assert (received, failed) == ({"r"}, {"r"} if rank else set())
        kv = KVConnectorOutput(finished_recving=received, failed_recving=failed)
        outputs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kv))
    merged = KVOutputAggregator(2).aggregate(outputs).kv_connector_output  # type: ignore[union-attr]
    assert merged is not None and merged.finished_recving == {"r"} and merged.failed_recving == {"r"}


@pytest.mark.parametrize(
    ("groups", "backend", "world", "want"),
    [
        (4, "mp", 2, True),  # a sliding-window or linear-attention hybrid at TP = 2: workers read the files again
        (4, "mp", 1, True),  # the mp executor at TP = 1: one worker, in a process of its own
        # The worker in the scheduler's process, handed what was verified: it may still fail (memory).
        (4, "uni", 1, True),
        (4, "external_launcher", 2, True),  # a scheduler per rank, each with its worker
        (1, "mp", 2, False),  # one group: vLLM maps failed blocks to requests
        (4, None, 2, True),  # a bare config: several ranks are several processes
    ],
)
def test_which_engines_load_asynchronously(groups: int, backend: str | None, world: int, want: bool) -> None:
    from hurray_vllm.adapters.vllm.connector.config import _async_loads

    cfg = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend, world_size=world))
    kv = SimpleNamespace(kv_cache_groups=[object()] * groups)
    assert _async_loads(cfg, kv) is want  # type: ignore[arg-type]


def test_a_request_recomputing_what_a_synchronous_load_failed_to_write_saves_it_again(tmp_path: Path) -> None:
    """vLLM moves a running request back to its longest valid prefix; the chunks after it are saved again, and the
    request's answer announces none of them until they are (a destination would wait for them in vain)."""
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    cfg = HurrayConfig.from_vllm(vllm_config({"hurray_path": str(tmp_path), "hurray_chunk_tokens": CHUNK}, 4), None)  # type: ignore[arg-type]
    tokens = [*snap.token_ids[0], 99]
    request = SimpleNamespace(
        request_id="r", all_token_ids=tokens, num_prompt_tokens=len(tokens), kv_transfer_params=None
    )
    sched = HurrayScheduler(cfg, store, snap.fingerprint, ns)  # type: ignore[arg-type]
    assert sched.get_num_new_matched_tokens(request, 0) == (16, False)
    blocks = [1, 2, 3, 4, 5]
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (blocks,)), 16)  # type: ignore[arg-type]
    out = _output([SimpleNamespace(req_id="r", block_ids=(blocks,), num_computed_tokens=16)])
    out.num_scheduled_tokens = {"r": 1}
    meta = sched.build_connector_meta(out)  # type: ignore[arg-type]
    assert len(meta.loads) == 1 and not meta.saves  # both chunks loaded: nothing to save
    # The worker could not load the second chunk (its file moved aside as damaged): vLLM recomputes from 8 on.
    store.path(ns, keys[1]).unlink()
    out = _output()
    out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.new_block_ids = ["r"], [None]
    out.scheduled_cached_reqs.num_computed_tokens, out.num_scheduled_tokens = [8], {"r": 9}
    meta = sched.build_connector_meta(out)  # type: ignore[arg-type]
    assert [t.key for t in meta.saves] == [keys[1]]  # recomputed, saved again (the store may lack it)
    assert sched.request_finished(request)[1] == {"hurray_saved_tokens": 16}  # type: ignore[arg-type]


def _saving(w: Any) -> list[list[tuple[str, str]]]:
    """What each step hands ``w``'s saving (``(request, key)`` per chunk) from now on, saved nowhere."""
    handed: list[list[tuple[str, str]]] = []
    w._saves_here, w._shares_states, w._async = True, False, False
    w._save = lambda meta, gathered=None: handed.append([(t.request_id, t.key) for t in meta.saves])
    return handed


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_failed_synchronous_load_drops_only_the_chunks_that_read_its_blocks(tmp_path: Path, in_flight: int) -> None:
    """Found by a review: every chunk of the step was dropped, another request's too, whose answer still announced
    it (vLLM moves back only the requests holding the failed blocks, so the scheduler never planned it again): a
    continuation waited hurray_push_wait_s for it. Dropped now: the failed load's request's chunks and those that
    hold one of its blocks, for the steps in flight (asynchronous scheduling: the next step too)."""
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, SaveTask

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    w = cpu_worker(store, ns)
    w._steps_in_flight = in_flight
    handed = _saving(w)
    task = _load(store, ns, keys, snap, report=False)  # request "r", into BLOCKS
    store.path(ns, keys[1]).unlink()  # a prune between the scheduler's check and this worker's read
    w.start_load_kv(HurrayConnectorMetadata(loads=[task]))
    assert w.get_block_ids_with_load_errors() == set(BLOCKS)
    own = SaveTask("r", "a0" * 8, list(range(8)), [3, 4])  # the failed load's request, past its loaded blocks
    other = SaveTask("o", "b0" * 8, list(range(8)), [3, 6])  # another request's, its own blocks
    sharing = SaveTask("s", "c0" * 8, list(range(8)), [BLOCKS[2], 6])  # one holding a block the load left unwritten
    forward = SaveTask("f", "d0" * 8, [], [], forward=True)  # a push from its files
    saves = [own, other, sharing, forward]
    for _ in range(in_flight):
        w.wait_for_save(HurrayConnectorMetadata(saves=saves))
    w.wait_for_save(HurrayConnectorMetadata(saves=saves))  # the failure is behind: every chunk is saved
    kept = [("o", other.key), ("f", forward.key)]
    assert handed == [kept] * in_flight + [[(t.request_id, t.key) for t in saves]]
    assert w.stats.saves_dropped == 2 * in_flight


def test_ranks_drop_the_same_chunks_whichever_rank_s_load_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk is all its ranks' slices: a rank whose load did not fail drops what another rank's failure spoils
    (learnt in a collective), and every chunk where it cannot learn it."""
    import torch.distributed as dist
    import vllm.distributed

    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, LoadTask, SaveTask

    store, ns, _, _ = stored_at_tp(tmp_path, 1)
    others: list[Any] = []
    monkeypatch.setattr(vllm.distributed, "get_tp_group", lambda: SimpleNamespace(cpu_group=None))
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: t.fill_(1))  # another rank's failed

    def all_gather_object(out: list[Any], mine: Any, group: Any = None) -> None:
        if not others:
            raise RuntimeError("Connection closed by peer")
        out[:] = [mine, *others]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    saves = [SaveTask("r", "a0" * 8, list(range(8)), [3, 4]), SaveTask("o", "b0" * 8, list(range(8)), [6, 7])]
    for told, kept in (([(True, (frozenset({5}), frozenset({"r"})))], [("o", "b0" * 8)]), ([], [])):
        others[:] = told
        w = cpu_worker(store, ns)
        w._tp = 2
        handed = _saving(w)
        w.wait_for_save(HurrayConnectorMetadata(loads=[LoadTask("r", [], [], [])], saves=saves))
        assert handed == ([kept] if kept else []) and w.stats.saves_dropped == 2 - len(kept)
