"""The peer-session machines (kvpush.protocol.session) on their own: a Dialer and an
Acceptor handed each other's frames, with and without a key."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvpush import messages as m
from kvpush.errors import AuthenticationError, ProtocolError
from kvpush.protocol import session as s
from kvpush.protocol.table import mermaid
from kvpush.testing.fakes import FakeMemory

KEY = b"k" * 32


def _nonces(seed: int):  # type: ignore[no-untyped-def]
    counter = itertools.count(seed * 1000)
    return lambda: next(counter).to_bytes(16, "big")


def _pair(key: bytes | None, producer: str = "p0") -> tuple[s.Dialers, s.Acceptor]:
    layout = FakeMemory(2, 16).layout
    acc = s.Acceptor(s.AcceptConfig(producer, layout, key, 1.0, f"tcp://{producer}:1",
                                    "tcp://0.0.0.0:1", lambda: 1000.0, _nonces(1)),
                     lambda: b"pmeta")
    dials = s.Dialers(s.DialConfig("c0", layout, key, 1.0, 0.05, 0.5, lambda: 1000.0,
                                   _nonces(2)))
    return dials, acc


def _frames(effects: list[s.SessionEffect]) -> list[s.Transmit]:
    return [e for e in effects if isinstance(e, s.Transmit)]


def _connect(dials: s.Dialers, acc: s.Acceptor, address: str = "tcp://p0:1"
             ) -> tuple[s.Dialer, list[s.SessionEffect]]:
    """Run the handshake to the end; returns the dialer and every consumer effect."""
    d, out = dials.dial(0.0, address, b"cmeta", 10.0)
    seen = list(out)
    for _ in range(4):
        answers: list[s.SessionEffect] = []
        for tx in _frames(out):
            got, msg = acc.receive(0.0, b"id-c0", tx.frame)
            assert msg is None
            for e in got:
                if isinstance(e, s.Admit):
                    answers += acc.admitted(0.0, e.peer, e.name)  # type: ignore[arg-type]
                else:
                    answers.append(e)
        out = []
        for tx in _frames(answers):
            got, msg = dials.receive(0.0, d, tx.frame)
            for e in got:
                if isinstance(e, s.Admit):
                    got2 = dials.admitted(0.0, d)
                    out += got2
                    seen += got2
            out += got
            seen += got
        if d.up:
            break
    return d, seen


@pytest.mark.parametrize("key", [None, KEY])
def test_handshake_brings_both_sides_up(key: bytes | None) -> None:
    dials, acc = _pair(key)
    d, seen = _connect(dials, acc)
    assert d.up and d.name == "p0"
    assert any(isinstance(e, s.PeerUp) and e.name == "p0" for e in seen)
    assert acc.connected("c0") is not None
    # a core's frame, sealed under the session, reaches the other side's core
    tx = acc.seal("c0", m.Bye("p0", rejoin=False))
    assert tx is not None


def test_a_frame_delivered_twice_is_refused_as_replayed_not_as_a_handshake_answer() -> None:
    """A sealed core frame that reaches the consumer twice is refused for what it is (a
    replay), not reported as a handshake answer that does not match its Hello."""
    dials, acc = _pair(KEY)
    d, _ = _connect(dials, acc)
    tx = acc.seal("c0", m.Posted("r", 7, 0))
    assert tx is not None
    _, msg = dials.receive(0.0, d, tx.frame)
    assert msg == m.Posted("r", 7, 0)
    with pytest.raises(AuthenticationError, match="replayed"):
        dials.receive(0.0, d, tx.frame)


def test_a_retransmitted_hello_crossing_a_producer_restart_starts_a_new_attempt() -> None:
    """A Hello and its retransmit reach a producer that restarted since it issued the
    challenge: the first is refused ("challenge"), and the second -- its nonce seen now --
    is refused the same way, sealed and echoing the nonce, so the consumer probes again
    instead of failing its connect() on an unsealed "replayed Hello"."""
    dials, old = _pair(KEY)
    d, out = dials.dial(0.0, "tcp://p0:1", b"cmeta", 10.0)
    (probe,) = _frames(out)
    got, _ = old.receive(0.0, b"id", probe.frame)
    (challenge,) = _frames(got)
    got, _ = dials.receive(0.0, d, challenge.frame)
    (hello,) = _frames(got)
    _, new = _pair(KEY)                       # the producer restarted
    answers = []
    for _ in range(2):                        # the Hello and its retransmit
        got, _ = new.receive(0.01, b"id", hello.frame)
        answers += _frames(got)
    assert len(answers) == 2
    for tx in answers:
        assert isinstance(tx.msg, m.HelloReject) and tx.msg.field == "challenge"
        assert m.is_sealed(tx.frame)
    for tx in answers:
        got, _ = dials.receive(0.01, d, tx.frame) if d.nonce else ([], None)
        assert not any(isinstance(e, s.ConnectFailed) for e in got)
    assert d.state is s.DialState.PROBING


def test_without_a_key_a_hello_made_for_the_previous_instance_is_refused() -> None:
    """No key: a Hello answering the challenge of a producer's previous instance (held in
    a socket while it restarted) is refused ("challenge"), and the consumer probes again:
    its session then names the instance it reaches (a second spelling of the address is
    joined to it rather than taken for another producer, which said Hello as well and
    ended the first session)."""
    dials, old = _pair(None)
    d, out = dials.dial(0.0, "tcp://p0:1", b"cmeta", 10.0)
    got, _ = old.receive(0.0, b"id", _frames(out)[0].frame)
    got, _ = dials.receive(0.0, d, _frames(got)[0].frame)
    (hello,) = _frames(got)
    assert isinstance(hello.msg, m.Hello)
    _, new = _pair(None)                      # the producer restarted
    got, _ = new.receive(0.01, b"id", hello.frame)
    assert not any(isinstance(e, (s.Admit, s.PeerUp)) for e in got)
    (refusal,) = _frames(got)
    assert isinstance(refusal.msg, m.HelloReject) and refusal.msg.field == "challenge"
    got, _ = dials.receive(0.01, d, refusal.frame)
    assert not any(isinstance(e, s.ConnectFailed) for e in got)
    assert d.state is s.DialState.PROBING


def test_a_hello_replayed_to_another_producer_is_refused() -> None:
    """Two producers share the key and the port; a consumer dialled one by a host name.
    Its Hello, captured and replayed to the other, answers no challenge of that one."""
    dials, p0 = _pair(KEY, "p0")
    _, p1 = _pair(KEY, "p1")
    d, out = dials.dial(0.0, "tcp://shared-name:1", b"cmeta", 10.0)
    got, _ = p0.receive(0.0, b"id", _frames(out)[0].frame)
    got, _ = dials.receive(0.0, d, _frames(got)[0].frame)
    (hello,) = _frames(got)
    got, _ = p1.receive(0.0, b"attacker", hello.frame)
    assert not any(isinstance(e, (s.Admit, s.PeerDown)) for e in got)
    (tx,) = _frames(got)
    assert isinstance(tx.msg, m.HelloReject) and tx.best_effort


def test_the_first_heartbeat_goes_as_the_session_comes_up() -> None:
    """The producer counts a new session's silence from its HelloAck, which a congested
    link can hold for most of the peer timeout: the consumer asks its first question the
    moment the answer arrives, not a heartbeat period later."""
    dials, acc = _pair(None)
    d, seen = _connect(dials, acc)
    up = next(i for i, e in enumerate(seen) if isinstance(e, s.PeerUp))
    beats = [tx for tx in _frames(seen[up:]) if isinstance(tx.msg, m.Heartbeat)]
    assert len(beats) == 1 and d.unanswered == (beats[0].msg.seq, 0.0)  # type: ignore[union-attr]
    got, msg = acc.receive(0.0, b"id-c0", beats[0].frame)
    assert msg is not None and isinstance(msg[1], m.Heartbeat)
    (ack,) = _frames(got)
    assert isinstance(ack.msg, m.HeartbeatAck)
    dials.receive(0.0, d, ack.frame)
    assert d.unanswered is None


def test_heartbeats_unanswered_lose_the_producer() -> None:
    dials, acc = _pair(None)
    d, seen = _connect(dials, acc)                # first asked on coming up, at 0.0
    assert any(isinstance(tx.msg, m.Heartbeat) for tx in _frames(seen))
    assert _frames(dials.heartbeat(0.5))          # not answered yet, asked again
    assert _frames(dials.heartbeat(1.0))          # 1.0 s: not past the timeout yet
    out = dials.heartbeat(1.1)                    # 1.1 s after the first question
    (down,) = [e for e in out if isinstance(e, s.PeerDown)]
    assert not d.up and "tcp://p0:1" not in dials.by_address
    # what the silence was: the questions left unanswered, and nothing heard at all
    assert "(3 heartbeats unanswered; last frame from it 1.10 s ago)" in down.why


def test_a_loss_says_when_the_producer_was_last_heard() -> None:
    """Heartbeats unanswered while other frames from the producer still come (its answers
    alone lost or held) read otherwise in the loss than a producer gone silent."""
    dials, acc = _pair(None)
    d, _ = _connect(dials, acc)
    dials.heartbeat(0.5)
    dials.receive(0.9, d, m.encode(m.Posted("r", 1, 0)))   # a frame, not an answer
    (down,) = [e for e in dials.heartbeat(1.1) if isinstance(e, s.PeerDown)]
    assert down.why.endswith("(2 heartbeats unanswered; last frame from it 0.20 s ago)")


def _judged_pair() -> tuple[s.Acceptor, s.Dialer]:
    """A session whose consumer said how it judges silence: a Heartbeat every 0.25 s, the
    producer given up after 1.0 s unanswered."""
    layout = FakeMemory(2, 16).layout
    acc = s.Acceptor(s.AcceptConfig("p0", layout, None, 1.0, "tcp://p0:1",
                                    "tcp://0.0.0.0:1", lambda: 1000.0, _nonces(1)),
                     lambda: b"pmeta")
    dials = s.Dialers(s.DialConfig("c0", layout, None, 1.0, 0.05, 0.5, lambda: 1000.0,
                                   _nonces(2), heartbeat_s=0.25))
    d, _ = _connect(dials, acc)
    return acc, d


def _register(sent: float) -> bytes:
    return m.encode(m.Register("r", 11, m.encode_ids(np.array([1])), 0, 30.0, sent=sent))


def _dropped(effects: list[s.SessionEffect]) -> str:
    downs = [e for e in effects if isinstance(e, s.PeerDown)]
    byes = [tx.msg for tx in _frames(effects) if isinstance(tx.msg, m.Bye)]
    assert len(downs) == len(byes) <= 1 and all(b.rejoin for b in byes)  # type: ignore[union-attr]
    return downs[0].why if downs else ""


@pytest.mark.parametrize("clock", [0.0, 5000.0, -70.0])
def test_a_register_read_later_than_the_consumer_waits_drops_its_session(clock: float) -> None:
    """The producer's loop froze past the consumer's peer timeout: the consumer has given
    it up and failed its requests (blocks_safe=False), and may reuse their blocks. The
    Register waiting in the socket is not served (its WRITE could land in them); the
    session goes and the consumer is told to connect again. The consumer's clock is its
    own: only the frames' delays count."""
    acc, _ = _judged_pair()
    acc.receive(10.001, b"id-c0", m.encode(m.Heartbeat(5, clock + 10.0)))
    got, msg = acc.receive(10.2, b"id-c0", _register(clock + 10.19))    # in time
    assert msg is not None and not _dropped(got)
    got, msg = acc.receive(12.0, b"id-c0", _register(clock + 10.3))     # 1.7 s late
    assert msg is None
    assert "read its Register 1.70 s late" in _dropped(got)
    assert acc.connected("c0") is None


