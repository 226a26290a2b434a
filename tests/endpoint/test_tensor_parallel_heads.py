"""Heterogeneous tensor parallelism: producer and consumer hold different KV-head shards
(2->1, 1->2, 4->2, and GQA with replicated heads); each producer writes exactly the heads
both hold into the right offset of the consumer's blocks."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

import kvpush
from kvpush import RequestState, TransferMode
from kvpush.layout import covering_producers
from tests.support.harness import CANARY, fill, make_cache

TOTAL = 4  # KV heads of the model


def shard(tp: int, rank: int, total: int = TOTAL) -> tuple[int, int]:
    """(head_start, num_heads) of a TP rank; with tp > total, heads are replicated."""
    if tp <= total:
        per = total // tp
        return rank * per, per
    return rank * total // tp, 1


def heads_of(cache, region: int, block: int) -> dict[int, bytes]:
    lay = cache.layout
    raw = cache.buffers[region][block]
    return {lay.head_start + h: raw[h * lay.head_bytes:(h + 1) * lay.head_bytes].tobytes()
            for h in range(lay.num_kv_heads)}


@pytest.mark.parametrize(("p_tp", "c_tp", "total"), [
    (2, 1, TOTAL), (1, 2, TOTAL), (4, 2, TOTAL), (8, 2, TOTAL), (2, 4, TOTAL),
    (4, 3, 12),  # decode rank 0 reads prefill rank 0 (one sharer) and rank 1 (two)
])
@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_heterogeneous_tp(p_tp: int, c_tp: int, total: int, mode: TransferMode) -> None:
    def cache(tp: int, rank: int, blocks: int):
        start, n = shard(tp, rank, total)
        return make_cache(num_blocks=blocks, num_layers=2, num_kv_heads=n,
                          head_start=start, total_kv_heads=total)

    src = [cache(p_tp, r, 16) for r in range(p_tp)]
    dst = [cache(c_tp, r, 24) for r in range(c_tp)]
    for c in src:  # ranks that replicate a head hold the same bytes for it
        fill(c, 50 + c.layout.head_start)
    for c in dst:
        for buf in c.buffers:
            buf[:] = CANARY
    src_ids, dst_ids = np.array([3, 4, 9]), np.array([20, 0, 7])
    with contextlib.ExitStack() as stack:
        producers = [stack.enter_context(kvpush.Producer(c.layout)) for c in src]
        consumers = [stack.enter_context(kvpush.Consumer(c.layout)) for c in dst]
        # One prefill request, one request id: every producer rank calls prefill_done once,
        # and every decode rank takes its heads' share from the ranks covering them. A
        # source shared by several decode ranks is held until each has taken its share.
        rid = "tp"
        chosen: list[list[str]] = []
        by_name: dict[str, kvpush.Producer] = {}
        for ci, consumer in enumerate(consumers):
            names = {}
            for p in producers:
                try:
                    names[consumer.connect(p.address)] = p
                except kvpush.LayoutMismatch as exc:  # shares no head with this consumer
                    assert exc.field == "head_start"
            by_name.update(names)
            chosen.append(covering_producers(
                dst[ci].layout, {n: consumer.producer_layout(n) for n in names}))
        sharers = {n: sum(n in c for c in chosen) for n in by_name}
        handles = []
        tickets = {}
        for n, p in by_name.items():
            if not sharers[n]:
                continue
            if mode is TransferMode.PUSH:
                p.prefill_done(rid, src_ids)
            else:
                tickets[n] = p.prefill_done(rid, src_ids, TransferMode.PULL)
        for ci, consumer in enumerate(consumers):
            if mode is TransferMode.PUSH:
                handles.append(consumer.expect(rid, dst_ids, chosen[ci],
                                               sharers=[sharers[n] for n in chosen[ci]]))
            else:  # one READ per producer rank, one request
                handles.append(consumer.pull([tickets[n] for n in chosen[ci]], dst_ids,
                                             sharers=[sharers[n] for n in chosen[ci]]))
        for h in handles:
            assert h.wait(10).state is RequestState.READY
        # Each producer rank's blocks come back once, after every sharer took its share.
        deadline = time.monotonic() + 10
        released: dict[str, list[kvpush.Release]] = {n: [] for n in by_name}
        while time.monotonic() < deadline and any(
                len(released[n]) < (1 if sharers[n] else 0) for n in by_name):
            for n, p in by_name.items():
                released[n] += p.get_released()
            time.sleep(0.01)
        for n in by_name:
            assert [r.reason for r in released[n]] == (
                [kvpush.ReleaseReason.TRANSFERRED] if sharers[n] else []), n
        # Every head of every consumer block holds the producer's bytes for that head.
        expected: dict[int, dict[int, bytes]] = {}
        for r in range(src[0].layout.num_regions):
            for s, d in zip(src_ids, dst_ids, strict=True):
                want: dict[int, bytes] = {}
                for c in src:
                    want.update(heads_of(c, r, s))
                for c in dst:
                    got = heads_of(c, r, d)
                    for h, data in got.items():
                        assert data == want[h], f"region {r} block {d} head {h}"
                expected[r] = want
        # Bytes moved: each consumer received exactly its own heads, once.
        for c, consumer in zip(dst, consumers, strict=True):
            assert consumer.stats()["bytes_moved"] == len(dst_ids) * c.layout.bytes_per_block_id


def test_covering_producers_picks_each_head_once() -> None:
    lay = lambda start, n: make_cache(num_blocks=2, num_kv_heads=n, head_start=start,  # noqa: E731
                                      total_kv_heads=TOTAL).layout
    consumer = lay(0, 4)
    producers = {"r0": lay(0, 1), "r1": lay(0, 1), "r2": lay(1, 1), "r3": lay(1, 1),
                 "r4": lay(2, 2), "r5": lay(2, 2)}
    assert covering_producers(consumer, producers) == ["r4", "r0", "r2"]
    with pytest.raises(ValueError, match="no producer holds KV heads"):
        covering_producers(consumer, {"r0": lay(0, 1)})


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_head_shard_descriptors_counted_as_posted(mode: TransferMode) -> None:
    """A head shard of each block is not adjacent to the next block's shard, so NIXL merges
    nothing: descriptors_posted counts every (region, block), not one per run of blocks."""
    src = make_cache(num_blocks=16, num_kv_heads=4, total_kv_heads=4)
    dst = make_cache(num_blocks=16, num_kv_heads=2, head_start=0, total_kv_heads=4)
    src_ids, dst_ids = np.array([3, 4, 5]), np.array([6, 7, 8])  # one run on both sides
    with kvpush.Producer(src.layout) as p, kvpush.Consumer(dst.layout) as c:
        name = c.connect(p.address)
        if mode is TransferMode.PUSH:
            handle = c.expect("r", dst_ids, name)
            p.prefill_done("r", src_ids)
        else:
            handle = c.pull(p.prefill_done("r", src_ids, mode), dst_ids)
        assert handle.wait(10).state is RequestState.READY
        poster = p if mode is TransferMode.PUSH else c
        assert poster.stats()["descriptors_posted"] == 3 * src.layout.num_regions
