"""``hurray-vllm router`` over two vLLM OpenAI servers serving a sliding-window hybrid (Gemma 3 style), on 127.0.0.1.

The router tests of ``test_router.py`` run a Llama. Users also put hybrids
behind it, whose chunks carry every KV cache group (three sliding-window
layers of window 64, one full-attention layer) and which load whole chunks
only (no prompt tails). Servers A (blocks of 32) and B (blocks of 64)
share one store (chunks of 64 tokens); router P prefills on A and decodes
on B. Each stream runs alone and is compared token for token with a plain
engine's greedy run (no connector, no router).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import require
from servers import (
    ServerSpec,
    router_spec,
    run_engine,
    start_servers,
    stop_servers,
    stream_completion,
    vllm_server_spec,
)
from tiny_models import build_tiny_gemma3

pytestmark = [pytest.mark.vllm]
CHUNK, WINDOW = 64, 64


def _prompt(seed: int, n: int) -> list[int]:
    return [(i * (29 + seed) + 5 * seed) % 500 + 1 for i in range(n)]


PROMPTS = {"moved": _prompt(1, 300), "pd": _prompt(2, 260)}
MAX_TOKENS = {"moved": 100, "pd": 30}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require("vllm")
    require("transformers")
    require("httpx")
    tmp = tmp_path_factory.mktemp("router-hybrid")
    build_tiny_gemma3(tmp / "model", window=WINDOW)
    plain = run_engine(tmp, "plain", 32, None, PROMPTS, max_tokens=MAX_TOKENS, sequential=True)["outputs"]
    store = tmp / "store"

    def specs(port: Callable[[], int]) -> list[ServerSpec]:
        extra = {"hurray_path": str(store), "hurray_chunk_tokens": CHUNK}
        a, b, r, p = port(), port(), port(), port()
        urls = f"http://127.0.0.1:{a}", f"http://127.0.0.1:{b}"
        return [
            vllm_server_spec(tmp, "a", a, 32, extra),
            vllm_server_spec(tmp, "b", b, 64, extra),
            router_spec("router", r, urls, chunk_tokens=CHUNK),
            router_spec("pd-router", p, urls[1:], prefill=urls[:1], chunk_tokens=CHUNK),
        ]

    servers = start_servers(specs, tmp / "logs")
    a, b, router, pd = servers
    try:
        yield {"a": a.url, "b": b.url, "router": router.url, "pd": pd.url, "plain": plain, "model": str(tmp / "model")}
    finally:
        stop_servers(servers)


def _body(fleet: dict[str, Any], name: str) -> dict[str, Any]:
    return {"model": fleet["model"], "prompt": PROMPTS[name], "max_tokens": MAX_TOKENS[name], "temperature": 0,
            "ignore_eos": True}  # fmt: skip


def _last(base: str) -> dict[str, Any]:
    import httpx

    recent: dict[str, Any] = httpx.get(base + "/hurray/requests?recent=true", timeout=30).json()["recent"][-1]
    return recent


def test_a_hybrid_stream_migrated_mid_decode_equals_the_unmoved_run(fleet: dict[str, Any]) -> None:
    """Moved after 40 tokens: chunks 256..320 and on hold generated tokens, with the windows a resume attends."""
    import httpx

    answer: dict[str, Any] = {}

    def move() -> None:
        (flight,) = httpx.get(fleet["router"] + "/hurray/requests", timeout=30).json()["requests"]
        dest = fleet["b"] if flight["backend"] == fleet["a"] else fleet["a"]
        r = httpx.post(fleet["router"] + "/hurray/migrate", json={"id": flight["id"], "to": dest}, timeout=120)
        answer.update(r.json(), status=r.status_code, dest=dest)

    threads: list[threading.Thread] = []

    def on_tokens(tokens: list[int]) -> None:
        if len(tokens) >= 40 and not threads:
            threads.append(threading.Thread(target=move))
            threads[0].start()

    got = stream_completion(fleet["router"], _body(fleet, "moved"), on_tokens)
    assert threads, "the stream ended before the move"
    threads[0].join(120)
    assert answer.get("status") == 200 and answer["to"] == answer["dest"], answer
    assert got["token_ids"] == fleet["plain"]["moved"] and len(got["ids"]) == 1
    legs = _last(fleet["router"])["legs"]
    assert len(legs) == 2
    # The destination's first warm-up, before it computed anything of this request, loaded every whole chunk
    # of prompt and generated tokens but the last token: the KV moved, every group of it.
    first = legs[1]["warmups"][0]
    assert first["cached_tokens"] >= (first["tokens"] - 1) // CHUNK * CHUNK >= 320, legs[1]


def test_a_hybrid_prefilled_on_one_server_and_decoded_on_another_equals_one_server(fleet: dict[str, Any]) -> None:
    got = stream_completion(fleet["pd"], _body(fleet, "pd"))
    assert got["token_ids"] == fleet["plain"]["pd"]
    legs = _last(fleet["pd"])["legs"]
    assert [(leg["backend"], leg["why"]) for leg in legs] == [(fleet["a"], "prefill"), (fleet["b"], "decode")]
    # Every whole chunk of the prompt (a hybrid loads no tail): 256 of its 260 tokens.
    assert legs[1]["cached_tokens"] == 256 and legs[1]["announced"]["hurray_saved_tokens"] == 256, legs[1]
    assert "hurray_tail_tokens" not in legs[1]["announced"]
