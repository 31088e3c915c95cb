"""``snapshot()`` and its workers without an engine: replies, which ranks ship KV, in-process workers, refusals.

* Every rank answers every call, whatever it raised: vLLM's
  multiprocessing executor reads the ranks' replies in rank order and raises
  at the first failure, leaving the later ranks' replies queued for the next
  call, which would then join one call's KV with another's.
* At tensor parallelism > 1 a rank whose KV heads another rank exports (a
  replica, an MLA latent, a single KV head) ships only its share of a
  linear-attention hybrid's states, or nothing; the joined snapshot is the
  same as the TP = 1 export.
* Whether the worker runs in this process is the executor's (vLLM's
  ``UniProcExecutor`` holds it as ``driver_worker``), not the TP size's: at
  TP = 1 with the ``"mp"`` backend no cache tensors are pickled over.
* Layer groups come from the worker's ``kv_cache_config``, which alone lists
  the layers that share another layer's KV.
* Refusals: a preempted request (its KV was freed), a ``str`` of ids, an
  unsupported model before any worker is asked (``snapshot_stream`` too).
* The AMX warm-up prompt is shorter than one block, whatever the block size.

The executors are faked as vLLM 0.32 runs them (``multiproc_executor.py``:
one reply queue per rank, read in rank order; ``uniproc_executor.py``: the
function called on the one worker, nothing pickled).
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import hurray_vllm as hv
from hurray_vllm import HurrayArgumentError, HurrayFormatError
from hurray_vllm.adapters.vllm import engine
from hurray_vllm.adapters.vllm.cache import EngineCache
from hurray_vllm.adapters.vllm.export import SequenceState, export_snapshot
from hurray_vllm.adapters.vllm.layouts import LogicalBHNC, MLALatent
from hurray_vllm.containers.io import read_stream
from hurray_vllm.kv.heads import distinct_ranks, rank_heads
from hurray_vllm.kv.snapshot import KVSnapshot

# Executors.

_RANK = {"now": 0}  # the rank whose worker the fake executor is running (engine._tp_rank, patched)


@pytest.fixture(autouse=True)
def _ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "_tp_rank", lambda: _RANK["now"])


class MultiprocRanks:
    """``LLM.collective_rpc`` as vLLM 0.32's ``MultiprocExecutor`` runs it over ``len(workers)`` ranks.

    Each rank puts its reply (pickled) on its own queue; the driver reads the
    queues in rank order and raises at the first failed reply, leaving the
    other ranks' replies queued: the next call reads those first.
    """

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.queues: list[collections.deque[tuple[bool, Any]]] = [collections.deque() for _ in workers]
        self.replies: list[list[Any]] = []  # each call's replies, as they crossed the process boundary
        self.sizes: list[list[int]] = []  # ... and their pickled sizes

    def __call__(
        self, method: Callable[..., Any], timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> list[Any]:
        replies, sizes = [], []
        for rank, (worker, queue) in enumerate(zip(self.workers, self.queues)):
            _RANK["now"] = rank
            try:
                data = pickle.dumps(method(worker, *args, **(kwargs or {})))
                sizes.append(len(data))
                replies.append(pickle.loads(data))
                queue.append((True, replies[-1]))
            except Exception as exc:
                queue.append((False, f"{type(exc).__name__}: {exc}"))
        self.replies.append(replies)
        self.sizes.append(sizes)
        out = []
        for queue in self.queues:
            ok, reply = queue.popleft()
            if not ok:
                raise RuntimeError(f"Worker failed with error '{reply}', please check the stack trace above")
            out.append(reply)
        return out


class UniProc:
    """vLLM 0.32's ``UniProcExecutor``: the worker in this process, its ``driver_worker``; nothing pickled."""

    def __init__(self, worker: Any) -> None:
        self.driver_worker = SimpleNamespace(worker=worker)
        self.worker = worker
        self.calls: list[str] = []

    def __call__(
        self, method: Callable[..., Any], timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> list[Any]:
        _RANK["now"] = 0
        self.calls.append(getattr(args[0], "__name__", "?") if args else "?")
        return [method(self.worker, *args, **(kwargs or {}))]


# An engine as far as snapshot() looks.


class FullAttentionSpec:
    pass


class SlidingWindowSpec:
    sliding_window = 32


def _groups(*layers: list[str]) -> Any:
    """A KVCacheConfig of a full-attention group and a sliding-window one, holding ``layers``."""
    specs = [FullAttentionSpec(), SlidingWindowSpec()]
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=specs[g], layer_names=n) for g, n in enumerate(layers)]
    )


