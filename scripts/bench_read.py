#!/usr/bin/env python3
"""Benchmark a consumer's read and data check of chunk files: checksummed from memory, or page by page as read.

What HurrayConnector's scheduler does per chunk file of a warm load, before
the first block is written: read the file (from the page cache) into memory
of its own, parse it, and check its page pools against the chunk digest
(CRC-32C). Two ways, side by side on the same files:

* ``after``  one read of the whole file, then the pools' checksum: every
             pool byte comes from memory a second time (the read's copy
             left the cache long before);
* ``paged``  the read checksums each 4 KiB page as it arrives, while it is
             in cache (``read_whole(page_crcs=True)``), and the check
             combines those registers over the pools' ranges
             (``begin_check_data(read=...)``): the way the connector reads.

Each way runs with the CRC-32C folded with VPCLMULQDQ (``fold``, where the
CPU has AVX-512 and it) and with the crc32 instruction alone (``lanes``,
``native.crc32c_fold(False)``): ``after/lanes`` is how loads read before
2026-12-07, ``paged/fold`` how they read now.

Chunk files as ``bench_parse.py`` makes them (the connector's Llama: 8 MiB,
eight per 2048-token prompt). Per prompt of ``--files`` files, on one thread:
the read, the parse and both halves of the check, one file after another
(in the connector the read runs ahead on a helper and the pools' half on
another; here their sum is what a 2-core machine pays). The two ways
alternate prompt by prompt (which goes first alternates too). Reported: the
median per prompt of each stage and of the whole, wall and thread CPU, and
ratios of the medians: before ÷ now, ``after`` ÷ ``paged``, lanes ÷ fold.

Prints one JSON object (stdout); progress goes to stderr.

    .venv/bin/python scripts/bench_read.py [--rounds 60] [--files 8]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _bench import git_state, log, machine
from bench_parse import NAMESPACE, make_chunks

from hurray_vllm import native
from hurray_vllm.chunks.store import load_chunk
from hurray_vllm.chunks.verify import begin_check_data
from hurray_vllm.containers.hrryfile import read_whole

STAGES = ("read", "parse", "check", "total")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60, help="prompts read per way (default 60)")
    ap.add_argument("--files", type=int, default=8, help="chunk files per prompt (default 8: 2048 tokens)")
    ap.add_argument("--dir", default=None, help="where the chunk files go (default: a temporary directory)")
    args = ap.parse_args()
    # bench_parse's chunk geometry: the connector benchmark's Llama.
    args.layers, args.heads, args.head_dim, args.block_size, args.chunk_tokens, args.dtype = (
        8,
        8,
        128,
        128,
        256,
        "bfloat16",
    )
    if native.library() is None:
        raise SystemExit(f"the native kernels are needed: {native.unavailable_reason()}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        log(f"writing {args.files} chunk files")
        store, names, _ = make_chunks(Path(tmp), args)
        paths = [store.path(NAMESPACE, n) for n in names]
        size = paths[0].stat().st_size
        folds = ("fold", "lanes") if native.crc32c_fold() else ("lanes",)
        ways = tuple(f"{w}/{c}" for w in ("after", "paged") for c in folds)
        wall = {w: {s: [] for s in STAGES} for w in ways}  # type: dict[str, dict[str, list[float]]]
        cpu = {w: {s: [] for s in STAGES} for w in ways}  # type: dict[str, dict[str, list[float]]]

        def prompt(way: str, record: bool) -> None:
            native.crc32c_fold(way.endswith("/fold"))
            spent = {s: [0.0, 0.0] for s in STAGES}
            c00, t00 = time.thread_time(), time.perf_counter()
            for path in paths:
                c0, t0 = time.thread_time(), time.perf_counter()
                read = read_whole(path, page_crcs=way.startswith("paged"))
                c1, t1 = time.thread_time(), time.perf_counter()
                snap = load_chunk(read)
                c2, t2 = time.thread_time(), time.perf_counter()
                begin_check_data(snap, read=read)()
                c3, t3 = time.thread_time(), time.perf_counter()
                for stage, (w, c) in zip(STAGES, ((t1 - t0, c1 - c0), (t2 - t1, c2 - c1), (t3 - t2, c3 - c2))):
                    spent[stage][0] += w
                    spent[stage][1] += c
                del snap, read
            spent["total"] = [time.perf_counter() - t00, time.thread_time() - c00]
            if record:
                for stage in STAGES:
                    wall[way][stage].append(spent[stage][0])
                    cpu[way][stage].append(spent[stage][1])

        log("warming up (the files into the page cache, the recycled buffers)")
        for _ in range(3):
            for w in ways:
                prompt(w, False)
        log(f"measuring {args.rounds} prompts of {args.files} files per way")
        gc.disable()
        try:
            for r in range(args.rounds):
                for w in ways if r % 2 == 0 else ways[::-1]:
                    prompt(w, True)
                gc.collect()
        finally:
            gc.enable()
            native.crc32c_fold(True)

        def med(xs: list[float]) -> float:
            return round(statistics.median(xs) * 1e3, 3)

        per_prompt = {w: {s: {"wall_ms": med(wall[w][s]), "cpu_ms": med(cpu[w][s])} for s in STAGES} for w in ways}
        out = {
            "benchmark": "read",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "git": git_state(),
            "machine": machine(),
            "files_per_prompt": args.files,
            "file_bytes": size,
            "rounds": args.rounds,
            "per_prompt": per_prompt,
            "ratios": {
                f"{a} / {b}": {
                    s: round(statistics.median(wall[a][s]) / statistics.median(wall[b][s]), 3)
                    for s in ("read", "check", "total")
                }
                for a, b in (
                    ("after/lanes", f"paged/{folds[0]}"),  # before 2026-12-07 / now
                    (f"after/{folds[0]}", f"paged/{folds[0]}"),
                    ("after/lanes", f"after/{folds[0]}"),
                )
                if a != b
            },
        }
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
