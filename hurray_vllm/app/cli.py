"""The ``hurray-vllm`` command line: inspect, validate, convert, migrate, receive, prune, fsck, router, demo."""

from __future__ import annotations

import argparse
import errno
import io
import json
import math
import os
import stat
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..containers.check import validate
from ..containers.io import (
    PARSE_ERRORS,
    SUFFIX_FORMATS,
    detect_format,
    file_kv,
    iter_nodes,
    open_records,
    read_error,
    save_records,
)
from ..containers.schema import Node, Record, group_records, index_tables
from ..errors import HurrayArgumentError, HurrayFormatError
from ..progress import progress
from ..transport import CHANNELS
from ..transport.base import host_port, parse_listen
from ..wire import dtypes
from ..wire.descriptor import LAYOUT_BLOCK_PAGED, TensorDescriptor
from ..wire.rules import raise_if

if TYPE_CHECKING:
    from ..chunks.store import DirectoryStore

__all__ = ["main", "build_parser"]

EPILOG = """\
examples:
  hurray-vllm inspect snapshot.hrry            one line per descriptor
  hurray-vllm inspect snapshot.hrrs --json     the same as JSON
  hurray-vllm validate snapshot.hrry           exit 0 if valid, 1 if not
  hurray-vllm validate other.hrry --permissive waive what the spec lets readers waive
  hurray-vllm convert snapshot.hrrs out.hrry   stream -> file (or file -> stream)
  hurray-vllm demo                             the main job end to end on built-in data
  hurray-vllm migrate --from http://a:8000 --to http://b:8000 --prompt-ids 1,2,3 --after 16 --max-tokens 64
                                               move a decoding request between two vLLM servers
  hurray-vllm receive --listen 0.0.0.0:9000 --dir /var/cache/hurray
                                               accept KV chunks streamed by HurrayConnector
  hurray-vllm prune /var/cache/hurray --max-size 200G
                                               delete least recently used chunks beyond 200 GiB
  hurray-vllm fsck /var/cache/hurray --quarantine
                                               verify every chunk file, move the damaged ones aside
  hurray-vllm router --listen 0.0.0.0:9000 --backend http://a:8000 --backend http://b:8000
                                               one OpenAI endpoint over vLLM servers: routing, migration, failover

exit status:
  0    success (validate: the file is valid, as load reads it; fsck: every chunk was read and is good,
       verifiable here and, with --key-file, signed with one of the keys)
  1    the data or the operation failed: an invalid file (the line says which field), a damaged chunk,
       a demo check FAILED, a server that could not be reached or answered wrongly, a permission (a chunk
       fsck could not read (listed as unreadable), a path prune could not read, delete or follow (listed as
       skipped)); what fsck skips (a symbolic link, a name that is not a chunk's) does not fail it
  2    a bad call: an option refused, a path that is missing, a directory, pipe or device given for a
       file (or a file for a directory), a symbolic link loop, '-' for a path, an optional package missing,
       a directory given to fsck or prune that holds no chunk store namespaces (a namespace directory)
  3    an internal error: a bug (HURRAY_VLLM_DEBUG=1 shows the traceback; please report it)
  130  interrupted (Ctrl-C); receive and router exit 0 on Ctrl-C or SIGTERM: that is how they stop
  141  standard output closed early (e.g. piped into head): the rest is not printed
"""


def _layout_name(tag: int) -> str:
    return {0x01: "row_major", 0x0A: "block_paged", 0x0B: "composite"}.get(tag, f"0x{tag:02X}")


def _type_name(tag: int) -> str:
    try:
        return dtypes.from_tag(tag).name
    except HurrayFormatError:
        return f"0x{tag:02X}"


#: The keys of every ``inspect --json`` row, whatever the format and layout: ``null`` where unknown or not applicable.
_ROW_KEYS = (
    "name", "depth", "layout", "dtype", "shape", "bytes", "layer", "role", "page_size", "num_pages", "num_seqs",
    "index_type", "seq_lens", "referenced_pages", "shared_pages", "quantization", "rule", "members",
)  # fmt: skip


def _describe(rec: Record, seq_lens: list[int] | None, depth: int) -> dict[str, Any]:
    d: TensorDescriptor = rec.descriptor
    row: dict[str, Any] = dict.fromkeys(_ROW_KEYS)
    row.update(
        name=rec.name or None,
        depth=depth,
        layout=_layout_name(d.layout_tag),
        dtype=_type_name(d.type_tag),
        shape=list(d.shape),
        bytes=d.data_bytes,
    )
    bp = d.block_paged
    if bp is not None:
        row.update(
            layer=bp.layer_index,
            role=bp.kv_role,
            page_size=bp.page_size,
            num_pages=bp.num_pages,
            num_seqs=bp.num_seqs,
            index_type=bp.index_type,
            seq_lens=seq_lens,
        )
        tables = index_tables(rec)
        if tables is not None:
            table = tables[0]
            if table.numel():
                _, counts = torch.unique(table, return_counts=True)
                row.update(referenced_pages=int(counts.numel()), shared_pages=int((counts > 1).sum()))
            else:
                row.update(referenced_pages=0, shared_pages=0)
        if d.quantization is not None:
            row["quantization"] = type(d.quantization).__name__
    comp = d.composite
    if comp is not None:
        row.update(rule=comp.rule, members=comp.member_count)
    return row


def _wire_records(records: Iterator[Record]) -> Iterator[Record]:
    """``records`` with their buffers as the bytes a file holds.

    A safetensors snapshot's records hold typed tensors, where the index and length readers take bytes: its
    rows then say what a ``.hrry`` file's say.
    """
    for rec in records:
        yield Record(rec.name, rec.descriptor, [b.contiguous().reshape(-1).view(torch.uint8) for b in rec.buffers])


def _rows(nodes: Iterator[Node]) -> Iterator[dict[str, Any]]:
    def walk(node: Node, depth: int, seq_lens: list[int] | None) -> Iterator[dict[str, Any]]:
        yield _describe(node.record, seq_lens, depth)
        pair_lens = node.pair_seq_lens()
        lens = pair_lens.tolist() if pair_lens is not None else None
        for m in node.members:
            yield from walk(m, depth + 1, lens if m.record.descriptor.layout_tag == LAYOUT_BLOCK_PAGED else None)

    for n in nodes:
        yield from walk(n, 0, None)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


_COLUMNS = [
    ("name", "<22"),
    ("layout", "<11"),
    ("dtype", "<11"),
    ("shape", "<18"),
    ("layer", ">5"),
    ("role", "<5"),
    ("page", ">5"),
    ("pages", ">6"),
    ("seqs", ">5"),
    ("ref", ">6"),
    ("shared", ">6"),
    ("bytes", ">10"),
]


