"""The exporter on CUDA caches: device-side gather, pinned, overlapped copies to the host."""

from __future__ import annotations

import io

import pytest
import torch

import hurray_vllm as hv
from hurray_vllm.adapters.vllm import (
    CpuPacked,
    LogicalBHNC,
    SequenceState,
    export_layers,
    export_snapshot,
    export_stream,
)
from hurray_vllm.adapters.vllm.cache import EngineCache, write_blocks
from hurray_vllm.adapters.vllm.export import GatherBuffers, plan_batch, to_host_overlapped

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _caches(device: str, layers: int = 3, head_dim: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(64, 4, 16, 2 * head_dim, generator=g).to(torch.bfloat16).to(device) for _ in range(layers)]


SEQS = [
    SequenceState("a", [5, 9, 2, 40], 60, list(range(61))),
    SequenceState("b", [5, 9, 33], 40, list(range(41))),
]


@pytest.mark.parametrize("layout", [LogicalBHNC(64), CpuPacked("vec", 64)])
def test_cuda_export_equals_cpu_export(layout) -> None:  # type: ignore[no-untyped-def]
    cpu = export_snapshot(_caches("cpu"), layout, SEQS, block_size=16)
    gpu = export_snapshot(_caches("cuda"), layout, SEQS, block_size=16)
    assert gpu[0, "key"].page_pool.is_cuda
    for a, b in zip((*cpu.keys, *cpu.values), (*gpu.keys, *gpu.values)):
        assert torch.equal(a.page_pool, b.page_pool.cpu())


def test_cuda_stream_export_goes_through_pinned_buffers() -> None:
    layout = LogicalBHNC(64)
    want = io.BytesIO()
    export_stream(want, _caches("cpu"), layout, SEQS, block_size=16)
    got = io.BytesIO()
    export_stream(got, _caches("cuda"), layout, SEQS, block_size=16)
    assert got.getvalue() == want.getvalue()
    got.seek(0)
    assert hv.read_stream(got).num_layers == 3


MORE = [*SEQS, SequenceState("c", [7, 8, 10, 11, 12, 13], 90, list(range(90)))]


@pytest.mark.parametrize(
    ("layout", "head_dim"),
    # 8 KiB pages: K and V adjacent (one fill, one copy); 5 * 2-byte heads: V padded to 256 bytes.
    [(LogicalBHNC(64), 64), (CpuPacked("vec", 64), 64), (LogicalBHNC(5), 5)],
)
def test_cuda_stream_export_with_kept_buffers(layout, head_dim: int) -> None:  # type: ignore[no-untyped-def]
    """An odd layer count through the two alternating device buffer pairs, kept across exports that grow."""
    cpu, gpu = _caches("cpu", 7, head_dim), _caches("cuda", 7, head_dim)
    kept = GatherBuffers()
    for seqs in (SEQS, MORE, SEQS):
        want, got = io.BytesIO(), io.BytesIO()
        export_stream(want, cpu, layout, seqs, block_size=16)
        export_stream(got, gpu, layout, seqs, block_size=16, buffers=kept)
        assert got.getvalue() == want.getvalue()
    assert kept.nbytes > 0 and kept.twin().nbytes > 0


def test_host_layers_from_fresh_device_pools() -> None:
    """Pools allocated per layer (no gather buffers): each arrives pinned and equal to the CPU export."""
    layout = LogicalBHNC(64)
    want = export_snapshot(_caches("cpu", 5), layout, MORE, block_size=16)
    plan = plan_batch(MORE, 16)
    got = []
    for k, v in to_host_overlapped(export_layers(_caches("cuda", 5), layout, plan)):
        assert k.page_pool.is_pinned() and not k.block_table.is_cuda
        got.append((k.page_pool.clone(), v.page_pool.clone()))  # valid only until the next layer
    assert len(got) == 5
    for i, (k, v) in enumerate(got):
        assert torch.equal(k, want.keys[i].page_pool)
        assert torch.equal(v, want.values[i].page_pool)


def _fp8_cache(device: str, blocks: int, storage: torch.dtype, scale: float) -> EngineCache:
    return EngineCache(
        caches=[torch.zeros(blocks, 4, 16, 2 * 64, dtype=torch.uint8, device=device)],
        layer_names=["model.layers.0.self_attn.attn"],
        layout=LogicalBHNC(64),
        layout_name="vllm-LBNHC",
        storage_dtype=storage,
        model_dtype=torch.bfloat16,
        kv_cache_dtype="fp8",
        kv_scales=[(scale, scale)],
        fingerprint=hv.ModelFingerprint("LlamaForCausalLM", 1, 4, 64, "float8_e4m3"),
        block_size=16,
        engine="vllm test",
    )


@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_cuda_fp8_writes_quantize_as_the_cpu_ones(storage: torch.dtype) -> None:
    """vLLM divides by the fp8 scale: CUDA multiplied by its reciprocal instead, one float8 step off near ties."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every)]  # every finite bf16 value, the ties among them
    page = 16 * 4 * 64
    blocks = -(-every.numel() // page)
    keys = torch.zeros(blocks * page, dtype=torch.bfloat16)
    keys[: every.numel()] = every
    keys = keys.view(blocks, 16, 4, 64)
    scale, top = 0.3, torch.finfo(storage).max
    divided = (keys.float() / torch.tensor(scale)).clamp(-top, top).to(storage)
    by_reciprocal = (keys.float() * (1 / torch.tensor(scale))).clamp(-top, top).to(storage)
    assert not torch.equal(divided.view(torch.uint8), by_reciprocal.view(torch.uint8))  # the pools hold such ties
    ids = torch.arange(blocks).flip(0)
    cpu, gpu = _fp8_cache("cpu", blocks, storage, scale), _fp8_cache("cuda", blocks, storage, scale)
    write_blocks(cpu, 0, ids, keys, keys.neg())
    write_blocks(gpu, 0, ids, keys.cuda(), keys.neg().cuda())
    assert torch.equal(gpu.caches[0].cpu(), cpu.caches[0])
    k, _ = LogicalBHNC(64).gather(cpu.caches[0].view(storage), ids)
    assert torch.equal(k.view(torch.uint8), divided.view(torch.uint8))
