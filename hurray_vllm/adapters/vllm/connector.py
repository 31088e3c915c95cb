"""``HurrayConnector``: a vLLM KV connector that saves and loads Hurray chunks.

Enable it with::

    --kv-transfer-config '{"kv_connector": "HurrayConnector",
      "kv_connector_module_path": "hurray_vllm.adapters.vllm.connector",
      "kv_role": "kv_both",
      "kv_connector_extra_config": {"hurray_path": "/var/cache/hurray"}}'

Extra config:

* ``hurray_path`` (required): directory of the chunk store (see
  :mod:`hurray_vllm.chunks.store`). Producers write there, consumers read there.
* ``hurray_url``: ``tcp://HOST:PORT`` (or ``nixl://HOST:PORT``) of another
  server's receiver; every chunk saved here is also sent there
  (server-to-server migration).
* ``hurray_listen``: ``HOST:PORT`` to run a receiver on; chunks it receives
  land, validated, in ``hurray_path``. ``hurray_listen_transport``: ``"tcp"``
  (default) or ``"nixl"`` (page pools arrive as NIXL writes; needs
  ``hurray-vllm[nixl]``).
* ``hurray_chunk_tokens`` (default 256): tokens per chunk. Must be a multiple
  of the block size of every engine sharing the store; engines with
  different block sizes share chunks (a loaded chunk is repaged).
* ``hurray_save_async`` (default ``true``): the step only copies the saved
  blocks out of the cache; a background thread unpacks, checksums and
  writes them (see :meth:`HurrayConnector.wait_for_save`). A chunk becomes
  visible in the store when its file is complete. ``false`` writes inside
  the step. With ``hurray_url`` saves are always synchronous, so that a
  migrated request finds its chunks on the destination.
* ``hurray_save_queue_mib`` (default 1024): copied-out blocks waiting for
  the background writer; a step that would exceed it waits for the writer.
* ``hurray_verified_chunks`` (default 256): chunks this process verified
  and keeps, by key, so that loading them again (the next turn of a
  conversation, a shared system prompt) neither parses nor checksums their
  files again while the files are unchanged (same inode, size and times).
  At least 64 (the chunks the scheduler verifies pass through it to the
  worker of the same process) and at most an eighth of the process's
  open-file limit: each kept chunk keeps its file open (Python's mmap
  holds a descriptor while the mapping lives).

``kv_role`` is honoured: ``kv_producer`` only saves, ``kv_consumer`` only
loads, ``kv_both`` does both.

What it does:

* **Save** (producer): whenever a request's computed tokens complete a
  chunk (prompt or generated tokens), the worker copies that chunk's blocks
  out of the cache after the forward pass (:meth:`wait_for_save`) unless
  the store has it, and a background thread writes it (:meth:`flush` waits
  for that).
* **Load** (consumer): for a new request, the scheduler finds the longest
  stored prefix (:meth:`get_num_new_matched_tokens`), checking the chunks'
  model, tokens and data digest before it claims any token; the worker
  then writes those chunks into the blocks vLLM allocated, through the
  engine's own cache-write op (:meth:`start_load_kv`), all validated before
  the first block is touched.

A chunk of another model, a truncated file or a corrupt transfer is
refused with one log line and the request is computed normally; a failure
discovered only on the worker is reported through
:meth:`get_block_ids_with_load_errors`, where vLLM's
``kv_load_failure_policy`` decides (``"recompute"`` recomputes).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ...chunks.store import (
    DIGEST_KEY,
    DIGEST_MISMATCH,
    DirectoryStore,
    chunk_digest,
    chunk_keys,
    digest_matches,
    namespace_of,
    verify_chunk,
)
from ...errors import HurrayFormatError
from ...kv.repage import repage_snapshot
from ...kv.snapshot import KVSnapshot, SnapshotSource
from ...transport.tcp import Receiver, parse_url, send_chunks
from .cache import EngineCache, attention_layers, describe_worker_cache, fingerprint_of, write_blocks
from .export import GatherBuffers, SequenceState, export_snapshot

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["HurrayConnector", "HurrayConnectorMetadata", "ConnectorStats", "forget_verified_chunks"]

log = logging.getLogger("hurray_vllm.connector")


class _VerifiedChunks:
    """Chunks this process verified (model, tokens, checksum), by key, with their file's identity.

    The scheduler hands them to a worker in the same process, which then
    does not read them again; and a later load of the same prefix (the
    next turn of a conversation, a shared system prompt) skips parsing and
    checksumming their files again as long as each file is still the one
    that was verified (:meth:`DirectoryStore.identity`). Least recently
    used first out. An entry costs little memory (its page pools are views
    of the file's mapping, which the kernel may drop and re-read), but it
    keeps the file's mapping, so a deleted chunk's disk space is freed only
    when its entry goes.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[tuple[int, ...], KVSnapshot]] = OrderedDict()

    def get(self, key: str, identity: tuple[int, ...]) -> KVSnapshot | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None or hit[0] != identity:
                return None
            self._items.move_to_end(key)
            return hit[1]

    def put(self, key: str, identity: tuple[int, ...], snap: KVSnapshot) -> None:
        with self._lock:
            self._items[key] = (identity, snap)
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


