"""A HurrayWorker without an engine, over caches a test builds: what the connector's load does to them."""

from __future__ import annotations

from typing import Any

import hurray_vllm as hv
from hurray_vllm.chunks.store import DirectoryStore
from hurray_vllm.kv.snapshot import HeadRange


def bare_worker(
    store: DirectoryStore,
    ns: str,
    fingerprint: hv.ModelFingerprint,
    ec: Any,
    chunk_tokens: int,
    mine: HeadRange | None = None,
) -> Any:
    """A worker loading from ``store`` into ``ec``'s caches (an ``EngineCache``), one KV cache group.

    ``mine``: the KV heads of the tensor-parallel rank it plays (``None``: all of them, TP = 1).
    Needs vLLM importable (the worker module imports its connector API).
    """
    from hurray_vllm.adapters.vllm.connector.metadata import ConnectorStats
    from hurray_vllm.adapters.vllm.connector.worker import HurrayWorker

    w = object.__new__(HurrayWorker)
    w._store, w._ns, w._fingerprint, w._keys = store, ns, fingerprint, None
    w._chunk, w._block_size, w._my_heads = chunk_tokens, ec.block_size, mine
    w._verified_cap, w._verified_bytes = 64, 1 << 30
    w._layer_groups, w._windows, w._load_errors = {}, (), set()
    w.stats = ConnectorStats()
    w._ec = ec
    return w
