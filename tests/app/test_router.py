"""``hurray-vllm router`` over two real vLLM OpenAI servers (CPU) sharing one chunk store, on 127.0.0.1.

Servers A (blocks of 32) and B (blocks of 64) run HurrayConnector on one
``hurray_path`` (chunks of 64 tokens). Router R routes over both; router P
runs prompts on A and decodes on B (``--prefill``). Every stream is compared
token for token with a plain engine's greedy run (no connector, no router).
The push deployment (own stores, ``hurray_url``) is tested with the
migration servers in ``tests/adapters/vllm/test_migration.py``.

Both servers run vLLM's asynchronous scheduling, its default on GPUs, which
the CPU platform turns off (``vllm_patches.keep_async_scheduling``): a
chunk that decode completes is then planned a step after the step that
computed it. The migration servers and the hybrid router's
(``test_router_hybrid.py``) run vLLM's CPU default, synchronous scheduling.

The tests run in this file's order: the last one SIGKILLs a backend.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import require
from margins import assert_continues
from servers import (
    Server,
    ServerSpec,
    kill_server,
    router_spec,
    run_engine,
    start_servers,
    stop_servers,
    stream_completion,
    vllm_server_spec,
)
from tiny_models import add_tiny_tokenizer, build_tiny_llama
from vllm_patches import KEPT

pytestmark = [pytest.mark.vllm]
CHUNK = 64
MAX_TOKENS = 160


def _prompt(seed: int, n: int) -> list[int]:
    return [(i * (31 + seed) + 7 * seed) % 500 + 1 for i in range(n)]


PROMPTS = {
    "plain": _prompt(1, 120),
    "moved": _prompt(2, 300),  # a migrated request: 300 prompt tokens, chunks of 64
    **{f"drain{k}": _prompt(3 + k, 200 + 16 * k) for k in range(4)},
    "pd": _prompt(8, 260),
    "hung": _prompt(9, 280),
    "killed": _prompt(10, 300),
    "chat": [5, 9, 11],  # the chat template of one message "w5 w9 w11"
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require("vllm")
    require("transformers")
    require("httpx")
    tmp = tmp_path_factory.mktemp("router")
    add_tiny_tokenizer(build_tiny_llama(tmp / "model"))
    # One request at a time: each stream below runs alone on its backend, so its arithmetic is the same.
    plain = run_engine(tmp, "plain", 32, None, PROMPTS, max_tokens=MAX_TOKENS, sequential=True)["outputs"]
    store = tmp / "store"

    def specs(port: Callable[[], int]) -> list[ServerSpec]:
        extra = {"hurray_path": str(store), "hurray_chunk_tokens": CHUNK}
        a, b, r, p = port(), port(), port(), port()
        urls = f"http://127.0.0.1:{a}", f"http://127.0.0.1:{b}"
        return [
            vllm_server_spec(tmp, "a", a, 32, extra, tokenizer=True, async_scheduling=True),
            vllm_server_spec(tmp, "b", b, 64, extra, tokenizer=True, async_scheduling=True),
            router_spec("router", r, urls, chunk_tokens=CHUNK),
            router_spec("pd-router", p, urls[1:], prefill=urls[:1], chunk_tokens=CHUNK),
        ]

    servers = start_servers(specs, tmp / "logs")
    a, b, router, pd = servers
    model = str(tmp / "model")
    try:
        yield {"a": a, "b": b, "router": router.url, "pd": pd.url, "plain": plain, "model": model, "tmp": tmp}
    finally:
        stop_servers(servers)


def _body(fleet: dict[str, Any], name: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"model": fleet["model"], "prompt": PROMPTS[name], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip


def _get(url: str) -> Any:
    import httpx

    return httpx.get(url, timeout=30).json()


def _post(url: str, body: dict[str, Any]) -> Any:
    import httpx

    return httpx.post(url, json=body, timeout=120)


def _when(tokens_at_least: int, action: Callable[[], None]) -> tuple[Callable[[list[int]], None], dict[str, Any]]:
    """An ``on_tokens`` callback that runs ``action`` on another thread once that many tokens arrived."""
    state: dict[str, Any] = {}

    def run() -> None:
        try:
            action()
        except BaseException as exc:  # surfaced by the test
            state["error"] = exc

    def on_tokens(tokens: list[int]) -> None:
        if "thread" not in state and len(tokens) >= tokens_at_least:
            state["at"] = len(tokens)
            state["thread"] = threading.Thread(target=run)
            state["thread"].start()

    return on_tokens, state


def _finish(state: dict[str, Any]) -> None:
    assert "thread" in state, "the stream ended before the action ran"
    state["thread"].join(120)
    if "error" in state:
        raise state["error"]


def _last(fleet: dict[str, Any], router: str = "router") -> dict[str, Any]:
    recent: dict[str, Any] = _get(fleet[router] + "/hurray/requests?recent=true")["recent"][-1]
    return recent


def _only_flight(fleet: dict[str, Any]) -> dict[str, Any]:
    (flight,) = _get(fleet["router"] + "/hurray/requests")["requests"]
    return dict(flight)


def test_streams_and_answers_through_the_router_equal_the_engine(fleet: dict[str, Any]) -> None:
    body = _body(fleet, "plain", 24)
    got = stream_completion(fleet["router"], body)
    assert got["token_ids"] == fleet["plain"]["plain"][:24]
    assert len(got["ids"]) == 1 and next(iter(got["ids"])).startswith("cmpl-hurray-")
    assert got["usage"]["prompt_tokens"] == 120 and got["usage"]["completion_tokens"] == 24
    whole = _post(fleet["router"] + "/v1/completions", {**body, "return_token_ids": True}).json()
    assert whole["choices"][0]["token_ids"] == got["token_ids"] and whole["choices"][0]["text"] == got["text"]
    assert whole["id"].startswith("cmpl-hurray-") and whole["id"] not in got["ids"]
    # Several sequences cannot change backends: relayed as the backend answers, under the router's id.
    two = _post(fleet["router"] + "/v1/completions", {**body, "n": 2, "temperature": 1.0, "seed": 1})
    assert two.status_code == 200, two.text
    assert two.json()["id"].startswith("cmpl-hurray-") and len(two.json()["choices"]) == 2
    # A refusal before any token is the backend's own answer.
    refused = _post(fleet["router"] + "/v1/completions", {**body, "n": 2})
    assert refused.status_code == 400 and "error" in refused.json(), refused.text


def test_the_openai_client_streams_completions_and_chat_unchanged(fleet: dict[str, Any]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=fleet["router"] + "/v1", api_key="unused")
    (model,) = [m.id for m in client.models.list().data]
    stream = client.completions.create(
        model=model, prompt=PROMPTS["plain"], max_tokens=16, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    tokens = [t for chunk in stream for t in (chunk.choices[0].token_ids or [])]  # type: ignore[attr-defined]
    assert tokens == fleet["plain"]["plain"][:16]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "w5 w9 w11"}], max_tokens=12, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    assert text.split() == [f"w{t}" for t in fleet["plain"]["chat"][:12]]


def test_a_stream_migrated_mid_decode_equals_the_unmoved_run(fleet: dict[str, Any]) -> None:
    """After 40 tokens a whole chunk (256..320) holds generated tokens; the destination loads it too.

    The servers schedule asynchronously: the source saved that chunk a step after it computed its last token.
    """
    assert all(f"{KEPT}True" in fleet[s].log_text() for s in "ab"), "a server did not keep asynchronous scheduling"
    a, b = fleet["a"].url, fleet["b"].url
    answer: dict[str, Any] = {}

    def move() -> None:
        flight = _only_flight(fleet)
        dest = b if flight["backend"] == a else a
        r = _post(fleet["router"] + "/hurray/migrate", {"id": flight["id"], "to": dest})
        answer.update(r.json(), status=r.status_code, source=flight["backend"], dest=dest)

    on_tokens, state = _when(40, move)
    got = stream_completion(fleet["router"], _body(fleet, "moved"), on_tokens)
    _finish(state)
    assert answer["status"] == 200 and answer["from"] == answer["source"] and answer["to"] == answer["dest"], answer
    assert len(got["ids"]) == 1
    legs = _last(fleet)["legs"]
    assert [leg["backend"] for leg in legs] == [answer["source"], answer["dest"]]
    moved_at = legs[1]["start_token"]
    assert_continues(got["token_ids"], fleet["plain"]["moved"], fleet["model"], PROMPTS["moved"], "migrated",
                     same_until=moved_at)  # fmt: skip
    # The KV moved: the destination's first warm-up (before it had computed anything of this request)
    # loaded every whole chunk of prompt + generated tokens but the last token, including chunks the
    # source completed with generated tokens while it decoded.
    _assert_warmup_loaded(legs[1])
    # The destination computed only the tail at the switch (the warm-ups left the rest in its prefix cache).
    assert legs[1]["cached_tokens"] >= (300 + moved_at - 1) // CHUNK * CHUNK >= 320
    assert got["usage"]["prompt_tokens"] == 300 and got["usage"]["completion_tokens"] == MAX_TOKENS
    metrics = _post_metrics(fleet)
    assert 'hurray_router_migrations_total{result="ok"} 1' in metrics
    assert "hurray_router_migration_pause_seconds_count 1" in metrics


def _assert_warmup_loaded(leg: dict[str, Any], at_least: int = 320) -> None:
    """The move's first warm-up on ``leg``'s backend was served from moved KV: every whole chunk but the last token.

    The leg's own ``cached_tokens`` cannot show it: the warm-ups left the
    context in the destination's prefix cache, moved or recomputed.
    """
    first = leg["warmups"][0]
    assert first["cached_tokens"] >= (first["tokens"] - 1) // CHUNK * CHUNK >= at_least, leg


def _post_metrics(fleet: dict[str, Any]) -> str:
    import httpx

    r = httpx.get(fleet["router"] + "/metrics", timeout=30)
    assert r.headers["content-type"].startswith("text/plain")
    return r.text


def _failovers(fleet: dict[str, Any]) -> int:
    """The router's ``hurray_router_failovers_total``."""
    (line,) = [x for x in _post_metrics(fleet).splitlines() if x.startswith("hurray_router_failovers_total ")]
    return int(line.split()[1])


