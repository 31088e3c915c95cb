"""What the exporter refuses before it touches a cache, without an engine.

* ``request_states``: a request still loading its KV through a connector, and
  the committed tokens of a request under asynchronous scheduling (with
  speculative decoding the step in flight holds drafts).
* Block ids past a cache: found on the host before any gather or write (on
  CUDA such an id is a device-side assert, not an ``IndexError``).
* fp8 ``kv_scales`` that are not one pair per layer, and an MLA export without
  its ``LatentSplit``: refused before the first layer is gathered or written.
* Gather buffers a snapshot's layers would share, and the states of a
  sequence with nothing computed (zeros, whatever block it names).
"""

from __future__ import annotations

import enum
import importlib.util
import io
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import hurray_vllm as hv
from hurray_vllm import HurrayArgumentError, HurrayFormatError
from hurray_vllm.adapters.vllm.cache import EngineCache, write_blocks
from hurray_vllm.adapters.vllm.engine import request_states
from hurray_vllm.adapters.vllm.export import (
    SequenceState,
    export_layers,
    export_snapshot,
    export_stream,
    plan_batch,
)
from hurray_vllm.adapters.vllm.layouts import LogicalBHNC, MLALatent, Out
from hurray_vllm.adapters.vllm.states import StateCache

H, D, N = 2, 8, 16


class RequestStatus(enum.IntEnum):
    """The members of ``vllm.v1.request.RequestStatus`` used here (importing vLLM takes seconds)."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()


def test_vllm_names_the_status_as_the_engine_checks_it() -> None:
    """``request_states`` matches the status by name: vLLM's enum must still have it (read, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    source = (Path(next(iter(spec.submodule_search_locations))) / "v1" / "request.py").read_text()
    assert "    WAITING_FOR_REMOTE_KVS = enum.auto()" in source
    assert "self.num_output_placeholders = 0" in source


@dataclass
class FakeRequest:
    """The fields of a scheduler ``Request`` that ``request_states`` reads."""

    all_token_ids: list[int]
    num_computed_tokens: int
    num_output_placeholders: int = 0
    status: RequestStatus = RequestStatus.RUNNING
    finished: bool = False
    blocks: list[int] = field(default_factory=lambda: [1, 2, 3])

    def is_finished(self) -> bool:
        return self.finished


def _llm(requests: dict[str, FakeRequest]) -> Any:
    """An in-process ``vllm.LLM`` as far as ``request_states`` looks (one full-attention group)."""
    manager = SimpleNamespace(kv_cache_config=None, get_block_ids=lambda rid: (list(requests[rid].blocks),))
    core = SimpleNamespace(scheduler=SimpleNamespace(requests=requests, kv_cache_manager=manager))
    engine = SimpleNamespace(
        engine_core=SimpleNamespace(engine_core=core),
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(use_replayssm=False)),
        output_processor=SimpleNamespace(external_req_ids={}),
    )
    return SimpleNamespace(llm_engine=engine)


def test_a_request_still_loading_its_kv_is_refused() -> None:
    """vLLM allocates the blocks and counts the loading tokens as computed before the load ends."""
    loading = FakeRequest(list(range(40)), 32, status=RequestStatus.WAITING_FOR_REMOTE_KVS)
    llm = _llm({"ok": FakeRequest(list(range(20)), 19), "loading": loading})
    with pytest.raises(HurrayFormatError, match="still loading its KV") as info:
        request_states(llm, ["ok", "loading"])
    assert info.value.field == "request_id"
    assert "after its load finishes" in str(info.value)
    loading.status = RequestStatus.RUNNING  # the load finished
    assert [s.num_computed for s in request_states(llm, ["ok", "loading"])] == [19, 32]


