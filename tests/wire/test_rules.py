"""Each rule of the spec, broken on purpose, is reported by its name."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import paged_tensors

import hurray_vllm as hv
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.wire import rules
from hurray_vllm.wire.descriptor import (
    LAYOUT_COMPOSITE,
    BufferHandle,
    CompositeFields,
    PerBlockAffine,
    PerChannelAffine,
    PerTensorAffine,
    RawQuantization,
    Shard,
    TensorDescriptor,
)


def base() -> hv.BlockPagedTensor:
    return spec_example_snapshot()[3, "key"]


def desc() -> TensorDescriptor:
    return base().descriptor()


def names(obj: object, permissive: bool = False) -> set[str]:
    return {v.invariant for v in hv.validate(obj, permissive=permissive).violations}  # type: ignore[arg-type]


def with_bp(**kw: object) -> TensorDescriptor:
    d = desc()
    return replace(d, layout=replace(d.block_paged, **kw))  # type: ignore[type-var]


def with_buffer(i: int, **kw: object) -> TensorDescriptor:
    d = desc()
    bufs = list(d.buffers)
    bufs[i] = replace(bufs[i], **kw)  # type: ignore[arg-type]
    return replace(d, buffers=tuple(bufs))


def test_valid_example_has_no_violations() -> None:
    assert hv.validate(base()).ok
    assert hv.validate(desc()).ok
    assert hv.validate(hv.encode_descriptor(desc())).ok


@pytest.mark.parametrize(
    ("broken", "invariant"),
    [
        (lambda: replace(desc(), shape=(9, 16)), "rank"),
        (lambda: with_bp(paged_axis=1), "paged_axis"),
        (lambda: with_bp(page_size=0), "page_size"),
        (lambda: replace(desc(), byte_offset=8), "byte_offset"),
        (lambda: replace(desc(), buffers=desc().buffers[:2]), "buffer_count"),
        (lambda: with_buffer(0, byte_size=638), "page_pool.byte_size"),
        (lambda: with_buffer(1, byte_size=10), "block_table.byte_size"),
        (lambda: with_buffer(2, byte_size=8), "seq_ptr.byte_size"),
        (lambda: with_bp(reserved=b"\x00\x00\x01\x00\x00\x00"), "block_paged.reserved"),
        (lambda: replace(desc(), shard=Shard((9, 2, 8), (0, 0, 0))), "shard"),
        (lambda: with_bp(kv_role_tag=7), "kv_role"),
        (lambda: with_bp(index_type_tag=2), "block_table_index_type"),
        (lambda: with_bp(num_pages=2**32), "block_table_index_type"),
        (lambda: with_buffer(1, device_tag=1), "buffers.device_tag"),
        (lambda: with_buffer(2, memory_class=1), "buffers.memory_class"),
        (lambda: with_buffer(0, alignment=32), "buffers.alignment"),
        (lambda: with_buffer(0, reserved=1), "buffers.reserved"),
        (lambda: replace(desc(), reserved_flags=1 << 9), "flags.reserved"),
        (lambda: replace(desc(), type_tag=0x99), "type_tag"),
        (lambda: replace(desc(), shape=(99, 2, 8)), "shape.total_tokens"),
    ],
)
def test_descriptor_rules(broken, invariant: str) -> None:  # type: ignore[no-untyped-def]
    assert invariant in names(broken())


def _index_case(table: list[int], ptr: list[int], lens: list[int] | None) -> hv.BlockPagedTensor:
    b = base()
    return replace(
        b,
        block_table=torch.tensor(table),
        seq_ptr=torch.tensor(ptr),
        seq_lens=None if lens is None else torch.tensor(lens),
    )


@pytest.mark.parametrize(
    ("table", "ptr", "lens", "invariant"),
    [
        ([0, 1, 0], [1, 2, 3], None, "seq_ptr.first"),
        ([0, 1, 0], [0, 3, 2], None, "seq_ptr.non_decreasing"),
        ([0, 1, 0, 2], [0, 2, 3], None, "seq_ptr.last"),
        ([0, 5, 0], [0, 2, 3], None, "block_table.page_id"),
        ([0, 1, 0], [0, 2, 3], [6, 5], "seq_lens.pages"),
        ([0, 1, 0], [0, 2, 3], [6], "seq_lens.count"),
    ],
)
def test_index_buffer_rules(table: list[int], ptr: list[int], lens: list[int] | None, invariant: str) -> None:
    t = _index_case(table, ptr, lens)
    found = {v.invariant for v in hv.validate(t).violations}
    assert invariant in found, found


def test_seq_lens_against_shape() -> None:
    d = replace(desc(), shape=(8, 2, 8))
    checked = rules.validate_descriptor(
        d, block_table=torch.tensor([0, 1, 0]), seq_ptr=torch.tensor([0, 2, 3]), seq_lens=torch.tensor([6, 3])
    )
    assert "seq_lens.total" in {v.invariant for v in checked.violations}


def _quant(q: object, extra: list[int]) -> TensorDescriptor:
    d = desc()
    return replace(
        d,
        type_tag=0x10,  # int8 storage
        buffers=(BufferHandle(320, 64, 0), *d.buffers[1:], *(BufferHandle(n, 64, 0) for n in extra)),
        quantization=q,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("q", "extra", "invariant"),
    [
        (PerBlockAffine(1, 4, 3), [80], "quantization.axis"),
        (PerBlockAffine(0, 8, 3), [80], "quantization.block_size"),
        (PerBlockAffine(0, 4, 3), [36], "quantization.scales.byte_size"),
        (PerChannelAffine(0, 3), [36], "quantization.axis"),
        (PerChannelAffine(2, 3), [12], "quantization.scales.byte_size"),
        (PerBlockAffine(0, 4, 2), [80], "quantization.buffer_index"),
        (PerTensorAffine(0.0), [], "quantization.scale"),
        (RawQuantization(b"\x70\x01\x00\x00"), [], "quantization.scheme_tag"),
        (PerBlockAffine(0, 4, 3, 4), [80, 20], "quantization.zero_points.byte_size"),
    ],
)
def test_quantization_rules(q: object, extra: list[int], invariant: str) -> None:
    assert invariant in names(_quant(q, extra))


def test_quantization_storage_type() -> None:
    fp8 = replace(_quant(PerTensorAffine(0.5), []), type_tag=0x40)
    assert "quantization.storage_type" in names(fp8)
    assert "quantization.storage_type" in names(replace(_quant(PerBlockAffine(0, 4, 3), [80]), type_tag=0x12))


def test_quantization_valid_cases() -> None:
    assert hv.validate(_quant(PerBlockAffine(0, 4, 3, 4), [80, 80])).ok  # int32 zero point per slot
    assert hv.validate(_quant(PerBlockAffine(0, 4, 3), [80])).ok  # 5 pages x 4 slots x f32
    assert hv.validate(_quant(PerChannelAffine(2, 3), [32])).ok  # 8 channels x f32
    assert hv.validate(_quant(PerTensorAffine(0.5), [])).ok


def errors(d: TensorDescriptor, permissive: bool) -> set[str]:
    return {v.invariant for v in hv.validate(d, permissive=permissive).errors}


@pytest.mark.parametrize(
    ("q", "extra", "invariant"),
    [
        # A scale type not allowed (waivable) sized by its element type: float64 needs 20 x 8 bytes.
        (PerBlockAffine(0, 4, 3, scale_type_tag=0x04), [160, 8], "buffer_count"),
        (PerBlockAffine(0, 4, 3, scale_type_tag=0x04), [80], "quantization.scales.byte_size"),
        # A scale type of no known width: its scales are not sized, the zero points and the count still are.
        (PerBlockAffine(0, 4, 3, 4, scale_type_tag=0x99), [80, 20], "quantization.zero_points.byte_size"),
        (PerBlockAffine(0, 4, 3, scale_type_tag=0x99), [80, 8], "buffer_count"),
        # A per-channel axis past the rank (waivable): no entries to size by, the buffer count still counts.
        (PerChannelAffine(5, 3), [32, 8], "buffer_count"),
    ],
    ids=["f64 extra buffer", "f64 short scales", "unknown type zero points", "unknown type extra", "axis >= rank"],
)
def test_a_waivable_scale_type_or_axis_does_not_waive_the_structural_sizes(
    q: object, extra: list[int], invariant: str
) -> None:
    """Found by a review: an unknown scale type or an axis >= rank skipped the never-waived size and count
    checks, so a permissive read accepted buffers that do not add up."""
    d = _quant(q, extra)
    assert invariant in errors(d, permissive=False)
    assert invariant in errors(d, permissive=True)


def test_a_shared_scale_and_zero_point_buffer_still_counts_the_buffers() -> None:
    """Found by a review: a shared scale/zero-point buffer returned before the buffer count was checked."""
    shared = PerBlockAffine(0, 4, 3, 3)  # 20 entries of f32 scale + int32 zero point in buffer 3
    assert hv.validate(_quant(shared, [160])).ok
    for permissive in (False, True):
        assert "buffer_count" in errors(_quant(shared, [160, 64]), permissive)
        assert "quantization.scales.byte_size" in errors(_quant(shared, [80]), permissive)


def _head(**kw: object) -> TensorDescriptor:
    fields = dict(rule_tag=3, member_count=3)
    fields.update(kw)
    return TensorDescriptor(0x01, (9, 2, 8), LAYOUT_COMPOSITE, CompositeFields(**fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("head", "invariant"),
    [
        (lambda: _head(rule_tag=0), "composite.rule"),
        (lambda: _head(combine_op=1), "composite.combine_op"),
        (lambda: _head(rule_tag=2, combine_op=0), "composite.combine_op"),
        (lambda: _head(reserved=b"\x01\x00"), "composite.reserved"),
        (lambda: _head(member_count=0xFFFFFFFF), "composite.member_count"),
        (lambda: replace(_head(), buffers=(BufferHandle(8),)), "composite.buffer_count"),
        (lambda: replace(_head(), byte_offset=8), "byte_offset"),
    ],
)
def test_composite_rules(head, invariant: str) -> None:  # type: ignore[no-untyped-def]
    assert invariant in names(head())


def test_permissive_waives_only_what_the_spec_allows() -> None:
    waivable = with_bp(reserved=b"\x01" * 6, kv_role_tag=9)
    assert not hv.validate(waivable).ok
    assert hv.validate(waivable, permissive=True).ok
    assert hv.validate(waivable, permissive=True).violations  # still listed
    structural = with_buffer(0, byte_size=1)
    assert not hv.validate(structural, permissive=True).ok
    out_of_range = _index_case([0, 9, 0], [0, 2, 3], [6, 3])
    assert not hv.validate(out_of_range, permissive=True).ok


def test_from_wire_refuses_with_one_error_type() -> None:
    t = base()
    bufs = [b.contiguous().view(torch.uint8).reshape(-1) for b in t.wire_buffers()]
    with pytest.raises(hv.HurrayFormatError) as info:
        hv.BlockPagedTensor.from_wire(with_buffer(0, byte_size=4), bufs)
    assert info.value.field == "page_pool.byte_size"
    assert isinstance(info.value, ValueError)


def test_snapshot_consistency() -> None:
    snap = spec_example_snapshot(num_layers=2)
    bad = replace(snap, token_ids=((1, 2),))
    assert "snapshot.token_ids" in names(bad)
    swapped = replace(snap, keys=snap.values, values=snap.keys)
    assert "kv_role" in names(swapped)


@given(
    table=st.lists(st.integers(-2, 6), max_size=8),
    ptr=st.lists(st.integers(-1, 9), min_size=1, max_size=5),
    lens=st.none() | st.lists(st.integers(-3, 40), max_size=5),
)
def test_small_index_buffers_take_a_list_path_with_the_same_verdicts(
    table: list[int], ptr: list[int], lens: list[int] | None
) -> None:
    import hurray_vllm.wire.rules as v

    t = _index_case(table, ptr, lens)
    fast = [(x.invariant, x.message) for x in hv.validate(t).violations]
    saved, v._SMALL = v._SMALL, -1  # every tensor through the torch path
    try:
        slow = [(x.invariant, x.message) for x in hv.validate(t).violations]
    finally:
        v._SMALL = saved
    assert fast == slow


@given(
    lens=st.lists(st.integers(0, 127), min_size=1, max_size=5),
    pages=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 4, 16, 128, 256]),
    dtype=st.sampled_from([torch.uint8, torch.int8, torch.int16, torch.int32]),
)
def test_narrow_seq_lens_get_the_verdict_of_int64_on_either_path(
    lens: list[int], pages: list[int], page_size: int, dtype: torch.dtype
) -> None:
    """Found by a review: past 4096 index entries the rules did the pages arithmetic in the lengths' own
    dtype, where uint8's 250 + 15 wraps: a sequence of 250 tokens in no page was valid (save wrote it, load
    refused the file), valid ones were refused, and a page_size of 256 divided by zero."""
    import hurray_vllm.wire.rules as v

    n = min(len(lens), len(pages))
    lens, pages = lens[:n], pages[:n]
    ptr = [0]
    for p in pages:
        ptr.append(ptr[-1] + p)
    b = base()
    pool = torch.zeros(max(1, ptr[-1]), page_size, *b.page_pool.shape[2:], dtype=b.page_pool.dtype)

    def verdict(dt: torch.dtype) -> list[tuple[str, str]]:
        t = replace(
            b,
            page_pool=pool,
            block_table=torch.zeros(ptr[-1], dtype=torch.int64),
            seq_ptr=torch.tensor(ptr),
            seq_lens=torch.tensor(lens, dtype=dt),
        )
        return [(x.invariant, x.message) for x in hv.validate(t).violations]

    wide = verdict(torch.int64)
    saved, v._SMALL = v._SMALL, -1  # every tensor through the torch path
    try:
        assert verdict(dtype) == wide
    finally:
        v._SMALL = saved
    assert verdict(dtype) == wide


@pytest.mark.parametrize("n", [10, 3000], ids=["list path", "tensor path"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool, torch.uint32])
def test_seq_lens_that_are_not_integers_are_refused(n: int, dtype: torch.dtype) -> None:
    """A writer stores lengths as int64: 3.5 tokens would be written as 3, and shape[0] as their float sum."""
    t = hv.BlockPagedTensor(
        torch.zeros(n, 4, 1, 2), torch.arange(n), torch.arange(n + 1), torch.full((n,), 3).to(dtype)
    )
    checked = t.validate(permissive=True)
    assert [v.invariant for v in checked.errors] == ["seq_lens.dtype"], checked.errors
    assert replace(t, seq_lens=torch.full((n,), 3, dtype=torch.int32)).validate().ok


@given(paged_tensors(), st.sampled_from([torch.float16, torch.float32, torch.bool]))
def test_seq_lens_of_any_batch_held_as_floats_do_not_validate(t: hv.BlockPagedTensor, dtype: torch.dtype) -> None:
    assert t.validate().ok
    assert "seq_lens.dtype" in names(replace(t, seq_lens=t.seq_lens.to(dtype)))  # type: ignore[union-attr]
    assert replace(t, seq_lens=t.seq_lens.to(torch.int32)).validate().ok  # type: ignore[union-attr]


@pytest.mark.parametrize("n", [10, 3000], ids=["list path", "tensor path"])
@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.float32, torch.bool])
@pytest.mark.parametrize("which", ["block_table", "seq_ptr"])
def test_index_tensors_held_as_other_than_int32_or_int64_are_refused(n: int, dtype: torch.dtype, which: str) -> None:
    """An int16 table of page ids up to 3000 over pages of 16 validated, then repaged into wrapped slots."""
    t = hv.BlockPagedTensor(
        torch.zeros(n, 4, 1, 2), torch.arange(n) % 2, torch.arange(n + 1), torch.full((n,), 3, dtype=torch.int64)
    )
    bad = replace(t, **{which: getattr(t, which).to(dtype)})
    checked = bad.validate(permissive=True)
    assert [v.invariant for v in checked.errors] == [f"{which}.dtype"], checked.errors
    # What the readers hold (int64, widened from the wire) and what vLLM and FlashInfer hand over (int32) pass.
    assert t.validate().ok
    assert replace(t, block_table=t.block_table.to(torch.int32), seq_ptr=t.seq_ptr.to(torch.int32)).validate().ok


def test_total_tokens_may_fill_the_logical_pages_and_not_one_token_more() -> None:
    """The boundary of shape.total_tokens: every logical page full is fine, one token past them is not."""
    d = desc()
    bp = d.block_paged
    assert bp is not None
    logical = d.buffers[1].byte_size // bp.index_bytes
    full = logical * bp.page_size
    assert "shape.total_tokens" not in names(replace(d, shape=(full, *d.shape[1:])))
    over = replace(d, shape=(full + 1, *d.shape[1:]))
    assert "shape.total_tokens" in names(over)
    (v,) = (v for v in hv.validate(over).violations if v.invariant == "shape.total_tokens")
    assert f"shape[0] = {full + 1} tokens do not fit in {logical} logical pages of {bp.page_size}" in v.message
