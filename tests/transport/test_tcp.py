"""The TCP channel and what every receiver shares (:mod:`hurray_vllm.transport.base`), on 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from blocking import wait_for
from synthetic import example_chunk

import hurray_vllm as hv
from hurray_vllm import KVSnapshot, transport
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.chunks.store import DirectoryStore, chunks_of, namespace_of
from hurray_vllm.transport import base
from hurray_vllm.transport.base import ReceiverBase, recv_exact
from hurray_vllm.transport.tcp import Receiver, TcpSender, parse_url, send_chunks


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path), timeout=5, idle_timeout=0.5) as r:
        yield r


def _url(r: ReceiverBase) -> str:
    return f"tcp://127.0.0.1:{r.address[1]}"


def test_tcp_transport_stores_valid_chunks_only(tmp_path: Path) -> None:
    snap = spec_example_snapshot()
    ((key, chunk),) = chunks_of(snap, 4)
    assert chunk.fingerprint is not None
    ns = namespace_of(chunk.fingerprint)
    receiver = Receiver("127.0.0.1", 0, DirectoryStore(tmp_path)).start()
    url = f"tcp://127.0.0.1:{receiver.address[1]}"
    try:
        send_chunks(url, [(ns, key, chunk)])
        assert DirectoryStore(tmp_path).has(ns, key)
        # Several chunks on one connection, each framed by its counted length.
        send_chunks(url, ((ns, f"{i:02x}" * 4, chunk) for i in range(3)))
        for i in range(3):
            got = DirectoryStore(tmp_path).get(ns, f"{i:02x}" * 4)
            assert torch.equal(got.keys[0].page_pool, chunk.keys[0].page_pool) and got.token_ids == chunk.token_ids
        with pytest.raises(hv.HurrayFormatError, match="refused"):
            send_chunks(url, [(ns, "ab" * 8, replace(chunk, extra={"hurray_vllm.chunk_digest": "00"}))])
        assert not DirectoryStore(tmp_path).has(ns, "ab" * 8)
        with pytest.raises(hv.HurrayFormatError, match="refused"):
            send_chunks(url, [("../../etc", key, chunk)])
        # A sender that dies mid-chunk leaves nothing behind.
        with socket.create_connection(("127.0.0.1", receiver.address[1])) as s:
            s.sendall(b"HVC1" + (2).to_bytes(2, "little") + b"ab" + (2).to_bytes(2, "little") + b"cd")
            s.sendall((10_000).to_bytes(8, "little") + b"HRRY" + bytes(100))
        assert not DirectoryStore(tmp_path).has("ab", "cd")
        assert receiver.received == 4 and receiver.refused >= 2
    finally:
        receiver.stop()


def test_a_store_that_fails_unexpectedly_still_gets_an_answer(tmp_path: Path) -> None:
    """A bug behind the receiver (here: the store raises) refuses the chunk with ER; the sender never hangs."""

    class Broken(DirectoryStore):
        def put(self, ns: str, key: str, snap: KVSnapshot) -> None:
            raise RuntimeError("disk on fire")

    ns, key, chunk = example_chunk()
    with Receiver("127.0.0.1", 0, Broken(tmp_path), timeout=5) as r:
        with pytest.raises(hv.HurrayFormatError, match="disk on fire"):
            send_chunks(_url(r), [(ns, key, chunk)], timeout=10)
        assert (r.received, r.refused) == (0, 1) and r.last_error is not None and "RuntimeError" in r.last_error
        send_chunks(_url(r), [], timeout=10)  # and it still accepts connections


def test_an_ipv6_listen_address_goes_in_brackets_as_in_a_url(tmp_path: Path) -> None:
    from hurray_vllm.transport.base import host_port, parse_listen

    assert parse_listen("[::1]:0") == ("::1", 0) and parse_listen(":7") == ("127.0.0.1", 7)
    assert host_port("::1", 9) == "[::1]:9" and host_port("10.0.0.5", 9) == "10.0.0.5:9"
    for bad in ("::1:0", "[10.0.0.5]:1", "1.2.3.4:\u00b2", "1.2.3.4:\u0663"):  # superscript 2, Arabic-Indic 3
        with pytest.raises(hv.HurrayFormatError) as err:
            parse_listen(bad)
        assert err.value.field == "hurray_listen"
    try:  # a host without IPv6 loopback cannot take the rest
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return
    snap = spec_example_snapshot()
    ((key, chunk),) = chunks_of(snap, 4)
    assert chunk.fingerprint is not None
    receiver = Receiver(*parse_listen("[::1]:0"), DirectoryStore(tmp_path)).start()
    try:
        send_chunks(f"tcp://{host_port(*receiver.address)}", [(namespace_of(chunk.fingerprint), key, chunk)])
        assert DirectoryStore(tmp_path).has(namespace_of(chunk.fingerprint), key)
    finally:
        receiver.stop()


def test_an_idle_connection_is_closed_after_idle_timeout(receiver: Receiver) -> None:
    with socket.create_connection(("127.0.0.1", receiver.address[1]), timeout=60) as s:
        assert s.recv(1) == b""  # closed by the receiver: this test's timeout would raise TimeoutError


def test_bad_timeouts_are_refused(tmp_path: Path) -> None:
    with pytest.raises(hv.HurrayArgumentError, match="must be positive") as err:
        Receiver("127.0.0.1", 0, DirectoryStore(tmp_path), idle_timeout=0)
    assert err.value.field == "idle_timeout"  # was "timeout", which the receiver also takes


def test_an_oversized_frame_is_refused_without_reading_it(tmp_path: Path) -> None:
    """A frame announcing more than max_chunk_bytes is answered ER at once and the connection closed."""
    with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path), max_chunk_bytes=1 << 10) as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as s:
            s.sendall(b"HVC1" + (2).to_bytes(2, "little") + b"ab" + (2).to_bytes(2, "little") + b"cd")
            s.sendall((1 << 62).to_bytes(8, "little"))
            assert recv_exact(s, 2) == b"ER"
            n = int.from_bytes(recv_exact(s, 2), "little")
            message = recv_exact(s, n)
            # The limit's value and the setting that raises it (found by a review: neither was said).
            assert b"exceeds the limit of 1024 bytes" in message and b"--max-chunk" in message, message
            assert s.recv(1) == b""
        assert r.refused == 1


def test_counters_are_exact_under_concurrent_senders(receiver: Receiver) -> None:
    ns, _, chunk = example_chunk()
    errors: list[BaseException] = []

    def push(i: int) -> None:
        try:
            send_chunks(_url(receiver), ((ns, f"{i:02x}{j:02x}" * 4, chunk) for j in range(5)), timeout=30)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and receiver.received == 30 and receiver.refused == 0


def test_malformed_urls_name_the_field() -> None:
    for url in ("tcp://h", "tcp://h:port", "tcp://h:99999", "http://h:1", "h:1"):
        with pytest.raises(hv.HurrayFormatError, match="tcp://HOST:PORT") as info:
            parse_url(url)
        assert info.value.field == "hurray_url"


@pytest.mark.parametrize(
    "url",
    ["tcp://[::1", "nixl://[::1", "tcp://u:pw@h:1", "tcp://h:1?q=1", "tcp://h:1#f", "tcp://h\n:1", "tcp://h:1/x"],
)
def test_urls_urlsplit_lets_through_or_chokes_on_are_refused_naming_hurray_url(url: str) -> None:
    """An unclosed bracket raised a bare ValueError (an engine crash); user info, a query or a newline passed."""
    with pytest.raises(hv.HurrayFormatError) as info:
        transport.channel_of(url)
    assert info.value.field == "hurray_url"


def test_channels_are_chosen_by_url_scheme(tmp_path: Path) -> None:
    assert transport.channel_of("tcp://127.0.0.1:1") == "tcp"
    assert transport.channel_of("nixl://127.0.0.1:1") == "nixl"  # checked without loading NIXL
    for url in ("udp://h:1", "nixl://h", "", "127.0.0.1:9000"):
        with pytest.raises(hv.HurrayFormatError) as info:
            transport.channel_of(url)
        assert info.value.field == "hurray_url"
    assert isinstance(transport.sender_for("tcp://127.0.0.1:1"), TcpSender)
    with pytest.raises(hv.HurrayArgumentError, match="unknown transport 'udp'"):
        transport.receiver_for("udp", "127.0.0.1", 0, DirectoryStore(tmp_path))
    with pytest.raises(hv.HurrayArgumentError):
        transport.require_channel("udp")
    transport.require_channel("tcp")
    r = transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), idle_timeout=3).start()
    try:
        assert isinstance(r, Receiver) and r.idle_timeout == 3
        ns, key, chunk = example_chunk()
        transport.send_chunks(_url(r), [(ns, key, chunk)])
        got = DirectoryStore(tmp_path).get(ns, key)
        assert torch.equal(got.keys[0].page_pool, chunk.keys[0].page_pool)
    finally:
        r.stop()


def test_frame_fields_split_across_segments_are_read_whole(receiver: Receiver) -> None:
    """The magic and every length may arrive a byte at a time; names ending in a newline are refused."""
    ns, key, chunk = example_chunk()
    import io

    from hurray_vllm.containers.io import write_stream

    buf = io.BytesIO()
    write_stream(chunk, buf)
    body = buf.getvalue()
    frame = b"HVC1" + len(ns).to_bytes(2, "little") + ns.encode() + len(key).to_bytes(2, "little") + key.encode()
    frame += len(body).to_bytes(8, "little")
    with socket.create_connection(("127.0.0.1", receiver.address[1]), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(frame)):
            s.sendall(frame[i : i + 1])
            time.sleep(0.001)
        s.sendall(body)
        assert recv_exact(s, 2) == b"OK"
        bad = "ab\n"
        s.sendall(b"HVC1" + (3).to_bytes(2, "little") + bad.encode() + len(key).to_bytes(2, "little") + key.encode())
        s.sendall(len(body).to_bytes(8, "little") + body)
        assert recv_exact(s, 2) == b"ER"
    assert DirectoryStore(receiver.store.root).has(ns, key)  # type: ignore[attr-defined]


def test_a_2_to_the_60_announcement_is_refused_at_the_default_limit(receiver: Receiver) -> None:
    with socket.create_connection(("127.0.0.1", receiver.address[1]), timeout=10) as s:
        s.sendall(b"HVC1" + (2).to_bytes(2, "little") + b"ab" + (2).to_bytes(2, "little") + b"cd")
        s.sendall((1 << 60).to_bytes(8, "little") + b"HRRS")
        assert recv_exact(s, 2) == b"ER"
        assert s.recv(int.from_bytes(recv_exact(s, 2), "little")).startswith(b"transport: chunk of")
        assert s.recv(1) == b""  # closed: not drained


@pytest.mark.parametrize("channel", transport.CHANNELS)
def test_tensor_parallel_slices_travel_under_their_names_and_must_hold_those_heads(
    channel: str, tmp_path: Path
) -> None:
    """Each TP rank pushes ``<key>.h<a>-<b>``; every channel's receiver stores it only if the slice holds heads a..b."""
    from conftest import require
    from synthetic import make_snapshot

    if channel == "nixl":
        require("nixl_cu12")
    receiver = transport.receiver_for(channel, "127.0.0.1", 0, DirectoryStore(tmp_path)).start()
    url = f"{channel}://127.0.0.1:{receiver.address[1]}"

    from hurray_vllm.chunks.digest import DIGEST_KEY, chunk_digest
    from hurray_vllm.chunks.store import slice_key
    from hurray_vllm.kv.heads import select_heads

    whole = make_snapshot([8], [0], 4, heads=4, dim=8)
    whole = replace(whole, fingerprint=hv.ModelFingerprint("Llama", 2, 4, 8, "bfloat16"), token_ids=(tuple(range(8)),))

    def signed(s: KVSnapshot) -> KVSnapshot:
        return replace(s, extra={**s.extra, DIGEST_KEY: chunk_digest(s)})

    low, high = (signed(select_heads(whole, range(a, b))) for a, b in ((0, 2), (2, 4)))
    ns, key, store = namespace_of(whole.fingerprint), "cd" * 8, receiver.store
    assert isinstance(store, DirectoryStore)
    transport.send_chunks(url, [(ns, slice_key(key, range(0, 2)), low), (ns, slice_key(key, range(2, 4)), high)])
    parts = store.parts(ns, key, 4)
    assert parts is not None and [p.name for p in parts] == [f"{key}.h0-2", f"{key}.h2-4"]
    got = store.get(ns, f"{key}.h2-4")
    assert got.heads == hv.HeadRange(2, 4, 4) and torch.equal(got[0, "key"].page_pool, high[0, "key"].page_pool)
    # A slice under another slice's name, or under the whole chunk's, would be loaded for heads it lacks.
    for name in (slice_key("ef" * 8, range(2, 4)), "ef" * 8):
        with pytest.raises(hv.HurrayFormatError, match=r"refused.*heads 0\.\.2"):
            transport.send_chunks(url, [(ns, name, low)])
    # A whole chunk under a "slice" name of every head: stored, no lookup would ever read it.
    with pytest.raises(hv.HurrayFormatError, match=r"refused.*slice of every head"):
        transport.send_chunks(url, [(ns, slice_key("ef" * 8, range(0, 4)), signed(whole))])
    # Names that are not canonical slices are refused before anything is read.
    for name in (f"{key}.h02-4", f"{key}.h4-2", f"{key}.h2-4.h0-1", f"{key}.x"):
        with pytest.raises(hv.HurrayFormatError, match=r"refused.*hex digits"):
            transport.send_chunks(url, [(ns, name, high)])
    assert not list(store.root.rglob("ef*"))
    assert receiver.received == 2
    receiver.stop()


