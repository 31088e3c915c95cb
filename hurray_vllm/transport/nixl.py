"""Scale-out transport: KV chunks moved between processes with NIXL (UCX underneath).

The same contract as :mod:`hurray_vllm.transport.tcp` (``send_chunks`` /
``Receiver``), but the page pools do not travel through Python or a socket
stream: the sender WRITEs them with NIXL, straight from its own page buffers
into buffers the receiver registered for them. Only the small things go over
a TCP side channel: the Hurray descriptors of every record, token ids, block
tables and the metadata (model fingerprint, chunk digest).

One side-channel connection carries any number of chunks. Per chunk::

    sender                                          receiver
    OFFER  b"HVN1" u64 len | ns, key, records  -->  validate every descriptor, bound the sizes,
           (descriptor + inline buffers; a            take destination buffers from a registered arena,
           page pool is only announced)               assemble the snapshot (validated as any input)
                                               <--  b"RD" xfer id, agent name + metadata, one address
                                                    per announced page pool   (or b"ER" + message)
    NIXL WRITE of every page pool, several in flight,
    each carrying a notification "hvn1:<id>:<i>" -->  hashes pools in digest order as they land
    b"GO"  (every write completed locally)     -->  all notifications + GO: check the chunk digest,
                                                    store the chunk
                                               <--  b"OK"  or  b"ER" + u16 length + message

Nothing is stored unless every byte arrived and matches the chunk digest. A
sender that disconnects (or dies) before ``GO``, a sender that sends
``b"AB"``, and a transfer that exceeds the receiver's timeout abort the
chunk: nothing is stored, the connection is closed, and the destination
buffers are quarantined (not reused for a while) so that a straggling write
cannot land in a later chunk. Every wait has a timeout.

NIXL is optional: it is imported when a sender or receiver is created, and
its absence raises :class:`NixlUnavailableError` (an ``ImportError``) that
says ``pip install 'hurray-vllm[nixl]'``.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import secrets
import select
import socket
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

import torch

from ..chunks.digest import DIGEST_KEY, ChunkDigest
from ..chunks.store import ChunkStore
from ..containers.schema import Record, assemble_snapshot, dense_record, group_records, header_records, layer_records
from ..containers.stream import layer_structure_key, tensor_bytes
from ..errors import HurrayFormatError
from ..kv.snapshot import KVSnapshot
from ..wire.descriptor import (
    LAYER_INDEX_NONE,
    LAYOUT_BLOCK_PAGED,
    TensorDescriptor,
    encode_descriptor,
    layer_index_offset,
)
from ..wire.descriptor import peek_descriptor_length as _peek_len
from ..wire.rules import decode_checked
from .tcp import _NAME, MAX_CHUNK_BYTES, _recv_exact

__all__ = [
    "NixlReceiver",
    "NixlSender",
    "NixlError",
    "NixlUnavailableError",
    "TransferStats",
    "send_chunks_nixl",
    "parse_nixl_url",
    "load_nixl",
    "INSTALL_HINT",
]

log = logging.getLogger("hurray_vllm.transport.nixl")

INSTALL_HINT = "pip install 'hurray-vllm[nixl]'"
#: Module names NIXL's Python API is published under (the CUDA 12 wheel first; it runs without CUDA).
_MODULES = ("nixl_cu12", "nixl_cu13", "nixl._api", "nixl")
#: ``ucx_error_handling_mode`` of the UCX backend ("peer", NIXL's default, or "none": see docs/nixl.md).
ERROR_HANDLING_ENV = "HURRAY_NIXL_UCX_ERROR_HANDLING"

MAGIC = b"HVN1"
_INLINE, _REMOTE = 0, 1
#: Polling intervals while a chunk is in flight (no progress thread: UCX moves data when polled).
#: A WRITE needs both sides to poll (rendezvous), so longer intervals slow the transfer;
#: shorter ones burn the CPU the copy needs on a small machine.
#: Measured on 2 cores: 0.1-0.5 ms on either side changed a 256 MiB chunk's time by less than its noise.
_SEND_POLL_S = 0.0002
_RECV_POLL_S = 0.0005
_INLINE_BYTE, _REMOTE_BYTE = bytes([_INLINE]), bytes([_REMOTE])
#: Descriptors and inline buffers (token ids, block tables, metadata) of one chunk.
MAX_OFFER_BYTES = 64 << 20
MAX_RECORDS = 1 << 16
#: Registered receive memory, all chunks in flight together (quarantined buffers count).
DEFAULT_ARENA_BYTES = 8 << 30
_MAX_METADATA_BYTES = 16 << 20
_ALIGN = 4096
_MIN_SLAB = 16 << 20
_NOTIF = b"hvn1:"

_U16, _U32, _U64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<Q")


class NixlUnavailableError(ImportError):
    """NIXL's Python package is not installed (or does not load)."""


