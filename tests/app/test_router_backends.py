"""KV-aware routing: the backend that was sent the longest prefix of a prompt, else the least loaded."""

from __future__ import annotations

import pytest

from hurray_vllm.app.router.backends import KV_LOAD_SLACK, Backends
from hurray_vllm.app.router.server import Router, RouterConfig

A, B, C = "http://a:1", "http://b:2", "http://c:3"


def test_the_longest_prefix_sent_before_wins_then_the_least_loaded() -> None:
    bs = Backends([A, B, C])
    a, b, c = (bs.all[u] for u in (A, B, C))
    keys = ["k0", "k1", "k2"]
    a.remember(keys[:1])
    b.remember(keys[:2])
    c.remember(["k1", "k2"])  # not a prefix: counts nothing
    assert bs.pick(keys) is b
    assert bs.pick(keys, exclude=[b]) is a
    b.draining = True
    assert bs.pick(keys) is a
    b.draining, a.healthy = False, False
    assert bs.pick(keys) is b
    a.healthy = True
    b.in_flight, c.in_flight, a.in_flight = 1, 0, 3
    assert bs.pick(["other"]) is c  # nothing held anywhere: the least loaded
    a.remember(keys)
    assert bs.pick(keys) is a  # a longer prefix beats a lighter load, within the slack
    a.in_flight = KV_LOAD_SLACK + 1  # beyond it: the longest prefix among those within the slack (b's)
    assert bs.pick(keys) is b
    b.in_flight = KV_LOAD_SLACK + 1
    assert bs.pick(keys) is c  # no prefix within the slack: the least loaded
    c.planned = KV_LOAD_SLACK + 1  # moves on their way there count too
    assert bs.pick(keys) is a and bs.pick(keys, exclude=[a]) is b


def test_one_shared_prefix_does_not_send_all_traffic_to_one_backend() -> None:
    """A system prompt every request starts with: the backend that saw it first takes requests only while it is
    not much busier than the others; they then hold the prefix too, and the load evens out."""
    bs = Backends([A, B, C])
    keys = ["system-prompt"]
    for _ in range(60):
        got = bs.pick(keys)
        assert got is not None
        got.in_flight += 1
        got.remember(keys)
    loads = sorted(b.in_flight for b in bs.all.values())
    assert loads[-1] - loads[0] <= KV_LOAD_SLACK and loads[0] > 0, loads
    strict = Backends([A, B], slack=0)
    strict.all[A].remember(keys)
    strict.all[A].in_flight = 1
    assert strict.pick(keys) is strict.all[B]
    with pytest.raises(ValueError, match="kv_load_slack"):
        Backends([A], slack=-1)


def test_prefill_backends_are_picked_apart() -> None:
    bs = Backends([A], prefill=[B])
    assert bs.has_prefill
    assert bs.pick(["k"], prefill=True) is bs.all[B] and bs.pick(["k"]) is bs.all[A]


@pytest.mark.parametrize("why", ["migrated", "failover", "decode"])
def test_every_leg_remembers_the_prompt_where_it_runs(why: str) -> None:
    """After a move or a failover the prompt's KV is on the new backend: the next request with it goes there."""
    import asyncio

    from hurray_vllm.app.router.flight import Flight

    router = Router(RouterConfig(backends=(A, B)))
    f = Flight(router, "completion", {"model": "m", "prompt": list(range(600)), "max_tokens": 4})
    assert f.keys  # 600 tokens: whole chunks of the default 256

    async def run() -> None:
        async def never(*_: object) -> None:
            await asyncio.sleep(3600)

        f._read = never  # type: ignore[assignment,method-assign]
        q: asyncio.Queue[object] = asyncio.Queue()
        f._start_leg(router.backends.all[A], "routed", q, asyncio.Semaphore(1))
        f._start_leg(router.backends.all[B], why, q, asyncio.Semaphore(1))
        assert f._reader is not None
        f._reader.cancel()

    asyncio.run(run())
    assert router.backends.all[B].held(f.keys) == len(f.keys)
    assert router.backends.pick(f.keys, exclude=[router.backends.all[A]]) is router.backends.all[B]


