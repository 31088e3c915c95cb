"""Who may push chunks: TLS for the TCP channel, and a mutual key handshake between a keyed sender and receiver.

Two independent layers, both off by default:

* **TLS** (``tls://HOST:PORT``): the TCP channel inside the standard
  library's :mod:`ssl`, TLS 1.2 or later. The receiver presents a
  certificate (:class:`TlsOptions` ``cert_file``/``key_file``) and refuses
  plaintext; with ``client_ca_file`` it also requires client certificates
  signed by that CA (mutual TLS). The sender verifies the receiver against
  ``ca_file`` (default: the system's CAs) and the host name in the URL.
* **The key handshake** with the fleet key (:mod:`hurray_vllm.chunks.signing`),
  on TCP, TLS and NIXL's side channel alike. Each side proves that it holds
  the key, the receiver first. A keyed sender opens every connection with::

      sender:   b"HVA2"  key id (16 ASCII hex digits)  Ns (32 random bytes)
      receiver: b"HP"  Cr (32 random bytes)  HMAC-SHA256(k, RECV || Ns || Cr || B)
                (or b"ER" + u16 length + UTF-8 message, and it closes)
      sender:   HMAC-SHA256(k, SEND || Cr || Ns || B)
      receiver: b"OK"  (or b"ER" + u16 length + message, and it closes)

  ``k`` is the secret whose id the sender named (the first of its ring);
  ``RECV`` and ``SEND`` are the labels ``"hurray-vllm key handshake v2:
  receiver" NUL`` and ``"... v2: sender" NUL`` (one per direction: neither
  proof passes for the other; no other HMAC of hurray-vllm starts so).
  ``B`` binds the proofs to the TLS session's server: SHA-256 of the
  receiver's certificate (DER), as RFC 5929's ``tls-server-end-point``
  (always SHA-256): the sender takes the certificate it was shown, the
  receiver its own. On plain TCP (and NIXL's side channel) ``B`` is empty.

  A keyed sender sends nothing else until the receiver's proof checks out:
  an endpoint without the key (a wrong URL, a spoofed address) gets no
  chunk unless it can reach some keyed receiver of the fleet, and the sender
  is told that the receiver does not hold the fleet key or is not the
  receiver asked for. On plain TCP (and NIXL's side channel) the proofs name
  no receiver: a keyless endpoint at the address dialed can pass the
  sender's hello to any keyed receiver it reaches, return that receiver's
  proof, and then read the chunks (and answer "stored" or "held" without
  storing). The key proves membership of the fleet, not which member: where
  the address itself is not trusted, use TLS, whose binding names the
  receiver's certificate. A receiver with keys requires the
  handshake of every connection; one without keys refuses it (``ER``: start
  the receiver with the same key file). Over TLS, an endpoint relaying the
  handshake between two sessions fails it (the certificates differ). Over
  plain TCP a relay **on the path** between sender and receiver cannot be
  told apart (it passes every byte, proofs included, and can read and change
  what follows): only TLS stops that.

  Peers of another handshake version are refused by name, not served by a
  weaker fallback: the one-way ``b"HVA1"`` handshake of older hurray-vllm
  (only the sender proved the key, unbound to TLS) is answered with a
  refusal its sender reports, and a v2 sender says so when an older
  receiver refuses or drops its hello. Chunks are signed besides (a keyed
  receiver stores only signed ones): the handshake keeps unauthenticated
  peers from using a receiver's disk, bandwidth and connection slots, and
  keeps a keyed sender's chunks from peers without the key.

NIXL's data path (UCX) is not covered by either: it writes into memory the
receiver registered for an authenticated offer, and relies on the fabric's
isolation; the chunk MAC is checked after the writes, before anything is
stored.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import socket
import ssl
import time
import weakref
from dataclasses import dataclass

from ..chunks.signing import FleetKeys
from ..errors import HurrayArgumentError, HurrayFormatError

__all__ = [
    "AUTH_MAGIC",
    "V1_AUTH_MAGIC",
    "PROOF_TAG",
    "TlsOptions",
    "answer_handshake",
    "authenticate",
    "client_context",
    "peer_binding",
    "refuse_v1_handshake",
    "server_binding",
    "server_context",
]

#: What a keyed sender opens a connection with (the key handshake, version 2).
AUTH_MAGIC = b"HVA2"
#: The one-way sender authentication of older hurray-vllm: refused, naming the version.
V1_AUTH_MAGIC = b"HVA1"
#: The receiver's answer to a hello: its nonce and its proof follow.
PROOF_TAG = b"HP"
_RECV_LABEL = b"hurray-vllm key handshake v2: receiver\0"
_SEND_LABEL = b"hurray-vllm key handshake v2: sender\0"
_NONCE = 32
_PROOF = 32
_KEY_ID = 16
#: What a v1 sender takes for its 32-byte challenge before it reads the refusal.
_V1_FILLER = b"hurray-vllm: key handshake v2 \0\0"
#: How a v1 receiver with keys refuses anything but ``b"HVA1"``: a v2 sender that reads it names the version.
_V1_KEYED_REFUSAL = "this receiver takes chunks only from senders holding the fleet key"
_SAME_VERSION = "run the same hurray-vllm version on the sender and the receiver"
_KEY_FILES = "hurray_key_file, HURRAY_VLLM_KEY_FILE or --key-file"
#: Each server context's binding (SHA-256 of its certificate), as :func:`server_context` loaded it.
_BINDINGS: weakref.WeakKeyDictionary[ssl.SSLContext, bytes] = weakref.WeakKeyDictionary()
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


@dataclass(frozen=True)
class TlsOptions:
    """TLS settings of a receiver (``cert_file``, ``key_file``, optional ``client_ca_file``) or a sender.

    A sender uses ``ca_file`` (the CA bundle to verify receivers with;
    ``None``: the system's) and, for mutual TLS, ``cert_file``/``key_file``
    as its client certificate.

    Example:
        >>> TlsOptions(cert_file="server.pem", key_file="server.key").server_side
        True
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    client_ca_file: str | None = None

    @property
    def server_side(self) -> bool:
        """Whether these options can serve (a certificate and its key are given)."""
        return self.cert_file is not None and self.key_file is not None


def _load_chain(ctx: ssl.SSLContext, cert: str | None, key: str | None, field: str) -> None:
    if (cert is None) != (key is None):
        raise HurrayArgumentError(field, "a TLS certificate needs its private key, and the key its certificate")
    if cert is not None:
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise HurrayArgumentError(field, f"cannot load certificate {cert} with key {key}: {exc}") from None


def server_context(opts: TlsOptions) -> ssl.SSLContext:
    """The receiver's TLS context: its certificate, TLS >= 1.2, client certificates required with ``client_ca_file``.

    Raises:
        HurrayArgumentError: no certificate or key, or one that cannot be loaded (field ``tls``).
    """
    if not opts.server_side:
        raise HurrayArgumentError("tls", "a TLS receiver needs a certificate and its private key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, opts.cert_file, opts.key_file, "tls")
    _record_binding(ctx, opts.cert_file)
    if opts.client_ca_file is not None:
        try:
            ctx.load_verify_locations(opts.client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise HurrayArgumentError("tls", f"cannot load client CA {opts.client_ca_file}: {exc}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(opts: TlsOptions | None = None) -> ssl.SSLContext:
    """A sender's TLS context: verifies the receiver against ``ca_file`` (or the system's CAs) and its host name.

    Raises:
        HurrayArgumentError: a CA bundle or client certificate that cannot be loaded (field ``tls``).
    """
    opts = opts or TlsOptions()
    try:
        ctx = ssl.create_default_context(cafile=opts.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise HurrayArgumentError("tls", f"cannot load CA bundle {opts.ca_file}: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, opts.cert_file, opts.key_file, "tls")
    return ctx


def _record_binding(ctx: ssl.SSLContext, cert_file: str | None) -> None:
    """Note the SHA-256 of the certificate ``ctx`` presents: the first in ``cert_file`` (``load_cert_chain``'s leaf)."""
    try:
        with open(cert_file or "", "rb") as f:
            found = _PEM_CERT.search(f.read())
    except OSError:  # loaded a moment ago: gone meanwhile. server_binding() asks the context itself
        return
    if found is not None:
        try:
            der = ssl.PEM_cert_to_DER_cert(found.group().decode("ascii"))
        except ValueError:  # not one OpenSSL read as the leaf, then: server_binding() asks the context
            return
        _BINDINGS[ctx] = hashlib.sha256(der).digest()


def server_binding(ctx: ssl.SSLContext) -> bytes | None:
    """The key handshake's TLS binding for a receiver with ``ctx``: SHA-256 of its certificate; ``None`` if unknown.

    A context from :func:`server_context` knows its certificate; of another, the certificate is found by one TLS
    handshake with it in memory (once: the result is kept). ``None`` when that fails too (a context that
    requires client certificates and speaks no TLS 1.3).
    """
    known = _BINDINGS.get(ctx)
    if known is not None:
        return known
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = probe.wrap_bio(to_client, to_server, server_hostname="localhost")
    out = ssl.MemoryBIO()
    server = ctx.wrap_bio(to_server, out, server_side=True)
    for _ in range(8):  # TLS 1.3 needs two flights each way, 1.2 three
        for side in (client, server):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError:
                return None
        to_client.write(out.read())
        try:
            der = client.getpeercert(binary_form=True)
        except ValueError:  # not done yet
            continue
        if der is None:
            return None
        _BINDINGS[ctx] = digest = hashlib.sha256(der).digest()
        return digest
    return None


def peer_binding(sock: socket.socket) -> bytes:
    """A sender's TLS binding for ``sock``: SHA-256 of the certificate the receiver presented; empty on plain TCP."""
    if not isinstance(sock, ssl.SSLSocket):
        return b""
    der = sock.getpeercert(binary_form=True)
    if der is None:  # every TLS server the sender verified presented one; anonymous suites are off
        raise HurrayFormatError("transport.auth", "the TLS receiver presented no certificate to bind the key to")
    return hashlib.sha256(der).digest()


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes, binding: bytes) -> bytes:
    return hmac.new(secret, label + first + second + binding, hashlib.sha256).digest()


def _closed_hint(sock: socket.socket) -> str:
    tls = "" if isinstance(sock, ssl.SSLSocket) else "; or does the receiver use TLS? (tls:// vs tcp://)"
    return (
        "an older hurray-vllm receiver without a fleet key (key handshake v1) hangs up on this sender's v2 "
        f"handshake: start it with the same key file and {_SAME_VERSION}{tls}"
    )


def authenticate(sock: socket.socket, keys: FleetKeys, timeout: float | None = None) -> None:
    """Sender side: the key handshake on ``sock``; returns once the receiver proved the key and took this sender's.

    Called once per connection, before the first frame. The whole handshake takes ``timeout`` seconds at most
    (default: the socket's timeout), however the receiver trickles its answers. Nothing is sent before the
    receiver's proof checks out.

    Raises:
        HurrayFormatError: field ``transport``: the receiver refused (its message says why: no fleet key, another
            key, too many connections, TLS expected); field ``transport.auth``: the receiver did not prove that it
            holds the fleet key (a receiver without it, another fleet's, a relay, or an older hurray-vllm).
        OSError: the connection failed, or no answer within the time (``TimeoutError``).
    """
    from .base import read_message, recv_exact

    timeout = sock.gettimeout() if timeout is None else timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    binding = peer_binding(sock)
    secret = keys.secrets[0]
    n_s = os.urandom(_NONCE)
    sock.sendall(AUTH_MAGIC + keys.key_id.encode() + n_s)
    try:
        tag = recv_exact(sock, len(PROOF_TAG), deadline)
    except HurrayFormatError:
        raise HurrayFormatError(
            "transport.auth",
            f"the receiver closed the connection instead of answering the key handshake: {_closed_hint(sock)}",
        ) from None
    except (ConnectionResetError, BrokenPipeError) as lost:
        raise type(lost)(lost.errno, f"{lost.strerror} during the key handshake: {_closed_hint(sock)}") from lost
    if tag == b"ER":
        message = read_message(sock, deadline)
        if _V1_KEYED_REFUSAL in message:  # what only a v1 receiver answers a v2 hello
            message += f" (so answers a receiver of an older hurray-vllm, whose key handshake is v1: {_SAME_VERSION})"
        raise HurrayFormatError("transport", f"receiver refused the key handshake: {message}")
    if tag != PROOF_TAG:
        raise HurrayFormatError(
            "transport.auth",
            f"the receiver answered {tag!r} to the key handshake, not a proof that it holds the fleet key: it does "
            f"not hold the fleet key, or is not the receiver asked for, or is a hurray-vllm of another version (key "
            f"handshake v1): check the URL, start the receiver with the same key file and {_SAME_VERSION}",
        )
    answer = recv_exact(sock, _NONCE + _PROOF, deadline)
    c_r, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, _RECV_LABEL, n_s, c_r, binding)):
        relay = " (an endpoint relaying to it from another TLS session, say)" if binding else ""
        raise HurrayFormatError(
            "transport.auth",
            "the receiver's proof of the fleet key is wrong: it does not hold the fleet key (another fleet's, or "
            f"a retired key) or is not the receiver asked for{relay}; no chunk was sent: check the URL, and start "
            f"the receiver with the same key file ({_KEY_FILES})",
        )
    sock.sendall(_mac(secret, _SEND_LABEL, c_r, n_s, binding))
    answer = recv_exact(sock, 2, deadline)
    if answer == b"ER":
        raise HurrayFormatError("transport", f"receiver refused the key handshake: {read_message(sock, deadline)}")
    if answer != b"OK":
        raise HurrayFormatError("transport.auth", f"unexpected answer {answer!r} to the key handshake")


def answer_handshake(conn: socket.socket, keys: FleetKeys | None, binding: bytes) -> None:
    """Receiver side, after reading :data:`AUTH_MAGIC`: prove the key to the sender, check its proof, answer ``OK``.

    ``binding``: :func:`server_binding` on a TLS connection, empty on plain TCP. A receiver without
    ``keys`` cannot prove anything: it refuses (a keyed sender would refuse it).

    Raises:
        HurrayFormatError: field ``receiver.auth``: no keys here, an unknown key id or a wrong proof
            (the caller answers ``ER`` and closes).
        OSError: the connection failed or timed out.
    """
    from .base import recv_exact

    key_id = recv_exact(conn, _KEY_ID).decode("ascii", "replace")
    n_s = recv_exact(conn, _NONCE)
    if keys is None:
        raise HurrayFormatError(
            "receiver.auth",
            "this receiver holds no fleet key, and a sender with one pushes only to a receiver that proves it "
            f"holds it: start the receiver with the same key file ({_KEY_FILES}), or push without a key",
        )
    secret = keys.secret_for(key_id)
    if secret is None:
        raise HurrayFormatError(
            "receiver.auth",
            f"sender authentication failed: its key id {key_id!r} is not one of this receiver's fleet keys "
            "(another fleet key? give the receiver the sender's key file too)",
        )
    c_r = os.urandom(_NONCE)
    conn.sendall(PROOF_TAG + c_r + _mac(secret, _RECV_LABEL, n_s, c_r, binding))
    proof = recv_exact(conn, _PROOF)
    if not hmac.compare_digest(proof, _mac(secret, _SEND_LABEL, c_r, n_s, binding)):
        raise HurrayFormatError(
            "receiver.auth", "sender authentication failed: a wrong proof of the fleet key (another fleet key?)"
        )
    conn.sendall(b"OK")


def refuse_v1_handshake(conn: socket.socket) -> HurrayFormatError:
    """Receiver side, after reading :data:`V1_AUTH_MAGIC`: the refusal to answer (its sender reports the message).

    A v1 sender reads 32 bytes as its challenge and answers before it reads a refusal: it is given 32 bytes
    and its answer read, so that the ``ER`` reaches it as the reason, naming the version.

    Raises:
        HurrayFormatError: the connection ended first.
        OSError: the connection failed or timed out.
    """
    from .base import recv_exact

    recv_exact(conn, _KEY_ID)
    conn.sendall(_V1_FILLER)
    recv_exact(conn, 32)
    return HurrayFormatError(
        "receiver.auth",
        "the sender speaks the key handshake v1 (b'HVA1') of an older hurray-vllm, this receiver v2 only "
        f"(b'HVA2', mutual): {_SAME_VERSION}",
    )
