"""Stream writers and sinks that take fewer bytes than they are given (raw files, sockets, non-blocking pipes).

A raw sink (``open(path, "wb", buffering=0)``, ``socket.makefile("wb",
buffering=0)``, any :class:`io.RawIOBase`) may take part of a write and say
so in its return: Linux's ``write()`` takes at most 0x7ffff000 bytes, so a
page pool over 2 GiB always goes short. Found by a review: the writers
ignored the count, and such a stream silently lost bytes while the returned
size claimed them all. Here the sinks take at most a few KiB per write.
"""

from __future__ import annotations

import errno
import io

import pytest
import torch
from strategies import same_snapshot
from synthetic import make_snapshot

import hurray_vllm as hv
from hurray_vllm.app.demo import spec_example_snapshot


class Trickle(io.RawIOBase):
    """A raw sink that takes at most ``limit`` bytes per write, as a raw file or socket may."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self.held = bytearray()
        self.calls = 0

    def writable(self) -> bool:
        return True

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        self.calls += 1
        part = memoryview(b).cast("B")[: self.limit]
        self.held += part
        return part.nbytes


def _snapshots() -> list[hv.KVSnapshot]:
    """Pools of several times a write's share (the layer writer's shared path), and fp8 (per-layer records)."""
    big = make_snapshot([300, 200], [0, 1], 16, heads=4, dim=32, layers=3)  # pools of 40 KiB
    fp8 = make_snapshot([40, 33], [0, 1], 8, heads=2, dim=64, dtype=torch.float8_e4m3fn)
    return [spec_example_snapshot(), big, fp8]


@pytest.mark.parametrize("snap", _snapshots(), ids=["spec", "big", "fp8"])
def test_a_sink_taking_part_of_each_write_receives_the_whole_stream(snap: hv.KVSnapshot) -> None:
    want = io.BytesIO()
    hv.write_stream(snap, want)
    sink = Trickle()
    n = hv.write_stream(snap, sink)
    assert bytes(sink.held) == want.getvalue()
    assert n == len(sink.held)  # the count returned is the bytes the sink holds
    assert same_snapshot(snap, hv.read_stream(io.BytesIO(bytes(sink.held))))


def test_a_sink_taking_everything_is_written_once_per_piece() -> None:
    """The common case costs one write per piece: the loop only runs on a short write."""
    snap = _snapshots()[1]
    whole, short = Trickle(limit=1 << 30), Trickle()
    hv.write_stream(snap, whole)
    hv.write_stream(snap, short)
    assert bytes(whole.held) == bytes(short.held)
    assert whole.calls < short.calls


def test_a_non_blocking_sink_that_would_block_raises() -> None:
    """``write()`` returning None: the sink took nothing; the bytes would be lost, so the write fails."""

    class WouldBlock(Trickle):
        def write(self, b: bytes | bytearray | memoryview) -> int | None:  # type: ignore[override]
            if len(self.held) >= 5000:
                return None
            return super().write(b)

    with pytest.raises(BlockingIOError, match="would block") as info:
        hv.write_stream(_snapshots()[1], WouldBlock())
    assert info.value.errno == errno.EAGAIN


def test_a_sink_taking_nothing_raises_rather_than_looping() -> None:
    class Stuck(Trickle):
        def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
            return 0 if len(self.held) >= 5000 else super().write(b)

    with pytest.raises(OSError, match="returned 0"):
        hv.write_stream(_snapshots()[1], Stuck())


def test_a_sink_of_its_own_whose_write_returns_nothing_took_everything() -> None:
    """A duck-typed sink (no io class) that keeps what it is given and returns None worked before short writes
    were looked at, and still does: only an io object's None means "would block"."""

    class Keeper:
        def __init__(self) -> None:
            self.parts: list[bytes] = []

        def write(self, b: bytes | bytearray | memoryview) -> None:
            self.parts.append(bytes(b))

    snap = spec_example_snapshot()
    sink = Keeper()
    n = hv.write_stream(snap, sink)  # type: ignore[arg-type]
    data = b"".join(sink.parts)
    assert n == len(data)
    assert hv.read_stream(io.BytesIO(data)).token_ids == snap.token_ids


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(kv_scales=((1.0, 1.0),)), "snapshot.kv_scales"),  # one pair for four layers: a bare IndexError
        (dict(kv_scales=((float("nan"), 1.0),) * 4), "snapshot.kv_scales"),  # written whole, refused on read
        (dict(token_ids=((1,), (2,))), "snapshot.token_ids"),
        (dict(extra={"x": {1, 2}}), "snapshot.meta"),  # not JSON: a bare TypeError
    ],
)
def test_a_snapshot_the_reader_refuses_is_not_written(change: dict[str, object], field: str) -> None:
    """write_stream wrote what read_stream refuses, or failed halfway with 2454 bytes already in the caller's f."""
    from dataclasses import replace

    bad = replace(spec_example_snapshot(), **change)  # type: ignore[arg-type]
    f = io.BytesIO()
    with pytest.raises(hv.HurrayFormatError) as err:
        hv.write_stream(bad, f)
    assert err.value.field.startswith(field)
    assert f.getvalue() == b""
