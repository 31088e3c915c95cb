#!/usr/bin/env python3
"""Benchmark the Python parse of chunk files: what a consumer's scheduler does per file after the read.

Chunk files as HurrayConnector writes them for ``bench_connector.py``'s Llama
(8 layers, 8 KV heads x head dim 128, bf16, vLLM block size 128, chunks of
256 tokens: 8 MiB and 36 records per file), made the connector's way
(``export_snapshot`` of staged blocks, the chunk digest, ``DirectoryStore.put``),
one per prompt with the request ids of a run ("0", "1", ... "12": metadata of
two lengths). Each file is read into memory once (``read_file``, what the
reader's helper thread does); then, per file, on the measuring thread:

* ``parse``      ``load_file_bytes``: the file's records into a checked ``KVSnapshot``;
* ``header``     the data check's Python half (``begin_check_data``: the header digest),
                 on the snapshot ``parse`` returned;
* ``scheduler``  both plus ``verify_chunk``: the scheduler thread's CPU per file
                 (the pools' checksum runs natively on a helper, not timed here).

Each is timed with the parse memo (``hurray_vllm.containers.template``, and
the digest header's remembered tensor sections) off and on, side by side: the
two alternate file by file within each round (which goes first alternates
too), so that the machine's drift and other work fall on both alike.
Reported per file: the median wall time (``perf_counter``), its 10th and
90th percentiles, the median thread CPU time (``thread_time``), and off ÷ on
ratios of the medians. ``--rounds`` sets how
many times every file is parsed per mode.

A checkout without the memo (an older commit, via ``PYTHONPATH``) is measured
with the memo "off" only.

Prints one JSON object (stdout); progress goes to stderr.

    .venv/bin/python scripts/bench_parse.py [--rounds 200] [--files 13] [--layers 8] [--heads 8]
        [--head-dim 128] [--block-size 128] [--chunk-tokens 256] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from _bench import git_state, log, machine

from hurray_vllm.adapters.vllm.export import SequenceState, export_snapshot
from hurray_vllm.adapters.vllm.layouts import LogicalBHNC
from hurray_vllm.chunks import digest
from hurray_vllm.chunks.digest import DIGEST_KEY, chunk_digest
from hurray_vllm.chunks.store import DirectoryStore
from hurray_vllm.chunks.verify import begin_check_data, verify_chunk
from hurray_vllm.containers.io import load_file_bytes, read_file
from hurray_vllm.kv.snapshot import KVSnapshot, ModelFingerprint, SnapshotSource

try:
    from hurray_vllm.containers import template
except ImportError:  # a checkout before the memo
    template = None  # type: ignore[assignment]

#: The namespace the chunk files go under (a store's names are hex: DirectoryStore refuses others).
NAMESPACE = "0a"


def make_chunks(root: Path, args: argparse.Namespace) -> tuple[DirectoryStore, list[str], ModelFingerprint]:
    """``args.files`` chunk files of one engine, written as the connector writes them."""
    dtype = getattr(torch, args.dtype)
    fp = ModelFingerprint("LlamaForCausalLM", args.layers, args.heads, args.head_dim, args.dtype, "sha256:" + "5a" * 16)
    store = DirectoryStore(root)
    pages = args.chunk_tokens // args.block_size
    names = []
    gen = torch.Generator().manual_seed(0)
    for c in range(args.files):
        # The worker's staged copy: vLLM's null block 0, then the chunk's blocks.
        caches = [
            torch.randn(pages + 1, args.heads, args.block_size, 2 * args.head_dim, generator=gen).to(dtype)
            for _ in range(args.layers)
        ]
        tokens = [1000 + 7 * c + t for t in range(args.chunk_tokens)]
        snap = export_snapshot(
            caches,
            LogicalBHNC(args.head_dim),
            [SequenceState(str(c), list(range(1, pages + 1)), args.chunk_tokens, tokens)],
            block_size=args.block_size,
            fingerprint=fp,
            source=SnapshotSource("vllm", "cpu", args.block_size),
            reserved_blocks=(),
        )
        snap = replace(snap, extra={**snap.extra, DIGEST_KEY: chunk_digest(snap)})
        store.put(NAMESPACE, f"{c:04x}", snap, replace=True)
        names.append(f"{c:04x}")
    return store, names, fp


def _stats(wall: list[float], cpu: list[float]) -> dict[str, float]:
    w = sorted(wall)
    n = len(w)
    return {
        "median_us": round(statistics.median(w) * 1e6, 1),
        "p10_us": round(w[n // 10] * 1e6, 1),
        "p90_us": round(w[(9 * n) // 10] * 1e6, 1),
        "cpu_median_us": round(statistics.median(cpu) * 1e6, 1),
        "samples": n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200, help="parses of every file per mode (default 200)")
    ap.add_argument("--files", type=int, default=13, help="chunk files (default 13: request ids 0..12)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dir", default=None, help="where the chunk files go (default: a temporary directory)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        log(f"writing {args.files} chunk files")
        store, names, fp = make_chunks(Path(tmp), args)
        datas = [read_file(store.path(NAMESPACE, n)) for n in names]
        size = datas[0].view.nbytes
        modes = ["off", "on"] if template is not None else ["off"]
        stages = ("parse", "header", "scheduler")
        wall: dict[str, dict[str, list[float]]] = {m: {s: [] for s in stages} for m in modes}
        cpu: dict[str, dict[str, list[float]]] = {m: {s: [] for s in stages} for m in modes}

        def timed(mode: str, stage: str, fn: Callable[[], Any]) -> Any:
            c0, t0 = time.thread_time(), time.perf_counter()
            out = fn()
            t1, c1 = time.perf_counter(), time.thread_time()
            wall[mode][stage].append(t1 - t0)
            cpu[mode][stage].append(c1 - c0)
            return out

        def set_mode(mode: str) -> None:
            if template is not None:
                template.set_enabled(mode == "on")
                digest.remember_sections(mode == "on")

        def one(mode: str, i: int, record: bool) -> None:
            set_mode(mode)
            data = datas[i % len(datas)]
            tokens = list(range(1000 + 7 * (i % len(datas)), 1000 + 7 * (i % len(datas)) + args.chunk_tokens))
            if not record:
                snap = load_file_bytes(data)
                begin_check_data(snap)
                verify_chunk(snap, fp, tokens, digest=False)
                return
            c0, t0 = time.thread_time(), time.perf_counter()
            snap = timed(mode, "parse", lambda: load_file_bytes(data))
            verify_chunk(snap, fp, tokens, digest=False)
            timed(mode, "header", lambda: begin_check_data(snap))
            wall[mode]["scheduler"].append(time.perf_counter() - t0)
            cpu[mode]["scheduler"].append(time.thread_time() - c0)

        log("warming up")
        for i in range(3 * len(datas)):
            for m in modes:
                one(m, i, False)
        log(f"measuring {args.rounds} rounds of {len(datas)} files per mode")
        gc.disable()  # collections land on one mode or the other at random; run them between rounds instead
        try:
            for r in range(args.rounds):
                for i in range(len(datas)):
                    order = modes if (r + i) % 2 == 0 else modes[::-1]
                    for m in order:
                        one(m, r * len(datas) + i, True)
                gc.collect()
        finally:
            gc.enable()
            set_mode("on")
        snap = load_file_bytes(datas[0])
        assert isinstance(snap, KVSnapshot)
        out: dict[str, Any] = {
            "benchmark": "parse",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "git": git_state(),
            "machine": machine(),
            "chunk": {
                "layers": args.layers,
                "kv_heads": args.heads,
                "head_dim": args.head_dim,
                "dtype": args.dtype,
                "block_size": args.block_size,
                "chunk_tokens": args.chunk_tokens,
                "file_bytes": size,
                "records": _records(datas[0]),
                "files": len(datas),
            },
            "per_file": {m: {s: _stats(wall[m][s], cpu[m][s]) for s in stages} for m in modes},
        }
        if template is not None:
            out["memo"] = template.stats()
        if len(modes) == 2:
            out["off_over_on"] = {
                s: {
                    "wall": round(
                        out["per_file"]["off"][s]["median_us"] / max(out["per_file"]["on"][s]["median_us"], 1e-9), 2
                    ),
                    "cpu": round(
                        out["per_file"]["off"][s]["cpu_median_us"]
                        / max(out["per_file"]["on"][s]["cpu_median_us"], 1e-9),
                        2,
                    ),
                }
                for s in stages
            }
        print(json.dumps(out, indent=2))


def _records(data: Any) -> int:
    from hurray_vllm.containers.hrryfile import HrryFile

    with HrryFile(data.path, data=data) as hf:
        return len(hf.entries)


if __name__ == "__main__":
    sys.exit(main())
