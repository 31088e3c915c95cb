"""Signed chunks (:mod:`hurray_vllm.chunks.signing`): key files, MACs bound to a name, keyed consumers' verdicts."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic import example_chunk

import hurray_vllm as hv
from hurray_vllm import KVSnapshot, transport
from hurray_vllm.app.cli import main
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.chunks import DirectoryStore, fsck, store_snapshot
from hurray_vllm.chunks.digest import digest_matches
from hurray_vllm.chunks.signing import (
    BAD_MAC,
    KEY_FILE_ENV,
    MAC_KEY,
    OTHER_KEY,
    UNSIGNED,
    ChunkMac,
    FleetKeys,
    check_signature,
    load_keys,
    refusal_kind,
    sign_chunk,
)
from hurray_vllm.chunks.verify import begin_check_data, check_data, verify_chunk

FUZZ_EXAMPLES = int(os.environ.get("HURRAY_FUZZ_EXAMPLES", "40"))
KEY_A = FleetKeys.from_secrets(b"a" * 32)
KEY_B = FleetKeys.from_secrets(b"b" * 40)


def _key_file(path: Path, secret: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(secret)
    path.chmod(mode)
    return path


def _refusal(snap: KVSnapshot, keys: FleetKeys, ns: str, name: str) -> str | None:
    try:
        check_signature(snap, keys, ns, name)
    except hv.HurrayFormatError as exc:
        return exc.field
    return None


def test_a_signed_chunk_passes_for_its_name_only_and_under_its_keys_only() -> None:
    ns, key, chunk = example_chunk()
    signed = sign_chunk(chunk, KEY_A, ns, key)
    assert signed.extra[MAC_KEY].split(":")[1] == KEY_A.key_id
    assert digest_matches(signed)  # the MAC is outside what the digest covers, and vice versa
    assert _refusal(signed, KEY_A, ns, key) is None
    assert _refusal(chunk, KEY_A, ns, key) == UNSIGNED
    assert _refusal(signed, KEY_B, ns, key) == OTHER_KEY
    # Copied under another chunk's key, another slice's name or into another namespace.
    for where in ((ns, "ab" * 8), (ns, f"{key}.h0-1"), ("0" * 16, key)):
        assert _refusal(signed, KEY_A, *where) == BAD_MAC
    # A fresh nonce per signature: the same chunk signed twice carries two MACs, both valid.
    again = sign_chunk(chunk, KEY_A, ns, key)
    assert again.extra[MAC_KEY] != signed.extra[MAC_KEY] and _refusal(again, KEY_A, ns, key) is None


def test_every_part_the_digest_covers_is_covered_by_the_mac() -> None:
    ns, key, chunk = example_chunk()
    signed = sign_chunk(chunk, KEY_A, ns, key)
    pool = signed.keys[0].page_pool.clone()
    pool.view(torch.uint8).view(-1)[7] ^= 1
    forged = [
        replace(signed, keys=[replace(signed.keys[0], page_pool=pool), *signed.keys[1:]]),  # a page's bits
        replace(signed, token_ids=[[t + 1 for t in signed.token_ids[0]]]),  # the tokens it claims
        replace(signed, extra={**signed.extra, "note": "added"}),  # metadata
    ]
    for bad in forged:
        assert _refusal(bad, KEY_A, ns, key) == BAD_MAC
    # A well-formed forgery: the right checksum (recomputed by whoever wrote the file) but no key.
    mac = signed.extra[MAC_KEY].split(":")
    mac[3] = "00" * 16
    assert _refusal(replace(signed, extra={**signed.extra, MAC_KEY: ":".join(mac)}), KEY_A, ns, key) == BAD_MAC
    for junk in ("", "x", "poly1305-hs256/v1:zz:00:00", 42):
        assert _refusal(replace(signed, extra={**signed.extra, MAC_KEY: junk}), KEY_A, ns, key) == BAD_MAC


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(st.data())
def test_any_flipped_bit_of_a_signed_chunk_file_is_refused(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """Property: a signed chunk file with one bit flipped anywhere is refused, or reads as the very chunk signed.

    (A few header bits do not change what is read: the file's minor version, flags an importer ignores.)
    """
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path_factory.mktemp("flip"))
    store.put(ns, key, sign_chunk(chunk, KEY_A, ns, key))
    path = store.path(ns, key)
    raw = bytearray(path.read_bytes())
    at = data.draw(st.integers(0, len(raw) - 1), label="byte")
    raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    path.write_bytes(bytes(raw))
    try:
        got = store.get(ns, key)
        check_data(got, KEY_A, ns, key)
    except hv.HurrayFormatError:
        return
    want = sign_chunk(chunk, KEY_A, ns, key)
    assert got.token_ids == want.token_ids and got.seq_lens == want.seq_lens
    assert {k: v for k, v in got.extra.items() if k != MAC_KEY} == {k: v for k, v in want.extra.items() if k != MAC_KEY}
    for a, b in zip(got.tensors(), want.tensors(), strict=True):
        assert a.descriptor(device_tag=0) == b.descriptor(device_tag=0)
        assert torch.equal(a.page_pool.view(torch.uint8), b.page_pool.view(torch.uint8))
        assert torch.equal(a.block_table, b.block_table) and torch.equal(a.seq_ptr, b.seq_ptr)


def test_key_rotation_signs_with_the_first_key_and_accepts_every_one() -> None:
    ns, key, chunk = example_chunk()
    ring = FleetKeys.from_secrets(b"n" * 32, b"a" * 32)  # new first, the old one still accepted
    assert ring.ids[1] == KEY_A.key_id
    assert _refusal(sign_chunk(chunk, KEY_A, ns, key), ring, ns, key) is None
    new = sign_chunk(chunk, ring, ns, key)
    assert new.extra[MAC_KEY].split(":")[1] == ring.key_id
    assert _refusal(new, KEY_A, ns, key) == OTHER_KEY  # a reader that knows only the old key


def test_key_files_are_checked_like_ssh_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = _key_file(tmp_path / "fleet.key", b"  " + b"k" * 32 + b"\n")  # surrounding whitespace is not key
    assert load_keys(good) == FleetKeys.from_secrets(b"k" * 32)
    assert "k" * 8 not in repr(load_keys(good))  # never printed
    with pytest.raises(hv.HurrayArgumentError, match="chmod 600"):
        load_keys(_key_file(tmp_path / "open.key", b"k" * 32, 0o640))
    with pytest.raises(hv.HurrayArgumentError, match="at least 32"):
        load_keys(_key_file(tmp_path / "short.key", b"k" * 31 + b"   "))
    with pytest.raises(hv.HurrayArgumentError, match="cannot read"):
        load_keys(tmp_path / "missing.key")
    with pytest.raises(hv.HurrayArgumentError, match="not a key file"):  # read no further than a key's size
        load_keys(_key_file(tmp_path / "huge.key", b"k" * 5000))
    old = _key_file(tmp_path / "old.key", b"o" * 32)
    assert load_keys(f"{good}{os.pathsep}{old}") == load_keys([good, old])
    assert len(load_keys([good, old]).ids) == 2  # type: ignore[union-attr]
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    assert load_keys() is None
    monkeypatch.setenv(KEY_FILE_ENV, str(good))
    assert load_keys() == FleetKeys.from_secrets(b"k" * 32)
    # A setting that names no file ("$NEW:$OLD" with both unset) must not turn signing off.
    for nothing in ("", os.pathsep, os.pathsep * 2, [], [""]):
        with pytest.raises(hv.HurrayArgumentError, match="names no key file"):
            load_keys(nothing)  # type: ignore[arg-type]
    monkeypatch.setenv(KEY_FILE_ENV, os.pathsep)
    with pytest.raises(hv.HurrayArgumentError, match="names no key file"):
        load_keys()
    # Found by a review: an empty variable was taken for an unset one, quietly turning signing off where ":" is
    # refused. Only an unset variable means no keys.
    monkeypatch.setenv(KEY_FILE_ENV, "")
    with pytest.raises(hv.HurrayArgumentError, match=r"\$HURRAY_VLLM_KEY_FILE is set to '', which names no key file"):
        load_keys()
    with pytest.raises(hv.HurrayArgumentError, match="expected paths"):
        load_keys([1])  # type: ignore[list-item]


def test_a_key_file_short_once_stripped_says_whitespace_is_stripped_and_how_to_make_one(tmp_path: Path) -> None:
    """Found by a review: a raw 32-byte key whose first or last byte reads as whitespace (1 in 22 keys from
    /dev/urandom) was refused as "holds 31 bytes", with no word of why. Key files are text (the documented
    key is a base64 line; surrounding whitespace is stripped): the refusal now says that, and how to make one."""
    for raw in (b" " + b"k" * 31, b"k" * 31 + b"\n", b"\t" + b"k" * 30 + b"\r"):
        path = _key_file(tmp_path / "raw.key", raw)
        with pytest.raises(hv.HurrayArgumentError, match="at least 32") as err:
            load_keys(path)
        msg = str(err.value)
        assert err.value.field == "hurray_key_file" and f"{len(raw.strip())} bytes" in msg and "32 in the file" in msg
        assert "whitespace at its ends is stripped" in msg and "base64" in msg and "head -c 32 /dev/urandom" in msg


def test_verify_chunk_checks_the_mac_under_the_namespace_it_resolves() -> None:
    """Found by a review: verify_chunk with keys and no namespace checked the MAC against namespace "", not the
    fingerprint's own it had resolved (and checked the chunk against): a good signed chunk was refused as
    snapshot.mac, which a consumer counts as damage. Keys without the chunk's name are the caller's error."""
    ns, key, chunk = example_chunk()
    assert chunk.fingerprint is not None
    signed, tokens = sign_chunk(chunk, KEY_A, ns, key), list(chunk.token_ids[0])
    verify_chunk(signed, chunk.fingerprint, tokens, keys=KEY_A, namespace=ns, name=key)
    verify_chunk(signed, chunk.fingerprint, tokens, keys=KEY_A, name=key)  # the namespace: the fingerprint's own
    with pytest.raises(hv.HurrayFormatError) as refused:
        verify_chunk(signed, chunk.fingerprint, tokens, keys=KEY_A, name="a1" * 8)
    assert refused.value.field == BAD_MAC  # under another name: still refused
    with pytest.raises(hv.HurrayArgumentError, match="name=") as err:
        verify_chunk(signed, chunk.fingerprint, tokens, keys=KEY_A)
    assert err.value.field == "name"
    verify_chunk(signed, chunk.fingerprint, tokens, keys=KEY_A, digest=False)  # no MAC checked: no name needed
    for where, field in (((ns, ""), "name"), (("", key), "namespace")):
        with pytest.raises(hv.HurrayArgumentError) as err:
            check_data(signed, KEY_A, *where)
        assert err.value.field == field


def test_a_key_file_under_home_is_found_with_a_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review: no shell expands "~" inside a JSON --kv-transfer-config, and load_keys did not either."""
    monkeypatch.setenv("HOME", str(tmp_path))
    _key_file(tmp_path / "new.key", b"n" * 32)
    _key_file(tmp_path / "old.key", b"o" * 32)
    ring = FleetKeys.from_secrets(b"n" * 32, b"o" * 32)
    assert load_keys(f"~/new.key{os.pathsep}~/old.key") == ring  # each entry of a list, not only the first
    assert load_keys(["~/new.key", Path("~/old.key")]) == ring
    monkeypatch.setenv(KEY_FILE_ENV, f"~/new.key{os.pathsep}~/old.key")
    assert load_keys() == ring


def test_fsck_with_keys_moves_forgeries_aside_and_lists_other_fleets_chunks(tmp_path: Path) -> None:
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path)
    snap = spec_example_snapshot()
    assert store_snapshot(store, snap, 4, keys=KEY_A) == 1
    store.put(ns, "a1" * 8, chunk)  # unsigned
    store.put(ns, "a2" * 8, sign_chunk(chunk, KEY_B, ns, "a2" * 8))  # another fleet's
    store.put(ns, "a3" * 8, sign_chunk(chunk, KEY_A, ns, key))  # a copy under another key
    report = fsck(store, keys=KEY_A, quarantine=True)
    assert report.good == 1 and not report.clean
    assert sorted(Path(p).name for p, _ in report.foreign) == ["a1" * 8 + ".hrry", "a2" * 8 + ".hrry"]
    assert [Path(p).name for p, _ in report.damaged] == ["a3" * 8 + ".hrry"] and len(report.moved) == 1
    assert store.has(ns, "a1" * 8) and store.has(ns, "a2" * 8) and not store.has(ns, "a3" * 8)
    assert fsck(store).clean  # without a key all are good chunks


