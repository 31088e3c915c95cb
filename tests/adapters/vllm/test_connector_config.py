"""The connector's configuration on its own (no engine): the ``hurray_*`` options it knows, the values it
refuses and the key each refusal names, the ``hurray_listen`` receivers engines of one process share, and what
it tells vLLM."""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import require
from connector_parts import backend_spec, kv_groups, vllm_config, worker_config

DOCS = Path(__file__).resolve().parents[3] / "docs" / "connector.md"


def _config(extra: dict[str, object], role: str = "kv_both", max_model_len: int | None = None) -> SimpleNamespace:
    """``vllm_config``'s VllmConfig (``max_model_len``: with a model_config that has it)."""
    engine = vllm_config(extra, role=role)
    if max_model_len is not None:
        engine.model_config = SimpleNamespace(max_model_len=max_model_len)
    return engine


def _parse(extra: dict[str, object], **kwargs: Any) -> Any:
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig

    return HurrayConfig.from_vllm(_config(extra, **kwargs), None)  # type: ignore[arg-type]


def _refused(extra: dict[str, object], **kwargs: Any) -> Any:
    """The HurrayArgumentError parsing ``extra`` raises."""
    from hurray_vllm.errors import HurrayArgumentError

    with pytest.raises(HurrayArgumentError) as info:
        _parse(extra, **kwargs)
    return info.value


# ── options the connector does not know ──────────────────────────────────────


@pytest.mark.parametrize(
    ("typo", "meant", "value"),
    [
        ("hurray_keyfile", "hurray_key_file", "/etc/hurray/fleet.key"),  # would leave chunks unsigned
        ("hurray_chunk_token", "hurray_chunk_tokens", 64),  # would keep the default chunk size
        ("hurray_listen_quota", "hurray_listen_quota_mib", 100),
    ],
)
def test_a_misspelled_option_is_refused_naming_it_and_the_option_meant(typo: str, meant: str, value: object) -> None:
    err = _refused({"hurray_path": "/x", typo: value})
    assert err.field == typo and f"did you mean {meant!r}" in str(err)


def test_keys_that_are_not_hurray_options_are_left_alone() -> None:
    cfg = _parse({"hurray_path": "/x", "shared_storage_path": "/y", "lmcache.chunk_size": 3, "hurrayish": 1})
    assert cfg.path == "/x"


