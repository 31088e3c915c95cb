"""MLA (DeepSeek-V2-style) latents through the transformers adapter, against transformers' own MLA layers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import require

import hurray_vllm as hv
from hurray_vllm.adapters import transformers as tfa

PROMPT = [(i * 37 + 11) % 200 + 1 for i in range(29)]


@pytest.fixture(scope="module")
def mla_model() -> Any:
    """A tiny DeepSeek-V2 in float32 (the same arithmetic on both sides: exact comparisons)."""
    tr = require("transformers")
    torch.manual_seed(0)
    cfg = tr.DeepseekV2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        q_lora_rank=None,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=2,
        intermediate_size=128,
        moe_intermediate_size=32,
        vocab_size=256,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    return tr.DeepseekV2ForCausalLM(cfg).eval()


def _prefill(model: Any, ids: list[int]) -> tuple[Any, int]:
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    return out.past_key_values, int(out.logits[0, -1].argmax())


def test_from_transformers_fuses_the_cached_latent(mla_model: Any, tmp_path: Any) -> None:
    pkv, first = _prefill(mla_model, PROMPT)
    snap = tfa.from_transformers(pkv, [[*PROMPT, first]], model_config=mla_model.config, page_size=8)
    assert snap.is_latent and snap.roles == ("fused",)
    assert snap.latent == hv.LatentSplit(32, 16, "deepseek_v2")
    assert snap.fingerprint is not None and (snap.fingerprint.num_kv_heads, snap.fingerprint.head_dim) == (1, 48)
    for i, layer in enumerate(pkv.layers):
        dense = snap[i, "fused"].to_dense(0)  # [T, 1, 48]: compressed KV, then rotated k_pe
        assert torch.equal(dense[:, 0, :32], layer.keys[0, 0])
        assert torch.equal(dense[:, 0, 32:], layer.values[0, 0])
    for name in ("s.hrry", "s.hrrs", "s.safetensors"):
        hv.save(snap, tmp_path / name)
        back = hv.load(tmp_path / name)
        assert back.latent == snap.latent and torch.equal(back[1, "fused"].page_pool, snap[1, "fused"].page_pool)
        assert hv.validate(tmp_path / name).ok


def test_continuation_from_a_latent_snapshot_equals_generate(mla_model: Any) -> None:
    pkv, first = _prefill(mla_model, PROMPT)
    snap = tfa.from_transformers(pkv, [[*PROMPT, first]], model_config=mla_model.config, page_size=8)
    unmoved = mla_model.generate(torch.tensor([PROMPT]), max_new_tokens=9, do_sample=False)[0, len(PROMPT) :]
    assert [first, *tfa.continue_generation(mla_model, snap, 0, 8)] == unmoved.tolist()
    assert len(set(unmoved.tolist())) > 3  # a model whose tokens vary: the comparison means something


def test_expand_latent_equals_the_models_own_decompression(mla_model: Any) -> None:
    pkv, first = _prefill(mla_model, PROMPT)
    snap = tfa.from_transformers(pkv, [[*PROMPT, first]], model_config=mla_model.config, page_size=8)
    for i, layer in enumerate(pkv.layers):
        attn = mla_model.model.layers[i].self_attn
        with torch.no_grad():
            k_ref, v_ref = attn.expand_kv(layer.keys, layer.values)  # transformers' own kv_b_proj expansion
        k, v = tfa.expand_latent(mla_model, snap, 0, i)
        assert k.shape == (4, len(PROMPT), 32) and v.shape == (4, len(PROMPT), 16)
        torch.testing.assert_close(k, k_ref[0], rtol=0, atol=0)
        torch.testing.assert_close(v, v_ref[0], rtol=0, atol=0)
    with pytest.raises(hv.HurrayFormatError, match="model"):
        tfa.expand_latent(mla_model, snap, 0, 2)


def test_latents_and_key_values_do_not_mix(mla_model: Any, hf_model: Any) -> None:
    """A latent snapshot for a Llama, or a Llama snapshot for an MLA model: refused by what is missing."""
    pkv, first = _prefill(mla_model, PROMPT)
    latent = tfa.from_transformers(pkv, [[*PROMPT, first]], model_config=mla_model.config, page_size=8)
    with pytest.raises(hv.HurrayFormatError, match="fused MLA latents"):
        tfa.to_dynamic_cache(latent, 0, model_config=hf_model.config)
    with torch.no_grad():
        llama = hf_model(torch.tensor([PROMPT]), use_cache=True).past_key_values
    kv = tfa.from_transformers(llama, [PROMPT], model_config=hf_model.config)
    with pytest.raises(hv.HurrayFormatError, match="the model is MLA"):
        tfa.to_dynamic_cache(kv, 0, model_config=mla_model.config)
    with pytest.raises(hv.HurrayFormatError, match="kv_role"):
        latent.layers()
    with pytest.raises(hv.HurrayFormatError, match="MLA cache holds"):
        tfa.from_transformers(llama, [PROMPT], model_config=mla_model.config)
