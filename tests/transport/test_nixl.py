"""The NIXL transport: KV chunks between two processes on 127.0.0.1 (CPU, UCX), and its failure modes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from blocking import wait_for
from conftest import require
from hypothesis import given
from servers import ROOT
from strategies import snapshots

import hurray_vllm as hv
from hurray_vllm import BlockPagedTensor, KVSnapshot, ModelFingerprint, SnapshotSource
from hurray_vllm.chunks.store import DIGEST_KEY, DirectoryStore, chunk_digest, chunks_of, namespace_of
from hurray_vllm.containers.schema import snapshot_records
from hurray_vllm.transport import nixl as tn
from hurray_vllm.transport.nixl import agent as tn_agent
from hurray_vllm.transport.nixl import offer as tn_offer
from hurray_vllm.transport.nixl import receiver as tn_receiver
from hurray_vllm.transport.nixl import sender as tn_sender

#: The sender process: loads a chunk and pushes it; ``die`` kills itself right after posting the first WRITE.
SENDER = """
import os, signal, sys
import hurray_vllm as hv
from hurray_vllm.transport import nixl as tn
mode, url, ns, key, path = sys.argv[1:6]
if mode == "die":
    post = tn.NixlSender._post
    def post_then_die(self, *args):
        handle = post(self, *args)
        os.kill(os.getpid(), signal.SIGKILL)
        return handle
    tn.NixlSender._post = post_then_die
tn.send_chunks_nixl(url, [(ns, key, hv.load(path))], timeout=30)
print("sent")
"""


def multilayer_snapshot(layers: int = 6, tokens: int = 128, page_size: int = 16, seed: int = 0) -> KVSnapshot:
    """Two sequences sharing their first pages, bf16, every layer and role with its own values."""
    gen = torch.Generator().manual_seed(seed)
    heads, dim = 4, 64
    pages = tokens // page_size
    table = torch.tensor([*range(pages), *range(pages // 2), *range(pages, pages + pages // 2)])
    seq_ptr = torch.tensor([0, pages, 2 * pages])
    seq_lens = torch.tensor([tokens, tokens])
    ids = tuple(range(1000, 1000 + tokens))
    other = ids[: tokens // 2] + tuple(range(5000, 5000 + tokens // 2))

    def pool() -> torch.Tensor:
        return torch.randn(pages + pages // 2, page_size, heads, dim, generator=gen).to(torch.bfloat16)

    keys = tuple(BlockPagedTensor(pool(), table, seq_ptr, seq_lens, "key", i) for i in range(layers))
    values = tuple(BlockPagedTensor(pool(), table, seq_ptr, seq_lens, "value", i) for i in range(layers))
    return KVSnapshot(
        keys,
        values,
        token_ids=(ids, other),
        fingerprint=ModelFingerprint("TestLlama", layers, heads, dim, "bfloat16"),
        source=SnapshotSource("test", "nhd", page_size),
    )


def pool_bytes(snap: KVSnapshot) -> list[bytes]:
    return [bytes(t.page_pool.contiguous().view(torch.uint8).reshape(-1).numpy()) for t in (*snap.keys, *snap.values)]


@pytest.fixture(scope="module")
def chunks() -> list[tuple[str, str, KVSnapshot]]:
    snap = multilayer_snapshot()
    assert snap.fingerprint is not None
    ns = namespace_of(snap.fingerprint)
    return [(ns, key, chunk) for key, chunk in chunks_of(snap, 64)]


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tn.NixlReceiver]:
    require("nixl_cu12")
    r = tn.NixlReceiver("127.0.0.1", 0, DirectoryStore(tmp_path / "store"), timeout=15).start()
    try:
        yield r
    finally:
        r.stop()


def url_of(r: tn.NixlReceiver) -> str:
    return f"nixl://127.0.0.1:{r.address[1]}"


def run_sender(mode: str, r: tn.NixlReceiver, ns: str, key: str, chunk: KVSnapshot, tmp: Path) -> subprocess.Popen[str]:
    path = tmp / f"{key}.hrry"
    hv.save(chunk, path)
    return subprocess.Popen(
        [sys.executable, "-c", SENDER, mode, url_of(r), ns, key, str(path)],
        env={**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 90) -> tuple[str, str]:
    """``proc``'s output once it ended; killed (and the test failed with its stderr) if it runs past ``timeout``."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the sender did not finish within {timeout:.0f} s: {err[-3000:]}") from None


