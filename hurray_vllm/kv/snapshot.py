"""``KVSnapshot``: one batch of sequences across a whole model."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ..errors import HurrayFormatError, Violation
from ..wire.jsonvalues import Fields
from ..wire.rules import Checked
from .paged import BlockPagedTensor, SharingStats, plan_compaction

__all__ = ["ModelFingerprint", "SnapshotSource", "KVSnapshot"]


#: Bounds on what a fingerprint may claim (a sanity bound on hostile metadata, far above any model).
_MAX_LAYERS = 1 << 16
_MAX_HEADS = 1 << 16
_MAX_HEAD_DIM = 1 << 16


@dataclass(frozen=True)
class ModelFingerprint:
    """What an importer compares before it trusts a snapshot's KV.

    ``dtype`` is the cache *storage* dtype name (``"bfloat16"``,
    ``"float8_e4m3"``...). ``weights_digest`` tells apart two models with the
    same geometry (a hash the exporter computes from the weights), when known.
    """

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    weights_digest: str | None = None

    def mismatches(
        self,
        other: ModelFingerprint,
        *,
        ignore: Collection[str] = (),
        labels: tuple[str, str] = ("snapshot", "target"),
    ) -> list[str]:
        """Human-readable differences from ``other`` (empty when compatible).

        A digest only counts when both sides have one.

        Args:
            other: The fingerprint to compare with.
            ignore: Field names not to compare (e.g. ``{"dtype"}`` where an
                fp8 cache is dequantized for a bf16 model).
            labels: What to call ``self`` and ``other`` in the messages.

        Example:
            >>> a = ModelFingerprint("Llama", 2, 4, 64, "bfloat16")
            >>> a.mismatches(ModelFingerprint("Llama", 2, 8, 64, "bfloat16"))
            ['num_kv_heads: snapshot has 4, target has 8']
        """
        out = []
        mine, theirs = labels
        for name in ("architecture", "num_layers", "num_kv_heads", "head_dim", "dtype"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b and name not in ignore:
                out.append(f"{name}: {mine} has {a!r}, {theirs} has {b!r}")
        if (
            "weights_digest" not in ignore
            and self.weights_digest
            and other.weights_digest
            and self.weights_digest != other.weights_digest
        ):
            out.append(f"weights_digest: the {mine} was computed by different weights")
        return out

    def to_json(self) -> dict[str, Any]:
        """The fingerprint as a JSON-ready dict of its fields."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> ModelFingerprint:
        """The fingerprint :meth:`to_json` wrote; a bad field raises :class:`HurrayFormatError` naming it."""
        f = Fields(d, "snapshot.fingerprint")
        return cls(
            architecture=f.string("architecture", max_len=256),
            num_layers=f.integer("num_layers", hi=_MAX_LAYERS),
            num_kv_heads=f.integer("num_kv_heads", lo=1, hi=_MAX_HEADS),
            head_dim=f.integer("head_dim", lo=1, hi=_MAX_HEAD_DIM),
            dtype=f.string("dtype", max_len=64),
            weights_digest=f.string("weights_digest", max_len=256, default=None),
        )