@dataclass
class Request:
    """The fields of a scheduler ``Request`` that ``request_states`` and ``request_seed`` read."""

    all_token_ids: list[int]
    num_computed_tokens: int
    blocks: tuple[list[int], ...] = ([1, 2],)
    status: Any = field(default_factory=lambda: SimpleNamespace(name="RUNNING"))
    num_output_placeholders: int = 0
    cache_salt: str | None = None
    mm_features: list[Any] = field(default_factory=list)

    def is_finished(self) -> bool:
        return False


def _vllm_config(heads: int = 2, tp: int = 1, layers: int = 2, *, mla: bool = False, backend: str = "uni") -> Any:
    return SimpleNamespace(
        cache_config=SimpleNamespace(use_replayssm=False, block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, distributed_executor_backend=backend),
        model_config=SimpleNamespace(
            use_mla=mla,
            is_hybrid=False,
            get_total_num_kv_heads=lambda: heads,
            get_num_layers=lambda pc: layers,
            hf_config=SimpleNamespace(kv_lora_rank=32, qk_rope_head_dim=16, model_type="deepseek_v3"),
        ),
    )


def _llm(requests: dict[str, Request], rpc: Any, vllm_config: Any, *, kv_cache_config: Any = None) -> Any:
    """An engine core in this process; its executor is ``rpc`` (in-process where it has a ``driver_worker``)."""
    manager = SimpleNamespace(kv_cache_config=kv_cache_config, get_block_ids=lambda rid: requests[rid].blocks)
    scheduler = SimpleNamespace(requests=requests, kv_cache_manager=manager, connector=None)
    core = SimpleNamespace(scheduler=scheduler, model_executor=rpc)
    llm_engine = SimpleNamespace(
        engine_core=SimpleNamespace(engine_core=core),
        vllm_config=vllm_config,
        output_processor=SimpleNamespace(external_req_ids={}, request_states={}),
    )
    return SimpleNamespace(llm_engine=llm_engine, collective_rpc=rpc)


def _kv_cache(heads: int, layers: int = 2, d: int = 4, bs: int = 16, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(8, heads, bs, 2 * d, generator=gen) for _ in range(layers)]


def _engine_cache(caches: list[torch.Tensor], heads: int, *, states: Any = None, names: list[str] | None = None) -> Any:
    d = int(caches[0].shape[-1]) // 2
    return EngineCache(
        caches=caches,
        layer_names=names or [f"l{i}" for i in range(len(caches))],
        layout=LogicalBHNC(d),
        layout_name="vllm-LBNHC",
        storage_dtype=torch.float32,
        model_dtype=torch.float32,
        kv_cache_dtype="auto",
        kv_scales=None,
        fingerprint=hv.ModelFingerprint("X", len(caches), heads, d, "float32", "digest"),
        block_size=int(caches[0].shape[2]),
        engine="vllm test",
        states=states,
    )


def _worker(ec: Any, vllm_config: Any, kv_cache_config: Any = None) -> Any:
    return SimpleNamespace(
        ec=ec, vllm_config=vllm_config, model_runner=SimpleNamespace(kv_cache_config=kv_cache_config)
    )


