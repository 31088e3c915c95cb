"""Trust on the wire (:mod:`hurray_vllm.transport.security`): TLS for TCP, and keyed sender authentication."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from blocking import wait_for
from pki import make_pki as _pki

import hurray_vllm as hv
from hurray_vllm import KVSnapshot, transport
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.chunks.keys import chunks_of, namespace_of
from hurray_vllm.chunks.signing import FleetKeys, sign_chunk
from hurray_vllm.chunks.store import DirectoryStore
from hurray_vllm.transport.base import read_message, recv_exact
from hurray_vllm.transport.security import TlsOptions, client_context, server_context

KEYS = FleetKeys.from_secrets(b"s" * 32)
OTHER = FleetKeys.from_secrets(b"t" * 32)


def _chunk(keys: FleetKeys | None = KEYS) -> tuple[str, str, KVSnapshot]:
    ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    ns = namespace_of(chunk.fingerprint)
    return ns, key, sign_chunk(chunk, keys, ns, key) if keys is not None else chunk


@pytest.mark.parametrize("channel", transport.CHANNELS)
def test_a_keyed_receiver_serves_only_senders_that_hold_a_key(channel: str, tmp_path: Path) -> None:
    from conftest import require

    if channel == "nixl":
        require("nixl_cu12")
    ns, key, chunk = _chunk()
    store = DirectoryStore(tmp_path)
    with transport.receiver_for(channel, "127.0.0.1", 0, store, keys=KEYS).start() as r:
        url = f"{channel}://127.0.0.1:{r.address[1]}"
        with pytest.raises(hv.HurrayFormatError, match="fleet key"):
            transport.send_chunks(url, [(ns, key, chunk)])  # no key: refused before any chunk
        with pytest.raises(hv.HurrayFormatError, match="authentication failed"):
            transport.send_chunks(url, [(ns, key, chunk)], keys=OTHER)
        assert not store.has(ns, key) and r.refused == 2 and r.received == 0
        # Rotation: a receiver whose ring holds the sender's key among others takes it.
        r.keys = FleetKeys.from_secrets(b"n" * 32, b"s" * 32)
        transport.send_chunks(url, [(ns, key, chunk)], keys=KEYS)
        assert store.has(ns, key) and r.received == 1


@pytest.mark.parametrize("channel", transport.CHANNELS)
def test_a_keyed_sender_refuses_a_receiver_without_keys(channel: str, tmp_path: Path) -> None:
    """Changed: a receiver without keys used to answer the challenge unchecked and take the chunks.

    A keyed sender now pushes only to a receiver that proves it holds the key (the handshake is mutual), so an
    endpoint without it (a wrong ``hurray_url``, a spoofed address) learns nothing of the chunks, unless it can
    pass the handshake on to some keyed receiver of the fleet: on plain TCP the proofs name no receiver (only
    TLS binds them to one; see hurray_vllm.transport.security).
    """
    from conftest import require

    if channel == "nixl":
        require("nixl_cu12")
    ns, key, chunk = _chunk()
    store = DirectoryStore(tmp_path)
    with transport.receiver_for(channel, "127.0.0.1", 0, store).start() as r:
        with pytest.raises(hv.HurrayFormatError, match="start the receiver with the same key file") as info:
            transport.send_chunks(f"{channel}://127.0.0.1:{r.address[1]}", [(ns, key, chunk)], keys=KEYS, timeout=5)
        assert "holds no fleet key" in str(info.value)
        assert wait_for(lambda: r.refused == 1)
        assert not store.has(ns, key) and r.received == 0 and "receiver.auth" in (r.last_error or "")


# The key handshake, byte for byte (docs/connector.md, "Trust"): written out here, not taken from the module.
_RECV_LABEL = b"hurray-vllm key handshake v2: receiver\0"
_SEND_LABEL = b"hurray-vllm key handshake v2: sender\0"


def _mac(label: bytes, *parts: bytes, secret: bytes = b"s" * 32) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


def _hello(s: socket.socket, nonce: bytes, key_id: bytes | None = None) -> bytes:
    """Send a v2 hello; the receiver's answer: ``b"HP"`` + its nonce + its proof (66 bytes), or ``b"ER"`` ..."""
    s.sendall(b"HVA2" + (key_id if key_id is not None else KEYS.key_id.encode()) + nonce)
    tag = recv_exact(s, 2)
    return tag + (recv_exact(s, 64) if tag == b"HP" else b"")


