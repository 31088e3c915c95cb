"""Loading a ``.hrry`` snapshot whose structure a file read before had: what repeats from chunk to chunk.

The chunk files of one engine differ in their content (metadata, token ids,
page pools) and in nothing else: the same index rows, descriptors, block
tables, sequence pointers and lengths, layer after layer. Reading one the
general way (:func:`load_hrry` without a template) decodes and checks ~36
records, widens and checks the index buffers and builds each tensor through
:meth:`BlockPagedTensor.from_wire`: about three quarters of a chunk's parse,
the same work for every file.

A *template* remembers, from a file that loaded, everything that work
depended on: the index rows of its layer groups, the bytes of their
descriptors and of every buffer the checks read (all but the page pools and
raw quantization buffers, which are opaque content), the file's size and
alignment, and how the loaded tensors came out of them. A later file whose
rows, size and those bytes are the same gives the same verdicts on them, so
its layers are built straight from the template: pool views at the same
offsets, fresh copies of the index tensors (never shared between snapshots).
What differs from file to file is read as before: the header group (its
records and metadata, by the same functions), then the snapshot-level checks
(:func:`build_snapshot`). Same result, same errors, in the same order, as
the general way; any difference, and the general way reads the file.

Only files of the plain layout are remembered (a header group, then layer
groups of block-paged members, a ``seq_lens`` and perhaps ``kv_scales``);
a linear-attention hybrid's state groups, bare descriptors or nested groups
are always read the general way.

What a template holds is counted in bytes of memory (:func:`_cost`): its
compared bytes, and a fixed cost, measured with tracemalloc and rounded up,
for each index row (with its name), compared span, tensor, index tensor and
layer it keeps. A file whose template would hold more than
:data:`MAX_TEMPLATE_BYTES` is not remembered; at most :data:`MAX_TEMPLATES`
are kept, holding at most :data:`MAX_TOTAL_BYTES` together. Those that no
file matched since they were learned go first (least recently used first),
then the least recently used of the rest: a template is learned from a file
before its reader verifies it (a chunk's digest, its tokens), and the files
a reader then refuses, each read once, must not push out the templates of
the files it uses. (Such a template is sound: the general reader read its
file's structure, and only files of the same bytes are built from it.)

``HURRAY_PARSE_MEMO=0`` in the environment (or :func:`set_enabled`) turns
templates off, for comparisons.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..kv.paged import BlockPagedTensor
from ..kv.snapshot import KVSnapshot
from ..wire.descriptor import LAYOUT_BLOCK_PAGED
from .hrryfile import HrryFile, IndexEntry, row_bytes
from .schema import (
    Node,
    Record,
    _layer_member_count,
    _parse_meta,
    assemble_snapshot,
    build_snapshot,
    check_layer_count,
    group_records,
    is_snapshot_header,
)

__all__ = [
    "load_hrry",
    "set_enabled",
    "enabled",
    "clear",
    "stats",
    "MAX_TEMPLATES",
    "MAX_TEMPLATE_BYTES",
    "MAX_TOTAL_BYTES",
]

#: Templates kept (all shapes of file together; an engine writes one or two: whole chunks, tails).
MAX_TEMPLATES = 32
#: A file whose template would hold more memory than this is not remembered (:func:`_cost`; an 8-layer
#: chunk's holds ~37 KiB, of which 3.4 KiB compared bytes; a 128-layer chunk's ~0.55 MiB).
MAX_TEMPLATE_BYTES = 1 << 20
#: The memory all templates kept may hold together.
MAX_TOTAL_BYTES = 8 << 20
#: What a template holds besides its compared bytes and index rows (:func:`~.hrryfile.row_bytes`), per object:
#: measured with tracemalloc (in parentheses) and rounded up. A compared span, or a quantization buffer's:
#: two ints in a tuple (~140).
_SPAN_BYTES = 160
#: A tensor's recipe: its _Tensor, fields dict, pool offset and shape (~540).
_TENSOR_BYTES = 768
#: An index tensor besides its bytes: the Python object, and torch's tensor and storage, which tracemalloc does not see.
_INDEX_TENSOR_BYTES = 768
#: A layer's tuple and its kv_scales pair (~100).
_LAYER_BYTES = 160
#: Regions of the file closer than this are compared as one (with the padding between them): adjacent
#: descriptors, say, but not a 8-byte block table and the 4 KiB of padding after it.
_JOIN_GAP = 64
#: Records of the header group: its head, the metadata, the token ids and their offsets.
_HEADER_RECORDS = 4
#: The tensor fields of a BlockPagedTensor a template rebuilds for every file; the rest it copies.
_TENSOR_FIELDS = frozenset({"page_pool", "block_table", "seq_ptr", "seq_lens", "quant_buffers"})

_enabled = os.environ.get("HURRAY_PARSE_MEMO", "1") != "0"
_lock = threading.Lock()


def set_enabled(on: bool) -> bool:
    """Use templates (``on``) or read every file the general way; returns the previous setting."""
    global _enabled
    before, _enabled = _enabled, bool(on)
    return before


def enabled() -> bool:
    """Whether templates are used."""
    return _enabled


def clear() -> None:
    """Forget every template (and zero :func:`stats`)."""
    with _lock:
        _TEMPLATES.clear()
        for k in _STATS:
            _STATS[k] = 0


def stats() -> dict[str, int]:
    """What the templates did so far.

    ``hits``: files built (or refused) from a template; ``misses``: files read the general way with
    templates on; ``learned``: templates made; ``kept``: templates kept now; ``bytes``: the memory
    they hold (:func:`_cost`).
    """
    with _lock:
        kept = [t for v in _TEMPLATES.values() for t in v]
        return {**_STATS, "kept": len(kept), "bytes": sum(t.cost for t in kept)}


_STATS = {"hits": 0, "misses": 0, "learned": 0}


def _count(what: str) -> None:
    with _lock:
        _STATS[what] += 1


def _plain_dataclass(cls: type) -> bool:
    """Whether ``cls``'s ``__init__`` only stores its fields (a dataclass without ``__post_init__`` or slots)."""
    params = getattr(cls, "__dataclass_params__", None)
    return params is not None and params.init and not hasattr(cls, "__post_init__") and "__slots__" not in vars(cls)


