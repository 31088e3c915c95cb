"""The recurrent state of vLLM's linear-attention layers (GDN, Mamba2): where it lives, how to read and write it.

vLLM keeps a hybrid model's linear-attention layers in ``MambaSpec`` KV
cache groups. Each such layer's ``kv_cache`` is a list of state tensors
(for a gated delta net: conv ``[num_blocks, kernel - 1, conv_dim]`` and
recurrent ``[num_blocks, v_heads, v_dim, k_dim]``), indexed by the
group's block ids like pages, but a block holds one whole state, not
tokens.

Which block holds a request's state at ``n`` computed tokens depends on
``mamba_cache_mode``:

* ``"align"`` (prefix caching on, vLLM's default): block ``(n - 1) //
  block_size`` of the group's table; a block ending on a block boundary
  keeps the state at that boundary. Before a step the engine copies the
  previous state block into the step's own (``preprocess_mamba``), so a
  load writes both.
* ``"none"``: the table's first block, always the current state.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import torch

from ...errors import HurrayFormatError
from ...kv.states import RecurrentStates, join_states, part_fraction, state_split
from ...wire import dtypes

__all__ = [
    "StateCache",
    "state_groups",
    "state_cache",
    "state_names",
    "state_block",
    "step_block",
    "declared_layout",
    "model_layer_index",
    "pack_states",
    "join_shares",
]

_LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def model_layer_index(name: str) -> int | None:
    """The model layer a vLLM module name belongs to (``model.layers.3.self_attn.attn`` -> 3), if it says."""
    m = _LAYER_NUMBER.search(name)
    return int(m.group(1)) if m else None


def state_names(count: int) -> tuple[str, ...]:
    """The members of a state layer: vLLM orders them conv state, then SSM (recurrent) state."""
    return ("conv", "ssm")[:count] if count <= 2 else tuple(f"state{i}" for i in range(count))


def state_block(block_ids: Sequence[int], tokens: int, block_size: int, mode: str) -> int:
    """The block of a state group's table holding the state after ``tokens`` computed tokens (0: none).

    Example:
        >>> state_block([0, 7, 9], 768, 384, "align"), state_block([5], 768, 384, "none")
        (7, 5)
    """
    if tokens <= 0 or not block_ids:
        return 0
    i = (tokens - 1) // block_size if mode == "align" else 0
    return int(block_ids[i]) if i < len(block_ids) else 0


def step_block(block_ids: Sequence[int], tokens: int, scheduled: int, block_size: int, mode: str) -> int:
    """The block a step of ``scheduled`` tokens after ``tokens`` keeps its running state in (0: none).

    In "align" mode the engine copies the state from :func:`state_block` into
    it before the step's forward pass (``preprocess_mamba``), which runs
    before a connector's load: a load writes both blocks.
    """
    if mode != "align":
        return 0
    i = (tokens + scheduled + block_size - 1) // block_size - 1
    return int(block_ids[i]) if 0 <= i < len(block_ids) else 0


def state_groups(kv_cache_config: Any) -> dict[str, int]:
    """Each linear-attention (``MambaSpec``) layer's KV cache group, by layer name, in model order (empty for others).

    Model order, not the groups': vLLM deals a model's layers round-robin
    into groups of one page size (``layers[i::num_groups]``), so with more
    than one linear layer per group the groups list them interleaved
    (Qwen3-Next's 0, 4, 8, ... then 1, 5, 9, ...). A snapshot's states are
    the model's layers in order (what transformers and other engines pair
    them by); names without a layer number keep the groups' order.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    found = {
        name: g
        for g, group in enumerate(groups)
        if type(group.kv_cache_spec).__name__ == "MambaSpec"
        for name in group.layer_names
    }
    index: dict[str, int] = {}
    for name in found:
        i = model_layer_index(name)
        if i is None:
            return found
        index[name] = i
    return {name: found[name] for name in sorted(found, key=index.__getitem__)}


def _kind(kv_cache_config: Any) -> str:
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        spec = group.kv_cache_spec
        if type(spec).__name__ == "MambaSpec":
            kind = getattr(spec, "mamba_type", "")
            return str(getattr(kind, "name", kind)).lower()
    return ""


