"""The exporter on CUDA caches: device-side gather, pinned, overlapped copies to the host."""

from __future__ import annotations

import io

import pytest
import torch

import hurray_vllm as hv
from hurray_vllm.adapters.vllm import CpuPacked, LogicalBHNC, SequenceState, export_snapshot, export_stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _caches(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(64, 4, 16, 2 * 64, generator=g).to(torch.bfloat16).to(device) for _ in range(3)]


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