@pytest.mark.parametrize("channel", transport.CHANNELS)
def test_a_store_quota_or_free_disk_floor_refuses_a_chunk_before_it_is_read(
    channel: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing of a refused chunk reaches the disk; the store takes chunks again once there is room."""
    from conftest import require

    if channel == "nixl":
        require("nixl_cu12")
    monkeypatch.setattr(base, "_REMEASURE_S", 0.1)  # a refusal has the store measured at most this often
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path / "store")
    with transport.receiver_for(channel, "127.0.0.1", 0, store, quota_bytes=1 << 20).start() as r:
        url = f"{channel}://127.0.0.1:{r.address[1]}"
        transport.send_chunks(url, [(ns, key, chunk)])  # a few KiB: room for it
        used = sum(p.stat().st_size for p in (tmp_path / "store").rglob("*") if p.is_file())
        r.quota_bytes = used + 10  # not enough room for another
        with pytest.raises(hv.HurrayFormatError, match="quota"):
            transport.send_chunks(url, [(ns, "ab" * 8, chunk)])
        assert not store.has(ns, "ab" * 8) and r.refused == 1 and "receiver.quota" in (r.last_error or "")
        assert sorted(p.name for p in (tmp_path / "store").rglob("*") if p.is_file()) == [f"{key}.hrry"]
        (tmp_path / "store" / ns / f"{key}.hrry").unlink()  # pruned: room again (measured afresh, not counted)
        time.sleep(0.15)  # once the last measurement is old enough to be taken again
        transport.send_chunks(url, [(ns, "ab" * 8, chunk)])
        assert store.has(ns, "ab" * 8)
    floor = DirectoryStore(tmp_path / "floor")
    with transport.receiver_for(channel, "127.0.0.1", 0, floor, min_free_bytes=1 << 60).start() as r:
        with pytest.raises(hv.HurrayFormatError, match="free"):
            transport.send_chunks(f"{channel}://127.0.0.1:{r.address[1]}", [(ns, key, chunk)])
        assert not (tmp_path / "floor").exists() or not any(p.is_file() for p in (tmp_path / "floor").rglob("*"))


@pytest.mark.parametrize("channel", transport.CHANNELS)
def test_the_quota_counts_a_chunks_file_not_its_stream(channel: str, tmp_path: Path) -> None:
    """Every buffer of a file starts on a 4 KiB boundary: a chunk of many tiny buffers takes ~40x its stream."""
    from conftest import require

    if channel == "nixl":
        require("nixl_cu12")
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path / "store")
    on_disk = store.size_of(chunk)
    with transport.receiver_for(channel, "127.0.0.1", 0, store, quota_bytes=on_disk - 1).start() as r:
        _slow_settle(r)
        url = f"{channel}://127.0.0.1:{r.address[1]}"
        with pytest.raises(hv.HurrayFormatError, match="quota"):
            transport.send_chunks(url, [(ns, key, chunk)])  # its stream fits; its file would not
        assert r._promised == 0  # released before the answer, however long it takes
        assert not store.has(ns, key) and "receiver.quota" in (r.last_error or "")
        assert not [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
        r.quota_bytes = on_disk
        transport.send_chunks(url, [(ns, key, chunk)])  # a retry at once finds the room
        assert r._promised == 0
        assert (tmp_path / "store" / ns / f"{key}.hrry").stat().st_size == on_disk


@pytest.mark.parametrize("channel", transport.CHANNELS)
def test_a_refused_chunk_releases_its_room_before_the_answer(channel: str, tmp_path: Path) -> None:
    """A sender that retries the moment it is refused must not be refused again for the room the first took."""
    from conftest import require

    if channel == "nixl":
        require("nixl_cu12")
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path / "store")
    bad = _damaged(chunk)
    with transport.receiver_for(channel, "127.0.0.1", 0, store, quota_bytes=store.size_of(chunk) + 4096).start() as r:
        _slow_settle(r)
        url = f"{channel}://127.0.0.1:{r.address[1]}"
        with pytest.raises(hv.HurrayFormatError, match="digest"):
            transport.send_chunks(url, [(ns, key, bad)])  # admitted, then refused: its data is damaged
        assert r._promised == 0
        transport.send_chunks(url, [(ns, key, chunk)])  # the whole quota again, at once
        assert store.has(ns, key) and r._promised == 0


def _damaged(chunk: KVSnapshot) -> KVSnapshot:
    """``chunk`` with a well-formed digest its data does not match."""
    from hurray_vllm.chunks.digest import DIGEST_KEY

    real = chunk.extra[DIGEST_KEY]
    return replace(chunk, extra={**chunk.extra, DIGEST_KEY: real[:-1] + ("1" if real[-1] == "0" else "0")})


def _slow_settle(r: ReceiverBase, delay_s: float = 0.3) -> None:
    """Make ``r`` release its promises slowly, so an answer sent before the release shows."""
    settle = r.settle

    def slow(nbytes: int, stored_bytes: int) -> None:
        time.sleep(delay_s)
        settle(nbytes, stored_bytes)

    r.settle = slow  # type: ignore[method-assign]


def test_connections_beyond_the_limit_are_answered_and_closed(tmp_path: Path) -> None:
    ns, key, chunk = example_chunk()
    with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path), max_connections=1, idle_timeout=30) as r:
        first = socket.create_connection(("127.0.0.1", r.address[1]), timeout=10)
        try:
            _wait_for(lambda: r._conns)  # the first connection is being served
            with pytest.raises(hv.HurrayFormatError, match="more than 1 connections"):
                send_chunks(_url(r), [(ns, key, chunk)], timeout=10)
        finally:
            first.close()
        _wait_for(lambda: not r._conns)
        send_chunks(_url(r), [(ns, key, chunk)], timeout=10)  # served again once the first is gone
        assert DirectoryStore(tmp_path).has(ns, key)
    with pytest.raises(hv.HurrayArgumentError, match=r"max_connections: .* not 0"):
        Receiver("127.0.0.1", 0, DirectoryStore(tmp_path), max_connections=0)


@pytest.mark.parametrize("channel", transport.CHANNELS)
def test_a_sender_asks_which_chunks_the_receiver_holds(channel: str, tmp_path: Path) -> None:
    """The held-chunk query: answered per name, in batches, between chunks; malformed ones close the connection."""
    from conftest import require

    from hurray_vllm.transport.base import MAX_HELD_QUERY, query_held

    if channel == "nixl":
        require("nixl_cu12")
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path)
    with transport.receiver_for(channel, "127.0.0.1", 0, store, idle_timeout=5).start() as r:
        url = f"{channel}://127.0.0.1:{r.address[1]}"
        sender = transport.sender_for(url)
        assert sender.held(url, [(ns, key)]) == set() and sender.held(url, []) == set()
        transport.send_chunks(url, [(ns, key, chunk)])
        # A slice's name is another file: held only if that file is stored.
        assert sender.held(url, [(ns, key), (ns, "ab" * 8), (ns, key + ".h0-1")]) == {(ns, key)}
        many = [(ns, f"{i:x}") for i in range(MAX_HELD_QUERY + 5)] + [(ns, key)]
        assert sender.held(url, many) == {(ns, key)}  # asked in two batches
        # Questions and chunks share a connection: asked, then pushed, then asked again.
        with sender.connect(url) as sock:
            assert query_held(sock, [(ns, "cd" * 8)]) == set()
            if channel == "tcp":
                from hurray_vllm.transport.tcp import _send_over

                _send_over(sock, [(ns, "cd" * 8, chunk)])  # the connection stays open
                assert query_held(sock, [(ns, "cd" * 8)]) == {(ns, "cd" * 8)}
        # A name that is not a chunk's, or longer than one, ends the connection: nothing is answered.
        with pytest.raises(hv.HurrayFormatError):
            sender.held(url, [("../../etc", key)])
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=5) as s:
            s.sendall(b"HVH1" + (1).to_bytes(2, "little") + (60_000).to_bytes(2, "little"))
            assert _until_closed(s) in (b"", b"ER")  # closed (after an error, NIXL), without reading 60 000 bytes
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=5) as s:
            s.sendall(b"HVH1" + (MAX_HELD_QUERY + 1).to_bytes(2, "little"))
            assert _until_closed(s) in (b"", b"ER")
        assert sender.held(url, [(ns, key)]) == {(ns, key)}  # and the receiver goes on serving


def test_a_keyed_receiver_answers_held_queries_only_from_fleet_members(tmp_path: Path) -> None:
    """Which prompts a store holds is as private as the chunks: no key, no answer."""
    from hurray_vllm.chunks.signing import FleetKeys, sign_chunk

    keys = FleetKeys.from_secrets(b"s" * 32)
    ns, key, chunk = example_chunk()
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), keys=keys).start() as r:
        url = _url(r)
        transport.send_chunks(url, [(ns, key, sign_chunk(chunk, keys, ns, key))], keys=keys)
        with pytest.raises(hv.HurrayFormatError, match="fleet key"):
            TcpSender().held(url, [(ns, key)])
        assert TcpSender().held(url, [(ns, key)], keys=keys) == {(ns, key)}


def _wait_for(ready: Callable[[], object], within: float = 10) -> None:
    """Poll ``ready()`` until it is true; fail the test after ``within`` seconds."""
    assert wait_for(ready, within), "timed out waiting"


def _until_closed(s: socket.socket) -> bytes:
    """What the peer sends until it closes: the first two bytes of it."""
    got = b""
    while part := s.recv(4096):
        got += part
    return got[:2]


def test_a_sender_trickling_a_frame_is_disconnected_at_its_deadline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each byte inside the socket timeout, but the frame far slower than the receiver's timeout: cut off."""
    import logging
    import socket
    import struct

    ns, key, _ = example_chunk()
    store = DirectoryStore(tmp_path / "store")
    caplog.set_level(logging.WARNING, logger="hurray_vllm.transport")
    # A byte every 0.25 s against 3 s per recv: only a 3 s stall of this test would let the socket timeout cut it.
    with transport.receiver_for("tcp", "127.0.0.1", 0, store, timeout=3.0, quota_bytes=1 << 30).start() as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as s:
            name = ns.encode(), key.encode()
            s.sendall(b"HVC1" + struct.pack("<H", len(name[0])) + name[0] + struct.pack("<H", len(name[1])) + name[1])
            s.sendall(struct.pack("<Q", 4096))
            start, closed = time.monotonic(), False
            while time.monotonic() - start < 60:  # a hang guard: 4096 B at this pace take 17 minutes
                try:
                    s.sendall(b"\0")
                    time.sleep(0.25)  # well inside the socket timeout: each recv is satisfied in time
                except OSError:
                    closed = True
                    break
            assert closed  # 3 s (the bytes keep no pace), then the watchdog (its message, not a recv's timeout):
            assert "closing a connection whose frame is overdue" in caplog.text
        deadline = time.monotonic() + 60
        while r._promised and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r._promised == 0 and r.received == 0 and not store.has(ns, key)


def test_a_failed_accept_does_not_stop_the_receiver(tmp_path: Path) -> None:
    """Out of file descriptors for a moment (EMFILE): the receiver keeps accepting once they are back."""
    import errno

    class _Flaky:
        def __init__(self, sock: socket.socket) -> None:
            self.sock, self.failures = sock, 3

        def accept(self) -> tuple[socket.socket, object]:
            if self.failures:
                self.failures -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return self.sock.accept()

        def shutdown(self, how: int) -> None:
            self.sock.shutdown(how)

        def close(self) -> None:
            self.sock.close()

    ns, key, chunk = example_chunk()
    r = transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path))
    r._sock = _Flaky(r._sock)  # type: ignore[assignment]
    with r.start():
        transport.send_chunks(f"tcp://127.0.0.1:{r.address[1]}", [(ns, key, chunk)], timeout=10)
        assert r.received == 1 and r._sock.failures == 0  # type: ignore[attr-defined]


