"""The optional C kernels for the CPU-packed layouts: byte-identical to the torch path, and optional."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hurray_vllm import native
from hurray_vllm.adapters.vllm import CpuPacked


@pytest.fixture
def torch_only(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Run with the native kernels switched off, then restore whatever was loaded."""
    saved = dict(native._state)
    monkeypatch.setenv("HURRAY_VLLM_NATIVE", "0")
    native._state.clear()
    yield
    native._state.clear()
    native._state.update(saved)


def _lib() -> ctypes.CDLL:
    lib = native.library()
    if lib is None and os.environ.get("CI") == "true":
        pytest.fail(f"native kernels must build in CI: {native.unavailable_reason()}")
    if lib is None:
        pytest.skip(f"no native kernels here: {native.unavailable_reason()}")
    return lib


def _cache(dtype: torch.dtype, b: int, h: int, n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(2**15), 2**15, (b, h, n, 2 * d * dtype.itemsize // 2), generator=g, dtype=torch.int16)
    return raw.view(torch.uint8).view(dtype).view(b, h, n, 2 * d)


CASES = [
    (isa, dtype, n, d)
    for isa in ("vec", "vec16", "amx")
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)
    for n, d in ((32, 64), (128, 128), (32, 80))
    if not (isa == "amx" and d % 16)
]


@pytest.mark.parametrize(("isa", "dtype", "n", "d"), CASES)
def test_native_gather_equals_the_torch_gather(isa: str, dtype: torch.dtype, n: int, d: int, torch_only) -> None:  # type: ignore[no-untyped-def]
    cache = _cache(dtype, 9, 3, n, d, seed=n + d)
    ids = torch.tensor([7, 0, 3, 3, 8])
    want = CpuPacked(isa, d).gather(cache, ids)  # torch path (native switched off by the fixture)
    native._state.clear()
    os.environ["HURRAY_VLLM_NATIVE"] = "1"
    _lib()
    layout = CpuPacked(isa, d)
    out = (torch.empty_like(want[0]), torch.empty_like(want[1]))
    assert layout._gather_native(cache, ids, out)
    for a, b in zip(want, out, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # A strided cache (a view of a larger buffer, as vLLM's per-layer views are) reads the same.
    big = torch.cat([cache, cache], dim=1)[:, :3]
    assert layout._gather_native(big, ids, out)
    assert torch.equal(want[0].view(torch.uint8), out[0].view(torch.uint8))


@pytest.mark.parametrize("kind", ["vec_keys", "amx_keys", "amx_values"])
def test_sse2_kernels_equal_the_portable_loops(kind: str) -> None:
    lib = _lib()
    if not hasattr(lib, f"hurray_{kind}_2_generic"):
        pytest.skip("built without the 16-bit specialisations")
    b, h, n, d = 6, 4, 64, 128
    cache = _cache(torch.bfloat16, b, h, n, d, seed=1)
    ids = torch.tensor([5, 1, 2])
    base = cache.data_ptr() + (n * d * 2 if kind == "amx_values" else 0)
    outs = []
    for name in (f"hurray_{kind}_2", f"hurray_{kind}_2_generic"):
        out = torch.zeros(3, n, h, d, dtype=torch.bfloat16)
        native.kernel(lib, name)(base, ids.data_ptr(), 0, 3, cache.stride(0), cache.stride(1), h, n, d, out.data_ptr())
        outs.append(out.view(torch.int16))
    assert torch.equal(outs[0], outs[1])


def test_block_ids_outside_the_cache_are_refused() -> None:
    _lib()
    cache = _cache(torch.bfloat16, 4, 2, 32, 64, seed=2)
    out = (torch.empty(1, 32, 2, 64, dtype=torch.bfloat16), torch.empty(1, 32, 2, 64, dtype=torch.bfloat16))
    from hurray_vllm import HurrayFormatError

    with pytest.raises(HurrayFormatError) as err:
        CpuPacked("amx", 64).gather(cache, torch.tensor([4]), out)
    assert err.value.field == "block_ids"


def test_switched_off_says_why(torch_only) -> None:  # type: ignore[no-untyped-def]
    assert native.library() is None
    assert "HURRAY_VLLM_NATIVE=0" in (native.unavailable_reason() or "")
    cache = _cache(torch.bfloat16, 4, 2, 32, 64, seed=3)
    k, _ = CpuPacked("amx", 64).gather(cache, torch.tensor([1, 2]))  # the torch path still works
    assert k.shape == (2, 32, 2, 64)


def test_a_missing_compiler_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    saved = dict(native._state)
    try:
        native._state.clear()
        monkeypatch.setenv("HURRAY_VLLM_CACHE_DIR", str(tmp_path))
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        assert native.library() is None
        assert "no-such-cc" in (native.unavailable_reason() or "")
        assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("*.tmp"))
    finally:
        native._state.clear()
        native._state.update(saved)


def test_crc32c_equals_the_reference_implementation() -> None:
    _lib()
    from hurray_vllm.wire.crc32c import crc32c_python as crc32c

    data = bytes(range(256)) * 41 + b"tail"
    assert native.crc32c(data) == crc32c(data)
    assert native.crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
    assert native.crc32c(data[500:], native.crc32c(data[:500]) or 0) == crc32c(data)
    assert native.crc32c(memoryview(bytearray(data))) == crc32c(data)  # writable buffers too
    assert native.crc32c(b"", 7) == 7
    # Long inputs run in interleaved lanes of 4 KiB, three per block: every boundary around them.
    import random

    big = random.Random(5).randbytes(3 * 4096 * 3 + 77)
    for n in (3 * 4096 - 1, 3 * 4096, 3 * 4096 + 1, 2 * 3 * 4096 + 8, len(big)):
        assert native.crc32c(big[:n]) == crc32c(big[:n]), n
    assert native.crc32c(big[12345:], native.crc32c(big[:12345]) or 0) == crc32c(big)


def test_crc32c_of_tensors_is_the_crc_of_their_bytes_in_order() -> None:
    _lib()
    from hurray_vllm.wire.crc32c import crc32c_python as crc32c

    g = torch.Generator().manual_seed(3)
    parts = [
        torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g),
        torch.empty(0, dtype=torch.bfloat16),
        torch.randn(3, 7, 64, generator=g).to(torch.bfloat16),
        torch.randn(13000, generator=g),
    ]
    whole = b"".join(p.view(torch.uint8).numpy().tobytes() if p.numel() else b"" for p in parts)
    assert native.crc32c_tensors(parts) == crc32c(whole)
    assert native.crc32c_tensors(parts[2:], native.crc32c_tensors(parts[:2]) or 0) == crc32c(whole)
    assert native.crc32c_tensors([], 9) == 9
    with pytest.raises(ValueError, match="contiguous"):
        native.crc32c_tensors([parts[2].transpose(0, 1)])