#: BlockPagedTensor's __init__ stores its ten fields one by one (3 us per tensor, 16 per chunk);
#: a plain dataclass instance is its __dict__, which one update fills with the same values.
_FAST_NEW = _plain_dataclass(BlockPagedTensor)
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(BlockPagedTensor))
_OTHER_FIELDS = tuple(n for n in _FIELD_NAMES if n not in _TENSOR_FIELDS)


def _tensor_of(values: dict[str, object]) -> BlockPagedTensor:
    """``BlockPagedTensor(**values)``, ``values`` holding every field in field order."""
    if not _FAST_NEW:
        return BlockPagedTensor(**values)  # type: ignore[arg-type]
    t: BlockPagedTensor = object.__new__(BlockPagedTensor)
    t.__dict__.update(values)
    return t


@dataclass(frozen=True, eq=False)
class _Tensor:
    """How one BlockPagedTensor of a template is rebuilt from a file: where its buffers lie, what it holds."""

    fields: dict[str, object]  # every field: those of no tensor (role, layer, index type...) and placeholders
    pool: tuple[int, int]  # offset and size of the page pool
    dtype: torch.dtype
    shape: tuple[int, ...]
    quant: tuple[tuple[int, int], ...]  # offset and size of each raw quantization buffer
    table: int  # indices into the template's index tensors
    ptr: int
    lens: int | None


@dataclass(eq=False)
class _Template:
    permissive: bool
    tail: list[IndexEntry]  # the index rows after the header group's
    regions: tuple[tuple[int, int], ...]  # compared spans (start, stop)
    key: bytes  # their bytes in the file the template was made from
    small: tuple[torch.Tensor, ...]  # the index tensors (int64), copied for every snapshot built
    layers: tuple[tuple[_Tensor, ...], ...]
    kv_scales: tuple[tuple[float, float], ...] | None
    cost: int = 0  # the memory it holds (_cost)
    matched: bool = False  # whether a file matched it since it was learned (set under _lock)

    def matches(self, hf: HrryFile, view: memoryview) -> bool:
        # Rows are interned (hrryfile._interned): equal rows are one object, compared by identity.
        if hf.entries[_HEADER_RECORDS:] != self.tail:
            return False
        return b"".join([view[a:b] for a, b in self.regions]) == self.key

    def build(self, hf: HrryFile) -> KVSnapshot | None:
        """The snapshot :func:`assemble_snapshot` would return for ``hf`` (or its error).

        ``None`` if the header group has another shape: the general way then reads the file,
        meeting what was read here in the same order.
        """
        p = self.permissive
        entries = hf.entries
        # The header group, read as group_records reads it: record by record, in index order.
        head = hf.read(entries[0], permissive=p)
        comp = head.descriptor.composite
        if comp is None or comp.member_count != _HEADER_RECORDS - 1:
            return None
        members = []
        for e in entries[1:_HEADER_RECORDS]:
            rec = hf.read(e, permissive=p)
            if rec.descriptor.composite is not None:
                return None
            members.append(Node(rec))
        node = Node(head, members)
        if not is_snapshot_header(node):
            return None
        _count("hits")  # from here on, what the general reader would build or refuse is built or refused here
        meta, token_ids = _parse_meta(node, permissive=p)
        # The layers: what assemble_snapshot built from the same bytes, with this file's pools.
        small = [t.clone() for t in self.small]
        per_layer = []
        for layer in self.layers:
            built = []
            for t in layer:
                values = t.fields.copy()  # the other fields, as the first file had them (in field order)
                values["page_pool"] = hf.typed_buffer(*t.pool, t.dtype).view(t.shape)
                values["block_table"] = small[t.table]
                values["seq_ptr"] = small[t.ptr]
                values["seq_lens"] = None if t.lens is None else small[t.lens]
                values["quant_buffers"] = tuple(hf.buffer(*q) for q in t.quant) if t.quant else ()
                built.append(_tensor_of(values))
            per_layer.append(tuple(built))
        check_layer_count(meta, len(per_layer))
        return build_snapshot(per_layer, token_ids, self.kv_scales, meta, permissive=p, states=[])


