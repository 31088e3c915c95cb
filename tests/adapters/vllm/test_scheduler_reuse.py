"""The scheduler part without an engine: lookups vLLM repeats, tails after a partial match, what a consumer
announces, states of another layout, and requests known at a cache reset.

vLLM asks a waiting request's matched tokens again at every step while it
cannot allocate the request's blocks (a full KV cache): the connector gives
the same answer without reading and checksumming the chunks again, whatever
the verified-chunk cache evicted meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from bare_worker import CHUNK, DIM, HEADS, PAGE, gqa_fingerprint, stored_at_tp
from conftest import require
from connector_parts import counting_headers, counting_reads, linear_scheduler, vllm_config

import hurray_vllm as hv


@pytest.fixture(autouse=True)
def _vllm() -> None:
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.metadata import forget_verified_chunks

    forget_verified_chunks()


def _config(tmp_path: Path, role: str = "kv_both", **fields: Any) -> Any:
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig

    extra = {"hurray_path": str(tmp_path), "hurray_chunk_tokens": CHUNK}
    cfg = HurrayConfig.from_vllm(vllm_config(extra, 4, role=role), None)  # type: ignore[arg-type]
    return dataclasses.replace(cfg, **fields)


def _scheduler(cfg: Any, store: Any, ns: str) -> Any:
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler

    return HurrayScheduler(cfg, store, gqa_fingerprint(), ns)


def _request(rid: str, tokens: list[int], **fields: Any) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid, all_token_ids=tokens, num_prompt_tokens=len(tokens), kv_transfer_params=None, **fields
    )


def _output(new: list[Any] | None = None, scheduled: dict[str, int] | None = None) -> SimpleNamespace:
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=new or [], scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled or {}
    )


def _blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def test_a_lookup_vllm_repeats_while_it_cannot_allocate_reads_no_chunk_again(tmp_path: Path) -> None:
    from hurray_vllm.adapters.vllm.connector.metadata import forget_verified_chunks

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    sched = _scheduler(_config(tmp_path), store, ns)
    read = counting_reads(sched)
    request = _request("r", list(snap.token_ids[0]))
    assert sched.get_num_new_matched_tokens(request, 0) == (16, False)
    planned = sched._reqs["r"].load
    assert planned is not None and len(read) == 2
    # The KV cache is full: no allocation, no update_state_after_alloc; the verified chunks were evicted meanwhile.
    for _ in range(3):
        forget_verified_chunks()
        assert sched.get_num_new_matched_tokens(request, 0) == (16, False)
    assert len(read) == 2 and sched._reqs["r"].load is planned

    # Another start (a local prefix-cache hit) is another lookup.
    assert sched.get_num_new_matched_tokens(request, 8) == (8, False) and len(read) == 3
    assert sched.get_num_new_matched_tokens(request, 8) == (8, False) and len(read) == 3
    # A file replaced (another identity) is read again.
    path = store.path(ns, keys[1])
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert sched.get_num_new_matched_tokens(request, 8) == (8, False) and len(read) == 4
    # A file gone: the answer changes.
    path.unlink()
    assert sched.get_num_new_matched_tokens(request, 8) == (0, False) and sched._reqs["r"].load is None


def test_a_repeated_lookup_is_dropped_when_vllm_grants_nothing_schedules_it_or_it_finishes(tmp_path: Path) -> None:
    store, ns, _, snap = stored_at_tp(tmp_path, 1)
    sched = _scheduler(_config(tmp_path), store, ns)
    read = counting_reads(sched)
    tokens = list(snap.token_ids[0])
    request = _request("r", tokens)
    assert sched.get_num_new_matched_tokens(request, 0) == (16, False) and len(read) == 2
    # vLLM granted none of it (another connector's rule, a replay window): the plan goes, the next lookup looks.
    sched.update_state_after_alloc(request, _blocks([1, 2, 3, 4, 5]), 0)
    assert sched._reqs["r"].load is None
    assert sched.get_num_new_matched_tokens(request, 0) == (16, False) and len(read) == 4
    # Granted and scheduled: the load goes to the workers; preempted, the request looks again.
    sched.update_state_after_alloc(request, _blocks([1, 2, 3, 4, 5]), 16)
    new = SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=16)
    (load,) = sched.build_connector_meta(_output([new], {"r": 1})).loads
    assert sched.get_num_new_matched_tokens(request, 0) == (16, False) and len(read) == 6
    assert sched._reqs["r"].load is not load
    # Finished (aborted while it waited): forgotten, a request of the same id looks again.
    sched.request_finished(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (16, False) and len(read) == 8


def _sequence(tokens: int, seed: int = 0) -> hv.KVSnapshot:
    """:func:`bare_worker.two_chunks`'s model, one sequence of ``tokens`` tokens (whole pages) of KV."""
    pages = tokens // PAGE
    gen = torch.Generator().manual_seed(seed)
    table, ptr, lens = torch.arange(pages), torch.tensor([0, pages]), torch.tensor([tokens])

    def pool() -> torch.Tensor:
        return torch.randn((pages, PAGE, HEADS, DIM), generator=gen).to(torch.bfloat16)

    return hv.KVSnapshot(
        keys=tuple(hv.BlockPagedTensor(pool(), table, ptr, lens, "key", i) for i in range(2)),
        values=tuple(hv.BlockPagedTensor(pool(), table, ptr, lens, "value", i) for i in range(2)),
        token_ids=(tuple(range(100, 100 + tokens + 1)),),
        fingerprint=gqa_fingerprint(),
        source=hv.SnapshotSource("vllm", "test", PAGE),
        request_ids=("r",),
    )


