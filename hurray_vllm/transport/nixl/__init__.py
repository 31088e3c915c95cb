"""The NIXL channel: KV chunks moved between processes with NIXL (UCX underneath).

The same contract as :mod:`hurray_vllm.transport.tcp` (``send_chunks`` /
``Receiver``), but the page pools do not travel through Python or a socket
stream: the sender WRITEs them with NIXL, straight from its own page buffers
into buffers the receiver registered for them. Only the small things go over
a TCP side channel: the Hurray descriptors of every record, token ids, block
tables and the metadata (model fingerprint, chunk digest).

One side-channel connection carries any number of chunks. Per chunk::

    sender                                          receiver
    OFFER  b"HVN1" u64 len | ns, key, records  -->  validate every descriptor, bound the sizes,
           (descriptor + inline buffers; a            take destination buffers from a registered arena,
           page pool is only announced)               assemble the snapshot (validated as any input)
                                               <--  b"RD" xfer id, agent name + metadata, one address
                                                    per announced page pool   (or b"ER" + message)
    NIXL WRITE of every page pool, several in flight,
    each carrying a notification "hvn1:<id>:<i>" -->  hashes pools in digest order as they land
    b"GO"  (every write completed locally)     -->  all notifications + GO: check the chunk digest,
                                                    store the chunk
                                               <--  b"OK"  or  b"ER" + u16 length + message

Between chunks, the side channel also answers which chunks the receiver
holds (``b"HVH1"``, :func:`~hurray_vllm.transport.base.query_held`).

Nothing is stored unless every byte arrived and matches the chunk digest. A
sender that disconnects (or dies) before ``GO``, a sender that sends
``b"AB"``, and a transfer that exceeds the receiver's timeout abort the
chunk: nothing is stored, the connection is closed, and the destination
buffers are quarantined (not reused for a while) so that a straggling write
cannot land in a later chunk. Every wait has a timeout.

NIXL is optional: it is imported when a sender or receiver is created, and
its absence raises :class:`NixlUnavailableError` (an ``ImportError``) that
says ``pip install 'hurray-vllm[nixl]'``.

Modules: :mod:`.agent` (loading NIXL, starting agents), :mod:`.offer` (the
side channel's offer codec), :mod:`.sender`, :mod:`.receiver`.
"""

from __future__ import annotations

from ..base import MAX_CHUNK_BYTES
from .agent import ERROR_HANDLING_ENV, INSTALL_HINT, NixlError, NixlUnavailableError, load_nixl, make_agent
from .offer import MAGIC, MAX_OFFER_BYTES, MAX_RECORDS, parse_nixl_url
from .receiver import DEFAULT_ARENA_BYTES, NixlReceiver
from .sender import DEFAULT_LANES, NixlSender, TransferStats, default_sender, send_chunks_nixl

__all__ = [
    "NixlReceiver",
    "NixlSender",
    "NixlError",
    "NixlUnavailableError",
    "TransferStats",
    "send_chunks_nixl",
    "default_sender",
    "parse_nixl_url",
    "load_nixl",
    "make_agent",
    "INSTALL_HINT",
    "ERROR_HANDLING_ENV",
    "MAGIC",
    "MAX_OFFER_BYTES",
    "MAX_RECORDS",
    "MAX_CHUNK_BYTES",
    "DEFAULT_ARENA_BYTES",
    "DEFAULT_LANES",
]
