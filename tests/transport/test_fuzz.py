"""Mutation fuzzing of what a receiver parses from the network (#21): TCP frames and NIXL offers.

The only outcome allowed is the documented refusal (``HurrayFormatError``;
over TCP an ``ER`` answer or a closed connection): no other exception, no
hang, no allocation beyond what the input announces within the limits, and
nothing stored that a consumer would not take. The suite runs a bounded
number of examples; ``make fuzz`` runs many more (``HURRAY_FUZZ_EXAMPLES``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hurray_vllm as hv
from hurray_vllm.app.demo import spec_example_snapshot
from hurray_vllm.chunks import DirectoryStore, fsck
from hurray_vllm.chunks.keys import chunks_of, namespace_of
from hurray_vllm.containers.io import write_stream
from hurray_vllm.transport import base
from hurray_vllm.transport.nixl.offer import assemble_offer, encode_snapshot_offer, parse_offer
from hurray_vllm.transport.tcp import Receiver, frame_head

FUZZ_EXAMPLES = int(os.environ.get("HURRAY_FUZZ_EXAMPLES", "60"))
((KEY, CHUNK),) = chunks_of(spec_example_snapshot(), 4)
assert CHUNK.fingerprint is not None
NS = namespace_of(CHUNK.fingerprint)
_HOSTILE = [0, 1, 0xFF, 0xFFFF, 0xFFFFFFFF, 2**60, 2**64 - 1]


def _stream() -> bytes:
    import io

    buf = io.BytesIO()
    write_stream(CHUNK, buf)
    return buf.getvalue()


STREAM = _stream()
FRAME = frame_head(NS, KEY, len(STREAM)) + STREAM


def _offer_body() -> bytes:
    parts, _, _ = encode_snapshot_offer(NS, KEY, CHUNK)
    return b"".join(bytes(memoryview(p)) for p in parts)


OFFER = _offer_body()


def _mutate(raw: bytes, data: st.DataObject, header: int) -> bytes:
    """One to four edits of ``raw``, most of them in its first ``header`` bytes (the framing, the descriptors)."""
    out = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        kind = data.draw(st.sampled_from(["flip", "word", "cut", "insert", "delete"]), label="kind")
        span = header if data.draw(st.booleans(), label="in header") else len(out)
        at = data.draw(st.integers(0, max(0, min(span, len(out)) - 1)), label="at")
        if kind == "flip" and out:
            out[at] ^= data.draw(st.integers(1, 255), label="xor")
        elif kind == "word":
            width = data.draw(st.sampled_from([2, 4, 8]), label="width")
            value = data.draw(st.sampled_from(_HOSTILE), label="value") % (1 << (8 * width))
            out[at : at + width] = value.to_bytes(width, "little")
        elif kind == "cut":
            del out[at:]
        elif kind == "insert":
            out[at:at] = data.draw(st.binary(min_size=1, max_size=16), label="bytes")
        elif out:
            del out[at : at + data.draw(st.integers(1, 64), label="n")]
    return bytes(out)


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    store = DirectoryStore(tmp_path_factory.mktemp("fuzz-store"))
    # Short timeouts: a frame that announces more than it sends must end in a refusal, not a hang.
    with Receiver("127.0.0.1", 0, store, timeout=2.0, idle_timeout=2.0, max_chunk_bytes=1 << 20) as r:
        yield r


def _exchange(receiver: Receiver, frame: bytes) -> bytes:
    """Send ``frame`` and end the sending side; what the receiver answers before it closes (a challenge cut off)."""
    answer = b""
    with socket.create_connection(("127.0.0.1", receiver.address[1]), timeout=10) as s:
        try:
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)  # the rest never comes: the receiver sees the end, not a stall
            while chunk := s.recv(1 << 16):  # the receiver answers and closes within its timeouts
                answer += chunk
        except TimeoutError:
            pytest.fail("the receiver neither answered nor closed the connection within 10 s")
        except OSError:  # reset, not connected: the receiver dropped the connection
            pass  # the receiver dropped the connection (a bad magic, a broken header): a refusal
    if frame.startswith(b"HVA1"):  # the key handshake of older versions: 32 bytes for its challenge, then refused
        answer = answer[32:]
    return answer


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_tcp_frames_are_refused_or_stored_valid(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch, data: st.DataObject
) -> None:
    bugs: list[Any] = []
    monkeypatch.setattr(base.log, "exception", lambda *a, **k: bugs.append(a))
    frame = _mutate(FRAME, data, header=len(FRAME) - len(STREAM) + 1024)
    answer = _exchange(receiver, frame)
    assert answer[:2] in (b"", b"OK", b"ER"), answer[:20]
    assert not bugs, bugs  # the catch-all for unforeseen errors never ran
    report = fsck(receiver.store)  # type: ignore[arg-type]
    assert report.clean, report.damaged  # whatever was stored is a whole, valid chunk under a fitting name


def _name(text: str) -> bytes:
    return len(text).to_bytes(2, "little") + text.encode()


QUERY = b"HVH1" + (2).to_bytes(2, "little") + _name(NS) + _name(KEY) + _name(NS) + _name("ab" * 8)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_held_queries_are_answered_or_end_the_connection(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch, data: st.DataObject
) -> None:
    """A held-chunk query, then a chunk, mutated: answered (one flag per name), or refused; never a crash."""
    bugs: list[Any] = []
    monkeypatch.setattr(base.log, "exception", lambda *a, **k: bugs.append(a))
    answer = _exchange(receiver, _mutate(QUERY + FRAME, data, header=len(QUERY) + 64))
    if answer.startswith(b"HV"):  # answered: as many flags as names asked, each 0 or 1
        count = int.from_bytes(answer[2:4], "little")
        assert count <= base.MAX_HELD_QUERY and set(answer[4 : 4 + count]) <= {0, 1}
        answer = answer[4 + count :]
    assert answer[:2] in (b"", b"OK", b"ER"), answer[:20]
    assert not bugs, bugs
    report = fsck(receiver.store)  # type: ignore[arg-type]
    assert report.clean, report.damaged


@settings(max_examples=FUZZ_EXAMPLES * 4, deadline=None)
@given(data=st.data())
def test_mutated_nixl_offers_are_refused_before_any_transfer_or_describe_a_chunk(data: st.DataObject) -> None:
    body = bytearray(_mutate(OFFER, data, header=len(OFFER)))
    limit = 4 * CHUNK.nbytes  # what the receiver would set aside for page pools is bounded by its limit
    try:
        offer = parse_offer(body, limit)
        assert sum(offer.remote_sizes) <= limit
        views = [torch.empty(n, dtype=torch.uint8) for n in offer.remote_sizes]
        landing = assemble_offer(offer, views)
        snap, digest = landing.snapshot, landing.digest
    except hv.HurrayFormatError:
        return
    assert snap.num_layers > 0 and digest.startswith(("crc32c/", "crc32/"))


def test_the_unmutated_frame_and_offer_are_accepted(receiver: Receiver) -> None:
    offer = parse_offer(bytearray(OFFER), 1 << 30)
    views = [torch.empty(n, dtype=torch.uint8) for n in offer.remote_sizes]
    assemble_offer(offer, views)
    with socket.create_connection(("127.0.0.1", receiver.address[1]), timeout=10) as s:
        s.sendall(FRAME)
        assert s.recv(2) == b"OK"


def test_a_chunk_under_another_models_namespace_is_refused(tmp_path: Path) -> None:
    from hurray_vllm import transport

    with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path)) as r:
        with pytest.raises(hv.HurrayFormatError, match="namespace"):
            transport.send_chunks(f"tcp://127.0.0.1:{r.address[1]}", [("0123456789abcdef", KEY, CHUNK)])
    assert not any(tmp_path.rglob("*.hrry"))


def _offer_of(records: list[tuple[Any, list[torch.Tensor | int | None]]], count: int | None = None) -> bytearray:
    """An offer body of ``records`` (descriptor, per buffer: inline bytes, or an int/None for one sent by NIXL).

    ``count``: the record count to announce (default: the records given).
    """
    from hurray_vllm.wire.descriptor import encode_descriptor

    u16, u32 = (lambda v: v.to_bytes(2, "little")), (lambda v: v.to_bytes(4, "little"))
    out = bytearray(u16(len(NS)) + NS.encode() + u16(len(KEY)) + KEY.encode())
    out += u32(len(records) if count is None else count)
    for desc, bufs in records:
        raw = encode_descriptor(desc)
        out += u32(len(raw)) + raw
        for b in bufs:
            out += b"\x00" + b.numpy().tobytes() if isinstance(b, torch.Tensor) else b"\x01"
    return out


def _offer_records() -> list[tuple[Any, list[torch.Tensor | int | None]]]:
    offer = parse_offer(bytearray(OFFER), 1 << 30)
    return [(d, list(b)) for d, b in zip(offer.descriptors, offer.buffers, strict=True)]


def test_an_offer_rebuilt_from_its_records_is_the_offer() -> None:
    """What the refusals below are built with: the encoder's own bytes, record for record."""
    assert bytes(_offer_of(_offer_records())) == OFFER


