"""A leg whose backend sends events of an unexpected shape fails cleanly: its client is answered, never left waiting."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hurray_vllm.app.router.backends import Backend
from hurray_vllm.app.router.flight import Flight, UpstreamError, _cached_tokens, _upstream_delta
from hurray_vllm.app.router.server import Router, RouterConfig


@pytest.mark.parametrize(
    "event",
    [
        {"choices": ["not an object"]},
        {"choices": [{"text": "x", "token_ids": ["7"]}]},
        {"choices": [{"text": "x", "token_ids": [True]}]},
        {"choices": [{"text": "x", "token_ids": 7}]},
        {"choices": [{"text": "x", "token_ids": [1], "prompt_token_ids": [1.5]}]},
        {"choices": {"0": {}}},
    ],
)
def test_an_unreadable_event_ends_the_leg_with_an_error(event: Any) -> None:
    router = Router(RouterConfig(backends=("http://127.0.0.1:9",)))
    f = Flight(router, "completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
    backend = Backend("http://127.0.0.1:9")

    async def upstream(*_: Any) -> AsyncIterator[Any]:
        yield {"choices": [{"text": "a", "token_ids": [5], "prompt_token_ids": [1, 2, 3]}]}
        yield event

    f._upstream = upstream  # type: ignore[method-assign]

    async def run() -> list[tuple[str, Any]]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        await asyncio.wait_for(f._read(backend, "/v1/completions", {}, q, asyncio.Semaphore(8)), 5)
        return [q.get_nowait() for _ in range(q.qsize())]

    got = asyncio.run(run())
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
