"""Which chunks prune keeps: loadable prefixes, never a chunk whose parent it deleted (no engine needed).

A consumer loads a prompt's chunks in order and stops at the first one
missing, so a chunk whose parent (the chunk before it in its prefix) is gone
is dead weight. Producers write a prefix's chunks in order and consumers read
them in order, so by file times alone the head of every prefix is its oldest
chunk: prune went head first and kept only unreachable chunks. Each chunk now
names its parent in its header, and prune ranks a chunk by the latest use of
it or of anything after it.
"""

from __future__ import annotations

import errno
import importlib
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from bare_worker import HEADS, stored_at_tp
from synthetic import make_snapshot

import hurray_vllm as hv
from hurray_vllm.chunks import keys as keys_module
from hurray_vllm.chunks.digest import DIGEST_KEY, chunk_digest
from hurray_vllm.chunks.keys import chunks_of, namespace_of
from hurray_vllm.chunks.store import DirectoryStore, read_header, verify_chunk

FP = hv.ModelFingerprint("X", 2, 2, 16, "bfloat16")
NS = namespace_of(FP)
prune_module = importlib.import_module("hurray_vllm.chunks.prune")  # the package re-exports the function


def _chunks(tokens: list[int], *, tails: bool = False) -> list[tuple[str, hv.KVSnapshot]]:
    """One prompt's chunks of 4 tokens (pages of 4), keyed and made as ``store_snapshot`` makes them."""
    snap = make_snapshot([len(tokens)], [0], 4)
    return chunks_of(replace(snap, fingerprint=FP, token_ids=(tuple(tokens),)), 4, tails=tails)


def _put(store: DirectoryStore, chunks: list[tuple[str, hv.KVSnapshot]], t: float, step: float = 10.0) -> float:
    """Store ``chunks`` as a producer writes them and a consumer reads them: in order, each used after the one before.

    Returns the time after the last one's.
    """
    for key, chunk in chunks:
        if store.put(NS, key, chunk):  # one stored already (a shared head) keeps its times (relatime)
            os.utime(store.path(NS, key), (t, t))
        t += step
    return t


def _size(store: DirectoryStore, *keys: str) -> int:
    return sum(store.path(NS, k).stat().st_size for k in keys)


def _without_parent(chunk: hv.KVSnapshot) -> hv.KVSnapshot:
    """``chunk`` as a writer from before parents were recorded wrote it (its digest made again)."""
    extra = {k: v for k, v in chunk.extra.items() if k not in (keys_module.PARENT_KEY, DIGEST_KEY)}
    bare = replace(chunk, extra=extra)
    return replace(bare, extra={**extra, DIGEST_KEY: chunk_digest(bare)})


def _with_parent(chunk: hv.KVSnapshot, parent: object) -> hv.KVSnapshot:
    """``chunk`` naming ``parent`` (whatever it is), with a digest that matches: a crafted or corrupt writer's."""
    extra = {k: v for k, v in chunk.extra.items() if k not in (keys_module.PARENT_KEY, DIGEST_KEY)}
    bare = replace(chunk, extra={**extra, keys_module.PARENT_KEY: parent})
    return replace(bare, extra={**bare.extra, DIGEST_KEY: chunk_digest(bare)})


def _verify(chunk: hv.KVSnapshot) -> None:
    verify_chunk(chunk, FP, list(chunk.token_ids[0]))


def test_chunks_name_their_parent_and_the_digest_covers_it() -> None:
    chunks = _chunks(list(range(14)), tails=True)  # 3 whole chunks; 2 tokens left, less than a page: no tail
    keys = [k for k, _ in chunks]
    assert len(keys) == 3
    parents = [c.extra.get(keys_module.PARENT_KEY) for _, c in chunks]
    assert parents == [None, keys[0], keys[1]]
    assert keys_module.PARENT_KEY not in chunks[0][1].extra  # the first chunk names none
    for _, chunk in chunks:
        _verify(chunk)
    _, second = chunks[1]
    forged = replace(second, extra={**second.extra, keys_module.PARENT_KEY: "0" * 32})
    with pytest.raises(hv.HurrayFormatError, match="digest"):
        _verify(forged)


