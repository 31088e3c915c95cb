"""Tiny random models built on the spot (no model hub is reachable in CI)."""

from __future__ import annotations

from pathlib import Path


def build_tiny_llama(path: Path, *, seed: int = 0, layers: int = 2, head_dim: int = 32) -> Path:
    """A 2-layer GQA Llama (4 query heads, 2 KV heads) saved in bf16 at ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        intermediate_size=256,
        vocab_size=512,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path
