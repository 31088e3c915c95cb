"""The router's failure paths, against stand-in OpenAI servers (``tests/fake_openai_server.py``) in processes.

Real engines (``test_router.py``) cover migration, drain, failover and the
P/D split end to end; these cover what an engine cannot be made to do on
cue: a destination that refuses a moved request, a control request for a
finished one, a client that goes away. The stand-in's tokens follow from the
whole context, so a stream continued anywhere goes on exactly as it would have.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import require
from fake_openai_server import next_token
from servers import ROOT, ServerSpec, router_spec, start_servers, stop_servers, stream_completion

BREAK_AT = 52  # the context length at which fake-f and fake-g break off a first leg


def _expected(prompt: list[int], n: int) -> list[int]:
    ctx, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(ctx))
        ctx.append(out[-1])
    return out


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    require("fastapi")
    require("httpx")
    tmp = tmp_path_factory.mktemp("router-fakes")

    def specs(port: Callable[[], int]) -> list[ServerSpec]:
        a, b, c, d, e, f, g = port(), port(), port(), port(), port(), port(), port()
        fake = [sys.executable, str(ROOT / "tests" / "fake_openai_server.py")]
        urls = [f"http://127.0.0.1:{a}", f"http://127.0.0.1:{b}"]
        return [
            ServerSpec("fake-a", [*fake, str(a)], a),
            ServerSpec("fake-b", [*fake, str(b), "--refuse-continuations"], b),
            ServerSpec("fake-c", [*fake, str(c), "--announce"], c),  # a prefill server
            ServerSpec("fake-d", [*fake, str(d), "--delay", "0.05"], d),  # slow: 20 tokens a second
            ServerSpec("fake-e", [*fake, str(e), "--drop-after-finish"], e),
            # Either breaks off a first leg once its context holds BREAK_AT tokens; either takes the rest.
            ServerSpec("fake-f", [*fake, str(f), "--break-at-context", str(BREAK_AT)], f),
            ServerSpec("fake-g", [*fake, str(g), "--break-at-context", str(BREAK_AT)], g),
            router_spec("router", port(), urls),
            router_spec("pd-router", port(), urls[:1], prefill=[f"http://127.0.0.1:{c}"]),
            router_spec("slow-router", port(), [f"http://127.0.0.1:{d}"]),
            router_spec("dropping-router", port(), [f"http://127.0.0.1:{e}"]),
            router_spec("breaking-router", port(), [f"http://127.0.0.1:{f}", f"http://127.0.0.1:{g}"]),
        ]

    servers = start_servers(specs, tmp / "logs")
    a, b, c, d, e, _, _, router, pd, slow, dropping, breaking = servers
    try:
        yield {
            "a": a.url,
            "b": b.url,
            "c": c.url,
            "d": d.url,
            "e": e.url,
            "router": router.url,
            "pd": pd.url,
            "slow": slow.url,
            "dropping": dropping.url,
            "breaking": breaking.url,
        }
    finally:
        stop_servers(servers)


def _post(url: str, body: dict[str, Any]) -> Any:
    import httpx

    return httpx.post(url, json=body, timeout=60)


def test_a_refused_move_is_answered_502_and_the_stream_goes_on_where_it_was(fakes: dict[str, str]) -> None:
    import httpx

    prompt = list(range(1, 40))
    answer: dict[str, Any] = {}

    def on_tokens(tokens: list[int]) -> None:
        if len(tokens) >= 10 and not answer:
            (flight,) = httpx.get(fakes["router"] + "/hurray/requests", timeout=30).json()["requests"]
            assert flight["backend"] == fakes["a"]
            r = _post(fakes["router"] + "/hurray/migrate", {"id": flight["id"], "to": fakes["b"]})
            answer.update(r.json(), status=r.status_code)

    # 300 tokens at 10 ms each: the stream still runs when the move comes, on a busy machine too.
    got = stream_completion(fakes["router"], {"model": "fake", "prompt": prompt, "max_tokens": 300}, on_tokens)
    assert answer["status"] == 502 and "could not take it" in answer["error"]["message"], answer
    assert got["token_ids"] == _expected(prompt, 300) and len(got["ids"]) == 1
    (last,) = [f for f in httpx.get(fakes["router"] + "/hurray/requests?recent=true", timeout=30).json()["recent"]
               if f["id"] in got["ids"]]  # fmt: skip
    assert [leg["why"] for leg in last["legs"]] == ["routed", "migrated", "resumed"]
    assert [leg["backend"] for leg in last["legs"]] == [fakes["a"], fakes["b"], fakes["a"]]
    assert 'hurray_router_migrations_total{result="failed"} 1' in httpx.get(fakes["router"] + "/metrics").text


def test_moving_a_finished_or_unknown_request_says_so(fakes: dict[str, str]) -> None:
    import httpx

    got = stream_completion(fakes["router"], {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 5})
    (rid,) = got["ids"]
    r = _post(fakes["router"] + "/hurray/migrate", {"id": rid, "to": fakes["b"]})
    assert r.status_code == 404  # finished requests are no longer in flight
    assert _post(fakes["router"] + "/hurray/migrate", {"id": rid, "to": "http://nowhere:1"}).status_code == 404
    bad = httpx.post(fakes["router"] + "/hurray/drain", content=b"{not json", timeout=30)
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]


def test_a_client_that_goes_away_ends_its_upstream_stream(fakes: dict[str, str]) -> None:
    import time

    import httpx

    body = {"model": "fake", "prompt": [4, 5, 6], "max_tokens": 1000, "stream": True}  # 10 s of tokens
    with httpx.stream("POST", fakes["router"] + "/v1/completions", json=body, timeout=60) as r:
        for _ in r.iter_lines():
            break  # one event, then hang up
    deadline = time.monotonic() + 3
    while httpx.get(fakes["router"] + "/hurray/requests", timeout=30).json()["requests"]:
        assert time.monotonic() < deadline, "the request stayed in flight after its client left"
        time.sleep(0.05)
    assert httpx.get(fakes["router"] + "/health", timeout=30).json()["backends"][fakes["a"]]["in_flight"] == 0


def test_a_request_relayed_unmoved_is_listed_refused_a_move_and_reported_by_a_drain(fakes: dict[str, str]) -> None:
    """Structured output cannot change backends: it is still in flight for the controls, and says why it stays."""
    import httpx

    seen: dict[str, Any] = {}

    def on_tokens(tokens: list[int]) -> None:
        if len(tokens) >= 5 and not seen:
            (req,) = httpx.get(fakes["router"] + "/hurray/requests", timeout=30).json()["requests"]
            seen["listed"] = req
            other = fakes["b"] if req["backend"] == fakes["a"] else fakes["a"]
            r = _post(fakes["router"] + "/hurray/migrate", {"id": req["id"], "to": other})
            seen["migrate"] = (r.status_code, r.json())
            seen["drain"] = _post(fakes["router"] + "/hurray/drain", {"backend": req["backend"]}).json()
            _post(fakes["router"] + "/hurray/undrain", {"backend": req["backend"]})

    # 300 tokens at the stand-in's 10 ms each: still streaming when the drain comes, on a busy machine too (with
    # 40 the request could end between the listing and the drain, and no longer be there to report).
    body = {"model": "fake", "prompt": list(range(1, 30)), "max_tokens": 300, "guided_regex": "[0-9 ]+"}
    got = stream_completion(fakes["router"], body, on_tokens)
    assert got["token_ids"] == _expected(list(range(1, 30)), 300)
    req = seen["listed"]
    assert req["movable"] is False and "structured output" in req["why_not_movable"]
    assert req["prompt_tokens"] == 29 and req["generated_tokens"] >= 5 and req["id"] in got["ids"]
    status, answer = seen["migrate"]
    assert status == 409 and "cannot be moved" in answer["error"]["message"]
    assert seen["drain"]["moved"] == [] and [f["id"] for f in seen["drain"]["failed"]] == [req["id"]]
    assert "not movable" in seen["drain"]["failed"][0]["error"]
    assert httpx.get(fakes["router"] + "/hurray/requests", timeout=30).json()["requests"] == []


def test_the_decode_leg_gets_what_the_prefill_engine_announced(fakes: dict[str, str]) -> None:
    """P/D: the prefill leg's answer carries the engine's kv_transfer_params (its chunks and its prompt's tail);
    the decode leg passes them on, so the decode engine waits for the tail too, as vLLM's P/D proxies do."""
    import httpx

    prompt = list(range(3, 90))
    got = stream_completion(fakes["pd"], {"model": "fake", "prompt": prompt, "max_tokens": 12})
    assert got["token_ids"] == _expected(prompt, 12) and len(got["ids"]) == 1
    (last,) = [f for f in httpx.get(fakes["pd"] + "/hurray/requests?recent=true", timeout=30).json()["recent"]
               if f["id"] in got["ids"]]  # fmt: skip
    assert [(leg["backend"], leg["why"]) for leg in last["legs"]] == [(fakes["c"], "prefill"), (fakes["a"], "decode")]
    assert httpx.get(fakes["c"] + "/seen", timeout=30).json()[-1] is None  # the prefill leg announces nothing
    assert httpx.get(fakes["a"] + "/seen", timeout=30).json()[-1] == {
        "hurray_saved_tokens": 64,
        "hurray_tail_tokens": 7,
    }


def test_a_decode_leg_is_told_nothing_when_the_prefill_engine_announced_nothing() -> None:
    """P/D: a prefill engine whose connector saved nothing (its prefix cache reset, saves off) announces nothing in
    its answer. The decode leg once got the router's own announcement of the whole prompt, and its engine waited
    hurray_push_wait_s for chunks nobody writes; it is told nothing now, and computes the prompt."""
    import asyncio

    from hurray_vllm.app.router.backends import Backend
    from hurray_vllm.app.router.server import Router, RouterConfig

    router = Router(RouterConfig(backends=("http://127.0.0.1:9",), prefill=("http://127.0.0.1:10",)))
    for b in router.backends.all.values():
        b.max_model_len, b.served = 4096, frozenset({"m"})
    f = router.begin("completion", {"model": "m", "prompt": list(range(600)), "max_tokens": 4, "stream": True})
    sent: list[tuple[str, Any]] = []

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> Any:
        sent.append((backend.url, body.get("kv_transfer_params")))
        prompt = body["prompt"]
        if not body["stream"]:  # the prefill leg: one JSON answer, without kv_transfer_params
            choice = {"text": "t", "token_ids": [7], "prompt_token_ids": prompt, "finish_reason": "length"}
            answer = {"choices": [choice]}
            for event in f._answer_events(json.dumps(answer).encode(), backend):
                yield event
            return
        for i in range(body["max_tokens"]):
            done = "length" if i == body["max_tokens"] - 1 else None
            yield {"choices": [{"text": "t", "token_ids": [7], "prompt_token_ids": prompt, "finish_reason": done}]}

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> list[list[int]]:
        return [d.token_ids async for d in f.deltas()]

    assert asyncio.run(run()) == [[7]] * 4
    assert sent == [("http://127.0.0.1:10", None), ("http://127.0.0.1:9", None)]
    assert [leg.why for leg in f.legs] == ["prefill", "decode"] and f.legs[1].announced is None


def test_a_backend_that_breaks_off_after_the_finish_leaves_the_stream_finished(fakes: dict[str, str]) -> None:
    """The finish was sent: continuing the request elsewhere (it once was) put tokens or an error after its end."""
    import httpx

    prompt = list(range(7, 30))
    got = stream_completion(fakes["dropping"], {"model": "fake", "prompt": prompt, "max_tokens": 9})
    assert got["token_ids"] == _expected(prompt, 9) and got["finish_reason"] == "length"
    health = httpx.get(fakes["dropping"] + "/health", timeout=30).json()["backends"][fakes["e"]]
    assert health["in_flight"] == 0 and health["healthy"]  # not failed over, not marked down
    assert "hurray_router_failovers_total 0" in httpx.get(fakes["dropping"] + "/metrics", timeout=30).text


def test_bodies_the_router_cannot_use_are_answered_400_naming_what(fakes: dict[str, str]) -> None:
    """Each once ended in a 500 with a traceback, or a stream cut off after its tokens."""
    import httpx

    url = fakes["router"] + "/v1/completions"
    deep = httpx.post(url, content=b"[" * 100_000, timeout=30)
    assert deep.status_code == 400 and "not JSON" in deep.json()["error"]["message"]
    assert httpx.post(fakes["router"] + "/hurray/drain", content=b"[" * 100_000, timeout=30).status_code == 400
    base = {"model": "fake", "prompt": [1, 2, 3]}
    options = _post(url, {**base, "stream": True, "stream_options": True})
    assert options.status_code == 400 and "stream_options" in options.json()["error"]["message"]
    for bad in ("many", -1, 2.5, True):
        r = _post(url, {**base, "max_tokens": bad})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], (bad, r.text)
    huge = _post(url, {**base, "prompt": [2**64] * 300, "max_tokens": 2})  # no token id: not keyable, relayed
    assert huge.status_code != 500 and huge.headers["content-type"].startswith("application/json")


