"""The router's streamed events are the bytes ``json.dumps`` gives for each chunk, in OpenAI's format.

The router joins each event from a per-stream head and the delta's fields
(:func:`~hurray_vllm.app.router.server._event`) instead of encoding a dict per
token; ``_reference`` here is that dict, the format clients read.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hurray_vllm.app.router.flight import Delta, UpstreamError, flag, sse_data
from hurray_vllm.app.router.server import _event, _event_head


def _reference(f: Any, d: Delta, first: bool) -> dict[str, Any]:
    if f.kind == "chat":
        delta: dict[str, Any] = {"content": d.text}
        if first:
            delta["role"] = "assistant"
        delta.update(d.extra or {})
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": d.logprobs, "finish_reason": d.finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": d.text, "logprobs": d.logprobs, "finish_reason": d.finish_reason}
        obj = "text_completion"
    if d.stop_reason is not None:  # vLLM's chat chunks carry it too (its last one)
        choice["stop_reason"] = d.stop_reason
    asked = flag(f.body, "return_token_ids")
    if asked:
        choice["token_ids"] = d.token_ids
        if first and f.kind == "completion":
            choice["prompt_token_ids"] = f.prompt_ids
    out = {"id": f.id, "object": obj, "created": f.created, "model": f.model, "choices": [choice]}
    if first and f.kind == "chat" and asked:
        out["prompt_token_ids"] = f.prompt_ids
    return out


# Any code point, lone surrogates and control characters too (st.text() leaves surrogates out).
any_text = st.text(st.characters(exclude_categories=()), max_size=16) | st.sampled_from(["\ud800", '\x00\u2028"\\'])
json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | any_text
logprobs = st.none() | st.dictionaries(st.text(max_size=6), st.lists(json_leaf, max_size=3), max_size=3)


@given(
    kind=st.sampled_from(["completion", "chat"]),
    first=st.booleans(),
    asked=st.sampled_from([None, False, True, 1, "false", "True", "0"]),
    model=st.none() | any_text | st.integers(),
    text=any_text | json_leaf,  # a misbehaving backend's text may be anything JSON
    lp=logprobs,
    finish=st.none() | st.sampled_from(["stop", "length"]) | any_text,
    stop=st.none() | st.integers(0, 1 << 20) | any_text,
    ids=st.lists(st.integers(0, 1 << 31), max_size=4),
    prompt=st.none() | st.lists(st.integers(0, 1 << 20), max_size=6),
    extra=st.none()
    | st.dictionaries(
        st.sampled_from(["reasoning_content", "reasoning", "tool_calls"]) | any_text,
        json_leaf | st.lists(st.dictionaries(any_text, json_leaf, max_size=2), max_size=2),
        max_size=3,
    ),
)
def test_each_event_is_the_bytes_json_dumps_gives(
    kind: str,
    first: bool,
    asked: Any,
    model: Any,
    text: Any,
    lp: Any,
    finish: Any,
    stop: Any,
    ids: list[int],
    prompt: Any,
    extra: Any,
) -> None:
    body = {} if asked is None else {"return_token_ids": asked}
    f = SimpleNamespace(
        kind=kind,
        body=body,
        return_token_ids=flag(body, "return_token_ids"),
        id="cmpl-hurray-ab12",
        created=1733370000,
        model=model,
        prompt_ids=prompt,
    )
    extra = {k: v for k, v in (extra or {}).items() if k not in ("content", "role")} if kind == "chat" else None
    d = Delta(text, ids, finish, stop, lp, extra=extra)
    expected = f"data: {json.dumps(_reference(f, d, first))}\n\n".encode()
    assert _event(f, d, first, _event_head(f)) == expected  # type: ignore[arg-type]


# ── sse_data: the upstream event stream, split into data payloads ─────────────────────────────────────


class _Chunks:
    """What ``sse_data`` reads: an aiohttp response whose body arrives in the given chunks."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.content = SimpleNamespace(iter_any=lambda: self._iter(chunks))

    @staticmethod
    async def _iter(chunks: list[bytes]) -> Any:
        for c in chunks:
            yield c


def _payloads(chunks: list[bytes]) -> list[bytes]:
    async def run() -> list[bytes]:
        return [d async for d in sse_data(_Chunks(chunks), "http://b")]

    return asyncio.run(run())


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    at = sorted({min(c, len(data)) for c in cuts})
    return [data[i:j] for i, j in zip([0, *at], [*at, len(data)])]


_sse_line = st.sampled_from([b"data: ", b"data:", b": comment", b"event: x", b"", b"data: [DONE]"]) | st.binary(
    max_size=6
)


@given(
    lines=st.lists(st.tuples(_sse_line, st.binary(max_size=8), st.sampled_from([b"\n", b"\r\n", b"\n\n"])), max_size=8),
    tail=st.binary(max_size=8),
    cuts=st.lists(st.integers(0, 200), max_size=10),
)
def test_sse_data_yields_each_data_line_however_the_body_is_cut(
    lines: list[tuple[bytes, bytes, bytes]], tail: bytes, cuts: list[int]
) -> None:
    body = b"".join(a + b + end for a, b, end in lines) + tail
    expected = [line[5:].strip() for line in body.split(b"\n") if line.startswith(b"data:")]
    assert _payloads(_split(body, cuts)) == expected


def test_sse_data_refuses_a_line_longer_than_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import hurray_vllm.app.router.flight as flight

    monkeypatch.setattr(flight, "MAX_EVENT_BYTES", 100)
    assert _payloads([b"data: " + b"x" * 200 + b"\n"]) == [b"x" * 200]  # whole in one chunk: read, as before
    with pytest.raises(UpstreamError, match="more than 100 bytes"):
        _payloads([b"data: " + b"x" * 60, b"x" * 60])


def test_sse_data_reads_a_long_line_in_time_linear_in_its_length() -> None:
    """A line arriving in many chunks was joined and searched from its start at each chunk: quadratic (a 12 MB
    line held the event loop, and every other stream, for 0.19 s). One 8 MiB line in 4096 chunks now takes a few
    times as long as 4096 lines of a chunk each (the same bytes, chunks and reads; the long line is copied whole a
    few times); it took hundreds of times as long. The bound leaves room for a loaded machine."""
    n, size = 4096, 2048
    long_line = b"data: " + b"x" * (n * size - 8) + b"\n\n"
    one_line = _split(long_line, list(range(size, n * size, size)))
    many_lines = [b"data: " + b"x" * (size - 8) + b"\n\n"] * n

    async def took(chunks: list[bytes]) -> float:
        best = float("inf")
        for _ in range(3):  # the least of a few: what the reader costs, not what a busy machine adds
            t0 = time.perf_counter()
            async for _ in sse_data(_Chunks(chunks), "http://b"):
                pass
            best = min(best, time.perf_counter() - t0)
        return best

    async def run() -> tuple[float, float]:
        return await took(many_lines), await took(one_line)

    lines, line = asyncio.run(run())
    assert line < 40 * lines, (lines, line)
