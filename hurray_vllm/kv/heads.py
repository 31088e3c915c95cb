"""Snapshots split by KV heads: what each tensor-parallel rank of an engine holds, and joining them.

At tensor parallelism ``tp`` an engine gives each rank ``num_kv_heads / tp``
of every layer's KV heads (rank ``r`` the ``r``-th run of them, in model
order). With fewer KV heads than ranks it replicates them instead: each head
lives on ``tp / num_kv_heads`` consecutive ranks. An MLA latent (one
"head") is on every rank. A linear-attention hybrid's states split with
the heads: a slice of heads ``a .. b - 1`` of ``n`` holds the part ``a / n``
to ``b / n`` of every state (:meth:`~hurray_vllm.kv.states.RecurrentStates.take`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..errors import HurrayArgumentError, HurrayFormatError
from .snapshot import HeadRange, KVSnapshot
from .states import join_states

__all__ = ["rank_heads", "distinct_ranks", "concat_heads", "select_heads", "partitions"]


def _refuse_quantized(snap: KVSnapshot, what: str) -> None:
    """Refuse a snapshot whose tensors carry quantization: their scales are not split or joined by heads."""
    for t in snap.tensors():
        if t.quantization is not None or t.quant_buffers:
            raise HurrayFormatError(
                "quantization",
                f"layer {t.layer_index} {t.kv_role} is quantized ({type(t.quantization).__name__}); {what} "
                "does not split or join quantization parameters by heads: dequantize the snapshot first",
            )


def rank_heads(num_kv_heads: int, tp: int, rank: int) -> range:
    """The model's KV heads rank ``rank`` of ``tp`` holds.

    Raises:
        HurrayArgumentError: ``tp`` below 1 (field ``tensor_parallel_size``) or
            ``rank`` outside ``0 .. tp - 1`` (field ``rank``): the caller's.
        HurrayFormatError: (field ``num_kv_heads``) heads that do not divide
            among, or replicate over, ``tp`` ranks.

    Example:
        >>> rank_heads(8, 2, 1), rank_heads(2, 4, 3)
        (range(4, 8), range(1, 2))
    """
    if tp < 1:
        raise HurrayArgumentError("tensor_parallel_size", f"must be at least 1, got {tp}")
    if not 0 <= rank < tp:
        raise HurrayArgumentError("rank", f"rank {rank} is outside the {tp} ranks 0..{tp - 1}")
    if num_kv_heads < 1:
        raise HurrayFormatError("num_kv_heads", f"{num_kv_heads} KV heads")
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise HurrayFormatError("num_kv_heads", f"{num_kv_heads} KV heads do not divide among {tp} ranks")
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    if tp % num_kv_heads:
        raise HurrayFormatError("num_kv_heads", f"{num_kv_heads} KV heads cannot be replicated over {tp} ranks")
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


def distinct_ranks(num_kv_heads: int, tp: int) -> list[int]:
    """One rank per distinct head range, in head order (replicas left out).

    Example:
        >>> distinct_ranks(8, 4), distinct_ranks(2, 4)
        ([0, 1, 2, 3], [0, 2])

    Raises:
        HurrayArgumentError: as :func:`rank_heads` (``tp`` below 1: field ``tensor_parallel_size``,
            not "no rank exports").
    """
    if tp < 1:
        raise HurrayArgumentError("tensor_parallel_size", f"must be at least 1, got {tp}")
    out, seen = [], set()
    for r in range(tp):
        heads = rank_heads(num_kv_heads, tp, r)
        if heads.start not in seen:
            seen.add(heads.start)
            out.append(r)
    return out


def concat_heads(parts: Sequence[KVSnapshot]) -> KVSnapshot:
    """One snapshot holding every part's KV heads, in the order given (each part: a run of heads).

    The parts must be the same batch exported from one engine: the same
    layers, block tables, sequences and token ids, sliding windows (which
    tokens each layer holds) and latent split, differing only in their
    heads. The first part's metadata is kept.

    Raises:
        HurrayFormatError: (field ``snapshot.structure``) parts that differ in
            anything but their heads; (``snapshot.heads``) parts whose ranges
            are not one run in order, or a part whose pools hold another number
            of heads than its range says; (``quantization``) a quantized part; (``snapshot.states``) linear-attention
            states that are not the parts' shares (:func:`~hurray_vllm.kv.states.join_states`).
    """
    if not parts:
        raise HurrayFormatError("snapshot.structure", "no parts to join")
    for i, p in enumerate(parts):
        _refuse_quantized(p, "concat_heads")
        # The joined range is read from the parts' ranges: a part whose pools hold other heads would
        # shift every later part's heads (and the result's count) under a range that does not say so.
        count = p.head_range.count
        odd = next((t for t in p.tensors() if t.page_pool.dim() != 4 or t.num_heads != count), None)
        if odd is not None:
            raise HurrayFormatError(
                "snapshot.heads",
                f"part {i}'s layer {odd.layer_index} {odd.kv_role} pool is {list(odd.page_pool.shape)}, but its "
                f"head range {p.head_range.start}..{p.head_range.stop} says [num_pages, page_size, {count}, head_dim]",
            )
    first = parts[0]
    if len(parts) == 1:
        h = first.heads
        return replace(first, heads=None) if h is not None and (h.start, h.stop) == (0, h.total) else first
    with_states = [p.states for p in parts if p.states is not None]
    if with_states and len(with_states) != len(parts):
        raise HurrayFormatError("snapshot.states", "some parts carry linear-attention states and some do not")
    for i, p in enumerate(parts[1:], 1):
        same = (
            p.num_layers == first.num_layers
            and p.roles == first.roles
            and p.token_ids == first.token_ids
            and p.num_seqs == first.num_seqs
            and (not p.num_layers or p.seq_lens == first.seq_lens)
            and p.kv_scales == first.kv_scales
            # What the first part's metadata says of every part's pools: the tokens each layer holds, the split.
            and p.windows == first.windows
            and p.latent == first.latent
            and all(
                torch.equal(a.block_table, b.block_table)
                and torch.equal(a.seq_ptr, b.seq_ptr)
                and a.page_pool.shape[:2] == b.page_pool.shape[:2]
                and a.page_pool.shape[3:] == b.page_pool.shape[3:]
                and a.page_pool.dtype == b.page_pool.dtype
                and (a.layer_index, a.kv_role) == (b.layer_index, b.kv_role)
                for a, b in zip(p.tensors(), first.tensors(), strict=True)
            )
        )
        if not same:
            raise HurrayFormatError("snapshot.structure", f"part {i} is another batch or layout than part 0")
    ranges = [p.head_range for p in parts]
    if any(a.stop != b.start or a.total != b.total for a, b in itertools.pairwise(ranges)):
        raise HurrayFormatError(
            "snapshot.heads", f"parts hold heads {[(r.start, r.stop) for r in ranges]}: not one run in order"
        )
    layers = [
        tuple(
            replace(t, page_pool=torch.cat([p.layer(i)[j].page_pool for p in parts], dim=2))
            for j, t in enumerate(members)
        )
        for i, members in enumerate(first.layer_members())
    ]
    start, stop, total = ranges[0].start, ranges[-1].stop, ranges[0].total
    states = join_states(with_states) if with_states else None  # each part: its heads' share
    return first.with_layers(
        layers, heads=None if (start, stop) == (0, total) else HeadRange(start, stop, total), states=states
    )


def select_heads(snap: KVSnapshot, heads: range) -> KVSnapshot:
    """The KV heads ``heads`` of every layer (views of its pools), marked as a slice; its states' share with them.

    The pools are views; the states' share is a view of a member with one
    section and a copy of one with several (:meth:`~hurray_vllm.kv.states.RecurrentStates.take`).

    Raises:
        HurrayFormatError: (field ``snapshot.heads``) heads outside the snapshot's, or an MLA latent (one head);
            (``quantization``) a quantized snapshot.
        HurrayArgumentError: ``heads`` is not a run of consecutive heads (a step other than 1).
    """
    have = snap.head_range
    if heads.step != 1:
        raise HurrayArgumentError("heads", f"a run of consecutive heads (step 1), not {heads}")
    if snap.is_latent:
        raise HurrayFormatError("snapshot.heads", "an MLA latent is one head: it is not split")
    _refuse_quantized(snap, "select_heads")
    if heads.start < have.start or heads.stop > have.stop or not len(heads):
        raise HurrayFormatError(
            "snapshot.heads", f"heads {heads.start}..{heads.stop} outside {have.start}..{have.stop}"
        )
    lo, hi = heads.start - have.start, heads.stop - have.start
    layers = [tuple(replace(t, page_pool=t.page_pool[:, :, lo:hi]) for t in m) for m in snap.layer_members()]
    total = have.total
    states = snap.states.take(heads.start, heads.stop, total) if snap.states is not None else None
    return snap.with_layers(
        layers,
        heads=None if (heads.start, heads.stop) == (0, total) else HeadRange(heads.start, heads.stop, total),
        states=states,
    )


def partitions(num_kv_heads: int) -> list[list[range]]:
    """The ways producers may split ``num_kv_heads`` into equal runs (one per distinct rank), whole first.

    A producer at TP ``t`` stores ``min(t, num_kv_heads)`` runs: a divisor of ``num_kv_heads``.

    Example:
        >>> [[(r.start, r.stop) for r in p] for p in partitions(4)]
        [[(0, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 3), (3, 4)]]
    """
    out = []
    for d in range(1, num_kv_heads + 1):  # every divisor: 6 heads at TP 3 store 3 slices of 2
        if num_kv_heads % d == 0:
            per = num_kv_heads // d
            out.append([range(i * per, (i + 1) * per) for i in range(d)])
    return out