def test_two_processes_move_a_multilayer_chunk_byte_for_byte(
    receiver: tn.NixlReceiver, chunks: list[tuple[str, str, KVSnapshot]], tmp_path: Path
) -> None:
    ns, key, chunk = chunks[1]  # the chunk behind a shared prefix: pages renumbered by compaction
    assert chunk.num_layers == 6 and chunk.keys[0].num_pages > 1
    proc = run_sender("send", receiver, ns, key, chunk, tmp_path)
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "sent" in out
    got = receiver.store.get(ns, key)  # type: ignore[attr-defined]
    assert pool_bytes(got) == pool_bytes(chunk)
    assert got.token_ids == chunk.token_ids and got.fingerprint == chunk.fingerprint
    assert got.extra[DIGEST_KEY] == chunk_digest(got) == chunk.extra[DIGEST_KEY]
    for a, b in zip((*got.keys, *got.values), (*chunk.keys, *chunk.values)):
        assert torch.equal(a.block_table, b.block_table) and torch.equal(a.seq_lens, b.seq_lens)  # type: ignore[arg-type]
    assert receiver.received == 1 and receiver.refused == 0


def test_corrupt_chunks_are_refused_and_not_stored(
    receiver: tn.NixlReceiver, chunks: list[tuple[str, str, KVSnapshot]]
) -> None:
    ns, key, chunk = chunks[0]
    store = receiver.store
    assert isinstance(store, DirectoryStore)
    wrong_digest = replace(chunk, extra={**chunk.extra, DIGEST_KEY: "00" * 16})
    with pytest.raises(hv.HurrayFormatError, match=r"refused.*digest"):
        tn.send_chunks_nixl(url_of(receiver), [(ns, "ab" * 8, wrong_digest)], timeout=20)
    # The descriptor's digest is right, but the bytes that travel are not the ones it describes.
    flipped = chunk.values[3].page_pool.clone()
    flipped.view(torch.uint8).reshape(-1)[12345] ^= 0x40
    tampered = replace(
        chunk, values=tuple(replace(v, page_pool=flipped) if v.layer_index == 3 else v for v in chunk.values)
    )
    with pytest.raises(hv.HurrayFormatError, match=r"refused.*digest"):
        tn.send_chunks_nixl(url_of(receiver), [(ns, "cd" * 8, tampered)], timeout=20)
    with pytest.raises(hv.HurrayFormatError, match=r"refused.*lowercase hex"):
        tn.send_chunks_nixl(url_of(receiver), [("../../etc", key, chunk)], timeout=20)
    assert not store.has(ns, "ab" * 8) and not store.has(ns, "cd" * 8)
    assert receiver.refused == 3 and receiver.received == 0
    # The same connection and the same receive buffers go on serving valid chunks.
    tn.send_chunks_nixl(url_of(receiver), [(ns, key, chunk), (ns, "ef" * 8, chunk)], timeout=20)
    assert store.has(ns, key) and store.has(ns, "ef" * 8)
    assert pool_bytes(store.get(ns, key)) == pool_bytes(chunk)
    assert receiver.arena.registrations == 1  # registered once, reused by every chunk


def test_sender_killed_mid_transfer_leaves_nothing_and_the_receiver_keeps_serving(
    receiver: tn.NixlReceiver, chunks: list[tuple[str, str, KVSnapshot]], tmp_path: Path
) -> None:
    ns, key, chunk = chunks[0]
    store = receiver.store
    assert isinstance(store, DirectoryStore)
    proc = run_sender("die", receiver, ns, key, chunk, tmp_path)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    assert wait_for(lambda: receiver.refused == 1), "the receiver did not notice the dead sender"
    assert "disconnected mid-transfer" in (receiver.last_error or "")
    assert not store.has(ns, key) and not (store.root / ns).exists()
    # The receiver still serves, and a later transfer of the same chunk succeeds.
    tn.send_chunks_nixl(url_of(receiver), [(ns, key, chunk)], timeout=20)
    assert pool_bytes(store.get(ns, key)) == pool_bytes(chunk)
    assert receiver.received == 1


