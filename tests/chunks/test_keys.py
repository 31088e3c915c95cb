"""Chunk keys of a snapshot's requests: plain, under their own seed (LoRA, ``cache_salt``), or none (media)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import hurray_vllm as hv
from hurray_vllm.chunks.keys import KEY_SEEDS, chunk_keys, chunks_of, key_seed, namespace_of, tail_keys
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


def _utf8_key_prompt(ns: str) -> tuple[list[int], str]:
    """A prompt whose first chunk key's 16 raw bytes are valid UTF-8 (about 1 key in 12,000), and that string."""
    for i in range(10**6):
        prompt = [1000 + i, 7, 8, 9]
        key = chunk_keys(prompt, CHUNK, ns)[0]
        try:
            return prompt, bytes.fromhex(key).decode()
        except UnicodeDecodeError:
            pass
    raise AssertionError("no such key")


def test_a_seed_that_is_a_key_s_raw_bytes_is_refused(tmp_path: Path) -> None:
    """A seed whose UTF-8 bytes are a stored key's raw bytes hashes as that key's next chunk does: a snapshot
    carrying it stored (and, with a fleet key, signed) its own KV under another prompt's next key."""
    snap = _batch({})
    ns = namespace_of(snap.fingerprint)  # type: ignore[arg-type]
    victim, seed = _utf8_key_prompt(ns)
    tokens = list(snap.token_ids[0][:CHUNK])
    assert chunk_keys(tokens, CHUNK, seed)[0] == chunk_keys(victim + tokens, CHUNK, ns)[1]  # the collision
    evil = replace(snap, extra={KEY_SEEDS: {"salted": seed}})
    with pytest.raises(hv.HurrayFormatError) as err:
        chunks_of(evil, CHUNK)
    assert err.value.field == f"snapshot.extra.{KEY_SEEDS}"
    hv.save(evil, tmp_path / "evil.hrry")  # the same through a file
    with pytest.raises(hv.HurrayFormatError):
        store_snapshot(DirectoryStore(tmp_path / "store"), hv.load(tmp_path / "evil.hrry"), CHUNK)
    assert not list((tmp_path / "store").rglob("*.hrry"))


@pytest.mark.parametrize("seed", ["A" * 32, "a" * 31, "a" * 33, "g" * 32, "ab" * 32, "ns", " " + "a" * 31])
def test_a_seed_key_seed_cannot_make_is_refused(seed: str) -> None:
    with pytest.raises(hv.HurrayFormatError) as err:
        chunks_of(_batch({"salted": seed}), CHUNK)
    assert err.value.field == f"snapshot.extra.{KEY_SEEDS}"


def test_every_seed_key_seed_makes_is_taken_and_keys_stay_as_they_were() -> None:
    snap = _batch({})
    ns = namespace_of(snap.fingerprint)  # type: ignore[arg-type]
    seeds = [ns, key_seed(ns, cache_salt="t"), key_seed(ns, lora=("files", "d")), key_seed(ns, epoch="e")]
    tokens = list(snap.token_ids[0][:CHUNK])
    for seed in seeds:
        got = chunks_of(replace(snap, extra={KEY_SEEDS: {"salted": seed}}), CHUNK)
        assert [k for k, _ in got][1] == chunk_keys(tokens, CHUNK, seed)[0]
    # The keys themselves are what they always were (a store written before keeps its hits).
    assert chunk_keys([1, 2, 3, 4], 4, "ns") == ["758e5284ab707e55b9194022153f8dfe"]


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: chunk_keys([1, 2], 1.5, "ns"), "chunk_tokens"),
        (lambda: chunk_keys([1, 2], True, "ns"), "chunk_tokens"),
        (lambda: chunk_keys([1, 2], "2", "ns"), "chunk_tokens"),
        (lambda: chunk_keys([1, 2**63], 2, "ns"), "token_ids"),
        (lambda: chunk_keys([1, "2"], 2, "ns"), "token_ids"),
        (lambda: tail_keys(None, [1, 2, 3], 0, "ns"), "step"),
        (lambda: tail_keys(None, [1, 2, 3], -1, "ns"), "step"),
        (lambda: tail_keys(None, [1, 2, 3], 1.0, "ns"), "step"),
        (lambda: tail_keys("xyz", [1], 1, "ns"), "prev"),
        (lambda: tail_keys("ab", [1], 1, "ns"), "prev"),
        (lambda: tail_keys("AB" * 16, [1], 1, "ns"), "prev"),
        (lambda: tail_keys("", [1], 1, "ns"), "prev"),
    ],
)
def test_key_arguments_that_cannot_be_are_argument_errors(call: Any, field: str) -> None:
    """A zero step, a prev that is no key, a float chunk size raised bare ValueError and TypeError."""
    with pytest.raises(hv.HurrayArgumentError) as err:
        call()
    assert err.value.field == field


def test_seed_parts_cannot_pass_for_a_split_of_other_parts() -> None:
    """Found by mutation testing: seed parts joined without their lengths failed no test, though a ``cache_salt``
    of ``"aepoche"`` then gets the seed of salt ``"a"`` under epoch ``"e"`` (a tenant naming another's cache), and
    one LoRA adapter's name and digest pass for another's."""
    assert key_seed("ns", cache_salt="a", epoch="e") != key_seed("ns", cache_salt="aepoche")
    assert key_seed("ns", lora=("x", "saltt")) != key_seed("ns", lora=("xsalt", "t"))


@pytest.mark.parametrize(
    "changes",
    [
        {"architecture": "MistralForCausalLM"},
        {"num_layers": 3},
        {"num_kv_heads": 4},
        {"head_dim": 16},
        {"dtype": "bfloat16"},
        {"weights_digest": "d2"},
    ],
)
def test_every_field_of_the_fingerprint_makes_a_namespace_of_its_own(changes: dict[str, object]) -> None:
    """Found by mutation testing: a namespace without the cache dtype (a float16 and an fp8 cache of one model
    sharing chunk keys) failed no test of the keys."""
    fp = hv.ModelFingerprint("LlamaForCausalLM", 2, 2, 8, "float16", weights_digest="d1")
    assert namespace_of(replace(fp, **changes)) != namespace_of(fp)  # type: ignore[arg-type]


def test_a_chunk_ending_before_a_layers_window_starts_holds_none_of_it() -> None:
    """Found by mutation testing: a window's start relative to a chunk left unclamped to the chunk's length failed
    no test; a chunk ending before the window then says its layer starts past the chunk's own end."""
    from hurray_vllm.app.demo import spec_example_snapshot

    snap = spec_example_snapshot()  # pages of 4; sequence 0 has 6 tokens, one whole chunk
    sizes = (2, None, 2, None)
    windows = hv.SlidingWindows(sizes, ((5, 1), (0, 0), (5, 1), (0, 0)))  # layers 0 and 2 hold tokens 5.. only
    ((_, chunk),) = chunks_of(replace(snap, windows=windows), CHUNK)
    assert chunk.windows == hv.SlidingWindows(sizes, ((CHUNK,), (0,), (CHUNK,), (0,)))
    assert chunk.validate().ok