class NixlError(OSError):
    """NIXL or UCX failed (agent creation, registration, a transfer).

    An ``OSError``, like a refused connection: callers that survive an
    unreachable TCP receiver survive this too.
    """


_nixl: ModuleType | None = None
_nixl_lock = threading.Lock()


def load_nixl() -> ModuleType:
    """NIXL's Python API module; raises :class:`NixlUnavailableError` with the install command."""
    global _nixl
    with _nixl_lock:
        if _nixl is not None:
            return _nixl
        tried = []
        for name in _MODULES:
            try:
                mod = importlib.import_module(name)
            except Exception as exc:  # ImportError, or a shared library that does not load
                tried.append(f"{name}: {exc}")
                continue
            if hasattr(mod, "nixl_agent") and hasattr(mod, "nixl_agent_config"):
                # NIXL logs every agent start at INFO on *stdout*; keep stdout for the host program.
                if not os.environ.get("NIXL_LOG_LEVEL"):
                    logging.getLogger("nixl").setLevel(logging.WARNING)
                _nixl = mod
                return mod
            tried.append(f"{name}: no nixl_agent")
        raise NixlUnavailableError(
            f"the NIXL transport needs NIXL, which is not installed: {INSTALL_HINT} "
            f"(or pip install nixl-cu12; it runs on CPU-only machines too). Tried {'; '.join(tried)}"
        )


def _make_agent(role: str, backend_params: dict[str, str] | None, progress_thread: bool = False) -> Any:
    """A NIXL agent with the UCX backend.

    Without a progress thread (the default) UCX progresses while the agent is
    polled (transfer states, notifications), which this module does whenever
    a chunk is in flight. NIXL's progress thread spins without pause: it
    would keep a core busy for the life of every agent.
    """
    nixl = load_nixl()
    name = f"hurray-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    params = dict(backend_params or {})
    mode = os.environ.get(ERROR_HANDLING_ENV)
    if mode and "ucx_error_handling_mode" not in params:
        params["ucx_error_handling_mode"] = mode
    try:
        sync = getattr(nixl, "nixl_thread_sync_t", None)
        try:
            conf = nixl.nixl_agent_config(
                enable_prog_thread=progress_thread,
                backends=[],
                sync_mode=sync.NIXL_THREAD_SYNC_STRICT if sync else None,
            )
        except TypeError:  # an older NIXL without sync modes
            conf = nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        agent = nixl.nixl_agent(name, conf)
        agent.create_backend("UCX", params)
    except NixlUnavailableError:
        raise
    except Exception as exc:
        hint = ""
        if os.environ.get("UCX_TLS") is not None and params.get("ucx_error_handling_mode", "peer") == "peer":
            hint = (
                f" (UCX_TLS={os.environ['UCX_TLS']!r}: shared-memory transports need "
                f"{ERROR_HANDLING_ENV}=none, and an empty UCX_TLS selects nothing)"
            )
        raise NixlError(
            f"could not start a NIXL agent with the UCX backend ({type(exc).__name__}: {exc}); "
            f"check UCX_TLS / UCX_NET_DEVICES and the backend parameters{hint}"
        ) from exc
    return agent


def parse_nixl_url(url: str) -> tuple[str, int]:
    """``nixl://HOST:PORT`` (the receiver's side channel) -> ``(HOST, PORT)``."""
    u = urlparse(url)
    if u.scheme != "nixl" or not u.hostname or not u.port:
        raise HurrayFormatError("hurray_url", f"expected nixl://HOST:PORT, got {url!r}")
    return u.hostname, u.port


def _notif(xfer_id: int, index: int) -> bytes:
    return _NOTIF + b"%x:%d" % (xfer_id, index)


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t``'s bytes in host memory (a copy only for device or strided tensors)."""
    if t.device.type != "cpu":
        t = t.cpu()  # NIXL can read VRAM too, but only tested on the host: stage it
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


# ── the offer: descriptors and inline buffers ──────────────────────────────────