def test_a_stopped_receiver_takes_no_more_connections(tmp_path: Path) -> None:
    """stop() ends the accept thread and closes the port: closing the socket alone left accept() blocked on it."""
    r = transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path)).start()
    port = r.address[1]
    r.stop()
    assert r._accepting is not None
    r._accepting.join(10)
    assert not r._accepting.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10).close()


def test_chunks_read_at_once_are_bounded_in_memory(tmp_path: Path) -> None:
    """A second chunk that would pass max_inflight_bytes while one is being read is refused unread; alone, it fits."""
    import io
    import struct

    from hurray_vllm.containers.io import write_stream

    ns, key, chunk = example_chunk()
    buf = io.BytesIO()
    write_stream(chunk, buf)
    body = buf.getvalue()
    name = ns.encode(), key.encode()
    head = b"HVC1" + struct.pack("<H", len(name[0])) + name[0] + struct.pack("<H", len(name[1])) + name[1]
    store = DirectoryStore(tmp_path)
    with transport.receiver_for("tcp", "127.0.0.1", 0, store, max_inflight_bytes=len(body) + 100).start() as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as first:
            first.sendall(head + struct.pack("<Q", len(body)) + body[:10])  # being read: holds its bytes
            deadline = time.monotonic() + 5
            while not r._inflight and time.monotonic() < deadline:
                time.sleep(0.01)
            with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as second:
                second.sendall(head + struct.pack("<Q", len(body)))
                assert recv_exact(second, 2) == b"ER"
                message = recv_exact(second, int.from_bytes(recv_exact(second, 2), "little"))
                assert message.startswith(b"receiver.memory:")
            first.sendall(body[10:])
            assert recv_exact(first, 2) == b"OK"
        assert r._inflight == 0 and store.has(ns, key)
        url = f"tcp://127.0.0.1:{r.address[1]}"
        transport.send_chunks(url, [(ns, "ef" * 8, chunk)], timeout=10)  # alone again: takes it
    with pytest.raises(hv.HurrayArgumentError, match="max_inflight_bytes") as refused:
        transport.receiver_for("tcp", "127.0.0.1", 0, store, max_inflight_bytes=0)
    assert refused.value.field == "max_inflight_bytes"  # as the other limits: a caller's mistake, named


