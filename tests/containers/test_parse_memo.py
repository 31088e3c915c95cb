"""The parse memo (``containers.template``): a file built from a remembered structure is what the general reader
builds, down to the errors, and a byte the memo compared that differs sends the file to the general reader."""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hurray_vllm as hv
from hurray_vllm.chunks.digest import DIGEST_KEY, chunk_digest, digest_header
from hurray_vllm.chunks.store import DirectoryStore
from hurray_vllm.containers import digest, template
from hurray_vllm.containers.hrryfile import HrryFile
from hurray_vllm.containers.io import load_file_bytes, read_file, save_records
from hurray_vllm.containers.schema import Record
from hurray_vllm.kv.paged import BlockPagedTensor
from hurray_vllm.kv.snapshot import KVSnapshot, ModelFingerprint, SnapshotSource

FUZZ_EXAMPLES = int(os.environ.get("HURRAY_FUZZ_EXAMPLES", "150"))
LAYERS, HEADS, DIM, PAGE = 3, 8, 128, 16  # pools of 64 KiB: views of the file's memory, as a chunk's are
FP = ModelFingerprint("LlamaForCausalLM", LAYERS, HEADS, DIM, "bfloat16")


def chunk(seed: int, *, pages: int = 2, request: str = "0", heads: int = HEADS, fp8: bool = False) -> KVSnapshot:
    """A one-sequence chunk as the connector stores it: shared index tensors, fingerprint, digest."""
    g = torch.Generator().manual_seed(seed)
    bt, sp, sl = torch.arange(pages), torch.tensor([0, pages]), torch.tensor([pages * PAGE])
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16

    def pool() -> torch.Tensor:
        return torch.randn(pages, PAGE, heads, DIM, generator=g).to(dtype)

    keys = tuple(BlockPagedTensor(pool(), bt, sp, sl, "key", i) for i in range(LAYERS))
    values = tuple(BlockPagedTensor(pool(), bt, sp, sl, "value", i) for i in range(LAYERS))
    snap = KVSnapshot(
        keys=keys,
        values=values,
        token_ids=(tuple(range(seed, seed + pages * PAGE)),),
        fingerprint=FP if heads == HEADS else replace(FP, num_kv_heads=heads),  # the pools' heads
        source=SnapshotSource("vllm", "cpu", PAGE),
        request_ids=(request,),
        kv_scales=tuple((0.5, 0.25) for _ in range(LAYERS)) if fp8 else None,
    )
    return replace(snap, extra={DIGEST_KEY: chunk_digest(snap)})


def as_the_store_reads(path: Path, *, permissive: bool = False) -> KVSnapshot:
    """``path`` read as the chunk store's consumers read it: the digest is theirs to check afterwards.

    What the templates serve; :func:`hv.load` also checks the digest, so a file damaged on purpose here is
    read this way to see what the template built of it.
    """
    return load_file_bytes(read_file(path), permissive=permissive, digest=False)


def put(tmp: Path, name: str, snap: KVSnapshot) -> Path:
    store = DirectoryStore(tmp)
    store.put("0a", name, snap, replace=True)
    return store.path("0a", name)


@pytest.fixture(autouse=True)
def fresh_memo() -> Iterator[None]:
    template.clear()
    before = template.set_enabled(True)
    yield
    template.set_enabled(before)
    template.clear()


def outcome(fn: Callable[[], KVSnapshot]) -> tuple[Any, ...]:
    """What a load gave: its error (type, field, message), or the snapshot."""
    try:
        return ("ok", fn())
    except hv.HurrayFormatError as exc:
        return ("error", type(exc), exc.field, str(exc))


def general(fn: Callable[[], KVSnapshot]) -> tuple[Any, ...]:
    before = template.set_enabled(False)
    try:
        return outcome(fn)
    finally:
        template.set_enabled(before)


