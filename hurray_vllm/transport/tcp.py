"""The TCP channel: KV chunks streamed over one TCP connection as Hurray streams, in the clear or over TLS.

``tcp://HOST:PORT`` is plain TCP; ``tls://HOST:PORT`` the same frames inside
TLS (:mod:`.security`: the receiver runs with a certificate and refuses
plaintext).

One connection carries any number of chunks; each is framed as::

    b"HVC1"  u16 len + namespace  u16 len + key  u64 stream_length  <Hurray stream>

and answered by the receiver with ``b"OK"`` once the chunk is validated and
stored (atomically), or ``b"ER"`` + u16 length + message when it was
refused. A chunk refused once its payload was let in (a wrong digest or
signature, the store failing) is read to its end and the connection stays
open; one refused before (a bad name, too large, no room in the quota or
in memory) is not read: the connection closes after the answer. Between
chunks a sender may ask which chunks the receiver holds (``b"HVH1"``,
:func:`~.base.query_held`). The sender waits for each answer,
so when :func:`send_chunks` returns the chunks are durable on the other
side. Nothing that fails validation (truncated, corrupt, wrong digest) is
ever stored.
"""

from __future__ import annotations

import contextlib
import errno
import io
import itertools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO, cast

from ..chunks.signing import FleetKeys
from ..chunks.store import ChunkStore, digest_matches
from ..containers.io import read_stream, write_stream
from ..errors import HurrayFormatError, integer_arg
from .base import (
    DEFAULT_TIMEOUT_S,
    FRAME_MIN_RATE,
    MAX_CHUNK_BYTES,
    U16,
    U64,
    Chunk,
    ChunkSender,
    ReceiverBase,
    SendAborted,
    check_names,
    check_timeout,
    dial,
    finish_with_error,
    first_of,
    parse_address,
    read_answer,
    read_message,
    recv_exact,
    send_error,
)
from .security import client_context

__all__ = ["Receiver", "TcpSender", "send_chunks", "connect", "parse_url", "frame_head", "MAGIC", "MAX_CHUNK_BYTES"]

log = logging.getLogger("hurray_vllm.transport.tcp")
MAGIC = b"HVC1"
#: Memory for the chunks a TCP receiver is reading, all connections together (as NIXL's arena).
DEFAULT_INFLIGHT_BYTES = 8 << 30
#: How long a sender whose write failed waits for the receiver's refusal (already sent, if there is one).
_ANSWER_AFTER_LOSS_S = 1.0


