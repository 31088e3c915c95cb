"""``snapshot()``'s API without an engine: key seeds after a cache reset, workers' errors, ``n > 1``.

* The chunk key seeds a snapshot records come from the engine's
  HurrayConnector: after a cache reset (a weight update) they carry the
  reset's epoch, and a request holding KV from before it has none.
* At tensor parallelism > 1 a worker's error reaches the caller as the
  worker raised it (vLLM's multiprocessing executor passes exceptions on as
  strings), and ``snapshot_ranks`` removes the files the other ranks wrote.
* A request of ``n > 1`` sampling is refused, also once one child is left.

The engine is faked (no vLLM engine starts here); its workers are faked as
vLLM's multiprocessing executor runs them: every rank runs, each answer is
pickled, and an exception becomes ``RuntimeError("Worker failed ...")``.
"""

from __future__ import annotations

import errno
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from synthetic import make_snapshot

import hurray_vllm as hv
from hurray_vllm import HurrayArgumentError, HurrayFormatError
from hurray_vllm.adapters.vllm import engine
from hurray_vllm.chunks.keys import KEY_SEEDS, key_seed
from hurray_vllm.errors import ImportArgumentError, Violation


@dataclass
class FakeRequest:
    """The fields of a scheduler ``Request`` that ``snapshot`` and ``request_seed`` read."""

    all_token_ids: list[int]
    num_computed_tokens: int
    num_output_placeholders: int = 0
    cache_salt: str | None = None
    mm_features: list[Any] = field(default_factory=list)
    blocks: list[int] = field(default_factory=lambda: [1, 2])
    request_id: str = ""  # set by _llm: the id the scheduler holds it under

    def is_finished(self) -> bool:
        return False


def _llm(
    requests: dict[str, FakeRequest],
    *,
    connector: Any = None,
    tp: int = 1,
    external: dict[str, list[str]] | None = None,
    states: dict[str, Any] | None = None,
    worker_rpc: Callable[..., list[Any]] | None = None,
) -> Any:
    """An in-process ``vllm.LLM`` as far as ``snapshot`` looks (one full-attention group)."""
    for rid, r in requests.items():
        r.request_id = rid
    manager = SimpleNamespace(kv_cache_config=None, get_block_ids=lambda rid: (list(requests[rid].blocks),))
    scheduler = SimpleNamespace(requests=requests, kv_cache_manager=manager, connector=connector)
    config = SimpleNamespace(
        cache_config=SimpleNamespace(use_replayssm=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        model_config=SimpleNamespace(is_hybrid=False, get_num_layers=lambda pc: 2),
    )
    llm_engine = SimpleNamespace(
        engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler)),
        vllm_config=config,
        output_processor=SimpleNamespace(external_req_ids=external or {}, request_states=states or {}),
    )
    return SimpleNamespace(llm_engine=llm_engine, collective_rpc=worker_rpc)


def _connector(epoch: str | None, seeds: dict[str, str | None]) -> Any:
    """A HurrayConnector's scheduler role as far as a snapshot reads it: its namespace, epoch, requests' seeds."""
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler

    part = HurrayScheduler.__new__(HurrayScheduler)  # the state seed_of() reads, without an engine's config
    part._ns, part._epoch = "ns", epoch
    part._reqs = {rid: SimpleNamespace(seed=seed) for rid, seed in seeds.items()}  # type: ignore[misc]
    return SimpleNamespace(_scheduler=part)


# Key seeds after a cache reset.


def test_the_seeds_after_a_reset_are_the_connectors() -> None:
    """A request computed since the reset has its epoch in its seed; one holding KV from before has none."""
    new, old, unseen = FakeRequest(list(range(20)), 19), FakeRequest(list(range(30)), 29), FakeRequest([1, 2], 0)
    epoch_seed = key_seed("ns", epoch="e1")
    connector = _connector("e1", {"new": epoch_seed, "old": None})  # reset_cache set "old"'s seed to None
    llm = _llm({"new": new, "old": old, "unseen": unseen}, connector=connector)
    seeds = engine._key_seeds(llm, ["new", "old", "unseen"])
    # "unseen": not yet looked at by the connector, which will seed it with the current epoch.
    assert seeds == {KEY_SEEDS: {"new": epoch_seed, "old": None, "unseen": epoch_seed}}
    assert epoch_seed != "ns"


