"""Streams and .hrry files: round trips, the reference implementation both ways, bad input."""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from blocking import within
from conftest import require
from hypothesis import given
from hypothesis import strategies as st
from pyhurray_bridge import to_reference
from strategies import same_snapshot, same_tensor, snapshots

import hurray_vllm as hv
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.containers import hrryfile, schema, stream
from hurray_vllm.containers.hrryfile import FileBytes, HrryFile
from hurray_vllm.wire.crc32c import crc32c
from hurray_vllm.wire.descriptor import peek_descriptor_length
from hurray_vllm.wire.rules import Checked


@given(snapshots())
def test_stream_round_trip(snap: hv.KVSnapshot) -> None:
    buf = io.BytesIO()
    n = hv.write_stream(snap, buf)
    assert n == len(buf.getvalue())
    buf.seek(0)
    assert same_snapshot(snap, hv.read_stream(buf))


@given(snapshots(), st.booleans())
def test_file_round_trip(tmp_path_factory: pytest.TempPathFactory, snap: hv.KVSnapshot, mmap: bool) -> None:
    path = tmp_path_factory.mktemp("rt") / "snap.hrry"
    hv.save(snap, path)
    back = hv.load(path, mmap=mmap)
    assert same_snapshot(snap, back)
    assert hv.validate(path).ok


def test_format_is_detected_by_magic(tmp_path: Path) -> None:
    snap = spec_example_snapshot()
    hv.save(snap, tmp_path / "a.hrry")
    hv.save(snap, tmp_path / "b.hrrs")
    os.rename(tmp_path / "a.hrry", tmp_path / "a.bin")
    os.rename(tmp_path / "b.hrrs", tmp_path / "b.bin")
    assert hv.detect_format(tmp_path / "a.bin") == "hrry"
    assert hv.detect_format(tmp_path / "b.bin") == "stream"
    assert same_snapshot(hv.load(tmp_path / "a.bin"), hv.load(tmp_path / "b.bin"))


def test_unknown_suffix_is_refused(tmp_path: Path) -> None:
    with pytest.raises(hv.HurrayArgumentError, match="path"):
        hv.save(spec_example_snapshot(), tmp_path / "x.bin")


# ── the reference implementation reads what we write ────────────────────────


def _pool_of(ref_tensor) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.asarray(ref_tensor.buffer(0))


@given(snapshots())
def test_reference_reads_our_files(hurray, tmp_path_factory: pytest.TempPathFactory, snap: hv.KVSnapshot) -> None:
    d = tmp_path_factory.mktemp("ref")
    hv.save(snap, d / "s.hrry")
    hv.save(snap, d / "s.hrrs")
    from_file = hurray.load(str(d / "s.hrry"))
    from_stream = list(hurray.StreamReader(str(d / "s.hrrs")))
    states = snap.states.tensors if snap.states is not None else ()
    named = {"snapshot", *(f"layers.{i}" for i in range(snap.num_layers)), *(f"states.{j}" for j in range(len(states)))}
    assert set(from_file) == named
    assert len(from_stream) == 1 + snap.num_layers + len(states)
    for j, layer in enumerate(states):  # a linear-attention hybrid's states: plain row-major tensors
        for group in (from_file[f"states.{j}"], from_stream[1 + snap.num_layers + j]):
            for ours, ref in zip(layer, group.members, strict=True):
                assert tuple(ref.shape) == tuple(ours.shape)
                assert np.asarray(ref.buffer(0)).tobytes() == bytes(ours.contiguous().view(torch.uint8).numpy())
    n = len(snap.roles)  # K and V, or one fused MLA latent
    for i, layer in enumerate(snap.layer_members()):
        for group in (from_file[f"layers.{i}"], from_stream[1 + i]):
            members = group.members
            assert [m.layout.kv_role for m in members[:n]] == list(snap.roles)
            for ours, ref in zip(layer, members[:n], strict=True):
                for j, buf in enumerate(ours.wire_buffers()):
                    assert np.asarray(ref.buffer(j)).tobytes() == bytes(buf.view(torch.uint8).reshape(-1).numpy())
            lens = np.frombuffer(np.asarray(members[n].buffer(0)).tobytes(), dtype=np.int64)
            assert lens.tolist() == snap.seq_lens
    assert hurray.load_kv(str(d / "s.hrry")) == {"hurray_vllm.format_version": 1}


# ── we read what the reference implementation writes ────────────────────────


def test_we_read_reference_composite_files_and_streams(hurray, tmp_path: Path) -> None:
    snap = spec_example_snapshot(num_layers=2)
    groups = {}
    for i, (k, v) in enumerate(snap.layers()):
        lens = hurray.Tensor(np.array(snap.seq_lens, dtype=np.int64).tobytes(), hurray.int64, [len(snap.seq_lens)])
        groups[f"layers.{i}"] = hurray.Composite(
            "group",
            shape=list(k.shape),
            dtype=hurray.float16,
            members=[to_reference(hurray, k), to_reference(hurray, v), lens],
        )
    hurray.save(str(tmp_path / "ref.hrry"), groups, kv={"producer": "pyhurray"})
    with hurray.StreamWriter(str(tmp_path / "ref.hrrs")) as w:
        for g in groups.values():
            w.write_composite(g)
    for name in ("ref.hrry", "ref.hrrs"):
        back = hv.load(tmp_path / name)
        assert back.num_layers == 2 and back.fingerprint is None
        for i in range(2):
            assert same_tensor(back[i, "key"], snap[i, "key"])
            assert same_tensor(back[i, "value"], snap[i, "value"])
        assert hv.validate(tmp_path / name).ok
    assert HrryFile(tmp_path / "ref.hrry").kv == {"producer": "pyhurray"}


