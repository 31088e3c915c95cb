"""vLLM's KV cache layouts, read back into the interchange layout.

Every layout answers one question: given the cache tensor(s) of one layer
and a list of block ids, return the keys and the values of those blocks as
``[n, block_size, num_kv_heads, head_dim]`` contiguous tensors (the Hurray
interchange layout). Each layout first builds a *strided view* of the cache
whose logical order is already ``[blocks, tokens, heads, dim]`` and then
gathers the requested blocks with one ``index_select``: one copy of exactly
the referenced pages, never of the whole pool.

Nothing here imports vLLM: the layouts are described from vLLM's source
(cited per class) and tested against vLLM's own helpers and cache-write op.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from ... import native
from ...errors import HurrayArgumentError, HurrayFormatError
from ...kv.repage import overlaps

__all__ = [
    "KVLayout",
    "LogicalBHNC",
    "MLALatent",
    "cpu_has_amx",
    "cpu_mla_backend",
    "CpuPacked",
    "FlashAttnLegacy",
    "FlashInferLegacy",
    "PagedAttentionLegacy",
    "KV_CACHE_LAYOUT_ORDERS",
    "layer_view_from_buffer",
    "as_storage_dtype",
]


#: Optional destination of a gather: one tensor per role (keys, values; or the fused latent),
#: each ``[n, block_size, H, D]`` contiguous.
Out = tuple[torch.Tensor, ...] | None

#: The roles a layout's gather returns, when the layout does not say (``roles``): keys then values.
KV_PAIR = ("key", "value")


def roles_of(layout: object) -> tuple[str, ...]:
    """The roles ``layout.gather`` returns, in order: ``("key", "value")`` unless it says otherwise."""
    return tuple(getattr(layout, "roles", KV_PAIR))


class KVLayout(Protocol):
    """What the exporter needs from a cache layout.

    ``gather`` returns one pool per role: keys and values for attention
    caches, one fused latent for MLA caches (a layout with ``roles =
    ("fused",)``, see :func:`roles_of`).
    """

    @property
    def name(self) -> str:
        """Short name of the layout (e.g. ``"vllm-cpu"``)."""
        ...

    def page_shape(self, cache: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[int, int, int]:
        """``(block_size, H, D)`` of one gathered page of ``cache``."""
        ...

    def gather(
        self, cache: torch.Tensor | tuple[torch.Tensor, ...], block_ids: torch.Tensor, out: Out = None
    ) -> tuple[torch.Tensor, ...]:
        """Keys and values (or the one fused latent) of ``block_ids`` (int64), each ``[n, block_size, H, D]``.

        With ``out`` (one contiguous tensor of that shape and the cache's
        dtype and device per role) the pages are written there and ``out``
        is returned.
        """
        ...


def _ids(block_ids: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``block_ids`` as int64 on ``cache``'s device.

    Raises:
        HurrayArgumentError: (field ``block_ids``) ids that are not integers:
            float ids would be truncated (1.7 reads block 1) and bool ones
            read blocks 0 and 1, silently.
    """
    dtype = block_ids.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise HurrayArgumentError(
            "block_ids", f"must be an integer tensor (int64 or int32 engine block ids), got {dtype}"
        )
    return block_ids.to(device=cache.device, dtype=torch.int64)


def _nth(out: Out, j: int) -> torch.Tensor | None:
    """The destination of role ``j`` of a gather, if the caller gave destinations."""
    return out[j] if out else None


