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
    with pytest.raises(hv.HurrayArgumentError, match="the model has 2 MLA layers") as err:  # the caller's index
        tfa.expand_latent(mla_model, snap, 0, 2)
    assert err.value.field == "layer"
    for layer in (1.0, True):  # mods[1.0] was a bare TypeError, True layer 1
        with pytest.raises(hv.HurrayArgumentError, match="must be an integer") as err:
            tfa.expand_latent(mla_model, snap, 0, layer)  # type: ignore[arg-type]
        assert err.value.field == "layer"
    with pytest.raises(hv.HurrayArgumentError) as seq_err:
        tfa.expand_latent(mla_model, snap, 1, 0)
    assert seq_err.value.field == "seq" and isinstance(seq_err.value, IndexError)


def test_expand_latent_decompresses_on_the_layers_own_device(mla_model: Any) -> None:
    """A model split across devices (device_map): each layer's kv_b_proj computes where its weights are.

    This machine has one device, so the second is ``meta`` (shapes only): layer 1 moved there.
    """
    import copy

    pkv, first = _prefill(mla_model, PROMPT)
    snap = tfa.from_transformers(pkv, [[*PROMPT, first]], model_config=mla_model.config, page_size=8)
    split = copy.deepcopy(mla_model)
    split.model.layers[1].to("meta")
    k, v = tfa.expand_latent(split, snap, 0, 1)
    assert k.device.type == "meta" and v.device.type == "meta" and k.shape == (4, len(PROMPT), 32)
    assert tfa.expand_latent(split, snap, 0, 0)[0].device.type == "cpu"


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


@pytest.fixture(scope="module")
def v3_pair(mla_model: Any) -> tuple[Any, Any]:
    """The tiny DeepSeek-V2 above and a DeepSeek-V3 with its very weights (``rope_interleave=True``, V3's default).

    The two compute the same attention: V2 rotates each pair of k_pe's dims
    where it lies, as vLLM and FlashMLA do, and caches it so (the snapshot's
    order, held against vLLM in tests/adapters/vllm/test_mla.py); V3 caches
    every pair's first element, then every second one.
    """
    tr = require("transformers")
    v3 = tr.DeepseekV3ForCausalLM(tr.DeepseekV3Config(**mla_model.config.to_diff_dict())).eval()
    assert v3.config.rope_interleave
    v3.load_state_dict(mla_model.state_dict(), strict=True)
    return mla_model, v3


def _as_v3(snap: hv.KVSnapshot, v3: Any) -> hv.KVSnapshot:
    """``snap`` labelled as a DeepSeek-V3 snapshot (as an engine serving the V3 checkpoint would export it)."""
    import dataclasses

    fp = tfa.fingerprint_from_config(v3.config, dtype=torch.float32)
    return dataclasses.replace(snap, fingerprint=fp, latent=tfa.config_geometry(v3.config).latent)


