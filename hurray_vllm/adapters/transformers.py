"""Hugging Face transformers adapter: snapshots to ``DynamicCache`` and back.

Both directions speak transformers' cache layout, one tensor per layer and
role of shape ``[batch, num_kv_heads, seq_len, head_dim]`` with post-RoPE
keys, which is also what vLLM writes into its pages; no transposition of the
head dimension or re-rotation is needed, only paging.

* :func:`to_dynamic_cache` builds a ``transformers.DynamicCache`` holding one
  sequence of a :class:`~hurray_vllm.KVSnapshot` (fp8 pools dequantized).
* :func:`continue_generation` greedily continues a sequence from its
  snapshot KV with a transformers model, without recomputing the prefix.
* :func:`from_transformers` pages a transformers cache (a batch, padded or
  not) into a snapshot that any importer (vLLM included) can read.
* MLA models (DeepSeek-V2/V3 and kin): transformers 5.x caches their latent
  itself, the normalized compressed KV as the layer's "keys"
  (``[batch, 1, T, kv_lora_rank]``) and the rotated k_pe as its "values"
  (``[batch, 1, T, rope_dim]``), exactly the two halves of a fused
  snapshot layer: :func:`to_dynamic_cache` splits the latent, no
  decompression happens. :func:`expand_latent` decompresses it through the
  model's own ``kv_b_proj`` into per-head K/V for consumers that want them.
  A snapshot's k_pe keeps each rotated pair of dims side by side, as vLLM
  and FlashMLA hold it; transformers' DeepSeek-V3-style models
  (``rope_interleave=True``, the published checkpoints) cache the pairs'
  first elements, then their second ones, as LongCat-Flash and the DSA
  models always do (:data:`_ALWAYS_PAIRS_SPLIT`). Both directions reorder
  it when the model's config says so (``docs/format.md`` 2.3a). DeepSeek
  Sparse Attention models are refused: a snapshot has no indexer cache.

Only this module imports ``transformers``, and only when a function needs it.
Tested with transformers 5.x (``DynamicCache.layers[i].keys``,
``Cache.update(k, v, layer_idx)``); legacy tuple caches are accepted as input.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..agreement import DEFAULT_ULPS, Agreement, greedy_agreement
from ..errors import HurrayArgumentError, HurrayFormatError, ImportArgumentError, integer_arg, plain_int
from ..kv import repage
from ..kv.paged import BlockPagedTensor, zero_slots_
from ..kv.repage import check_budget, check_memory
from ..kv.snapshot import TARGET_LAYERS, KVSnapshot, LatentSplit, ModelFingerprint, SnapshotSource
from ..kv.states import RecurrentStates
from ..wire import dtypes
from ..wire.descriptor import PerTensorAffine
from ..wire.rules import raise_if
from ._common import check_layer

if TYPE_CHECKING:
    from transformers import DynamicCache

__all__ = [
    "ConfigGeometry",
    "check_compatible",
    "check_continuation",
    "config_geometry",
    "continue_generation",
    "expand_latent",
    "fingerprint_from_config",
    "from_transformers",
    "next_token_logits",
    "sequence_kv",
    "teacher_forced_logits",
    "to_dynamic_cache",
]

#: ``SnapshotSource.layout`` of snapshots made by :func:`from_transformers`.
SOURCE_LAYOUT = "transformers-BHTD"


# ── model geometry ─────────────────────────────────────────────────────────


@dataclass(frozen=True)
class ConfigGeometry:
    """The KV geometry a transformers config implies.

    Attributes:
        architecture: ``config.architectures[0]`` (``"LlamaForCausalLM"``), or
            ``None`` when the config does not name one (a model built from a
            config object rather than loaded from a checkpoint).
        num_layers: the layers that cache KV: ``num_hidden_layers``, less a
            Gemma3n-style model's ``num_kv_shared_layers`` (which attend
            over an earlier layer's cache) and a linear-attention hybrid's
            state layers (``layer_types`` with ``"linear_attention"``).
        linear_layers: a linear-attention hybrid's state layers (model indices).
        num_kv_heads: ``num_key_value_heads`` (``num_attention_heads`` when
            the config has no GQA field).
        head_dim: ``head_dim``, or ``hidden_size // num_attention_heads``.
        latent: for MLA models (a config with ``kv_lora_rank``), how the
            cached latent divides; ``num_kv_heads`` is then 1 and
            ``head_dim`` the latent's width, as a fused snapshot holds it.
    """

    architecture: str | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    latent: LatentSplit | None = None
    linear_layers: tuple[int, ...] = ()


#: ``layer_types`` entries of transformers' linear-attention layers (Qwen3-Next's gated delta net).
_LINEAR_TYPES = ("linear_attention",)

#: ``layer_types`` entries of DeepSeek Sparse Attention layers (DeepSeek-V3.2, GLM-5 ``glm_moe_dsa``,
#: A.X K2, HY-V4...): besides the latent they cache an indexer's keys, which select the tokens each query
#: attends to. A snapshot carries no indexer cache, and without it the model attends to the wrong tokens.
_INDEXED_TYPES = ("indexed_attention",)

#: ``layer_types`` entries this adapter moves: attention layers that cache every token's keys and values (full,
#: sliding-window and chunked: transformers' cache keeps the window or chunk of them), and a hybrid's linear-attention
#: layers (their states, :func:`_put_states`). Any other kind caches something a snapshot does not hold
#: (DeepSeek-V4's compressed KV and compressor state, a hybrid layer's state beside its KV, none at all for an
#: MLP-only layer): loaded as plain KV, it would continue with wrong tokens rather than fail.
_HANDLED_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", *_LINEAR_TYPES})


def _text_config(model_config: Any) -> Any:
    """The decoder's text config of a composite (multimodal) config; the config itself otherwise."""
    get_text = getattr(model_config, "get_text_config", None)
    if not callable(get_text):
        return model_config
    try:
        return get_text(decoder=True)
    except TypeError:  # older transformers: no decoder argument
        return get_text()


def _shared_kv_layers(cfg: Any) -> int:
    """How many of a text config's last layers reuse an earlier layer's KV and have no cache (Gemma3n's).

    transformers builds no cache layer for them (``get_layer_types_and_kwargs``
    drops the last ``num_kv_shared_layers`` layer types), and vLLM allocates
    them no KV: the cache, and a snapshot, hold the other layers only.
    """
    shared = getattr(cfg, "num_kv_shared_layers", None)
    return int(shared) if isinstance(shared, int) and shared > 0 else 0


def _cached_layer_types(cfg: Any) -> list[str]:
    """A text config's ``layer_types`` of the layers with a cache of their own (``[]`` when it has none)."""
    types = list(getattr(cfg, "layer_types", None) or ())
    shared = _shared_kv_layers(cfg)
    return types[:-shared] if shared else types


def _per_layer(cfg: Any, name: str, layers: Sequence[int]) -> Any:
    """``cfg.<name>`` (``None`` when it has none), or the one value the config gives it in every layer of ``layers``.

    A heterogeneous config (transformers' ``per_layer_config``: Gemma 4's
    full-attention layers take ``global_head_dim``) refuses a global read of
    an attribute that varies by layer; its layers' own configs say it.

    Raises:
        HurrayFormatError: (field ``model_config``) the layers differ in it.
    """
    per_layer = getattr(cfg, "per_layer_attributes", None)
    if not per_layer or name not in per_layer:
        return getattr(cfg, name, None)
    view = cfg.per_layer_config
    found: dict[Any, list[int]] = {}
    for i in layers:
        found.setdefault(getattr(view[i], name, None), []).append(i)
    if len(found) > 1:
        where = "; ".join(f"layers {idx} have {value}" for value, idx in found.items())
        raise HurrayFormatError(
            "model_config",
            f"per-layer KV geometry (Gemma 4's full-attention layers and kin, per_layer_config) is not supported: "
            f"{name} differs by layer ({where}), while a snapshot's layers share one KV geometry; "
            "this adapter cannot page or resume this model's cache",
        )
    return next(iter(found), None)


def config_geometry(model_config: Any) -> ConfigGeometry:
    """Read :class:`ConfigGeometry` from a transformers ``PretrainedConfig``.

    Composite (multimodal) configs are read through their decoder text
    config. A heterogeneous config (``per_layer_config``) is read layer by
    layer; its cached layers must share one head size and KV head count.
    Raises :class:`HurrayFormatError` (field ``model_config``) when the
    config lacks the attention geometry or its layers' KV geometries differ
    (Gemma 4's full-attention layers' ``global_head_dim``).
    """
    cfg = _text_config(model_config)
    archs = getattr(model_config, "architectures", None) or getattr(cfg, "architectures", None)
    try:
        layers = int(cfg.num_hidden_layers) - _shared_kv_layers(cfg)
        heads = int(cfg.num_attention_heads)
        linear = tuple(i for i, t in enumerate(_cached_layer_types(cfg)) if t in _LINEAR_TYPES)
        cached = [i for i in range(layers) if i not in linear]
        kv_heads = _per_layer(cfg, "num_key_value_heads", cached)
        head_dim = _per_layer(cfg, "head_dim", cached)
        if head_dim is None:
            head_dim = int(cfg.hidden_size) // heads
        rank = getattr(cfg, "kv_lora_rank", None)
        if rank:  # MLA: one cached latent "head" of kv_lora_rank + rope values per token
            latent = LatentSplit(int(rank), int(cfg.qk_rope_head_dim), str(getattr(cfg, "model_type", "") or ""))
            arch = str(archs[0]) if archs else None
            return ConfigGeometry(arch, layers - len(linear), 1, latent.head_dim, latent, linear)
        return ConfigGeometry(
            architecture=str(archs[0]) if archs else None,
            num_layers=layers - len(linear),
            num_kv_heads=int(kv_heads) if kv_heads is not None else heads,
            head_dim=int(head_dim),
            linear_layers=linear,
        )
    except HurrayFormatError:
        raise  # _per_layer's, already naming the field
    except (AttributeError, TypeError, ValueError, ZeroDivisionError, RuntimeError) as exc:
        # RuntimeError: transformers' AmbiguousGlobalPerLayerAttributeError, a per-layer attribute read globally.
        raise HurrayFormatError(
            "model_config", f"{type(model_config).__name__} does not describe an attention model's KV: {exc}"
        ) from None


def fingerprint_from_config(
    model_config: Any, *, dtype: torch.dtype | str, weights_digest: str | None = None
) -> ModelFingerprint:
    """A :class:`~hurray_vllm.ModelFingerprint` for a transformers model.

    ``dtype`` is the cache storage dtype (a torch dtype or a Hurray element
    type name such as ``"bfloat16"``). The architecture falls back to the
    config's ``model_type`` when it names no ``architectures``. Note that
    vLLM's ``weights_digest`` hashes vLLM's own (fused) parameters, so a
    digest computed from a transformers model never equals it; leave it
    ``None`` unless both sides hash the same way.
    """
    geo = config_geometry(model_config)
    name = dtypes.from_torch(dtype).name if isinstance(dtype, torch.dtype) else dtypes.element_type(dtype).name
    return ModelFingerprint(
        architecture=geo.architecture or str(getattr(model_config, "model_type", "unknown")),
        num_layers=geo.num_layers,
        num_kv_heads=geo.num_kv_heads,
        head_dim=geo.head_dim,
        dtype=name,
        weights_digest=weights_digest,
    )


