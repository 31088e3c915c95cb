"""How a :class:`KVSnapshot` is laid out as a sequence of Hurray tensors.

The same sequence is written to streams and to ``.hrry`` files (see
``docs/format.md``)::

    snapshot               group head (0x0B, rule 0x03), 3 members
      snapshot.meta        uint8 [n]     UTF-8 JSON: fingerprint, source, request ids
      snapshot.token_ids   int64 [T]     every sequence's token ids, concatenated
      snapshot.token_ptr   int64 [S+1]   CSR offsets into token_ids
    layers.{i}             group head, 3 or 4 members (2 or 3 for an MLA latent)
      layers.{i}.key       block-paged (0x0A), kv_role key,   layer_index i
      layers.{i}.value     block-paged (0x0A), kv_role value, layer_index i
        or
      layers.{i}.fused     block-paged (0x0A), kv_role fused, layer_index i (MLA latent)
      layers.{i}.seq_lens  int64 [S]     tokens per sequence (not on the wire otherwise)
      layers.{i}.kv_scales float32 [2]   (k_scale, v_scale) of an fp8 cache, if any
                                         (a fused latent: its one scale, twice)
    states.{j}             group head, one member per state tensor (linear-attention hybrids only)
      states.{j}.{name}    row-major [S, *shape] in the engine's dtype (e.g. conv, ssm)

Only standard Hurray constructs are used, so any reader (pyhurray included)
sees a valid stream of composites; a reader that skips groups still finds
plain block-paged descriptors. Conversely :func:`assemble_snapshot` accepts
streams of bare block-paged descriptors written by other tools.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import HurrayFormatError
from ..kv.paged import BlockPagedTensor, IndexCache
from ..kv.snapshot import (
    FUSED_ROLES,
    KV_ROLES,
    HeadRange,
    KVSnapshot,
    LatentSplit,
    ModelFingerprint,
    SlidingWindows,
    SnapshotSource,
    decode_header_members,
)
from ..kv.states import RecurrentStates
from ..wire import dtypes
from ..wire.descriptor import (
    COMPOSITION_RULE_TAGS,
    LAYOUT_BLOCK_PAGED,
    LAYOUT_COMPOSITE,
    LAYOUT_ROW_MAJOR,
    BufferHandle,
    CompositeFields,
    TensorDescriptor,
)
from ..wire.dtypes import widen_index
from ..wire.jsonvalues import Fields, loads_bounded
from ..wire.rules import check_own, raise_if

__all__ = [
    "Record",
    "Node",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_RECORDS",
    "MAX_BUFFERS",
    "snapshot_records",
    "group_records",
    "assemble_snapshot",
    "dense_record",
    "index_tables",
    "snapshot_metadata",
    "group_head",
    "SnapshotHeader",
    "decode_header",
    "build_snapshot",
    "read_state_layer",
    "is_snapshot_header",
    "claims_snapshot",
    "kv_scale_pair",
    "header_records",
    "layer_records",
    "state_records",
    "flatten_tokens",
    "split_tokens",
]

FORMAT_NAME = "hurray-vllm.kv_snapshot"
FORMAT_VERSION = 1
MAX_COMPOSITE_DEPTH = 8
#: Records one input may hold (a file's index entries, a stream's descriptors, a group's members). A
#: snapshot has 4 per layer plus 4; the bound keeps a crafted input of a million tiny records from costing
#: hundreds of MiB of bookkeeping (measured: 28 MiB of input, +330 MiB and 14 s, before the bound).
MAX_RECORDS = 1 << 16
#: Buffers one input may hold, all its records together. Each costs the reader a tensor (~0.5 KB) for 16 bytes
#: of descriptor, empty or not: a group of 8,000 records of 255 empty buffers each (31 MiB of input) cost 18 s
#: and +1.1 GiB before this bound, and the record bound alone admits 16.7 million (65,536 x 255). hurray-vllm's
#: own layout has at most 12 per 5 records (a layer group of quantized K and V), so every snapshot the record
#: bound admits stays under this one; at the bound a reader holds ~150 MB of buffers at worst.
MAX_BUFFERS = 4 * MAX_RECORDS
_MAX_META_BYTES = 64 << 20
_MAX_DIM = (1 << 63) - 1  # torch's sizes are int64
_SMALL_TOKENS = 8192  # token ids and offsets below which split_tokens works on Python lists


@dataclass(frozen=True, eq=False)
class Record:
    """One tensor on the wire: a name (files only), a descriptor, its buffers.

    For writing, ``buffers`` may be typed tensors (their bytes are written
    as they lie in memory); readers return uint8 tensors.
    """

    name: str
    descriptor: TensorDescriptor
    buffers: Sequence[torch.Tensor] = ()


@dataclass(eq=False)
class Node:
    """A record and, for a composite head, the nodes of its members."""

    record: Record
    members: list[Node] = field(default_factory=list)

    @property
    def is_composite(self) -> bool:
        """Whether the record is a composite head (0x0B) whose members follow it."""
        return self.record.descriptor.layout_tag == LAYOUT_COMPOSITE

    def pair_seq_lens(self) -> torch.Tensor | None:
        """A layer group's per-sequence token counts: int64 ``[num_seqs]``, or ``None``.

        A layer group is a composite of its block-paged members (K and V,
        or one fused MLA latent) and a row-major int64 member after them
        holding the sequences' lengths (what :func:`layer_records` writes).
        ``None`` for any other node, and for an empty member of a batch that
        has sequences: the lengths are then unknown, as :func:`assemble_snapshot`
        reads them (so ``validate`` judges as ``load`` does).
        """
        n = _layer_member_count(self)
        if n is None:
            return None
        lens = self.members[n].record
        if (
            lens.descriptor.layout_tag == LAYOUT_ROW_MAJOR
            and lens.descriptor.type_tag == _INT64_TAG
            and lens.buffers
            and lens.buffers[0].numel() % 8 == 0
            and (lens.buffers[0].numel() or _no_seqs(self))
        ):
            return lens.buffers[0].view(torch.int64)
        return None


def index_tables(rec: Record) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A block-paged record's block table and sequence pointers as int64 ``[n]`` tensors.

    ``None`` when the record is not block-paged, lacks the buffers, or their
    sizes are not whole indices (the descriptor checks report that).
    Raises :class:`HurrayFormatError` for a uint64 index no int64 holds, naming the structural
    rule it breaks (``block_table.page_id``, ``seq_ptr.last``): no mode reads past it.
    """
    d = rec.descriptor
    bp = d.block_paged
    if d.layout_tag != LAYOUT_BLOCK_PAGED or bp is None or len(rec.buffers) < 3:
        return None
    ib = bp.index_bytes
    if rec.buffers[1].numel() % ib or rec.buffers[2].numel() % ib:
        return None
    wide = torch.uint64 if bp.index_type_tag == 1 else torch.uint32
    return widen_index(rec.buffers[1], wide, "block_table.page_id"), widen_index(rec.buffers[2], wide, "seq_ptr.last")


