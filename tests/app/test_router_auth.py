"""The router's ``/hurray/*`` behind the fleet key (issue 21) and ``/v1/*`` behind its ``--api-key``, in-process.

A router with ``--key-file`` answers 401 to a control request without the
key's bearer token, names what to send, and accepts the token of any key of
the ring (rotation). ``/health`` and ``/metrics`` stay open; the OpenAI
endpoints need a key only with the router's own ``--api-key`` (or
``$HURRAY_API_KEY``). The end-to-end router tests (``test_router.py``) run
unkeyed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import require

from hurray_vllm.app.cli import main
from hurray_vllm.chunks.signing import FleetKeys

OLD, NEW = b"o" * 32, b"n" * 48


def _key_file(tmp_path: Path, name: str, secret: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(secret + b"\n")
    os.chmod(p, 0o600)
    return p


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    require("fastapi")
    require("httpx")
    from fastapi.testclient import TestClient

    from hurray_vllm.app.router import RouterConfig, build_app
    from hurray_vllm.app.router.server import CONTROL_PURPOSE

    monkeypatch.delenv("HURRAY_API_KEY", raising=False)  # the OpenAI endpoints unkeyed
    ring = FleetKeys.from_secrets(NEW, OLD)
    config = RouterConfig(backends=("http://127.0.0.1:9",), control_tokens=ring.tokens(CONTROL_PURPOSE))
    with TestClient(build_app(config)) as c:
        yield c


def test_controls_need_a_fleet_token_and_the_openai_endpoints_do_not(client: Any) -> None:
    from hurray_vllm.app.router.server import CONTROL_PURPOSE

    for method, path in (("get", "/hurray/requests"), ("post", "/hurray/drain"), ("post", "/hurray/migrate")):
        for headers in ({}, {"Authorization": "Bearer " + "0" * 64}, {"Authorization": "Basic xyz"}):
            r = client.request(method, path, json={"backend": "http://127.0.0.1:9"}, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.headers["www-authenticate"] == "Bearer"
            assert "--print-token" in r.json()["error"]["message"]
    # A token of either key of the ring opens them; one for another purpose does not.
    for secret in (NEW, OLD):
        token = FleetKeys.from_secrets(secret).tokens(CONTROL_PURPOSE)[0]
        r = client.get("/hurray/requests", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200 and r.json() == {"requests": []}
    other = FleetKeys.from_secrets(NEW).tokens("something-else")[0]
    assert client.get("/hurray/requests", headers={"Authorization": f"Bearer {other}"}).status_code == 401
    # Open endpoints: the (unreachable) backend makes them 503, never 401.
    assert client.get("/health").status_code in (200, 503)
    assert client.get("/metrics").status_code == 200
    assert client.post("/v1/completions", json={"model": "m", "prompt": [1, 2]}).status_code != 401


def test_controls_need_a_token_behind_a_root_path() -> None:
    """Behind a proxy's root path (uvicorn ``--root-path``), ``/PFX/hurray/*`` is the control route: still closed."""
    require("fastapi")
    require("httpx")
    from fastapi.testclient import TestClient

    from hurray_vllm.app.router import RouterConfig, build_app
    from hurray_vllm.app.router.server import CONTROL_PURPOSE

    ring = FleetKeys.from_secrets(NEW)
    config = RouterConfig(backends=("http://127.0.0.1:9",), control_tokens=ring.tokens(CONTROL_PURPOSE))
    with TestClient(build_app(config), root_path="/pfx") as c:
        assert c.get("/pfx/hurray/requests").status_code == 401
        token = ring.tokens(CONTROL_PURPOSE)[0]
        r = c.get("/pfx/hurray/requests", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200 and r.json() == {"requests": []}
    # A root path that the path only starts with, not at a "/": Starlette routes the whole path.
    app = build_app(config)
    with TestClient(app):
        for root in ("/hur", "/"):
            assert _asgi_get(app, "/hurray/requests", root) == 401, root


def _asgi_get(app: Any, path: str, root_path: str) -> int:
    """The status of a GET of exactly this ASGI scope (what a server sends behind ``--root-path``)."""
    import asyncio

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": root_path, "query_string": b"", "headers": [],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_print_token_uses_the_signing_key_and_needs_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hurray_vllm.app.router.server import CONTROL_PURPOSE

    monkeypatch.delenv("HURRAY_VLLM_KEY_FILE", raising=False)
    new, old = _key_file(tmp_path, "new.key", NEW), _key_file(tmp_path, "old.key", OLD)
    assert main(["router", "--key-file", str(new), "--key-file", str(old), "--print-token"]) == 0
    assert capsys.readouterr().out.strip() == FleetKeys.from_secrets(NEW).tokens(CONTROL_PURPOSE)[0]
    monkeypatch.setenv("HURRAY_VLLM_KEY_FILE", str(old))
    assert main(["router", "--print-token"]) == 0
    assert capsys.readouterr().out.strip() == FleetKeys.from_secrets(OLD).tokens(CONTROL_PURPOSE)[0]
    monkeypatch.delenv("HURRAY_VLLM_KEY_FILE")
    assert main(["router", "--print-token"]) == 2
    assert "--key-file" in capsys.readouterr().err
    assert main(["router", "--listen", "127.0.0.1:0"]) == 2  # no backend
    assert "--backend" in capsys.readouterr().err


# ── the OpenAI endpoints behind the router's own --api-key ──────────────────


def _keyed(monkeypatch: pytest.MonkeyPatch, env: str | None = None, **config: Any) -> Any:
    """A router over an unreachable backend (``config`` on top), with ``$HURRAY_API_KEY`` set to ``env``."""
    require("fastapi")
    require("httpx")
    from fastapi.testclient import TestClient

    from hurray_vllm.app.router import RouterConfig, build_app

    if env is None:
        monkeypatch.delenv("HURRAY_API_KEY", raising=False)
    else:
        monkeypatch.setenv("HURRAY_API_KEY", env)
    return TestClient(build_app(RouterConfig(backends=("http://127.0.0.1:9",), health_interval=30, **config)))


@pytest.mark.parametrize("env", [False, True])
def test_with_an_api_key_the_openai_endpoints_need_it(monkeypatch: pytest.MonkeyPatch, env: bool) -> None:
    """The router sends the backends their key itself: unkeyed, a backend started with --api-key was open to whoever
    reached the router. As vLLM's --api-key guards /v1: 401 without a key it holds, /health and /metrics open."""
    if env:  # kept off the command line
        client = _keyed(monkeypatch, env="sk-new")
    else:
        client = _keyed(monkeypatch, api_keys=("sk-old", "sk-new"))
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 2}
    with client:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic sk-new"},
                        {"Authorization": "sk-new"}, {"Authorization": "Bearer sk-new-and-more"}):  # fmt: skip
            for method, path in (("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("get", "/v1/models")):
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
                error = r.json()["error"]
                assert error["code"] == 401 and "--api-key" in error["message"] and error["type"]
        # A key it holds opens them (the backend is unreachable: never 401), as any key of several.
        for key in ("sk-new",) if env else ("sk-new", "sk-old"):
            r = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code in (502, 503), r.text
        assert client.get("/health").status_code in (200, 503)
        assert client.get("/metrics").status_code == 200
        assert client.get("/hurray/requests").status_code == 200  # its own token, with --key-file only


def test_without_an_api_key_the_openai_endpoints_stay_open(monkeypatch: pytest.MonkeyPatch) -> None:
    with _keyed(monkeypatch) as client:
        assert client.post("/v1/completions", json={"model": "m", "prompt": [1, 2]}).status_code in (502, 503)


def test_an_api_key_is_needed_behind_a_root_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind a proxy's root path, ``/PFX/v1/*`` is the OpenAI route: still closed (the check reads the route)."""
    from fastapi.testclient import TestClient

    app = _keyed(monkeypatch, api_keys=("sk-1",)).app
    with TestClient(app, root_path="/pfx") as c:
        assert c.get("/pfx/v1/models").status_code == 401
        assert c.get("/pfx/v1/models", headers={"Authorization": "Bearer sk-1"}).status_code != 401


def test_api_key_reaches_the_router(monkeypatch: pytest.MonkeyPatch) -> None:
    require("aiohttp")
    import hurray_vllm.app.router as router

    seen: list[Any] = []
    monkeypatch.setattr(router, "serve", lambda config, host, port, log_level: seen.append(config))
    base = ["router", "--listen", "127.0.0.1:0", "--backend", "http://a:1"]
    assert main([*base, "--api-key", "k1", "--api-key", "k2"]) == 0
    assert seen[-1].api_keys == ("k1", "k2") and "k1" not in repr(seen[-1])
    assert main(base) == 0
    assert seen[-1].api_keys == ()  # the router reads $HURRAY_API_KEY then


def test_an_empty_key_never_opens_the_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review: --api-key "" let in whoever sent an empty bearer token; an empty $HURRAY_API_KEY was
    taken for unset (an open /v1). A configured key is never empty, and an empty token never matches."""
    require("fastapi")
    from hurray_vllm.app.router import RouterConfig, build_app
    from hurray_vllm.app.router.server import _NeedsBearer
    from hurray_vllm.errors import HurrayArgumentError

    guard = _NeedsBearer(None, prefix="/v1", keys=("",), message="m")
    for auth in (b"Bearer ", b"Bearer", b"bearer  "):
        assert not guard.holds_a_key({"headers": [(b"authorization", auth)]}), auth
    monkeypatch.delenv("HURRAY_API_KEY", raising=False)
    with pytest.raises(HurrayArgumentError, match="empty"):
        build_app(RouterConfig(backends=("http://127.0.0.1:9",), api_keys=("k", "")))
    monkeypatch.setenv("HURRAY_API_KEY", "")
    with pytest.raises(HurrayArgumentError, match=r"\$HURRAY_API_KEY"):
        build_app(RouterConfig(backends=("http://127.0.0.1:9",)))


@pytest.mark.parametrize(
    "key", ["sk-abc ", " sk-abc", "sk-abc\n", " "], ids=["trailing", "leading", "newline", "blank"]
)
def test_a_key_with_whitespace_at_its_ends_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: such a key was taken, and no client could send it (a bearer token is read stripped, as
    an HTTP header's value): every /v1 request got 401. Refused as --api-key, $HURRAY_API_KEY and api_keys=."""
    require("fastapi")
    from hurray_vllm.app.router import RouterConfig, build_app
    from hurray_vllm.errors import HurrayArgumentError

    monkeypatch.delenv("HURRAY_API_KEY", raising=False)
    with pytest.raises(HurrayArgumentError, match="whitespace") as exc:
        build_app(RouterConfig(backends=("http://127.0.0.1:9",), api_keys=("sk-ok", key)))
    assert exc.value.field == "api_keys"
    monkeypatch.setenv("HURRAY_API_KEY", key)
    with pytest.raises(HurrayArgumentError, match=r"whitespace|empty") as exc:  # blank: as good as empty
        build_app(RouterConfig(backends=("http://127.0.0.1:9",)))
    assert exc.value.field == "$HURRAY_API_KEY"
    with pytest.raises(SystemExit) as stop:
        main(["router", "--listen", "127.0.0.1:0", "--backend", "http://a:1", "--api-key", key])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after argparse's usage lines
    assert "argument --api-key:" in err and "whitespace" in err, err
    monkeypatch.setenv("HURRAY_API_KEY", "sk abc")  # whitespace inside a key is the key's own
    assert build_app(RouterConfig(backends=("http://127.0.0.1:9",))) is not None


def test_an_api_key_without_control_tokens_warns_that_the_controls_are_open(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Documented, but a router keyed for its clients looked closed: /hurray/* stays open without --key-file."""
    require("fastapi")
    from hurray_vllm.app.router import RouterConfig, build_app
    from hurray_vllm.app.router.server import CONTROL_PURPOSE

    monkeypatch.delenv("HURRAY_API_KEY", raising=False)
    with caplog.at_level("WARNING", logger="hurray_vllm.router"):
        build_app(RouterConfig(backends=("http://127.0.0.1:9",), api_keys=("sk-1",)))
    (warning,) = [r.getMessage() for r in caplog.records if "/hurray/*" in r.getMessage()]
    assert "open" in warning and "--key-file" in warning
    caplog.clear()
    tokens = FleetKeys.from_secrets(NEW).tokens(CONTROL_PURPOSE)
    with caplog.at_level("WARNING", logger="hurray_vllm.router"):
        build_app(RouterConfig(backends=("http://127.0.0.1:9",), api_keys=("sk-1",), control_tokens=tokens))
        build_app(RouterConfig(backends=("http://127.0.0.1:9",)))  # nothing keyed: nothing looks closed
    assert [r for r in caplog.records if "/hurray/*" in r.getMessage()] == []


def test_the_routers_own_refusals_have_its_error_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review: FastAPI's own refusals came back as {"detail": ...}: a query parameter it could not read
    (422), a method a route does not take (405). Every error of the router is {"error": {message, type, code}}."""
    with _keyed(monkeypatch) as client:
        for method, path, status in (("get", "/hurray/requests?recent=maybe", 400), ("get", "/hurray/migrate", 405),
                                     ("get", "/nowhere", 404)):  # fmt: skip
            r = client.request(method, path)
            assert r.status_code == status, (path, r.text)
            error = r.json()["error"]
            assert error["code"] == status and error["message"] and error["type"], r.text
        assert "recent" in client.get("/hurray/requests?recent=maybe").json()["error"]["message"]
        assert client.get("/hurray/migrate").headers["allow"] == "POST"
        assert client.get("/hurray/requests?recent=true").status_code == 200
