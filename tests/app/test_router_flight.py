"""A leg whose backend sends events of an unexpected shape fails cleanly: its client is answered, never left waiting."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hurray_vllm.app.router.backends import Backend
from hurray_vllm.app.router.flight import (
    PARSED,
    Delta,
    Flight,
    RouterError,
    UpstreamError,
    _cached_tokens,
    _upstream_delta,
    movable,
)
from hurray_vllm.app.router.server import Router, RouterConfig


def _read_leg(f: Flight, backend: Backend, path: str, events: list[Any]) -> list[tuple[str, Any]]:
    """What a leg's reader queues for ``events`` from its backend: ``(kind, item)`` in order."""

    async def upstream(*_: Any) -> AsyncIterator[Any]:
        for e in events:
            yield e

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> list[tuple[str, Any]]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        await asyncio.wait_for(f._read(backend, path, {}, q, asyncio.Semaphore(8)), 5)
        return [q.get_nowait() for _ in range(q.qsize())]

    return asyncio.run(run())


@pytest.mark.parametrize(
    "event",
    [
        {"choices": ["not an object"]},
        {"choices": [{"text": "x", "token_ids": ["7"]}]},
        {"choices": [{"text": "x", "token_ids": [True]}]},
        {"choices": [{"text": "x", "token_ids": 7}]},
        {"choices": [{"text": "x", "token_ids": [1], "prompt_token_ids": [1.5]}]},
        {"choices": {"0": {}}},
        {"choices": [], "usage": "not an object"},
        {"choices": [], "usage": {"prompt_tokens_details": 7}},
        {"choices": [{"text": 5, "token_ids": [1]}]},
        {"choices": [{"text": "x", "token_ids": [1], "finish_reason": 1}]},
    ],
)
def test_an_unreadable_event_ends_the_leg_with_an_error(event: Any) -> None:
    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    f = Flight(router, "completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
    backend = Backend("http://127.0.0.1:9")

    first = {"choices": [{"text": "a", "token_ids": [5], "prompt_token_ids": [1, 2, 3]}]}
    got = _read_leg(f, backend, "/v1/completions", [first, event])
    assert [k for k, _ in got] == ["delta", "error"]
    assert isinstance(got[-1][1], UpstreamError)
    assert f.generated == [5]


def test_token_ids_must_be_integers() -> None:
    with pytest.raises(UpstreamError, match="list of integers"):
        _upstream_delta({"choices": [{"text": "", "token_ids": [1, "2"]}]}, chat=False)
    delta, prompt = _upstream_delta({"choices": [{"text": "", "token_ids": [1, 2], "prompt_token_ids": [3]}]}, False)
    assert delta.token_ids == [1, 2] and prompt == [3]


@pytest.mark.parametrize(
    ("answer", "cached"),
    [
        (b'{"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}}', 8),
        (b'{"usage": {"prompt_tokens": 9, "prompt_tokens_details": null}}', None),  # no --enable-prompt-tokens-details
        (b'{"usage": {"prompt_tokens_details": {"cached_tokens": true}}}', None),
        (b'{"usage": {"prompt_tokens_details": {"cached_tokens": "8"}}}', None),
        (b'{"usage": []}', None),
        (b"[1, 2]", None),
        (b"not json", None),
        (b"\xff\xfe", None),
    ],
)
def test_a_warm_ups_cached_tokens_are_read_from_any_answer(answer: bytes, cached: int | None) -> None:
    assert _cached_tokens(answer) == cached


@pytest.mark.parametrize(
    ("kind", "body", "why"),
    [
        ("completion", {"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
        ("completion", {"guided_regex": "[a-z]+"}, "guided_regex"),
        ("completion", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"guided_choice": ["yes", "no"]}, "guided_choice"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ("chat", {"tools": [{"type": "function"}]}, "tools"),
        ("chat", {"include_reasoning": False}, "include_reasoning"),  # vLLM then leaves out the token ids
        ("chat", {"response_format": {"type": "text"}}, None),  # plain text: nothing to restart
        ("completion", {"guided_json": None, "temperature": 0}, None),
        ("completion", {"prompt_embeds": "base64..."}, "embeddings"),
    ],
)
def test_structured_output_is_not_moved(kind: str, body: dict[str, Any], why: str | None) -> None:
    """A continuation is a new request: a grammar or schema would start over in the middle of the output."""
    got = movable(kind, {"model": "m", "messages" if kind == "chat" else "prompt": [1], **body})
    assert (got is None) if why is None else (got is not None and why in got)


def test_a_chat_backends_reasoning_is_passed_on_and_pins_the_request() -> None:
    """Fields a reasoning or tool parser splits out reach the client; such a stream can then no longer move."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    f = Flight(router, "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    backend = Backend("http://127.0.0.1:9")
    events = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}, "token_ids": [], "prompt_token_ids": [1, 2]}]},
        {"choices": [{"delta": {"content": "a"}, "token_ids": [5]}]},
        {"choices": [{"delta": {"reasoning_content": "hm", "tool_calls": None}, "token_ids": [6]}]},
    ]

    got = [d for kind, d in _read_leg(f, backend, "/v1/chat/completions", events) if kind == "delta"]
    assert [d.extra for d in got] == [None, None, {"reasoning_content": "hm", "tool_calls": None}]
    assert f.unmovable == PARSED
    with pytest.raises(RouterError, match="parses reasoning") as exc:
        asyncio.run(f.migrate(backend))
    assert exc.value.status == 409
    with pytest.raises(UpstreamError, match="not an object"):
        _upstream_delta({"choices": [{"delta": ["x"]}]}, chat=True)


def test_a_move_behind_a_client_that_does_not_read_says_so() -> None:
    """The switch happens in the client's stream: unread, the move times out with that reason (the request still
    moves when the client reads on)."""
    from hurray_vllm.app.router.flight import Leg

    router = Router(RouterConfig(backends=("http://127.0.0.1:9", "http://127.0.0.1:10")))
    f = Flight(router, "completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 40})
    src, dst = (router.backends.all[u] for u in ("http://127.0.0.1:9", "http://127.0.0.1:10"))

    async def nothing(*_: Any) -> None:
        return None

    f._prewarm = nothing  # type: ignore[method-assign]

    async def run() -> RouterError:
        f.prompt_ids, f.generated, f.backend = [1, 2, 3], [7, 8], src
        f.legs.append(Leg(src.url, "routed", 0))
        f._reader = asyncio.create_task(asyncio.sleep(3600))
        try:
            await f.migrate(dst, timeout=0.2)  # nobody consumes f.deltas(): the client is not reading
        except RouterError as exc:
            return exc
        raise AssertionError("the move did not time out")

    exc = asyncio.run(run())
    assert exc.status == 504 and "client has not read" in exc.message
    assert f._interrupt is not None and f._interrupt.to is dst  # still pending: it happens when the client reads


def test_a_prefill_answer_becomes_the_events_a_stream_would_have_sent() -> None:
    """The prefill leg is answered in one JSON (whose kv_transfer_params the decode leg passes on)."""
    import json

    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    backend = Backend("http://127.0.0.1:9")
    f = Flight(router, "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    answer = {
        "id": "chatcmpl-x",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "a", "tool_calls": [], "reasoning_content": None},
                "token_ids": [5],
                "finish_reason": "length",
            }
        ],
        "prompt_token_ids": [1, 2],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1},
        "kv_transfer_params": {"hurray_saved_tokens": 0, "hurray_tail_tokens": 2},
    }
    event, usage = f._answer_events(json.dumps(answer).encode(), backend)
    delta, prompt = _upstream_delta(event, chat=True)
    assert (delta.text, delta.token_ids, delta.finish_reason, delta.extra, prompt) == ("a", [5], "length", None, [1, 2])
    assert usage == {"choices": [], "usage": answer["usage"]}
    assert f._announced == answer["kv_transfer_params"]
    for bad in (b"not json", b"[]", b'{"choices": []}', b'{"choices": ["x"]}', b'{"error": {"message": "no"}}'):
        with pytest.raises(UpstreamError, match="malformed answer"):
            f._answer_events(bad, backend)


def test_a_request_whose_parser_showed_during_the_warm_ups_is_not_moved() -> None:
    from hurray_vllm.app.router.flight import Leg

    router = Router(RouterConfig(backends=("http://127.0.0.1:9", "http://127.0.0.1:10")))
    f = Flight(router, "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40})
    src, dst = (router.backends.all[u] for u in ("http://127.0.0.1:9", "http://127.0.0.1:10"))

    async def warm_up(*_: Any) -> None:
        f.unmovable = PARSED  # the source's stream sent reasoning meanwhile

    f._prewarm = warm_up  # type: ignore[method-assign]

    async def run() -> RouterError:
        f.prompt_ids, f.generated, f.backend = [1, 2, 3], [7], src
        f.legs.append(Leg(src.url, "routed", 0))
        f._reader = asyncio.create_task(asyncio.sleep(3600))
        try:
            await f.migrate(dst, timeout=5)
        except RouterError as exc:
            assert not f._reader.cancelled() and f._interrupt is None  # the source stream goes on untouched
            f._reader.cancel()
            return exc
        raise AssertionError("moved")

    exc = asyncio.run(run())
    assert exc.status == 409 and "cannot be moved" in exc.message


def test_a_non_streamed_chat_answer_keeps_what_the_parser_split_out() -> None:
    from hurray_vllm.app.router.flight import Delta
    from hurray_vllm.app.router.server import _collect

    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    f = router.begin("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    f.prompt_ids = [1, 2]

    async def deltas() -> AsyncIterator[Delta]:
        yield Delta("", [6], extra={"reasoning_content": " so"})
        yield Delta("yes", [7], "stop", extra={"tool_calls": None})

    first = Delta("", [5], extra={"reasoning_content": "think"})
    out = asyncio.run(_collect(router, f, deltas(), first))
    message = out["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "yes", "reasoning_content": "think so"}
    assert f.id not in router.flights  # ended


def _streamed_run(body_fails: bool, client_gone: bool) -> int:
    """How many times a streamed answer's end hook ran, for one way of ending."""
    from hurray_vllm.app.router.server import _streamed

    ended: list[int] = []

    async def body() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        if body_fails:
            raise RuntimeError("upstream broke")
        yield b"data: [DONE]\n\n"

    async def done() -> None:
        ended.append(1)

    async def receive() -> dict[str, Any]:
        if client_gone:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)
        return {}

    async def send(message: dict[str, Any]) -> None:
        await asyncio.sleep(0)

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/"}
    try:
        asyncio.run(_streamed(body(), done, media_type="text/event-stream")(scope, receive, send))
    except Exception:  # the body's own failure propagates; what matters is that the request was let go
        pass
    return len(ended)


@pytest.mark.parametrize(("body_fails", "client_gone"), [(False, False), (True, False), (False, True)])
def test_a_streamed_answer_lets_go_of_its_request_however_it_ends(body_fails: bool, client_gone: bool) -> None:
    """Also when the client is gone before the body starts (Starlette then never runs the generator)."""
    assert _streamed_run(body_fails, client_gone) == 1


@pytest.mark.parametrize(
    ("content", "moves"),
    [
        ("hi", True),
        ([{"type": "text", "text": "hi"}], True),
        ([{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": "data:..."}}], False),
        ([{"type": "input_audio", "input_audio": {"data": "..."}}], False),
        ([{"type": "text", "uuid": "u1", "image_url": {"url": "data:..."}}], False),  # a media key: an image
        ([{"type": "video_url", "video_url": {"url": "v"}}], False),
        ([{"type": "something new"}], False),  # unknown to the router: it would be lost at a move
        ([{"type": "refusal", "refusal": "no"}, {"type": "thinking", "thinking": "hm"}, {"text": "x"}], True),
        (["a string part"], True),
    ],
)
def test_a_chat_with_images_or_audio_is_not_moved(content: Any, moves: bool) -> None:
    """A continuation is a token-id prompt: the media's KV would be computed from placeholder tokens alone."""
    got = movable("chat", {"model": "m", "messages": [{"role": "user", "content": content}]})
    assert (got is None) is moves, got
    assert moves or "images" in str(got)


def test_a_continuation_and_a_warm_up_keep_the_requests_cache_salt() -> None:
    """``cache_salt`` keeps a tenant's KV apart (vLLM's prefix cache, the connector's keys): every leg keeps it."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    for kind, base in (("chat", {"messages": [{"role": "user", "content": "hi"}]}), ("completion", {"prompt": [1]})):
        f = Flight(router, kind, {"model": "m", "max_tokens": 8, "cache_salt": "tenant-a", **base})
        f.prompt_ids, f.generated = [1, 2, 3], [4]
        f.legs.append(object())  # type: ignore[arg-type]  # a leg ran: the next one is a continuation
        _, body = f._leg_body(announce=True)
        assert body["cache_salt"] == "tenant-a" and body["prompt"] == [1, 2, 3, 4], kind
    # Truncation applied to the prompt already: a continuation is not truncated again.
    f = Flight(
        router, "completion", {"model": "m", "prompt": [1], "truncate_prompt_tokens": 3, "truncation_side": "right"}
    )
    f.prompt_ids, f.generated = [1, 2, 3], [4]
    f.legs.append(object())  # type: ignore[arg-type]
    _, body = f._leg_body(announce=True)
    assert "truncate_prompt_tokens" not in body and "truncation_side" not in body and body["prompt"] == [1, 2, 3, 4]

    sent: list[dict[str, Any]] = []

    class _Answer:
        status = 200

        async def __aenter__(self) -> _Answer:
            return self

        async def __aexit__(self, *_: Any) -> None:
            return None

        async def read(self) -> bytes:
            return b"{}"

    class _Client:
        def post(self, url: str, json: dict[str, Any], timeout: Any) -> _Answer:
            sent.append(json)
            return _Answer()

    router.client = _Client()  # type: ignore[assignment]
    f = Flight(router, "completion", {"model": "m", "prompt": [1], "max_tokens": 8, "cache_salt": "tenant-a"})
    f.prompt_ids, f.generated = [1, 2, 3], [4]
    asyncio.run(f._prewarm(Backend("http://127.0.0.1:9"), 5))
    assert sent[0]["cache_salt"] == "tenant-a" and sent[0]["model"] == "m"


def test_prompt_logprobs_are_not_moved() -> None:
    """vLLM refuses them on a stream, and a continuation's would cover the generated tokens too."""
    assert movable("completion", {"prompt": [1], "prompt_logprobs": 2}) == "prompt_logprobs"
    assert movable("completion", {"prompt": [1], "prompt_logprobs": None}) is None


def test_a_chat_continuation_without_a_limit_runs_to_the_destinations_context_length() -> None:
    """/v1/completions would stop a continuation at 16 tokens; the chat it continues had no limit."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    dest = Backend("http://127.0.0.1:9")
    dest.max_model_len = 100
    f = Flight(router, "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    f.prompt_ids, f.generated = [1, 2, 3], [4, 5]
    f.legs.append(object())  # type: ignore[arg-type]
    _, body = f._leg_body(announce=True, dest=dest)
    assert body["max_tokens"] == 95
    f = Flight(router, "completion", {"model": "m", "prompt": [1, 2, 3]})
    f.prompt_ids, f.generated = [1, 2, 3], [4, 5]
    f.legs.append(object())  # type: ignore[arg-type]
    assert f._leg_body(announce=True, dest=dest)[1]["max_tokens"] == 14  # vLLM's 16, less the two generated


def test_a_chat_continuation_to_a_backend_of_unknown_context_takes_another_backends_of_the_model() -> None:
    """No health check read the destination's /v1/models yet: the largest max_model_len another backend serving
    the model said (vLLM takes max_tokens up to its own context), never none (/v1/completions' 16)."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11")))
    dest, same, other = router.backends.all.values()
    same.max_model_len, same.served = 100, frozenset({"m"})
    other.max_model_len, other.served = 5000, frozenset({"another"})
    f = Flight(router, "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    f.prompt_ids, f.generated = [1, 2, 3], [4, 5]
    f.legs.append(object())  # type: ignore[arg-type]
    assert f._leg_body(announce=True, dest=dest)[1]["max_tokens"] == 95


def test_text_offsets_count_on_across_legs() -> None:
    """Each leg's logprobs count text_offset from its own first token; the client sees one text."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    f = Flight(router, "completion", {"model": "m", "prompt": [1], "logprobs": 1})
    b = Backend("http://127.0.0.1:9")

    def event(tok: int, text: str, offset: int) -> dict[str, Any]:
        lp = {"tokens": [text], "token_logprobs": [0.0], "top_logprobs": [{text: 0.0}], "text_offset": [offset]}
        return {"choices": [{"text": text, "token_ids": [tok], "logprobs": lp}]}

    first = _read_leg(f, b, "/v1/completions", [event(5, " ab", 0), event(6, " c", 3)])
    second = _read_leg(f, b, "/v1/completions", [event(7, " de", 0)])
    offsets = [item.logprobs["text_offset"] for kind, item in first + second if kind == "delta"]
    assert offsets == [[0], [3], [5]]


def _vllm_stop(pieces: list[str], stops: list[str], keep: bool, min_tokens: int) -> tuple[str, str | None, int]:
    """What vLLM sends for tokens of text ``pieces`` on one engine: the text, its stop string, the tokens."""
    text = ""
    for j, piece in enumerate(pieces):
        text += piece
        hit = _match(text, piece, stops) if j + 1 > min_tokens else None
        if hit is not None:
            stop, at = hit
            return text[: at + len(stop) if keep else at], stop, j + 1
    return text, None, len(pieces)


def _match(text: str, new: str, stops: list[str]) -> tuple[str, int] | None:
    """vLLM 0.32's rule (``check_stop_strings``): of the stop strings found in the new text and the characters
    just before it, the one that completes first; of two that end together, the first in the request's order."""
    hits = [(at + len(stop), i, stop, at) for i, stop in enumerate(stops)
            if (at := text.find(stop, max(0, len(text) - len(new) - len(stop) + 1))) != -1]  # fmt: skip
    return min(hits)[2:] if hits else None


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text("ab ", max_size=3), min_size=1, max_size=24),
    stops=st.lists(st.text("ab ", min_size=1, max_size=4), min_size=1, max_size=3),
    keep=st.booleans(),
    min_tokens=st.integers(0, 4),
    switches=st.sets(st.integers(1, 23)),
)
def test_stop_strings_are_matched_across_legs_as_one_engine_would(
    pieces: list[str], stops: list[str], keep: bool, min_tokens: int, switches: set[int]
) -> None:
    """Legs that each see only their own text end where one engine seeing all of it would, every character once."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    body = {"model": "m", "prompt": [1], "max_tokens": 99, "stop": stops, "include_stop_str_in_output": keep}
    f = Flight(router, "completion", {**body, "min_tokens": min_tokens})
    want_text, want_stop, want_tokens = _vllm_stop(pieces, stops, keep, min_tokens)
    sent, leg_text, got = "", "", None
    for j, piece in enumerate(pieces):
        if j in switches:
            leg_text = ""  # a new leg: its backend matches over its own text only
        leg_text += piece
        # The leg's backend matches over its own text (and its own min_tokens: what is left of the request's).
        own = _match(leg_text, piece, stops) if j + 1 > min_tokens else None
        finish = "stop" if own is not None else ("length" if j == len(pieces) - 1 else None)
        text = leg_text[len(leg_text) - len(piece) : own[1] + len(own[0])] if own is not None else piece
        d = Delta(text, [j], finish, own[0] if own is not None else None, upto=j + 1)
        stopped = f._release(d)
        sent += d.text
        if d.finish_reason is not None:
            got = (d.finish_reason, d.stop_reason, j + 1, stopped)
            break
    assert got is not None
    assert sent == want_text
    if want_stop is not None:
        assert got[:3] == ("stop", want_stop, want_tokens)
    else:
        assert got[0] == "length" and got[2] == len(pieces)


@pytest.mark.parametrize("keep", [False, True])
def test_a_stop_tokens_text_is_left_out_as_vllm_leaves_it_out(keep: bool) -> None:
    """The router asks legs to keep stop strings (to cut them itself); vLLM would then send a stop token's text."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    body = {"model": "m", "prompt": [1], "max_tokens": 9, "stop": ["zz"], "include_stop_str_in_output": keep}
    f = Flight(router, "completion", body)
    sent = ""
    for d in (Delta(" a", [5], upto=1), Delta(" b", [6], upto=2), Delta("\n", [13], "stop", 13, upto=3)):
        f._release(d)
        sent += d.text
    assert sent == (" a b\n" if keep else " a b")


@pytest.mark.parametrize("stop", [5, {"a": 1}, [None, 7, ""], None])
def test_stop_fields_that_are_no_strings_leave_matching_to_the_backend(stop: Any) -> None:
    """vLLM answers such a request 400 itself; the router must not fail first (500) on it."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    f = Flight(router, "completion", {"model": "m", "prompt": [1], "max_tokens": 4, "stop": stop})
    d = Delta(" x", [5], upto=1)
    assert f._release(d) is False and f._stops == []


def _two_backends(max_tokens: int = 40) -> tuple[Router, Flight, Backend, Backend]:
    """A router over two backends nobody serves, and a streamed flight on it (its upstream stubbed by the test)."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9", "http://127.0.0.1:10")))
    f = Flight(router, "completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True})
    router.flights[f.id] = f
    src, dst = (router.backends.all[u] for u in ("http://127.0.0.1:9", "http://127.0.0.1:10"))
    return router, f, src, dst


def _tokens(pause: float = 0.0, limit: int = 40) -> Any:
    """A stub of a leg's upstream: one token per event, 100 on, finishing at the flight's ``limit``."""

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        prompt = body["prompt"]
        for i in range(body["max_tokens"]):
            await asyncio.sleep(pause)
            done = "length" if i == body["max_tokens"] - 1 else None
            yield {"choices": [{"text": "t", "token_ids": [100 + len(prompt) - 3 + i], "prompt_token_ids": prompt,
                                "finish_reason": done}]}  # fmt: skip

    return upstream


def _queued_on(f: Flight, src: Backend) -> list[tuple[Backend, dict[str, Any]]]:
    """``f``'s legs: ``src`` answers nothing (the request queued there), any other backend :func:`_tokens`.

    Returns the (backend, body) of every leg started, in order.
    """
    sent: list[tuple[Backend, dict[str, Any]]] = []
    tokens = _tokens()

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        sent.append((backend, body))
        if backend is src:
            await asyncio.sleep(3600)  # queued there
        async for event in tokens(backend, path, body):
            yield event

    f._upstream = upstream  # type: ignore[method-assign]
    return sent


def test_a_continuation_asks_only_for_the_min_tokens_not_yet_generated() -> None:
    """Found by mutation testing: a request's ``min_tokens`` count from its first token, not each leg's. Failed
    over after 3 of at least 5 tokens, the next leg must ask for 2 more; the whole 5 would keep a stop token or
    string from ending the request for 3 tokens too many."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9", "http://127.0.0.1:10")))
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "min_tokens": 5, "stream": True}
    f = Flight(router, "completion", body)
    router.flights[f.id] = f
    sent: list[dict[str, Any]] = []

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        sent.append(body)
        prompt, first = body["prompt"], len(sent) == 1
        for i in range(3 if first else body["max_tokens"]):
            done = "length" if not first and i == body["max_tokens"] - 1 else None
            yield {"choices": [{"text": "t", "token_ids": [100 + len(prompt) - 3 + i], "prompt_token_ids": prompt,
                                "finish_reason": done}]}  # fmt: skip
        if first:
            await asyncio.sleep(3600)  # the source goes quiet after 3 tokens

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> list[Delta]:
        agen = f.deltas()
        got = [await agen.__anext__() for _ in range(3)]
        f.fail_over()  # the source found dead: continue elsewhere
        return got + [d async for d in agen]

    got = asyncio.run(asyncio.wait_for(run(), 10))
    assert [t for d in got for t in d.token_ids] == list(range(100, 108))
    assert [leg.why for leg in f.legs] == ["routed", "failover"]
    assert sent[0]["min_tokens"] == 5
    assert sent[1]["prompt"] == [1, 2, 3, 100, 101, 102] and sent[1]["max_tokens"] == 5
    assert sent[1]["min_tokens"] == 2
    # Past the request's min_tokens, a continuation asks for none.
    f.generated = list(range(100, 106))
    assert f._leg_body(announce=True)[1]["min_tokens"] == 0


def test_a_leg_cancelled_before_its_reader_ran_still_ends() -> None:
    """The health task fails a request over in the loop iteration that started its leg: the reader task is
    cancelled before its first step (its body never runs), and its end must still reach the client's stream."""
    _, f, _, _ = _two_backends(4)
    f._upstream = _tokens()  # type: ignore[method-assign]

    async def run() -> list[Delta]:
        agen = f.deltas()
        first = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)  # deltas() started the first leg; its reader has not run yet
        assert f._reader is not None and not f._reader.done()
        f.fail_over()
        got = [await asyncio.wait_for(first, 5)]
        got += [d async for d in agen]
        return got

    got = asyncio.run(run())
    assert [len(d.token_ids) for d in got] == [1] * 4 and got[-1].finish_reason == "length"
    assert [leg.why for leg in f.legs] == ["routed", "failover"]


def test_a_drain_behind_a_move_that_waits_for_its_client_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's move waits (504) for a client that does not read: the drain lists the request as failed
    after the move's timeout rather than wait for that client for ever."""
    import hurray_vllm.app.router.server as server

    monkeypatch.setattr(server, "MOVE_TIMEOUT_S", 0.5)
    router, f, src, dst = _two_backends(300)  # more events than the flight buffers: its reader waits
    f._upstream = _tokens(pause=0.001)  # type: ignore[method-assign]

    async def nothing(*_: Any) -> None:
        return None

    f._prewarm = nothing  # type: ignore[method-assign]

    async def run() -> dict[str, Any]:
        agen = f.deltas()
        await agen.__anext__()  # the client reads one event, then stops reading
        await asyncio.sleep(0.2)  # the reader fills its buffer and waits
        with pytest.raises(RouterError) as moved:
            await f.migrate(dst if f.backend is src else src, timeout=0.2)
        assert moved.value.status == 504 and f.moving
        out = await asyncio.wait_for(router.drain(f.backend.url), 10)
        await agen.aclose()
        return out

    out = asyncio.run(run())
    assert out["moved"] == [] and [x["id"] for x in out["failed"]] == [f.id]
    assert "not reading" in out["failed"][0]["error"]


def test_a_move_to_a_backend_drained_before_the_switch_leaves_the_request_where_it_was() -> None:
    """The switch waited behind events its client had not read; meanwhile the destination was drained: the
    move is refused there, and the request resumes on its source instead of landing on the drained backend."""
    router, f, src, dst = _two_backends(120)
    f._upstream = _tokens(pause=0.001)  # type: ignore[method-assign]

    async def nothing(*_: Any) -> None:
        return None

    f._prewarm = nothing  # type: ignore[method-assign]

    async def run() -> tuple[list[Delta], RouterError]:
        agen = f.deltas()
        got = [await agen.__anext__()]
        await asyncio.sleep(0.2)
        source = f.backend
        assert source is not None
        target = dst if source is src else src
        move = asyncio.ensure_future(f.migrate(target, timeout=30))
        await asyncio.sleep(0.2)  # warmed up; the switch waits in the unread stream
        await router.drain(target.url)
        got += [d async for d in agen]  # the client reads on
        with pytest.raises(RouterError) as refused:
            await move
        assert f.legs[-1].backend == source.url
        return got, refused.value

    got, refused = asyncio.run(run())
    assert refused.status == 409 and "drained" in refused.message
    assert [leg.why for leg in f.legs] == ["routed", "resumed"]
    tokens = [t for d in got for t in d.token_ids]
    assert tokens == list(range(100, 220))  # nothing lost or repeated across the refused switch


def test_a_move_whose_request_failed_over_while_it_warmed_up_is_refused() -> None:
    """Its backend was found dead during the destination's warm-up: the request continues elsewhere (here, on
    the destination itself), and the move says so instead of moving it again or calling it finished."""
    router, f, src, dst = _two_backends(5000)
    f._upstream = _tokens(pause=0.001)  # type: ignore[method-assign]

    async def run() -> RouterError:
        agen = f.deltas()
        await agen.__anext__()
        source = f.backend
        assert source is not None
        target = dst if source is src else src

        async def prewarm(to: Backend, timeout: float) -> None:
            if source.healthy:  # the first warm-up (the source goes on generating: there may be more)
                f.fail_over()  # what the health task does for a backend found dead
                source.healthy = False
            await asyncio.sleep(0.2)

        f._prewarm = prewarm  # type: ignore[method-assign]
        reading = asyncio.ensure_future(_drain_all(agen))
        try:
            with pytest.raises(RouterError) as refused:
                await f.migrate(target, timeout=30)
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            await agen.aclose()
        return refused.value

    refused = asyncio.run(run())
    assert refused.status == 409 and "changed backends" in refused.message
    assert [leg.why for leg in f.legs] == ["routed", "failover"]
    assert router.metrics.migrations == {"ok": 0, "failed": 1} and router.metrics.failovers == 1


async def _drain_all(agen: AsyncIterator[Delta]) -> None:
    async for _ in agen:
        pass


def test_a_refusal_before_any_token_is_the_clients_answer_on_any_leg() -> None:
    """The first backend fails (503), the one the request fails over to refuses it (400): the client gets the
    400 and its body, and the refusing backend stays in routing (a refusal says nothing of its health)."""
    _, f, src, dst = _two_backends()

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        if backend is first:
            raise UpstreamError(f"{backend.url} answered HTTP 503", 503, {"error": {"message": "overloaded"}})
        raise UpstreamError(f"{backend.url} answered HTTP 400", 400, {"error": {"message": "prompt too long"}})
        yield {}  # an async generator

    f._upstream = upstream  # type: ignore[method-assign]
    first = src  # the router's first pick of two idle backends with no prefix: the first listed

    async def run() -> UpstreamError:
        with pytest.raises(UpstreamError) as refused:
            await f.deltas().__anext__()
        return refused.value

    refused = asyncio.run(run())
    assert refused.status == 400 and refused.body == {"error": {"message": "prompt too long"}}
    assert [leg.why for leg in f.legs] == ["routed", "failover"] and f.legs[0].backend == src.url
    assert not src.healthy and dst.healthy


def test_a_client_leaving_before_the_first_token_stops_the_request_at_once() -> None:
    """A backend's queue and prefill can take long: the request is stopped when its client leaves, not when its
    first token comes."""
    import json
    import time

    from hurray_vllm.app.router.server import build_app

    cancelled: list[float] = []

    async def slow(self: Flight, backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        try:
            await asyncio.sleep(3600)  # only the client's leaving ends it within the 120 s hang guard below
        except asyncio.CancelledError:
            cancelled.append(time.monotonic())
            raise
        yield {}

    app = build_app(RouterConfig(backends=("http://127.0.0.1:9",)))
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        body = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.sleep(0.3)  # the client leaves
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 2)}  # fmt: skip
        await asyncio.wait_for(app(scope, receive, send), 120)

    original = Flight._upstream
    Flight._upstream = slow  # type: ignore[method-assign,assignment]
    try:
        asyncio.run(run())
    finally:
        Flight._upstream = original  # type: ignore[method-assign]
    assert len(cancelled) == 1  # cancelled when the client left: the hang guard's cut would have raised
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [499]


