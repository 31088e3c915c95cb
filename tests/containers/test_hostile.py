"""Hostile input: malformed metadata, tensors and truncations give HurrayFormatError and nothing else.

The only outcomes allowed for a damaged or crafted input: the documented
error (naming the field), or a clean load of data that did not change; and
``validate`` never calls ok a snapshot that ``load`` refuses.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synthetic import save_unchecked

import hurray_vllm as hv
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.containers.io import load_file_bytes, read_file
from hurray_vllm.containers.schema import (
    Record,
    dense_record,
    flatten_tokens,
    group_head,
    layer_records,
    snapshot_metadata,
    snapshot_records,
)
from hurray_vllm.containers.stream import write_records
from hurray_vllm.kv.snapshot import KVSnapshot

SNAP = spec_example_snapshot()

#: Random damages per run; `make fuzz` raises it (HURRAY_FUZZ_EXAMPLES).
FUZZ_EXAMPLES = int(os.environ.get("HURRAY_FUZZ_EXAMPLES", "150"))


def _stream(meta: Any, snap: KVSnapshot = SNAP, *, raw: bytes | None = None) -> bytes:
    """A stream whose header carries ``meta`` (JSON-encoded) or the ``raw`` bytes given."""
    body = raw if raw is not None else json.dumps(meta).encode()
    flat, ptr = flatten_tokens(snap.token_ids)
    records = [
        group_head("snapshot", 3, [len(body)], torch.uint8),
        dense_record("snapshot.meta", torch.frombuffer(bytearray(body), dtype=torch.uint8)),
        dense_record("snapshot.token_ids", flat),
        dense_record("snapshot.token_ptr", ptr),
    ]
    for i, (k, v) in enumerate(snap.layers()):
        records += list(layer_records(i, (k, v), None, {}))
    out = io.BytesIO()
    write_records(records, out)
    return out.getvalue()


def _meta(**changes: Any) -> dict[str, Any]:
    meta = json.loads(json.dumps(snapshot_metadata(SNAP, SNAP.num_layers)))
    for path, value in changes.items():
        node = meta
        *parents, last = path.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    return meta


def test_the_crafted_stream_reads_back_unchanged() -> None:
    back = hv.read_stream(io.BytesIO(_stream(_meta())))
    assert back.token_ids == SNAP.token_ids and back.fingerprint == SNAP.fingerprint


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'{"format": "hurray-vllm.kv_snapshot", "version": 1, "num_layers": 4, "fingerprint": '
         b'{"architecture": "x", "num_layers": 4, "num_kv_heads": 2, "head_dim": Infinity, "dtype": "float16"}}',
         "snapshot.meta"),
        (json.dumps(_meta(request_ids=5)).encode(), "snapshot.meta.request_ids"),
        (json.dumps(_meta(extra=[1])).encode(), "snapshot.meta.extra"),
        (json.dumps(_meta(num_layers=0)).replace('"num_layers": 0', '"num_layers": ' + "9" * 5000).encode(),
         "snapshot.meta"),
        (b"[" * 100_000 + b"]" * 100_000, "snapshot.meta"),
        (json.dumps(_meta(fingerprint__head_dim=8.5)).encode(), "snapshot.fingerprint.head_dim"),
        (json.dumps(_meta(fingerprint__num_layers=True)).encode(), "snapshot.fingerprint.num_layers"),
        (json.dumps(_meta(source__page_size="4")).encode(), "snapshot.source.page_size"),
        (json.dumps(_meta(num_layers=-1)).encode(), "snapshot.meta.num_layers"),
        (json.dumps(_meta(version="1")).encode(), "snapshot.meta.version"),
        (b"\xff\xfe", "snapshot.meta"),
    ],
)  # fmt: skip
def test_malformed_metadata_is_a_format_error_naming_the_field(raw: bytes, field: str) -> None:
    data = _stream(None, raw=raw)
    with pytest.raises(hv.HurrayFormatError) as err:
        hv.read_stream(io.BytesIO(data))
    assert err.value.field == field, err.value


def test_bad_scales_and_tokens_are_refused(tmp_path: Path) -> None:
    from dataclasses import replace

    for bad in ((float("nan"), 1.0), (0.0, 1.0), (1.0, -2.0), (float("inf"), 1.0)):
        snap = replace(SNAP, kv_scales=tuple(bad for _ in range(SNAP.num_layers)))
        assert not snap.validate().ok
        hv.save(replace(SNAP, kv_scales=tuple((1.0, 1.0) for _ in range(SNAP.num_layers))), tmp_path / "ok.hrry")
        assert hv.validate(tmp_path / "ok.hrry").ok
    assert not replace(SNAP, token_ids=((11, 12.5, 13, 14, 15, 16), (1, 2, 3))).validate().ok
    assert not replace(SNAP, token_ids=((-1, 12, 13, 14, 15, 16), (1, 2, 3))).validate().ok
    swapped = replace(SNAP, values=(SNAP.values[1], SNAP.values[0], *SNAP.values[2:]))
    assert "layer_index" in {v.invariant for v in swapped.validate().violations}


# ── safetensors ───────────────────────────────────────────────────────────────


def _safetensors(tmp_path: Path, edit: Any) -> Path:
    """A snapshot saved as .safetensors, its tensors and metadata passed through ``edit(tensors, metadata)``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "s.safetensors"
    hv.save(SNAP, path)
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors, metadata)
    save_file(tensors, str(path), metadata=metadata)
    return path


