"""``RecurrentStates``: the per-sequence state of a hybrid model's linear-attention layers.

Linear-attention and state-space layers (Qwen3-Next's gated delta net,
Mamba2) keep no per-token KV. They carry a fixed-size state per sequence
instead: a short convolution window and a recurrent matrix, updated token
by token. That state is valid only at the token where it was taken, so a
snapshot records that position with it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import torch

from ..errors import HurrayFormatError, Violation
from ..wire import dtypes
from ..wire.jsonvalues import Fields

__all__ = ["RecurrentStates", "join_states", "part_fraction", "state_split"]

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
            ``mamba_type``: ``"gdn_attn"``, ``"mamba2"``...). A state
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
            When recorded: one per snapshot layer, strictly increasing, none
            of them a state layer (:meth:`~hurray_vllm.kv.snapshot.KVSnapshot.validate`
            checks the count).
        layout: ``""`` for the layout above; an engine-specific name (such as
            ``"vllm-cuda-SD"``) for kinds whose memory layout is not
            normalized, which only the same layout may load.
        split: on a part only: per member, how it splits across
            tensor-parallel ranks, ``(axis, sections)``: its per-sequence
            axis, and the whole sizes of the consecutive sections along it
            (a gated delta net's conv state: its query, key and value
            channels; its recurrent state: its value heads).
        part: ``(start, stop, total)`` when these are a part of the states
            (one tensor-parallel rank's): of every section, the elements
            ``size * start / total`` to ``size * stop / total``, in order.
            ``None``: the whole states. In a snapshot holding a slice of
            the KV heads (:class:`~hurray_vllm.kv.snapshot.HeadRange`), the
            states are the same part.

    Example:
        >>> import torch
        >>> s = RecurrentStates("gdn_attn", (0, 1), ("conv", "ssm"), (7,),
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
    split: tuple[tuple[int, tuple[int, ...]], ...] = ()
    part: tuple[int, int, int] | None = None

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
    def whole_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per member, the whole state's shape for one sequence (:attr:`shapes` unless this is a part)."""
        if self.part is None:
            return self.shapes
        out = []
        for shape, (axis, sections) in zip(self.shapes, self.split, strict=False):
            dims = list(shape)
            if 0 <= axis < len(dims):
                dims[axis] = sum(sections)
            out.append(tuple(dims))
        return tuple(out)

    @property
    def fraction(self) -> tuple[Fraction, Fraction]:
        """The part these states hold, as fractions of every section (``(0, 1)``: whole)."""
        return part_fraction(self.part)

    def take(self, start: int, stop: int, total: int) -> RecurrentStates:
        """The part ``start / total`` to ``stop / total`` of every member, from the whole or a larger part.

        A member with one section is a view of this one's; a member with
        several (a fused conv state, ``[q | k | v]``) is a new tensor, its
        sections' parts concatenated: writing into it does not write here.

        What a tensor-parallel rank of ``total`` equal shares holds of a
        whole state is ``take(rank, rank + 1, total)``; a rank holding the
        KV heads ``a .. b - 1`` of ``n`` holds ``take(a, b, n)``.

        Raises:
            HurrayFormatError: (field ``snapshot.states``) a kind whose split
                is not known, a part outside these states, or sections that
                do not divide at that part's boundaries.

        Example:
            >>> import torch
            >>> s = RecurrentStates("gdn_attn", (0,), ("conv", "ssm"), (5,),
            ...     ((torch.arange(12.).reshape(1, 1, 12), torch.zeros(1, 2, 2, 2)),))
            >>> s.take(1, 2, 2).tensors[0][0].tolist()
            [[[2.0, 3.0, 6.0, 7.0, 10.0, 11.0]]]
        """
        if not 0 <= start < stop <= total:
            raise HurrayFormatError(
                "snapshot.states", f"part {start}..{stop} of {total}: expected 0 <= start < stop <= total"
            )
        lo, hi = Fraction(start, total), Fraction(stop, total)
        have_lo, have_hi = self.fraction
        if lo < have_lo or hi > have_hi:
            raise HurrayFormatError(
                "snapshot.states",
                f"part {start}..{stop} of {total} is outside the states' part {self.part or 'whole'}",
            )
        if (lo, hi) == (have_lo, have_hi):
            return self
        split = self.split or state_split(self.kind, self.layout, self.whole_shapes)
        if split is None:
            raise HurrayFormatError("snapshot.states", f"states of kind {self.kind!r} do not split across ranks")
        tensors = []
        for layer in self.tensors:
            members = []
            for t, (axis, sections) in zip(layer, split, strict=True):
                pieces, offset = [], 0
                for size in sections:
                    first, begin, end = _at(size, have_lo), _at(size, lo), _at(size, hi)
                    pieces.append(t.narrow(axis + 1, offset + begin - first, end - begin))
                    offset += _at(size, have_hi) - first
                members.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=axis + 1))
            tensors.append(tuple(members))
        whole = (lo, hi) == (0, 1)
        declared: tuple[tuple[tuple[int, ...], str], ...] = ()
        if not self.tensors:  # a header: the declared shapes of the part
            declared = tuple(
                (_part_shape(shape, axis, sections, lo, hi), dt)
                for shape, dt, (axis, sections) in zip(self.whole_shapes, self.dtype_names, split, strict=True)
            )
        return replace(
            self,
            tensors=tuple(tensors),
            declared=declared,
            split=() if whole else tuple(split),
            part=None if whole else _reduced(lo, hi),
        )

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

        Raises:
            HurrayFormatError: (field ``snapshot.states.attention_layers``) the
                recorded indices are fewer than ``num_attention_layers``.
        """
        if self.attention:
            if len(self.attention) < num_attention_layers:
                # A short list would leave the last layers' KV out of an import, silently.
                raise HurrayFormatError(
                    "snapshot.states.attention_layers",
                    f"{len(self.attention)} attention layer indices recorded for {num_attention_layers} layers",
                )
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
        theirs = list(zip(other.whole_shapes, other.dtype_names, strict=False))
        mine = list(zip(self.whole_shapes, self.dtype_names, strict=False))
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
        elif any(b <= a for a, b in itertools.pairwise(self.attention)):
            # The snapshot's layers are in model order: layer i is model layer attention[i].
            found.append(
                Violation(
                    "snapshot.states.attention_layers",
                    f"{list(self.attention)[:16]}: model layer indices must be strictly increasing",
                )
            )
        if not _good_names(self.names):
            found.append(
                Violation("snapshot.states.names", f"{list(self.names)}: expected 1 to 16 distinct identifiers")
            )
        if any(p < 0 for p in self.positions):
            found.append(Violation("snapshot.states.positions", "positions must be >= 0"))
        bad = [d for d in (self.dtype_names if self.tensors or self.declared else ()) if d not in _STATE_DTYPES]
        if bad:
            found.append(Violation("snapshot.states.dtypes", f"{bad}: states are one of {sorted(_STATE_DTYPES)}"))
        found.extend(self.part_violations())
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

    def part_violations(self) -> list[Violation]:
        """A part whose split does not match its members, or whose members are not that part of the sections."""
        if self.part is None:
            return [Violation("snapshot.states.split", "a split without a part")] if self.split else []
        start, stop, total = self.part
        if not 0 <= start < stop <= total or (start, stop) == (0, total):
            return [
                Violation("snapshot.states.part", f"{list(self.part)}: expected 0 <= start < stop <= total, not all")
            ]
        if len(self.split) != len(self.names):
            return [Violation("snapshot.states.split", f"{len(self.split)} splits for {len(self.names)} members")]
        if any(not 0 <= axis < len(shape) or not sections for shape, (axis, sections) in zip(self.shapes, self.split)):
            return [Violation("snapshot.states.split", "a split axis outside its member, or no sections")]
        # Only the split the kind has: the sections say which channels a part holds, and nothing else checks them.
        known = state_split(self.kind, self.layout, self.whole_shapes)
        if known is None or tuple(self.split) != known:
            return [
                Violation(
                    "snapshot.states.split",
                    f"{_splits_text(self.split)} is not how {self.kind!r} states split "
                    f"({_splits_text(known) if known else 'they do not split across ranks'})",
                )
            ]
        lo, hi = self.fraction
        for name, shape, (axis, sections) in zip(self.names, self.shapes, self.split, strict=False):
            if not 0 <= axis < len(shape) or not sections:
                return [Violation(f"snapshot.states.{name}", f"split axis {axis} of a {len(shape)}-d state")]
            bounds = [size * f for size in sections for f in (lo, hi)]
            if any(b.denominator != 1 for b in bounds):
                return [Violation(f"snapshot.states.{name}", f"sections {list(sections)} do not divide at {self.part}")]
            if shape[axis] != sum(_at(size, hi) - _at(size, lo) for size in sections):
                return [
                    Violation(
                        f"snapshot.states.{name}",
                        f"{shape[axis]} along axis {axis}, part {list(self.part)} of sections {list(sections)}",
                    )
                ]
        return []

    def to_json(self) -> dict[str, Any]:
        """The layout as a JSON-ready dict (no tensors: containers hold them as records).

        ``attention_layers`` and ``layout`` appear only when set; ``split``
        and ``part`` only on a part.
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
        if self.part is not None:
            out["split"] = [{"axis": axis, "sections": list(sections)} for axis, sections in self.split]
            out["part"] = {"start": self.part[0], "stop": self.part[1], "total": self.part[2]}
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
        split, part = _split_from_json(f.obj.get("split"), f.obj.get("part"), len(names))
        out = cls(kind, layers, tuple(names), positions, (), tuple(declared), attention, layout or "", split, part)
        bad = out.part_violations()  # a part that does not add up is refused here, permissive reads included
        if bad:
            raise HurrayFormatError(bad[0].invariant, bad[0].message)
        return out