def _select(view: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``view.index_select(0, ids)``, into ``out`` (viewed as the result's shape) when given."""
    if out is None:
        return view.index_select(0, ids)
    torch.index_select(view, 0, ids, out=out.view(ids.numel(), *view.shape[1:]))
    return out


def _check_out(out: Out, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None) -> None:
    if out is None:
        return
    for t in out:
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise HurrayFormatError(
                "out", f"gather buffers must be contiguous {list(shape)} {dtype}, got {list(t.shape)} {t.dtype}"
            )
        if device is not None and t.device != device:  # the native kernels take raw host pointers
            raise HurrayArgumentError("out", f"gather buffers must be on the cache's {device}, got {t.device}")


def _check_kv_pages(cache: torch.Tensor, head_dim: int) -> None:
    """Refuse a ``[B, H, N, C]`` cache whose tokens are not a key and a value of ``head_dim`` each.

    A model whose values have another head size than its keys (vLLM's
    ``head_size_v``, e.g. MiMo-V2 on the diff-KV backends) keeps ``C = D_k +
    D_v``: split at ``head_dim`` its values would be read as the keys' tail.
    Checked by ``page_shape`` too, so such a cache is refused where the
    worker registers it, not at its first save or load. A backend that keeps
    keys and values as two head slots (vLLM's B12X, ROCM_ATTN: ``[B, 2, N,
    H*D]``) fails this check too, except at two KV heads, where only its KV
    cache spec tells it apart (``cache._packed_pages``, at start).

    Raises:
        HurrayFormatError: (field ``cache``) not 4-D, or ``C != 2 * head_dim``.
    """
    if cache.dim() != 4 or cache.shape[-1] != 2 * head_dim:
        raise HurrayFormatError(
            "cache",
            f"expected [B, H, N, {2 * head_dim}], got {list(cache.shape)}: each token holds a key and a value "
            f"of head size {head_dim} (values of another head size than the keys are not supported, nor "
            "backends that keep keys and values as two head slots, [B, 2, N, H*D]: B12X, ROCM_ATTN)",
        )


def as_storage_dtype(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a cache's elements (e.g. uint8 fp8 storage as ``float8_e4m3fn``)."""
    if cache.dtype == dtype:
        return cache
    if cache.element_size() != torch.empty(0, dtype=dtype).element_size():
        raise HurrayFormatError("dtype", f"cannot view {cache.dtype} cache storage as {dtype}")
    return cache.view(dtype)


# ── vLLM 0.32: one [B, H, N, C] view per layer, C = [K | V] per token ────────

#: ``vllm/v1/kv_cache_layout.py`` ``KVCacheLayout``: the physical order of the
#: logical axes ``[L, B, H, N, C]`` (stride permutation, outermost first).
KV_CACHE_LAYOUT_ORDERS: dict[str, tuple[int, int, int, int, int]] = {
    "LBHNC": (0, 1, 2, 3, 4),  # HND
    "LBNHC": (0, 1, 3, 2, 4),  # NHD, the GPU default
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),  # cross-layer
    "BLNHC": (1, 0, 3, 2, 4),  # cross-layer
    "BHLNC": (1, 2, 0, 3, 4),  # cross-layer
}


def layer_view_from_buffer(
    raw: torch.Tensor,
    layout: str,
    *,
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Per-layer ``[B, H, N, 2*D]`` views of a flat cache buffer in ``layout``.

    Mirrors ``vllm/v1/kv_cache_interface.py`` ``compute_layout_strides`` and
    ``create_kv_cache_views`` for dense (unpadded) pages: strides are laid
    out innermost-first in the layout's physical order, then each layer's
    view is a strided window over the same buffer.
    """
    try:
        order = KV_CACHE_LAYOUT_ORDERS[layout]
    except KeyError:
        raise HurrayFormatError("layout", f"unknown vLLM KV cache layout {layout!r}") from None
    elem = torch.empty(0, dtype=dtype).element_size()
    shape = (num_layers, num_blocks, num_kv_heads, block_size, 2 * head_dim * elem)
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    if raw.numel() * raw.element_size() < step:
        raise HurrayFormatError("cache", f"buffer of {raw.numel()} bytes is smaller than the {step} the layout needs")
    flat = raw.view(torch.int8) if raw.dtype != torch.int8 else raw
    view5 = torch.as_strided(flat, size=shape, stride=strides, storage_offset=flat.storage_offset())
    return [view5[i].view(dtype) for i in range(num_layers)]


@dataclass(frozen=True)
class LogicalBHNC:
    """vLLM 0.32's per-layer logical view ``[num_blocks, H, block_size, 2*D]``, any stride order.

    The six ``KVCacheLayout`` orders (LBNHC/NHD, LBHNC/HND and the
    cross-layer BLHNC, BLNHC, BHLNC, LHBNC) differ only in strides; the
    logical view (``vllm/v1/kv_cache_interface.py`` ``create_kv_cache_views``)
    always puts the key in ``C[:D]`` and the value in ``C[D:]`` of each token,
    as FlashAttention/Triton/FlashInfer backends read it.
    """

    head_dim: int
    name: str = "vllm-logical-BHNC"

    def page_shape(self, cache: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[int, int, int]:
        """``(block_size, H, D)`` of one page of the ``[B, H, N, 2*D]`` cache.

        Raises:
            HurrayFormatError: (field ``cache``) a cache whose last dimension
                is not ``2 * head_dim`` (values of another head size than the keys).
        """
        assert isinstance(cache, torch.Tensor)
        _check_kv_pages(cache, self.head_dim)
        return int(cache.shape[2]), int(cache.shape[1]), self.head_dim

    def gather(
        self, cache: torch.Tensor | tuple[torch.Tensor, ...], block_ids: torch.Tensor, out: Out = None
    ) -> tuple[torch.Tensor, ...]:
        """Keys and values of ``block_ids``, each ``[n, block_size, H, D]`` contiguous (into ``out`` if given)."""
        assert isinstance(cache, torch.Tensor)
        d = self.head_dim
        _check_kv_pages(cache, d)
        ids = _ids(block_ids, cache)
        _, h, n, _ = cache.shape
        _check_out(out, (ids.numel(), n, h, d), cache.dtype, cache.device)
        got = self._gather_native(cache, ids, out)
        if got is not None:
            return got
        k = _select(cache[..., :d].transpose(1, 2), ids, _nth(out, 0))
        v = _select(cache[..., d:].transpose(1, 2), ids, _nth(out, 1))
        return k, v

    def _gather_native(self, cache: torch.Tensor, ids: torch.Tensor, out: Out) -> tuple[torch.Tensor, ...] | None:
        """The same gather in one pass over each token's row (``hurray_kv_rows``); None where it does not apply.

        Each (block, token, head) row holds the key then the value: the C
        kernel reads it once and writes both halves, where two
        ``index_select`` calls stream every block twice. Byte-identical to
        the torch path. It needs the native kernels, a CPU cache whose last
        axis is element-contiguous (any order of the others: all six
        ``KVCacheLayout`` orders), CPU int64 block ids, and CPU destinations
        (allocated here without ``out``); anything else takes the torch path.

        Raises:
            HurrayFormatError: (field ``block_ids``) an id outside ``[0, B)``.
        """
        b, h, n, c = cache.shape
        d, es, m = self.head_dim, cache.element_size(), ids.numel()
        shape = (m, n, h, d)
        if cache.device.type != "cpu" or cache.layout != torch.strided or cache.stride(3) != 1 or c != 2 * d:
            return None
        if cache.is_conj() or cache.is_neg() or ids.device.type != "cpu" or ids.dtype != torch.int64 or ids.dim() != 1:
            return None
        if out is not None and (
            len(out) != 2
            or any(
                t.device.type != "cpu" or tuple(t.shape) != shape or t.dtype != cache.dtype or not t.is_contiguous()
                for t in out
            )
        ):
            return None  # the torch path says what is wrong with them
        if out is not None and (overlaps(out[0], cache) or overlaps(out[1], cache) or overlaps(out[0], out[1])):
            return None  # the C kernel would read what it wrote: torch's index_select refuses such out=
        lib = native.library()
        if lib is None:
            return None
        if out is None:
            out = (torch.empty(shape, dtype=cache.dtype), torch.empty(shape, dtype=cache.dtype))
        k, v = out[0], out[1]
        if m == 0 or n == 0 or h == 0 or d == 0:
            return k, v
        blocks = ids.contiguous()
        # The kernel indexes blocks[i] * sb + n * sn + h * sh + [0, 2 * D): in the cache for ids in [0, B)
        # (torch keeps every view inside its storage), and ((i * N + n) * H + h) * D + [0, D) of k and v.
        lo, hi = (int(x) for x in torch.aminmax(blocks))
        if lo < 0 or hi >= b:
            raise HurrayFormatError("block_ids", f"block ids must lie in [0, {b}) for this cache")
        sb, sh, sn, _ = (s * es for s in cache.stride())
        base, kp, vp = cache.data_ptr(), k.data_ptr(), v.data_ptr()
        lib.hurray_kv_rows(base, blocks.data_ptr(), 0, m, sb, sn, sh, n, h, d * es, kp, vp)
        return k, v


def cpu_has_amx() -> bool:
    """Whether this is an x86 CPU with AMX tiles, where vLLM's CPU backends use their AMX kernels (bf16)."""
    import platform

    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") and torch.cpu._is_amx_tile_supported()


def cpu_mla_backend() -> tuple[str, int]:
    """The MLA backend vLLM's CPU platform runs MLA models on here, and the smallest block size it takes.

    On an x86 CPU with AMX tiles vLLM picks ``AMX_MLA`` (bf16 only; blocks a
    multiple of 32, 128 by default; prefix caching and chunked prefill on),
    elsewhere the reference ``CPU_MLA`` (blocks of 16 whatever the engine
    asks for; prefix caching and chunked prefill off). The test is
    ``CpuPlatform.get_attn_backend_cls``'s; an engine configured with
    ``attention_backend="CPU_MLA"`` runs the reference backend anyway. Both
    take only a latent of 576 (kv_lora_rank 512 + rope 64).

    Example:
        >>> cpu_mla_backend() in (("AMX_MLA", 32), ("CPU_MLA", 16))
        True
    """
    return ("AMX_MLA", 32) if cpu_has_amx() else ("CPU_MLA", 16)


@dataclass(frozen=True)
class MLALatent:
    """An MLA (DeepSeek-style) latent cache: one vector of ``kv_lora_rank + rope_dim`` per token.

    vLLM keeps one tensor per layer, ``[num_blocks, block_size, C]`` on GPU
    backends (``MLACommonBackend.get_kv_cache_shape``) and on the CPU's
    ``AMX_MLA``, and ``[num_blocks, 1, block_size, C]`` on the CPU's
    reference ``CPU_MLA`` (which forces block size 16; see
    :func:`cpu_mla_backend`), token-major in all: each token's ``C`` values are the normalized
    compressed KV, then the rotated k_pe. One fused page pool
    ``[n, block_size, 1, C]`` comes out (kv_role ``"fused"``).
    """

    head_dim: int
    name: str = "vllm-mla"
    roles: ClassVar[tuple[str, ...]] = ("fused",)

    def _view(self, cache: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The cache as ``[B, N, 1, C]`` (a view; the head axis has one entry, so no data moves)."""
        if not isinstance(cache, torch.Tensor) or cache.shape[-1] != self.head_dim:
            got = list(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
            raise HurrayFormatError("cache", f"expected an MLA latent cache [B, N, {self.head_dim}], got {got}")
        if cache.dim() == 3:
            return cache.unsqueeze(2)
        if cache.dim() == 4 and cache.shape[1] == 1:
            return cache.transpose(1, 2)
        raise HurrayFormatError(
            "cache", f"expected [B, N, {self.head_dim}] or [B, 1, N, {self.head_dim}], got {list(cache.shape)}"
        )

    def page_shape(self, cache: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[int, int, int]:
        """``(block_size, 1, C)`` of one page."""
        return int(self._view(cache).shape[1]), 1, self.head_dim

    def gather(
        self, cache: torch.Tensor | tuple[torch.Tensor, ...], block_ids: torch.Tensor, out: Out = None
    ) -> tuple[torch.Tensor, ...]:
        """The latent of ``block_ids``: a 1-tuple ``([n, block_size, 1, C],)`` (into ``out[0]`` if given)."""
        view = self._view(cache)
        ids = _ids(block_ids, view)
        _check_out(out, (ids.numel(), *view.shape[1:]), view.dtype)
        return (_select(view, ids, _nth(out, 0)),)

    def scatter(self, cache: torch.Tensor, block_ids: torch.Tensor, latent: torch.Tensor) -> None:
        """Write ``latent`` (``[n, block_size, 1, C]`` in the cache's dtype) into blocks ``block_ids``.

        Args:
            cache: the layer's latent cache, viewed as its storage dtype (an
                fp8 cache held as raw ``uint8`` bytes: as ``float8``).
            block_ids: int64 ``[n]``, distinct.
            latent: the values, in ``cache``'s dtype (any device).

        Raises:
            HurrayFormatError: (field ``latent``) another dtype than the
                cache's; (field ``cache``) not an MLA latent cache.
        """
        view = self._view(cache)
        if latent.dtype != view.dtype:
            # No conversion here: float8 values into a raw uint8 cache would be converted numerically
            # (a 1.5 stored as byte 1), not moved as the bits the engine reads back as float8.
            raise HurrayFormatError(
                "latent", f"must be {view.dtype} (the cache's dtype; view raw storage as it first), got {latent.dtype}"
            )
        src = latent.to(device=view.device)
        if view.element_size() == 1:  # torch has no index_copy_ for float8: copy the bytes
            view, src = view.view(torch.uint8), src.view(torch.uint8)
        view.index_copy_(0, _ids(block_ids, view), src)


@dataclass(frozen=True)
class CpuPacked:
    """The CPU backend's cache ``[num_blocks, H, block_size, 2*D]``, packed per ISA.

    ``vllm/v1/attention/backends/cpu_attn.py`` (``do_kv_cache_update``)
    re-views each layer as ``[B, H, 2*N, D]`` and splits it into a key half
    and a value half (``chunk(2, dim=2)``): rows ``[0, N)`` of each
    (block, head) hold keys, rows ``[N, 2N)`` values, each an ``N*D``
    region whose element order the ISA's cache-write op
    (``cpu_attn_reshape_and_cache``) decides; ``_get_attn_isa`` picks the ISA.

    * ``vec`` / ``vec16``: keys transposed, ``[D, N]``; values row-major
      ``[N, D]``.
    * ``amx``: with ``P`` elements per pair (2 for 16- and 8-bit types, 1 for
      float32), keys ``[N/16][D/P][16 tokens][P dims]`` and values
      ``[D/16][N/P][16 dims][P tokens]``: the tile shapes of the AMX
      dot-product instructions.

    Derived from the op's output on index-coded inputs (``docs/vllm-layouts.md``)
    and checked against it for every ISA in the tests.
    """

    isa: str
    head_dim: int
    name: str = "vllm-cpu"

    _ISAS: ClassVar[tuple[str, ...]] = ("vec", "vec16", "amx")

    def page_shape(self, cache: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[int, int, int]:
        """``(block_size, H, D)`` of one page of the packed ``[B, H, N, 2*D]`` cache.

        Raises:
            HurrayFormatError: (field ``cache``) a cache whose last dimension
                is not ``2 * head_dim`` (values of another head size than the keys).
        """
        assert isinstance(cache, torch.Tensor)
        _check_kv_pages(cache, self.head_dim)
        return int(cache.shape[2]), int(cache.shape[1]), self.head_dim

    def __post_init__(self) -> None:
        if self.isa not in self._ISAS:
            raise HurrayFormatError("isa", f"CPU cache packing for ISA {self.isa!r} is not known (have {self._ISAS})")

    def gather(
        self, cache: torch.Tensor | tuple[torch.Tensor, ...], block_ids: torch.Tensor, out: Out = None
    ) -> tuple[torch.Tensor, ...]:
        """Keys and values of ``block_ids`` unpacked, each ``[n, block_size, H, D]`` (into ``out`` if given)."""
        assert isinstance(cache, torch.Tensor)
        b, h, n, d, p = self._geometry(cache)
        ids = _ids(block_ids, cache)
        m = ids.numel()
        _check_out(out, (m, n, h, d), cache.dtype, cache.device)
        if out is None:
            out = (
                torch.empty((m, n, h, d), dtype=cache.dtype, device=cache.device),
                torch.empty((m, n, h, d), dtype=cache.dtype, device=cache.device),
            )
        if self._gather_native(cache, ids, out):
            return out
        k, v, wide = self._views(cache.reshape(b, h, 2, n * d), n, d, p)
        _select(k, ids, out[0] if wide is None else out[0].view(wide))
        _select(v, ids, out[1])
        return out

    def scatter(self, cache: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write whole blocks into ``cache``: the inverse of :meth:`gather`.

        ``keys`` and ``values`` are ``[n, block_size, H, head_dim]`` in the
        cache's dtype; ``block_ids`` (int64 ``[n]``) must be distinct. For an
        unquantized cache this packs exactly what vLLM's
        ``cpu_attn_reshape_and_cache`` (``csrc/cpu/cpu_attn.cpp``) would
        write for those tokens (tested against it), at memory speed through
        the native kernels; fp8 caches need the op's quantization instead.
        """
        b, h, n, d, p = self._geometry(cache)
        ids = _ids(block_ids, cache)
        m = ids.numel()
        for name, t in (("keys", keys), ("values", values)):
            if tuple(t.shape) != (m, n, h, d) or t.dtype != cache.dtype:
                raise HurrayFormatError(
                    name, f"must be {cache.dtype} [{m}, {n}, {h}, {d}], got {t.dtype} {list(t.shape)}"
                )
            if t.device != cache.device:  # the native kernels take raw host pointers: no GPU or meta ones
                raise HurrayArgumentError(name, f"must be on the cache's {cache.device}, got {t.device}")
        if m == 0:
            return
        lo, hi = (int(x) for x in torch.aminmax(ids))  # one pass: this runs per layer, role and slice of a load
        if lo < 0 or hi >= b:
            raise HurrayFormatError("block_ids", f"block ids must lie in [0, {b}) for this cache")
        keys, values = keys.contiguous(), values.contiguous()
        if self._scatter_native(cache, ids, keys, values):
            return
        # Bits are moved, not values: as integers of the same width (index_copy_ has no float8 kernels).
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[cache.element_size()]
        try:
            planes = cache.view(bits).view(b, h, 2, n * d)  # never reshape: a copy would take the writes
        except RuntimeError:
            raise HurrayFormatError("cache", "each (block, head) plane must be contiguous to be written") from None
        k, v, wide = self._views(planes, n, d, p)
        k.index_copy_(0, ids, keys.view(bits if wide is None else wide).view(m, *k.shape[1:]))
        v.index_copy_(0, ids, values.view(bits).view(m, *v.shape[1:]))

    def _geometry(self, cache: torch.Tensor) -> tuple[int, int, int, int, int]:
        """``(B, H, N, head_dim, P)`` of ``cache``, refusing shapes the packing cannot hold."""
        d = self.head_dim
        _check_kv_pages(cache, d)
        b, h, n, _ = cache.shape
        es = cache.element_size()
        if es not in (1, 2, 4):  # vLLM's CPU cache-write op packs 8-, 16- and 32-bit elements only
            raise HurrayFormatError(
                "cache", f"CPU cache packing holds 1-, 2- or 4-byte elements (fp8, fp16/bf16, fp32), got {cache.dtype}"
            )
        p = 1 if es == 4 else 2
        if self.isa == "amx" and (n % 16 or d % 16 or n % p or d % p):
            raise HurrayFormatError("cache", f"AMX packing needs block_size and head_dim multiples of 16, got {n}, {d}")
        return b, h, n, d, p

    def _views(
        self, planes: torch.Tensor, n: int, d: int, p: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype | None]:
        """The key and value planes of ``planes`` (``[B, H, 2, N*D]``) as strided views, block first.

        Their other dims run in the interchange order: what gather reads and scatter writes.

        AMX keys come as integers ``P`` elements wide (the third value; ``None`` otherwise): a
        key's ``P`` adjacent dims move as one, where a 2-element innermost loop would make the
        copy several times slower.
        """
        kp, vp = planes[:, :, 0], planes[:, :, 1]
        if self.isa in ("vec", "vec16"):
            return kp.unflatten(-1, (d, n)).permute(0, 3, 1, 2), vp.unflatten(-1, (n, d)).permute(0, 2, 1, 3), None
        wide = {2: torch.int16, 4: torch.int32, 8: torch.int64}[p * planes.element_size()]
        k = kp.view(wide).unflatten(-1, (n // 16, d // p, 16)).permute(0, 2, 4, 1, 3)
        v = vp.unflatten(-1, (d // 16, n // p, 16, p)).permute(0, 3, 5, 1, 2, 4)
        return k, v, wide

    def _native(self, cache: torch.Tensor) -> tuple[ctypes.CDLL, int, int, tuple[int, ...]] | None:
        """(library, key plane base, value plane base, geometry) when the C kernels apply, else None.

        They need a CPU cache whose (block, head) planes are contiguous and
        1-, 2- or 4-byte elements; the value plane follows the key plane in
        every (block, head).
        """
        es = cache.element_size()
        _, h, n, c = cache.shape
        if cache.device.type != "cpu" or es not in (1, 2, 4) or cache.stride(3) != 1 or cache.stride(2) != c:
            return None
        lib = native.library()
        if lib is None:
            return None
        base = cache.data_ptr()
        return lib, base, base + n * self.head_dim * es, (cache.stride(0), cache.stride(1), h, n, self.head_dim)

    def _scatter_native(self, cache: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
        got = self._native(cache)
        if got is None:
            return False
        lib, base_k, base_v, geometry = got
        es = cache.element_size()
        blocks = ids.contiguous()
        vec = self.isa in ("vec", "vec16")
        fk = native.kernel(lib, f"hurray_{'vec' if vec else 'amx'}_keys_put_{es}")
        fv = native.kernel(lib, f"hurray_{'rows' if vec else 'amx_values'}_put_{es}")
        fk(base_k, blocks.data_ptr(), 0, blocks.numel(), *geometry, keys.data_ptr())
        fv(base_v, blocks.data_ptr(), 0, blocks.numel(), *geometry, values.data_ptr())
        return True

    def _gather_native(self, cache: torch.Tensor, ids: torch.Tensor, out: tuple[torch.Tensor, ...]) -> bool:
        """The same gather through the C kernels of :mod:`hurray_vllm.native`; False where they do not apply.

        The results are byte-identical to the torch path's. The vec/vec16
        values are already row-major and go through ``index_select`` at
        memory speed.
        """
        got = self._native(cache)
        if got is None:
            return False
        lib, base_k, base_v, geometry = got
        b, h, n, _ = cache.shape
        d, es = self.head_dim, cache.element_size()
        m = ids.numel()
        if m == 0:
            return True
        blocks = ids.contiguous()
        if int(blocks.min()) < 0 or int(blocks.max()) >= b:
            raise HurrayFormatError("block_ids", f"block ids must lie in [0, {b}) for this cache")
        bp, dk, dv = blocks.data_ptr(), out[0].data_ptr(), out[1].data_ptr()
        vec = self.isa in ("vec", "vec16")
        fk = native.kernel(lib, f"hurray_{'vec' if vec else 'amx'}_keys_{es}")
        fv = None if vec else native.kernel(lib, f"hurray_amx_values_{es}")

        fk(base_k, bp, 0, m, *geometry, dk)
        if fv is not None:
            fv(base_v, bp, 0, m, *geometry, dv)
        if vec:
            planes = cache.reshape(b, h, 2, n * d)
            _select(planes[:, :, 1].unflatten(-1, (n, d)).permute(0, 2, 1, 3), ids, out[1])
        return True


@dataclass(frozen=True)
class _StackedKV:
    """Caches that stack K and V on one axis of a 5-D tensor of ``[B, N, H, D]`` pages."""

    name: str
    #: Where K and V sit: 0 for ``[2, B, N, H, D]``, 1 for ``[B, 2, N, H, D]``.
    kv_axis: int

    def page_shape(self, cache: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[int, int, int]:
        """``(block_size, num_kv_heads, head_dim)`` of ``cache``.

        Raises:
            HurrayFormatError: (field ``cache``) not this layout's 5-D tensor.
        """
        n, h, d = self._checked(cache).shape[2:]
        return int(n), int(h), int(d)

    def gather(
        self, cache: torch.Tensor | tuple[torch.Tensor, ...], block_ids: torch.Tensor, out: Out = None
    ) -> tuple[torch.Tensor, ...]:
        """The pages ``block_ids`` of K and V, each ``[len(block_ids), N, H, D]`` (into ``out`` if given)."""
        cache = self._checked(cache)
        ids = _ids(block_ids, cache)
        _check_out(out, (ids.numel(), *cache.shape[2:]), cache.dtype)
        k, v = cache.select(self.kv_axis, 0), cache.select(self.kv_axis, 1)
        return _select(k, ids, _nth(out, 0)), _select(v, ids, _nth(out, 1))

    def _checked(self, cache: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``cache``, refused by name unless it stacks K and V on this layout's axis of a 5-D tensor."""
        if not isinstance(cache, torch.Tensor) or cache.dim() != 5 or cache.shape[self.kv_axis] != 2:
            want = "[2, B, N, H, D]" if self.kv_axis == 0 else "[B, 2, N, H, D]"
            got = list(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
            raise HurrayFormatError("cache", f"expected {want}, got {got}")
        return cache


@dataclass(frozen=True)
class FlashAttnLegacy(_StackedKV):
    """Older vLLM FlashAttention caches: ``[2, num_blocks, block_size, H, D]``.

    ``vllm/v1/attention/backends/flash_attn.py`` ``get_kv_cache_shape`` (up
    to 0.11); the HND stride order stores ``[2, B, H, N, D]`` physically but
    presents the same logical shape, so any strides work here.
    """

    name: str = "flash-attn-legacy"
    kv_axis: int = 0


@dataclass(frozen=True)
class FlashInferLegacy(_StackedKV):
    """Older vLLM FlashInfer caches: ``[num_blocks, 2, block_size, H, D]`` (NHD or HND strides).

    ``vllm/v1/attention/backends/flashinfer.py`` ``get_kv_cache_shape``.
    """

    name: str = "flashinfer-legacy"
    kv_axis: int = 1


@dataclass(frozen=True)
class PagedAttentionLegacy:
    """paged_attention_v1/v2 caches: key ``[B, H, D/x, N, x]``, value ``[B, H, D, N]``.

    ``vllm/attention/ops/paged_attn.py`` ``PagedAttention.split_kv_cache``
    (vLLM <= 0.10): ``x = 16 // element_size`` elements of a key row are
    kept together so one 16-byte load fetches them.
    """

    name: str = "paged-attention-legacy"

    def page_shape(self, cache: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[int, int, int]:
        """``(block_size, H, D)`` of one page, from the key cache ``[B, H, D/x, N, x]``.

        Raises:
            HurrayFormatError: (field ``cache``) not a key and value cache pair of one geometry.
        """
        kc, _ = self._pair(cache)
        _, h, dx, n, x = kc.shape
        return int(n), int(h), int(dx * x)

    def gather(
        self, cache: torch.Tensor | tuple[torch.Tensor, ...], block_ids: torch.Tensor, out: Out = None
    ) -> tuple[torch.Tensor, ...]:
        """Keys and values of ``block_ids`` from the cache pair, each ``[n, block_size, H, D]`` (into ``out``)."""
        kc, vc = self._pair(cache)
        x = int(kc.shape[-1])
        ids = _ids(block_ids, kc)
        _, h, dx, n, _ = kc.shape
        _check_out(out, (ids.numel(), n, h, dx * x), kc.dtype)
        k = _select(kc.permute(0, 3, 1, 2, 4), ids, _nth(out, 0)).reshape(ids.numel(), n, h, dx * x)
        v = _select(vc.permute(0, 3, 1, 2), ids, _nth(out, 1))
        return k, v

    @staticmethod
    def _pair(cache: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value caches of ``cache``, refused by name unless they hold the same pages.

        A value cache of another head count, head size, block size or block
        count than the key cache's would be exported beside the keys as if
        it matched them.
        """
        if not isinstance(cache, tuple) or len(cache) != 2:
            raise HurrayFormatError("cache", "paged-attention caches come as a (key_cache, value_cache) pair")
        kc, vc = cache
        if kc.dim() != 5 or vc.dim() != 4:
            raise HurrayFormatError(
                "cache", f"expected key [B,H,D/x,N,x] and value [B,H,D,N], got {list(kc.shape)}, {list(vc.shape)}"
            )
        x = 16 // kc.element_size()
        if kc.shape[-1] != x:
            raise HurrayFormatError("cache", f"key cache's last dim is {kc.shape[-1]}, expected x = {x}")
        b, h, dx, n, _ = kc.shape
        if tuple(vc.shape) != (b, h, dx * x, n):
            raise HurrayFormatError(
                "cache",
                f"the value cache {list(vc.shape)} does not match the key cache {list(kc.shape)}: "
                f"expected [{b}, {h}, {dx * x}, {n}] (the same blocks, heads, head size and block size)",
            )
        return kc, vc
