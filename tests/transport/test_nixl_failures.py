"""The NIXL transport's failure handling, with fake agents: no NIXL, no UCX, no second process.

Each test drives the sender's or the receiver's code against agents that
record what is done to them, and answer as NIXL does in the case at hand
(a WRITE that stays in flight, metadata NIXL will not load over the old).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import queue
import socket
import threading
import time
import tracemalloc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from blocking import wait_for
from synthetic import example_chunk

from hurray_vllm import transport
from hurray_vllm.chunks.store import DirectoryStore
from hurray_vllm.containers.schema import Record, dense_record
from hurray_vllm.errors import HurrayArgumentError, HurrayFormatError
from hurray_vllm.transport import base
from hurray_vllm.transport.base import U16, U32, U64, ReceiverBase, SendAborted, read_message, recv_exact
from hurray_vllm.transport.nixl import NixlError, NixlReceiver, NixlSender
from hurray_vllm.transport.nixl import offer as tn_offer
from hurray_vllm.transport.nixl import receiver as tn_receiver
from hurray_vllm.transport.nixl import sender as tn_sender
from hurray_vllm.wire import dtypes
from hurray_vllm.wire.descriptor import LAYOUT_ROW_MAJOR, BufferHandle, TensorDescriptor

MIB = 1 << 20


class FakeHandle:
    """A transfer handle: its release is recorded (and, as NIXL's UCX backend does, always succeeds)."""

    def __init__(self, events: list[tuple[Any, ...]], agent: str) -> None:
        self.events, self.agent = events, agent

    def release(self) -> None:
        self.events.append(("release", self.agent, self))


class FakeDlist:
    def release(self) -> None:
        pass


class FakeAgent:
    """A lane agent (or a receiver's) that records every call that matters here.

    ``state``: what every posted WRITE reports ("PROC": in flight for good).
    ``fail_post``: posting raises, as NIXL does when the peer went away (once
    another agent posted, when both share ``posted``: the failing lane runs on a thread).
    ``refuse_reload``: loading other metadata under a name already loaded raises
    (NIXL's NOT_ALLOWED, a region at the same address under another key).
    """

    def __init__(
        self,
        name: str,
        events: list[tuple[Any, ...]],
        *,
        state: str = "PROC",
        fail_post: bool = False,
        refuse_reload: bool = False,
        posted: threading.Event | None = None,
    ) -> None:
        self.name, self.events, self.state = name, events, state
        self.fail_post, self.refuse_reload, self.posted = fail_post, refuse_reload, posted
        self.remote: dict[str, bytes] = {}
        self.notifs: list[bytes] = []
        self.polls = 0
        self.mu = threading.Lock()  # a test thread adding notifications while the receiver polls: none is lost

    def register_memory(self, descs: list[tuple[int, int, int, str]], kind: str) -> object:
        reg = object()
        self.events.append(("register", self.name, reg))
        return reg

    def deregister_memory(self, reg: object) -> None:
        self.events.append(("deregister", self.name, reg))

    def get_agent_metadata(self) -> bytes:
        return f"{self.name}|1".encode()  # what a sender's fake add_remote_agent takes the name from

    def add_remote_agent(self, md: bytes) -> str:
        name = md.partition(b"|")[0].decode()
        if self.refuse_reload and self.remote.get(name, md) != md:
            raise RuntimeError("NIXL_ERR_NOT_ALLOWED")
        self.remote[name] = md
        self.events.append(("add_remote_agent", self.name, name))
        return name

    def remove_remote_agent(self, name: str) -> None:
        self.remote.pop(name, None)
        self.events.append(("remove_remote_agent", self.name, name))

    def prep_xfer_dlist(self, who: str, descs: list[tuple[int, int, int]], kind: str) -> FakeDlist:
        return FakeDlist()

    def make_prepped_xfer(self, *args: Any) -> FakeHandle:
        return FakeHandle(self.events, self.name)

    def transfer(self, handle: FakeHandle) -> str:
        if self.fail_post:
            if self.posted is not None:
                self.posted.wait(5)
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        if self.posted is not None:
            self.posted.set()
        return self.state

    def check_xfer_state(self, handle: FakeHandle) -> str:
        return self.state

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        with self.mu:
            self.polls += 1
            new, self.notifs = self.notifs, []
        return {"sender": new} if new else {}


def fake_sender(monkeypatch: pytest.MonkeyPatch, events: list[tuple[Any, ...]], **per_lane: Any) -> NixlSender:
    """A two-lane sender whose agents are fakes; ``per_lane`` maps an agent's role (``send``, ``send1``) to options.

    The first lane (``send``) runs on the calling thread, the second on the sender's lane thread.
    """
    agents: dict[str, FakeAgent] = {}

    def make_agent(role: str, backend_params: object, progress_thread: bool = False) -> FakeAgent:
        agents[role] = FakeAgent(role, events, **per_lane.get(role, {}))
        return agents[role]

    monkeypatch.setattr(tn_sender, "make_agent", make_agent)
    monkeypatch.setattr(tn_sender, "_MIN_LANE_BYTES", 1)
    monkeypatch.setattr(tn_sender, "_DRAIN_S", 0.01, raising=False)
    return NixlSender(lanes=2, max_inflight=4)


@pytest.fixture
def side() -> Iterator[tuple[socket.socket, socket.socket]]:
    """The side channel: the sender's end, and the receiver's (which says nothing unless a test makes it)."""
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)  # a hang guard: a test that fails must not wait for an answer forever
        b.settimeout(5)
        yield a, b


def pools(n: int = 2, size: int = MIB) -> list[torch.Tensor]:
    return [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]


def kinds(events: list[tuple[Any, ...]], kind: str) -> list[int]:
    return [i for i, e in enumerate(events) if e[0] == kind]


def second_lane_fails(first: str = "PROC", second: str = "PROC") -> dict[str, dict[str, Any]]:
    """Options for :func:`fake_sender`: the second lane's post fails once the first lane posted its WRITE.

    ``first``, ``second``: what each lane's WRITEs report afterwards (the failed one's too).
    """
    posted = threading.Event()
    return {
        "send": {"posted": posted, "state": first},
        "send1": {"fail_post": True, "posted": posted, "state": second},
    }


# ── the sender ──