def test_the_receiver_proves_the_key_first_bound_to_both_nonces(tmp_path: Path) -> None:
    """Sender: magic, key id, nonce Ns; receiver: tag, nonce Cr, HMAC(k, "receiver" label, Ns, Cr); sender: its own."""
    ns, key, chunk = _chunk()
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), keys=KEYS).start() as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=5) as s:
            n_s = os.urandom(32)
            answer = _hello(s, n_s)
            assert answer[:2] == b"HP"
            c_r, proof = answer[2:34], answer[34:]
            assert proof == _mac(_RECV_LABEL, n_s, c_r)  # plain TCP: no TLS binding (empty)
            s.sendall(_mac(_SEND_LABEL, c_r, n_s))
            assert recv_exact(s, 2) == b"OK"
            transport.tcp._send_over(s, [(ns, key, chunk)])
        assert r.received == 1 and r.refused == 0


def test_a_reflected_or_forged_sender_proof_is_refused(tmp_path: Path) -> None:
    """The receiver's own proof, sent back, or one made for the receiver's direction, does not pass as the sender's."""
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), keys=KEYS).start() as r:
        for forge in (
            lambda n_s, c_r, proof: proof,  # reflected
            lambda n_s, c_r, proof: _mac(_RECV_LABEL, c_r, n_s),  # the sender's order, the receiver's label
            lambda n_s, c_r, proof: _mac(_SEND_LABEL, n_s, c_r),  # the sender's label, the receiver's order
            lambda n_s, c_r, proof: _mac(_SEND_LABEL, c_r, n_s, secret=b"t" * 32),  # another key
        ):
            with socket.create_connection(("127.0.0.1", r.address[1]), timeout=5) as s:
                n_s = os.urandom(32)
                answer = _hello(s, n_s)
                s.sendall(forge(n_s, answer[2:34], answer[34:]))
                assert recv_exact(s, 2) == b"ER" and "authentication failed" in read_message(s)
        assert r.refused == 4 and r.received == 0


def test_a_keyed_sender_pushes_nothing_to_an_impostor_without_the_key() -> None:
    """Found by a review: an endpoint without the key answering the old challenge's b"OK" got every chunk."""
    ns, key, chunk = _chunk()
    got: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as lsn:

        def impostor() -> None:
            conn, _ = lsn.accept()
            with conn:
                conn.settimeout(5)
                try:  # either handshake: what it cannot compute, made up, then b"OK"
                    if recv_exact(conn, 4) == b"HVA1":  # the one-way handshake of before
                        recv_exact(conn, 16)
                        conn.sendall(os.urandom(32))
                    else:
                        recv_exact(conn, 48)
                        conn.sendall(b"HP" + os.urandom(64))
                    recv_exact(conn, 32)
                    conn.sendall(b"OK")
                    while data := conn.recv(1 << 16):
                        got.append(data)
                        if b"HVC1" in b"".join(got):
                            conn.sendall(b"OK")
                except (OSError, hv.HurrayFormatError):  # the sender hung up
                    pass

        threading.Thread(target=impostor, daemon=True).start()
        with pytest.raises(hv.HurrayFormatError, match="does not hold the fleet key") as info:
            transport.send_chunks(f"tcp://127.0.0.1:{lsn.getsockname()[1]}", [(ns, key, chunk)], keys=KEYS, timeout=5)
        assert info.value.field == "transport.auth" and "not the receiver asked for" in str(info.value)
    time.sleep(0.1)
    assert b"HVC1" not in b"".join(got)  # no chunk left the sender