@dataclass(frozen=True)
class SnapshotSource:
    """Where a snapshot came from: engine, its cache layout, its block size."""

    engine: str
    layout: str
    page_size: int

    def to_json(self) -> dict[str, Any]:
        """The source as a JSON-ready dict of its fields."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> SnapshotSource:
        """The source :meth:`to_json` wrote; a bad field raises :class:`HurrayFormatError` naming it."""
        f = Fields(d, "snapshot.source")
        return cls(
            engine=f.string("engine", max_len=256),
            layout=f.string("layout", max_len=256),
            page_size=f.integer("page_size", lo=1, hi=(1 << 32) - 1),
        )


_ROLES = ("key", "value")


@dataclass(frozen=True, eq=False)
class KVSnapshot:
    """Keys and values of a batch of sequences, for every layer.

    ``keys[i]`` and ``values[i]`` are layer ``i``'s block-paged tensors; all
    layers and both roles share one block structure (same block table,
    seq_ptr and seq_lens), which is what lets an importer plan repaging once.

    Attributes:
        keys, values: one :class:`BlockPagedTensor` per layer.
        token_ids: per sequence, the token ids whose KV the snapshot holds,
            optionally followed by tokens sampled but not yet computed (a
            continuation needs the last sampled token; ``seq_lens`` says
            how many have KV).
        fingerprint: the model the KV belongs to, when known.
        kv_scales: per layer ``(k_scale, v_scale)`` of an fp8 cache
            (``value = stored * scale``); ``None`` for unscaled caches.
        source: the producing engine, layout and page size.
        request_ids: the engine's ids of the sequences, when known.
    """

    keys: tuple[BlockPagedTensor, ...]
    values: tuple[BlockPagedTensor, ...]
    token_ids: tuple[tuple[int, ...], ...] = ()
    fingerprint: ModelFingerprint | None = None
    kv_scales: tuple[tuple[float, float], ...] | None = None
    source: SnapshotSource | None = None
    request_ids: tuple[str, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values):
            raise HurrayFormatError(
                "snapshot.layers", f"{len(self.keys)} key layers but {len(self.values)} value layers"
            )

    # ── access ─────────────────────────────────────────────────────────────

    def __getitem__(self, item: tuple[int, str]) -> BlockPagedTensor:
        layer, role = item
        if role not in _ROLES:
            raise KeyError(f"role must be 'key' or 'value', not {role!r}")
        layers = self.keys if role == "key" else self.values
        return layers[layer]

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.keys)

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch."""
        return self.keys[0].num_seqs if self.keys else len(self.token_ids)

    @property
    def seq_lens(self) -> list[int]:
        """Tokens with KV, per sequence."""
        if not self.keys:
            return [len(t) for t in self.token_ids]
        lens = self.keys[0].seq_lens
        if lens is None:
            raise HurrayFormatError("seq_lens", "this snapshot does not carry sequence lengths")
        return [int(x) for x in lens]

    @property
    def page_size(self) -> int:
        """Tokens per page (0 for a snapshot without layers)."""
        return self.keys[0].page_size if self.keys else 0

    @property
    def nbytes(self) -> int:
        """Bytes of all layers' buffers on the wire, keys and values."""
        return sum(t.nbytes for t in (*self.keys, *self.values))

    def layers(self) -> list[tuple[BlockPagedTensor, BlockPagedTensor]]:
        """``(keys, values)`` of every layer, in layer order."""
        return list(zip(self.keys, self.values))

    def sharing(self) -> SharingStats:
        """The block structure's page sharing (:meth:`BlockPagedTensor.sharing`), shared by every layer and role."""
        return self.keys[0].sharing() if self.keys else SharingStats(0, 0, 0, 0)

    # ── batch operations ───────────────────────────────────────────────────

    def select(self, seqs: Sequence[int]) -> KVSnapshot:
        """A snapshot of the sequences ``seqs`` only, compacted."""
        keys = tuple(k.select(seqs) for k in self.keys)
        values = tuple(v.select(seqs) for v in self.values)
        ids = tuple(self.token_ids[s] for s in seqs) if self.token_ids else ()
        rids = tuple(self.request_ids[s] for s in seqs) if self.request_ids else None
        return replace(self, keys=keys, values=values, token_ids=ids, request_ids=rids).compact()

    def compact(self) -> KVSnapshot:
        """Drop pages no sequence references; one plan for every layer and role."""
        if not self.keys:
            return self
        plan = plan_compaction(self.keys[0].block_table, self.keys[0].num_pages)
        return replace(
            self,
            keys=tuple(k.compact(plan) for k in self.keys),
            values=tuple(v.compact(plan) for v in self.values),
        )

    # ── checks ─────────────────────────────────────────────────────────────

    def validate(self, *, permissive: bool = False, tensors: bool = True) -> Checked:
        """Every rule broken by any layer, plus the snapshot's own consistency.

        ``tensors=False`` skips the per-tensor rules (a reader that built the
        tensors with :meth:`BlockPagedTensor.from_wire` has checked them).
        """
        found: list[Violation] = []
        for i, (k, v) in enumerate(self.layers()):
            for t in (k, v) if tensors else ():
                found.extend(
                    Violation(x.invariant, f"layer {i} {t.kv_role}: {x.message}")
                    for x in t.validate(permissive=permissive).violations
                )
            if k.kv_role != "key" or v.kv_role != "value":
                found.append(Violation("kv_role", f"layer {i} holds roles {k.kv_role}/{v.kv_role}"))
            if k.layer_index != v.layer_index:
                found.append(
                    Violation("layer_index", f"layer {i}: key says layer {k.layer_index}, value {v.layer_index}")
                )
            if not (
                (k.block_table is v.block_table or torch.equal(k.block_table, v.block_table))
                and (k.seq_ptr is v.seq_ptr or torch.equal(k.seq_ptr, v.seq_ptr))
                and k.page_pool.shape == v.page_pool.shape
            ):
                found.append(Violation("snapshot.structure", f"layer {i} key and value differ in block structure"))
        if self.keys:
            k0 = self.keys[0]
            for i, k in enumerate(self.keys[1:], 1):
                if k.num_seqs != k0.num_seqs or not (k.seq_ptr is k0.seq_ptr or torch.equal(k.seq_ptr, k0.seq_ptr)):
                    found.append(Violation("snapshot.structure", f"layer {i} has another batch than layer 0"))
            if self.token_ids and len(self.token_ids) != k0.num_seqs:
                found.append(
                    Violation("snapshot.token_ids", f"{len(self.token_ids)} token lists for {k0.num_seqs} sequences")
                )
            elif self.token_ids and k0.seq_lens is not None:
                for s, (ids, n) in enumerate(zip(self.token_ids, k0.seq_lens.tolist())):
                    if len(ids) < n:
                        found.append(
                            Violation(
                                "snapshot.token_ids", f"sequence {s} has {n} tokens of KV but {len(ids)} token ids"
                            )
                        )
                        break
        if self.kv_scales is not None and len(self.kv_scales) != self.num_layers:
            found.append(
                Violation("snapshot.kv_scales", f"{len(self.kv_scales)} scale pairs for {self.num_layers} layers")
            )
        for i, pair in enumerate(self.kv_scales or ()):
            # A NaN, infinite, zero or negative scale turns every dequantized value into garbage.
            if len(pair) != 2 or not all(isinstance(x, float | int) and math.isfinite(x) and x > 0 for x in pair):
                found.append(Violation("snapshot.kv_scales", f"layer {i}: scales {pair} must be finite and positive"))
                break
        for s, ids in enumerate(self.token_ids):
            # map/min/max run in C: a 131k-token batch costs ~6 ms, not a per-token Python loop.
            if ids and not (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < 1 << 63):
                found.append(Violation("snapshot.token_ids", f"sequence {s}: token ids must be integers >= 0"))
                break
        if self.request_ids is not None and (
            len(self.request_ids) != self.num_seqs or not all(isinstance(r, str) for r in self.request_ids)
        ):
            found.append(
                Violation("snapshot.request_ids", f"{len(self.request_ids)} request ids for {self.num_seqs} sequences")
            )
        if self.fingerprint is not None and self.keys and self.fingerprint.num_layers != self.num_layers:
            found.append(
                Violation(
                    "snapshot.fingerprint",
                    f"fingerprint says {self.fingerprint.num_layers} layers, snapshot has {self.num_layers}",
                )
            )
        return Checked(tuple(found), permissive)

    def __repr__(self) -> str:
        if not self.keys:
            return f"KVSnapshot(num_layers=0, num_seqs={len(self.token_ids)})"
        k = self.keys[0]
        return (
            f"KVSnapshot(num_layers={self.num_layers}, num_seqs={k.num_seqs}, page_size={k.page_size}, "
            f"num_pages={k.num_pages}, heads={k.num_heads}, head_dim={k.head_dim}, dtype={k.dtype})"
        )
