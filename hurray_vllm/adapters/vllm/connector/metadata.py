"""What the scheduler part hands the worker part: each step's metadata, and the chunks it verified.

* :class:`HurrayConnectorMetadata` travels with every step (vLLM pickles it
  to a worker in another process): the loads and saves to perform. A load
  carries the chunks the scheduler verified to a worker in the same process,
  which writes them without reading their files again; pickling leaves them
  out (:class:`LoadTask`).
* :data:`VERIFIED` remembers the chunks this process verified, so that a
  later load of the same prefix neither reads nor checks their files again
  (see :class:`VerifiedChunks`).
* :data:`REFUSED` remembers the chunk files this process refused and left in
  place, so that later lookups stop at them without reading them again
  (see :class:`RefusedChunks`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ....chunks.signing import OTHER_KEY, UNSIGNED, FleetKeys
from ....errors import HurrayArgumentError, HurrayFormatError
from ....kv.snapshot import KVSnapshot

__all__ = [
    "DEFAULT_VERIFIED_BYTES",
    "REFUSED",
    "VERIFIED",
    "verified_scope",
    "ConnectorStats",
    "HurrayConnectorMetadata",
    "LoadTask",
    "RefusedChunks",
    "SaveTask",
    "VerifiedChunks",
    "forget_verified_chunks",
    "is_damage",
    "snapshot_bytes",
]


@dataclass
class LoadTask:
    """A request's stored chunks for the worker to load: their keys and tokens, and the engine blocks they fill."""

    request_id: str
    keys: list[str]
    tokens: list[list[int]]  # per chunk
    block_ids: list[int]  # engine blocks to fill, chunk after chunk (the first chunk's skipped blocks excluded)
    #: Per chunk, the files the scheduler verified: ``(name, first head, end head, file identity)``; one
    #: file holds every head, or tensor-parallel slices together do (``DirectoryStore.parts``).
    parts: list[list[tuple[str, int, int, tuple[int, ...]]]] = field(default_factory=list)
    #: Leading blocks of the first chunk the engine already holds (a local prefix-cache hit that ends
    #: mid-chunk): they are not written, so blocks shared with other requests are never touched.
    skip_blocks: int = 0
    #: Several KV cache groups: the blocks to fill per group, aligned with ``block_ids`` (a sliding-window
    #: group's entries out of its window are the null block 0: nothing is written there).
    groups: list[list[int]] = field(default_factory=list)
    #: A linear-attention hybrid: the token the load resumes at (where the last chunk's states were
    #: taken), and per state group the blocks its state is written into.
    resume: int = 0
    state_blocks: dict[int, list[int]] = field(default_factory=dict)
    #: The last key is a tail (``hurray_tails``): fewer tokens than a chunk, its whole blocks only.
    tail: bool = False
    #: Loaded through vLLM's asynchronous-load path: the worker reports the request as received, or as
    #: failed (``get_transfer_results``), instead of reporting blocks (``config.async_loads``).
    report: bool = False
    #: Per chunk, the snapshots the scheduler verified, aligned with ``parts``: a worker in the
    #: scheduler's process writes from them (never read again, whatever the verified-chunk cache
    #: evicted meanwhile). Not pickled: a worker in another process reads the files.
    snaps: list[list[KVSnapshot]] = field(default_factory=list, repr=False, compare=False)

    def __getstate__(self) -> dict[str, object]:
        """What crosses to a worker in another process: everything but the verified snapshots."""
        return {**self.__dict__, "snaps": []}

    def num_tokens(self, chunk_tokens: int) -> int:
        """The tokens the chunks cover (the first one's skipped blocks included): whole chunks, then the tail."""
        return (len(self.keys) - self.tail) * chunk_tokens + (len(self.tokens[-1]) if self.tail else 0)


@dataclass
class SaveTask:
    """One chunk of a request for the worker to save: its key and tokens, and the engine blocks holding its KV."""

    request_id: str
    key: str
    tokens: list[int]
    block_ids: list[int]
    #: Several KV cache groups: each group's blocks of the chunk; a sliding-window group's blocks no
    #: later resume needs (out of the window of the chunk's end) are 0, so the chunk does not store them.
    groups: list[list[int]] = field(default_factory=list)
    #: A linear-attention hybrid whose state at the chunk's end is in the engine this step: per state
    #: group the block holding it (empty otherwise: the chunk is stored without states), and that end.
    state_blocks: dict[int, list[int]] = field(default_factory=dict)
    state_position: int = 0
    #: Write even if the key is stored: the stored chunk lacks the states this one carries.
    replace: bool = False
    #: A prompt's tail (``hurray_tails``): its whole blocks after its last whole chunk, fewer than a chunk's.
    tail: bool = False
    #: Stored already (loaded, not computed here): only pushed on to ``hurray_url``, from its files, if the
    #: destination lacks them; never exported (``tokens`` and ``block_ids`` are empty).
    forward: bool = False
    #: The key of the chunk before this one in its prefix (a tail's: its last whole chunk's; a slice's: the
    #: previous chunk's key, not a slice name), written into the chunk's header (``PARENT_KEY``) so that a
    #: prune keeps it while it keeps this chunk. None for a sequence's first chunk.
    parent: str | None = None
    #: Blocks of the request before the chunk's own that another request's synchronous load fills in a step
    #: still in flight (a prefix-cache hit on its blocks): the chunk's attention read them, so a failure of that
    #: load spoils this chunk too, which its own blocks would not tell the worker (``wait_for_save``).
    reads: list[int] = field(default_factory=list)


