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

import bisect
import errno
import math
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from ..errors import HurrayArgumentError, HurrayFormatError, ImportArgumentError, integer_arg
from ..wire.descriptor import PerBlockAffine
from ..wire.rules import LENGTH_DTYPES
from .paged import BlockPagedTensor, check_slot_params, check_structure, made_for, same_tensor
from .snapshot import KVSnapshot

__all__ = [
    "MAX_IMPORT_SLOTS",
    "check_page_budget",
    "RepagePlan",
    "check_budget",
    "check_structure",
    "check_memory",
    "same_tensor",
    "device_memory",
    "check_out_pool",
    "memory_span",
    "overlaps",
    "plan_repage",
    "refuse_pool_overlap",
    "repage",
    "repage_into",
    "repage_snapshot",
]


#: The most token slots (or padded block-table entries) an importer expands a batch into before it refuses.
#: A snapshot's pages may repeat (prefix sharing), so what an import allocates grows with the tokens and
#: sequences a snapshot *declares*, not with its size: a file of a few hundred KB can declare millions of
#: tokens over one page. Raise it for batches that really are that large.
MAX_IMPORT_SLOTS = 1 << 28


def check_budget(slots: int, what: str, field: str = "seq_lens") -> None:
    """Refuse to expand a batch into more than :data:`MAX_IMPORT_SLOTS` slots (before allocating them)."""
    if slots > MAX_IMPORT_SLOTS:
        raise HurrayFormatError(
            field,
            f"{what} would expand the batch into {slots} slots, over hurray_vllm.kv.repage.MAX_IMPORT_SLOTS "
            f"= {MAX_IMPORT_SLOTS}; raise it if the batch is meant to be this large",
        )


