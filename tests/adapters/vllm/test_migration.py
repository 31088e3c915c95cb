"""vLLM OpenAI servers on 127.0.0.1: a completion migrated over NIXL and TCP mid-decode equals an unmoved run.

Source A pushes every chunk it saves to destination B's receiver
(``hurray_url`` / ``hurray_listen``) over NIXL, and B to C's over TCP: the
push deployment. Once
with ``hurray-vllm migrate`` (two completions), once through ``hurray-vllm
router`` moving a live stream (``POST /hurray/migrate``), and once moving it
twice, A -> B -> C, where C needs what B loaded from A.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import require
from margins import assert_continues
from prefetch import prefetched
from servers import (
    ServerSpec,
    router_spec,
    run_engine,
    start_servers,
    stop_servers,
    stream_completion,
    vllm_server_spec,
)
from tiny_models import build_tiny_llama

from hurray_vllm.adapters.vllm.migrate import MigrationResult
from hurray_vllm.app.cli import main

pytestmark = [pytest.mark.vllm]
PROMPT = [(i * 53 + 7) % 500 + 1 for i in range(200)]
ROUTED = [(i * 41 + 3) % 500 + 1 for i in range(300)]  # a stream the router moves
ROUTED_TOKENS = 120
CHAINED = [(i * 29 + 11) % 500 + 1 for i in range(300)]  # a stream the router moves twice
# Long enough that the second move (after 100) is far from the end: the router reads ahead of its client,
# and a move asked for once it has read the last token is refused ("has finished").
CHAINED_TOKENS = 600


@pytest.fixture(scope="module")
@prefetched
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """The unmoved references: a plain engine without connector, one request at a time."""
    require("vllm")
    tmp = tmp_path_factory.mktemp("migration-plain")
    build_tiny_llama(tmp / "model")
    run = run_engine(
        tmp,
        "plain",
        32,
        None,
        {"m": PROMPT, "routed": ROUTED, "chained": CHAINED},
        {"m": 24, "routed": ROUTED_TOKENS, "chained": CHAINED_TOKENS},
        sequential=True,
    )
    outputs: dict[str, list[int]] = run["outputs"]
    return outputs


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path, Path, str, str]]:
    """A pushes to B over NIXL, B to C over TCP: each transport carries a live stream's chunks between servers.

    One fleet for both (each has tests of its own in ``tests/transport``): a
    fleet of three servers takes a minute of CI's 2 cores to start.
    """
    require("vllm")
    require("transformers")
    require("nixl_cu12")
    tmp = tmp_path_factory.mktemp("migration")
    build_tiny_llama(tmp / "model")

    def specs(port: Callable[[], int]) -> list[ServerSpec]:
        recv, recv_c = port(), port()
        b_extra = {"hurray_path": str(tmp / "b"), "hurray_listen": f"127.0.0.1:{recv}",
                   "hurray_listen_transport": "nixl", "hurray_chunk_tokens": 64,
                   "hurray_url": f"tcp://127.0.0.1:{recv_c}"}  # fmt: skip
        a_extra = {"hurray_path": str(tmp / "a"), "hurray_url": f"nixl://127.0.0.1:{recv}",
                   "hurray_chunk_tokens": 64}  # fmt: skip
        c_extra = {"hurray_path": str(tmp / "c"), "hurray_listen": f"127.0.0.1:{recv_c}",
                   "hurray_listen_transport": "tcp", "hurray_chunk_tokens": 64}  # fmt: skip
        a, b, c = port(), port(), port()
        # Ties go to A, the first: the one that pushes to B.
        urls = [f"http://127.0.0.1:{a}", f"http://127.0.0.1:{b}", f"http://127.0.0.1:{c}"]
        return [
            vllm_server_spec(tmp, "a", a, 32, a_extra),
            vllm_server_spec(tmp, "b", b, 64, b_extra),
            vllm_server_spec(tmp, "c", c, 32, c_extra),
            router_spec("router", port(), urls, chunk_tokens=64),
        ]

    a, b, c, router = start_servers(specs, tmp / "logs")
    try:
        yield a.url, b.url, tmp, tmp / "b", router.url, c.url
    finally:
        stop_servers([a, b, c, router])


def test_migrated_completion_equals_unmoved_run(servers, plain) -> None:  # type: ignore[no-untyped-def]
    src, dst, tmp, b_store, _, _ = servers
    c_store = tmp / "c"
    for store in (b_store, c_store):
        assert not store.exists() or not any(store.rglob("*.hrry"))  # nothing arrived yet
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["migrate", "--from", src, "--to", dst, "--prompt-ids", ",".join(map(str, PROMPT)),
                   "--after", "9", "--max-tokens", "24", "--json"])  # fmt: skip
    assert rc == 0
    moved = MigrationResult(**{k: v for k, v in json.loads(buf.getvalue()).items() if k != "tokens"})
    assert moved.tokens == plain["m"]
    # The destination got the chunks over NIXL and did not recompute them: 209 tokens -> 3 chunks of 64.
    assert len(list(b_store.rglob("*.hrry"))) >= 3
    assert moved.destination_cached_tokens == 192
    assert len(moved.tokens) == 24
    # B pushes on to C the chunks it loaded (it computed no whole chunk of its own: 209 + 24 < 256), so that
    # a request moved on from B finds them on C as well.
    deadline = time.monotonic() + 30
    while len(list(c_store.rglob("*.hrry"))) < 3:
        assert time.monotonic() < deadline, sorted(p.name for p in c_store.rglob("*"))
        time.sleep(0.1)


def test_a_stream_moved_by_the_router_over_pushes_equals_the_unmoved_run(servers, plain) -> None:  # type: ignore[no-untyped-def]
    """The router moves a live stream from A to B after 40 tokens; B loads what A pushed while it decoded."""
    import httpx

    src, dst, tmp, _, router, _ = servers
    answer: dict[str, object] = {}

    def on_tokens(tokens: list[int]) -> None:
        if len(tokens) >= 40 and not answer:
            (flight,) = httpx.get(router + "/hurray/requests", timeout=30).json()["requests"]
            answer["flight"] = flight
            r = httpx.post(router + "/hurray/migrate", json={"id": flight["id"], "to": dst}, timeout=120)
            answer.update(r.json(), status=r.status_code)

    body = {"model": str(tmp / "model"), "prompt": ROUTED, "max_tokens": ROUTED_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    got = stream_completion(router, body, on_tokens)
    assert answer["status"] == 200 and answer["from"] == src and answer["to"] == dst, answer
    assert len(got["ids"]) == 1
    (last,) = [f for f in httpx.get(router + "/hurray/requests?recent=true", timeout=30).json()["recent"]
               if f["id"] in got["ids"]]  # fmt: skip
    moved_at = last["legs"][1]["start_token"]
    assert_continues(got["token_ids"], plain["routed"], tmp / "model", ROUTED, "moved A -> B", same_until=moved_at)
    # Every whole chunk of prompt + generated tokens but the last token reached B while A decoded: B's
    # first warm-up, before it had computed anything of this request, loaded them all. (The leg's own
    # cached_tokens also count what the warm-ups left in B's prefix cache.)
    first = last["legs"][1]["warmups"][0]
    assert first["cached_tokens"] >= (first["tokens"] - 1) // 64 * 64 >= 320, last["legs"][1]
    assert last["legs"][1]["cached_tokens"] >= (300 + moved_at - 1) // 64 * 64 >= 320


def test_a_stream_moved_twice_finds_every_chunk_at_each_hop(servers, plain) -> None:  # type: ignore[no-untyped-def]
    """A -> B -> C, each pushing to the next (a ring, as docs/router.md shows): C loads every whole chunk.

    Those A computed reach C through B, which loaded them (pushed on after the
    load, and again from its store as the continuation starts on its prefix
    cache: once, the receiver is asked first); without them C would wait
    ``hurray_push_wait_s`` for chunks no one sends, then recompute the prompt.
    """
    import httpx

    a, b, tmp, _, router, c = servers
    moves: list[dict[str, object]] = []

    def on_tokens(tokens: list[int]) -> None:
        for after, to in ((30, b), (100, c)):
            if len(tokens) >= after and len(moves) < 1 + (to == c):
                (flight,) = httpx.get(router + "/hurray/requests", timeout=30).json()["requests"]
                r = httpx.post(router + "/hurray/migrate", json={"id": flight["id"], "to": to}, timeout=120)
                moves.append({**r.json(), "status": r.status_code})

    body = {"model": str(tmp / "model"), "prompt": CHAINED, "max_tokens": CHAINED_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    got = stream_completion(router, body, on_tokens)
    assert [(m["status"], m.get("from"), m.get("to")) for m in moves] == [(200, a, b), (200, b, c)], moves
    (flight,) = [f for f in httpx.get(router + "/hurray/requests?recent=true", timeout=30).json()["recent"]
                 if f["id"] in got["ids"]]  # fmt: skip
    assert_continues(got["token_ids"], plain["chained"], tmp / "model", CHAINED, "moved A -> B -> C",
                     same_until=flight["legs"][1]["start_token"])  # fmt: skip
    on_c = flight["legs"][2]
    # C's first warm-up loaded every whole chunk but the last token's: those A computed (pushed on by B,
    # which only loaded them) and those B computed; none was waited for in vain (that takes 5 s).
    first = on_c["warmups"][0]
    assert first["cached_tokens"] >= (first["tokens"] - 1) // 64 * 64 >= 384, on_c
    assert on_c["cached_tokens"] >= (300 + on_c["start_token"] - 1) // 64 * 64, on_c
