"""``migrate()`` and ``complete()`` refuse what is not a server's base URL, as the caller's error, before any call.

So too an API key that is empty or that no HTTP header carries; and the command passes its key on.

No server and no engine: the checks come before the first request (a
request made anyway would fail the test, see ``_no_calls``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from hurray_vllm import HurrayArgumentError
from hurray_vllm.adapters.vllm import migrate as mig

GOOD = "http://127.0.0.1:9"
OTHER = "http://127.0.0.1:10"  # the command refuses one server as both ends

BAD = [
    "myserver",  # no scheme: urllib raised a bare ValueError
    "myserver:8000",  # "myserver" read as the scheme
    "ftp://a:8000",
    "http://",  # no host
    "http://a:port",  # a port that is not a number
    "http://a:70000",  # out of range
    "http://[::1",  # an unclosed bracket
    "http://a:8000/?x=1",  # the query would end up in the middle of the URL
    "",
    "http://a:8000/?",  # an empty query: still not a base URL
    "http://a:8000#f",
    "http://user:pw@a:8000",  # credentials in a URL that is logged
    "http://a:8000\n",  # urlsplit drops newlines and tabs
    None,
]


@pytest.fixture(autouse=True)
def _no_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    def call(req: Any, timeout: float) -> Any:
        raise AssertionError(f"a request was made: {req}")

    monkeypatch.setattr(mig, "_call", call)


@pytest.mark.parametrize("url", BAD)
@pytest.mark.parametrize("which", ["source", "destination"])
def test_migrate_names_the_url_that_is_not_a_server(url: Any, which: str) -> None:
    urls = {"source": GOOD, "destination": GOOD, which: url}
    for model in (None, "m"):  # without a model the source is asked for one first
        with pytest.raises(HurrayArgumentError, match="not a server's base URL") as info:
            mig.migrate(urls["source"], urls["destination"], [1, 2, 3], after=1, max_tokens=4, model=model)
        assert info.value.field == which


@pytest.mark.parametrize("url", BAD)
def test_complete_refuses_a_url_that_is_not_a_server(url: Any) -> None:
    for model in (None, "m"):
        with pytest.raises(HurrayArgumentError, match="not a server's base URL") as info:
            mig.complete(url, [1, 2, 3], 4, model=model)
        assert info.value.field == "server"


@pytest.mark.parametrize("url", ["http://a:8000", "https://a", "http://a:8000/", "http://[::1]:8000", "http://gw/vllm"])
def test_server_urls_are_taken(url: str) -> None:
    with pytest.raises(AssertionError, match="a request was made"):  # past the checks, to the first request
        mig.complete(url, [1, 2, 3], 4, model="m")


def test_the_command_takes_the_urls_migrate_takes() -> None:
    """``hurray-vllm migrate --from http://gw/vllm`` was refused though migrate() takes a path prefix."""
    from hurray_vllm.app.cli import build_parser

    parser = build_parser()
    base = ["migrate", "--to", GOOD, "--prompt-ids", "1", "--after", "1", "--max-tokens", "2", "--from"]
    assert parser.parse_args([*base, "http://gw:8000/vllm"]).source == "http://gw:8000/vllm"
    for url in BAD:
        if isinstance(url, str):
            with pytest.raises(SystemExit):  # argparse's error: the same URLs refused
                parser.parse_args([*base, url])


# An API key is checked before any call too: an empty one is a key lost on the way (an unset variable), not a
# request for none, and one no HTTP header carries as given made http.client raise a ValueError quoting it.

#: The variable users set (README, docs/router.md): the router's, which migrate() reads too.
ENV = "HURRAY_BACKEND_API_KEY"
KEY_BAD = ["sk-a\nX-Injected: 1", "sk-\r\n", " sk-a", "sk-a ", "sk-\x00", "sk-\u00e9t\u00e9", "sk-\x7f"]