def _line(columns: list[tuple[str, str]], cells: dict[str, Any]) -> str:
    def cell(v: Any) -> str:
        return "" if v is None else str(v)

    return " ".join(f"{cell(cells.get(name)):{spec}}" for name, spec in columns)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Run ``hurray-vllm inspect``: print the file's descriptors as a table or JSON; returns 0."""
    _file_arg(args.path)
    fmt = detect_format(args.path)
    try:
        if fmt == "safetensors":
            nodes = group_records(_wire_records(open_records(args.path, permissive=True)), permissive=True)
        else:
            nodes = iter_nodes(args.path, permissive=True)
        rows = list(_rows(nodes))
    except HurrayArgumentError:  # the safetensors package missing: the install's error, not the file's
        raise
    except (*PARSE_ERRORS, MemoryError) as exc:  # load's contract: one error type, and memory is not the data's
        raise read_error(exc, str(args.path)) from exc
    if args.json:
        print(
            json.dumps(
                {"path": str(args.path), "format": fmt, "kv": _jsonable(file_kv(args.path)), "tensors": rows},
                indent=2,
                allow_nan=False,  # strict JSON: _jsonable spelled out what JSON has no value for
            )
        )
        return 0
    kind = {"hrry": "Hurray file", "stream": "Hurray stream", "safetensors": "safetensors file"}[fmt]
    print(f"{args.path}: {kind}, {len(rows)} descriptors")
    print(_line(_COLUMNS, {c: c for c, _ in _COLUMNS}))
    for r in rows:
        cells = dict(r, name=("  " * r["depth"] + (r["name"] or "-"))[:22], bytes=_fmt_bytes(r["bytes"]))
        if r["layout"] == "block_paged":
            unknown = {k: "?" for k in ("referenced_pages", "shared_pages") if r[k] is None}
            cells.update(ref=unknown.get("referenced_pages", r["referenced_pages"]), page=r["page_size"])
            cells.update(shared=unknown.get("shared_pages", r["shared_pages"]))
            cells.update(pages=r["num_pages"], seqs=r["num_seqs"])
            print(_line(_COLUMNS, cells))
            if r["seq_lens"] is not None and not args.quiet:
                lens = r["seq_lens"]
                shown = ", ".join(map(str, lens[:8])) + (", ..." if len(lens) > 8 else "")
                print(f"{'':<24}seq_lens [{shown}]")
        elif r["layout"] == "composite":
            print(f"{cells['name']:<22} {r['layout']:<11} {r['rule']} of {r['members']}")
        else:
            print(_line(_COLUMNS, cells))
    return 0