@pytest.mark.parametrize(
    ("computed", "placeholders", "committed"),
    [
        (19, 0, 19),  # synchronous scheduling: the last sampled token has no KV yet
        (20, 1, 20),  # asynchronous: the step in flight computes the last sampled token
        (18, 0, 18),  # a prefill chunk (no placeholders)
        (23, 4, 20),  # asynchronous with 3 drafts in flight: they are not exported
        (22, 3, 20),  # 2 drafts scheduled in the step in flight
    ],
)
def test_the_committed_tokens_leave_out_drafts_in_flight(computed: int, placeholders: int, committed: int) -> None:
    """Between steps, asynchronous scheduling counts the step in flight; drafts are not in ``all_token_ids``."""
    req = FakeRequest(list(range(20)), computed, placeholders, blocks=[4, 5])
    (seq,) = request_states(_llm({"r": req}), ["r"])
    assert seq.num_computed == committed
    assert seq.token_ids == list(range(20))
    plan = plan_batch([seq], N)  # data the plan takes (it refused 23 computed tokens for 20 token ids)
    assert plan.seq_lens.tolist() == [committed]


def test_computed_tokens_the_placeholders_do_not_explain_are_refused() -> None:
    req = FakeRequest(list(range(20)), 30, 1)
    with pytest.raises(HurrayFormatError, match="30 computed tokens") as info:
        request_states(_llm({"r": req}), ["r"])
    assert info.value.field == "request_id"


# Block ids past the cache: refused on the host, before any gather or write.


class _Spy:
    """A layout that records the gathers it is asked for (mixed in before the layout's class)."""

    calls: list[int]

    def gather(
        self, cache: torch.Tensor | tuple[torch.Tensor, ...], block_ids: torch.Tensor, out: Out = None
    ) -> tuple[torch.Tensor, ...]:
        self.calls.append(int(block_ids.numel()))
        return super().gather(cache, block_ids, out)  # type: ignore[misc]


@dataclass(frozen=True)
class SpyBHNC(_Spy, LogicalBHNC):
    calls: list[int] = field(default_factory=list, compare=False, hash=False)


@dataclass(frozen=True)
class SpyLatent(_Spy, MLALatent):
    calls: list[int] = field(default_factory=list, compare=False, hash=False)


def _caches(*blocks: int, device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn((b, H, N, 2 * D), generator=gen).to(device) for b in blocks]


