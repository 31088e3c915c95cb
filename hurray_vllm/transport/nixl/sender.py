"""The NIXL sender: page pools WRITten from the sender's buffers into the receiver's, over several lanes."""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from ...chunks.signing import FleetKeys
from ...errors import HurrayArgumentError, HurrayFormatError
from ...kv.snapshot import KVSnapshot
from ..base import (
    DEFAULT_TIMEOUT_S,
    U16,
    U32,
    U64,
    Chunk,
    ChunkSender,
    SendAborted,
    check_timeout,
    dial,
    first_of,
    read_answer,
    read_message,
    recv_exact,
)
from .agent import NixlError, make_agent
from .offer import MAGIC, encode_snapshot_offer, notif_tag, parse_nixl_url, transfer_seconds

__all__ = ["NixlSender", "TransferStats", "default_sender", "send_chunks_nixl", "DEFAULT_LANES"]

log = logging.getLogger("hurray_vllm.transport.nixl")

#: How often a sender polls its transfers and the side channel while a chunk is in flight
#: (no progress thread: UCX moves data when polled). A WRITE needs both sides to poll
#: (rendezvous), so longer intervals slow the transfer; shorter ones burn the CPU the copy
#: needs on a small machine. Measured on 2 cores: 0.1-0.5 ms on either side changed a
#: 256 MiB chunk's time by less than its noise.
_SEND_POLL_S = 0.0002
_MAX_METADATA_BYTES = 16 << 20
#: After a failure, how long the WRITEs still in flight are polled to let them finish (or fail) before
#: their handles are released: one that is still in flight then may go on reading its source memory
#: (UCX cannot cancel a started put), which must then be kept (see ``NixlSender.max_leaked_bytes``).
#: Most finish within this: the receiver goes on polling an aborted chunk's buffers (its quarantine).
_DRAIN_S = 0.5
#: A transfer's state once NIXL is done with it: its memory may be reused.
_FINISHED = ("DONE", "ERR")
#: Source memory a sender keeps for WRITEs it could not cancel before it refuses to send more.
DEFAULT_MAX_LEAKED_BYTES = 1 << 30


@dataclass(frozen=True)
class TransferStats:
    """What one chunk cost; seconds are wall-clock on the sender."""

    key: str
    nixl_bytes: int
    inline_bytes: int
    transfers: int
    handshake_s: float
    transfer_s: float
    commit_s: float

    @property
    def total_s(self) -> float:
        """Handshake, transfer and commit together."""
        return self.handshake_s + self.transfer_s + self.commit_s


