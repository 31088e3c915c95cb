"""Which blocks of a sliding-window group the scheduler hands a save: never one vLLM already freed.

vLLM frees a sliding-window group's blocks wholly before ``computed - window + 1``
when it schedules a step (and may give them to another request in that
step), where ``computed`` counts the tokens its finished steps computed. A
chunk is planned once its tokens are final: with speculative decoding, in a
step that may start well past the chunk's end (the drafts accepted). The
scheduler must blank what vLLM freed for that step's start, not only what
the chunk's own end leaves out of the window, or the save copies a block
that is someone else's by then.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from bare_worker import CHUNK, stored_at_tp
from conftest import require
from connector_parts import counting_headers, counting_reads, vllm_config
from hypothesis import given, settings
from hypothesis import strategies as st

WINDOW = 8  # tokens; blocks of 4 and chunks of 8 (bare_worker)
GROUPS = ([21, 22, 23, 24], [11, 12, 13, 14])  # the full group's blocks, then the sliding-window group's


@pytest.fixture(autouse=True)
def _vllm() -> None:
    require("vllm")


def _scheduler(tmp_path: Path) -> Any:
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler

    store, ns, _, snap = stored_at_tp(tmp_path, 1)
    cfg = HurrayConfig.from_vllm(vllm_config({"hurray_path": str(tmp_path), "hurray_chunk_tokens": CHUNK}, 4), None)  # type: ignore[arg-type]
    cfg = dataclasses.replace(cfg, group_windows=(None, WINDOW), tails=False)
    return HurrayScheduler(cfg, store, snap.fingerprint, ns)  # type: ignore[arg-type]


def _step(new: list[Any], cached: list[tuple[str, int]], scheduled: dict[str, int]) -> SimpleNamespace:
    """A SchedulerOutput, as much as the connector reads: ``cached`` is ``(request, computed before the step)``."""
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            new_block_ids=[None] * len(cached),
            resumed_req_ids=set(),
            num_computed_tokens=[c for _, c in cached],
        ),
        num_scheduled_tokens=scheduled,
    )


def _planned_saves(tmp_path: Path, accepted: int, in_flight: int = 0) -> list[Any]:
    """A 6-token prompt, then a decode step drafting 5 tokens of which ``accepted`` are; then one more step,
    scheduled while ``in_flight`` of the computed tokens are still in flight (asynchronous scheduling).

    Returns the saves that last step plans: the first chunk's (tokens 0-7), unless it is stored already.
    """
    sched = _scheduler(tmp_path)
    tokens = list(range(1000, 1006))  # nothing of it is stored
    request = SimpleNamespace(
        request_id="r", all_token_ids=tokens, num_prompt_tokens=6, kv_transfer_params=None, num_in_flight_tokens=0
    )
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    new = SimpleNamespace(req_id="r", block_ids=GROUPS, num_computed_tokens=0)
    assert not sched.build_connector_meta(_step([new], [], {"r": 6})).saves  # type: ignore[arg-type]
    tokens.append(1006)  # the prefill's token; the next step computes it and 5 drafts (tokens 6-11)
    assert not sched.build_connector_meta(_step([], [("r", 6)], {"r": 6})).saves  # type: ignore[arg-type]
    tokens += list(range(1007, 1008 + accepted))  # the accepted drafts and the bonus token
    request.num_in_flight_tokens = in_flight
    return list(sched.build_connector_meta(_step([], [("r", 7 + accepted)], {"r": 1})).saves)  # type: ignore[arg-type]


def _saved_blocks(tmp_path: Path, accepted: int, in_flight: int = 0) -> list[list[int]]:
    """:func:`_planned_saves`'s one save: the groups' blocks it copies."""
    (save,) = _planned_saves(tmp_path, accepted, in_flight)
    assert save.block_ids == GROUPS[0][:2]
    return save.groups


def test_a_chunk_planned_in_a_step_starting_past_it_leaves_out_the_blocks_vllm_freed(tmp_path: Path) -> None:
    # 5 drafts accepted: the step starts at token 12, and vLLM freed the blocks before 12 - 8 + 1 = 5: block 0.
    assert _saved_blocks(tmp_path, 5) == [[21, 22], [0, 12]]


def test_tokens_still_in_flight_free_nothing_yet(tmp_path: Path) -> None:
    # 4 drafts accepted: the step starts at token 11, and vLLM frees the blocks before 11 - 8 + 1 = 4: block 0.
    assert _saved_blocks(tmp_path, 4) == [[21, 22], [0, 12]]
    # One of them still in flight: vLLM frees on the 10 tokens processed, before 3: nothing.
    assert _saved_blocks(tmp_path / "async", 4, in_flight=1) == [[21, 22], [11, 12]]


def test_a_chunk_planned_as_its_tokens_complete_keeps_its_window(tmp_path: Path) -> None:
    # 1 draft accepted: the step starts at token 8, the chunk's end; vLLM freed nothing (8 - 8 + 1 = 1 token).
    assert _saved_blocks(tmp_path, 1) == [[21, 22], [11, 12]]


def _store_copy(
    tmp_path: Path, key: str, start: int, heads: range | None = None, scales: tuple[float, float] | None = None
) -> None:
    """Store chunk ``key`` (tokens 1000-1007) as another producer did: its windowed layer from ``start`` on.

    ``heads``: only those KV heads, as a rank at tensor parallelism > 1 stores its slice (``<key>.h<a>-<b>``).
    ``scales``: every layer's fp8 ``(k_scale, v_scale)``, which a header does not tell.
    """
    import torch
    from bare_worker import DIM, HEADS, PAGE, gqa_fingerprint

    import hurray_vllm as hv
    from hurray_vllm.chunks.digest import DIGEST_KEY, chunk_digest
    from hurray_vllm.chunks.store import DirectoryStore, namespace_of, slice_key
    from hurray_vllm.kv.snapshot import HeadRange, SlidingWindows

    count = len(heads) if heads is not None else HEADS
    pool = torch.randn((CHUNK // PAGE, PAGE, count, DIM)).to(torch.bfloat16)
    table, ptr, lens = torch.arange(CHUNK // PAGE), torch.tensor([0, CHUNK // PAGE]), torch.tensor([CHUNK])
    layers = [[hv.BlockPagedTensor(pool, table, ptr, lens, role, i) for role in ("key", "value")] for i in range(2)]
    snap = hv.KVSnapshot.from_layers(
        layers,
        token_ids=(tuple(range(1000, 1000 + CHUNK)),),
        fingerprint=gqa_fingerprint(),
        windows=SlidingWindows(sizes=(None, WINDOW), kv_start=((0,), (start,))),
        kv_scales=(scales, scales) if scales is not None else None,
    )
    if heads is not None:
        snap = dataclasses.replace(snap, heads=HeadRange(heads.start, heads.stop, HEADS))
    snap = dataclasses.replace(snap, extra={**snap.extra, DIGEST_KEY: chunk_digest(snap)})  # loadable
    store = DirectoryStore(tmp_path / "tp1")
    assert store.put(namespace_of(gqa_fingerprint()), slice_key(key, heads), snap, replace=True)


def _lookup(tmp_path: Path) -> tuple[Any, tuple[int | None, bool]]:
    """A consumer of this engine's windows asks for the stored chunk 0 (tokens 1000-1007): the scheduler, its answer."""
    from collections import Counter

    sched = _scheduler(tmp_path)
    sched._window_counts = Counter({WINDOW: 1})  # one layer sliding by WINDOW, one full (the chunks' layers)
    tokens = list(range(1000, 1000 + CHUNK + 1))
    request = SimpleNamespace(
        request_id="c", all_token_ids=tokens, num_prompt_tokens=len(tokens), kv_transfer_params=None
    )
    return sched, sched.get_num_new_matched_tokens(request, 0)


