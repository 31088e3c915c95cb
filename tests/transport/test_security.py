"""Trust on the wire (:mod:`hurray_vllm.transport.security`): TLS for TCP, and keyed sender authentication."""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path

import pytest
from pki import make_pki as _pki

import hurray_vllm as hv
from hurray_vllm import KVSnapshot, transport
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.chunks.keys import chunks_of, namespace_of
from hurray_vllm.chunks.signing import FleetKeys, sign_chunk
from hurray_vllm.chunks.store import DirectoryStore
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


def test_a_receiver_without_keys_takes_keyed_senders_as_before(tmp_path: Path) -> None:
    ns, key, chunk = _chunk()
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path)).start() as r:
        transport.send_chunks(f"tcp://127.0.0.1:{r.address[1]}", [(ns, key, chunk)], keys=KEYS)
        assert r.received == 1


def test_a_forged_handshake_response_is_refused(tmp_path: Path) -> None:
    """A peer that knows the key id (it is public) but not the secret cannot answer the challenge."""
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), keys=KEYS).start() as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=5) as s:
            s.sendall(b"HVA1" + KEYS.key_id.encode())
            challenge = b""
            while len(challenge) < 32:
                challenge += s.recv(32 - len(challenge))
            s.sendall(challenge)  # echoing the challenge, or anything else without the secret
            assert s.recv(2) == b"ER"
        assert r.refused == 1 and "authentication failed" in (r.last_error or "")


@pytest.mark.parametrize("key_id", [b"\xff" * 16, "\u0660".encode() * 8, b"Z" * 16])
def test_a_key_id_that_is_not_one_is_refused_as_an_unknown_key(tmp_path: Path, key_id: bytes) -> None:
    """Non-ASCII text reached hmac.compare_digest, whose TypeError killed the connection unanswered."""
    assert KEYS.secret_for(key_id.decode("ascii", "replace")) is None
    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), keys=KEYS).start() as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=5) as s:
            s.sendall(b"HVA1" + key_id[:16])
            challenge = b""
            while len(challenge) < 32:
                challenge += s.recv(32 - len(challenge))
            s.sendall(bytes(32))
            assert s.recv(2) == b"ER"
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
        transport.send_chunks(url, [(ns, key, chunk)], tls=client_context(opts), keys=KEYS)
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
                for byte in b"HVA1" + b"0" * 48:  # each byte well inside the socket timeout
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
    from hurray_vllm.transport.base import read_message, recv_exact
    from hurray_vllm.transport.security import authenticate

    with transport.receiver_for("tcp", "127.0.0.1", 0, DirectoryStore(tmp_path), keys=KEYS).start() as r:
        with socket.create_connection(("127.0.0.1", r.address[1]), timeout=5) as s:
            authenticate(s, KEYS)  # the first time, right
            s.sendall(b"HVA1" + KEYS.key_id.encode())
            recv_exact(s, 32)  # the challenge
            s.sendall(bytes(32))  # not the answer
            assert recv_exact(s, 2) == b"ER" and read_message(s).startswith("receiver.auth:")
        assert r.refused == 1 and "authentication failed" in (r.last_error or "")
