"""Chunk keys: which prefix of which model a chunk holds, as a name.

A chunk's key chains the hashes of all chunks before it, so a key names a
whole prefix. Keys live in a namespace derived from the model fingerprint,
so a chunk of another model is never even looked at.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..errors import HurrayArgumentError, HurrayFormatError
from ..kv.heads import partitions
from ..kv.snapshot import KVSnapshot, ModelFingerprint, SlidingWindows
from .digest import DIGEST_KEY, chunk_digest

__all__ = [
    "KEY_SEEDS",
    "PARENT_KEY",
    "namespace_of",
    "key_seed",
    "chunk_keys",
    "chunks_of",
    "slice_key",
    "split_slice_key",
    "chunk_layouts",
    "tail_keys",
    "sequence_seeds",
]


def namespace_of(fp: ModelFingerprint) -> str:
    """A short, stable name for everything one model's caches may share."""
    h = hashlib.blake2b(digest_size=8)
    for part in (fp.architecture, fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.dtype, fp.weights_digest or ""):
        h.update(f"{part}\x00".encode())
    return h.hexdigest()


def key_seed(
    namespace: str, *, lora: tuple[str, str] | None = None, cache_salt: str | None = None, epoch: str | None = None
) -> str:
    """What a sequence's first chunk key is hashed from: the namespace, and whatever else decides its KV.

    The same tokens give other KV under a LoRA adapter (named with its path,
    as vLLM's prefix cache names it), and a ``cache_salt`` asks for a cache
    of its own (a tenant's). Either goes into the seed, so that such chunks
    get keys of their own and are only shared by requests that agree on
    both. An ``epoch`` (an engine's connector after a cache reset, see
    ``HurrayScheduler.reset_cache``) gives keys no engine before the reset
    used. Without any of these, the seed is the namespace itself: keys are
    unchanged. Pass the result as the ``namespace`` argument of
    :func:`chunk_keys` and :func:`tail_keys`; the store's directory stays
    the namespace.

    Example:
        >>> key_seed("ns") == "ns", key_seed("ns", cache_salt="t1") == key_seed("ns", cache_salt="t2")
        (True, False)
    """
    parts = [namespace]
    if lora is not None:  # the adapter's identity (its files' digest): other weights must not reuse this KV
        parts += ["lora", *lora]
    if cache_salt:
        parts += ["salt", cache_salt]
    if epoch:
        parts += ["epoch", epoch]
    if len(parts) == 1:
        return namespace
    # Each part with its length: no name, path or salt can pass for a split of another.
    raw = b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in parts)
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


#: A chunk key as :func:`chunk_keys` and :func:`tail_keys` make it (a 16-byte digest), and a key seed as
#: :func:`key_seed` makes it from more than the namespace: 32 lowercase hex digits.
_KEY = re.compile(r"[0-9a-f]{32}")


def _chained(prev: str | None, namespace: str) -> hashlib.blake2b:
    """The hash a chunk's key starts from: the key before it (raw digest), or the namespace for the first."""
    return hashlib.blake2b(bytes.fromhex(prev) if prev else namespace.encode(), digest_size=16)


def _positive(value: object, name: str) -> int:
    """``value`` if it is a positive ``int`` (not a bool), else :class:`HurrayArgumentError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HurrayArgumentError(name, f"expected a positive number of tokens, got {value!r}")
    return value


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as the keys hash them: int64, native order."""
    try:
        return array("q", token_ids).tobytes()
    except (OverflowError, TypeError) as exc:
        raise HurrayArgumentError("token_ids", f"expected integers that fit in 64 bits: {exc}") from None


