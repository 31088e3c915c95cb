"""Repaging and importing on CUDA: the same pages as on the CPU, without a trip through host memory."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from synthetic import make_snapshot

import hurray_vllm as hv
from hurray_vllm.adapters.flash_attn import plan_flash_attn, to_flash_attn_all
from hurray_vllm.adapters.flashinfer import to_flashinfer
from hurray_vllm.kv.repage import repage_snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _to(snap: hv.KVSnapshot, device: str) -> hv.KVSnapshot:
    def move(t: hv.BlockPagedTensor) -> hv.BlockPagedTensor:
        return replace(
            t,
            page_pool=t.page_pool.to(device),
            block_table=t.block_table.to(device),
            seq_ptr=t.seq_ptr.to(device),
            seq_lens=None if t.seq_lens is None else t.seq_lens.to(device),
        )

    return replace(snap, keys=tuple(map(move, snap.keys)), values=tuple(map(move, snap.values)))


@pytest.mark.parametrize("target", [256, 48, 7])
def test_cuda_repage_equals_cpu_repage(target: int) -> None:
    cpu = make_snapshot([300, 41, 129], [0, 2, 1], 16, layers=2)
    gpu = _to(cpu, "cuda")
    a, b = repage_snapshot(cpu, target), repage_snapshot(gpu, target)
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True):
        assert y.page_pool.is_cuda
        assert torch.equal(x.page_pool, y.page_pool.cpu())
        assert torch.equal(x.block_table, y.block_table.cpu())


def test_import_into_cuda_caches() -> None:
    cpu = make_snapshot([300, 41, 129], [0, 2, 1], 16, layers=2)
    gpu = _to(cpu, "cuda")
    ref = to_flash_attn_all(cpu, page_size=256, reserve=8)
    plan = plan_flash_attn(gpu, page_size=256, reserve=8)
    shape = (plan.num_blocks + 3, 256, 2, 16)
    pools = [
        (
            torch.zeros(shape, dtype=torch.bfloat16, device="cuda"),
            torch.zeros(shape, dtype=torch.bfloat16, device="cuda"),
        )
        for _ in range(2)
    ]
    got = to_flash_attn_all(gpu, page_size=256, reserve=8, out=pools)
    for r, g in zip(ref, got, strict=True):
        assert torch.equal(r.k_cache, g.k_cache[: r.num_blocks].cpu())
        assert torch.equal(r.v_cache, g.v_cache[: r.num_blocks].cpu())
    # A CPU snapshot into CUDA caches: gathered on the CPU, copied once.
    fi = to_flashinfer(cpu, 1, page_size=32)
    k = torch.zeros((fi.num_pages + 1, 32, 2, 16), dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    into = to_flashinfer(cpu, 1, page_size=32, out=(k, v), device="cuda")
    assert torch.equal(fi.k_cache, into.k_cache[: fi.num_pages].cpu())
    assert into.paged_kv_indices.is_cuda
