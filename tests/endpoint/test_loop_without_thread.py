"""The production driver, sessions and cores run without a thread, on a test's clock and over
an in-memory network (kvpush.driver.LoopIO, kvpush.testing.wire), with real NIXL agents:
what the simulator needs to run the real loop. Each test steps both ends itself, so a
dropped Hello, a stalled producer or a clock jump happens exactly where the test puts it."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from kvpush import ConsumerConfig, ProducerConfig, TransferMode
from kvpush import messages as m
from kvpush.agent import TransportConfig
from kvpush.dataplane import make_agent
from kvpush.driver import Driver, LoopIO
from kvpush.errors import KvpushError, PeerUnavailable
from kvpush.progress import ProgressPolicy
from kvpush.protocol.consumer import ConsumerCore, new_xid
from kvpush.protocol.producer import ProducerCore
from kvpush.request import RequestState, TransferResult
from kvpush.sessions import Accepting, Dialing
from kvpush.testing.wire import Context, Network, Socket
from tests.support.harness import check_blocks, fill, make_cache

KEY = b"w" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Lossy(Network):
    """Drops the messages ``drop`` picks (by their order on the network, from 0)."""

    def __init__(self, drop: Callable[[int, Socket, list[bytes]], bool]) -> None:
        super().__init__()
        self.drop = drop
        self.sent = itertools.count()

    def carry(self, src: Socket, dst: Socket, frames: list[bytes],
              arrive: Callable[[], None]) -> None:
        if not self.drop(next(self.sent), src, frames):
            arrive()


class Side:
    """One endpoint's driver, core and sessions, stepped by the test."""

    def __init__(self, role: str, net: Network, clock: Clock, seed: int,
                 key: bytes | None) -> None:
        self.cache = make_cache(num_blocks=16)
        self.delivered: list[Any] = []
        rng = random.Random(seed)
        io = LoopIO(clock=clock, wall=lambda: clock.now + 5e8,
                    nonce=lambda: rng.randbytes(16), context=Context(net),
                    agent=lambda name, layout: make_agent(name, layout, TransportConfig()))
        self.driver = Driver(self.cache.layout, role=role, name=f"{role}-{seed}",
                             transport=TransportConfig(), progress=ProgressPolicy(),
                             auth_key=key, io=io)
        d = self.driver
        self.core: Any
        self.sessions: Any
        if role == "producer":
            self.config: Any = ProducerConfig(auth_key=key)
            self.core = ProducerCore(self.cache.layout, self.config, d.links, d.stats)
            self.sessions = Accepting(d, self.core, host="127.0.0.1", port=0,
                                      advertise=None, peer_timeout_s=self.config.peer_timeout_s)
        else:
            self.config = ConsumerConfig(auth_key=key)
            self.core = ConsumerCore(self.cache.layout, self.config, d.links, d.stats)
            self.sessions = Dialing(d, self.core, peer_timeout_s=self.config.peer_timeout_s,
                                    heartbeat_s=self.config.heartbeat_s,
                                    connect_timeout_s=self.config.connect_timeout_s)
        d.start(self.core, self.sessions, self.delivered.append, lambda: None)


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Any:
    made: list[Side] = []

    def make(net: Network | None = None, key: bytes | None = KEY) -> tuple[Side, Side, Clock]:
        net = net or Network()
        clock = Clock()
        p = Side("producer", net, clock, 1, key)
        c = Side("consumer", net, clock, 2, key)
        made.extend([p, c])
        return p, c, clock

    yield make
    for side in made:
        side.driver.close()


def run(sides: tuple[Side, ...], clock: Clock, until: Callable[[], bool],
        seconds: float = 10.0, jump: bool = True) -> None:
    """Step ``sides`` until ``until()``; with ``jump``, an idle moment moves the clock to
    the next timer. Bounded by real time (NIXL's copies run on their own)."""
    give_up = time.monotonic() + seconds
    while not until():
        assert time.monotonic() < give_up, "the pair did not get there"
        for side in sides:
            side.driver.step()
        if until():
            return
        busy = any(s.driver.busy() for s in sides)
        wakes = [w for w in (s.driver.next_wake() for s in sides) if w is not None]
        if jump and not busy and wakes and min(wakes) > clock.now:
            clock.now = min(wakes)


def connect(p: Side, c: Side, clock: Clock) -> list[Any]:
    got: list[Any] = []
    c.driver.call_soon(lambda: c.sessions.connect(
        p.sessions.address, 5.0, lambda name, error: got.append((name, error))))
    run((p, c), clock, lambda: bool(got))
    return got


def test_push_and_pull_over_the_real_loop_without_threads(pair: Any) -> None:
    p, c, clock = pair()
    assert connect(p, c, clock) == [(p.driver.name, None)]
    fill(p.cache, 7)
    src, dst = np.array([3, 4]), np.array([9, 10])

    # push: the consumer registers, the prefill ends, the producer WRITEs
    xid = new_xid()
    c.driver.submit(lambda now: c.core.expect(now, "push-1", dst, [p.driver.name], 5.0,
                                              xid=xid))
    p.driver.submit(lambda now: p.core.prefill_done(now, "push-1", src, TransferMode.PUSH,
                                                    0, now))
    run((p, c), clock, lambda: bool(c.delivered) and bool(p.delivered))
    result = c.delivered.pop()
    assert isinstance(result, TransferResult) and result.state is RequestState.READY, result
    assert result.xid == xid
    check_blocks(c.cache, dst, src, 7)
    assert p.delivered.pop().request_id == "push-1"

    # pull: the producer's ticket, the consumer READs
    sid = 77
    ticket = m.PullTicket(producer=p.driver.name, address=p.sessions.address,
                          request_id="pull-1", block_ids=m.encode_ids(src),
                          lease_s=p.config.lease_s, issued_at=clock.now + 5e8, sid=sid)
    p.driver.submit(lambda now: p.core.prefill_done(now, "pull-1", src, TransferMode.PULL,
                                                    sid, now))
    dst2 = np.array([12, 13])
    c.driver.submit(lambda now: c.core.pull(now, [ticket], [src], dst2, 5.0))
    run((p, c), clock, lambda: bool(c.delivered) and bool(p.delivered))
    result = c.delivered.pop()
    assert result.state is RequestState.READY, result
    check_blocks(c.cache, dst2, src, 7)


