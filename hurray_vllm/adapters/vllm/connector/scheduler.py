"""The scheduler part of :class:`~hurray_vllm.adapters.vllm.connector.HurrayConnector`.

Runs in the engine core's process, inside vLLM's scheduling loop: it finds
stored prefixes for new requests, plans each step's loads and saves
(:class:`~.metadata.HurrayConnectorMetadata`) and runs the ``hurray_listen``
receiver.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import secrets
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .... import native
from ....chunks.digest import digest_unverifiable
from ....chunks.keys import key_seed
from ....chunks.signing import refusal_kind
from ....chunks.store import (
    MISSING,
    ChunkPart,
    ChunkReader,
    ChunkUses,
    DirectoryStore,
    chunk_keys,
    load_chunk,
    read_header,
    tail_keys,
    verify_chunk,
)
from ....chunks.verify import begin_check_data
from ....containers.hrryfile import FileBytes
from ....errors import HurrayArgumentError, HurrayFormatError
from ....kv.snapshot import KVSnapshot, ModelFingerprint, SlidingWindows
from ....kv.states import RecurrentStates
from ....transport import ReceiverBase, receiver_for
from ....transport.base import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT_S,
    host_port,
    parse_listen,
)
from ....transport.security import server_context
from ..cache import adapter_digest
from ..states import state_block, step_block
from .config import HurrayConfig
from .metadata import (
    REFUSED,
    VERIFIED,
    ConnectorStats,
    HurrayConnectorMetadata,
    LoadTask,
    SaveTask,
    is_damage,
    verified_scope,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["HurrayScheduler", "is_damage"]

log = logging.getLogger("hurray_vllm.connector")

_POOL_LOCK = threading.Lock()


@dataclass
class _Listening:
    """A ``hurray_listen`` receiver of this process, the configuration it was started with, and its engines."""

    receiver: ReceiverBase
    setup: tuple[Any, ...]
    users: int = 1


def _effective_limits(limits: dict[str, Any], transport: str) -> tuple[tuple[str, Any], ...]:
    """``limits`` (``HurrayConfig.listen_limits``: the options given) with the receiver's defaults filled in.

    What two engines sharing a receiver must agree on: one that spells out a default
    (``hurray_listen_max_connections: 64``) asks for the same receiver as one that leaves it unset.
    """
    defaults: dict[str, Any] = {
        "timeout": DEFAULT_TIMEOUT_S,
        "idle_timeout": DEFAULT_IDLE_TIMEOUT_S,
        "max_connections": DEFAULT_MAX_CONNECTIONS,
        "quota_bytes": None,
        "min_free_bytes": 0,
    }
    if transport == "nixl":  # imported here, as receiver_for does: only an engine receiving over NIXL needs it
        from ....transport.nixl.receiver import DEFAULT_ARENA_BYTES

        defaults["max_arena_bytes"] = DEFAULT_ARENA_BYTES
    else:
        from ....transport.tcp import DEFAULT_INFLIGHT_BYTES

        defaults["max_inflight_bytes"] = DEFAULT_INFLIGHT_BYTES
    return tuple(sorted({**defaults, **limits}.items()))


_RECEIVERS_LOCK = threading.Lock()
#: By the address bound (host, port): port 0's receiver under the port it got.
_RECEIVERS: dict[tuple[str, int], _Listening] = {}
_HELPERS: dict[str, ThreadPoolExecutor] = {}
#: Stored chunk files whose headers' windows and states a scheduler remembers (a few hundred bytes each), and
#: complete sets of them whose resume it remembers (:meth:`HurrayScheduler._serves_from`); the least recently used
#: go first.
_STORED_HEADERS_CAP = 4096
#: Complete sets of a chunk's files a scheduler remembers not joining (:func:`_fit_together`).
_UNJOINED_CAP = 4096
#: Chunk files a scheduler remembers refusing for their states' layout (warned about and counted once each).
_LAYOUT_REFUSED_CAP = 4096
#: Errors reading a chunk file that say nothing about the file (the process ran short): such a refusal is not
#: remembered (REFUSED), the next lookup reads the file again.
_PASSING_ERRNOS = frozenset({errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.EMFILE, errno.ENFILE, errno.ENOBUFS})
# A forked child inherits the executors without their threads: it makes its own.
os.register_at_fork(after_in_child=_HELPERS.clear)

#: How many windowed chunks' save plans a scheduler remembers (HurrayScheduler._window_plans): a few hundred
#: bytes each, far more than the saves of the steps a worker's queue holds.
_WINDOW_PLANS = 4096


def _forget_parents_receivers() -> None:
    """In a forked child: drop the parent's receivers, whose threads live in the parent only.

    Shared, one would take nothing in the child, and the child's last shutdown would close the listening
    socket under the parent's receiver. The child's engines start their own (the parent's address: refused,
    in use). The lock too is the child's own: a parent thread may have held it at the fork.
    """
    global _RECEIVERS_LOCK
    _RECEIVERS_LOCK = threading.Lock()
    _RECEIVERS.clear()


os.register_at_fork(after_in_child=_forget_parents_receivers)


def _helper(name: str) -> ThreadPoolExecutor:
    """The one helper thread ``name``, made on first use: ``"digest"`` for chunk checksums, ``"read"`` for reads.

    Both run calls that release the GIL (native checksums, file reads).
    Reads have their own thread so that the next file's read never waits
    behind a checksum: a MAC takes longer than the parse it overlaps.
    """
    with _POOL_LOCK:
        pool = _HELPERS.get(name)
        if pool is None:
            pool = _HELPERS[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hurray-{name}")
        return pool


class _Windowed(Protocol):
    """A chunk, or what its header says of it: the sliding windows it holds."""

    @property
    def windows(self) -> SlidingWindows | None: ...


@dataclass(frozen=True)
class _Held:
    """What a stored chunk file's header says of what it holds: its windows, and its states' layout and position.

    Enough to choose between a chunk's complete sets of files (whole, or another TP degree's slices) before
    any is read, and to tell slices that do not join (:func:`_headers_agree`).
    """

    windows: SlidingWindows | None
    states: RecurrentStates | None


def _same_states(a: RecurrentStates | None, b: RecurrentStates | None) -> bool:
    """Whether two slices of a chunk carry states that join: each its share, taken at the same token (or none)."""
    if a is None or b is None:
        return a is None and b is None
    return a.positions == b.positions and not a.mismatches(b)


def _headers_agree(held: list[_Held | None]) -> bool:
    """Whether a chunk's files, by their headers, join into one (:func:`_fit_together`'s windows and states).

    An unreadable header (``None``) says nothing: its reader refuses the file (and moves it aside if damaged).
    """
    known = [h for h in held if h is not None]
    return all(h.windows == known[0].windows and _same_states(h.states, known[0].states) for h in known[1:])


def _windows_held(
    chunks: Sequence[_Windowed], first: int, resume: int, chunk: int, block_size: int, computed: int = 0
) -> bool:
    """Whether chunks ``first, first + 1, ...`` hold every sliding-window token a resume at ``resume`` attends.

    Chunk ``i`` covers tokens ``[i * chunk, (i + 1) * chunk)``; a windowed
    layer must hold those from ``resume - window + 1`` on, from the start of
    the engine block that token is in: vLLM keeps that whole block, and the
    worker refuses a load that leaves part of a kept block unwritten (which,
    with several KV cache groups, stops a vLLM 0.32 engine). The producer's
    blocks may be smaller than this engine's. ``computed``: the engine's own
    prefix-cache hit (whole blocks), which may end inside chunk ``first``:
    the blocks before it are the engine's, not written by the load.
    """
    for n, snap in enumerate(chunks):
        win = snap.windows
        if win is None:
            continue
        base = (first + n) * chunk
        for size, starts in zip(win.sizes, win.kv_start):
            if size is None:
                continue
            kept = max(0, resume - size + 1) // block_size * block_size  # the first block vLLM keeps
            if base + starts[0] > max(base, kept, computed):
                return False
    return True


def _slides(windows: SlidingWindows) -> Counter[int]:
    """How many of a chunk's layers slide, by window."""
    return Counter(size for size in windows.sizes if size is not None)


def _fit_together(parts: list[KVSnapshot]) -> bool:
    """Whether a chunk's slices join into one (same scales, windows, states and page structure), as workers will.

    Slices of two producers (other fp8 scales, another window policy) sharing
    a store would otherwise pass here one by one and fail in the workers.
    """
    first = parts[0]
    return all(
        p.kv_scales == first.kv_scales
        and p.windows == first.windows
        and _same_states(p.states, first.states)
        and p.page_size == first.page_size
        and [t.page_pool.shape[:2] for t in p.tensors()] == [t.page_pool.shape[:2] for t in first.tensors()]
        for p in parts[1:]
    )


def _count(value: object) -> int:
    """A ``kv_transfer_params`` entry as a token count: 0 unless a positive int (JSON gives ints; bools are not)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _not_keyable(request: Any) -> bool:
    """Whether ``request``'s KV depends on inputs its token ids do not name (multimodal data, prompt embeddings)."""
    return bool(getattr(request, "mm_features", None)) or getattr(request, "prompt_embeds", None) is not None


