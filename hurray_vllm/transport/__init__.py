"""Moving chunks between processes: one channel per module, chosen by URL scheme.

Channels: :mod:`.tcp` (``tcp://HOST:PORT``, Hurray streams over a socket;
``tls://HOST:PORT`` the same inside TLS) and :mod:`.nixl`
(``nixl://HOST:PORT``, page pools written by NIXL / UCX). :mod:`.security`
holds what they share for trust: TLS contexts and sender authentication.
Each has a :class:`~.base.ChunkSender` and a :class:`~.base.ReceiverBase`;
the functions here pick one by name, so callers (the connector, the CLI)
never branch on the channel themselves.

Example:
    >>> from hurray_vllm import transport
    >>> transport.channel_of("tcp://10.0.0.2:7070")
    'tcp'
    >>> transport.channel_of("nixl://10.0.0.2:7070")
    'nixl'
    >>> transport.channel_of("tls://10.0.0.2:7070")  # the TCP channel, inside TLS
    'tcp'

In 0.1 ``hurray_vllm.transport`` was the TCP module; its names
(``Receiver``, ``parse_url``, ``MAGIC``, ``MAX_CHUNK_BYTES``) still resolve
here, with a ``DeprecationWarning``, until 0.3: import them from :mod:`.tcp`.
"""

from __future__ import annotations

import ssl
import warnings
from collections.abc import Iterable
from typing import Any

from ..chunks.signing import FleetKeys
from ..chunks.store import ChunkStore
from ..errors import HurrayArgumentError, HurrayFormatError
from .base import DEFAULT_TIMEOUT_S, Chunk, ChunkSender, ReceiverBase, check_timeout, parse_address

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
#: URL schemes, and the channel each names: ``tls://`` is the TCP channel inside TLS.
SCHEMES = {"tcp": "tcp", "tls": "tcp", "nixl": "nixl"}


def channel_of(url: str) -> str:
    """The channel ``url`` names (``"tcp"`` for ``tcp://`` and ``tls://``, or ``"nixl"``), after checking it.

    Raises:
        HurrayFormatError: an unknown scheme or a malformed address (the field is ``hurray_url``).
    """
    if not isinstance(url, str):  # a missing setting (None) from a config: the same error as a malformed URL
        raise HurrayFormatError("hurray_url", f"a transport URL must be a string, got {type(url).__name__}")
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme in SCHEMES:
        parse_address(url, scheme)  # NIXL itself is not loaded to check a nixl:// URL
    else:
        raise HurrayFormatError(
            "hurray_url",
            f"unknown transport {scheme!r} in {url!r}; expected tcp://HOST:PORT, tls://HOST:PORT or nixl://HOST:PORT",
        )
    return SCHEMES[scheme]


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


def sender_for(url: str, *, tls: ssl.SSLContext | None = None) -> ChunkSender:
    """A sender for ``url``'s channel: a new TCP sender (over ``tls`` for ``tls://``), or the shared NIXL sender.

    Each call gets its own TCP sender (they are cheap). The NIXL sender is one per process (its agents
    are costly), shared by every engine in it: a caller that may give up on its pushes passes itself as
    ``owner`` to :meth:`~.base.ChunkSender.send` and ``held``, and calls ``abort(owner)``, which cuts
    only its own calls; one engine giving up on its push must not cut another engine's in the same
    process. ``abort()`` without an owner cuts every call in progress on the sender.

    Creating the NIXL sender starts its agents (UCX, ~0.4 s): call this at
    start-up, not inside a step. ``tls``: the client context
    (:func:`.security.client_context`; default: the system's CAs).

    Raises:
        HurrayFormatError: ``url`` names no known channel (see :func:`channel_of`).
        NixlUnavailableError: a ``nixl://`` URL without NIXL installed.
    """
    if channel_of(url) == "nixl":
        from . import nixl

        return nixl.default_sender()
    from .tcp import TcpSender

    if tls is not None or url.startswith("tls://"):
        from .security import client_context

        return TcpSender(tls or client_context())
    return TcpSender()


def send_chunks(
    url: str,
    chunks: Iterable[Chunk],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    keys: FleetKeys | None = None,
    tls: ssl.SSLContext | None = None,
) -> None:
    """Push ``(namespace, key, snapshot)`` chunks to the receiver at ``url`` (any channel).

    Returns once every chunk is stored there; ``chunks`` is consumed lazily.
    ``keys``: the fleet key: sender and receiver each prove they hold it
    before any chunk goes (a keyed receiver refuses a sender without it; a
    keyed sender refuses a receiver without it, or one that is not the
    receiver asked for). ``tls``: see :func:`sender_for`.

    Raises:
        HurrayFormatError: the receiver refused a chunk or the sender, or ``url`` is malformed.
        OSError: the receiver cannot be reached, or a transfer failed or timed out
            (``ssl.SSLError``: its certificate is not trusted).
        HurrayArgumentError: (field ``timeout``) not positive seconds below :data:`~.base.MAX_TIMEOUT_S`.
    """
    timeout = check_timeout(timeout)  # before a NIXL sender's agents start
    sender_for(url, tls=tls).send(url, chunks, timeout=timeout, keys=keys)


def receiver_for(channel: str, host: str, port: int, store: ChunkStore, **options: Any) -> ReceiverBase:
    """A receiver of ``channel`` listening on ``host:port`` (not started: call ``.start()``).

    ``options`` go to the channel's receiver (``timeout``, ``idle_timeout``,
    ``max_chunk_bytes``, the limits, ``keys``; TCP also takes ``tls``, NIXL
    ``max_arena_bytes`` and ``backend_params``).

    Raises:
        HurrayArgumentError: an unknown channel name, a ``port`` outside
            0..65535, an option out of range (named as the option).
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
