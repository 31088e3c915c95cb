"""Move a decoding request from one vLLM server to another.

Both servers run :class:`~hurray_vllm.adapters.vllm.connector.HurrayConnector`:
the source with ``hurray_url`` pointing at the destination's receiver
(``hurray_listen``), so every chunk of KV it completes, prompt and generated
tokens alike, is streamed to the destination as it is computed. Migration
is then two completions:

1. the source decodes ``after`` tokens and stops; its answer's
   ``kv_transfer_params`` say up to which token its chunks are saved (and
   on their way to the destination: pushes run in the background);
2. the destination continues from prompt + those tokens with those
   ``kv_transfer_params``, so that it waits for the chunks still arriving,
   and loads the stored prefix instead of recomputing it (only the tail of
   less than one chunk is recomputed).

With greedy sampling the concatenation equals an unmoved run. Only the
OpenAI-compatible HTTP API is used (``/v1/completions`` with token-id
prompts and ``return_token_ids``), so nothing here imports vLLM. Servers
started with vLLM's ``--api-key`` are given it as ``Authorization: Bearer
KEY`` (``api_key=``, else :data:`BACKEND_API_KEY_ENV`), as the router gives
its backends.
"""

from __future__ import annotations

import errno
import http.client
import json
import numbers
import os
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

from ...errors import HurrayArgumentError, HurrayFormatError, integer_arg, plain_int
from ...transport.base import split_url

__all__ = ["BACKEND_API_KEY_ENV", "MigrationResult", "complete", "migrate"]

#: The environment variable the vLLM servers' API key is read from when none is given (``--backend-api-key``,
#: ``api_key=``): a key on a command line is visible to every user of the machine (``ps``). Defined here, not in
#: the router that reads it too (:class:`~hurray_vllm.app.router.RouterConfig`), because adapters must not import
#: the app layer: the router imports it from here, so that both read the same variable.
BACKEND_API_KEY_ENV = "HURRAY_BACKEND_API_KEY"

# The most an answer may hold. A completion's JSON is kilobytes; a wrong URL (a file server, a stream) could
# otherwise be read into memory without end.
_MAX_ANSWER_BYTES = 64 << 20
_PIECE = 64 << 10


@dataclass(frozen=True)
class MigrationResult:
    """Tokens produced on each side, and what the destination did not recompute."""

    source_tokens: list[int]
    destination_tokens: list[int]
    destination_cached_tokens: int | None

    @property
    def tokens(self) -> list[int]:
        """All generated tokens: the source's, then the destination's."""
        return self.source_tokens + self.destination_tokens


