"""The router in front of stand-in vLLM servers in this process: what it relays, lists and joins.

Each stand-in is an aiohttp server on 127.0.0.1, in a thread of its own,
that answers ``/health``, ``/v1/models`` and scripted completions (the
events vLLM 0.32 streams for the case at hand); the router runs in
Starlette's ``TestClient``. For what an in-process stub of a leg's upstream
cannot show: a request relayed unmoved, and the router's own endpoints.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import require

#: A stand-in's script: the events of one answer to a request body (streamed, or the first one is the answer); an
#: event given as bytes is streamed as it is (a payload no JSON encoder writes).
Script = Callable[[dict[str, Any]], list[dict[str, Any]] | list[dict[str, Any] | bytes]]


class FakeVLLM:
    """A vLLM OpenAI server stand-in: ``models`` on ``/v1/models``, ``script`` for every completion.

    A streamed answer sends ``hold_after`` events, then waits for :attr:`gate`
    before the rest (a request that is still in flight while the test looks);
    it ends with ``data: [DONE]`` unless ``done`` is false (its body then ends
    cleanly after the events).
    """

    def __init__(self, models: list[str], script: Script, hold_after: int | None = None, done: bool = True) -> None:
        self.models, self.script, self.hold_after, self.done = models, script, hold_after, done
        self.gate = threading.Event()
        self.bodies: list[dict[str, Any]] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._runner: Any = None

    def __enter__(self) -> FakeVLLM:
        self._thread.start()
        assert self._started.wait(10), "the stand-in did not start"
        return self

    def __exit__(self, *_: Any) -> None:
        self.gate.set()
        # Its connections closed first (the router's keep-alive ones too): none is left pending in a stopped loop.
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _serve(self) -> None:
        from aiohttp import web

        async def health(_: web.Request) -> web.Response:
            return web.Response()

        async def models(_: web.Request) -> web.Response:
            return web.json_response(
                {"object": "list", "data": [{"id": m, "object": "model", "max_model_len": 64} for m in self.models]}
            )

        async def complete(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.bodies.append(body)
            events = self.script(body)
            if not body.get("stream"):
                return web.json_response(events[0])
            out = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await out.prepare(request)
            for i, event in enumerate(events):
                if i == self.hold_after:
                    while not self.gate.is_set():
                        await asyncio.sleep(0.01)
                payload = event if isinstance(event, bytes) else json.dumps(event).encode()
                await out.write(b"data: " + payload + b"\n\n")
            if self.done:
                await out.write(b"data: [DONE]\n\n")
            return out

        async def start() -> None:
            app = web.Application()
            app.router.add_get("/health", health)
            app.router.add_get("/v1/models", models)
            app.router.add_post("/v1/completions", complete)
            app.router.add_post("/v1/chat/completions", complete)
            runner = self._runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(start())
        self._started.set()
        self._loop.run_forever()


@pytest.fixture
def router_over() -> Iterator[Callable[..., Any]]:
    """``router_over(*fakes)``: a ``TestClient`` of a router over the stand-ins, closed at the test's end."""
    require("fastapi")
    require("httpx")
    from fastapi.testclient import TestClient

    from hurray_vllm.app.router import RouterConfig, build_app

    clients: list[Any] = []

    def make(*fakes: FakeVLLM) -> Any:
        config = RouterConfig(backends=tuple(f.url for f in fakes), health_interval=30)
        client = TestClient(build_app(config))
        client.__enter__()
        clients.append(client)
        deadline = time.monotonic() + 30
        # The first health check reads every backend's /v1/models (what each serves), in the background.
        while any(b.max_model_len is None for b in client.app.state.router.backends.all.values()):
            assert time.monotonic() < deadline, "the router did not read its backends' models"
            time.sleep(0.01)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def _chunk(delta: dict[str, Any], **choice: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **choice}]}  # fmt: skip


