"""Push and pull between a Producer in a child process and a Consumer in this one, over
real NIXL agents: every destination byte checked, canaries around, releases counted."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest

import kvpush
from kvpush import RequestState, TransferMode
from tests.support.harness import CANARY, ChildProducer, check_blocks, check_canaries, make_cache

SEED = 7
CACHE = dict(num_blocks=512, num_layers=2, kv_packed=False)


@pytest.fixture(scope="module")
def producer() -> Iterator[ChildProducer]:
    child = ChildProducer(seed=SEED, cache=CACHE)
    yield child
    child.close()


@pytest.fixture()
def consumer() -> Iterator[tuple[kvpush.Consumer, object]]:
    cache = make_cache(**CACHE)
    for buf in cache.buffers:
        buf[:] = CANARY
    with kvpush.Consumer(cache.layout) as c:
        yield c, cache


def random_requests(rng: np.random.Generator, count: int, src_blocks: int,
                    dst_blocks: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` requests with disjoint destination blocks: scattered ids, adjacent runs,
    single blocks and empty requests, int32 and int64."""
    dst_pool = list(rng.permutation(dst_blocks))
    out = []
    for i in range(count):
        kind = i % 5
        if kind == 0:
            n = 0
        elif kind == 1:
            n = 1
        else:
            n = int(rng.integers(2, 12))
        if kind == 3 and n and len(dst_pool) > 0:
            # adjacent runs on both sides: a run in the source, a run in the destination
            start = int(rng.integers(0, src_blocks - n))
            src = np.arange(start, start + n)
            free = set(dst_pool)
            starts = [s for s in range(dst_blocks - n) if all(x in free for x in range(s, s + n))]
            if starts:
                d0 = int(rng.choice(starts))
                dst = np.arange(d0, d0 + n)
                for x in dst:
                    dst_pool.remove(x)
                out.append((src, dst))
                continue
        n = min(n, len(dst_pool))
        dst = np.array([dst_pool.pop() for _ in range(n)], dtype=np.int64)
        src = rng.choice(src_blocks, size=n, replace=False)
        dtype = np.int32 if i % 2 else np.int64
        out.append((src.astype(dtype), dst.astype(dtype)))
    return out


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_thousand_requests_every_byte(producer: ChildProducer, consumer: tuple, mode: TransferMode
                                      ) -> None:
    c, cache = consumer
    name = c.connect(producer.address, timeout=30)
    assert name == producer.name
    rng = np.random.default_rng(1234 if mode is TransferMode.PUSH else 4321)
    total = 0
    released: list = []
    for batch in range(20):
        reqs = random_requests(rng, 50, cache.layout.num_blocks, cache.layout.num_blocks)
        rids = [f"{mode.value}-{batch}-{i}" for i in range(len(reqs))]
        if mode is TransferMode.PUSH:
            handles = [c.expect(rid, dst, name) for rid, (_, dst) in zip(rids, reqs, strict=True)]
            producer.call("prefill_done_many",
                          [(rid, src, "push") for rid, (src, _) in zip(rids, reqs, strict=True)])
        else:
            tickets = producer.call("prefill_done_many",
                                    [(rid, src, "pull") for rid, (src, _) in
                                     zip(rids, reqs, strict=True)])
            handles = [c.pull(t, dst) for t, (_, dst) in zip(tickets, reqs, strict=True)]
        for h in handles:
            result = h.wait(30)
            assert result.state is RequestState.READY, result
        touched = np.concatenate([d for _, d in reqs]).astype(np.int64)
        for src, dst in reqs:
            check_blocks(cache, dst.astype(np.int64), src.astype(np.int64), SEED)
        check_canaries(cache, touched)
        for buf in cache.buffers:
            buf[:] = CANARY
        released += producer.released(len(reqs))
        total += len(reqs)
    assert total == 1000
    counts = Counter(rid for rid, _, _ in released)
    assert len(counts) == 1000 and set(counts.values()) == {1}, "each request released once"
    assert {reason for _, reason, _ in released} == {"transferred"}
    assert c.pending == 0


def test_rendezvous_registration_first(producer: ChildProducer, consumer: tuple) -> None:
    c, cache = consumer
    name = c.connect(producer.address)
    src, dst = np.array([5, 6, 7, 100]), np.array([1, 2, 3, 50])
    h = c.expect("reg-first", dst, name)
    deadline = time.monotonic() + 10
    while producer.call("state", "reg-first") != "registered":
        assert time.monotonic() < deadline
        time.sleep(0.005)
    producer.call("prefill_done", ("reg-first", src, "push"))
    assert h.wait(10).state is RequestState.READY
    check_blocks(cache, dst, src, SEED)
    assert producer.released(1) == [("reg-first", "transferred", src.tolist())]


def test_rendezvous_prefill_first(producer: ChildProducer, consumer: tuple) -> None:
    c, cache = consumer
    name = c.connect(producer.address)
    src, dst = np.array([9, 3, 4]), np.array([10, 11, 12])
    producer.call("prefill_done", ("pf-first", src, "push"))
    assert producer.call("state", "pf-first") == "held-push"
    h = c.expect("pf-first", dst, name)
    assert h.wait(10).state is RequestState.READY
    check_blocks(cache, dst, src, SEED)
    assert producer.released(1) == [("pf-first", "transferred", src.tolist())]