def _jsonable(value: Any) -> Any:
    """``value`` (a ``.hrry`` file's KV metadata, or one of its values) as strict JSON values.

    Bytes become hex strings, at any depth (a KV array of bytes), and a NaN or
    infinity its string (``"nan"``, ``"inf"``): ``json.dumps`` would write bare
    ``NaN``, which is not JSON, and strict readers (``jq``) refuse the output.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _keys(args: argparse.Namespace) -> Any:
    """The fleet keys of ``--key-file`` (repeatable), else of ``$HURRAY_VLLM_KEY_FILE``; ``None`` without either."""
    from ..chunks.signing import KEY_FILE_ENV, load_keys

    # The library names the connector's option (hurray_key_file): say which of the command's settings it was.
    given = args.key_file is not None
    if given and not any(args.key_file):  # the library's "hurray_key_file is set to ['']" names neither
        raise HurrayArgumentError(
            "--key-file", f"{' '.join(map(repr, args.key_file))} names no key file: name one, or leave --key-file out"
        )
    try:
        return load_keys(args.key_file)  # None when neither is given
    except HurrayArgumentError as exc:
        if exc.field != "hurray_key_file":
            raise
        why = str(exc).removeprefix(f"{exc.field}: ")
        if given:
            raise HurrayArgumentError("--key-file", why) from None
        env = f"${KEY_FILE_ENV}"
        if why.startswith(f"{env} is "):  # "$HURRAY_VLLM_KEY_FILE is set to ''": said once, as the field
            why = why.removeprefix(f"{env} is ")
        else:
            why = f"{why} (fix or unset {env}, or give --key-file)"
        raise HurrayArgumentError(env, why) from None


def _add_key_file(s: argparse.ArgumentParser, what: str) -> None:
    s.add_argument(
        "--key-file",
        action="append",
        help=f"fleet key file (repeat for key rotation: the first signs, all are accepted); {what}. "
        "Default: $HURRAY_VLLM_KEY_FILE",
    )


def _chunk_name(path: Path) -> tuple[str, str] | None:
    """``(namespace, name)`` of a chunk file of a store (``DIR/<namespace>/<name>.hrry``), else ``None``."""
    from ..chunks.keys import is_chunk_name, is_namespace_name

    ns = path.resolve().parent.name
    if path.suffix != ".hrry" or not is_chunk_name(path.name.removesuffix(".hrry")) or not is_namespace_name(ns):
        return None
    return ns, path.name.removesuffix(".hrry")


def _safetensors_file(path: str) -> bool:
    """Whether ``path`` is a safetensors file by its magic (what is neither, or unreadable, is validate's finding)."""
    try:
        return detect_format(path) == "safetensors"
    except (HurrayFormatError, OSError):
        return False


def cmd_validate(args: argparse.Namespace) -> int:
    """Run ``hurray-vllm validate``: print each violation; returns 0 if the file is valid, else 1."""
    keys = _keys(args)
    _file_arg(args.path)  # a path that names no file is the call's error (stderr, exit 2), not a verdict
    where = _chunk_name(Path(args.path)) if keys is not None else None
    if args.key_file and where is None:
        raise HurrayArgumentError(
            "--key-file", f"{args.path} is not a chunk file of a store (DIR/<namespace>/<key>.hrry): no MAC to check"
        )
    if _safetensors_file(args.path):
        from ..containers.safetensors import _safetensors

        _safetensors()  # without the package: the install's error (exit 2), not a verdict on the file
    # validate == load: KV that load refuses (a lone key record, a layer missing) is not valid (hv.validate).
    checked = validate(args.path, permissive=args.permissive)
    blocking = set(id(v) for v in checked.errors)
    # What stopped parsing (a truncated file, a bad magic) is always an error; print it too.
    for v in (*checked.violations, *checked.unreadable):
        tag = "error" if id(v) in blocking else "waived"
        print(f"{tag}: {v.invariant}: {v.message}")
    if checked.ok and where is not None:
        # A chunk's MAC is checked on what load reads.
        from ..chunks.store import check_data
        from ..containers.io import load

        try:
            check_data(load(args.path, permissive=args.permissive), keys, *where)
        except HurrayFormatError as exc:
            for v in exc.violations:
                print(f"error: {v.invariant}: {v.message}")
            return 1
    if checked.ok:
        if not args.quiet:
            print(f"{args.path}: valid" + (" (permissive)" if args.permissive else ""))
        return 0
    return 1


def _file_arg(path: str, *, output: bool = False) -> None:
    """Refuse, as the call's error (exit 2), a path that names no file to read (``output``: to write).

    Checked before the library opens it: the library calls a pipe or device where a file
    should be malformed input (a chunk store's consumers must refuse one at a chunk's name), but on
    the command line it is a wrong argument, as a missing path or a directory is.

    Raises:
        FileNotFoundError: nothing at ``path`` (a file to read only).
        IsADirectoryError: a directory.
        OSError: ``path`` cannot be looked at (``ELOOP``: a symbolic link loop; ``EACCES``).
        HurrayArgumentError: a pipe, socket or device.
    """
    try:
        mode = os.stat(path).st_mode  # through links: what an open() would open
    except FileNotFoundError:
        if output:
            return  # a new file (or a dangling link, which the write creates the target of)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path) from None
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(
            errno.EISDIR, "Is a directory (give a file path to write)" if output else "Is a directory", path
        )
    if not stat.S_ISREG(mode):
        what = "write to a file" if output else "save it to a file first"
        raise HurrayArgumentError("path", f"{path} is not a regular file (a pipe, socket or device): {what}")


def cmd_convert(args: argparse.Namespace) -> int:
    """Run ``hurray-vllm convert``: write the input in the output's format; returns 0."""
    _file_arg(args.input)
    _file_arg(args.output, output=True)
    src_fmt = detect_format(args.input)
    out = Path(args.output)
    if out.exists() and os.path.samefile(args.input, out):
        raise HurrayArgumentError("output", f"{out} is the input file: write the conversion to another path")
    out_fmt = args.to or SUFFIX_FORMATS.get(out.suffix.lower())
    if out_fmt is None:
        raise HurrayArgumentError(
            "to",
            f"cannot tell the format to write from the name {out.name!r}: end it in "
            f"{', '.join(SUFFIX_FORMATS)} or give --to {{{','.join(dict.fromkeys(SUFFIX_FORMATS.values()))}}}",
        )
    if args.page_size or "safetensors" in (src_fmt, out_fmt):
        # Snapshot-level: repaging and safetensors need whole snapshots.
        from ..containers.io import load, save
        from ..kv.repage import repage_snapshot

        snap = load(args.input, permissive=args.permissive)
        if args.page_size:
            snap = repage_snapshot(snap, args.page_size)
        size = save(snap, out, format=out_fmt, permissive=args.permissive)
    else:
        # Record-level: any Hurray descriptors, carried over unchanged. What validate refuses is refused first,
        # with its message, before anything is written (--permissive: carried over as it is).
        if not args.permissive:
            raise_if(validate(args.input), str(args.input))
        records = progress(
            _named(open_records(args.input, permissive=args.permissive)), desc="convert", quiet=args.quiet
        )
        size = save_records(records, out, format=out_fmt, kv=file_kv(args.input) or None)
    if not args.quiet:
        print(f"{args.input} ({src_fmt}) -> {out} ({out_fmt}), {_fmt_bytes(size)}")
    return 0


def _named(records: Iterator[Record]) -> Iterator[Record]:
    """Give stream records file names: the layout's own where it is known, else tensor.N."""
    used: set[str] = set()
    for i, rec in enumerate(records):
        name = rec.name or _default_name(rec.descriptor, i)
        while name in used:
            name = f"{name}.{i}"
        used.add(name)
        yield Record(name, rec.descriptor, rec.buffers)


def _default_name(d: TensorDescriptor, i: int) -> str:
    bp = d.block_paged
    if bp is not None and bp.layer_index is not None:
        return f"layers.{bp.layer_index}.{bp.kv_role}"
    return f"tensor.{i}"


def cmd_demo(args: argparse.Namespace) -> int:
    """Run ``hurray-vllm demo`` (``--format-only``: the format round trip); returns the demo's exit code."""
    from .demo import run_format_demo, run_vllm_demo

    workdir = Path(args.workdir) if args.workdir else None
    if workdir is not None:  # before vLLM's import (seconds), as the call's error: a file there exited 1
        _dir_arg(args.workdir, "--workdir is where the demo writes its files")
    if args.format_only:
        return run_format_demo(workdir, quiet=args.quiet, keep=args.keep)
    try:
        return run_vllm_demo(workdir, quiet=args.quiet, verbose=args.verbose, keep=args.keep)
    except ImportError as exc:  # vLLM or transformers missing (or broken): what to install, not a bug report
        raise HurrayArgumentError(
            "demo",
            f"{exc}; the full demo runs vLLM and transformers: pip install 'hurray-vllm[vllm]' "
            "(see docs/quickstart.md), or run 'hurray-vllm demo --format-only', which needs neither",
        ) from None


def cmd_migrate(args: argparse.Namespace) -> int:
    """Run ``hurray-vllm migrate``: decode on the source, finish on the destination, print the tokens; returns 0."""
    from ..adapters.vllm.migrate import migrate

    if _same_server(args.source, args.destination):
        raise HurrayArgumentError(
            "--to", f"{args.destination} is the same server as --from {args.source}: migrate moves to another one"
        )
    if args.prompt_file:
        prompt = _token_ids(_read_prompt_file(args.prompt_file), "prompt_file")
    else:
        prompt = _token_ids(args.prompt_ids, "prompt_ids")
    result = migrate(args.source, args.destination, prompt, after=args.after, max_tokens=args.max_tokens,
                     model=args.model, timeout=args.timeout, api_key=args.backend_api_key)  # fmt: skip
    if args.json:
        print(
            json.dumps(
                {
                    "tokens": result.tokens,
                    "source_tokens": result.source_tokens,
                    "destination_tokens": result.destination_tokens,
                    "destination_cached_tokens": result.destination_cached_tokens,
                }
            )
        )
    else:
        moved = f"{len(result.source_tokens)} tokens on {args.source}, {len(result.destination_tokens)} on "
        cached = result.destination_cached_tokens
        loaded = (
            f"{cached} prompt tokens loaded, not recomputed"
            if cached is not None  # vLLM reports it only when started with --enable-prompt-tokens-details
            else "prompt tokens loaded: not reported; start the destination with --enable-prompt-tokens-details"
        )
        print(f"{moved}{args.destination} ({loaded})")
        print(" ".join(map(str, result.tokens)))
    return 0


def _same_server(a: str, b: str) -> bool:
    """Whether two base URLs name one server.

    Scheme and host in any case, the default port spelt out or not, a trailing slash or not.
    """
    from urllib.parse import urlsplit

    def norm(url: str) -> tuple[str, str, int | None, str]:
        u = urlsplit(url)
        scheme = u.scheme.lower()
        return scheme, (u.hostname or "").lower(), u.port or {"http": 80, "https": 443}.get(scheme), u.path.rstrip("/")

    return norm(a) == norm(b)


def cmd_receive(args: argparse.Namespace) -> int:
    """Run ``hurray-vllm receive``: store the KV chunks received until SIGINT/SIGTERM; returns 0."""
    import faulthandler
    import signal
    import time

    from ..transport import receiver_for

    host, port = args.listen
    limits = {
        "timeout": args.timeout,
        "idle_timeout": args.idle_timeout,
        "max_chunk_bytes": args.max_chunk,
        "max_connections": args.max_connections,
        "quota_bytes": args.quota,
        "min_free_bytes": args.min_free,
        "keys": _keys(args),
    }
    if args.max_memory is not None:
        limits["max_arena_bytes" if args.transport == "nixl" else "max_inflight_bytes"] = args.max_memory
    if args.tls_cert or args.tls_key or args.tls_client_ca:
        from ..transport.security import TlsOptions, server_context

        if args.transport != "tcp":
            raise HurrayArgumentError("tls", "--tls-* options are for the tcp transport (senders use tls://HOST:PORT)")
        limits["tls"] = server_context(TlsOptions(args.tls_cert, args.tls_key, client_ca_file=args.tls_client_ca))
    store = _store_dir(args.dir, must_exist=False, writable=True)
    try:
        # kill -USR1: every thread's stack, on stderr. Not without a stderr to write to (`2>&-`, a capture
        # without a descriptor): the receiver serves as well without it.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (RuntimeError, ValueError, io.UnsupportedOperation):
        pass
    try:
        receiver = receiver_for(args.transport, host, port, store, **limits).start()
    except ValueError as exc:  # a limit out of range
        raise HurrayArgumentError("receive", str(exc)) from None
    except ImportError as exc:  # NixlUnavailableError (--transport nixl without NIXL): the call's, not a bug
        from ..transport.nixl.agent import INSTALL_HINT

        hint = "" if args.transport != "nixl" or INSTALL_HINT in str(exc) else f" (install it with: {INSTALL_HINT})"
        raise HurrayArgumentError("transport", f"{exc}{hint}") from None

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.getsignal(signal.SIGTERM)
    try:  # whatever ends it (a signal, a closed stdout), the receiver stops: its threads would keep the process
        # kill stops it as cleanly as Ctrl-C, from the start-up line on (a script waits for it, then may kill).
        # (SIGINT keeps the disposition it was started with: a job a shell started in the background ignores it,
        # and Python then leaves it ignored.)
        signal.signal(signal.SIGTERM, _terminate)
        if not args.quiet:
            where = host_port(receiver.address[0], receiver.address[1])
            channel = "tls" if "tls" in limits else args.transport
            print(f"receiving KV chunks ({channel}) on {where} into {args.dir}", flush=True)
        while True:
            # Short sleeps: a signal the kernel hands to one of NIXL's or UCX's threads
            # does not interrupt this one, which would then only notice it on waking.
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        receiver.stop()
        if previous is not None:  # main() called in-process (tests) leaves the caller's SIGTERM as it was
            signal.signal(signal.SIGTERM, previous)
    return 0


def _store_dir(path: str, *, must_exist: bool = True, writable: bool = False) -> DirectoryStore:
    """The chunk store at ``path``: refused up front when it is a file (or, ``must_exist``, missing).

    ``writable``: made if missing, and refused unless a file can be created in it.
    """
    from ..chunks.store import DirectoryStore

    p = Path(path)
    _dir_arg(path, "a chunk store is a directory")
    if must_exist and not p.exists():
        raise FileNotFoundError(errno.ENOENT, "No such directory", path)
    if writable:  # a receiver that cannot store would refuse every chunk it is sent, and look fine
        import tempfile

        p.mkdir(parents=True, exist_ok=True)
        try:
            with tempfile.TemporaryFile(dir=p):
                pass
        except OSError as exc:  # its message named the probe's random name, not the directory given
            raise OSError(exc.errno, f"{exc.strerror or exc} (cannot create a file in this directory)", path) from None
    return DirectoryStore(path)


def _dir_arg(path: str, why: str) -> None:
    """Refuse, as the call's error (exit 2), a ``path`` given for a directory that cannot be one.

    A file, or a symbolic link to nothing: ``mkdir(exist_ok=True)`` raises ``FileExistsError`` for both, which
    reads as a failed operation (exit 1) where the path given is wrong. ``why`` (the option, what it is for)
    is said in brackets.

    Raises:
        NotADirectoryError: something not a directory at ``path``.
        FileNotFoundError: a symbolic link whose target is missing (mkdir does not make it through the link).
        OSError: a symbolic link loop (``ELOOP``).
    """
    p = Path(path)
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # Path.exists() says False for a loop: it is no missing target
            raise OSError(errno.ELOOP, f"A symbolic link loop (ELOOP) ({why})", path) from None
    if p.exists() and not p.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"Not a directory ({why})", path)
    if not p.exists() and p.is_symlink():
        raise FileNotFoundError(errno.ENOENT, f"A symbolic link to a missing target ({why})", path)