@pytest.fixture
def described(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each fake worker's ``_describe`` is the EngineCache it holds."""
    monkeypatch.setattr(engine, "_describe", lambda worker: worker.ec)


# 1. Every rank answers.


def test_every_rank_answers_a_call_in_which_one_rank_raised_another_exception() -> None:
    """A MemoryError on rank 0 fails that call; the next calls join their own ranks' replies, not stale ones."""
    calls = {"n": 0}

    def part(worker: Any) -> str:
        if worker.rank == 0 and calls["n"] == 0:
            raise MemoryError("could not allocate the gather buffers")
        return f"call {calls['n']} rank {worker.rank}"

    rpc = MultiprocRanks([SimpleNamespace(rank=r) for r in range(3)])
    llm = SimpleNamespace(collective_rpc=rpc)
    with pytest.raises(RuntimeError) as info:
        engine._raise_failed(engine._rpc(llm, part))
    assert str(info.value) == "rank 0: MemoryError: could not allocate the gather buffers"
    assert info.value.__notes__[0] == "(raised on worker 0)"
    assert "MemoryError" in info.value.__notes__[-1]  # the worker's traceback, which vLLM would have logged
    for n in (1, 2):
        calls["n"] = n
        assert engine._rpc(llm, part) == [f"call {n} rank {r}" for r in range(3)]


def test_a_worker_error_in_this_process_is_raised_as_it_was_raised() -> None:
    """In-process (TP = 1, nothing pickled): the worker's own exception, as before; out of process, text only."""

    def fails(worker: Any) -> None:
        raise KeyError("l7")

    llm = SimpleNamespace(collective_rpc=UniProc(SimpleNamespace()))
    with pytest.raises(KeyError, match="l7") as info:
        engine._raise_failed(engine._rpc(llm, fails))
    assert info.value.__notes__ == ["(raised on worker 0)"]
    llm = SimpleNamespace(collective_rpc=MultiprocRanks([SimpleNamespace(), SimpleNamespace()]))
    with pytest.raises(RuntimeError) as rebuilt:
        engine._raise_failed(engine._rpc(llm, fails))
    assert str(rebuilt.value) == "rank 0: KeyError: 'l7'"


def test_interrupts_and_exits_on_a_worker_are_not_turned_into_replies() -> None:
    for exc in (KeyboardInterrupt(), SystemExit(3)):

        def raises(worker: Any, exc: BaseException = exc) -> None:
            raise exc

        with pytest.raises(type(exc)):
            engine._on_worker(SimpleNamespace(), raises)


# 2. Ranks whose heads another rank exports ship no KV.


def _whole_states(positions: tuple[int, ...]) -> hv.RecurrentStates:
    gen = torch.Generator().manual_seed(0)
    conv = torch.randn(len(positions), 3, 2 * 4 * 3 + 4 * 3, generator=gen).to(torch.bfloat16)
    layers = tuple((conv + j, torch.randn(len(positions), 4, 3, 3, generator=gen)) for j in range(2))
    return hv.RecurrentStates("gdn_attn", (0, 1), ("conv", "ssm"), positions, layers, attention=(2, 3))


def _state_cache(share: hv.RecurrentStates | None) -> Any:
    """A StateCache as far as ``engine._states`` reads it: its gather gives this rank's share."""
    return None if share is None else SimpleNamespace(state_group_ids=(), gather=lambda blocks, positions: share)


_SEQS = [SequenceState("a", [1, 2], 20, list(range(21))), SequenceState("b", [1, 3, 4], 40, list(range(41)))]


@pytest.mark.parametrize("with_states", [True, False], ids=["states", "no-states"])
@pytest.mark.parametrize(("heads", "tp"), [(4, 2), (2, 4), (1, 2), (4, 4)])
def test_ranks_whose_heads_another_rank_exports_ship_no_kv(
    heads: int, tp: int, with_states: bool, described: None
) -> None:
    """Replicas (2 heads over 4 ranks) and a single KV head: their ranks send their states' share, or nothing."""
    caches = _kv_cache(heads)
    whole_states = _whole_states((20, 40)) if with_states else None
    tp1 = _engine_cache(caches, heads, states=_state_cache(whole_states))
    want = export_snapshot(caches, tp1.layout, _SEQS, **tp1.export_options(), states=whole_states)
    workers = []
    for r in range(tp):
        h = rank_heads(heads, tp, r)
        share = whole_states.take(r, r + 1, tp) if whole_states is not None else None
        ec = _engine_cache([c[:, h.start : h.stop].contiguous() for c in caches], heads, states=_state_cache(share))
        workers.append(_worker(ec, _vllm_config(heads, tp, backend="mp")))
    rpc = MultiprocRanks(workers)
    got = engine._snapshot_tp(SimpleNamespace(collective_rpc=rpc), _SEQS)

    assert all(torch.equal(a.page_pool, b.page_pool) for a, b in zip(got.tensors(), want.tensors(), strict=True))
    assert got.heads is None and got.num_layers == want.num_layers
    if with_states:
        assert got.states is not None and want.states is not None and got.states.part is None
        for a, b in zip(got.states.tensors, want.states.tensors, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    else:
        assert got.states is None
    (replies,) = rpc.replies
    writers = distinct_ranks(heads, tp)
    for rank, (r, reply) in enumerate(replies):
        assert r == rank
        if rank in writers:
            assert isinstance(reply, KVSnapshot)
        else:  # its heads are another rank's: no KV crossed over
            assert not isinstance(reply, KVSnapshot)
            assert (reply is None) != with_states
    (sizes,) = rpc.sizes
    assert all(sizes[r] < min(sizes[w] for w in writers) for r in range(tp) if r not in writers)


def test_an_mla_latent_is_shipped_by_rank_0_alone(described: None) -> None:
    """Every rank holds the whole latent: the other ranks answer with nothing."""
    split = hv.LatentSplit(32, 16, "deepseek_v3")
    gen = torch.Generator().manual_seed(2)
    caches = [torch.randn(8, 16, split.head_dim, generator=gen).to(torch.bfloat16) for _ in range(2)]
    ec = EngineCache(
        caches=caches,
        layer_names=["l0", "l1"],
        layout=MLALatent(split.head_dim),
        layout_name="vllm-mla",
        storage_dtype=torch.bfloat16,
        model_dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        kv_scales=None,
        fingerprint=hv.ModelFingerprint("DeepseekV3ForCausalLM", 2, 1, split.head_dim, "bfloat16"),
        block_size=16,
        engine="vllm test",
        latent=split,
    )
    want = export_snapshot(caches, ec.layout, _SEQS, **ec.export_options())
    rpc = MultiprocRanks([_worker(ec, _vllm_config(1, 2, mla=True, backend="mp")) for _ in range(2)])
    got = engine._snapshot_tp(SimpleNamespace(collective_rpc=rpc), _SEQS)
    assert got.is_latent and all(torch.equal(a.page_pool, b.page_pool) for a, b in zip(got.tensors(), want.tensors()))
    assert [r for r, _ in rpc.replies[0]] == [0, 1] and rpc.replies[0][1][1] is None


# 3. In this process or not: the executor says, not the TP size.


def test_at_tp_1_with_workers_in_other_processes_the_ranks_export_and_no_cache_is_pickled(described: None) -> None:
    """distributed_executor_backend="mp" at TP = 1: the worker exports; engine_cache() refuses (its tensors)."""
    caches = _kv_cache(2)
    ec = _engine_cache(caches, 2)
    rpc = MultiprocRanks([_worker(ec, _vllm_config(2, 1, backend="mp"))])
    llm = _llm({"a": Request(list(range(21)), 20)}, rpc, _vllm_config(2, 1, backend="mp"))
    snap = engine.snapshot(llm, ["a"])
    want = export_snapshot(caches, ec.layout, engine.request_states(llm, ["a"]), **ec.export_options())
    assert all(torch.equal(a.page_pool, b.page_pool) for a, b in zip(snap.tensors(), want.tensors(), strict=True))
    assert all(not isinstance(reply, EngineCache) for call in rpc.replies for _, reply in call)
    assert max(max(s) for s in rpc.sizes) < sum(c.numel() * c.element_size() for c in caches)
    with pytest.raises(HurrayFormatError, match="in processes of their own") as info:
        engine.engine_cache(llm)
    assert info.value.field == "distributed_executor_backend"
    out = io.BytesIO()
    assert engine.snapshot_stream(llm, ["a"], out) == len(out.getvalue()) > 0
    streamed = read_stream(io.BytesIO(out.getvalue()))
    assert all(torch.equal(a.page_pool, b.page_pool) for a, b in zip(streamed.tensors(), want.tensors(), strict=True))


def test_in_process_workers_are_described_here(described: None) -> None:
    """UniProcExecutor: engine_cache() returns the worker's own tensors (no copy)."""
    caches = _kv_cache(2)
    uni = UniProc(_worker(_engine_cache(caches, 2), _vllm_config(2, 1)))
    llm = _llm({"a": Request(list(range(21)), 20)}, uni, _vllm_config(2, 1))
    assert engine.engine_cache(llm).caches[0] is caches[0]
    assert engine.snapshot(llm, ["a"]).num_layers == 2


# 5. Layers that share another layer's KV: in the worker's groups only.


def test_tp_1_groups_layers_by_the_workers_kv_cache_config(described: None) -> None:
    """vLLM adds layers that reuse another layer's KV to the worker's copy of the groups, not the scheduler's."""
    names = [f"l{i}" for i in range(6)]  # l4 and l5 reuse l2's and l3's KV
    scheduler = _groups(["l0", "l2"], ["l1", "l3"])
    worker_groups = _groups(["l0", "l2", "l4"], ["l1", "l3", "l5"])
    caches = _kv_cache(2, layers=6)
    ec = _engine_cache(caches, 2, names=names)
    config = _vllm_config(2, 1, layers=6)
    llm = _llm(
        {"a": Request(list(range(41)), 40, blocks=([1, 2, 3], [0, 4, 5]))},
        UniProc(_worker(ec, config, worker_groups)),
        config,
        kv_cache_config=scheduler,
    )
    snap = engine.snapshot(llm, ["a"])
    assert snap.num_layers == 6
    out = io.BytesIO()
    assert engine.snapshot_stream(llm, ["a"], out) > 0
    seqs = engine.request_states(llm, ["a"])
    want = export_snapshot(
        caches, ec.layout, seqs, **ec.export_options(), layer_groups=[0, 1] * 3, group_windows=(None, 32)
    )
    assert all(torch.equal(a.page_pool, b.page_pool) for a, b in zip(snap.tensors(), want.tensors(), strict=True))


# 4, 6, 13. Refusals.


def test_a_preempted_request_is_refused() -> None:
    """vLLM freed its blocks and set num_computed_tokens to 0: exported, it would be silently empty."""
    preempted = Request(list(range(300)), 0, blocks=([],), status=SimpleNamespace(name="PREEMPTED"))
    llm = _llm({"r": preempted, "ok": Request([1, 2, 3], 2)}, UniProc(SimpleNamespace()), _vllm_config())
    with pytest.raises(HurrayFormatError, match="was preempted") as info:
        engine.request_states(llm, ["ok", "r"])
    assert info.value.field == "request_id" and "after it resumes" in str(info.value)
    preempted.status, preempted.num_computed_tokens, preempted.blocks = SimpleNamespace(name="RUNNING"), 16, ([3],)
    assert [s.num_computed for s in engine.request_states(llm, ["ok", "r"])] == [2, 16]  # resumed


def test_a_string_of_request_ids_is_refused() -> None:
    llm = _llm({"ab": Request([1, 2, 3], 2)}, UniProc(SimpleNamespace()), _vllm_config())
    for call in (
        lambda: engine.request_states(llm, "ab"),
        lambda: engine.snapshot(llm, "ab"),
        lambda: engine.snapshot_stream(llm, "ab", io.BytesIO()),
    ):
        with pytest.raises(HurrayArgumentError, match=r"\['ab'\]") as info:
            call()
        assert info.value.field == "request_ids"
    assert [s.request_id for s in engine.request_states(llm, ["ab"])] == ["ab"]


@pytest.mark.parametrize("name", ["snapshot", "snapshot_stream"])
def test_an_unsupported_model_is_refused_before_any_worker_is_asked(name: str) -> None:
    class CrossAttentionSpec:
        pass

    def rpc(fn: Any, timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: Any = None) -> list[Any]:
        raise AssertionError("a worker was asked")

    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=CrossAttentionSpec(), layer_names=["x"])])
    llm = _llm({"r": Request([1, 2, 3], 2)}, rpc, _vllm_config(), kv_cache_config=config)
    args = (io.BytesIO(),) if name == "snapshot_stream" else ()
    with pytest.raises(HurrayFormatError, match="CrossAttentionSpec") as info:
        getattr(engine, name)(llm, ["r"], *args)
    assert info.value.field == "kv_cache_groups"


