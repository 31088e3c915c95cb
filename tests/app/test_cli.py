"""The hurray-vllm command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import require
from pyhurray_bridge import to_reference

import hurray_vllm as hv
from hurray_vllm.app.cli import main
from hurray_vllm.app.demo import spec_example_snapshot


@pytest.fixture()
def files(tmp_path: Path) -> Path:
    snap = spec_example_snapshot(num_layers=2)
    hv.save(snap, tmp_path / "s.hrry")
    hv.save(snap, tmp_path / "s.hrrs")
    return tmp_path


#: A migration's --after and --max-tokens, for the commands that never get that far.
TOKENS = ["--after", "2", "--max-tokens", "4"]


def test_help_lists_every_command_with_examples() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hurray_vllm.app.cli", "--help"], capture_output=True, text=True, check=True
    )
    for cmd in ("inspect", "validate", "convert", "migrate", "receive", "prune", "fsck", "router", "demo"):
        assert cmd in out.stdout
        assert f"hurray-vllm {cmd}" in out.stdout


def test_inspect_table_and_json(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(files / "s.hrry")]) == 0
    table = capsys.readouterr().out
    assert "layers.1.value" in table and "seq_lens [6, 3]" in table
    assert main(["inspect", "--json", str(files / "s.hrrs")]) == 0
    doc = json.loads(capsys.readouterr().out)
    bp = [t for t in doc["tensors"] if t["layout"] == "block_paged"]
    assert len(bp) == 4
    want = {"layer": 0, "role": "key", "page_size": 4, "num_pages": 5, "num_seqs": 2}
    assert {k: bp[0][k] for k in want} == want
    assert bp[0]["seq_lens"] == [6, 3] and bp[0]["referenced_pages"] == 2 and bp[0]["shared_pages"] == 1


def test_validate_exit_codes(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(files / "s.hrry")]) == 0
    raw = bytearray((files / "s.hrrs").read_bytes())
    at = raw.index(hv.encode_descriptor(spec_example_snapshot(num_layers=2)[0, "key"].descriptor()))
    raw[at + 20 + 24 + 8 + 26] = 1  # a reserved byte of the block-paged fields
    (files / "bad.hrrs").write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["validate", str(files / "bad.hrrs")]) == 1
    assert "block_paged.reserved" in capsys.readouterr().out
    assert main(["validate", "--permissive", str(files / "bad.hrrs")]) == 0


def test_convert_permissive_repages_and_writes_what_permissive_readers_waive(tmp_path: Path) -> None:
    """Token ids shorter than the KV: a waivable violation, carried over with --permissive only."""
    from dataclasses import replace

    from synthetic import save_unchecked

    snap = spec_example_snapshot(num_layers=2)
    save_unchecked(replace(snap, token_ids=[snap.token_ids[0][:2], snap.token_ids[1]]), tmp_path / "bad.hrry")
    args = ["convert", "-q", "--page-size", "2", str(tmp_path / "bad.hrry")]
    assert main([*args, str(tmp_path / "strict.hrry")]) == 1 and not (tmp_path / "strict.hrry").exists()
    assert main(["convert", "-q", "--permissive", *args[2:], str(tmp_path / "out.hrry")]) == 0
    assert hv.load(tmp_path / "out.hrry", permissive=True)[0, "key"].page_size == 2


def test_convert_both_ways(files: Path) -> None:
    assert main(["convert", "-q", str(files / "s.hrrs"), str(files / "c.hrry")]) == 0
    assert main(["convert", "-q", str(files / "c.hrry"), str(files / "c.hrrs")]) == 0
    assert (files / "c.hrrs").read_bytes() == (files / "s.hrrs").read_bytes()
    assert hv.validate(files / "c.hrry").ok


def test_tools_work_on_foreign_single_descriptors(hurray, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    k = spec_example_snapshot()[3, "key"]
    with hurray.StreamWriter(str(tmp_path / "one.hrrs")) as w:
        w.write(to_reference(hurray, k))
    assert main(["inspect", str(tmp_path / "one.hrrs")]) == 0
    assert "block_paged" in capsys.readouterr().out
    # Valid Hurray records, but one key and no value is no KV that load reads: validate says what load says.
    assert main(["validate", str(tmp_path / "one.hrrs")]) == 1
    assert "error: layer_index: layers [3] are not 0..0" in capsys.readouterr().out
    # convert refuses what validate refuses; --permissive carries the record over as it is.
    assert main(["convert", "-q", str(tmp_path / "one.hrrs"), str(tmp_path / "one.hrry")]) == 1
    assert "layers [3] are not 0..0" in capsys.readouterr().err and not (tmp_path / "one.hrry").exists()
    assert main(["convert", "-q", "--permissive", str(tmp_path / "one.hrrs"), str(tmp_path / "one.hrry")]) == 0
    assert set(hurray.load(str(tmp_path / "one.hrry"))) == {"layers.3.key"}
    assert main(["convert", "-q", "--permissive", str(tmp_path / "one.hrry"), str(tmp_path / "back.hrrs")]) == 0
    assert (tmp_path / "back.hrrs").read_bytes() == (tmp_path / "one.hrrs").read_bytes()


def test_bad_input_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "junk.hrry").write_bytes(b"not hurray at all")
    out = subprocess.run(
        [sys.executable, "-m", "hurray_vllm.app.cli", "inspect", str(tmp_path / "junk.hrry")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert "invalid input" in out.stderr and "Traceback" not in out.stderr


def test_validate_names_what_stopped_parsing(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = (files / "s.hrry").read_bytes()
    (files / "cut.hrry").write_bytes(raw[: len(raw) // 2])
    assert main(["validate", str(files / "cut.hrry")]) == 1
    out = capsys.readouterr().out
    assert out.startswith("error: ") and "trailer" in out


def test_demo_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--format-only", "--workdir", str(tmp_path)]) == 0
    assert "FAILED" not in capsys.readouterr().out
    assert (tmp_path / "spec-example.hrry").is_file()


def test_demo_cleans_its_temporary_directory_unless_kept(capsys: pytest.CaptureFixture[str]) -> None:
    import re
    import shutil

    for keep in (False, True):
        assert main(["demo", "--format-only", *(["--keep"] if keep else [])]) == 0
        out = capsys.readouterr().out
        found = re.search(r" in (\S*hurray-vllm-demo-\S+)", out)
        assert found, out
        where = Path(found.group(1))
        assert where.exists() == keep and ("removed on exit" in out) != keep
        shutil.rmtree(where, ignore_errors=True)


def test_prune_shrinks_a_store_to_the_size_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hurray_vllm.chunks.store import DirectoryStore, store_snapshot

    store = DirectoryStore(tmp_path)
    assert store_snapshot(store, spec_example_snapshot(), 4) == 1
    (chunk,) = tmp_path.glob("*/*.hrry")
    size = chunk.stat().st_size
    assert main(["prune", str(tmp_path), "--max-size", "1G", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chunks_removed"] == 0
    assert main(["prune", str(tmp_path), "--max-size", str(size - 1), "--dry-run"]) == 0
    assert "would delete 1 chunk files" in capsys.readouterr().out and chunk.exists()
    assert main(["prune", str(tmp_path), "--max-size", "0"]) == 0
    assert "deleted 1 chunk files" in capsys.readouterr().out and not chunk.exists()
    with pytest.raises(SystemExit):
        main(["prune", str(tmp_path), "--max-size", "lots"])
    assert main(["prune", str(tmp_path / "nowhere"), "--max-size", "1G"]) == 2


def test_prune_exits_1_when_it_skipped_files_it_could_not_delete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: prune that could not delete a chunk (permissions) listed it as skipped and exited 0,
    leaving the store above --max-size. The --help epilog's exit 1 covers a permission: now it says so."""
    import importlib

    from hurray_vllm.chunks.store import DirectoryStore, store_snapshot

    prune_module = importlib.import_module("hurray_vllm.chunks.prune")  # the package re-exports the function
    assert store_snapshot(DirectoryStore(tmp_path), spec_example_snapshot(), 4) == 1
    (chunk,) = tmp_path.glob("*/*.hrry")

    def rename(src: object, dst: object) -> None:
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(prune_module.os, "rename", rename)
    assert main(["prune", str(tmp_path), "--max-size", "0"]) == 1
    err = capsys.readouterr().err
    assert f"skipped: {chunk}: Permission denied" in err and chunk.exists()
    assert "prune skipped 1 path it could not read, delete or follow" in err and "above --max-size" in err
    assert main(["prune", str(tmp_path), "--max-size", "1G"]) == 0  # nothing to delete: nothing skipped
    assert "could not" not in capsys.readouterr().err