def _three_backends() -> tuple[Router, list[Backend]]:
    urls = ("http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11")
    router = Router(RouterConfig(backends=urls))
    return router, [router.backends.all[u] for u in urls]


def test_a_drain_spreads_its_requests_over_the_other_backends() -> None:
    """Each request of a drain picks its destination before any of them switches: a move on its way counts in
    its destination's load, or all of them land on one backend."""
    from collections import Counter

    router, (a, b, c) = _three_backends()
    b.draining = c.draining = True  # every request starts on a
    flights = [router.begin("completion", {"model": "m", "prompt": [1, 2, k], "max_tokens": 400, "stream": True})
               for k in range(4)]  # fmt: skip

    async def warm_up(to: Backend, timeout: float) -> None:
        await asyncio.sleep(0.05)

    for f in flights:
        f._upstream = _tokens(pause=0.002)  # type: ignore[method-assign]
        f._prewarm = warm_up  # type: ignore[method-assign]

    async def run() -> dict[str, Any]:
        streams = [f.deltas() for f in flights]
        for s in streams:
            await s.__anext__()
        reading = [asyncio.ensure_future(_drain_all(s)) for s in streams]
        b.draining = c.draining = False
        try:
            return await asyncio.wait_for(router.drain(a.url), 10)
        finally:
            for r in reading:
                r.cancel()
            await asyncio.gather(*reading, return_exceptions=True)
            for s in streams:
                await s.aclose()

    out = asyncio.run(run())
    assert sorted(out["moved"]) == sorted(f.id for f in flights) and out["failed"] == []
    assert Counter(f.legs[-1].backend for f in flights) == {b.url: 2, c.url: 2}
    assert b.planned == c.planned == 0  # released once each move was answered


