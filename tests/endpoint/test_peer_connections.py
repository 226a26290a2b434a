"""What one peer can do to a connection and to the other peers: frames read a few at a
time, with strangers' bounded before they are checked; block ids held per consumer; a Hello
bound to the producer that challenged it, and refusals the real consumer can trust; one
connection per producer, whatever spelling of its address was dialled. Real Producers and
Consumers over NIXL in one process; raw ZeroMQ sockets play the attacker or the wire."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

import kvpush
from kvpush import messages as m
from kvpush import stream
from kvpush.agent import Agent
from kvpush.auth import Opener
from kvpush.driver import READ_BYTES, READ_MESSAGES, STRANGER_FRAME_BYTES
from kvpush.errors import AuthenticationError
from tests.support.harness import fill, make_cache, raw_hello

KEY = b"q" * 32
_CACHES: list[object] = []  # registered memory must outlive its endpoint


def producer(key: bytes | None = KEY, **config: Any) -> kvpush.Producer:
    cache = make_cache(num_blocks=16)
    fill(cache, 3)
    _CACHES.append(cache)
    return kvpush.Producer(cache.layout, kvpush.ProducerConfig(auth_key=key, **config))


def consumer(key: bytes | None = KEY, **config: Any) -> kvpush.Consumer:
    cache = make_cache(num_blocks=16)
    _CACHES.append(cache)
    config.setdefault("connect_timeout_s", 5.0)
    return kvpush.Consumer(cache.layout, kvpush.ConsumerConfig(auth_key=key, **config))


def push(p: kvpush.Producer, c: kvpush.Consumer, rid: str, timeout: float = 10.0) -> Any:
    handle = c.expect(rid, np.array([5]), p.name, timeout=timeout)
    p.prefill_done(rid, np.array([2]))
    return handle.wait(timeout + 10)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


class Relay:
    """A man in the middle: a ROUTER at ``tcp://127.0.0.1:<port>`` that passes one
    consumer's frames to ``upstream`` and the answers back, keeping what the consumer sent.
    Stopped (and its sockets closed) by :meth:`close`, within a second."""

    def __init__(self) -> None:
        self.ctx = stream.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.back = self.ctx.socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.sent: list[bytes] = []
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self, upstream: str) -> None:
        self.back.connect(upstream)
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        identity = b""
        while not self._stop:
            # (a stream socket's fd also wakes a poll for its own work: read until Again)
            poller.poll(50)
            try:
                identity, frame = self.front.recv_multipart(zmq.NOBLOCK)
                self.sent.append(frame)
                self.back.send(frame)
            except zmq.Again:
                pass
            try:
                self.front.send_multipart([identity, self.back.recv(zmq.NOBLOCK)])
            except zmq.Again:
                pass

    def close(self) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join(5)
        self.front.close()
        self.back.close()
        self.ctx.destroy(linger=0)


def opened_as_hello(frame: bytes) -> object:
    """``frame`` decoded as a consumer's handshake frame, or None if it is sealed otherwise."""
    try:
        return m.decode(frame, Opener(KEY, b"hello", replay=False))
    except AuthenticationError:
        return None


def attacker(address: str) -> tuple[stream.Context, stream.Socket]:
    ctx = stream.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100000)
    sock.connect(address)
    return ctx, sock


# -- a Hello is bound to the producer that challenged it -------------------------------------
def test_a_hello_replayed_to_a_producer_sharing_key_and_port_is_refused() -> None:
    """Producers on two hosts with one key and one port (here 127.0.0.3 and 127.0.0.2); the
    consumer dials the first by a host name, so its Hello names no address the second could
    tell apart. That Hello, captured and replayed to the second, must change nothing there:
    the consumer's connection to it stays, and so do its requests."""
    relay = Relay()
    p1 = producer(host="127.0.0.3", port=relay.port)
    p2 = producer(host="127.0.0.2", port=relay.port)
    c = consumer()
    ctx, sock = attacker(p2.address)
    relay.start(p1.address)
    try:
        assert c.connect(p2.address) == p2.name
        assert c.connect(f"tcp://localhost:{relay.port}") == p1.name
        # The relay also carries frames sealed under the session (the first Heartbeat goes
        # as the session comes up), which the hello key cannot open.
        hellos = [f for f in list(relay.sent) if isinstance(opened_as_hello(f), m.Hello)]
        assert hellos, "no Hello went through the relay"
        sock.send(hellos[0])
        assert sock.poll(5000), "no answer to the replayed Hello"
        answer = m.decode(sock.recv(), Opener(KEY, b"hello-ack", replay=False))
        assert isinstance(answer, m.HelloReject) and answer.field == "challenge", answer
        time.sleep(0.3)
        assert p2.stats()["peers_lost"] == 0
        result = push(p2, c, "after-replay")
        assert result.state is kvpush.RequestState.READY, result
        assert c.stats()["peers_lost"] == 0
    finally:
        sock.close()
        ctx.destroy(linger=0)
        c.close()
        p1.close()
        p2.close()
        relay.close()