def _rank_plans(tmp_path: Path, save: Any) -> list[tuple[bool, bool]]:
    """What each TP = 2 rank's worker does with ``save`` (its slice's key): (exports it, exports it unless replace)."""
    from bare_worker import HEADS, gqa_fingerprint

    from hurray_vllm.adapters.vllm.connector.metadata import ConnectorStats
    from hurray_vllm.adapters.vllm.connector.worker import HurrayWorker
    from hurray_vllm.chunks.store import DirectoryStore, namespace_of, slice_key

    def exports(task: Any) -> bool:
        worker = object.__new__(HurrayWorker)  # the attributes _plan_save looks at; nothing in flight
        worker._store, worker._ns = DirectoryStore(tmp_path / "tp1"), namespace_of(gqa_fingerprint())
        worker._fingerprint, worker._inflight, worker.stats = gqa_fingerprint(), set(), ConnectorStats()
        planned = worker._plan_save(task)
        return planned is not None and planned[1]

    out = []
    for r in range(HEADS):
        task = dataclasses.replace(save, key=slice_key(save.key, range(r, r + 1)))
        out.append((exports(task), exports(dataclasses.replace(task, replace=False))))
    return out


def test_a_copy_holding_less_of_the_window_is_replaced_by_one_holding_it(tmp_path: Path) -> None:
    """A copy saved after vLLM freed a block of the chunk's window (a speculative step; or the "last" policy
    for a longer prompt) would block for good the copy a resume at the chunk's end needs."""
    (probe,) = _planned_saves(tmp_path / "probe", 1)
    # Stored without its first block; this producer holds the whole window: written again, over it.
    _store_copy(tmp_path / "weak", probe.key, 4)
    (save,) = _planned_saves(tmp_path / "weak", 1)
    assert save.replace and save.groups == [[21, 22], [11, 12]]
    # A copy holding as much, or more, stays: no producer writes one that holds less over it.
    _store_copy(tmp_path / "whole", probe.key, 0)
    assert _planned_saves(tmp_path / "whole", 1) == []
    _store_copy(tmp_path / "same", probe.key, 4)
    assert _planned_saves(tmp_path / "same", 5) == []