class _OfferWriter:
    """The parts of an offer's body, record after record (see the protocol in the module docstring)."""

    def __init__(self, ns: str, key: str) -> None:
        nsb, kb = ns.encode(), key.encode()
        self.parts: list[Any] = [_U16.pack(len(nsb)), nsb, _U16.pack(len(kb)), kb, b""]
        self.remote: list[torch.Tensor] = []
        self._rank: list[tuple[int, int]] = []
        self._count = 0

    def add(self, rec: Record) -> None:
        raw = encode_descriptor(rec.descriptor)
        self.parts += [_U32.pack(len(raw)), raw]
        self._count += 1
        bp = rec.descriptor.block_paged
        for j, t in enumerate(rec.buffers):
            if bp is not None and j == 0 and t.numel() > 0:
                self.parts.append(_REMOTE_BYTE)
                self._announce(bp.kv_role, t)
            else:
                self.parts += [_INLINE_BYTE, tensor_bytes(t)]

    def _announce(self, role: str, pool: torch.Tensor) -> None:
        self._rank.append((0 if role == "key" else 1, len(self.remote)))
        self.remote.append(_host_bytes(pool))

    def add_layers(self, snap: KVSnapshot) -> None:
        """Every layer's group; layers that share their block structure (a chunk's do) are encoded once.

        A later layer reuses the first one's parts and patches its layer index
        into the two block-paged descriptors, as :class:`stream.LayerWriter`
        does for streams: the bytes are those of ``add`` over ``layer_records``.
        """
        index_cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        shared: tuple[object, ...] | None = None
        template: list[Any] = []
        patches: list[tuple[int, int]] = []  # (part index in the template, layer index offset) for key, value
        for i, (k, v) in enumerate(snap.layers()):
            scales = snap.kv_scales[i] if snap.kv_scales is not None else None
            structure = layer_structure_key(k, v, scales)
            if structure is not None and structure == shared and all(t.page_pool.numel() for t in (k, v)):
                at = len(self.parts)
                self.parts += template
                for (pos, off), t in zip(patches, (k, v), strict=True):
                    raw = bytearray(template[pos])
                    struct.pack_into("<I", raw, off, LAYER_INDEX_NONE if t.layer_index is None else t.layer_index)
                    self.parts[at + pos] = raw
                    self._announce(t.kv_role, t.page_pool)
                self._count += 4
                if scales is not None:
                    self.add(dense_record(f"layers.{i}.kv_scales", torch.tensor(scales, dtype=torch.float32)))
                continue
            head, krec, vrec, lens, *rest = layer_records(i, k, v, scales, index_cache)
            at = len(self.parts)
            self.add(head)
            patches = []
            for rec in (krec, vrec):
                patches.append((len(self.parts) + 1 - at, layer_index_offset(rec.descriptor)))
                self.add(rec)
            self.add(lens)
            template = self.parts[at:]
            shared = structure
            for rec in rest:
                self.add(rec)

    def finish(self) -> tuple[list[Any], list[torch.Tensor], list[int]]:
        """(message parts, page pools to WRITE, the order to post them in: keys before values)."""
        self.parts[4] = _U32.pack(self._count)
        return self.parts, self.remote, [i for _, i in sorted(self._rank)]


def _encode_offer(ns: str, key: str, records: Iterable[Record]) -> tuple[list[Any], list[torch.Tensor], list[int]]:
    """(message parts, page pools to WRITE, the order to post them in) for any records."""
    w = _OfferWriter(ns, key)
    for rec in records:
        w.add(rec)
    return w.finish()


def _encode_snapshot_offer(ns: str, key: str, snap: KVSnapshot) -> tuple[list[Any], list[torch.Tensor], list[int]]:
    """``_encode_offer(ns, key, snapshot_records(snap))``, encoding a shared layer structure once."""
    w = _OfferWriter(ns, key)
    for rec in header_records(snap):
        w.add(rec)
    w.add_layers(snap)
    return w.finish()


