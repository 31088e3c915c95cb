"""Export from real vLLM engines (CPU), checked against transformers as ground truth."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import CONFIGS

import hurray_vllm as hv

pytestmark = [pytest.mark.vllm]


def hf_kv(model: Any, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) as [tokens, kv_heads, head_dim], post-RoPE, from transformers."""
    with torch.no_grad():
        pkv = model(torch.tensor([ids]), use_cache=True).past_key_values
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in pkv.layers]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_equals_transformers(engine_runs, hf_model, name: str) -> None:  # type: ignore[no-untyped-def]
    out, result = engine_runs[name]
    snap = hv.load(out / "snap.hrry")
    fp8 = result["kv_cache_dtype"] == "fp8"
    assert snap.request_ids == ("a", "b", "c")
    assert snap.fingerprint is not None and snap.fingerprint.architecture == "LlamaForCausalLM"
    assert snap.fingerprint.num_kv_heads == 2 and snap.fingerprint.head_dim == 32
    assert snap.page_size == result["block_size"]
    # The exporter read the packing vLLM chose for this CPU (it differs between CPUs: AMX or not).
    assert snap.source is not None and snap.source.layout == f"vllm-cpu-{result['isa']}", snap.source
    prompts = result["prompts"]
    for s, rid in enumerate(("a", "b", "c")):
        ids = list(snap.token_ids[s])
        n = snap.seq_lens[s]
        # Mid-decode: the prompt and the first sampled token have KV, the newest token not yet.
        assert n == len(prompts[rid]) + 1 and len(ids) == n + 1
        assert ids[: len(prompts[rid])] == prompts[rid]
        for layer, (k_ref, v_ref) in enumerate(hf_kv(hf_model, ids[:n])):
            k = snap[layer, "key"].to_dense(s).float()
            v = snap[layer, "value"].to_dense(s).float()
            if fp8:
                ks, vs = snap.kv_scales[layer]  # type: ignore[index]
                k, v = k * ks, v * vs
                # e4m3 keeps 3 mantissa bits, rounded toward zero: < 2**-3 relative error.
                tol_k, tol_v = 0.13 * k_ref.abs().float() + 2e-2, 0.13 * v_ref.abs().float() + 2e-2
            else:
                tol_k, tol_v = 2e-2 * (1 + k_ref.abs().float()), 2e-2 * (1 + v_ref.abs().float())
            assert ((k - k_ref.float()).abs() <= tol_k).all(), f"{name} seq {rid} layer {layer} keys"
            assert ((v - v_ref.float()).abs() <= tol_v).all(), f"{name} seq {rid} layer {layer} values"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefix_sharing_is_preserved(engine_runs, name: str) -> None:  # type: ignore[no-untyped-def]
    out, result = engine_runs[name]
    snap = hv.load(out / "snap.hrry")
    bs = result["block_size"]
    k = snap[0, "key"]
    a, b = k.pages_of(0).tolist(), k.pages_of(1).tolist()
    shared = 80 // bs  # "b" repeats 80 tokens of "a": that many whole blocks
    assert a[:shared] == b[:shared]
    assert not set(a[shared:]) & set(b[shared:])
    assert snap.sharing().shared_pages == shared
    # Only referenced pages left the engine.
    assert k.num_pages == len(set(k.block_table.tolist()))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_sentinel_and_nothing_foreign(engine_runs, name: str) -> None:  # type: ignore[no-untyped-def]
    """The pools were filled with 0x7F before any request: none of it may be exported."""
    out, _result = engine_runs[name]
    snap = hv.load(out / "snap.hrry")
    for t in (*snap.keys, *snap.values):
        raw = t.page_pool.view(torch.uint8).reshape(-1)
        if t.page_pool.element_size() == 1:
            assert not (raw == 0x7F).any()  # 0x7F is NaN in e4m3: no real value has it
        else:
            assert not (t.page_pool.view(torch.int16) == 0x7F7F).any()
        # Slots past every sequence's length are zero.
        valid = t.valid_slots()
        pool = t.page_pool.view(torch.uint8).reshape(t.num_pages, t.page_size, -1)
        for p in range(t.num_pages):
            assert not pool[p, int(valid[p]) :].any()


def test_stream_export_equals_snapshot(engine_runs) -> None:  # type: ignore[no-untyped-def]
    out, _ = engine_runs["bf16-32"]
    a, b = hv.load(out / "snap.hrry"), hv.load(out / "snap.hrrs")
    assert a.token_ids == b.token_ids and a.fingerprint == b.fingerprint
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
        assert torch.equal(x.page_pool.view(torch.uint8), y.page_pool.view(torch.uint8))
        assert torch.equal(x.block_table, y.block_table)


def test_fp8_export_is_float8_with_scales(engine_runs) -> None:  # type: ignore[no-untyped-def]
    out, _ = engine_runs["fp8-32"]
    snap = hv.load(out / "snap.hrry")
    assert snap[0, "key"].dtype == torch.float8_e4m3fn
    assert snap.kv_scales is not None and len(snap.kv_scales) == snap.num_layers
    assert snap.fingerprint is not None and snap.fingerprint.dtype == "float8_e4m3"


def test_errors_for_unknown_and_finished_requests(engine_runs) -> None:  # type: ignore[no-untyped-def]
    _, result = engine_runs["bf16-32"]
    assert "no live request 'nope'" in result["errors"]["unknown"]
    assert "'c'" in result["errors"]["finished"]


def test_reference_implementation_reads_the_export(engine_runs, hurray) -> None:  # type: ignore[no-untyped-def]
    out, _ = engine_runs["bf16-32"]
    loaded = hurray.load(str(out / "snap.hrry"))
    key = loaded["layers.1"].members[0]
    assert key.layout.kv_role == "key" and key.layout.layer_index == 1
    assert key.layout.page_size == 32
