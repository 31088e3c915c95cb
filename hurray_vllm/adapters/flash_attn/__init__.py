"""flash-attn importer: a snapshot's layer as the paged cache ``flash_attn_with_kvcache`` reads.

Three builds of the kernel read the same ``[num_blocks, page_size, nheads_k,
head_dim]`` pools and int32 ``[batch, max_num_blocks_per_seq]`` block table,
with different limits (``FLAVORS``; the table is in ``docs/importers-flash-attn.md``):

* ``"fa2"``: ``flash_attn.flash_attn_with_kvcache`` (FlashAttention-2): page
  size a multiple of 256, float16/bfloat16, head_dim <= 256.
* ``"fa3"``: ``flash_attn_interface.flash_attn_with_kvcache(page_table=...)``
  (FlashAttention-3): any page size, float16/bfloat16 or float8_e4m3fn with
  float32 ``[batch, nheads_k]`` descales, head_dim <= 256 and a multiple of 8
  (16 for fp8).
* ``"vllm"``: vLLM's fork (``vllm.vllm_flash_attn``, its FA2 kernel): page
  size a multiple of 16, float16/bfloat16, head_dim <= 256 and a multiple of 8.

:func:`plan_flash_attn` computes the block structure once per snapshot
(repaging with :func:`hurray_vllm.kv.repage.plan_repage` when the page size
differs, room for appended tokens); :func:`to_flash_attn` applies it to one
layer, :func:`to_flash_attn_all` to every layer. :func:`check_flash_attn_args`
checks a call against the kernel's contract before anything reaches CUDA,
and :func:`flash_attn_with_kvcache` checks and calls the installed kernel.
No kernel package is imported at module level.

Modules: :mod:`.flavors` (the builds' limits), :mod:`.importer` (plan and
import), :mod:`.contract` (the argument checks), :mod:`.kernels` (the calls).
"""

from __future__ import annotations

from .contract import check_flash_attn_args
from .flavors import FLAVORS, Flavor, FlavorLimits
from .importer import FlashAttnCache, FlashAttnPlan, plan_flash_attn, to_flash_attn, to_flash_attn_all
from .kernels import FlashAttnUnavailableError, flash_attn_with_kvcache

__all__ = [
    "FLAVORS",
    "FlashAttnCache",
    "FlashAttnPlan",
    "FlashAttnUnavailableError",
    "Flavor",
    "FlavorLimits",
    "check_flash_attn_args",
    "flash_attn_with_kvcache",
    "plan_flash_attn",
    "to_flash_attn",
    "to_flash_attn_all",
]