def test_a_consumer_the_producer_dropped_is_told_under_its_session() -> None:
    """A producer that gave a consumer up answers what it still sends with a Bye sealed
    under that connection's session: the consumer trusts it and fails its requests at once,
    not ``peer_timeout_s`` later (an unsealed answer it would have to discard)."""
    p = producer()
    c = consumer(heartbeat_s=0.1, peer_timeout_s=30.0)
    try:
        c.connect(p.address)
        handle = c.expect("dropped", np.array([5]), p.name, timeout=60)
        time.sleep(0.2)
        p._driver.call_and_wait(lambda: p._sessions.drop(next(iter(p._sessions.consumers.values())),
                                                   "given up by the test"), 5)
        result = handle.wait(5)
        assert result.state is kvpush.RequestState.FAILED, result
        assert c.producers() == []
        assert c.stats()["auth_rejected"] == 0
    finally:
        c.close()
        p.close()


# -- one connection per producer, however its address is spelt -------------------------------
@pytest.mark.parametrize("key", [KEY, None], ids=["key", "no-key"])
def test_a_second_spelling_of_a_producers_address_joins_its_connection(
        key: bytes | None) -> None:
    p = producer(key)
    c = consumer(key)
    try:
        port = port_of(p.address)
        assert c.connect(f"tcp://127.0.0.1:{port}") == p.name
        waiting = c.expect("spanning", np.array([5]), p.name, timeout=20)
        assert c.connect(f"tcp://localhost:{port}") == p.name
        both = [c.connect_nowait(f"tcp://{host}:{port}") for host in ("localhost", "127.0.0.1")]
        assert [h.wait(10) for h in both] == [p.name, p.name]
        p.prefill_done("spanning", np.array([2]))
        result = waiting.wait(20)
        assert result.state is kvpush.RequestState.READY, result
        assert len(p._sessions.consumers) == 1
        assert p.stats()["peers_lost"] == 0 and c.stats()["peers_lost"] == 0
        assert push(p, c, "after").state is kvpush.RequestState.READY
    finally:
        c.close()
        p.close()


def test_two_spellings_dialled_at_once_make_one_connection() -> None:
    p = producer()
    c = consumer()
    try:
        port = port_of(p.address)
        handles = [c.connect_nowait(f"tcp://{host}:{port}")
                   for host in ("127.0.0.1", "localhost", "127.0.0.1")]
        assert [h.wait(10) for h in handles] == [p.name] * 3
        time.sleep(0.2)
        assert len(p._sessions.consumers) == 1 and p.stats()["peers_lost"] == 0
        assert push(p, c, "one").state is kvpush.RequestState.READY
    finally:
        c.close()
        p.close()


