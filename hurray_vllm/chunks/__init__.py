"""The chunk store: content-addressed KV chunks of a prefix, their integrity, and cleanup.

* :mod:`.keys`: chunk keys and model namespaces, and cutting a snapshot into chunks;
* :mod:`.digest`: the checksum a chunk carries and the checks a consumer runs;
* :mod:`.store`: the :class:`ChunkStore` protocol and :class:`DirectoryStore`;
* :mod:`.prune`: cleanup by size;
* :mod:`.fsck`: checking every chunk file of a store.
"""

from .digest import DIGEST_KEY, DIGEST_MISMATCH, ChunkDigest, chunk_digest, digest_matches, verify_chunk
from .fsck import FsckReport, fsck
from .keys import chunk_keys, chunks_of, namespace_of
from .prune import PruneReport, prune
from .store import ChunkStore, DirectoryStore, store_snapshot

__all__ = [
    "DIGEST_KEY",
    "DIGEST_MISMATCH",
    "ChunkDigest",
    "ChunkStore",
    "DirectoryStore",
    "FsckReport",
    "PruneReport",
    "chunk_digest",
    "chunk_keys",
    "chunks_of",
    "digest_matches",
    "fsck",
    "namespace_of",
    "prune",
    "store_snapshot",
    "verify_chunk",
]
