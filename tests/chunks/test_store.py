"""The chunk store: keys, integrity, atomic puts, quarantine and pruning (no engine needed)."""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from blocking import within
from synthetic import example_chunk, make_snapshot

import hurray_vllm as hv
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.chunks.store import (
    DirectoryStore,
    chunk_keys,
    chunks_of,
    namespace_of,
    store_snapshot,
    tail_keys,
    verify_chunk,
)


def test_keys_chain_over_the_prefix() -> None:
    a = chunk_keys(list(range(20)), 8, "ns")
    b = chunk_keys([*range(8), 99, *range(9, 20)], 8, "ns")
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert chunk_keys(list(range(20)), 8, "other")[0] != a[0]


def test_a_snapshot_is_stored_with_its_tails_as_a_connector_saves_them(tmp_path: Path) -> None:
    """Chunks of 8 tokens, pages of 4: sequence 0 (6 tokens) has no whole chunk but one whole page, its tail."""
    snap = spec_example_snapshot()
    assert chunks_of(snap, 8) == []
    ((key, tail),) = chunks_of(snap, 8, tails=True)
    assert tail.fingerprint is not None
    ns, tokens = namespace_of(tail.fingerprint), list(snap.token_ids[0][:4])
    assert tail_keys(None, tokens, 4, ns) == [(4, key)]
    verify_chunk(tail, snap.fingerprint, tokens)  # type: ignore[arg-type]  # digest included
    assert torch.equal(tail[1, "key"].to_dense(0), snap[1, "key"].to_dense(0)[:4])
    store = DirectoryStore(tmp_path)
    assert store_snapshot(store, snap, 8, tails=False) == 0
    assert store_snapshot(store, snap, 8) == 1 and store.has(ns, key)


def test_chunks_verify_and_store_once(tmp_path: Path) -> None:
    snap = spec_example_snapshot()
    chunks = chunks_of(snap, 4)
    assert len(chunks) == 1  # sequence 0 has one whole chunk of 4 tokens, sequence 1 none
    key, chunk = chunks[0]
    assert chunk.fingerprint is not None
    verify_chunk(chunk, snap.fingerprint, list(snap.token_ids[0][:4]))  # type: ignore[arg-type]
    assert torch.equal(chunk[2, "value"].to_dense(0), snap[2, "value"].to_dense(0)[:4])
    store = DirectoryStore(tmp_path)
    assert store_snapshot(store, snap, 4) == 1
    assert store_snapshot(store, snap, 4) == 0  # already there
    ns = namespace_of(chunk.fingerprint)
    assert store.has(ns, key)
    with pytest.raises(hv.HurrayFormatError, match="another model"):
        verify_chunk(chunk, replace(chunk.fingerprint, head_dim=16), list(snap.token_ids[0][:4]))
    with pytest.raises(hv.HurrayFormatError, match="other tokens"):
        verify_chunk(chunk, chunk.fingerprint, [0, 0, 0, 0])
    bad = replace(chunk, extra={"hurray_vllm.chunk_digest": "00"})
    with pytest.raises(hv.HurrayFormatError, match="digest"):
        verify_chunk(bad, chunk.fingerprint, list(snap.token_ids[0][:4]))


def _one_chunk_store(root: Path) -> tuple[DirectoryStore, str, str, hv.KVSnapshot]:
    """A store holding the one whole chunk of the spec's example: (store, namespace, key, chunk)."""
    snap = spec_example_snapshot()
    store = DirectoryStore(root)
    store_snapshot(store, snap, 4)
    ((key, chunk),) = chunks_of(snap, 4)
    assert chunk.fingerprint is not None
    return store, namespace_of(chunk.fingerprint), key, chunk


def test_identity_tells_a_rewritten_chunk_file_from_the_one_seen(tmp_path: Path) -> None:
    store, ns, key, chunk = _one_chunk_store(tmp_path)
    assert store.identity(ns, "0" * 32) is None
    seen = store.identity(ns, key)
    assert seen is not None and seen[2] == store.path(ns, key).stat().st_size
    store.get(ns, key)
    assert store.identity(ns, key) == seen  # reading changes nothing
    path = store.path(ns, key)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 1
    time.sleep(0.05)  # file times tick in steps of a few milliseconds (see DirectoryStore.identity)
    with open(path, "r+b") as f:  # in place, same size: only the times tell
        f.write(bytes(raw))
    assert store.identity(ns, key) != seen
    replaced = store.identity(ns, key)
    path.unlink()
    hv.save(chunk, path)  # a new file under the same name
    assert store.identity(ns, key) not in (seen, replaced)


def test_quarantine_moves_only_the_file_that_was_found_damaged(tmp_path: Path) -> None:
    store, ns, key, chunk = _one_chunk_store(tmp_path)
    seen = store.identity(ns, key)
    assert seen is not None
    path = store.path(ns, key)
    path.unlink()
    hv.save(chunk, path)  # replaced since it was looked at: stays
    assert store.quarantine(ns, key, seen) is None and path.exists()
    now = store.identity(ns, key)
    assert now is not None
    moved = store.quarantine(ns, key, now)
    assert moved == path.with_name(path.name + ".bad") and moved.exists()
    assert not store.has(ns, key) and store.identity(ns, key) is None
    assert store.quarantine(ns, key, now) is None  # nothing left to move
    assert store.put(ns, key, chunk)  # the next producer writes it again