def test_chunk_digests_name_their_algorithm(torch_only) -> None:  # type: ignore[no-untyped-def]
    from hurray_vllm import HurrayFormatError
    from hurray_vllm.chunks.store import ChunkDigest

    d = ChunkDigest()  # native switched off: zlib's CRC-32
    d.update(b"123456789")
    assert d.hexdigest() == "crc32/v2:cbf43926"
    with pytest.raises(HurrayFormatError) as err:
        ChunkDigest.like("crc32c/v2:e3069283")  # cannot be checked without the native kernels: refused, not trusted
    assert err.value.field == "snapshot.digest" and "native" in str(err.value)
    with pytest.raises(HurrayFormatError):
        ChunkDigest.like("sha1/v2:00")
    with pytest.raises(HurrayFormatError, match="does not cover the descriptors"):
        ChunkDigest.like("crc32:cbf43926")  # 0.1's digest of the pools alone: refused


@pytest.mark.parametrize("code", [13, 30])  # EACCES; EROFS, a read-only file system (not a PermissionError)
def test_an_unwritable_cache_dir_falls_back_to_a_temporary_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path, code: int
) -> None:  # type: ignore[no-untyped-def]
    _lib()
    locked = tmp_path / "read-only-home"
    real_build = native._build

    def build(target):  # type: ignore[no-untyped-def]
        if locked in target.parents:
            raise OSError(code, "cannot write there", str(target.parent))
        real_build(target)

    saved = dict(native._state)
    try:
        native._state.clear()
        monkeypatch.setenv("HURRAY_VLLM_CACHE_DIR", str(locked))
        monkeypatch.setattr(native, "_build", build)
        monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
        assert native.library() is not None, native.unavailable_reason()
        assert list((tmp_path / "tmp").rglob("cpu_packed-*.so"))
        private = next((tmp_path / "tmp").glob("hurray-vllm-*"))
        assert private.stat().st_mode & 0o777 == 0o700
        # A directory others may write to (another local user could plant a library in it): not loaded from.
        private.chmod(0o777)
        native._state.clear()
        assert native.library() is None and "not owned by this user alone" in (native.unavailable_reason() or "")
    finally:
        native._state.clear()
        native._state.update(saved)


