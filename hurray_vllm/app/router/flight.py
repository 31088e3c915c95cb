"""One client request in flight through the router, over one or more *legs* (upstream requests).

A leg is one streamed request to one backend. A request starts with one
leg (or, with ``--prefill`` backends, a one-token prefill leg and a decode
leg) and gets another when it is migrated, drained or its backend fails.
Every leg after the first is a ``/v1/completions`` continuation from the
token ids the router has received so far (the prompt's, which every leg
returns with ``return_token_ids``, plus the generated ones), so the client
sees one stream whose tokens are neither duplicated nor missing.

The KV follows through the engines' ``HurrayConnector``: a continuation
announces, in its ``kv_transfer_params``, the tokens whose KV the source
computed (``hurray_saved_tokens``); the destination waits for those chunks
(pushed by the source, or written to a shared store) and computes only the
tail. After a failure nothing is announced: the destination loads whatever
reached it and recomputes the rest.

One reader task per leg moves upstream events into an unbounded queue; it
takes a slot of a per-flight semaphore first, and the client's side gives
the slot back when it sent the event on: a slow client holds back its own
upstream stream (TCP backpressure to that backend) and nothing else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .backends import Backend, prompt_keys

if TYPE_CHECKING:
    from .server import Router

__all__ = ["Delta", "Flight", "Leg", "RouterError", "UpstreamError", "flag", "movable", "sse_data"]

log = logging.getLogger("hurray_vllm.router")

#: Upstream events a flight buffers before its reader stops reading (a slow client's backpressure).
BUFFERED_EVENTS = 64
#: How many times one request is continued after its backend failed.
MAX_FAILOVERS = 3
#: How long a move (``/hurray/migrate``, one request of a drain) waits for the request to run on its destination.
MOVE_TIMEOUT_S = 600.0
#: At most this many warm-ups of a move's destination, while the source generated more than WARMUP_SLACK
#: tokens during the last one.
WARMUPS, WARMUP_SLACK = 3, 8
#: vLLM's ``max_tokens`` for a ``/v1/completions`` request without one (absent or null): a continuation
#: without an explicit ``max_tokens`` would get it, whatever the client's request had.
COMPLETION_MAX_TOKENS = 16
#: Sampling fields a chat request shares with ``/v1/completions`` (what its continuations carry over).
_SAMPLING = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "bad_words",
    "allowed_token_ids", "logit_bias", "priority", "user", "watermarking", "vllm_xargs", "thinking_token_budget",
    "repetition_detection", "stream_interval",
    # Not sampling, but the request's own cache: a continuation without it would share the tenant's KV.
    "cache_salt",
)  # fmt: skip


class RouterError(Exception):
    """A request the router refuses or cannot serve: an HTTP status and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class UpstreamError(Exception):
    """A leg that failed: the backend could not be reached, answered an error, or broke off."""

    def __init__(self, message: str, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.status = status  # the backend's HTTP status when it answered one
        self.body = body  # ... and its JSON body


@dataclass
class Delta:
    """What one upstream event adds to the request: text, token ids, and at the end a finish reason."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    logprobs: Any = None
    usage: dict[str, Any] | None = None  # the leg's usage chunk (no choice)
    # A chat delta's fields besides content and role, passed on as they came: the reasoning or tool calls
    # a backend's parsers split out of the text (``reasoning_content``, ``tool_calls``...).
    extra: dict[str, Any] | None = None
    received: float = 0.0  # time.perf_counter() when the router read it (its latency through the router)
    upto: int = 0  # the request's generated tokens up to and with this delta's, all legs together


@dataclass
class Leg:
    """One upstream request of a flight."""

    backend: str
    why: str  # "routed", "prefill", "decode", "migrated", "drained", "failover", "resumed"
    start_token: int  # how many tokens had been generated when it started
    cached_tokens: int | None = None  # prompt tokens the backend did not compute (its usage, when it finished)
    # A move's warm-ups on this backend before the leg: per warm-up the context it was sent ("tokens") and
    # the part the backend did not compute ("cached_tokens", None if it did not say). The first one's is
    # what the KV movement brought: the leg's own cached_tokens also count what the warm-ups computed.
    warmups: list[dict[str, int | None]] = field(default_factory=list)
    # The kv_transfer_params the leg was sent: the chunks (and prompt tail) whose KV it was told to wait for.
    announced: dict[str, Any] | None = None


@dataclass
class _Interrupt:
    """Why a flight's reader was stopped: a migration to ``to`` (answered through ``done``), or a failover."""

    kind: str  # "move" or "failover"
    to: Backend | None = None
    why: str = "migrated"
    done: asyncio.Future[dict[str, Any]] | None = None
    # When the client's side took the source's last token (time.perf_counter()): the pause starts there. Its
    # arrival, or later behind a client that reads slower than the tokens came: that wait is not the move's.
    since: float = 0.0
    broke: bool = False  # its source broke as it was left: a failover to the move's destination, not a migration


#: The largest server-sent event the router reads (a first event carries the prompt's token ids: ~6 bytes each).
MAX_EVENT_BYTES = 16 << 20


async def sse_data(response: Any, where: str) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of an ``aiohttp`` response's event stream, as they arrive.

    Raises:
        UpstreamError: an event longer than :data:`MAX_EVENT_BYTES`.
    """
    # The unfinished line's pieces, joined once its newline comes, and only the new chunk searched for it: joining
    # and searching the whole line at each chunk made a long line (a first event's prompt ids) quadratic, one
    # stretch of the event loop that held every other stream.
    pieces: list[bytes] = []
    size = 0  # their length
    async for chunk in response.content.iter_any():
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            line = chunk[start:end]
            if pieces:
                pieces.append(line)
                line = b"".join(pieces)
                pieces, size = [], 0
            start = end + 1
            if line.startswith(b"data:"):
                yield line[5:].strip()
        if start < len(chunk):
            pieces.append(chunk[start:])
            size += len(chunk) - start
        if size > MAX_EVENT_BYTES:
            raise UpstreamError(f"{where} sent an event of more than {MAX_EVENT_BYTES} bytes")
    line = b"".join(pieces)
    if line.startswith(b"data:"):
        yield line[5:].strip()


def _upstream_delta(event: dict[str, Any], chat: bool) -> tuple[Delta, list[int] | None]:
    """An upstream SSE event as a :class:`Delta`, and the prompt's token ids where the event carries them."""
    if "error" in event and not event.get("choices"):
        # vLLM reports what it finds wrong after a stream started (a request it refuses, ``logprobs`` over its
        # ``--max-logprobs``, say) as such an event, its HTTP status as ``code``: a 4xx is a refusal, not a failure.
        err = event["error"]
        code = err.get("code") if isinstance(err, dict) else None
        status = code if type(code) is int and 400 <= code < 600 else None
        raise UpstreamError(f"backend error: {err.get('message') if isinstance(err, dict) else err}", status, event)
    choices = event.get("choices") or []
    if not choices:
        usage = event.get("usage")
        # Read by the client's side (cached tokens, counts): a wrong shape fails the leg here, on the reader.
        if usage is not None and not (
            isinstance(usage, dict) and isinstance(usage.get("prompt_tokens_details") or {}, dict)
        ):
            raise UpstreamError(f"backend sent a usage that is not an object: {str(usage)[:200]}")
        return Delta(usage=usage), None
    c = choices[0]
    prompt = c.get("prompt_token_ids") or event.get("prompt_token_ids")
    extra = None
    if chat:
        message = c.get("delta") or {}
        if not isinstance(message, dict):
            raise UpstreamError(f"backend sent a chat delta that is not an object: {str(message)[:200]}")
        text = message.get("content") or ""
        if not message.keys() <= _PLAIN_DELTA:
            extra = {k: v for k, v in message.items() if k not in _PLAIN_DELTA}
    else:
        text = c.get("text") or ""
    if not isinstance(text, str) or not isinstance(c.get("finish_reason"), str | None):
        raise UpstreamError(f"backend sent a text or finish reason that is not a string: {str(c)[:200]}")
    ids = c.get("token_ids") or []
    # Token ids go back upstream as a continuation's prompt: anything but a list of ints breaks a leg later.
    for what in (ids, prompt or []):
        if not isinstance(what, list) or not all(type(t) is int for t in what):
            raise UpstreamError(f"backend sent token ids that are not a list of integers: {str(what)[:200]}")
    return (
        Delta(text, list(ids), c.get("finish_reason"), c.get("stop_reason"), c.get("logprobs"), extra=extra),
        list(prompt) if prompt else None,
    )


def _refusal(exc: object) -> bool:
    """Whether a leg's failure is its backend refusing the request (4xx), not the backend failing."""
    return isinstance(exc, UpstreamError) and exc.status is not None and exc.status < 500


def _cached_tokens(answer: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a completion's JSON answer; None if it has none.

    vLLM reports it with ``--enable-prompt-tokens-details``: the prompt
    tokens it did not compute (its prefix cache and what the connector loaded).
    """
    try:
        n = json.loads(answer)["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (ValueError, KeyError, TypeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


#: The chat delta fields the router writes itself; any other is passed on (:attr:`Delta.extra`).
_PLAIN_DELTA = frozenset({"content", "role"})
#: Request fields that constrain what is generated with a grammar or schema (vLLM's structured outputs).
_STRUCTURED = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "response_format",
)
#: Why a flight whose backend splits reasoning or tool calls out of the text can no longer move.
PARSED = "its backend parses reasoning or tool calls out of the text (a continuation is a plain completion)"


#: Chat content part types vLLM reads as text (or as nothing a model sees: a tool reference).
_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"})
#: Keys that make vLLM read a content part as media, whatever its ``type``.
_MEDIA_KEYS = frozenset(
    {"input_image", "image_url", "image_embeds", "image_pil", "audio_embeds", "audio_url", "input_audio",
     "video_embeds", "video_url", "prompt_embeds"}
)  # fmt: skip


def _has_media(messages: object) -> bool:
    """Whether chat ``messages`` hold a content part vLLM reads as media (an image, audio, video, embeddings).

    As vLLM's own chat parsing decides: a part with a media key is media
    whatever its ``type``; one without a ``type`` is text; a string is text.
    An unknown type counts as media (a continuation would lose it).
    """
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type", "text")
            if not _MEDIA_KEYS.isdisjoint(part) or not isinstance(kind, str) or kind not in _TEXT_PARTS:
                return True
    return False


def token_count(body: dict[str, Any], name: str) -> int | None:
    """``body[name]`` as a token count (``None`` when absent), as vLLM's request model reads it.

    vLLM's pydantic models coerce ``"20"`` and ``20.0`` to 20; the router does its arithmetic on
    the same number (what is left of ``max_tokens`` after a move, say).

    Raises:
        RouterError: 400, the value is not a count at all (vLLM would refuse it too).
    """
    value = body.get(name)
    if value is None:
        return None
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str) and value.strip().isdecimal() and value.strip().isascii():
        try:
            n = int(value.strip())
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits()): no count either
            n = None
    if n is None or n < 0:
        # The value shown cut short: a string of thousands of digits is not the answer's to repeat.
        raise RouterError(400, f"{name} must be a non-negative integer, got {value!r:.100}")
    return n


#: The strings vLLM's request models (pydantic, lax) read as a boolean, in any case.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def flag(body: dict[str, Any], key: str, default: bool = False, *, name: str | None = None) -> bool:
    """``body[key]`` as a boolean (``default`` when absent or null), as vLLM's request model reads it.

    pydantic's lax booleans: ``true``/``false``, 0 and 1 (also 0.0 and
    1.0), and the strings ``"true"``, ``"false"``, ``"1"``, ``"0"``,
    ``"yes"``, ``"no"``, ``"on"``, ``"off"``, ``"t"``, ``"f"``, ``"y"``,
    ``"n"`` in any case. ``bool("false")`` would be True.

    Raises:
        RouterError: 400 naming the field (``name``, else ``key``): anything else, which vLLM refuses too.
    """
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise RouterError(400, f"{name or key} must be a boolean, got {value!r}")


def movable(kind: str, body: dict[str, Any]) -> str | None:
    """Why a request cannot change backends mid-stream (``None``: it can); the server relays such requests as is.

    A chat request whose backend turns out to split reasoning or tool calls
    out of its text becomes unmovable at its first such delta (:data:`PARSED`).

    Raises:
        RouterError: 400, a boolean field it reads is not one (:func:`flag`).
    """
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        return "n > 1 or best_of > 1: several sequences"
    if flag(body, "use_beam_search"):
        return "use_beam_search (vLLM does not stream beam search, and every leg streams)"
    if body.get("prompt_logprobs") is not None:
        # vLLM refuses them on a stream (every leg streams), the router's answer has no place for them, and a
        # continuation's would cover the generated tokens too: relayed as they come.
        return "prompt_logprobs"
    for name in _STRUCTURED:
        rf = body.get(name)
        if rf is not None and not (name == "response_format" and isinstance(rf, dict) and rf.get("type") == "text"):
            # The continuation would start the grammar over in the middle of the output.
            return f"structured output ({name}): a continuation would restart its grammar"
    if body.get("kv_transfer_params") is not None and not flag(body, "stream"):
        # vLLM answers its own kv_transfer_params (an external P/D proxy's handshake) in a non-streamed answer
        # only, and every leg streams: relayed, the answer carries them.
        return "kv_transfer_params on a non-streamed request (vLLM answers its own only there; every leg streams)"
    if kind == "completion":
        p = body.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return "a batch of prompts"
        if body.get("prompt_embeds") is not None:
            return "prompt embeddings (a continuation is a token-id prompt)"
        if flag(body, "echo"):
            return "echo"
        if body.get("suffix"):
            return "suffix"
    elif flag(body, "logprobs") or body.get("tools"):
        return "chat logprobs or tools (a continuation is a plain completion)"
    elif flag(body, "echo"):
        # vLLM streams the echoed last message as an event of its own, outside the generated text its stop
        # strings are matched over; a prefill leg's answer joins it to its token. Relayed, vLLM keeps them apart.
        return "echo"
    elif flag(body, "return_prompt_text"):
        # vLLM puts the templated prompt's text in the answer (a stream's first event), outside the choices the
        # router rebuilds its answer from: relayed, the client gets it.
        return "return_prompt_text (the prompt's text is in the backend's answer, outside its choices)"
    elif _has_media(body.get("messages")):
        return "images, audio or video in the messages (a continuation is a token-id prompt, without them)"
    elif not flag(body, "include_reasoning", True):
        return "include_reasoning false (the backend then leaves out the token ids a continuation is built from)"
    return None


class Flight:
    """A client request and its legs (see the module docstring).

    Args:
        router: the router it runs in (backends, HTTP client, metrics).
        kind: ``"completion"`` or ``"chat"``.
        body: the client's JSON body.
    """

    def __init__(self, router: Router, kind: str, body: dict[str, Any]) -> None:
        self.router = router
        self.kind = kind
        self.body = body
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-hurray-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model: str | None = body.get("model")
        self.unmovable = movable(kind, body)
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []
        # vLLM holds back the last len(longest stop string) - 1 characters of a stream's text until it knows
        # they start no stop string; a leg cut off by a move or a failure would take them with it (its
        # tokens are sent, their text never). The legs send all their text, and the router holds it back.
        stops = body.get("stop")
        stops = [stops] if isinstance(stops, str) else stops if isinstance(stops, list) else []
        self._stops = [s for s in stops if isinstance(s, str) and s]  # the backend answers 400 to the rest
        self._keep_stop = flag(body, "include_stop_str_in_output")
        # The client's flags, read once as vLLM reads them (a string "false" is false).
        self.stream = flag(body, "stream")
        self.return_token_ids = flag(body, "return_token_ids")
        options = body.get("stream_options")
        self.include_usage = isinstance(options, dict) and flag(
            options, "include_usage", name="stream_options.include_usage"
        )
        # Each backend matches stop strings over its own leg's text only: one that starts in an earlier leg
        # is matched here, over the last (longest - 1) characters before the new text (_release).
        self._tail_len = max(map(len, self._stops), default=1) - 1
        self._tail = ""
        self._hold = 0 if self._keep_stop else self._tail_len
        self._held = ""
        self.legs: list[Leg] = []
        self.backend: Backend | None = None
        self.finished = False
        self.finish_reason: str | None = None
        self.cached_tokens: int | None = None
        limit = token_count(body, "max_completion_tokens") if kind == "chat" else None
        self.max_tokens: int | None = limit if limit is not None else token_count(body, "max_tokens")
        if self.max_tokens is None and kind == "completion":
            self.max_tokens = COMPLETION_MAX_TOKENS  # as the first leg's backend reads it
        self.min_tokens = token_count(body, "min_tokens") or 0
        # Where the next completion logprobs' text_offset starts: each leg counts from its own first token.
        self._text_offset = 0
        self._keys = prompt_keys(body, router.config.chunk_tokens)
        self._interrupt: _Interrupt | None = None
        self._moving = False  # a move's destination has not sent its first token yet
        # The coming move's destination and warm-ups there, for the leg it starts (Leg.warmups).
        self._warmups: tuple[Backend | None, list[dict[str, int | None]]] = (None, [])
        self._reader: asyncio.Task[None] | None = None
        # The finish reason the running leg's backend sent (its reader saw it), None before: a leg whose reader
        # ended with it finished the request, one without it broke off, both before the client read that far.
        self._leg_finish: str | None = None
        self._last_token_at = 0.0  # when the client's side took the latest token (time.perf_counter(); a move's pause)
        # The source of a move that switched while its destination has not sent its first token: a drain of that
        # source waits for the move to settle (the request may come back), and it does not come back to it then.
        self.pending_from: Backend | None = None
        self._failovers = 0
        # What the prefill leg's engine announced (its answer's kv_transfer_params: the chunks it saved
        # and the prompt's tail), passed on to the decode leg as vLLM's P/D proxies do.
        self._announced: dict[str, Any] | None = None

    # ── what the server and the control endpoints read ───────────────────────

    @property
    def keys(self) -> list[str]:
        """The prefix keys of its prompt (what KV-aware routing compares)."""
        return self._keys

    def describe(self) -> dict[str, Any]:
        """The request as ``GET /hurray/requests`` lists it."""
        return {
            "id": self.id,
            "backend": self.backend.url if self.backend else None,
            "prompt_tokens": len(self.prompt_ids) if self.prompt_ids is not None else None,
            "generated_tokens": len(self.generated),
            "movable": self.unmovable is None,
            "legs": [vars(leg) for leg in self.legs],
        }

    # ── the legs ────────────────────────────────────────────────────────────

    def _leg_body(
        self,
        prefill: bool = False,
        announce: bool = False,
        announced: dict[str, Any] | None = None,
        dest: Backend | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """The path and JSON body of the next leg (``announced``: the prefill engine's own announcement)."""
        body: dict[str, Any]
        if not self.legs or (self.prompt_ids is None and not self.generated):
            path = "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"
            body = dict(self.body)
            remaining = self.max_tokens
        else:
            assert self.prompt_ids is not None
            path = "/v1/completions"
            src = self.body if self.kind == "completion" else {k: self.body[k] for k in _SAMPLING if k in self.body}
            # The prompt ids are the truncated prompt already: truncating the continuation again would cut
            # the generated tokens (right side) or more of the prompt (left side).
            dropped = ("echo", "suffix", "n", "best_of", "truncate_prompt_tokens", "truncation_side")
            body = {k: v for k, v in src.items() if k not in dropped}
            body["prompt"] = self.prompt_ids + self.generated
            remaining = None if self.max_tokens is None else self.max_tokens - len(self.generated)
            context = self._context(dest) if remaining is None and dest is not None else None
            if context is not None:
                # A chat without a limit runs to the end of the context; /v1/completions would stop at 16.
                remaining = context - len(body["prompt"])
            if self.min_tokens:
                body["min_tokens"] = max(0, self.min_tokens - len(self.generated))
            if announced is not None:  # the prefill engine said what it saved, its prompt's tail included
                body["kv_transfer_params"] = announced
            elif announce:  # the source computed the KV of every token but the last generated one
                n = len(self.prompt_ids) + len(self.generated) - 1
                body["kv_transfer_params"] = {"hurray_saved_tokens": n}
            else:
                body.pop("kv_transfer_params", None)
        if prefill:
            remaining = 1
            if self.min_tokens:
                body["min_tokens"] = min(self.min_tokens, 1)
        body.pop("max_completion_tokens", None)
        if remaining is not None:
            body["max_tokens"] = remaining
        body["return_token_ids"] = True
        if self._hold:  # the router strips the stop string itself (_release)
            body["include_stop_str_in_output"] = True
        if prefill:
            # Its one token in one answer, which (unlike a stream) carries the engine's kv_transfer_params.
            body["stream"] = False
            body.pop("stream_options", None)
        else:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return path, body

    def _needs_context(self) -> bool:
        """Whether its next leg is a continuation without a token limit (a chat without one).

        Its ``max_tokens`` is then the rest of the destination's context, which the router must know.
        """
        return self.max_tokens is None and self.prompt_ids is not None

    def _context(self, backend: Backend) -> int | None:
        """The context length a continuation on ``backend`` runs to; None: unknown.

        Its ``max_model_len``, else the largest another backend serving the
        model said (:meth:`~.backends.Backends.context_length`).
        """
        if backend.max_model_len is not None:
            return backend.max_model_len
        return self.router.backends.context_length(self.model)

    async def _ask_context(self, backend: Backend, timeout: float) -> int | None:
        """:meth:`_context` after asking ``backend``'s ``/v1/models`` (within ``timeout``) when no health check has."""
        if backend.max_model_len is None:
            await self.router.backends.read_models(self.router.client, backend, timeout)
        return self._context(backend)

    async def _continue_on(self, backend: Backend, why: str, q: asyncio.Queue[Any], space: asyncio.Semaphore) -> None:
        """:meth:`_start_leg`, once the continuation's limit is known where it needs one, and only if it has one.

        A continuation with no token left to generate (its ``max_tokens``
        spent, or ``backend``'s context full) is never sent: vLLM refuses
        ``max_tokens`` 0, and a prompt that fills its context. The request
        then finishes with ``"length"``, as one server ends a request at
        either limit; a move's destination without room fails as one that
        refuses the continuation (the move is answered 502, the request
        resumes on its source).

        Raises:
            RouterError: 502, a chat without a token limit whose destination's context length is unknown (its
                ``/v1/models`` did not answer): a continuation without ``max_tokens`` would stop after 16 tokens.
        """
        if self._needs_context() and self._context(backend) is None:
            patience = self.router.patience
            if await self._ask_context(backend, patience) is None:
                raise RouterError(
                    502,
                    f"request {self.id} cannot continue on {backend.url}: its max_model_len is unknown (its "
                    "/v1/models did not answer), and a continuation without max_tokens would stop after 16 tokens",
                )
        room = self._room(backend)
        if room is not None and room <= 0:
            spent = self.max_tokens is not None and len(self.generated) >= self.max_tokens
            if why in ("migrated", "drained") and not spent:
                n = len(self.prompt_ids or ()) + len(self.generated)
                message = f"no room left in its context of {self._context(backend)} tokens for the request's {n}"
                q.put_nowait(("error", UpstreamError(message, 400)))  # as its refusal of the continuation would be
            else:
                q.put_nowait(("finish", "length"))
                q.put_nowait(("end", None))
            return
        self._start_leg(backend, why, q, space)

    async def _go_on(
        self, source: Backend, failed: Backend | None, q: asyncio.Queue[Any], space: asyncio.Semaphore
    ) -> None:
        """A move that failed (to ``failed``) left the request off its legs: it resumes on ``source``, where it was.

        Unless ``source`` was drained meanwhile: a drain of it waits for the move to settle, so the request goes
        where that drain's own move would take it (another backend serving its model, the source's KV announced),
        not back to the drained backend. Back there only when no other can take it (not ``failed``, nor one
        without room for it): the drain then moves it itself, or lists it as failed.

        Picked without a wait (no backend checked once more, no ``/v1/models`` asked): a drain that wakes to the
        failed move's answer meanwhile would find the request still on ``failed`` and take it for moved off.
        """
        nxt = self.router.backends.pick(self._keys, model=self.model, exclude=(source,)) if source.draining else None
        if nxt is not None and (nxt is failed or not nxt.serves(self.model)):
            nxt = None
        room = None if nxt is None else self._room(nxt)
        if nxt is not None and ((room is not None and room <= 0) or (self._needs_context() and not self._context(nxt))):
            nxt = None  # it would refuse the continuation, and that refusal would end the client's request
        try:
            await self._continue_on(nxt or source, "resumed" if nxt is None else "drained", q, space)
        finally:
            # Under way until the request runs on a leg again: a drain that saw the move settle before then would
            # find it between legs, still on its drained backend, and try to move it itself.
            self._moving = False

    def _room(self, backend: Backend) -> int | None:
        """How many tokens a continuation on ``backend`` may generate: what is left of its limit and context.

        None: not a continuation (nothing of the request came back yet), or no bound known.
        """
        if self.prompt_ids is None:
            return None
        context = self._context(backend)
        left = [self.max_tokens - len(self.generated)] if self.max_tokens is not None else []
        left += [context - len(self.prompt_ids) - len(self.generated)] if context is not None else []
        return min(left, default=None)

    async def _upstream(self, backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The leg's SSE events, parsed; :class:`UpstreamError` when it cannot start or breaks off."""
        import aiohttp

        try:
            async with self.router.client.post(backend.base + path, json=body) as r:
                if r.status != 200:
                    raw = await r.read()
                    try:
                        payload = json.loads(raw)
                    except ValueError:
                        payload = {"error": {"message": raw.decode(errors="replace")[:2000]}}
                    raise UpstreamError(f"{backend.url} answered HTTP {r.status}", r.status, payload)
                if not body.get("stream"):  # a prefill leg: one JSON answer
                    for answered in self._answer_events(await r.read(), backend):
                        yield answered
                    return
                async for data in sse_data(r, backend.url):
                    if data == b"[DONE]":
                        return
                    try:
                        event = json.loads(data.decode())  # as text: json.loads guesses the encoding of bytes
                    except (ValueError, RecursionError):
                        event = None
                    if not isinstance(event, dict):
                        raise UpstreamError(f"{backend.url} sent a malformed event: {data[:200]!r}")
                    yield event
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(f"{backend.url}: {type(exc).__name__}: {exc}") from exc

    def _answer_events(self, raw: bytes, backend: Backend) -> list[dict[str, Any]]:
        """A non-streamed answer as the events a stream of it would have sent; keeps its kv_transfer_params.

        A completion's choice already has a streamed chunk's fields; a chat
        choice's ``message`` becomes its ``delta`` (fields that are empty
        left out), its prompt's token ids stay at the top as vLLM streams them.
        """
        try:
            answer = json.loads(raw.decode())
        except (ValueError, RecursionError):
            answer = None
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise UpstreamError(f"{backend.url} sent a malformed answer: {raw[:200]!r}")
        assert isinstance(answer, dict)
        params = answer.get("kv_transfer_params")
        self._announced = params if isinstance(params, dict) else None
        choice = dict(choices[0])
        message = choice.pop("message", None)
        if isinstance(message, dict):
            delta = {k: v for k, v in message.items() if k in ("content", "role") or v not in (None, [], "")}
            choice["delta"] = delta
        event: dict[str, Any] = {"choices": [choice]}
        if isinstance(answer.get("model"), str):
            event["model"] = answer["model"]
        if answer.get("prompt_token_ids") is not None:
            event["prompt_token_ids"] = answer["prompt_token_ids"]
        usage = answer.get("usage")
        return [event, {"choices": [], "usage": usage}] if isinstance(usage, dict) else [event]

    async def _read(
        self, backend: Backend, path: str, body: dict[str, Any], q: asyncio.Queue[Any], space: asyncio.Semaphore
    ) -> None:
        """The leg's reader task: record each event's tokens, then queue it; always ends with a marker."""
        chat = path.endswith("/chat/completions")
        base = self._text_offset  # the offsets of the legs before (a leg starts after the last one's end)
        try:
            async for event in self._upstream(backend, path, body):
                delta, prompt = _upstream_delta(event, chat)  # first: an unreadable event takes no slot
                delta.received = time.perf_counter()  # when it was read, not when a slow client made room for it
                await space.acquire()
                lp = delta.logprobs
                offsets, toks = (lp.get("text_offset"), lp.get("tokens")) if isinstance(lp, dict) else (None, None)
                if not chat and offsets and toks and all(type(o) is int for o in offsets) and isinstance(toks[-1], str):
                    lp["text_offset"] = offsets = [o + base for o in offsets]
                    self._text_offset = offsets[-1] + len(toks[-1])  # vLLM's own rule
                if delta.extra and any(delta.extra.values()) and self.unmovable is None:
                    self.unmovable = PARSED  # its text and the parser's state would part at a move
                if prompt is not None and self.prompt_ids is None:
                    self.prompt_ids = prompt
                if self.model is None and isinstance(event.get("model"), str):
                    self.model = event["model"]  # the client left it out: the name the backend serves it under
                if delta.token_ids:
                    self.generated.extend(delta.token_ids)
                if delta.finish_reason is not None:
                    self._leg_finish = delta.finish_reason
                delta.upto = len(self.generated)
                q.put_nowait(("delta", delta))
            q.put_nowait(("end", None))
        except asyncio.CancelledError:
            raise  # its end marker comes from _start_leg's done-callback
        except UpstreamError as exc:
            q.put_nowait(("error", exc))
        except Exception as exc:  # an event of an unexpected shape: the leg failed, it must not hang its client
            log.warning("router: %s: unreadable event from %s", self.id, backend.url, exc_info=True)
            q.put_nowait(("error", UpstreamError(f"{backend.url} sent an event the router cannot read: {exc!r}")))

    def _start_leg(self, backend: Backend, why: str, q: asyncio.Queue[Any], space: asyncio.Semaphore) -> None:
        prefill = why == "prefill"
        announced, self._announced = (self._announced if why == "decode" else None), None
        path, body = self._leg_body(
            prefill=prefill,
            # A decode leg passes on what the prefill engine announced, and nothing if it announced nothing (its
            # connector saved nothing: a decode engine told otherwise would wait for chunks nobody writes).
            announce=why in ("migrated", "drained", "resumed"),
            announced=announced,
            dest=backend,
        )
        if self.backend is not None:
            self.backend.in_flight -= 1
        self.backend = backend
        backend.in_flight += 1
        if not self.legs:
            self.router.metrics.routed(backend.url)
        # Every leg's backend ends up holding the prompt's KV (computed, loaded or moved there): a later
        # request with the same prefix is best sent there too, also after a move, a failover or a P/D split.
        backend.remember(self._keys)
        warmed, self._warmups = self._warmups, (None, [])
        # A move that failed resumes on its source: the destination's warm-ups are not that leg's.
        leg = Leg(backend.url, why, len(self.generated), warmups=warmed[1] if warmed[0] is backend else [])
        if len(self.legs) and isinstance(body.get("kv_transfer_params"), dict):
            leg.announced = body["kv_transfer_params"]
        self.legs.append(leg)
        self._leg_finish = None
        self._reader = asyncio.create_task(self._read(backend, path, body, q, space), name=f"leg {self.id}")
        # A cancelled leg ends with a marker too, queued here: a task cancelled before its first step (a
        # failover or a move in the same loop iteration that started it) never runs its body, and without
        # the marker its client's stream would wait forever.
        self._reader.add_done_callback(lambda t: q.put_nowait(("end", None)) if t.cancelled() else None)

    # ── control: called from other requests' handlers ───────────────────────

    async def migrate(self, to: Backend, why: str = "migrated", timeout: float = MOVE_TIMEOUT_S) -> dict[str, Any]:
        """Move the request to ``to``; returns once it runs there (its first token), or raises :class:`RouterError`.

        ``timeout`` bounds the whole move, warm-ups included. If ``to`` cannot
        take it (a warm-up fails, it is drained or found dead), the source is
        left alone and this raises with the reason; if ``to`` fails after the
        switch, before its first token, the request resumes on its source.
        A request whose backend has sent nothing yet (its queue, its prefill)
        is started over on ``to``: its client has seen nothing. One in its
        prefill leg is not moved (409): it leaves the prefill backend for a
        decode backend when that leg ends.
        """
        if self.unmovable is not None:
            raise RouterError(409, f"request {self.id} cannot be moved: {self.unmovable}")
        if self.finished:
            raise RouterError(409, f"request {self.id} has finished")
        if self._interrupt is not None or self._moving:
            raise RouterError(409, f"request {self.id} is being moved already")
        if self.backend is not None and self.backend.prefill:
            # A move whose destination then failed resumed it on its source: the whole decode ran on the prefill
            # backend. Its prefill is one short answer, and a decode backend takes it when that ends.
            raise RouterError(
                409,
                f"request {self.id} is in its prefill leg on {self.backend.url}; it moves to a decode backend "
                "when the prefill ends (POST /hurray/migrate then)",
            )
        if self.backend is to:
            raise RouterError(409, f"request {self.id} runs on {to.url} already")
        if self._reader is None or not self.legs or (self.prompt_ids is None and self.generated):
            raise RouterError(409, f"request {self.id} has not started yet: its prompt's tokens are not known")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self._moving = True  # until the destination's first token (or the move's failure)
        self._warmups = (to, [])
        # Counted in the destination's load from now on: the requests of one drain pick their destinations
        # before any of them switches (and its in-flight count changes).
        to.planned += 1
        try:
            return await self._move(to, why, timeout, deadline)
        finally:
            to.planned -= 1

    async def _move(self, to: Backend, why: str, timeout: float, deadline: float) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        legs = len(self.legs)
        ended = False  # the request finished (or its leg ended) before the switch: no failed migration
        try:
            if self._needs_context():
                # Its continuation runs to the end of the destination's context: without knowing that, it would
                # stop after 16 tokens. Asked for now if no health check has; unknown, the request stays.
                patience = self.router.patience
                if await self._ask_context(to, min(patience, max(deadline - loop.time(), 0.1))) is None:
                    raise RouterError(
                        502,
                        f"to: {to.url} could not take it: its max_model_len is unknown (its /v1/models did not "
                        "answer), and the request has no max_tokens to continue with",
                    )
            # Warm up again while a warm-up took long enough for the source to generate more than a few
            # tokens (a long context): what the destination must catch up on at the switch stays small.
            # Nothing to warm up before the prompt's tokens are known: the destination starts it over.
            for _ in range(WARMUPS if self.prompt_ids is not None else 0):
                # Drained or found dead during the last one: no more warm-ups there (each could wait long).
                self._check_destination(to)
                left = deadline - loop.time()
                if left <= 0:
                    raise RouterError(504, f"to: {to.url} did not warm up within the move's {timeout:.0f} s")
                before = len(self.generated)
                await self._prewarm(to, left)
                if len(self.generated) - before <= WARMUP_SLACK or self.finished:
                    break
            if not self.finished and (len(self.legs) != legs or self._interrupt is not None):
                # Its backend failed (or its prefill ended) while the destination warmed up: it runs, or is about
                # to run, elsewhere already; moving it now would move it from wherever that is, or onto itself.
                where = self.backend.url if self.backend is not None else "another backend"
                raise RouterError(409, f"request {self.id} changed backends while {to.url} warmed up (now {where})")
            if self.ended:
                ended = True
                raise RouterError(409, f"request {self.id} has finished")
            if self._reader is None or self._reader.done():
                # Its leg broke off (or its prefill ended) and the events before that wait for a client that reads
                # slowly: it goes on elsewhere once they are read. Not "finished": it is not, and a drain would
                # then leave it unreported on the backend it drains. Not a failed migration either (ended): a
                # source that broke as it was left counts as a failover.
                ended = True
                where = self.backend.url if self.backend is not None else "its backend"
                raise RouterError(
                    409,
                    f"request {self.id}'s stream from {where} has ended unfinished; it continues on another backend "
                    "once its client reads the events before that end (POST /hurray/migrate again then)",
                )
            if self.unmovable is not None:  # its backend's parser showed itself during the warm-ups
                raise RouterError(409, f"request {self.id} cannot be moved: {self.unmovable}")
            if self.prompt_ids is None and self.generated:  # events without the prompt's ids: no continuation
                raise RouterError(409, f"request {self.id} has not started yet: its prompt's tokens are not known")
            self._check_destination(to)
        except BaseException as exc:
            self._moving = False
            # The move began (its warm-ups, its checks) and failed before the switch: a failed migration, as one
            # whose destination fails after it. Not when the request ended first (it has nothing left to move),
            # nor when the caller went away (a cancellation, not a RouterError).
            if isinstance(exc, RouterError) and not (ended or self.finished):
                self.router.metrics.migrated(False)
            raise
        done: asyncio.Future[dict[str, Any]] = loop.create_future()
        # Answered after a 504 nobody waits for: its outcome is read here, not logged as never retrieved.
        done.add_done_callback(lambda d: d.cancelled() or d.exception())
        self._interrupt = _Interrupt("move", to, why, done)
        self._reader.cancel()
        try:
            # At least a moment for the switch itself, however long the warm-ups took.
            return await asyncio.wait_for(asyncio.shield(done), max(deadline - loop.time(), 0.1))
        except TimeoutError:
            if self._interrupt is not None and self._interrupt.done is done:
                # The switch waits in the client's own stream behind events it has not read yet.
                raise RouterError(
                    504,
                    f"request {self.id} has not moved to {to.url} within {timeout:.0f} s: its client has not "
                    "read the events before the switch; it moves when the client reads them",
                ) from None
            raise RouterError(504, f"request {self.id} did not start on {to.url} within {timeout:.0f} s") from None

    @staticmethod
    def _check_destination(to: Backend) -> None:
        """:class:`RouterError` 409 when ``to`` was drained or found dead since the move began: the request stays."""
        if to.draining or not to.healthy:
            raise RouterError(409, f"to: {to.url} was {'drained' if to.draining else 'found dead'} meanwhile")

    @property
    def ended(self) -> bool:
        """Whether the request needs its backend no more: it ended (finished or failed), or its backend sent the finish.

        The latter before a client that reads slowly has read that far (the
        events before it wait in its queue). Not when its leg broke off
        unfinished: once its client reads that far, it continues elsewhere.
        """
        if self.finished or self.finish_reason is not None:
            return True
        if self._leg_finish is None or self._reader is None or not self._reader.done():
            return False
        # A prefill leg's one-token limit ends that leg, not the request: decoding goes on elsewhere.
        return not (self.legs[-1].why == "prefill" and self._more_to_decode(Delta(finish_reason=self._leg_finish)))

    @property
    def moving(self) -> bool:
        """Whether a move of it is under way (from its first warm-up to the destination's first token)."""
        return self._moving or (self._interrupt is not None and self._interrupt.kind == "move")

    async def _prewarm(self, to: Backend, timeout: float) -> None:
        """Have ``to`` load the request's KV into its own cache while the source still decodes.

        A one-token completion of the tokens so far, announcing the source's
        chunks (``hurray_saved_tokens``): the destination loads them, waiting
        for pushes still on their way, and keeps them in its prefix cache.
        The continuation after the switch then finds them there and loads or
        computes only what came since: the pause does not grow with the
        context. Its token is discarded.

        Raises:
            RouterError: 502, ``to`` did not answer it with 200 (it could not
                take the continuation either: the move stops before the
                source is touched); 504, not within ``timeout``.
        """
        import aiohttp

        assert self.prompt_ids is not None
        ids = self.prompt_ids + self.generated
        body: dict[str, Any] = {
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {"hurray_saved_tokens": len(ids) - 1},
        }
        if self.model is not None:
            body["model"] = self.model  # a LoRA adapter is a model name: its KV is its own
        if self.body.get("cache_salt"):  # the tenant's own cache, and its chunks' keys (docs/connector.md)
            body["cache_salt"] = self.body["cache_salt"]
        # A timeout of its own replaces the session's whole: its connect limit is restated.
        limit = aiohttp.ClientTimeout(total=timeout, connect=self.router.config.connect_timeout)
        try:
            async with self.router.client.post(to.base + "/v1/completions", json=body, timeout=limit) as r:
                data = await r.read()
                status = r.status
        except TimeoutError as exc:  # connecting (connect_timeout) or answering (what the move had left)
            connect = self.router.config.connect_timeout
            raise RouterError(
                504,
                f"to: {to.url} did not answer a warm-up in time ({type(exc).__name__}; the move had {timeout:.0f} s "
                f"left, a connection may take {connect:.0f} s)",
            ) from None
        except aiohttp.ClientError as exc:
            raise RouterError(502, f"to: {to.url} could not take it: {type(exc).__name__}: {exc}") from None
        if status != 200:
            try:
                err = json.loads(data)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                err = data[:200].decode(errors="replace")
            raise RouterError(502, f"to: {to.url} could not take it: its warm-up answered HTTP {status}: {err}")
        self._warmups[1].append({"tokens": len(ids), "cached_tokens": _cached_tokens(data)})

    def fail_over(self) -> None:
        """Its backend was found dead (health checks): continue elsewhere now, not at the next read."""
        # A reader that has ended (its end is queued) is not failed over: it may have finished the request.
        if self._interrupt is None and self._reader is not None and not self._reader.done() and not self.finished:
            self._interrupt = _Interrupt("failover")
            self._reader.cancel()

    # ── the client's side ───────────────────────────────────────────────────

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """Everything the client is sent, leg after leg, ending with a finish reason (or an error).

        Raises:
            RouterError: no backend can take the request.
            UpstreamError: the first leg was refused (the client gets the backend's own answer).
        """
        backends = self.router.backends
        q: asyncio.Queue[Any] = asyncio.Queue()
        space = asyncio.Semaphore(BUFFERED_EVENTS)
        # A chat without a token limit is split only where the decode leg's limit (the rest of the context) is
        # known: without it, that leg would stop after 16 tokens; unsplit, the backend applies its own defaults.
        split = backends.has_prefill and self.unmovable is None
        split = split and (self.max_tokens is not None or backends.context_length(self.model) is not None)
        # max_tokens 0 is refused by vLLM (unless with echo, which is relayed); a prefill leg's own limit of 1
        # would generate a token instead: the request goes whole to a decode backend, which answers as vLLM does.
        split = split and self.max_tokens != 0

        # Split only where a decode leg can run: with no usable decode backend serving its model, the prefill would
        # run for nothing and the client get an error after its first token; unsplit, it is answered up front.
        split = split and any(b.serves(self.model) for b in backends.usable())

        async def pick(avoid: Backend | None = None, prefill: bool = False) -> Backend | None:
            exclude = () if avoid is None else (avoid,)
            return await self.router.pick(self._keys, model=self.model, prefill=prefill, exclude=exclude)

        first = await pick(prefill=True) if split else None
        if first is not None and not first.serves(self.model):
            # pick() falls back to any prefill backend: none serves the model (a LoRA adapter loaded on decode
            # backends only), and this one would refuse it (404). It runs whole on a decode backend that does.
            first = None
        first = first or await pick()
        if first is None:
            raise RouterError(503, backends.unroutable())
        phase = "prefill" if first.prefill else "routed"
        self._start_leg(first, phase, q, space)
        pending: _Interrupt | None = None  # a move whose destination has not answered yet (from self.pending_from)
        try:
            while True:
                kind, item = await q.get()
                if kind == "finish":  # no leg to run (_continue_on): the request ends here as one server ends it
                    kind, item = "delta", Delta(finish_reason=item, upto=len(self.generated))
                elif kind == "delta":
                    space.release()
                if kind == "delta":
                    delta: Delta = item
                    if delta.usage is not None:
                        details = delta.usage.get("prompt_tokens_details") or {}
                        self.legs[-1].cached_tokens = details.get("cached_tokens")
                        continue
                    if pending is not None and delta.token_ids:
                        self._answer(pending, self.pending_from, delta.received)
                        pending, self.pending_from, self._moving = None, None, False
                    if delta.token_ids:
                        self._last_token_at = time.perf_counter()
                    if delta.finish_reason is not None and phase == "prefill" and self._more_to_decode(delta):
                        delta.finish_reason = None  # the prefill's one token: decoding goes on elsewhere
                    stopped = self._release(delta)  # a stop string across legs ends the request here
                    if stopped:
                        self._end_leg_at(delta)
                    if delta.finish_reason is not None:
                        self.finish_reason = delta.finish_reason
                    yield delta
                    if stopped:
                        self.cached_tokens = self.legs[-1].cached_tokens
                        return
                    continue
                # The leg ended: finished, interrupted (a move or a failover), or broken.
                interrupt, self._interrupt = self._interrupt, None
                if kind == "end" and phase == "prefill" and interrupt is None and self._decoding_left():
                    nxt = await pick()
                    if nxt is None:
                        raise RouterError(503, f"after the prefill: {backends.unroutable()}")
                    phase = "decode"
                    await self._continue_on(nxt, "decode", q, space)
                    continue
                if kind == "end" and interrupt is None:
                    if self.finish_reason is not None:
                        self.finished = True
                        self.cached_tokens = self.legs[-1].cached_tokens
                        return
                    item = UpstreamError(f"{self.legs[-1].backend} ended the stream without finishing it")
                    kind = "error"
                phase = "decode"
                if interrupt is not None and interrupt.kind == "move":
                    assert interrupt.to is not None
                    if self.finish_reason is not None:  # it finished before the move took effect: no migration
                        self._refuse(interrupt, 409, f"request {self.id} has finished", count=False)
                        self.finished = True
                        return
                    to = interrupt.to
                    if kind == "error" and _refusal(item):
                        # Its backend refused it as it was left (vLLM's error event): the refusal is the answer.
                        self._refuse(
                            interrupt, 409, f"request {self.id} was refused by its backend: {item}", count=False
                        )
                        self._moving = False
                        interrupt = None
                    elif to.draining or not to.healthy:
                        # Drained or found dead while the switch waited (behind events its client had not read):
                        # the request stays where it was, as a move refused at once would have left it.
                        state = "drained" if to.draining else "found dead"
                        self._refuse(interrupt, 409, f"to: {to.url} was {state} before the request switched")
                        if kind == "end" and self.backend is not None and self.backend.healthy:
                            await self._go_on(self.backend, to, q, space)
                            continue
                        self._moving = False
                        interrupt = None  # its source broke as it was left: a failover, below
                if interrupt is not None and interrupt.kind == "move":
                    assert interrupt.to is not None
                    source = self.pending_from = self.backend
                    pending, interrupt.since = interrupt, self._last_token_at
                    self._moving = True
                    why = interrupt.why
                    # The source broke as it was left, or the health checks found it dead while the switch waited
                    # behind events its client had not read: a failover, announcing nothing (its KV may be lost).
                    if source is not None and (kind == "error" or not source.healthy):
                        backends.mark_down(source)
                        why, interrupt.broke = "failover", True
                        self._failovers += 1
                        self.router.metrics.failed_over()
                    await self._continue_on(interrupt.to, why, q, space)
                    continue
                if self.finish_reason is not None:
                    # The client has its finish already: the backend broke off (or was found dead) after sending
                    # it. The request is complete; continuing it elsewhere would send tokens after its end.
                    self.finished = True
                    self.cached_tokens = self.legs[-1].cached_tokens
                    return
                # A failure: the backend died, broke off or refused. A refusal (4xx: an HTTP answer, or vLLM's error
                # event in the stream) is the client's answer, on any leg (a failover's too: a bad request stays bad
                # elsewhere): before any token its status and body, after tokens its error event.
                exc = item if isinstance(item, UpstreamError) else UpstreamError("backend failed health checks")
                if pending is not None:
                    # The destination of a move failed before its first token: answer the move, resume on the source.
                    where = pending.to.url if pending.to else "?"
                    self._refuse(pending, 502, f"{where} could not take it: {exc}", count=not pending.broke)
                    if pending.to is not None and not _refusal(exc):
                        # Unreachable, 5xx or broken off: taken out of routing as any backend that fails a leg.
                        backends.mark_down(pending.to)
                    failed, pending = pending.to, None
                    source, self.pending_from = self.pending_from, None
                    if source is not None and source.healthy:
                        await self._go_on(source, failed, q, space)
                        continue
                    self._moving = False
                    # ... and its source is dead: it continues elsewhere (a refusal was the move's, not the request's).
                elif _refusal(exc):
                    raise exc  # neither marked down (it says nothing of the backend's health) nor failed over
                if self.backend is not None and not _refusal(exc):
                    backends.mark_down(self.backend)
                self._failovers += 1
                nxt = await pick(avoid=self.backend)
                started = self.prompt_ids is not None or bool(self.generated)
                if nxt is not None and started and not await self.router.serves(nxt, self.model):
                    # pick() falls back to any backend: one known not to serve the model would refuse (404) a request
                    # that is not bad. (One that has sent nothing yet is started over: the client gets the answer.)
                    nxt, why = None, f"no other healthy backend serves {self.model!r}"
                else:
                    why = "no other healthy backend" if nxt is None else "too many failures"
                lost = self.prompt_ids is None and bool(self.generated)  # cannot happen with vLLM: it sends them first
                if nxt is None or self._failovers > MAX_FAILOVERS or lost:
                    raise RouterError(502, f"request {self.id} failed on {self.legs[-1].backend}: {exc} ({why})")
                where = self.backend.url if self.backend is not None else "?"
                log.warning("router: %s failed on %s (%s); continuing on %s", self.id, where, exc, nxt.url)
                self.router.metrics.failed_over()
                await self._continue_on(nxt, "failover", q, space)
        finally:
            self.finished = True
            self.pending_from = None
            if self._reader is not None and not self._reader.done():
                self._reader.cancel()
            if self.backend is not None:
                self.backend.in_flight -= 1
                self.backend = None
            # Neither is a failed migration: the request ended (finished, or its client left) before it switched.
            if pending is not None:
                self._refuse(pending, 409, f"request {self.id} ended before it ran on the destination", count=False)
            if self._interrupt is not None and self._interrupt.done is not None:
                self._refuse(self._interrupt, 409, f"request {self.id} has finished", count=False)

    def _release(self, delta: Delta) -> bool:
        """Pass ``delta`` on as vLLM would have: stop strings matched across legs, text a stop may start held back.

        vLLM (0.32) matches stop strings over the new text and the (stop's
        length - 1) characters before it, once more tokens than
        ``min_tokens`` were generated, and takes the one that completes
        first (of two ending together, the first in the request's order). A
        leg's backend sees only its own text, so a stop string that starts
        before a switch is matched here by the same rule. The text then ends
        before the stop string (after it with ``include_stop_str_in_output``),
        and the delta finishes with ``"stop"``. A delta is taken as one
        token: a backend streaming several tokens per event (speculative
        decoding, ``stream_interval``) keeps them all where vLLM would drop
        those after the one completing the stop string.

        Returns:
            True when such a match ends the request at this delta while its
            leg goes on: the caller ends the leg.
        """
        if not self._stops:
            return False
        new = delta.text
        window = self._tail + new
        unsent = len(self._tail) - len(self._held)  # window[unsent:] is the held text and the new
        hit = self._stop_in(window, len(new), delta.upto)
        if hit is not None:
            stop, at = hit
            delta.text = window[unsent : at + len(stop) if self._keep_stop else at]
            ended_here = delta.finish_reason is None
            delta.finish_reason, delta.stop_reason = "stop", stop
            self._held = self._tail = ""
            return ended_here
        if delta.finish_reason is None:
            cut = max(unsent, len(window) - self._hold)
            delta.text, self._held = window[unsent:cut], window[cut:]
        else:
            text, stop = window[unsent:], delta.stop_reason
            if delta.finish_reason == "stop" and isinstance(stop, str) and stop and text.endswith(stop):
                text = text if self._keep_stop else text[: -len(stop)]
            elif delta.finish_reason == "stop" and self._hold and len(delta.token_ids) == 1:
                # A stop token (EOS, stop_token_ids): vLLM leaves its text out unless asked to keep stop
                # strings, which the router asked the leg to do.
                text = window[unsent : len(window) - len(new)]
            delta.text, self._held = text, ""
        self._tail = window[max(0, len(window) - self._tail_len) :]
        return False

    def _stop_in(self, window: str, new: int, upto: int) -> tuple[str, int] | None:
        """The stop string that completes first in the last ``new`` characters of ``window``, and where it starts."""
        if self.min_tokens and upto <= self.min_tokens:
            return None
        best: tuple[str, int] | None = None
        for stop in self._stops:
            at = window.find(stop, max(0, len(window) - new - len(stop) + 1))
            if at != -1 and (best is None or at + len(stop) < best[1] + len(best[0])):
                best = (stop, at)  # the first to complete; of two ending together, the first in order
        return best

    def _end_leg_at(self, delta: Delta) -> None:
        """The request ended at ``delta`` (a stop string across legs): its leg's later tokens are not its."""
        if self._reader is not None:
            self._reader.cancel()  # it extends generated no more: cancelled at its next await
        del self.generated[delta.upto :]
        self.finished = True

    def _more_to_decode(self, delta: Delta) -> bool:
        """Whether a prefill leg's end is only the leg's own one-token limit."""
        return delta.finish_reason == "length" and self._decoding_left()

    def _decoding_left(self) -> bool:
        """Whether the request goes on after its prefill leg: unfinished, with tokens left of its limit and context.

        The context: the largest a backend serving its model has (as for a
        continuation's limit, :meth:`~.backends.Backends.context_length`).
        A prompt one token short of it ends with the prefill's token and
        ``"length"``, as on one server; a decode leg would be refused.
        """
        if self.finish_reason is not None:
            return False
        n = len(self.generated)
        context = self.router.backends.context_length(self.model)
        if context is not None and self.prompt_ids is not None and len(self.prompt_ids) + n >= context:
            return False
        return self.max_tokens is None or n < self.max_tokens

    def _answer(self, move: _Interrupt, source: Backend | None, received: float) -> None:
        """The destination produced its first token, read at ``received``: the move is done."""
        # That token's own stamp: the reader may have read several more of the destination's by now.
        pause = received - move.since if move.since else None
        if not move.broke:  # counted as a failover when its source broke
            self.router.metrics.migrated(True, pause)
        if move.done is not None and not move.done.done():
            move.done.set_result(
                {
                    "id": self.id,
                    "from": source.url if source else None,
                    "to": move.to.url if move.to else None,
                    "generated_tokens": len(self.generated),
                    "pause_ms": None if pause is None else round(pause * 1e3, 3),
                }
            )

    def _refuse(self, move: _Interrupt, status: int, message: str, count: bool = True) -> None:
        """Answer ``move`` with an error; ``count``: as a failed migration (not when the request ended first)."""
        if count:
            self.router.metrics.migrated(False)
        if move.done is not None and not move.done.done():
            move.done.set_exception(RouterError(status, message))