def test_a_chunk_that_fails_its_checksum_stops_the_reads_after_it(tmp_path: Path) -> None:
    """Six chunks stored, the first one's checksum fails: the chunks after it are not all read for nothing."""
    from hurray_vllm.chunks.keys import namespace_of
    from hurray_vllm.chunks.store import DirectoryStore, store_snapshot
    from hurray_vllm.errors import HurrayFormatError

    snap = _sequence(6 * CHUNK)
    store = DirectoryStore(tmp_path / "store")
    assert store_snapshot(store, snap, CHUNK) == 6
    sched = _scheduler(_config(tmp_path), store, namespace_of(gqa_fingerprint()))
    read = counting_reads(sched)
    bad: list[str] = []
    real = sched._check_later

    def check_later(chunk: Any, name: str, read: Any) -> Future[None]:
        if not bad:  # the first chunk checked
            bad.append(name)
            failed: Future[None] = Future()
            failed.set_exception(HurrayFormatError("chunk.digest", "wrong checksum"))
            return failed
        return real(chunk, name, read)

    sched._check_later = check_later
    assert sched.get_num_new_matched_tokens(_request("r", list(snap.token_ids[0])), 0) == (0, False)
    assert sched.stats.chunks_refused == 1 and read[0] == bad[0]
    assert len(read) <= 2, read  # the first, and the one parsed while its checksum ran


def test_a_tail_is_found_after_the_last_chunk_found_where_the_prompt_runs_on(tmp_path: Path) -> None:
    """The producer's prompt was 12 tokens (chunk 0 and a tail of one block); the consumer's extends it past
    a chunk: its chunk 1 is not stored, the tail after chunk 0 is."""
    from hurray_vllm.chunks.keys import namespace_of, tail_keys
    from hurray_vllm.chunks.store import DirectoryStore, chunk_keys, store_snapshot

    snap = _sequence(12)
    store = DirectoryStore(tmp_path / "store")
    ns = namespace_of(gqa_fingerprint())
    assert store_snapshot(store, snap, CHUNK) == 2  # chunk 0 and the tail
    prompt = list(snap.token_ids[0][:12])
    (key,) = chunk_keys(prompt[:8], CHUNK, ns)
    ((_, tail),) = tail_keys(key, prompt[8:12], 4, ns)
    sched = _scheduler(_config(tmp_path), store, ns)
    longer = _request("c", [*prompt, 7, 7, 7, 7, 7, 7])
    assert sched.get_num_new_matched_tokens(longer, 0) == (12, False)
    load = sched._reqs["c"].load
    assert load.keys == [key, tail] and load.tail and load.tokens == [prompt[:8], prompt[8:12]]
    # At most up to the last token but one, and not what the engine holds itself.
    assert sched.get_num_new_matched_tokens(_request("s", [*prompt, 7]), 0) == (12, False)
    assert sched.get_num_new_matched_tokens(_request("h", [*prompt, 7, 7, 7, 7, 7, 7]), 12) == (0, False)
    off = _scheduler(_config(tmp_path, tails=False), store, ns)
    assert off.get_num_new_matched_tokens(longer, 0) == (8, False)


