"""The NIXL transport's failure handling, with fake agents: no NIXL, no UCX, no second process.

Each test drives the sender's or the receiver's code against agents that
record what is done to them, and answer as NIXL does in the case at hand
(a WRITE that stays in flight, metadata NIXL will not load over the old).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from synthetic import example_chunk

from hurray_vllm.chunks.store import DirectoryStore
from hurray_vllm.containers.schema import Record
from hurray_vllm.errors import HurrayFormatError
from hurray_vllm.transport.base import U16, U32, U64, ReceiverBase, read_message
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

    def register_memory(self, descs: list[tuple[int, int, int, str]], kind: str) -> object:
        reg = object()
        self.events.append(("register", self.name, reg))
        return reg

    def deregister_memory(self, reg: object) -> None:
        self.events.append(("deregister", self.name, reg))

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
    offer = tn_offer.parse_offer(bytearray(b"".join(bytes(p) for p in parts)), 1 << 30, charged.append)
    assert offer.key == key and charged[1:] == [len(offer.descriptors) * tn_offer.RECORD_MEMORY_BYTES]
    assert decoded[0] == len(offer.descriptors)


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