def test_a_heartbeat_read_late_drops_its_session() -> None:
    """Late by more than the timeout less one heartbeat period (kept for the answer's way
    back): 0.75 s here."""
    acc, _ = _judged_pair()
    acc.receive(10.001, b"id-c0", m.encode(m.Heartbeat(5, 10.0)))
    got, msg = acc.receive(10.8, b"id-c0", m.encode(m.Heartbeat(6, 10.1)))  # 0.70 s: kept
    assert msg is not None and not _dropped(got)
    got, msg = acc.receive(11.2, b"id-c0", m.encode(m.Heartbeat(7, 10.35)))  # 0.85 s
    assert msg is None and "read its Heartbeat 0.85 s late" in _dropped(got)


def test_a_consumer_that_stalled_itself_is_kept() -> None:
    """The consumer's own loop stalled 3 s (no Heartbeats sent): its next one, read at
    once, is on time, and it judges no producer across its own stall."""
    acc, _ = _judged_pair()
    acc.receive(10.001, b"id-c0", m.encode(m.Heartbeat(5, 10.0)))
    got, msg = acc.receive(13.001, b"id-c0", m.encode(m.Heartbeat(6, 13.0)))
    assert msg is not None and not _dropped(got) and acc.connected("c0") is not None


def test_clocks_running_at_different_rates_stay_matched() -> None:
    """A consumer whose clock runs 200 parts per million slow, its frames read at once
    for three hours: no frame is read late, and a late one still is."""
    acc, _ = _judged_pair()
    t = 10.0
    while t < 10_800.0:
        got, msg = acc.receive(t + 0.001, b"id-c0", m.encode(m.Heartbeat(int(t), t * 0.9998)))
        assert msg is not None and not _dropped(got), t
        t += 0.25
    got, _ = acc.receive(t + 1.0, b"id-c0", m.encode(m.Heartbeat(1, t * 0.9998)))
    assert "read its Heartbeat 1.00 s late" in _dropped(got)