class _Answer:
    """An aiohttp response of a warm-up, as ``async with client.post(...)`` gives it."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body

    async def __aenter__(self) -> _Answer:
        return self

    async def __aexit__(self, *_: Any) -> None:
        return None

    async def read(self) -> bytes:
        return self.body


def _started(f: Flight, src: Backend) -> None:
    """``f`` runs on ``src`` (a reader that never ends), 1 token generated: ready to be moved."""
    from hurray_vllm.app.router.flight import Leg

    f.prompt_ids, f.generated, f.backend = [1, 2, 3], [7], src
    f.legs.append(Leg(src.url, "routed", 0))
    f._reader = asyncio.create_task(asyncio.sleep(3600))


def _refused_move(f: Flight, src: Backend, dst: Backend, timeout: float) -> tuple[RouterError, dict[str, Any]]:
    """Start ``f`` on ``src``, move it to ``dst`` (which must refuse): the error, and the source's state just after."""

    async def run() -> tuple[RouterError, dict[str, Any]]:
        _started(f, src)
        assert f._reader is not None
        try:
            with pytest.raises(RouterError) as exc:
                await f.migrate(dst, timeout=timeout)
            return exc.value, {"running": not f._reader.done(), "interrupt": f._interrupt, "moving": f.moving}
        finally:
            f._reader.cancel()

    return asyncio.run(run())


