"""Signed chunks: a fleet key, the MAC a chunk carries with it, and the check a keyed consumer runs.

The chunk digest (:mod:`.digest`) is a checksum: whoever can write a chunk
file or reach a receiver can compute it for KV of their choosing. With a
*fleet key* (a secret shared by the engines and receivers that trust each
other) every chunk also carries a MAC, and a keyed consumer refuses a chunk
without one, with a wrong one, or signed with a key it does not hold.

The MAC covers exactly what the digest covers (:func:`~.digest.digest_header`
and the page pools) and is bound to the chunk's namespace and file name, so
a chunk copied under another prefix's key (or another tensor-parallel
slice's) is refused too. Construction (``poly1305-hs256/v1``):

* a fresh random 16-byte nonce per signed chunk;
* a one-time key ``HMAC-SHA256(secret, label || nonce || u16le(len(ns)) || ns || u16le(len(name)) || name)``
  (namespace and name UTF-8, each after its byte length);
* the tag: Poly1305 under that one-time key over the covered bytes.

This is the MAC half of the ChaCha20-Poly1305 construction with an HMAC as
the key derivation; HMAC-SHA256 over the whole chunk would do as well but runs
at ~1.7 GB/s (SHA-NI) against Poly1305's ~10 GB/s, and a consumer verifies
every chunk it loads: checking a keyed chunk costs what checking its CRC-32C
costs (the MAC replaces the checksum on that path).

The stored value (``extra["hurray_vllm.chunk_mac"]``) is
``"poly1305-hs256/v1:<key id>:<nonce>:<tag>"`` in hex. The key id (16 hex
digits of ``HMAC-SHA256(secret, "hurray-vllm key id v1")``) names the key
without revealing it: a consumer picks the key of a ring by it, and tells a
chunk of another fleet (not damage, never quarantined) from a forged one.

Example:
    >>> keys = FleetKeys.from_secrets(b"0123456789abcdef0123456789abcdef")
    >>> keys.key_id  # doctest: +SKIP
    '5c1f...'
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..containers.stream import byte_view
from ..errors import HurrayArgumentError, HurrayFormatError
from ..kv.snapshot import KVSnapshot
from ..native.openssl import NativePoly1305, poly1305
from .digest import MAC_KEY, digest_header, digest_pools

__all__ = [
    "KEY_FILE_ENV",
    "MAC_KEY",
    "MAC_SCHEME",
    "MIN_KEY_BYTES",
    "MAX_KEY_FILE_BYTES",
    "BAD_MAC",
    "OTHER_KEY",
    "UNSIGNED",
    "ChunkMac",
    "FleetKeys",
    "load_keys",
    "sign_chunk",
    "begin_signature_check",
    "signing_secret",
    "check_signature",
    "parse_mac",
    "refusal_kind",
]

MAC_SCHEME = "poly1305-hs256/v1"
#: The environment variable naming key files (``os.pathsep``-separated; the first signs).
KEY_FILE_ENV = "HURRAY_VLLM_KEY_FILE"
MIN_KEY_BYTES = 32
#: The largest key file read: a secret and its whitespace (a base64 line of a 32-byte key is 45 bytes).
MAX_KEY_FILE_BYTES = 4096
#: The ``field`` of a refusal: the chunk carries no MAC.
UNSIGNED = "snapshot.mac.unsigned"
#: ... it is signed with a key the consumer does not hold (another fleet, a retired key): not damage.
OTHER_KEY = "snapshot.mac.key_id"
#: ... its MAC is wrong for its bytes, namespace and name: forged, moved or damaged.
BAD_MAC = "snapshot.mac"

_KEY_ID_LABEL = b"hurray-vllm key id v1"
_OTK_LABEL = b"hurray-vllm chunk mac v1\0"
_NONCE_BYTES = 16
#: What a key id looks like (:func:`_key_id`): anything else, from a peer or a file, names no key of ours.
_KEY_ID = re.compile(r"[0-9a-f]{16}")


def _key_id(secret: bytes) -> str:
    return hmac.new(secret, _KEY_ID_LABEL, hashlib.sha256).hexdigest()[:16]


@dataclass(frozen=True)
class FleetKeys:
    """A ring of fleet keys: chunks are signed with the first, accepted when signed with any.

    Rotation: put the new key first and keep the old one second until every
    writer signs with the new one and the old chunks are pruned
    (``hurray-vllm prune --key-file NEW`` deletes every chunk no key of that
    ring signed, whatever its size limit), then drop it. The secrets never appear in ``repr``.

    Attributes:
        secrets: The keys, each at least :data:`MIN_KEY_BYTES` bytes.
        ids: Their key ids (16 hex digits each), in the same order.
    """

    secrets: tuple[bytes, ...] = field(repr=False)
    ids: tuple[str, ...]

    @classmethod
    def from_secrets(cls, *secrets: bytes) -> FleetKeys:
        """A ring of ``secrets`` (the first signs).

        Raises:
            HurrayArgumentError: no secret, or one shorter than :data:`MIN_KEY_BYTES`.
        """
        if not secrets:
            raise HurrayArgumentError("hurray_key_file", "no key given")
        for s in secrets:
            if len(s) < MIN_KEY_BYTES:
                raise HurrayArgumentError(
                    "hurray_key_file", f"a fleet key must be at least {MIN_KEY_BYTES} bytes, this one has {len(s)}"
                )
        return cls(tuple(bytes(s) for s in secrets), tuple(_key_id(s) for s in secrets))

    @classmethod
    def from_files(cls, paths: Sequence[str | os.PathLike[str]]) -> FleetKeys:
        """A ring read from key files, in order; see :func:`load_keys`."""
        return cls.from_secrets(*(_read_key_file(Path(p)) for p in paths))

    @property
    def key_id(self) -> str:
        """The id of the signing key."""
        return self.ids[0]

    def tokens(self, purpose: str) -> tuple[str, ...]:
        """One bearer token per key for ``purpose``, the first key's first (hex HMAC-SHA256).

        Derived, so a token reveals nothing of the secret and one purpose's
        token is useless for another (the router's controls use
        ``"router-control"``).

        Example:
            >>> FleetKeys.from_secrets(b"k" * 32).tokens("router-control")[0][:16]
            '9f6b7968be0fad5d'
        """
        label = b"hurray-vllm/token/v1/" + purpose.encode()
        return tuple(hmac.new(s, label, hashlib.sha256).hexdigest() for s in self.secrets)

    def secret_for(self, key_id: str) -> bytes | None:
        """The secret whose id is ``key_id``, or ``None`` if the ring lacks it (or it is not a key id at all)."""
        if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
            # compare_digest raises TypeError for non-ASCII text: a peer's bytes must not get that far.
            return None
        for kid, secret in zip(self.ids, self.secrets, strict=True):
            if hmac.compare_digest(kid, key_id):
                return secret
        return None


def _read_key_file(path: Path) -> bytes:
    """The secret in the key file at ``path``: its bytes, whitespace at both ends stripped.

    A key file is text (the documented key is a base64 line: ``head -c 32 /dev/urandom | base64``), so a
    newline an editor adds is no part of the key. Raw binary bytes are taken as they are otherwise, but a raw
    key whose first or last bytes read as whitespace (1 in 22 of 32 random bytes) loses them: the refusal of
    a key short after stripping says so. Stripping only raw files of exactly 32 bytes instead would make the
    key of a 31-character text key with its newline, which every other reader strips: keys stay text.
    """
    try:
        # One open, and the checks on what it opened (fstat): checked by name and then opened by name, a link
        # swapped in between had a key others can read taken, and a FIFO swapped in hung the start. Non-blocking:
        # opening a FIFO waits for a writer otherwise. Links themselves are followed (secret mounts are links).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise HurrayArgumentError("hurray_key_file", f"{path} is not a regular file")
            if st.st_mode & 0o077:
                raise HurrayArgumentError(
                    "hurray_key_file",
                    f"{path} can be read or written by other users (mode {stat.S_IMODE(st.st_mode):04o}): "
                    f"run chmod 600 {path}",
                )
            secret = f.read(MAX_KEY_FILE_BYTES + 1)  # a key, not whatever large file was named
        if len(secret) > MAX_KEY_FILE_BYTES:
            raise HurrayArgumentError(
                "hurray_key_file", f"{path} is larger than {MAX_KEY_FILE_BYTES} bytes: not a key file"
            )
        stripped = secret.strip()
    except OSError as exc:
        raise HurrayArgumentError("hurray_key_file", f"cannot read key file {path}: {exc.strerror or exc}") from None
    if len(stripped) < MIN_KEY_BYTES:
        raise HurrayArgumentError(
            "hurray_key_file",
            f"{path} holds {len(stripped)} bytes once whitespace at its ends is stripped ({len(secret)} in the file); "
            f"a fleet key must be at least {MIN_KEY_BYTES}. A key file is text, such as a base64 line (raw binary "
            "bytes that read as whitespace at its ends are stripped too): make one with: "
            "head -c 32 /dev/urandom | base64 > KEYFILE; chmod 600 KEYFILE",
        )
    return stripped


def load_keys(spec: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None) -> FleetKeys | None:
    """The fleet keys named by ``spec``, else by ``$HURRAY_VLLM_KEY_FILE``; ``None`` when neither is set.

    ``spec``: a key file, several separated by ``os.pathsep`` (``:``), or a
    list of them; the first signs, all are accepted. A leading ``~`` is
    expanded (no shell did inside a JSON ``--kv-transfer-config``). A key
    file holds one secret of at least 32 bytes (surrounding whitespace is
    stripped, so a base64 line works) and must not be accessible to other
    users. ``$HURRAY_VLLM_KEY_FILE`` set but empty is refused as a setting
    naming no file, not taken for unset.

    Raises:
        HurrayArgumentError: a file is missing, unreadable, too short or readable by others
            (field ``hurray_key_file``).

    Example:
        >>> load_keys(None) is None or isinstance(load_keys(None), FleetKeys)
        True
    """
    where = "hurray_key_file"
    if spec is None:
        spec = os.environ.get(KEY_FILE_ENV)
        if spec is None:  # unset only: an empty value names no file, refused below as ":" is
            return None
        where = f"${KEY_FILE_ENV}"
    if isinstance(spec, (str, os.PathLike)):
        paths = [os.path.expanduser(p) for p in os.fspath(spec).split(os.pathsep) if p]
    else:
        if not all(isinstance(p, (str, os.PathLike)) for p in spec):
            raise HurrayArgumentError("hurray_key_file", f"expected paths, got {list(spec)!r}")
        paths = [os.path.expanduser(os.fspath(p)) for p in spec if os.fspath(p)]
    if not paths:
        # A setting made of separators only ("$NEW:$OLD" with both unset) must not quietly turn signing off:
        # the engine would accept unsigned and forged chunks.
        raise HurrayArgumentError(
            "hurray_key_file", f"{where} is set to {spec!r}, which names no key file; name one, or unset it for no keys"
        )
    return FleetKeys.from_files(paths)


class ChunkMac:
    """Incremental chunk MAC: Poly1305 under the one-time key of (secret, nonce, namespace, name).

    Feed it what a :class:`~.digest.ChunkDigest` is fed (the header bytes,
    then the page pools in :func:`~.digest.digest_tensors` order).
    """

    def __init__(self, secret: bytes, nonce: bytes, namespace: str, name: str) -> None:
        ns, nm = namespace.encode(), name.encode()
        label = _OTK_LABEL + nonce + len(ns).to_bytes(2, "little") + ns + len(nm).to_bytes(2, "little") + nm
        key = hmac.new(secret, label, hashlib.sha256).digest()
        # OpenSSL through ctypes where it can (the GIL released: the check overlaps the scheduler's reads),
        # else cryptography's Poly1305: the same tags, the same two methods.
        self._poly: Any = poly1305(key)
        if self._poly is None:
            try:
                from cryptography.hazmat.primitives.poly1305 import Poly1305
            except ImportError:  # pragma: no cover - cryptography comes with vLLM and the test extras
                raise HurrayArgumentError(
                    "hurray_key_file",
                    "signed chunks need OpenSSL 3's libcrypto or the cryptography package: "
                    "pip install 'hurray-vllm[security]'",
                ) from None
            self._poly = Poly1305(key)

    def update(self, data: bytes | memoryview) -> None:
        """Add ``data``'s bytes."""
        self._poly.update(data)

    def update_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Add the bytes of contiguous CPU ``tensors``, in order (one native call where it can)."""
        native = isinstance(self._poly, NativePoly1305) and all(t.is_cpu and t.is_contiguous() for t in tensors)
        if native and self._poly.update_tensors(tensors):
            return
        for t in tensors:
            if t.numel():
                self._poly.update(byte_view(t.reshape(-1).view(torch.uint8)))

    def tag(self) -> bytes:
        """The 16-byte tag (the MAC can take no more data afterwards)."""
        return bytes(self._poly.finalize())


def _header_mac(snap: KVSnapshot, secret: bytes, nonce: bytes, namespace: str, name: str) -> ChunkMac:
    """The chunk's MAC fed its header bytes: the page pools (:func:`~.digest.digest_pools`) come next."""
    m = ChunkMac(secret, nonce, namespace, name)
    m.update(digest_header(snap))
    return m