@given(snapshots())
def test_we_read_reference_bare_descriptors(
    hurray, tmp_path_factory: pytest.TempPathFactory, snap: hv.KVSnapshot
) -> None:
    d = tmp_path_factory.mktemp("bare")
    tensors = {}
    with hurray.StreamWriter(str(d / "bare.hrrs")) as w:
        for i, t in enumerate(snap.tensors()):
            ref = to_reference(hurray, t)
            w.write(ref)
            tensors[f"t{i}.{t.kv_role}"] = ref
    hurray.save(str(d / "bare.hrry"), tensors)
    if snap.is_latent:
        # Bare fused tensors do not say how they divide (nor that they are MLA latents): refused, by name.
        for name in ("bare.hrrs", "bare.hrry"):
            with pytest.raises(hv.HurrayFormatError, match=r"snapshot\.latent"):
                hv.load(d / name)
        return
    for name in ("bare.hrrs", "bare.hrry"):
        back = hv.load(d / name)
        assert back.num_layers == snap.num_layers
        for i in range(snap.num_layers):
            assert back[i, "key"].seq_lens is None  # nothing on the wire carries them
            assert back[i, "key"].shape == snap[i, "key"].shape
            assert torch.equal(back[i, "value"].block_table, snap[i, "value"].block_table)
            assert torch.equal(back[i, "key"].page_pool.view(torch.uint8), snap[i, "key"].page_pool.view(torch.uint8))


@pytest.mark.parametrize("suffix", [".hrry", ".hrrs"])
def test_validate_says_what_load_says_of_a_lone_key_record(tmp_path: Path, suffix: str) -> None:
    """Found by a review: hv.validate called ok a file with a block-paged key and no value, which load refuses."""
    from hurray_vllm.containers.io import save_records

    k = spec_example_snapshot()[0, "key"]
    path = tmp_path / f"lone{suffix}"
    save_records([schema.Record("layers.0.key", k.descriptor(device_tag=0), k.wire_buffers())], path)
    with pytest.raises(hv.HurrayFormatError) as exc:
        hv.load(path)
    checked = hv.validate(path)
    assert not checked.ok and exc.value.field in [v.invariant for v in checked.errors]


@pytest.mark.parametrize("suffix", [".hrry", ".hrrs"])
def test_validate_names_what_load_names_of_a_descriptor_breaking_a_waivable_and_a_structural_rule(
    tmp_path: Path, suffix: str
) -> None:
    """Found by a review: validate walks descriptors permissively, so it named only the structural rule
    (page_pool.byte_size) where a strict load names the waivable one it meets first."""
    snap = spec_example_snapshot()
    path = tmp_path / f"s{suffix}"
    hv.save(snap, path)
    raw = bytearray(path.read_bytes())
    at = raw.index(hv.encode_descriptor(snap[0, "key"].descriptor()))
    raw[at + 61] ^= 1  # num_pages' byte 5: 5 + 2**40 pages, past uint32 indices and the pool's 640 bytes
    path.write_bytes(bytes(raw))
    for permissive, field in ((False, "block_table_index_type"), (True, "page_pool.byte_size")):
        with pytest.raises(hv.HurrayFormatError) as exc:
            hv.load(path, permissive=permissive)
        assert exc.value.field == field
        checked = hv.validate(path, permissive=permissive)
        assert [v.invariant for v in checked.errors][:1] == [field]
        assert "page_pool.byte_size" in [v.invariant for v in checked.errors]


def test_validate_names_what_load_names_of_a_header_member_whose_buffer_does_not_hold_its_shape(
    tmp_path: Path,
) -> None:
    """Found by a review: load refuses token_ptr's 25 bytes for shape [3]; validate read past them and
    reported the next record's magic instead."""
    snap = spec_example_snapshot()
    path = tmp_path / "s.hrrs"
    hv.save(snap, path)
    raw = bytearray(path.read_bytes())
    token_ptr = hv.encode_descriptor(schema.dense_record("", schema.flatten_tokens(snap.token_ids)[1]).descriptor)
    assert raw.count(token_ptr) == 1
    at = raw.index(token_ptr)
    assert raw[at + 37] == 24  # a rank-1 descriptor's buffer byte_size: 3 int64
    raw[at + 37] = 25
    path.write_bytes(bytes(raw))
    for permissive in (False, True):
        with pytest.raises(hv.HurrayFormatError) as exc:
            hv.load(path, permissive=permissive)
        assert exc.value.field == "snapshot.token_ptr"
        checked = hv.validate(path, permissive=permissive)
        assert [v.invariant for v in checked.errors][:1] == ["snapshot.token_ptr"]


def test_validate_of_broken_data_that_is_no_kv_does_not_ask_load(hurray, tmp_path: Path) -> None:
    """Another writer's row-major tensors, broken in the second: the walk's finding, not load's 'no snapshot'."""
    path = tmp_path / "plain.hrrs"
    with hurray.StreamWriter(str(path)) as w:
        w.write(hurray.Tensor(bytes(16), hurray.float32, [4]))
        w.write(hurray.Tensor(bytes(16), hurray.float32, [4]))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 :] = bytes(len(raw) - len(raw) // 2)  # the second record's magic and on: zeros
    path.write_bytes(bytes(raw))
    checked = hv.validate(path)
    assert not checked.ok and [v.invariant for v in checked.errors] == ["magic"]


@pytest.mark.parametrize("suffix", [".hrry", ".hrrs", ".safetensors"])
@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: replace(s, keys=s.values, values=s.keys), "kv_role"),
        (
            lambda s: replace(s, values=(replace(s.values[0], seq_lens=torch.tensor([5, 4])), *s.values[1:])),
            "snapshot.structure",
        ),
    ],
    ids=["roles_swapped", "value_seq_lens_differ"],
)
def test_what_no_container_carries_is_not_written_even_permissively(
    tmp_path: Path, suffix: str, change: Callable[[hv.KVSnapshot], hv.KVSnapshot], field: str
) -> None:
    """Found by a review: validate waived these, so save(permissive=True) wrote files that read back as other
    data (a layer group stores the key's seq_lens only; .safetensors swapped the pools back) or not at all
    (the .hrry and stream readers refuse a layer group holding value/key in every mode)."""
    if suffix == ".safetensors":
        require("safetensors")
    bad = change(spec_example_snapshot(2))
    for permissive in (False, True):
        checked = hv.validate(bad, permissive=permissive)
        assert not checked.ok and field in [v.invariant for v in checked.errors]
        with pytest.raises(hv.HurrayFormatError) as exc:
            hv.save(bad, tmp_path / f"bad{suffix}", permissive=permissive)
        assert exc.value.field == field and not (tmp_path / f"bad{suffix}").exists()


