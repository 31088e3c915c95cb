"""``KVSnapshot``: one batch of sequences across a whole model."""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import HurrayArgumentError, HurrayFormatError, Violation, integer_arg
from ..wire.jsonvalues import Fields, loads_bounded
from ..wire.rules import Checked
from .paged import BlockPagedTensor, SharingStats, plan_compaction
from .states import RecurrentStates, part_fraction

__all__ = [
    "ModelFingerprint",
    "SnapshotSource",
    "LatentSplit",
    "SlidingWindows",
    "HeadRange",
    "KVSnapshot",
    "KV_ROLES",
    "FUSED_ROLES",
    "TARGET_LAYERS",
    "DIGEST_KEY",
    "MAC_KEY",
]

#: ``extra`` key of a snapshot whose trailing layers are a speculative drafter's (EAGLE's head, DeepSeek's
#: MTP layers), exported after the model's own: how many leading layers are the model's. An engine with
#: such a drafter keeps the drafter's KV in the same caches, so its snapshots hold both;
#: :meth:`KVSnapshot.without_drafter` keeps the model's.
TARGET_LAYERS = "hurray_vllm.target_layers"

#: ``extra`` keys of a chunk's checksum (:mod:`hurray_vllm.containers.digest`) and of its MAC
#: (:mod:`hurray_vllm.chunks.signing`). Both vouch for the layers they were computed over: a snapshot made
#: of other layers drops them (:meth:`KVSnapshot.with_layers`), since ``load`` refuses a file whose data
#: does not match the digest it carries.
DIGEST_KEY = "hurray_vllm.chunk_digest"
MAC_KEY = "hurray_vllm.chunk_mac"


#: Bounds on what a fingerprint may claim (a sanity bound on hostile metadata, far above any model).
_MAX_LAYERS = 1 << 16
_MAX_HEADS = 1 << 16
_MAX_HEAD_DIM = 1 << 16
#: The most sequences a header may announce (``num_seqs``, ``request_ids``).
_MAX_SEQS = 1 << 24


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
        return dict(vars(self))  # flat fields of plain values: what asdict returns, without its deep copies

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
        return dict(vars(self))  # flat fields of plain values: what asdict returns, without its deep copies

    @classmethod
    def from_json(cls, d: Any) -> SnapshotSource:
        """The source :meth:`to_json` wrote; a bad field raises :class:`HurrayFormatError` naming it."""
        f = Fields(d, "snapshot.source")
        return cls(
            engine=f.string("engine", max_len=256),
            layout=f.string("layout", max_len=256),
            page_size=f.integer("page_size", lo=1, hi=(1 << 32) - 1),
        )


@dataclass(frozen=True)
class LatentSplit:
    """How an MLA layer's fused latent divides along ``head_dim``: ``[kv_lora_rank | rope_dim]``.

    DeepSeek-style attention (MLA) caches one vector per token and layer:
    the normalized compressed KV (``kv_lora_rank`` values, the output of
    ``kv_a_layernorm``), then the shared key's rotary part (``rope_dim``
    values, after RoPE). Both vLLM and transformers keep it in this order.

    Attributes:
        kv_lora_rank: width of the compressed KV (512 for DeepSeek-V2/V3).
        rope_dim: width of the rotated key part (``qk_rope_head_dim``, 64).
        family: the model family (``config.model_type``: ``"deepseek_v2"``,
            ``"deepseek_v3"``...), for importers that must know how the
            latent is expanded.

    Example:
        >>> LatentSplit(512, 64, "deepseek_v2").head_dim
        576
    """

    kv_lora_rank: int
    rope_dim: int
    family: str = ""

    @property
    def head_dim(self) -> int:
        """Width of the fused latent: ``kv_lora_rank + rope_dim``."""
        return self.kv_lora_rank + self.rope_dim

    def to_json(self) -> dict[str, Any]:
        """The split as a JSON-ready dict of its fields."""
        return dict(vars(self))  # flat fields of plain values: what asdict returns, without its deep copies

    @classmethod
    def from_json(cls, d: Any) -> LatentSplit:
        """The split :meth:`to_json` wrote; a bad field raises :class:`HurrayFormatError` naming it."""
        f = Fields(d, "snapshot.latent")
        return cls(
            kv_lora_rank=f.integer("kv_lora_rank", lo=1, hi=_MAX_HEAD_DIM),
            rope_dim=f.integer("rope_dim", hi=_MAX_HEAD_DIM),
            family=f.string("family", max_len=256, default=""),
        )