def test_with_no_healthy_backend_the_router_checks_the_others_once_more() -> None:
    """A backend marked down may be back before the next periodic check (it restarted, or it started late)."""
    import asyncio
    from typing import Any

    router = Router(RouterConfig(backends=(A, B), prefill=(C,)))
    a, b, c = (router.backends.all[u] for u in (A, B, C))
    a.healthy = b.healthy = c.healthy = False
    answers = {A: False, B: True, C: True}
    checked: list[str] = []

    async def check(client: Any, backend: Any, timeout: float) -> bool:
        checked.append(backend.url)
        return answers[backend.url]

    router.backends.check = check  # type: ignore[method-assign]
    assert asyncio.run(router.pick(["k"])) is b
    assert sorted(checked) == [A, B] and b.healthy and not a.healthy and not c.healthy  # decode backends only
    checked.clear()
    assert asyncio.run(router.pick(["k"])) is b and checked == []  # one is healthy: no extra check
    answers[B] = False
    b.healthy = False
    assert asyncio.run(router.pick(["k"], exclude=[a])) is None and checked == []  # checked within the interval
    router._rechecked.clear()  # the interval passed
    assert asyncio.run(router.pick(["k"], exclude=[a])) is None and checked == [B]


def test_requests_that_find_no_healthy_backend_together_share_one_check() -> None:
    """A hung backend costs the requests waiting on it one check, not one each."""
    import asyncio
    from typing import Any

    router = Router(RouterConfig(backends=(A,)))
    router.backends.all[A].healthy = False
    calls: list[str] = []

    async def check(client: Any, backend: Any, timeout: float) -> bool:
        calls.append(backend.url)
        await asyncio.sleep(0.05)
        return True

    router.backends.check = check  # type: ignore[method-assign]

    async def many() -> list[Any]:
        return list(await asyncio.gather(*(router.pick(["k"]) for _ in range(10))))

    assert asyncio.run(many()) == [router.backends.all[A]] * 10 and calls == [A]


def test_a_move_to_a_backend_marked_down_checks_it_once_more() -> None:
    import asyncio
    from typing import Any

    from hurray_vllm.app.router.flight import Flight, RouterError

    router = Router(RouterConfig(backends=(A, B)))
    b = router.backends.all[B]
    f = Flight(router, "completion", {"model": "m", "prompt": [1, 2], "max_tokens": 4})
    router.flights[f.id] = f

    async def moved(to: Any, why: str = "migrated", timeout: float = 600.0) -> dict[str, Any]:
        return {"to": to.url}

    f.migrate = moved  # type: ignore[method-assign]
    answers = {B: False}

    async def check(client: Any, backend: Any, timeout: float) -> bool:
        return answers[backend.url]

    router.backends.check = check  # type: ignore[method-assign]
    b.healthy = False
    with pytest.raises(RouterError) as exc:
        asyncio.run(router.migrate(f.id, B))
    assert exc.value.status == 503 and not b.healthy
    answers[B] = True  # it came back since its last periodic check
    router._rechecked.clear()  # and the health interval passed
    assert asyncio.run(router.migrate(f.id, B)) == {"to": B} and b.healthy


def test_prefix_keys_differ_by_model_and_cache_salt() -> None:
    """Affinity never sends a request toward KV another adapter (a model name) or tenant (a salt) computed."""
    from hurray_vllm.app.router.backends import prompt_keys

    base = {"model": "m", "prompt": list(range(300))}
    keys = prompt_keys(base, 64)
    assert len(keys) == 4 and prompt_keys(dict(base), 64) == keys
    assert prompt_keys({**base, "model": "m-sql-lora"}, 64)[0] != keys[0]
    assert prompt_keys({**base, "cache_salt": "t1"}, 64)[0] != keys[0]
    assert prompt_keys({**base, "cache_salt": 7}, 64)  # junk from a client is keyed, not a crash
    chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 600}]}
    assert prompt_keys({**chat, "cache_salt": "t1"}, 64)[0] != prompt_keys(chat, 64)[0]


def test_prefix_keys_of_messages_nested_deeper_than_json_writes_are_none() -> None:
    """Found by a review: messages the parser took just under its depth limit failed json.dumps deeper in the
    stack (RecursionError: a bare 500). Keys only serve affinity: such a request has none, and is routed."""
    from hurray_vllm.app.router.backends import prompt_keys

    deep: object = "x" * 600
    for _ in range(100_000):
        deep = [deep]
    assert prompt_keys({"model": "m", "messages": [{"role": "user", "content": deep}]}, 64) == []