def _relay(lsn: socket.socket, serve: ssl.SSLContext, dial: Callable[[], socket.socket]) -> None:
    """A keyless endpoint in the middle: takes a TLS connection with its own (trusted) certificate, pipes its bytes."""
    raw, _ = lsn.accept()
    with serve.wrap_socket(raw, server_side=True) as a, dial() as b:
        pipes = []
        for src, dst in ((a, b), (b, a)):

            def pipe(src: socket.socket = src, dst: socket.socket = dst) -> None:
                try:
                    while data := src.recv(1 << 16):
                        dst.sendall(data)
                except OSError:
                    pass
                for end in (src, dst):
                    with contextlib.suppress(OSError):
                        socket.socket.shutdown(end, socket.SHUT_RDWR)

            pipes.append(threading.Thread(target=pipe, daemon=True))
            pipes[-1].start()
        # Open until either side hangs up (each pipe then shuts both down), not for a fixed time: on a busy
        # machine the exchange outlasted a 3 s sleep, and the relay's sockets closed under the sender's read.
        for p in pipes:
            p.join(timeout=60)


def test_a_relay_between_two_tls_sessions_gets_no_session_on_the_receiver(tmp_path: Path) -> None:
    """Found by a review: a keyless endpoint with any certificate the sender trusts relayed the handshake.

    The proofs cover the receiver's certificate (RFC 5929 tls-server-end-point): the sender sees the relay's, the
    receiver its own, so neither proof passes across the relay.
    """
    ns, key, chunk = _chunk()
    fleet = _pki(tmp_path, "fleet")
    relay_cert = _pki(tmp_path, "relay")
    store = DirectoryStore(tmp_path / "store")
    # Both certificates signed by CAs the sender trusts (two CAs in its bundle).
    bundle = tmp_path / "bundle.pem"
    bundle.write_text(Path(fleet["ca"]).read_text() + Path(relay_cert["ca"]).read_text())
    trusted = client_context(TlsOptions(ca_file=str(bundle)))
    tls = server_context(TlsOptions(fleet["cert"], fleet["key"]))
    with transport.receiver_for("tcp", "127.0.0.1", 0, store, tls=tls, keys=KEYS, timeout=5).start() as r:
        with socket.create_server(("127.0.0.1", 0)) as lsn:

            def to_receiver() -> socket.socket:
                raw = socket.create_connection(("127.0.0.1", r.address[1]), timeout=5)
                return trusted.wrap_socket(raw, server_hostname="127.0.0.1")

            relay = server_context(TlsOptions(relay_cert["cert"], relay_cert["key"]))
            threading.Thread(target=_relay, args=(lsn, relay, to_receiver), daemon=True).start()
            url = f"tls://127.0.0.1:{lsn.getsockname()[1]}"
            with pytest.raises(hv.HurrayFormatError, match="not the receiver asked for"):
                transport.send_chunks(url, [(ns, key, chunk)], keys=KEYS, tls=trusted, timeout=5)
        assert not store.has(ns, key) and r.received == 0
        # Directly, the same sender and receiver agree.
        transport.send_chunks(f"tls://127.0.0.1:{r.address[1]}", [(ns, key, chunk)], keys=KEYS, tls=trusted)
        assert store.has(ns, key)


def test_a_keyed_tls_receiver_refuses_a_sender_proof_made_for_another_session(tmp_path: Path) -> None:
    """The receiver checks the binding too: a proof for plain TCP (or another certificate) does not pass over TLS."""
    fleet = _pki(tmp_path, "fleet")
    tls = server_context(TlsOptions(fleet["cert"], fleet["key"]))
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), tls=tls, keys=KEYS).start() as r:
        ctx = client_context(TlsOptions(ca_file=fleet["ca"]))
        for binding_of in (lambda s: b"", lambda s: hashlib.sha256(s.getpeercert(True)).digest()):
            raw = socket.create_connection(("127.0.0.1", r.address[1]), timeout=5)
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                n_s, binding = os.urandom(32), hashlib.sha256(s.getpeercert(True)).digest()
                answer = _hello(s, n_s)
                c_r = answer[2:34]
                assert answer[34:] == _mac(_RECV_LABEL, n_s, c_r, binding)  # bound to its certificate
                s.sendall(_mac(_SEND_LABEL, c_r, n_s, binding_of(s)))
                assert recv_exact(s, 2) == (b"ER" if binding_of(s) == b"" else b"OK")
        assert r.refused == 1