def test_the_options_known_are_those_documented_and_read_whatever_the_others_say(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The known options are the keys the parser asks for: it must ask for each, in every configuration."""
    require("vllm")
    import hurray_vllm.adapters.vllm.connector.config as config

    seen: list[Any] = []

    class Recorded(config._Options):  # type: ignore[name-defined,misc]
        def __init__(self, cfg: Any) -> None:
            super().__init__(cfg)
            seen.append(self)

    monkeypatch.setattr(config, "_Options", Recorded)
    _parse({"hurray_path": "/x"}, role="kv_consumer")
    many = {
        "hurray_path": str(tmp_path),
        "hurray_chunk_tokens": 32,
        "hurray_url": "tcp://h:1",
        "hurray_listen": ":0",
        "hurray_listen_quota_mib": 10,
        "hurray_listen_max_connections": 4,
        "hurray_save_async": False,
        "hurray_tails": False,
    }
    _parse(many, role="kv_producer")
    documented = set()
    for line in DOCS.read_text().splitlines():
        if line.startswith("| `hurray_"):
            documented |= set(re.findall(r"`(hurray_\w+)`", line.split("|")[1]))
    assert seen[0].asked == seen[1].asked == documented


# ── values ───────────────────────────────────────────────────────────────────

_LISTEN = {"hurray_path": "/x", "hurray_listen": ":0"}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({**_LISTEN, "hurray_listen_max_connections": 2.5}, "hurray_listen_max_connections"),  # was 2
        ({**_LISTEN, "hurray_listen_max_connections": "2.5"}, "hurray_listen_max_connections"),
        ({**_LISTEN, "hurray_listen_max_connections": True}, "hurray_listen_max_connections"),  # was 1
        ({**_LISTEN, "hurray_listen_max_memory_mib": True}, "hurray_listen_max_memory_mib"),  # was 1 MiB
        ({**_LISTEN, "hurray_listen_quota_mib": True}, "hurray_listen_quota_mib"),
        ({**_LISTEN, "hurray_listen_timeout_s": True}, "hurray_listen_timeout_s"),
        ({"hurray_path": "/x", "hurray_push_wait_s": True}, "hurray_push_wait_s"),  # was 1 s
        ({"hurray_path": True}, "hurray_path"),  # was a directory "True"
        ({"hurray_path": 5}, "hurray_path"),
        ({"hurray_path": ["/x"]}, "hurray_path"),
        ({"hurray_path": ""}, "hurray_path"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_naming_the_key(extra: dict[str, object], field: str) -> None:
    assert _refused(extra).field == field


def test_counts_and_sizes_that_are_whole_numbers_pass() -> None:
    cfg = _parse({**_LISTEN, "hurray_listen_max_connections": 8.0, "hurray_listen_max_memory_mib": 1.5})
    assert cfg.listen_limits == {"max_connections": 8, "max_inflight_bytes": 3 << 19}
    assert isinstance(cfg.listen_limits["max_connections"], int)
    assert _parse({"hurray_path": "/x", "hurray_push_wait_s": 0.5}).push_wait_s == 0.5


def test_a_path_like_hurray_path_is_a_string(tmp_path: Path) -> None:
    assert _parse({"hurray_path": tmp_path}).path == str(tmp_path)


def test_a_path_like_hurray_key_file_is_a_path(tmp_path: Path) -> None:
    """Found by a review: a bare Path was refused ("expected a path or a list of paths, got PosixPath(...)")."""
    key = tmp_path / "fleet.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o600)
    cfg = _parse({"hurray_path": "/x", "hurray_key_file": key})
    assert cfg.keys is not None and cfg.keys == _parse({"hurray_path": "/x", "hurray_key_file": str(key)}).keys


def test_a_tilde_in_hurray_path_and_hurray_key_file_is_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: no shell expands "~" inside the quoted --kv-transfer-config JSON, and the connector did
    not either: the store was a directory named "~" under the engine's working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("new.key", "old.key"):
        (tmp_path / name).write_bytes(name.encode() * 8)
        (tmp_path / name).chmod(0o600)
    cfg = _parse({"hurray_path": "~/hurray", "hurray_key_file": ["~/new.key", "~/old.key"]})
    assert cfg.path == str(tmp_path / "hurray")
    assert cfg.keys is not None and len(cfg.keys.ids) == 2


def test_null_leaves_every_option_at_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review: JSON null meant "unset" for some options (hurray_url, hurray_listen, hurray_key_file) and
    was refused by others ("got None" for hurray_tails, hurray_chunk_tokens, hurray_push_wait_s...)."""
    monkeypatch.delenv("HURRAY_VLLM_KEY_FILE", raising=False)
    options = set()
    for line in DOCS.read_text().splitlines():
        if line.startswith("| `hurray_"):
            options |= set(re.findall(r"`(hurray_\w+)`", line.split("|")[1]))
    options.discard("hurray_path")
    assert "hurray_tails" in options and "hurray_chunk_tokens" in options
    default = _parse({"hurray_path": "/x"})
    for option in sorted(options):
        assert _parse({"hurray_path": "/x", option: None}) == default, option
    err = _refused({"hurray_path": None})  # as if missing: it has no default
    assert err.field == "hurray_path" and str(err).endswith("needs kv_connector_extra_config.hurray_path")


def test_a_chunk_longer_than_the_model_is_refused() -> None:
    err = _refused({"hurray_path": "/x", "hurray_chunk_tokens": 10**9 // 16 * 16}, max_model_len=4096)
    assert err.field == "hurray_chunk_tokens" and "max_model_len 4096" in str(err)
    # Found by a review: a chunk of exactly max_model_len tokens passed, yet never fills either: vLLM refuses a
    # prompt of max_model_len tokens and computes KV for at most max_model_len - 1 (the last token generated has none).
    err = _refused({"hurray_path": "/x", "hurray_chunk_tokens": 4096}, max_model_len=4096)
    assert err.field == "hurray_chunk_tokens" and "max_model_len 4096" in str(err) and "at most 4095" in str(err)
    assert _parse({"hurray_path": "/x", "hurray_chunk_tokens": 4080}, max_model_len=4096).chunk_tokens == 4080
    # The default is not the operator's choice: a short model keeps it (and the engine still starts).
    assert _parse({"hurray_path": "/x"}, max_model_len=128).chunk_tokens == 256


@pytest.mark.parametrize("chunk", [0, -32, 24])
def test_a_chunk_size_that_is_no_positive_multiple_of_the_block_size_says_so(chunk: int) -> None:
    """Found by a review: 0 and -32 were refused as "not a multiple of the engine's block size" (they are)."""
    err = _refused({"hurray_path": "/x", "hurray_chunk_tokens": chunk})
    assert err.field == "hurray_chunk_tokens"
    assert f"must be a positive multiple of the engine's block size 16, got {chunk}" in str(err), str(err)


# ── kv_role ──────────────────────────────────────────────────────────────────


def test_a_hurray_url_urlsplit_chokes_on_is_a_config_error_not_a_crash() -> None:
    """An unclosed IPv6 bracket raised a bare ValueError out of engine start."""
    err = _refused({"hurray_path": "/x", "hurray_url": "tcp://[::1:9000"}, role="kv_producer")
    assert err.field == "hurray_url" and "tcp://HOST:PORT" in str(err)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"hurray_path": "/x", "hurray_url": "udp://h:1"}, "hurray_url"),
        ({"hurray_path": "/x", "hurray_url": "tcp://h:port"}, "hurray_url"),
        ({"hurray_path": "/x", "hurray_listen": "h:99999"}, "hurray_listen"),
    ],
)
def test_a_malformed_address_s_error_names_its_option_once(extra: dict[str, object], field: str) -> None:
    """Found by a review: "hurray_url: hurray_url: expected tcp://..." (the transport's error already named it)."""
    err = _refused(extra, role="kv_producer")
    assert err.field == field and str(err).startswith(f"{field}: ") and str(err).count(field) == 1, str(err)


