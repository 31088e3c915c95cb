"""The CPU backend's packed cache, written by vLLM's own op, read back for every ISA."""

from __future__ import annotations

import pytest
import torch
from conftest import require

from hurray_vllm.adapters.vllm import CpuPacked

H = 2
# (isa, dtype, head_dim, block_size): what vLLM's _get_attn_isa can pick, and fp32 for the AMX pair size 1.
CASES = [
    ("vec", torch.bfloat16, 64, 32),
    ("vec", torch.float16, 32, 64),
    ("vec", torch.float32, 128, 32),
    ("vec16", torch.bfloat16, 80, 32),
    ("vec16", torch.float32, 112, 32),
    ("amx", torch.bfloat16, 64, 32),
    ("amx", torch.bfloat16, 128, 128),
    ("amx", torch.float16, 32, 64),
    ("amx", torch.float32, 64, 32),
]


def _write(isa: str, dtype: torch.dtype, d: int, n: int, kv_cache_dtype: str = "auto", scale: float = 1.0):  # type: ignore[no-untyped-def]
    ops = require("vllm._custom_ops")
    blocks = 6
    storage = torch.uint8 if kv_cache_dtype != "auto" else dtype
    cache = torch.zeros(blocks, H, n, 2 * d, dtype=storage)
    # Tokens land in blocks 4, 1 and 5 (5 partly filled), as a block table would place them.
    slots = torch.cat([torch.arange(4 * n, 5 * n), torch.arange(n, 2 * n), torch.arange(5 * n, 5 * n + n // 2 + 3)])
    g = torch.Generator().manual_seed(n + d)
    key = torch.randn(slots.numel(), H, d, generator=g).to(dtype)
    value = torch.randn(slots.numel(), H, d, generator=g).to(dtype)
    kv = cache.view(blocks, H, 2 * n, d)
    kc, vc = kv.chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(
            key, value, kc, vc, slots, isa, k_scale=scale, v_scale=scale, kv_cache_dtype=kv_cache_dtype
        )
    except RuntimeError as exc:
        # vLLM's CPU build carries the AMX and fp8 kernels only for CPUs that run them (AVX-512 or AMX);
        # elsewhere the op refuses, and CpuPacked's layout for them is checked by tests/test_native.py.
        if "Unsupported CPU attention configuration" not in str(exc):
            raise
        cpu = torch.backends.cpu.get_cpu_capability()
        # Only the documented refusals skip (docs/testing.md): amx on a CPU without AMX tiles, fp8 on a CPU
        # with neither AVX-512 nor AMX (vLLM's _get_attn_isa). Any other refusal is a regression.
        amx, avx512 = torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx512_supported()
        if not ((isa == "amx" and not amx) or (kv_cache_dtype != "auto" and not (amx or avx512))):
            raise AssertionError(f"vLLM refused {isa} caches of {kv_cache_dtype}/{dtype} on this CPU ({cpu})") from exc
        pytest.skip(f"needs a CPU whose vLLM build writes {isa} caches of {kv_cache_dtype}/{dtype} (this CPU: {cpu})")
    return cache, slots, key, value


def _expected(slots: torch.Tensor, x: torch.Tensor, n: int, ids: list[int]) -> list[torch.Tensor]:
    """Per requested block, the rows written there (in slot order)."""
    out = []
    for b in ids:
        sel = (slots // n) == b
        out.append(x[sel][torch.argsort(slots[sel] % n)])
    return out


@pytest.mark.parametrize(("isa", "dtype", "d", "n"), CASES)
def test_cpu_packing(isa: str, dtype: torch.dtype, d: int, n: int) -> None:
    cache, slots, key, value = _write(isa, dtype, d, n)
    ids = [4, 1, 5]
    k, v = CpuPacked(isa, d).gather(cache, torch.tensor(ids))
    assert k.shape == (3, n, H, d) and k.is_contiguous()
    for j, (ke, ve) in enumerate(zip(_expected(slots, key, n, ids), _expected(slots, value, n, ids))):
        assert torch.equal(k[j, : ke.shape[0]], ke), f"{isa} keys of block {ids[j]}"
        assert torch.equal(v[j, : ve.shape[0]], ve), f"{isa} values of block {ids[j]}"


@pytest.mark.parametrize(("isa", "dtype", "d", "n"), CASES)
def test_scatter_packs_what_the_op_packs(isa: str, dtype: torch.dtype, d: int, n: int) -> None:
    """CpuPacked.scatter (native kernels here) writes the bytes cpu_attn_reshape_and_cache writes."""
    cache, slots, key, value = _write(isa, dtype, d, n)
    full = [4, 1]  # the blocks the op filled completely
    pages = [torch.stack(_expected(slots, x, n, full)) for x in (key, value)]
    ours = torch.zeros_like(cache)
    CpuPacked(isa, d).scatter(ours, torch.tensor(full), *pages)
    assert torch.equal(ours[full].view(torch.uint8), cache[full].view(torch.uint8))
    rest = [b for b in range(cache.shape[0]) if b not in full]
    assert not ours[rest].view(torch.uint8).any()


def _within_one_fp8_step(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Stored as fp8(x / scale), rounded toward zero: within one fp8 step (25% for e5m2) of the input."""
    return bool(((got.float() - want.float()).abs() <= 0.26 * want.float().abs() + 1e-2).all())


@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize(
    ("kv_cache_dtype", "fp8"), [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]
)
def test_cpu_packing_fp8(isa: str, kv_cache_dtype: str, fp8: torch.dtype) -> None:
    scale = 0.25
    cache, slots, key, value = _write(isa, torch.bfloat16, 64, 32, kv_cache_dtype, scale)
    ids = [4, 1, 5]
    k, v = CpuPacked(isa, 64).gather(cache.view(fp8), torch.tensor(ids))
    assert k.dtype == v.dtype == fp8
    for name, got, x in (("keys", k, key), ("values", v, value)):
        for j, want in enumerate(_expected(slots, x, 32, ids)):
            assert _within_one_fp8_step(got[j, : want.shape[0]].float() * scale, want), (
                f"{isa} {name} of block {ids[j]}"
            )
        # The relaxed check still tells pages apart: block 4's rows read as block 1's are refused.
        wrong = _expected(slots, x, 32, [1])[0]
        rows = min(wrong.shape[0], got.shape[1])
        assert not _within_one_fp8_step(got[0, :rows].float() * scale, wrong[:rows]), f"{isa} {name}: wrong page"
    keys4 = _expected(slots, key, 32, [4])[0]
    assert not _within_one_fp8_step(v[0, : keys4.shape[0]].float() * scale, keys4), "values read as keys"


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_fp8_tolerance_refuses_wrong_pages_on_any_cpu(fp8: torch.dtype) -> None:
    """The 26% check of test_cpu_packing_fp8 accepts fp8-rounded data and refuses another page's (any CPU)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 32, H, 64, generator=g).to(torch.bfloat16)
    scale = 0.25
    stored = (x.float() / scale).to(fp8).float() * scale
    assert _within_one_fp8_step(stored, x)
    assert not _within_one_fp8_step(stored.roll(1, dims=0), x)  # every page read from its neighbour
    assert not _within_one_fp8_step(stored[:, 1:], x[:, :-1])  # rows shifted by one token


def test_unknown_isa_is_refused() -> None:
    import hurray_vllm as hv

    with pytest.raises(hv.HurrayFormatError, match="neon"):
        CpuPacked("neon", 64)