class _Cursor:
    def __init__(self, buf: bytearray) -> None:
        self.buf, self.pos = memoryview(buf), 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise HurrayFormatError("transport.offer", f"offer ends inside {what}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return int(self.take(1, what)[0])

    def u16(self, what: str) -> int:
        return int(_U16.unpack(self.take(2, what))[0])

    def u32(self, what: str) -> int:
        return int(_U32.unpack(self.take(4, what))[0])


@dataclass
class _Offer:
    ns: str
    key: str
    descriptors: list[TensorDescriptor]
    #: per record, per buffer: an inline uint8 tensor or the index of a remote buffer
    buffers: list[list[torch.Tensor | int]]
    remote_sizes: list[int]


def _parse_offer(body: bytearray, max_remote_bytes: int) -> _Offer:
    """Decode and validate an offer; every size is checked before anything is allocated."""
    c = _Cursor(body)
    try:
        ns = bytes(c.take(c.u16("namespace"), "namespace")).decode()
        key = bytes(c.take(c.u16("key"), "key")).decode()
    except UnicodeDecodeError:
        raise HurrayFormatError("transport", "namespace and key must be lowercase hex") from None
    if not (_NAME.match(ns) and _NAME.match(key)):
        raise HurrayFormatError("transport", "namespace and key must be lowercase hex")
    n = c.u32("record count")
    if not 0 < n <= MAX_RECORDS:
        raise HurrayFormatError("transport.offer", f"{n} records is not a plausible chunk")
    descs: list[TensorDescriptor] = []
    buffers: list[list[torch.Tensor | int]] = []
    remote_sizes: list[int] = []
    remote_total = 0
    for i in range(n):
        length = c.u32(f"descriptor {i} length")
        raw = c.take(length, f"descriptor {i}")
        if len(raw) < 10 or _peek_len(raw) != length:
            raise HurrayFormatError("descriptor_length", f"descriptor {i}: framed length {length} does not match")
        desc = decode_checked(raw, f"descriptor {i}")
        bufs: list[torch.Tensor | int] = []
        for j, b in enumerate(desc.buffers):
            mode = c.u8(f"descriptor {i} buffer {j} mode")
            if mode == _INLINE:
                raw_buf = c.take(b.byte_size, f"descriptor {i} buffer {j}")
                t = torch.empty(b.byte_size, dtype=torch.uint8)
                if b.byte_size:
                    t.numpy()[:] = memoryview(raw_buf)
                bufs.append(t)
            elif mode == _REMOTE:
                # Only page pools travel by NIXL: everything the validation reads is inline.
                if desc.layout_tag != LAYOUT_BLOCK_PAGED or j != 0 or b.byte_size == 0:
                    raise HurrayFormatError("transport.offer", f"descriptor {i} buffer {j} cannot be sent by NIXL")
                remote_total += b.byte_size
                if remote_total > max_remote_bytes:
                    raise HurrayFormatError(
                        "transport", f"chunk of more than {remote_total} bytes exceeds the limit of {max_remote_bytes}"
                    )
                bufs.append(len(remote_sizes))
                remote_sizes.append(b.byte_size)
            else:
                raise HurrayFormatError("transport.offer", f"descriptor {i} buffer {j}: unknown mode {mode}")
        descs.append(desc)
        buffers.append(bufs)
    if c.pos != len(body):
        raise HurrayFormatError("transport.offer", f"{len(body) - c.pos} stray bytes after the last record")
    return _Offer(ns, key, descs, buffers, remote_sizes)


# ── sender ─────────────────────────────────────────────────────────────────────


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


class NixlSender:
    """NIXL agents that push chunks to :class:`NixlReceiver` instances.

    A sender has ``lanes`` agents (default: 2, at most the usable CPUs); the
    page pools of a chunk are shared out among them and each lane posts and
    progresses its WRITEs on its own thread, so local transfers copy on
    several cores. Page pools are registered once per chunk (one
    registration per pool and lane, whatever the number of transfers), or
    once for good with :meth:`register` (an engine's KV cache). Up to
    ``max_inflight`` pools are in flight together, shared among the lanes.
    Chunks through one sender go one at a time.
    """

    def __init__(
        self,
        *,
        backend_params: dict[str, str] | None = None,
        max_inflight: int = 16,
        max_peers: int = 16,
        progress_thread: bool = False,
        lanes: int | None = None,
    ) -> None:
        if lanes is not None and lanes < 1:
            raise ValueError(f"lanes must be at least 1, got {lanes}")
        n = lanes if lanes is not None else min(DEFAULT_LANES, _usable_cpus())
        self._agents = [_make_agent(f"send{i}" if i else "send", backend_params, progress_thread) for i in range(n)]
        self._agent = self._agents[0]
        self.name = str(self._agent.name)
        self.lanes = n
        self.max_inflight = max(1, max_inflight)
        self._max_peers = max(1, max_peers)
        self._lock = threading.RLock()
        self._pinned: list[tuple[int, int, list[Any], torch.Tensor]] = []
        self._peers: OrderedDict[str, bytes] = OrderedDict()
        self._threads: ThreadPoolExecutor | None = None
        #: Transfers NIXL could not cancel, with their memory: kept alive, never deregistered.
        self._leaked: list[Any] = []

    # ── registration ──

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register long-lived host tensors (page pools) once, until :meth:`close`."""
        with self._lock:
            for t in tensors:
                if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
                    raise HurrayFormatError("transport", "only contiguous, non-empty host tensors can be registered")
                n = t.numel() * t.element_size()
                regs = self._register([(t.data_ptr(), n)])
                self._pinned.append((t.data_ptr(), t.data_ptr() + n, regs, t))

    def unregister(self, tensors: Sequence[torch.Tensor]) -> None:
        """Deregister tensors given to :meth:`register` (those not registered are ignored).

        For buffers that are about to be replaced: a registration keeps its
        tensor alive until it is undone here or by :meth:`close`.
        """
        gone = {t.data_ptr() for t in tensors}
        with self._lock:
            keep = []
            for entry in self._pinned:
                if entry[0] in gone:
                    self._deregister(entry[2])
                else:
                    keep.append(entry)
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
        """Deregister pinned memory, forget every receiver and stop the lane threads."""
        with self._lock:
            for _, _, regs, _ in self._pinned:
                self._deregister(regs)
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
        if self._peers.get(name) != md:  # new, or it registered more memory since
            try:
                for agent in self._agents:
                    agent.add_remote_agent(md)
            except Exception as exc:
                raise NixlError(f"NIXL could not load the receiver's metadata: {exc}") from exc
            self._peers[name] = md
        self._peers.move_to_end(name)
        while len(self._peers) > self._max_peers:
            self._forget_peer(next(iter(self._peers)))
        return name

    def _forget_peer(self, name: str) -> None:
        if self._peers.pop(name, None) is not None:
            for agent in self._agents:
                self._quiet(agent.remove_remote_agent, name)

    # ── sending ──

    def send(
        self, url: str, chunks: Iterable[tuple[str, str, KVSnapshot]], *, timeout: float = 60.0
    ) -> list[TransferStats]:
        """Push ``(namespace, key, snapshot)`` chunks to the receiver at ``nixl://HOST:PORT``.

        Returns when every chunk is stored on the other side. ``chunks`` is
        consumed lazily: a chunk is asked for only once the previous one is
        stored there, so a generator may export every chunk into the same
        (registered) buffers. Raises
        :class:`HurrayFormatError` when the receiver refuses a chunk,
        ``OSError`` (:class:`NixlError`, ``TimeoutError``, ``ConnectionError``)
        when it cannot be reached or the transfer fails.
        """
        host, port = parse_nixl_url(url)
        out = []
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for ns, key, snap in chunks:
                out.append(self._send_one(sock, ns, key, snap, timeout))
        return out

    def _send_one(self, sock: socket.socket, ns: str, key: str, snap: KVSnapshot, timeout: float) -> TransferStats:
        t0 = time.perf_counter()
        parts, sources, order = _encode_snapshot_offer(ns, key, snap)
        # One send: part by part, a chunk of 32 layers took ~600 system calls and as many packets.
        body = sum(memoryview(p).nbytes for p in parts)
        sock.sendall(b"".join([MAGIC, _U64.pack(body), *parts]))
        reply = _recv_exact(sock, 2)
        if reply == b"ER":
            raise HurrayFormatError("transport", f"receiver refused chunk {key}: {_read_message(sock)}")
        if reply != b"RD":
            raise HurrayFormatError("transport", f"unexpected answer {reply!r} from the receiver")
        (xfer_id,) = _U64.unpack(_recv_exact(sock, 8))
        name = _recv_exact(sock, _U16.unpack(_recv_exact(sock, 2))[0]).decode()
        (md_len,) = _U32.unpack(_recv_exact(sock, 4))
        if md_len > _MAX_METADATA_BYTES:
            raise HurrayFormatError("transport", f"receiver metadata of {md_len} bytes is implausible")
        md = _recv_exact(sock, md_len)
        (count,) = _U32.unpack(_recv_exact(sock, 4))
        if count != len(sources):
            raise HurrayFormatError("transport", f"receiver granted {count} buffers for {len(sources)} page pools")
        addrs = [a for (a,) in _U64.iter_unpack(_recv_exact(sock, 8 * count))]
        t1 = time.perf_counter()
        if sources:
            self._transfer(sock, name, md, xfer_id, sources, addrs, order, time.monotonic() + timeout)
        t2 = time.perf_counter()
        sock.sendall(b"GO")
        answer = _recv_exact(sock, 2)
        if answer != b"OK":
            raise HurrayFormatError("transport", f"receiver refused chunk {key}: {_read_message(sock)}")
        inline = sum(memoryview(p).nbytes for p in parts if isinstance(p, memoryview))  # the inline buffers
        return TransferStats(
            key, sum(s.numel() for s in sources), inline, len(sources), t1 - t0, t2 - t1, time.perf_counter() - t2
        )

    def _post(self, agent: Any, local: Any, remote: Any, index: int, notif: bytes) -> Any:
        """Create and post the WRITE of page pool ``index`` (a separate method: tests kill the sender here)."""
        try:
            h = agent.make_prepped_xfer("WRITE", local, [index], remote, [index], notif)
        except Exception as exc:
            raise NixlError(f"NIXL could not create the transfer of page pool {index}: {exc}") from exc
        try:
            state = agent.transfer(h)
        except Exception as exc:
            state = f"ERR ({exc})"
        if state.startswith("ERR"):
            if not self._quiet(h.release):
                self._leaked.append(h)
            raise NixlError(f"NIXL could not post the transfer of page pool {index}: {state}")
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
        agent, handles = lane.agent, lane.handles
        pending = list(reversed(lane.indices))
        while pending or handles:
            if stop.is_set():
                return
            while pending and len(handles) < inflight:
                i = pending.pop()
                handles[i] = self._post(agent, lane.local, lane.remote, i, _notif(xfer_id, i))
            for i, h in list(handles.items()):
                try:
                    state = agent.check_xfer_state(h)
                except Exception as exc:
                    raise NixlError(f"NIXL transfer of page pool {i} failed: {exc}") from exc
                if state == "DONE":
                    del handles[i]
                    if not self._quiet(h.release):
                        self._leaked.append(h)
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
        with self._lock:
            peer = self._peer(name, md)
            ranges = [(s.data_ptr(), s.numel()) for s in sources]
            todo = [r for r in dict.fromkeys(ranges) if not self._covered(*r)]
            regs = self._register(todo) if todo else None
            # At most max_inflight lanes: each has at least one WRITE in flight.
            shares = _lane_shares(order, [n for _, n in ranges], min(len(self._agents), self.max_inflight))
            lanes = [_Lane(agent, share) for agent, share in zip(self._agents, shares)]
            inflight = max(1, self.max_inflight // len(lanes))
            stop = threading.Event()
            futures: list[Future[None]] = []
            done = False
            try:
                try:
                    for lane in lanes:
                        lane.local = lane.agent.prep_xfer_dlist(
                            "NIXL_INIT_AGENT", [(p, n, 0) for p, n in ranges], "DRAM"
                        )
                        lane.remote = lane.agent.prep_xfer_dlist(
                            peer, [(a, n, 0) for a, (_, n) in zip(addrs, ranges)], "DRAM"
                        )
                except Exception as exc:
                    raise NixlError(f"NIXL could not prepare the transfer: {exc}") from exc
                try:
                    if len(lanes) > 1:
                        if self._threads is None:
                            self._threads = ThreadPoolExecutor(len(self._agents) - 1, "hurray-nixl-lane")

                        def drive(lane: _Lane) -> None:
                            try:
                                self._drive(lane, xfer_id, inflight, deadline, stop, None)
                            except BaseException:
                                stop.set()  # the other lanes stop at their next poll
                                raise

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
                done = True
            finally:
                if not done:
                    try:
                        sock.sendall(b"AB")
                    except OSError:
                        pass
                    self._forget_peer(peer)
                for lane in lanes:
                    for h in lane.handles.values():
                        if not self._quiet(h.release):  # still in flight: its memory must outlive it
                            self._leaked.append((h, sources, regs))
                            regs = None
                    for d in (lane.local, lane.remote):
                        if d is not None:
                            self._quiet(d.release)
                if regs is not None:
                    self._deregister(regs)


def _watch_receiver(sock: socket.socket, timeout: float) -> None:
    """During a transfer the receiver speaks only to give up: raise if it did."""
    r, _, _ = select.select([sock], [], [], timeout)
    if not r:
        return
    head = sock.recv(1)
    if not head:
        raise ConnectionError("the receiver closed the side channel during the transfer")
    head += _recv_exact(sock, 1)
    if head == b"ER":
        raise HurrayFormatError("transport", f"receiver refused the chunk during the transfer: {_read_message(sock)}")
    raise HurrayFormatError("transport", f"unexpected {head!r} from the receiver during the transfer")


def _read_message(sock: socket.socket) -> str:
    try:
        (n,) = _U16.unpack(_recv_exact(sock, 2))
        return _recv_exact(sock, n).decode(errors="replace")
    except (HurrayFormatError, OSError):
        return "(no reason given)"


_default: NixlSender | None = None
_default_lock = threading.Lock()


def default_sender() -> NixlSender:
    """The process's shared sender (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = NixlSender()
        return _default


def send_chunks_nixl(url: str, chunks: Iterable[tuple[str, str, KVSnapshot]], *, timeout: float = 60.0) -> None:
    """:func:`hurray_vllm.transport.tcp.send_chunks` over NIXL: ``url`` is ``nixl://HOST:PORT``.

    ``chunks`` is consumed lazily, one chunk after the previous one is stored.

    Raises :class:`HurrayFormatError` when the receiver refuses a chunk,
    ``OSError`` when it cannot be reached or a transfer fails or times out,
    and :class:`NixlUnavailableError` (an ``ImportError``) without NIXL.
    """
    parse_nixl_url(url)
    default_sender().send(url, chunks, timeout=timeout)


# ── receiver ───────────────────────────────────────────────────────────────────


@dataclass(eq=False)
class _Slab:
    mem: torch.Tensor
    reg: Any

    @property
    def size(self) -> int:
        return int(self.mem.numel())


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
    """

    def __init__(self, agent: Any, max_bytes: int, quarantine_s: float) -> None:
        self._agent = agent
        self.max_bytes = max_bytes
        self.quarantine_s = quarantine_s
        self._free: list[_Slab] = []
        self._quarantined: list[tuple[float, _Slab]] = []
        self._mu = threading.Lock()
        self.total = 0
        self.registrations = 0

    def take(self, sizes: list[int]) -> tuple[_Slab, list[torch.Tensor]]:
        offsets, need = [], 0
        for s in sizes:
            offsets.append(need)
            need += -(-s // _ALIGN) * _ALIGN
        with self._mu:
            now = time.monotonic()
            self._free += [s for t, s in self._quarantined if t <= now]
            self._quarantined = [(t, s) for t, s in self._quarantined if t > now]
            fits = sorted((s for s in self._free if s.size >= need), key=lambda s: s.size)
            if fits:
                slab = fits[0]
                self._free.remove(slab)
            else:
                size = min(_slab_size(need), max(need, self.max_bytes - self.total))
                for old in sorted(self._free, key=lambda s: s.size):
                    if self.total + size <= self.max_bytes:
                        break
                    self._drop(old)
                if self.total + size > self.max_bytes:
                    raise HurrayFormatError(
                        "transport",
                        f"receiver buffers are full ({self.total} of {self.max_bytes} bytes in use); try again later",
                    )
                slab = self._new(size)
        return slab, [slab.mem[o : o + s] for o, s in zip(offsets, sizes)]

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
        try:
            self._agent.deregister_memory(slab.reg)
        except Exception as exc:
            log.debug("hurray nixl: deregistering a free slab failed: %s", exc)
        self.total -= slab.size

    def give(self, slab: _Slab) -> None:
        with self._mu:
            self._free.append(slab)

    def quarantine(self, slab: _Slab) -> None:
        """An aborted chunk's slab: a straggling write may still land, so keep it out of use for a while."""
        with self._mu:
            self._quarantined.append((time.monotonic() + self.quarantine_s, slab))


class _Notifs:
    """Routes NIXL notifications ``hvn1:<xfer id>:<index>`` to the chunk waiting for them."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._mu = threading.Lock()
        self._queues: dict[int, queue.SimpleQueue[int]] = {}

    def expect(self, xfer_id: int) -> queue.SimpleQueue[int]:
        q: queue.SimpleQueue[int] = queue.SimpleQueue()
        with self._mu:
            self._queues[xfer_id] = q
        return q

    def forget(self, xfer_id: int) -> None:
        with self._mu:
            self._queues.pop(xfer_id, None)

    def poll(self) -> None:
        with self._mu:  # one poller at a time: get_new_notifs hands each notification out once
            try:
                new = self._agent.get_new_notifs()
            except Exception as exc:
                log.warning("hurray nixl: reading notifications failed: %s", exc)
                return
            for msgs in new.values():
                for m in msgs:
                    if not m.startswith(_NOTIF):
                        continue
                    xid_s, _, idx_s = bytes(m[len(_NOTIF) :]).partition(b":")
                    try:
                        xid, idx = int(xid_s, 16), int(idx_s)
                    except ValueError:
                        continue
                    q = self._queues.get(xid)
                    if q is not None:  # notifications of aborted chunks are dropped
                        q.put(idx)


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


class NixlReceiver:
    """Accepts chunks over NIXL (side channel on ``host:port``) and stores the valid ones in ``store``.

    Like :class:`hurray_vllm.transport.tcp.Receiver`: daemon threads, one per
    side-channel connection; :meth:`stop` closes it. ``timeout`` bounds every
    step of a chunk (offer, transfer, commit); ``idle_timeout`` how long a
    connection may wait between chunks. Incoming page pools land in a
    registered arena of at most ``max_arena_bytes``; one chunk's pools may
    not exceed ``max_chunk_bytes``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        store: ChunkStore,
        *,
        timeout: float = 60.0,
        idle_timeout: float = 120.0,
        max_chunk_bytes: int = MAX_CHUNK_BYTES,
        max_arena_bytes: int = DEFAULT_ARENA_BYTES,
        backend_params: dict[str, str] | None = None,
        progress_thread: bool = False,
    ) -> None:
        self.store = store
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.max_chunk_bytes = max_chunk_bytes
        self._agent = _make_agent("recv", backend_params, progress_thread)
        self.name = str(self._agent.name)
        self.arena = _Arena(self._agent, max_arena_bytes, quarantine_s=max(2 * timeout, 5.0))
        self._notifs = _Notifs(self._agent)
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.address = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._mu = threading.Lock()
        self.received = 0
        self.refused = 0
        self.last_error: str | None = None

    def start(self) -> NixlReceiver:
        threading.Thread(target=self._accept, name="hurray-nixl-receiver", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop accepting and close open side channels (their chunks abort; nothing partial is stored)."""
        self._stop.set()
        self._sock.close()
        with self._mu:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> NixlReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="hurray-nixl-conn", daemon=True).start()

    def _count(self, ok: bool, err: str | None = None) -> None:
        with self._mu:
            if ok:
                self.received += 1
            else:
                self.refused += 1
                self.last_error = err

    def _serve(self, conn: socket.socket) -> None:
        with self._mu:
            self._conns.add(conn)
        try:
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while not self._stop.is_set():
                    try:
                        conn.settimeout(self.idle_timeout)
                        head = conn.recv(4)
                        if not head:
                            return
                        conn.settimeout(self.timeout)
                        if len(head) < 4:
                            head += _recv_exact(conn, 4 - len(head))
                        if head != MAGIC:
                            raise HurrayFormatError("transport", "bad frame magic")
                        (length,) = _U64.unpack(_recv_exact(conn, 8))
                        if length > MAX_OFFER_BYTES:
                            raise HurrayFormatError("transport", f"an offer of {length} bytes exceeds the limit")
                        body = bytearray(length)
                        view = memoryview(body)
                        got = 0
                        while got < length:
                            k = conn.recv_into(view[got:], min(length - got, 1 << 20))
                            if not k:
                                raise HurrayFormatError("transport", "sender disconnected in the middle of an offer")
                            got += k
                    except (HurrayFormatError, OSError) as exc:
                        log.warning("hurray nixl receiver: dropping connection: %s", exc)
                        if isinstance(exc, HurrayFormatError):
                            self._count(False, str(exc))
                            _send_error(conn, exc)
                        return
                    if not self._chunk(conn, body):
                        return
        finally:
            with self._mu:
                self._conns.discard(conn)

    def _chunk(self, conn: socket.socket, body: bytearray) -> bool:
        """Handle one offer to its end; False when the connection must be closed."""
        key = "?"
        slab: _Slab | None = None
        xfer_id = secrets.randbits(63) + 1
        landed = True
        try:
            offer = _parse_offer(body, self.max_chunk_bytes)
            key = offer.key
            views: list[torch.Tensor] = []
            if offer.remote_sizes:
                slab, views = self.arena.take(offer.remote_sizes)
            records = [
                Record("", d, [views[b] if isinstance(b, int) else b for b in bufs])
                for d, bufs in zip(offer.descriptors, offer.buffers)
            ]
            snap = assemble_snapshot(group_records(records))
            want = snap.extra.get(DIGEST_KEY)
            algorithm = ChunkDigest.like(want).algorithm  # refuses a missing or unknown digest before any transfer
            where = {v.data_ptr(): i for i, v in enumerate(views)}
            plan = [
                (tensor_bytes(t.page_pool), where.get(t.page_pool.data_ptr()) if t.page_pool.numel() else None)
                for t in (*snap.keys, *snap.values)
            ]
            if sorted(i for _, i in plan if i is not None) != list(range(len(views))):
                raise HurrayFormatError("transport.offer", "the announced page pools are not the snapshot's")
            q = self._notifs.expect(xfer_id)
            name = self.name.encode()
            md = self._agent.get_agent_metadata() if views else b""
            landed = False
            conn.sendall(
                b"RD"
                + _U64.pack(xfer_id)
                + _U16.pack(len(name))
                + name
                + _U32.pack(len(md))
                + md
                + _U32.pack(len(views))
                + b"".join(_U64.pack(v.data_ptr()) for v in views)
            )
            digest = self._await(conn, q, plan, len(views), algorithm)
            landed = True
            if digest != want:
                raise HurrayFormatError("snapshot.digest", "chunk data does not match its digest (corrupt transfer?)")
            self.store.put(offer.ns, key, snap)
            del snap, records, views, plan
            self._count(True)
            try:
                conn.sendall(b"OK")
            except OSError:
                return False  # stored; the sender will learn nothing more on this connection
            return True
        except _Aborted as exc:
            self._count(False, str(exc))
            log.warning("hurray nixl receiver: aborted chunk %s, nothing stored: %s", key, exc)
            _send_error(conn, exc)
            return False
        except (HurrayFormatError, OSError) as exc:
            self._count(False, str(exc))
            log.warning("hurray nixl receiver: refused chunk %s: %s", key, exc)
            return _send_error(conn, exc) and landed
        except Exception as exc:  # a NIXL call failed in an unforeseen way: drop this connection, keep serving
            self._count(False, f"{type(exc).__name__}: {exc}")
            log.exception("hurray nixl receiver: chunk %s failed, nothing stored", key)
            _send_error(conn, exc)
            return False
        finally:
            self._notifs.forget(xfer_id)
            if slab is not None:
                (self.arena.give if landed else self.arena.quarantine)(slab)

    def _await(
        self,
        conn: socket.socket,
        q: queue.SimpleQueue[int],
        plan: list[tuple[memoryview, int | None]],
        n: int,
        algorithm: str,
    ) -> str:
        """Wait for every page pool and the sender's GO, hashing pools in digest order as they land."""
        deadline = time.monotonic() + self.timeout
        hasher = _Hasher(algorithm)
        try:
            return self._await_hashing(conn, q, plan, n, deadline, hasher)
        finally:
            hasher.cancel()

    def _await_hashing(
        self,
        conn: socket.socket,
        q: queue.SimpleQueue[int],
        plan: list[tuple[memoryview, int | None]],
        n: int,
        deadline: float,
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
                    raise _Aborted(f"timed out after {self.timeout:g} s verifying the chunk digest")
                return digest
            if self._stop.is_set():
                raise _Aborted("the receiver is stopping")
            if time.monotonic() > deadline:
                raise _Aborted(f"timed out after {self.timeout:g} s ({len(arrived)} of {n} page pools arrived)")
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
                r, _, _ = select.select([conn], [], [], _RECV_POLL_S if len(arrived) < n else 0.05)
                data = conn.recv(2 - len(pending)) if r else None
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


def _send_error(conn: socket.socket, exc: BaseException) -> bool:
    msg = str(exc).encode()[:1000]
    try:
        conn.sendall(b"ER" + _U16.pack(len(msg)) + msg)
        return True
    except OSError:
        return False