def test_a_dropped_hello_is_sent_again_on_the_loops_clock(pair: Any) -> None:
    """The first frame the consumer sends after the Challenge (its Hello) is lost; the
    session's retransmit timer, on the test's clock, sends it again."""
    hellos: list[int] = []

    def drop(n: int, src: Socket, frames: list[bytes]) -> bool:
        if src.kind == zmq.DEALER:
            hellos.append(n)
            return len(hellos) == 2   # (the first is the Probe)
        return False

    p, c, clock = pair(Lossy(drop))
    start = clock.now
    assert connect(p, c, clock) == [(p.driver.name, None)]
    assert len(hellos) >= 3 and clock.now > start   # sent again, after the clock moved


def test_a_silent_producer_is_lost_when_the_clock_passes_peer_timeout(pair: Any) -> None:
    """The producer is never stepped again (a stalled process): the consumer's heartbeats
    go unanswered, and once its clock passes ``peer_timeout_s`` the expect in flight fails
    with PeerUnavailable; nothing real waits those seconds."""
    p, c, clock = pair()
    assert connect(p, c, clock)[0][1] is None
    c.driver.submit(lambda now: c.core.expect(now, "r", np.array([1]), [p.driver.name],
                                              600.0))
    run((c,), clock, lambda: bool(c.delivered), seconds=10.0)
    result = c.delivered.pop()
    assert result.state is RequestState.FAILED
    assert isinstance(result.error, PeerUnavailable), result.error
    assert clock.now - 1000.0 >= c.config.peer_timeout_s
    assert not c.sessions.up(p.driver.name)


def test_a_handshake_with_the_wrong_key_fails_without_threads(pair: Any) -> None:
    net = Network()
    p, _, clock = pair(net)
    wrong = Side("consumer", net, clock, 3, b"x" * 32)
    try:
        got = connect(p, wrong, clock)
    finally:
        wrong.driver.close()
    name, error = got[0]
    assert name is None and isinstance(error, KvpushError), got


def test_a_connect_to_an_address_already_dialled_ends_at_its_own_timeout(pair: Any) -> None:
    """A second connect() to an address whose handshake is under way (its first caller
    gave it 100 s) is answered at its own 1 s, with PeerUnavailable; the first caller
    keeps waiting. (A pull's Dial is such a caller: it waited past its request's time.)"""
    _, c, clock = pair()
    start = clock.now
    first: list[Any] = []
    second: list[Any] = []
    address = "tcp://nobody-listens:9"
    c.driver.call_soon(lambda: c.sessions.connect(address, 100.0,
                                                  lambda *got: first.append(got)))
    c.driver.call_soon(lambda: c.sessions.connect(address, 1.0,
                                                  lambda *got: second.append(got)))
    run((c,), clock, lambda: bool(second))
    ((name, error),) = second
    assert name is None and isinstance(error, PeerUnavailable), second
    assert clock.now - start == pytest.approx(1.0, abs=0.01)
    assert first == []
    run((c,), clock, lambda: bool(first), seconds=10.0)
    assert clock.now - start >= 100.0 and first[0][0] is None


def test_the_wire_refuses_a_send_past_the_high_water_mark() -> None:
    """What the simulator's sockets keep of ZeroMQ's high-water mark: a DEALER's send
    raises Again once the ROUTER holds that many of its frames unread, a ROUTER's with
    ROUTER_MANDATORY once the DEALER does (without it the frame is dropped); reading makes
    room, and would_take says so beforehand."""
    net = Network()
    net.hwm = 2
    ctx = Context(net)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind("tcp://127.0.0.1:5000")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"d")
    dealer.connect("tcp://127.0.0.1:5000")
    dealer.send(b"1", zmq.NOBLOCK)
    dealer.send(b"2", zmq.NOBLOCK)
    assert not dealer.would_take()
    with pytest.raises(zmq.Again):
        dealer.send(b"3", zmq.NOBLOCK)
    assert router.recv_multipart() == [b"d", b"1"]
    assert dealer.would_take()
    dealer.send(b"3", zmq.NOBLOCK)
    router.send_multipart([b"d", b"a"], zmq.NOBLOCK)
    router.send_multipart([b"d", b"b"], zmq.NOBLOCK)
    assert not router.would_take(b"d") and not router.would_take(b"nobody")
    with pytest.raises(zmq.Again):
        router.send_multipart([b"d", b"c"], zmq.NOBLOCK)
    router.setsockopt(zmq.ROUTER_MANDATORY, 0)
    router.send_multipart([b"d", b"c"], zmq.NOBLOCK)   # dropped, as ZeroMQ does
    assert [dealer.recv_multipart() for _ in range(2)] == [[b"a"], [b"b"]]
    with pytest.raises(zmq.Again):
        dealer.recv_multipart(zmq.NOBLOCK)
    assert [router.recv_multipart() for _ in range(2)] == [[b"d", b"2"], [b"d", b"3"]]
