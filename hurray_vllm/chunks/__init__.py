"""The chunk store: content-addressed KV chunks of a prefix, their integrity, and cleanup.

* :mod:`.keys`: chunk keys and model namespaces, and cutting a snapshot into chunks;
* :mod:`.digest`: the checksum a chunk carries;
* :mod:`.signing`: fleet keys and the MAC a signed chunk carries;
* :mod:`.verify`: the checks a consumer runs before using a chunk;
* :mod:`.store`: the :class:`ChunkStore` protocol and :class:`DirectoryStore`;
* :mod:`.prune`: cleanup by size;
* :mod:`.fsck`: checking every chunk file of a store.
"""

from .digest import DIGEST_KEY, DIGEST_MISMATCH, ChunkDigest, chunk_digest, digest_matches
from .fsck import FsckReport, fsck
from .keys import chunk_keys, chunks_of, namespace_of
from .prune import PruneReport, prune
from .signing import FleetKeys, load_keys, sign_chunk
from .store import ChunkStore, DirectoryStore, store_snapshot
from .verify import check_data, verify_chunk

__all__ = [
    "DIGEST_KEY",
    "DIGEST_MISMATCH",
    "ChunkDigest",
    "ChunkStore",
    "DirectoryStore",
    "FleetKeys",
    "FsckReport",
    "PruneReport",
    "check_data",
    "chunk_digest",
    "chunk_keys",
    "chunks_of",
    "digest_matches",
    "fsck",
    "load_keys",
    "namespace_of",
    "prune",
    "sign_chunk",
    "store_snapshot",
    "verify_chunk",
]
