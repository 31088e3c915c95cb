"""Who may push chunks: TLS for the TCP channel, and a challenge-response that authenticates a keyed sender.

Two independent layers, both off by default:

* **TLS** (``tls://HOST:PORT``): the TCP channel inside the standard
  library's :mod:`ssl`, TLS 1.2 or later. The receiver presents a
  certificate (:class:`TlsOptions` ``cert_file``/``key_file``) and refuses
  plaintext; with ``client_ca_file`` it also requires client certificates
  signed by that CA (mutual TLS). The sender verifies the receiver against
  ``ca_file`` (default: the system's CAs) and the host name in the URL.
* **Sender authentication** with the fleet key (:mod:`hurray_vllm.chunks.signing`),
  on TCP, TLS and NIXL's side channel alike. A keyed sender opens every
  connection with::

      b"HVA1"  key id (16 ASCII hex digits)

  the receiver answers 32 random bytes (the challenge), the sender answers
  ``HMAC-SHA256(secret, "hurray-vllm sender auth v1" NUL || challenge)`` and
  the receiver ``b"OK"``, or ``b"ER"`` + message and closes. A receiver with
  keys refuses a connection that does not start so; one without keys
  answers the challenge's ``OK`` without checking (it trusts its network,
  as before). Chunks are signed besides (a keyed receiver stores only
  signed ones): the handshake keeps unauthenticated peers from using a
  receiver's disk, bandwidth and connection slots at all.

NIXL's data path (UCX) is not covered by either: it writes into memory the
receiver registered for an authenticated offer, and relies on the fabric's
isolation; the chunk MAC is checked after the writes, before anything is
stored.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import ssl
from dataclasses import dataclass

from ..chunks.signing import FleetKeys
from ..errors import HurrayArgumentError, HurrayFormatError

__all__ = [
    "AUTH_MAGIC",
    "TlsOptions",
    "answer_challenge",
    "authenticate",
    "client_context",
    "server_context",
]

AUTH_MAGIC = b"HVA1"
_LABEL = b"hurray-vllm sender auth v1\0"
_CHALLENGE = 32


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


def _response(secret: bytes, challenge: bytes) -> bytes:
    return hmac.new(secret, _LABEL + challenge, hashlib.sha256).digest()


def authenticate(sock: socket.socket, keys: FleetKeys) -> None:
    """Sender side: prove to the receiver on ``sock`` that this process holds ``keys``' signing key.

    Called once per connection, before the first frame.

    Raises:
        HurrayFormatError: the receiver refused (field ``transport``; the message says why).
        OSError: the connection failed or timed out.
    """
    from .base import read_answer, recv_exact

    sock.sendall(AUTH_MAGIC + keys.key_id.encode())
    challenge = recv_exact(sock, _CHALLENGE)
    sock.sendall(_response(keys.secrets[0], challenge))
    read_answer(sock, "(sender authentication)")


def answer_challenge(conn: socket.socket, keys: FleetKeys | None) -> None:
    """Receiver side, after reading :data:`AUTH_MAGIC`: challenge the sender; answer ``OK`` if it holds a key of ours.

    Without ``keys`` the sender is answered ``OK`` unchecked (such a receiver
    does not authenticate anyone).

    Raises:
        HurrayFormatError: field ``receiver.auth``: an unknown key id or a wrong response
            (the caller answers ``ER`` and closes).
        OSError: the connection failed or timed out.
    """
    from .base import recv_exact

    key_id = recv_exact(conn, 16).decode("ascii", "replace")
    challenge = os.urandom(_CHALLENGE)
    conn.sendall(challenge)
    response = recv_exact(conn, 32)
    if keys is not None:
        secret = keys.secret_for(key_id)
        if secret is None or not hmac.compare_digest(response, _response(secret, challenge)):
            raise HurrayFormatError("receiver.auth", "sender authentication failed (another fleet key?)")
    conn.sendall(b"OK")
