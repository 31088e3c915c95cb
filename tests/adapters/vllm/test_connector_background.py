"""The connector's machinery on its own (no engine): the writer thread, the block copies, the verified chunks,
its configuration, and which errors move a chunk file aside."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from types import ModuleType, SimpleNamespace
from typing import Any

import connector_parts
import pytest
import torch
from blocking import wait_for
from conftest import require
from connector_parts import bare_push_worker, linear_scheduler, vllm_config

# Module fixtures shared with other connector tests (connector_parts): the connector's worker and metadata modules.
conn, meta = connector_parts.conn, connector_parts.meta


@pytest.fixture
def long_push_pause(conn: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed push pauses pushing for an hour, not PUSH_BACKOFF_S: what a test does after the failure (the next
    saves, a flush) must find pushing still paused, and a loaded machine can stall a test for seconds."""
    monkeypatch.setattr(conn, "PUSH_BACKOFF_S", 3600.0)


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
    full: list[None] = []
    w = conn._Writer(max_bytes=100, on_full=lambda: full.append(None))  # called on each round of the wait
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
    assert started.wait(60)
    deadline = time.monotonic() + 60  # a hang guard: the submit is seen waiting (twice round), not slept on
    while len(full) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(full) >= 2 and not finished.is_set()
    gate.set()
    t.join(60)
    assert finished.is_set() and w.flush(timeout=5)
    assert w.flush(timeout=0)  # idle: true at once


def test_staging_copies_blocks_and_recycles_buffers(conn: ModuleType) -> None:
    caches = [torch.arange(6 * 4, dtype=torch.float32).view(6, 2, 2) + 100 * i for i in range(3)]
    staging = conn._Staging(1 << 20)
    views, bufs = staging.copy(caches, torch.tensor([4, 1]))
    for v, c in zip(views, caches, strict=True):
        assert torch.equal(v, c[[4, 1]])
    staging.recycle(bufs)
    again, bufs2 = staging.copy(caches, torch.tensor([2]))  # smaller: the recycled buffers serve
    assert bufs2[0].data_ptr() == bufs[0].data_ptr()
    assert torch.equal(again[1], caches[1][[2]])
    bigger, bufs3 = staging.copy(caches, torch.tensor([0, 1, 2, 3]))  # larger: new buffers
    assert bufs3[0].shape[0] == 4 and torch.equal(bigger[2], caches[2][:4])


def test_verified_chunks_are_kept_while_their_file_is_the_same(meta: ModuleType) -> None:
    from hurray_vllm.app.demo import spec_example_snapshot

    snap = spec_example_snapshot()
    cache = meta.VerifiedChunks(2)
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


def test_verified_chunks_stay_within_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    require("vllm")
    from hurray_vllm.adapters.vllm.connector.config import verified_capacity

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    assert verified_capacity(256) == 128  # each kept chunk keeps a file descriptor
    assert verified_capacity(100) == 100
    assert verified_capacity(8) == 64  # the scheduler-to-worker handoff needs these
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert verified_capacity(1000) == 1000


class _Sender:
    """A ChunkSender stand-in: records what it is asked to push; ``gate`` holds it before each chunk."""

    scheme = "nixl"

    def __init__(self, calls: list[tuple[str, list[int]]]) -> None:
        self.calls = calls
        self.fail = False
        self.sends = 0
        self.pushed: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.asked: list[list[tuple[str, str]]] = []  # held() queries
        self.answer: set[str] | BaseException = set()  # held()'s answer: the keys held, or what it raises
        self.aborts = 0
        self.gate_s = 30.0  # how long ``gate`` holds each chunk at most

    def abort(self, owner: object | None = None) -> None:
        self.aborts += 1

    def register(self, ts: Sequence[torch.Tensor]) -> None:
        self.calls.append(("register", [t.data_ptr() for t in ts]))

    def unregister(self, ts: Sequence[torch.Tensor]) -> None:
        self.calls.append(("unregister", [t.data_ptr() for t in ts]))

    def held(
        self, url: str, names: Sequence[tuple[str, str]], *, timeout: float = 60.0, keys: Any = None, owner: Any = None
    ) -> set[Any]:
        self.asked.append(list(names))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return {n for n in names if n[1] in self.answer}

    def send(
        self, url: str, chunks: Iterable[Any], *, timeout: float = 60.0, keys: Any = None, owner: Any = None
    ) -> None:
        from hurray_vllm.transport.nixl import NixlError

        self.sends += 1
        for _ns, key, _chunk in chunks:
            self.gate.wait(self.gate_s)
            if self.fail:  # a push that fails part-way, after the first chunk
                raise NixlError("peer gone")
            self.pushed.append(key)


def _patient_tcp_sender() -> Any:
    """A TcpSender whose network steps wait 600 s (not 60): only a cut can end them in a test's time."""
    from hurray_vllm.transport.tcp import TcpSender

    class _Patient(TcpSender):
        def __init__(self) -> None:
            super().__init__()
            self.asking = threading.Event()  # set when a held-chunk query starts
            self.sending = threading.Event()  # set when a push starts (past the worker's look at the pause)

        def held(self, url: str, names: Any, *, timeout: float = 600.0, keys: Any = None, owner: Any = None) -> Any:
            self.asking.set()
            return super().held(url, names, timeout=timeout, keys=keys, owner=owner)

        def send(self, url: str, chunks: Any, *, timeout: float = 600.0, keys: Any = None, owner: Any = None) -> Any:
            self.sending.set()
            return super().send(url, chunks, timeout=timeout, keys=keys, owner=owner)

    return _Patient()


def test_pushed_chunks_share_buffers_registered_once(conn: ModuleType, meta: ModuleType, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Saving with a nixl:// url: chunks go one by one through the same buffers, registered with NIXL once."""
    calls: list[tuple[str, list[int]]] = []
    sender = _Sender(calls)
    c = bare_push_worker(conn, meta, tmp_path, sender)
    tasks = [meta.SaveTask("r", f"{i:02x}" * 8, list(range(8)), [1, 2]) for i in range(3)]
    tasks.append(meta.SaveTask("r", "ff" * 8, list(range(12)), [1, 2, 3]))  # larger: the buffers grow
    seen = []
    ec = c._engine_cache()
    for _ns, key, chunk in c._stored(ec, ec.caches, iter([(t, t.block_ids, None) for t in tasks]), push=True):
        seen.append((key, chunk.keys[0].page_pool.data_ptr()))
        assert key not in c._pushed  # marked only once the receiver has it, i.e. when the next is asked for
    assert [k for k, _ in seen] == [t.key for t in tasks] and list(c._pushed) == [t.key for t in tasks]
    assert len({p for _, p in seen[:3]}) == 1  # one memory for the same-sized chunks
    assert [kind for kind, _ in calls] == ["register", "unregister", "register"]
    assert calls[1][1] == calls[0][1] and calls[2][1] != calls[0][1]
    assert all(c._store.has(c._ns, t.key) for t in tasks)

    # A push that fails part-way: the chunks after it are still saved here, and not marked as pushed.
    sender.fail = True
    more = [meta.SaveTask("r", f"{i:02x}" * 8, list(range(8)), [4, 5]) for i in range(10, 13)]
    c._async = False
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=more))
    assert all(c._store.has(c._ns, t.key) for t in more) and not set(c._pushed) & {t.key for t in more}
    assert c.stats.push_failures == 1 and c.stats.chunks_pushed == 4


@pytest.mark.usefixtures("long_push_pause")
def test_background_pushes_keep_their_order_and_never_hold_the_step(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """With hurray_url, the step only copies blocks out; the writer stores and pushes, in step order."""
    sender = _Sender([])
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._async = True
    sender.gate.clear()  # the destination does not answer yet
    sender.gate_s = 600.0  # a step that waited for the push would wait this out, and see it pushed
    steps = [[meta.SaveTask(f"r{r}", f"{r:02x}{i:02x}" * 4, list(range(8)), [2 * i + 1, 2 * i + 2]) for r in range(2)]
             for i in range(3)]  # fmt: skip
    for tasks in steps:
        c.wait_for_save(meta.HurrayConnectorMetadata(saves=tasks))
    assert sender.pushed == []  # three steps went on while the push waited
    # A chunk stored before (a shared prefix) is pushed too, from the store, in its place.
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[steps[0][0]]))
    sender.gate.set()
    assert c.flush(timeout=30)
    assert sender.pushed == [t.key for tasks in steps for t in tasks]  # pushed once, in order
    assert c.stats.chunks_pushed == 6 and c.stats.chunks_saved == 6

    # A failed push pauses pushing (one timeout for a dead destination, not one per save); saving goes on.
    sender.fail, sends = True, sender.sends
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", "aa" * 8, list(range(8)), [7, 8])]))
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", "bb" * 8, list(range(8)), [9, 10])]))
    assert c.flush(timeout=30)
    assert c.stats.push_failures == 1 and sender.sends == sends + 1
    assert c._store.has(c._ns, "aa" * 8) and c._store.has(c._ns, "bb" * 8)


@pytest.mark.usefixtures("long_push_pause")
def test_a_destination_that_never_reads_does_not_hold_the_step(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """Accepted, never read (a hung receiver): a full queue cuts the push short instead of waiting its 60 s."""
    import socket

    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)  # the kernel accepts; nobody reads or answers
        url = f"tcp://127.0.0.1:{hole.getsockname()[1]}"
        # Its push waits 600 s: a step that took under 60 s was not held by it (60 s: a hang guard, not a timing).
        c = bare_push_worker(conn, meta, tmp_path, _patient_tcp_sender())
        c._url, c._async = url, True
        c._writer = conn._Writer(256, on_full=c._abort_push)  # a few steps' blocks
        for i in range(12):
            t0 = time.monotonic()
            c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", f"{i:02x}" * 8, [0] * 8, [1, 2])]))
            assert time.monotonic() - t0 < 60
        assert c.flush(timeout=60) and c.stats.push_failures == 1 and c.stats.chunks_saved == 12


def test_shutdown_stores_the_chunks_a_hung_destination_held_up(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """A push blocked on a receiver that never reads gets a few seconds at shutdown, not the minute of its timeout."""
    import socket

    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        # Its push waits 600 s: uncut, shutdown gives up after SHUTDOWN_SAVE_S with the chunks not stored.
        sender = _patient_tcp_sender()
        c = bare_push_worker(conn, meta, tmp_path, sender)
        c._url, c._async = f"tcp://127.0.0.1:{hole.getsockname()[1]}", True
        c._writer = conn._Writer(1 << 30, on_full=c._abort_push)  # room for all: nothing cuts the push short
        keys = [f"{i:02x}" * 8 for i in range(4)]
        c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", k, [0] * 8, [1, 2]) for k in keys]))
        assert sender.sending.wait(60)  # the push is out (a writer that starts it only after shutdown never tries)
        c.shutdown()
        assert all(c._store.has(c._ns, k) for k in keys) and c.stats.push_failures == 1


@pytest.mark.usefixtures("long_push_pause")
def test_an_engine_cutting_its_push_leaves_another_engines_push_on_the_shared_sender_running(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """Engines of one process share the NIXL sender: engine A's full queue (or shutdown) cut engine B's push too,
    which B counted as a failure of its destination, doubling its backoff and pausing its pushes."""
    import socket

    sender = _patient_tcp_sender()  # one sender object for both, as nixl.default_sender() is
    with socket.socket() as slow:
        slow.bind(("127.0.0.1", 0))
        slow.listen(16)  # B's destination: accepts, never answers (B's push waits its 600 s)
        b = bare_push_worker(conn, meta, tmp_path / "b", sender)
        b._url, b._async = f"tcp://127.0.0.1:{slow.getsockname()[1]}", True
        b._writer = conn._Writer(1 << 30, on_full=b._abort_push)  # room for all: B never cuts its push
        a = bare_push_worker(conn, meta, tmp_path / "a", sender)
        rounds: list[None] = []

        def a_full() -> None:
            rounds.append(None)
            a._abort_push()

        a._writer = conn._Writer(100, on_full=a_full)
        b.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", "b0" * 8, [0] * 8, [1, 2])]))
        assert sender.sending.wait(60) and wait_for(lambda: bool(sender._live_sockets()), 60)  # B's push is out
        gate = threading.Event()
        a._writer.submit(gate.wait, 100)  # A's writer is busy and its queue full:
        waiter = threading.Thread(target=a._writer.wait_for_room, args=(50,))  # a step of A waits, cutting A's push
        waiter.start()
        assert wait_for(lambda: len(rounds) >= 3, 60)
        gate.set()
        waiter.join(60)
        assert b.stats.push_failures == 0 and b._writer._pending == 1 and sender._live_sockets()  # still pushing
        b._abort_push()  # B's own cut ends it: counted, but its destination is not blamed
        assert b.flush(timeout=60) and b.stats.push_failures == 1 and b._push_backoff == conn.PUSH_BACKOFF_S
        assert b._store.has(b._ns, "b0" * 8)


@pytest.mark.usefixtures("long_push_pause")
def test_an_unforeseen_error_in_a_push_still_stores_every_chunk_here(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """A channel raising something else than OSError (a pool shut down at exit): counted, paused, stored."""

    class _Broken(_Sender):
        def send(
            self, url: str, chunks: Iterable[Any], *, timeout: float = 60.0, keys: Any = None, owner: Any = None
        ) -> None:
            self.sends += 1
            next(iter(chunks))
            raise RuntimeError("cannot schedule new futures after shutdown")

    sender = _Broken([])
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._async = True
    keys = [f"{i:02x}" * 8 for i in range(6)]
    for k in keys:
        c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", k, list(range(8)), [1, 2])]))
    assert c.flush(timeout=30)
    assert all(c._store.has(c._ns, k) for k in keys)
    assert c.stats.push_failures == 1 and sender.sends == 1  # then pushing paused


@pytest.mark.usefixtures("long_push_pause")
def test_chunks_stored_while_pushing_paused_are_pushed_when_it_resumes(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """A failed push leaves no hole for good: what was stored meanwhile goes first once pushing resumes."""
    sender = _Sender([])
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._async = True
    tasks = [meta.SaveTask("r", f"{i:02x}" * 8, list(range(8)), [2 * i + 1, 2 * i + 2]) for i in range(4)]
    sender.fail = True
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[tasks[0]]))  # fails: pushing pauses
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[tasks[1]]))  # paused: stored here only
    assert c.flush(timeout=30) and c.stats.push_failures == 1 and sender.pushed == []
    sender.fail, c._push_paused_until = False, 0.0  # the destination is back, the pause is over
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=tasks[2:]))
    assert c.flush(timeout=30)
    assert sender.pushed == [t.key for t in tasks]  # the held-back ones first: no hole in the prefix