def _size(text: str) -> int:
    """``"500M"``, ``"20G"``, ``"1.5T"`` or plain bytes (binary units: M = MiB)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        # Plain bytes must be whole: "0.5" is far more likely a forgotten unit than half a byte, and read as 0
        # it would have prune delete the whole store.
        n = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(int(t))
    except ValueError:
        n = math.nan
    if not (math.isfinite(n) and 0 <= n < 1 << 63):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 500M, 20G, 1.5T)")
    return int(n)


#: The largest page a conversion repages to: far above any engine's (vLLM's largest block is 256 tokens), and
#: small enough that repaging a short sequence into one such page stays a modest allocation.
_MAX_PAGE_SIZE = 1 << 16


def _page_size(text: str) -> int:
    """A page size in tokens, ``1 .. 2^16``."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= _MAX_PAGE_SIZE:
        raise argparse.ArgumentTypeError(f"not a page size: {text!r} (a number of tokens, 1 to {_MAX_PAGE_SIZE})")
    return n


def _input_path(text: str) -> str:
    """A file to read: ``-`` would be a file named ``-``, where a user means standard input (not offered)."""
    if text == "-":
        raise argparse.ArgumentTypeError(
            "'-' (standard input) is not supported: name the file to read (save a piped stream to a file first)"
        )
    return text