def test_a_consumer_announces_no_chunk_of_its_own_prefix_cache_hit(tmp_path: Path) -> None:
    """A kv_consumer saves nothing: chunks of its local hit may be in no store, and a destination would wait
    hurray_push_wait_s for them. What it loaded from the prompt's start is stored (it was loaded from there)."""
    store, ns, _, snap = stored_at_tp(tmp_path, 1)
    tokens = list(snap.token_ids[0])
    for role, local, announced in (
        ("kv_consumer", 8, None),
        ("kv_consumer", 0, {"hurray_saved_tokens": 16}),
        ("kv_both", 8, {"hurray_saved_tokens": 16}),
    ):
        sched = _scheduler(_config(tmp_path, role=role), store, ns)
        request = _request("r", tokens)
        assert sched.get_num_new_matched_tokens(request, local) == (16 - local, False)
        sched.update_state_after_alloc(request, _blocks([1, 2, 3, 4, 5]), 16 - local)
        new = SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=16)
        (load,) = sched.build_connector_meta(_output([new], {"r": 1})).loads
        assert len(load.block_ids) == (16 - local) // PAGE
        assert sched.request_finished(request) == (False, announced), (role, local)


def test_states_of_another_layout_are_warned_about_and_counted_once_per_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from dataclasses import replace

    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks import chunk_keys

    sched = linear_scheduler(tmp_path)
    store, ns = sched._store, sched._ns
    tokens = list(range(100))
    (key,) = chunk_keys(tokens[:64], 64, sched._seed(sched._state(_request("x", tokens))) or ns)
    pair = (torch.zeros(1, 3, 16, dtype=torch.float16), torch.zeros(1, 2, 8, 4, dtype=torch.float16))  # not bf16
    states = hv.RecurrentStates("gdn_attn", (0, 1), ("conv", "ssm"), (64,), (pair, pair), attention=(2,))
    sched._heads = 2
    snap = replace(
        spec_example_snapshot(num_layers=1).select([0]),
        fingerprint=hv.ModelFingerprint("Qwen3NextForCausalLM", 1, 2, 8, "float16"),
        states=states,
    )
    store.put(ns, key, snap)
    sched._read_parts = lambda parts, toks, reader=None: ([store.get(ns, p.name) for p in parts], [None] * len(parts))
    sched._passed = lambda parts, snaps, checks: True
    with caplog.at_level(logging.WARNING, logger="hurray_vllm.connector"):
        for rid in ("a", "b", "a", "c"):
            assert sched.get_num_new_matched_tokens(_request(rid, tokens), 0) == (0, False)
    warned = [r for r in caplog.records if "not loading the states" in r.getMessage()]
    assert len(warned) == 1 and sched.stats.chunks_refused == 1


def test_a_whole_file_refused_before_hides_no_slices_carrying_states(tmp_path: Path) -> None:
    """A linear-attention hybrid resumes at the furthest chunk a complete set of files carries states for: a whole
    file refused and left in place (another fleet's, unverifiable) stands for no such set while another TP degree's
    slices beside it carry them; nor do slices whose states were taken at other tokens (two saves': no join)."""
    from dataclasses import replace

    from hurray_vllm.adapters.vllm.connector.metadata import REFUSED, verified_scope
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks.store import slice_key

    sched = linear_scheduler(tmp_path)
    store, ns = sched._store, sched._ns
    sched._heads = 2
    pair = (torch.zeros(1, 3, 16, dtype=torch.bfloat16), torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16))
    snap = replace(
        spec_example_snapshot(num_layers=1).select([0]),
        fingerprint=hv.ModelFingerprint("Qwen3NextForCausalLM", 1, 2, 8, "float16"),
        states=hv.RecurrentStates("gdn_attn", (0, 1), ("conv", "ssm"), (64,), (pair, pair), attention=(2,)),
    )
    key = "ab" * 16
    slices = [slice_key(key, range(0, 1)), slice_key(key, range(1, 2))]
    for name in (key, *slices):
        store.put(ns, name, snap)
    whole = store.identity(ns, key)
    assert whole is not None
    REFUSED.add(key, whole, verified_scope(None))
    found = sched._states_set(key)
    assert found is not None and [p.name for p in found] == slices
    assert [p.name for p in sched._load_set(key, 0, 0)] == slices
    # One slice's states taken at another token: the slices do not join, and no set carries the chunk's states.
    assert snap.states is not None
    store.put(ns, slices[1], replace(snap, states=replace(snap.states, positions=(32,))), replace=True)
    assert sched._states_set(key) is None