#: Templates by (permissive, file size, alignment, record count), each a short list; least recently used first.
_TEMPLATES: OrderedDict[tuple[bool, int, int, int], list[_Template]] = OrderedDict()
_PER_KEY = 4


def _coarse(hf: HrryFile, permissive: bool) -> tuple[bool, int, int, int]:
    return (permissive, hf.size, hf.alignment, len(hf.entries))


def _find(hf: HrryFile, view: memoryview, permissive: bool) -> _Template | None:
    key = _coarse(hf, permissive)
    with _lock:
        found = _TEMPLATES.get(key)
        if found is None:
            return None
        _TEMPLATES.move_to_end(key)
        candidates = list(found)
    for t in candidates:
        if t.matches(hf, view):
            with _lock:
                t.matched = True
                if t in found:  # still kept: the most recently used of its list
                    found.remove(t)
                    found.insert(0, t)
            return t
    return None


def _remember(hf: HrryFile, permissive: bool, t: _Template) -> None:
    key = _coarse(hf, permissive)
    with _lock:
        found = _TEMPLATES.setdefault(key, [])
        _TEMPLATES.move_to_end(key)
        found.insert(0, t)
        if len(found) > _PER_KEY:
            _evict([(key, found)], t)
        while True:
            kept = [x for v in _TEMPLATES.values() for x in v]
            if len(kept) <= MAX_TEMPLATES and sum(x.cost for x in kept) <= MAX_TOTAL_BYTES:
                break
            if not _evict(list(_TEMPLATES.items()), t):
                break


def _evict(lists: list[tuple[tuple[bool, int, int, int], list[_Template]]], keep: _Template) -> bool:
    """Drop one template of ``lists`` (least recently used first, each list most recent first), not ``keep``.

    The least recently used that no file matched since it was learned, else the least recently used:
    templates of files read once (refused by their reader, perhaps) go before those that serve files.
    Returns whether one was dropped. Called under ``_lock``.
    """
    order = [(key, t) for key, found in lists for t in reversed(found) if t is not keep]
    if not order:
        return False
    key, t = next((x for x in order if not x[1].matched), order[0])
    found = _TEMPLATES[key]
    found.remove(t)
    if not found:
        del _TEMPLATES[key]
    return True


def _kept(records: Iterable[Record], into: list[Record]) -> Iterator[Record]:
    for r in records:
        into.append(r)
        yield r


def load_hrry(hf: HrryFile, *, permissive: bool = False) -> KVSnapshot:
    """The snapshot in the open ``.hrry`` file ``hf``, from a template where one fits.

    What ``assemble_snapshot(group_records(hf.records()))`` returns, with the same errors
    (see the module's documentation).

    Raises:
        HurrayFormatError: as :func:`hurray_vllm.containers.io.load`.
    """
    view = hf.whole
    use = _enabled and isinstance(view, memoryview)
    if use:
        assert isinstance(view, memoryview)
        t = _find(hf, view, permissive)
        if t is not None:
            snap = t.build(hf)  # a hit (counted there) unless the header group has another shape
            if snap is not None:
                return snap
        _count("misses")
    records: list[Record] = []
    snap = assemble_snapshot(
        group_records(_kept(hf.records(permissive=permissive), records), permissive=permissive),
        permissive=permissive,
    )
    if use:
        assert isinstance(view, memoryview)
        made = _template(hf, view, permissive, records, snap)
        if made is not None:
            _remember(hf, permissive, made)
            _count("learned")
    return snap