def part_fraction(part: tuple[int, int, int] | None) -> tuple[Fraction, Fraction]:
    """``(start, stop, total)`` as the fractions ``start / total`` and ``stop / total`` (None: ``(0, 1)``, whole).

    Example:
        >>> part_fraction((2, 4, 8)), part_fraction(None)
        ((Fraction(1, 4), Fraction(1, 2)), (Fraction(0, 1), Fraction(1, 1)))
    """
    if part is None:
        return Fraction(0), Fraction(1)
    start, stop, total = part
    return Fraction(start, total), Fraction(stop, total)


def state_split(
    kind: str, layout: str, whole_shapes: Sequence[Sequence[int]]
) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    """How states of ``kind`` split across tensor-parallel ranks, per member ``(axis, sections)``; None: unknown.

    A gated delta net (``"gdn_attn"``, the format's layout) shards its
    heads: its conv state ``[kernel - 1, conv_dim]`` holds the query, key
    and value channels (``key_dim``, ``key_dim``, ``value_dim``), each
    split evenly, and its recurrent state ``[v_heads, k_dim, v_dim]`` its
    value heads. vLLM gives rank ``r`` of ``tp`` the ``r``-th share of each.

    Example:
        >>> state_split("gdn_attn", "", [(3, 1024), (4, 128, 128)])
        ((1, (256, 256, 512)), (0, (4,)))
    """
    if kind != "gdn_attn" or layout or len(whole_shapes) != 2:
        return None
    conv, ssm = (tuple(int(x) for x in s) for s in whole_shapes)
    if len(conv) != 2 or len(ssm) != 3:
        return None
    value_dim = ssm[0] * ssm[2]
    key_dim, odd = divmod(conv[1] - value_dim, 2)
    if odd or key_dim <= 0:
        return None
    return ((1, (key_dim, key_dim, value_dim)), (0, (ssm[0],)))


