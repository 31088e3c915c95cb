"""Descriptor codec: byte-identical to the reference implementation, and self-inverse."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from pyhurray_bridge import to_reference
from strategies import paged_tensors

from hurray_vllm import BlockPagedTensor, HurrayFormatError, decode_descriptor, encode_descriptor
from hurray_vllm.wire.descriptor import (
    PerBlockAffine,
    PerChannelAffine,
    PerTensorAffine,
    decode_quantization,
    encode_quantization,
)

# The spec's example (layer 3, key, page_size 4, 5 pages, 2 x 8 float16, seqs 6 and 3 sharing page 0).
SPEC_EXAMPLE_HEX = (
    "4852525901008500000000000000010a030000000900000000000000020000000000000008000000000000000000000000000000"
    "040000000500000000000000000000000200000000030000000000000000000003800200000000000040000000000000000c0000"
    "000000000040000000000000000c000000000000004000000000000000"
)


def spec_example() -> BlockPagedTensor:
    pool = torch.zeros(5, 4, 2, 8, dtype=torch.float16)
    return BlockPagedTensor(pool, torch.tensor([0, 1, 0]), torch.tensor([0, 2, 3]), torch.tensor([6, 3]), "key", 3)


def test_spec_example_bytes() -> None:
    raw = encode_descriptor(spec_example().descriptor())
    assert len(raw) == 133
    assert raw.hex() == SPEC_EXAMPLE_HEX


def test_spec_example_matches_reference(hurray) -> None:
    assert to_reference(hurray, spec_example()).descriptor.encode() == bytes.fromhex(SPEC_EXAMPLE_HEX)


@given(paged_tensors(layer=None) | paged_tensors(role="value", layer=7) | paged_tensors(role="fused", layer=0))
def test_random_descriptors_match_reference(hurray, t: BlockPagedTensor) -> None:
    ours = encode_descriptor(t.descriptor())
    assert ours == to_reference(hurray, t).descriptor.encode()
    assert decode_descriptor(ours) == t.descriptor()


def _quantized(t: BlockPagedTensor, scheme: str, asym: bool) -> BlockPagedTensor:
    pool = t.page_pool.view(torch.int8) if t.page_pool.element_size() == 1 else t.page_pool.to(torch.int8)
    slots = t.num_pages * t.page_size
    if scheme == "tensor":
        return replace(t, page_pool=pool, quantization=PerTensorAffine(0.125, 3 if asym else 0))
    if scheme == "block":
        q = PerBlockAffine(0, t.page_size, 3, 4 if asym else None)
        bufs = (torch.rand(slots), *((torch.randint(-5, 5, (slots,), dtype=torch.int32),) if asym else ()))
    else:
        q = PerChannelAffine(2, 3, 4 if asym else None)
        bufs = (torch.rand(t.head_dim), *((torch.randint(-5, 5, (t.head_dim,), dtype=torch.int32),) if asym else ()))
    return replace(t, page_pool=pool, quantization=q, quant_buffers=tuple(b.view(torch.uint8) for b in bufs))


@given(paged_tensors(dtype=torch.int8), st.sampled_from(["tensor", "block", "channel"]), st.booleans())
def test_quantized_descriptors_match_reference(hurray, t: BlockPagedTensor, scheme: str, asym: bool) -> None:
    assume(scheme != "block" or t.page_size >= 2)  # per-block-affine needs a power-of-two block >= 2
    q = _quantized(t, scheme, asym)
    assert q.validate().ok, q.validate().violations
    ours = encode_descriptor(q.descriptor())
    assert ours == to_reference(hurray, q).descriptor.encode()
    assert decode_descriptor(ours) == q.descriptor()


def test_quantization_sections_match_reference(hurray) -> None:
    cases = [
        (PerTensorAffine(0.5, 3), hurray.PerTensorAffine(0.5, 3)),
        (PerChannelAffine(1, 3), hurray.PerChannelAffine.symmetric(axis=1, scale_buffer_index=3)),
        (PerBlockAffine(0, 16, 3), hurray.PerBlockAffine.symmetric(0, 16, 3, hurray.float32)),
        (PerBlockAffine(0, 16, 3, 4, scale_type_tag=2), hurray.PerBlockAffine.asymmetric(0, 16, 3, 4, hurray.bfloat16)),
    ]
    for ours, ref in cases:
        assert encode_quantization(ours) == ref.encode()
        assert decode_quantization(ref.encode()) == ours


def test_empty_batch_matches_reference(hurray) -> None:
    t = BlockPagedTensor(
        torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16),
        torch.empty(0, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
        torch.empty(0, dtype=torch.int64),
    )
    assert t.validate().ok
    assert encode_descriptor(t.descriptor()) == to_reference(hurray, t).descriptor.encode()


def test_reference_decodes_ours(hurray) -> None:
    raw = encode_descriptor(spec_example().descriptor())
    d = hurray.Descriptor.decode(raw)
    assert d.shape == (9, 2, 8)
    assert d.layout.kv_role == "key" and d.layout.layer_index == 3


@pytest.mark.parametrize("cut", [0, 1, 9, 10, 19, 20, 50, 132])
def test_truncated_descriptor_raises(cut: int) -> None:
    raw = bytes.fromhex(SPEC_EXAMPLE_HEX)
    with pytest.raises(HurrayFormatError):
        decode_descriptor(raw[:cut])


def test_length_that_lies_is_refused() -> None:
    raw = bytearray.fromhex(SPEC_EXAMPLE_HEX)
    raw[6:10] = (200).to_bytes(4, "little")
    with pytest.raises(HurrayFormatError, match="descriptor_length"):
        decode_descriptor(bytes(raw) + bytes(67))
    raw[6:10] = (0xFFFFFFFF).to_bytes(4, "little")
    with pytest.raises(HurrayFormatError, match="descriptor_length"):
        decode_descriptor(bytes(raw))


def test_bad_magic_and_version() -> None:
    raw = bytearray.fromhex(SPEC_EXAMPLE_HEX)
    raw[0] = ord("X")
    with pytest.raises(HurrayFormatError, match="magic"):
        decode_descriptor(bytes(raw))
    raw = bytearray.fromhex(SPEC_EXAMPLE_HEX)
    raw[4] = 2
    with pytest.raises(HurrayFormatError, match="version_major"):
        decode_descriptor(bytes(raw))


@given(st.data())
def test_mutated_descriptors_raise_only_format_errors(data: st.DataObject) -> None:
    raw = bytearray.fromhex(SPEC_EXAMPLE_HEX)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        d = decode_descriptor(bytes(raw[:cut]))
    except HurrayFormatError:
        return
    from hurray_vllm import validate

    validate(d)  # must not raise


@given(paged_tensors(), st.one_of(st.none(), st.integers(0, 2**32 - 2)))
def test_patching_the_layer_index_equals_encoding_it(t: BlockPagedTensor, layer: int | None) -> None:
    import struct

    from hurray_vllm.wire.descriptor import LAYER_INDEX_NONE, layer_index_offset

    d = t.descriptor()
    raw = bytearray(encode_descriptor(d))
    struct.pack_into("<I", raw, layer_index_offset(d), LAYER_INDEX_NONE if layer is None else layer)
    assert bytes(raw) == encode_descriptor(replace(t, layer_index=layer).descriptor())