def test_messages_nested_about_as_deep_as_the_parser_takes_get_no_500(fakes: dict[str, str]) -> None:
    """Found by a review: messages the router's parser took, just under its depth limit, failed its prefix keys
    (json.dumps, called deeper in the stack: RecursionError) with a bare 500. They are keyed as none now (keys only
    serve affinity) and go to a backend, whose answer the client gets (the stand-in has no chat endpoint: 404)."""
    import httpx

    url = fakes["router"] + "/v1/chat/completions"
    answers: dict[int, list[int]] = {}
    for depth in range(1000, 900, -1):  # across the parser's limit, wherever the router's stack puts it
        for nested in ("[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth):
            body = '{"model": "fake", "messages": [{"role": "user", "content": ' + nested + "}]}"
            r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
            assert r.headers["content-type"].startswith("application/json"), (depth, r.status_code, r.text[:200])
            answers.setdefault(r.status_code, []).append(depth)
    assert set(answers) == {400, 404}, {k: v[:3] for k, v in answers.items()}  # too deep to parse, or the backend's
    assert httpx.get(fakes["router"] + "/health", timeout=30).json()["backends"][fakes["a"]]["healthy"]


@pytest.mark.parametrize("kind", ["completions", "chat/completions"])
@pytest.mark.parametrize("extra", [{}, {"n": 2}])  # a flight, or relayed unmoved
@pytest.mark.parametrize("model", [["fake"], {"a": 1}, 7])
def test_a_model_that_is_not_a_string_is_answered_400_naming_it(kind: str, extra: dict[str, Any], model: Any) -> None:
    """Found by a review: with --prefill backends, a chat without max_tokens whose model was a list or an object
    failed the router's context length lookup (not a set member) with a bare 500. vLLM takes a string only."""
    require("fastapi")
    require("httpx")
    import asyncio

    import httpx

    from hurray_vllm.app.router import RouterConfig, build_app

    app = build_app(RouterConfig(backends=(_closed_port(),), prefill=(_closed_port(),)))
    for b in app.state.router.backends.all.values():  # as a health check would have read them
        b.max_model_len, b.served = 4096, frozenset({"fake"})
    prompt = {"prompt": [1, 2]} if kind == "completions" else {"messages": [{"role": "user", "content": "hi"}]}

    async def run() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.post(f"/v1/{kind}", json={"model": model, **prompt, **extra})

    answer = asyncio.run(run())
    assert answer.status_code == 400, answer.text[:300]
    error = answer.json()["error"]
    assert error["code"] == 400 and error["message"].startswith("model must be a string"), error


@pytest.mark.parametrize("echo", [False, True])
def test_a_text_with_a_lone_surrogate_reaches_a_backend(echo: bool) -> None:
    """A lone surrogate's escape is valid JSON, which vLLM reads; the router's affinity keys once failed to encode it
    (in the prompt, the model or the cache_salt): a bare 500, whether the request was movable or relayed (echo)."""
    require("fastapi")
    require("httpx")
    import asyncio

    from hurray_vllm.app.router.backends import prompt_keys

    assert len(prompt_keys({"model": "m\udc80", "prompt": "x" * 1024}, 256)) == 1
    raw = '{"model": "m", "prompt": "abc\\ud800", "cache_salt": "\\udfff", "max_tokens": 1'
    raw += ', "echo": true}' if echo else "}"

    async def run() -> tuple[Any, int]:
        async with _Stand("ok") as ok:
            answer, _ = await _through_router([ok.url], raw)
            return answer, ok.posts

    answer, posts = asyncio.run(run())
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " ok", answer.text
    assert posts == 1


def test_max_tokens_as_a_numeric_string_counts_as_vllm_reads_it(fakes: dict[str, str]) -> None:
    """vLLM's request model coerces "8" to 8: the router's own arithmetic (P/D, moves) must too."""
    prompt = list(range(3, 90))
    r = _post(fakes["pd"] + "/v1/completions", {"model": "fake", "prompt": prompt, "max_tokens": "8"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "".join(f" w{t}" for t in _expected(prompt, 8))


def test_a_non_streamed_request_whose_client_leaves_ends_upstream(fakes: dict[str, str]) -> None:
    import time

    import httpx

    body = {"model": "fake", "prompt": [8, 9], "max_tokens": 400}  # 20 s at 20 tokens a second
    with pytest.raises(httpx.TimeoutException):
        httpx.post(fakes["slow"] + "/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 3
    while httpx.get(fakes["slow"] + "/hurray/requests", timeout=30).json()["requests"]:
        assert time.monotonic() < deadline, "the request stayed in flight after its client left"
        time.sleep(0.05)
    assert httpx.get(fakes["slow"] + "/health", timeout=30).json()["backends"][fakes["d"]]["in_flight"] == 0


def test_a_non_streamed_request_relayed_unmoved_is_listed_while_it_runs(fakes: dict[str, str]) -> None:
    """Its answer's headers come only at its end: it used to be listed (and known to a drain) only then."""
    import threading
    import time

    import httpx

    body = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 80, "guided_regex": "[0-9 ]+"}  # 4 s
    answer: dict[str, Any] = {}
    t = threading.Thread(target=lambda: answer.update(r=_post(fakes["slow"] + "/v1/completions", body)))
    t.start()
    listed: list[Any] = []
    while not listed and t.is_alive():  # looked at for as long as it runs, however slowly this machine polls
        listed = httpx.get(fakes["slow"] + "/hurray/requests", timeout=30).json()["requests"]
        time.sleep(0.02)
    t.join()
    assert [r["movable"] for r in listed] == [False] and listed[0]["backend"] == fakes["d"]
    assert answer["r"].status_code == 200 and answer["r"].json()["id"] == listed[0]["id"]
    assert httpx.get(fakes["slow"] + "/hurray/requests", timeout=30).json()["requests"] == []


def test_a_client_leaving_a_relayed_non_streamed_request_lets_it_go(fakes: dict[str, str]) -> None:
    """Its answer would come only at its end (10 s here): the router stops waiting when its client leaves."""
    import time

    import httpx

    body = {"model": "fake", "prompt": [8, 9, 10], "max_tokens": 200, "guided_regex": "[0-9 ]+"}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(fakes["slow"] + "/v1/completions", json=body, timeout=0.5)  # the client gives up
    deadline, listed = time.monotonic() + 3, [None]
    while listed and time.monotonic() < deadline:
        listed = httpx.get(fakes["slow"] + "/hurray/requests", timeout=30).json()["requests"]
        time.sleep(0.05)
    assert listed == []
    health = httpx.get(fakes["slow"] + "/health", timeout=30).json()
    assert [b["in_flight"] for b in health["backends"].values()] == [0]


def test_a_relayed_stream_that_breaks_off_still_ends_with_done(fakes: dict[str, str]) -> None:
    """An unmovable request's backend broke mid-stream: an error event, then [DONE], as every stream ends."""
    import httpx

    # fake-f and fake-g break off once the context holds BREAK_AT tokens: before the finish, at 60 tokens.
    body = {"model": "fake", "prompt": [5, 6], "max_tokens": 60, "stream": True, "guided_regex": "[0-9 ]+"}
    with httpx.stream("POST", fakes["breaking"] + "/v1/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]", lines[-3:]
    assert '"finish_reason": null' in lines[-3], lines[-3:]


@pytest.mark.parametrize("n", [1, 2])
def test_a_relayed_stream_that_breaks_off_after_its_finish_ends_cleanly(fakes: dict[str, str], n: int) -> None:
    """Every choice it showed had finished: the request is complete, and ends as a flight does (the docs' failure
    table); it once ended with an error event before [DONE]."""
    import httpx

    body = {"model": "fake", "prompt": [5, 6], "max_tokens": 4, "stream": True, "n": n, "guided_regex": "[0-9 ]+"}
    with httpx.stream("POST", fakes["dropping"] + "/v1/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines[-3:]
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length", lines[-3:]


def test_text_a_stop_string_holds_back_is_not_lost_at_a_move(fakes: dict[str, str]) -> None:
    """vLLM holds back a stream's last (longest stop - 1) characters; a leg cut off at a move took them along.

    The move is refused (``fake-b``), so the stream resumes on its source: a second leg all the same.
    """
    import httpx

    prompt = list(range(1, 40))
    full = "".join(f" w{t}" for t in _expected(prompt, 300))
    answer: dict[str, Any] = {}

    def on_tokens(tokens: list[int]) -> None:
        if len(tokens) >= 10 and not answer:
            (flight,) = httpx.get(fakes["router"] + "/hurray/requests", timeout=30).json()["requests"]
            r = _post(fakes["router"] + "/hurray/migrate", {"id": flight["id"], "to": fakes["b"]})
            answer.update(status=r.status_code)

    # 39 characters held back; 300 tokens at 10 ms each: still streaming when the move comes, on a busy machine too
    body = {"model": "fake", "prompt": prompt, "max_tokens": 300, "stop": ["z" * 40]}
    got = stream_completion(fakes["router"], body, on_tokens)
    assert answer["status"] == 502 and len(_last_legs(fakes, got)) == 3
    assert got["text"] == full and got["finish_reason"] == "length"  # every character, once


def test_a_stop_string_ends_the_text_as_vllm_ends_it(fakes: dict[str, str]) -> None:
    """The router asks every leg for its stop string (so that no leg holds text back) and cuts it off itself."""
    prompt = [*range(1, 40), 1]
    toks = _expected(prompt, 60)
    full = "".join(f" w{t}" for t in toks)
    at = 20  # the first place these two tokens' text appears
    stop = f"w{toks[at]} w{toks[at + 1]}"
    assert full.find(stop) == len("".join(f" w{t}" for t in toks[:at])) + 1
    body = {"model": "fake", "prompt": prompt, "max_tokens": 60, "stop": [stop, "z" * 40]}
    got = stream_completion(fakes["router"], body)
    assert got["token_ids"] == toks[: at + 2] and got["finish_reason"] == "stop"
    assert got["text"] == full[: full.find(stop)]
    whole = _post(fakes["router"] + "/v1/completions", body).json()["choices"][0]
    assert whole["text"] == got["text"] and whole["stop_reason"] == stop
    kept = stream_completion(fakes["router"], {**body, "include_stop_str_in_output": True})
    assert kept["text"] == full[: full.find(stop) + len(stop)]


def test_a_stop_string_across_a_switch_ends_the_request_there(fakes: dict[str, str]) -> None:
    """Each leg's backend matches stop strings over its own text; the router matches one that spans two legs."""
    import httpx

    prompt = list(range(1, 41))
    toks = _expected(prompt, 60)
    at = BREAK_AT - len(prompt)  # the first leg's last token is toks[at - 1], the next leg's first toks[at]
    full = "".join(f" w{t}" for t in toks)
    stop = f"w{toks[at - 1]} w{toks[at]}"
    assert _stops_at(toks, stop) == at  # a stop string across the switch: neither leg's backend sees it
    body = {"model": "fake", "prompt": prompt, "max_tokens": 60, "stop": ["z" * 30, stop]}
    got = stream_completion(fakes["breaking"], body)
    assert got["token_ids"] == toks[: at + 1] and got["finish_reason"] == "stop", got
    assert got["text"] == full[: full.find(stop)]
    (last,) = [f for f in httpx.get(fakes["breaking"] + "/hurray/requests?recent=true", timeout=30).json()["recent"]
               if f["id"] in got["ids"]]  # fmt: skip
    assert [leg["why"] for leg in last["legs"]] == ["routed", "failover"]
    whole = _post(fakes["breaking"] + "/v1/completions", body).json()
    choice = whole["choices"][0]
    assert choice["text"] == got["text"] and choice["stop_reason"] == stop and choice["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == at + 1  # the tokens the second leg ran on past the stop are not its
    kept = stream_completion(fakes["breaking"], {**body, "include_stop_str_in_output": True})
    assert kept["text"] == full[: full.find(stop) + len(stop)] and kept["token_ids"] == toks[: at + 1]
    # min_tokens past the stop string: vLLM does not match it there, and neither does the router
    later = _stops_at(toks, stop, min_tokens=at + 2)
    assert later > at + 1
    late = stream_completion(fakes["breaking"], {**body, "min_tokens": at + 2})
    assert late["token_ids"] == toks[: later + 1] and late["finish_reason"] == "stop"


def _stops_at(toks: list[int], stop: str, min_tokens: int = 0) -> int:
    """The token at which vLLM would end ``toks`` at ``stop``: the first past min_tokens whose text completes it."""
    text = ""
    for j, t in enumerate(toks):
        text += f" w{t}"
        if j + 1 > min_tokens and text.find(stop, len(text) - len(f" w{t}") - len(stop) + 1) != -1:
            return j
    return len(toks)


def _last_legs(fakes: dict[str, str], got: dict[str, Any]) -> list[dict[str, Any]]:
    import httpx

    recent = httpx.get(fakes["router"] + "/hurray/requests?recent=true", timeout=30).json()["recent"]
    (last,) = [f for f in recent if f["id"] in got["ids"]]
    return list(last["legs"])


def test_a_continuation_keeps_the_limit_the_first_leg_had_by_default(fakes: dict[str, str]) -> None:
    """vLLM gives a completion without max_tokens 16: the decode leg of a P/D split must stop at 16 in all."""
    prompt = list(range(3, 90))
    got = stream_completion(fakes["pd"], {"model": "fake", "prompt": prompt})
    assert got["token_ids"] == _expected(prompt, 16) and got["finish_reason"] == "length"


# ── in process: stand-in backends on aiohttp, the router's app through httpx's ASGI transport ──────────────


class _Stand:
    """An in-process stand-in for a vLLM server: ``/health`` while ``healthy``; completions answer as ``how`` says.

    ``how``: ``"ok"`` (one token, streamed or not), an HTTP status (answered with it), ``"hang"`` (never
    answers: the backend dies, found so by its health checks), ``"hang-after-first"`` (one unfinished token, then
    the same), ``"hang-after-finish"`` (the finished token, then the same),
    ``"error-event"`` (a stream of vLLM's error event alone: a request it refuses once the stream started, such as
    ``logprobs`` over its ``--max-logprobs``), ``"error-after-first"`` (one unfinished token, then that event).
    """

    def __init__(self, how: Any) -> None:
        self.how, self.healthy, self.posts = how, True, 0
        self.url = ""

    async def __aenter__(self) -> _Stand:
        import asyncio

        from aiohttp import web

        self.release = asyncio.Event()

        async def health(request: web.Request) -> web.Response:
            return web.json_response({}, status=200 if self.healthy else 500)

        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.posts += 1
            if isinstance(self.how, int):
                return web.json_response({"error": {"message": "engine dead"}}, status=self.how)
            if self.how == "hang":
                self.healthy = False
                await self.release.wait()
            choice = {"index": 0, "text": " ok", "token_ids": [5], "finish_reason": "length"}
            if self.how in ("error-after-first", "hang-after-first"):
                choice.update(finish_reason=None, prompt_token_ids=body["prompt"])
            event = {"id": "cmpl-stand", "object": "text_completion", "model": "fake", "choices": [choice]}
            if self.how in ("error-event", "error-after-first"):
                r = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await r.prepare(request)
                if self.how == "error-after-first":
                    await r.write(f"data: {json.dumps(event)}\n\n".encode())
                await r.write(f"data: {json.dumps(VLLM_ERROR)}\n\ndata: [DONE]\n\n".encode())
                return r
            if not body.get("stream"):
                return web.json_response(event)
            r = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await r.prepare(request)
            await r.write(f"data: {json.dumps(event)}\n\n".encode())
            if self.how in ("hang-after-first", "hang-after-finish"):
                self.healthy = False
                await self.release.wait()
            await r.write(b"data: [DONE]\n\n")
            return r

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completions)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *_: Any) -> None:
        self.release.set()
        await self.runner.cleanup()


def _closed_port() -> str:
    """The URL of a port nothing listens on (connection refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def _through_router(urls: list[str], body: dict[str, Any] | str, **config: Any) -> tuple[Any, Any]:
    """``body`` posted to a router over ``urls`` (in this process); its answer, and the router.

    A string is sent as it is (JSON that httpx would not write: a lone surrogate's escape).
    """
    import asyncio

    import httpx

    from hurray_vllm.app.router import RouterConfig, build_app

    app = build_app(RouterConfig(backends=tuple(urls), stream_timeout=5.0, **config))
    router = app.state.router
    await router.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            if isinstance(body, str):
                post = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            else:
                post = client.post("/v1/completions", json=body)
            answer = await asyncio.wait_for(post, 10)
    finally:
        await router.stop()
    return answer, router


RELAYED = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 1, "echo": True}  # echo: relayed unmoved
#: What vLLM 0.32 streams for ``logprobs: 21`` (``create_streaming_error_response``: after the stream started).
VLLM_ERROR = {
    "error": {
        "message": "Requested sample logprobs of 21, which is greater than max allowed: 20",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}


@pytest.mark.parametrize(("first", "stream"), [("refused", False), (503, False), (503, True)])
def test_a_relayed_request_whose_backend_fails_before_answering_goes_to_another(first: Any, stream: bool) -> None:
    """Nothing reached the client: the request is tried elsewhere (it once got a 502, or the 503), and the
    failing backend is marked down, as for a flight's first leg."""
    require("fastapi")
    require("httpx")
    import asyncio

    async def run() -> tuple[Any, Any, str, list[int]]:
        async with _Stand("ok") as ok, _Stand(first if first != "refused" else "ok") as failing:
            bad = _closed_port() if first == "refused" else failing.url
            answer, router = await _through_router([bad, ok.url], {**RELAYED, "stream": stream}, health_interval=30)
            return answer, router, bad, [failing.posts, ok.posts]

    answer, router, bad, posts = asyncio.run(run())
    assert answer.status_code == 200, answer.text
    assert '"cmpl-hurray-' in answer.text and '" ok"' in answer.text
    assert posts == ([0, 1] if first == "refused" else [1, 1])
    # Marked down (a 503's backend may be back already: the health check at start-up found it answering).
    assert first != "refused" or not router.backends.all[bad].healthy
    assert router.relayed == {} and all(b.in_flight == 0 for b in router.backends.all.values())


def test_a_relayed_request_on_a_backend_found_dead_before_it_answered_goes_to_another() -> None:
    require("fastapi")
    require("httpx")
    import asyncio

    async def run() -> tuple[Any, int, int]:
        async with _Stand("hang") as hung, _Stand("ok") as ok:
            answer, _ = await _through_router([hung.url, ok.url], RELAYED, health_interval=0.05)
            return answer, hung.posts, ok.posts

    answer, hung_posts, ok_posts = asyncio.run(run())
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " ok", answer.text
    assert hung_posts == 1 and ok_posts == 1


def test_a_relayed_stream_on_a_backend_found_dead_ends_with_an_error() -> None:
    """As a flight's stream would be continued: a relayed one, which cannot be, ends (it waited the stream
    timeout, 600 s by default)."""
    require("fastapi")
    require("httpx")
    import asyncio

    async def run() -> Any:
        async with _Stand("hang-after-first") as hung:
            answer, _ = await _through_router([hung.url], {**RELAYED, "stream": True}, health_interval=0.05)
            return answer

    answer = asyncio.run(run())
    lines = [line for line in answer.text.splitlines() if line.startswith("data: ")]
    assert '" ok"' in lines[0] and lines[-1] == "data: [DONE]", lines
    assert "failed its health checks" in json.loads(lines[-2][6:])["error"]["message"]


def test_a_relayed_stream_on_a_backend_found_dead_after_its_finish_ends_cleanly() -> None:
    """Its only choice had finished: the request is complete, and ends with [DONE] alone (once an error event)."""
    require("fastapi")
    require("httpx")
    import asyncio

    async def run() -> Any:
        async with _Stand("hang-after-finish") as hung:
            answer, _ = await _through_router([hung.url], {**RELAYED, "stream": True}, health_interval=0.05)
            return answer

    answer = asyncio.run(run())
    lines = [line for line in answer.text.splitlines() if line.startswith("data: ")]
    assert len(lines) == 2 and '"length"' in lines[0] and lines[-1] == "data: [DONE]", lines


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_vllm_refuses_in_its_stream_gets_vllms_error_and_no_backend_is_marked_down(stream: bool) -> None:
    """vLLM refuses some requests only once the stream started (an error event, code 400): the client gets that
    error as vLLM gives it, the request is not failed over, and every backend stays in routing (it once marked
    four backends down, answered 502 "too many failures", and other clients 503 meanwhile)."""
    require("fastapi")
    require("httpx")
    import asyncio

    body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 21, "stream": stream}

    async def run() -> tuple[Any, Any, list[int]]:
        async with _Stand("error-event") as a, _Stand("error-event") as b:
            answer, router = await _through_router([a.url, b.url], body, health_interval=30)
            return answer, router, [a.posts, b.posts]

    answer, router, posts = asyncio.run(run())
    assert answer.status_code == 400 and answer.json() == VLLM_ERROR, answer.text
    assert sorted(posts) == [0, 1] and all(b.healthy for b in router.backends.all.values())
    assert router.metrics.failovers == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_refusal_after_tokens_ends_the_request_with_vllms_error(stream: bool) -> None:
    require("fastapi")
    require("httpx")
    import asyncio

    body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream}

    async def run() -> tuple[Any, Any, list[int]]:
        async with _Stand("error-after-first") as a, _Stand("error-after-first") as b:
            answer, router = await _through_router([a.url, b.url], body, health_interval=30)
            return answer, router, [a.posts, b.posts]

    answer, router, posts = asyncio.run(run())
    if stream:
        lines = [line for line in answer.text.splitlines() if line.startswith("data: ")]
        assert '" ok"' in lines[0] and json.loads(lines[1][6:]) == VLLM_ERROR and lines[2:] == ["data: [DONE]"], lines
    else:
        assert answer.status_code == 400 and answer.json() == VLLM_ERROR, answer.text
    assert sorted(posts) == [0, 1] and all(b.healthy for b in router.backends.all.values())


def test_booleans_sent_as_strings_are_read_as_vllm_reads_them() -> None:
    """``"stream": "false"`` is false to vLLM's request model (``bool("false")`` is True); a value vLLM would
    refuse is answered 400 naming the field."""
    require("fastapi")
    require("httpx")
    import asyncio

    body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 1, "stream": "false", "echo": "False",
            "return_token_ids": "no", "stream_options": {"include_usage": "off"}}  # fmt: skip

    async def run() -> tuple[Any, Any, Any]:
        async with _Stand("ok") as a:
            answer, router = await _through_router([a.url], body)
            bad, _ = await _through_router([a.url], {**body, "stream": "maybe"})
            return answer, router, bad

    answer, router, bad = asyncio.run(run())
    assert answer.headers["content-type"].startswith("application/json"), answer.text  # not streamed
    (choice,) = answer.json()["choices"]
    assert choice["text"] == " ok" and "token_ids" not in choice
    assert len(router.recent) == 1  # a flight (echo false: movable), not relayed
    assert bad.status_code == 400 and "stream" in bad.json()["error"]["message"]


@pytest.mark.parametrize("kind", ["completions", "chat/completions"])
@pytest.mark.parametrize("field", ["max_tokens", "min_tokens"])
def test_a_count_of_more_digits_than_python_reads_is_answered_400_naming_it(kind: str, field: str) -> None:
    """int() refuses a string of more than 4300 digits (ValueError): it was answered 500 with a traceback."""
    require("fastapi")
    require("httpx")
    import asyncio

    import httpx

    from hurray_vllm.app.router import RouterConfig, build_app

    app = build_app(RouterConfig(backends=(_closed_port(),)))
    prompt = {"prompt": [1, 2]} if kind == "completions" else {"messages": [{"role": "user", "content": "hi"}]}

    async def run() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.post(f"/v1/{kind}", json={"model": "m", field: "9" * 5000, **prompt})

    answer = asyncio.run(run())
    assert answer.status_code == 400 and field in answer.json()["error"]["message"], answer.text[:300]
    assert len(answer.text) < 500  # the value is not repeated whole


def test_a_relayed_stream_found_dead_as_its_answer_came_ends_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The health task found the backend dead after the answer's headers came, before the handler took them: the
    cut found neither the wait (done) nor the answer (not yet taken), and the client waited for the stream timeout."""
    require("fastapi")
    require("httpx")
    import asyncio
    import time

    import hurray_vllm.app.router.server as server

    answered_then = server._unless_client_leaves

    async def found_dead_meanwhile(request: Any, task: Any) -> bool:
        answered = await answered_then(request, task)
        router = request.app.state.router
        for entry in list(router.relayed.values()):
            router.abandon(entry.backend, "failed its health checks")  # what the health task does, in between
        return answered

    monkeypatch.setattr(server, "_unless_client_leaves", found_dead_meanwhile)

    async def run() -> tuple[Any, float]:
        async with _Stand("hang-after-first") as hung:
            t0 = time.monotonic()
            answer, _ = await _through_router([hung.url], {**RELAYED, "stream": True}, health_interval=30)
            return answer, time.monotonic() - t0

    answer, took = asyncio.run(run())
    lines = [line for line in answer.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and "failed its health checks" in json.loads(lines[-2][6:])["error"]["message"]
    assert took < 4, took  # not the stream timeout (5 s here)


@pytest.mark.parametrize("leg", ["broke off", "finished"])
def test_a_move_behind_a_slow_client_after_its_leg_ended_says_how_it_ended(leg: str) -> None:
    """Its leg's reader ended and its client has not read the events before that end. A leg that broke off was
    answered "has finished" (and a drain left it unreported) while the request then went on on another backend:
    it now says so, and a drain lists it under failed with that reason. One whose backend sent the finish has."""
    import asyncio
    from collections.abc import AsyncIterator

    from hurray_vllm.app.router import RouterConfig
    from hurray_vllm.app.router.flight import RouterError, UpstreamError
    from hurray_vllm.app.router.server import Router

    router = Router(RouterConfig(backends=("http://127.0.0.1:9", "http://127.0.0.1:10")))
    src, dst = (router.backends.all[u] for u in ("http://127.0.0.1:9", "http://127.0.0.1:10"))
    f = router.begin("completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 20, "stream": True})

    async def upstream(backend: Any, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        start = len(body["prompt"]) - 3
        for i in range(start, 20 if backend is dst or leg == "finished" else 5):
            done = "length" if i == 19 else None
            yield {"choices": [{"text": "t", "token_ids": [100 + i], "prompt_token_ids": body["prompt"],
                                "finish_reason": done}]}  # fmt: skip
        if backend is src and leg == "broke off":
            raise UpstreamError(f"{src.url}: ClientConnectionError: connection reset")

    async def nothing(*_: Any) -> None:
        return None

    f._upstream = upstream  # type: ignore[method-assign]
    f._prewarm = nothing  # type: ignore[method-assign]

    async def run() -> tuple[RouterError, dict[str, Any], list[int]]:
        agen = f.deltas()
        got = list((await agen.__anext__()).token_ids)  # then the client reads nothing for a while
        while f._reader is not None and not f._reader.done():
            await asyncio.sleep(0.01)
        with pytest.raises(RouterError) as refused:
            await f.migrate(dst, timeout=5)
        drained = await asyncio.wait_for(router.drain(src.url), 10)
        got += [t async for d in agen for t in d.token_ids]  # it reads on
        return refused.value, drained, got

    refused, drained, got = asyncio.run(run())
    assert got == list(range(100, 120))
    assert refused.status == 409
    if leg == "finished":
        assert refused.message == f"request {f.id} has finished"
        assert drained["moved"] == drained["failed"] == []  # nothing left on it
        assert [x.why for x in f.legs] == ["routed"]
    else:
        assert "has finished" not in refused.message and "ended unfinished" in refused.message, refused.message
        assert drained["failed"] == [{"id": f.id, "error": refused.message}] and drained["moved"] == []
        assert [x.why for x in f.legs] == ["routed", "failover"] and f.legs[-1].backend == dst.url
    assert router.metrics.migrations == {"ok": 0, "failed": 0}  # the request ended, or its source broke: neither


def _counting_upstream(f: Any, until: int, gate: Any = None, refuse: Any = None) -> Any:
    """A leg's upstream for an in-process flight (``f._upstream``): tokens ``100 + i`` up to ``until``, one each 10 ms.

    A prefill leg (not streamed) answers its one token once ``gate`` is set; a leg on ``refuse`` is refused (503).
    """
    import asyncio

    from hurray_vllm.app.router.flight import UpstreamError

    async def upstream(backend: Any, path: str, body: dict[str, Any]) -> Any:
        if backend is refuse:
            raise UpstreamError(f"{backend.url} answered HTTP 503", 503, {"error": {"message": "engine dead"}})
        start = len(body["prompt"]) - 3
        if not body["stream"]:
            await gate.wait()
        for i in range(start, until if body["stream"] else start + 1):
            await asyncio.sleep(0.01)
            done = "length" if i == until - 1 or not body["stream"] else None
            yield {"choices": [{"text": "t", "token_ids": [100 + i], "prompt_token_ids": body["prompt"],
                                "finish_reason": done}]}  # fmt: skip

    return upstream


@pytest.mark.parametrize("how", ["drained", "refused"])
def test_a_drain_whose_destination_cannot_take_a_request_tries_another(how: str) -> None:
    """Found by a review: a drain moved a request again only when another move of it was under way. One whose
    destination was drained meanwhile (two backends drained a moment apart) or refused its warm-up stayed on the
    drained backend, listed under failed, while a third backend was idle."""
    import asyncio

    from hurray_vllm.app.router import RouterConfig
    from hurray_vllm.app.router.flight import RouterError
    from hurray_vllm.app.router.server import Router

    urls = ("http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11")
    router = Router(RouterConfig(backends=urls))
    a, b, c = (router.backends.all[u] for u in urls)
    f = router.begin("completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 100, "stream": True})

    async def prewarm(to: Any, timeout: float) -> None:
        if to is b:  # the first choice (as loaded as c, listed first)
            if how == "drained":
                b.draining = True  # a drain of it began while it warmed up
                return
            raise RouterError(502, f"to: {b.url} could not take it: its warm-up answered HTTP 503: engine dead")

    f._upstream = _counting_upstream(f, 100)  # type: ignore[method-assign]
    f._prewarm = prewarm  # type: ignore[method-assign]

    async def run() -> tuple[dict[str, Any], list[int]]:
        got: list[int] = []

        async def read() -> None:
            async for d in f.deltas():
                got.extend(d.token_ids)

        reading = asyncio.create_task(read())
        while len(f.generated) < 5:
            await asyncio.sleep(0.01)
        drained = await asyncio.wait_for(router.drain(a.url), 10)
        await asyncio.wait_for(reading, 10)
        return drained, got

    drained, got = asyncio.run(run())
    assert drained == {"backend": a.url, "moved": [f.id], "failed": []}
    assert got == list(range(100, 200))
    assert [(leg.backend, leg.why) for leg in f.legs] == [(a.url, "routed"), (c.url, "drained")]
    assert router.metrics.migrations == {"ok": 1, "failed": 1}


@pytest.mark.parametrize("how", ["migrate", "drain"])
def test_a_request_in_its_prefill_leg_is_not_moved_and_decodes_on_a_decode_backend(how: str) -> None:
    """Found by a review: a request moved during its prefill leg whose destination then failed resumed on its source,
    the prefill backend, and decoded there entirely. /hurray/migrate refuses it now (409, saying why), and a drain of
    the prefill backend waits for it to leave for a decode backend, which it does when its prefill ends."""
    import asyncio

    from hurray_vllm.app.router import RouterConfig
    from hurray_vllm.app.router.flight import RouterError
    from hurray_vllm.app.router.server import Router

    router = Router(
        RouterConfig(backends=("http://127.0.0.1:9", "http://127.0.0.1:10"), prefill=("http://127.0.0.1:11",))
    )
    d1, d2, p = router.backends.all.values()
    f = router.begin("completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 20, "stream": True})

    async def run() -> tuple[Any, list[int]]:
        gate = asyncio.Event()
        f._upstream = _counting_upstream(f, 20, gate, refuse=d2)  # type: ignore[method-assign]
        got: list[int] = []

        async def read() -> None:
            async for d in f.deltas():
                got.extend(d.token_ids)

        reading = asyncio.create_task(read())
        while not f.legs:
            await asyncio.sleep(0.01)
        outcome: Any
        if how == "migrate":
            try:
                outcome = await router.migrate(f.id, d2.url)
            except RouterError as exc:
                outcome = exc
            gate.set()
        else:
            draining = asyncio.create_task(router.drain(p.url))
            await asyncio.sleep(0.2)
            assert not draining.done()  # it waits for the prefill to end
            gate.set()
            outcome = await asyncio.wait_for(draining, 10)
        await asyncio.wait_for(reading, 10)
        return outcome, got

    outcome, got = asyncio.run(run())
    assert got == list(range(100, 120))
    assert [(leg.backend, leg.why) for leg in f.legs] == [(p.url, "prefill"), (d1.url, "decode")]
    if how == "migrate":
        assert isinstance(outcome, RouterError) and outcome.status == 409, outcome
        assert (
            f"is in its prefill leg on {p.url}; it moves to a decode backend when the prefill ends" in outcome.message
        )
    else:
        assert outcome == {"backend": p.url, "moved": [f.id], "failed": []}
    assert router.metrics.migrations == {"ok": 0, "failed": 0}
