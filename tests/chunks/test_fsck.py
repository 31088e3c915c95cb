"""``fsck`` and ``hurray-vllm fsck``: every chunk file verified as a consumer would, the damaged moved aside."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from synthetic import example_chunk

import hurray_vllm as hv
from hurray_vllm.app.cli import main
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.chunks import DirectoryStore, fsck
from hurray_vllm.chunks.digest import DIGEST_KEY, chunk_digest
from hurray_vllm.chunks.keys import chunks_of, namespace_of, slice_key
from hurray_vllm.kv.heads import select_heads

#: What fsck says of a file in a namespace directory whose name is not a chunk's (skipped, left alone).
NOT_A_CHUNKS_NAME = "not a chunk's name (a key is hex digits, with .h<a>-<b> for a slice), not the store's: left alone"


def _damaged_store(root: Path) -> tuple[DirectoryStore, str, dict[str, str]]:
    """One good chunk and one of each kind of damage; returns the store, its namespace and name -> kind."""
    ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    ns, store = namespace_of(chunk.fingerprint), DirectoryStore(root)
    store.put(ns, key, chunk)
    kinds = {}
    flipped = "a1" * 8
    store.put(ns, flipped, chunk)
    raw = bytearray(store.path(ns, flipped).read_bytes())
    raw[16384 + 3] ^= 0x10  # inside the first page pool (layers.0.key's data): only the checksum notices
    store.path(ns, flipped).write_bytes(bytes(raw))
    kinds[flipped] = "digest"
    cut = "a2" * 8
    store.put(ns, cut, chunk)
    store.path(ns, cut).write_bytes(store.path(ns, cut).read_bytes()[:-100])
    kinds[cut] = "truncated"
    heads = chunk.head_range.total
    if heads > 1:  # a slice under the whole chunk's name, and under another slice's
        half = select_heads(chunk, range(0, heads // 2))
        half = replace(half, extra={**half.extra, DIGEST_KEY: chunk_digest(half)})
        store.put(ns, "a3" * 8, half)
        kinds["a3" * 8] = "heads"
        store.put(ns, slice_key("a4" * 8, range(heads // 2, heads)), half)
        kinds[slice_key("a4" * 8, range(heads // 2, heads))] = "heads"
        # The whole chunk named as a slice of every head: a name no lookup reads.
        store.put(ns, slice_key("a7" * 8, range(0, heads)), chunk)
        kinds[slice_key("a7" * 8, range(0, heads))] = "heads"
    other = "0123456789abcdef"  # a namespace this chunk's model does not have
    store.put(other, "a5" * 8, chunk)
    kinds["a5" * 8] = "namespace"
    (root / ns / "notakey.hrry").write_bytes(b"x")  # not a chunk's name: not the store's, left alone (skipped)
    (root / ns / ".a6.hrry.1234.tmp").write_bytes(b"partial")
    return store, ns, kinds


def test_fsck_names_every_damaged_file_and_quarantine_moves_them_aside(tmp_path: Path) -> None:
    store, ns, kinds = _damaged_store(tmp_path)
    report = fsck(store)
    assert report.checked == 1 + len(kinds) and report.good == 1 and not report.clean
    found = {Path(p).name.removesuffix(".hrry"): why for p, why in report.damaged}
    assert set(found) == set(kinds)
    assert "snapshot.digest" in found["a1" * 8] and "snapshot.heads" in found["a3" * 8]
    assert all("slice of every head" in why for name, why in found.items() if name.startswith("a7"))
    assert "another model" in found["a5" * 8]
    assert (
        report.temporary == 1 and not report.moved and all(store.path(ns, n).exists() for n in kinds if n != "a5" * 8)
    )
    assert [s.partition(": ")[::2] for s in report.skipped] == [
        (str(tmp_path / ns / "notakey.hrry"), NOT_A_CHUNKS_NAME)
    ]
    moved = fsck(store, quarantine=True)
    assert len(moved.moved) == len(kinds) and all(m.endswith(".hrry.bad") for m in moved.moved)
    assert (tmp_path / ns / "notakey.hrry").read_bytes() == b"x"  # never moved
    again = fsck(store)
    assert again.clean and again.checked == again.good == 1


def test_the_command_reports_and_exits_1_on_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _damaged_store(tmp_path)
    assert main(["fsck", str(tmp_path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["clean"] is False and doc["good"] == 1 and doc["damaged"]
    assert main(["fsck", str(tmp_path), "--quarantine"]) == 1
    out = capsys.readouterr().out
    assert "damaged:" in out and "moved aside" in out
    assert main(["fsck", str(tmp_path)]) == 0
    assert main(["fsck", str(tmp_path / "missing")]) == 2
    assert "No such directory" in capsys.readouterr().err


def test_a_good_store_written_by_store_snapshot_is_clean(tmp_path: Path) -> None:
    from hurray_vllm.chunks.store import store_snapshot

    snap = spec_example_snapshot()
    store = DirectoryStore(tmp_path)
    assert store_snapshot(store, snap, 4) >= 1
    report = fsck(store)
    assert report.clean and report.checked == report.good >= 1
    assert hv.validate(next(tmp_path.rglob("*.hrry"))).ok


def test_a_chunk_whose_checksum_cannot_run_here_is_unverified_not_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the native kernels a CRC-32C digest cannot be checked: consumers leave such files; so does fsck."""
    from hurray_vllm import native

    ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    ns, store = namespace_of(chunk.fingerprint), DirectoryStore(tmp_path)
    store.put(ns, key, chunk)
    if not str(chunk.extra[DIGEST_KEY]).startswith("crc32c"):
        # A zlib digest means the native kernels did not load: make test builds them, so that is a failure in CI.
        why = f"this machine wrote a zlib digest (no native kernels: {native.unavailable_reason()})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"native kernels must build in CI; {why}")
        pytest.skip(why)
    monkeypatch.setattr(native, "library", lambda: None)
    report = fsck(store, quarantine=True)
    assert (
        report.damaged == [] and report.moved == [] and [p for p, _ in report.unverified] == [str(store.path(ns, key))]
    )
    assert not report.clean and store.path(ns, key).is_file()