def _splits_text(split: Sequence[tuple[int, Sequence[int]]]) -> str:
    """``axis 1: 16+16+16; axis 0: 8`` (for messages)."""
    return "; ".join(f"axis {axis}: {'+'.join(map(str, sections))}" for axis, sections in split)


def join_states(parts: Sequence[RecurrentStates]) -> RecurrentStates:
    """One part (or the whole) from consecutive parts of the same states, in order.

    Raises:
        HurrayFormatError: (field ``snapshot.states``) parts that are not
            consecutive parts of one layout.
    """
    if not parts:
        raise HurrayFormatError("snapshot.states", "no parts to join")
    first = parts[0]
    if len(parts) == 1:
        return first
    spans = [p.fraction for p in parts]
    if any(a[1] != b[0] for a, b in itertools.pairwise(spans)) or any(
        p.mismatches(first) or p.split != first.split or p.positions != first.positions for p in parts
    ):
        raise HurrayFormatError(
            "snapshot.states", f"parts {[p.part for p in parts]} are not consecutive parts of one state"
        )
    if first.part is None:
        raise HurrayFormatError("snapshot.states", "a whole state cannot be joined with another part")
    if len({bool(p.tensors) for p in parts}) > 1:
        raise HurrayFormatError("snapshot.states", "parts with tensors and header-only parts do not join")
    lo, hi = spans[0][0], spans[-1][1]
    whole = (lo, hi) == (0, 1)
    if not first.tensors:  # headers: the declared shapes of the joined part
        declared = tuple(
            (_part_shape(shape, axis, sections, lo, hi), dt)
            for shape, dt, (axis, sections) in zip(first.whole_shapes, first.dtype_names, first.split, strict=True)
        )
        return replace(
            first, declared=declared, split=() if whole else first.split, part=None if whole else _reduced(lo, hi)
        )
    # Per member, the runs to join in order: (part, offset in it, length). Every layer splits alike, so the
    # exact fraction arithmetic runs once per member, not once per layer.
    runs: list[tuple[int, list[tuple[int, int, int]]]] = []
    for axis, sections in first.split:
        offsets = [0] * len(parts)
        member_runs = []
        for size in sections:
            for i in range(len(parts)):
                n = _at(size, spans[i][1]) - _at(size, spans[i][0])
                member_runs.append((i, offsets[i], n))
                offsets[i] += n
        runs.append((axis + 1, member_runs))
    tensors = tuple(
        tuple(
            torch.cat([parts[i].tensors[j][m].narrow(dim, at, n) for i, at, n in member_runs], dim=dim)
            for m, (dim, member_runs) in enumerate(runs)
        )
        for j in range(len(first.tensors))
    )
    return replace(
        first,
        tensors=tensors,
        declared=(),
        split=() if whole else first.split,
        part=None if whole else _reduced(lo, hi),
    )


