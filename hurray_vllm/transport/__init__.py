"""Moving chunks between processes: one channel per module, chosen by URL scheme.

Channels: :mod:`.tcp` (``tcp://HOST:PORT``, Hurray streams over a socket)
and :mod:`.nixl` (``nixl://HOST:PORT``, page pools written by NIXL / UCX).
Each has a :class:`~.base.ChunkSender` and a :class:`~.base.ReceiverBase`;
the functions here pick one by name, so callers (the connector, the CLI)
never branch on the channel themselves.

Example:
    >>> from hurray_vllm import transport
    >>> transport.channel_of("tcp://10.0.0.2:7070")
    'tcp'
    >>> transport.channel_of("nixl://10.0.0.2:7070")
    'nixl'

In 0.1 ``hurray_vllm.transport`` was the TCP module; its names
(``Receiver``, ``parse_url``, ``MAGIC``, ``MAX_CHUNK_BYTES``) still resolve
here, with a ``DeprecationWarning``, until 0.3: import them from :mod:`.tcp`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

from ..chunks.store import ChunkStore
from ..errors import HurrayArgumentError, HurrayFormatError
from .base import DEFAULT_TIMEOUT_S, Chunk, ChunkSender, ReceiverBase, parse_address

__all__ = [
    "CHANNELS",
    "ChunkSender",
    "ReceiverBase",
    "channel_of",
    "require_channel",
    "sender_for",
    "receiver_for",
    "send_chunks",
]

#: Every channel, by the name its URLs start with (``hurray-vllm receive --transport`` takes these).
CHANNELS = ("tcp", "nixl")


def channel_of(url: str) -> str:
    """The channel ``url`` names (``"tcp"`` or ``"nixl"``), after checking it is ``SCHEME://HOST:PORT``.

    Raises:
        HurrayFormatError: an unknown scheme or a malformed address (the field is ``hurray_url``).
    """
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme in CHANNELS:
        parse_address(url, scheme)  # NIXL itself is not loaded to check a nixl:// URL
    else:
        raise HurrayFormatError(
            "hurray_url", f"unknown transport {scheme!r} in {url!r}; expected tcp://HOST:PORT or nixl://HOST:PORT"
        )
    return scheme


def _check(channel: str) -> None:
    if channel not in CHANNELS:
        raise HurrayArgumentError("transport", f"unknown transport {channel!r}; expected one of {', '.join(CHANNELS)}")


def require_channel(channel: str) -> None:
    """Fail now, with the install command, when ``channel`` needs a library this machine lacks.

    Raises:
        HurrayArgumentError: an unknown channel name.
        NixlUnavailableError: ``"nixl"`` without NIXL installed (an ``ImportError``).
    """
    _check(channel)
    if channel == "nixl":
        from .nixl import load_nixl

        load_nixl()


_TCP_SENDER: ChunkSender | None = None


def sender_for(url: str) -> ChunkSender:
    """The sender for ``url``'s channel: a stateless TCP sender, or the process's shared NIXL sender.

    Creating the NIXL sender starts its agents (UCX, ~0.4 s): call this at
    start-up, not inside a step.

    Raises:
        HurrayFormatError: ``url`` names no known channel (see :func:`channel_of`).
        NixlUnavailableError: a ``nixl://`` URL without NIXL installed.
    """
    global _TCP_SENDER
    if channel_of(url) == "nixl":
        from . import nixl

        return nixl.default_sender()
    if _TCP_SENDER is None:
        from .tcp import TcpSender

        _TCP_SENDER = TcpSender()
    return _TCP_SENDER


def send_chunks(url: str, chunks: Iterable[Chunk], *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Push ``(namespace, key, snapshot)`` chunks to the receiver at ``url`` (any channel).

    Returns once every chunk is stored there; ``chunks`` is consumed lazily.

    Raises:
        HurrayFormatError: the receiver refused a chunk, or ``url`` is malformed.
        OSError: the receiver cannot be reached, or a transfer failed or timed out.
    """
    sender_for(url).send(url, chunks, timeout=timeout)


def receiver_for(channel: str, host: str, port: int, store: ChunkStore, **options: Any) -> ReceiverBase:
    """A receiver of ``channel`` listening on ``host:port`` (not started: call ``.start()``).

    ``options`` go to the channel's receiver (``timeout``, ``idle_timeout``,
    ``max_chunk_bytes``; NIXL also takes ``max_arena_bytes``,
    ``backend_params``).

    Raises:
        HurrayArgumentError: an unknown channel name.
        NixlUnavailableError: ``"nixl"`` without NIXL installed.
        OSError: the address cannot be bound.
    """
    _check(channel)
    if channel == "nixl":
        from .nixl import NixlReceiver

        return NixlReceiver(host, port, store, **options)
    from .tcp import Receiver

    return Receiver(host, port, store, **options)


_TCP_NAMES = ("Receiver", "parse_url", "MAGIC", "MAX_CHUNK_BYTES")


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