def test_single_bare_descriptor_without_layer(hurray, tmp_path: Path) -> None:
    k = spec_example_snapshot()[3, "key"]
    with hurray.StreamWriter(str(tmp_path / "one.hrrs")) as w:
        w.write(to_reference(hurray, k))
    # Each record keeps the Hurray rules, but one key and no value is not a KV snapshot, which load needs:
    # validate says what load says (found by a review: it said ok for KV without hurray-vllm's header).
    checked = hv.validate(tmp_path / "one.hrrs")
    assert not checked.ok and not checked.violations
    assert [v.invariant for v in checked.unreadable] == ["layer_index"]
    with pytest.raises(hv.HurrayFormatError, match="layer"):
        hv.load(tmp_path / "one.hrrs")


# ── bad input ───────────────────────────────────────────────────────────────


def _stream_bytes() -> bytes:
    buf = io.BytesIO()
    hv.write_stream(spec_example_snapshot(num_layers=2), buf)
    return buf.getvalue()


def test_truncated_stream_at_every_byte() -> None:
    data = _stream_bytes()
    # Every cut inside a record; cuts at record boundaries give a shorter valid
    # stream that is then refused as an incomplete snapshot.
    for cut in range(0, len(data), 7):
        with pytest.raises(hv.HurrayFormatError):
            hv.read_stream(io.BytesIO(data[:cut]))


@given(st.data())
def test_mutated_streams_raise_only_format_errors(data: st.DataObject) -> None:
    raw = bytearray(_stream_bytes())
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    try:
        hv.read_stream(io.BytesIO(bytes(raw)))
    except hv.HurrayFormatError:
        pass


@given(st.data())
def test_mutated_files_raise_only_format_errors(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    d = tmp_path_factory.mktemp("mut")
    hv.save(spec_example_snapshot(num_layers=1), d / "s.hrry")
    raw = bytearray((d / "s.hrry").read_bytes())
    # Aim at the parts with structure: header, descriptors, index and trailer.
    interesting = [*range(0, 700), *range(len(raw) - 900, len(raw))]
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.sampled_from(interesting))
        raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.sampled_from([len(raw), len(raw), data.draw(st.integers(0, len(raw)))]))
    (d / "m.hrry").write_bytes(bytes(raw[:cut]))
    try:
        hv.load(d / "m.hrry")
    except hv.HurrayFormatError:
        pass
    hv.validate(d / "m.hrry")  # reports, never raises


def _huge_descriptor() -> bytes:
    """A valid descriptor whose pool is 2**32-1 pages of 4 x 2 x 8 fp16 (0.5 TiB), declared consistently."""
    k = spec_example_snapshot()[0, "key"]
    raw = bytearray(hv.encode_descriptor(k.descriptor()))
    pages = 2**32 - 1
    struct.pack_into("<Q", raw, 20 + 24 + 8 + 4, pages)
    struct.pack_into("<Q", raw, 20 + 24 + 8 + 32 + 1, pages * 4 * 2 * 8 * 2)
    assert hv.validate(bytes(raw)).ok
    return bytes(raw)


def test_tiny_stream_claiming_a_huge_pool() -> None:
    raw = _huge_descriptor()
    data = raw + bytes(100 - len(raw) % 100)
    with pytest.raises(hv.HurrayFormatError, match="remain"):
        list(stream.read_records(io.BytesIO(data)))


class _Pipe(io.RawIOBase):
    """A non-seekable source, like a socket."""

    def __init__(self, data: bytes) -> None:
        self._src = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        chunk = self._src.read(min(len(b), 4096))
        b[: len(chunk)] = chunk
        return len(chunk)


def test_non_seekable_lying_stream_allocates_by_arrival() -> None:
    raw = _huge_descriptor()
    with pytest.raises(hv.HurrayFormatError, match="stream ends"):
        list(stream.read_records(_Pipe(raw + bytes(1000))))
    # And a valid stream reads fine through the same non-seekable path.
    assert same_snapshot(hv.read_stream(_Pipe(_stream_bytes())), spec_example_snapshot(num_layers=2))


def test_non_seekable_stream_reserves_little_before_a_buffer_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 50-byte descriptor declaring a 64 MiB buffer must not make a socket's reader reserve 64 MiB."""
    sizes: list[int] = []
    real = torch.empty

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = real(*args, **kwargs)
        sizes.append(t.numel() * t.element_size())
        return t

    raw = hv.encode_descriptor(schema.dense_record("x", torch.empty(64 << 20, dtype=torch.uint8)).descriptor)
    monkeypatch.setattr(torch, "empty", spy)
    with pytest.raises(hv.HurrayFormatError, match="stream ends"):
        list(stream.read_records(_Pipe(raw + bytes(1000))))
    assert max(sizes) <= stream._GROW_FROM <= 4 << 20
    # Where the frame's length is known, a buffer past it is refused before any allocation.
    sizes.clear()
    with pytest.raises(hv.HurrayFormatError, match="remain in the frame"):
        list(stream.read_records(_Pipe(raw + bytes(1000)), limit=len(raw) + 1000))
    assert not sizes
    # A valid stream under its exact limit reads as before.
    data = _stream_bytes()
    assert same_snapshot(hv.read_stream(_Pipe(data), limit=len(data)), spec_example_snapshot(num_layers=2))


def test_a_descriptor_longer_than_what_is_left_of_the_frame_is_refused_unread() -> None:
    """Found by a review: with ``limit=`` its buffers were checked against the frame, its own length was not:
    the descriptor was read (from the next frame, on a connection) before anything was refused."""
    data = _stream_bytes()
    length = peek_descriptor_length(data[:10])
    f = _Pipe(data)
    with pytest.raises(hv.HurrayFormatError) as exc:
        list(stream.read_records(f, limit=length - 1))
    assert exc.value.field == "descriptor_length" and "remain in the frame" in str(exc.value)
    assert f._src.tell() == 10  # only the fixed head that carries the length