def test_a_drain_moves_four_streams_and_each_completes_correctly(fleet: dict[str, Any]) -> None:
    """Four concurrent streams: the engines batch them, in another arithmetic than one stream at a time.

    So the tokens meet the margin rule against transformers (``tests/margins.py``) instead of equalling a
    batch of another composition; the companion shows the rule refuses a token repeated where the
    stream changed backends.
    """
    import torch
    from margins import agreement, assert_agrees, recompute_logits
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(fleet["tmp"] / "model", dtype=torch.bfloat16).eval()
    names = [f"drain{k}" for k in range(4)]
    results: dict[str, Any] = {}
    drained: dict[str, Any] = {}
    streams = [
        threading.Thread(target=lambda n=n: results.update({n: stream_completion(fleet["router"], _body(fleet, n))}))
        for n in names
    ]
    for t in streams:
        t.start()
    deadline = time.monotonic() + 120
    flights: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        flights = _get(fleet["router"] + "/hurray/requests")["requests"]
        if len(flights) == 4 and all(f["generated_tokens"] >= 8 for f in flights):
            break
        time.sleep(0.05)
    busiest = max({f["backend"] for f in flights}, key=[f["backend"] for f in flights].count)
    r = _post(fleet["router"] + "/hurray/drain", {"backend": busiest})
    try:
        drained.update(r.json(), status=r.status_code)
        started = [f for f in _get(fleet["router"] + "/hurray/requests")["requests"] if f["backend"] == busiest]
        for t in streams:
            t.join(300)
        assert drained["status"] == 200 and drained["failed"] == [] and drained["moved"], drained
        assert not started  # nothing left on the drained backend, and nothing new sent there
        recent = {f["id"]: f for f in _get(fleet["router"] + "/hurray/requests?recent=true")["recent"]}
        for n in names:
            tokens, (rid,) = results[n]["token_ids"], results[n]["ids"]
            assert len(tokens) == MAX_TOKENS and results[n]["finish_reason"] == "length"
            logits = recompute_logits(hf, PROMPTS[n], tokens)
            assert_agrees(logits, tokens, f"router drain {n}: the stream against transformers")
            legs = recent[rid]["legs"]
            if len(legs) > 1:
                at = legs[1]["start_token"]
                assert legs[1]["why"] == "drained"
                assert legs[1]["cached_tokens"] >= (len(PROMPTS[n]) + at - 1) // 64 * 64
                _assert_warmup_loaded(legs[1], at_least=len(PROMPTS[n]) // CHUNK * CHUNK)
                wrong = _resent(tokens, at, logits)  # the companion: a stream that resent a token is refused
                assert not agreement(recompute_logits(hf, PROMPTS[n], wrong), wrong).ok, n
    finally:  # a drained backend left behind would starve the tests after this one
        undrained = _post(fleet["router"] + "/hurray/undrain", {"backend": busiest}).json()
    assert undrained["draining"] is False


def _resent(tokens: list[int], at: int, logits: Any) -> list[int]:
    """The companion's wrong stream: the token before the switch at ``at`` sent twice.

    ``logits`` are transformers' teacher-forced logits of the right stream (row ``i`` predicts
    ``tokens[i]``). Where the resent token is within the margin of the right one at ``at`` (a tiny
    random model often nearly repeats itself), or is the right one, no margin rule can tell the
    two streams apart: the wrong stream then carries the token the model likes least there.
    """
    from hurray_vllm.agreement import logit_margin

    step = logits[at].float()
    twice = [*tokens[:at], tokens[at - 1], *tokens[at:-1]]
    if twice != tokens and float(step.max() - step[tokens[at - 1]]) > float(logit_margin(step[None])[0]):
        return twice
    return [*tokens[:at], int(step.argmin()), *tokens[at + 1 :]]


def test_prefill_on_one_server_decode_on_another_equals_one_server(fleet: dict[str, Any]) -> None:
    got = stream_completion(fleet["pd"], _body(fleet, "pd", 40))
    legs = _last(fleet, "pd")["legs"]
    assert_continues(got["token_ids"], fleet["plain"]["pd"][:40], fleet["model"], PROMPTS["pd"], "P/D", same_until=1)
    assert [(leg["backend"], leg["why"]) for leg in legs] == [(fleet["a"].url, "prefill"), (fleet["b"].url, "decode")]
    assert legs[1]["cached_tokens"] == 256  # the prompt's whole chunks, which the prefill server wrote
    # The decode leg was told what the prefill engine said it saved (its answer's kv_transfer_params).
    assert legs[1]["announced"]["hurray_saved_tokens"] == 256, legs[1]


def test_a_chat_split_between_prefill_and_decode_equals_one_server(fleet: dict[str, Any]) -> None:
    """The prefill leg of a chat is one JSON chat answer, turned into the stream's first event."""
    from openai import OpenAI

    client = OpenAI(base_url=fleet["pd"] + "/v1", api_key="unused")
    chat = client.chat.completions.create(
        model=fleet["model"], messages=[{"role": "user", "content": "w5 w9 w11"}], max_tokens=12, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [c for c in chat if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text.split() == [f"w{t}" for t in fleet["plain"]["chat"][:12]]
    legs = _last(fleet, "pd")["legs"]
    assert [(leg["backend"], leg["why"]) for leg in legs] == [(fleet["a"].url, "prefill"), (fleet["b"].url, "decode")]


def _signal(server: Server, sig: int) -> None:
    os.kill(server.proc.pid, sig)


def test_a_hung_backend_fails_its_health_checks_its_stream_moves_and_it_comes_back(fleet: dict[str, Any]) -> None:
    servers = {fleet["a"].url: fleet["a"], fleet["b"].url: fleet["b"]}
    hung: dict[str, Server] = {}

    def stop() -> None:
        flight = _only_flight(fleet)
        hung["server"] = servers[flight["backend"]]
        _signal(hung["server"], signal.SIGSTOP)

    on_tokens, state = _when(30, stop)
    try:
        got = stream_completion(fleet["router"], _body(fleet, "hung"), on_tokens)
        _finish(state)
        legs = _last(fleet)["legs"]
        assert_continues(got["token_ids"], fleet["plain"]["hung"], fleet["model"], PROMPTS["hung"], "hung",
                         same_until=legs[1]["start_token"])  # fmt: skip
        assert [leg["why"] for leg in legs] == ["routed", "failover"] and legs[0]["backend"] == hung["server"].url
        health = _get(fleet["router"] + "/health")["backends"]
        assert health[hung["server"].url]["healthy"] is False
    finally:
        if "server" in hung:
            _signal(hung["server"], signal.SIGCONT)
    deadline = time.monotonic() + 60
    while not _get(fleet["router"] + "/health")["backends"][hung["server"].url]["healthy"]:
        assert time.monotonic() < deadline, "the backend did not come back"
        time.sleep(0.2)


def test_control_requests_say_what_is_wrong(fleet: dict[str, Any]) -> None:
    r = fleet["router"]
    assert _post(r + "/hurray/migrate", {"id": "nope", "to": fleet["a"].url}).status_code == 404
    bad = _post(r + "/hurray/migrate", {"id": "x"})
    assert bad.status_code == 400 and "expected" in bad.json()["error"]["message"]
    assert _post(r + "/hurray/drain", {"backend": "http://elsewhere:1"}).status_code == 400
    assert _post(r + "/v1/completions", {"model": fleet["model"], "prompt": [1] * 2000}).status_code == 400
    assert _get(r + "/health")["status"] == "ok"
    metrics = _post_metrics(fleet)
    assert f'hurray_router_backend_up{{backend="{fleet["a"].url}"}} 1' in metrics


def test_a_backend_killed_mid_stream_is_failed_over_and_the_stream_completes(fleet: dict[str, Any]) -> None:
    """Last: the killed backend stays down. The survivor loads what the dead one wrote to the shared store."""
    servers = {fleet["a"].url: fleet["a"], fleet["b"].url: fleet["b"]}
    killed: dict[str, Server] = {}

    def kill() -> None:
        killed["server"] = servers[_only_flight(fleet)["backend"]]
        kill_server(killed["server"])  # its engine core too: a dead machine, and no orphan left running

    failovers = _failovers(fleet)  # the hung backend's test, if it ran first, counted one already
    on_tokens, state = _when(40, kill)
    got = stream_completion(fleet["router"], _body(fleet, "killed"), on_tokens)
    _finish(state)
    legs = _last(fleet)["legs"]
    assert len(got["ids"]) == 1
    assert_continues(got["token_ids"], fleet["plain"]["killed"], fleet["model"], PROMPTS["killed"],
                     "failed over", same_until=legs[1]["start_token"])  # fmt: skip
    assert [leg["why"] for leg in legs] == ["routed", "failover"] and legs[0]["backend"] == killed["server"].url
    assert legs[1]["cached_tokens"] >= 256  # at least the prompt's chunks the dead backend wrote
    assert _failovers(fleet) == failovers + 1  # this one
    # Routing goes on over the survivor.
    assert stream_completion(fleet["router"], _body(fleet, "plain", 8))["token_ids"] == fleet["plain"]["plain"][:8]