def test_a_refused_option_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from hurray_vllm.app import cli
    from hurray_vllm.errors import HurrayArgumentError

    def refuse(args: object) -> int:
        raise HurrayArgumentError("page_size", "flash-attn 2 needs a multiple of 256, not 100")

    monkeypatch.setattr(cli, "cmd_inspect", refuse)
    assert cli.main(["inspect", str(tmp_path / "x.hrry")]) == 2
    err = capsys.readouterr().err
    assert err == "hurray-vllm: page_size: flash-attn 2 needs a multiple of 256, not 100\n"


# ── bad input: one line and a non-zero exit, never a traceback ───────────────


@pytest.mark.parametrize(
    "argv",
    [
        ["prune", "{dir}", "--max-size", "infG"],
        ["prune", "{dir}", "--max-size", "1e400G"],
        ["prune", "{dir}", "--max-size", "-5G"],
        ["prune", "{dir}", "--max-size", "0.5"],
        ["convert", "{file}", "{dir}/out.hrrs", "--page-size", "1099511627776"],
        ["convert", "{file}", "{dir}/out.hrrs", "--page-size", "0"],
        ["receive", "--listen", "localhost", "--dir", "{dir}"],
        ["receive", "--listen", "127.0.0.1:99999", "--dir", "{dir}"],
        ["receive", "--listen", "127.0.0.1:0", "--dir", "{dir}", "--quota", "lots"],
        ["router", "--listen", "127.0.0.1:0", "--backend", "ftp://a:1"],
        ["router", "--listen", "127.0.0.1:0", "--backend", "http://a:1", "--policy", "random"],
        ["receive", "--listen", "127.0.0.1:0", "--dir", "{dir}", "--timeout", "nan"],
        ["receive", "--listen", "127.0.0.1:0", "--dir", "{dir}", "--idle-timeout", "inf"],
        ["router", "--listen", "127.0.0.1:0", "--backend", "http://a:1", "--health-interval", "nan"],
        ["router", "--listen", "127.0.0.1:0", "--backend", "http://a:1", "--stream-timeout", "-1"],
        ["router", "--listen", "127.0.0.1:0", "--backend", "http://a:1", "--kv-load-slack", "-1"],
        ["router", "--listen", "127.0.0.1:0", "--backend", "http://a:1", "--kv-load-slack", "2.5"],
        ["migrate", "--from", "notaurl", "--to", "http://b:1", "--prompt-ids", "1", *TOKENS],
        ["receive", "--listen", "::1:0", "--dir", "{dir}"],
        ["convert", "{file}", "-"],
        ["convert", "{file}", "{dir}/out.hrrs", "--page-size", "131072"],
        ["receive", "--listen", "[localhost]:0", "--dir", "{dir}"],
        ["inspect", "-"],
        ["validate", "-"],
        ["convert", "-", "{dir}/out.hrrs"],
    ],
    ids=[
        "size inf", "size 1e400", "size negative", "size half a byte", "page 2^40", "page 0", "listen no port",
        "listen port range",
        "quota not a size", "backend not http", "unknown policy", "timeout nan", "idle inf", "health nan",
        "stream timeout negative", "kv slack negative", "kv slack fraction",
        "migrate not a url", "listen ipv6 bare", "convert to stdout", "page 2^17",
        "listen brackets not ipv6", "inspect stdin", "validate stdin", "convert stdin",
    ],
)  # fmt: skip
def test_bad_options_are_refused_before_anything_runs(
    argv: list[str], files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a.format(dir=files, file=files / "s.hrry") for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_receiver_limits_out_of_range_are_one_line(
    files: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hurray_vllm import transport

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("max_chunk_bytes=0 must be positive")

    monkeypatch.setattr(transport, "receiver_for", refuse)  # a limit the receiver itself refuses
    assert main(["receive", "--listen", "127.0.0.1:0", "--dir", str(files), "-q"]) == 2
    err = capsys.readouterr().err
    assert "max_chunk_bytes=0" in err and "Traceback" not in err and err.count("\n") == 1


def test_receive_over_nixl_without_nixl_is_a_usage_error(
    files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: NixlUnavailableError (an ImportError) got past cmd_receive as an internal error (exit 3)."""
    import hurray_vllm.transport as transport
    from hurray_vllm.transport.nixl import agent

    def no_nixl() -> Any:
        raise agent.NixlUnavailableError(f"the NIXL transport needs NIXL, which is not installed: {agent.INSTALL_HINT}")

    monkeypatch.setattr(agent, "load_nixl", no_nixl)  # as if NIXL were not installed, where it is
    argv = ["receive", "--transport", "nixl", "--listen", "127.0.0.1:0", "--dir", str(files), "-q"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hurray-vllm: transport: ") and agent.INSTALL_HINT in err and "internal error" not in err

    def factory(*args: Any, **kwargs: Any) -> Any:  # the channel factory, its message without the install command
        raise agent.NixlUnavailableError("no module named nixl")

    monkeypatch.setattr(transport, "receiver_for", factory)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no module named nixl" in err and agent.INSTALL_HINT in err and "internal error" not in err, err


def test_bad_files_and_servers_are_one_line(files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        ["inspect", str(tmp_path)],  # a directory as input
        ["validate", str(tmp_path)],
        ["convert", str(tmp_path), str(tmp_path / "x.hrrs")],
        ["convert", str(files / "s.hrry"), str(tmp_path)],  # a directory as output
        ["migrate", "--from", "http://127.0.0.1:9", "--to", "http://127.0.0.1:8", "--prompt-ids", "1,2,3", *TOKENS],
        ["migrate", "--from", "http://127.0.0.1:9", "--to", "http://127.0.0.1:8", "--prompt-ids", "1,x", *TOKENS],
    ]
    for argv in cases:
        code = main(argv)
        captured = capsys.readouterr()
        said = (captured.err or captured.out).strip()  # validate reports on stdout, the rest on stderr
        assert code != 0, argv
        assert said and "\n" not in said and "Traceback" not in said, (argv, said)


def test_files_that_are_not_files_are_one_line_and_never_hang(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO (opened twice, it would block), /dev/zero as a prompt file, a file where a store belongs."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    binary = tmp_path / "binary"
    binary.write_bytes(bytes(range(256)))
    not_dir = tmp_path / "not-a-dir"
    not_dir.write_bytes(b"x")
    migrate = ["migrate", "--from", "http://127.0.0.1:9", "--to", "http://127.0.0.1:8", *TOKENS]
    for command in ("inspect", "validate"):  # in a process of its own: a regression hangs, and must fail instead
        cli = [sys.executable, "-m", "hurray_vllm.app.cli", command, str(fifo)]
        run = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        said = (run.stderr or run.stdout).strip()
        assert run.returncode != 0 and "pipe" in said and "\n" not in said, (command, said)
    cases = [
        ([*migrate, "--prompt-file", "/dev/zero"], "prompt_file"),
        ([*migrate, "--prompt-file", str(binary)], "prompt_file"),
        (["receive", "--listen", "127.0.0.1:0", "--dir", str(not_dir), "-q"], "Not a directory"),
        (["fsck", str(files / "s.hrry")], "Not a directory"),
        (["prune", str(files / "s.hrry"), "--max-size", "1G"], "Not a directory"),
        (["validate", str(tmp_path / "missing.hrry")], "No such file"),
    ]
    for argv, says in cases:
        code = main(argv)
        captured = capsys.readouterr()
        said = (captured.err or captured.out).strip()
        assert code != 0 and says in said and "\n" not in said and "Traceback" not in said, (argv, said)
    assert main(["validate", str(tmp_path / "missing.hrry")]) == 2  # the caller's mistake, not a verdict
    capsys.readouterr()
    safetensors = tmp_path / "s.safetensors"
    assert main(["convert", str(files / "s.hrry"), str(safetensors)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(safetensors)]) == 0
    assert "safetensors file" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (200, b"<html>not an API</html>", "not an OpenAI-compatible server"),
        (200, b'{"data": []}', "lists no model"),
        (404, b'{"error": {"message": "The model `x` does not exist."}}', "does not exist"),
    ],
    ids=["html", "no model", "server error"],
)
def test_migrate_against_a_server_that_is_not_vllm_says_what_it_got(
    status: int, body: bytes, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code = main(["migrate", "--from", url, "--to", "http://127.0.0.1:9", "--prompt-ids", "1,2,3", *TOKENS])
        server.shutdown()
    err = capsys.readouterr().err.strip()
    assert code == 1 and says in err and "\n" not in err and "internal error" not in err, err


@pytest.mark.parametrize("reply", [b"garbage, not HTTP\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"])
def test_migrate_to_a_port_that_does_not_speak_http_is_one_line(
    reply: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    """A receiver's port given as --to, or an answer cut short: http.client's own errors were a traceback."""
    import socket
    import threading

    lsock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{lsock.getsockname()[1]}"
    try:
        code = main(["migrate", "--from", url, "--to", "http://127.0.0.1:9", "--prompt-ids", "1,2,3", *TOKENS])
    finally:
        lsock.close()
    err = capsys.readouterr().err.strip()
    assert code == 1 and "not an HTTP answer" in err and "Traceback" not in err, err


def test_migrate_refuses_a_timeout_that_is_not_positive() -> None:
    from hurray_vllm.adapters.vllm.migrate import migrate

    for bad in (0, -1, float("nan")):
        with pytest.raises(hv.HurrayArgumentError, match="timeout"):
            migrate("http://127.0.0.1:9", "http://127.0.0.1:9", [1, 2], max_tokens=4, after=2, timeout=bad)


def test_convert_writes_through_a_symlink_and_names_the_path_given(files: Path, tmp_path: Path) -> None:
    """The link stays a link and its target gets the file; errors name the user's path, not a temporary one."""
    target = tmp_path / "real.hrrs"
    link = tmp_path / "link.hrrs"
    link.symlink_to(target)
    assert main(["convert", str(files / "s.hrry"), str(link)]) == 0
    assert link.is_symlink() and target.is_file()
    assert hv.load(link).num_layers == hv.load(files / "s.hrry").num_layers
    with pytest.raises(OSError) as err:
        hv.save(hv.load(files / "s.hrry"), tmp_path / "missing-dir" / "x.hrrs")
    assert ".tmp" not in str(err.value) and "missing-dir" in str(err.value)


def test_files_of_every_format_get_the_same_permissions(tmp_path: Path) -> None:
    import os
    import stat

    snap = spec_example_snapshot()
    modes = set()
    for suffix in (".hrry", ".hrrs", ".safetensors"):
        hv.save(snap, tmp_path / f"s{suffix}")
        modes.add(stat.S_IMODE(os.stat(tmp_path / f"s{suffix}").st_mode))
    assert len(modes) == 1, modes


def test_user_mistakes_found_in_review_are_one_line(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """convert onto its own input; a receiver that could not store what it is sent; a router's port in use."""
    import socket
    import tempfile

    same = files / "s.hrry"
    before = same.read_bytes()
    assert main(["convert", str(same), str(same), "--to", "safetensors"]) == 2
    assert "is the input file" in capsys.readouterr().err and same.read_bytes() == before

    def unwritable(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(tmp_path / "store"))

    monkeypatch.setattr(tempfile, "TemporaryFile", unwritable)
    assert main(["receive", "--listen", "127.0.0.1:0", "--dir", str(tmp_path / "store"), "-q"]) == 1
    assert "Permission denied" in capsys.readouterr().err
    monkeypatch.undo()

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["router", "--listen", f"127.0.0.1:{port}", "--backend", "http://127.0.0.1:9"]) == 1
    out = capsys.readouterr()
    assert f"127.0.0.1:{port}" in out.err and "in use" in out.err and "router on" not in out.out


def _openai_stub(model: str, token_ids: object, usage: object = None) -> Any:
    """A stand-in OpenAI server on 127.0.0.1: serves ``model``, answers every completion with ``token_ids``."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, doc: object) -> None:
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._send({"data": [{"id": model}]})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send({"choices": [{"token_ids": token_ids}], "usage": usage})

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize(
    ("source", "destination", "says"),
    [
        (("a", [5, 6]), ("b", [7, 8]), "does not serve 'a'"),  # two models: not one continuation
        (("a", [5]), ("a", [7, 8]), "generated 1 tokens where 2"),  # the source ended before the move
        (("a", [5, 6]), ("a", [7]), "generated 1 tokens where 2"),  # short of max_tokens in all
        (("a", ["x", 6]), ("a", [7, 8]), "not non-negative integers"),
        (("a", [5, 6]), ("a", [7, 8], "none"), None),  # a usage that is no object: no cached count, no crash
    ],
    ids=["other model", "source short", "destination short", "bad ids", "bad usage"],
)
def test_migrate_checks_what_the_servers_answer(
    source: tuple[Any, ...], destination: tuple[Any, ...], says: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    servers = [_openai_stub(*source), _openai_stub(*destination)]
    try:
        src, dst = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
        code = main(["migrate", "--from", src, "--to", dst, "--prompt-ids", "1,2,3", *TOKENS, "--timeout", "10"])
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
    err = capsys.readouterr().err.strip()
    if says is None:
        assert code == 0, err
    else:
        assert code == 1 and says in err and "internal error" not in err, err


def test_router_options_reach_the_router_and_its_defaults_are_the_routers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    require("aiohttp")
    import hurray_vllm.app.router as router
    from hurray_vllm.app.router.backends import KV_LOAD_SLACK

    seen: list[Any] = []
    monkeypatch.setattr(router, "serve", lambda config, host, port, log_level: seen.append(config))
    base = ["router", "--listen", "127.0.0.1:0", "--backend", "http://a:1"]
    assert main([*base, "--kv-load-slack", "3", "--backend-api-key", "k1"]) == 0
    assert seen[-1].kv_load_slack == 3 and seen[-1].backend_api_key == "k1"
    assert main(base) == 0
    assert seen[-1].kv_load_slack == KV_LOAD_SLACK and seen[-1].backend_api_key is None
    with pytest.raises(SystemExit):
        main(["router", "--help"])
    assert f"(default {KV_LOAD_SLACK})" in " ".join(capsys.readouterr().out.split())


# ── found in review: validate == load, exit codes, pipes, the demo's failures ──


def test_validate_says_what_load_says_of_kv_outside_a_snapshot(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A block-paged record under another name, alone: valid Hurray, but load refuses it, and so must validate."""
    from hurray_vllm.containers.io import open_records, save_records
    from hurray_vllm.containers.schema import Record

    (rec,) = [r for r in open_records(files / "s.hrry") if r.name == "layers.0.key"]
    save_records([Record("kv0", rec.descriptor, rec.buffers)], files / "kv0", format="hrry")
    with pytest.raises(hv.HurrayFormatError) as refused:
        hv.load(files / "kv0")
    for permissive in ([], ["--permissive"]):
        assert main(["validate", *permissive, str(files / "kv0")]) == 1
        out = capsys.readouterr().out
        assert out == f"error: {refused.value}\n", out
    assert main(["validate", str(files / "s.hrrs")]) == 0  # a whole snapshot still is valid


def test_validate_permissive_checks_a_chunks_mac_permissively(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--permissive --key-file: the MAC is checked on the snapshot a permissive load reads, not a strict one."""
    from dataclasses import replace

    from synthetic import example_chunk, save_unchecked

    from hurray_vllm.chunks.digest import DIGEST_KEY, chunk_digest
    from hurray_vllm.chunks.signing import FleetKeys, sign_chunk

    ns, key, chunk = example_chunk()
    waivable = replace(chunk, token_ids=tuple(ids[:2] for ids in chunk.token_ids))  # fewer ids than KV tokens
    # Its digest for what it holds, as a producer computes it before signing (load checks a carried digest).
    waivable = replace(waivable, extra={**waivable.extra, DIGEST_KEY: chunk_digest(waivable)})
    path = tmp_path / ns / f"{key}.hrry"
    path.parent.mkdir()
    save_unchecked(sign_chunk(waivable, FleetKeys.from_secrets(b"k" * 32), ns, key), path)
    key_file = tmp_path / "fleet.key"
    key_file.write_bytes(b"k" * 32)
    key_file.chmod(0o600)
    assert main(["validate", "--key-file", str(key_file), str(path)]) == 1
    assert "snapshot.token_ids" in capsys.readouterr().out
    assert main(["validate", "--permissive", "--key-file", str(key_file), str(path)]) == 0
    assert capsys.readouterr().out.endswith("valid (permissive)\n")
    other = tmp_path / "other.key"
    other.write_bytes(b"o" * 32)
    other.chmod(0o600)
    assert main(["validate", "--permissive", "--key-file", str(other), str(path)]) == 1  # the MAC is still checked


def test_validate_says_a_store_chunk_whose_pools_do_not_match_its_digest_is_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: without --key-file a chunk with a flipped pool byte was "valid" (exit 0) while the
    connector refused and quarantined it; fsck found it. validate now says what load and the connector say."""
    from synthetic import example_chunk

    from hurray_vllm.chunks import DirectoryStore, fsck

    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path)
    store.put(ns, key, chunk)
    path = store.path(ns, key)
    assert main(["validate", str(path)]) == 0
    capsys.readouterr()
    raw = bytearray(path.read_bytes())
    pool = chunk.values[-1].page_pool.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    at = raw.rfind(pool)  # the last value pool: nothing after it in the file says what its bytes must be
    assert at > 0
    raw[at + 5] ^= 0x10
    path.write_bytes(bytes(raw))
    damaged = "snapshot.digest: chunk data does not match its digest (corrupt transfer?)"
    assert main(["validate", str(path)]) == 1
    assert capsys.readouterr().out == f"error: {damaged}\n"
    assert [why for _, why in fsck(store).damaged] == [damaged]  # what fsck has said all along


def test_a_path_of_the_wrong_kind_is_the_callers_mistake_exit_2(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        (["inspect", str(tmp_path)], "Is a directory"),
        (["validate", str(tmp_path)], "Is a directory"),
        (["convert", str(tmp_path), str(tmp_path / "x.hrrs")], "directory"),
        (["fsck", str(files / "s.hrry")], "Not a directory"),
        (["prune", str(files / "s.hrry"), "--max-size", "1G"], "Not a directory"),
        (["inspect", str(files / "s.hrry" / "x.hrry")], "Not a directory"),
    ]
    for argv, says in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, (argv, err)


def test_help_documents_every_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    section = out[out.index("exit status:") :]
    for code in (0, 1, 2, 3, 130, 141):
        assert f"\n  {code} " in section, code


def test_every_argument_has_help() -> None:
    import argparse

    from hurray_vllm.app.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [
        f"{name} {action.dest}"
        for name, parser in sub.choices.items()
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert not missing, missing


def test_stdin_as_input_says_it_is_not_supported(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a review (migrate): --prompt-file - said "No such file or directory: -"."""
    migrate = ["migrate", "--from", "http://127.0.0.1:9", "--to", "http://127.0.0.1:8", *TOKENS, "--prompt-file", "-"]
    for argv in (["convert", "-", str(files / "out.hrrs")], migrate):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "'-' (standard input) is not supported" in err and "No such file" not in err


def test_output_closed_early_is_quiet_and_exit_141(files: Path) -> None:
    """`hurray-vllm inspect big.hrrs | head -1`: no "Broken pipe" message, no traceback, the shell's 141."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # a reader that has gone: every write fails
    try:
        run = subprocess.run(
            [sys.executable, "-m", "hurray_vllm.app.cli", "inspect", str(files / "s.hrrs")],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert run.returncode == 141 and run.stderr == "", (run.returncode, run.stderr)


def test_convert_refuses_an_output_suffix_it_cannot_read_a_format_from(
    files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The format comes from the suffix (or --to): out.txt is not silently a stream."""
    out = files / "out.txt"
    assert main(["convert", str(files / "s.hrry"), str(out)]) == 2
    err = capsys.readouterr().err
    assert ".hrry, .hrrs, .safetensors" in err and "--to" in err and not out.exists()
    assert main(["convert", "-q", "--to", "stream", str(files / "s.hrry"), str(out)]) == 0
    assert hv.load(out).num_layers == 2


def test_demo_without_vllm_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    assert main(["demo", "-q"]) == 2
    err = capsys.readouterr().err
    assert "vllm" in err and "pip install" in err and "--format-only" in err and "internal error" not in err, err


def test_demo_keep_quiet_still_names_the_kept_directory(capsys: pytest.CaptureFixture[str]) -> None:
    import re
    import shutil

    assert main(["demo", "--format-only", "--keep", "-q"]) == 0
    captured = capsys.readouterr()
    found = re.search(r"(\S*hurray-vllm-demo-\S+)", captured.err)
    assert captured.out == "" and found, captured
    assert (Path(found.group(1)) / "spec-example.hrry").is_file()
    shutil.rmtree(found.group(1))


def test_demo_engines_report_no_usage_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from hurray_vllm.app import demo

    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(name, "0")  # restored afterwards: the demo sets them
    monkeypatch.delenv("VLLM_NO_USAGE_STATS", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())
    seen: list[str | None] = []

    def stop() -> tuple[float, str]:  # the first step: the engines start after it
        import os

        seen.append(os.environ.get("VLLM_NO_USAGE_STATS"))
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_native_kernels", stop)
    with pytest.raises(KeyboardInterrupt):
        demo.run_vllm_demo(quiet=True)
    assert seen == ["1"]


def test_demo_second_engine_timeout_is_a_failed_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hurray_vllm.app import demo

    def too_slow(cmd: list[str], **kwargs: Any) -> None:
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], stderr=b"still loading")

    monkeypatch.setattr(subprocess, "run", too_slow)
    snap = spec_example_snapshot()
    prompts = {"seq-0": list(snap.token_ids[0][:5]), "seq-1": list(snap.token_ids[1][:3])}
    run = demo._FirstRun(snap, prompts, {"seq-0": [1, 2, 3], "seq-1": [1, 2]}, 0.1)
    checks = demo._Checks()
    assert demo._second_engine(Path("model"), run, tmp_path, checks, verbose=False)[1] == {}
    assert checks.exit_code() == 1
    # Found by a review: the failure went to stdout, which -q silences; it is said on stderr, after the engine
    # logs (which send stderr into demo.log) are done.
    assert capsys.readouterr().out == ""
    checks.print_failures()
    captured = capsys.readouterr()
    assert "did not finish within 600 s" in captured.err and "still loading" in captured.err and not captured.out


def test_demo_model_interrupted_mid_build_is_not_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers writes config.json before the weights: a Ctrl-C then must not leave a "model" behind."""
    transformers = require("transformers")
    from hurray_vllm.app.demo import _tiny_llama

    def interrupted(self: Any, path: Path, **kwargs: Any) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    model = tmp_path / "tiny-llama"
    with monkeypatch.context() as m:
        m.setattr(transformers.LlamaForCausalLM, "save_pretrained", interrupted)
        with pytest.raises(KeyboardInterrupt):
            _tiny_llama(model)
    assert list(tmp_path.iterdir()) == []  # neither the model nor its temporary directory
    model.mkdir()
    (model / "config.json").write_text("{}")  # an interrupted build of an earlier version: no weights
    assert _tiny_llama(model) == model
    assert (model / "config.json").stat().st_size > 2 and list(model.glob("*.safetensors"))
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama"]


def test_a_pipe_a_device_or_a_link_loop_for_a_file_is_the_callers_mistake_exit_2(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: a FIFO or device given for a file was an invalid file (exit 1), and a symbolic link
    loop was 'No such file' in validate but exit 1 in inspect: each is a wrong argument (exit 2), one line."""
    import os

    fifo = tmp_path / "fifo.hrry"
    os.mkfifo(fifo)
    loop = tmp_path / "loop.hrry"
    loop.symlink_to(loop.name)
    key_file = tmp_path / "fleet.key"
    key_file.write_bytes(b"k" * 32)
    key_file.chmod(0o600)
    cases = [
        (["validate", "--key-file", str(key_file), str(loop)], "symbolic links"),
        (["validate", str(fifo)], "not a regular file"),
        (["inspect", str(fifo)], "not a regular file"),
        (["validate", "/dev/null"], "not a regular file"),
        (["convert", str(fifo), str(tmp_path / "out.hrrs")], "not a regular file"),
        (["convert", str(files / "s.hrrs"), str(fifo)], "not a regular file"),
        (["validate", str(loop)], "symbolic links"),
        (["inspect", str(loop)], "symbolic links"),
        (["convert", str(loop), str(tmp_path / "out.hrrs")], "symbolic links"),
        (["convert", str(files / "s.hrrs"), str(loop)], "symbolic links"),
    ]
    for argv, says in cases:
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert says in captured.err and captured.err.count("\n") == 1 and not captured.out, (argv, captured)
    assert fifo.exists() and not (tmp_path / "out.hrrs").exists()


def test_inspect_json_is_strict_json_whatever_the_kv_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a review: bytes inside a KV array crashed inspect --json (exit 3), a NaN was printed bare."""
    from hurray_vllm.containers.io import save_records
    from hurray_vllm.containers.schema import snapshot_records

    kv = {"hurray_vllm.format_version": 1, "x.blobs": [b"\x00\x01", b"\xff"], "x.score": float("nan")}
    kv |= {"x.big": float("inf"), "x.blob": b"\xab"}
    path = tmp_path / "kv.hrry"
    save_records(snapshot_records(spec_example_snapshot()), path, kv=kv)
    assert main(["inspect", "--json", str(path)]) == 0

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    doc = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert doc["kv"] == {
        "hurray_vllm.format_version": 1,
        "x.blobs": ["0001", "ff"],
        "x.score": "nan",
        "x.big": "inf",
        "x.blob": "ab",
    }


@pytest.mark.parametrize(("debug", "traceback"), [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)])
def test_hurray_vllm_debug_0_shows_no_traceback(
    debug: str | None, traceback: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: HURRAY_VLLM_DEBUG=0 showed the traceback (any value set counted as on)."""
    from hurray_vllm.app import cli

    def bug(args: Any) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_inspect", bug)
    if debug is None:
        monkeypatch.delenv("HURRAY_VLLM_DEBUG", raising=False)
    else:
        monkeypatch.setenv("HURRAY_VLLM_DEBUG", debug)
    if traceback:
        with pytest.raises(RuntimeError, match="a bug"):
            main(["inspect", "x.hrry"])
    else:
        assert main(["inspect", "x.hrry"]) == 3
        assert "internal error: RuntimeError: a bug" in capsys.readouterr().err


def test_a_file_or_a_dangling_link_given_for_a_directory_is_the_calls_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: mkdir's FileExistsError exited 1 (a failed operation) where the path given was wrong."""
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"x")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nothing")
    for path in (a_file, dangling):
        assert main(["demo", "--format-only", "-q", "--workdir", str(path)]) == 2
        err = capsys.readouterr().err
        assert "--workdir" in err and str(path) in err and "\n" not in err.strip(), err
        assert main(["receive", "--listen", "127.0.0.1:0", "--dir", str(path), "-q"]) == 2
        err = capsys.readouterr().err
        assert "chunk store is a directory" in err and str(path) in err and "\n" not in err.strip(), err
    assert not (tmp_path / "nothing").exists() and a_file.read_bytes() == b"x"


def test_demo_keep_names_the_kept_directory_when_a_step_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: without -q only the summary named it, and a failed step prints none."""
    import re
    import shutil

    from hurray_vllm.app import demo

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device", "spec-example.hrry")

    monkeypatch.setattr(demo, "spec_example_snapshot", fail)
    assert main(["demo", "--format-only", "--keep"]) == 1
    err = capsys.readouterr().err
    found = re.search(r"files kept in (\S*hurray-vllm-demo-\S+)", err)
    assert found and "No space left" in err, err
    assert Path(found.group(1)).is_dir()
    shutil.rmtree(found.group(1))
    assert main(["demo", "--format-only"]) == 1  # not kept: removed, and not named
    assert "files kept" not in capsys.readouterr().err


# ── found in a new user's review of the CLI and the docs ─────────────────────


def test_convert_refuses_what_validate_refuses_unless_permissive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: .hrry <-> .hrrs (record by record) wrote invalid output and exited 0 for input validate
    refuses (a chunk whose pools do not match their digest, token ids shorter than the KV). Now exit 1 with
    validate's message and nothing written; --permissive still carries the records over."""
    from dataclasses import replace

    from synthetic import example_chunk, save_unchecked

    from hurray_vllm.chunks import DirectoryStore

    snap = spec_example_snapshot(num_layers=2)
    short = tmp_path / "short.hrry"
    save_unchecked(replace(snap, token_ids=[snap.token_ids[0][:2], snap.token_ids[1]]), short)
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path / "store")
    store.put(ns, key, chunk)
    damaged = store.path(ns, key)
    raw = bytearray(damaged.read_bytes())
    pool = chunk.values[-1].page_pool.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    raw[raw.rfind(pool) + 5] ^= 0x10
    damaged.write_bytes(bytes(raw))
    for bad in (short, damaged):
        capsys.readouterr()
        assert main(["validate", str(bad)]) == 1
        invariant, _, message = capsys.readouterr().out.splitlines()[0].removeprefix("error: ").partition(": ")
        for suffix in (".hrrs", ".hrry"):
            out = tmp_path / f"out{suffix}"
            assert main(["convert", "-q", str(bad), str(out)]) == 1, (bad, suffix)
            err = capsys.readouterr().err
            assert err.startswith(f"hurray-vllm: invalid input: {invariant}") and message in err, err
            assert not out.exists()
            assert main(["convert", "-q", "--permissive", str(bad), str(out)]) == 0 and out.exists()
            out.unlink()


def test_inspect_json_has_the_same_keys_in_every_format(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a review: safetensors rows lacked referenced_pages and shared_pages (seq_lens null), and
    quantization came only when set. Every row has every key (null when unknown), whatever the format."""
    hv.save(spec_example_snapshot(num_layers=2), files / "s.safetensors")
    docs = {}
    for name in ("s.hrry", "s.hrrs", "s.safetensors"):
        capsys.readouterr()
        assert main(["inspect", "--json", str(files / name)]) == 0
        docs[name] = json.loads(capsys.readouterr().out)["tensors"]
    keys = {frozenset(row) for rows in docs.values() for row in rows}
    assert len(keys) == 1, keys
    assert {"referenced_pages", "shared_pages", "seq_lens", "quantization", "rule", "members"} <= set(next(iter(keys)))
    assert docs["s.safetensors"] == docs["s.hrry"]  # a stream's rows differ only in names (a stream has none)
    assert [dict(r, name=None) for r in docs["s.hrrs"]] == [dict(r, name=None) for r in docs["s.hrry"]]
    paged = [r for r in docs["s.safetensors"] if r["layout"] == "block_paged"]
    assert paged and all(r["seq_lens"] == [6, 3] and r["referenced_pages"] == 2 for r in paged)
    assert all(r["quantization"] is None for r in paged)
    assert main(["inspect", str(files / "s.safetensors")]) == 0
    assert "seq_lens [6, 3]" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["receive", "--listen", "127.0.0.1:0", "--dir", "{dir}", "--max-connections", "0"], "--max-connections"),
        (["receive", "--listen", "127.0.0.1:0", "--dir", "{dir}", "--quota", "0"], "--quota"),
        (["receive", "--listen", "127.0.0.1:0", "--dir", "{dir}", "--max-chunk", "0"], "--max-chunk"),
        (["receive", "--listen", "127.0.0.1:0", "--dir", "{dir}", "--max-memory", "0"], "--max-memory"),
        (["router", "--listen", "127.0.0.1:0", "--backend", "http://a:1", "--chunk-tokens", "0"], "--chunk-tokens"),
        (["router", "--listen", "127.0.0.1:0", "--backend", "http://a:1", "--api-key", ""], "--api-key"),
        (["router", "--listen", "127.0.0.1:0", "--backend", "http://a:1", "--backend-api-key", ""],
         "--backend-api-key"),
    ],
    ids=["max connections 0", "quota 0", "max chunk 0", "max memory 0", "chunk tokens 0", "router empty api key",
         "router empty backend key"],
)  # fmt: skip
def test_counts_and_keys_out_of_range_are_refused_naming_the_flag(
    argv: list[str], flag: str, files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: --max-connections 0 named the internal 'limits', --quota 0 was accepted, --chunk-tokens 0
    named --health-interval too, and an empty router key let anyone in (or fell back to the variable). Found by a
    later one: --max-chunk 0 and --max-memory 0 passed the parser and failed in the library's words."""
    with pytest.raises(SystemExit) as exc:
        main([a.format(dir=files) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after argparse's usage lines
    assert f"argument {flag}:" in err and "limits" not in err and "--health-interval" not in err, err


def test_key_file_errors_name_the_option(tmp_path: Path, files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a review: they said 'hurray_key_file:', the connector's option, not the command's."""
    short = tmp_path / "short.key"
    short.write_bytes(b"k" * 8)
    short.chmod(0o600)
    for key in (tmp_path / "missing.key", short):
        assert main(["validate", "--key-file", str(key), str(files / "s.hrry")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hurray-vllm: --key-file: ") and "hurray_key_file" not in err and str(key) in err, err


def test_a_link_loop_given_for_a_directory_says_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop.name)
    assert main(["receive", "--listen", "127.0.0.1:0", "--dir", str(loop), "-q"]) == 2
    err = capsys.readouterr().err
    assert "symbolic link loop (ELOOP)" in err and "missing target" not in err and str(loop) in err, err
    assert main(["demo", "--format-only", "-q", "--workdir", str(loop)]) == 2
    assert "symbolic link loop (ELOOP)" in capsys.readouterr().err


def test_prune_names_unsigned_chunks_only_with_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hurray_vllm.chunks.store import DirectoryStore, store_snapshot

    store_snapshot(DirectoryStore(tmp_path), spec_example_snapshot(), 4)
    assert main(["prune", str(tmp_path), "--max-size", "1G"]) == 0
    out = capsys.readouterr().out
    assert "deleted 0 chunk files," in out and "not signed" not in out, out
    key = tmp_path.parent / "fleet.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o600)
    assert main(["prune", str(tmp_path), "--max-size", "1G", "--key-file", str(key)]) == 0
    assert "(1 not signed with the key)" in capsys.readouterr().out


def test_prune_lists_a_chunk_named_link_and_exits_1_and_fsck_skips_it_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: prune skipped a chunk-named symbolic link silently (exit 0); the docs say it is listed."""
    from hurray_vllm.chunks.store import DirectoryStore, store_snapshot

    store_snapshot(DirectoryStore(tmp_path), spec_example_snapshot(), 4)
    (chunk,) = tmp_path.glob("*/*.hrry")
    link = chunk.with_name("ab" * 16 + ".hrry")
    link.symlink_to(chunk.name)
    assert main(["prune", str(tmp_path), "--max-size", "1G"]) == 1
    err = capsys.readouterr().err
    assert f"skipped: {link}: a symbolic link, not followed" in err, err
    assert main(["fsck", str(tmp_path)]) == 0  # skipped, not unreadable: no failure
    assert f"skipped: {link}: a symbolic link, not followed" in capsys.readouterr().err
    assert link.is_symlink() and chunk.exists()


def test_migrate_refuses_the_same_server_twice(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["migrate", "--prompt-ids", "1 2,3", *TOKENS, "--timeout", "5"]
    for src, dst in (("http://127.0.0.1:9", "http://127.0.0.1:9/"), ("HTTP://LOCALHOST:80/v1/", "http://localhost/v1")):
        assert main([*argv, "--from", src, "--to", dst]) == 2  # refused before either server is called
        assert "same server" in capsys.readouterr().err


def test_router_refuses_an_empty_api_key_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """$HURRAY_API_KEY set but empty: refused at start, as an empty $HURRAY_VLLM_KEY_FILE is (not an open /v1)."""
    require("fastapi")
    require("uvicorn")
    require("aiohttp")
    import uvicorn

    def started(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the router started")

    monkeypatch.setattr(uvicorn, "run", started)
    monkeypatch.setattr(uvicorn.Server, "run", started)
    monkeypatch.setenv("HURRAY_API_KEY", "")
    assert main(["router", "--listen", "127.0.0.1:0", "--backend", "http://127.0.0.1:9"]) == 2
    captured = capsys.readouterr()
    assert "$HURRAY_API_KEY" in captured.err and "empty" in captured.err and "router on" not in captured.out


def test_router_start_up_line_names_the_bound_port_and_prefill_backends(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    require("fastapi")
    require("uvicorn")
    require("aiohttp")
    import gc

    import uvicorn

    seen: list[Any] = []

    def run(self: Any, sockets: Any = None) -> None:
        seen.append(sockets[0].getsockname())
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setattr(gc, "freeze", lambda: None)
    monkeypatch.delenv("HURRAY_API_KEY", raising=False)
    argv = ["router", "--listen", "127.0.0.1:0", "--backend", "http://127.0.0.1:9", "--prefill", "http://127.0.0.1:8"]
    assert main(argv) == 0
    ((_, port),) = seen
    assert port != 0
    line = capsys.readouterr().out
    assert f"router on http://127.0.0.1:{port} " in line and "http://127.0.0.1:9" in line, line
    assert "prefill http://127.0.0.1:8" in line, line


def test_help_says_how_skips_and_stops_exit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "a chunk fsck could not read (listed as unreadable), a path prune could not read, delete or follow "
        "(listed as skipped)" in out
    )
    assert "receive and router exit 0 on" in out


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_router_stops_cleanly_on_sigint_and_sigterm(sig: str) -> None:
    """Found by a review: the epilog's stop (exit 0, as receive's) was 130 on Ctrl-C and death by SIGTERM (143)."""
    require("fastapi")
    require("uvicorn")
    require("aiohttp")
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "hurray_vllm.app.cli", "router", "--listen", "127.0.0.1:0", "--backend",
         "http://127.0.0.1:9"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        assert "router on http://127.0.0.1:" in banner, banner
        port = int(banner.split("127.0.0.1:")[1].split()[0])
        import socket

        for _ in range(300):  # the banner comes before uvicorn serves: a connection says it has its handlers
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (proc.returncode, err)


def test_closed_stdout_or_stderr_is_no_internal_error(
    tmp_path: Path, files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: `validate -q s.hrry >&-` did the work and exited 3 (None has no flush), and with `2>&-` what
    went to stderr (fsck's skipped lines) was printed on stdout, into --json's output."""
    from hurray_vllm.chunks.store import DirectoryStore, store_snapshot

    monkeypatch.setattr(sys, "stdout", None)  # what Python makes of a descriptor closed at start
    assert main(["validate", "-q", str(files / "s.hrry")]) == 0
    assert main(["validate", str(files / "s.hrry")]) == 0  # print() writes nothing
    monkeypatch.undo()
    store = tmp_path / "store"
    store_snapshot(DirectoryStore(store), spec_example_snapshot(), 4)
    (ns,) = [p for p in store.iterdir()]
    (ns / "NOTES.hrry").write_text("operator's notes")  # listed as skipped, on stderr
    capsys.readouterr()
    monkeypatch.setattr(sys, "stderr", None)
    assert main(["fsck", str(store), "--json"]) == 0
    assert main(["validate", str(tmp_path / "missing.hrry")]) == 2  # the error line goes nowhere, not to stdout
    monkeypatch.undo()
    out = capsys.readouterr().out
    assert json.loads(out)["skipped"] and "hurray-vllm:" not in out, out


def test_receive_with_stderr_closed_serves_and_stops_cleanly(tmp_path: Path) -> None:
    """Found by a review: `receive ... 2>&-` started the receiver, then failed to register the SIGUSR1 stack dump
    (no stderr), exit 3, and the receiver was never stopped."""
    import signal

    cmd = [sys.executable, "-m", "hurray_vllm.app.cli", "receive", "--listen", "127.0.0.1:0", "--dir",
           str(tmp_path / "store")]  # fmt: skip
    proc = subprocess.Popen(["sh", "-c", 'exec "$@" 2>&-', "sh", *cmd], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        assert "receiving KV chunks (tcp) on 127.0.0.1:" in banner, banner
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out == "", (proc.returncode, out)


def test_receive_stops_its_receiver_whatever_ends_it(
    files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: only Ctrl-C or SIGTERM stopped the receiver; a failure after its start (a closed stdout at
    the start-up line) left its threads running."""
    from hurray_vllm import transport

    stopped: list[bool] = []

    class Receiver:
        address = ("127.0.0.1", 9)

        def start(self) -> Receiver:
            return self

        def stop(self) -> None:
            stopped.append(True)

    class ClosedPipe:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(transport, "receiver_for", lambda *args, **kwargs: Receiver())
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["receive", "--listen", "127.0.0.1:0", "--dir", str(files)]) == 141
    monkeypatch.undo()
    assert stopped == [True]


def test_key_file_errors_name_where_the_key_file_came_from(
    files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: `--key-file ""` said "hurray_key_file is set to ['']", the connector's option, and a bad
    $HURRAY_VLLM_KEY_FILE was reported as "--key-file: cannot read key file" where no --key-file was given."""
    monkeypatch.delenv("HURRAY_VLLM_KEY_FILE", raising=False)
    assert main(["validate", str(files / "s.hrry"), "--key-file", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hurray-vllm: --key-file: '' names no key file") and "hurray_key_file" not in err, err
    missing = files / "missing.key"
    monkeypatch.setenv("HURRAY_VLLM_KEY_FILE", str(missing))
    assert main(["validate", str(files / "s.hrry")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hurray-vllm: $HURRAY_VLLM_KEY_FILE: cannot read key file {missing}"), err
    assert "--key-file:" not in err and "hurray_key_file" not in err, err
    monkeypatch.setenv("HURRAY_VLLM_KEY_FILE", "")
    assert main(["validate", str(files / "s.hrry")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hurray-vllm: $HURRAY_VLLM_KEY_FILE: set to '', which names no key file"), err


def test_receive_dir_not_writable_names_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: the error named the random file the write check tried to create, not --dir."""
    import tempfile

    store = tmp_path / "store"

    def unwritable(*args: object, dir: Path, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(Path(dir) / "tmpk3x9q2ab"))

    monkeypatch.setattr(tempfile, "TemporaryFile", unwritable)
    assert main(["receive", "--listen", "127.0.0.1:0", "--dir", str(store), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hurray-vllm: Permission denied") and err.rstrip().endswith(f": {store}"), err
    assert "tmpk3x9q2ab" not in err, err


def test_help_says_prune_with_a_key_deletes_unsigned_chunks_whatever_the_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Found by a review: "deleted first" read as an order, where every chunk no key signed goes, whatever
    --max-size; and --max-memory's "refused unread" left out that one chunk alone always fits over tcp."""
    for cmd in ("prune", "receive"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "deleted first" not in out
    assert "every chunk no key of the ring signed" in out and "is deleted, whatever --max-size" in out, out
    assert "a store shared with another fleet loses that fleet's chunks" in out, out
    assert "a chunk beyond it is refused unread, but over tcp one chunk alone is always read" in out, out
