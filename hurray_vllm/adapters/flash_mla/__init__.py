"""FlashMLA importer: an MLA snapshot's layer as the paged latent cache ``flash_mla_with_kvcache`` reads.

FlashMLA (DeepSeek's decode kernel for MLA) reads one latent pool per layer,
``[num_blocks, 64, 1, 576]`` (pages of 64 tokens, one latent "head" of
kv_lora_rank 512 + rope 64, bfloat16 or float16), an int32 ``[batch,
max_num_blocks_per_seq]`` block table and int32 ``cache_seqlens``: the
fused snapshot layout (``docs/format.md`` 2.3a) repaged to 64-token pages.

* :func:`to_flash_mla` builds that cache from a fused snapshot's layer
  (repaging, dequantizing fp8 latents with the layer's scale);
* :func:`check_flash_mla_args` checks a call against the kernel's contract
  before anything reaches CUDA;
* :func:`flash_mla_with_kvcache` checks and calls the installed ``flash_mla``
  package (CUDA, Hopper), or raises :class:`FlashMLAUnavailableError`.

The pure-PyTorch oracle is :func:`hurray_vllm.adapters.reference.mla_paged_decode`.
No kernel package is imported at module level.
"""

from __future__ import annotations

from .contract import FLASH_MLA_HEAD_DIM, FLASH_MLA_HEAD_DIM_V, FLASH_MLA_PAGE, check_flash_mla_args
from .importer import FlashMLACache, to_flash_mla
from .kernels import FlashMLAUnavailableError, flash_mla_with_kvcache

__all__ = [
    "FLASH_MLA_HEAD_DIM",
    "FLASH_MLA_HEAD_DIM_V",
    "FLASH_MLA_PAGE",
    "FlashMLACache",
    "FlashMLAUnavailableError",
    "check_flash_mla_args",
    "flash_mla_with_kvcache",
    "to_flash_mla",
]