def test_quarantine_leaves_a_file_renamed_over_the_damaged_one_after_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer's rename landing between quarantine's identity check and its move: the fresh file stays."""
    store, ns, key, chunk = _one_chunk_store(tmp_path)
    seen = store.identity(ns, key)
    assert seen is not None
    real = DirectoryStore.identity

    def identity(self: DirectoryStore, n: str, k: str) -> tuple[int, ...] | None:
        found = real(self, n, k)
        self.put(n, k, chunk, replace=True)  # lands right after the check
        return found

    monkeypatch.setattr(DirectoryStore, "identity", identity)
    assert store.quarantine(ns, key, seen) is None
    monkeypatch.undo()
    assert store.has(ns, key) and store.identity(ns, key) != seen
    assert sorted(p.name for p in (tmp_path / ns).iterdir()) == [store.path(ns, key).name]  # no .bad, no temp


def test_prune_deletes_least_recently_used_chunks_and_leftovers(tmp_path: Path) -> None:
    import os

    store = DirectoryStore(tmp_path)
    snap = spec_example_snapshot()
    ((_, chunk),) = chunks_of(snap, 4)
    names = [f"{i:032x}" for i in range(4)]
    ns = "ab" * 8
    for name in names:
        store.put(ns, name, chunk)
    size = store.path(ns, names[0]).stat().st_size
    now = time.time()
    for i, name in enumerate(names):  # used long ago (0) ... recently (3)
        os.utime(store.path(ns, name), (now - 1000 + 100 * i, now - 2000))
    (tmp_path / ns / f"{names[0]}.hrry.bad").write_bytes(b"x" * 10)
    (tmp_path / ns / f".{names[1]}.hrry.1.tmp").write_bytes(b"x" * 10)
    os.utime(tmp_path / ns / f".{names[1]}.hrry.1.tmp", (now - 7200, now - 7200))
    (tmp_path / ns / f".{names[2]}.hrry.2.tmp").write_bytes(b"x" * 10)  # a writer may still be busy with it
    # Not the store's: a directory given by mistake keeps them, however old or large.
    (tmp_path / "snapshots").mkdir()
    (tmp_path / "snapshots" / "my_experiment.hrry").write_bytes(b"x" * 10)
    (tmp_path / ns / "notes.hrry").write_bytes(b"x" * 10)
    (tmp_path / ns / ".build.tmp").write_bytes(b"x" * 10)
    os.utime(tmp_path / ns / ".build.tmp", (now - 7200, now - 7200))

    dry = store.prune(2 * size, dry_run=True)
    assert (dry.chunks_removed, dry.bad_removed, dry.temp_removed) == (2, 1, 1)
    assert all(store.has(ns, n) for n in names)
    report = store.prune(2 * size)
    assert (report.chunks_removed, report.chunks_kept, report.bytes_kept) == (2, 2, 2 * size)
    assert report.bytes_removed == 2 * size + 20
    assert [store.has(ns, n) for n in names] == [False, False, True, True]
    left = sorted(p.name for p in (tmp_path / ns).iterdir() if not p.name.endswith(".hrry"))
    assert left == sorted([".build.tmp", f".{names[2]}.hrry.2.tmp"])
    assert store.prune(0).chunks_kept == 0
    assert (tmp_path / "snapshots" / "my_experiment.hrry").exists() and (tmp_path / ns / "notes.hrry").exists()
    with pytest.raises(hv.HurrayArgumentError, match="max_bytes"):
        store.prune(-1)


def test_prune_keeps_a_chunk_written_again_after_it_was_judged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer's file renamed over a chunk prune chose (before prune deletes it) is not deleted."""
    import importlib
    import os

    prune_module = importlib.import_module("hurray_vllm.chunks.prune")
    store, ns, key, chunk = _one_chunk_store(tmp_path)
    old = time.time() - 1000
    os.utime(store.path(ns, key), (old, old))
    real = prune_module.PruneReport

    def report(*args, **kwargs):  # type: ignore[no-untyped-def]  # built after the choice, before any deletion
        store.put(ns, key, chunk, replace=True)
        return real(*args, **kwargs)

    monkeypatch.setattr(prune_module, "PruneReport", report)
    got = store.prune(0)
    monkeypatch.undo()
    assert store.has(ns, key) and got.chunks_removed == 0 and got.bytes_removed == 0
    assert sorted(p.name for p in (tmp_path / ns).iterdir()) == [store.path(ns, key).name]  # no temp left
    assert store.prune(0).chunks_removed == 1 and not store.has(ns, key)  # the next prune judges it afresh


def test_a_chunk_truncated_after_it_was_read_stays_usable(tmp_path: Path) -> None:
    """The store reads chunks into owned memory: truncating the file (another program) cannot SIGBUS the reader."""
    ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    ns = namespace_of(chunk.fingerprint)
    store = DirectoryStore(tmp_path)
    store.put(ns, key, chunk)
    got = store.get(ns, key)
    with open(store.path(ns, key), "r+b") as f:
        f.truncate(64)
    assert torch.equal(got.keys[0].page_pool, chunk.keys[0].page_pool)  # would be SIGBUS on a mapping
    with pytest.raises(hv.HurrayFormatError):
        store.get(ns, key)