def test_writes_left_in_flight_are_released_before_the_peer_is_forgotten_and_keep_their_memory(
    monkeypatch: pytest.MonkeyPatch, side: tuple[socket.socket, socket.socket]
) -> None:
    """One lane fails, the other's WRITEs stay in flight: released first, then the peer goes; sources kept.

    NIXL's UCX backend releases an in-flight handle with success, yet UCX goes on
    with a started put: the chunk's sources and registrations must outlive it.
    """
    events: list[tuple[Any, ...]] = []
    sender = fake_sender(monkeypatch, events, **second_lane_fails())
    sources = pools()
    with pytest.raises(NixlError, match="could not post"):
        sender._transfer(side[0], "recv", b"recv|1", 7, sources, [4096, 8192], [0, 1], time.monotonic() + 10)
    assert side[1].recv(2) == b"AB"
    released, removed = kinds(events, "release"), kinds(events, "remove_remote_agent")
    assert len(released) == 2 and len(removed) == 2  # a handle per lane; the peer from both agents
    assert max(released) < min(removed)
    (leak,) = sender._leaked
    assert {id(h) for h in leak.handles} == {id(events[i][2]) for i in released}
    assert leak.sources is sources and leak.regs is not None and leak.nbytes == 2 * MIB
    assert not kinds(events, "deregister")  # the chunk's registrations stay with its WRITEs
    assert not sender._peers
    sender.close()
    assert not kinds(events, "deregister")


def test_writes_that_finish_while_draining_free_their_memory(
    monkeypatch: pytest.MonkeyPatch, side: tuple[socket.socket, socket.socket]
) -> None:
    """A failed chunk whose other WRITEs complete meanwhile keeps nothing: its registrations go."""
    events: list[tuple[Any, ...]] = []
    sender = fake_sender(monkeypatch, events, **second_lane_fails("DONE", "ERR"))
    with pytest.raises(NixlError):
        sender._transfer(side[0], "recv", b"recv|1", 7, pools(), [4096, 8192], [0, 1], time.monotonic() + 10)
    assert not sender._leaked and sender.leaked_bytes == 0
    assert len(kinds(events, "deregister")) == 2  # the chunk's registration, on each lane's agent


def test_a_sender_past_its_leak_bound_refuses_to_send(
    monkeypatch: pytest.MonkeyPatch, side: tuple[socket.socket, socket.socket]
) -> None:
    events: list[tuple[Any, ...]] = []
    sender = fake_sender(monkeypatch, events, **second_lane_fails())
    sender.max_leaked_bytes = MIB
    with pytest.raises(NixlError):
        sender._transfer(side[0], "recv", b"recv|1", 7, pools(), [4096, 8192], [0, 1], time.monotonic() + 10)
    assert side[1].recv(2) == b"AB"
    ns, key, chunk = example_chunk()
    with pytest.raises(NixlError, match="max_leaked_bytes"):
        sender._send_one(side[0], ns, key, chunk, 5.0)
    side[1].setblocking(False)
    with pytest.raises(BlockingIOError):  # refused before offering anything
        side[1].recv(1)


def test_pinned_memory_a_leaked_write_reads_stays_registered(
    monkeypatch: pytest.MonkeyPatch, side: tuple[socket.socket, socket.socket]
) -> None:
    """unregister() and close() must not deregister a buffer a WRITE that could not be cancelled still reads."""
    events: list[tuple[Any, ...]] = []
    sender = fake_sender(monkeypatch, events, **second_lane_fails())
    cache, other = torch.zeros(4 * MIB, dtype=torch.uint8), torch.zeros(MIB, dtype=torch.uint8)
    sender.register([cache, other])
    cache_regs = {e[2] for e in events[:2]}
    with pytest.raises(NixlError):
        sender._transfer(
            side[0],
            "recv",
            b"recv|1",
            7,
            [cache[:MIB], cache[MIB : 2 * MIB]],
            [4096, 8192],
            [0, 1],
            time.monotonic() + 9,
        )
    (leak,) = sender._leaked
    assert leak.regs is None and [e[3] for e in leak.pinned] == [cache]
    sender.unregister([cache, other])
    gone = {e[2] for e in events if e[0] == "deregister"}
    assert not gone & cache_regs and len(gone) == 2  # ``other``'s registration, on both agents
    assert not sender._covered(cache.data_ptr(), MIB)  # no later chunk relies on it
    sender.close()
    assert not {e[2] for e in events if e[0] == "deregister"} & cache_regs


def test_metadata_nixl_will_not_load_over_the_old_is_loaded_afresh(
    monkeypatch: pytest.MonkeyPatch, side: tuple[socket.socket, socket.socket]
) -> None:
    """A receiver that registered a slab again at a reused address: NIXL refuses its new metadata (NOT_ALLOWED)."""
    events: list[tuple[Any, ...]] = []
    done = {"state": "DONE", "refuse_reload": True}
    sender = fake_sender(monkeypatch, events, send=done, send1=done)
    sender._transfer(side[0], "recv", b"recv|1", 7, pools(), [4096, 8192], [0, 1], time.monotonic() + 10)
    events.clear()
    sender._transfer(side[0], "recv", b"recv|2", 8, pools(), [4096, 8192], [0, 1], time.monotonic() + 10)
    assert sender._peers["recv"] == b"recv|2"
    assert [e[0] for e in events if "remote" in e[0]] == ["remove_remote_agent"] * 2 + ["add_remote_agent"] * 2
    side[1].setblocking(False)
    with pytest.raises(BlockingIOError):  # no AB: both chunks went through
        side[1].recv(1)


def test_metadata_that_cannot_be_loaded_aborts_the_transfer_on_the_side_channel(
    monkeypatch: pytest.MonkeyPatch, side: tuple[socket.socket, socket.socket]
) -> None:
    """The receiver must hear AB at once, not wait out its timeout; nothing stays cached or loaded."""
    events: list[tuple[Any, ...]] = []
    sender = fake_sender(monkeypatch, events)

    def refuse(md: bytes) -> str:
        raise RuntimeError("NIXL_ERR_BACKEND")

    for agent in sender._agents:
        monkeypatch.setattr(agent, "add_remote_agent", refuse)
    with pytest.raises(NixlError, match="metadata"):
        sender._transfer(side[0], "recv", b"recv|1", 7, pools(), [4096, 8192], [0, 1], time.monotonic() + 10)
    assert side[1].recv(2) == b"AB"
    assert not sender._peers and not kinds(events, "register")


# ── the transfer's deadline ──


def test_a_large_chunk_gets_more_than_the_flat_timeout() -> None:
    assert tn_offer.transfer_seconds(60.0, 4 << 30) == 60.0 + 4096
    assert tn_offer.transfer_seconds(60.0, 0) == 60.0


