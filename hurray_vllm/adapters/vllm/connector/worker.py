"""The worker part of :class:`~hurray_vllm.adapters.vllm.connector.HurrayConnector`.

Runs in each model-runner process (the engine core's own, or a separate
worker process): it writes the step's loads into the engine's blocks
before the forward pass and saves completed chunks after it, through a
background writer by default.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import math
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from ....chunks.digest import digest_unverifiable
from ....chunks.keys import PARENT_KEY
from ....chunks.signing import sign_chunk
from ....chunks.store import (
    DIGEST_KEY,
    MISSING,
    ChunkUses,
    DirectoryStore,
    chunk_digest,
    chunk_layouts,
    slice_key,
    split_slice_key,
    verify_chunk,
)
from ....errors import HurrayArgumentError, HurrayFormatError
from ....kv.heads import concat_heads, select_heads
from ....kv.repage import RepagePlan, check_memory, plan_repage, repage_into
from ....kv.snapshot import HeadRange, KVSnapshot, ModelFingerprint
from ....kv.states import RecurrentStates, join_states
from ....transport import ChunkSender, sender_for
from ....transport.security import client_context
from ..cache import (
    EngineCache,
    attention_layers,
    describe_worker_cache,
    group_options,
    rank_share,
    with_heads,
    with_shared_layers,
    write_blocks,
)
from ..export import GatherBuffers, SequenceState, export_snapshot
from ..states import join_shares, pack_states
from .config import HurrayConfig
from .metadata import VERIFIED, ConnectorStats, HurrayConnectorMetadata, LoadTask, SaveTask, is_damage, verified_scope

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from ....kv.paged import BlockPagedTensor

__all__ = ["HurrayWorker"]

log = logging.getLogger("hurray_vllm.connector")


#: A callback the writer holds: called for the callable, or ``None`` once its object was collected.
_Callback = Callable[[], Callable[[], None] | None]


def _held_weakly(fn: Callable[[], None] | None) -> _Callback | None:
    """``fn`` as the writer holds it: weakly if it is a bound method, else as is.

    The writer's callbacks are its worker's methods. Held strongly, the
    writer's thread (alive while idle) would keep the worker, and with it the
    engine's KV caches, alive until :meth:`HurrayWorker.shutdown`.
    """
    if fn is None:
        return None
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    return lambda: fn


class _Writer:
    """One background thread running submitted jobs in order, with a bound on the bytes they hold.

    Jobs never raise into the thread (they log); :meth:`flush` waits until
    every job submitted so far has finished; :meth:`close` ends the thread.
    Bound methods given as callbacks are held weakly (:func:`_held_weakly`):
    once their object is collected they are not called, and an idle thread
    with no ``on_idle`` left ends.
    """

    def __init__(
        self,
        max_bytes: int,
        on_full: Callable[[], None] | None = None,
        on_idle: Callable[[], None] | None = None,
        idle_s: float = 1.0,
    ) -> None:
        self._on_full = _held_weakly(on_full)  # called when a submit must wait: the job running should hurry
        # Called on the thread after ``idle_s`` seconds without a job (then every ``idle_s``): work that waits
        # for no step (pushing on what a failed push held back) runs when nothing else does. Not a job:
        # flush() means "every chunk saved so far is stored", and must not wait for the network.
        self._on_idle = _held_weakly(on_idle)
        self._idle_s = idle_s
        self._jobs: queue.Queue[tuple[Callable[[], None], int] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._pending = 0
        self._held = 0
        self._max = max_bytes
        self._thread: threading.Thread | None = None
        self._ending = False  # close() queued the None that ends the thread

    @property
    def max_bytes(self) -> int:
        """The bound on the bytes queued jobs hold (``hurray_save_queue_mib``)."""
        return self._max

    def wait_for_room(self, nbytes: int) -> None:
        """Block until a job of ``nbytes`` fits in the bound (at once if none is queued); as :meth:`submit` does.

        Called before the memory a job will hold is allocated, so that the
        queue and the job being prepared stay within the bound together.
        """
        with self._cond:
            self._wait_for_room(nbytes)

    def _wait_for_room(self, nbytes: int) -> None:
        """:meth:`wait_for_room`, called under ``_cond``."""
        # The thread first: a bound waited for with none to drain the queue would be waited for forever.
        # A job larger than the bound alone is let in once the queue is empty: refusing it would drop it.
        while self._alive() and self._held and self._held + nbytes > self._max:
            on_full = self._on_full() if self._on_full is not None else None
            if on_full is not None:
                # Again and again: a push may connect after the first call.
                try:
                    on_full()
                except Exception:  # the step waits on: a failed abort only leaves the push to its own timeout
                    log.exception("hurray: could not cut the push in flight short")
            self._cond.wait(0.05)  # bounded: the thread may die meanwhile (_alive starts another)

    def submit(self, job: Callable[[], None], nbytes: int) -> None:
        """Queue ``job``; blocks first while the queued jobs hold more than the bound.

        Without a thread to be had (``RuntimeError: can't start new thread``)
        the job runs here, as a synchronous save would.
        """
        with self._cond:
            self._wait_for_room(nbytes)
            if self._thread is not None:
                self._pending += 1
                self._held += nbytes
                # Under the lock: an ending thread looks at the queue under it too (_run), and never leaves a
                # job behind.
                self._jobs.put((job, nbytes))
                return
        log.warning("hurray: no thread for the background writer; saving on the step's thread")
        self._run_job(job)

    def _alive(self) -> bool:
        """Start the thread unless it runs (also after one ended by an error no job catches); False if none starts.

        Called under ``_cond``. ``_thread`` is set only once it started, so
        that a thread that could not start is tried again by the next call.
        """
        if self._thread is not None and self._thread.is_alive():
            return True
        thread = threading.Thread(target=self._run, name="hurray-save", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # out of threads (or memory for a stack): passing, try again next time
            log.warning("hurray: cannot start the background writer: %s", exc)
            self._thread = None
            return False
        self._thread = thread
        return True

    @staticmethod
    def _run_job(job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:  # a failed save only costs a recomputation later
            log.exception("hurray: background save failed")

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # Ended by an error no job catches (a BaseException): the next submit (or this) starts another, for
            # the jobs still queued; without it they would wait for a dead thread, and a full queue for ever.
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None
                    if not self._jobs.empty():
                        self._alive()

    def _serve(self) -> None:
        while True:
            try:
                item = self._jobs.get(timeout=self._idle_s if self._on_idle is not None else None)
            except queue.Empty:
                assert self._on_idle is not None
                on_idle = self._on_idle()
                if on_idle is None:  # its worker is gone: no job can come (each holds it), nor idle work
                    with self._cond:
                        if self._jobs.empty():
                            self._thread, self._ending = None, False
                            return
                    continue
                try:
                    on_idle()
                except Exception:
                    log.exception("hurray: background push failed")
                del on_idle  # not held while waiting: the worker may be dropped meanwhile
                continue
            if item is None:
                with self._cond:
                    if self._jobs.empty():
                        self._thread, self._ending = None, False
                        return
                self._jobs.put(None)  # jobs submitted after close(): they run first
                continue
            job, nbytes = item
            try:
                self._run_job(job)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._held -= nbytes
                    self._cond.notify_all()
            # Not kept while the thread waits for the next job: a job holds its worker and its block copies.
            del item, job

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has run; False if ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def end(self) -> threading.Thread | None:
        """Have the thread end once the jobs submitted so far have run, without waiting; the thread, if any.

        Safe on the writer's own thread (a worker collected there ends its writer).
        """
        with self._cond:
            thread = self._thread
            if thread is not None and not self._ending:
                self._ending = True
                self._jobs.put(None)
            return thread

    def close(self, timeout: float) -> bool:
        """End the thread once the jobs submitted so far have run; False if it still runs after ``timeout`` seconds.

        Call it again to wait longer. Without it the idle thread would live on
        until its worker is collected. A job submitted later starts a new
        thread.
        """
        thread = self.end()
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()


#: Live workers, shut down at interpreter exit (as :meth:`HurrayWorker.shutdown`) so that no chunk is lost
#: half-way, nor held up behind a hung push. Weak: a worker dropped without shutdown is still collected.
_WORKERS: weakref.WeakSet[HurrayWorker] = weakref.WeakSet()


@atexit.register
def _drain_writers() -> None:
    for worker in list(_WORKERS):
        try:
            worker.shutdown()
        except Exception:  # at exit: nothing to raise into, and the other workers still drain
            log.exception("hurray: could not finish the background saves at exit")


#: A kept staging buffer is reused only for a copy of at least 1/this of its blocks (the queue is charged it whole).
_STAGING_SLACK = 2


class _Staging:
    """Recycled copies of whole engine blocks (one tensor per layer) for the background writer.

    Copying blocks into memory that is already mapped runs at memory speed;
    into fresh memory it costs about three times as much on a CPU, which
    would make the step's share of a save as slow as writing the chunk.

    ``max_bytes`` (``hurray_save_queue_mib``) bounds the buffers, counted by
    capacity: those handed out (held by the writer's queue) and those kept
    for reuse together stay within it, as far as dropping kept ones can make
    them (a single copy larger than the bound is still made). A copy takes
    the smallest kept buffer that fits, and none more than
    :data:`_STAGING_SLACK` times its size (then a buffer of its own size):
    saves of one size reuse their buffers step after step.
    """

    def __init__(self, max_bytes: int) -> None:
        self._free: list[list[torch.Tensor]] = []
        self._lock = threading.Lock()
        self._max = max_bytes
        self._free_bytes = 0  # capacity of the buffers kept for reuse
        self._out_bytes = 0  # ... and of those handed out, not yet recycled

    @staticmethod
    def capacity(bufs: list[torch.Tensor]) -> int:
        """The bytes a set of buffers holds (what :meth:`copy` handed out, whatever part of it is in use)."""
        return sum(b.numel() * b.element_size() for b in bufs)

    def copy(
        self, caches: list[torch.Tensor], ids: torch.Tensor | list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Blocks ``ids`` of every layer (or ``ids[i]`` of layer ``i``): ``(views, the buffers to recycle)``.

        Raises:
            HurrayFormatError: (field ``block_ids``) a block id outside a
                layer's cache (checked on the host, before any copy).
        """
        per_layer = ids if isinstance(ids, list) else [ids] * len(caches)
        # On the host, as write_blocks does: an id past a CUDA cache is a device-side assert that takes the
        # engine down, not an error the step can drop its saves on. One id tensor for every layer: checked once.
        checks = zip(per_layer, caches) if isinstance(ids, list) else [(ids, min(caches, key=len))] if caches else []
        for x, c in checks:
            if x.numel():
                lo, hi = (int(v) for v in torch.aminmax(x.detach().cpu()))
                if lo < 0 or hi >= len(c):
                    raise HurrayFormatError(
                        "block_ids",
                        f"block {lo if lo < 0 else hi} is outside this cache's {len(c)} blocks; "
                        "save only blocks the engine allocated to the request",
                    )
        n = max((int(x.numel()) for x in per_layer), default=0)
        bufs = None
        with self._lock:
            # The smallest kept buffer that fits, and none much larger: the writer's queue is charged a copy's
            # whole capacity, and a 1-block save in the buffer of an earlier large one would hold about the
            # whole bound, so that the next step waits for the writer (and cuts its push).
            best = None
            for i, cand in enumerate(self._free):
                rows = cand[0].shape[0]
                if (
                    n <= rows <= _STAGING_SLACK * n
                    and (best is None or rows < self._free[best][0].shape[0])
                    and all(
                        b.shape[1:] == c.shape[1:] and b.dtype == c.dtype and b.device == c.device
                        for b, c in zip(cand, caches, strict=True)
                    )
                ):
                    best = i
            if best is not None:
                bufs = self._free.pop(best)
                self._free_bytes -= self.capacity(bufs)
            else:
                # Room for the new buffers first: the kept ones that did not fit go, smallest first.
                need = n * sum(math.prod(c.shape[1:]) * c.element_size() for c in caches)
                while self._free and self._out_bytes + self._free_bytes + need > self._max:
                    self._free_bytes -= self.capacity(self._free.pop())
        if bufs is None:
            bufs = [torch.empty((n, *c.shape[1:]), dtype=c.dtype, device=c.device) for c in caches]
        with self._lock:
            self._out_bytes += self.capacity(bufs)
        try:
            views = []
            for b, c, x in zip(bufs, caches, per_layer, strict=True):
                m = int(x.numel())
                torch.index_select(c, 0, x.to(c.device), out=b[:m])
                views.append(b[:m])
        except BaseException:
            self.recycle(bufs)  # still counted as handed out otherwise
            raise
        return views, bufs

    def recycle(self, bufs: list[torch.Tensor]) -> None:
        """Give back the buffers :meth:`copy` returned; the largest are kept, within the bound."""
        size = self.capacity(bufs)
        with self._lock:
            self._out_bytes -= size
            self._free.append(bufs)
            self._free_bytes += size
            self._free.sort(key=lambda b: -self.capacity(b))
            while self._free and self._out_bytes + self._free_bytes > self._max:
                self._free_bytes -= self.capacity(self._free.pop())


def _expected_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is bad data or a machine's limit (logged without a traceback), not a bug."""
    return isinstance(exc, (HurrayFormatError, OSError, MemoryError, torch.OutOfMemoryError))


def _states_first(saves: list[SaveTask]) -> list[SaveTask]:
    """The tasks with linear-attention states first.

    A step may complete one chunk for two requests, one holding its states
    and one not, and of two writes of a key the first is kept.
    """
    return sorted(saves, key=lambda t: not t.state_blocks)


#: A step's chunk states joined from every rank's share, by request id and chunk key (unsliced).
_Gathered = dict[tuple[str, str], RecurrentStates]


def _task_states(ec: EngineCache, task: SaveTask, gathered: _Gathered | None = None) -> RecurrentStates | None:
    """A copy of the linear-attention states the chunk of ``task`` is stored with (``None``: none this step).

    ``gathered``: the states of this step's chunks joined from every rank's
    share (:meth:`HurrayWorker._gather_states`), by request and chunk key;
    else this rank's own share.
    """
    if ec.states is None or not task.state_blocks:
        return None
    if gathered is not None:  # missing: the shares did not join, the chunk goes without states
        return gathered.get((task.request_id, split_slice_key(task.key)[0]))
    return ec.states.gather([{g: ids[0] for g, ids in task.state_blocks.items()}], [task.state_position])


#: A chunk for the writer: its task, the blocks to export it from (``None``: stored already, only to be
#: pushed), and its linear-attention states.
_Item = tuple[SaveTask, list[int] | None, RecurrentStates | None]
#: After a push fails, how long saves go on without pushing: a dead destination costs one timeout,
#: not one per save. Each failure in a row doubles it, up to :data:`PUSH_BACKOFF_MAX_S`.
PUSH_BACKOFF_S = 10.0
PUSH_BACKOFF_MAX_S = 160.0
#: At shutdown, how long pending pushes may go on before the writer only stores.
SHUTDOWN_PUSH_GRACE_S = 5.0
#: At shutdown, how long the writer may then take to store what it holds.
SHUTDOWN_SAVE_S = 60.0
#: After a receiver could not say which chunks it holds (older than the query), how long none is asked.
ASK_BACKOFF_S = 600.0
#: How many pushed keys a worker remembers (not pushing them again from its store).
_PUSHED_KEYS = 1 << 16
#: How many stored chunks a worker remembers it could not push (tried again once pushing resumes).
_UNPUSHED_KEYS = 1 << 14

#: One stored file's share of a load: its KV (this worker's heads of it, in the file's own page size) and
#: the run of the worker's cache heads it fills (``None``: every head).
_Piece = tuple[KVSnapshot, range | None]
#: Builds one layer's pages of one piece of a load, as :func:`write_blocks` takes them (repaged to the
#: engine's block size, dequantized): called in the write loop, so that one layer's are held at a time.
_Pages = Callable[[], tuple[torch.Tensor, ...]]
#: One write of a load: ``(layer, engine blocks, its pages, the cache heads it fills)``.
_Write = tuple[int, torch.Tensor, _Pages, range | None]


def _task_blocks(task: LoadTask) -> set[int]:
    """Every engine block a load fills, in every group; never vLLM's null block 0 (nothing is loaded there)."""
    state = {b for ids in task.state_blocks.values() for b in ids if b}
    return {b for g in (task.groups or [task.block_ids]) for b in g if b} | state


#: A synchronous load that failed, while it spoils steps still to save: (how many, its blocks, its request).
_FailedLoad = tuple[int, frozenset[int], str]


def _reads_spoiled(task: SaveTask, spoiled: tuple[frozenset[int], frozenset[str]] | None) -> bool:
    """Whether a save's chunk read blocks a failed load left unwritten: its request's, its own or those before.

    ``spoiled``: the failed loads' blocks and requests (:meth:`HurrayWorker._spoiled`); None: not known, so yes.
    """
    if spoiled is None:
        return True
    blocks, requests = spoiled
    if task.request_id in requests or any(b in blocks for b in task.reads):
        return True
    return any(b in blocks for g in (task.groups or [task.block_ids]) for b in g if b)


class HurrayWorker:
    """Worker-side state and methods (see the facade's docstrings for who calls what, when)."""

    #: The synchronous loads that failed, each while it spoils the steps in flight (see wait_for_save). A
    #: tuple, replaced and never changed in place.
    _failed_loads: tuple[_FailedLoad, ...] = ()

    def __init__(
        self,
        config: HurrayConfig,
        store: DirectoryStore,
        fingerprint: ModelFingerprint,
        ns: str,
        vllm_config: VllmConfig | None = None,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config  # finds a linear-attention hybrid's state layers
        self._store = store
        self._fingerprint = fingerprint
        self._ns = ns
        self._chunk = config.chunk_tokens
        self._block_size = config.block_size
        self._url = config.url
        self._keys = config.keys
        # Made here: the NIXL sender starts UCX (~0.4 s), which must not happen inside a step.
        tls = client_context(config.push_tls) if config.push_tls is not None else None
        self._sender: ChunkSender | None = sender_for(config.url, tls=tls) if config.url and config.saves else None
        self._async = config.save_async
        # The process-wide handoff cache is bounded by this part's own setting on each put.
        self._verified_cap = config.verified_chunks
        self._scope = verified_scope(config.keys)
        self._verified_bytes = config.verified_bytes
        self.stats = ConnectorStats()
        self._ec: EngineCache | None = None
        self._load_errors: set[int] = set()
        # Steps whose saves are checked: a synchronous load failed in one still in flight (see wait_for_save).
        self._failed_steps = 0
        self._failed_loads = ()
        sched = getattr(vllm_config, "scheduler_config", None)
        self._steps_in_flight = 2 if getattr(sched, "async_scheduling", False) else 1
        # Asynchronous loads (``LoadTask.report``) done in this step, and those of them that failed.
        self._received: set[str] = set()
        self._failed: set[str] = set()
        self._pushed: OrderedDict[str, None] = OrderedDict()  # keys pushed, the most recent last
        self._push_paused_until = 0.0  # monotonic time: after a failed push, none is tried until then
        self._push_backoff = PUSH_BACKOFF_S  # the next pause: doubled by each failure in a row
        self._cut_short = False  # the push in flight was aborted here (a full queue, shutdown), not failed
        self._closing = False  # shutting down: nothing held back is pushed any more
        # Chunks stored while pushing failed or paused, the oldest first: pushed (if the receiver lacks
        # them) before the next delivery's, so that one failure does not leave a hole for good.
        self._unpushed: OrderedDict[str, None] = OrderedDict()
        self._ask_paused_until = 0.0  # ... after a receiver could not say which chunks it holds, none is asked
        # A step that would wait for the writer first cuts short the push it may be blocked on: the
        # step waits for the local disk, never for the network.
        # Idle pushes of what a failed push held back: with background saves, whose deliveries all run on
        # the writer's thread (synchronous saves retry with the next delivery, on the step's thread).
        idle = self._push_held_back if self._sender is not None and self._async else None
        self._writer = _Writer(config.save_queue_bytes, on_full=self._abort_push, on_idle=idle)
        # The writer holds this worker weakly: dropped without shutdown(), it ends the writer's thread (which
        # may run this, so end() does not join). Not at exit: _drain_writers shuts the live ones down instead.
        weakref.finalize(self, self._writer.end).atexit = False
        _WORKERS.add(self)
        self._staging = _Staging(config.save_queue_bytes)
        self._inflight: set[str] = set()  # keys handed to the writer, not yet in the store
        self._chunk_buffers: list[GatherBuffers] = []  # the writer's, reused chunk after chunk
        self._registered: list[torch.Tensor] = []  # their memory, registered with the sender
        # At tensor parallelism > 1: this rank's KV heads (which it saves and loads), and whether it
        # saves at all (a replica of heads another rank holds, or an MLA latent off rank 0, does not).
        self._my_heads: HeadRange | None = None
        self._saves_here = True
        if config.tp > 1 and vllm_config is not None:
            self._my_heads, self._saves_here = rank_share(vllm_config)
        # Fewer KV heads than ranks, with linear-attention states: ranks holding the same KV heads hold
        # different shares of the states, and the rank that saves those heads needs its replicas' shares.
        self._shares_states = bool(
            config.tp > 1
            and config.state_groups
            and vllm_config is not None
            and vllm_config.model_config.get_total_num_kv_heads() < config.tp
        )
        self._tp = config.tp
        self._layer_groups = config.layer_groups  # several KV cache groups only: layer name -> group
        self._windows = config.group_windows

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember the caches and how they are laid out; refuse layers in no KV cache group (at start).

        A layer that reuses another's KV (cross-layer KV sharing) is in its
        target's group (:func:`~..cache.with_shared_layers`), as in the model
        runner's groups: its cache is its target's, saved and loaded as a
        layer of its own, as an ungrouped engine's and ``snapshot()`` do.
        """
        layers = attention_layers(self._vllm_config)
        self._layer_groups = with_shared_layers(self._layer_groups, layers)
        names = [n for n in layers if n in kv_caches]
        missing = [n for n in names if self._layer_groups and n not in self._layer_groups]
        if missing:
            raise HurrayArgumentError(
                "kv_cache_groups",
                f"HurrayConnector: layers {missing} are in no KV cache group, nor share the KV of a layer in one",
            )
        self._ec = self._describe([kv_caches[n] for n in names], names)

    def _describe(self, caches: list[torch.Tensor], names: list[str]) -> EngineCache:
        """The caches described and checked against the scheduler's layer count (:func:`describe_worker_cache`).

        Raises:
            HurrayArgumentError: a cache this connector cannot serve (a kv_cache_dtype, per-head fp8 scales, a
                block size the backend splits, a drafter's geometry): the engine's configuration, refused as every
                setting is, whether at start (:meth:`register_kv_caches`) or at the first load or save.
        """
        try:
            ec = describe_worker_cache(self._vllm_config, caches, names, self._kv_cache_config)
        except HurrayFormatError as exc:
            if isinstance(exc, HurrayArgumentError):
                raise
            raise HurrayArgumentError(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from exc
        self._check_layers(ec)
        return ec

    def _check_layers(self, ec: EngineCache) -> None:
        """Refuse caches of another layer count than the scheduler keys chunks by (at start, not at each load).

        Its chunks would carry one fingerprint and be stored under another's
        namespace: saved on every request, loaded by none.
        """
        if self._fingerprint is not None and ec.num_layers != self._fingerprint.num_layers:
            raise HurrayArgumentError(
                "num_layers",
                f"HurrayConnector: this worker's caches hold {ec.num_layers} attention layers, the engine's KV cache "
                f"groups {self._fingerprint.num_layers}",
            )

    def _engine_cache(self, forward_context: ForwardContext | None = None) -> EngineCache:
        if self._ec is None:
            layers = attention_layers(self._vllm_config)
            self._layer_groups = with_shared_layers(self._layer_groups, layers)
            names = list(layers)
            caches = [m.kv_cache[0] if isinstance(m.kv_cache, (list, tuple)) else m.kv_cache for m in layers.values()]
            self._ec = self._describe(caches, names)
        return self._ec

    def start_load_kv(self, meta: HurrayConnectorMetadata, forward_context: ForwardContext | None = None) -> None:
        """Write this step's loads into their blocks.

        Returns when every block is written. Every chunk is read and verified
        before the first block is touched; a request whose chunks fail leaves
        its blocks unwritten and is reported as vLLM expects (:meth:`_fail`).
        """
        if not meta.loads:
            return
        t0 = time.perf_counter()
        try:
            self._load(meta, forward_context)
        finally:
            self.stats.load_s += time.perf_counter() - t0

    def _load(self, meta: HurrayConnectorMetadata, forward_context: ForwardContext | None) -> None:
        try:
            ec = self._engine_cache(forward_context)
        except Exception as exc:  # caches described late (vLLM never registered them) and refused: recompute
            for task in meta.loads:
                if task.report:
                    self._received.add(task.request_id)
                self._fail(task, exc)
            return
        for task in meta.loads:
            if task.report:
                self._received.add(task.request_id)  # done in this step, written or failed
                if not task.keys:  # vLLM waits for a load the scheduler could not plan
                    self._fail(task, HurrayFormatError("load", "the scheduler planned no chunks"))
                    continue
            try:
                chunks = [self._chunk_for_load(ec, task, c) for c in range(len(task.keys))]
                writes = self._plan_writes(ec, task, chunks)
                states = self._plan_states(ec, task, [snap for snap, _ in chunks[-1]] if chunks else [])
            except Exception as exc:  # nothing is written yet: any failure costs a recompute, not the worker
                self._fail(task, exc)
                continue
            try:
                for layer, ids, pages, heads in writes:
                    # Built here, a layer at a time (an fp8 chunk's pages are float32, four times its size):
                    # only allocation can fail now, everything the data decides was checked above.
                    write_blocks(ec, layer, ids, *pages(), heads=heads)
                if states is not None and ec.states is not None:
                    ec.states.write([task.state_blocks], states)
            except Exception as exc:
                # Out of memory for a layer's pages (host or device), or not foreseen by the checks above
                # (verify_chunk's geometry check makes it unreachable for data): some blocks may hold part of
                # the load. Reported failed, every block of the task is recomputed (asynchronous: the whole
                # request), never read as loaded; the engine lives on.
                self._fail(task, exc)
                continue
            self.stats.chunks_loaded += len(chunks) - task.tail
            self.stats.tails_loaded += task.tail
            self.stats.tokens_loaded += task.num_tokens(self._chunk) - task.skip_blocks * ec.block_size

    def _fail(self, task: LoadTask, why: BaseException) -> None:
        """A load that failed (before its first block was written, as a rule): report it, to be recomputed.

        An asynchronous load fails its request (``failed_recving``); a
        synchronous one reports its blocks (``invalid_block_ids``). A file
        found damaged was moved aside where it was read (:meth:`_quarantine`).
        """
        # Keep the traceback of anything else than bad data or a machine's limits.
        log.warning(
            "hurray: load of %s failed (%s); it will be recomputed",
            task.request_id,
            why,
            exc_info=not _expected_failure(why),
        )
        self.stats.loads_failed += 1
        if task.report:
            self._failed.add(task.request_id)
        else:
            blocks = _task_blocks(task)
            self._load_errors.update(blocks)
            # This step's forward pass reads blocks not written (see wait_for_save); with asynchronous scheduling
            # so does the next one, scheduled before vLLM learns of the failure.
            self._failed_steps = self._steps_in_flight
            self._failed_loads = (*self._failed_loads, (self._steps_in_flight, frozenset(blocks), task.request_id))

    def _quarantine(self, name: str, identity: tuple[int, ...], why: HurrayFormatError) -> None:
        """Move a chunk file this worker found damaged aside, as the scheduler's lookup does (``_refuse``).

        Left in place, its set of files would still count as stored: the
        recompute's save would skip the chunk, and every later lookup would
        read and refuse it again. Only if the file still is the one read
        (``identity``, taken before the read): one renamed over it since stays.
        """
        moved = self._store.quarantine(self._ns, name, identity)
        if moved is not None:
            self.stats.chunks_quarantined += 1
            log.warning("hurray: chunk %s is damaged (%s); moved it to %s", name, why, moved)

    def _plan_writes(self, ec: EngineCache, task: LoadTask, chunks: list[list[_Piece]]) -> list[_Write]:
        """Every ``(layer, engine blocks, pages, heads)`` write of a load, checked before the first block is touched.

        Chunk by chunk and piece by piece (a piece: one stored file's share
        of this worker's heads, see :meth:`_chunk_for_load`), straight from
        each file's pages: no dense copy, no concatenation. With several KV
        cache groups, each layer fills its group's blocks; a sliding-window
        group's null blocks (out of the window) get nothing, and a block the
        engine holds whose page the chunk did not keep refuses the load.

        Each write's pages are a recipe (:meth:`_page_recipe`), built only
        when the write loop gets to it: everything the data decides
        (repaging plans, page ids, windows, block counts) is checked here,
        but the pages are repaged and dequantized one layer at a time, so
        that a load holds one layer's float32 pages, not every layer's.

        Raises:
            HurrayFormatError: (field ``block_ids``) a KV cache group's
                engine blocks do not match the chunks' pages; a chunk's pages,
                windows or block structure that cannot be written.
            OSError: ``ENOMEM``: one layer's pages would not fit in the
                device's memory at all.
        """
        per = self._chunk // ec.block_size
        skip = task.skip_blocks  # the first chunk's blocks the engine holds already (prefix cache)
        tables = [torch.tensor(g, dtype=torch.int64) for g in task.groups] or [
            torch.tensor(task.block_ids, dtype=torch.int64)
        ]
        counts = [
            len(task.tokens[c]) // ec.block_size if task.tail and c == len(chunks) - 1 else per
            for c in range(len(chunks))
        ]
        if chunks:
            # Before any null block is dropped: a sliding-window group's table holds vLLM's null block 0 for
            # every block out of its window, so each group has one entry per block loaded. A short table would
            # only fail inside the writes (or, on a quantized CPU cache, hand the op fewer slots than values).
            need = sum(counts) - skip
            used = sorted({self._layer_groups[n] for n in ec.layer_names}) if self._layer_groups else [0]
            for g in used:
                have = len(tables[g]) if g < len(tables) else None
                if have != need:
                    raise HurrayFormatError(
                        "block_ids",
                        f"the load of {task.request_id} fills {need} blocks per KV cache group, "
                        f"group {g} has {have if have is not None else 'no'} engine blocks for them",
                    )
        writes: list[_Write] = []
        plans: dict[tuple[int, ...], RepagePlan] = {}  # repaging plans, per block structure
        held = 0  # the most one write holds at once, and where
        device: torch.device | None = None
        for layer in range(ec.num_layers):
            g = self._layer_groups[ec.layer_names[layer]] if self._layer_groups else 0
            ids = tables[g]
            window = self._windows[g] if self._windows else None
            for c, chunk, heads in ((c, snap, h) for c, pieces in enumerate(chunks) for snap, h in pieces):
                lo = 0 if c else skip
                pages = counts[c]
                dest = ids[c * per - skip + lo : c * per - skip + pages]
                rows = list(range(lo, pages))  # the chunk's pages these blocks take
                theirs = chunk.windows.sizes[layer] if chunk.windows is not None else None
                if theirs is not None and theirs != window:
                    # The chunk's layer dropped tokens this engine's layer attends (another window, or full).
                    raise HurrayFormatError(
                        "snapshot.windows",
                        f"chunk {task.keys[c]}: layer {layer} has a window of {theirs}, here {window}",
                    )
                if window is not None:
                    start = chunk.windows.kv_start[layer][0] if chunk.windows is not None else 0
                    wanted = (dest != 0).tolist()  # vLLM's null block: out of the window, nothing to write
                    # Only a page wholly at or after the first held token counts as held.
                    if any(w and r * ec.block_size < start for w, r in zip(wanted, rows, strict=True)):
                        raise HurrayFormatError(
                            "snapshot.windows", f"chunk {task.keys[c]} lacks sliding-window tokens layer {layer} needs"
                        )
                    rows = [r for w, r in zip(wanted, rows, strict=True) if w]
                    dest = dest[torch.tensor(wanted, dtype=torch.bool)]
                if dest.numel():
                    recipe, nbytes, where = self._page_recipe(chunk, layer, rows, ec.block_size, plans)
                    writes.append((layer, dest, recipe, heads))
                    if nbytes > held:
                        held, device = nbytes, where
        check_memory(held, f"loading one layer of {task.request_id}'s chunks", device)
        return writes

    @staticmethod
    def _plan_states(ec: EngineCache, task: LoadTask, last: list[KVSnapshot]) -> RecurrentStates | None:
        """The linear-attention states a load writes (the last chunk's), checked before any block is touched.

        ``last``: the pieces of the last chunk this worker reads (at tensor
        parallelism, the stored slices holding its heads, each with their
        share of the states, narrowed to this rank's): their states joined.

        Raises:
            HurrayFormatError: (field ``snapshot.states``) the last chunk holds
                no states taken at the resume, states of another geometry, or
                the engine gave a state group no block to hold them.
        """
        if ec.states is None:
            if task.state_blocks:
                raise HurrayFormatError("snapshot.states", "this worker found no linear-attention layers to load into")
            return None
        parts = [snap.states for snap in last]
        states = join_states([p for p in parts if p is not None]) if parts and None not in parts else None
        if states is None or tuple(states.positions) != (task.resume,):
            raise HurrayFormatError(
                "snapshot.states", f"chunk {task.keys[-1] if task.keys else '?'} holds no states at token {task.resume}"
            )
        if ec.states.part is not None and states.fraction != ec.states.fraction:
            states = states.take(*ec.states.part)  # heads replicated over ranks: this rank's share of theirs
        # Every layer's states, here rather than in StateCache.write (which checks them too): a violation
        # found there comes after the load's KV blocks are written.
        bad = states.violations()
        if bad:
            raise HurrayFormatError.from_violations(bad)
        diffs = ec.states.mismatches(states)
        if diffs:
            raise HurrayFormatError("snapshot.states", "states of another model: " + "; ".join(diffs))
        missing = [g for g in ec.states.state_group_ids if not task.state_blocks.get(g)]
        if missing:
            raise HurrayFormatError("snapshot.states", f"no engine block to hold the states of groups {missing}")
        return states

    @functools.cached_property
    def _uses(self) -> ChunkUses:
        """The files served from the verified copies, read a byte now and then: prune ranks by access time."""
        return ChunkUses(self._store, self._ns, self._verified_cap)

    def _chunk_for_load(self, ec: EngineCache, task: LoadTask, c: int) -> list[_Piece]:
        """Chunk ``c`` of a load as pieces: this rank's KV heads, from the files that hold them.

        Pieces keep the files' page size: a chunk stored in pages of another
        size is repaged a layer at a time as it is written (:meth:`_page_recipe`).

        A piece is one stored file's share of this worker's heads and the run
        of the worker's cache heads it fills (``None``: all of them), so that
        tensor-parallel slices are written where they lie, not joined into
        fresh memory first (only a quantized CPU cache, which cannot be
        written a part of its heads at a time, gets them joined). In the
        scheduler's process the files are the ones it verified; a worker in
        another process reads them itself (and checks them again, unless the
        file is the one the scheduler verified there already: then a byte of
        it is read, at most hourly, for prune's access times, see
        :class:`~hurray_vllm.chunks.store.ChunkUses`).
        """
        mine = self._my_heads
        parts = task.parts[c] if c < len(task.parts) else [(task.keys[c], 0, 0, ())]
        given = task.snaps[c] if c < len(task.snaps) else []  # in the scheduler's process: what it verified
        snaps = []
        for p, (name, start, stop, ident) in enumerate(parts):
            if mine is not None and stop > start and (stop <= mine.start or start >= mine.stop):
                continue  # another rank's heads
            snap = given[p] if p < len(given) else VERIFIED.get(name, ident, self._scope)
            if snap is not None and p >= len(given):
                self._uses.used(name)
                # Remembered by this process: its key promised these tokens then too, but the check is cheap.
                verify_chunk(
                    snap,
                    self._fingerprint,
                    task.tokens[c],
                    digest=False,
                    heads=range(start, stop) if stop > start else None,
                )
            if snap is None:
                now = self._store.identity(self._ns, name)
                try:
                    snap = self._store.get(self._ns, name)
                    self._uses.used(name, read=True)
                    verify_chunk(
                        snap,
                        self._fingerprint,
                        task.tokens[c],
                        heads=range(start, stop) if stop > start else None,
                        keys=self._keys,
                        namespace=self._ns,
                        name=name,
                    )
                except HurrayFormatError as exc:
                    # A file gone since the lookup (a prune) fails the load, but is no damage to move aside.
                    if now is not None and exc.field != MISSING and is_damage(exc) and not digest_unverifiable(exc):
                        self._quarantine(name, now, exc)
                    raise
                if now is not None:
                    VERIFIED.put(name, now, snap, self._verified_cap, self._verified_bytes, self._scope)
            snaps.append(snap)
        if not snaps:
            raise HurrayFormatError("snapshot.heads", f"chunk {task.keys[c]}: no stored file holds this rank's heads")
        if len(snaps) > 1 and not ec.writes_head_slices:
            snaps = [concat_heads(snaps)]
        pieces: list[_Piece] = []
        for snap in snaps:
            local = None
            if not snap.is_latent:
                have = snap.head_range
                lo, hi = (mine.start, mine.stop) if mine is not None else (0, have.total)
                a, b = max(have.start, lo), min(have.stop, hi)
                if (a, b) != (have.start, have.stop):
                    snap = select_heads(snap, range(a, b))  # views: only this rank's heads are written
                local = None if (a, b) == (lo, hi) else range(a - lo, b - lo)
            pieces.append((snap, local))
        return pieces

    @staticmethod
    def _page_recipe(
        chunk: KVSnapshot,
        layer: int,
        rows: list[int],
        page_size: int,
        plans: dict[tuple[int, ...], RepagePlan],
    ) -> tuple[_Pages, int, torch.device]:
        """How to build one chunk's K and V (or MLA latent) of ``layer`` as ``[pages, page_size, H, D]`` in token order.

        Returns ``(recipe, the bytes it allocates at most, their device)``;
        checks now everything the data decides (the repaging plan, the page
        ids), so that calling the recipe can only fail to allocate.

        ``rows``: only these of the chunk's pages (its logical page indices
        in pages of ``page_size``), so that a sliding-window layer copies
        only the pages it writes. A chunk holds one sequence, so its pool
        already is in token order when its block table is ``0, 1, ...``
        (what the exporter writes) and every page is asked for: a view, no
        copy. A chunk stored in pages of another size is repaged, one layer
        at a time (``plans``: the plans made so far, by block structure);
        fp8 chunks are dequantized with their own scales.

        Raises:
            HurrayFormatError: a tensor to repage without ``seq_lens``, an
                inconsistent block structure, or page ids past the pool.
        """
        members: list[tuple[BlockPagedTensor, RepagePlan | None, list[int]]] = []
        scales = chunk.kv_scales[layer] if chunk.kv_scales is not None else None
        nbytes = 0
        for t in chunk.layer(layer):
            plan = None
            if t.page_size != page_size:
                if t.seq_lens is None:
                    raise HurrayFormatError(
                        "seq_lens", "repaging needs the sequence lengths, which this snapshot does not carry"
                    )
                key = (id(t.block_table), id(t.seq_ptr), id(t.seq_lens), t.page_size)
                plan = plans.get(key)
                if plan is None:
                    plan = plans[key] = plan_repage(
                        t.block_table, t.seq_ptr, t.seq_lens, t.page_size, page_size, t.num_pages
                    )
                table_t, ptr_t, num_pages = plan.block_table, plan.seq_ptr, plan.num_pages
            else:
                table_t, ptr_t, num_pages = t.block_table, t.seq_ptr, int(t.page_pool.shape[0])
            # A chunk's tables hold a handful of ids: compared as lists, not with tensor ops
            # (this runs for every layer, role and chunk of a load).
            ptr = ptr_t.tolist()
            table = table_t.tolist()[ptr[0] : ptr[1]]
            if rows and max(rows) >= len(table):
                raise HurrayFormatError(
                    "block_table", f"layer {layer} {t.kv_role}: {len(table)} pages, page {max(rows)} asked for"
                )
            table = [table[r] for r in rows]
            if table and (min(table) < 0 or max(table) >= num_pages):
                raise HurrayFormatError(
                    "block_table", f"layer {layer} {t.kv_role}: page ids {table} outside the pool's {num_pages}"
                )
            members.append((t, plan, table))
            # What the recipe allocates at most: the repaged pool, the pages taken from it, their float32 values.
            elems, size = page_size * t.num_heads * t.head_dim, t.page_pool.element_size()
            nbytes += (plan.num_pages if plan is not None else 0) * elems * size
            nbytes += len(table) * elems * (size + (4 if scales is not None else 0))

        def build() -> tuple[torch.Tensor, ...]:
            out = []
            for t, plan, table in members:
                pool = t.page_pool
                if plan is not None:  # this layer's pool alone, repaged: freed once the layer is written
                    whole = torch.empty(
                        (plan.num_pages, page_size, t.num_heads, t.head_dim), dtype=pool.dtype, device=pool.device
                    )
                    repage_into(t, plan, whole)
                    pool = whole
                if table and table == list(range(table[0], table[0] + len(table))):
                    pool = pool[table[0] : table[0] + len(table)]  # a run of pages: a view, no copy
                else:
                    pool = pool.index_select(0, torch.tensor(table, dtype=torch.int64, device=pool.device))
                out.append(pool)
            if scales is None:
                return tuple(out)
            # Real values: the engine's cache write quantizes them again with its own scales.
            return tuple(pool.float() * scale for pool, scale in zip(out, scales, strict=False))

        return build, nbytes, chunk.layer(layer)[0].page_pool.device

    def wait_for_save(self, meta: HurrayConnectorMetadata) -> None:
        """Save this step's completed chunks (what it blocks on: :meth:`HurrayConnector.wait_for_save`).

        At tensor parallelism > 1 each rank saves its heads as a slice of the
        chunk (``<key>.h<a>-<b>``, :func:`~hurray_vllm.chunks.store.slice_key`);
        a rank whose heads another rank saves already (replicas, an MLA
        latent off rank 0) saves nothing. With linear-attention states and
        fewer KV heads than ranks, every rank first sends its share of the
        states of this step's chunks to the ranks that save them
        (:meth:`_gather_states`): this step then waits for the other ranks.

        Raises no error: vLLM calls it inside its step, where any exception
        stops the engine. A chunk that cannot be saved is counted
        (``saves_failed``), logged, and recomputed by whoever lacks it.
        """
        t0 = time.perf_counter()
        failed = failed_here = self._failed_steps > 0
        self._failed_steps = max(0, self._failed_steps - 1)
        spoiled = self._spoiled()
        try:
            # Every rank, the replicas too, takes part in the gather (a collective, in the same order).
            gathered = self._gather_states(meta.saves) if self._shares_states and meta.saves else None
            if meta.saves and self._tp > 1 and (meta.loads or self._steps_in_flight > 1):
                failed = self._any_rank(failed)  # every rank, on the same metadata: the collectives line up
                if failed:  # then on every rank: they all drop the same saves (a chunk is all its slices)
                    spoiled = self._every_rank_spoiled(failed_here, spoiled)
            todo = meta
            if meta.saves and failed:
                # This step's forward pass attended to blocks a synchronous load did not write (vLLM recomputes
                # them after it, and moves back the requests that hold them): a chunk that read one may hold
                # wrong KV. Those are not stored: the failed load's request's, those holding its blocks, and
                # those that read one before their own (a prefix-cache hit on the loading request's blocks:
                # SaveTask.reads, from HurrayScheduler._note_loads).
                # The scheduler plans again what vLLM moves back; the other requests' chunks are stored, as
                # their answers announce. Failures not known block by block (another rank's that could not be
                # learnt) drop every chunk. Those only to push on (read from their files, no block) still go:
                # _save makes no collective, so the ranks stay in step.
                todo = replace(meta, saves=[t for t in meta.saves if t.forward or not _reads_spoiled(t, spoiled)])
                dropped = len(meta.saves) - len(todo.saves)
                if dropped:
                    log.warning("hurray: a load failed; not saving the %d chunks that read its blocks", dropped)
                    self.stats.saves_dropped += dropped
            if todo.saves and self._saves_here:
                try:
                    self._save(todo, gathered)
                except Exception as exc:
                    # _save handles failures chunk by chunk; this is the net under what it does not foresee (the
                    # cache description failing, a bug). No collective follows: this rank alone may stop here.
                    self.stats.saves_failed += len(todo.saves)
                    log.warning(
                        "hurray: could not save this step's %d chunks: %s",
                        len(todo.saves),
                        exc,
                        exc_info=not _expected_failure(exc),
                    )
        finally:
            if meta.saves and self._saves_here:
                self.stats.save_s += time.perf_counter() - t0

    def _spoiled(self) -> tuple[frozenset[int], frozenset[str]] | None:
        """The blocks and requests of the synchronous loads that failed in the steps still in flight; one step on.

        Called once per step (by :meth:`wait_for_save`). None where none is known.
        """
        live = self._failed_loads
        self._failed_loads = tuple((n - 1, blocks, req) for n, blocks, req in live if n > 1)
        if not live:
            return None
        return frozenset().union(*(blocks for _, blocks, _ in live)), frozenset(req for _, _, req in live)

    def _every_rank_spoiled(
        self, failed: bool, mine: tuple[frozenset[int], frozenset[str]] | None
    ) -> tuple[frozenset[int], frozenset[str]] | None:
        """:meth:`_spoiled` of every tensor-parallel rank together (a collective, once a rank's load failed).

        A rank may fail a load the others did not (a slice file of its own). ``failed``: whether a load of this
        rank spoils this step, ``mine`` what it spoils. None where some rank's failure is not known (none
        recorded, or the collective failed): every chunk is dropped then.
        """
        import torch.distributed as dist
        from vllm.distributed import get_tp_group

        try:
            every: list[Any] = [None] * self._tp
            dist.all_gather_object(every, (failed, mine), group=get_tp_group().cpu_group)
        except Exception as exc:
            log.warning(
                "hurray: a collective with the other tensor-parallel ranks failed (%s); dropping every chunk", exc
            )
            return None
        known = [theirs for _, theirs in every if theirs is not None]
        if any(spoils and theirs is None for spoils, theirs in every) or not known:
            return None
        return frozenset().union(*(b for b, _ in known)), frozenset().union(*(r for _, r in known))

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any tensor-parallel rank (a collective: every rank calls it in the same step).

        A collective that fails (a broken channel, on every rank as a rule)
        reads as set, the side that saves nothing wrong; it does not raise
        into the step.
        """
        import torch.distributed as dist
        from vllm.distributed import get_tp_group

        try:
            t = torch.tensor([int(flag)], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
            return bool(t.item())
        except Exception as exc:
            log.warning("hurray: a collective with the other tensor-parallel ranks failed (%s); taking it as set", exc)
            return True

    def _gather_states(self, saves: list[SaveTask]) -> _Gathered:
        """This step's chunk states, each joined from every rank's share and cut to the heads this rank saves.

        Called on every rank in the same step with the same tasks (the
        scheduler's metadata), so the collectives line up. Each rank first
        copies its shares out (which may fail on one rank alone: no memory),
        then all of them agree on whether every rank could (one
        :meth:`_any_rank`); only then comes one all-gather per chunk with
        states, or none anywhere. Runs where ranks hold fewer KV heads than
        there are ranks: the file of a run of heads carries their share of
        the states (``docs/format.md`` 2.3d), which several ranks hold parts
        of. A chunk whose shares are not gathered or do not join is saved
        without states (a consumer recomputes from the chunk before). What it
        may block on: the other ranks reaching the same save.
        """
        import torch.distributed as dist
        from vllm.distributed import get_tp_group

        prepared: list[tuple[SaveTask, RecurrentStates, torch.Tensor, list[torch.Tensor]]] = []
        ready = True
        try:
            ec = self._engine_cache()
            for task in saves:
                mine = _task_states(ec, task)
                if mine is None:
                    continue
                flat = pack_states(mine)  # one buffer per chunk, members aligned
                prepared.append((task, mine, flat, [torch.empty_like(flat) for _ in range(self._tp)]))
        except Exception as exc:
            # This rank cannot send its shares; it still takes part in the flag below, so that no rank waits in
            # an all-gather this one never makes.
            ready = False
            log.warning(
                "hurray: could not copy this step's states out (%s); its chunks are saved without them",
                exc,
                exc_info=not _expected_failure(exc),
            )
        if self._any_rank(not ready):
            return {}
        try:
            group = get_tp_group().cpu_group
            for _task, _mine, flat, buffers in prepared:
                dist.all_gather(buffers, flat, group=group)
        except Exception as exc:  # a broken channel (on every rank, as a rule): raised, it would stop the engine
            log.warning("hurray: could not gather this step's states (%s); its chunks are saved without them", exc)
            return {}
        out: _Gathered = {}
        if not self._saves_here:
            return out  # a replica: its share is in the saving rank's file now
        heads = self._my_heads
        for task, mine, _flat, buffers in prepared:
            try:
                out[(task.request_id, task.key)] = join_shares(
                    mine, buffers, (heads.start, heads.stop, heads.total) if heads is not None else None
                )
            except Exception as exc:  # shares that do not join, no memory to join them: this chunk only
                log.warning(
                    "hurray: chunk %s is saved without its states: %s",
                    task.key,
                    exc,
                    exc_info=not _expected_failure(exc),
                )
        return out

    def _save(self, meta: HurrayConnectorMetadata, gathered: _Gathered | None = None) -> None:
        """Save (and push) ``meta``'s chunks; ``gathered``: their states joined across ranks (:func:`_task_states`)."""
        saves = meta.saves
        if self._my_heads is not None:
            heads = range(self._my_heads.start, self._my_heads.stop)
            saves = [replace(t, key=slice_key(t.key, heads)) for t in saves]
        ec = self._engine_cache()
        if self._async:
            self._save_async(ec, saves, gathered)
            return
        items: list[_Item] = []
        for task in _states_first(saves):
            try:
                if task.state_blocks and not task.replace and self._lacks_own_states(task.key):
                    task = replace(task, replace=True)
                if task.forward:
                    items.append((task, None, None))  # loaded here: only pushed on
                elif self._holds(task.key) and not task.replace:
                    self.stats.chunks_skipped += 1
                    items.append((task, None, None))  # stored already: pushed if the destination may lack it
                else:
                    items.append((task, task.block_ids, _task_states(ec, task, gathered)))
            except Exception as exc:
                # No memory to copy its states, a store that cannot be looked at: this chunk goes unsaved, as the
                # writer's export failures do (_stored), and the step's other chunks are saved.
                self.stats.saves_failed += 1
                log.warning("hurray: could not save chunk %s: %s", task.key, exc, exc_info=not _expected_failure(exc))
        self._deliver(ec, ec.caches, items)

    def _deliver(self, ec: EngineCache, caches: list[torch.Tensor], items: list[_Item]) -> None:
        """Store each item's chunk, in order; with ``hurray_url``, push each to the destination as it is stored.

        Chunk by chunk: each is exported into the same reused buffers
        (registered once with the sender), stored, and sent before the next
        is exported; the senders ask for the next chunk only once the
        receiver acknowledged the previous one. A push that fails is counted
        and logged, the rest of the items are still stored here, and no push
        is tried for :data:`PUSH_BACKOFF_S` (a dead destination must not make
        every save wait for its timeout); the destination recomputes what it
        lacks. Runs on the background writer (``hurray_save_async``, the
        default) or inside the step.
        """
        if self._sender is None or self._url is None or time.monotonic() < self._push_paused_until:
            self._store_only(ec, caches, items)
            return
        if self._unpushed:  # stored earlier, not pushed then: first, as chunks to push on from the store
            retry = [(SaveTask("", k, [], [], forward=True), None, None) for k in self._unpushed]
            self._unpushed.clear()
            items = [*retry, *items]
        rest = iter(items)
        self._cut_short = False
        try:
            forward = self._forward_plan(self._sender, self._url, items)
            if time.monotonic() < self._push_paused_until:
                # Paused while the receiver was asked (shutdown): a connection made now is one no abort
                # aimed at, and the push would hold the local writes for its whole timeout.
                self._store_only(ec, caches, items)
                return
            stored = self._stored(ec, caches, rest, push=True, forward=forward)
            self._sender.send(self._url, stored, keys=self._keys, owner=self)  # owner: _abort_push cuts only this
        except Exception as exc:  # a channel's unforeseen error too: the rest must still be stored here
            self.stats.push_failures += 1
            pause = self._push_backoff
            if not self._cut_short:  # a destination that failed, not one this engine stopped waiting for
                self._push_backoff = min(2 * self._push_backoff, PUSH_BACKOFF_MAX_S)
            self._push_paused_until = max(self._push_paused_until, time.monotonic() + pause)
            log.warning(
                "hurray: could not push chunks to %s (%s); not pushing for %.0f s, the destination recomputes them",
                self._url,
                exc,
                pause,
                exc_info=not _expected_failure(exc),
            )
            for _ in self._stored(ec, caches, rest, push=False):
                pass
            self._remember_unpushed(items)
        else:
            self._push_backoff = PUSH_BACKOFF_S

    def _store_only(self, ec: EngineCache, caches: list[torch.Tensor], items: list[_Item]) -> None:
        """Store the items' chunks here without pushing; remember them to push once pushing resumes."""
        for _ in self._stored(ec, caches, iter(items), push=False):
            pass
        self._remember_unpushed(items)

    def _push_held_back(self) -> None:
        """The writer is idle: push on the chunks a failed push held back, once the pause is over.

        Runs on the background writer's thread when it has no job (not as a
        job: ``flush`` does not wait for it); without it they would wait for
        the next delivery, which a finished request never has. What it may
        block on: the network, as any push on the writer.
        """
        ec = self._ec  # described by the delivery that held them back
        if self._unpushed and ec is not None and not self._closing and time.monotonic() >= self._push_paused_until:
            self._deliver(ec, [], [])

    def _remember_unpushed(self, items: list[_Item]) -> None:
        """Remember the items not pushed (the most recent :data:`_UNPUSHED_KEYS`), to push on later."""
        if self._sender is None or self._url is None:
            return
        for task, _, _ in items:
            if task.key not in self._pushed:
                self._unpushed[task.key] = None
                self._unpushed.move_to_end(task.key)
        while len(self._unpushed) > _UNPUSHED_KEYS:
            self._unpushed.popitem(last=False)

    def _abort_push(self) -> None:
        """Fail the push in progress (the writer then stores the rest here and pushing pauses).

        This worker's own push only: the NIXL sender is shared by every engine
        in the process, and another engine's push is not this one's to cut.
        """
        if self._sender is not None:
            self._cut_short = True
            self._sender.abort(self)

    def _holds(self, key: str) -> bool:
        """Whether the store holds chunk ``key`` (this rank's slice's key, or the whole's) for this worker's heads.

        Its own file, or any complete set of files (another TP degree's
        slices, or the whole chunk): then nothing is exported again, only
        pushed where the destination may lack it.
        """
        base, heads = split_slice_key(key)
        if heads is not None and self._store.has(self._ns, key):  # its own slice (parts looks at whole sets)
            return True
        return self._store.parts(self._ns, base, self._num_heads) is not None  # the whole file first

    def _lacks_own_states(self, key: str) -> bool:
        """Whether this rank's own file of chunk ``key`` (its slice, or the whole) is stored without states.

        A task with states then writes over it: else a sibling rank writing its
        slice with states (its own was missing) leaves the chunk's slices
        disagreeing, and no lookup loads the chunk or any after it.
        """
        return self._store.has(self._ns, key) and not self._store.has_states(self._ns, key)

    @property
    def _num_heads(self) -> int:
        """Every KV head of the model (what a complete set of a chunk's files holds)."""
        return self._fingerprint.num_kv_heads if self._fingerprint else 1

    def _push_names(self, key: str) -> list[str]:
        """The stored files of chunk ``key`` (a slice's key or the whole's) that this worker pushes on.

        The files that hold the chunk's heads, whichever producer wrote them
        (a whole file, or another TP degree's slices); at tensor parallelism
        > 1 each from the one saving rank whose heads it starts in, so that
        every file goes once. While a sibling rank's slice is still being
        written (no complete set yet), this rank's own slice. None if the
        chunk is not (or no longer) stored.
        """
        base, heads = split_slice_key(key)
        parts = self._store.parts(self._ns, base, self._num_heads)
        if parts is None:
            return [key] if heads is not None and self._store.has(self._ns, key) else []
        mine = self._my_heads
        return [p.name for p in parts if mine is None or mine.start <= p.heads.start < mine.stop]

    def _forward_plan(self, sender: ChunkSender, url: str, items: list[_Item]) -> dict[str, list[str]]:
        """Per item stored already (no block ids), by its key: the files to push, those the receiver lacks.

        Files this worker pushed before are left out without asking; the
        receiver is asked about the rest in one query, together with every
        other way their chunk can be stored (the whole file, or any TP
        degree's slices): a receiver that holds the chunk in other files gets
        nothing, but for the files that carry linear-attention states (its
        copy may lack them: a held answer does not say). A receiver that
        cannot answer (older than the query, or a channel without it) gets
        them all, and is not asked again for :data:`ASK_BACKOFF_S`: a push
        it does not need costs bandwidth, not correctness.

        Raises:
            OSError: the receiver cannot be reached, this engine cut the query short
                (:meth:`_abort_push`), or the store could not be listed: the push fails as a whole,
                and pauses; asking does not.
        """
        try:
            plan = {
                t.key: [n for n in self._push_names(t.key) if n not in self._pushed]
                for t, ids, _ in items
                if ids is None
            }
            layouts = {key: self._chunk_layouts(key) for key, names in plan.items() if names}
        except OSError:
            # The store could not be listed (ESTALE, EMFILE: passing): the push fails as a whole (counted,
            # paused), and what it held back and was to push on is remembered, not dropped.
            raise
        except Exception:  # a bug or an unforeseen error must not cost the local saves of this delivery
            log.exception("hurray: could not list the stored chunks to push on; not pushing them")
            return {}
        ask = sorted({(self._ns, n) for sets in layouts.values() for names in sets for n in names})
        if not ask or time.monotonic() < self._ask_paused_until:
            return plan
        try:
            held = {n for _ns, n in sender.held(url, ask, keys=self._keys, owner=self)}
        except (HurrayFormatError, NotImplementedError) as exc:
            if self._cut_short:  # this engine cut the query short (a full queue, shutdown): not the receiver's age
                raise
            self._ask_paused_until = time.monotonic() + ASK_BACKOFF_S
            log.info("hurray: %s did not say which chunks it holds (%s); pushing them", url, exc)
            return plan
        out = {}
        for key, names in plan.items():
            whole = any(all(n in held for n in layout) for layout in layouts.get(key, ()))
            # A file with linear-attention states goes all the same: the answer does not say whether the
            # receiver's copy has them, and its put replaces one without (else a load there resumes earlier).
            out[key] = [n for n in names if not (whole or n in held) or self._store.has_states(self._ns, n)]
            for n in set(names) - set(out[key]):  # the receiver holds them, or their chunk in other files
                self._mark_pushed(n)
            self.stats.chunks_held += len(names) - len(out[key])
        return out

    def _chunk_layouts(self, key: str) -> list[list[str]]:
        """Every complete set of files chunk ``key`` (or its slice's chunk) may be stored as: whole first."""
        return [[name for name, _ in files] for files in chunk_layouts(split_slice_key(key)[0], self._num_heads)]

    def _mark_pushed(self, name: str) -> None:
        """Remember that the destination holds file ``name`` (the most recent :data:`_PUSHED_KEYS`)."""
        self._pushed[name] = None
        self._pushed.move_to_end(name)
        if len(self._pushed) > _PUSHED_KEYS:
            self._pushed.popitem(last=False)

    def _stored(
        self,
        ec: EngineCache,
        caches: list[torch.Tensor],
        items: Iterator[_Item],
        push: bool,
        forward: dict[str, list[str]] | None = None,
    ) -> Iterator[tuple[str, str, KVSnapshot]]:
        """Store each item's chunk as it is asked for; yield ``(namespace, key, chunk)`` for those to push.

        An item with block ids is exported from those blocks of ``caches``
        and stored; one without (``None``) is a chunk stored before, whose
        files (``forward``, by the item's key: :meth:`_forward_plan`) are read
        back only to be pushed. Exported chunks share the writer's reused
        buffers: a yielded chunk is valid until the next one is asked for.
        """
        for task, block_ids, states in items:
            if block_ids is None:
                if push:
                    yield from self._forwarded((forward or {}).get(task.key, ()))
                continue
            try:
                # Exported into the writer's own reused buffers: no fresh memory per chunk.
                snap = self._export_chunk(ec, caches, task, block_ids, reuse=True, states=states)
                self._put(task.key, snap, replace=task.replace, tail=task.tail)
            except Exception as exc:
                # Any failure, per chunk: it costs this chunk a recomputation, not the rest of the delivery (nor,
                # with hurray_save_async=false, the engine), and it is no push failure (no back-off).
                self.stats.saves_failed += 1
                log.warning("hurray: could not save chunk %s: %s", task.key, exc, exc_info=not _expected_failure(exc))
                continue
            if push:
                self._register_chunk_buffers()
                yield self._ns, task.key, snap
                # Resumed only once the receiver acknowledged the chunk.
                self.stats.chunks_pushed += 1
                self._mark_pushed(task.key)

    def _forwarded(self, names: Iterable[str]) -> Iterator[tuple[str, str, KVSnapshot]]:
        """Stored files read back to be pushed, one at a time; unreadable ones (damaged, pruned) are skipped."""
        for name in names:
            if name in self._pushed:  # pushed meanwhile (two requests sharing a prefix, in one delivery)
                continue
            try:
                snap = self._store.get(self._ns, name)
            except (HurrayFormatError, OSError) as exc:
                log.warning("hurray: not pushing unreadable chunk %s: %s", name, exc)
                continue
            yield self._ns, name, snap
            self.stats.chunks_pushed += 1
            self.stats.chunks_forwarded += 1
            self._mark_pushed(name)

    def _register_chunk_buffers(self) -> None:
        """Register the reused chunk buffers with the sender once (again only when they grow; TCP ignores it).

        Host buffers only: a GPU engine exports into device memory, whose pools
        the NIXL sender copies to the host chunk by chunk (registering it
        would refuse them, and fail every push).
        """
        memory = [m for b in self._chunk_buffers for m in b.memory if m.device.type == "cpu"]
        sender = self._sender
        if sender is None or [m.data_ptr() for m in memory] == [m.data_ptr() for m in self._registered]:
            return
        if self._registered:
            sender.unregister(self._registered)
            self._registered = []
        sender.register(memory)
        self._registered = memory
        mib = sum(m.numel() for m in memory) / 2**20
        log.info("hurray: %.1f MiB of chunk buffers registered with the %s sender", mib, sender.scheme)

    def _save_async(self, ec: EngineCache, saves: list[SaveTask], gathered: _Gathered | None = None) -> None:
        """Copy the blocks of the chunks to save out of the cache and hand them to the background writer.

        A chunk already stored (or on its way there) is not copied; with
        ``hurray_url`` a stored one still goes to the writer, which pushes it
        if this worker has not yet (pushes keep the order of the steps).

        The copies are made and handed over in batches that each fit in
        ``hurray_save_queue_mib`` (a chunk larger than it goes alone): before
        each batch the step waits until the writer has room for it, so that
        a step completing many chunks holds no more than the bound, not all
        of its chunks' blocks at once.
        """
        order: list[tuple[SaveTask, bool]] = []  # the writer's items in order: (task, whether to export it)
        for task in _states_first(saves):
            try:
                entry = self._plan_save(task)
            except Exception as exc:  # a store that cannot be looked at: this chunk only
                self.stats.saves_failed += 1
                log.warning("hurray: could not save chunk %s: %s", task.key, exc, exc_info=not _expected_failure(exc))
                continue
            if entry is not None:
                order.append(entry)
        if self._sender is None:
            order = [e for e in order if e[1]]  # nothing to push: only the chunks to export
        per_block = sum(math.prod(c.shape[1:]) * c.element_size() for c in ec.caches)
        batches: list[tuple[list[tuple[SaveTask, bool]], int]] = []
        batch: list[tuple[SaveTask, bool]] = []
        size = 0
        for task, export in order:
            nbytes = self._copy_blocks(task) * per_block if export else 0
            if size and size + nbytes > self._writer.max_bytes:
                batches.append((batch, size))
                batch, size = [], 0
            batch.append((task, export))
            size += nbytes
        if batch:
            batches.append((batch, size))
        for i, (batch, size) in enumerate(batches):
            try:
                self._stage(ec, batch, size, gathered)
            except Exception as exc:
                # Out of device memory for the copies, say: this batch's chunks and the rest of the step's go
                # unsaved (a consumer recomputes them), and the engine runs on. Their keys are no longer in
                # flight, so a later step saves them; those only to push are pushed with a later delivery.
                rest = [entry for b, _ in batches[i:] for entry in b]
                lost = [t for t, export in rest if export]
                self._inflight.difference_update(t.key for t in lost)
                self.stats.saves_failed += len(lost)
                unpushed: list[_Item] = [(t, None, None) for t, export in rest if not export]
                if unpushed:  # on the writer's thread, which iterates what it remembers as it delivers
                    self._writer.submit(partial(self._remember_unpushed, unpushed), 0)
                log.warning(
                    "hurray: dropping %d of this step's saves: %s", len(lost), exc, exc_info=not _expected_failure(exc)
                )
                return

    def _plan_save(self, task: SaveTask) -> tuple[SaveTask, bool] | None:
        """Whether the writer exports ``task``'s chunk (marked in flight), only pushes it (stored), or neither."""
        if task.forward:  # loaded here: only pushed on, from its files
            return task, False
        if task.state_blocks:
            # A chunk with states is written even over the same chunk without them (stored or on its way):
            # also over this rank's own slice stored without them, which the scheduler cannot see while a
            # sibling rank's slice is missing (its replace covers complete sets only).
            if task.key in self._inflight or (not task.replace and self._lacks_own_states(task.key)):
                task = replace(task, replace=True)
            if self._holds(task.key) and not task.replace:
                self.stats.chunks_skipped += 1
                return task, False
        elif not task.replace and (task.key in self._inflight or self._holds(task.key)):
            # (A replace, the scheduler's call, writes after any copy in flight: the writer keeps order.)
            self.stats.chunks_skipped += 1
            return None if task.key in self._inflight else (task, False)
        self._inflight.add(task.key)
        return task, True

    def _copy_blocks(self, task: SaveTask) -> int:
        """How many blocks of each layer copying ``task``'s chunk out takes at most."""
        if self._windows and task.groups:
            return max(len(g) for g in task.groups) + 1  # each group's copy starts with the null block
        return len(task.block_ids)

    def _stage(
        self, ec: EngineCache, batch: list[tuple[SaveTask, bool]], size: int, gathered: _Gathered | None
    ) -> None:
        """Copy one batch's blocks and states out of the cache and hand them to the writer, in order.

        ``batch``: ``(task, whether to export it)``, in the writer's order;
        ``size``: what its block copies take at most, waited for first.

        Raises:
            HurrayFormatError: (field ``block_ids``) a block outside the cache.
            torch.OutOfMemoryError: no memory for the copies.
        """
        todo = [t for t, export in batch if export]
        staged: list[torch.Tensor] = []
        buffers: list[torch.Tensor] | None = None
        staged_tasks = todo
        if todo:
            # Before the copies: the queue and this batch's copies stay within the bound together.
            self._writer.wait_for_room(size)
            ids: torch.Tensor | list[torch.Tensor]
            if self._windows:
                ids, staged_tasks = self._stage_groups(ec, todo)
            else:
                ids = torch.tensor([b for t in todo for b in t.block_ids], dtype=torch.int64)
            staged, buffers = self._staging.copy(ec.caches, ids)
        try:
            # States are copied now too: their blocks are reused as the engine runs on.
            states = [_task_states(ec, t, gathered) for t in todo]
        except BaseException:
            if buffers is not None:
                self._staging.recycle(buffers)
            raise
        # On a GPU the copies run on the step's stream, which the writer's thread does not follow: it waits
        # for this event before it reads them (else it could read a recycled buffer's older chunk).
        copied = torch.cuda.Event() if staged and staged[0].is_cuda else None
        if copied is not None:
            copied.record()
        # What the buffers hold, not the views in use: a recycled buffer may be larger than this batch needs.
        nbytes = self._staging.capacity(buffers) if buffers is not None else 0
        nbytes += sum(s.nbytes for s in states if s is not None)
        items: list[_Item] = []
        exported, start = iter(zip(staged_tasks, states, strict=True)), 0
        for task, export in batch:
            if not export:
                items.append((task, None, None))
                continue
            task, task_states = next(exported)
            if task.groups:  # already renumbered into the staged copies
                local = list(task.groups[0])
            else:
                local = list(range(start, start + len(task.block_ids)))
                start += len(task.block_ids)
            items.append((task, local, task_states))

        def write() -> None:
            try:
                if copied is not None:
                    copied.synchronize()
                self._deliver(ec, staged, items)
            except Exception:  # what _deliver does not foresee (a bug): its chunks count as failed (the writer logs)
                self.stats.saves_failed += len(todo)
                raise
            finally:
                if buffers is not None:
                    self._staging.recycle(buffers)
                self._inflight.difference_update(t.key for t in todo)

        self._writer.submit(write, nbytes)

    def _stage_groups(self, ec: EngineCache, todo: list[SaveTask]) -> tuple[list[torch.Tensor], list[SaveTask]]:
        """Per layer, the blocks of its group to copy out; the tasks renumbered into those copies.

        Each group's copy starts with vLLM's null block 0, so that a sliding
        group's dropped blocks (0) stay 0 in the copy: the export maps them
        to its zero page as it would in the engine's cache.
        """
        staged_ids: list[list[int]] = []
        where: list[dict[int, int]] = []
        for g in range(len(self._windows)):
            order, pos = [0], {0: 0}
            for task in todo:
                for b in task.groups[g]:
                    if b not in pos:
                        pos[b] = len(order)
                        order.append(b)
            staged_ids.append(order)
            where.append(pos)
        tasks = [replace(t, groups=[[where[g][b] for b in t.groups[g]] for g in range(len(where))]) for t in todo]
        layer_ids = [torch.tensor(staged_ids[self._layer_groups[n]], dtype=torch.int64) for n in ec.layer_names]
        return layer_ids, tasks

    def _export_chunk(
        self,
        ec: EngineCache,
        caches: list[torch.Tensor],
        task: SaveTask,
        block_ids: list[int],
        reuse: bool = False,
        states: RecurrentStates | None = None,
    ) -> KVSnapshot:
        if reuse and len(self._chunk_buffers) != len(caches):
            self._chunk_buffers = [GatherBuffers() for _ in caches]
        # Several KV cache groups: each layer's blocks are its group's.
        groups = group_options(self._layer_groups, self._windows, ec.layer_names) if task.groups else {}
        snap = export_snapshot(
            caches,
            ec.layout,
            [
                SequenceState(
                    task.request_id, block_ids, len(task.tokens), task.tokens, group_block_ids=tuple(task.groups)
                )
            ],
            **ec.export_options(),
            # The engine's cache, and a grouped copy (_stage_groups puts vLLM's null block first): block 0 is the
            # null block, a sliding group's dropped blocks. A plain copy's block 0 is the chunk's first block.
            reserved_blocks=(0,) if task.groups or caches is ec.caches else (),
            buffers=self._chunk_buffers if reuse else None,
            **groups,
            states=states,
        )
        snap = with_heads(snap, self._my_heads)  # a rank's slice says which heads it holds (checked)
        if task.parent is not None:  # the chunk before it (prune keeps it while it keeps this one): digested, signed
            snap = replace(snap, extra={**snap.extra, PARENT_KEY: task.parent})
        snap = replace(snap, extra={**snap.extra, DIGEST_KEY: chunk_digest(snap)})
        # task.key is the file's name (a rank's slice key at TP > 1): the MAC binds the chunk to it.
        return sign_chunk(snap, self._keys, self._ns, task.key) if self._keys is not None else snap

    def _put(self, key: str, snap: KVSnapshot, replace: bool = False, tail: bool = False) -> None:
        if not self._store.put(self._ns, key, snap, replace=replace):
            # Stored meanwhile (another worker or engine sharing the store): what the step's check would have
            # skipped, had the file been there then.
            self.stats.chunks_skipped += 1
            return
        if tail:
            self.stats.tails_saved += 1
        else:
            self.stats.chunks_saved += 1
        self.stats.bytes_saved += snap.nbytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every chunk saved so far is in the store.

        Returns False if ``timeout`` seconds passed first. Called at shutdown
        and at interpreter exit; tests and benchmarks call it before looking
        at the store.
        """
        return self._writer.flush(timeout)

    def shutdown(self) -> None:
        """Finish the background saves (up to a minute) and end the writer; pushes get :data:`SHUTDOWN_PUSH_GRACE_S`."""
        self._closing = True
        self._writer.flush(timeout=SHUTDOWN_PUSH_GRACE_S)
        # From here on the writer only stores: a push still waiting (a hung destination) must not keep the
        # local writes from the disk. Cut again and again, as a full queue does: a delivery past its look at
        # the pause may still open a connection after any one abort.
        self._push_paused_until = float("inf")
        deadline = time.monotonic() + SHUTDOWN_SAVE_S
        while not self._writer.close(timeout=0.05):
            if time.monotonic() >= deadline:
                log.warning("hurray: shutting down with chunk saves still running; they will be recomputed")
                return  # the writer may still push from the registered buffers: they stay registered
            self._abort_push()
        self._unregister_chunk_buffers()

    def _unregister_chunk_buffers(self) -> None:
        """Hand the chunk buffers' registration back to the sender (the writer is done with them).

        The NIXL sender is the process's (:func:`~hurray_vllm.transport.nixl.default_sender`) and
        outlives this worker: each registration keeps its buffers alive and pinned, so a worker
        shut down without this leaks them for the process's life.
        """
        registered, self._registered = self._registered, []
        if self._sender is None or not registered:
            return
        try:
            self._sender.unregister(registered)
        except Exception as exc:  # shutting down: nothing to retry, nothing to raise into
            log.warning("hurray: could not unregister %d chunk buffers from the sender: %s", len(registered), exc)

    def get_transfer_results(self) -> tuple[set[str], set[str]]:
        """The asynchronous loads done since the last call, and those of them that failed; then forgets them."""
        out = (self._received, self._failed)
        self._received, self._failed = set(), set()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed (vLLM applies kv_load_failure_policy).

        vLLM 0.32 cannot map block ids back to requests when a model has
        several KV cache groups, and stops the engine rather than compute on
        blocks that were not written. Such a model's loads are therefore
        always reported per request (:meth:`get_transfer_results`,
        ``config.async_loads``), whatever process the worker runs in: a block
        reported here for it would mean a load the scheduler did not mark
        asynchronous, and fails closed.
        """
        out, self._load_errors = self._load_errors, set()
        if out and len(self._windows) > 1:
            log.error(
                "hurray: a load failed on the worker of a model with several KV cache groups; vLLM stops the engine "
                "rather than compute on unwritten blocks (docs/connector.md, Limitations)"
            )
        return out
