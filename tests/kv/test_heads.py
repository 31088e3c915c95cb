"""Joining snapshots split by KV heads (tensor-parallel ranks), including replicated heads (no engine)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import require
from synthetic import save_unchecked

import hurray_vllm as hv
from hurray_vllm.kv.heads import concat_heads, distinct_ranks, partitions, rank_heads, select_heads


def _shard(snap: hv.KVSnapshot, heads: range) -> hv.KVSnapshot:
    return select_heads(snap, heads)


def test_ranks_hold_runs_of_heads_or_replicas() -> None:
    assert [rank_heads(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert distinct_ranks(2, 4) == [0, 2] and distinct_ranks(1, 8) == [0]
    with pytest.raises(hv.HurrayFormatError):
        rank_heads(6, 4, 0)


@pytest.mark.parametrize(("heads", "tp"), [(2, 2), (4, 2), (2, 4), (1, 2)])
def test_joining_every_ranks_shard_gives_the_whole_snapshot_back(heads: int, tp: int) -> None:
    from synthetic import make_snapshot

    whole = make_snapshot([6, 3], [0, 1], 4, heads=heads, dim=8)
    shards = [_shard(whole, rank_heads(heads, tp, r)) for r in range(tp)]
    joined = concat_heads([shards[r] for r in distinct_ranks(heads, tp)])
    for x, y in zip(joined.tensors(), whole.tensors(), strict=True):
        assert torch.equal(x.page_pool, y.page_pool) and torch.equal(x.block_table, y.block_table)


def test_parts_of_another_batch_are_refused() -> None:
    from synthetic import make_snapshot

    a = make_snapshot([6, 3], [0, 1], 4, heads=2, dim=8)
    b = make_snapshot([5, 3], [0, 1], 4, heads=2, dim=8)
    with pytest.raises(hv.HurrayFormatError, match="another batch"):
        concat_heads([_shard(a, range(0, 1)), _shard(b, range(1, 2))])


def test_a_slice_says_which_heads_it_holds_and_round_trips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from synthetic import make_snapshot

    whole = make_snapshot([6, 3], [0, 1], 4, heads=4, dim=8)
    whole = replace(whole, fingerprint=hv.ModelFingerprint("Llama", 2, 4, 8, "bfloat16"))
    part = select_heads(whole, range(2, 4))
    assert part.heads == hv.HeadRange(2, 4, 4) and part.tensors()[0].num_heads == 2
    assert select_heads(whole, range(0, 4)).heads is None
    for ext in ("hrry", "hrrs", "safetensors"):
        hv.save(part, tmp_path / f"p.{ext}")
        assert hv.load(tmp_path / f"p.{ext}").heads == part.heads
    assert not replace(part, heads=hv.HeadRange(0, 3, 4)).validate().ok  # 3 heads claimed, 2 held
    assert not replace(part, heads=hv.HeadRange(0, 2, 8)).validate().ok  # the fingerprint says 4
    assert partitions(2) == [[range(0, 2)], [range(0, 1), range(1, 2)]]


def test_the_digest_covers_the_head_range() -> None:
    from synthetic import make_snapshot

    from hurray_vllm.chunks.digest import chunk_digest

    part = select_heads(make_snapshot([6, 3], [0, 1], 4, heads=4, dim=8), range(2, 4))
    assert chunk_digest(part) != chunk_digest(replace(part, heads=hv.HeadRange(0, 2, 4)))


def test_a_chunk_is_stored_only_when_files_hold_every_head(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from synthetic import make_snapshot

    from hurray_vllm.chunks.store import DirectoryStore, slice_key

    store = DirectoryStore(tmp_path)
    whole = make_snapshot([8], [0], 4, heads=4, dim=8)
    assert store.parts("0a", "0b", 4) is None
    store.put("0a", slice_key("0b", range(0, 2)), select_heads(whole, range(0, 2)))
    assert store.parts("0a", "0b", 4) is None  # half the heads: incomplete
    store.put("0a", slice_key("0b", range(2, 4)), select_heads(whole, range(2, 4)))
    parts = store.parts("0a", "0b", 4)
    assert parts is not None and [(p.name, p.heads) for p in parts] == [
        ("0b.h0-2", range(0, 2)),
        ("0b.h2-4", range(2, 4)),
    ]
    store.put("0a", "0b", whole)
    whole_parts = store.parts("0a", "0b", 4)
    assert whole_parts is not None and [p.name for p in whole_parts] == ["0b"]  # the whole file first


def test_store_snapshot_names_a_slice_as_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from synthetic import make_snapshot

    from hurray_vllm.chunks.store import DirectoryStore, store_snapshot

    snap = make_snapshot([8], [0], 4, heads=2, dim=8)
    snap = replace(snap, fingerprint=hv.ModelFingerprint("Llama", 2, 2, 8, "bfloat16"), token_ids=(tuple(range(8)),))
    store = DirectoryStore(tmp_path)
    assert store_snapshot(store, select_heads(snap, range(1, 2)), 4) == 2
    assert sorted(p.name for p in tmp_path.rglob("*.hrry")) == sorted([p.name for p in tmp_path.rglob("*.h1-2.hrry")])


def test_every_divisor_split_counts_and_mqa_is_never_a_slice(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """6 heads at TP 3 are stored as 3 slices of 2; one KV head (MQA) is whole on every rank."""
    from synthetic import make_snapshot

    from hurray_vllm.chunks.store import DirectoryStore, slice_key

    assert [len(p) for p in partitions(6)] == [1, 2, 3, 6]
    store = DirectoryStore(tmp_path)
    whole = make_snapshot([8], [0], 4, heads=6, dim=8)
    for r in range(3):
        heads = rank_heads(6, 3, r)
        store.put("0a", slice_key("0b", heads), select_heads(whole, heads))
    parts = store.parts("0a", "0b", 6)
    assert parts is not None and len(parts) == 3
    one = make_snapshot([8], [0], 4, heads=1, dim=8)
    assert concat_heads([replace(one, heads=hv.HeadRange(0, 1, 1))]).heads is None


def test_parallel_layouts_that_split_tokens_are_refused() -> None:
    from types import SimpleNamespace

    from hurray_vllm.adapters.vllm.cache import unsupported_parallelism

    assert unsupported_parallelism(SimpleNamespace(tensor_parallel_size=2)) is None
    assert unsupported_parallelism(SimpleNamespace(decode_context_parallel_size=2))[0] == "decode_context_parallel_size"  # type: ignore[index]
    ext = SimpleNamespace(tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    assert unsupported_parallelism(ext)[0] == "distributed_executor_backend"  # type: ignore[index]
    assert unsupported_parallelism(SimpleNamespace(pipeline_parallel_size=2))[0] == "pipeline_parallel_size"  # type: ignore[index]


@pytest.mark.parametrize("name", ["snapshot", "snapshot_ranks", "snapshot_stream"])
def test_snapshots_refuse_pipeline_parallelism_before_touching_the_engine(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each stage holds other layers: a snapshot of one would be a wrong model's KV, so none is taken."""
    import io
    from types import SimpleNamespace

    require("vllm")
    from hurray_vllm.adapters.vllm import engine

    parallel = SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel)))
    extra = {"snapshot_ranks": (tmp_path,), "snapshot_stream": (io.BytesIO(),)}.get(name, ())
    with pytest.raises(hv.HurrayFormatError) as exc:
        getattr(engine, name)(llm, ["a"], *extra)
    assert exc.value.field == "pipeline_parallel_size"


