"""Synthetic snapshots shared by the importer, store and transport tests (no engine needed)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

import hurray_vllm as hv
from hurray_vllm import BlockPagedTensor, KVSnapshot, LatentSplit

__all__ = ["DEEPSEEK", "FP8", "example_chunk", "latent_snapshot", "make_flashinfer_snapshot", "make_snapshot"]

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# DeepSeek-V3's MLA latent: 512 values of compressed KV, then 64 of the rotated key (latent_snapshot's default).
DEEPSEEK = LatentSplit(512, 64, "deepseek_v3")


def make_snapshot(
    lens: Sequence[int],
    shares: Sequence[int],
    page_size: int,
    *,
    heads: int = 2,
    dim: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    layers: int = 2,
    spare_pages: int = 2,
    seed: int = 0,
) -> hv.KVSnapshot:
    """A snapshot whose sequence ``s`` reuses the first ``shares[s]`` pages of sequence ``s - 1``.

    Fresh page ids are a random permutation of the pool (plus ``spare_pages``
    pages nobody references); fp8 snapshots get per-layer ``kv_scales``.
    """
    gen = torch.Generator().manual_seed(seed)
    per_seq: list[list[int]] = []
    fresh_needed = 0
    for i, n in enumerate(lens):
        pages = -(-n // page_size)
        share = min(shares[i], pages, len(per_seq[-1])) if i else 0
        per_seq.append([-1] * share + [-2] * (pages - share))
        fresh_needed += pages - share
    num_pages = fresh_needed + spare_pages
    ids = iter(torch.randperm(max(num_pages, 1), generator=gen).tolist())
    table: list[int] = []
    ptr = [0]
    prev: list[int] = []
    for own in per_seq:
        row = [prev[j] if x == -1 else next(ids) for j, x in enumerate(own)]
        table.extend(row)
        ptr.append(len(table))
        prev = row
    bt, sp, sl = (torch.tensor(x, dtype=torch.int64) for x in (table, ptr, list(lens)))

    def pool() -> torch.Tensor:
        return (torch.randn((num_pages, page_size, heads, dim), generator=gen) * 2).to(dtype)

    keys = tuple(hv.BlockPagedTensor(pool(), bt, sp, sl, "key", i) for i in range(layers))
    values = tuple(hv.BlockPagedTensor(pool(), bt, sp, sl, "value", i) for i in range(layers))
    scales = tuple((0.5 + 0.25 * i, 0.75 + 0.5 * i) for i in range(layers)) if dtype in FP8 else None
    return hv.KVSnapshot(keys=keys, values=values, kv_scales=scales)


def make_flashinfer_snapshot(
    lens: list[int],
    *,
    page_size: int = 4,
    heads: int = 2,
    dim: int = 8,
    dtype: torch.dtype = torch.float16,
    layers: int = 2,
    kv_scales: tuple[tuple[float, float], ...] | None = None,
    seed: int = 0,
    spare_pages: int = 0,
    shuffle: bool = False,
    scale: float = 2.0,
) -> KVSnapshot:
    """Sequence 0 owns fresh pages from 0; a later sequence with a full first page shares page 0 (a prefix).

    ``spare_pages`` adds pages no sequence references; ``shuffle`` permutes the page ids;
    the values are ``scale`` times standard normal.
    """
    table: list[int] = []
    ptr = [0]
    next_page = 0
    share = bool(lens) and lens[0] >= page_size
    for s, n in enumerate(lens):
        for j in range(-(-n // page_size)):
            if s and j == 0 and share and n >= page_size:
                table.append(0)
            else:
                table.append(next_page)
                next_page += 1
        ptr.append(len(table))
    num_pages = max(next_page, 1) + spare_pages
    gen = torch.Generator().manual_seed(seed)
    bt, sp, sl = (torch.tensor(x, dtype=torch.int64) for x in (table, ptr, lens))
    if shuffle:
        perm = torch.randperm(num_pages, generator=gen)
        bt = perm[bt] if table else bt

    def pool() -> torch.Tensor:
        return (torch.randn(num_pages, page_size, heads, dim, generator=gen) * scale).to(dtype)

    return KVSnapshot(
        keys=tuple(BlockPagedTensor(pool(), bt, sp, sl, "key", i) for i in range(layers)),
        values=tuple(BlockPagedTensor(pool(), bt, sp, sl, "value", i) for i in range(layers)),
        kv_scales=kv_scales,
    )


def example_chunk() -> tuple[str, str, KVSnapshot]:
    """The spec example's one whole chunk of 4 tokens, keyed as a connector stores it: ``(namespace, key, chunk)``."""
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks.keys import chunks_of, namespace_of

    ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    return namespace_of(chunk.fingerprint), key, chunk


def save_unchecked(snap: KVSnapshot, path: object) -> None:
    """Write ``snap`` as ``hv.save`` does, without its checks: a rule-breaking snapshot, for readers to refuse."""
    from hurray_vllm.containers.io import save_records
    from hurray_vllm.containers.schema import snapshot_records

    save_records(snapshot_records(snap), path)  # type: ignore[arg-type]


def latent_snapshot(lens: list[int], *, page: int = 16, split: LatentSplit = DEEPSEEK, fp8: bool = False) -> KVSnapshot:
    """A one-layer MLA latent snapshot: sequence s > 0 shares sequence 0's first page; pages shuffled; one spare."""
    gen = torch.Generator().manual_seed(len(lens))
    per = [-(-n // page) for n in lens]
    pages = per[0] + sum(max(p - 1, 0) for p in per[1:]) + 1
    order = torch.randperm(pages, generator=gen).tolist()
    table, ptr, used = [], [0], 0
    for s, p in enumerate(per):
        own = order[used : used + p] if s == 0 else [table[0], *order[used : used + p - 1]][:p]
        used += p if s == 0 else max(p - 1, 0)
        table += own
        ptr.append(len(table))
    pool = torch.randn((pages, page, 1, split.head_dim), generator=gen)
    pool = (pool / 2).to(torch.float8_e4m3fn) if fp8 else pool.to(torch.bfloat16)
    t = BlockPagedTensor(pool, torch.tensor(table), torch.tensor(ptr), torch.tensor(lens), "fused", 0)
    scales = ((2.0, 2.0),) if fp8 else None
    return KVSnapshot.from_layers([(t,)], latent=split, kv_scales=scales)