def test_cli_validate_and_fsck_take_key_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ns, key, chunk = example_chunk()
    kf = str(_key_file(tmp_path / "a.key", b"a" * 32))
    store = DirectoryStore(tmp_path / "store")
    store.put(ns, key, sign_chunk(chunk, KEY_A, ns, key))
    store.put(ns, "a1" * 8, chunk)
    assert main(["validate", str(store.path(ns, key)), "--key-file", kf]) == 0
    assert main(["validate", str(store.path(ns, "a1" * 8)), "--key-file", kf]) == 1
    assert UNSIGNED in capsys.readouterr().out
    assert main(["validate", str(store.path(ns, "a1" * 8))]) == 0  # no key: the checksum only
    loose = tmp_path / "loose.hrry"
    loose.write_bytes(store.path(ns, key).read_bytes())
    assert main(["validate", str(loose), "--key-file", kf]) == 2  # no store name, nothing to bind the MAC to
    assert main(["fsck", str(store.root), "--key-file", kf]) == 1
    assert "not ours" in capsys.readouterr().out
    _key_file(tmp_path / "a.key", b"a" * 32, 0o644)
    assert main(["fsck", str(store.root), "--key-file", kf]) == 2
    assert "chmod 600" in capsys.readouterr().err


@pytest.mark.parametrize("channel", transport.CHANNELS)
def test_a_keyed_receiver_stores_only_chunks_signed_for_their_name(channel: str, tmp_path: Path) -> None:
    from conftest import require

    if channel == "nixl":
        require("nixl_cu12")
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path)
    with transport.receiver_for(channel, "127.0.0.1", 0, store, keys=KEY_A).start() as r:
        url = f"{channel}://127.0.0.1:{r.address[1]}"
        transport.send_chunks(url, [(ns, key, sign_chunk(chunk, KEY_A, ns, key))], keys=KEY_A)
        assert store.has(ns, key)
        for name, snap, why in (
            ("a1" * 8, chunk, UNSIGNED),
            ("a2" * 8, sign_chunk(chunk, KEY_B, ns, "a2" * 8), OTHER_KEY),
            ("a3" * 8, sign_chunk(chunk, KEY_A, ns, key), BAD_MAC),  # replayed under another prefix's key
        ):
            with pytest.raises(hv.HurrayFormatError, match="refused") as info:
                transport.send_chunks(url, [(ns, name, snap)], keys=KEY_A)
            assert why in str(info.value) and not store.has(ns, name)
        assert r.received == 1 and r.refused == 3