#: Shared by the scheduler and a uniprocess worker (see _VerifiedChunks).
_VERIFIED = _VerifiedChunks(256)


def _verified_capacity(wanted: int) -> int:
    """``wanted``, at least 64 (the handoff to the worker) and at most an eighth of the open-file limit.

    Each kept chunk keeps its file open: Python's mmap holds a descriptor
    for as long as the mapping lives.
    """
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no limit known: keep what was asked
        soft = -1
    if soft > 0:
        wanted = min(wanted, soft // 8)
    return max(64, wanted)


def forget_verified_chunks() -> None:
    """Drop every chunk this process remembers as verified: the next loads read and check their files."""
    _VERIFIED.clear()


_POOL_LOCK = threading.Lock()
_RECEIVERS: dict[str, Any] = {}  # transport.Receiver or transport_nixl.NixlReceiver
_DIGEST_POOL: list[ThreadPoolExecutor] = []


def _digest_pool() -> ThreadPoolExecutor:
    """One helper thread for chunk checksums (they release the GIL), made on first use."""
    with _POOL_LOCK:
        if not _DIGEST_POOL:
            _DIGEST_POOL.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="hurray-digest"))
        return _DIGEST_POOL[0]


@dataclass
class LoadTask:
    request_id: str
    keys: list[str]
    tokens: list[list[int]]  # per chunk
    block_ids: list[int]  # engine blocks to fill, chunk after chunk
    identities: list[tuple[int, ...]] = field(default_factory=list)  # of the chunk files the scheduler verified


@dataclass
class SaveTask:
    request_id: str
    key: str
    tokens: list[int]
    block_ids: list[int]


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
    tokens_loaded: int = 0
    chunks_refused: int = 0
    bytes_saved: int = 0
    chunks_remembered: int = 0  # loads served by chunks verified earlier in this process (files not read again)
    chunks_quarantined: int = 0  # damaged chunk files moved aside (<key>.hrry.bad), so that they are written again


@dataclass
class _Request:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    chunks_done: int = 0  # chunks known to be in the store (saved or loaded)
    load: LoadTask | None = None


class _Writer:
    """One background thread running submitted jobs in order, with a bound on the bytes they hold.

    Jobs never raise into the thread (they log); :meth:`flush` waits until
    every job submitted so far has finished.
    """

    def __init__(self, max_bytes: int) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], None], int] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._pending = 0
        self._held = 0
        self._max = max_bytes
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None], nbytes: int) -> None:
        """Queue ``job``; blocks first while the queued jobs hold more than the bound."""
        with self._cond:
            while self._held and self._held + nbytes > self._max:
                self._cond.wait()
            self._pending += 1
            self._held += nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hurray-save", daemon=True)
                self._thread.start()
        self._jobs.put((job, nbytes))

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, nbytes = item
            try:
                job()
            except Exception:  # a failed save only costs a recomputation later
                log.exception("hurray: background save failed")
            finally:
                with self._cond:
                    self._pending -= 1
                    self._held -= nbytes
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has run; False if ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)


#: Writers of live connectors, drained at interpreter exit so that no chunk is lost half-way.
_WRITERS: weakref.WeakSet[_Writer] = weakref.WeakSet()


@atexit.register
def _drain_writers() -> None:
    for w in list(_WRITERS):
        w.flush(timeout=60.0)