@pytest.mark.parametrize("why", ["no home", "others may write"])
def test_a_homeless_or_shared_cache_dir_falls_back_to_a_private_temporary_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path, why: str
) -> None:  # type: ignore[no-untyped-def]
    """No home (Path.home() raises RuntimeError) or a cache directory others may write to: built aside, loaded."""
    _lib()
    saved = dict(native._state)
    try:
        native._state.clear()
        monkeypatch.delenv("HURRAY_VLLM_CACHE_DIR", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        if why == "no home":

            def homeless() -> None:
                raise RuntimeError("Could not determine home directory.")

            monkeypatch.setattr(native.Path, "home", staticmethod(homeless))
        else:
            shared = tmp_path / "shared"
            shared.mkdir()
            shared.chmod(0o777)  # another local user could plant a library under the public name
            monkeypatch.setenv("HURRAY_VLLM_CACHE_DIR", str(shared))
        monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
        assert native.library() is not None, native.unavailable_reason()
        assert list((tmp_path / "tmp").rglob("cpu_packed-*.so"))
        if why != "no home":
            assert not list((tmp_path / "shared").rglob("*.so"))
    finally:
        native._state.clear()
        native._state.update(saved)


def test_the_checksums_prototypes_are_declared_before_anyone_calls_them() -> None:
    """Declared lazily by callers, a thread could call with argtypes set and restype still c_int (negative CRCs)."""
    lib = _lib()
    for name in ("hurray_crc32c", "hurray_crc32c_segments"):
        fn = getattr(lib, name)
        assert fn.restype is ctypes.c_uint32 and fn.argtypes is not None, name
    assert native.crc32c(b"123456789") == 0xE3069283  # above 2**31: a c_int return would make it negative


@pytest.mark.parametrize(("isa", "dtype", "n", "d"), CASES)
def test_scatter_inverts_gather_natively_and_in_torch(isa: str, dtype: torch.dtype, n: int, d: int, torch_only) -> None:  # type: ignore[no-untyped-def]
    """scatter writes exactly the blocks it is given (a strided cache too), and gather reads them back."""
    src = _cache(dtype, 9, 3, n, d, seed=n + d)
    ids = torch.tensor([7, 0, 3, 8])
    layout = CpuPacked(isa, d)
    k, v = layout.gather(src, ids)
    caches = []
    for use_native in (False, True):
        if use_native:
            native._state.clear()
            os.environ["HURRAY_VLLM_NATIVE"] = "1"
            _lib()
        # Every (block, head) plane contiguous but the cache a view of a larger buffer, as vLLM's are.
        big = _cache(dtype, 9, 6, n, d, seed=1)
        cache = big[:, 1:4]
        before = big.clone()
        layout.scatter(cache, ids, k, v)
        got = layout.gather(cache, ids)
        assert torch.equal(got[0].view(torch.uint8), k.view(torch.uint8))
        assert torch.equal(got[1].view(torch.uint8), v.view(torch.uint8))
        untouched = torch.ones(9, 6, dtype=torch.bool)
        untouched[ids, 1:4] = False
        assert torch.equal(big[untouched].view(torch.uint8), before[untouched].view(torch.uint8))
        caches.append(cache.clone())
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))