def test_the_context_length_of_a_model_that_is_not_a_string_is_any_backends() -> None:
    """Found by a review: a list or object as the model (the router refuses it at intake now) raised TypeError
    here (no set member); it names no model, as Backend.serves reads it."""
    backends = Backends([A, B])
    backends.all[A].max_model_len, backends.all[A].served = 4096, frozenset({"m"})
    backends.all[B].max_model_len, backends.all[B].served = 8192, frozenset({"sql"})
    assert backends.context_length("m") == 4096 and backends.context_length(None) == 8192
    assert backends.context_length(["m"]) == backends.context_length({"a": 1}) == 8192


def test_a_backend_marked_down_by_a_broken_stream_has_its_other_requests_moved_at_its_next_failed_check() -> None:
    """mark_down() (a stream of it broke) takes it out of routing without the health loop seeing it go down; its
    other requests, hung on it, were then left to their stream timeout."""
    import asyncio
    from typing import Any

    from hurray_vllm.app.router.server import Relayed

    router = Router(RouterConfig(backends=(A, B), health_interval=30))
    a = router.backends.all[A]
    router.backends.mark_down(a)
    moved: list[str] = []

    class _Flight:
        backend = a
        id = "f1"

        def fail_over(self) -> None:
            moved.append("flight")

    router.flights["f1"] = _Flight()  # type: ignore[assignment]
    relayed = router.relayed["r1"] = Relayed("r1", a, "tools", None)
    waiting: list[asyncio.Future[Any]] = []

    async def check(client: Any, backend: Any, timeout: float) -> bool:
        return backend is not a

    router.backends.check = check  # type: ignore[method-assign]

    async def run() -> None:
        relayed.waiting = asyncio.get_running_loop().create_future()  # its answer's headers, not come yet
        waiting.append(relayed.waiting)
        watch = asyncio.ensure_future(router._health())
        await asyncio.sleep(0.05)  # one round of checks; the next is 30 s away
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)

    asyncio.run(run())
    assert moved == ["flight"] and waiting[0].cancelled() and relayed.dead == "failed its health checks"
    assert not a.healthy and router.backends.all[B].healthy


def test_a_backend_api_key_goes_with_every_request_to_the_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's --api-key answers 401 to requests without it: health checks, /v1/models, completions."""
    import asyncio

    from aiohttp import web

    seen: list[tuple[str, str | None]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization")))
        return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})

    async def run(config: RouterConfig) -> None:
        app = web.Application()
        app.router.add_get("/health", record)
        app.router.add_get("/v1/models", record)
        app.router.add_post("/v1/completions", record)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        router = Router(RouterConfig(backends=(url,), health_interval=30, backend_api_key=config.backend_api_key))
        try:
            await router.start()
            assert await router.backends.check(router.client, router.backends.all[url], 2.0)
            async with router.client.post(url + "/v1/completions", json={}) as r:
                await r.read()
        finally:
            await router.stop()
            await runner.cleanup()

    asyncio.run(run(RouterConfig(backends=(), backend_api_key="sk-test")))
    assert {p for p, _ in seen} == {"/health", "/v1/models", "/v1/completions"}
    assert {k for _, k in seen} == {"Bearer sk-test"}
    seen.clear()
    monkeypatch.setenv("HURRAY_BACKEND_API_KEY", "sk-env")  # kept off the command line
    asyncio.run(run(RouterConfig(backends=())))
    assert seen and {k for _, k in seen} == {"Bearer sk-env"}
    seen.clear()
    monkeypatch.delenv("HURRAY_BACKEND_API_KEY")
    asyncio.run(run(RouterConfig(backends=())))
    assert seen and {k for _, k in seen} == {None}


def test_with_every_backend_drained_health_and_requests_say_so() -> None:
    """Every request gets 503 then: /health must not say ok, and the 503 says what to do."""
    from conftest import require

    require("fastapi")
    require("httpx")
    from fastapi.testclient import TestClient

    from hurray_vllm.app.router import build_app

    with TestClient(build_app(RouterConfig(backends=(A, B), health_interval=30))) as client:
        assert client.get("/health").status_code == 200
        for url in (A, B):
            client.app.state.router.backends.all[url].draining = True  # type: ignore[attr-defined]
        health = client.get("/health")
        assert health.status_code == 503 and "/hurray/undrain" in health.json()["reason"]
        for body in ({"prompt": [1, 2], "max_tokens": 2}, {"prompt": [1, 2], "max_tokens": 2, "echo": True}):
            r = client.post("/v1/completions", json={"model": "m", **body})  # a flight, and a relayed request
            assert r.status_code == 503 and "drained" in r.json()["error"]["message"], r.text
            assert "POST /hurray/undrain" in r.json()["error"]["message"]


