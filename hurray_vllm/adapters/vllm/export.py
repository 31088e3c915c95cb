"""Export paged KV caches to block-paged snapshots, layer by layer.

This module knows nothing of a running engine: it takes the per-layer cache
tensors, their :class:`~hurray_vllm.adapters.vllm.layouts.KVLayout`, and
what each sequence holds (its block ids and computed token count). The
in-process entry point (:func:`hurray_vllm.adapters.vllm.snapshot`) and the
KV connector both go through :func:`export_layers`.

Only pages referenced by the exported sequences leave the cache: one
compaction plan (first-reference order, aliasing kept) is computed once
and applied to every layer and role. Slots past each sequence's length are
zeroed in the copy, so nothing of other requests leaks out.
"""

from __future__ import annotations

import io
import logging
import math
import os
import threading
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

import torch

from ...containers.schema import header_records, state_records
from ...containers.stream import LayerWriter, write_records
from ...errors import HurrayArgumentError, HurrayFormatError
from ...kv.paged import BlockPagedTensor, plan_compaction
from ...kv.snapshot import HeadRange, KVSnapshot, LatentSplit, ModelFingerprint, SlidingWindows, SnapshotSource
from ...kv.states import RecurrentStates
from .layouts import (
    CpuPacked,
    FlashAttnLegacy,
    FlashInferLegacy,
    KVLayout,
    LogicalBHNC,
    MLALatent,
    PagedAttentionLegacy,
    as_storage_dtype,
    roles_of,
)

__all__ = [
    "GatherBuffers",
    "SequenceState",
    "BatchPlan",
    "plan_batch",
    "export_layers",
    "export_snapshot",
    "export_stream",
    "to_host_overlapped",
    "release_export_workspace",
]

log = logging.getLogger("hurray_vllm.export")


@dataclass(frozen=True)
class SequenceState:
    """What a sequence holds in the engine's cache.

    Attributes:
        request_id: the caller's name for the sequence.
        block_ids: the engine's block table for it (may hold blocks
            allocated ahead; only the ones covering ``num_computed`` are read).
        num_computed: tokens whose K/V are in the cache.
        token_ids: prompt and generated token ids (``>= num_computed``).
        group_block_ids: for an engine with several KV cache groups (a
            sliding-window hybrid), the block table of each group; a
            sliding-window group's leading blocks may be vLLM's null block 0
            (freed: out of the window). Empty for one group.
    """

    request_id: str
    block_ids: Sequence[int]
    num_computed: int
    token_ids: Sequence[int]
    group_block_ids: tuple[Sequence[int], ...] = ()


@dataclass(frozen=True)
class BatchPlan:
    """The block structure every layer of an export shares."""

    keep: torch.Tensor  # engine block ids to copy, int64 [num_pages]
    block_table: torch.Tensor  # snapshot page ids, int64
    seq_ptr: torch.Tensor
    seq_lens: torch.Tensor
    valid: torch.Tensor  # per snapshot page, slots some sequence uses
    block_size: int
    # (page, first slot no sequence uses) for every page with unused slots, on the host:
    # zeroing them needs no per-layer scan of `valid` (or device sync).
    tails: tuple[tuple[int, int], ...] = ()
    # With holes: per sequence, the first token its pages hold (the pages before are one zero page).
    kv_start: tuple[int, ...] | None = None
    # The largest engine block id in `keep` (-1: none), on the host: checked against each cache's
    # block count before its gather, since an id past a CUDA cache is a device-side assert.
    max_block: int = -1