def test_the_sender_gives_a_chunk_the_size_scaled_deadline(
    monkeypatch: pytest.MonkeyPatch, side: tuple[socket.socket, socket.socket]
) -> None:
    monkeypatch.setattr(tn_offer, "FRAME_MIN_RATE", 1)  # a second per byte: this small chunk is "large"
    sender = fake_sender(monkeypatch, [])
    ns, key, chunk = example_chunk()
    _, sources, _ = tn_offer.encode_snapshot_offer(ns, key, chunk)
    nbytes = sum(s.numel() for s in sources)
    side[1].sendall(
        b"RD"
        + U64.pack(1)
        + U16.pack(4)
        + b"recv"
        + U32.pack(0)
        + U32.pack(len(sources))
        + U64.pack(4096) * len(sources)
    )
    got: list[float] = []

    def transfer(*args: Any) -> None:
        got.append(args[-1] - time.monotonic())
        raise NixlError("enough")

    monkeypatch.setattr(sender, "_transfer", transfer)
    with pytest.raises(NixlError, match="enough"):
        sender._send_one(side[0], ns, key, chunk, 0.5)
    assert got[0] > 0.5 + 0.9 * nbytes


def test_the_receiver_waits_for_the_size_scaled_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool that never lands: the receiver gives up after transfer_seconds, not after the flat timeout."""
    monkeypatch.setattr(tn_offer, "FRAME_MIN_RATE", 1000)
    r = object.__new__(NixlReceiver)
    r._stop, r.timeout = threading.Event(), 0.01
    r._notifs = tn_receiver._Notifs(FakeAgent("recv", []))
    a, b = socket.socketpair()
    with a, b:
        t0 = time.monotonic()
        with pytest.raises(tn_receiver._Aborted, match=r"timed out after 0\.21 s"):
            r._await(a, queue.SimpleQueue(), [], 1, "crc32", b"header", nbytes=200)
        assert time.monotonic() - t0 >= 0.2


# ── the receiver's quarantine and teardown ──


@pytest.fixture
def arena(monkeypatch: pytest.MonkeyPatch) -> tuple[tn_receiver._Arena, tn_receiver._Notifs, FakeAgent]:
    """A receiver's arena of 40 MiB with a fake agent, its quarantine 0.05 s (not a second per MiB more)."""
    monkeypatch.setattr(tn_receiver, "transfer_seconds", lambda timeout, nbytes: timeout)
    agent = FakeAgent("recv", [])
    a = tn_receiver._Arena(agent, 40 * MIB, quarantine_s=0.05)
    return a, tn_receiver._Notifs(agent, a.late, a.age), agent


def test_a_quarantine_ends_only_once_the_agent_was_polled_quietly_past_it(
    arena: tuple[tn_receiver._Arena, tn_receiver._Notifs, FakeAgent],
) -> None:
    """Late WRITEs land only while the agent is polled: time alone must not free an aborted chunk's slab."""
    a, notifs, agent = arena
    slab, _ = a.take([1000])
    a.quarantine(slab, 7)
    time.sleep(0.1)  # past the deadline, but nobody polled
    other, _ = a.take([1000])
    assert other is not slab
    a.give(other)
    agent.notifs.append(tn_offer.notif_tag(7, 0))  # a straggler of the aborted transfer: its quarantine restarts
    assert notifs.poll()
    assert a.quarantined == 1
    time.sleep(0.1)
    assert notifs.poll() and a.quarantined == 0  # a quiet poll past the deadline
    got = {a.take([1000])[0], a.take([1000])[0]}
    assert got == {slab, other}


def test_a_slab_that_was_quarantined_is_never_dropped_to_make_room(
    arena: tuple[tn_receiver._Arena, tn_receiver._Notifs, FakeAgent],
) -> None:
    a, notifs, agent = arena
    slab, _ = a.take([1000])  # 16 MiB
    a.quarantine(slab, 7)
    time.sleep(0.1)
    notifs.poll()
    assert a.quarantined == 0
    with pytest.raises(Exception, match="buffers are full"):
        a.take([30 * MIB])  # would need the quarantined slab's room
    assert not kinds(agent.events, "deregister")
    assert a.take([1000])[0] is slab  # reused, after its quiet period