# 9. The warm-up prompt.


@pytest.mark.parametrize(("block_size", "tokens"), [(16, 15), (32, 16), (128, 16), (8, 7), (6, 5)])
def test_the_warm_up_prompt_is_shorter_than_a_block(
    monkeypatch: pytest.MonkeyPatch, block_size: int, tokens: int
) -> None:
    """A full block would be cached (and saved by a connector) as if it were a request's."""
    pytest.importorskip("vllm")
    from hurray_vllm.adapters.vllm import _generate, layouts

    prompts: list[Any] = []
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(cache_config=SimpleNamespace(block_size=block_size))),
        generate=lambda p, params, use_tqdm: prompts.extend(p),
    )
    monkeypatch.setattr(layouts, "cpu_has_amx", lambda: True)
    _generate.warm_up(llm)
    (prompt,) = prompts
    assert len(prompt["prompt_token_ids"]) == tokens < block_size
    assert len(prompt["prompt_token_ids"]) > 4  # what the AMX kernel's first call needs


def test_a_rank_that_should_have_exported_heads_and_did_not_is_named(described: None) -> None:
    """Workers whose configs disagree with the model's (a rank that thinks itself a replica): refused, not joined."""
    caches = _kv_cache(4)
    workers = []
    for r in range(2):
        h = rank_heads(4, 2, r)
        ec = _engine_cache([c[:, h.start : h.stop].contiguous() for c in caches], 4)
        workers.append(_worker(ec, _vllm_config(4 if r == 0 else 1, 2, backend="mp")))  # rank 1: "1 KV head"
    with pytest.raises(HurrayFormatError, match=r"ranks \[1\] exported none") as info:
        engine._snapshot_tp(SimpleNamespace(collective_rpc=MultiprocRanks(workers)), _SEQS)
    assert info.value.field == "tensor_parallel_size"