def _sse(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_a_chats_echo_reaches_the_client_whole_and_outside_the_stop_strings(router_over: Any) -> None:
    """vLLM streams the echoed last message as an event of its own, without token ids, and matches stop strings
    over the generated text only: "is" in the echo must not end the request (the client once got "The answer ")."""

    def vllm(body: dict[str, Any]) -> list[dict[str, Any]]:
        asked = bool(body.get("return_token_ids"))
        role = _chunk({"role": "assistant", "content": ""})
        if asked:
            role["prompt_token_ids"] = [1, 2, 3, 4]
        gen = [_chunk({"content": " 42"}, **({"token_ids": [42]} if asked else {})),
               _chunk({"content": "."}, finish_reason="stop", **({"token_ids": [2]} if asked else {}))]  # fmt: skip
        return [role, _chunk({"content": "The answer is"}), *gen]

    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "The answer is"}]
    body = {"model": "m", "messages": messages, "continue_final_message": True, "add_generation_prompt": False,
            "echo": True, "stop": ["is"], "stream": True}  # fmt: skip
    with FakeVLLM(["m"], vllm) as fake:
        client = router_over(fake)
        r = client.post("/v1/chat/completions", json=body)
        events = _sse(r.text)
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
        assert text == "The answer is 42." and events[-1]["choices"][0]["finish_reason"] == "stop", r.text
        assert {e["id"] for e in events} == {events[0]["id"]} and events[0]["id"].startswith("chatcmpl-hurray-")
        assert fake.bodies[-1]["echo"] is True and "include_stop_str_in_output" not in fake.bodies[-1]  # as sent


@pytest.mark.parametrize("token_ids", [True, False])
def test_a_relayed_request_is_listed_with_its_prompt_and_the_tokens_it_generated(
    router_over: Any, token_ids: bool
) -> None:
    """Relayed unmoved (structured output): the role event is no token, an event of several tokens is several, and
    the prompt's length comes from the first event (it once stayed null for a text prompt)."""

    def vllm(body: dict[str, Any]) -> list[dict[str, Any]]:
        role = _chunk({"role": "assistant", "content": ""})
        if token_ids:
            role["prompt_token_ids"] = [1, 2, 3, 4]
        ids = ({"token_ids": [5, 6, 7]}, {"token_ids": [8]}, {"token_ids": [9]})
        return [role, _chunk({"content": "a b c"}, **(ids[0] if token_ids else {})),
                _chunk({"content": "d"}, **(ids[1] if token_ids else {})),
                _chunk({"content": "e"}, finish_reason="stop", **(ids[2] if token_ids else {}))]  # fmt: skip

    body = {"model": "m", "messages": [{"role": "user", "content": "count"}], "guided_regex": "[a-e ]+",
            "stream": True, "return_token_ids": token_ids}  # fmt: skip
    with FakeVLLM(["m"], vllm, hold_after=3) as fake:
        client = router_over(fake)
        answer: dict[str, Any] = {}
        streaming = threading.Thread(target=lambda: answer.update(r=client.post("/v1/chat/completions", json=body)))
        streaming.start()
        try:
            deadline = time.monotonic() + 30
            while True:
                listed = client.get("/hurray/requests").json()["requests"]
                if listed and listed[0]["generated_tokens"] >= (4 if token_ids else 2):
                    break
                assert time.monotonic() < deadline, listed
                time.sleep(0.02)
            time.sleep(0.1)  # nothing more is counted while the stand-in holds the rest back
            (req,) = client.get("/hurray/requests").json()["requests"]
        finally:
            fake.gate.set()
            streaming.join(30)
        assert req["movable"] is False and "structured output" in req["why_not_movable"]
        assert (req["prompt_tokens"], req["generated_tokens"]) == ((4, 4) if token_ids else (None, 2))
        assert answer["r"].status_code == 200 and client.get("/hurray/requests").json()["requests"] == []


