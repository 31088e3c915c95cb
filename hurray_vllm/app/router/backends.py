"""The vLLM servers behind the router: their health, load, drain state, and which one a request goes to.

Routing is KV-aware: the router remembers, per backend, the chunk keys of the
prompts it sent there (content-addressed, :func:`~hurray_vllm.chunks.keys.chunk_keys`),
and sends a request where the longest prefix of its prompt went before, since
that engine holds it in its prefix cache or store, as long as that backend
is not much busier than the least loaded one (:data:`KV_LOAD_SLACK`);
otherwise to the backend with the fewest requests in flight. Keys are the
router's own (its namespace, ``--chunk-tokens``): it needs no access to the
engines or their stores.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...chunks.keys import chunk_keys, key_seed

__all__ = ["KV_LOAD_SLACK", "POLICIES", "Backend", "Backends", "backend_key", "prompt_keys"]

log = logging.getLogger("hurray_vllm.router")

#: The namespace of the router's own prefix keys (they never meet a store's).
_NS = "726f75746572"
#: Prefix keys remembered per backend, least recently used out.
_KEYS_PER_BACKEND = 1 << 17
#: KV-aware routing sends a request where its prefix went before only while that backend has at most this many
#: more requests in flight (and moves on their way to it) than the least loaded one. Without a bound, one
#: shared system prompt would send all traffic to the first backend that saw it, for ever; with one, the
#: others get requests (and the prefix) once it is busier, and the prefix then has several homes.
KV_LOAD_SLACK = 8


def backend_key(url: str) -> str:
    """What names one backend among URLs given for it: ``url`` without a trailing slash (which does not matter).

    Example:
        >>> backend_key("http://a:8000/") == backend_key("http://a:8000")
        True
    """
    return url.rstrip("/")


def prompt_keys(body: dict[str, Any], chunk_tokens: int) -> list[str]:
    """Keys of the whole chunks of a request's prompt, for prefix-affinity routing.

    A token-id prompt is keyed by its tokens, as the connector keys chunks;
    a text prompt or chat messages by their UTF-8 bytes in runs of
    ``4 * chunk_tokens`` (about as many tokens): close enough to find the
    backend that saw the same prefix. The model name (a LoRA adapter is one)
    and a ``cache_salt`` seed the keys: the same tokens under another
    adapter or tenant are other KV, which no backend shares.
    """
    salt = body.get("cache_salt")
    seed = key_seed(_NS, lora=(_encodable(body.get("model") or ""), ""), cache_salt=_encodable(salt) if salt else None)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        if not all(0 <= t < 1 << 63 for t in prompt):
            return []  # no token id: the backend refuses the prompt (chunk keys pack ids as int64)
        return chunk_keys(prompt, chunk_tokens, seed)
    if isinstance(prompt, str):
        raw = prompt.encode(errors="surrogatepass")  # a lone surrogate is valid JSON; keys only serve affinity
    elif "messages" in body:
        try:
            raw = json.dumps(body["messages"], sort_keys=True, separators=(",", ":")).encode()
        except RecursionError:  # nested about as deep as the parser took: no keys (they only serve affinity)
            return []
    else:
        return []
    step, keys, prev = 4 * chunk_tokens, [], seed.encode()
    for i in range(len(raw) // step):
        prev = hashlib.blake2b(prev + raw[i * step : (i + 1) * step], digest_size=16).digest()
        keys.append(prev.hex())
    return keys


def _encodable(value: object) -> str:
    """``value`` as text that encodes to UTF-8: a lone surrogate (valid JSON) as its bytes' escapes.

    Keys only serve affinity: two names that end up alike share a backend's preference, nothing more.
    """
    return str(value).encode(errors="surrogatepass").decode(errors="backslashreplace")


@dataclass
class Backend:
    """One vLLM OpenAI server, by the URL it was given as on the command line."""

    url: str
    prefill: bool = False  # a --prefill backend: runs prompts only
    healthy: bool = True
    draining: bool = False
    in_flight: int = 0
    # Moves on their way here (a warm-up under way, the switch not yet made): counted in its load, so that the
    # requests of one drain, which all pick their destination before any of them switches, spread out.
    planned: int = 0
    failures: int = 0  # consecutive failed health checks
    max_model_len: int | None = None  # its /v1/models' max_model_len (a chat continuation's default limit)
    # The model ids its /v1/models lists (LoRA adapters too). Out of the repr, as keys: a backend in a log line
    # or an error must cost a URL's worth of text, not thousands of names or keys formatted on the event loop.
    served: frozenset[str] = field(default=frozenset(), repr=False)
    keys: OrderedDict[str, None] = field(default_factory=OrderedDict, repr=False)  # up to _KEYS_PER_BACKEND

    @property
    def base(self) -> str:
        """The URL without a trailing slash (:func:`backend_key`)."""
        return backend_key(self.url)

    def serves(self, model: object) -> bool:
        """Whether a request for ``model`` can run here: it is in :attr:`served`, or that is not known.

        Not known: no model named (the backend's own default serves it), or
        no ``/v1/models`` read from it yet (nor one that listed anything).
        """
        return not isinstance(model, str) or not self.served or model in self.served

    @property
    def load(self) -> int:
        """What routing compares: requests in flight here, and moves on their way here."""
        return self.in_flight + self.planned

    def remember(self, keys: Sequence[str]) -> None:
        """Note that the prefixes ``keys`` were sent here."""
        for k in keys:
            self.keys[k] = None
            self.keys.move_to_end(k)
        while len(self.keys) > _KEYS_PER_BACKEND:
            self.keys.popitem(last=False)

    def held(self, keys: Sequence[str]) -> int:
        """How many leading chunks of ``keys`` were sent here."""
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n


#: Routing policies: ``kv`` (longest prefix sent there before, then least loaded), ``least-loaded``,
#: ``round-robin`` (for comparisons: ``scripts/bench_router.py``).
POLICIES = ("kv", "least-loaded", "round-robin")


class Backends:
    """Every backend, and the choices between them (``policy``: one of :data:`POLICIES`)."""

    def __init__(
        self, decode: Sequence[str], prefill: Sequence[str] = (), policy: str = "kv", slack: int = KV_LOAD_SLACK
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; expected one of {', '.join(POLICIES)}")
        if slack < 0:
            raise ValueError(f"kv_load_slack must be >= 0, got {slack}")
        self.policy = policy
        self.slack = slack
        self._turn = 0
        # By backend_key(): "http://a:1" and "http://a:1/" are one backend (its first spelling is its url).
        self.all: dict[str, Backend] = {}
        for url in decode:
            self.all.setdefault(backend_key(url), Backend(url))
        for url in prefill:
            self.all.setdefault(backend_key(url), Backend(url, prefill=True))

    def get(self, url: str) -> Backend | None:
        """The backend given as ``url`` (with or without a trailing slash), if any."""
        return self.all.get(backend_key(url))

    def usable(self, *, prefill: bool = False) -> list[Backend]:
        """The healthy, undrained backends of one kind."""
        return [b for b in self.all.values() if b.prefill == prefill and b.healthy and not b.draining]

    def unroutable(self, *, prefill: bool = False) -> str:
        """Why no backend of one kind can take a request: what a 503 says (and what to do about it)."""
        kind = [b for b in self.all.values() if b.prefill == prefill]
        what = "prefill backend" if prefill else "backend"
        if any(b.healthy for b in kind):  # healthy ones exist: every one of them is drained
            return f'every healthy {what} is drained; POST /hurray/undrain {{"backend": URL}} to route to one again'
        return f"no healthy {what} to route to"

    @property
    def has_prefill(self) -> bool:
        """Whether ``--prefill`` backends were given (prefill/decode split)."""
        return any(b.prefill for b in self.all.values())

    def pick(
        self,
        keys: Sequence[str],
        *,
        model: object = None,
        prefill: bool = False,
        exclude: Sequence[Backend] = (),
    ) -> Backend | None:
        """The backend to send a request for ``model`` with prefix ``keys`` to; None if none is usable.

        Never one of ``exclude`` (the backend a request leaves, a drain's destinations that could not take it).

        Only backends that serve ``model`` (:meth:`Backend.serves`: a LoRA
        adapter loaded on some of them, say) are chosen from while there is
        one; a backend known not to serve it would answer 404. With none,
        any usable backend: a new request then gets the backend's own answer
        for a model nobody serves (callers that move a running request check
        :meth:`Backend.serves` themselves). With the ``kv`` policy: of the
        backends whose load is within :attr:`slack` of the least loaded
        one's, the one sent the longest prefix of ``keys`` before, then the
        least loaded of those.
        """
        cands = [b for b in self.usable(prefill=prefill) if all(b is not e for e in exclude)]
        if not cands:
            return None
        cands = [b for b in cands if b.serves(model)] or cands
        if self.policy == "round-robin":
            self._turn += 1
            return cands[self._turn % len(cands)]
        least = min(b.load for b in cands)
        if self.policy == "least-loaded":
            return next(b for b in cands if b.load == least)
        near = [b for b in cands if b.load <= least + self.slack]
        return max(near, key=lambda b: (b.held(keys), -b.load))

    async def check(self, client: Any, backend: Backend, timeout: float) -> bool:
        """One health check: ``GET /health`` answers 200."""
        import aiohttp

        try:
            async with client.get(f"{backend.base}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                ok = bool(r.status == 200)
        except Exception:  # any failure to answer is unhealthy
            return False
        if ok and backend.max_model_len is None:
            await self.read_models(client, backend, timeout)
        return ok

    async def read_models(self, client: Any, backend: Backend, timeout: float) -> list[dict[str, Any]] | None:
        """Read ``backend``'s ``/v1/models``: its :attr:`~Backend.max_model_len` and what it serves.

        Within ``timeout`` seconds; a failure leaves both as they were (unknown: the next health check asks again).

        Returns:
            The model cards it listed (``GET /v1/models`` joins them); None when it did not answer 200.
        """
        import aiohttp

        try:
            async with client.get(f"{backend.base}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status != 200:
                    return None
                cards = [c for c in (await r.json()).get("data") or [] if isinstance(c, dict)]
            n = next((c.get("max_model_len") for c in cards if type(c.get("max_model_len")) is int), None)
        except Exception:  # not known yet: the next check asks again
            return None
        backend.served = frozenset(c["id"] for c in cards if isinstance(c.get("id"), str))
        backend.max_model_len = n
        return cards

    def context_length(self, model: object) -> int | None:
        """The largest ``max_model_len`` a backend serving ``model`` (any, for None) said it has; None: none did.

        The largest: vLLM takes a continuation's ``max_tokens`` up to the rest of its own context
        (``get_max_tokens``), so a larger one costs nothing where a smaller one would cut it short. A
        ``model`` that is not a string counts as none (any backend), as :meth:`Backend.serves` reads it: a
        list or an object, no set member, once raised TypeError here.
        """
        lens = [
            b.max_model_len
            for b in self.all.values()
            if b.max_model_len is not None and (not isinstance(model, str) or model in b.served)
        ]
        return max(lens, default=None)

    def mark_up(self, backend: Backend) -> None:
        """``backend`` answered a health check: route to it again."""
        if not backend.healthy:
            log.info("router: backend %s is back", backend.url)
        backend.healthy, backend.failures = True, 0

    def mark_down(self, backend: Backend) -> None:
        """Take ``backend`` out of routing now (its stream broke); the health checks bring it back."""
        if backend.healthy:
            log.warning("router: backend %s failed mid-stream", backend.url)
        backend.healthy = False
