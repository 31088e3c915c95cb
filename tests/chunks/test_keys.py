"""Chunk keys of a snapshot's requests: plain, under their own seed (LoRA, ``cache_salt``), or none (media)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import hurray_vllm as hv
from hurray_vllm.chunks.keys import KEY_SEEDS, chunk_keys, chunks_of, key_seed, namespace_of
from hurray_vllm.chunks.store import DirectoryStore, store_snapshot

CHUNK = 4  # the example's pages of 4 tokens: sequence "a" (6 tokens) has one whole chunk


def _batch(seeds: dict[str, object] | None) -> hv.KVSnapshot:
    from hurray_vllm.app.demo import spec_example_snapshot

    base = spec_example_snapshot(num_layers=2)
    snap = base.select([0, 0, 0])  # three requests with the same tokens
    snap = replace(
        snap,
        request_ids=("plain", "salted", "image"),
        fingerprint=hv.ModelFingerprint("LlamaForCausalLM", 2, base.tensors()[0].num_heads, 8, "float16"),
    )
    return replace(snap, extra={KEY_SEEDS: seeds}) if seeds is not None else snap


def test_each_request_is_keyed_as_the_connector_keys_it() -> None:
    snap = _batch({})
    ns = namespace_of(snap.fingerprint)  # type: ignore[arg-type]
    salted = key_seed(ns, cache_salt="tenant-a")
    snap = replace(snap, extra={KEY_SEEDS: {"salted": salted, "image": None}})
    tokens = list(snap.token_ids[0][: snap.seq_lens[0]])
    got = [(chunk.request_ids, key) for key, chunk in chunks_of(snap, CHUNK)]
    assert got == [
        (("plain",), chunk_keys(tokens, CHUNK, ns)[0]),
        (("salted",), chunk_keys(tokens, CHUNK, salted)[0]),  # its own key; the request with media has none
    ]
    assert all(KEY_SEEDS not in chunk.extra for _, chunk in chunks_of(snap, CHUNK))  # the batch's, not a chunk's


def test_the_seeds_survive_files_and_selection(tmp_path: Path) -> None:
    snap = _batch({})
    salted = key_seed(namespace_of(snap.fingerprint), cache_salt="t")  # type: ignore[arg-type]
    snap = replace(snap, extra={KEY_SEEDS: {"salted": salted, "image": None}})
    hv.save(snap, tmp_path / "s.hrry")
    back = hv.load(tmp_path / "s.hrry")
    assert [k for k, _ in chunks_of(back, CHUNK)] == [k for k, _ in chunks_of(snap, CHUNK)]
    only = back.select([1])  # "salted" alone keeps its seed (by request id, not position)
    assert [k for k, _ in chunks_of(only, CHUNK)] == [k for k, _ in chunks_of(snap, CHUNK)][1:]
    store = DirectoryStore(tmp_path / "store")
    assert store_snapshot(store, back, CHUNK, tails=False) == 2


@pytest.mark.parametrize("seeds", [["x"], {"salted": 3}, {"salted": ""}, {"salted": "x" * 300}])
def test_malformed_seeds_name_the_field(seeds: object) -> None:
    with pytest.raises(hv.HurrayFormatError) as err:
        chunks_of(_batch(seeds), CHUNK)  # type: ignore[arg-type]
    assert err.value.field == f"snapshot.extra.{KEY_SEEDS}"


@pytest.mark.parametrize("size", [0, -4, 6, 4.0, True])
def test_a_chunk_size_that_cannot_be_is_an_argument_error(size: object, tmp_path: Path) -> None:
    """0 divided by zero, -4 wrote a file under the key of a real 4-token chunk, 6 (pages of 4) was data's fault."""
    snap = _batch(None)
    with pytest.raises(hv.HurrayArgumentError) as exc:
        chunks_of(snap, size)  # type: ignore[arg-type]
    assert exc.value.field == "chunk_tokens"
    with pytest.raises(hv.HurrayArgumentError):
        store_snapshot(DirectoryStore(tmp_path), snap, size)  # type: ignore[arg-type]
    assert not list(tmp_path.rglob("*.hrry"))
    with pytest.raises(hv.HurrayArgumentError):
        chunk_keys([1, 2, 3], 0, "ns")
