"""Snapshots of live requests in an in-process ``vllm.LLM``.

Drive the engine step by step (``llm.llm_engine.add_request(...)``,
``llm.llm_engine.step()``) and call :func:`snapshot` between steps: the
engine is single-threaded in-process, so between two ``step()`` calls no
forward pass is writing the cache and the snapshot is consistent.

Requires ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core in this
process). For engines in other processes or servers, use the KV connector.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ... import dtypes
from ...errors import HurrayFormatError
from ...snapshot import KVSnapshot, ModelFingerprint, SnapshotSource
from .export import SequenceState, export_snapshot, export_stream
from .layouts import CpuPacked, KVLayout, LogicalBHNC

__all__ = ["snapshot", "snapshot_stream", "EngineCache", "engine_cache", "request_states"]

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class EngineCache:
    """The worker-side facts an export needs: caches, their layout and dtype."""

    caches: list[torch.Tensor]
    layout: KVLayout
    layout_name: str
    storage_dtype: torch.dtype
    kv_scales: list[tuple[float, float]] | None
    fingerprint: ModelFingerprint
    block_size: int
    engine: str


def _core(llm: Any) -> Any:
    try:
        return llm.llm_engine.engine_core.engine_core
    except AttributeError:
        raise HurrayFormatError(
            "engine",
            "the engine core is not in this process; start vLLM with VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "or export through HurrayConnector",
        ) from None


def _weights_digest(model: torch.nn.Module) -> str:
    """A cheap digest of the weights: name, shape, dtype and the first 64 KiB of each tensor."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in sorted(model.state_dict().items()):
        t = p.detach()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.reshape(-1)[: max(1, 65536 // max(1, t.element_size()))].contiguous().cpu()
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _worker_facts(worker: Any) -> dict[str, Any]:
    """Runs on the worker (in-process: same objects, no copies)."""
    runner = worker.model_runner
    ctx = worker.vllm_config.compilation_config.static_forward_context
    layers = [m for m in ctx.values() if hasattr(m, "kv_cache") and hasattr(m, "impl")]
    return {
        "caches": list(runner.kv_caches),
        "backend": type(layers[0].impl).__name__ if layers else "",
        "isa": [getattr(m, "isa", None) for m in layers],
        "kv_cache_dtype": [getattr(m, "kv_cache_dtype", "auto") for m in layers],
        "scales": [
            (float(getattr(m, "_k_scale_float", 1.0)), float(getattr(m, "_v_scale_float", 1.0))) for m in layers
        ],
        "digest": _weights_digest(runner.model),
    }


def engine_cache(llm: Any) -> EngineCache:
    """Describe the KV cache of an in-process ``vllm.LLM``."""
    core = _core(llm)
    cfg = core.vllm_config
    facts = llm.collective_rpc(_worker_facts)[0]
    hf = cfg.model_config.hf_config
    head_dim = cfg.model_config.get_head_size()
    num_kv_heads = cfg.model_config.get_total_num_kv_heads()
    cache_dtype = cfg.cache_config.cache_dtype
    model_dtype = cfg.model_config.dtype
    storage = _FP8.get(cache_dtype, model_dtype)
    if cache_dtype not in _FP8 and cache_dtype != "auto":
        raise HurrayFormatError("kv_cache_dtype", f"kv_cache_dtype {cache_dtype!r} is not supported for export")
    if facts["backend"].startswith("CPU"):
        isas = set(facts["isa"])
        if len(isas) != 1:
            raise HurrayFormatError("isa", f"layers use different CPU ISAs {sorted(map(str, isas))}")
        isa = isas.pop()
        layout: KVLayout = CpuPacked(isa, head_dim)
        layout_name = f"vllm-cpu-{isa}"
    else:
        layout = LogicalBHNC(head_dim)
        layout_name = f"vllm-{cfg.cache_config.kv_cache_layout or 'NHD'}"
    version = getattr(__import__("vllm"), "__version__", "?")
    return EngineCache(
        caches=facts["caches"],
        layout=layout,
        layout_name=layout_name,
        storage_dtype=storage,
        kv_scales=facts["scales"] if cache_dtype in _FP8 else None,
        fingerprint=ModelFingerprint(
            architecture=(hf.architectures or [type(hf).__name__])[0],
            num_layers=len(facts["caches"]),
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtypes.from_torch(storage).name,
            weights_digest=facts["digest"],
        ),
        block_size=cfg.cache_config.block_size,
        engine=f"vllm {version}",
    )


def _internal_id(llm: Any, core: Any, request_id: str) -> str:
    requests = core.scheduler.requests
    if request_id in requests:
        return request_id
    internal = llm.llm_engine.output_processor.external_req_ids.get(request_id, [])
    live = [i for i in internal if i in requests]
    if not live:
        raise HurrayFormatError(
            "request_id", f"no live request {request_id!r} in the engine (unknown, or already finished and freed)"
        )
    if len(live) > 1:
        raise HurrayFormatError("request_id", f"{request_id!r} names {len(live)} requests (n > 1 sampling)")
    return live[0]


def request_states(llm: Any, request_ids: Sequence[str]) -> list[SequenceState]:
    """Block ids, computed tokens and token ids of live requests (scheduler side)."""
    core = _core(llm)
    sched = core.scheduler
    out = []
    for rid in request_ids:
        internal = _internal_id(llm, core, rid)
        req = sched.requests[internal]
        if req.is_finished():
            raise HurrayFormatError("request_id", f"request {rid!r} has finished; its blocks may be reused")
        groups = sched.kv_cache_manager.get_block_ids(internal)
        if len(groups) != 1:
            raise HurrayFormatError(
                "kv_cache_groups", f"{len(groups)} KV cache groups (hybrid models) are not supported"
            )
        out.append(SequenceState(rid, list(groups[0]), int(req.num_computed_tokens), list(req.all_token_ids)))
    return out


def snapshot(llm: Any, request_ids: Sequence[str]) -> KVSnapshot:
    """Export the KV of live requests of an in-process ``vllm.LLM``.

    Args:
        llm: a ``vllm.LLM`` created with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
        request_ids: the ids given to ``llm.llm_engine.add_request``.

    Returns:
        A snapshot holding every computed token of each request (including a
        partly filled last block), their token ids (prompt and generated;
        the last sampled token has no KV yet), the model fingerprint, and
        the fp8 scales of an fp8 cache.

    Call it between ``llm.llm_engine.step()`` calls. Raises
    :class:`HurrayFormatError` for an unknown or finished request.
    """
    ec = engine_cache(llm)
    seqs = request_states(llm, request_ids)
    return export_snapshot(
        ec.caches,
        ec.layout,
        seqs,
        block_size=ec.block_size,
        storage_dtype=ec.storage_dtype,
        kv_scales=ec.kv_scales,
        fingerprint=ec.fingerprint,
        source=SnapshotSource(ec.engine, ec.layout_name, ec.block_size),
    )


def snapshot_stream(llm: Any, request_ids: Sequence[str], f: BinaryIO) -> int:
    """Like :func:`snapshot`, written to ``f`` layer by layer (memory: one layer's pages)."""
    ec = engine_cache(llm)
    seqs = request_states(llm, request_ids)
    return export_stream(
        f,
        ec.caches,
        ec.layout,
        seqs,
        block_size=ec.block_size,
        storage_dtype=ec.storage_dtype,
        kv_scales=ec.kv_scales,
        fingerprint=ec.fingerprint,
        source=SnapshotSource(ec.engine, ec.layout_name, ec.block_size),
    )
