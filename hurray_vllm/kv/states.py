"""``RecurrentStates``: the per-sequence state of a hybrid model's linear-attention layers.

Linear-attention and state-space layers (Qwen3-Next's gated delta net,
Mamba2) keep no per-token KV. They carry a fixed-size state per sequence
instead: a short convolution window and a recurrent matrix, updated token
by token. That state is valid only at the token where it was taken, so a
snapshot records that position with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import HurrayFormatError, Violation
from ..wire import dtypes
from ..wire.jsonvalues import Fields

__all__ = ["RecurrentStates"]

_MAX_LAYERS = 1 << 16
_MAX_MEMBERS = 16
_MAX_RANK = 8
_MAX_DIM = 1 << 24
#: What engines keep states in (whole bytes: a state is read back as a typed tensor).
_STATE_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


@dataclass(frozen=True, eq=False)
class RecurrentStates:
    """Each linear-attention layer's state tensors, per sequence, as the engine holds them.

    A hybrid model's layers are its attention layers (the snapshot's
    ``layers.{i}``, holding KV) and its state layers (these). Both keep
    the model's order: the attention layers are the model layers not
    listed in :attr:`layers`, in order (:meth:`attention_layers`).

    Attributes:
        kind: what computes the state, as the engine names it (vLLM's
            ``mamba_type``: ``"gdn_attention"``, ``"mamba2"``...). A state
            is only meaningful to the same kind of layer.
        layers: per state layer, its index among all the model's layers.
        names: the state members of every layer, in the engine's order
            (for a gated delta net ``("conv", "ssm")``).
        positions: per sequence, how many tokens the state has consumed
            (the token it resumes at). A snapshot's states sit at the end of
            each sequence's KV; a chunk's at the chunk's end, counted from
            the start of the whole prefix.
        tensors: per state layer, per member, ``[num_seqs, *shape]`` in the
            engine's dtype. A gated delta net's (``"gdn_attn"``) are in one
            layout whatever the engine's memory holds: conv ``[S, kernel - 1,
            conv_dim]`` (oldest input first) and recurrent ``[S, v_heads,
            k_dim, v_dim]`` (transformers' order; vLLM's GPU kernels keep
            ``v_dim, k_dim``, its CPU kernels this one). Empty in a header
            that carries only the layout.
        attention: the model indices of the snapshot's attention layers (its
            ``layers.{i}``), when the exporter knows them; otherwise they are
            the model layers :attr:`layers` leaves (:meth:`attention_layers`).
        layout: ``""`` for the layout above; an engine-specific name (such as
            ``"vllm-cuda-SD"``) for kinds whose memory layout is not
            normalized, which only the same layout may load.

    Example:
        >>> import torch
        >>> s = RecurrentStates("gdn_attention", (0, 1), ("conv", "ssm"), (7,),
        ...     tuple((torch.zeros(1, 3, 8), torch.zeros(1, 2, 4, 4)) for _ in range(2)))
        >>> s.attention_layers(2), s.shapes
        ([2, 3], ((3, 8), (2, 4, 4)))
    """

    kind: str
    layers: tuple[int, ...]
    names: tuple[str, ...]
    positions: tuple[int, ...]
    tensors: tuple[tuple[torch.Tensor, ...], ...] = ()
    #: Per member, its per-sequence shape and dtype name; what a header announces before the tensors.
    declared: tuple[tuple[tuple[int, ...], str], ...] = ()
    attention: tuple[int, ...] = ()
    layout: str = ""

    @property
    def num_seqs(self) -> int:
        """Number of sequences."""
        return len(self.positions)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per member, the state's shape for one sequence."""
        if self.tensors:
            return tuple(tuple(int(x) for x in t.shape[1:]) for t in self.tensors[0])
        return tuple(s for s, _ in self.declared)

    @property
    def dtype_names(self) -> tuple[str, ...]:
        """Per member, its dtype's Hurray name (``"bfloat16"``...)."""
        if self.tensors:
            return tuple(dtypes.from_torch(t.dtype).name for t in self.tensors[0])
        return tuple(d for _, d in self.declared)

    @property
    def nbytes(self) -> int:
        """Bytes of every state tensor."""
        return sum(t.numel() * t.element_size() for layer in self.tensors for t in layer)

    def attention_layers(self, num_attention_layers: int) -> list[int]:
        """The model indices of ``num_attention_layers`` attention layers.

        :attr:`attention` when the exporter recorded it, else the model layers
        no state layer takes, in order.
        """
        if self.attention:
            return list(self.attention[:num_attention_layers])
        taken = set(self.layers)
        out: list[int] = []
        i = 0
        while len(out) < num_attention_layers:
            if i not in taken:
                out.append(i)
            i += 1
        return out

    def select(self, seqs: Sequence[int]) -> RecurrentStates:
        """The states of sequences ``seqs`` only."""
        idx = torch.tensor(list(seqs), dtype=torch.int64)
        return replace(
            self,
            positions=tuple(self.positions[s] for s in seqs),
            tensors=tuple(tuple(t.index_select(0, idx.to(t.device)) for t in layer) for layer in self.tensors),
        )

    def with_tensors(self, tensors: Sequence[Sequence[torch.Tensor]]) -> RecurrentStates:
        """This layout with its tensors (what a reader builds after the header)."""
        return replace(self, tensors=tuple(tuple(layer) for layer in tensors), declared=())

    def mismatches(self, other: RecurrentStates) -> list[str]:
        """How ``other``'s layout differs from this one (empty when a consumer of this layout can load it).

        Compares the kind, layer indices, members, per-sequence shapes,
        dtypes and layout name; not the positions or values.
        """
        out = []
        for name in ("kind", "layers", "names", "layout"):
            a, b = getattr(other, name), getattr(self, name)
            if a != b:
                out.append(f"{name}: {a!r}, here {b!r}")
        theirs = list(zip(other.shapes, other.dtype_names, strict=False))
        mine = list(zip(self.shapes, self.dtype_names, strict=False))
        if not out and theirs != mine:
            out.append(f"shapes and dtypes: {theirs}, here {mine}")
        return out

    def violations(self) -> list[Violation]:
        """What is inconsistent: counts, shapes and dtypes across layers and sequences.

        The same rules :meth:`from_json` applies to a header, so that what
        ``validate`` passes in memory also loads from a file.
        """
        found = []
        if len(set(self.layers)) != len(self.layers) or any(i < 0 for i in self.layers):
            found.append(Violation("snapshot.states.layers", f"layer indices {list(self.layers)} repeat or are < 0"))
        if set(self.attention) & set(self.layers) or any(i < 0 for i in self.attention):
            found.append(Violation("snapshot.states.attention_layers", "attention layers overlap state layers"))
        if not _good_names(self.names):
            found.append(
                Violation("snapshot.states.names", f"{list(self.names)}: expected 1 to 16 distinct identifiers")
            )
        if any(p < 0 for p in self.positions):
            found.append(Violation("snapshot.states.positions", "positions must be >= 0"))
        bad = [d for d in (self.dtype_names if self.tensors or self.declared else ()) if d not in _STATE_DTYPES]
        if bad:
            found.append(Violation("snapshot.states.dtypes", f"{bad}: states are one of {sorted(_STATE_DTYPES)}"))
        if len(self.tensors) != len(self.layers):
            found.append(
                Violation("snapshot.states", f"{len(self.tensors)} state layers for {len(self.layers)} layer indices")
            )
            return found
        first = self.tensors[0] if self.tensors else ()
        for j, layer in enumerate(self.tensors):
            if len(layer) != len(self.names):
                found.append(
                    Violation("snapshot.states", f"state layer {j} has {len(layer)} members, names {list(self.names)}")
                )
                break
            for name, t, t0 in zip(self.names, layer, first, strict=True):
                if t.dim() < 1 or t.shape[0] != self.num_seqs:
                    found.append(
                        Violation(
                            f"snapshot.states.{name}",
                            f"state layer {j}: {list(t.shape)} does not lead with {self.num_seqs} sequences",
                        )
                    )
                    return found
                if t.shape != t0.shape or t.dtype != t0.dtype:
                    found.append(
                        Violation(
                            f"snapshot.states.{name}",
                            f"state layer {j} is {t.dtype} {list(t.shape)}, layer 0 {t0.dtype} {list(t0.shape)}",
                        )
                    )
                    return found
        return found

    def to_json(self) -> dict[str, Any]:
        """The layout as a JSON-ready dict (no tensors: containers hold them as records).

        ``attention_layers`` and ``layout`` appear only when set.
        """
        out: dict[str, Any] = {
            "kind": self.kind,
            "layers": list(self.layers),
            "names": list(self.names),
            "positions": list(self.positions),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtype_names),
        }
        if self.attention:
            out["attention_layers"] = list(self.attention)
        if self.layout:
            out["layout"] = self.layout
        return out

    @classmethod
    def from_json(cls, d: Any) -> RecurrentStates:
        """The layout :meth:`to_json` wrote (without tensors); a bad member raises :class:`HurrayFormatError`."""
        f = Fields(d, "snapshot.states")
        kind = f.string("kind", max_len=256)
        layers = _int_list(f.obj.get("layers"), "snapshot.states.layers", _MAX_LAYERS, 0, _MAX_LAYERS)
        positions = _int_list(f.obj.get("positions"), "snapshot.states.positions", 1 << 24, 0, 1 << 62)
        attention = _int_list(
            f.obj.get("attention_layers", []), "snapshot.states.attention_layers", _MAX_LAYERS, 0, _MAX_LAYERS
        )
        layout = f.string("layout", max_len=256, default="")
        names = f.obj.get("names")
        if not isinstance(names, list) or not _good_names(names):
            raise HurrayFormatError("snapshot.states.names", "expected 1 to 16 distinct identifier names")
        shapes, dts = f.obj.get("shapes"), f.obj.get("dtypes")
        if not isinstance(shapes, list) or len(shapes) != len(names):
            raise HurrayFormatError("snapshot.states.shapes", "expected one shape per state member")
        if not isinstance(dts, list) or len(dts) != len(names):
            raise HurrayFormatError("snapshot.states.dtypes", "expected one dtype name per state member")
        declared = []
        for shape, dt in zip(shapes, dts, strict=True):
            dims = _int_list(shape, "snapshot.states.shapes", _MAX_RANK, 0, _MAX_DIM)
            if not isinstance(dt, str) or dt not in _STATE_DTYPES:
                raise HurrayFormatError("snapshot.states.dtypes", f"{dt!r} is not one of {sorted(_STATE_DTYPES)}")
            declared.append((dims, dt))
        return cls(kind, layers, tuple(names), positions, (), tuple(declared), attention, layout or "")


def _good_names(names: Sequence[Any]) -> bool:
    """1 to 16 distinct identifiers of at most 64 characters (they become record names)."""
    return (
        1 <= len(names) <= _MAX_MEMBERS
        and all(isinstance(n, str) and n.isidentifier() and len(n) <= 64 for n in names)
        and len(set(names)) == len(names)
    )


def _int_list(v: Any, what: str, max_len: int, lo: int, hi: int) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > max_len or not all(type(x) is int and lo <= x < hi for x in v):
        raise HurrayFormatError(what, f"expected a list of at most {max_len} integers in [{lo}, {hi})")
    return tuple(v)