def test_prune_takes_a_chunks_slices_together(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os

    from synthetic import make_snapshot

    from hurray_vllm.chunks.store import DirectoryStore, slice_key

    store = DirectoryStore(tmp_path)
    whole = make_snapshot([8], [0], 4, heads=2, dim=8)
    for i, key in enumerate(("aa", "bb")):
        for heads in (range(0, 1), range(1, 2)):
            path = store.path("ab" * 8, slice_key(key, heads))  # a namespace's name, as prune takes it
            store.put("ab" * 8, slice_key(key, heads), select_heads(whole, heads))
            os.utime(path, (1000 + i, 1000 + i))  # "aa" used first
    one = sum(p.stat().st_size for p in tmp_path.rglob("bb.*"))
    store.prune(one)
    assert sorted(p.name for p in tmp_path.rglob("*.hrry")) == ["bb.h0-1.hrry", "bb.h1-2.hrry"]


def test_tp_snapshots_of_hybrids_whose_states_cannot_split_are_refused_before_any_worker_is_asked() -> None:
    """Unknown states, or KV heads that ranks do not share out evenly, are refused; replicated heads are fine."""
    from types import SimpleNamespace

    require("vllm")
    from hurray_vllm.adapters.vllm import engine

    class MambaSpec:  # what vLLM names a linear-attention group's spec; one rank's share at TP = 2
        def __init__(self, kind: str) -> None:
            self.mamba_type, self.mamba_cache_mode = kind, "align"
            self.shapes, self.dtypes = ((3, 24), (4, 2, 4)), (torch.bfloat16, torch.bfloat16)

    def llm(kind: str, kv_heads: int, tp: int) -> SimpleNamespace:
        config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=MambaSpec(kind), layer_names=["l0"])])
        scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(kv_cache_config=config))
        vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
            model_config=SimpleNamespace(get_total_num_kv_heads=lambda: kv_heads),
        )
        core = SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler))
        return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=vllm_config, engine_core=core))

    for kind, kv_heads, match in (("gdn_attn", 3, "not shared out evenly"), ("mamba2", 2, "not split across ranks")):
        with pytest.raises(hv.HurrayFormatError, match=match) as exc:
            engine._refuse_split_states(llm(kind, kv_heads, 2), "snapshots")
        assert exc.value.field == "tensor_parallel_size"
    engine._refuse_split_states(llm("gdn_attn", 2, 2), "snapshots")  # a gated delta net's states split
    engine._refuse_split_states(llm("gdn_attn", 1, 2), "snapshots")  # also with its KV head on both ranks
    with pytest.raises(hv.HurrayFormatError, match="use snapshot"):  # ... whose file would need both ranks' shares
        engine._refuse_split_states(llm("gdn_attn", 1, 2), "snapshot_ranks() files", per_rank=True)
    engine._refuse_split_states(llm("mamba2", 1, 1), "snapshots")  # at TP = 1 every state is whole: fine


