"""Rules where pyhurray (the reference) and hurray-vllm must reach the same verdict.

pyhurray builds each base descriptor; a field is then changed through our model
(whose encoding is byte-identical to pyhurray's) and both judge the same bytes.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

import hurray_vllm as hv
from hurray_vllm.wire import dtypes, rules
from hurray_vllm.wire.descriptor import (
    BlockPagedFields,
    BufferHandle,
    PerBlockAffine,
    PerChannelAffine,
    PerTensorAffine,
    TensorDescriptor,
    decode_descriptor,
    decode_quantization,
    encode_descriptor,
    encode_quantization,
)

ROOT = Path(__file__).resolve().parents[2]


def found(d: TensorDescriptor | bytes, permissive: bool = False) -> rules.Checked:
    return rules.validate_descriptor(decode_descriptor(d) if isinstance(d, bytes) else d, permissive=permissive)


def names(d: TensorDescriptor | bytes) -> set[str]:
    return {v.invariant for v in found(d).violations}


def reference_accepts(hurray: ModuleType, raw: bytes) -> bool:
    try:
        hurray.Descriptor.decode(raw)
    except hurray.InvalidDescriptorError:
        return False
    return True


def paged(hurray: ModuleType, dtype: Any, pool: int, shape: tuple[int, int, int], **kw: Any) -> bytes:
    """pyhurray's descriptor of a one-sequence block-paged tensor, one token per page."""
    pages = shape[0]
    layout = hurray.BlockPagedLayout(page_size=1, num_pages=pages, paged_axis=0, num_seqs=1)
    table = np.arange(pages, dtype=np.uint32).tobytes()
    ptr = np.array([0, pages], dtype=np.uint32).tobytes()
    t = hurray.Tensor(bytes(pool), dtype, list(shape), aux_buffers=[table, ptr], layout=layout, **kw)
    return bytes(t.descriptor.encode())


# ── head extents beyond int64 ───────────────────────────────────────────────


def _empty_pool(shape: tuple[int, int, int], num_pages: int = 0, page_size: int = 16) -> TensorDescriptor:
    return TensorDescriptor(
        0x01,
        shape,
        0x0A,
        BlockPagedFields(page_size, num_pages, 0, index_type_tag=1),
        (BufferHandle(0, 1), BufferHandle(0, 1), BufferHandle(8)),
    )


@pytest.mark.parametrize(
    ("d", "invariant"),
    [
        (_empty_pool((0, 2**64 - 1, 1)), "shape.heads"),
        (_empty_pool((0, 1, 2**63)), "shape.heads"),
        (_empty_pool((0, 2**62, 2)), "shape.heads"),  # each fits, a page of 16 * 2**63 elements does not
        (_empty_pool((0, 1, 1), num_pages=2**63, page_size=0), "num_pages"),
        (_empty_pool((2**64 - 1, 1, 1)), "shape.total_tokens"),
    ],
)
def test_extents_no_tensor_can_have_are_structural(d: TensorDescriptor, invariant: str) -> None:
    # A pool of 0 bytes passes the size rule whatever the head count: the bound must come first.
    checked = found(d, permissive=True)
    assert invariant in {v.invariant for v in checked.errors}, checked.violations


def test_from_wire_refuses_huge_heads_by_name() -> None:
    d = _empty_pool((0, 2**64 - 1, 1))
    empty = torch.zeros(0, dtype=torch.uint8)
    with pytest.raises(hv.HurrayFormatError) as info:
        hv.BlockPagedTensor.from_wire(d, [empty, empty, torch.zeros(8, dtype=torch.uint8)])
    assert info.value.field == "shape.heads"
    assert "heads" in str(info.value)


# ── element sizes ───────────────────────────────────────────────────────────


def test_float6_packs_four_elements_in_three_bytes() -> None:
    f6 = dtypes.element_type("float6_e2m3")
    assert [f6.nbytes(n) for n in range(9)] == [0, 3, 3, 3, 3, 6, 6, 6, 6]


def test_every_element_type_sized_like_the_reference(hurray: ModuleType) -> None:
    for tag in range(256):
        if not dtypes.is_known_tag(tag):
            continue
        ours, ref = dtypes.from_tag(tag), hurray.Dtype.from_tag(tag)
        assert [ours.nbytes(n) for n in range(40)] == [hurray.buffer_size_bytes(ref, n) for n in range(40)], ours.name