@pytest.mark.parametrize("call", ["migrate", "complete"])
def test_an_empty_api_key_is_the_callers_error(call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "sk-from-the-environment")  # "" is not "read the variable"
    for key in ("", b"sk-bytes"):
        with pytest.raises(HurrayArgumentError, match="API key") as info:
            if call == "migrate":
                mig.migrate(GOOD, GOOD, [1, 2, 3], after=1, max_tokens=4, api_key=key)  # type: ignore[arg-type]
            else:
                mig.complete(GOOD, [1, 2, 3], 4, model="m", api_key=key)  # type: ignore[arg-type]
        assert info.value.field == "api_key"
        assert "sk-bytes" not in str(info.value)


@pytest.mark.parametrize("key", KEY_BAD)
def test_an_api_key_no_header_carries_is_refused_unshown(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(HurrayArgumentError) as info:
        mig.migrate(GOOD, GOOD, [1, 2, 3], after=1, max_tokens=4, model="m", api_key=key)
    assert info.value.field == "api_key" and key.strip() not in str(info.value)
    if "\x00" in key:  # no environment holds one
        return
    monkeypatch.setenv(ENV, key)  # the variable's key: the error names the variable
    with pytest.raises(HurrayArgumentError) as info:
        mig.complete(GOOD, [1, 2, 3], 4, model="m")
    assert info.value.field == f"${ENV}" and key.strip() not in str(info.value)


def test_the_command_passes_its_backend_api_key_to_migrate(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hurray_vllm.app.cli import build_parser, main

    seen: list[Any] = []

    def fake(*args: Any, **kwargs: Any) -> mig.MigrationResult:
        seen.append(kwargs.get("api_key", "not passed"))
        return mig.MigrationResult([1], [2], None)

    monkeypatch.setattr(mig, "migrate", fake)
    base = ["migrate", "--from", GOOD, "--to", OTHER, "--prompt-ids", "1", "--after", "1", "--max-tokens", "2"]
    assert main([*base, "--backend-api-key", "sk-k1"]) == 0
    assert main(base) == 0  # None: migrate() reads the variable, as the router does
    assert seen == ["sk-k1", None]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:  # --backend-api-key "$KEY" with KEY unset: refused, not "no key"
        main([*base, "--backend-api-key", ""])
    assert exited.value.code == 2 and "--backend-api-key" in capsys.readouterr().err and len(seen) == 2
    # The router's option, and its variable, in the help.
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {
        name: next(a.help for a in sub.choices[name]._actions if a.dest == "backend_api_key")
        for name in ("migrate", "router")
    }
    assert f"${ENV}" in helps["migrate"] and "Bearer KEY" in helps["migrate"]
    assert helps["migrate"].replace("both servers", "every backend") == helps["router"]


@pytest.mark.parametrize("cached", [None, 128])
def test_the_command_says_when_the_destination_does_not_report_loaded_tokens(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cached: int | None
) -> None:
    """vLLM reports cached tokens only with --enable-prompt-tokens-details: "None prompt tokens loaded" was said."""
    from hurray_vllm.app.cli import main

    monkeypatch.setattr(mig, "migrate", lambda *args, **kwargs: mig.MigrationResult([1], [2], cached))
    base = ["migrate", "--from", GOOD, "--to", OTHER, "--prompt-ids", "1", "--after", "1", "--max-tokens", "2"]
    assert main(base) == 0
    said = capsys.readouterr().out
    assert "None" not in said
    if cached is None:
        assert "prompt tokens loaded: not reported; start the destination with --enable-prompt-tokens-details" in said
    else:
        assert "(128 prompt tokens loaded, not recomputed)" in said


# The prompt, the counts and the timeout are checked, and the prompt read once, before any call too. A generator
# prompt was read empty by the destination's call (a continuation of the generated tokens alone, said nowhere);
# numpy and torch ids (what tokenizers return) failed in json.dumps; text, an empty prompt, a negative id, a float
# or bool count, or a timeout of 0, NaN or inf reached the servers (or the sockets) and failed there, or did not.

PROMPT_BAD = ["hello", b"\x01\x02", [], [1, -5], [1, 2.0], [1, True], [[1, 2]], None, "2-D tensor"]


def _bad_prompt(prompt: Any) -> Any:
    if prompt == "2-D tensor":
        import torch

        return torch.tensor([[1, 2], [3, 4]])
    return prompt


@pytest.mark.parametrize("prompt", PROMPT_BAD, ids=repr)
def test_a_prompt_that_is_not_token_ids_is_the_callers_error(prompt: Any) -> None:
    for model in (None, "m"):
        with pytest.raises(HurrayArgumentError) as info:
            mig.migrate(GOOD, OTHER, _bad_prompt(prompt), after=1, max_tokens=4, model=model)
        assert info.value.field == "prompt"
        with pytest.raises(HurrayArgumentError) as info:
            mig.complete(GOOD, _bad_prompt(prompt), 4, model=model)
        assert info.value.field == "prompt"


COUNTS_BAD = [
    ({"after": 1.5}, "after"),
    ({"after": True}, "after"),
    ({"after": "2"}, "after"),
    ({"after": None}, "after"),
    ({"max_tokens": 5.0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": False}, "max_tokens"),
    ({"after": 4, "max_tokens": 4}, "after"),
    ({"timeout": "5"}, "timeout"),
    ({"timeout": True}, "timeout"),
    ({"timeout": 0}, "timeout"),
    ({"timeout": -1.0}, "timeout"),
    ({"timeout": float("nan")}, "timeout"),
    ({"timeout": float("inf")}, "timeout"),
]


@pytest.mark.parametrize(("kwargs", "field"), COUNTS_BAD, ids=repr)
def test_migrate_names_a_count_or_timeout_it_cannot_use(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"after": 2, "max_tokens": 4, **kwargs}
    for model in (None, "m"):
        with pytest.raises(HurrayArgumentError) as info:
            mig.migrate(GOOD, OTHER, [1, 2, 3], model=model, **args)
        assert info.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [(k, f) for k, f in COUNTS_BAD if "after" not in k] + [({"max_tokens": 0}, "max_tokens")],
    ids=repr,
)
def test_complete_names_a_count_or_timeout_it_cannot_use(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"max_tokens": 4, **kwargs}
    for model in (None, "m"):
        with pytest.raises(HurrayArgumentError) as info:
            mig.complete(GOOD, [1, 2, 3], model=model, **args)
        assert info.value.field == field


def _answering(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Stand in for both servers (``_call``): model ``m``, and as many token ids as asked for (9, 10, ...).

    Returns each call's URL and the JSON body sent (``None`` for a GET).
    """
    sent: list[tuple[str, Any]] = []

    def call(req: Any, timeout: float) -> Any:
        body = json.loads(req.data) if req.data is not None else None
        sent.append((req.full_url, body))
        if body is None:
            return {"data": [{"id": "m"}]}
        return {"choices": [{"token_ids": list(range(9, 9 + body["max_tokens"]))}]}

    monkeypatch.setattr(mig, "_call", call)
    return sent


def test_a_prompt_is_read_once_and_sent_whole_to_both_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    import torch

    sent = _answering(monkeypatch)
    prompts = [
        (t for t in [1, 2, 3]),  # read empty by the second call
        map(int, "1 2 3".split()),
        np.array([1, 2, 3]),  # np.int64 ids: not JSON
        torch.tensor([1, 2, 3]),  # 0-d tensors: not JSON
        (np.int32(1), 2, np.uint16(3)),
    ]
    for prompt in prompts:
        sent.clear()
        r = mig.migrate(GOOD, OTHER, prompt, after=np.int64(2), max_tokens=5, model="m")  # type: ignore[arg-type]
        assert r.tokens == [9, 10, 9, 10, 11]
        completions = [body for _, body in sent if body is not None]
        assert [c["prompt"] for c in completions] == [[1, 2, 3], [1, 2, 3, 9, 10]], sent
        assert all(type(t) is int for c in completions for t in c["prompt"])
    assert mig.complete(GOOD, torch.tensor([4, 5]), 2, model="m")["choices"][0]["token_ids"] == [9, 10]
    assert sent[-1][1]["prompt"] == [4, 5]
