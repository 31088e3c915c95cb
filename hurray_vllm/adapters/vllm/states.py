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
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import HurrayFormatError
from ...kv.states import RecurrentStates

__all__ = [
    "StateCache",
    "state_groups",
    "state_cache",
    "state_names",
    "state_block",
    "step_block",
    "model_layer_index",
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
    """Each linear-attention (``MambaSpec``) layer's KV cache group, by layer name (empty for other models)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    return {
        name: g
        for g, group in enumerate(groups)
        if type(group.kv_cache_spec).__name__ == "MambaSpec"
        for name in group.layer_names
    }


def _kind(kv_cache_config: Any) -> str:
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        spec = group.kv_cache_spec
        if type(spec).__name__ == "MambaSpec":
            kind = getattr(spec, "mamba_type", "")
            return str(getattr(kind, "name", kind)).lower()
    return ""


@dataclass(frozen=True)
class StateCache:
    """One worker's linear-attention layers: their state tensors and how to find a request's state.

    Attributes:
        kind: vLLM's ``mamba_type`` (lower case, e.g. ``"gdn_attn"``).
        names: the members of every layer (``("conv", "ssm")``).
        layer_names: the layers' module names, in model order.
        layers: their model layer indices.
        groups: each layer's KV cache group.
        tensors: per layer, per member, ``[num_blocks, *shape]`` as vLLM holds it.
        block_size: tokens per block of the state groups.
        mode: ``mamba_cache_mode`` (``"align"`` or ``"none"``).
    """

    kind: str
    names: tuple[str, ...]
    layer_names: tuple[str, ...]
    layers: tuple[int, ...]
    groups: tuple[int, ...]
    tensors: tuple[tuple[torch.Tensor, ...], ...]
    block_size: int
    mode: str

    @property
    def state_group_ids(self) -> list[int]:
        """The KV cache groups holding states, in order (one per layer in vLLM: several share none)."""
        return sorted(set(self.groups))

    def block_of(self, block_ids: Sequence[int], tokens: int) -> int:
        """The block of one group's table holding the state after ``tokens`` computed tokens (0: none)."""
        return state_block(block_ids, tokens, self.block_size, self.mode)

    def gather(self, blocks: Sequence[dict[int, int]], positions: Sequence[int]) -> RecurrentStates:
        """The states of sequences whose state sits in ``blocks[s][group]``, taken after ``positions[s]`` tokens.

        Copies (a state block is reused as the engine runs on). A sequence
        without a state block (none computed yet) gets zeros, the state of
        an empty prefix.
        """
        tensors = []
        for layer, g in zip(self.tensors, self.groups, strict=True):
            ids = torch.tensor([b.get(g, 0) for b in blocks], dtype=torch.int64)
            members = []
            for t in layer:
                out = t.index_select(0, ids.to(t.device)).cpu()
                empty = ids == 0
                if bool(empty.any()):
                    out[empty] = 0
                members.append(out)
            tensors.append(tuple(members))
        return RecurrentStates(self.kind, self.layers, self.names, tuple(int(p) for p in positions), tuple(tensors))

    def mismatches(self, states: RecurrentStates) -> list[str]:
        """Why ``states`` cannot be loaded here (empty when they can)."""
        out = []
        if states.kind != self.kind:
            out.append(f"kind: {states.kind!r}, here {self.kind!r}")
        if tuple(states.layers) != self.layers:
            out.append(f"layers: {list(states.layers)}, here {list(self.layers)}")
        if tuple(states.names) != self.names:
            out.append(f"members: {list(states.names)}, here {list(self.names)}")
        mine = tuple((tuple(t.shape[1:]), t.dtype) for t in self.tensors[0]) if self.tensors else ()
        theirs = tuple((tuple(t.shape[1:]), t.dtype) for t in states.tensors[0]) if states.tensors else ()
        if not out and mine != theirs:
            out.append(f"shapes: {theirs}, here {mine}")
        return out

    def write(self, blocks: Sequence[dict[int, list[int]]], states: RecurrentStates) -> None:
        """Write sequence ``s``'s state into the blocks ``blocks[s][group]`` of each layer's group.

        Raises:
            HurrayFormatError: (field ``snapshot.states``) states of another
                model geometry (see :meth:`mismatches`).
        """
        diffs = self.mismatches(states)
        if diffs:
            raise HurrayFormatError("snapshot.states", "states of another model: " + "; ".join(diffs))
        for layer, g, src in zip(self.tensors, self.groups, states.tensors, strict=True):
            rows = [s for s, b in enumerate(blocks) for _ in b.get(g, [])]
            ids = [x for b in blocks for x in b.get(g, [])]
            if not ids:
                continue
            dest = torch.tensor(ids, dtype=torch.int64)
            pick = torch.tensor(rows, dtype=torch.int64)
            for t, s in zip(layer, src, strict=True):
                t.index_copy_(0, dest.to(t.device), s.index_select(0, pick).to(t.device, t.dtype))


def state_cache(vllm_config: Any, kv_cache_config: Any) -> StateCache | None:
    """The linear-attention layers of this worker (``None`` for a model without any).

    Raises:
        HurrayFormatError: (field ``kv_cache_groups``) a state layer whose
            cache is not a list of tensors, or layers that disagree in shape.
    """
    of_layer = state_groups(kv_cache_config)
    if not of_layer:
        return None
    ctx = vllm_config.compilation_config.static_forward_context
    names = [n for n in ctx if n in of_layer]
    tensors = []
    for n in names:
        kv = getattr(ctx[n], "kv_cache", None)
        if not isinstance(kv, (list, tuple)) or not kv or not all(isinstance(t, torch.Tensor) for t in kv):
            raise HurrayFormatError("kv_cache_groups", f"{n}: its state cache is not a list of tensors")
        tensors.append(tuple(kv))
    if len({tuple((tuple(t.shape[1:]), t.dtype) for t in layer) for layer in tensors}) > 1:
        raise HurrayFormatError("kv_cache_groups", "linear-attention layers hold states of different shapes")
    idx = [model_layer_index(n) for n in names]
    layers = tuple(i if i is not None else k for k, i in enumerate(idx))
    groups = list(kv_cache_config.kv_cache_groups)
    spec = groups[of_layer[names[0]]].kv_cache_spec if names else None
    return StateCache(
        kind=_kind(kv_cache_config),
        names=state_names(len(tensors[0]) if tensors else 0),
        layer_names=tuple(names),
        layers=layers,
        groups=tuple(of_layer[n] for n in names),
        tensors=tuple(tensors),
        block_size=int(getattr(spec, "block_size", vllm_config.cache_config.block_size)),
        mode=str(getattr(spec, "mamba_cache_mode", vllm_config.cache_config.mamba_cache_mode) or "none"),
    )