def test_an_offer_of_no_records_is_refused() -> None:
    with pytest.raises(hv.HurrayFormatError, match="0 records") as err:
        parse_offer(_offer_of([]), 1 << 30)
    assert err.value.field == "transport.offer"


def test_stray_bytes_after_the_last_record_are_refused() -> None:
    for tail in (b"\x00", b"\x01" * 16):
        with pytest.raises(hv.HurrayFormatError, match=f"{len(tail)} stray bytes") as err:
            parse_offer(bytearray(OFFER + tail), 1 << 30)
        assert err.value.field == "transport.offer"


def test_only_page_pools_may_be_sent_by_nixl() -> None:
    """A block table (buffer 1 of a block-paged record) announced for NIXL: everything validation reads is inline."""
    from hurray_vllm.wire.descriptor import LAYOUT_BLOCK_PAGED

    records = _offer_records()
    i = next(i for i, (d, _) in enumerate(records) if d.layout_tag == LAYOUT_BLOCK_PAGED)
    desc, bufs = records[i]
    assert isinstance(bufs[0], int) and isinstance(bufs[1], torch.Tensor) and bufs[1].numel()
    records[i] = (desc, [bufs[0], None, *bufs[2:]])
    with pytest.raises(hv.HurrayFormatError, match=f"descriptor {i} buffer 1 cannot be sent by NIXL") as err:
        parse_offer(_offer_of(records), 1 << 30)
    assert err.value.field == "transport.offer"


def test_the_views_given_for_an_offer_must_be_its_announced_pools_one_each() -> None:
    """A view more than the pools announced, or one view for two pools, leaves a pool nothing would write."""
    offer = parse_offer(bytearray(OFFER), 1 << 30)
    views = [torch.empty(n, dtype=torch.uint8) for n in offer.remote_sizes]
    assert len(views) > 1
    assemble_offer(offer, views)
    spare = torch.empty(max(offer.remote_sizes), dtype=torch.uint8)
    for wrong in ([*views, spare], [views[1], *views[1:]]):
        with pytest.raises(hv.HurrayFormatError, match="not the snapshot's") as err:
            assemble_offer(offer, wrong)
        assert err.value.field == "transport.offer"
