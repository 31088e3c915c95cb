"""Regression tests for the reviewed wire defects: each fails without its fix."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest
import torch

from hurray_vllm import BlockPagedTensor, HurrayFormatError, decode_descriptor, encode_descriptor
from hurray_vllm.errors import HurrayArgumentError
from hurray_vllm.wire import rules
from hurray_vllm.wire.descriptor import (
    LAYOUT_COMPOSITE,
    LAYOUT_ROW_MAJOR,
    MAX_DESCRIPTOR_LEN,
    BufferHandle,
    CompositeFields,
    PerTensorAffine,
    RawQuantization,
    Shard,
    TensorDescriptor,
    peek_descriptor_length,
)
from hurray_vllm.wire.dtypes import widen_index


def _paged() -> TensorDescriptor:
    pool = torch.zeros(5, 4, 2, 8, dtype=torch.float16)
    t = BlockPagedTensor(pool, torch.tensor([0, 1, 0]), torch.tensor([0, 2, 3]), torch.tensor([6, 3]), "key", 3)
    return t.descriptor()


def _row_major() -> TensorDescriptor:
    return TensorDescriptor(type_tag=0x03, shape=(2, 4), layout_tag=LAYOUT_ROW_MAJOR, buffers=(BufferHandle(32),))


def _newer_minor(raw: bytes, extra: bytes) -> bytes:
    b = bytearray(raw + extra)
    b[5] = 1
    struct.pack_into("<I", b, 6, len(b))
    return bytes(b)


def _invariants(d: TensorDescriptor, permissive: bool = False) -> set[str]:
    return {v.invariant for v in rules.validate_descriptor(d, permissive=permissive).errors}


# ── 1. forward compatibility ──


def test_newer_minor_trailing_bytes_are_skipped_and_kept(hurray) -> None:
    raw = _newer_minor(encode_descriptor(_paged()), b"\x01\x02\x03\x04\x05\x06\x07\x08")
    hurray.Descriptor.decode(raw)  # the reference reads it too
    d = decode_descriptor(raw)
    assert d.version_minor == 1 and d.trailing == bytes(range(1, 9))
    assert rules.validate_descriptor(d).ok
    assert encode_descriptor(d) == raw  # convert stays byte-preserving


def test_own_minor_trailing_bytes_still_refused() -> None:
    b = bytearray(encode_descriptor(_paged()) + bytes(8))
    struct.pack_into("<I", b, 6, len(b))
    with pytest.raises(HurrayFormatError) as err:
        decode_descriptor(bytes(b))
    assert err.value.field == "descriptor_length"


def test_default_trailing_keeps_encodings_identical(hurray) -> None:
    raw = encode_descriptor(_paged())
    assert decode_descriptor(raw).trailing == b""
    assert hurray.Descriptor.decode(raw).encode() == raw


def test_trailing_on_own_minor_is_a_caller_error() -> None:
    with pytest.raises(HurrayArgumentError) as err:
        encode_descriptor(replace(_paged(), trailing=b"x"))
    assert err.value.field == "trailing"


def test_descriptor_cap_names_its_field() -> None:
    head = b"HRRY\x01\x00" + struct.pack("<I", MAX_DESCRIPTOR_LEN + 1)
    with pytest.raises(HurrayFormatError, match="descriptor_length") as err:
        peek_descriptor_length(head)
    assert err.value.field == "descriptor_length"


# ── 2. validate refuses what the spec refuses ──


@pytest.mark.parametrize("shard", [Shard((4, 4), (3, 0)), Shard((1, 4), (0, 0)), Shard((2**64 - 1, 4), (2**64 - 2, 0))])
def test_shard_out_of_its_parent_is_structural(shard: Shard) -> None:
    d = replace(_row_major(), shard=shard)
    assert "shard.bounds" in _invariants(d, permissive=True)


def test_shard_inside_its_parent_passes() -> None:
    assert rules.validate_descriptor(replace(_row_major(), shard=Shard((4, 4), (2, 0)))).ok


def test_zero_buffers_on_a_row_major_tensor() -> None:
    assert "buffer_count" in _invariants(_row_major().with_buffers(()), permissive=True)


@pytest.mark.parametrize("tag", [0x00, 0x47, 0x80, 0xFF])
def test_reserved_type_tag_on_a_composite_head(tag: int) -> None:
    head = TensorDescriptor(
        type_tag=tag, shape=(8, 8), layout_tag=LAYOUT_COMPOSITE, layout=CompositeFields(rule_tag=1, member_count=2)
    )
    assert "type_tag" in _invariants(head, permissive=True)
    assert rules.validate_descriptor(replace(head, type_tag=0x03)).ok


# ── 3. never-waivable checks ──


def test_reserved_flag_is_refused_in_permissive_mode() -> None:
    d = replace(_paged(), reserved_flags=1 << 5)
    assert "flags.reserved" in _invariants(d, permissive=True)
    newer = decode_descriptor(_newer_minor(encode_descriptor(d), b""))
    assert "flags.reserved" in _invariants(newer, permissive=True)


def test_shard_on_block_paged_is_structural() -> None:
    d = replace(_paged(), shard=Shard((9, 2, 8), (0, 0, 0)))
    assert "shard" in _invariants(d, permissive=True)


def _mxfp() -> tuple[TensorDescriptor, list[torch.Tensor]]:
    d = replace(
        _paged(),
        type_tag=0x40,
        quantization=RawQuantization(bytes.fromhex("05010000000000001000000003000000")),
    )
    d = d.with_buffers((BufferHandle(5 * 4 * 2 * 8), *d.buffers[1:], BufferHandle(16)))
    bufs = [torch.zeros(b.byte_size, dtype=torch.uint8) for b in d.buffers]
    bufs[1].view(torch.int32)[:] = torch.tensor([0, 1, 0], dtype=torch.int32)
    bufs[2].view(torch.int32)[:] = torch.tensor([0, 2, 3], dtype=torch.int32)
    return d, bufs


@pytest.mark.parametrize("permissive", [False, True])
def test_from_wire_refuses_an_unsupported_scheme_in_every_mode(permissive: bool) -> None:
    d, bufs = _mxfp()
    with pytest.raises(HurrayFormatError) as err:
        BlockPagedTensor.from_wire(d, bufs, seq_lens=torch.tensor([6, 3]), permissive=permissive)
    assert "quantization.unsupported" in {v.invariant for v in err.value.violations}


def test_descriptor_tools_may_still_carry_an_unsupported_scheme() -> None:
    d, _ = _mxfp()
    assert rules.validate_descriptor(d, permissive=True).ok
    assert decode_descriptor(encode_descriptor(d)) == d


# ── 4. and 5. per-tensor affine ──


def _ptq(type_tag: int, **kw: object) -> TensorDescriptor:
    nbytes = {0x10: 320, 0x11: 320, 0x48: 160, 0x49: 160, 0x4B: 80}[type_tag]
    d = replace(_paged(), type_tag=type_tag, quantization=PerTensorAffine(**{"scale": 0.5, **kw}))  # type: ignore[arg-type]
    return d.with_buffers((BufferHandle(nbytes), *d.buffers[1:]))


@pytest.mark.parametrize(
    ("tag", "zp"), [(0x10, 1000), (0x10, -129), (0x11, -1), (0x11, 256), (0x48, 8), (0x48, -9), (0x49, 16)]
)
def test_zero_point_outside_the_storage_type(tag: int, zp: int) -> None:
    d = _ptq(tag, zero_point=zp)
    assert "quantization.zero_point" in _invariants(d)
    assert "quantization.zero_point" not in _invariants(d, permissive=True)


@pytest.mark.parametrize(("tag", "zp"), [(0x10, 127), (0x10, -128), (0x11, 255), (0x48, -8), (0x4B, 3)])
def test_zero_point_inside_the_storage_type(tag: int, zp: int) -> None:
    assert rules.validate_descriptor(_ptq(tag, zero_point=zp)).ok


@pytest.mark.parametrize("version", [0, 2])
def test_scheme_version_must_be_1(version: int) -> None:
    assert "quantization.scheme_version" in _invariants(_ptq(0x10, scheme_version=version))


@pytest.mark.parametrize("scale", [1e39, -1e39, 1e-50])
def test_scale_must_survive_float32(scale: float) -> None:
    assert "quantization.scale" in _invariants(_ptq(0x10, scale=scale))


def test_scale_overflowing_float32_is_a_caller_error_at_encode() -> None:
    with pytest.raises(HurrayArgumentError) as err:
        encode_descriptor(_ptq(0x10, scale=1e39))
    assert err.value.field == "quantization.scale"


# ── 6. encoder input checks ──


def _bp(**kw: object) -> TensorDescriptor:
    d = _paged()
    return replace(d, layout=replace(d.layout, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: replace(_paged(), shape=(2**64, 2, 8)), "shape[0]"),
        (lambda: replace(_paged(), shape=(-1, 2, 8)), "shape[0]"),
        (lambda: _bp(num_pages=2**64), "num_pages"),
        (lambda: _bp(page_size=2**32), "page_size"),
        (lambda: _bp(num_seqs=2**32), "num_seqs"),
        (lambda: _bp(layer_index=0xFFFFFFFF), "layer_index"),
        (lambda: _bp(layer_index=-1), "layer_index"),
        (lambda: _bp(reserved=bytes(5)), "block_paged.reserved"),
        (lambda: _paged().with_buffers((BufferHandle(2**64), *_paged().buffers[1:])), "buffers[0].byte_size"),
        (lambda: _paged().with_buffers((BufferHandle(160, 2**32), *_paged().buffers[1:])), "buffers[0].alignment"),
        (lambda: replace(_paged(), shard=Shard((1, 2), (0, 0))), "shard.parent_shape"),
        (lambda: replace(_paged(), statistics=bytes(10)), "statistics"),
        (lambda: replace(_paged(), extension_type=bytes(3)), "extension_type"),
        (lambda: replace(_paged(), composite_member=bytes(3)), "composite_member"),
        (lambda: replace(_paged(), reserved_flags=1 << 40), "flags.reserved"),
        (lambda: replace(_paged(), reserved_flags=1), "flags.reserved"),
        (lambda: replace(_paged(), quantization=PerTensorAffine(0.5, 2**31)), "quantization.zero_point"),
        (lambda: replace(_paged(), quantization=PerTensorAffine(0.5, 0, reserved=bytes(3))), "quantization.reserved"),
        (lambda: replace(_paged(), shape=(1,) * 65), "rank"),
        (lambda: replace(_row_major(), layout_tag=0x0A), "layout_tag"),
    ],
)
def test_encoder_refuses_what_it_cannot_write(make, field: str) -> None:
    with pytest.raises(HurrayArgumentError) as err:
        encode_descriptor(make())
    assert err.value.field == field


# ── 7. misaligned byte slices ──


@pytest.mark.parametrize("offset", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("wire", [torch.uint32, torch.uint64])
def test_widen_index_on_a_misaligned_slice(offset: int, wire: torch.dtype) -> None:
    buf = torch.zeros(offset + 16, dtype=torch.uint8)
    buf[offset : offset + 16] = torch.tensor([7, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)
    out = widen_index(buf[offset : offset + 16], wire)
    assert out.tolist() == ([7, 0, 9, 0] if wire == torch.uint32 else [7, 9])


def test_from_wire_on_a_misaligned_pool() -> None:
    d = _paged()
    whole = torch.zeros(1 + d.data_bytes, dtype=torch.uint8)
    bufs, at = [], 1
    for b in d.buffers:
        bufs.append(whole[at : at + b.byte_size])
        at += b.byte_size
    bufs[0].view(-1)[:2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # 1.0 as float16
    bufs[1][:] = torch.tensor([0, 1, 0], dtype=torch.int32).view(torch.uint8)
    bufs[2][:] = torch.tensor([0, 2, 3], dtype=torch.int32).view(torch.uint8)
    t = BlockPagedTensor.from_wire(d, bufs, seq_lens=torch.tensor([6, 3]))
    assert t.page_pool[0, 0, 0, 0].item() == 1.0