#: Transfer lanes per sender by default (at most one per CPU the process may use).
#: Each lane is a NIXL agent that posts and progresses its share of a chunk's
#: WRITEs on its own thread. Within a host (shared memory, CMA, TCP loopback) the
#: sending side does the copying: measured here, the sender's CPU time equals the
#: transfer's wall time and the receiver's is ~5 % of it, so one agent moves one
#: core's worth of memcpy (4-5 GB/s on the test VM). On 2 cores two agents moved a
#: 256 MiB chunk 1.5x faster while the receiver only polled, 1.2x with it
#: checksumming alongside; more agents did not help there, nor did UCX's own
#: ``num_workers`` (one thread progresses them all). Over RDMA the NIC copies, and
#: a lane costs an extra connection per receiver.
DEFAULT_LANES = 2
#: Chunks smaller than this per lane go through fewer lanes: handing a few small
#: pools to another thread costs more than copying them.
_MIN_LANE_BYTES = 1 << 20


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _lane_shares(order: Sequence[int], sizes: Sequence[int], lanes: int) -> list[list[int]]:
    """Pools (in posting order) to lanes, each to the lane with the fewest bytes so far.

    The lanes then finish together, and pools still land roughly in posting
    order, which is the order the receiver checksums them in.
    """
    lanes = max(1, min(lanes, len(order), sum(sizes[i] for i in order) // _MIN_LANE_BYTES))
    shares: list[list[int]] = [[] for _ in range(lanes)]
    load = [0] * lanes
    for i in order:
        k = min(range(lanes), key=load.__getitem__)
        shares[k].append(i)
        load[k] += sizes[i]
    return shares


@dataclass
class _Lane:
    """One agent's share of a chunk: its prepared descriptor lists and the WRITEs it has in flight."""

    agent: Any
    indices: list[int]
    local: Any = None
    remote: Any = None
    handles: dict[int, Any] = field(default_factory=dict)
    #: Per handle, the state NIXL last reported ("PROC", "DONE", "ERR"; "?" when posting it failed).
    states: dict[int, str] = field(default_factory=dict)


#: A buffer given to :meth:`NixlSender.register`: start, end, its registration per lane, the tensor.
_Pinned = tuple[int, int, list[Any], torch.Tensor]


@dataclass(eq=False)
class _Leak:
    """WRITEs that NIXL may still be carrying out after their chunk ended, and the memory they read.

    UCX cannot cancel a put it started: NIXL's release of such a handle
    succeeds, yet the copy may go on. So the chunk's source tensors and their
    registrations (its own, or the :meth:`NixlSender.register`-ed buffers
    they lie in) are kept alive and registered for the life of the sender.
    """

    handles: list[Any]
    sources: list[torch.Tensor]
    regs: list[Any] | None
    pinned: list[_Pinned]
    nbytes: int


class _PostFailed(NixlError):
    """Posting a WRITE failed; ``handle`` may still have started (its ``state`` is what NIXL said)."""

    def __init__(self, message: str, handle: Any, state: str) -> None:
        super().__init__(message)
        self.handle = handle
        self.state = state


class NixlSender(ChunkSender):
    """NIXL agents that push chunks to :class:`NixlReceiver` instances.

    A sender has ``lanes`` agents (default: 2, at most the usable CPUs); the
    page pools of a chunk are shared out among them and each lane posts and
    progresses its WRITEs on its own thread, so local transfers copy on
    several cores. Page pools are registered once per chunk (one
    registration per pool and lane, whatever the number of transfers), or
    once for good with :meth:`register` (an engine's KV cache). Up to
    ``max_inflight`` pools are in flight together, shared among the lanes.
    Chunks through one sender go one at a time.

    A WRITE still in flight when its chunk fails cannot be cancelled (UCX
    goes on reading its source): its source tensors and registrations are
    then kept for the life of the sender. Once they pass
    ``max_leaked_bytes``, every later chunk is refused with
    :class:`NixlError` (a new sender, or a new process, starts afresh).
    """

    scheme = "nixl"

    def __init__(
        self,
        *,
        backend_params: dict[str, str] | None = None,
        max_inflight: int = 16,
        max_peers: int = 16,
        progress_thread: bool = False,
        lanes: int | None = None,
        max_leaked_bytes: int = DEFAULT_MAX_LEAKED_BYTES,
    ) -> None:
        if lanes is not None and lanes < 1:
            raise HurrayArgumentError("lanes", f"lanes must be at least 1, got {lanes}")
        if max_leaked_bytes < 0:  # a sender past its bound from the start would refuse every chunk, for good
            raise HurrayArgumentError("max_leaked_bytes", f"max_leaked_bytes must be 0 or more, got {max_leaked_bytes}")
        n = lanes if lanes is not None else min(DEFAULT_LANES, _usable_cpus())
        self._agents = [make_agent(f"send{i}" if i else "send", backend_params, progress_thread) for i in range(n)]
        self._agent = self._agents[0]
        self.name = str(self._agent.name)
        self.lanes = n
        self.max_inflight = max(1, max_inflight)
        self._max_peers = max(1, max_peers)
        self._lock = threading.RLock()
        self._pinned: list[_Pinned] = []
        self._peers: OrderedDict[str, bytes] = OrderedDict()
        self._threads: ThreadPoolExecutor | None = None
        #: Transfers NIXL could not cancel (or release), with their memory: kept alive, never deregistered.
        self._leaked: list[_Leak] = []
        self.max_leaked_bytes = max_leaked_bytes

    @property
    def leaked_bytes(self) -> int:
        """Source memory kept for WRITEs that may still be in flight (see :class:`NixlSender`)."""
        return sum(leak.nbytes for leak in self._leaked)

    def _held_by_leaks(self, entry: _Pinned) -> bool:
        return any(p is entry for leak in self._leaked for p in leak.pinned)

    # ── registration ──

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register long-lived host tensors (page pools) once, until :meth:`close`.

        All or nothing: if one cannot be registered, none of ``tensors`` stays
        registered (the caller, which learns of no registration, retries them all).

        Raises:
            HurrayArgumentError: (field ``tensors``) one is not a contiguous, non-empty host
                tensor (nothing is registered).
            NixlError: NIXL could not register one.
        """
        for i, t in enumerate(tensors):  # every one checked before any is registered
            if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
                raise HurrayArgumentError(
                    "tensors",
                    f"tensor {i} ({t.device.type}, shape {list(t.shape)}, contiguous={t.is_contiguous()}): only "
                    "contiguous, non-empty host tensors can be registered (pass .contiguous() host copies)",
                )
        with self._lock:
            added: list[_Pinned] = []
            try:
                for t in tensors:
                    n = t.numel() * t.element_size()
                    added.append((t.data_ptr(), t.data_ptr() + n, self._register([(t.data_ptr(), n)]), t))
            except BaseException:
                # The caller keeps nothing to unregister: what this call registered would stay pinned (and
                # registered on every lane) for the life of the sender, once more on each of its retries.
                for entry in added:
                    self._deregister(entry[2])
                raise
            self._pinned.extend(added)

    def unregister(self, tensors: Sequence[torch.Tensor]) -> None:
        """Deregister tensors given to :meth:`register` (those not registered are ignored).

        For buffers that are about to be replaced: a registration keeps its
        tensor alive until it is undone here or by :meth:`close`. A buffer
        that a WRITE NIXL could not cancel may still read stays registered
        (and alive) with that transfer, though no later chunk uses it.
        """
        gone = {t.data_ptr() for t in tensors}
        with self._lock:
            keep = []
            for entry in self._pinned:
                if entry[0] not in gone:
                    keep.append(entry)
                elif not self._held_by_leaks(entry):
                    self._deregister(entry[2])
            self._pinned = keep

    def _covered(self, ptr: int, n: int) -> bool:
        return any(a <= ptr and ptr + n <= b for a, b, _, _ in self._pinned)

    def _register(self, ranges: list[tuple[int, int]]) -> list[Any]:
        """Register ``ranges`` with every lane's agent: one registration handle per lane."""
        regs: list[Any] = []
        try:
            for agent in self._agents:
                regs.append(agent.register_memory([(p, n, 0, "") for p, n in ranges], "DRAM"))
        except Exception as exc:
            self._deregister(regs)
            raise NixlError(f"NIXL could not register {len(ranges)} buffers: {exc}") from exc
        return regs

    def _deregister(self, regs: list[Any]) -> None:
        for agent, reg in zip(self._agents, regs):
            self._quiet(agent.deregister_memory, reg)

    def close(self) -> None:
        """Deregister pinned memory, forget every receiver and stop the lane threads.

        Memory that WRITEs NIXL could not cancel may still read stays
        registered, held by the sender (see :class:`NixlSender`).
        """
        with self._lock:
            for entry in self._pinned:
                if not self._held_by_leaks(entry):
                    self._deregister(entry[2])
            self._pinned.clear()
            for name in list(self._peers):
                self._forget_peer(name)
            if self._threads is not None:
                self._threads.shutdown(wait=True)
                self._threads = None

    @staticmethod
    def _quiet(fn: Any, *args: Any) -> bool:
        try:
            fn(*args)
            return True
        except Exception as exc:
            log.debug("hurray nixl: %s failed: %s", getattr(fn, "__name__", fn), exc)
            return False

    def _peer(self, name: str, md: bytes) -> str:
        """Load the receiver's agent metadata into every lane's agent (again only when it changed)."""
        if self._peers.get(name) != md:  # new, or it registered more memory since
            try:
                self._load(name, md)
            except NixlError:
                if name not in self._peers:
                    raise
                # NIXL refuses metadata over what it holds for that agent in some cases (NOT_ALLOWED: a
                # region at the same address and length under another key, as when the receiver registers
                # a slab again at a reused address), and would refuse it on every later chunk: load it
                # afresh. The failure's own half-loaded state goes with the old metadata.
                log.info("hurray nixl: reloading the metadata of %s from scratch", name)
                self._forget_peer(name)
                self._load(name, md)
            self._peers[name] = md
        self._peers.move_to_end(name)
        while len(self._peers) > self._max_peers:
            self._forget_peer(next(iter(self._peers)))
        return name

    def _load(self, name: str, md: bytes) -> None:
        """``md`` into every lane's agent; on failure nothing of it stays loaded unless ``name`` was already."""
        loaded: list[tuple[Any, str]] = []
        try:
            for agent in self._agents:
                got = agent.add_remote_agent(md)
                got = got.decode(errors="replace") if isinstance(got, bytes) else str(got)
                loaded.append((agent, got))
                if got != name:
                    raise HurrayFormatError("transport", f"the receiver calls its agent {name!r}, its metadata {got!r}")
        except Exception as exc:
            # Unload what this call loaded (unless it is a peer already in use): a receiver must not
            # leave agents behind that _peers does not track, nor make WRITEs go to another agent.
            for agent, got in loaded:
                if got not in self._peers:
                    self._quiet(agent.remove_remote_agent, got)
            if isinstance(exc, HurrayFormatError):
                raise
            raise NixlError(f"NIXL could not load the receiver's metadata: {exc}") from exc

    def _forget_peer(self, name: str) -> None:
        if self._peers.pop(name, None) is not None:
            for agent in self._agents:
                self._quiet(agent.remove_remote_agent, name)

    # ── sending ──

    def send(
        self,
        url: str,
        chunks: Iterable[Chunk],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        keys: FleetKeys | None = None,
        owner: object | None = None,
    ) -> list[TransferStats]:
        """Push ``(namespace, key, snapshot)`` chunks to the receiver at ``nixl://HOST:PORT``.

        Returns when every chunk is stored on the other side. ``chunks`` is
        consumed lazily: a chunk is asked for only once the previous one is
        stored there, so a generator may export every chunk into the same
        (registered) buffers. Raises
        :class:`HurrayFormatError` when the receiver refuses a chunk,
        ``OSError`` (:class:`NixlError`, ``TimeoutError``, ``ConnectionError``)
        when it cannot be reached or the transfer fails. With ``keys`` the
        side channel first runs the key handshake (:mod:`..security`): the
        receiver must prove it holds the fleet key before anything is
        offered to it, and this sender then proves it too. The first chunk
        is made before the side channel is opened, and the channel is opened
        under the sender's lock, which its first offer takes: the receiver
        gives a new connection :data:`~..base.HANDSHAKE_TIMEOUT_S` for its
        first offer, and another push on this shared sender may hold the lock
        for a whole chunk.
        ``owner``: who makes the call; ``abort(owner)`` cuts only such calls
        (this sender is one per process, shared by every engine in it).
        A ``timeout`` that is not positive seconds below
        :data:`~..base.MAX_TIMEOUT_S` raises :class:`HurrayArgumentError`.
        """
        timeout = check_timeout(timeout)
        out = []
        with self._calling(owner) as (_, aborted):
            first, rest = first_of(chunks)
            # Connected under the lock the first offer takes (an RLock: _send_one takes it again): opened while
            # another push on this shared sender held it, the side channel would stay silent past the receiver's
            # first-frame bound (HANDSHAKE_TIMEOUT_S) and be cut, failing a push to a healthy receiver. Later
            # chunks wait for the lock between frames, where the idle timeout applies.
            self._lock.acquire()
            locked = True
            try:
                with self.tracked(url, timeout=timeout, keys=keys, owner=owner) as sock:  # abort() cuts it
                    if aborted():  # aborted while the first chunk was made: before any socket it could shut
                        raise SendAborted(f"the {self.scheme} call to {url} was aborted")
                    for ns, key, snap in itertools.chain(first, rest):
                        out.append(self._send_one(sock, ns, key, snap, timeout))
                        if locked:
                            locked = False
                            self._lock.release()
            finally:
                if locked:
                    self._lock.release()
        return out

    def connect(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        keys: FleetKeys | None = None,
        track: Callable[[socket.socket], None] | None = None,
        aborted: Callable[[], bool] | None = None,
    ) -> socket.socket:
        """The side channel to the receiver at ``nixl://HOST:PORT``, after the key handshake with ``keys`` if given."""
        host, port = parse_nixl_url(url)
        return dial(host, port, timeout=timeout, keys=keys, track=track, aborted=aborted)

    def _send_one(self, sock: socket.socket, ns: str, key: str, snap: KVSnapshot, timeout: float) -> TransferStats:
        if self.leaked_bytes > self.max_leaked_bytes:
            # Each leak keeps a chunk's memory for good: past the bound, a sender whose receivers keep
            # failing mid-transfer would take the host's memory chunk by chunk.
            raise NixlError(
                f"this NIXL sender keeps {self.leaked_bytes} bytes for transfers NIXL could not cancel, more "
                f"than max_leaked_bytes={self.max_leaked_bytes}: it sends no more (use a new sender or restart)"
            )
        t0 = time.perf_counter()
        parts, sources, order = encode_snapshot_offer(ns, key, snap)
        # One send: part by part, a chunk of 32 layers took ~600 system calls and as many packets.
        body = sum(memoryview(p).nbytes for p in parts)
        # Offer, grant and transfer under the lock: the receiver's clock on the transfer starts at its grant, so
        # a chunk granted while another push on this (shared) sender transfers would wait out its own deadline.
        with self._lock:
            sock.sendall(b"".join([MAGIC, U64.pack(body), *parts]))
            # The whole grant within one timeout: per recv, a receiver trickling a byte per timeout would hold
            # the sender for as many timeouts as its metadata has bytes.
            deadline = time.monotonic() + timeout
            reply = recv_exact(sock, 2, deadline)
            if reply == b"ER":
                raise HurrayFormatError("transport", f"receiver refused chunk {key}: {read_message(sock, deadline)}")
            if reply != b"RD":
                raise HurrayFormatError("transport", f"unexpected answer {reply!r} from the receiver")
            (xfer_id,) = U64.unpack(recv_exact(sock, 8, deadline))
            try:
                name = recv_exact(sock, U16.unpack(recv_exact(sock, 2, deadline))[0], deadline).decode()
            except UnicodeDecodeError:
                raise HurrayFormatError("transport", "the receiver's agent name is not UTF-8") from None
            (md_len,) = U32.unpack(recv_exact(sock, 4, deadline))
            if md_len > _MAX_METADATA_BYTES:
                raise HurrayFormatError("transport", f"receiver metadata of {md_len} bytes is implausible")
            md = recv_exact(sock, md_len, deadline)
            (count,) = U32.unpack(recv_exact(sock, 4, deadline))
            if count != len(sources):
                raise HurrayFormatError("transport", f"receiver granted {count} buffers for {len(sources)} page pools")
            addrs = [a for (a,) in U64.iter_unpack(recv_exact(sock, 8 * count, deadline))]
            t1 = time.perf_counter()
            if sources:
                # The receiver's own bound on the transfer (transfer_seconds), from its grant: past it, it gives
                # up anyway.
                seconds = transfer_seconds(timeout, sum(s.numel() for s in sources))
                self._transfer(sock, name, md, xfer_id, sources, addrs, order, time.monotonic() + seconds)
        t2 = time.perf_counter()
        sock.sendall(b"GO")
        read_answer(sock, key)
        inline = sum(memoryview(p).nbytes for p in parts if isinstance(p, memoryview))  # the inline buffers
        return TransferStats(
            key, sum(s.numel() for s in sources), inline, len(sources), t1 - t0, t2 - t1, time.perf_counter() - t2
        )

    def _post(self, agent: Any, local: Any, remote: Any, index: int, notif: bytes) -> Any:
        """Create and post the WRITE of page pool ``index`` (a separate method: tests kill the sender here).

        Raises:
            NixlError: it could not be created; :class:`_PostFailed` (with the handle) when
                posting it failed, which may have started it nonetheless.
        """
        try:
            h = agent.make_prepped_xfer("WRITE", local, [index], remote, [index], notif)
        except Exception as exc:
            raise NixlError(f"NIXL could not create the transfer of page pool {index}: {exc}") from exc
        try:
            state = agent.transfer(h)
        except Exception as exc:
            # NIXL reports most failures so, some after the WRITE started (its notification failing):
            # the handle's state is checked again before its memory is let go (_release).
            raise _PostFailed(f"NIXL could not post the transfer of page pool {index}: {exc}", h, "?") from exc
        if state == "ERR":
            raise _PostFailed(f"NIXL could not post the transfer of page pool {index}: {state}", h, state)
        return h

    def _drive(
        self,
        lane: _Lane,
        xfer_id: int,
        inflight: int,
        deadline: float,
        stop: threading.Event,
        sock: socket.socket | None,
    ) -> None:
        """Post and progress one lane's WRITEs until they all completed, another lane failed, or time is up.

        The calling thread's lane also watches the side channel (``sock``),
        where the receiver only ever speaks to give up.
        """
        agent, handles, states = lane.agent, lane.handles, lane.states
        pending = list(reversed(lane.indices))
        while pending or handles:
            if stop.is_set():
                return
            if pending and len(handles) < inflight and time.monotonic() > deadline:
                # The receiver gave up by now (its slab quarantined): a WRITE posted after would only be one
                # more that UCX cannot cancel.
                raise TimeoutError("NIXL transfer did not complete in time")
            while pending and len(handles) < inflight:
                i = pending.pop()
                try:
                    handles[i] = self._post(agent, lane.local, lane.remote, i, notif_tag(xfer_id, i))
                except _PostFailed as exc:
                    handles[i], states[i] = exc.handle, exc.state  # released (or kept) by _release
                    raise
                states[i] = "PROC"
            for i, h in list(handles.items()):
                try:
                    state = agent.check_xfer_state(h)
                except Exception as exc:
                    states[i] = "ERR"  # NIXL's way of saying so: the transfer ended in failure
                    raise NixlError(f"NIXL transfer of page pool {i} failed: {exc}") from exc
                states[i] = state
                if state == "DONE":
                    del handles[i], states[i]
                    if not self._quiet(h.release):  # done: its memory is free, the handle is NIXL's to keep
                        self._leaked.append(_Leak([h], [], None, [], 0))
                elif state == "ERR":
                    raise NixlError(f"NIXL transfer of page pool {i} failed")
            if not handles and not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("NIXL transfer did not complete in time")
            if sock is not None:
                _watch_receiver(sock, _SEND_POLL_S)
            else:
                time.sleep(_SEND_POLL_S)

    def _transfer(
        self,
        sock: socket.socket,
        name: str,
        md: bytes,
        xfer_id: int,
        sources: list[torch.Tensor],
        addrs: list[int],
        order: list[int],
        deadline: float,
    ) -> None:
        """WRITE every page pool in ``sources`` to ``addrs`` on the receiver; on any failure tell it ``AB``.

        After a failure the receiver's agent is forgotten (its metadata loaded
        afresh next time), but only once every handle is released: NIXL
        disconnects from it then, under WRITEs that would still be in flight.
        """
        with self._lock:
            lanes: list[_Lane] = []
            regs: list[Any] | None = None
            failed = True
            try:
                # Inside: a receiver whose metadata cannot be loaded hears AB too (not a timeout, later).
                peer = self._peer(name, md)
                ranges = [(s.data_ptr(), s.numel()) for s in sources]
                todo = [r for r in dict.fromkeys(ranges) if not self._covered(*r)]
                regs = self._register(todo) if todo else None
                # At most max_inflight lanes: each has at least one WRITE in flight.
                shares = _lane_shares(order, [n for _, n in ranges], min(len(self._agents), self.max_inflight))
                lanes = [_Lane(agent, share) for agent, share in zip(self._agents, shares)]
                self._prepare(lanes, peer, ranges, addrs)
                self._run_lanes(sock, peer, lanes, xfer_id, deadline)
                failed = False
            except BaseException:
                try:
                    sock.sendall(b"AB")
                except OSError:
                    pass
                raise
            finally:
                self._release(lanes, sources, regs)
                if failed:
                    self._forget_peer(name)

    @staticmethod
    def _prepare(lanes: list[_Lane], peer: str, ranges: list[tuple[int, int]], addrs: list[int]) -> None:
        """Each lane's local and remote descriptor lists (all pools: a lane posts only its share)."""
        try:
            for lane in lanes:
                lane.local = lane.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(p, n, 0) for p, n in ranges], "DRAM")
                lane.remote = lane.agent.prep_xfer_dlist(peer, [(a, n, 0) for a, (_, n) in zip(addrs, ranges)], "DRAM")
        except Exception as exc:
            raise NixlError(f"NIXL could not prepare the transfer: {exc}") from exc

    def _run_lanes(self, sock: socket.socket, peer: str, lanes: list[_Lane], xfer_id: int, deadline: float) -> None:
        """Drive the first lane on this thread (it watches the side channel), the others on the pool."""
        inflight = max(1, self.max_inflight // len(lanes))
        stop = threading.Event()
        futures: list[Future[None]] = []

        def drive(lane: _Lane) -> None:
            try:
                self._drive(lane, xfer_id, inflight, deadline, stop, None)
            except BaseException:
                stop.set()  # the other lanes stop at their next poll
                raise

        try:
            if len(lanes) > 1:
                if self._threads is None:
                    self._threads = ThreadPoolExecutor(len(self._agents) - 1, "hurray-nixl-lane")
                futures = [self._threads.submit(drive, lane) for lane in lanes[1:]]
            self._drive(lanes[0], xfer_id, inflight, deadline, stop, sock)
            while futures:
                for f in [f for f in futures if f.done()]:
                    f.result()  # a lane's error, raised here
                    futures.remove(f)
                if futures:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"NIXL transfer to {peer} did not complete in time")
                    _watch_receiver(sock, _SEND_POLL_S)
        except BaseException:
            stop.set()
            wait(futures)  # every lane returns at its next poll
            raise

    def _release(self, lanes: list[_Lane], sources: list[torch.Tensor], regs: list[Any] | None) -> None:
        """Release handles and descriptor lists; deregister the chunk's memory unless a WRITE may still use it.

        A handle NIXL last reported neither done nor failed may still be
        copying after its release (UCX's release cancels what it can and
        says success, but a started put goes on): it is kept with the
        chunk's sources, registrations and the pinned buffers they lie in.
        """
        self._settle(lanes)
        unsafe: list[Any] = []  # maybe in flight: its memory must outlive it
        unreleased: list[Any] = []  # over, but NIXL kept the handle
        for lane in lanes:
            for i, h in lane.handles.items():
                released = self._quiet(h.release)
                if lane.states.get(i) not in _FINISHED:
                    unsafe.append(h)
                elif not released:
                    unreleased.append(h)
            lane.handles.clear()
            for d in (lane.local, lane.remote):
                if d is not None:
                    self._quiet(d.release)
        if unsafe:
            ranges = dict.fromkeys((s.data_ptr(), s.numel()) for s in sources)
            pinned = [e for e in self._pinned if any(e[0] <= p < e[1] for p, _ in ranges)]
            self._leaked.append(_Leak(unsafe + unreleased, sources, regs, pinned, sum(n for _, n in ranges)))
            log.warning(
                "hurray nixl: %d WRITEs may still be in flight after their chunk failed: keeping its %d bytes "
                "(%d kept in all, at most %d before this sender refuses to send)",
                len(unsafe),
                sum(n for _, n in ranges),
                self.leaked_bytes,
                self.max_leaked_bytes,
            )
            return
        if unreleased:
            self._leaked.append(_Leak(unreleased, [], None, [], 0))
        if regs is not None:
            self._deregister(regs)

    @staticmethod
    def _settle(lanes: list[_Lane]) -> None:
        """After a failure, poll the WRITEs still in flight for up to :data:`_DRAIN_S` until each is over."""
        end = time.monotonic() + _DRAIN_S
        while True:
            pending = [
                (lane, i, h) for lane in lanes for i, h in lane.handles.items() if lane.states.get(i) not in _FINISHED
            ]
            if not pending:
                return
            for lane, i, h in pending:
                try:
                    lane.states[i] = lane.agent.check_xfer_state(h)
                except Exception:
                    lane.states[i] = "ERR"  # NIXL's way of saying the transfer ended in failure
            if time.monotonic() >= end:
                return
            time.sleep(_SEND_POLL_S)