def device_memory(device: torch.device | str | None) -> int | None:
    """All the memory ``device`` has (host RAM for the CPU), in bytes; ``None`` where it cannot be told."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    try:
        if dev.type == "cpu":
            have = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
        elif dev.type == "cuda":
            have = int(torch.cuda.get_device_properties(dev).total_memory)
        else:
            return None
    except (ValueError, OSError, RuntimeError, AssertionError, AttributeError):  # no sysconf (Windows), no device
        return None
    return have if have > 0 else None


def check_page_budget(slots: int, tokens: int, page_size: int, what: str) -> None:
    """Refuse ``tokens`` paged into ``slots`` over :data:`MAX_IMPORT_SLOTS`, blaming whichever is too large.

    Over the budget only because of the pages asked for (five tokens padded to pages of ``2**40``) is the
    caller's ``page_size``; tokens over it whatever the page size are the data's (:func:`check_budget`).

    Raises:
        ImportArgumentError: (field ``page_size``) the padding alone goes over the budget.
        HurrayFormatError: (field ``seq_lens``) the tokens do.
    """
    if slots > MAX_IMPORT_SLOTS and tokens <= MAX_IMPORT_SLOTS:
        raise ImportArgumentError(
            "page_size",
            f"pages of {page_size} pad these {tokens} tokens into {slots} slots, over "
            f"hurray_vllm.kv.repage.MAX_IMPORT_SLOTS = {MAX_IMPORT_SLOTS}; use a smaller page size",
        )
    check_budget(slots, what)


def check_memory(nbytes: int, what: str, device: torch.device | str | None) -> None:
    """Refuse an import that would allocate more than ``device`` has at all, before allocating any of it.

    Slots (:func:`check_budget`) bound a batch's expansion, not its bytes: a
    slot holds ``num_heads x head_dim`` values, and one layer of a file of a
    few MB can declare hundreds of GB. Such an import cannot succeed; tried,
    it ends in an out-of-memory kill, or a failed allocation half-way through
    the layers. Callers count every layer that is held at once.

    Raises:
        OSError: ``ENOMEM``, as the readers raise when memory runs out: the
            machine's limit, not a verdict on the data (which may be a
            legitimate batch too large for this machine).
    """
    have = device_memory(device)
    if have is not None and nbytes > have:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        raise OSError(
            errno.ENOMEM,
            f"{what} would allocate {nbytes / 2**30:.1f} GiB on {dev}, which has {have / 2**30:.1f} GiB in all "
            "(the batch's declared tokens: check seq_lens, or import fewer sequences at a time)",
        )


#: Bytes of temporaries :func:`plan_repage` builds per target slot (token positions, source pages and
#: slots, the mask, the unique rows and their sort), counted before it builds them.
PLAN_BYTES_PER_SLOT = 64


@dataclass(frozen=True)
class RepagePlan:
    """Where each slot of the new pool comes from.

    Attributes:
        page_size: the target page size.
        src_slots: int64 ``[num_pages * page_size]``: for each new slot the
            flat source slot (``page * src_page_size + offset``), or -1 for
            a slot no sequence uses (left zero).
        block_table, seq_ptr, seq_lens: the new block structure (int64).
        run: slots copied as one row by the gather (``gcd`` of the page
            sizes for a plan from :func:`plan_repage`; 1 otherwise).
        tails: ``(page, first_unused_slot)`` for every new page that is only
            partly used. A page's used slots always come first (a page holds
            consecutive tokens of one sequence), so zeroing these ranges
            zeroes every ``-1`` slot; kept on the host so that applying the
            plan needs no device sync. ``None`` (a plan built by hand):
            unknown, the unused slots are found from ``src_slots``.
    """

    page_size: int
    src_slots: torch.Tensor
    block_table: torch.Tensor
    seq_ptr: torch.Tensor
    seq_lens: torch.Tensor
    tails: tuple[tuple[int, int], ...] | None = None
    run: int = 1
    #: The source page size the plan was made for (0: unknown, a plan built by hand), and the source
    #: pages it reads (one past the highest page id).
    src_page_size: int = 0
    src_pages: int = 0
    #: The sequence lengths the plan was made from (the very tensor): a plan applied to the tensors it was
    #: made for is recognised without comparing them (a device sync per layer on GPU).
    _src_lens: torch.Tensor | None = field(default=None, repr=False, compare=False)
    #: The block table the plan was made from (the very tensor; ``None``: a plan built by hand). Lengths and
    #: page size alone do not tell two batches apart whose pages differ: importers that take a plan compare it.
    src_block_table: torch.Tensor | None = field(default=None, repr=False, compare=False)
    #: The source ``seq_ptr`` the plan was made from (``None``: a plan built by hand), compared alike.
    src_seq_ptr: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _rows: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def rows(self) -> torch.Tensor:
        """The gather index: for every run of ``run`` new slots, the source run it copies.

        Runs of ``gcd(src_page_size, page_size)`` slots start at token
        positions that are multiples of the run length, so each lies inside
        one source page and is copied as one row; a run with no used slot
        reads run 0. Unused slots are zeroed afterwards (see ``tails``).
        """
        if self._rows is not None:
            return self._rows
        return (self.src_slots.view(-1, self.run)[:, 0] // self.run).clamp(min=0)

    @property
    def num_pages(self) -> int:
        """Number of target pages the plan fills."""
        return int(self.src_slots.numel()) // self.page_size


def plan_repage(
    block_table: torch.Tensor,
    seq_ptr: torch.Tensor,
    seq_lens: torch.Tensor,
    src_page_size: int,
    page_size: int,
    num_pages: int | None = None,
) -> RepagePlan:
    """Plan moving a batch from pages of ``src_page_size`` to pages of ``page_size``.

    ``num_pages``, when given, is the source pool's: a page id past it is refused.

    Raises:
        ImportArgumentError: ``page_size`` is not a positive integer (the caller's target),
            or pads tokens that fit :data:`MAX_IMPORT_SLOTS` into more slots than that.
        HurrayFormatError: the block structure is inconsistent (``seq_ptr``,
            ``seq_lens.pages``) or declares more than :data:`MAX_IMPORT_SLOTS`
            tokens (field ``seq_lens``, whatever the page size); the lengths
            are not integers (``seq_lens.dtype``), or the block table or
            ``seq_ptr`` not integers (``block_table.dtype``, ``seq_ptr.dtype``).
    """
    page_size = integer_arg(page_size, "page_size", 1, ImportArgumentError)
    if seq_lens.dtype not in LENGTH_DTYPES:
        raise HurrayFormatError(
            "seq_lens.dtype", f"sequence lengths must be integers (int8..int64 or uint8), not {seq_lens.dtype}"
        )
    for name, index in (("block_table", block_table), ("seq_ptr", seq_ptr)):
        if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
            raise HurrayFormatError(f"{name}.dtype", f"{name} must be held as integers, not {index.dtype}")
    dev = block_table.device
    src_lens = seq_lens
    src_ptr = seq_ptr
    # In int64 whatever they were held as: torch has no repeat_interleave for int16, int8 or uint8, and
    # uint8 wraps in the ceiling division below. (The plan's seq_lens are int64, as documented.)
    seq_lens = seq_lens.to(dev, torch.int64)
    seq_ptr = seq_ptr.to(dev)
    num_seqs = int(seq_lens.numel())
    if src_page_size <= 0 or seq_ptr.numel() != num_seqs + 1:
        raise HurrayFormatError(
            "seq_ptr", f"{seq_ptr.numel()} offsets for {num_seqs} sequences of pages of {src_page_size}"
        )
    src_pages = check_structure(block_table, seq_ptr, seq_lens, num_pages)
    if num_seqs and int(seq_lens.max()) > MAX_IMPORT_SLOTS:
        s = int(seq_lens.argmax())
        raise HurrayFormatError(
            "seq_lens",
            f"sequence {s} declares {int(seq_lens[s])} tokens, over hurray_vllm.kv.repage.MAX_IMPORT_SLOTS "
            f"= {MAX_IMPORT_SLOTS}; raise it if the batch is meant to be this large",
        )
    # Each sequence must own the pages its tokens need: a short one would read the next sequence's pages.
    # (Compared without rounding up: seq_lens + src_page_size - 1 could overflow int64.)
    short = (seq_lens > (seq_ptr[1:] - seq_ptr[:-1]) * src_page_size).nonzero()
    if short.numel():
        s = int(short[0, 0])
        raise HurrayFormatError(
            "seq_lens.pages",
            f"sequence {s} has {int(seq_lens[s])} tokens but {int(seq_ptr[s + 1] - seq_ptr[s])} "
            f"pages of {src_page_size}; the block structure is inconsistent (validate() it)",
        )
    need = -(-seq_lens // page_size)  # target pages per sequence (ceil, without overflow for a huge page_size)
    new_ptr = torch.zeros(num_seqs + 1, dtype=torch.int64, device=dev)
    if num_seqs:
        torch.cumsum(need, 0, out=new_ptr[1:])
    total = int(new_ptr[-1])
    check_page_budget(total * page_size, int(seq_lens.sum()), page_size, "repaging")
    # The plan's own temporaries ([total, page_size] int64 several times over) come before any pool.
    check_memory(total * page_size * PLAN_BYTES_PER_SLOT, "repage plan", dev)
    if total == 0:
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        return RepagePlan(
            page_size,
            empty,
            empty,
            new_ptr,
            seq_lens.clone(),
            src_page_size=src_page_size,
            _src_lens=src_lens,
            src_block_table=block_table,
            src_seq_ptr=src_ptr,
        )
    # For every target logical page (s, j) and position r: token t = j*T + r of s.
    seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=dev), need)
    j = torch.arange(total, device=dev) - new_ptr[:-1][seq_of]
    t = j[:, None] * page_size + torch.arange(page_size, device=dev)[None, :]
    valid = t < seq_lens[seq_of][:, None]
    t = torch.where(valid, t, torch.zeros_like(t))
    # Widened before the multiply: in an int16 (or, for pools past 2**31 slots, int32) table's own dtype,
    # page * src_page_size wraps, and the gather reads other pages' slots silently.
    src_page = block_table[seq_ptr[:-1][seq_of][:, None] + t // src_page_size].to(torch.int64)
    slots = torch.where(valid, src_page * src_page_size + t % src_page_size, torch.full_like(t, -1))
    # Target pages holding the same slots are one page; keep first-use order.
    uniq, inverse = torch.unique(slots, dim=0, return_inverse=True)
    first = torch.full((uniq.shape[0],), total, dtype=torch.int64, device=dev)
    first.scatter_reduce_(0, inverse, torch.arange(total, device=dev), reduce="amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=dev)
    src_slots = uniq[order]
    used = (src_slots >= 0).sum(1)
    partial = (used < page_size).nonzero().reshape(-1)
    run = math.gcd(src_page_size, page_size)
    return RepagePlan(
        page_size=page_size,
        src_slots=src_slots.reshape(-1),
        block_table=rank[inverse],
        seq_ptr=new_ptr,
        seq_lens=seq_lens.clone(),
        tails=tuple(zip(partial.tolist(), used[partial].tolist(), strict=True)),
        run=run,
        src_page_size=src_page_size,
        src_pages=src_pages,
        _src_lens=src_lens,
        src_block_table=block_table,
        src_seq_ptr=src_ptr,
        _rows=(src_slots.reshape(-1, run)[:, 0] // run).clamp(min=0),
    )


def _gather_slots(src: torch.Tensor, plan: RepagePlan, per_slot: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Flat storage ``[num_slots, per_slot]`` holding ``plan``'s slots of ``src``; unused slots zero.

    One ``index_select`` of whole runs (``plan.run`` slots, up to a source
    page, per row) writes every output byte once; the unused slots, always
    the end of a partly used page, are then zeroed as one slice per such
    page (``plan.tails``). A plan without ``tails`` falls back to one
    ``index_fill_`` over the unused slots through the widest integer view of
    a row, which also works for float8 rows. With ``out`` (contiguous, same
    dtype and device as ``src``) the rows land there instead of in new
    memory.
    """
    idx = plan.src_slots
    if out is None:
        out = torch.empty(idx.numel(), per_slot, dtype=src.dtype, device=src.device)
    if src.numel() == 0 or idx.numel() == 0:
        return out.zero_()
    run = plan.run if plan.tails is not None else 1
    rows = plan.rows if run == plan.run else idx.clamp(min=0)
    torch.index_select(src.reshape(-1, run * per_slot), 0, rows.to(src.device), out=out.view(-1, run * per_slot))
    if plan.tails is not None:
        pages = out.view(-1, plan.page_size, per_slot)
        for page, first in plan.tails:
            pages[page, first:].zero_()
        return out
    unused = (idx.to(src.device) < 0).nonzero().reshape(-1)
    if unused.numel():
        row_bytes = per_slot * out.element_size()
        wide = torch.int64 if row_bytes % 8 == 0 else torch.int32 if row_bytes % 4 == 0 else torch.uint8
        out.view(wide).index_fill_(0, unused, 0)
    return out


def on_device(t: torch.Tensor, device: torch.device | str) -> bool:
    """Whether ``t`` lives on ``device``.

    ``"cuda"`` without an index means the current CUDA device, where torch would
    allocate (``torch.device("cuda") != torch.device("cuda:0")`` otherwise).
    """
    want = torch.device(device)
    if want.type == "cuda" and want.index is None:
        want = torch.device("cuda", torch.cuda.current_device())
    return t.device == want


def memory_span(t: torch.Tensor) -> tuple[torch.device, int, int]:
    """``(device, first byte, one past the last byte)`` that ``t``'s elements may occupy (empty for no elements)."""
    if t.numel() == 0 or t.device.type == "meta":
        return t.device, 0, 0
    extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True)) + 1
    return t.device, t.data_ptr(), t.data_ptr() + extent * t.element_size()


