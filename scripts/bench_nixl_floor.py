#!/usr/bin/env python3
"""The floor under the NIXL transport on this machine: bare NIXL WRITEs, with and without a checksum.

    python scripts/bench_nixl_floor.py [--mib 256] [--repeat 5]

No Hurray protocol at all: a receiver process registers one slab, a sender
process registers 64 pools and WRITEs them into it (one notification per
pool), with 1 and with 2 sender agents on as many threads, and the receiver
either only polls its notifications or also checksums every pool as it
lands (CRC-32C on a helper thread, as ``NixlReceiver`` does). Each round is
timed on the receiver from the sender's start signal to the last
notification, and to the last checksum. Beside them, the 2-thread and
1-thread in-process ``copy_`` of the same bytes that ``bench_transport.py``
compares with, and each process's CPU time per round.

What it answers: whether the end-to-end figure of ``bench_transport.py``
is bounded by the protocol (offer, grant, Python) or by the machine (the
copy and the checksum sharing its cores). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hurray_vllm import native
from hurray_vllm.transport.nixl import make_agent

POOLS = 64
POLL_S = 0.0005
WAIT_S = 600.0  # the most either process waits for the other (a round takes seconds): past it, it gives up


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def receiver(conn: Any, pool_bytes: int, rounds: int) -> None:
    agent = make_agent("floor-recv", None)
    slab = torch.zeros(POOLS * pool_bytes, dtype=torch.uint8)
    agent.register_memory([(slab.data_ptr(), slab.numel(), 0, "")], "DRAM")
    conn.send((agent.name, agent.get_agent_metadata(), slab.data_ptr()))
    while (job := conn.recv()) is not None:
        check = job["checksum"]
        landed: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        t0, c0 = time.perf_counter(), cpu_s()
        done: dict[str, float] = {}

        def hash_pools(landed: queue.SimpleQueue[int | None], done: dict[str, float], t0: float) -> None:
            while (j := landed.get()) is not None:
                native.crc32c_tensors([slab[j * pool_bytes : (j + 1) * pool_bytes]])
            done["checked"] = time.perf_counter() - t0

        # A daemon: a receiver giving up below must not wait at exit for a hasher waiting for pools.
        hasher = threading.Thread(target=hash_pools, args=(landed, done, t0), daemon=True)
        if check:
            hasher.start()
        got = 0
        deadline = time.monotonic() + WAIT_S
        while got < POOLS:
            if time.monotonic() > deadline:  # a sender that died mid-round: exit, which the sender's recv sees
                raise SystemExit(f"receiver: {got} of {POOLS} pools landed in {WAIT_S:g} s")
            for msgs in agent.get_new_notifs().values():
                for m in msgs:
                    got += 1
                    if check:
                        landed.put(int(bytes(m)[1:]))
            time.sleep(POLL_S)
        done["landed"] = time.perf_counter() - t0
        if check:
            landed.put(None)
            hasher.join()
        done["cpu"] = cpu_s() - c0
        conn.send(done)


def reply(here: Any, proc: Any) -> Any:
    """The receiver's next message; exits when it died (EOF: the parent holds no copy of its end) or is silent."""
    if here.poll(WAIT_S):
        try:
            return here.recv()
        except EOFError:
            pass
        proc.join(5)
        sys.exit(f"the receiver died (exit code {proc.exitcode}); its error is above")
    proc.terminate()
    sys.exit(f"the receiver sent nothing in {WAIT_S:g} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    pool_bytes = (args.mib << 20) // POOLS
    nbytes = pool_bytes * POOLS
    if native.library() is None:
        sys.exit("the native kernels are needed for the checksum (a C compiler)")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(there, pool_bytes, args.repeat))
    proc.start()
    # The child's end, closed here: otherwise it stays open in this process, and a receiver that dies leaves
    # here.recv() waiting forever instead of raising EOFError.
    there.close()
    name, md, base = reply(here, proc)
    gen = torch.Generator().manual_seed(0)
    pools = [torch.randint(0, 256, (pool_bytes,), dtype=torch.uint8, generator=gen) for _ in range(POOLS)]
    agents = [make_agent(f"floor-send{i}", None) for i in range(2)]
    for a in agents:
        a.add_remote_agent(md)
        a.register_memory([(p.data_ptr(), pool_bytes, 0, "") for p in pools], "DRAM")

    def push(a: Any, idx: list[int]) -> None:
        local = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(pools[j].data_ptr(), pool_bytes, 0) for j in idx], "DRAM")
        remote = a.prep_xfer_dlist(name, [(base + j * pool_bytes, pool_bytes, 0) for j in idx], "DRAM")
        hs = [a.make_prepped_xfer("WRITE", local, [k], remote, [k], b"n%d" % j) for k, j in enumerate(idx)]
        for h in hs:
            a.transfer(h)
        while hs:
            hs = [h for h in hs if a.check_xfer_state(h) != "DONE"]
            time.sleep(0.0002)
        local.release()
        remote.release()

    def copy_round(threads: int) -> float:
        dst = [torch.empty_like(p) for p in pools]
        torch.set_num_threads(threads)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            for d, p in zip(dst, pools):
                d.copy_(p)
            times.append(time.perf_counter() - t)
        return min(times)

    default_threads = torch.get_num_threads()
    results: dict[str, Any] = {}
    for lanes in (1, 2):
        for check in (False, True):
            rows = []
            for rnd in range(args.repeat + 1):
                here.send({"checksum": check})
                t0, c0 = time.perf_counter(), cpu_s()
                shares = [list(range(k, POOLS, lanes)) for k in range(lanes)]
                ths = [threading.Thread(target=push, args=(agents[k], shares[k])) for k in range(lanes)]
                for t in ths:
                    t.start()
                for t in ths:
                    t.join()
                sent, sender_cpu = time.perf_counter() - t0, cpu_s() - c0
                r = reply(here, proc)
                if rnd:  # round 0 connects and warms up
                    rows.append({**r, "sent": sent, "sender_cpu": sender_cpu})
            key = f"{lanes}_agents_{'with' if check else 'without'}_checksum"
            end = [x.get("checked", x["landed"]) for x in rows]
            results[key] = {
                "median_s": round(statistics.median(end), 4),
                "best_s": round(min(end), 4),
                "GBps": round(nbytes / statistics.median(end) / 1e9, 2),
                "sender_cpu_s": round(statistics.median(x["sender_cpu"] for x in rows), 4),
                "receiver_cpu_s": round(statistics.median(x["cpu"] for x in rows), 4),
            }
    copies = {f"{n}_threads": round(copy_round(n), 4) for n in sorted({default_threads, 1})}
    torch.set_num_threads(default_threads)
    here.send(None)
    proc.join(30)
    ref = min(copies.values())
    out = {
        "bytes": nbytes,
        "pools": POOLS,
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "copy_best_s": copies,
        "nixl": results,
        "half_of_copy_s": round(2 * ref, 4),
        "over_copy_": {k: round(ref / v["median_s"], 2) for k, v in results.items()},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