def test_a_background_save_the_scheduler_marks_replace_writes_over_the_stored_copy(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """A stored chunk is skipped, unless the scheduler found the copy weaker (less of a window) and asks again."""
    c = bare_push_worker(conn, meta, tmp_path, _Sender([]))
    c._async, c._sender, c._url = True, None, None
    task = meta.SaveTask("r", "cd" * 8, list(range(8)), [1, 2])
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[task]))
    assert c.flush(timeout=30) and c.stats.chunks_saved == 1
    first = c._store.identity(c._ns, task.key)
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[task]))
    assert c.flush(timeout=30) and c.stats.chunks_saved == 1 and c.stats.chunks_skipped == 1
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[replace(task, replace=True)]))
    assert c.flush(timeout=30) and c.stats.chunks_saved == 2
    assert c._store.identity(c._ns, task.key) != first


def test_a_step_whose_block_copies_fail_drops_its_saves_and_the_engine_runs_on(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """Out of device memory for the copies, say: nothing raises out of wait_for_save, and a later step saves."""
    c = bare_push_worker(conn, meta, tmp_path, _Sender([]))
    c._async, c._sender, c._url = True, None, None
    task = meta.SaveTask("r", "ce" * 8, list(range(8)), [1, 2])
    real = c._staging.copy

    def no_memory(*args: Any) -> Any:
        raise torch.OutOfMemoryError("no room for the copies")

    c._staging.copy = no_memory
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[task]))
    assert c.flush(timeout=30) and c.stats.saves_failed == 1 and not c._inflight
    c._staging.copy = real
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[task]))
    assert c.flush(timeout=30) and c.stats.chunks_saved == 1 and c._store.has(c._ns, task.key)


@pytest.mark.usefixtures("long_push_pause")
def test_chunks_held_back_are_pushed_by_the_idle_writer_without_another_save(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """A request that finished while pushing was paused gets its chunks pushed all the same, once the pause ends."""
    sender = _Sender([])
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._async = True
    idle: list[None] = []

    def push_held_back() -> None:
        idle.append(None)
        c._push_held_back()

    c._writer = conn._Writer(1 << 30, on_idle=push_held_back, idle_s=0.05)
    tasks = [meta.SaveTask("r", f"{i:02x}" * 8, list(range(8)), [2 * i + 1, 2 * i + 2]) for i in range(2)]
    sender.fail = True
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=tasks))  # the push fails: both stored, none pushed
    assert c.flush(timeout=30) and c.stats.push_failures == 1 and sender.pushed == []
    seen, deadline = len(idle), time.monotonic() + 60  # hang guards, not timings
    while len(idle) < seen + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(idle) >= seen + 3 and sender.sends == 1  # still paused: the idle writer looked, and did not try
    sender.gate.clear()  # the destination is back, slow to answer (600 s: until the gate opens)
    sender.gate_s = 600.0
    sender.fail, c._push_paused_until = False, 0.0  # ... and the pause is over
    while sender.sends < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sender.sends == 2
    assert c.flush(timeout=60)  # every save is stored: flush waits for no push (the push waits 600 s)
    sender.gate.set()
    deadline = time.monotonic() + 60
    while sender.pushed != [t.key for t in tasks] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sender.pushed == [t.key for t in tasks] and not c._unpushed  # no further save was needed
    c.shutdown()


def test_pushes_failing_in_a_row_pause_longer_and_longer(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A destination that stays dead costs one attempt per pause, each pause twice the last, up to a cap."""
    sender = _Sender([])
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._async = False
    sender.fail = True
    pauses = []
    now = 1000.0  # the worker's clock, stopped: a pause is read off exactly, however long a step took
    monkeypatch.setattr(conn, "time", SimpleNamespace(monotonic=lambda: now, perf_counter=time.perf_counter))
    for i in range(7):
        c._push_paused_until = 0.0  # as if the pause were over
        c.wait_for_save(
            meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", f"{i:02x}" * 8, list(range(8)), [1, 2])])
        )
        pauses.append(c._push_paused_until - now)
    assert pauses == [10, 20, 40, 80, 160, 160, 160] and c.stats.push_failures == 7
    c._push_backoff = conn.PUSH_BACKOFF_S
    sender.send = lambda *a, **k: (c._abort_push(), (_ for _ in ()).throw(OSError("aborted")))  # cut short here
    for i in range(2):
        c._push_paused_until = 0.0
        c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", f"c{i}" * 8, list(range(8)), [1, 2])]))
    assert c._push_backoff == conn.PUSH_BACKOFF_S  # the engine stopped waiting: no longer pauses for that
    del sender.send
    sender.fail, c._push_paused_until = False, 0.0
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", "ee" * 8, list(range(8)), [1, 2])]))
    assert c._push_backoff == conn.PUSH_BACKOFF_S  # a push that went through: the next failure pauses 10 s again


def test_loaded_chunks_are_pushed_on_only_where_the_destination_lacks_them(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """A -> B -> C: B pushes on the chunks it loaded; A <-> B: it asks first, and sends A nothing back."""
    from hurray_vllm.chunks.store import DIGEST_KEY, DirectoryStore, chunk_digest, namespace_of
    from hurray_vllm.transport import sender_for
    from hurray_vllm.transport.tcp import Receiver

    dest = DirectoryStore(tmp_path / "dest")
    with Receiver("127.0.0.1", 0, dest).start() as r:
        url = f"tcp://127.0.0.1:{r.address[1]}"
        c = bare_push_worker(conn, meta, tmp_path / "here", sender_for(url))
        c._url, c._ns = url, namespace_of(c._fingerprint)
        keys = [f"{i:02x}" * 8 for i in range(3)]
        ec = c._engine_cache()
        for k in keys:  # stored here as a load found them; the destination holds the first already
            snap = c._export_chunk(ec, ec.caches, meta.SaveTask("r", k, list(range(8)), []), [1, 2], reuse=True)
            c._store.put(c._ns, k, replace(snap, extra={DIGEST_KEY: chunk_digest(snap)}))
        dest.put(c._ns, keys[0], c._store.get(c._ns, keys[0]))
        forwards = [meta.SaveTask("r", k, list(range(8)), [], forward=True) for k in keys]
        for background in (True, False):
            c._async = background
            c.wait_for_save(meta.HurrayConnectorMetadata(saves=forwards))
            assert c.flush(timeout=30)
            # Pushed once (the second round asks nothing: this worker knows the destination has them all).
            assert all(dest.has(c._ns, k) for k in keys) and r.received == 2
            assert c.stats.chunks_held == 1 and c.stats.chunks_forwarded == c.stats.chunks_pushed == 2
            assert c.stats.chunks_saved == 0 and c.stats.chunks_skipped == 0  # never exported, never counted
        # A chunk no longer stored (pruned since the load) is not pushed, and is not an error.
        gone = meta.SaveTask("r", "ee" * 8, list(range(8)), [], forward=True)
        c.wait_for_save(meta.HurrayConnectorMetadata(saves=[gone]))
        assert c.flush(timeout=30) and r.received == 2 and c.stats.push_failures == 0


def test_each_stored_file_of_a_chunk_is_pushed_on_by_one_rank(conn: ModuleType, meta: ModuleType, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Whatever TP degree wrote a chunk, its files go once: each from the saving rank its first head is on."""
    from hurray_vllm.kv.snapshot import HeadRange

    c = bare_push_worker(conn, meta, tmp_path, _Sender([]))
    c._fingerprint = replace(c._fingerprint, num_kv_heads=2)
    ns_dir = tmp_path / c._ns
    ns_dir.mkdir()
    for name in ("aa.h0-1", "aa.h1-2", "bb", "bb.h0-1", "bb.h1-2"):
        (ns_dir / f"{name}.hrry").write_bytes(b"x")
    expect = {  # rank heads -> what it pushes of aa (two TP = 2 slices) and bb (whole, preferred)
        None: (["aa.h0-1", "aa.h1-2"], ["bb"]),
        HeadRange(0, 1, 2): (["aa.h0-1"], ["bb"]),
        HeadRange(1, 2, 2): (["aa.h1-2"], []),
    }
    for heads, (aa, bb) in expect.items():
        c._my_heads = heads
        assert c._push_names("aa") == aa and c._push_names("aa.h1-2") == aa and c._push_names("bb") == bb
    assert c._push_names("cc") == []
    # A sibling rank's slice still being written: each rank pushes its own, once it is there.
    (ns_dir / "dd.h1-2.hrry").write_bytes(b"x")
    assert c._push_names("dd.h1-2") == ["dd.h1-2"] and c._push_names("dd.h0-1") == []


def test_a_receiver_holding_a_chunk_in_other_files_is_sent_none_of_it(
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Asked about every way a chunk can be stored: TP = 2's slices there, a whole file here, nothing goes."""
    sender = _Sender([])
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._fingerprint = replace(c._fingerprint, num_kv_heads=2)
    (tmp_path / c._ns).mkdir()
    for name in ("aa", "bb"):
        (tmp_path / c._ns / f"{name}.hrry").write_bytes(b"x")
    items = [(meta.SaveTask("r", k, [], [], forward=True), None, None) for k in ("aa", "bb")]
    sender.answer = {"aa.h0-1", "aa.h1-2", "bb.h0-1"}  # "aa" whole in slices; half of "bb" only
    plan = c._forward_plan(sender, c._url, items)
    assert plan == {"aa": [], "bb": ["bb"]}
    (asked,) = sender.asked
    assert sorted(n for _, n in asked) == sorted(f"{k}{s}" for k in ("aa", "bb") for s in ("", ".h0-1", ".h1-2"))
    assert "aa" in c._pushed and "bb" not in c._pushed and c.stats.chunks_held == 1


def test_a_receiver_that_cannot_say_what_it_holds_gets_everything_and_is_not_asked_again(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """Older than the query: pushed everything, asked again only after ASK_BACKOFF_S; unreachable: the push pauses."""
    import hurray_vllm as hv

    sender = _Sender([])
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._async = False
    for i in range(3):
        c._store.put(
            c._ns,
            f"{i:02x}" * 8,
            c._export_chunk(c._engine_cache(), [], meta.SaveTask("r", "", list(range(4)), []), [1], True),
        )
    forward = [meta.SaveTask("r", f"{i:02x}" * 8, [], [], forward=True) for i in range(3)]
    sender.answer = hv.HurrayFormatError("transport", "unexpected answer b'ER'")
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=forward[:2]))
    assert sender.pushed == [t.key for t in forward[:2]] and len(sender.asked) == 1
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=forward))
    assert sender.pushed[2:] == [forward[2].key] and len(sender.asked) == 1  # not asked again for a while
    assert c.stats.chunks_forwarded == 3 and c.stats.push_failures == 0

    # Unreachable: the whole push fails (one failure, pushing pauses); the chunks to save are still saved.
    c._ask_paused_until, c._pushed = 0.0, conn.OrderedDict()
    sender.answer = ConnectionRefusedError("refused")
    new = meta.SaveTask("r", "ee" * 8, list(range(8)), [4, 5])
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[forward[0], new]))
    assert c.stats.push_failures == 1 and c._store.has(c._ns, new.key) and sender.pushed[3:] == []