def overlaps(a: torch.Tensor | tuple[torch.device, int, int], b: torch.Tensor | tuple[torch.device, int, int]) -> bool:
    """Whether two tensors (or :func:`memory_span` results) may share memory; conservative for strided views."""
    da, a0, a1 = memory_span(a) if isinstance(a, torch.Tensor) else a
    db, b0, b1 = memory_span(b) if isinstance(b, torch.Tensor) else b
    return a0 < b1 and b0 < a1 and a0 < a1 and b0 < b1 and da == db


class _PoolSpans(NamedTuple):
    """A snapshot's page pools by where their memory starts, for :func:`refuse_pool_overlap`."""

    starts: list[int]
    #: The largest end among the spans up to each index: a scan back stops where it no longer reaches.
    reach: list[int]
    spans: list[tuple[tuple[torch.device, int, int], BlockPagedTensor]]


_POOL_SPANS: weakref.WeakKeyDictionary[KVSnapshot, _PoolSpans] = weakref.WeakKeyDictionary()


def _pool_spans(snap: KVSnapshot) -> _PoolSpans:
    """Every non-empty page pool of ``snap`` by start (computed once per snapshot)."""
    got = _POOL_SPANS.get(snap)
    if got is None:
        spans = sorted(
            ((span, t) for t in snap.tensors() for span in (memory_span(t.page_pool),) if span[1] < span[2]),
            key=lambda st: st[0][1],
        )
        reach, top = [], 0
        for span, _ in spans:
            top = max(top, span[2])
            reach.append(top)
        got = _POOL_SPANS[snap] = _PoolSpans([span[1] for span, _ in spans], reach, spans)
    return got


