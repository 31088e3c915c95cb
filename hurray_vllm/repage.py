"""Repaging: the same sequences over pages of another size.

Engines disagree on page sizes (vLLM's CPU backend uses 128, its GPU
backends 16, FlashAttention-2's paged kernel wants multiples of 256), so
importers repage. The plan is computed once per batch and applied to every
layer and role:

* every sequence keeps its tokens, in order;
* a target page is identified by the source *slots* it holds (source page
  id and offset, for each of its ``page_size`` positions). Two sequences'
  target pages that hold exactly the same slots become one physical page,
  so a shared prefix stays shared wherever it covers whole target pages;
* slots past a sequence's end are zero;
* no target page is created that no token needs.

Everything is vectorised torch on the tensors' own device: one gather per
layer and role, no per-token Python loop, no trip through host memory for
CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .descriptor import PerBlockAffine
from .errors import HurrayFormatError
from .paged import BlockPagedTensor
from .snapshot import KVSnapshot

__all__ = ["RepagePlan", "plan_repage", "repage", "repage_snapshot"]


@dataclass(frozen=True)
class RepagePlan:
    """Where each slot of the new pool comes from.

    Attributes:
        page_size: the target page size.
        src_slots: int64 ``[num_pages * page_size]``: for each new slot the
            flat source slot (``page * src_page_size + offset``), or -1 for
            a slot no sequence uses (left zero).
        block_table, seq_ptr, seq_lens: the new block structure (int64).
    """

    page_size: int
    src_slots: torch.Tensor
    block_table: torch.Tensor
    seq_ptr: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def num_pages(self) -> int:
        return int(self.src_slots.numel()) // self.page_size


def plan_repage(
    block_table: torch.Tensor,
    seq_ptr: torch.Tensor,
    seq_lens: torch.Tensor,
    src_page_size: int,
    page_size: int,
) -> RepagePlan:
    """Plan moving a batch from pages of ``src_page_size`` to pages of ``page_size``."""
    if page_size <= 0:
        raise HurrayFormatError("page_size", f"target page size must be positive, got {page_size}")
    dev = block_table.device
    seq_lens = seq_lens.to(dev)
    seq_ptr = seq_ptr.to(dev)
    num_seqs = int(seq_lens.numel())
    need = (seq_lens + page_size - 1) // page_size  # target pages per sequence
    new_ptr = torch.zeros(num_seqs + 1, dtype=torch.int64, device=dev)
    if num_seqs:
        torch.cumsum(need, 0, out=new_ptr[1:])
    total = int(new_ptr[-1])
    if total == 0:
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        return RepagePlan(page_size, empty, empty, new_ptr, seq_lens.clone())
    # For every target logical page (s, j) and position r: token t = j*T + r of s.
    seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=dev), need)
    j = torch.arange(total, device=dev) - new_ptr[:-1][seq_of]
    t = j[:, None] * page_size + torch.arange(page_size, device=dev)[None, :]
    valid = t < seq_lens[seq_of][:, None]
    t = torch.where(valid, t, torch.zeros_like(t))
    src_page = block_table[seq_ptr[:-1][seq_of][:, None] + t // src_page_size]
    slots = torch.where(valid, src_page * src_page_size + t % src_page_size, torch.full_like(t, -1))
    # Target pages holding the same slots are one page; keep first-use order.
    uniq, inverse = torch.unique(slots, dim=0, return_inverse=True)
    first = torch.full((uniq.shape[0],), total, dtype=torch.int64, device=dev)
    first.scatter_reduce_(0, inverse, torch.arange(total, device=dev), reduce="amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=dev)
    return RepagePlan(
        page_size=page_size,
        src_slots=uniq[order].reshape(-1),
        block_table=rank[inverse],
        seq_ptr=new_ptr,
        seq_lens=seq_lens.clone(),
    )


def _gather_slots(src: torch.Tensor, src_slots: torch.Tensor, per_slot: int) -> torch.Tensor:
    """New flat storage: ``per_slot`` elements per slot gathered from ``src``; unused slots zero.

    One ``index_select`` writes every output byte once (boolean-mask
    indexing would write them three times through a slow per-element path);
    the few unused slots are then zeroed in one ``index_fill_`` over the
    widest integer view of a row, which also works for float8 rows.
    """
    flat = src.reshape(-1, per_slot)
    idx = src_slots.to(src.device)
    if flat.shape[0] == 0:
        return torch.zeros(idx.numel(), per_slot, dtype=src.dtype, device=src.device)
    out = flat.index_select(0, idx.clamp(min=0))
    unused = (idx < 0).nonzero().reshape(-1)
    if unused.numel():
        row_bytes = per_slot * out.element_size()
        wide = torch.int64 if row_bytes % 8 == 0 else torch.int32 if row_bytes % 4 == 0 else torch.uint8
        out.view(wide).index_fill_(0, unused, 0)
    return out


def repage(t: BlockPagedTensor, page_size: int, plan: RepagePlan | None = None) -> BlockPagedTensor:
    """``t`` over pages of ``page_size`` tokens (see the module docstring).

    Per-page-slot quantization parameters (per-block-affine) move with their
    slots; per-tensor and per-channel parameters are unchanged.
    """
    if t.seq_lens is None:
        raise HurrayFormatError("seq_lens", "repaging needs the sequence lengths, which this tensor does not carry")
    plan = plan or plan_repage(t.block_table, t.seq_ptr, t.seq_lens, t.page_size, page_size)
    per_slot = t.num_heads * t.head_dim
    pool = _gather_slots(t.page_pool.reshape(-1, per_slot), plan.src_slots, per_slot)
    pool = pool.view(plan.num_pages, page_size, t.num_heads, t.head_dim)
    q, qbufs = t.quantization, t.quant_buffers
    if isinstance(q, PerBlockAffine) and qbufs:
        slots_in = t.num_pages * t.page_size
        qbufs = tuple(
            _gather_slots(b.reshape(slots_in, -1), plan.src_slots, b.numel() // max(1, slots_in)).reshape(-1)
            for b in qbufs
        )
        q = replace(q, block_size=page_size)
    return replace(
        t,
        page_pool=pool,
        block_table=plan.block_table.to(t.block_table.device),
        seq_ptr=plan.seq_ptr.to(t.seq_ptr.device),
        seq_lens=plan.seq_lens.to(t.seq_lens.device),
        quantization=q,
        quant_buffers=qbufs,
        num_tokens=None,
    )


def repage_snapshot(snap: KVSnapshot, page_size: int) -> KVSnapshot:
    """Every layer and role of ``snap`` repaged with one shared plan."""
    if not snap.keys or snap.page_size == page_size:
        return snap
    k0 = snap.keys[0]
    if k0.seq_lens is None:
        raise HurrayFormatError("seq_lens", "repaging needs the sequence lengths, which this snapshot does not carry")
    plan = plan_repage(k0.block_table, k0.seq_ptr, k0.seq_lens, k0.page_size, page_size)
    return replace(
        snap,
        keys=tuple(repage(k, page_size, plan) for k in snap.keys),
        values=tuple(repage(v, page_size, plan) for v in snap.values),
    )
