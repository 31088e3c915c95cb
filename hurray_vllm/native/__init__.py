"""Optional native kernels for the copies torch's strided loops make slow.

The CPU backend's packed KV cache planes (``CpuPacked``) need transposing
copies whose contiguous runs are 4 to 32 bytes; torch runs them through
short inner loops at a third of memory speed. ``cpu_packed.c`` holds plain C
loops for them: no Python or torch headers, built with the system C
compiler (``$CC`` or ``cc``) the first time they are needed, cached under
``$HURRAY_VLLM_CACHE_DIR`` (default ``~/.cache/hurray-vllm``) by a hash of
the source, and loaded with :mod:`ctypes` (which releases the GIL during a
call). Built with ``-fopenmp`` where the compiler can, the kernels split
their work with OpenMP; loaded after torch, the library binds to the libgomp
torch already loaded (same soname), so it shares torch's thread pool and
``torch.set_num_threads``. Python threads would compete with that pool's
spinning workers instead: on 2 cores that halved the speed.

Everything has a pure-torch fallback with byte-identical results: when no
compiler is found, the build fails, or ``HURRAY_VLLM_NATIVE=0`` is set,
:func:`library` returns ``None`` and :func:`unavailable_reason` says why.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import HurrayArgumentError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CRC_PAGE",
    "DISABLED",
    "cache_dir",
    "crc32c",
    "crc32c_fold",
    "crc32c_ranges",
    "disabled",
    "kernel",
    "library",
    "read_crc32c_pages",
    "segments",
    "unavailable_reason",
]

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = ("cpu_packed.c", "cpu_packed_body.h", "cpu_packed_sse2.h", "crc32c.h")
_FLAGS = ("-O3", "-fPIC", "-shared", "-std=c11", "-fno-strict-aliasing")
_OPENMP = ("-fopenmp",)  # tried first; without it the kernels run on the calling thread
_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_dir() -> Path:
    """Where built libraries are kept.

    ``$HURRAY_VLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/hurray-vllm``, else ``~/.cache/hurray-vllm``.
    """
    env = os.environ.get("HURRAY_VLLM_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hurray-vllm"


def _private_dir(path: Path) -> Path:
    """``path``, a directory only this user can write to (made so if new).

    Why: a shared temporary directory's name is predictable, and a library
    another local user planted there would run inside the engine.

    Raises:
        PermissionError: it exists, and another user owns it or may write to it.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_owned(path)
    return path


def _check_owned(path: Path) -> None:
    st = os.lstat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o022 or stat.S_ISLNK(st.st_mode):
        raise PermissionError(errno.EPERM, "not owned by this user alone; native kernels not loaded from it", str(path))