def check_compatible(snapshot: KVSnapshot, model_config: Any, *, architecture: str | None = None) -> None:
    """Refuse a snapshot whose KV cannot belong to the model ``model_config`` describes.

    Compares the number of layers, KV heads and the head size, both of the
    snapshot's fingerprint (when it has one) and of every layer's page
    pools, and the fingerprint's architecture against ``architecture``
    (default: the config's ``architectures[0]``; skipped when neither names
    one). A linear-attention hybrid's states must be of the layers, kind,
    layout and shapes the config implies (:func:`_gdn_state_shapes`), and
    its recorded attention-layer indices (``states.attention``) the config's
    full-attention layers. A slice of the KV heads (``snapshot.heads``,
    one tensor-parallel rank's part) is refused, and so are heads of a
    model with another KV head count. The
    cache dtype is not compared: an fp8 snapshot is dequantized for a bf16
    model.

    Raises:
        HurrayFormatError: field ``fingerprint``, listing every difference;
            field ``model_config`` for a DeepSeek Sparse Attention model
            (``"indexed_attention"`` layers), whose indexer cache no snapshot
            carries, and for a model with layers of a type other than
            full, sliding-window, chunked or linear attention in its
            ``layer_types`` (DeepSeek-V4's compressed attention...), whose
            caches hold something other than a snapshot's KV, or an MLA
            model with linear-attention layers (Kimi Linear), whose KDA
            states no snapshot holds.
    """
    geo = config_geometry(model_config)
    indexed = sorted({t for t in _cached_layer_types(_text_config(model_config)) if t in _INDEXED_TYPES})
    if indexed:
        raise HurrayFormatError(
            "model_config",
            f"{type(model_config).__name__} has DeepSeek Sparse Attention layers ({indexed[0]!r} in layer_types), "
            "which attend through an indexer's cached keys; a snapshot carries no indexer cache, so this model "
            "cannot resume from one",
        )
    _refuse_unhandled_layers(model_config, "cannot resume from a snapshot")
    arch = architecture or geo.architecture
    fp = snapshot.fingerprint
    model_type = getattr(model_config, "model_type", None)
    named = {architecture, *(getattr(model_config, "architectures", None) or ()), geo.architecture} - {None}
    if (
        fp is not None
        and model_type
        and (fp.architecture == model_type or (arch == model_type and fp.architecture in named))
    ):
        # fingerprint_from_config writes the model_type for a config that names no architectures (one built in
        # code); the same model names its class once saved or loaded (save_pretrained sets architectures). Either
        # name of this config's model matches the other; a different model's name still does not.
        arch = fp.architecture
    model = ModelFingerprint(arch or "", geo.num_layers, geo.num_kv_heads, geo.head_dim, "")
    ignore = {"dtype"} if arch else {"dtype", "architecture"}
    # The fingerprint says what the exporter meant, the pools what the snapshot holds: check both.
    claims: list[ModelFingerprint] = []
    if snapshot.fingerprint is not None:
        claims.append(snapshot.fingerprint)
    problems: list[str] = []
    heads = snapshot.heads
    if heads is not None and heads.count != heads.total:
        # One rank's heads fill only part of each layer: the model would attend its heads over the wrong heads'
        # KV (or fail on the shape), whatever its fingerprint says.
        problems.append(
            f"heads: the snapshot holds KV heads {heads.start}..{heads.stop - 1} of {heads.total} (one "
            "tensor-parallel rank's part); join the ranks' parts first (hurray_vllm.kv.heads.concat_heads)"
        )
    if heads is not None and heads.total != geo.num_kv_heads:
        problems.append(f"heads: the snapshot's heads are of {heads.total} KV heads, the model has {geo.num_kv_heads}")
    if snapshot.num_layers:
        # Every pool, not just layer 0's: validate() accepts layers of different geometries, which the
        # model's cache would only refuse mid-forward with a bare shape error.
        first = snapshot.tensors()[0]
        seen: set[tuple[int, int]] = set()
        for t in snapshot.tensors():
            geometry = (t.num_heads, t.head_dim)
            if geometry in seen:
                continue
            seen.add(geometry)
            claims.append(ModelFingerprint(model.architecture, snapshot.num_layers, *geometry, ""))
            if geometry != (first.num_heads, first.head_dim):
                problems.append(
                    f"layer {t.layer_index} {t.kv_role}: {t.num_heads} heads of {t.head_dim}, "
                    f"layer 0 {first.num_heads} of {first.head_dim}"
                )
    if (geo.latent is None) != (not snapshot.is_latent) and snapshot.num_layers:
        what = "fused MLA latents" if snapshot.is_latent else "keys and values"
        problems.append(
            f"kv_role: the snapshot holds {what}, the model {'does not' if geo.latent is None else 'is MLA'}"
        )
    elif geo.latent is not None and snapshot.latent is not None and snapshot.latent != geo.latent:
        problems.append(f"latent: snapshot has {snapshot.latent}, model has {geo.latent}")
    wants = _config_windows(model_config)
    if snapshot.windows is not None and wants is not None and list(snapshot.windows.sizes) != wants:
        problems.append(f"windows: snapshot's layers have windows {list(snapshot.windows.sizes)}, the model's {wants}")
    elif snapshot.windows is not None and wants is None and any(w is not None for w in snapshot.windows.sizes):
        problems.append("windows: the snapshot's sliding-window layers dropped old tokens the model attends to")
    held = tuple(snapshot.states.layers) if snapshot.states is not None else ()
    if held != geo.linear_layers:
        problems.append(
            f"states: the snapshot holds linear-attention states of layers {list(held)}, "
            f"the model's linear-attention layers are {list(geo.linear_layers)}"
        )
    elif snapshot.states is not None:
        problems.extend(_state_problems(snapshot.states, model_config))
        # Recorded indices say where each snapshot layer's KV goes: one the model does not have as full
        # attention would put KV into a linear-attention layer, or past the cache's last layer.
        full = [i for i in range(geo.num_layers + len(geo.linear_layers)) if i not in geo.linear_layers]
        if snapshot.states.attention and list(snapshot.states.attention) != full:
            problems.append(
                f"states: the snapshot's attention layers are model layers {list(snapshot.states.attention)}, "
                f"the model's full-attention layers are {full}"
            )
    for claim in claims:
        for msg in claim.mismatches(model, ignore=ignore, labels=("snapshot", "model")):
            if msg not in problems:
                problems.append(msg)
    if problems:
        hint = ""
        if snapshot.num_layers > geo.num_layers:
            # An engine with EAGLE or MTP exports the drafter's layers after the model's (and names them).
            hint = (
                f" (if layers {geo.num_layers}.. are a speculative drafter's, take the model's: "
                f"snapshot.with_layers(snapshot.layer_members()[:{geo.num_layers}], fingerprint=None))"
                if TARGET_LAYERS not in snapshot.extra
                else f" (layers {snapshot.extra[TARGET_LAYERS]}.. are a speculative drafter's: "
                "snapshot.without_drafter() takes the model's)"
            )
        raise HurrayFormatError("fingerprint", "the snapshot does not fit this model: " + "; ".join(problems) + hint)


def _refuse_unhandled_layers(model_config: Any, what: str) -> None:
    """Raise unless every cached layer of the config is of a type this adapter moves (:data:`_HANDLED_TYPES`).

    Args:
        model_config: the model's ``PretrainedConfig`` (a composite one is read through its text config).
        what: what the model cannot do, for the message (``"cannot resume from a snapshot"``).

    Raises:
        HurrayFormatError: (field ``model_config``) naming the first unknown layer type and where it is, or an
            MLA model's linear-attention layers (Kimi Linear's KDA), whose states no snapshot state kind holds.
    """
    geo = config_geometry(model_config)
    if geo.latent is not None and geo.linear_layers:
        raise HurrayFormatError(
            "model_config",
            f"{type(model_config).__name__} is an MLA model with linear-attention layers {list(geo.linear_layers)} "
            f"(Kimi Linear's KDA), whose states no snapshot state kind describes (only {sorted(_STATE_KINDS)}); "
            f"this adapter moves an MLA model's latents only, so this model {what}",
        )
    types = _cached_layer_types(_text_config(model_config))
    unknown = [(i, t) for i, t in enumerate(types) if t not in _HANDLED_TYPES and t not in _INDEXED_TYPES]
    if unknown:
        i, kind = unknown[0]
        raise HurrayFormatError(
            "model_config",
            f"{type(model_config).__name__} has {kind!r} layers (layer_types[{i}], {len(unknown)} layers of "
            f"types {sorted({t for _, t in unknown})}), whose cache holds more or other than every token's keys "
            f"and values; this adapter moves {sorted(_HANDLED_TYPES)} layers only, so this model {what}",
        )