def refuse_pool_overlap(
    snap: KVSnapshot,
    out: torch.Tensor,
    field: str,
    allow: Callable[[BlockPagedTensor], bool] | None = None,
) -> None:
    """Refuse an ``out=`` tensor that shares memory with a page pool of ``snap`` the import reads.

    ``allow(t)`` may accept an overlap with ``t`` (an import in place). A
    lookup by address: an import checks every layer's caches against every
    pool, so a scan of all pools per cache would grow with the square of
    the layers.

    Raises:
        HurrayArgumentError: naming ``field`` and the pool.
    """
    mine = memory_span(out)
    if mine[1] >= mine[2]:
        return
    ps = _pool_spans(snap)
    j = bisect.bisect_left(ps.starts, mine[2]) - 1  # the last pool starting before ``out`` ends
    while j >= 0 and ps.reach[j] > mine[1]:
        span, t = ps.spans[j]
        if overlaps(mine, span) and not (allow is not None and allow(t)):
            raise HurrayArgumentError(
                field,
                f"shares memory with the snapshot's layer {t.layer_index} {t.kv_role} pool, which the import "
                "reads; import into other memory (or clone the snapshot first)",
            )
        j -= 1


def check_out_pool(out: torch.Tensor, pages: int, page_shape: tuple[int, ...], dtype: torch.dtype, field: str) -> None:
    """Refuse an ``out=`` pool that cannot take ``pages`` pages of ``page_shape`` and ``dtype``.

    Raises:
        ImportArgumentError: naming ``field``: not a tensor, or the wrong
            shape, page count or dtype (the caller's cache, not the data).
    """
    if not isinstance(out, torch.Tensor):
        raise ImportArgumentError(field, f"must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape[1:]) != page_shape or out.dim() != len(page_shape) + 1:
        raise ImportArgumentError(
            field, f"must have shape [num_pages, {', '.join(map(str, page_shape))}], got {list(out.shape)}"
        )
    if out.shape[0] < pages:
        raise ImportArgumentError(field, f"has {out.shape[0]} pages, the import needs {pages}; allocate a larger pool")
    if out.dtype != dtype:
        raise ImportArgumentError(field, f"is {out.dtype}, the import produces {dtype}; pass dtype= or another pool")


def repage_into(t: BlockPagedTensor, plan: RepagePlan | None, out: torch.Tensor) -> None:
    """Write ``t``'s pool, repaged by ``plan`` (``None``: as it is), into ``out``.

    ``out`` is any ``[plan.num_pages, page_size, num_heads, head_dim]`` view
    of ``t``'s dtype (for example the first pages of an engine's cache, or a
    strided HND or combined-K/V view). A contiguous ``out`` on the pool's
    device is gathered into directly; any other goes through one temporary.
    """
    per_slot = t.num_heads * t.head_dim
    pool = t.page_pool
    if plan is None:
        out.copy_(pool)
        return
    direct = out.is_contiguous() and out.device == pool.device and out.dtype == pool.dtype
    if direct:
        _gather_slots(pool, plan, per_slot, out.view(-1, per_slot))
    else:
        out.copy_(_gather_slots(pool, plan, per_slot).view(out.shape))


def repage(
    t: BlockPagedTensor, page_size: int, plan: RepagePlan | None = None, *, out: torch.Tensor | None = None
) -> BlockPagedTensor:
    """``t`` over pages of ``page_size`` tokens (see the module docstring).

    Per-page-slot quantization parameters (per-block-affine) move with their
    slots; per-tensor and per-channel parameters are unchanged.

    ``out``, when given, is a preallocated ``[>= num_pages, page_size,
    num_heads, head_dim]`` pool of ``t``'s dtype (contiguous pages): the
    repaged pages are written into its first ``plan.num_pages`` pages, which
    the result's ``page_pool`` views, and the rest of ``out`` is left
    untouched. Importing into memory that is already mapped (an engine's
    cache, a pool reused across imports) avoids faulting in a new pool.

    Raises:
        HurrayFormatError: ``t`` carries no ``seq_lens``, its block
            structure is inconsistent (see :func:`plan_repage`), or its
            scales and zero points share one buffer (:func:`~hurray_vllm.kv.paged.check_slot_params`).
        ImportArgumentError: ``plan`` is for other sequences or another page
            size, ``page_size`` is not a positive integer or too large for the batch
            (see :func:`plan_repage`), or ``out`` does not fit
            (see :func:`check_out_pool`).
        HurrayArgumentError: ``out`` shares memory with ``t``'s pool.
        OSError: ``ENOMEM``: the new pool is larger than the device's memory
            (:func:`check_memory`).
    """
    page_size = integer_arg(page_size, "page_size", 1, ImportArgumentError)
    if t.seq_lens is None:
        raise HurrayFormatError("seq_lens", "repaging needs the sequence lengths, which this tensor does not carry")
    check_slot_params(t, "repage")
    plan = plan or plan_repage(t.block_table, t.seq_ptr, t.seq_lens, t.page_size, page_size, t.num_pages)
    if (
        plan.page_size != page_size
        or plan.seq_ptr.numel() != t.seq_ptr.numel()
        or plan.src_page_size not in (0, t.page_size)
        or plan.src_pages > t.num_pages
        or (plan._src_lens is not t.seq_lens and not torch.equal(plan.seq_lens.cpu(), t.seq_lens.cpu()))
        # Lengths and page size alone do not tell two batches apart whose pages differ.
        or not made_for(t.block_table, plan.src_block_table)
        or not made_for(t.seq_ptr, plan.src_seq_ptr)
    ):
        raise ImportArgumentError(
            "plan",
            f"the plan repages {plan.seq_ptr.numel() - 1} sequences of pages of {plan.src_page_size or '?'} to "
            f"{plan.page_size}, not these {t.num_seqs} of pages of {t.page_size} to {page_size} "
            "(a plan made for another snapshot)",
        )
    q = t.quantization
    if isinstance(q, PerBlockAffine) and (page_size < 2 or page_size & (page_size - 1)):
        raise ImportArgumentError(
            "page_size",
            f"a per-block-affine quantized tensor moves its scales with its pages, so its blocks become pages of "
            f"{page_size}; the format's blocks are powers of two >= 2",
        )
    page_shape = (page_size, t.num_heads, t.head_dim)
    if out is not None:
        check_out_pool(out, plan.num_pages, page_shape, t.dtype, "out")
        if overlaps(out, t.page_pool):
            raise HurrayArgumentError("out", "shares memory with the pool being repaged; repage into other memory")
        pool = out[: plan.num_pages]
        repage_into(t, plan, pool)
    else:
        per_slot = t.num_heads * t.head_dim
        nbytes = plan.num_pages * page_size * per_slot * t.page_pool.element_size()
        check_memory(nbytes, f"repaging layer {t.layer_index} {t.kv_role}", t.page_pool.device)
        pool = _gather_slots(t.page_pool, plan, per_slot)
        pool = pool.view(plan.num_pages, *page_shape)
    qbufs = t.quant_buffers
    if isinstance(q, PerBlockAffine) and qbufs:
        slots_in = t.num_pages * t.page_size
        qbufs = tuple(_gather_slots(b, plan, b.numel() // max(1, slots_in)).reshape(-1) for b in qbufs)
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
    """Every layer and role of ``snap`` repaged, with one plan per block structure.

    Most snapshots have one structure for every layer and role, so one plan
    serves all; a sliding-window hybrid's windowed layers hold other pages
    (``snap.windows``) and get their own.

    Raises:
        HurrayFormatError: a tensor without ``seq_lens``, or an inconsistent
            block structure (see :func:`plan_repage`).
        ImportArgumentError: ``page_size`` is not a positive integer, or too
            large for the batch (see :func:`plan_repage`).
        OSError: ``ENOMEM``: every layer's new pools together are larger than
            the device's memory, before the first is built.
    """
    # 8.0 would compare equal to a page size of 8 below
    page_size = integer_arg(page_size, "page_size", 1, ImportArgumentError)
    # Layers may have pages of their own sizes (the format allows it): each is looked at, not just the first.
    if all(t.page_size == page_size for t in snap.tensors()):
        return snap
    plans: dict[tuple[int, int], RepagePlan] = {}

    def plan_for(t: BlockPagedTensor) -> RepagePlan:
        if t.seq_lens is None:
            raise HurrayFormatError(
                "seq_lens", "repaging needs the sequence lengths, which this snapshot does not carry"
            )
        key = (id(t.block_table), t.page_size)  # one block table may be read with two page sizes
        if key not in plans:
            plans[key] = plan_repage(t.block_table, t.seq_ptr, t.seq_lens, t.page_size, page_size, t.num_pages)
        return plans[key]

    # Every layer's new pool is held at once: counted together, before the first is built.
    total = sum(
        plan_for(t).num_pages * page_size * t.num_heads * t.head_dim * t.page_pool.element_size()
        for t in snap.tensors()
        if t.page_size != page_size
    )
    check_memory(total, f"repaging {snap.num_layers} layers", snap.tensors()[0].page_pool.device)
    return snap.with_layers(
        [
            tuple(t if t.page_size == page_size else repage(t, page_size, plan_for(t)) for t in members)
            for members in snap.layer_members()
        ]
    )
