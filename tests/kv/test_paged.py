"""BlockPagedTensor operations, as properties over random batches with shared prefixes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import paged_tensors, snapshots

import hurray_vllm as hv
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.kv.paged import plan_compaction, zero_slots_
from hurray_vllm.wire.descriptor import PerBlockAffine


def dense_all(t: hv.BlockPagedTensor) -> list[torch.Tensor]:
    return [t.to_dense(s).view(torch.uint8) for s in range(t.num_seqs)]


@given(paged_tensors(dtype=torch.float32))
def test_lookup_follows_the_spec_formula(t: hv.BlockPagedTensor) -> None:
    for s in range(t.num_seqs):
        dense = t.to_dense(s)
        assert dense.shape == (int(t.seq_lens[s]), t.num_heads, t.head_dim)  # type: ignore[index]
        for tok in {0, dense.shape[0] // 2, dense.shape[0] - 1} if dense.shape[0] else set():
            page = int(t.block_table[int(t.seq_ptr[s]) + tok // t.page_size])
            assert torch.equal(t.lookup(s, tok, 0, 0), t.page_pool[page, tok % t.page_size, 0, 0])
            assert torch.equal(dense[tok, 0, 0], t.lookup(s, tok, 0, 0))


@given(paged_tensors())
def test_compact_keeps_tokens_and_aliasing(t: hv.BlockPagedTensor) -> None:
    c = t.compact()
    assert all(torch.equal(a, b) for a, b in zip(dense_all(t), dense_all(c)))
    assert c.num_pages == int(torch.unique(t.block_table).numel())
    assert c.sharing().shared_pages == t.sharing().shared_pages
    # Aliasing preserved: equal ids before <=> equal ids after.
    same_before = t.block_table[:, None] == t.block_table[None, :]
    same_after = c.block_table[:, None] == c.block_table[None, :]
    assert torch.equal(same_before, same_after)
    assert c.validate().ok


@given(paged_tensors(), st.data())
def test_select_is_a_sub_batch(t: hv.BlockPagedTensor, data: st.DataObject) -> None:
    if t.num_seqs == 0:
        return
    seqs = data.draw(st.lists(st.integers(0, t.num_seqs - 1), max_size=4))
    sub = t.select(seqs)
    assert sub.num_seqs == len(seqs)
    for i, s in enumerate(seqs):
        assert torch.equal(sub.to_dense(i).view(torch.uint8), t.to_dense(s).view(torch.uint8))
    assert sub.validate().ok


@given(paged_tensors())
def test_zero_unused_slots(t: hv.BlockPagedTensor) -> None:
    z = t.zero_unused_slots()
    assert all(torch.equal(a, b) for a, b in zip(dense_all(t), dense_all(z)))
    valid = z.valid_slots()
    raw = z.page_pool.view(torch.uint8).reshape(z.num_pages, z.page_size, -1)
    for p in range(z.num_pages):
        assert not raw[p, int(valid[p]) :].any()


def test_shared_page_keeps_what_the_longer_sequence_uses() -> None:
    t = spec_example_snapshot()[0, "key"]
    # Page 0 is full for sequence 0 (6 tokens) and 3/4 used by sequence 1: nothing of it is zeroed.
    assert t.valid_slots().tolist() == [4, 2, 0, 0, 0]


def test_sharing_stats() -> None:
    s = spec_example_snapshot().sharing()
    assert (s.logical_pages, s.distinct_pages, s.shared_pages) == (3, 2, 1)
    assert s.saved_bytes == 4 * 2 * 8 * 2


@given(snapshots())
def test_snapshot_select_compacts(snap: hv.KVSnapshot) -> None:
    if snap.num_seqs == 0:
        return
    sub = snap.select([snap.num_seqs - 1])
    assert sub.num_seqs == 1
    assert sub.token_ids == (snap.token_ids[-1],)
    first, last = snap.roles[0], snap.roles[-1]  # key and value, or the one fused latent
    assert sub[0, last].num_pages == int(torch.unique(sub[0, last].block_table).numel())
    assert torch.equal(
        sub[0, first].to_dense(0).view(torch.uint8), snap[0, first].to_dense(snap.num_seqs - 1).view(torch.uint8)
    )


def test_errors_name_the_problem() -> None:
    t = spec_example_snapshot()[0, "key"]
    with pytest.raises(IndexError):
        t.to_dense(2)
    with pytest.raises(IndexError):
        t.lookup(1, 3, 0, 0)  # sequence 1 has 3 tokens
    from dataclasses import replace

    with pytest.raises(hv.HurrayFormatError, match="seq_lens"):
        replace(t, seq_lens=None).to_dense(0)
    with pytest.raises(KeyError):
        spec_example_snapshot()[0, "both"]


def test_lookup_refuses_indices_outside_the_tensor() -> None:
    """The flat offset would read a neighbouring token, head or sequence."""
    pool = torch.arange(2 * 4 * 2 * 2, dtype=torch.float32).view(2, 4, 2, 2)
    for lens in (torch.tensor([3, 2]), None):
        t = hv.BlockPagedTensor(pool, torch.tensor([0, 1]), torch.tensor([0, 1, 2]), lens)
        assert float(t.lookup(1, 1, 1, 1)) == float(pool[1, 1, 1, 1])
        for args in [(0, 0, 2, 0), (0, 0, -1, 0), (0, 0, 0, 2), (1, -1, 0, 0), (0, 4, 0, 0)]:
            with pytest.raises(IndexError):
                t.lookup(*args)


def test_lookup_reads_the_last_head_and_the_last_dim_where_they_lie() -> None:
    """Found by mutation testing: with as many heads as dims (or index 0 only) a head and a dim swapped in the
    flat offset read the same element; here 2 heads of 3 dims, and every token, head and dim is checked."""
    pool = torch.arange(3 * 4 * 2 * 3, dtype=torch.float32).view(3, 4, 2, 3)
    t = hv.BlockPagedTensor(pool, torch.tensor([2, 0]), torch.tensor([0, 2]), torch.tensor([7]))
    assert t.num_heads != t.head_dim
    for tok in range(7):
        page, off = int(t.block_table[tok // 4]), tok % 4
        assert float(t.lookup(0, tok, 1, 0)) == float(pool[page, off, 1, 0])  # the last head
        assert float(t.lookup(0, tok, 0, 2)) == float(pool[page, off, 0, 2])  # the last dim
        got = [float(t.lookup(0, tok, h, d)) for h in range(2) for d in range(3)]
        assert got == pool[page, off].reshape(-1).tolist()


def test_validate_reports_a_pool_that_is_not_four_dimensional() -> None:
    """descriptor() reads heads and head_dim from the pool: validate used to fail with an IndexError."""
    t = hv.BlockPagedTensor(torch.zeros(2, 4, 8), torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([8]))
    checked = t.validate()
    assert not checked.ok and [v.invariant for v in checked.violations] == ["rank"]
    assert not t.validate(permissive=True).ok  # structural: blocks in permissive mode too


def test_snapshot_select_of_a_sequence_outside_the_batch_is_an_argument_error() -> None:
    snap = spec_example_snapshot(2)
    for seq in (snap.num_seqs, -1):
        with pytest.raises(hv.HurrayArgumentError) as err:
            snap.select([0, seq])
        assert err.value.field == "seqs"


@given(paged_tensors(dtype=torch.float32), st.data())
def test_a_length_past_a_sequences_pages_or_negative_is_refused_not_read(
    t: hv.BlockPagedTensor, data: st.DataObject
) -> None:
    """Trusted, it read the next sequence's pages, or (negative) sliced tokens from the end."""
    if t.num_seqs == 0:
        return
    s = data.draw(st.integers(0, t.num_seqs - 1))
    room = t.page_size * len(t.pages_of(s))
    n = data.draw(st.integers(room + 1, room + 2 * t.page_size) | st.integers(-2 * t.page_size, -1))
    lens = t.seq_lens.clone()  # type: ignore[union-attr]
    lens[s] = n
    bad = replace(t, seq_lens=lens)
    for read in (lambda: bad.seq_len(s), lambda: bad.to_dense(s), lambda: bad.lookup(s, max(0, room), 0, 0)):
        with pytest.raises(hv.HurrayFormatError) as err:
            read()
        assert err.value.field == "seq_lens.pages"
    # Up to what its pages hold, a length reads only them (validate() wants exactly ceil(n / page_size) pages).
    lens[s] = room
    assert replace(t, seq_lens=lens).to_dense(s).shape[0] == room