def _mac(snap: KVSnapshot, secret: bytes, nonce: bytes, namespace: str, name: str) -> bytes:
    m = _header_mac(snap, secret, nonce, namespace, name)
    m.update_tensors(digest_pools(snap))
    return m.tag()


def sign_chunk(snap: KVSnapshot, keys: FleetKeys, namespace: str, name: str) -> KVSnapshot:
    """``snap`` with its MAC under ``keys``' signing key, for the file ``name`` of ``namespace``.

    ``name`` is the chunk's file name in the store (:func:`~.keys.slice_key`:
    a tensor-parallel slice's includes its heads). The MAC does not cover
    the chunk digest (nor the digest the MAC), so the two can be added in
    either order.
    """
    nonce = os.urandom(_NONCE_BYTES)
    tag = _mac(snap, keys.secrets[0], nonce, namespace, name)
    return replace(snap, extra={**snap.extra, MAC_KEY: f"{MAC_SCHEME}:{keys.key_id}:{nonce.hex()}:{tag.hex()}"})


def parse_mac(value: Any) -> tuple[str, bytes, bytes]:
    """``(key id, nonce, tag)`` of a stored MAC value.

    Raises:
        HurrayFormatError: none stored (field :data:`UNSIGNED`), or not one this version writes (:data:`BAD_MAC`).
    """
    if value is None:
        raise HurrayFormatError(UNSIGNED, "chunk is not signed, and this consumer holds a fleet key")
    parts = value.split(":") if isinstance(value, str) else []
    try:
        # fullmatch, not int(.., 16): that takes other scripts' digits, which no key id holds.
        if len(parts) != 4 or parts[0] != MAC_SCHEME or not _KEY_ID.fullmatch(parts[1]):
            raise ValueError
        nonce, tag = bytes.fromhex(parts[2]), bytes.fromhex(parts[3])
        if len(nonce) != _NONCE_BYTES or len(tag) != 16:
            raise ValueError
    except ValueError:
        raise HurrayFormatError(BAD_MAC, f"chunk MAC {str(value)[:80]!r} is not a {MAC_SCHEME} MAC") from None
    return parts[1], nonce, tag