def _output_path(text: str) -> str:
    """A file to write: ``-`` would be a file named ``-``, where a user means standard output (not offered)."""
    if text == "-":
        raise argparse.ArgumentTypeError("'-' (standard output) is not supported: name the file to write")
    return text


def _seconds(text: str) -> float:
    """A duration in seconds: finite and > 0 (``nan``/``inf`` would break every socket or sleep later)."""
    try:
        n = float(text)
    except ValueError:
        n = math.nan
    if not (math.isfinite(n) and 0 < n <= 365 * 86400):
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (seconds, e.g. 60 or 0.5)")
    return n


def _api_key_option(text: str) -> str:
    """``--api-key``, ``--backend-api-key``: not empty (the option left out reads the variable, or means none).

    ``--api-key "$KEY"`` with ``KEY`` not set is a key lost on the way, not a request for none: an empty router
    key would let in whoever sends an empty bearer token. Nor with whitespace at its start or end: an HTTP
    header's value is read without it, so no request would ever carry the key (every one answered 401).
    """
    if not text:
        raise argparse.ArgumentTypeError("an empty key: give the key, or leave the option out")
    if text != text.strip():
        raise argparse.ArgumentTypeError(
            "a key with whitespace at its start or end, which no request can carry (a bearer token is read without "
            "it): remove the whitespace"
        )
    return text


def _positive_size(text: str) -> int:
    """A size (:func:`_size`) of at least one byte."""
    n = _size(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r} (use e.g. 500M, 20G, 1.5T)")
    return n


def _whole(text: str, least: int, example: str) -> int:
    """A whole number >= ``least``; the argparse error names the text and the rule."""
    try:
        n = int(text)
    except ValueError:
        n = least - 1
    if n < least:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (a whole number >= {least}{example})")
    return n


def _positive_count(text: str) -> int:
    """A whole number >= 1."""
    return _whole(text, 1, "")


def _count(text: str) -> int:
    """A whole number >= 0 (a count of requests)."""
    return _whole(text, 0, ", e.g. 8")


def _host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``:PORT`` listens on 127.0.0.1)."""
    try:
        return parse_listen(text)
    except HurrayFormatError as exc:
        raise argparse.ArgumentTypeError(str(exc).partition(": ")[2]) from None


#: The largest --prompt-file read: far above any context length written as decimal ids.
_MAX_PROMPT_FILE = 64 << 20


def _read_prompt_file(path: str) -> str:
    """The text of ``--prompt-file``, at most :data:`_MAX_PROMPT_FILE` bytes (``/dev/zero`` must not fill memory)."""
    with open(path, "rb") as f:
        data = f.read(_MAX_PROMPT_FILE + 1)
    if len(data) > _MAX_PROMPT_FILE:
        raise HurrayArgumentError(
            "prompt_file", f"{path} is larger than {_MAX_PROMPT_FILE >> 20} MiB: not a list of token ids"
        )
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise HurrayArgumentError(
            "prompt_file", f"{path} is not text: give token ids separated by commas or spaces"
        ) from None


def _token_ids(text: str, what: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise HurrayArgumentError(what, "token ids must be integers separated by commas or spaces") from None
    if not ids or min(ids) < 0:
        raise HurrayArgumentError(what, "give at least one token id, each >= 0")
    return ids


def _backend_url(text: str) -> str:
    """A router backend's base URL, ``http(s)://HOST[:PORT]`` (kept as given: ``/hurray/*`` names backends by it)."""
    return _base_url(text, path_ok=False)


def _server_url(text: str) -> str:
    """A server's base URL for ``migrate``, ``http(s)://HOST[:PORT][/PREFIX]``: what :func:`migrate` itself takes."""
    return _base_url(text, path_ok=True)


def _base_url(text: str, *, path_ok: bool) -> str:
    from ..adapters.vllm.migrate import check_server_url

    try:
        check_server_url(text, "url", path_ok=path_ok)
    except HurrayArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc).partition(": ")[2]) from None  # argparse names the option
    return text


def cmd_router(args: argparse.Namespace) -> int:
    """Run ``hurray-vllm router`` until SIGINT/SIGTERM; returns 0."""
    try:
        from .router import CONTROL_PURPOSE, RouterConfig, serve
        from .router.backends import backend_key
    except ImportError as exc:  # FastAPI, uvicorn or aiohttp missing (all come with vLLM)
        raise HurrayArgumentError("router", f"{exc}; install them with: pip install 'hurray-vllm[router]'") from None

    keys = _keys(args)
    if args.print_token:
        if keys is None:
            raise HurrayArgumentError("--key-file", "--print-token needs --key-file or $HURRAY_VLLM_KEY_FILE")
        print(keys.tokens(CONTROL_PURPOSE)[0])
        return 0
    if args.listen is None or not args.backend:
        raise HurrayArgumentError("router", "give --listen HOST:PORT and at least one --backend URL")
    # One backend however often given, with or without a trailing slash (the router's own rule): its first spelling.
    decode: dict[str, str] = {}
    prefill: dict[str, str] = {}
    for given, urls in ((decode, args.backend), (prefill, args.prefill or [])):
        for url in urls:
            given.setdefault(backend_key(url), url)
    overlap = decode.keys() & prefill.keys()
    if overlap:
        raise HurrayArgumentError("prefill", f"{sorted(overlap)} given both as --backend and --prefill")
    host, port = args.listen
    config = RouterConfig(
        backends=tuple(decode.values()),
        prefill=tuple(prefill.values()),
        chunk_tokens=args.chunk_tokens,
        health_interval=args.health_interval,
        stream_timeout=args.stream_timeout,
        policy=args.policy,
        backend_api_key=args.backend_api_key,
        api_keys=tuple(args.api_key or ()),
        control_tokens=keys.tokens(CONTROL_PURPOSE) if keys is not None else (),
        # The router's own default when not given: the parser does not import the router (aiohttp).
        **({} if args.kv_load_slack is None else {"kv_load_slack": args.kv_load_slack}),
    )
    serve(config, host, port, log_level=args.log_level)
    return 0