def test_a_whole_chunk_holding_fewer_heads_than_its_model_is_damage(tmp_path: Path) -> None:
    """Every consumer refuses it (verify_chunk, heads 0..model's): fsck called it good."""
    snap = spec_example_snapshot()
    assert snap.fingerprint is not None
    snap = replace(snap, fingerprint=replace(snap.fingerprint, num_kv_heads=4))  # the pools hold 2
    ((key, chunk),) = chunks_of(snap, 4)
    assert chunk.fingerprint is not None
    ns, store = namespace_of(chunk.fingerprint), DirectoryStore(tmp_path)
    store.put(ns, key, chunk)
    report = fsck(store)
    # The reader's own validate() refuses it now, before the chunk's head check.
    assert report.good == 0 and [why for _, why in report.damaged] == [
        "snapshot.fingerprint: snapshot: fingerprint says 4 KV heads x 8, the layers hold 2 x 8"
    ]


@pytest.mark.parametrize("tool", ["fsck", "prune"])
def test_fsck_and_prune_do_not_follow_a_symlinked_namespace_out_of_the_store(tmp_path: Path, tool: str) -> None:
    from hurray_vllm.chunks import prune

    outside = tmp_path / "home"
    outside.mkdir()
    for name in ("thesis.hrry", "notes.hrry.bad", ".draft.tmp", "a1a1a1a1.hrry"):
        (outside / name).write_bytes(b"mine")
    store = DirectoryStore(tmp_path / "store")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "0123456789abcdef").symlink_to(outside, target_is_directory=True)
    report = fsck(store, quarantine=True) if tool == "fsck" else prune(store, 0, stale_temp_s=3600)
    assert sorted(p.name for p in outside.iterdir()) == [".draft.tmp", "a1a1a1a1.hrry", "notes.hrry.bad", "thesis.hrry"]
    assert any("symbolic link" in s for s in report.skipped)


