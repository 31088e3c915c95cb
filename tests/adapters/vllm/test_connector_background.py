"""The connector's machinery on its own (no engine): the writer thread, the block copies, the verified chunks."""

from __future__ import annotations

import threading
import time
from types import ModuleType, SimpleNamespace

import pytest
import torch
from conftest import require


@pytest.fixture(scope="module")
def conn() -> ModuleType:
    require("vllm")
    import hurray_vllm.adapters.vllm.connector as c

    return c


def test_writer_runs_jobs_in_order_and_flush_waits(conn: ModuleType) -> None:
    w = conn._Writer(max_bytes=1 << 20)
    done: list[int] = []
    for i in range(5):
        w.submit(lambda i=i: (time.sleep(0.01), done.append(i)), 10)
    assert w.flush(timeout=10)
    assert done == [0, 1, 2, 3, 4]


def test_a_failing_job_is_logged_and_the_writer_goes_on(conn: ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    w = conn._Writer(max_bytes=1 << 20)
    done: list[str] = []

    def boom() -> None:
        raise RuntimeError("disk full")

    w.submit(boom, 1)
    w.submit(lambda: done.append("after"), 1)
    assert w.flush(timeout=10)
    assert done == ["after"]
    assert "background save failed" in caplog.text


def test_submit_waits_while_the_queue_holds_too_many_bytes(conn: ModuleType) -> None:
    w = conn._Writer(max_bytes=100)
    gate = threading.Event()
    w.submit(gate.wait, 80)  # holds 80 of 100 bytes until the gate opens
    started = threading.Event()
    finished = threading.Event()

    def second() -> None:
        started.set()
        w.submit(lambda: None, 50)  # would make 130: must wait
        finished.set()

    t = threading.Thread(target=second)
    t.start()
    started.wait(5)
    time.sleep(0.05)
    assert not finished.is_set()
    gate.set()
    t.join(5)
    assert finished.is_set() and w.flush(timeout=5)
    assert w.flush(timeout=0)  # idle: true at once


def test_staging_copies_blocks_and_recycles_buffers(conn: ModuleType) -> None:
    caches = [torch.arange(6 * 4, dtype=torch.float32).view(6, 2, 2) + 100 * i for i in range(3)]
    staging = conn._Staging()
    views, bufs = staging.copy(caches, torch.tensor([4, 1]))
    for v, c in zip(views, caches, strict=True):
        assert torch.equal(v, c[[4, 1]])
    staging.recycle(bufs)
    again, bufs2 = staging.copy(caches, torch.tensor([2]))  # smaller: the recycled buffers serve
    assert bufs2[0].data_ptr() == bufs[0].data_ptr()
    assert torch.equal(again[1], caches[1][[2]])
    bigger, bufs3 = staging.copy(caches, torch.tensor([0, 1, 2, 3]))  # larger: new buffers
    assert bufs3[0].shape[0] == 4 and torch.equal(bigger[2], caches[2][:4])


def test_verified_chunks_are_kept_while_their_file_is_the_same(conn: ModuleType) -> None:
    from hurray_vllm.app.demo import spec_example_snapshot

    snap = spec_example_snapshot()
    cache = conn._VerifiedChunks(2)
    cache.put("a", (1, 2, 3, 4, 5), snap)
    assert cache.get("a", (1, 2, 3, 4, 5)) is snap
    assert cache.get("a", (1, 2, 3, 4, 6)) is None  # the file changed since it was verified
    assert cache.get("b", (1, 2, 3, 4, 5)) is None
    cache.put("b", (7,), snap)
    cache.get("a", (1, 2, 3, 4, 5))  # "a" is now the most recently used
    cache.put("c", (8,), snap)
    assert cache.get("b", (7,)) is None and cache.get("a", (1, 2, 3, 4, 5)) is snap
    cache.clear()
    assert cache.get("a", (1, 2, 3, 4, 5)) is None


def test_verified_chunks_stay_within_the_open_file_limit(conn: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    assert conn._verified_capacity(256) == 128  # each kept chunk keeps a file descriptor
    assert conn._verified_capacity(100) == 100
    assert conn._verified_capacity(8) == 64  # the scheduler-to-worker handoff needs these
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert conn._verified_capacity(1000) == 1000


def test_pushed_chunks_share_buffers_registered_once(conn: ModuleType, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Saving with a nixl:// url: chunks go one by one through the same buffers, registered with NIXL once."""
    from hurray_vllm import KVSnapshot, ModelFingerprint
    from hurray_vllm.adapters.vllm import GatherBuffers
    from hurray_vllm.chunks.store import DirectoryStore
    from hurray_vllm.kv.paged import BlockPagedTensor
    from hurray_vllm.transport.nixl import NixlError

    calls: list[tuple[str, list[int]]] = []

    class Sender:
        def register(self, ts: list[torch.Tensor]) -> None:
            calls.append(("register", [t.data_ptr() for t in ts]))

        def unregister(self, ts: list[torch.Tensor]) -> None:
            calls.append(("unregister", [t.data_ptr() for t in ts]))

    monkeypatch.setattr("hurray_vllm.transport.nixl.default_sender", lambda: Sender())
    c = object.__new__(conn.HurrayConnector)
    c._store, c._ns, c._url, c.stats = DirectoryStore(tmp_path), "ab" * 8, "nixl://127.0.0.1:1", conn.ConnectorStats()
    c._pushed, c._chunk_buffers, c._registered, c._nixl = set(), [], [], True

    def export(ec, caches, task, block_ids, reuse=False):  # type: ignore[no-untyped-def]
        assert reuse
        if not c._chunk_buffers:
            c._chunk_buffers = [GatherBuffers()]
        k, v = c._chunk_buffers[0].take((len(block_ids), 4, 1, 8), torch.bfloat16, torch.device("cpu"))
        k.fill_(float(len(calls))), v.fill_(1.0)
        n = 4 * len(block_ids)
        idx = (torch.arange(len(block_ids)), torch.tensor([0, len(block_ids)]), torch.tensor([n]))
        return KVSnapshot(
            (BlockPagedTensor(k, *idx, "key", 0),),
            (BlockPagedTensor(v, *idx, "value", 0),),
            token_ids=(tuple(task.tokens),),
            fingerprint=ModelFingerprint("T", 1, 1, 8, "bfloat16"),
        )

    c._export_chunk = export
    tasks = [conn.SaveTask("r", f"{i:02x}" * 8, list(range(8)), [1, 2]) for i in range(3)]
    tasks.append(conn.SaveTask("r", "ff" * 8, list(range(12)), [1, 2, 3]))  # larger: the buffers grow
    seen = []
    ec = SimpleNamespace(caches=None)
    for _ns, key, chunk in c._saved(ec, iter(tasks), push=True):
        seen.append((key, chunk.keys[0].page_pool.data_ptr()))
        assert key not in c._pushed  # marked only once the receiver has it, i.e. when the next is asked for
    assert [k for k, _ in seen] == [t.key for t in tasks] and c._pushed == {t.key for t in tasks}
    assert len({p for _, p in seen[:3]}) == 1  # one memory for the same-sized chunks
    assert [kind for kind, _ in calls] == ["register", "unregister", "register"]
    assert calls[1][1] == calls[0][1] and calls[2][1] != calls[0][1]
    assert all(c._store.has(c._ns, t.key) for t in tasks)

    # A push that fails part-way: the chunks after it are still saved here, and not marked as pushed.
    def failing_send(url, chunks):  # type: ignore[no-untyped-def]
        next(iter(chunks))
        raise NixlError("peer gone")

    monkeypatch.setattr("hurray_vllm.transport.nixl.send_chunks_nixl", failing_send)
    more = [conn.SaveTask("r", f"{i:02x}" * 8, list(range(8)), [4, 5]) for i in range(10, 13)]
    meta = conn.HurrayConnectorMetadata(saves=more)
    c._get_connector_metadata = lambda: meta
    c._async, c._engine_cache = False, lambda: ec
    c.wait_for_save()
    assert all(c._store.has(c._ns, t.key) for t in more) and not c._pushed & {t.key for t in more}