def _at(size: int, f: Fraction) -> int:
    """Where fraction ``f`` of a section of ``size`` elements falls (exact: a part's sections divide)."""
    x = size * f
    if x.denominator != 1:
        raise HurrayFormatError("snapshot.states", f"a section of {size} does not divide at {f}")
    return int(x)


def _part_shape(
    shape: Sequence[int], axis: int, sections: Sequence[int], lo: Fraction, hi: Fraction
) -> tuple[int, ...]:
    dims = [int(x) for x in shape]
    dims[axis] = sum(_at(size, hi) - _at(size, lo) for size in sections)
    return tuple(dims)


def _reduced(lo: Fraction, hi: Fraction) -> tuple[int, int, int]:
    """``(start, stop, total)`` of the part ``lo .. hi`` over the smallest common denominator."""
    total = lo.denominator * hi.denominator // math.gcd(lo.denominator, hi.denominator)
    return int(lo * total), int(hi * total), total


def _split_from_json(
    split: Any, part: Any, members: int
) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], tuple[int, int, int] | None]:
    if split is None and part is None:
        return (), None
    p = Fields(part, "snapshot.states.part")
    total = p.integer("total", lo=2, hi=1 << 16)
    start = p.integer("start", hi=total - 1)
    stop = p.integer("stop", lo=start + 1, hi=total)
    if not isinstance(split, list) or len(split) != members:
        raise HurrayFormatError("snapshot.states.split", "expected one split per state member")
    out = []
    for item in split:
        s = Fields(item, "snapshot.states.split")
        axis = s.integer("axis", hi=_MAX_RANK - 1)
        sections = _int_list(s.obj.get("sections"), "snapshot.states.split.sections", 16, 1, _MAX_DIM + 1)
        if not sections:
            raise HurrayFormatError("snapshot.states.split.sections", "expected at least one section")
        out.append((axis, sections))
    return tuple(out), (start, stop, total)


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