@dataclass
class HurrayConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the worker to do in one step."""

    loads: list[LoadTask] = field(default_factory=list)
    saves: list[SaveTask] = field(default_factory=list)


@dataclass
class ConnectorStats:
    """Counters a test or an operator can read (``connector.stats``)."""

    chunks_saved: int = 0
    chunks_skipped: int = 0
    chunks_loaded: int = 0
    tokens_loaded: int = 0  # worker: tokens written from whole chunks and tails
    tails_saved: int = 0  # worker: prompt tails stored (hurray_tails), not counted in chunks_saved
    tails_loaded: int = 0  # worker: tails loaded after a request's whole chunks, not counted in chunks_loaded
    chunks_refused: int = 0
    chunks_unsigned: int = 0  # refused (with hurray_key_file): no MAC; not moved aside
    chunks_other_key: int = 0  # refused: signed with a key not in hurray_key_file; not moved aside
    chunks_bad_mac: int = 0  # refused: wrong MAC (forged, copied under another name, damaged); moved aside
    bytes_saved: int = 0
    chunks_remembered: int = 0  # loads served by chunks verified earlier in this process (files not read again)
    chunks_quarantined: int = 0  # damaged chunk files moved aside (<key>.hrry.bad), so that they are written again
    chunks_pushed: int = 0  # worker: chunks the hurray_url receiver acknowledged
    push_failures: int = 0  # worker: pushes that failed (each pauses pushing: PUSH_BACKOFF_S, doubling in a row)
    chunks_forwarded: int = 0  # worker: of chunks_pushed, files pushed on from the store (loaded, or saved earlier)
    chunks_held: int = 0  # worker: files not pushed on because the receiver said it holds them already
    push_waits: int = 0  # scheduler: requests held back until the chunks their kv_transfer_params announced arrived
    push_wait_timeouts: int = 0  # scheduler: ... of which some chunks never came (those tokens were recomputed)
    cache_resets: int = 0  # scheduler: vLLM reset the connector (reset_cache): new keys from then on
    #: Loads that failed on the worker after the scheduler promised them (a file gone, I/O): recomputed.
    #: Counted by each worker; by the scheduler too for asynchronous loads (``config.async_loads``).
    loads_failed: int = 0
    #: worker: chunks (and tails) that read blocks a failed synchronous load did not write (the failed
    #: request's, and those holding or having read its blocks: ``SaveTask.reads``): not saved (saved once
    #: recomputed).
    saves_dropped: int = 0
    #: worker: chunks (and tails) a step planned to save that could not be: no memory for their block or
    #: state copies, a block id outside the cache, an export or a file write that failed (disk full). Not
    #: stored; recomputed by whoever lacks them.
    saves_failed: int = 0
    save_s: float = 0.0  # worker: wall time the steps spent saving (with async saves: copying the blocks out)
    load_s: float = 0.0  # worker: wall time the steps spent loading (reading, checking, writing blocks)


#: ``hurray_verified_mib``'s default, in bytes: what verified chunks may hold in memory per process.
DEFAULT_VERIFIED_BYTES = 2048 << 20


class VerifiedChunks:
    """Chunks this process verified (model, tokens, checksum), by key, with their file's identity.

    A later load of the same prefix (the next turn of a conversation, a
    shared system prompt) skips reading, parsing and checksumming their
    files again as long as each file is still the one that was verified
    (:meth:`DirectoryStore.identity`); a worker in another process keeps
    the chunks it read and checked itself. Least recently used first out.

    An entry holds the chunk's page pools in the process's own memory (files
    are read, not mapped: issue 17), so the cache is bounded in bytes as well
    as in entries. Evicting an entry never fails a load: the load carries
    its own chunks to a worker in the scheduler's process.

    ``capacity`` and ``max_bytes`` are only the default bounds: each
    connector part passes its own (``hurray_verified_chunks``,
    ``hurray_verified_mib``) to :meth:`put`, so that building a connector
    changes nothing process-wide.
    """

    def __init__(self, capacity: int, max_bytes: int = DEFAULT_VERIFIED_BYTES) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # By (scope, name): see verified_scope.
        self._items: OrderedDict[tuple[str, str], tuple[tuple[int, ...], KVSnapshot, int]] = OrderedDict()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of page pools and states the kept chunks hold."""
        return self._bytes

    def get(self, key: str, identity: tuple[int, ...], scope: str = "") -> KVSnapshot | None:
        """The snapshot verified for ``key`` under ``scope`` if its file still has ``identity``, else None.

        A hit becomes the most recently used. ``scope``: :func:`verified_scope` of the checks the caller
        demands; only a chunk verified under the same checks is served.
        """
        with self._lock:
            hit = self._items.get((scope, key))
            if hit is None or hit[0] != identity:
                return None
            self._items.move_to_end((scope, key))
            return hit[1]

    def put(
        self,
        key: str,
        identity: tuple[int, ...],
        snap: KVSnapshot,
        capacity: int | None = None,
        max_bytes: int | None = None,
        scope: str = "",
    ) -> None:
        """Keep ``snap``, verified under ``scope``; then drop the least recently used beyond the bounds.

        The bounds (``capacity`` entries, ``max_bytes``) default to :attr:`capacity`
        and :attr:`max_bytes`. A chunk larger than ``max_bytes`` alone is not
        kept, and evicts only what the bounds do.
        """
        keep = self.capacity if capacity is None else capacity
        budget = self.max_bytes if max_bytes is None else max_bytes
        size = snapshot_bytes(snap)
        with self._lock:
            old = self._items.pop((scope, key), None)
            if old is not None:
                self._bytes -= old[2]
            if size <= budget:  # a chunk larger than the budget alone would evict everything, then itself
                self._items[(scope, key)] = (identity, snap, size)
                self._bytes += size
            while self._items and (len(self._items) > keep or self._bytes > budget):
                self._bytes -= self._items.popitem(last=False)[1][2]

    def clear(self) -> None:
        """Forget every chunk."""
        with self._lock:
            self._items.clear()
            self._bytes = 0


