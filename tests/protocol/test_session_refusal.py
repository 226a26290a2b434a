"""A refusal a consumer cannot authenticate: with a key, an unsealed HelloReject (what a
producer without the key answers, and what anyone on the network can send) never ends a
handshake; it only names the likely reason when the handshake times out."""

from __future__ import annotations

import itertools

import pytest

from kvpush import messages as m
from kvpush.errors import AuthenticationError, PeerUnavailable
from kvpush.protocol import session as s
from kvpush.testing.fakes import FakeMemory

KEY = b"k" * 32


def _nonces(seed: int):  # type: ignore[no-untyped-def]
    counter = itertools.count(seed * 1000)
    return lambda: next(counter).to_bytes(16, "big")


def _producer(key: bytes | None) -> s.Acceptor:
    return s.Acceptor(s.AcceptConfig("p0", FakeMemory(2, 16).layout, key, 1.0, "tcp://p0:1",
                                     "tcp://0.0.0.0:1", lambda: 1000.0, _nonces(1)),
                      lambda: b"pmeta")


def _dial(key: bytes | None, deadline: float = 2.0) -> tuple[s.Dialers, s.Dialer,
                                                                list[s.SessionEffect]]:
    dials = s.Dialers(s.DialConfig("c0", FakeMemory(2, 16).layout, key, 1.0, 0.05, 0.5,
                                   lambda: 1000.0, _nonces(2)))
    d, out = dials.dial(0.0, "tcp://p0:1", b"cmeta", deadline)
    return dials, d, out


def _until_deadline(dials: s.Dialers, d: s.Dialer, end: float) -> list[s.SessionEffect]:
    out: list[s.SessionEffect] = []
    now = 0.0
    while now <= end:
        out += dials.tick(now)
        now += 0.05
    return out


def test_a_forged_plain_refusal_does_not_end_a_keyed_handshake() -> None:
    dials, d, _ = _dial(KEY)
    forged = m.encode(m.HelloReject("bad authentication tag (forged, tampered, or wrong key)",
                                    "auth_key"))
    with pytest.raises(AuthenticationError):
        dials.receive(0.01, d, forged)
    assert d.state is s.DialState.PROBING and d.error is None
    # the genuine producer's answers still bring the session up
    acc = _producer(KEY)
    frames = [e for e in dials.tick(1.0) if isinstance(e, s.Transmit)]
    for _ in range(4):
        answers: list[s.SessionEffect] = []
        for tx in frames:
            got, _msg = acc.receive(1.0, b"id-c0", tx.frame)
            for e in got:
                answers += acc.admitted(1.0, e.peer, e.name) \
                    if isinstance(e, s.Admit) else [e]  # type: ignore[arg-type]
        frames = []
        for tx in answers:
            if not isinstance(tx, s.Transmit):
                continue
            got, _msg = dials.receive(1.0, d, tx.frame)
            for e in got:
                if isinstance(e, s.Admit):
                    got += dials.admitted(1.0, d)
            frames += [e for e in got if isinstance(e, s.Transmit)]
            frames += [e for e in dials.tick(1.0) if isinstance(e, s.Transmit)]
        if d.up:
            break
    assert d.up


def test_a_producer_without_our_key_fails_the_connect_at_its_deadline_with_its_reason(
        ) -> None:
    dials, d, out = _dial(KEY, deadline=1.0)
    acc = _producer(None)
    for tx in [e for e in out if isinstance(e, s.Transmit)]:
        got, _ = acc.receive(0.0, b"id-c0", tx.frame)
        for answer in [e for e in got if isinstance(e, s.Transmit)]:
            with pytest.raises(AuthenticationError):
                dials.receive(0.0, d, answer.frame)
    assert d.state is s.DialState.PROBING         # still trying: it may be an attacker
    (failed,) = [e for e in _until_deadline(dials, d, 1.2) if isinstance(e, s.ConnectFailed)]
    assert isinstance(failed.error, AuthenticationError) and failed.timed_out
    assert "could not be authenticated" in str(failed.error)


def test_silence_until_the_deadline_is_peer_unavailable() -> None:
    dials, d, _ = _dial(KEY, deadline=1.0)
    (failed,) = [e for e in _until_deadline(dials, d, 1.2) if isinstance(e, s.ConnectFailed)]
    assert isinstance(failed.error, PeerUnavailable) and failed.timed_out


def test_without_a_key_a_refusal_ends_the_handshake_at_once() -> None:
    dials, d, _ = _dial(None)
    out, _ = dials.receive(0.01, d, m.encode(m.HelloReject("go away")))
    (failed,) = [e for e in out if isinstance(e, s.ConnectFailed)]
    assert isinstance(failed.error, PeerUnavailable) and d.state is s.DialState.DOWN
    assert not failed.timed_out               # refused, not timed out