def test_a_tls_context_made_elsewhere_is_bound_to_the_certificate_it_presents(tmp_path: Path) -> None:
    """A receiver's context not made by server_context: its certificate is found by a handshake in memory."""
    ns, key, chunk = _chunk()
    fleet, client = _pki(tmp_path, "fleet"), _pki(tmp_path, "client")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(fleet["cert"], fleet["key"])
    store = DirectoryStore(tmp_path / "store")
    with transport.receiver_for("tcp", "127.0.0.1", 0, store, tls=ctx, keys=KEYS).start() as r:
        trusted = client_context(TlsOptions(ca_file=fleet["ca"]))
        transport.send_chunks(f"tls://127.0.0.1:{r.address[1]}", [(ns, key, chunk)], keys=KEYS, tls=trusted)
        assert store.has(ns, key)
    # One whose certificate cannot be found so (client certificates required, no TLS 1.3): refused at the start.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(fleet["cert"], fleet["key"])
    ctx.load_verify_locations(client["ca"])
    ctx.verify_mode, ctx.maximum_version = ssl.CERT_REQUIRED, ssl.TLSVersion.TLSv1_2
    with pytest.raises(hv.HurrayArgumentError, match="server_context"):
        transport.receiver_for("tcp", "127.0.0.1", 0, store, tls=ctx, keys=KEYS)
    transport.receiver_for("tcp", "127.0.0.1", 0, store, tls=ctx).stop()  # without keys it needs none


def test_peers_of_the_older_one_way_handshake_are_told_to_upgrade(tmp_path: Path) -> None:
    """No silent fallback: a v1 sender (b"HVA1") is refused by name, and a v2 sender names a v1 receiver's age."""
    old_label = b"hurray-vllm sender auth v1\0"
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), keys=KEYS).start() as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=5) as s:  # what a v1 sender does
            s.sendall(b"HVA1" + KEYS.key_id.encode())
            challenge = recv_exact(s, 32)
            s.sendall(_mac(old_label, challenge))
            assert recv_exact(s, 2) == b"ER"  # what its read_answer reports
            message = read_message(s)
        assert "v1" in message and "same hurray-vllm version" in message
        assert r.refused == 1 and "v1" in (r.last_error or "")
    # A v1 receiver, keyed (it refuses anything but b"HVA1") and without keys (it takes b"HVA2" for a bad frame).
    v1_keyed = b"receiver.auth: this receiver takes chunks only from senders holding the fleet key " + (
        b"(hurray_key_file, HURRAY_VLLM_KEY_FILE or --key-file)"
    )
    for answer, says in ((b"ER" + len(v1_keyed).to_bytes(2, "little") + v1_keyed, "older hurray-vllm"),
                         (b"", "older hurray-vllm")):  # fmt: skip
        with socket.create_server(("127.0.0.1", 0)) as lsn:

            def old_receiver(answer: bytes = answer) -> None:
                conn, _ = lsn.accept()
                with conn:
                    recv_exact(conn, 4)
                    conn.sendall(answer)
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_WR)
                        while conn.recv(1 << 16):
                            pass

            threading.Thread(target=old_receiver, daemon=True).start()
            ns, key, chunk = _chunk()
            with pytest.raises((hv.HurrayFormatError, OSError), match=says) as info:
                transport.send_chunks(f"tcp://127.0.0.1:{lsn.getsockname()[1]}", [(ns, key, chunk)], keys=KEYS)
            assert "v1" in str(info.value)