# ── which models a backend serves (its /v1/models: LoRA adapters loaded on some backends only) ─────────────


def test_a_request_goes_to_a_backend_that_serves_its_model() -> None:
    """``sql`` is loaded on A only: B, less loaded and holding the prefix, would answer 404. A backend whose models
    are not known yet stays a candidate; a request for a model no backend lists goes anywhere (its 404 is vLLM's)."""
    bs = Backends([A, B, C])
    a, b, c = (bs.all[u] for u in (A, B, C))
    a.served, b.served = frozenset({"m", "sql"}), frozenset({"m"})
    a.in_flight = 3
    b.remember(["k"])
    assert bs.pick(["k"], model="sql") is c  # c's models are unknown: it may serve it, and it is idle
    c.served = frozenset({"m"})
    assert bs.pick(["k"], model="sql") is a
    assert bs.pick(["k"], model="m") is b and bs.pick(["k"]) is b  # no model named: the backend's own default
    assert bs.pick(["k"], model="sql", exclude=[a]) in (b, c)  # none left that serves it: any (the caller checks)
    for policy in ("least-loaded", "round-robin"):
        other = Backends([A, B], policy=policy)
        other.all[A].served, other.all[B].served = frozenset({"m"}), frozenset({"m", "sql"})
        assert {id(other.pick([], model="sql")) for _ in range(4)} == {id(other.all[B])}
    assert b.serves(None) and b.serves(7) and not b.serves("sql") and Backends([A]).all[A].serves("sql")


def test_a_move_to_a_backend_that_does_not_serve_the_model_is_refused_naming_why() -> None:
    import asyncio
    from typing import Any

    from hurray_vllm.app.router.flight import Flight, RouterError

    router = Router(RouterConfig(backends=(A, B)))
    router.backends.all[B].served = frozenset({"m"})
    f = Flight(router, "completion", {"model": "sql", "prompt": [1, 2], "max_tokens": 4})
    router.flights[f.id] = f
    tried: list[str] = []

    async def moved(to: Any, why: str = "migrated", timeout: float = 600.0) -> dict[str, Any]:
        tried.append(to.url)
        return {"to": to.url}

    f.migrate = moved  # type: ignore[method-assign]
    with pytest.raises(RouterError) as exc:
        asyncio.run(router.migrate(f.id, B))
    assert exc.value.status == 409 and "does not serve model 'sql'" in exc.value.message and tried == []

    class _Models:  # B's /v1/models now lists the adapter (loaded there since the router first read it)
        def get(self, url: str, timeout: Any) -> Any:
            assert url == B + "/v1/models"

            class _R:
                status = 200

                async def __aenter__(self) -> Any:
                    return self

                async def __aexit__(self, *_: Any) -> None:
                    return None

                async def json(self) -> Any:
                    return {"data": [{"id": "m", "max_model_len": 64}, {"id": "sql", "max_model_len": 64}]}

            return _R()

    router.client = _Models()
    assert asyncio.run(router.migrate(f.id, B)) == {"to": B} and router.backends.all[B].served == {"m", "sql"}


def test_a_drain_moves_a_request_only_to_a_backend_that_serves_its_model() -> None:
    import asyncio
    from typing import Any

    from hurray_vllm.app.router.flight import Flight

    router = Router(RouterConfig(backends=(A, B, C)))
    a, b, c = (router.backends.all[u] for u in (A, B, C))
    b.served, c.served = frozenset({"m"}), frozenset({"m", "sql"})
    c.in_flight = 5  # busier than b: only the model sends the request there
    flights = {}
    for model in ("sql", "m", "other"):
        f = Flight(router, "completion", {"model": model, "prompt": [1, 2], "max_tokens": 4})
        f.backend = a
        router.flights[f.id] = flights[model] = f
    moved: dict[str, str] = {}

    def mover(f: Flight) -> Any:
        async def migrate(to: Any, why: str = "migrated", timeout: float = 600.0) -> dict[str, Any]:
            moved[f.model or ""] = to.url
            f.backend = to
            return {"to": to.url}

        return migrate

    for f in flights.values():
        f.migrate = mover(f)  # type: ignore[method-assign]
    out = asyncio.run(router.drain(A))
    assert moved == {"sql": C, "m": B}  # least loaded for "m"
    assert [x["id"] for x in out["failed"]] == [flights["other"].id]
    assert "serves 'other'" in out["failed"][0]["error"]