@pytest.mark.parametrize("key", ["hurray_url", "hurray_listen"])
@pytest.mark.parametrize("value", [0, False, 9000, ["tcp://h:1"]])
def test_an_address_that_is_not_a_string_is_refused_not_taken_as_unset(key: str, value: object) -> None:
    """Found by a review: 0 and false passed as unset (``or None``): no pushes or no receiver, and no word of it."""
    err = _refused({"hurray_path": "/x", key: value}, role="kv_producer")
    assert err.field == key and repr(value) in str(err), str(err)
    # null and "" are the ways to leave it unset.
    for unset in (None, ""):
        cfg = _parse({"hurray_path": "/x", key: unset}, role="kv_producer")
        assert cfg.url is None and cfg.listen is None


def test_a_consumer_with_hurray_url_is_refused_it_would_push_nothing() -> None:
    err = _refused({"hurray_path": "/x", "hurray_url": "tcp://h:1"}, role="kv_consumer")
    assert err.field == "hurray_url" and "kv_both" in str(err) and "kv_producer" in str(err)
    for role in ("kv_producer", "kv_both"):
        assert _parse({"hurray_path": "/x", "hurray_url": "tcp://h:1"}, role=role).url == "tcp://h:1"


# ── receiver options without a receiver ──────────────────────────────────────


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("hurray_listen_transport", "tcp"),
        ("hurray_listen_quota_mib", 100),
        ("hurray_listen_min_free_mib", 100),
        ("hurray_listen_max_connections", 8),
        ("hurray_listen_max_memory_mib", 64),
        ("hurray_listen_timeout_s", 10),
        ("hurray_listen_idle_timeout_s", 10),
    ],
)
def test_a_receiver_option_without_hurray_listen_is_refused_naming_it(key: str, value: object) -> None:
    err = _refused({"hurray_path": "/x", key: value})
    assert err.field == key and "hurray_listen" in str(err)
    assert _parse({**_LISTEN, key: value}).listen == ":0"


