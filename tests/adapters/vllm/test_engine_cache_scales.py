"""The fp8 scales a worker's cache description carries (``describe_worker_cache``), without an engine.

A snapshot of an fp8 cache carries one ``(k_scale, v_scale)`` per layer,
read from vLLM's attention layers (``_k_scale_float``, ``_v_scale_float``);
an MLA layer quantizes its one latent with ``k_scale``. Found by mutation
testing: reading each layer's scales the other way round (``v`` for the
key, ``k`` for the value) failed no test: none described a worker's fp8 cache.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch
from conftest import require

from hurray_vllm.adapters.vllm.cache import describe_worker_cache

SCALES = [(0.5, 2.0), (0.25, 4.0)]  # per layer (k, v): no two alike


def _config(caches: list[torch.Tensor], *, mla: bool, cache_dtype: str = "fp8") -> tuple[NS, list[str]]:
    """A vLLM config as far as ``describe_worker_cache`` reads it; each layer with its own fp8 scales."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(len(caches))]
    backend = type("FlashAttentionImpl" if not mla else "FlashMLAImpl", (), {})
    layers = {
        n: NS(kv_cache=[c], impl=backend(), _k_scale_float=k, _v_scale_float=v)
        for n, c, (k, v) in zip(names, caches, SCALES, strict=True)
    }
    hf = NS(architectures=["DeepseekV2ForCausalLM" if mla else "LlamaForCausalLM"], model_type="deepseek_v2")
    hf.kv_lora_rank, hf.qk_rope_head_dim = 16, 8
    model = NS(
        use_mla=mla,
        dtype=torch.bfloat16,
        get_head_size=lambda: 16,
        get_total_num_kv_heads=lambda: 2,
        get_num_layers=lambda pc: len(caches),
        hf_config=hf,
        hf_text_config=hf,
        model="/nonexistent",
        revision=None,
        is_hybrid=False,
    )
    config = NS(
        model_config=model,
        cache_config=NS(cache_dtype=cache_dtype, block_size=16, kv_cache_layout=None),
        compilation_config=NS(static_forward_context=layers),
        parallel_config=NS(tensor_parallel_size=1),
        load_config=NS(load_format="auto", download_dir=None),
        speculative_config=None,
    )
    return config, names


def test_each_layer_carries_its_own_key_and_value_scale() -> None:
    require("vllm")  # the fp8 dtype is asked of vLLM's platform
    caches = [torch.zeros(4, 2, 16, 2 * 16, dtype=torch.uint8) for _ in SCALES]  # [B, H, N, 2 * D]
    config, names = _config(caches, mla=False)
    ec = describe_worker_cache(config, caches, names)
    assert ec.kv_scales == SCALES
    auto, _ = _config([c.to(torch.bfloat16) for c in caches], mla=False, cache_dtype="auto")
    assert describe_worker_cache(auto, [c.to(torch.bfloat16) for c in caches], names).kv_scales is None


def test_an_mla_layer_quantizes_its_latent_with_the_key_scale() -> None:
    require("vllm")
    caches = [torch.zeros(4, 16, 16 + 8, dtype=torch.uint8) for _ in SCALES]  # [B, N, kv_lora_rank + rope]
    config, names = _config(caches, mla=True)
    ec = describe_worker_cache(config, caches, names)
    assert ec.latent is not None
    assert ec.kv_scales == [(k, k) for k, _ in SCALES]