@pytest.mark.parametrize("name", ["float6_e2m3", "float6_e3m2", "float4_e2m1", "int4", "uint2", "bool"])
@pytest.mark.parametrize("heads", [1, 2, 3, 5])
def test_sub_byte_pools_the_reference_writes_are_valid(hurray: ModuleType, name: str, heads: int) -> None:
    dtype = getattr(hurray.dtype, name)
    shape = (3, heads, 1)
    raw = paged(hurray, dtype, hurray.buffer_size_bytes(dtype, 3 * heads), shape)
    assert found(raw).ok, found(raw).violations
    d = decode_descriptor(raw)
    short = d.with_buffers((replace(d.buffers[0], byte_size=d.buffers[0].byte_size + 1), *d.buffers[1:]))
    assert "page_pool.byte_size" in {v.invariant for v in found(short, permissive=True).errors}


# ── extension element types ─────────────────────────────────────────────────


@pytest.mark.parametrize("bit_width", [1, 2, 4, 8, 16, 24, 32, 64])
def test_extension_pools_sized_by_their_section(hurray: ModuleType, bit_width: int) -> None:
    ext = hurray.ExtensionType(bit_width=bit_width)
    count = 3 * 5
    raw = paged(hurray, hurray.Dtype.from_tag(0xF2), ext.buffer_size_bytes(count), (3, 5, 1), extension_type=ext)
    assert found(raw).ok, found(raw).violations
    d = decode_descriptor(raw)
    for wrong in (d.buffers[0].byte_size + 1, d.buffers[0].byte_size - 1):
        bad = d.with_buffers((replace(d.buffers[0], byte_size=wrong), *d.buffers[1:]))
        assert "page_pool.byte_size" in {v.invariant for v in found(bad, permissive=True).errors}


def test_extension_pool_without_a_size_is_reported_not_passed(hurray: ModuleType) -> None:
    # A 12-bit type: pyhurray sizes it as 1 byte per element, which cannot hold 12 bits.
    ext = hurray.ExtensionType(bit_width=12)
    raw = paged(hurray, hurray.Dtype.from_tag(0xF2), ext.buffer_size_bytes(3), (3, 1, 1), extension_type=ext)
    assert "page_pool.size_unverifiable" in names(raw)
    assert found(raw, permissive=True).ok
    no_section = replace(decode_descriptor(raw), extension_type=None)
    assert {"flags.extension_type", "page_pool.size_unverifiable"} <= names(no_section)


def test_extension_packing_agrees_with_the_reference(hurray: ModuleType) -> None:
    ext = hurray.ExtensionType(bit_width=8)
    base = decode_descriptor(paged(hurray, hurray.Dtype.from_tag(0xF2), 3, (3, 1, 1), extension_type=ext))
    assert base.extension_type is not None
    for bit_width in [*range(20), 24, 32, 2**31, 2**32 - 1]:
        for packing in range(10):
            section = bit_width.to_bytes(4, "little") + bytes([packing]) + base.extension_type[5:]
            raw = encode_descriptor(replace(base, extension_type=section))
            ours = "extension_type.packing" not in names(raw)
            assert ours == reference_accepts(hurray, raw), (bit_width, packing)
            if not ours:
                assert "page_pool.size_unverifiable" in names(raw)
                assert found(raw, permissive=True).ok


def test_extension_section_bytes_agree_with_the_reference(hurray: ModuleType) -> None:
    ext = hurray.ExtensionType(bit_width=24, is_signed=True)
    raw = bytes(hurray.Tensor(bytes(12), hurray.Dtype.from_tag(0xF5), [4], extension_type=ext).descriptor.encode())
    for offset in range(20):
        for bit in (0x01, 0x80):
            bad = bytearray(raw)
            bad[len(raw) - 20 + offset] ^= bit
            assert found(bytes(bad)).ok == reference_accepts(hurray, bytes(bad)), (offset, bit)
            assert found(bytes(bad), permissive=True).ok
    bad = bytearray(raw)
    bad[-2] = 1
    assert "extension_type.reserved" in names(bytes(bad))


# ── statistics ──────────────────────────────────────────────────────────────