def test_a_tail_names_the_last_whole_chunk_and_a_snapshot_s_own_parent_is_not_copied() -> None:
    tokens = list(range(16))
    chunks = _chunks(tokens, tails=True)  # 4 whole chunks, no tail (16 tokens)
    assert [c.extra.get(keys_module.PARENT_KEY) for _, c in chunks][1:] == [k for k, _ in chunks][:-1]
    snap = make_snapshot([14], [0], 2)
    snap = replace(snap, fingerprint=FP, token_ids=(tuple(range(14)),), extra={keys_module.PARENT_KEY: "ab" * 16})
    got = chunks_of(snap, 4, tails=True)  # 3 whole chunks of 4 and a tail of 2 tokens
    keys = [k for k, _ in got]
    assert [c.extra.get(keys_module.PARENT_KEY) for _, c in got] == [None, keys[0], keys[1], keys[2]]
    for _, c in got:
        _verify(c)


def test_prune_keeps_the_head_of_a_prefix_written_and_read_in_order(tmp_path: Path) -> None:
    """The reviewer's case: 4 chunks written and read in order, pruned to half: chunks 2 and 3 were kept."""
    store = DirectoryStore(tmp_path)
    chunks = _chunks(list(range(16)))
    keys = [k for k, _ in chunks]
    _put(store, chunks, time.time() - 1000)
    report = store.prune(_size(store, keys[0], keys[1]))
    assert [store.has(NS, k) for k in keys] == [True, True, False, False]
    assert (report.chunks_removed, report.chunks_kept) == (2, 2)


def test_prune_keeps_a_shared_head_and_whole_branches(tmp_path: Path) -> None:
    """Three prompts sharing a head chunk (a system prompt), each run later than the one before: every chunk kept
    was unreachable (the head, used first, went first)."""
    store = DirectoryStore(tmp_path)
    t = time.time() - 1000
    prompts = {}
    for name, base in (("a", 10), ("b", 20), ("c", 30)):
        chunks = _chunks([1, 2, 3, 4, *range(base, base + 8)])
        prompts[name] = [k for k, _ in chunks]
        t = _put(store, chunks, t)
    head, a1, a2 = prompts["a"]
    _, b1, b2 = prompts["b"]
    _, c1, c2 = prompts["c"]
    assert prompts["b"][0] == prompts["c"][0] == head
    report = store.prune(_size(store, head, b1, c1, c2))
    kept = {k for k in (head, a1, a2, b1, b2, c1, c2) if store.has(NS, k)}
    assert kept == {head, b1, c1, c2}  # the oldest branch whole, then the next one's tail
    assert report.chunks_removed == 3
    # Every chunk kept loads: its parent is kept too.
    for key in kept:
        header = read_header(store.path(NS, key))
        assert header is not None
        parent = header.extra.get(keys_module.PARENT_KEY)
        assert parent is None or parent in kept
    assert store.prune(_size(store, head)).chunks_kept == 1 and store.has(NS, head)


def test_prune_takes_a_tensor_parallel_chunk_whole_and_in_prefix_order(tmp_path: Path) -> None:
    store, ns, keys, _ = stored_at_tp(tmp_path, 2)
    files = {k: sorted((tmp_path / "tp2" / ns).glob(f"{k}.h*.hrry")) for k in keys}
    assert all(len(f) == 2 for f in files.values())
    for path in files[keys[1]]:  # slices name the previous chunk's key, not a slice of it
        header = read_header(path)
        assert header is not None and header.extra.get(keys_module.PARENT_KEY) == keys[0]
    now = time.time()
    for age, path in zip((900, 500, 400, 300), [*files[keys[0]], *files[keys[1]]], strict=True):
        os.utime(path, (now - age, now - age))
    size = sum(p.stat().st_size for p in files[keys[0]])
    report = store.prune(size)
    assert all(p.exists() for p in files[keys[0]]) and not any(p.exists() for p in files[keys[1]])
    assert (report.chunks_removed, report.chunks_kept) == (2, 2)


def test_files_without_a_parent_are_ranked_by_their_own_use(tmp_path: Path) -> None:
    """A file from a writer that did not record parents is a root, ranked by its own times, as before; a newer
    chunk naming it as its parent keeps it."""
    store = DirectoryStore(tmp_path)
    now = time.time()
    old = [(k, _without_parent(c)) for k, c in _chunks(list(range(100, 108)))]  # an older writer's prefix
    _put(store, old, now - 1000)  # old[0] used longest ago
    other = _chunks(list(range(200, 204)))
    _put(store, other, now - 900)
    # A newer producer extends the old prefix: its chunk 2 names old[1] as parent.
    longer = _chunks(list(range(100, 112)))
    assert [k for k, _ in longer[:2]] == [k for k, _ in old]
    _put(store, longer[2:], now - 100)
    keys = [old[0][0], old[1][0], other[0][0], longer[2][0]]
    report = store.prune(_size(store, keys[1], keys[3]))
    # old[0] has no recorded child: it goes by its own time, the oldest; old[1] is the newer chunk's parent.
    assert [store.has(NS, k) for k in keys] == [False, True, False, True]
    assert report.chunks_removed == 2