@pytest.mark.parametrize(
    ("start", "stop", "total", "field"),
    [
        (3, 5, 4, "snapshot.heads.stop"),  # past the model's heads
        (0, 2, 1, "snapshot.heads.stop"),  # more heads than the model has
        (-1, 1, 4, "snapshot.heads.start"),  # before the first head
        (0, 2, 0, "snapshot.heads.total"),  # a model without heads
    ],
)
def test_validate_refuses_the_head_ranges_load_refuses(  # type: ignore[no-untyped-def]
    tmp_path, start: int, stop: int, total: int, field: str
) -> None:
    """What validate passes loads: a slice outside the model's heads is a violation in memory, as in the header."""
    from synthetic import make_snapshot

    snap = replace(make_snapshot([6, 3], [0, 1], 4, heads=2, dim=8), heads=hv.HeadRange(start, stop, total))
    assert field in [v.invariant for v in snap.validate().violations]
    with pytest.raises(hv.HurrayFormatError) as refused:
        hv.save(snap, tmp_path / "bad.hrry")  # nothing load refuses is written
    assert refused.value.field == field and not (tmp_path / "bad.hrry").exists()
    save_unchecked(snap, tmp_path / "bad.hrry")  # a writer that does not check: the reader refuses it
    with pytest.raises(hv.HurrayFormatError) as err:
        hv.load(tmp_path / "bad.hrry")
    assert err.value.field == field


def test_a_head_range_inside_the_model_validates_and_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from synthetic import make_snapshot

    snap = replace(make_snapshot([6, 3], [0, 1], 4, heads=2, dim=8), heads=hv.HeadRange(2, 4, 4))
    assert snap.validate().ok and hv.HeadRange(2, 4, 4).violations() == []
    hv.save(snap, tmp_path / "ok.hrry")
    assert hv.load(tmp_path / "ok.hrry").heads == hv.HeadRange(2, 4, 4)


def test_select_heads_takes_runs_of_consecutive_heads_only() -> None:
    from synthetic import make_snapshot

    whole = make_snapshot([6, 3], [0, 1], 4, heads=4, dim=8)
    for stepped in (range(0, 4, 2), range(1, 3, 5)):  # would have returned other heads than asked for
        with pytest.raises(hv.HurrayArgumentError, match="step 1"):
            select_heads(whole, stepped)
    with pytest.raises(hv.HurrayFormatError):
        rank_heads(0, 2, 0)  # was a ZeroDivisionError


def test_parts_of_other_sliding_windows_are_refused() -> None:
    """The joined snapshot keeps the first part's windows: a part that holds other tokens of a layer cannot join."""
    from synthetic import make_snapshot

    whole = make_snapshot([6, 3], [0, 1], 4, heads=2, dim=8)
    full = hv.SlidingWindows((None, None), ((0, 0), (0, 0)))
    windowed = hv.SlidingWindows((4, None), ((2, 0), (0, 0)))
    a, b = (_shard(replace(whole, windows=w), r) for w, r in ((full, range(0, 1)), (windowed, range(1, 2))))
    with pytest.raises(hv.HurrayFormatError, match="another batch or layout") as err:
        concat_heads([a, b])
    assert err.value.field == "snapshot.structure"
    assert concat_heads([a, replace(b, windows=full)]).windows == full