def test_the_connectors_seeds_are_recorded_under_the_ids_given() -> None:
    """The connector knows requests by vLLM's internal id; the snapshot names them by the caller's."""
    salted = key_seed("ns", cache_salt="t1")
    llm = _llm(
        {"a-1234": FakeRequest([1, 2, 3], 2, cache_salt="t1"), "b-5678": FakeRequest([1, 2], 1)},
        connector=_connector(None, {"a-1234": salted, "b-5678": "ns"}),
        external={"a": ["a-1234"], "b": ["b-5678"]},
    )
    assert engine._key_seeds(llm, ["a", "b"]) == {KEY_SEEDS: {"a": salted}}  # "b" is plain: not recorded


def test_a_connector_without_a_reset_records_nothing_for_plain_requests() -> None:
    llm = _llm({"r": FakeRequest([1, 2, 3], 2)}, connector=_connector(None, {"r": "ns"}))
    assert engine._key_seeds(llm, ["r"]) == {}


def test_a_request_that_took_media_since_the_connector_saw_it_has_no_seed() -> None:
    """As the connector's ``_seed``: media make a request's seed None for good."""
    req = FakeRequest([1, 2, 3], 2, mm_features=["image"])
    llm = _llm({"r": req}, connector=_connector(None, {"r": "ns"}))
    assert engine._key_seeds(llm, ["r"]) == {KEY_SEEDS: {"r": None}}


def test_the_seeds_of_a_hurray_connector_inside_a_multiconnector_are_used() -> None:
    multi = SimpleNamespace(_connectors=[SimpleNamespace(), _connector("e1", {"r": None})])
    llm = _llm({"r": FakeRequest([1, 2, 3], 2)}, connector=multi)
    assert engine._key_seeds(llm, ["r"]) == {KEY_SEEDS: {"r": None}}