def _store_one(c: Any, meta: ModuleType, key: str) -> None:
    """Chunk ``key`` in the worker's store, as an earlier save or load left it."""
    c._store.put(c._ns, key, c._export_chunk(c._engine_cache(), [], meta.SaveTask("r", "", [0] * 4, []), [1], True))


def _forwarding(conn: ModuleType, meta: ModuleType, tmp_path: Any, held: Any) -> Any:
    """A synchronous worker holding chunk 01.. to push on, whose receiver answers held-chunk queries with ``held``;
    a step of it forwards that chunk and saves chunk ee.. (returned: the worker, the sender, the new chunk's key)."""
    sender = _Sender([])
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._async = False
    _store_one(c, meta, "01" * 8)
    sender.held = lambda url, names, **kw: held(c)  # type: ignore[method-assign]
    new = meta.SaveTask("r", "ee" * 8, list(range(8)), [4, 5])
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", "01" * 8, [], [], forward=True), new]))
    return c, sender, new.key


def test_a_gpu_engines_device_chunk_buffers_are_not_registered_and_its_pushes_go_through(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """NIXL registers host memory only: device buffers are left to the sender, which copies their pools to the host."""
    import hurray_vllm as hv
    from hurray_vllm.adapters.vllm.export import GatherBuffers

    class _HostOnly(_Sender):
        def register(self, ts: Sequence[torch.Tensor]) -> None:
            if any(t.device.type != "cpu" for t in ts):  # as NixlSender.register
                raise hv.HurrayFormatError("transport", "only contiguous, non-empty host tensors can be registered")
            super().register(ts)

    calls: list[tuple[str, list[int]]] = []
    sender = _HostOnly(calls)
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._async = False
    export = c._export_chunk

    def on_device(ec, caches, task, block_ids, reuse=False, states=None):  # type: ignore[no-untyped-def]
        snap = export(ec, caches, task, block_ids, reuse, states)
        # A device export's buffers: "meta" stands in for "cuda" on a machine without one.
        device = GatherBuffers()
        device.take((len(block_ids), 4, 1, 8), torch.bfloat16, torch.device("meta"))
        c._chunk_buffers = [c._chunk_buffers[0], device]
        return snap

    c._export_chunk = on_device
    tasks = [meta.SaveTask("r", f"{i:02x}" * 8, list(range(8)), [1, 2]) for i in range(2)]
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=tasks))
    assert c.stats.push_failures == 0 and sender.pushed == [t.key for t in tasks]
    host = [m.data_ptr() for m in c._chunk_buffers[0].memory]
    assert calls == [("register", host)]  # the host buffers, once; never the device ones


