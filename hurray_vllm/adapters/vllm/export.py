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

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import BinaryIO

import torch

from ...errors import HurrayFormatError
from ...paged import BlockPagedTensor, plan_compaction
from ...records import header_records, layer_records
from ...snapshot import KVSnapshot, ModelFingerprint, SnapshotSource
from ...stream import write_records
from .layouts import KVLayout, as_storage_dtype

__all__ = [
    "GatherBuffers",
    "SequenceState",
    "BatchPlan",
    "plan_batch",
    "export_layers",
    "export_snapshot",
    "export_stream",
    "to_host_overlapped",
]


@dataclass(frozen=True)
class SequenceState:
    """What a sequence holds in the engine's cache.

    Attributes:
        request_id: the caller's name for the sequence.
        block_ids: the engine's block table for it (may hold blocks
            allocated ahead; only the ones covering ``num_computed`` are read).
        num_computed: tokens whose K/V are in the cache.
        token_ids: prompt and generated token ids (``>= num_computed``).
    """

    request_id: str
    block_ids: Sequence[int]
    num_computed: int
    token_ids: Sequence[int]


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


def plan_batch(seqs: Sequence[SequenceState], block_size: int, *, reserved_blocks: Sequence[int] = (0,)) -> BatchPlan:
    """Compaction plan for ``seqs`` over an engine cache of ``block_size`` blocks.

    ``reserved_blocks`` (vLLM's null block 0) may never hold a computed token.
    """
    tables: list[int] = []
    ptr = [0]
    lens = []
    for s in seqs:
        if s.num_computed < 0 or s.num_computed > len(s.token_ids):
            raise HurrayFormatError(
                "num_computed", f"{s.request_id}: {s.num_computed} computed tokens but {len(s.token_ids)} token ids"
            )
        need = -(-s.num_computed // block_size)
        if need > len(s.block_ids):
            raise HurrayFormatError(
                "block_ids",
                f"{s.request_id}: {s.num_computed} tokens need {need} blocks, the engine lists {len(s.block_ids)}",
            )
        own = [int(b) for b in s.block_ids[:need]]
        bad = set(own) & set(reserved_blocks)
        if bad:
            raise HurrayFormatError("block_ids", f"{s.request_id}: reserved block {sorted(bad)} in its computed range")
        tables.extend(own)
        ptr.append(len(tables))
        lens.append(s.num_computed)
    table = torch.tensor(tables, dtype=torch.int64)
    plan = plan_compaction(table, int(table.max()) + 1 if table.numel() else 0)
    seq_ptr = torch.tensor(ptr, dtype=torch.int64)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    # Valid slots per snapshot page, over every sequence that references it.
    probe = BlockPagedTensor(
        torch.empty(int(plan.keep.numel()), block_size, 0, 0),
        plan.block_table,
        seq_ptr,
        seq_lens,
    )
    valid = probe.valid_slots()
    part = (valid < block_size).nonzero().reshape(-1)
    tails = tuple(zip(part.tolist(), valid[part].clamp(min=0).tolist(), strict=True))
    return BatchPlan(plan.keep, plan.block_table, seq_ptr, seq_lens, valid, block_size, tails)


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
        self._raw: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held (both buffers)."""
        return 0 if self._raw is None else 2 * int(self._raw[0].numel())

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two contiguous ``shape`` tensors of ``dtype`` on ``device``, overwriting what the last call returned."""
        need = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        raw = self._raw
        if raw is None or raw[0].numel() < need or raw[0].device != device:
            self._raw = raw = (
                torch.empty(need, dtype=torch.uint8, device=device),
                torch.empty(need, dtype=torch.uint8, device=device),
            )
        return raw[0][:need].view(dtype).view(shape), raw[1][:need].view(dtype).view(shape)

    def release(self) -> None:
        """Drop the buffers (they are allocated again when next needed)."""
        self._raw = None


def export_layers(
    caches: Sequence[torch.Tensor | tuple[torch.Tensor, ...]],
    layout: KVLayout,
    plan: BatchPlan,
    *,
    storage_dtype: torch.dtype | None = None,
    zero_unused: bool = True,
    buffers: GatherBuffers | Sequence[GatherBuffers] | None = None,
) -> Iterator[tuple[BlockPagedTensor, BlockPagedTensor]]:
    """Yield each layer's (key, value) block-paged tensors, one layer at a time.

    Peak extra memory is one layer's compacted pages: nothing is gathered
    before the caller asks for the layer. With one :class:`GatherBuffers`
    every layer is gathered into the same two tensors, so a yielded layer's
    pools are only valid until the caller asks for the next layer (fine for
    writing a stream, wrong for collecting the layers). With one per layer,
    the layers stay valid together until the buffers are used again (a
    writer exporting chunk after chunk without allocating).
    """
    if buffers is not None and not isinstance(buffers, GatherBuffers) and len(buffers) != len(caches):
        raise HurrayFormatError("buffers", f"{len(buffers)} gather buffers for {len(caches)} layers")
    for i, cache in enumerate(caches):
        if storage_dtype is not None:
            cache = (
                tuple(as_storage_dtype(c, storage_dtype) for c in cache)
                if isinstance(cache, tuple)
                else as_storage_dtype(cache, storage_dtype)
            )
        out = None
        if buffers is not None:
            first = cache[0] if isinstance(cache, tuple) else cache
            shape = (int(plan.keep.numel()), *layout.page_shape(cache))
            mine = buffers if isinstance(buffers, GatherBuffers) else buffers[i]
            out = mine.take(shape, first.dtype, first.device)
        k_pool, v_pool = layout.gather(cache, plan.keep, out)
        del out
        if zero_unused:
            for page, start in plan.tails:
                k_pool[page, start:].zero_()
                v_pool[page, start:].zero_()
        yield (
            BlockPagedTensor(k_pool, plan.block_table, plan.seq_ptr, plan.seq_lens, "key", i),
            BlockPagedTensor(v_pool, plan.block_table, plan.seq_ptr, plan.seq_lens, "value", i),
        )
        # Drop this layer before the next is gathered: peak memory stays one layer.
        del k_pool, v_pool, cache


def _snapshot_shell(
    seqs: Sequence[SequenceState],
    fingerprint: ModelFingerprint | None,
    source: SnapshotSource | None,
    kv_scales: Sequence[tuple[float, float]] | None,
    *,
    transient: bool = False,
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
) -> KVSnapshot:
    """An in-memory :class:`KVSnapshot` of ``seqs`` (see :func:`export_stream` to bound memory).

    ``reserved_blocks`` (vLLM's null block 0 by default) may hold no computed
    token; pass ``()`` for caches that are copies of selected blocks.
    ``buffers``, one :class:`GatherBuffers` per layer, makes the snapshot's
    pools views of those buffers (valid until they are used again) instead
    of new memory.
    """
    plan = plan_batch(seqs, block_size, reserved_blocks=reserved_blocks)
    layers = list(export_layers(caches, layout, plan, storage_dtype=storage_dtype, buffers=buffers))
    shell = _snapshot_shell(seqs, fingerprint, source, kv_scales)
    return replace(shell, keys=tuple(k for k, _ in layers), values=tuple(v for _, v in layers))


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
) -> int:
    """Write ``seqs`` to ``f`` as a Hurray stream, gathering one layer at a time.

    Every layer is gathered into the same two buffers (``buffers``, or a
    pair allocated for this call): extra memory is one layer's compacted
    pages. Pass a :class:`GatherBuffers` kept across calls to reuse that
    memory from one export to the next. ``show_progress=True`` shows a
    per-layer progress bar on a terminal.
    """
    plan = plan_batch(seqs, block_size)
    shell = _snapshot_shell(seqs, fingerprint, source, kv_scales, transient=True)
    # The header announces the layer count before any layer is gathered.
    total = write_records(header_records(shell, num_layers=len(caches)), f)
    buffers = buffers if buffers is not None else GatherBuffers()
    layers = export_layers(caches, layout, plan, storage_dtype=storage_dtype, buffers=buffers)
    if show_progress:
        from ...progress import progress

        layers = progress(layers, desc="export", total=len(caches))
    # No enumerate(): it keeps its last result alive, i.e. the previous layer's pages.
    i = 0
    narrowed: dict[tuple[int, str], torch.Tensor] = {}  # every layer shares the plan's index tensors
    for k, v in to_host_overlapped(layers):
        total += write_records(layer_records(i, k, v, kv_scales[i] if kv_scales is not None else None, narrowed), f)
        del k, v  # release this layer's pages before gathering the next
        i += 1
    return total


