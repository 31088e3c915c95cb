"""Every writer lands files the same way: whole or not at all, with the umask's mode."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import hurray_vllm as hv
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.chunks import DirectoryStore, chunks_of
from hurray_vllm.containers.atomic import atomic_file, atomic_path
from hurray_vllm.containers.io import open_records, save_records


@pytest.fixture
def umask_027():  # type: ignore[no-untyped-def]
    old = os.umask(0o027)
    yield 0o640
    os.umask(old)


@pytest.mark.parametrize("suffix", [".hrry", ".hrrs", ".safetensors"])
def test_save_gives_every_format_the_umask_mode(tmp_path: Path, suffix: str, umask_027: int) -> None:
    path = tmp_path / f"snap{suffix}"
    hv.save(spec_example_snapshot(), path)
    assert stat.S_IMODE(path.stat().st_mode) == umask_027
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_save_records_and_chunk_store_share_the_rule(tmp_path: Path, umask_027: int) -> None:
    src = tmp_path / "a.hrry"
    hv.save(spec_example_snapshot(), src)
    out = tmp_path / "b.hrrs"
    save_records(open_records(src), out)
    assert stat.S_IMODE(out.stat().st_mode) == umask_027
    snap = hv.load(src)
    store = DirectoryStore(tmp_path / "store")
    key, chunk = chunks_of(snap, snap.page_size)[0]
    assert store.put("0a", key, chunk)
    assert stat.S_IMODE(store.path("0a", key).stat().st_mode) == umask_027


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "x.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as f:
            f.write(b"new, half")
            raise RuntimeError("writer died")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]


def test_a_failed_save_leaves_nothing(tmp_path: Path) -> None:
    def records():  # type: ignore[no-untyped-def]
        yield from open_records(tmp_path / "a.hrry")
        raise OSError("disk full")

    hv.save(spec_example_snapshot(), tmp_path / "a.hrry")
    for name in ("b.hrry", "b.hrrs"):
        with pytest.raises(OSError, match="disk full"):
            save_records(records(), tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.hrry"]


def test_temp_names_are_unique_per_write(tmp_path: Path) -> None:
    # Two writers of one target in one process (threads) must not share a temp file.
    with atomic_path(tmp_path / "x") as a, atomic_path(tmp_path / "x") as b:
        assert a != b
        assert a.name.startswith(".x.") and a.name.endswith(".tmp")


def test_writing_never_sets_the_processes_umask(
    tmp_path: Path, umask_027: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading the umask with os.umask sets it for every thread for a moment (a directory another thread makes
    then could come out world-writable): the kernel applies it as the file is created instead."""

    def umask(_: int) -> int:
        raise AssertionError("os.umask called while writing")

    monkeypatch.setattr(os, "umask", umask)
    with atomic_path(tmp_path / "x.bin") as tmp:
        tmp.write_bytes(b"whole")
    assert stat.S_IMODE((tmp_path / "x.bin").stat().st_mode) == umask_027


@pytest.mark.parametrize("suffix", [".hrry", ".hrrs", ".safetensors"])
def test_replacing_a_file_keeps_its_mode(tmp_path: Path, suffix: str) -> None:
    """Found by a review: a private (0600) file came back 0644 after save: open(path, "wb") would keep it."""
    path = tmp_path / f"private{suffix}"
    path.write_bytes(b"old")
    path.chmod(0o600)
    old = os.umask(0o022)
    try:
        hv.save(spec_example_snapshot(), path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert hv.load(path).num_layers == 4


def test_replacing_keeps_a_read_only_mode_and_the_files_group(tmp_path: Path) -> None:
    """A read-only target is still replaced (the temp file is owner-writable while written), and lands 0440."""
    path = tmp_path / "ro.hrrs"
    path.write_bytes(b"old")
    # A group other than the one a new file gets, where this process may give one: the replacement keeps it.
    groups = [g for g in os.getgroups() if g != path.stat().st_gid]
    if os.geteuid() == 0:
        groups.append(path.stat().st_gid + 1)
    if groups:
        os.chown(path, -1, groups[0])
    gid = path.stat().st_gid
    path.chmod(0o440)
    with atomic_file(path) as f:
        f.write(b"new")
    assert path.read_bytes() == b"new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o440 and path.stat().st_gid == gid


def test_atomic_file_syncs_the_directory_the_rename_happened_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: through a symbolic link into another directory, the link's directory was synced, and
    the new entry, in the link target's directory, was not."""
    import hurray_vllm.containers.atomic as atomic

    (tmp_path / "real").mkdir()
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "out.hrrs").symlink_to(tmp_path / "real" / "out.hrrs")
    synced: list[Path] = []
    monkeypatch.setattr(atomic, "_fsync_dir", lambda d: synced.append(Path(os.path.realpath(d))))
    with atomic_file(tmp_path / "links" / "out.hrrs") as f:
        f.write(b"data")
    assert (tmp_path / "real" / "out.hrrs").read_bytes() == b"data"
    assert synced == [Path(os.path.realpath(tmp_path / "real"))]