def test_a_relayed_requests_usage_is_the_backends_count() -> None:
    """A whole answer, or a stream's usage chunk: vLLM's own counts replace what the events added up to."""
    from hurray_vllm.app.router.backends import Backend
    from hurray_vllm.app.router.server import Relayed

    r = Relayed("r", Backend("http://a:1"), "tools", None)
    r.count(_chunk({"role": "assistant", "content": ""}))
    r.count({"choices": [{"index": 0, "text": "ab"}, {"index": 1, "text": ""}]})  # n = 2: one carried text
    assert (r.prompt_tokens, r.generated_tokens) == (None, 1)
    r.count({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}})
    assert (r.prompt_tokens, r.generated_tokens) == (9, 7)
    whole = Relayed("w", Backend("http://a:1"), "n > 1", None)
    whole.count({"choices": [{"index": 0, "message": {"role": "assistant", "content": "x y"}}],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 2}})  # fmt: skip
    assert (whole.prompt_tokens, whole.generated_tokens) == (3, 2)


def test_models_lists_what_every_healthy_backend_serves_once(router_over: Any) -> None:
    """A LoRA adapter loaded on one backend is served through the router: /v1/models lists it (it once listed the
    first backend's models only), and each model once however many backends serve it."""

    def never(body: dict[str, Any]) -> list[dict[str, Any]]:
        raise AssertionError("no completion expected")

    with FakeVLLM(["m", "sql"], never) as a, FakeVLLM(["m", "chat-lora"], never) as b:
        client = router_over(a, b)
        r = client.get("/v1/models")
        assert r.status_code == 200 and r.json()["object"] == "list"
        assert [c["id"] for c in r.json()["data"]] == ["m", "sql", "chat-lora"]
        router = client.app.state.router
        router.backends.all[a.url].healthy = False  # a backend found dead: its models are not served now
        assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["m", "chat-lora"]
        router.backends.all[b.url].healthy = False
        assert client.get("/v1/models").status_code == 503


def test_models_leaves_out_a_card_whose_id_is_not_a_string(router_over: Any) -> None:
    """Found by a review: a backend card whose id was a list (a malformed peer) failed the whole list with a
    plain-text 500 for every client (an unhashable key); the other backends' models are still listed."""

    def never(body: dict[str, Any]) -> list[dict[str, Any]]:
        raise AssertionError("no completion expected")

    with FakeVLLM(["m"], never) as a, FakeVLLM(["m"], never) as b:
        client = router_over(a, b)
        b.models = [["x"], {"k": 1}, "sql"]  # type: ignore[list-item]  # ids: a list, an object, a string
        r = client.get("/v1/models")
        assert r.status_code == 200, r.text
        assert [c["id"] for c in r.json()["data"]] == ["m", "sql"]