_INT64_TAG = dtypes.from_torch(torch.int64).tag


def dense_record(name: str, tensor: torch.Tensor, alignment: int = 64) -> Record:
    """A row-major record for a small CPU tensor.

    Raises:
        HurrayArgumentError: ``tensor``'s dtype has no Hurray element type (field ``name``).
    """
    t = tensor.detach().contiguous()
    et = dtypes.from_torch(t.dtype, argument=name or "tensor")
    desc = TensorDescriptor(
        type_tag=et.tag,
        shape=tuple(int(s) for s in t.shape),
        layout_tag=LAYOUT_ROW_MAJOR,
        buffers=(BufferHandle(t.numel() * t.element_size(), alignment if t.numel() else 1, 0),),
    )
    return Record(name, desc, [t])


def group_head(name: str, member_count: int, shape: Sequence[int], dtype: torch.dtype) -> Record:
    """A data-less group (0x03) head binding the next ``member_count`` records.

    Raises:
        HurrayArgumentError: ``dtype`` has no Hurray element type (field ``dtype``).
    """
    desc = TensorDescriptor(
        type_tag=dtypes.from_torch(dtype, argument="dtype").tag,
        shape=tuple(int(s) for s in shape),
        layout_tag=LAYOUT_COMPOSITE,
        layout=CompositeFields(rule_tag=COMPOSITION_RULE_TAGS["group"], member_count=member_count),
    )
    return Record(name, desc, [])