# ── TLS: the key at fault ────────────────────────────────────────────────────


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, str]:
    require("cryptography")
    from pki import make_pki

    files = make_pki(tmp_path, "fleet")
    files["other_key"] = make_pki(tmp_path, "other")["key"]
    files["missing"] = str(tmp_path / "missing.pem")
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    files["garbage"] = str(tmp_path / "garbage.pem")
    return files


_TLS_URL = {"hurray_path": "/x", "hurray_url": "tls://h:1"}
_TLS_LISTEN = {"hurray_path": "/x", "hurray_listen": ":0"}


@pytest.mark.parametrize(
    ("extra", "files", "field"),
    [
        # Without a tls:// URL: the option given, not hurray_tls_ca.
        ({"hurray_path": "/x"}, {"hurray_tls_cert": "cert", "hurray_tls_key": "key"}, "hurray_tls_cert"),
        ({"hurray_path": "/x"}, {"hurray_tls_key": "key"}, "hurray_tls_key"),
        ({"hurray_path": "/x", "hurray_url": "tcp://h:1"}, {"hurray_tls_ca": "ca"}, "hurray_tls_ca"),
        # A file that does not load.
        (_TLS_URL, {"hurray_tls_cert": "cert", "hurray_tls_key": "missing"}, "hurray_tls_key"),
        (_TLS_URL, {"hurray_tls_cert": "cert", "hurray_tls_key": "garbage"}, "hurray_tls_key"),
        (_TLS_URL, {"hurray_tls_cert": "cert", "hurray_tls_key": "other_key"}, "hurray_tls_key"),
        (_TLS_URL, {"hurray_tls_cert": "missing", "hurray_tls_key": "key"}, "hurray_tls_cert"),
        (_TLS_URL, {"hurray_tls_cert": "garbage", "hurray_tls_key": "key"}, "hurray_tls_cert"),
        (_TLS_URL, {"hurray_tls_cert": "cert"}, "hurray_tls_key"),  # the key it needs
        (_TLS_URL, {"hurray_tls_ca": "garbage"}, "hurray_tls_ca"),
        # The receiver's.
        ({"hurray_path": "/x"}, {"hurray_listen_tls_key": "key"}, "hurray_listen_tls_key"),
        (
            _TLS_LISTEN,
            {
                "hurray_listen_tls_cert": "cert",
                "hurray_listen_tls_key": "key",
                "hurray_listen_tls_client_ca": "missing",
            },
            "hurray_listen_tls_client_ca",
        ),
        (
            _TLS_LISTEN,
            {
                "hurray_listen_tls_cert": "cert",
                "hurray_listen_tls_key": "key",
                "hurray_listen_tls_client_ca": "garbage",
            },
            "hurray_listen_tls_client_ca",
        ),
        (_TLS_LISTEN, {"hurray_listen_tls_cert": "cert", "hurray_listen_tls_key": "missing"}, "hurray_listen_tls_key"),
        (_TLS_LISTEN, {"hurray_listen_tls_cert": "missing", "hurray_listen_tls_key": "key"}, "hurray_listen_tls_cert"),
        (_TLS_LISTEN, {"hurray_listen_tls_key": "key"}, "hurray_listen_tls_cert"),  # the certificate it needs
    ],
)
def test_a_tls_error_names_the_option_at_fault(
    pki: dict[str, str], extra: dict[str, object], files: dict[str, str], field: str
) -> None:
    err = _refused({**extra, **{key: pki[name] for key, name in files.items()}})
    assert err.field == field, err


def test_good_tls_files_pass(pki: dict[str, str]) -> None:
    push = {"hurray_tls_cert": pki["cert"], "hurray_tls_key": pki["key"], "hurray_tls_ca": pki["ca"]}
    listen = {
        "hurray_listen_tls_cert": pki["cert"],
        "hurray_listen_tls_key": pki["key"],
        "hurray_listen_tls_client_ca": pki["ca"],
    }
    cfg = _parse({**_TLS_URL, **_TLS_LISTEN, **push, **listen})
    assert cfg.push_tls is not None and cfg.listen_tls is not None


# ── hurray_listen receivers of one process ───────────────────────────────────


