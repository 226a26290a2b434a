"""How an engine author tests their kvpush integration with :mod:`kvpush.testing`: the
engine's own glue code (here two toy engines that own a block free list) runs against a
simulated peer that is killed, restarted, stalled, or loses control frames, and the test
asserts what the engine must guarantee: every block comes back to its free list exactly
once (or is quarantined when kvpush says a transfer may still touch it), and the bytes that
land are the bytes that were sent.

    python -m pytest examples/engine_tests.py      # from the repository root

(``tests/tooling/test_example_engine_tests.py`` runs these tests.)
"""

from __future__ import annotations

import threading
import time

import numpy as np

import kvpush
from kvpush.testing import (
    Action,
    Direction,
    FrameRule,
    SimulatedDecode,
    SimulatedPrefill,
    check_blocks,
    fill_blocks,
)

NUM_BLOCKS = 32


def make_cache() -> tuple[list[np.ndarray], kvpush.KVLayout]:
    """The engine's KV cache: two layers, K+V packed, 4 tokens x 2 heads x 16, fp16."""
    bufs = [np.zeros((NUM_BLOCKS, 4 * 2 * 16 * 2 * 2), np.uint8) for _ in range(2)]
    return bufs, kvpush.KVLayout.from_buffers(
        bufs, num_layers=2, num_blocks=NUM_BLOCKS, tokens_per_block=4, num_kv_heads=2,
        head_size=16, dtype="float16")


class FreeList:
    """Block ids an engine may allocate; giving one back twice is the bug tests look for."""

    def __init__(self) -> None:
        self.free = set(range(NUM_BLOCKS))
        self.quarantined: set[int] = set()
        self.lock = threading.Lock()
        self.double_frees: list[int] = []

    def take(self, n: int) -> list[int]:
        with self.lock:
            ids = sorted(self.free)[:n]
            self.free -= set(ids)
            return ids

    def give_back(self, ids: np.ndarray, safe: bool) -> None:
        with self.lock:
            back = {int(i) for i in ids}
            self.double_frees += sorted(back & (self.free | self.quarantined))
            (self.free if safe else self.quarantined).update(back)

    def all_back(self, timeout: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.free) + len(self.quarantined) == NUM_BLOCKS:
                    return True
            time.sleep(0.02)
        return False


class ToyDecodeEngine:
    """A decode engine's kvpush glue: allocates blocks for a request, registers them, and
    frees them when kvpush reports the request ended (``on_finished``)."""

    def __init__(self, config: kvpush.ConsumerConfig) -> None:
        self.bufs, self.layout = make_cache()
        self.blocks = FreeList()
        self.results: dict[str, kvpush.TransferResult] = {}
        self.consumer = kvpush.Consumer(self.layout, config, on_finished=self._finished)

    def admit(self, request_id: str, n: int, producer: str) -> list[int]:
        ids = self.blocks.take(n)
        self.consumer.expect(request_id, np.array(ids), producer)
        return ids

    def _finished(self, result: kvpush.TransferResult) -> None:
        self.results[result.request_id] = result
        if not result.ok:  # a READY request's blocks are decoded from, then freed
            self.blocks.give_back(result.block_ids, result.blocks_safe)

    def close(self) -> None:
        self.consumer.close()


class ToyPrefillEngine:
    """A prefill engine's kvpush glue: computes a request into fresh blocks, hands them to
    kvpush, and frees them on their :class:`~kvpush.Release`."""

    def __init__(self, config: kvpush.ProducerConfig) -> None:
        self.bufs, self.layout = make_cache()
        self.blocks = FreeList()
        self.producer = kvpush.Producer(self.layout, config, on_release=self._released)

    def prefill(self, request_id: str, n: int) -> None:
        ids = self.blocks.take(n)
        fill_blocks(self.layout, ids, request_id)   # stands for the model's prefill
        self.producer.prefill_done(request_id, np.array(ids))

    def _released(self, release: kvpush.Release) -> None:
        self.blocks.give_back(release.block_ids, release.blocks_safe)

    def close(self) -> None:
        self.producer.close()


FAST_CONSUMER = kvpush.ConsumerConfig(heartbeat_s=0.1, peer_timeout_s=0.5,
                                      request_timeout_s=5.0, abort_grace_s=1.0)
FAST_PRODUCER = kvpush.ProducerConfig(peer_timeout_s=0.5, lease_s=2.0)


def test_decode_engine_frees_every_block_when_its_prefill_dies() -> None:
    engine = ToyDecodeEngine(FAST_CONSUMER)
    try:
        with SimulatedPrefill(engine.layout) as prefill:
            name = engine.consumer.connect(prefill.address, timeout=10)
            landed = engine.admit("landed", 2, name)
            prefill.prefill("landed", [3, 4])
            engine.admit("orphan", 3, name)
            deadline = time.monotonic() + 10
            while "landed" not in engine.results and time.monotonic() < deadline:
                time.sleep(0.02)
            check_blocks(engine.layout, landed, "landed")
            prefill.kill()                    # the orphan's producer is gone for good
            engine.blocks.give_back(np.array(landed), True)   # decoded, done
            assert engine.blocks.all_back()
            assert engine.results["orphan"].state is kvpush.RequestState.FAILED
            assert engine.blocks.double_frees == []
    finally:
        engine.close()


def test_decode_engine_survives_a_prefill_that_stalls_and_restarts() -> None:
    engine = ToyDecodeEngine(FAST_CONSUMER)
    try:
        with SimulatedPrefill(engine.layout) as prefill:
            name = engine.consumer.connect(prefill.address, timeout=10)
            engine.admit("stalled", 2, name)
            prefill.stall()                   # silent past the engine's peer_timeout_s
            assert engine.blocks.all_back()   # the request failed; its blocks came back
            prefill.restart()                 # a new incarnation under the same name
            assert engine.consumer.connect(prefill.address, timeout=10) == name
            ids = engine.admit("again", 2, name)
            prefill.prefill("again", [0, 1])
            deadline = time.monotonic() + 10
            while "again" not in engine.results and time.monotonic() < deadline:
                time.sleep(0.02)
            assert engine.results["again"].ok
            check_blocks(engine.layout, ids, "again")
            assert engine.blocks.double_frees == []
    finally:
        engine.close()


def test_prefill_engine_gets_every_block_back_whatever_the_decode_does() -> None:
    engine = ToyPrefillEngine(FAST_PRODUCER)
    try:
        # The decode loses a third of its registrations (seeded), then dies.
        lossy = FrameRule(Action.DROP, frozenset({"register"}), Direction.TO_PRODUCER,
                          probability=0.3, seed=5)
        with SimulatedDecode(engine.producer.address, engine.layout, rules=[lossy]) as decode:
            handles = [decode.expect(f"r{i}", [i], timeout=2.0) for i in range(8)]
            for i in range(8):
                engine.prefill(f"r{i}", 1)
            for i, handle in enumerate(handles):
                result = handle.wait(10)
                if result.ok:
                    decode.check(result)
                else:
                    assert result.state is kvpush.RequestState.TIMED_OUT, result
                    assert result.blocks_safe and not decode.buffers[0][i].any()
            decode.expect("orphan", [9])
            decode.kill()
            engine.prefill("orphan", 2)
            assert engine.blocks.all_back()   # every source released, by lease at worst
            assert engine.blocks.double_frees == []
    finally:
        engine.close()
