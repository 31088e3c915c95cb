"""``kv_connector_extra_config`` (the ``hurray_*`` keys) parsed and checked once, into :class:`HurrayConfig`.

Bad configuration is the operator's mistake, not the data's: every error
here is a :class:`~hurray_vllm.errors.HurrayArgumentError` whose ``.field``
names the key (``"hurray_path"``, ``"hurray_chunk_tokens"``, ...). It
surfaces when the engine starts, never inside a step.
"""

from __future__ import annotations

import difflib
import os
import ssl
import stat
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ....chunks.signing import FleetKeys, load_keys
from ....errors import HurrayArgumentError, HurrayFormatError
from ....kv.states import RecurrentStates
from ....transport import CHANNELS, channel_of
from ....transport.base import MAX_TIMEOUT_S, parse_listen
from ....transport.security import TlsOptions, client_context, server_context
from ..cache import cache_groups, is_grouped, split_states_refusal, unsupported_cache, unsupported_parallelism
from ..states import declared_layout, state_groups
from .metadata import DEFAULT_VERIFIED_BYTES

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["HurrayConfig", "verified_capacity"]


def verified_capacity(wanted: int) -> int:
    """``wanted``, at least 64 and at most an eighth of the open-file limit.

    The open-file bound dates from when kept chunks were mapped (each mapping
    holds its file open); chunks are read now, and it stays as a bound on
    entries. Their memory is bounded by ``hurray_verified_mib``.
    """
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no limit known: keep what was asked
        soft = -1
    if soft > 0:
        wanted = min(wanted, soft // 8)
    return max(64, wanted)


class _Options:
    """``kv_connector_extra_config`` as the parser reads it, noting every key it asks for.

    The keys asked for are the connector's options: :meth:`refuse_unknown`
    then refuses any other ``hurray_*`` key (a misspelled option would
    otherwise leave its default in place: ``hurray_keyfile`` would leave
    chunks unsigned). So :meth:`HurrayConfig.from_vllm` reads every option
    unconditionally, whatever the others say.
    """

    def __init__(self, cfg: Any) -> None:
        self._cfg = cfg
        self.asked: set[str] = set()

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        """``key``'s value, or ``default`` where it is missing or JSON ``null``.

        ``null`` means unset for every option alike, here once: ``"hurray_tails": null`` is not a value to refuse.
        """
        self.asked.add(key)
        value = self._cfg.get_from_extra_config(key, None)
        return default if value is None else value

    def given(self, key: str) -> bool:
        """Whether ``key`` was set (to something other than None)."""
        return self.get_from_extra_config(key, None) is not None

    def refuse_unknown(self) -> None:
        """Refuse a ``hurray_*`` key the parser never asked for, naming the closest option. Other keys pass."""
        extra = getattr(self._cfg, "kv_connector_extra_config", None) or {}
        for key in sorted(k for k in extra if isinstance(k, str) and k.startswith("hurray_") and k not in self.asked):
            close = difflib.get_close_matches(key, sorted(self.asked), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise HurrayArgumentError(key, f"not a HurrayConnector option{hint} (see docs/connector.md)")


def _reason(exc: ValueError) -> str:
    """``exc``'s message without its own ``field: `` prefix, for an error that names the option in its place.

    A :class:`HurrayFormatError` of ``channel_of`` or ``parse_listen`` already names the option
    (``hurray_url: expected ...``): wrapped as it is, the option would be printed twice.
    """
    field = getattr(exc, "field", None)
    return str(exc).removeprefix(f"{field}: ") if field else str(exc)


def _float(extra: Any, key: str, default: float) -> float:
    value = extra.get_from_extra_config(key, default)
    if isinstance(value, bool):  # true must not become 1 (one second, one MiB)
        raise HurrayArgumentError(key, f"expected a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer of 400 digits
        raise HurrayArgumentError(key, f"expected a number, got {value!r}") from None
    if out != out:  # NaN
        raise HurrayArgumentError(key, f"expected a number, got {value!r}")
    return out


def _flag(extra: Any, key: str, default: bool) -> bool:
    value = extra.get_from_extra_config(key, default)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise HurrayArgumentError(key, f"expected true or false, got {value!r}")


def _int(extra: Any, key: str, default: int) -> int:
    value = extra.get_from_extra_config(key, default)
    # 64.5 must not become 64 (a chunk size every engine of a fleet must agree on), nor true become 1.
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise HurrayArgumentError(key, f"expected an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise HurrayArgumentError(key, f"expected an integer, got {value!r}") from None


def _address(extra: Any, key: str, example: str) -> str | None:
    """``key``'s address, or None where it is missing, ``null`` or ``""`` (the ways to leave it unset).

    Any other value that is not a string is refused: ``0`` or ``false`` must not pass as unset (no receiver,
    no pushes, and no word of it), nor a number as a port.
    """
    value = extra.get_from_extra_config(key, None)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise HurrayArgumentError(key, f"expected a string such as {example!r} (or null: none), got {value!r}")
    return value


def _has_nul(path: str | os.PathLike[Any]) -> bool:
    """Whether ``path`` holds a NUL byte, which no file name can (``open`` raises a bare ``ValueError``)."""
    text = os.fspath(path)
    return ("\0" if isinstance(text, str) else b"\0") in text


def _tls_file(extra: Any, key: str) -> str | None:
    """``key``'s file, ``~`` expanded; None only where it is missing or ``null``.

    Anything else that names no file is refused, not taken for unset: ``""`` for
    ``hurray_listen_tls_client_ca`` would drop mutual TLS, for the receiver's
    certificate and key serve plaintext, for ``hurray_tls_ca`` trust the system's
    CAs, and no word of it.
    """
    value = extra.get_from_extra_config(key, None)
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise HurrayArgumentError(key, f"expected a path (or null: none), got {value!r}")
    if not value.strip():
        raise HurrayArgumentError(key, f"{key} is set to {value!r}, which names no file; name one, or unset it")
    if _has_nul(value):
        raise HurrayArgumentError(key, f"a path cannot hold a NUL byte, got {value!r}")
    # As hurray_path and hurray_key_file: no shell expands "~" inside the quoted --kv-transfer-config JSON.
    return os.path.expanduser(value)


def _check_store_dir(path: str, writes: bool) -> None:
    """Refuse, at start, a ``hurray_path`` no chunk can be stored in or read from.

    Something that is not a directory (a file, a symbolic link to nothing or a
    loop, a file above it) would fail every save inside the writer and make every
    lookup a miss, with the engine looking fine. ``writes`` (the engine saves, or
    receives): an existing directory must also let a file be created in it. A
    missing directory is left for the first save to make (``DirectoryStore`` does):
    the parser makes nothing.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):  # mkdir would not make the directory through the link
            raise HurrayArgumentError(
                "hurray_path", f"{path} is a symbolic link to a missing target (a chunk store is a directory)"
            ) from None
        return
    except OSError as exc:  # a file above it (ENOTDIR), a link loop (ELOOP), a name too long
        raise HurrayArgumentError(
            "hurray_path", f"{path}: {exc.strerror or exc} (a chunk store is a directory)"
        ) from None
    if not stat.S_ISDIR(mode):
        raise HurrayArgumentError("hurray_path", f"{path} is not a directory (a chunk store is a directory)")
    if writes:
        try:
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as exc:  # its message names the probe's random name, not the directory given
            raise HurrayArgumentError(
                "hurray_path",
                f"cannot create a file in {path} ({exc.strerror or exc}): every chunk saved or received would fail",
            ) from None


_PUSH_TLS = {"cert_file": "hurray_tls_cert", "key_file": "hurray_tls_key", "ca_file": "hurray_tls_ca"}
_LISTEN_TLS = {
    "cert_file": "hurray_listen_tls_cert",
    "key_file": "hurray_listen_tls_key",
    "client_ca_file": "hurray_listen_tls_client_ca",
}


def _tls_options(cfg: Any, url: Any, listen: Any, transport: str) -> tuple[TlsOptions | None, TlsOptions | None]:
    """The TLS options of pushes and of the receiver, each checked by building its context once (at start)."""
    push = TlsOptions(**{attr: _tls_file(cfg, key) for attr, key in _PUSH_TLS.items()})
    listen_opts = TlsOptions(**{attr: _tls_file(cfg, key) for attr, key in _LISTEN_TLS.items()})
    if push == TlsOptions():
        push_opts = None
    elif not (url and str(url).startswith("tls://")):
        key = next(k for attr, k in _PUSH_TLS.items() if getattr(push, attr))
        raise HurrayArgumentError(key, "hurray_tls_* options need a tls://HOST:PORT hurray_url")
    else:
        push_opts = push
    if listen_opts == TlsOptions():
        return push_opts, None
    if not listen or transport != "tcp":
        key = next(k for attr, k in _LISTEN_TLS.items() if getattr(listen_opts, attr))
        raise HurrayArgumentError(key, "hurray_listen_tls_* options need hurray_listen with the tcp transport")
    try:
        server_context(listen_opts)
    except HurrayArgumentError as exc:
        raise HurrayArgumentError(_tls_fault(listen_opts, _LISTEN_TLS), str(exc)) from None
    return push_opts, listen_opts


def _tls_fault(opts: TlsOptions, keys: dict[str, str]) -> str:
    """The option of ``opts`` (``keys``: its options by attribute) that a failed TLS context is about.

    The context's error names no option: a file that cannot be read, a
    certificate without its key (or the key without it), a CA bundle or a
    certificate that does not load; else the private key (unreadable as a
    key, or not the certificate's).
    """
    files = {attr: getattr(opts, attr) for attr in keys}
    for attr, path in files.items():
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError:
            return keys[attr]
    if (files["cert_file"] is None) != (files["key_file"] is None):
        return keys["key_file"] if files["key_file"] is None else keys["cert_file"]
    for attr in (a for a in keys if a not in ("cert_file", "key_file")):
        if files[attr] is not None and not _loads_as_certificates(files[attr]):
            return keys[attr]
    if files["cert_file"] is not None and not _loads_as_certificates(files["cert_file"]):
        return keys["cert_file"]
    return keys["key_file"] if files["key_file"] is not None else next(iter(keys.values()))


def _loads_as_certificates(path: str) -> bool:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(path)
    except (OSError, ssl.SSLError):
        return False
    return True


def _check_push_tls(push_opts: TlsOptions | None) -> None:
    """Build the pushes' TLS context once, so that a bad file stops the start naming the push options."""
    if push_opts is None:
        return
    try:
        client_context(push_opts)
    except HurrayArgumentError as exc:
        raise HurrayArgumentError(_tls_fault(push_opts, _PUSH_TLS), str(exc)) from None


def _worker_in_process(vllm_config: VllmConfig) -> bool:
    """Whether the worker runs in the scheduler's process: vLLM's ``uni`` executor, or its external launcher.

    ``mp`` and ``ray`` (and an executor class) run workers in processes of
    their own, whatever the tensor-parallel degree.
    """
    parallel = vllm_config.parallel_config
    backend = getattr(parallel, "distributed_executor_backend", None)
    if backend is None:  # vLLM sets it; a bare config: in-process unless several ranks
        return int(getattr(parallel, "world_size", 1) or 1) == 1
    return backend in ("uni", "external_launcher")


def _async_loads(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> bool:
    """Whether loads must be reported per request: several KV cache groups, wherever the workers run.

    vLLM 0.32 maps blocks a worker failed to load back to their requests
    only for one KV cache group; with several it stops the engine
    (``_handle_invalid_blocks`` raises). A worker can fail a load the
    scheduler verified, in the scheduler's process too: out of host or
    device memory for a layer's pages, or (in a process of its own) a file
    gone since (a prune). Such a model's loads therefore take vLLM's
    asynchronous path whatever the executor: the request waits a step, and
    a failed load fails the request alone (recomputed, with
    ``kv_load_failure_policy: "recompute"``). A worker in the scheduler's
    process still writes the chunks the scheduler verified, handed over with
    the load. A linear-attention hybrid's load then writes the state block at
    the resume only: the step that computes on from there comes later, and
    vLLM copies that block into the step's own before it
    (``preprocess_mamba``), as after any prefix hit. ``vllm_config`` is not
    looked at: the executor no longer decides.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return len(groups) > 1


@dataclass(frozen=True)
class HurrayConfig:
    """The connector's settings, as read from ``kv_transfer_config`` (see the package docstring).

    Example:
        What ``vllm serve ... --kv-transfer-config '{...}'`` passes, read and checked:

        >>> from types import SimpleNamespace
        >>> from vllm.config import KVTransferConfig
        >>> kv = KVTransferConfig(
        ...     kv_connector="HurrayConnector",
        ...     kv_connector_module_path="hurray_vllm.adapters.vllm.connector",
        ...     kv_role="kv_both",
        ...     kv_connector_extra_config={"hurray_path": "/var/cache/hurray", "hurray_chunk_tokens": 256,
        ...                                "hurray_url": "tcp://10.0.0.2:9000"},
        ... )
        >>> engine = SimpleNamespace(kv_transfer_config=kv, cache_config=SimpleNamespace(block_size=16),
        ...                          parallel_config=SimpleNamespace(tensor_parallel_size=1))
        >>> cfg = HurrayConfig.from_vllm(engine, None)
        >>> cfg.chunk_tokens, cfg.url_channel, cfg.save_async  # pushes run on the background writer too
        (256, 'tcp', True)
    """

    path: str
    chunk_tokens: int
    block_size: int
    url: str | None
    url_channel: str | None  # the transport hurray_url names ("tcp", "nixl")
    loads: bool  # kv_consumer or kv_both
    saves: bool  # kv_producer or kv_both
    save_async: bool  # hurray_save_async: saves (and pushes) run on a background writer
    save_queue_bytes: int
    #: hurray_push_wait_s: how long a request whose kv_transfer_params announce pushed chunks waits for
    #: the next one to arrive before it recomputes what is missing.
    push_wait_s: float
    verified_chunks: int  # already bounded by verified_capacity()
    verified_bytes: int  # hurray_verified_mib: what the verified chunks may hold in memory
    listen: str | None
    listen_transport: str
    #: The hurray_listen receiver's limits (``hurray_listen_quota_mib``, ``hurray_listen_min_free_mib``,
    #: ``hurray_listen_max_connections``, ``hurray_listen_max_memory_mib``, ``hurray_listen_timeout_s``,
    #: ``hurray_listen_idle_timeout_s``), as the keyword arguments of
    #: :func:`~hurray_vllm.transport.receiver_for`; unset ones keep the receiver's defaults.
    listen_limits: dict[str, Any] = field(default_factory=dict)
    #: Several KV cache groups or a sliding window (vLLM's hybrid KV cache manager): each attention
    #: layer's group and each group's window (``None``: full attention). Empty otherwise.
    layer_groups: dict[str, int] = field(default_factory=dict)
    group_windows: tuple[int | None, ...] = ()
    #: ``hurray_window_chunks``: "every" (default) keeps, in each chunk, the sliding-window blocks a resume
    #: at that chunk's end needs (any shared prefix resumes); "last" keeps them only where a resume at the
    #: prompt's last whole chunk (or later) needs them (migration and prefill/decode; a store of at most
    #: the windows per request, but a shorter shared prefix of a hybrid no longer loads).
    window_chunks: str = "every"
    #: A linear-attention hybrid: the KV cache groups holding recurrent states (``MambaSpec``), and vLLM's
    #: ``mamba_cache_mode`` ("align" with prefix caching, else "none"). Empty for other models.
    state_groups: tuple[int, ...] = ()
    state_mode: str = ""
    #: The states this engine's chunks carry and its workers load (``declared_layout``); None without any.
    state_layout: RecurrentStates | None = None
    #: ``tensor_parallel_size``: each worker saves and loads its ranks' KV heads (``kv.heads``).
    tp: int = 1
    #: Loads go through vLLM's asynchronous-load path (reported per request, not per block): a model of
    #: several KV cache groups, for which vLLM cannot map failed blocks back to requests, wherever its
    #: workers run (see ``_async_loads``).
    async_loads: bool = False
    #: Steps vLLM schedules before it learns the outcome of the one before (2 with ``async_scheduling``):
    #: how long a synchronous load that fails spoils the steps that read its blocks (see ``wait_for_save``).
    steps_in_flight: int = 1
    #: The worker runs in the scheduler's process: a load hands it the chunks the scheduler verified.
    worker_in_process: bool = True
    #: ``hurray_key_file`` (or ``$HURRAY_VLLM_KEY_FILE``): the fleet keys chunks are signed with and
    #: checked against (:mod:`hurray_vllm.chunks.signing`); None: unsigned chunks, as before.
    keys: FleetKeys | None = field(default=None, repr=False)
    #: Pushes to a ``tls://`` hurray_url: ``hurray_tls_ca`` (CA bundle; default the system's), and for mutual
    #: TLS ``hurray_tls_cert`` / ``hurray_tls_key`` (this engine's client certificate).
    push_tls: TlsOptions | None = None
    #: The hurray_listen receiver over TLS: ``hurray_listen_tls_cert`` / ``hurray_listen_tls_key``, and
    #: ``hurray_listen_tls_client_ca`` to require client certificates (mutual TLS). None: plain TCP.
    listen_tls: TlsOptions | None = None
    #: ``hurray_tails``: save each prompt's whole blocks after its last whole chunk when its prefill ends, and
    #: load such a tail after a request's whole chunks (models of one KV cache group; see docs/connector.md).
    tails: bool = True

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> HurrayConfig:
        """Read and check the configuration; :class:`HurrayArgumentError` names the bad key."""
        kv = vllm_config.kv_transfer_config
        if kv is None:
            raise HurrayArgumentError("kv_transfer_config", "HurrayConnector needs a kv_transfer_config")
        cfg = _Options(kv)  # every option below is read whatever the others say: see _Options
        path = cfg.get_from_extra_config("hurray_path", None)
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            what = "" if path is None else f", a non-empty path, not {path!r}"
            raise HurrayArgumentError(
                "hurray_path", f"HurrayConnector needs kv_connector_extra_config.hurray_path{what}"
            )
        if _has_nul(path):
            raise HurrayArgumentError("hurray_path", f"a path cannot hold a NUL byte, got {path!r}")
        # No shell expands "~" inside the quoted --kv-transfer-config JSON: unexpanded, the store would be a
        # directory named "~" under the engine's working directory.
        path = os.path.expanduser(path)
        block_size = vllm_config.cache_config.block_size
        # 256 tokens, or the nearest whole number of blocks above (a hybrid's blocks may be larger).
        chunk = _int(cfg, "hurray_chunk_tokens", -(-256 // block_size) * block_size)
        if chunk <= 0 or chunk % block_size:
            raise HurrayArgumentError(
                "hurray_chunk_tokens",
                f"must be a positive multiple of the engine's block size {block_size}, got {chunk}",
            )
        max_len = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
        if cfg.given("hurray_chunk_tokens") and isinstance(max_len, int) and 0 < max_len <= chunk:
            # No request would ever complete a chunk: nothing saved, nothing loaded, and no word of it. vLLM computes
            # KV for at most max_model_len - 1 tokens (it refuses a prompt of max_model_len), so equal is too long.
            raise HurrayArgumentError(
                "hurray_chunk_tokens",
                f"{chunk} tokens: a request of the model's max_model_len {max_len} computes KV for at most "
                f"{max_len - 1}, so no chunk would fill",
            )
        saves = kv.kv_role in ("kv_producer", "kv_both")
        url = _address(cfg, "hurray_url", "tcp://HOST:PORT")
        try:
            url_channel = channel_of(str(url)) if url else None  # a typo surfaces at start, not at the first save
        except ValueError as exc:  # a HurrayFormatError, or whatever a URL parser lets through: not an engine crash
            raise HurrayArgumentError("hurray_url", _reason(exc)) from exc
        if url and not saves:
            # The worker pushes from its background writer, which only an engine that saves runs; the chunks a
            # request loaded are forwarded (A -> B -> C) alongside its saves.
            raise HurrayArgumentError(
                "hurray_url",
                f"kv_role {kv.kv_role!r} saves nothing, so nothing is pushed: hurray_url needs kv_role "
                '"kv_producer" (pushes the chunks it saves) or "kv_both" (also forwards the chunks a request loaded)',
            )
        replay = bool(getattr(vllm_config.cache_config, "use_replayssm", False))
        why = unsupported_cache(kv_cache_config, sliding_windows=True, replay_ssm=replay)
        if why is not None:
            raise HurrayArgumentError("kv_cache_groups", f"HurrayConnector cannot serve this model: {why}")
        layer_groups, windows = cache_groups(kv_cache_config)
        grouped = is_grouped(windows)
        states = sorted(set(state_groups(kv_cache_config).values()))
        specs = [g.kv_cache_spec for g in getattr(kv_cache_config, "kv_cache_groups", None) or []]
        # Without prefix caching a state group holds one block per request, sized to the model length:
        # its block size says nothing about chunks.
        specs = [x for x in specs if getattr(x, "mamba_cache_mode", "align") == "align"]
        sizes = {getattr(spec, "block_size", block_size) for spec in specs} | {block_size}
        if sizes != {block_size}:
            raise HurrayArgumentError(
                "kv_cache_groups", f"KV cache groups with block sizes {sorted(sizes)}: chunks need one block size"
            )
        tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        state_layout = None
        if states:
            why = split_states_refusal(vllm_config, tp)
            if why is not None:
                raise HurrayArgumentError("tensor_parallel_size", f"HurrayConnector {why}")
            try:
                state_layout = declared_layout(kv_cache_config, tp)
            except HurrayFormatError as exc:
                raise HurrayArgumentError("tensor_parallel_size", f"HurrayConnector: {exc}") from exc
        layout = unsupported_parallelism(vllm_config.parallel_config)
        if layout is not None:
            raise HurrayArgumentError(layout[0], f"HurrayConnector {layout[1]}")
        save_async = _flag(cfg, "hurray_save_async", True)
        # Tails need the chunk's own blocks alone to resume from: no sliding window, no recurrent state.
        tails = _flag(cfg, "hurray_tails", True) and not grouped and not states
        push_wait_s = _float(cfg, "hurray_push_wait_s", 5.0)
        if not 0 <= push_wait_s <= 3600:
            raise HurrayArgumentError("hurray_push_wait_s", f"expected 0 to 3600 seconds, got {push_wait_s}")
        window_chunks = str(cfg.get_from_extra_config("hurray_window_chunks", "every"))
        if window_chunks not in ("every", "last"):
            raise HurrayArgumentError("hurray_window_chunks", f"expected 'every' or 'last', got {window_chunks!r}")
        listen = _address(cfg, "hurray_listen", "HOST:PORT")
        if cfg.given("hurray_listen_transport") and listen is None:
            raise HurrayArgumentError("hurray_listen_transport", "a receiver's option: it needs hurray_listen")
        transport = str(cfg.get_from_extra_config("hurray_listen_transport", "tcp"))
        if transport not in CHANNELS:
            raise HurrayArgumentError(
                "hurray_listen_transport", f"expected one of {', '.join(CHANNELS)}, got {transport!r}"
            )
        if listen is not None:
            try:
                parse_listen(str(listen))
            except HurrayFormatError as exc:
                raise HurrayArgumentError("hurray_listen", _reason(exc)) from exc
        _check_store_dir(path, writes=saves or listen is not None)
        limits: dict[str, Any] = {}
        for key, arg, scale, low in (  # scale None: seconds, kept as a float; 1: a count, an integer
            ("hurray_listen_quota_mib", "quota_bytes", 1 << 20, 0.0),
            ("hurray_listen_min_free_mib", "min_free_bytes", 1 << 20, 0.0),
            ("hurray_listen_max_connections", "max_connections", 1, 1.0),
            # TCP reads each chunk into memory, NIXL into registered buffers: one bound for both.
            (
                "hurray_listen_max_memory_mib",
                "max_arena_bytes" if transport == "nixl" else "max_inflight_bytes",
                1 << 20,
                1.0,
            ),
            ("hurray_listen_timeout_s", "timeout", None, 0.001),
            ("hurray_listen_idle_timeout_s", "idle_timeout", None, 0.001),
        ):
            if cfg.given(key):
                if listen is None:  # as hurray_listen_tls_*: a limit of no receiver would be dropped unsaid
                    raise HurrayArgumentError(key, "a receiver's limit: it needs hurray_listen")
                value = _int(cfg, key, 0) if scale == 1 else _float(cfg, key, 0.0)
                # Seconds within the receiver's own bound, sizes that fit a 64-bit count: "inf" would otherwise
                # fail later (an OverflowError, or the receiver's refusal) without naming the option.
                high = MAX_TIMEOUT_S if scale is None else float(1 << 62) / scale
                if not low <= value < high:
                    raise HurrayArgumentError(key, f"must be at least {low:g} and below {high:g}, got {value:g}")
                limits[arg] = value if scale is None else int(value * scale)
                if arg == "quota_bytes" and limits[arg] < 1:  # a quota of 0 bytes refuses every chunk
                    raise HurrayArgumentError(
                        key, f"must be more than 0 (at least one byte), got {value:g}: unset it for no quota"
                    )
        verified_mib = _int(cfg, "hurray_verified_mib", DEFAULT_VERIFIED_BYTES >> 20)
        if verified_mib < 0:
            raise HurrayArgumentError("hurray_verified_mib", f"must be at least 0, got {verified_mib}")
        key_files = cfg.get_from_extra_config("hurray_key_file", None)
        if key_files is not None and not isinstance(key_files, (str, os.PathLike, list, tuple)):
            raise HurrayArgumentError("hurray_key_file", f"expected a path or a list of paths, got {key_files!r}")
        named = [key_files] if isinstance(key_files, (str, os.PathLike)) else list(key_files or ())
        if any(isinstance(p, (str, os.PathLike)) and _has_nul(p) for p in named):
            raise HurrayArgumentError("hurray_key_file", f"a path cannot hold a NUL byte, got {key_files!r}")
        keys = load_keys(key_files)  # read now: a missing or exposed key file stops the engine at start
        push_tls, listen_tls = _tls_options(cfg, url, listen, transport)
        _check_push_tls(push_tls)
        save_queue_mib = _int(cfg, "hurray_save_queue_mib", 1024)
        if save_queue_mib < 1:  # 0 would count every step's saves as a full queue and cut each push short
            raise HurrayArgumentError("hurray_save_queue_mib", f"must be at least 1, got {save_queue_mib}")
        verified_chunks = _int(cfg, "hurray_verified_chunks", 256)
        async_scheduling = bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))
        cfg.refuse_unknown()  # last: by now every option was asked for
        return cls(
            path=path,
            chunk_tokens=chunk,
            block_size=block_size,
            url=str(url) if url else None,
            url_channel=url_channel,
            loads=kv.kv_role in ("kv_consumer", "kv_both"),
            saves=saves,
            save_async=save_async,
            save_queue_bytes=save_queue_mib << 20,
            push_wait_s=push_wait_s,
            verified_chunks=verified_capacity(verified_chunks),
            verified_bytes=verified_mib << 20,
            listen=str(listen) if listen else None,
            listen_transport=transport,
            listen_limits=limits,
            layer_groups=layer_groups if grouped else {},
            group_windows=tuple(windows) if grouped else (),
            window_chunks=window_chunks,
            state_groups=tuple(states),
            state_mode=str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none") or "none") if states else "",
            state_layout=state_layout,
            tp=tp,
            async_loads=_async_loads(vllm_config, kv_cache_config),
            steps_in_flight=2 if async_scheduling else 1,
            worker_in_process=_worker_in_process(vllm_config),
            keys=keys,
            push_tls=push_tls,
            listen_tls=listen_tls,
            tails=tails,
        )