def _template(
    hf: HrryFile, view: memoryview, permissive: bool, records: list[Record], snap: KVSnapshot
) -> _Template | None:
    """A template of ``hf`` (whose records loaded as ``snap``), or ``None`` for a file not of the plain layout."""
    if snap.states is not None or len(records) != len(hf.entries) or len(records) <= _HEADER_RECORDS:
        return None
    nodes = list(group_records(records, permissive=permissive))
    if not nodes or not is_snapshot_header(nodes[0]) or len(nodes[0].members) != _HEADER_RECORDS - 1:
        return None
    if any(m.members for m in nodes[0].members):
        return None
    # Every other node a layer group of plain members; the records of all of them, in file order.
    for node in nodes[1:]:
        if _layer_member_count(node) is None or any(m.members or m.is_composite for m in node.members):
            return None
    entries = hf.entries
    pools: dict[int, tuple[Record, list[tuple[int, int]]]] = {}  # record and buffer spans by the pool's address
    spans: list[tuple[int, int]] = []
    for k in range(_HEADER_RECORDS, len(records)):
        e, rec = entries[k], records[k]
        spans.append((e.descriptor_offset, e.descriptor_offset + e.descriptor_length))
        bufs = hf.buffer_spans(e, rec.descriptor)
        paged = rec.descriptor.layout_tag == LAYOUT_BLOCK_PAGED
        for i, (pos, size) in enumerate(bufs):
            if paged and (i == 0 or i >= 3):
                continue  # content: the pool and raw quantization buffers, which no check reads
            spans.append((pos, pos + size))
        if paged:
            if not bufs or bufs[0][1] == 0 or not rec.buffers:
                return None
            pools[rec.buffers[0].data_ptr()] = (rec, bufs)
    regions = _joined(spans)
    # What it will hold at least (the rows' names may be 64 KiB each; a layer of tiny pools holds more in
    # objects than in compared bytes), before building any of it.
    tail = entries[_HEADER_RECORDS:]
    least = sum(b - a for a, b in regions) + len(regions) * _SPAN_BYTES + sum(map(row_bytes, tail))
    if least + len(pools) * _TENSOR_BYTES > MAX_TEMPLATE_BYTES:
        return None
    small: list[torch.Tensor] = []
    where: dict[int, int] = {}  # index tensors of the snapshot by identity -> position in small

    def index_of(t: torch.Tensor) -> int:
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise _NotPlain
        got = where.get(id(t))
        if got is None:
            got = where[id(t)] = len(small)
            small.append(t.clone())
        return got

    layers = []
    try:
        for members in snap.layer_members():
            built = []
            for t in members:
                found = pools.pop(t.page_pool.data_ptr(), None)
                if found is None:
                    return None
                rec, bufs = found
                pool = t.page_pool
                if not pool.is_contiguous() or pool.numel() * pool.element_size() != bufs[0][1]:
                    return None
                if len(t.quant_buffers) != len(bufs) - 3 or any(
                    q is not b for q, b in zip(t.quant_buffers, rec.buffers[3:], strict=False)
                ):
                    return None
                # Every field in field order; the tensor fields are placeholders, set for each file.
                fields = dict.fromkeys(_FIELD_NAMES)
                for name in _OTHER_FIELDS:
                    value = fields[name] = getattr(t, name)
                    if isinstance(value, torch.Tensor):
                        return None
                if len(vars(t)) != len(fields):
                    return None
                built.append(
                    _Tensor(
                        fields=fields,
                        pool=bufs[0],
                        dtype=pool.dtype,
                        shape=tuple(pool.shape),
                        quant=tuple(bufs[3:]),
                        table=index_of(t.block_table),
                        ptr=index_of(t.seq_ptr),
                        lens=None if t.seq_lens is None else index_of(t.seq_lens),
                    )
                )
            layers.append(tuple(built))
    except _NotPlain:
        return None
    if pools:  # a block-paged record the snapshot does not hold
        return None
    made = _Template(
        permissive=permissive,
        tail=tail,
        regions=regions,
        key=b"".join([view[a:b] for a, b in regions]),
        small=tuple(small),
        layers=tuple(layers),
        kv_scales=snap.kv_scales,
    )
    made.cost = _cost(made)
    return made if made.cost <= MAX_TEMPLATE_BYTES else None


def _cost(t: _Template) -> int:
    """The memory ``t`` holds: its compared bytes, index rows, spans, tensors, index tensors and layers."""
    tensors = [x for layer in t.layers for x in layer]
    return (
        len(t.key)
        + sum(map(row_bytes, t.tail))
        + (len(t.regions) + sum(len(x.quant) for x in tensors)) * _SPAN_BYTES
        + len(tensors) * _TENSOR_BYTES
        + sum(_INDEX_TENSOR_BYTES + x.nbytes for x in t.small)
        + len(t.layers) * _LAYER_BYTES
    )


class _NotPlain(Exception):
    """A loaded tensor a template could not rebuild as it is."""


def _joined(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``spans`` in file order, those closer than :data:`_JOIN_GAP` joined (fewer, longer comparisons)."""
    out: list[list[int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a - out[-1][1] < _JOIN_GAP:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)
