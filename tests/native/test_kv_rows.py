"""The one-pass native gather of vLLM 0.32's logical [B, H, N, 2*D] cache: byte-identical to the torch path."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hurray_vllm import HurrayFormatError, native
from hurray_vllm.adapters.vllm.layouts import KV_CACHE_LAYOUT_ORDERS, LogicalBHNC, layer_view_from_buffer

#: float8 as torch float8 and as the raw uint8 storage vLLM allocates for an fp8 cache.
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8]


@pytest.fixture
def lib():  # type: ignore[no-untyped-def]
    """The native kernels, loaded (fails in CI where they must build, skips elsewhere without them)."""
    saved = dict(native._state)
    native._state.clear()
    got = native.library()
    if got is None and os.environ.get("CI") == "true":
        pytest.fail(f"native kernels must build in CI: {native.unavailable_reason()}")
    if got is None:
        native._state.update(saved)
        pytest.skip(f"no native kernels here: {native.unavailable_reason()}")
    yield got
    native._state.clear()
    native._state.update(saved)


def _views(layout: str, dtype: torch.dtype, layers: int, b: int, h: int, n: int, d: int, seed: int):  # type: ignore[no-untyped-def]
    """Per-layer views of one flat buffer of random bytes (NaN bit patterns included), as vLLM makes them."""
    es = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (layers * b * h * n * 2 * d * es,), generator=g, dtype=torch.uint8)
    return layer_view_from_buffer(
        raw, layout, num_layers=layers, num_blocks=b, num_kv_heads=h, block_size=n, head_dim=d, dtype=dtype
    )


def _torch_gather(cache: torch.Tensor, d: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's gather, spelled out (``index_select`` on the transposed halves)."""
    return (
        cache[..., :d].transpose(1, 2).index_select(0, ids),
        cache[..., d:].transpose(1, 2).index_select(0, ids),
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.is_contiguous() and a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(_bits(a), _bits(b))


def _spy(monkeypatch: pytest.MonkeyPatch, lib) -> list[int]:  # type: ignore[no-untyped-def]
    """Count the native kernel's calls (the library's function, replaced on the loaded CDLL)."""
    calls: list[int] = []
    fn = lib.hurray_kv_rows

    def counted(*args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return fn(*args)

    monkeypatch.setattr(lib, "hurray_kv_rows", counted)
    return calls


@pytest.mark.parametrize("layout", sorted(KV_CACHE_LAYOUT_ORDERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("given_out", [False, True], ids=["alloc", "out"])
def test_native_gather_equals_the_torch_gather_in_every_layout(
    layout: str, dtype: torch.dtype, given_out: bool, lib, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    b, h, n, d = 7, 3, 5, 9  # odd everything
    ids = torch.tensor([6, 0, 3, 3, 1, 6])  # unsorted, duplicated
    calls = _spy(monkeypatch, lib)
    for cache in _views(layout, dtype, 3, b, h, n, d, seed=len(layout)):
        want = _torch_gather(cache, d, ids)
        out = tuple(torch.full_like(w, 7) for w in want) if given_out else None
        got = LogicalBHNC(d).gather(cache, ids, out)
        _same(got, want)
        if out is not None:
            assert got[0] is out[0] and got[1] is out[1]
    assert len(calls) == 3  # one native call per layer: the torch path was not taken


@pytest.mark.parametrize("given_out", [False, True], ids=["alloc", "out"])
def test_no_block_ids_gather_empty_pools(given_out: bool, lib) -> None:  # type: ignore[no-untyped-def]
    (cache,) = _views("LBNHC", torch.bfloat16, 1, 4, 2, 3, 5, seed=1)
    ids = torch.empty(0, dtype=torch.int64)
    out = (torch.empty(0, 3, 2, 5, dtype=torch.bfloat16), torch.empty(0, 3, 2, 5, dtype=torch.bfloat16))
    got = LogicalBHNC(5).gather(cache, ids, out if given_out else None)
    assert [tuple(t.shape) for t in got] == [(0, 3, 2, 5)] * 2


def test_block_ids_outside_the_cache_are_refused_before_the_kernel(lib, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    (cache,) = _views("LBNHC", torch.float16, 1, 4, 2, 3, 5, seed=2)
    calls = _spy(monkeypatch, lib)
    for bad in ([4], [0, -1], [2**40]):
        with pytest.raises(HurrayFormatError) as err:
            LogicalBHNC(5).gather(cache, torch.tensor(bad))
        assert err.value.field == "block_ids"
    assert not calls


def test_int32_ids_and_a_view_into_a_larger_buffer_gather_the_same(lib) -> None:  # type: ignore[no-untyped-def]
    (cache,) = _views("BLNHC", torch.bfloat16, 1, 6, 4, 3, 5, seed=3)
    window = cache[1:5, 1:3]  # storage offset, strides of the whole buffer
    ids = torch.tensor([3, 0, 2], dtype=torch.int32)
    _same(LogicalBHNC(5).gather(window, ids), _torch_gather(window, 5, ids.long()))


def test_a_cache_whose_last_axis_is_strided_takes_the_torch_path(lib, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    b, h, n, d = 5, 2, 3, 4
    wide = torch.randn(b, h, n, 2 * d, 2).to(torch.bfloat16)
    cache = wide[..., 0]  # last stride 2
    assert cache.stride(3) != 1
    calls = _spy(monkeypatch, lib)
    ids = torch.tensor([4, 1, 1])
    _same(LogicalBHNC(d).gather(cache, ids), _torch_gather(cache, d, ids))
    assert not calls


def test_destinations_the_kernel_cannot_take_go_to_the_torch_path(lib, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    (cache,) = _views("LBNHC", torch.float32, 1, 4, 2, 3, 5, seed=4)
    ids = torch.tensor([1, 3])
    calls = _spy(monkeypatch, lib)
    with pytest.raises(HurrayFormatError) as err:  # not contiguous: refused, as before
        LogicalBHNC(5).gather(cache, ids, tuple(torch.empty(2, 3, 5, 2).transpose(2, 3) for _ in range(2)))
    assert err.value.field == "out"
    with pytest.raises(HurrayFormatError):  # the wrong dtype
        LogicalBHNC(5).gather(cache, ids, tuple(torch.empty(2, 3, 2, 5, dtype=torch.float16) for _ in range(2)))
    assert not calls


def test_switched_off_the_torch_path_gathers_the_same(lib, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    (cache,) = _views("LBNHC", torch.bfloat16, 1, 6, 3, 4, 7, seed=5)
    ids = torch.tensor([5, 2, 2, 0])
    fast = LogicalBHNC(7).gather(cache, ids)
    monkeypatch.setenv("HURRAY_VLLM_NATIVE", "0")
    native._state.clear()
    assert native.library() is None
    _same(LogicalBHNC(7).gather(cache, ids), fast)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layout=st.sampled_from(sorted(KV_CACHE_LAYOUT_ORDERS)),
    dtype=st.sampled_from(DTYPES),
    shape=st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(1, 5), st.integers(1, 9)),
    data=st.data(),
)
def test_any_geometry_and_ids_gather_as_torch_does(layout, dtype, shape, data, lib) -> None:  # type: ignore[no-untyped-def]
    b, h, n, d = shape
    ids = torch.tensor(data.draw(st.lists(st.integers(0, b - 1), max_size=9)), dtype=torch.int64)
    layers = data.draw(st.integers(1, 3))
    layer = data.draw(st.integers(0, layers - 1))
    cache = _views(layout, dtype, layers, b, h, n, d, seed=data.draw(st.integers(0, 2**16)))[layer]
    _same(LogicalBHNC(d).gather(cache, ids), _torch_gather(cache, d, ids))


def test_destinations_that_share_memory_with_the_cache_take_the_torch_path() -> None:
    """The kernel would read rows it already wrote: torch's index_select refuses such ``out``, so it decides."""
    from hurray_vllm.adapters.vllm.layouts import LogicalBHNC

    layout = LogicalBHNC(4)
    cache = torch.randn(6, 2, 3, 8)
    ids = torch.tensor([1, 2])
    inside = cache.view(-1)[: 2 * 3 * 2 * 4].view(2, 3, 2, 4)  # shape [m, N, H, D]
    assert layout._gather_native(cache, ids, (inside, torch.empty(2, 3, 2, 4))) is None
    k = torch.empty(2 * 3 * 2 * 4 + 4)
    assert layout._gather_native(cache, ids, (k[:48].view(2, 3, 2, 4), k[4:52].view(2, 3, 2, 4))) is None
    fine = (torch.empty(2, 3, 2, 4), torch.empty(2, 3, 2, 4))
    assert layout._gather_native(cache, ids, fine) is not None


def test_destinations_on_another_device_than_the_cache_are_refused_as_such() -> None:
    """As for the packed CPU layout: ``out`` on another device (here meta) names ``out``, not a raw RuntimeError
    from the copy."""
    from hurray_vllm import HurrayArgumentError

    (cache,) = _views("LBNHC", torch.bfloat16, 1, 4, 2, 16, 8, seed=6)
    out = tuple(torch.empty(1, 16, 2, 8, dtype=torch.bfloat16, device="meta") for _ in range(2))
    with pytest.raises(HurrayArgumentError) as err:
        LogicalBHNC(8).gather(cache, torch.tensor([1]), out)
    assert err.value.field == "out"


@pytest.mark.parametrize(
    "ids", [torch.tensor([1.7, 2.2]), torch.tensor([True, False]), torch.tensor([1.0]).to(torch.float16)], ids=str
)
def test_block_ids_that_are_not_integers_are_refused(ids: torch.Tensor) -> None:
    """Float ids were truncated (1.7 read block 1) and bool ones read blocks 0 and 1, silently: the layouts
    refuse them, on gather and scatter; integer ids of any width still gather (int32 block tables)."""
    from hurray_vllm import HurrayArgumentError
    from hurray_vllm.adapters.vllm import CpuPacked

    (cache,) = _views("LBHNC", torch.bfloat16, 1, 4, 2, 16, 8, seed=7)
    packed = cache.contiguous()
    pages = torch.zeros(ids.numel(), 16, 2, 8, dtype=torch.bfloat16)
    calls = [
        lambda: LogicalBHNC(8).gather(cache, ids),
        lambda: CpuPacked("vec", 8).gather(packed, ids),
        lambda: CpuPacked("amx", 16).gather(torch.zeros(4, 2, 16, 32, dtype=torch.bfloat16), ids),
        lambda: CpuPacked("vec", 8).scatter(packed, ids, pages, pages),
    ]
    for call in calls:
        with pytest.raises(HurrayArgumentError) as err:
            call()
        assert err.value.field == "block_ids"
    for dtype in (torch.int32, torch.int16, torch.uint8):
        want = LogicalBHNC(8).gather(cache, torch.tensor([2, 0]))
        _same(LogicalBHNC(8).gather(cache, torch.tensor([2, 0], dtype=dtype)), want)
        _same(
            CpuPacked("vec", 8).gather(packed, torch.tensor([2, 0], dtype=dtype)),
            CpuPacked("vec", 8).gather(packed, torch.tensor([2, 0])),
        )