def _plan_first_chunk(sched: Any, rid: str, accepted: int) -> list[Any]:
    """:func:`_planned_saves`' steps for request ``rid`` on ``sched``: the saves its last step plans."""
    tokens = list(range(1000, 1006))
    request = SimpleNamespace(
        request_id=rid, all_token_ids=tokens, num_prompt_tokens=6, kv_transfer_params=None, num_in_flight_tokens=0
    )
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.build_connector_meta(
        _step([SimpleNamespace(req_id=rid, block_ids=GROUPS, num_computed_tokens=0)], [], {rid: 6})
    )
    tokens.append(1006)
    sched.build_connector_meta(_step([], [(rid, 6)], {rid: 6}))
    tokens += list(range(1007, 1008 + accepted))
    return list(sched.build_connector_meta(_step([], [(rid, 7 + accepted)], {rid: 1})).saves)


def test_a_save_holding_more_window_than_one_planned_before_is_written_over_it(tmp_path: Path) -> None:
    """Found by a full-suite run under load: the copy planned first (less window) was still on the worker's queue
    when a later request planned the chunk with its window; the store showed nothing, so the later save was no
    replace, and the worker skipped it as in flight: whichever landed first stayed, by timing."""
    sched = _scheduler(tmp_path)
    (weak,) = _plan_first_chunk(sched, "a", 5)  # a step starting past the chunk: vLLM freed block 0 (11)
    assert weak.groups == [[21, 22], [0, 12]] and not weak.replace
    (full,) = _plan_first_chunk(sched, "b", 1)  # the whole window, nothing stored yet: over the first
    assert full.key == weak.key and full.groups == [[21, 22], [11, 12]] and full.replace
    (again,) = _plan_first_chunk(sched, "c", 5)  # less than planned: no replace (the worker skips it)
    assert not again.replace
    (same,) = _plan_first_chunk(sched, "d", 1)  # as much as planned: no replace either (no turns taken)
    assert not same.replace