def test_ids_given_as_an_iterator_keep_their_seeds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The ids are read once: a generator's seeds (a tenant's salt, a pre-reset None) reach the snapshot too.

    Read twice (the requests' states, then their seeds), an iterator gave the
    seeds none: a salted tenant's chunks were keyed as unsalted.
    """
    salted = key_seed("ns", cache_salt="t1")
    requests = {"a": FakeRequest([1, 2, 3], 3, cache_salt="t1"), "b": FakeRequest([4, 5, 6], 3)}
    want = {KEY_SEEDS: {"a": salted, "b": None}}  # "b" holds KV from before a cache reset

    def llm() -> Any:
        connector = _connector("e1", {"a": salted, "b": None})
        return _llm(requests, connector=connector, tp=2, worker_rpc=MultiprocWorkers(2))

    monkeypatch.setattr(
        engine, "_snapshot_tp", lambda llm, seqs: make_snapshot([s.num_computed for s in seqs], [0, 0], 4)
    )
    assert engine.snapshot(llm(), iter(["a", "b"])).extra[KEY_SEEDS] == want[KEY_SEEDS]
    with open(tmp_path / "kv.hrrs", "wb") as f:
        engine.snapshot_stream(llm(), iter(["a", "b"]), f)
    loaded = hv.load(tmp_path / "kv.hrrs")
    assert loaded.num_seqs == 2 and loaded.extra[KEY_SEEDS] == want[KEY_SEEDS]
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(engine, "_stream_on_rank", lambda w, seqs, d, extra: sent.append(extra) or (w.rank, (0, None)))
    engine.snapshot_ranks(llm(), iter(["a", "b"]), tmp_path / "ranks")
    assert sent == [want, want]


def test_a_request_id_that_is_not_a_str_is_refused_naming_its_place() -> None:
    """vLLM's ids are ``str`` (``add_request`` refuses others): another object is the caller's mistake."""
    llm = _llm({"a": FakeRequest([1, 2, 3], 2)})
    for ids in (["a", ["a"]], ["a", 1], [None]):
        with pytest.raises(HurrayArgumentError, match=f"element {len(ids) - 1} is a {type(ids[-1]).__name__}") as info:
            engine.request_states(llm, ids)  # type: ignore[arg-type]
        assert info.value.field == "request_ids"
        with pytest.raises(HurrayArgumentError):
            engine.snapshot(llm, ids)  # type: ignore[arg-type]


# n > 1 sampling.


def test_a_request_of_n_above_one_is_refused_also_with_one_child_left() -> None:
    parent = SimpleNamespace(request_id="a-1234")
    requests = {"1_a-1234": FakeRequest([1, 2, 3], 2)}  # child 0 finished and was freed
    llm = _llm(
        requests,
        external={"a": ["0_a-1234", "1_a-1234"]},
        states={"1_a-1234": SimpleNamespace(parent_req=parent)},
    )
    with pytest.raises(HurrayFormatError, match="n > 1 sampling") as info:
        engine.request_states(llm, ["a"])
    assert info.value.field == "request_id"
    with pytest.raises(HurrayFormatError, match="n > 1 sampling"):  # nor under the child's own id
        engine.request_states(llm, ["1_a-1234"])
    llm.llm_engine.output_processor.request_states = {"1_a-1234": SimpleNamespace(parent_req=None)}
    assert [s.request_id for s in engine.request_states(llm, ["a"])] == ["a"]  # n = 1: as before


# Workers' errors at tensor parallelism > 1.


class MultiprocWorkers:
    """``LLM.collective_rpc`` as vLLM's multiprocessing executor runs it, over ``tp`` fake workers.

    Every rank runs the function; each answer is pickled and unpickled; the
    first rank that raised makes the call raise ``RuntimeError`` with the
    exception's text, as ``MultiprocExecutor.collective_rpc`` does.
    """

    def __init__(self, tp: int) -> None:
        self.workers = [SimpleNamespace(rank=r) for r in range(tp)]
        self.timeouts: list[float | None] = []

    def __call__(
        self, method: Callable[..., Any], timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> list[Any]:
        self.timeouts.append(timeout)
        answers: list[tuple[bool, Any]] = []
        for worker in self.workers:
            try:
                answers.append((True, pickle.loads(pickle.dumps(method(worker, *args, **(kwargs or {}))))))
            except Exception as exc:
                answers.append((False, str(exc)))
        for ok, answer in answers:
            if not ok:
                raise RuntimeError(f"Worker failed with error '{answer}', please check the stack trace above")
        return [answer for _, answer in answers]


def _failing_on_rank_1(error: Exception, rank0: Callable[[Any], Any]) -> Callable[..., Any]:
    def fn(worker: Any, *args: Any) -> Any:
        if worker.rank == 1:
            raise error
        return rank0(worker)

    return fn


def test_a_data_error_on_another_rank_arrives_as_at_tp_1(monkeypatch: pytest.MonkeyPatch) -> None:
    workers = MultiprocWorkers(2)
    error = HurrayFormatError("block_ids", "block id 9 outside this cache of 6 blocks")
    monkeypatch.setattr(engine, "_export_on_rank", _failing_on_rank_1(error, lambda w: (w.rank, None)))
    llm = _llm({"r": FakeRequest([1, 2, 3], 2)}, tp=2, worker_rpc=workers)
    with pytest.raises(HurrayFormatError, match="block id 9 outside this cache of 6 blocks") as info:
        engine.snapshot(llm, ["r"])
    assert type(info.value) is HurrayFormatError
    assert info.value.field == "block_ids" and str(info.value) == str(error)
    assert info.value.violations == error.violations
    assert workers.timeouts == [engine.WORKER_TIMEOUT_S]  # a hung worker cannot block the call for ever


@pytest.mark.parametrize(
    "error",
    [
        HurrayArgumentError("kv_scales", "3 pairs for 2 layers"),
        ImportArgumentError("out", "2 caches for 3 layers"),
        HurrayFormatError.from_violations(
            [Violation("seq_ptr.non_decreasing", "goes back"), Violation("seq_ptr.first", "not 0")], "layer 1"
        ),
        FileNotFoundError(errno.ENOENT, "No such file or directory", "/models/x"),
        FileNotFoundError(errno.ENOENT, "No such file or directory", "/kv/rank0.tmp", None, "/kv/rank0.hrrs"),
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(None, "HTTP 500", "http://a:8000/v1"),
        TimeoutError("timed out"),
        OSError("no errno"),
    ],
    ids=repr,
)
def test_every_error_a_worker_returns_is_raised_as_it_was_raised(error: Exception) -> None:
    """Class, ``field``, message and violations; an ``OSError``'s class, errno, strerror and file names."""
    record = pickle.loads(pickle.dumps(engine._WorkerError.of(error)))
    got = record.error(1)
    assert type(got) is type(error) and str(got) == str(error) and got.args == error.args
    for name in ("field", "violations", "errno", "strerror", "filename", "filename2"):
        assert getattr(got, name, None) == getattr(error, name, None)
    assert got.__notes__ == ["(raised on worker 1)"]


def test_the_description_of_another_ranks_cache_arrives_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    error = HurrayFormatError("block_size", "the backend cuts blocks of 32 into kernel blocks of 16")
    monkeypatch.setattr(engine, "_describe", _failing_on_rank_1(error, lambda w: "cache"))
    llm = _llm({}, tp=2, worker_rpc=MultiprocWorkers(2))
    with pytest.raises(HurrayFormatError) as info:
        engine._raise_failed(engine._rpc(llm, engine._describe))
    assert info.value.field == "block_size"
    # engine_cache() returns the worker's tensors: with the workers in processes of their own it refuses.
    with pytest.raises(HurrayFormatError) as info:
        engine.engine_cache(llm)
    assert info.value.field == "distributed_executor_backend"


def test_snapshot_ranks_removes_the_files_of_the_ranks_that_wrote_when_one_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    workers = MultiprocWorkers(3)
    older = tmp_path / "rank2.heads4-6.hrrs"
    older.write_bytes(b"an earlier call's")

    def stream(worker: Any, seqs: Any, directory: str, extra: Any) -> Any:
        if worker.rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device", f"{directory}/rank1.heads2-4.hrrs")
        path = Path(directory) / f"rank{worker.rank}.heads{2 * worker.rank}-{2 * worker.rank + 2}.hrrs"
        path.write_bytes(b"written")
        return worker.rank, (2 * worker.rank, str(path))

    monkeypatch.setattr(engine, "_stream_on_rank", stream)
    llm = _llm({"r": FakeRequest([1, 2, 3], 2)}, tp=3, worker_rpc=workers)
    with pytest.raises(OSError, match="No space left on device") as info:
        engine.snapshot_ranks(llm, ["r"], tmp_path)
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # rank 0's and rank 2's files: removed
    assert workers.timeouts == [engine.WORKER_TIMEOUT_S]

    monkeypatch.setattr(engine, "_stream_on_rank", lambda w, *a: stream(SimpleNamespace(rank=w.rank * 2), *a))
    files = engine.snapshot_ranks(llm, ["r"], tmp_path)  # ranks 0, 2, 4 in disguise: all write
    assert [f.name for f in files] == ["rank0.heads0-2.hrrs", "rank2.heads4-6.hrrs", "rank4.heads8-10.hrrs"]
    assert older.read_bytes() == b"written"
