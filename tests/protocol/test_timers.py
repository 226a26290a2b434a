"""Timers of the protocol cores and the loop (:mod:`kvpush.protocol.timers`), and the cores'
timer heaps under a stream of requests.

Every request arms deadlines that are cancelled as it moves on (the registration's wait,
the WRITE's timeout, the lease; an expect's timeout). The heaps kept each cancelled entry,
with its callback and what that held, until its deadline came round: at a high request
rate hundreds of thousands of dead entries that the garbage collector walked on every full
collection (a 150,000-request run of the producer core stalled one call for 1.3 s).
"""

from __future__ import annotations

import gc
import weakref

import numpy as np

from kvpush import messages as m
from kvpush.protocol.effects import Post, XferEnd
from kvpush.protocol.timers import COMPACT_MIN, TimerHeap
from kvpush.request import TransferMode
from tests.support.cores import Harness, P, core, expect


def test_pop_order_is_deadline_then_arming_order_across_compactions() -> None:
    heap = TimerHeap()
    fired: list[int] = []
    timers = [heap.add(float(i % 7), lambda i=i: fired.append(i)) for i in range(500)]
    for t in timers[::3] + timers[1::3]:  # two thirds cancelled: compacted on the way
        t.cancel()
    assert len(heap) < 500 - COMPACT_MIN
    for fn in heap.pop_due(10.0):
        fn()
    kept = [i for i in range(500) if i % 3 == 2]
    assert fired == sorted(kept, key=lambda i: (i % 7, i))
    assert len(heap) == 0 and heap.next_deadline() is None


def test_the_fifo_lane_merges_with_the_heap_in_deadline_then_arming_order() -> None:
    heap = TimerHeap()
    fired: list[str] = []
    for i, (deadline, fifo) in enumerate([(5.0, True), (3.0, False), (5.0, False),
                                          (6.0, True), (4.0, True), (6.0, False)]):
        # (4.0, fifo) comes after 6.0 in the lane: it goes to the heap instead
        heap.add(deadline, fired.append, f"{deadline}/{i}", fifo=fifo)
    dropped = heap.add(7.0, fired.append, "cancelled", fifo=True)
    dropped.cancel()
    assert heap.next_deadline() == 3.0
    for fn in heap.pop_due(10.0):
        fn()
    assert fired == ["3.0/1", "4.0/4", "5.0/0", "5.0/2", "6.0/3", "6.0/5"]
    assert len(heap) == 0


def test_a_cancelled_timer_lets_go_of_its_callback() -> None:
    class Payload:
        pass

    heap = TimerHeap()
    payload = Payload()
    ref = weakref.ref(payload)
    timer = heap.add(100.0, lambda p=payload: None)
    del payload
    timer.cancel()
    gc.collect()
    assert ref() is None and timer.cancelled
    timer.cancel()  # twice: nothing more
    assert heap.next_deadline() is None and len(heap) == 0


def test_callbacks_may_arm_and_cancel_during_a_pass() -> None:
    heap = TimerHeap()
    fired: list[str] = []
    later = heap.add(2.0, lambda: fired.append("later"))

    def first() -> None:
        fired.append("first")
        later.cancel()
        heap.add(1.5, lambda: fired.append("armed"))   # due in this same pass
        for _ in range(3 * COMPACT_MIN):                # compacts in place mid-pass
            heap.add(50.0, lambda: None).cancel()

    heap.add(1.0, first)
    for fn in heap.pop_due(3.0):
        fn()
    assert fired == ["first", "armed"]
    assert heap.next_deadline() is None


def test_fired_timers_count_as_cancelled_and_leave_the_heap() -> None:
    heap = TimerHeap()
    timer = heap.add(1.0, lambda: None)
    assert [fn() for fn in heap.pop_due(1.0)] == [None]
    assert timer.cancelled
    timer.cancel()  # after firing: not counted against the heap
    assert heap._cancelled == 0


def test_producer_core_heap_follows_the_live_timers() -> None:
    """Registration wait, WRITE deadline and lease are cancelled by every push; only the
    tombstone stays armed. The heap held all four per request until their deadlines."""
    h = Harness(lease_s=60.0, tombstone_s=120.0, transfer_timeout_s=30.0)
    ids = np.arange(4, dtype=np.int64)
    n = 3000
    for i in range(n):
        rid = f"r{i}"
        h.core.on_message(h.now, "A", m.Register(rid, i + 1, m.encode_ids(ids), 0, 60.0))
        h.core.drain()
        h.core.prefill_done(h.now, rid, ids, TransferMode.PUSH, i + 1, h.now)
        post = next(e for e in h.core.drain() if isinstance(e, Post))
        h.core.transfer_ended(h.now, post.key, XferEnd.DONE)
        h.core.drain()
        h.now += 0.001
    tombs = len(h.core._requests)
    assert tombs == n  # every use is remembered for tombstone_s (by design)
    # the tombstones, and at most a compaction's worth of cancelled entries (before: about
    # four entries per request, most of them cancelled)
    assert len(h.core._timers) <= tombs + 2 * COMPACT_MIN + 8


def test_consumer_core_heap_follows_the_live_uses() -> None:
    """Each expect arms its timeout; a use that ends cancels it, so the heap holds the
    live uses' timers, not one per request ever made."""
    c = core()
    n = 3000
    for i in range(n):
        rid = f"c{i}"
        expect(c, rid=rid, xid=i + 1, timeout=60.0)
        c.on_message(0.0, P, m.Posted(rid, i + 1, 0))
        c.on_notification(0.0, P, m.Landed(rid, i + 1, 0, nbytes=8))
        c.drain()
    assert c.pending == 0
    assert len(c._timers) <= COMPACT_MIN + 8  # before: one per request ever made