def test_file_claiming_more_than_it_holds(tmp_path: Path) -> None:
    hv.save(spec_example_snapshot(num_layers=1), tmp_path / "s.hrry")
    raw = (tmp_path / "s.hrry").read_bytes()
    (tmp_path / "short.hrry").write_bytes(raw[:100])
    with pytest.raises(hv.HurrayFormatError, match="too short"):
        hv.load(tmp_path / "short.hrry")
    # The first block-paged descriptor, rewritten in place to declare a 0.5 TiB pool.
    huge = _huge_descriptor()
    at = raw.index(hv.encode_descriptor(spec_example_snapshot(num_layers=1)[0, "key"].descriptor()))
    patched = raw[:at] + huge + raw[at + len(huge) :]
    (tmp_path / "huge.hrry").write_bytes(patched)
    with pytest.raises(hv.HurrayFormatError, match=r"data_length|past the end"):
        hv.load(tmp_path / "huge.hrry")


def test_index_crc_mismatch(tmp_path: Path) -> None:
    hv.save(spec_example_snapshot(num_layers=1), tmp_path / "s.hrry")
    raw = bytearray((tmp_path / "s.hrry").read_bytes())
    index_off = struct.unpack_from("<Q", raw, len(raw) - 40)[0]
    raw[index_off + 12] ^= 0xFF  # inside the first entry's name
    (tmp_path / "c.hrry").write_bytes(bytes(raw))
    with pytest.raises(hv.HurrayFormatError, match="crc32c"):
        hv.load(tmp_path / "c.hrry")


def test_torn_composite(tmp_path: Path) -> None:
    data = _stream_bytes()
    recs = list(stream.read_records(io.BytesIO(data)))
    buf = io.BytesIO()
    stream.write_records(recs[:-1], buf)  # drop the last member of the last layer group
    with pytest.raises(hv.HurrayFormatError, match="torn composite"):
        hv.read_stream(io.BytesIO(buf.getvalue()))


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    snap = spec_example_snapshot()
    target = tmp_path / "s.hrry"

    class Boom(Exception):
        pass

    def records():  # type: ignore[no-untyped-def]
        yield from schema.snapshot_records(snap)
        raise Boom

    with pytest.raises(Boom):
        hrryfile.write_file(records(), target)
    assert list(tmp_path.iterdir()) == []


def test_unseekable_write_is_zero_copy() -> None:
    """Page pools reach write() as views of tensor memory, never as bytes copies."""
    snap = spec_example_snapshot(num_layers=1)
    seen = []

    class Sink(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b) -> int:  # type: ignore[no-untyped-def]
            seen.append(b)
            return len(b)

    hv.write_stream(snap, Sink())
    pool = snap[0, "key"].page_pool
    views = [b for b in seen if isinstance(b, memoryview) and b.nbytes == pool.numel() * 2]
    assert views and any(np.shares_memory(np.asarray(v), pool.view(torch.uint8).numpy()) for v in views)


def test_index_must_agree_with_descriptor_length(tmp_path: Path) -> None:
    hv.save(spec_example_snapshot(num_layers=1), tmp_path / "s.hrry")
    raw = bytearray((tmp_path / "s.hrry").read_bytes())
    index_off, index_len = struct.unpack_from("<QQ", raw, len(raw) - 40)
    # First entry: u16 name length, name, u64 descriptor_offset, u32 descriptor_length.
    (n,) = struct.unpack_from("<H", raw, index_off + 8)
    at = index_off + 8 + 2 + n + 8
    struct.pack_into("<I", raw, at, struct.unpack_from("<I", raw, at)[0] + 3)
    crc = crc32c(bytes(raw[index_off : index_off + index_len]))
    struct.pack_into("<I", raw, len(raw) - 12, crc)
    (tmp_path / "lie.hrry").write_bytes(bytes(raw))
    with pytest.raises(hv.HurrayFormatError, match="descriptor_length"):
        hv.load(tmp_path / "lie.hrry")


def test_unreadable_input_is_invalid_even_when_permissive(tmp_path: Path) -> None:
    (tmp_path / "junk").write_bytes(b"HRRYFILE" + bytes(20))
    for p in (tmp_path / "junk", tmp_path / "missing"):
        assert not hv.validate(p, permissive=True).ok
    assert not hv.validate(b"garbage", permissive=True).ok


@given(snapshots(), snapshots())
def test_layer_writer_writes_the_generic_records_bytes(a: hv.KVSnapshot, b: hv.KVSnapshot) -> None:
    """One LayerWriter over two snapshots' layers (its fixed part re-encoded when the structure changes)."""
    from hurray_vllm.containers.schema import layer_records
    from hurray_vllm.containers.stream import LayerWriter, write_records

    writer = LayerWriter()
    want, got = io.BytesIO(), io.BytesIO()
    for snap in (a, b, a):
        for i in range(snap.num_layers):
            scales = snap.kv_scales[i] if snap.kv_scales is not None else None
            n = writer.write(got, i, snap.layer(i), scales)
            assert n == write_records(layer_records(i, snap.layer(i), scales), want)
    assert got.getvalue() == want.getvalue()


def test_layer_writer_hands_a_keeping_sink_bytes_that_do_not_change() -> None:
    """Found by a review: every layer's descriptor was the same bytearray, patched in place, so a sink that
    kept what it was given (rather than copying) saw the earlier layers' descriptors rewritten."""
    from hurray_vllm.containers.schema import layer_records
    from hurray_vllm.containers.stream import LayerWriter, write_records

    class Keeping:
        def __init__(self) -> None:
            self.parts: list[object] = []

        def write(self, b: object) -> int:
            self.parts.append(b)
            return len(b)  # type: ignore[arg-type]

    snap = spec_example_snapshot()
    sink, want = Keeping(), io.BytesIO()
    writer = LayerWriter()
    for i in range(snap.num_layers):
        writer.write(sink, i, snap.layer(i))  # type: ignore[arg-type]
        write_records(layer_records(i, snap.layer(i)), want)
    assert b"".join(bytes(p) for p in sink.parts) == want.getvalue()  # type: ignore[call-overload]
    assert not any(isinstance(p, bytearray) for p in sink.parts)