def test_concurrent_senders_and_pinned_page_pools(
    receiver: tn.NixlReceiver, chunks: list[tuple[str, str, KVSnapshot]]
) -> None:
    (ns, key0, chunk0), (_, key1, chunk1) = chunks[:2]
    pinned = tn.NixlSender()
    try:
        pinned.register([t.page_pool for t in (*chunk1.keys, *chunk1.values)])  # an engine's KV cache, say
        errors: list[BaseException] = []

        def push(sender: tn.NixlSender, key: str, chunk: KVSnapshot) -> None:
            try:
                for i in range(3):
                    sender.send(url_of(receiver), [(ns, f"{key[:-1]}{i}", chunk)], timeout=30)
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=push, args=(tn.default_sender(), key0, chunk0)),
            threading.Thread(target=push, args=(pinned, key1, chunk1)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        store = receiver.store
        assert isinstance(store, DirectoryStore)
        for key, chunk in ((key0, chunk0), (key1, chunk1)):
            for i in range(3):
                assert pool_bytes(store.get(ns, f"{key[:-1]}{i}")) == pool_bytes(chunk)
        assert receiver.received == 6 and receiver.refused == 0
    finally:
        pinned.close()


def test_absurd_sizes_and_stalled_senders_are_bounded(
    tmp_path: Path, chunks: list[tuple[str, str, KVSnapshot]]
) -> None:
    require("nixl_cu12")
    ns, key, chunk = chunks[0]
    store = DirectoryStore(tmp_path / "store")
    with tn.NixlReceiver("127.0.0.1", 0, store, timeout=1.0) as r:
        addr = ("127.0.0.1", r.address[1])
        # A descriptor that announces a 16 TiB page pool is refused before anything is allocated.
        records = list(snapshot_records(chunk))
        i = next(n for n, rec in enumerate(records) if rec.descriptor.block_paged is not None)
        d = records[i].descriptor
        assert d.block_paged is not None
        pages = 1 << 31
        size = pages * chunk.keys[0].page_bytes
        huge = replace(
            d,
            layout=replace(d.block_paged, num_pages=pages),
            buffers=(replace(d.buffers[0], byte_size=size), *d.buffers[1:]),
        )
        records[i] = replace(records[i], descriptor=huge)
        with socket.create_connection(addr, timeout=10) as s:
            send_offer(s, ns, key, records)
            assert s.recv(2) == b"ER"
            assert b"exceeds the limit" in read_message(s)
        assert r.arena.total == 0
        # A sender that takes the buffers and never writes: the receiver gives up after its timeout.
        with socket.create_connection(addr, timeout=10) as s:
            send_offer(s, ns, key, list(snapshot_records(chunk)))
            assert s.recv(2) == b"RD"
            assert wait_for(lambda: r.refused == 2, 10)
            assert "timed out" in (r.last_error or "")
        assert not store.has(ns, key)
        # Still serving.
        tn.send_chunks_nixl(f"nixl://127.0.0.1:{r.address[1]}", [(ns, key, chunk)], timeout=20)
        assert store.has(ns, key) and r.received == 1


def test_an_offer_of_many_empty_buffers_is_refused_before_they_become_tensors() -> None:
    """255 zero-byte buffers per record would cost ~25x the offer's bytes in tensors before any admission."""
    from hurray_vllm.containers.schema import Record
    from hurray_vllm.wire import dtypes
    from hurray_vllm.wire.descriptor import LAYOUT_ROW_MAJOR, BufferHandle, TensorDescriptor

    d = TensorDescriptor(
        type_tag=dtypes.from_torch(torch.uint8).tag,
        shape=(0,),
        layout_tag=LAYOUT_ROW_MAJOR,
        buffers=tuple(BufferHandle(0, 1, 0) for _ in range(255)),
    )
    parts, _, _ = tn_offer.encode_offer("ab" * 8, "cd" * 8, [Record("", d, [torch.empty(0, dtype=torch.uint8)] * 255)])
    with pytest.raises(hv.HurrayFormatError, match="buffers") as err:
        tn_offer.parse_offer(bytearray(b"".join(bytes(p) for p in parts)), 1 << 30)
    assert err.value.field == "buffer_count"


def test_abort_cuts_a_send_to_a_receiver_that_never_answers(chunks: list[tuple[str, str, KVSnapshot]]) -> None:
    """The worker aborts the push in flight when its save queue is full: a NIXL send must give up too."""
    require("nixl_cu12")
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(4)  # accepted by the kernel; nobody reads or answers
        sender = tn.NixlSender()
        failed: list[BaseException] = []

        def send() -> None:
            try:
                sender.send(f"nixl://127.0.0.1:{hole.getsockname()[1]}", chunks[:1], timeout=600)
            except (OSError, hv.HurrayFormatError) as exc:
                failed.append(exc)

        t = threading.Thread(target=send)
        t.start()
        assert wait_for(lambda: bool(sender._live_sockets()), 60)
        sender.abort()
        t.join(60)  # a hang guard: the send's own timeout is 600 s, so only the abort ends it by then
        assert not t.is_alive() and failed
        assert not sender._live_sockets()


def test_a_receiver_that_lies_about_its_agent_is_refused_and_leaves_nothing_loaded(
    chunks: list[tuple[str, str, KVSnapshot]],
) -> None:
    """A name that is not UTF-8, or another agent's metadata under a made-up name: refused, nothing left loaded."""
    require("nixl_cu12")
    from hurray_vllm.transport.base import U16, U32, U64, recv_exact

    other = tn_agent.make_agent("other", None)
    md = other.get_agent_metadata()
    pools = len(chunks[0][2].tensors())  # a remote buffer each
    replies = [
        b"RD" + U64.pack(1) + U16.pack(2) + b"\xff\xfe",
        b"RD"
        + U64.pack(1)
        + U16.pack(5)
        + b"bogus"
        + U32.pack(len(md))
        + md
        + U32.pack(pools)
        + U64.pack(4096) * pools,
    ]
    sender = tn.NixlSender(lanes=1)
    for reply, says in zip(replies, ("not UTF-8", "calls its agent"), strict=True):
        with socket.create_server(("127.0.0.1", 0)) as srv:

            def serve(reply: bytes = reply) -> None:
                conn, _ = srv.accept()
                with conn:
                    recv_exact(conn, 4)
                    recv_exact(conn, int.from_bytes(recv_exact(conn, 8), "little"))
                    conn.sendall(reply)
                    conn.recv(1)  # until the sender hangs up

            t = threading.Thread(target=serve, daemon=True)
            t.start()
            with pytest.raises(hv.HurrayFormatError, match=says):
                sender.send(f"nixl://127.0.0.1:{srv.getsockname()[1]}", chunks[:1], timeout=10)
            t.join(10)
    assert not sender._peers and not sender._agent.check_remote_metadata(other.name)


def send_offer(s: socket.socket, ns: str, key: str, records: list) -> None:  # type: ignore[type-arg]
    parts, _, _ = tn_offer.encode_offer(ns, key, records)
    body = b"".join(bytes(p) for p in parts)
    s.sendall(tn.MAGIC + len(body).to_bytes(8, "little") + body)


def read_message(s: socket.socket) -> bytes:
    n = int.from_bytes(s.recv(2), "little")
    out = b""
    while len(out) < n:
        out += s.recv(n - len(out))
    return out


def test_without_nixl_the_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tn_agent, "_nixl", None)
    monkeypatch.setattr(tn_sender, "_default", None)
    for name in tn_agent._MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules makes the import fail
    with pytest.raises(ImportError, match=r"pip install 'hurray-vllm\[nixl\]'"):
        tn.send_chunks_nixl("nixl://127.0.0.1:9", [])
    with pytest.raises(tn.NixlUnavailableError):
        tn.NixlReceiver("127.0.0.1", 0, DirectoryStore("unused"))
    with pytest.raises(hv.HurrayFormatError, match="nixl://HOST:PORT"):
        tn.send_chunks_nixl("tcp://127.0.0.1:9", [])