def test_prune_skips_what_it_cannot_read_and_keeps_live_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib
    import os

    prune_module = importlib.import_module("hurray_vllm.chunks.prune")  # the package re-exports the function

    store = DirectoryStore(tmp_path)
    assert store_snapshot(store, spec_example_snapshot(), 4) == 1
    (tmp_path / "0bad").mkdir()  # a namespace this user cannot read
    real = os.scandir

    def scandir(path):  # type: ignore[no-untyped-def]
        if str(path).endswith("0bad"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(prune_module.os, "scandir", scandir)
    report = store.prune(0)
    assert report.chunks_removed == 1 and any("0bad" in s for s in report.skipped)
    with pytest.raises(hv.HurrayArgumentError, match="stale_temp_s"):
        store.prune(0, stale_temp_s=0)


def test_a_reader_reads_ahead_and_gives_what_get_gives(tmp_path: Path) -> None:
    """ChunkReader: the next file read on a helper while this one is parsed; the same snapshots as get, in any order."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from hurray_vllm.containers.io import FileBytes

    fp = hv.ModelFingerprint("LlamaForCausalLM", 2, 2, 16, "bfloat16")
    snap = replace(make_snapshot([16], [0], 4), token_ids=(tuple(range(16)),), fingerprint=fp)
    ns, store = namespace_of(fp), DirectoryStore(tmp_path)
    keys = [k for k, c in chunks_of(snap, 4) if store.put(ns, k, c)]
    assert len(keys) == 4
    with ThreadPoolExecutor(1) as pool:
        reader = store.reader(ns, keys, pool.submit)
        for key in [keys[0], keys[2], keys[3], keys[1]]:  # keys[1] skipped: reading ahead resumes after keys[2]
            got, want = reader.get(key), store.get(ns, key)
            assert got.token_ids == want.token_ids and got.extra == want.extra
            assert all(torch.equal(a.page_pool, b.page_pool) for a, b in zip(got.keys, want.keys, strict=True))

    def now(fn: Callable[[], FileBytes]) -> Future[FileBytes]:  # reads at once: the test decides what exists when
        done: Future[FileBytes] = Future()
        try:
            done.set_result(fn())
        except OSError as exc:
            done.set_exception(exc)
        return done

    reader = store.reader(ns, keys, now)
    reader.get(keys[0])  # keys[1] is read here
    store.path(ns, keys[1]).unlink()
    store.path(ns, keys[2]).unlink()
    reader.get(keys[1])  # read before it was deleted: as a file truncated after its read
    with pytest.raises(hv.HurrayFormatError, match="no chunk") as err:
        reader.get(keys[2])
    assert err.value.field == "store"


def test_a_read_ahead_that_fails_is_refused_as_load_refuses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory running out while reading is the OSError (ENOMEM) ``load`` gives, reading ahead or not: not a crash,
    and not a verdict on the file (a connector moves aside only files that are malformed)."""
    from concurrent.futures import ThreadPoolExecutor

    import hurray_vllm.containers.hrryfile as hrryfile

    ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    ns, store = namespace_of(chunk.fingerprint), DirectoryStore(tmp_path)
    store.put(ns, key, chunk)

    def no_memory(n: int) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(hrryfile._recycler, "take", no_memory)
    with pytest.raises(OSError) as direct:
        store.get(ns, key)
    with ThreadPoolExecutor(1) as pool, pytest.raises(OSError) as ahead:
        store.reader(ns, [key], pool.submit).get(key)
    assert ahead.value.errno == direct.value.errno == errno.ENOMEM


def test_a_resume_point_takes_the_set_of_files_that_carries_states(tmp_path: Path) -> None:
    """A TP = 1 engine stored a hybrid's chunk whole without states (its step ran past the chunk's end); a TP = 2
    engine stored it again as slices with them. A lookup that resumes there wants the slices, and a save that
    holds the states finds them there instead of writing its slices again and again."""
    from hurray_vllm.kv.heads import select_heads

    gen = torch.Generator().manual_seed(0)
    tensors = tuple((torch.randn(2, 3, 16, generator=gen), torch.randn(2, 2, 8, 8, generator=gen)) for _ in range(3))
    states = hv.RecurrentStates("gdn_attn", (0, 1, 2), ("conv", "ssm"), (6, 3), tensors)
    snap = replace(
        spec_example_snapshot(num_layers=2),
        fingerprint=hv.ModelFingerprint("Qwen3NextForCausalLM", 2, 2, 8, "float16"),
    )
    store, ns, key = DirectoryStore(tmp_path), "ab" * 8, "cd" * 8
    store.put(ns, key, snap)  # whole, no states
    assert [p.name for p in store.parts(ns, key, 2, states=True)] == [key]  # no set with states: the first
    for r in range(2):  # the header is what tells: each slice says it carries states
        store.put(ns, f"{key}.h{r}-{r + 1}", replace(select_heads(snap, range(r, r + 1)), states=states))
    assert [p.name for p in store.parts(ns, key, 2)] == [key]  # any set will do: the whole file first
    assert [p.name for p in store.parts(ns, key, 2, states=True)] == [f"{key}.h0-1", f"{key}.h1-2"]


def test_a_symbolic_link_at_a_chunks_name_is_replaced_not_written_through(tmp_path: Path) -> None:
    """Planted in a shared store, a link must not send a producer's write outside it (nor count as stored)."""
    store, ns, _, chunk = _one_chunk_store(tmp_path / "store")
    outside = tmp_path / "precious.cfg"
    outside.write_bytes(b"keep me")
    other = "bc" * 16
    link = store.path(ns, other)
    link.symlink_to(outside)
    dangling = store.path(ns, "cd" * 16)
    dangling.symlink_to(tmp_path / "planted.txt")
    assert store.identity(ns, other) is None and not store.has(ns, "cd" * 16)  # a link is not a chunk
    assert store.put(ns, other, chunk) and store.put(ns, "cd" * 16, chunk)
    assert outside.read_bytes() == b"keep me" and not (tmp_path / "planted.txt").exists()
    assert not link.is_symlink() and store.identity(ns, other) is not None


def test_fsck_does_not_call_a_chunk_pruned_while_it_was_read_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hurray_vllm.chunks.fsck import fsck

    store = _one_chunk_store(tmp_path)[0]
    real = DirectoryStore.get

    def get(self: DirectoryStore, n: str, k: str, **kwargs: bool) -> hv.KVSnapshot:
        self.path(n, k).unlink()  # a prune lands between the listing and the read
        return real(self, n, k, **kwargs)

    monkeypatch.setattr(DirectoryStore, "get", get)
    report = fsck(store)
    assert report.clean and report.checked == 0 and not report.damaged


def _crafted_chunk_file(store: DirectoryStore, ns: str, key: str, edit: Callable[[list], None]) -> Path:
    """The spec example's chunk written under ``key`` after ``edit`` changed its records (a list, in file order)."""
    from hurray_vllm.containers.hrryfile import write_file
    from hurray_vllm.containers.schema import snapshot_records

    ((_, chunk),) = chunks_of(spec_example_snapshot(), 4)
    records = list(snapshot_records(chunk))
    edit(records)
    path = store.path(ns, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(records, path)
    return path


def test_a_header_whose_metadata_record_has_no_buffer_is_unreadable_not_an_index_error(tmp_path: Path) -> None:
    """header() ran unchecked code on the metadata record: a uint8 record with no buffer raised IndexError, which
    reached vLLM's scheduler (has_states, parts_with_states) and stopped the engine."""
    from hurray_vllm.containers.schema import Record

    store, ns, key, _ = _one_chunk_store(tmp_path)
    assert store.header(ns, key) is not None and not store.has_states(ns, key)

    def no_buffer(records: list) -> None:
        meta = records[1]
        assert meta.name == "snapshot.meta"
        records[1] = Record(meta.name, replace(meta.descriptor, buffers=(), shape=(0,)), [])

    path = _crafted_chunk_file(store, ns, key, no_buffer)
    assert store.header(ns, key) is None and not store.has_states(ns, key)
    assert store.parts_with_states(ns, key, 2) == (store.parts(ns, key, 2), False)
    from hurray_vllm.chunks.store import read_header

    with pytest.raises(hv.HurrayFormatError) as err:
        read_header(path)
    # A record of no buffers is refused by the descriptor's own rules now (buffer_count: only a composite head
    # may have none), before the metadata reader looks at it.
    assert err.value.field in ("snapshot.meta", "buffer_count")
    with pytest.raises(hv.HurrayFormatError):
        store.get(ns, key)


def test_a_header_record_too_large_for_a_header_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hurray_vllm.chunks import store as store_module
    from hurray_vllm.chunks.store import read_header

    store, ns, key, _ = _one_chunk_store(tmp_path)
    monkeypatch.setattr(store_module, "_MAX_META_BYTES", 16)  # the metadata record holds far more
    with pytest.raises(hv.HurrayFormatError, match="more than a snapshot header's record holds"):
        read_header(store.path(ns, key))
    assert store.header(ns, key) is None


def test_a_pipe_at_a_chunks_name_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A FIFO swapped in under a key (after any check of it) blocked the scheduler's open forever."""
    import os

    from hurray_vllm.containers.hrryfile import HrryFile, read_whole

    store, ns, key, _ = _one_chunk_store(tmp_path)
    path = store.path(ns, key)
    path.unlink()
    os.mkfifo(path)
    assert within(lambda: store.header(ns, key), path) is None
    from hurray_vllm.chunks.store import read_header

    for call in (
        lambda: read_whole(path),
        lambda: read_header(path),
        lambda: HrryFile(path),
        lambda: store.get(ns, key),
    ):
        got = within(call, path)
        assert isinstance(got, hv.HurrayFormatError) and got.field == "file", got
        assert "not a regular file" in str(got)


def test_a_symbolic_link_at_a_chunks_name_is_not_read_through(tmp_path: Path) -> None:
    import errno as errno_module

    store, ns, key, chunk = _one_chunk_store(tmp_path)
    path = store.path(ns, key)
    elsewhere = tmp_path / "elsewhere.hrry"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    assert store.header(ns, key) is None
    with pytest.raises(OSError) as err:
        store.get(ns, key)
    assert err.value.errno == errno_module.ELOOP
    assert hv.load(path).token_ids == chunk.token_ids  # a user's own load of a link still follows it


def test_a_sparse_file_larger_than_any_chunk_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 100 GiB sparse file under a key's name: the read allocated its size before parsing anything (OOM)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from hurray_vllm.chunks import store as store_module

    assert store_module.MAX_CHUNK_FILE_BYTES >= 1 << 30
    store, ns, key, _ = _one_chunk_store(tmp_path)
    monkeypatch.setattr(store_module, "MAX_CHUNK_FILE_BYTES", 1 << 20)
    assert store.get(ns, key).token_ids  # a real chunk is far smaller
    path = store.path(ns, key)
    os.truncate(path, 100 << 30)  # sparse: nothing is written
    assert path.stat().st_blocks * 512 < 1 << 30
    with pytest.raises(hv.HurrayFormatError) as err:
        store.get(ns, key)
    assert err.value.field == "file.size" and str(100 << 30) in str(err.value) and str(1 << 20) in str(err.value)
    with ThreadPoolExecutor(1) as pool, pytest.raises(hv.HurrayFormatError) as ahead:
        store.reader(ns, [key], pool.submit).get(key)
    assert ahead.value.field == "file.size"


def test_prune_with_keys_keeps_a_signed_chunk_it_cannot_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error reading a chunk's key id said "not ours" and deleted a validly signed chunk."""
    import builtins
    import os

    from hurray_vllm.chunks.signing import FleetKeys, sign_chunk

    keys = FleetKeys.from_secrets(b"k" * 32)
    ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    ns, store = namespace_of(chunk.fingerprint), DirectoryStore(tmp_path)
    store.put(ns, key, sign_chunk(chunk, keys, ns, key))
    store.put(ns, "a1" * 8, chunk)  # unsigned: goes
    path = store.path(ns, key)
    real_open, real_os_open = builtins.open, os.open

    def failing(real: Callable[..., object]) -> Callable[..., object]:
        def call(file: object, *args: object, **kwargs: object) -> object:
            if isinstance(file, str | os.PathLike) and os.fspath(file) == str(path):
                raise OSError(errno.EIO, "Input/output error", str(path))
            return real(file, *args, **kwargs)

        return call

    monkeypatch.setattr(builtins, "open", failing(real_open))
    monkeypatch.setattr(os, "open", failing(real_os_open))
    report = store.prune(1 << 40, keys=keys)
    monkeypatch.undo()
    assert path.exists() and not store.has(ns, "a1" * 8)
    assert report.foreign_removed == 1 and any(str(path) in s and "Input/output" in s for s in report.skipped)
    assert store.prune(1 << 40, keys=keys).foreign_removed == 0 and store.has(ns, key)  # readable again: ours


def _sparse_file_claiming_an_index(path: Path, index_len: int) -> None:
    """A file of ``index_len`` + 104 bytes, nearly all a hole, whose trailer says its index is ``index_len`` bytes."""
    import struct

    from hurray_vllm.containers.hrryfile import FILE_MAGIC, TRAILER_MAGIC

    size = 64 + index_len + 40
    header = FILE_MAGIC + struct.pack("<BBHIIQ", 1, 0, 0, 0, 4096, 64) + bytes(64 - 8 - 20)
    trailer = struct.pack("<QQQII", 64, index_len, 0, 0, 0) + bytes(4) + TRAILER_MAGIC
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(size)
        f.seek(size - 40)
        f.write(trailer)


def test_a_sparse_file_claiming_a_huge_index_is_refused_before_a_header_read_reads_it(tmp_path: Path) -> None:
    """1 GiB of index claimed by a file of 4 KiB on disk: read_header (a scheduler's has_states, a keyed prune)
    allocated the whole 1 GiB and took seconds before refusing it."""
    import tracemalloc

    from hurray_vllm.chunks.signing import FleetKeys
    from hurray_vllm.chunks.store import read_header

    store, ns, key = DirectoryStore(tmp_path), "0123456789abcdef", "aa"
    path = store.path(ns, key)
    _sparse_file_claiming_an_index(path, 1 << 30)
    assert path.stat().st_blocks * 512 < 1 << 20  # nothing of the index is on disk
    tracemalloc.start()
    try:
        start = time.monotonic()
        with pytest.raises(hv.HurrayFormatError) as err:
            read_header(path)
        assert store.header(ns, key) is None and not store.has_states(ns, key)
        report = store.prune(1 << 40, keys=FleetKeys.from_secrets(b"k" * 32), dry_run=True)
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.field == "file.index"
    assert report.foreign_removed == 1 and not report.skipped  # malformed: what a keyed engine refuses
    assert peak < 16 << 20, f"{peak} bytes allocated"
    assert elapsed < 2.0, f"{elapsed:.1f} s"


def test_a_header_read_bound_admits_any_index_a_chunk_file_may_have() -> None:
    """The bound must not refuse a legitimate file: ``MAX_RECORDS`` index rows (8 + 34 bytes and a name each)."""
    from hurray_vllm.chunks.store import MAX_HEADER_READ_BYTES
    from hurray_vllm.containers.schema import MAX_RECORDS

    assert 8 + MAX_RECORDS * (34 + 989) <= MAX_HEADER_READ_BYTES  # names of up to 989 bytes, as documented


def test_a_header_read_is_bounded_by_all_its_records_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each record under the bound, all of them over it: a header group of many members read them all."""
    from hurray_vllm.chunks import store as store_module
    from hurray_vllm.chunks.store import read_header
    from hurray_vllm.containers.schema import dense_record

    store, ns, key, _ = _one_chunk_store(tmp_path)

    def long_token_ids(records: list) -> None:
        assert records[2].name == "snapshot.token_ids"
        records[2] = dense_record("snapshot.token_ids", torch.zeros(350, dtype=torch.int64))  # 2,800 bytes

    path = _crafted_chunk_file(store, ns, key, long_token_ids)
    assert read_header(path) is not None  # read whole, the header's records are a few KiB
    monkeypatch.setattr(store_module, "MAX_HEADER_READ_BYTES", 3000)  # more than any one record, less than all
    with pytest.raises(hv.HurrayFormatError, match="more than 3000 bytes") as err:
        read_header(path)
    assert err.value.field == "snapshot.token_ids"
    assert store.header(ns, key) is None


def _atime_moves_here(directory: Path) -> bool:
    """Whether a plain read of a file in ``directory`` moves its access time (not so under ``noatime``)."""
    import os

    probe = directory / "atime-probe"
    probe.write_bytes(b"x")
    old = time.time() - 10 * 86400  # older than a day: relatime moves it too
    os.utime(probe, (old, old))
    before = probe.stat().st_atime_ns
    with open(probe, "rb") as f:
        f.read()
    moved = probe.stat().st_atime_ns != before
    probe.unlink()
    return moved


def test_fsck_and_a_keyed_prune_leave_access_times_alone(tmp_path: Path) -> None:
    """Prune ranks chunks by their last use (access or modification time): fsck's and a keyed prune's reads moved
    the access time of chunks never loaded, which the next prune then kept over chunks engines had used."""
    import os

    from hurray_vllm.chunks.fsck import fsck
    from hurray_vllm.chunks.signing import FleetKeys, sign_chunk

    if not hasattr(os, "O_NOATIME"):
        pytest.skip("no O_NOATIME on this system")
    if not _atime_moves_here(tmp_path):
        pytest.skip("this file system does not move access times on reads (mounted noatime): nothing to keep")
    keys = FleetKeys.from_secrets(b"k" * 32)
    ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    ns, store = namespace_of(chunk.fingerprint), DirectoryStore(tmp_path / "store")
    store.put(ns, key, sign_chunk(chunk, keys, ns, key))
    path = store.path(ns, key)
    old = time.time() - 10 * 86400
    os.utime(path, (old, old))
    before = path.stat().st_atime_ns
    assert fsck(store, keys=keys).good == 1
    assert path.stat().st_atime_ns == before
    report = store.prune(1 << 40, keys=keys)
    assert report.chunks_kept == 1 and report.foreign_removed == 0
    assert path.stat().st_atime_ns == before


def test_a_read_without_access_time_falls_back_to_a_plain_read_for_another_users_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O_NOATIME is refused (EPERM) on a file the reader does not own: fsck and prune read it all the same."""
    import os

    from hurray_vllm.chunks.fsck import fsck
    from hurray_vllm.chunks.store import read_header

    if not hasattr(os, "O_NOATIME"):
        pytest.skip("no O_NOATIME on this system")
    store, ns, key, _ = _one_chunk_store(tmp_path)
    real = os.open
    refused = []

    def open_(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if flags & os.O_NOATIME:
            refused.append(path)
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    assert read_header(store.path(ns, key), noatime=True) is not None
    assert fsck(store).good == 1
    assert store.prune(1 << 40).chunks_kept == 1
    assert len(refused) == 2  # read_header's and fsck's


def test_keyed_prune_counts_a_chunk_it_cannot_read_as_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unreadable file (an I/O error reading its signer) was in neither kept nor foreign: its bytes never
    counted toward max_bytes, and the report said the store held less than it did."""
    import os

    from hurray_vllm.chunks import store as store_module
    from hurray_vllm.chunks.signing import FleetKeys, sign_chunk

    keys = FleetKeys.from_secrets(b"k" * 32)
    ((_, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    ns, store = namespace_of(chunk.fingerprint), DirectoryStore(tmp_path)
    names = ["a1" * 8, "b2" * 8, "c3" * 8]
    now = time.time()
    for age, name in zip((0, 200, 100), names, strict=True):  # b2 used longest ago
        store.put(ns, name, sign_chunk(chunk, keys, ns, name))
        os.utime(store.path(ns, name), (now - age, now - age))
    size = store.path(ns, names[0]).stat().st_size
    unreadable = store.path(ns, names[0])  # the most recently used: kept
    real = store_module.read_header

    def read_header(path: Path, **kwargs: bool) -> object:
        if path == unreadable:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path, **kwargs)

    monkeypatch.setattr(store_module, "read_header", read_header)
    dry = store.prune(2 * size, keys=keys, dry_run=True)
    assert (dry.chunks_kept, dry.chunks_removed, dry.bytes_kept) == (2, 1, 2 * size)
    report = store.prune(2 * size, keys=keys)
    on_disk = sorted(p for p in (tmp_path / ns).iterdir())
    assert on_disk == sorted([unreadable, store.path(ns, names[2])])  # the least recently used went
    assert report.chunks_kept == len(on_disk) and report.bytes_kept == sum(p.stat().st_size for p in on_disk)
    assert report.bytes_kept <= 2 * size and any(str(unreadable) in s for s in report.skipped)


def test_a_snapshot_without_token_ids_or_a_fingerprint_is_a_format_error_not_a_crash(tmp_path: Path) -> None:
    """A file saved without token ids (valid) loaded and chunked raised IndexError; one without a fingerprint a bare
    AssertionError in store_snapshot."""
    path = tmp_path / "no_ids.hrry"
    hv.save(replace(spec_example_snapshot(), token_ids=()), path)
    loaded = hv.load(path)
    assert loaded.token_ids == () and loaded.num_layers
    store = DirectoryStore(tmp_path / "store")
    for call in (lambda: chunks_of(loaded, 4), lambda: store_snapshot(store, loaded, 4)):
        with pytest.raises(hv.HurrayFormatError) as err:
            call()
        assert err.value.field == "snapshot.token_ids"
    no_fingerprint = replace(spec_example_snapshot(), fingerprint=None)
    with pytest.raises(hv.HurrayFormatError) as err:
        store_snapshot(store, no_fingerprint, 4)
    assert err.value.field == "snapshot.fingerprint"
    assert not (tmp_path / "store").exists()  # nothing written


@pytest.mark.parametrize(
    ("ns", "key", "field"),
    [
        ("..", "0a", "namespace"),
        ("0a/../..", "0a", "namespace"),
        ("", "0a", "namespace"),
        ("0A", "0a", "namespace"),
        ("0a.h0-1", "0a", "namespace"),
        ("0a", "../0a", "key"),
        ("0a", "/etc/0a", "key"),
        ("0a", "", "key"),
        ("0a", "0a.hrry", "key"),
        ("0a", "0a.h02-4", "key"),
        ("0a", "0a\0", "key"),
        ("0a", "0" * 65, "key"),
    ],
)
def test_the_store_refuses_names_that_are_not_its_own(tmp_path: Path, ns: str, key: str, field: str) -> None:
    """Found by a review: DirectoryStore.path, put and get took any names, so a library caller could read and
    write outside the root with '..' (the receivers validate what peers send; the store did not)."""
    _, _, chunk = example_chunk()
    store = DirectoryStore(tmp_path / "store")
    calls: list[Callable[[], object]] = [
        lambda: store.path(ns, key),
        lambda: store.put(ns, key, chunk),
        lambda: store.get(ns, key),
        lambda: store.identity(ns, key),
        lambda: store.has(ns, key),
    ]
    for call in calls:
        with pytest.raises(hv.HurrayArgumentError) as err:
            call()
        assert err.value.field == field and "hex digits" in str(err.value)
    assert not any(tmp_path.rglob("*.hrry"))
    assert store.path("0a", "0b.h2-4") == tmp_path / "store" / "0a" / "0b.h2-4.hrry"  # a slice's name is the store's


def test_prune_lists_a_chunk_named_symbolic_link_as_skipped(tmp_path: Path) -> None:
    """Found by a review: prune passed over it silently, where fsck and the docs list it (not followed)."""
    store, ns, key, _ = _one_chunk_store(tmp_path)
    link = store.path(ns, "ab" * 16)
    link.symlink_to(store.path(ns, key).name)
    report = store.prune(1 << 30)
    assert report.skipped == [f"{link}: a symbolic link, not followed"]
    assert store.prune(0).skipped == [f"{link}: a symbolic link, not followed"]
    assert link.is_symlink() and not store.path(ns, key).exists()  # the chunk pruned, the link left alone


def _hybrid_chunk() -> tuple[hv.KVSnapshot, hv.KVSnapshot]:
    """A linear-attention hybrid's chunk without its states, and with them."""
    gen = torch.Generator().manual_seed(0)
    tensors = tuple((torch.randn(2, 3, 16, generator=gen), torch.randn(2, 2, 8, 8, generator=gen)) for _ in range(3))
    states = hv.RecurrentStates("gdn_attn", (0, 1, 2), ("conv", "ssm"), (6, 3), tensors)
    snap = replace(
        spec_example_snapshot(num_layers=2),
        fingerprint=hv.ModelFingerprint("Qwen3NextForCausalLM", 2, 2, 8, "float16"),
    )
    return snap, replace(snap, states=states)


def _in_puts_window(monkeypatch: pytest.MonkeyPatch, other: Callable[[], object]) -> None:
    """Run ``other`` once, in the next put's window between its existence check and its file landing."""
    from hurray_vllm.chunks import store as store_module

    real = store_module.snapshot_records

    def records(snap: hv.KVSnapshot):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(store_module, "snapshot_records", real)
        other()
        return real(snap)

    monkeypatch.setattr(store_module, "snapshot_records", records)


@pytest.mark.parametrize("other_replaces", [False, True])
@pytest.mark.parametrize("hard_links", [True, False])
def test_a_copy_stored_while_a_put_writes_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_replaces: bool, hard_links: bool
) -> None:
    """Found by a review: put checked for the file, then renamed over it; a copy with states stored by another
    engine in between was replaced by one without (at TP > 1, one slice of a set by another engine's)."""
    import os

    if not hard_links:  # a file system without them (FAT): the last look before the rename still sees the copy

        def no_link(src: object, dst: object, **kwargs: object) -> None:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(dst))

        monkeypatch.setattr(os, "link", no_link)
    stateless, with_states = _hybrid_chunk()
    store, ns, key = DirectoryStore(tmp_path), "ab" * 8, "cd" * 8
    _in_puts_window(monkeypatch, lambda: store.put(ns, key, with_states, replace=other_replaces))
    assert store.put(ns, key, stateless) is False  # stored meanwhile: as 'already stored'
    assert store.has_states(ns, key)
    assert sorted(p.name for p in (tmp_path / ns).iterdir()) == [f"{key}.hrry"]  # no temp file left
    assert store.put(ns, key, stateless, replace=True) and not store.has_states(ns, key)  # replace still replaces


def test_a_put_without_hard_links_still_lands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for code in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV):

        def no_link(src: object, dst: object, code: int = code, **kwargs: object) -> None:
            raise OSError(code, os.strerror(code), str(dst))

        monkeypatch.setattr(os, "link", no_link)
        store, ns, key, chunk = _one_chunk_store(tmp_path / str(code))
        assert store.get(ns, key).token_ids == chunk.token_ids
        assert sorted(p.name for p in (tmp_path / str(code) / ns).iterdir()) == [f"{key}.hrry"]