def test_layers_share_index_tensors_but_each_is_checked() -> None:
    """Reading widens equal index buffers once (the layers share them); a bad one is still refused."""
    from dataclasses import replace as dc_replace

    from hurray_vllm.containers.schema import header_records, layer_records
    from hurray_vllm.containers.stream import write_records

    snap = spec_example_snapshot()
    buf = io.BytesIO()
    hv.write_stream(snap, buf)
    buf.seek(0)
    back = hv.read_stream(buf)
    assert back.num_layers == 4
    assert back[0, "key"].block_table is back[3, "value"].block_table
    # Layer 1 points past its pool: the shared result of layer 0 must not hide it.
    bad = io.BytesIO()
    write_records(header_records(snap), bad)
    for i in range(snap.num_layers):
        k, v = snap.keys[i], snap.values[i]
        if i == snap.num_layers - 1:
            table = k.block_table.clone()
            table[0] = k.num_pages + 3
            k, v = dc_replace(k, block_table=table), dc_replace(v, block_table=table)
        write_records(layer_records(i, (k, v)), bad)
    bad.seek(0)
    with pytest.raises(hv.HurrayFormatError, match="block_table"):
        hv.read_stream(bad)


@given(snapshots())
def test_write_stream_writes_the_generic_records_bytes(snap: hv.KVSnapshot) -> None:
    from hurray_vllm.containers.stream import write_records

    want, got = io.BytesIO(), io.BytesIO()
    n = hv.write_stream(snap, got)
    assert n == write_records(schema.snapshot_records(snap), want) and got.getvalue() == want.getvalue()


def _big_snapshot(seed: int) -> hv.KVSnapshot:
    """Pools large enough (256 KiB) to be views of the file's memory, not copies."""
    g = torch.Generator().manual_seed(seed)

    def bpt(role: str, layer: int) -> hv.BlockPagedTensor:
        pool = torch.randn(8, 16, 4, 128, generator=g).to(torch.bfloat16)
        return hv.BlockPagedTensor(pool, torch.arange(8), torch.tensor([0, 8]), torch.tensor([128]), role, layer)

    return hv.KVSnapshot(tuple(bpt("key", i) for i in range(2)), tuple(bpt("value", i) for i in range(2)))


def test_recycled_file_memory_never_backs_two_live_snapshots(tmp_path: Path) -> None:
    """Loads reuse the memory of dropped snapshots (no page faults), never of one still alive."""
    paths = [tmp_path / f"{i}.hrry" for i in range(3)]
    originals = [_big_snapshot(i) for i in range(3)]
    for snap, p in zip(originals, paths, strict=True):
        hv.save(snap, p)
    kept = hv.load(paths[0])
    pool = kept.keys[0].page_pool
    del kept  # a pool alone keeps the file's memory from being recycled
    for _ in range(20):
        for p, snap in zip(paths[1:], originals[1:], strict=True):
            assert same_snapshot(snap, hv.load(p))  # each loaded and dropped: memory recycled
    assert torch.equal(pool, originals[0].keys[0].page_pool)
    # Dropped, it is reused: the next load of that size lands in memory a dropped load held.
    held = {hv.load(p).keys[0].page_pool.untyped_storage().data_ptr() for p in paths for _ in range(2)}
    assert len(held) < 6
    del pool
    assert same_snapshot(originals[0], hv.load(paths[0]))
    assert hrryfile._recycler._bytes <= hrryfile._recycler.limit


@pytest.mark.parametrize("delta", [-4096, 4096], ids=["grew", "shrank"])
def test_a_file_that_changes_size_while_loaded_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delta: int
) -> None:
    """The whole-file read checks what it read against the size it was told: never a half-read snapshot."""
    path = tmp_path / "s.hrry"
    hv.save(_big_snapshot(0), path)
    real = os.fstat

    def fstat(fd: int) -> os.stat_result:  # the size seen before the read, as if the file changed after
        st = list(real(fd))
        st[6] += delta  # st_size
        return os.stat_result(st)

    monkeypatch.setattr(hrryfile.os, "fstat", fstat)
    with pytest.raises(hv.HurrayFormatError) as info:
        hv.load(path)
    assert info.value.field == "file"


def test_memory_running_out_is_not_a_verdict_on_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """validate and inspect say the machine ran out (``file``), as load does (ENOMEM), never "malformed"."""
    import hurray_vllm.app.cli as cli
    import hurray_vllm.containers.io as hio

    path = tmp_path / "s.hrry"
    hv.save(spec_example_snapshot(), path)

    def no_memory(*_: object, **__: object) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes")

    monkeypatch.setattr(hio, "iter_nodes", no_memory)
    monkeypatch.setattr(cli, "iter_nodes", no_memory)
    (finding,) = hv.validate(path).errors
    assert finding.invariant == "file" and "out of memory" in finding.message and "malformed" not in finding.message
    assert cli.main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert "out of memory" in err and "invalid input" not in err


def test_read_whole_refuses_a_file_over_its_bound_before_allocating(tmp_path: Path) -> None:
    from hurray_vllm.containers.hrryfile import read_whole

    path = tmp_path / "sparse.hrry"
    with open(path, "wb") as f:
        f.truncate(100 << 30)  # sparse: nothing is written, nothing may be read
    with pytest.raises(hv.HurrayFormatError) as err:
        read_whole(path, max_bytes=1 << 20)
    assert err.value.field == "file.size" and str(100 << 30) in str(err.value)
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 10)
    assert bytes(read_whole(small, max_bytes=10).view) == b"x" * 10


# ── reading a path once: load_file_bytes parses what it read; a pipe is refused, not waited on ──