def test_an_aborted_held_query_fails_the_push_but_does_not_stop_asking(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """A query this engine cut short (its EOF reads as an error) says nothing of the receiver's age."""
    import hurray_vllm as hv

    def cut(c: Any) -> set[Any]:
        c._abort_push()  # a full queue, or shutdown, while the query waits
        raise hv.HurrayFormatError("transport", "connection closed after 0 of 2 bytes")

    c, sender, new = _forwarding(conn, meta, tmp_path, cut)
    assert c.stats.push_failures == 1 and sender.sends == 0 and c._store.has(c._ns, new)
    assert c._ask_paused_until == 0.0 and c._push_backoff == conn.PUSH_BACKOFF_S


def test_a_delivery_paused_while_it_asked_the_receiver_opens_no_connection(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """Shutdown pauses pushing while the query is out: the push after it would be a connection no abort aimed at."""

    def asked_during_shutdown(c: Any) -> set[Any]:
        c._push_paused_until = float("inf")  # what shutdown does once pushes had their grace
        return set()

    c, sender, new = _forwarding(conn, meta, tmp_path, asked_during_shutdown)
    assert sender.sends == 0 and c._store.has(c._ns, new) and c.stats.push_failures == 0
    assert list(c._unpushed) == ["01" * 8, new]  # pushed once pushing resumes (a later engine's start, say)


def test_shutdown_cuts_a_held_query_to_a_hung_receiver_and_stores_everything(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cut at shutdown, a held-chunk query fails the push: no new connection for the chunks, no pause of asking."""
    import socket

    monkeypatch.setattr(conn, "SHUTDOWN_PUSH_GRACE_S", 0.5)
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)  # accepted by the kernel, never answered
        # Its query waits 600 s: uncut, shutdown gives up after SHUTDOWN_SAVE_S with the chunks not stored.
        sender = _patient_tcp_sender()
        c = bare_push_worker(conn, meta, tmp_path, sender)
        c._url, c._async = f"tcp://127.0.0.1:{hole.getsockname()[1]}", True
        c._writer = conn._Writer(1 << 30, on_full=c._abort_push)
        _store_one(c, meta, "01" * 8)
        c._unpushed["01" * 8] = None  # a push failed earlier: the next delivery asks about it first
        keys = [f"{i:02x}" * 8 for i in range(2, 5)]
        c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", k, [0] * 8, [1, 2]) for k in keys]))
        assert sender.asking.wait(60)  # the query is out
        c.shutdown()
    assert all(c._store.has(c._ns, k) for k in keys) and c.stats.push_failures == 1
    assert c._ask_paused_until == 0.0  # the receiver may well answer queries: it was cut, not too old


def test_shutdown_ends_the_writer_thread_and_lets_the_worker_go(conn: ModuleType, meta: ModuleType, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The idle writer's thread holds its worker (on_idle): shutdown ends it, so neither outlives the engine."""
    import gc
    import weakref

    c = bare_push_worker(conn, meta, tmp_path, _Sender([]))
    c._async = True
    c._writer = conn._Writer(1 << 30, on_full=c._abort_push, on_idle=c._push_held_back, idle_s=0.05)
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", "01" * 8, list(range(8)), [1, 2])]))
    thread = c._writer._thread
    assert thread is not None and c.flush(timeout=30) and thread.is_alive()
    c.shutdown()
    assert not thread.is_alive() and c._store.has(c._ns, "01" * 8)
    worker = weakref.ref(c)
    del c
    gc.collect()
    assert worker() is None


def test_a_closed_writer_runs_its_jobs_first_and_a_later_job_starts_it_again(conn: ModuleType) -> None:
    w = conn._Writer(1 << 20, on_idle=lambda: None, idle_s=0.01)
    gate = threading.Event()
    done: list[int] = []
    w.submit(gate.wait, 1)
    w.submit(lambda: done.append(1), 1)
    thread = w._thread
    assert not w.close(timeout=0.05)  # a job still runs
    gate.set()
    assert w.close(timeout=5) and not thread.is_alive() and done == [1]
    w.submit(lambda: done.append(2), 1)
    assert w.flush(timeout=5) and done == [1, 2] and w.close(timeout=5)


def test_a_writer_without_a_thread_saves_on_the_callers_and_starts_one_later(
    conn: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``can't start new thread``: the job runs at once (as a synchronous save), and nothing is left counted."""
    w = conn._Writer(max_bytes=100)
    done: list[str] = []
    start = threading.Thread.start

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    w.submit(lambda: done.append("here"), 80)
    assert done == ["here"] and w._thread is None and (w._pending, w._held) == (0, 0)
    monkeypatch.setattr(threading.Thread, "start", start)
    w.submit(lambda: done.append("on the thread"), 80)
    w.submit(lambda: done.append("after"), 80)  # over the bound: waits for the first, which the thread runs
    assert w.flush(timeout=10) and done == ["here", "on the thread", "after"]
    assert w.close(timeout=5)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's end, on purpose
def test_a_job_that_ends_the_writer_thread_leaves_a_writer_that_runs_the_next(conn: ModuleType) -> None:
    """An error no job catches (a BaseException) ends the thread: later jobs must not queue for a dead one."""

    class _Fatal(BaseException):
        pass

    def fatal() -> None:
        raise _Fatal("gone")

    w = conn._Writer(max_bytes=100)
    done: list[int] = []
    w.submit(fatal, 80)
    first = w._thread
    assert first is not None
    first.join(10)
    assert not first.is_alive()
    w.submit(lambda: done.append(1), 80)  # would wait for ever on the 80 bytes a dead thread held
    assert w.flush(timeout=10) and done == [1] and w._held == 0
    assert w.close(timeout=5)


def test_an_unforeseen_export_error_costs_that_chunk_only_and_is_no_push_failure(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """A RuntimeError exporting a chunk (out of device memory, a bug), inside a push or the store-only loop after
    one failed: that chunk goes unsaved, the rest are stored and pushed, and the step (synchronous) goes on."""
    sender = _Sender([])
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._async = False  # the export runs on the step's thread: an error escaping it would stop the engine
    export = c._export_chunk
    keys = [f"{i:02x}" * 8 for i in range(4)]
    bad = {keys[0], keys[2]}

    def failing(ec, caches, task, block_ids, reuse=False, states=None):  # type: ignore[no-untyped-def]
        if task.key in bad:
            raise RuntimeError("CUDA error: out of memory")
        return export(ec, caches, task, block_ids, reuse, states)

    c._export_chunk = failing
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", k, list(range(8)), [1, 2]) for k in keys]))
    assert [c._store.has(c._ns, k) for k in keys] == [False, True, False, True]
    assert sender.pushed == [keys[1], keys[3]] and c.stats.push_failures == 0
    sender.fail = True  # now a push that fails: the store-only loop meets the failing export too
    more = [f"{i:02x}" * 8 for i in range(10, 14)]
    bad = {more[1], more[2]}  # the first is stored and its push fails: the others are stored only
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", k, list(range(8)), [1, 2]) for k in more]))
    assert [c._store.has(c._ns, k) for k in more] == [True, False, False, True] and c.stats.push_failures == 1


def test_shutdown_unregisters_the_chunk_buffers_from_the_process_wide_sender(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """The NIXL sender outlives the worker: a registration left behind pins its buffers for the process's life."""
    calls: list[tuple[str, list[int]]] = []
    c = bare_push_worker(conn, meta, tmp_path, _Sender(calls))
    c._async = True
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", "01" * 8, list(range(8)), [1, 2])]))
    assert c.flush(timeout=30) and [kind for kind, _ in calls] == ["register"]
    c.shutdown()
    assert calls == [("register", calls[0][1]), ("unregister", calls[0][1])] and c._registered == []


@pytest.mark.parametrize(
    ("extra", "tp", "field"),
    [
        ({}, 1, "hurray_path"),
        ({"hurray_path": "/tmp/x", "hurray_chunk_tokens": 24}, 1, "hurray_chunk_tokens"),
        ({"hurray_path": "/tmp/x", "hurray_chunk_tokens": "many"}, 1, "hurray_chunk_tokens"),
        ({"hurray_path": "/tmp/x", "hurray_url": "udp://h:1"}, 1, "hurray_url"),
        ({"hurray_path": "/tmp/x", "hurray_url": "tcp://h:port"}, 1, "hurray_url"),
        ({"hurray_path": "/x", "hurray_listen": ":9", "hurray_listen_transport": "ucx"}, 1, "hurray_listen_transport"),
        ({"hurray_path": "/tmp/x", "hurray_verified_chunks": "lots"}, 1, "hurray_verified_chunks"),
        ({"hurray_path": "/tmp/x", "hurray_verified_mib": -1}, 1, "hurray_verified_mib"),
        ({"hurray_path": "/tmp/x", "hurray_push_wait_s": "soon"}, 1, "hurray_push_wait_s"),
        ({"hurray_path": "/tmp/x", "hurray_push_wait_s": -1}, 1, "hurray_push_wait_s"),
        (
            {"hurray_path": "/x", "hurray_listen": ":0", "hurray_listen_max_connections": 0},
            1,
            "hurray_listen_max_connections",
        ),
        ({"hurray_path": "/x", "hurray_listen": ":0", "hurray_listen_quota_mib": "big"}, 1, "hurray_listen_quota_mib"),
        ({"hurray_path": "/tmp/x", "hurray_tails": "maybe"}, 1, "hurray_tails"),
        ({"hurray_path": "/tmp/x", "hurray_save_async": "sometimes"}, 1, "hurray_save_async"),
        ({"hurray_path": "/tmp/x"}, -2, "pipeline_parallel_size"),  # -2: pipeline parallelism 2
        ({"hurray_path": "/tmp/x", "hurray_chunk_tokens": 64.5}, 1, "hurray_chunk_tokens"),  # was 64
        ({"hurray_path": "/tmp/x", "hurray_chunk_tokens": True}, 1, "hurray_chunk_tokens"),
        ({"hurray_path": "/tmp/x", "hurray_save_queue_mib": 0}, 1, "hurray_save_queue_mib"),  # cut every push
        ({"hurray_path": "/x", "hurray_listen": ":0", "hurray_listen_quota_mib": "inf"}, 1, "hurray_listen_quota_mib"),
        ({"hurray_path": "/x", "hurray_listen": ":0", "hurray_listen_timeout_s": 1e12}, 1, "hurray_listen_timeout_s"),
        ({"hurray_path": "/tmp/x", "hurray_key_file": [1]}, 1, "hurray_key_file"),  # TypeError in load_keys
        ({"hurray_path": "/x", "hurray_url": "tls://h:1", "hurray_tls_ca": "/nonexistent.pem"}, 1, "hurray_tls_ca"),
    ],
)
def test_bad_configuration_is_an_argument_error_naming_the_key(extra: dict[str, object], tp: int, field: str) -> None:
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.errors import HurrayArgumentError, HurrayFormatError

    with pytest.raises(HurrayArgumentError) as info:
        config = vllm_config(extra, tp=max(tp, 1), pp=-tp if tp < 0 else 1)
        HurrayConfig.from_vllm(config, None)  # type: ignore[arg-type]
    assert info.value.field == field and isinstance(info.value, ValueError)
    assert not isinstance(info.value, HurrayFormatError)


def test_configuration_is_read_once_into_a_frozen_value() -> None:
    require("vllm")
    import dataclasses

    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig

    cfg = HurrayConfig.from_vllm(
        vllm_config(
            {"hurray_path": "/tmp/x", "hurray_chunk_tokens": 32, "hurray_url": "tcp://h:1"}, role="kv_producer"
        ),
        None,  # type: ignore[arg-type]
    )
    assert (cfg.chunk_tokens, cfg.url, cfg.saves, cfg.loads) == (32, "tcp://h:1", True, False)
    assert cfg.url_channel == "tcp"
    assert cfg.save_async and cfg.push_wait_s == 5.0  # pushes run on the background writer too
    assert cfg.listen_limits == {}  # the receiver's own defaults
    limited = HurrayConfig.from_vllm(
        vllm_config(
            {
                "hurray_path": "/x",
                "hurray_listen": ":0",
                "hurray_listen_quota_mib": 512,
                "hurray_listen_idle_timeout_s": 30,
            }
        ),
        None,  # type: ignore[arg-type]
    )
    assert limited.listen_limits == {"quota_bytes": 512 << 20, "idle_timeout": 30.0}
    for channel, arg in (("tcp", "max_inflight_bytes"), ("nixl", "max_arena_bytes")):  # one bound, either receiver
        extra = {
            "hurray_path": "/x",
            "hurray_listen": ":0",
            "hurray_listen_max_memory_mib": 64,
            "hurray_listen_transport": channel,
        }
        memory = HurrayConfig.from_vllm(vllm_config(extra), None)  # type: ignore[arg-type]
        assert memory.listen_limits == {arg: 64 << 20}
    assert cfg.save_queue_bytes == 1024 << 20 and cfg.verified_chunks >= 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_tokens = 64  # type: ignore[misc]


def _scheduler_with_one_chunk(tmp_path, chunk: int = 16):  # type: ignore[no-untyped-def]
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks.store import DirectoryStore, chunk_keys

    cfg = HurrayConfig.from_vllm(vllm_config({"hurray_path": str(tmp_path), "hurray_chunk_tokens": chunk}), None)  # type: ignore[arg-type]
    snap = spec_example_snapshot()
    store, ns = DirectoryStore(tmp_path), "cd" * 8
    tokens = list(range(chunk + 1))
    key = chunk_keys(tokens[:chunk], chunk, ns)[0]
    assert store.put(ns, key, snap)
    sched = HurrayScheduler(cfg, store, snap.fingerprint, ns)  # type: ignore[arg-type]
    return sched, store, ns, key, SimpleNamespace(request_id="r", all_token_ids=tokens)


def test_a_load_with_a_destination_plans_pushing_on_what_it_loaded(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With hurray_url, the loaded chunks go to the worker as forwards (their files; never their blocks)."""
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, forget_verified_chunks
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks.store import DirectoryStore, chunks_of, namespace_of

    ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    ns, tokens = namespace_of(chunk.fingerprint), [*chunk.token_ids[0], 1]
    store = DirectoryStore(tmp_path)
    store.put(ns, key, chunk)
    for url in (None, "tcp://127.0.0.1:1"):
        forget_verified_chunks()
        extra = {"hurray_path": str(tmp_path), "hurray_chunk_tokens": 4, **({"hurray_url": url} if url else {})}
        cfg = HurrayConfig.from_vllm(vllm_config(extra, block_size=4), None)  # type: ignore[arg-type]
        sched = HurrayScheduler(cfg, store, chunk.fingerprint, ns)
        req = SimpleNamespace(request_id="r", all_token_ids=tokens, kv_transfer_params=None)
        assert sched.get_num_new_matched_tokens(req, 0) == (4, False)  # type: ignore[arg-type]
        state = sched._reqs["r"]
        state.block_ids = [3, 4]
        meta = HurrayConnectorMetadata()
        sched._attach_load(meta, state, 4, 1)
        assert [load.keys for load in meta.loads] == [[key]] and state.load is None  # handed over once
        forwards = [(t.key, t.forward, t.block_ids) for t in meta.saves]
        assert forwards == ([] if url is None else [(key, True, [])])


def test_only_data_errors_move_a_chunk_aside(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A caller error or any other exception while checking a chunk says nothing about its file: the chunk is
    refused (it stopped the engine, at every request with its prefix), the file left in place."""
    require("vllm")
    import hurray_vllm.adapters.vllm.connector.scheduler as sm
    from hurray_vllm.adapters.vllm.connector.metadata import forget_verified_chunks
    from hurray_vllm.errors import HurrayArgumentError, HurrayFormatError

    forget_verified_chunks()
    sched, store, ns, key, req = _scheduler_with_one_chunk(tmp_path)

    def look(rid: str) -> tuple[int | None, bool]:
        # A file refused and left in place is remembered (not read again): each verdict needs a fresh look.
        forget_verified_chunks()
        return sched.get_num_new_matched_tokens(SimpleNamespace(**{**vars(req), "request_id": rid}), 0)

    for n, exc in enumerate((HurrayArgumentError("page_size", "a kernel refused it"), RuntimeError("a bug")), 1):

        def fail(*a, exc=exc, **k):  # type: ignore[no-untyped-def]
            raise exc

        monkeypatch.setattr(sm, "verify_chunk", fail)
        assert look(f"r{n}") == (0, False)
        assert store.has(ns, key) and sched.stats.chunks_refused == n and sched.stats.chunks_quarantined == 0
    sched.stats.chunks_refused = 0

    def other_model(*a, **k):  # type: ignore[no-untyped-def]
        raise HurrayFormatError("snapshot.fingerprint", "another model")

    monkeypatch.setattr(sm, "verify_chunk", other_model)
    assert look("other") == (0, False)
    assert store.has(ns, key) and sched.stats.chunks_refused == 1 and sched.stats.chunks_quarantined == 0

    def damaged(*a, **k):  # type: ignore[no-untyped-def]
        raise HurrayFormatError("snapshot.tokens", "not the tokens its key promises")

    monkeypatch.setattr(sm, "verify_chunk", damaged)
    assert look("damaged") == (0, False)
    assert not store.has(ns, key) and sched.stats.chunks_quarantined == 1


def test_an_unexpected_error_reading_or_checking_one_chunk_file_refuses_it_and_the_engine_runs_on(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Anything but a data or I/O error escaped vLLM's scheduling loop and stopped the engine, and the next
    request with the prefix stopped the next one: the file is refused (logged with the exception), left in place."""
    require("vllm")
    import hurray_vllm.adapters.vllm.connector.scheduler as sm
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.metadata import forget_verified_chunks
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks.store import DirectoryStore, chunks_of, namespace_of

    ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    ns, store = namespace_of(chunk.fingerprint), DirectoryStore(tmp_path)
    store.put(ns, key, chunk)
    cfg = HurrayConfig.from_vllm(vllm_config({"hurray_path": str(tmp_path), "hurray_chunk_tokens": 4}, 4), None)  # type: ignore[arg-type]
    req = SimpleNamespace(request_id="r", all_token_ids=[*chunk.token_ids[0], 1], kv_transfer_params=None)

    def lookup() -> tuple[int | None, bool]:
        forget_verified_chunks()
        return sm.HurrayScheduler(cfg, store, chunk.fingerprint, ns).get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]

    assert lookup() == (4, False)

    def fail(*a, **k):  # type: ignore[no-untyped-def]
        raise ValueError("a check that went wrong")

    with monkeypatch.context() as m:  # the read and the token check
        m.setattr(sm, "verify_chunk", fail)
        with caplog.at_level("WARNING", logger="hurray_vllm"):
            assert lookup() == (0, False)
        assert any(r.exc_info and isinstance(r.exc_info[1], ValueError) for r in caplog.records)
    with monkeypatch.context() as m:  # the data check, on the helper thread
        m.setattr(sm, "begin_check_data", lambda *a, **k: fail)
        assert lookup() == (0, False)
    assert store.has(ns, key) and lookup() == (4, False)


def test_a_stored_chunk_without_token_ids_is_moved_aside_not_raised_in_the_scheduler(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The loader takes a one-sequence file without token ids; reading ``token_ids[0]`` raised an IndexError
    that stopped the engine, and the file stayed for the next request to stop it again."""
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.metadata import forget_verified_chunks
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks.digest import DIGEST_KEY, chunk_digest
    from hurray_vllm.chunks.store import DirectoryStore, chunks_of, namespace_of

    forget_verified_chunks()
    ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    bad = replace(chunk, token_ids=())
    bad = replace(bad, extra={**bad.extra, DIGEST_KEY: chunk_digest(bad)})
    ns, store = namespace_of(chunk.fingerprint), DirectoryStore(tmp_path)
    store.put(ns, key, bad)
    cfg = HurrayConfig.from_vllm(vllm_config({"hurray_path": str(tmp_path), "hurray_chunk_tokens": 4}, 4), None)  # type: ignore[arg-type]
    sched = HurrayScheduler(cfg, store, chunk.fingerprint, ns)
    req = SimpleNamespace(request_id="r", all_token_ids=[*chunk.token_ids[0], 1], kv_transfer_params=None)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
    assert sched.stats.chunks_refused == 1 and sched.stats.chunks_quarantined == 1 and not store.has(ns, key)
    assert store.put(ns, key, chunk)  # the next producer writes it again


def test_is_damage_is_about_data_only() -> None:
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.scheduler import is_damage
    from hurray_vllm.errors import HurrayArgumentError, HurrayFormatError

    assert is_damage(HurrayFormatError("file.trailer_magic", "truncated"))
    assert not is_damage(HurrayFormatError("snapshot.fingerprint", "another model"))
    assert not is_damage(HurrayArgumentError("hurray_chunk_tokens", "bad"))
    assert not is_damage(OSError("gone")) and not is_damage(ValueError("other"))


def test_building_a_part_changes_nothing_process_wide(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """hurray_verified_chunks bounds the shared handoff cache on each put; it does not reset its capacity."""
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.metadata import VERIFIED

    before = VERIFIED.capacity
    _scheduler_with_one_chunk(tmp_path)
    assert VERIFIED.capacity == before


def test_verified_chunks_are_bounded_in_bytes_as_well_as_in_entries() -> None:
    """Kept chunks hold their pools in the process's memory: hurray_verified_mib bounds it, oldest out first."""
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.metadata import VerifiedChunks, snapshot_bytes
    from hurray_vllm.app.demo import spec_example_snapshot

    snap = spec_example_snapshot()
    size = snapshot_bytes(snap)
    assert size == sum(t.page_pool.numel() * t.page_pool.element_size() for t in (*snap.keys, *snap.values))
    cache = VerifiedChunks(capacity=100, max_bytes=3 * size)
    for i in range(5):
        cache.put(f"k{i}", (i,), snap)
    assert cache.nbytes == 3 * size
    assert [cache.get(f"k{i}", (i,)) is not None for i in range(5)] == [False, False, True, True, True]
    cache.put("k2", (2,), snap)  # put again: counted once
    assert cache.nbytes == 3 * size
    cache.put("big", (9,), snap, max_bytes=size - 1)  # larger than the budget alone: not kept, nor anything
    assert cache.get("big", (9,)) is None and cache.nbytes == 0
    cache.put("a", (1,), snap, capacity=1)
    cache.put("b", (1,), snap, capacity=1)
    assert cache.get("a", (1,)) is None and cache.nbytes == size
    cache.clear()
    assert cache.nbytes == 0
    bigger = VerifiedChunks(capacity=100, max_bytes=size)
    bigger.put("k", (1,), snap)
    from dataclasses import replace

    twice = replace(snap, keys=snap.keys + snap.keys, values=snap.values + snap.values)
    bigger.put("huge", (2,), twice)  # twice the budget alone: not kept, and "k" stays (it was emptied)
    assert bigger.get("huge", (2,)) is None and bigger.get("k", (1,)) is snap


def test_a_chunk_verified_without_a_fleet_key_is_not_served_to_a_keyed_connector() -> None:
    """Remembered chunks are kept by the checks they passed: a checksum alone never stands in for a MAC."""
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.metadata import VerifiedChunks, verified_scope
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks.signing import FleetKeys

    snap, keys = spec_example_snapshot(), FleetKeys.from_secrets(b"k" * 32)
    cache = VerifiedChunks(8)
    cache.put("a", (1,), snap, scope=verified_scope(None))
    assert cache.get("a", (1,), verified_scope(None)) is snap
    assert cache.get("a", (1,), verified_scope(keys)) is None
    assert cache.get("a", (1,), verified_scope(FleetKeys.from_secrets(b"o" * 32, b"k" * 32))) is None
    cache.put("a", (1,), snap, scope=verified_scope(keys))
    assert cache.get("a", (1,), verified_scope(keys)) is snap and cache.get("a", (1,), verified_scope(None)) is snap


@pytest.mark.parametrize(
    ("specs", "says"),
    [
        (["MLAAttentionSpec", "SlidingWindowSpec"], "2 KV cache groups"),
        (["EncoderOnlyAttentionSpec"], "EncoderOnlyAttentionSpec"),
        ([("MambaSpec", {"num_speculative_blocks": 1}), "FullAttentionSpec"], "speculative decoding"),
        ([("MambaSpec", {"mamba_cache_mode": "all"}), "FullAttentionSpec"], "mamba_cache_mode 'all'"),
        ([("SlidingWindowSpec", {"extra_retained_tokens": 2}), "FullAttentionSpec"], "retaining 2 tokens"),
    ],
)
def test_models_the_connector_cannot_serve_are_refused_at_start(specs: list[Any], says: str) -> None:
    """Refused when the engine builds the connector, naming what the model has: never a crash at the first save."""
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.errors import HurrayArgumentError

    def config(kinds: list[Any]) -> SimpleNamespace:
        specs = [type(k, (), {})() if isinstance(k, str) else type(k[0], (), k[1])() for k in kinds]
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=[]) for s in specs])

    with pytest.raises(HurrayArgumentError, match=says) as err:
        HurrayConfig.from_vllm(vllm_config({"hurray_path": "/tmp/x"}), config(specs))  # type: ignore[arg-type]
    assert err.value.field == "kv_cache_groups"
    # Key/value attention, MLA latents, sliding windows and full + sliding-window or linear-attention hybrids.
    for ok in (
        ["FullAttentionSpec"],
        ["MLAAttentionSpec"],
        ["SlidingWindowSpec"],
        ["SlidingWindowSpec", "FullAttentionSpec"],
        ["MambaSpec", "MambaSpec", "FullAttentionSpec"],  # linear-attention hybrids (Qwen3-Next)
    ):
        HurrayConfig.from_vllm(vllm_config({"hurray_path": "/tmp/x"}), config(ok))  # type: ignore[arg-type]
    # ReplaySSM writes a linear-attention layer's whole state back only every few decode steps.
    replaying = vllm_config({"hurray_path": "/tmp/x"})
    replaying.cache_config.use_replayssm = True
    with pytest.raises(HurrayArgumentError, match="ReplaySSM"):
        HurrayConfig.from_vllm(replaying, config(["MambaSpec", "FullAttentionSpec"]))  # type: ignore[arg-type]
    HurrayConfig.from_vllm(replaying, config(["FullAttentionSpec"]))  # type: ignore[arg-type]  # no states: fine


@pytest.mark.parametrize("policy", ["every", "last"])
def test_save_tasks_keep_the_sliding_blocks_a_resume_needs(tmp_path, policy: str) -> None:  # type: ignore[no-untyped-def]
    """Block 32, chunk 128, window 64: a resume at a chunk's end attends its last 63 tokens (blocks 2 and 3).

    With "last", only the resume at the prompt's last whole chunk (512 of 600 tokens) is kept.
    """
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler
    from hurray_vllm.chunks.store import DirectoryStore

    groups = [
        SimpleNamespace(kv_cache_spec=SimpleNamespace(sliding_window=64, block_size=32), layer_names=["l0"]),
        SimpleNamespace(kv_cache_spec=SimpleNamespace(sliding_window=None, block_size=32), layer_names=["l1"]),
    ]
    kv = SimpleNamespace(kv_cache_groups=groups)
    extra = {"hurray_path": str(tmp_path), "hurray_chunk_tokens": 128, "hurray_window_chunks": policy}
    cfg = HurrayConfig.from_vllm(vllm_config(extra, block_size=32), _specs_named(kv))  # type: ignore[arg-type]
    assert cfg.group_windows == (64, None) and cfg.save_async
    sched = HurrayScheduler(cfg, DirectoryStore(tmp_path), None, "ab" * 8)  # type: ignore[arg-type]
    request = SimpleNamespace(request_id="r", all_token_ids=list(range(600)), num_prompt_tokens=600)
    blocks = [list(range(1, 20)), list(range(101, 120))]
    state = sched._state(request)
    state.block_ids, state.groups = list(blocks[0]), [list(b) for b in blocks]
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "r", state, 600)  # type: ignore[arg-type]
    assert [t.groups[1] for t in meta.saves] == [blocks[1][c * 4 : c * 4 + 4] for c in range(4)]  # full: all kept
    sliding = [t.groups[0] for t in meta.saves]
    if policy == "every":
        assert sliding == [[0, 0, 3, 4], [0, 0, 7, 8], [0, 0, 11, 12], [0, 0, 15, 16]]
    else:  # a resume at 512 attends from 449 on: block 14 (448..479) and 15
        assert sliding == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 15, 16]]


def _specs_named(kv: SimpleNamespace) -> SimpleNamespace:
    """Give the stand-in specs vLLM's class names (what unsupported_cache reads)."""
    for g in kv.kv_cache_groups:
        name = "SlidingWindowSpec" if g.kv_cache_spec.sliding_window else "FullAttentionSpec"
        spec = type(name, (), {})()
        spec.sliding_window, spec.block_size = g.kv_cache_spec.sliding_window, g.kv_cache_spec.block_size
        g.kv_cache_spec = spec
    return kv


def test_a_full_attention_group_that_records_a_window_does_not_slide() -> None:
    """With the hybrid manager off, vLLM keeps sliding layers in a FullAttentionSpec group that frees nothing."""
    require("vllm")
    from hurray_vllm.adapters.vllm.cache import cache_groups

    spec = type("FullAttentionSpec", (), {"sliding_window": 64, "block_size": 16})()
    of_layer, windows = cache_groups(
        SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["a"])])
    )
    assert of_layer == {"a": 0} and windows == [None]


