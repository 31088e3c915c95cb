"""Snapshots as ``.safetensors`` files that any safetensors reader opens.

Tensors, per layer ``i`` and role ``r`` in ``key``/``value``::

    layers.{i}.{r}.page_pool     [num_pages, page_size, num_kv_heads, head_dim], the pool dtype
    layers.{i}.{r}.block_table   int64 [total_logical_pages]
    layers.{i}.{r}.seq_ptr       int64 [num_seqs + 1]
    layers.{i}.{r}.seq_lens      int64 [num_seqs]
    layers.{i}.kv_scales         float32 [2]          (fp8 caches only)
    states.{j}.{name}            [num_seqs, *shape]   (linear-attention hybrids only)
    token_ids                    int64 [total_token_ids]
    token_ptr                    int64 [num_seqs + 1]

``__metadata__`` holds ``format`` (``hurray-vllm.kv_snapshot``), the
snapshot metadata JSON under ``snapshot`` and, under ``descriptors``, the
encoded Hurray descriptor of every block-paged tensor (hex), so the file
converts back to ``.hrry`` losslessly. ``safe_open`` gives zero-copy access
to any single page pool.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import HurrayFormatError, ImportArgumentError
from ..kv.paged import BlockPagedTensor
from ..kv.snapshot import FUSED_ROLES, KV_ROLES, KVSnapshot
from ..wire import dtypes
from ..wire.descriptor import encode_descriptor
from ..wire.jsonvalues import Fields, loads_bounded
from ..wire.rules import decode_checked
from .atomic import atomic_path
from .io import PARSE_ERRORS, read_error
from .schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    SnapshotHeader,
    build_snapshot,
    decode_header,
    flatten_tokens,
    kv_scale_pair,
    snapshot_metadata,
    split_tokens,
)

__all__ = ["save_safetensors", "load_safetensors"]


def _safetensors() -> Any:
    """``safetensors.torch``; without the package, an argument error (the install, not the file, is wrong).

    An :class:`~hurray_vllm.errors.ImportArgumentError`: a :class:`~hurray_vllm.errors.HurrayArgumentError`
    (the CLI's exit 2) that the readers' boundaries pass on unchanged (they re-raise a ``HurrayFormatError``,
    and would call any other ``ValueError`` malformed input), and that ``except HurrayFormatError`` written
    against 0.1, when this was a format error, still catches.
    """
    try:
        import safetensors.torch as st
    except ImportError:
        raise ImportArgumentError(
            "safetensors",
            "the safetensors package is needed for .safetensors files: pip install 'hurray-vllm[safetensors]'",
        ) from None
    return st


def save_safetensors(snap: KVSnapshot, path: str | os.PathLike[str]) -> int:
    """Write ``snap`` to ``path`` as safetensors (atomically); returns the file size."""
    st = _safetensors()
    tensors: dict[str, torch.Tensor] = {}
    descriptors: dict[str, str] = {}
    for i, members in enumerate(snap.layer_members()):
        for t in members:
            name = f"layers.{i}.{t.kv_role}"
            if t.quantization is not None:
                raise HurrayFormatError(
                    "quantization", f"{name}: quantized block-paged tensors have no safetensors form; use .hrry"
                )
            # safetensors refuses tensors that share memory, and the layers share their tables.
            tensors[f"{name}.page_pool"] = t.page_pool.detach().cpu().contiguous()
            tensors[f"{name}.block_table"] = t.block_table.to(torch.int64).cpu().clone()
            tensors[f"{name}.seq_ptr"] = t.seq_ptr.to(torch.int64).cpu().clone()
            if t.seq_lens is not None:
                tensors[f"{name}.seq_lens"] = t.seq_lens.to(torch.int64).cpu().clone()
            descriptors[name] = encode_descriptor(t.descriptor(device_tag=0)).hex()
        if snap.kv_scales is not None:
            tensors[f"layers.{i}.kv_scales"] = torch.tensor(snap.kv_scales[i], dtype=torch.float32)
    if snap.states is not None:
        for j, layer in enumerate(snap.states.tensors):
            for name, state in zip(snap.states.names, layer, strict=True):
                tensors[f"states.{j}.{name}"] = state.detach().cpu().contiguous().clone()
    tensors["token_ids"], tensors["token_ptr"] = flatten_tokens(snap.token_ids)
    metadata = {
        "format": FORMAT_NAME,
        "version": str(FORMAT_VERSION),
        "snapshot": json.dumps(snapshot_metadata(snap, snap.num_layers), sort_keys=True),
        "descriptors": json.dumps(descriptors, sort_keys=True),
    }
    with atomic_path(path) as tmp:
        st.save_file(tensors, str(tmp), metadata=metadata)
    return Path(path).stat().st_size


def load_safetensors(path: str | os.PathLike[str], *, permissive: bool = False) -> KVSnapshot:
    """Read a snapshot written by :func:`save_safetensors` (checked like any Hurray input).

    Raises:
        HurrayFormatError: the file is not such a snapshot, or is malformed (as :func:`hurray_vllm.load`).
        OSError: the file cannot be read, or memory ran out while reading it.
    """
    try:
        return _load_safetensors(path, permissive)
    except (HurrayFormatError, OSError):
        raise
    except (*PARSE_ERRORS, MemoryError) as exc:  # the boundary load() has: one error type for bad input
        raise read_error(exc, str(path)) from exc


def _load_safetensors(path: str | os.PathLike[str], permissive: bool) -> KVSnapshot:
    _safetensors()  # the install hint when the package is missing
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return _read_snapshot(f, path, permissive)
    except SafetensorError as exc:  # its own type for a malformed header, data cut short, or the OS's error
        err = read_error(exc, str(path))  # the OS's ENOMEM is the machine's state, not the file's
        if isinstance(err, OSError):
            raise err from exc
        raise HurrayFormatError("safetensors", f"{path}: not a readable safetensors file ({exc})") from None


def _read_snapshot(f: Any, path: str | os.PathLike[str], permissive: bool) -> KVSnapshot:
    """The snapshot in the open safetensors file ``f`` (``safe_open``'s handle): its metadata, then its tensors."""
    metadata = f.metadata() or {}
    if metadata.get("format") != FORMAT_NAME:
        raise HurrayFormatError("safetensors.metadata", f"{path} is a safetensors file but not a hurray-vllm snapshot")
    if "snapshot" not in metadata or "descriptors" not in metadata:
        raise HurrayFormatError(
            "safetensors.metadata", "malformed snapshot metadata: missing 'snapshot' or 'descriptors'"
        )
    header = decode_header(metadata["snapshot"], "safetensors.metadata.snapshot")
    descriptors = Fields(loads_bounded(metadata["descriptors"], "safetensors.descriptors"), "safetensors.descriptors")
    roles = FUSED_ROLES if header.latent is not None else KV_ROLES
    names = set(f.keys())
    _check_names(names, header, roles)
    # Only the names checked above are read (a stray tensor is refused unread): each one mapped, not the whole file.
    tensors = {n: f.get_tensor(n) for n in sorted(names)}
    layers, scales = [], []
    for i in range(header.num_layers):
        layers.append(tuple(_layer_tensor(tensors, descriptors, f"layers.{i}.{role}", permissive) for role in roles))
        if f"layers.{i}.kv_scales" in tensors:
            scales.append(kv_scale_pair(tensors[f"layers.{i}.kv_scales"]))
    token_ids: list[tuple[int, ...]] = []
    if "token_ids" in tensors:  # _check_names saw both or neither
        token_ids = split_tokens(tensors["token_ids"], tensors["token_ptr"])
    if scales and len(scales) != header.num_layers:
        raise HurrayFormatError("kv_scales", "some layers carry fp8 scales and others do not")
    return build_snapshot(
        layers, token_ids, tuple(scales) or None, header, permissive=permissive, states=_states(tensors, header)
    )


def _check_names(names: set[str], header: SnapshotHeader, roles: tuple[str, ...]) -> None:
    """Refuse tensors the header does not account for, and token ids without their offsets (or the reverse).

    Why: what the reader skipped, another safetensors reader still sees; a file
    whose tensors say more than the snapshot read from it is not that snapshot.

    Raises:
        HurrayFormatError: a stray tensor (field ``safetensors.tensors``, the message names it), or one of
            ``token_ids``/``token_ptr`` without the other (field ``snapshot.token_ptr`` or ``snapshot.token_ids``).
    """
    if ("token_ids" in names) != ("token_ptr" in names):
        missing = "token_ptr" if "token_ids" in names else "token_ids"
        other = "token_ids" if missing == "token_ptr" else "token_ptr"
        raise HurrayFormatError(f"snapshot.{missing}", f"the file holds {other} but no {missing}")
    known = {"token_ids", "token_ptr"}
    for i in range(header.num_layers):
        known.add(f"layers.{i}.kv_scales")
        for role in roles:
            known.update(f"layers.{i}.{role}.{part}" for part in ("page_pool", "block_table", "seq_ptr", "seq_lens"))
    if header.states is not None:
        known.update(f"states.{j}.{n}" for j in range(len(header.states.layers)) for n in header.states.names)
    stray = sorted(names - known)
    if stray:
        shown = ", ".join(repr(n[:80]) for n in stray[:3]) + (f" and {len(stray) - 3} more" if len(stray) > 3 else "")
        raise HurrayFormatError(
            "safetensors.tensors",
            f"{shown}: not a tensor of this snapshot ({header.num_layers} layers of {'/'.join(roles)}"
            f"{', with states' if header.states is not None else ''})",
        )


def _states(tensors: dict[str, torch.Tensor], header: SnapshotHeader) -> list[list[torch.Tensor]]:
    """The state tensors the header declares, each of its declared shape and dtype."""
    layout = header.states
    if layout is None:
        return []
    out = []
    for j in range(len(layout.layers)):
        layer = []
        for name, (shape, dt) in zip(layout.names, layout.declared, strict=True):
            t = tensors.get(f"states.{j}.{name}")
            want = dtypes.element_type(dt).torch
            if t is None or t.dtype != want or tuple(t.shape) != (layout.num_seqs, *shape):
                found = "missing" if t is None else f"{t.dtype} {list(t.shape)}"
                raise HurrayFormatError(
                    f"snapshot.states.{name}",
                    f"states.{j}.{name} is {found}, the header declares {want} {[layout.num_seqs, *shape]}",
                )
            layer.append(t)
        out.append(layer)
    return out


def _layer_tensor(
    tensors: dict[str, torch.Tensor], descriptors: Fields, name: str, permissive: bool
) -> BlockPagedTensor:
    """One layer and role: its descriptor (hex in the metadata) and its tensors, checked as wire input."""
    need = [f"{name}.page_pool", f"{name}.block_table", f"{name}.seq_ptr"]
    missing = [n for n in need if n not in tensors]
    if missing or name not in descriptors.obj:
        raise HurrayFormatError("safetensors", f"{name} is incomplete (missing {missing or 'descriptor'})")
    try:
        raw = bytes.fromhex(descriptors.string(name, max_len=1 << 20))
    except ValueError:
        raise HurrayFormatError(f"safetensors.descriptors.{name}", "not a hex string") from None
    desc = decode_checked(raw, name, permissive=permissive)
    bp = desc.block_paged
    if bp is None:
        raise HurrayFormatError("layout_tag", f"{name}: expected a block-paged descriptor")
    pool = tensors[f"{name}.page_pool"]
    # The tensor any safetensors reader sees must be the one the descriptor declares: from_wire checks only the
    # byte count, and would reinterpret a float32 pool's bytes as float16, or heads and head_dim swapped.
    want_dtype = dtypes.torch_dtype(desc.type_tag)
    want_shape = (bp.num_pages, bp.page_size, *desc.shape[1:])  # [pages, page_size, heads, head_dim]
    if pool.dtype != want_dtype or tuple(pool.shape) != want_shape:
        raise HurrayFormatError(
            f"{name}.page_pool",
            f"is {pool.dtype} {list(pool.shape)}, its descriptor declares {want_dtype} {list(want_shape)}",
        )
    wire = [
        pool.contiguous().view(torch.uint8).reshape(-1),
        _index_bytes(tensors[f"{name}.block_table"], bp.index_type, f"{name}.block_table"),
        _index_bytes(tensors[f"{name}.seq_ptr"], bp.index_type, f"{name}.seq_ptr"),
    ]
    lens = tensors.get(f"{name}.seq_lens")
    if lens is not None and (lens.dtype != torch.int64 or lens.dim() != 1):
        raise HurrayFormatError(f"{name}.seq_lens", f"expected 1-D int64, found {lens.dtype} {list(lens.shape)}")
    return BlockPagedTensor.from_wire(desc, wire, seq_lens=lens, permissive=permissive)


def _index_bytes(t: torch.Tensor, index_type: str, name: str) -> torch.Tensor:
    """An int64 index tensor as the wire bytes of ``index_type`` (what from_wire widens back).

    Refuses values the wire type cannot hold instead of letting them wrap
    (a uint32 table entry of 2^32 would become page 0).
    """
    if t.dtype != torch.int64 or t.dim() != 1:
        raise HurrayFormatError(name, f"expected a 1-D int64 tensor, found {t.dtype} of shape {list(t.shape)}")
    hi = (1 << 63) - 1 if index_type == "uint64" else (1 << 32) - 1
    if t.numel() and (int(t.min()) < 0 or int(t.max()) > hi):
        raise HurrayFormatError(name, f"entries must lie in [0, {hi}] for {index_type or 'uint32'} indices")
    if index_type == "uint64":
        return t.contiguous().view(torch.uint8).reshape(-1)
    return t.to(torch.int32).contiguous().view(torch.uint8).reshape(-1)  # < 2^32: the same bytes as uint32
