"""kvpush.testing's simulated peers against a real Producer and a real Consumer: each
fault an integration must survive, judged by what the engine sees (result states, errors,
``blocks_safe``, releases exactly once, the bytes that landed)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvpush
from kvpush import ReleaseReason, RequestState, TransferMode
from kvpush.testing import (
    Action,
    Direction,
    FrameRule,
    SimulatedDecode,
    SimulatedPrefill,
    check_blocks,
    fill_blocks,
)

# The engine's side: quick to notice a lost peer, quick to give a request up.
FAST_CONSUMER = kvpush.ConsumerConfig(heartbeat_s=0.1, peer_timeout_s=0.5,
                                      request_timeout_s=10.0, abort_grace_s=1.0)
FAST_PRODUCER = kvpush.ProducerConfig(peer_timeout_s=0.5, lease_s=2.0)
SETTLE_S = 0.5  # after the one result or release expected, how long a second one may come


def engine_cache(num_blocks: int = 16) -> tuple[list[np.ndarray], kvpush.KVLayout]:
    bufs = [np.zeros((num_blocks, 2 * 4 * 2 * 16 * 2), np.uint8) for _ in range(2)]
    return bufs, kvpush.KVLayout.from_buffers(
        bufs, num_layers=2, num_blocks=num_blocks, tokens_per_block=4, num_kv_heads=2,
        head_size=16, dtype="float16")


def results_of(consumer: kvpush.Consumer, handle: kvpush.TransferHandle
               ) -> list[kvpush.TransferResult]:
    """Every result the engine's Consumer queued for ``handle``'s use, once it has one and
    SETTLE_S passed without another."""
    handle.wait(15)
    time.sleep(SETTLE_S)
    return [r for r in consumer.get_finished() if r.xid == handle.xid]


def releases_of(producer: kvpush.Producer, *rids: str, timeout: float = 10.0
                ) -> dict[str, list[kvpush.Release]]:
    """Every release of each of ``rids`` the engine's Producer queued, once each has one
    and SETTLE_S passed without another (the queue is drained: ask for every id at once)."""
    got: list[kvpush.Release] = []
    deadline = time.monotonic() + timeout
    while not {r.request_id for r in got} >= set(rids) and time.monotonic() < deadline:
        time.sleep(0.02)
        got += producer.get_released()
    time.sleep(SETTLE_S)
    got += producer.get_released()
    return {rid: [r for r in got if r.request_id == rid] for rid in rids}


def untouched(layout: kvpush.KVLayout, bufs: list[np.ndarray], ids: list[int]) -> bool:
    return all(not b[ids].any() for b in bufs)


# -- a decode engine (its real Consumer) against a simulated prefill ------------------------
@pytest.fixture
def decode() -> Iterator[tuple[SimulatedPrefill, kvpush.Consumer, list[np.ndarray], str]]:
    bufs, layout = engine_cache()
    with SimulatedPrefill(layout, config=kvpush.ProducerConfig(lease_s=2.0)) as sim, \
            kvpush.Consumer(layout, FAST_CONSUMER) as consumer:
        name = consumer.connect(sim.address, timeout=10)
        yield sim, consumer, bufs, name


def test_push_and_pull_from_a_simulated_prefill_land_its_bytes(decode: tuple) -> None:
    sim, consumer, _, name = decode
    handle = consumer.expect("push", [0, 1], name)
    sim.prefill("push", [5, 6])
    [result] = results_of(consumer, handle)
    assert result.state is RequestState.READY and result.blocks_safe
    check_blocks(consumer.layout, [0, 1], "push")
    ticket = sim.prefill("pull", [7], TransferMode.PULL)
    assert ticket is not None
    [result] = results_of(consumer, consumer.pull(ticket, [2]))
    assert result.state is RequestState.READY
    check_blocks(consumer.layout, [2], "pull")
    assert [r.reason for r in sim.releases()] == [ReleaseReason.TRANSFERRED] * 2


def test_a_killed_prefill_fails_the_request_after_peer_timeout(decode: tuple) -> None:
    sim, consumer, bufs, name = decode
    handle = consumer.expect("orphan", [3], name)
    time.sleep(0.2)  # registered
    sim.kill()
    t0 = time.monotonic()
    [result] = results_of(consumer, handle)
    assert result.state is RequestState.FAILED
    assert isinstance(result.error, kvpush.PeerUnavailable)
    assert time.monotonic() - t0 < FAST_CONSUMER.peer_timeout_s + 2 + SETTLE_S
    assert name not in consumer.producers()
    assert untouched(consumer.layout, bufs, [3])


def test_a_restarted_prefill_is_a_new_incarnation(decode: tuple) -> None:
    """The restart ends the old incarnation's request (nothing it held survives); the
    engine connects again, under the same name, and the new incarnation serves it."""
    sim, consumer, _, name = decode
    handle = consumer.expect("across", [4], name)
    time.sleep(0.2)
    sim.restart()
    [result] = results_of(consumer, handle)
    assert result.state is RequestState.FAILED
    assert isinstance(result.error, kvpush.PeerUnavailable)
    assert consumer.connect(sim.address, timeout=10) == name
    handle = consumer.expect("after", [5], name)
    sim.prefill("after", [1])
    [result] = results_of(consumer, handle)
    assert result.state is RequestState.READY
    check_blocks(consumer.layout, [5], "after")


def test_a_stalled_prefill_is_lost_and_its_late_frames_change_nothing(decode: tuple) -> None:
    sim, consumer, bufs, name = decode
    handle = consumer.expect("stalled", [6], name)
    time.sleep(0.2)
    sim.stall()
    sim.prefill("stalled", [2])     # its Posted waits in the stall
    [result] = results_of(consumer, handle)
    sim.resume()
    time.sleep(SETTLE_S)
    assert result.state is RequestState.FAILED
    assert isinstance(result.error, kvpush.PeerUnavailable)
    assert [r for r in consumer.get_finished() if r.xid == handle.xid] == []  # once only
    if result.blocks_safe:
        assert untouched(consumer.layout, bufs, [6])
    # Alive after all: the engine connects again and is served.
    assert consumer.connect(sim.address, timeout=10) == name
    handle = consumer.expect("after-stall", [7], name)
    sim.prefill("after-stall", [3])
    assert handle.wait(10).state is RequestState.READY


def test_a_lost_registration_times_out_and_the_prefill_lets_its_lease_run_out(
        decode: tuple) -> None:
    sim, consumer, bufs, name = decode
    sim.add_rule(FrameRule(Action.DROP, frozenset({"register"}), request_id="lost", limit=1))
    handle = consumer.expect("lost", [8], name, timeout=1.0)
    sim.prefill("lost", [4])
    [result] = results_of(consumer, handle)
    assert result.state is RequestState.TIMED_OUT and result.blocks_safe
    assert untouched(consumer.layout, bufs, [8])
    release = sim.wait_release("lost")
    assert release.reason is ReleaseReason.LEASE_EXPIRED
    assert sim.proxy.counts[Direction.TO_PRODUCER, "register", "drop"] == 1


def test_a_failed_push_fails_with_its_blocks_safe(decode: tuple) -> None:
    sim, consumer, bufs, name = decode
    sim.fail_push("doomed")
    handle = consumer.expect("doomed", [9, 10], name)
    [result] = results_of(consumer, handle)
    assert result.state is RequestState.FAILED
    assert isinstance(result.error, kvpush.TransferFailed)
    assert result.blocks_safe and untouched(consumer.layout, bufs, [9, 10])


def test_a_prefill_abort_ends_the_use_aborted(decode: tuple) -> None:
    sim, consumer, _, name = decode
    handle = consumer.expect("given-up", [11], name)
    time.sleep(0.2)
    sim.abort("given-up")
    [result] = results_of(consumer, handle)
    assert result.state is RequestState.ABORTED
    assert isinstance(result.error, kvpush.RequestAborted)


def test_slow_and_duplicated_frames_still_land_every_byte_once(decode: tuple) -> None:
    sim, consumer, _, name = decode
    sim.slow(0.05)
    sim.add_rule(FrameRule(Action.DUPLICATE, frozenset({"hb", "hb_ack", "posted"}),
                           probability=0.5, seed=3))
    handles = [consumer.expect(f"dup{i}", [i], name) for i in range(6)]
    for i in range(6):
        sim.prefill(f"dup{i}", [8 + i])
    for i, handle in enumerate(handles):
        [result] = results_of(consumer, handle) if i == 5 else [handle.wait(15)]
        assert result.state is RequestState.READY, result
        check_blocks(consumer.layout, [i], f"dup{i}")
    time.sleep(SETTLE_S)
    assert sorted(r.request_id for r in sim.releases()) == [f"dup{i}" for i in range(6)]
    assert sum(n for (_, _, what), n in sim.proxy.counts.items() if what == "duplicate")


def test_a_duplicated_registration_is_taken_once(decode: tuple) -> None:
    """ZeroMQ never delivers a frame twice; when a registration comes twice all the same,
    the producer drops the second (answering it Failed would tell the consumer that a use
    it goes on serving is over: the consumer gives its blocks back on a Failed), the use
    is served once, every byte exact, and its source comes back once."""
    sim, consumer, _, name = decode
    sim.add_rule(FrameRule(Action.DUPLICATE, frozenset({"register"}), limit=1))
    handle = consumer.expect("twice", [12], name)
    time.sleep(0.2)
    sim.prefill("twice", [6])
    [result] = results_of(consumer, handle)
    assert result.state is RequestState.READY, result
    check_blocks(consumer.layout, [12], "twice")
    assert [r.reason for r in sim.releases("twice")] == [ReleaseReason.TRANSFERRED]
    assert sum(n for (_, _, what), n in sim.proxy.counts.items() if what == "duplicate")


def test_an_authenticated_prefill_behind_its_proxy_serves_and_restarts() -> None:
    """With ``auth_key`` the proxy still stands between (Hellos name the proxy's address,
    which the Producer advertises); a sealed frame delivered twice is refused as a replay
    and changes nothing; a restart ends the old incarnation's request within the engine's
    ``peer_timeout_s``."""
    key = b"k" * 32
    _, layout = engine_cache()
    with SimulatedPrefill(layout, config=kvpush.ProducerConfig(auth_key=key)) as sim, \
            kvpush.Consumer(layout, kvpush.ConsumerConfig(
                heartbeat_s=0.1, peer_timeout_s=0.5, auth_key=key)) as consumer:
        name = consumer.connect(sim.address, timeout=10)
        sim.add_rule(FrameRule(Action.DUPLICATE, frozenset({"posted"})))
        handle = consumer.expect("sealed", [0], name)
        sim.prefill("sealed", [4])
        assert handle.wait(10).state is RequestState.READY
        check_blocks(layout, [0], "sealed")
        ticket = sim.prefill("pulled", [5], TransferMode.PULL)
        assert ticket is not None
        assert consumer.pull(ticket, [1]).wait(10).state is RequestState.READY
        check_blocks(layout, [1], "pulled")
        assert consumer.stats()["auth_rejected"] >= 1    # the second Posted
        handle = consumer.expect("across", [2], name)
        time.sleep(0.2)
        sim.restart()
        t0 = time.monotonic()
        result = handle.wait(10)
        assert result.state is RequestState.FAILED
        assert isinstance(result.error, kvpush.PeerUnavailable)
        assert time.monotonic() - t0 < 0.5 + 2


# -- a prefill engine (its real Producer) against a simulated decode ------------------------
@pytest.fixture
def prefill() -> Iterator[tuple[SimulatedDecode, kvpush.Producer]]:
    _, layout = engine_cache()
    with kvpush.Producer(layout, FAST_PRODUCER) as producer, \
            SimulatedDecode(producer.address, layout, config=kvpush.ConsumerConfig(
                heartbeat_s=0.1, peer_timeout_s=5.0, abort_grace_s=1.0)) as sim:
        yield sim, producer


def test_a_simulated_decode_gets_the_prefills_bytes_and_each_source_comes_back_once(
        prefill: tuple) -> None:
    sim, producer = prefill
    handle = sim.expect("push", [0, 1])
    fill_blocks(producer.layout, [4, 5], "push")
    producer.prefill_done("push", [4, 5])
    sim.check(handle.wait(10))
    fill_blocks(producer.layout, [6], "pull")
    ticket = producer.prefill_done("pull", [6], TransferMode.PULL)
    sim.check(sim.pull(ticket, [2]).wait(10))
    for [release] in releases_of(producer, "push", "pull").values():
        assert release.reason is ReleaseReason.TRANSFERRED and release.blocks_safe


def test_a_killed_decode_costs_its_registration_not_the_blocks(prefill: tuple) -> None:
    sim, producer = prefill
    sim.expect("orphan", [3])
    time.sleep(0.2)
    sim.kill()
    deadline = time.monotonic() + 5
    while producer.stats()["peers_lost"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert producer.stats()["peers_lost"] == 1
    producer.prefill_done("orphan", [7])
    [release] = releases_of(producer, "orphan")["orphan"]
    assert release.reason in (ReleaseReason.FAILED, ReleaseReason.LEASE_EXPIRED)
    assert release.blocks_safe


def test_a_decode_abort_gives_the_blocks_back_aborted(prefill: tuple) -> None:
    sim, producer = prefill
    handle = sim.expect("given-up", [4])
    time.sleep(0.2)
    sim.abort("given-up")
    assert handle.wait(10).state is RequestState.ABORTED
    producer.prefill_done("given-up", [8])
    [release] = releases_of(producer, "given-up")["given-up"]
    assert release.reason is ReleaseReason.ABORTED and release.blocks_safe


def test_a_restarted_decode_is_served_as_a_new_incarnation(prefill: tuple) -> None:
    sim, producer = prefill
    sim.expect("old", [5])
    time.sleep(0.2)
    sim.restart()
    handle = sim.expect("new", [6])
    fill_blocks(producer.layout, [9], "new")
    producer.prefill_done("new", [9])
    sim.check(handle.wait(10))
    time.sleep(3 * FAST_PRODUCER.peer_timeout_s)  # the old incarnation is lost by now
    producer.prefill_done("old", [10])
    released = releases_of(producer, "old", "new")
    assert [(r.reason, r.blocks_safe) for r in released["old"]] == [(ReleaseReason.FAILED, True)]
    assert [r.reason for r in released["new"]] == [ReleaseReason.TRANSFERRED]


def test_a_stalled_decode_is_dropped_and_the_source_fails_once(prefill: tuple) -> None:
    sim, producer = prefill
    handle = sim.expect("stalled", [7])
    time.sleep(0.2)
    sim.stall()
    time.sleep(3 * FAST_PRODUCER.peer_timeout_s)
    sim.resume()
    producer.prefill_done("stalled", [11])
    [release] = releases_of(producer, "stalled")["stalled"]
    assert release.reason is ReleaseReason.FAILED and release.blocks_safe
    assert handle.wait(10).state is RequestState.FAILED


def test_a_slow_decode_is_still_served(prefill: tuple) -> None:
    sim, producer = prefill
    sim.slow(0.2)  # below the producer's peer_timeout_s
    handle = sim.expect("slow", [8])
    fill_blocks(producer.layout, [12], "slow")
    producer.prefill_done("slow", [12])
    sim.check(handle.wait(10))
    [release] = releases_of(producer, "slow")["slow"]
    assert release.reason is ReleaseReason.TRANSFERRED


def test_a_pull_whose_announcement_is_lost_is_never_trusted(prefill: tuple) -> None:
    """The decode's PullBegin never reaches the producer: without the producer's PullHeld
    the READ's data is not trusted whatever it read, and the source comes back once."""
    sim, producer = prefill
    sim.add_rule(FrameRule(Action.DROP, frozenset({"pull_begin"}), request_id="unheld"))
    fill_blocks(producer.layout, [13], "unheld")
    ticket = producer.prefill_done("unheld", [13], TransferMode.PULL)
    result = sim.pull(ticket, [9], timeout=3.0).wait(15)
    assert result.state is RequestState.TIMED_OUT
    [release] = releases_of(producer, "unheld")["unheld"]
    assert release.reason in (ReleaseReason.LEASE_EXPIRED, ReleaseReason.TRANSFERRED)
    assert sim.proxy.counts[Direction.TO_PRODUCER, "pull_begin", "drop"] == 1
