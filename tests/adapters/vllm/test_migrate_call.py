"""``migrate``'s calls are bounded as a whole: in time (``--timeout``) and in the size of the answer.

urlopen's ``timeout`` bounds each socket read only, and ``json.load`` read a body of any size: a server
sending a byte every half second held a 1 s call for as long as it sent, and a wrong URL streaming a large
body grew memory without limit. And they carry the API key of servers started with vLLM's ``--api-key``
(below). Local sockets only, no engine.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from hurray_vllm import HurrayFormatError
from hurray_vllm.adapters.vllm import migrate as mig

HEAD = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n"


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket], None]], str]]:
    """Start a one-connection server running ``answer(conn)``; returns its base URL."""
    socks: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def start(answer: Callable[[socket.socket], None]) -> str:
        srv = socket.create_server(("127.0.0.1", 0))
        socks.append(srv)

        def run() -> None:
            try:
                conn, _ = srv.accept()
            except OSError:  # closed by the fixture
                return
            with conn:
                conn.recv(65536)
                try:
                    answer(conn)
                except OSError:  # the client gave up: what the test expects
                    pass

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
        return f"http://127.0.0.1:{srv.getsockname()[1]}"

    yield start
    for s in socks:
        s.close()
    for t in threads:
        t.join(5)


def test_a_dripping_server_does_not_outlast_the_timeout(serve: Callable[..., str]) -> None:
    stop = threading.Event()

    def drip(conn: socket.socket) -> None:
        conn.sendall(HEAD)
        for _ in range(20):  # 10 s of one byte each half second, were it read to the end
            if stop.is_set():
                return
            conn.sendall(b" ")
            time.sleep(0.5)
        conn.sendall(b'{"data": []}')

    url = serve(drip)
    t0 = time.monotonic()
    try:
        with pytest.raises(OSError) as info:
            mig._call(f"{url}/v1/models", timeout=1.0)
    finally:
        stop.set()
    assert time.monotonic() - t0 < 2.5
    assert info.value.errno == errno.ETIMEDOUT
    assert info.value.filename == f"{url}/v1/models"


# The deadline held for a 200's body only: an error's body (read for its message, 4096 bytes) and the status line
# and headers had urlopen's per-read bound, so a server dripping them a byte at a time held a 1 s call for 10 s.


@pytest.mark.parametrize("drips", ["an error's body", "the headers"])
def test_a_server_dripping_headers_or_an_error_does_not_outlast_the_timeout(
    serve: Callable[..., str], drips: str
) -> None:
    stop = threading.Event()

    def drip(conn: socket.socket) -> None:
        if drips == "an error's body":
            conn.sendall(b"HTTP/1.0 500 Internal Server Error\r\nContent-Type: application/json\r\n\r\n")
        else:
            conn.sendall(b"HTTP/1.0 200 OK\r\n")
        for _ in range(20):  # 10 s of a byte (or a header line) each half second
            if stop.is_set():
                return
            conn.sendall(b" " if drips == "an error's body" else b"X-A: b\r\n")
            time.sleep(0.5)
        conn.sendall(b"\r\n{}")

    url = serve(drip)
    t0 = time.monotonic()
    try:
        with pytest.raises(OSError) as info:
            mig._call(f"{url}/v1/models", timeout=1.0)
    finally:
        stop.set()
    assert time.monotonic() - t0 < 2.0
    assert info.value.filename == f"{url}/v1/models"
    if drips == "an error's body":  # the status came in time: said, without the message that did not
        assert info.value.errno == errno.EPROTO and str(info.value.strerror) == "HTTP 500 Internal Server Error"
    else:
        assert info.value.errno == errno.ETIMEDOUT and "no answer within 1 s" in str(info.value)


def test_an_error_body_cut_short_is_said_as_the_status(serve: Callable[..., str]) -> None:
    """A chunked error body cut off (the server died while sending it) raised a bare IncompleteRead, naming no URL."""

    def cut(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n"
            b'400\r\n{"error": {"message": "engine dead'
        )

    url = serve(cut)
    with pytest.raises(OSError) as info:
        mig._call(f"{url}/v1/models", timeout=5.0)
    assert info.value.errno == errno.EPROTO and info.value.filename == f"{url}/v1/models"
    assert info.value.strerror == "HTTP 503 Service Unavailable"


@pytest.mark.parametrize("status", [b"200 OK", b"502 Bad Gateway"])
def test_json_nested_past_the_stack_is_not_an_internal_error(serve: Callable[..., str], status: bytes) -> None:
    """``[[[[...``: json.loads raised RecursionError, which escaped as an internal error (the command's exit 3)."""
    deep = b"[" * 5000

    def nested(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.0 %s\r\nContent-Length: %d\r\n\r\n%s" % (status, len(deep), deep))

    url = serve(nested)
    if status == b"200 OK":
        with pytest.raises(HurrayFormatError, match="not an OpenAI-compatible server's answer") as info:
            mig._call(f"{url}/v1/models", timeout=5.0)
        assert info.value.field == "answer"
    else:  # an error's body: no message, the status said alone
        with pytest.raises(OSError) as err:
            mig._call(f"{url}/v1/models", timeout=5.0)
        assert err.value.errno == errno.EPROTO and err.value.strerror == "HTTP 502 Bad Gateway"


def test_an_oversized_answer_is_refused(serve: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mig, "_MAX_ANSWER_BYTES", 100_000)  # the cap's logic, without 64 MiB of traffic

    def flood(conn: socket.socket) -> None:
        conn.sendall(HEAD)
        for _ in range(100):  # 1 MiB, without an end the client could wait for
            conn.sendall(b" " * 10_000)

    url = serve(flood)
    with pytest.raises(HurrayFormatError, match="answer over 100000 bytes") as info:
        mig._call(f"{url}/v1/models", timeout=5.0)
    assert info.value.field == "answer"


def test_an_answer_in_pieces_is_read_whole(serve: Callable[..., str]) -> None:
    def pieces(conn: socket.socket) -> None:
        body = b'{"data": [{"id": "m"}], "pad": "' + b"x" * 200_000 + b'"}'
        conn.sendall(HEAD.replace(b"\r\n\r\n", b"\r\nContent-Length: %d\r\n\r\n" % len(body)))
        for i in range(0, len(body), 70_000):
            conn.sendall(body[i : i + 70_000])

    url = serve(pieces)
    assert mig._call(f"{url}/v1/models", timeout=5.0)["data"] == [{"id": "m"}]


# Servers started with vLLM's --api-key answer 401 to a call without "Authorization: Bearer KEY". migrate() sent
# no header at all: such servers could not be used, and the 401 said nothing of a key.

KEY = "sk-migrate-test-7f3a"
#: The variable users set (README, docs/router.md): the router's, which migrate() reads too.
ENV = "HURRAY_BACKEND_API_KEY"


@pytest.fixture
def vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[str, list[str | None]]]]:
    """Start a stand-in vLLM server; returns its base URL and the Authorization header of each call, in order.

    ``key``: it runs with ``--api-key key`` (vLLM's answer without it: 401 ``{"error": "Unauthorized"}``;
    ``status`` picks another, a proxy's 403); ``redirect``: every call is sent on there (status ``moved``).
    It serves ``model``; each completion of it answers as many token ids as asked for, of another model a
    404 (as vLLM does). ``log``: each call's method and path, appended. The environment's key is removed first.
    """
    import http.server

    monkeypatch.delenv(ENV, raising=False)
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(
        key: str | None = None,
        *,
        status: int = 401,
        redirect: str | None = None,
        moved: int = 307,
        model: str = "m",
        log: list[tuple[str, str]] | None = None,
    ) -> tuple[str, list[str | None]]:
        seen: list[str | None] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, code: int, doc: object, headers: dict[str, str] | None = None) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _serve(self, doc: object) -> None:
                seen.append(self.headers.get("Authorization"))
                if log is not None:
                    log.append((self.command, self.path))
                if redirect is not None:
                    self._answer(moved, {}, {"Location": redirect + self.path})
                elif key is not None and self.headers.get("Authorization") != f"Bearer {key}":
                    self._answer(status, {"error": "Unauthorized"})
                else:
                    self._answer(200, doc)

            def do_GET(self) -> None:
                self._serve({"object": "list", "data": [{"id": model}]})

            def do_POST(self) -> None:
                asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if asked["model"] != model and redirect is None:
                    if log is not None:
                        log.append((self.command, self.path))
                    self._answer(404, {"error": {"message": f"The model `{asked['model']}` does not exist."}})
                    return
                self._serve({"choices": [{"token_ids": list(range(asked["max_tokens"]))}]})

            def log_message(self, *_: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}", seen

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def _migrate(src: str, dst: str, **kwargs: object) -> mig.MigrationResult:
    return mig.migrate(src, dst, [1, 2, 3], after=2, max_tokens=5, timeout=10.0, **kwargs)  # type: ignore[arg-type]


def test_the_api_key_goes_with_every_call_to_both_servers(vllm: Callable[..., tuple[str, list[str | None]]]) -> None:
    (src, src_seen), (dst, dst_seen) = vllm(KEY), vllm(KEY)
    r = _migrate(src, dst, api_key=KEY)
    assert r.source_tokens == [0, 1] and r.destination_tokens == [0, 1, 2]
    # /v1/models on both (no model given: the source's, which the destination must serve), then a completion each.
    assert src_seen == [f"Bearer {KEY}"] * 2 and dst_seen == [f"Bearer {KEY}"] * 2
    src_seen.clear()
    dst_seen.clear()
    _migrate(src, dst, api_key=KEY, model="m")  # the model given is checked on both servers all the same
    assert src_seen == [f"Bearer {KEY}"] * 2 and dst_seen == [f"Bearer {KEY}"] * 2


def test_the_api_key_is_read_from_the_routers_variable(
    vllm: Callable[..., tuple[str, list[str | None]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hurray_vllm.app.router import server

    # One variable, one definition: the router's backends and migrate()'s servers take the same key.
    assert server.BACKEND_API_KEY_ENV is mig.BACKEND_API_KEY_ENV == ENV
    (src, src_seen), (dst, dst_seen) = vllm(KEY), vllm(KEY)
    monkeypatch.setenv(ENV, KEY)
    assert _migrate(src, dst).tokens == [0, 1, 0, 1, 2]
    assert src_seen == dst_seen == [f"Bearer {KEY}"] * 2
    assert mig.complete(src, [1], 1, model="m", timeout=10.0)["choices"][0]["token_ids"] == [0]
    with pytest.raises(OSError, match="refused the API key"):  # api_key= comes first
        _migrate(src, dst, api_key="sk-other")


def test_without_a_key_none_is_sent(
    vllm: Callable[..., tuple[str, list[str | None]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    (src, src_seen), (dst, dst_seen) = vllm(), vllm()
    monkeypatch.setenv(ENV, "")  # set but empty: unset, as the router reads it
    assert _migrate(src, dst).tokens == [0, 1, 0, 1, 2]
    assert src_seen == dst_seen == [None, None]


@pytest.mark.parametrize("status", [401, 403])
def test_a_server_that_needs_a_key_says_so_and_how_to_give_it(
    vllm: Callable[..., tuple[str, list[str | None]]], status: int
) -> None:
    (src, _), (dst, _) = vllm(KEY, status=status), vllm(KEY, status=status)
    with pytest.raises(OSError) as info:
        _migrate(src, dst)
    said = str(info.value)
    assert info.value.errno == errno.EACCES and info.value.filename == f"{src}/v1/models", said
    assert f"HTTP {status}" in said and "needs an API key" in said, said
    for how in ("--backend-api-key", f"${ENV}", "api_key="):
        assert how in said, said


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("model", [None, "m"])
def test_a_refused_key_is_said_as_such_and_never_shown(
    vllm: Callable[..., tuple[str, list[str | None]]], status: int, model: str | None
) -> None:
    (src, _), (dst, dst_seen) = vllm(KEY), vllm("sk-the-destinations", status=status)
    wrong = "sk-wrong-key-91c2"
    with pytest.raises(OSError) as info:
        _migrate(src, dst, api_key=wrong, model=model)
    said = str(info.value)
    assert info.value.errno == errno.EACCES and "refused the API key" in said and "--backend-api-key" in said, said
    assert info.value.filename.startswith(src) and dst_seen == []  # the source refused it: the first call
    assert wrong not in said and wrong not in repr(info.value) and KEY not in said


def test_the_key_does_not_follow_a_redirect_to_another_server(
    vllm: Callable[..., tuple[str, list[str | None]]],
) -> None:
    """urllib carries a request's headers along a redirect to any host: the key would go to whoever it names.

    No redirect is followed at all now (below): nothing reaches the other server.
    """
    other, other_seen = vllm(KEY)
    src, src_seen = vllm(KEY, redirect=other)
    with pytest.raises(OSError) as info:
        _migrate(src, src, api_key=KEY)
    assert src_seen == [f"Bearer {KEY}"] and other_seen == []
    said = str(info.value)
    assert info.value.errno == errno.EPROTO and "redirected" in said and other in said and KEY not in said, said


def test_the_command_sends_its_backend_api_key(
    vllm: Callable[..., tuple[str, list[str | None]]], capsys: pytest.CaptureFixture[str]
) -> None:
    from hurray_vllm.app.cli import main

    (src, src_seen), (dst, dst_seen) = vllm(KEY), vllm(KEY)
    base = ["migrate", "--from", src, "--to", dst, "--prompt-ids", "1,2,3", "--after", "2", "--max-tokens", "5"]
    assert main([*base, "--timeout", "10", "--json", "--backend-api-key", KEY]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [0, 1, 0, 1, 2]
    assert src_seen == dst_seen == [f"Bearer {KEY}"] * 2
    assert main([*base, "--timeout", "10"]) == 1  # no key: one line saying which option gives it
    err = capsys.readouterr().err.strip()
    assert "needs an API key" in err and "--backend-api-key" in err and "\n" not in err, err
    wrong = "sk-wrong-key-91c2"
    assert main([*base, "--timeout", "10", "--backend-api-key", wrong]) == 1
    err = capsys.readouterr().err
    assert "refused the API key" in err and wrong not in err, err


# A redirect turned the completion's POST into a body-less GET (urllib follows 301, 302 and 303 so): the server
# moved to answered 405, or another endpoint's answer. No call follows a redirect now; each says where to go.


@pytest.mark.parametrize("moved", [301, 302, 303, 307, 308])
def test_a_redirect_is_not_followed_and_says_which_url_to_give(
    vllm: Callable[..., tuple[str, list[str | None]]], moved: int
) -> None:
    log: list[tuple[str, str]] = []
    other, _ = vllm(log=log)
    old, _ = vllm(redirect=other, moved=moved)
    for model in ("m", None):  # the POST, and the GET of /v1/models before it
        with pytest.raises(OSError) as info:
            mig.complete(old, [1, 2], 1, model=model, timeout=10.0)
        said = str(info.value)
        assert info.value.errno == errno.EPROTO and info.value.filename.startswith(f"{old}/v1/"), said
        assert f"HTTP {moved}" in said and f"redirected to {other}/v1/" in said, said
        assert f"give {other} as the server's base URL" in said, said
    assert log == []  # nothing reached the server redirected to: no GET made of the POST


# The model given was never looked for on the destination: the source decoded (and pushed its chunks) for a
# destination that then answered 404, where migrate() without a model refused it first, as a HurrayFormatError.


@pytest.mark.parametrize("model", [None, "m"])
def test_a_destination_without_the_model_is_refused_before_the_source_decodes(
    vllm: Callable[..., tuple[str, list[str | None]]], model: str | None
) -> None:
    src_log: list[tuple[str, str]] = []
    dst_log: list[tuple[str, str]] = []
    (src, _), (dst, _) = vllm(log=src_log), vllm(model="other", log=dst_log)
    with pytest.raises(HurrayFormatError, match="does not serve 'm'") as info:
        _migrate(src, dst, model=model)
    assert info.value.field == "model" and dst in str(info.value)
    assert ("POST", "/v1/completions") not in src_log + dst_log  # no decoding on either side


def test_a_source_without_the_model_given_is_refused_first(vllm: Callable[..., tuple[str, list[str | None]]]) -> None:
    src_log: list[tuple[str, str]] = []
    dst_log: list[tuple[str, str]] = []
    (src, _), (dst, _) = vllm(model="other", log=src_log), vllm(log=dst_log)
    with pytest.raises(HurrayFormatError, match="does not serve 'm'") as info:
        _migrate(src, dst, model="m")
    assert info.value.field == "model" and src in str(info.value)
    assert src_log == [("GET", "/v1/models")] and dst_log == []


# Timeouts are OSError(ETIMEDOUT) as docs/connector.md promises: a server that never answered, or stopped in the
# middle of its body, raised Python's bare "timed out" (errno None), and only the deadline's own check said ETIMEDOUT.


@pytest.mark.parametrize("stops", ["before the status line", "in the body"])
def test_a_server_that_stops_answering_times_out_as_etimedout(serve: Callable[..., str], stops: str) -> None:
    stop = threading.Event()

    def stall(conn: socket.socket) -> None:
        if stops == "in the body":
            conn.sendall(HEAD.replace(b"\r\n\r\n", b"\r\nContent-Length: 50\r\n\r\n{"))
        stop.wait(5)

    url = serve(stall)
    try:
        with pytest.raises(OSError) as info:
            mig._call(f"{url}/v1/models", timeout=0.5)
    finally:
        stop.set()
    assert info.value.errno == errno.ETIMEDOUT and info.value.filename == f"{url}/v1/models"
    assert "no answer within 0.5 s" in str(info.value)


def test_migrate_times_out_as_etimedout(serve: Callable[..., str]) -> None:
    stop = threading.Event()
    url = serve(lambda conn: stop.wait(5))
    try:
        with pytest.raises(OSError) as info:
            mig.migrate(url, "http://127.0.0.1:9", [1, 2, 3], after=1, max_tokens=2, model="m", timeout=0.5)
    finally:
        stop.set()
    assert info.value.errno == errno.ETIMEDOUT and info.value.filename == f"{url}/v1/models"


def test_a_connection_that_times_out_is_etimedout() -> None:
    """Connecting past the timeout (urllib: a URLError around Python's timeout): a server whose queue is full."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)  # never accepted: once its queue is full, further connections wait for the server
    port = srv.getsockname()[1]
    queued: list[socket.socket] = []
    try:
        for _ in range(8):
            c = socket.socket()
            c.settimeout(0.3)
            try:
                c.connect(("127.0.0.1", port))
            except TimeoutError:
                c.close()
                break
            queued.append(c)
        else:
            pytest.skip("this system's kernel queued every connection: none waits")
        url = f"http://127.0.0.1:{port}/v1/models"
        with pytest.raises(OSError) as info:
            mig._call(url, timeout=0.5)
    finally:
        for c in queued:
            c.close()
        srv.close()
    assert info.value.errno == errno.ETIMEDOUT and "no answer within 0.5 s" in str(info.value)
    assert info.value.filename == url
