"""Loading NIXL and starting agents: the only module that touches NIXL's Python API directly.

NIXL is optional: it is imported when a sender or receiver is created, and
its absence raises :class:`NixlUnavailableError` (an ``ImportError``) that
says ``pip install 'hurray-vllm[nixl]'``.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import threading
import uuid
from types import ModuleType
from typing import Any

__all__ = ["NixlError", "NixlUnavailableError", "load_nixl", "make_agent", "INSTALL_HINT", "ERROR_HANDLING_ENV"]

INSTALL_HINT = "pip install 'hurray-vllm[nixl]'"
#: Module names NIXL's Python API is published under (the CUDA 12 wheel first; it runs without CUDA).
_MODULES = ("nixl_cu12", "nixl_cu13", "nixl._api", "nixl")
#: ``ucx_error_handling_mode`` of the UCX backend ("peer", NIXL's default, or "none": see docs/nixl.md).
ERROR_HANDLING_ENV = "HURRAY_NIXL_UCX_ERROR_HANDLING"


class NixlUnavailableError(ImportError):
    """NIXL's Python package is not installed (or does not load)."""


class NixlError(OSError):
    """NIXL or UCX failed (agent creation, registration, a transfer).

    An ``OSError``, like a refused connection: callers that survive an
    unreachable TCP receiver survive this too.
    """


_nixl: ModuleType | None = None
_nixl_lock = threading.Lock()


def load_nixl() -> ModuleType:
    """NIXL's Python API module; raises :class:`NixlUnavailableError` with the install command."""
    global _nixl
    with _nixl_lock:
        if _nixl is not None:
            return _nixl
        tried = []
        for name in _MODULES:
            try:
                mod = importlib.import_module(name)
            except Exception as exc:  # ImportError, or a shared library that does not load
                tried.append(f"{name}: {exc}")
                continue
            if hasattr(mod, "nixl_agent") and hasattr(mod, "nixl_agent_config"):
                # NIXL logs every agent start at INFO on *stdout*; keep stdout for the host program.
                if not os.environ.get("NIXL_LOG_LEVEL"):
                    logging.getLogger("nixl").setLevel(logging.WARNING)
                _nixl = mod
                return mod
            tried.append(f"{name}: no nixl_agent")
        raise NixlUnavailableError(
            f"the NIXL transport needs NIXL, which is not installed: {INSTALL_HINT} "
            f"(or pip install nixl-cu12; it runs on CPU-only machines too). Tried {'; '.join(tried)}"
        )


def make_agent(role: str, backend_params: dict[str, str] | None, progress_thread: bool = False) -> Any:
    """A NIXL agent with the UCX backend.

    Without a progress thread (the default) UCX progresses while the agent is
    polled (transfer states, notifications), which this module does whenever
    a chunk is in flight. NIXL's progress thread spins without pause: it
    would keep a core busy for the life of every agent.
    """
    nixl = load_nixl()
    name = f"hurray-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    params = dict(backend_params or {})
    mode = os.environ.get(ERROR_HANDLING_ENV)
    if mode and "ucx_error_handling_mode" not in params:
        params["ucx_error_handling_mode"] = mode
    try:
        sync = getattr(nixl, "nixl_thread_sync_t", None)
        try:
            conf = nixl.nixl_agent_config(
                enable_prog_thread=progress_thread,
                backends=[],
                sync_mode=sync.NIXL_THREAD_SYNC_STRICT if sync else None,
            )
        except TypeError:  # an older NIXL without sync modes
            conf = nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        agent = nixl.nixl_agent(name, conf)
        agent.create_backend("UCX", params)
    except NixlUnavailableError:
        raise
    except Exception as exc:
        hint = ""
        if os.environ.get("UCX_TLS") is not None and params.get("ucx_error_handling_mode", "peer") == "peer":
            hint = (
                f" (UCX_TLS={os.environ['UCX_TLS']!r}: shared-memory transports need "
                f"{ERROR_HANDLING_ENV}=none, and an empty UCX_TLS selects nothing)"
            )
        raise NixlError(
            f"could not start a NIXL agent with the UCX backend ({type(exc).__name__}: {exc}); "
            f"check UCX_TLS / UCX_NET_DEVICES and the backend parameters{hint}"
        ) from exc
    return agent