def test_a_chunk_takes_the_states_only_when_the_step_ends_at_its_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Align mode: block (n - 1) // 32 of each state group holds the state after n tokens, if a step ended there."""

    sched = linear_scheduler(tmp_path)
    request = SimpleNamespace(request_id="r", all_token_ids=list(range(300)), num_prompt_tokens=300)
    state = sched._state(request)
    # vLLM's table after a step that ran 0..256: only the last block of a state group is real.
    state.groups = [[0] * 7 + [11], [0] * 7 + [21], list(range(31, 39))]
    state.block_ids = list(state.groups[0])
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "r", state, 256)  # type: ignore[arg-type]
    assert [t.state_blocks for t in meta.saves] == [{}, {}, {}, {0: [11], 1: [21]}]
    assert meta.saves[-1].state_position == 256
    # A step that runs past a chunk's end (256..330 past 320) leaves that chunk without states...
    request.all_token_ids = list(range(400))
    state.groups = [[*g, 0, 0, 12] for g in state.groups[:2]] + [state.groups[2] + [39, 40, 41]]
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "r", state, 330)  # type: ignore[arg-type]
    assert [t.state_blocks for t in meta.saves] == [{}]
    # ...and a (decode) step that ends at one (384) gives it the state of block 383 // 32 = 11.
    state.groups = [[*g, 13] for g in state.groups[:2]] + [state.groups[2] + [42]]
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "r", state, 384)  # type: ignore[arg-type]
    assert [t.state_blocks for t in meta.saves] == [{0: [13], 1: [13]}]