def _aborted_after(sender: TcpSender, call: Callable[[], object], delay: float = 0.3) -> tuple[BaseException, float]:
    """Run ``call`` on a thread and abort ``sender`` from ``delay`` seconds in: what it raised, and after how long."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            failed.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    time.sleep(delay)
    deadline = time.monotonic() + 120  # a hang guard: the calls aborted here wait 600 s otherwise
    while t.is_alive() and time.monotonic() < deadline:
        sender.abort()  # again until it ends: an abort cuts the calls under way only, and a slow start may not be
        t.join(0.1)
    assert failed, "the call returned although it was aborted"
    return failed[0], time.monotonic() - t0


def test_an_aborted_held_query_says_it_was_aborted_and_the_next_call_is_not(receiver: Receiver) -> None:
    """A query cut short reads EOF, which must not pass for a receiver too old to answer (a HurrayFormatError)."""
    from hurray_vllm.transport.base import SendAborted

    ns, key, chunk = example_chunk()
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)  # accepted by the kernel, never answered
        sender = TcpSender()
        url = f"tcp://127.0.0.1:{hole.getsockname()[1]}"
        exc, took = _aborted_after(sender, lambda: sender.held(url, [(ns, key)], timeout=600))
    assert isinstance(exc, SendAborted) and isinstance(exc, OSError) and took < 60  # 60: a hang guard
    assert not sender._live_sockets()
    send_chunks(_url(receiver), [(ns, key, chunk)])
    assert sender.held(_url(receiver), [(ns, key)]) == {(ns, key)}  # an abort cuts the calls in progress only


def test_abort_cuts_a_connect_the_receiver_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that drops SYNs: the connect is cut at once, not after its 5 s."""
    from hurray_vllm.transport import base
    from hurray_vllm.transport.base import SendAborted

    monkeypatch.setattr(base, "CONNECT_TIMEOUT_S", 600.0)  # only the abort ends the connect within the hang guard
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(0)
        port = hole.getsockname()[1]
        fill = []
        try:
            for _ in range(3):  # a full accept queue: the kernel drops further SYNs, as a blackholed host would
                f = socket.socket()
                f.setblocking(False)
                f.connect_ex(("127.0.0.1", port))
                fill.append(f)
            time.sleep(0.2)
            with socket.socket() as probe:
                probe.settimeout(0.5)
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    pytest.skip("this kernel completes connects to a full accept queue")
            sender = TcpSender()
            exc, took = _aborted_after(sender, lambda: sender.send(f"tcp://127.0.0.1:{port}", [], timeout=600))
        finally:
            for f in fill:
                f.close()
    assert isinstance(exc, SendAborted) and took < 60  # 60: a hang guard
    assert not sender._live_sockets()


def test_abort_cuts_a_tls_handshake_the_receiver_never_answers() -> None:
    """The TLS socket takes the plain one's descriptor: it is the one an abort must reach, before it shakes hands."""
    import ssl

    from hurray_vllm.transport.base import SendAborted

    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)  # accepted by the kernel; never speaks TLS
        sender = TcpSender(ssl.create_default_context())
        exc, took = _aborted_after(
            sender, lambda: sender.send(f"tls://127.0.0.1:{hole.getsockname()[1]}", [], timeout=600)
        )
    assert isinstance(exc, SendAborted) and took < 60  # 60: a hang guard (the handshake's own limit is 600 s)


def test_a_push_the_receiver_never_reads_fails_after_one_timeout() -> None:
    """The bytes a timed-out write left buffered are not flushed again (a second timeout) as the connection closes."""
    from hurray_vllm import ModelFingerprint
    from hurray_vllm.kv.paged import BlockPagedTensor

    nb, layers = 32, 128
    pool = torch.zeros(nb, 16, 2, 64, dtype=torch.float16)  # 128 KiB, shared by every layer: 32 MiB on the wire
    idx = (torch.arange(nb), torch.tensor([0, nb]), torch.tensor([nb * 16]))
    snap = KVSnapshot(
        tuple(BlockPagedTensor(pool, *idx, "key", i) for i in range(layers)),
        tuple(BlockPagedTensor(pool, *idx, "value", i) for i in range(layers)),
        token_ids=(tuple(range(nb * 16)),),
        fingerprint=ModelFingerprint("T", layers, 2, 64, "float16"),
    )
    # Counted, not timed (encoding 32 MiB takes what it takes): how many writes ran into the socket's timeout.
    timed_out: list[str] = []

    def counting(name: str) -> Any:
        real = getattr(socket.socket, name)

        def write(self: socket.socket, *args: Any, **kwargs: Any) -> Any:
            try:
                return real(self, *args, **kwargs)
            except TimeoutError:
                timed_out.append(name)
                raise

        return write

    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)  # accepted by the kernel, never read: the socket buffers fill up
        with pytest.MonkeyPatch.context() as mp:
            for name in ("send", "sendall", "sendmsg"):
                mp.setattr(socket.socket, name, counting(name))
            with pytest.raises(TimeoutError):
                TcpSender().send(f"tcp://127.0.0.1:{hole.getsockname()[1]}", [("ab" * 8, "cd" * 8, snap)], timeout=1.5)
        assert len(timed_out) == 1, timed_out