def test_stop_deregisters_the_receive_buffers_once_it_is_safe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Free slabs at once, one in use when its chunk ends, a quarantined one after the agent was polled past it.

    A chunk still in flight at the stop may abort after it: its slab too is deregistered once its quarantine is over.
    """
    events: list[tuple[Any, ...]] = []
    agent = FakeAgent("recv", events)
    monkeypatch.setattr(tn_receiver, "make_agent", lambda *args: agent)
    monkeypatch.setattr(tn_receiver, "transfer_seconds", lambda timeout, nbytes: timeout)
    r = NixlReceiver("127.0.0.1", 0, DirectoryStore(tmp_path / "store"), timeout=5)
    assert isinstance(r, ReceiverBase)
    r.arena.quarantine_s = 0.2
    r.start()
    (free, _), (done, _), (held, _), (aborted, _) = (r.arena.take([1000]) for _ in range(4))
    r.arena.give(free)
    r.arena.quarantine(held, 7)
    names = {id(s.reg): name for s, name in ((free, "free"), (done, "done"), (held, "held"), (aborted, "aborted"))}

    def deregistered() -> list[str]:
        return [names[id(e[2])] for e in events if e[0] == "deregister"]

    def poller() -> bool:  # this receiver's: another test's may still poll its own quarantine
        return r._poller is not None and r._poller.is_alive()

    r.stop()
    assert deregistered() == ["free"]
    with pytest.raises(Exception, match="stopping"):
        r.arena.take([1000])
    r.arena.give(done)  # chunks that ended after the stop
    r.arena.quarantine(aborted, 8)
    assert deregistered() == ["free", "done"]
    polls = agent.polls
    end = time.monotonic() + 5
    while poller() and time.monotonic() < end:
        time.sleep(0.02)
    assert not poller()
    assert sorted(deregistered()) == ["aborted", "done", "free", "held"]
    assert agent.polls > polls and r.arena.total == 0


# ── what an offer's records decode into counts against max_offer_memory_bytes ──


def empty_buffer_offer(n: int) -> bytearray:
    """An offer of ``n`` dense row-major records of 5 zero-byte inline buffers: 126 bytes each on the wire.

    Every record passes ``decode_checked``; decoded, each is a descriptor and 5 tensors (~2 KiB, ~17x its bytes).
    """
    nb = tn_offer.MAX_RECORD_BUFFERS
    d = TensorDescriptor(
        type_tag=dtypes.from_torch(torch.uint8).tag,
        shape=(0,),
        layout_tag=LAYOUT_ROW_MAJOR,
        buffers=tuple(BufferHandle(0, 1, 0) for _ in range(nb)),
    )
    parts, _, _ = tn_offer.encode_offer("ab" * 8, "cd" * 8, [Record("", d, [torch.empty(0, dtype=torch.uint8)] * nb)])
    body = b"".join(bytes(p) for p in parts)
    head = 2 + 16 + 2 + 16  # namespace and key; then the record count, then the one record
    return bytearray(body[:head] + U32.pack(n) + body[head + 4 :] * n)


def count_decoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    decoded = [0]
    real = tn_offer.decode_checked

    def counting(raw: Any, what: str) -> Any:
        decoded[0] += 1
        return real(raw, what)

    monkeypatch.setattr(tn_offer, "decode_checked", counting)
    return decoded


def test_an_offer_is_charged_for_its_records_before_any_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """65,536 records of empty buffers (8 MiB) would build ~140 MB of objects: the charge comes first."""
    body = empty_buffer_offer(tn_offer.MAX_RECORDS)
    decoded = count_decoded(monkeypatch)
    charged: list[int] = []

    def refuse(nbytes: int) -> None:
        charged.append(nbytes)
        raise HurrayFormatError("receiver.memory", "no room")

    tracemalloc.start()
    try:
        with pytest.raises(HurrayFormatError, match="no room"):
            tn_offer.parse_offer(body, 1 << 30, refuse)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert charged == [tn_offer.MAX_RECORDS * tn_offer.RECORD_MEMORY_BYTES]
    assert charged[0] > 16 * len(body)  # what decoding would build, not the wire bytes
    assert decoded[0] == 0 and peak < 64 << 10  # nothing per record was built

    # A real chunk's offer still parses, charged for its records.
    ns, key, chunk = example_chunk()
    parts, _, _ = tn_offer.encode_snapshot_offer(ns, key, chunk)
    body = bytearray(b"".join(bytes(p) for p in parts))
    offer = tn_offer.parse_offer(body, 1 << 30, charged.append)
    assert offer.key == key and charged[1] == len(offer.descriptors) * tn_offer.RECORD_MEMORY_BYTES
    assert charged[2:] == [copied_bytes(offer, body)]  # and the inline buffers it copied out of the body
    assert decoded[0] == len(offer.descriptors)


def copied_bytes(offer: tn_offer.Offer, body: bytearray) -> int:
    """The bytes of an offer's inline buffers that are not views of its ``body``."""
    lo = torch.frombuffer(body, dtype=torch.uint8).data_ptr()
    inline = [t for bufs in offer.buffers for t in bufs if isinstance(t, torch.Tensor)]
    return sum(t.numel() for t in inline if not lo <= t.data_ptr() < lo + len(body))