def parse_url(url: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` or ``tls://HOST:PORT`` -> ``(HOST, PORT)``; :class:`HurrayFormatError` otherwise."""
    return parse_address(url, "tls" if url.startswith("tls://") else "tcp")


def send_chunks(
    url: str,
    chunks: Iterable[Chunk],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    keys: FleetKeys | None = None,
    tls: ssl.SSLContext | None = None,
) -> None:
    """Stream ``(namespace, key, snapshot)`` chunks to the receiver at ``url``; wait for each answer.

    ``chunks`` is consumed lazily: a chunk is asked for only after the
    receiver acknowledged the previous one (the first before connecting: a
    receiver waits :data:`~.base.HANDSHAKE_TIMEOUT_S` at most for a new
    connection's first frame). Page pools go from their tensors to the
    socket without an intermediate copy.

    Args:
        url: ``tcp://HOST:PORT``, or ``tls://HOST:PORT`` for TLS.
        chunks: ``(namespace, key, snapshot)`` triples.
        timeout: Seconds each step (connect, a chunk's answer) may take; a chunk's write, that plus
            :data:`SENDER_RATE_SLACK` seconds per MiB (eight times what a receiver allows, so that a
            receiver with a longer timeout than this is not cut short by the sender).
        keys: Fleet keys: authenticate as their holder first (:mod:`.security`).
        tls: The client TLS context for a ``tls://`` URL (default: the system's CAs).

    Raises:
        HurrayFormatError: the receiver refused a chunk or the authentication, or ``url`` is malformed.
        OSError: the receiver cannot be reached or stopped answering within ``timeout`` (``TimeoutError``
            too when it took a chunk slower than that plus 8 seconds per MiB); ``ssl.SSLError`` (an
            ``OSError``) when its certificate is not trusted.
        HurrayArgumentError: (field ``timeout``) not positive seconds below :data:`~.base.MAX_TIMEOUT_S`.
    """
    timeout = check_timeout(timeout)  # before any chunk is made: a socket refused it deep inside, in its own words
    first, rest = first_of(chunks)
    with connect(url, timeout=timeout, keys=keys, tls=tls) as sock:
        _send_over(sock, itertools.chain(first, rest))


def connect(
    url: str,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    keys: FleetKeys | None = None,
    tls: ssl.SSLContext | None = None,
    track: Callable[[socket.socket], None] | None = None,
    aborted: Callable[[], bool] | None = None,
) -> socket.socket:
    """A connection to the receiver at ``url``: TLS for ``tls://``, then the sender authentication with ``keys``.

    ``track`` sees each socket as soon as it exists (before the connect and the handshakes), so
    another thread can shut it down (:meth:`TcpSender.abort`); ``aborted`` says when to give up.

    Raises:
        HurrayFormatError: ``url`` is malformed, or the receiver refused the authentication.
        OSError: the receiver cannot be reached; ``ssl.SSLError`` when its certificate is not trusted.
    """
    host, port = parse_url(url)
    context = (tls or client_context()) if url.startswith("tls://") else None
    return dial(host, port, timeout=timeout, keys=keys, tls=context, track=track, aborted=aborted)


def frame_head(ns: str, key: str, size: int) -> bytes:
    """A chunk frame's head: ``HVC1``, the namespace and key (u16 length + UTF-8 each), the stream's u64 length."""
    nsb, kb = ns.encode(), key.encode()
    return MAGIC + U16.pack(len(nsb)) + nsb + U16.pack(len(kb)) + kb + U64.pack(size)


def _send_over(sock: socket.socket, chunks: Iterable[Chunk]) -> None:
    """Send ``chunks`` on ``sock`` through a buffered writer, waiting for each answer."""
    raw = _Paced(sock)
    out = io.BufferedWriter(raw)  # as sock.makefile("wb"): small pieces coalesced, page pools written as they are
    try:
        _send_all(sock, out, raw, chunks)
    except BaseException:
        # What a failed write left in the buffer would be flushed again as the writer closes, and wait
        # out the timeout a second time: the connection is shut first, so that flush fails at once.
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's, also under TLS
        except OSError:
            pass
        try:
            out.close()
        except OSError:
            pass  # the flush into the shut connection: the first error is the one to raise
        raise
    out.close()


#: How a write fails when the receiver closed the connection: a broken pipe, a reset; over TLS an EOF.
_LOST = (BrokenPipeError, ConnectionResetError, ssl.SSLEOFError, ssl.SSLZeroReturnError)
#: Said when a plain connection ends before the receiver's first answer, and before it could have read any of the
#: payload (:func:`_payload_unread`): a TLS receiver does that (before 0.3).
_TLS_HINT = "the receiver ended the connection before its first answer: does the receiver use TLS? (tls:// vs tcp://)"
#: How much slower than the receivers' own rule (:data:`~.base.FRAME_MIN_RATE`) a sender lets a chunk's write go
#: before it gives up: 8 s per MiB beyond its timeout. Only a receiver that reads a trickle meets it.
SENDER_RATE_SLACK = 8

#: What a receiver's socket may hold that its reader never read, beyond the sender's own send buffer (Linux
#: starts a receive buffer at 128 KiB and grows it, to 6 MiB by default, only as its reader reads).
_PEER_BUFFER = 8 << 20


def _send_all(sock: socket.socket, out: BinaryIO, raw: _Paced, chunks: Iterable[Chunk]) -> None:
    answered = isinstance(sock, ssl.SSLSocket)  # over TLS the scheme is right: no hint about it
    timeout = sock.gettimeout()
    for ns, key, snap in chunks:
        # Encoded once into a list of pieces (descriptors, and views of the page pools: no copy), so
        # that the frame can announce the stream's length before it; then sent with one call.
        pieces = _Pieces()
        # Unchecked: the receiver validates every chunk, and validating here cost ~3.5 ms per 32-layer chunk.
        size = write_stream(snap, cast(BinaryIO, pieces), check=False)
        head = frame_head(ns, key, size)
        try:
            try:
                if timeout is not None:
                    # The socket's timeout alone bounds each write: a receiver reading a little before each one
                    # ran out would hold the sender for as long as it liked. The chunk's own bound is looser
                    # than the receiver's rule (one timeout plus a second per MiB, FRAME_MIN_RATE) by
                    # SENDER_RATE_SLACK: a receiver given a longer timeout than this sender's (a slow link) must
                    # not see its chunks cut by the sender first.
                    nbytes = len(head) + size
                    raw.pace(key, nbytes, timeout + nbytes * SENDER_RATE_SLACK / FRAME_MIN_RATE)
                try:
                    out.write(head)
                    out.writelines(pieces.parts)
                    out.flush()
                finally:
                    raw.unpace()  # the answer's wait has the socket's own timeout
            except _LOST as lost:
                _raise_refusal(sock, key, lost)
                raise
            read_answer(sock, key)
        except (ConnectionResetError, BrokenPipeError) as lost:
            if answered or not _payload_unread(sock, raw):
                raise
            raise type(lost)(lost.errno, f"{lost.strerror}: {_TLS_HINT}") from lost
        except HurrayFormatError as exc:
            if (
                answered
                or not str(exc).endswith("connection closed after 0 of 2 bytes")
                or not _payload_unread(sock, raw)
            ):
                raise
            raise HurrayFormatError(exc.field, f"{str(exc).partition(': ')[2]}: {_TLS_HINT}") from exc
        answered = True
        del pieces  # the views: not kept alive while the next chunk is exported


def _payload_unread(sock: socket.socket, raw: _Paced) -> bool:
    """Whether the receiver may have read none of the payload: what the socket took fits in two sockets' buffers.

    A TLS receiver hangs up on the first bytes of a plaintext frame; one that hangs up (crashes, stops) after
    it read more than the buffers hold speaks the frames: asking it about TLS would mislead.
    """
    try:
        own = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    except OSError:
        own = 0
    return raw.handed <= own + _PEER_BUFFER


def _raise_refusal(sock: socket.socket, key: str, lost: OSError) -> None:
    """Raise the receiver's refusal of chunk ``key`` if it sent one before the connection broke; else return.

    A receiver refuses a chunk it will not read (too large, beyond the quota or its memory) at its head,
    and closes; the sender, still writing the payload, then fails with a broken pipe or a reset (over TLS,
    an ``ssl.SSLEOFError``). The refusal, which says why, is usually in the socket's buffer already: it is
    the error to raise.
    """
    deadline = time.monotonic() + _ANSWER_AFTER_LOSS_S
    try:
        answer = recv_exact(sock, 2, deadline)
    except (HurrayFormatError, OSError):  # closed with nothing to read (or the reset discarded it)
        return  # the write's own error stands
    if answer == b"ER":
        raise HurrayFormatError("transport", f"receiver refused chunk {key}: {read_message(sock, deadline)}") from lost


class TcpSender(ChunkSender):
    """:func:`send_chunks` as a :class:`~.base.ChunkSender` (one connection per :meth:`send`).

    Args:
        tls: The client TLS context ``tls://`` URLs use (default: the system's CAs).
    """

    scheme = "tcp"

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls

    def send(
        self,
        url: str,
        chunks: Iterable[Chunk],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        keys: FleetKeys | None = None,
        owner: object | None = None,
    ) -> None:
        """See :func:`send_chunks`; :meth:`abort` (for every caller, or for ``owner``) makes it fail at once."""
        timeout = check_timeout(timeout)
        with self._calling(owner) as (_, aborted):
            first, rest = first_of(chunks)
            with self.tracked(url, timeout=timeout, keys=keys, owner=owner) as sock:
                if aborted():  # aborted while the first chunk was made: before any socket it could shut
                    raise SendAborted(f"the {self.scheme} call to {url} was aborted")
                _send_over(sock, itertools.chain(first, rest))

    def connect(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        keys: FleetKeys | None = None,
        track: Callable[[socket.socket], None] | None = None,
        aborted: Callable[[], bool] | None = None,
    ) -> socket.socket:
        """See :func:`connect` (module level)."""
        return connect(url, timeout=timeout, keys=keys, tls=self.tls, track=track, aborted=aborted)


class _Pieces(io.RawIOBase):
    """A sink that keeps what is written to it.

    Views are kept by reference (their memory must stay alive), and each ``bytearray`` as a copy: the
    stream writer reuses those for its descriptors.
    """

    def __init__(self) -> None:
        self.parts: list[bytes | bytearray | memoryview] = []

    def writable(self) -> bool:
        return True

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        self.parts.append(bytes(b) if isinstance(b, bytearray) else b)
        return memoryview(b).nbytes


#: The most one write hands the socket (a view: no copy). A TLS socket's write waits for all it is given,
#: under one timeout: a whole page pool in one call would take the deadline's bound on it away.
_PIECE = 4 << 20


class _Paced(io.RawIOBase):
    """A sender's socket as a raw file whose writes end by a deadline (:meth:`pace`, per chunk).

    Each write waits the socket's timeout at most or, if sooner, until the deadline: a receiver reading a
    little before each timeout ran out cannot hold the sender beyond it. ``handed``: the bytes the socket
    took, all chunks together.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()
        self.handed = 0
        self._chunk: tuple[str, int, float, float, int] | None = None  # key, bytes, seconds, start, handed before

    def writable(self) -> bool:
        return True

    def pace(self, key: str, nbytes: int, seconds: float) -> None:
        """Chunk ``key``'s ``nbytes`` must be handed to the socket within ``seconds`` from now."""
        self._chunk = (key, nbytes, seconds, time.monotonic(), self.handed)

    def unpace(self) -> None:
        """No deadline any more; the socket's own timeout again."""
        self._chunk = None
        with contextlib.suppress(OSError):  # closed meanwhile: nothing more is written to it
            self._sock.settimeout(self._timeout)

    def write(self, b: Any, /) -> int:  # a buffer: BufferedWriter passes a view of its own or of the caller's bytes
        view = memoryview(b).cast("B")[:_PIECE]
        chunk = self._chunk
        if chunk is not None:
            left = chunk[3] + chunk[2] - time.monotonic()
            if left <= 0:
                raise self._overdue(chunk)
            self._sock.settimeout(left if self._timeout is None else min(left, self._timeout))
        try:
            n = self._sock.send(view)
        except TimeoutError as exc:
            if chunk is None or time.monotonic() < chunk[3] + chunk[2]:
                raise  # the socket's own timeout (no progress within it), not the chunk's deadline
            raise self._overdue(chunk) from exc
        self.handed += n
        return n

    def _overdue(self, chunk: tuple[str, int, float, float, int]) -> TimeoutError:
        key, nbytes, seconds, start, before = chunk
        return TimeoutError(
            errno.ETIMEDOUT,
            f"the tcp receiver took {self.handed - before} of the {nbytes} bytes of chunk {key} in "
            f"{time.monotonic() - start:.1f} s (a chunk may take {seconds:.0f} s: the timeout, plus "
            f"{SENDER_RATE_SLACK} seconds per MiB): it stopped reading, or reads too slowly",
        )


class _Limited(io.RawIOBase):
    """Exactly ``n`` bytes of a socket, as a file the stream reader can read.

    ``progress`` sees how many bytes arrived so far after each read (the receiver moves the frame's
    deadline with them).
    """

    def __init__(self, sock: socket.socket, n: int, progress: Callable[[int], None] | None = None) -> None:
        self._sock, self._left, self._got, self._progress = sock, n, 0, progress

    @property
    def left(self) -> int:
        """The bytes not read yet."""
        return self._left

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        if self._left == 0:
            return 0
        n = self._sock.recv_into(b, min(len(b), self._left))
        if n == 0:
            raise HurrayFormatError("transport", "sender disconnected in the middle of a chunk")
        self._left -= n
        self._got += n
        if self._progress is not None:
            self._progress(self._got)
        return n

    def drain(self) -> None:
        while self._left:
            self.readinto(memoryview(bytearray(min(self._left, 1 << 20))))


class Receiver(ReceiverBase):
    """Accepts chunks on ``host:port`` and stores the valid ones in ``store``.

    Daemon threads, one per connection; :meth:`stop` closes it (see
    :class:`~.base.ReceiverBase` for the arguments). A frame's body is read
    straight into the stream reader, which validates it as any input; a
    chunk whose digest does not match is refused.

    Args:
        host: The address to listen on.
        port: The port; 0 picks a free one (see ``address``).
        store: Where accepted chunks go.
        timeout: How long one frame may take to arrive, in seconds.
        idle_timeout: How long a connection may stay silent between chunks (before its first:
            :data:`~.base.HANDSHAKE_TIMEOUT_S` at most, as :meth:`~.base.ReceiverBase.next_frame` says).
        max_chunk_bytes: The largest stream accepted for one chunk.
        max_inflight_bytes: The chunks read at once, all connections together,
            in bytes: each is read into memory before its digest is checked,
            so without this bound 64 connections announcing 4 GiB each could
            take 256 GiB. A chunk beyond it is refused unread (field
            ``receiver.memory``) unless no other is being read.
        **limits: ``timeout``, ``idle_timeout``, ``max_connections``, ``quota_bytes``,
            ``min_free_bytes``, ``keys``, ``tls``, as :class:`~.base.ReceiverBase` takes them.
    """

    transport = "tcp"

    def __init__(
        self,
        host: str,
        port: int,
        store: ChunkStore,
        *,
        max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
        **limits: Any,
    ) -> None:
        # 1.5 compared as 2, a string failed with a bare TypeError.
        max_inflight_bytes = integer_arg(max_inflight_bytes, "max_inflight_bytes", 1)
        super().__init__(host, port, store, **limits)
        self.max_inflight_bytes = max_inflight_bytes
        self._inflight = 0
        self._inflight_mu = threading.Lock()

    def _reserve(self, length: int) -> None:
        """Count ``length`` bytes as being read, or refuse the chunk (one chunk alone always fits)."""
        with self._inflight_mu:
            if self._inflight and self._inflight + length > self.max_inflight_bytes:
                raise HurrayFormatError(
                    "receiver.memory",
                    f"{self._inflight} bytes of chunks are being received; {length} more would pass the "
                    f"receiver's limit of {self.max_inflight_bytes} (--max-memory): try again later",
                )
            self._inflight += length

    def _release(self, length: int) -> None:
        with self._inflight_mu:
            self._inflight -= length

    def serve(self, conn: socket.socket) -> None:
        """Read frames until the sender closes; answer each chunk ``OK`` or ``ER``."""
        first = True
        while not self.stopping:
            try:
                if not self.next_frame(conn, MAGIC, first=first):
                    return
                first = False
                # Not UTF-8: no chunk's name either; check_names refuses it with an answer (and counts it).
                ns = recv_exact(conn, U16.unpack(recv_exact(conn, 2))[0]).decode(errors="replace")
                key = recv_exact(conn, U16.unpack(recv_exact(conn, 2))[0]).decode(errors="replace")
                (length,) = U64.unpack(recv_exact(conn, 8))
            except (HurrayFormatError, OSError) as exc:
                log.warning("hurray receiver: dropping connection: %s", exc)
                if isinstance(exc, HurrayFormatError):
                    # A frame refused at its head (bad magic: another protocol, a scanner; a head cut short) is
                    # counted as any refused frame is, so that refused / last_error show peers speaking garbage.
                    self.count(False, str(exc))
                    if exc.field in ("receiver.auth", "receiver.tls"):
                        # A sender that fails the key handshake (again mid-connection, or without keys here), or
                        # opens TLS to a plain receiver, is told why, as a keyed receiver tells it at the start.
                        finish_with_error(conn, exc)
                return
            if not self._chunk(conn, ns, key, length):
                return

    def _chunk(self, conn: socket.socket, ns: str, key: str, length: int) -> bool:
        """Receive, check and store one chunk's stream; False when the connection must be closed."""
        start = time.monotonic()

        def progress(got: int) -> None:
            # The deadline follows the bytes that arrived: a sender must keep up FRAME_MIN_RATE from the
            # start, after one timeout's grace. A deadline for the whole frame, set at its head, would let
            # a peer announcing 4 GiB and trickling a byte per recv timeout hold the memory and quota
            # reserved for it for over an hour.
            self.extend(conn, start + self.timeout + got / FRAME_MIN_RATE)

        body = _Limited(conn, length, progress)
        admitted, reserved, stored = False, False, 0
        try:
            check_names(ns, key)
            if length > self.max_chunk_bytes:
                raise HurrayFormatError(
                    "transport",
                    f"chunk of {length} bytes exceeds the limit of {self.max_chunk_bytes} bytes per chunk "
                    "(max_chunk_bytes; hurray-vllm receive --max-chunk): raise it on the receiver, or save "
                    "smaller chunks (hurray_chunk_tokens)",
                )
            self.arm(conn, self.timeout)  # until the first payload bytes; then as they arrive (progress)
            self._reserve(length)  # memory, before the payload is read into it
            reserved = True
            self.admit(length)  # the store's quota and the disk's floor, before the payload is read
            admitted = True
            snap = read_stream(io.BufferedReader(body), limit=length)  # no buffer larger than the frame
            if not body.left:
                # The frame arrived: checking and storing it is the receiver's own time, which no deadline
                # cuts (a slow disk would have a stored chunk counted refused, and its sender told nothing).
                self.disarm(conn)
            if not digest_matches(snap):
                raise HurrayFormatError("snapshot.digest", "chunk data does not match its digest")
            if self.stopping:  # stop() began: it waits for a put under way, and no other starts after it
                raise HurrayFormatError("transport", "the receiver is stopping")
            stored = self.put(ns, key, snap, admitted=length)
        except (HurrayFormatError, OSError) as exc:
            # Whether its payload was let in: then the rest of it is read and skipped, below (settling clears
            # ``admitted``, so it is noted first).
            read_on = admitted
            if admitted:  # released before the answer: a sender that retries at once finds the room
                self.settle(length, stored)
                admitted = False
            if reserved:
                self._release(length)
                reserved = False
            self.count(False, str(exc))
            log.warning("hurray receiver: refused chunk %s: %s", key, exc)
            try:
                # The rest of a refused frame is skipped so the next one can be read; a frame refused
                # before its payload was let in (a bad name, longer than the limit, no room for it) is
                # not worth reading: the connection closes instead.
                if not read_on:
                    finish_with_error(conn, exc)
                    return False
                body.drain()
            except (HurrayFormatError, OSError):
                return False
            return send_error(conn, exc)
        finally:
            if admitted:  # stored, or failed in a way the handlers above do not answer
                self.settle(length, stored)
            if reserved:
                self._release(length)
        self.count(True)
        try:
            conn.sendall(b"OK")
        except OSError:
            return False
        return True