def request_seed(namespace: str, request: Any, epoch: str | None = None) -> str | None:
    """The seed of ``request``'s chunk keys (:func:`~hurray_vllm.chunks.keys.key_seed`); None: it has no chunks.

    A LoRA adapter (the digest of its files, :func:`~hurray_vllm.adapters.vllm.cache.adapter_digest`)
    and a ``cache_salt`` go into the seed. An adapter whose files are not on this
    machine has no identity to key by (its name and path may stand for other
    weights tomorrow: a new hub revision, files replaced): such a request is
    neither loaded nor saved. Images, audio and
    other multimodal inputs, and prompt embeddings, decide KV that the token
    ids do not name (their positions hold placeholders): such a request is
    neither loaded nor saved.
    """
    if _not_keyable(request):
        return None
    lora = getattr(request, "lora_request", None)
    adapter = None
    if lora:
        path = str(getattr(lora, "lora_path", "") or "")
        digest = adapter_digest(path) if path else None
        if digest is None:  # never by name and path: the store outlives the adapter those name today
            return None
        adapter = ("files", digest)
    return key_seed(namespace, lora=adapter, cache_salt=getattr(request, "cache_salt", None), epoch=epoch)


#: What a lookup found in the store: per file, its name and identity (``DirectoryStore.identity``).
_Files = tuple[tuple[str, tuple[int, ...]], ...]


def _files(parts: list[ChunkPart]) -> _Files:
    return tuple((p.name, p.identity) for p in parts)


def _task_parts(parts: list[ChunkPart]) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """A chunk's files as a load names them (``LoadTask.parts``): name, heads held, identity."""
    return [(p.name, p.heads.start, p.heads.stop, p.identity) for p in parts]


def _tail_files(probed: tuple[str, list[int], list[ChunkPart]] | None) -> tuple[str, _Files] | None:
    """A probed tail (``HurrayScheduler._probe_tail``) as a lookup remembers it: its key and files."""
    return None if probed is None else (probed[0], _files(probed[2]))


@dataclass
class _Lookup:
    """The lookup that planned a load, and the stored files it was made on (``get_num_new_matched_tokens``)."""

    #: Where it started (the local prefix-cache hit) and the stored chunk files after it, in order.
    files: tuple[int, _Files]
    hit: int  # the whole chunks it ends after
    tail: tuple[str, _Files] | None  # the tail found stored after them (key, files), loaded or refused
    matched: int  # the tokens offered


@dataclass
class _Request:
    request: Any
    #: Its chunk keys' seed (``request_seed``): the namespace, a LoRA adapter, a cache salt; None: no chunks.
    seed: str | None = None
    block_ids: list[int] = field(default_factory=list)  # group 0's
    groups: list[list[int]] = field(default_factory=list)  # every group's (several KV cache groups only)
    chunks_done: int = 0  # chunks known to be in the store (saved or loaded)
    load: LoadTask | None = None
    #: Waiting for pushed chunks (:meth:`HurrayScheduler._awaits_push`): how many had arrived, since when
    #: (monotonic), and whether the wait is over (all came, or they stopped coming).
    arrived: int = -1
    arrived_at: float = 0.0
    waited: bool = False
    #: ``hurray_tails``: the prompt's tail was looked at (once, in the step that ends its prefill), and the
    #: token it ends at when one was saved (0: none).
    tail_planned: bool = False
    tail_end: int = 0
    #: Where the planned load starts (the local prefix-cache hit it was planned after).
    load_from: int = 0
    #: The whole chunks a load wrote while ``chunks_done`` stays before them (a chunk of the local prefix-cache
    #: hit was not stored): the next planned saves skip them. Empty once those saves are planned.
    loaded: range = field(default_factory=lambda: range(0))
    #: A load promised to this request failed on a worker (reported through vLLM's asynchronous-load
    #: path): vLLM recomputes the request, and this connector does not offer it a load again.
    load_failed: bool = False
    #: Where the request's previous step ended (0: none since its blocks were given): with linear-attention
    #: states in "align" mode, the state there is still in its block during the next step.
    prev_end: int = 0
    #: The lookup that planned ``load``, while vLLM may ask again (it could not allocate the blocks): the same
    #: answer and load while the store holds the same files. None once vLLM took an answer.
    lookup: _Lookup | None = None


