"""The consumer's side of protocol version 2, against a scripted producer: a raw ZeroMQ
ROUTER and a NIXL agent over real DRAM, driven message by message by the test (no
``Producer``), so every message the consumer sends can be read and every answer chosen.

What it pins: a fresh ``xid`` per use in every message; a message of another use changes
nothing (``stale_messages``); ``sid``/``sharers`` in pull messages; ``PullHeld.hold_s``
bounds when a READ may end; identical Hello retransmits; results that name
their blocks and xid; claims.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

import kvpush
from kvpush import messages as m
from kvpush.agent import Agent
from kvpush.auth import Opener, Sealer, decrypt, encrypt, new_nonce, session_key
from kvpush.errors import AuthenticationError, InvalidRequest
from tests.support.harness import check_blocks, fill, make_cache

KEY = b"k" * 32
CACHE = {"num_blocks": 16}


class ScriptedProducer:
    """Plays a producer: accepts one consumer's Hello, then sends and receives what the
    test says. ``recv`` returns the next control message (with a timeout)."""

    def __init__(self, auth_key: bytes | None = None, name: str = "scripted") -> None:
        self.cache = make_cache(**CACHE)
        fill(self.cache, 7)
        self.name = name
        self.key = auth_key
        self.agent = Agent(name, self.cache.layout, kvpush.TransportConfig())
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.identity = b""
        self.sealer: Sealer | None = None
        self.opener: Opener | None = None
        self.consumer_agent = ""
        self.session = b""
        # NIXL progress on this side (a READ from it may need it), and its notifications
        self.notes: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = False
        self._progress = threading.Thread(target=self._progress_loop, name="scripted-nixl")
        self._progress.start()

    def _progress_loop(self) -> None:
        while not self._stop:
            with self._lock:
                for notes in self.agent.notifications().values():
                    self.notes.extend(notes)
            time.sleep(0.001)

    def recv_frame(self, timeout: float = 5.0) -> tuple[bytes, bytes]:
        assert self.sock.poll(int(timeout * 1000)), "no frame from the consumer"
        identity, frame = self.sock.recv_multipart()
        return identity, frame

    def recv(self, timeout: float = 5.0, skip: tuple[type, ...] = (m.Heartbeat,)) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            _, frame = self.recv_frame(max(deadline - time.monotonic(), 0.01))
            try:
                msg = m.decode(frame, self.opener)
            except AuthenticationError:
                # A Probe or Hello retransmit that crossed our answer: sealed with the key.
                assert self.key is not None
                msg = m.decode(frame, Opener(self.key, b"hello", replay=False))
                assert isinstance(msg, (m.Probe, m.Hello))
            if not isinstance(msg, (*skip, m.Probe, m.Hello)):
                return msg

    def send(self, msg: m.Message) -> None:
        self.sock.send_multipart([self.identity, m.encode(msg, self.sealer)])

    def _handshake(self, frame: bytes) -> m.Message:
        return m.decode(frame) if self.key is None else \
            m.decode(frame, Opener(self.key, b"hello", replay=False))

    def challenge(self, frame: bytes) -> None:
        """Answer the consumer's Probe ``frame`` with a Challenge."""
        probe = self._handshake(frame)
        assert isinstance(probe, m.Probe)
        answer = m.Challenge(self.name, b"scripted", new_nonce(), probe.nonce)
        self.sock.send_multipart([self.identity, m.encode(
            answer, None if self.key is None else Sealer(self.key, b"challenge"))])

    def next_hello(self) -> bytes:
        """The consumer's next Hello frame (Probe retransmits that crossed the Challenge
        skipped)."""
        while True:
            self.identity, frame = self.recv_frame()
            if isinstance(self._handshake(frame), m.Hello):
                return frame

    def accept(self, frame: bytes | None = None) -> bytes:
        """Answer the consumer's Probe with a Challenge and its Hello with a HelloAck
        (``frame``: the Probe or the Hello, already received); returns the HelloAck's
        frame."""
        if frame is None:
            self.identity, frame = self.recv_frame()
        if isinstance(self._handshake(frame), m.Probe):
            self.challenge(frame)
            frame = self.next_hello()
        hello = self._handshake(frame)
        assert isinstance(hello, m.Hello)
        layout = kvpush.KVLayout.from_wire(hello.layout)
        metadata = hello.agent_metadata if self.key is None else decrypt(
            self.key, b"hello-metadata", hello.nonce + hello.name.encode(), hello.agent_metadata)
        with self._lock:
            self.consumer_agent = self.agent.add_peer(metadata, layout)
        if self.key is None:
            ack = m.HelloAck(self.name, self.agent.metadata(), self.cache.layout.to_wire())
            answer = m.encode(ack)
        else:
            nonce = new_nonce()
            session = session_key(self.key, hello.nonce, nonce)
            self.session = session
            self.sealer, self.opener = Sealer(session, b"p2c"), Opener(session, b"c2p")
            ack = m.HelloAck(self.name, encrypt(session, b"ack-metadata", nonce + hello.nonce,
                                                self.agent.metadata()),
                             self.cache.layout.to_wire(), nonce=nonce, echo=hello.nonce)
            answer = m.encode(ack, Sealer(self.key, b"hello-ack"))
        self.sock.send_multipart([self.identity, answer])
        return answer

    def ticket(self, rid: str, ids: list[int], sid: int = 77, lease_s: float = 30.0) -> Any:
        ticket = m.PullTicket(producer=self.name, address=self.address, request_id=rid,
                              block_ids=m.encode_ids(np.array(ids)), lease_s=lease_s,
                              issued_at=time.time(), sid=sid)
        return ticket if self.key is None else ticket.seal(self.key)

    def close(self) -> None:
        self._stop = True
        self._progress.join(5)
        self.sock.close()
        self.ctx.destroy(linger=0)
        self.agent.close()


