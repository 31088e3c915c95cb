"""Tiny random models built on the spot (no model hub is reachable in CI)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., Path])
_BUILDING = threading.Lock()


def _one_at_a_time(build: F) -> F:
    """Builders seed torch's global generator and draw the weights from it: two threads building at once
    (engine runs side by side, ``servers.side_by_side``) would interleave the draws, and a model's weights
    would depend on timing. One build at a time keeps every model what its seed makes.

    Off the tests' own thread (``tests/prefetch.py``'s lanes, ``side_by_side``) a model is built in a
    process of its own: the tests go on drawing from the global generator meanwhile, and a lock cannot
    keep them out. A fresh process seeded alike draws the same weights.
    """

    @functools.wraps(build)
    def one(path: Path, **kwargs: object) -> Path:
        if threading.current_thread() is not threading.main_thread():
            if not (path / "config.json").exists():
                _build_in_a_process(build.__name__, path, kwargs)
            return path
        with _BUILDING:
            return build(path, **kwargs)

    return one  # type: ignore[return-value]


def _build_in_a_process(name: str, path: Path, kwargs: dict[str, object]) -> None:
    script = (
        "import json, sys; from pathlib import Path; import tiny_models; "
        f"tiny_models.{name}(Path(sys.argv[1]), **json.loads(sys.argv[2]))"
    )
    here = Path(__file__).resolve().parent
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path), json.dumps(kwargs)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])},
    )
    if proc.returncode:
        raise RuntimeError(f"building {name} at {path} failed:\n{proc.stderr[-4000:]}")


@_one_at_a_time
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


@_one_at_a_time
def build_tiny_eagle(path: Path, *, seed: int = 1) -> Path:
    """An EAGLE draft head (one decoder layer and ``fc``) for :func:`build_tiny_llama`'s model, bf16, at ``path``.

    vLLM's ``EagleLlamaForCausalLM`` takes the target's embeddings and
    ``lm_head``; its layer is the engine's layer 2, with a KV cache of its
    own in the target's KV cache group.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    hidden, inter, heads, kv_heads, head_dim = 128, 256, 4, 2, 32
    cfg = LlamaConfig(
        num_hidden_layers=1,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=512,
        max_position_embeddings=1024,
        architectures=["LlamaForCausalLM"],
    )
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape) * 0.05).to(torch.bfloat16)

    layer = "layers.0."
    weights = {
        "fc.weight": w(hidden, 2 * hidden),
        layer + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
        layer + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
        layer + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
        layer + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
        layer + "mlp.gate_proj.weight": w(inter, hidden),
        layer + "mlp.up_proj.weight": w(inter, hidden),
        layer + "mlp.down_proj.weight": w(hidden, inter),
        layer + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


#: The tiny MLA models' geometry. vLLM's CPU MLA backend takes only a latent of 576 (kv_lora_rank 512
#: + rope 64); dense MLPs (``first_k_dense_replace`` at least the layer count), as vLLM's CPU MoE
#: router asserts on so tiny a router; ``initializer_range`` 0.1, or the greedy tokens repeat one id.
_TINY_MLA: dict[str, object] = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "q_lora_rank": None,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "initializer_range": 0.1,
}