def test_the_plan_keeps_its_largest_block_id() -> None:
    seqs = [SequenceState("a", [3, 9, 2], 40, list(range(41))), SequenceState("b", [3, 7], 20, list(range(20)))]
    assert plan_batch(seqs, N).max_block == 9
    assert plan_batch([SequenceState("e", [], 0, [])], N).max_block == -1
    holes = plan_batch([SequenceState("w", [0, 0, 5], 40, list(range(40)))], N, holes=True)
    assert holes.max_block == 5


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_block_id_past_any_layer_is_refused_before_the_first_gather(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    caches = _caches(12, 6, device=device)  # block 8 lies in layer 0, past layer 1
    layout = SpyBHNC(D)
    plan = plan_batch([SequenceState("a", [3, 8], 20, list(range(21)))], N)
    with pytest.raises(HurrayFormatError, match="block id 8 outside this cache of 6 blocks") as info:
        next(export_layers(caches, layout, plan))
    assert info.value.field == "block_ids"
    assert layout.calls == []  # nothing gathered, not even layer 0
    assert len(list(export_layers(caches[:1], layout, plan))) == 1  # in range: gathered as before


def test_a_stream_with_a_block_id_past_a_layer_writes_nothing() -> None:
    f = io.BytesIO()
    layout = SpyBHNC(D)
    with pytest.raises(HurrayFormatError, match="layer 1"):
        export_stream(f, _caches(12, 6), layout, [SequenceState("a", [3, 8], 20, list(range(21)))], block_size=N)
    assert f.getvalue() == b"" and layout.calls == []


def _engine_cache(blocks: int) -> EngineCache:
    return EngineCache(
        caches=_caches(blocks),
        layer_names=["model.layers.0.self_attn.attn"],
        layout=LogicalBHNC(D),
        layout_name="vllm-LBHNC",
        storage_dtype=torch.float32,
        model_dtype=torch.float32,
        kv_cache_dtype="auto",
        kv_scales=None,
        fingerprint=hv.ModelFingerprint("LlamaForCausalLM", 1, H, D, "float32"),
        block_size=N,
        engine="vllm test",
    )


@pytest.mark.parametrize("ids", [[2, 6], [-1, 2]])
def test_write_blocks_refuses_blocks_outside_the_cache_before_writing(ids: list[int]) -> None:
    ec = _engine_cache(6)
    before = ec.caches[0].clone()
    keys, values = torch.ones((2, N, H, D)), torch.ones((2, N, H, D))
    with pytest.raises(HurrayFormatError, match="outside this cache's 6 blocks") as info:
        write_blocks(ec, 0, torch.tensor(ids), keys, values)
    assert info.value.field == "block_ids"
    assert torch.equal(ec.caches[0], before)  # not even block 2
    write_blocks(ec, 0, torch.tensor([2, 5]), keys, values)  # the last block is in range
    assert (ec.caches[0][5] == 1).all()


def _state_cache(blocks: int) -> StateCache:
    spec = hv.RecurrentStates(
        "gdn_attn", (0,), ("conv", "ssm"), (), declared=(((3, 8), "float32"), ((2, 4, 4), "float32"))
    )
    tensors = ((torch.randn(blocks, 3, 8), torch.randn(blocks, 2, 4, 4)),)
    return StateCache(spec, ("model.layers.0.linear_attn",), (1,), tensors, ("", ""), N, "align")


def test_state_gather_refuses_a_block_outside_the_states_on_the_host() -> None:
    sc = _state_cache(5)
    with pytest.raises(HurrayFormatError, match="state block 5 of KV cache group 1 is outside its 5 blocks") as info:
        sc.gather([{1: 2}, {1: 5}], [16, 16])
    assert info.value.field == "block_ids"
    got = sc.gather([{1: 2}, {1: 4}], [16, 16])
    assert torch.equal(got.tensors[0][0][1], sc.tensors[0][0][4])


@pytest.mark.parametrize("bad", [5, -1])
def test_state_write_refuses_a_block_outside_the_states_before_writing(bad: int) -> None:
    sc = _state_cache(5)
    states = sc.gather([{1: 2}, {1: 3}], [16, 16])
    before = [t.clone() for t in sc.tensors[0]]
    with pytest.raises(
        HurrayFormatError, match=f"state block {bad} of KV cache group 1 is outside its 5 blocks"
    ) as info:
        sc.write([{1: [1]}, {1: [bad]}], states)
    assert info.value.field == "block_ids"
    assert all(torch.equal(t, b) for t, b in zip(sc.tensors[0], before, strict=True))  # not even block 1
    sc.write([{1: [1]}, {1: [4]}], states)  # the last block is in range
    assert torch.equal(sc.tensors[0][0][4], states.tensors[0][0][1])


# kv_scales and the LatentSplit: checked before any work.


def test_kv_scales_of_another_layer_count_are_refused_before_the_stream_is_written() -> None:
    f = io.BytesIO()
    layout = SpyBHNC(D)
    seqs = [SequenceState("a", [3], 10, list(range(11)))]
    with pytest.raises(HurrayArgumentError, match="1 \\(k_scale, v_scale\\) pairs for 2 layers") as info:
        export_stream(f, _caches(6, 6), layout, seqs, block_size=N, kv_scales=[(1.0, 1.0)])
    assert info.value.field == "kv_scales"
    assert f.getvalue() == b"" and layout.calls == []
    with pytest.raises(HurrayArgumentError, match="3 \\(k_scale, v_scale\\) pairs for 2 layers"):
        export_snapshot(_caches(6, 6), layout, seqs, block_size=N, kv_scales=[(1.0, 1.0)] * 3)
    assert layout.calls == []


def test_an_mla_stream_without_its_latent_split_is_refused_before_any_gather() -> None:
    f = io.BytesIO()
    layout = SpyLatent(24)
    caches = [torch.zeros((6, N, 24)) for _ in range(2)]
    with pytest.raises(HurrayFormatError, match="LatentSplit") as info:
        export_stream(f, caches, layout, [SequenceState("a", [3], 10, list(range(11)))], block_size=N)
    assert info.value.field == "latent"
    assert f.getvalue() == b"" and layout.calls == []


def test_a_sequence_with_nothing_computed_gets_zero_states_whatever_block_it_names() -> None:
    """Before, only block id 0 gave zeros: a real block at position 0 handed out what it held (maybe another
    request's state) as the state of an empty prefix."""
    sc = _state_cache(5)
    got = sc.gather([{1: 3}, {1: 4}], [0, 16])
    conv, ssm = got.tensors[0]
    assert not conv[0].any() and not ssm[0].any()
    assert torch.equal(conv[1], sc.tensors[0][0][4]) and torch.equal(ssm[1], sc.tensors[0][1][4])
    assert sc.tensors[0][0][3].any()  # the block held a state: it was left out, not missing


# Gather buffers: a snapshot keeps every layer, so layers must not share them.


@pytest.mark.parametrize("how", ["one", "short", "repeated"])
def test_a_snapshot_refuses_buffers_its_layers_would_share(how: str) -> None:
    """Before, one GatherBuffers (which a stream may share between layers) made every layer alias the last."""
    from hurray_vllm.adapters.vllm.export import GatherBuffers

    layout = SpyBHNC(D)
    shared = GatherBuffers()
    buffers: Any = {"one": shared, "short": [GatherBuffers()], "repeated": [shared, shared]}[how]
    seqs = [SequenceState("a", [3], 10, list(range(11)))]
    with pytest.raises(HurrayArgumentError, match="for 2 layers") as info:
        export_snapshot(_caches(6, 6), layout, seqs, block_size=N, buffers=buffers)
    assert info.value.field == "buffers" and layout.calls == []
    caches = _caches(6, 6)
    snap = export_snapshot(caches, layout, seqs, block_size=N, buffers=[GatherBuffers(), GatherBuffers()])
    want = export_snapshot(caches, layout, seqs, block_size=N)
    assert all(torch.equal(snap[i, "key"].page_pool, want[i, "key"].page_pool) for i in range(2))


# The plan's block size: it must be the cache's page size, or pages are cut across blocks.


@pytest.mark.parametrize("block_size", [N // 2, 2 * N])
def test_a_plan_of_another_block_size_than_the_cache_pages_is_refused_before_any_gather(block_size: int) -> None:
    """Before, blocks of 8 over pages of 16 exported whole pages (other blocks' slots) under a table of 8-token
    blocks, silently: the snapshot held another request's KV and read back its own tokens at the wrong slots."""
    layout = SpyBHNC(D)
    seqs = [SequenceState("a", [3, 4, 5], 20, list(range(21)))]  # blocks enough for 8 tokens each
    plan = plan_batch(seqs, block_size)
    with pytest.raises(HurrayFormatError, match=f"blocks of {block_size} tokens, layer 0's cache pages hold {N}") as e:
        next(export_layers(_caches(6, 6), layout, plan))
    assert e.value.field == "block_size" and layout.calls == []
    with pytest.raises(HurrayFormatError, match="block_size"):
        export_snapshot(_caches(6, 6), layout, seqs, block_size=block_size)
    f = io.BytesIO()
    with pytest.raises(HurrayFormatError, match="block_size"):
        export_stream(f, _caches(6, 6), layout, seqs, block_size=block_size)
    assert f.getvalue() == b"" and layout.calls == []
    assert len(export_snapshot(_caches(6, 6), layout, seqs, block_size=N).tensors()) == 4  # the pages' own: as before


def test_a_layer_whose_pages_hold_another_block_size_is_refused_before_the_first_gather() -> None:
    """Layer 1's pages of 32 tokens under the plan of blocks of 16 the first layer's pages hold."""
    layout = SpyBHNC(D)
    caches = [_caches(6)[0], torch.zeros((6, H, 2 * N, 2 * D))]
    plan = plan_batch([SequenceState("a", [3], 10, list(range(11)))], N)
    with pytest.raises(HurrayFormatError, match=f"layer 1's cache pages hold {2 * N}") as info:
        next(export_layers(caches, layout, plan))
    assert info.value.field == "block_size" and layout.calls == []
