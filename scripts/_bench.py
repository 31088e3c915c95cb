"""Helpers the benchmark scripts share: progress logging, machine facts, memory probes, malloc pinning.

The scripts import it as ``_bench`` (they run as ``python scripts/bench_*.py``,
which puts this folder first on ``sys.path``).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

__all__ = [
    "MALLOC_ENV",
    "cpu_name",
    "free_page_reporting",
    "git_state",
    "log",
    "machine",
    "pin_malloc",
    "reset_hwm",
    "status_kib",
]

#: glibc's mmap threshold, pinned by :func:`pin_malloc`.
MALLOC_ENV = "MALLOC_MMAP_THRESHOLD_"


def log(msg: str) -> None:
    """Progress on stderr (stdout carries the JSON result)."""
    print(msg, file=sys.stderr, flush=True)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine(**extra: object) -> dict[str, object]:
    """The JSON ``machine`` entry every benchmark reports, plus ``extra`` (load averages...)."""
    import torch  # late: this module is also imported where torch is not needed

    return {
        "cores": os.cpu_count(),
        "cpu": cpu_name(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "malloc_mmap_threshold": os.environ.get(MALLOC_ENV),
        "free_page_reporting": free_page_reporting(),
        **extra,
    }


def free_page_reporting() -> bool:
    """Whether this is a VM that hands free memory back to its host (a virtio balloon with page reporting).

    There, memory the guest has not used for a moment is backed again by the
    host on its next use: a new page (a fresh allocation, a file's new page
    cache) costs ~2.5 ms per MiB on machine A', against ~0.3 ms on a page
    used a moment ago. Figures that allocate or write new files carry that.
    """
    for dev in Path("/sys/bus/virtio/devices").glob("*"):
        try:
            if (dev / "device").read_text().strip() == "0x0005":  # virtio balloon
                bits = (dev / "features").read_text().strip()
                return len(bits) > 5 and bits[5] == "1"  # VIRTIO_BALLOON_F_REPORTING
        except OSError:
            continue
    return False


def git_state() -> str:
    """The checkout's short commit, marked when the working tree has uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
        return rev.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def pin_malloc(script: str) -> None:
    """Re-run ``script`` (the caller's ``__file__``) with glibc's mmap threshold fixed at 128 KiB.

    By default glibc raises the threshold after a large block is freed, so
    a later 16 MiB buffer may be served from already-faulted heap memory
    while a 256 MiB one never is: an operation would then be 2-4x faster or
    not depending on what the previous contender freed. A fixed threshold
    puts every large buffer in freshly mapped memory, as in a fresh process.
    An explicit setting in the environment is respected.
    """
    if MALLOC_ENV in os.environ:
        return
    env = dict(os.environ, **{MALLOC_ENV: str(128 << 10)})
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(script), *sys.argv[1:]], env)


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``...), or -1."""
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) if m else -1


def reset_hwm() -> bool:
    """Reset the RSS high-water mark (``VmHWM``); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