@pytest.mark.parametrize("answer", [(404, b'{"error": {"message": "no model m"}}'), (503, b"down"), "refused"])
def test_a_move_whose_warm_up_fails_is_refused_before_the_source_is_touched(answer: Any) -> None:
    """The continuation would fail there too: stopping the source anyway cost a pause and a resumed leg."""
    import aiohttp

    router, f, src, dst = _two_backends()
    limits: list[Any] = []

    class _Client:
        def post(self, url: str, json: dict[str, Any], timeout: Any) -> _Answer:
            limits.append(timeout)
            if answer == "refused":
                raise aiohttp.ClientConnectionError("connection refused")
            return _Answer(*answer)

    router.client = _Client()

    exc, source = _refused_move(f, src, dst, 5)
    assert source["running"] and source["interrupt"] is None and not source["moving"]  # the source goes on
    assert exc.status == 502 and "could not take it" in exc.message and dst.planned == 0
    assert (answer == "refused" and "refused" in exc.message) or str(answer[0]) in exc.message
    assert answer != (404, b'{"error": {"message": "no model m"}}') or "no model m" in exc.message
    assert router.metrics.migrations == {"ok": 0, "failed": 1}  # a move that failed, if before its switch
    # The warm-up's own timeout keeps the session's connect limit (a timeout replaces the session's whole).
    assert limits[0].connect == router.config.connect_timeout and 0 < limits[0].total <= 5


