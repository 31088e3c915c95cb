"""Moving chunks between processes: :mod:`.tcp` (plain TCP) and :mod:`.nixl` (NIXL / UCX).

In 0.1 ``hurray_vllm.transport`` was the TCP module; its names
(``Receiver``, ``send_chunks``, ``parse_url``) still resolve here, with a
``DeprecationWarning``, until 0.3: import them from :mod:`.tcp`.
"""

from __future__ import annotations

import warnings

__all__: list[str] = []

_TCP_NAMES = ("Receiver", "send_chunks", "parse_url", "MAGIC", "MAX_CHUNK_BYTES")


def __getattr__(name: str) -> object:
    if name in _TCP_NAMES:
        from . import tcp

        warnings.warn(
            f"hurray_vllm.transport.{name} moved to hurray_vllm.transport.tcp.{name} (the old name goes in 0.3)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(tcp, name)
    raise AttributeError(f"module 'hurray_vllm.transport' has no attribute {name!r}")
