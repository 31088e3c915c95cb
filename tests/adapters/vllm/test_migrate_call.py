"""``migrate``'s calls are bounded as a whole: in time (``--timeout``) and in the size of the answer.

urlopen's ``timeout`` bounds each socket read only, and ``json.load`` read a body of any size: a server
sending a byte every half second held a 1 s call for as long as it sent, and a wrong URL streaming a large
body grew memory without limit. Local sockets only, no engine.
"""

from __future__ import annotations

import errno
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
