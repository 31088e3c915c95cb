"""``write_blocks(..., heads=)``: a tensor-parallel slice of a chunk is written into its own heads of the cache.

Writing each slice where it lies must give the very bytes of writing the
joined chunk at once, for every layout the connector writes (the CPU
packings and the GPU backends' logical ``[B, H, N, 2*D]`` view); a cache that
cannot be written a part of its heads at a time (fp8 on the CPU: only the
engine's op quantizes) says so, and the worker joins the slices instead.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hurray_vllm as hv
from hurray_vllm.adapters.vllm.cache import EngineCache, write_blocks
from hurray_vllm.adapters.vllm.layouts import CpuPacked, KVLayout, LogicalBHNC, MLALatent

H, D, N, BLOCKS = 4, 16, 32, 6


def _engine_cache(layout: KVLayout, *, fp8: bool = False, head_dim: int = D) -> EngineCache:
    cache = torch.zeros((BLOCKS, H, N, 2 * head_dim), dtype=torch.uint8 if fp8 else torch.bfloat16)
    return EngineCache(
        caches=[cache],
        layer_names=["model.layers.0.self_attn.attn"],
        layout=layout,
        layout_name=layout.name,
        storage_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
        model_dtype=torch.bfloat16,
        kv_cache_dtype="fp8" if fp8 else "auto",
        kv_scales=[(0.5, 0.5)] if fp8 else None,
        fingerprint=hv.ModelFingerprint("LlamaForCausalLM", 1, H, head_dim, "float8_e4m3" if fp8 else "bfloat16"),
        block_size=N,
        engine="vllm test",
    )


@pytest.mark.parametrize("layout", [CpuPacked("vec", D), CpuPacked("vec16", D), CpuPacked("amx", D), LogicalBHNC(D)])
@pytest.mark.parametrize("split", [[range(0, 2), range(2, 4)], [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]])
def test_slices_written_where_they_lie_equal_the_whole_chunk_written_at_once(
    layout: KVLayout, split: list[range]
) -> None:
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn((3, N, H, D), generator=gen).to(torch.bfloat16) for _ in range(2))
    ids = torch.tensor([4, 1, 2])
    whole, sliced = _engine_cache(layout), _engine_cache(layout)
    assert sliced.writes_head_slices
    write_blocks(whole, 0, ids, keys, values)
    for heads in split:
        write_blocks(
            sliced, 0, ids, keys[:, :, heads.start : heads.stop], values[:, :, heads.start : heads.stop], heads=heads
        )
    assert torch.equal(whole.caches[0].view(torch.int16), sliced.caches[0].view(torch.int16))
    assert whole.caches[0].view(torch.int16).any()
    k, v = layout.gather(sliced.caches[0], ids)
    assert torch.equal(k, keys) and torch.equal(v, values)


def test_heads_outside_the_cache_or_an_fp8_cpu_cache_are_refused() -> None:
    ec = _engine_cache(CpuPacked("vec", D))
    part = torch.zeros((1, N, 2, D), dtype=torch.bfloat16)
    with pytest.raises(hv.HurrayArgumentError, match=r"heads 3\.\.5") as err:
        write_blocks(ec, 0, torch.tensor([1]), part, part, heads=range(3, 5))
    assert err.value.field == "heads"
    fp8 = _engine_cache(CpuPacked("vec", D), fp8=True)
    assert not fp8.writes_head_slices
    with pytest.raises(hv.HurrayArgumentError, match=r"heads 0\.\.2"):
        write_blocks(fp8, 0, torch.tensor([1]), part, part, heads=range(0, 2))


@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_token_major_cache_is_written_whole_or_by_heads(storage: torch.dtype) -> None:
    """A GPU backend's fp8 cache: quantized with its scales (saturated, as vLLM writes), copied as bytes."""
    gen = torch.Generator().manual_seed(1)
    keys, values = (torch.randn((2, N, H, D), generator=gen).to(torch.bfloat16) for _ in range(2))
    keys[0, 0, 0, 0] = 1e6  # far past float8's range: saturated, never inf
    ids = torch.tensor([3, 0])
    whole, sliced = (dataclasses.replace(_engine_cache(LogicalBHNC(D), fp8=True), storage_dtype=storage) for _ in "ab")
    write_blocks(whole, 0, ids, keys, values)
    for heads in (range(0, 1), range(1, 4)):
        write_blocks(
            sliced, 0, ids, keys[:, :, heads.start : heads.stop], values[:, :, heads.start : heads.stop], heads=heads
        )
    assert torch.equal(whole.caches[0], sliced.caches[0])
    k, v = LogicalBHNC(D).gather(whole.caches[0].view(storage), ids)
    top = torch.finfo(storage).max
    assert torch.isfinite(k.float()).all() and k[0, 0, 0, 0].float() == top
    want = (keys.float() / 0.5).clamp(-top, top).to(storage)
    assert torch.equal(k.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), (values.float() / 0.5).to(storage).view(torch.uint8))