@pytest.mark.parametrize("page", [5, -1], ids=["past the pool", "negative"])
def test_page_ids_outside_the_pool_are_a_format_error_in_every_operation(page: int) -> None:
    """They failed with a RuntimeError (scatter) or IndexError (index_select), or read another tensor's memory."""
    t = hv.BlockPagedTensor(
        torch.arange(8.0).reshape(2, 4, 1, 1), torch.tensor([0, page]), torch.tensor([0, 2]), torch.tensor([8])
    )
    for op in (t.valid_slots, t.zero_unused_slots, t.compact, lambda: t.to_dense(0), lambda: t.lookup(0, 5, 0, 0)):
        with pytest.raises(hv.HurrayFormatError) as err:
            op()
        assert err.value.field == "block_table"
    with pytest.raises(hv.HurrayFormatError, match="reads 3 pages"):  # a plan made for a larger pool
        replace(t, block_table=torch.tensor([0, 1])).compact(plan_compaction(torch.tensor([0, 2]), 3))


@given(paged_tensors(), st.data())
def test_select_without_lengths_keeps_a_known_token_count_or_refuses(
    t: hv.BlockPagedTensor, data: st.DataObject
) -> None:
    """A plain descriptor's tensor knows shape[0] only: select() counted every page as full."""
    tokens = int(t.seq_lens.sum())  # type: ignore[union-attr]
    plain = replace(t, seq_lens=None, num_tokens=tokens)
    assert plain.select(range(t.num_seqs)).shape == t.shape  # the whole batch: its count
    seqs = data.draw(st.lists(st.integers(0, max(0, t.num_seqs - 1)), max_size=4)) if t.num_seqs else []
    if tokens == t.block_table.numel() * t.page_size:  # every page full: every sub-batch's count is known
        assert plain.select(seqs).shape == t.select(seqs).shape
    elif seqs != list(range(t.num_seqs)):
        with pytest.raises(hv.HurrayFormatError) as err:
            plain.select(seqs)
        assert err.value.field == "seq_lens"