def test_a_refusal_thread_that_cannot_start_leaves_the_receiver_accepting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread to answer a connection beyond the limit: it is closed, its slot freed, and accepting goes on."""
    from hurray_vllm.transport import base

    start = threading.Thread.start

    def no_refusal_thread(self: threading.Thread) -> None:
        if getattr(getattr(self, "_target", None), "__name__", "") == "_refuse":
            raise RuntimeError("can't start new thread")
        start(self)

    ns, key, chunk = example_chunk()
    with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path), max_connections=1, idle_timeout=30) as r:
        first = socket.create_connection(("127.0.0.1", r.address[1]), timeout=10)
        try:
            _wait_for(lambda: r._conns)  # the first connection is being served: the next one is refused
            monkeypatch.setattr(threading.Thread, "start", no_refusal_thread)
            with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as second:
                assert _until_closed(second) == b""  # closed unanswered
            monkeypatch.undo()
        finally:
            first.close()
        _wait_for(lambda: not r._conns)
        send_chunks(_url(r), [(ns, key, chunk)], timeout=10)  # the accept thread lives on
        assert DirectoryStore(tmp_path).has(ns, key)
        assert r._refusing._value == base._MAX_REFUSING  # type: ignore[attr-defined]  # no slot leaked


def test_a_name_that_never_resolves_costs_the_connect_timeout_and_an_abort_cuts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dead DNS server: getaddrinfo cannot be interrupted, so it must not hold the connect (or an abort) itself."""
    from hurray_vllm.transport import base
    from hurray_vllm.transport.base import SendAborted

    released = threading.Event()
    getaddrinfo = socket.getaddrinfo
    asked: list[str] = []

    def dead_dns(host: str, *args: object, **kwargs: object) -> object:
        asked.append(host if threading.current_thread() is threading.main_thread() else f"{host} (on a helper)")
        if host == "dead.invalid":
            released.wait(600)  # only the connect timeout (or an abort) ends the connect within the hang guards
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return getaddrinfo(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", dead_dns)
    monkeypatch.setattr(base, "CONNECT_TIMEOUT_S", 0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"resolving dead\.invalid"):
            send_chunks("tcp://dead.invalid:9", [], timeout=600)
        assert time.monotonic() - t0 < 60  # a hang guard: the dead DNS answers after 600 s
        monkeypatch.setattr(base, "CONNECT_TIMEOUT_S", 600.0)
        sender = TcpSender()
        exc, took = _aborted_after(sender, lambda: sender.send("tcp://dead.invalid:9", [], timeout=600))
        assert isinstance(exc, SendAborted) and took < 60  # a hang guard
    finally:
        released.set()
    with socket.socket() as hole:  # a numeric address needs no DNS: resolved at once, on the caller's thread
        hole.bind(("127.0.0.1", 0))
        hole.listen(1)
        asked.clear()
        send_chunks(f"tcp://127.0.0.1:{hole.getsockname()[1]}", [], timeout=5)
        assert asked == ["127.0.0.1"]


@pytest.mark.parametrize("channel", transport.CHANNELS)
def test_a_chunk_with_states_replaces_a_stored_copy_without_them(channel: str, tmp_path: Path) -> None:
    """As the connector writes over its own stateless copy: the receiver keeps the copy a load resumes from."""
    from conftest import require

    from hurray_vllm.chunks.store import DIGEST_KEY, chunk_digest

    if channel == "nixl":
        require("nixl_cu12")
    ns, key, chunk = example_chunk()
    states = hv.RecurrentStates(
        "gdn_attn", (chunk.num_layers,), ("conv", "ssm"), (4,), ((torch.ones(1, 3, 16), torch.ones(1, 2, 8, 8)),)
    )
    with_states = replace(chunk, states=states)
    with_states = replace(with_states, extra={**with_states.extra, DIGEST_KEY: chunk_digest(with_states)})
    store = DirectoryStore(tmp_path)
    with transport.receiver_for(channel, "127.0.0.1", 0, store).start() as r:
        url = f"{channel}://127.0.0.1:{r.address[1]}"
        transport.send_chunks(url, [(ns, key, chunk)], timeout=10)
        assert store.has(ns, key) and not store.has_states(ns, key)
        transport.send_chunks(url, [(ns, key, with_states)], timeout=10)
        assert store.has_states(ns, key)
        transport.send_chunks(url, [(ns, key, chunk)], timeout=10)  # never the other way round
        assert store.has_states(ns, key) and r.received == 3


def test_a_chunk_with_states_replaces_a_stateless_copy_stored_while_it_was_written(tmp_path: Path) -> None:
    """Found by a review: a stateless copy landing (another connection) between the check and the write was kept."""
    from hurray_vllm.chunks.store import DIGEST_KEY, chunk_digest

    ns, key, chunk = example_chunk()
    states = hv.RecurrentStates(
        "gdn_attn", (chunk.num_layers,), ("conv", "ssm"), (4,), ((torch.ones(1, 3, 16), torch.ones(1, 2, 8, 8)),)
    )
    with_states = replace(chunk, states=states)
    with_states = replace(with_states, extra={**with_states.extra, DIGEST_KEY: chunk_digest(with_states)})

    class Racing(DirectoryStore):
        """A disk on which the stateful file takes long enough that a stateless copy, pushed meanwhile, lands first."""

        url = ""
        raced = False

        def put(self, ns: str, key: str, snap: KVSnapshot, *, replace: bool = False) -> bool:
            if snap.states is not None and not replace and not self.raced:
                self.raced = True
                send_chunks(self.url, [(ns, key, chunk)], timeout=10)  # another connection, served meanwhile
            return super().put(ns, key, snap, replace=replace)

    store = Racing(tmp_path)
    with Receiver("127.0.0.1", 0, store, timeout=5, quota_bytes=1 << 30) as r:
        store.url = _url(r)
        send_chunks(_url(r), [(ns, key, with_states)], timeout=10)
        assert store.raced and store.has_states(ns, key) and (r.received, r.refused) == (2, 0)
        # Both connections counted: the stateless file, then only what the stateful one added.
        assert r._used is not None and r._used[1] == store.path(ns, key).stat().st_size and r._promised == 0


def test_a_chunk_refused_after_its_payload_was_read_leaves_the_connection_open(receiver: Receiver) -> None:
    """A damaged chunk is answered ER and the next frame on the same connection is served; an unread one closes it."""
    import io
    import struct

    from hurray_vllm.containers.io import write_stream
    from hurray_vllm.transport.tcp import frame_head

    ns, key, chunk = example_chunk()

    def frame(snap: KVSnapshot, ns: str = ns) -> bytes:
        buf = io.BytesIO()
        write_stream(snap, buf)
        return frame_head(ns, key, len(buf.getvalue())) + buf.getvalue()

    def answer(s: socket.socket) -> bytes:
        head = recv_exact(s, 2)
        return head if head == b"OK" else head + recv_exact(s, struct.unpack("<H", recv_exact(s, 2))[0])

    with socket.create_connection(("127.0.0.1", receiver.address[1]), timeout=10) as s:
        s.sendall(frame(_damaged(chunk)))
        assert answer(s).startswith(b"ERsnapshot.digest")
        s.sendall(frame(chunk))  # the same connection
        assert answer(s) == b"OK"
    assert receiver.store.has(ns, key)  # type: ignore[attr-defined]
    with socket.create_connection(("127.0.0.1", receiver.address[1]), timeout=10) as s:
        s.sendall(frame(chunk, ns="../x"))  # refused before its payload is let in: not read, the connection ends
        assert answer(s).startswith(b"ER") and _until_closed(s) == b""


# ── reviewed defects: slow peers, refusals a sender must see, stopping, counting ──


def test_a_payload_trickled_after_its_head_is_cut_after_one_timeout_whatever_length_it_announces(
    tmp_path: Path,
) -> None:
    """64 MiB announced (a 64 s frame at FRAME_MIN_RATE): a byte per 0.1 s is cut after ~timeout, not 64 s."""
    from hurray_vllm.transport.tcp import frame_head

    ns, key, _ = example_chunk()
    with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path), timeout=0.5) as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as s:
            s.sendall(frame_head(ns, key, 64 << 20))
            start, closed = time.monotonic(), False
            while time.monotonic() - start < 20:  # a hang guard
                try:
                    s.sendall(b"\0")
                    time.sleep(0.1)  # each recv well inside the socket timeout
                except OSError:
                    closed = True
                    break
            assert closed and time.monotonic() - start < 5
        _wait_for(lambda: r._inflight == 0 and r.refused == 1)  # the memory reserved for it is back