@_one_at_a_time
def build_tiny_deepseek_v2(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer DeepSeek-V2-style MLA model (dense MLPs) saved in bf16 at ``path``.

    vLLM's CPU MLA backends take only a latent of 576 (kv_lora_rank 512 + rope
    64), and blocks of 16 or multiples of 32 (``adapters.vllm.layouts.cpu_mla_backend``). ``initializer_range``
    0.1: at the default 0.02 the greedy tokens of so small a model repeat one id,
    which would make token comparisons weak.
    """
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = DeepseekV2Config(**_TINY_MLA, num_hidden_layers=2, first_k_dense_replace=2)
    model = DeepseekV2ForCausalLM(cfg).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


@_one_at_a_time
def build_tiny_deepseek_v3_mtp(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer DeepSeek-V3-style MLA model with one multi-token-prediction layer (vLLM's ``mtp`` drafter).

    Geometry as :func:`build_tiny_deepseek_v2` (the CPU MLA backend's latent
    of 576, dense MLPs). transformers has no MTP layer: a 3-layer model is
    saved, then its config names 2 layers and ``num_nextn_predict_layers=1``,
    and layer 2 gains the MTP weights vLLM's ``DeepSeekMTP`` loads (its
    norms, ``eh_proj``, the shared head and embeddings).
    """
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    hidden = int(_TINY_MLA["hidden_size"])
    # first_k_dense_replace=3: the MTP layer is dense too.
    cfg = DeepseekV3Config(**_TINY_MLA, num_hidden_layers=3, first_k_dense_replace=3, n_group=1, topk_group=1)
    DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    weights = load_file(str(path / "model.safetensors"))
    mtp = "model.layers.2."
    ones = torch.ones(hidden, dtype=torch.bfloat16)
    weights[mtp + "enorm.weight"] = ones.clone()
    weights[mtp + "hnorm.weight"] = ones.clone()
    weights[mtp + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden) * 0.05).to(torch.bfloat16)
    weights[mtp + "shared_head.norm.weight"] = ones.clone()
    weights[mtp + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    weights[mtp + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=2, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@_one_at_a_time
def build_tiny_gemma3(path: Path, *, seed: int = 0, window: int = 64) -> Path:
    """A 4-layer Gemma-3-style hybrid (3 sliding-window layers of ``window`` tokens, 1 full) in bf16 at ``path``."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        vocab_size=512,
        max_position_embeddings=1024,
        sliding_window=window,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        initializer_range=0.1,
        # Tied embeddings make so small a model repeat one token whatever the prompt.
        tie_word_embeddings=False,
    )
    model = Gemma3ForCausalLM(cfg).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


@_one_at_a_time
def build_tiny_qwen3_next(
    path: Path, *, seed: int = 0, kv_heads: int = 2, experts_per_token: int = 2, linear_heads: tuple[int, int] = (2, 4)
) -> Path:
    """A 4-layer Qwen3-Next-style hybrid (3 gated-delta-net linear-attention layers, 1 full) in bf16 at ``path``.

    vLLM's CPU GDN kernels take only head dims of 128 (``../shared/notes/facts.md``
    §5). The linear-attention layers have dense MLPs: with MoE there, vLLM's
    decode and transformers' prefill pick other experts for some tokens (a
    router near a tie flips on bf16 rounding), and the states after a decode
    step then differ by a fifth. The full-attention layer keeps its MoE: with
    ``mlp_only_layers`` covering every layer vLLM finds no Qwen3Next layer.
    ``initializer_range`` 0.1, as for the MLA model, so that greedy tokens do
    not repeat one id. ``kv_heads``: of the full-attention layer (1: at
    TP = 2 every rank holds it, while the state heads still split).
    ``experts_per_token`` = 4 routes every token to every expert: no router
    near-tie then flips an expert choice on another summation order (TP).
    ``linear_heads``: the gated delta nets' key and value heads (4 and 8
    split over 4 ranks, as Qwen3-Next's 16 and 32 do at TP = 4).
    """
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=64,
        linear_num_key_heads=linear_heads[0],
        linear_num_value_heads=linear_heads[1],
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_experts=4,
        num_experts_per_tok=experts_per_token,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        vocab_size=512,
        max_position_embeddings=2048,
        initializer_range=0.1,
        mlp_only_layers=[0, 1, 2],
    )
    model = Qwen3NextForCausalLM(cfg).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


def add_tiny_tokenizer(path: Path, vocab_size: int = 512) -> Path:
    """Give the model at ``path`` a word-level tokenizer (``w0`` .. ``w{vocab_size - 1}``) and a chat template.

    Enough for vLLM to serve chat completions and text: a word is one token,
    decoding joins tokens with spaces, and the template is each message's
    content followed by a space. No special token ends generation (tests use
    ``ignore_eos`` or ``max_tokens``).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if (path / "tokenizer.json").exists():
        return path
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    return path