def check_signature(snap: KVSnapshot, keys: FleetKeys, namespace: str, name: str) -> None:
    """Raise :class:`HurrayFormatError` unless ``snap`` is signed by a key of ``keys`` for ``namespace``/``name``.

    A passing MAC also proves the bytes intact: a consumer need not check
    the chunk digest as well.

    Raises:
        HurrayFormatError: field :data:`UNSIGNED` (no MAC), :data:`OTHER_KEY` (signed with
            a key not in the ring: refuse, but it is not damage) or :data:`BAD_MAC`
            (forged, stored under another name, or damaged).
    """
    begin_signature_check(snap, keys, namespace, name)()


def signing_secret(snap: KVSnapshot, keys: FleetKeys) -> tuple[bytes, bytes, bytes]:
    """The secret of ``keys`` that ``snap``'s MAC names, with the MAC's nonce and tag: its header alone.

    What can be refused before a chunk's page pools are read (or, over NIXL, transferred).

    Raises:
        HurrayFormatError: :data:`UNSIGNED` (no MAC), :data:`OTHER_KEY` (a key not in ``keys``),
            :data:`BAD_MAC` (a malformed MAC).
    """
    key_id, nonce, tag = parse_mac(snap.extra.get(MAC_KEY))
    secret = keys.secret_for(key_id)
    if secret is None:
        raise HurrayFormatError(
            OTHER_KEY, f"chunk is signed with key {key_id}, which is not among this consumer's ({', '.join(keys.ids)})"
        )
    return secret, nonce, tag


