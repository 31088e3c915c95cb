"""``hurray-vllm router``: one OpenAI endpoint over many vLLM servers running ``HurrayConnector``.

Clients talk to the router as to one vLLM server (``/v1/completions``,
``/v1/chat/completions``, streamed or not, ``/v1/models``); the router picks a
backend per request and can move a request between backends while it
streams, with the client's stream going on unchanged:

* **KV-aware routing**: a request goes where the longest prefix of its
  prompt went before, unless that backend is much busier than the others,
  else to the least loaded backend (:mod:`.backends`).
* **Prefill/decode split**: with ``--prefill`` backends, the prompt runs
  there (one token) and decoding continues on a ``--backend``.
* **Live migration** (``POST /hurray/migrate``) and **drain**
  (``POST /hurray/drain``): the source stops, the destination continues
  from the tokens streamed so far and loads their KV (pushed by the source
  or in a shared store), computing only the tail (:mod:`.flight`).
* **Failover**: a backend that dies mid-stream (connection reset, failed
  health checks) has its requests continued elsewhere, loading whatever KV
  reached the destination.
* ``/health``, ``/metrics`` (Prometheus) and ``GET /hurray/requests``.

Example:
    >>> from hurray_vllm.app.router import RouterConfig
    >>> RouterConfig(backends=("http://10.0.0.5:8000",), prefill=("http://10.0.0.7:8000",)).chunk_tokens
    256

Run it with ``hurray-vllm router --listen 0.0.0.0:9000 --backend URL ...``
(``docs/router.md``). Needs FastAPI, uvicorn and aiohttp (in every vLLM
environment; ``pip install hurray-vllm[router]`` otherwise).
"""

from __future__ import annotations

from .server import CONTROL_PURPOSE, Router, RouterConfig, build_app, serve

__all__ = ["CONTROL_PURPOSE", "Router", "RouterConfig", "build_app", "serve"]