def _vllm_with_answer_fields(body: dict[str, Any]) -> list[dict[str, Any]]:
    """vLLM 0.32's answers with its fields outside the choices: ``kv_transfer_params`` in a non-streamed answer
    (what an external P/D proxy reads), and a chat's ``prompt_text`` (its answer, or a stream's first event)."""
    chat = "messages" in body
    if not body.get("stream"):
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": " x"}}
        else:
            choice = {"index": 0, "text": " x", "prompt_token_ids": [1, 2]}
        answer = {"id": "up", "object": "chat.completion" if chat else "text_completion", "created": 1, "model": "m",
                  "choices": [{**choice, "token_ids": [5], "finish_reason": "length"}],
                  "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}  # fmt: skip
        if chat:
            answer["prompt_token_ids"] = [1, 2]
        if body.get("kv_transfer_params") is not None:
            answer["kv_transfer_params"] = {"remote_block_ids": [1, 2], "do_remote_prefill": True}
        if chat and body.get("return_prompt_text"):
            answer["prompt_text"] = "<|user|>hi"
        return [answer]
    if chat:
        role = _chunk({"role": "assistant", "content": ""})
        role["prompt_token_ids"] = [1, 2]
        if body.get("return_prompt_text"):
            role["prompt_text"] = "<|user|>hi"  # vLLM: on the first chunk only
        return [role, _chunk({"content": " x"}, token_ids=[5], finish_reason="length")]
    return [{"id": "up", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": " x", "token_ids": [5], "prompt_token_ids": [1, 2], "logprobs": None,
                          "finish_reason": "length"}]}]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("completions", {"prompt": [1, 2], "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "return_prompt_text": True},
         "prompt_text"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "return_prompt_text": True,
                              "stream": True}, "prompt_text"),
    ],
    ids=["completion kv_transfer_params", "chat kv_transfer_params", "chat prompt_text", "streamed prompt_text"],
)  # fmt: skip
def test_answer_fields_outside_the_choices_reach_the_client(
    router_over: Any, path: str, extra: dict[str, Any], field: str
) -> None:
    """Found by a review: every leg streams and the router rebuilds the answer from the choices, so an external
    P/D proxy's non-streamed request got no kv_transfer_params back (no handshake), and return_prompt_text's
    prompt_text was dropped. Such requests are relayed as sent, unmoved, and the backend's answer has them."""
    with FakeVLLM(["m"], _vllm_with_answer_fields) as fake:
        client = router_over(fake)
        body = {"model": "m", "max_tokens": 1, **extra}
        r = client.post(f"/v1/{path}", json=body)
        assert r.status_code == 200, r.text
        answer = _sse(r.text)[0] if body.get("stream") else r.json()
        assert field in answer, answer
        assert answer["id"].startswith(("cmpl-hurray-", "chatcmpl-hurray-"))  # the router's own, as relayed ones
        assert fake.bodies[-1] == body  # as the client sent it: not made a stream
        assert client.get("/hurray/requests?recent=true").json()["requests"] == []


def test_only_a_non_streamed_request_with_kv_transfer_params_and_a_chat_with_prompt_text_are_unmovable() -> None:
    """A stream carries no kv_transfer_params back (vLLM's rule): streamed, the request still moves; vLLM's
    completions take no return_prompt_text."""
    from hurray_vllm.app.router.flight import movable

    kv = {"kv_transfer_params": {"do_remote_decode": True}}
    assert "kv_transfer_params" in (movable("completion", {"prompt": [1], **kv}) or "")
    assert "kv_transfer_params" in (movable("chat", {"messages": [], "stream": "false", **kv}) or "")
    assert movable("completion", {"prompt": [1], "stream": True, **kv}) is None
    assert "return_prompt_text" in (movable("chat", {"messages": [], "return_prompt_text": True}) or "")
    assert movable("chat", {"messages": [], "return_prompt_text": False}) is None
    assert movable("completion", {"prompt": [1], "return_prompt_text": True}) is None