def _set(key: str, value: Any) -> Any:
    def edit(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        if key in metadata:
            metadata[key] = value
        else:
            tensors[key] = value

    return edit


def _snapshot_meta(**changes: Any) -> Any:
    def edit(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        meta = json.loads(metadata["snapshot"])
        meta.update(changes)
        metadata["snapshot"] = json.dumps(meta)

    return edit


def _descriptor(value: str) -> Any:
    def edit(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        d = json.loads(metadata["descriptors"])
        d["layers.0.key"] = value
        metadata["descriptors"] = json.dumps(d)

    return edit


@pytest.mark.parametrize(
    "edit",
    [
        _descriptor("zz-not-hex"),
        _snapshot_meta(num_layers="4"),
        _snapshot_meta(request_ids=[1, 2]),
        _set("layers.0.kv_scales", torch.empty(0)),
        _set("layers.0.key.seq_lens", torch.tensor([[6, 3]])),
        _set("layers.0.key.block_table", torch.tensor([0, 1 << 32, 0])),
        _set("token_ids", torch.tensor([11.5] * 9)),
        _set("token_ptr", torch.tensor([0, 7, 11], dtype=torch.int32)),
        _set("descriptors", "{"),
        _set("snapshot", "[]"),
        _set("layers.0.key.seq_ptr", torch.tensor([0, 2, 3, 3])),
        _set("layers.0.key.page_pool", torch.zeros(4, 4, 2, 8, dtype=torch.float16)),
    ],
    ids=["bad hex", "num_layers str", "request_ids ints", "empty kv_scales", "2-D seq_lens", "page id 2^32",
         "float token ids", "int32 token_ptr", "descriptors JSON", "snapshot not an object",
         "seq_ptr longer than declared", "pool shorter than declared"],
)  # fmt: skip
def test_malformed_safetensors_is_a_format_error(tmp_path: Path, edit: Any) -> None:
    path = _safetensors(tmp_path, edit)
    with pytest.raises(hv.HurrayFormatError):
        hv.load(path)
    assert not hv.validate(path).ok  # validate runs what load runs: it never raises, and never says ok here


# ── validate agrees with load, under random damage ────────────────────────────


def test_a_stream_cut_after_its_first_layer_is_not_valid(tmp_path: Path) -> None:
    full = _stream(_meta())
    one_layer = KVSnapshot(SNAP.keys[:1], SNAP.values[:1], token_ids=SNAP.token_ids)
    cut = _stream(_meta(), one_layer)  # the header still announces 4 layers
    assert len(cut) < len(full)
    (tmp_path / "cut.hrrs").write_bytes(cut)
    with pytest.raises(hv.HurrayFormatError, match="announces 4 layers"):
        hv.load(tmp_path / "cut.hrrs")
    assert not hv.validate(tmp_path / "cut.hrrs").ok


_FILES: dict[str, bytes] = {}


def _file(fmt: str, tmp: Path) -> bytes:
    if fmt not in _FILES:
        hv.save(SNAP, tmp / f"base{fmt}")
        _FILES[fmt] = (tmp / f"base{fmt}").read_bytes()
    return _FILES[fmt]


_SIZES = [0, 1, 2**32, 2**60, 2**64 - 1]


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fmt=st.sampled_from([".hrry", ".hrrs", ".safetensors"]),
    kind=st.sampled_from(["flip", "truncate", "field"]),
    data=st.data(),
)
def test_random_damage_gives_the_documented_error_or_the_same_data(
    tmp_path: Path, fmt: str, kind: str, data: st.DataObject
) -> None:
    raw = bytearray(_file(fmt, tmp_path))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            raw[data.draw(st.integers(0, len(raw) - 1), label="at")] ^= data.draw(st.integers(1, 255), label="xor")
    elif kind == "truncate":
        del raw[data.draw(st.integers(0, len(raw) - 1), label="cut") :]
    else:  # a size or offset field: any 8 aligned bytes set to a hostile value
        at = data.draw(st.integers(0, max(0, len(raw) // 8 - 1)), label="word") * 8
        raw[at : at + 8] = data.draw(st.sampled_from(_SIZES), label="value").to_bytes(8, "little")
    path = tmp_path / f"damaged{fmt}"
    path.write_bytes(bytes(raw))
    field = None
    try:
        back = hv.load(path)
    except hv.HurrayFormatError as exc:
        loaded, field = False, exc.field
    else:
        loaded = True
        assert back.num_layers == SNAP.num_layers
    checked = hv.validate(path)  # never raises
    if checked.ok:
        assert loaded, f"validate said ok where load refused ({kind} {fmt})"
    if fmt != ".safetensors":  # read whole first (what a chunk reader does on its helper thread): the same verdict
        try:
            ahead = load_file_bytes(read_file(path))
        except hv.HurrayFormatError as exc:
            assert (loaded, exc.field) == (False, field)
        else:
            assert loaded and ahead.token_ids == back.token_ids
            # Bit for bit: damage may leave a NaN in a pool, which torch.equal calls unequal to itself.
            assert all(
                torch.equal(a.page_pool.view(torch.uint8), b.page_pool.view(torch.uint8))
                for a, b in zip(ahead.keys, back.keys, strict=True)
            )


# ── crafted structure: offsets into the header, huge groups ───────────────────


def _patch_index(path: Path, edit: Any) -> None:
    """Rewrite ``path``'s index entries through ``edit(name, (d_off, d_len, data_off, data_len), entries)``, CRC
    recomputed; ``entries`` maps every name read so far to its entry. ``edit`` returns the new entry or None."""
    import struct

    from hurray_vllm.wire.crc32c import crc32c

    raw = bytearray(path.read_bytes())
    index_off, index_len, *_ = struct.unpack_from("<QQQII", raw, len(raw) - 40)
    index = bytearray(raw[index_off : index_off + index_len])
    pos, patched, seen = 8, False, {}
    for _ in range(struct.unpack_from("<Q", index, 0)[0]):
        (n,) = struct.unpack_from("<H", index, pos)
        name = bytes(index[pos + 2 : pos + 2 + n]).decode()
        at = pos + 2 + n
        d_off, d_len, data_off, data_len, flags = struct.unpack_from("<QIQQI", index, at)
        seen[name] = (d_off, d_len, data_off, data_len)
        new = edit(name, seen[name], seen)
        if new is not None:
            struct.pack_into("<QIQQI", index, at, *new, flags)
            patched = True
        pos = at + 32
    assert patched
    raw[index_off : index_off + index_len] = index
    struct.pack_into("<I", raw, len(raw) - 40 + 32 - 4, crc32c(bytes(index)))
    path.write_bytes(bytes(raw))


def test_an_index_entry_pointing_into_the_header_is_refused(tmp_path: Path) -> None:
    """Data offset 0 with the CRC recomputed: the header would be read as token ids."""
    path = tmp_path / "s.hrry"
    hv.save(SNAP, path)
    _patch_index(path, lambda name, e, _: (e[0], e[1], 0, e[3]) if name == "snapshot.token_ids" and e[3] else None)
    with pytest.raises(hv.HurrayFormatError, match="header") as err:
        hv.load(path)
    assert err.value.field == "file.index.data_offset"
    assert not hv.validate(path).ok


def _crafted_index_file(seed: int, rows: int = 1778) -> bytes:
    """A file of one index (CRC right) of ``rows`` rows of two-character names, every one a descriptor of 0 bytes
    at offset 64: ~64 KiB that parse (no two rows share a byte), of a file that fails when its records are read."""
    import struct

    from hurray_vllm.wire.crc32c import crc32c

    names = [chr(33 + (seed + i) // 94 % 94) + chr(33 + (seed + i) % 94) for i in range(rows)]
    assert len(set(names)) == rows
    index = struct.pack("<Q", rows) + b"".join(
        struct.pack("<H", 2) + n.encode() + struct.pack("<QIQQI", 64, 0, 64, 0, 0) for n in names
    )
    header = b"HRRYFILE" + struct.pack("<BBHIIQQ", 1, 0, 0, 4, 4096, 64, 2**64 - 1) + bytes(28)
    trailer = struct.pack("<QQQII", 64, len(index), 0, 0, crc32c(index)) + bytes(4) + b"HRRY"
    return header + index + trailer


def test_the_index_memo_is_bounded_by_the_memory_it_holds(tmp_path: Path) -> None:
    """Found by a review: the memo kept 256 indexes of up to 64 KiB each, whatever they held. A crafted index of
    64 KB holds 1,778 rows: ~0.4 MB of objects. Its file fails later (the index parse succeeded, so it stayed
    remembered): 256 such files pinned ~120 MB."""
    import gc
    import tracemalloc

    from hurray_vllm.containers import hrryfile
    from hurray_vllm.containers.hrryfile import FileBytes, HrryFile

    files = [_crafted_index_file(seed * 1778) for seed in range(4)]
    # What the memo counts a row at is at least what one holds.
    hrryfile._indexes.clear()
    hrryfile._ENTRIES.clear()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with HrryFile(tmp_path / "x.hrry", data=FileBytes(tmp_path / "x.hrry", memoryview(files[0]))) as hf:
            rows = len(hf.entries)
        hrryfile._ENTRIES.clear()  # the interning table: bounded on its own (8192 rows)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert rows == 1778 and len(hrryfile._indexes) == 1
    assert held <= hrryfile._indexes.cost <= len(files[0]) + rows * (hrryfile._ROW_BYTES + 64)
    # Many such files: what the memo keeps stays within its bound, least recently used out first.
    files = [_crafted_index_file(seed * 1778) for seed in range(16)]
    hrryfile._indexes.clear()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, raw in enumerate(files):
            with pytest.raises(hv.HurrayFormatError):
                load_file_bytes(FileBytes(tmp_path / f"{i}.hrry", memoryview(raw)))
        hrryfile._ENTRIES.clear()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < len(hrryfile._indexes) < len(files)
    assert hrryfile._indexes.cost <= hrryfile._MEMO_HELD_BYTES
    assert held <= hrryfile._MEMO_HELD_BYTES  # 16 of them held ~6 MB
    hrryfile._indexes.clear()


def test_index_entries_sharing_bytes_are_refused(tmp_path: Path) -> None:
    """Every layer's entry pointing at one pool read (and copied) it once per entry: memory far beyond the file."""
    path = tmp_path / "s.hrry"
    hv.save(SNAP, path)

    def onto_layer_0(name: str, e: tuple[int, ...], seen: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
        return (e[0], e[1], *seen["layers.0.key"][2:]) if name == "layers.1.key" else None

    _patch_index(path, onto_layer_0)
    with pytest.raises(hv.HurrayFormatError, match="overlap") as err:
        hv.load(path)
    assert err.value.field == "file.index"
    assert not hv.validate(path).ok


def test_a_kv_tensor_of_no_heads_and_a_pointer_not_from_0_are_refused_even_permissively(tmp_path: Path) -> None:
    """Both read as a file of zero-byte pools or shifted sequences, and broke whatever used them later."""
    from dataclasses import replace

    for damage in ("heads", "seq_ptr"):
        layers = []
        for k, v in zip(SNAP.keys, SNAP.values, strict=True):
            if damage == "heads":
                k, v = (replace(t, page_pool=t.page_pool[:, :, :0]) for t in (k, v))
            layers.append((k, v))
        snap = KVSnapshot.from_layers(layers, token_ids=SNAP.token_ids)
        path = tmp_path / f"{damage}.hrrs"
        if damage == "heads":
            with pytest.raises(hv.HurrayFormatError):
                hv.save(snap, path)  # what load refuses is not written
        save_unchecked(snap, path) if damage == "heads" else hv.save(SNAP, path)
        if damage == "seq_ptr":
            raw = bytearray(path.read_bytes())
            first = hv.load(path)[0, "key"].seq_ptr
            assert first.tolist() == [0, 2, 3]
            at = raw.find(bytes(torch.tensor([0, 2, 3], dtype=torch.int32).numpy().tobytes()))
            assert at > 0
            raw[at : at + 12] = torch.tensor([1, 2, 3], dtype=torch.int32).numpy().tobytes()
            path.write_bytes(bytes(raw))
        for permissive in (False, True):
            with pytest.raises(hv.HurrayFormatError) as err:
                hv.load(path, permissive=permissive)
            assert err.value.field == ("shape.heads" if damage == "heads" else "seq_ptr.first")
        assert not hv.validate(path).ok


def test_a_group_of_a_million_members_is_refused_before_it_is_read() -> None:
    from hurray_vllm.containers.schema import MAX_RECORDS

    out = io.BytesIO()
    write_records([group_head("g", 1_000_000, [0], torch.uint8)], out)
    out.write(b"\0" * 1000)
    with pytest.raises(hv.HurrayFormatError, match=f"at most {MAX_RECORDS}"):
        hv.read_stream(io.BytesIO(out.getvalue()))


@pytest.mark.parametrize("case", ["no seq_lens (hrry)", "no seq_lens (hrrs)", "header swallows the layers"])
def test_validate_and_load_agree_on_what_they_once_judged_apart(tmp_path: Path, case: str) -> None:
    """Found by a review: validate refused lengths load reads as unknown, and checked only Hurray rules for a
    stream header whose member count swallowed the layers. (Bare KV tensors without a header stay Hurray data
    that validate checks by the Hurray rules alone: tests/containers/test_io.py.)"""
    from dataclasses import replace

    path = tmp_path / ("s.hrry" if "hrry" in case else "s.hrrs")
    if case.startswith("no seq_lens"):
        hv.save(SNAP.with_layers([tuple(replace(t, seq_lens=None) for t in m) for m in SNAP.layer_members()]), path)
    else:
        hv.save(SNAP, path)
        raw = bytearray(path.read_bytes())
        assert raw[40] == 3  # the header group's member count
        raw[40] = 7
        path.write_bytes(bytes(raw))
    try:
        hv.load(path)
        loaded = True
    except hv.HurrayFormatError:
        loaded = False
    assert hv.validate(path).ok == loaded
    assert loaded == case.startswith("no seq_lens")


def _stream_of(records: list[Record]) -> bytes:
    out = io.BytesIO()
    write_records(records, out)
    return out.getvalue()


def test_a_header_swallowed_by_a_widened_group_is_not_called_valid(tmp_path: Path) -> None:
    """A copy of the header group, its member count raised to take the header and every layer in: validate
    must look inside to see a snapshot that load refuses (it said ok)."""
    from dataclasses import replace

    from hurray_vllm.wire.descriptor import CompositeFields

    recs = list(snapshot_records(spec_example_snapshot()))
    head = recs[0]
    assert head.descriptor.composite is not None
    wide = replace(head.descriptor, layout=CompositeFields(rule_tag=head.descriptor.composite.rule_tag, member_count=5))
    path = tmp_path / "wide.hrrs"
    path.write_bytes(_stream_of([Record(head.name, wide, []), *recs]))
    for permissive in (False, True):
        with pytest.raises(hv.HurrayFormatError):
            hv.load(path, permissive=permissive)
        assert not hv.validate(path, permissive=permissive).ok


def test_a_permissive_read_refuses_an_unreadable_tensor_in_a_group_it_leaves_out(tmp_path: Path) -> None:
    """A group after the snapshot holding a block-paged tensor whose table points past its pool: validate
    refuses it, so load does, even permissively (it used to skip the group)."""
    snap = spec_example_snapshot()
    k = snap.keys[0]
    pool, table, ptr = k.wire_buffers()
    table = table.clone()
    table[0] = 99  # the pool has 5 pages
    extra = [group_head("g", 1, k.shape, k.dtype), Record("x", k.descriptor(device_tag=0), [pool, table, ptr])]
    path = tmp_path / "extra.hrrs"
    path.write_bytes(_stream_of([*snapshot_records(snap), *extra]))
    for permissive in (False, True):
        assert not hv.validate(path, permissive=permissive).ok
        with pytest.raises(hv.HurrayFormatError):
            hv.load(path, permissive=permissive)


def test_a_huge_dimension_of_an_empty_record_is_named_not_a_torch_error() -> None:
    """token ids of shape [0, 2^64 - 1]: the empty buffer "holds" it; the reader names the field."""
    from dataclasses import replace

    recs = list(snapshot_records(replace(spec_example_snapshot(), token_ids=())))
    ids = next(i for i, r in enumerate(recs) if r.name == "snapshot.token_ids")
    recs[ids] = Record(recs[ids].name, replace(recs[ids].descriptor, shape=(0, 2**64 - 1)), recs[ids].buffers)
    with pytest.raises(hv.HurrayFormatError) as exc:
        hv.read_stream(io.BytesIO(_stream_of(recs)))
    assert exc.value.field == "snapshot.token_ids"


# ── permissive reads agree with permissive validation ─────────────────────────


def _bare_uint64_layer(table: bytes, ptr: bytes, waived: int = 0) -> bytes:
    """A bare stream (no header) of layer 0's key and value: uint64 indices, one page, one sequence.

    ``waived``: the pool buffer's reserved byte (``buffers.reserved``, a rule permissive reads waive).
    """
    from hurray_vllm.wire.descriptor import LAYOUT_BLOCK_PAGED, BlockPagedFields, BufferHandle, TensorDescriptor

    pool = torch.zeros(2 * 1 * 4, dtype=torch.float16)  # 1 page of 2 tokens, 1 head of 4
    records = []
    for role in (0, 1):
        d = TensorDescriptor(
            type_tag=0x01,
            shape=(1, 1, 4),
            layout_tag=LAYOUT_BLOCK_PAGED,
            layout=BlockPagedFields(
                page_size=2, num_pages=1, num_seqs=1, kv_role_tag=role, layer_index=0, index_type_tag=0x01
            ),
            buffers=(
                BufferHandle(16, 64, 0, reserved=waived),
                BufferHandle(len(table), 64, 0),
                BufferHandle(len(ptr), 64, 0),
            ),
        )
        bufs = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in (table, ptr)]
        records.append(Record("", d, [pool, *bufs]))
    return _stream_of(records)


@pytest.mark.parametrize(
    ("table", "ptr", "field"),
    [
        (b"\xff" * 8, (0).to_bytes(8, "little") + (1).to_bytes(8, "little"), "block_table.page_id"),
        ((0).to_bytes(8, "little"), (0).to_bytes(8, "little") + b"\xff" * 8, "seq_ptr.last"),
    ],
    ids=["table", "seq_ptr"],
)
def test_a_uint64_index_no_int64_holds_is_structural(tmp_path: Path, table: bytes, ptr: bytes, field: str) -> None:
    """Found by a review: the error was named ``block_table``, not a structural rule, so a permissive validate
    called ok a file permissive load refuses; and it hid the record's other violations."""
    path = tmp_path / "bare.hrrs"
    path.write_bytes(_bare_uint64_layer(table, ptr, waived=1))
    for permissive in (False, True):
        checked = hv.validate(path, permissive=permissive)
        assert not checked.ok
        found = {v.invariant for v in checked.violations}
        assert field in found
        assert "buffers.reserved" in found  # the descriptor's own rules are reported too
        with pytest.raises(hv.HurrayFormatError) as err:
            hv.load(path, permissive=permissive)
        # Strict: the reserved byte first. Permissive: the index, structural, so refused in every mode.
        assert err.value.field in (("block_table.page_id", "seq_ptr.last") if permissive else ("buffers.reserved",))


def _with_reserved_flag(snap: KVSnapshot, target: str) -> bytes:
    """``snap``'s stream with ``target``'s first buffer's reserved byte set: a waivable rule (``buffers.reserved``).

    Was a reserved flag bit, which the spec refuses in every mode (``flags.reserved`` is structural now).
    """
    from dataclasses import replace

    recs = list(snapshot_records(snap))
    assert any(r.name == target for r in recs)

    def waived(d):  # type: ignore[no-untyped-def]
        return replace(d, buffers=(replace(d.buffers[0], reserved=1), *d.buffers[1:]))

    return _stream_of([Record(r.name, waived(r.descriptor), r.buffers) if r.name == target else r for r in recs])


def _hybrid() -> KVSnapshot:
    from dataclasses import replace

    from hurray_vllm.kv.states import RecurrentStates

    s = len(SNAP.seq_lens)
    tensors = ((torch.ones(s, 2, 4), torch.ones(s, 1, 4, 4)),)
    return replace(SNAP, states=RecurrentStates("gdn_attn", (4,), ("conv", "ssm"), tuple(SNAP.seq_lens), tensors))


@pytest.mark.parametrize(
    "target",
    [
        "snapshot.meta",
        "snapshot.token_ids",
        "snapshot.token_ptr",
        "layers.0.seq_lens",
        "layers.2.kv_scales",
        "states.0.ssm",
    ],
)
def test_a_permissive_load_waives_a_row_major_records_waivable_rules(tmp_path: Path, target: str) -> None:
    """Found by a review: the row-major records' own rules were checked strictly in every mode, so a permissive
    load refused a reserved flag bit that docs/format.md (and permissive validation) waive."""
    from dataclasses import replace

    snap = SNAP
    if target.endswith("kv_scales"):
        snap = replace(SNAP, kv_scales=tuple((1.0, 1.0) for _ in range(SNAP.num_layers)))
    elif target.startswith("states"):
        snap = _hybrid()
    assert snap.validate().ok
    path = tmp_path / "flagged.hrrs"
    path.write_bytes(_with_reserved_flag(snap, target))
    with pytest.raises(hv.HurrayFormatError) as err:
        hv.load(path)
    assert err.value.field == "buffers.reserved"
    assert not hv.validate(path).ok
    back = hv.load(path, permissive=True)
    assert back.token_ids == snap.token_ids and back.num_layers == snap.num_layers
    checked = hv.validate(path, permissive=True)
    assert checked.ok and "buffers.reserved" in {v.invariant for v in checked.violations}


@pytest.mark.parametrize("fmt", [".hrrs", ".hrry", ".safetensors"])
def test_a_header_announcing_other_sequences_than_the_layers_hold_is_refused(tmp_path: Path, fmt: str) -> None:
    """Found by a review: the header's num_seqs was decoded and never compared with the layers'."""
    assert SNAP.num_seqs == 2
    if fmt == ".hrrs":
        path = tmp_path / "s.hrrs"
        path.write_bytes(_stream(_meta(num_seqs=3)))
    elif fmt == ".hrry":
        path = tmp_path / "s.hrry"
        hv.save(SNAP, path)
        raw = path.read_bytes()
        assert raw.count(b'"num_seqs": 2') == 1
        path.write_bytes(raw.replace(b'"num_seqs": 2', b'"num_seqs": 3'))
    else:
        path = _safetensors(tmp_path, _snapshot_meta(num_seqs=3))
    for permissive in (False, True):
        with pytest.raises(hv.HurrayFormatError, match="announces 3 sequences") as err:
            hv.load(path, permissive=permissive)
        assert err.value.field == "snapshot.num_seqs"
        checked = hv.validate(path, permissive=permissive)
        assert not checked.ok and "snapshot.num_seqs" in {v.invariant for v in checked.errors}
    # A header without num_seqs announces none, and the snapshot's own count passes.
    if fmt == ".hrrs":
        meta = _meta()
        del meta["num_seqs"]
        path.write_bytes(_stream(meta))
        assert hv.load(path).num_seqs == 2 and hv.validate(path).ok
        path.write_bytes(_stream(_meta()))
        assert hv.validate(path).ok


def test_sections_beyond_a_reads_bound_are_refused_before_they_are_read(tmp_path: Path) -> None:
    """HrryFile(max_section_bytes=...): a header read's bound on the index, the KV section and each descriptor."""
    from hurray_vllm.containers.hrryfile import HrryFile, write_file

    records = [dense_record("x", torch.zeros(4, dtype=torch.uint8))]
    plain, with_kv = tmp_path / "plain.hrry", tmp_path / "kv.hrry"
    write_file(records, plain)
    write_file(records, with_kv, kv={"note": "n" * 1000})
    with HrryFile(plain) as hf:  # the index: 8 + 34 + 1 bytes; the descriptor more
        (entry,) = hf.entries
        assert entry.descriptor_length > 43
    with HrryFile(plain, max_section_bytes=43) as hf:  # the index passes
        with pytest.raises(hv.HurrayFormatError) as err:
            hf.read(hf.entries[0])
        assert err.value.field == "x.descriptor"
    with pytest.raises(hv.HurrayFormatError) as err:
        HrryFile(plain, max_section_bytes=42)
    assert err.value.field == "file.index" and "43 bytes" in str(err.value)
    with pytest.raises(hv.HurrayFormatError) as err:
        HrryFile(with_kv, max_section_bytes=500)
    assert err.value.field == "file.kv"
    with HrryFile(with_kv) as hf:  # no bound: as before
        assert hf.kv == {"note": "n" * 1000}
        assert torch.equal(hf.read(hf.entries[0]).buffers[0], torch.zeros(4, dtype=torch.uint8))


# ── a chunk's digest: load, validate and the chunk store's consumers give one verdict ──


def _flipped(chunk: KVSnapshot, tensor: int, at: int, xor: int) -> KVSnapshot:
    """``chunk`` with byte ``at`` of its ``tensor``-th digested page pool xor-ed with ``xor``; its digest kept."""
    from dataclasses import replace

    from hurray_vllm.chunks.digest import digest_tensors

    tensors = digest_tensors(chunk)
    t = tensors[tensor]
    raw = t.page_pool.contiguous().clone()
    flat = raw.view(-1).view(torch.uint8)
    flat[at % flat.numel()] ^= xor
    tensors[tensor] = replace(t, page_pool=raw)
    n = chunk.num_layers
    return replace(chunk, keys=tuple(tensors[:n]), values=tuple(tensors[n:]))


@settings(max_examples=FUZZ_EXAMPLES // 10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from([".hrry", ".hrrs", ".safetensors"]), data=st.data())
def test_a_chunk_whose_pools_do_not_match_its_digest_is_refused_by_load_and_validate_as_by_its_consumers(
    tmp_path: Path, fmt: str, data: st.DataObject
) -> None:
    """Found by a review: a store chunk with a flipped pool byte was valid to ``hurray-vllm validate`` and
    ``hv.load`` (without --key-file nothing checked its CRC-32C digest) while the connector refused and
    quarantined it. Now every reader of a file says what the connector says: ``snapshot.digest``, damaged."""
    from synthetic import example_chunk

    from hurray_vllm.chunks.digest import DIGEST_MISMATCH, digest_tensors
    from hurray_vllm.chunks.store import DirectoryStore
    from hurray_vllm.chunks.verify import check_data
    from hurray_vllm.containers.safetensors import save_safetensors

    ns, key, chunk = example_chunk()
    tensor = data.draw(st.integers(0, len(digest_tensors(chunk)) - 1), label="tensor")
    damaged = _flipped(chunk, tensor, data.draw(st.integers(0, 1 << 20), label="at"), data.draw(st.integers(1, 255)))
    store = DirectoryStore(tmp_path / "store")
    if fmt == ".hrry":  # as the store holds it
        store.put(ns, key, damaged, replace=True)
        path = store.path(ns, key)
    elif fmt == ".hrrs":
        path = tmp_path / "chunk.hrrs"
        save_unchecked(damaged, path)
    else:
        path = tmp_path / "chunk.safetensors"
        save_safetensors(damaged, path)
    for permissive, mmap in ((False, False), (False, True), (True, False)):
        with pytest.raises(hv.HurrayFormatError) as refused:
            hv.load(path, permissive=permissive, mmap=mmap)
        assert (refused.value.field, str(refused.value)) == ("snapshot.digest", f"snapshot.digest: {DIGEST_MISMATCH}")
        checked = hv.validate(path, permissive=permissive)
        assert not checked.ok and checked.errors == refused.value.violations
    if fmt != ".safetensors":  # the same verdict from bytes read first
        with pytest.raises(hv.HurrayFormatError) as ahead:
            load_file_bytes(read_file(path))
        assert str(ahead.value) == str(refused.value)
    if fmt == ".hrry":  # the same error a consumer (connector, fsck) gives for it
        with pytest.raises(hv.HurrayFormatError) as consumer:
            check_data(store.get(ns, key))
        assert str(consumer.value) == str(refused.value)


@pytest.mark.parametrize("digest", ["crc32:00000000", "00", "sha3/v2:00000000", 7])
def test_a_chunk_digest_that_cannot_be_checked_here_is_no_verdict_on_the_file(tmp_path: Path, digest: Any) -> None:
    """An old (0.1), unknown or malformed digest: consumers refuse the chunk but leave it (no damage found),
    fsck lists it as unverified; ``load`` and ``validate`` read it, as before."""
    from dataclasses import replace

    from synthetic import example_chunk

    from hurray_vllm.chunks.digest import DIGEST_KEY

    _, _, chunk = example_chunk()
    for fmt in (".hrry", ".hrrs"):
        path = tmp_path / f"old{fmt}"
        hv.save(replace(chunk, extra={**chunk.extra, DIGEST_KEY: digest}), path)
        assert hv.load(path).extra[DIGEST_KEY] == digest
        assert hv.validate(path).ok


def test_save_writes_no_chunk_whose_data_does_not_match_its_digest(tmp_path: Path) -> None:
    """What load refuses is not written: a chunk changed after its digest was computed is refused by save."""
    from synthetic import example_chunk

    from hurray_vllm.chunks.digest import DIGEST_MISMATCH

    _, _, chunk = example_chunk()
    damaged = _flipped(chunk, 0, 0, 1)
    # validate() of the snapshot in memory says what save() does: ok is what save writes.
    checked = hv.validate(damaged)
    assert not checked.ok and [v.invariant for v in checked.errors] == ["snapshot.digest"]
    assert hv.validate(chunk).ok
    for fmt in (".hrry", ".hrrs", ".safetensors"):
        with pytest.raises(hv.HurrayFormatError) as refused:
            hv.save(damaged, tmp_path / f"c{fmt}")
        assert str(refused.value) == f"snapshot.digest: {DIGEST_MISMATCH}"
        assert checked.errors == refused.value.violations
        assert not (tmp_path / f"c{fmt}").exists()
        hv.save(chunk, tmp_path / f"c{fmt}")  # intact: written, and read back
        assert hv.load(tmp_path / f"c{fmt}").extra == chunk.extra


def _index_off(path: Path) -> int:
    import struct

    raw = path.read_bytes()
    return int(struct.unpack_from("<Q", raw, len(raw) - 40)[0])


@pytest.mark.parametrize(
    ("target", "field", "says"),
    [
        # The group head's descriptor moved onto the index (8-aligned, past every other region).
        ("descriptor", "file.index.descriptor_offset", "descriptor is out of place"),
        # The last buffer (ending at the KV section) made to run one byte into the index.
        ("data", "file.index.data_offset", "data is out of place"),
    ],
)
def test_an_index_entry_running_into_the_index_is_refused(tmp_path: Path, target: str, field: str, says: str) -> None:
    """The index's own bytes would be read as a descriptor or as tensor data (its CRC vouches only for itself)."""
    path = tmp_path / "s.hrry"
    hv.save(SNAP, path)
    index_off = _index_off(path)

    def edit(name: str, e: tuple[int, ...], _: Any) -> tuple[int, ...] | None:
        if target == "descriptor" and name == "snapshot":
            assert index_off % 8 == 0 and e[3] == 0  # a group head: no data of its own
            return (index_off, e[1], e[2], e[3])
        if target == "data" and name == "layers.3.seq_lens":
            assert e[2] + e[3] < index_off
            return (e[0], e[1], e[2], index_off + 1 - e[2])
        return None

    _patch_index(path, edit)
    with pytest.raises(hv.HurrayFormatError, match=says) as err:
        hv.load(path)
    assert err.value.field == field
    assert not hv.validate(path).ok


def test_index_entries_sharing_one_byte_are_refused(tmp_path: Path) -> None:
    """The group head's descriptor stretched to end one byte into the next region (the next descriptor)."""
    from hurray_vllm.containers.hrryfile import HrryFile

    path = tmp_path / "s.hrry"
    hv.save(SNAP, path)
    with HrryFile(path) as hf:
        head, nxt = sorted(hf.entries, key=lambda e: e.descriptor_offset)[:2]
    assert (head.name, nxt.name) == ("snapshot", "snapshot.meta") and head.data_length == 0
    assert head.descriptor_offset + head.descriptor_length < nxt.descriptor_offset  # apart, as written
    stretched = nxt.descriptor_offset + 1 - head.descriptor_offset
    _patch_index(path, lambda name, e, _: (e[0], stretched, e[2], e[3]) if name == "snapshot" else None)
    with pytest.raises(hv.HurrayFormatError, match=r"'snapshot' and 'snapshot\.meta' overlap") as err:
        hv.load(path)
    assert err.value.field == "file.index"
    assert not hv.validate(path).ok


def test_a_kv_bool_other_than_0_or_1_is_refused(tmp_path: Path) -> None:
    """A bool byte of 2 read as True: two files of different bytes would say the same."""
    import struct

    from hurray_vllm.containers.hrryfile import write_file

    path = tmp_path / "kv.hrry"
    write_file(snapshot_records(SNAP), path, kv={"flag": True})
    assert hv.load(path).token_ids == SNAP.token_ids
    raw = bytearray(path.read_bytes())
    kv_off, kv_len = struct.unpack_from("<QI", raw, len(raw) - 40 + 16)  # trailer: index off, len, KV off, len
    assert raw[kv_off + kv_len - 1] == 1  # the value of the one key, last in the section
    raw[kv_off + kv_len - 1] = 2
    path.write_bytes(bytes(raw))
    with pytest.raises(hv.HurrayFormatError, match="neither 0 nor 1") as err:
        hv.load(path)
    assert err.value.field == "kv"
    assert not hv.validate(path).ok


def test_a_token_ptr_that_goes_back_is_refused(tmp_path: Path) -> None:
    """[0, 12, 11] runs from 0 to the 11 ids: sequence 0 would take them all and sequence 1 none."""
    path = _safetensors(tmp_path, _set("token_ptr", torch.tensor([0, 12, 11])))
    with pytest.raises(hv.HurrayFormatError, match="non-decreasing") as err:
        hv.load(path)
    assert err.value.field == "snapshot.token_ptr"
    assert not hv.validate(path).ok