def test_with_asynchronous_scheduling_a_decoded_chunk_takes_the_state_the_step_before_left(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The token ids trail the computed tokens by one: the chunk is planned a step late, from the block kept."""

    sched = linear_scheduler(tmp_path)
    request = SimpleNamespace(request_id="r", all_token_ids=list(range(383)), num_prompt_tokens=300)
    state = sched._state(request)
    state.chunks_done = 5
    state.groups = [[0] * 11 + [11], [0] * 11 + [21], list(range(31, 43))]
    state.block_ids = list(state.groups[0])
    # The decode step that ends at 384, the end of chunk 5: token 383 is not known yet, nothing is planned.
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "r", state, 384)  # type: ignore[arg-type]
    assert meta.saves == []
    # The next step (384..385) runs in block 12; block 11 keeps the state at 384, which the chunk takes.
    request.all_token_ids = list(range(384))
    state.groups = [[*g, n] for g, n in zip(state.groups, (12, 22, 43), strict=True)]
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "r", state, 385)  # type: ignore[arg-type]
    (task,) = meta.saves
    assert task.state_blocks == {0: [11], 1: [21]} and task.state_position == 384
    # A step later than that, or in "none" mode (one block, always the running state), there is none.
    for mode, done, end in (("align", 385, 386), ("none", 384, 385)):
        sched._state_mode = mode
        state.chunks_done, state.prev_end = 5, done
        meta = SimpleNamespace(saves=[])
        sched._plan_saves(meta, "r", state, end)  # type: ignore[arg-type]
        assert [t.state_blocks for t in meta.saves] == [{}], mode


def test_a_load_resumes_at_the_last_chunk_with_states_and_writes_both_state_blocks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hurray_vllm.adapters.vllm.connector.metadata import LoadTask

    sched = linear_scheduler(tmp_path)
    request = SimpleNamespace(request_id="r", all_token_ids=list(range(300)), num_prompt_tokens=300)
    state = sched._state(request)
    # 128 tokens loaded (two chunks); vLLM pads the state groups' skipped blocks with the null block.
    state.groups = [[0, 0, 0, 11, 12], [0, 0, 0, 21, 22], [31, 32, 33, 34, 35]]
    state.block_ids = list(state.groups[0])
    state.load = LoadTask("r", ["k0", "k1"], [[], []], [])
    meta = SimpleNamespace(loads=[])
    sched._attach_load(meta, state, 128, 20)  # type: ignore[arg-type]
    (load,) = meta.loads
    assert load.resume == 128
    # The state at 128 sits in block 3; the step (128..148) runs in block 4, which vLLM fills from block 3 first.
    assert load.state_blocks == {0: [11, 12], 1: [21, 22]}
    assert load.groups[2] == [31, 32, 33, 34]


def test_a_hybrid_resumes_only_at_a_chunk_whose_states_were_taken_at_its_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Found by mutation testing: a scheduler promising a resume at a chunk whose states were taken at another
    token (or that has none) failed no test; the worker, which checks again, would then fail the load promised."""
    from hurray_vllm.app.demo import spec_example_snapshot

    sched = linear_scheduler(tmp_path)  # chunks of 64 tokens
    layout = sched._config.state_layout

    def states_at(pos: int) -> Any:
        t = tuple(tuple(torch.zeros(1, *s, dtype=torch.bfloat16) for s in layout.shapes) for _ in layout.layers)
        return replace(layout, positions=(pos,)).with_tensors(t)

    snap = spec_example_snapshot(num_layers=1)
    assert not sched._resumes_at([snap], 0, 1)  # no states
    assert not sched._resumes_at([replace(snap, states=states_at(63))], 0, 1)  # taken a token before the end
    assert not sched._resumes_at([replace(snap, states=states_at(128))], 0, 1)  # taken past it
    assert sched._resumes_at([replace(snap, states=states_at(64))], 0, 1)


def test_a_stored_chunk_without_states_is_written_again_by_a_step_that_has_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import hurray_vllm as hv
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks import chunk_keys

    sched = linear_scheduler(tmp_path)
    request = SimpleNamespace(request_id="r", all_token_ids=list(range(100)), num_prompt_tokens=100)
    state = sched._state(request)
    state.groups = [[0, 11], [0, 21], [31, 32]]
    state.block_ids = list(state.groups[0])
    (key,) = chunk_keys(list(range(64)), 64, sched._ns)
    sched._store.put(sched._ns, key, spec_example_snapshot(num_layers=1))  # the same key, no states
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "r", state, 64)  # type: ignore[arg-type]
    (task,) = meta.saves
    assert task.replace and task.state_blocks == {0: [11], 1: [21]}
    # Once stored with states, the chunk is skipped like any other.
    snap = spec_example_snapshot(num_layers=1)
    states = hv.RecurrentStates("gdn_attn", (0,), ("conv",), (6, 3), ((torch.zeros(2, 3, 4),),))
    sched._store.put(sched._ns, key, replace(snap, states=states), replace=True)
    assert sched._store.has_states(sched._ns, key)
    state.chunks_done = 0
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "r", state, 64)  # type: ignore[arg-type]
    assert meta.saves == []


def test_slices_of_another_tp_degree_holding_the_states_are_not_written_again(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A TP = 1 engine stored the chunk whole without states; TP = 2 ranks wrote their slices with them: the whole
    file (looked at first) must not hide those, else every step ending there writes the slices again."""
    import hurray_vllm as hv
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks import chunk_keys
    from hurray_vllm.kv.heads import select_heads

    sched = linear_scheduler(tmp_path)
    sched._heads = 2  # a model of two KV heads
    request = SimpleNamespace(request_id="r", all_token_ids=list(range(100)), num_prompt_tokens=100)
    state = sched._state(request)
    state.groups = [[0, 11], [0, 21], [31, 32]]
    state.block_ids = list(state.groups[0])
    (key,) = chunk_keys(list(range(64)), 64, sched._ns)
    snap = replace(
        spec_example_snapshot(num_layers=1), fingerprint=hv.ModelFingerprint("Qwen3NextForCausalLM", 1, 2, 8, "float16")
    )
    states = hv.RecurrentStates("gdn_attn", (0,), ("conv",), (6, 3), ((torch.zeros(2, 3, 4),),))
    sched._store.put(sched._ns, key, snap)  # whole, without states
    for r in range(2):
        sched._store.put(sched._ns, f"{key}.h{r}-{r + 1}", replace(select_heads(snap, range(r, r + 1)), states=states))
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "r", state, 64)  # type: ignore[arg-type]
    assert meta.saves == [] and sched.stats.chunks_skipped == 1


class _Clock:
    """``time`` for a module under test, but for ``monotonic()``: a clock stopped at ``now``, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_a_request_waits_for_the_pushed_chunks_its_kv_transfer_params_announce(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``{"hurray_saved_tokens": N}`` from the source: wait while those chunks arrive, never longer than that."""
    require("vllm")
    import hurray_vllm.adapters.vllm.connector.scheduler as scheduler
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.metadata import forget_verified_chunks
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks.store import DirectoryStore, chunk_keys, chunks_of, namespace_of

    forget_verified_chunks()
    ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    ns, tokens = namespace_of(chunk.fingerprint), [*chunk.token_ids[0], 1]
    assert chunk_keys(tokens, 4, ns) == [key]
    extra = {"hurray_path": str(tmp_path), "hurray_chunk_tokens": 4, "hurray_push_wait_s": 0.5}
    cfg = HurrayConfig.from_vllm(vllm_config(extra, block_size=4), None)  # type: ignore[arg-type]
    store = DirectoryStore(tmp_path)
    sched = HurrayScheduler(cfg, store, chunk.fingerprint, ns)
    # The scheduler's clock, moved by hand: a wait of hurray_push_wait_s is read off exactly, however long a
    # step (or a machine too busy to run this test) took.
    clock = _Clock()
    monkeypatch.setattr(scheduler, "time", clock)

    def request(rid: str, toks: list[int], params: object) -> SimpleNamespace:
        return SimpleNamespace(request_id=rid, all_token_ids=toks, kv_transfer_params=params)

    moved = request("moved", tokens, {"hurray_saved_tokens": 4})
    assert sched.get_num_new_matched_tokens(moved, 0) == (None, False)  # announced, not here yet: ask again
    assert sched.get_num_new_matched_tokens(moved, 0) == (None, False)
    store.put(ns, key, chunk)  # the push arrives
    assert sched.get_num_new_matched_tokens(moved, 0) == (4, False)
    assert (sched.stats.push_waits, sched.stats.push_wait_timeouts) == (1, 0)

    # Chunks that never come (a failed push, a dead source): once none arrived for hurray_push_wait_s, recompute.
    lost = request("lost", [7] * 8 + [1], {"hurray_saved_tokens": 8})
    assert sched.get_num_new_matched_tokens(lost, 0) == (None, False)
    clock.now += 0.25
    assert sched.get_num_new_matched_tokens(lost, 0) == (None, False)  # none for 0.25 s of 0.5: it waits on
    clock.now += 0.25
    assert sched.get_num_new_matched_tokens(lost, 0) == (0, False)  # none for 0.5 s: recompute
    clock.now += 60
    assert sched.get_num_new_matched_tokens(lost, 0) == (0, False)  # the wait is over for good
    assert (sched.stats.push_waits, sched.stats.push_wait_timeouts) == (2, 1)

    # Nothing announced (or not a token count): nothing to wait for.
    for i, params in enumerate([None, {}, {"hurray_saved_tokens": "4"}, {"hurray_saved_tokens": True}, ["x"]]):
        assert sched.get_num_new_matched_tokens(request(f"plain{i}", [5] * 9, params), 0) == (0, False)
    assert sched.stats.push_waits == 2


def test_a_prompt_tail_is_saved_at_the_end_of_prefill_announced_awaited_and_loaded(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """hurray_tails, chunks of 8 and blocks of 4: a 6-token prompt has no whole chunk but a one-block tail."""
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.metadata import forget_verified_chunks
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks.store import DirectoryStore, chunks_of, namespace_of, tail_keys

    forget_verified_chunks()
    # Sequence 0 of the spec example, cut at 4 tokens: what a producer stores as the prompt's tail.
    ((key, tail),) = chunks_of(spec_example_snapshot(), 4)
    assert tail.fingerprint is not None
    ns, prompt = namespace_of(tail.fingerprint), [*tail.token_ids[0], 99, 1]
    assert tail_keys(None, prompt[:4], 4, ns) == [(4, key)]
    extra = {"hurray_path": str(tmp_path), "hurray_chunk_tokens": 8, "hurray_push_wait_s": 30}
    cfg = HurrayConfig.from_vllm(vllm_config(extra, block_size=4), None)  # type: ignore[arg-type]
    assert cfg.tails
    store = DirectoryStore(tmp_path)
    sched = HurrayScheduler(cfg, store, tail.fingerprint, ns)

    # The producer: the step that computes the whole prompt saves its first block as the tail, and the
    # request's answer announces it.
    request = SimpleNamespace(request_id="p", all_token_ids=prompt, num_prompt_tokens=6)
    state = sched._state(request)
    state.block_ids = [5, 6]
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "p", state, 4)  # type: ignore[arg-type]  # a step that ends mid-prompt: nothing yet
    assert meta.saves == []
    sched._plan_saves(meta, "p", state, 6)  # type: ignore[arg-type]
    (task,) = meta.saves
    assert (task.key, task.tokens, task.block_ids, task.tail) == (key, prompt[:4], [5], True)
    sched._plan_saves(meta, "p", state, 7)  # type: ignore[arg-type]  # once per request
    assert len(meta.saves) == 1
    assert sched.request_finished(request) == (False, {"hurray_tail_tokens": 4})  # type: ignore[arg-type]

    # The consumer of the continuation waits for the announced tail, then loads its block.
    moved = SimpleNamespace(request_id="c", all_token_ids=[*prompt, 7], kv_transfer_params={"hurray_tail_tokens": 4})
    assert sched.get_num_new_matched_tokens(moved, 0) == (None, False)  # type: ignore[arg-type]
    store.put(ns, key, tail)  # the push arrives
    assert sched.get_num_new_matched_tokens(moved, 0) == (4, False)  # type: ignore[arg-type]
    load = sched._reqs["c"].load
    assert load is not None and load.tail and load.keys == [key] and load.tokens == [prompt[:4]]
    # Unannounced, a stored tail is found by probing; one the local prefix cache covers is not loaded.
    again = SimpleNamespace(request_id="a", all_token_ids=prompt, kv_transfer_params=None)
    assert sched.get_num_new_matched_tokens(again, 0) == (4, False)  # type: ignore[arg-type]
    assert sched.get_num_new_matched_tokens(again, 4) == (0, False)  # type: ignore[arg-type]
    other = SimpleNamespace(request_id="o", all_token_ids=[11, 12, 13, 15, 99, 1], kv_transfer_params=None)
    assert sched.get_num_new_matched_tokens(other, 0) == (0, False)  # type: ignore[arg-type]  # other tokens

    off = HurrayConfig.from_vllm(vllm_config({**extra, "hurray_tails": "false"}, block_size=4), None)  # type: ignore[arg-type]
    sched = HurrayScheduler(off, store, tail.fingerprint, ns)
    assert sched.get_num_new_matched_tokens(again, 0) == (0, False)  # type: ignore[arg-type]


def test_the_connector_tells_vllm_it_is_a_best_effort_cache() -> None:
    """vLLM would otherwise drop a preempted producer's in-flight output under asynchronous scheduling."""
    require("vllm")
    from hurray_vllm.adapters.vllm.connector import HurrayConnector

    assert object.__new__(HurrayConnector).requires_kv_delivery is False


def test_a_step_whose_synchronous_load_failed_stores_none_of_its_chunks(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """Its forward pass read blocks the load did not write: what it completed may hold wrong KV (and would be
    found by key and loaded elsewhere). The next step, recomputing, saves again."""
    c = bare_push_worker(conn, meta, tmp_path, None)
    c._sender, c._url, c._async = None, None, True
    task = meta.SaveTask("r", "ab" * 8, list(range(8)), [1, 2])
    c._failed_steps = 1  # what _fail sets for a synchronous load
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[task]))
    assert c.flush(timeout=10) and not c._store.has(c._ns, task.key) and c.stats.saves_dropped == 1
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[task]))  # the flag was this step's only
    assert c.flush(timeout=10) and c._store.has(c._ns, task.key) and c.stats.chunks_saved == 1
    # With asynchronous scheduling the next step was scheduled before vLLM knew: its saves go too.
    other = meta.SaveTask("r", "cd" * 8, list(range(8)), [3, 4])
    c._failed_steps = c._steps_in_flight = 2
    for _ in range(3):
        c.wait_for_save(meta.HurrayConnectorMetadata(saves=[other]))
        assert c.flush(timeout=10)
    assert c._store.has(c._ns, other.key) and c.stats.saves_dropped == 3 and c.stats.chunks_saved == 2


