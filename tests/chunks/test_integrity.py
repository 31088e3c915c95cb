"""A chunk's digest covers every byte that decides the KV an importer writes, not only the page pools."""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synthetic import FP8, make_snapshot

import hurray_vllm as hv
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.chunks.digest import DIGEST_KEY, digest_matches, digest_tensors
from hurray_vllm.chunks.keys import chunks_of, namespace_of
from hurray_vllm.chunks.store import DirectoryStore, load_chunk
from hurray_vllm.chunks.verify import begin_check_data
from hurray_vllm.containers.digest import _encoded_descriptor
from hurray_vllm.kv.snapshot import KVSnapshot
from hurray_vllm.wire.descriptor import PerTensorAffine, encode_descriptor

#: Random damages per run; `make fuzz` raises it (HURRAY_FUZZ_EXAMPLES).
FUZZ_EXAMPLES = int(os.environ.get("HURRAY_FUZZ_EXAMPLES", "60"))


def _chunk(scales: bool = False) -> KVSnapshot:
    snap = spec_example_snapshot()
    if scales:
        snap = replace(snap, kv_scales=tuple((0.5, 0.25) for _ in range(snap.num_layers)))
    ((_, chunk),) = chunks_of(snap, 4)[:1]
    assert digest_matches(chunk)
    return chunk


def _layers(snap: KVSnapshot, layer: int, role: str, **changes: object) -> KVSnapshot:
    field = "keys" if role == "key" else "values"
    ts = list(getattr(snap, field))
    ts[layer] = replace(ts[layer], **changes)
    return replace(snap, **{field: tuple(ts)})


MUTATIONS = {
    # The case: the bytes stay, the type tag says fp16 instead of bf16 (here fp16 -> bf16).
    "element type": lambda c: _layers(c, 1, "key", page_pool=c.keys[1].page_pool.view(torch.bfloat16)),
    "block table": lambda c: _layers(c, 0, "value", block_table=c.values[0].block_table + 1),
    "layer index": lambda c: _layers(_layers(c, 2, "key", layer_index=3), 2, "value", layer_index=3),
    "kv role": lambda c: replace(c, keys=c.values, values=c.keys),
    "token ids": lambda c: replace(c, token_ids=((99, *c.token_ids[0][1:]),)),
    "fingerprint": lambda c: replace(c, fingerprint=replace(c.fingerprint, architecture="Other")),  # type: ignore[arg-type]
    "extra": lambda c: replace(c, extra={**c.extra, "note": "added"}),
}


@pytest.mark.parametrize("what", sorted(MUTATIONS))
def test_every_mutation_of_what_the_importer_reads_breaks_the_digest(what: str) -> None:
    chunk = _chunk()
    assert not digest_matches(MUTATIONS[what](chunk)), what


def test_changed_fp8_scales_break_the_digest() -> None:
    chunk = _chunk(scales=True)
    assert chunk.kv_scales is not None
    doubled = tuple((2 * k, v) for k, v in chunk.kv_scales)
    assert not digest_matches(replace(chunk, kv_scales=doubled))


def test_a_chunks_digest_covers_where_its_sliding_windows_start() -> None:
    """Found by mutation testing: a sliding-window hybrid's chunk whose windows say its layer holds more (or
    fewer) tokens than it was stored with must fail its digest, as a loader trusts ``kv_start`` to tell held
    KV from the zeros before it."""
    snap = spec_example_snapshot()
    sizes = (4, None, 4, None)
    windows = hv.SlidingWindows(sizes, ((2, 1), (0, 0), (2, 1), (0, 0)))
    ((_, chunk),) = chunks_of(replace(snap, windows=windows), 4)[:1]
    assert chunk.windows == hv.SlidingWindows(sizes, ((2,), (0,), (2,), (0,))) and digest_matches(chunk)
    moved = hv.SlidingWindows(sizes, ((1,), (0,), (2,), (0,)))  # layer 0 now claims token 1's KV
    assert not digest_matches(replace(chunk, windows=moved))


