"""``BlockPagedTensor``: one block-paged descriptor's worth of KV, as torch tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from ..errors import HurrayFormatError, ImportArgumentError, Violation, integer_arg, plain_int
from ..wire import dtypes
from ..wire.descriptor import (
    INDEX_TYPE_TAGS,
    INDEX_TYPES,
    KV_ROLE_TAGS,
    LAYER_INDEX_NONE,
    LAYOUT_BLOCK_PAGED,
    BlockPagedFields,
    BufferHandle,
    PerBlockAffine,
    Quantization,
    TensorDescriptor,
)
from ..wire.dtypes import widen_index
from ..wire.rules import (
    INDEX_DTYPES,
    LENGTH_DTYPES,
    Checked,
    check_own,
    raise_if,
    validate_descriptor,
    validate_index_buffers,
)

__all__ = [
    "BlockPagedTensor",
    "IndexCache",
    "SharingStats",
    "CompactionPlan",
    "check_slot_params",
    "check_index_dtypes",
    "check_structure",
    "made_for",
    "plan_compaction",
    "same_tensor",
    "zero_slots_",
]

_DEVICE_TAGS = {"cpu": 0x00, "cuda": 0x01}


class IndexCache:
    """Index buffers already widened and checked while reading one snapshot, for :meth:`BlockPagedTensor.from_wire`.

    A snapshot's layers usually carry the same block table; with one cache
    per snapshot read they share one int64 copy of it, and its rules are
    checked once. Keyed by the bytes the rules read, so a hit is the verdict
    the check would give. Make one per snapshot and drop it afterwards.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor, tuple[Violation, ...]]] = {}

    def get(self, key: tuple[object, ...]) -> tuple[torch.Tensor, torch.Tensor, tuple[Violation, ...]] | None:
        """The widened ``(block_table, seq_ptr)`` and their violations, if these bytes were seen."""
        return self._entries.get(key)

    def put(self, key: tuple[object, ...], value: tuple[torch.Tensor, torch.Tensor, tuple[Violation, ...]]) -> None:
        """Remember what the index buffers with these bytes widened and checked to."""
        self._entries[key] = value

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class SharingStats:
    """How much prefix sharing a block table expresses."""

    logical_pages: int
    distinct_pages: int
    shared_pages: int
    page_bytes: int

    @property
    def saved_bytes(self) -> int:
        """Bytes a copy without sharing would add (one page per logical page)."""
        return (self.logical_pages - self.distinct_pages) * self.page_bytes


@dataclass(frozen=True)
class CompactionPlan:
    """Which pool pages a block table references, and their new ids.

    ``keep`` lists the old page ids in order of first reference (int64);
    ``block_table`` is the renumbered table. One plan serves every layer and
    both roles of a snapshot, since they share one block structure.
    """

    keep: torch.Tensor
    block_table: torch.Tensor
    #: The pages the plan reads (one past the highest id in ``keep``; 0 for a plan built by hand): a
    #: tensor with a smaller pool is refused without reading ``keep`` again.
    src_pages: int = 0
    #: The block table the plan was made from (the very tensor; ``None``: a plan built by hand). ``keep``
    #: alone does not tell two tables apart: another table's plan would gather other pages, silently.
    src_block_table: torch.Tensor | None = field(default=None, repr=False, compare=False)


