"""The memory keys and what protects them: with an auth_key the NIXL
metadata (the keys of the whole cache) and pull tickets cannot be read or altered without the
key, a Hello is bound to the producer it was meant for and to its sender's NIXL agent, a
ZeroMQ identity cannot be taken over, and oversized inputs are refused before allocation.
Real Producers and Consumers over NIXL; a raw ZeroMQ socket plays the attacker."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq

import kvpush
from kvpush import messages as m
from kvpush.auth import Opener, Sealer, decrypt, encrypt
from kvpush.errors import AuthenticationError, InvalidRequest, ProtocolError
from tests.support.harness import fill, make_cache

KEY = b"s" * 32


_CACHES: list[object] = []  # registered memory must outlive its endpoint


def producer() -> kvpush.Producer:
    cache = make_cache(num_blocks=16)
    fill(cache, 3)
    _CACHES.append(cache)
    return kvpush.Producer(cache.layout, kvpush.ProducerConfig(auth_key=KEY))


def consumer(key: bytes | None = KEY) -> kvpush.Consumer:
    cache = make_cache(num_blocks=16)
    _CACHES.append(cache)
    return kvpush.Consumer(cache.layout,
                           kvpush.ConsumerConfig(auth_key=key, connect_timeout_s=5.0))


class Sniffer:
    """A ROUTER a consumer connects to, recording what it sends (an observer of the wire)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def frame(self, timeout: float = 5.0) -> tuple[bytes, bytes]:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("nothing received")
        identity, frame = self.sock.recv_multipart()
        return identity, frame

    def close(self) -> None:
        self.sock.close()
        self.ctx.destroy(linger=0)


def hello_to(sniffer: Sniffer, c: kvpush.Consumer) -> tuple[bytes, bytes]:
    """The Hello ``c`` sends when it dials ``sniffer``, which answers its Probe as a
    producer would (the connect then times out)."""
    import threading

    def dial() -> None:
        with pytest.raises(kvpush.KvpushError):
            c.connect(sniffer.address, 1.0)
    t = threading.Thread(target=dial, daemon=True)
    t.start()
    try:
        identity, frame = sniffer.frame()
        key = c.config.auth_key
        probe = m.decode(frame, None if key is None else Opener(key, b"hello", replay=False))
        assert isinstance(probe, m.Probe)
        challenge = m.Challenge("sniffed", b"i", b"c" * 16, probe.nonce)
        sniffer.sock.send_multipart([identity, m.encode(
            challenge, None if key is None else Sealer(key, b"challenge"))])
        while True:  # its Hello, after any Probe re-sent meanwhile
            identity, frame = sniffer.frame()
            opener = None if key is None else Opener(key, b"hello", replay=False)
            if isinstance(m.decode(frame, opener), m.Hello):
                return identity, frame
    finally:
        t.join(8)


def test_hello_metadata_is_encrypted_and_bound_to_its_nonce() -> None:
    sniffer, c = Sniffer(), consumer()
    try:
        identity, frame = hello_to(sniffer, c)
        metadata = c._agent.metadata()
        assert metadata not in frame and metadata[:64] not in frame  # not readable on the wire
        hello = m.decode(frame, Opener(KEY, b"hello", replay=False))
        assert isinstance(hello, m.Hello) and hello.to == sniffer.address
        assert decrypt(KEY, b"hello-metadata", hello.nonce + hello.name.encode(),
                       hello.agent_metadata) == metadata
        with pytest.raises(AuthenticationError):  # bound to its nonce and sender
            decrypt(KEY, b"hello-metadata", bytes(16) + hello.name.encode(),
                    hello.agent_metadata)
        assert not identity.startswith(c.name.encode())  # a random routing identity
    finally:
        c.close()
        sniffer.close()
    plain_sniffer, plain = Sniffer(), consumer(None)
    try:
        _, frame = hello_to(plain_sniffer, plain)
        assert plain._agent.metadata() in frame  # without a key nothing is hidden
    finally:
        plain.close()
        plain_sniffer.close()


def test_a_hello_replayed_to_another_producer_is_refused() -> None:
    """A Hello captured on its way to one producer, replayed to another that shares the key:
    the second refuses it (the Hello names the address it was meant for)."""
    sniffer, c, p2 = Sniffer(), consumer(), producer()
    ctx = zmq.Context()
    attacker = ctx.socket(zmq.DEALER)
    try:
        _, frame = hello_to(sniffer, c)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(p2.address)
        attacker.send(frame)
        assert attacker.poll(5000), "no answer"
        answer = m.decode(attacker.recv(), Opener(KEY, b"hello-ack", replay=False))
        assert isinstance(answer, m.HelloReject) and "meant for" in answer.reason
        assert p2.stats()["auth_rejected"] >= 1
    finally:
        attacker.close()
        ctx.destroy(linger=0)
        p2.close()
        c.close()
        sniffer.close()


def test_helloack_metadata_is_encrypted_under_the_session() -> None:
    p, c = producer(), consumer()
    try:
        name = c.connect(p.address)
        assert name == p.name
        # The producer's answer as it was sent: its metadata does not appear in it.
        peer = next(iter(p._sessions.consumers.values()))
        assert p._agent.metadata() not in peer.ack_frame
    finally:
        c.close()
        p.close()