def chunk_keys(token_ids: Sequence[int], chunk_tokens: int, namespace: str) -> list[str]:
    """Keys of the whole chunks of ``token_ids``; key ``i`` covers tokens ``[0, (i+1)*chunk_tokens)``.

    Raises:
        HurrayArgumentError: ``chunk_tokens`` is not a positive ``int``, or a token id is not an integer of
            64 bits (field ``token_ids``).
    """
    _positive(chunk_tokens, "chunk_tokens")
    keys: list[str] = []
    for i in range(len(token_ids) // chunk_tokens):
        h = _chained(keys[-1] if keys else None, namespace)
        h.update(_token_bytes(token_ids[i * chunk_tokens : (i + 1) * chunk_tokens]))
        keys.append(h.hexdigest())
    return keys


def tail_keys(prev: str | None, token_ids: Sequence[int], step: int, namespace: str) -> list[tuple[int, str]]:
    """``(n, key)`` of every tail of ``n`` = ``step``, ``2 * step``, ... tokens of ``token_ids`` after ``prev``.

    A tail is a prompt's whole blocks after its last whole chunk, saved when
    its prefill ends so that a consumer computes at most one block of it
    (see ``hurray_tails`` in docs/connector.md). It is keyed as a chunk of
    its own length would be: chained on the key of the chunk before it
    (``prev``; ``None`` at the start of a sequence), so that its key names
    the whole prefix, and a tail can never be mistaken for a whole chunk
    (shorter: another hash). One pass over the tokens gives every
    candidate length a consumer may probe.

    Example:
        >>> tokens = list(range(10))
        >>> first = chunk_keys(tokens, 4, "ns")[0]
        >>> [n for n, _ in tail_keys(first, tokens[4:], 2, "ns")]
        [2, 4, 6]
        >>> tail_keys(first, tokens[4:], 2, "ns")[1][1] == chunk_keys(tokens, 4, "ns")[1]  # 4 tokens: chunk 1's key
        True

    Raises:
        HurrayArgumentError: ``step`` is not a positive ``int``, ``prev`` is not a key (32 lowercase hex
            digits) or ``None``, or a token id is not an integer of 64 bits (field ``token_ids``).
    """
    _positive(step, "step")
    if prev is not None and (not isinstance(prev, str) or _KEY.fullmatch(prev) is None):
        raise HurrayArgumentError("prev", f"expected a chunk key (32 lowercase hex digits) or None, got {prev!r}")
    h = _chained(prev, namespace)
    out = []
    for n in range(step, len(token_ids) + 1, step):
        h.update(_token_bytes(token_ids[n - step : n]))
        out.append((n, h.copy().hexdigest()))
    return out


#: ``KVSnapshot.extra`` member: per request id, the seed of that request's chunk keys where it is not the
#: namespace (:func:`key_seed`: a LoRA adapter, a ``cache_salt``, a connector's epoch after a reset), or None
#: for a request whose KV its token ids do not name (images, prompt embeddings) or that holds KV from before
#: a connector reset (other weights): it has no chunks. ``adapters.vllm.snapshot``
#: records it, :func:`chunks_of` keys by it; chunks do not carry it.
KEY_SEEDS = "hurray_vllm.key_seeds"

#: ``extra`` member of a stored chunk: the key of the chunk before it in its prefix (a prompt tail's: its
#: last whole chunk's), absent in a sequence's first chunk and in files of writers from before it was
#: recorded. A whole key, never a tensor-parallel slice's name. Covered by the chunk's digest and MAC, as
#: all of ``extra`` is. :func:`chunks_of` and the connector's saves write it; ``prune`` reads it (a chunk
#: whose parent is gone can never load, so a parent is kept while a chunk after it is).
PARENT_KEY = "hurray_vllm.parent_key"


def _seed_ok(value: object, namespace: str) -> bool:
    """Whether ``value`` is a seed :func:`key_seed` makes over ``namespace`` (or None: no chunks)."""
    return value is None or value == namespace or (isinstance(value, str) and _KEY.fullmatch(value) is not None)


def sequence_seeds(snap: KVSnapshot, namespace: str) -> list[str | None]:
    """Each sequence's key seed: the namespace unless ``snap.extra[KEY_SEEDS]`` names another (or none).

    A seed must be one :func:`key_seed` makes: the namespace itself, or 32
    lowercase hex digits. The first chunk's key hashes its seed where each
    later chunk's hashes the key before it (16 raw bytes): a seed of any
    other text (one whose UTF-8 bytes are a stored key's raw bytes) would
    give a snapshot's chunks the keys of another prompt's later chunks.

    Raises:
        HurrayFormatError: (field ``snapshot.extra.hurray_vllm.key_seeds``) a malformed member.
    """
    given = snap.extra.get(KEY_SEEDS)
    if given is None:
        return [namespace] * snap.num_seqs
    if not isinstance(given, dict) or not all(isinstance(k, str) and _seed_ok(v, namespace) for k, v in given.items()):
        raise HurrayFormatError(
            f"snapshot.extra.{KEY_SEEDS}",
            "expected request ids mapped to key seeds (what key_seed makes: 32 lowercase hex digits, or the "
            "namespace) or null",
        )
    rids = snap.request_ids or ()
    if given and len(rids) != snap.num_seqs:
        raise HurrayFormatError(f"snapshot.extra.{KEY_SEEDS}", "key seeds by request id need the request ids")
    return [given.get(rid, namespace) for rid in rids] if given else [namespace] * snap.num_seqs


def chunks_of(snap: KVSnapshot, chunk_tokens: int, *, tails: bool = False) -> list[tuple[str, KVSnapshot]]:
    """Every whole chunk of every sequence of ``snap``, keyed as a connector would key it.

    ``chunk_tokens`` must be a multiple of the snapshot's page size. Only
    tokens with KV count; a sequence's last partial chunk is left out, or
    with ``tails`` cut to its whole pages and keyed as a prompt tail
    (:func:`tail_keys`, what ``hurray_tails`` saves; not for a snapshot with
    sliding windows or recurrent states, whose tails no consumer loads). A
    linear-attention hybrid's states go with the chunk that ends where they
    were taken (a sequence of a whole number of chunks); the other chunks
    carry none, and a consumer resumes only at a chunk with states.

    A request run under a LoRA adapter or a ``cache_salt`` is keyed with its
    own seed, and one with images or prompt embeddings gets no chunks, as
    the connector keys them (:data:`KEY_SEEDS`, which ``snapshot()`` records).
    Each chunk but a sequence's first names the key before it
    (:data:`PARENT_KEY`), as the connector's saves do.

    Raises:
        HurrayArgumentError: ``chunk_tokens`` is not a positive multiple of the page size.
        HurrayFormatError: the snapshot has no fingerprint, no token ids (a file saved without them), or
            layers paged in other sizes.
    """
    h = snap.heads
    if h is not None and (h.start, h.stop) == (0, h.total):
        # A "slice" of every head is the whole chunk (docs/format.md: such a snapshot has no heads member);
        # keyed as a slice, it would be stored as "<key>.h0-<all>", a name no lookup reads.
        snap = replace(snap, heads=None)
    if snap.fingerprint is None:
        raise HurrayFormatError(
            "snapshot.fingerprint", "chunks are namespaced by model: the snapshot needs a fingerprint"
        )
    if not snap.num_layers:
        return []
    ps = snap.page_size
    # The caller's choice, not the data's: an argument error (0 divided by zero, a negative size wrote
    # files under the keys of real chunks).
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise HurrayArgumentError("chunk_tokens", f"expected a positive number of tokens, got {chunk_tokens!r}")
    if chunk_tokens % ps:
        raise HurrayArgumentError("chunk_tokens", f"{chunk_tokens} is not a multiple of the page size {ps}")
    # Keys are hashes of the tokens: a snapshot may be saved without them (valid, but nothing to key by).
    if len(snap.token_ids) != snap.num_seqs:
        raise HurrayFormatError(
            "snapshot.token_ids",
            f"chunks are keyed by their tokens: {len(snap.token_ids)} token lists for {snap.num_seqs} sequences",
        )
    if any(t.page_size != ps for t in snap.tensors()):
        raise HurrayFormatError(
            "snapshot.structure", "layers are paged in different sizes: repage_snapshot() it to one page size first"
        )
    tails = tails and snap.windows is None and snap.states is None
    seeds = sequence_seeds(snap, namespace_of(snap.fingerprint))
    per = chunk_tokens // ps
    out = []
    lens = snap.seq_lens
    for s in range(snap.num_seqs):
        ns = seeds[s]
        if ns is None:  # KV its token ids do not name: no chunks
            continue
        tokens = list(snap.token_ids[s][: lens[s]])
        # Per block structure (a sliding-window hybrid's layers may hold other pages), computed once.
        pages: dict[int, torch.Tensor] = {}
        for t in snap.tensors():
            pages.setdefault(id(t.block_table), t.pages_of(s))
        keys = chunk_keys(tokens, chunk_tokens, ns)
        # (key, parent key, first page, pages): the parent is the chunk before (a tail's: the last whole one).
        cuts = [(key, keys[c - 1] if c else None, c * per, per) for c, key in enumerate(keys)]
        tail = (len(tokens) - len(keys) * chunk_tokens) // ps
        if tails and tail:
            start = len(keys) * chunk_tokens
            prev = keys[-1] if keys else None
            ((_, key),) = tail_keys(prev, tokens[start : start + tail * ps], tail * ps, ns)
            cuts.append((key, prev, len(keys) * per, tail))
        for key, parent, first, n in cuts:
            lo, hi = first * ps, (first + n) * ps  # the cut's tokens
            ptr = torch.tensor([0, n])
            num = torch.tensor([n * ps])
            tables = {k: v[first : first + n] for k, v in pages.items()}
            layers = [
                tuple(
                    replace(t, block_table=tables[id(t.block_table)], seq_ptr=ptr, seq_lens=num, num_tokens=None)
                    for t in members
                )
                for members in snap.layer_members()
            ]
            win = snap.windows
            if win is not None:  # positions relative to the chunk's first token
                starts = tuple((min(max(row[s] - lo, 0), hi - lo),) for row in win.kv_start)
                win = SlidingWindows(win.sizes, starts)
            # A recurrent state is valid only where it was taken: it goes with the chunk that ends there.
            states = snap.states
            if states is not None:
                states = states.select([s]) if states.positions[s] == hi else None
            chunk = snap.with_layers(
                layers,
                windows=win,
                states=states,
                token_ids=(tuple(tokens[lo:hi]),),
                request_ids=(snap.request_ids[s],) if snap.request_ids else None,
            ).compact()
            # The batch's seeds are not the chunk's, nor is a parent the snapshot carried (it was a chunk).
            extra = {k: v for k, v in chunk.extra.items() if k not in (KEY_SEEDS, PARENT_KEY)}
            if parent is not None:
                extra[PARENT_KEY] = parent
            chunk = replace(chunk, extra=extra)
            out.append((key, replace(chunk, extra={**extra, DIGEST_KEY: chunk_digest(chunk)})))
    return out


def slice_key(key: str, heads: range | None) -> str:
    """The name a chunk's slice of KV heads is stored under (``key`` itself for every head).

    A tensor-parallel rank stores its heads ``a .. b - 1`` as ``<key>.h<a>-<b>``:
    the chunk is complete when slices covering every head are there
    (:meth:`DirectoryStore.parts`).

    Example:
        >>> slice_key("ab12", range(2, 4)), slice_key("ab12", None)
        ('ab12.h2-4', 'ab12')
    """
    return key if heads is None else f"{key}.h{heads.start}-{heads.stop}"


def chunk_layouts(key: str, num_kv_heads: int) -> list[list[tuple[str, range]]]:
    """Every complete set of files chunk ``key`` may be stored as, whole first: ``(name, heads)`` per file.

    The whole chunk, or the slices of one way of splitting the heads into
    equal runs (what producers at tensor parallelism 2, 4, 8... write,
    :func:`hurray_vllm.kv.heads.partitions`).

    Example:
        >>> [[name for name, _ in files] for files in chunk_layouts("ab12", 2)]
        [['ab12'], ['ab12.h0-1', 'ab12.h1-2']]
    """
    return [
        [(slice_key(key, None if len(runs) == 1 else r), r) for r in runs] for runs in partitions(max(num_kv_heads, 1))
    ]


_SLICE_NAME = re.compile(r"(.+)\.h(\d{1,5})-(\d{1,5})")


#: Namespaces and keys: what this module makes (1-64 lowercase hex digits), nothing that could name another path.
CHUNK_NAME = re.compile(r"[0-9a-f]{1,64}")


def is_namespace_name(name: str) -> bool:
    """Whether ``name`` can be a namespace directory of a store (``namespace_of``: hex digits)."""
    return CHUNK_NAME.fullmatch(name) is not None


def is_chunk_name(name: str) -> bool:
    """Whether ``name`` (without ``.hrry``) can be a chunk's: a key, or a tensor-parallel slice's ``<key>.h<a>-<b>``."""
    return CHUNK_NAME.fullmatch(split_slice_key(name)[0]) is not None


def split_slice_key(name: str) -> tuple[str, range | None]:
    """The inverse of :func:`slice_key`: ``(key, heads)``, with ``heads`` ``None`` for a whole chunk's name.

    Only the canonical form counts as a slice (``h2-4``, not ``h02-4`` or
    ``h4-2``): any other name is returned whole, so that it can never be
    taken for another file's.

    Example:
        >>> split_slice_key("ab12.h2-4"), split_slice_key("ab12")
        (('ab12', range(2, 4)), ('ab12', None))
    """
    m = _SLICE_NAME.fullmatch(name)
    if m is not None:
        key, heads = m.group(1), range(int(m.group(2)), int(m.group(3)))
        if heads and slice_key(key, heads) == name:
            return key, heads
    return name, None
