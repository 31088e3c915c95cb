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
  server's receiver; every chunk saved here is also pushed there
  (server-to-server migration), by the background writer, in the order the
  steps saved them; so are the chunks a request loaded here, when the
  receiver says it lacks them (a request moved on, A -> B -> C, finds them
  on C). At tensor parallelism > 1 each rank pushes its own slices. A
  failed push is counted (``push_failures``) and pauses pushing for 10 s;
  the destination recomputes what it lacks. Needs ``kv_role``
  ``kv_producer`` or ``kv_both`` (only an engine that saves pushes; only
  ``kv_both`` also loads, and forwards): a ``kv_consumer`` is refused.
* ``hurray_listen``: ``HOST:PORT`` to run a receiver on; chunks it receives
  land, validated, in ``hurray_path``. ``hurray_listen_transport``: ``"tcp"``
  (default) or ``"nixl"`` (page pools arrive as NIXL writes; needs
  ``hurray-vllm[nixl]``). Its limits: ``hurray_listen_quota_mib`` (the most
  the store may hold; a chunk beyond it is refused before it is read),
  ``hurray_listen_min_free_mib`` (free disk space a chunk must leave),
  ``hurray_listen_max_connections`` (default 64),
  ``hurray_listen_max_memory_mib`` (chunks being received, all connections
  together: default 8192), ``hurray_listen_timeout_s`` (one chunk's
  arrival, default 60) and ``hurray_listen_idle_timeout_s`` (default 120).
  These options without ``hurray_listen`` are refused. Engines of one
  process share a receiver only on the same address (not port 0) with the
  same configuration; another configuration on that address is refused.
* ``hurray_chunk_tokens`` (default 256): tokens per chunk. Must be a multiple
  of the block size of every engine sharing the store; engines with
  different block sizes share chunks (a loaded chunk is repaged).
* ``hurray_save_async`` (default ``true``): the step only copies the saved
  blocks out of the cache; a background thread unpacks, checksums and
  writes (and pushes) them (see :meth:`HurrayConnector.wait_for_save`). A
  chunk becomes visible in the store when its file is complete. ``false``
  writes and pushes inside the step.
* ``hurray_push_wait_s`` (default 5): a request whose ``kv_transfer_params``
  carry ``{"hurray_saved_tokens": N}`` (what a source engine answers; pass it
  on with the continuation, as :func:`~hurray_vllm.adapters.vllm.migrate.migrate`
  does) waits for the chunks up to token N to arrive before it is
  scheduled, as long as each next one arrives within this many seconds;
  then it loads what came and recomputes the rest.
* ``hurray_tails`` (default ``true``): the step that ends a prompt's prefill
  also saves its tail, its whole blocks after its last whole chunk, and a
  request whose whole chunks all loaded also loads such a tail: a consumer
  computes at most one block of the prompt, not up to a chunk. Models of one
  KV cache group only (hybrids load whole chunks).
* ``hurray_save_queue_mib`` (default 1024): copied-out blocks waiting for
  the background writer; a step that would exceed it waits for the writer.
* ``hurray_verified_chunks`` (default 256): chunks this process verified
  and keeps, by key, so that loading them again (the next turn of a
  conversation, a shared system prompt) neither parses nor checksums their
  files again while the files are unchanged (same inode, size and times).
  At most an eighth of the process's open-file limit, and never under 64
  (a value of 0 or less is 64).
* ``hurray_verified_mib`` (default 2048): the memory those kept chunks may
  hold (their page pools are read into the process, not mapped); least
  recently used out first. A load's own chunks reach a worker in the
  scheduler's process with the load, whatever was evicted meanwhile.
* ``hurray_key_file`` (or ``$HURRAY_VLLM_KEY_FILE``): the fleet key file, or
  a list of them (the first signs, all are accepted: key rotation). Every
  chunk saved is signed; a chunk loaded or received without a valid MAC
  under one of the keys is refused and recomputed (counted in
  ``chunks_unsigned``, ``chunks_other_key``, ``chunks_bad_mac``). The
  receiver of ``hurray_listen`` refuses them too, and takes connections
  only from senders that authenticate with the key; pushes to
  ``hurray_url`` go only to a receiver that proves it holds the key too
  (one started without it is refused, and the chunks are recomputed
  there). See :mod:`hurray_vllm.chunks.signing` and
  :mod:`hurray_vllm.transport.security`.