@dataclass(frozen=True)
class SlidingWindows:
    """Which tokens each layer holds, in a model mixing sliding-window and full attention (Gemma 3, gpt-oss).

    An engine frees a sliding-window layer's pages once they fall out of the
    window (vLLM nulls them: block id 0). Such a layer's block table still
    has an entry for every page of every sequence, so all layers share one
    logical structure, but the entries of pages it no longer holds point to
    one zeroed page: only the pages inside the window leave the engine.

    Attributes:
        sizes: per layer, its window in tokens (a token attends itself and the
            ``size - 1`` before it); ``None`` for full attention.
        kv_start: per layer, per sequence, the first token position whose KV
            the layer holds (0 for full-attention layers, at most the
            sequence's length). The positions before it read as zeros. A
            snapshot taken from an engine holds each window of the next token
            (``kv_start <= seq_len - size + 1``); a chunk, a segment of a
            prefix, may hold less (:func:`~hurray_vllm.chunks.chunks_of`).

    Example:
        >>> w = SlidingWindows(sizes=(64, None), kv_start=((128,), (0,)))
        >>> w.held(0, 0, 201), w.held(1, 0, 201)
        (range(128, 201), range(0, 201))
    """

    sizes: tuple[int | None, ...]
    kv_start: tuple[tuple[int, ...], ...]

    def held(self, layer: int, seq: int, seq_len: int) -> range:
        """The token positions whose KV ``layer`` holds for sequence ``seq`` (of ``seq_len`` tokens)."""
        return range(self.kv_start[layer][seq], seq_len)

    def to_json(self) -> dict[str, Any]:
        """The windows as a JSON-ready dict."""
        return {"sizes": list(self.sizes), "kv_start": [list(x) for x in self.kv_start]}

    @classmethod
    def from_json(cls, d: Any) -> SlidingWindows:
        """The windows :meth:`to_json` wrote; a bad member raises :class:`HurrayFormatError` naming it."""
        f = Fields(d, "snapshot.windows")
        sizes = f.obj.get("sizes")
        starts = f.obj.get("kv_start")
        if not isinstance(sizes, list) or len(sizes) > _MAX_LAYERS:
            raise HurrayFormatError("snapshot.windows.sizes", "expected a list of window sizes (or null) per layer")
        if not all(x is None or (type(x) is int and 1 <= x < 1 << 40) for x in sizes):
            raise HurrayFormatError("snapshot.windows.sizes", "window sizes must be positive integers or null")
        if not isinstance(starts, list) or len(starts) != len(sizes):
            raise HurrayFormatError("snapshot.windows.kv_start", "expected one list of start positions per layer")
        rows = []
        for row in starts:
            if not isinstance(row, list) or not all(type(x) is int and 0 <= x < 1 << 62 for x in row):
                raise HurrayFormatError("snapshot.windows.kv_start", "start positions must be integers >= 0")
            rows.append(tuple(row))
        return cls(tuple(sizes), tuple(rows))


@dataclass(frozen=True)
class HeadRange:
    """The KV heads a snapshot holds when it is a slice of the model's (one tensor-parallel rank's).

    Heads ``start .. stop - 1`` of the model's ``total`` (``fingerprint.num_kv_heads``),
    in order; each layer's K and V hold ``stop - start`` heads. A snapshot
    of every head has none (``KVSnapshot.heads is None``).

    Example:
        >>> HeadRange(2, 4, 8).count
        2
    """

    start: int
    stop: int
    total: int

    @property
    def count(self) -> int:
        """How many heads the slice holds."""
        return self.stop - self.start

    def to_json(self) -> dict[str, Any]:
        """The range as a JSON-ready dict."""
        return dict(vars(self))

    @classmethod
    def from_json(cls, d: Any) -> HeadRange:
        """The range :meth:`to_json` wrote; a bad member raises :class:`HurrayFormatError` naming it."""
        f = Fields(d, "snapshot.heads")
        total = f.integer("total", lo=1, hi=_MAX_HEADS)
        start = f.integer("start", hi=total - 1)
        stop = f.integer("stop", lo=start + 1, hi=total)
        return cls(start, stop, total)

    def violations(self) -> list[Violation]:
        """What a reader refuses in this range: integers ``0 <= start < stop <= total``, ``1 <= total <= 65536``.

        The constructor takes any values (:attr:`KVSnapshot.head_range` of a
        snapshot without layers is ``HeadRange(0, 0, 1)``); a snapshot's
        :meth:`~KVSnapshot.validate` reports these, with the fields
        :meth:`from_json` names, so that what ``validate`` passes loads.

        Example:
            >>> [str(v) for v in HeadRange(3, 5, 4).violations()]
            ['snapshot.heads.stop: 5 is outside [4, 4]']
        """
        try:
            HeadRange.from_json(self.to_json())  # the reader's own rules: validate and load cannot drift apart
        except HurrayFormatError as exc:
            return list(exc.violations)
        return []


#: The roles of a key/value layer and of a fused (MLA latent) layer, in the order layers hold them.
KV_ROLES = ("key", "value")
FUSED_ROLES = ("fused",)