def test_scatter_refuses_bad_pages() -> None:
    from hurray_vllm import HurrayFormatError

    layout = CpuPacked("vec", 8)
    cache = torch.zeros(4, 2, 16, 16, dtype=torch.bfloat16)
    k = torch.zeros(1, 16, 2, 8, dtype=torch.bfloat16)
    for ids, keys, field in ((torch.tensor([1]), k.float(), "keys"), (torch.tensor([4]), k, "block_ids")):
        with pytest.raises(HurrayFormatError) as info:
            layout.scatter(cache, ids, keys, k)
        assert info.value.field == field


# AMX packing needs block sizes and head dims in multiples of 16: those kinds get only such shapes (a skip in
# CI is for GPU tests alone).
_PUT_SHAPES = [(64, 128), (16, 64), (48, 32), (8, 16), (12, 24), (128, 80)]
_PUT_CASES = [
    (kind, n, d)
    for kind in ("vec_keys_put", "amx_keys_put", "amx_values_put", "rows_put")
    for n, d in _PUT_SHAPES
    if not (kind.startswith("amx") and (n % 16 or d % 16))
]


@pytest.mark.parametrize(("kind", "n", "d"), _PUT_CASES)
@pytest.mark.parametrize("misaligned", [False, True])
def test_sse2_put_kernels_equal_the_portable_loops(kind: str, n: int, d: int, misaligned: bool) -> None:
    """The vectorised put kernels (token groups, every head per item) write what the plain loops write.

    Block sizes of one to several token groups and ones no group divides (the kernels fall back);
    the cache a view of a larger one (other heads around it), and a block range starting past 0.
    On an AVX2 CPU, vec keys of whole 32-token lines in an aligned cache take the AVX2 kernel.
    """
    lib = _lib()
    b, h = 6, 3
    pages = _cache(torch.bfloat16, 4, n, h, d // 2, seed=2).reshape(4, n, h, d)
    ids = torch.tensor([0, 5, 1, 2])
    caches = []
    for name in (f"hurray_{kind}_2", f"hurray_{kind}_2_generic"):
        big = _cache(torch.bfloat16, b, h + 2, n, d, seed=3)
        if misaligned:  # 16 bytes off a 32-byte boundary: the vec keys' streamed (AVX2) stores do not apply
            big = torch.cat([big.reshape(-1), big.new_zeros(8)])[8:].view(big.shape)
        cache = big[:, 1 : 1 + h]
        base = cache.data_ptr() + (n * d * 2 if kind in ("amx_values_put", "rows_put") else 0)
        fn = native.kernel(lib, name)
        fn(base, ids.data_ptr(), 1, 4, cache.stride(0), cache.stride(1), h, n, d, pages.data_ptr())
        caches.append(big.view(torch.int16))
    assert torch.equal(caches[0], caches[1])


def test_tensors_on_another_device_are_refused_before_the_kernels_see_their_pointers() -> None:
    """The kernels take raw host pointers: a GPU (here meta) tensor handed to them would crash the process."""
    from hurray_vllm import HurrayArgumentError

    _lib()
    cache = _cache(torch.bfloat16, 4, 2, 16, 8, seed=0)
    layout = CpuPacked("vec", 8)
    k, v = layout.gather(cache, torch.tensor([1]))
    elsewhere = torch.empty_like(k, device="meta")
    with pytest.raises(HurrayArgumentError) as err:
        layout.scatter(cache, torch.tensor([1]), elsewhere, v)
    assert err.value.field == "keys"
    with pytest.raises(HurrayArgumentError) as err:
        layout.gather(cache, torch.tensor([1]), (elsewhere, torch.empty_like(v, device="meta")))
    assert err.value.field == "out"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_page_registers_of_a_read_combine_into_the_crc_of_any_ranges(tmp_path, data: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    """A chunk's reader checksums each 4 KiB page as it reads; any ranges' CRC-32C is then combined from those
    registers (partial pages at a range's ends read again): equal to the CRC of the ranges' bytes, wherever the
    ranges start and end, for files shorter than the buffer too (pages past the end are not trusted)."""
    _lib()
    import random

    from hurray_vllm.wire.crc32c import crc32c_python as crc32c

    page = native.CRC_PAGE
    size = data.draw(
        st.sampled_from([0, 1, page - 1, page, page + 1, 3 * page, 3 * page + 9, 7 * page + 100, 65536 + 3])
    )
    room = size + data.draw(st.sampled_from([0, 1, page]))  # a buffer larger than the file: a short read
    raw = random.Random(size).randbytes(size)
    path = tmp_path / "f"
    path.write_bytes(raw)
    buf = torch.zeros(room, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = native.read_crc32c_pages(fd, buf)
    finally:
        os.close(fd)
    assert done is not None
    got, pages = done
    assert got == size and bytes(buf[:size].numpy()) == raw
    assert pages is not None and pages.numel() == size // page
    spans = []
    for _ in range(data.draw(st.integers(0, 4))):
        a = data.draw(st.integers(0, size))
        spans.append((a, data.draw(st.integers(0, size - a))))
    start = data.draw(st.integers(0, 2**32 - 1))
    want = start
    for a, n in spans:
        want = crc32c(raw[a : a + n], want)
    assert native.crc32c_ranges(start, buf[:size], pages, spans) == want
    with pytest.raises(ValueError, match="outside"):
        native.crc32c_ranges(0, buf[:size], pages, [(size, 1)])


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "lanes"])
def test_both_ways_of_checksumming_long_inputs_equal_the_reference(fold: bool) -> None:
    """Long inputs fold with VPCLMULQDQ where the CPU has it, else run the crc32 instruction in three lanes: both
    equal the bitwise definition at every size around their block boundaries, at any alignment, from any start,
    and in the page registers a read computes."""
    _lib()
    import random

    from hurray_vllm.wire.crc32c import crc32c_python as crc32c

    if fold and not native.crc32c_fold():
        pytest.skip("this CPU has no AVX-512 VPCLMULQDQ: long inputs run in lanes")
    before = native.crc32c_fold()
    try:
        native.crc32c_fold(fold)
        rng = random.Random(11)
        big = rng.randbytes(3 * 4096 * 2 + 1024)
        for n in (1023, 1024, 1025, 1280, 1279, 4096, 3 * 4096, 3 * 4096 + 255, 3 * 4096 + 256, len(big) - 3):
            for skew in (0, 1, 3):
                data = big[skew : skew + n]
                start = rng.getrandbits(32)
                assert native.crc32c(data, start) == crc32c(data, start), (n, skew)
        pages = torch.frombuffer(bytearray(big[: 5 * 4096]), dtype=torch.uint8)
        import tempfile

        with tempfile.TemporaryFile() as f:
            f.write(bytes(pages.numpy()))
            f.seek(0)
            buf = torch.empty(5 * 4096, dtype=torch.uint8)
            done = native.read_crc32c_pages(f.fileno(), buf)
        assert done is not None and done[1] is not None
        registers = [int(r) & 0xFFFFFFFF for r in done[1]]
        # A page's register from zero is its CRC-32C with the initial and final inversions undone.
        want = [crc32c(big[i * 4096 : (i + 1) * 4096], 0xFFFFFFFF) ^ 0xFFFFFFFF for i in range(5)]
        assert registers == want
    finally:
        native.crc32c_fold(before)


#: Hostile buffers for the checksumming read, run under ``python -O`` (asserts stripped) in a child process:
#: each must be refused before its pointer reaches C, where a stride-0, shrunk or meta buffer made read() or
#: the kernel write or read past the storage (a segfault or heap corruption, not an exception).
_HOSTILE_CRC_CALLS = """
import json, os, sys, tempfile
import torch
from hurray_vllm import HurrayArgumentError, native

assert native.library() is not None, native.unavailable_reason()
fd, path = tempfile.mkstemp()
os.write(fd, b"x" * (1 << 20))
got = {}


def attempt(name, call):
    os.lseek(fd, 0, 0)
    try:
        call()
        got[name] = "accepted"
    except HurrayArgumentError as exc:
        got[name] = exc.field


shrunk = torch.zeros(1 << 20, dtype=torch.uint8)
shrunk.untyped_storage().resize_(1)  # still contiguous, 1 MiB of elements over 1 byte
attempt("expanded", lambda: native.read_crc32c_pages(fd, torch.zeros(1, dtype=torch.uint8).expand(1 << 20)))
attempt("shrunk", lambda: native.read_crc32c_pages(fd, shrunk))
attempt("int16", lambda: native.read_crc32c_pages(fd, torch.zeros(8, dtype=torch.int16)))
attempt("meta_buf", lambda: native.read_crc32c_pages(fd, torch.empty(1 << 20, dtype=torch.uint8, device="meta")))
base, pages = torch.zeros(3 * 4096, dtype=torch.uint8), torch.zeros(3, dtype=torch.int32)
attempt("meta_base", lambda: native.crc32c_ranges(0, base.to("meta"), pages, [(5, 100)]))
attempt("meta_pages", lambda: native.crc32c_ranges(0, base, pages.to("meta"), [(0, 3 * 4096)]))
attempt("outside", lambda: native.crc32c_ranges(0, base, pages, [(3 * 4096, 1)]))
attempt("fine", lambda: native.read_crc32c_pages(fd, torch.zeros(1 << 20, dtype=torch.uint8)))
os.close(fd)
os.unlink(path)
print(json.dumps(got))
"""


def test_buffers_the_checksumming_read_cannot_take_are_refused_even_under_python_O() -> None:
    """``read_crc32c_pages`` and ``crc32c_ranges`` hand raw pointers and byte counts to C: a buffer that is not
    contiguous, not uint8, not on the CPU or larger than its storage is a :class:`HurrayArgumentError` naming the
    argument, checked explicitly (an ``assert`` is gone under ``-O``), never a crash of the process."""
    import json
    import subprocess
    import sys

    _lib()
    done = subprocess.run(
        [sys.executable, "-O", "-c", _HOSTILE_CRC_CALLS], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "expanded": "buf",
        "shrunk": "buf",
        "int16": "buf",
        "meta_buf": "buf",
        "meta_base": "base",
        "meta_pages": "pages",
        "outside": "ranges",
        "fine": "accepted",
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.int64], ids=str)
@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_cpu_packing_refuses_elements_of_eight_bytes(isa: str, dtype: torch.dtype) -> None:
    """vLLM's CPU cache-write op packs 1-, 2- and 4-byte elements only: a cache of wider ones is refused as such
    (it was a bare ``KeyError(16)`` from the AMX key view), on gather and scatter alike."""
    from hurray_vllm import HurrayFormatError

    layout = CpuPacked(isa, 16)
    cache = torch.zeros(4, 2, 16, 32, dtype=dtype)
    pages = torch.zeros(1, 16, 2, 16, dtype=dtype)
    with pytest.raises(HurrayFormatError, match="4-byte elements") as err:
        layout.gather(cache, torch.tensor([1]))
    assert err.value.field == "cache"
    with pytest.raises(HurrayFormatError, match="4-byte elements") as err:
        layout.scatter(cache, torch.tensor([1]), pages, pages)
    assert err.value.field == "cache"