def test_a_moves_warm_ups_share_one_deadline() -> None:
    """Each of up to 3 warm-ups once had the whole move's timeout (600 s each: 30 min on a stuck destination)."""
    from hurray_vllm.app.router.flight import WARMUP_SLACK

    router, f, src, dst = _two_backends()
    given: list[float] = []

    skipped = [0.0]  # seconds each warm-up moves the loop's clock (flight's deadline) on, without sleeping

    async def warm_up(to: Backend, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        if "time" not in vars(loop):  # the loop's own clock, skipped ahead: flight reads it
            real = loop.time
            loop.time = lambda: real() + skipped[0]  # type: ignore[method-assign]
        given.append(timeout)
        f.generated.extend([7] * (WARMUP_SLACK + 1))  # a long context: the source ran on, so warm up again
        skipped[0] += 600  # this warm-up took 600 s
        await asyncio.sleep(0)

    f._prewarm = warm_up  # type: ignore[method-assign]

    exc, source = _refused_move(f, src, dst, 1000)
    assert source["running"] and source["interrupt"] is None  # the source was not touched
    assert exc.status == 504 and "did not warm up" in exc.message
    assert router.metrics.migrations == {"ok": 0, "failed": 1}
    # 1000 s, then what is left of them (400 s); none after. 60 s: the real time the test took, a hang guard.
    assert len(given) == 2 and given[0] == pytest.approx(1000, abs=60) and given[1] == pytest.approx(400, abs=60)


def test_a_move_stops_warming_up_a_destination_drained_meanwhile() -> None:
    from hurray_vllm.app.router.flight import WARMUP_SLACK

    router, f, src, dst = _two_backends()
    given: list[float] = []

    async def warm_up(to: Backend, timeout: float) -> None:
        given.append(timeout)
        f.generated.extend([7] * (WARMUP_SLACK + 1))
        to.draining = True

    f._prewarm = warm_up  # type: ignore[method-assign]

    exc, _ = _refused_move(f, src, dst, 5)
    assert exc.status == 409 and "drained" in exc.message and len(given) == 1
    assert router.metrics.migrations == {"ok": 0, "failed": 1}


def test_a_drain_starts_a_request_that_has_sent_nothing_yet_over_on_another_backend() -> None:
    """Its backend has not answered yet (its queue, its prefill): the client has seen nothing, so the request
    starts over on the destination instead of staying on the drained backend."""
    router, f, src, dst = _two_backends(6)
    sent = _queued_on(f, src)

    async def run() -> tuple[dict[str, Any], list[Delta]]:
        stream = f.deltas()
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert f.backend is src and f.prompt_ids is None
        out = await asyncio.wait_for(router.drain(src.url), 5)

        async def rest() -> list[Delta]:
            return [await first] + [d async for d in stream]

        return out, await asyncio.wait_for(rest(), 5)

    out, got = asyncio.run(run())
    assert out == {"backend": src.url, "moved": [f.id], "failed": []}
    assert [t for d in got for t in d.token_ids] == list(range(100, 106)) and got[-1].finish_reason == "length"
    assert [leg.why for leg in f.legs] == ["routed", "drained"] and sent[-1][0] is dst
    assert sent[-1][1]["prompt"] == [1, 2, 3] and "kv_transfer_params" not in sent[-1][1]  # the request itself
    assert src.in_flight == dst.in_flight == 0


def test_a_request_that_finished_before_its_switch_is_no_failed_migration() -> None:
    router, f, src, dst = _two_backends(4)

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        async for event in _tokens()(backend, path, body):
            yield event
        await asyncio.sleep(3600)  # its [DONE] has not come when the move stops it

    async def nothing(*_: Any) -> None:
        return None

    f._upstream = upstream  # type: ignore[method-assign]
    f._prewarm = nothing  # type: ignore[method-assign]

    async def run() -> RouterError:
        stream = f.deltas()
        await stream.__anext__()
        await asyncio.sleep(0.05)  # the finish is queued; the client has not read it
        move = asyncio.ensure_future(f.migrate(dst if f.backend is src else src, timeout=5))
        await asyncio.sleep(0.05)
        await _drain_all(stream)
        with pytest.raises(RouterError) as exc:
            await move
        return exc.value

    exc = asyncio.run(run())
    assert exc.status == 409 and "has finished" in exc.message
    assert router.metrics.migrations == {"ok": 0, "failed": 0}


def test_a_move_whose_source_broke_as_it_was_left_counts_as_a_failover() -> None:
    from hurray_vllm.app.router.flight import _Interrupt

    router, f, src, dst = _two_backends(6)
    tokens = _tokens()
    answers: list[asyncio.Future[dict[str, Any]]] = []

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        n = 0
        async for event in tokens(backend, path, body):
            yield event
            n += 1
            if backend is src and n == 2:
                # The move's switch and the source's failure come together: the leg ends with its error.
                answers.append(asyncio.get_running_loop().create_future())
                f._interrupt = _Interrupt("move", dst, "migrated", answers[0])
                raise UpstreamError(f"{src.url}: connection reset")

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> list[Delta]:
        return [d async for d in f.deltas()]

    got = asyncio.run(run())
    assert [t for d in got for t in d.token_ids] == list(range(100, 106))
    assert [leg.why for leg in f.legs] == ["routed", "failover"] and answers[0].result()["to"] == dst.url
    assert router.metrics.failovers == 1 and router.metrics.migrations == {"ok": 0, "failed": 0}


def test_a_move_whose_source_was_found_dead_behind_an_unread_switch_counts_as_a_failover() -> None:
    """The switch waits behind events its client has not read; meanwhile the health checks find the source dead.
    Its KV may be lost: the destination is told nothing (it once waited for the dead source's chunks), and the
    move is a failover, not a migration."""
    router, f, src, dst = _two_backends(500)
    tokens = _tokens(pause=0.001)
    sent: list[tuple[Backend, Any]] = []

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        sent.append((backend, body.get("kv_transfer_params")))
        async for event in tokens(backend, path, body):
            yield event

    async def nothing(*_: Any) -> None:
        return None

    f._upstream = upstream  # type: ignore[method-assign]
    f._prewarm = nothing  # type: ignore[method-assign]

    async def run() -> tuple[list[Delta], dict[str, Any]]:
        stream = f.deltas()
        got = [await stream.__anext__()]
        await asyncio.sleep(0.1)  # the source streams on into the buffer; the client reads nothing
        move = asyncio.ensure_future(f.migrate(dst, timeout=30))
        await asyncio.sleep(0.1)  # the switch waits behind the unread events
        src.healthy = False
        router.abandon(src, "failed its health checks")  # what the health checks do
        got += [d async for d in stream]
        return got, await move

    got, answer = asyncio.run(run())
    assert [t for d in got for t in d.token_ids] == list(range(100, 600))
    assert [leg.why for leg in f.legs] == ["routed", "failover"] and answer["to"] == dst.url
    assert sent[-1] == (dst, None) and f.legs[-1].announced is None
    assert router.metrics.failovers == 1 and router.metrics.migrations == {"ok": 0, "failed": 0}


def test_the_model_is_the_backends_when_the_client_names_none() -> None:
    """vLLM serves a request without "model" with its own; the router's events and answers said null."""
    from hurray_vllm.app.router.server import _event_head

    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    backend = Backend("http://127.0.0.1:9")
    f = Flight(router, "completion", {"prompt": [1, 2, 3], "max_tokens": 4})
    first = {"model": "served", "choices": [{"text": "a", "token_ids": [5], "prompt_token_ids": [1, 2, 3]}]}
    _read_leg(f, backend, "/v1/completions", [first, {**first, "model": "other"}])
    assert f.model == "served" and '"model": "served"' in _event_head(f)
    named = Flight(router, "completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
    _read_leg(named, backend, "/v1/completions", [first])
    assert named.model == "m"
    answer = {"model": "served", "choices": [{"text": "a", "token_ids": [5]}], "prompt_token_ids": [1, 2, 3]}
    (event,) = f._answer_events(json.dumps(answer).encode(), backend)  # a prefill leg's answer
    assert event["model"] == "served"


def test_cached_tokens_never_exceed_the_prompt() -> None:
    """After a move the last leg's prompt holds the tokens generated before: its cached tokens can exceed the
    client's prompt."""
    from hurray_vllm.app.router.server import _usage

    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    f = Flight(router, "completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
    f.prompt_ids, f.generated, f.cached_tokens = [1, 2, 3], [4, 5, 6, 7], 6
    assert _usage(f)["prompt_tokens_details"] == {"cached_tokens": 3} and _usage(f)["prompt_tokens"] == 3
    f.cached_tokens = 2
    assert _usage(f)["prompt_tokens_details"] == {"cached_tokens": 2}


# ── a backend's refusal in the stream (vLLM's error event), a continuation's limit, the client's flags ─────────


def _vllm_error(code: int) -> dict[str, Any]:
    """What vLLM streams for a request it refuses after the stream started (``create_streaming_error_response``)."""
    message = "Requested sample logprobs of 21, which is greater than max allowed: 20"
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": code}}


@pytest.mark.parametrize(("code", "status"), [(400, 400), (500, 500), ("400", None), (True, None), (200, None)])
def test_an_error_event_carries_its_code_as_the_status(code: Any, status: int | None) -> None:
    event = _vllm_error(400)
    event["error"]["code"] = code
    with pytest.raises(UpstreamError) as exc:
        _upstream_delta(event, chat=False)
    assert exc.value.status == status and exc.value.body == event


@pytest.mark.parametrize("tokens_before", [0, 3])
def test_a_refusal_in_the_stream_is_the_clients_answer_and_marks_no_backend_down(tokens_before: int) -> None:
    """vLLM refuses ``logprobs: 21`` with an error event (code 400) once the stream started: the client gets it as
    vLLM sent it (before any token, its status and body), no backend is marked down and nothing fails over."""
    router, f, src, dst = _two_backends()

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        for i in range(tokens_before):
            yield {"choices": [{"text": "t", "token_ids": [100 + i], "prompt_token_ids": [1, 2, 3]}]}
        yield _vllm_error(400)

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> tuple[list[Delta], UpstreamError]:
        got: list[Delta] = []
        with pytest.raises(UpstreamError) as refused:
            async for d in f.deltas():
                got.append(d)
        return got, refused.value

    got, refused = asyncio.run(run())
    assert len(got) == tokens_before
    assert refused.status == 400 and refused.body == _vllm_error(400)
    assert len(f.legs) == 1 and src.healthy and dst.healthy and router.metrics.failovers == 0


class _Models:
    """An aiohttp client whose ``GET /v1/models`` answers ``cards`` (None: the connection is refused)."""

    def __init__(self, cards: list[dict[str, Any]] | None) -> None:
        self.cards, self.asked = cards, 0

    def get(self, url: str, timeout: Any) -> Any:
        import aiohttp

        self.asked += 1
        assert url.endswith("/v1/models") and timeout.total <= 5
        if self.cards is None:
            raise aiohttp.ClientConnectionError("connection refused")
        cards = self.cards

        class _R:
            status = 200

            async def __aenter__(self) -> _R:
                return self

            async def __aexit__(self, *_: Any) -> None:
                return None

            async def json(self) -> Any:
                return {"object": "list", "data": cards}

        return _R()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}  # no token limit


@pytest.mark.parametrize("cards", [[{"id": "m", "max_model_len": 64}], None, [{"id": "m"}]])
def test_a_failover_of_a_chat_without_a_limit_asks_the_destinations_context_or_fails(cards: Any) -> None:
    """The destination's max_model_len is not known yet: asked for at once; if it does not say, the request ends
    with an error rather than run on as a completion cut at 16 tokens."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9", "http://127.0.0.1:10")))
    router.client = _Models(cards)
    f = router.begin("chat", dict(CHAT))
    sent: list[dict[str, Any]] = []

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        sent.append(body)
        if len(sent) == 1:
            yield {"choices": [{"delta": {"content": "a"}, "token_ids": [5]}], "prompt_token_ids": [1, 2, 3]}
            raise UpstreamError(f"{backend.url}: ServerDisconnectedError")
        yield {"choices": [{"delta": {"content": "b"}, "token_ids": [6], "finish_reason": "stop"}]}

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> list[Delta]:
        return [d async for d in f.deltas()]

    if cards is not None and "max_model_len" in cards[0]:
        got = asyncio.run(run())
        assert [d.token_ids for d in got] == [[5], [6]] and [leg.why for leg in f.legs] == ["routed", "failover"]
        assert sent[1]["max_tokens"] == 64 - 4  # the rest of the destination's context
    else:
        with pytest.raises(RouterError, match="max_model_len is unknown") as exc:
            asyncio.run(run())
        assert exc.value.status == 502 and len(sent) == 1  # no leg cut at 16 tokens
    assert router.client.asked == 1


@pytest.mark.parametrize("cards", [None, [{"id": "m", "max_model_len": 64}]])
def test_a_move_of_a_chat_without_a_limit_needs_the_destinations_context(cards: Any) -> None:
    """Unknown (its /v1/models does not answer), the move is refused before the source is touched: the request
    goes on where it was rather than be cut at 16 tokens on the destination."""
    router, _, src, dst = _two_backends()
    router.client = _Models(cards)
    f = Flight(router, "chat", dict(CHAT))
    warmed: list[Backend] = []

    async def prewarm(to: Backend, timeout: float) -> None:
        warmed.append(to)
        raise RouterError(502, f"to: {to.url} could not take it: stub")

    f._prewarm = prewarm  # type: ignore[method-assign]
    exc, source = _refused_move(f, src, dst, 5)
    assert source["running"] and source["interrupt"] is None and not source["moving"]  # the source goes on
    assert exc.status == 502 and router.client.asked == 1
    assert router.metrics.migrations == {"ok": 0, "failed": 1}  # the context unknown, or the warm-up's refusal
    if cards is None:
        assert "max_model_len is unknown" in exc.message and warmed == []
    else:
        assert dst.max_model_len == 64 and warmed == [dst]  # known now: the move went on to its warm-up


@pytest.mark.parametrize("known", [False, True])
def test_a_chat_without_a_limit_is_split_only_where_the_decode_legs_limit_is_known(known: bool) -> None:
    """P/D: the decode leg is a continuation, its max_tokens the rest of the context. Unknown, the request runs
    whole on a decode backend (as vLLM answers it) instead of a decode leg cut at 16 tokens."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9",), prefill=("http://127.0.0.1:10",)))
    decode = router.backends.all["http://127.0.0.1:9"]
    if known:
        decode.max_model_len, decode.served = 64, frozenset({"m"})
    f = router.begin("chat", dict(CHAT))
    sent: list[tuple[str, dict[str, Any]]] = []

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        sent.append((path, body))
        done = "length" if body.get("max_tokens") == 1 else "stop"
        yield {"choices": [{"delta": {"content": "a"}, "text": "a", "token_ids": [5], "finish_reason": done}],
               "prompt_token_ids": [1, 2, 3]}  # fmt: skip

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> None:
        async for _ in f.deltas():
            pass

    asyncio.run(run())
    if known:
        assert [leg.why for leg in f.legs] == ["prefill", "decode"] and sent[1][1]["max_tokens"] == 64 - 4
    else:
        assert [leg.why for leg in f.legs] == ["routed"] and sent[0][0] == "/v1/chat/completions"
        assert "max_tokens" not in sent[0][1]


