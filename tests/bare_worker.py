"""A HurrayWorker without an engine, over caches a test builds: what the connector's load does to them.

Also a small model to drive it with: two chunks of 2 layers of 2 KV heads,
stored as a producer at any tensor-parallel degree stores them, and a
CPU-packed cache for any rank's heads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import hurray_vllm as hv
from hurray_vllm.chunks.keys import chunks_of, namespace_of
from hurray_vllm.chunks.store import DirectoryStore, store_snapshot
from hurray_vllm.kv.heads import distinct_ranks, rank_heads, select_heads
from hurray_vllm.kv.snapshot import HeadRange

__all__ = [
    "CHUNK",
    "DIM",
    "HEADS",
    "PAGE",
    "bare_worker",
    "cpu_worker",
    "gqa_fingerprint",
    "stored_at_tp",
    "two_chunks",
]

HEADS, DIM, PAGE, CHUNK = 2, 16, 4, 8


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
    w._verified_cap, w._verified_bytes, w._scope = 64, 1 << 30, ""
    w._layer_groups, w._windows, w._load_errors = {}, (), set()
    w._received, w._failed, w._failed_steps, w._steps_in_flight, w._tp = set(), set(), 0, 1, 1
    w.stats = ConnectorStats()
    w._ec = ec
    return w


def gqa_fingerprint(kv_heads: int = HEADS) -> hv.ModelFingerprint:
    """The fingerprint of :func:`stored_at_tp`'s model (or of one with ``kv_heads`` KV heads)."""
    return hv.ModelFingerprint("LlamaForCausalLM", 2, kv_heads, DIM, "bfloat16")


def two_chunks(
    kv_heads: int = HEADS, dim: int = DIM, seed: int = 0, fingerprint: hv.ModelFingerprint | None = None
) -> hv.KVSnapshot:
    """One sequence of 2 chunks (16 tokens), 2 layers of ``kv_heads`` KV heads of ``dim``, random values.

    ``fingerprint``: the snapshot's (default :func:`gqa_fingerprint` of ``kv_heads``): another one makes a
    file whose pools disagree with it.
    """
    n = 2 * CHUNK
    gen = torch.Generator().manual_seed(seed)
    table, ptr, lens = torch.arange(n // PAGE), torch.tensor([0, n // PAGE]), torch.tensor([n])

    def pool() -> torch.Tensor:
        return torch.randn((n // PAGE, PAGE, kv_heads, dim), generator=gen).to(torch.bfloat16)

    return hv.KVSnapshot(
        keys=tuple(hv.BlockPagedTensor(pool(), table, ptr, lens, "key", i) for i in range(2)),
        values=tuple(hv.BlockPagedTensor(pool(), table, ptr, lens, "value", i) for i in range(2)),
        token_ids=(tuple(range(100, 100 + n + 1)),),
        fingerprint=fingerprint or gqa_fingerprint(kv_heads),
        source=hv.SnapshotSource("vllm", "test", PAGE),
        request_ids=("r",),
    )


def _two_chunks() -> hv.KVSnapshot:
    """:func:`two_chunks` of the bare worker's model."""
    return two_chunks()


def stored_at_tp(tmp_path: Path, producer_tp: int) -> tuple[DirectoryStore, str, list[str], hv.KVSnapshot]:
    """Two chunks as a producer at ``producer_tp`` stores them (whole, or one slice per distinct rank).

    Returns ``(store, namespace, chunk keys, the whole snapshot)``.
    """
    snap = _two_chunks()
    store = DirectoryStore(tmp_path / f"tp{producer_tp}")
    if producer_tp == 1:
        store_snapshot(store, snap, CHUNK)
    else:
        for r in distinct_ranks(HEADS, producer_tp):
            store_snapshot(store, select_heads(snap, rank_heads(HEADS, producer_tp, r)), CHUNK)
    assert snap.fingerprint is not None
    keys = [k for k, _ in chunks_of(snap, CHUNK)]
    return store, namespace_of(snap.fingerprint), keys, snap


def cpu_worker(store: DirectoryStore, ns: str, mine: HeadRange | None = None, kv_heads: int = HEADS) -> Any:
    """A consumer's worker for one rank (``mine``: its KV heads) over a CPU cache of its heads, 8 blocks.

    ``kv_heads``: the model's (:func:`gqa_fingerprint`).
    """
    from hurray_vllm.adapters.vllm.cache import EngineCache
    from hurray_vllm.adapters.vllm.layouts import CpuPacked

    h = mine.count if mine is not None else kv_heads
    fp = gqa_fingerprint(kv_heads)
    layout = CpuPacked("vec", DIM)
    ec = EngineCache(
        caches=[torch.zeros((8, h, PAGE, 2 * DIM), dtype=torch.bfloat16) for _ in range(2)],
        layer_names=["l0", "l1"],
        layout=layout,
        layout_name=layout.name,
        storage_dtype=torch.bfloat16,
        model_dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        kv_scales=None,
        fingerprint=fp,
        block_size=PAGE,
        engine="vllm test",
        isa="vec",
    )
    return bare_worker(store, ns, fp, ec, CHUNK, mine)