def _chunk_store_arg(path: str) -> DirectoryStore:
    """The chunk store at ``path`` for fsck and prune: refused (exit 2) when it holds no namespace directories.

    A namespace directory given for its store (one level too deep), or a directory above it, would otherwise be
    "0 chunk files checked", exit 0. An empty directory (a file system's ``lost+found`` aside) is an empty store:
    one no engine has written to yet, fine. One that cannot be listed is left to fsck and prune to report.

    Raises:
        HurrayArgumentError: field ``dir``, what to give instead.
    """
    from ..chunks.keys import is_chunk_name, is_namespace_name

    store = _store_dir(path)
    try:
        names = os.listdir(path)
    except OSError:
        return store
    if any(is_namespace_name(n) for n in names) or all(n == "lost+found" for n in names):
        return store
    p = Path(path).resolve()
    if is_namespace_name(p.name) or any(n.endswith(".hrry") and is_chunk_name(n.removesuffix(".hrry")) for n in names):
        hint = f"it looks like one namespace directory of a store: give the store, its parent {p.parent}"
    else:
        hint = "give the store's directory (a HurrayConnector's hurray_path, the receiver's --dir)"
    raise HurrayArgumentError(
        "dir", f"{path} holds no chunk store namespaces (directories named by hex digits, one per model): {hint}"
    )


def cmd_prune(args: argparse.Namespace) -> int:
    """Run ``hurray-vllm prune``: delete least recently used chunks beyond ``--max-size``; 0, or 1 if it skipped any."""
    keys = _keys(args)
    report = _chunk_store_arg(args.dir).prune(args.max_size, dry_run=args.dry_run, keys=keys)
    if args.json:
        print(json.dumps(vars(report)))
    elif not args.quiet:
        verb = "would delete" if report.dry_run else "deleted"
        foreign = f" ({report.foreign_removed} not signed with the key)" if keys is not None else ""  # keys only
        print(
            f"{verb} {report.chunks_removed} chunk files{foreign}, {report.bad_removed} damaged and "
            f"{report.temp_removed} stale temporary files ({report.bytes_removed / 2**20:.1f} MiB); "
            f"{report.chunks_kept} chunk files ({report.bytes_kept / 2**20:.1f} MiB) remain"
        )
    for skipped in report.skipped:
        _warn(f"hurray-vllm: skipped: {skipped}")
    if report.skipped:
        n = len(report.skipped)
        above = ""
        if report.bytes_kept > args.max_size:
            above = f"; {report.bytes_kept / 2**20:.1f} MiB remain, above --max-size ({args.max_size / 2**20:.1f} MiB)"
        _warn(
            f"hurray-vllm: prune skipped {n} path{'s' * (n != 1)} it could not read, delete or follow (listed above)"
            f"{above}: fix them (permissions, symbolic links) and run prune again"
        )
        return 1
    return 0


def cmd_fsck(args: argparse.Namespace) -> int:
    """Run ``hurray-vllm fsck``: verify every chunk file of a store; 0 if it is clean (``FsckReport.clean``), else 1."""
    from ..chunks.fsck import fsck

    report = fsck(_chunk_store_arg(args.dir), quarantine=args.quarantine, keys=_keys(args))
    if args.json:
        print(json.dumps({**vars(report), "clean": report.clean}))
    elif not args.quiet:
        for path, why in report.damaged:
            print(f"damaged: {path}: {why}")
        for path, why in report.foreign:
            print(f"not ours: {path}: {why}")
        for path, why in report.unverified:
            print(f"not verified: {path}: {why}")
        for path, why in report.unreadable:
            print(f"unreadable: {path}: {why}")
        moved = f", {len(report.moved)} moved aside (*.hrry.bad)" if args.quarantine else ""
        print(
            f"{report.checked} chunk files checked: {report.good} good, {len(report.damaged)} damaged{moved}, "
            f"{len(report.foreign)} unsigned or of another key, {len(report.unverified)} not verifiable here, "
            f"{len(report.unreadable)} unreadable; {report.temporary} temporary files"
        )
    for skipped in report.skipped:
        _warn(f"hurray-vllm: skipped: {skipped}")
    return 0 if report.clean else 1