def test_select_of_a_plain_descriptors_tensor() -> None:
    t = hv.BlockPagedTensor(torch.zeros(2, 4, 2, 8), torch.tensor([0, 1, 0]), torch.tensor([0, 2, 3]), num_tokens=9)
    assert t.select([0, 1]).shape == (9, 2, 8)
    with pytest.raises(hv.HurrayFormatError, match="sub-batch"):
        t.select([1])
    full = replace(t, num_tokens=12)
    assert full.select([1]).shape == (4, 2, 8)


def _shared_params() -> hv.BlockPagedTensor:
    """int8 pages with scales and zero points at one buffer index, which the rules accept."""
    pool = torch.randint(-100, 100, (3, 4, 1, 2), dtype=torch.int8)
    return hv.BlockPagedTensor(
        pool,
        torch.tensor([2, 0, 1]),
        torch.tensor([0, 3]),
        torch.tensor([10]),
        quantization=PerBlockAffine(0, 4, 3, 3),
        quant_buffers=(torch.zeros(12 * (4 + 4), dtype=torch.uint8),),
    )


def test_scales_and_zero_points_in_one_buffer_are_not_moved_by_compact() -> None:
    """Their layout in the buffer is undefined: a per-slot gather could pair a slot with another's parameters."""
    t = _shared_params()
    assert t.validate().ok
    with pytest.raises(hv.HurrayFormatError) as err:
        t.compact()
    assert err.value.field == "quantization.buffer_index"
    separate = replace(
        t,
        quantization=PerBlockAffine(0, 4, 3, 4),
        quant_buffers=(torch.zeros(12 * 4, dtype=torch.uint8), torch.zeros(12 * 4, dtype=torch.uint8)),
    )
    assert separate.validate().ok and separate.compact().validate().ok