@pytest.mark.parametrize("swapped", ["before detect_format opens it", "before load reads the stream"])
def test_a_pipe_swapped_in_after_a_check_is_refused_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swapped: str
) -> None:
    """Found by a review: detect_format looked at the path with os.stat, then opened it with open(): a FIFO swapped
    in between blocked load() and validate() until a writer appeared, forever; so did the stream reader's open."""
    from hurray_vllm.containers import io as io_module

    regular = tmp_path / "regular.hrrs"
    hv.save(spec_example_snapshot(), regular)
    fifo = tmp_path / "swapped.hrrs"
    os.mkfifo(fifo)
    if swapped.startswith("before detect_format"):
        real_stat = os.stat

        def stat_as_before_the_swap(path: object, *args: object, **kwargs: object) -> os.stat_result:
            return real_stat(regular if os.fspath(path) == os.fspath(fifo) else path, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "stat", stat_as_before_the_swap)
        calls: list[Callable[[], object]] = [
            lambda: hv.load(fifo),
            lambda: hv.detect_format(fifo),
            lambda: hv.containers.io.file_kv(fifo),
        ]
    else:
        monkeypatch.setattr(io_module, "detect_format", lambda path: "stream")
        calls = [lambda: hv.load(fifo), lambda: list(io_module.open_records(fifo))]
    for call in calls:
        got = within(call, fifo)
        assert isinstance(got, hv.HurrayFormatError) and got.field == "file", got
        assert "not a regular file" in str(got)
    checked = within(lambda: hv.validate(fifo), fifo)  # never raises: the refusal is its finding
    assert isinstance(checked, Checked) and not checked.ok, checked
    assert [v.invariant for v in checked.errors] == ["file"]