@pytest.fixture
def pair() -> Iterator[tuple[ScriptedProducer, kvpush.Consumer, Any]]:
    prod = ScriptedProducer()
    dst = make_cache(**CACHE)
    consumer = kvpush.Consumer(dst.layout, kvpush.ConsumerConfig(abort_grace_s=1.0))
    try:
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(consumer.connect(prod.address, 10)))
        t.start()
        prod.accept()
        t.join(10)
        assert box == [prod.name]
        yield prod, consumer, dst
    finally:
        consumer.close()
        prod.close()


def _wait_stat(consumer: kvpush.Consumer, name: str, at_least: int) -> None:
    deadline = time.monotonic() + 5
    while consumer.stats()[name] < at_least:
        assert time.monotonic() < deadline, consumer.stats()
        time.sleep(0.01)


def test_every_message_of_a_push_carries_its_xid_and_stale_ones_change_nothing(
        pair: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    prod, consumer, _ = pair
    h1 = consumer.expect("r", np.array([1, 2]), prod.name, timeout=10, sharers=3)
    reg = prod.recv()
    assert isinstance(reg, m.Register) and reg.xid == h1.xid != 0 and reg.sharers == 3
    # A Failed, Posted, Abort or AbortAck of another use of "r" (or of no use) is stale.
    for msg in (m.Failed("r", reg.xid ^ 1, "aborted", "old use"),
                m.Abort("r", reg.xid + 2, "old use"), m.AbortAck("r", 5),
                m.Posted("r", 9, 0, empty=True), m.Failed("nobody", reg.xid, "x", "y")):
        prod.send(msg)
    _wait_stat(consumer, "stale_messages", 5)
    assert not h1.done() and consumer.pending == 1
    # A duplicate expect fails on its own: its result names its own xid and blocks.
    h2 = consumer.expect("r", np.array([5]), prod.name, timeout=10)
    dup = h2.wait(5)
    assert dup.state is kvpush.RequestState.FAILED and dup.xid == h2.xid != h1.xid
    assert dup.block_ids.tolist() == [5] and not h1.done()
    # The live use's own Failed ends it (no WRITE was posted: nothing to wait for).
    prod.send(m.Failed("r", reg.xid, "lease_expired", "too late"))
    res = h1.wait(5)
    assert res.state is kvpush.RequestState.TIMED_OUT and res.xid == h1.xid
    assert res.block_ids.tolist() == [1, 2] and res.blocks_safe
    abort = prod.recv()  # this side gives the use up at the producer too
    assert isinstance(abort, m.Abort) and abort.xid == h1.xid
    # A second use of the id gets a fresh xid.
    h3 = consumer.expect("r", np.array([3]), prod.name, timeout=10)
    reg3 = prod.recv()
    assert isinstance(reg3, m.Register) and reg3.xid == h3.xid not in (h1.xid, h2.xid)
    consumer.abort("r")
    abort = prod.recv()
    assert isinstance(abort, m.Abort) and abort.xid == h3.xid
    prod.send(m.AbortAck("r", h1.xid))  # the old use's ack does not end the new one
    _wait_stat(consumer, "stale_messages", 6)
    assert not h3.done()
    prod.send(m.AbortAck("r", h3.xid))
    assert h3.wait(5).state is kvpush.RequestState.ABORTED


def test_sharers_are_checked_at_the_api(
        pair: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    prod, consumer, _ = pair
    for bad in (0, m.MAX_SHARERS + 1, True, 1.0, [1, 2], [0]):
        with pytest.raises(ValueError, match="sharers"):
            consumer.expect("s", np.array([1]), prod.name, sharers=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sharers"):
        consumer.pull(prod.ticket("s", [1]), np.array([1]), sharers=0)
    with pytest.raises(ValueError, match="sharers"):
        consumer.claim(prod.ticket("s", [1]), sharers=-1)
    consumer.expect("s", np.array([1]), [prod.name], sharers=[4])
    reg = prod.recv()
    assert isinstance(reg, m.Register) and reg.sharers == 4


def _pull(prod: ScriptedProducer, consumer: kvpush.Consumer, hold_s: float,
          rid: str) -> tuple[kvpush.TransferResult, m.PullBegin]:
    handle = consumer.pull(prod.ticket(rid, [3, 4], sid=1234), np.array([5, 6]),
                           timeout=10, sharers=2)
    begin = prod.recv()
    assert isinstance(begin, m.PullBegin)
    assert (begin.xid, begin.sid, begin.sharers) == (handle.xid, 1234, 2)
    time.sleep(0.2)  # the READ (local DRAM) has ended by now
    prod.send(m.PullHeld(rid, begin.xid ^ 2, 100.0))  # another use's: stale
    _wait_stat(consumer, "stale_messages", 1)
    assert not handle.done()
    prod.send(m.PullHeld(rid, begin.xid, hold_s))
    return handle.wait(5), begin


def test_pull_is_ready_when_its_read_ended_inside_the_hold(
        pair: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    prod, consumer, dst = pair
    res, begin = _pull(prod, consumer, 30.0, "held")
    assert res.state is kvpush.RequestState.READY, res
    assert res.xid == begin.xid and res.block_ids.tolist() == [5, 6]
    check_blocks(dst, np.array([5, 6]), np.array([3, 4]), 7)
    # The READ's own notification names the use and the source.
    deadline = time.monotonic() + 5
    while not prod.notes and time.monotonic() < deadline:
        time.sleep(0.01)
    done = m.decode(prod.notes[0])
    assert isinstance(done, m.PullDone) and (done.xid, done.sid) == (begin.xid, 1234)
    assert done.nbytes > 0


@pytest.mark.parametrize("hold_s", [0.0, float("nan"), -1.0])
def test_pull_whose_read_ended_past_the_hold_fails_safely(
        pair: tuple[ScriptedProducer, kvpush.Consumer, Any], hold_s: float) -> None:
    prod, consumer, _ = pair
    res, _ = _pull(prod, consumer, hold_s, "late")
    assert res.state is kvpush.RequestState.FAILED and res.blocks_safe
    assert "hold" in str(res.error)


def test_a_claim_keeps_its_xid_into_the_pull_and_abort_gives_it_up(
        pair: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    prod, consumer, dst = pair
    ticket = prod.ticket("c", [1, 2], sid=55, lease_s=1.5)  # lease_margin_s 1: 0.5 s left
    xid = consumer.claim(ticket, sharers=2)
    claim = prod.recv()
    assert isinstance(claim, m.Claim) and (claim.xid, claim.sid, claim.sharers) == (xid, 55, 2)
    with pytest.raises(InvalidRequest, match="claimed"):
        consumer.claim(ticket)
    time.sleep(0.6)  # past the ticket's lease: a claimed source is held past it
    handle = consumer.pull(ticket, np.array([8, 9]), timeout=10, sharers=2)
    assert handle.xid == xid
    begin = prod.recv()
    assert isinstance(begin, m.PullBegin) and begin.xid == xid and begin.sid == 55
    prod.send(m.PullHeld("c", xid, 30.0))
    assert handle.wait(5).state is kvpush.RequestState.READY
    check_blocks(dst, np.array([8, 9]), np.array([1, 2]), 7)
    # A second claim of another use, given up before it is pulled.
    xid2 = consumer.claim(prod.ticket("c2", [3], sid=56))
    assert isinstance(prod.recv(), m.Claim)
    consumer.abort("c2", "engine gave up")
    abort = prod.recv()
    assert isinstance(abort, m.Abort) and (abort.request_id, abort.xid) == ("c2", xid2)
    # A claim the producer refuses is dropped: the pull then starts a use of its own.
    xid3 = consumer.claim(prod.ticket("c3", [4], sid=57))
    assert isinstance(prod.recv(), m.Claim)
    prod.send(m.Failed("c3", xid3, "not_owner", "two consumers"))
    time.sleep(0.2)
    h3 = consumer.pull(prod.ticket("c3", [4], sid=57), np.array([10]), timeout=10)
    assert h3.xid != xid3
    begin3 = prod.recv()
    assert isinstance(begin3, m.PullBegin) and begin3.xid == h3.xid
    prod.send(m.Failed("c3", h3.xid, "not_owner", "two consumers"))
    assert h3.wait(5).state is kvpush.RequestState.FAILED


def test_a_pull_of_another_source_use_gives_the_stale_claim_up(
        pair: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    prod, consumer, _ = pair
    xid = consumer.claim(prod.ticket("d", [1], sid=60))
    assert isinstance(prod.recv(), m.Claim)
    handle = consumer.pull(prod.ticket("d", [1], sid=61), np.array([2]), timeout=10)
    assert handle.xid != xid
    first, second = prod.recv(), prod.recv()
    assert isinstance(first, m.Abort) and first.xid == xid
    assert isinstance(second, m.PullBegin) and second.xid == handle.xid and second.sid == 61


@pytest.fixture
def unconnected() -> Iterator[tuple[ScriptedProducer, kvpush.Consumer, Any]]:
    """A scripted producer and a consumer that has not connected to it."""
    prod = ScriptedProducer()
    dst = make_cache(**CACHE)
    consumer = kvpush.Consumer(dst.layout, kvpush.ConsumerConfig(abort_grace_s=1.0,
                                                                 connect_timeout_s=2.0))
    try:
        yield prod, consumer, dst
    finally:
        consumer.close()
        prod.close()


def test_a_claim_returns_before_its_producer_answers_and_the_pull_continues_it(
        unconnected: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    """claim() returns at once and its handshake runs on the loop; status() reads the
    claim's phase from the core (claiming). A pull made while the handshake runs keeps the
    claim's xid and connects itself: the claim was never sent, so only PullBegin comes."""
    prod, consumer, dst = unconnected
    ticket = prod.ticket("cc", [1, 2], sid=70)
    t0 = time.monotonic()
    xid = consumer.claim(ticket)
    assert time.monotonic() - t0 < 0.5  # no answer has been sent yet
    status = consumer.status("cc")
    assert (status.phase, status.xid, status.sid) == ("claiming", xid, 70)
    assert status.deadline is not None and status.deadline <= time.monotonic() + 2.0
    time.sleep(0.2)  # the handshake is waiting for us
    handle = consumer.pull(ticket, np.array([8, 9]), timeout=10)
    assert handle.xid == xid and not handle.done()
    assert consumer.status("cc").phase == "connecting"
    prod.accept()
    begin = prod.recv()
    assert isinstance(begin, m.PullBegin) and begin.xid == xid
    prod.send(m.PullHeld("cc", xid, 30.0))
    assert handle.wait(5).state is kvpush.RequestState.READY
    check_blocks(dst, np.array([8, 9]), np.array([1, 2]), 7)


def test_a_claim_connected_later_is_sent_and_continued_by_its_pull(
        unconnected: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    prod, consumer, dst = unconnected
    ticket = prod.ticket("cl", [1, 2], sid=76)
    xid = consumer.claim(ticket)
    prod.accept()
    claim = prod.recv()
    assert isinstance(claim, m.Claim) and (claim.xid, claim.sid) == (xid, 76)
    assert consumer.status("cl").phase == "claimed"
    handle = consumer.pull(ticket, np.array([8, 9]), timeout=10)
    assert handle.xid == xid
    begin = prod.recv()
    assert isinstance(begin, m.PullBegin) and begin.xid == xid
    prod.send(m.PullHeld("cl", xid, 30.0))
    assert handle.wait(5).state is kvpush.RequestState.READY
    check_blocks(dst, np.array([8, 9]), np.array([1, 2]), 7)


def test_a_claim_aborted_during_its_handshake_sends_nothing(
        unconnected: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    prod, consumer, _ = unconnected
    consumer.claim(prod.ticket("ca", [1], sid=71))
    consumer.abort("ca", "engine gave up")
    assert consumer.status("ca").phase == "none"
    prod.accept()
    xid = consumer.claim(prod.ticket("cb", [2], sid=72))  # connected now: sent at once
    claim = prod.recv()  # the first Claim to come is the second claim's
    assert isinstance(claim, m.Claim) and (claim.request_id, claim.xid) == ("cb", xid)


def test_a_claim_whose_handshake_fails_is_given_up_and_the_pull_fails_with_it(
        unconnected: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    """No answer within connect_timeout_s (2 s): the claim goes (status none), and a pull
    of the same tickets connects itself and ends with the handshake's error."""
    prod, consumer, _ = unconnected
    ticket = prod.ticket("cf", [1], sid=73)
    consumer.claim(ticket)
    deadline = time.monotonic() + 6
    while consumer.status("cf").phase != "none":
        assert time.monotonic() < deadline, consumer.status("cf")
        time.sleep(0.05)
    handle = consumer.pull(ticket, np.array([3]), timeout=1.0)
    res = handle.wait(5)
    assert res.state in (kvpush.RequestState.FAILED, kvpush.RequestState.TIMED_OUT)
    assert res.blocks_safe


def _gone(consumer: kvpush.Consumer, rid: str) -> None:
    deadline = time.monotonic() + 5
    while consumer.status(rid).phase != "none":
        assert time.monotonic() < deadline, consumer.status(rid)
        time.sleep(0.02)


def test_a_claim_whose_handshake_reaches_another_producer_is_forgotten(
        unconnected: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    """The ticket names a producer the address does not reach: the core gives the claim up
    and tells the facade, so the id can be claimed again (not 'already claimed')."""
    prod, consumer, _ = unconnected
    wrong = msgspec.structs.replace(prod.ticket("cw", [1], sid=77), producer="elsewhere")
    xid = consumer.claim(wrong)
    prod.accept()
    _gone(consumer, "cw")
    xid2 = consumer.claim(prod.ticket("cw", [1], sid=77))
    claim = prod.recv()
    assert isinstance(claim, m.Claim) and claim.xid == xid2 != xid


@pytest.mark.parametrize("how", ["failed", "abort", "lost"])
def test_a_claim_its_producer_gives_up_or_loses_is_forgotten(
        how: str, pair: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    """The producer's Failed or Abort of the claim, or its loss (Bye), ends the claim in
    the core, which tells the facade: a later pull of the tickets starts a use of its own
    (a new xid) and the id can be claimed again."""
    prod, consumer, _ = pair
    ticket = prod.ticket("cg", [1], sid=78)
    xid = consumer.claim(ticket)
    assert isinstance(prod.recv(), m.Claim)
    prod.send(m.Failed("cg", xid, "not_owner", "taken") if how == "failed" else
              m.Abort("cg", xid, "gave up") if how == "abort" else m.Bye(prod.name))
    _gone(consumer, "cg")
    handle = consumer.pull(ticket, np.array([2]), timeout=10)
    assert handle.xid != xid
    consumer.abort("cg")
    assert handle.wait(5).state is kvpush.RequestState.ABORTED
    assert consumer.claim(ticket) not in (xid, handle.xid)


def test_a_claim_whose_lease_runs_out_in_its_handshake_is_forgotten(
        unconnected: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    prod, consumer, _ = unconnected
    ticket = prod.ticket("cx", [1], sid=79, lease_s=1.3)  # lease_margin_s 1: 0.3 s left
    xid = consumer.claim(ticket)
    assert consumer.status("cx").phase == "claiming"
    _gone(consumer, "cx")
    handle = consumer.pull(ticket, np.array([2]), timeout=10)
    assert handle.xid != xid
    assert handle.wait(5).state is kvpush.RequestState.TIMED_OUT


def test_a_claim_on_a_closed_consumer_keeps_no_record(
        pair: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    """claim() recorded the claim before queueing it: on a closed Consumer the queueing
    raised ClosedError and the record stayed, so the next claim of the same tickets said
    'already claimed' (InvalidRequest) instead of 'closed'."""
    prod, consumer, _ = pair
    ticket = prod.ticket("gone", [1], sid=75)
    consumer.close()
    for _ in range(2):
        with pytest.raises(kvpush.ClosedError):
            consumer.claim(ticket)


def test_a_claim_ended_by_close_is_forgotten(
        pair: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    """Close gives every claim up in the core, which tells the facade: claiming the same
    tickets again says 'closed', not 'already claimed' (the facade's record outlived the
    core's)."""
    prod, consumer, _ = pair
    ticket = prod.ticket("cz", [1], sid=80)
    consumer.claim(ticket)
    assert isinstance(prod.recv(), m.Claim)
    consumer.close()
    with pytest.raises(kvpush.ClosedError):
        consumer.claim(ticket)


def test_a_claim_from_a_callback_returns_at_once(
        pair: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    prod, consumer, _ = pair
    other = ScriptedProducer(name="other")
    box: list[Any] = []
    try:
        handle = consumer.expect("cb", np.array([1]), prod.name, timeout=10)
        handle.add_done_callback(
            lambda _h: box.append(consumer.claim(other.ticket("late", [2], sid=74))))
        reg = prod.recv()
        assert isinstance(reg, m.Register)
        consumer.abort("cb")
        assert isinstance(prod.recv(), m.Abort)
        prod.send(m.AbortAck("cb", reg.xid))
        assert handle.wait(5).state is kvpush.RequestState.ABORTED
        deadline = time.monotonic() + 5
        while not box:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert isinstance(box[0], int), box  # an xid, not a RuntimeError
        other.accept()
        claim = other.recv()
        assert isinstance(claim, m.Claim) and claim.xid == box[0]
    finally:
        consumer.close()
        other.close()


def test_close_marks_push_parts_not_announced_unsafe(
        pair: tuple[ScriptedProducer, kvpush.Consumer, Any]) -> None:
    """The producer may have posted the WRITE while its Posted hint is still on the way."""
    prod, consumer, _ = pair
    handle = consumer.expect("u", np.array([1]), prod.name, timeout=10)
    assert isinstance(prod.recv(), m.Register)
    consumer.close()
    res = handle.wait(5)
    assert res.state is kvpush.RequestState.ABORTED and not res.blocks_safe


def test_hello_retransmits_are_identical_and_a_slow_answer_still_authenticates() -> None:
    """A producer slow to answer gets several Hellos; they must be one Hello re-sent (same
    nonce, same time, same bytes), so the one session key it derives is the one this side
    uses for every later frame."""
    prod = ScriptedProducer(auth_key=KEY)
    dst = make_cache(**CACHE)
    consumer = kvpush.Consumer(dst.layout, kvpush.ConsumerConfig(auth_key=KEY))
    try:
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(consumer.connect(prod.address, 10)))
        t.start()
        got = [prod.recv_frame() for _ in range(3)]  # sent at 0, 50, 150 ms
        assert len({frame for _, frame in got}) == 1, "Probe retransmits differ"
        prod.identity = got[0][0]
        prod.challenge(got[0][1])
        frames = [prod.next_hello() for _ in range(3)]  # sent at 0, 50, 150 ms
        assert len(set(frames)) == 1, "Hello retransmits differ"
        ack = prod.accept(frames[-1])
        t.join(10)
        assert box == [prod.name]
        for _ in range(3):  # the same answer to each duplicate: ignored, not an attack
            prod.sock.send_multipart([prod.identity, ack])
        h = consumer.expect("a", np.array([1]), prod.name, timeout=10)
        reg = prod.recv()  # authenticated with the session key
        assert isinstance(reg, m.Register) and reg.xid == h.xid
        prod.send(m.Failed("a", reg.xid, "aborted", "test"))
        assert h.wait(5).state is kvpush.RequestState.ABORTED
        assert consumer.stats()["auth_rejected"] == 0
    finally:
        consumer.close()
        prod.close()


def test_a_landed_overtaken_by_thousands_of_notifications_still_counts() -> None:
    """The notification of a large WRITE, overtaken by more than the 4096-counter replay
    window of later notifications, is not refused as a replay (the request would time out):
    a Landed counts once per (xid, part)."""
    prod = ScriptedProducer(auth_key=KEY)
    dst = make_cache(**CACHE)
    consumer = kvpush.Consumer(dst.layout, kvpush.ConsumerConfig(auth_key=KEY))
    try:
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(consumer.connect(prod.address, 10)))
        t.start()
        prod.identity, frame = prod.recv_frame()
        prod.accept(frame)
        t.join(10)
        assert box == [prod.name]
        h = consumer.expect("big", np.array([1]), prod.name, timeout=20)
        reg = prod.recv()
        assert isinstance(reg, m.Register)
        assert prod.sealer is not None and prod.opener is not None
        notif = Sealer(prod.session, b"p2c-notif")
        late = m.encode(m.Landed("big", reg.xid, 0), notif)
        overtaking = [m.encode(m.Landed(f"other{i}", 1, 0), notif) for i in range(4200)]
        prod.send(m.Posted("big", reg.xid, 0))  # the consumer polls notifications now
        time.sleep(0.1)
        with prod._lock:
            for note in overtaking:
                prod.agent.send_notification(prod.consumer_agent, note)
        _wait_stat(consumer, "stale_messages", 4200)
        with prod._lock:
            prod.agent.send_notification(prod.consumer_agent, late)
        assert h.wait(10).state is kvpush.RequestState.READY
        assert consumer.stats()["auth_rejected"] == 0
    finally:
        consumer.close()
        prod.close()