def plan_batch(
    seqs: Sequence[SequenceState],
    block_size: int,
    *,
    reserved_blocks: Sequence[int] = (0,),
    holes: bool = False,
) -> BatchPlan:
    """Compaction plan for ``seqs`` over an engine cache of ``block_size`` blocks.

    ``reserved_blocks`` (vLLM's null block 0) may never hold a computed token,
    unless ``holes``: then a sequence's leading null blocks are pages a
    sliding-window layer has freed, and they all map to one zeroed page
    (``kv_start`` says where each sequence's held tokens begin). Runs before
    the first layer is gathered, on every export, so the ids go into an array
    (a C loop) and the rest is a handful of tensor ops over them, with no
    per-id Python code.
    """
    if holes:
        return _plan_with_holes(seqs, block_size, reserved_blocks)
    table = array("q")
    ptr = array("q", [0])
    lens = array("q")
    partial: list[tuple[int, int]] = []  # (table position, used slots) of each partly used last page
    for s in seqs:
        n = s.num_computed
        if n < 0 or n > len(s.token_ids):
            raise HurrayFormatError(
                "num_computed", f"{s.request_id}: {n} computed tokens but {len(s.token_ids)} token ids"
            )
        need = -(-n // block_size)
        if need > len(s.block_ids):
            raise HurrayFormatError(
                "block_ids", f"{s.request_id}: {n} tokens need {need} blocks, the engine lists {len(s.block_ids)}"
            )
        try:
            table.extend(s.block_ids[:need])
        except (TypeError, OverflowError) as exc:
            raise HurrayFormatError("block_ids", f"{s.request_id}: block ids must be integers ({exc})") from None
        used = n - (need - 1) * block_size
        if need and used < block_size:
            partial.append((len(table) - 1, used))
        ptr.append(len(table))
        lens.append(n)
    if not table:
        empty = torch.empty(0, dtype=torch.int64)
        return BatchPlan(empty, empty, _int64(ptr), _int64(lens), empty, block_size)
    t = _int64(table)
    lo, hi = (int(x) for x in torch.aminmax(t))
    if lo < 0:
        raise HurrayFormatError("block_ids", f"negative block id {lo}")
    for r in reserved_blocks:
        if lo <= r <= hi and bool((t == r).any()):
            who = next(s.request_id for i, s in enumerate(seqs) if r in table[ptr[i] : ptr[i + 1]])
            raise HurrayFormatError("block_ids", f"{who}: reserved block [{r}] in its computed range")
    keep, block_table = _compact(t, hi)
    valid = torch.full((keep.numel(),), block_size, dtype=torch.int64)
    tails: dict[int, int] = {}
    if partial:
        # Only a sequence's last page can be partly used; a page another reference
        # uses in full (a longer sequence sharing it) has no unused tail.
        pages = block_table[torch.tensor([pos for pos, _ in partial], dtype=torch.int64)]
        refs = torch.bincount(block_table, minlength=keep.numel())
        partial_refs = torch.bincount(pages, minlength=keep.numel())
        only_partial = (refs[pages] == partial_refs[pages]).tolist()
        for page, (_, used), only in zip(pages.tolist(), partial, only_partial, strict=True):
            if only:
                tails[page] = max(used, tails.get(page, 0))
        for page, used in tails.items():
            valid[page] = used
    return BatchPlan(
        keep, block_table, _int64(ptr), _int64(lens), valid, block_size, tuple(sorted(tails.items())), max_block=hi
    )


def _plan_with_holes(seqs: Sequence[SequenceState], block_size: int, reserved_blocks: Sequence[int]) -> BatchPlan:
    """:func:`plan_batch` for a sliding-window group: leading reserved blocks become zero pages.

    Only ids in ``reserved_blocks`` are holes: in a cache of copied blocks
    (``reserved_blocks=()``) block 0 is a real block and its tokens are kept.
    """
    reserved = {int(r) for r in reserved_blocks}
    starts = []
    for s in seqs:
        need = -(-s.num_computed // block_size)
        ids = list(s.block_ids[:need])
        lead = 0
        while lead < len(ids) and ids[lead] in reserved:
            lead += 1
        late = next((b for b in ids[lead:] if b in reserved), None)
        if late is not None:
            raise HurrayFormatError(
                "block_ids", f"{s.request_id}: reserved block [{late}] after held ones (not a sliding window)"
            )
        starts.append(min(lead * block_size, s.num_computed))
    if not any(starts):
        return replace(plan_batch(seqs, block_size, reserved_blocks=reserved_blocks), kv_start=tuple(starts))
    # A reserved block stands for every freed page: gathered once as a real page, then zeroed whole.
    # Reserved ids occur only as leading holes (checked above), so every page of one is a hole's.
    plan = plan_batch(seqs, block_size, reserved_blocks=())
    tails = dict(plan.tails)
    valid = plan.valid.clone()
    holes = torch.isin(plan.keep, torch.tensor(sorted(reserved), dtype=torch.int64))
    for page in holes.nonzero().reshape(-1).tolist():
        tails[page] = 0
        valid[page] = 0
    return replace(plan, valid=valid, tails=tuple(sorted(tails.items())), kv_start=tuple(starts))


def _compact(table: torch.Tensor, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages in first-reference order, renumbered table) of a non-empty int64 ``table`` with ids <= ``hi``.

    First-reference order keeps a sequence's pages adjacent in the new pool (an
    identity-like, cache-friendly gather in the common unshared case). Through a
    lookup table over the ids when they are dense, as an engine's block ids are;
    sorting otherwise, so a stray huge id cannot size an allocation.
    """
    n = table.numel()
    if hi >= 4 * n + (1 << 16):
        plan = plan_compaction(table, hi + 1)
        return plan.keep, plan.block_table
    first = torch.full((hi + 1,), n, dtype=torch.int64)
    first.scatter_reduce_(0, table, torch.arange(n), reduce="amin")
    used = (first < n).nonzero().reshape(-1)
    keep = used[torch.argsort(first[used])]
    rank = first  # reused as the id -> new page lookup table
    rank[keep] = torch.arange(keep.numel())
    return keep, rank[table]


def _int64(a: array[int]) -> torch.Tensor:
    # A copy: the tensor then owns its memory rather than pinning the array's buffer.
    return torch.frombuffer(a, dtype=torch.int64).clone() if a else torch.empty(0, dtype=torch.int64)


class GatherBuffers:
    """One reusable (key, value) pair of page pools that layers are gathered into.

    A streaming export writes each layer out before it gathers the next, so
    all layers can share two buffers: peak extra memory is then exactly one
    layer's pages, and no layer after the first faults in new memory (on a
    CPU that costs about twice the copy). Keep one object across exports (a
    connector saving request after request) to reuse the memory of the
    first layer too. The buffers grow to the largest layer seen, never
    shrink, and are not safe to share between threads.
    """

    def __init__(self) -> None:
        # One allocation: K then V, adjacent when the pool size allows, so that a device
        # export zeroes and copies both roles with one launch each (see _kv_pair).
        self._raw: torch.Tensor | None = None
        self._twin: GatherBuffers | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held (both buffers, and the twin's)."""
        own = 0 if self._raw is None else int(self._raw.numel())
        return own + (self._twin.nbytes if self._twin is not None else 0)

    @property
    def memory(self) -> tuple[torch.Tensor, ...]:
        """The allocations behind the buffers (and the twin's): what to register with a transport.

        They change only when the buffers grow or are released.
        """
        own = () if self._raw is None else (self._raw,)
        return own + (self._twin.memory if self._twin is not None else ())

    def twin(self) -> GatherBuffers:
        """A second pair kept with this one, made on first use.

        Device exports alternate layers between the two, so one layer is gathered
        while the previous is still being copied to the host.
        """
        if self._twin is None:
            self._twin = GatherBuffers()
        return self._twin

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, count: int = 2
    ) -> tuple[torch.Tensor, ...]:
        """``count`` (2: K and V; 1: a fused latent) contiguous ``shape`` tensors of ``dtype`` on ``device``.

        They overwrite what the last call returned.
        """
        need = math.prod(shape) * dtype.itemsize
        at = need if need % 256 == 0 else -(-need // 256) * 256  # V's start, aligned for any kernel
        total = at * (count - 1) + need
        raw = self._raw
        if raw is None or raw.numel() < total or raw.device != device:
            self._raw = raw = torch.empty(total, dtype=torch.uint8, device=device)
        return tuple(raw[j * at : j * at + need].view(dtype).view(shape) for j in range(count))

    def release(self) -> None:
        """Drop the buffers and the twin's (they are allocated again when next needed)."""
        self._raw = None
        self._twin = None


#: Most MiB of gather buffers that host exports keep between calls, unless the environment
#: variable :data:`WORKSPACE_ENV` says otherwise (0 keeps none). See :func:`release_export_workspace`.
EXPORT_WORKSPACE_MIB = 256
WORKSPACE_ENV = "HURRAY_VLLM_EXPORT_WORKSPACE_MIB"
_spare: list[GatherBuffers] = []
_spare_lock = threading.Lock()


def _workspace_cap() -> int:
    """The workspace limit in bytes (read per export: a bad value is reported, not fatal at import)."""
    raw = os.environ.get(WORKSPACE_ENV)
    if raw is None:
        return EXPORT_WORKSPACE_MIB << 20
    try:
        return max(0, int(raw)) << 20
    except ValueError:
        log.warning("hurray: %s=%r is not a whole number of MiB; using %d", WORKSPACE_ENV, raw, EXPORT_WORKSPACE_MIB)
        return EXPORT_WORKSPACE_MIB << 20


@contextmanager
def _workspace(buffers: GatherBuffers | None, on_cuda: bool) -> Iterator[GatherBuffers]:
    """``buffers``, or gather buffers lent by the process for one export.

    A host export gathers into fresh memory otherwise, and faulting it in
    costs about twice the copy on the first layer (``docs/benchmarks.md``).
    So the buffers of a finished export are kept, like the CUDA caching
    allocator keeps freed blocks, up to ``HURRAY_VLLM_EXPORT_WORKSPACE_MIB``
    (default 256) in all,
    and lent to the next export; concurrent exports each get their own.
    Device exports allocate per call: the CUDA allocator already caches.
    """
    if buffers is not None:
        yield buffers
        return
    if on_cuda:
        yield GatherBuffers()
        return
    with _spare_lock:
        ws = _spare.pop() if _spare else GatherBuffers()
    try:
        yield ws
    finally:
        with _spare_lock:
            if ws.nbytes + sum(s.nbytes for s in _spare) <= _workspace_cap():
                _spare.append(ws)


def release_export_workspace() -> int:
    """Free the gather buffers host exports keep between calls; returns the bytes released.

    They are allocated again by the next export. Exports that pass their own
    :class:`GatherBuffers` never use them.
    """
    with _spare_lock:
        freed = sum(s.nbytes for s in _spare)
        _spare.clear()
    return freed


def _kv_pair(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``[2, *k.shape]`` over both pools when V directly follows K in memory; else None.

    :class:`GatherBuffers` lays them out so, and one launch then zeroes or copies both.
    """
    if (
        k.shape != v.shape
        or k.dtype != v.dtype
        or k.device != v.device
        or not (k.is_contiguous() and v.is_contiguous())
        or v.data_ptr() != k.data_ptr() + k.numel() * k.element_size()
        or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
    ):
        return None
    return k.as_strided((2, *k.shape), (k.numel(), *k.stride()), k.storage_offset())


#: One layer as the exporter yields it: ``(key, value)``, or ``(fused,)`` for an MLA latent.
Layer = tuple[BlockPagedTensor, ...]


def _first(cache: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return cache[0] if isinstance(cache, tuple) else cache


def export_layers(
    caches: Sequence[torch.Tensor | tuple[torch.Tensor, ...]],
    layout: KVLayout,
    plan: BatchPlan | Sequence[BatchPlan],
    *,
    storage_dtype: torch.dtype | None = None,
    zero_unused: bool = True,
    buffers: GatherBuffers | Sequence[GatherBuffers] | None = None,
) -> Iterator[Layer]:
    """Yield each layer's block-paged tensors, one layer at a time.

    A layer is ``(key, value)``, or ``(fused,)`` for a layout whose roles
    are ``("fused",)`` (:class:`~.layouts.MLALatent`). ``plan`` is one plan
    for every layer, or one per layer (the plan of the layer's KV cache
    group, in a sliding-window hybrid).

    Peak extra memory is one layer's compacted pages: nothing is gathered
    before the caller asks for the layer. With one :class:`GatherBuffers`
    every layer is gathered into the same two tensors, so a yielded layer's
    pools are only valid until the caller asks for the next layer (fine for
    writing a stream, wrong for collecting the layers). With one per layer,
    the layers stay valid together until the buffers are used again (a
    writer exporting chunk after chunk without allocating).

    Raises:
        HurrayFormatError: found for every layer before the first is
            gathered: (field ``block_ids``) a plan's block id past a layer's
            cache; (field ``block_size``) a plan made for blocks of another
            size than a layer's cache pages hold; (field ``cache``) a cache
            the layout cannot read. Also (field ``plan`` or ``buffers``) not
            one plan or gather buffers per layer.
    """
    if buffers is not None and not isinstance(buffers, GatherBuffers) and len(buffers) != len(caches):
        raise HurrayFormatError("buffers", f"{len(buffers)} gather buffers for {len(caches)} layers")
    # The ids go to each cache device once per export: a host-to-device copy per layer
    # would synchronise the stream, stalling the previous layer's device-to-host copy.
    plans = [plan] * len(caches) if isinstance(plan, BatchPlan) else list(plan)
    if len(plans) != len(caches):
        raise HurrayFormatError("plan", f"{len(plans)} plans for {len(caches)} layers")
    # Per plan (by identity) and device: the ids and tail rows are made once per export.
    keep_on: dict[tuple[int, torch.device], torch.Tensor] = {}
    tail_rows: dict[int, dict[tuple[torch.device, bool], torch.Tensor]] = {}
    # Before any gather: an id past a CUDA cache would be a device-side assert, not an IndexError.
    for i, (cache, p) in enumerate(zip(caches, plans, strict=True)):
        num = _num_blocks(layout, cache)
        if num is not None and p.max_block >= num:
            raise HurrayFormatError(
                "block_ids",
                f"layer {i}: block id {p.max_block} outside this cache of {num} blocks; "
                "the block tables do not belong to these caches",
            )
        # The gather copies whole cache pages; the plan numbers tokens in its blocks. Pages of 32 tokens under
        # blocks of 16 would carry the next block's slots (another request's KV) into the snapshot, and every
        # token past the first 16 of a page would be read back at the wrong position; so would the opposite.
        page = int(layout.page_shape(cache)[0])
        if page != p.block_size:
            raise HurrayFormatError(
                "block_size",
                f"the plan is for blocks of {p.block_size} tokens, layer {i}'s cache pages hold {page}; "
                "export with the engine's block size (EngineCache.block_size, export_options())",
            )
    roles = roles_of(layout)
    for i, cache in enumerate(caches):
        plan = plans[i]
        if storage_dtype is not None:
            cache = (
                tuple(as_storage_dtype(c, storage_dtype) for c in cache)
                if isinstance(cache, tuple)
                else as_storage_dtype(cache, storage_dtype)
            )
        first = _first(cache)
        out = None
        if buffers is not None:
            shape = (int(plan.keep.numel()), *layout.page_shape(cache))
            mine = buffers if isinstance(buffers, GatherBuffers) else buffers[i]
            out = mine.take(shape, first.dtype, first.device, len(roles))
        keep = keep_on.get((id(plan), first.device))
        if keep is None:
            keep = keep_on[id(plan), first.device] = plan.keep.to(first.device)
        del first
        try:
            pools = layout.gather(cache, keep, out)
        except IndexError as exc:  # a block id past the cache (the packed CPU layout names it itself)
            raise HurrayFormatError("block_ids", f"layer {i}: block ids outside this cache ({exc})") from exc
        del out
        if zero_unused or plan.kv_start is not None:  # a hole's page holds another request's KV: always zeroed
            _zero_tails(plan, pools, tail_rows.setdefault(id(plan), {}))
        yield tuple(
            BlockPagedTensor(pool, plan.block_table, plan.seq_ptr, plan.seq_lens, role, i)
            for pool, role in zip(pools, roles, strict=True)
        )
        # Drop this layer before the next is gathered: peak memory stays one layer.
        del pools, cache


def _num_blocks(layout: KVLayout, cache: torch.Tensor | tuple[torch.Tensor, ...]) -> int | None:
    """How many blocks ``cache`` holds in ``layout`` (a layout may say, ``num_blocks(cache)``); None: unknown."""
    own = getattr(layout, "num_blocks", None)
    if callable(own):
        return int(own(cache))
    if isinstance(layout, (FlashAttnLegacy, FlashInferLegacy)):  # [2, B, ...] or [B, 2, ...]
        return int(_first(cache).shape[1 - layout.kv_axis])
    if isinstance(layout, (LogicalBHNC, CpuPacked, MLALatent, PagedAttentionLegacy)):  # [B, ...] (a pair's key)
        return int(_first(cache).shape[0])
    return None


def _zero_tails(
    plan: BatchPlan,
    pools: Sequence[torch.Tensor],
    rows: dict[tuple[torch.device, bool], torch.Tensor],
    by_index: bool | None = None,
) -> None:
    """Zero the slots no sequence uses in a layer's (contiguous) pools: K and V, or one latent.

    On the host each partly used page is one memset. On a device that would be
    two kernel launches per page and layer, which costs more CPU time than the
    device-to-host copy of the layer takes: there (``by_index``, the default
    off the CPU), every unused slot's row goes in one index, built once per
    export and device and kept in ``rows``, and one fill covers both pools
    when they are adjacent (one per pool otherwise).
    """
    if not plan.tails:
        return
    k_pool = pools[0]
    dev = k_pool.device
    if not (by_index if by_index is not None else dev.type != "cpu"):
        for page, start in plan.tails:
            for pool in pools:
                pool[page, start:].zero_()
        return
    slots = k_pool.shape[0] * k_pool.shape[1]
    both = _kv_pair(k_pool, pools[1]) if len(pools) == 2 else None
    idx = rows.get((dev, both is not None))
    if idx is None:
        bs = plan.block_size
        flat = [page * bs + slot for page, start in plan.tails for slot in range(start, bs)]
        if both is not None:
            flat += [slots + r for r in flat]  # the same rows of the value half
        idx = rows[dev, both is not None] = torch.tensor(flat, dtype=torch.int64).to(dev)
    if both is not None:
        _bits(both).view(2 * slots, math.prod(k_pool.shape[2:])).index_fill_(0, idx, 0)
        return
    for pool in pools:
        _bits(pool).view(slots, math.prod(pool.shape[2:])).index_fill_(0, idx, 0)


#: Integer dtypes by width: zeroing through one zeroes every float format (index_fill_ has no float8 kernels).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its width: all-zero bits are 0.0 in every float format."""
    return t.view(_BITS[t.element_size()]) if t.dtype.is_floating_point else t


def _snapshot_shell(
    seqs: Sequence[SequenceState],
    fingerprint: ModelFingerprint | None,
    source: SnapshotSource | None,
    kv_scales: Sequence[tuple[float, float]] | None,
    *,
    transient: bool = False,
    latent: LatentSplit | None = None,
) -> KVSnapshot:
    # A transient shell only feeds header_records, which packs the ids straight into
    # an int64 array: copying every id into a tuple of ints first would be wasted.
    return KVSnapshot(
        keys=(),
        values=(),
        token_ids=tuple(s.token_ids if transient else tuple(map(int, s.token_ids)) for s in seqs),  # type: ignore[misc]
        fingerprint=fingerprint,
        kv_scales=tuple(kv_scales) if kv_scales is not None else None,
        source=source,
        request_ids=tuple(s.request_id for s in seqs),
        latent=latent,
    )


def export_snapshot(
    caches: Sequence[torch.Tensor | tuple[torch.Tensor, ...]],
    layout: KVLayout,
    seqs: Sequence[SequenceState],
    *,
    block_size: int,
    storage_dtype: torch.dtype | None = None,
    kv_scales: Sequence[tuple[float, float]] | None = None,
    fingerprint: ModelFingerprint | None = None,
    source: SnapshotSource | None = None,
    reserved_blocks: Sequence[int] = (0,),
    buffers: Sequence[GatherBuffers] | None = None,
    latent: LatentSplit | None = None,
    layer_groups: Sequence[int] | None = None,
    group_windows: Sequence[int | None] | None = None,
    states: RecurrentStates | None = None,
) -> KVSnapshot:
    """An in-memory :class:`KVSnapshot` of ``seqs`` (see :func:`export_stream` to bound memory).

    ``reserved_blocks`` (vLLM's null block 0 by default) may hold no computed
    token; pass ``()`` for caches that are copies of selected blocks.
    ``buffers``, one distinct :class:`GatherBuffers` per layer, makes the
    snapshot's pools views of those buffers (valid until they are used
    again) instead of new memory. ``latent`` (required for an MLA layout)
    says how its fused latent divides.

    A sliding-window hybrid has several KV cache groups: ``layer_groups``
    gives each layer's group, ``group_windows`` each group's window (``None``
    for full attention), and every sequence its ``group_block_ids``. A
    windowed group's leading ``reserved_blocks`` (vLLM's null block: freed,
    out of the window) become zero pages, and the snapshot's
    :class:`~hurray_vllm.SlidingWindows` says where each layer's held tokens
    begin; with ``reserved_blocks=()`` every block is real and nothing is a
    hole. A linear-attention hybrid's ``states`` (read by the caller, e.g.
    :meth:`~.states.StateCache.gather`) go along as they are.

    Raises:
        HurrayArgumentError: (field ``buffers``) not one distinct
            :class:`GatherBuffers` per layer (a single one would make every
            layer the last); (field ``kv_scales``) not one pair per layer.
        HurrayFormatError: block tables the caches cannot hold (a reserved
            block in a computed range, ids past a cache); (field
            ``block_size``) a ``block_size`` other than the tokens the
            caches' pages hold.
    """
    _check_scales(kv_scales, len(caches))
    _check_snapshot_buffers(buffers, len(caches))
    plan: BatchPlan | list[BatchPlan]
    windows = None
    if layer_groups is not None:
        plans, windows = _group_plans(seqs, block_size, layer_groups, group_windows, reserved_blocks)
        plan = plans
    else:
        plan = plan_batch(seqs, block_size, reserved_blocks=reserved_blocks)
    layers = list(export_layers(caches, layout, plan, storage_dtype=storage_dtype, buffers=buffers))
    shell = _snapshot_shell(seqs, fingerprint, source, kv_scales)
    return shell.with_layers(
        layers, windows=windows, latent=latent if roles_of(layout) == ("fused",) else None, states=states
    )


def _check_scales(kv_scales: Sequence[tuple[float, float]] | None, num_layers: int) -> None:
    """Refuse fp8 ``kv_scales`` that are not one ``(k_scale, v_scale)`` pair per layer."""
    if kv_scales is not None and len(kv_scales) != num_layers:
        raise HurrayArgumentError(
            "kv_scales",
            f"{len(kv_scales)} (k_scale, v_scale) pairs for {num_layers} layers; pass one pair per cache "
            "(EngineCache.export_options() gives the engine's), or None for a cache that is not fp8",
        )


def _check_snapshot_buffers(buffers: Sequence[GatherBuffers] | None, num_layers: int) -> None:
    """Refuse ``buffers`` that would make layers of one snapshot share memory.

    The snapshot keeps every layer, so each needs buffers of its own: with
    one :class:`GatherBuffers` (which :func:`export_layers` accepts, for a
    stream) or one listed twice, every layer would silently be the last.

    Raises:
        HurrayArgumentError: (field ``buffers``) not one distinct
            :class:`GatherBuffers` per layer.
    """
    if buffers is None:
        return
    if isinstance(buffers, GatherBuffers):
        raise HurrayArgumentError(
            "buffers",
            f"one GatherBuffers for {num_layers} layers: a snapshot keeps every layer, pass one per layer (or None)",
        )
    if len(buffers) != num_layers or len({id(b) for b in buffers}) != len(buffers):
        raise HurrayArgumentError(
            "buffers",
            f"{len({id(b) for b in buffers})} distinct GatherBuffers for {num_layers} layers; pass one per layer",
        )


def _group_plans(
    seqs: Sequence[SequenceState],
    block_size: int,
    layer_groups: Sequence[int],
    group_windows: Sequence[int | None] | None,
    reserved_blocks: Sequence[int] = (0,),
) -> tuple[list[BatchPlan], SlidingWindows]:
    """One plan per KV cache group (layers of a group share it) and the layers' windows.

    ``reserved_blocks``: as for :func:`plan_batch`, in every group; in a
    windowed group they are the freed blocks (holes).
    """
    groups = sorted(set(layer_groups))
    wins = list(group_windows) if group_windows is not None else [None] * (max(groups, default=-1) + 1)
    if groups and (groups[0] < 0 or groups[-1] >= len(wins)):
        raise HurrayFormatError("layer_groups", f"layers name groups {groups}, {len(wins)} groups are known")
    by_group: dict[int, BatchPlan] = {}
    for g in groups:
        per_seq = []
        for s in seqs:
            if len(s.group_block_ids) <= g:
                raise HurrayFormatError("group_block_ids", f"{s.request_id}: no block table for KV cache group {g}")
            per_seq.append(replace(s, block_ids=s.group_block_ids[g]))
        by_group[g] = plan_batch(per_seq, block_size, reserved_blocks=reserved_blocks, holes=wins[g] is not None)
    plans = [by_group[g] for g in layer_groups]
    starts = tuple(p.kv_start if p.kv_start is not None else (0,) * len(seqs) for p in plans)
    return plans, SlidingWindows(tuple(wins[g] for g in layer_groups), starts)


def export_stream(
    f: BinaryIO,
    caches: Sequence[torch.Tensor | tuple[torch.Tensor, ...]],
    layout: KVLayout,
    seqs: Sequence[SequenceState],
    *,
    block_size: int,
    storage_dtype: torch.dtype | None = None,
    kv_scales: Sequence[tuple[float, float]] | None = None,
    fingerprint: ModelFingerprint | None = None,
    source: SnapshotSource | None = None,
    show_progress: bool = False,
    buffers: GatherBuffers | None = None,
    latent: LatentSplit | None = None,
    layer_groups: Sequence[int] | None = None,
    group_windows: Sequence[int | None] | None = None,
    states: RecurrentStates | None = None,
    heads: HeadRange | None = None,
    extra: dict[str, Any] | None = None,
) -> int:
    """Write ``seqs`` to ``f`` as a Hurray stream, gathering one layer at a time.

    Every layer is gathered into the same two buffers: extra memory is one
    layer's compacted pages. ``buffers``: a :class:`GatherBuffers` the caller
    keeps across calls; without it a host export to an :class:`io.IOBase`
    (a file, a socket's file, :class:`io.BytesIO`) borrows the buffers the
    last export left (up to ``HURRAY_VLLM_EXPORT_WORKSPACE_MIB``, see
    :func:`release_export_workspace`), so only the first export of a process
    faults in new memory; to any other sink it gathers into buffers of its
    own. ``show_progress=True`` shows a per-layer progress
    bar on a terminal. ``layer_groups``, ``group_windows`` and ``states``:
    as for :func:`export_snapshot` (the states follow the layers; they are
    the caller's, already in memory, and add to the one layer's pages).
    ``heads``: the caches hold these of the model's KV heads (one
    tensor-parallel rank's): the header says so (``docs/format.md`` 2.3d).
    ``extra``: more of the header's free-form metadata (``KVSnapshot.extra``).

    ``f.write`` must not keep the object it is given, as :mod:`io` requires
    of ``write()``: pools reach it as memoryviews over the gather buffers,
    which the next layer (and, through the buffers the caller or the process
    keeps, the next export, maybe of another request) overwrites. A sink
    that queues what it is given must copy it (``bytes(b)``) first. For a
    sink that is no :class:`io.IOBase` the buffers are this export's own, so
    one that keeps views anyway sees no other export's data (only its
    earlier layers overwritten by later ones).

    Raises:
        HurrayArgumentError: (field ``kv_scales``) not one pair per layer.
        HurrayFormatError: block tables the caches cannot hold, a
            ``block_size`` other than the tokens the caches' pages hold (field
            ``block_size``), or an MLA layout without ``latent``; found before
            anything is written.
    """
    # Before any work: a stream refused half-way is a truncated file.
    _check_scales(kv_scales, len(caches))
    if (roles_of(layout) == ("fused",)) != (latent is not None):
        raise HurrayFormatError("latent", "an MLA cache's export needs its LatentSplit, and only it has one")
    plan: BatchPlan | list[BatchPlan]
    windows = None
    if layer_groups is not None:
        plan, windows = _group_plans(seqs, block_size, layer_groups, group_windows)
    else:
        plan = plan_batch(seqs, block_size)
    on_cuda = bool(caches) and _first(caches[0]).device.type == "cuda"
    if buffers is None and not isinstance(f, io.IOBase):
        # A sink outside io's write() contract may keep the views it is given (a list, a queue for a
        # sender thread): through the process's workspace it would later show another export's KV.
        buffers = GatherBuffers()
    with _workspace(buffers, on_cuda) as buffers:
        # On a device, layers alternate between two buffer pairs so that one is gathered while
        # the previous is still being copied out; on the host one pair serves every layer.
        per_layer = [buffers.twin() if i % 2 else buffers for i in range(len(caches))] if on_cuda else buffers
        layers = export_layers(caches, layout, plan, storage_dtype=storage_dtype, buffers=per_layer)
        if show_progress:
            from ...progress import progress

            layers = progress(layers, desc="export", total=len(caches))
        # Made before the header is written: a device export's first layer is already on its way.
        host = to_host_overlapped(layers, device_slots=2 if on_cuda else 1)
        shell = _snapshot_shell(seqs, fingerprint, source, kv_scales, transient=True, latent=latent)
        if windows is not None or states is not None or heads is not None:
            shell = replace(shell, windows=windows, states=states, heads=heads)
        if extra:
            shell = replace(shell, extra={**shell.extra, **extra})
        # The header announces the layer count before any layer is written.
        total = write_records(header_records(shell, num_layers=len(caches)), f)
        # No enumerate(): it keeps its last result alive, i.e. the previous layer's pages.
        i = 0
        writer = LayerWriter()  # every layer shares the plan's index tensors: encoded once
        for members in host:
            total += writer.write(f, i, members, kv_scales[i] if kv_scales is not None else None)
            del members  # release this layer's pages before gathering the next
            i += 1
        return total + write_records(state_records(states), f)


def to_host_overlapped(layers: Iterator[Layer], *, device_slots: int = 1) -> Iterator[Layer]:
    """Layers with their pools in host memory; CUDA pools arrive through pinned buffers.

    CPU layers pass through untouched, one at a time. For CUDA layers, see
    :class:`HostLayers`; ``device_slots`` says how many device buffers the
    layers' pools rotate through (1: every layer reuses the same memory, as
    with one :class:`GatherBuffers`).
    """
    return HostLayers(layers, device_slots=device_slots)


#: One pinned host slot: a host pool per role, and the ``[2, ...]`` tensor holding K and V when they share a shape.
_Slot = tuple[tuple[torch.Tensor, ...], torch.Tensor | None]


class HostLayers:
    """Iterator over layers with host pools, staging CUDA layers ahead of the caller.

    Each CUDA layer (K and V, or one fused latent) is copied on a side
    stream into one of two pinned host buffers, with non-blocking
    transfers: while the caller writes layer ``i``, layer ``i+1`` is copied
    to the host, and layer ``i+2`` may already be gathered on the device
    when the pools rotate through two device buffers (``device_slots=2``).
    The first layer is staged as soon as the object is made, so work the
    caller does before iterating (a stream header) overlaps its transfer.
    A yielded layer's host pools are valid until the caller asks for the
    next layer.
    """

    def __init__(self, layers: Iterator[Layer], *, device_slots: int = 1) -> None:
        if device_slots not in (1, 2):
            raise ValueError(f"device_slots must be 1 or 2, not {device_slots}")
        self._layers = iter(layers)
        self._slots = device_slots
        self._pinned: list[_Slot | None] = [None, None]
        self._copier: torch.cuda.Stream | None = None
        self._compute: torch.cuda.Stream | None = None
        # (host layer, its copy's event; None for a CPU layer), oldest first: at most two.
        self._staged: list[tuple[Layer, torch.cuda.Event | None]] = []
        self._copied = 0
        self._done = False
        self._pull()

    def __iter__(self) -> HostLayers:
        return self

    def __next__(self) -> Layer:
        if not self._staged:
            self._pull()
        if not self._staged:
            raise StopIteration
        if self._staged[0][1] is not None and len(self._staged) == 1:
            # Queue the next layer's gather and copy before waiting on this one.
            self._pull()
        layer, copied = self._staged.pop(0)
        if copied is not None:
            copied.synchronize()
        return layer

    def _pull(self) -> None:
        if self._done:
            return
        try:
            members = next(self._layers)
        except StopIteration:
            self._done = True
            return
        if members[0].page_pool.device.type != "cuda":
            # A CPU layer is handed over as is; the next is pulled only when the
            # caller is done with it (it may share this layer's buffers).
            self._staged.append((members, None))
            return
        self._staged.append(self._stage(members))

    def _host_slot(self, i: int, pools: Sequence[torch.Tensor]) -> _Slot:
        """Slot ``i % 2``, reallocated when this layer's pools do not fit it."""
        slot = self._pinned[i % 2]
        if slot is not None and len(slot[0]) == len(pools):
            if all(h.shape == d.shape and h.dtype == d.dtype for h, d in zip(slot[0], pools, strict=True)):
                return slot
        # The caller is done with the layer that used this slot two layers ago.
        if len(pools) == 2 and pools[0].shape == pools[1].shape and pools[0].dtype == pools[1].dtype:
            pair = torch.empty((2, *pools[0].shape), dtype=pools[0].dtype, pin_memory=True)
            slot = ((pair[0], pair[1]), pair)
        else:
            slot = (tuple(torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in pools), None)
        self._pinned[i % 2] = slot
        return slot

    def _stage(self, members: Layer) -> tuple[Layer, torch.cuda.Event]:
        dev = members[0].page_pool.device
        if self._copier is None or self._compute is None or self._copier.device != dev:
            # Looked up once per device: torch.cuda.current_stream costs more than a copy launch.
            self._compute = torch.cuda.current_stream(dev)
            self._copier = torch.cuda.Stream(dev)
        compute = self._compute
        i = self._copied
        self._copied += 1
        pools = [t.page_pool for t in members]
        hosts, pair = self._host_slot(i, pools)
        both = _kv_pair(pools[0], pools[1]) if pair is not None else None
        self._copier.wait_stream(compute)  # the gather (and tail zeroing) of this layer
        with torch.cuda.stream(self._copier):
            if both is not None and pair is not None:
                pair.copy_(both, non_blocking=True)  # adjacent pools: one transfer
            else:
                for h, d in zip(hosts, pools, strict=True):
                    h.copy_(d, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        # The allocator must not hand these pools out again before the copy has read them.
        for j, d in enumerate(pools):
            if j == 0 or both is None:
                d.record_stream(self._copier)
        if self._slots == 1:
            # The next gather overwrites these device buffers: after this copy.
            compute.wait_event(event)
        elif self._staged and self._staged[-1][1] is not None:
            # Two device buffers: the gather after next reuses the previous layer's
            # (a previous layer already handed over was waited for then).
            compute.wait_event(self._staged[-1][1])
        # Built directly: dataclasses.replace costs more than the copy launches (no-op .cpu() on host tensors).
        host_layer = tuple(
            BlockPagedTensor(
                page_pool=buf,
                block_table=t.block_table.cpu(),
                seq_ptr=t.seq_ptr.cpu(),
                seq_lens=t.seq_lens.cpu() if t.seq_lens is not None else None,
                kv_role=t.kv_role,
                layer_index=t.layer_index,
                index_type=t.index_type,
                quantization=t.quantization,
                quant_buffers=tuple(b.cpu() for b in t.quant_buffers),
                num_tokens=t.num_tokens,
            )
            for t, buf in zip(members, hosts, strict=True)
        )
        return host_layer, event
