"""What a chunk file must hold beyond intact bytes: its tokens' ids, its own model's namespace, and a real directory.

Each of these files passed the checks before (a digest over what it holds is
easy to compute): one without token ids made every consumer raise an
``IndexError``, one of a model without a weights digest was loaded by an
engine of the same architecture whose weights have one, and a namespace
directory replaced by a symbolic link had chunks read from and written to
wherever it pointed.
"""

from __future__ import annotations

import errno
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

import hurray_vllm as hv
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.chunks import DirectoryStore, fsck
from hurray_vllm.chunks.digest import DIGEST_KEY, chunk_digest
from hurray_vllm.chunks.keys import chunks_of, namespace_of
from hurray_vllm.chunks.verify import verify_chunk


def _chunk() -> tuple[str, hv.KVSnapshot]:
    ((key, chunk),) = chunks_of(spec_example_snapshot(), 4)
    assert chunk.fingerprint is not None
    return key, chunk


def _redigested(snap: hv.KVSnapshot) -> hv.KVSnapshot:
    """``snap`` with a digest of what it holds now: intact bytes, whatever they claim."""
    return replace(snap, extra={**snap.extra, DIGEST_KEY: chunk_digest(snap)})


def test_a_chunk_without_token_ids_is_refused_as_damage_not_an_index_error(tmp_path: Path) -> None:
    key, c = _chunk()
    assert c.fingerprint is not None
    bad = _redigested(replace(c, token_ids=()))
    ns, store = namespace_of(c.fingerprint), DirectoryStore(tmp_path)
    store.put(ns, key, bad)
    got = store.get(ns, key)
    assert got.token_ids == () and got.num_seqs == 1  # the loader takes it: token ids are optional in a snapshot
    with pytest.raises(hv.HurrayFormatError) as err:
        verify_chunk(got, c.fingerprint, list(c.token_ids[0]))
    assert err.value.field == "snapshot.token_ids"
    report = fsck(store, quarantine=True)
    assert report.good == 0 and [why for _, why in report.damaged] == [str(err.value)]
    assert report.moved == [str(store.path(ns, key)) + ".bad"]


def test_a_chunk_carrying_more_token_ids_than_its_kv_is_refused() -> None:
    """A chunk holds the ids of its tokens and no more: a consumer checks exactly those against its key."""
    _, c = _chunk()
    assert c.fingerprint is not None
    tokens = list(c.token_ids[0])
    longer = _redigested(replace(c, token_ids=((*tokens, 7),)))
    with pytest.raises(hv.HurrayFormatError) as err:
        verify_chunk(longer, c.fingerprint, tokens)
    assert err.value.field == "snapshot.token_ids"


@pytest.mark.parametrize("whose", ["producer", "consumer"])
def test_a_chunk_of_a_model_with_another_or_no_weights_digest_is_refused(tmp_path: Path, whose: str) -> None:
    """The fingerprints match when only one side has a weights digest: the chunk's namespace tells them apart.

    ``producer``: the chunk's engine had no digest, the consumer's has one;
    ``consumer``: the other way round. Either file was copied into the
    consumer's namespace directory.
    """
    key, c = _chunk()
    assert c.fingerprint is not None
    with_digest = replace(c.fingerprint, weights_digest="d" * 32)
    chunk_fp, consumer_fp = (c.fingerprint, with_digest) if whose == "producer" else (with_digest, c.fingerprint)
    chunk = _redigested(replace(c, fingerprint=chunk_fp))
    assert not chunk_fp.mismatches(consumer_fp)  # what verify_chunk compared before
    ns, store = namespace_of(consumer_fp), DirectoryStore(tmp_path)
    assert namespace_of(chunk_fp) != ns
    store.put(ns, key, chunk)
    got, tokens = store.get(ns, key), list(c.token_ids[0])
    for namespace in ("", ns):  # the scheduler passes none (its model's), the worker the directory it read
        with pytest.raises(hv.HurrayFormatError, match="another model") as err:
            verify_chunk(got, consumer_fp, tokens, namespace=namespace)
        assert err.value.field == "snapshot.fingerprint"  # another model's: left in place by a consumer
    verify_chunk(got, chunk_fp, tokens)  # in its own model's directory it is fine
    assert [Path(p).name for p, _ in fsck(store).damaged] == [f"{key}.hrry"]  # as fsck has always said


def test_a_namespace_directory_that_is_a_symbolic_link_is_neither_read_nor_written_through(tmp_path: Path) -> None:
    key, c = _chunk()
    assert c.fingerprint is not None
    ns = namespace_of(c.fingerprint)
    outside = tmp_path / "e15e"  # a namespace's name: the store refuses others
    DirectoryStore(outside.parent).put(outside.name, key, c)  # a chunk file outside the store
    store = DirectoryStore(tmp_path / "store")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / ns).symlink_to(outside, target_is_directory=True)
    assert not store.has(ns, key)  # a link in place of the namespace holds nothing: get refuses it too
    with ThreadPoolExecutor(1) as pool:
        for read in (lambda: store.get(ns, key), lambda: store.reader(ns, [key], pool.submit).get(key)):
            with pytest.raises(OSError) as err:
                read()
            assert err.value.errno == errno.ELOOP and "symbolic link" in str(err.value)
    before = sorted(p.name for p in outside.iterdir())
    with pytest.raises(OSError) as err:
        store.put(ns, "ab" * 16, c)
    assert err.value.errno == errno.ELOOP
    assert sorted(p.name for p in outside.iterdir()) == before  # nothing written there, not even a temp file
    # A missing namespace is still a missing chunk, and a put still makes its directory.
    other = DirectoryStore(tmp_path / "fresh")
    with pytest.raises(hv.HurrayFormatError) as missing:
        other.get(ns, key)
    assert missing.value.field == "store"
    assert other.put(ns, key, c) and other.get(ns, key).token_ids == c.token_ids
