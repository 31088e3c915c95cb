"""The NIXL receiver: an arena of registered buffers the senders WRITE into, checked before anything is stored."""

from __future__ import annotations

import atexit
import logging
import queue
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...chunks.digest import ChunkDigest, digest_header
from ...chunks.signing import signing_secret
from ...chunks.store import ChunkStore
from ...errors import HurrayArgumentError, HurrayFormatError, integer_arg
from ...kv.snapshot import KVSnapshot
from ..base import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    MAX_CHUNK_BYTES,
    U16,
    U32,
    U64,
    ReceiverBase,
    finish_with_error,
    recv_exact,
    send_error,
)
from .agent import NixlError, make_agent
from .offer import (
    MAGIC,
    MAX_OFFER_BYTES,
    NOTIF_PREFIX,
    assemble_offer,
    check_offer,
    parse_offer,
    pool_offsets,
    transfer_seconds,
)

__all__ = ["NixlReceiver", "DEFAULT_ARENA_BYTES", "DEFAULT_OFFER_MEMORY_BYTES"]

log = logging.getLogger("hurray_vllm.transport.nixl")

#: How often the receiver polls notifications while a chunk is in flight (see ``sender._SEND_POLL_S``).
_RECV_POLL_S = 0.0005
#: How often the receiver polls its agent while a buffer is quarantined and no chunk is in flight: a
#: straggling WRITE lands (or is seen to land) only while the agent is polled (no progress thread).
_QUARANTINE_POLL_S = 0.05

#: Set at interpreter exit: every receiver's quarantine poller returns (see :func:`_stop_pollers`).
_EXITING = threading.Event()
_POLLERS: list[threading.Thread] = []
_POLLERS_MU = threading.Lock()


@atexit.register
def _stop_pollers() -> None:
    """At exit, end the quarantine pollers before the interpreter finalizes.

    They are daemon threads (a quarantine may outlast the process's wish to
    exit), and one left polling its agent runs NIXL's C++ while the
    interpreter tears down: the process then dies in ``std::terminate``
    instead of exiting with its status. A receiver stopped at exit leaves
    its quarantined slabs to the process's end.
    """
    _EXITING.set()
    with _POLLERS_MU:
        threads = list(_POLLERS)
    for t in threads:
        t.join(2.0)


#: Registered receive memory, all chunks in flight together (quarantined buffers count).
DEFAULT_ARENA_BYTES = 8 << 30
#: Memory for the offers being handled, all connections together: without a bound, 64 connections
#: announcing the largest offer would take 4 GiB outside the arena.
DEFAULT_OFFER_MEMORY_BYTES = 256 << 20
_MIN_SLAB = 16 << 20


def _readable(conn: socket.socket, timeout: float) -> bool:
    """Whether ``conn`` has something to read (or hung up) within ``timeout`` seconds.

    poll, not select: a busy engine's side channel may have a descriptor past
    select's limit of 1024, where select raises ValueError. poll counts whole
    milliseconds: a shorter wait only looks, then sleeps the rest.
    """
    watch = select.poll()
    watch.register(conn, select.POLLIN)
    ms = int(timeout * 1000)
    if watch.poll(ms):
        return True
    if not ms:
        time.sleep(timeout)
    return False


@dataclass(eq=False)
class _Slab:
    mem: torch.Tensor
    reg: Any
    #: Once quarantined, never deregistered (nor freed) before the receiver stops: see _Arena.quarantine.
    tainted: bool = False

    @property
    def size(self) -> int:
        return int(self.mem.numel())


@dataclass(eq=False)
class _Quarantined:
    slab: _Slab
    until: float  # monotonic; pushed back by every sign of the aborted transfer
    seconds: float