def build_parser() -> argparse.ArgumentParser:
    """The ``hurray-vllm`` argument parser, one subcommand per ``cmd_*`` function."""
    p = argparse.ArgumentParser(
        prog="hurray-vllm",
        description="Move LLM KV caches between inference engines as Hurray block-paged tensors.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"hurray-vllm {__import__('hurray_vllm').__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "inspect",
        help="list the descriptors of a Hurray file or stream",
        description="One line per descriptor: layer, role, dtype, shape, page_size, num_pages, "
        "num_seqs, seq_lens when known, referenced and shared pages, bytes. "
        "Example: hurray-vllm inspect snapshot.hrry --json",
    )
    s.add_argument("path", type=_input_path, help="a .hrry file, .hrrs stream or .safetensors file")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("-q", "--quiet", action="store_true", help="omit per-sequence details")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser(
        "validate",
        help="check a Hurray file or stream against the spec (exit 0 valid, 1 invalid)",
        description="Prints one line per violation, naming the invariant. "
        "Example: hurray-vllm validate snapshot.hrry --permissive",
    )
    s.add_argument("path", type=_input_path, help="a .hrry file, .hrrs stream or .safetensors file")
    s.add_argument("--permissive", action="store_true", help="waive what the spec lets permissive readers waive")
    _add_key_file(s, "a chunk file of a store must then carry a valid MAC")
    s.add_argument("-q", "--quiet", action="store_true", help='print no "valid" line (violations are still printed)')
    s.set_defaults(func=cmd_validate)

    s = sub.add_parser(
        "convert",
        help="convert between .hrry files, .hrrs streams and .safetensors (optionally repaging)",
        description="Between .hrry and .hrrs, descriptors are carried over unchanged, including ones that "
        "are not part of a hurray-vllm snapshot; input validate refuses is refused (exit 1, nothing written) unless "
        "--permissive. .safetensors and --page-size work on whole snapshots. "
        "Example: hurray-vllm convert snapshot.hrrs snapshot.safetensors --page-size 256",
    )
    s.add_argument("input", type=_input_path, help="the file to read: .hrry, .hrrs or .safetensors")
    s.add_argument("output", type=_output_path, help="the file to write (a path: not '-', standard output)")
    s.add_argument(
        "--to",
        choices=["hrry", "stream", "safetensors"],
        help="output format (default: from the output's suffix: "
        f"{', '.join(f'{k} {v}' for k, v in SUFFIX_FORMATS.items())}; another suffix needs --to)",
    )
    s.add_argument("--page-size", type=_page_size, help="repage to pages of this many tokens on the way")
    s.add_argument("--permissive", action="store_true", help="carry over descriptors with waivable violations")
    s.add_argument("-q", "--quiet", action="store_true", help="print no progress bar and no summary line")
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser(
        "migrate",
        help="move a decoding request from one vLLM server to another",
        description="Both servers run HurrayConnector; the source pushes KV chunks to the destination's "
        "receiver (hurray_url / hurray_listen). Example: hurray-vllm migrate --from http://a:8000 "
        "--to http://b:8000 --prompt-ids 1,2,3 --after 16 --max-tokens 64",
    )
    s.add_argument("--from", dest="source", required=True, type=_server_url, help="source server base URL")
    s.add_argument("--to", dest="destination", required=True, type=_server_url, help="destination server base URL")
    group = s.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--prompt-ids", help="prompt token ids, comma- or space-separated (quote them when separated by spaces)"
    )
    group.add_argument(
        "--prompt-file", type=_input_path, help="file of whitespace- or comma-separated token ids (not '-')"
    )
    s.add_argument(
        "--after",
        type=int,
        required=True,
        help="tokens to generate on the source before moving (1 <= AFTER < --max-tokens)",
    )
    s.add_argument("--max-tokens", type=int, required=True, help="tokens to generate in total")
    s.add_argument("--model", help="served model name (default: the source's first, which the destination must serve)")
    s.add_argument(
        "--timeout", type=_seconds, default=600.0, help="seconds each call to a server may take (default 600)"
    )
    s.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: the token lists (tokens, source_tokens, destination_tokens) and "
        "destination_cached_tokens, the prompt tokens the destination loaded",
    )
    # The router's --backend-api-key, for the same servers: one key for both, and the same variable.
    s.add_argument(
        "--backend-api-key",
        default=None,
        type=_api_key_option,
        help="sent as 'Authorization: Bearer KEY' to both servers (vLLM's --api-key); default: "
        "$HURRAY_BACKEND_API_KEY, which keeps the key off the command line",
    )
    s.set_defaults(func=cmd_migrate)

    s = sub.add_parser(
        "receive",
        help="accept KV chunks sent over TCP or NIXL into a chunk store",
        description="Example: hurray-vllm receive --listen 0.0.0.0:9000 --dir /var/cache/hurray [--transport nixl]",
    )
    s.add_argument("--listen", required=True, type=_host_port, help="HOST:PORT")
    s.add_argument(
        "--transport",
        choices=CHANNELS,
        default="tcp",
        help="tcp (senders use tcp://HOST:PORT) or nixl (nixl://HOST:PORT; needs hurray-vllm[nixl])",
    )
    s.add_argument("--dir", required=True, help="chunk store directory (a HurrayConnector's hurray_path)")
    s.add_argument(
        "--quota",
        type=_positive_size,
        default=None,
        help="most bytes the store may hold (500M, 20G, ...): a chunk beyond it is refused before it is read",
    )
    s.add_argument(
        "--min-free", type=_size, default=0, help="free disk space every chunk must leave (e.g. 10G; default 0)"
    )
    s.add_argument(
        "--max-connections", type=_positive_count, default=64, help="connections served at once (>= 1; default 64)"
    )
    s.add_argument(
        "--max-chunk", type=_positive_size, default=4 << 30, help="largest chunk accepted (default 4G: a frame "
        "announcing more is refused unread)"
    )  # fmt: skip
    s.add_argument(
        "--max-memory",
        type=_positive_size,
        default=None,
        help="memory for the chunks being received, all connections together (default 8G; over nixl, its "
        "registered buffers): a chunk beyond it is refused unread, but over tcp one chunk alone is always read "
        "(up to --max-chunk)",
    )
    s.add_argument(
        "--timeout",
        type=_seconds,
        default=60.0,
        help="seconds one chunk may take to arrive, plus one per MiB that arrived (TCP; per MiB offered over "
        "NIXL); a slower sender is disconnected (default 60; a new connection's TLS and key handshakes get 10 s "
        "at most)",
    )
    s.add_argument(
        "--idle-timeout",
        type=_seconds,
        default=120.0,
        help="seconds a connection may stay silent between chunks (default 120)",
    )
    _add_key_file(
        s,
        "senders must authenticate with one, and only chunks signed with one for the name they arrive under are stored",
    )
    s.add_argument("--tls-cert", help="serve TLS with this certificate (PEM; senders use tls://HOST:PORT)")
    s.add_argument("--tls-key", help="the private key of --tls-cert (PEM)")
    s.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")
    s.add_argument("-q", "--quiet", action="store_true", help="print no start-up line")
    s.set_defaults(func=cmd_receive)

    s = sub.add_parser(
        "prune",
        help="shrink a chunk store: delete its least recently used chunks",
        description="Deletes least recently used chunk files until the store holds at most --max-size, plus "
        "damaged files moved aside (*.hrry.bad) and temporary files older than an hour. Safe while engines "
        "use the store. Exit 1 if it skipped a path it could not read, delete or follow (a symbolic link), each listed "
        "as skipped. "
        "Example: hurray-vllm prune /var/cache/hurray --max-size 200G --dry-run",
    )
    s.add_argument("dir", help="chunk store directory (a HurrayConnector's hurray_path)")
    s.add_argument("--max-size", type=_size, required=True, help="bytes to keep at most: 500M, 20G, 1.5T, ...")
    s.add_argument("--dry-run", action="store_true", help="only report what would be deleted")
    _add_key_file(
        s,
        "then every chunk no key of the ring signed (unsigned, another fleet's, a header that cannot be parsed) "
        "is deleted, whatever --max-size: a store shared with another fleet loses that fleet's chunks (give each "
        "fleet its own store directory, or prune a shared one with neither --key-file nor the variable)",
    )
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.add_argument("-q", "--quiet", action="store_true", help="print no report (--json is still printed)")
    s.set_defaults(func=cmd_prune)

    s = sub.add_parser(
        "fsck",
        help="verify every chunk file of a store; optionally move the damaged ones aside",
        description="Reads and verifies every chunk file as a consumer would (name, format, model namespace, "
        "KV heads, checksum). Exit 0 if all are good, 1 if any is damaged, unreadable or not verifiable here "
        "(and, with --key-file, unsigned or signed with a key not given); what it skips (a symbolic link, a name "
        "that is not a chunk's) is listed and does not fail it. Safe while engines use the store. "
        "Example: hurray-vllm fsck /var/cache/hurray --quarantine",
    )
    s.add_argument("dir", help="chunk store directory (a HurrayConnector's hurray_path)")
    s.add_argument(
        "--quarantine", action="store_true", help="move damaged files aside (*.hrry.bad): producers write them again"
    )
    _add_key_file(s, "checks each chunk's MAC instead of its checksum; unsigned chunks and other keys' are listed")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.add_argument(
        "-q", "--quiet", action="store_true", help="list nothing (--json is still printed); the exit status still tells"
    )
    s.set_defaults(func=cmd_fsck)

    s = sub.add_parser(
        "router",
        help="one OpenAI endpoint over vLLM servers: KV-aware routing, P/D split, live migration, drain, failover",
        description="Runs an OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics) in front of vLLM OpenAI servers that run HurrayConnector, with /hurray/requests, "
        "/hurray/migrate, /hurray/drain and /hurray/undrain (docs/router.md). Example: hurray-vllm router "
        "--listen 0.0.0.0:9000 --backend http://10.0.0.5:8000 --backend http://10.0.0.6:8000",
    )
    s.add_argument("--listen", type=_host_port, help="HOST:PORT to serve on (required)")
    s.add_argument(
        "--backend",
        action="append",
        type=_backend_url,
        help="base URL of a vLLM server that decodes (repeat for each; at least one); /hurray/* names it as given",
    )
    s.add_argument(
        "--prefill",
        action="append",
        type=_backend_url,
        help="base URL of a vLLM server that runs prompts only (prefill/decode split; repeat for each)",
    )
    s.add_argument(
        "--chunk-tokens",
        type=_positive_count,
        default=256,
        help="tokens per prefix key for KV-aware routing: the engines' hurray_chunk_tokens (default 256)",
    )
    s.add_argument("--health-interval", type=_seconds, default=2.0, help="seconds between health checks (default 2)")
    s.add_argument(
        "--stream-timeout",
        type=_seconds,
        default=600.0,
        help="seconds a backend may stay silent before its request moves elsewhere; this also bounds the wait "
        "for a stream's first token (queue and prefill) and for a whole non-streamed answer, so set it above the "
        "longest of those (default 600)",
    )
    s.add_argument(
        "--policy",
        default="kv",
        choices=["kv", "least-loaded", "round-robin"],
        help="how a request picks its backend: kv (where the longest prefix of its prompt went, else the least "
        "loaded; default), least-loaded, round-robin",
    )
    s.add_argument(
        "--kv-load-slack",
        type=_count,
        default=None,
        help="with --policy kv, follow a prefix only to a backend with at most this many more requests in flight "
        "than the least loaded one (default 8)",
    )
    s.add_argument(
        "--backend-api-key",
        default=None,
        type=_api_key_option,
        help="sent as 'Authorization: Bearer KEY' to every backend (vLLM's --api-key); default: "
        "$HURRAY_BACKEND_API_KEY, which keeps the key off the command line",
    )
    s.add_argument(
        "--api-key",
        action="append",
        default=None,
        type=_api_key_option,
        help="clients must send 'Authorization: Bearer KEY' on /v1/* (vLLM's --api-key; repeat to accept several, "
        "e.g. while rotating); default: $HURRAY_API_KEY, which keeps the key off the command line; without either, "
        "/v1/* is open (/health and /metrics always are). It does not guard /hurray/* (listing, moving and draining "
        "requests): --key-file does",
    )
    _add_key_file(s, "with a key, /hurray/* needs 'Authorization: Bearer TOKEN' (a token of any key of the ring)")
    s.add_argument("--print-token", action="store_true", help="print the control token of the signing key and exit")
    s.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="the router's and its HTTP server's log level, on stderr (default warning)",
    )
    s.set_defaults(func=cmd_router)

    s = sub.add_parser(
        "demo",
        help="run the main job end to end on built-in data",
        description="Builds a tiny model, runs vLLM on the CPU with requests sharing a prefix, snapshots them "
        "mid-decode, writes .hrry/.hrrs/.safetensors, and continues them in a second vLLM engine, in "
        "flash-attn's layout (reference attention) and in transformers. Example: hurray-vllm demo --workdir /tmp/hv",
    )
    s.add_argument("--workdir", help="write (and keep) the files here (default: a temporary directory, removed)")
    s.add_argument("--keep", action="store_true", help="keep the temporary directory and print its path")
    s.add_argument(
        "--format-only", action="store_true", help="only the format round trip on the spec's example (no vLLM)"
    )
    s.add_argument("-v", "--verbose", action="store_true", help="show vLLM's and torch's logs (default: into demo.log)")
    s.add_argument(
        "-q", "--quiet", action="store_true", help="print nothing (a --keep directory's path still goes to stderr)"
    )
    s.set_defaults(func=cmd_demo)
    return p