def assert_same_outcome(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert a[0] == b[0], (a, b)
    if a[0] == "error":
        assert a == b
    else:
        assert_same(a[1], b[1])


def _sharing(snap: KVSnapshot) -> list[tuple[int, ...]]:
    """Which tensors of ``snap`` are one object (block tables, pointers, lengths), as a pattern of first uses."""
    seen: dict[int, int] = {}
    out = []
    for t in snap.tensors():
        out.append(tuple(seen.setdefault(id(x), len(seen)) for x in (t.block_table, t.seq_ptr, t.seq_lens)))
    return out


def assert_same(a: KVSnapshot, b: KVSnapshot) -> None:
    """Equal in every field, tensors in dtype, shape, strides and values; index tensors shared alike."""
    for f in fields(KVSnapshot):
        if f.name not in ("keys", "values", "fused", "states"):
            assert getattr(a, f.name) == getattr(b, f.name), f.name
    assert a.states is None and b.states is None
    assert len(a.tensors()) == len(b.tensors())
    for x, y in zip(a.tensors(), b.tensors(), strict=True):
        for f in fields(BlockPagedTensor):
            u, v = getattr(x, f.name), getattr(y, f.name)
            if isinstance(u, torch.Tensor):
                assert isinstance(v, torch.Tensor), f.name
                assert (u.dtype, u.shape, u.stride(), u.is_contiguous()) == (v.dtype, v.shape, v.stride(), True)
                assert torch.equal(u.view(torch.uint8), v.view(torch.uint8)), f.name
            elif isinstance(u, tuple):
                assert len(u) == len(v) and all(torch.equal(p, q) for p, q in zip(u, v, strict=True)), f.name
            else:
                assert u == v, f.name
    assert _sharing(a) == _sharing(b)


def test_chunks_of_one_structure_load_from_the_memo_as_the_general_reader_loads_them(tmp_path: Path) -> None:
    # Request ids of one and two digits: the metadata record (and the index) differ in length.
    paths = [put(tmp_path, f"c{i}", chunk(i, request=str(i * 7))) for i in range(4)]
    for p in paths:
        for load in (lambda p=p: load_file_bytes(read_file(p)), lambda p=p: hv.load(p)):
            assert_same_outcome(outcome(load), general(load))
    got = template.stats()
    assert got["learned"] == 1 and got["hits"] == 7 and got["misses"] == 1 and got["kept"] == 1


def test_snapshots_from_the_memo_share_no_tensor_with_each_other(tmp_path: Path) -> None:
    p = put(tmp_path, "c", chunk(1))
    hv.load(p)  # learned
    a, b = hv.load(p), hv.load(p)
    assert template.stats()["hits"] == 2
    for x, y in zip(a.tensors(), b.tensors(), strict=True):
        for name in ("page_pool", "block_table", "seq_ptr", "seq_lens"):
            u, v = getattr(x, name), getattr(y, name)
            assert u.data_ptr() != v.data_ptr(), name
    # Written into in place, one snapshot's index tensors change nothing another load sees.
    a.keys[0].block_table.add_(1)
    a.keys[0].seq_lens.zero_()
    c = hv.load(p)
    assert c.keys[0].block_table.tolist() == [0, 1] and c.seq_lens == [2 * PAGE] and b.seq_lens == [2 * PAGE]
    assert_same(c, b)


def _flip_each(raw: bytes, start: int, stop: int) -> Iterator[bytearray]:
    for at in range(start, stop):
        damaged = bytearray(raw)
        damaged[at] ^= 0x41
        yield damaged


def test_a_flipped_byte_of_a_remembered_descriptor_or_index_buffer_is_not_taken_from_the_memo(tmp_path: Path) -> None:
    base = put(tmp_path, "c", chunk(2))
    raw = base.read_bytes()
    hv.load(base)
    with HrryFile(base) as hf:
        value = next(e for e in hf.entries if e.name == "layers.1.value")
        lens = next(e for e in hf.entries if e.name == "layers.1.seq_lens")
        desc = hf.descriptor(value)
        (_, _), (table, tsize), (ptr, psize) = hf.buffer_spans(value, desc)
        ((lpos, lsize),) = hf.buffer_spans(lens, hf.descriptor(lens))
    regions = [
        (value.descriptor_offset, value.descriptor_offset + value.descriptor_length),
        (table, table + tsize),
        (ptr, ptr + psize),
        (lpos, lpos + lsize),
    ]
    path = tmp_path / "damaged.hrry"
    for start, stop in regions:
        for damaged in _flip_each(raw, start, stop):
            path.write_bytes(bytes(damaged))
            hits = template.stats()["hits"]
            got = outcome(lambda: load_file_bytes(read_file(path)))
            assert template.stats()["hits"] == hits, f"byte {damaged} taken from the memo"
            assert_same_outcome(got, general(lambda: load_file_bytes(read_file(path))))


def test_a_changed_pool_is_content_the_memo_reads_from_the_file(tmp_path: Path) -> None:
    base = put(tmp_path, "c", chunk(3))
    hv.load(base)
    with HrryFile(base) as hf:
        e = next(e for e in hf.entries if e.name == "layers.2.key")
        (pos, _), *_ = hf.buffer_spans(e, hf.descriptor(e))
    raw = bytearray(base.read_bytes())
    raw[pos] ^= 0xFF
    base.write_bytes(bytes(raw))
    snap = as_the_store_reads(base)
    assert template.stats()["hits"] == 1
    assert snap.keys[2].page_pool.view(torch.uint8).reshape(-1)[0] == raw[pos]
    assert_same(snap, general(lambda: as_the_store_reads(base))[1])
    with pytest.raises(hv.HurrayFormatError, match="does not match its digest"):  # built from the template too
        hv.load(base)


@pytest.mark.parametrize(
    "edit",
    [
        (b'kv_snapshot", "num_layers": 3', b'kv_snapshot", "num_layers": 4'),  # announces a layer the file lacks
        (b'"format": "hurray-vllm.kv_snapshot"', b'"format": "hurray-vllm.kv_snapshoT"'),
        (b'"version": 1', b'"version": 9'),
        (b'"num_seqs": 1', b'"num_seqs": "'),  # no longer JSON
        (b'"num_seqs": 1', b'"num_seqs": 2'),  # announces a sequence the layers lack
        (b'"request_ids": ["5"]', b'"request_ids": [555]'),
    ],
)
def test_a_header_the_memo_does_not_remember_is_judged_as_the_general_reader_judges_it(
    tmp_path: Path, edit: tuple[bytes, bytes]
) -> None:
    base = put(tmp_path, "c", chunk(4, request="5"))
    hv.load(base)
    raw = base.read_bytes()
    assert raw.count(edit[0]) == 1
    path = tmp_path / "edited.hrry"
    path.write_bytes(raw.replace(*edit))
    got = outcome(lambda: hv.load(path))
    assert got[0] == "error" and template.stats()["hits"] == 1  # the layers matched: the header refused it
    assert_same_outcome(got, general(lambda: hv.load(path)))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["flip", "field"]), data=st.data())