def test_the_receive_command_accepts_nixl(chunks: list[tuple[str, str, KVSnapshot]], tmp_path: Path) -> None:
    require("nixl_cu12")
    store = tmp_path / "store"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hurray_vllm.app.cli",
            "receive",
            "--listen",
            "127.0.0.1:0",  # the receiver binds a free port and prints it: no race for one
            "--dir",
            str(store),
            "--transport",
            "nixl",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "receiving KV chunks (nixl)" in line, line
        port = int(line.split(" on ")[1].split()[0].rsplit(":", 1)[1])
        ns, key, chunk = chunks[0]
        tn.send_chunks_nixl(f"nixl://127.0.0.1:{port}", [(ns, key, chunk)], timeout=30)
        got = DirectoryStore(store).get(ns, key)
        assert torch.equal(got[0, "key"].page_pool, chunk[0, "key"].page_pool)
    finally:
        # SIGTERM, not SIGINT: a test run started in the background by a shell inherits an
        # ignored SIGINT, and so does this receiver. communicate, not wait: the pipe must be
        # drained, or a receiver with more to log than it holds blocks in write.
        proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # the receive command dumps its threads' stacks
            time.sleep(2)
            proc.kill()
            rest, _ = proc.communicate()
            pytest.fail(f"the receiver did not stop on SIGTERM; its output:\n{rest[-8000:]}")