def verified_scope(keys: FleetKeys | None) -> str:
    """What a chunk was verified against: its checksum alone (``""``), or a MAC under one of ``keys``.

    Part of :data:`VERIFIED`'s key, so that a chunk a connector without a fleet key took (on its
    checksum) is never served from memory to one that demands a signature, nor one verified under
    another key ring.
    """
    return "" if keys is None else "mac:" + "+".join(keys.ids)


def snapshot_bytes(snap: KVSnapshot) -> int:
    """Bytes of ``snap``'s page pools and recurrent states (what keeping it costs)."""
    pools = sum(t.page_pool.numel() * t.page_pool.element_size() for t in (*snap.keys, *snap.values, *snap.fused))
    states = 0
    if snap.states is not None:
        states = sum(t.numel() * t.element_size() for layer in snap.states.tensors for t in layer)
    return int(pools + states)


#: Shared by the scheduler part and a worker part in the same process: the handoff of verified
#: chunks (see VerifiedChunks). Its bound is the one each part passes to ``put``.
VERIFIED = VerifiedChunks(256)


class RefusedChunks:
    """Chunk files this process refused and left in place, by scope, file name and file identity.

    A file refused for what it is, not moved aside (another model's, unsigned or
    signed with another key, a digest this version cannot verify, unreadable
    for good), stays in the store: without this memory every lookup that meets
    it (vLLM asks again for a waiting request at every step, and every request
    with the prefix asks) would read, check, log and count it again. A file
    changed since (another identity, :meth:`DirectoryStore.identity`) is judged
    afresh. Bounded in entries, oldest first out: forgetting one costs one
    more read of its file.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[str, str, tuple[int, ...]], None] = OrderedDict()

    def has(self, name: str, identity: tuple[int, ...], scope: str = "") -> bool:
        """Whether file ``name`` with ``identity`` was refused under ``scope`` (:func:`verified_scope`)."""
        with self._lock:
            return (scope, name, identity) in self._items

    def add(self, name: str, identity: tuple[int, ...], scope: str = "") -> None:
        """Remember file ``name`` with ``identity`` as refused under ``scope``; the oldest beyond the bound go."""
        with self._lock:
            self._items[(scope, name, identity)] = None
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def clear(self) -> None:
        """Forget every refusal."""
        with self._lock:
            self._items.clear()


#: The scheduler parts' refusals of this process (see RefusedChunks): a few hundred bytes an entry.
REFUSED = RefusedChunks(4096)


def forget_verified_chunks() -> None:
    """Drop every chunk this process remembers as verified or refused: the next loads read and check their files."""
    VERIFIED.clear()
    REFUSED.clear()


def is_damage(exc: BaseException) -> bool:
    """Whether ``exc`` says a chunk *file* is damaged, so that it may be moved aside.

    Only a data error (:class:`HurrayFormatError`) is, and not a fingerprint
    mismatch (another model's chunk is fine, just not ours), nor a chunk
    that is unsigned or signed with another fleet's key (fine for whoever
    holds that key; a wrong MAC under a key of ours is damage). A caller error
    (:class:`HurrayArgumentError`), an ``OSError`` or any other exception says
    nothing about the file: a good chunk must never be quarantined for one.
    """
    return (
        isinstance(exc, HurrayFormatError)
        and not isinstance(exc, HurrayArgumentError)
        and exc.field not in ("snapshot.fingerprint", UNSIGNED, OTHER_KEY)
    )