def test_a_put_that_dies_after_its_file_landed_leaves_a_temp_file_prune_removes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file lands as a hard link to its temporary file: a writer that dies before removing that name leaves
    a second name of the chunk, which prune takes for a stale temp file and deletes, the chunk left whole."""
    import os

    def cannot_unlink(path: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "simulated crash before the unlink", str(path))

    monkeypatch.setattr(os, "unlink", cannot_unlink)
    store, ns, key, chunk = _one_chunk_store(tmp_path)
    monkeypatch.undo()
    (temp,) = [p for p in (tmp_path / ns).iterdir() if p.name.endswith(".tmp")]
    assert temp.stat().st_ino == store.path(ns, key).stat().st_ino
    old = time.time() - 7200
    os.utime(temp, (old, old))
    report = store.prune(1 << 30)
    assert report.temp_removed == 1 and report.chunks_removed == 0
    assert sorted(p.name for p in (tmp_path / ns).iterdir()) == [f"{key}.hrry"]
    assert store.get(ns, key).token_ids == chunk.token_ids


def test_a_full_disk_names_the_chunk_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review: put's ENOSPC had no filename, so the operator's log did not say which store was full."""
    from hurray_vllm.chunks import store as store_module

    def records(snap: hv.KVSnapshot):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")
        yield  # a generator: raises as the file is written

    _, ns, key, chunk = _one_chunk_store(tmp_path / "a")
    store = DirectoryStore(tmp_path / "b")
    monkeypatch.setattr(store_module, "snapshot_records", records)
    with pytest.raises(OSError) as err:
        store.put(ns, key, chunk)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(store.path(ns, key))
    assert list((tmp_path / "b" / ns).iterdir()) == []