def test_a_chunk_whose_pools_disagree_with_its_fingerprint_is_refused_before_any_promise(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A faulty producer's file: its checksum covers its pools (head_dim 8) and its fingerprint says 16. Taken,
    its blocks' write would fail inside the worker and stop the engine; the scheduler refuses it."""
    from bare_worker import CHUNK, gqa_fingerprint, two_chunks

    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler
    from hurray_vllm.chunks.store import DirectoryStore, chunks_of, namespace_of

    snap = two_chunks(dim=8, fingerprint=gqa_fingerprint())  # pools of head_dim 8, its fingerprint says 16
    store = DirectoryStore(tmp_path)
    for key, chunk in chunks_of(snap, CHUNK):  # put as such a producer would: store_snapshot validates, and refuses it
        assert chunk.fingerprint is not None
        store.put(namespace_of(chunk.fingerprint), key, chunk)
    cfg = HurrayConfig.from_vllm(vllm_config({"hurray_path": str(tmp_path), "hurray_chunk_tokens": CHUNK}, 4), None)  # type: ignore[arg-type]
    sched = HurrayScheduler(cfg, store, gqa_fingerprint(), namespace_of(gqa_fingerprint()))
    request = SimpleNamespace(request_id="r", all_token_ids=list(snap.token_ids[0]), kv_transfer_params=None)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert sched.stats.chunks_refused == 1 and sched.stats.chunks_quarantined == 0  # left in place


def test_a_block_write_that_fails_is_reported_not_raised(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Whatever fails while a load writes its blocks: the worker reports them (recomputed), the engine lives on."""
    from bare_worker import CHUNK, cpu_worker, stored_at_tp

    import hurray_vllm.adapters.vllm.connector.worker as worker_module
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, LoadTask

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    parts = [store.parts(ns, k, 2) for k in keys]
    tokens = [list(snap.token_ids[0][c * CHUNK : (c + 1) * CHUNK]) for c in range(2)]
    verified = [[(p.name, p.heads.start, p.heads.stop, p.identity) for p in ps] for ps in parts]  # type: ignore[union-attr]
    worker = cpu_worker(store, ns)
    calls: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) > 1:  # the first layer is written: a part of the load lies in the blocks
            raise RuntimeError("the cache moved under us")

    monkeypatch.setattr(worker_module, "write_blocks", broken)
    worker.start_load_kv(HurrayConnectorMetadata(loads=[LoadTask("r", keys, tokens, [5, 2, 7, 1], verified)]))
    assert worker.get_block_ids_with_load_errors() == {5, 2, 7, 1} and worker.stats.loads_failed == 1


def test_late_described_caches_refused_fail_the_load_not_the_engine(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """vLLM may never call register_kv_caches: the worker describes its caches at the first load. A cache it
    cannot serve then raised out of start_load_kv into vLLM's step (stopping the engine), as a format error;
    now the load fails (recomputed) and the refusal is the same argument error as at start."""
    from bare_worker import CHUNK, cpu_worker, stored_at_tp

    import hurray_vllm.adapters.vllm.connector.worker as worker_module
    from hurray_vllm import HurrayArgumentError, HurrayFormatError
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, LoadTask

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    parts = [store.parts(ns, k, 2) for k in keys]
    tokens = [list(snap.token_ids[0][c * CHUNK : (c + 1) * CHUNK]) for c in range(2)]
    verified = [[(p.name, p.heads.start, p.heads.stop, p.identity) for p in ps] for ps in parts]  # type: ignore[union-attr]
    worker = cpu_worker(store, ns)
    worker._ec, worker._vllm_config, worker._kv_cache_config = None, None, None

    def refused(*args: Any, **kwargs: Any) -> None:
        raise HurrayFormatError("kv_cache_dtype", "HurrayConnector does not handle this cache")

    monkeypatch.setattr(worker_module, "describe_worker_cache", refused)
    monkeypatch.setattr(worker_module, "attention_layers", lambda cfg: {})
    with pytest.raises(HurrayArgumentError) as err:
        worker._describe([], [])
    assert err.value.field == "kv_cache_dtype"
    worker.start_load_kv(HurrayConnectorMetadata(loads=[LoadTask("r", keys, tokens, [5, 2, 7, 1], verified)]))
    assert worker.get_block_ids_with_load_errors() == {5, 2, 7, 1} and worker.stats.loads_failed == 1


def test_a_hybrid_resumes_at_the_furthest_chunk_any_complete_set_of_whose_files_carries_states(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Chunk 0 is stored whole without states (its step ran past its end) and as TP = 2 slices with states;
    chunk 1 whole without states. Only the last chunk found was looked at for a set with states: a prompt
    running past chunk 1 stepped back over chunk 0's whole file and loaded nothing."""
    require("vllm")
    from dataclasses import replace

    import torch

    import hurray_vllm as hv
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks import chunk_keys
    from hurray_vllm.kv.heads import select_heads

    sched = linear_scheduler(tmp_path)
    sched._heads = 2
    st, ns = sched._store, sched._ns
    tokens = list(range(200))
    probe = SimpleNamespace(request_id="x", all_token_ids=tokens, num_prompt_tokens=200)
    keys = chunk_keys(tokens[:192], 64, sched._seed(sched._state(probe)) or ns)
    snap = replace(
        spec_example_snapshot(num_layers=1).select([0]),
        fingerprint=hv.ModelFingerprint("Qwen3NextForCausalLM", 1, 2, 8, "float16"),
    )

    def states_at(pos: int) -> hv.RecurrentStates:
        pair = (torch.zeros(1, 3, 16, dtype=torch.bfloat16), torch.zeros(1, 2, 8, 4, dtype=torch.bfloat16))
        return hv.RecurrentStates("gdn_attn", (0, 1), ("conv", "ssm"), (pos,), (pair, pair), attention=(2,))

    st.put(ns, keys[0], snap)
    for r in range(2):
        st.put(ns, f"{keys[0]}.h{r}-{r + 1}", select_heads(replace(snap, states=states_at(64)), range(r, r + 1)))
    st.put(ns, keys[1], snap)
    read: list[str] = []

    def read_parts(parts, toks, reader=None):  # type: ignore[no-untyped-def]
        read.extend(p.name for p in parts)
        return [st.get(ns, p.name) for p in parts], [None] * len(parts)

    sched._read_parts = read_parts  # the selection alone: every file reads and verifies
    sched._passed = lambda parts, snaps, checks: True
    for rid, n in (("long", 200), ("short", 100)):
        req = SimpleNamespace(request_id=rid, all_token_ids=tokens[:n], num_prompt_tokens=n, kv_transfer_params=None)
        # Asynchronous: a model of several KV cache groups loads so wherever its worker runs (config._async_loads).
        assert sched.get_num_new_matched_tokens(req, 0) == (64, True), rid
    assert keys[1] + ".hrry" not in read  # past the resume point: not read


def _no_memory(*args: Any, **kwargs: Any) -> Any:
    raise torch.OutOfMemoryError("no memory for the copy")


def test_a_synchronous_save_whose_states_copy_fails_costs_that_chunk_and_the_engine_runs_on(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """vLLM calls wait_for_save inside its step: an error copying a chunk's states must not escape into it."""
    c = bare_push_worker(conn, meta, tmp_path, None)
    c._sender, c._url, c._async = None, None, False
    c._engine_cache().states = SimpleNamespace(gather=_no_memory)
    with_states = meta.SaveTask("r", "ab" * 8, list(range(8)), [1, 2], state_blocks={1: [3]}, state_position=8)
    plain = meta.SaveTask("r", "cd" * 8, list(range(8)), [4, 5])
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[with_states, plain]))
    assert c.stats.saves_failed == 1 and not c._store.has(c._ns, with_states.key) and c._store.has(c._ns, plain.key)


class _TpGroup:
    """torch.distributed's collectives as one rank sees them: ``others`` is what the other rank adds to a flag."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, others: int = 0, broken: bool = False) -> None:
        import torch.distributed as dist
        import vllm.distributed

        self.others, self.broken = others, broken
        self.reduced: list[int] = []
        self.gathers = 0
        monkeypatch.setattr(vllm.distributed, "get_tp_group", lambda: SimpleNamespace(cpu_group=None))
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)
        monkeypatch.setattr(dist, "all_gather", self.all_gather)

    def all_reduce(self, t: torch.Tensor, op: Any = None, group: Any = None) -> None:
        if self.broken:
            raise RuntimeError("Connection closed by peer")
        self.reduced.append(int(t.item()))
        t.fill_(max(int(t.item()), self.others))

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor, group: Any = None) -> None:
        self.gathers += 1
        for o in out:
            o.copy_(t)


def test_a_rank_whose_states_copy_fails_still_takes_part_in_the_collectives(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At TP > 1 with shared states every rank must make the same collectives: a rank that cannot copy its share
    says so in one all-reduce, and then no rank gathers; the chunk is saved without states, nothing raises."""
    task = meta.SaveTask("r", "ab" * 8, list(range(8)), [1, 2], state_blocks={1: [3]}, state_position=8)
    for mine_fails, others in ((True, 0), (False, 1)):  # this rank's copy fails / the other rank's did
        c = bare_push_worker(conn, meta, tmp_path / str(others), None)
        c._sender, c._url, c._async, c._tp, c._shares_states = None, None, True, 2, True
        c._engine_cache().states = SimpleNamespace(gather=_no_memory if mine_fails else lambda *a: "share")
        monkeypatch.setattr(conn, "pack_states", lambda s: torch.zeros(8, dtype=torch.uint8))
        group = _TpGroup(monkeypatch, others=others)
        c.wait_for_save(meta.HurrayConnectorMetadata(saves=[task]))
        assert group.reduced == [int(mine_fails)] and group.gathers == 0
        assert c.flush(timeout=30) and c._store.has(c._ns, task.key) and c.stats.chunks_saved == 1
    # A broken channel: the collective raises on this rank; the step's saves are dropped (it cannot know whether
    # another rank's load failed), and nothing raises into the step.
    c = bare_push_worker(conn, meta, tmp_path / "broken", None)
    c._sender, c._url, c._async, c._tp = None, None, True, 2
    _TpGroup(monkeypatch, broken=True)
    load = meta.LoadTask("r", [], [], [])
    c.wait_for_save(meta.HurrayConnectorMetadata(loads=[load], saves=[replace(task, state_blocks={})]))
    assert c.flush(timeout=30) and c.stats.saves_dropped == 1 and not c._store.has(c._ns, task.key)


def test_a_step_completing_more_chunks_than_the_save_queue_holds_copies_them_in_batches(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """hurray_save_queue_mib bounds what one step copies out too: in batches that fit, the step waiting between."""
    bound = 8 << 10  # 8 blocks of 1 KiB
    c = bare_push_worker(conn, meta, tmp_path, None)
    c._sender, c._url, c._async = None, None, True
    c._writer, c._staging = conn._Writer(bound, on_full=c._abort_push), conn._Staging(bound)
    c._engine_cache().caches = [torch.zeros((64, 256), dtype=torch.float32)]
    seen: list[int] = []  # what the queue holds, each time the writer takes a job
    deliver = c._deliver

    def recording(*args: Any) -> None:
        time.sleep(0.01)  # a slow disk: the step gets ahead of the writer unless it waits
        seen.append(c._writer._held)
        deliver(*args)

    c._deliver = recording
    tasks = [meta.SaveTask("r", f"{i:032x}", list(range(8)), [2 * i + 1, 2 * i + 2]) for i in range(20)]
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=tasks))  # 40 KiB of blocks
    assert c.flush(timeout=60) and c.stats.chunks_saved == 20 and not c._inflight
    assert len(seen) >= 5 and max(seen) <= bound
    assert sum(b.numel() * b.element_size() for bufs in c._staging._free for b in bufs) <= bound  # kept for reuse


def test_staging_keeps_no_more_than_its_bound_of_recycled_buffers(conn: ModuleType) -> None:
    caches = [torch.zeros((16, 4), dtype=torch.float32)]  # 16 bytes a block
    staging = conn._Staging(64)
    sets = [staging.copy(caches, torch.arange(n))[1] for n in (1, 2, 3, 4)]  # 160 bytes handed out at once
    for bufs in sets:
        staging.recycle(bufs)
    assert sum(staging.capacity(b) for b in staging._free) <= 64 and staging._out_bytes == 0
    assert [staging.capacity(b) for b in staging._free] == [64]  # the largest that fits