def _warn(text: str) -> None:
    """Print ``text`` on standard error; nothing when it was closed at start (``2>&-``: ``sys.stderr`` is None).

    ``print(file=None)`` would write it on standard output instead, into what a script reads (``--json``).
    """
    if sys.stderr is not None:
        print(text, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hurray-vllm`` on ``argv`` (default ``sys.argv[1:]``); returns the exit code (the --help epilog's)."""
    for stream in (sys.stdout, sys.stderr):
        # A path that is not UTF-8 (bytes the file system allows) is printed escaped, not a crash.
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
        if sys.stdout is not None:  # None: started with it closed (`>&-`), and print() wrote nothing
            sys.stdout.flush()  # a closed pipe shows here, not at exit where nothing can catch it
        return code
    except BrokenPipeError:  # `hurray-vllm inspect big.hrrs | head`: the reader has what it wanted
        # Python's recipe: what is still buffered goes nowhere, instead of failing again at exit.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # a stdout without a descriptor (tests' capture)
            pass
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by it
    except HurrayArgumentError as exc:  # an option the library refused: the call, not the data
        _warn(f"hurray-vllm: {exc}")
        return 2
    except HurrayFormatError as exc:
        _warn(f"hurray-vllm: invalid input: {exc}")
        return 1
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:  # the path given: the call's error
        _warn(f"hurray-vllm: {exc.strerror}: {exc.filename}")
        return 2
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        _warn(f"hurray-vllm: {exc.strerror or exc}{where}")
        # A symbolic link loop is the path given too; a permission, a full disk, an unreachable server are not.
        return 2 if exc.errno == errno.ELOOP else 1
    except KeyboardInterrupt:
        _warn("hurray-vllm: interrupted")
        return 130
    except Exception as exc:  # a bug: one line, and the traceback on request
        if os.environ.get("HURRAY_VLLM_DEBUG", "") not in ("", "0"):  # "0" asks for no traceback, as unset does
            raise
        _warn(
            f"hurray-vllm: internal error: {type(exc).__name__}: {exc} "
            "(HURRAY_VLLM_DEBUG=1 shows the traceback; please report it)"
        )
        return 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