class _Staging:
    """Recycled copies of whole engine blocks (one tensor per layer) for the background writer.

    Copying blocks into memory that is already mapped runs at memory speed;
    into fresh memory it costs about three times as much on a CPU, which
    would make the step's share of a save as slow as writing the chunk.
    """

    def __init__(self, keep: int = 2) -> None:
        self._free: list[list[torch.Tensor]] = []
        self._lock = threading.Lock()
        self._keep = keep

    def copy(self, caches: list[torch.Tensor], ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Blocks ``ids`` of every layer: ``(views [len(ids), ...], the buffers to recycle)``."""
        n = int(ids.numel())
        bufs = None
        with self._lock:
            for i, cand in enumerate(self._free):
                if cand[0].shape[0] >= n and all(
                    b.shape[1:] == c.shape[1:] and b.dtype == c.dtype and b.device == c.device
                    for b, c in zip(cand, caches, strict=True)
                ):
                    bufs = self._free.pop(i)
                    break
        if bufs is None:
            bufs = [torch.empty((n, *c.shape[1:]), dtype=c.dtype, device=c.device) for c in caches]
        views = []
        for b, c in zip(bufs, caches, strict=True):
            torch.index_select(c, 0, ids.to(c.device), out=b[:n])
            views.append(b[:n])
        return views, bufs

    def recycle(self, bufs: list[torch.Tensor]) -> None:
        """Give back the buffers :meth:`copy` returned; the largest few are kept."""
        with self._lock:
            self._free.append(bufs)
            self._free.sort(key=lambda b: -b[0].shape[0])
            del self._free[self._keep :]


class HurrayConnector(KVConnectorBase_V1):
    """vLLM KV connector storing KV as Hurray block-paged chunks (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        path = cfg.get_from_extra_config("hurray_path", None)
        if not path:
            raise HurrayFormatError("hurray_path", "HurrayConnector needs kv_connector_extra_config.hurray_path")
        self._store = DirectoryStore(path)
        self._url = cfg.get_from_extra_config("hurray_url", None)
        self._nixl = bool(self._url) and str(self._url).startswith("nixl://")
        self._block_size = vllm_config.cache_config.block_size
        self._chunk = int(cfg.get_from_extra_config("hurray_chunk_tokens", 256))
        if self._chunk % self._block_size:
            raise HurrayFormatError(
                "hurray_chunk_tokens", f"{self._chunk} is not a multiple of the engine's block size {self._block_size}"
            )
        if self._nixl:
            from ...transport.nixl import default_sender, load_nixl, parse_nixl_url

            parse_nixl_url(self._url)
            load_nixl()  # a missing NIXL surfaces at start, not at the first save
            if role == KVConnectorRole.WORKER and cfg.kv_role in ("kv_producer", "kv_both"):
                default_sender()  # UCX starts here (~0.4 s), not inside the first step that pushes
        elif self._url:
            parse_url(self._url)  # a typo surfaces at start, not at the first save
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise HurrayFormatError("kv_cache_groups", "HurrayConnector supports models with one KV cache group")
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            raise HurrayFormatError("tensor_parallel_size", "HurrayConnector does not handle tensor parallelism yet")
        # kv_producer only saves, kv_consumer only loads, kv_both does both.
        self._loads = cfg.kv_role in ("kv_consumer", "kv_both")
        self._saves = cfg.kv_role in ("kv_producer", "kv_both")
        self._fingerprint = fingerprint_of(vllm_config)
        self._ns = namespace_of(self._fingerprint)
        self.stats = ConnectorStats()
        # Scheduler side.
        self._reqs: dict[str, _Request] = {}
        # Worker side.
        self._ec: EngineCache | None = None
        self._load_errors: set[int] = set()
        self._pushed: set[str] = set()
        self._async = str(cfg.get_from_extra_config("hurray_save_async", True)).lower() not in ("0", "false", "no")
        if self._url:
            self._async = False  # a migrated request must find its chunks on the destination
        _VERIFIED.capacity = _verified_capacity(int(cfg.get_from_extra_config("hurray_verified_chunks", 256)))
        queue_mib = int(cfg.get_from_extra_config("hurray_save_queue_mib", 1024))
        self._writer = _Writer(queue_mib << 20)
        _WRITERS.add(self._writer)
        self._staging = _Staging()
        self._inflight: set[str] = set()  # keys handed to the writer, not yet in the store
        self._chunk_buffers: list[GatherBuffers] = []  # the writer's, reused chunk after chunk
        self._registered: list[torch.Tensor] = []  # their memory, registered with the NIXL sender
        listen = cfg.get_from_extra_config("hurray_listen", None)
        if listen and role == KVConnectorRole.SCHEDULER and listen not in _RECEIVERS:
            host, _, port = str(listen).rpartition(":")
            if cfg.get_from_extra_config("hurray_listen_transport", "tcp") == "nixl":
                from ...transport.nixl import NixlReceiver

                _RECEIVERS[listen] = NixlReceiver(host or "127.0.0.1", int(port), self._store).start()
            else:
                _RECEIVERS[listen] = Receiver(host or "127.0.0.1", int(port), self._store).start()
            log.info("hurray: receiving chunks on %s into %s", listen, path)

    # ── scheduler side ─────────────────────────────────────────────────────

    def _refuse(self, key: str, why: object, damaged: tuple[int, ...] | None = None) -> None:
        """Count and log a refused chunk; ``damaged`` (its file's identity) moves a damaged file aside.

        A damaged file (unreadable, wrong checksum, tokens other than its key
        promises) would otherwise be refused by every later request with
        that prefix, and no producer would replace it: the key exists.
        """
        self.stats.chunks_refused += 1
        moved = self._store.quarantine(self._ns, key, damaged) if damaged is not None else None
        if moved is not None:
            self.stats.chunks_quarantined += 1
            log.warning("hurray: refusing chunk %s (%s); moved it to %s; recomputing instead", key, why, moved)
        else:
            log.warning("hurray: refusing chunk %s (%s); recomputing instead", key, why)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler side, when a request is scheduled: tokens loadable beyond ``num_computed_tokens``.

        Walks the chunk keys of the prompt (leaving at least one token to
        compute) and verifies each stored chunk (model, tokens, digest);
        stops at the first missing or refused one. Blocks on file reads and
        checksums; a chunk's checksum runs on a helper thread while the next
        chunk file is parsed.
        """
        if not self._loads:
            return 0, False
        tokens = list(request.all_token_ids)
        usable = (len(tokens) - 1) // self._chunk * self._chunk
        keys = chunk_keys(tokens[:usable], self._chunk, self._ns)
        state = self._reqs.setdefault(request.request_id, _Request(request))
        first = num_computed_tokens // self._chunk
        found: list[tuple[int, tuple[int, ...], KVSnapshot, Future[bool] | None]] = []
        for i in range(first, len(keys)):
            ident = self._store.identity(self._ns, keys[i])
            if ident is None:
                break
            toks = tokens[i * self._chunk : (i + 1) * self._chunk]
            snap = _VERIFIED.get(keys[i], ident)
            check: Future[bool] | None = None
            if snap is not None:
                self.stats.chunks_remembered += 1
            try:
                if snap is None:
                    snap = self._store.get(self._ns, keys[i])
                    check = _digest_pool().submit(digest_matches, snap)
                # Also for a remembered chunk: its key promises these tokens, the check costs little.
                verify_chunk(snap, self._fingerprint, toks, digest=False)
            except HurrayFormatError as exc:
                # Another model's chunk is left alone; anything else in it is damage.
                self._refuse(keys[i], exc, None if exc.field == "snapshot.fingerprint" else ident)
                break
            except OSError as exc:
                self._refuse(keys[i], exc)
                break
            found.append((i, ident, snap, check))
        hit = first
        idents = []
        for i, ident, snap, check in found:
            if check is not None:
                try:
                    ok = check.result()
                except (HurrayFormatError, OSError) as exc:
                    self._refuse(keys[i], exc)
                    break
                if not ok:
                    self._refuse(keys[i], DIGEST_MISMATCH, ident)
                    break
                _VERIFIED.put(keys[i], ident, snap)
            idents.append(ident)
            hit = i + 1
        matched = hit * self._chunk - num_computed_tokens
        if matched <= 0 or num_computed_tokens % self._chunk:
            return 0, False
        chunk_tokens = [tokens[i * self._chunk : (i + 1) * self._chunk] for i in range(first, hit)]
        state.load = LoadTask(request.request_id, keys[first:hit], chunk_tokens, [], idents)
        return matched, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Scheduler side, after vLLM allocated blocks: keep the load only if tokens were granted."""
        state = self._reqs.get(request.request_id)
        if state is not None and num_external_tokens == 0:
            state.load = None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Scheduler side, once per step: the loads and saves the worker performs in this step."""
        meta = HurrayConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            start = new.num_computed_tokens
            if state.load is not None:
                self._attach_load(meta, state, start)
            self._plan_saves(meta, new.req_id, state, start + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    state.block_ids = list(new_ids[0])
                else:
                    state.block_ids.extend(new_ids[0])
            if state.load is not None:
                # A preempted request resumed with a load planned when it was rescheduled.
                self._attach_load(meta, state, cached.num_computed_tokens[i])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._plan_saves(meta, req_id, state, done)
        return meta

    def _attach_load(self, meta: HurrayConnectorMetadata, state: _Request, computed: int) -> None:
        """Hand the planned load to the worker, with the engine blocks it fills."""
        load = state.load
        assert load is not None
        # The scheduler already counts the loaded tokens as computed.
        first = (computed - len(load.keys) * self._chunk) // self._block_size
        nblocks = len(load.keys) * self._chunk // self._block_size
        load.block_ids = state.block_ids[first : first + nblocks]
        meta.loads.append(load)
        state.chunks_done = computed // self._chunk
        state.load = None

    def _plan_saves(self, meta: HurrayConnectorMetadata, req_id: str, state: _Request, computed: int) -> None:
        full = computed // self._chunk
        if full <= state.chunks_done or not self._saves:
            return
        tokens = list(state.request.all_token_ids)
        keys = chunk_keys(tokens[: full * self._chunk], self._chunk, self._ns)
        per = self._chunk // self._block_size
        for c in range(state.chunks_done, full):
            # With a destination, chunks already stored still go to the worker, to be pushed.
            if self._store.has(self._ns, keys[c]) and not self._url:
                self.stats.chunks_skipped += 1
                continue
            meta.saves.append(
                SaveTask(
                    req_id,
                    keys[c],
                    tokens[c * self._chunk : (c + 1) * self._chunk],
                    state.block_ids[c * per : (c + 1) * per],
                )
            )
        state.chunks_done = full

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler side, once per finished request: forget it; blocks are freed at once."""
        state = self._reqs.pop(request.request_id, None)
        saved = state.chunks_done * self._chunk if state else 0
        return False, {"hurray_saved_tokens": saved} if saved else None

    # ── worker side ────────────────────────────────────────────────────────

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker side, once at start: remember the caches and how they are laid out."""
        layers = attention_layers(self._vllm_config)
        names = [n for n in layers if n in kv_caches]
        self._ec = describe_worker_cache(self._vllm_config, [kv_caches[n] for n in names], names)

    def _engine_cache(self, forward_context: ForwardContext | None = None) -> EngineCache:
        if self._ec is None:
            layers = attention_layers(self._vllm_config)
            names = list(layers)
            caches = [m.kv_cache[0] if isinstance(m.kv_cache, (list, tuple)) else m.kv_cache for m in layers.values()]
            self._ec = describe_worker_cache(self._vllm_config, caches, names)
        return self._ec

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Worker side, before the forward pass: write this step's loads into their blocks.

        Synchronous: returns when every block is written. Every chunk is
        read and verified before the first block is touched; a request whose
        chunks fail leaves its blocks unwritten and reports them as load errors.
        """
        meta = self._get_connector_metadata()
        assert isinstance(meta, HurrayConnectorMetadata)
        if not meta.loads:
            return
        ec = self._engine_cache(forward_context)
        for task in meta.loads:
            try:
                chunks = [self._chunk_for_load(task, c) for c in range(len(task.keys))]
            except (HurrayFormatError, OSError) as exc:
                log.warning("hurray: load of %s failed (%s); its blocks will be recomputed", task.request_id, exc)
                self._load_errors.update(task.block_ids)
                continue
            ids = torch.tensor(task.block_ids, dtype=torch.int64)
            per = self._chunk // ec.block_size
            for layer in range(ec.num_layers):
                # Chunk by chunk, straight from each chunk's pages: no dense copy, no concatenation.
                for c, chunk in enumerate(chunks):
                    k, v = self._pages(chunk, layer)
                    write_blocks(ec, layer, ids[c * per : (c + 1) * per], k, v)
            self.stats.chunks_loaded += len(chunks)
            self.stats.tokens_loaded += len(chunks) * self._chunk

    def _chunk_for_load(self, task: LoadTask, c: int) -> KVSnapshot:
        key = task.keys[c]
        # In the scheduler's process this is the chunk it verified; a worker process reads its own.
        snap = _VERIFIED.get(key, task.identities[c]) if c < len(task.identities) else None
        if snap is None:
            ident = self._store.identity(self._ns, key)
            snap = self._store.get(self._ns, key)
            verify_chunk(snap, self._fingerprint, task.tokens[c])
            if ident is not None:
                _VERIFIED.put(key, ident, snap)
        if snap.page_size != self._block_size:
            snap = repage_snapshot(snap, self._block_size)
        return snap

    @staticmethod
    def _pages(chunk: KVSnapshot, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk's K and V of ``layer`` as ``[pages, page_size, H, D]`` in token order, real-valued.

        A chunk holds one sequence, so its pool already is in token order
        when its block table is ``0, 1, ...`` (what the exporter writes);
        fp8 chunks are dequantized with their own scales.
        """
        out = []
        for role in ("key", "value"):
            t = chunk[layer, role]
            pool = t.page_pool
            # A chunk's tables hold a handful of ids: compared as lists, not with tensor ops
            # (this runs for every layer, role and chunk of a load).
            ptr = t.seq_ptr.tolist()
            table = t.block_table.tolist()[ptr[0] : ptr[1]]
            if table != list(range(pool.shape[0])):
                pool = pool.index_select(0, torch.tensor(table, dtype=torch.int64, device=pool.device))
            out.append(pool)
        if chunk.kv_scales is None:
            return out[0], out[1]
        ks, vs = chunk.kv_scales[layer]
        return out[0].float() * ks, out[1].float() * vs

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker side, per layer: nothing to wait for, :meth:`start_load_kv` is synchronous."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Worker side, per layer during the forward pass: nothing.

        Chunks are exported whole, all layers at once, in :meth:`wait_for_save`.
        """
        return

    def wait_for_save(self) -> None:
        """Worker side, after the forward pass: save this step's completed chunks.

        Asynchronous by default (``hurray_save_async``): copies the chunks'
        blocks out of the cache (one ``index_select`` per layer into recycled
        buffers) and returns; a background thread unpacks the copies into
        block-paged chunks, checksums and writes them. Blocks only when the
        copies waiting for that thread would exceed ``hurray_save_queue_mib``.
        Synchronous otherwise, and always with ``hurray_url``: then returns
        once every chunk is in the store and the receiver acknowledged it or
        the push failed (logged; the destination recomputes what it lacks).
        """
        meta = self._get_connector_metadata()
        assert isinstance(meta, HurrayConnectorMetadata)
        if not meta.saves:
            return
        ec = self._engine_cache()
        if self._async:
            self._save_async(ec, meta.saves)
            return
        tasks = iter(meta.saves)
        if not self._url:
            for _ in self._saved(ec, tasks, push=False):
                pass
            return
        # Chunk by chunk: each is exported into the same reused buffers (registered once with
        # NIXL), stored, and sent before the next is exported; the transports ask for the
        # next chunk only once the receiver acknowledged the previous one.
        chunks = self._saved(ec, tasks, push=True)
        try:
            if self._nixl:
                from ...transport.nixl import send_chunks_nixl

                send_chunks_nixl(self._url, chunks)
            else:
                send_chunks(self._url, chunks)
        except (OSError, HurrayFormatError) as exc:
            # The destination recomputes what it lacks; this engine's step goes on, and the
            # chunks not sent yet are still saved here.
            log.warning("hurray: could not push chunks to %s: %s", self._url, exc)
            for _ in self._saved(ec, tasks, push=False):
                pass

    def _saved(self, ec: EngineCache, tasks: Iterator[SaveTask], push: bool) -> Iterator[tuple[str, str, KVSnapshot]]:
        """Save each task's chunk; yield ``(namespace, key, chunk)`` for those to push.

        Exported chunks share the writer's reused buffers: a yielded chunk is
        valid until the next one is asked for.
        """
        for task in tasks:
            if self._store.has(self._ns, task.key):
                self.stats.chunks_skipped += 1
                if push and task.key not in self._pushed:
                    try:
                        chunk = self._store.get(self._ns, task.key)
                    except HurrayFormatError as exc:
                        log.warning("hurray: not pushing unreadable chunk %s: %s", task.key, exc)
                        continue
                    yield self._ns, task.key, chunk
                    self._pushed.add(task.key)
                continue
            snap = self._export_chunk(ec, ec.caches, task, task.block_ids, reuse=True)
            self._put(task.key, snap)
            if push:
                if self._nixl:
                    self._register_chunk_buffers()
                yield self._ns, task.key, snap
                self._pushed.add(task.key)

    def _register_chunk_buffers(self) -> None:
        """NIXL: register the reused chunk buffers with the sender once (again only when they grow)."""
        from ...transport.nixl import default_sender

        memory = [m for b in self._chunk_buffers for m in b.memory]
        if [m.data_ptr() for m in memory] == [m.data_ptr() for m in self._registered]:
            return
        sender = default_sender()
        if self._registered:
            sender.unregister(self._registered)
            self._registered = []
        sender.register(memory)
        self._registered = memory
        log.info("hurray: registered %.1f MiB of chunk buffers with NIXL", sum(m.numel() for m in memory) / 2**20)

    def _save_async(self, ec: EngineCache, saves: list[SaveTask]) -> None:
        todo: list[SaveTask] = []
        for task in saves:
            if task.key in self._inflight or self._store.has(self._ns, task.key):
                self.stats.chunks_skipped += 1
                continue
            self._inflight.add(task.key)
            todo.append(task)
        if not todo:
            return
        ids = torch.tensor([b for t in todo for b in t.block_ids], dtype=torch.int64)
        staged, buffers = self._staging.copy(ec.caches, ids)
        nbytes = sum(int(t.numel()) * t.element_size() for t in staged)

        def write() -> None:
            try:
                start = 0
                for task in todo:
                    local = list(range(start, start + len(task.block_ids)))
                    start += len(task.block_ids)
                    try:
                        # Exported into the writer's own reused buffers: no fresh memory per chunk.
                        self._put(task.key, self._export_chunk(ec, staged, task, local, reuse=True))
                    except (HurrayFormatError, OSError) as exc:
                        log.warning("hurray: could not save chunk %s: %s", task.key, exc)
            finally:
                self._staging.recycle(buffers)
                self._inflight.difference_update(t.key for t in todo)

        self._writer.submit(write, nbytes)

    def _export_chunk(
        self, ec: EngineCache, caches: list[torch.Tensor], task: SaveTask, block_ids: list[int], reuse: bool = False
    ) -> KVSnapshot:
        if reuse and len(self._chunk_buffers) != len(caches):
            self._chunk_buffers = [GatherBuffers() for _ in caches]
        snap = export_snapshot(
            caches,
            ec.layout,
            [SequenceState(task.request_id, block_ids, len(task.tokens), task.tokens)],
            block_size=ec.block_size,
            storage_dtype=ec.storage_dtype,
            kv_scales=ec.kv_scales,
            fingerprint=ec.fingerprint,
            source=SnapshotSource(ec.engine, ec.layout_name, ec.block_size),
            reserved_blocks=() if caches is not ec.caches else (0,),
            buffers=self._chunk_buffers if reuse else None,
        )
        return replace(snap, extra={DIGEST_KEY: chunk_digest(snap)})

    def _put(self, key: str, snap: KVSnapshot) -> None:
        if self._store.put(self._ns, key, snap):
            self.stats.chunks_saved += 1
            self.stats.bytes_saved += snap.nbytes

    def flush(self, timeout: float | None = None) -> bool:
        """Worker side, any time: wait until every chunk saved so far is in the store.

        Returns False if ``timeout`` seconds passed first. Called at shutdown
        and at interpreter exit; tests and benchmarks call it before looking
        at the store.
        """
        return self._writer.flush(timeout)

    def shutdown(self) -> None:
        """Worker side, when the worker shuts down: finish the background saves (up to a minute)."""
        if not self._writer.flush(timeout=60.0):
            log.warning("hurray: shutting down with chunk saves still running; they will be recomputed")

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker side, after a step: blocks whose load failed (vLLM applies kv_load_failure_policy)."""
        out, self._load_errors = self._load_errors, set()
        return out