def test_a_consumer_whose_next_heartbeat_is_not_read_in_time_is_in_doubt() -> None:
    """What a WRITE must not outrun: the consumer's next Heartbeat is due 0.25 s after its
    last, and it gives the producer up if that goes unanswered 1.0 s. Until a Heartbeat
    sent at 10.0 (read at 10.001), nothing is in doubt; from 11.001 a WRITE could reach a
    consumer that failed its request (this loop may not have read its Heartbeats yet)."""
    acc, _ = _judged_pair()
    acc.receive(10.001, b"id-c0", m.encode(m.Heartbeat(5, 10.0)))
    assert acc.doubt("c0", 11.0) == ""
    assert "no Heartbeat of it read for 1.00 s" in acc.doubt("c0", 11.002)
    acc.receive(11.003, b"id-c0", m.encode(m.Heartbeat(6, 11.0)))
    assert acc.doubt("c0", 11.5) == "" and acc.doubt("nobody", 99.0) == ""


def test_a_consumer_that_said_nothing_of_its_timeouts_is_not_judged() -> None:
    """A Hello that says no heartbeat period (or none that makes sense with its timeout):
    the consumer's frames' delays are not judged (the producer's own silence check still
    drops it)."""
    dials, acc = _pair(None)
    _connect(dials, acc)
    acc.receive(10.001, b"id-c0", m.encode(m.Heartbeat(5, 10.0)))
    got, msg = acc.receive(20.0, b"id-c0", _register(10.1))
    assert msg is not None and not _dropped(got) and acc.doubt("c0", 30.0) == ""


