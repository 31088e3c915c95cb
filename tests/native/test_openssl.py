"""native.openssl: Poly1305 from the system's libcrypto through ctypes, against cryptography's."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hurray_vllm.native import openssl

FUZZ_EXAMPLES = int(os.environ.get("HURRAY_FUZZ_EXAMPLES", "40"))


def _mac(key: bytes) -> openssl.NativePoly1305:
    """``openssl.poly1305(key)``; skip without libcrypto 3 locally, fail under CI=true (make test has it)."""
    mac = openssl.poly1305(key)
    if mac is None and os.environ.get("CI") == "true":
        pytest.fail(f"libcrypto 3 is required in CI: {openssl.unavailable_reason()}")
    if mac is None:
        pytest.skip(f"no libcrypto 3 here: {openssl.unavailable_reason()}")
    return mac


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=6), st.binary(min_size=32, max_size=32))
def test_openssl_poly1305_equals_cryptography(parts: list[bytes], key: bytes) -> None:
    """The GIL-free path (libcrypto through ctypes) and cryptography's give the same tags, however data is split."""
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    native = _mac(key)
    ref = Poly1305(key)
    for i, p in enumerate(parts):
        ref.update(p)
        if i % 2:
            native.update(memoryview(p))
        else:
            t = torch.frombuffer(bytearray(p), dtype=torch.uint8) if p else torch.empty(0, dtype=torch.uint8)
            native.update(memoryview(t.numpy()))  # writable: read in place
    assert native.finalize() == ref.finalize()


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=6), st.binary(min_size=32, max_size=32))
def test_segments_fed_in_one_native_call_give_the_tag_of_updates_one_by_one(parts: list[bytes], key: bytes) -> None:
    """``update_tensors`` (a chunk's page pools, one GIL release) equals one ``update`` per segment."""
    native, ref = _mac(key), _mac(key)
    empty = torch.empty(0, dtype=torch.uint8)
    bufs = [torch.frombuffer(bytearray(p), dtype=torch.uint8) if p else empty for p in parts]
    assert native.update_tensors(bufs)
    for p in parts:
        ref.update(p)
    assert native.finalize() == ref.finalize()


def test_a_key_of_another_length_is_refused_and_disabling_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    _mac(b"k" * 32)
    with pytest.raises(ValueError, match="32 bytes"):
        openssl.poly1305(b"k" * 16)
    monkeypatch.setattr(openssl, "_state", {})
    monkeypatch.setenv("HURRAY_VLLM_NATIVE", "0")
    assert openssl.poly1305(b"k" * 32) is None
    assert openssl.unavailable_reason() == "disabled by HURRAY_VLLM_NATIVE=0"


def test_a_finalized_mac_refuses_more_instead_of_handing_openssl_a_freed_context() -> None:
    """It segfaulted the process (a NULL context to EVP_MAC_update/final); cryptography raises AlreadyFinalized."""
    mac = _mac(b"k" * 32)
    mac.update(b"data")
    mac.finalize()
    for again in (
        lambda: mac.update(b"x"),
        lambda: mac.update_tensors([torch.ones(4, dtype=torch.uint8)]),
        mac.finalize,
    ):
        with pytest.raises(RuntimeError, match="finalized"):
            again()