def _watch_receiver(sock: socket.socket, timeout: float) -> None:
    """During a transfer the receiver speaks only to give up: raise if it did; else wait ``timeout`` seconds.

    poll, not select: an engine's side channel may well have a descriptor past
    select's limit of 1024. poll counts whole milliseconds, longer than the
    sender's poll interval, so it only looks, and the wait is a sleep.
    """
    watch = select.poll()
    watch.register(sock, select.POLLIN)
    if not watch.poll(0):  # also answers a hangup or an error: the recv below reports it
        time.sleep(timeout)
        return
    head = sock.recv(1)
    if not head:
        raise ConnectionError("the receiver closed the side channel during the transfer")
    head += recv_exact(sock, 1)
    if head == b"ER":
        raise HurrayFormatError("transport", f"receiver refused the chunk during the transfer: {read_message(sock)}")
    raise HurrayFormatError("transport", f"unexpected {head!r} from the receiver during the transfer")


_default: NixlSender | None = None
_default_lock = threading.Lock()


def default_sender() -> NixlSender:
    """The process's shared sender (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = NixlSender()
        return _default


def send_chunks_nixl(
    url: str, chunks: Iterable[Chunk], *, timeout: float = DEFAULT_TIMEOUT_S, keys: FleetKeys | None = None
) -> None:
    """:func:`hurray_vllm.transport.tcp.send_chunks` over NIXL: ``url`` is ``nixl://HOST:PORT``.

    ``chunks`` is consumed lazily, one chunk after the previous one is stored.

    Raises :class:`HurrayFormatError` when the receiver refuses a chunk,
    ``OSError`` when it cannot be reached or a transfer fails or times out,
    and :class:`NixlUnavailableError` (an ``ImportError``) without NIXL.
    """
    parse_nixl_url(url)
    default_sender().send(url, chunks, timeout=timeout, keys=keys)


# ── receiver ───────────────────────────────────────────────────────────────────