def test_a_model_no_prefill_backend_serves_runs_whole_on_a_decode_backend_that_does() -> None:
    """P/D with a LoRA adapter loaded on the decode backends only: the prefill backend would refuse it (404), so the
    request is not split (a P/D leg goes only to backends serving the model)."""
    router = _pd_router(64)
    decode, prefill = router.backends.all["http://127.0.0.1:9"], router.backends.all["http://127.0.0.1:10"]
    decode.served = frozenset({"m", "lora1"})
    f = router.begin("completion", {"model": "lora1", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True})
    sent: list[Backend] = []
    tokens = _tokens()

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        sent.append(backend)
        if body["model"] not in backend.served:
            raise UpstreamError(f"{backend.url} answered HTTP 404", 404, {"error": {"message": "no such model"}})
        async for event in tokens(backend, path, body):
            yield event

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> list[Delta]:
        return [d async for d in f.deltas()]

    got = asyncio.run(run())
    assert [t for d in got for t in d.token_ids] == [100, 101, 102, 103]
    assert sent == [decode] and [leg.why for leg in f.legs] == ["routed"]
    assert prefill.in_flight == decode.in_flight == 0


@pytest.mark.parametrize("decode_is", ["drained", "down", "not serving"])
def test_a_request_no_decode_backend_can_take_is_not_prefilled(decode_is: str) -> None:
    """P/D with no usable decode backend serving the model: the prefill once ran anyway, its token reached the
    client, and then the request failed after HTTP 200. Now it is answered as an unsplit request is, up front:
    503 (drained, down), or the decode backend's own refusal (a model it does not serve)."""
    router = _pd_router(64)
    router._recheck = lambda b: asyncio.sleep(0, result=False)  # type: ignore[method-assign]  # still down
    decode, prefill = router.backends.all["http://127.0.0.1:9"], router.backends.all["http://127.0.0.1:10"]
    if decode_is == "drained":
        decode.draining = True
    elif decode_is == "down":
        decode.healthy = False
    else:
        prefill.served = frozenset({"m", "lora1"})  # an adapter loaded on the prefill backend only
    model = "lora1" if decode_is == "not serving" else "m"
    f = router.begin("completion", {"model": model, "prompt": [1, 2, 3], "max_tokens": 4, "stream": True})
    sent: list[Backend] = []

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        sent.append(backend)
        if body["model"] not in backend.served:
            raise UpstreamError(f"{backend.url} answered HTTP 404", 404, {"error": {"message": "no such model"}})
        async for event in _tokens()(backend, path, body):
            yield event

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> list[Delta]:
        return [d async for d in f.deltas()]

    with pytest.raises((RouterError, UpstreamError)) as exc:
        asyncio.run(run())
    if decode_is == "not serving":
        assert exc.value.status == 404 and sent == [decode]
    else:
        assert isinstance(exc.value, RouterError) and exc.value.status == 503 and sent == []
        assert ("drained" in exc.value.message) == (decode_is == "drained")
    assert prefill not in sent and prefill.in_flight == decode.in_flight == 0


BOOLEANS = [True, False, 0, 1, 0.0, 1.0, 2, 1.5, "true", "FALSE", "1", "0", "Yes", "no", "on", "OFF", "t", "f", "y",
            "n", " true", "", "2", "maybe", [], {}, None]  # fmt: skip


@pytest.mark.parametrize("value", BOOLEANS)
def test_a_boolean_field_is_read_as_vllms_request_model_reads_it(value: Any) -> None:
    import pydantic

    from hurray_vllm.app.router.flight import flag

    try:
        expected: Any = pydantic.TypeAdapter(bool | None).validate_python(value)
    except pydantic.ValidationError:
        expected = 400
    try:
        got: Any = flag({"stream": value}, "stream", default=False)
    except RouterError as exc:
        got = exc.status
        assert "stream" in exc.message
    assert got == (False if expected is None else expected)


def test_booleans_sent_as_strings_count_as_vllm_reads_them() -> None:
    assert movable("completion", {"prompt": [1], "echo": "false"}) is None
    assert movable("chat", {"messages": [], "logprobs": "false"}) is None
    assert movable("chat", {"messages": [], "include_reasoning": "false"}) is not None
    assert movable("chat", {"messages": [], "include_reasoning": "true"}) is None
    with pytest.raises(RouterError, match="echo") as exc:
        movable("completion", {"prompt": [1], "echo": "maybe"})
    assert exc.value.status == 400
    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    body = {"prompt": [1], "stream": "false", "return_token_ids": "0", "include_stop_str_in_output": "no",
            "stop": ["xy"], "stream_options": {"include_usage": "off"}}  # fmt: skip
    f = Flight(router, "completion", body)
    assert not (f.stream or f.return_token_ids or f.include_usage or f._keep_stop)
    with pytest.raises(RouterError, match=r"stream_options\.include_usage"):
        Flight(router, "completion", {"prompt": [1], "stream_options": {"include_usage": "maybe"}})


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_beam_search_is_relayed_as_is(kind: str) -> None:
    """vLLM refuses to stream beam search, and every leg streams."""
    body = {"model": "m", "messages" if kind == "chat" else "prompt": [1], "use_beam_search": True}
    assert "use_beam_search" in str(movable(kind, body))
    assert movable(kind, {**body, "use_beam_search": "false"}) is None