def test_statistics_bytes_agree_with_the_reference(hurray: ModuleType) -> None:
    stats = hurray.Statistics(nnz=2, value_min=-1.0, value_max=2.0, value_abs_max=2.0, has_nan=False, has_inf=False)
    raw = bytes(hurray.Tensor(bytes(8), hurray.float32, [2], statistics=stats).descriptor.encode())
    for offset in range(72):
        bad = bytearray(raw)
        bad[len(raw) - 72 + offset] ^= 0x01
        assert found(bytes(bad)).ok == reference_accepts(hurray, bytes(bad)), offset
        assert found(bytes(bad), permissive=True).ok
    for offset in (4, 7, 68, 71):
        bad = bytearray(raw)
        bad[len(raw) - 72 + offset] = 0xFF
        assert "statistics.reserved" in names(bytes(bad))


# ── buffer handles ──────────────────────────────────────────────────────────


def _with_handles(d: TensorDescriptor, **kw: int) -> TensorDescriptor:
    return d.with_buffers(tuple(replace(b, **kw) for b in d.buffers))


@pytest.mark.parametrize("device", [*range(0x0B), 0x7F, 0xEF, 0xF0, 0xF7, 0xFE, 0xFF])
@pytest.mark.parametrize("sync", [0, 1, 2, 3])
def test_device_tags_and_sync_modes_agree_with_the_reference(hurray: ModuleType, device: int, sync: int) -> None:
    d = decode_descriptor(paged(hurray, hurray.float16, 6, (3, 1, 1)))
    raw = encode_descriptor(_with_handles(d, device_tag=device, sync_mode=sync))
    assert found(raw).ok == reference_accepts(hurray, raw), found(raw).violations
    assert found(raw, permissive=True).ok


def test_reserved_device_tag_and_cpu_sync_are_named() -> None:
    d = _empty_pool((0, 1, 1))
    assert "buffers.device_tag" in names(_with_handles(d, device_tag=0x09))
    assert "buffers.device_tag" in names(_with_handles(d, device_tag=0xFF))
    assert "buffers.sync_mode" in names(_with_handles(d, sync_mode=1))
    assert found(_with_handles(d, device_tag=0x01, sync_mode=2)).ok


# ── quantization sections longer than their scheme ─────────────────────────


@pytest.mark.parametrize(
    "q", [PerTensorAffine(0.5, 3), PerChannelAffine(1, 3), PerBlockAffine(0, 16, 3, 4, scale_type_tag=2)]
)
def test_longer_quantization_section_round_trips(q: object) -> None:
    raw = encode_quantization(q) + b"\x01\x02\x03\x04"  # type: ignore[arg-type]
    back = decode_quantization(raw)
    assert encode_quantization(back) == raw
    assert back == replace(q, trailing=b"\x01\x02\x03\x04")  # type: ignore[type-var]


def test_longer_quantization_section_kept_like_the_reference(hurray: ModuleType) -> None:
    raw = paged(hurray, hurray.int8, 3, (3, 1, 1), quantization=hurray.PerTensorAffine(0.5, 0))
    d = decode_descriptor(raw)
    assert isinstance(d.quantization, PerTensorAffine)
    longer = encode_descriptor(replace(d, quantization=replace(d.quantization, trailing=b"\x07" * 4)))
    assert len(longer) == len(raw) + 4
    assert bytes(hurray.Descriptor.decode(longer).encode()) == longer  # the reference keeps the tail too
    assert encode_descriptor(decode_descriptor(longer)) == longer
    assert found(longer).ok


# ── docs/format.md § 4 ──────────────────────────────────────────────────────


def test_format_doc_lists_every_rule_with_its_strength() -> None:
    text = (ROOT / "docs" / "format.md").read_text()
    table = text[text.index("## 4. Validation rules") :]
    rows: dict[str, str] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            for name in re.findall(r"`([a-z_.]+)`", cells[0]):
                rows[name] = cells[2]
    source = (ROOT / "hurray_vllm" / "wire" / "rules.py").read_text()
    emitted = set(re.findall(r'Violation\(\s*"([a-z_.]+)"', source))
    assert emitted - rows.keys() == set(), "rules missing from docs/format.md § 4"
    for name in emitted:
        assert (rows[name] == "never") == (name in rules._STRUCTURAL), name