def test_a_v3_models_k_pe_is_reordered_both_ways(v3_pair: tuple[Any, Any]) -> None:
    v2, v3 = v3_pair
    pkv2, first = _prefill(v2, PROMPT)
    pkv3, first3 = _prefill(v3, PROMPT)
    assert first3 == first
    rope = v2.config.qk_rope_head_dim
    # Without the reordering the caches differ: the test below means something.
    assert not torch.allclose(pkv2.layers[0].values, pkv3.layers[0].values, atol=1e-3)
    engine = tfa.from_transformers(pkv2, [[*PROMPT, first]], model_config=v2.config, page_size=8)
    ours = tfa.from_transformers(pkv3, [[*PROMPT, first]], model_config=v3.config, page_size=8)
    for i in range(v3.config.num_hidden_layers):
        torch.testing.assert_close(ours[i, "fused"].page_pool, engine[i, "fused"].page_pool, rtol=0, atol=1e-5)
    # V2 and V3 round differently (their norms and rotations are other code): close, not equal.
    cache = tfa.to_dynamic_cache(_as_v3(engine, v3), 0, model_config=v3.config)
    back = tfa.to_dynamic_cache(ours, 0, model_config=v3.config)  # the reordering itself is exact
    for i, layer in enumerate(pkv3.layers):
        assert cache.layers[i].values.shape[-1] == rope
        torch.testing.assert_close(cache.layers[i].keys, layer.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(cache.layers[i].values, layer.values, rtol=0, atol=1e-5)
        assert torch.equal(back.layers[i].keys, layer.keys) and torch.equal(back.layers[i].values, layer.values)


def test_a_v3_model_continues_an_engine_order_snapshot(v3_pair: tuple[Any, Any]) -> None:
    v2, v3 = v3_pair
    pkv, first = _prefill(v2, PROMPT)
    snap = _as_v3(tfa.from_transformers(pkv, [[*PROMPT, first]], model_config=v2.config, page_size=8), v3)
    unmoved = v3.generate(torch.tensor([PROMPT]), max_new_tokens=9, do_sample=False)[0, len(PROMPT) :].tolist()
    assert [first, *tfa.continue_generation(v3, snap, 0, 8)] == unmoved
    for i in range(v3.config.num_hidden_layers):
        attn = v3.model.layers[i].self_attn
        with torch.no_grad():
            own = v3(torch.tensor([PROMPT]), use_cache=True).past_key_values.layers[i]
            k_ref, v_ref = attn.expand_kv(own.keys, own.values)
        k, v = tfa.expand_latent(v3, snap, 0, i)  # V2's arithmetic against V3's: close
        torch.testing.assert_close(k, k_ref[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(v, v_ref[0], rtol=0, atol=1e-5)


def test_expand_latent_refuses_another_mla_models_latent(mla_model: Any) -> None:
    """Another rope/nope split of the same head size: without the check, keys of the wrong width come back."""
    tr = require("transformers")
    pkv, first = _prefill(mla_model, PROMPT)
    snap = tfa.from_transformers(pkv, [[*PROMPT, first]], model_config=mla_model.config, page_size=8)
    cfg = tr.DeepseekV2Config.from_dict({**mla_model.config.to_dict(), "qk_rope_head_dim": 8, "qk_nope_head_dim": 24})
    torch.manual_seed(0)
    other = tr.DeepseekV2ForCausalLM(cfg).eval()
    with pytest.raises(hv.HurrayFormatError, match="latent: snapshot has") as err:
        tfa.expand_latent(other, snap, 0, 0)
    assert err.value.field == "fingerprint"


def _relabel(snap: hv.KVSnapshot, config: Any) -> hv.KVSnapshot:
    """``snap`` labelled as a snapshot of the model ``config`` describes (its fingerprint and latent split)."""
    import dataclasses

    fp = tfa.fingerprint_from_config(config, dtype=torch.float32)
    return dataclasses.replace(snap, fingerprint=fp, latent=tfa.config_geometry(config).latent)


_MLA_DIMS: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=16, q_lora_rank=16, vocab_size=256,
)  # fmt: skip


def _always_split_configs() -> list[Any]:
    """Two-layer configs of the MLA models whose transformers attention always splits k_pe's pairs (no flag)."""
    tr = require("transformers")
    return [
        tr.LongcatFlashConfig(num_layers=1, **_MLA_DIMS),  # two attention layers per decoder layer
        *(c(num_hidden_layers=2, **_MLA_DIMS) for c in (tr.DeepseekV32Config, tr.GlmMoeDsaConfig, tr.AXK2Config)),
    ]


def _firsts_then_seconds(k_pe: torch.Tensor) -> torch.Tensor:
    """k_pe with its rotary pairs split, as a ``rope_interleave`` model caches it."""
    return torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)


def test_models_that_always_split_k_pe_pairs_are_reordered_without_a_flag(mla_model: Any) -> None:
    """LongCat-Flash, DeepSeek-V3.2, GLM-5 and A.X K2 rotate k_pe as V3 does but name no ``rope_interleave``."""
    pkv, first = _prefill(mla_model, PROMPT)
    engine = tfa.from_transformers(pkv, [[*PROMPT, first]], model_config=mla_model.config, page_size=8)
    for cfg in _always_split_configs():
        assert getattr(cfg, "rope_interleave", None) is None, cfg.model_type
        # Their cache holds every pair's first element, then every second one: paged, the engine's order.
        split = tuple((layer.keys, _firsts_then_seconds(layer.values)) for layer in pkv.layers)
        ours = tfa.from_transformers(split, [[*PROMPT, first]], model_config=cfg, page_size=8)
        for i in range(2):
            assert torch.equal(ours[i, "fused"].page_pool, engine[i, "fused"].page_pool), cfg.model_type
    longcat = _always_split_configs()[0]
    cache = tfa.to_dynamic_cache(_relabel(engine, longcat), 0, model_config=longcat)
    for i, layer in enumerate(pkv.layers):
        assert torch.equal(cache.layers[i].values, _firsts_then_seconds(layer.values))


def test_dsa_models_are_refused_for_want_of_the_indexer_cache(mla_model: Any) -> None:
    """DeepSeek-V3.2 / GLM-5 / A.X K2 attend through an indexer's keys, which no snapshot carries."""
    pkv, first = _prefill(mla_model, PROMPT)
    engine = tfa.from_transformers(pkv, [[*PROMPT, first]], model_config=mla_model.config, page_size=8)
    for cfg in _always_split_configs()[1:]:
        snap = _relabel(engine, cfg)
        with pytest.raises(hv.HurrayFormatError, match="indexer") as err:
            tfa.check_compatible(snap, cfg)
        assert err.value.field == "model_config", cfg.model_type
        with pytest.raises(hv.HurrayFormatError, match="indexer"):
            tfa.to_dynamic_cache(snap, 0, model_config=cfg)


def test_expand_latent_reads_a_multimodal_models_text_config(v3_pair: tuple[Any, Any]) -> None:
    """Kimi-K2.5 wraps a DeepSeek-V3 text config: its MLA fields are not on the composite config."""
    tr = require("transformers")
    v2, v3 = v3_pair

    class Multimodal(torch.nn.Module):  # a composite model: the language model inside, the composite config outside
        def __init__(self, lm: Any, config: Any) -> None:
            super().__init__()
            self.language_model, self.config = lm, config

    wrapped = Multimodal(v3, tr.Kimi_K25Config(text_config=v3.config.to_dict()))
    pkv, first = _prefill(v2, PROMPT)
    engine = tfa.from_transformers(pkv, [[*PROMPT, first]], model_config=v2.config, page_size=8)
    for i in range(v3.config.num_hidden_layers):
        k, v = tfa.expand_latent(wrapped, _relabel(engine, wrapped.config), 0, i)
        k_ref, v_ref = tfa.expand_latent(v3, _as_v3(engine, v3), 0, i)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_a_latent_snapshot_needs_the_models_config(mla_model: Any) -> None:
    """Without the config the k_pe order (rope_interleave) would be guessed: a named refusal instead."""
    pkv, first = _prefill(mla_model, PROMPT)
    snap = tfa.from_transformers(pkv, [[*PROMPT, first]], model_config=mla_model.config, page_size=8)
    with pytest.raises(hv.HurrayArgumentError, match="rope_interleave") as err:
        tfa.to_dynamic_cache(snap, 0)
    assert err.value.field == "model_config"
    tfa.to_dynamic_cache(snap, 0, model_config=mla_model.config)


def test_a_longcat_flash_split_across_devices_puts_both_sublayers_caches_on_their_layers_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LongCat-Flash's decoder layer ``i`` holds two MLA sublayers, cache layers ``2i`` and ``2i + 1``.

    This machine has one device, so the second is ``meta`` (shapes only): decoder layer 1 moved there.
    """
    tr = require("transformers")
    torch.manual_seed(0)
    dims = {**_MLA_DIMS, "q_lora_rank": 32, "vocab_size": 200}
    cfg = tr.LongcatFlashConfig(
        num_layers=2, ffn_hidden_size=64, head_dim=16, moe_topk=2, n_routed_experts=4, zero_expert_num=2,
        expert_ffn_hidden_size=32, initializer_range=0.1, **dims,
    )  # fmt: skip
    model = tr.LongcatFlashForCausalLM(cfg).eval()
    prompt = PROMPT[:9]
    pkv, first = _prefill(model, prompt)
    assert len(pkv.layers) == 4 and len(tfa._decoder_layers(model)) == 2
    snap = tfa.from_transformers(pkv, [[*prompt, first]], model_config=cfg)
    model.model.layers[1].to("meta")
    assert [d.type for d in tfa._layer_devices(model) or []] == ["cpu", "cpu", "meta", "meta"]
    cache, *_ = tfa._resume(model, snap, 0)
    assert [layer.keys.device.type for layer in cache.layers] == ["cpu", "cpu", "meta", "meta"]
    # Attentions that do not say which cache layer is theirs: the cache layers divide evenly among the decoder layers.
    monkeypatch.setattr(tfa, "_CACHE_OWNER_ATTRS", ())
    assert [d.type for d in tfa._layer_devices(model) or []] == ["cpu", "cpu", "meta", "meta"]


def test_an_mla_model_with_linear_attention_layers_is_refused(mla_model: Any) -> None:
    """Kimi Linear: MLA layers between KDA linear-attention layers, whose states no snapshot state kind holds."""
    tr = require("transformers")
    if not hasattr(tr, "KimiLinearConfig"):
        pytest.skip("this transformers has no Kimi Linear (KimiLinearConfig)")
    cfg = tr.KimiLinearConfig(num_hidden_layers=6, **{**_MLA_DIMS, "q_lora_rank": None})
    linear = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    assert linear == [0, 1, 2, 3, 5]
    geo = tfa.config_geometry(cfg)
    assert geo.latent is not None and list(geo.linear_layers) == linear and geo.num_layers == 1
    pkv, first = _prefill(mla_model, PROMPT)
    snap = tfa.from_transformers(pkv, [[*PROMPT, first]], model_config=mla_model.config, page_size=8)
    with pytest.raises(hv.HurrayFormatError, match=r"linear-attention layers \[0, 1, 2, 3, 5\]") as err:
        tfa.check_compatible(_relabel(snap, cfg), cfg)
    assert err.value.field == "model_config"
    with pytest.raises(hv.HurrayFormatError, match="linear-attention layers") as err:
        tfa.from_transformers(pkv, [[*PROMPT, first]], model_config=cfg, page_size=8)
    assert err.value.field == "model_config"