* TLS: ``hurray_url`` ``tls://HOST:PORT`` pushes over TLS, verifying the
  receiver against ``hurray_tls_ca`` (default: the system's CAs), with
  ``hurray_tls_cert`` / ``hurray_tls_key`` as client certificate (mutual
  TLS). ``hurray_listen_tls_cert`` / ``hurray_listen_tls_key`` make the
  ``hurray_listen`` receiver (tcp) serve TLS only;
  ``hurray_listen_tls_client_ca`` also requires client certificates.

Layout (as vLLM's own NIXL connector): :class:`HurrayConnector` is a thin
facade. vLLM builds one per role; the scheduler role's holds a
:class:`~.scheduler.HurrayScheduler`, the worker role's a
:class:`~.worker.HurrayWorker`, and each base-class method delegates to the
part of its role. :mod:`.config` reads the ``hurray_*`` keys (bad ones, and
``hurray_*`` keys that are no option, raise
:class:`~hurray_vllm.errors.HurrayArgumentError` naming the key);
:mod:`.metadata` is what the scheduler hands the worker.

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

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ....chunks.store import DirectoryStore, chunk_digest, namespace_of, verify_chunk
from ....transport import require_channel
from ..cache import fingerprint_of, write_blocks
from ..export import export_snapshot
from .config import HurrayConfig
from .metadata import ConnectorStats, HurrayConnectorMetadata, LoadTask, SaveTask, forget_verified_chunks
from .scheduler import HurrayScheduler
from .worker import HurrayWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "ConnectorStats",
    "HurrayConfig",
    "HurrayConnector",
    "HurrayConnectorMetadata",
    "HurrayScheduler",
    "HurrayWorker",
    "LoadTask",
    "SaveTask",
    "forget_verified_chunks",
]

# Names ``scripts/bench_connector.py`` looks up here (it used to wrap them in the single module).
# Wrapping them here no longer reaches the parts: wrap them in ``.worker`` / ``.scheduler``.
_BENCH_NAMES = (chunk_digest, export_snapshot, verify_chunk, write_blocks)

log = logging.getLogger("hurray_vllm.connector")


def _warn_of_failure_policy(vllm_config: VllmConfig, config: HurrayConfig) -> None:
    """Warn, once per engine (its scheduler side), that vLLM's default ``kv_load_failure_policy`` fails requests.

    Under ``"fail"`` a load that fails on a worker (a chunk file pruned since
    the scheduler verified it, no memory for a layer's pages) ends its
    request with an error, where ``"recompute"`` recomputes it.
    """
    policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", None)
    if config.loads and policy == "fail":
        log.warning(
            'hurray: kv_load_failure_policy is "fail": a request whose load fails on a worker ends with an error; '
            'set "kv_load_failure_policy": "recompute" in --kv-transfer-config to recompute it instead'
        )


class HurrayConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector storing KV as Hurray block-paged chunks (see the package docstring).

    A facade: the constructor builds the part of ``role`` and every method
    below delegates to it. Scheduler-side methods run in the engine core's
    scheduling loop (their time is every request's latency); worker-side
    methods run in the model runner around each forward pass. It supports
    vLLM's hybrid KV cache manager (``SupportsHMA``): a sliding-window or
    linear-attention hybrid keeps it on, and chunks carry every group's
    layers (a linear-attention layer's recurrent state goes with the chunk
    that ends where it was taken).
    """

    #: Where vLLM's cache-hit metrics say loaded tokens came from: the chunk store is a directory.
    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = HurrayConfig.from_vllm(vllm_config, kv_cache_config)
        self._config = config
        if config.url_channel:
            require_channel(config.url_channel)  # a missing NIXL surfaces at start, not at the first save
        store = DirectoryStore(config.path)
        fingerprint = fingerprint_of(vllm_config, kv_cache_config=kv_cache_config)
        ns = namespace_of(fingerprint)
        self._scheduler: HurrayScheduler | None = None
        self._worker: HurrayWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            _warn_of_failure_policy(vllm_config, config)
            self._scheduler = HurrayScheduler(config, store, fingerprint, ns)
            self._scheduler.start_receiver()
        else:
            self._worker = HurrayWorker(config, store, fingerprint, ns, vllm_config, kv_cache_config)

    @property
    def stats(self) -> ConnectorStats:
        """This role's counters (scheduler: refused, remembered, quarantined, skipped; worker: the rest)."""
        part = self._scheduler if self._scheduler is not None else self._worker
        assert part is not None
        return part.stats

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache. Read by vLLM's scheduler once, at start.

        A save copies its blocks out of the cache within the step that plans
        it, and ``request_finished`` never holds a request's blocks: a
        preempted request has no hand-off pending, and a save that did not
        happen is a later cache miss. True (the base class's default for
        producers) would make vLLM drop a preempted request's output still in
        flight under asynchronous scheduling, and sample it again.
        """
        return False

    def _sched(self) -> HurrayScheduler:
        assert self._scheduler is not None, "a scheduler-side method called on a worker-role HurrayConnector"
        return self._scheduler

    def _work(self) -> HurrayWorker:
        assert self._worker is not None, "a worker-side method called on a scheduler-role HurrayConnector"
        return self._worker

    def _meta(self) -> HurrayConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HurrayConnectorMetadata)
        return meta

    # ── scheduler side ─────────────────────────────────────────────────────

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler side, when a request is scheduled: tokens loadable beyond ``num_computed_tokens``.

        Walks the chunk keys of the prompt (leaving at least one token to
        compute) and verifies each stored chunk (model, tokens, digest);
        stops at the first missing or refused one. A chunk whose data is
        damaged (a :class:`~hurray_vllm.errors.HurrayFormatError` other than
        another model's fingerprint) is moved aside; nothing else moves a
        file. Blocks on file reads and checksums; a chunk's checksum runs on
        a helper thread while the next chunk file is parsed. Returns
        ``(None, False)`` (vLLM asks again next step) while chunks the
        request's ``kv_transfer_params`` announce are still arriving
        (``hurray_push_wait_s``). The second value is ``False`` (the load
        happens in the step that schedules the request) except for a model of
        several KV cache groups, wherever its workers run (``True``: vLLM's
        asynchronous-load path, so that a load a worker fails fails its
        request alone instead of stopping the engine; the request then waits
        a step).
        """
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Scheduler side, after vLLM allocated blocks: keep the load only if tokens were granted. Never blocks.

        An asynchronous load takes its blocks from here (its request is not
        scheduled in this step).
        """
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def reset_cache(self) -> bool | None:
        """Scheduler side, when vLLM resets its caches with the connector's (before a weight update). Never blocks.

        Returns True: from then on this engine's chunks get keys of their own,
        so it never loads KV saved before the reset, nor saves new KV where
        an engine of the old weights would find it (see
        ``HurrayScheduler.reset_cache``). Nothing in the store is deleted.
        """
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler side, after each step: learn which asynchronous loads failed on a worker. Never blocks.

        With ``kv_load_failure_policy: "recompute"`` vLLM recomputes those
        requests and asks for their matched tokens again: they get none (once
        running again, a later lookup may load). Under vLLM's default,
        ``"fail"``, they end with an error.
        """
        self._sched().update_connector_output(set(connector_output.failed_recving or ()))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Scheduler side, once per step: the loads and saves the worker performs in this step.

        Blocks only on ``stat`` calls (is a chunk to save already stored?).
        """
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler side: forget a finished request; blocks are freed at once. Never blocks.

        vLLM 0.32 calls :meth:`request_finished_all_groups` instead (this class implements ``SupportsHMA``).
        """
        return self._sched().request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler side, once per finished request, whatever the number of KV cache groups (``SupportsHMA``).

        As :meth:`request_finished`: forget it; blocks are freed at once. Never blocks.
        """
        return self._sched().request_finished(request)

    # ── worker side ────────────────────────────────────────────────────────

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker side, once at start: remember the caches and how they are laid out. Never blocks."""
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Worker side, before the forward pass (after it, in a step with only asynchronous loads): write the loads.

        Returns when every block is written; blocks on reading the chunks a
        worker in another process did not get from the scheduler. Every chunk
        is read and verified before the first block is touched; a request
        whose chunks fail leaves its blocks unwritten and is reported: its
        blocks as load errors, or the request itself for an asynchronous load
        (:meth:`get_transfer_results`).
        """
        self._work().start_load_kv(self._meta(), forward_context)

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
        block-paged chunks, checksums and writes them, and with
        ``hurray_url`` pushes each to the destination: the step never waits
        for the network. Blocks only when the copies waiting for that thread
        would exceed ``hurray_save_queue_mib``. Synchronous otherwise: then
        returns once every chunk is in the store and, with ``hurray_url``,
        the receiver acknowledged it or the push failed (logged; the
        destination recomputes what it lacks).
        """
        self._work().wait_for_save(self._meta())

    def flush(self, timeout: float | None = None) -> bool:
        """Worker side, any time: wait until every chunk saved so far is in the store.

        Returns False if ``timeout`` seconds passed first. Called at shutdown
        and at interpreter exit; tests and benchmarks call it before looking
        at the store. The scheduler side saves nothing: True at once.
        """
        return self._worker.flush(timeout) if self._worker is not None else True

    def shutdown(self) -> None:
        """Either side, when vLLM shuts down: the worker finishes its background saves (up to a minute).

        The scheduler side stops its ``hurray_listen`` receiver, unless another engine of the process
        shares it.
        """
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Worker side, after each step: the asynchronous loads that ended, and those that failed. Never blocks.

        Only a model of several KV cache groups loads asynchronously (see
        :meth:`get_num_new_matched_tokens`). Its loads end in the step that
        hands them to the worker; a failed one (a chunk file gone since the
        scheduler verified it, no memory for a layer's pages) is in both
        sets, and vLLM recomputes it. No
        request is ever reported as sending: every save copied its blocks
        out within its step.
        """
        received, failed = self._work().get_transfer_results()
        return KVConnectorTransferResults(finished_recving=received, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker side, after a step: blocks whose load failed (vLLM applies kv_load_failure_policy). Never blocks."""
        return self._work().get_block_ids_with_load_errors()