def _scheduler(store: Path, listen: str, **extra: object) -> Any:
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler
    from hurray_vllm.chunks.store import DirectoryStore

    cfg = _parse({"hurray_path": str(store), "hurray_listen": listen, **extra})
    return HurrayScheduler(cfg, DirectoryStore(store), None, "cd" * 8)  # type: ignore[arg-type]


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError:
        return False
    return True


def test_port_0_starts_a_receiver_for_each_engine(tmp_path: Path) -> None:
    """Port 0 picks a free port for each engine: a second one no longer gets the first one's receiver."""
    from hurray_vllm.adapters.vllm.connector.scheduler import _RECEIVERS

    first, second = _scheduler(tmp_path / "a", "127.0.0.1:0"), _scheduler(tmp_path / "b", "127.0.0.1:0")
    try:
        first.start_receiver()
        second.start_receiver()
        a, b = _RECEIVERS[first._listening], _RECEIVERS[second._listening]
        assert a.receiver is not b.receiver and a.receiver.address[1] != b.receiver.address[1]
        assert a.receiver.store.root != b.receiver.store.root  # each engine's chunks land in its own store
    finally:
        first.shutdown()
        second.shutdown()


def test_engines_on_one_address_share_its_receiver_until_the_last_shuts_down(tmp_path: Path) -> None:
    from hurray_vllm.adapters.vllm.connector.scheduler import _RECEIVERS

    first = _scheduler(tmp_path, "127.0.0.1:0", hurray_listen_max_connections=4)
    first.start_receiver()
    try:
        port = first._listening[1]
        second = _scheduler(tmp_path, f"127.0.0.1:{port}", hurray_listen_max_connections=4)
        second.start_receiver()  # the same address and configuration: shared, not bound again (which would fail)
        shared = _RECEIVERS[first._listening]
        assert second._listening == first._listening and shared.users == 2
        first.shutdown()
        first.shutdown()  # once per engine
        assert not shared.receiver.stopping and _accepts(port), "stopped while another engine uses it"
        second.shutdown()
        # Stopped: an accept already waiting still takes one last connection (ReceiverBase.stop), so no connect here.
        assert shared.receiver.stopping and ("127.0.0.1", port) not in _RECEIVERS
    finally:
        first.shutdown()


def test_a_forked_child_neither_shares_nor_stops_its_parent_s_receiver(tmp_path: Path) -> None:
    """Found by a review: a forked child (an engine core) inherited the registry, so its shutdown stopped the
    parent's listening socket, and its engines "shared" a receiver whose threads live in the parent only."""
    import os
    import signal
    import time
    import warnings

    from hurray_vllm.adapters.vllm.connector.scheduler import _RECEIVERS

    first = _scheduler(tmp_path, "127.0.0.1:0")
    first.start_receiver()
    try:
        port = first._listening[1]
        with warnings.catch_warnings():  # Python 3.12+ warns of forking a process with threads: this child only exits
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            code = 1
            try:
                empty = not _RECEIVERS
                first.shutdown()  # the child's copy of the engine, as its teardown may run
                code = 0 if empty else 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:  # a hang guard: the child must not outlive the test
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in its shutdown")
        assert os.waitstatus_to_exitcode(done[1]) == 0, "the child saw its parent's receivers"
        assert not _RECEIVERS[first._listening].receiver.stopping and _accepts(port), "the child stopped it"
    finally:
        first.shutdown()


@pytest.mark.parametrize(
    "other",
    [
        {"store": "elsewhere"},
        {"hurray_listen_max_connections": 8},
        {"hurray_listen_quota_mib": 100},
    ],
)
def test_another_configuration_on_a_receiver_s_address_is_refused(tmp_path: Path, other: dict[str, object]) -> None:
    from hurray_vllm.adapters.vllm.connector.scheduler import _RECEIVERS
    from hurray_vllm.errors import HurrayArgumentError

    first = _scheduler(tmp_path, "127.0.0.1:0", hurray_listen_max_connections=4)
    first.start_receiver()
    try:
        port = first._listening[1]
        extra = {k: v for k, v in other.items() if k != "store"}
        store = tmp_path / str(other["store"]) if "store" in other else tmp_path
        second = _scheduler(store, f"127.0.0.1:{port}", **{"hurray_listen_max_connections": 4, **extra})
        with pytest.raises(HurrayArgumentError) as info:
            second.start_receiver()
        assert info.value.field == "hurray_listen"
        second.shutdown()  # started nothing: stops nothing
        assert not _RECEIVERS[first._listening].receiver.stopping and _accepts(port)
    finally:
        first.shutdown()