def begin_signature_check(snap: KVSnapshot, keys: FleetKeys, namespace: str, name: str) -> Callable[[], None]:
    """:func:`check_signature` in two halves: the header now, the page pools in the callable returned.

    As :func:`~.digest.begin_digest_check`: with OpenSSL's Poly1305 the second
    half is one native call, which releases the GIL.

    Raises:
        HurrayFormatError: :data:`UNSIGNED` or :data:`OTHER_KEY` now; :data:`BAD_MAC` now for a
            malformed MAC, from the callable for one that does not match.
    """
    secret, nonce, tag = signing_secret(snap, keys)
    m = _header_mac(snap, secret, nonce, namespace, name)
    pools = digest_pools(snap)

    verdict: list[bool] = []  # the MAC takes its data once: a second call answers what the first found

    def pools_match() -> None:
        if not verdict:
            m.update_tensors(pools)
            verdict.append(hmac.compare_digest(m.tag(), tag))
        if not verdict[0]:
            raise HurrayFormatError(
                BAD_MAC, f"chunk MAC does not match its data, namespace and name {name!r} (forged, moved or damaged)"
            )

    return pools_match


def refusal_kind(exc: BaseException) -> str | None:
    """``"unsigned"``, ``"other_key"`` or ``"bad_mac"`` for a signature refusal; ``None`` for any other error."""
    kinds = {UNSIGNED: "unsigned", OTHER_KEY: "other_key", BAD_MAC: "bad_mac"}
    return kinds.get(getattr(exc, "field", None) or "")
