"""Snapshots as ``.safetensors`` files that any safetensors reader opens.

Tensors, per layer ``i`` and role ``r`` in ``key``/``value``::

    layers.{i}.{r}.page_pool     [num_pages, page_size, num_kv_heads, head_dim], the pool dtype
    layers.{i}.{r}.block_table   int64 [total_logical_pages]
    layers.{i}.{r}.seq_ptr       int64 [num_seqs + 1]
    layers.{i}.{r}.seq_lens      int64 [num_seqs]
    layers.{i}.kv_scales         float32 [2]          (fp8 caches only)
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

from ..errors import HurrayFormatError
from ..kv.paged import BlockPagedTensor
from ..kv.snapshot import KVSnapshot, ModelFingerprint, SnapshotSource
from ..wire.descriptor import decode_descriptor, encode_descriptor
from ..wire.rules import raise_if
from .atomic import atomic_path
from .schema import FORMAT_NAME, FORMAT_VERSION, flatten_tokens, snapshot_metadata, split_tokens

__all__ = ["save_safetensors", "load_safetensors"]


def _safetensors() -> Any:
    try:
        import safetensors.torch as st
    except ImportError:
        raise HurrayFormatError(
            "safetensors",
            "the safetensors package is needed for .safetensors files: pip install 'hurray-vllm[safetensors]'",
        ) from None
    return st


def save_safetensors(snap: KVSnapshot, path: str | os.PathLike[str]) -> int:
    """Write ``snap`` to ``path`` as safetensors (atomically); returns the file size."""
    st = _safetensors()
    tensors: dict[str, torch.Tensor] = {}
    descriptors: dict[str, str] = {}
    for i, (k, v) in enumerate(snap.layers()):
        for t in (k, v):
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
    """Read a snapshot written by :func:`save_safetensors` (checked like any Hurray input)."""
    st = _safetensors()
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            names = set(f.keys())
    except Exception as exc:  # safetensors raises its own error types for malformed headers
        raise HurrayFormatError("safetensors", f"{path}: not a readable safetensors file ({exc})") from None
    if metadata.get("format") != FORMAT_NAME:
        raise HurrayFormatError("safetensors.metadata", f"{path} is a safetensors file but not a hurray-vllm snapshot")
    try:
        meta = json.loads(metadata["snapshot"])
        descriptors = json.loads(metadata["descriptors"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise HurrayFormatError("safetensors.metadata", f"malformed snapshot metadata: {exc}") from None
    tensors = st.load_file(str(path))
    num_layers = int(meta.get("num_layers", 0))
    keys, values = [], []
    scales = []
    for i in range(num_layers):
        pair = []
        for role in ("key", "value"):
            name = f"layers.{i}.{role}"
            need = [f"{name}.page_pool", f"{name}.block_table", f"{name}.seq_ptr"]
            missing = [n for n in need if n not in names]
            if missing or name not in descriptors:
                raise HurrayFormatError(
                    "safetensors", f"{path}: {name} is incomplete (missing {missing or 'descriptor'})"
                )
            desc = decode_descriptor(bytes.fromhex(descriptors[name]))
            pool = tensors[f"{name}.page_pool"]
            wire = [
                pool.contiguous().view(torch.uint8).reshape(-1),
                _index_bytes(tensors[f"{name}.block_table"], desc.block_paged.index_type if desc.block_paged else ""),
                _index_bytes(tensors[f"{name}.seq_ptr"], desc.block_paged.index_type if desc.block_paged else ""),
            ]
            lens = tensors.get(f"{name}.seq_lens")
            t = BlockPagedTensor.from_wire(desc, wire, seq_lens=lens, permissive=permissive)
            pair.append(t)
        keys.append(pair[0])
        values.append(pair[1])
        if f"layers.{i}.kv_scales" in names:
            sc = tensors[f"layers.{i}.kv_scales"]
            scales.append((float(sc[0]), float(sc[1])))
    ids, ptr = tensors.get("token_ids"), tensors.get("token_ptr")
    token_ids: tuple[tuple[int, ...], ...] = ()
    if ids is not None and ptr is not None:
        token_ids = tuple(split_tokens(ids, ptr))
    if scales and len(scales) != num_layers:
        raise HurrayFormatError("kv_scales", "some layers carry fp8 scales and others do not")
    snap = KVSnapshot(
        keys=tuple(keys),
        values=tuple(values),
        token_ids=token_ids,
        fingerprint=ModelFingerprint.from_json(meta["fingerprint"]) if meta.get("fingerprint") else None,
        kv_scales=tuple(scales) if scales else None,
        source=SnapshotSource.from_json(meta["source"]) if meta.get("source") else None,
        request_ids=tuple(meta["request_ids"]) if meta.get("request_ids") is not None else None,
        extra=dict(meta.get("extra") or {}),
    )
    raise_if(snap.validate(permissive=permissive, tensors=False), "snapshot")
    return snap


def _index_bytes(t: torch.Tensor, index_type: str) -> torch.Tensor:
    """An int64 index tensor as the wire bytes of ``index_type`` (what from_wire widens back)."""
    wire = torch.uint64 if index_type == "uint64" else torch.int32
    return t.to(torch.int64).to(wire).contiguous().view(torch.uint8).reshape(-1)