def test_a_non_streamed_chat_answer_has_its_stop_reason() -> None:
    """vLLM 0.32's chat choices carry ``stop_reason`` (the stop string or token id that ended it), as completions'."""
    from hurray_vllm.app.router.server import _collect

    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    f = router.begin("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    f.prompt_ids = [1, 2]

    async def deltas() -> AsyncIterator[Delta]:
        yield Delta(" yes", [7], "stop", "END")

    out = asyncio.run(_collect(router, f, deltas(), Delta("so", [6])))
    assert out["choices"][0]["stop_reason"] == "END" and out["choices"][0]["message"]["content"] == "so yes"


# ── chat echo, moves that fail before their switch, the end of the context, a move's destination that fails ─


def test_a_chat_with_echo_is_relayed_as_vllm_answers_it() -> None:
    """vLLM streams the echoed last message as an event of its own (no token ids) and matches stop strings over the
    generated text only; as a flight its echo was matched too (``tests/app/test_router_relay.py`` sends one)."""
    body = {"model": "m", "messages": [{"role": "assistant", "content": "The answer is"}], "echo": True}
    assert movable("chat", body) == "echo"
    assert movable("chat", {**body, "echo": "false"}) is None
    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    assert Flight(router, "chat", body).unmovable == "echo"


def test_a_request_that_finished_while_its_destination_warmed_up_is_no_failed_migration() -> None:
    router, f, src, dst = _two_backends()

    async def warm_up(to: Backend, timeout: float) -> None:
        f.finished = True  # its last token came meanwhile

    f._prewarm = warm_up  # type: ignore[method-assign]
    exc, _ = _refused_move(f, src, dst, 5)
    assert exc.status == 409 and "has finished" in exc.message
    assert router.metrics.migrations == {"ok": 0, "failed": 0}


@pytest.mark.parametrize("serving", [True, False])
def test_a_failover_goes_only_to_a_backend_that_serves_the_model(serving: bool) -> None:
    """An adapter loaded on some backends only: a backend that does not list it would refuse (404) a request that
    is not bad. With none left that serves it, the request ends with the reason."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11")))
    router.client = _Models(None)  # asked once more before a backend is passed over: it does not answer
    a, b, c = router.backends.all.values()
    a.served, b.served, c.served = frozenset({"m", "sql"}), frozenset({"m"}), frozenset({"m", "sql"})
    c.healthy = serving
    f = router.begin("completion", {"model": "sql", "prompt": [1, 2, 3], "max_tokens": 3, "stream": True})
    sent: list[Backend] = []

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        sent.append(backend)
        async for event in _tokens()(backend, path, body):
            yield event
            if backend is a:
                raise UpstreamError(f"{backend.url}: ServerDisconnectedError")

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> list[Delta]:
        return [d async for d in f.deltas()]

    if serving:
        got = asyncio.run(run())
        assert [t for d in got for t in d.token_ids] == [100, 101, 102] and sent == [a, c]
    else:
        with pytest.raises(RouterError, match="no other healthy backend serves 'sql'") as exc:
            asyncio.run(run())
        assert exc.value.status == 502 and sent == [a]


def _pd_router(context: int) -> Router:
    router = Router(RouterConfig(backends=("http://127.0.0.1:9",), prefill=("http://127.0.0.1:10",)))
    for b in router.backends.all.values():
        b.max_model_len, b.served = context, frozenset({"m"})
    return router


def _like_vllm(context: int, sent: list[dict[str, Any]]) -> Any:
    """A leg's upstream that refuses what vLLM 0.32 refuses (max_tokens 0; a prompt with no room left in
    ``context``) and otherwise generates up to its limit, one token an event."""

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        sent.append(body)
        prompt = body.get("prompt") if isinstance(body.get("prompt"), list) else [1, 2, 3]
        limit = min(body.get("max_tokens", 16), context - len(prompt))
        if limit < 1:
            error = {"error": {"message": f"max_tokens must be at least 1, got {limit}.", "code": 400}}
            raise UpstreamError(f"{backend.url} answered HTTP 400", 400, error)
        for i in range(limit):
            done = "length" if i == limit - 1 else None
            yield {"choices": [{"text": "t", "delta": {"content": "t"}, "token_ids": [50 + len(prompt) + i],
                                "prompt_token_ids": prompt, "finish_reason": done}]}  # fmt: skip

    return upstream


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_prompt_one_token_short_of_the_context_ends_with_the_prefills_token(kind: str) -> None:
    """P/D: the prefill leg's one token fills the context; one server ends there with "length". The decode leg
    (its prompt the whole context) was refused: an error after the token."""
    router = _pd_router(10)
    prompt = {"prompt": list(range(9))} if kind == "completion" else {"messages": [{"role": "user", "content": "?"}]}
    body: dict[str, Any] = {"model": "m", "stream": True, **prompt}
    f = router.begin(kind, body)
    sent: list[dict[str, Any]] = []
    vllm = _like_vllm(10, sent)

    async def upstream(backend: Backend, path: str, leg: dict[str, Any]) -> AsyncIterator[Any]:
        if "messages" in leg:  # the chat's template makes 9 prompt tokens of it
            leg = {**leg, "prompt": list(range(9))}
        async for event in vllm(backend, path, leg):
            yield event

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> list[Delta]:
        return [d async for d in f.deltas()]

    got = asyncio.run(run())
    assert [(d.token_ids, d.finish_reason) for d in got] == [([59], "length")]
    assert [leg.why for leg in f.legs] == ["prefill"] and len(sent) == 1


def test_a_failover_into_a_full_context_finishes_with_length() -> None:
    """A chat without a limit continues to the end of the destination's context: with none left, its max_tokens
    would be 0 (refused by vLLM). The request has all one server would have given it."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9", "http://127.0.0.1:10")))
    a, b = router.backends.all.values()
    a.max_model_len, b.max_model_len = 64, 5
    f = router.begin("chat", dict(CHAT))
    sent: list[dict[str, Any]] = []

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        sent.append(body)
        for tok in (5, 6):
            yield {"choices": [{"delta": {"content": "x"}, "token_ids": [tok]}], "prompt_token_ids": [1, 2, 3]}
        raise UpstreamError(f"{backend.url}: ServerDisconnectedError")

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> list[Delta]:
        return [d async for d in f.deltas()]

    got = asyncio.run(run())
    assert [t for d in got for t in d.token_ids] == [5, 6] and got[-1].finish_reason == "length"
    assert got[-1].text == "" and len(sent) == 1 and [leg.why for leg in f.legs] == ["routed"]
    assert f.finish_reason == "length" and a.in_flight == b.in_flight == 0


def test_a_move_to_a_destination_without_room_is_refused_and_the_request_goes_on() -> None:
    """The destination's context is smaller than what the request holds already: vLLM would refuse the continuation
    (max_tokens 0). The move is answered 502, the request resumes on its source, the destination stays in routing."""
    router, f, _, dst = _two_backends(60)
    dst.max_model_len = 3  # the prompt's length: no room for anything
    f._upstream = _tokens(pause=0.001)  # type: ignore[method-assign]

    async def nothing(*_: Any) -> None:
        return None

    f._prewarm = nothing  # type: ignore[method-assign]

    got, refused = asyncio.run(_move_refused_while_reading(f, dst))
    assert refused.status == 502 and "no room" in refused.message
    assert [leg.why for leg in f.legs] == ["routed", "resumed"] and dst.healthy
    assert [t for d in got for t in d.token_ids] == list(range(100, 160)) and got[-1].finish_reason == "length"
    assert router.metrics.migrations == {"ok": 0, "failed": 1}


async def _drain_all_into(agen: AsyncIterator[Delta], got: list[Delta]) -> None:
    async for d in agen:
        got.append(d)


async def _move_refused_while_reading(f: Flight, dst: Backend) -> tuple[list[Delta], RouterError]:
    """Move ``f`` to ``dst`` after its first token, the client reading on meanwhile: what it read, and the refusal."""
    agen = f.deltas()
    got = [await agen.__anext__()]
    reading = asyncio.ensure_future(_drain_all_into(agen, got))
    with pytest.raises(RouterError) as refused:
        await f.migrate(dst, timeout=10)
    await asyncio.wait_for(reading, 10)
    return got, refused.value


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_max_tokens_0_reaches_vllm_unchanged_with_prefill_backends(kind: str) -> None:
    """vLLM refuses max_tokens 0 (without echo); the prefill leg's own limit of 1 once generated a token instead."""
    router = _pd_router(64)
    body: dict[str, Any] = {"model": "m", "max_tokens": 0}
    body.update({"prompt": [1, 2, 3]} if kind == "completion" else {"messages": [{"role": "user", "content": "hi"}]})
    f = router.begin(kind, body)
    sent: list[dict[str, Any]] = []
    f._upstream = _like_vllm(64, sent)  # type: ignore[method-assign]

    async def run() -> UpstreamError:
        with pytest.raises(UpstreamError) as refused:
            await f.deltas().__anext__()
        return refused.value

    refused = asyncio.run(run())
    assert refused.status == 400 and "at least 1" in refused.body["error"]["message"]
    assert [leg.why for leg in f.legs] == ["routed"] and sent[0]["max_tokens"] == 0


