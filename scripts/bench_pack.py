#!/usr/bin/env python3
"""Benchmark the load side's packing: interchange pages written into vLLM's CPU cache.

A consumer's worker writes each loaded layer's keys and values
(``[n, block_size, heads, head_dim]``, the interchange layout) into the CPU
backend's packed cache (``CpuPacked.scatter``, the native kernels of
``hurray_vllm/native``). On the same bytes, cold (a 64 MiB buffer is written
between repetitions, so neither side finds its data in the caches), this
compares, per repetition and in alternating order:

* scatter_vec / scatter_amx  ``CpuPacked(isa).scatter`` of every layer;
* copy                       ``dst.copy_(src)`` of the same bytes, contiguous,
                             into already-faulted memory (the baseline);
* scatter_vec_torch          the pure-torch fallback (``HURRAY_VLLM_NATIVE=0``
                             path, information).

Defaults mirror ``bench_connector.py``'s Llama: 8 layers of 8 KV heads x 128,
bf16, blocks of 128 tokens, 16 blocks per layer (one 2048-token prompt:
64 MiB in all). ``--threads`` sets torch's (and so the kernels' OpenMP)
threads: 1 is what the benchmark engines run with.

Prints one JSON object to stdout; progress goes to stderr.

    .venv/bin/python scripts/bench_pack.py [--repeat 25] [--threads 1]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from _bench import git_state, log, machine

from hurray_vllm import native
from hurray_vllm.adapters.vllm.layouts import CpuPacked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=16, help="blocks written per layer")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h, d, n, m = args.heads, args.head_dim, args.block_size, args.blocks
    total = 4 * m  # the cache holds more blocks than are written, in shuffled order
    caches = [torch.zeros(total, h, n, 2 * d, dtype=torch.bfloat16) for _ in range(args.layers)]
    ids = torch.randperm(total)[:m].to(torch.int64)
    keys = [torch.randn(m, n, h, d, dtype=torch.bfloat16) for _ in range(args.layers)]
    values = [torch.randn_like(k) for k in keys]
    src = [torch.cat([k.reshape(-1), v.reshape(-1)]) for k, v in zip(keys, values, strict=True)]
    dst = [torch.empty_like(s) for s in src]
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    nbytes = sum(s.numel() * s.element_size() for s in src)

    def scatter(isa: str) -> Callable[[], None]:
        layout = CpuPacked(isa, d)
        return lambda: [layout.scatter(c, ids, k, v) for c, k, v in zip(caches, keys, values, strict=True)] and None

    def torch_scatter() -> None:
        saved = dict(native._state)
        native._state.clear()
        native._state["lib"] = None  # as if the kernels were switched off
        native._state["reason"] = "benchmark: the torch path"
        try:
            scatter("vec")()
        finally:
            native._state.clear()
            native._state.update(saved)

    contenders: dict[str, Callable[[], None]] = {
        "copy": lambda: [b.copy_(a) for a, b in zip(src, dst, strict=True)] and None,
        "scatter_vec": scatter("vec"),
        "scatter_amx": scatter("amx"),
        "scatter_vec_torch": torch_scatter,
    }
    for fn in contenders.values():  # warm: the kernels' library is built or loaded here
        fn()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    log(f"{nbytes / 2**20:.0f} MiB per call, {args.repeat} repetitions, {args.threads} thread(s)")
    for r in range(args.repeat):
        order = list(contenders)
        if r % 2:
            order.reverse()
        for name in order:
            flush.fill_(r & 0xFF)
            t0 = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "benchmark": "pack",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git": git_state(),
        "machine": machine(threads=args.threads),
        "native": native.library() is not None,
        "bytes": nbytes,
        "median_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
        "ratio_over_copy": {k: round(v / med["copy"], 3) for k, v in med.items() if k != "copy"},
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