def test_a_backend_that_serves_the_model_is_checked_once_more_before_one_that_does_not_takes_it() -> None:
    """The one backend with the adapter was marked down (a broken stream) and is back: the request goes there, not
    to the healthy backend that would answer 404."""
    import asyncio
    from typing import Any

    router = Router(RouterConfig(backends=(A, B)))
    a, b = router.backends.all[A], router.backends.all[B]
    a.served, b.served = frozenset({"m", "sql"}), frozenset({"m"})
    a.healthy = False

    async def check(client: Any, backend: Any, timeout: float) -> bool:
        return True

    router.backends.check = check  # type: ignore[method-assign]
    assert asyncio.run(router.pick(["k"], model="m")) is b and not a.healthy  # b serves it: no check
    assert asyncio.run(router.pick(["k"], model="sql")) is a and a.healthy


def test_a_backend_given_with_and_without_a_trailing_slash_is_one_backend(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The docs say a trailing slash does not matter: "http://a:1" and "http://a:1/" were two backends (each with its
    own load, health and prefix memory), and the CLI's dedup and --backend/--prefill check compared raw strings."""
    from typing import Any

    from conftest import require

    require("aiohttp")
    import hurray_vllm.app.router as router
    from hurray_vllm.app.cli import main

    bs = Backends(["http://a:1", "http://a:1/", "http://b:1/"], ["http://b:1", "http://c:1/"])
    assert [(b.url, b.prefill) for b in bs.all.values()] == [
        ("http://a:1", False),
        ("http://b:1/", False),  # its first spelling
        ("http://c:1/", True),
    ]
    assert bs.get("http://a:1/") is bs.get("http://a:1") is not None and bs.get("http://c:1") is not None

    seen: list[Any] = []
    monkeypatch.setattr(router, "serve", lambda config, host, port, log_level: seen.append(config))
    base = ["router", "--listen", "127.0.0.1:0", "--backend", "http://a:1"]
    assert main([*base, "--backend", "http://a:1/", "--backend", "http://b:1", "--prefill", "http://c:1/"]) == 0
    assert seen[-1].backends == ("http://a:1", "http://b:1") and seen[-1].prefill == ("http://c:1/",)
    capsys.readouterr()
    assert main([*base, "--prefill", "http://a:1/"]) == 2  # a usage error
    assert "both as --backend and --prefill" in capsys.readouterr().err


def test_a_backend_in_a_log_line_is_its_url_not_the_prefix_keys_it_remembers(caplog: pytest.LogCaptureFixture) -> None:
    """The failover warning formatted the whole Backend: its repr held every remembered prefix key (up to 2**17),
    a line of megabytes formatted on the event loop at each failover, which held up every stream meanwhile."""
    import asyncio
    import logging
    from collections.abc import AsyncIterator
    from typing import Any

    from hurray_vllm.app.router.flight import UpstreamError

    router = Router(RouterConfig(backends=(A, B)))
    a, b = router.backends.all[A], router.backends.all[B]
    a.remember([f"{i:032x}" for i in range(20000)])
    a.served = frozenset(f"adapter-{i}" for i in range(2000))
    assert len(repr(a)) < 300 and A in repr(a)  # no error or log line that formats a backend can hit them either

    async def upstream(backend: Any, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        if backend is a:
            yield {"choices": [{"text": "x", "token_ids": [7], "prompt_token_ids": [1, 2, 3]}]}
            raise UpstreamError(f"{A}: ClientConnectionError: connection reset")
        yield {"choices": [{"text": "y", "token_ids": [8], "finish_reason": "length"}]}

    f = router.begin("completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True})
    f._upstream = upstream  # type: ignore[method-assign]
    router.backends.pick = lambda keys, exclude=(), **_: b if any(x is a for x in exclude) else a  # type: ignore[method-assign]

    async def run() -> list[int]:
        return [t async for d in f.deltas() for t in d.token_ids]

    with caplog.at_level(logging.WARNING, logger="hurray_vllm.router"):
        assert asyncio.run(run()) == [7, 8]
    (line,) = [r.getMessage() for r in caplog.records if "continuing on" in r.getMessage()]
    assert line.startswith(f"router: {f.id} failed on {A} (") and line.endswith(f"continuing on {B}"), line[:300]
    assert len(line) < 300
