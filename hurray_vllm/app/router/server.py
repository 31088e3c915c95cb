"""The router's HTTP server: OpenAI endpoints in front of vLLM servers, and the ``/hurray/*`` controls.

Built on what vLLM's own server uses (FastAPI on uvicorn, aiohttp to the
backends), asyncio throughout: no thread per request. See
:mod:`hurray_vllm.app.router` for what it does and ``docs/router.md`` for
how to run it.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations (``request: Request``)
# at run time, and ``Request`` is imported inside build_app.
import asyncio
import contextlib
import functools
import gc
import hashlib
import hmac
import json
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str  # what json.dumps does to a str
from typing import Any

# BACKEND_API_KEY_ENV: the backends' API key when the config gives none (``--backend-api-key``). It lives with
# migrate(), which sends the same key to the same servers, because adapters must not import the app layer.
from ...adapters.vllm.migrate import BACKEND_API_KEY_ENV
from ...transport.base import host_port
from .backends import KV_LOAD_SLACK, Backend, Backends, prompt_keys
from .flight import MAX_FAILOVERS, MOVE_TIMEOUT_S, Delta, Flight, RouterError, UpstreamError, flag, movable, sse_data
from .metrics import Metrics

__all__ = ["API_KEY_ENV", "BACKEND_API_KEY_ENV", "CONTROL_PURPOSE", "Router", "RouterConfig", "build_app", "serve"]

#: The environment variable the router's own API key is read from when the config gives none (``--api-key``):
#: vLLM's ``VLLM_API_KEY`` under this project's prefix, as :data:`BACKEND_API_KEY_ENV` (a router next to
#: engines that read ``VLLM_API_KEY`` does not take their key for its clients' by accident).
API_KEY_ENV = "HURRAY_API_KEY"

#: The purpose of the fleet-key tokens that open ``/hurray/*`` (:meth:`~hurray_vllm.chunks.signing.FleetKeys.tokens`).
CONTROL_PURPOSE = "router-control"

log = logging.getLogger("hurray_vllm.router")


@dataclass(frozen=True)
class RouterConfig:
    """How the router runs (``hurray-vllm router``'s options).

    Attributes:
        backends: base URLs of the vLLM servers that decode (and, without
            ``prefill``, also run prompts).
        prefill: base URLs of the servers that run prompts only (P/D split).
        chunk_tokens: tokens per prefix key of KV-aware routing (match the
            engines' ``hurray_chunk_tokens``).
        health_interval: seconds between health checks of every backend.
        connect_timeout: seconds to open a connection to a backend.
        stream_timeout: seconds a backend may stay silent before its request
            is continued elsewhere (and the backend marked down). It also
            bounds the wait for a stream's first token (the backend's queue
            and the prompt's prefill) and for a whole non-streamed answer
            (relayed unmoved, or a prefill leg): set it above the longest
            of those, or busy backends are taken for dead ones.
        policy: how a new request picks its backend (:data:`~.backends.POLICIES`).
        kv_load_slack: with ``policy="kv"``, a request goes where its prefix
            went before only while that backend has at most this many more
            requests in flight than the least loaded one
            (:data:`~.backends.KV_LOAD_SLACK`).
        backend_api_key: sent as ``Authorization: Bearer KEY`` on every
            request to a backend (vLLM's ``--api-key``); ``None``: read from
            :data:`BACKEND_API_KEY_ENV`, and without it none is sent.
        control_tokens: bearer tokens accepted on ``/hurray/*`` (any of them;
            :data:`CONTROL_PURPOSE` tokens of the fleet keys); empty: the
            controls are open to whoever reaches the router.
        api_keys: the keys clients must send as ``Authorization: Bearer KEY``
            on ``/v1/*`` (any of them; vLLM's ``--api-key``); empty: read
            from :data:`API_KEY_ENV`, and without it ``/v1/*`` is open.
            ``/health``, ``/metrics`` and ``/hurray/*`` never take them.
    """

    backends: tuple[str, ...]
    prefill: tuple[str, ...] = ()
    chunk_tokens: int = 256
    health_interval: float = 2.0
    connect_timeout: float = 10.0
    stream_timeout: float = 600.0
    policy: str = "kv"
    control_tokens: tuple[str, ...] = field(default=(), repr=False)
    kv_load_slack: int = KV_LOAD_SLACK
    backend_api_key: str | None = field(default=None, repr=False)
    api_keys: tuple[str, ...] = field(default=(), repr=False)


class Router:
    """The router's state: backends, flights in progress, metrics, the HTTP client to the backends."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.backends = Backends(config.backends, config.prefill, config.policy, config.kv_load_slack)
        self.metrics = Metrics()
        self.flights: dict[str, Flight] = {}
        # Requests relayed unmoved (see movable()): listed and reported by a drain, never moved.
        self.relayed: dict[str, Relayed] = {}
        self._rechecks: dict[str, asyncio.Future[bool]] = {}  # a down backend's check under way (_recheck)
        self._rechecked: dict[str, float] = {}  # when each was last checked that way
        self.recent: deque[dict[str, Any]] = deque(maxlen=256)
        self.client: Any = None
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Open the HTTP client and start the health checks (called by the server at start-up)."""
        import aiohttp

        # aiohttp rather than httpx to the backends: its C HTTP parser takes about half the CPU per streamed
        # event (measured: the router's CPU per event is what competes with the engines).
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.config.connect_timeout, sock_read=self.config.stream_timeout
        )
        # Session headers go with every request to a backend (legs, warm-ups, health checks, /v1/models), also
        # with those that pass a timeout of their own.
        key = self.config.backend_api_key or os.environ.get(BACKEND_API_KEY_ENV) or None
        headers = {"Authorization": f"Bearer {key}"} if key else None
        self.client = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0), headers=headers)
        self._watch = asyncio.create_task(self._health(), name="router health checks")

    async def stop(self) -> None:
        """Stop the health checks and close the client."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.client is not None:
            await self.client.close()

    async def _health(self) -> None:
        """Check the backends; move the requests of one found dead at once (a hung backend breaks no stream)."""
        interval = self.config.health_interval
        # A busy backend may take a moment to answer: a short interval must not make it look dead.
        patience = max(interval, 2.0)
        while True:
            before = {b.url: b.healthy for b in self.backends.all.values()}
            results = await asyncio.gather(
                *(self.backends.check(self.client, b, patience) for b in self.backends.all.values())
            )
            for b, ok in zip(self.backends.all.values(), results):
                if ok:
                    self.backends.mark_up(b)
                    continue
                b.failures += 1
                if b.failures >= 2:
                    b.healthy = False
                if not b.healthy:
                    if before[b.url]:
                        log.warning("router: backend %s failed %d health checks", b.url, b.failures)
                    # Also when it was marked down before (a stream of it broke): its other streams wait on it
                    # until the stream timeout otherwise. fail_over() passes over a request already moving on.
                    self.abandon(b, "failed its health checks")
            await asyncio.sleep(interval)

    def abandon(self, backend: Backend, why: str) -> None:
        """Take every request off ``backend``, found dead (``why``).

        Flights continue elsewhere; relayed requests end with an error, or,
        before their answer came, are sent to another backend.
        """
        for f in list(self.flights.values()):
            if f.backend is backend:
                f.fail_over()
        for r in list(self.relayed.values()):
            if r.backend is backend:
                r.cut(why)

    async def pick(
        self,
        keys: list[str],
        *,
        model: object = None,
        prefill: bool = False,
        exclude: Sequence[Backend] = (),
    ) -> Backend | None:
        """:meth:`Backends.pick`; when no backend of that kind is healthy, check the others once more first.

        A backend marked down (two failed health checks, or a stream that
        broke) may be back before the next periodic check: one that just
        restarted, or every backend of a router started before them. Also
        when the only healthy ones do not serve ``model``.
        """
        b = self.backends.pick(keys, model=model, prefill=prefill, exclude=exclude)
        if b is not None and b.serves(model):
            return b
        down = [
            x
            for x in self.backends.all.values()
            if x.prefill == prefill and not x.healthy and all(x is not e for e in exclude)
        ]
        if not down:
            return b
        await asyncio.gather(*(self._recheck(x) for x in down))
        return self.backends.pick(keys, model=model, prefill=prefill, exclude=exclude)

    @property
    def patience(self) -> float:
        """Seconds a health check, or a question of the same kind (``/v1/models``), waits for a backend."""
        return max(self.config.health_interval, 2.0)

    async def serves(self, backend: Backend, model: object) -> bool:
        """:meth:`Backend.serves`, asking ``backend``'s ``/v1/models`` once more before saying no.

        What it serves was read once (the first health check): an adapter
        loaded there since is found before a move is refused for it.
        """
        if backend.serves(model):
            return True
        await self.backends.read_models(self.client, backend, self.patience)
        return backend.serves(model)

    async def _recheck(self, backend: Backend) -> bool:
        """A health check of a backend marked down, now; True (and marked healthy) if it answers.

        Requests that arrive together share one check, and a backend checked
        this way within the health interval is not checked again: a hung
        backend costs the requests one check's wait, not one each.
        """
        task = self._rechecks.get(backend.url)
        if task is None:
            if time.monotonic() - self._rechecked.get(backend.url, -1e9) < self.config.health_interval:
                return backend.healthy
            task = asyncio.ensure_future(self.backends.check(self.client, backend, self.patience))
            self._rechecks[backend.url] = task
            task.add_done_callback(lambda _: self._rechecks.pop(backend.url, None))
        ok = await asyncio.shield(task)
        self._rechecked[backend.url] = time.monotonic()
        if ok:
            self.backends.mark_up(backend)
        return bool(ok)

    def begin(self, kind: str, body: dict[str, Any]) -> Flight:
        """A new flight, registered."""
        f = Flight(self, kind, body)
        self.flights[f.id] = f
        return f

    def end(self, f: Flight) -> None:
        """Forget a flight (keep its summary in ``recent``); once, however many times it is called."""
        if self.flights.pop(f.id, None) is not None:
            self.recent.append({**f.describe(), "finish_reason": f.finish_reason, "cached_tokens": f.cached_tokens})

    def backend(self, url: Any, field: str) -> Backend:
        """The backend named by a control request's ``field``; :class:`RouterError` 400 otherwise."""
        b = self.backends.get(url) if isinstance(url, str) else None
        if b is None:
            known = ", ".join(b.url for b in self.backends.all.values())
            raise RouterError(400, f"{field}: {url!r} is not one of this router's backends ({known})")
        return b

    async def migrate(self, flight_id: Any, to: Any) -> dict[str, Any]:
        """``POST /hurray/migrate``."""
        f = self.flights.get(flight_id) if isinstance(flight_id, str) else None
        if f is None:
            relayed = self.relayed.get(flight_id) if isinstance(flight_id, str) else None
            if relayed is not None:
                raise RouterError(409, f"request {relayed.id} cannot be moved: {relayed.why}")
            raise RouterError(404, f"id: no request {flight_id!r} in flight")
        dest = self.backend(to, "to")
        if dest.prefill:
            raise RouterError(409, f"to: {dest.url} is a prefill backend")
        if not dest.healthy and not await self._recheck(dest):
            raise RouterError(503, f"to: {dest.url} fails its health checks")
        if dest.draining:
            raise RouterError(409, f"to: {dest.url} is drained")
        if not await self.serves(dest, f.model):  # it would answer the warm-up 404: an adapter loaded elsewhere only
            served = ", ".join(sorted(dest.served))
            raise RouterError(409, f"to: {dest.url} does not serve model {f.model!r} (its /v1/models lists {served})")
        return await f.migrate(dest)

    async def drain(self, url: Any) -> dict[str, Any]:
        """``POST /hurray/drain``: no new requests there; move every request off it."""
        b = self.backend(url, "backend")
        b.draining = True
        # Also a request whose move away from it switched and has not settled: its destination may fail before its
        # first token, and the request then comes back (Flight.pending_from); the drain waits for that move too.
        moving = [f for f in self.flights.values() if f.backend is b or f.pending_from is b]
        moved: list[str] = []
        failed: list[dict[str, Any]] = []

        async def move(f: Flight) -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + MOVE_TIMEOUT_S
            tried: list[Backend] = []  # destinations that could not take it: another may (a drain of one, say)
            last = ""  # why the last of them could not
            others = 0  # times another move of it, under way, refused this drain's
            while True:
                # A move under way (a client's /hurray/migrate) settles first: it takes the request off, or
                # fails (a destination drained meanwhile refuses it) and this drain moves it after all.
                while f.moving and not f.finished:
                    if loop.time() > deadline:  # its switch waits for a client that does not read
                        failed.append({"id": f.id, "error": "a move of it has not settled: its client is not reading"})
                        return
                    await asyncio.sleep(0.05)
                if f.ended:
                    return  # finished meanwhile: nothing left on the backend
                if f.backend is not b:
                    moved.append(f.id)
                    return
                if b.prefill:
                    # In its prefill leg, which is not moved (Flight.migrate): it leaves for a decode backend when
                    # that one short answer ends. Waited for, as a move's switch is.
                    while f.backend is b and not f.ended:
                        if loop.time() > deadline:
                            why = f"still in its prefill leg after {MOVE_TIMEOUT_S:.0f} s (its client is not reading)"
                            failed.append({"id": f.id, "error": why})
                            return
                        await asyncio.sleep(0.05)
                    continue
                if loop.time() > deadline:
                    why = f"not moved within {MOVE_TIMEOUT_S:.0f} s" + (
                        f" (the last destination: {last})" if last else ""
                    )
                    failed.append({"id": f.id, "error": why})
                    return
                dest = await self.pick(f.keys, model=f.model, exclude=[b, *tried])
                if dest is None:
                    why = "no other healthy, undrained backend" + (f" (the last destination: {last})" if last else "")
                    failed.append({"id": f.id, "error": why})
                    return
                if not await self.serves(dest, f.model):  # pick() falls back to any backend: this one would answer 404
                    failed.append({"id": f.id, "error": f"no other healthy, undrained backend serves {f.model!r}"})
                    return
                try:
                    await f.migrate(dest, why="drained", timeout=max(1.0, deadline - loop.time()))
                    moved.append(f.id)
                    return
                except RouterError as exc:
                    if f.ended:  # finished, or its backend sent the finish (a slow client reads on): nothing to move
                        return
                    if f.backend is not b and f.backend is not None:  # failed over meanwhile: off it all the same
                        moved.append(f.id)
                        return
                    # 504: the switch waits for a client that does not read (it moves once that client reads).
                    if exc.status == 504:
                        failed.append({"id": f.id, "error": exc.message})
                        return
                    if exc.status == 502 or dest.draining or not dest.healthy:
                        # The destination could not take it (its warm-up failed, it was drained or found dead
                        # meanwhile, it failed before its first token) and the request is still here: another may.
                        tried.append(dest)
                        last = exc.message
                        continue
                    if not f.moving and "being moved already" not in exc.message:
                        failed.append({"id": f.id, "error": exc.message})
                        return
                    others += 1
                    if others >= 2:
                        failed.append({"id": f.id, "error": "another move of it kept it on the drained backend"})
                        return
                    await asyncio.sleep(0.05)  # a failover under way refuses moves too: it runs meanwhile

        await asyncio.gather(*(move(f) for f in moving))
        # Requests that cannot move finish where they are; the operator learns which, and why.
        failed += [{"id": r.id, "error": f"not movable: {r.why}"} for r in self.relayed.values() if r.backend is b]
        return {"backend": b.url, "moved": sorted(moved), "failed": failed}

    def undrain(self, url: Any) -> dict[str, Any]:
        """``POST /hurray/undrain``."""
        b = self.backend(url, "backend")
        b.draining = False
        return {"backend": b.url, "draining": False}


@functools.cache
def _streamed_class() -> type:
    """:class:`starlette.responses.StreamingResponse` with an end hook (made on first use: fastapi is optional)."""
    from starlette.responses import StreamingResponse

    class Streamed(StreamingResponse):
        def __init__(self, content: Any, ended: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
            super().__init__(content, **kwargs)
            self._ended = ended

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self._ended()

    return Streamed


def _streamed(content: Any, ended: Callable[[], Awaitable[None]], **kwargs: Any) -> Any:
    """A streamed answer whose ``ended`` runs once it is over, however it ends.

    Starlette runs a streaming body in a task it cancels when the client
    goes away, before the body's generator ever started if the client left
    early: a ``finally`` in the generator then never runs. What a request
    holds (its backend's in-flight count, its flight or relay record, its
    upstream stream) is let go in ``ended`` instead.
    """
    return _streamed_class()(content, ended, **kwargs)


def _carries_text(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice carries generated text (a chat delta's role alone does not; a parser's fields do)."""
    if "text" in choice:
        return bool(choice["text"])
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(v for k, v in delta.items() if k != "role")


@dataclass
class Relayed:
    """A request relayed to one backend as it comes (:func:`~.flight.movable` says why): listed, never moved."""

    id: str
    backend: Backend
    why: str
    # The prompt's length when it is token ids; else what the backend's events say, once one does (count()).
    prompt_tokens: int | None
    token_ids: bool = False  # the client asked for return_token_ids: the events carry the generated tokens' ids
    generated_tokens: int = 0  # tokens relayed so far (count())
    # What its handler waits on, for cut(): the POST until its answer's headers come, then the answer.
    waiting: asyncio.Future[Any] | None = field(default=None, repr=False)
    upstream: Any = field(default=None, repr=False)
    dead: str | None = None  # why its backend was found dead (cut)
    # Per choice index its events showed (count()): whether that choice's finish came. Once every one's has,
    # the request is complete: a backend that breaks off (or is found dead) after that ends it cleanly.
    choices: dict[int, bool] = field(default_factory=dict, repr=False)

    @property
    def finished(self) -> bool:
        """Whether every choice its events showed has its finish reason (and one did): the client has its end."""
        return bool(self.choices) and all(self.choices.values())

    def cut(self, why: str) -> None:
        """Its backend was found dead: end the wait for it now rather than after the stream timeout.

        Before the answer's headers nothing reached the client: the handler
        tries another backend. After them, the relay ends with an error event
        (a stream) or an error body, as for a stream that breaks off; a
        stream whose every choice has finished (:attr:`finished`) ends with
        ``[DONE]`` alone, as it would have.
        """
        if self.dead is not None:
            return
        self.dead = why
        if self.upstream is not None:
            self.upstream.content.set_exception(UpstreamError(why))  # wakes the relay's read with it
        elif self.waiting is not None:
            self.waiting.cancel()

    def count(self, event: dict[str, Any]) -> None:
        """Count what one of its events (streamed, or a whole answer) says of its prompt and generated tokens.

        The token ids, where the request asked for them; else one token per
        choice that carries text (vLLM streams a token an event, and its
        first chat event, the role, carries none). A ``usage`` (a whole
        answer's, a stream's last or continuous one) is the backend's own count
        and replaces both; the prompt is otherwise counted from the first
        event that carries its token ids.
        """
        choices = event.get("choices")
        choices = [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []
        if self.prompt_tokens is None:
            prompt = event.get("prompt_token_ids")
            prompt = next((c.get("prompt_token_ids") for c in choices if c.get("prompt_token_ids")), prompt)
            if isinstance(prompt, list):
                self.prompt_tokens = len(prompt)
        for c in choices:
            index = c.get("index") if type(c.get("index")) is int else 0
            self.choices[index] = self.choices.get(index, False) or c.get("finish_reason") is not None
            if self.token_ids:
                ids = c.get("token_ids")
                self.generated_tokens += len(ids) if isinstance(ids, list) else 0
            elif _carries_text(c):
                self.generated_tokens += 1
        usage = event.get("usage")
        if isinstance(usage, dict):
            if type(usage.get("prompt_tokens")) is int:
                self.prompt_tokens = usage["prompt_tokens"]
            if type(usage.get("completion_tokens")) is int:
                self.generated_tokens = usage["completion_tokens"]

    def describe(self) -> dict[str, Any]:
        """As ``GET /hurray/requests`` lists it (the shape of :meth:`Flight.describe`)."""
        return {
            "id": self.id,
            "backend": self.backend.url,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "movable": False,
            "why_not_movable": self.why,
            "legs": [{"backend": self.backend.url, "why": "relayed", "start_token": 0, "cached_tokens": None}],
        }


# ── what the client sees ────────────────────────────────────────────────────


class _NeedsBearer:
    """Paths under ``prefix`` need ``Authorization: Bearer K`` with one of ``keys``; 401 otherwise.

    A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's
    ``BaseHTTPMiddleware`` passes every chunk of a streamed response through a
    memory channel and a task (measured: about half the router's CPU per
    streamed token, which competes with the engines for the cores). Keys are
    held as SHA-256 digests, as vLLM's ``AuthenticationMiddleware`` keeps
    them, and every one is compared: the time says nothing of the length of
    the key sent or of which key matched.
    """

    def __init__(self, app: Any, *, prefix: str, keys: tuple[str, ...], message: str) -> None:
        self.app, self.prefix, self.message = app, prefix, message
        # Never an empty key (build_app refuses one): were one here, an empty token would still not match.
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys if k]

    def holds_a_key(self, scope: dict[str, Any]) -> bool:
        auth = next((v for k, v in scope.get("headers") or () if k == b"authorization"), b"")
        scheme, _, given = auth.partition(b" ")
        sent = hashlib.sha256(given.strip()).digest()
        match = False
        for d in self.digests:
            match |= hmac.compare_digest(sent, d)
        return scheme.lower() == b"bearer" and bool(given.strip()) and match

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        guarded = scope.get("path", "").startswith(self.prefix) or _route_path(scope).startswith(self.prefix)
        if scope["type"] == "http" and guarded and not self.holds_a_key(scope):
            from fastapi.responses import JSONResponse  # the router's own stack, imported where it is built

            refusal = JSONResponse(_error(401, self.message), status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _route_path(scope: dict[str, Any]) -> str:
    """The path the routes match: ``path`` without the ``root_path`` a proxy or a mount puts before it.

    Starlette's rule (``get_route_path``): the root path is stripped only where
    a ``/`` (or the end) follows it. Behind ``--root-path /pfx``,
    ``/pfx/hurray/requests`` is the ``/hurray/requests`` route.
    """
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


def _event_head(f: Flight) -> str:
    """What every event of ``f``'s stream starts with: its id, object, creation time and model, up to its choice."""
    obj = "chat.completion.chunk" if f.kind == "chat" else "text_completion"
    return (
        f'{{"id": {json.dumps(f.id)}, "object": "{obj}", "created": {json.dumps(f.created)}, '
        f'"model": {json.dumps(f.model)}, "choices": [{{"index": 0, '
    )


def _json(value: Any) -> str:
    """``json.dumps(value)``, with its two commonest cases (a string, ``None``) short-cut."""
    if value is None:
        return "null"
    return _json_str(value) if type(value) is str else json.dumps(value)


def _event(f: Flight, d: Delta, first: bool, head: str) -> bytes:
    """One delta as the client's SSE event, ``data: {...}``, in the format of its endpoint.

    The bytes ``json.dumps`` gives for the chunk (``tests/app/test_router_events.py``
    holds the two together), joined from ``head`` (:func:`_event_head`) and the
    delta's fields: the router writes one event per token, and a dict encoded
    whole cost ~7x as much.
    """
    chat = f.kind == "chat"
    if chat:
        parts = ['"delta": {"content": ', _json(d.text)]
        if first:
            parts.append(', "role": "assistant"')
        if d.extra:  # what the backend's reasoning or tool parser split out, as it came
            for k, v in d.extra.items():
                parts += [", ", _json_str(k), ": ", _json(v)]
        parts.append("}")
    else:
        parts = ['"text": ', _json(d.text)]
    parts += [', "logprobs": ', _json(d.logprobs), ', "finish_reason": ', _json(d.finish_reason)]
    if d.stop_reason is not None:
        parts += [', "stop_reason": ', _json(d.stop_reason)]
    ids = f.return_token_ids
    if ids:
        parts += [', "token_ids": ', json.dumps(d.token_ids)]
        if first and not chat:
            parts += [', "prompt_token_ids": ', json.dumps(f.prompt_ids)]
    parts.append("}]")
    if first and chat and ids:
        parts += [', "prompt_token_ids": ', json.dumps(f.prompt_ids)]
    return ("data: " + head + "".join(parts) + "}\n\n").encode()


def _usage(f: Flight) -> dict[str, Any]:
    """The whole request's usage: its prompt, and every leg's generated tokens."""
    p = len(f.prompt_ids or [])
    usage: dict[str, Any] = {
        "prompt_tokens": p,
        "completion_tokens": len(f.generated),
        "total_tokens": p + len(f.generated),
    }
    cached = f.cached_tokens
    if cached is not None:
        # The last leg's: after a move its prompt held the tokens generated before too, which it may have
        # loaded; the client's prompt is the whole of what can have been cached of it.
        cached = min(cached, p) if type(cached) is int else cached  # anything else: passed on as the backend said
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _error(status: int, message: str, kind: str = "router_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


def _failure(exc: RouterError | UpstreamError) -> tuple[int, dict[str, Any]]:
    """The status and error body a failed request is answered: a backend's refusal as the backend gave it."""
    if isinstance(exc, UpstreamError):
        if exc.status is not None and isinstance(exc.body, dict):
            return exc.status, exc.body
        return 502, _error(502, str(exc))
    return exc.status, _error(exc.status, exc.message)


async def _sse(
    router: Router, f: Flight, deltas: AsyncGenerator[Delta, None], first: Delta | None
) -> AsyncIterator[bytes]:
    """The client's event stream; the upstream legs stop when the client goes away (this generator closes)."""
    sent = False
    head = _event_head(f)
    ready = time.perf_counter()  # when the client's side was last ready for the next event
    try:
        pending = [first] if first is not None else []
        while True:
            d = pending.pop() if pending else await deltas.__anext__()
            event = _event(f, d, not sent, head)
            if d.token_ids and d.received:
                # The router's share of its latency: from read off the backend (or, if the client had not taken the
                # event before yet, from when it had) to handed to the server. Not what a slow client keeps it waiting.
                router.metrics.relayed(time.perf_counter() - max(d.received, ready))
            yield event
            ready = time.perf_counter()
            sent = True
    except StopAsyncIteration:
        if f.include_usage:
            obj = "chat.completion.chunk" if f.kind == "chat" else "text_completion"
            tail = {
                "id": f.id,
                "object": obj,
                "created": f.created,
                "model": f.model,
                "choices": [],
                "usage": _usage(f),
            }
            yield f"data: {json.dumps(tail)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    except (RouterError, UpstreamError) as exc:
        yield f"data: {json.dumps(_failure(exc)[1])}\n\n".encode()  # a backend's refusal: vLLM's own error event
        yield b"data: [DONE]\n\n"
    finally:
        # Here too, not only in the response's end hook: the flight is over before the stream's last byte
        # goes out, so a client that asks /hurray/requests right after [DONE] finds it among the recent ones.
        await deltas.aclose()
        router.end(f)


async def _client_left(request: Any) -> None:
    """Returns once the client has disconnected (its body was read already: the next message is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(request: Any, task: asyncio.Future[Any]) -> bool:
    """Wait for ``task`` unless the client disconnects first; True when it finished, False when it was cancelled."""
    left = asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if task.done():
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False


async def _collect(router: Router, f: Flight, deltas: AsyncIterator[Delta], first: Delta | None) -> dict[str, Any]:
    """A non-streamed answer: every delta of every leg, joined."""
    texts, finish, stop, logprobs = [], None, None, []
    parsed: dict[str, str] = {}  # what a reasoning parser split out, joined like the text
    try:
        items = [first] if first is not None else []
        async for d in deltas:
            items.append(d)
        for d in items:
            texts.append(d.text)
            for k, v in (d.extra or {}).items():
                if isinstance(v, str):
                    parsed[k] = parsed.get(k, "") + v
            finish = d.finish_reason or finish
            stop = d.stop_reason if d.stop_reason is not None else stop
            if d.logprobs is not None:
                logprobs.append(d.logprobs)
    finally:
        router.end(f)
    text = "".join(texts)
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if f.kind == "chat":
        choice.update(message={"role": "assistant", "content": text, **parsed}, stop_reason=stop)
        obj = "chat.completion"
    else:
        choice.update(text=text, stop_reason=stop, logprobs=_join_logprobs(logprobs))
        obj = "text_completion"
    if f.return_token_ids:
        choice["token_ids"] = list(f.generated)
        if f.kind == "completion":
            choice["prompt_token_ids"] = f.prompt_ids
    out: dict[str, Any] = {"id": f.id, "object": obj, "created": f.created, "model": f.model, "choices": [choice]}
    if f.kind == "chat" and f.return_token_ids:
        out["prompt_token_ids"] = f.prompt_ids
    out["usage"] = _usage(f)
    return out


def _join_logprobs(parts: list[Any]) -> Any:
    """Completion logprobs of several stream chunks as one (the lists concatenated)."""
    if not parts:
        return None
    out: dict[str, list[Any]] = {}
    for p in parts:
        if isinstance(p, dict):
            for k, v in p.items():
                if isinstance(v, list):
                    out.setdefault(k, []).extend(v)
    return out


#: Why a router key with whitespace at its start or end is refused (:func:`_api_keys`).
_SPACED_KEY = (
    "a key with whitespace at its start or end, which no client can send (a bearer token is read without it): "
    "remove the whitespace (a key file's trailing newline, say)"
)


def _api_keys(config: RouterConfig) -> tuple[str, ...]:
    """The keys ``/v1/*`` takes: the config's, else :data:`API_KEY_ENV`'s; none, ``/v1/*`` open.

    Raises:
        HurrayArgumentError: an empty key, or the variable set but empty (as an empty
            ``$HURRAY_VLLM_KEY_FILE`` is refused): an empty bearer token must never pass, and a key lost on
            the way (``HURRAY_API_KEY=$UNSET``) must not open ``/v1/*``. Also a key with whitespace at its start
            or end: a client's token is read without it (an HTTP header's value is), so every request got 401.
    """
    from ...errors import HurrayArgumentError

    if any(not k for k in (*config.api_keys, *config.control_tokens)):
        raise HurrayArgumentError("api_keys", "an empty key: give the key, or leave it out")
    if any(k != k.strip() for k in config.api_keys):
        raise HurrayArgumentError("api_keys", _SPACED_KEY)
    if config.api_keys:
        return config.api_keys
    env = os.environ.get(API_KEY_ENV)
    if env is None:
        return ()
    if not env.strip():
        raise HurrayArgumentError(
            f"${API_KEY_ENV}", "is set but empty: set it to the key clients must send, or unset it for an open /v1/*"
        )
    if env != env.strip():
        raise HurrayArgumentError(f"${API_KEY_ENV}", _SPACED_KEY)
    return (env,)


def build_app(config: RouterConfig) -> Any:
    """The router's ASGI application (FastAPI).

    Example:
        >>> from hurray_vllm.app.router import RouterConfig, build_app
        >>> app = build_app(RouterConfig(backends=("http://10.0.0.5:8000", "http://10.0.0.6:8000")))
        >>> sorted(r.path for r in app.routes if r.path.startswith("/hurray"))
        ['/hurray/drain', '/hurray/migrate', '/hurray/requests', '/hurray/undrain']
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="hurray-vllm router", lifespan=lifespan)
    app.state.router = router

    def fail(status: int, message: str) -> JSONResponse:
        return JSONResponse(_error(status, message), status_code=status)

    # /hurray/* moves and drains other clients' requests: with fleet keys, only their holders may. /v1/* takes the
    # router's own --api-key, as vLLM's server guards /v1 with its own: the router sends the backends their key
    # itself, so without it a backend started with --api-key would be open to whoever reaches the router.
    # /health and /metrics stay open, as on vLLM's server.
    if config.control_tokens:
        app.add_middleware(
            _NeedsBearer,
            prefix="/hurray/",
            keys=config.control_tokens,
            message="this router's /hurray/* controls need 'Authorization: Bearer TOKEN'; "
            "hurray-vllm router --key-file KEY --print-token prints the token of a fleet key",
        )
    api_keys = _api_keys(config)
    if api_keys:
        app.add_middleware(
            _NeedsBearer,
            prefix="/v1",
            keys=api_keys,
            message="this router's /v1/* endpoints need 'Authorization: Bearer KEY' with its --api-key",
        )
        if not config.control_tokens:
            # Documented, but a router keyed for its clients looks closed: whoever can send to /v1 can move and drain.
            log.warning(
                "router: /v1/* needs an API key, but /hurray/* (which lists, moves and drains every client's requests) "
                "is open to whoever reaches the router: guard it with a fleet key (hurray-vllm router --key-file KEY, "
                "or $HURRAY_VLLM_KEY_FILE; control_tokens in RouterConfig), or keep its port off untrusted networks"
            )

    async def json_body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            raise RouterError(400, "the request body is not JSON (or nested too deeply)") from None
        if not isinstance(body, dict):
            raise RouterError(400, "the request body must be a JSON object")
        return body

    async def passthrough(request: Request, kind: str, body: dict[str, Any], why: str) -> Any:
        """A request that cannot change backends (:func:`~.flight.movable`): relayed as it comes, its id replaced.

        A backend that cannot be reached, answers 5xx or is found dead before
        the answer's headers came is marked down and the request is sent to
        another one, as a flight's first leg is: the client has seen nothing.
        """
        import aiohttp

        keys = prompt_keys(body, config.chunk_tokens)
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-hurray-{uuid.uuid4().hex}"
        prompt = body.get("prompt")
        counted = len(prompt) if isinstance(prompt, list) and all(type(t) is int for t in prompt) else None
        token_ids = flag(body, "return_token_ids")  # its events then carry the generated tokens' ids (Relayed.count)
        failed: str | None = None  # the last backend's failure, the answer when no other backend is left
        avoid: tuple[Backend, ...] = ()  # the backend that just failed: tried elsewhere

        def let_go(b: Backend) -> None:  # the request no longer runs on b
            b.in_flight -= 1
            router.relayed.pop(rid, None)

        for attempt in range(MAX_FAILOVERS + 1):
            b = await router.pick(keys, model=body.get("model"), exclude=avoid)
            if b is None:
                break
            b.in_flight += 1
            if attempt == 0:
                router.metrics.routed(b.url)
            b.remember(keys)
            # Listed (and known to a drain) from now on: a non-streamed answer's headers come only at its end.
            entry = router.relayed[rid] = Relayed(rid, b, why, counted, token_ids)
            post = entry.waiting = asyncio.ensure_future(router.client.post(b.base + path, json=body))
            try:
                # A non-streamed answer's headers come at its end: a client that leaves before then must stop the
                # backend's request (closing the connection to it aborts it there), as for a flight.
                answered = await _unless_client_leaves(request, post)
            except BaseException:
                post.cancel()
                let_go(b)
                raise
            if not answered:
                let_go(b)
                return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
            exc = None if post.cancelled() else post.exception()  # cancelled: only by entry.cut()
            if post.cancelled() or exc is not None:
                let_go(b)
                if exc is not None and not isinstance(exc, (aiohttp.ClientError, TimeoutError)):
                    raise exc
                failed = f"{b.url}: {entry.dead}" if exc is None else f"{b.url}: {type(exc).__name__}: {exc}"
                router.backends.mark_down(b)
                log.warning("router: %s failed before its answer (%s); trying another backend", rid, failed)
                avoid = (b,)
                continue
            upstream = entry.upstream = post.result()
            if entry.dead is not None:
                # Found dead between the answer's headers and this line (the health task ran in between): cut() then
                # found neither a wait to cancel nor the answer, and the relay would wait for the stream timeout.
                upstream.content.set_exception(UpstreamError(entry.dead))
            if upstream.status >= 500 and attempt < MAX_FAILOVERS and any(x is not b for x in router.backends.usable()):
                # A failure of the backend, not of the request (vLLM answers 4xx to those), before any byte reached
                # the client: tried elsewhere, as a flight's first leg is.
                upstream.release()
                let_go(b)
                failed = f"{b.url} answered HTTP {upstream.status}"
                router.backends.mark_down(b)
                log.warning("router: %s: %s; trying another backend", rid, failed)
                avoid = (b,)
                continue
            break
        else:
            return fail(502, f"{failed} (too many failures)")
        if b is None:
            if failed is not None:
                return fail(502, f"{failed} (no other healthy backend)")
            return fail(503, router.backends.unroutable())
        log.debug("router: %s relayed to %s unchanged (%s)", rid, b.url, why)

        def renamed(data: bytes) -> bytes:
            try:
                event = json.loads(data)
            except ValueError:
                return data
            except RecursionError:  # nested deeper than the parser goes: the relay ends with an error, as a flight's
                raise UpstreamError("it sent an event nested too deeply to read") from None
            if isinstance(event, dict) and "id" in event:
                event["id"] = rid
                entry.count(event)
            try:
                return json.dumps(event).encode()
            except RecursionError:  # read just within the limit, written from deeper in the stack
                raise UpstreamError("it sent an event nested too deeply to read") from None

        streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")

        async def relay() -> AsyncIterator[bytes]:
            try:
                if streamed:
                    done = False
                    async for data in sse_data(upstream, b.url):
                        done = done or data == b"[DONE]"
                        yield b"data: " + (data if data == b"[DONE]" else renamed(data)) + b"\n\n"
                    if not done:
                        # Its body ended cleanly without [DONE]: as a stream that breaks off (below), the client
                        # gets an error and [DONE] (only [DONE] after every choice's finish), not a stream that stops.
                        raise UpstreamError("it ended the stream without finishing the request")
                else:
                    yield renamed(await upstream.read())
            except (aiohttp.ClientError, TimeoutError, UpstreamError) as exc:
                if streamed and entry.finished:
                    # Broken off (or found dead) after every choice's finish: the client has the whole answer, and
                    # a finished request ends cleanly (docs/router.md), as a flight's does. At most the backend's
                    # usage event is lost.
                    yield b"data: [DONE]\n\n"
                    return
                error = json.dumps(_error(502, f"{b.url}: {exc}"))
                # A stream ends as every stream does; a JSON answer's status is sent already: its body says it.
                yield f"data: {error}\n\ndata: [DONE]\n\n".encode() if streamed else error.encode()

        async def ended() -> None:  # however the response ends: also if the client left before it started
            upstream.release()
            let_go(b)

        media = upstream.headers.get("content-type", "application/json")
        return _streamed(relay(), ended, status_code=upstream.status, media_type=media)

    async def generate(request: Request, kind: str) -> Any:
        body = await json_body(request)
        if body.get("stream_options") and not body.get("stream"):
            # vLLM's own check (validate_stream_options), on the raw values as it makes it: every leg streams, so
            # no backend would see the request as the client sent it.
            return fail(400, "Stream options can only be defined when `stream=True`.")
        if not isinstance(body.get("stream_options") or {}, dict):
            return fail(400, "stream_options must be an object")  # the router reads it, and sends its own upstream
        if not isinstance(body.get("model"), str | None):
            # vLLM refuses it too; the router routes by it (what each backend serves, a context length) and writes
            # it into every event. Its type only: the value may be anything, nested deep.
            return fail(400, f"model must be a string (a name /v1/models lists), got {type(body['model']).__name__}")
        why = movable(kind, body)
        if why is not None:
            return await passthrough(request, kind, body, why)
        try:
            f = router.begin(kind, body)
        except RouterError as exc:  # a field the router computes with is not what vLLM would take
            return fail(exc.status, exc.message)
        deltas = f.deltas()
        # Until the first event (the backend's queue and the prefill) the client may leave: the request is then
        # stopped at once, as vLLM's own server would, not when its first token comes.
        starting = asyncio.ensure_future(deltas.__anext__())
        if not await _unless_client_leaves(request, starting):
            await deltas.aclose()
            router.end(f)
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        try:
            first = starting.result()  # the first leg's refusal is the client's answer, with its status
        except StopAsyncIteration:
            first = None
        except RouterError as exc:
            router.end(f)
            return fail(exc.status, exc.message)
        except UpstreamError as exc:
            router.end(f)
            status, error = _failure(exc)
            return JSONResponse(error, status_code=status)
        if f.stream:

            async def ended() -> None:  # however the stream ended: also if the client left before it started
                await deltas.aclose()
                router.end(f)

            return _streamed(_sse(router, f, deltas, first), ended, media_type="text/event-stream")
        collect = asyncio.ensure_future(_collect(router, f, deltas, first))
        try:
            if not await _unless_client_leaves(request, collect):
                # The client went away: stop the backend's request now rather than generate for nobody.
                await deltas.aclose()
                router.end(f)
                return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
            return JSONResponse(collect.result())
        except (RouterError, UpstreamError) as exc:
            status, error = _failure(exc)  # a backend's refusal (4xx) after tokens too: vLLM's own answer
            return JSONResponse(error, status_code=status)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await generate(request, "chat")

    @app.get("/v1/models")
    async def models() -> Any:
        # Every healthy backend that decodes, asked at once: a LoRA adapter loaded on some of them is served all
        # the same (requests for it are routed there). A health check's wait, not a stream's: a hung backend
        # must not hold a client that lists models. Each answer also refreshes what routing knows it serves.
        asked = [b for b in router.backends.all.values() if b.healthy and not b.prefill]
        answers = await asyncio.gather(*(router.backends.read_models(router.client, b, router.patience) for b in asked))
        if all(a is None for a in answers):
            return fail(503, "no backend answered /v1/models")
        cards: dict[str, dict[str, Any]] = {}
        for a in answers:
            for card in a or ():
                # A card without a string id names no model a request could ask for (and a list or object as
                # its id is no key to join on: it once failed the whole list with a 500).
                if isinstance(card.get("id"), str):
                    cards.setdefault(card["id"], card)  # the first backend's card of a model, in --backend order
        return JSONResponse({"object": "list", "data": list(cards.values())})

    @app.get("/health")
    async def health() -> Any:
        state = {b.url: {"healthy": b.healthy, "draining": b.draining, "in_flight": b.in_flight, "prefill": b.prefill}
                 for b in router.backends.all.values()}  # fmt: skip
        # "ok" only while a request can be routed: every backend drained answers 503 to every request.
        ok = bool(router.backends.usable())
        out: dict[str, Any] = {"status": "ok" if ok else "unavailable", "backends": state}
        if not ok:
            out["reason"] = router.backends.unroutable()
        return JSONResponse(out, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Any:
        bs = router.backends.all.values()
        text = router.metrics.render(
            {b.url: b.in_flight for b in bs}, {b.url: b.healthy for b in bs}, {b.url: b.draining for b in bs}
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/hurray/requests")
    async def requests(recent: bool = False) -> Any:
        out: dict[str, Any] = {"requests": [f.describe() for f in router.flights.values() if not f.finished]}
        out["requests"] += [r.describe() for r in router.relayed.values()]
        if recent:
            out["recent"] = list(router.recent)
        return JSONResponse(out)

    @app.post("/hurray/migrate")
    async def migrate(request: Request) -> Any:
        body = await json_body(request)
        if "id" not in body or "to" not in body:
            raise RouterError(400, 'expected {"id": ..., "to": URL}')
        t0 = time.monotonic()
        out = await router.migrate(body["id"], body["to"])
        out["took_ms"] = round((time.monotonic() - t0) * 1e3, 3)
        return JSONResponse(out)

    @app.post("/hurray/drain")
    async def drain(request: Request) -> Any:
        return JSONResponse(await router.drain((await json_body(request)).get("backend")))

    @app.post("/hurray/undrain")
    async def undrain(request: Request) -> Any:
        return JSONResponse(router.undrain((await json_body(request)).get("backend")))

    @app.exception_handler(RouterError)
    async def refused(request: Request, exc: RouterError) -> Any:
        return fail(exc.status, exc.message)

    # FastAPI's and Starlette's own refusals (a query parameter it cannot read, a method or path it has no route for)
    # in the router's error shape too: a client reads every error of the router the same way.
    @app.exception_handler(RequestValidationError)
    async def unreadable(request: Request, exc: RequestValidationError) -> Any:
        what = "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'request'}: {e.get('msg', 'invalid')}"
            for e in exc.errors()
        )
        return fail(400, what or "the request is not what this endpoint takes")

    @app.exception_handler(StarletteHTTPException)
    async def http_refusal(request: Request, exc: StarletteHTTPException) -> Any:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return JSONResponse(_error(exc.status_code, detail), status_code=exc.status_code, headers=exc.headers)

    return app


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(config: RouterConfig, host: str, port: int, *, log_level: str = "warning") -> None:
    """Run the router on ``host:port`` until SIGINT or SIGTERM (uvicorn's handling), then return: a clean stop.

    Raises:
        HurrayArgumentError: what :func:`build_app` refuses (an empty ``$HURRAY_API_KEY``), before anything binds.
        OSError: ``host:port`` cannot be bound (in use), named in ``filename``.
    """
    import signal
    import socket
    import threading

    import aiohttp  # noqa: F401 - imported before the freeze below (Router.start() would import it later)
    import uvicorn

    app = build_app(config)  # what it refuses is the call's error, before the banner says the router runs
    # Bound here, and handed to uvicorn: a port in use is the caller's to hear about as any bad address, before the
    # banner, and the banner names the port bound (--listen HOST:0 picks one).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, host_port(host, port)) from None
        over = ", ".join(config.backends) + (f"; prefill {', '.join(config.prefill)}" if config.prefill else "")
        print(f"hurray-vllm router on http://{host_port(host, sock.getsockname()[1])} over {over}", flush=True)
        # What start-up imported (torch among it: ~170k objects) lives as long as the process: kept out of
        # the collector's full passes, each of which took ~45 ms of a token stream's time. Here, in the
        # router's own process only: an application embedding build_app() keeps its collector as it is.
        gc.collect()
        gc.freeze()
        server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False))
        # uvicorn stops gracefully on SIGINT or SIGTERM, then raises the signal again under the handler it found:
        # SIGINT's KeyboardInterrupt, SIGTERM's death by the signal. Both are how the router is stopped: a clean
        # stop (exit 0), as receive's. Only in the main thread, where handlers can be set (uvicorn's rule too).
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _interrupted) if main_thread else None
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            if not server.started:  # interrupted while starting: not a stop of a router that ran
                raise
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous)
    if not server.started:  # as uvicorn.run: a start-up that failed (uvicorn logged why) is no clean stop
        raise SystemExit(3)  # uvicorn's STARTUP_FAILURE