def _build(target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        for extra in (_OPENMP, ()):
            cmd = [cc, *_FLAGS, *extra, "-o", tmp, str(_HERE / "cpu_packed.c")]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
            if done.returncode == 0:
                break
        else:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: concurrent builders each install a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


#: Why native code is not used when ``HURRAY_VLLM_NATIVE=0``.
DISABLED = "disabled by HURRAY_VLLM_NATIVE=0"


def disabled() -> bool:
    """``HURRAY_VLLM_NATIVE=0``: every native path (built kernels, OpenSSL) falls back to Python/torch."""
    return os.environ.get("HURRAY_VLLM_NATIVE", "1") == "0"


def library() -> ctypes.CDLL | None:
    """The native kernels, built on first use; ``None`` when they cannot be had (see :func:`unavailable_reason`)."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib: ctypes.CDLL | None = None
        reason: str | None = None
        if disabled():
            reason = DISABLED
        else:
            try:
                lib = _load()
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                reason = f"native kernels unavailable, using torch copies: {exc}"
                log.info(reason)
        _state["lib"], _state["reason"] = lib, reason
        return lib


def _load() -> ctypes.CDLL:
    """Build (unless built) and load the kernels, their functions' prototypes declared."""
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update((_HERE / name).read_bytes())
    digest.update(" ".join(_FLAGS).encode())
    digest.update(platform.machine().encode())
    name = f"cpu_packed-{digest.hexdigest()[:16]}.so"
    try:
        base: Path | None = cache_dir()
    except RuntimeError:  # no home: a container's user without a passwd entry or $HOME
        base = None
    target: Path | None = None
    if base is not None:
        try:
            # Only a directory this user alone may write to: another user's library planted there would run
            # inside the engine (the file's name is public: a hash of these sources).
            target = _private_dir(base) / name
            if not target.exists():
                _build(target)
            _check_owned(target)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            target = None  # read-only, or others may write to it
    if target is None:
        # Build into a per-user temporary directory instead.
        target = _private_dir(Path(tempfile.gettempdir()) / f"hurray-vllm-{os.getuid()}") / name
        if not target.exists():
            _build(target)
        _check_owned(target)
    import torch  # noqa: F401  (load torch's libgomp first, so the kernels share it)

    lib = ctypes.CDLL(str(target))
    # Declared here, once, under library()'s lock, before any caller sees the library: declared lazily by
    # each caller, a second thread could call a function whose argtypes were set but not yet its restype
    # (ctypes' default c_int turned a CRC above 2**31 negative).
    _declare(lib.hurray_crc32c, [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_uint32)
    segments_args = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    _declare(lib.hurray_crc32c_segments, segments_args, ctypes.c_uint32)
    _declare(lib.hurray_update_segments, [ctypes.c_void_p] * 4 + [ctypes.c_size_t], ctypes.c_int)
    _declare(lib.hurray_crc32c_pages_ok, [], ctypes.c_int)
    _declare(lib.hurray_crc32c_fold, [ctypes.c_int], ctypes.c_int)
    read_args = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    _declare(lib.hurray_read_crc32c_pages, read_args, ctypes.c_int64)
    ranges_args = [ctypes.c_uint32, *[ctypes.c_void_p] * 2, ctypes.c_size_t, *[ctypes.c_void_p] * 2, ctypes.c_size_t]
    _declare(lib.hurray_crc32c_ranges, ranges_args, ctypes.c_uint32)
    # (base, blocks, i0, i1, sb, sn, sh, N, H, Db, k_out, v_out): byte strides and row half in bytes.
    kv_rows_args = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 8, ctypes.c_void_p, ctypes.c_void_p]
    _declare(lib.hurray_kv_rows, kv_rows_args, None)
    return lib


def _declare(fn: Any, argtypes: list[Any], restype: Any) -> None:
    fn.restype = restype  # first: argtypes set is what tells a function declared
    fn.argtypes = argtypes


def unavailable_reason() -> str | None:
    """Why :func:`library` returned ``None`` (``None`` when it did not, or was not asked yet)."""
    return _state.get("reason")  # type: ignore[return-value]


def crc32c_tensors(tensors: Sequence[torch.Tensor], crc: int = 0) -> int | None:
    """CRC-32C of the bytes of contiguous CPU ``tensors``, one after another, in one native call.

    ``None`` when the native kernels are unavailable. Releases the GIL once
    for all of them: a helper thread checksumming a chunk's page pools
    otherwise waits for the GIL after every pool while another thread
    (the engine's) holds it.
    """
    lib = library()
    if lib is None:
        return None
    fn = lib.hurray_crc32c_segments  # declared by library()
    return int(fn(crc, *segments(tensors, "crc32c_tensors")))


def segments(tensors: Sequence[torch.Tensor], caller: str) -> tuple[Any, Any, int]:
    """``(addresses, byte lengths, count)`` of contiguous CPU ``tensors``, as the ``*_segments`` kernels take them.

    The caller keeps the tensors alive during the native call.

    Raises:
        HurrayArgumentError: (field ``tensors``, a :class:`ValueError`) a tensor
            that is not contiguous or not on the CPU.
    """
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise HurrayArgumentError("tensors", f"{caller} needs contiguous CPU tensors, got one on {t.device}")
    addrs = (ctypes.c_uint64 * len(tensors))(*(t.data_ptr() for t in tensors))
    lens = (ctypes.c_uint64 * len(tensors))(*(t.numel() * t.element_size() for t in tensors))
    return addrs, lens, len(tensors)


_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 7, ctypes.c_void_p]


def kernel(lib: ctypes.CDLL, name: str) -> Callable[..., None]:
    """``lib``'s function ``name`` with the kernels' signature declared.

    Every kernel takes ``(base, blocks, i0, i1, sb, sh, H, N, D, dst)``:
    pointers to the cache and to int64 block ids, the block range, the
    block and head strides in elements, the page shape, and the output.
    """
    fn = getattr(lib, name)
    if fn.argtypes is None:
        _declare(fn, _ARGTYPES, None)
    return fn


def crc32c(data: memoryview | bytes | bytearray, crc: int = 0) -> int | None:
    """CRC-32C of ``data`` continuing from ``crc`` (as :func:`hurray_vllm.wire.crc32c.crc32c`), or ``None``.

    ``None`` when the native kernels are unavailable. Releases the GIL while
    it runs (ctypes), so other threads go on.
    """
    lib = library()
    if lib is None:
        return None
    fn = lib.hurray_crc32c  # declared by library()
    mv = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    n = mv.nbytes
    if n == 0:
        return crc
    # The object whose address is taken stays referenced through the call, which runs without the GIL: its
    # export keeps the buffer from being resized or closed by another thread meanwhile.
    if mv.readonly:
        # ctypes cannot take the address of a read-only buffer; numpy can, without a copy.
        import numpy as np

        held: Any = np.frombuffer(mv, dtype=np.uint8)
        addr = held.ctypes.data
    else:
        held = ctypes.c_char.from_buffer(mv)
        addr = ctypes.addressof(held)
    result = int(fn(crc, addr, n))
    del held
    return result