def _gdn_state_shapes(model_config: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Per sequence, the conv and recurrent state shapes of the config's gated delta net layers, in the format's layout.

    Qwen3-Next's gated delta net (and its kin's) convolves its query, key
    and value channels together, ``2 * key_heads * key_dim + value_heads *
    value_dim`` of them over ``linear_conv_kernel_dim`` inputs, of which the
    state keeps the last ``kernel - 1``; its recurrent state is ``[value_heads,
    key_dim, value_dim]`` (``kv/states.py``'s whole shapes). ``None`` when
    the config does not describe one (a Mamba-style hybrid).
    """
    cfg = _text_config(model_config)
    try:
        kernel = int(cfg.linear_conv_kernel_dim)
        key_heads, key_dim = int(cfg.linear_num_key_heads), int(cfg.linear_key_head_dim)
        value_heads, value_dim = int(cfg.linear_num_value_heads), int(cfg.linear_value_head_dim)
    except (AttributeError, TypeError, ValueError):
        return None
    return (kernel - 1, 2 * key_heads * key_dim + value_heads * value_dim), (value_heads, key_dim, value_dim)


def _state_problems(states: RecurrentStates, model_config: Any) -> list[str]:
    """How linear-attention states held for the model's layers differ from what its config implies.

    Shapes are compared because a wrong one either fails deep inside
    transformers or, for a shorter conv kernel, is silently cut to fit and
    continues with wrong tokens.
    """
    if states.kind not in _STATE_KINDS:
        return [f"states: {states.kind!r} states; this adapter reads {sorted(_STATE_KINDS)}"]
    if states.layout:
        # An engine's own memory layout holds the same numbers in another order: read as ours, they are wrong.
        return [
            f"states: layout {states.layout!r}, an engine's memory layout; this adapter reads the format's "
            "normalized one (layout ''): export the states normalized"
        ]
    if states.part is not None:
        return [
            f"states: part {list(states.part)} of the states (one tensor-parallel rank's); "
            "join the ranks' states first (hurray_vllm.kv.states.join_states)"
        ]
    want = _gdn_state_shapes(model_config)
    if want is None:
        return [
            "states: the model's config does not describe a gated delta net (linear_conv_kernel_dim, "
            "linear_num_key_heads, linear_key_head_dim, linear_num_value_heads, linear_value_head_dim)"
        ]
    held = states.shapes
    if len(held) != len(want):
        return [f"states: members {list(states.names)}; a gated delta net's are its conv and recurrent states"]
    out = [
        f"states.{name}: snapshot has {list(got)}, model has {list(shape)}"
        for name, got, shape in zip(states.names, held, want, strict=True)
        if tuple(got) != shape
    ]
    if out:
        out.append(
            "states: conv is [kernel - 1, 2 * key_heads * key_dim + value_heads * value_dim] and recurrent "
            "[value_heads, key_dim, value_dim] by the config's linear_* fields: these are another model's states"
        )
    return out


# ── snapshot → transformers ────────────────────────────────────────────────


def _dequantize(t: BlockPagedTensor, dense: torch.Tensor, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    q = t.quantization
    if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = None  # kv_scales are an fp8 cache's (docs/format.md): ignored elsewhere, as every importer does
    if q is None and not t.dtype.is_floating_point:
        # Integers are KV only through a quantization that says how to map them back; cast, they are noise.
        raise HurrayFormatError(
            "dtype",
            f"layer {t.layer_index} {t.kv_role}: a {t.dtype} pool without a quantization descriptor holds no "
            "values this adapter can read; export float or fp8 pools, or describe the quantization",
        )
    if q is None and scale is None:
        return dense.to(dtype)
    x = dense.to(torch.float32)
    if isinstance(q, PerTensorAffine):
        x = (x - q.zero_point) * q.scale
    elif q is not None:
        raise HurrayFormatError(
            "quantization", f"layer {t.layer_index} {t.kv_role}: {type(q).__name__} caches cannot be dequantized here"
        )
    if scale is not None:
        x = x * scale
    return x.to(dtype)


def _config_dtype(model_config: Any) -> torch.dtype | None:
    """The dtype a config says its model computes in (``dtype``, ``torch_dtype``; a composite's text config's too)."""
    if model_config is None:
        return None
    for cfg in (model_config, _text_config(model_config)):
        want = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        if isinstance(want, str):
            want = getattr(torch, want, None)  # a config read from JSON names it ("bfloat16"); "auto" is none
        if isinstance(want, torch.dtype) and want.is_floating_point and want.itemsize > 1:
            return want
    return None


def _default_dtype(snapshot: KVSnapshot, model_config: Any) -> torch.dtype:
    """The cache dtype when the caller names none: the model's (its config's), else the pools' if they hold values.

    The model's first: its attention refuses keys and values of another
    dtype than its queries, so a float32 snapshot for a bf16 model would
    build a cache the model cannot attend over.
    """
    want = _config_dtype(model_config)
    if want is not None:
        return want
    first = snapshot.tensors()[0]
    pool = first.dtype
    quantized = snapshot.kv_scales is not None or first.quantization is not None
    if pool.is_floating_point and pool.itemsize > 1 and not quantized:
        return pool
    return torch.float32


class _SequenceIndexError(HurrayArgumentError, IndexError):
    """A sequence index outside the snapshot's batch: the caller's mistake, still an ``IndexError`` as it used to be."""


def _check_dtype(dtype: Any) -> None:
    """Refuse a ``dtype`` argument that cannot hold dequantized KV (field ``dtype``), as :func:`from_transformers` does.

    An integer, bool or fp8 cache would truncate the KV to a few values without a word, and the model would
    continue from noise.
    """
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise ImportArgumentError("dtype", f"expected a torch dtype (torch.bfloat16, torch.float32...), got {dtype!r}")
    if not dtype.is_floating_point or dtype.itemsize == 1:
        raise ImportArgumentError(
            "dtype", f"{dtype} cannot hold dequantized KV (fp8 would need scales); use bf16/fp16/fp32"
        )


def _stop_tokens(eos_token_id: Any) -> set[int]:
    """:func:`continue_generation`'s ``eos_token_id`` (an id, ids, or a tensor of them) as a set of ints.

    A tensor's elements are compared by identity in a set, so a tensor left as it is never stopped generation.
    """
    if eos_token_id is None:
        return set()
    ids = eos_token_id.tolist() if isinstance(eos_token_id, torch.Tensor) else eos_token_id
    try:
        items = [ids] if isinstance(ids, int) else list(ids)
    except TypeError:  # one id of another integer type (numpy's), or no id at all
        items = [ids]
    try:
        return {plain_int(t) for t in items}
    except TypeError:
        raise HurrayArgumentError(
            "eos_token_id", f"expected a token id, a sequence of them or an integer tensor, got {eos_token_id!r}"
        ) from None


def _check_seq(snapshot: KVSnapshot, seq: int) -> int:
    """``seq`` as a plain ``int``; raise unless it is one of the snapshot's sequences.

    The error names field ``seq`` and is also an ``IndexError``. A float or a bool is refused too: it would
    fail later with a bare ``TypeError``, or index sequence 0 or 1.
    """
    seq = integer_arg(seq, "seq", error=_SequenceIndexError)
    if not 0 <= seq < snapshot.num_seqs:
        raise _SequenceIndexError("seq", f"sequence {seq} is outside the batch of {snapshot.num_seqs}")
    return seq


def sequence_kv(
    snapshot: KVSnapshot,
    seq: int,
    layer: int,
    *,
    dtype: torch.dtype | None = None,
    length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``seq``'s keys and values of ``layer``, dense and dequantized, as a transformers cache holds them.

    Returns two ``[num_kv_heads, n, head_dim]`` tensors (``n`` =
    ``length`` or the sequence's length) of ``dtype`` (default: the pool's
    dtype, float32 for fp8 or otherwise quantized pools), on the pools'
    device. fp8 pools are scaled by ``snapshot.kv_scales[layer]``. For an
    MLA snapshot, the latent's two parts: the normalized compressed KV
    ``[1, n, kv_lora_rank]`` and the rotated k_pe ``[1, n, rope_dim]`` in
    the snapshot's order, each rotated pair's dims side by side (what
    transformers' MLA layers cache as their keys and values, except that a
    ``rope_interleave`` model, and LongCat-Flash or a DSA model, caches the
    pairs split: :func:`to_dynamic_cache` reorders k_pe with
    :func:`_split_pairs` for those).

    The snapshot is validated first, as :func:`to_dynamic_cache` does.

    Raises:
        HurrayFormatError: the snapshot breaks a format rule (a block table
            entry past the pool...), a sequence declaring more than
            ``MAX_IMPORT_SLOTS`` slots, a quantization this adapter cannot
            undo, or an integer pool without one.
        HurrayArgumentError: ``seq`` outside the batch (field ``seq``, also an
            ``IndexError``), ``layer`` outside the snapshot's layers (field
            ``layer``), ``length`` outside ``0..seq_lens[seq]`` (field ``length``),
            a ``dtype`` that is not a floating torch dtype of 2 bytes or more (field ``dtype``).
        OSError: ``ENOMEM``: the dense KV is larger than the device's memory.
    """
    # An in-memory snapshot was never checked as a file is on load: a block table entry past the pool would
    # otherwise fail deep in index_select.
    _check_dtype(dtype)
    raise_if(snapshot.validate(), "sequence_kv")
    layer = check_layer(snapshot, layer)
    seq = _check_seq(snapshot, seq)
    return _sequence_kv(snapshot, seq, layer, dtype=dtype, length=length)