def test_a_receivers_trickled_handshake_answer_holds_a_keyed_sender_one_timeout_in_all() -> None:
    """Found by a review: the challenge was read without a deadline (a byte per 0.8 timeout: 12.8 s for 0.5 s)."""
    ns, key, chunk = _chunk()
    with socket.create_server(("127.0.0.1", 0)) as lsn:

        def trickle() -> None:
            conn, _ = lsn.accept()
            with conn, contextlib.suppress(OSError):
                for byte in b"HP" + bytes(64):
                    time.sleep(0.3)
                    conn.sendall(bytes([byte]))

        threading.Thread(target=trickle, daemon=True).start()
        start = time.monotonic()
        with pytest.raises(OSError):  # TimeoutError
            transport.send_chunks(f"tcp://127.0.0.1:{lsn.getsockname()[1]}", [(ns, key, chunk)], keys=KEYS,
                                  timeout=0.5)  # fmt: skip
        assert time.monotonic() - start < 2.0


def test_a_keyed_sender_reports_a_refusal_sent_before_the_handshake(tmp_path: Path) -> None:
    """Found by a review: a receiver at max_connections answers ER at once; a keyed sender read it as its challenge.

    The slot is held by an authenticated connection: one still in its handshakes would give it up.
    """
    from hurray_vllm.transport.security import authenticate

    ns, key, chunk = _chunk()
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), keys=KEYS,
                                max_connections=1).start() as r:  # fmt: skip
        with socket.create_connection(("127.0.0.1", r.address[1])) as held:  # the one slot
            authenticate(held, KEYS, timeout=10)
            assert wait_for(lambda: len(r._conns) == 1 and not r._unproven)
            with pytest.raises(hv.HurrayFormatError, match=r"receiver\.connections: more than 1 connections"):
                transport.send_chunks(f"tcp://127.0.0.1:{r.address[1]}", [(ns, key, chunk)], keys=KEYS, timeout=5)


def test_a_probe_that_connects_and_closes_is_no_refusal(tmp_path: Path) -> None:
    """Found by a review: a keyed (or TLS) receiver counted a health check's bare connect as a refused chunk."""
    server = _pki(tmp_path, "server")
    tls = server_context(TlsOptions(server["cert"], server["key"]))
    for limits in ({"keys": KEYS}, {"tls": tls}, {"keys": KEYS, "tls": tls}):
        with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), **limits).start() as r:
            for _ in range(3):
                socket.create_connection(("127.0.0.1", r.address[1])).close()
            assert wait_for(lambda r=r: not r._conns)
            assert r.refused == 0 and r.last_error is None, limits


def test_stop_during_a_tls_handshake_ends_it_at_once(tmp_path: Path) -> None:
    """Found by a review: wrap_socket handshook before the TLS socket was registered: stop() waited 10 s for it."""
    server = _pki(tmp_path, "server")
    tls = server_context(TlsOptions(server["cert"], server["key"]))
    r = transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), tls=tls, timeout=30).start()
    with socket.create_connection(("127.0.0.1", r.address[1])) as s:
        s.sendall(b"\x16\x03\x01\x00\xff")  # the head of a ClientHello, then silence
        assert wait_for(lambda: len(r._conns) == 1)
        time.sleep(0.2)
        start = time.monotonic()
        r.stop()
        assert time.monotonic() - start < 2.0
        assert not any(t.is_alive() for t in r._threads)


def test_a_chunk_refused_at_its_head_over_tls_reaches_the_sender_as_the_refusal(tmp_path: Path) -> None:
    """Found by a review: over TLS the broken write is an ssl.SSLEOFError, and the receiver's reason was lost."""
    from synthetic import make_snapshot

    server = _pki(tmp_path, "server")
    tls = server_context(TlsOptions(server["cert"], server["key"]))
    snap = make_snapshot([4096], [0], 16, heads=8, dim=128, layers=2)  # 32 MiB
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), tls=tls, timeout=5,
                                max_chunk_bytes=1 << 20).start() as r:  # fmt: skip
        trusted = client_context(TlsOptions(ca_file=server["ca"]))
        with pytest.raises(hv.HurrayFormatError, match="exceeds the limit") as info:
            transport.send_chunks(f"tls://127.0.0.1:{r.address[1]}", [("ab" * 8, "cd" * 8, snap)], tls=trusted,
                                  timeout=10)  # fmt: skip
        assert "receiver refused" in str(info.value)