def test_after_a_large_save_a_one_block_save_holds_its_own_bytes_and_the_next_step_does_not_wait(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """The queue is charged a copy's whole buffer: in the buffer a large save left, a 1-block save would hold about
    the whole bound, and the next step would wait for the push in flight and cut it (push_failures, backoff)."""
    sender = _Sender([])
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._async = True
    per_block = 16  # the stand-in engine's one layer: blocks of 4 float32
    bound = 10 * per_block
    full: list[None] = []

    def on_full() -> None:  # a step waits for room: it cuts the push in flight (an abort ends the stand-in's wait)
        full.append(None)
        c._abort_push()
        sender.gate.set()

    c._writer, c._staging = conn._Writer(bound, on_full=on_full), conn._Staging(bound)
    large = meta.SaveTask("r", "00" * 8, list(range(8)), list(range(1, 11)))  # 10 blocks: the whole bound
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[large]))
    assert c.flush(timeout=30) and sender.pushed == ["00" * 8]
    sender.gate.clear()  # a destination slow to acknowledge: the next push stays in flight
    sender.gate_s = 600.0
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", "01" * 8, list(range(8)), [1])]))
    assert c._writer._held <= 2 * per_block  # about its own bytes, not the 10-block buffer's
    t0 = time.monotonic()
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", "02" * 8, list(range(8)), [2])]))
    assert time.monotonic() - t0 < 30  # a hang guard
    assert not full and sender.aborts == 0
    sender.gate.set()
    assert c.flush(timeout=30) and sender.pushed == ["00" * 8, "01" * 8, "02" * 8] and c.stats.push_failures == 0


def test_staging_refuses_a_block_outside_the_cache_before_copying(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """On CUDA an index past the cache is a device-side assert: checked on the host, as write_blocks does."""
    from hurray_vllm.errors import HurrayFormatError

    staging = conn._Staging(1 << 20)
    caches = [torch.zeros((6, 4))]
    for ids in (torch.tensor([1, 6]), [torch.tensor([-1])]):
        with pytest.raises(HurrayFormatError) as info:
            staging.copy(caches, ids)
        assert info.value.field == "block_ids"
    assert staging._out_bytes == 0
    c = bare_push_worker(conn, meta, tmp_path, None)
    c._sender, c._url, c._async = None, None, True
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", "ab" * 8, list(range(8)), [15, 16])]))
    assert c.flush(timeout=30) and c.stats.saves_failed == 1 and not c._inflight


def test_saves_that_fail_or_find_the_file_stored_are_counted(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """A write that fails (disk full) is a failed save; a file stored meanwhile by another writer, a skipped one."""
    import errno

    c = bare_push_worker(conn, meta, tmp_path, None)
    c._sender, c._url, c._async = None, None, True
    put = c._store.put

    def full(*args: Any, **kwargs: Any) -> bool:
        raise OSError(errno.ENOSPC, "No space left on device")

    object.__setattr__(c._store, "put", full)
    tasks = [meta.SaveTask("r", f"{i:032x}", list(range(8)), [1, 2]) for i in range(3)]
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=tasks))
    assert c.flush(timeout=30) and c.stats.saves_failed == 3 and c.stats.chunks_saved == 0
    object.__setattr__(c._store, "put", lambda *args, **kwargs: False)  # stored meanwhile
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=tasks[:1]))
    assert c.flush(timeout=30) and c.stats.chunks_skipped == 1 and c.stats.saves_failed == 3
    object.__setattr__(c._store, "put", put)


def test_a_step_whose_copies_fail_still_pushes_its_stored_chunks_later(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """A chunk of the step only to push on never reaches the writer when the copies fail: it is remembered."""
    sender = _Sender([])
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._async = True
    _store_one(c, meta, "01" * 8)
    c._staging.copy = _no_memory
    forward = meta.SaveTask("r", "01" * 8, [], [], forward=True)
    new = meta.SaveTask("r", "ee" * 8, list(range(8)), [4, 5])
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[forward, new]))
    assert c.flush(timeout=30) and c.stats.saves_failed == 1 and c.stats.saves_dropped == 0
    assert list(c._unpushed) == [forward.key] and not c._inflight


def test_a_step_whose_synchronous_load_failed_still_pushes_on_the_chunks_it_loaded(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """A chunk only to push on is read from its files, not from the step's blocks: the failed load drops the chunks
    the step completed, not the pushes of what another request loaded."""
    sender = _Sender([])
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._async = True
    _store_one(c, meta, "01" * 8)
    forward = meta.SaveTask("r2", "01" * 8, [], [], forward=True)
    new = meta.SaveTask("r", "ee" * 8, list(range(8)), [4, 5])
    c._failed_steps = 1  # what _fail sets for a synchronous load
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[forward, new]))
    assert c.flush(timeout=30) and sender.pushed == [forward.key] and not c._store.has(c._ns, new.key)
    assert c.stats.saves_dropped == 1 and not c._unpushed


def test_a_store_that_cannot_be_listed_fails_the_push_and_keeps_what_it_held_back(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """A passing error listing the chunks to push on (ESTALE, EMFILE) is a failed push: neither the chunks held
    back by an earlier failure nor those to push on are forgotten, and the next delivery pushes them."""
    import errno

    sender = _Sender([])
    c = bare_push_worker(conn, meta, tmp_path, sender)
    c._async = True
    keys = ["01" * 8, "02" * 8]
    for k in keys:
        _store_one(c, meta, k)
    c._unpushed[keys[0]] = None  # held back by an earlier failed push
    parts, calls = c._store.parts, []

    def stale(*args: Any, **kwargs: Any) -> Any:
        calls.append(None)
        if len(calls) == 1:
            raise OSError(errno.ESTALE, "Stale file handle")
        return parts(*args, **kwargs)

    object.__setattr__(c._store, "parts", stale)
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", keys[1], [], [], forward=True)]))
    assert c.flush(timeout=30) and c.stats.push_failures == 1 and sender.pushed == []
    assert list(c._unpushed) == keys
    c._push_paused_until = 0.0  # the pause is over
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", "ee" * 8, list(range(8)), [4, 5])]))
    assert c.flush(timeout=30) and sender.pushed == [*keys, "ee" * 8] and not c._unpushed


def test_the_chunks_a_failed_copy_leaves_to_push_are_remembered_on_the_writers_thread(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """The writer iterates the chunks held back as it delivers: the step's thread must not change them meanwhile."""
    c = bare_push_worker(conn, meta, tmp_path, _Sender([]))
    c._async = True
    _store_one(c, meta, "01" * 8)
    c._staging.copy = _no_memory
    remember, threads = c._remember_unpushed, []

    def recording(items: Any) -> None:
        threads.append(threading.current_thread())
        remember(items)

    c._remember_unpushed = recording
    forward = meta.SaveTask("r", "01" * 8, [], [], forward=True)
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[forward, meta.SaveTask("r", "ee" * 8, list(range(8)), [4, 5])]))
    assert c.flush(timeout=30) and list(c._unpushed) == [forward.key]
    assert threads and all(t.name == "hurray-save" for t in threads)


def test_a_delivery_that_raises_counts_its_chunks_as_failed(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug the delivery does not catch: the batch's chunks are neither stored nor forgotten by the counters."""
    c = bare_push_worker(conn, meta, tmp_path, _Sender([]))
    c._async = True

    def broken(*args: Any) -> None:
        raise RuntimeError("OrderedDict mutated during iteration")

    c._deliver = broken
    tasks = [meta.SaveTask("r", f"{i:02x}" * 8, list(range(8)), [2 * i + 1, 2 * i + 2]) for i in range(2)]
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=tasks))
    assert c.flush(timeout=30) and c.stats.saves_failed == 2 and not c._inflight
    assert "background save failed" in caplog.text


def test_interpreter_exit_cuts_a_hung_push_and_stores_everything(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At exit, as at shutdown: a push blocked on a receiver that never reads must not keep the saves from disk."""
    import socket

    monkeypatch.setattr(conn, "SHUTDOWN_PUSH_GRACE_S", 0.2)
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        sender = _patient_tcp_sender()
        c = bare_push_worker(conn, meta, tmp_path, sender)
        c._url, c._async = f"tcp://127.0.0.1:{hole.getsockname()[1]}", True
        c._writer = conn._Writer(1 << 30, on_full=c._abort_push)
        monkeypatch.setattr(conn, "_WORKERS", conn.weakref.WeakSet([c]))
        keys = [f"{i:02x}" * 8 for i in range(4)]
        c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", k, [0] * 8, [1, 2]) for k in keys]))
        assert sender.sending.wait(60)  # the push is out: started only after the 0.2 s grace, it is never tried
        t0 = time.monotonic()
        conn._drain_writers()
        assert time.monotonic() - t0 < 30  # not the push's 600 s, nor a flush's 60
        assert all(c._store.has(c._ns, k) for k in keys) and c.stats.push_failures == 1


def test_a_worker_dropped_without_shutdown_is_collected_and_its_writer_thread_ends(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path
) -> None:
    """The writer holds its worker's methods weakly: an idle writer thread must not keep the engine's caches."""
    import gc
    import weakref

    from hurray_vllm import ModelFingerprint
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.chunks.store import DirectoryStore

    c = bare_push_worker(conn, meta, tmp_path, _Sender([]))
    c._async = True
    c._writer = conn._Writer(1 << 30, on_full=c._abort_push, on_idle=c._push_held_back, idle_s=0.05)
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=[meta.SaveTask("r", "01" * 8, list(range(8)), [1, 2])]))
    thread = c._writer._thread
    assert thread is not None and c.flush(timeout=30)
    worker = weakref.ref(c)
    del c
    # A hang guard, not a timing: an idle round in progress holds the worker until it returns.
    assert wait_for(lambda: gc.collect() >= 0 and worker() is None, 60)
    thread.join(60)
    assert not thread.is_alive()  # on its next idle round it found its worker gone
    # A worker as the connector builds it (a writer with no idle work: its thread waits for jobs only).
    config = HurrayConfig.from_vllm(vllm_config({"hurray_path": str(tmp_path)}), None)  # type: ignore[arg-type]
    w = conn.HurrayWorker(config, DirectoryStore(tmp_path), ModelFingerprint("T", 1, 1, 8, "bfloat16"), "ab" * 8)
    assert w in conn._WORKERS
    w._writer.submit(lambda: None, 1)
    thread = w._writer._thread
    assert thread is not None and w.flush(timeout=30)
    worker = weakref.ref(w)
    del w
    gc.collect()
    assert worker() is None
    thread.join(60)
    assert not thread.is_alive()  # ended by the worker's finalizer


def test_a_rank_slice_exported_with_another_head_count_is_refused(  # type: ignore[no-untyped-def]
    conn: ModuleType, meta: ModuleType, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slice claiming heads its pools do not hold would be stored and refused by every reader: refused here."""
    from hurray_vllm.errors import HurrayFormatError
    from hurray_vllm.kv.snapshot import HeadRange

    c = bare_push_worker(conn, meta, tmp_path, None)
    ec = SimpleNamespace(caches=[torch.zeros((16, 4))], layout=None, export_options=lambda: {})
    task = meta.SaveTask("r", "ab" * 8, list(range(8)), [1, 2])
    one_head = c._export_chunk(ec, ec.caches, task, [1, 2], True)  # the stub: one KV head
    monkeypatch.setattr(conn, "export_snapshot", lambda *args, **kwargs: one_head)
    c._my_heads = HeadRange(0, 2, 4)
    with pytest.raises(HurrayFormatError) as info:
        conn.HurrayWorker._export_chunk(c, ec, ec.caches, task, [1, 2])
    assert info.value.field == "snapshot.heads"
    c._my_heads = HeadRange(1, 2, 2)
    assert conn.HurrayWorker._export_chunk(c, ec, ec.caches, task, [1, 2]).heads == HeadRange(1, 2, 2)


def test_machine_limits_are_expected_failures_and_bugs_are_not(conn: ModuleType) -> None:
    """One rule for every failure the worker logs: a traceback only for what is neither bad data nor a limit."""
    from hurray_vllm.errors import HurrayFormatError

    for exc in (MemoryError(), torch.OutOfMemoryError("cuda"), OSError(28, "full"), HurrayFormatError("x", "y")):
        assert conn._expected_failure(exc)
    assert not conn._expected_failure(RuntimeError("a bug")) and not conn._expected_failure(KeyError("k"))