@given(snapshots())
def test_a_snapshot_offer_encodes_shared_layers_once_to_the_same_bytes(snap: KVSnapshot) -> None:
    """The sender's offer (layer structure encoded once, layer index patched) equals the generic record encoding."""
    ns, key = "ab" * 8, "cd" * 16
    want_parts, want_pools, want_order = tn_offer.encode_offer(ns, key, snapshot_records(snap))
    got_parts, got_pools, got_order = tn_offer.encode_snapshot_offer(ns, key, snap)
    assert b"".join(bytes(p) for p in got_parts) == b"".join(bytes(p) for p in want_parts)
    assert [p.data_ptr() for p in got_pools] == [p.data_ptr() for p in want_pools]
    assert got_order == want_order


def test_lanes_share_pools_by_bytes_in_posting_order() -> None:
    mib = 1 << 20
    assert tn_sender._lane_shares([0, 2, 1, 3], [4 * mib] * 4, 2) == [[0, 1], [2, 3]]
    # Unequal pools: each goes to the lane with the fewest bytes so far.
    assert tn_sender._lane_shares([0, 1, 2, 3], [8 * mib, 2 * mib, 2 * mib, 2 * mib], 2) == [[0], [1, 2, 3]]
    # Small chunks use fewer lanes (at least 1 MiB each), never more lanes than pools.
    assert tn_sender._lane_shares([0, 1, 2], [1000, 1000, 1000], 4) == [[0, 1, 2]]
    assert tn_sender._lane_shares([0], [64 * mib], 4) == [[0]]
    assert tn_sender._lane_shares([], [], 2) == [[]]