def _transforms(kind: str, members: int) -> tuple[tuple[str, ...], str]:
    """How this engine's state memory maps to the format's layout: per member, and the layout's name.

    Per member ``""`` (as is), ``"T"`` (swap the last two dimensions) or
    ``"V"`` (the memory already is in the format's order; only the declared
    shape's last two dimensions are swapped: a view). A gated delta net's
    conv state is ``[kernel - 1, conv_dim]`` in vLLM's default ("SD") conv
    layout and the transpose under ``VLLM_SSM_CONV_STATE_LAYOUT=DS``. Its
    recurrent state is declared ``[v_heads, v_dim, k_dim]``, which vLLM's
    GPU kernels address as such, while its CPU kernels view the same memory
    as ``[v_heads, k_dim, v_dim]``: transformers' order, the format's. Other
    kinds keep the engine's memory under a layout name only the same engine
    kind loads.
    """
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    from vllm.platforms import current_platform

    conv = get_conv_state_layout()
    if kind == "gdn_attn" and members == 2:
        return ("T" if conv == "DS" else "", "V" if current_platform.is_cpu() else "T"), ""
    return ("",) * members, f"vllm-{current_platform.device_type}-{conv}"


def _swap(shape: Sequence[int], how: str) -> tuple[int, ...]:
    dims = tuple(int(x) for x in shape)
    return (*dims[:-2], dims[-1], dims[-2]) if how and len(dims) >= 2 else dims


def declared_layout(kv_cache_config: Any, tp: int = 1) -> RecurrentStates | None:
    """The states a chunk of this engine's model carries, without tensors (``None``: no linear attention).

    Built from the ``MambaSpec`` groups alone, so the scheduler (which has no
    caches) refuses chunks whose states this engine's workers could not
    load, before any block is touched. At tensor parallelism ``tp`` the
    groups hold one rank's share; the layout is the whole model's (each
    split axis ``tp`` times the share, see
    :func:`~hurray_vllm.kv.states.state_split`), so that chunks saved at any
    degree compare equal.

    Raises:
        HurrayFormatError: (field ``tensor_parallel_size``) ``tp > 1`` with
            states whose split across ranks is not known.
    """
    of_layer = state_groups(kv_cache_config)
    if not of_layer:
        return None
    groups = list(kv_cache_config.kv_cache_groups)
    spec = groups[next(iter(of_layer.values()))].kv_cache_spec
    shapes = [tuple(x) for x in getattr(spec, "shapes", ())]
    names = tuple(of_layer)
    kind = _kind(kv_cache_config)
    how, layout = _transforms(kind, len(shapes))
    state_dtypes = [dtypes.from_torch(d).name for d in getattr(spec, "dtypes", ())]
    attention = [n for g in groups if type(g.kv_cache_spec).__name__ != "MambaSpec" for n in g.layer_names]
    shapes = [_swap(sh, h) for sh, h in zip(shapes, how, strict=True)]
    if tp > 1:
        share = state_split(kind, layout, shapes)
        if share is None:
            raise HurrayFormatError(
                "tensor_parallel_size",
                f"the states of {kind or 'these'} linear-attention layers (layout {layout or 'normalized'}) are not "
                "split across ranks by hurray-vllm; gated delta nets (Qwen3-Next) are",
            )
        shapes = [tuple(d * tp if i == axis else d for i, d in enumerate(sh)) for sh, (axis, _) in zip(shapes, share)]
    return RecurrentStates(
        kind,
        tuple(_model_indices(names)),
        state_names(len(shapes)),
        (),
        declared=tuple(zip(shapes, state_dtypes, strict=True)),
        attention=tuple(sorted(_model_indices(attention))),
        layout=layout,
    )


def _model_indices(names: Sequence[str]) -> list[int]:
    """Model layer indices of vLLM module names, or their order when the names carry none."""
    idx = [model_layer_index(n) for n in names]
    return [i for i in idx if i is not None] if all(i is not None for i in idx) else list(range(len(names)))