def to_host_overlapped(
    layers: Iterator[tuple[BlockPagedTensor, BlockPagedTensor]],
) -> Iterator[tuple[BlockPagedTensor, BlockPagedTensor]]:
    """Layers with their pools in host memory; CUDA pools arrive through pinned buffers.

    While the caller writes layer ``i``, layer ``i+1`` is gathered on the
    device and copied into the other of two pinned buffers with a
    non-blocking transfer: device-to-host copies overlap the writes. CPU
    layers pass through untouched.
    """
    pending: tuple[tuple[BlockPagedTensor, BlockPagedTensor], torch.cuda.Event] | None = None
    buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
    i = -1
    for k, v in layers:
        i += 1
        if k.page_pool.device.type != "cuda":
            if pending is not None:
                pending[1].synchronize()
                yield pending[0]
                pending = None
            yield k, v
            del k, v  # the caller is done with this layer: do not hold it while the next is gathered
            continue
        slot = buffers[i % 2]
        if slot is None or slot[0].shape != k.page_pool.shape or slot[0].dtype != k.page_pool.dtype:
            slot = (
                torch.empty(k.page_pool.shape, dtype=k.page_pool.dtype, pin_memory=True),
                torch.empty(v.page_pool.shape, dtype=v.page_pool.dtype, pin_memory=True),
            )
            buffers[i % 2] = slot
        slot[0].copy_(k.page_pool, non_blocking=True)
        slot[1].copy_(v.page_pool, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        host = tuple(
            replace(
                t,
                page_pool=buf,
                block_table=t.block_table.cpu(),
                seq_ptr=t.seq_ptr.cpu(),
                seq_lens=t.seq_lens.cpu() if t.seq_lens is not None else None,
            )
            for t, buf in ((k, slot[0]), (v, slot[1]))
        )
        if pending is not None:
            pending[1].synchronize()
            yield pending[0]
        # The generator resumes only after the caller is done with the layer
        # it was handed, so the buffer pair used two layers ago is free again.
        pending = ((host[0], host[1]), done)
    if pending is not None:
        pending[1].synchronize()
        yield pending[0]