def test_a_chunk_refused_at_its_head_reaches_the_sender_as_the_refusal_not_a_broken_pipe(tmp_path: Path) -> None:
    """The receiver closes while the sender still writes 32 MiB: the sender raises the receiver's reason."""
    from synthetic import make_snapshot

    snap = make_snapshot([4096], [0], 16, heads=8, dim=128, layers=2)
    for limits, says in (({"max_chunk_bytes": 1 << 20}, "exceeds the limit"), ({"quota_bytes": 1 << 20}, "quota")):
        with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path / says), timeout=5, **limits) as r:
            with pytest.raises(hv.HurrayFormatError, match=says) as info:
                send_chunks(_url(r), [("ab" * 8, "cd" * 8, snap)], timeout=10)
            assert "receiver refused" in str(info.value)


def test_each_caller_gets_its_own_tcp_sender_and_aborts_only_its_own_pushes(tmp_path: Path) -> None:
    """One engine aborting its push (a full save queue, shutdown) cut every other engine's pushes in the process."""
    ns, key, chunk = example_chunk()

    class Slow(DirectoryStore):
        def put(self, *args: Any, **kwargs: Any) -> Any:
            time.sleep(0.5)
            return super().put(*args, **kwargs)

    with Receiver("127.0.0.1", 0, Slow(tmp_path), timeout=5) as r:
        mine, theirs = transport.sender_for("tcp://127.0.0.1:1"), transport.sender_for(_url(r))
        assert mine is not theirs
        failed: list[BaseException] = []

        def push() -> None:
            try:
                theirs.send(_url(r), [(ns, key, chunk)], timeout=10)
            except BaseException as exc:
                failed.append(exc)

        t = threading.Thread(target=push)
        t.start()
        time.sleep(0.2)
        mine.abort()
        t.join(20)
        assert not failed and DirectoryStore(tmp_path).has(ns, key)


def _answering(answer: bytes, trickle: bytes) -> tuple[int, threading.Event]:
    """A fake receiver (one connection): swallows the frame, sends ``answer``, then ``trickle`` a byte per 0.2 s."""
    srv = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        with srv, srv.accept()[0] as c:
            c.settimeout(0.3)
            try:
                while c.recv(1 << 20):
                    pass
            except OSError:  # the frame is in; the sender waits for its answer
                pass
            c.sendall(answer)
            for byte in trickle:
                if done.wait(0.2):
                    return
                c.sendall(bytes([byte]))

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], done


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (b"ER" + (65535).to_bytes(2, "little"), "longer than receivers send"),  # refused unread
        (b"ER" + (500).to_bytes(2, "little"), "no reason given"),  # the whole answer within the timeout
    ],
)
def test_a_receiver_trickling_its_answer_holds_the_sender_one_timeout(answer: bytes, says: str) -> None:
    ns, key, chunk = example_chunk()
    port, done = _answering(answer, b"x" * 1000)
    try:
        start = time.monotonic()
        with pytest.raises(hv.HurrayFormatError, match=says):
            TcpSender().send(f"tcp://127.0.0.1:{port}", [(ns, key, chunk)], timeout=1.0)
        assert time.monotonic() - start < 5  # 1 s; a byte per 0.2 s would have taken 100 s or more
    finally:
        done.set()


def test_stop_waits_for_a_chunk_being_stored_and_stores_none_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() returned while connection threads still wrote chunks into the store."""
    from hurray_vllm.transport import tcp

    ns, key, chunk = example_chunk()
    storing, checked, release = threading.Event(), threading.Event(), threading.Event()

    class Gated(DirectoryStore):
        def put(self, *args: Any, **kwargs: Any) -> Any:
            storing.set()
            release.wait(10)
            return super().put(*args, **kwargs)

    def push(url: str) -> None:
        with contextlib.suppress(OSError, hv.HurrayFormatError):  # stop() cuts the connection
            send_chunks(url, [(ns, key, chunk)], timeout=10)

    # A put under way when stop() is called: stop() returns after it, the chunk stored.
    r = Receiver("127.0.0.1", 0, Gated(tmp_path / "a"), timeout=5).start()
    threading.Thread(target=push, args=(_url(r),), daemon=True).start()
    _wait_for(storing.is_set)
    threading.Timer(0.3, release.set).start()
    r.stop()
    assert DirectoryStore(tmp_path / "a").has(ns, key) and not r._threads
    # A chunk read whole as stop() begins: refused, never written afterwards.
    real = tcp.digest_matches

    def gated_digest(snap: KVSnapshot) -> bool:
        checked.set()
        _wait_for(lambda: r2.stopping)
        return real(snap)

    monkeypatch.setattr(tcp, "digest_matches", gated_digest)
    storing.clear()
    r2 = Receiver("127.0.0.1", 0, Gated(tmp_path / "b"), timeout=5).start()
    threading.Thread(target=push, args=(_url(r2),), daemon=True).start()
    _wait_for(checked.is_set)
    r2.stop()
    assert not storing.is_set() and not DirectoryStore(tmp_path / "b").has(ns, key) and not r2._threads


def test_the_usage_of_a_store_is_measured_at_most_once_a_second_outside_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every head beyond the quota walked the whole store, under the lock every admit and settle take."""
    import os

    from hurray_vllm.transport.tcp import frame_head

    ns, key, _ = example_chunk()
    (tmp_path / ns).mkdir()
    for i in range(50):
        (tmp_path / ns / f"{i:016x}.hrry").write_bytes(b"")
    walks: list[bool] = []
    real = os.walk

    with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path), quota_bytes=1 << 20, timeout=5) as r:

        def counting(*args: Any, **kwargs: Any) -> Any:
            walks.append(r._disk.locked())
            return real(*args, **kwargs)

        monkeypatch.setattr(base.os, "walk", counting)
        for _ in range(10):  # heads announcing 2 MiB, beyond the quota, each refused unread
            with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as s:
                s.sendall(frame_head(ns, key, 2 << 20))
                assert _until_closed(s) == b"ER"
        assert 1 <= len(walks) <= 2 and not any(walks), walks  # the first look, and once more a second later
        assert r.refused == 10


def test_a_frame_cut_at_its_deadline_is_counted_refused_once(tmp_path: Path) -> None:
    """The watchdog counted the cut, and the chunk's reader its failure: two refusals for one frame."""
    import io

    from hurray_vllm.containers.io import write_stream
    from hurray_vllm.transport.tcp import frame_head

    ns, key, chunk = example_chunk()
    stream = io.BytesIO()
    write_stream(chunk, stream)
    head = frame_head(ns, key, len(stream.getvalue()))
    with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path), timeout=0.3) as r:
        # A byte per 0.05 s (no recv times out): in the payload, then in the head (magic sent whole).
        for first, trickled in ((head, stream.getvalue()), (head[:4], head[4:])):
            before = r.refused
            with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as s:
                s.sendall(first)
                with contextlib.suppress(OSError):  # cut: the receiver closed
                    for byte in trickled:
                        s.sendall(bytes([byte]))
                        time.sleep(0.05)
            _wait_for(lambda: not r._conns)  # the connection's thread is done (counted first)
            assert r.refused == before + 1 and "receiver.timeout" in (r.last_error or "")


def test_a_chunk_stored_after_its_deadline_passed_is_counted_stored_and_answered(tmp_path: Path) -> None:
    """A slow put outlived the frame's deadline: the chunk was stored, counted refused and its sender cut off."""
    ns, key, chunk = example_chunk()

    class Slow(DirectoryStore):
        def put(self, *args: Any, **kwargs: Any) -> Any:
            time.sleep(0.8)
            return super().put(*args, **kwargs)

    with Receiver("127.0.0.1", 0, Slow(tmp_path), timeout=0.3) as r:
        send_chunks(_url(r), [(ns, key, chunk)], timeout=10)
        assert (r.received, r.refused) == (1, 0)