#: The page of :func:`read_crc32c_pages`' registers, in bytes (the kernels' ``LANE``).
CRC_PAGE = 4096


def read_crc32c_pages(fd: int, buf: torch.Tensor) -> tuple[int, torch.Tensor | None] | None:
    """Fill ``buf`` from file descriptor ``fd`` (from its offset) and checksum each page as it arrives.

    Returns ``(bytes read, registers)``: fewer bytes than ``buf`` holds at
    the file's end; the registers (int32, one per whole :data:`CRC_PAGE` of
    ``buf``, each from zero) are what :func:`crc32c_ranges` combines into the
    CRC-32C of any ranges of ``buf``, without reading the bytes again; ``None``
    without the crc32 instruction (a plain read then). ``None`` in all when
    the native kernels are unavailable (the caller reads as it would). One
    native call for the whole read, which releases the GIL once.

    Raises:
        HurrayArgumentError: (field ``buf``) not a contiguous uint8 CPU
            tensor over its own storage.
        OSError: the read failed.
    """
    lib = library()
    if lib is None:
        return None
    import torch

    # Checked, not asserted: read() writes numel() bytes at data_ptr(), so an expanded (stride-0) or GPU/meta
    # tensor would let the kernel write past its storage, also under ``python -O``.
    n = buf.numel()
    if buf.dtype != torch.uint8 or buf.device.type != "cpu" or not buf.is_contiguous():
        what = f"{'a contiguous' if buf.is_contiguous() else 'a non-contiguous'} {buf.dtype} tensor on {buf.device}"
        raise HurrayArgumentError("buf", f"must be a contiguous uint8 CPU tensor to read into, got {what}")
    if buf.storage_offset() + n > buf.untyped_storage().nbytes():
        raise HurrayArgumentError("buf", f"its {n} bytes run past the end of its storage: read into a fresh tensor")
    pages = torch.empty(n // CRC_PAGE, dtype=torch.int32) if lib.hurray_crc32c_pages_ok() else None
    got = int(lib.hurray_read_crc32c_pages(fd, buf.data_ptr(), n, pages.data_ptr() if pages is not None else None))
    if got < 0:
        raise OSError(-got, os.strerror(-got))
    return got, pages[: got // CRC_PAGE] if pages is not None else None  # a short read filled fewer


def crc32c_ranges(crc: int, base: torch.Tensor, pages: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> int | None:
    """CRC-32C continuing from ``crc`` over byte ranges ``(offset, length)`` of ``base``, one after another.

    ``pages``: :func:`read_crc32c_pages`' registers of ``base``, read into
    ``base`` by it and not changed since: whole pages inside a range are
    combined from them, partial ones checksummed from ``base``. ``None``
    when the native kernels are unavailable.

    Raises:
        HurrayArgumentError: (a :class:`ValueError`) a range outside
            ``base`` (field ``ranges``); ``pages`` or ``base`` not
            contiguous CPU tensors (field ``pages`` or ``base``).
    """
    lib = library()
    if lib is None:
        return None
    import torch

    size = base.numel() * base.element_size()
    # The kernel dereferences both pointers on the host: a CUDA or meta tensor would crash the process.
    if pages.dtype != torch.int32 or pages.device.type != "cpu" or not pages.is_contiguous():
        raise HurrayArgumentError(
            "pages", f"must be read_crc32c_pages' contiguous int32 CPU registers, got {pages.dtype} on {pages.device}"
        )
    if base.device.type != "cpu" or not base.is_contiguous():
        raise HurrayArgumentError("base", f"must be a contiguous CPU tensor (the buffer read into), got {base.device}")
    for off, length in ranges:
        if off < 0 or length < 0 or off + length > size:
            raise HurrayArgumentError("ranges", f"range ({off}, {length}) outside the base's {size} bytes")
    offs = (ctypes.c_uint64 * len(ranges))(*(off for off, _ in ranges))
    lens = (ctypes.c_uint64 * len(ranges))(*(length for _, length in ranges))
    n = min(pages.numel(), size // CRC_PAGE)
    return int(lib.hurray_crc32c_ranges(crc, base.data_ptr(), pages.data_ptr(), n, offs, lens, len(ranges)))


def crc32c_fold(on: bool | None = None) -> bool:
    """Whether long CRC-32C checksums fold with VPCLMULQDQ here (AVX-512), and turn it off or back on.

    ``on``: ``False`` checksums with the crc32 instruction only (three lanes),
    ``True`` folds again where the CPU can; ``None`` only asks. Both give the
    same checksums; this is for tests and benchmarks that compare them. Not
    thread-safe: call it while nothing checksums. ``False`` without the
    native kernels.
    """
    lib = library()
    if lib is None:
        return False
    return bool(lib.hurray_crc32c_fold(-1 if on is None else int(on)))