def test_a_chunk_whose_pools_disagree_with_its_fingerprint_is_damage(tmp_path: Path) -> None:
    """Every consumer refuses it (verify_chunk's geometry check) and no producer writes over it: fsck called it good."""
    snap = spec_example_snapshot()
    assert snap.fingerprint is not None
    snap = replace(snap, fingerprint=replace(snap.fingerprint, head_dim=2 * snap.fingerprint.head_dim))
    ((key, chunk),) = chunks_of(snap, 4)
    assert chunk.fingerprint is not None
    ns, store = namespace_of(chunk.fingerprint), DirectoryStore(tmp_path)
    store.put(ns, key, chunk)
    report = fsck(store)
    assert report.good == 0 and len(report.damaged) == 1 and "the layers hold 2 x 8" in report.damaged[0][1]
    moved = fsck(store, quarantine=True)
    assert moved.moved == [str(store.path(ns, key)) + ".bad"] and not store.has(ns, key)


def test_fsck_lists_a_link_a_pipe_and_a_directory_at_a_chunks_name_as_skipped(tmp_path: Path) -> None:
    """Found by a review: fsck passed over them in silence (and said clean): consumers never read them, so
    they are no damage, but an operator should hear why they were not checked."""
    store, ns, _ = _damaged_store(tmp_path / "s")
    good = next(p for p in (tmp_path / "s" / ns).iterdir() if p.suffix == ".hrry")
    (tmp_path / "s" / ns / ("b1" * 8 + ".hrry")).symlink_to(good)
    os.mkfifo(tmp_path / "s" / ns / ("b2" * 8 + ".hrry"))
    (tmp_path / "s" / ns / ("b3" * 8 + ".hrry")).mkdir()
    report = fsck(store, quarantine=True)
    why = {Path(s.partition(": ")[0]).name: s.partition(": ")[2] for s in report.skipped}
    assert why == {
        "b1" * 8 + ".hrry": "a symbolic link, not followed",
        "b2" * 8 + ".hrry": "not a regular file (a pipe, socket or device), not read",
        "b3" * 8 + ".hrry": "a directory, not a chunk file",
        "notakey.hrry": NOT_A_CHUNKS_NAME,
    }
    assert not any(Path(p).name.startswith(("b1", "b2", "b3")) for p, _ in report.damaged)
    assert (tmp_path / "s" / ns / ("b1" * 8 + ".hrry")).is_symlink()  # neither moved nor followed


def test_a_chunk_file_fsck_cannot_read_leaves_the_store_not_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: a chunk file fsck could not read (permissions) was listed only as skipped, and fsck
    exited 0, "clean", where the --help epilog says exit 0 means every chunk is good and 1 covers a permission.
    Not damage (nothing moved aside): unreadable, and so not clean; an unlistable namespace is the same."""
    import importlib

    import hurray_vllm.chunks.store as store_module

    fsck_module = importlib.import_module("hurray_vllm.chunks.fsck")  # the package re-exports the function

    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path)
    store.put(ns, key, chunk)

    def denied(path: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(store_module, "read_whole", denied)
    report = fsck(store, quarantine=True)
    assert report.unreadable == [(str(store.path(ns, key)), "Permission denied")] and not report.clean
    assert report.checked == 0 and not report.damaged and not report.moved and store.has(ns, key)
    assert main(["fsck", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"unreadable: {store.path(ns, key)}: Permission denied" in out and "1 unreadable" in out
    monkeypatch.undo()
    (tmp_path / "0bad").mkdir()  # a namespace this user cannot list
    real = os.listdir

    def listdir(path: object) -> list[str]:
        if str(path).endswith("0bad"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)  # type: ignore[arg-type]

    monkeypatch.setattr(fsck_module.os, "listdir", listdir)
    report = fsck(store)
    assert report.good == 1 and report.unreadable == [(str(tmp_path / "0bad"), "Permission denied")]
    assert not report.clean


def test_fsck_leaves_a_file_not_named_as_a_chunk_alone_as_prune_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: fsck --quarantine called an operator's NOTES.hrry in a namespace directory damaged and
    renamed it; prune leaves such a file alone as not the store's. Now fsck lists it as skipped."""
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path)
    store.put(ns, key, chunk)
    notes = tmp_path / ns / "NOTES.hrry"
    notes.write_text("operator's notes")
    report = fsck(store, quarantine=True)
    assert report.clean and report.checked == report.good == 1 and not report.moved
    assert len(report.skipped) == 1 and report.skipped[0].startswith(f"{notes}: not a chunk's name")
    assert main(["fsck", str(tmp_path), "--quarantine"]) == 0
    assert "not a chunk's name" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path / ns)) == ["NOTES.hrry", f"{key}.hrry"]
    assert notes.read_text() == "operator's notes"