def test_refusal_kinds_name_only_signature_refusals() -> None:
    assert refusal_kind(hv.HurrayFormatError(UNSIGNED, "x")) == "unsigned"
    assert refusal_kind(hv.HurrayFormatError(OTHER_KEY, "x")) == "other_key"
    assert refusal_kind(hv.HurrayFormatError(BAD_MAC, "x")) == "bad_mac"
    assert refusal_kind(hv.HurrayFormatError("snapshot.digest", "x")) is None
    assert refusal_kind(ValueError()) is None


def test_prune_with_keys_deletes_the_chunks_no_key_of_the_ring_signed_first(tmp_path: Path) -> None:
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path)
    store.put(ns, key, sign_chunk(chunk, KEY_A, ns, key))
    store.put(ns, "a1" * 8, chunk)  # unsigned
    store.put(ns, "a2" * 8, sign_chunk(chunk, KEY_B, ns, "a2" * 8))  # another fleet's
    (tmp_path / ns / ("a3" * 8 + ".hrry")).write_bytes(b"not a chunk")
    report = store.prune(1 << 40, keys=KEY_A, dry_run=True)
    assert report.foreign_removed == 3 and report.chunks_kept == 1 and store.has(ns, "a1" * 8)
    assert store.prune(1 << 40).chunks_removed == 0  # without keys every chunk is one to keep
    ring = FleetKeys.from_secrets(b"a" * 32, b"b" * 40)
    assert store.prune(1 << 40, keys=ring).foreign_removed == 2
    assert store.has(ns, key) and store.has(ns, "a2" * 8) and not store.has(ns, "a1" * 8)
    kf = str(_key_file(tmp_path.parent / "prune.key", b"a" * 32))
    assert main(["prune", str(tmp_path), "--max-size", "1T", "--key-file", kf, "-q"]) == 0
    assert store.has(ns, key) and not store.has(ns, "a2" * 8)