def test_a_sealed_ticket_cannot_be_read_altered_or_spliced() -> None:
    p, c = producer(), consumer()
    try:
        c.connect(p.address)
        ticket = p.prefill_done("r1", np.array([3, 4, 5]), kvpush.TransferMode.PULL)
        assert ticket is not None and ticket.sealed and ticket.block_ids == b""
        raw = ticket.to_bytes()
        assert m.encode_ids(np.array([3, 4, 5])) not in raw  # the router cannot read them
        # A router that rewrites the plain fields changes nothing: they come from the seal.
        forged = msgspec.structs.replace(ticket, block_ids=m.encode_ids(np.array([9])))
        assert forged.open(KEY).block_ids == m.encode_ids(np.array([3, 4, 5]))
        # One that alters the sealed bytes, or moves them to another request, is refused.
        flipped = bytearray(ticket.sealed)
        flipped[-1] ^= 1
        with pytest.raises(AuthenticationError):
            c.pull(msgspec.structs.replace(ticket, sealed=bytes(flipped)), np.array([1, 2, 3]))
        other = p.prefill_done("r2", np.array([6]), kvpush.TransferMode.PULL)
        assert other is not None
        with pytest.raises(AuthenticationError):
            c.pull(msgspec.structs.replace(other, sealed=ticket.sealed), np.array([1, 2, 3]))
        # An unsealed ticket (a producer without the key, or forged) is refused too.
        plain = ticket.open(KEY)
        with pytest.raises(AuthenticationError, match="not sealed"):
            c.pull(plain, np.array([1, 2, 3]))
        # The real one works.
        result = c.pull(raw, np.array([1, 2, 3])).wait(10)
        assert result.state is kvpush.RequestState.READY, result
        keyless = consumer(None)
        with pytest.raises(AuthenticationError, match="no auth_key"):
            keyless.pull(raw, np.array([1, 2, 3]))
        keyless.close()
    finally:
        c.close()
        p.close()


def test_a_zeromq_identity_cannot_be_taken_over() -> None:
    """Another connection under the consumer's name (ROUTER_HANDOVER used to hand it the
    consumer's pipe): the consumer's requests still complete."""
    p, c = producer(), consumer()
    ctx = zmq.Context()
    attacker = ctx.socket(zmq.DEALER)
    try:
        c.connect(p.address)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.setsockopt(zmq.IDENTITY, c.name.encode())
        attacker.connect(p.address)
        attacker.send(b"\x02\x00garbage")
        time.sleep(0.3)
        h = c.expect("r", np.array([7]), p.name, timeout=10)
        p.prefill_done("r", np.array([2]))
        assert h.wait(10).state is kvpush.RequestState.READY
        while attacker.poll(200):  # only the answer to its own garbage, nothing of the consumer's
            answer = m.decode(attacker.recv())
            assert isinstance(answer, m.HelloReject), answer
    finally:
        attacker.close()
        ctx.destroy(linger=0)
        c.close()
        p.close()


def test_a_hello_with_another_agents_metadata_is_refused() -> None:
    p, c = producer(), consumer()
    ctx = zmq.Context()
    attacker = ctx.socket(zmq.DEALER)
    try:
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(p.address)
        nonce = b"n" * 16
        attacker.send(m.encode(m.Probe(nonce), Sealer(KEY, b"hello")))
        assert attacker.poll(5000)
        challenge = m.decode(attacker.recv(), Opener(KEY, b"challenge", replay=False))
        assert isinstance(challenge, m.Challenge) and challenge.name == p.name
        metadata = encrypt(KEY, b"hello-metadata", nonce + b"someone-else",
                           c._agent.metadata())
        hello = m.Hello("someone-else", metadata, c.layout.to_wire(), nonce, time.time(),
                        p.address, challenge.nonce)
        attacker.send(m.encode(hello, Sealer(KEY, b"hello")))
        assert attacker.poll(5000)
        answer = m.decode(attacker.recv(), Opener(KEY, b"hello-ack", replay=False))
        assert isinstance(answer, m.HelloReject) and "NIXL metadata of" in answer.reason
        assert answer.echo == nonce  # sealed, and bound to the Hello it refuses
    finally:
        attacker.close()
        ctx.destroy(linger=0)
        c.close()
        p.close()


def test_oversized_inputs_are_refused_before_allocation() -> None:
    with pytest.raises(InvalidRequest, match="at most 1024"):
        kvpush.plan.check_request_id("x" * 1025)
    with pytest.raises(ProtocolError, match="exceeds"):
        m.decode_ids(bytes(8 * (m.MAX_FRAME_BYTES // 8)))
    too_long = m.encode(m.Abort("x" * 2000, 1, "r"))
    with pytest.raises(ProtocolError, match="length"):
        m.decode(too_long)
    with pytest.raises(ProtocolError, match=">= 1"):
        m.decode(m.encode(m.PullBegin("r", 1, 2, sharers=0)))
    # A frame over MAX_FRAME_BYTES: libzmq drops the connection that sent it before
    # allocating it; the producer goes on serving the others.
    p, c = producer(), consumer()
    ctx = zmq.Context()
    attacker = ctx.socket(zmq.DEALER)
    try:
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(p.address)
        attacker.send(b"\x02\x00" + bytes(m.MAX_FRAME_BYTES + 1))
        time.sleep(0.5)
        assert p.stats()["messages_rejected"] == 0  # never reached the producer's logic
        c.connect(p.address)
        h = c.expect("ok", np.array([1]), p.name, timeout=10)
        p.prefill_done("ok", np.array([2]))
        assert h.wait(10).state is kvpush.RequestState.READY
    finally:
        attacker.close()
        ctx.destroy(linger=0)
        c.close()
        p.close()