def test_a_pools_only_digest_from_0_1_is_refused() -> None:
    chunk = _chunk()
    with pytest.raises(hv.HurrayFormatError, match="does not cover the descriptors") as err:
        digest_matches(replace(chunk, extra={DIGEST_KEY: "crc32:00000000"}))
    assert err.value.field == "snapshot.digest"


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_flipped_byte_in_a_stored_chunk_is_refused_or_harmless(tmp_path: Path, data: st.DataObject) -> None:
    """Any one byte of a chunk file flipped: the file is refused, the digest fails, or nothing that matters changed."""
    chunk = _chunk()
    path = tmp_path / "c.hrry"
    hv.save(chunk, path)
    raw = bytearray(path.read_bytes())
    pos = data.draw(st.integers(0, len(raw) - 1), label="offset")
    raw[pos] ^= data.draw(st.integers(1, 255), label="xor")
    path.write_bytes(bytes(raw))
    try:
        back = hv.load(path)
    except hv.HurrayFormatError:
        return
    try:
        ok = digest_matches(back)
    except hv.HurrayFormatError:
        return
    if ok:  # accepted: then what an importer reads is what was stored
        assert back.token_ids == chunk.token_ids and back.fingerprint == chunk.fingerprint
        for a, b in zip((*back.keys, *back.values), (*chunk.keys, *chunk.values)):
            assert a.page_pool.dtype == b.page_pool.dtype and torch.equal(a.page_pool, b.page_pool)
            assert torch.equal(a.block_table, b.block_table) and a.layer_index == b.layer_index


def test_key_value_chunk_digests_are_those_stored_chunks_carry() -> None:
    """A golden digest: the chunks a store already holds must keep verifying after an upgrade.

    Computed by the release before MLA and sliding-window support: the digest
    covers every key, then every value (``digest_tensors``), not layer by layer.
    """
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks.digest import chunk_digest

    assert chunk_digest(spec_example_snapshot(num_layers=3)) == "crc32c/v2:9fccaf70"


def test_remembered_descriptor_encodings_are_each_tensors_own() -> None:
    """``digest_header`` remembers encoded descriptors by what decides them; each is still its own tensor's."""
    snaps = [
        make_snapshot([5, 9], [0, 1], 4),
        make_snapshot([5, 9], [0, 1], 4, dtype=torch.float16),  # same geometry, another element type
        make_snapshot([5, 8], [0, 1], 4),  # one token fewer: another shape[0]
        make_snapshot([16], [0], 8, heads=1, dim=24, layers=3),
        make_snapshot([7, 7], [0, 0], 4, dtype=FP8[0]),
    ]
    # Quantization sections that compare equal but encode apart (0.0 and -0.0).
    k = snaps[0].keys[0]
    snaps.append(replace(snaps[0], keys=(replace(k, quantization=PerTensorAffine(0.0)), *snaps[0].keys[1:])))
    snaps.append(replace(snaps[0], keys=(replace(k, quantization=PerTensorAffine(-0.0)), *snaps[0].keys[1:])))
    for _ in range(2):  # the second round finds every key remembered
        for snap in snaps:
            for t in digest_tensors(snap):
                assert _encoded_descriptor(t, {}) == encode_descriptor(t.descriptor(device_tag=0))


def test_a_quantized_chunk_is_refused_by_the_check_every_consumer_runs() -> None:
    """Quantization parameter buffers are outside the digest (and MAC): a chunk that has any must not pass."""
    from hurray_vllm.chunks.digest import chunk_digest
    from hurray_vllm.chunks.verify import verify_chunk

    chunk = _chunk()
    assert chunk.fingerprint is not None
    tokens = list(chunk.token_ids[0])
    verify_chunk(chunk, chunk.fingerprint, tokens)
    k = chunk.keys[0]
    params = [
        replace(chunk, keys=(replace(k, quant_buffers=(torch.full((8,), b, dtype=torch.uint8),)), *chunk.keys[1:]))
        for b in (0, 255)
    ]
    assert chunk_digest(params[0]) == chunk_digest(params[1])  # why: the digest does not see them
    section = replace(chunk, keys=(replace(k, quantization=PerTensorAffine(0.5)), *chunk.keys[1:]))
    for bad in (*params, section):
        signed = replace(bad, extra={**bad.extra, DIGEST_KEY: chunk_digest(bad)})
        with pytest.raises(hv.HurrayFormatError, match="quantized") as err:
            verify_chunk(signed, chunk.fingerprint, tokens)
        assert err.value.field == "quantization"


def _paged_chunk_file(root: Path) -> tuple[DirectoryStore, str, str]:
    """A stored chunk whose pools are views of the file read whole (64 KiB and more), over several 4 KiB pages,
    starting on a page and ending mid-page (the reader's page registers)."""
    fp = hv.ModelFingerprint("LlamaForCausalLM", 2, 2, 40, "bfloat16")
    snap = replace(make_snapshot([424], [0], 8, dim=40), token_ids=(tuple(range(424)),), fingerprint=fp)
    ((key, chunk),) = chunks_of(snap, 424)
    assert chunk.keys[0].page_pool.nbytes % 4096  # 67840 bytes
    ns, store = namespace_of(fp), DirectoryStore(root)
    assert store.put(ns, key, chunk)
    return store, ns, key


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_check_from_page_registers_judges_a_damaged_file_as_the_full_check(
    tmp_path: Path, data: st.DataObject
) -> None:
    """A consumer's digest check combines the CRCs its read computed page by page: any flipped byte of the file
    gets the verdict reading the pools again gives (refused, or accepted because nothing that matters changed)."""
    store, ns, key = _paged_chunk_file(Path(tempfile.mkdtemp(dir=tmp_path)))
    path = store.path(ns, key)
    raw = bytearray(path.read_bytes())
    pos = data.draw(st.integers(0, len(raw) - 1), label="offset")
    raw[pos] ^= data.draw(st.integers(1, 255), label="xor")
    path.write_bytes(bytes(raw))
    try:
        read = store.read(ns, key, page_crcs=True)
        snap = load_chunk(read)
    except hv.HurrayFormatError:
        return
    assert read.page_crcs is not None
    try:
        want = digest_matches(snap)
    except hv.HurrayFormatError:
        want = False
    try:
        begin_check_data(snap, read=read)()
        got = True
    except hv.HurrayFormatError:
        got = False
    assert got == want


