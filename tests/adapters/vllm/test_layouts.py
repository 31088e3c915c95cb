"""Every vLLM cache layout read back into the interchange layout (no engine needed)."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import require
from connector_parts import backend_spec, kv_groups, worker_config

import hurray_vllm as hv
from hurray_vllm import HurrayFormatError
from hurray_vllm.adapters.vllm import (
    CpuPacked,
    FlashAttnLegacy,
    FlashInferLegacy,
    LogicalBHNC,
    PagedAttentionLegacy,
    SequenceState,
    export_snapshot,
    export_stream,
    layer_view_from_buffer,
    release_export_workspace,
)
from hurray_vllm.adapters.vllm.export import GatherBuffers
from hurray_vllm.adapters.vllm.layouts import KV_CACHE_LAYOUT_ORDERS

B, H, N, D = 6, 2, 16, 8


def reference(seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Interchange-layout K and V, [B, N, H, D], with distinct values."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, N, H, D, generator=g).to(dtype), torch.randn(B, N, H, D, generator=g).to(dtype))


IDS = torch.tensor([4, 1, 5])


@pytest.mark.parametrize("layout", sorted(KV_CACHE_LAYOUT_ORDERS))
def test_vllm_032_layouts_match_vllm_strides(layout: str) -> None:
    vllm_iface = require("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layers = 3
    spec = vllm_iface.FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    raw = torch.zeros(layers * B * H * N * 2 * D * 2, dtype=torch.int8)
    views = layer_view_from_buffer(
        raw, layout, num_layers=layers, num_blocks=B, num_kv_heads=H, block_size=N, head_dim=D, dtype=torch.bfloat16
    )
    # The byte strides vLLM computes for [L, B, H, N, C], with C in bytes.
    want = vllm_iface.compute_layout_strides(spec, B, layers, KVCacheLayout[layout])
    byte_view = torch.as_strided(raw, (layers, B, H, N, 4 * D), want)
    for layer in range(layers):
        k, v = reference(layer)
        views[layer][..., :D] = k.transpose(1, 2)
        views[layer][..., D:] = v.transpose(1, 2)
        got_k, got_v = LogicalBHNC(D).gather(views[layer], IDS)
        assert torch.equal(got_k, k[IDS]) and torch.equal(got_v, v[IDS])
        assert got_k.is_contiguous() and got_k.shape == (3, N, H, D)
        # vLLM's strides address the very same bytes.
        ours = views[layer].view(torch.int8)
        assert torch.equal(ours, byte_view[layer])


@pytest.mark.parametrize("hnd", [False, True])
def test_flash_attn_legacy(hnd: bool) -> None:
    k, v = reference(7)
    if hnd:  # physically [2, B, H, N, D], logically [2, B, N, H, D]
        cache = torch.stack([k, v]).permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    else:
        cache = torch.stack([k, v])
    got_k, got_v = FlashAttnLegacy().gather(cache, IDS)
    assert torch.equal(got_k, k[IDS]) and torch.equal(got_v, v[IDS])


@pytest.mark.parametrize("hnd", [False, True])
def test_flashinfer_legacy(hnd: bool) -> None:
    k, v = reference(8)
    cache = torch.stack([k, v], dim=1)
    if hnd:
        cache = cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    got_k, got_v = FlashInferLegacy().gather(cache, IDS)
    assert torch.equal(got_k, k[IDS]) and torch.equal(got_v, v[IDS])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_paged_attention_v1_v2(dtype: torch.dtype) -> None:
    d = 32  # fp8 packs x = 16 elements per 16-byte load
    g = torch.Generator().manual_seed(9)
    k, v = (torch.randn(B, N, H, d, generator=g).to(dtype) for _ in range(2))
    x = 16 // k.element_size()
    # key_cache[b, h, d // x, n, d % x] = K[b, n, h, d]; value_cache[b, h, d, n] = V[b, n, h, d]
    key_cache = k.reshape(B, N, H, d // x, x).permute(0, 2, 3, 1, 4).contiguous()
    value_cache = v.permute(0, 2, 3, 1).contiguous()
    got_k, got_v = PagedAttentionLegacy().gather((key_cache, value_cache), IDS)
    assert torch.equal(got_k.view(torch.uint8), k[IDS].view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), v[IDS].view(torch.uint8))


@pytest.mark.parametrize(
    "value_shape",
    [(B, H + 1, D, N), (B, H, D * 2, N), (B, H, D, N * 2), (B - 2, H, D, N)],
    ids=["heads", "head_dim", "block_size", "blocks"],
)
def test_a_paged_attention_value_cache_of_another_geometry_than_the_keys_is_refused(
    value_shape: tuple[int, ...],
) -> None:
    """Keys and values of different shapes were exported side by side as one snapshot's pages."""
    x = 16 // torch.empty(0, dtype=torch.bfloat16).element_size()
    key_cache = torch.zeros(B, H, D // x, N, x, dtype=torch.bfloat16)
    pair = (key_cache, torch.zeros(value_shape, dtype=torch.bfloat16))
    for read in (lambda: PagedAttentionLegacy().gather(pair, IDS), lambda: PagedAttentionLegacy().page_shape(pair)):
        with pytest.raises(HurrayFormatError, match=r"does not match the key cache") as err:
            read()
        assert err.value.field == "cache"


@pytest.mark.parametrize(
    ("layout", "cache"),
    [
        (PagedAttentionLegacy(), torch.zeros(B, H, 1, N, 8)),  # the key cache alone, not the pair
        (FlashAttnLegacy(), torch.zeros(2, B, N, H)),
        (FlashInferLegacy(), torch.zeros(B, 2, N, H)),
        (FlashAttnLegacy(), (torch.zeros(B, N, H, D), torch.zeros(B, N, H, D))),
    ],
    ids=["paged-key-only", "flash-attn-4d", "flashinfer-4d", "flash-attn-pair"],
)
def test_legacy_page_shape_refuses_a_cache_of_another_rank_by_name(layout, cache) -> None:  # type: ignore[no-untyped-def]
    """``page_shape`` failed with an AssertionError or a bare unpacking ValueError."""
    with pytest.raises(HurrayFormatError) as err:
        layout.page_shape(cache)
    assert err.value.field == "cache"


def _layout_cases() -> list[tuple[object, object]]:
    k, v = reference(11)
    bhnc = torch.cat([k, v], dim=-1).transpose(1, 2).contiguous()  # [B, H, N, 2D]
    fa = torch.stack([k, v])
    fi = torch.stack([k, v], dim=1)
    x = 16 // k.element_size()
    pa = (k.reshape(B, N, H, D // x, x).permute(0, 2, 3, 1, 4).contiguous(), v.permute(0, 2, 3, 1).contiguous())
    return [
        (LogicalBHNC(D), bhnc),
        (CpuPacked("vec", D), bhnc),
        (CpuPacked("amx", 16), torch.randn(B, H, 16, 32).to(torch.bfloat16)),
        (FlashAttnLegacy(), fa),
        (FlashInferLegacy(), fi),
        (PagedAttentionLegacy(), pa),
    ]


@pytest.mark.parametrize(("layout", "cache"), _layout_cases(), ids=lambda c: getattr(c, "name", ""))
def test_gather_into_buffers_equals_a_fresh_gather(layout, cache) -> None:  # type: ignore[no-untyped-def]
    k, v = layout.gather(cache, IDS)
    assert layout.page_shape(cache) == tuple(k.shape[1:])
    out = (torch.full_like(k, 7.0), torch.full_like(v, 7.0))
    got = layout.gather(cache, IDS, out)
    assert got[0].data_ptr() == out[0].data_ptr() and got[1].data_ptr() == out[1].data_ptr()
    assert torch.equal(got[0], k) and torch.equal(got[1], v)
    with pytest.raises(HurrayFormatError) as err:
        layout.gather(cache, IDS, (out[0][:1], out[1][:1]))
    assert err.value.field == "out"


def test_gather_buffers_grow_and_are_reused() -> None:
    bufs = GatherBuffers()
    a, b = bufs.take((2, 4, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert a.shape == (2, 4, 2, 8) and a.dtype == torch.bfloat16 and a.data_ptr() != b.data_ptr()
    held = bufs.nbytes
    c, _ = bufs.take((1, 4, 2, 8), torch.float32, torch.device("cpu"))  # same bytes: reused
    assert c.data_ptr() == a.data_ptr() and bufs.nbytes == held
    d, _ = bufs.take((5, 4, 2, 8), torch.bfloat16, torch.device("cpu"))  # larger: grown
    assert bufs.nbytes > held and d.shape[0] == 5
    bufs.release()
    assert bufs.nbytes == 0


def test_stream_export_through_shared_buffers_equals_the_in_memory_export() -> None:
    g = torch.Generator().manual_seed(3)
    caches = [torch.randn(8, H, N, 2 * D, generator=g).to(torch.bfloat16) for _ in range(3)]
    seqs = [
        SequenceState("a", [3, 5, 2], 40, list(range(41))),
        SequenceState("b", [3, 6], 20, list(range(20))),
    ]
    want = export_snapshot(caches, LogicalBHNC(D), seqs, block_size=N)
    bufs = GatherBuffers()
    for _ in range(2):  # the second export reuses the first one's buffers
        f = io.BytesIO()
        export_stream(f, caches, LogicalBHNC(D), seqs, block_size=N, buffers=bufs)
        got = hv.read_stream(io.BytesIO(f.getvalue()))
        for x, y in zip((*want.keys, *want.values), (*got.keys, *got.values), strict=True):
            assert torch.equal(x.page_pool, y.page_pool) and torch.equal(x.block_table, y.block_table)
    assert bufs.nbytes == 2 * want.keys[0].page_pool.numel() * 2


def test_export_of_inference_mode_tensors_writes_a_stream() -> None:
    # vLLM's workers run under torch.inference_mode: their tensors have no version counter.
    with torch.inference_mode():
        caches = [torch.randn(8, H, N, 2 * D).to(torch.bfloat16) for _ in range(2)]
        seqs = [SequenceState("a", [3, 5], 20, list(range(20)))]
        snap = export_snapshot(caches, LogicalBHNC(D), seqs, block_size=N)
        f = io.BytesIO()
        hv.write_stream(snap, f)
        export_stream(io.BytesIO(), caches, LogicalBHNC(D), seqs, block_size=N)
    back = hv.read_stream(io.BytesIO(f.getvalue()))
    assert torch.equal(back[1, "value"].page_pool, snap[1, "value"].page_pool)


def test_host_exports_without_buffers_borrow_the_last_exports_workspace(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from hurray_vllm.adapters.vllm import export as ex

    g = torch.Generator().manual_seed(4)
    caches = [torch.randn(8, H, N, 2 * D, generator=g).to(torch.bfloat16) for _ in range(3)]
    seqs = [SequenceState("a", [3, 5, 2], 40, list(range(41)))]
    want = io.BytesIO()
    export_stream(want, caches, LogicalBHNC(D), seqs, block_size=N, buffers=GatherBuffers())
    release_export_workspace()
    seen: list[int] = []
    take = GatherBuffers.take

    def spy(self: GatherBuffers, *args: object, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        out = take(self, *args, **kw)  # type: ignore[arg-type]
        seen.append(out[0].untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(GatherBuffers, "take", spy)
    for _ in range(2):
        f = io.BytesIO()
        export_stream(f, caches, LogicalBHNC(D), seqs, block_size=N)
        assert f.getvalue() == want.getvalue()
    assert len(set(seen)) == 1  # the second export gathered into the first one's memory
    layer_bytes = 2 * 3 * N * H * D * 2
    assert release_export_workspace() == layer_bytes and release_export_workspace() == 0
    # Nothing is kept beyond the cap (0: every export allocates its own).
    monkeypatch.setenv(ex.WORKSPACE_ENV, "0")
    export_stream(io.BytesIO(), caches, LogicalBHNC(D), seqs, block_size=N)
    assert release_export_workspace() == 0
    # A value that is no number is reported, and the default applies.
    monkeypatch.setenv(ex.WORKSPACE_ENV, "nonsense")
    export_stream(io.BytesIO(), caches, LogicalBHNC(D), seqs, block_size=N)
    assert ex.WORKSPACE_ENV in caplog.text
    assert release_export_workspace() == layer_bytes
    # Exports that overlap in time never share buffers.
    with ex._workspace(None, False) as a, ex._workspace(None, False) as b:
        assert a is not b
    assert release_export_workspace() == 0  # neither had allocated anything


def test_a_backend_that_splits_blocks_into_kernel_blocks_is_refused_at_registration() -> None:
    """vLLM cuts each block into kernel blocks for a backend that does not take the engine's block size
    (FlashInfer off Blackwell takes 16, 32 or 64): block ids then index other pages. Found in vLLM 0.32's
    ``prepare_kernel_block_sizes``; on CPU (multiples of 32, MLA 16) it never happens, so faked here."""
    require("vllm")
    from types import SimpleNamespace

    from hurray_vllm.adapters.vllm.cache import describe_worker_cache

    class FlashInferImpl:
        pass

    layer = SimpleNamespace(kv_cache=None, impl=FlashInferImpl())
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={"l0": layer}),
        model_config=SimpleNamespace(use_mla=False, get_head_size=lambda: 16, dtype=torch.bfloat16),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=128, kv_cache_layout=None),
    )
    # vLLM 0.32's create_kv_cache_views with kernel blocks of 64: [blocks * 2, heads, 64 tokens, 2 * dim]. (A
    # 5-D legacy FlashInfer shape stood here, which 0.32 never hands a layer; page_shape now refuses it as such.)
    cache = torch.zeros(8, 2, 64, 2 * 16, dtype=torch.bfloat16)
    with pytest.raises(HurrayFormatError, match="--block-size 64") as exc:
        describe_worker_cache(config, [cache], ["l0"])
    assert exc.value.field == "block_size"


class KeepingSink:
    """A sink that keeps what ``write`` is given (a queue for a sender thread): no :class:`io.IOBase`."""

    def __init__(self) -> None:
        self.parts: list[object] = []

    def write(self, b: bytes | memoryview) -> int:
        self.parts.append(b)
        return memoryview(b).nbytes

    def getvalue(self) -> bytes:
        return b"".join(bytes(p) for p in self.parts)  # type: ignore[call-overload]


def test_a_sink_that_keeps_views_never_sees_another_exports_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, such a sink was handed views over the process's workspace: the next export (another request's)
    overwrote what it held. io.IOBase sinks still borrow the workspace (their write() copies)."""
    monkeypatch.delenv("HURRAY_VLLM_EXPORT_WORKSPACE_MIB", raising=False)
    mine = [torch.full((8, H, N, 2 * D), 1.0, dtype=torch.bfloat16)]
    other = [torch.full((8, H, N, 2 * D), 100.0, dtype=torch.bfloat16)]
    seqs = [SequenceState("a", [1, 2], 2 * N, list(range(2 * N)))]
    want = io.BytesIO()
    export_stream(want, mine, CpuPacked("vec", D), seqs, block_size=N)
    sink = KeepingSink()
    export_stream(sink, mine, CpuPacked("vec", D), seqs, block_size=N)  # type: ignore[arg-type]
    export_stream(io.BytesIO(), other, CpuPacked("vec", D), seqs, block_size=N)
    assert sink.getvalue() == want.getvalue()
    assert release_export_workspace() > 0  # the BytesIO exports borrowed and returned it


def test_an_mla_latent_of_another_dtype_is_refused_not_converted() -> None:
    """Before, a float8 latent written into a raw uint8 cache was converted numerically (1.5 became byte 1)."""
    from hurray_vllm.adapters.vllm.layouts import MLALatent

    cache = torch.zeros(4, N, 24, dtype=torch.uint8)
    latent = (torch.rand(2, N, 1, 24) * 3 + 0.5).to(torch.float8_e4m3fn)
    with pytest.raises(HurrayFormatError, match=r"must be torch\.uint8") as err:
        MLALatent(24).scatter(cache, torch.tensor([1, 3]), latent)
    assert err.value.field == "latent" and not cache.any()
    with pytest.raises(HurrayFormatError, match=r"must be torch\.bfloat16"):
        MLALatent(24).scatter(torch.zeros(4, N, 24, dtype=torch.bfloat16), torch.tensor([1]), latent[:1].float())
    # Viewed as its storage dtype first (as write_blocks does): the bits land as they are.
    MLALatent(24).scatter(cache.view(torch.float8_e4m3fn), torch.tensor([1, 3]), latent)
    assert torch.equal(cache[[1, 3]], latent[:, :, 0].view(torch.uint8))


# Caches hurray-vllm cannot read, refused where the engine starts or registers them (no engine needed).


def test_a_model_whose_values_have_another_head_size_than_its_keys_is_refused_at_start() -> None:
    """MiMo-V2 (keys of 192, values of 128; vLLM's ``head_size_v``) passed, then every save and load failed."""
    require("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowSpec

    from hurray_vllm.adapters.vllm.cache import unsupported_cache

    def groups(*specs: object) -> object:
        from types import SimpleNamespace

        return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])

    kv = {"block_size": 16, "num_kv_heads": 2, "dtype": torch.bfloat16}
    diff = FullAttentionSpec(head_size=192, head_size_v=128, **kv)
    window = SlidingWindowSpec(head_size=192, head_size_v=128, sliding_window=64, **kv)
    same = FullAttentionSpec(head_size=192, **kv)
    for config, sliding in ((groups(diff), False), (groups(diff), True), (groups(same, window), True)):
        why = unsupported_cache(config, sliding_windows=sliding)
        assert why is not None and "keys of head size 192 and values of head size 128" in why, why
    assert unsupported_cache(groups(same), sliding_windows=True) is None
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert mla.head_size_v == 0 and unsupported_cache(groups(mla)) is None  # one latent: no V at all


TWO_SLOT_BACKENDS = ["B12X", "ROCM_ATTN", "ROCM_SEGMENTED_ATTN", "ROCM_AITER_FA_SHUFFLE"]


@pytest.mark.parametrize("heads", [2, 4])
@pytest.mark.parametrize("backend", TWO_SLOT_BACKENDS)
def test_a_backend_that_keeps_keys_and_values_as_two_head_slots_is_refused_at_start(
    backend: str, heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its pages are [B, 2 (K slot, V slot), N, H*D]: at two KV heads per rank the shape of [B, H, N, 2D], and
    LogicalBHNC exported and wrote its keys and values mixed up, silently; at four the refusal blamed values of
    another head size."""
    from hurray_vllm.adapters.vllm.cache import describe_worker_cache, unsupported_cache

    spec = backend_spec(backend, heads, monkeypatch)
    assert getattr(spec, "num_head_slots", None) == 2  # what vLLM publishes: the premise of the refusal
    window = backend_spec(backend, heads, monkeypatch, window=64)
    for config, sliding in ((kv_groups(spec), False), (kv_groups(spec), True), (kv_groups(spec, window), True)):
        why = unsupported_cache(config, sliding_windows=sliding)
        assert why is not None and "num_head_slots=2" in why and "FLASH_ATTN" in why, why
    # Where the worker describes its caches (engine_cache(), the connector's worker): the spec says it too.
    caches = [torch.zeros(4, 2, 16, heads * 8, dtype=torch.bfloat16)]  # [B, 2, N, H*D]
    config, names = worker_config(caches, 8, "B12xPagedAttentionImpl")
    with pytest.raises(HurrayFormatError, match="num_head_slots=2") as err:
        describe_worker_cache(config, caches, names, kv_groups(spec))
    assert err.value.field == "kv_cache_groups"


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN", "ROCM_AITER_UNIFIED_ATTN", "ROCM_AITER_FA"])
def test_a_backend_with_one_head_slot_per_kv_head_is_still_accepted(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hurray_vllm.adapters.vllm.cache import describe_worker_cache, unsupported_cache

    spec = backend_spec(backend, 2, monkeypatch)
    window = backend_spec(backend, 2, monkeypatch, window=64)
    assert unsupported_cache(kv_groups(spec)) is None
    assert unsupported_cache(kv_groups(spec, window), sliding_windows=True) is None
    caches = [torch.zeros(4, 2, 16, 16, dtype=torch.bfloat16)]
    config, names = worker_config(caches, 8, "FlashAttentionImpl")
    assert describe_worker_cache(config, caches, names, kv_groups(spec)).layout_name == "vllm-LBNHC"


def test_a_packed_quantized_cache_is_refused_at_start() -> None:
    """TRITON_ATTN's per-token-head modes pack each head's scales inline (``state_content_bytes`` alone)."""
    require("vllm")
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    from hurray_vllm.adapters.vllm.cache import unsupported_cache

    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype=torch.int8, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD
    )
    packed = TritonAttentionBackend.customize_spec(spec)
    assert packed.num_head_slots is None and packed.state_content_bytes == 2 * 8 + 2 * 4
    why = unsupported_cache(kv_groups(packed), sliding_windows=True)
    assert why is not None and "state_content_bytes=24: a packed quantized cache" in why, why


@pytest.mark.parametrize("layout", [LogicalBHNC(192), CpuPacked("vec", 192)], ids=lambda x: x.name)
def test_pages_that_do_not_hold_a_key_and_a_value_of_the_head_size_are_refused_by_page_shape(layout) -> None:  # type: ignore[no-untyped-def]
    """vLLM's diff-KV backends keep ``[B, H, N, 192 + 128]``: a page shape of head_dim 192 was reported for it."""
    with pytest.raises(HurrayFormatError, match=r"expected \[B, H, N, 384\], got \[4, 2, 16, 320\]") as err:
        layout.page_shape(torch.zeros(4, 2, 16, 320))
    assert err.value.field == "cache"
    assert layout.page_shape(torch.zeros(4, 2, 16, 384)) == (16, 2, 192)


@pytest.mark.parametrize("impl", ["FlashAttentionDiffKVImpl", "CPUAttentionBackendImpl"])
def test_a_cache_whose_values_have_another_head_size_is_refused_when_registered(impl: str) -> None:
    from hurray_vllm.adapters.vllm.cache import describe_worker_cache

    caches = [torch.zeros(4, 2, 16, 192 + 128, dtype=torch.bfloat16) for _ in range(2)]
    config, names = worker_config(caches, 192, impl)
    with pytest.raises(HurrayFormatError, match=r"\[4, 2, 16, 320\]") as err:
        describe_worker_cache(config, caches, names)
    assert err.value.field == "cache"


def test_kv_cache_groups_of_other_page_geometries_are_refused_naming_them() -> None:
    """vLLM's ``unify_kv_cache_spec_page_size`` gives a sliding group with fewer KV heads larger blocks; the
    refusal blamed a speculative drafter alone."""
    from hurray_vllm.adapters.vllm.cache import describe_worker_cache

    caches = [torch.zeros(4, 4, 32, 128, dtype=torch.bfloat16), torch.zeros(4, 2, 64, 128, dtype=torch.bfloat16)]
    config, names = worker_config(caches, 64, "CPUAttentionBackendImpl")
    with pytest.raises(HurrayFormatError, match="KV cache groups with different page geometries") as err:
        describe_worker_cache(config, caches, names)
    assert err.value.field == "layers" and "speculative drafter" in str(err.value)  # still one possible cause


class FnuzPlatform:
    """vLLM's ROCm platform on an MI300 (``gfx94``), as far as the fp8 dtype goes."""

    @classmethod
    def is_fp8_fnuz(cls) -> bool:
        return True

    @classmethod
    def fp8_dtype(cls) -> torch.dtype:
        return torch.float8_e4m3fnuz


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_cache_on_a_platform_whose_fp8_is_fnuz_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, cache_dtype: str
) -> None:
    """Before, "fp8" was read as float8_e4m3fn everywhere: an MI300's float8_e4m3fnuz cache came out at twice its
    values, silently."""
    require("vllm")
    import vllm.platforms

    from hurray_vllm.adapters.vllm.cache import describe_worker_cache, fingerprint_of

    caches = [torch.zeros(4, 2, 32, 64, dtype=torch.uint8) for _ in range(2)]
    config, names = worker_config(caches, 32, "CPUAttentionBackendImpl", cache_dtype=cache_dtype)
    ec = describe_worker_cache(config, caches, names)  # this platform's (the CPU's) fp8 is the one mapped
    assert ec.storage_dtype == (torch.float8_e5m2 if cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn)
    monkeypatch.setattr(vllm.platforms, "_current_platform", FnuzPlatform())
    assert vllm.platforms.current_platform.fp8_dtype() == torch.float8_e4m3fnuz
    with pytest.raises(HurrayFormatError, match="float8_e4m3fnuz") as err:
        describe_worker_cache(config, caches, names)
    assert err.value.field == "kv_cache_dtype"
    with pytest.raises(HurrayFormatError, match="float8_e4m3fnuz"):
        fingerprint_of(config, num_layers=2)  # the scheduler side refuses it too
    auto, _ = worker_config(caches, 32, "CPUAttentionBackendImpl")
    assert fingerprint_of(auto, num_layers=2).dtype == "bfloat16"  # an unquantized cache does not care


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_cache_dtype_naming_the_models_own_dtype_is_the_auto_cache(model_dtype: torch.dtype) -> None:
    """vLLM's CacheDType takes "bfloat16" and "float16" (a plain cache of that dtype): on a model of that dtype
    it is the "auto" cache, and was refused; on a model of the other dtype it is refused naming kv_cache_dtype."""
    from hurray_vllm.adapters.vllm.cache import describe_worker_cache, fingerprint_of

    same, other = ("bfloat16", "float16") if model_dtype == torch.bfloat16 else ("float16", "bfloat16")
    caches = [torch.zeros(4, 2, 32, 64, dtype=model_dtype) for _ in range(2)]
    auto, names = worker_config(caches, 32, "FlashAttentionImpl")
    auto.model_config.dtype = model_dtype
    want = describe_worker_cache(auto, caches, names)
    for cache_dtype in (same, other):
        config, _ = worker_config(caches, 32, "FlashAttentionImpl", cache_dtype=cache_dtype)
        config.model_config.dtype = model_dtype
        if cache_dtype == same:
            ec = describe_worker_cache(config, caches, names)
            assert (ec.kv_cache_dtype, ec.storage_dtype, ec.kv_scales) == ("auto", model_dtype, None)
            assert ec.fingerprint == want.fingerprint  # the same chunks as an "auto" engine's
            assert fingerprint_of(config, num_layers=2) == fingerprint_of(auto, num_layers=2)
            continue
        with pytest.raises(HurrayFormatError, match=f"kv_cache_dtype '{other}' on a model of dtype") as err:
            describe_worker_cache(config, caches, names)
        assert err.value.field == "kv_cache_dtype" and "--kv-cache-dtype auto" in str(err.value)
        with pytest.raises(HurrayFormatError, match=f"'{other}'") as err:
            fingerprint_of(config, num_layers=2)  # the scheduler side refuses it too
        assert err.value.field == "kv_cache_dtype"
