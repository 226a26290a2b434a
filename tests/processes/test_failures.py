"""Every failure path of the protocol, across two processes: leases, deadlines, aborts from
either side at each step, a producer that dies, a consumer that leaves. Each ends within its
deadline with a defined state and the source blocks released exactly once.

The same paths are pinned at each layer on purpose: event by event on the protocol cores
(``tests/protocol``), here between a Producer process and a Consumer over NIXL's local
transports, and across two hosts with link faults (``tests/netns/test_fault_matrix.py``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvpush
from kvpush import RequestState
from tests.support.harness import CANARY, ChildProducer, make_cache

CACHE = dict(num_blocks=128, num_layers=2)
FAST = dict(heartbeat_s=0.1, peer_timeout_s=1.0, abort_grace_s=2.0, lease_margin_s=0.05)


@pytest.fixture(scope="module")
def producer() -> Iterator[ChildProducer]:
    child = ChildProducer(cache=CACHE, lease_s=0.5, peer_timeout_s=1.0)
    yield child
    child.close()


@pytest.fixture()
def consumer() -> Iterator[kvpush.Consumer]:
    cache = make_cache(**CACHE)
    for buf in cache.buffers:
        buf[:] = CANARY
    with kvpush.Consumer(cache.layout, kvpush.ConsumerConfig(**FAST)) as c:
        c._test_cache = cache  # type: ignore[attr-defined]
        yield c


def releases_of(producer: ChildProducer, rid: str, timeout: float = 5.0) -> list[str]:
    """Wait for ``rid``'s release and return every release reason seen for it."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen += [reason for r, reason, _ in producer.call("released") if r == rid]
        if seen:
            time.sleep(0.3)  # a second release would show up now
            seen += [reason for r, reason, _ in producer.call("released") if r == rid]
            return seen
        time.sleep(0.01)
    return seen


