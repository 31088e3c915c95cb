"""Poly1305 from the system's OpenSSL 3 (``libcrypto``), called through :mod:`ctypes`.

Why not only ``cryptography``'s ``Poly1305``: it holds the GIL while it
hashes. A keyed consumer checks every chunk's MAC on a helper thread so the
check overlaps the scheduler reading the next file; under the GIL it did
not, and a keyed load took 1.4x an unkeyed one (the CRC-32C it replaces is
native and releases the GIL). Through :mod:`ctypes` the same OpenSSL code
(vectorized, ~10 GB/s) runs with the GIL released.

Tags are byte-identical to ``cryptography``'s (tested). Where libcrypto 3 is
missing, lacks ``EVP_MAC``, or ``HURRAY_VLLM_NATIVE=0`` is set,
:func:`poly1305` returns ``None`` and the caller uses ``cryptography``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import DISABLED, disabled

if TYPE_CHECKING:
    import torch

__all__ = ["NativePoly1305", "poly1305", "unavailable_reason"]

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _load() -> tuple[Any, Any] | None:
    """``(libcrypto, EVP_MAC* for POLY1305)``, or ``None`` with the reason in ``_state``."""
    if "lib" in _state:  # every chunk MAC asks: no lock once loaded
        return _state["lib"]
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        out: tuple[Any, Any] | None = None
        reason = None
        if disabled():
            reason = DISABLED
        else:
            try:
                out = _bind()
            except (OSError, AttributeError) as exc:  # no libcrypto, or one before 3.0 (no EVP_MAC)
                reason = f"libcrypto 3 not usable: {exc}"
            if out is None and reason is None:
                reason = "libcrypto has no POLY1305 MAC"
        _state["lib"], _state["reason"] = out, reason
        return out


def _bind() -> tuple[Any, Any] | None:
    name = ctypes.util.find_library("crypto") or "libcrypto.so.3"
    lib = ctypes.CDLL(name)  # CDLL, not PyDLL: calls release the GIL
    c_void_p, c_size_t = ctypes.c_void_p, ctypes.c_size_t
    lib.EVP_MAC_fetch.restype, lib.EVP_MAC_fetch.argtypes = c_void_p, [c_void_p, ctypes.c_char_p, ctypes.c_char_p]
    lib.EVP_MAC_CTX_new.restype, lib.EVP_MAC_CTX_new.argtypes = c_void_p, [c_void_p]
    lib.EVP_MAC_init.restype = ctypes.c_int
    lib.EVP_MAC_init.argtypes = [c_void_p, ctypes.c_char_p, c_size_t, c_void_p]
    lib.EVP_MAC_update.restype, lib.EVP_MAC_update.argtypes = ctypes.c_int, [c_void_p, c_void_p, c_size_t]
    lib.EVP_MAC_final.restype = ctypes.c_int
    lib.EVP_MAC_final.argtypes = [c_void_p, ctypes.c_char_p, ctypes.POINTER(c_size_t), c_size_t]
    lib.EVP_MAC_CTX_free.restype, lib.EVP_MAC_CTX_free.argtypes = None, [c_void_p]
    mac = lib.EVP_MAC_fetch(None, b"POLY1305", None)  # fetched once, shared: EVP_MAC objects are thread-safe
    return (lib, mac) if mac else None


def unavailable_reason() -> str | None:
    """Why :func:`poly1305` returns ``None``, or ``None`` when it does not."""
    _load()
    reason: str | None = _state.get("reason")
    return reason


class NativePoly1305:
    """One Poly1305 computation (one-time ``key`` of 32 bytes); not for use by two threads at once."""

    def __init__(self, lib: Any, mac: Any, key: bytes) -> None:
        self._lib, self._ctx = lib, None  # first: __del__ runs even when __init__ raises
        if len(key) != 32:
            raise ValueError("a Poly1305 key is 32 bytes")
        self._ctx = lib.EVP_MAC_CTX_new(mac)
        if not self._ctx or lib.EVP_MAC_init(self._ctx, key, 32, None) != 1:
            self._free()
            raise RuntimeError("libcrypto refused to start a Poly1305 MAC")

    def _live(self) -> Any:
        """The MAC context; a finalized one is gone (OpenSSL would be handed NULL and crash the process)."""
        if not self._ctx:
            raise RuntimeError("this Poly1305 MAC is finalized; start another")
        return self._ctx

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Add ``data``'s bytes: a writable buffer (a tensor's ``byte_view``) is read in place, others copied first."""
        ctx = self._live()
        view = memoryview(data)
        if not view.nbytes:
            return
        if not view.readonly and view.c_contiguous:
            buf: Any = (ctypes.c_char * view.nbytes).from_buffer(view.cast("B"))  # no copy: a page pool's bytes
        else:
            buf = view.tobytes()
        if self._lib.EVP_MAC_update(ctx, buf, view.nbytes) != 1:
            raise RuntimeError("libcrypto's Poly1305 update failed")

    def update_tensors(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Add the bytes of contiguous CPU ``tensors``, in order, in one native call; False without the native kernels.

        One call releases the GIL once for a whole chunk's page pools, as
        :func:`hurray_vllm.native.crc32c_tensors` does for the checksum: a
        helper thread otherwise waits for the GIL after every pool while the
        engine's thread holds it.

        Raises:
            ValueError: a tensor that is not contiguous or not on the CPU.
        """
        from . import library, segments

        ctx = self._live()
        lib = library()
        if lib is None:
            return False
        fn = lib.hurray_update_segments  # declared by library()
        update = ctypes.cast(self._lib.EVP_MAC_update, ctypes.c_void_p)
        if fn(update, ctx, *segments(tensors, "NativePoly1305.update_tensors")) != 0:
            raise RuntimeError("libcrypto's Poly1305 update failed")
        return True

    def finalize(self) -> bytes:
        """The 16-byte tag; the object takes nothing more afterwards."""
        ctx = self._live()
        out, n = ctypes.create_string_buffer(16), ctypes.c_size_t()
        try:
            if self._lib.EVP_MAC_final(ctx, out, ctypes.byref(n), 16) != 1 or n.value != 16:
                raise RuntimeError("libcrypto's Poly1305 final failed")
        finally:
            self._free()
        return out.raw

    def _free(self) -> None:
        if self._ctx:
            self._lib.EVP_MAC_CTX_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        self._free()


def poly1305(key: bytes) -> NativePoly1305 | None:
    """A GIL-free Poly1305 under ``key``, or ``None`` where libcrypto 3 is not usable (see :func:`unavailable_reason`).

    Example:
        >>> m = poly1305(bytes(range(32)))
        >>> m is None or (m.update(b"abc"), len(m.finalize()))[1] == 16
        True
    """
    loaded = _load()
    if loaded is None:
        return None
    return NativePoly1305(loaded[0], loaded[1], key)
