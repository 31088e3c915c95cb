#!/usr/bin/env python3
"""Benchmark importing a snapshot with repaging (16 -> 256) for flash-attn and FlashInfer.

A :class:`~hurray_vllm.KVSnapshot` of ``--layers`` layers (bfloat16, 8 KV
heads x 128 by default, page size 16) holds a batch of ``--seqs``
sequences sharing a ``--prefix-tokens`` prefix, with at least ``--kv-mib``
MiB of distinct page-pool bytes (all layers, keys and values), its pages
in shuffled order. On it, in one run, this compares:

* repage            ``repage_snapshot(snap, 256)`` (plan once, one gather per
                    layer and role);
* fa2               ``to_flash_attn_all(snap, page_size=256, flavor="fa2")``
                    (the whole FlashAttention-2 import of every layer);
* flashinfer        ``plan_flashinfer(snap, 256)`` then
                    ``to_flashinfer(snap, i, page_size=256, plan=plan)`` for
                    every layer (NHD, ``(k, v)`` tuples);
* fa2_into          the same with ``out=``: every layer imported into a
                    preallocated, already-faulted ``(k_cache, v_cache)``
                    pair (an engine's cache, or pools reused across
                    imports), the plan computed inside the timing;
* flashinfer_into   the same for FlashInfer;
* copy              ``dst.copy_(src)``: a preallocated, already-faulted
                    destination of exactly the bytes the repaged pools hold,
                    from a contiguous source of that size (the goal's
                    baseline);
* copy_fresh        ``torch.empty_like(src).copy_(src)``: the same into newly
                    allocated memory, as the importers' outputs are
                    (information);
* copy_source       ``copy_`` of the snapshot's own page-pool bytes
                    (preallocated destination), and copy_source_fresh the
                    same into new memory (information: repaging to larger
                    pages duplicates every sequence's partly shared pages).

Contenders alternate inside each repetition in a seeded random order;
medians are reported; freeing a result is not timed. A breakdown times
``plan_repage``, the per-layer ``repage`` gathers and ``plan_flash_attn``
on their own. ``--threads 1`` helps on an oversubscribed machine, where
every OpenMP parallel region can wait a scheduler time slice for its second
thread. Like ``bench_codec.py`` the script re-runs itself with glibc's
mmap threshold pinned at 128 KiB (``--default-malloc`` turns that off), so
every large result lands in freshly mapped memory, as in a fresh process.

Prints one JSON object to stdout; progress goes to stderr.

    .venv/bin/python scripts/bench_import.py [--kv-mib 128] [--repeat 7]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _bench import git_state, log, machine, pin_malloc

from hurray_vllm import BlockPagedTensor, KVSnapshot
from hurray_vllm.adapters.flash_attn import plan_flash_attn, to_flash_attn_all
from hurray_vllm.adapters.flashinfer import plan_flashinfer, to_flashinfer
from hurray_vllm.kv.paged import zero_slots_
from hurray_vllm.kv.repage import plan_repage, repage, repage_snapshot

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
GOAL = 1.5  # import time / copy_ of the repaged bytes


# ── the snapshot ───────────────────────────────────────────────────────────


def seq_lengths(args: argparse.Namespace, token_bytes: int) -> list[int]:
    """A shared prefix plus own tokens, enough for ``--kv-mib`` MiB of distinct source pages."""
    rng = random.Random(args.seed)
    target = -(-(args.kv_mib << 20) // (args.layers * token_bytes))  # distinct tokens, all layers
    base = max(1, -(-(target - args.prefix_tokens) // args.seqs))
    return [args.prefix_tokens + base + rng.randint(1, 120) for _ in range(args.seqs)]


def build_snapshot(args: argparse.Namespace) -> KVSnapshot:
    ps, dtype = args.page_size, DTYPES[args.dtype]
    token_bytes = 2 * args.kv_heads * args.head_dim * torch.empty(0, dtype=dtype).element_size()
    if args.prefix_tokens % ps:
        raise SystemExit(f"--prefix-tokens must be a multiple of --page-size {ps} (only whole pages are shared)")
    lens = seq_lengths(args, token_bytes)
    prefix_pages = args.prefix_tokens // ps
    own = [-(-n // ps) - prefix_pages for n in lens]
    num_pages = prefix_pages + sum(own)
    rng = random.Random(args.seed + 1)
    free = list(range(num_pages))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(prefix_pages)]
    table: list[int] = []
    ptr = [0]
    for n in own:
        table += prefix + [free.pop() for _ in range(n)]
        ptr.append(len(table))
    bt, sp, sl = (torch.tensor(x, dtype=torch.int64) for x in (table, ptr, lens))
    gen = torch.Generator().manual_seed(args.seed)
    probe = BlockPagedTensor(torch.empty(num_pages, ps, 1, 1), bt, sp, sl)
    valid = probe.valid_slots()

    def pool(role: str, layer: int) -> BlockPagedTensor:
        p = torch.empty(num_pages, ps, args.kv_heads, args.head_dim, dtype=dtype)
        # Random finite values (random bit patterns would include NaNs; irrelevant to speed but ugly).
        p.copy_(torch.randn(p.shape, generator=gen))
        zero_slots_(p, valid)  # a snapshot's unused slots are zero
        return BlockPagedTensor(p, bt, sp, sl, role, layer)

    return KVSnapshot(
        keys=tuple(pool("key", i) for i in range(args.layers)),
        values=tuple(pool("value", i) for i in range(args.layers)),
    )


def pool_bytes(tensors: Any) -> int:
    return sum(int(t.numel()) * t.element_size() for t in tensors)


# ── contenders ─────────────────────────────────────────────────────────────


def flashinfer_all(snap: KVSnapshot, page_size: int) -> list[Any]:
    plan = plan_flashinfer(snap, page_size)
    return [to_flashinfer(snap, i, page_size=page_size, plan=plan) for i in range(snap.num_layers)]


def preallocated_pools(snap: KVSnapshot, page_size: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """One faulted-in ``(k, v)`` pool pair per layer, large enough for the import; and its pages."""
    blocks = plan_flash_attn(snap, page_size=page_size, flavor="fa2").num_blocks
    k0 = snap.keys[0]
    shape = (blocks, page_size, k0.num_heads, k0.head_dim)
    pools = []
    for _ in range(snap.num_layers):
        pair = (torch.empty(shape, dtype=k0.dtype), torch.empty(shape, dtype=k0.dtype))
        for t in pair:
            t.view(torch.uint8).fill_(0)
        pools.append(pair)
    return pools, blocks


def flash_attn_into(snap: KVSnapshot, page_size: int, pools: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    return to_flash_attn_all(snap, page_size=page_size, flavor="fa2", out=pools)


def flashinfer_into(snap: KVSnapshot, page_size: int, pools: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
    plan = plan_flashinfer(snap, page_size)
    return [to_flashinfer(snap, i, page_size=page_size, plan=plan, out=pools[i]) for i in range(snap.num_layers)]


def breakdown_once(snap: KVSnapshot, page_size: int) -> dict[str, float]:
    """``repage_snapshot`` step by step, plus ``plan_flash_attn`` (which contains a ``plan_repage``)."""
    pc = time.perf_counter
    k0 = snap.keys[0]
    t0 = pc()
    plan = plan_repage(k0.block_table, k0.seq_ptr, k0.seq_lens, k0.page_size, page_size)
    t1 = pc()
    out = [repage(t, page_size, plan) for t in (*snap.keys, *snap.values)]
    t2 = pc()
    del out
    gc.collect()
    t3 = pc()
    fplan = plan_flash_attn(snap, page_size=page_size, flavor="fa2")
    t4 = pc()
    del fplan
    return {"plan_repage": t1 - t0, "repage_gathers": t2 - t1, "plan_flash_attn": t4 - t3}


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    result = fn()
    dt = time.perf_counter() - t0
    del result  # freeing the result is not timed, for any contender
    gc.collect()
    return dt


def check_once(snap: KVSnapshot, page_size: int) -> dict[str, int]:
    """Untimed: the three imports agree with each other and with the source, token for token."""
    rp = repage_snapshot(snap, page_size)
    fa = to_flash_attn_all(snap, page_size=page_size, flavor="fa2")
    fi = flashinfer_all(snap, page_size)
    for i in (0, snap.num_layers - 1):
        assert torch.equal(fa[i].k_cache, rp.keys[i].page_pool) and torch.equal(fa[i].v_cache, rp.values[i].page_pool)
        assert torch.equal(fi[i].k_cache, rp.keys[i].page_pool) and torch.equal(fi[i].v_cache, rp.values[i].page_pool)
        for s in (0, snap.num_seqs - 1):
            assert torch.equal(rp.keys[i].to_dense(s), snap.keys[i].to_dense(s))
            assert torch.equal(rp.values[i].to_dense(s), snap.values[i].to_dense(s))
    k = rp.keys[0]
    return {
        "pages": k.num_pages,
        "logical_pages": int(k.block_table.numel()),
        "bytes": pool_bytes(t.page_pool for t in (*rp.keys, *rp.values)),
        "fa2_bytes": pool_bytes(t for c in fa for t in (c.k_cache, c.v_cache)),
        "flashinfer_bytes": pool_bytes(t for c in fi for t in (c.k_cache, c.v_cache)),
    }


# ── driver ─────────────────────────────────────────────────────────────────


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-mib", type=int, default=128, help="at least this many MiB of distinct source KV (128)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--page-size", type=int, default=16, help="the snapshot's page size (16)")
    ap.add_argument("--target-page-size", type=int, default=256, help="the imported page size (256, FA2's minimum)")
    ap.add_argument("--seqs", type=int, default=8, help="sequences in the batch (8)")
    ap.add_argument("--prefix-tokens", type=int, default=2000, help="shared prefix, whole source pages (2000)")
    ap.add_argument("--repeat", type=int, default=7, help="repetitions, medians reported (7)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's own choice)")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-piece timing")
    ap.add_argument("--default-malloc", action="store_true", help="keep glibc's adaptive mmap threshold")
    return ap.parse_args(argv)


def main() -> int:
    if "--default-malloc" not in sys.argv:
        pin_malloc(__file__)
    args = parse_args(sys.argv[1:])
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    med = statistics.median
    tps = args.target_page_size

    log("building the snapshot ...")
    snap = build_snapshot(args)
    k0 = snap.keys[0]
    src_bytes = pool_bytes(t.page_pool for t in (*snap.keys, *snap.values))
    sharing = k0.sharing()
    log(f"  {snap.num_layers} layers, {k0.num_pages} pages of {k0.page_size}, {src_bytes / 2**20:.1f} MiB")
    log("checking the imports (untimed) ...")
    out = check_once(snap, tps)
    rep_bytes = out["bytes"]
    pools_fa, _ = preallocated_pools(snap, tps)
    pools_fi, _ = preallocated_pools(snap, tps)
    ref = to_flash_attn_all(snap, page_size=tps, flavor="fa2")
    for r, a, b in zip(ref, flash_attn_into(snap, tps, pools_fa), flashinfer_into(snap, tps, pools_fi), strict=True):
        for x, y, z in ((r.k_cache, a.k_cache, b.k_cache), (r.v_cache, a.v_cache, b.v_cache)):
            n = x.shape[0]
            assert torch.equal(x.view(torch.uint8), y[:n].view(torch.uint8)), "fa2 out= import differs"
            assert torch.equal(x.view(torch.uint8), z[:n].view(torch.uint8)), "flashinfer out= import differs"
    del ref
    log(f"  repaged: {out['pages']} pages of {tps}, {rep_bytes / 2**20:.1f} MiB")

    elem = DTYPES[args.dtype]
    src_r = torch.empty(rep_bytes // torch.empty(0, dtype=elem).element_size(), dtype=elem)
    src_r.view(torch.uint8).fill_(1)
    dst_r = torch.empty_like(src_r)
    dst_r.view(torch.uint8).fill_(0)  # faulted in: "preallocated"
    src_s = torch.cat([t.page_pool.reshape(-1) for t in (*snap.keys, *snap.values)])
    dst_s = torch.empty_like(src_s)
    dst_s.view(torch.uint8).fill_(0)

    runs: dict[str, Callable[[], Any]] = {
        "repage": lambda: repage_snapshot(snap, tps),
        "fa2": lambda: to_flash_attn_all(snap, page_size=tps, flavor="fa2"),
        "flashinfer": lambda: flashinfer_all(snap, tps),
        "fa2_into": lambda: flash_attn_into(snap, tps, pools_fa),
        "flashinfer_into": lambda: flashinfer_into(snap, tps, pools_fi),
        "copy": lambda: dst_r.copy_(src_r),
        "copy_fresh": lambda: torch.empty_like(src_r).copy_(src_r),
        "copy_source": lambda: dst_s.copy_(src_s),
        "copy_source_fresh": lambda: torch.empty_like(src_s).copy_(src_s),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    pieces: list[dict[str, float]] = []
    log("warm-up ...")
    for fn in runs.values():
        timed(fn)
    for rep in range(args.repeat):
        items = list(runs.items())
        random.Random(rep).shuffle(items)
        for key, fn in items:
            times[key].append(timed(fn))
        if not args.no_breakdown:
            pieces.append(breakdown_once(snap, tps))
            gc.collect()
        log(f"repetition {rep + 1}/{args.repeat}: " + " ".join(f"{k}={times[k][-1]:.3f}" for k in runs))

    sec = {k: med(v) for k, v in times.items()}
    imports = ("repage", "fa2", "flashinfer", "fa2_into", "flashinfer_into")
    ratios: dict[str, float] = {}
    for name in imports:
        ratios[f"{name}_vs_copy"] = round(sec[name] / sec["copy"], 2)
        ratios[f"{name}_vs_copy_fresh"] = round(sec[name] / sec["copy_fresh"], 2)
        ratios[f"{name}_vs_copy_source"] = round(sec[name] / sec["copy_source"], 2)
    ratios["copy_fresh_vs_copy"] = round(sec["copy_fresh"] / sec["copy"], 2)
    nbytes = {
        "copy": rep_bytes,
        "copy_fresh": rep_bytes,
        "copy_source": src_bytes,
        "copy_source_fresh": src_bytes,
        **dict.fromkeys(imports, rep_bytes),
    }
    result = {
        "benchmark": "import",
        "date": datetime.date.today().isoformat(),
        "machine": machine(
            loadavg_start=[round(x, 2) for x in load_start], loadavg_end=[round(x, 2) for x in os.getloadavg()]
        ),
        "git": git_state(),
        "config": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "dtype": args.dtype,
            "page_size": args.page_size,
            "target_page_size": tps,
            "seqs": args.seqs,
            "prefix_tokens": args.prefix_tokens,
            "seq_lens": [int(x) for x in k0.seq_lens],
            "kv_mib_min": args.kv_mib,
            "repeat": args.repeat,
            "seed": args.seed,
        },
        "source": {
            "bytes": src_bytes,
            "pages": k0.num_pages,
            "logical_pages": sharing.logical_pages,
            "shared_pages": sharing.shared_pages,
        },
        "repaged": {
            "bytes": rep_bytes,
            "pages": out["pages"],
            "logical_pages": out["logical_pages"],
            "fa2_bytes": out["fa2_bytes"],
            "flashinfer_bytes": out["flashinfer_bytes"],
        },
        "seconds": {k: round(v, 4) for k, v in sec.items()},
        "gb_per_s": {k: round(nbytes[k] / v / 1e9, 2) for k, v in sec.items()},
        "ratios": ratios,
        "goal_vs_copy": GOAL,
        "goals_met": {f"{n}_vs_copy_le_{GOAL}x": ratios[f"{n}_vs_copy"] <= GOAL for n in imports},
        "all_seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "wall_seconds": 0.0,
    }
    if pieces:
        result["breakdown_seconds"] = {k: round(med([p[k] for p in pieces]), 4) for k in pieces[0]}
    result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