@dataclass(frozen=True, eq=False)
class KVSnapshot:
    """The KV cache of a batch of sequences, for every layer.

    A snapshot holds either keys and values (``keys[i]`` and ``values[i]``
    are layer ``i``'s block-paged tensors) or, for MLA models, one fused
    latent per layer (``fused[i]``, kv_role ``"fused"``, ``num_heads == 1``,
    ``head_dim == latent.head_dim``). All layers and roles share one block
    structure (same block table, seq_ptr and seq_lens), which is what lets
    an importer plan repaging once. ``snap[i, role]`` reads any of them.

    Attributes:
        keys, values: one :class:`BlockPagedTensor` per layer (empty for MLA).
        token_ids: per sequence, the token ids whose KV the snapshot holds,
            optionally followed by tokens sampled but not yet computed (a
            continuation needs the last sampled token; ``seq_lens`` says
            how many have KV).
        fingerprint: the model the KV belongs to, when known.
        kv_scales: per layer ``(k_scale, v_scale)`` of an fp8 cache
            (``value = stored * scale``); ``None`` for unscaled caches.
        source: the producing engine, layout and page size.
        request_ids: the engine's ids of the sequences, when known.
        extra: free-form JSON metadata carried along.
        fused: one MLA latent :class:`BlockPagedTensor` per layer (empty for
            key/value models).
        latent: how the fused latent divides (required with ``fused``).
        windows: for sliding-window hybrids, which tokens each layer holds
            (``None``: every layer holds every token).
        states: for linear-attention hybrids (Qwen3-Next, Mamba2 hybrids),
            the state of every linear-attention layer per sequence and the
            token it was taken at; the layers above are then the model's
            attention layers only (:meth:`RecurrentStates.attention_layers`).
        heads: for a slice of the model's KV heads (a tensor-parallel rank's),
            which ones (``None``: every head).
    """

    keys: tuple[BlockPagedTensor, ...]
    values: tuple[BlockPagedTensor, ...]
    token_ids: tuple[tuple[int, ...], ...] = ()
    fingerprint: ModelFingerprint | None = None
    kv_scales: tuple[tuple[float, float], ...] | None = None
    source: SnapshotSource | None = None
    request_ids: tuple[str, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    fused: tuple[BlockPagedTensor, ...] = ()
    latent: LatentSplit | None = None
    windows: SlidingWindows | None = None
    states: RecurrentStates | None = None
    heads: HeadRange | None = None

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values):
            raise HurrayFormatError(
                "snapshot.layers", f"{len(self.keys)} key layers but {len(self.values)} value layers"
            )
        if self.fused and self.keys:
            raise HurrayFormatError(
                "snapshot.layers", "a snapshot holds either key/value layers or fused (MLA latent) layers, not both"
            )
        if self.fused and self.latent is None:
            raise HurrayFormatError("snapshot.latent", "fused (MLA latent) layers need a LatentSplit")
        if self.keys and self.latent is not None:
            raise HurrayFormatError("snapshot.latent", "key/value layers have no latent split (it is for MLA latents)")

    @classmethod
    def from_layers(cls, layers: Sequence[Sequence[BlockPagedTensor]], **fields: Any) -> KVSnapshot:
        """A snapshot of per-layer members: ``(key, value)`` pairs or ``(fused,)`` singles, in layer order.

        ``fields`` are the other attributes (``token_ids``, ``latent``...).
        What :meth:`layer` returns, fed back: ``KVSnapshot.from_layers(s.layer_members(), ...)``.

        Example:
            >>> KVSnapshot.from_layers([]).num_layers
            0
        """
        if layers and all(len(m) == 1 for m in layers):
            return cls(keys=(), values=(), fused=tuple(m[0] for m in layers), **fields)
        if any(len(m) != 2 for m in layers):
            raise HurrayFormatError(
                "snapshot.layers", f"layers hold {sorted({len(m) for m in layers})} tensors each; need 2 (K, V) or 1"
            )
        return cls(keys=tuple(m[0] for m in layers), values=tuple(m[1] for m in layers), **fields)

    # ── access ─────────────────────────────────────────────────────────────

    def __getitem__(self, item: tuple[int, str]) -> BlockPagedTensor:
        layer, role = item
        if role not in self.roles:
            kind = "fused MLA latents" if self.fused else "keys and values"
            raise KeyError(f"this snapshot holds {kind}: role must be one of {self.roles}, not {role!r}")
        layers = self.fused if role == "fused" else self.keys if role == "key" else self.values
        return layers[layer]

    @property
    def is_latent(self) -> bool:
        """Whether the layers hold fused MLA latents instead of keys and values."""
        return bool(self.fused)

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles each layer holds: ``("key", "value")``, or ``("fused",)`` for MLA latents."""
        return FUSED_ROLES if self.fused else KV_ROLES

    @property
    def _lead(self) -> tuple[BlockPagedTensor, ...]:
        # Layer order, first role of each layer: what the shared block structure is read from.
        return self.fused or self.keys

    @property
    def head_range(self) -> HeadRange:
        """The model's KV heads the layers hold: :attr:`heads`, or all of the pools' heads."""
        if self.heads is not None:
            return self.heads
        n = self._lead[0].num_heads if self._lead else 0
        return HeadRange(0, n, max(n, 1))

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self._lead)

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch."""
        lead = self._lead
        return lead[0].num_seqs if lead else len(self.token_ids)

    @property
    def seq_lens(self) -> list[int]:
        """Tokens with KV, per sequence."""
        lead = self._lead
        if not lead:
            return [len(t) for t in self.token_ids]
        lens = lead[0].seq_lens
        if lens is None:
            raise HurrayFormatError("seq_lens", "this snapshot does not carry sequence lengths")
        return [int(x) for x in lens]

    @property
    def page_size(self) -> int:
        """Tokens per page (0 for a snapshot without layers)."""
        lead = self._lead
        return lead[0].page_size if lead else 0

    @property
    def nbytes(self) -> int:
        """Bytes of all layers' buffers on the wire, every role, and of the recurrent states."""
        return sum(t.nbytes for t in self.tensors()) + (self.states.nbytes if self.states is not None else 0)

    def layer(self, i: int) -> tuple[BlockPagedTensor, ...]:
        """Layer ``i``'s tensors in :attr:`roles` order: ``(key, value)`` or ``(fused,)``."""
        return (self.fused[i],) if self.fused else (self.keys[i], self.values[i])

    def layer_members(self) -> list[tuple[BlockPagedTensor, ...]]:
        """:meth:`layer` of every layer, in layer order (what containers write and :meth:`from_layers` takes)."""
        return [(t,) for t in self.fused] if self.fused else list(zip(self.keys, self.values))

    def tensors(self) -> list[BlockPagedTensor]:
        """Every block-paged tensor, layer by layer, in :attr:`roles` order within a layer."""
        return [t for members in self.layer_members() for t in members]

    def layers(self) -> list[tuple[BlockPagedTensor, BlockPagedTensor]]:
        """``(keys, values)`` of every layer, in layer order.

        Raises:
            HurrayFormatError: (field ``kv_role``) the snapshot holds fused MLA
                latents; read them with :meth:`layer` or ``snap[i, "fused"]``.
        """
        self.require_kv("this operation")
        return list(zip(self.keys, self.values))

    def require_kv(self, what: str) -> None:
        """Refuse an MLA snapshot where ``what`` needs separate keys and values.

        Raises:
            HurrayFormatError: (field ``kv_role``) naming ``what`` and the way out.
        """
        if self.fused:
            raise HurrayFormatError(
                "kv_role",
                f"{what} needs separate keys and values, but this snapshot holds fused MLA latents "
                f"({self.latent.family if self.latent else 'MLA'}: kv_lora_rank "
                f"{self.latent.kv_lora_rank if self.latent else '?'} + rope "
                f"{self.latent.rope_dim if self.latent else '?'}); import it with an MLA-aware "
                "importer (vLLM, transformers) or expand it with adapters.transformers.expand_latent",
            )

    def sharing(self) -> SharingStats:
        """The block structure's page sharing (:meth:`BlockPagedTensor.sharing`), shared by every layer and role."""
        lead = self._lead
        return lead[0].sharing() if lead else SharingStats(0, 0, 0, 0)

    def with_layers(self, layers: Sequence[Sequence[BlockPagedTensor]], **changes: Any) -> KVSnapshot:
        """This snapshot with other per-layer members (as :meth:`from_layers` takes them) and ``changes``.

        The members say the kind: ``(fused,)`` singles, or ``(key, value)``
        pairs (also for a snapshot without layers yet, a header's shell).

        A chunk's digest and MAC (``extra[DIGEST_KEY]``, ``extra[MAC_KEY]``)
        are dropped: they are of the layers they were computed over, and a
        repaged, compacted or head-sliced chunk saved with them would be
        refused by ``load`` as damaged. :func:`~hurray_vllm.chunks.keys.chunks_of`
        computes a new digest for each chunk it cuts.
        """
        extra = changes.get("extra", self.extra)
        if DIGEST_KEY in extra or MAC_KEY in extra:
            changes["extra"] = {k: v for k, v in extra.items() if k not in (DIGEST_KEY, MAC_KEY)}
        if self.fused or (layers and len(layers[0]) == 1):
            return replace(self, keys=(), values=(), fused=tuple(m[0] for m in layers), **changes)
        return replace(self, keys=tuple(m[0] for m in layers), values=tuple(m[1] for m in layers), **changes)

    def without_drafter(self) -> KVSnapshot:
        """The model's own layers, without a speculative drafter's (named by ``extra[TARGET_LAYERS]``).

        A snapshot of an engine running EAGLE or MTP holds the drafter's KV
        layers after the model's; a model without the drafter (transformers,
        an engine without speculation) takes the leading ones. The result's
        fingerprint counts those layers and has no weights digest (the
        engine's covered the drafter's weights too); per-layer scales and
        windows are cut alike. A snapshot that names no drafter is returned
        as it is.

        Raises:
            HurrayFormatError: ``extra[TARGET_LAYERS]`` is not a layer count
                from 1 to the snapshot's number of layers.

        Example:
            >>> one = torch.tensor([0])
            >>> t = BlockPagedTensor(torch.zeros(1, 2, 1, 4), one, torch.tensor([0, 1]), torch.tensor([2]))
            >>> snap = KVSnapshot.from_layers([(t, replace(t, kv_role="value"))] * 3, extra={TARGET_LAYERS: 2})
            >>> snap.without_drafter().num_layers
            2
        """
        if TARGET_LAYERS not in self.extra:
            return self
        n = self.extra[TARGET_LAYERS]
        if type(n) is not int or not 1 <= n <= self.num_layers:
            raise HurrayFormatError(
                f"extra.{TARGET_LAYERS}",
                f"expected how many of the snapshot's {self.num_layers} layers are the model's, got {n!r}",
            )
        fp = self.fingerprint
        windows = self.windows
        states = self.states
        if states is not None and states.attention:  # the recorded indices of the layers kept
            states = replace(states, attention=states.attention[:n])
        return self.with_layers(
            self.layer_members()[:n],
            fingerprint=replace(fp, num_layers=n, weights_digest=None) if fp is not None else None,
            kv_scales=self.kv_scales[:n] if self.kv_scales is not None else None,
            windows=replace(windows, sizes=windows.sizes[:n], kv_start=windows.kv_start[:n]) if windows else None,
            states=states,
            extra={k: v for k, v in self.extra.items() if k != TARGET_LAYERS},
        )

    # ── batch operations ───────────────────────────────────────────────────

    def select(self, seqs: Sequence[int]) -> KVSnapshot:
        """A snapshot of the sequences ``seqs`` only, compacted.

        Raises:
            HurrayArgumentError: (field ``seqs``) a sequence outside ``0 .. num_seqs - 1``, or one that is not
                an integer (a bool or a float).
        """
        n = self.num_seqs
        # Read once: a generator would be spent by the range check, and every part below then selects nothing.
        seqs = [integer_arg(s, "seqs") for s in seqs]
        bad = next((s for s in seqs if not 0 <= s < n), None)
        if bad is not None:
            raise HurrayArgumentError("seqs", f"sequence {bad} is outside the batch's {n} (0..{n - 1})")
        layers = [tuple(t.select(seqs) for t in members) for members in self.layer_members()]
        ids = tuple(self.token_ids[s] for s in seqs) if self.token_ids else ()
        rids = tuple(self.request_ids[s] for s in seqs) if self.request_ids else None
        win = self.windows
        if win is not None:
            win = SlidingWindows(win.sizes, tuple(tuple(row[s] for s in seqs) for row in win.kv_start))
        states = self.states.select(seqs) if self.states is not None else None
        return self.with_layers(layers, token_ids=ids, request_ids=rids, windows=win, states=states).compact()

    def compact(self) -> KVSnapshot:
        """Drop pages no sequence references; one plan per block structure (one for most snapshots).

        A sliding-window hybrid's layers may hold different pages (``windows``):
        each distinct block table gets its own plan, computed once.
        """
        if not self._lead:
            return self
        plans: dict[int, Any] = {}

        def plan_for(t: BlockPagedTensor) -> Any:
            key = id(t.block_table)
            if key not in plans:
                plans[key] = plan_compaction(t.block_table, t.num_pages)
            return plans[key]

        return self.with_layers([tuple(t.compact(plan_for(t)) for t in members) for members in self.layer_members()])

    # ── checks ─────────────────────────────────────────────────────────────

    def validate(self, *, permissive: bool = False, tensors: bool = True) -> Checked:
        """Every rule broken by any layer, plus the snapshot's own consistency.

        What a container's reader refuses, this reports, so that what
        ``validate`` (and so :func:`~hurray_vllm.save`) passes loads: the
        header's members are put through the reader's own decoders too
        (``snapshot.meta``, ``snapshot.fingerprint.*``, ``snapshot.source.*``...).

        ``tensors=False`` is for a reader, which has checked what it read: it
        skips the per-tensor rules (the tensors were built with
        :meth:`BlockPagedTensor.from_wire`) and the header's (it was decoded
        with ``decode_header``), a second decoding that would cost a chunk's
        load some 10%.

        Two of the snapshot's own rules are never waived, as no container
        carries what breaks them: a layer whose slots hold other roles
        (``kv_role``: the ``.hrry`` and stream readers refuse such a layer
        group in every mode, a ``.safetensors`` file would load its pools
        swapped) and a layer whose key and value differ in ``seq_lens``
        (``snapshot.structure``: a layer group stores one ``seq_lens``
        member, so the value would read back with the key's lengths). With
        ``permissive=True`` they are returned in ``Checked.unreadable``,
        which blocks in every mode: what ``save`` wrote would not read back.
        """
        found: list[Violation] = []
        # What permissive mode must not waive either (see above): blocking in every mode.
        never_waived: list[Violation] = []
        roles = self.roles
        for i, members in enumerate(self.layer_members()):
            for t in members if tensors else ():
                found.extend(
                    Violation(x.invariant, f"layer {i} {t.kv_role}: {x.message}")
                    for x in t.validate(permissive=permissive).violations
                )
            if tuple(t.kv_role for t in members) != roles:
                never_waived.append(
                    Violation(
                        "kv_role",
                        f"layer {i} holds roles {'/'.join(t.kv_role for t in members)}, not {'/'.join(roles)}",
                    )
                )
                found.append(never_waived[-1])
            # A reader places a layer by its layer_index (None: by position): layer i must say i, or layers
            # would load swapped, or twice and be refused (docs/format.md 2.6).
            if any(t.layer_index not in (None, i) for t in members) or len({t.layer_index for t in members}) > 1:
                found.append(
                    Violation(
                        "layer_index",
                        f"layer {i}: its tensors say layers {[t.layer_index for t in members]}, not {i} (or None)",
                    )
                )
            first = members[0]
            if not all(
                (t.block_table is first.block_table or torch.equal(t.block_table, first.block_table))
                and (t.seq_ptr is first.seq_ptr or torch.equal(t.seq_ptr, first.seq_ptr))
                and t.page_pool.shape == first.page_pool.shape
                for t in members[1:]
            ):
                found.append(Violation("snapshot.structure", f"layer {i} key and value differ in block structure"))
            for t in members[1:]:
                # A layer group stores one seq_lens member (the first role's): another role's would be lost.
                differ = _seq_lens_differ(t.seq_lens, first.seq_lens)
                if differ:
                    never_waived.append(
                        Violation(
                            "snapshot.structure",
                            f"layer {i} {t.kv_role} and {first.kv_role} differ in seq_lens ({differ})",
                        )
                    )
                    found.append(never_waived[-1])
        if self.fused and self.latent is not None:
            lat = self.latent
            for i, t in enumerate(self.fused):
                if t.page_pool.dim() == 4 and (t.num_heads != 1 or t.head_dim != lat.head_dim):
                    found.append(
                        Violation(
                            "snapshot.latent",
                            f"layer {i}: a fused latent of {t.num_heads} heads x {t.head_dim}, but the split says "
                            f"1 x {lat.head_dim} (kv_lora_rank {lat.kv_lora_rank} + rope {lat.rope_dim})",
                        )
                    )
                    break
        lead = self._lead
        # A pool that is not [pages, page_size, heads, head_dim] was reported above (rule "rank"): the checks
        # that read heads or head_dim skip the snapshot then, rather than fail on it.
        shaped = all(t.page_pool.dim() == 4 for t in self.tensors())
        if not shaped and not tensors:
            found.append(Violation("rank", "a layer's page_pool is not [num_pages, page_size, num_heads, head_dim]"))
        if lead and shaped:
            # One head geometry and dtype for the whole model (page sizes may differ per layer).
            k0 = lead[0]
            for i, members in enumerate(self.layer_members()):
                odd = next(
                    (t for t in members if (t.num_heads, t.head_dim, t.dtype) != (k0.num_heads, k0.head_dim, k0.dtype)),
                    None,
                )
                if odd is not None:
                    found.append(
                        Violation(
                            "snapshot.structure",
                            f"layer {i} {odd.kv_role} holds {odd.num_heads} heads x {odd.head_dim} of {odd.dtype}, "
                            f"layer 0 {k0.kv_role} {k0.num_heads} x {k0.head_dim} of {k0.dtype}",
                        )
                    )
                    break
            fp = self.fingerprint
            if fp is not None:
                # A fused MLA latent is one "head" of latent.head_dim values, as its fingerprint says;
                # a slice of the heads holds fewer than the model's (checked against heads.total below).
                if fp.head_dim != k0.head_dim or (self.heads is None and fp.num_kv_heads != k0.num_heads):
                    found.append(
                        Violation(
                            "snapshot.fingerprint",
                            f"fingerprint says {fp.num_kv_heads} KV heads x {fp.head_dim}, the layers hold "
                            f"{k0.num_heads} x {k0.head_dim}",
                        )
                    )
        if lead:
            k0 = lead[0]
            for i, k in enumerate(lead[1:], 1):
                if k.num_seqs != k0.num_seqs or not (k.seq_ptr is k0.seq_ptr or torch.equal(k.seq_ptr, k0.seq_ptr)):
                    found.append(Violation("snapshot.structure", f"layer {i} has another batch than layer 0"))
                    continue
                # Every layer holds every token of a sequence (a sliding-window layer too: its dropped
                # pages point to a zeroed page, docs/format.md 2.3b), so all share layer 0's lengths.
                differ = _seq_lens_differ(k.seq_lens, k0.seq_lens)
                if differ:
                    found.append(
                        Violation("snapshot.structure", f"layer {i} and layer 0 differ in seq_lens ({differ})")
                    )
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
        found.extend(self._window_violations())
        heads_bad = self.heads.violations() if self.heads is not None else []
        found.extend(heads_bad)
        if self.heads is not None and lead and shaped and any(t.num_heads != self.heads.count for t in self.tensors()):
            found.append(
                Violation(
                    "snapshot.heads",
                    f"the layers hold {lead[0].num_heads} heads, the slice says {self.heads.count} "
                    f"({self.heads.start}..{self.heads.stop} of {self.heads.total})",
                )
            )
        fp = self.fingerprint
        if self.heads is not None and fp is not None and self.heads.total != fp.num_kv_heads:
            found.append(Violation("snapshot.heads", "the slice's total heads differ from the fingerprint's"))
        if self.states is not None:
            found.extend(self.states.violations())
        if self.states is not None and not heads_bad and not self.states.part_violations():  # valid parts, or whole
            # A slice of the heads carries the same part of the states (one rank's share of both).
            h = self.heads
            if self.states.fraction != part_fraction((h.start, h.stop, h.total) if h is not None else None):
                found.append(
                    Violation(
                        "snapshot.states.part",
                        f"the states are part {self.states.part or 'whole'}, the KV heads "
                        f"{(h.start, h.stop, h.total) if h is not None else 'whole'}",
                    )
                )
        if self.states is not None:
            if self._lead and self.states.num_seqs != self.num_seqs:
                found.append(
                    Violation(
                        "snapshot.states.positions",
                        f"states for {self.states.num_seqs} sequences, the snapshot has {self.num_seqs}",
                    )
                )
            attention = self.states.attention
            if attention and self._lead and len(attention) != self.num_layers:
                # One model index per layer: a short list leaves a layer's KV out of an import.
                found.append(
                    Violation(
                        "snapshot.states.attention_layers",
                        f"{len(attention)} attention layer indices {list(attention)[:8]} for {self.num_layers} layers",
                    )
                )
        if self.fused and self.kv_scales is not None and any(len(p) == 2 and p[0] != p[1] for p in self.kv_scales):
            # One latent, one scale: the pair's second entry repeats it (docs/format.md).
            found.append(Violation("snapshot.kv_scales", "a fused layer's two scale entries must be equal"))
        for s, ids in enumerate(self.token_ids):
            # map/min/max run in C: a 131k-token batch costs ~6 ms, not a per-token Python loop.
            if ids and not (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < 1 << 63):
                found.append(Violation("snapshot.token_ids", f"sequence {s}: token ids must be integers >= 0"))
                break
        if self.request_ids is not None and len(self.request_ids) != self.num_seqs:
            # Their types and lengths are the header's (_header_violations).
            found.append(
                Violation("snapshot.request_ids", f"{len(self.request_ids)} request ids for {self.num_seqs} sequences")
            )
        # A member's own rules above may have named a field already (a states part): once is enough.
        named = {v.invariant for v in found}
        found.extend(v for v in (self._header_violations() if tensors else ()) if v.invariant not in named)
        if self.fingerprint is not None and lead and self.fingerprint.num_layers != self.num_layers:
            found.append(
                Violation(
                    "snapshot.fingerprint",
                    f"fingerprint says {self.fingerprint.num_layers} layers, snapshot has {self.num_layers}",
                )
            )
        if permissive and never_waived:
            # Not in _STRUCTURAL by name: the same invariants name waivable rules elsewhere (an unknown
            # kv_role tag, layers of different batches). Moved, not copied: each is listed once.
            blocking = {id(v) for v in never_waived}
            return Checked(tuple(v for v in found if id(v) not in blocking), permissive, tuple(never_waived))
        return Checked(tuple(found), permissive)

    def _header_violations(self) -> list[Violation]:
        """What a reader refuses in the header JSON a container writes for this snapshot.

        The members are encoded as the writers encode them and decoded by the
        reader's own decoders (:func:`~hurray_vllm.wire.jsonvalues.loads_bounded`,
        :class:`~hurray_vllm.wire.jsonvalues.Fields`, each member's
        ``from_json``), as ``containers.schema.decode_header`` composes them,
        so that what ``validate`` passes loads: a zero page size, a 300-character
        architecture, ``NaN`` or nesting 40 deep in ``extra``. The violations
        carry the reader's field names (the first bad member's; ``windows``
        and ``heads`` have their own rules above, which name theirs once).
        The header is small (no token ids, no tensors): this costs tens of
        microseconds whatever the batch holds.
        """
        meta: dict[str, Any] = {
            "num_layers": self.num_layers,
            "num_seqs": self.num_seqs,
            "request_ids": list(self.request_ids) if self.request_ids is not None else None,
            "extra": self.extra,
        }
        parts = (
            ("fingerprint", self.fingerprint),
            ("source", self.source),
            ("latent", self.latent),
            ("states", self.states),
            ("windows", self.windows),
            ("heads", self.heads),
        )
        try:
            # The writers' encoding: a value json cannot write (an object, a circular or 1000-deep
            # extra) would otherwise fail in save() as a bare TypeError/ValueError/RecursionError.
            meta.update({name: part.to_json() for name, part in parts if part is not None})
            text = json.dumps(meta, sort_keys=True)
            decode_header_members(Fields(loads_bounded(text, "snapshot.meta"), "snapshot.meta"))
        except HurrayFormatError as exc:
            return list(exc.violations)
        except (TypeError, ValueError, RecursionError) as exc:
            return [Violation("snapshot.meta", f"the header cannot be written as JSON: {exc}")]
        return []

    def _window_violations(self) -> list[Violation]:
        win = self.windows
        if win is None:
            return []
        try:  # what the reader refuses, validate reports: save() never writes a file load() rejects
            SlidingWindows.from_json(win.to_json())
        except HurrayFormatError as exc:
            return list(exc.violations)
        if len(win.sizes) != self.num_layers or len(win.kv_start) != self.num_layers:
            return [
                Violation(
                    "snapshot.windows", f"windows for {len(win.sizes)} layers, the snapshot has {self.num_layers}"
                )
            ]
        lead = self._lead
        lens = lead[0].seq_lens.tolist() if lead and lead[0].seq_lens is not None else None
        for i, (size, row) in enumerate(zip(win.sizes, win.kv_start)):
            if len(row) != self.num_seqs:
                return [
                    Violation(
                        "snapshot.windows", f"layer {i}: {len(row)} start positions for {self.num_seqs} sequences"
                    )
                ]
            for s, start in enumerate(row):
                n = lens[s] if lens is not None else None
                if size is None and start:
                    return [Violation("snapshot.windows", f"layer {i} is full attention but starts at token {start}")]
                if n is not None and start > n:
                    return [Violation("snapshot.windows", f"layer {i} sequence {s}: starts at token {start} of {n}")]
        return []

    def __repr__(self) -> str:
        if not self._lead:
            return f"KVSnapshot(num_layers=0, num_seqs={len(self.token_ids)})"
        k = self._lead[0]
        latent = f", latent={self.latent.kv_lora_rank}+{self.latent.rope_dim}" if self.latent and self.fused else ""
        return (
            f"KVSnapshot(num_layers={self.num_layers}, num_seqs={k.num_seqs}, page_size={k.page_size}, "
            f"num_pages={k.num_pages}, heads={k.num_heads}, head_dim={k.head_dim}, dtype={k.dtype}{latent})"
        )