def _truncate(path: Path) -> None:
    """Damage a stored file as a torn copy or a full disk would: its second half gone."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_damaged_whole_file_refused_by_a_lookup_hides_no_slices_of_its_chunk(tmp_path: Path) -> None:
    """Found by a review: chunk 1 stored whole (a TP=1 save) and as a complete set of TP=2 slices; the whole file
    is damaged. The lookup moved it aside and stopped there, recomputing a chunk whose slices were fine (only a
    later lookup found them). It looks up the chunk once more and loads the slices; the next ask replays that."""
    from hurray_vllm.chunks.store import store_snapshot
    from hurray_vllm.kv.heads import distinct_ranks, rank_heads, select_heads

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    for r in distinct_ranks(HEADS, 2):
        store_snapshot(store, select_heads(snap, rank_heads(HEADS, 2, r)), CHUNK)
    whole = store.path(ns, keys[1])
    _truncate(whole)
    sched = _scheduler(_config(tmp_path), store, ns)
    read = counting_reads(sched)
    request = _request("r", list(snap.token_ids[0]))
    assert sched.get_num_new_matched_tokens(request, 0) == (16, False)
    load = sched._reqs["r"].load
    assert load is not None and load.keys == keys
    assert [p[0] for p in load.parts[0]] == [keys[0]]
    assert [p[0] for p in load.parts[1]] == [p.name for p in store.parts(ns, keys[1], HEADS) or []] != [keys[1]]
    assert not whole.exists() and whole.with_name(whole.name + ".bad").exists()
    assert sched.stats.chunks_quarantined == 1 and sched.stats.chunks_refused == 1
    seen = len(read)
    assert sched.get_num_new_matched_tokens(request, 0) == (16, False)
    assert len(read) == seen and sched._reqs["r"].load is load  # replayed: nothing read again

    # The slices damaged too: chunk 1 is looked up once more, not again and again; chunk 0 still loads.
    slices = store.parts(ns, keys[1], HEADS)
    assert slices is not None and len(slices) == 2
    _truncate(store.path(ns, slices[0].name))
    store_snapshot(store, snap, CHUNK)  # the whole file written again (damaged below)
    _truncate(whole)
    again = _scheduler(_config(tmp_path), store, ns)
    assert again.get_num_new_matched_tokens(_request("s", list(snap.token_ids[0])), 0) == (8, False)
    assert again.stats.chunks_quarantined == 2 and store.parts(ns, keys[1], HEADS) is None


def test_a_reset_keys_the_requests_that_hold_no_kv_with_the_new_epoch(tmp_path: Path) -> None:
    from hurray_vllm.adapters.vllm.connector.scheduler import request_seed

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    sched = _scheduler(_config(tmp_path), store, ns)
    tokens = list(snap.token_ids[0])
    announced = {"hurray_saved_tokens": 16 + CHUNK}  # a source's chunk still on its way (under the old keys)
    waiting = _request("w", [*tokens, *range(8)], num_computed_tokens=0)
    waiting.kv_transfer_params = announced
    running = _request("run", tokens, num_computed_tokens=16)
    assert sched.get_num_new_matched_tokens(waiting, 0) == (None, False)
    sched._state(running)
    assert sched.reset_cache() is True
    assert sched._reqs["run"].seed is None  # runs on KV from before the reset: neither loaded nor saved
    seed = sched._reqs["w"].seed
    assert seed is not None and seed == request_seed(ns, waiting, sched._epoch) != request_seed(ns, waiting)
    # It waits for nothing announced under the old keys, loads none of them, and saves under the new ones.
    assert sched.get_num_new_matched_tokens(waiting, 0) == (0, False)
    state = sched._reqs["w"]
    state.block_ids = [1, 2, 3, 4, 5, 6]
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "w", state, 24)
    assert len(meta.saves) == 3 and not {t.key for t in meta.saves} & set(keys)


def test_after_a_reset_no_request_waits_for_pushed_chunks_and_none_are_announced(tmp_path: Path) -> None:
    """After reset_cache the keys carry this engine's own epoch: no source pushes under them, and no destination
    derives the keys of what this engine saves. Before, every migrated-in request waited hurray_push_wait_s in
    vain, and a source announced chunks a destination then waited for in vain."""
    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    sched = _scheduler(_config(tmp_path, push_wait_s=60.0), store, ns)
    tokens = [*snap.token_ids[0], 7]
    sched.reset_cache()
    moved_in = _request("m", tokens, num_computed_tokens=0)
    moved_in.kv_transfer_params = {"hurray_saved_tokens": 16}
    assert sched.get_num_new_matched_tokens(moved_in, 0) == (0, False)  # the old keys' chunks are not loaded
    assert sched.stats.push_waits == 0 and sched.stats.push_wait_timeouts == 0
    # What a request computes after the reset is still saved, under the epoch's keys, and never announced.
    request = _request("r", tokens, num_computed_tokens=0)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, _blocks([1, 2, 3, 4, 5]), 0)
    new = SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=0)
    saves = sched.build_connector_meta(_output([new], {"r": len(tokens)})).saves
    assert len(saves) == 2 and not {t.key for t in saves} & set(keys)
    assert sched.request_finished(request) == (False, None)


def test_a_push_wait_of_zero_holds_no_request(tmp_path: Path) -> None:
    from hurray_vllm.chunks.keys import namespace_of
    from hurray_vllm.chunks.store import DirectoryStore

    store = DirectoryStore(tmp_path / "empty")
    sched = _scheduler(_config(tmp_path, push_wait_s=0.0), store, namespace_of(gqa_fingerprint()))
    request = _request("m", list(range(17)))
    request.kv_transfer_params = {"hurray_saved_tokens": 16}
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert sched.stats.push_waits == 0 and sched.stats.push_wait_timeouts == 0


def test_a_chunk_refused_and_left_in_place_is_read_warned_about_and_counted_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Unsigned chunks under hurray_key_file: vLLM asks again for a waiting request at every step, and every
    request with the prefix asks. The file was read, MAC-checked, logged and counted each time."""
    from hurray_vllm.chunks.signing import FleetKeys

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)  # unsigned
    sched = _scheduler(_config(tmp_path, keys=FleetKeys.from_secrets(b"k" * 32)), store, ns)
    read = counting_reads(sched)
    tokens = [*snap.token_ids[0], 7]
    with caplog.at_level(logging.WARNING, logger="hurray_vllm.connector"):
        for _ in range(5):
            assert sched.get_num_new_matched_tokens(_request("r", tokens), 0) == (0, False)
        first = len(read)
        assert first >= 1 and sched.stats.chunks_refused == sched.stats.chunks_unsigned == 1
        # Another request with the prefix stops at the refused chunk after a stat.
        assert sched.get_num_new_matched_tokens(_request("s", tokens), 0) == (0, False)
        assert len(read) == first and sched.stats.chunks_refused == 1
        # A file changed since (another identity) is judged again.
        path = store.path(ns, keys[0])
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        assert sched.get_num_new_matched_tokens(_request("t", tokens), 0) == (0, False)
    assert len(read) > first and sched.stats.chunks_refused == 2
    assert len([r for r in caplog.records if "refusing chunk" in r.getMessage()]) == 2