def test_inline_buffers_are_views_of_the_offer_and_only_copies_are_charged() -> None:
    """Each inline buffer used to be copied out of the body, uncharged, while the body stays held: twice the memory.

    Now one that starts on a 16-byte boundary is a view of the body; the others are copied (a record may view its
    buffer as a wider type), and charged before they are. Over the 16 shifts of the body in memory, each buffer
    is a view at exactly one.
    """
    sizes = [16, 17, 4096, 3, 1 << 20, 64, 1]
    records = [dense_record(f"x{i}", torch.arange(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    parts, _, _ = tn_offer.encode_offer("ab" * 8, "cd" * 8, records)
    raw = b"".join(bytes(memoryview(p)) for p in parts)
    room = bytearray(len(raw) + tn_offer.INLINE_ALIGN)
    viewed = [0] * len(sizes)
    for shift in range(tn_offer.INLINE_ALIGN):
        body = memoryview(room)[shift : shift + len(raw)]
        body[:] = raw
        lo = torch.frombuffer(body, dtype=torch.uint8).data_ptr()
        charged: list[int] = []
        offer = tn_offer.parse_offer(body, 1 << 30, charged.append)  # type: ignore[arg-type]
        inline = [t for bufs in offer.buffers for t in bufs if isinstance(t, torch.Tensor)]
        copies = 0
        for i, (t, n) in enumerate(zip(inline, sizes, strict=True)):
            assert torch.equal(t, torch.arange(n, dtype=torch.uint8))  # the bytes, viewed or copied
            if lo <= t.data_ptr() < lo + len(raw):
                assert t.data_ptr() % tn_offer.INLINE_ALIGN == 0
                viewed[i] += 1
            else:
                copies += n
        assert charged == [len(sizes) * tn_offer.RECORD_MEMORY_BYTES] + ([copies] if copies else [])
        del offer, inline, t
    assert viewed == [1] * len(sizes)

    # A read-only body is never viewed (torch would warn its tensors could write to it): all copied, all charged.
    charged = []
    tn_offer.parse_offer(raw, 1 << 30, charged.append)  # type: ignore[arg-type]
    assert charged[1] == sum(sizes)


def offer_receiver(limit: int, held: int) -> NixlReceiver:
    """A receiver (no agent, no store) whose connections hold ``held`` bytes of offers of at most ``limit``."""
    r = object.__new__(NixlReceiver)
    r._offers_mu, r._mu = threading.Lock(), threading.Lock()
    r._offer_bytes, r.max_offer_memory_bytes, r.max_chunk_bytes = held, limit, 1 << 30
    r.received = r.refused = 0
    r._local, r._overdue = threading.local(), set()  # what count() looks up: the frames the watchdog cut
    r._notifs = tn_receiver._Notifs(FakeAgent("recv", []))
    return r


def test_the_receiver_refuses_an_offer_whose_records_would_pass_its_memory_bound(
    monkeypatch: pytest.MonkeyPatch, side: tuple[socket.socket, socket.socket]
) -> None:
    """Read whole (8 MiB), it fits the bound; its records, charged, do not: refused undecoded, connection kept."""
    body = empty_buffer_offer(tn_offer.MAX_RECORDS)
    decoded = count_decoded(monkeypatch)
    other = 1 << 20  # another connection's offer
    r = offer_receiver(limit=64 << 20, held=other + len(body))
    assert r._chunk(side[1], body)  # answered; the connection stays usable
    assert side[0].recv(2) == b"ER" and read_message(side[0]).startswith("receiver.memory:")
    assert decoded[0] == 0 and r.refused == 1
    assert r._offer_bytes == other + len(body)  # the charge is given back; the body's bytes are serve's to give


def test_one_offer_alone_is_charged_for_its_records_beyond_the_bound() -> None:
    """As for its bytes, an offer alone always fits; with another connection's held, the bound applies."""
    r = offer_receiver(limit=1000, held=500)
    r._take_offer_memory(10_000, held=500)  # only this connection's own body is held
    assert r._offer_bytes == 10_500
    r._give_offer_memory(10_000)
    r._offer_bytes += 1  # now someone else holds a byte
    with pytest.raises(HurrayFormatError) as err:
        r._take_offer_memory(10_000, held=500)
    assert err.value.field == "receiver.memory" and r._offer_bytes == 501


# ── registering pinned memory ──


def fail_nth_registration(monkeypatch: pytest.MonkeyPatch, sender: NixlSender, n: int) -> None:
    """The ``n``-th ``register_memory`` call, over every lane's agent, fails as NIXL does when memlock runs out."""
    calls = [0]
    for agent in sender._agents:

        def register(descs: list[tuple[int, int, int, str]], kind: str, real: Any = agent.register_memory) -> object:
            calls[0] += 1
            if calls[0] == n:
                raise RuntimeError("NIXL_ERR_BACKEND (memlock)")
            return real(descs, kind)

        monkeypatch.setattr(agent, "register_memory", register)


def test_a_register_that_fails_midway_leaves_nothing_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller learns of no registration and retries them all: none of the first may stay pinned."""
    events: list[tuple[Any, ...]] = []
    sender = fake_sender(monkeypatch, events)
    fail_nth_registration(monkeypatch, sender, 3)  # the second tensor's, on the first lane
    buffers = pools(3)
    with pytest.raises(NixlError, match="could not register"):
        sender.register(buffers)
    assert not sender._pinned
    registered = {id(e[2]) for e in events if e[0] == "register"}
    assert len(registered) == 2  # the first tensor's, on both lanes
    assert {id(e[2]) for e in events if e[0] == "deregister"} == registered
    sender.register(buffers)  # the retry
    assert len(sender._pinned) == 3


@pytest.mark.parametrize("bad", ["empty", "strided"])
def test_a_register_with_a_buffer_it_refuses_registers_none(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    """The caller's mistake (HurrayArgumentError naming ``tensors``), not bad data: was a HurrayFormatError."""
    events: list[tuple[Any, ...]] = []
    sender = fake_sender(monkeypatch, events)
    wrong = torch.zeros(0, dtype=torch.uint8) if bad == "empty" else torch.zeros(64, 64, dtype=torch.uint8).t()
    with pytest.raises(HurrayArgumentError, match="non-empty host tensors") as info:
        sender.register([*pools(2), wrong])
    assert info.value.field == "tensors" and "tensor 2" in str(info.value)
    assert not sender._pinned and not events


def test_a_negative_leak_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender built past its bound would refuse every chunk, for good, with a NixlError that blames leaks."""
    monkeypatch.setattr(tn_sender, "make_agent", lambda role, *args: FakeAgent(role, []))
    with pytest.raises(HurrayArgumentError, match="max_leaked_bytes") as info:
        NixlSender(lanes=1, max_leaked_bytes=-1)
    assert info.value.field == "max_leaked_bytes"
    assert NixlSender(lanes=1, max_leaked_bytes=0).max_leaked_bytes == 0  # no leak kept: refuses after the first


# ── the grant, and transfers through a shared sender ──


def test_a_receiver_trickling_its_grant_times_out_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch, side: tuple[socket.socket, socket.socket]
) -> None:
    """A byte per (almost) timeout of 1,000 bytes of metadata: the whole grant within one timeout, not per byte."""
    sender = fake_sender(monkeypatch, [])
    side[0].settimeout(0.5)  # as dial() leaves it: the send's timeout
    stop = threading.Event()

    def trickle() -> None:
        side[1].sendall(b"RD" + U64.pack(1) + U16.pack(4) + b"recv" + U32.pack(1000))
        end = time.monotonic() + 3  # bounds the test without the fix
        while not stop.wait(0.2) and time.monotonic() < end:
            try:
                side[1].sendall(b"x")
            except OSError:
                return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    ns, key, chunk = example_chunk()
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            sender._send_one(side[0], ns, key, chunk, 0.5)
        assert time.monotonic() - t0 < 2 * 0.5
    finally:
        stop.set()
        t.join(5)


def test_no_write_is_posted_past_the_transfer_deadline(
    monkeypatch: pytest.MonkeyPatch, side: tuple[socket.socket, socket.socket]
) -> None:
    """Past its deadline the receiver gave up: a WRITE posted then could only be one more UCX cannot cancel."""
    events: list[tuple[Any, ...]] = []
    sender = fake_sender(monkeypatch, events, send={"state": "DONE"}, send1={"state": "DONE"})
    posted: list[Any] = []

    def post(*args: Any) -> FakeHandle:
        posted.append(args)
        return FakeHandle(events, "send")

    monkeypatch.setattr(sender, "_post", post)
    with pytest.raises(TimeoutError):
        sender._transfer(side[0], "recv", b"recv|1", 7, pools(), [4096, 8192], [0, 1], time.monotonic() - 0.01)
    assert not posted
    assert side[1].recv(2) == b"AB"
    assert not sender._leaked and len(kinds(events, "deregister")) == 2  # the chunk's registrations go


class CopyingAgent(FakeAgent):
    """A sender's lane agent whose WRITEs copy into the receiver's memory and notify its (fake) agent.

    A WRITE posted from thread ``T`` completes ``delays[T]`` seconds after it was posted.
    """

    def __init__(self, name: str, receiver: FakeAgent, delays: dict[str, float], posts: list[tuple[str, float]]):
        super().__init__(name, [])
        self.receiver, self.delays, self.posts = receiver, delays, posts

    def prep_xfer_dlist(self, who: str, descs: list[tuple[int, int, int]], kind: str) -> Any:
        d = FakeDlist()
        d.descs = descs  # type: ignore[attr-defined]
        return d

    def make_prepped_xfer(self, *args: Any) -> Any:
        _, local, (i,), remote, _, notif = args
        h = FakeHandle(self.events, self.name)
        h.write = (local.descs[i], remote.descs[i], notif)  # type: ignore[attr-defined]
        return h

    def transfer(self, handle: Any) -> str:
        name = threading.current_thread().name
        self.posts.append((name, time.monotonic()))
        handle.due = time.monotonic() + self.delays.get(name, 0.0)
        return "PROC"

    def check_xfer_state(self, handle: Any) -> str:
        if time.monotonic() < handle.due:
            return "PROC"
        (src, n, _), (dst, _, _), notif = handle.write
        ctypes.memmove(dst, src, n)
        with self.receiver.mu:
            self.receiver.notifs.append(notif)
        return "DONE"


@pytest.fixture
def fake_receiver(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[NixlReceiver, FakeAgent]]:
    """A started receiver on 127.0.0.1 whose agent is a fake: page pools are written into its slabs by the test."""
    agent = FakeAgent("recv", [])
    monkeypatch.setattr(tn_receiver, "make_agent", lambda *args: agent)
    r = NixlReceiver("127.0.0.1", 0, DirectoryStore(tmp_path / "store"), timeout=5).start()
    try:
        yield r, agent
    finally:
        r.stop()


def test_a_push_waiting_for_another_on_a_shared_sender_posts_nothing_past_its_deadline(
    monkeypatch: pytest.MonkeyPatch, fake_receiver: tuple[NixlReceiver, FakeAgent]
) -> None:
    """B's chunk, granted while A's transfer holds the (process-wide) sender, must not be posted past B's deadline.

    The receiver's clock on a transfer starts at its grant: so must the sender's.
    """
    r, ragent = fake_receiver
    delays = {"A": 1.0}  # A's WRITEs take a second; B's are instant
    posts: list[tuple[str, float]] = []
    monkeypatch.setattr(tn_sender, "make_agent", lambda role, *args: CopyingAgent(role, ragent, delays, posts))
    monkeypatch.setattr(tn_sender, "_DRAIN_S", 0.01)
    sender = NixlSender(lanes=1)
    deadlines: dict[str, float] = {}
    transfer = sender._transfer

    def recording(*args: Any) -> None:
        deadlines[threading.current_thread().name] = args[-1]
        transfer(*args)

    monkeypatch.setattr(sender, "_transfer", recording)
    url = f"nixl://127.0.0.1:{r.address[1]}"
    ns, key, chunk = example_chunk()
    results: dict[str, str] = {}

    def push(timeout: float) -> None:
        try:
            sender.send(url, [(ns, key, chunk)], timeout=timeout)
            results[threading.current_thread().name] = "ok"
        except Exception as exc:
            results[threading.current_thread().name] = repr(exc)

    a = threading.Thread(target=push, args=(10.0,), name="A")
    a.start()
    end = time.monotonic() + 5
    while not posts and time.monotonic() < end:  # A's transfer is under way
        time.sleep(0.01)
    b = threading.Thread(target=push, args=(0.5,), name="B")
    b.start()
    a.join(10)
    b.join(10)
    late = [t for name, t in posts if name == "B" and t > deadlines["B"]]
    assert not late
    assert results == {"A": "ok", "B": "ok"}
    sender.close()


def test_a_push_waiting_for_the_shared_sender_opens_its_side_channel_only_when_it_may_offer(
    monkeypatch: pytest.MonkeyPatch, fake_receiver: tuple[NixlReceiver, FakeAgent]
) -> None:
    """Found by a review: B connected, then waited silently for the sender's lock while A's transfer ran, and the
    receiver cut B's side channel at its first-frame bound: a push to a healthy receiver failed because another
    engine's transfer was slow. B now connects under the lock its first offer takes."""
    from hurray_vllm.transport import base

    r, ragent = fake_receiver
    monkeypatch.setattr(base, "HANDSHAKE_TIMEOUT_S", 0.5)  # the receiver's first-frame bound, scaled from 10 s
    delays = {"A": 1.5}  # A's WRITEs outlast B's bound
    posts: list[tuple[str, float]] = []
    monkeypatch.setattr(tn_sender, "make_agent", lambda role, *args: CopyingAgent(role, ragent, delays, posts))
    monkeypatch.setattr(tn_sender, "_DRAIN_S", 0.01)
    sender = NixlSender(lanes=1)
    url = f"nixl://127.0.0.1:{r.address[1]}"
    ns, key, chunk = example_chunk()
    results: dict[str, str] = {}

    def push(name: str) -> None:
        try:
            sender.send(url, [(ns, name * 8 + key[16:], chunk)], timeout=10.0, owner=threading.current_thread())
            results[name] = "ok"
        except Exception as exc:
            results[name] = repr(exc)

    a = threading.Thread(target=push, args=("aa",), name="A")
    a.start()
    end = time.monotonic() + 5
    while not posts and time.monotonic() < end:  # A's transfer is under way
        time.sleep(0.01)
    b = threading.Thread(target=push, args=("bb",), name="B")
    b.start()
    a.join(15)
    b.join(15)
    assert results == {"aa": "ok", "bb": "ok"}
    assert r.refused == 0
    sender.close()


# ── the receiver's arena, its stop, and its construction ──


def test_an_offer_that_cannot_fit_is_refused_before_any_free_slab_is_dropped() -> None:
    """Dropping the free slabs would not make room for it: they stay, warm and registered (any peer could ask)."""
    agent = FakeAgent("recv", [])
    a = tn_receiver._Arena(agent, 64 * MIB, quarantine_s=5.0)
    a.take([30 * MIB])  # a chunk in flight
    free = [a.take([10 * MIB])[0] for _ in range(2)]  # 16 MiB slabs
    for slab in free:
        a.give(slab)
    total = a.total
    with pytest.raises(HurrayFormatError, match=r"buffers are full.*try again later") as info:
        a.take([40 * MIB])  # would need 70 MiB with the free slabs dropped
    assert info.value.field == "receiver.memory"  # as docs/connector.md says, and as over TCP
    assert a._free == free and a.total == total and not kinds(agent.events, "deregister")
    a.take([20 * MIB])  # fits once both free slabs are dropped: they are
    assert not a._free and len(kinds(agent.events, "deregister")) == 2


def test_a_chunk_larger_than_the_arena_is_refused_for_good_naming_the_limit() -> None:
    """It used to be refused as "full; try again later" (field ``transport``): the sender would retry for good."""
    agent = FakeAgent("recv", [])
    a = tn_receiver._Arena(agent, 1 * MIB, quarantine_s=5.0)
    for sizes in ([2 * MIB], [MIB // 2, MIB // 2 + 1]):  # the second: 4 KiB alignment takes it past the limit
        with pytest.raises(HurrayFormatError, match="can never be received") as info:
            a.take(sizes)
        assert info.value.field == "receiver.memory"
        assert all(name in str(info.value) for name in ("max_arena_bytes", "--max-memory", "max_memory_mib"))
    assert not agent.events and a.total == 0
    a.take([MIB])  # the limit itself fits


def test_a_malformed_offer_has_no_slab_allocated_for_it(fake_receiver: tuple[NixlReceiver, FakeAgent]) -> None:
    """A slab (up to max_chunk_bytes, registered with NIXL) used to be taken before the offer was assembled."""
    from hurray_vllm.app.demo import spec_example_snapshot
    from hurray_vllm.chunks.keys import namespace_of

    r, agent = fake_receiver
    whole = spec_example_snapshot()  # a whole snapshot: no chunk digest
    assert whole.fingerprint is not None
    msg, _ = offer_message(namespace_of(whole.fingerprint), "ab" * 8, whole)
    with socket.create_connection(r.address, timeout=5) as s:
        for _ in range(2):
            s.sendall(msg)
            assert recv_exact(s, 2) == b"ER" and read_message(s).startswith("snapshot.digest:")
        assert r.arena.registrations == 0 and r.arena.total == 0 and not kinds(agent.events, "register")
        s.sendall(offer_message(*example_chunk())[0])  # the connection still serves: a chunk gets its slab
        read_grant(s)
        assert r.arena.registrations == 1


def test_a_keyed_receiver_refuses_an_unsigned_chunk_before_its_transfer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Only the connection is authenticated: an unsigned chunk used to be granted, transferred, then refused."""
    from hurray_vllm.chunks.signing import FleetKeys, sign_chunk

    keys = FleetKeys.from_secrets(b"k" * 32)
    ragent = FakeAgent("recv", [])
    monkeypatch.setattr(tn_receiver, "make_agent", lambda *args: ragent)
    posts: list[tuple[str, float]] = []
    monkeypatch.setattr(tn_sender, "make_agent", lambda role, *args: CopyingAgent(role, ragent, {}, posts))
    ns, key, chunk = example_chunk()
    with NixlReceiver("127.0.0.1", 0, DirectoryStore(tmp_path), keys=keys, timeout=5).start() as r:
        url = f"nixl://127.0.0.1:{r.address[1]}"
        sender = NixlSender(lanes=1)
        with pytest.raises(HurrayFormatError, match=r"snapshot\.mac\.unsigned"):
            sender.send(url, [(ns, key, chunk)], keys=keys)
        assert not posts and r.received == 0 and r.arena.registrations == 0  # no slab allocated for it either
        sender.send(url, [(ns, key, sign_chunk(chunk, keys, ns, key))], keys=keys)  # a signed one still goes
        assert posts and r.received == 1
        posts.clear()
        other = FleetKeys.from_secrets(b"o" * 32)  # with a slab free now: checked after it is taken, before the grant
        with pytest.raises(HurrayFormatError, match=r"snapshot\.mac\.key_id"):
            sender.send(url, [(ns, key, sign_chunk(chunk, other, ns, key))], keys=keys)
        assert not posts and r.received == 1 and r.arena.registrations == 1
        sender.close()


def offer_message(ns: str, key: str, chunk: Any) -> tuple[bytes, list[torch.Tensor]]:
    """A chunk's offer as the sender frames it, and its page pools."""
    parts, sources, _ = tn_offer.encode_snapshot_offer(ns, key, chunk)
    body = b"".join(bytes(memoryview(p)) for p in parts)
    return tn_offer.MAGIC + U64.pack(len(body)) + body, sources


def read_grant(s: socket.socket) -> tuple[int, list[int]]:
    """The transfer id and the destination addresses of a grant (``RD``)."""
    assert recv_exact(s, 2) == b"RD"
    (xfer_id,) = U64.unpack(recv_exact(s, 8))
    recv_exact(s, U16.unpack(recv_exact(s, 2))[0])  # the agent's name
    recv_exact(s, U32.unpack(recv_exact(s, 4))[0])  # its metadata
    (n,) = U32.unpack(recv_exact(s, 4))
    return xfer_id, [a for (a,) in U64.iter_unpack(recv_exact(s, 8 * n))]


def test_a_chunk_whose_digest_is_checked_after_stop_began_is_refused_not_stored(
    monkeypatch: pytest.MonkeyPatch, fake_receiver: tuple[NixlReceiver, FakeAgent], tmp_path: Path
) -> None:
    """stop() waits only for a put under way (10 s at most): none may start after it began, as over TCP."""
    r, agent = fake_receiver
    result = tn_receiver._Hasher.result

    def stop_begins(self: tn_receiver._Hasher, timeout: float) -> str | None:
        r._stop.set()  # what stop() does first, while a large chunk's checksum is being finished
        return result(self, timeout)

    monkeypatch.setattr(tn_receiver._Hasher, "result", stop_begins)
    ns, key, chunk = example_chunk()
    msg, sources = offer_message(ns, key, chunk)
    with socket.create_connection(r.address, timeout=5) as s:
        s.sendall(msg)
        xfer_id, addrs = read_grant(s)
        for i, (addr, src) in enumerate(zip(addrs, sources)):
            ctypes.memmove(addr, src.data_ptr(), src.numel())
            with agent.mu:
                agent.notifs.append(tn_offer.notif_tag(xfer_id, i))
        s.sendall(b"GO")
        assert recv_exact(s, 2) == b"ER"
        assert "the receiver is stopping" in read_message(s)
    assert not list((tmp_path / "store").rglob("*.hrry"))
    assert r.received == 0 and r.refused == 1
    assert len(r.arena._free) == 1 and not r.arena.quarantined  # its slab given back, as after any refusal


@pytest.mark.parametrize("bad", ["timeout", "port in use"])
def test_a_receiver_that_cannot_start_keeps_no_agent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, bad: str) -> None:
    """NIXL has no close: an agent lives (its UCX workers too) as long as a reference, a traceback's say."""
    made: list[weakref.ref[FakeAgent]] = []

    def make_agent(*args: Any) -> FakeAgent:
        agent = FakeAgent("recv", [])
        made.append(weakref.ref(agent))
        return agent

    monkeypatch.setattr(tn_receiver, "make_agent", make_agent)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1] if bad == "port in use" else 0
        timeout = 0.0 if bad == "timeout" else 5.0
        with pytest.raises((HurrayArgumentError, OSError)) as info:
            NixlReceiver("127.0.0.1", port, DirectoryStore(tmp_path), timeout=timeout)
        gc.collect()
        assert made and made[0]() is None
        assert info.value is not None  # the traceback (and the frames it holds) still alive here


@pytest.mark.parametrize("size", [0, -1, 1.5, "8"])
def test_an_arena_with_no_room_is_refused_before_an_agent_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, size: int
) -> None:
    made: list[FakeAgent] = []

    def make_agent(*args: Any) -> FakeAgent:
        made.append(FakeAgent("recv", []))
        return made[-1]

    monkeypatch.setattr(tn_receiver, "make_agent", make_agent)
    with pytest.raises(HurrayArgumentError, match="max_arena_bytes") as info:
        NixlReceiver("127.0.0.1", 0, DirectoryStore(tmp_path), max_arena_bytes=size)
    assert info.value.field == "max_arena_bytes" and not made


@pytest.mark.parametrize("size", [0, 2.5, "1"])
def test_offer_memory_that_is_no_positive_integer_is_refused_naming_it(tmp_path: Path, size: object) -> None:
    """The error named "limits" (no argument of that name), and 2.5 bytes or "1" were compared as they were."""
    with pytest.raises(HurrayArgumentError) as info:
        NixlReceiver("127.0.0.1", 0, DirectoryStore(tmp_path), max_offer_memory_bytes=size)  # type: ignore[arg-type]
    assert info.value.field == "max_offer_memory_bytes"


def test_a_url_that_is_not_a_string_is_refused_naming_hurray_url() -> None:
    """A missing setting (None) raised a TypeError where every malformed URL raises HurrayFormatError."""
    for url in (None, b"nixl://h:1", 7):
        with pytest.raises(HurrayFormatError) as info:
            transport.channel_of(url)  # type: ignore[arg-type]
        assert info.value.field == "hurray_url"


# ── a new side channel's first frame, and the aligned pool bytes ──


@contextlib.contextmanager
def copying_pair(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **limits: Any
) -> Iterator[tuple[NixlReceiver, NixlSender, str]]:
    """A started receiver with ``limits`` and a one-lane sender whose WRITEs copy into its slabs; the sender's URL."""
    ragent = FakeAgent("recv", [])
    monkeypatch.setattr(tn_receiver, "make_agent", lambda *args: ragent)
    monkeypatch.setattr(tn_sender, "make_agent", lambda role, *args: CopyingAgent(role, ragent, {}, []))
    with NixlReceiver("127.0.0.1", 0, DirectoryStore(tmp_path / "store"), **limits).start() as r:
        sender = NixlSender(lanes=1)
        try:
            yield r, sender, f"nixl://127.0.0.1:{r.address[1]}"
        finally:
            sender.close()


def test_a_silent_side_channel_is_closed_after_the_handshake_timeout_and_frees_its_slot(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A keyless receiver gave a silent new connection the idle timeout: 64 of them locked every sender out."""
    monkeypatch.setattr(base, "HANDSHAKE_TIMEOUT_S", 0.5)
    ns, key, chunk = example_chunk()
    with copying_pair(monkeypatch, tmp_path, timeout=5, idle_timeout=60, max_connections=1) as (r, sender, url):
        with socket.create_connection(r.address, timeout=10) as silent:
            start = time.monotonic()
            assert silent.recv(1) == b""  # closed by the receiver: 60 s idle would raise TimeoutError here
            assert time.monotonic() - start < 5
            # Its one slot is free once the connection's thread is done (just after the close).
            assert wait_for(lambda: not r._conns, 5)
            sender.send(url, [(ns, key, chunk)], timeout=5)  # while the silent peer's socket is still open
        assert r.store.has(ns, key) and (r.received, r.refused) == (1, 0)  # type: ignore[attr-defined]


def test_a_sender_makes_its_first_chunk_before_it_opens_the_side_channel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A chunk exported (and stored) after connecting would spend the receiver's first-frame bound: it is made first."""
    monkeypatch.setattr(base, "HANDSHAKE_TIMEOUT_S", 0.5)
    ns, key, chunk = example_chunk()

    def slow_first() -> Iterator[tuple[str, str, Any]]:  # an engine exporting and storing its chunk
        time.sleep(1.5)
        yield ns, key, chunk

    with copying_pair(monkeypatch, tmp_path, timeout=5, idle_timeout=60) as (r, sender, url):
        (stats,) = sender.send(url, slow_first(), timeout=5)
        assert stats.key == key and r.received == 1 and r.refused == 0


def test_an_abort_while_the_first_chunk_is_made_still_aborts_the_nixl_push(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The first chunk is made before any socket exists for abort() to shut: the push checks for it once connected."""
    ns, key, chunk = example_chunk()
    with copying_pair(monkeypatch, tmp_path, timeout=5) as (r, sender, url):

        def aborted_first() -> Iterator[tuple[str, str, Any]]:
            sender.abort()  # the connector's shutdown, while the writer exports the first chunk
            yield ns, key, chunk

        with pytest.raises(SendAborted):
            sender.send(url, aborted_first(), timeout=5)
        assert r.received == 0 and r.arena.registrations == 0


def test_max_chunk_bytes_counts_each_page_pool_as_its_receive_buffer_takes_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Pools are laid out on 4 KiB boundaries: 16,000 pools of 2 bytes passed a 64 KiB limit and took ~64 MB."""
    msg, sources = offer_message(*example_chunk())  # 8 pools of 128 bytes: 1 KiB announced, 32 KiB taken
    sizes = [s.numel() for s in sources]
    _, taken = tn_offer.pool_offsets(sizes)
    assert sum(sizes) < taken - 1
    for limit, granted in ((taken - 1, False), (taken, True)):
        with copying_pair(monkeypatch, tmp_path / str(limit), timeout=5, max_chunk_bytes=limit) as (r, _, _):
            with socket.create_connection(r.address, timeout=5) as s:
                s.sendall(msg)
                if granted:
                    read_grant(s)
                    assert r.arena.registrations == 1
                    continue
                assert recv_exact(s, 2) == b"ER"
                message = read_message(s)
                assert "max_chunk_bytes" in message and f"limit of {limit} bytes" in message, message
                assert r.arena.registrations == 0 and r.arena.total == 0
                assert "max_chunk_bytes" in (r.last_error or "") and r.refused == 1
