"""kvpush.testing.proxy on raw control sockets (kvpush.stream's, as the endpoints'): frames
recognised sealed or not, seeded rules that choose the same frames every run, delays and stalls that keep a connection's order,
cuts that reset it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from kvpush import messages as m
from kvpush import stream
from kvpush.auth import Sealer
from kvpush.testing import Action, ControlProxy, Direction, FrameRule, frame_info


class Ends:
    """A ROUTER standing for the producer, a DEALER for a consumer, and a proxy between."""

    def __init__(self, rules: tuple[FrameRule, ...] = ()) -> None:
        self.ctx = stream.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.proxy = ControlProxy(f"tcp://127.0.0.1:{port}", rules=rules)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(self.proxy.address)

    def send(self, seqs: range) -> None:
        for seq in seqs:
            self.dealer.send(m.encode(m.Heartbeat(seq)))

    def received(self, timeout: float = 1.0, until: int | None = None,
                 within: float = 10.0) -> list[int]:
        """Heartbeat seqs the producer side gets until ``timeout`` passes without one; with
        ``until``, a silence does not end the wait before that seq came (at most ``within``
        seconds): a reconnection takes what the machine's load gives it."""
        seqs: list[int] = []
        give_up = time.monotonic() + within
        while True:
            if not self.router.poll(int(timeout * 1000)):
                if until is None or until in seqs or time.monotonic() >= give_up:
                    return seqs
                continue
            _, frame = self.router.recv_multipart()
            msg = m.decode(frame)
            assert isinstance(msg, m.Heartbeat)
            seqs.append(msg.seq)

    def close(self) -> None:
        self.proxy.close()
        self.dealer.close(0)
        self.router.close(0)
        self.ctx.term()


@pytest.fixture
def ends() -> Iterator[Ends]:
    e = Ends()
    yield e
    e.close()


def test_frames_are_recognised_whether_or_not_they_are_sealed() -> None:
    msg = m.Register("r1", 7, b"", 0, 1.0)
    assert frame_info(m.encode(msg)) == ("register", "r1")
    assert frame_info(m.encode(msg, Sealer(b"k" * 32, b"c2p"))) == ("register", "r1")
    assert frame_info(m.encode(m.Heartbeat(3))) == ("hb", None)
    assert frame_info(b"\x00garbage") == ("?", None)


def test_rules_are_refused_when_they_cannot_mean_anything() -> None:
    with pytest.raises(ValueError, match="probability"):
        FrameRule(Action.DROP, probability=1.5)
    with pytest.raises(ValueError, match="delay_s"):
        FrameRule(Action.DELAY)
    with pytest.raises(TypeError, match="set of message tags"):
        FrameRule(Action.DROP, "register")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FAIL"):
        FrameRule(Action.FAIL, frozenset({"posted"}))


def test_a_seeded_rule_picks_the_same_frames_every_run() -> None:
    runs = []
    for _ in range(2):
        e = Ends((FrameRule(Action.DROP, frozenset({"hb"}), Direction.TO_PRODUCER,
                            probability=0.5, seed=11),))
        try:
            e.send(range(40))
            runs.append(e.received(0.5))
        finally:
            e.close()
    assert runs[0] == runs[1]
    assert 5 < len(runs[0]) < 35 and runs[0] == sorted(runs[0])


def test_skip_and_limit_bound_what_a_rule_picks(ends: Ends) -> None:
    ends.proxy.add_rule(FrameRule(Action.DROP, frozenset({"hb"}), skip=2, limit=3))
    ends.send(range(8))
    assert ends.received(0.5) == [0, 1, 5, 6, 7]
    assert ends.proxy.counts[Direction.TO_PRODUCER, "hb", "drop"] == 3


def test_a_delay_holds_back_the_frames_behind_it(ends: Ends) -> None:
    ends.proxy.add_rule(FrameRule(Action.DELAY, frozenset({"hb"}), limit=1, delay_s=0.3))
    t0 = time.monotonic()
    ends.send(range(5))
    assert ends.router.poll(2000)
    assert time.monotonic() - t0 >= 0.25
    assert ends.received(0.5) == [0, 1, 2, 3, 4]


def test_a_hold_keeps_everything_until_release_in_order(ends: Ends) -> None:
    ends.send(range(1))
    assert ends.received(0.5) == [0]
    ends.proxy.hold()
    ends.send(range(1, 4))
    assert ends.received(0.3) == []
    ends.proxy.release()
    assert ends.received(0.5) == [1, 2, 3]


def test_a_cut_loses_frames_and_reopen_lets_the_consumer_back(ends: Ends) -> None:
    """The consumer, connected through the proxy, reconnects by itself once the proxy
    listens again. ZeroMQ's I/O thread learns of the cut after ``cut()`` returns, so frames
    sent just after it (even after ``reopen()``) may go into the dead connection and be
    lost; the consumer therefore sends until one comes through (sending two frames after
    the reopen and waiting for them lost both in about one run of six)."""
    ends.send(range(1))
    assert ends.received(0.5) == [0]       # connected through the proxy
    ends.proxy.cut()
    assert ends.proxy.is_cut
    ends.send(range(1, 3))                 # lost, or queued in the consumer's socket
    ends.proxy.reopen()
    got: list[int] = []
    deadline = time.monotonic() + 10.0
    seq = 3
    while not got and time.monotonic() < deadline:
        ends.send(range(seq, seq + 1))
        seq += 1
        got = ends.received(0.05)
    assert got, "the consumer did not get back through the reopened proxy in 10 s"
    assert got == sorted(got) and got[-1] >= 3, got