def test_a_chunk_read_page_by_page_is_checked_without_reading_its_pools_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pools' half of the check combines the read's page registers; a snapshot whose pools are not the read's
    memory (a copy) is checked from its own bytes."""
    from hurray_vllm import native

    store, ns, key = _paged_chunk_file(tmp_path)
    assert store.read(ns, key).page_crcs is None  # only for a caller that asks (a MAC reads the pools itself)
    read = store.read(ns, key, page_crcs=True)
    snap = load_chunk(read)
    assert read.page_crcs is not None and read.page_crcs.registers.numel() > 2
    copied = replace(snap, keys=tuple(replace(t, page_pool=t.page_pool.clone()) for t in snap.keys))
    rest_copied = begin_check_data(copied, read=read)
    with monkeypatch.context() as m:
        m.setattr(native, "crc32c_tensors", lambda *a: pytest.fail("the pools were read again"))
        begin_check_data(snap, read=read)()
    rest_copied()  # from the copy's own bytes: equal, so it passes
    damaged = replace(
        snap, keys=(replace(snap.keys[0], page_pool=snap.keys[0].page_pool.clone().fill_(0)), *snap.keys[1:])
    )
    with pytest.raises(hv.HurrayFormatError, match="does not match"):
        begin_check_data(damaged, read=read)()


def test_page_registers_vouch_only_for_the_memory_they_were_computed_from(tmp_path: Path) -> None:
    """A FileBytes given other bytes (a damaged copy) keeps registers that no longer describe them: the check
    reads the bytes themselves, and refuses the damage."""
    store, ns, key = _paged_chunk_file(tmp_path)
    read = store.read(ns, key, page_crcs=True)
    raw = bytearray(read.view)
    snap = load_chunk(read)
    offset = snap.keys[0].page_pool.data_ptr() - torch.frombuffer(read.view, dtype=torch.uint8).data_ptr()
    raw[offset + 20000] ^= 0x10  # inside the first key pool, on a whole page
    copy = replace(read, view=memoryview(raw))
    damaged = load_chunk(copy)
    with pytest.raises(hv.HurrayFormatError, match="does not match"):
        begin_check_data(damaged, read=copy)()


def test_a_slice_stored_under_another_slices_heads_is_refused() -> None:
    """Heads 0..1 under the name of heads 2..3 have the count the name says: only the range tells them apart."""
    from hurray_vllm.chunks.verify import verify_chunk
    from hurray_vllm.kv.heads import select_heads

    fp = hv.ModelFingerprint("X", 2, 4, 16, "bfloat16")
    snap = make_snapshot([8], [0], 4, heads=4, dim=16)
    ((_, chunk),) = chunks_of(replace(snap, fingerprint=fp, token_ids=(tuple(range(8)),)), 8)
    low = select_heads(chunk, range(0, 2))
    verify_chunk(low, fp, list(range(8)), heads=range(0, 2), digest=False)
    with pytest.raises(hv.HurrayFormatError, match=r"its name says 2\.\.4") as err:
        verify_chunk(low, fp, list(range(8)), heads=range(2, 4), digest=False)
    assert err.value.field == "snapshot.heads"


def test_a_chunk_differing_from_its_keys_tokens_in_any_one_token_is_refused() -> None:
    """Each position counts, the first included: a chunk of other tokens is KV of another prompt."""
    from hurray_vllm.chunks.verify import verify_chunk

    chunk = _chunk()
    assert chunk.fingerprint is not None
    tokens = list(chunk.token_ids[0])
    verify_chunk(chunk, chunk.fingerprint, tokens)
    for i in range(len(tokens)):
        other = [t + 1 if j == i else t for j, t in enumerate(tokens)]
        with pytest.raises(hv.HurrayFormatError, match="other tokens") as err:
            verify_chunk(chunk, chunk.fingerprint, other, digest=False)
        assert err.value.field == "snapshot.token_ids"