def test_the_connector_s_shutdown_stops_the_scheduler_s_receiver(tmp_path: Path) -> None:
    from hurray_vllm.adapters.vllm.connector import HurrayConnector
    from hurray_vllm.adapters.vllm.connector.scheduler import _RECEIVERS

    sched = _scheduler(tmp_path, "127.0.0.1:0")
    sched.start_receiver()
    listening = _RECEIVERS[sched._listening]
    connector = HurrayConnector.__new__(HurrayConnector)  # the facade alone: no engine
    connector._scheduler, connector._worker = sched, None
    try:
        connector.shutdown()
        assert listening.receiver.stopping and listening not in _RECEIVERS.values()
    finally:
        sched.shutdown()


# ── caches the connector cannot serve: refused at start ──────────────────────


@pytest.mark.parametrize(
    ("cache_dtype", "block_size", "field", "says"),
    [("fp4", 64, "kv_cache_dtype", "'fp4' is not supported"), ("auto", 128, "block_size", "--block-size 64")],
)
def test_caches_the_connector_cannot_serve_are_a_configuration_error_at_registration(
    cache_dtype: str, block_size: int, field: str, says: str
) -> None:
    """Found by a review: docs/connector.md says start refusals are HurrayArgumentError, but register_kv_caches
    let describe_worker_cache's HurrayFormatError (a verdict on data, for snapshot()) through."""
    require("vllm")
    import torch

    from hurray_vllm.adapters.vllm.connector.worker import HurrayWorker
    from hurray_vllm.errors import HurrayArgumentError, HurrayFormatError

    class FlashInferImpl:
        pass

    layer = SimpleNamespace(kv_cache=None, impl=FlashInferImpl())
    worker = object.__new__(HurrayWorker)
    worker._vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={"l0": layer}),
        model_config=SimpleNamespace(use_mla=False, get_head_size=lambda: 16, dtype=torch.bfloat16),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=block_size, kv_cache_layout=None),
    )
    worker._layer_groups, worker._kv_cache_config, worker._fingerprint, worker._ec = {}, None, None, None
    # vLLM 0.32's kernel-block view (blocks of 64): [blocks * 2, heads, 64 tokens, 2 * dim].
    cache = torch.zeros(8, 2, 64, 2 * 16, dtype=torch.bfloat16)
    with pytest.raises(HurrayArgumentError) as info:
        worker.register_kv_caches({"l0": cache})
    err = info.value
    assert err.field == field and says in str(err) and not isinstance(err, HurrayFormatError)
    assert isinstance(err.__cause__, HurrayFormatError) and str(err) == str(err.__cause__)  # the same words
    assert worker._ec is None


