"""Move one >= 256 MiB KV chunk between two local processes: TCP (plain and TLS) vs NIXL vs an in-process ``copy_``.

    python scripts/bench_transport.py [--mib 256] [--repeat 3] [--out bench.json]

This process hosts the receivers (``hurray_vllm.transport.tcp.Receiver`` and
``hurray_vllm.transport.nixl.NixlReceiver``) with a store that keeps nothing;
a sender subprocess builds the same chunk (32 layers, bf16, random bytes, its
chunk digest) and, round after round, copies its page pools in process
(``copy_`` into preallocated pools), pushes it over TCP, over TCP inside TLS
(``tls://``, a throwaway certificate; issue #21), over NIXL with UCX's
default peer error handling, and over NIXL with ``ucx_error_handling_mode=none``
(which lets UCX use shared memory). A first round warms up connections and
registrations and is not counted.

Every timed push is end to end: from the call until the receiver validated
the chunk, verified its digest (blake2b over every page pool) and stored it.
The digest check costs the same on both transports and bounds both on a small
machine, so the figures without it are reported too (TCP: end to end minus
the receiver's digest time; NIXL: offer + grant + WRITEs, which the digest
check overlaps). Ratios are speed-ups: ``a_over_b`` = time of b / time of a.
Prints one JSON object (medians and bests, ratios, the UCX lanes chosen).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hurray_vllm import BlockPagedTensor, KVSnapshot, ModelFingerprint, SnapshotSource  # noqa: E402
from hurray_vllm.chunks.store import chunk_digest, chunks_of, namespace_of  # noqa: E402
from hurray_vllm.transport import tcp  # noqa: E402
from hurray_vllm.transport.security import TlsOptions, client_context, server_context  # noqa: E402

LAYERS, HEADS, DIM, PAGE = 32, 8, 128, 16


def build_chunk(mib: int, seed: int = 0) -> tuple[str, str, KVSnapshot]:
    """One chunk of ``mib`` MiB of page pools (32 layers x key/value, bf16), with its digest."""
    per_token = 2 * LAYERS * HEADS * DIM * 2
    tokens = -(-(mib << 20) // per_token)
    tokens = -(-tokens // PAGE) * PAGE
    pages = tokens // PAGE
    gen = torch.Generator().manual_seed(seed)
    table, ptr, lens = torch.arange(pages), torch.tensor([0, pages]), torch.tensor([tokens])

    def pool() -> torch.Tensor:
        raw = torch.randint(0, 256, (pages * PAGE * HEADS * DIM * 2,), dtype=torch.uint8, generator=gen)
        return raw.view(torch.bfloat16).view(pages, PAGE, HEADS, DIM)

    keys = tuple(BlockPagedTensor(pool(), table, ptr, lens, "key", i) for i in range(LAYERS))
    values = tuple(BlockPagedTensor(pool(), table, ptr, lens, "value", i) for i in range(LAYERS))
    snap = KVSnapshot(
        keys,
        values,
        token_ids=(tuple(range(tokens)),),
        fingerprint=ModelFingerprint("BenchLlama", LAYERS, HEADS, DIM, "bfloat16"),
        source=SnapshotSource("bench", "nhd", PAGE),
    )
    ((key, chunk),) = chunks_of(snap, tokens)
    assert chunk.fingerprint is not None
    return namespace_of(chunk.fingerprint), key, chunk


class NullStore:
    """Counts what it is given and keeps nothing (page pools of NIXL chunks are the receiver's buffers)."""

    def __init__(self) -> None:
        self.count = 0
        self.nbytes = 0

    def put(self, namespace: str, key: str, snap: KVSnapshot) -> bool:
        self.count += 1
        self.nbytes = snap.nbytes
        return True

    def has(self, namespace: str, key: str) -> bool:
        return False


def summary(times: list[float], nbytes: int) -> dict[str, float]:
    med, best = statistics.median(times), min(times)
    return {
        "median_s": round(med, 4),
        "best_s": round(best, 4),
        "median_GBps": round(nbytes / med / 1e9, 3),
        "best_GBps": round(nbytes / best / 1e9, 3),
    }


# ── the sender process ─────────────────────────────────────────────────────────


def sender(args: argparse.Namespace) -> None:
    from hurray_vllm.transport.nixl import NixlSender

    t = time.perf_counter()
    ns, key, chunk = build_chunk(args.mib)
    build_s = time.perf_counter() - t
    pools = [p.page_pool for p in (*chunk.keys, *chunk.values)]
    dst = [torch.empty_like(p) for p in pools]
    t = time.perf_counter()
    chunk_digest(chunk)
    digest_s = time.perf_counter() - t
    senders = {
        "nixl": NixlSender(),
        "nixl_shm": NixlSender(backend_params={"ucx_error_handling_mode": "none"}),
    }
    runs: dict[str, Any] = {"copy_": {}, "tcp": [], "tls": [], "nixl": [], "nixl_shm": []}
    tls = client_context(TlsOptions(ca_file=args.tls_ca))
    default_threads = torch.get_num_threads()
    for rnd in range(args.repeat + 1):
        # copy_ with torch's default threads and with one thread (on a small, busy machine
        # the intra-op threads can slow it down tenfold); three samples of each a round.
        copy_s: dict[str, list[float]] = {}
        for threads in (default_threads, 1):
            torch.set_num_threads(threads)
            for _ in range(3):
                t = time.perf_counter()
                for d, p in zip(dst, pools):
                    d.copy_(p)
                copy_s.setdefault(f"{threads}_threads", []).append(time.perf_counter() - t)
        torch.set_num_threads(default_threads)
        t = time.perf_counter()
        tcp.send_chunks(args.tcp_url, [(ns, key, chunk)], timeout=300)
        tcp_s = time.perf_counter() - t
        t = time.perf_counter()
        tcp.send_chunks(args.tls_url, [(ns, key, chunk)], timeout=300, tls=tls)
        tls_s = time.perf_counter() - t
        out: dict[str, Any] = {"copy_": copy_s, "tcp": tcp_s, "tls": tls_s}
        for name, s in senders.items():
            t = time.perf_counter()
            (st,) = s.send(args.nixl_url, [(ns, key, chunk)], timeout=300)
            out[name] = {
                "s": time.perf_counter() - t,
                "handshake_s": st.handshake_s,
                "transfer_s": st.transfer_s,
                "commit_s": st.commit_s,
            }
        if rnd:  # round 0 warms up
            for k, v in out.items():
                if k == "copy_":
                    for threads, times in v.items():
                        runs[k].setdefault(threads, []).extend(times)
                else:
                    runs[k].append(v)
    assert all(torch.equal(d.view(torch.uint8), p.view(torch.uint8)) for d, p in zip(dst, pools))
    result = {"nbytes": chunk.nbytes, "build_s": build_s, "sender_digest_s": digest_s, "runs": runs}
    print("RESULT " + json.dumps(result), flush=True)


# ── the receiving process (main) ───────────────────────────────────────────────


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--role", default="main", help=argparse.SUPPRESS)
    ap.add_argument("--tcp-url", help=argparse.SUPPRESS)
    ap.add_argument("--nixl-url", help=argparse.SUPPRESS)
    ap.add_argument("--tls-url", help=argparse.SUPPRESS)
    ap.add_argument("--tls-ca", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "sender":
        sender(args)
        return

    from hurray_vllm.transport.nixl import NixlReceiver

    # Time the TCP receiver's phases: reading + validating the stream, then the digest.
    phases: dict[str, list[float]] = {"receive_s": [], "digest_s": []}

    def timed(fn: Any, name: str) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name].append(time.perf_counter() - t)

        return wrapper

    tcp.read_stream = timed(tcp.read_stream, "receive_s")
    tcp.digest_matches = timed(tcp.digest_matches, "digest_s")

    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from pki import make_pki

    pki_dir = tempfile.mkdtemp(prefix="bench_transport_pki.")
    pki = make_pki(Path(pki_dir), "bench")
    tcp_store, nixl_store, tls_store = NullStore(), NullStore(), NullStore()
    tcp_rx = tcp.Receiver("127.0.0.1", 0, tcp_store).start()  # type: ignore[arg-type]
    tls_rx = tcp.Receiver(
        "127.0.0.1",
        0,
        tls_store,  # type: ignore[arg-type]
        tls=server_context(TlsOptions(pki["cert"], pki["key"])),
    ).start()
    nixl_rx = NixlReceiver("127.0.0.1", 0, nixl_store, timeout=300).start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_LOG_LEVEL": "info"}
    cmd = [
        sys.executable,
        __file__,
        "--role=sender",
        f"--mib={args.mib}",
        f"--repeat={args.repeat}",
        f"--tcp-url=tcp://127.0.0.1:{tcp_rx.address[1]}",
        f"--nixl-url=nixl://127.0.0.1:{nixl_rx.address[1]}",
        f"--tls-url=tls://127.0.0.1:{tls_rx.address[1]}",
        f"--tls-ca={pki['ca']}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    tcp_rx.stop()
    tls_rx.stop()
    nixl_rx.stop()
    import shutil

    shutil.rmtree(pki_dir, ignore_errors=True)
    if proc.returncode:
        sys.exit(f"sender failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT ") :])
    lanes = [x.split("UCX  INFO", 1)[1].strip() for x in (proc.stdout + proc.stderr).splitlines() if "cfg#1" in x]
    n, runs = res["nbytes"], res["runs"]
    # Each round pushes over TCP, then over TLS (the same receiver code): the TCP pushes' phases are every other.
    phases = {k: v[0::2] for k, v in phases.items()}
    assert tcp_store.count == tls_store.count == args.repeat + 1 and nixl_store.count == 2 * (args.repeat + 1)

    out: dict[str, Any] = {
        "bytes": n,
        "MiB": round(n / (1 << 20), 1),
        "layers": LAYERS,
        "page_pools": 2 * LAYERS,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "UCX_TLS": os.environ.get("UCX_TLS", "(unset)"),
        "ucx_lanes": {"nixl": lanes[0] if lanes else None, "nixl_shm": lanes[1] if len(lanes) > 1 else None},
        "sender_digest_GBps": round(n / res["sender_digest_s"] / 1e9, 3),
        # The faster of the two thread settings is the reference.
        "copy_": min(
            ({**summary(t, n), "torch_threads": int(k.split("_")[0])} for k, t in runs["copy_"].items()),
            key=lambda x: x["median_s"],
        ),
        "copy_all": {k: summary(t, n) for k, t in runs["copy_"].items()},
        "tcp": {
            **summary(runs["tcp"], n),
            "receive_and_validate_median_s": round(statistics.median(phases["receive_s"][1:]), 4),
            "digest_median_s": round(statistics.median(phases["digest_s"][1:]), 4),
            # Everything but the receiver's digest check (round 0 is the warm-up).
            "excluding_digest_median_s": round(
                statistics.median(t - d for t, d in zip(runs["tcp"], phases["digest_s"][1:])), 4
            ),
        },
        "tls": summary(runs["tls"], n),
        "receiver_digest_GBps": round(n / statistics.median(phases["digest_s"][1:]) / 1e9, 3),
    }
    for name in ("nixl", "nixl_shm"):
        r = runs[name]
        out[name] = {
            **summary([x["s"] for x in r], n),
            "handshake_median_s": round(statistics.median(x["handshake_s"] for x in r), 4),
            "transfer_median_s": round(statistics.median(x["transfer_s"] for x in r), 4),
            "transfer_median_GBps": round(n / statistics.median(x["transfer_s"] for x in r) / 1e9, 3),
            "commit_median_s": round(statistics.median(x["commit_s"] for x in r), 4),
            # Offer, grant and the WRITEs; the digest check overlaps them and ends in the commit.
            "excluding_digest_median_s": round(statistics.median(x["handshake_s"] + x["transfer_s"] for x in r), 4),
        }
    tcp_med, copy_med = out["tcp"]["median_s"], out["copy_"]["median_s"]
    out["ratios"] = {
        # Recorded, no goal (#21): what TLS (AES-GCM, one core each side) costs against plain TCP.
        "tls_throughput_over_tcp": round(tcp_med / out["tls"]["median_s"], 2),
        "nixl_over_tcp": round(tcp_med / out["nixl"]["median_s"], 2),
        "nixl_over_copy_": round(copy_med / out["nixl"]["median_s"], 2),
        "nixl_shm_over_tcp": round(tcp_med / out["nixl_shm"]["median_s"], 2),
        "nixl_shm_over_copy_": round(copy_med / out["nixl_shm"]["median_s"], 2),
        "nixl_transfer_over_copy_": round(copy_med / out["nixl"]["transfer_median_s"], 2),
        "nixl_shm_transfer_over_copy_": round(copy_med / out["nixl_shm"]["transfer_median_s"], 2),
        "nixl_over_tcp_excluding_digest": round(
            out["tcp"]["excluding_digest_median_s"] / out["nixl"]["excluding_digest_median_s"], 2
        ),
        "nixl_shm_over_tcp_excluding_digest": round(
            out["tcp"]["excluding_digest_median_s"] / out["nixl_shm"]["excluding_digest_median_s"], 2
        ),
    }
    ratios = out["ratios"]
    out["goals"] = {
        "nixl >= 2x tcp (end to end)": ratios["nixl_over_tcp"] >= 2,
        "nixl >= 2x tcp (excluding the digest check)": ratios["nixl_over_tcp_excluding_digest"] >= 2,
        "nixl >= 0.5x copy_ (end to end)": ratios["nixl_over_copy_"] >= 0.5,
        "nixl >= 0.5x copy_ (transfer phase)": ratios["nixl_transfer_over_copy_"] >= 0.5,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