@dataclass(frozen=True)
class StateCache:
    """One worker's linear-attention layers: their state tensors and how to find a request's state.

    Attributes:
        spec: the states a chunk carries (:func:`declared_layout`: kind, model
            layer indices, members, shapes and dtypes in the format's layout).
        layer_names: the layers' module names, in model order.
        groups: each layer's KV cache group.
        tensors: per layer, per member, ``[num_blocks, *shape]`` as vLLM holds it.
        transforms: per member, engine memory to the format's layout
            (:func:`_transforms`).
        block_size: tokens per block of the state groups.
        mode: ``mamba_cache_mode`` (``"align"`` or ``"none"``).
        part: at tensor parallelism ``tp`` > 1, the share of the states rank
            ``r`` holds, ``(r, r + 1, tp)`` (vLLM splits their heads over
            every rank, even where it replicates KV heads); ``None``: whole.
    """

    spec: RecurrentStates
    layer_names: tuple[str, ...]
    groups: tuple[int, ...]
    tensors: tuple[tuple[torch.Tensor, ...], ...]
    transforms: tuple[str, ...]
    block_size: int
    mode: str
    part: tuple[int, int, int] | None = None

    @property
    def state_group_ids(self) -> list[int]:
        """The KV cache groups holding states, in order."""
        return sorted(set(self.groups))

    def block_of(self, block_ids: Sequence[int], tokens: int) -> int:
        """The block of one group's table holding the state after ``tokens`` computed tokens (0: none)."""
        return state_block(block_ids, tokens, self.block_size, self.mode)

    def _to_format(self, t: torch.Tensor, m: int) -> torch.Tensor:
        how = self.transforms[m] if m < len(self.transforms) else ""
        if how == "T":
            return t.transpose(-1, -2)
        if how == "V":
            return t.reshape(_swap(t.shape, how))  # contiguous rows of one block: the same memory
        return t

    def _to_engine(self, t: torch.Tensor, m: int) -> torch.Tensor:
        how = self.transforms[m] if m < len(self.transforms) else ""
        if how == "T":
            return t.transpose(-1, -2)
        if how == "V":
            return t.contiguous().reshape(_swap(t.shape, how))
        return t

    def gather(self, blocks: Sequence[dict[int, int]], positions: Sequence[int]) -> RecurrentStates:
        """The states of sequences whose state sits in ``blocks[s][group]``, taken after ``positions[s]`` tokens.

        Copies (a state block is reused as the engine runs on), in the
        format's layout. A sequence with nothing computed yet (position 0)
        gets zeros, the state of an empty prefix, whatever block it names.

        Raises:
            HurrayFormatError: (field ``snapshot.states``) a sequence with
                computed tokens whose state block is missing (vLLM's null
                block); (field ``block_ids``) a block id outside the state
                tensors, found on the host before anything is gathered.
        """
        for s, (b, n) in enumerate(zip(blocks, positions, strict=True)):
            if n > 0 and not all(b.get(g, 0) for g in self.state_group_ids):
                raise HurrayFormatError(
                    "snapshot.states", f"sequence {s}: no state block after {n} tokens (the engine did not keep one)"
                )
        of_group = {g: [int(b.get(g, 0)) for b in blocks] for g in self.state_group_ids}
        self._check_block_ids(of_group, "the block tables do not belong to this engine's caches")
        # Nothing computed: whatever block the caller names holds no state of this sequence (maybe another's).
        nothing = torch.tensor([int(n) <= 0 for n in positions], dtype=torch.bool)
        tensors = []
        for layer, g in zip(self.tensors, self.groups, strict=True):
            ids = torch.tensor(of_group[g], dtype=torch.int64)
            empty = (ids == 0) | nothing
            members = []
            for m, t in enumerate(layer):
                out = self._to_format(t.index_select(0, ids.to(t.device)), m).contiguous().cpu()
                out[empty] = 0
                members.append(out)
            tensors.append(tuple(members))
        states = replace(self.spec, positions=tuple(int(p) for p in positions)).with_tensors(tensors)
        if self.part is None:
            return states
        # The whole states' split (the spec is the whole model's layout; declared_layout refused others).
        split = state_split(self.spec.kind, self.spec.layout, self.spec.shapes) or ()
        return replace(states, split=split, part=self.part)

    def _check_block_ids(self, of_group: dict[int, list[int]], hint: str) -> None:
        """Raise unless every block id of ``of_group`` (ids by KV cache group) is inside its layers' state tensors.

        On the host, before any gather or write: an id past a CUDA tensor is a
        device-side assert, and a layer written before a later one failed
        would leave a half-written state.
        """
        for layer, g in zip(self.tensors, self.groups, strict=True):
            lo, hi = min(of_group[g], default=0), max(of_group[g], default=0)
            num = min((int(t.shape[0]) for t in layer), default=hi + 1)
            if lo < 0 or hi >= num:
                raise HurrayFormatError(
                    "block_ids",
                    f"state block {lo if lo < 0 else hi} of KV cache group {g} is outside its {num} blocks; {hint}",
                )

    @property
    def fraction(self) -> tuple[Fraction, Fraction]:
        """The share of the states this rank holds, as fractions (``(0, 1)``: whole)."""
        return part_fraction(self.part)

    def mismatches(self, states: RecurrentStates) -> list[str]:
        """Why ``states`` cannot be loaded here (empty when they can): another geometry, or another rank's share."""
        diffs = self.spec.mismatches(states)
        if not diffs and states.fraction != self.fraction:
            diffs.append(f"part {states.part or 'whole'}, this rank holds {self.part or 'whole'}")
        return diffs

    def write(self, blocks: Sequence[dict[int, list[int]]], states: RecurrentStates) -> None:
        """Write sequence ``s``'s state into the blocks ``blocks[s][group]`` of each layer's group.

        Raises:
            HurrayFormatError: (field: the first broken rule's, ``snapshot.states...``)
                states inconsistent in themselves (see
                :meth:`~hurray_vllm.kv.states.RecurrentStates.violations`);
                (field ``snapshot.states``) states of another model geometry
                (see :meth:`mismatches`); (field ``block_ids``) a block id
                outside the state tensors. All found on the host before
                anything is written.
        """
        # mismatches() compares layer 0's shapes and dtypes only: a later layer of another shape failed in
        # index_copy_ with the layers before it written, and one of another dtype was silently cast.
        bad = states.violations()
        if bad:
            raise HurrayFormatError.from_violations(bad, "states to write")
        diffs = self.mismatches(states)
        if diffs:
            raise HurrayFormatError("snapshot.states", "states of another model: " + "; ".join(diffs))
        of_group = {g: [int(x) for b in blocks for x in b.get(g, [])] for g in set(self.groups)}
        self._check_block_ids(of_group, "write only blocks the engine allocated to the request")
        for layer, g, src in zip(self.tensors, self.groups, states.tensors, strict=True):
            rows = [s for s, b in enumerate(blocks) for _ in b.get(g, [])]
            ids = of_group[g]
            if not ids:
                continue
            dest = torch.tensor(ids, dtype=torch.int64)
            pick = torch.tensor(rows, dtype=torch.int64)
            every = rows == list(range(len(states.positions)))  # each sequence once, in order: no gather copy
            for m, (t, src_m) in enumerate(zip(layer, src, strict=True)):
                value = self._to_engine(src_m if every else src_m.index_select(0, pick), m)
                t.index_copy_(0, dest.to(t.device), value.to(t.device, t.dtype))