def test_fsck_lists_a_file_of_any_other_suffix_as_skipped_but_not_what_it_moved_aside(tmp_path: Path) -> None:
    """Found by a review: a file not ending in .hrry (notes.txt, a stray subdirectory) was ignored silently, where
    the docs say a file whose name is not a chunk's is listed as skipped. A file fsck moved aside is the store's."""
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path)
    store.put(ns, key, chunk)
    (tmp_path / ns / "notes.txt").write_text("operator's notes")
    (tmp_path / ns / "old").mkdir()
    (tmp_path / ns / f"{'a1' * 8}.hrry.bad").write_bytes(b"moved aside")  # fsck --quarantine's; prune deletes it
    report = fsck(store)
    assert report.clean and report.checked == report.good == 1
    assert [s.partition(": ")[::2] for s in report.skipped] == [
        (str(tmp_path / ns / "notes.txt"), NOT_A_CHUNKS_NAME),
        (str(tmp_path / ns / "old"), NOT_A_CHUNKS_NAME),
    ]
    assert (tmp_path / ns / "notes.txt").exists() and (tmp_path / ns / "old").is_dir()


def test_a_chunk_moved_aside_and_back_while_it_was_read_is_not_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a prune holds a chunk aside (take_if_same) and puts it back (a hard link: the same
    file, a new change time), or a producer writes it again; fsck's read in that window found no file, and
    fsck called the good chunk damaged (and moved it aside). A file that changed while it was read is judged
    again, not called damaged."""
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path)
    store.put(ns, key, chunk)
    real = DirectoryStore.read
    reads: list[str] = []

    def read(self: DirectoryStore, n: str, k: str, **kwargs: bool) -> object:
        reads.append(k)
        if len(reads) > 1:
            return real(self, n, k, **kwargs)
        path = self.path(n, k)
        held = path.with_name(f".{path.name}.abcdef.tmp")
        os.rename(path, held)  # a prune holds it aside ...
        try:
            return real(self, n, k, **kwargs)  # ... fsck's read lands in that window
        finally:
            os.link(held, path)  # ... and puts it back
            os.unlink(held)

    monkeypatch.setattr(DirectoryStore, "read", read)
    report = fsck(store, quarantine=True)
    assert not report.damaged and not report.moved and store.has(ns, key)
    assert report.clean and report.checked == report.good == 1 and reads == [key, key]


@pytest.mark.parametrize("tool", ["fsck", "prune"])
def test_a_directory_holding_no_namespaces_is_refused_as_the_calls_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tool: str
) -> None:
    """Found by a review: fsck and prune given a namespace directory (one level too deep) or another wrong
    path said "0 chunk files checked" and exited 0. Now exit 2 with what to give; an empty directory is an
    empty store (one no engine has written to yet; a file system's lost+found aside) and is fine."""
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path / "store")
    store.put(ns, key, chunk)
    size = ["--max-size", "0"] if tool == "prune" else []
    assert main([tool, str(tmp_path / "store" / ns), *size]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'store' / ns} holds no chunk store namespaces" in err and "its parent" in err
    assert main([tool, str(tmp_path), *size]) == 2  # the directory above the store
    assert "holds no chunk store namespaces" in capsys.readouterr().err
    assert store.has(ns, key)
    (tmp_path / "fresh" / "lost+found").mkdir(parents=True)
    assert main([tool, str(tmp_path / "fresh"), *size]) == 0
    assert "namespaces" not in capsys.readouterr().err
    assert main([tool, str(tmp_path / "store"), *(["--max-size", "1G"] if size else [])]) == 0