#: The CPU fp8 case at head size 64, one vLLM's CPU op takes: past the checks, it would write.
_LAYOUTS = [
    (LogicalBHNC(D), False, D),
    (LogicalBHNC(D), True, D),
    (CpuPacked("vec", D), False, D),
    (CpuPacked("vec", 64), True, 64),
    (CpuPacked("amx", 64), True, 64),
]


def _unchanged(ec: EngineCache, before: torch.Tensor) -> bool:
    return torch.equal(ec.caches[0].view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize(("layout", "fp8", "head_dim"), _LAYOUTS)
@pytest.mark.parametrize("ids", [[4], [4, 2, 5], [[4, 2]]], ids=["fewer", "more", "2-D"])
def test_block_ids_that_are_not_one_per_pool_block_are_refused_before_writing(
    layout: KVLayout, fp8: bool, head_dim: int, ids: list[int]
) -> None:
    """On the CPU fp8 path vLLM's op writes a slot per pool token: fewer ids than blocks overran the heap."""
    ec = _engine_cache(layout, fp8=fp8, head_dim=head_dim)
    before = ec.caches[0].clone()
    pool = torch.ones((2, N, H, head_dim), dtype=torch.bfloat16)
    with pytest.raises(hv.HurrayFormatError) as err:
        write_blocks(ec, 0, torch.tensor(ids), pool, pool)
    assert err.value.field == "block_ids"
    assert _unchanged(ec, before)


@pytest.mark.parametrize(("layout", "fp8", "head_dim"), _LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_block_ids_that_are_not_integers_are_refused_before_writing(
    layout: KVLayout, fp8: bool, head_dim: int, dtype: torch.dtype
) -> None:
    """Float ids were truncated on the token-major path: 1.7 wrote block 1."""
    ec = _engine_cache(layout, fp8=fp8, head_dim=head_dim)
    before = ec.caches[0].clone()
    pool = torch.ones((2, N, H, head_dim), dtype=torch.bfloat16)
    with pytest.raises(hv.HurrayArgumentError) as err:
        write_blocks(ec, 0, torch.tensor([1.7, 0.0]).to(dtype), pool, pool)
    assert err.value.field == "block_ids"
    assert _unchanged(ec, before)


def _mla_cache() -> EngineCache:
    width = 96
    return EngineCache(
        caches=[torch.zeros((BLOCKS, N, width), dtype=torch.bfloat16)],
        layer_names=["model.layers.0.self_attn.attn"],
        layout=MLALatent(width),
        layout_name="vllm-mla",
        storage_dtype=torch.bfloat16,
        model_dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        kv_scales=None,
        fingerprint=hv.ModelFingerprint("DeepseekV3ForCausalLM", 1, 1, width, "bfloat16"),
        block_size=N,
        engine="vllm test",
    )


@pytest.mark.parametrize(("layout", "fp8", "head_dim"), _LAYOUTS)
def test_pools_of_another_head_geometry_are_refused_by_name(layout: KVLayout, fp8: bool, head_dim: int) -> None:
    ec = _engine_cache(layout, fp8=fp8, head_dim=head_dim)
    before = ec.caches[0].clone()
    ids = torch.tensor([1])
    cases = (
        ((1, N, H - 1, head_dim), (1, N, H - 1, head_dim), "num_heads"),
        ((1, N, H, head_dim // 2), (1, N, H, head_dim // 2), "head_dim"),  # the CPU fp8 op read past them
        ((N, H, head_dim), (N, H, head_dim), "keys"),
        ((1, N, H, head_dim), (1, N, H, head_dim // 2), "values"),
    )
    for kshape, vshape, field in cases:
        keys, values = torch.zeros(kshape, dtype=torch.bfloat16), torch.zeros(vshape, dtype=torch.bfloat16)
        with pytest.raises(hv.HurrayFormatError) as err:
            write_blocks(ec, 0, ids, keys, values)
        assert err.value.field == field
    assert _unchanged(ec, before)


def test_latents_of_another_geometry_are_refused_by_name() -> None:
    ec = _mla_cache()
    before = ec.caches[0].clone()
    for shape, ids, field in (
        ((1, N, 2, 96), [1], "num_heads"),
        ((1, N, 1, 64), [1], "head_dim"),
        ((N, 1, 96), [1], "latent"),
        ((2, N, 1, 96), [1], "block_ids"),
    ):
        with pytest.raises(hv.HurrayFormatError) as err:
            write_blocks(ec, 0, torch.tensor(ids), torch.zeros(shape, dtype=torch.bfloat16))
        assert err.value.field == field
    assert _unchanged(ec, before)