def wait_state(producer: ChildProducer, rid: str, want: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while (state := producer.call("state", rid)) != want:
        assert time.monotonic() < deadline, f"{rid}: state {state}, wanted {want}"
        time.sleep(0.005)


def test_lease_expires_without_registration(producer: ChildProducer,
                                            consumer: kvpush.Consumer) -> None:
    name = consumer.connect(producer.address)
    t0 = time.monotonic()
    producer.call("prefill_done", ("lease", np.array([1, 2]), "push"))
    assert releases_of(producer, "lease") == ["lease_expired"]
    assert time.monotonic() - t0 < 3
    # A registration after the lease ran out fails fast, it does not wait.
    h = consumer.expect("lease", np.array([3, 4]), name, timeout=30)
    result = h.wait(5)
    assert result.state is RequestState.TIMED_OUT
    assert isinstance(result.error, kvpush.TransferTimeout)


def test_registration_deadline_without_prefill(producer: ChildProducer,
                                               consumer: kvpush.Consumer) -> None:
    name = consumer.connect(producer.address)
    h = consumer.expect("noprefill", np.array([1]), name, timeout=0.3)
    result = h.wait(5)
    assert result.state is RequestState.TIMED_OUT
    assert result.elapsed_s < 3
    wait_state(producer, "noprefill", "none")
    # Prefill finishing late: the blocks go back at once, not after a lease.
    producer.call("prefill_done", ("noprefill", np.array([9]), "push"))
    assert releases_of(producer, "noprefill") == ["aborted"]


@pytest.mark.parametrize("step", ["before_anything", "registered", "held"])
def test_producer_abort(producer: ChildProducer, consumer: kvpush.Consumer, step: str) -> None:
    name = consumer.connect(producer.address)
    rid = f"pabort-{step}"
    handle = None
    if step == "registered":
        handle = consumer.expect(rid, np.array([1, 2]), name)
        wait_state(producer, rid, "registered")
    elif step == "held":
        producer.call("prefill_done", (rid, np.array([5]), "pull"))
        wait_state(producer, rid, "held-pull")
    producer.call("abort", rid)
    if step == "before_anything":
        # prefill finishing after the abort: blocks released at once
        producer.call("prefill_done", (rid, np.array([3]), "push"))
        handle = consumer.expect(rid, np.array([1]), name)
    if step != "registered":
        assert releases_of(producer, rid) == ["aborted"]
    assert handle is None or handle.wait(5).state is RequestState.ABORTED


@pytest.mark.parametrize("step", ["registered", "held_pull"])
def test_consumer_abort(producer: ChildProducer, consumer: kvpush.Consumer, step: str) -> None:
    name = consumer.connect(producer.address)
    rid = f"cabort-{step}"
    if step == "registered":
        handle = consumer.expect(rid, np.array([1, 2]), name)
        wait_state(producer, rid, "registered")
        consumer.abort(rid)
        assert handle.wait(5).state is RequestState.ABORTED
        wait_state(producer, rid, "none")
        producer.call("prefill_done", (rid, np.array([3, 4]), "push"))
        assert releases_of(producer, rid) == ["aborted"]
    else:
        ticket = producer.call("prefill_done", (rid, np.array([3, 4]), "pull"))
        assert ticket is not None
        # The router gives up on the request: the consumer tells the producer.
        handle = consumer.pull(ticket, np.array([1, 2]))
        consumer.abort(rid)
        state = handle.wait(5).state
        assert state in (RequestState.ABORTED, RequestState.READY)  # the READ may win
        assert len(releases_of(producer, rid)) == 1


def test_pull_ticket_lease_run_out(producer: ChildProducer, consumer: kvpush.Consumer) -> None:
    ticket = producer.call("prefill_done", ("stale", np.array([1]), "pull"))
    time.sleep(0.6)  # past the producer's 0.5 s lease
    handle = consumer.pull(ticket, np.array([2]))
    result = handle.wait(5)
    assert result.state is RequestState.TIMED_OUT
    assert releases_of(producer, "stale") == ["lease_expired"]
    cache = consumer._test_cache  # type: ignore[attr-defined]
    assert (cache.buffers[0][2] == CANARY).all(), "no READ may start on an expired lease"


def test_producer_killed_mid_request() -> None:
    child = ChildProducer(cache=CACHE)
    cache = make_cache(**CACHE)
    try:
        with kvpush.Consumer(cache.layout, kvpush.ConsumerConfig(**FAST)) as consumer:
            name = consumer.connect(child.address)
            handle = consumer.expect("orphan", np.array([1, 2, 3]), name, timeout=60)
            wait_state(child, "orphan", "registered")
            t0 = time.monotonic()
            child.kill()
            result = handle.wait(10)
            assert result.state is RequestState.FAILED
            assert isinstance(result.error, kvpush.PeerUnavailable)
            assert time.monotonic() - t0 < 5
            assert name not in consumer.producers()
            # New requests toward the dead producer fail at once.
            late = consumer.expect("late", np.array([4]), name).wait(5)
            assert late.state is RequestState.FAILED
    finally:
        child.close()


def test_consumer_leaves_producer_releases() -> None:
    child = ChildProducer(cache=CACHE, lease_s=30, peer_timeout_s=1.0)
    cache = make_cache(**CACHE)
    try:
        consumer = kvpush.Consumer(cache.layout, kvpush.ConsumerConfig(**FAST))
        name = consumer.connect(child.address)
        consumer.expect("gone", np.array([1, 2]), name)
        wait_state(child, "gone", "registered")
        consumer.close()
        # The producer forgets the registration; a late prefill just waits out its lease.
        wait_state(child, "gone", "none")
        assert child.call("stats")["peers_lost"] >= 1
    finally:
        child.close()


def test_handles_closed_consumer_reports_aborted(producer: ChildProducer) -> None:
    cache = make_cache(**CACHE)
    consumer = kvpush.Consumer(cache.layout, kvpush.ConsumerConfig(**FAST))
    name = consumer.connect(producer.address)
    handle = consumer.expect("closing", np.array([1]), name)
    consumer.close()
    result = handle.wait(5)
    assert result.state is RequestState.ABORTED
    assert isinstance(result.error, kvpush.ClosedError)
    with pytest.raises(kvpush.ClosedError):
        consumer.expect("after", np.array([1]), name)


def test_a_first_read_to_a_stopped_producer_holds_no_loop() -> None:
    """A consumer's first READ from a producer process that cannot run (stopped between its
    ticket and the pull: its UCX worker makes no progress) is posted without waiting for
    that peer: the consumer's loop takes its next command at once, and the pull ends READY
    once the producer runs again."""
    child = ChildProducer(cache=CACHE, lease_s=30.0, peer_timeout_s=10.0)
    try:
        cache = make_cache(**CACHE)
        config = kvpush.ConsumerConfig(heartbeat_s=0.5, peer_timeout_s=10.0)
        with kvpush.Consumer(cache.layout, config) as consumer:
            consumer.connect(child.address, timeout=30)
            ticket = child.call("prefill_done", ("first", np.arange(8), "pull"))
            assert child.process.pid is not None
            os.kill(child.process.pid, signal.SIGSTOP)
            try:
                handle = consumer.pull(ticket, np.arange(8))
                answered = threading.Event()
                consumer._driver.call_soon(answered.set)
                assert answered.wait(2.0), "the consumer's loop waited on a stopped peer"
            finally:
                os.kill(child.process.pid, signal.SIGCONT)
            assert handle.wait(30).state is RequestState.READY
    finally:
        child.close()