def _slab_size(need: int) -> int:
    """Room for ``need`` bytes, rounded up to 1/8 of its power of two (reused by similar chunks)."""
    need = max(need, _MIN_SLAB)
    step = max(1 << 20, 1 << (need.bit_length() - 4))
    return -(-need // step) * step


class _Arena:
    """Registered host memory for incoming page pools, reused from chunk to chunk.

    Grows by slabs (each registered once with NIXL); a chunk takes one slab
    at least as large as its pools. Never holds more than ``max_bytes``:
    free slabs are dropped to make room, and a chunk that cannot fit is refused.
    A slab that was ever quarantined is not dropped (see :meth:`quarantine`):
    it is reused, and counts against ``max_bytes``, until :meth:`close`.
    """

    def __init__(self, agent: Any, max_bytes: int, quarantine_s: float) -> None:
        self._agent = agent
        self.max_bytes = max_bytes
        self.quarantine_s = quarantine_s
        self._free: list[_Slab] = []
        self._quarantined: dict[int, _Quarantined] = {}  # by the aborted transfer's id
        self._mu = threading.Lock()
        self.total = 0
        self.registrations = 0
        self.closed = False
        self._busy = 0  # slabs taken by chunks and not yet given back (nor quarantined)
        #: Set when a slab is quarantined (or the arena closes): the receiver's poller wakes up.
        self.wake = threading.Event()

    @property
    def quarantined(self) -> int:
        """How many slabs are quarantined."""
        with self._mu:
            return len(self._quarantined)

    @property
    def settled(self) -> bool:
        """Whether no slab is in use by a chunk nor quarantined (once closed: every slab is deregistered)."""
        with self._mu:
            return not self._quarantined and not self._busy

    def take(self, sizes: list[int], vet: Callable[[], object] | None = None) -> tuple[_Slab, list[torch.Tensor]]:
        """A slab for pools of ``sizes`` bytes and their views in it (4 KiB-aligned).

        ``vet``, when given, is called (once, outside the arena's lock) before
        a slab is allocated and registered for these pools, none free being
        large enough; it refuses them by raising (what it returns is ignored).

        Raises:
            HurrayFormatError: ``receiver.memory``: the pools would pass ``max_bytes``: for now
                (slabs in use or quarantined), or for good (they alone take more). ``transport``:
                the receiver is stopping. Whatever ``vet`` raises.
        """
        offsets, need = pool_offsets(sizes)
        if need > self.max_bytes:
            # No slab could ever hold it: "try again later" would have the sender retry for good.
            raise HurrayFormatError(
                "receiver.memory",
                f"the chunk's page pools take {need} bytes (each on a 4 KiB boundary), more than the receiver's "
                f"arena may ever hold ({self.max_bytes} bytes): it can never be received here; raise the "
                "receiver's max_arena_bytes (--max-memory, hurray_listen_max_memory_mib) or send smaller chunks",
            )
        while True:
            with self._mu:
                if self.closed:
                    raise HurrayFormatError("transport", "the receiver is stopping")
                fits = sorted((s for s in self._free if s.size >= need), key=lambda s: s.size)
                if fits or vet is None:
                    slab = self._take(fits, need)
                    break
            # Not under the lock (the check takes milliseconds); a slab freed meanwhile is found on the next round.
            vet()
            vet = None
        return slab, [slab.mem[o : o + s] for o, s in zip(offsets, sizes)]

    def _take(self, fits: list[_Slab], need: int) -> _Slab:
        """(Under the lock) the smallest of ``fits``, else a new slab of at least ``need`` bytes if there is room."""
        if fits:
            slab = fits[0]
            self._free.remove(slab)
        else:
            size = min(_slab_size(need), max(need, self.max_bytes - self.total))
            droppable = sorted((s for s in self._free if not s.tainted), key=lambda s: s.size)
            if self.total - sum(s.size for s in droppable) + size > self.max_bytes:
                # Refused before any free slab is dropped: dropping them would not make room, and would
                # leave the next chunk to register its slab afresh (any peer could empty the arena so).
                raise HurrayFormatError(
                    "receiver.memory",
                    f"receiver buffers are full ({self.total} of {self.max_bytes} bytes in use); try again later",
                )
            for old in droppable:
                if self.total + size <= self.max_bytes:
                    break
                self._drop(old)
            slab = self._new(size)
        self._busy += 1
        return slab

    def _new(self, size: int) -> _Slab:
        mem = torch.empty(size, dtype=torch.uint8)
        try:
            reg = self._agent.register_memory([(mem.data_ptr(), size, 0, "")], "DRAM")
        except Exception as exc:
            raise NixlError(f"NIXL could not register {size} bytes of receive buffers: {exc}") from exc
        self.total += size
        self.registrations += 1
        return _Slab(mem, reg)

    def _drop(self, slab: _Slab) -> None:
        self._free.remove(slab)
        self._deregister(slab)

    def _deregister(self, slab: _Slab) -> None:
        try:
            self._agent.deregister_memory(slab.reg)
        except Exception as exc:
            log.debug("hurray nixl: deregistering a free slab failed: %s", exc)
        self.total -= slab.size

    def give(self, slab: _Slab) -> None:
        """A slab whose chunk is over with every WRITE landed: free for the next (deregistered once closed)."""
        with self._mu:
            self._busy -= 1
            self._give(slab)

    def _give(self, slab: _Slab) -> None:
        if self.closed:
            self._deregister(slab)
        else:
            self._free.append(slab)

    def quarantine(self, slab: _Slab, xfer_id: int) -> None:
        """An aborted chunk's slab: a straggling WRITE of transfer ``xfer_id`` may still land in it.

        The slab stays out of use until the receiver's agent was polled past
        its deadline (``quarantine_s`` plus a second per MiB, as a transfer
        may take) with no sign of that transfer: a late WRITE lands only
        while the agent is polled, and its notification, seen by that poll
        (:meth:`late`), pushes the deadline back. Wall-clock time alone would
        let it land in the next chunk's pools. Even then a WRITE that UCX
        carries out without the receiver (RDMA, CMA) could come later: the
        slab is never deregistered nor freed before the receiver stops, so it
        can at worst spoil a later chunk's bytes (caught by the digest check
        unless they land after it), never memory put to another use.
        """
        seconds = transfer_seconds(self.quarantine_s, slab.size)
        with self._mu:
            self._busy -= 1
            slab.tainted = True
            self._quarantined[xfer_id] = _Quarantined(slab, time.monotonic() + seconds, seconds)
        self.wake.set()

    def late(self, xfer_id: int) -> None:
        """A notification no chunk waits for, of transfer ``xfer_id``: if it was aborted, its quarantine restarts."""
        with self._mu:
            held = self._quarantined.get(xfer_id)
            if held is not None:
                held.until = max(held.until, time.monotonic() + held.seconds)

    def age(self, polled_at: float) -> None:
        """The agent was polled at ``polled_at`` (monotonic): end the quarantines that were over by then."""
        if not self._quarantined:  # the usual case, after every poll of a chunk in flight: no lock taken
            return
        with self._mu:
            for xfer_id, held in list(self._quarantined.items()):
                if held.until <= polled_at:
                    del self._quarantined[xfer_id]
                    self._give(held.slab)

    def close(self) -> None:
        """Deregister the free slabs; those in use are deregistered as their chunks give them back.

        A quarantined slab stays registered (and allocated) until its
        quarantine ends, which needs the agent polled: the receiver's poller
        goes on after :meth:`NixlReceiver.stop` until the arena is
        :attr:`settled` (a chunk still in flight may yet quarantine its slab).
        """
        with self._mu:
            self.closed = True
            for slab in list(self._free):
                self._drop(slab)
        self.wake.set()


class _Notifs:
    """Routes NIXL notifications ``hvn1:<xfer id>:<index>`` to the chunk waiting for them."""

    def __init__(
        self,
        agent: Any,
        late: Callable[[int], None] | None = None,
        polled: Callable[[float], None] | None = None,
    ) -> None:
        """``late``: called with the id of a transfer no chunk waits for; ``polled``: with each poll's start."""
        self._agent = agent
        self._mu = threading.Lock()
        self._queues: dict[int, queue.SimpleQueue[int]] = {}
        self._late = late
        self._polled = polled

    def expect(self, xfer_id: int) -> queue.SimpleQueue[int]:
        q: queue.SimpleQueue[int] = queue.SimpleQueue()
        with self._mu:
            self._queues[xfer_id] = q
        return q

    def forget(self, xfer_id: int) -> None:
        with self._mu:
            self._queues.pop(xfer_id, None)

    def poll(self) -> bool:
        """Poll the agent (UCX progresses) and route what it delivered; False when that failed."""
        with self._mu:  # one poller at a time: get_new_notifs hands each notification out once
            started = time.monotonic()
            try:
                new = self._agent.get_new_notifs()
            except Exception as exc:
                log.warning("hurray nixl: reading notifications failed: %s", exc)
                return False
            for msgs in new.values():
                for m in msgs:
                    if not m.startswith(NOTIF_PREFIX):
                        continue
                    xid_s, _, idx_s = bytes(m[len(NOTIF_PREFIX) :]).partition(b":")
                    try:
                        xid, idx = int(xid_s, 16), int(idx_s)
                    except ValueError:
                        continue
                    q = self._queues.get(xid)
                    if q is not None:
                        q.put(idx)
                    elif self._late is not None:  # an aborted chunk's: dropped, but its buffers wait longer
                        self._late(xid)
            if self._polled is not None:
                self._polled(started)
            return True


class _Hasher:
    """The chunk digest (:class:`hurray_vllm.chunks.store.ChunkDigest`) on its own thread.

    zlib releases the GIL, so the receiving thread keeps UCX progressing
    while pools that already landed are checksummed.
    """

    def __init__(self, algorithm: str | None = None) -> None:
        self._h = ChunkDigest(algorithm)
        self._q: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="hurray-nixl-digest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (mv := self._q.get()) is not None:
            if not self._cancelled:
                self._h.update(mv)

    def add(self, mv: memoryview) -> None:
        self._q.put(mv)

    def result(self, timeout: float) -> str | None:
        self._q.put(None)
        self._thread.join(timeout)
        return None if self._thread.is_alive() else self._h.hexdigest()

    def cancel(self) -> None:
        self._cancelled = True
        self._q.put(None)


class _Aborted(Exception):
    """The chunk cannot complete: the connection is closed, its buffers quarantined."""


class NixlReceiver(ReceiverBase):
    """Accepts chunks over NIXL (side channel on ``host:port``) and stores the valid ones in ``store``.

    Like :class:`hurray_vllm.transport.tcp.Receiver`: daemon threads, one per
    side-channel connection; :meth:`stop` closes it and deregisters the
    receive buffers. Incoming page pools land in a registered arena of at
    most ``max_arena_bytes``.

    Args:
        host: The side channel's address.
        port: Its port; 0 picks a free one (see ``address``).
        store: Where accepted chunks go.
        timeout: Bounds every step of a chunk (offer, transfer, commit), in seconds; the
            transfer may take one second more per MiB of page pools (as the sender allows it).
        idle_timeout: How long a connection may wait between chunks (before its first offer:
            :data:`~..base.HANDSHAKE_TIMEOUT_S` at most, as :meth:`~..base.ReceiverBase.next_frame` says).
        max_chunk_bytes: The largest page pools one chunk may announce, all together, each counted
            as the receive buffer takes it: rounded up to :data:`.offer.POOL_ALIGN` (4 KiB).
        max_arena_bytes: Registered receive memory for all chunks in flight.
        max_offer_memory_bytes: Memory for the offers being handled, all connections
            together (each is read whole, up to :data:`MAX_OFFER_BYTES`, before it is
            checked). One beyond it is refused unread (field ``receiver.memory``) and
            its connection closed, unless no other is held. What an offer's records
            decode into counts too (:data:`.offer.RECORD_MEMORY_BYTES` each, charged
            from its record count before they are decoded): one beyond it is refused
            the same way, its connection kept.
        backend_params: UCX backend parameters handed to NIXL.
        progress_thread: Use NIXL's progress thread (it spins: one core busy).
        **limits: ``max_connections``, ``quota_bytes``, ``min_free_bytes``, as
            for every receiver (:class:`~hurray_vllm.transport.base.ReceiverBase`).

    Raises:
        NixlUnavailableError: NIXL is not installed.
        NixlError: NIXL could not start an agent.
        HurrayArgumentError: a timeout or a limit out of range (``max_arena_bytes`` below 1, say).
    """

    transport = "nixl"

    def __init__(
        self,
        host: str,
        port: int,
        store: ChunkStore,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
        max_chunk_bytes: int = MAX_CHUNK_BYTES,
        max_arena_bytes: int = DEFAULT_ARENA_BYTES,
        max_offer_memory_bytes: int = DEFAULT_OFFER_MEMORY_BYTES,
        backend_params: dict[str, str] | None = None,
        progress_thread: bool = False,
        **limits: Any,
    ) -> None:
        # Named as the arguments they are (the error said "limits"); an arena with no room refuses every chunk.
        max_offer_memory_bytes = integer_arg(max_offer_memory_bytes, "max_offer_memory_bytes", 1)
        max_arena_bytes = integer_arg(max_arena_bytes, "max_arena_bytes", 1)
        if limits.get("tls") is not None:
            raise HurrayArgumentError(
                "tls", "the NIXL channel has no TLS (its side channel is authenticated with the fleet key): use tcp"
            )
        # The agent first: without NIXL nothing listens.
        agent = make_agent("recv", backend_params, progress_thread)
        try:
            super().__init__(
                host, port, store, timeout=timeout, idle_timeout=idle_timeout, max_chunk_bytes=max_chunk_bytes, **limits
            )
        except BaseException:
            # NIXL has no close: an agent (its UCX workers) goes with its last reference. The traceback keeps
            # this frame, and with it ``self``: neither may hold the agent of a receiver that never was.
            del agent
            raise
        self._agent = agent
        self.name = str(self._agent.name)
        self.arena = _Arena(self._agent, max_arena_bytes, quarantine_s=max(2 * timeout, 5.0))
        self.max_offer_memory_bytes = max_offer_memory_bytes
        self._offer_bytes = 0  # the offers read or being handled, all connections together
        self._offers_mu = threading.Lock()
        self._notifs = _Notifs(self._agent, self.arena.late, self.arena.age)
        self._poller: threading.Thread | None = None  # start()'s quarantine poller

    def start(self) -> NixlReceiver:
        """Start accepting side-channel connections; returns ``self``."""
        super().start()
        self._poller = threading.Thread(target=self._poll_quarantined, name="hurray-nixl-quarantine", daemon=True)
        with _POLLERS_MU:
            _POLLERS[:] = [t for t in _POLLERS if t.is_alive()]
            _POLLERS.append(self._poller)
        self._poller.start()
        return self

    def stop(self) -> None:
        """Stop accepting, close open connections (their chunks abort) and deregister the receive buffers.

        Free buffers are deregistered at once, those of chunks still in flight
        as the chunks end, quarantined ones once their quarantine is over (see
        :meth:`_Arena.quarantine`; the agent is polled until then).
        """
        super().stop()
        self.arena.close()

    def _poll_quarantined(self) -> None:
        """Poll the agent while a slab is quarantined, so that its quarantine can end (see :meth:`_Arena.quarantine`).

        Runs from :meth:`start` until the receiver stopped and its arena
        settled: every slab deregistered, the quarantined ones included.
        """
        while not _EXITING.is_set():
            if self.arena.quarantined:
                ok = self._notifs.poll()
                time.sleep(_QUARANTINE_POLL_S if ok else 1.0)  # a failing agent: it logged why, not 20 times a second
                continue
            if self.stopping and self.arena.settled:
                return
            self.arena.wake.wait(1.0)
            self.arena.wake.clear()

    def __enter__(self) -> NixlReceiver:
        return self.start()

    def serve(self, conn: socket.socket) -> None:
        """Read offers until the sender closes; see the protocol in :mod:`hurray_vllm.transport.nixl`."""
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        first = True  # its first frame within HANDSHAKE_TIMEOUT_S: a silent peer must not hold a slot for long
        while not self.stopping:
            held = 0  # the offer bytes this connection holds, counted against max_offer_memory_bytes
            try:
                try:
                    if not self.next_frame(conn, MAGIC, first=first):
                        return
                    first = False
                    (length,) = U64.unpack(recv_exact(conn, 8))
                    if length > MAX_OFFER_BYTES:
                        raise HurrayFormatError("transport", f"an offer of {length} bytes exceeds the limit")
                    self._take_offer_memory(length)
                    held = length
                    body = self._read_offer(conn, length)
                except (HurrayFormatError, OSError) as exc:
                    log.warning("hurray nixl receiver: dropping connection: %s", exc)
                    if isinstance(exc, HurrayFormatError):
                        self.count(False, str(exc))
                        finish_with_error(conn, exc)
                    return
                done = self._chunk(conn, body)
                del body  # not kept while the connection waits for its next offer, when it no longer counts
                if not done:
                    return
            finally:
                self._give_offer_memory(held)

    def _take_offer_memory(self, length: int, held: int = 0) -> None:
        """Count ``length`` more bytes of offers as held, or refuse them (one offer alone always fits).

        ``length``: an offer's body, before it is read; or, with ``held`` (that body's
        bytes, already counted), the memory its decoded records may hold, before they are built.

        Raises:
            HurrayFormatError: with the offers held by other connections beyond
                ``max_offer_memory_bytes`` (``receiver.memory``).
        """
        with self._offers_mu:
            if self._offer_bytes > held and self._offer_bytes + length > self.max_offer_memory_bytes:
                raise HurrayFormatError(
                    "receiver.memory",
                    f"{self._offer_bytes} bytes of offers are being handled; {length} more would pass the "
                    f"receiver's limit of {self.max_offer_memory_bytes}: try again later",
                )
            self._offer_bytes += length

    def _give_offer_memory(self, length: int) -> None:
        with self._offers_mu:
            self._offer_bytes -= length

    @staticmethod
    def _read_offer(conn: socket.socket, length: int) -> bytearray:
        """The offer's body of ``length`` bytes (bounded by :meth:`_take_offer_memory` before this allocates)."""
        body = bytearray(length)
        view = memoryview(body)
        got = 0
        while got < length:
            k = conn.recv_into(view[got:], min(length - got, 1 << 20))
            if not k:
                raise HurrayFormatError("transport", "sender disconnected in the middle of an offer")
            got += k
        return body

    def _chunk(self, conn: socket.socket, body: bytearray) -> bool:
        """Handle one offer to its end; False when the connection must be closed."""
        key = "?"
        slab: _Slab | None = None
        xfer_id = secrets.randbits(63) + 1
        landed = True
        promised = stored = 0
        charged = 0  # the memory the offer's decoded records may hold, counted against max_offer_memory_bytes

        def charge(nbytes: int) -> None:
            nonlocal charged
            self._take_offer_memory(nbytes, held=len(body) + charged)
            charged += nbytes

        def release() -> None:
            # Before any answer: a sender that sends again at once finds the room and the slab free.
            nonlocal promised, slab
            if promised:
                self.settle(promised, stored)
                promised = 0
            if slab is not None:
                if landed:
                    self.arena.give(slab)
                else:  # before forget: from then on its notifications count as the transfer's late activity
                    self.arena.quarantine(slab, xfer_id)
                slab = None
            self._notifs.forget(xfer_id)

        try:
            offer = parse_offer(body, self.max_chunk_bytes, charge)
            key = offer.key
            # The transfer and the digest within transfer_seconds (see _await), then the commit within timeout.
            self.arm(conn, self.timeout + transfer_seconds(self.timeout, sum(offer.remote_sizes)))
            # The store's quota and the disk's floor, before any page pool is written here.
            self.admit(sum(offer.remote_sizes) + len(body))
            promised = sum(offer.remote_sizes) + len(body)

            def signed(snap: KVSnapshot) -> None:
                if self.keys is not None:
                    # From its metadata alone (the pools have not landed): an unsigned chunk, or one signed with a
                    # key not in the ring, is refused before its transfer. The MAC itself is checked by put.
                    signing_secret(snap, self.keys)

            views: list[torch.Tensor] = []
            if offer.remote_sizes:
                # A slab allocated and registered for it only once the offer is known to describe a chunk.
                slab, views = self.arena.take(offer.remote_sizes, vet=lambda: signed(check_offer(offer)))
            landing = assemble_offer(offer, views)  # checked whole before any transfer
            snap, want, plan = landing.snapshot, landing.digest, landing.plan
            signed(snap)
            q = self._notifs.expect(xfer_id)
            name = self.name.encode()
            md = self._agent.get_agent_metadata() if views else b""
            landed = False
            conn.sendall(
                b"RD"
                + U64.pack(xfer_id)
                + U16.pack(len(name))
                + name
                + U32.pack(len(md))
                + md
                + U32.pack(len(views))
                + b"".join(U64.pack(v.data_ptr()) for v in views)
            )
            digest = self._await(
                conn, q, plan, len(views), landing.algorithm, digest_header(snap), nbytes=sum(offer.remote_sizes)
            )
            landed = True
            if digest != want:
                raise HurrayFormatError("snapshot.digest", "chunk data does not match its digest (corrupt transfer?)")
            if self.keys is not None and views:
                # The slab stays registered with NIXL (it is reused): a peer's late WRITE could change the bytes
                # between the MAC check and the file write. Checked and written from a private copy instead,
                # so what is stored is exactly what was authenticated.
                snap = assemble_offer(offer, [v.clone() for v in views]).snapshot
            if self.stopping:  # stop() began: it waits for a put under way, and no other starts after it
                raise HurrayFormatError("transport", "the receiver is stopping")
            stored = self.put(offer.ns, key, snap, admitted=promised)
            del snap, views, plan, landing
            release()
            self.count(True)
            try:
                conn.sendall(b"OK")
            except OSError:
                return False  # stored; the sender will learn nothing more on this connection
            return True
        except _Aborted as exc:
            release()
            self.count(False, str(exc))
            log.warning("hurray nixl receiver: aborted chunk %s, nothing stored: %s", key, exc)
            send_error(conn, exc)
            return False
        except (HurrayFormatError, OSError) as exc:
            release()
            self.count(False, str(exc))
            log.warning("hurray nixl receiver: refused chunk %s: %s", key, exc)
            return send_error(conn, exc) and landed
        except Exception as exc:  # a NIXL call failed in an unforeseen way: drop this connection, keep serving
            release()
            self.count(False, f"{type(exc).__name__}: {exc}")
            log.exception("hurray nixl receiver: chunk %s failed, nothing stored", key)
            send_error(conn, exc)
            return False
        finally:
            release()  # a no-op unless an error no handler above answers (BaseException)
            self._give_offer_memory(charged)

    def _await(
        self,
        conn: socket.socket,
        q: queue.SimpleQueue[int],
        plan: list[tuple[memoryview, int | None]],
        n: int,
        algorithm: str,
        header: bytes,
        *,
        nbytes: int = 0,
    ) -> str:
        """Wait for every pool and the sender's GO, hashing ``header``, then the pools in digest order as they land.

        The wait is bounded by :func:`.offer.transfer_seconds` of ``nbytes``
        (the pools' size), the bound the sender applies to its WRITEs.
        """
        seconds = transfer_seconds(self.timeout, nbytes)
        deadline = time.monotonic() + seconds
        hasher = _Hasher(algorithm)
        hasher.add(memoryview(header))
        try:
            return self._await_hashing(conn, q, plan, n, deadline, seconds, hasher)
        finally:
            hasher.cancel()

    def _await_hashing(
        self,
        conn: socket.socket,
        q: queue.SimpleQueue[int],
        plan: list[tuple[memoryview, int | None]],
        n: int,
        deadline: float,
        seconds: float,
        hasher: _Hasher,
    ) -> str:
        arrived: set[int] = set()
        nxt = 0
        go = False
        pending = b""
        while True:
            while nxt < len(plan) and (plan[nxt][1] is None or plan[nxt][1] in arrived):
                hasher.add(plan[nxt][0])
                nxt += 1
            if go and nxt == len(plan):
                digest = hasher.result(max(0.0, deadline - time.monotonic()))
                if digest is None:
                    raise _Aborted(f"timed out after {seconds:g} s verifying the chunk digest")
                return digest
            if self.stopping:
                raise _Aborted("the receiver is stopping")
            if time.monotonic() > deadline:
                raise _Aborted(f"timed out after {seconds:g} s ({len(arrived)} of {n} page pools arrived)")
            if len(arrived) < n:
                self._notifs.poll()
                fresh = False
                while True:
                    try:
                        idx = q.get_nowait()
                    except queue.Empty:
                        break
                    if 0 <= idx < n:
                        arrived.add(idx)
                        fresh = True
                if fresh:
                    continue
            try:
                ready = _readable(conn, _RECV_POLL_S if len(arrived) < n else 0.05)
                data = conn.recv(2 - len(pending)) if ready else None
            except OSError as exc:
                raise _Aborted(f"side channel failed: {exc}") from None
            if data is None:
                continue
            if not data:
                raise _Aborted(f"the sender disconnected mid-transfer ({len(arrived)} of {n} page pools arrived)")
            pending += data
            if len(pending) < 2:
                continue
            if pending == b"GO" and not go:
                go = True
            elif pending == b"AB":
                raise _Aborted("the sender aborted the transfer")
            else:
                raise _Aborted(f"unexpected {pending!r} from the sender")
            pending = b""