def test_prune_with_keys_judges_each_file_of_a_chunk_alone(tmp_path: Path) -> None:
    """A chunk stored whole (signed) and as an unsigned slice (another TP degree's engine): the slice goes, the
    signed file stays; counts are of files."""
    ns, key, chunk = example_chunk()
    store = DirectoryStore(tmp_path)
    store.put(ns, key, sign_chunk(chunk, KEY_A, ns, key))
    slice_name = f"{key}.h0-1"
    store.put(ns, slice_name, chunk)  # unsigned: bytes that need not be a real slice for prune's judgment
    report = store.prune(1 << 40, keys=KEY_A)
    assert (report.foreign_removed, report.chunks_removed, report.chunks_kept) == (1, 1, 1)
    assert store.has(ns, key) and not store.has(ns, slice_name)
    report = store.prune(0)  # every file goes now: the counts stay whole numbers of files
    assert (report.chunks_removed, report.chunks_kept) == (1, 0)


def test_chunk_macs_are_the_same_with_and_without_openssl(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk signed through one path verifies through the other: the fallback is not another format."""
    from hurray_vllm.native import openssl

    ns, key, snap = example_chunk()
    signed = sign_chunk(snap, KEY_A, ns, key)
    monkeypatch.setattr(openssl, "_state", {"lib": None, "reason": "off for this test"})
    assert openssl.poly1305(b"k" * 32) is None
    check_signature(signed, KEY_A, ns, key)  # cryptography's Poly1305 accepts OpenSSL's tag
    again = sign_chunk(snap, KEY_A, ns, key)
    monkeypatch.undo()
    check_signature(again, KEY_A, ns, key)
    mac = str(again.extra[MAC_KEY])
    forged = mac[:-1] + ("1" if mac[-1] == "0" else "0")
    with pytest.raises(hv.HurrayFormatError):
        check_signature(replace(again, extra={**again.extra, MAC_KEY: forged}), KEY_A, ns, key)


def test_the_data_check_in_two_halves_refuses_what_check_data_refuses() -> None:
    """begin_check_data: a missing or foreign digest or MAC raises at once, damaged pools from the second half."""
    ns, key, chunk = example_chunk()
    signed = sign_chunk(chunk, KEY_A, ns, key)
    begin_check_data(chunk)()
    begin_check_data(signed, KEY_A, ns, key)()
    for snap, keys, field in (
        (replace(chunk, extra={}), None, "snapshot.digest"),
        (chunk, KEY_A, UNSIGNED),
        (signed, KEY_B, OTHER_KEY),
    ):
        with pytest.raises(hv.HurrayFormatError) as info:
            begin_check_data(snap, keys, ns, key)
        assert info.value.field == field
    pool = chunk.keys[0].page_pool + 1
    for snap, keys, field in (
        (replace(chunk, keys=(replace(chunk.keys[0], page_pool=pool), *chunk.keys[1:])), None, "snapshot.digest"),
        (replace(signed, keys=(replace(signed.keys[0], page_pool=pool), *signed.keys[1:])), KEY_A, BAD_MAC),
    ):
        rest = begin_check_data(snap, keys, ns, key)  # the header is intact: no error yet
        with pytest.raises(hv.HurrayFormatError) as info:
            rest()
        assert info.value.field == field


def test_a_keyed_nixl_receiver_stores_the_bytes_it_authenticated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The landing slab stays registered for remote writes: a WRITE landing after the MAC check used to be
    stored unauthenticated. The receiver now checks and writes a private copy; here the slab is changed
    between the check and the file write, as a late WRITE would."""
    from conftest import require

    require("nixl_cu12")
    from hurray_vllm.transport.nixl import receiver as nixl_receiver

    ns, key, chunk = example_chunk()
    slabs: list[list[torch.Tensor]] = []
    assemble = nixl_receiver.assemble_offer

    def remember_slab(offer, views):  # type: ignore[no-untyped-def]
        if not slabs:
            slabs.append(views)  # the first call gets the registered landing views
        return assemble(offer, views)

    monkeypatch.setattr(nixl_receiver, "assemble_offer", remember_slab)
    store = DirectoryStore(tmp_path)
    put = DirectoryStore.put

    def late_write(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        for v in slabs[0]:
            v.view(torch.uint8).reshape(-1)[:1] ^= 0xFF
        return put(self, *args, **kwargs)

    monkeypatch.setattr(DirectoryStore, "put", late_write)
    with transport.receiver_for("nixl", "127.0.0.1", 0, store, keys=KEY_A).start() as r:
        url = f"nixl://127.0.0.1:{r.address[1]}"
        transport.send_chunks(url, [(ns, key, sign_chunk(chunk, KEY_A, ns, key))], keys=KEY_A)
    assert slabs and store.has(ns, key)
    check_signature(store.get(ns, key), KEY_A, ns, key)  # what was stored is what was authenticated


def test_the_one_time_key_is_derived_as_docs_connector_md_writes_it() -> None:
    """An independent verifier built from the documented construction computes the same tags (the docs once left
    out the two length prefixes, and a verifier written from them failed every chunk)."""
    import hashlib
    import hmac

    from cryptography.hazmat.primitives.poly1305 import Poly1305

    secret, nonce, ns, name = bytes(range(32)), bytes(range(100, 116)), "llama-ns", "ab" * 32
    label = b"hurray-vllm chunk mac v1\0"  # 25 bytes, as the docs say
    assert len(label) == 25
    u16 = lambda b: len(b).to_bytes(2, "little")  # noqa: E731
    otk = hmac.new(secret, label + nonce + u16(ns.encode()) + ns.encode() + u16(name.encode()) + name.encode(),
                   hashlib.sha256).digest()  # fmt: skip
    data = os.urandom(1000)
    m = ChunkMac(secret, nonce, ns, name)
    m.update(data)
    assert m.tag() == Poly1305.generate_tag(otk, data)


def test_the_key_file_checked_is_the_one_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mode was checked by name (os.stat) and the file then opened by name: a link swapped in between had a
    key others can read taken. The checks now look at what was opened; os.stat answering for another file (the
    swap, made deterministic) changes nothing."""
    good = _key_file(tmp_path / "good.key", b"g" * 44)
    bad = _key_file(tmp_path / "bad.key", b"b" * 44, 0o644)
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(good if str(p) == str(bad) else p, *a, **k))
    with pytest.raises(hv.HurrayArgumentError, match="chmod 600") as err:
        load_keys(bad)
    assert err.value.field == "hurray_key_file"


def test_a_fifo_named_as_the_key_file_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    """open() of a FIFO waits for a writer; the file is opened before it is checked now, so that open must not
    block (before, a FIFO swapped in between the check and the open hung the engine's start)."""
    import threading

    fifo = tmp_path / "fleet.key"
    os.mkfifo(fifo, 0o600)
    out: list[BaseException] = []

    def load() -> None:
        try:
            load_keys(fifo)
        except hv.HurrayArgumentError as exc:
            out.append(exc)

    t = threading.Thread(target=load)
    t.daemon = True
    t.start()
    t.join(10)
    assert not t.is_alive(), "load_keys waited on a FIFO"
    assert out and "not a regular file" in str(out[0])