def _sequence_kv(
    snapshot: KVSnapshot, seq: int, layer: int, *, dtype: torch.dtype | None, length: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_kv` of a snapshot already validated, ``seq`` and ``layer`` in range."""
    if snapshot.is_latent:
        return _latent_parts(snapshot, seq, layer, dtype=dtype, length=length)
    k_t, v_t = snapshot.keys[layer], snapshot.values[layer]
    n = _tokens_asked(k_t, seq, length)
    dtype = dtype or _default_dtype(snapshot, None)
    scales = snapshot.kv_scales[layer] if snapshot.kv_scales is not None else (None, None)
    out = []
    for t, scale in ((k_t, scales[0]), (v_t, scales[1])):
        out.append(_dequantize(t, _dense(t, seq, n), scale, dtype).transpose(0, 1).contiguous())
    return out[0], out[1]


def _dense(t: BlockPagedTensor, seq: int, n: int) -> torch.Tensor:
    """The first ``n`` tokens of sequence ``seq``, ``[n, H, D]``, within the import budget.

    A sequence's pages may repeat, so a small file can declare a sequence far
    longer than its pool: the pages read are counted against
    :data:`~hurray_vllm.kv.repage.MAX_IMPORT_SLOTS` before any is copied.
    """
    pages = t.pages_of(seq)[: -(-n // t.page_size)]
    if pages.numel() * t.page_size < n:
        raise HurrayFormatError(
            "seq_lens.pages",
            f"layer {t.layer_index} {t.kv_role}: sequence {seq} has {n} tokens but {pages.numel()} pages of "
            f"{t.page_size}",
        )
    what = f"sequence {seq} of layer {t.layer_index} {t.kv_role}"
    slots = int(pages.numel()) * t.page_size
    check_budget(slots, what)
    check_memory(slots * t.num_heads * t.head_dim * t.page_pool.element_size(), what, t.page_pool.device)
    dense = t.page_pool.index_select(0, pages.to(t.page_pool.device))
    return dense.reshape(-1, t.num_heads, t.head_dim)[:n]


def _tokens_asked(t: BlockPagedTensor, seq: int, length: int | None) -> int:
    """``length`` tokens of sequence ``seq`` (default: all it has), refused when it is no integer or it has fewer."""
    n = t.seq_len(seq)
    if length is None:
        return n
    length = integer_arg(length, "length", error=ImportArgumentError)  # 2.5 would fail as a bare slice TypeError
    if not 0 <= length <= n:
        raise ImportArgumentError("length", f"sequence {seq} has {n} tokens of KV, {length} were asked for")
    return length


def _latent_parts(
    snapshot: KVSnapshot, seq: int, layer: int, *, dtype: torch.dtype | None, length: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    t = snapshot.fused[layer]
    lat = snapshot.latent
    assert lat is not None  # a fused snapshot always has one (KVSnapshot checks)
    n = _tokens_asked(t, seq, length)
    dtype = dtype or _default_dtype(snapshot, None)
    scale = snapshot.kv_scales[layer][0] if snapshot.kv_scales is not None else None
    dense = _dequantize(t, _dense(t, seq, n), scale, dtype).transpose(0, 1)  # [1, n, C]
    return dense[..., : lat.kv_lora_rank].contiguous(), dense[..., lat.kv_lora_rank :].contiguous()


#: ``model_type`` of the MLA models whose transformers attention always splits k_pe's rotary pairs: their
#: modeling calls ``apply_rotary_pos_emb_interleave`` unconditionally and their configs have no
#: ``rope_interleave`` to say so (transformers 5.x: LongCat-Flash, DeepSeek-V3.2, GLM-5, A.X K2).
_ALWAYS_PAIRS_SPLIT = frozenset({"longcat_flash", "deepseek_v32", "glm_moe_dsa", "axk2"})


def _pairs_split(model_config: Any) -> bool:
    """Whether an MLA model's attention caches k_pe with its rotary pairs split (``rope_interleave``).

    DeepSeek's checkpoints lay each rotary pair out side by side. vLLM and
    FlashMLA rotate them where they lie; transformers' DeepSeek-V3 and its
    kin (``rope_interleave=True``, their default) gather every pair's first
    element, then every second one, and rotate those halves: the same
    values in another order, in its cache and in its queries alike.
    DeepSeek-V2 in transformers rotates them where they lie. The models of
    :data:`_ALWAYS_PAIRS_SPLIT` split them whatever their config says.
    """
    if model_config is None:
        return False
    cfg = _text_config(model_config)
    return getattr(cfg, "model_type", None) in _ALWAYS_PAIRS_SPLIT or bool(getattr(cfg, "rope_interleave", False))


def _split_pairs(k_pe: torch.Tensor) -> torch.Tensor:
    """k_pe in the snapshot's order (pairs side by side) into a ``rope_interleave`` model's (firsts, then seconds)."""
    if k_pe.shape[-1] % 2:
        raise HurrayFormatError("latent.rope_dim", f"{k_pe.shape[-1]} rotary dims do not form pairs")
    return torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)


def _join_pairs(k_pe: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_split_pairs`: a ``rope_interleave`` model's k_pe in the snapshot's order."""
    if k_pe.shape[-1] % 2:
        raise HurrayFormatError("latent.rope_dim", f"{k_pe.shape[-1]} rotary dims do not form pairs")
    half = k_pe.shape[-1] // 2
    return torch.stack([k_pe[..., :half], k_pe[..., half:]], dim=-1).flatten(-2)


def _mla_layers(model: Any) -> list[Any]:
    """The model's MLA attention modules (those with a ``kv_b_proj``), in layer order."""
    return [m for m in model.modules() if isinstance(getattr(m, "kv_b_proj", None), torch.nn.Module)]


def expand_latent(
    model: Any, snapshot: KVSnapshot, seq: int, layer: int, *, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys and values of an MLA snapshot's layer, decompressed through the model's ``kv_b_proj``.

    For consumers that attend over per-head K/V (flash-attn, FlashInfer's
    K/V API, an older transformers): the latent ``c`` (``kv_lora_rank``)
    goes through the layer's ``kv_b_proj`` into ``[num_heads, qk_nope +
    v_head]`` per token, and each head's key is its nope part followed by
    the shared rotated k_pe.

    Args:
        model: the transformers MLA model the snapshot belongs to
            (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``...).
        snapshot: a fused (MLA) snapshot.
        seq: the sequence's index.
        layer: the layer.
        length: only the first ``length`` tokens.

    Returns:
        ``(keys [num_heads, n, qk_nope_head_dim + qk_rope_head_dim],
        values [num_heads, n, v_head_dim])`` in the model's dtype and device;
        the keys' k_pe in the order the model rotates its queries in (pairs
        split for ``rope_interleave`` models).

    Raises:
        HurrayFormatError: the snapshot holds keys and values (field
            ``kv_role``), does not fit the model (:func:`check_compatible`,
            field ``fingerprint``), or breaks a format rule.
        HurrayArgumentError: ``layer`` outside the model's MLA layers (field
            ``layer``), ``seq`` outside the batch (field ``seq``, also an
            ``IndexError``), a bad ``length`` (field ``length``).
        OSError: ``ENOMEM``: the dense KV is larger than the device's memory.
    """
    if not snapshot.is_latent:
        raise HurrayFormatError("kv_role", "expand_latent needs an MLA snapshot (fused latents)")
    # Another MLA model's latent splits at another width: decompressed anyway, its K/V come out misshapen.
    snapshot = _models_layers(snapshot)
    check_compatible(snapshot, model.config, architecture=_architecture(model))
    mods = _mla_layers(model)
    layer = integer_arg(layer, "layer", error=ImportArgumentError)  # mods[1.0] would be a bare TypeError
    if not 0 <= layer < len(mods):
        raise ImportArgumentError("layer", f"the model has {len(mods)} MLA layers (kv_b_proj), not layer {layer}")
    attn = mods[layer]
    # The layer's own weights' device: a model split across devices (device_map) computes each layer on its own.
    # The model's dtype, not the projection's: a quantized kv_b_proj's weights are stored in another.
    device, dtype = next(attn.kv_b_proj.parameters()).device, _device_and_dtype(model)[1]
    kv_nope, k_rot = (x.to(device) for x in sequence_kv(snapshot, seq, layer, dtype=dtype, length=length))
    cfg = _text_config(model.config)  # a multimodal model's (Kimi-K2.5's) MLA fields are its text config's
    if _pairs_split(cfg):
        k_rot = _split_pairs(k_rot)  # the order this model's queries are rotated in
    nope, v_dim, heads = int(cfg.qk_nope_head_dim), int(cfg.v_head_dim), int(cfg.num_attention_heads)
    with torch.no_grad():
        kv = attn.kv_b_proj(kv_nope[0]).view(-1, heads, nope + v_dim).transpose(0, 1)  # [H, n, nope + v]
    k_nope, values = kv.split([nope, v_dim], dim=-1)
    keys = torch.cat([k_nope, k_rot.expand(heads, -1, -1)], dim=-1)
    return keys.contiguous(), values.contiguous()


def to_dynamic_cache(
    snapshot: KVSnapshot,
    seq: int,
    *,
    model_config: Any = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | Sequence[torch.device | str] | None = None,
    length: int | None = None,
    architecture: str | None = None,
    for_generate: bool = False,
) -> DynamicCache:
    """A ``transformers.DynamicCache`` holding sequence ``seq`` of ``snapshot``.

    Every layer holds keys and values of shape ``[1, num_kv_heads, n,
    head_dim]`` (``n`` = ``length``, default ``snapshot.seq_lens[seq]``):
    post-RoPE keys for positions ``0..n-1``, exactly what a transformers
    forward pass over ``snapshot.token_ids[seq][:n]`` would have cached.
    For an MLA snapshot, what transformers' MLA layers cache: the
    normalized compressed KV ``[1, 1, n, kv_lora_rank]`` as keys and the
    rotated k_pe ``[1, 1, n, rope_dim]`` as values, its rotary pairs split
    for a ``rope_interleave`` model (DeepSeek-V3 and kin, LongCat-Flash; needs ``model_config``).
    fp8 pools are dequantized with ``snapshot.kv_scales``.

    Args:
        snapshot: any snapshot (from vLLM, a file, :func:`from_transformers`).
        seq: the sequence's index in the snapshot.
        model_config: the target model's ``PretrainedConfig``. When given, the
            snapshot is checked against it (:func:`check_compatible`) and the
            cache is built with ``DynamicCache(config=...)``, so sliding-window
            layers keep only their window. A snapshot with linear-attention
            states needs it (the cache's layer types), and so does an MLA
            snapshot (the model's k_pe order). A snapshot of an
            engine running EAGLE or MTP, whose drafter's layers follow the
            model's and are named (``extra[TARGET_LAYERS]``), gives the
            model's layers.
        dtype: the cache dtype. It must match the model's activations
            dtype. Default: the config's ``dtype`` (``torch_dtype``) when
            ``model_config`` names one; otherwise the pool dtype, float32
            for fp8 or otherwise quantized pools.
        device: where the cache tensors go (default: the pools' device).
            For a model split across devices (``device_map``), one device
            per model layer instead (linear-attention layers counted): each
            layer's KV, or states, go to its own.
        length: cache only the first ``length`` tokens.
        architecture: the model class name to compare with the fingerprint
            when the config names no ``architectures``.
        for_generate: a cache for ``model.generate(token_ids[seq],
            past_key_values=...)``: at most ``len(token_ids[seq]) - 1``
            tokens (and at most ``length``). ``generate`` feeds the input
            past the cache's length, and when every token has KV (a
            prefill-only snapshot, a chunk) it would feed nothing and,
            instead, run the whole input again on top of the full cache:
            wrong tokens, no error. Cut by one token, the last one is fed
            and its logits computed. Needs the snapshot's token ids; a
            snapshot with linear-attention states, whose states cannot be
            rewound by a token, is refused where the cut is needed.

    Raises:
        HurrayFormatError: the snapshot breaks a format rule (``validate``,
            a block table entry past the pool say), does not fit
            ``model_config`` (a DeepSeek Sparse Attention model's included,
            field ``model_config``), has no
            sequence lengths, or uses a quantization this adapter cannot undo
            (integer pools without one included, field ``dtype``); a
            sequence declaring more than ``MAX_IMPORT_SLOTS`` slots; with
            ``for_generate``, a sequence without token ids (field
            ``snapshot.token_ids``).
        HurrayArgumentError: (field ``model_config``) a linear-attention
            or MLA snapshot without ``model_config``; (``seq``, also an
            ``IndexError``) ``seq`` no integer or outside the batch; (``length``) a
            ``length`` no integer or outside ``0..seq_lens[seq]``; (``for_generate``)
            ``for_generate`` for a snapshot with linear-attention states whose
            every token has KV; (``device``) fewer
            devices than the model's layers; (``dtype``) a ``dtype`` that is
            not a floating torch dtype of 2 bytes or more (integers, bool, fp8).
        OSError: ``ENOMEM``: the dense cache is larger than the device's
            memory (every layer together), before any of it is built.
    """
    from transformers import DynamicCache

    _check_dtype(dtype)
    if model_config is not None:
        snapshot = _models_layers(snapshot)
        check_compatible(snapshot, model_config, architecture=architecture)
    elif snapshot.states is not None:
        # Only the config says which cache layers are linear attention: transformers builds them from it.
        raise HurrayArgumentError(
            "model_config",
            f"the snapshot holds linear-attention states (layers {list(snapshot.states.layers)}), which go into "
            "a cache built from the model's config: pass model_config=model.config",
        )
    elif snapshot.is_latent:
        # Only the config says the order the model rotates k_pe in (rope_interleave): guessed, it is wrong
        # for DeepSeek-V3 and its kin and continues with wrong tokens.
        raise HurrayArgumentError(
            "model_config",
            "the snapshot holds MLA latents, whose k_pe order depends on the model (rope_interleave): "
            "pass model_config=model.config",
        )
    # An in-memory snapshot was never checked as a file is on load: a block table entry past the pool
    # would otherwise fail deep in index_select. After the model check, whose message lists every
    # difference from the model; the rules read the index tensors only, not the pools.
    raise_if(snapshot.validate(), "to_dynamic_cache")
    if not snapshot.num_layers:
        raise HurrayFormatError("snapshot.layers", "the snapshot holds no layers")
    seq = _check_seq(snapshot, seq)
    # Before the memory check: a length past the sequence is a bad request, not a lack of memory.
    n = _tokens_asked(snapshot.tensors()[0], seq, length)
    if for_generate:
        n = _generate_length(snapshot, seq, n)
    dtype = dtype or _default_dtype(snapshot, model_config)
    _check_windows_held(snapshot, seq, n)
    states = snapshot.states
    # A linear-attention hybrid's attention layers are the model layers its states leave.
    where = states.attention_layers(snapshot.num_layers) if states is not None else range(snapshot.num_layers)
    to = _placement(device, [*where, *(states.layers if states is not None else ())])
    # Every layer's keys and values end up in the cache together, in ``dtype``, each on its layer's device;
    # each is gathered where the pools lie first (one layer at a time, in the pool's dtype too while it converts).
    members = snapshot.layer_members()
    built = members[0][0].page_pool.device
    tokens = [[-(-n // t.page_size) * t.page_size * t.num_heads * t.head_dim for t in ts] for ts in members]
    # Bytes per device: one layer's gathered keys and values where the pools are, each layer's cache on its own.
    held: dict[torch.device, int] = {
        built: 2 * max(map(max, tokens)) * max(dtype.itemsize, members[0][0].page_pool.element_size())
    }
    for layer, counts in zip(where, tokens, strict=True):
        on = torch.device(to(layer) or built)
        held[on] = held.get(on, 0) + sum(counts) * dtype.itemsize
    for on, nbytes in held.items():
        check_memory(nbytes, f"a dense cache of sequence {seq}", on)
    cache = _new_dynamic_cache(DynamicCache, model_config)
    split = snapshot.is_latent and _pairs_split(model_config)
    for i, layer in enumerate(where):
        k, v = _sequence_kv(snapshot, seq, i, dtype=dtype, length=n)
        if split:
            v = _split_pairs(v)  # an MLA cache's "values" are its k_pe
        k, v = k.unsqueeze(0), v.unsqueeze(0)
        if (dest := to(layer)) is not None:
            k, v = k.to(dest), v.to(dest)
        cache.update(k, v, layer)
    if states is not None:
        _put_states(cache, states, seq, n, dtype, to)
    return cache


def _generate_length(snapshot: KVSnapshot, seq: int, n: int) -> int:
    """How many of ``n`` tokens of KV a cache for ``generate(token_ids[seq])`` may hold: one token fewer than the ids.

    ``generate`` feeds ``input_ids[:, cache length:]``; an empty feed makes it run the whole input again over the
    full cache (transformers' own full cache too), which continues with wrong tokens.

    Raises:
        HurrayFormatError: (field ``snapshot.token_ids``) the sequence has no token ids to feed.
        HurrayArgumentError: (field ``for_generate``) the cut is needed but the snapshot carries
            linear-attention states, which hold every token and cannot be rewound by one.
    """
    ids = snapshot.token_ids[seq] if snapshot.token_ids else ()
    if not ids:
        raise HurrayFormatError(
            "snapshot.token_ids",
            f"for_generate: sequence {seq} carries no token ids; generate() needs them as its input",
        )
    cut = min(n, len(ids) - 1)
    if cut < n and snapshot.states is not None:
        raise HurrayArgumentError(
            "for_generate",
            f"every token of sequence {seq} has KV and linear-attention states, which cannot be rewound by a "
            "token for generate() to feed the last one (continue_generation refuses it too): knowing the next "
            "token, build the cache without for_generate and pass generate() token_ids[seq] + [next]; or take "
            "the snapshot with its sampled token pending, as vLLM's mid-decode snapshots are",
        )
    return cut


def _placement(
    device: torch.device | str | Sequence[torch.device | str] | None, layers: Sequence[int]
) -> Callable[[int], torch.device | str | None]:
    """Where model layer ``i``'s cache goes: ``device`` itself, or its ``i``-th entry when it is one per layer.

    Args:
        device: :func:`to_dynamic_cache`'s ``device``.
        layers: the model layers the cache will fill.

    Raises:
        HurrayArgumentError: (field ``device``) a per-layer sequence without an entry for every layer filled.
    """
    if device is None or isinstance(device, (str, torch.device)):
        return lambda _: device
    per_layer = list(device)
    if layers and max(layers) >= len(per_layer):
        raise ImportArgumentError(
            "device", f"{len(per_layer)} devices, one per model layer, but the cache fills model layer {max(layers)}"
        )
    return lambda i: per_layer[i]


def _models_layers(snapshot: KVSnapshot) -> KVSnapshot:
    """The snapshot without a speculative drafter's layers when it names them (an EAGLE or MTP engine's).

    Whatever the counts: a 2-layer model's snapshot with a 1-layer drafter
    has as many layers as a 3-layer model, and kept whole, the drafter's KV
    would become that model's layer 2 (wrong tokens, no error). Cut, it is
    refused by :func:`check_compatible` (2 layers against 3).
    """
    return snapshot.without_drafter()  # returned as it is when it names no drafter


#: Linear-attention state kinds this adapter converts (vLLM's ``mamba_type``), see :func:`_put_states`.
_STATE_KINDS = frozenset({"gdn_attn"})


def _put_states(
    cache: Any,
    states: RecurrentStates,
    seq: int,
    n: int,
    dtype: torch.dtype,
    device: Callable[[int], torch.device | str | None],
) -> None:
    """Put sequence ``seq``'s linear-attention states into a transformers cache, resuming at token ``n``.

    A gated delta net's conv state: vLLM keeps the last ``kernel - 1``
    inputs as ``[kernel - 1, conv_dim]``, transformers the last ``kernel``
    as ``[conv_dim, kernel]``, whose oldest column its decode step drops
    before use (so it is left zero). The recurrent state has one layout on
    both sides, ``[v_heads, k_dim, v_dim]``; transformers keeps it in float32.
    ``device(layer)`` says where model layer ``layer``'s states go (``None``:
    where the snapshot's are).

    Raises:
        HurrayFormatError: (field ``snapshot.states``) the states were taken
            at another token than ``n``, or are of a kind or layout not
            converted here.
    """
    if states.positions[seq] != n:
        raise HurrayFormatError(
            "snapshot.states",
            f"sequence {seq}'s linear-attention states were taken after {states.positions[seq]} tokens; "
            f"they cannot resume at token {n}",
        )
    if states.kind not in _STATE_KINDS or states.layout:
        raise HurrayFormatError(
            "snapshot.states",
            f"{states.kind!r} states in layout {states.layout!r}; this adapter reads {sorted(_STATE_KINDS)} "
            "in the format's layout ('')",
        )
    for layer, (conv, ssm) in zip(states.layers, states.tensors, strict=True):
        c = conv[seq].transpose(0, 1).to(dtype)  # [conv_dim, kernel - 1]
        c = torch.cat([torch.zeros_like(c[:, :1]), c], dim=1).unsqueeze(0)
        r = ssm[seq].to(torch.float32).unsqueeze(0)
        if (dest := device(layer)) is not None:
            c, r = c.to(dest), r.to(dest)
        cache.update_conv_state(c, layer, conv_kernel_size=c.shape[-1])
        cache.update_recurrent_state(r, layer)


def _check_windows_held(snapshot: KVSnapshot, seq: int, n: int) -> None:
    """Refuse to resume at token ``n`` when a sliding-window layer no longer holds the window it needs.

    The token at position ``n`` attends ``n - size + 1 .. n``; a layer that
    holds its tokens only from ``kv_start`` needs ``kv_start <= n - size + 1``.
    """
    win = snapshot.windows
    if win is None:
        return
    for i, (size, row) in enumerate(zip(win.sizes, win.kv_start)):
        if size is not None and row[seq] > max(0, n - size + 1):
            raise HurrayFormatError(
                "snapshot.windows",
                f"layer {i} holds sequence {seq} from token {row[seq]}, but resuming at token {n} with a window "
                f"of {size} needs it from {max(0, n - size + 1)}",
            )


def _config_windows(model_config: Any) -> list[int | None] | None:
    """Per layer, the sliding window a transformers config gives it (``None``: full), or ``None`` if it says nothing."""
    cfg = _text_config(model_config)
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:  # Qwen2 records a window it does not use
        return None
    types = _cached_layer_types(cfg)  # a layer sharing another's KV (Gemma3n) has no window of its own
    if not types:  # Mistral-style: every layer slides
        return [int(window)] * (int(getattr(cfg, "num_hidden_layers", 0) or 0) - _shared_kv_layers(cfg))
    return [int(window) if t == "sliding_attention" else None for t in types]


def _new_dynamic_cache(cls: Any, model_config: Any) -> Any:
    if model_config is None:
        return cls()
    try:
        return cls(config=model_config)
    except TypeError:  # transformers < 4.56 takes no config
        return cls()


def _device_and_dtype(model: Any) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype


def _decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers, in order (``[]`` when they cannot be found).

    transformers' ``get_decoder()`` gives the text model (a multimodal
    model's language model included), whose ``layers`` they are; otherwise
    the first ``...layers`` module list of the text config's length.
    """
    get = getattr(model, "get_decoder", None)
    try:
        layers = getattr(get(), "layers", None) if callable(get) else None
    except (AttributeError, NotImplementedError, TypeError):
        layers = None
    if isinstance(layers, torch.nn.ModuleList):
        return list(layers)
    count = getattr(_text_config(model.config), "num_hidden_layers", None)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.endswith("layers") and len(mod) == count:
            return list(mod)
    return []


#: Attributes of the modules that own a cache layer (by their ``layer_idx``): an attention's key projection, an MLA
#: attention's latent one, a linear attention's convolution.
_CACHE_OWNER_ATTRS = ("k_proj", "kv_b_proj", "conv1d")


def _layer_devices(model: Any) -> list[torch.device] | None:
    """Per cache layer, the device its decoder layer computes on, when the layers are on more than one; else ``None``.

    A model loaded with ``device_map`` computes each layer where its weights
    are (accelerate's hook says where for an offloaded one, whose weights wait
    on ``meta``), and its attention concatenates the cache with new keys there:
    a layer's cache must be on that device. A decoder layer may own more than
    one cache layer (LongCat-Flash's two MLA sublayers, ``layer_idx`` ``2i``
    and ``2i + 1``): cache layer ``k`` goes where the decoder layer whose
    attention has ``layer_idx == k`` is, or, when the attentions do not say,
    where decoder layer ``k * decoder layers // cache layers`` is.
    """
    decoders = _decoder_layers(model)
    found: list[torch.device | None] = []
    for layer in decoders:
        run = getattr(getattr(layer, "_hf_hook", None), "execution_device", None)
        if run is None:
            weight = next(itertools.chain(layer.parameters(), layer.buffers()), None)
            run = weight.device if weight is not None else None
        found.append(torch.device(run) if run is not None else None)
    known = [d for d in found if d is not None]
    if len(set(known)) < 2:
        return None
    # A layer without weights (none in practice) keeps the cache where the layer before it is.
    out: list[torch.device] = []
    for d in found:
        out.append(d if d is not None else (out[-1] if out else known[0]))
    owners: dict[int, torch.device] = {}
    for layer, on in zip(decoders, out, strict=True):
        for mod in layer.modules():
            idx = getattr(mod, "layer_idx", None)
            if isinstance(idx, int) and any(hasattr(mod, a) for a in _CACHE_OWNER_ATTRS):
                owners.setdefault(idx, on)
    count = int(getattr(_text_config(model.config), "num_hidden_layers", 0) or 0)  # cache layers
    if count and all(k in owners for k in range(count)):
        return [owners[k] for k in range(count)]
    if count > len(out) and count % len(out) == 0:
        return [out[k * len(out) // count] for k in range(count)]
    return out


def _architecture(model: Any) -> str | None:
    archs = getattr(model.config, "architectures", None)
    return None if archs else type(model).__name__


def _resume(model: Any, snapshot: KVSnapshot, seq: int) -> tuple[Any, list[int], int, torch.device]:
    """Check the snapshot against ``model`` and load sequence ``seq``'s KV.

    Returns the cache, the tokens to feed first (those without KV), the
    position of the first of them, and the model's device (its first
    weights', where the inputs go). Each layer's cache is on that layer's
    device (:func:`_layer_devices`).
    """
    if not snapshot.token_ids:
        raise HurrayFormatError("snapshot.token_ids", "the snapshot carries no token ids to continue from")
    seq = _check_seq(snapshot, seq)
    ids = list(snapshot.token_ids[seq])
    n = snapshot.seq_lens[seq]
    if len(ids) < n:
        raise HurrayFormatError("snapshot.token_ids", f"sequence {seq} has {n} tokens of KV but {len(ids)} token ids")
    if not ids:
        raise HurrayFormatError("snapshot.token_ids", f"sequence {seq} is empty: there is nothing to continue")
    media = _mrope_media_tokens(model, ids)
    if media:
        # The continuation feeds positions n, n+1...; after images the engine's are n + mrope_delta.
        raise HurrayFormatError(
            "snapshot.token_ids",
            f"sequence {seq} holds image/video tokens {media} of an M-RoPE model (mrope_section): its next "
            "positions are offset by the media's grid (vLLM's mrope_delta), which the snapshot does not carry; "
            "only text-only sequences of such a model continue here",
        )
    # The model needs the logits after the last token. When every token has KV
    # (no sampled token pending), recompute the last one from the others' KV.
    start = n if len(ids) > n else n - 1
    if snapshot.states is not None and start != n:
        # A recurrent state cannot be rewound by a token.
        raise HurrayFormatError(
            "snapshot.token_ids",
            f"sequence {seq}: a linear-attention snapshot continues from a pending token; every token has KV here",
        )
    device, dtype = _device_and_dtype(model)
    cache = to_dynamic_cache(
        snapshot,
        seq,
        model_config=model.config,
        dtype=dtype,
        device=_layer_devices(model) or device,
        length=start,
        architecture=_architecture(model),
    )
    vocab = _vocab_size(model)
    # After the model check (another model's snapshot is named as such); only the ids fed, which index the
    # embedding: past it, an IndexError on the CPU, a device-side assert that breaks the context on CUDA.
    if vocab is not None and (top := max(ids[start:])) >= vocab:
        raise HurrayFormatError(
            "snapshot.token_ids",
            f"sequence {seq}: token id {top} is outside the model's vocabulary of {vocab} ids: the ids are another "
            "tokenizer's (another model's snapshot?)",
        )
    return cache, ids[start:], start, device


def _vocab_size(model: Any) -> int | None:
    """How many token ids ``model`` embeds: its input embedding's rows, else its text config's ``vocab_size``."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        rows = getattr(get(), "num_embeddings", None) if callable(get) else None
    except (AttributeError, NotImplementedError, TypeError):
        rows = None
    if isinstance(rows, int):
        return rows
    size = getattr(_text_config(model.config), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


#: Config fields naming a multimodal prompt's placeholder tokens, whose M-RoPE positions are not a count.
_MEDIA_TOKEN_FIELDS = ("image_token_id", "video_token_id", "audio_token_id")


def _config_says_mrope(cfg: Any) -> bool:
    """Whether a text config names an ``mrope_section`` in ``rope_parameters`` (``rope_scaling``), or per layer type."""
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if not isinstance(rope, dict):
        return False
    per_type = [r for r in rope.values() if isinstance(r, dict)]
    return any("mrope_section" in r for r in (rope, *per_type))


def _uses_mrope(model: Any) -> bool:
    """Whether ``model`` positions its tokens with M-RoPE, by its config or by its own modules.

    Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4V configs may leave
    ``mrope_section`` out: their rotary embedding then takes a default one
    in code (an ``mrope_section`` attribute), and the model computes the
    media's positions in ``get_rope_index``. Either marks an M-RoPE model.
    """
    if _config_says_mrope(_text_config(model.config)):
        return True
    return any(
        getattr(m, "mrope_section", None) is not None or callable(getattr(m, "get_rope_index", None))
        for m in model.modules()
    )


def _mrope_media_tokens(model: Any, ids: Sequence[int]) -> list[int]:
    """The media placeholder ids in ``ids`` when the model uses M-RoPE (Qwen2.5-VL, Qwen3-VL...); else ``[]``.

    Such a model's text positions after an image or video run on from the
    media's grid, not from the token count (vLLM's ``mrope_delta``), and a
    text-only prompt's are the plain count (:func:`_uses_mrope` says which
    models). The placeholder ids are the composite config's (or the text
    config's).
    """
    model_config = model.config
    cfg = _text_config(model_config)
    media = {
        int(tok)
        for c in (model_config, cfg)
        for name in _MEDIA_TOKEN_FIELDS
        if isinstance(tok := getattr(c, name, None), int)
    }
    held = media & set(ids)
    # Only when some are held: a text-only sequence continues whatever the model, and needs no walk of its modules.
    return sorted(held) if held and _uses_mrope(model) else []


def _greedy(model: Any, snapshot: KVSnapshot, seq: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Check, load the cache, and return an endless iterator of (greedy token, float32 ``[vocab]`` logits)."""
    cache, first, start, device = _resume(model, snapshot, seq)

    def steps() -> Iterator[tuple[int, torch.Tensor]]:
        feed, pos, past = first, start, cache
        while True:
            input_ids = torch.tensor([feed], dtype=torch.long, device=device)
            position_ids = torch.arange(pos, pos + len(feed), device=device).unsqueeze(0)
            # no_grad around the call only: a suspended generator must not leave grad mode off for its caller.
            with torch.no_grad():
                out = model(input_ids=input_ids, position_ids=position_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            token = int(logits.argmax())
            yield token, logits
            pos += len(feed)
            feed = [token]

    return steps()


def next_token_logits(model: Any, snapshot: KVSnapshot, seq: int) -> torch.Tensor:
    """float32 ``[vocab]`` logits for the token after ``snapshot.token_ids[seq]``.

    Computed by ``model`` (a transformers causal LM) from the snapshot's KV
    plus the pending tokens, as :func:`continue_generation` does for its
    first step.
    """
    return next(_greedy(model, snapshot, seq))[1]


def teacher_forced_logits(model: Any, snapshot: KVSnapshot, seq: int, tokens: Sequence[int]) -> torch.Tensor:
    """``model``'s logits at each of ``tokens``, fed after sequence ``seq`` of ``snapshot`` (teacher forcing).

    The snapshot's KV is loaded as :func:`continue_generation` loads it; the
    pending tokens and ``tokens[:-1]`` are then fed in one forward, so row
    ``i`` holds the logits for the position of ``tokens[i]`` given
    ``tokens[:i]``, whatever the model itself would have picked before it.
    That is what :func:`hurray_vllm.agreement.greedy_agreement` compares
    another engine's greedy tokens against.

    Args:
        model: a transformers causal LM, in eval mode.
        snapshot: the snapshot holding the sequence.
        seq: the sequence's index.
        tokens: the continuation to score, those that follow ``token_ids[seq]``.

    Returns:
        float32 ``[len(tokens), vocab]``.

    Raises:
        HurrayFormatError: the snapshot does not fit the model or has no token ids, or,
            for an M-RoPE model (Qwen2.5-VL...), the sequence holds image or video
            tokens (field ``snapshot.token_ids``: its positions are not a count), or
            token ids to feed outside the model's vocabulary (field ``snapshot.token_ids``).
        HurrayArgumentError: ``tokens`` holding an id outside the model's vocabulary
            (field ``tokens``), ``seq`` outside the batch (field ``seq``, also an ``IndexError``).
        OSError: ``ENOMEM``: the dense KV is larger than the device's memory.

    Example:
        >>> from hurray_vllm.agreement import greedy_agreement
        >>> logits = teacher_forced_logits(model, snap, 0, vllm_tokens)  # doctest: +SKIP
        >>> greedy_agreement(logits, vllm_tokens).ok  # doctest: +SKIP
        True
    """
    vocab = _vocab_size(model)
    # Fed (or scored) past the embedding: a bare IndexError on the CPU, a device-side assert on CUDA.
    if tokens and vocab is not None and not 0 <= min(tokens) <= max(tokens) < vocab:
        i, bad = next((i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab)
        raise HurrayArgumentError(
            "tokens",
            f"tokens[{i}] = {bad} is outside the model's vocabulary of {vocab} ids (0..{vocab - 1}): "
            "pass ids of this model's tokenizer",
        )
    cache, first, start, device = _resume(model, snapshot, seq)  # checks the snapshot even for no tokens
    if not tokens:
        return torch.empty(0, int(getattr(model.config, "vocab_size", 0)))
    feed = [*first, *(int(t) for t in tokens[:-1])]
    input_ids = torch.tensor([feed], dtype=torch.long, device=device)
    position_ids = torch.arange(start, start + len(feed), device=device).unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True)
    return out.logits[0, len(first) - 1 :].float()


def check_continuation(
    model: Any, snapshot: KVSnapshot, seq: int, tokens: Sequence[int], *, ulps: int = DEFAULT_ULPS
) -> Agreement:
    """Does ``model``, resumed from the snapshot, agree with another engine's greedy ``tokens``?

    The margin-aware rule of :mod:`hurray_vllm.agreement` over
    :func:`teacher_forced_logits`, with the margin in ulps of the model's
    dtype. Use it where the two engines compute with different arithmetic;
    where they compute the same, compare :func:`continue_generation`'s
    tokens exactly.

    Args:
        model: a transformers causal LM, in eval mode.
        snapshot: the snapshot holding the sequence (taken from the other engine).
        seq: the sequence's index.
        tokens: the other engine's greedy tokens after ``token_ids[seq]``.
        ulps: the margin (see :func:`hurray_vllm.agreement.logit_margin`).

    Returns:
        An :class:`~hurray_vllm.agreement.Agreement`; ``ok`` is the verdict.

    Example:
        >>> report = check_continuation(model, snap, 0, vllm_tokens)  # doctest: +SKIP
        >>> report.ok, report.describe()  # doctest: +SKIP
        (True, '10/10 tokens are the argmax')
    """
    logits = teacher_forced_logits(model, snapshot, seq, tokens)
    return greedy_agreement(logits, tokens, dtype=_device_and_dtype(model)[1], ulps=ulps)


def continue_generation(
    model: Any,
    snapshot: KVSnapshot,
    seq: int,
    max_new_tokens: int,
    *,
    eos_token_id: int | Sequence[int] | torch.Tensor | None = None,
) -> list[int]:
    """Greedily continue sequence ``seq`` of ``snapshot`` with ``model``.

    The snapshot's KV (``seq_lens[seq]`` tokens) is loaded with
    :func:`to_dynamic_cache` (checked against ``model.config``, converted
    to the model's dtype and device); the tokens that have none yet
    (``token_ids[seq][seq_lens[seq]:]``, typically the last sampled one)
    are fed at their positions, then the model decodes greedily (argmax,
    one token per forward).

    Args:
        model: a transformers causal LM (``LlamaForCausalLM``...), in eval mode.
        snapshot: the snapshot holding the sequence.
        seq: the sequence's index.
        max_new_tokens: how many tokens to generate (an ``int >= 0``).
        eos_token_id: stop after generating this token (or any of these: a
            sequence or a tensor of ids, as ``generation_config.eos_token_id``
            may be); default: never stop early (vLLM's ``ignore_eos``).

    Returns:
        The generated token ids, those that follow ``token_ids[seq]``.

    Raises:
        HurrayFormatError: the snapshot does not fit the model or has no token ids, or,
            for an M-RoPE model (Qwen2.5-VL...), the sequence holds image or video
            tokens (field ``snapshot.token_ids``: its positions are not a count), or
            token ids to feed outside the model's vocabulary (field ``snapshot.token_ids``).
        HurrayArgumentError: ``max_new_tokens`` not an integer or below 0 (field
            ``max_new_tokens``), an ``eos_token_id`` that is no token id or ids (field
            ``eos_token_id``), ``seq`` outside the batch (field ``seq``, also an ``IndexError``).
        OSError: ``ENOMEM``: the dense KV is larger than the device's memory.

    Example:
        A tiny random Llama: prefill in transformers, page the cache, and
        continue from the snapshot as ``generate`` would have:

        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
        ...                   num_key_value_heads=2, intermediate_size=128, vocab_size=100)
        >>> model = LlamaForCausalLM(cfg).eval()
        >>> prompt = [1, 5, 9, 12]
        >>> with torch.no_grad():
        ...     out = model(torch.tensor([prompt]), use_cache=True)
        >>> first = int(out.logits[0, -1].argmax())  # sampled, no KV yet: the continuation feeds it
        >>> snap = from_transformers(out.past_key_values, [prompt + [first]], model_config=cfg)
        >>> tokens = continue_generation(model, snap, 0, 5)
        >>> unmoved = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        >>> [first, *tokens] == unmoved[0, 4:].tolist()
        True
    """
    max_new_tokens = integer_arg(max_new_tokens, "max_new_tokens", 0)
    stop = _stop_tokens(eos_token_id)
    steps = _greedy(model, snapshot, seq)  # checks the snapshot against the model even for 0 tokens
    out: list[int] = []
    if max_new_tokens == 0:
        return out
    for token, _ in steps:
        out.append(token)
        if len(out) >= max_new_tokens or token in stop:
            break
    return out


# ── transformers → snapshot ────────────────────────────────────────────────


def _cache_layers(
    past_key_values: Any, latent: LatentSplit | None = None, *, split_pairs: bool = False
) -> list[tuple[torch.Tensor, ...]]:
    """Per layer ``(keys, values)``, each ``[batch, kv_heads, T, head_dim]``.

    With ``latent`` (an MLA model), per layer ``(fused,)``: the cached
    compressed KV and k_pe joined into ``[batch, 1, T, kv_lora_rank + rope_dim]``;
    ``split_pairs``: the cache holds k_pe with its rotary pairs split (:func:`_pairs_split`).
    """
    layers = getattr(past_key_values, "layers", None)
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    if layers is not None:  # transformers >= 4.56 Cache
        for i, layer in enumerate(layers):
            if hasattr(layer, "recurrent_states"):
                raise HurrayFormatError(
                    "past_key_values",
                    f"layer {i} is a linear-attention layer ({type(layer).__name__}); from_transformers pages "
                    "attention KV only and does not export recurrent states",
                )
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4:
                raise HurrayFormatError(
                    "past_key_values", f"layer {i} ({type(layer).__name__}) holds no [batch, heads, T, dim] KV"
                )
            # A static sliding-window layer counts its tokens in a Python int; its tensor count stops when full.
            seen = getattr(layer, "cumulative_length_int", None)
            if not isinstance(seen, int):
                seen = getattr(layer, "cumulative_length", None)
            if isinstance(seen, torch.Tensor):
                seen = int(seen.max()) if seen.numel() else 0
            if isinstance(seen, int) and seen > k.shape[2]:
                raise HurrayFormatError(
                    "past_key_values",
                    f"layer {i} ({type(layer).__name__}) is a sliding-window layer that keeps only the last "
                    f"{k.shape[2]} of {seen} tokens' KV; a snapshot needs every token's KV",
                )
            if isinstance(seen, int) and seen != k.shape[2]:
                # A static layer preallocates its slots: those past the tokens seen hold no KV yet.
                raise HurrayFormatError(
                    "past_key_values",
                    f"layer {i} ({type(layer).__name__}) is a preallocated (static) layer of {k.shape[2]} slots "
                    f"holding {seen} tokens; page a DynamicCache, or its first {seen} slots as "
                    "((keys, values), ...) tuples",
                )
            out.append((k, v))
    elif isinstance(past_key_values, (list, tuple)):  # legacy ((k, v), ...) per layer
        for i, entry in enumerate(past_key_values):
            if not isinstance(entry, (list, tuple)) or len(entry) < 2:
                raise HurrayFormatError("past_key_values", f"layer {i} is not a (keys, values) pair")
            k, v = entry[0], entry[1]
            if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
                raise HurrayFormatError("past_key_values", f"layer {i} does not hold tensors")
            out.append((k, v))
    else:
        raise HurrayFormatError(
            "past_key_values", f"expected a transformers Cache or ((keys, values), ...), got {type(past_key_values)}"
        )
    if not out:
        raise HurrayFormatError("past_key_values", "the cache holds no layers (was it used in a forward pass?)")
    if latent is not None:
        return _fuse_latents(out, latent, split_pairs=split_pairs)
    shape = tuple(out[0][0].shape)
    for i, (k, v) in enumerate(out):
        if k.dim() != 4 or tuple(k.shape) != shape or tuple(v.shape) != shape:
            raise HurrayFormatError(
                "past_key_values",
                f"layer {i} holds keys {tuple(k.shape)} and values {tuple(v.shape)}; "
                f"every layer must hold [batch, kv_heads, T, head_dim] = {shape} for both",
            )
        if k.dtype != out[0][0].dtype or v.dtype != k.dtype:
            raise HurrayFormatError("past_key_values", f"layer {i} mixes dtypes {k.dtype} and {v.dtype}")
    return list(out)


def _fuse_latents(
    layers: list[tuple[torch.Tensor, torch.Tensor]], latent: LatentSplit, *, split_pairs: bool = False
) -> list[tuple[torch.Tensor, ...]]:
    """An MLA cache's layers as one ``[batch, 1, T, rank + rope]`` latent each (the engine's order)."""
    first = layers[0][0]
    out: list[tuple[torch.Tensor, ...]] = []
    for i, (c, pe) in enumerate(layers):
        want_c = (first.shape[0], 1, first.shape[2], latent.kv_lora_rank)
        want_pe = (first.shape[0], 1, first.shape[2], latent.rope_dim)
        if c.dim() != 4 or tuple(c.shape) != want_c or tuple(pe.shape) != want_pe or pe.dtype != c.dtype:
            raise HurrayFormatError(
                "past_key_values",
                f"layer {i} holds {tuple(c.shape)} and {tuple(pe.shape)}; an MLA cache holds the compressed KV "
                f"{want_c} and the rotated k_pe {want_pe} of one dtype",
            )
        out.append((torch.cat([c, _join_pairs(pe) if split_pairs else pe], dim=-1),))
    return out


def _token_positions(
    batch: int, total: int, seq_lens: Sequence[int] | torch.Tensor | None, attention_mask: torch.Tensor | None
) -> list[torch.Tensor]:
    """Per sequence, the cache slots (int64 indices into ``T``) that hold its tokens, in order."""
    # Both describe the caller's batch, not the cache's data: a mistake in either is an argument error.
    if seq_lens is not None and attention_mask is not None:
        raise ImportArgumentError("seq_lens", "pass seq_lens (right padding) or attention_mask (any padding), not both")
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask)
        if mask.dim() != 2 or tuple(mask.shape) != (batch, total):
            raise ImportArgumentError(
                "attention_mask",
                f"expected [batch, T] = [{batch}, {total}] (the cached tokens), got {list(mask.shape)}",
            )
        return [torch.nonzero(mask[b].cpu() != 0).reshape(-1) for b in range(batch)]
    if seq_lens is None:
        return [torch.arange(total) for _ in range(batch)]
    # integer_arg, not int(): a float length (2.9) would be truncated to a shorter sequence without a word.
    lens = [
        integer_arg(x, "seq_lens", error=ImportArgumentError)
        for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)
    ]
    if len(lens) != batch:
        raise ImportArgumentError("seq_lens", f"{len(lens)} lengths for a batch of {batch}")
    for b, n in enumerate(lens):
        if not 0 <= n <= total:
            raise ImportArgumentError("seq_lens", f"sequence {b} has length {n}, the cache holds {total} tokens")
    return [torch.arange(n) for n in lens]


def _token_lists(
    token_ids: Sequence[Sequence[int]] | torch.Tensor, positions: list[torch.Tensor], total: int
) -> list[tuple[int, ...]]:
    """Per sequence, its token ids: a tensor's padding dropped where its columns line up with the cache's.

    A ``[batch, W]`` tensor is the padded batch when ``W == T``, or when
    ``W > T`` and some sequence has padding (``generate``'s output: the
    padded input, then the sampled columns). Its first ``T`` columns are
    the cache's, of which ``positions`` keeps each sequence's own; columns
    ``T..W-1`` follow as sampled tokens. Narrower tensors and lists are
    taken row by row (a padded row is at least ``T`` wide).

    Raises:
        HurrayArgumentError: (field ``token_ids``) a ``[batch, W > T]``
            tensor where every sequence has the same padding, so unpadded
            rows with ``W - n`` sampled tokens would fit it as well.
        HurrayFormatError: (field ``token_ids``) a tensor that is not
            ``[batch, tokens]``, or fewer ids than tokens with KV.
        ImportArgumentError: (field ``token_ids``) an id that is not an
            integer (a float, a string, a bool).
    """
    batch = len(positions)
    if isinstance(token_ids, torch.Tensor):
        ids = token_ids.reshape(1, -1) if token_ids.dim() == 1 else token_ids
        if ids.dim() != 2 or ids.shape[0] != batch:
            raise HurrayFormatError("token_ids", f"expected [batch={batch}, tokens], got {list(token_ids.shape)}")
        rows = ids.cpu().tolist()
        width = int(ids.shape[1])
        lens = [int(p.numel()) for p in positions]
        padded = any(n != total for n in lens)
        if width > total and padded and len(set(lens)) == 1:
            raise HurrayArgumentError(
                "token_ids",
                f"a [{batch}, {width}] tensor for a cache of {total} tokens, every sequence holding {lens[0]} "
                f"(attention_mask / seq_lens): it may be the padded batch and {width - total} sampled columns, "
                f"or unpadded ids and {width - lens[0]} sampled tokens; pass per-sequence lists instead",
            )
        if width == total or (width > total and padded):
            # The padded batch as fed to the model (then generate's sampled columns, which have no KV):
            # keep each sequence's own cached tokens, then the columns after the cache's.
            rows = [[row[j] for j in positions[b].tolist()] + row[total:] for b, row in enumerate(rows)]
    else:
        rows = [list(r) for r in token_ids]
        if len(rows) != batch:
            raise HurrayFormatError("token_ids", f"{len(rows)} token lists for a batch of {batch}")
    out = []
    for b, row in enumerate(rows):
        n = int(positions[b].numel())
        if len(row) < n:
            raise HurrayFormatError("token_ids", f"sequence {b} has {n} tokens of KV but {len(row)} token ids")
        row_ids = []
        for t in row:
            try:
                # int() took 1.5 as 1 and "5" or True as ids: the chunks were keyed by another prefix.
                row_ids.append(plain_int(t))
            except TypeError:
                raise ImportArgumentError(
                    "token_ids", f"sequence {b} holds {t!r}, not an integer token id; pass ints or an integer tensor"
                ) from None
        out.append(tuple(row_ids))
    return out


def from_transformers(
    past_key_values: Any,
    token_ids: Sequence[Sequence[int]] | torch.Tensor,
    *,
    page_size: int = 16,
    fingerprint: ModelFingerprint | None = None,
    model_config: Any = None,
    dtype: torch.dtype | None = None,
    seq_lens: Sequence[int] | torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    request_ids: Sequence[str] | None = None,
    share_pages: bool = True,
) -> KVSnapshot:
    """Page a transformers cache into a :class:`~hurray_vllm.KVSnapshot`.

    Args:
        past_key_values: a ``transformers.Cache`` (``DynamicCache``: per layer
            ``.keys``/``.values``) or a legacy ``((keys, values), ...)`` tuple;
            each tensor ``[batch, kv_heads, T, head_dim]``, post-RoPE keys,
            any float dtype. Sliding-window layers (which drop old tokens)
            are refused.
        token_ids: per sequence, its token ids without padding: those with KV,
            optionally followed by the sampled tokens that have none yet (a
            continuation feeds them). A ``[batch, T]`` tensor of the padded
            model input is accepted too: its padding is dropped by
            ``seq_lens`` / ``attention_mask``. So is a padded ``[batch, W > T]``
            tensor (``generate``'s output: the padded input, then sampled
            columns): its first ``T`` columns are the cache's, whose padding
            is dropped, and the columns after them are every sequence's
            sampled tokens. A tensor narrower than ``T``, or one without
            padding, is read row by row.
        page_size: tokens per page.
        fingerprint: the model's fingerprint (see :func:`fingerprint_from_config`);
            checked against the cache's geometry and dtype.
        model_config: alternatively, the model's ``PretrainedConfig``; the
            fingerprint is then derived from it. An MLA model's cache needs
            it (its latent split, and a ``rope_interleave`` model's k_pe
            order, which is put back into the engine's).
        dtype: the pools' storage dtype (default: the cache's). fp8 is refused
            (it would need scales).
        seq_lens: for a right-padded batch, each sequence's token count
            (``<= T``); its KV is ``[..., :seq_lens[b], :]``.
        attention_mask: for a padded batch (left or right), ``[batch, T]``
            nonzero on real tokens. The KV must have been computed at
            positions ``0..n-1`` of each sequence (as ``generate`` does
            with ``position_ids`` derived from the mask).
        request_ids: names for the sequences.
        share_pages: let sequences reference one page when their token
            prefixes up to its end are equal and its KV is bit-identical in
            every layer and role (full pages only).

    Returns:
        A snapshot with per-sequence ``seq_lens``, zeroed slots past every
        sequence's end, each layer's pools on its cache layer's device (a
        ``device_map`` model's on several), a ``SnapshotSource`` of engine
        ``"transformers <version>"``.

    Raises:
        HurrayFormatError: inconsistent shapes, lengths, token ids, or a
            fingerprint that does not match the cache; (field
            ``model_config``) a config with layers of a type other than full,
            sliding-window, chunked or linear attention (DeepSeek-V4's
            compressed attention...), whose cache holds other than KV, or an
            MLA model with linear-attention layers (Kimi Linear).
        HurrayArgumentError: (field ``token_ids``) a ``[batch, W > T]``
            tensor where every sequence has the same padding: padded input
            and sampled columns cannot be told from unpadded rows (pass
            per-sequence lists) or a token id that is not an integer (a
            float, a string, a bool); a ``page_size`` that is not an integer
            ``>= 1``, or that pads the batch's tokens into more than
            :data:`~hurray_vllm.kv.repage.MAX_IMPORT_SLOTS` slots or more
            memory than the device has, a ``dtype`` that is not a torch dtype or cannot store
            the cache, ``seq_lens`` or ``attention_mask`` that do not fit the
            batch (or both), ``request_ids`` of another count (each field
            named after its argument).
        OSError: ``ENOMEM``, the cache's tokens alone need more memory than
            the device has (:func:`~hurray_vllm.kv.repage.check_memory`).
    """
    page_size = integer_arg(page_size, "page_size", 1, ImportArgumentError)
    if dtype is not None and not isinstance(dtype, torch.dtype):  # a name ("float16"): no is_floating_point
        raise ImportArgumentError("dtype", f"expected a torch dtype (torch.bfloat16, torch.float32...), got {dtype!r}")
    if model_config is not None:
        _refuse_unhandled_layers(model_config, "cannot be paged from its cache")
    latent = config_geometry(model_config).latent if model_config is not None else None
    layers = _cache_layers(past_key_values, latent, split_pairs=latent is not None and _pairs_split(model_config))
    batch, heads, total, head_dim = (int(x) for x in layers[0][0].shape)
    storage = dtype or layers[0][0].dtype
    if not storage.is_floating_point or storage.itemsize == 1:
        why = f"{storage} cannot store a transformers cache here (fp8 would need scales; use bf16/fp16/fp32)"
        if dtype is not None:  # the caller's choice
            raise ImportArgumentError("dtype", why)
        raise HurrayFormatError("dtype", why)  # the cache's own dtype: the data
    dtypes.from_torch(storage)  # a Hurray element type exists for it
    positions = _token_positions(batch, total, seq_lens, attention_mask)
    ids = _token_lists(token_ids, positions, total)
    lens = [int(p.numel()) for p in positions]
    if request_ids is not None and len(request_ids) != batch:
        raise ImportArgumentError("request_ids", f"{len(request_ids)} request ids for a batch of {batch}")

    if fingerprint is None and model_config is not None:
        fingerprint = fingerprint_from_config(model_config, dtype=storage)
    if fingerprint is not None:
        cache = ModelFingerprint(
            fingerprint.architecture, len(layers), heads, head_dim, dtypes.from_torch(storage).name
        )
        bad = fingerprint.mismatches(cache, ignore={"architecture", "weights_digest"}, labels=("fingerprint", "cache"))
        if bad:
            raise HurrayFormatError("fingerprint", "the fingerprint does not describe this cache: " + "; ".join(bad))

    # Lay out pages sequence after sequence; a full page may be shared when it is bit-identical.
    src_seq: list[int] = []  # per physical page: the sequence and first slot it is copied from
    src_start: list[int] = []
    table: list[int] = []
    seq_ptr = [0]
    known: dict[tuple[int, int], list[int]] = {}  # (page index, prefix hash) -> candidate physical pages
    for b in range(batch):
        prefix_hash = 0
        for j in range(-(-lens[b] // page_size)):
            lo, hi = j * page_size, min((j + 1) * page_size, lens[b])
            phys = None
            if share_pages and hi - lo == page_size:
                prefix_hash = hash((prefix_hash, ids[b][lo:hi]))
                for cand in known.get((j, prefix_hash), []):
                    if _same_page(layers, positions, src_seq[cand], b, lo, hi):
                        phys = cand
                        break
                if phys is None:
                    known.setdefault((j, prefix_hash), []).append(len(src_seq))
            if phys is None:
                phys = len(src_seq)
                src_seq.append(b)
                src_start.append(lo)
            table.append(phys)
        seq_ptr.append(len(table))

    num_pages = len(src_seq)
    _check_page_budget(layers, storage, num_pages, page_size, sum(lens))
    # One gather index for every layer: slot (page p, offset o) <- (src_seq[p], positions[...][start + o]).
    flat_b = torch.zeros(num_pages * page_size, dtype=torch.int64)
    flat_t = torch.zeros(num_pages * page_size, dtype=torch.int64)
    valid = torch.zeros(num_pages, dtype=torch.int64)
    for p, (b, lo) in enumerate(zip(src_seq, src_start)):
        hi = min(lo + page_size, lens[b])
        flat_b[p * page_size : p * page_size + hi - lo] = b
        flat_t[p * page_size : p * page_size + hi - lo] = positions[b][lo:hi]
        valid[p] = hi - lo
    # The indices go to each layer's device: a device_map model's cache lies on several, and indexing a tensor
    # with indices on another GPU (or a CPU-offloaded layer with a GPU's) fails.
    index_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    t_table = torch.tensor(table, dtype=torch.int64)
    t_ptr = torch.tensor(seq_ptr, dtype=torch.int64)
    t_lens = torch.tensor(lens, dtype=torch.int64)
    index_type = "uint32" if num_pages < 2**32 else "uint64"
    roles = ("fused",) if latent is not None else ("key", "value")
    paged: list[tuple[BlockPagedTensor, ...]] = []
    for i, members in enumerate(layers):
        row = []
        for src, role in zip(members, roles, strict=True):
            # [B, H, T, D] -> [B, T, H, D], then one gather of every slot.
            if src.device not in index_on:
                index_on[src.device] = (flat_b.to(src.device), flat_t.to(src.device))
            on_b, on_t = index_on[src.device]
            pool = src.detach().transpose(1, 2)[on_b, on_t].to(storage)
            pool = pool.reshape(num_pages, page_size, heads, head_dim).contiguous()
            zero_slots_(pool, valid)
            row.append(BlockPagedTensor(pool, t_table, t_ptr, t_lens, role, i, index_type=index_type))
        paged.append(tuple(row))
    snap = KVSnapshot.from_layers(
        paged,
        latent=latent,
        token_ids=tuple(ids),
        fingerprint=fingerprint,
        source=SnapshotSource(engine=_engine_name(), layout=SOURCE_LAYOUT, page_size=page_size),
        request_ids=tuple(request_ids) if request_ids is not None else None,
    )
    raise_if(snap.validate(), "from_transformers")
    return snap


def _check_page_budget(
    layers: list[tuple[torch.Tensor, ...]], storage: torch.dtype, num_pages: int, page_size: int, tokens: int
) -> None:
    """Refuse pages that would pad ``tokens`` into more slots, or bytes, than an import may allocate, before any is.

    As :func:`~hurray_vllm.kv.repage.plan_repage` does: over a limit only because of the page size asked for
    (five tokens in pages of ``2**40``) is the caller's ``page_size``; over it whatever the page size is the
    cache's own size.

    Raises:
        ImportArgumentError: (field ``page_size``) the padding alone goes over
            :data:`~hurray_vllm.kv.repage.MAX_IMPORT_SLOTS` or the memory of a device.
        HurrayFormatError: the tokens alone go over ``MAX_IMPORT_SLOTS``.
        OSError: ``ENOMEM``, the tokens alone go over a device's memory
            (:func:`~hurray_vllm.kv.repage.check_memory`).
    """
    slots = num_pages * page_size
    repage.check_page_budget(slots, tokens, page_size, "paging the cache")
    # Each device holds the pools of its layers at once (and the host the two int64 gather indices).
    per_slot: dict[torch.device, int] = {torch.device("cpu"): 16}
    for members in layers:
        for t in members:
            per_slot[t.device] = per_slot.get(t.device, 0) + int(t.shape[1]) * int(t.shape[3]) * storage.itemsize
    for device, size in per_slot.items():
        what = f"paging the cache into pages of {page_size}"
        try:
            check_memory(slots * size, what, device)
        except OSError:
            check_memory(tokens * size, what, device)  # too large for this machine whatever the page size
            raise ImportArgumentError(
                "page_size", f"{what} would allocate {slots * size / 2**30:.1f} GiB on {device}; use a smaller one"
            ) from None


def _same_page(
    layers: list[tuple[torch.Tensor, ...]], positions: list[torch.Tensor], a: int, b: int, lo: int, hi: int
) -> bool:
    """Whether slots ``lo:hi`` of sequences ``a`` and ``b`` hold bit-identical KV in every layer and role."""
    pa, pb = positions[a][lo:hi], positions[b][lo:hi]
    for members in layers:
        for t in members:
            x = t[a].index_select(1, pa.to(t.device)).contiguous().view(torch.uint8)
            y = t[b].index_select(1, pb.to(t.device)).contiguous().view(torch.uint8)
            if not torch.equal(x, y):
                return False
    return True


def _engine_name() -> str:
    try:
        import transformers

        return f"transformers {transformers.__version__}"
    except ImportError:  # a cache built without transformers (legacy tuples)
        return "transformers"