def test_stop_shuts_tls_connections_as_the_watchdog_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SSLSocket.shutdown drops the TLS state under the connection's thread: the plain socket's is used."""
    import ssl

    from pki import make_pki

    from hurray_vllm.transport.security import TlsOptions, client_context, server_context

    pki = make_pki(tmp_path, "fleet")
    tls = server_context(TlsOptions(pki["cert"], pki["key"]))
    calls: list[object] = []
    real = ssl.SSLSocket.shutdown

    def spy(self: ssl.SSLSocket, how: int) -> None:
        calls.append(self)
        real(self, how)

    r = Receiver("127.0.0.1", 0, DirectoryStore(tmp_path / "store"), tls=tls, timeout=5).start()
    ctx = client_context(TlsOptions(ca_file=pki["ca"]))
    with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            s.sendall(b"HV")  # half a magic: the connection's thread waits in a TLS read
            _wait_for(lambda: len(r._conns) == 1 and all(isinstance(c, ssl.SSLSocket) for c in r._conns))
            monkeypatch.setattr(ssl.SSLSocket, "shutdown", spy)
            r.stop()
    assert not calls


def test_a_chunk_the_store_holds_already_counts_nothing_against_the_quota(tmp_path: Path) -> None:
    """Found by a review: sending a chunk again counted its file once more, though nothing was written."""
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path)
    store.put(ns, key, chunk)
    size = store.path(ns, key).stat().st_size
    with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path), timeout=5, quota_bytes=2 * size) as r:
        for _ in range(6):  # each would have counted another ``size``: the third was refused
            send_chunks(_url(r), [(ns, key, chunk)], timeout=5)
        assert r.received == 6 and r.refused == 0
        assert r._used is not None and r._used[1] == size and r._promised == 0


def test_a_receiver_that_hangs_up_before_its_first_answer_has_the_sender_ask_about_tls() -> None:
    """What a TLS receiver of an older hurray-vllm does with a tcp:// sender: reads, hangs up. Said so, not bare."""
    ns, key, chunk = example_chunk()
    for reset in (False, True):
        with socket.create_server(("127.0.0.1", 0)) as lsn:

            def tls_receiver(reset: bool = reset) -> None:
                conn, _ = lsn.accept()
                with conn:
                    conn.recv(5)  # not a TLS record: the handshake fails
                    if reset:  # unread bytes left: the close resets the connection
                        time.sleep(0.1)
                    else:
                        with contextlib.suppress(OSError):
                            conn.shutdown(socket.SHUT_WR)
                            while conn.recv(1 << 16):
                                pass

            threading.Thread(target=tls_receiver, daemon=True).start()
            with pytest.raises(
                (hv.HurrayFormatError, OSError), match=r"does the receiver use TLS\? \(tls:// vs tcp://\)"
            ):
                send_chunks(f"tcp://127.0.0.1:{lsn.getsockname()[1]}", [(ns, key, chunk)], timeout=5)


def _wide_snapshot(layers: int) -> KVSnapshot:
    """A snapshot of ``layers`` x 256 KiB on the wire, every layer a view of one 128 KiB pool (little memory)."""
    from hurray_vllm import ModelFingerprint
    from hurray_vllm.kv.paged import BlockPagedTensor

    nb = 32
    pool = torch.zeros(nb, 16, 2, 64, dtype=torch.float16)
    idx = (torch.arange(nb), torch.tensor([0, nb]), torch.tensor([nb * 16]))
    return KVSnapshot(
        tuple(BlockPagedTensor(pool, *idx, "key", i) for i in range(layers)),
        tuple(BlockPagedTensor(pool, *idx, "value", i) for i in range(layers)),
        token_ids=(tuple(range(nb * 16)),),
        fingerprint=ModelFingerprint("T", layers, 2, 64, "float16"),
    )


def test_a_receiver_reading_a_trickle_fails_the_push_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each write goes on within the socket timeout, but the chunk far slower than its deadline: TimeoutError."""
    from blocking import within

    from hurray_vllm.transport import tcp

    monkeypatch.setattr(tcp, "FRAME_MIN_RATE", 16 << 20)  # 32 MiB: 1 s + 2 s (at 1 MiB/s: 1 s + 32 s)
    monkeypatch.setattr(tcp, "SENDER_RATE_SLACK", 1)  # the receiver's rule itself: the default is 8 times looser
    snap = _wide_snapshot(128)
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as lsn:

        def trickle() -> None:
            conn, _ = lsn.accept()
            with conn:
                while not stop.is_set():
                    conn.recv(64 << 10)  # 320 KiB/s: each of the sender's writes goes on within its 1 s
                    stop.wait(0.2)

        threading.Thread(target=trickle, daemon=True).start()
        url = f"tcp://127.0.0.1:{lsn.getsockname()[1]}"
        try:
            start = time.monotonic()
            # At this pace the 32 MiB take 100 s: without a deadline for the whole chunk, within() fails.
            failed = within(lambda: TcpSender().send(url, [("ab" * 8, "cd" * 8, snap)], timeout=1.0), timeout=20)
            took = time.monotonic() - start
        finally:
            stop.set()  # the reader closes: a sender still blocked fails and its thread ends
    assert isinstance(failed, TimeoutError) and "tcp" in str(failed) and "chunk cd" in str(failed), failed
    assert took < 15


def _paced_reader(lsn: socket.socket, total: int, piece: int, pause: float, stop: threading.Event) -> None:
    """Accept one connection, read ``total`` bytes ``piece`` at a time with ``pause`` between reads, answer OK."""
    conn, _ = lsn.accept()
    with conn:
        got = 0
        while got < total and not stop.is_set():
            data = conn.recv(min(piece, total - got))
            if not data:
                return
            got += len(data)
            stop.wait(pause)
        if got == total:
            conn.sendall(b"OK")
            stop.wait(5)


def test_a_slow_steady_receiver_is_not_cut_short_by_the_senders_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by reviewing the deadline: based on the sender's own timeout, it cut a chunk a receiver with a longer
    timeout (a slow link) was still taking in steadily. The sender allows SENDER_RATE_SLACK times the receivers'
    rate: half their rate is no reason to give up."""
    from hurray_vllm.transport import tcp

    monkeypatch.setattr(tcp, "FRAME_MIN_RATE", 16 << 20)  # the receivers' rule: 1 s + 2 s for these 32 MiB
    snap = _wide_snapshot(128)
    ns, key = "ab" * 8, "cd" * 8
    size = hv.write_stream(snap, tcp._Pieces())  # type: ignore[arg-type]
    total = len(tcp.frame_head(ns, key, size)) + size
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as lsn:
        # 1 MiB every 1/8 s: 8 MiB/s, half the receivers' rate here; the 32 MiB take ~4 s, past 1 s + 2 s.
        t = threading.Thread(target=_paced_reader, args=(lsn, total, 1 << 20, 0.125, stop), daemon=True)
        t.start()
        try:
            TcpSender().send(f"tcp://127.0.0.1:{lsn.getsockname()[1]}", [(ns, key, snap)], timeout=1.0)
        finally:
            stop.set()
            t.join(10)


def test_a_write_that_makes_no_progress_within_the_timeout_is_no_overdue_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by reviewing the deadline: a receiver that stopped reading fails the write after the socket's timeout,
    as before; the error said the chunk was overdue (and how long it "may take") although its deadline was far."""

    snap = _wide_snapshot(128)
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as lsn:
        t = threading.Thread(target=_paced_reader, args=(lsn, 1 << 62, 1 << 20, 3600, stop), daemon=True)
        t.start()  # reads 1 MiB, then nothing
        try:
            start = time.monotonic()
            with pytest.raises(TimeoutError) as caught:
                TcpSender().send(f"tcp://127.0.0.1:{lsn.getsockname()[1]}", [("ab" * 8, "cd" * 8, snap)], timeout=1.0)
            took = time.monotonic() - start
        finally:
            stop.set()
            t.join(10)
    assert "may take" not in str(caught.value), caught.value
    assert took < 10


def test_a_new_connection_that_sends_nothing_is_closed_after_the_handshake_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Silent new connections held the receiver's slots for the idle timeout; a sender makes its chunk first."""
    monkeypatch.setattr(base, "HANDSHAKE_TIMEOUT_S", 0.5)
    ns, key, chunk = example_chunk()

    def slow_first() -> Iterator[tuple[str, str, KVSnapshot]]:  # an engine exporting and storing its chunk
        time.sleep(1.5)
        yield ns, key, chunk

    with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path), timeout=5, idle_timeout=60) as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as s:
            start = time.monotonic()
            assert s.recv(1) == b""  # closed by the receiver: 60 s idle would raise TimeoutError here
            assert time.monotonic() - start < 5
        send_chunks(_url(r), slow_first(), timeout=5)  # connected once its first chunk is made: not cut
        assert DirectoryStore(tmp_path).has(ns, key) and (r.received, r.refused) == (1, 0)
        # A query first: what follows it gets the idle timeout, as any later frame.
        sender = TcpSender()
        with sender.tracked(_url(r), timeout=5) as sock:
            assert base.query_held(sock, [(ns, key)]) == {(ns, key)}
            time.sleep(1)  # past the first frame's 0.5 s
            assert base.query_held(sock, [(ns, key)]) == {(ns, key)}


