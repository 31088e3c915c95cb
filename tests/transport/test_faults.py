"""Faults on loopback (#21): a receiver or a sender SIGKILLed mid-chunk, a full disk. Nothing partial, ever.

Each fault is injected into a real process (``hurray-vllm receive``, or a
sender in a subprocess). Afterwards no partial chunk is visible, the store
is consistent (``fsck`` finds it clean, at most a temporary file a killed
writer left, which no reader takes for a chunk), and the receiver (or its
restart) takes the next chunk as before.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from servers import ROOT, readline_within
from synthetic import example_chunk

from hurray_vllm import KVSnapshot, transport
from hurray_vllm.chunks import DirectoryStore, fsck
from hurray_vllm.containers.io import write_stream
from hurray_vllm.transport.tcp import Receiver, frame_head


def _stream(snap: KVSnapshot) -> bytes:
    import io

    buf = io.BytesIO()
    write_stream(snap, buf)
    return buf.getvalue()


def _receive(store: Path, log: Path, preexec: Callable[[], None] | None = None) -> tuple[subprocess.Popen[str], int]:
    """``hurray-vllm receive`` on a free port; the process and its port."""
    cmd = [sys.executable, "-m", "hurray_vllm.app.cli", "receive", "--listen", "127.0.0.1:0", "--dir", str(store)]
    with open(log, "a") as err:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            preexec_fn=preexec,
        )
    line = readline_within(proc, 120, "hurray-vllm receive", log)  # killed, and failed with its log, if it hangs
    if " on " not in line:
        proc.kill()
        pytest.fail(f"hurray-vllm receive did not start:\n{log.read_text()[-2000:]}")
    return proc, int(line.split(" on ")[1].split()[0].rsplit(":", 1)[1])


def _read_by_peer(sock: socket.socket) -> bool:
    """Everything ``sock`` sent was read by the process at its other end (Linux: ``/proc/net/tcp``).

    Both ends are on loopback: ``sock``'s send queue is acknowledged (empty) and
    the peer's socket has nothing left in its receive queue.
    """
    mine, peer = f"{sock.getsockname()[1]:04X}", f"{sock.getpeername()[1]:04X}"
    sent = received = False
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        tx, rx = (int(q, 16) for q in f[4].split(":"))
        if f[1].endswith(":" + mine) and f[2].endswith(":" + peer):
            sent = tx == 0
        elif f[1].endswith(":" + peer) and f[2].endswith(":" + mine):
            received = rx == 0
    return sent and received


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _files(store: Path) -> list[str]:
    return sorted(p.name for p in store.rglob("*") if p.is_file())


def _consistent(store: Path) -> None:
    """No chunk file but whole, verified ones; ``fsck`` clean."""
    report = fsck(DirectoryStore(store))
    assert report.clean, report.damaged


def test_a_receiver_killed_mid_chunk_leaves_nothing_and_its_restart_takes_the_chunk(tmp_path: Path) -> None:
    ns, key, chunk = example_chunk()
    store = tmp_path / "store"
    proc, port = _receive(store, tmp_path / "receiver.log")
    try:
        body = _stream(chunk)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(frame_head(ns, key, len(body)) + body[: len(body) * 2 // 3])
            deadline = time.monotonic() + 60  # a hang guard: the receiver reads what it got, and waits for the rest
            while not _read_by_peer(s):
                assert time.monotonic() < deadline, "the receiver did not read the chunk's first part"
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    finally:
        _stop(proc)
    assert not DirectoryStore(store).has(ns, key) and not [f for f in _files(store) if f.endswith(".hrry")]
    _consistent(store)
    proc, port = _receive(store, tmp_path / "receiver.log")
    try:
        transport.send_chunks(f"tcp://127.0.0.1:{port}", [(ns, key, chunk)])
    finally:
        _stop(proc)
    assert DirectoryStore(store).has(ns, key)
    _consistent(store)


def test_a_sender_killed_mid_chunk_stores_nothing_and_the_receiver_serves_on(tmp_path: Path) -> None:
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path / "store")
    body = _stream(chunk)
    (tmp_path / "part.bin").write_bytes(frame_head(ns, key, len(body)) + body[: len(body) // 2])
    with Receiver("127.0.0.1", 0, store, timeout=30).start() as r:
        script = textwrap.dedent(
            f"""
            import socket, sys, time
            s = socket.create_connection(("127.0.0.1", {r.address[1]}))
            s.sendall(open({str(tmp_path / "part.bin")!r}, "rb").read())
            print("sent", flush=True)
            time.sleep(60)
            """
        )
        sender = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            if readline_within(sender, 120, "the sender").strip() != "sent":
                sender.kill()
                pytest.fail(f"the sender did not send:\n{sender.communicate(timeout=30)[1][-2000:]}")
        finally:
            sender.kill()  # mid-chunk: the kernel closes its socket (and killed whatever failed above)
            sender.wait(timeout=30)
        deadline = time.monotonic() + 60
        while r.refused < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.refused == 1 and "disconnected" in (r.last_error or ""), r.last_error
        assert not store.has(ns, key) and not _files(tmp_path / "store")
        transport.send_chunks(f"tcp://127.0.0.1:{r.address[1]}", [(ns, key, chunk)])
        assert store.has(ns, key) and r.received == 1
    _consistent(tmp_path / "store")


def test_a_full_disk_refuses_the_chunk_and_leaves_no_file(tmp_path: Path) -> None:
    """The receiver's process may write no file beyond 2 KiB (RLIMIT_FSIZE): a write fails as on a full disk."""
    ns, key, chunk = example_chunk()
    store = tmp_path / "store"

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    proc, port = _receive(store, tmp_path / "receiver.log", preexec=small_files)
    try:
        url = f"tcp://127.0.0.1:{port}"
        for name in (key, "ab" * 8):  # the receiver serves on after the first failure
            with pytest.raises(Exception, match="refused") as info:
                transport.send_chunks(url, [(ns, name, chunk)])
            assert "File too large" in str(info.value) or "EFBIG" in str(info.value), info.value
        assert proc.poll() is None
    finally:
        _stop(proc)
    assert _files(store) == []  # no chunk, and no temporary file either
    _consistent(store)


