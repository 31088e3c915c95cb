"""Helpers the paged-KV importers share (flash-attn, FlashInfer, the reference).

Only :mod:`hurray_vllm.errors`, :mod:`hurray_vllm.wire` and
:mod:`hurray_vllm.kv` may be imported here, never another adapter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import HurrayFormatError, ImportArgumentError
from ..kv.paged import BlockPagedTensor
from ..kv.repage import check_budget, check_memory
from ..kv.snapshot import KVSnapshot

__all__ = [
    "FP8_DTYPES",
    "INT32_MAX",
    "check_import_memory",
    "check_layer",
    "check_one_structure",
    "dequantize",
    "padded_block_table",
]

#: The float8 storage dtypes: pools in these hold ``value / scale``.
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)

#: The largest page id or token count the kernels' int32 indices hold.
INT32_MAX = 2**31 - 1


def check_layer(snapshot: KVSnapshot, layer: int) -> None:
    """Raise unless ``layer`` names one of ``snapshot``'s layers.

    Args:
        snapshot: the batch being imported.
        layer: the layer index asked for; must satisfy
            ``0 <= layer < snapshot.num_layers``.

    Raises:
        ImportArgumentError: with ``field="layer"`` when it is out of range
            (the caller's index, not the data: a :class:`HurrayArgumentError`).
    """
    if not 0 <= layer < snapshot.num_layers:
        raise ImportArgumentError("layer", f"layer {layer} is outside the snapshot's {snapshot.num_layers} layers")


def check_one_structure(snapshot: KVSnapshot, what: str) -> None:
    """Refuse a snapshot whose sliding-window layers dropped tokens, where ``what`` reads every page as KV.

    Such a layer's dropped pages are one zero page (``snapshot.windows``):
    a kernel handed them without its window would attend zeros, and a
    planner of one table for all layers would give the full layers the
    windowed layers' pages. A windowed snapshot that dropped nothing is fine.

    A linear-attention hybrid is refused too: its layers are the model's
    attention layers only, and a model whose linear-attention layers need
    their states (``snapshot.states``) cannot run on the KV alone.

    Every layer must share one page table too (``snapshot.structure``): the
    importers plan (and repage) once, from layer 0's.

    Raises:
        HurrayFormatError: (field ``snapshot.windows``, ``snapshot.states`` or
            ``snapshot.structure``) naming ``what``.
    """
    if snapshot.states is not None:
        raise HurrayFormatError(
            "snapshot.states",
            f"{what} imports attention KV only, but this snapshot's model also has linear-attention layers "
            f"{list(snapshot.states.layers)} whose states it carries (its KV layers are model layers "
            f"{snapshot.states.attention_layers(snapshot.num_layers)}); import it with the transformers adapter "
            "or into vLLM",
        )
    win = snapshot.windows
    if win is not None and snapshot.num_layers and any(start for row in win.kv_start for start in row):
        raise HurrayFormatError(
            "snapshot.windows",
            f"{what} reads every page as KV, but this snapshot's sliding-window layers hold only their windows "
            "(the older pages are zeros); import it with the transformers adapter or into vLLM",
        )
    lead = [members[0] for members in snapshot.layer_members()]
    for i, t in enumerate(lead[1:], 1):
        # One plan (one block table, one repaging) serves every layer: a layer paged otherwise would be
        # read through layer 0's table, silently. Tensors built alike share the table object: no compare.
        if t.page_size != lead[0].page_size or (
            t.block_table is not lead[0].block_table and not torch.equal(t.block_table, lead[0].block_table)
        ):
            raise HurrayFormatError(
                "snapshot.structure",
                f"{what} takes one page table for every layer, but layer {i}'s (or its page size) differs from "
                "layer 0's; "
                "import it with the transformers adapter or into vLLM, or rebuild it with one table",
            )


def dequantize(pool: torch.Tensor, scale: float) -> torch.Tensor:
    """Real values of a float8 page pool: ``stored.float() * scale``.

    Args:
        pool: a page pool of any shape (the importers pass
            ``[num_pages, page_size, num_kv_heads, head_dim]``), float8 (or any
            floating dtype), any device and layout.
        scale: the per-layer scale (``value = stored * scale``).

    Returns:
        A new float32 tensor of ``pool``'s shape, on ``pool``'s device.
    """
    return pool.float() * float(scale)


def padded_block_table(
    table: torch.Tensor, ptr: torch.Tensor, lens: torch.Tensor, base: int, page: int, reserve: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A flash-attn/FlashMLA style block table for CSR ``table``/``ptr`` over ``base`` pages.

    Args:
        table: int64 ``[total_pages]``, the pages of every sequence in order.
        ptr: int64 ``[batch + 1]``, sequence ``b`` owns ``table[ptr[b]:ptr[b+1]]``.
        lens: int64 ``[batch]``, tokens per sequence.
        base: pages in the pool the table indexes.
        page: tokens per page.
        reserve: tokens of room to leave after every sequence for appends.

    Returns:
        ``(extra_pages, block_table)``: int64 ``[num_extra]`` pages appended
        after the pool (each the pool page it copies, a shared partly filled
        tail made private so appends cannot clobber another sequence, or -1
        for a zero page), and the int64 ``[batch, width]`` table padded with 0.

    Raises:
        HurrayFormatError: a sequence has fewer pages than its tokens need, or
            the table names pages outside the pool.
    """
    dev = table.device
    ptr, lens = ptr.to(dev), lens.to(dev)
    batch = int(lens.numel())
    have = ptr[1:] - ptr[:-1]
    use = (lens + page - 1) // page
    short = (have < use).nonzero()
    if short.numel():
        s = int(short[0, 0])
        raise HurrayFormatError(
            "block_table",
            f"sequence {s} has {int(have[s])} pages for {int(lens[s])} tokens of {page}; the snapshot is inconsistent",
        )
    need = (lens + reserve + page - 1) // page
    width = max(1, int(need.max()))
    if width * page > INT32_MAX:
        raise HurrayFormatError("seq_lens", f"{width * page} tokens per sequence do not fit the kernels' int32 indices")
    # [batch, width] grows with the longest sequence times the batch, whatever the snapshot's size.
    check_budget(batch * width, "the padded block table", "block_table")
    cols = torch.arange(width, device=dev)[None, :]
    in_use = cols < use[:, None]
    bt = torch.zeros(batch, width, dtype=torch.int64, device=dev)
    bt[in_use] = table[(ptr[:-1, None] + cols)[in_use]]
    used = bt[in_use]
    if bool(((used < 0) | (used >= base)).any()):
        raise HurrayFormatError(
            "block_table", f"the snapshot's block table names pages outside its {base}-page pool; validate() it"
        )
    extra = [torch.empty(0, dtype=torch.int64, device=dev)]
    if reserve > 0:
        # Copy-on-write: the first appended token lands in the last page when it is
        # partly filled; if any other covered entry references that page, give the
        # sequence its own copy.
        refs = torch.bincount(used, minlength=max(base, 1))
        tail_col = lens // page
        rows = torch.arange(batch, device=dev)
        tail = bt[rows, tail_col.clamp(max=width - 1)]
        cow = ((lens % page) != 0) & (refs[tail] > 1)
        # When every reference to a page is such a tail (identical sequences), the
        # first of them may keep the original: the others no longer read it.
        tails = torch.bincount(tail[cow], minlength=refs.numel())
        first = torch.full_like(refs, batch)
        first.scatter_reduce_(0, tail[cow], rows[cow], reduce="amin")
        cow &= ~((tails[tail] == refs[tail]) & (first[tail] == rows))
        cow_rows = cow.nonzero().reshape(-1)
        bt[cow_rows, tail_col[cow_rows]] = base + torch.arange(cow_rows.numel(), device=dev)
        extra.append(tail[cow_rows])
        fresh = ~in_use & (cols < need[:, None])
        n_fresh = int(fresh.sum())
        bt[fresh] = base + cow_rows.numel() + torch.arange(n_fresh, device=dev)
        extra.append(torch.full((n_fresh,), -1, dtype=torch.int64, device=dev))
    out = torch.cat(extra)
    if base + out.numel() == 0:
        # Every sequence is empty: one zero page keeps the padding id 0 valid.
        out = torch.full((1,), -1, dtype=torch.int64, device=dev)
    return out, bt


def check_import_memory(
    snapshot: KVSnapshot,
    slots: int,
    out_dtype: Callable[[BlockPagedTensor], torch.dtype],
    device: torch.device | str | None,
) -> None:
    """Refuse an import of every layer whose new pools no device could hold, before the first is allocated.

    The pools of every layer end up on ``device`` together, in their output
    dtype. Each is built where the snapshot lies, one layer at a time: a
    layer converted to another dtype holds its repaged pool besides the
    result until the next layer, so that much is counted there too.

    Args:
        snapshot: the batch being imported.
        slots: token slots of each new pool (pages x page size), the same for every layer and role.
        out_dtype: each tensor's dtype in the new pool.
        device: where the pools go (``None``: where the snapshot lies).

    Raises:
        OSError: ``ENOMEM`` (see :func:`~hurray_vllm.kv.repage.check_memory`).
    """
    tensors = snapshot.tensors()
    if not tensors:
        return
    built = tensors[0].page_pool.device
    target = torch.device(device) if device is not None else built
    results, converting = [], []  # per layer: its new pools' bytes; the repaged pools a conversion holds besides
    for members in snapshot.layer_members():
        values = [(slots * t.num_heads * t.head_dim, t) for t in members]  # each new pool's element count
        results.append(sum(n * out_dtype(t).itemsize for n, t in values))
        converting.append(sum(n * t.page_pool.element_size() for n, t in values if out_dtype(t) != t.dtype))
    what = f"importing {snapshot.num_layers} layers of {slots} token slots"
    if target == built:
        check_memory(sum(results) + max(converting), what, built)
    else:  # built a layer at a time (its pool, and the converted copy), then moved
        check_memory(max(converting) + max(results), what, built)
        check_memory(sum(results), what, target)