def test_rank_heads_refuses_a_tp_or_rank_out_of_range_as_the_callers_mistake() -> None:
    for tp, rank, field in ((0, 0, "tensor_parallel_size"), (2, 2, "rank"), (2, -1, "rank")):
        with pytest.raises(hv.HurrayArgumentError) as err:
            rank_heads(8, tp, rank)
        assert err.value.field == field and not isinstance(err.value, hv.HurrayFormatError)


def test_quantized_snapshots_are_not_split_or_joined_by_heads() -> None:
    """Per-channel scales would stay unsliced, and a join would keep part 0's: both refuse quantization."""
    from synthetic import make_snapshot

    from hurray_vllm.wire.descriptor import PerTensorAffine

    whole = make_snapshot([6, 3], [0, 1], 4, heads=2, dim=8)
    scales = torch.ones(2 * 8, dtype=torch.float32).view(torch.uint8)
    with_buffers = whole.with_layers(
        [tuple(replace(t, quant_buffers=(scales,)) for t in m) for m in whole.layer_members()]
    )
    q = PerTensorAffine(0.5)
    with_section = whole.with_layers([tuple(replace(t, quantization=q) for t in m) for m in whole.layer_members()])
    quantized = [with_buffers, with_section]
    for snap in quantized:
        with pytest.raises(hv.HurrayFormatError) as err:
            select_heads(snap, range(0, 1))
        assert err.value.field == "quantization"
        halves = [select_heads(whole, range(0, 1)), select_heads(whole, range(1, 2))]
        halves[1] = halves[1].with_layers(
            [
                tuple(replace(t, quant_buffers=(scales,), quantization=snap.tensors()[0].quantization) for t in m)
                for m in halves[1].layer_members()
            ]
        )
        with pytest.raises(hv.HurrayFormatError) as err:
            concat_heads(halves)
        assert err.value.field == "quantization"


def test_a_part_whose_pools_hold_other_heads_than_its_range_says_is_refused() -> None:
    """Joined anyway, the result held 5 heads under no head range, and validated."""
    from synthetic import make_snapshot

    three, two = (
        make_snapshot([6, 3], [0, 0], 4, heads=3, layers=2),
        make_snapshot([6, 3], [0, 0], 4, heads=2, layers=2),
    )
    for parts in (
        [replace(three, heads=hv.HeadRange(0, 2, 4)), replace(two, heads=hv.HeadRange(2, 4, 4))],
        [replace(two, heads=hv.HeadRange(0, 2, 4)), replace(three, heads=hv.HeadRange(2, 4, 4))],
        [replace(three, heads=hv.HeadRange(0, 2, 2))],
    ):
        with pytest.raises(hv.HurrayFormatError) as err:
            concat_heads(parts)
        assert err.value.field == "snapshot.heads"


@pytest.mark.parametrize("tp", [0, -2])
def test_distinct_ranks_of_no_ranks_is_the_callers_error_as_rank_heads_says(tp: int) -> None:
    """distinct_ranks(8, 0) returned [] ("no rank exports") where rank_heads names the argument."""
    with pytest.raises(hv.HurrayArgumentError) as err:
        distinct_ranks(8, tp)
    assert err.value.field == "tensor_parallel_size"


def test_parts_out_of_order_or_with_a_gap_are_refused() -> None:
    """Joined anyway, parts given backwards held heads 2..3 where 0..1 belong; gapped ones lost heads 2..3 unsaid."""
    from synthetic import make_snapshot

    whole = make_snapshot([6, 3], [0, 1], 4, heads=4, dim=8)
    low, high = select_heads(whole, range(0, 2)), select_heads(whole, range(2, 4))
    eight = make_snapshot([6, 3], [0, 1], 4, heads=8, dim=8)
    gapped = [select_heads(eight, range(0, 2)), select_heads(eight, range(4, 6))]
    for parts in ([high, low], gapped):
        with pytest.raises(hv.HurrayFormatError, match="not one run in order") as err:
            concat_heads(parts)
        assert err.value.field == "snapshot.heads"
    assert concat_heads([low, high]).heads is None  # in order: the whole snapshot


def test_select_heads_refuses_heads_past_the_slices_last() -> None:
    """A slice of heads 0..1 asked for 1..3 returned one head's pools marked as heads 1..3."""
    from synthetic import make_snapshot

    whole = make_snapshot([6, 3], [0, 1], 4, heads=4, dim=8)
    low = select_heads(whole, range(0, 2))
    for past in (range(1, 3), range(0, 3), range(2, 4)):
        with pytest.raises(hv.HurrayFormatError, match=r"outside 0\.\.2") as err:
            select_heads(low, past)
        assert err.value.field == "snapshot.heads"
    assert select_heads(low, range(1, 2)).heads == hv.HeadRange(1, 2, 4)
