"""Authenticated control plane: both keys work; one key, or two different keys, fail the
handshake with a clear error; forged, tampered and replayed frames are rejected and counted."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

import kvpush
from kvpush import messages as m
from kvpush import stream
from kvpush.auth import Opener, Sealer
from kvpush.errors import AuthenticationError
from tests.support.harness import check_blocks, drain_released, fill, make_cache

KEY = b"k" * 32


def test_sealer_opener_roundtrip_tamper_replay() -> None:
    sealer, opener = Sealer(KEY, b"dir"), Opener(KEY, b"dir", window=8)
    frames = [sealer.seal(f"msg{i}".encode()) for i in range(12)]
    assert opener.open(frames[0]) == b"msg0"
    assert opener.open(frames[3]) == b"msg3"
    assert opener.open(frames[2]) == b"msg2"  # out of order inside the window: once
    with pytest.raises(AuthenticationError, match="replayed"):
        opener.open(frames[2])
    assert opener.open(frames[11]) == b"msg11"
    with pytest.raises(AuthenticationError, match="replayed"):
        opener.open(frames[1])  # fell out of the window
    tampered = bytearray(frames[5])
    tampered[-1] ^= 1
    with pytest.raises(AuthenticationError, match="tag"):
        opener.open(bytes(tampered))
    with pytest.raises(AuthenticationError, match="tag"):
        Opener(b"x" * 32, b"dir").open(frames[6])
    with pytest.raises(AuthenticationError, match="tag"):
        Opener(KEY, b"other-direction").open(frames[6])


def test_authenticated_push_and_pull() -> None:
    src, dst = make_cache(num_blocks=16), make_cache(num_blocks=16)
    fill(src, 5)
    with kvpush.Producer(src.layout, kvpush.ProducerConfig(auth_key=KEY)) as p, \
            kvpush.Consumer(dst.layout, kvpush.ConsumerConfig(auth_key=KEY)) as c:
        name = c.connect(p.address, timeout=10)
        h = c.expect("a", np.array([1, 2]), name)
        p.prefill_done("a", np.array([3, 4]))
        assert h.wait(10).ok
        ticket = p.prefill_done("b", np.array([5]), kvpush.TransferMode.PULL)
        assert c.pull(ticket, np.array([9])).wait(10).ok
        check_blocks(dst, np.array([1, 2, 9]), np.array([3, 4, 5]), 5)
        assert p.stats()["auth_rejected"] == 0 and c.stats()["auth_rejected"] == 0
        assert len(drain_released(p, 2)) == 2


@pytest.mark.parametrize(("pkey", "ckey"), [(KEY, None), (None, KEY), (KEY, b"z" * 32)])
def test_key_mismatch_fails_handshake_clearly(pkey: bytes | None, ckey: bytes | None) -> None:
    cache = make_cache(num_blocks=8)
    with kvpush.Producer(cache.layout, kvpush.ProducerConfig(auth_key=pkey)) as p, \
            kvpush.Consumer(cache.layout, kvpush.ConsumerConfig(auth_key=ckey)) as c:
        with pytest.raises(AuthenticationError, match=r"auth|tag|key"):
            c.connect(p.address, timeout=3)
        assert c.producers() == []


def test_forged_messages_are_rejected_and_counted() -> None:
    src, dst = make_cache(num_blocks=8), make_cache(num_blocks=8)
    with kvpush.Producer(src.layout, kvpush.ProducerConfig(auth_key=KEY)) as p, \
            kvpush.Consumer(dst.layout, kvpush.ConsumerConfig(auth_key=KEY,
                                                              name="victim")) as c:
        c.connect(p.address, timeout=10)
        ctx = stream.Context()
        try:
            # An attacker that knows the consumer's name (its ZeroMQ identity) but not the key.
            rogue = ctx.socket(zmq.DEALER)
            rogue.setsockopt(zmq.LINGER, 0)
            rogue.setsockopt(zmq.IDENTITY, b"victim-2")
            rogue.connect(p.address)
            register = m.Register("evil", 1, m.encode_ids(np.array([1])), 0, 10.0)
            rogue.send(m.encode(register))                              # plain
            rogue.send(m.encode(register, Sealer(b"w" * 32, b"c2p")))   # wrong key
            rogue.send(m.encode(register, Sealer(KEY, b"hello")))       # not a Hello
            deadline = time.monotonic() + 5
            while p.stats()["auth_rejected"] < 3:
                assert time.monotonic() < deadline, p.stats()
                time.sleep(0.01)
            rogue.close()
        finally:
            ctx.destroy(linger=0)
        assert p._driver.call_and_wait(lambda: p._debug_state("evil"), 5) == "none"
        assert p.stats()["transfers_posted"] == 0
