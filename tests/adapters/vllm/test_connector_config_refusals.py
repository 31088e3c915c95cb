"""Connector options a review found passing as something else, or failing later without naming themselves: each
is now refused when the engine starts, naming the key (``HurrayArgumentError.field``)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import require
from connector_parts import vllm_config


def _parse(extra: dict[str, object], role: str = "kv_both") -> Any:
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig

    return HurrayConfig.from_vllm(vllm_config(extra, role=role), None)  # type: ignore[arg-type]


def _refused(extra: dict[str, object], role: str = "kv_both") -> Any:
    """The HurrayArgumentError parsing ``extra`` raises."""
    from hurray_vllm.errors import HurrayArgumentError

    with pytest.raises(HurrayArgumentError) as info:
        _parse(extra, role=role)
    return info.value


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, str]:
    require("cryptography")
    from pki import make_pki

    return make_pki(tmp_path, "fleet")


def _tls(pki: dict[str, str]) -> dict[str, object]:
    """Pushes to a tls:// URL and a TLS receiver with mutual TLS, every file good."""
    return {
        "hurray_path": "/x",
        "hurray_url": "tls://h:1",
        "hurray_tls_ca": pki["ca"],
        "hurray_tls_cert": pki["cert"],
        "hurray_tls_key": pki["key"],
        "hurray_listen": ":0",
        "hurray_listen_tls_cert": pki["cert"],
        "hurray_listen_tls_key": pki["key"],
        "hurray_listen_tls_client_ca": pki["ca"],
    }


# ── TLS files: only a missing key (or null) is unset ─────────────────────────

_TLS_KEYS = (
    "hurray_tls_ca",
    "hurray_tls_cert",
    "hurray_tls_key",
    "hurray_listen_tls_cert",
    "hurray_listen_tls_key",
    "hurray_listen_tls_client_ca",
)


@pytest.mark.parametrize("key", _TLS_KEYS)
@pytest.mark.parametrize("value", ["", "  ", 0, False, 1, ["a.pem"]])
def test_a_tls_option_that_names_no_file_is_refused_not_taken_for_unset(
    pki: dict[str, str], key: str, value: object
) -> None:
    """Found by a review: ``""``, ``0`` or ``false`` passed as unset: ``hurray_listen_tls_client_ca: ""`` dropped
    mutual TLS, an empty receiver certificate and key served plaintext, ``hurray_tls_ca: ""`` trusted the system's
    CAs, and no word of it."""
    err = _refused({**_tls(pki), key: value})
    assert err.field == key, err


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        # The receiver's certificate and key both empty: a plaintext receiver, started as if none were given.
        ({"hurray_listen": ":0", "hurray_listen_tls_cert": "", "hurray_listen_tls_key": ""}, "hurray_listen_tls_cert"),
        # false for the CA with a tcp:// URL: accepted although hurray_tls_* needs a tls:// one.
        ({"hurray_url": "tcp://h:1", "hurray_tls_ca": False}, "hurray_tls_ca"),
        ({"hurray_url": "tls://h:1", "hurray_tls_ca": ""}, "hurray_tls_ca"),
    ],
)
def test_empty_tls_options_alone_are_refused(extra: dict[str, object], key: str) -> None:
    err = _refused({"hurray_path": "/x", **extra})
    assert err.field == key, err


def test_null_tls_options_are_unset(pki: dict[str, str]) -> None:
    cfg = _parse({"hurray_path": "/x", **dict.fromkeys(_TLS_KEYS)})
    assert cfg.push_tls is None and cfg.listen_tls is None


