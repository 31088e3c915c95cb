"""fp8 KV caches between real vLLM engines at TP = 1 and TP = 2 (CPU, one core per rank).

vLLM's CPU fp8 cache is filled only through its own op, a block of every
head the rank holds at a time: a TP = 2 rank writes its share of a TP = 1
engine's whole chunk, and a TP = 1 engine the two slices of a TP = 2 chunk,
joined. Loaded values are quantized again with the same per-layer scale,
so what an engine holds after a load is the stored KV exactly (a negative
zero comes back positive). Three
engines (tiny Llama, 2 KV heads, blocks and chunks of 32 tokens):

1. TP = 1 computes "p" and saves its whole chunks;
2. TP = 2 loads "p" and snapshots it, then computes "s" and saves its
   chunks as two slices;
3. TP = 1 loads "s" and snapshots it.

Each snapshot's whole chunks equal the stored chunks they were loaded from,
every head in its place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import require_kv_cache_dtype
from engine_script import run_phases
from prefetch import prefetched
from tiny_models import build_tiny_llama

import hurray_vllm as hv
from hurray_vllm.chunks.keys import chunks_of
from hurray_vllm.kv.heads import concat_heads

pytestmark = [pytest.mark.vllm]
BLOCK = CHUNK = 32
P = [(i * 37 + 11) % 500 + 1 for i in range(100)]  # three whole chunks
S = [(i * 53 + 7) % 500 + 1 for i in range(100)]


def _run(tmp: Path, name: str, tp: int, phases: list[dict[str, Any]]) -> dict[str, Any]:
    return run_phases(tmp, name, tp, phases, block=BLOCK, chunk=CHUNK, max_model_len=1024, kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
@prefetched
def fp8_tp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_kv_cache_dtype("fp8", block_size=BLOCK)
    tmp = tmp_path_factory.mktemp("fp8-tp")
    build_tiny_llama(tmp / "model")
    runs: dict[str, Any] = {"tmp": tmp}
    runs["save1"] = _run(tmp, "save1", 1, [{"prompts": {"p": P}}])
    runs["tp2"] = _run(tmp, "tp2", 2, [{"prompts": {"p": P}, "snapshot": True}, {"prompts": {"s": S}}])
    runs["load1"] = _run(tmp, "load1", 1, [{"prompts": {"s": S}, "snapshot": True}])
    return runs


def _store(tmp: Path) -> Path:
    (ns,) = [p for p in (tmp / "store").iterdir() if p.is_dir()]
    return ns


def _pages(t: hv.BlockPagedTensor) -> torch.Tensor:
    """A one-sequence tensor's pages in token order, as the values stored (float32: exact for fp8).

    Values, not bytes: vLLM's quantizing op writes a loaded -0.0 back as +0.0.
    """
    ptr = t.seq_ptr.tolist()
    return t.page_pool[t.block_table[ptr[0] : ptr[1]]].float()


def _same_kv(got: hv.KVSnapshot, want: hv.KVSnapshot) -> None:
    assert got.kv_scales == want.kv_scales and got.num_layers == want.num_layers
    for x, y in zip(got.tensors(), want.tensors(), strict=True):
        assert x.num_heads == y.num_heads == 2
        assert torch.equal(_pages(x), _pages(y)), f"layer {x.layer_index} {x.kv_role}"


def test_a_tp2_fp8_engine_holds_the_tp1_chunks_it_loaded(fp8_tp: dict[str, Any]) -> None:
    run = fp8_tp["tp2"]
    assert run["phases"][0]["cached"] == {"p": 3 * CHUNK}
    snap = hv.load(run["dir"] / "snap0.hrry")
    assert snap.kv_scales is not None and snap.tensors()[0].page_pool.dtype == torch.float8_e4m3fn
    store = _store(fp8_tp["tmp"])
    chunks = chunks_of(snap, CHUNK)
    assert len(chunks) == 3
    for key, chunk in chunks:
        _same_kv(chunk, hv.load(store / f"{key}.hrry"))


def test_a_tp1_fp8_engine_holds_the_tp2_slices_it_loaded_joined(fp8_tp: dict[str, Any]) -> None:
    files = set(fp8_tp["tp2"]["phases"][1]["files"])
    loaded = fp8_tp["load1"]
    assert loaded["phases"][0]["cached"] == {"s": 3 * CHUNK}
    snap = hv.load(loaded["dir"] / "snap0.hrry")
    store = _store(fp8_tp["tmp"])
    for key, chunk in chunks_of(snap, CHUNK):
        assert {f"{key}.h0-1.hrry", f"{key}.h1-2.hrry"} <= files and f"{key}.hrry" not in files
        _same_kv(chunk, concat_heads([hv.load(store / f"{key}.h{h}-{h + 1}.hrry") for h in (0, 1)]))
