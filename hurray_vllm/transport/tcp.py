"""Server-to-server transport: KV chunks streamed over TCP as Hurray streams.

One connection carries any number of chunks; each is framed as::

    b"HVC1"  u16 len + namespace  u16 len + key  u64 stream_length  <Hurray stream>

and answered by the receiver with ``b"OK"`` once the chunk is validated and
stored (atomically), or ``b"ER"`` + u16 length + message when it was
refused. The sender waits for each answer, so when :func:`send_chunks`
returns the chunks are durable on the other side. Nothing that fails
validation (truncated, corrupt, wrong digest) is ever stored.
"""

from __future__ import annotations

import io
import logging
import re
import socket
import struct
import threading
from collections.abc import Iterable
from typing import BinaryIO, cast
from urllib.parse import urlparse

from ..chunks.store import DirectoryStore, digest_matches
from ..containers.io import read_stream, write_stream
from ..errors import HurrayFormatError
from ..kv.snapshot import KVSnapshot

__all__ = ["Receiver", "send_chunks", "parse_url"]

log = logging.getLogger("hurray_vllm.transport.tcp")
MAGIC = b"HVC1"
_NAME = re.compile(r"^[0-9a-f]{1,64}$")
#: The largest chunk a receiver accepts (a 256-token chunk of a 70B model is ~80 MiB).
MAX_CHUNK_BYTES = 4 << 30


def parse_url(url: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> ``(HOST, PORT)``."""
    u = urlparse(url)
    if u.scheme != "tcp" or not u.hostname or not u.port:
        raise HurrayFormatError("hurray_url", f"expected tcp://HOST:PORT, got {url!r}")
    return u.hostname, u.port


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(min(n - len(buf), 1 << 20))
        if not part:
            raise HurrayFormatError("transport", f"connection closed after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)


def send_chunks(url: str, chunks: Iterable[tuple[str, str, KVSnapshot]], *, timeout: float = 60.0) -> None:
    """Stream ``(namespace, key, snapshot)`` chunks to the receiver at ``url``; wait for each answer.

    ``chunks`` is consumed lazily: a chunk is asked for only after the
    receiver acknowledged the previous one. Page pools go from their tensors
    to the socket without an intermediate copy.

    Raises :class:`HurrayFormatError` when the receiver refuses a chunk and
    ``OSError`` when it cannot be reached.
    """
    host, port = parse_url(url)
    with socket.create_connection((host, port), timeout=timeout) as sock, sock.makefile("wb") as out:
        for ns, key, snap in chunks:
            # The frame announces the stream's length: a first pass counts it without copying
            # anything (serialising into memory first took ~170 ms for 256 MiB).
            size = write_stream(snap, cast(BinaryIO, _Counter()))
            header = MAGIC + struct.pack("<H", len(ns)) + ns.encode() + struct.pack("<H", len(key)) + key.encode()
            out.write(header + struct.pack("<Q", size))
            written = write_stream(snap, out)
            out.flush()
            if written != size:  # the receiver would misread every later frame
                raise HurrayFormatError("transport", f"chunk {key} changed while it was sent")
            answer = _recv_exact(sock, 2)
            if answer != b"OK":
                (n,) = struct.unpack("<H", _recv_exact(sock, 2))
                raise HurrayFormatError("transport", f"receiver refused chunk {key}: {_recv_exact(sock, n).decode()}")


class _Counter(io.RawIOBase):
    """A sink that only counts what is written to it."""

    def writable(self) -> bool:
        return True

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        return memoryview(b).nbytes


class _Limited(io.RawIOBase):
    """Exactly ``n`` bytes of a socket, as a file the stream reader can read."""

    def __init__(self, sock: socket.socket, n: int) -> None:
        self._sock, self._left = sock, n

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        if self._left == 0:
            return 0
        n = self._sock.recv_into(b, min(len(b), self._left))
        if n == 0:
            raise HurrayFormatError("transport", "sender disconnected in the middle of a chunk")
        self._left -= n
        return n

    def drain(self) -> None:
        while self._left:
            self.readinto(memoryview(bytearray(min(self._left, 1 << 20))))


class Receiver:
    """Accepts chunks on ``host:port`` and stores the valid ones in ``store``.

    Runs in daemon threads (one per connection); :meth:`stop` closes it.
    """

    def __init__(self, host: str, port: int, store: DirectoryStore) -> None:
        self.store = store
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.address = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self.received = 0
        self.refused = 0

    def start(self) -> Receiver:
        threading.Thread(target=self._accept, name="hurray-receiver", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(120)
            while True:
                try:
                    head = conn.recv(4)
                    if not head:
                        return
                    if head != MAGIC:
                        raise HurrayFormatError("transport", "bad frame magic")
                    ns = _recv_exact(conn, struct.unpack("<H", _recv_exact(conn, 2))[0]).decode()
                    key = _recv_exact(conn, struct.unpack("<H", _recv_exact(conn, 2))[0]).decode()
                    (length,) = struct.unpack("<Q", _recv_exact(conn, 8))
                except (HurrayFormatError, OSError, UnicodeDecodeError) as exc:
                    log.warning("hurray receiver: dropping connection: %s", exc)
                    return
                body = _Limited(conn, length)
                try:
                    if not (_NAME.match(ns) and _NAME.match(key)):
                        raise HurrayFormatError("transport", "namespace and key must be lowercase hex")
                    if length > MAX_CHUNK_BYTES:
                        raise HurrayFormatError("transport", f"chunk of {length} bytes exceeds the limit")
                    snap = read_stream(io.BufferedReader(body))
                    if not digest_matches(snap):
                        raise HurrayFormatError("snapshot.digest", "chunk data does not match its digest")
                    self.store.put(ns, key, snap)
                    self.received += 1
                    conn.sendall(b"OK")
                except (HurrayFormatError, OSError) as exc:
                    self.refused += 1
                    log.warning("hurray receiver: refused chunk %s: %s", key, exc)
                    try:
                        body.drain()
                        msg = str(exc).encode()[:1000]
                        conn.sendall(b"ER" + struct.pack("<H", len(msg)) + msg)
                    except (HurrayFormatError, OSError):
                        return