def test_compact_moves_each_slots_scale_and_zero_point_with_its_page() -> None:
    """Found by mutation testing: the per-slot parameters of a pool whose pages compact drops and renumbers must
    follow their pages (a leading slice of the buffers keeps the right count, the wrong slots' values)."""
    pool = torch.randint(-100, 100, (4, 4, 1, 2), dtype=torch.int8)
    scales, zeros = torch.arange(16, dtype=torch.float32), torch.arange(100, 116, dtype=torch.float32)
    t = hv.BlockPagedTensor(
        pool,
        torch.tensor([3, 0, 2]),  # page 1 unused: compact keeps pages 0, 2 and 3, renumbered
        torch.tensor([0, 3]),
        torch.tensor([10]),
        quantization=PerBlockAffine(0, 4, 3, 4),  # scales and zero points in buffers of their own
        quant_buffers=(scales.view(torch.uint8), zeros.view(torch.uint8)),
    )
    assert t.validate().ok
    c = t.compact()
    assert c.num_pages == 3 and c.validate().ok

    def slots(x: hv.BlockPagedTensor) -> list[int]:  # token k's slot: its page's, then its offset
        return [int(x.block_table[k // 4]) * 4 + k % 4 for k in range(10)]

    for before, after in zip(t.quant_buffers, c.quant_buffers, strict=True):
        b, a = before.view(torch.float32), after.view(torch.float32)
        assert a.numel() == 3 * 4
        assert [float(a[i]) for i in slots(c)] == [float(b[i]) for i in slots(t)]


def test_compact_refuses_a_plan_made_for_another_block_table() -> None:
    """compact(plan) gathered the pages another table's plan lists: other tokens, silently (repage refuses these)."""
    pool = torch.arange(6.0).reshape(3, 2, 1, 1)
    a = hv.BlockPagedTensor(pool, torch.tensor([0, 2]), torch.tensor([0, 2]), torch.tensor([4]))
    b = replace(a, block_table=torch.tensor([2, 1]))
    for plan in (plan_compaction(a.block_table, 3), plan_compaction(torch.empty(0, dtype=torch.int64), 3)):
        with pytest.raises(hv.HurrayArgumentError) as err:
            b.compact(plan)
        assert err.value.field == "plan"
    # The same table's plan applies, however the table is held (another layer's copy of it).
    assert torch.equal(b.compact(plan_compaction(b.block_table.clone(), 3)).to_dense(0), b.to_dense(0))


class _OffHost(torch.Tensor):
    """CPU data that says it lives on the meta device: CUDA index tensors, for a machine without CUDA.

    Its ops run on the CPU data. As on CUDA, an op that mixes it with a CPU tensor of one or more
    dimensions (an operand, an ``out=`` buffer) fails; CPU indices are accepted, as CUDA indexing does.
    """

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> _OffHost:
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype, device="meta")
        r.elem = elem
        return r  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.utils import _pytree as pytree

        kwargs = dict(kwargs or {})
        indices = args[1] if func is torch.ops.aten.index.Tensor else ()
        host = [
            a
            for a in pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and not isinstance(a, cls) and a.dim() and all(a is not i for i in indices)
        ]
        if host:
            raise RuntimeError(f"{func}: expected every tensor on one device, got meta and cpu")
        if "device" in kwargs:  # a factory on "this" device: the CPU data's
            kwargs["device"] = torch.device("cpu")
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.elem, (args, kwargs))
        return pytree.tree_map_only(torch.Tensor, cls, func(*args, **kwargs))


@pytest.mark.parametrize(
    "device",
    [
        "off-host",
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
        ),
    ],
)
def test_select_builds_its_offsets_on_the_index_tensors_device(device: str) -> None:
    """select() allocated seq_ptr on the CPU and cumsummed the device's counts into it: a cross-device error."""
    move = _OffHost if device == "off-host" else (lambda x: x.to(device))
    t = hv.BlockPagedTensor(
        torch.zeros(3, 4, 1, 2),
        move(torch.tensor([0, 1, 2])),
        move(torch.tensor([0, 2, 3])),
        move(torch.tensor([6, 3])),
    )
    for seqs, table, ptr in (([1, 0], [2, 0, 1], [0, 1, 3]), ([], [], [0])):
        r = t.select(seqs)
        assert r.seq_ptr.device == r.block_table.device == t.seq_ptr.device
        for got, want in ((r.seq_ptr, ptr), (r.block_table, table)):
            assert (got.elem if isinstance(got, _OffHost) else got).tolist() == want