class HurrayScheduler:
    """Scheduler-side state and methods (see the facade's docstrings for who calls what, when)."""

    def __init__(self, config: HurrayConfig, store: DirectoryStore, fingerprint: ModelFingerprint, ns: str) -> None:
        self._config = config
        self._store = store
        self._fingerprint = fingerprint
        self._ns = ns
        # Set by reset_cache: the KV this engine computes from then on may come from other weights than its
        # namespace names (a weight update), so its keys are its own (key_seed's epoch).
        self._epoch: str | None = None
        self._chunk = config.chunk_tokens
        self._block_size = config.block_size
        self._loads = config.loads
        self._saves = config.saves
        self._url = config.url
        self.stats = ConnectorStats()
        self._reqs: dict[str, _Request] = {}
        # The process-wide handoff cache is bounded by this part's own setting on each put.
        self._verified_cap = config.verified_chunks
        self._scope = verified_scope(config.keys)
        self._verified_bytes = config.verified_bytes
        # Files served from the verified copies are read a byte now and then: prune ranks by access time.
        self._uses = ChunkUses(store, ns, self._verified_cap)
        self._windows = config.group_windows  # () for one KV cache group
        # How many of this engine's layers slide, by window: a chunk saved with other windows (an engine with
        # the hybrid KV cache manager or sliding windows off) is refused by the worker, so it is not offered.
        self._window_counts = Counter(
            w for g in config.layer_groups.values() if g < len(self._windows) and (w := self._windows[g]) is not None
        )
        # Whether a chunk's sliding-window layers hold less than its tokens: its files' headers then choose
        # between its complete sets (a lookup's, a save's), and tell a stored copy that holds less.
        self._sliding = any(w is not None for w in self._windows)
        #: Windowed chunks this scheduler planned to save, by key: ``(chunk index, resume)`` of the plan holding
        #: the most of their windows (:meth:`_window_start`). A later save holding more is written over it even
        #: where the store does not show it yet (its file still on the worker's queue, or landing after the
        #: look): else whichever landed first stayed, by timing (the worker skips a copy in flight, and the
        #: store keeps the first writer's). Bounded: the oldest entries go first.
        self._window_plans: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._last_only = config.window_chunks == "last"
        # Chunk files' pages checksummed as they are read, where the CRC-32C digest is the check (a MAC reads the
        # pools itself) and the CPU folds (bench_read.py: with the crc32 instruction alone it saved nothing here).
        self._page_crcs = config.keys is None and native.crc32c_fold()
        # Stored chunk files' windows and states, by file name and identity (None: unreadable): see _held.
        self._stored_headers: OrderedDict[tuple[str, tuple[int, ...]], _Held | None] = OrderedDict()
        # Complete sets of a chunk's files, by their names and identities, the chunk and the local prefix-cache
        # hit: the chunk boundary from which on they serve a resume (see _serves_from).
        self._serving: OrderedDict[tuple[_Files, int, int], int | None] = OrderedDict()
        # Complete sets of a chunk's files, by their names and identities, that were read and did not join (another
        # producer's scales or pages, which headers do not tell): no lookup reads them again, a save writes over them.
        self._unjoined: dict[_Files, None] = {}
        # Chunk files refused for their states' layout (another engine's), by name and identity: warned once.
        self._layout_refused: dict[tuple[str, tuple[int, ...]], None] = {}
        # Every KV head of the model: a chunk is complete when its files hold them all.
        self._heads = fingerprint.num_kv_heads if fingerprint is not None else 1
        self._state_groups = config.state_groups  # () unless linear-attention layers keep states
        self._state_mode = config.state_mode
        # Asynchronous loads vLLM allocated blocks for, to hand to the workers in this step's metadata; and
        # requests vLLM put to wait for a load that is not (or no longer) planned, which the workers fail.
        self._allocated: list[tuple[_Request, int]] = []
        self._unplanned: list[str] = []
        #: The blocks the synchronous loads of the steps in flight fill, per step (_note_loads), and all of
        #: them with their loading requests.
        self._loading: deque[dict[int, str]] = deque(maxlen=config.steps_in_flight)
        self._loading_blocks: dict[int, set[str]] = {}
        #: The lookup under way refused a file for a passing reason (:meth:`_refuse`): its answer is not replayed.
        self._passing_refusal = False
        # The receiver start_receiver started or shares, by the address it bound (see _RECEIVERS).
        self._listening: tuple[str, int] | None = None

    def start_receiver(self) -> None:
        """Start the ``hurray_listen`` receiver, or share the one another engine of this process started.

        An engine shares a receiver only when it listens on the same address
        (not port 0, which picks a free port for each) with the same
        configuration: store path, keys, TLS, limits and transport. The same
        address with another configuration is refused
        (:class:`~hurray_vllm.errors.HurrayArgumentError` naming
        ``hurray_listen``): that engine's chunks would land, or be checked,
        as the first engine's receiver decides. :meth:`shutdown` stops it
        when no engine of the process uses it any more.
        """
        listen = self._config.listen
        if not listen or self._listening is not None:
            return
        host, port = parse_listen(listen)  # checked by HurrayConfig
        limits = self._config.listen_limits
        setup = (
            os.path.realpath(self._config.path),
            self._config.keys,
            self._config.listen_tls,
            _effective_limits(limits, self._config.listen_transport),
            self._config.listen_transport,
        )
        with _RECEIVERS_LOCK:
            shared = _RECEIVERS.get((host, port)) if port else None
            if shared is not None:
                if shared.setup != setup:
                    raise HurrayArgumentError(
                        "hurray_listen",
                        f"another engine of this process receives on {listen} with another store path, keys, TLS, "
                        "limits or transport: give this engine an address of its own",
                    )
                shared.users += 1
                self._listening = (host, port)
                return
            tls = server_context(self._config.listen_tls) if self._config.listen_tls is not None else None
            options: dict[str, Any] = {"keys": self._config.keys, **limits}
            if tls is not None:
                options["tls"] = tls
            receiver = receiver_for(self._config.listen_transport, host, port, self._store, **options).start()
            bound = (host, int(receiver.address[1]))
            _RECEIVERS[bound] = _Listening(receiver, setup)
            self._listening = bound
        log.info("hurray: receiving chunks on %s into %s", host_port(*bound), self._config.path)

    def shutdown(self) -> None:
        """When vLLM shuts the engine down: stop its receiver unless another engine of the process uses it."""
        with _RECEIVERS_LOCK:
            bound, self._listening = self._listening, None
            if bound is None or (shared := _RECEIVERS.get(bound)) is None:
                return
            shared.users -= 1
            if shared.users > 0:
                return
            del _RECEIVERS[bound]
        shared.receiver.stop()
        log.info("hurray: stopped receiving chunks on %s", host_port(*bound))

    def _refuse(self, part: ChunkPart, why: object, damaged: bool = False) -> None:
        """Count and log a refused chunk file; ``damaged`` moves it aside, else it is remembered as refused.

        A damaged file (unreadable, wrong checksum, tokens other than its key
        promises) would otherwise be refused by every later request with
        that prefix, and no producer would replace it: the key exists. A file
        left in place (another model's, unsigned, a digest this version cannot
        verify, or one whose move failed) goes to :data:`~.metadata.REFUSED`:
        later lookups of this process stop at it after a ``stat``, so it is read,
        counted and warned about once per identity, not at every step vLLM
        asks again for a waiting request. An error that says nothing about the
        file (out of memory, out of descriptors) is not remembered, neither as
        a refusal nor as the answer of the lookup it cut short.
        """
        self.stats.chunks_refused += 1
        kind = refusal_kind(why) if isinstance(why, BaseException) else None
        if kind is not None:  # chunks_unsigned, chunks_other_key, chunks_bad_mac
            setattr(self.stats, f"chunks_{kind}", getattr(self.stats, f"chunks_{kind}") + 1)
        moved = self._store.quarantine(self._ns, part.name, part.identity) if damaged else None
        if moved is not None:
            self.stats.chunks_quarantined += 1
            log.warning("hurray: refusing chunk %s (%s); moved it to %s; recomputing instead", part.name, why, moved)
            return
        if not (isinstance(why, OSError) and why.errno in _PASSING_ERRNOS):
            REFUSED.add(part.name, part.identity, self._scope)
        else:  # nor is this lookup's answer: the request's next ask reads again (get_num_new_matched_tokens)
            self._passing_refusal = True
        log.warning("hurray: refusing chunk %s (%s); recomputing instead", part.name, why)

    def _refused_before(self, parts: list[ChunkPart]) -> bool:
        """Whether a file of this chunk was refused and left in place, unchanged since (:meth:`_refuse`).

        Or its files, read before, did not join (:meth:`_unjoined_set`).
        """
        return any(REFUSED.has(p.name, p.identity, self._scope) for p in parts) or self._unjoined_set(parts)

    def _unjoined_set(self, parts: list[ChunkPart]) -> bool:
        """Whether these files of a chunk were read and found not to join, unchanged since (:meth:`_passed`)."""
        return bool(self._unjoined) and _files(parts) in self._unjoined

    @staticmethod
    def _seed(state: _Request) -> str | None:
        """The request's key seed, now: None for good once it holds media (a streaming session may add some)."""
        if state.seed is not None and _not_keyable(state.request):
            state.seed = None
        return state.seed

    def seed_of(self, request: Any) -> str | None:
        """The seed this connector keys ``request``'s chunks by, without recording the request.

        A request it knows: its seed as :meth:`_seed` says (None once it holds
        media, or when a cache reset came after its KV); one it has not seen
        yet: the seed :meth:`_state` would give it now (the current epoch's).
        Read by ``snapshot()``, so that its chunks land where this connector's do.
        """
        state = self._reqs.get(request.request_id)
        if state is None:
            return request_seed(self._ns, request, self._epoch)
        return None if _not_keyable(request) else state.seed

    def _state(self, request: Any) -> _Request:
        """The request's state, made on first sight (vLLM asks for every new request's matched tokens)."""
        state = self._reqs.get(request.request_id)
        if state is None:
            seed = request_seed(self._ns, request, self._epoch)
            state = self._reqs[request.request_id] = _Request(request, seed=seed)
        return state

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Called by vLLM's scheduler, via the connector, when it schedules a request: stored tokens to load.

        Verifies the stored chunks past ``num_computed_tokens`` and plans their load; returns
        ``(tokens, False)`` (loaded in the step that schedules the request), ``(tokens, True)`` where
        loads are asynchronous (``config.async_loads``), ``(0, False)`` when nothing can be loaded.

        vLLM asks again at each step while it cannot allocate the request's blocks (a full KV cache):
        while the request starts at the same token and the store holds the same files (``stat`` only),
        the load planned last is offered again without reading or checking any file; so is an answer of
        nothing. Not an answer a passing error cut short (a read out of memory or descriptors): the next ask
        reads again. A chunk file refused and left in place (:meth:`_refuse`) stops any later lookup of this
        process after a ``stat``. A chunk whose set of files this lookup refuses is looked up once more: another
        TP degree's set of it (a whole file and slices both stored) may be fine.
        """
        state = self._state(request)  # also for a producer alone: its saves follow the request
        seed = self._seed(state)
        if not self._loads or state.load_failed or seed is None:
            return 0, False  # a worker could not load it (recompute rather than fail again), or it has no chunks
        if getattr(request, "skip_reading_prefix_cache", False):
            # Prompt logprobs (or a caller's wish): vLLM computes every prompt token and discards what we
            # offer, so reading and checking the chunks would be wasted. Its KV is still saved.
            return 0, False
        tokens = list(request.all_token_ids)
        usable = (len(tokens) - 1) // self._chunk * self._chunk
        keys = chunk_keys(tokens[:usable], self._chunk, seed)
        first = num_computed_tokens // self._chunk
        if self._awaits_push(state, tokens, keys, num_computed_tokens):
            return None, False  # vLLM asks again at its next step
        stored = self._stored_sets(keys, first, num_computed_tokens)
        files = (num_computed_tokens, tuple(f for parts in stored for f in _files(parts)))
        last = state.lookup
        # The last answer again, the load it planned with it; also an answer of nothing (refused chunks, or a
        # resume that fits no window or states), so that no file is read, checked and logged again each step.
        if last is not None and (state.load is not None or not last.matched) and last.files == files:
            probed = self._probe_tail(tokens, keys, last.hit, num_computed_tokens, seed)
            if _tail_files(probed) == last.tail:
                return (last.matched, state.load.report) if state.load is not None else (0, False)
        state.load = state.lookup = None
        self._passing_refusal = False
        hit, verified, verified_snaps = self._verify_chunks(stored, tokens, first)
        retried: set[int] = set()
        while hit < first + len(stored) and hit not in retried:
            # Chunk `hit`'s set was refused: moved aside or remembered as refused, it no longer hides another TP
            # degree's set of the chunk (a whole file and slices both stored), which is looked at once more.
            retried.add(hit)
            again = self._stored_sets(keys, hit, num_computed_tokens)
            if not again or _files(again[0]) == _files(stored[hit - first]):
                break  # no other set, or the same one (a passing error: not remembered)
            stored = [*stored[: hit - first], *again]
            hit, more, more_snaps = self._verify_chunks(again, tokens, hit)
            verified += more
            verified_snaps += more_snaps
        if retried:  # what the next ask finds (the refused sets hidden), so that it may replay this answer
            files = (num_computed_tokens, tuple(f for parts in stored for f in _files(parts)))
        # The slices of a chunk share windows and structure: the first of each speaks for them.
        while hit > first and not self._resumes_at(
            [v[0] for v in verified_snaps[: hit - first]], first, hit, num_computed_tokens, verified[hit - first - 1]
        ):
            # A sliding-window layer of some chunk lacks tokens a resume at hit * chunk attends, or (linear
            # attention) the last chunk holds no states taken there: load less.
            hit -= 1
            verified.pop()
            verified_snaps.pop()
        chunk_tokens = [tokens[i * self._chunk : (i + 1) * self._chunk] for i in range(first, hit)]
        load_keys = keys[first:hit]
        # A tail may follow the last chunk found even where the prompt goes on past it (a consumer's prompt
        # extending the producer's, whose tail was saved).
        probed = self._probe_tail(tokens, keys, hit, num_computed_tokens, seed)
        tail = self._read_tail(*probed) if probed is not None else None
        if tail is not None:
            tail_key, tail_tokens, tail_parts, tail_snaps = tail
            load_keys.append(tail_key)
            chunk_tokens.append(tail_tokens)
            verified.append(tail_parts)
            verified_snaps.append(tail_snaps)
        end = hit * self._chunk + (len(tail[1]) if tail is not None else 0)
        matched = end - num_computed_tokens
        # An answer cut short by a passing error (out of memory or descriptors) is not replayed: the same files may
        # give more at the request's next ask.
        replay = not self._passing_refusal
        if matched <= 0 or num_computed_tokens % self._block_size:
            if replay:
                state.lookup = _Lookup(files, hit, _tail_files(probed), 0)  # the same files give nothing next time
            return 0, False
        # A local prefix-cache hit may end inside chunk `first`: its leading blocks are the engine's
        # (possibly shared with other requests) and are skipped; the rest of the chunk is loaded.
        skip = (num_computed_tokens - first * self._chunk) // self._block_size
        report = self._config.async_loads
        state.load = LoadTask(
            request.request_id,
            load_keys,
            chunk_tokens,
            [],
            verified,
            skip_blocks=skip,
            tail=tail is not None,
            report=report,
            snaps=verified_snaps if self._config.worker_in_process else [],
        )
        state.load_from = num_computed_tokens
        state.lookup = _Lookup(files, hit, _tail_files(probed), matched) if replay else None
        return matched, report

    def _stored_sets(self, keys: list[str], start: int, computed: int) -> list[list[ChunkPart]]:
        """The sets of files a lookup reads for chunks ``start, start + 1, ...``, up to the first not stored.

        One per chunk (:meth:`_load_set`); with linear-attention states, up to the furthest chunk a set carries
        them for, that chunk's set carrying them (none with no such set).
        """
        stored: list[list[ChunkPart]] = []
        for i in range(start, len(keys)):
            parts = self._load_set(keys[i], i, computed)
            if parts is None:  # not stored, or a tensor-parallel slice still missing
                break
            stored.append(parts)
        if self._state_groups and stored:
            # A resume needs the states taken at its chunk's end: the furthest chunk with a complete set of
            # files that carries them (another TP degree's, perhaps) is where the request resumes. Chunks
            # after it are not read (a resume there has no states), and one before the last found is not
            # missed because its first set lacks them. With none, no chunk is read: nothing could load.
            for j in range(len(stored) - 1, -1, -1):
                with_states = self._states_set(keys[start + j])
                if with_states is not None:
                    return [*stored[:j], with_states]
            return []
        return stored

    def _verify_chunks(
        self, stored: list[list[ChunkPart]], tokens: list[int], first: int
    ) -> tuple[int, list[list[tuple[str, int, int, tuple[int, ...]]]], list[list[KVSnapshot]]]:
        """Read and check the stored chunks ``first, first + 1, ...`` in order, up to the first that fails.

        Returns where the chunks that passed end (a chunk index), and per chunk its files (``LoadTask.parts``)
        and snapshots. Each file is read on a helper thread while the one before is parsed here, and each
        chunk's data checks run while the next chunk is parsed; a chunk's checks are waited for before the
        chunk after the next is read, so a bad chunk costs at most the next two chunks' reads, not all after it.
        """
        for n, parts in enumerate(stored):
            if self._refused_before(parts):  # refused and left in place: stop there, no file read (or logged) again
                stored = stored[:n]
                break
        unread = [p.name for parts in stored for p in parts if VERIFIED.get(p.name, p.identity, self._scope) is None]
        reader = (
            self._store.reader(self._ns, unread, _helper("read").submit, page_crcs=self._page_crcs) if unread else None
        )
        verified: list[list[tuple[str, int, int, tuple[int, ...]]]] = []
        verified_snaps: list[list[KVSnapshot]] = []
        pending: tuple[list[ChunkPart], list[KVSnapshot], list[Future[None] | None]] | None = None
        for i, parts in enumerate(stored, first):
            read = self._read_parts(parts, tokens[i * self._chunk : (i + 1) * self._chunk], reader)
            if pending is not None:  # the chunk before: its checks ran while this one was parsed
                if not self._passed(*pending):
                    return first + len(verified), verified, verified_snaps
                verified.append(_task_parts(pending[0]))
                verified_snaps.append(pending[1])
            if read is None:
                return first + len(verified), verified, verified_snaps
            pending = (parts, *read)
        if pending is not None and self._passed(*pending):
            verified.append(_task_parts(pending[0]))
            verified_snaps.append(pending[1])
        return first + len(verified), verified, verified_snaps

    def _probe_tail(
        self, tokens: list[int], keys: list[str], hit: int, computed: int, seed: str
    ) -> tuple[str, list[int], list[ChunkPart]] | None:
        """The longest stored tail after whole chunk ``hit - 1`` (its key, tokens and files); ``None`` if there is none.

        A producer stores a prompt's tail (its whole blocks after its last whole
        chunk, ``hurray_tails``) when the prompt's prefill ends. Its length is
        the producer's, unknown here: every whole number of this engine's
        blocks that leaves the last token to compute, and reaches past the
        local prefix-cache hit, is tried, longest first (a hash and a ``stat``
        each, at most ``chunk / block - 1`` of them; one pass hashes them all).
        Whether chunk ``hit`` is stored or not: a consumer's prompt may run on
        past the producer's. Nothing is read. A tail holds neither states nor
        windows: a linear-attention hybrid (whose states a resume needs at its
        exact token) never loads one (``HurrayConfig`` turns tails off for it).
        """
        if not self._config.tails or self._state_groups:
            return None
        start = hit * self._chunk
        room = min(len(tokens) - 1 - start, self._chunk - self._block_size)
        if room < self._block_size:
            return None
        rest = tokens[start : start + room // self._block_size * self._block_size]
        for n, key in reversed(tail_keys(keys[hit - 1] if hit else None, rest, self._block_size, seed)):
            if start + n <= computed:
                break  # the engine holds these tokens itself
            parts = self._store.parts(self._ns, key, self._heads)
            if parts is not None:
                return key, rest[:n], parts
        return None

    def _read_tail(
        self, key: str, tokens: list[int], parts: list[ChunkPart]
    ) -> tuple[str, list[int], list[tuple[str, int, int, tuple[int, ...]]], list[KVSnapshot]] | None:
        """The tail :meth:`_probe_tail` found, read and verified; ``None`` if it fails (refused like a chunk).

        No shorter tail is tried then.
        """
        if self._refused_before(parts):
            return None
        read = self._read_parts(parts, tokens)
        if read is None or not self._passed(parts, *read):
            return None
        return key, tokens, _task_parts(parts), read[0]

    def _awaits_push(self, state: _Request, tokens: list[int], keys: list[str], computed: int) -> bool:
        """Whether to hold a request back a step: chunks its ``kv_transfer_params`` announce are still arriving.

        A source engine's answer carries ``{"hurray_saved_tokens": N}``: its
        chunks up to token N are saved, and pushed to this engine's receiver
        in the background; and ``"hurray_tail_tokens": T`` when it also saved
        its prompt's tail, up to token T (``hurray_tails``). A client that
        passes those ``kv_transfer_params`` on with the continuation
        (:func:`~hurray_vllm.adapters.vllm.migrate.migrate`, the router,
        vLLM's P/D proxies) makes this engine wait for them instead of
        recomputing what is still on the wire. The wait ends when every
        announced chunk is stored, or when none arrived for
        ``hurray_push_wait_s`` (a failed push, a dead source): then the
        request loads what came and recomputes the rest. Costs one ``stat``
        per announced chunk per step while waiting.

        No wait with ``hurray_push_wait_s`` 0, nor after a cache reset
        (:meth:`reset_cache`): this engine's keys then carry its own epoch,
        and no source pushes chunks under them.
        """
        params = getattr(state.request, "kv_transfer_params", None)
        if state.waited or self._config.push_wait_s <= 0 or self._epoch is not None or not isinstance(params, dict):
            return False
        first = computed // self._chunk
        announced, tail_end = _count(params.get("hurray_saved_tokens")), _count(params.get("hurray_tail_tokens"))
        awaited = keys[first : min(announced // self._chunk, len(keys))]
        assert state.seed is not None  # the caller returned already for a request without chunks
        tail = self._announced_tail(tokens, keys, tail_end, state.seed) if computed < tail_end else None
        if tail is not None and first + len(awaited) == tail_end // self._chunk:
            awaited.append(tail)  # right after the whole chunks before it (the source pushes it last)
        want = len(awaited)
        have = 0
        while have < want and self._store.parts(self._ns, awaited[have], self._heads) is not None:
            have += 1
        now = time.monotonic()
        if have >= want:
            state.waited = True
            return False
        if have > state.arrived:  # the first look, or more arrived: the wait goes on
            if state.arrived < 0:
                self.stats.push_waits += 1
            state.arrived, state.arrived_at = have, now
            return True
        if now - state.arrived_at < self._config.push_wait_s:
            return True
        state.waited = True
        self.stats.push_wait_timeouts += 1
        log.warning(
            "hurray: request %s: %d of %d announced chunks arrived, none for %.1f s (hurray_push_wait_s); "
            "recomputing the rest",
            state.request.request_id,
            have,
            want,
            self._config.push_wait_s,
        )
        return False

    def _announced_tail(self, tokens: list[int], keys: list[str], end: int, seed: str) -> str | None:
        """The key of the tail a source announced (``hurray_tail_tokens``), if this engine can load it."""
        start = end // self._chunk * self._chunk
        n = end - start
        if not self._config.tails or n <= 0 or n % self._block_size or end > len(tokens) - 1:
            return None
        if start // self._chunk > len(keys):
            return None
        prev = keys[start // self._chunk - 1] if start else None
        return tail_keys(prev, tokens[start:end], n, seed)[0][1]

    def _read_parts(
        self, parts: list[ChunkPart], tokens: list[int], reader: ChunkReader | None = None
    ) -> tuple[list[KVSnapshot], list[Future[None] | None]] | None:
        """Every file of one chunk read and checked against its tokens, with their data checks under way.

        ``None`` after refusing the first that fails: another model's chunk is
        left alone, anything else in it is damage (moved aside). A file gone
        since the lookup's ``stat`` (a prune) is a miss, not refused. Any other
        exception is refused too (logged with its traceback, never moved aside):
        this runs in vLLM's scheduling loop, where it would stop the engine,
        and again at every request with the file's prefix.
        """
        read: list[KVSnapshot] = []
        checks: list[Future[None] | None] = []
        for part in parts:
            try:
                snap, check = self._read_part(part, tokens, reader)
            except HurrayFormatError as exc:
                if exc.field == MISSING:
                    # Deleted since the lookup's stat (a prune): a miss, no refusal; the lookup stops here.
                    log.debug("hurray: chunk %s is gone since it was looked up (%s)", part.name, exc)
                    return None
                self._refuse(part, exc, is_damage(exc))
                return None
            except OSError as exc:
                self._refuse(part, exc)
                return None
            except Exception as exc:  # a file the checks missed, or a bug: this chunk is lost, not the engine
                log.error("hurray: unexpected error checking chunk %s", part.name, exc_info=exc)
                self._refuse(part, f"unexpected {type(exc).__name__}: {exc}")
                return None
            read.append(snap)
            checks.append(check)
        return read, checks

    def _passed(self, parts: list[ChunkPart], snaps: list[KVSnapshot], checks: list[Future[None] | None]) -> bool:
        """Whether one chunk's files passed their data checks and fit together; then they are remembered.

        Files that do not fit together (slices of two producers: other fp8 scales or pages, which their headers do
        not tell) are remembered as such: no lookup reads them again, and the next save of the chunk writes over
        them (:meth:`_stored_for_save`).
        """
        if self._failed_check(parts, checks):
            return False
        if not _fit_together(snaps):
            if len(self._unjoined) >= _UNJOINED_CAP:
                self._unjoined.pop(next(iter(self._unjoined)))
            self._unjoined[_files(parts)] = None
            return False
        for part, snap in zip(parts, snaps, strict=True):
            VERIFIED.put(part.name, part.identity, snap, self._verified_cap, self._verified_bytes, self._scope)
        return True

    def _read_part(
        self, part: ChunkPart, tokens: list[int], reader: ChunkReader | None = None
    ) -> tuple[KVSnapshot, Future[None] | None]:
        """One file of a chunk, checked against its key's tokens; its data check runs on the helper thread.

        The data check (:func:`~hurray_vllm.chunks.verify.check_data`) is the
        checksum, or with ``hurray_key_file`` the MAC, which covers the same
        bytes and the file's name.

        A file remembered as verified (same identity) is not read again, but
        for one byte at most hourly (:class:`~hurray_vllm.chunks.store.ChunkUses`):
        prune ranks chunks by their files' access times.
        ``reader``: the load's files, read ahead (else the store reads it now).

        Raises:
            HurrayFormatError: the file is unreadable, of another model, for other tokens, or holds
                other heads than its name says; gone since the lookup's ``stat`` (field ``store``).
        """
        snap = VERIFIED.get(part.name, part.identity, self._scope)
        check: Future[None] | None = None
        if snap is not None:
            self.stats.chunks_remembered += 1
            self._uses.used(part.name)
        else:
            if reader is not None:
                read = reader.read(part.name)
            else:
                read = self._store.read(self._ns, part.name, page_crcs=self._page_crcs)
            self._uses.used(part.name, read=True)
            snap = load_chunk(read)
            check = self._check_later(snap, part.name, read)
        # Also for a remembered chunk: its key promises these tokens, the check costs little.
        verify_chunk(snap, self._fingerprint, tokens, digest=False, heads=part.heads)
        return snap, check

    def _check_later(self, snap: KVSnapshot, name: str, read: FileBytes) -> Future[None]:
        """The chunk's data check: its header half now, its pools' half (native, GIL-free) on the helper thread.

        Only native code runs on the helper: with Python on both threads they
        handed the GIL back and forth at every small step, and in the engine's
        busy process that made each check cost several times its own work.
        ``read``: the file's bytes, checksummed page by page as they were read
        (the pools' half then combines those instead of reading them again).
        """
        try:
            rest = begin_check_data(snap, self._config.keys, self._ns, name, read)
        except HurrayFormatError as exc:  # no, an old or a foreign digest or MAC: judged with the data errors
            done: Future[None] = Future()
            done.set_exception(exc)
            return done
        return _helper("digest").submit(rest)

    def _failed_check(self, parts: list[ChunkPart], checks: list[Future[None] | None]) -> bool:
        """Wait for the parts' data checks; refuse the first that fails (moved aside if damaged). True if one did."""
        for part, check in zip(parts, checks, strict=True):
            if check is None:
                continue
            try:
                check.result()
            except HurrayFormatError as exc:
                # A missing or old digest is refused, not moved: a newer writer's file may be fine.
                self._refuse(part, exc, is_damage(exc) and not digest_unverifiable(exc))
                return True
            except OSError as exc:
                self._refuse(part, exc)
                return True
            except Exception as exc:  # as in _read_parts: this chunk is lost, not the engine
                log.error("hurray: unexpected error checking chunk %s", part.name, exc_info=exc)
                self._refuse(part, f"unexpected {type(exc).__name__}: {exc}")
                return True
        return False

    def _resumes_at(
        self,
        chunks: list[KVSnapshot],
        first: int,
        hit: int,
        computed: int = 0,
        last: list[tuple[str, int, int, tuple[int, ...]]] | None = None,
    ) -> bool:
        """Whether chunks ``first .. hit - 1`` let a request resume at token ``hit * chunk``.

        ``computed``: the engine's own prefix-cache hit, from which the load writes. ``last``: chunk
        ``hit - 1``'s files (``LoadTask.parts``): states of another layout in them are warned about and
        counted in ``chunks_refused`` once per file (identity), not at every lookup that meets them again.
        """
        resume = hit * self._chunk
        if any(c.windows is not None and _slides(c.windows) != self._window_counts for c in chunks):
            return False  # windows of another engine's attention: the worker would refuse every layer of it
        if not _windows_held(chunks, first, resume, self._chunk, self._block_size, computed):
            return False
        if not self._state_groups:
            return True
        states = chunks[-1].states
        if states is None or tuple(states.positions) != (resume,):
            return False
        why = self._config.state_layout.mismatches(states) if self._config.state_layout is not None else []
        if why:
            # Another engine's states (layout, dtype): not damage, and no chunk before this one resumes here.
            seen = (last[0][0], last[0][3]) if last else None
            if seen is None or seen not in self._layout_refused:
                if seen is not None:
                    if len(self._layout_refused) >= _LAYOUT_REFUSED_CAP:
                        self._layout_refused.pop(next(iter(self._layout_refused)))
                    self._layout_refused[seen] = None
                self.stats.chunks_refused += 1
                log.warning(
                    "hurray: not loading the states of chunk %s at %d: %s; recomputing instead",
                    seen[0] if seen is not None else "?",
                    resume,
                    why,
                )
        return not why

    def _load_set(self, key: str, c: int, computed: int) -> list[ChunkPart] | None:
        """The complete set of chunk ``c``'s files (``key``) a lookup reads; ``None`` if none is stored.

        The first set (the whole file first) not refused before: one left in
        place (unreadable, another fleet's) or whose files did not join hides
        no other TP degree's set. Nor does one the lookup under way refuses
        (moved aside or remembered): :meth:`get_num_new_matched_tokens` asks
        for that chunk's set again, once. With sliding windows, of the sets whose
        headers agree (slices that join) and whose windows are this engine's,
        the one that serves the earliest resume (:meth:`_serves_from`):
        engines of two TP degrees, or a save that ran past the chunk's end,
        may have stored one copy holding less of the window, which must not
        hide one holding it. With none suiting, the first (its reader refuses
        it). A ``stat`` per file of the first set, and what its headers serve
        remembered: the other sets are looked at (a ``stat`` per file) only
        when it does not serve a resume at the chunk's end.
        """
        sets = self._store.complete_sets(self._ns, key, self._heads)
        first = next(sets, None)
        if first is None:
            return None
        if not self._refused_before(first) and (not self._sliding or self._serves_from(first, c, computed) == c + 1):
            return first
        unrefused: list[ChunkPart] | None = None
        best: tuple[int, list[ChunkPart]] | None = None
        for parts in itertools.chain([first], sets):
            if self._refused_before(parts):
                continue
            if not self._sliding:
                return parts
            unrefused = unrefused or parts
            at = self._serves_from(parts, c, computed)
            if at is not None and (best is None or at < best[0]):
                best = (at, parts)
        return best[1] if best is not None else unrefused or first

    def _serves_from(self, parts: list[ChunkPart], c: int, computed: int) -> int | None:
        """:meth:`_earliest_resume` of chunk ``c`` stored as ``parts``, by their headers; None if it serves none.

        None for files that do not join (two saves' slices), or whose windows
        are not this engine's (:meth:`_resumes_at`): no load of them would
        pass. An unreadable header says nothing (:func:`_headers_agree`): the
        set is judged by the others, and one with none readable serves
        ``c + 1``: its reader judges it (and moves a damaged file aside).
        Remembered by the files' names and identities, ``c`` and
        ``computed`` (vLLM asks again for a waiting request at every step),
        once every header was read.
        """
        memo = (_files(parts), c, computed)
        if memo in self._serving:
            self._serving.move_to_end(memo)
            return self._serving[memo]
        held = [self._held(p) for p in parts]
        known = [h for h in held if h is not None]
        if not known:
            return c + 1
        win = known[0].windows
        if not _headers_agree(held) or (win is not None and _slides(win) != self._window_counts):
            at = None
        else:
            at = self._earliest_resume(win, c, computed)
        if len(known) == len(held):
            if len(self._serving) >= _STORED_HEADERS_CAP:
                self._serving.popitem(last=False)
            self._serving[memo] = at
        return at

    def _earliest_resume(self, windows: SlidingWindows | None, c: int, computed: int) -> int:
        """The first chunk boundary (a chunk index) from which on a resume finds chunk ``c``'s ``windows`` held.

        ``c + 1`` for a copy holding the window a resume at its own end
        attends; later for one holding less: a resume further on attends less
        of the chunk, and every resume from a held one on is held too
        (:func:`_windows_held`). ``computed``: the engine's own prefix-cache hit.
        """
        longest = max((w for w in windows.sizes if w is not None), default=0) if windows is not None else 0
        last = c + 1 + -(-longest // self._chunk)  # from there on the windows start past chunk c: nothing of it
        held = [_Held(windows, None)]
        for at in range(c + 1, last):
            if _windows_held(held, c, at * self._chunk, self._chunk, self._block_size, computed):
                return at
        return last

    def _held(self, part: ChunkPart) -> _Held | None:
        """What a stored file's header says it holds (:class:`_Held`); ``None`` if unreadable. Read once per identity.

        vLLM asks again for a waiting request at every step, and a save looks
        at each chunk it completes: the headers are not read again each time
        (the least recently used are forgotten first). An unreadable file
        stays so until its identity changes; an error that says nothing about
        the file (the process ran short of memory or descriptors) is not
        remembered: the next look reads the header again.
        """
        memo = (part.name, part.identity)
        if memo in self._stored_headers:
            self._stored_headers.move_to_end(memo)
            return self._stored_headers[memo]
        try:
            header = read_header(self._store.path(self._ns, part.name))
        except OSError as exc:
            if exc.errno in _PASSING_ERRNOS:
                return None
            header = None
        except HurrayFormatError:
            header = None
        found = _Held(header.windows, header.states) if header is not None else None
        if len(self._stored_headers) >= _STORED_HEADERS_CAP:
            self._stored_headers.popitem(last=False)
        self._stored_headers[memo] = found
        return found

    def _states_set(self, key: str) -> list[ChunkPart] | None:
        """The first complete set of chunk ``key``'s files that carries states, or None if no set does.

        Not one refused before (:meth:`_refused_before`), nor slices whose
        headers do not join (:func:`_headers_agree`): each would hide a set
        another TP degree stored with states. Each file's header is read
        once per identity (:meth:`_held`): vLLM asks again for a waiting
        request at every step, and the chunks of a prefix stored without
        states would otherwise be read backwards each time.
        """
        for parts in self._store.complete_sets(self._ns, key, self._heads):
            if self._refused_before(parts):
                continue
            held = [self._held(p) for p in parts]
            if all(h is not None and h.states is not None for h in held) and _headers_agree(held):
                return parts
        return None

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Called by vLLM's scheduler, via the connector, after block allocation: drops the load if none was granted.

        An asynchronous load (``config.async_loads``) takes its blocks from
        here: its request is not scheduled in this step, so it is not among
        the step's new requests.
        """
        state = self._reqs.get(request.request_id)
        if state is not None:
            state.lookup = None  # vLLM took the answer: a later lookup (a preemption) looks again
        if num_external_tokens == 0:
            if state is not None:
                state.load = None
            return
        if state is None or state.load is None or not state.load.report:
            if self._config.async_loads:
                # vLLM waits for this request's load and nothing would report it: fail it, to be recomputed.
                log.error("hurray: request %s waits for a load this connector did not plan", request.request_id)
                self._unplanned.append(request.request_id)
            return
        ids = blocks.get_block_ids()
        state.block_ids = list(ids[0])
        state.groups = [list(g) for g in ids] if self._windows else []
        self._allocated.append((state, state.load_from + num_external_tokens))

    def update_connector_output(self, failed_recving: set[str]) -> None:
        """Called by vLLM's scheduler, via the connector, after each step: asynchronous loads that failed.

        vLLM recomputes those requests from scratch and asks for their
        matched tokens again; they are offered none.
        """
        for req_id in failed_recving:
            state = self._reqs.get(req_id)
            if state is not None:
                state.load_failed = True
                state.load = state.lookup = None
                state.chunks_done = 0  # what it recomputes is saved again where the store lacks it
                state.loaded = range(0)
                self.stats.loads_failed += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HurrayConnectorMetadata:
        """Called by vLLM's scheduler, via the connector, once per step: the loads and saves the worker performs."""
        meta = HurrayConnectorMetadata()
        allocated, self._allocated = self._allocated, []
        for waiting, computed in allocated:
            if waiting.load is not None and self._reqs.get(waiting.request.request_id) is waiting:
                self._attach_load(meta, waiting, computed, 0)  # loaded in this step, scheduled in a later one
            else:
                self._unplanned.append(waiting.request.request_id)
        # An empty reported load is failed by every worker: vLLM then stops waiting for it and recomputes.
        meta.loads += [LoadTask(req_id, [], [], [], report=True) for req_id in self._unplanned]
        self._unplanned = []
        # Saves are planned once every load of the step is known (_note_loads): (request, its state, the tokens
        # computed after the step, where vLLM freed its out-of-window blocks).
        due: list[tuple[str, _Request, int, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.load_failed = False  # scheduled again (recomputing): a later lookup (a preemption) may load
            state.lookup = None
            state.block_ids = list(new.block_ids[0])
            state.prev_end = 0
            if self._windows:
                state.groups = [list(g) for g in new.block_ids]
            start = new.num_computed_tokens
            if state.load is not None:
                self._attach_load(meta, state, start, scheduler_output.num_scheduled_tokens[new.req_id])
            due.append((new.req_id, state, start + scheduler_output.num_scheduled_tokens[new.req_id], start))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    state.block_ids = list(new_ids[0])
                    state.prev_end = 0
                    state.groups = [list(g) for g in new_ids] if self._windows else []
                else:
                    state.block_ids.extend(new_ids[0])
                    for mine, more in zip(state.groups, new_ids, strict=False):
                        mine.extend(more)
            computed = cached.num_computed_tokens[i]
            if state.load is not None:
                # A preempted request resumed with a load planned when it was rescheduled.
                self._attach_load(meta, state, computed, scheduler_output.num_scheduled_tokens[req_id])
            elif computed < state.chunks_done * self._chunk and req_id not in cached.resumed_req_ids:
                # A running request went back: vLLM recomputes the blocks a synchronous load failed to write
                # (kv_load_failure_policy "recompute"). Those chunks are saved again as they are recomputed,
                # and request_finished does not announce what the store may lack.
                state.chunks_done = computed // self._chunk
                if state.tail_end > computed:  # the prompt's tail too: planned again when the prefill ends again
                    state.tail_planned, state.tail_end = False, 0
            done = computed + scheduler_output.num_scheduled_tokens[req_id]
            # vLLM freed this step's out-of-window blocks on the tokens its finished steps computed (this
            # method runs before it counts the step's own tokens in flight).
            freed_at = computed - getattr(state.request, "num_in_flight_tokens", 0)
            due.append((req_id, state, done, freed_at))
        self._note_loads(meta)
        for req_id, state, done, freed_at in due:
            self._plan_saves(meta, req_id, state, done, freed_at=freed_at)
        return meta

    def _note_loads(self, meta: HurrayConnectorMetadata) -> None:
        """Remember the blocks this step's synchronous loads fill, for the steps a failure of one spoils.

        A synchronous load that fails on a worker leaves its blocks unwritten, and every step vLLM scheduled
        before it learned of it (this one, and the next with asynchronous scheduling) computes on them: the
        worker stores no chunk of those steps that reads them. It knows a chunk's own blocks, not the blocks
        before them that the chunk's attention read too (a prefix-cache hit on the loading request's blocks,
        by a request scheduled in the same step or the next): :meth:`_plan_saves` names those blocks in the
        chunk's task (``SaveTask.reads``, :meth:`_reads_loading`).
        """
        loads = [task for task in meta.loads if not task.report and task.block_ids]
        self._loading.append({b: task.request_id for task in loads for b in task.block_ids})
        self._loading_blocks = {}
        for step in self._loading:
            for b, req_id in step.items():
                self._loading_blocks.setdefault(b, set()).add(req_id)

    def _reads_loading(self, req_id: str, state: _Request) -> list[tuple[int, int]]:
        """``(index, block)`` of the request's blocks that another request's synchronous load in flight fills.

        A prefix-cache hit on the loading request's blocks: every chunk after
        such a block attended to it. A request's own loads are left out: the
        worker drops every save of a request whose load failed.
        """
        return [
            (i, b)
            for i, b in enumerate(state.block_ids)
            if (owners := self._loading_blocks.get(b)) is not None and owners != {req_id}
        ]

    def _attach_load(self, meta: HurrayConnectorMetadata, state: _Request, computed: int, scheduled: int) -> None:
        """Hand the planned load to the worker, with the engine blocks it fills."""
        load = state.load
        assert load is not None
        # The scheduler already counts the loaded tokens as computed.
        nblocks = load.num_tokens(self._chunk) // self._block_size - load.skip_blocks
        first = computed // self._block_size - nblocks
        load.block_ids = state.block_ids[first : first + nblocks]
        load.groups = [g[first : first + nblocks] for g in state.groups]
        if self._state_groups:
            # The state block at the resume, and the step's own: the engine copies the first into the
            # second before the forward pass, ahead of this load (see adapters.vllm.states).
            load.resume = computed
            for g in self._state_groups:
                ids = state.groups[g]
                found = (
                    state_block(ids, computed, self._block_size, self._state_mode),
                    step_block(ids, computed, scheduled, self._block_size, self._state_mode),
                )
                load.state_blocks[g] = [b for b in dict.fromkeys(found) if b]
        meta.loads.append(load)
        # The chunks before the load (a local prefix-cache hit) were in the store when this engine computed or
        # loaded them, if it saves; but one may be gone since (pruned), have failed to save, or have been
        # completed by a request's last step (never saved): request_finished would announce it, and a
        # destination wait for it in vain. Those from the first not stored on are saved from the engine's
        # blocks instead (_plan_saves), the loaded ones are not (stored; an asynchronous load may still be
        # writing their blocks). An engine that does not save announces only a load from the prompt's start.
        start = state.load_from // self._chunk
        end = computed // self._chunk
        if not self._saves:
            state.chunks_done = end if state.load_from < self._chunk else 0
        else:
            state.chunks_done = self._stored_prefix(state, start, end)
            state.loaded = range(start, end) if state.chunks_done < start else range(0)
        state.load = state.lookup = None
        if self._url and self._saves:
            self._plan_forwards(meta, load)

    def _stored_prefix(self, state: _Request, chunks: int, end: int) -> int:
        """How many of the request's first ``chunks`` whole chunks are stored, up to the first missing; else ``end``.

        A ``stat`` per chunk (a complete set of files, :meth:`_stored`).
        """
        seed = self._seed(state)
        if not chunks or seed is None:
            return end
        tokens = list(state.request.all_token_ids)[: chunks * self._chunk]
        for c, key in enumerate(chunk_keys(tokens, self._chunk, seed)):
            if not self._stored(key):
                return c
        return end

    @staticmethod
    def _plan_forwards(meta: HurrayConnectorMetadata, load: LoadTask) -> None:
        """With a destination, push on the whole chunks ``load`` found here (loaded, not computed here).

        A request moved from A to this engine loaded what A pushed; when it
        moves on to the destination, that one must find them too, or it waits
        ``hurray_push_wait_s`` for them and recomputes (a chain of moves:
        A -> B -> C). The worker pushes the stored files (never the engine's
        blocks, which an asynchronous load may still be filling), only those
        the destination does not hold (it asks first: A <-> B pushing to each
        other sends nothing back), and not those it pushed before. The chunks
        before the load (a local prefix-cache hit) went when this engine
        computed or loaded them.
        """
        whole = load.keys[: len(load.keys) - load.tail]  # a prompt's tail is no later request's
        meta.saves += [SaveTask(load.request_id, key, [], [], forward=True) for key in whole]

    def _plan_saves(
        self, meta: HurrayConnectorMetadata, req_id: str, state: _Request, computed: int, freed_at: int = 0
    ) -> None:
        """Plan saves of the chunks ``computed`` tokens complete (those after this step's forward pass).

        With speculative decoding a step also computes draft tokens, which
        the request's token ids do not hold yet and which may be rejected:
        only the tokens the request holds count, so a chunk is saved once its
        every token is final (draft KV at a rejected position is overwritten
        later; an accepted draft's is the token's own). With asynchronous
        scheduling the token ids trail ``computed`` by a token the same way.
        A chunk that only the request's last step completes is then not saved
        (no later step plans it): a consumer recomputes at most that chunk.

        ``freed_at``: the tokens vLLM freed this step's sliding-window blocks
        for (``computed - window + 1`` of them, whole blocks). A chunk planned
        in a step that starts past its end (a speculative step accepted
        drafts beyond it) may have lost more blocks than its own end frees:
        vLLM may already have given them to another request, so they are
        blanked too, and the chunk holds less of its window.
        """
        step_end, computed = computed, min(computed, len(state.request.all_token_ids))
        prev_end, state.prev_end = state.prev_end, step_end
        full = computed // self._chunk
        # The step that ends the prompt's prefill also saves its tail (once), after its whole chunks.
        tail = self._config.tails and not state.tail_planned and computed >= state.request.num_prompt_tokens
        if not self._saves or (full <= state.chunks_done and not tail):
            return
        per = self._chunk // self._block_size
        # Blocks this request holds that another request's synchronous load in flight fills: every chunk after
        # one read it (SaveTask.reads), and a failure of that load spoils the chunk as well.
        loading = self._reads_loading(req_id, state) if self._loading_blocks else []
        seed = self._seed(state)  # looked at only when a chunk or the tail is due, not every decode step
        if seed is None:
            return
        tokens = list(state.request.all_token_ids)
        keys = chunk_keys(tokens[: full * self._chunk], self._chunk, seed)
        # The resume the "last" window policy keeps sliding blocks for: the prompt's last whole chunk.
        prompt_end = (state.request.num_prompt_tokens - 1) // self._chunk * self._chunk if self._last_only else 0
        kept_from = max(prompt_end, freed_at)  # no resume before either is kept (or could be)
        loaded = state.loaded
        if full >= loaded.stop:
            state.loaded = range(0)  # planned past them: chunks_done covers them from now on
        for c in range(state.chunks_done, full):
            if c in loaded:  # loaded in this step or before: stored (and, with a destination, pushed on)
                continue
            # The engine holds the state where this step ends (uncapped: with asynchronous scheduling the
            # request's token ids trail it by a token) and, in "align" mode, where the step before ended.
            states = self._state_blocks(state, (c + 1) * self._chunk, step_end, prev_end)
            # A chunk stored without the states this step holds for it is written again, with them:
            # else the first writer's step (which ran past the chunk's end) would hide them for good.
            stored, replace = self._stored_for_save(keys[c], c, kept_from, bool(states))
            if self._sliding and not self._blanks_windows(c, kept_from):
                more = self._holds_more_than_planned(keys[c], c, kept_from)
                if more:  # over the copy planned before, wherever it is by now (unless the store holds as much)
                    replace = replace or not stored
                if more is not False:
                    self._window_plans[keys[c]] = (c, kept_from)
                    self._window_plans.move_to_end(keys[c])
                    while len(self._window_plans) > _WINDOW_PLANS:
                        self._window_plans.popitem(last=False)
            # With a destination, chunks already stored still go to the worker, to be pushed.
            if stored and not self._url and not replace:
                self.stats.chunks_skipped += 1
                continue
            meta.saves.append(
                SaveTask(
                    req_id,
                    keys[c],
                    tokens[c * self._chunk : (c + 1) * self._chunk],
                    state.block_ids[c * per : (c + 1) * per],
                    groups=[
                        self._chunk_blocks(g, w, c, per, kept_from)
                        for g, w in zip(state.groups, self._windows, strict=True)
                    ],
                    replace=replace,
                    parent=keys[c - 1] if c else None,
                    reads=[b for i, b in loading if i < c * per],
                    **states,
                )
            )
        state.chunks_done = max(state.chunks_done, full)
        if tail:
            self._plan_tail(meta, req_id, state, tokens, keys, loading)

    def _plan_tail(
        self,
        meta: HurrayConnectorMetadata,
        req_id: str,
        state: _Request,
        tokens: list[int],
        keys: list[str],
        loading: list[tuple[int, int]],
    ) -> None:
        """In the step that ends a prompt's prefill, save its tail: its whole blocks after its last whole chunk.

        A consumer of the same prompt (a prefill/decode split, the same prompt
        sent again) then loads every whole block of it and computes at most
        one block, instead of up to a chunk. Decode tokens complete the chunk
        later, and it is saved whole as usual. Once per request. ``keys``:
        the whole chunks' keys, at least up to the prompt's last one;
        ``loading``: as :meth:`_reads_loading`.
        """
        state.tail_planned = True
        prompt = state.request.num_prompt_tokens
        start = prompt // self._chunk * self._chunk
        end = prompt // self._block_size * self._block_size
        if end <= start:
            return
        prev = keys[start // self._chunk - 1] if start else None
        assert state.seed is not None  # _plan_saves returned already for a request without chunks
        n, key = tail_keys(prev, tokens[start:end], end - start, state.seed)[0]
        state.tail_end = end
        if self._stored(key) and not self._url:
            self.stats.chunks_skipped += 1
            return
        first = start // self._block_size
        blocks = state.block_ids[first : first + n // self._block_size]
        reads = [b for i, b in loading if i < first]
        meta.saves.append(SaveTask(req_id, key, tokens[start:end], blocks, tail=True, parent=prev, reads=reads))

    def _window_start(self, window: int, c: int, resume: int) -> int:
        """Where a save of chunk ``c`` holds a sliding layer's tokens from (chunk-relative, whole blocks).

        The blocks wholly before what a resume at the chunk's end (or at
        ``resume``, if later) attends are blanked (:meth:`_chunk_blocks`).
        """
        base, end = c * self._chunk, (c + 1) * self._chunk
        first_needed = max(0, max(end, resume) - window + 1) // self._block_size * self._block_size
        return min(self._chunk, max(0, first_needed - base))

    def _stored_for_save(self, key: str, c: int, resume: int, states: bool) -> tuple[bool, bool]:
        """Whether chunk ``c`` (``key``) is stored for a save of it, and whether that save writes over what is.

        Stored: some complete set of files holds what this save would, as far
        as their headers tell: they join (one save's slices), carry states
        where this save has them (``states``), and hold as much of the sliding
        windows (:meth:`_holds_less_window`). Else, with any complete set
        there, the save writes over it (``replace``): a set of slices from
        two saves (one rank's save failed, or two engines interleaved) is
        loaded by no lookup, and every rank of this engine rewrites its own
        slice, so that they join; so is a set whose files a lookup read and
        found not to join (:meth:`_passed`: scales or pages their headers do
        not tell). A set that another TP degree stored holding less is left
        beside the one this save writes (different names): the lookup takes
        whichever holds more (:meth:`_load_set`). Without states or windows to
        compare (none held, or this save blanks every windowed block), the
        first complete set that joins is stored (a ``stat`` per file, no
        header read).
        """
        compared = states or not self._blanks_windows(c, resume)
        found = False
        for parts in self._store.complete_sets(self._ns, key, self._heads):
            found = True
            if self._unjoined_set(parts):
                continue
            if not compared:
                return True, False
            held = [self._held(p) for p in parts]
            if not _headers_agree(held):
                continue
            if states and not all(h is not None and h.states is not None for h in held):
                continue  # its step ran past the chunk's end: this one's states are written over it
            # An unreadable header holds what it may: its reader judges (and moves it aside if damaged).
            win = next((h.windows for h in held if h is not None), None)
            if self._sliding and self._holds_less_window(win, c, resume):
                continue
            return True, False
        return found, found

    def _holds_less_window(self, win: SlidingWindows | None, c: int, resume: int) -> bool:
        """Whether a stored copy of chunk ``c`` holding ``win`` holds less of its sliding windows than this save would.

        A copy saved in a step that started past the chunk's end (speculative
        decoding), or under the "last" policy by a request whose prompt ran
        on past it, lacks blocks a resume at the chunk's end attends: a
        consumer resuming there would load nothing of it. Such a copy is
        written again by a producer that holds them. Only a save holding as
        much in every layer and more in one replaces it, so two producers
        never take turns. A stored file's header is read once (remembered by
        the file's identity, :meth:`_held`).
        """
        if self._blanks_windows(c, resume):
            return False  # it cannot hold more
        if win is None:
            return False  # holds every layer whole, or unreadable (its reader judges that)
        pairs = [
            (self._window_start(size, c, resume), starts[0])
            for size, starts in zip(win.sizes, win.kv_start, strict=True)
            if size is not None and starts
        ]
        return all(o <= t for o, t in pairs) and any(o < t for o, t in pairs)

    def _holds_more_than_planned(self, key: str, c: int, resume: int) -> bool | None:
        """Whether a save of chunk ``c`` (``key``) for ``resume`` holds more of its windows than one planned before.

        None where none was planned (:attr:`_window_plans`). As :meth:`_holds_less_window`: as much in every
        windowed layer and more in one, so that two plans never take turns.
        """
        planned = self._window_plans.get(key)
        if planned is None:
            return None
        pc, presume = planned
        pairs = [(self._window_start(w, c, resume), self._window_start(w, pc, presume)) for w in self._windows if w]
        return all(o <= t for o, t in pairs) and any(o < t for o, t in pairs)

    def _blanks_windows(self, c: int, resume: int) -> bool:
        """Whether a save of chunk ``c`` blanks every windowed block (:meth:`_window_start`); True with none."""
        return all(w is None or self._window_start(w, c, resume) >= self._chunk for w in self._windows)

    def _stored(self, key: str) -> bool:
        """Whether chunk ``key`` is stored whole (one file, or tensor-parallel slices of every head)."""
        return self._store.parts(self._ns, key, self._heads) is not None

    def _state_blocks(self, state: _Request, end: int, computed: int, prev_end: int = 0) -> dict[str, Any]:
        """A chunk's linear-attention state blocks, when this step ends at the chunk's end (else none).

        Only then does the engine hold the state at that token: a step that
        runs past it keeps only its own end's state. In "align" mode a step
        keeps its state in the block of its last token, and the next step
        copies it into its own block before it runs on: the state where the
        step before this one ended (``prev_end``) is also held, in its block,
        until vLLM frees that block in a later step. With asynchronous
        scheduling (vLLM's default on GPUs) a chunk whose last token was
        generated is planned exactly then, a step after the step that
        computed it, when the request's token ids hold that token.
        """
        if not self._state_groups or not (end == computed or (end == prev_end and self._state_mode == "align")):
            return {}
        blocks = {g: state_block(state.groups[g], end, self._block_size, self._state_mode) for g in self._state_groups}
        if not all(blocks.values()):
            return {}
        return {"state_blocks": {g: [b] for g, b in blocks.items()}, "state_position": end}

    def _chunk_blocks(self, blocks: list[int], window: int | None, c: int, per: int, resume: int = 0) -> list[int]:
        """Chunk ``c``'s blocks of one group; for a sliding window, 0 for those no kept resume needs.

        A resume at the chunk's end ``E`` attends from ``E - window + 1`` on, a later
        one from further on: the blocks wholly before that are never read again.
        ``resume``: no resume before it is kept either (the "last" policy), or
        vLLM freed the blocks for a resume there already.
        """
        own = blocks[c * per : (c + 1) * per]
        if window is None:
            return own
        start = self._window_start(window, c, resume)
        return [b if j * self._block_size >= start else 0 for j, b in enumerate(own)]

    def reset_cache(self) -> bool:
        """Called by vLLM's scheduler, via the connector, when the caches are reset; returns True. Never blocks.

        vLLM resets the connector with its prefix cache (``reset_prefix_cache(reset_connector=True)``, and
        ``pause_generation(clear_cache=True)`` before a weight update in reinforcement learning). The KV the
        engine computes from then on may come from weights other than those its namespace digests (weight
        files on disk), so this engine's chunks from then on get keys of their own (a random ``epoch`` in
        their seed, :func:`~hurray_vllm.chunks.keys.key_seed`): it neither loads the chunks saved before,
        nor stores new KV where an engine of the old weights would load it. The requests it knows already
        that hold KV (vLLM may keep a request running on KV from before the reset) are neither loaded nor
        saved any more and announce no saved chunks. Those that hold none (waiting, nothing computed, or
        preempted by the reset) compute all of their KV from then on: they take the new seed, as new
        requests do, and are loaded and saved under it. No request waits for pushed chunks any more
        (announced under the old keys, or under another engine's: none come under this engine's epoch), and
        none announces its saved chunks (:meth:`request_finished`): no other engine derives their keys. The
        chunks in the store stay there for other engines (``prune`` removes them once
        unused). Two engines that update to the same weights share no chunks until they restart: nothing
        in the engine names the new weights.
        """
        self._epoch = secrets.token_hex(16)
        for state in self._reqs.values():
            fresh = getattr(state.request, "num_computed_tokens", None) == 0
            state.seed = request_seed(self._ns, state.request, self._epoch) if fresh else None
            state.chunks_done = state.tail_end = 0
            state.loaded = range(0)
            state.tail_planned = False
            state.load = state.lookup = None  # planned under the old keys
            state.waited = True  # announced chunks are under the old keys: none will come under the new ones
        self._stored_headers.clear()
        self._serving.clear()
        self.stats.cache_resets += 1
        log.info("hurray: cache reset: this engine's chunks get keys of their own from now on")
        return True

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Called by vLLM's scheduler, via the connector, when a request finishes: forgets it.

        Returns ``(False, params)``: its blocks may be freed at once; ``params`` holds
        ``hurray_saved_tokens``, the tokens of its whole chunks saved (in the store, or on their way there and,
        with ``hurray_url``, to the destination), or is ``None`` when there are none. vLLM puts ``params`` in
        the answer's ``kv_transfer_params``; passed on with a continuation elsewhere, they make that engine wait
        for the chunks (:meth:`_awaits_push`). After a cache reset (:meth:`reset_cache`) ``params`` is always
        ``None``: the chunks are keyed by this engine's own epoch, which no other engine derives, so a
        continuation elsewhere would wait for them in vain.
        """
        state = self._reqs.pop(request.request_id, None)
        if self._epoch is not None:
            return False, None
        saved = state.chunks_done * self._chunk if state else 0
        params: dict[str, Any] = {"hurray_saved_tokens": saved} if saved else {}
        if state is not None and state.tail_end > saved:
            params["hurray_tail_tokens"] = state.tail_end
        return False, params or None
