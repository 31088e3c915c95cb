"""``migrate()`` and ``complete()`` refuse what is not a server's base URL, as the caller's error, before any call.

No server and no engine: the checks come before the first request (a
request made anyway would fail the test, see ``_no_calls``).
"""

from __future__ import annotations

from typing import Any

import pytest

from hurray_vllm import HurrayArgumentError
from hurray_vllm.adapters.vllm import migrate as mig

GOOD = "http://127.0.0.1:9"

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