def test_random_damage_gives_the_general_readers_verdict(tmp_path: Path, kind: str, data: st.DataObject) -> None:
    base = tmp_path / "base.hrry"
    if not base.exists():
        base = put(tmp_path, "ba5e", chunk(5, pages=1))
        base.rename(tmp_path / "base.hrry")
        base = tmp_path / "base.hrry"
    template.clear()
    hv.load(base)  # learned
    raw = bytearray(base.read_bytes())
    # Half the damage lands where the memo compares or reads bytes (all but the pools), half anywhere.
    spans = _structure(base)
    where = st.one_of(
        st.integers(0, len(raw) - 1), st.sampled_from(spans).flatmap(lambda s: st.integers(s[0], s[1] - 1))
    )
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            raw[data.draw(where, label="at")] ^= data.draw(st.integers(1, 255), label="xor")
    else:
        at = min(data.draw(where, label="near") // 8, len(raw) // 8 - 1) * 8
        value = data.draw(st.sampled_from([0, 1, 2, 3, 2**32, 2**63, 2**64 - 1]), label="value")
        raw[at : at + 8] = value.to_bytes(8, "little")
    path = tmp_path / "damaged.hrry"
    path.write_bytes(bytes(raw))
    for load in (lambda: load_file_bytes(read_file(path)), lambda: hv.load(path)):
        assert_same_outcome(outcome(load), general(load))
    if outcome(lambda: hv.load(path))[0] == "ok":
        assert hv.validate(path).ok


def _structure(path: Path) -> list[tuple[int, int]]:
    """Every span of ``path`` but its page pools: header, descriptors, small buffers, index, trailer."""
    with HrryFile(path) as hf:
        spans = [(0, 64), (hf.size - 40, hf.size)]
        for e in hf.entries:
            d = hf.descriptor(e)
            spans.append((e.descriptor_offset, e.descriptor_offset + e.descriptor_length))
            for i, (pos, size) in enumerate(hf.buffer_spans(e, d)):
                if size and not (i == 0 and e.name.endswith(("key", "value"))):
                    spans.append((pos, pos + size))
        last = max(e.data_offset + e.data_length for e in hf.entries)
        spans.append((last, hf.size - 40))  # the index
    return spans


def test_permissive_and_strict_reads_keep_templates_of_their_own(tmp_path: Path) -> None:
    p = put(tmp_path, "c", chunk(6))
    hv.load(p)
    hv.load(p, permissive=True)
    assert template.stats()["learned"] == 2 and template.stats()["hits"] == 0
    assert_same(hv.load(p, permissive=True), hv.load(p))
    assert template.stats()["hits"] == 2


def test_templates_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(template, "MAX_TEMPLATES", 3)
    for pages in range(1, 7):  # six shapes of file
        hv.load(put(tmp_path, f"a{pages:x}", chunk(pages, pages=pages)))
        assert template.stats()["kept"] <= 3
    assert template.stats()["learned"] == 6
    monkeypatch.setattr(template, "MAX_TEMPLATE_BYTES", 100)  # a template of more memory is not remembered
    template.clear()
    hv.load(put(tmp_path, "b19", chunk(9)))
    assert template.stats() == {"hits": 0, "misses": 1, "learned": 0, "kept": 0, "bytes": 0}


def test_record_names_count_against_a_templates_bound_and_long_ones_are_not_interned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template kept every row's name uncounted (names may be 64 KiB each), and the interning table kept
    rows of any index, including ones the index memo leaves out for their size."""
    from hurray_vllm.containers import hrryfile
    from hurray_vllm.containers.io import open_records, save_records
    from hurray_vllm.containers.schema import Record

    src = put(tmp_path, "a", chunk(1))
    monkeypatch.setattr(template, "MAX_TEMPLATE_BYTES", 40_000)  # far above what its template holds (~16 KB)
    long = "n" * 20_000
    recs = [
        Record(r.name + ("" if i < 4 else "." + long), r.descriptor, r.buffers) for i, r in enumerate(open_records(src))
    ]
    path = tmp_path / "long.hrry"
    save_records(recs, path)
    template.clear()
    hv.load(path)
    assert template.stats()["learned"] == 0  # its names alone exceed the bound
    assert not [e for e in hrryfile._ENTRIES if len(e.name) > 256]  # the long rows were not interned


def test_fp8_chunks_and_small_pools_load_from_the_memo_too(tmp_path: Path) -> None:
    # fp8 pools with their kv_scales; pools of 8 KiB, which the reader copies rather than views.
    for snap in (chunk(7, fp8=True), chunk(8, heads=1)):
        p = put(tmp_path, "c", snap)
        hv.load(p)
        hits = template.stats()["hits"]
        assert_same(hv.load(p), general(lambda p=p: hv.load(p))[1])
        assert template.stats()["hits"] == hits + 1


def test_files_not_of_the_plain_layout_are_read_the_general_way(tmp_path: Path) -> None:
    snap = chunk(10)
    bare = [Record(f"t{i}", t.descriptor(device_tag=0), t.wire_buffers()) for i, t in enumerate(snap.tensors())]
    path = tmp_path / "bare.hrry"
    save_records(bare, path)
    for _ in range(2):
        got = hv.load(path)
    assert template.stats()["learned"] == 0 and template.stats()["hits"] == 0
    assert got.num_layers == LAYERS


def test_threads_parsing_at_once_get_the_general_readers_snapshots(tmp_path: Path) -> None:
    paths = [put(tmp_path, f"c{i}", chunk(20 + i, request=str(i))) for i in range(3)]
    want = [general(lambda p=p: hv.load(p))[1] for p in paths]
    datas = [read_file(p) for p in paths]
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for k in range(30):
                assert_same(load_file_bytes(datas[k % 3]), want[k % 3])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert template.stats()["hits"] > 0


def test_the_digest_headers_remembered_sections_are_what_building_them_gives() -> None:
    snaps = [chunk(30), chunk(31, pages=1), chunk(32, fp8=True)]
    # Layers that share nothing, and a swapped layer index: keyed apart, or not remembered at all.
    s = snaps[0]
    unshared = replace(s, keys=tuple(replace(t, block_table=t.block_table.clone()) for t in s.keys))
    swapped = replace(s, keys=(replace(s.keys[0], layer_index=1), replace(s.keys[1], layer_index=0), s.keys[2]))
    digest._SECTIONS.clear()
    for snap in [*snaps, unshared, swapped, *snaps]:
        before = digest.remember_sections(False)
        try:
            want = digest_header(snap)
        finally:
            digest.remember_sections(before)
        assert digest_header(snap) == want
    assert len(digest._SECTIONS) == 4  # the three chunks and the swapped one; the unshared one is built afresh


# ── what the templates hold, and which go first ──────────────────────────────


def _tiny_layers(layers: int) -> KVSnapshot:
    """``layers`` layers of pools of 64 bytes: a template of many objects and few compared bytes."""
    bt, sp, sl = torch.arange(1), torch.tensor([0, 1]), torch.tensor([4])

    def pool() -> torch.Tensor:
        return torch.zeros(1, 4, 1, 8, dtype=torch.bfloat16)

    members = [tuple(BlockPagedTensor(pool(), bt, sp, sl, role, i) for role in ("key", "value")) for i in range(layers)]
    return KVSnapshot.from_layers(
        members,
        token_ids=(tuple(range(4)),),
        fingerprint=ModelFingerprint("LlamaForCausalLM", layers, 1, 8, "bfloat16"),
        source=SnapshotSource("vllm", "cpu", 4),
    )


def _measured(path: Path) -> tuple[template._Template | None, int]:
    """The template of the file at ``path``, and the memory (traced by tracemalloc) that making it kept."""
    import gc
    import tracemalloc

    from hurray_vllm.containers.schema import assemble_snapshot, group_records

    with HrryFile(path, whole=True) as hf:
        records = list(hf.records())
        snap = assemble_snapshot(group_records(iter(records)))
        view = hf.whole
        assert isinstance(view, memoryview)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            made = template._template(hf, view, False, records, snap)
            gc.collect()
            return made, tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()


def test_a_templates_bound_counts_the_objects_it_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound counted compared bytes and names only: a file of many layers of tiny pools holds ~5 times that in
    objects (a recipe per tensor, a span per buffer), and was remembered at many times the documented bound."""
    from hurray_vllm.containers.hrryfile import row_bytes

    for name, snap in (("fp8", chunk(40, fp8=True)), ("mla", _fused(41, fp8=False)), ("tiny", _tiny_layers(48))):
        path = tmp_path / f"{name}.hrry"
        hv.save(snap, path)
        made, held = _measured(path)
        assert made is not None
        # Its rows were made by the index parse (and are measured there): the rest is what making it kept.
        assert held <= made.cost - sum(map(row_bytes, made.tail)), name
    tiny = path
    assert made is not None and sum(b - a for a, b in made.regions) + sum(len(e.name) for e in made.tail) < 24 << 10
    assert held > 64 << 10  # ~115 KB, of what the old count called 22.5 KB
    monkeypatch.setattr(template, "MAX_TEMPLATE_BYTES", 64 << 10)
    hv.load(tiny)
    assert template.stats()["learned"] == 0
    # Together: the least recently used go once the templates kept hold more than the total bound.
    monkeypatch.setattr(template, "MAX_TEMPLATE_BYTES", 1 << 20)
    monkeypatch.setattr(template, "MAX_TOTAL_BYTES", 40_000)
    for pages in range(1, 5):
        hv.load(put(tmp_path, f"a{pages:x}", chunk(pages, pages=pages)))  # ~16 KB each
        assert 0 < template.stats()["bytes"] <= 40_000
    assert template.stats()["learned"] == 4 and template.stats()["kept"] == 2


def test_templates_of_files_read_once_go_before_those_that_served_other_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template is learned before the reader verifies the file (its digest, its tokens): files it then refuses
    pushed the templates of the files it uses out, least recently used first."""
    monkeypatch.setattr(template, "MAX_TEMPLATES", 3)
    used = [put(tmp_path, f"d{i}", chunk(50 + i, request=str(i), pages=4)) for i in range(2)]
    for p in used:  # one structure: the second file matches the first's template
        hv.load(p)
    assert template.stats()["hits"] == 1
    for pages in range(5, 11):  # six files of other shapes, each read once (and, say, refused)
        hv.load(put(tmp_path, f"e{pages:x}", chunk(60 + pages, pages=pages)))
        assert template.stats()["kept"] <= 3
    hv.load(used[0])
    assert template.stats()["hits"] == 2  # still there
    # Within one shape of file too (at most four templates of one size and record count): files whose
    # block tables list the pages in another order.
    template.clear()
    hv.load(used[0])
    hv.load(used[1])
    raw = used[0].read_bytes()
    with HrryFile(used[0]) as hf:
        tables = [hf.buffer_spans(e, hf.descriptor(e))[1] for e in hf.entries if e.name.endswith(("key", "value"))]
    path = tmp_path / "permuted.hrry"
    for order in list(itertools.permutations(range(4)))[1:7]:
        permuted = bytearray(raw)
        for pos, size in tables:
            permuted[pos : pos + size] = b"".join(i.to_bytes(size // 4, "little") for i in order)
        path.write_bytes(bytes(permuted))
        as_the_store_reads(path)  # learned; the digest check that follows refuses it
        assert template.stats()["kept"] <= 4
    assert template.stats()["learned"] == 7
    hits = template.stats()["hits"]
    hv.load(used[1])
    assert template.stats()["hits"] == hits + 1


def test_index_tensors_written_in_place_change_no_later_snapshot(tmp_path: Path) -> None:
    """Every index tensor (block table, pointer, lengths) and pool of a snapshot from the general reader (whose
    tensors the template copied) and of one from the template, written into: later files built from the template
    are what the general reader gives them."""
    paths = [put(tmp_path, f"c{i}", chunk(70 + i, request=str(i))) for i in range(3)]
    want = [general(lambda p=p: hv.load(p))[1] for p in paths]
    template.clear()

    def scribble(snap: KVSnapshot) -> None:
        for t in snap.tensors():
            for x in (t.block_table, t.seq_ptr, t.seq_lens):
                x.fill_(7)
            t.page_pool.view(torch.uint8).fill_(0xAB)

    scribble(hv.load(paths[0]))  # learned
    scribble(hv.load(paths[1]))  # from the template
    for p, w in zip(paths, want, strict=True):
        got = hv.load(p)
        assert_same(got, w)
        scribble(got)
    assert template.stats()["learned"] == 1 and template.stats()["hits"] == 4


# ── the template's verdict is the general reader's: bases of every kind, edits that keep the structure ──


_ROOM = 96  # characters of an ``extra`` note a metadata edit may take for room


def _fused(seed: int, *, fp8: bool, pages: int = 2) -> KVSnapshot:
    """A chunk of MLA latents (one fused tensor per layer, heads 1)."""
    split = hv.LatentSplit(512, 64, "deepseek_v3")
    g = torch.Generator().manual_seed(seed)
    bt, sp, sl = torch.arange(pages), torch.tensor([0, pages]), torch.tensor([pages * PAGE])
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    fused = tuple(
        BlockPagedTensor(torch.randn(pages, PAGE, 1, split.head_dim, generator=g).to(dtype), bt, sp, sl, "fused", i)
        for i in range(LAYERS)
    )
    return KVSnapshot(
        keys=(),
        values=(),
        fused=fused,
        latent=split,
        token_ids=(tuple(range(seed, seed + pages * PAGE)),),
        fingerprint=ModelFingerprint("DeepseekV3ForCausalLM", LAYERS, 1, split.head_dim, "bfloat16"),
        source=SnapshotSource("vllm", "cpu", PAGE),
        request_ids=("0",),
        kv_scales=tuple((0.5, 0.5) for _ in range(LAYERS)) if fp8 else None,
    )


def _base(fused: bool, fp8: bool, big: bool) -> KVSnapshot:
    """A chunk whose pools are over 64 KiB (views of the file's memory) or under (copies), with room in its extra."""
    itemsize = 1 if fp8 else 2
    heads = 1 if fused else (HEADS if big else 1)
    page_bytes = PAGE * heads * (576 if fused else DIM) * itemsize
    pages = -(-(80 << 10) // page_bytes) if big else max(1, (32 << 10) // page_bytes)
    snap = _fused(80, fp8=fp8, pages=pages) if fused else chunk(80, pages=pages, heads=heads, fp8=fp8)
    assert (pages * page_bytes >= 64 << 10) == big
    snap = replace(snap, extra={"note": "x" * _ROOM})
    return replace(snap, extra={**snap.extra, DIGEST_KEY: chunk_digest(snap)})  # the note is covered too


def _span(path: Path, name: str, buffer: int = 0) -> tuple[int, int]:
    with HrryFile(path) as hf:
        e = next(e for e in hf.entries if e.name == name)
        pos, size = hf.buffer_spans(e, hf.descriptor(e))[buffer]
    return pos, pos + size


@st.composite
def _meta_edit(draw: st.DrawFn, meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with one to three fields changed: some edits valid, some that the layers contradict."""
    meta = json.loads(json.dumps(meta))
    ints = st.integers(0, 4)
    edits = {
        "request_ids": lambda: [str(draw(st.integers(0, 999)))],
        "num_seqs": lambda: draw(st.integers(0, 2)),
        "num_layers": lambda: draw(st.integers(LAYERS - 1, LAYERS + 1)),
        "version": lambda: draw(st.sampled_from([1, 2])),
        "windows": lambda: {
            "sizes": [draw(st.sampled_from([None, 4, PAGE, 64])) for _ in range(LAYERS)],
            "kv_start": [[draw(st.sampled_from([0, 1, PAGE, 2 * PAGE - 1]))] for _ in range(LAYERS)],
        },
        "heads": lambda: {"start": draw(ints), "stop": draw(st.integers(1, 9)), "total": draw(st.integers(1, 16))},
        "latent": lambda: {
            "kv_lora_rank": draw(st.sampled_from([448, 512, 576])),
            "rope_dim": draw(st.sampled_from([0, 64, 128])),
            "family": "deepseek_v3",
        },
        "fingerprint": lambda: {**meta["fingerprint"], "num_kv_heads": draw(st.sampled_from([1, 2, HEADS]))},
        "source": lambda: {**meta["source"], "page_size": draw(st.sampled_from([8, PAGE, 32]))},
    }
    for key in draw(st.lists(st.sampled_from(sorted(edits)), min_size=1, max_size=3, unique=True)):
        if draw(st.integers(0, 5)) == 0:
            meta.pop(key, None)
        else:
            meta[key] = edits[key]()
    return meta


def _same_length(meta: dict[str, Any], length: int) -> bytes | None:
    """``meta`` encoded in ``length`` bytes (the note shortened for room, spaces after), or None if it cannot be."""
    raw = json.dumps(meta).encode()
    over = len(raw) - length
    if over > 0:
        extra = meta.get("extra")
        if not isinstance(extra, dict) or len(extra.get("note", "")) < over:
            return None
        raw = json.dumps({**meta, "extra": {**extra, "note": extra["note"][over:]}}).encode()
    return raw + b" " * (length - len(raw))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fused=st.booleans(),
    fp8=st.booleans(),
    big=st.booleans(),
    permissive=st.booleans(),
    kind=st.sampled_from(["flip", "meta", "tokens"]),
    data=st.data(),
)
def test_damage_and_equal_length_edits_of_any_base_give_the_general_readers_verdict(
    tmp_path: Path, fused: bool, fp8: bool, big: bool, permissive: bool, kind: str, data: st.DataObject
) -> None:
    """Bases of key/value or fused (MLA latent) layers, bf16 or fp8 with kv_scales, pools over or under 64 KiB, read
    strict or permissive. Edits of the header group's contents that keep its length (metadata rewritten, token ids)
    keep the layers' structure: they are built from the template, and judged as the general reader judges them.

    The general reader's side is read with ``set_enabled(False)``, which turns off the templates (and the digest
    header's remembered sections) only: the index memo, interned rows and descriptor verdicts serve both sides.
    """
    base = tmp_path / f"base-{fused}-{fp8}-{big}.hrry"
    if not base.exists():
        put(tmp_path, "ba5e", _base(fused, fp8, big)).rename(base)
    template.clear()
    hv.load(base, permissive=permissive)  # learned
    assert template.stats()["learned"] == 1
    raw = bytearray(base.read_bytes())
    if kind == "flip":
        spans = _structure(base)
        for _ in range(data.draw(st.integers(1, 3), label="flips")):
            start, stop = data.draw(st.sampled_from(spans), label="span")
            raw[data.draw(st.integers(start, stop - 1), label="at")] ^= data.draw(st.integers(1, 255), label="xor")
    elif kind == "meta":
        start, stop = _span(base, "snapshot.meta")
        edited = _same_length(data.draw(_meta_edit(json.loads(raw[start:stop])), label="meta"), stop - start)
        if edited is None:
            return
        raw[start:stop] = edited
    else:
        start, stop = _span(base, "snapshot.token_ids")
        n = (stop - start) // 8
        ids = data.draw(st.lists(st.integers(0, 2**17), min_size=n, max_size=n), label="ids")
        if data.draw(st.booleans(), label="hostile"):
            at = data.draw(st.integers(0, n - 1), label="where")
            ids[at] = data.draw(st.sampled_from([-1, 2**31, 2**63 - 1, -(2**63)]), label="value")
        raw[start:stop] = b"".join(i.to_bytes(8, "little", signed=True) for i in ids)
        if data.draw(st.booleans(), label="ptr"):
            start, stop = _span(base, "snapshot.token_ptr")
            ends = data.draw(st.sampled_from([(0, n), (0, n - 1), (1, n), (0, 2**63 - 1), (-1, n)]), label="ends")
            raw[start:stop] = b"".join(i.to_bytes(8, "little", signed=True) for i in ends)
    path = tmp_path / "edited.hrry"
    path.write_bytes(bytes(raw))
    for load in (
        lambda: as_the_store_reads(path, permissive=permissive),  # the header's contents judged, not the digest
        lambda: hv.load(path, permissive=permissive),
    ):
        hits = template.stats()["hits"]
        got = outcome(load)
        if kind != "flip":  # the layers' structure is the base's: built (or refused) from its template
            assert template.stats()["hits"] == hits + 1, got
        assert_same_outcome(got, general(load))
