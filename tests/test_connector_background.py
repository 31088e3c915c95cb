"""The connector's machinery on its own (no engine): the writer thread, the block copies, the verified chunks."""

from __future__ import annotations

import threading
import time
from types import ModuleType

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
    from hurray_vllm.demo import spec_example_snapshot

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
