"""Several producer ranks per request, and layer-wise push: the consumer expects exactly the
parts owed (ranks x layer groups) and reports READY once, after the last one landed."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvpush
from kvpush import RequestState
from tests.support.harness import CANARY, ChildProducer, check_blocks, fill, make_cache

SEED = 3
CACHE = dict(num_blocks=64, num_layers=4, kv_packed=False)


@pytest.fixture(scope="module")
def producer() -> Iterator[ChildProducer]:
    child = ChildProducer(seed=SEED, cache=CACHE)
    yield child
    child.close()


def test_layerwise_push_across_processes(producer: ChildProducer) -> None:
    cache = make_cache(**CACHE)
    for buf in cache.buffers:
        buf[:] = CANARY
    with kvpush.Consumer(cache.layout) as consumer:
        name = consumer.connect(producer.address)
        before = producer.call("stats")["transfers_posted"]
        src, dst = np.array([4, 5, 6, 30]), np.array([10, 11, 12, 40])
        handle = consumer.expect("lw", dst, name, layerwise=True)
        deadline = time.monotonic() + 10
        while producer.call("state", "lw") != "registered":
            assert time.monotonic() < deadline
            time.sleep(0.005)
        per_layer = cache.layout.num_regions // cache.layout.num_layers
        for layer in range(CACHE["num_layers"]):
            producer.call("layer_done", ("lw", src, layer))
            # This layer's regions land before the later layers are even final.
            region = layer * per_layer
            deadline = time.monotonic() + 10
            while (cache.buffers[region][dst[0]] == CANARY).all():
                assert time.monotonic() < deadline, f"layer {layer} did not land"
                time.sleep(0.002)
            later = (layer + 1) * per_layer
            if later < cache.layout.num_regions:
                assert (cache.buffers[later][dst] == CANARY).all()
                assert not handle.done()
        producer.call("prefill_done", ("lw", src, "push"))
        assert handle.wait(10).state is RequestState.READY
        check_blocks(cache, dst, src, SEED)
        assert producer.call("stats")["transfers_posted"] - before == CACHE["num_layers"]
        assert next(r for r in producer.released(1) if r[0] == "lw")[1] == "transferred"


def test_layerwise_registration_after_some_layers(producer: ChildProducer) -> None:
    cache = make_cache(**CACHE)
    with kvpush.Consumer(cache.layout) as consumer:
        name = consumer.connect(producer.address)
        src, dst = np.array([1, 2]), np.array([3, 4])
        producer.call("layer_done", ("late", src, 0))
        producer.call("layer_done", ("late", src, 1))
        handle = consumer.expect("late", dst, name, layerwise=True)
        producer.call("prefill_done", ("late", src, "push"))
        assert handle.wait(10).state is RequestState.READY
        check_blocks(cache, dst, src, SEED)
        assert next(r for r in producer.released(1) if r[0] == "late")[1] == "transferred"


def test_layerwise_prefill_never_finishes(producer: ChildProducer) -> None:
    cache = make_cache(**CACHE)
    with kvpush.Consumer(cache.layout, kvpush.ConsumerConfig(abort_grace_s=2)) as consumer:
        name = consumer.connect(producer.address)
        src = np.array([7])
        handle = consumer.expect("stuck", np.array([9]), name, layerwise=True, timeout=0.5)
        producer.call("layer_done", ("stuck", src, 0))
        result = handle.wait(10)
        assert result.state is RequestState.TIMED_OUT
        rel = [r for r in producer.released(1) if r[0] == "stuck"]
        # The consumer's abort and the registration's own deadline (the same 0.5 s) race.
        assert [r[1] for r in rel] in (["aborted"], ["failed"])
        producer.call("prefill_done", ("stuck", src, "push"))  # late: nothing released twice
        time.sleep(0.2)
        assert not [r for r in producer.call("released") if r[0] == "stuck"]


@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_layerwise_abort_after_some_layers(producer: ChildProducer, side: str) -> None:
    """Aborted after two of four layers were written: the consumer learns that every WRITE
    has ended (the landed layers' notifications, the producer's Failed/AbortAck) and reports
    ABORTED with safe blocks at once, not after ``abort_grace_s``; released once."""
    cache = make_cache(**CACHE)
    with kvpush.Consumer(cache.layout, kvpush.ConsumerConfig(abort_grace_s=5)) as consumer:
        name = consumer.connect(producer.address)
        rid = f"lw-abort-{side}"
        src, dst = np.array([20, 21, 22]), np.array([30, 31, 32])
        handle = consumer.expect(rid, dst, name, layerwise=True)
        deadline = time.monotonic() + 10
        while producer.call("state", rid) != "registered":
            assert time.monotonic() < deadline
            time.sleep(0.005)
        for layer in range(2):
            producer.call("layer_done", (rid, src, layer))
        t0 = time.monotonic()
        if side == "producer":
            producer.call("abort", rid)
        else:
            consumer.abort(rid)
        result = handle.wait(10)
        assert (result.state, result.blocks_safe) == (RequestState.ABORTED, True), result
        assert time.monotonic() - t0 < 2.0
        assert [r[1] for r in producer.released(1) if r[0] == rid] == ["aborted"]
        producer.call("prefill_done", (rid, src, "push"))  # late: nothing released twice
        time.sleep(0.2)
        assert not [r for r in producer.call("released") if r[0] == rid]


def test_two_producer_ranks_one_request() -> None:
    """A request whose KV comes from two producer ranks (e.g. two pipeline stages, each
    owning half the layers' regions): READY only after both parts landed."""
    caches = [make_cache(num_blocks=16, num_layers=2) for _ in range(2)]
    for i, c in enumerate(caches):
        fill(c, 100 + i)
    dst = make_cache(num_blocks=16, num_layers=2)
    with kvpush.Producer(caches[0].layout) as p0, kvpush.Producer(caches[1].layout) as p1, \
            kvpush.Consumer(dst.layout) as consumer:
        names = [consumer.connect(p.address) for p in (p0, p1)]
        handle = consumer.expect("tp", np.array([1, 2]), names)
        p0.prefill_done("tp", np.array([5, 6]))
        deadline = time.monotonic() + 5
        while consumer.stats()["bytes_moved"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert not handle.done(), "one rank of two must not complete the request"
        p1.prefill_done("tp", np.array([5, 6]))
        result = handle.wait(10)
        assert result.state is RequestState.READY
        assert consumer.stats()["requests_completed"] == 1
        # Both ranks wrote the same blocks here; the last writer's bytes are what lands.
        assert dst.buffers[0][1][:16].view(np.int64)[1] in (100, 101)


def test_rank_failure_fails_request_once() -> None:
    caches = [make_cache(num_blocks=16) for _ in range(2)]
    dst = make_cache(num_blocks=16)
    with kvpush.Producer(caches[0].layout) as p0, kvpush.Producer(caches[1].layout) as p1, \
            kvpush.Consumer(dst.layout) as consumer:
        names = [consumer.connect(p.address) for p in (p0, p1)]
        handle = consumer.expect("tpfail", np.array([1]), names)
        p0.prefill_done("tpfail", np.array([2]))
        p1.abort("tpfail")
        result = handle.wait(10)
        assert result.state is RequestState.ABORTED
        assert consumer.stats()["requests_aborted"] == 1
        assert consumer.stats()["requests_completed"] == 0