def test_tls_files_take_paths_and_a_leading_tilde(
    pki: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leading ``~`` is the home directory, as in hurray_path and hurray_key_file (no shell expands it inside the
    quoted --kv-transfer-config JSON); it was taken for a directory named ``~``."""
    monkeypatch.setenv("HOME", str(tmp_path))
    tilde = {key: "~/" + Path(str(value)).name for key, value in _tls(pki).items() if key in _TLS_KEYS}
    cfg = _parse({**_tls(pki), **tilde})
    assert cfg.push_tls.ca_file == pki["ca"] and cfg.listen_tls.client_ca_file == pki["ca"]
    assert cfg.listen_tls.cert_file == pki["cert"] and cfg.push_tls.key_file == pki["key"]
    paths = {key: Path(str(value)) for key, value in _tls(pki).items() if key in _TLS_KEYS}
    assert _parse({**_tls(pki), **paths}).listen_tls == cfg.listen_tls  # os.PathLike as before


# ── NUL bytes in paths ───────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"hurray_path": "/x\0y"}, "hurray_path"),
        ({"hurray_key_file": "/k\0ey"}, "hurray_key_file"),
        ({"hurray_key_file": ["/a.key", "/k\0ey"]}, "hurray_key_file"),
        ({"hurray_url": "tls://h:1", "hurray_tls_ca": "/c\0a.pem"}, "hurray_tls_ca"),
        (
            {"hurray_listen": ":0", "hurray_listen_tls_cert": "/c\0ert.pem", "hurray_listen_tls_key": "/key.pem"},
            "hurray_listen_tls_cert",
        ),
    ],
)
def test_a_nul_byte_in_a_path_is_refused_naming_the_option(extra: dict[str, object], key: str) -> None:
    """Found by a review: a bare ValueError (embedded null byte) naming nothing, or, for hurray_path, accepted and
    every lookup failing later."""
    err = _refused({"hurray_path": "/x", **extra})
    assert err.field == key and "NUL" in str(err), err


def test_a_nul_byte_in_a_tls_file_among_good_ones_is_refused(pki: dict[str, str]) -> None:
    err = _refused({**_tls(pki), "hurray_listen_tls_client_ca": pki["ca"] + "\0"})
    assert err.field == "hurray_listen_tls_client_ca", err


# ── numbers ──────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("key", "extra"),
    [
        ("hurray_push_wait_s", {}),
        ("hurray_listen_timeout_s", {"hurray_listen": ":0"}),
        ("hurray_listen_idle_timeout_s", {"hurray_listen": ":0"}),
        ("hurray_listen_max_memory_mib", {"hurray_listen": ":0"}),
        ("hurray_listen_quota_mib", {"hurray_listen": ":0"}),
    ],
)
def test_an_integer_too_large_for_a_float_option_is_refused_naming_it(key: str, extra: dict[str, object]) -> None:
    """Found by a review: ``10**400`` raised a bare OverflowError (int too large to convert to float)."""
    err = _refused({"hurray_path": "/x", **extra, key: 10**400})
    assert err.field == key, err


@pytest.mark.parametrize("quota", [0, 0.0, 1e-7, "0"])
def test_a_quota_under_one_byte_is_refused(quota: object) -> None:
    """Found by a review: 0 (or 1e-7 MiB, 0 bytes once scaled) was taken, and the receiver then refused every
    chunk; ``hurray-vllm receive --quota 0`` is refused too."""
    err = _refused({"hurray_path": "/x", "hurray_listen": ":0", "hurray_listen_quota_mib": quota})
    assert err.field == "hurray_listen_quota_mib", err


def test_a_quota_of_one_byte_is_taken() -> None:
    cfg = _parse({"hurray_path": "/x", "hurray_listen": ":0", "hurray_listen_quota_mib": 1 / (1 << 20)})
    assert cfg.listen_limits == {"quota_bytes": 1}


# ── hurray_path that cannot be a store ───────────────────────────────────────


@pytest.mark.parametrize("role", ["kv_both", "kv_producer", "kv_consumer"])
def test_a_hurray_path_that_is_a_file_is_refused(tmp_path: Path, role: str) -> None:
    """Found by a review: a regular file passed the start and every save then failed inside the writer (a
    consumer's every lookup missed); ``hurray-vllm receive --dir`` refuses it."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for path in (afile, afile / "store"):  # the file, or a file above the store
        err = _refused({"hurray_path": str(path)}, role=role)
        assert err.field == "hurray_path" and str(afile) in str(err), err


def test_a_hurray_path_that_is_a_dangling_link_or_a_loop_is_refused(tmp_path: Path) -> None:
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for name in ("dangling", "loop"):
        err = _refused({"hurray_path": str(tmp_path / name)})
        assert err.field == "hurray_path", err


def test_a_store_no_file_can_be_created_in_is_refused_where_the_engine_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that saves, or receives, into a directory it cannot write would fail every chunk, looking fine.

    Made unwritable by the probe itself: permissions do not stop root.
    """
    from hurray_vllm.adapters.vllm.connector import config

    def read_only(**kwargs: object) -> Any:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(kwargs.get("dir")) + "/tmpXYZ")

    monkeypatch.setattr(config.tempfile, "TemporaryFile", read_only)
    store = str(tmp_path)
    for role, extra in (("kv_both", {}), ("kv_producer", {}), ("kv_consumer", {"hurray_listen": ":0"})):
        err = _refused({"hurray_path": store, **extra}, role=role)
        assert err.field == "hurray_path" and store in str(err) and "tmpXYZ" not in str(err), err
    assert _parse({"hurray_path": store}, role="kv_consumer").path == store  # reads only: no probe


def test_a_good_or_missing_store_passes_and_the_parser_makes_nothing(tmp_path: Path) -> None:
    assert _parse({"hurray_path": str(tmp_path)}).path == str(tmp_path)
    missing = tmp_path / "later" / "store"  # made by the first save, as before
    assert _parse({"hurray_path": str(missing)}).path == str(missing)
    assert not (tmp_path / "later").exists() and list(tmp_path.iterdir()) == []  # the probe left nothing


# ── hurray_listen ────────────────────────────────────────────────────────────


@pytest.mark.parametrize("listen", [" :0", "h :0", "\t127.0.0.1:0", "h\0:0", "127.0.0.1:0\n", "[::1 ]:0"])
def test_a_listen_address_with_whitespace_or_a_control_character_is_refused(listen: str) -> None:
    """Found by a review: ``" :0"`` passed and failed at bind with an OSError naming no option; parse_address
    refuses such a URL."""
    from hurray_vllm.errors import HurrayFormatError
    from hurray_vllm.transport.base import parse_listen

    with pytest.raises(HurrayFormatError) as info:
        parse_listen(listen)
    assert info.value.field == "hurray_listen"
    err = _refused({"hurray_path": "/x", "hurray_listen": listen})
    assert err.field == "hurray_listen" and "whitespace or a control character" in str(err), err


def _scheduler(store: Path, listen: str, **extra: object) -> Any:
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler
    from hurray_vllm.chunks.store import DirectoryStore

    cfg = _parse({"hurray_path": str(store), "hurray_listen": listen, **extra})
    return HurrayScheduler(cfg, DirectoryStore(store), None, "cd" * 8)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "spelled",
    [
        {"hurray_listen_max_connections": 64},
        {"hurray_listen_timeout_s": 60, "hurray_listen_idle_timeout_s": 120.0},
        {"hurray_listen_min_free_mib": 0, "hurray_listen_max_memory_mib": 8192},
    ],
)
def test_an_engine_spelling_out_a_default_limit_shares_the_receiver(tmp_path: Path, spelled: dict[str, Any]) -> None:
    """Found by a review: the second engine of a process was refused for giving a limit at its default value,
    as if it asked for another receiver (the limits compared were the options given)."""
    first = _scheduler(tmp_path, "127.0.0.1:0")
    first.start_receiver()
    second = None
    try:
        port = first._listening[1]
        second = _scheduler(tmp_path, f"127.0.0.1:{port}", **spelled)
        second.start_receiver()
        assert second._listening == first._listening
    finally:
        if second is not None:
            second.shutdown()
        first.shutdown()


def test_an_engine_asking_for_another_limit_is_still_refused(tmp_path: Path) -> None:
    from hurray_vllm.errors import HurrayArgumentError

    first = _scheduler(tmp_path, "127.0.0.1:0")
    first.start_receiver()
    try:
        port = first._listening[1]
        for other in ({"hurray_listen_max_connections": 65}, {"hurray_listen_quota_mib": 100}):
            with pytest.raises(HurrayArgumentError) as info:
                _scheduler(tmp_path, f"127.0.0.1:{port}", **other).start_receiver()
            assert info.value.field == "hurray_listen"
    finally:
        first.shutdown()