@pytest.mark.parametrize("keys", [None, KEYS])
def test_a_url_whose_scheme_does_not_match_the_receivers_tls_says_so(tmp_path: Path, keys: FleetKeys | None) -> None:
    """Found by a review: tcp:// to a TLS receiver and tls:// to a plain one were a bare ConnectionResetError."""
    ns, key, chunk = _chunk()
    server = _pki(tmp_path, "server")
    tls = server_context(TlsOptions(server["cert"], server["key"]))
    trusted = client_context(TlsOptions(ca_file=server["ca"]))
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path / "a"), tls=tls, keys=keys).start() as r:
        with pytest.raises(hv.HurrayFormatError, match=r"tls://") as info:
            transport.send_chunks(f"tcp://127.0.0.1:{r.address[1]}", [(ns, key, chunk)], keys=keys, timeout=5)
        assert "receiver.tls" in str(info.value)
        assert wait_for(lambda: r.refused == 1)
        assert "receiver.tls" in (r.last_error or "")
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path / "b"), keys=keys).start() as r:
        with pytest.raises(OSError, match=r"does the receiver use TLS\? \(tls:// vs tcp://\)"):
            transport.send_chunks(f"tls://127.0.0.1:{r.address[1]}", [(ns, key, chunk)], keys=keys, tls=trusted,
                                  timeout=5)  # fmt: skip


def test_a_forged_handshake_response_is_refused(tmp_path: Path) -> None:
    """A peer that knows the key id (it is public) but not the secret cannot answer the receiver's nonce."""
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), keys=KEYS).start() as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=5) as s:
            answer = _hello(s, os.urandom(32))
            s.sendall(answer[2:34])  # echoing the receiver's nonce, or anything else without the secret
            assert recv_exact(s, 2) == b"ER"
        assert r.refused == 1 and "authentication failed" in (r.last_error or "")


@pytest.mark.parametrize("key_id", [b"\xff" * 16, "\u0660".encode() * 8, b"Z" * 16, b"0" * 16])
def test_a_key_id_that_is_not_one_is_refused_as_an_unknown_key(tmp_path: Path, key_id: bytes) -> None:
    """Non-ASCII text reached hmac.compare_digest, whose TypeError killed the connection unanswered.

    An unknown key id is refused before the receiver proves anything (it has no key to prove with).
    """
    assert KEYS.secret_for(key_id.decode("ascii", "replace")) is None
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), keys=KEYS).start() as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=5) as s:
            assert _hello(s, os.urandom(32), key_id[:16]) == b"ER"
            assert "not one of this receiver's fleet keys" in read_message(s)
        assert r.refused == 1 and "authentication failed" in (r.last_error or "")


def test_a_mac_whose_key_id_is_not_one_is_refused_naming_the_mac(tmp_path: Path) -> None:
    """int(.., 16) takes other scripts' digits: such a key id was let through to compare_digest."""
    from dataclasses import replace

    from hurray_vllm.chunks.signing import MAC_KEY, check_signature

    ns, key, chunk = _chunk()
    scheme, _kid, nonce, tag = chunk.extra[MAC_KEY].split(":")
    forged = replace(chunk, extra={**chunk.extra, MAC_KEY: ":".join([scheme, "\u0660" * 16, nonce, tag])})
    with pytest.raises(hv.HurrayFormatError) as info:
        check_signature(forged, KEYS, ns, key)
    assert info.value.field == "snapshot.mac"
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), keys=KEYS).start() as r:
        with pytest.raises(hv.HurrayFormatError, match=r"snapshot\.mac"):
            transport.send_chunks(f"tcp://127.0.0.1:{r.address[1]}", [(ns, key, forged)], keys=KEYS)
        assert r.received == 0 and r.refused == 1