def complete(
    server: str,
    prompt: Iterable[int],
    max_tokens: int,
    *,
    model: str | None = None,
    timeout: float = 600.0,
    extra: dict[str, Any] | None = None,
    api_key: str | None = None,
) -> dict[str, Any]:
    """One greedy ``/v1/completions`` call with a token-id prompt; returns the parsed answer.

    ``api_key`` is sent as ``Authorization: Bearer KEY`` (a server started
    with vLLM's ``--api-key``); ``None``: read from :data:`BACKEND_API_KEY_ENV`,
    and without it none is sent.

    Raises:
        HurrayArgumentError: ``server`` is not an ``http(s)://HOST[:PORT]`` base URL, ``prompt``
            is not a non-empty sequence of token ids (integers >= 0), ``max_tokens`` is not an
            integer >= 1, ``timeout`` is not a positive number of seconds, or ``api_key`` (or
            :data:`BACKEND_API_KEY_ENV`) is empty or not a header's printable ASCII.
        HurrayFormatError: the answer is not what a vLLM server answers.
        OSError: the server cannot be reached, fails, redirects (``EPROTO``: give the URL it
            names), or takes longer than ``timeout`` (``ETIMEDOUT``); ``EACCES`` when it
            answers 401 or 403 (it needs an API key, or refused the one given).
    """
    ids, max_tokens, timeout = _checked(prompt, max_tokens, timeout)
    _check_url("server", server)
    key = _api_key(api_key)
    body: dict[str, Any] = {
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if model is None:
        model = _first_model(server, timeout, key)
    body["model"] = model
    body.update(extra or {})
    req = _request(f"{server.rstrip('/')}/v1/completions", key, json.dumps(body).encode())
    answer = _call(req, timeout)
    if not isinstance(answer, dict):
        raise HurrayFormatError("answer", f"{server}/v1/completions did not answer a JSON object")
    return answer


def _checked(prompt: Iterable[int], max_tokens: object, timeout: object) -> tuple[list[int], int, float]:
    """``prompt`` as a list of ints, ``max_tokens`` and ``timeout`` checked: the arguments of a completion.

    Before any call, so that a mistake is said as the caller's, naming the argument: a bad ``timeout`` made
    socket errors (0: non-blocking) or an ``OverflowError`` (inf), a float ``max_tokens`` a server's refusal.
    The prompt is read once (``migrate`` sends it twice: an iterator would be empty the second time) and
    becomes plain ints, so that numpy and torch token ids (what tokenizers return) go into the JSON.

    Raises:
        HurrayArgumentError: (field ``prompt``) text, an empty prompt, or an id that is not an integer
            >= 0; (``max_tokens``) not an integer >= 1; (``timeout``) not a positive, finite number.
    """
    if isinstance(prompt, (str, bytes, bytearray)):
        raise HurrayArgumentError("prompt", "expected token ids, got text: tokenize it with the servers' tokenizer")
    try:
        ids = [plain_int(t) for t in prompt]
    except TypeError as exc:
        raise HurrayArgumentError(
            "prompt", f"expected a sequence of integer token ids, got {type(prompt).__name__} ({exc})"
        ) from None
    if not ids:
        raise HurrayArgumentError("prompt", "expected at least one token id, got none")
    if min(ids) < 0:
        raise HurrayArgumentError("prompt", f"token ids are >= 0, got {min(ids)}")
    max_tokens = integer_arg(max_tokens, "max_tokens")
    if max_tokens < 1:
        raise HurrayArgumentError("max_tokens", f"expected at least 1 token to generate, got {max_tokens}")
    # 0 would make every socket non-blocking, NaN and inf are no timeout (and inf overflows the socket's).
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < float(timeout) < 1e9:
        raise HurrayArgumentError("timeout", f"expected positive seconds, got {timeout!r}")
    return ids, max_tokens, float(timeout)


def _api_key(api_key: object) -> str | None:
    """The key to send: ``api_key``, else :data:`BACKEND_API_KEY_ENV`'s; ``None``: send none.

    The variable set but empty counts as unset, as the router reads it. An empty ``api_key`` is the caller's
    mistake (a key that did not come through), not a request for no key: ``None`` says that.

    Raises:
        HurrayArgumentError: an empty key, or one no HTTP header carries as given (field ``api_key``, or the
            variable's name). The message never holds the key.
    """
    where = "api_key"
    if api_key is None:
        api_key = os.environ.get(BACKEND_API_KEY_ENV) or None
        if api_key is None:
            return None
        where = f"${BACKEND_API_KEY_ENV}"
    if not isinstance(api_key, str) or not api_key:
        got = "an empty string" if isinstance(api_key, str) else type(api_key).__name__
        raise HurrayArgumentError(
            where, f"expected the servers' API key (vLLM's --api-key), got {got}; None reads ${BACKEND_API_KEY_ENV}"
        )
    # http.client refuses a header with a line break in a ValueError that quotes it (the key, into an error
    # message and a log), and servers strip the spaces around a header's value (a key that can never match).
    if not all(" " <= c <= "~" for c in api_key) or api_key != api_key.strip():
        raise HurrayArgumentError(
            where, "the API key holds characters other than printable ASCII, or spaces at an end (not shown here)"
        )
    return api_key


def _request(url: str, key: str | None, data: bytes | None = None) -> urllib.request.Request:
    """A call to ``url`` (a POST of JSON ``data``, else a GET), with ``key`` as ``Authorization: Bearer KEY``."""
    req = urllib.request.Request(url, data=data)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key is not None:
        # Unredirected: urllib would carry a plain header along a redirect to any host, and the key with it.
        req.add_unredirected_header("Authorization", f"Bearer {key}")
    return req


def _check_url(what: str, url: object) -> None:
    """Refuse what is not a server's base URL, ``http(s)://HOST[:PORT]`` (a path prefix allowed), naming ``what``.

    The caller's mistake, said as such before any call: urllib would raise a bare ``ValueError`` (no
    scheme), or report a server name as a failed connection.
    """
    check_server_url(url, what)


def check_server_url(url: object, field: str, *, path_ok: bool = True) -> None:
    """Refuse what is not a server's base URL, ``http(s)://HOST[:PORT][/PREFIX]``, naming ``field``.

    The rules of every URL a caller gives (:func:`~hurray_vllm.transport.base.split_url`): no user
    info, query, fragment or control characters. ``hurray-vllm migrate`` checks its ``--from`` and
    ``--to`` with this too, so that the command and :func:`migrate` take the same URLs.

    Args:
        url: The URL.
        field: The argument the error names.
        path_ok: Whether a path prefix may follow the host (``http://gw/vllm``).

    Raises:
        HurrayArgumentError: ``url`` is not such a URL.
    """
    split_url(
        url,
        ("http", "https"),
        field=field,
        path_ok=path_ok,
        port_required=False,
        expected="not a server's base URL (e.g. http://10.0.0.5:8000)",
    )


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Follow no redirect: the answer comes back as the 3xx :class:`~urllib.error.HTTPError` it is.

    urllib turns a redirected POST into a body-less GET (a completion answered 405, or another endpoint's
    answer), and would send the request to whatever host the server names. Every call is refused alike, the
    GETs too, so that the first call says which URL to give instead, not the first POST after it.
    """

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Watchdog:
    """One deadline for a whole call: at it, the call's connection is shut down, ending whatever read waits.

    urlopen's ``timeout`` bounds each socket read only: a server sending its status line, headers or body a
    byte per read would hold the call for as long as it liked. A shutdown (not a close: the reading thread
    owns the socket) makes a blocked read return at once; :func:`_call` then says the call timed out. The
    socket is taken once connected (:meth:`attach`): connecting, and a TLS handshake, keep urlopen's bound.
    """

    def __init__(self, timeout: float) -> None:
        self.fired = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(timeout, self._fire)
        self._timer.daemon = True

    def __enter__(self) -> _Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def attach(self, sock: socket.socket | None) -> None:
        """Watch ``sock``, the call's connected socket; shut it at once if the deadline has passed."""
        with self._lock:
            self._sock = sock
            if self.fired:
                _shut(sock)

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            _shut(self._sock)


def _shut(sock: socket.socket | None) -> None:
    """Shut ``sock`` down both ways, if it is still open (the call may just have closed it)."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _watched(http_class: Any, watch: _Watchdog) -> Any:
    """``http_class`` (an ``http.client`` connection class) whose connections hand their socket to ``watch``."""

    def connection(*args: Any, **kwargs: Any) -> Any:
        conn = http_class(*args, **kwargs)
        connect = conn.connect

        def connect_and_attach() -> None:  # sock: TLS-wrapped for https, the socket every later read goes through
            connect()
            watch.attach(conn.sock)

        conn.connect = connect_and_attach
        return conn

    return connection


class _Watching(urllib.request.AbstractHTTPHandler):
    """An HTTP(S) handler whose connections hand their socket to the call's :class:`_Watchdog`."""

    def __init__(self, watch: _Watchdog) -> None:
        super().__init__()
        self.watch = watch

    def do_open(self, http_class: Any, req: urllib.request.Request, **kwargs: Any) -> Any:
        return super().do_open(_watched(http_class, self.watch), req, **kwargs)


class _WatchedHTTP(_Watching, urllib.request.HTTPHandler):
    pass


class _WatchedHTTPS(_Watching, urllib.request.HTTPSHandler):
    pass


def _opener(watch: _Watchdog) -> urllib.request.OpenerDirector:
    """The opener of a call: it follows no redirect, and ``watch`` shuts its connections down at the deadline."""
    return urllib.request.build_opener(_NoRedirect, _WatchedHTTP(watch), _WatchedHTTPS(watch))


def _redirected(exc: urllib.error.HTTPError, url: str) -> OSError:
    """The error for a redirect of the call to ``url``: where it points, as the base URL to give instead."""
    where = exc.headers.get("Location") if exc.headers is not None else None
    if not where:
        return OSError(errno.EPROTO, f"HTTP {exc.code} {exc.reason}: a redirect without a Location", url)
    new = urljoin(url, where)
    endpoint = url[url.rfind("/v1/") :] if "/v1/" in url else ""
    base = new[: -len(endpoint)] if endpoint and new.endswith(endpoint) else new
    said = f"HTTP {exc.code} {exc.reason}: redirected to {new}: give {base} as the server's base URL"
    return OSError(errno.EPROTO, said, url)


def _call(req: urllib.request.Request | str, timeout: float) -> Any:
    """``req``'s JSON answer.

    Raises:
        OSError: naming the URL: unreachable, no whole answer within ``timeout`` (``ETIMEDOUT``), a redirect
            (``EPROTO``, naming where to: never followed), or an HTTP error (with the server's message).
        HurrayFormatError: an answer that is not JSON, or over ``_MAX_ANSWER_BYTES`` (not an OpenAI-compatible
            server).
    """
    url = req if isinstance(req, str) else req.full_url
    # One deadline for the whole call, status line, headers and body (an error's too, read by _server_message
    # while the watchdog runs): at it the watchdog shuts the connection down, and a read then ends at once.
    with _Watchdog(timeout) as watch:
        try:
            try:
                with _opener(watch).open(req, timeout=timeout) as r:
                    body = bytearray()
                    while piece := r.read1(_PIECE):  # read1: one socket read, where read(n) waits for all n bytes
                        body += piece
                        if len(body) > _MAX_ANSWER_BYTES:
                            big = f"{url}: an answer over {_MAX_ANSWER_BYTES} bytes"
                            big += ", not an OpenAI-compatible server's answer"
                            raise HurrayFormatError("answer", big)
                    if watch.fired:  # the shutdown ended the body, not the server
                        raise TimeoutError
                    if r.length:  # read1, unlike read, ends quietly at a connection closed short of Content-Length
                        raise http.client.IncompleteRead(bytes(body), r.length)
                    return json.loads(body)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                # After the shutdown a read fails, or ends short (headers cut off, a body that is not JSON): the
                # deadline, not the server, did that. An HTTP error stays one: its status came in time.
                if watch.fired and not isinstance(exc, (urllib.error.HTTPError, HurrayFormatError)):
                    raise TimeoutError from None
                raise
        except HurrayFormatError:  # the size cap's own message (a ValueError, which the last clause would rename)
            raise
        except urllib.error.HTTPError as exc:
            if 300 <= exc.code < 400:
                raise _redirected(exc, url) from None
            said = f"HTTP {exc.code} {exc.reason}{_server_message(exc)}"
            if exc.code in (401, 403):  # vLLM's --api-key: say what to do, not only the status
                raise OSError(errno.EACCES, f"{said}; {_key_advice(req)}", url) from None
            raise OSError(errno.EPROTO, said, url) from None
        except urllib.error.URLError as exc:
            why = exc.reason
            if isinstance(why, TimeoutError):  # connecting took too long
                raise _timed_out(why, timeout, url) from None
            raise OSError(getattr(why, "errno", None), getattr(why, "strerror", None) or str(why), url) from None
        except http.client.HTTPException as exc:  # not HTTP at all (a receiver's port), or an answer cut short
            raise OSError(errno.EPROTO, f"not an HTTP answer ({type(exc).__name__}: {exc})", url) from None
        except TimeoutError as exc:  # a socket read, or the whole call, past the timeout
            raise _timed_out(exc, timeout, url) from None
        except OSError as exc:  # a reset mid-answer
            raise OSError(exc.errno, exc.strerror or str(exc) or type(exc).__name__, url) from None
        except (ValueError, RecursionError) as exc:  # not JSON (or nested past Python's stack), not UTF-8, no URL
            why = "nested too deeply" if isinstance(exc, RecursionError) else exc
            raise HurrayFormatError("answer", f"{url}: not an OpenAI-compatible server's answer ({why})") from None


def _timed_out(exc: TimeoutError, timeout: float, url: str) -> OSError:
    """A timeout as :func:`_call` promises it: ``ETIMEDOUT``, naming the URL.

    Python's own socket timeouts carry no errno ("timed out"): said as the ``timeout`` they ran past. The
    system's (a connection the kernel gave up on) keep their own words.
    """
    said = exc.strerror if exc.errno is not None and exc.strerror else f"no answer within {timeout:g} s"
    return OSError(errno.ETIMEDOUT, said, url)


def _key_advice(req: urllib.request.Request | str) -> str:
    """What a 401 or 403 answer to ``req`` asks of the caller: a key, or another one."""
    how = f"--backend-api-key KEY, ${BACKEND_API_KEY_ENV} or api_key="
    if isinstance(req, str) or not req.has_header("Authorization"):
        return f"the server needs an API key (it runs with vLLM's --api-key): give it with {how}"
    return f"the server refused the API key given (the same key goes to both servers): check {how}"


def _server_message(exc: urllib.error.HTTPError) -> str:
    """``": <the server's error message>"`` from an OpenAI-style error body, else ``""``."""
    try:
        doc = json.loads(exc.read(4096))
        message = doc.get("message") or (doc.get("error") or {}).get("message")
    # HTTPException: a body cut short (a chunked one raises IncompleteRead); RecursionError: JSON nested past
    # Python's stack. Either way the status alone is said.
    except (ValueError, AttributeError, OSError, http.client.HTTPException, RecursionError):
        return ""
    return f": {message}" if isinstance(message, str) and message else ""


def _tokens(answer: dict[str, Any], server: str, want: int) -> list[int]:
    """The ``want`` token ids of a completion (``ignore_eos``: no fewer, unless it was cut short)."""
    try:
        ids = answer["choices"][0]["token_ids"]
    except (KeyError, IndexError, TypeError):
        raise HurrayFormatError("token_ids", f"{server} did not return token ids (is it vLLM >= 0.10?)") from None
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise HurrayFormatError("token_ids", f"{server} returned token ids that are not non-negative integers")
    if len(ids) != want:
        # Ended early (a stop, the context's end) or ran on: the move would not be where it was asked to be.
        raise HurrayFormatError("token_ids", f"{server} generated {len(ids)} tokens where {want} were asked for")
    return ids


def _first_model(server: str, timeout: float, key: str | None) -> str:
    listed = _call(_request(f"{server.rstrip('/')}/v1/models", key), timeout)
    try:
        return str(listed["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise HurrayFormatError("model", f"{server}/v1/models lists no model: pass --model NAME") from None


def _serves(server: str, model: str, timeout: float, key: str | None) -> bool:
    listed = _call(_request(f"{server.rstrip('/')}/v1/models", key), timeout)
    data = listed.get("data") if isinstance(listed, dict) else None
    return isinstance(data, list) and any(isinstance(m, dict) and m.get("id") == model for m in data)


def migrate(
    source: str,
    destination: str,
    prompt: Iterable[int],
    *,
    after: int,
    max_tokens: int,
    model: str | None = None,
    timeout: float = 600.0,
    api_key: str | None = None,
) -> MigrationResult:
    """Decode ``after`` tokens on ``source``, the remaining ``max_tokens - after`` on ``destination``.

    Args:
        source: base URL of the server that decodes first (``http://host:port``).
        destination: base URL of the server that decodes the rest (``http://host:port``).
        prompt: the prompt's token ids (any iterable of integers, numpy's and torch's
            too; read once).
        after: tokens generated on the source before the move (>= 1).
        max_tokens: tokens generated in total.
        model: the model name both servers serve; ``None``: the source's first
            (``/v1/models``). Either way both servers must list it, checked
            before the source decodes.
        timeout: seconds each call to a server may take.
        api_key: sent as ``Authorization: Bearer KEY`` on every call to both
            servers (vLLM's ``--api-key``; the router's ``--backend-api-key``);
            ``None``: read from :data:`BACKEND_API_KEY_ENV`, and without it none
            is sent. Never part of an error message.

    Raises:
        HurrayArgumentError: ``source`` or ``destination`` is not an ``http(s)://HOST[:PORT]``
            base URL, ``prompt`` is not a non-empty sequence of token ids (integers >= 0),
            ``after`` or ``max_tokens`` is not an integer or out of range, ``timeout`` is not a
            positive number of seconds, or ``api_key`` (or :data:`BACKEND_API_KEY_ENV`) is
            empty or not a header's printable ASCII. All before any call.
        HurrayFormatError: a server's answer is not what a vLLM server answers, a server
            does not serve the model (field ``model``, before the source decodes), or a
            server generated fewer (or more) tokens than asked for.
        OSError: a server cannot be reached, fails, redirects (``EPROTO``: the message names
            the URL to give instead), or takes longer than ``timeout`` (``ETIMEDOUT``);
            ``EACCES`` when a server answers 401 or 403: it needs an API key, or refused the
            one given (the message says how to give it).
    """
    after = integer_arg(after, "after")
    # Read once: the source and the destination are both sent the prompt (an iterator would be empty the second time).
    ids, max_tokens, timeout = _checked(prompt, max_tokens, timeout)
    if not 1 <= after < max_tokens:
        raise HurrayArgumentError("after", f"need 1 <= after < max_tokens, got after={after}, max_tokens={max_tokens}")
    _check_url("source", source)
    _check_url("destination", destination)
    key = _api_key(api_key)  # once, before any call: both servers get the same key
    if model is None:
        model = _first_model(source, timeout, key)
    elif not _serves(source, model, timeout, key):  # said before a 404 from its completion could say it less well
        raise HurrayFormatError("model", f"{source} does not serve {model!r}: give a model it lists at /v1/models")
    # Before the source decodes, whoever named the model: another model's continuation is not this one's, and a
    # destination that refuses the completion would leave the source's work (and its pushed chunks) unused.
    if not _serves(destination, model, timeout, key):
        raise HurrayFormatError("model", f"{destination} does not serve {model!r}, which {source} serves")
    # complete() reads the variable again only when no key was found (key None): the same answer, none.
    head = complete(source, ids, after, model=model, timeout=timeout, api_key=key)
    first = _tokens(head, source, after)
    # The source's connector announces the chunks it saved and is still pushing ({"hurray_saved_tokens": N}):
    # passed on, they make the destination wait for them rather than recompute what is on the wire.
    params = head.get("kv_transfer_params")
    extra = {"kv_transfer_params": params} if isinstance(params, dict) else None
    rest = max_tokens - after
    answer = complete(destination, [*ids, *first], rest, model=model, extra=extra, timeout=timeout, api_key=key)
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if type(cached) is int else None
    return MigrationResult(first, _tokens(answer, destination, max_tokens - after), cached)
