"""FlashInfer adapter: one snapshot layer as FlashInfer's paged-KV arguments.

FlashInfer's batch attention wrappers (``BatchDecodeWithPagedKVCacheWrapper``,
``BatchPrefillWithPagedKVCacheWrapper``) take a batch's KV as a page pool plus
three int32 CSR arrays: ``paged_kv_indptr`` (pages per request, cumulated),
``paged_kv_indices`` (the page ids, request after request) and
``paged_kv_last_page_len`` (tokens in each request's last page). A Hurray
block-paged tensor is the same structure with int64 indices and explicit
sequence lengths, so importing is mostly a narrowing, plus the optional
repaging, dequantization, layout change and device move FlashInfer needs.

Nothing here imports FlashInfer. Its argument rules are mirrored from its
source (``flashinfer/decode.py``, ``flashinfer/prefill.py``,
``flashinfer/page.py``, ``include/flashinfer/page.cuh``,
``include/flashinfer/attention/state.cuh``) by :func:`check_flashinfer_args`,
and :func:`reference_decode` computes what batch decode returns, so both can
be used on a machine without CUDA.

Empty requests: FlashInfer's kernels read a request's length as
``0`` when it has no pages (``paged_kv_t::get_length``) and its planner as
``max(num_pages - 1, 0) * page_size + last_page_len`` (``get_seq_lens``);
both agree only with ``last_page_len = 0``. An empty sequence is therefore
imported as ``indptr[s] == indptr[s + 1]`` and ``last_page_len[s] == 0``;
decode returns zeros for it (the attention state starts at ``o = 0``).

MLA models: :func:`to_flashinfer_mla` gives the ``ckv_cache``/``kpe_cache``
pools and index arrays of ``flashinfer.mla.BatchMLAPagedAttentionWrapper``.

Modules: :mod:`.cache` (the imported cache), :mod:`.importer` (plan and
import), :mod:`.contract` (the argument checks), :mod:`.decode` (the reference
decode), :mod:`.mla` (the MLA page pools).
"""

from __future__ import annotations

from .cache import FlashInferCache, PagedKVCache
from .contract import check_flashinfer_args
from .decode import reference_decode
from .importer import plan_flashinfer, plan_flashinfer_repage, to_flashinfer, to_flashinfer_all
from .mla import FlashInferMLACache, to_flashinfer_mla

__all__ = [
    "FlashInferCache",
    "FlashInferMLACache",
    "PagedKVCache",
    "check_flashinfer_args",
    "plan_flashinfer",
    "plan_flashinfer_repage",
    "reference_decode",
    "to_flashinfer",
    "to_flashinfer_all",
    "to_flashinfer_mla",
]
