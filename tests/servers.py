"""Processes that tests start: vLLM OpenAI servers and engine runs, started robustly, failures explained.

* A server's port is picked free and then bound by the server, which another
  process can take in between on a busy machine. :func:`start_servers`
  retries with fresh ports when a server dies of "address already in use".
* When a process fails, :func:`root_cause` shows the lines of its log where the
  first error begins, not only the tail (vLLM's tail is its shutdown noise).
* Servers are stopped by their own pid: SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import zygote
from prefetch import engine_slot, fleet_down, fleet_up

T = TypeVar("T")

__all__ = [
    "ROOT",
    "Server",
    "ServerSpec",
    "free_port",
    "receiver_process",
    "root_cause",
    "router_spec",
    "run_engine",
    "side_by_side",
    "start_servers",
    "stop_servers",
    "stream_completion",
    "vllm_server_spec",
]

#: The repository's root (what child processes get as PYTHONPATH).
ROOT = Path(__file__).resolve().parent.parent

#: How long a vLLM server may take to answer /v1/models (a tiny model starts in ~25 s alone,
#: several times that on a busy 2-core machine).
START_DEADLINE_S = 600.0
_IN_USE = re.compile(r"address already in use|EADDRINUSE|Errno 98", re.IGNORECASE)
_FIRST_ERROR = re.compile(r"Traceback \(most recent call last\)|\b\w*(Error|Exception)\b|\bERROR\b")


def free_port() -> int:
    """A port that was free a moment ago (see :func:`start_servers` for the race this leaves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def root_cause(log: str, *, before: int = 3, lines: int = 60, tail: int = 25) -> str:
    """The part of a process's log that says why it failed.

    From a few lines before the first traceback or error line, ``lines`` lines
    on, then the last ``tail`` lines if they are further down.
    """
    rows = log.splitlines()
    first = next((i for i, row in enumerate(rows) if _FIRST_ERROR.search(row)), None)
    if first is None:
        return "\n".join(rows[-(lines + tail) :])
    start = max(0, first - before)
    head = rows[start : start + lines]
    rest = rows[start + lines :]
    out = ([f"[... {start} earlier lines ...]"] if start else []) + head
    if rest:
        skipped = max(0, len(rest) - tail)
        out += ([f"[... {skipped} lines ...]"] if skipped else []) + rest[-tail:]
    return "\n".join(out)


@dataclass(frozen=True)
class ServerSpec:
    """One server to start: its name (for its log), command line and HTTP port."""

    name: str
    cmd: Sequence[str]
    port: int
    env: dict[str, str] | None = None


@dataclass
class Server:
    """A started server: stop it with :func:`stop_servers`."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    #: The fleet (one :func:`start_servers` call) it belongs to: the lanes go on once all of it stopped.
    fleet: list[Server] | None = field(default=None, repr=False, compare=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _spawn(spec: ServerSpec, logdir: Path, attempt: int) -> Server:
    log = logdir / f"{spec.name}.{attempt}.log"
    with open(log, "wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            list(spec.cmd), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=spec.env or os.environ
        )
    return Server(spec.name, proc, spec.port, log)


def descendants(pid: int) -> list[int]:
    """The pids of every process below ``pid`` (a vLLM server's engine core and workers)."""
    import psutil  # vLLM's own dependency

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 9)
        except (ProcessLookupError, PermissionError):
            pass


def kill_server(server: Server) -> None:
    """SIGKILL a server and every process below it, as a machine failure would.

    Killing only the API server's pid leaves its engine core (2 GB) running,
    orphaned, for the rest of the session.
    """
    below = descendants(server.proc.pid)
    server.proc.kill()
    server.proc.wait(timeout=60)
    _kill_pids(below)


def stop_servers(servers: Sequence[Server], grace_s: float = 30.0) -> None:
    """SIGTERM every server (by its pid), wait up to ``grace_s``, SIGKILL what is left, its engine processes too.

    A fleet whose every server has stopped lets the lanes of ``tests/prefetch.py`` go on.
    """
    _stop(servers, grace_s)
    fleets = {id(s.fleet): s.fleet for s in servers if s.fleet is not None}
    for fleet in fleets.values():
        if all(s.proc.poll() is not None for s in fleet):
            for s in fleet:
                s.fleet = None
            fleet_down()


def _stop(servers: Sequence[Server], grace_s: float = 30.0) -> None:
    below = {s.proc.pid: descendants(s.proc.pid) for s in servers if s.proc.poll() is None}
    for s in servers:
        if s.proc.poll() is None:
            s.proc.terminate()
    for s in servers:
        try:
            s.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait(timeout=grace_s)
        _kill_pids(below.get(s.proc.pid, []))  # an engine core a clean shutdown did not take down


def _ready(server: Server) -> bool:
    try:
        with urllib.request.urlopen(f"{server.url}/v1/models", timeout=2):
            return True
    except OSError:
        return False


def start_servers(
    make_specs: Callable[[Callable[[], int]], Sequence[ServerSpec]],
    logdir: Path,
    *,
    deadline_s: float = START_DEADLINE_S,
    attempts: int = 3,
) -> list[Server]:
    """Start servers together and wait until each answers ``/v1/models``.

    Args:
        make_specs: builds the servers' specs given a function that picks a
            free port; called again with fresh ports on a retry, so every port
            a command line names (HTTP, receivers) must come from it.
        logdir: where each server's output goes (``NAME.ATTEMPT.log``).
        deadline_s: how long all of them together may take to start.
        attempts: how many times to start over when one dies of "address in use".

    Returns:
        The running servers, in the order of their specs.
    """
    logdir.mkdir(parents=True, exist_ok=True)
    fleet_up()  # the lanes of tests/prefetch.py take up no further engine chain while a fleet serves
    try:
        return _start_servers(make_specs, logdir, deadline_s, attempts)
    except BaseException:
        fleet_down()
        raise


def _start_servers(
    make_specs: Callable[[Callable[[], int]], Sequence[ServerSpec]], logdir: Path, deadline_s: float, attempts: int
) -> list[Server]:
    for attempt in range(attempts):
        servers = [_spawn(spec, logdir, attempt) for spec in make_specs(free_port)]
        deadline = time.monotonic() + deadline_s
        pending = list(servers)
        try:
            while pending and time.monotonic() < deadline:
                for s in list(pending):
                    if s.proc.poll() is not None:
                        text = s.log_text()
                        if _IN_USE.search(text) and attempt + 1 < attempts:
                            raise _PortTaken(s.name)
                        why = root_cause(text)
                        pytest.fail(f"server {s.name} exited ({s.proc.returncode}) during start-up:\n{why}")
                    elif _ready(s):
                        pending.remove(s)
                if pending:
                    time.sleep(1)
            if pending:
                s = pending[0]
                pytest.fail(f"server {s.name} did not answer within {deadline_s:.0f} s:\n{root_cause(s.log_text())}")
            for s in servers:
                s.fleet = servers
            return servers
        except _PortTaken:
            _stop(servers)
            continue
        except BaseException:
            _stop(servers)
            raise
    raise AssertionError("unreachable: the last attempt fails instead of retrying")


def run_group(cmd: Sequence[str], *, timeout: float, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=...)``, in a process group of its own.

    On a timeout (or any error here) the whole group is SIGKILLed, not only the
    direct child: a vLLM engine's EngineCore and TP workers would outlive it.
    Then ``subprocess.TimeoutExpired`` is raised, as ``subprocess.run`` does.
    A ``python`` command of one process runs forked from a process that
    imported vLLM already (``tests/zygote.py``): the same run, ~9 s of CPU
    sooner.
    """
    if zygote.takes(cmd, env):
        return zygote.run(cmd, timeout=timeout, env=env)
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env), start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc``'s process group (it leads one: ``start_new_session``)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group has ended already
        pass


def readline_within(proc: subprocess.Popen[str], timeout: float, what: str, log: Path | None = None) -> str:
    """``proc``'s first line of output, read for at most ``timeout`` seconds.

    A process that prints nothing (a hung start) is killed, and the test fails
    with its stderr (``log``, where it writes it) instead of hanging the suite.
    """
    assert proc.stdout is not None
    stdout = proc.stdout
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not got:
        proc.kill()
        proc.wait(timeout=30)
        reader.join(30)  # the pipe's end closed with the process
        if log is not None:
            err = root_cause(log.read_text()) if log.exists() else ""
        else:
            err = proc.stderr.read()[-3000:] if proc.stderr is not None else ""
        pytest.fail(f"{what} printed nothing in {timeout:.0f} s (killed):\n{err}")
    return got[0]


@contextmanager
def receiver_process(store: Path, log: Path, transport: str = "tcp") -> Iterator[str]:
    """``hurray-vllm receive`` into ``store`` in a process of its own; yields its URL (``tcp://127.0.0.1:PORT``).

    The receiver binds a free port itself and prints it, so no other process
    can take it in between. Stopped by its pid on exit (SIGTERM, then SIGKILL);
    its output is in ``log``.
    """
    cmd = [sys.executable, "-m", "hurray_vllm.app.cli", "receive", "--listen", "127.0.0.1:0", "--dir", str(store)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*cmd, "--transport", transport],
            stdout=subprocess.PIPE,
            stderr=out,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    try:
        # "receiving KV chunks (tcp) on 127.0.0.1:PORT into DIR"
        line = readline_within(proc, 120, "hurray-vllm receive", log)
        if " on " not in line:
            proc.wait(timeout=30)
            pytest.fail(f"hurray-vllm receive did not start ({proc.returncode}):\n{root_cause(log.read_text())}")
        port = int(line.split(" on ")[1].split()[0].rsplit(":", 1)[1])
        yield f"{transport}://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def vllm_server_spec(
    tmp: Path,
    name: str,
    port: int,
    block_size: int,
    extra: dict[str, object],
    *,
    tokenizer: bool = False,
    async_scheduling: bool = False,
) -> ServerSpec:
    """vLLM's OpenAI server on ``tmp / "model"`` with a HurrayConnector of ``extra`` (prefix caching on).

    ``tokenizer``: the model has one (chat completions, text); else token-id prompts only.
    ``async_scheduling``: vLLM's asynchronous scheduling (its default on GPUs), through
    ``tests/patched_server.py`` (the CPU platform turns it off otherwise).
    """
    kv = {
        "kv_connector": "HurrayConnector",
        "kv_connector_module_path": "hurray_vllm.adapters.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    server = [str(Path(__file__).resolve().parent / "patched_server.py")] if async_scheduling else [
        "-m", "vllm.entrypoints.openai.api_server"]  # fmt: skip
    cmd = [
        sys.executable, *server,
        *(["--async-scheduling"] if async_scheduling else []),
        "--model", str(tmp / "model"), "--enforce-eager", "--dtype", "bfloat16",
        "--max-model-len", "1024", "--block-size", str(block_size),  # prefix caching on: the default
        "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(kv),
        *([] if tokenizer else ["--skip-tokenizer-init"]),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    return ServerSpec(name, cmd, port, env)


def router_spec(
    name: str, port: int, backends: Sequence[str], *, prefill: Sequence[str] = (), chunk_tokens: int = 64
) -> ServerSpec:
    """``hurray-vllm router`` on 127.0.0.1:``port`` over ``backends`` (health checks every half second)."""
    cmd = [sys.executable, "-m", "hurray_vllm.app.cli", "router", "--listen", f"127.0.0.1:{port}"]
    cmd += [a for b in backends for a in ("--backend", b)] + [a for b in prefill for a in ("--prefill", b)]
    cmd += ["--chunk-tokens", str(chunk_tokens), "--health-interval", "0.5", "--log-level", "info"]
    return ServerSpec(name, cmd, port, {**os.environ, "PYTHONPATH": str(ROOT)})


def stream_completion(
    base: str,
    body: dict[str, Any],
    on_tokens: Callable[[list[int]], None] | None = None,
    *,
    path: str = "/v1/completions",
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Stream one request from ``base`` (a router or a server) and collect it.

    Returns ``{"ids": [...], "token_ids": [...], "text": "...", "finish_reason": ..., "usage": ..., "events": n}``;
    ``on_tokens`` sees the token ids received so far after each event (from this thread). An ``error`` event
    fails the test.
    """
    import httpx

    out: dict[str, Any] = {"ids": set(), "token_ids": [], "text": "", "finish_reason": None, "usage": None, "events": 0}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    with httpx.stream("POST", base + path, json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            out["ids"].add(ev["id"])
            out["events"] += 1
            if not ev.get("choices"):
                out["usage"] = ev.get("usage")
                continue
            c = ev["choices"][0]
            out["token_ids"].extend(c.get("token_ids") or [])
            out["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            out["finish_reason"] = c.get("finish_reason") or out["finish_reason"]
            if on_tokens is not None:
                on_tokens(out["token_ids"])
    return out


class _PortTaken(Exception):
    """A server lost its port to another process between picking and binding: start over."""


def _engine_command(tmp: Path, name: str, cfg: dict[str, Any], *, native_rope: bool = False) -> list[str]:
    """Write ``NAME.json`` (``cfg`` over ``tmp / "model"``); the command that runs it into ``NAME.out``.

    ``native_rope``: through ``tests/patched_generate.py`` (MLA models: see ``vllm_patches``), as is
    an engine whose ``cfg`` asks for ``async_scheduling``.
    """
    (tmp / f"{name}.json").write_text(json.dumps({"model": str(tmp / "model"), **cfg, "native_rope": native_rope}))
    if native_rope or cfg.get("async_scheduling"):
        generate = [sys.executable, str(Path(__file__).resolve().parent / "patched_generate.py")]
    else:
        generate = [sys.executable, "-m", "hurray_vllm.adapters.vllm._generate"]
    return [*generate, str(tmp / f"{name}.json"), str(tmp / f"{name}.out")]


def kill_engine_when(
    tmp: Path,
    name: str,
    block_size: int,
    extra: dict[str, Any],
    prompts: dict[str, list[int]],
    when: Callable[[], bool],
    timeout_s: float = 600.0,
) -> bool:
    """Run an offline engine as :func:`run_engine` does, and SIGKILL it (its whole process group) once ``when()``.

    ``when`` is polled every few milliseconds. Returns True if the engine was
    killed, False if it finished first.
    """
    cmd = _engine_command(
        tmp, name, {"block_size": block_size, "connector": extra, "prompts": prompts, "max_tokens": 8}
    )
    with engine_slot():
        with open(tmp / f"{name}.log", "w") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=log, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if when():
                    os.killpg(proc.pid, 9)
                    proc.wait(timeout=60)
                    return True
                time.sleep(0.003)
            if proc.poll() is None:
                pytest.fail(f"engine {name} neither finished nor met its kill condition in {timeout_s:.0f} s")
            return False
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=60)


def side_by_side(jobs: Mapping[str, Callable[[], T]]) -> dict[str, T]:
    """Run independent engine runs at the same time, as many as the machine has cores; their results by name.

    Why: an offline TP = 1 engine computes on one thread (vLLM sets torch's
    threads to 1), and most of its ~12 s is Python importing vLLM, so two
    side by side on CI's 2 cores take the wall time of one. The arithmetic,
    and so every token and byte, is that of a run alone. Only for runs that
    share nothing one of them writes while another reads. A TP = 2 engine
    binds a rank to each core, but its three processes leave the cores idle
    for much of its start: a TP = 1 run beside it takes that time (two TP = 2
    engines side by side would only compete). The first failure is raised
    once every run has ended.

    Example:
        >>> out = side_by_side({"a": lambda: 1, "b": lambda: 2})
        >>> out["b"]
        2
    """
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
    return {name: future.result() for name, future in futures.items()}


def run_engine(
    tmp: Path,
    name: str,
    block_size: int,
    extra: dict[str, Any] | None,
    prompts: dict[str, list[int]],
    max_tokens: int | dict[str, int] = 8,
    *,
    sequential: bool = False,
    prefix_caching: bool = True,
    speculative: dict[str, Any] | None = None,
    role: str = "kv_both",
    salts: dict[str, str] | None = None,
    engine: dict[str, Any] | None = None,
    native_rope: bool = False,
) -> dict[str, Any]:
    """Run one offline vLLM engine over ``prompts`` in a subprocess (``tmp / "model"``, greedy).

    Args:
        tmp: holds the model (``model/``) and gets ``NAME.json`` / ``NAME.out``.
        name: names the run's files.
        block_size: the engine's block size.
        extra: ``kv_connector_extra_config`` of a ``HurrayConnector``, or None for no connector.
        prompts: request id -> prompt token ids.
        max_tokens: tokens to generate (per request id, or for all).
        sequential: run the requests one after the other (a later one can hit an earlier one's
            prefix in vLLM's own prefix cache).
        prefix_caching: vLLM's prefix cache (on by default, as in vLLM).
        speculative: vLLM's ``speculative_config`` (none by default).
        role: the connector's ``kv_role``.
        salts: request id -> its prompt's ``cache_salt``.
        engine: more of ``_generate``'s settings (``max_model_len``, ``num_blocks``).
        native_rope: vLLM's PyTorch rotary embeddings (an MLA model: see ``vllm_patches``).

    Returns:
        The run's outputs, vLLM counters and connector statistics, plus its ``log``.
    """
    cfg = {
        "block_size": block_size,
        "connector": extra,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "stats": True,
        "sequential": sequential,
        "prefix_caching": prefix_caching,
        "speculative": speculative,
        "role": role,
        "salts": salts or {},
        **(engine or {}),
    }
    with engine_slot():
        proc = run_group(
            _engine_command(tmp, name, cfg, native_rope=native_rope),
            timeout=900,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    if proc.returncode:
        pytest.fail(f"engine {name} failed:\n{root_cause(proc.stderr)}")
    result: dict[str, Any] = json.loads((tmp / f"{name}.out").read_text())
    result["log"] = proc.stderr
    return result