def test_a_lookup_cut_short_by_a_passing_error_is_read_again_while_vllm_asks_again(tmp_path: Path) -> None:
    """Out of memory reading a chunk says nothing about its file: it is neither remembered as refused nor replayed
    as the request's answer; each ask reads again (found by a review: the same request asking again at the next
    step was offered nothing without a read, while the file was fine)."""
    import errno

    store, ns, _, snap = stored_at_tp(tmp_path, 1)
    sched = _scheduler(_config(tmp_path), store, ns)
    read: list[str] = []

    def short_of_memory(part: Any, tokens: Any, reader: Any = None) -> Any:
        read.append(part.name)
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    sched._read_part = short_of_memory
    tokens = [*snap.token_ids[0], 7]
    for _ in range(3):
        assert sched.get_num_new_matched_tokens(_request("r", tokens), 0) == (0, False)
    assert len(read) == 3 and sched.stats.chunks_refused == 3
    # vLLM took the answer: a later lookup (a preemption) looks again, as does another request.
    sched.update_state_after_alloc(_request("r", tokens), _blocks([1, 2, 3, 4, 5]), 0)
    assert sched.get_num_new_matched_tokens(_request("r", tokens), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(_request("s", tokens), 0) == (0, False)
    assert len(read) == 5 and sched.stats.chunks_refused == 5


@pytest.mark.parametrize("code", ["EMFILE", "ENOMEM"])
def test_the_next_ask_after_a_passing_error_loads_what_it_could_not_read(tmp_path: Path, code: str) -> None:
    """The error passed (a descriptor freed): the same request asking again at the next step (vLLM could not
    allocate its blocks yet) loads the chunks, also the one the error cut a load short before."""
    import errno

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    tokens = [*snap.token_ids[0], 7]
    for failing, first_answer in ((0, 0), (1, 8)):  # chunk 0's read fails: nothing; chunk 1's: chunk 0 only
        sched = _scheduler(_config(tmp_path), store, ns)
        real, fails = sched._read_part, [keys[failing]]

        def passing(part: Any, tokens: Any, reader: Any = None, real: Any = real, fails: list[str] = fails) -> Any:
            if part.name in fails:
                fails.remove(part.name)
                raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
            return real(part, tokens, reader)

        sched._read_part = passing
        request = _request("r", tokens)
        assert sched.get_num_new_matched_tokens(request, 0) == (first_answer, False)
        assert sched.get_num_new_matched_tokens(request, 0) == (16, False)
        assert sched._reqs["r"].load is not None and len(sched._reqs["r"].load.keys) == 2
        # Once read whole, the answer is replayed again while vLLM asks (no file read).
        sched._read_part = None
        assert sched.get_num_new_matched_tokens(request, 0) == (16, False)


def test_a_linear_attention_hybrid_reads_no_chunk_when_none_holds_states(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without states in any stored chunk no resume is possible: every chunk was read and checksummed for
    nothing, and the headers were read backwards again at every step vLLM asked."""
    from hurray_vllm.adapters.vllm.connector.metadata import forget_verified_chunks

    store, ns, _, snap = stored_at_tp(tmp_path, 1)  # no states
    sched = _scheduler(_config(tmp_path, state_groups=(0,), tails=False), store, ns)
    read = counting_reads(sched)
    headers = counting_headers(monkeypatch)
    tokens = [*snap.token_ids[0], 7]
    for rid in ("r", "r", "s"):
        forget_verified_chunks()
        assert sched.get_num_new_matched_tokens(_request(rid, tokens), 0) == (0, False)
    assert read == [] and len(headers) == 2  # each file's header once


def test_a_load_after_a_local_hit_saves_the_hit_chunks_the_store_lacks(tmp_path: Path) -> None:
    """The local prefix-cache hit's chunk 0 is not stored (pruned, a save that failed): it was counted as saved
    and announced, and a destination waited for it in vain. It is saved from the engine's blocks; the loaded
    chunk 1 is not saved again."""
    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    tokens = [*snap.token_ids[0], 7]
    for stored, planned in ((True, []), (False, [(keys[0], [1, 2])])):
        if not stored:
            store.path(ns, keys[0]).unlink()
        sched = _scheduler(_config(tmp_path), store, ns)
        request = _request("r", tokens)
        assert sched.get_num_new_matched_tokens(request, 8) == (8, False)
        sched.update_state_after_alloc(request, _blocks([1, 2, 3, 4, 5]), 8)
        new = SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=16)
        meta = sched.build_connector_meta(_output([new], {"r": 1}))
        ((load,),) = [meta.loads]
        assert load.keys == [keys[1]] and load.block_ids == [3, 4]
        assert [(t.key, t.block_ids) for t in meta.saves] == planned, stored
        assert sched.request_finished(request) == (False, {"hurray_saved_tokens": 16})


def _failing_load_and_another_request(
    tmp_path: Path, b_tokens: list[int] | None, b_blocks: list[int], b_hit: int, in_flight: int = 1
) -> tuple[Any, Any, Any, list[list[tuple[str, str]]]]:
    """Request A loads its two stored chunks into blocks 1-4 (synchronously); B is scheduled in the same step
    (``b_tokens``: None for A's 16 tokens then 9 of its own; ``b_hit``: its local prefix-cache hit). A worker's
    read of A's chunk 1 then fails (the file pruned meanwhile). Returns the scheduler, B, the step's metadata and
    what the worker hands its saving (``(request, key)`` per chunk, saved nowhere) in that step."""
    from bare_worker import cpu_worker

    from hurray_vllm.adapters.vllm.connector.metadata import forget_verified_chunks

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    sched = _scheduler(_config(tmp_path, worker_in_process=False, steps_in_flight=in_flight), store, ns)
    a = _request("A", list(snap.token_ids[0]))
    b = _request("B", b_tokens if b_tokens is not None else [*snap.token_ids[0][:16], *range(600, 609)])
    assert sched.get_num_new_matched_tokens(a, 0) == (16, False)
    assert sched.get_num_new_matched_tokens(b, b_hit) == (0, False)
    sched.update_state_after_alloc(a, _blocks([1, 2, 3, 4, 5]), 16)
    sched.update_state_after_alloc(b, _blocks(b_blocks), 0)
    new_a = SimpleNamespace(req_id="A", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=16)
    new_b = SimpleNamespace(req_id="B", block_ids=(b_blocks,), num_computed_tokens=b_hit)
    # B first: the scheduler knows the step's loads before it plans any save.
    meta = sched.build_connector_meta(_output([new_b, new_a], {"A": 1, "B": len(b.all_token_ids) - b_hit}))
    assert [load.request_id for load in meta.loads] == ["A"]
    store.path(ns, keys[1]).unlink()
    forget_verified_chunks()  # a worker process of its own: it reads the files
    w = cpu_worker(store, ns)
    handed: list[list[tuple[str, str]]] = []
    w._saves_here, w._shares_states, w._async = True, False, False
    w._save = lambda m, gathered=None: handed.append([(t.request_id, t.key) for t in m.saves])
    w.start_load_kv(meta)
    assert w.get_block_ids_with_load_errors() == {1, 2, 3, 4}
    w.wait_for_save(meta)
    return sched, b, meta, handed


def test_a_failed_load_does_not_cost_another_request_the_chunks_its_answer_announces(tmp_path: Path) -> None:
    """Found by a review: the worker dropped every save of a step whose synchronous load failed, B's too, while B's
    answer announced them (vLLM moves back only A: B never saved them); a continuation waited for them in vain."""
    sched, b, meta, handed = _failing_load_and_another_request(tmp_path, list(range(500, 517)), [6, 7, 8, 9, 10], 0)
    b_chunks = [("B", t.key) for t in meta.saves if t.request_id == "B"]
    assert len(b_chunks) == 2 and handed == [b_chunks]  # saved: B's blocks hold none of A's
    assert sched.request_finished(b) == (False, {"hurray_saved_tokens": 16})


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_chunk_that_read_blocks_a_load_in_flight_fills_is_dropped_when_the_load_fails(
    tmp_path: Path, in_flight: int
) -> None:
    """B's prefix-cache hit holds A's blocks, which A's load fills in the same step: B's chunks attend to them,
    but chunk 2's own blocks hold none of them. Its task names them (reads), so the worker that sees A's load fail
    does not store it wrong; B's chunks are planned at once (a load that succeeds costs nothing)."""
    sched, b, meta, handed = _failing_load_and_another_request(tmp_path, None, [1, 2, 3, 4, 8, 9, 10], 16, in_flight)
    (task,) = [t for t in meta.saves if t.request_id == "B"]  # chunk 2 (chunk 1 was stored when planned)
    assert task.block_ids == [8, 9] and task.reads == [1, 2, 3, 4]
    assert handed == []  # it read what the failed load left unwritten: not stored
    # vLLM moves B back too (it holds the failed blocks): its chunks are planned again once recomputed.
    out = _output([], {"B": len(b.all_token_ids)})
    c = out.scheduled_cached_reqs
    c.req_ids, c.new_block_ids, c.num_computed_tokens = ["B"], [None], [0]
    again = [t for t in sched.build_connector_meta(out).saves if t.request_id == "B"]
    assert [t.block_ids for t in again] == [[3, 4], [8, 9]]


def _load_task(store: Any, ns: str, keys: list[str], snap: Any) -> Any:
    """A worker's load of the two stored chunks into blocks 1-4, with the files as the scheduler verified them."""
    from hurray_vllm.adapters.vllm.connector.metadata import LoadTask

    parts = [store.parts(ns, k, HEADS) for k in keys]
    verified = [[(p.name, p.heads.start, p.heads.stop, p.identity) for p in ps] for ps in parts if ps is not None]
    tokens = [list(snap.token_ids[0][c * CHUNK : (c + 1) * CHUNK]) for c in range(2)]
    return LoadTask("r", keys, tokens, [1, 2, 3, 4], verified)


def _counting_touches(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[float]]:
    """The chunk files a byte of which is read to move their access time from now on (file names, not read), and
    the clock (``time.monotonic``) the connector parts see: move its only element to let time pass."""
    from hurray_vllm.chunks import store as store_module

    touched: list[str] = []
    clock = [1000.0]
    monkeypatch.setattr(store_module, "touch_file", lambda path: touched.append(path.name))
    monkeypatch.setattr(store_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    return touched, clock


def test_a_chunk_the_scheduler_serves_from_memory_has_a_byte_of_its_file_read_once_an_hour(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: prune deletes the least recently used chunks by their files' access times, and a chunk the
    scheduler served from its verified copies was never read again: the hottest prefix kept its first read's time
    and was pruned first. A use now reads a byte of the file (not os.utime: it would move the change time, and
    with it the file's identity), at most once an hour per file."""
    from hurray_vllm.chunks.store import TOUCH_INTERVAL_S

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    sched = _scheduler(_config(tmp_path), store, ns)
    touched, clock = _counting_touches(monkeypatch)
    tokens = [*snap.token_ids[0], 7]
    assert sched.get_num_new_matched_tokens(_request("r0", tokens), 0) == (16, False)
    assert sched.stats.chunks_remembered == 0 and touched == []  # read from the files: that moved their times
    for i in range(1, 4):  # other requests with the prefix, within the hour: a dictionary look-up each
        clock[0] += 60
        assert sched.get_num_new_matched_tokens(_request(f"r{i}", tokens), 0) == (16, False)
    assert sched.stats.chunks_remembered == 6 and touched == []
    clock[0] += TOUCH_INTERVAL_S
    for i in range(4, 7):
        assert sched.get_num_new_matched_tokens(_request(f"r{i}", tokens), 0) == (16, False)
    assert sched.stats.chunks_remembered == 12
    assert touched == [f"{k}.hrry" for k in keys]  # once each in the hour
    clock[0] += TOUCH_INTERVAL_S
    assert sched.get_num_new_matched_tokens(_request("r7", tokens), 0) == (16, False)
    assert touched == [f"{k}.hrry" for k in keys] * 2


def test_a_chunk_a_worker_serves_from_memory_has_a_byte_of_its_file_read_once_an_hour(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the scheduler's: a worker in a process of its own serves the files it verified before from memory."""
    from bare_worker import cpu_worker

    from hurray_vllm.chunks.store import TOUCH_INTERVAL_S

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    task = _load_task(store, ns, keys, snap)
    w = cpu_worker(store, ns)
    touched, clock = _counting_touches(monkeypatch)
    for _ in range(3):  # the first reads the files, the others take the verified copies
        assert [len(w._chunk_for_load(w._ec, task, c)) for c in range(2)] == [1, 1]
        clock[0] += 60
    assert touched == []
    clock[0] += TOUCH_INTERVAL_S
    for _ in range(3):
        assert [len(w._chunk_for_load(w._ec, task, c)) for c in range(2)] == [1, 1]
    assert touched == [f"{k}.hrry" for k in keys]


def test_a_chunk_pruned_since_the_lookup_s_stat_is_a_miss_not_a_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a review: a chunk a prune deleted between a lookup's stat and its read was counted in
    chunks_refused, warned about as refused ("refusing chunk") and a quarantine tried; it is a plain miss."""
    from hurray_vllm.adapters.vllm.connector.metadata import REFUSED
    from hurray_vllm.chunks.store import DirectoryStore, store_snapshot

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    sched = _scheduler(_config(tmp_path, tails=False), store, ns)
    gone = store.path(ns, keys[1])
    ident = store.identity(ns, keys[1])
    real_reader = DirectoryStore.reader

    def reader(self: Any, namespace: str, names: Any, submit: Any, **kwargs: Any) -> Any:
        gone.unlink(missing_ok=True)  # a prune lands between the lookup's stat and its read
        return real_reader(self, namespace, names, submit, **kwargs)

    moved: list[str] = []
    real_quarantine = DirectoryStore.quarantine

    def quarantine(self: Any, namespace: str, key: str, identity: Any) -> Any:
        moved.append(key)
        return real_quarantine(self, namespace, key, identity)

    monkeypatch.setattr(DirectoryStore, "reader", reader)
    monkeypatch.setattr(DirectoryStore, "quarantine", quarantine)
    tokens = [*snap.token_ids[0], 7]
    with caplog.at_level(logging.DEBUG, logger="hurray_vllm.connector"):
        assert sched.get_num_new_matched_tokens(_request("r", tokens), 0) == (8, False)
    assert sched.stats.chunks_refused == 0 and moved == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert ident is not None and not REFUSED.has(keys[1], ident)
    # Stored again by a producer: the next lookup finds it.
    monkeypatch.setattr(DirectoryStore, "reader", real_reader)
    assert store_snapshot(store, snap, CHUNK) == 1
    assert sched.get_num_new_matched_tokens(_request("s", tokens), 0) == (16, False)


def test_a_chunk_pruned_before_a_worker_reads_it_fails_the_load_but_is_no_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's read of a chunk gone since it took the file's identity: the load fails (to be recomputed), and
    no quarantine of a file that is not there is tried."""
    from bare_worker import cpu_worker

    from hurray_vllm.chunks.store import DirectoryStore
    from hurray_vllm.errors import HurrayFormatError

    store, ns, keys, snap = stored_at_tp(tmp_path, 1)
    task = _load_task(store, ns, keys, snap)
    w = cpu_worker(store, ns)
    real_get = DirectoryStore.get

    def get(self: Any, namespace: str, key: str, **kwargs: Any) -> Any:
        self.path(namespace, key).unlink(missing_ok=True)  # a prune lands between the identity and the read
        return real_get(self, namespace, key, **kwargs)

    moved: list[str] = []
    monkeypatch.setattr(DirectoryStore, "get", get)
    monkeypatch.setattr(DirectoryStore, "quarantine", lambda self, n, key, i: moved.append(key))
    with pytest.raises(HurrayFormatError) as err:
        w._chunk_for_load(w._ec, task, 0)
    assert err.value.field == "store" and moved == []