def test_tls_pushes_verify_the_receiver_and_a_tls_receiver_refuses_plaintext(tmp_path: Path) -> None:
    ns, key, chunk = _chunk(None)
    server, rogue = _pki(tmp_path, "fleet"), _pki(tmp_path, "rogue")
    store = DirectoryStore(tmp_path / "store")
    tls = server_context(TlsOptions(server["cert"], server["key"]))
    with transport.receiver_for("tcp", "127.0.0.1", 0, store, tls=tls).start() as r:
        port = r.address[1]
        trusted = client_context(TlsOptions(ca_file=server["ca"]))
        transport.send_chunks(f"tls://127.0.0.1:{port}", [(ns, key, chunk)], tls=trusted)
        assert store.has(ns, key) and r.received == 1
        # Plaintext to a TLS receiver: refused (the handshake fails), nothing stored.
        with pytest.raises((hv.HurrayFormatError, OSError)):
            transport.send_chunks(f"tcp://127.0.0.1:{port}", [(ns, "ab" * 8, chunk)], timeout=5)
        # A receiver the sender's CA did not sign (the wrong CA): the push fails on the sender's side.
        with pytest.raises(ssl.SSLCertVerificationError):
            transport.send_chunks(
                f"tls://127.0.0.1:{port}", [(ns, "cd" * 8, chunk)], tls=client_context(TlsOptions(ca_file=rogue["ca"]))
            )
        assert not store.has(ns, "ab" * 8) and not store.has(ns, "cd" * 8)
        deadline = time.monotonic() + 5  # the receiver's side of the aborted handshake ends on its own thread
        while r.refused < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.refused == 2 and "receiver.tls" in (r.last_error or "")


def test_mutual_tls_requires_a_client_certificate_of_the_client_ca(tmp_path: Path) -> None:
    ns, key, chunk = _chunk(None)
    server, client, rogue = _pki(tmp_path, "server"), _pki(tmp_path, "client"), _pki(tmp_path, "rogue")
    tls = server_context(TlsOptions(server["cert"], server["key"], client_ca_file=client["ca"]))
    store = DirectoryStore(tmp_path / "store")
    with transport.receiver_for("tcp", "127.0.0.1", 0, store, tls=tls).start() as r:
        url = f"tls://127.0.0.1:{r.address[1]}"
        for who in (None, rogue):
            opts = TlsOptions(ca_file=server["ca"], cert_file=who["cert"] if who else None,
                              key_file=who["key"] if who else None)  # fmt: skip
            with pytest.raises((hv.HurrayFormatError, OSError)):
                transport.send_chunks(url, [(ns, key, chunk)], tls=client_context(opts), timeout=5)
        assert not store.has(ns, key)
        opts = TlsOptions(ca_file=server["ca"], cert_file=client["cert"], key_file=client["key"])
        transport.send_chunks(url, [(ns, key, chunk)], tls=client_context(opts))  # a keyless receiver: no key
        assert store.has(ns, key)


def test_tls_options_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(hv.HurrayArgumentError, match="certificate and its private key"):
        server_context(TlsOptions(cert_file="x.pem"))
    with pytest.raises(hv.HurrayArgumentError, match="cannot load certificate"):
        server_context(TlsOptions(cert_file=str(tmp_path / "no.pem"), key_file=str(tmp_path / "no.key")))
    with pytest.raises(hv.HurrayArgumentError, match="CA bundle"):
        client_context(TlsOptions(ca_file=str(tmp_path / "no-ca.pem")))
    with pytest.raises(hv.HurrayArgumentError, match="tls"):
        transport.receiver_for("nixl", "127.0.0.1", 0, DirectoryStore(tmp_path), tls=ssl.create_default_context())
    assert transport.channel_of("tls://h:1") == "tcp"


