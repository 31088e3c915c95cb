"""What every chunk channel shares: the sender interface, the receiver's server loop and the framing helpers.

A *channel* moves ``(namespace, key, KVSnapshot)`` chunks from one process
into another's :class:`~hurray_vllm.chunks.store.ChunkStore`. Each channel
is one module (:mod:`.tcp`, :mod:`.nixl`) with a :class:`ChunkSender` and a
:class:`ReceiverBase` subclass; :mod:`hurray_vllm.transport` picks one by
URL scheme.

What the channels agree on:

* every frame starts with a 4-byte magic (``b"HVC1"``, ``b"HVN1"``); a
  sender with a fleet key opens each connection with the key handshake
  (``b"HVA2"``, :mod:`.security`), which a receiver with keys requires and
  one without refuses (a keyed sender pushes only to a receiver that proves
  it holds the key);
* namespaces and keys are 1-64 lowercase hex digits, and a key may name a
  tensor-parallel rank's slice of the KV heads, ``<key>.h<a>-<b>``
  (:func:`check_names`); the slice stored must hold exactly those heads;
* a chunk is answered with ``b"OK"`` once it is validated and stored, or
  ``b"ER"`` + u16 length + UTF-8 message when it was refused
  (:func:`send_error`, :func:`read_answer`);
* nothing is stored unless every byte arrived and matched the chunk digest;
* a receiver with fleet keys stores only chunks signed for the namespace and
  key they arrive under (:mod:`hurray_vllm.chunks.signing`);
* between chunks, a sender may ask which chunks the receiver holds already
  (:func:`query_held`), so that it does not send them::

      b"HVH1"  u16 count  count x (u16 len + namespace, u16 len + key)
                                          -->  b"HV" u16 count  count x u8 (1: held)

  at most :data:`MAX_HELD_QUERY` names; a malformed query closes the
  connection. A chunk counts as held when its file (whole, or the slice the
  key names) is in the receiver's store. A receiver with fleet keys answers
  only authenticated senders, as it takes chunks only from them: which
  prompts a store holds is as private as the chunks.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import ipaddress
import itertools
import logging
import numbers
import os
import select
import shutil
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any, ClassVar, cast
from urllib.parse import SplitResult, urlsplit

import torch

from ..chunks.digest import check_named_heads
from ..chunks.keys import CHUNK_NAME, namespace_of
from ..chunks.signing import FleetKeys, check_signature
from ..chunks.store import ChunkStore, split_slice_key
from ..errors import HurrayArgumentError, HurrayFormatError, integer_arg
from ..kv.snapshot import KVSnapshot
from .security import AUTH_MAGIC, V1_AUTH_MAGIC, answer_handshake, authenticate, refuse_v1_handshake, server_binding

__all__ = [
    "ChunkSender",
    "ReceiverBase",
    "Chunk",
    "CHUNK_NAME",
    "MAX_CHUNK_BYTES",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_IDLE_TIMEOUT_S",
    "HANDSHAKE_TIMEOUT_S",
    "MAX_TIMEOUT_S",
    "check_timeout",
    "host_port",
    "parse_address",
    "split_url",
    "parse_listen",
    "recv_exact",
    "check_names",
    "send_error",
    "finish_with_error",
    "read_message",
    "read_answer",
    "query_held",
    "first_of",
    "dial",
    "SendAborted",
    "HELD_MAGIC",
    "MAX_HELD_QUERY",
]

log = logging.getLogger("hurray_vllm.transport")

#: ``(namespace, key, snapshot)``: what a channel moves.
Chunk = tuple[str, str, KVSnapshot]
#: The largest chunk a receiver accepts (a 256-token chunk of a 70B model is ~80 MiB).
MAX_CHUNK_BYTES = 4 << 30
#: How long one step of a chunk (a frame, a transfer, the answer) may take.
DEFAULT_TIMEOUT_S = 60.0
#: How long a new connection's TLS and key handshakes may take in all, at most (the receiver's ``timeout`` if
#: shorter). A connection holds one of ``max_connections`` before it proved anything: a keyless peer opening
#: that many and sending nothing would otherwise lock every sender out for a whole frame's timeout per round.
#: A handshake is a few round trips, and ten seconds is far above any of them.
HANDSHAKE_TIMEOUT_S = 10.0
#: How long a sender's TCP connect may take (a host that drops SYNs must not cost a whole step timeout).
CONNECT_TIMEOUT_S = 5.0
#: The longest timeout a receiver takes (a socket's own limit is far above; NaN and infinity are refused).
MAX_TIMEOUT_S = 365 * 86400.0


def check_timeout(value: object, field: str = "timeout") -> float:
    """``value`` as seconds a sender or receiver waits: a real number, positive, below :data:`MAX_TIMEOUT_S`.

    A socket took -1 or 0 as a ``ValueError`` or a non-blocking socket (an instant ``TimeoutError``), ``nan`` as
    a ``ValueError``, ``1e12`` as an ``OverflowError`` and a string or ``None`` as a ``TypeError``, deep inside
    a send; a receiver compared a string with a number.

    Raises:
        HurrayArgumentError: naming ``field``: not a number (a bool, a string, ``None``), not positive, NaN, or
            not below :data:`MAX_TIMEOUT_S`.
    """
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not number or not 0 < value < MAX_TIMEOUT_S:  # type: ignore[operator]  # NaN fails it too
        raise HurrayArgumentError(
            field, f"must be positive and finite seconds below {MAX_TIMEOUT_S:.0f} (a year), not {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


#: How long a receiver keeps an open connection that sends nothing between chunks.
DEFAULT_IDLE_TIMEOUT_S = 120.0
#: How many connections a receiver serves at once (each holds a thread and, over NIXL, buffers).
DEFAULT_MAX_CONNECTIONS = 64
#: A frame may take the receiver's ``timeout`` plus one second per this many bytes (a TCP chunk: that arrived).
FRAME_MIN_RATE = 1 << 20
#: Connections beyond ``max_connections`` answered ``ER`` at once; past that many, closed unanswered.
_MAX_REFUSING = 16
#: A failed accept (out of file descriptors, say) is retried after this pause, doubling up to the maximum.
_ACCEPT_PAUSE_S = 0.05
_ACCEPT_PAUSE_MAX_S = 2.0
#: How long a receiver trusts its count of the store's bytes before measuring the disk again.
_USAGE_TTL_S = 5.0
#: How often a chunk beyond the quota may have the store measured again (each walk reads every directory).
_REMEASURE_S = 1.0
#: The longest message a receiver sends after ``ER`` (:func:`send_error`), and a sender reads.
_MAX_MESSAGE = 1000
#: How long :meth:`ReceiverBase.stop` waits for its threads (a chunk being written to the store) in all.
_STOP_JOIN_S = 10.0
#: What a frame that its deadline cut is counted refused as.
_OVERDUE = "receiver.timeout: a frame took longer than the receiver's timeout"
#: A sender's question "which of these chunks do you hold?" (see the module's docstring).
HELD_MAGIC = b"HVH1"
#: The most names one held-query may ask about (a sender asks in batches).
MAX_HELD_QUERY = 4096
_MAX_NAME = 128  # a key: 64 hex digits, and a slice's ".h<a>-<b>"

U16, U32, U64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<Q")


def split_url(
    url: object,
    schemes: Collection[str],
    *,
    field: str,
    path_ok: bool,
    port_required: bool,
    expected: str,
) -> SplitResult:
    """``url`` split, once it is a plain ``SCHEME://HOST[:PORT][/PATH]``; :class:`HurrayArgumentError` otherwise.

    The one rule set for every URL a caller gives (a channel's ``hurray_url``,
    a server's base URL for ``migrate`` and the router). ``urlsplit`` alone
    accepts far more: user info, a query or fragment (silently dropped by the
    channels, or pasted into the middle of a request URL), whitespace and
    control characters (it removes tabs and newlines: a URL with a newline
    after its host named that host), and it raises a bare ``ValueError`` for an unclosed IPv6
    bracket or a bad port.

    Args:
        url: What the caller gave (anything but a ``str`` is refused).
        schemes: The schemes taken (lowercase).
        field: The setting or argument the error names.
        path_ok: Whether a path prefix may follow (``http://gw/vllm``); otherwise only ``""`` or ``"/"``.
        port_required: Whether ``:PORT`` must be given (it must be 1-65535 whenever it is).
        expected: The start of the message, saying what was expected (``"expected tcp://HOST:PORT"``).

    Returns:
        The split URL: ``hostname`` (an IPv6 address without its brackets), ``port``, ``path``.

    Raises:
        HurrayArgumentError: ``url`` is not such a URL (the caller's mistake); callers that document
            another type convert it.
    """
    why = _url_fault(url, schemes, path_ok=path_ok, port_required=port_required)
    if why is not None:
        raise HurrayArgumentError(field, f"{expected}, got {url!r}: {why}")
    return urlsplit(cast(str, url))


def _url_fault(url: object, schemes: Collection[str], *, path_ok: bool, port_required: bool) -> str | None:
    """What is wrong with ``url`` for :func:`split_url` (``None``: nothing)."""
    if not isinstance(url, str):
        return "not a string"
    if any(c.isspace() or not c.isprintable() for c in url):
        return "whitespace or a control character"
    try:
        u = urlsplit(url)
        port = u.port  # raises on a port that is not a number or out of range
    except ValueError as exc:  # that, or an unclosed IPv6 bracket
        return str(exc)
    if u.scheme not in schemes:
        return f"the scheme must be {' or '.join(sorted(schemes))}"
    if "@" in u.netloc:
        return "user info (USER@HOST) is not taken"
    if not u.hostname:
        return "no host"
    if port_required and port is None:
        return "no port"
    if port == 0 or u.netloc.endswith(":"):
        return "a port must be 1-65535"
    if "?" in url or "#" in url:  # even empty: "http://a/?" is no base URL either
        return "a query or fragment is not taken"
    if not path_ok and u.path not in ("", "/"):
        return "a path is not taken"
    return None


def parse_address(url: str, scheme: str) -> tuple[str, int]:
    """``SCHEME://HOST:PORT`` -> ``(HOST, PORT)``; :class:`HurrayFormatError` names ``hurray_url`` otherwise."""
    try:
        u = split_url(
            url,
            (scheme,),
            field="hurray_url",
            path_ok=False,
            port_required=True,
            expected=f"expected {scheme}://HOST:PORT",
        )
    except HurrayArgumentError as exc:  # documented as a HurrayFormatError since 0.1 (config.py turns it back)
        raise HurrayFormatError("hurray_url", str(exc).partition(": ")[2]) from None
    return cast(str, u.hostname), cast(int, u.port)  # split_url refuses URLs without them


def parse_listen(text: str) -> tuple[str, int]:
    """A receiver's ``HOST:PORT`` (``:PORT``: 127.0.0.1; port 0 picks a free one); :class:`HurrayFormatError`.

    An IPv6 address goes in brackets, as in a URL: ``[::1]:9000`` is ``("::1", 9000)``.
    """
    # As parse_address: no host holds them, and the bind's error (" :0") would name no option.
    if any(c.isspace() or not c.isprintable() for c in text):
        raise HurrayFormatError("hurray_listen", f"expected HOST:PORT, got {text!r}: whitespace or a control character")
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise HurrayFormatError("hurray_listen", f"expected HOST:PORT with a port 0-65535, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise HurrayFormatError("hurray_listen", f"brackets hold an IPv6 address, got {text!r}")
    elif ":" in host:
        raise HurrayFormatError("hurray_listen", f"write an IPv6 address in brackets, [{host}]:{port}, got {text!r}")
    return host or "127.0.0.1", int(port)


def host_port(host: str, port: int) -> str:
    """``HOST:PORT`` as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes from ``sock``; :class:`HurrayFormatError` when the peer closes first.

    ``deadline`` (``time.monotonic()``): all of them by then, or ``TimeoutError``. Without one only each
    ``recv`` is bounded (by the socket's timeout), and a peer trickling a byte per timeout holds the reader
    for as long as it likes. The socket's timeout is as it was afterwards.
    """
    buf = bytearray()
    before = sock.gettimeout()
    try:
        while len(buf) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {len(buf)} of {n} bytes")
                sock.settimeout(left if before is None else min(left, before))
            part = sock.recv(min(n - len(buf), 1 << 20))
            if not part:
                raise HurrayFormatError("transport", f"connection closed after {len(buf)} of {n} bytes")
            buf += part
    finally:
        if deadline is not None:
            with contextlib.suppress(OSError):  # closed meanwhile: nothing more is read from it
                sock.settimeout(before)
    return bytes(buf)


def _deadline_of(sock: socket.socket) -> float | None:
    """When a whole answer on ``sock`` is due: one socket timeout from now (``None``: a socket without one)."""
    timeout = sock.gettimeout()
    return None if timeout is None else time.monotonic() + timeout


def check_names(ns: str, key: str) -> range | None:
    """Refuse a namespace or key that is not a chunk's name (it becomes a file name); the heads a slice's key names.

    A namespace is 1-64 lowercase hex digits; a key too, or a tensor-parallel
    rank's slice of one, ``<key>.h<a>-<b>`` in the canonical form
    :func:`~hurray_vllm.chunks.keys.slice_key` writes. Returns the slice's
    heads (``None`` for a whole chunk).
    """
    base, heads = split_slice_key(key)
    # fullmatch: "^...$" with match() accepts a trailing newline, which would end up in a file name.
    if not (CHUNK_NAME.fullmatch(ns) and CHUNK_NAME.fullmatch(base)):
        raise HurrayFormatError(
            "transport", "namespace and key must be 1-64 lowercase hex digits (a key may end in .h<a>-<b>)"
        )
    return heads


def finish_with_error(conn: socket.socket, exc: BaseException, *, linger_s: float = 1.0) -> None:
    """Answer ``ER`` and end the connection so that the answer arrives.

    Closing a socket with unread input makes the kernel send a reset, which
    may discard the answer before the peer reads it. So: answer, shut the
    sending side, and read (a bounded amount, for at most ``linger_s``) until
    the peer closes too.
    """
    if not send_error(conn, exc):
        return
    try:
        conn.shutdown(socket.SHUT_WR)
        end = time.monotonic() + linger_s  # in all: a peer trickling bytes must not hold the thread
        left = 1 << 20
        while left > 0 and (wait := end - time.monotonic()) > 0:
            conn.settimeout(wait)
            data = conn.recv(min(left, 1 << 16))
            if not data:
                break
            left -= len(data)
    except OSError:
        pass


def send_error(conn: socket.socket, exc: BaseException) -> bool:
    """Answer ``b"ER"`` + the (truncated) message of ``exc``; False when the peer is gone."""
    msg = (str(exc) or type(exc).__name__).encode()[:_MAX_MESSAGE]
    try:
        conn.sendall(b"ER" + U16.pack(len(msg)) + msg)
        return True
    except OSError:
        return False


#: The first byte of a TLS handshake record (a ClientHello); no frame magic starts with it.
_TLS_HANDSHAKE = b"\x16"


def _plain_to_tls() -> HurrayFormatError:
    return HurrayFormatError(
        "receiver.tls",
        "this receiver takes TLS connections only: push to tls://HOST:PORT, not tcp:// (tls:// vs tcp://)",
    )


def _tls_to_plain() -> HurrayFormatError:
    return HurrayFormatError(
        "receiver.tls",
        "a TLS handshake (a tls:// sender) reached a receiver without TLS: push to tcp://HOST:PORT (tls:// vs "
        "tcp://), or start the receiver with a certificate (--tls-cert/--tls-key, hurray_listen_tls_cert/_key)",
    )


def _size_on_disk(path: Callable[[str, str], Any] | None, ns: str, key: str) -> int:
    """The bytes of chunk ``key``'s file (0: a store without files, or none there)."""
    try:
        return int(os.stat(path(ns, key)).st_size) if path is not None else 0
    except OSError:
        return 0


def _refuse_connection(conn: socket.socket, exc: BaseException) -> None:
    """Answer a connection the receiver will not serve with ``ER``, then close it."""
    with conn:
        finish_with_error(conn, exc)


def read_message(sock: socket.socket, deadline: float | None = None) -> str:
    """The message after an ``b"ER"`` (or a placeholder when the peer does not send one).

    ``deadline``: as :func:`recv_exact` (default: one socket timeout from now, for the whole message).
    A length beyond what any receiver sends (:func:`send_error`) is not read: a hostile receiver would
    otherwise have the sender wait for 64 KiB it trickles.
    """
    if deadline is None:
        deadline = _deadline_of(sock)
    try:
        (n,) = U16.unpack(recv_exact(sock, 2, deadline))
        if n > _MAX_MESSAGE:
            return f"(a message of {n} bytes, longer than receivers send: not read)"
        return recv_exact(sock, n, deadline).decode(errors="replace")
    except (HurrayFormatError, OSError):
        return "(no reason given)"


def read_answer(sock: socket.socket, key: str, timeout: float | None = None) -> None:
    """Wait for the answer to chunk ``key``: return on ``b"OK"``, raise :class:`HurrayFormatError` otherwise.

    The whole answer, its message included, within ``timeout`` seconds (default: the socket's
    timeout), however the receiver trickles it.

    Raises:
        HurrayFormatError: the receiver refused the chunk (the message says why), closed the
            connection, or answered something else.
        OSError: the connection failed, or no answer within the time (``TimeoutError``).
    """
    deadline = _deadline_of(sock) if timeout is None else time.monotonic() + timeout
    answer = recv_exact(sock, 2, deadline)
    if answer == b"OK":
        return
    if answer == b"ER":
        raise HurrayFormatError("transport", f"receiver refused chunk {key}: {read_message(sock, deadline)}")
    raise HurrayFormatError("transport", f"unexpected answer {answer!r} from the receiver for chunk {key}")


def _name_bytes(text: str) -> bytes:
    raw = text.encode()
    return U16.pack(len(raw)) + raw


def dial(
    host: str,
    port: int,
    *,
    timeout: float,
    keys: FleetKeys | None = None,
    tls: ssl.SSLContext | None = None,
    track: Callable[[socket.socket], None] | None = None,
    aborted: Callable[[], bool] | None = None,
) -> socket.socket:
    """A sender's connection to a receiver: TCP (no delay), inside ``tls`` if given, then authenticated with ``keys``.

    The caller closes it; on failure it is closed here. ``track`` sees each
    socket before anything blocks on it (the TCP connect, the TLS and key
    handshakes), so that another thread can shut it down; ``aborted`` says
    whether that happened (checked where a shutdown may come too early to
    reach a socket: before it is connected, or before TLS took it over).

    Raises:
        HurrayFormatError: the receiver refused the key handshake, or did not prove that it holds the
            fleet key (field ``transport.auth``: :func:`.security.authenticate`).
        SendAborted: ``aborted()`` became true while connecting.
        OSError: the receiver cannot be reached; ``ssl.SSLCertVerificationError`` when its certificate is
            not trusted; a ``ConnectionError`` asking whether the receiver uses TLS when its TLS handshake
            fails as a receiver without TLS makes it fail.
    """
    sock = _connect(host, port, min(timeout, CONNECT_TIMEOUT_S), track, aborted)
    try:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            # The handshake waits for the receiver: it runs only once the TLS socket is tracked (wrap_socket
            # takes the plain socket's descriptor, and a shutdown of the plain one no longer reaches it).
            sock = tls.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
            if track is not None:
                track(sock)
            _check_aborted(aborted)  # an abort between the two reached neither socket
            try:
                sock.do_handshake()
            except OSError as exc:
                _raise_tls_mismatch(exc, host, port, aborted)
                raise
        if keys is not None:
            authenticate(sock, keys)
    except BaseException:
        sock.close()
        raise
    return sock


def _raise_tls_mismatch(exc: OSError, host: str, port: int, aborted: Callable[[], bool] | None) -> None:
    """Raise a sender's failed TLS handshake as a question about the URL's scheme when the receiver speaks no TLS.

    A receiver without TLS closes (or answers plaintext ``ER``) on a ClientHello: the handshake ends in a reset,
    an EOF or a record that is no TLS, which alone tell the operator nothing. Returns (the error stands) for a
    certificate the sender does not trust, a TLS alert (the receiver speaks TLS), or an abort.
    """
    if isinstance(exc, ssl.SSLCertVerificationError) or (aborted is not None and aborted()):
        return
    if isinstance(exc, ssl.SSLError) and "ALERT" in str(exc.reason or ""):
        return
    if isinstance(exc, (ssl.SSLError, ConnectionResetError, BrokenPipeError)):
        raise ConnectionError(
            f"the TLS handshake with {host_port(host, port)} failed ({exc}): does the receiver use TLS? "
            "(tls:// vs tcp://): a receiver without a certificate takes tcp:// only"
        ) from exc


#: How long a connect waits between looks at whether its call was aborted.
_CONNECT_SLICE_S = 0.1


class SendAborted(ConnectionAbortedError):
    """A :class:`ChunkSender` call that :meth:`ChunkSender.abort` cut short (an ``OSError``, as a lost connection)."""


def _check_aborted(aborted: Callable[[], bool] | None) -> None:
    if aborted is not None and aborted():
        raise SendAborted("aborted before the connection was made")


def _connect(
    host: str,
    port: int,
    timeout: float,
    track: Callable[[socket.socket], None] | None,
    aborted: Callable[[], bool] | None,
) -> socket.socket:
    """A TCP connection to ``host:port``, made on a socket ``track`` saw first.

    ``socket.create_connection`` returns its socket only once connected, so a
    receiver that drops SYNs would hold an abort off for the whole connect
    timeout. Here each socket is tracked before its connect starts, and the
    connect waits in short slices, looking at ``aborted`` between them. As
    ``create_connection`` does, every address ``host`` resolves to is tried in
    turn, each for up to ``timeout`` seconds; if none connects, the first
    address's failure is raised. Resolving the name takes ``timeout`` at most
    too, and an abort cuts it short (:func:`_resolve`).
    """
    failure: OSError | None = None
    for family, kind, proto, _name, address in _resolve(host, port, timeout, aborted):
        _check_aborted(aborted)
        sock = socket.socket(family, kind, proto)
        try:
            if track is not None:
                track(sock)
            _check_aborted(aborted)  # aborted before it was tracked: no shutdown reached it
            sock.setblocking(False)
            err = sock.connect_ex(address)
            if err in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                err = _wait_connected(sock, time.monotonic() + timeout, aborted)
            if err:
                raise OSError(err, os.strerror(err))  # its subclass: ConnectionRefusedError, ...
            sock.setblocking(True)
            return sock
        except SendAborted:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            _check_aborted(aborted)  # the abort's shutdown, not the receiver, failed this connect
            failure = failure or exc
        except BaseException:
            sock.close()
            raise
    raise failure if failure is not None else OSError(f"{host} resolves to no address")


def _resolve(
    host: str, port: int, timeout: float, aborted: Callable[[], bool] | None
) -> list[tuple[Any, Any, int, str, Any]]:
    """``host``'s addresses for a TCP connect, within ``timeout`` seconds and cut short by ``aborted``.

    A name is resolved on a helper thread: ``getaddrinfo`` cannot be
    interrupted, and a dead DNS server would hold the caller (and an abort)
    for the resolver's own timeouts, far beyond the connect timeout. The
    helper, a daemon, finishes on its own. A numeric address needs no DNS: it
    is resolved here, at once.

    Raises:
        TimeoutError: no answer within ``timeout`` (what a connect that times out raises).
        SendAborted: ``aborted()`` became true meanwhile.
        OSError: the name does not resolve (``socket.gaierror``).
    """
    try:
        ipaddress.ip_address(host.partition("%")[0])  # an IPv6 address may carry a zone: fe80::1%eth0
    except ValueError:
        pass
    else:
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    answer: list[list[tuple[Any, Any, int, str, Any]] | Exception] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
        except Exception as exc:  # re-raised on the caller's thread: socket.gaierror, a UnicodeError for a bad name
            answer.append(exc)
        finally:
            done.set()

    try:
        threading.Thread(target=lookup, name="hurray-resolve", daemon=True).start()
    except RuntimeError:  # no thread to be had: resolve here, unbounded, as socket.create_connection does
        lookup()
    deadline = time.monotonic() + timeout
    while not done.wait(min(max(0.0, deadline - time.monotonic()), _CONNECT_SLICE_S)):
        _check_aborted(aborted)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out resolving {host}")
    _check_aborted(aborted)
    (result,) = answer
    if isinstance(result, Exception):
        raise result
    return result


def _wait_connected(sock: socket.socket, deadline: float, aborted: Callable[[], bool] | None) -> int:
    """Wait for a non-blocking connect to finish; its error number (0: connected).

    poll, not select: a busy process's descriptors pass select's limit of 1024.
    """
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    while True:
        _check_aborted(aborted)
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")  # what create_connection says
        if poller.poll(min(left, _CONNECT_SLICE_S) * 1000):
            _check_aborted(aborted)
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)


def _read_name(conn: socket.socket) -> str:
    """A u16-length-prefixed name of a held-chunk query, refused before it is read when longer than a chunk's."""
    (n,) = U16.unpack(recv_exact(conn, 2))
    if n > _MAX_NAME:
        raise HurrayFormatError("transport", f"a name of {n} bytes in a held-chunk query; chunk names are shorter")
    return recv_exact(conn, n).decode(errors="replace")


def query_held(sock: socket.socket, names: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
    """Ask the receiver on ``sock`` which of ``names`` (``(namespace, key)``) it holds; those it does.

    Sent between chunks on a connection already authenticated (if keyed),
    in batches of :data:`MAX_HELD_QUERY`.

    Raises:
        HurrayFormatError: the receiver refused the query, closed the connection
            (a receiver older than the query does), or answered something else.
        OSError: the connection failed, or an answer took longer than the socket's timeout (in all).
    """
    held: set[tuple[str, str]] = set()
    for start in range(0, len(names), MAX_HELD_QUERY):
        batch = names[start : start + MAX_HELD_QUERY]
        sock.sendall(HELD_MAGIC + U16.pack(len(batch)) + b"".join(_name_bytes(n) + _name_bytes(k) for n, k in batch))
        deadline = _deadline_of(sock)  # the whole answer within a timeout, however it trickles
        answer = recv_exact(sock, 2, deadline)
        if answer == b"ER":
            raise HurrayFormatError(
                "transport", f"receiver refused the held-chunk query: {read_message(sock, deadline)}"
            )
        if answer != b"HV":
            raise HurrayFormatError("transport", f"unexpected answer {answer!r} to the held-chunk query")
        (count,) = U16.unpack(recv_exact(sock, 2, deadline))
        if count != len(batch):
            raise HurrayFormatError("transport", f"held-chunk query: {count} answers for {len(batch)} names")
        flags = recv_exact(sock, count, deadline)
        held.update(name for name, flag in zip(batch, flags, strict=True) if flag)
    return held


def first_of(chunks: Iterable[Chunk]) -> tuple[list[Chunk], Iterator[Chunk]]:
    """The first chunk (none if there are none), made before the connection is, and the rest, still lazy.

    A receiver gives a new connection :data:`HANDSHAKE_TIMEOUT_S` for its first frame (a silent
    connection holds one of its slots): an engine exports and stores a chunk before it yields it, which
    would spend that time with the connection open. Every sender (TCP, NIXL) connects after this.
    """
    rest = iter(chunks)
    return list(itertools.islice(rest, 1)), rest


#: Guards every sender's set of live connections (short critical sections; senders are few).
_LIVE_MU = threading.Lock()


class _Caller:
    """One owner's calls in progress on a :class:`ChunkSender`: how many, the aborts aimed at them, their sockets."""

    __slots__ = ("aborts", "calls", "live")

    def __init__(self) -> None:
        self.calls = 0
        self.aborts = 0  # abort(owner) calls while any of its calls was in progress
        self.live: set[socket.socket] = set()


class ChunkSender(abc.ABC):
    """Pushes chunks to receivers of one channel.

    Who calls it: the connector's worker after it saved a step's chunks, the
    CLI, benchmarks. :meth:`send` blocks until every chunk is stored on the
    other side (or refused); the connector calls it from the model runner's
    thread, between forward passes.
    """

    #: The URL scheme this channel answers to (``tcp``, ``nixl``).
    scheme: ClassVar[str]

    def register(self, tensors: Sequence[torch.Tensor]) -> None:  # noqa: B027 - optional hook
        """Hint that ``tensors`` will be sent again and again (reused export buffers).

        A channel that copies through the kernel ignores it; NIXL registers
        them once instead of per chunk.
        """

    def unregister(self, tensors: Sequence[torch.Tensor]) -> None:  # noqa: B027 - optional hook
        """Undo :meth:`register` for buffers about to be replaced (unknown tensors are ignored)."""

    def abort(self, owner: object | None = None) -> None:
        """From another thread: make the :meth:`send` and :meth:`held` calls in progress fail now.

        Shuts down their connections (from the TCP connect on: the TLS and key
        handshakes too), so that their blocked reads and writes fail at once,
        and those calls raise :class:`SendAborted` (an ``OSError``). Calls
        that start afterwards are not affected. Who calls it: the connector's
        worker, when a step would otherwise wait for a push (a full save
        queue) and at shutdown.

        Args:
            owner: Only the calls made with this ``owner`` (the caller's own
                pushes: one sender, such as the process-wide NIXL sender, may
                serve several engines, and one giving up on its push must not
                cut another's). ``None``: every call in progress, whoever made it.
        """
        with _LIVE_MU:  # counted with the snapshot: a socket tracked later sees the count (tracked())
            if owner is None:
                self.__dict__["_abort_count"] = self._aborts() + 1
                live = list(self._live_sockets())
            else:
                caller = self._callers().get(id(owner))
                if caller is None:  # none of its calls in progress: nothing to cut
                    return
                caller.aborts += 1
                live = list(caller.live)
        for sock in live:
            try:
                # The plain socket's shutdown, also under TLS: SSLSocket.shutdown would drop the TLS
                # state under the thread using it, which then fails with an AttributeError.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def _aborts(self) -> int:
        """How many times :meth:`abort` was called for every caller (an int: read without the lock)."""
        return int(self.__dict__.get("_abort_count", 0))

    def _live_sockets(self) -> set[socket.socket]:
        """The connections of the calls in progress (created on first use: channels need no ``__init__`` for it)."""
        live: set[socket.socket] | None = self.__dict__.get("_live")
        if live is None:
            live = self.__dict__["_live"] = set()
        return live

    def _callers(self) -> dict[int | None, _Caller]:
        """The owners with calls in progress, by ``id`` (``None``: calls without an owner); under ``_LIVE_MU``."""
        callers: dict[int | None, _Caller] | None = self.__dict__.get("_owners")
        if callers is None:
            callers = self.__dict__["_owners"] = {}
        return callers

    @contextlib.contextmanager
    def _calling(self, owner: object | None) -> Iterator[tuple[_Caller, Callable[[], bool]]]:
        """A call of ``owner`` in progress: its record, and whether :meth:`abort` reached it since it started.

        Entered before the call's first chunk is made (:meth:`send`): an abort
        meanwhile has no socket to shut, and is seen here. The record lives
        while any call of its owner does, so that owners that come and go
        leave nothing behind (and the owner, held by this frame, keeps its ``id``).
        """
        key = None if owner is None else id(owner)
        with _LIVE_MU:
            caller = self._callers().get(key)
            if caller is None:
                caller = self._callers()[key] = _Caller()
            caller.calls += 1
            start = self._aborts() + caller.aborts

        def aborted() -> bool:
            return self._aborts() + caller.aborts != start

        try:
            yield caller, aborted
        finally:
            with _LIVE_MU:
                caller.calls -= 1
                if not caller.calls:
                    del self._callers()[key]

    @contextlib.contextmanager
    def tracked(
        self, url: str, *, timeout: float, keys: FleetKeys | None = None, owner: object | None = None
    ) -> Iterator[socket.socket]:
        """:meth:`connect`, as a connection :meth:`abort` (for every caller, or for ``owner``) can cut; closed on exit.

        A call cut short sees its connection end: a read then finds the
        receiver gone, which would look like a receiver that hung up (or one
        too old for a query). Its error is raised as :class:`SendAborted`
        instead, so that callers can tell the two apart.
        """
        mine: list[socket.socket] = []
        with self._calling(owner) as (caller, aborted):

            def track(sock: socket.socket) -> None:
                with _LIVE_MU:
                    mine.append(sock)
                    self._live_sockets().add(sock)
                    caller.live.add(sock)

            try:
                with self.connect(url, timeout=timeout, keys=keys, track=track, aborted=aborted) as sock:
                    yield sock
            except (HurrayFormatError, OSError) as exc:
                if aborted() and not isinstance(exc, SendAborted):
                    raise SendAborted(f"the {self.scheme} call to {url} was aborted ({exc})") from exc
                raise
            finally:
                with _LIVE_MU:
                    self._live_sockets().difference_update(mine)
                    caller.live.difference_update(mine)

    def connect(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        keys: FleetKeys | None = None,
        track: Callable[[socket.socket], None] | None = None,
        aborted: Callable[[], bool] | None = None,
    ) -> socket.socket:
        """A connection to the receiver's frame channel at ``url``, authenticated with ``keys`` (if given).

        The caller closes it. TCP's is the chunk connection itself (inside
        TLS for ``tls://``); NIXL's is its side channel. ``track`` sees each
        socket as soon as it exists, ``aborted`` says whether to give up
        (:func:`dial`).

        Raises:
            HurrayFormatError: ``url`` is malformed, or the receiver refused the authentication.
            OSError: the receiver cannot be reached.
            NotImplementedError: a channel without such a connection (then :meth:`held` cannot ask).
        """
        raise NotImplementedError(f"the {self.scheme} channel cannot ask a receiver what it holds")

    def held(
        self,
        url: str,
        names: Sequence[tuple[str, str]],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        keys: FleetKeys | None = None,
        owner: object | None = None,
    ) -> set[tuple[str, str]]:
        """Which of ``names`` (``(namespace, key)``) the receiver at ``url`` holds already (:func:`query_held`).

        Who calls it: the connector's background writer, before it pushes on
        chunks it did not compute itself (loaded ones), so that two engines
        pushing to each other do not send each other back what they received.
        ``owner``: who makes the call (``abort(owner)`` cuts it; see :meth:`abort`).

        Raises:
            HurrayFormatError: the receiver refused the query or is older than it.
            OSError: the receiver cannot be reached; :class:`SendAborted` when :meth:`abort` cut the query.
            NotImplementedError: the channel cannot ask (:meth:`connect`).
        """
        if not names:
            return set()
        with self.tracked(url, timeout=timeout, keys=keys, owner=owner) as sock:
            return query_held(sock, names)

    @abc.abstractmethod
    def send(
        self,
        url: str,
        chunks: Iterable[Chunk],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        keys: FleetKeys | None = None,
        owner: object | None = None,
    ) -> Any:
        """Push ``chunks`` to the receiver at ``url``; return once each is stored there.

        ``chunks`` is consumed lazily: a chunk is asked for only after the
        receiver acknowledged the previous one, so a generator may export
        every chunk into the same buffers. With ``keys`` the connection
        starts with the sender authentication of :mod:`.security`.
        ``owner``: who makes the call (``abort(owner)`` cuts it; see :meth:`abort`).

        Raises:
            HurrayFormatError: the receiver refused a chunk (the message says why).
            OSError: the receiver cannot be reached, or a transfer failed or timed out;
                :class:`SendAborted` when :meth:`abort` cut the push.
        """


class ReceiverBase(abc.ABC):
    """A server on ``host:port`` that stores the valid chunks it receives in ``store``.

    Runs in daemon threads: one accepts, one serves each connection.
    Subclasses implement :meth:`serve`. The counters (``received``,
    ``refused``, ``last_error``) are updated under a lock by :meth:`count`.

    Args:
        host: The address to listen on (``"127.0.0.1"``, ``"0.0.0.0"``).
        port: The port; 0 picks a free one (see ``address``).
        store: Where accepted chunks go (``put`` is called from the connection threads).
        timeout: How long one frame (a chunk, a query) may take to arrive, in seconds (a new
            connection's TLS and key handshakes: at most :data:`HANDSHAKE_TIMEOUT_S`), plus one
            second per MiB (:data:`FRAME_MIN_RATE`): per MiB that arrived for a TCP chunk's payload,
            per MiB offered for a NIXL transfer. A peer slower than that, however steadily it
            trickles, is disconnected.
        idle_timeout: How long a connection may stay silent between chunks (before its first frame:
            at most :data:`HANDSHAKE_TIMEOUT_S`, see :meth:`next_frame`).
        max_chunk_bytes: The largest chunk accepted (its stream, or its page pools over NIXL, each
            rounded up to 4 KiB as its receive buffer takes it).
        max_connections: How many connections are served at once; one more is
            answered ``ER`` and closed. With keys or TLS, a connection still in
            its handshakes gives its slot up to a newer one when all are taken
            (the oldest first): peers without the key cannot hold the slots.
        quota_bytes: The most bytes the store (a directory) may hold: a chunk
            that would take it beyond is refused before its payload is read.
            ``None``: no quota.
        min_free_bytes: The free disk space a chunk must leave on the store's
            filesystem, likewise (0: none).
        keys: Fleet keys: a connection must first authenticate its sender
            with one of them (:mod:`.security`), and a chunk is stored only if
            it is signed with one of them for the namespace and key it arrives
            under (refused ``ER`` otherwise). ``None``: anyone may send, the
            digest alone is checked.
        tls: A server TLS context (:func:`.security.server_context`): every
            connection must open with a TLS handshake (plaintext is refused).

    Raises:
        HurrayArgumentError: naming the argument: a ``port`` outside
            0..65535, a timeout that is not
            positive seconds below :data:`MAX_TIMEOUT_S`, a count or size that
            is not an integer (``max_chunk_bytes`` and ``max_connections`` at
            least 1, ``quota_bytes`` and ``min_free_bytes`` at least 0).
        OSError: ``host:port`` cannot be bound.

    Example:
        >>> from hurray_vllm.chunks.store import DirectoryStore
        >>> from hurray_vllm.transport.tcp import Receiver
        >>> with Receiver("127.0.0.1", 0, DirectoryStore("/tmp/hv-doc-store")) as r:
        ...     url = f"tcp://127.0.0.1:{r.address[1]}"
    """

    #: The channel's name in logs and in ``hurray-vllm receive --transport``.
    transport: ClassVar[str]

    def __init__(
        self,
        host: str,
        port: int,
        store: ChunkStore,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
        max_chunk_bytes: int = MAX_CHUNK_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        quota_bytes: int | None = None,
        min_free_bytes: int = 0,
        keys: FleetKeys | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        # Each limit named as the argument it is: 1.5 bytes or 2.5 connections compared as the next integer
        # up, nan free bytes compared false with everything, and a string failed with a bare TypeError.
        timeout = check_timeout(timeout, "timeout")
        idle_timeout = check_timeout(idle_timeout, "idle_timeout")
        max_chunk_bytes = integer_arg(max_chunk_bytes, "max_chunk_bytes", 1)
        max_connections = integer_arg(max_connections, "max_connections", 1)
        if quota_bytes is not None:
            quota_bytes = integer_arg(quota_bytes, "quota_bytes", 0)
        min_free_bytes = integer_arg(min_free_bytes, "min_free_bytes", 0)
        port = integer_arg(port, "port", 0)
        if port > 65535:  # the socket's own refusal is an OverflowError, not the OSError of a port in use
            raise HurrayArgumentError("port", f"must be 0..65535 (0: any free port), not {port}")
        self.store = store
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.max_chunk_bytes = max_chunk_bytes
        self.max_connections = max_connections
        self.quota_bytes = quota_bytes
        self.min_free_bytes = min_free_bytes
        self.keys = keys
        self.tls = tls
        # What the key handshake is bound to over TLS (security.server_binding): worked out once, here.
        self._binding = server_binding(tls) if tls is not None else None
        if tls is not None and keys is not None and self._binding is None:
            raise HurrayArgumentError(
                "tls",
                "cannot tell which certificate this TLS context presents, which the key handshake is bound to: "
                "make it with hurray_vllm.transport.security.server_context",
            )
        self._disk = threading.Lock()  # the store's measured bytes and the bytes promised to chunks in flight
        self._used: tuple[float, int] | None = None  # (when measured, bytes)
        self._promised = 0
        self._settled = 0  # every byte settle() counted as stored (_measure adds what a walk may have missed)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET  # parse_listen took an IPv6 one's brackets off
        self._sock = socket.create_server((host, port), family=family, reuse_port=False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._accepting: threading.Thread | None = None  # start()'s accept thread
        self._conns: set[socket.socket] = set()
        self._mu = threading.Lock()
        # Per connection, when its frame must have arrived (see _watch); under _mu.
        self._deadlines: dict[socket.socket, float] = {}
        self._refusing = threading.BoundedSemaphore(_MAX_REFUSING)
        # The connection threads (stop() waits for them) and the connections _watch cut, not yet counted; under _mu.
        self._threads: set[threading.Thread] = set()
        self._overdue: set[socket.socket] = set()
        # With keys or TLS: the connections still in their handshakes, oldest first, by their sockets' list (held
        # in _connection); under _mu. A full receiver evicts the oldest of them for a newcomer (_evict_unproven).
        self._unproven: dict[int, list[socket.socket]] = {}
        self._local = threading.local()  # on a connection's thread: its sockets (count() looks them up)
        self._measuring = threading.Lock()  # one walk of the store at a time, outside _disk
        self.received = 0
        self.refused = 0
        self.last_error: str | None = None

    def start(self) -> ReceiverBase:
        """Start accepting connections (on a daemon thread); returns ``self``."""
        self._accepting = threading.Thread(target=self._accept, name=f"hurray-{self.transport}-receiver", daemon=True)
        self._accepting.start()
        threading.Thread(target=self._watch, name=f"hurray-{self.transport}-deadlines", daemon=True).start()
        return self

    def arm(self, conn: socket.socket, seconds: float) -> None:
        """Give ``conn``'s frame ``seconds`` from now to arrive whole; past that the connection is shut.

        Why: socket timeouts bound each ``recv``, and a peer sending a byte
        just before each one expires would hold a connection (and what
        :meth:`admit` promised its chunk) forever.
        """
        with self._mu:
            self._deadlines[conn] = time.monotonic() + seconds
        self._local.counted = False  # a frame begins (on its connection's thread): not counted yet

    def extend(self, conn: socket.socket, when: float) -> None:
        """Move ``conn``'s deadline to ``when`` (``time.monotonic()``), unless it is disarmed or already cut.

        Who calls it: a reader whose deadline follows the bytes that arrived (a TCP chunk's payload).
        """
        with self._mu:
            if conn in self._deadlines:
                self._deadlines[conn] = when

    def disarm(self, conn: socket.socket) -> None:
        """``conn`` is between frames (its idle timeout applies) or done."""
        with self._mu:
            self._deadlines.pop(conn, None)

    def _watch(self) -> None:
        """Shut every connection whose frame is overdue: its blocked read returns and the frame is refused.

        Counting is left to the connection's thread (:meth:`count` names the timeout as the reason): it
        alone knows whether the frame was refused or, cut during its last steps, stored after all.
        """
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._mu:
                late = [c for c, t in self._deadlines.items() if t <= now]
                for c in late:
                    del self._deadlines[c]
                    self._overdue.add(c)
            for c in late:
                log.warning("hurray %s receiver: closing a connection whose frame is overdue", self.transport)
                try:
                    # The plain socket's shutdown, also under TLS: SSLSocket.shutdown would drop
                    # the TLS state under the thread reading it.
                    socket.socket.shutdown(c, socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        """Stop accepting and close open connections (their chunks abort; nothing partial is stored).

        Returns once the connection threads ended (at most :data:`_STOP_JOIN_S` seconds: a chunk being
        written to the store is finished first), so that the store is not written to afterwards.
        """
        self._stop.set()
        try:
            # Wakes the accept thread (Linux: EINVAL). close() alone does not: the thread stays blocked in
            # accept() on the open listening socket, which keeps taking connections until one more arrives.
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # never listened, or already shut
            pass
        self._sock.close()
        end = time.monotonic() + _STOP_JOIN_S
        me = threading.current_thread()
        if self._accepting is not None and self._accepting is not me:
            self._accepting.join(_STOP_JOIN_S)  # no connection is added after this
        with self._mu:
            conns, threads = list(self._conns), list(self._threads)
        for c in conns:
            try:
                # The plain socket's shutdown, also under TLS: SSLSocket.shutdown would drop the TLS
                # state under the connection's thread, which then fails with an AttributeError.
                socket.socket.shutdown(c, socket.SHUT_RDWR)
            except OSError:
                pass
        for t in threads:
            # Not started yet (ident None): an accept thread that outlived its join is between registering
            # a connection and starting its thread; join() would raise. Its connection was shut above.
            if t is not me and t.ident is not None:
                t.join(max(0.0, end - time.monotonic()))

    def __enter__(self) -> ReceiverBase:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (long waits check it)."""
        return self._stop.is_set()

    def count(self, ok: bool, err: str | None = None) -> None:
        """Count one chunk as stored (``ok``) or refused with ``err``.

        On a connection's thread, once per frame: a frame whose deadline cut it is refused for that
        (``err`` is what the cut made its reader see), and counted here, not by the watchdog.
        """
        self._local.counted = True  # a cut after this (skipping the rest of a refused frame) is not counted again
        with self._mu:
            mine = [c for c in getattr(self._local, "held", ()) if c in self._overdue]
            if mine:  # this frame's cut, counted now: not again as the connection ends
                self._overdue.difference_update(mine)
                if not ok:
                    err = _OVERDUE
            if ok:
                self.received += 1
            else:
                self.refused += 1
                self.last_error = err

    def _limits_disk(self) -> bool:
        """Whether a quota or a free-space floor applies (only a directory store has a disk to measure)."""
        return getattr(self.store, "root", None) is not None and (
            self.quota_bytes is not None or bool(self.min_free_bytes)
        )

    def admit(self, nbytes: int) -> None:
        """Promise room for a chunk of ``nbytes`` before its payload is read, or refuse it.

        Every admitted chunk must be :meth:`settle`-d once it is stored or
        dropped. Only a directory store (one with a ``root``) has a disk to
        measure; other stores take the quota and floor as unset.

        Raises:
            HurrayFormatError: the chunk would take the store beyond ``quota_bytes``
                (field ``receiver.quota``) or leave less than ``min_free_bytes`` free
                (``receiver.min_free``). Nothing of it is written.
        """
        if not self._limits_disk():
            return
        root = self.store.root  # type: ignore[attr-defined]  # _limits_disk: a directory store
        if self.quota_bytes is not None:
            self._measure(root, _USAGE_TTL_S)
            if not self._within_quota(nbytes):
                # Pruned meanwhile, maybe. At most once a second: an unauthenticated peer sending headers
                # beyond the quota would otherwise have every directory of the store read for each.
                self._measure(root, _REMEASURE_S)
        with self._disk:
            if self.quota_bytes is not None and not self._within_quota(nbytes):
                used = self._used[1] if self._used is not None else 0
                raise HurrayFormatError(
                    "receiver.quota",
                    f"a chunk of {nbytes} bytes would take the store to {used + self._promised + nbytes} bytes, "
                    f"beyond its quota of {self.quota_bytes}: prune it (hurray-vllm prune) or raise --quota",
                )
            if self.min_free_bytes:
                free = shutil.disk_usage(root).free - self._promised
                if free - nbytes < self.min_free_bytes:
                    raise HurrayFormatError(
                        "receiver.min_free",
                        f"a chunk of {nbytes} bytes would leave {free - nbytes} bytes free on the store's disk, "
                        f"less than the floor of {self.min_free_bytes}",
                    )
            self._promised += nbytes

    def _within_quota(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit the quota, by the last measurement (taken as 0 before the first)."""
        used = self._used[1] if self._used is not None else 0
        return self.quota_bytes is None or used + self._promised + nbytes <= self.quota_bytes

    def settle(self, nbytes: int, stored_bytes: int) -> None:
        """Release the room :meth:`admit` promised for ``nbytes``; ``stored_bytes`` (:meth:`put`'s) count as used."""
        if not self._limits_disk():
            return
        with self._disk:
            self._promised -= nbytes
            self._settled += stored_bytes
            if self._used is not None:
                self._used = (self._used[0], self._used[1] + stored_bytes)

    def _measure(self, root: Any, max_age: float) -> None:
        """Measure the bytes of every file in the store, unless the last measurement is under ``max_age`` s old.

        The walk runs outside ``_disk`` (it reads every directory: on a large store, long enough to hold
        every connection's :meth:`admit` and :meth:`settle` up), one walk at a time: a thread that waited
        for another's walk uses its result.
        """
        with self._measuring:
            with self._disk:
                if self._used is not None and time.monotonic() - self._used[0] <= max_age:
                    return
                start, settled = time.monotonic(), self._settled
            total = 0
            for dirpath, _dirs, files in os.walk(root):
                for name in files:
                    try:
                        total += os.stat(os.path.join(dirpath, name), follow_symlinks=False).st_size
                    except OSError:  # gone meanwhile (pruned, renamed)
                        continue
            with self._disk:
                # Chunks stored during the walk, which it may have missed: counted (twice if it saw them,
                # too much rather than too little, until the next measurement).
                self._used = (start, total + self._settled - settled)

    def put(self, ns: str, key: str, snap: KVSnapshot, admitted: int = 0) -> int:
        """Store a chunk whose bytes matched its digest, once it holds the KV heads its key names; its bytes on disk.

        Every channel stores through here: a slice under a whole chunk's key
        (or another slice's) would be loaded for heads it does not hold. With
        ``keys``, the chunk's MAC is checked here too (one more pass over its
        bytes, off any engine's critical path).

        ``admitted``: the bytes :meth:`admit` promised the chunk from what the
        sender announced. Its file can take more (every buffer starts on a
        4 KiB boundary: a sender choosing many tiny buffers would otherwise
        write tens of times its announced size past the quota), so the
        difference is admitted here, before anything is written.

        A chunk already stored is kept, unless it lacks the linear-attention
        states the incoming one carries (a store with ``has_states``, as
        :class:`~hurray_vllm.chunks.store.DirectoryStore`): then it is replaced.

        Raises:
            HurrayFormatError: the heads differ from the key's (field ``snapshot.heads``), the
                chunk's model is not the namespace's (``snapshot.fingerprint``), its file
                would break the quota or the disk's floor (as :meth:`admit`), or
                (with ``keys``) the chunk is unsigned, signed with another key or its MAC is
                wrong (fields of :mod:`hurray_vllm.chunks.signing`).
        """
        check_named_heads(snap, check_names(ns, key))
        if snap.fingerprint is None or namespace_of(snap.fingerprint) != ns:
            # No consumer of this namespace would take it (another model's chunk): not worth the disk.
            raise HurrayFormatError("snapshot.fingerprint", f"chunk's model does not belong in namespace {ns}")
        if self.keys is not None:
            check_signature(snap, self.keys, ns, key)
        size_of = getattr(self.store, "size_of", None)
        extra = 0
        if size_of is not None and self._limits_disk():
            extra = max(0, int(size_of(snap)) - admitted)
            self.admit(extra)
        path = getattr(self.store, "path", None)  # a directory store: what the file takes on disk
        replaced = 0
        try:
            if snap.states is not None and self._lacks_states(ns, key):
                # A producer writing a chunk again with its linear-attention states (as the connector does over
                # its own stateless copy): kept as it would be kept locally, else a load resumes earlier here.
                replaced = _size_on_disk(path, ns, key)  # counted already: only the difference is new
                written = self.store.put(ns, key, snap, replace=True)  # type: ignore[call-arg]  # it can
            else:
                written = self.store.put(ns, key, snap)
                if written is False and snap.states is not None and self._lacks_states(ns, key):
                    # A stateless copy another connection stored while this one wrote (the store keeps the first
                    # writer's): replaced as above, else the receiver answers OK and keeps the copy holding less.
                    replaced = _size_on_disk(path, ns, key)
                    written = self.store.put(ns, key, snap, replace=True)  # type: ignore[call-arg]  # it can
        finally:
            if extra:
                self.settle(extra, 0)  # the caller's settle counts the file's bytes as used
        if written is False:  # held already, and kept: nothing was written, nothing more is used
            return 0
        return max(0, _size_on_disk(path, ns, key) - replaced)

    def _binding_of(self, conn: socket.socket) -> bytes:
        """What the key handshake on ``conn`` is bound to: this receiver's certificate over TLS, none on plain TCP."""
        if not isinstance(conn, ssl.SSLSocket):
            return b""
        if self._binding is None:  # a TLS context whose certificate is unknown, keys given after the start
            raise HurrayFormatError(
                "receiver.auth",
                "this receiver cannot bind the key handshake to its TLS certificate: make its TLS context with "
                "hurray_vllm.transport.security.server_context",
            )
        return self._binding

    def _lacks_states(self, ns: str, key: str) -> bool:
        """Whether the store holds chunk ``key`` without linear-attention states (a store that cannot tell: no)."""
        has = getattr(self.store, "has", None)
        has_states = getattr(self.store, "has_states", None)
        return has is not None and has_states is not None and has(ns, key) and not has_states(ns, key)

    def next_frame(self, conn: socket.socket, magic: bytes, *, first: bool = False) -> bool:
        """Wait (up to ``idle_timeout``) for the next frame's magic; False when the peer closed cleanly.

        Afterwards the connection's timeout is ``timeout``: the rest of the
        frame must follow promptly.

        ``first``: the connection's first frame, whose first byte must come within :data:`HANDSHAKE_TIMEOUT_S`
        (or a shorter ``timeout`` or ``idle_timeout``): a sender sends it as soon as it connected (and made
        its handshakes), and a peer opening connections without a word would otherwise hold every connection
        slot for the idle timeout. Any frame after it (a held-chunk query too) starts the idle timeout.
        """
        wait = min(self.idle_timeout, self.timeout, HANDSHAKE_TIMEOUT_S) if first else self.idle_timeout
        while True:
            self.disarm(conn)
            conn.settimeout(wait)
            head = conn.recv(len(magic))
            if not head:
                return False
            wait = self.idle_timeout
            self.arm(conn, self.timeout)
            conn.settimeout(self.timeout)
            if len(head) < len(magic):
                head += recv_exact(conn, len(magic) - len(head))
            if head == AUTH_MAGIC:  # a keyed sender, here or again: answered, then its frame follows
                answer_handshake(conn, self.keys, self._binding_of(conn))  # refused without keys
                continue
            if head == V1_AUTH_MAGIC:  # a sender of an older hurray-vllm: refused, naming the version
                raise refuse_v1_handshake(conn)
            if head == HELD_MAGIC:  # a question between chunks: answered, then the next frame follows
                self._answer_held(conn)
                continue
            if head != magic:
                if head[:1] == _TLS_HANDSHAKE and not isinstance(conn, ssl.SSLSocket):
                    raise _tls_to_plain()
                raise HurrayFormatError("transport", "bad frame magic")
            return True

    def _answer_held(self, conn: socket.socket) -> None:
        """Answer a held-chunk query (after its magic): one flag per name, 1 if the store holds that file.

        Raises:
            HurrayFormatError: a malformed query (too many names, a name that is not a chunk's): the
                connection is dropped.
        """
        (count,) = U16.unpack(recv_exact(conn, 2))
        if count > MAX_HELD_QUERY:
            raise HurrayFormatError("transport", f"held-chunk query of {count} names, more than {MAX_HELD_QUERY}")
        names = []
        for _ in range(count):
            ns, key = _read_name(conn), _read_name(conn)
            check_names(ns, key)
            names.append((ns, key))
        has = getattr(self.store, "has", None)  # a store that cannot tell holds nothing for this purpose
        flags = bytes(1 if has is not None and has(ns, key) else 0 for ns, key in names)
        conn.sendall(b"HV" + U16.pack(count) + flags)

    @abc.abstractmethod
    def serve(self, conn: socket.socket) -> None:
        """Serve one connection until it closes (on its own thread; the socket is closed afterwards)."""

    def _accept(self) -> None:
        pause = _ACCEPT_PAUSE_S
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError as failure:
                if self._stop.is_set():
                    return  # stop() closed the socket
                # Out of file descriptors or kernel buffers (EMFILE, ENFILE, ENOBUFS): passing, and the
                # receiver must outlive it; returning would leave senders queued in the backlog until
                # they time out, and every later push lost.
                log.warning(
                    "hurray %s receiver: accept failed (%s); retrying in %.2f s", self.transport, failure, pause
                )
                self._stop.wait(pause)
                pause = min(2 * pause, _ACCEPT_PAUSE_MAX_S)
                continue
            pause = _ACCEPT_PAUSE_S
            if self._stop.is_set():  # accepted as stop() began: it may have looked at the connections already
                conn.close()
                return
            with self._mu:
                full = len(self._conns) >= self.max_connections
            if full and self._evict_unproven():
                full = False
            if full:
                exc = HurrayFormatError("receiver.connections", f"more than {self.max_connections} connections")
                self.count(False, str(exc))
                log.warning("hurray %s receiver: refusing a connection: %s", self.transport, exc)
                if self._refusing.acquire(blocking=False):
                    try:
                        threading.Thread(target=self._refuse, args=(conn, exc), daemon=True).start()
                    except RuntimeError:  # no thread to be had: close unanswered, keep the slot and the accepting
                        self._refusing.release()
                        conn.close()
                else:  # a flood: no thread, no answer
                    conn.close()
                continue
            thread = threading.Thread(
                target=self._connection, args=(conn,), name=f"hurray-{self.transport}-conn", daemon=True
            )
            with self._mu:  # before it runs: stop() shuts the connection and waits for the thread
                self._conns.add(conn)
                self._threads.add(thread)
            try:
                thread.start()
            except RuntimeError as no_thread:  # none to be had: refuse this one, keep accepting
                with self._mu:
                    self._conns.discard(conn)
                    self._threads.discard(thread)
                self.count(False, f"receiver.connections: {no_thread}")
                log.warning("hurray %s receiver: refusing a connection: %s", self.transport, no_thread)
                conn.close()

    def _evict_unproven(self) -> bool:
        """Shut the oldest connection still in its TLS or key handshake, so a newcomer takes its place.

        A peer without the key could otherwise hold every slot of a keyed receiver: each silent connection is
        cut at the handshake deadline, and it opens the next (64 of them, reopened ~6 a second, refused every
        sender). A real sender's handshake takes a round trip; a slot held longer is given up first. Evicted
        connections leave within moments (their thread sees the socket shut), so at most twice
        ``max_connections`` are open at once. Returns whether one was evicted.
        """
        with self._mu:
            if not self._unproven or len(self._conns) >= 2 * self.max_connections:
                return False
            held = self._unproven.pop(next(iter(self._unproven)))
        log.info("hurray %s receiver: full; cutting the oldest connection still in its handshakes", self.transport)
        for sock in list(held):
            with contextlib.suppress(OSError):
                # The plain socket's shutdown, also under TLS: SSLSocket.shutdown would first try the TLS close.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
        return True

    def _refuse(self, conn: socket.socket, exc: BaseException) -> None:
        try:
            _refuse_connection(conn, exc)
        finally:
            self._refusing.release()

    def _secure(self, conn: socket.socket, held: list[socket.socket]) -> socket.socket | None:
        """The connection after TLS and the key handshake, as configured; ``None`` if refused (and closed).

        ``held``: the sockets of this connection :meth:`stop` and the deadline
        reach; the TLS socket joins it before its handshake starts. A
        connection closed before it sent a byte (a health probe) is closed
        uncounted: nothing was asked, nothing refused.
        """
        conn.settimeout(self.timeout)
        if self.tls is not None:
            try:
                first = conn.recv(1, socket.MSG_PEEK)  # waits for the first byte: the deadline and stop() reach it
            except OSError as exc:
                self._refuse_secure(conn, f"receiver.tls: no TLS handshake: {exc}", None)
                return None
            if not first:  # closed unused (or cut by the deadline: then counted as that, as the connection ends)
                conn.close()
                return None
            if first == b"H":  # a frame magic in plaintext: a tcp:// sender, told so in plaintext
                self._refuse_secure(conn, "", _plain_to_tls())
                return None
            secured = self._handshake_tls(self.tls, conn, held)
            if secured is None:
                return None
            conn = secured
        if self.keys is None:
            return conn
        try:
            head = conn.recv(len(AUTH_MAGIC))
            if not head:  # closed before a byte (TLS: right after its handshake): a probe, not a refusal
                conn.close()
                return None
            if len(head) < len(AUTH_MAGIC):
                head += recv_exact(conn, len(AUTH_MAGIC) - len(head))
            if head == V1_AUTH_MAGIC:
                raise refuse_v1_handshake(conn)
            if head[:1] == _TLS_HANDSHAKE and self.tls is None:
                raise _tls_to_plain()
            if head != AUTH_MAGIC:
                raise HurrayFormatError(
                    "receiver.auth",
                    "this receiver takes chunks only from senders holding the fleet key "
                    "(hurray_key_file, HURRAY_VLLM_KEY_FILE or --key-file)",
                )
            answer_handshake(conn, self.keys, self._binding_of(conn))
        except (HurrayFormatError, OSError) as exc:
            self._refuse_secure(conn, str(exc), exc)
            return None
        return conn

    def _handshake_tls(
        self, tls: ssl.SSLContext, raw: socket.socket, held: list[socket.socket]
    ) -> socket.socket | None:
        """``raw`` inside TLS, its handshake done; ``None`` if it failed (counted and closed).

        ``wrap_socket`` moves the descriptor to the TLS socket: the plain one can no longer be shut. So the
        TLS socket takes its place in ``held``, the connections :meth:`stop` shuts and the deadlines, before
        the handshake starts (``do_handshake_on_connect=False``); a peer stalling or trickling the handshake
        (or the key handshake after it) is cut at the frame's deadline, and at once by :meth:`stop`.
        """
        try:
            conn = tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:
            self._refuse_secure(raw, f"receiver.tls: TLS failed: {exc}", None)
            return None
        held.append(conn)
        with self._mu:
            self._conns.discard(raw)
            self._conns.add(conn)
            # Gone only if the watchdog found it overdue meanwhile (and could not shut it): due now. Its
            # mark goes too: the cut is marked (and counted) once, for the TLS socket.
            self._deadlines[conn] = self._deadlines.pop(raw, time.monotonic())
            self._overdue.discard(raw)
        if self.stopping:  # stop() may have looked at the connections before the TLS socket took raw's place
            conn.close()
            return None
        try:
            conn.do_handshake()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError: plaintext, an untrusted client
            if self.stopping:  # stop() shut it: no refusal of the peer's
                conn.close()
            else:
                self._refuse_secure(conn, f"receiver.tls: TLS handshake failed: {exc}", None)
            return None
        return conn

    def _refuse_secure(self, conn: socket.socket, reason: str, answer: BaseException | None) -> None:
        """Count and log a connection refused before its first frame; answer ``answer`` (if any) and close it."""
        reason = reason or str(answer)
        self.count(False, reason)
        log.warning("hurray %s receiver: refusing a connection: %s", self.transport, reason)
        with conn:
            if answer is not None:
                finish_with_error(conn, answer)

    def _connection(self, conn: socket.socket) -> None:
        with self._mu:
            self._conns.add(conn)
        held = [conn]
        self._local.held = held  # count() looks up whether the watchdog cut this connection
        self.arm(conn, min(self.timeout, HANDSHAKE_TIMEOUT_S))  # TLS and the key handshake, as one short frame
        if self.keys is not None or self.tls is not None:
            with self._mu:
                self._unproven[id(held)] = held
        try:
            try:
                secured = self._secure(conn, held)
            except Exception as exc:  # a bug or an unforeseen library error: refuse, never die silently
                self.count(False, f"{type(exc).__name__}: {exc}")
                log.exception("hurray %s receiver: connection failed before its first frame", self.transport)
                with conn:
                    finish_with_error(conn, exc)
                return
            finally:
                with self._mu:
                    self._unproven.pop(id(held), None)
            if secured is None:
                return
            conn = secured
            self.disarm(conn)  # the handshake is over: the idle timeout applies until the first frame
            with conn:
                try:
                    self.serve(conn)
                except Exception as exc:  # a bug or an unforeseen library error: refuse, never die silently
                    self.count(False, f"{type(exc).__name__}: {exc}")
                    log.exception("hurray %s receiver: connection failed, nothing stored", self.transport)
                    finish_with_error(conn, exc)
        finally:
            with self._mu:
                # Cut where nothing counted the frame (its head, a held-chunk query, the handshake).
                uncounted = any(c in self._overdue for c in held) and not getattr(self._local, "counted", False)
            if uncounted:  # counted before the connection is gone: whoever sees it gone sees the count
                self.count(False, _OVERDUE)
            with self._mu:
                for c in held:
                    self._conns.discard(c)
                    self._deadlines.pop(c, None)
                    self._overdue.discard(c)
                self._threads.discard(threading.current_thread())
            self._local.held, self._local.counted = (), False