def test_an_abort_for_one_owner_leaves_another_owners_push_on_the_same_sender_running(tmp_path: Path) -> None:
    """One sender object serves several callers (the process-wide NIXL sender serves every engine in it): engine
    A giving up on its push (a full save queue, shutdown) cut engine B's too, which B took for a failed receiver."""
    import threading
    from collections.abc import Iterator

    from hurray_vllm.transport.base import SendAborted
    from hurray_vllm.transport.tcp import TcpSender

    ns, key, chunk = example_chunk()

    class Slow(DirectoryStore):
        def put(self, *args: object, **kwargs: object) -> object:
            time.sleep(2)  # B's push is in flight while A's is cut
            return super().put(*args, **kwargs)  # type: ignore[arg-type]

    sender, a, b = TcpSender(), object(), object()
    results: dict[str, BaseException | None] = {}

    def push(owner: object, url: str, name: str) -> None:
        try:
            sender.send(url, [(ns, key, chunk)], timeout=60, owner=owner)
            results[name] = None
        except BaseException as exc:
            results[name] = exc

    with Receiver("127.0.0.1", 0, Slow(tmp_path), timeout=30) as r, socket.create_server(("127.0.0.1", 0)) as hole:
        # A's destination never answers: only an abort ends A's push in the test's time.
        urls = {"a": f"tcp://127.0.0.1:{hole.getsockname()[1]}", "b": f"tcp://127.0.0.1:{r.address[1]}"}
        threads = {n: threading.Thread(target=push, args=(o, urls[n], n)) for n, o in (("a", a), ("b", b))}
        for t in threads.values():
            t.start()
        deadline = time.monotonic() + 60
        while len(sender._live_sockets()) < 2 and len(results) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sender._live_sockets()) == 2, results  # both pushes are out
        sender.abort(a)
        threads["a"].join(30)
        assert isinstance(results.get("a"), SendAborted)
        threads["b"].join(30)
        assert "b" in results and results["b"] is None and DirectoryStore(tmp_path).has(ns, key)

        # Aborted while its first chunk is made (no socket yet to shut): its own owner's abort only.
        def first_made_during(owner: object) -> Iterator[tuple[str, str, KVSnapshot]]:
            sender.abort(owner)
            yield ns, "ef" * 8, chunk

        with pytest.raises(SendAborted):
            sender.send(urls["b"], first_made_during(b), timeout=30, owner=b)
        sender.send(urls["b"], first_made_during(a), timeout=30, owner=b)
        assert DirectoryStore(tmp_path).has(ns, "ef" * 8)
        assert not sender._live_sockets() and not sender._callers()  # nothing kept of owners whose calls ended
