"""``HurrayConnector``: a vLLM KV connector that saves and loads Hurray chunks.

Enable it with::

    --kv-transfer-config '{"kv_connector": "HurrayConnector",
      "kv_connector_module_path": "hurray_vllm.adapters.vllm.connector",
      "kv_role": "kv_both",
      "kv_connector_extra_config": {"hurray_path": "/var/cache/hurray"}}'

Extra config:

* ``hurray_path`` (required): directory of the chunk store (see
  :mod:`hurray_vllm.store`). Producers write there, consumers read there.
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

``kv_role`` is honoured: ``kv_producer`` only saves, ``kv_consumer`` only
loads, ``kv_both`` does both.

What it does:

* **Save** (producer): whenever a request's computed tokens complete a
  chunk (prompt or generated tokens), the worker exports that chunk after
  the forward pass (:meth:`wait_for_save`) unless the store has it.
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
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ...errors import HurrayFormatError
from ...repage import repage_snapshot
from ...snapshot import KVSnapshot, SnapshotSource
from ...store import DIGEST_KEY, DirectoryStore, chunk_digest, chunk_keys, namespace_of, verify_chunk
from ...transport import Receiver, parse_url, send_chunks
from .cache import EngineCache, attention_layers, describe_worker_cache, fingerprint_of, write_blocks
from .export import SequenceState, export_snapshot

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["HurrayConnector", "HurrayConnectorMetadata", "ConnectorStats"]

log = logging.getLogger("hurray_vllm.connector")

#: Chunks the scheduler verified, handed to a worker in the same process so it
#: does not read them twice (the scheduler and a uniprocess worker share it).
_VERIFIED: dict[str, KVSnapshot] = {}
_VERIFIED_LOCK = threading.Lock()
_VERIFIED_MAX = 64
_RECEIVERS: dict[str, Any] = {}  # transport.Receiver or transport_nixl.NixlReceiver


@dataclass
class LoadTask:
    request_id: str
    keys: list[str]
    tokens: list[list[int]]  # per chunk
    block_ids: list[int]  # engine blocks to fill, chunk after chunk


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


@dataclass
class _Request:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    chunks_done: int = 0  # chunks known to be in the store (saved or loaded)
    load: LoadTask | None = None


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
        self._block_size = vllm_config.cache_config.block_size
        self._chunk = int(cfg.get_from_extra_config("hurray_chunk_tokens", 256))
        if self._chunk % self._block_size:
            raise HurrayFormatError(
                "hurray_chunk_tokens", f"{self._chunk} is not a multiple of the engine's block size {self._block_size}"
            )
        if self._url and str(self._url).startswith("nixl://"):
            from ...transport_nixl import load_nixl, parse_nixl_url

            parse_nixl_url(self._url)
            load_nixl()  # a missing NIXL surfaces at start, not at the first save
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
        listen = cfg.get_from_extra_config("hurray_listen", None)
        if listen and role == KVConnectorRole.SCHEDULER and listen not in _RECEIVERS:
            host, _, port = str(listen).rpartition(":")
            if cfg.get_from_extra_config("hurray_listen_transport", "tcp") == "nixl":
                from ...transport_nixl import NixlReceiver

                _RECEIVERS[listen] = NixlReceiver(host or "127.0.0.1", int(port), self._store).start()
            else:
                _RECEIVERS[listen] = Receiver(host or "127.0.0.1", int(port), self._store).start()
            log.info("hurray: receiving chunks on %s into %s", listen, path)

    # ── scheduler side ─────────────────────────────────────────────────────

    def _verified(self, key: str, tokens: list[int]) -> KVSnapshot | None:
        with _VERIFIED_LOCK:
            snap = _VERIFIED.get(key)
        if snap is not None:
            return snap
        try:
            snap = self._store.get(self._ns, key)
            verify_chunk(snap, self._fingerprint, tokens)
        except (HurrayFormatError, OSError) as exc:
            self.stats.chunks_refused += 1
            log.warning("hurray: refusing chunk %s (%s); recomputing instead", key, exc)
            return None
        with _VERIFIED_LOCK:
            # Bounded: a worker in another process never collects these.
            while len(_VERIFIED) >= _VERIFIED_MAX:
                _VERIFIED.pop(next(iter(_VERIFIED)))
            _VERIFIED[key] = snap
        return snap

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler side, when a request is scheduled: tokens loadable beyond ``num_computed_tokens``.

        Walks the chunk keys of the prompt (leaving at least one token to
        compute) and verifies each stored chunk (model, tokens, digest);
        stops at the first missing or refused one. Blocks on file reads.
        """
        if not self._loads:
            return 0, False
        tokens = list(request.all_token_ids)
        usable = (len(tokens) - 1) // self._chunk * self._chunk
        keys = chunk_keys(tokens[:usable], self._chunk, self._ns)
        state = self._reqs.setdefault(request.request_id, _Request(request))
        first = num_computed_tokens // self._chunk
        hit = first
        chunk_tokens = []
        for i in range(first, len(keys)):
            if not self._store.has(self._ns, keys[i]):
                break
            toks = tokens[i * self._chunk : (i + 1) * self._chunk]
            if self._verified(keys[i], toks) is None:
                break
            chunk_tokens.append(toks)
            hit = i + 1
        matched = hit * self._chunk - num_computed_tokens
        if matched <= 0 or num_computed_tokens % self._chunk:
            return 0, False
        state.load = LoadTask(request.request_id, keys[first:hit], chunk_tokens, [])
        return matched, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Scheduler side, after vLLM allocated blocks: keep the load only if tokens were granted."""
        state = self._reqs.get(request.request_id)
        if state is not None and num_external_tokens == 0 and state.load is not None:
            with _VERIFIED_LOCK:
                for key in state.load.keys:
                    _VERIFIED.pop(key, None)
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
                chunks = [self._chunk_for_load(key, toks) for key, toks in zip(task.keys, task.tokens)]
            except (HurrayFormatError, OSError) as exc:
                log.warning("hurray: load of %s failed (%s); its blocks will be recomputed", task.request_id, exc)
                self._load_errors.update(task.block_ids)
                continue
            ids = torch.tensor(task.block_ids, dtype=torch.int64)
            for layer in range(ec.num_layers):
                kv = [self._dense(c, layer) for c in chunks]
                k, v = torch.cat([x for x, _ in kv]), torch.cat([y for _, y in kv])
                shape = (len(task.block_ids), ec.block_size, k.shape[1], k.shape[2])
                write_blocks(ec, layer, ids, k.reshape(shape), v.reshape(shape))
            self.stats.chunks_loaded += len(chunks)
            self.stats.tokens_loaded += len(chunks) * self._chunk

    def _chunk_for_load(self, key: str, tokens: list[int]) -> KVSnapshot:
        with _VERIFIED_LOCK:
            snap = _VERIFIED.pop(key, None)
        if snap is None:
            snap = self._store.get(self._ns, key)
            verify_chunk(snap, self._fingerprint, tokens)
        if snap.page_size != self._block_size:
            snap = repage_snapshot(snap, self._block_size)
        return snap

    @staticmethod
    def _dense(chunk: KVSnapshot, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk's real-valued K and V of ``layer`` (fp8 chunks dequantized with their own scales)."""
        k, v = chunk[layer, "key"].to_dense(0), chunk[layer, "value"].to_dense(0)
        if chunk.kv_scales is None:
            return k, v
        ks, vs = chunk.kv_scales[layer]
        return k.float() * ks, v.float() * vs

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker side, per layer: nothing to wait for, :meth:`start_load_kv` is synchronous."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Worker side, per layer during the forward pass: nothing.

        Chunks are exported whole, all layers at once, in :meth:`wait_for_save`.
        """
        return

    def wait_for_save(self) -> None:
        """Worker side, after the forward pass: export this step's completed chunks.

        Blocks until every chunk is in the store and, with ``hurray_url``,
        until the receiver acknowledged it or the push failed (logged; the
        destination then recomputes what it lacks).
        """
        meta = self._get_connector_metadata()
        assert isinstance(meta, HurrayConnectorMetadata)
        if not meta.saves:
            return
        ec = self._engine_cache()
        pushed = []
        for task in meta.saves:
            if self._store.has(self._ns, task.key):
                self.stats.chunks_skipped += 1
                if self._url and task.key not in self._pushed:
                    try:
                        pushed.append((self._ns, task.key, self._store.get(self._ns, task.key)))
                    except HurrayFormatError as exc:
                        log.warning("hurray: not pushing unreadable chunk %s: %s", task.key, exc)
                continue
            snap = export_snapshot(
                ec.caches,
                ec.layout,
                [SequenceState(task.request_id, task.block_ids, len(task.tokens), task.tokens)],
                block_size=ec.block_size,
                storage_dtype=ec.storage_dtype,
                kv_scales=ec.kv_scales,
                fingerprint=ec.fingerprint,
                source=SnapshotSource(ec.engine, ec.layout_name, ec.block_size),
            )
            snap = replace(snap, extra={DIGEST_KEY: chunk_digest(snap)})
            if self._store.put(self._ns, task.key, snap):
                self.stats.chunks_saved += 1
                self.stats.bytes_saved += snap.nbytes
            pushed.append((self._ns, task.key, snap))
        if self._url and pushed:
            try:
                if str(self._url).startswith("nixl://"):
                    from ...transport_nixl import send_chunks_nixl

                    send_chunks_nixl(self._url, pushed)
                else:
                    send_chunks(self._url, pushed)
                self._pushed.update(key for _, key, _ in pushed)
            except (OSError, HurrayFormatError) as exc:
                # The destination recomputes what it lacks; this engine's step goes on.
                log.warning("hurray: could not push %d chunks to %s: %s", len(pushed), self._url, exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker side, after a step: blocks whose load failed (vLLM applies kv_load_failure_policy)."""
        out, self._load_errors = self._load_errors, set()
        return out