def test_zeroing_unused_slots_works_on_strided_pools() -> None:
    """A permuted (HND-backed) pool or a head slice cannot be viewed as flat rows: both raised a RuntimeError."""
    hnd = torch.arange(3 * 2 * 4 * 2, dtype=torch.float32).reshape(3, 2, 4, 2) + 1
    pool = hnd.permute(0, 2, 1, 3)  # [pages, page_size, heads, dim], dense but not contiguous
    t = hv.BlockPagedTensor(pool, torch.tensor([2, 0]), torch.tensor([0, 2]), torch.tensor([6]))
    want = replace(t, page_pool=pool.contiguous()).zero_unused_slots().page_pool
    assert torch.equal(t.zero_unused_slots().page_pool, want)
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        whole = (torch.arange(3 * 4 * 4 * 2).reshape(3, 4, 4, 2) % 7 + 1).to(dtype)
        heads = whole[:, :, 1:3]  # a select_heads view
        zero_slots_(heads, torch.tensor([4, 2, 0]))
        assert heads[0].float().all() and heads[1, :2].float().all()
        assert not heads[1, 2:].float().any() and not heads[2].float().any()
        assert whole[:, :, [0, 3]].float().all()  # the other heads are not the view's: untouched


def test_an_index_cache_keys_on_the_lengths_dtype_and_shape_not_their_bytes_alone() -> None:
    """bf16 lengths failed with a TypeError building the key; int32 [6, 0, 3, 0] hit int64 [6, 3]'s entry."""
    from hurray_vllm.kv.paged import IndexCache
    from hurray_vllm.wire.descriptor import encode_descriptor
    from hurray_vllm.wire.rules import decode_checked

    t = hv.BlockPagedTensor(
        torch.zeros(5, 4, 2, 8, dtype=torch.float16),
        torch.tensor([0, 1, 0]),
        torch.tensor([0, 2, 3]),
        torch.tensor([6, 3]),
        "key",
        3,
    )
    d = decode_checked(encode_descriptor(t.descriptor()), "test")
    bufs = [b.contiguous().view(torch.uint8).reshape(-1) for b in t.wire_buffers()]
    for lens in (torch.tensor([6.0, 3.0], dtype=torch.bfloat16), torch.tensor([6.0, 3.0])):
        for cache in (None, IndexCache()):
            with pytest.raises(hv.HurrayFormatError) as err:
                hv.BlockPagedTensor.from_wire(d, bufs, seq_lens=lens, index_cache=cache)
            assert err.value.field == "seq_lens.dtype"
    good = torch.tensor([6, 3])
    cache = IndexCache()
    assert hv.BlockPagedTensor.from_wire(d, bufs, seq_lens=good, index_cache=cache).seq_lens is good
    for alias in (good.view(torch.int32), good.view(1, 2)):  # the same bytes, read as other lengths
        with pytest.raises(hv.HurrayFormatError) as err:
            hv.BlockPagedTensor.from_wire(d, bufs, seq_lens=alias, index_cache=cache)
        assert err.value.field == "seq_lens.count"
    assert hv.BlockPagedTensor.from_wire(d, bufs, seq_lens=good.clone(), index_cache=cache).num_seqs == 2


def test_descriptor_names_the_field_that_is_wrong() -> None:
    """An unknown index type was reported as a bad kv_role."""
    t = spec_example_snapshot()[0, "key"]
    for change, field in ((dict(kv_role="keys"), "kv_role"), (dict(index_type="int32"), "block_table_index_type")):
        with pytest.raises(hv.HurrayFormatError) as err:
            replace(t, **change).descriptor()  # type: ignore[arg-type]
        assert err.value.field == field