def snapshot_metadata(snap: KVSnapshot, num_layers: int) -> dict[str, Any]:
    """The snapshot header's JSON object (``hurray_vllm.snapshot`` metadata) for ``num_layers`` layers.

    ``latent`` (the MLA split) appears only for snapshots of fused latents,
    and ``windows`` only for sliding-window hybrids, so other snapshots
    encode to the same bytes as before these existed.
    """
    extra_fields: dict[str, Any] = {"latent": snap.latent.to_json()} if snap.latent is not None else {}
    if snap.windows is not None:
        extra_fields["windows"] = snap.windows.to_json()
    if snap.states is not None:
        extra_fields["states"] = snap.states.to_json()
    if snap.heads is not None:
        extra_fields["heads"] = snap.heads.to_json()
    return {
        **extra_fields,
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "num_layers": num_layers,
        "num_seqs": snap.num_seqs,
        "fingerprint": snap.fingerprint.to_json() if snap.fingerprint else None,
        "source": snap.source.to_json() if snap.source else None,
        "request_ids": list(snap.request_ids) if snap.request_ids is not None else None,
        "extra": snap.extra,
    }


def flatten_tokens(token_ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence token ids as CSR: int64 ``token_ids [T]`` and ``token_ptr [S+1]``."""
    # numpy converts a list of ints ~20x faster than torch.tensor(list) does, and per
    # sequence then concatenated ~1.8x faster than array('q') over a chain of them.
    ptr = np.zeros(len(token_ids) + 1, dtype=np.int64)
    if not token_ids:
        return torch.empty(0, dtype=torch.int64), torch.from_numpy(ptr)
    parts = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in token_ids]
    np.cumsum([p.size for p in parts], out=ptr[1:])
    return torch.from_numpy(np.concatenate(parts)), torch.from_numpy(ptr)


def split_tokens(ids: torch.Tensor, ptr: torch.Tensor) -> list[tuple[int, ...]]:
    """The inverse of :func:`flatten_tokens`, refusing offsets that do not partition ``ids``."""
    for name, t in (("snapshot.token_ids", ids), ("snapshot.token_ptr", ptr)):
        if t.dtype != torch.int64 or t.dim() != 1:
            raise HurrayFormatError(name, f"expected a 1-D int64 tensor, found {t.dtype} of shape {list(t.shape)}")
    if ids.numel() + ptr.numel() <= _SMALL_TOKENS:
        # A chunk's few hundred ids: the same checks on Python ints, several times cheaper than torch ops.
        flat, bounds = ids.tolist(), ptr.tolist()
        low = min(flat, default=0)
        if low < 0:
            raise HurrayFormatError("snapshot.token_ids", f"token id {low} is negative")
        if not bounds or bounds[0] != 0 or bounds[-1] != len(flat):
            raise HurrayFormatError("snapshot.token_ptr", "token_ptr must run from 0 to len(token_ids)")
        if any(b < a for a, b in itertools.pairwise(bounds)):
            raise HurrayFormatError("snapshot.token_ptr", "token_ptr must be non-decreasing")
        return [tuple(flat[bounds[s] : bounds[s + 1]]) for s in range(len(bounds) - 1)]
    if ids.numel() and int(ids.min()) < 0:
        raise HurrayFormatError("snapshot.token_ids", f"token id {int(ids.min())} is negative")
    if ptr.dim() != 1 or ptr.numel() < 1 or int(ptr[0]) != 0 or int(ptr[-1]) != ids.numel():
        raise HurrayFormatError("snapshot.token_ptr", "token_ptr must run from 0 to len(token_ids)")
    if ptr.numel() > 1 and bool((ptr[1:] < ptr[:-1]).any()):
        raise HurrayFormatError("snapshot.token_ptr", "token_ptr must be non-decreasing")
    flat = ids.tolist()
    bounds = ptr.tolist()
    return [tuple(flat[bounds[s] : bounds[s + 1]]) for s in range(len(bounds) - 1)]


def header_records(snap: KVSnapshot, *, num_layers: int | None = None) -> Iterator[Record]:
    """The ``snapshot`` header group: metadata JSON, token ids and their offsets.

    ``num_layers`` lets a streaming writer announce the layers it is about to
    gather (``snap`` then carries no layers yet).
    """
    count = snap.num_layers if num_layers is None else num_layers
    meta = json.dumps(snapshot_metadata(snap, count), sort_keys=True).encode()
    flat, ptr = flatten_tokens(snap.token_ids)
    yield group_head("snapshot", 3, [len(meta)], torch.uint8)
    yield dense_record("snapshot.meta", torch.frombuffer(bytearray(meta), dtype=torch.uint8))
    yield dense_record("snapshot.token_ids", flat)
    yield dense_record("snapshot.token_ptr", ptr)


def layer_records(
    i: int,
    members: Sequence[BlockPagedTensor],
    kv_scales: tuple[float, float] | None = None,
    index_cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Iterator[Record]:
    """The ``layers.{i}`` group of one layer: ``members`` is ``(key, value)`` or ``(fused,)``.

    ``index_cache``: see :meth:`BlockPagedTensor.wire_buffers`.
    """
    k = members[0]
    yield group_head(f"layers.{i}", len(members) + (2 if kv_scales is not None else 1), k.shape, k.dtype)
    # The bytes land on the host whatever device the pools live on.
    for t in members:
        yield Record(f"layers.{i}.{t.kv_role}", t.descriptor(device_tag=0), t.wire_buffers(index_cache))
    lens = k.seq_lens if k.seq_lens is not None else torch.empty(0, dtype=torch.int64)
    yield dense_record(f"layers.{i}.seq_lens", lens.to(torch.int64).cpu())
    if kv_scales is not None:
        yield dense_record(f"layers.{i}.kv_scales", torch.tensor(kv_scales, dtype=torch.float32))


def state_records(states: RecurrentStates | None) -> Iterator[Record]:
    """The ``states.{j}`` groups of a linear-attention hybrid's state layers (nothing for other snapshots)."""
    if states is None:
        return
    for j, layer in enumerate(states.tensors):
        yield group_head(f"states.{j}", len(layer), layer[0].shape, layer[0].dtype)
        for name, t in zip(states.names, layer, strict=True):
            yield dense_record(f"states.{j}.{name}", t.detach().cpu())


def snapshot_records(snap: KVSnapshot) -> Iterator[Record]:
    """The records of ``snap``, layer after layer, then its states (lazy: nothing is copied ahead)."""
    yield from header_records(snap)
    cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # layers often share index tensors
    for i, members in enumerate(snap.layer_members()):
        yield from layer_records(i, members, snap.kv_scales[i] if snap.kv_scales is not None else None, cache)
    yield from state_records(snap.states)


def group_records(records: Iterable[Record], *, permissive: bool = False) -> Iterator[Node]:
    """Bind composite heads to the records that follow them (pre-order).

    Raises for a torn composite (the input ends inside one) and for nesting
    deeper than 8 levels.
    """
    it = iter(records)

    def build(rec: Record, depth: int) -> Node:
        node = Node(rec)
        comp = rec.descriptor.composite
        if comp is None:
            return node
        if depth >= MAX_COMPOSITE_DEPTH:
            raise HurrayFormatError("composite.depth", f"composites nest deeper than {MAX_COMPOSITE_DEPTH} levels")
        if comp.member_count > MAX_RECORDS:
            raise HurrayFormatError(
                "composite.member_count", f"a group of {comp.member_count} members (at most {MAX_RECORDS})"
            )
        for m in range(comp.member_count):
            try:
                child = next(it)
            except StopIteration:
                raise HurrayFormatError(
                    "composite.member_count",
                    f"torn composite {rec.name or ''!s}: input ends after {m} of {comp.member_count} members",
                ) from None
            node.members.append(build(child, depth + 1))
        return node

    for rec in it:
        yield build(rec, 0)


def _dense(node: Node, dtype: torch.dtype, what: str, *, permissive: bool = False) -> torch.Tensor:
    """A row-major record's buffer viewed as ``dtype`` of its shape.

    The descriptor's own rules count as the mode says (a permissive read waives reserved
    flags, alignment and the like, as ``validate(permissive=True)`` does); what this view
    needs (the layout, one buffer, the type, a buffer that holds the shape) is refused in
    every mode.
    """
    d = node.record.descriptor
    if node.is_composite or d.layout_tag != LAYOUT_ROW_MAJOR or len(d.buffers) != 1:
        raise HurrayFormatError(what, "expected a single-buffer row-major tensor")
    if d.type_tag != dtypes.from_torch(dtype).tag:
        raise HurrayFormatError(what, f"expected {dtype}, found type tag 0x{d.type_tag:02X}")
    raise_if(check_own(d, permissive=permissive), what)
    raw = node.record.buffers[0]
    if any(s > _MAX_DIM for s in d.shape):  # an empty buffer "holds" any shape with a 0 in it
        raise HurrayFormatError(what, f"shape {list(d.shape)} has a dimension no tensor can have")
    n = 1
    for s in d.shape:
        n *= s
    if raw.numel() != n * dtype.itemsize:
        raise HurrayFormatError(what, f"buffer of {raw.numel()} bytes does not hold shape {list(d.shape)}")
    flat = raw.view(dtype)
    return flat if len(d.shape) == 1 and raw.dim() == 1 else flat.reshape(d.shape)  # a vector: its view already


def is_snapshot_header(node: Node) -> bool:
    """Whether ``node`` is hurray-vllm's snapshot header group (metadata, token ids, token pointers)."""
    if not node.is_composite or len(node.members) != 3:
        return False
    first = node.members[0].record.descriptor
    return first.layout_tag == LAYOUT_ROW_MAJOR and first.type_tag == dtypes.from_torch(torch.uint8).tag


def claims_snapshot(node: Node) -> bool:
    """Whether ``node`` is (or says it is) part of a hurray-vllm snapshot: its header, a layer group, their names.

    What decides whether ``validate`` runs the snapshot-level checks: a
    damaged header that no longer looks like one still claims to be one (a
    group whose first member still holds the format's name: in a stream,
    which has no names, a wrong member count can make the header swallow the
    layers). Bare KV tensors another writer made (no header) are Hurray data
    that ``validate`` checks by the Hurray rules alone: ``load`` may still
    refuse them as no snapshot.
    """
    name = node.record.name or ""
    return (
        is_snapshot_header(node)
        or _is_layer_group(node)
        or name == "snapshot"
        or name.startswith(("layers.", "states."))
        or _names_the_format(node)
    )


def _names_the_format(node: Node) -> bool:
    """Whether ``node`` is a group whose first member's bytes (the metadata's JSON) name this format."""
    if not node.is_composite or not node.members or node.members[0].is_composite:
        return False
    first = node.members[0].record
    if first.descriptor.layout_tag != LAYOUT_ROW_MAJOR or len(first.buffers) != 1:
        return False
    head = first.buffers[0][:256]
    return FORMAT_NAME.encode() in bytes(head.numpy()) if head.dtype == torch.uint8 else False


def _layer_member_count(node: Node) -> int | None:
    """How many block-paged members lead a layer group (2: K and V, 1: a fused latent); None if not one."""
    if not node.is_composite:
        return None
    tags = [m.record.descriptor.layout_tag for m in node.members]
    n = 0
    while n < len(tags) and n < 2 and tags[n] == LAYOUT_BLOCK_PAGED:
        n += 1
    if n and n + 1 <= len(tags) <= n + 2 and all(t != LAYOUT_BLOCK_PAGED for t in tags[n:]):
        return n
    return None


def _is_layer_group(node: Node) -> bool:
    return _layer_member_count(node) is not None


@dataclass(frozen=True)
class SnapshotHeader:
    """The snapshot metadata every container carries, decoded and type-checked (see :func:`decode_header`)."""

    num_layers: int
    num_seqs: int | None
    fingerprint: ModelFingerprint | None
    source: SnapshotSource | None
    request_ids: tuple[str, ...] | None
    extra: dict[str, Any]
    latent: LatentSplit | None = None
    windows: SlidingWindows | None = None
    states: RecurrentStates | None = None  # the layout only: the tensors follow the layers
    heads: HeadRange | None = None


def decode_header(raw: bytes | str | dict[str, Any], field: str = "snapshot.meta") -> SnapshotHeader:
    """The snapshot header's JSON (``.hrry``/``.hrrs`` metadata record, safetensors ``snapshot`` key), checked.

    The one decoder of snapshot metadata: every member is type-checked and
    bounded (:mod:`hurray_vllm.wire.jsonvalues`), so malformed metadata
    raises :class:`HurrayFormatError` naming the member, never another error.
    """
    meta = loads_bounded(raw, field) if isinstance(raw, bytes | str) else raw
    f = Fields(meta, field)
    if f.obj.get("format") != FORMAT_NAME:
        raise HurrayFormatError(field, f"not a {FORMAT_NAME} header")
    version = f.obj.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise HurrayFormatError(
            f"{field}.version", f"snapshot format version {version!r} is newer than {FORMAT_VERSION} or not a version"
        )
    return SnapshotHeader(**decode_header_members(f))


def _parse_meta(node: Node, *, permissive: bool = False) -> tuple[SnapshotHeader, list[tuple[int, ...]]]:
    raw = _dense(node.members[0], torch.uint8, "snapshot.meta", permissive=permissive)
    if raw.numel() > _MAX_META_BYTES:
        raise HurrayFormatError("snapshot.meta", f"{raw.numel()} bytes of metadata is implausible")
    header = decode_header(bytes(raw.numpy()))
    ids = _dense(node.members[1], torch.int64, "snapshot.token_ids", permissive=permissive)
    ptr = _dense(node.members[2], torch.int64, "snapshot.token_ptr", permissive=permissive)
    return header, split_tokens(ids, ptr)


def _bp(
    node: Node,
    seq_lens: torch.Tensor | None,
    permissive: bool,
    index_cache: IndexCache,
) -> BlockPagedTensor:
    rec = node.record
    if node.is_composite or rec.descriptor.layout_tag != LAYOUT_BLOCK_PAGED:
        raise HurrayFormatError("layout_tag", f"{rec.name or 'tensor'}: expected a block-paged descriptor")
    return BlockPagedTensor.from_wire(
        rec.descriptor, rec.buffers, seq_lens=seq_lens, permissive=permissive, index_cache=index_cache
    )


def assemble_snapshot(nodes: Iterable[Node], *, permissive: bool = False) -> KVSnapshot:
    """Build a :class:`KVSnapshot` from grouped records.

    Accepts hurray-vllm's layout (header group + one group per layer) and
    streams of bare block-paged descriptors (paired by ``layer_index`` and
    ``kv_role``; their sequence lengths are then unknown).
    """
    meta: SnapshotHeader | None = None
    token_ids: list[tuple[int, ...]] = []
    layers: dict[int, dict[str, BlockPagedTensor]] = {}
    scales: dict[int, tuple[float, float]] = {}
    state_groups: list[Node] = []
    # The layers' index buffers are widened and checked once per distinct content.
    index_cache = IndexCache()
    seen_lens: dict[bytes, torch.Tensor] = {}
    order = 0
    for node in nodes:
        if is_snapshot_header(node):
            if meta is not None:
                raise HurrayFormatError("snapshot", "two snapshot headers in one input")
            meta, token_ids = _parse_meta(node, permissive=permissive)
            continue
        n = _layer_member_count(node)
        if n is not None:
            lens = _dense(node.members[n], torch.int64, "seq_lens", permissive=permissive)
            if lens.dim() != 1:
                raise HurrayFormatError("seq_lens", f"sequence lengths must be a vector, got shape {list(lens.shape)}")
            # Every layer stores the lengths; equal ones become one tensor, as in the snapshot that was
            # written (the snapshot's checks then compare layers by identity, not value by value).
            lens = seen_lens.setdefault(lens.numpy().tobytes(), lens)
            first = _bp(node.members[0], lens if lens.numel() or _no_seqs(node) else None, permissive, index_cache)
            members = [first, *(_bp(m, first.seq_lens, permissive, index_cache) for m in node.members[1:n])]
            roles = tuple(t.kv_role for t in members)
            if roles not in (KV_ROLES, FUSED_ROLES):
                raise HurrayFormatError(
                    "kv_role", f"layer group holds {'/'.join(roles)}, not key/value or one fused latent"
                )
            idx = first.layer_index if first.layer_index is not None else order
            if idx in layers:
                raise HurrayFormatError("layer_index", f"layer {idx} appears twice")
            layers[idx] = {t.kv_role: t for t in members}
            if len(node.members) == n + 2:
                kv = _dense(node.members[n + 1], torch.float32, "kv_scales", permissive=permissive)
                scales[idx] = kv_scale_pair(kv)
            order += 1
            continue
        if meta is not None and meta.states is not None and _is_state_group(node, meta.states):
            state_groups.append(node)
            continue
        if not node.is_composite and node.record.descriptor.layout_tag == LAYOUT_BLOCK_PAGED:
            t = _bp(node, None, permissive, index_cache)
            idx = t.layer_index if t.layer_index is not None else order // 2
            slot = layers.setdefault(idx, {})
            if t.kv_role in slot:
                raise HurrayFormatError("kv_role", f"layer {idx} has two {t.kv_role} tensors")
            slot[t.kv_role] = t
            order += 1
            continue
        if permissive:
            # Left out of the snapshot, but not unread: its tensors must be readable, as validate finds them.
            _check_skipped(node, index_cache)
            continue
        raise HurrayFormatError(
            "layout_tag",
            f"{node.record.name or 'a tensor'} (layout 0x{node.record.descriptor.layout_tag:02X}) is not part of a KV "
            "snapshot; use hurray-vllm inspect to look at arbitrary Hurray data",
        )
    if meta is None and not layers:
        raise HurrayFormatError("snapshot", "the input holds no KV snapshot (no block-paged tensors)")
    if meta is not None:
        check_layer_count(meta, len(layers))
    if sorted(layers) != list(range(len(layers))):
        raise HurrayFormatError("layer_index", f"layers {sorted(layers)} are not 0..{len(layers) - 1}")
    roles = FUSED_ROLES if layers and set(layers[0]) == {"fused"} else KV_ROLES
    per_layer = []
    for i in range(len(layers)):
        if set(layers[i]) != set(roles):
            raise HurrayFormatError(
                "kv_role", f"layer {i} has roles {sorted(layers[i])}, layer 0 has {'/'.join(roles)}"
            )
        per_layer.append(tuple(layers[i][r] for r in roles))
    kv_scales = None
    if scales:
        if len(scales) != len(layers):
            raise HurrayFormatError("kv_scales", "some layers carry fp8 scales and others do not")
        kv_scales = tuple(scales[i] for i in range(len(layers)))
    states = [[m.record for m in g.members] for g in state_groups]
    return build_snapshot(
        per_layer,
        token_ids,
        kv_scales,
        meta,
        permissive=permissive,
        states=[read_state_layer(r, meta, permissive=permissive) for r in states],
    )


def check_layer_count(meta: SnapshotHeader, n: int) -> None:
    """Raise unless the header announces the ``n`` layers the input holds."""
    if meta.num_layers != n:
        raise HurrayFormatError(
            "snapshot.num_layers", f"the header announces {meta.num_layers} layers but the input holds {n} (truncated?)"
        )


def _check_skipped(node: Node, index_cache: IndexCache) -> None:
    """Raise for a block-paged tensor in ``node`` (a group a permissive read leaves out) that cannot be read.

    ``validate`` checks every record it walks; a permissive ``load`` that
    skipped what ``validate`` refuses would tell two stories of one file.
    """
    lens = node.pair_seq_lens()
    for m in node.members:
        if m.is_composite:
            _check_skipped(m, index_cache)
        elif m.record.descriptor.layout_tag == LAYOUT_BLOCK_PAGED:
            _bp(m, lens, True, index_cache)


def _is_state_group(node: Node, layout: RecurrentStates) -> bool:
    """A ``states.{j}`` group: a composite of row-major members, one per state the header names."""
    return (
        node.is_composite
        and len(node.members) == len(layout.names)
        and all(not m.is_composite and m.record.descriptor.layout_tag == LAYOUT_ROW_MAJOR for m in node.members)
    )


def read_state_layer(
    records: Sequence[Record], header: SnapshotHeader | None, *, permissive: bool = False
) -> list[torch.Tensor]:
    """One state layer's tensors from its records, each checked against the shape and dtype the header declares.

    ``permissive``: the records' own descriptor rules count as in a permissive read (waivable
    ones are waived); the shapes, dtypes and buffer sizes are checked in every mode.

    Raises:
        HurrayFormatError: (field ``snapshot.states.{name}``) a member of another
            shape or dtype than declared, or a buffer that does not hold it.
    """
    layout = header.states if header is not None else None
    if layout is None:
        raise HurrayFormatError("snapshot.states", "state tensors without a header that declares them")
    out = []
    for rec, name, (shape, dt) in zip(records, layout.names, layout.declared, strict=True):
        dtype = dtypes.element_type(dt).torch or torch.uint8
        t = _dense(Node(rec), dtype, f"snapshot.states.{name}", permissive=permissive)
        if tuple(t.shape) != (layout.num_seqs, *shape):
            raise HurrayFormatError(
                f"snapshot.states.{name}",
                f"holds {list(t.shape)}, the header declares {[layout.num_seqs, *shape]}",
            )
        out.append(t)
    return out


def build_snapshot(
    layers: Sequence[Sequence[BlockPagedTensor]],
    token_ids: Sequence[tuple[int, ...]],
    kv_scales: tuple[tuple[float, float], ...] | None,
    header: SnapshotHeader | None,
    *,
    permissive: bool = False,
    states: Sequence[Sequence[torch.Tensor]] = (),
) -> KVSnapshot:
    """The snapshot every container reader returns, after the snapshot-level rules (:meth:`KVSnapshot.validate`).

    ``layers``: per layer ``(key, value)`` or ``(fused,)`` (see :meth:`KVSnapshot.from_layers`).
    Fused latents need the header's ``latent`` split. ``states``: per state
    layer its tensors (:func:`read_state_layer`), exactly as many as the
    header's ``states`` declares.
    """
    layout = header.states if header is not None else None
    if layout is None and states:
        raise HurrayFormatError("snapshot.states", "state tensors without a header that declares them")
    if layout is not None and len(states) != len(layout.layers):
        raise HurrayFormatError(
            "snapshot.states",
            f"the header declares {len(layout.layers)} state layers but the input holds {len(states)} (truncated?)",
        )
    lead = layers[0][0] if layers and layers[0] else None
    held = lead.num_seqs if lead is not None else len(token_ids)  # what the snapshot's num_seqs will be
    if header is not None and header.num_seqs is not None and header.num_seqs != held:
        # As the layer count: the header announces what the input holds, in every mode.
        raise HurrayFormatError(
            "snapshot.num_seqs", f"the header announces {header.num_seqs} sequences but the input holds {held}"
        )
    if layout is not None and lead is not None and layout.num_seqs != lead.num_seqs:
        # Structural even for a permissive read: a sequence would take another's state.
        raise HurrayFormatError(
            "snapshot.states.positions", f"states for {layout.num_seqs} sequences, the layers hold {lead.num_seqs}"
        )
    if layers and all(len(m) == 1 for m in layers) and (header is None or header.latent is None):
        raise HurrayFormatError(
            "snapshot.latent", "the layers hold fused MLA latents but the header does not say how they divide"
        )
    snap = KVSnapshot.from_layers(
        layers,
        latent=header.latent if header and layers and all(len(m) == 1 for m in layers) else None,
        token_ids=tuple(token_ids),
        fingerprint=header.fingerprint if header else None,
        kv_scales=kv_scales,
        source=header.source if header else None,
        request_ids=header.request_ids if header else None,
        extra=dict(header.extra) if header else {},
        windows=header.windows if header else None,
        states=layout.with_tensors(states) if layout is not None else None,
        heads=header.heads if header else None,
    )
    raise_if(snap.validate(permissive=permissive, tensors=False), "snapshot")
    return snap


def kv_scale_pair(sc: torch.Tensor) -> tuple[float, float]:
    """A layer's ``(k_scale, v_scale)`` from its float32 ``[2]`` record; the values are checked by the snapshot."""
    if sc.dtype != torch.float32 or tuple(sc.shape) != (2,):
        raise HurrayFormatError("kv_scales", f"expected float32 (k_scale, v_scale), found {sc.dtype} {list(sc.shape)}")
    return float(sc[0]), float(sc[1])


def _no_seqs(node: Node) -> bool:
    bp = node.members[0].record.descriptor.block_paged
    return bp is not None and bp.num_seqs == 0