def test_a_chunk_split_across_lanes_arrives_whole_and_a_failing_lane_aborts_it(
    receiver: tn.NixlReceiver, chunks: list[tuple[str, str, KVSnapshot]], monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, key, chunk = chunks[1]
    monkeypatch.setattr(tn_sender, "_MIN_LANE_BYTES", 1)  # this chunk is small: use every lane anyway
    posted: dict[int, int] = {}
    post = tn.NixlSender._post
    fail: set[int] = set()

    def counting_post(self: tn.NixlSender, agent: object, local: object, remote: object, i: int, notif: bytes) -> Any:
        if i in fail:
            raise tn.NixlError(f"injected failure of page pool {i}")
        posted[i] = id(agent)
        return post(self, agent, local, remote, i, notif)

    monkeypatch.setattr(tn.NixlSender, "_post", counting_post)
    sender = tn.NixlSender(lanes=3)
    try:
        (stats,) = sender.send(url_of(receiver), [(ns, key, chunk)], timeout=20)
        assert stats.transfers == 2 * chunk.num_layers == len(posted)
        assert len(set(posted.values())) == 3  # every lane's agent wrote its share
        store = receiver.store
        assert isinstance(store, DirectoryStore)
        assert pool_bytes(store.get(ns, key)) == pool_bytes(chunk)
        # One lane fails mid-chunk: the sender reports it, the others stop, nothing is stored.
        fail.add(max(posted))
        with pytest.raises(tn.NixlError, match="injected"):
            sender.send(url_of(receiver), [(ns, "ab" * 8, chunk)], timeout=20)
        assert wait_for(lambda: receiver.refused == 1)
        assert not store.has(ns, "ab" * 8)
        fail.clear()
        sender.send(url_of(receiver), [(ns, "ab" * 8, chunk)], timeout=20)
        assert pool_bytes(store.get(ns, "ab" * 8)) == pool_bytes(chunk)
    finally:
        sender.close()


def test_registered_pools_can_be_unregistered_for_replacement() -> None:
    require("nixl_cu12")
    sender = tn.NixlSender(lanes=2)
    try:
        a, b = torch.zeros(1 << 16, dtype=torch.uint8), torch.zeros(1 << 16, dtype=torch.uint8)
        sender.register([a, b])
        assert sender._covered(a.data_ptr(), a.numel()) and sender._covered(b.data_ptr(), b.numel())
        sender.unregister([a, torch.zeros(8)])  # one registered, one never was
        assert not sender._covered(a.data_ptr(), a.numel()) and sender._covered(b.data_ptr(), b.numel())
        with pytest.raises(hv.HurrayArgumentError, match="contiguous"):
            sender.register([a[::2]])
    finally:
        sender.close()
    assert not sender._pinned


@contextlib.contextmanager
def side_channel_past_1024() -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two connected sockets, the first on a descriptor >= 1024 (past select's limit); skipped where none may be."""
    import fcntl
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1100:
        pytest.skip(f"this process may open {hard} files at most")
    if soft != resource.RLIM_INFINITY and soft <= 1100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096 if hard == resource.RLIM_INFINITY else min(4096, hard), hard))
    try:
        a, b = socket.socketpair()
        with a, b, socket.socket(fileno=fcntl.fcntl(a.fileno(), fcntl.F_DUPFD_CLOEXEC, 1024)) as side:
            assert side.fileno() >= 1024
            yield side, b
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_side_channel_past_descriptor_1024_is_watched_as_any_other() -> None:
    """An engine holds many files: its side channel's descriptor may pass select's limit (poll has none)."""
    with side_channel_past_1024() as (side, b):
        tn_sender._watch_receiver(side, 0.0002)  # the receiver said nothing: the transfer goes on
        b.sendall(b"ER" + (9).to_bytes(2, "little") + b"disk full")
        with pytest.raises(hv.HurrayFormatError, match="disk full"):
            tn_sender._watch_receiver(side, 0.0002)
        b.close()
        with pytest.raises(ConnectionError):
            tn_sender._watch_receiver(side, 0.0002)


def test_a_receiver_waits_on_a_side_channel_past_descriptor_1024() -> None:
    """The receiver's wait for GO, on a busy process's side channel: select would refuse it (ValueError)."""
    import queue

    from hurray_vllm.chunks.digest import ChunkDigest

    r = object.__new__(tn.NixlReceiver)  # no agent: a chunk without page pools waits only for GO
    r._stop, r.timeout = threading.Event(), 5.0
    want = ChunkDigest("crc32")
    want.update(memoryview(b"header"))
    with side_channel_past_1024() as (side, b):
        b.sendall(b"GO")
        assert r._await(side, queue.SimpleQueue(), [], 0, "crc32", b"header") == want.hexdigest()
        b.sendall(b"AB")
        with pytest.raises(tn_receiver._Aborted, match="aborted"):
            r._await(side, queue.SimpleQueue(), [], 0, "crc32", b"header")