def same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether ``a`` and ``b`` hold the same values (``b`` moved to ``a``'s device); ``None`` equals only itself."""
    # Tensors built alike share one object: no compare (and no device sync).
    if a is b:
        return True
    if a is None or b is None or a.shape != b.shape:
        return False
    return torch.equal(a, b.to(a.device))


def made_for(mine: torch.Tensor, plan_src: torch.Tensor | None) -> bool:
    """Whether a plan made from the index tensor ``plan_src`` applies to a tensor whose own is ``mine``.

    The check :meth:`BlockPagedTensor.compact` and :func:`~hurray_vllm.kv.repage.repage` share: a plan
    records the block table (and ``seq_ptr``) it was made from, and applies to the same values only.
    ``None`` (a plan built by hand) is trusted. The plan's own tensor, as a snapshot's layers share it,
    is recognised without comparing (no device sync).
    """
    return plan_src is None or same_tensor(mine, plan_src)


def plan_compaction(block_table: torch.Tensor, num_pages: int) -> CompactionPlan:
    """Plan a compaction of ``block_table`` (int64, ids < ``num_pages``).

    The plan applies to tensors with this block table only (:meth:`BlockPagedTensor.compact`
    refuses it for another).

    Raises:
        HurrayFormatError: (field ``block_table``) a page id outside ``0 .. num_pages - 1``;
            (``block_table.dtype``) ids not held as int32/int64.
    """
    check_index_dtypes(block_table=block_table)
    if block_table.numel() == 0:
        empty = torch.empty(0, dtype=torch.int64, device=block_table.device)
        return CompactionPlan(empty, empty, src_block_table=block_table)
    # First-reference order keeps a sequence's pages adjacent in the new pool,
    # which makes the common unshared case an identity-like, cache-friendly gather.
    uniq, inverse = torch.unique(block_table, return_inverse=True)
    # Sorted: its ends are the bounds, checked before the gather would fail on them (IndexError on the CPU,
    # a device-side assert on CUDA).
    lo, hi = int(uniq[0]), int(uniq[-1])
    _check_page_ids(lo, hi, num_pages)
    first = torch.full((uniq.numel(),), block_table.numel(), dtype=torch.int64, device=block_table.device)
    pos = torch.arange(block_table.numel(), device=block_table.device)
    first.scatter_reduce_(0, inverse, pos, reduce="amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return CompactionPlan(keep=uniq[order], block_table=rank[inverse], src_pages=hi + 1, src_block_table=block_table)


def check_index_dtypes(**tensors: torch.Tensor) -> None:
    """Refuse page-id tensors (``block_table``, ``seq_ptr``) not held as int32 or int64.

    The same structural rule :func:`~hurray_vllm.wire.rules.validate_index_buffers` reports, raised
    where a tensor built by hand is indexed with: torch would otherwise fail with a bare
    ``RuntimeError``, and an int16 ``page * page_size`` wraps silently.

    Raises:
        HurrayFormatError: (field ``<name>.dtype``) naming the first such tensor.
    """
    for name, t in tensors.items():
        if t.dtype not in INDEX_DTYPES:
            raise HurrayFormatError(
                f"{name}.dtype", f"{name} must be held as int32 or int64, not {t.dtype}; convert it"
            )


def _check_page_ids(lo: int, hi: int, num_pages: int | None) -> None:
    """Refuse page ids ``lo .. hi`` (a block table's least and greatest) outside a pool of ``num_pages``."""
    if lo < 0 or (num_pages is not None and hi >= num_pages):
        raise HurrayFormatError(
            "block_table",
            f"page ids {lo}..{hi} outside the pool's 0..{(num_pages or 0) - 1}"
            if num_pages is not None
            else f"page id {lo} is negative",
        )


def check_structure(
    block_table: torch.Tensor, seq_ptr: torch.Tensor, seq_lens: torch.Tensor | None, num_pages: int | None
) -> int:
    """Refuse a block structure a plan would index out of bounds with, or read as unused slots.

    ``seq_lens`` ``None`` (a plain descriptor's tensor) checks the offsets and page ids only.
    Returns the source pages it reads (one past the highest page id): one reduction serves both.

    Raises:
        HurrayFormatError: naming ``seq_lens``, ``seq_ptr`` or ``block_table``.
    """
    if (seq_lens is not None and seq_lens.dim() != 1) or seq_ptr.dim() != 1 or block_table.dim() != 1:
        raise HurrayFormatError("seq_lens", "block_table, seq_ptr and seq_lens must be one-dimensional")
    if seq_lens is not None and seq_lens.numel() != seq_ptr.numel() - 1:
        raise HurrayFormatError("seq_lens", f"{seq_lens.numel()} lengths for {seq_ptr.numel() - 1} sequences")
    if seq_lens is not None and seq_lens.numel() and int(seq_lens.min()) < 0:
        raise HurrayFormatError("seq_lens", "sequence lengths must be >= 0")
    if seq_ptr.numel() and (
        int(seq_ptr[0]) != 0 or int(seq_ptr[-1]) > block_table.numel() or bool((seq_ptr[1:] < seq_ptr[:-1]).any())
    ):
        raise HurrayFormatError(
            "seq_ptr", f"offsets must start at 0, never decrease and end within the {block_table.numel()} block ids"
        )
    if not block_table.numel():
        return 0
    lo, hi = (int(x) for x in torch.aminmax(block_table))
    _check_page_ids(lo, hi, num_pages)
    return hi + 1


def check_slot_params(t: BlockPagedTensor, what: str) -> None:
    """Refuse to move ``t``'s per-page-slot parameters when its scales and zero points share one buffer.

    The rules accept one buffer of ``entries * (scale width + 4)`` bytes at a
    shared index, but neither the spec nor docs/format.md says how scales and
    zero points lie in it (interleaved per slot, or one array after the
    other); gathering it either way could pair a slot with another's
    parameters. Separate buffers, per the spec's per-page-slot layout, move.

    Raises:
        HurrayFormatError: (field ``quantization.buffer_index``) naming ``what``.
    """
    q = t.quantization
    if isinstance(q, PerBlockAffine) and t.quant_buffers and q.zero_point_buffer_index == q.scale_buffer_index:
        raise HurrayFormatError(
            "quantization.buffer_index",
            f"{what}: layer {t.layer_index} {t.kv_role} keeps its scales and zero points in one buffer "
            f"(index {q.scale_buffer_index}), whose layout the format does not define; write them to separate buffers",
        )


@dataclass(frozen=True, eq=False)
class BlockPagedTensor:
    """A batch of sequences' keys or values for one layer, block-paged.

    Attributes:
        page_pool: ``[num_pages, page_size, num_heads, head_dim]``, any dtype
            Hurray can name (bf16, fp16, fp32, float8_e4m3fn, float8_e5m2...),
            contiguous as read from the wire; strided views (a head slice, an
            HND-backed permutation) work as well.
        block_table: int64 ``[total_logical_pages]``, the physical page id of
            every logical page, sequence after sequence.
        seq_ptr: int64 ``[num_seqs + 1]``; sequence ``s`` owns
            ``block_table[seq_ptr[s]:seq_ptr[s+1]]``.
        seq_lens: int64 ``[num_seqs]`` tokens per sequence, or ``None`` when a
            plain descriptor did not say (the wire format has no such field).
        kv_role: ``"key"``, ``"value"`` or ``"fused"``.
        layer_index: the transformer layer, or ``None``.
        index_type: ``"uint32"`` or ``"uint64"``: the block table's wire type.
        quantization: the quantization section, if any.
        quant_buffers: buffers 3.. as raw uint8 tensors (scales, zero points).
    """

    page_pool: torch.Tensor
    block_table: torch.Tensor
    seq_ptr: torch.Tensor
    seq_lens: torch.Tensor | None = None
    kv_role: str = "key"
    layer_index: int | None = None
    index_type: str = "uint32"
    quantization: Quantization | None = None
    quant_buffers: tuple[torch.Tensor, ...] = ()
    #: ``shape[0]`` as read from a descriptor that carried no sequence lengths.
    num_tokens: int | None = None

    # ── shape ──────────────────────────────────────────────────────────────

    @property
    def num_pages(self) -> int:
        """Number of pages in the pool."""
        return int(self.page_pool.shape[0])

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return int(self.page_pool.shape[1])

    @property
    def num_heads(self) -> int:
        """Number of KV heads."""
        return int(self.page_pool.shape[2])

    @property
    def head_dim(self) -> int:
        """Head size, the pool's last dimension."""
        return int(self.page_pool.shape[3])

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch."""
        return int(self.seq_ptr.numel()) - 1

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the page pool."""
        return self.page_pool.dtype

    @property
    def total_tokens(self) -> int:
        """``shape[0]`` on the wire: the sum of the sequence lengths.

        Without known lengths every logical page is counted as full.
        """
        if self.seq_lens is not None:
            return int(self.seq_lens.sum())
        if self.num_tokens is not None:
            return self.num_tokens
        return int(self.block_table.numel()) * self.page_size

    @property
    def shape(self) -> tuple[int, int, int]:
        """The logical shape ``[total_tokens, num_heads, head_dim]``."""
        return (self.total_tokens, self.num_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of the pool."""
        return self.page_size * self.num_heads * self.head_dim * self.page_pool.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of all buffers on the wire."""
        return sum(b.byte_size for b in self.descriptor().buffers)

    def pages_of(self, seq: int) -> torch.Tensor:
        """Physical page ids of sequence ``seq``, in logical order.

        Raises:
            IndexError: ``seq`` is outside the batch (``0 .. num_seqs - 1``).
        """
        self._check_seq(seq)
        return self.block_table[int(self.seq_ptr[seq]) : int(self.seq_ptr[seq + 1])]

    # ── element access ─────────────────────────────────────────────────────

    def lookup(self, seq: int, token: int, head: int, dim: int) -> torch.Tensor:
        """One element, by the spec's Element Lookup formula (0-d tensor).

        Raises:
            IndexError: ``seq`` outside the batch, or ``token``, ``head`` or ``dim`` outside the sequence.
            HurrayFormatError: the lengths are inconsistent (:meth:`seq_len`), or a page id outside the pool
                (field ``block_table``).
        """
        self._check_seq(seq)
        # Without seq_lens a sequence holds its pages' tokens; every index is checked, since the flat offset
        # below would otherwise silently read another token, head or sequence.
        held = self.seq_len(seq) if self.seq_lens is not None else self.page_size * len(self.pages_of(seq))
        if not 0 <= token < held:
            raise IndexError(f"token {token} is outside sequence {seq} of {held} tokens")
        if not (0 <= head < self.num_heads and 0 <= dim < self.head_dim):
            raise IndexError(f"head {head} / dim {dim} outside {self.num_heads} heads of {self.head_dim}")
        page_in_seq, offset = divmod(token, self.page_size)
        phys = int(self.block_table[int(self.seq_ptr[seq]) + page_in_seq])
        _check_page_ids(phys, phys, self.num_pages)
        flat = ((phys * self.page_size + offset) * self.num_heads + head) * self.head_dim + dim
        return self.page_pool.reshape(-1)[flat]

    def to_dense(self, seq: int) -> torch.Tensor:
        """Sequence ``seq`` as a contiguous ``[seq_len, num_heads, head_dim]`` tensor.

        Raises:
            IndexError: ``seq`` is outside the batch (``0 .. num_seqs - 1``).
            HurrayFormatError: the lengths are unknown or inconsistent (:meth:`seq_len`), a page id
                outside the pool (field ``block_table``), or page ids not held as int32/int64
                (``block_table.dtype``).
        """
        check_index_dtypes(block_table=self.block_table)
        n = self.seq_len(seq)
        pages = self.pages_of(seq)
        if pages.numel():
            lo, hi = (int(x) for x in torch.aminmax(pages))
            _check_page_ids(lo, hi, self.num_pages)
        return self.page_pool.index_select(0, pages.to(self.page_pool.device)).reshape(
            -1, self.num_heads, self.head_dim
        )[:n]

    def seq_len(self, seq: int) -> int:
        """Tokens of sequence ``seq``, at most what the pages it owns hold.

        Raises:
            IndexError: ``seq`` is outside the batch (``0 .. num_seqs - 1``).
            HurrayFormatError: (field ``seq_lens``) the lengths are not known;
                (``seq_lens.pages``) the length is negative or more than its
                pages hold: reading it would slice from the end, or read
                another sequence's pages.
        """
        self._check_seq(seq)
        if self.seq_lens is None:
            raise HurrayFormatError(
                "seq_lens",
                "this tensor does not know its sequence lengths (a plain block-paged descriptor "
                "carries none); pass seq_lens= when building it, or write snapshots with hurray-vllm",
            )
        n = int(self.seq_lens[seq])
        pages = int(self.seq_ptr[seq + 1]) - int(self.seq_ptr[seq])
        if not 0 <= n <= pages * self.page_size:
            raise HurrayFormatError(
                "seq_lens.pages",
                f"sequence {seq} has {n} tokens but owns {pages} pages of {self.page_size}; "
                "the block structure is inconsistent (validate() it)",
            )
        return n

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.num_seqs:
            raise IndexError(f"sequence {seq} is outside the batch of {self.num_seqs}")

    # ── batch operations ───────────────────────────────────────────────────

    def select(self, seqs: Sequence[int]) -> BlockPagedTensor:
        """A sub-batch of ``seqs`` (in that order) over the same page pool.

        Without ``seq_lens`` (a plain descriptor's tensor) the sub-batch's
        token count is known only when it is the whole batch in order (it
        keeps ``num_tokens``) or when every page of the batch is full: a
        count guessed otherwise would go on the wire as ``shape[0]``.

        Raises:
            IndexError: a sequence outside the batch.
            HurrayArgumentError: (field ``seqs``) a sequence that is not an
                integer (a bool or a float).
            HurrayFormatError: (field ``seq_lens``) the tensor carries no
                lengths and the sub-batch's token count is not known.
        """
        # Read once: a generator would be spent by the range check, and the sub-batch then holds nothing.
        seqs = [integer_arg(s, "seqs") for s in seqs]
        for s in seqs:
            self._check_seq(s)
        whole = list(seqs) == list(range(self.num_seqs))
        full = self.num_tokens in (None, self.block_table.numel() * self.page_size)
        if self.seq_lens is None and not (whole or full):
            raise HurrayFormatError(
                "seq_lens",
                f"this tensor's {self.num_tokens} tokens do not fill its pages and it carries no sequence lengths "
                "(a plain block-paged descriptor): a sub-batch's token count is unknown; pass seq_lens= "
                "when building it",
            )
        # A host index reads device tensors; the offsets and table are built where the index tensors live
        # (cumsum cannot write a CUDA result into a host tensor).
        idx = torch.as_tensor(list(seqs), dtype=torch.int64)
        seq_ptr = self.seq_ptr.new_zeros(idx.numel() + 1, dtype=torch.int64)
        if idx.numel():
            torch.cumsum((self.seq_ptr[1:] - self.seq_ptr[:-1])[idx], 0, out=seq_ptr[1:])
        parts = [self.block_table[int(self.seq_ptr[s]) : int(self.seq_ptr[s + 1])] for s in seqs]
        table = torch.cat(parts) if parts else self.block_table.new_empty(0, dtype=torch.int64)
        lens = self.seq_lens[idx] if self.seq_lens is not None else None
        return replace(
            self, block_table=table, seq_ptr=seq_ptr, seq_lens=lens, num_tokens=self.num_tokens if whole else None
        )

    def compact(self, plan: CompactionPlan | None = None) -> BlockPagedTensor:
        """Keep only referenced pages, renumbered; aliasing is preserved.

        Per-page-slot quantization parameters move with their pages.

        Args:
            plan: From :func:`plan_compaction` of this tensor's block table (one
                plan serves every layer and role sharing it); made here when
                ``None``.

        Raises:
            HurrayFormatError: a page id outside the pool (field ``block_table``),
                or scales and zero points in one buffer (:func:`check_slot_params`).
            ImportArgumentError: (field ``plan``) a plan made from another block
                table, or reading more pages than the pool holds (a
                :class:`~hurray_vllm.errors.HurrayArgumentError`; until 0.3 also
                a :class:`HurrayFormatError`, as this was).
        """
        check_slot_params(self, "compact")
        plan = plan or plan_compaction(self.block_table, self.num_pages)
        if plan.src_pages > self.num_pages:
            raise ImportArgumentError(
                "plan", f"the plan reads {plan.src_pages} pages, the pool holds {self.num_pages} (a plan for another)"
            )
        # Another table's plan gathers the pages it lists, not this table's: other tokens, silently.
        if not made_for(self.block_table, plan.src_block_table):
            raise ImportArgumentError(
                "plan",
                "the plan was made from another block table; make one with plan_compaction(t.block_table, t.num_pages)",
            )
        pool = self.page_pool.index_select(0, plan.keep.to(self.page_pool.device))
        qbufs = self.quant_buffers
        q = self.quantization
        if isinstance(q, PerBlockAffine) and qbufs:
            qbufs = tuple(self._slot_gather(b, plan.keep) for b in qbufs)
        return replace(
            self, page_pool=pool, block_table=plan.block_table.to(self.block_table.device), quant_buffers=qbufs
        )

    def _slot_gather(self, buf: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        per_page = buf.numel() // max(1, self.num_pages)
        return buf.view(self.num_pages, per_page).index_select(0, keep.to(buf.device)).reshape(-1)

    def valid_slots(self) -> torch.Tensor:
        """int64 ``[num_pages]``: how many leading slots of each page some sequence uses.

        Raises:
            HurrayFormatError: an inconsistent block structure (:func:`check_structure`),
                block-table entries no sequence owns (field ``seq_ptr``), or page ids not held
                as int32/int64 (``block_table.dtype``, ``seq_ptr.dtype``).
        """
        check_index_dtypes(block_table=self.block_table, seq_ptr=self.seq_ptr)
        valid = torch.zeros(self.num_pages, dtype=torch.int64, device=self.block_table.device)
        if self.block_table.numel() == 0:
            return valid
        check_structure(self.block_table, self.seq_ptr, self.seq_lens, self.num_pages)
        counts = self.seq_ptr[1:] - self.seq_ptr[:-1]
        if int(self.seq_ptr[-1]) != self.block_table.numel():  # every entry is read as some sequence's
            raise HurrayFormatError("seq_ptr", "seq_ptr is not a non-decreasing index into the block table")
        seq_of = torch.repeat_interleave(torch.arange(self.num_seqs, device=counts.device), counts)
        k = torch.arange(self.block_table.numel(), device=counts.device) - self.seq_ptr[:-1][seq_of]
        if self.seq_lens is None:
            used = torch.full_like(k, self.page_size)
        else:
            used = (self.seq_lens[seq_of] - k * self.page_size).clamp(0, self.page_size)
        valid.scatter_reduce_(0, self.block_table, used, reduce="amax")
        return valid

    def zero_unused_slots(self) -> BlockPagedTensor:
        """A copy whose slots past every referencing sequence's length are zero.

        A page shared by a long and a short sequence keeps what the long one
        uses: the rule is per physical page, over all its references.
        """
        pool = self.page_pool.clone()
        zero_slots_(pool, self.valid_slots())
        return replace(self, page_pool=pool)

    def sharing(self) -> SharingStats:
        """Logical vs distinct physical pages, and pages referenced more than once."""
        n = int(self.block_table.numel())
        if n == 0:
            return SharingStats(0, 0, 0, self.page_bytes)
        _, counts = torch.unique(self.block_table, return_counts=True)
        return SharingStats(n, int(counts.numel()), int((counts > 1).sum()), self.page_bytes)

    # ── wire form ──────────────────────────────────────────────────────────

    def descriptor(self, *, device_tag: int | None = None, alignment: int = 64) -> TensorDescriptor:
        """The block-paged descriptor for this tensor (buffers 0-2, then 3..)."""
        et = dtypes.from_torch(self.page_pool.dtype)
        ib = 8 if self.index_type == "uint64" else 4
        dev = device_tag if device_tag is not None else _DEVICE_TAGS.get(self.page_pool.device.type, 0xF0)
        sizes = [
            et.nbytes(self.page_pool.numel()),
            int(self.block_table.numel()) * ib,
            int(self.seq_ptr.numel()) * ib,
        ] + [int(b.numel()) * b.element_size() for b in self.quant_buffers]
        # Looked up apart, so that the error names the field that is wrong (the rules' names for them).
        role = KV_ROLE_TAGS.get(self.kv_role)
        if role is None:
            raise HurrayFormatError(
                "kv_role", f"unknown kv_role {self.kv_role!r}; use one of {', '.join(map(repr, KV_ROLE_TAGS))}"
            )
        index_tag = INDEX_TYPE_TAGS.get(self.index_type)
        if index_tag is None:
            raise HurrayFormatError(
                "block_table_index_type",
                f"unknown index type {self.index_type!r}; use one of {', '.join(map(repr, INDEX_TYPE_TAGS))}",
            )
        return TensorDescriptor(
            type_tag=et.tag,
            shape=self.shape,
            layout_tag=LAYOUT_BLOCK_PAGED,
            layout=BlockPagedFields(
                page_size=self.page_size,
                num_pages=self.num_pages,
                num_seqs=self.num_seqs,
                kv_role_tag=role,
                layer_index=self.layer_index,
                index_type_tag=index_tag,
            ),
            # An empty buffer has nothing to align; the reference writer declares 1 (buffer-protocol.md).
            buffers=tuple(BufferHandle(s, alignment if s else 1, dev) for s in sizes),
            quantization=self.quantization,
        )

    def wire_buffers(
        self, index_cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> list[torch.Tensor]:
        """The buffers in descriptor order, as contiguous tensors whose bytes go on the wire.

        The page pool is returned as is (no copy when it is contiguous);
        the int64 index tensors are narrowed to the wire index type.
        ``index_cache`` (a dict the caller keeps while the tensors live)
        narrows each index tensor once when many layers share it, as an
        export's layers do.
        """
        index_dtype = torch.uint64 if self.index_type == "uint64" else torch.int32
        pool = self.page_pool if self.page_pool.is_contiguous() else self.page_pool.contiguous()

        def narrow(t: torch.Tensor) -> torch.Tensor:
            if index_cache is None:
                return t.to(index_dtype).contiguous()
            # Keyed by identity; each entry keeps its source tensor alive, so its id cannot be
            # reused by another tensor while the entry exists, however long the caller keeps the
            # dict. (No _version in the key: tensors made under torch.inference_mode, as vLLM's
            # are, have none.)
            key = (id(t), self.index_type)
            got = index_cache.get(key)
            if got is None or got[0] is not t:
                got = index_cache[key] = (t, t.to(index_dtype).contiguous())
            return got[1]

        return [pool, narrow(self.block_table), narrow(self.seq_ptr), *(b.contiguous() for b in self.quant_buffers)]

    def validate(self, *, permissive: bool = False) -> Checked:
        """Every rule this tensor breaks (see :func:`hurray_vllm.containers.check`); raises nothing.

        A field the descriptor cannot be built from (``kv_role``, ``index_type``, a pool dtype with no
        Hurray element type, a ``num_tokens`` that is not an integer) is returned as the only violation.
        """
        if self.page_pool.dim() != 4:
            # The descriptor reads heads and head_dim from the pool's shape: nothing else can be checked.
            return Checked(
                (
                    Violation(
                        "rank",
                        f"page_pool must be [num_pages, page_size, num_heads, head_dim], "
                        f"got {self.page_pool.dim()} dimensions {list(self.page_pool.shape)}",
                    ),
                ),
                permissive,
            )
        try:
            if self.num_tokens is not None:
                plain_int(self.num_tokens)
        except TypeError:
            # shape[0] on the wire: a string or a float would fail the rules' arithmetic with a bare TypeError.
            bad = Violation("shape.total_tokens", f"num_tokens must be an integer or None, not {self.num_tokens!r}")
            return Checked((bad,), permissive)
        try:
            desc = self.descriptor()
        except HurrayFormatError as exc:
            # A kv_role, index type or pool dtype the wire has no tag for: reported, as every other rule is.
            return Checked(exc.violations, permissive)
        checked = validate_descriptor(
            desc,
            block_table=self.block_table,
            seq_ptr=self.seq_ptr,
            seq_lens=self.seq_lens,
            permissive=permissive,
        )
        li = self.layer_index
        if li is None or (isinstance(li, int) and not isinstance(li, bool) and 0 <= li < LAYER_INDEX_NONE):
            return checked
        # What encode_descriptor refuses (0xFFFFFFFF is how the wire says None): reported here, not at save.
        bad = Violation("layer_index", f"{li!r} is not an integer in 0..{LAYER_INDEX_NONE - 1} (or None)")
        return Checked((*checked.violations, bad), permissive, checked.unreadable)

    @classmethod
    def from_wire(
        cls,
        desc: TensorDescriptor,
        buffers: Sequence[torch.Tensor],
        *,
        seq_lens: torch.Tensor | None = None,
        permissive: bool = False,
        index_cache: IndexCache | None = None,
    ) -> BlockPagedTensor:
        """Rebuild from a decoded descriptor and its raw uint8 buffers.

        Views the page pool in place (no copy); widens the index buffers to
        int64. Raises :class:`HurrayFormatError` for any blocking violation.
        ``index_cache`` (one :class:`IndexCache` per snapshot read) widens and
        checks each distinct set of index buffers once: a snapshot's layers
        carry the same block table, and then share one int64 copy of it, as
        an export's layers do.
        """
        checked = check_own(desc, permissive=permissive)
        raise_if(checked, "block-paged descriptor")
        bp = desc.block_paged
        if bp is None:
            raise HurrayFormatError("layout_tag", f"expected block-paged (0x0A), got 0x{desc.layout_tag:02X}")
        if len(buffers) != len(desc.buffers):
            raise HurrayFormatError("buffer_count", f"{len(buffers)} buffers given for {len(desc.buffers)} declared")
        for i, (buf, declared) in enumerate(zip(buffers, desc.buffers, strict=True)):
            # What the descriptor's rules checked is what it declares: the buffers themselves (a
            # safetensors file's tensors, say) must be that size too, or the index checks read others.
            held = buf.numel() * buf.element_size()
            if held != declared.byte_size:
                name = ("page_pool", "block_table", "seq_ptr")[i] if i < 3 else f"buffer {i}"
                raise HurrayFormatError(
                    f"{name}.byte_size", f"{name} holds {held} bytes, its descriptor declares {declared.byte_size}"
                )
        dtype = dtypes.torch_dtype(desc.type_tag)
        _, heads, dim = desc.shape
        # A view where the bytes allow it; a copy where they start off the type's alignment.
        pool = dtypes.aligned_bytes(buffers[0], dtype.itemsize).view(dtype).view(bp.num_pages, bp.page_size, heads, dim)
        wide = torch.uint64 if bp.index_type_tag == 1 else torch.uint32
        found = checked.violations
        sizes_ok = not found or not any(
            v.invariant.endswith("byte_size") or v.invariant == "buffer_count" for v in found
        )
        # Everything the index-buffer rules read: the geometry and the three buffers' bytes.
        key: tuple[object, ...] | None = None
        table_raw, ptr_raw = buffers[1], buffers[2]
        # Cached only for lengths the rules take, on the host: any other is refused below, uncached (bf16 has
        # no numpy form to key on). The key holds their dtype and shape too: int64 [6, 3] and int32
        # [6, 0, 3, 0] are the same bytes.
        lens_keyable = seq_lens is None or (seq_lens.is_cpu and seq_lens.dtype in LENGTH_DTYPES)
        if index_cache is not None and sizes_ok and table_raw.is_cpu and ptr_raw.is_cpu and lens_keyable:
            key = (
                desc.shape,
                bp.page_size,
                bp.num_pages,
                bp.num_seqs,
                bp.index_type_tag,
                table_raw.numpy().tobytes(),
                ptr_raw.numpy().tobytes(),
                None if seq_lens is None else (seq_lens.dtype, tuple(seq_lens.shape), seq_lens.numpy().tobytes()),
            )
            hit = index_cache.get(key)
        else:
            hit = None
        if hit is not None:
            table, seq_ptr, index_found = hit
        else:
            table = widen_index(table_raw, wide)
            seq_ptr = widen_index(ptr_raw, wide, "seq_ptr.last")
            # The descriptor's own rules were checked above: add only the index-buffer rules
            # (the same verdict as validate_descriptor with the buffers, one pass cheaper).
            more: list[Violation] = []
            if sizes_ok:
                validate_index_buffers(desc, table, seq_ptr, seq_lens, more)
            index_found = tuple(more)
            if key is not None and index_cache is not None:
                index_cache.put(key, (table, seq_ptr, index_found))
        if found or index_found:
            raise_if(Checked(found + index_found, permissive), f"block-paged layer {bp.layer_index} {bp.kv_role}")
        return cls(
            page_pool=pool,
            block_table=table,
            seq_ptr=seq_ptr,
            seq_lens=seq_lens,
            kv_role=bp.kv_role,
            layer_index=bp.layer_index,
            index_type=INDEX_TYPES.get(bp.index_type_tag, "uint32"),
            quantization=desc.quantization,
            quant_buffers=tuple(buffers[3:]),
            num_tokens=None if seq_lens is not None else int(desc.shape[0]),
        )


#: The integer dtype of each element size: a view of any dtype (float8 included, which index_fill_ does not
#: take) that zeroes its elements, whatever the strides.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def zero_slots_(pool: torch.Tensor, valid: torch.Tensor) -> None:
    """Zero, in place, slots ``>= valid[p]`` of every page ``p`` of ``pool``.

    Args:
        pool: ``[num_pages, page_size, num_heads, head_dim]``, any dtype, any
            strides (a permuted HND-backed pool, a head slice of one).
        valid: integer ``[num_pages]``: the slots of each page to keep.
    """
    if pool.numel() == 0:
        return
    num_pages, page_size = int(pool.shape[0]), int(pool.shape[1])
    valid = valid.to(pool.device)
    # Pages nobody uses go in one op; the few partial ones (about one per
    # sequence) one slice each. A mask over every byte of the pool cost more
    # than the whole gather.
    empty = (valid <= 0).nonzero().reshape(-1)
    if empty.numel():
        if pool.is_contiguous():
            pool.view(torch.uint8).view(num_pages, -1).index_fill_(0, empty, 0)
        elif pool.element_size() in _INT_OF_SIZE:
            # A strided pool has no flat rows to view; a same-size dtype view keeps its strides.
            pool.view(_INT_OF_SIZE[pool.element_size()]).index_fill_(0, empty, 0)
        else:
            for p in empty.tolist():
                pool[p].zero_()
    partial = ((valid > 0) & (valid < page_size)).nonzero().reshape(-1)
    for p, v in zip(partial.tolist(), valid[partial].tolist()):
        pool[p, v:].zero_()