@pytest.mark.parametrize("layer", [-1, 2**32 - 1, 2**32, True])
def test_validate_reports_a_layer_index_the_wire_cannot_encode(layer: int) -> None:
    """encode_descriptor refuses these (0xFFFFFFFF is the wire's None): validate passed them, save then failed."""
    from hurray_vllm.wire.descriptor import encode_descriptor

    t = replace(spec_example_snapshot()[0, "key"], layer_index=layer)
    with pytest.raises(hv.HurrayArgumentError):
        encode_descriptor(t.descriptor())
    checked = t.validate(permissive=True)
    assert [v.invariant for v in checked.errors] == ["layer_index"], checked.errors
    assert replace(t, layer_index=2**32 - 2).validate().ok
    assert replace(t, layer_index=None).validate().ok


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.float32])
def test_page_ids_in_a_dtype_torch_cannot_index_with_are_refused_naming_the_field(dtype: torch.dtype) -> None:
    """to_dense, compact and valid_slots failed inside torch (a bare RuntimeError / NotImplementedError)."""
    t = hv.BlockPagedTensor(torch.randn(4, 2, 1, 2), torch.tensor([1, 2]), torch.tensor([0, 2]), torch.tensor([3]))
    narrow = replace(t, block_table=t.block_table.to(dtype))
    calls = {
        "to_dense": lambda: narrow.to_dense(0),
        "compact": narrow.compact,
        "valid_slots": narrow.valid_slots,
        "zero_unused_slots": narrow.zero_unused_slots,
        "plan_compaction": lambda: plan_compaction(narrow.block_table, narrow.num_pages),
    }
    for name, call in calls.items():
        with pytest.raises(hv.HurrayFormatError) as err:
            call()
        assert err.value.field == "block_table.dtype", name
    assert not narrow.validate().ok  # the same rule validate() reports
    assert torch.equal(replace(narrow, block_table=narrow.block_table.long()).to_dense(0), t.to_dense(0))


def test_select_of_a_generator_selects_its_sequences() -> None:
    """The range check consumed a generator, and the sub-batch then held no sequence."""
    t = spec_example_snapshot()[0, "key"]
    sub = t.select(s for s in [1])
    assert sub.num_seqs == 1 and torch.equal(sub.to_dense(0), t.to_dense(1))
    with pytest.raises(IndexError):
        t.select(s for s in [5])


@pytest.mark.parametrize("seq", [True, 1.0, 0.5, "0"])
def test_select_refuses_a_sequence_that_is_not_an_integer(seq: object) -> None:
    with pytest.raises(hv.HurrayArgumentError) as err:
        spec_example_snapshot()[0, "key"].select([seq])  # type: ignore[list-item]
    assert err.value.field == "seqs"


def _broken(name: str) -> hv.BlockPagedTensor:
    t = spec_example_snapshot()[0, "key"]
    return {
        "kv_role": lambda: replace(t, kv_role="kex"),
        "block_table_index_type": lambda: replace(t, index_type="int8"),
        "type_tag": lambda: replace(t, page_pool=t.page_pool.bool()),
        "block_table.dtype": lambda: replace(t, block_table=t.block_table.reshape(1, -1)),
        "seq_ptr.dtype": lambda: replace(t, seq_ptr=t.seq_ptr.reshape(1, -1)),
        "seq_ptr.first": lambda: replace(t, seq_ptr=torch.zeros(0, dtype=torch.int64)),
        "shape.total_tokens": lambda: replace(t, seq_lens=None, num_tokens="5"),
    }[name]()


@pytest.mark.parametrize(
    "invariant",
    [
        "kv_role",
        "block_table_index_type",
        "type_tag",
        "block_table.dtype",
        "seq_ptr.dtype",
        "seq_ptr.first",
        "shape.total_tokens",
    ],
)
def test_validate_reports_what_the_descriptor_cannot_be_built_from(invariant: str, tmp_path: Path) -> None:
    """validate raised (HurrayFormatError from descriptor(), or a bare TypeError, IndexError or ValueError)."""
    t = _broken(invariant)
    checked = t.validate()
    assert not checked.ok and checked.violations[0].invariant == invariant
    snap = spec_example_snapshot()
    bad = replace(snap, keys=(t, *snap.keys[1:]))
    assert invariant in {v.invariant for v in hv.validate(bad).violations}
    with pytest.raises(hv.HurrayFormatError):  # save still refuses it, now naming the field
        hv.save(bad, tmp_path / "bad.hrry")


@pytest.mark.parametrize("name", ["block_table", "seq_ptr"])
def test_a_large_two_dimensional_index_tensor_is_refused_not_saved_flattened(name: str, tmp_path: Path) -> None:
    """Over 4096 entries a 2-D block table validated, and was saved and loaded flattened."""
    pool = torch.zeros(5000, 1, 1, 2)
    t = hv.BlockPagedTensor(pool, torch.arange(5000), torch.tensor([0, 3000, 5000]), torch.tensor([3000, 2000]))
    assert t.validate().ok
    bad = replace(t, **{name: getattr(t, name).reshape(2, -1) if name == "block_table" else t.seq_ptr.view(1, -1)})
    assert [v.invariant for v in bad.validate().violations] == [f"{name}.dtype"]
