"""The router's streamed events are the bytes ``json.dumps`` gives for each chunk, in OpenAI's format.

The router joins each event from a per-stream head and the delta's fields
(:func:`~hurray_vllm.app.router.server._event`) instead of encoding a dict per
token; ``_reference`` here is that dict, the format clients read.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from hurray_vllm.app.router.flight import Delta, flag
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