def test_offers_held_at_once_are_bounded_in_memory(chunks: list[tuple[str, str, KVSnapshot]], tmp_path: Path) -> None:
    """64 connections each announcing a 64 MiB offer must not take 4 GiB: one beyond the bound is refused unread."""
    require("nixl_cu12")
    ns, key, chunk = chunks[0]
    size = 600_000
    store = DirectoryStore(tmp_path / "store")
    with tn.NixlReceiver("127.0.0.1", 0, store, timeout=15, max_offer_memory_bytes=size + 100).start() as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as first:
            first.sendall(tn.MAGIC + size.to_bytes(8, "little") + bytes(10))  # being read: holds its bytes
            assert wait_for(lambda: r._offer_bytes == size)
            with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as second:
                second.sendall(tn.MAGIC + size.to_bytes(8, "little"))
                assert second.recv(2) == b"ER" and read_message(second).startswith(b"receiver.memory:")
            first.sendall(bytes(size - 10))  # not an offer: refused, but it was read whole
            assert first.recv(2) == b"ER"
            assert wait_for(lambda: r._offer_bytes == 0)
        tn.send_chunks_nixl(url_of(r), [(ns, key, chunk)], timeout=15)  # alone again: taken
        assert store.has(ns, key) and wait_for(lambda: r._offer_bytes == 0)  # given back after the answer
    with pytest.raises(hv.HurrayArgumentError, match="max_offer_memory_bytes"):
        tn.NixlReceiver("127.0.0.1", 0, store, max_offer_memory_bytes=0)


@pytest.mark.parametrize("where", ["strided", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pools_outside_registered_host_memory_are_sent_from_host_copies(
    where: str, receiver: tn.NixlReceiver, chunks: list[tuple[str, str, KVSnapshot]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU engine's pools (which register refuses) go out through host copies registered for their chunk only."""
    if where == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ns, key, chunk = chunks[0]

    def away(t: torch.Tensor) -> torch.Tensor:
        if where == "cuda":
            return t.cuda()
        wide = torch.empty((*t.shape, 2), dtype=t.dtype)[..., 0]  # the same values, not contiguous
        wide.copy_(t)
        return wide

    moved = replace(
        chunk,
        keys=tuple(replace(t, page_pool=away(t.page_pool)) for t in chunk.keys),
        values=tuple(replace(t, page_pool=away(t.page_pool)) for t in chunk.values),
    )
    sender = tn.NixlSender(lanes=1)
    registered: list[list[tuple[int, int]]] = []
    deregistered: list[object] = []
    register, deregister = sender._register, sender._deregister
    monkeypatch.setattr(sender, "_register", lambda ranges: registered.append(ranges) or register(ranges))
    monkeypatch.setattr(sender, "_deregister", lambda regs: deregistered.append(regs) or deregister(regs))
    try:
        with pytest.raises(hv.HurrayArgumentError, match="host tensors"):
            sender.register([moved.keys[0].page_pool])
        (stats,) = sender.send(url_of(receiver), [(ns, key, moved)], timeout=20)
        assert stats.transfers == 2 * chunk.num_layers
        pools = {t.page_pool.data_ptr() for t in (*moved.keys, *moved.values)}
        (ranges,) = registered  # once, for this chunk: the host copies, not the pools
        assert len(ranges) == 2 * chunk.num_layers and not pools & {p for p, _ in ranges}
        assert len(deregistered) == 1 and not sender._pinned  # and released with it
        store = receiver.store
        assert isinstance(store, DirectoryStore)
        assert pool_bytes(store.get(ns, key)) == pool_bytes(chunk)
    finally:
        sender.close()