@pytest.mark.parametrize("suffix", [".hrry", ".hrrs"])
def test_load_file_bytes_parses_the_bytes_it_read_and_never_the_path_again(tmp_path: Path, suffix: str) -> None:
    """Found by a review: bytes that were not a .hrry file were loaded from their path again: a second read of a
    file that may have been replaced since (by a larger one, a link, a pipe), without read_whole's bounds."""
    from hurray_vllm.containers.io import load_file_bytes, read_file

    snap = spec_example_snapshot()
    path = tmp_path / f"s{suffix}"
    hv.save(snap, path)
    want = hv.load(path)
    data = read_file(path)
    path.unlink()
    os.mkfifo(path)  # what is at the path now would block a reader that opened it
    got = within(lambda: load_file_bytes(data), path)
    assert isinstance(got, hv.KVSnapshot) and same_snapshot(got, want), got
    # Damaged bytes: load's verdict on a file of those bytes.
    raw = bytearray(data.view)
    raw[len(raw) // 2] ^= 0xFF
    damaged = tmp_path / f"damaged{suffix}"
    damaged.write_bytes(bytes(raw))
    try:
        verdict: object = hv.load(damaged)
    except hv.HurrayFormatError as exc:
        verdict = exc.field
    try:
        again: object = load_file_bytes(read_file(damaged))
    except hv.HurrayFormatError as exc:
        again = exc.field
    assert (verdict if isinstance(verdict, str) else "ok") == (again if isinstance(again, str) else "ok")


def test_load_file_bytes_refuses_a_safetensors_file_rather_than_read_its_path_again(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from hurray_vllm.containers.io import load_file_bytes, read_file

    path = tmp_path / "s.safetensors"
    hv.save(spec_example_snapshot(), path)
    data = read_file(path)
    path.unlink()  # a reader that opened the path again would raise FileNotFoundError
    with pytest.raises(hv.HurrayFormatError, match="safetensors") as err:
        load_file_bytes(data)
    assert err.value.field == "file.magic"
    with pytest.raises(hv.HurrayFormatError) as err:  # neither format: as load says of such a file
        load_file_bytes(FileBytes(path, memoryview(b"not a snapshot")))
    assert err.value.field == "magic"


# ── found by a review of the containers ─────────────────────────────────────


def test_a_compressed_or_archived_stream_reads_as_the_stream_it_holds(tmp_path: Path) -> None:
    """Found by a review: ``fstat`` of a gzip file is its compressed size, and a valid stream was refused."""
    import gzip
    import tarfile

    data = _stream_bytes()
    with gzip.open(tmp_path / "s.hrrs.gz", "wb") as f:
        f.write(data)
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        pad = tarfile.TarInfo("pad")
        pad.size = 100_000
        tar.addfile(pad, io.BytesIO(bytes(pad.size)))
        member = tarfile.TarInfo("s.hrrs")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    want = spec_example_snapshot(num_layers=2)
    with gzip.open(tmp_path / "s.hrrs.gz", "rb") as f:
        assert same_snapshot(hv.read_stream(f), want)
    with tarfile.open(tmp_path / "s.tar") as tar:
        member_file = tar.extractfile("s.hrrs")
        assert member_file is not None
        assert same_snapshot(hv.read_stream(member_file), want)
    # A lying descriptor in a compressed stream still fails as a truncation, reserving what arrived.
    with gzip.open(tmp_path / "lie.hrrs.gz", "wb") as f:
        f.write(_huge_descriptor() + bytes(1000))
    with gzip.open(tmp_path / "lie.hrrs.gz", "rb") as f, pytest.raises(hv.HurrayFormatError, match="stream ends"):
        list(stream.read_records(f))
    # Real files and bytes are still sized: a buffer past their end is refused before it is read.
    (tmp_path / "lie.hrrs").write_bytes(_huge_descriptor() + bytes(1000))
    with open(tmp_path / "lie.hrrs", "rb") as f, pytest.raises(hv.HurrayFormatError, match="remain in the input"):
        list(stream.read_records(f))


def _many_empty_buffers(members: int) -> list[hv.TensorDescriptor]:
    """One group head binding ``members`` row-major records, each of 255 empty buffers."""
    from hurray_vllm.wire.descriptor import LAYOUT_COMPOSITE, LAYOUT_ROW_MAJOR, BufferHandle, CompositeFields

    head = hv.TensorDescriptor(
        type_tag=0x11, shape=(0,), layout_tag=LAYOUT_COMPOSITE, layout=CompositeFields(rule_tag=3, member_count=members)
    )
    rec = hv.TensorDescriptor(
        type_tag=0x11, shape=(0,), layout_tag=LAYOUT_ROW_MAJOR, buffers=(BufferHandle(0, 1, 0),) * 255
    )
    return [head, *([rec] * members)]


def _bound_buffers(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    for module in (schema, stream, hrryfile):
        monkeypatch.setattr(module, "MAX_BUFFERS", n)


def test_an_input_of_more_buffers_than_any_snapshot_has_is_refused_as_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a group of 8,000 members of 255 empty buffers each (31 MiB) cost 18 s and +1.1 GiB."""
    # hurray-vllm's own layout stays below the bound at the record bound (<= 12 buffers per 5 records, quantized).
    assert schema.MAX_BUFFERS >= schema.MAX_RECORDS * 12 // 5
    limit = 255 * 8
    _bound_buffers(monkeypatch, limit)
    descs = _many_empty_buffers(40)
    data = b"".join(hv.encode_descriptor(d) for d in descs)
    (tmp_path / "many.hrrs").write_bytes(data)
    empty = torch.empty(0, dtype=torch.uint8)
    recs = [schema.Record(f"t{i}", d, [empty] * len(d.buffers)) for i, d in enumerate(descs)]
    hrryfile.write_file(recs, tmp_path / "many.hrry")
    src = io.BytesIO(data)
    got = []
    with pytest.raises(hv.HurrayFormatError) as err:
        got.extend(stream.read_records(src))
    assert err.value.field == "buffer_count" and str(limit) in str(err.value)
    assert len(got) == 1 + 8 and src.tell() == sum(len(hv.encode_descriptor(d)) for d in descs[:10])  # and no more
    for name in ("many.hrrs", "many.hrry"):
        for permissive in (False, True):
            with pytest.raises(hv.HurrayFormatError) as err:
                hv.load(tmp_path / name, permissive=permissive)
            assert err.value.field == "buffer_count"
            checked = hv.validate(tmp_path / name, permissive=permissive)
            assert not checked.ok and "buffer_count" in {v.invariant for v in checked.errors}
    # Exactly as many buffers as the bound: read (a file and a stream), and then no snapshot.
    data = b"".join(hv.encode_descriptor(d) for d in descs[:9])
    assert len(list(stream.read_records(io.BytesIO(data)))) == 9
    hrryfile.write_file(recs[:9], tmp_path / "nine.hrry")
    with HrryFile(tmp_path / "nine.hrry") as hf:
        assert len(list(hf.records())) == 9


@pytest.mark.slow
def test_the_buffer_bound_holds_the_readers_memory_and_time() -> None:
    """The review's input at its real size: 8,000 records of 255 empty buffers (31 MiB): 18 s and +1.1 GiB before."""
    import time
    import tracemalloc

    data = b"".join(hv.encode_descriptor(d) for d in _many_empty_buffers(8000))
    start = time.perf_counter()
    with pytest.raises(hv.HurrayFormatError, match="buffers in all"):
        list(stream.read_records(io.BytesIO(data)))
    elapsed = time.perf_counter() - start
    tracemalloc.start()
    try:
        with pytest.raises(hv.HurrayFormatError, match="buffers in all"):
            list(stream.read_records(io.BytesIO(data)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 8.0, f"{elapsed:.1f} s"
    # Python's share (tensor objects, descriptors): torch's own ~0.4 KB per tensor comes on top (~100 MB).
    assert peak < 96 << 20, f"{peak} bytes"


def test_duplicate_keys_in_a_files_metadata_are_refused_by_load_and_validate(tmp_path: Path) -> None:
    """Found by a review: two ``request_ids`` members loaded without complaint (the last one won)."""
    from hurray_vllm.containers.io import save_records

    recs = list(schema.snapshot_records(spec_example_snapshot(num_layers=2)))
    meta = bytes(recs[1].buffers[0].numpy()).decode()
    evil = meta.replace('"request_ids": [', '"request_ids": ["first", "x"], "request_ids": [', 1)
    assert evil != meta
    recs[0] = schema.group_head("snapshot", 3, [len(evil)], torch.uint8)
    recs[1] = schema.dense_record("snapshot.meta", torch.frombuffer(bytearray(evil.encode()), dtype=torch.uint8))
    for name in ("dup.hrry", "dup.hrrs"):
        save_records(recs, tmp_path / name)
        for permissive in (False, True):
            with pytest.raises(hv.HurrayFormatError, match="'request_ids' twice") as err:
                hv.load(tmp_path / name, permissive=permissive)
            assert err.value.field == "snapshot.meta"
            assert not hv.validate(tmp_path / name, permissive=permissive).ok


def test_a_record_whose_buffers_disagree_with_its_descriptor_is_refused_before_a_byte_is_written(
    tmp_path: Path,
) -> None:
    """Found by a review: a record declaring 16 bytes and holding 8 was written, and reported a success."""
    from hurray_vllm.containers.io import save_records

    a = schema.dense_record("a", torch.arange(4, dtype=torch.int32))  # declares 16 bytes
    b = schema.dense_record("b", torch.arange(3, dtype=torch.int64))
    short = schema.Record("a", a.descriptor, [torch.arange(2, dtype=torch.int32)])  # holds 8
    extra = schema.Record("a", a.descriptor, [*a.buffers, torch.zeros(1)])
    none = schema.Record("a", a.descriptor, [])
    for bad, field, said in [(short, "a buffer 0", "16"), (extra, "a", "2 buffers"), (none, "a", "0 buffers")]:
        for name in ("x.hrrs", "x.hrry"):
            with pytest.raises(hv.HurrayArgumentError) as err:
                save_records([b, bad], tmp_path / name)
            assert err.value.field == field and said in str(err.value)
        sink = io.BytesIO()
        with pytest.raises(hv.HurrayArgumentError) as err:
            stream.write_records([bad], sink)
        assert err.value.field == field and sink.getvalue() == b""  # not even its descriptor
        with pytest.raises(hv.HurrayArgumentError) as err:
            hrryfile.file_size([bad])
        assert err.value.field == field
    with pytest.raises(hv.HurrayArgumentError) as err:  # a stream's records need no name: named by position
        stream.write_records([b, schema.Record("", a.descriptor, [])], io.BytesIO())
    assert err.value.field == "record 1"
    assert list(tmp_path.iterdir()) == []
    # A typed buffer is measured in bytes: an int32 [4] tensor is the 16 bytes declared.
    sink = io.BytesIO()
    assert stream.write_records([a, b], sink) == len(sink.getvalue())


def test_a_files_records_without_a_name_or_with_one_twice_are_argument_errors(tmp_path: Path) -> None:
    b = schema.dense_record("b", torch.arange(3, dtype=torch.int64))
    for recs in ([schema.Record("", b.descriptor, b.buffers)], [b, b]):
        with pytest.raises(hv.HurrayArgumentError) as err:
            hrryfile.write_file(recs, tmp_path / "x.hrry")
        assert err.value.field == "name"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"alignment": 1000}, "alignment"),
        ({"alignment": 0}, "alignment"),
        ({"kv": {"k": -(2**70)}}, "kv.k"),
        ({"kv": {"k": 2**64}}, "kv.k"),
        ({"kv": {1: 2}}, "kv"),
        ({"kv": {"": 2}}, "kv"),
        ({"kv": {"k": [1, 2**63]}}, "kv.k"),
        ({"kv": {"k": [[1, 2]]}}, "kv.k"),
        ({"kv": {"k": [1, None]}}, "kv.k"),
        ({"kv": {"k": object()}}, "kv.k"),
        ({"kv": [("k", 1)]}, "kv"),
    ],
)
def test_a_writers_wrong_argument_is_an_argument_error_and_writes_nothing(
    tmp_path: Path, kwargs: dict, field: str
) -> None:
    """Found by a review: these came out as data errors, raw struct/attribute errors, or (a nested KV array)
    a file that every reader refuses."""
    recs = list(schema.snapshot_records(spec_example_snapshot(num_layers=1)))
    with pytest.raises(hv.HurrayArgumentError) as err:
        hrryfile.write_file(recs, tmp_path / "a.hrry", **kwargs)
    assert err.value.field == field
    with pytest.raises(hv.HurrayArgumentError) as err:
        hrryfile.file_size(recs, **kwargs)
    assert err.value.field == field
    assert list(tmp_path.iterdir()) == []


def test_every_kv_value_the_writer_takes_reads_back(tmp_path: Path) -> None:
    kv = {"s": "x", "i": -(2**63), "u": 2**64 - 1, "f": 0.5, "b": True, "raw": b"\x00", "ints": [1, 2], "none": []}
    recs = list(schema.snapshot_records(spec_example_snapshot(num_layers=1)))
    hrryfile.write_file(recs, tmp_path / "a.hrry", kv=kv)
    assert HrryFile(tmp_path / "a.hrry").kv == kv


def test_a_descriptor_length_over_the_readers_limit_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: the index's descriptor_length was read whole, then compared with the limit."""
    from hurray_vllm.wire.descriptor import MAX_DESCRIPTOR_LEN

    # A record without data, then a KV section of 2 MiB: room for the index to claim a longer descriptor.
    path = tmp_path / "long.hrry"
    hrryfile.write_file([schema.group_head("g", 0, [0], torch.uint8)], path, kv={"pad": bytes(2 << 20)})
    raw = bytearray(path.read_bytes())
    index_off, index_len = struct.unpack_from("<QQ", raw, len(raw) - 40)
    (n,) = struct.unpack_from("<H", raw, index_off + 8)
    struct.pack_into("<I", raw, index_off + 8 + 2 + n + 8, MAX_DESCRIPTOR_LEN + 8)
    struct.pack_into("<I", raw, len(raw) - 12, crc32c(bytes(raw[index_off : index_off + index_len])))
    path.write_bytes(bytes(raw))
    sizes: list[int] = []
    real = HrryFile._read_at

    def spy(self: HrryFile, off: int, n: int, *args: str) -> bytes:
        sizes.append(n)
        return real(self, off, n, *args)

    monkeypatch.setattr(HrryFile, "_read_at", spy)
    with HrryFile(path) as hf:
        assert hf.entries[0].descriptor_length == MAX_DESCRIPTOR_LEN + 8
        sizes.clear()
        with pytest.raises(hv.HurrayFormatError) as err:
            hf.descriptor(hf.entries[0])
    assert err.value.field == "descriptor_length" and not sizes


@pytest.mark.parametrize("limit", [-1, 1.5, "x", True])
def test_read_stream_refuses_a_limit_that_is_not_a_byte_count(limit: object) -> None:
    """They were reported as malformed input (HurrayFormatError, fields descriptor_length or input)."""
    data = io.BytesIO()
    hv.write_stream(spec_example_snapshot(), data)
    with pytest.raises(hv.HurrayArgumentError) as err:
        hv.read_stream(io.BytesIO(data.getvalue()), limit=limit)  # type: ignore[arg-type]
    assert err.value.field == "limit"


@pytest.mark.parametrize("f", [None, io.StringIO("HRRY"), b"HRRY"])
def test_read_stream_refuses_what_is_not_a_binary_file(f: object) -> None:
    """read_stream(None) was a HurrayFormatError('input'): the caller's mistake, taken for a damaged stream."""
    with pytest.raises(hv.HurrayArgumentError) as err:
        hv.read_stream(f)  # type: ignore[arg-type]
    assert err.value.field == "f"


@pytest.mark.parametrize("fmt", ["hrrs", "HRRY", "bad", ""])
def test_save_names_the_formats_it_takes(fmt: str, tmp_path: Path) -> None:
    """save(format='hrrs') said "raw records go to .hrry or .hrrs files, not hrrs": not the value to pass."""
    with pytest.raises(hv.HurrayArgumentError, match="'hrry', 'stream', 'safetensors'") as err:
        hv.save(spec_example_snapshot(), tmp_path / "x.hrrs", format=fmt)  # type: ignore[arg-type]
    assert err.value.field == "format"
    assert not list(tmp_path.iterdir())