@pytest.mark.parametrize("failure", ["reset", 503, 400])
def test_a_moves_destination_that_fails_before_its_first_token_is_marked_down(failure: Any) -> None:
    """Unreachable or 5xx: out of routing, as any backend whose leg fails that way (it was left in, and the next
    request or move went there again). A refusal (4xx) says nothing of its health: it stays in."""
    _, f, src, dst = _two_backends(60)
    tokens = _tokens(pause=0.001)

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        if backend is dst:
            if failure == "reset":
                raise UpstreamError(f"{dst.url}: ClientConnectionError: connection reset")
            raise UpstreamError(f"{dst.url} answered HTTP {failure}", failure, {"error": {"message": "no"}})
        async for event in tokens(backend, path, body):
            yield event

    async def nothing(*_: Any) -> None:
        return None

    f._upstream = upstream  # type: ignore[method-assign]
    f._prewarm = nothing  # type: ignore[method-assign]

    got, refused = asyncio.run(_move_refused_while_reading(f, dst))
    assert refused.status == 502 and [leg.why for leg in f.legs] == ["routed", "migrated", "resumed"]
    assert [t for d in got for t in d.token_ids] == list(range(100, 160))
    assert dst.healthy is (failure == 400) and src.healthy


# ── found in review: a drain behind a move that switched, a move's pause behind a slow client, a move before ───
# ── the first token, the relay time behind a slow client ─────────────────────────────────────────────────────


@pytest.mark.parametrize("b_does", ["answer", "fail", "fail, c down"])
def test_a_drain_of_a_moves_source_waits_for_a_switched_move_and_the_request_stays_off_it(b_does: str) -> None:
    """A move from a switched to b, which has not sent its first token when a is drained: the drain once missed
    the request (it no longer ran on a). b then fails: the request once went back to the drained a; it now goes
    where the drain would have moved it, announcing a's KV (back to a only with nowhere else to go: failed)."""
    router, (a, b, c) = _three_backends()
    c.healthy = b_does != "fail, c down"
    f = router.begin("completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 60, "stream": True})
    tokens = _tokens(pause=0.001)
    sent: list[tuple[Backend, dict[str, Any]]] = []

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        sent.append((backend, body))
        if backend is b:
            await asyncio.sleep(0.3)  # waiting for the source's pushes, say
            if b_does != "answer":
                raise UpstreamError(f"{b.url} answered HTTP 503", 503, {"error": {"message": "boom"}})
        async for event in tokens(backend, path, body):
            yield event

    async def nothing(to: Backend, timeout: float) -> None:
        return None

    f._upstream = upstream  # type: ignore[method-assign]
    f._prewarm = nothing  # type: ignore[method-assign]

    async def run() -> tuple[dict[str, Any], Any, list[Delta]]:
        agen = f.deltas()
        got = [await agen.__anext__()]
        assert f.backend is a
        reading = asyncio.ensure_future(_drain_all_into(agen, got))
        move = asyncio.ensure_future(f.migrate(b, timeout=10))
        while f.backend is not b:  # switched; b has not answered yet
            await asyncio.sleep(0.005)
        out = await asyncio.wait_for(router.drain(a.url), 10)
        settled = (await asyncio.gather(move, return_exceptions=True))[0]
        await asyncio.wait_for(reading, 10)
        return out, settled, got

    out, answer, got = asyncio.run(run())
    assert [t for d in got for t in d.token_ids] == list(range(100, 160)) and got[-1].finish_reason == "length"
    if b_does == "fail, c down":
        assert out == {
            "backend": a.url,
            "moved": [],
            "failed": [{"id": f.id, "error": "no other healthy, undrained backend"}],
        }
        assert [leg.why for leg in f.legs] == ["routed", "migrated", "resumed"] and f.legs[-1].backend == a.url
    else:
        assert out == {"backend": a.url, "moved": [f.id], "failed": []}
    if b_does == "answer":
        assert answer["to"] == b.url and [leg.why for leg in f.legs] == ["routed", "migrated"]
    elif b_does == "fail":
        assert isinstance(answer, RouterError) and answer.status == 502
        assert [leg.why for leg in f.legs] == ["routed", "migrated", "drained"] and f.legs[-1].backend == c.url
        leg = sent[-1][1]
        assert sent[-1][0] is c and leg["kv_transfer_params"] == {"hurray_saved_tokens": len(leg["prompt"]) - 1}
    assert a.in_flight == b.in_flight == c.in_flight == 0 and f.pending_from is None


def test_a_moves_pause_is_not_the_time_its_client_stopped_reading() -> None:
    """The client stopped reading (its 64 events buffered, the source held back) and the switch waited for it: the
    pause once counted that wait (3.4 s where the client saw 93 ms), from the source's last token's arrival."""
    router, f, src, dst = _two_backends(300)  # more events than the flight buffers: its reader waits
    f._upstream = _tokens(pause=0.001)  # type: ignore[method-assign]

    async def nothing(to: Backend, timeout: float) -> None:
        return None

    f._prewarm = nothing  # type: ignore[method-assign]

    async def run() -> tuple[dict[str, Any], list[Delta]]:
        agen = f.deltas()
        got = [await agen.__anext__()]  # the client reads one event, then stops reading
        await asyncio.sleep(0.3)  # the reader fills its buffer and waits
        source = f.backend
        move = asyncio.ensure_future(f.migrate(dst if source is src else src, timeout=30))
        await asyncio.sleep(1.0)  # the switch waits behind the events the client has not read
        reading = asyncio.ensure_future(_drain_all_into(agen, got))
        answer = await asyncio.wait_for(move, 10)
        await asyncio.wait_for(reading, 10)
        return answer, got

    answer, got = asyncio.run(run())
    assert [t for d in got for t in d.token_ids] == list(range(100, 400))
    assert answer["pause_ms"] < 300, answer  # the stall was 1300 ms
    assert router.metrics.pauses.count == 1 and router.metrics.pauses.total < 0.3


def test_a_move_before_the_first_token_starts_the_request_over_on_the_destination() -> None:
    """What a drain relies on: the client has seen nothing, so the request itself goes to the destination (no
    warm-up, nothing announced), and the move is answered at its first token there, with no pause to report."""
    router, f, src, dst = _two_backends(6)
    sent = _queued_on(f, src)

    async def run() -> tuple[dict[str, Any], list[Delta]]:
        stream = f.deltas()
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert f.backend is src and f.prompt_ids is None
        answer = await asyncio.wait_for(router.migrate(f.id, dst.url), 5)

        async def rest() -> list[Delta]:
            return [await first] + [d async for d in stream]

        return answer, await asyncio.wait_for(rest(), 5)

    answer, got = asyncio.run(run())
    assert answer == {"id": f.id, "from": src.url, "to": dst.url, "generated_tokens": 1, "pause_ms": None}
    assert [t for d in got for t in d.token_ids] == list(range(100, 106))
    assert [leg.why for leg in f.legs] == ["routed", "migrated"] and sent[-1][0] is dst
    assert sent[-1][1]["prompt"] == [1, 2, 3] and "kv_transfer_params" not in sent[-1][1]
    assert router.metrics.migrations == {"ok": 1, "failed": 0} and router.metrics.pauses.count == 0


def test_the_relay_time_is_not_the_time_a_slow_client_keeps_a_token_waiting() -> None:
    """hurray_router_relay_seconds is the latency the router adds: tokens read together and queued behind a client
    that reads one event per 100 ms once counted 100, 200, 300 ms."""
    import time

    from hurray_vllm.app.router.server import _sse

    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    f = router.begin("completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True})
    f.prompt_ids = [1, 2, 3]

    async def run() -> None:
        read = time.perf_counter()
        queued = [Delta("t", [100 + i], received=read) for i in range(4)]

        async def deltas() -> AsyncIterator[Delta]:
            for d in queued[1:]:
                yield d

        async for _ in _sse(router, f, deltas(), queued[0]):  # type: ignore[arg-type]
            await asyncio.sleep(0.1)  # the client reads slowly

    asyncio.run(run())
    assert router.metrics.relay.count == 4 and router.metrics.relay.total < 0.05, router.metrics.relay.total


def test_a_stop_string_across_a_failover_leaves_only_the_tokens_up_to_it_generated() -> None:
    """The next leg's reader runs ahead of the client: tokens past the stop string were recorded as generated, and
    must be dropped as the request ends there (``/hurray/requests`` and a later leg count from them)."""
    router = Router(RouterConfig(backends=("http://127.0.0.1:9", "http://127.0.0.1:10")))
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "stream": True, "stop": ["bc"]}
    f = Flight(router, "completion", body)
    router.flights[f.id] = f
    legs: list[dict[str, Any]] = []

    async def upstream(backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        legs.append(body)
        prompt, first = body["prompt"], len(legs) == 1
        for i, text in enumerate("ab" if first else "cdef"):
            yield {"choices": [{"text": text, "token_ids": [100 + len(prompt) - 3 + i], "prompt_token_ids": prompt}]}
        await asyncio.sleep(3600)  # each leg goes quiet: the first to be failed over, the second to be cut off

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> list[Delta]:
        agen = f.deltas()
        got = [await agen.__anext__() for _ in range(2)]
        f.fail_over()  # the next leg sends "c": "bc" spans the two legs, neither backend saw it
        return got + [d async for d in agen]

    got = asyncio.run(asyncio.wait_for(run(), 10))
    assert len(legs) == 2 and legs[1]["prompt"] == [1, 2, 3, 100, 101]
    assert "".join(d.text for d in got) == "a" and got[-1].finish_reason == "stop" and got[-1].stop_reason == "bc"
    assert got[-1].upto == 3 and f.generated == [100, 101, 102]
    assert f.describe()["generated_tokens"] == 3