def test_a_keyless_peer_trickling_the_key_handshake_over_tls_is_cut_at_the_deadline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """TLS moves the connection to a new socket: the handshake's deadline must follow it there (and stop())."""
    import logging

    server = _pki(tmp_path, "server")
    tls = server_context(TlsOptions(server["cert"], server["key"]))
    caplog.set_level(logging.WARNING, logger="hurray_vllm.transport")
    # A byte every 0.25 s against 3 s per recv: only a 3 s stall of this test would let the socket timeout cut it.
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), tls=tls, keys=KEYS,
                                timeout=3.0).start() as r:  # fmt: skip
        ctx = client_context(TlsOptions(ca_file=server["ca"]))
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                start, closed = time.monotonic(), False
                for byte in b"HVA2" + b"0" * 48:  # each byte well inside the socket timeout
                    try:
                        s.sendall(bytes([byte]))
                        time.sleep(0.25)
                    except OSError:
                        closed = True
                        break
                    if time.monotonic() - start > 60:  # a hang guard, not a timing
                        break
                if not closed:  # the receiver shut its side: the next read ends
                    try:
                        closed = s.recv(1) == b""
                    except OSError:
                        closed = True
                assert closed  # 3 s, then the watchdog's next look: cut by the watchdog, not by a recv's timeout
                assert "closing a connection whose frame is overdue" in caplog.text
        assert r.refused >= 1 and r.received == 0  # the watchdog's timeout, then the cut handshake
        with r._mu:
            assert not r._conns and not r._deadlines  # nothing of the connection is left behind


def test_a_failed_second_authentication_is_answered_and_counted(tmp_path: Path) -> None:
    """A connection that authenticated, then fails to again mid-connection, was closed unanswered and uncounted."""
    from hurray_vllm.transport.security import authenticate

    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), keys=KEYS).start() as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=5) as s:
            authenticate(s, KEYS)  # the first time, right
            assert _hello(s, os.urandom(32))[:2] == b"HP"
            s.sendall(bytes(32))  # not the answer
            assert recv_exact(s, 2) == b"ER" and read_message(s).startswith("receiver.auth:")
        assert r.refused == 1 and "authentication failed" in (r.last_error or "")


@pytest.mark.parametrize("channel", transport.CHANNELS)
def test_peers_without_the_key_cannot_hold_every_slot_of_a_keyed_receiver(channel: str, tmp_path: Path) -> None:
    """Found by a review: silent connections, each cut at the handshake deadline and reopened, kept a keyed
    receiver full (60 keyed pushes refused in 30 s). A full receiver now gives the oldest connection still in its
    handshakes up to a newcomer."""
    from conftest import require

    if channel == "nixl":
        require("nixl_cu12")
    with transport.receiver_for(channel, "127.0.0.1", 0, DirectoryStore(tmp_path), keys=KEYS, timeout=60.0,
                                max_connections=2).start() as r:  # fmt: skip
        silent = [socket.create_connection(("127.0.0.1", r.address[1]), timeout=30) for _ in range(2)]
        try:
            assert wait_for(lambda: len(r._conns) == 2, 10)  # both slots held, neither has said a word
            ns, key, chunk = _chunk()
            start = time.monotonic()
            transport.send_chunks(f"{channel}://127.0.0.1:{r.address[1]}", [(ns, key, chunk)], keys=KEYS, timeout=10)
            assert r.received == 1 and time.monotonic() - start < 5  # not after the handshake deadline (10 s)
            try:
                cut = silent[0].recv(2) in (b"", b"ER")  # the oldest silent one gave its slot up
            except OSError:
                cut = True
            assert cut
        finally:
            for s in silent:
                s.close()


def test_a_silent_connection_to_a_keyed_receiver_is_cut_at_the_handshake_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unauthenticated connection holds one of max_connections: it gets the short handshake deadline, not a frame's.

    With the frame timeout (60 s) a keyless peer opening max_connections silent connections locked every
    sender out for a minute per round.
    """
    from hurray_vllm.transport import base

    monkeypatch.setattr(base, "HANDSHAKE_TIMEOUT_S", 0.5)
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), keys=KEYS, timeout=60.0,
                                max_connections=1).start() as r:  # fmt: skip
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=30) as s:
            start = time.monotonic()
            try:
                closed = s.recv(2) in (b"", b"ER")  # silent: the receiver cuts it (an answer or the close)
            except OSError:
                closed = True
            assert closed and time.monotonic() - start < 20  # the frame timeout (60 s) would cut it far later
        assert wait_for(lambda: not r._conns, 10)  # the slot is free again
        ns, key, chunk = _chunk()
        transport.send_chunks(f"tcp://127.0.0.1:{r.address[1]}", [(ns, key, chunk)], keys=KEYS, timeout=10)
        assert r.received == 1