def test_a_helloack_before_the_hello_is_refused_and_changes_nothing() -> None:
    """A HelloAck while the dialer still probes answers no Hello of this attempt: refused
    (the driver counts it), the dialer keeps probing."""
    dials, _ = _pair(None)
    d, _ = dials.dial(0.0, "tcp://p0:1", b"cmeta", 10.0)
    assert d.state is s.DialState.PROBING
    ack = m.HelloAck("p0", b"pmeta", FakeMemory(2, 16).layout.to_wire())
    with pytest.raises(ProtocolError):
        dials.receive(0.0, d, m.encode(ack))
    assert d.state is s.DialState.PROBING


def test_the_hello_carries_the_wire_layout() -> None:
    """DialConfig.wire: the layout the Hello carries (a data-plane child's, with its own
    addresses), checked by the producer; ``layout`` stays the one checked here."""
    here, child = FakeMemory(2, 16), FakeMemory(2, 16)   # both kept: other addresses
    layout, wire = here.layout, child.layout
    assert wire.to_wire() != layout.to_wire()
    dials = s.Dialers(s.DialConfig("c0", layout, None, 1.0, wire=lambda: wire))
    _, acc = _pair(None)
    d, out = dials.dial(0.0, "tcp://p0:1", b"cmeta", 10.0)
    got, _ = acc.receive(0.0, b"id", _frames(out)[0].frame)
    got, _ = dials.receive(0.0, d, _frames(got)[0].frame)
    (hello,) = _frames(got)
    assert isinstance(hello.msg, m.Hello) and hello.msg.layout == wire.to_wire()


def test_the_hello_reads_its_metadata_when_made() -> None:
    """Metadata given as a callable is read when the Hello is made: a data plane restarted
    between the dial and the producer's Challenge sends its new metadata."""
    dials, acc = _pair(None)
    current = [b"old"]
    d, out = dials.dial(0.0, "tcp://p0:1", lambda: current[0], 10.0)
    current[0] = b"new"
    got, _ = acc.receive(0.0, b"id", _frames(out)[0].frame)
    got, _ = dials.receive(0.0, d, _frames(got)[0].frame)
    (hello,) = _frames(got)
    assert isinstance(hello.msg, m.Hello) and hello.msg.agent_metadata == b"new"


def test_tables_render() -> None:
    for table in (s.DIAL_TABLE, s.LINK_TABLE):
        text = mermaid(table)
        assert text.startswith("stateDiagram-v2")
