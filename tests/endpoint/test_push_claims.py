"""Push claims (leases renewed while the decode side waits): a decode engine that
queues a request for blocks claims its push; the prefill keeps the source past its lease while
the decode side lives, and lets it go when the decode side gives it up, closes, or dies.
Real NIXL agents; the dying decode side is a spawned process killed with SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

import kvpush
from kvpush import ReleaseReason, RequestState
from tests.support.harness import CANARY, check_blocks, drain_released, fill, make_cache

LEASE_S = 1.0


def test_a_claimed_push_outlives_the_lease_and_an_unclaimed_one_does_not() -> None:
    src, dst = make_cache(num_blocks=16), make_cache(num_blocks=16)
    fill(src, 5)
    for buf in dst.buffers:
        buf[:] = CANARY
    with kvpush.Producer(src.layout, kvpush.ProducerConfig(lease_s=LEASE_S)) as p, \
            kvpush.Consumer(dst.layout, kvpush.ConsumerConfig(heartbeat_s=0.2)) as c:
        name = c.connect(p.address, timeout=10)
        xid = c.claim_push("claimed", name)
        with pytest.raises(kvpush.InvalidRequest, match="already claimed"):
            c.claim_push("claimed", name)
        p.prefill_done("claimed", np.array([3, 4]))
        p.prefill_done("unclaimed", np.array([5, 6]))     # the control
        time.sleep(3 * LEASE_S)                           # the decode engine had no blocks
        (expired,) = drain_released(p, 1)
        assert (expired.request_id, expired.reason) == ("unclaimed",
                                                        ReleaseReason.LEASE_EXPIRED)
        handle = c.expect("claimed", np.array([8, 9]), name, timeout=10)
        assert handle.xid == xid                          # the registration continues it
        assert handle.wait(10).state is RequestState.READY
        check_blocks(dst, np.array([8, 9]), np.array([3, 4]), 5)
        (done,) = drain_released(p, 1)
        assert (done.request_id, done.reason) == ("claimed", ReleaseReason.TRANSFERRED)
        late = c.expect("unclaimed", np.array([10, 11]), name, timeout=10).wait(10)
        # fails fast: its lease ended
        assert late.state is RequestState.TIMED_OUT and late.elapsed_s < 2.0


def test_claim_push_needs_a_connected_producer() -> None:
    with kvpush.Consumer(make_cache(num_blocks=4).layout) as c:
        with pytest.raises(kvpush.PeerUnavailable, match="connect first"):
            c.claim_push("r", "nobody")
        with pytest.raises(ValueError, match="at least one producer"):
            c.claim_push("r", [])


@pytest.mark.parametrize("how", ["abort", "close"])
def test_a_push_claim_given_up_releases_the_source(how: str) -> None:
    src, dst = make_cache(num_blocks=8), make_cache(num_blocks=8)
    config = kvpush.ProducerConfig(lease_s=LEASE_S)
    with kvpush.Producer(src.layout, config) as p:
        c = kvpush.Consumer(dst.layout)
        try:
            name = c.connect(p.address, timeout=10)
            c.claim_push("r", name)
            p.prefill_done("r", np.array([1, 2]))
            time.sleep(2 * LEASE_S)
            assert p.get_released() == []                 # held for the claimer
            if how == "abort":
                c.abort("r", "the request ended on the decode side")
            else:
                c.close()
            (release,) = drain_released(p, 1, timeout=10)
            assert release.reason is not ReleaseReason.TRANSFERRED and release.blocks_safe
        finally:
            c.close()


def test_a_claim_over_two_ranks_given_up_when_one_closes_releases_the_other() -> None:
    """A push claimed over two producer ranks (tensor parallel) whose one rank closes: the
    consumer gives the claim up, and tells the other rank, which lets its prefilled source
    go at once instead of holding it for ``max_wait_s``."""
    config = kvpush.ProducerConfig(lease_s=LEASE_S, max_wait_s=60.0)
    src0, src1, dst = make_cache(num_blocks=8), make_cache(num_blocks=8), \
        make_cache(num_blocks=8)
    with kvpush.Producer(src0.layout, config) as rank0, \
            kvpush.Producer(src1.layout, config) as rank1, \
            kvpush.Consumer(dst.layout, kvpush.ConsumerConfig(heartbeat_s=0.2)) as c:
        names = [c.connect(rank0.address, timeout=10), c.connect(rank1.address, timeout=10)]
        c.claim_push("r", names)
        time.sleep(0.3)                                   # the Claims are on their way
        rank0.prefill_done("r", np.array([1, 2]))
        rank1.prefill_done("r", np.array([1, 2]))
        time.sleep(2 * LEASE_S)
        assert rank0.get_released() == []                 # held for the claimer
        rank1.close()
        (release,) = drain_released(rank0, 1, timeout=10)
        assert (release.request_id, release.reason) == ("r", ReleaseReason.ABORTED)
        assert release.blocks_safe


def _claiming_consumer(conn: Any, address: str) -> None:
    dst = make_cache(num_blocks=8)
    with kvpush.Consumer(dst.layout, kvpush.ConsumerConfig(heartbeat_s=0.2)) as c:
        name = c.connect(address, timeout=20)
        c.claim_push("r", name)
        conn.send("claimed")
        conn.poll(60)   # SIGKILLed by the test long before


def test_a_push_claimer_that_dies_releases_the_source() -> None:
    src = make_cache(num_blocks=8)
    config = kvpush.ProducerConfig(lease_s=LEASE_S, peer_timeout_s=1.5)
    with kvpush.Producer(src.layout, config) as p:
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_claiming_consumer, args=(child, p.address), daemon=True)
        proc.start()
        try:
            assert conn.poll(60) and conn.recv() == "claimed"
            time.sleep(0.3)                               # the Claim is on its way
            p.prefill_done("r", np.array([1, 2]))
            time.sleep(2 * LEASE_S)
            assert p.get_released() == []                 # alive: held past the lease
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGKILL)
            (release,) = drain_released(p, 1, timeout=15)  # silent past peer_timeout_s
            assert release.reason is ReleaseReason.FAILED
            assert "consumer lost" in release.detail
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
