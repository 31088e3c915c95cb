"""The in-memory KV model: :class:`~.paged.BlockPagedTensor`, :class:`~.snapshot.KVSnapshot`, repaging.

Imports only :mod:`hurray_vllm.wire` (and :mod:`hurray_vllm.errors`).
"""

__all__: list[str] = []  # the modules are the API: import from them
