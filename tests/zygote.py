"""One-process engine runs forked from a process that imported vLLM once, instead of each importing it again.

An offline TP = 1 engine run of the tests (``python -m
hurray_vllm.adapters.vllm._generate``, ``tests/*_run.py``) spends about 9.5 of
its ~13 s of CPU importing torch and vLLM, the same modules every time. The
suite starts dozens of them on CI's two cores. :func:`run` starts such a
command as a child of a *fork server* (``multiprocessing``'s ``forkserver``)
that imported those modules once: the child starts with them in memory and
only runs the command's own code, as ``python`` would (its ``argv``,
environment, working directory, ``sys.path``, ``__main__``), with its output
in files.

What it does not change: each engine still runs alone in its own process (a
fresh fork: no state of an earlier run), in its own session (killed as a
group), and its arithmetic is what the same command computes started from a
shell. What is imported once is only what every such run imports first and
reads no setting of the run at import time (see :data:`PRELOAD`).

Multi-rank engines are not run here: their ranks are processes vLLM spawns
(``spawn`` re-imports everything anyway). Neither are servers. Set
``HURRAY_TEST_ZYGOTE=0`` to run every command as a plain subprocess.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["enabled", "run", "takes"]

#: Imported once, in the fork server: what every engine run imports first. Nothing of ``hurray_vllm`` (it reads
#: its settings, e.g. ``HURRAY_VLLM_NATIVE``, at import) and no model's module (imported as the run builds it).
PRELOAD = ["torch", "vllm", "vllm.v1.engine.llm_engine", "vllm.entrypoints.llm"]

_lock = threading.Lock()
_context: Any = None
_base_path: list[str] | None = None


def enabled() -> bool:
    """Whether engine runs go through the fork server (``HURRAY_TEST_ZYGOTE`` is not ``0``; Linux)."""
    return os.environ.get("HURRAY_TEST_ZYGOTE", "1") != "0" and sys.platform == "linux"


def takes(cmd: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether :func:`run` runs ``cmd``: ``python -m M`` or ``python SCRIPT``, one process (no ranks bound to cores)."""
    one_rank = "|" not in env.get("VLLM_CPU_OMP_THREADS_BIND", "")
    return enabled() and len(cmd) >= 2 and cmd[0] == sys.executable and cmd[1] != "-c" and one_rank


def _ctx() -> tuple[Any, list[str]]:
    """The fork server's context, and the ``sys.path`` a plain ``python`` has after its first entry."""
    global _context, _base_path
    with _lock:
        if _context is None:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            probe = [sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"]
            _base_path = json.loads(subprocess.run(probe, capture_output=True, text=True, env=env, check=True).stdout)
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _context = ctx
        assert _base_path is not None
        return _context, _base_path


def _child(argv: list[str], env: dict[str, str], cwd: str, base: list[str], out: str, err: str) -> None:
    """Run ``argv`` (``python X ...``) in this fresh fork as the interpreter would; exit with its status."""
    os.setsid()  # a group of its own, as start_new_session: killed whole on a timeout
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # the process's own streams, on its new fds
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            sys.path[:] = [cwd, *extra, *base]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            script = str(Path(argv[1]).resolve())
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:] = [str(Path(script).parent), *extra, *base]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # as the interpreter does at exit (vLLM shuts its engine down there)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(cmd: Sequence[str], *, timeout: float, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """``servers.run_group(cmd, timeout=..., env=...)`` through the fork server: ``cmd`` is ``python ...``.

    Raises ``subprocess.TimeoutExpired`` after killing the run's process group, as ``run_group`` does.
    """
    cmd = list(cmd)
    with tempfile.TemporaryDirectory(prefix="zygote-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        ctx, base = _ctx()
        proc = ctx.Process(target=_child, args=(cmd, dict(env), os.getcwd(), base, out, err), daemon=False)
        proc.start()
        try:
            proc.join(timeout)
            timed_out = proc.exitcode is None
            if timed_out:
                _kill(proc)
        except BaseException:
            _kill(proc)
            raise
        text = [Path(p).read_text(errors="replace") if os.path.exists(p) else "" for p in (out, err)]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=text[0], stderr=text[1])
    code = proc.exitcode if proc.exitcode is not None else -9
    return subprocess.CompletedProcess(cmd, code, text[0], text[1])


def _kill(proc: Any) -> None:
    """SIGKILL the run's process group (it leads one), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.join(60)