def test_a_temporary_file_that_cannot_be_made_names_the_namespace_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: put's docstring said the chunk's file; a refused temporary file names its directory."""
    import os

    _, ns, key, chunk = _one_chunk_store(tmp_path / "a")
    store = DirectoryStore(tmp_path / "b")
    real = os.open

    def refusing(path: str | os.PathLike[str], flags: int, *args: int, **kwargs: object) -> int:
        if str(path).endswith(".tmp") and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refusing)
    with pytest.raises(OSError) as err:
        store.put(ns, key, chunk)
    assert err.value.errno == errno.EACCES and err.value.filename == str(store.root / ns)
    assert not store.has(ns, key)


def test_touching_a_chunk_file_moves_its_access_time_and_keeps_its_identity(tmp_path: Path) -> None:
    """What a connector does to a chunk it serves from memory (ChunkUses): prune ranks by access time, and the
    identity (which includes the change time, as os.utime would move it) stays, so the copy is still served."""
    import os

    from hurray_vllm.chunks.store import touch_file

    store, ns, key, _ = _one_chunk_store(tmp_path)
    path = store.path(ns, key)
    old = time.time() - 3 * 86400  # older than a day: relatime moves it too
    os.utime(path, (old, old))
    ident = store.identity(ns, key)
    touch_file(path)
    if path.stat().st_atime == old:
        pytest.skip("reads do not move access times on this filesystem (noatime)")
    assert path.stat().st_atime > old + 86400 and store.identity(ns, key) == ident
    touch_file(tmp_path / "gone.hrry")  # errors are ignored: the next real read judges the file


def test_a_symbolic_link_in_place_of_the_namespace_is_not_looked_through(tmp_path: Path) -> None:
    """Found by a review: get refused the link (ELOOP), while has, parts, header and quarantine looked through it:
    a lookup promised chunks no load could read, and a quarantine moved a file outside the store."""
    victim, ns, key, _ = _one_chunk_store(tmp_path / "victim")
    ident = victim.identity(ns, key)
    assert ident is not None
    store = DirectoryStore(tmp_path / "store")
    store.root.mkdir()
    (store.root / ns).symlink_to(victim.root / ns)
    assert store.identity(ns, key) is None and not store.has(ns, key)
    assert store.parts(ns, key, 2) is None and store.parts_with_states(ns, key, 2) == (None, False)
    assert store.header(ns, key) is None and not store.has_states(ns, key)
    assert store.quarantine(ns, key, ident) is None
    with pytest.raises(OSError) as err:
        store.get(ns, key)
    assert err.value.errno == errno.ELOOP
    with pytest.raises(OSError) as err:
        store.put(ns, key, victim.get(ns, key))
    assert err.value.errno == errno.ELOOP
    assert victim.identity(ns, key) == ident and sorted(p.name for p in (victim.root / ns).iterdir()) == [f"{key}.hrry"]


def test_quarantine_does_not_move_through_a_namespace_link_swapped_in_after_its_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, ns, key, _ = _one_chunk_store(tmp_path / "store")
    seen = store.identity(ns, key)
    assert seen is not None
    real = DirectoryStore.identity

    def identity(self: DirectoryStore, n: str, k: str) -> tuple[int, ...] | None:
        found = real(self, n, k)
        (self.root / n).rename(tmp_path / "elsewhere")  # the same file, now outside the store, through a link
        (self.root / n).symlink_to(tmp_path / "elsewhere")
        return found

    monkeypatch.setattr(DirectoryStore, "identity", identity)
    assert store.quarantine(ns, key, seen) is None
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == [f"{key}.hrry"]


def test_a_directory_at_a_chunks_name_is_refused_as_not_a_file(tmp_path: Path) -> None:
    """Found by a review: get and read promise HurrayFormatError field 'file' for a name that is not a regular
    file; a directory raised IsADirectoryError, unlike a pipe."""
    from concurrent.futures import ThreadPoolExecutor

    store, ns, key, _ = _one_chunk_store(tmp_path)
    path = store.path(ns, key)
    path.unlink()
    path.mkdir()
    assert not store.has(ns, key)
    with ThreadPoolExecutor(1) as pool:
        for call in (
            lambda: store.get(ns, key),
            lambda: store.read(ns, key),
            lambda: store.reader(ns, [key], pool.submit).get(key),
        ):
            with pytest.raises(hv.HurrayFormatError) as err:
                call()
            assert err.value.field == "file" and "not a regular file" in str(err.value)


def test_a_slice_of_every_head_is_stored_as_the_whole_chunk_and_never_as_a_slice(tmp_path: Path) -> None:
    """A snapshot marked heads 0..n of n (valid, and it survives save/load) was stored as "<key>.h0-n".

    No lookup reads that name (a set covering every head is the whole key), so the chunks took disk and
    were never loaded; a receiver accepted such pushes too.
    """
    from bare_worker import CHUNK, two_chunks

    from hurray_vllm.chunks.digest import check_heads
    from hurray_vllm.kv.snapshot import HeadRange

    snap = two_chunks(2)
    full = replace(snap, heads=HeadRange(0, 2, 2))
    store = DirectoryStore(tmp_path)
    assert store_snapshot(store, full, CHUNK, tails=False) == 2
    ns = namespace_of(snap.fingerprint)
    keys = [k for k, _ in chunks_of(snap, CHUNK)]
    assert [k for k, _ in chunks_of(full, CHUNK)] == keys
    assert sorted(p.name for p in (tmp_path / ns).iterdir()) == sorted(f"{k}.hrry" for k in keys)
    assert all(store.parts(ns, k, 2) is not None for k in keys)
    # The store gives a whole file's heads as range(0, n): a consumer's check accepts them (a refusal here
    # quarantined every whole chunk).
    whole = chunks_of(snap, CHUNK)[0][1]
    (part,) = store.parts(ns, keys[0], 2) or []
    assert part.heads == range(0, 2)
    check_heads(whole, part.heads)
    check_heads(whole, None)
    assert snap.fingerprint is not None
    verify_chunk(whole, snap.fingerprint, whole.token_ids[0], heads=part.heads)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(kv_scales=((float("nan"), 1.0),) * 4), "snapshot.kv_scales"),  # stored, then damaged to fsck
        (dict(kv_scales=((1.0, 1.0),)), "snapshot.kv_scales"),  # one pair for four layers: a bare IndexError
        (dict(extra={"x": {1, 2}}), "snapshot.meta"),  # not JSON: a bare TypeError
    ],
)
def test_store_snapshot_refuses_a_snapshot_load_refuses(tmp_path: Path, change: dict, field: str) -> None:
    """store_snapshot stored chunks every engine refuses, or failed with a bare error naming nothing."""
    store = DirectoryStore(tmp_path)
    with pytest.raises(hv.HurrayFormatError) as err:
        store_snapshot(store, replace(spec_example_snapshot(), **change), 4)
    assert err.value.field.startswith(field)
    assert not list(tmp_path.rglob("*.hrry"))
    assert hv.chunks.fsck(store).clean