def decode_header_members(f: Fields) -> dict[str, Any]:
    """The snapshot header's members decoded from its JSON object ``f``: the one decoder of them.

    ``containers.schema.decode_header`` (every reader) builds its header from
    these, after checking the format's name and version; :meth:`KVSnapshot.validate`
    puts a snapshot's own header through them, so that what it passes loads.
    Every member is type-checked and bounded.

    Raises:
        HurrayFormatError: the first malformed member (``.field`` names it).
    """
    fp, src, lat = f.optional_obj("fingerprint"), f.optional_obj("source"), f.optional_obj("latent")
    win, states, heads = f.optional_obj("windows"), f.optional_obj("states"), f.optional_obj("heads")
    return {
        "heads": HeadRange.from_json(heads.obj) if heads is not None else None,
        "states": RecurrentStates.from_json(states.obj) if states is not None else None,
        "windows": SlidingWindows.from_json(win.obj) if win is not None else None,
        "latent": LatentSplit.from_json(lat.obj) if lat is not None else None,
        "num_layers": f.integer("num_layers", hi=_MAX_LAYERS),
        "num_seqs": f.integer("num_seqs", hi=_MAX_SEQS, default=None),
        "fingerprint": ModelFingerprint.from_json(fp.obj) if fp is not None else None,
        "source": SnapshotSource.from_json(src.obj) if src is not None else None,
        "request_ids": f.optional_str_list("request_ids", max_items=_MAX_SEQS),
        "extra": f.optional_dict("extra"),
    }


def _seq_lens_differ(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    """How two members' ``seq_lens`` differ, for a message; ``""`` when they are equal (one tensor comparison)."""
    if a is b:
        return ""
    if a is None or b is None:
        return "one carries sequence lengths, the other none"
    if a.shape != b.shape:
        return f"{a.numel()} lengths and {b.numel()}"
    b = b.to(a.device)
    if torch.equal(a, b):
        return ""
    s = int((a != b).reshape(-1).nonzero()[0])
    return f"sequence {s}: {int(a.reshape(-1)[s])} tokens and {int(b.reshape(-1)[s])}"