def test_crafted_parents_rank_a_file_by_its_own_use(tmp_path: Path) -> None:
    """Parents that cannot be (a cycle, itself, no key, a chunk not stored) are no links: nothing breaks."""
    store = DirectoryStore(tmp_path)
    now = time.time()
    chunks = _chunks(list(range(300, 324)))  # 6 chunks; their parents are rewritten below
    keys = [k for k, _ in chunks]
    parents: list[Any] = [keys[1], keys[0], keys[2], "not a key", "ff" * 16, 7]
    for i, ((key, chunk), parent) in enumerate(zip(chunks, parents, strict=True)):
        store.put(NS, key, _with_parent(chunk, parent))
        os.utime(store.path(NS, key), (now - 600 + 100 * i, now - 600 + 100 * i))
    report = store.prune(_size(store, *keys[3:]))
    assert [store.has(NS, k) for k in keys] == [False, False, False, True, True, True]
    assert report.chunks_removed == 3 and not report.skipped
    assert store.prune(0).chunks_kept == 0


def test_dry_run_names_what_the_prune_then_deletes(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    chunks = _chunks(list(range(16)))
    keys = [k for k, _ in chunks]
    _put(store, chunks, time.time() - 1000)
    limit = _size(store, keys[0])
    dry = store.prune(limit, dry_run=True)
    assert all(store.has(NS, k) for k in keys)
    report = store.prune(limit)
    assert (dry.chunks_removed, dry.bytes_kept) == (report.chunks_removed, report.bytes_kept) == (3, limit)
    assert [store.has(NS, k) for k in keys] == [True, False, False, False]


def _cannot_delete(monkeypatch: pytest.MonkeyPatch, how: str, stuck: Callable[[Path], bool]) -> None:
    """Prune cannot delete the files ``stuck`` picks: ``how`` "refused" (EACCES) or "written again" (a new file)."""
    real = prune_module.take_if_same

    def take(path: Path, identity: tuple[int, ...], dest: Path | None) -> bool:
        if stuck(path):
            if how == "refused":
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return False
        return real(path, identity, dest)

    monkeypatch.setattr(prune_module, "take_if_same", take)


@pytest.mark.parametrize("how", ["refused", "written again"])
def test_a_chunk_that_could_not_be_deleted_keeps_its_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A chunk left in place (no permission, or a producer's rename over it since the scan) keeps the chunks
    before it: deleting them would leave it unreachable."""
    store = DirectoryStore(tmp_path)
    chunks = _chunks(list(range(16)))
    keys = [k for k, _ in chunks]
    _put(store, chunks, time.time() - 1000)
    stuck = store.path(NS, keys[2])
    _cannot_delete(monkeypatch, how, lambda path: path == stuck)
    report = store.prune(0)
    assert [store.has(NS, k) for k in keys] == [True, True, True, False]
    assert report.chunks_removed == 1 and report.chunks_kept == 3
    assert report.bytes_kept == _size(store, *keys[:3])
    assert any(str(stuck) in s for s in report.skipped) == (how == "refused")


@pytest.mark.parametrize("how", ["refused", "written again"])
def test_a_tensor_parallel_chunk_whose_slice_could_not_be_deleted_stays_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A slice left in place keeps the chunk's other slices (a lone slice can never load) and the chunks before it."""
    store, ns, keys, _ = stored_at_tp(tmp_path, 2)
    files = {k: sorted((tmp_path / "tp2" / ns).glob(f"{k}.h*.hrry")) for k in keys}
    assert all(len(f) == 2 for f in files.values())
    stuck: list[Path] = []

    def first(path: Path) -> bool:  # the first file prune deletes: one slice of the last chunk
        if stuck:
            return False
        stuck.append(path)
        return True

    _cannot_delete(monkeypatch, how, first)
    report = store.prune(0)
    assert stuck and stuck[0] in files[keys[1]]
    assert all(p.exists() for k in keys for p in files[k])
    assert (report.chunks_removed, report.chunks_kept) == (0, 4)
    assert report.bytes_kept == sum(p.stat().st_size for k in keys for p in files[k])
    assert all(store.parts(ns, k, HEADS) is not None for k in keys)


def test_keyed_prune_deletes_foreign_chunks_first_then_prefixes_from_their_tails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hurray_vllm.chunks.signing import FleetKeys, sign_chunk

    keys = FleetKeys.from_secrets(b"k" * 32)
    store = DirectoryStore(tmp_path)
    chunks = _chunks(list(range(12)))
    names = [k for k, _ in chunks]
    now = time.time()
    _put(store, [(k, sign_chunk(c, keys, NS, k)) for k, c in chunks], now - 1000)
    (foreign,) = _chunks(list(range(500, 504)))
    _put(store, [foreign], now)  # unsigned, the most recently used: goes all the same
    reads = _counting_headers(monkeypatch)
    report = store.prune(_size(store, names[0], names[1]), keys=keys)
    assert [store.has(NS, k) for k in names] == [True, True, False] and not store.has(NS, foreign[0])
    assert (report.foreign_removed, report.chunks_removed, report.chunks_kept) == (1, 2, 2)
    assert sorted(reads) == sorted(f"{k}.hrry" for k in [*names, foreign[0]])  # one header read per file


def _counting_headers(monkeypatch: pytest.MonkeyPatch, fail: set[str] | None = None) -> list[str]:
    """The chunk files whose headers are read from now on; ``fail``: file names whose reads fail (EIO)."""
    from hurray_vllm.chunks import store as store_module

    read: list[str] = []
    real = store_module.read_header

    def counted(path: Path, **kwargs: bool) -> Any:
        read.append(path.name)
        if fail and path.name in fail:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path, **kwargs)

    monkeypatch.setattr(store_module, "read_header", counted)
    return read


def test_prune_reads_headers_only_when_it_deletes_and_goes_on_without_an_unreadable_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DirectoryStore(tmp_path)
    chunks = _chunks(list(range(16)))
    keys = [k for k, _ in chunks]
    _put(store, chunks, time.time() - 1000)
    reads = _counting_headers(monkeypatch, fail={f"{keys[3]}.hrry"})
    report = store.prune(1 << 40)
    assert reads == [] and report.chunks_kept == 4  # nothing to delete: nothing to rank
    # Chunk 3's header cannot be read: it is ranked by its own time (the most recent), as every file was before;
    # the others by their own chain.
    report = store.prune(_size(store, keys[0], keys[1]))
    assert sorted(reads) == sorted(f"{k}.hrry" for k in keys)
    assert [store.has(NS, k) for k in keys] == [True, False, False, True]
    assert report.chunks_removed == 2 and not report.skipped  # unkeyed: the read is no verdict on anything


def test_a_tensor_parallel_chunk_is_ranked_by_its_latest_used_slice(tmp_path: Path) -> None:
    """A TP chunk read 10 s ago through one slice (its other written 900 s ago) is newer than a whole chunk used
    500 s ago: ranked by its oldest file, it went first and the older chunk stayed."""
    from hurray_vllm.chunks.keys import slice_key
    from hurray_vllm.kv.heads import select_heads

    store = DirectoryStore(tmp_path)
    (tp_key, tp_chunk), (whole_key, whole) = (_chunks(tokens)[0] for tokens in ([1, 2, 3, 4], [9, 8, 7, 6]))
    halves = [range(0, 1), range(1, 2)]
    for heads in halves:
        assert store.put(NS, slice_key(tp_key, heads), select_heads(tp_chunk, heads))
    assert store.put(NS, whole_key, whole)
    now = time.time()
    slices = [store.path(NS, slice_key(tp_key, h)) for h in halves]
    for path, age in ((slices[0], 900), (slices[1], 10), (store.path(NS, whole_key), 500)):
        os.utime(path, (now - age, now - age))
    room = sum(p.stat().st_size for p in slices)
    assert room >= _size(store, whole_key)  # room for either chunk, not both
    report = store.prune(room)
    assert all(p.exists() for p in slices) and not store.has(NS, whole_key)
    assert (report.chunks_removed, report.chunks_kept) == (1, 2)


@pytest.mark.parametrize("max_bytes", [float("nan"), -float("inf"), 1.5, -0.5, "x", None, True])
def test_a_max_bytes_that_is_not_an_integer_is_refused_and_nothing_deleted(tmp_path: Path, max_bytes: Any) -> None:
    """nan compared false with every total and deleted nothing, silently; 1.5 counted as the next byte up; a string
    or None failed with a bare TypeError. The CLI passes an int (``--max-size 20G``)."""
    store = DirectoryStore(tmp_path)
    chunks = _chunks(list(range(8)))
    _put(store, chunks, time.time() - 1000)
    with pytest.raises(hv.HurrayArgumentError) as err:
        prune_module.prune(store, max_bytes)
    assert err.value.field == "max_bytes"
    assert all(store.has(NS, k) for k, _ in chunks)
    assert prune_module.prune(store, 0).chunks_removed == len(chunks)
