"""Chunk integrity: the checksum a chunk carries, and the KV heads its file name promises.

The checksum (:class:`ChunkDigest` and the functions over it) lives in
:mod:`hurray_vllm.containers.digest`, below the chunk store, because the
readers check it too (``load`` and ``validate`` refuse a chunk whose data
does not match its digest, with the error a consumer gives); it is
re-exported here for the chunk store's modules and their callers.
"""

from __future__ import annotations

from ..containers.digest import (
    DIGEST_KEY,
    DIGEST_MISMATCH,
    DIGEST_VERSION,
    MAC_KEY,
    ChunkDigest,
    FileRanges,
    begin_digest_check,
    check_digest,
    chunk_digest,
    digest_header,
    digest_matches,
    digest_pools,
    digest_tensors,
    digest_unverifiable,
    file_ranges,
    remember_sections,
)
from ..errors import HurrayFormatError
from ..kv.snapshot import KVSnapshot

__all__ = [
    "DIGEST_KEY",
    "MAC_KEY",
    "DIGEST_MISMATCH",
    "DIGEST_VERSION",
    "ChunkDigest",
    "FileRanges",
    "begin_digest_check",
    "check_digest",
    "chunk_digest",
    "digest_header",
    "digest_pools",
    "digest_matches",
    "digest_unverifiable",
    "check_heads",
    "check_named_heads",
    "digest_tensors",
    "file_ranges",
    "remember_sections",
]


def check_named_heads(snap: KVSnapshot, heads: range | None) -> None:
    """:func:`check_heads` for a file or pushed chunk whose heads come from its *name*.

    A name ``<key>.h0-<n>`` with ``n`` every head is refused as well: no lookup reads it (a set
    covering every head is the key alone), so such a file takes disk and quota and is never loaded.
    (The store gives a whole file's heads as ``range(0, n)``: that is :func:`check_heads`'s case.)

    Raises:
        HurrayFormatError: (field ``snapshot.heads``) as :func:`check_heads`, or a slice name of every head.
    """
    if heads is not None and heads.start == 0:
        # The model's count where known: a file without a heads member says only its own pools' count, and
        # "h0-1" of a 2-head model is a wrong slice (check_heads and the geometry checks say so), not this.
        model = snap.fingerprint is not None and not snap.is_latent
        total = snap.fingerprint.num_kv_heads if model and snap.fingerprint is not None else snap.head_range.total
        if heads.stop == total:
            raise HurrayFormatError(
                "snapshot.heads",
                f"named as a slice of every head ({heads.start}..{heads.stop}), a name no lookup reads: "
                "a whole chunk is stored under its key alone",
            )
    check_heads(snap, heads)


def check_heads(snap: KVSnapshot, heads: range | None) -> None:
    """Raise :class:`HurrayFormatError` unless ``snap`` holds the KV heads its file name says.

    ``heads``: a tensor-parallel slice's heads (``<key>.h<a>-<b>``,
    :func:`~hurray_vllm.chunks.keys.split_slice_key`); ``None``: a whole
    chunk, which must hold every head of the model. A slice stored under a
    whole chunk's name would otherwise be loaded as the whole chunk.
    (The store gives a whole file's heads as ``range(0, total)``: accepted.)
    """
    held = snap.head_range
    total = held.total
    if heads is None and snap.fingerprint is not None and not snap.is_latent:
        # The model's heads, not the file's own count: a whole chunk of fewer heads than its model has
        # is refused by every consumer (verify_chunk), so no checker may call it good.
        total = snap.fingerprint.num_kv_heads
    want = (heads.start, heads.stop) if heads is not None else (0, total)
    if (held.start, held.stop) != want:
        raise HurrayFormatError(
            "snapshot.heads", f"chunk holds heads {held.start}..{held.stop}, its name says {want[0]}..{want[1]}"
        )