def test_a_request_for_a_model_one_backend_serves_goes_there(router_over: Any) -> None:
    """``sql`` is loaded on A only: the request goes to A even while B is less loaded (B would answer 404)."""

    def vllm(body: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"id": "cmpl-up", "object": "text_completion", "created": 1, "model": body["model"],
                 "choices": [{"index": 0, "text": "x", "token_ids": [5], "prompt_token_ids": [1, 2],
                              "finish_reason": "length"}]}]  # fmt: skip

    with FakeVLLM(["m"], vllm) as b, FakeVLLM(["m", "sql"], vllm) as a:
        client = router_over(b, a)  # b first: the least loaded of two idle backends, all else equal
        router = client.app.state.router
        assert router.backends.all[a.url].served == {"m", "sql"}  # read by the first health check
        router.backends.all[a.url].in_flight = 3  # a is busier
        r = client.post("/v1/completions", json={"model": "sql", "prompt": [1, 2], "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert [x["model"] for x in a.bodies] == ["sql"] and b.bodies == []


@pytest.mark.parametrize("kind", ["completions", "chat/completions"])
def test_stream_options_without_a_stream_are_refused_as_vllm_refuses_them(router_over: Any, kind: str) -> None:
    """Every leg streams, so no backend saw the client's ``stream: false``: the router once answered such a request.
    vLLM checks the raw values (``validate_stream_options``): an empty object, or a stream of "false", passes."""

    def vllm(body: dict[str, Any]) -> list[dict[str, Any]]:
        ids = {"token_ids": [5], "prompt_token_ids": [1, 2]}
        if kind == "completions":
            choice: dict[str, Any] = {"index": 0, "text": "x", "finish_reason": "length", **ids}
        else:
            choice = {"index": 0, "delta": {"role": "assistant", "content": "x"}, "finish_reason": "length", **ids}
        return [{"id": "up", "object": "x", "created": 1, "model": "m", "choices": [choice]}]

    body = {"model": "m", "max_tokens": 1, **({"prompt": [1, 2]} if kind == "completions" else
            {"messages": [{"role": "user", "content": "hi"}]})}  # fmt: skip
    with FakeVLLM(["m"], vllm) as fake:
        client = router_over(fake)
        for stream in (False, None, 0):
            r = client.post(f"/v1/{kind}", json={**body, "stream": stream, "stream_options": {"include_usage": True}})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == "Stream options can only be defined when `stream=True`."
        assert fake.bodies == []
        assert client.post(f"/v1/{kind}", json={**body, "stream_options": {}}).status_code == 200
        r = client.post(f"/v1/{kind}", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and _sse(r.text)[-1]["usage"]["completion_tokens"] == 1


def _completion_chunk(finish: str | None = None, index: int = 0) -> dict[str, Any]:
    return {"id": "cmpl-up", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": index, "text": " w", "logprobs": None, "finish_reason": finish}]}  # fmt: skip


#: Relayed unmoved (n = 2: several sequences).
RELAYED = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "n": 2, "stream": True}


def test_a_relayed_event_nested_too_deeply_ends_the_stream_with_an_error_and_done(router_over: Any) -> None:
    """Found by a review: json.loads raised RecursionError out of the relay, and the client's chunked body broke
    off with neither an error nor [DONE]."""
    deep = b'{"id": "cmpl-up", "choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with FakeVLLM(["m"], lambda body: [_completion_chunk(), deep, _completion_chunk("length")]) as fake:
        r = router_over(fake).post("/v1/completions", json=RELAYED)
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and len(lines) == 3 and lines[-1] == "data: [DONE]", lines
    assert json.loads(lines[0][6:])["id"].startswith("cmpl-hurray-")
    error = json.loads(lines[1][6:])["error"]
    assert error["code"] == 502 and fake.url in error["message"] and "nested too deeply" in error["message"], error


@pytest.mark.parametrize("finished", [False, True])
def test_a_relayed_stream_whose_body_ends_without_done_ends_as_a_stream_that_breaks_off(
    router_over: Any, finished: bool
) -> None:
    """Found by a review: a backend body that ended cleanly mid-stream (no [DONE]) ended the client's stream with
    neither an error nor [DONE]. Unfinished, it is a failure (an error event, then [DONE]); after every choice's
    finish, the client has the whole answer ([DONE] alone)."""
    events = [_completion_chunk(), _completion_chunk(index=1)]
    if finished:
        events += [_completion_chunk("length"), _completion_chunk("length", index=1)]
    with FakeVLLM(["m"], lambda body: events, done=False) as fake:
        r = router_over(fake).post("/v1/completions", json=RELAYED)
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]", lines
    if finished:
        assert len(lines) == len(events) + 1 and all("error" not in line for line in lines), lines
    else:
        assert len(lines) == len(events) + 2, lines
        error = json.loads(lines[-2][6:])["error"]
        assert error["code"] == 502 and f"{fake.url}: it ended the stream without finishing" in error["message"]