@pytest.mark.parametrize("backend", ["B12X", "ROCM_ATTN"])
def test_a_backend_that_keeps_keys_and_values_as_two_head_slots_fails_the_start(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At two KV heads its [B, 2, N, H*D] pages passed for [B, H, N, 2D]: chunks of mixed-up keys and values."""
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.errors import HurrayArgumentError

    groups = kv_groups(backend_spec(backend, 2, monkeypatch))
    with pytest.raises(HurrayArgumentError, match="num_head_slots=2") as info:
        HurrayConfig.from_vllm(_config({"hurray_path": "/x"}), groups)  # type: ignore[arg-type]
    assert info.value.field == "kv_cache_groups" and "--attention-backend FLASH_ATTN" in str(info.value)
    HurrayConfig.from_vllm(_config({"hurray_path": "/x"}), kv_groups(backend_spec("FLASH_ATTN", 2, monkeypatch)))


def _grouped_worker(layers: dict[str, Any]) -> Any:
    """A HurrayWorker as far as register_kv_caches reads it: KV cache groups {l0: 0 (sliding), l1: 1 (full)}."""
    import torch

    from hurray_vllm.adapters.vllm.connector.worker import HurrayWorker

    worker = object.__new__(HurrayWorker)
    worker._vllm_config, _ = worker_config([torch.zeros(4, 2, 16, 32)], 16, "FlashAttentionImpl")
    worker._vllm_config.compilation_config.static_forward_context = layers
    # What vLLM builds the connector from: the engine's groups, before the model runner adds KV-sharing layers.
    worker._layer_groups, worker._windows = {"l0": 0, "l1": 1}, (64, None)
    worker._kv_cache_config, worker._fingerprint, worker._ec = None, None, None
    return worker


def test_layers_that_share_another_layers_kv_join_its_group_at_registration() -> None:
    """vLLM builds the connector from the KV cache groups before the model runner adds the cross-layer KV sharing
    layers (Gemma-3n's) to their targets' groups, then registers those layers too: a grouped model with KV sharing
    was refused at start, "layers [...] are in no KV cache group", though snapshot() served it."""
    require("vllm")
    import torch

    from hurray_vllm.adapters.vllm.cache import group_options
    from hurray_vllm.errors import HurrayArgumentError

    class FlashAttentionImpl:
        pass

    def layer(target: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(kv_cache=None, impl=FlashAttentionImpl(), kv_sharing_target_layer_name=target)

    layers = {"l0": layer(), "l1": layer(), "l2": layer("l0"), "l3": layer("l1")}
    caches = {n: torch.zeros(4, 2, 16, 32, dtype=torch.bfloat16) for n in ("l0", "l1")}
    caches.update(l2=caches["l0"], l3=caches["l1"])  # vLLM's kv_caches[layer] = kv_caches[target]
    worker = _grouped_worker(layers)
    worker.register_kv_caches(caches)
    assert worker._layer_groups == {"l0": 0, "l1": 1, "l2": 0, "l3": 1}  # the model runner's groups
    assert worker._ec.layer_names == ["l0", "l1", "l2", "l3"]
    assert group_options(worker._layer_groups, worker._windows, worker._ec.layer_names)["layer_groups"] == [0, 1, 0, 1]
    # Caches vLLM never registered, described at the first load or save: the same groups.
    late = _grouped_worker(layers)
    for name, m in layers.items():
        m.kv_cache = [caches[name]]
    assert late._engine_cache().layer_names == ["l0", "l1", "l2", "l3"] and late._layer_groups["l3"] == 1
    # A layer in no group that shares no grouped layer's KV is still refused.
    layers["l4"] = layer("elsewhere")
    with pytest.raises(HurrayArgumentError, match=r"layers \['l4'\] are in no KV cache group") as info:
        _grouped_worker(layers).register_kv_caches({**caches, "l4": caches["l0"]})
    assert info.value.field == "kv_cache_groups"


# ── what vLLM is told ────────────────────────────────────────────────────────


def test_loaded_tokens_are_reported_as_disk_hits() -> None:
    require("vllm")
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from hurray_vllm.adapters.vllm.connector import HurrayConnector

    assert HurrayConnector._cache_hit_source is CacheHitSource.DISK
    connector = HurrayConnector.__new__(HurrayConnector)
    assert connector.get_external_cache_hit_sources(None, 48) == {CacheHitSource.DISK: 48}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("role", "policy", "warned"),
    [
        ("kv_both", "fail", True),
        ("kv_consumer", "fail", True),
        ("kv_both", "recompute", False),
        ("kv_producer", "fail", False),
    ],
)
def test_the_fail_load_policy_is_warned_about_where_the_engine_loads(
    caplog: pytest.LogCaptureFixture, role: str, policy: str, warned: bool
) -> None:
    from hurray_vllm.adapters.vllm.connector import _warn_of_failure_policy

    engine = _config({"hurray_path": "/x"}, role=role)
    engine.kv_transfer_config.kv_load_failure_policy = policy
    config = _parse({"hurray_path": "/x"}, role=role)
    with caplog.at_level(logging.WARNING, logger="hurray_vllm.connector"):
        _warn_of_failure_policy(engine, config)  # type: ignore[arg-type]
    assert ('"recompute"' in caplog.text) is warned