def test_an_abort_while_the_first_chunk_is_made_still_aborts_the_push(receiver: Receiver) -> None:
    from hurray_vllm.transport.base import SendAborted

    ns, key, chunk = example_chunk()
    sender = TcpSender()

    def aborted_first() -> Iterator[tuple[str, str, KVSnapshot]]:
        sender.abort()  # the connector's shutdown, while the writer exports the first chunk
        yield ns, key, chunk

    with pytest.raises(SendAborted):
        sender.send(_url(receiver), aborted_first(), timeout=5)
    assert not receiver.store.has(ns, key)  # type: ignore[attr-defined]


@pytest.mark.parametrize("reads", [24 << 20, None], ids=["reset-mid-payload", "closed-after-the-frame"])
def test_a_plain_receiver_lost_after_reading_payload_is_no_question_about_tls(reads: int | None) -> None:
    """Only a connection lost before the receiver could have read any payload asks whether it uses TLS."""
    import struct

    from hurray_vllm.containers.io import write_stream
    from hurray_vllm.transport.tcp import _Pieces, frame_head

    snap = _wide_snapshot(256)  # 64 MiB: far more than two sockets' buffers hold
    size = write_stream(snap, _Pieces())  # type: ignore[arg-type]
    whole = len(frame_head("ab" * 8, "cd" * 8, size)) + size
    with socket.create_server(("127.0.0.1", 0)) as lsn:

        def receiver() -> None:
            conn, _ = lsn.accept()
            with conn:
                got, want = 0, reads or whole
                while got < want and (part := conn.recv(min(1 << 20, want - got))):
                    got += len(part)
                if reads:  # unread bytes left and no linger: a reset, as a killed receiver's
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

        threading.Thread(target=receiver, daemon=True).start()
        with pytest.raises((hv.HurrayFormatError, OSError)) as info:
            send_chunks(f"tcp://127.0.0.1:{lsn.getsockname()[1]}", [("ab" * 8, "cd" * 8, snap)], timeout=10)
    assert "TLS" not in str(info.value), info.value


def test_a_name_that_is_not_utf8_is_refused_with_an_answer_and_counted(receiver: Receiver) -> None:
    with socket.create_connection(("127.0.0.1", receiver.address[1]), timeout=10) as s:
        s.sendall(b"HVC1" + (2).to_bytes(2, "little") + b"\xff\xfe" + (2).to_bytes(2, "little") + b"cd")
        s.sendall((100).to_bytes(8, "little"))
        assert _until_closed(s) == b"ER"
    _wait_for(lambda: receiver.refused == 1)
    assert receiver.last_error is not None and "hex digits" in receiver.last_error


def _chunk_frame() -> tuple[str, str, bytes, bytes]:
    """An example chunk's ``(namespace, key, frame head after the magic, stream)``: a v1 frame is ``HVC1``,
    the head, then the stream."""
    import io

    from hurray_vllm.containers.io import write_stream

    ns, key, chunk = example_chunk()
    buf = io.BytesIO()
    write_stream(chunk, buf)
    body = buf.getvalue()
    head = len(ns).to_bytes(2, "little") + ns.encode() + len(key).to_bytes(2, "little") + key.encode()
    return ns, key, head + len(body).to_bytes(8, "little"), body


def test_a_frame_of_a_later_version_is_dropped_not_read_as_v1(receiver: Receiver) -> None:
    """Found by mutation testing: only the whole magic names a v1 frame. An ``HVC2`` frame (a later sender's,
    whose fields may mean something else) followed by what reads as a valid v1 frame is not stored: the
    connection is dropped."""
    ns, key, head, body = _chunk_frame()
    with socket.create_connection(("127.0.0.1", receiver.address[1]), timeout=10) as s:
        got = b""
        with contextlib.suppress(ConnectionError):  # closed (or reset, the frame unread) under the sender
            s.sendall(b"HVC2" + head + body)
            while part := s.recv(4096):
                got += part
        assert got == b""  # no OK: never parsed
    assert not DirectoryStore(receiver.store.root).has(ns, key)  # type: ignore[attr-defined]
    assert receiver.received == 0
    # Counted as refused (found by a leak review): an operator sees peers that speak garbage.
    _wait_for(lambda: receiver.refused == 1)
    assert "bad frame magic" in (receiver.last_error or "")
    with socket.create_connection(("127.0.0.1", receiver.address[1]), timeout=10) as s:
        s.sendall(b"HVC1" + head + body)  # the same frame as v1 is stored
        assert recv_exact(s, 2) == b"OK"
    assert DirectoryStore(receiver.store.root).has(ns, key)  # type: ignore[attr-defined]


@pytest.mark.parametrize("spare", [0, -1], ids=["at-the-limit", "one-byte-over"])
def test_max_chunk_bytes_is_the_largest_stream_accepted(tmp_path: Path, spare: int) -> None:
    """Found by mutation testing: a stream of exactly ``max_chunk_bytes`` is stored, one byte more refused at its
    head, unread."""
    ns, key, head, body = _chunk_frame()
    with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path), max_chunk_bytes=len(body) + spare) as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as s:
            s.sendall(b"HVC1" + head + body)
            if spare == 0:
                assert recv_exact(s, 2) == b"OK"
            else:
                assert recv_exact(s, 2) == b"ER"
                message = recv_exact(s, int.from_bytes(recv_exact(s, 2), "little"))
                assert f"chunk of {len(body)} bytes exceeds the limit of {len(body) - 1} bytes".encode() in message
        _wait_for(lambda: r.received + r.refused == 1)
        assert (r.received, r.refused) == ((1, 0) if spare == 0 else (0, 1))
    assert DirectoryStore(tmp_path).has(ns, key) is (spare == 0)


@pytest.mark.parametrize(
    ("option", "bad"),
    [
        ("max_chunk_bytes", 1.5),
        ("max_chunk_bytes", "x"),
        ("max_chunk_bytes", 0),
        ("max_connections", 2.5),
        ("max_connections", True),
        ("quota_bytes", "x"),
        ("quota_bytes", -1),
        ("min_free_bytes", float("nan")),
        ("min_free_bytes", -1),
        ("max_inflight_bytes", None),
        ("max_inflight_bytes", 1.5),
        ("timeout", "x"),
        ("timeout", float("inf")),
        ("idle_timeout", -1),
        ("idle_timeout", float("nan")),
    ],
)
def test_a_receiver_limit_out_of_range_is_refused_naming_the_limit(option: str, bad: object, tmp_path: Path) -> None:
    """1.5 bytes or 2.5 connections were taken (compared as the next integer up), nan free bytes compared false
    with everything, strings failed with a bare TypeError; the error named "limits", and idle_timeout "timeout"."""
    with pytest.raises(hv.HurrayArgumentError) as err:
        transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), **{option: bad})
    assert err.value.field == option, err.value


@pytest.mark.parametrize("port", [-1, 70000, 1.5, "x", None])
def test_a_port_out_of_range_is_refused_naming_the_port(port: object, tmp_path: Path) -> None:
    """-1 and 70000 raised the socket's OverflowError, not the documented OSError (which means: in use)."""
    with pytest.raises(hv.HurrayArgumentError) as err:
        transport.receiver_for("tcp", "127.0.0.1", port, DirectoryStore(tmp_path))  # type: ignore[arg-type]
    assert err.value.field == "port"


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), 1e12, None, "x", True])
def test_a_send_timeout_out_of_range_is_refused_before_sending(timeout: object, tmp_path: Path) -> None:
    """A socket took these as a TimeoutError (0: non-blocking), ValueError, OverflowError or TypeError, after the
    first chunk was made; now each entry refuses them naming the timeout, before asking for a chunk."""
    ns, key, chunk = example_chunk()
    made: list[int] = []

    def chunks() -> Iterator[tuple[str, str, KVSnapshot]]:
        made.append(1)
        yield ns, key, chunk

    with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path)) as r:
        for send in (send_chunks, transport.send_chunks, TcpSender().send):
            with pytest.raises(hv.HurrayArgumentError) as err:
                send(_url(r), chunks(), timeout=timeout)  # type: ignore[operator]
            assert err.value.field == "timeout"
        assert not made and not DirectoryStore(tmp_path).has(ns, key)
        send_chunks(_url(r), chunks(), timeout=10)
        assert DirectoryStore(tmp_path).has(ns, key)