_UMASK_222 = """
import os, stat, sys
os.umask(0o222)
import hurray_vllm as hv
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.containers.atomic import atomic_file, atomic_path
d = sys.argv[1]
with atomic_file(os.path.join(d, "a.bin")) as f:
    f.write(b"first")
with atomic_file(os.path.join(d, "a.bin")) as f:  # replaces a read-only file of its own
    f.write(b"whole")
with atomic_path(os.path.join(d, "p.bin")) as tmp, open(tmp, "wb") as f:  # a writer that opens it by name
    f.write(b"whole")
snap = spec_example_snapshot()
for suffix in (".hrry", ".hrrs", ".safetensors"):
    hv.save(snap, os.path.join(d, "s" + suffix))
    assert hv.load(os.path.join(d, "s" + suffix)).num_layers == 4
print(sorted((n, oct(stat.S_IMODE(os.stat(os.path.join(d, n)).st_mode))) for n in os.listdir(d)))
"""


def test_a_umask_that_makes_files_read_only_writes_them_read_only(tmp_path: Path) -> None:
    """Found by a review: under umask 0o222 every save failed (the temp file was created 0444, then opened
    again for writing), where ``open(path, "wb")`` creates and writes such a file. Run as a user the permission
    checks apply to (root passes them all): ``nobody`` through ``setpriv`` when the tests run as root."""
    import ast
    import shutil
    import subprocess
    import sys
    import tempfile

    command = [sys.executable, "-c", _UMASK_222]
    work = tmp_path
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: the permission checks would not apply")
        command = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        work = Path(tempfile.mkdtemp(prefix="umask222-"))  # tmp_path's parents are root's own (0700)
        work.chmod(0o777)
    root = Path(__file__).resolve().parents[2]
    out, home = work / "out", work / "home"  # home: for what torch may cache, away from the files counted
    for d in (out, home):
        d.mkdir()
        d.chmod(0o777)
    try:
        done = subprocess.run(
            [*command, str(out)],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root), "HOME": str(home)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        modes = dict(ast.literal_eval(done.stdout.strip().splitlines()[-1]))
        assert (out / "a.bin").read_bytes() == b"whole" and (out / "p.bin").read_bytes() == b"whole"
    finally:
        if work != tmp_path:
            shutil.rmtree(work, ignore_errors=True)
    names = ["a.bin", "p.bin", "s.hrrs", "s.hrry", "s.safetensors"]
    assert modes == dict.fromkeys(names, "0o444")  # as open() made them, and no temporary file left


def test_without_replace_a_file_that_landed_meanwhile_stays(tmp_path: Path) -> None:
    """replace=False (the chunk store's put): a file another writer lands while this one writes is kept."""
    target = tmp_path / "x.bin"
    with pytest.raises(FileExistsError) as err:
        with atomic_file(target, replace=False) as f:
            f.write(b"mine")
            target.write_bytes(b"theirs")
    assert err.value.filename == str(target)
    assert target.read_bytes() == b"theirs" and [p.name for p in tmp_path.iterdir()] == ["x.bin"]
    with pytest.raises(FileExistsError):  # there before: refused before a temporary file is made
        with atomic_file(target, replace=False) as f:
            raise AssertionError("not reached")
    with atomic_file(tmp_path / "y.bin", replace=False, fsync=True) as f:
        f.write(b"new")
    assert (tmp_path / "y.bin").read_bytes() == b"new" and (tmp_path / "y.bin").stat().st_nlink == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin", "y.bin"]


def test_without_replace_a_link_planted_meanwhile_is_replaced_not_kept(tmp_path: Path) -> None:
    outside = tmp_path / "precious.cfg"
    outside.write_bytes(b"keep me")
    target = tmp_path / "x.bin"
    with atomic_file(target, follow_symlinks=False, replace=False) as f:
        f.write(b"mine")
        target.symlink_to(outside)
    assert not target.is_symlink() and target.read_bytes() == b"mine" and outside.read_bytes() == b"keep me"


def test_without_hard_links_replace_false_looks_last_then_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    def no_link(src: object, dst: object, **kwargs: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", str(dst))

    monkeypatch.setattr(os, "link", no_link)
    target = tmp_path / "x.bin"
    with atomic_file(target, replace=False) as f:
        f.write(b"mine")
    assert target.read_bytes() == b"mine"
    other = tmp_path / "y.bin"
    with pytest.raises(FileExistsError):
        with atomic_file(other, replace=False) as f:
            f.write(b"mine")
            other.write_bytes(b"theirs")
    assert other.read_bytes() == b"theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["x.bin", "y.bin"]


def test_a_link_that_fails_otherwise_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def failing(src: object, dst: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "Input/output error", str(dst))

    monkeypatch.setattr(os, "link", failing)
    with pytest.raises(OSError) as err:
        with atomic_file(tmp_path / "x.bin", replace=False) as f:
            f.write(b"mine")
    assert err.value.errno == errno.EIO and list(tmp_path.iterdir()) == []
