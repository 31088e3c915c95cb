"""vLLM adapter: export live requests' KV caches; import and migrate them through the KV connector.

Tensor-level layouts and the exporter need no vLLM; :func:`snapshot` needs an
in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

from .cache import EngineCache, describe_worker_cache, write_blocks
from .export import (
    GatherBuffers,
    SequenceState,
    export_layers,
    export_snapshot,
    export_stream,
    plan_batch,
    release_export_workspace,
)
from .layouts import (
    CpuPacked,
    FlashAttnLegacy,
    FlashInferLegacy,
    KVLayout,
    LogicalBHNC,
    PagedAttentionLegacy,
    layer_view_from_buffer,
)

__all__ = [
    "CpuPacked",
    "EngineCache",
    "describe_worker_cache",
    "write_blocks",
    "FlashAttnLegacy",
    "FlashInferLegacy",
    "GatherBuffers",
    "KVLayout",
    "LogicalBHNC",
    "PagedAttentionLegacy",
    "SequenceState",
    "export_layers",
    "export_snapshot",
    "export_stream",
    "layer_view_from_buffer",
    "plan_batch",
    "release_export_workspace",
    "snapshot",
    "snapshot_stream",
]


def __getattr__(name: str) -> object:
    # The engine entry points import vLLM; keep `import hurray_vllm.adapters.vllm` light.
    if name in ("snapshot", "snapshot_stream"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(name)
