"""The chunk digest: the checksum a chunk carries over its metadata, descriptors and page pools.

Computed by every producer of a chunk (:func:`~hurray_vllm.chunks.keys.chunks_of`),
checked by every consumer (:mod:`hurray_vllm.chunks.verify`), and by
:func:`~hurray_vllm.containers.io.load` and ``save`` for any snapshot that
carries one (:func:`check_digest`): a store chunk whose pools were damaged
is refused by whatever reads the file, not only by the connector. It lives
here, below the chunk store, so that the readers can run it;
:mod:`hurray_vllm.chunks.digest` re-exports it.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable, Sequence

import torch

from .. import native
from ..errors import HurrayFormatError
from ..kv.paged import BlockPagedTensor
from ..kv.snapshot import DIGEST_KEY, MAC_KEY, KVSnapshot
from ..wire.descriptor import encode_descriptor
from .hrryfile import FileBytes
from .stream import byte_view

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
    "digest_tensors",
    "file_ranges",
    "remember_sections",
]

#: What the digest covers (named in the digest string); ``v2``: header bytes and pools.
DIGEST_VERSION = "v2"
_HEADER_MAGIC = b"hurray-vllm chunk digest v2\0"
DIGEST_MISMATCH = "chunk data does not match its digest (corrupt transfer?)"


class ChunkDigest:
    """Incremental chunk checksum: the chunk's header bytes (:func:`digest_header`), then its page pools.

    The digest string is ``"<algorithm>/v2:<8 hex>"``. ``v2`` covers every
    byte that decides what KV an importer writes: the descriptors (element
    type, geometry, layer index, role), the block tables and sequence
    pointers, the fp8 scales, the token ids and the metadata. Not a
    quantized tensor's parameter buffers (its buffers after the three
    block-paged ones; the quantization section itself is part of the
    descriptor): no importer reads them, and every consumer refuses a chunk
    that has any (:func:`~hurray_vllm.chunks.verify.verify_chunk`). A ``v1``
    digest (hurray-vllm 0.1: the page pools only) is refused: a type tag
    flipped from bf16 to fp16 passed it. Two algorithms:

    * ``crc32c`` (CRC-32C, Castagnoli): computed by the native kernels
      (:mod:`hurray_vllm.native`, the SSE4.2 ``crc32`` instruction where the
      CPU has it), about 3.5x faster than zlib here. The default wherever
      the native kernels load.
    * ``crc32`` (zlib's CRC-32): the fallback writers use without them.

    It guards against damaged transfers and files, not against an adversary
    (run transports on a trusted network), and runs several times faster
    than a cryptographic hash, which would dominate the cost of moving a
    chunk. Both release the GIL, so a receiver can checksum pools that
    landed while others are still arriving.
    """

    ALGORITHMS = ("crc32c", "crc32")

    def __init__(self, algorithm: str | None = None) -> None:
        if algorithm is None:
            algorithm = "crc32c" if native.library() is not None else "crc32"
        if algorithm not in self.ALGORITHMS:
            raise HurrayFormatError("snapshot.digest", f"unknown chunk digest algorithm {algorithm!r}")
        if algorithm == "crc32c" and native.library() is None:
            raise HurrayFormatError(
                "snapshot.digest",
                f"the chunk is checksummed with CRC-32C, which needs the native kernels: {native.unavailable_reason()}",
            )
        self.algorithm = algorithm
        self._crc = 0

    @classmethod
    def like(cls, digest: object) -> ChunkDigest:
        """A digest of the algorithm ``digest`` (a stored digest string) names, to check it."""
        if not isinstance(digest, str) or ":" not in digest:
            raise HurrayFormatError("snapshot.digest", "chunk carries no digest")
        algorithm, _, version = digest.partition(":")[0].partition("/")
        if version != DIGEST_VERSION:
            raise HurrayFormatError(
                "snapshot.digest",
                f"chunk digest {digest[:40]!r} does not cover the descriptors and metadata (written by an older "
                "hurray-vllm?); the chunk is refused and recomputed",
            )
        return cls(algorithm)

    def update(self, data: bytes | memoryview) -> None:
        """Add ``data``'s bytes."""
        if self.algorithm == "crc32c":
            crc = native.crc32c(data, self._crc)
            assert crc is not None  # checked in __init__
            self._crc = crc
        else:
            self._crc = zlib.crc32(data, self._crc)

    def update_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Add the bytes of contiguous CPU ``tensors``, in order; one native call for CRC-32C."""
        if self.algorithm == "crc32c":
            crc = native.crc32c_tensors(tensors, self._crc)
            assert crc is not None  # checked in __init__
            self._crc = crc
            return
        for t in tensors:
            if t.numel():
                self.update(byte_view(t.reshape(-1).view(torch.uint8)))

    def update_ranges(self, ranges: FileRanges) -> None:
        """Add the bytes of tensors that are views of a read file's memory, from the page registers of its read.

        The CRC-32C its reader computed page by page, while each piece was
        in cache (:attr:`FileBytes.page_crcs`), instead of reading the bytes
        from memory again: what :meth:`update_tensors` would add for those
        tensors (:func:`file_ranges`), in about a tenth of the time. One
        native call, which releases the GIL; no other Python.
        """
        if self.algorithm != "crc32c":
            raise HurrayFormatError("snapshot.digest", "page registers are CRC-32C's: this digest is another")
        base, pages, spans = ranges
        crc = native.crc32c_ranges(self._crc, base, pages, spans)
        assert crc is not None  # checked in __init__
        self._crc = crc

    def hexdigest(self) -> str:
        """The digest so far, as ``"<algorithm>:<8 hex digits>"``."""
        return f"{self.algorithm}/{DIGEST_VERSION}:{self._crc:08x}"


#: What :meth:`ChunkDigest.update_ranges` takes: a read's bytes, their page registers, and the tensors' byte
#: ranges ``(offset, length)`` in them, in order.
FileRanges = tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]


def file_ranges(read: FileBytes, tensors: Sequence[torch.Tensor]) -> FileRanges | None:
    """Where ``tensors`` lie in ``read``'s bytes, with the registers its read computed; ``None`` if it cannot tell.

    ``None`` unless ``read`` has page registers for exactly its memory
    (:class:`~hurray_vllm.containers.hrryfile.PageCrcs`: a ``FileBytes`` given
    another buffer keeps no registers that would vouch for it) and every
    tensor is a contiguous view inside that memory (a copy made while parsing
    is not): then the tensors' own bytes are checksummed instead.
    """
    pages = read.page_crcs
    if pages is None or not read.view.nbytes:
        return None
    base = torch.frombuffer(read.view, dtype=torch.uint8)  # keeps the file's memory alive through the check
    lo, size = base.data_ptr(), base.numel()
    if (lo, size) != (pages.address, pages.size) or pages.registers.dtype != torch.int32:
        return None
    spans = []
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        off, n = t.data_ptr() - lo, t.numel() * t.element_size()
        if n and not 0 <= off <= size - n:
            return None
        spans.append((off if n else 0, n))
    return base, pages.registers, spans


def digest_tensors(snap: KVSnapshot) -> list[BlockPagedTensor]:
    """The tensors a chunk digest covers, in its order: every key, then every value (or every fused latent).

    The order of the first digest version, kept so that stored key/value
    chunks keep their digests; a receiver checksums the pools in this order
    as they land (keys before values).
    """
    return list(snap.fused) if snap.fused else [*snap.keys, *snap.values]


def digest_header(snap: KVSnapshot) -> bytes:
    """What a chunk digest covers before the page pools, as canonical bytes.

    The metadata (fingerprint, source, request ids, extra minus the digest
    itself, token ids, sequence lengths, fp8 scales as exact hex floats, an
    MLA snapshot's latent split, a hybrid's windows and state layout) as
    sorted compact JSON, then per tensor (:func:`digest_tensors` order) its
    encoded descriptor and its int64 block table and sequence pointers,
    then the bytes of every recurrent state tensor. A receiver computes it
    from what the offer or stream carried, before the pools. Quantization
    parameter buffers are left out (see :class:`ChunkDigest`).
    """
    meta = {
        "fingerprint": snap.fingerprint.to_json() if snap.fingerprint else None,
        "source": snap.source.to_json() if snap.source else None,
        "request_ids": list(snap.request_ids) if snap.request_ids is not None else None,
        "extra": {k: v for k, v in snap.extra.items() if k not in (DIGEST_KEY, MAC_KEY)},
        "token_ids": [list(ids) for ids in snap.token_ids],
        "seq_lens": snap.seq_lens if snap.num_layers else [],
        "kv_scales": [[float(x).hex() for x in pair] for pair in snap.kv_scales] if snap.kv_scales else None,
    }
    if snap.latent is not None:  # MLA only: key/value chunks keep their digests
        meta["latent"] = snap.latent.to_json()
    if snap.windows is not None:  # sliding-window hybrids only, likewise
        meta["windows"] = snap.windows.to_json()
    if snap.states is not None:  # linear-attention hybrids only, likewise
        meta["states"] = snap.states.to_json()
    if snap.heads is not None:  # one tensor-parallel rank's slice of the heads only, likewise
        meta["heads"] = snap.heads.to_json()
    parts = [_HEADER_MAGIC, json.dumps(meta, sort_keys=True, separators=(",", ":"), default=str).encode()]
    parts.append(_tensor_section(digest_tensors(snap)))
    # Recurrent states travel inline with the descriptors (a receiver has them before the pools).
    for layer in snap.states.tensors if snap.states is not None else ():
        parts += [byte_view(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)).tobytes() for t in layer]
    return b"".join(parts)


def _index_bytes(idx: torch.Tensor) -> bytes:
    return idx.to(torch.int64).contiguous().cpu().numpy().tobytes()


def _tensor_section(tensors: list[BlockPagedTensor]) -> bytes:
    """The header's part after the metadata: per tensor its descriptor (length first), block table and seq_ptr.

    The descriptor is encoded, the index tensors as int64 bytes.

    Remembered whole (:data:`_SECTIONS`) for the common snapshot whose tensors share one block structure
    and one pool geometry, as every chunk of a model does: keyed by all that decides the part, that is the
    shared index bytes, token count, dtype, pool shape and index type, and each tensor's role and layer.
    """
    key = _uniform_key(tensors) if _sections_on else None
    if key is not None:
        got = _SECTIONS.get(key)
        if got is not None:
            return got
    parts: list[bytes] = []
    # A snapshot's layers share their index tensors (and their lengths): each is turned into bytes once.
    index_bytes: dict[int, bytes] = {}
    totals: dict[int, int] = {}
    for t in tensors:
        desc = _encoded_descriptor(t, totals)
        parts += [len(desc).to_bytes(4, "little"), desc]
        for idx in (t.block_table, t.seq_ptr):
            got = index_bytes.get(id(idx))
            if got is None:
                got = index_bytes[id(idx)] = _index_bytes(idx)
            parts.append(got)
    section = b"".join(parts)
    if key is not None and len(section) <= _SECTION_MAX_BYTES:
        if len(_SECTIONS) >= _SECTIONS_MAX:
            _SECTIONS.clear()
        _SECTIONS[key] = section
    return section


def _uniform_key(tensors: list[BlockPagedTensor]) -> tuple[object, ...] | None:
    """What decides :func:`_tensor_section` of ``tensors`` sharing one structure; ``None`` if they do not.

    One block table, seq_ptr and seq_lens tensor (the same objects), one pool dtype and shape,
    one index type and token count, no quantization: the descriptors then differ only in role
    and layer. Small index tensors only (the key holds their bytes).
    """
    if not tensors:
        return None
    t0 = tensors[0]
    bt, sp, lens, n0, it = t0.block_table, t0.seq_ptr, t0.seq_lens, t0.num_tokens, t0.index_type
    dtype, shape = t0.page_pool.dtype, t0.page_pool.shape
    if bt.numel() + sp.numel() > _SECTION_MAX_INDEX:
        return None
    roles = []
    for t in tensors:
        pool = t.page_pool
        if (
            t.block_table is not bt
            or t.seq_ptr is not sp
            or t.seq_lens is not lens
            or t.num_tokens != n0
            or t.index_type != it
            or t.quantization is not None
            or t.quant_buffers
            or pool.dtype != dtype
            or pool.shape != shape
        ):
            return None
        roles.append((t.kv_role, t.layer_index))
    total = t0.total_tokens
    return (dtype, tuple(shape), it, total, _index_bytes(bt), _index_bytes(sp), tuple(roles))


def remember_sections(on: bool) -> bool:
    """Remember digest headers' tensor sections (``on``, the default) or build each afresh; the previous setting.

    ``HURRAY_PARSE_MEMO=0`` in the environment starts with it off (for comparisons).
    """
    global _sections_on
    before, _sections_on = _sections_on, bool(on)
    return before


_sections_on = os.environ.get("HURRAY_PARSE_MEMO", "1") != "0"
#: Tensor sections of digest headers by :func:`_uniform_key`: every chunk file of a model repeats its own.
_SECTIONS: dict[tuple[object, ...], bytes] = {}
_SECTIONS_MAX = 64
_SECTION_MAX_BYTES = 64 << 10
_SECTION_MAX_INDEX = 4096


#: Encoded descriptors by what decides them (:func:`_encoded_descriptor`): every chunk of a model repeats them.
_ENCODED: dict[tuple[object, ...], bytes] = {}
_ENCODED_MAX = 4096


def _encoded_descriptor(t: BlockPagedTensor, totals: dict[int, int]) -> bytes:
    """``encode_descriptor(t.descriptor(device_tag=0))``, remembered by every input of that descriptor.

    Building and encoding a descriptor is most of :func:`digest_header`'s
    Python, and a consumer runs it for every chunk file it loads. The key
    holds all that :meth:`BlockPagedTensor.descriptor` reads: the pool's
    dtype and shape, the index lengths and type, role, layer, token count
    and extra buffers' sizes. A tensor with a quantization section is
    encoded afresh: equal sections can differ on the wire (scales of 0.0
    and -0.0 compare equal), and vLLM's fp8 caches carry their scales
    apart, without one. ``totals``: token counts by the identity of the
    ``seq_lens`` tensor, which a snapshot's layers share (the caller keeps
    the tensors alive while it holds the dict).
    """
    if t.quantization is not None:
        return encode_descriptor(t.descriptor(device_tag=0))
    lens = t.seq_lens
    if lens is None:
        total = t.total_tokens
    else:
        total = totals.get(id(lens), -1)
        if total < 0:
            total = totals[id(lens)] = int(lens.sum())
    pool = t.page_pool
    key = (
        pool.dtype,
        tuple(pool.shape),
        int(t.block_table.numel()),
        int(t.seq_ptr.numel()),
        t.kv_role,
        t.layer_index,
        t.index_type,
        total,
        tuple(int(b.numel()) * b.element_size() for b in t.quant_buffers),
    )
    got = _ENCODED.get(key)
    if got is None:
        got = encode_descriptor(t.descriptor(device_tag=0))
        if len(_ENCODED) >= _ENCODED_MAX:
            _ENCODED.clear()
        _ENCODED[key] = got
    return got


def chunk_digest(snap: KVSnapshot, algorithm: str | None = None) -> str:
    """The :class:`ChunkDigest` of ``snap``: its header bytes, then every page pool."""
    d = ChunkDigest(algorithm)
    d.update(digest_header(snap))
    d.update_tensors(digest_pools(snap))
    return d.hexdigest()


def digest_pools(snap: KVSnapshot) -> list[torch.Tensor]:
    """The page pools a chunk digest (or MAC) covers after its header, contiguous on the CPU, in order."""
    return [t.page_pool.contiguous().cpu() for t in digest_tensors(snap)]


def begin_digest_check(snap: KVSnapshot, read: FileBytes | None = None) -> Callable[[], None]:
    """Check ``snap``'s digest in two halves: the header now, and the page pools in the callable returned.

    ``read``: the file ``snap`` was parsed from (``read_whole(page_crcs=True)``):
    its pools' checksum is then combined from the registers computed while
    it was read (:meth:`ChunkDigest.update_ranges`), not read from memory again.

    The first half is Python (:func:`digest_header`); the second is one
    native call that releases the GIL, so a reader can run it on a helper
    thread while it parses the next chunk, without the two threads handing
    the GIL back and forth at every small step (which, in a busy process
    such as vLLM's engine, cost more than the checksum itself).

    Raises:
        HurrayFormatError: field ``snapshot.digest``: now, for a missing, old or
            unknown digest; from the callable, for data that does not match it.
    """
    want = snap.extra.get(DIGEST_KEY)
    d = ChunkDigest.like(want)
    d.update(digest_header(snap))
    pools = digest_pools(snap)
    # Planned here, in the first half: the second runs no Python but the native call (see above).
    ranges = file_ranges(read, pools) if read is not None and d.algorithm == "crc32c" else None

    def pools_match() -> None:
        if ranges is not None:
            d.update_ranges(ranges)
        else:
            d.update_tensors(pools)
        if d.hexdigest() != want:
            raise HurrayFormatError("snapshot.digest", DIGEST_MISMATCH)

    return pools_match


def digest_matches(snap: KVSnapshot) -> bool:
    """Whether ``snap``'s stored digest matches it (raises if the digest is missing, old or cannot run here)."""
    want = snap.extra.get(DIGEST_KEY)
    return want == chunk_digest(snap, ChunkDigest.like(want).algorithm)


def digest_unverifiable(exc: HurrayFormatError) -> bool:
    """Whether ``exc`` says a chunk's digest cannot be checked here, rather than that its data does not match.

    No digest, an old or unknown one, or one that needs the native kernels:
    consumers refuse such a chunk but leave its file (a newer writer's file
    may be fine), and ``fsck`` lists it as not verified. Only a mismatch is
    damage.
    """
    return exc.field == "snapshot.digest" and not str(exc).endswith(DIGEST_MISMATCH)


def check_digest(snap: KVSnapshot, read: FileBytes | None = None) -> None:
    """Raise unless the chunk digest ``snap`` carries matches it; what ``load`` and ``save`` check.

    The connector's own check (:func:`begin_digest_check`, both halves at
    once: one pass over the pools, or over ``read``'s page registers where
    the file was read with them). A snapshot without a digest passes (only
    chunks carry one), and so does one whose digest cannot be checked here
    (:func:`digest_unverifiable`: none, an old, unknown or malformed one,
    or CRC-32C without the native kernels): no damage was found, as for the
    consumers, which refuse such a chunk but leave its file.

    Raises:
        HurrayFormatError: field ``snapshot.digest``, message :data:`DIGEST_MISMATCH`: the data is not what
            was written (the error a consumer gives for the same chunk).
    """
    if DIGEST_KEY not in snap.extra:
        return
    try:
        pools_match = begin_digest_check(snap, read)
    except HurrayFormatError as exc:
        if digest_unverifiable(exc):
            return
        raise
    pools_match()