def _chunk(window: int, start: int) -> SimpleNamespace:
    """A stored chunk of a sliding-window layer and a full one: the first holds its tokens from ``start`` on."""
    from hurray_vllm.kv.snapshot import SlidingWindows

    return SimpleNamespace(windows=SlidingWindows(sizes=(window, None), kv_start=((start,), (0,))))


def _worker_refuses(window: int, start: int, base: int, resume: int, block: int, skip: int = 0) -> bool:
    """The worker's rule: a block vLLM keeps (from the one holding ``resume - window + 1``) that the chunk's
    pages do not wholly hold refuses the load; the first ``skip`` blocks (a local prefix hit) are not written."""
    kept = max(0, resume - window + 1) // block
    return any(base + r * block < base + start for r in range(skip, CHUNK // block) if base // block + r >= kept)


@given(
    window=st.integers(1, 40),
    saved_block=st.sampled_from([1, 2, 4, 8]),
    block=st.sampled_from([1, 2, 4, 8]),
    chunks=st.integers(1, 4),
    past=st.integers(0, 6),
    hit=st.integers(0, CHUNK - 1),
)
@settings(max_examples=300, deadline=None)
def test_the_scheduler_loads_a_windowed_chunk_exactly_when_the_worker_would_write_it(
    window: int, saved_block: int, block: int, chunks: int, past: int, hit: int
) -> None:
    """Producers of any block size (saving at the chunk's end, or ``past`` tokens after it); a resume at the end
    of the last chunk, loaded from a chunk inside which the engine's own prefix hit (``hit`` tokens, whole
    blocks) may end: the scheduler's check agrees with the worker's, so no load it plans is refused there, and
    it plans every load the worker would write."""
    from hurray_vllm.adapters.vllm.connector.scheduler import _windows_held

    resume = chunks * CHUNK
    skip = hit // block
    for c in range(chunks):
        base = c * CHUNK
        freed = max(0, base + CHUNK + past - window + 1) // saved_block * saved_block  # the producer's null blocks
        start = min(CHUNK, max(0, freed - base))
        held = _windows_held([_chunk(window, start)], c, resume, CHUNK, block, base + skip * block)
        assert held == (not _worker_refuses(window, start, base, resume, block, skip)), (c, start)


def test_chunks_saved_with_other_windows_are_not_offered(tmp_path: Path) -> None:
    """A chunk whose layers slide where this engine's do not (its hybrid KV cache manager or sliding windows
    off), or by other windows: the worker refuses every such layer, so the scheduler must not promise it."""
    from collections import Counter

    sched = _scheduler(tmp_path)
    chunks = [_chunk(WINDOW, 0), _chunk(WINDOW, 0)]
    sched._window_counts = Counter({WINDOW: 1})  # this engine: one layer sliding by WINDOW, one full
    assert sched._resumes_at(chunks, 0, 2)
    sched._window_counts = Counter()  # no sliding layer here
    assert not sched._resumes_at(chunks, 0, 2)
    sched._window_counts = Counter({2 * WINDOW: 1})
    assert not sched._resumes_at(chunks, 0, 2)


@pytest.mark.parametrize("weak", [0, 1])
def test_slices_of_two_saves_holding_different_windows_are_written_again_by_every_rank(
    tmp_path: Path, weak: int
) -> None:
    """One rank's save failed (or two engines interleaved): the chunk's slices hold different windows, do not
    join, and no lookup loads them. Whichever slice holds less (not only the first file), a save writes the chunk
    again over them, each rank its own slice, though its slice is stored; then it loads and is left alone."""
    (probe,) = _planned_saves(tmp_path / "probe", 1)
    for r in range(2):
        _store_copy(tmp_path, probe.key, 4 if r == weak else 0, range(r, r + 1))
    assert _lookup(tmp_path)[1] == (0, False)  # the slices do not join
    (save,) = _planned_saves(tmp_path, 1)
    assert save.replace and save.groups == [[21, 22], [11, 12]]
    # Each rank's own slice is stored: it is skipped, except for the scheduler's replace.
    assert _rank_plans(tmp_path, save) == [(True, False), (True, False)]
    _store_copy(tmp_path, probe.key, 0, range(weak, weak + 1))  # the slice that held less, written again
    assert _lookup(tmp_path)[1] == (CHUNK, False)
    assert _planned_saves(tmp_path, 1) == []


def test_a_whole_copy_holding_less_does_not_hide_slices_holding_the_window(tmp_path: Path) -> None:
    """Engines of two TP degrees share a store: a TP = 1 engine's whole copy holds less of the window, a TP = 2
    engine's slices hold it. The lookup loads the slices (the whole file is looked at first), and no save writes
    the slices again (the whole file's name is no TP = 2 rank's to replace: a replace would recur forever)."""
    (probe,) = _planned_saves(tmp_path / "probe", 1)
    _store_copy(tmp_path, probe.key, 4)
    for r in range(2):
        _store_copy(tmp_path, probe.key, 0, range(r, r + 1))
    sched, answer = _lookup(tmp_path)
    assert answer == (CHUNK, False)
    (load,) = sched._reqs["c"].load.parts
    assert [name[-5:] for name, *_ in load] == [".h0-1", ".h1-2"]
    assert _planned_saves(tmp_path, 1) == []
    # The other way round: the whole copy holds the window, the slices less. Whole first, as ever.
    _store_copy(tmp_path / "other", probe.key, 0)
    for r in range(2):
        _store_copy(tmp_path / "other", probe.key, 4, range(r, r + 1))
    sched, answer = _lookup(tmp_path / "other")
    assert answer == (CHUNK, False) and [n for n, *_ in sched._reqs["c"].load.parts[0]] == [probe.key]
    assert _planned_saves(tmp_path / "other", 1) == []


def test_a_complete_set_refused_before_does_not_hide_another(tmp_path: Path) -> None:
    """A whole file refused and left in place (unreadable, another fleet's): the lookup takes the slices beside it."""
    from bare_worker import gqa_fingerprint

    from hurray_vllm.adapters.vllm.connector.metadata import REFUSED, verified_scope
    from hurray_vllm.chunks.store import DirectoryStore, namespace_of

    (probe,) = _planned_saves(tmp_path / "probe", 1)
    _store_copy(tmp_path, probe.key, 0)
    for r in range(2):
        _store_copy(tmp_path, probe.key, 0, range(r, r + 1))
    identity = DirectoryStore(tmp_path / "tp1").identity(namespace_of(gqa_fingerprint()), probe.key)
    assert identity is not None
    REFUSED.add(probe.key, identity, verified_scope(None))
    sched, answer = _lookup(tmp_path)
    assert answer == (CHUNK, False)
    assert [n[-5:] for n, *_ in sched._reqs["c"].load.parts[0]] == [".h0-1", ".h1-2"]


def _two_ways(tmp_path: Path) -> tuple[str, list[str]]:
    """Chunk 0 stored by a TP = 1 engine holding less of the window, and by a TP = 2 engine's ranks holding it:
    its key, and the files' names (whole file first)."""
    from hurray_vllm.chunks.store import slice_key

    (probe,) = _planned_saves(tmp_path / "probe", 1)
    _store_copy(tmp_path, probe.key, 4)
    for r in range(2):
        _store_copy(tmp_path, probe.key, 0, range(r, r + 1))
    return probe.key, [f"{name}.hrry" for name in (probe.key, *(slice_key(probe.key, range(r, r + 1)) for r in (0, 1)))]


def test_a_lookup_vllm_repeats_stats_each_file_once_and_reads_no_header_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM asks again for a waiting request at every step. The whole file holds less of the window (as the "last"
    policy stores a chunk for a longer prompt): each step looks at the slices too, at a ``stat`` per file, and reads
    no header again, though fewer headers are remembered than the chunk has files. The headers remembered are the
    most recently used."""
    from hurray_vllm.adapters.vllm.connector import scheduler
    from hurray_vllm.chunks.store import DirectoryStore

    key, names = _two_ways(tmp_path)
    monkeypatch.setattr(scheduler, "_STORED_HEADERS_CAP", 2)
    headers = counting_headers(monkeypatch)
    stats: list[str] = []
    real = DirectoryStore.identity

    def identity(self: Any, namespace: str, name: str) -> Any:
        stats.append(f"{name}.hrry")
        return real(self, namespace, name)

    monkeypatch.setattr(DirectoryStore, "identity", identity)
    sched, answer = _lookup(tmp_path)
    assert answer == (CHUNK, False) and sorted(headers) == sorted(names)
    request = sched._reqs["c"].request
    for _ in range(3):
        headers.clear()
        stats.clear()
        assert sched.get_num_new_matched_tokens(request, 0) == (CHUNK, False)
        assert headers == [] and stats == names
    whole, slices = sched._store.complete_sets(sched._ns, key, sched._heads)
    sched._stored_headers.clear()
    headers.clear()
    for part in (whole[0], slices[0], whole[0], slices[1], whole[0]):
        sched._held(part)
    assert headers == names  # the whole file's header, looked at last but one, was kept


def test_a_header_unread_for_want_of_descriptors_hides_no_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a slice's header failed for a reason that says nothing about the file (out of descriptors): the
    slices are judged by their other header meanwhile, and the failure is not remembered: the next look reads the
    header again. The slices holding the window load, not the whole file holding less, for every request."""
    _, names = _two_ways(tmp_path)
    headers = counting_headers(monkeypatch, {names[2]: 1})
    sched, answer = _lookup(tmp_path)
    assert answer == (CHUNK, False)
    assert [name[-5:] for name, *_ in sched._reqs["c"].load.parts[0]] == [".h0-1", ".h1-2"]
    tokens = list(range(1000, 1000 + CHUNK + 1))
    request = SimpleNamespace(
        request_id="d", all_token_ids=tokens, num_prompt_tokens=len(tokens), kv_transfer_params=None
    )
    assert sched.get_num_new_matched_tokens(request, 0) == (CHUNK, False)
    assert headers.count(names[2]) == 2 and headers.count(names[1]) == 1


def test_slices_that_do_not_join_by_what_their_headers_do_not_tell_are_read_once_and_written_again(
    tmp_path: Path,
) -> None:
    """Two producers' slices hold the same windows but other fp8 scales: a lookup reads them and finds that they do
    not join. No later lookup reads them again, and a save of the chunk writes every slice again over them."""
    (probe,) = _planned_saves(tmp_path / "probe", 1)
    _store_copy(tmp_path, probe.key, 0, range(0, 1), scales=(1.0, 1.0))
    _store_copy(tmp_path, probe.key, 0, range(1, 2), scales=(0.5, 0.5))
    sched, answer = _lookup(tmp_path)
    assert answer == (0, False)
    read = counting_reads(sched)
    tokens = list(range(1000, 1000 + CHUNK + 1))
    request = SimpleNamespace(
        request_id="d", all_token_ids=tokens, num_prompt_tokens=len(tokens), kv_transfer_params=None
    )
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert read == []
    # Stored, and written over: by a save holding the window, and by one holding nothing of it.
    assert sched._stored_for_save(probe.key, 0, 0, False) == (True, True)
    assert sched._stored_for_save(probe.key, 0, 2 * CHUNK, False) == (True, True)


def test_a_save_holding_nothing_of_the_window_reads_no_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that blanks every windowed block (the "last" policy's chunks before a prompt's last, a step far past
    the chunk) can hold no more than any stored copy: a ``stat`` per file tells it is stored, no header is read."""
    key, _ = _two_ways(tmp_path)
    headers = counting_headers(monkeypatch)
    sched = _scheduler(tmp_path)
    assert sched._window_start(WINDOW, 0, 2 * CHUNK) == CHUNK  # a resume there attends nothing of chunk 0
    assert sched._stored_for_save(key, 0, 2 * CHUNK, False) == (True, False)
    assert headers == []