def state_cache(vllm_config: Any, kv_cache_config: Any, part: tuple[int, int, int] | None = None) -> StateCache | None:
    """The linear-attention layers of this worker (``None`` for a model without any).

    ``part``: at tensor parallelism > 1, this rank's share (see :class:`StateCache`).

    Raises:
        HurrayFormatError: (field ``kv_cache_groups``) a state layer whose
            cache is not a list of tensors, or layers that disagree in shape.
    """
    tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    spec = declared_layout(kv_cache_config, tp)
    if spec is None:
        return None
    if (tp > 1) != (part is not None) or (part is not None and (part[2] // (part[1] - part[0])) != tp):
        raise HurrayFormatError(
            "tensor_parallel_size", f"linear-attention states at tensor parallelism {tp} need a share of 1/{tp}: {part}"
        )
    of_layer = state_groups(kv_cache_config)
    ctx = vllm_config.compilation_config.static_forward_context
    names = [n for n in of_layer if n in ctx]
    tensors = []
    for n in names:
        kv = getattr(ctx[n], "kv_cache", None)
        if not isinstance(kv, (list, tuple)) or not kv or not all(isinstance(t, torch.Tensor) for t in kv):
            raise HurrayFormatError("kv_cache_groups", f"{n}: its state cache is not a list of tensors")
        tensors.append(tuple(kv))
    if len(tensors) != len(spec.layers):
        raise HurrayFormatError("kv_cache_groups", f"{len(tensors)} state caches for {len(spec.layers)} state layers")
    if len({tuple((tuple(t.shape[1:]), t.dtype) for t in layer) for layer in tensors}) > 1:
        raise HurrayFormatError("kv_cache_groups", "linear-attention layers hold states of different shapes")
    groups = list(kv_cache_config.kv_cache_groups)
    group_spec = groups[of_layer[names[0]]].kv_cache_spec
    how, _ = _transforms(spec.kind, len(spec.names))
    return StateCache(
        spec=spec,
        layer_names=tuple(names),
        groups=tuple(of_layer[n] for n in names),
        tensors=tuple(tensors),
        transforms=how,
        block_size=int(getattr(group_spec, "block_size", vllm_config.cache_config.block_size)),
        mode=str(getattr(group_spec, "mamba_cache_mode", "none") or "none"),
        part=part,
    )


#: Each member starts at a multiple of this many bytes in a packed buffer, so that it views back as its dtype.
_ALIGN = 16


def _packed_layout(states: RecurrentStates) -> list[tuple[int, int]]:
    """Each member's (offset, bytes) in :func:`pack_states`' buffer, layer after layer."""
    out, at = [], 0
    for layer in states.tensors:
        for t in layer:
            n = t.numel() * t.element_size()
            out.append((at, n))
            at += -(-n // _ALIGN) * _ALIGN
    return out


def pack_states(states: RecurrentStates) -> torch.Tensor:
    """Every state tensor's bytes in one uint8 buffer (members aligned), for one collective.

    Example:
        >>> s = RecurrentStates("gdn_attn", (0,), ("conv", "ssm"), (4,),
        ...     ((torch.ones(1, 1, 3, dtype=torch.bfloat16), torch.ones(1, 1, 1, 1)),))
        >>> pack_states(s).shape
        torch.Size([20])
    """
    where = _packed_layout(states)
    total = where[-1][0] + where[-1][1] if where else 0
    buf = torch.zeros(total, dtype=torch.uint8)
    members = [t for layer in states.tensors for t in layer]
    for (at, n), t in zip(where, members, strict=True):
        buf[at : at + n] = t.contiguous().view(-1).view(torch.uint8)
    return buf


def join_shares(
    template: RecurrentStates, buffers: Sequence[torch.Tensor], heads: tuple[int, int, int] | None
) -> RecurrentStates:
    """The states of the ranks' packed shares (rank ``r``'s: ``buffers[r]``), cut to ``heads``.

    ``template``: this rank's own share (its layout says how to read every
    buffer). ``heads``: ``(start, stop, total)`` of the KV heads the file
    holds (None: every head), whose share of the states it carries.

    Raises:
        HurrayFormatError: (field ``snapshot.states``) buffers of another
            size, or shares that do not join.
    """
    where = _packed_layout(template)
    members = [t for layer in template.tensors for t in layer]
    per = len(template.names)
    tp = len(buffers)
    shares = []
    for r, buf in enumerate(buffers):
        if where and buf.numel() != where[-1][0] + where[-1][1]:
            raise HurrayFormatError("snapshot.states", f"rank {r} sent {buf.numel()} bytes of states")
        tensors = [buf[at : at + n].view(t.dtype).view(t.shape) for (at, n), t in zip(where, members, strict=True)]
        layers = [tensors[j * per : (j + 1) * per] for j in range(len(template.tensors))]
        shares.append(replace(template.with_tensors(layers), part=(r, r + 1, tp)))
    whole = join_states(shares)
    return whole if heads is None else whole.take(*heads)