# -- frames read a few at a time; strangers' bounded before they are checked -----------------
def test_a_socket_is_read_a_budget_at_a_time() -> None:
    """Each call of a socket's handler reads at most READ_MESSAGES messages and about
    READ_BYTES bytes; the rest wait in ZeroMQ for the loop's next iteration."""
    c = consumer(None)
    ctx: zmq.Context[Any] = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    a.bind("inproc://budget")
    b.connect("inproc://budget")
    try:
        for _ in range(READ_MESSAGES + 10):
            a.send(b"x")
        big = bytes(READ_BYTES // 2 + 1)
        for _ in range(3):
            a.send(big, copy=False)
        time.sleep(0.1)

        def reads() -> int:
            return len(list(c._driver.read_frames(b)))

        assert c._driver.call_and_wait(reads, 5) == READ_MESSAGES
        assert c._driver.call_and_wait(reads, 5) == 12   # 10 small, then two big reach READ_BYTES
        assert c._driver.call_and_wait(reads, 5) == 1
        assert c._driver.call_and_wait(reads, 5) == 0
    finally:
        a.close()
        b.close()
        ctx.destroy(linger=0)
        c.close()


def test_a_stranger_flooding_large_frames_neither_costs_checks_nor_delays_a_push() -> None:
    """Frames too large for a handshake from a peer that has not authenticated are dropped
    unread (neither copied nor checked against the key), while a connected consumer's
    requests go on."""
    p = producer()
    c = consumer()
    ctx, sock = attacker(p.address)
    payload = bytes([m.PROTOCOL_VERSION, 1]) + bytes(4 * STRANGER_FRAME_BYTES)
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            try:
                sock.send(payload, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                time.sleep(0.001)

    c.connect(p.address)
    flooder = threading.Thread(target=flood, name="flood", daemon=True)
    flooder.start()
    try:
        time.sleep(0.5)
        start = time.monotonic()
        for i in range(5):
            assert push(p, c, f"during-{i}").state is kvpush.RequestState.READY
        took = time.monotonic() - start
        stats = p.stats()
        assert stats["auth_rejected"] == 0          # none was opened
        assert stats["messages_rejected"] > 10      # they were read and dropped
        assert took < 2.5, f"5 pushes took {took:.2f} s under the flood"
    finally:
        stop.set()
        flooder.join(5)
        sock.close()
        ctx.destroy(linger=0)
        c.close()
        p.close()


# -- block ids held per consumer ---------------------------------------------------------------
@pytest.fixture
def raw_consumer() -> Iterator[tuple[kvpush.Producer, zmq.Socket[Any]]]:
    """A producer with a 4096-block cache and a raw consumer (no key) of the same size that
    completed the handshake."""
    cache = make_cache(num_blocks=4096, num_layers=1, tokens_per_block=1, num_kv_heads=1,
                       head_size=8)
    p = kvpush.Producer(cache.layout, kvpush.ProducerConfig(lease_s=5.0))
    theirs = make_cache(num_blocks=4096, num_layers=1, tokens_per_block=1, num_kv_heads=1,
                        head_size=8)
    agent = Agent("raw-consumer", theirs.layout, kvpush.TransportConfig())
    ctx, sock = attacker(p.address)
    try:
        assert isinstance(raw_hello(sock, "raw-consumer", agent.metadata(),
                                    theirs.layout.to_wire()), m.HelloAck)
        yield p, sock
    finally:
        sock.send(m.encode(m.Bye("raw-consumer")))
        time.sleep(0.1)
        sock.close()
        ctx.destroy(linger=0)
        p.close()
        agent.close()
        del cache, theirs


def answers(sock: zmq.Socket[Any], want: int, timeout: float = 5.0) -> list[m.Message]:
    out: list[m.Message] = []
    deadline = time.monotonic() + timeout
    while len(out) < want and sock.poll(max(int((deadline - time.monotonic()) * 1000), 1)):
        out.append(m.decode(sock.recv()))
    return out


def test_a_registration_naming_more_blocks_than_a_request_can_is_refused(
        raw_consumer: tuple[kvpush.Producer, zmq.Socket[Any]]) -> None:
    p, sock = raw_consumer
    ids = m.encode_ids(np.arange(4097))
    sock.send(m.encode(m.Register("huge", 1, ids, 0, 600.0)))
    got = answers(sock, 1)
    assert len(got) == 1 and isinstance(got[0], m.Failed), got
    assert got[0].code == "invalid_ids" and "at most 4096" in got[0].reason
    assert p._driver.call_and_wait(lambda: p._debug_state("huge"), 5) == "none"


def test_block_ids_waiting_per_consumer_are_bounded(
        raw_consumer: tuple[kvpush.Producer, zmq.Socket[Any]]) -> None:
    """Four times the consumer's cache (at least 65536 ids) may wait for prefills; a
    registration past that is refused with ``too_many``, and one fits again once the
    others went."""
    p, sock = raw_consumer
    ids = m.encode_ids(np.arange(4096))
    for i in range(16):  # 65536 ids: the budget, full
        sock.send(m.encode(m.Register(f"r{i}", i + 1, ids, 0, 600.0)))
    sock.send(m.encode(m.Register("one-more", 99, m.encode_ids(np.arange(1)), 0, 600.0)))
    got = answers(sock, 1)
    assert len(got) == 1 and isinstance(got[0], m.Failed), got
    assert (got[0].request_id, got[0].code) == ("one-more", "too_many")
    assert "block ids waiting" in got[0].reason
    sock.send(m.encode(m.Abort("r0", 1, "make room")))
    assert isinstance(answers(sock, 1)[0], m.AbortAck)
    sock.send(m.encode(m.Register("fits", 100, ids, 0, 600.0)))
    assert answers(sock, 1, timeout=0.5) == []   # waiting for its prefill, not refused
    assert p._driver.call_and_wait(lambda: p._debug_state("fits"), 5) == "registered"
