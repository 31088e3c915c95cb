"""vLLM adapter: export live requests' KV caches; import and migrate them through the KV connector.

Tensor-level layouts and the exporter need no vLLM; :func:`snapshot` needs an
in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

from .cache import EngineCache, describe_worker_cache, write_blocks
from .export import (
    SequenceState,
    export_layers,
    export_snapshot,
    export_stream,
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
    "KVLayout",
    "LogicalBHNC",
    "PagedAttentionLegacy",
    "SequenceState",
    "export_layers",
    "export_snapshot",
    "export_stream",
    "layer_view_from_buffer",
    "release_export_workspace",
    "snapshot",
    "snapshot_ranks",
    "snapshot_stream",
]


#: Names 0.1 exported here that are the exporter's internals; they stay reachable, with a warning, until 0.3.
_INTERNAL = ("GatherBuffers", "plan_batch")


def __getattr__(name: str) -> object:
    # The engine entry points import vLLM; keep `import hurray_vllm.adapters.vllm` light.
    if name in ("snapshot", "snapshot_ranks", "snapshot_stream"):
        from . import engine

        return getattr(engine, name)
    if name in _INTERNAL:
        import warnings

        from . import export

        warnings.warn(
            f"hurray_vllm.adapters.vllm.{name} is internal; import it from hurray_vllm.adapters.vllm.export "
            "(the package-level name goes in 0.3)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(export, name)
    raise AttributeError(name)
