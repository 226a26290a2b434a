"""Tensor parallelism through the connector's halves, without servers: every prefill rank
and every decode rank is its own process with its own kvpush endpoint (``tp_ranks.py``),
driven by the scheduler halves the way vLLM drives them. Same-size TP (rank r <-> rank r),
heterogeneous TP both ways, and MQA (one KV head) where TP exceeds the head count, so the
prefill ranks replicate it and only one sends; push and pull; every head of every moved
block checked byte for byte on every decode rank, and every prefill rank's blocks handed
back to vLLM once. Then the decode side holding a pull or a push past the prefill's lease
(claimed), a decode side that dies while it holds a claim, and the preemption race (item 7).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from test_adapter_units import Blocks, request, scheduler
from tp_ranks import Rank

from kvpush.integrations.vllm_common import AdapterConfig, decode_params, prefill_params
from kvpush.integrations.vllm_scheduler import KVPushScheduler, RankInfo
from kvpush.layout import tp_routes

PROMPT = 100                     # tokens: 4 blocks of 32
_ids = itertools.count()


@contextlib.contextmanager
def ranks(role: str, tp: int, total: int, **config: Any) -> Iterator[list[Rank]]:
    started: list[Rank] = []
    try:
        for r in range(tp):
            started.append(Rank(role, r, tp, total, **config))
        yield started
    finally:
        for rank in started:
            rank.stop()


def prefill_side(prefill: list[Rank], **config: Any) -> KVPushScheduler:
    s = scheduler("kv_producer")
    s.config = AdapterConfig(**config)
    s.set_handshake({r.tp_rank: RankInfo(**r.info) for r in prefill})
    return s


def step_all(group: list[Rank], plan: Any, finished: set[str] = frozenset()) -> None:
    for rank in group:
        rank.call("step", (plan, set(finished)))


def wait_reported(group: list[Rank], req_id: str, which: int, finished: set[str] = frozenset(),
                  timeout: float = 20.0) -> dict[int, set[int]]:
    """Step every rank until each has reported ``req_id`` (which=0: finished_sending, 1:
    finished_recving), in this call or an earlier step; returns each rank's load errors."""
    deadline = time.monotonic() + timeout
    while True:
        left = [r for r in group if req_id not in r.reported[which]]
        if not left:
            break
        assert time.monotonic() < deadline, \
            f"ranks {[r.tp_rank for r in left]} never reported {req_id}"
        for rank in left:
            rank.call("poll", set(finished))
        time.sleep(0.02)
    return {r.tp_rank: r.call("errors") for r in group}


class Flow:
    """One request through both halves: prefill scheduler + ranks, decode scheduler +
    ranks."""

    def __init__(self, prefill: list[Rank], decode: list[Rank], **prefill_config: Any) -> None:
        self.prefill, self.decode = prefill, decode
        self.p = prefill_side(prefill, **prefill_config)
        self.d = scheduler("kv_consumer")

    def run_prefill(self, tid: str, mode: str, src: list[int]) -> tuple[Any, dict[str, Any]]:
        rid = f"p-{tid}"
        r = request(rid, prefill_params(tid, mode), PROMPT)
        self.p.on_new_request(r)
        self.p._kv_manager.blocks[rid] = src
        plan = self.p.build_plan(SimpleNamespace(num_scheduled_tokens={rid: PROMPT}))
        assert [s.transfer_id for s in plan.send] == [f"{tid}#{PROMPT}"]
        step_all(self.prefill, plan)
        r.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
        delay, out = self.p.request_finished(r, src)
        assert delay and out is not None
        return r, out

    def arrive(self, tid: str, params: dict[str, Any]) -> Any:
        """The decode request reaches the decode scheduler (no blocks yet)."""
        r = request(f"d-{tid}", params, PROMPT)
        self.d.on_new_request(r)
        return r

    def allocate(self, r: Any, dst: list[int]) -> None:
        assert self.d.get_num_new_matched_tokens(r, 0) == (PROMPT, True)
        self.d.update_state_after_alloc(r, Blocks(dst), PROMPT)
        step_all(self.decode, self.d.build_plan(SimpleNamespace(num_scheduled_tokens={})))

    def check(self, dst: list[int], src: list[int]) -> None:
        for rank in self.decode:
            assert rank.call("check", (dst, src)) == [], f"decode rank {rank.tp_rank}"


SHAPES = [  # (prefill TP, decode TP, KV heads)
    (2, 2, 2),     # same size: rank r <-> rank r
    (2, 1, 2),     # the decode rank reads both halves of each block
    (1, 2, 2),     # both decode ranks share one source
    (2, 1, 1),     # MQA: prefill TP above the KV head count; rank 1's replica is not sent
    (1, 2, 1),     # MQA: decode TP above the KV head count; both decode ranks get the head
]


@pytest.mark.parametrize(("p_tp", "d_tp", "total"), SHAPES)
def test_tp_shapes_push_and_pull_exact_bytes(p_tp: int, d_tp: int, total: int) -> None:
    routes = tp_routes(p_tp, d_tp, total)
    with ranks("kv_producer", p_tp, total) as prefill, ranks("kv_consumer", d_tp, total) as dec:
        flow = Flow(prefill, dec)
        for mode in ("push", "pull"):
            tid = f"{mode}-{p_tp}{d_tp}{total}-{next(_ids)}"
            src, dst = [9, 3, 4, 12], [1, 7, 8, 2]
            if mode == "push":  # registered before the prefill ends, as the router does
                r = flow.arrive(tid, decode_params(tid, [p.info["address"] for p in prefill]))
                flow.allocate(r, dst)
                rp, _ = flow.run_prefill(tid, mode, src)
            else:  # the decode request carries the prefill's answer
                rp, out = flow.run_prefill(tid, mode, src)
                r = flow.arrive(tid, out)
                flow.allocate(r, dst)
            errors = wait_reported(dec, r.request_id, 1)
            assert errors == {d: set() for d in range(d_tp)}, (mode, errors)
            flow.check(dst, src)
            # Each prefill rank's blocks go back to vLLM once every sharer is done (a
            # replica nobody reads, at once).
            wait_reported(prefill, rp.request_id, 0, finished={rp.request_id})
            for rank in prefill:
                assert rank.call("pending") == 0, (mode, rank.tp_rank)
            assert [routes.sends(p) for p in range(p_tp)] == [p % max(1, p_tp // total) == 0
                                                               for p in range(p_tp)]


def test_a_claimed_pull_outlives_the_prefill_lease() -> None:
    """The decode request waits for blocks (memory pressure) longer than the prefill's
    lease: it claimed the prefill's blocks as soon as it arrived, so its READ still finds
    them. The same wait without the claim finds them released."""
    lease = 2.5     # the consumer starts no READ with under 1 s of lease left
    with ranks("kv_producer", 1, 2, lease_s=lease) as prefill, \
            ranks("kv_consumer", 1, 2) as dec:
        flow = Flow(prefill, dec, lease_s=lease)
        src, dst = [5, 6, 7, 8], [11, 12, 13, 14]
        tid = f"claimed-{next(_ids)}"
        rp, out = flow.run_prefill(tid, "pull", src)
        r = flow.arrive(tid, out)
        plan = flow.d.build_plan(SimpleNamespace(num_scheduled_tokens={}))
        assert [c.req_id for c in plan.claims] == [r.request_id] and not plan.recv
        step_all(dec, plan)
        time.sleep(lease * 2.2)     # queued behind others, well past the lease
        prefill[0].call("poll", {rp.request_id})
        assert rp.request_id not in prefill[0].reported[0]
        assert prefill[0].call("pending") == 1
        flow.allocate(r, dst)
        assert wait_reported(dec, r.request_id, 1) == {0: set()}
        flow.check(dst, src)
        wait_reported(prefill, rp.request_id, 0, finished={rp.request_id})
        # Without the claim (the request never announced), the lease ends the source.
        tid = f"unclaimed-{next(_ids)}"
        rp, out = flow.run_prefill(tid, "pull", src)
        time.sleep(lease * 2.2)
        wait_reported(prefill, rp.request_id, 0, finished={rp.request_id})
        r = request(f"d-{tid}", out, PROMPT)
        flow.allocate(r, dst)
        assert wait_reported(dec, r.request_id, 1) == {0: set(dst)}  # a load error


def test_a_dead_claimer_releases_the_prefill_blocks() -> None:
    """The decode side dies while its claim holds the prefill's blocks: the prefill
    releases them once the decode's heartbeats stop (peer timeout), not at max_wait_s."""
    fast = dict(lease_s=2.5, heartbeat_s=0.25, peer_timeout_s=1.5, max_wait_s=600.0)
    with ranks("kv_producer", 1, 2, **fast) as prefill, \
            ranks("kv_consumer", 1, 2, heartbeat_s=0.25, peer_timeout_s=1.5) as dec:
        flow = Flow(prefill, dec, **fast)
        tid = f"dies-{next(_ids)}"
        rp, out = flow.run_prefill(tid, "pull", [1, 2, 3, 4])
        flow.arrive(tid, out)
        step_all(dec, flow.d.build_plan(SimpleNamespace(num_scheduled_tokens={})))
        time.sleep(3.5)             # past the lease: only the claim holds the blocks
        assert prefill[0].call("pending") == 1
        start = time.monotonic()
        dec[0].kill()
        wait_reported(prefill, rp.request_id, 0, finished={rp.request_id}, timeout=15)
        assert prefill[0].call("pending") == 0
        assert time.monotonic() - start < 10


def _announce_push(flow: Flow, tid: str) -> Any:
    """A push request reaches the decode scheduler with no blocks for it: its claim goes
    out (the connection completes on a later step's poll, as vLLM's steps go on)."""
    r = flow.arrive(tid, decode_params(tid, [p.info["address"] for p in flow.prefill]))
    plan = flow.d.build_plan(SimpleNamespace(num_scheduled_tokens={}))
    assert [c.req_id for c in plan.claims] == [r.request_id] and not plan.recv
    step_all(flow.decode, plan)
    for _ in range(25):
        for rank in flow.decode:
            rank.call("poll", set())
        time.sleep(0.02)
    return r


def test_a_claimed_push_outlives_the_prefill_lease() -> None:
    """Issue 14, leases renewed (push): the decode request waits for blocks longer than the
    prefill's lease; it claimed the push when it arrived, so the WRITE still finds the
    source when its blocks come. The same wait without the claim fails the load."""
    lease = 1.5
    with ranks("kv_producer", 1, 2, lease_s=lease) as prefill, \
            ranks("kv_consumer", 1, 2) as dec:
        flow = Flow(prefill, dec, lease_s=lease)
        src, dst = [5, 6, 7, 8], [11, 12, 13, 14]
        tid = f"claimed-push-{next(_ids)}"
        r = _announce_push(flow, tid)
        rp, _ = flow.run_prefill(tid, "push", src)
        time.sleep(lease * 2.2)     # queued behind others, well past the lease
        prefill[0].call("poll", {rp.request_id})
        assert rp.request_id not in prefill[0].reported[0]
        assert prefill[0].call("pending") == 1
        flow.allocate(r, dst)
        assert wait_reported(dec, r.request_id, 1) == {0: set()}
        flow.check(dst, src)
        wait_reported(prefill, rp.request_id, 0, finished={rp.request_id})
        # Without the claim (vLLM had not seen the request), the lease ends the source.
        tid = f"unclaimed-push-{next(_ids)}"
        rp, _ = flow.run_prefill(tid, "push", src)
        time.sleep(lease * 2.2)
        wait_reported(prefill, rp.request_id, 0, finished={rp.request_id})
        r = request(f"d-{tid}", decode_params(tid, [prefill[0].info["address"]]), PROMPT)
        flow.allocate(r, dst)
        assert wait_reported(dec, r.request_id, 1) == {0: set(dst)}  # a load error


def test_a_dead_push_claimer_releases_the_prefill_blocks() -> None:
    fast = dict(lease_s=1.5, heartbeat_s=0.25, peer_timeout_s=1.5, max_wait_s=600.0)
    with ranks("kv_producer", 1, 2, **fast) as prefill, \
            ranks("kv_consumer", 1, 2, heartbeat_s=0.25, peer_timeout_s=1.5) as dec:
        flow = Flow(prefill, dec, **fast)
        tid = f"dies-push-{next(_ids)}"
        _announce_push(flow, tid)
        rp, _ = flow.run_prefill(tid, "push", [1, 2, 3, 4])
        time.sleep(2.5)             # past the lease: only the claim holds the blocks
        assert prefill[0].call("pending") == 1
        start = time.monotonic()
        dec[0].kill()
        wait_reported(prefill, rp.request_id, 0, finished={rp.request_id}, timeout=15)
        assert prefill[0].call("pending") == 0
        assert time.monotonic() - start < 10


@pytest.mark.parametrize("attempt", range(3))
def test_preempted_prefill_keeps_its_blocks_until_no_write_can_read_them(attempt: int) -> None:
    """A WRITE of 48 blocks starts right after the prefill's forward; in the next step vLLM
    preempts the request and drops its hold on the blocks. The worker aborts the transfer
    without waiting; the blocks stay pinned (vLLM cannot hand them out) until the rank
    reports that nothing reads them, and only then are they reused (overwritten); the
    decode side gets either the true bytes or a failed load, never the overwritten ones;
    and the preempted request is never reported finished_sending."""
    with ranks("kv_producer", 1, 2, blocks=64) as prefill, \
            ranks("kv_consumer", 1, 2, blocks=64) as dec:
        flow = Flow(prefill, dec)
        src, dst = list(range(8, 56)), list(range(0, 48))
        tid = f"race-{attempt}-{next(_ids)}"
        r = request(f"d-{tid}", decode_params(tid, [prefill[0].info["address"]]), 48 * 32)
        flow.d.on_new_request(r)
        flow.d.update_state_after_alloc(r, Blocks(dst), 48 * 32)
        step_all(dec, flow.d.build_plan(SimpleNamespace(num_scheduled_tokens={})))
        time.sleep(0.3)             # the registration is at the producer
        rid = f"p-{tid}"
        rp = request(rid, prefill_params(tid, "push"), 48 * 32)
        flow.p.on_new_request(rp)
        flow.p._kv_manager.blocks[rid] = src
        plan = flow.p.build_plan(SimpleNamespace(num_scheduled_tokens={rid: 48 * 32}))
        assert not flow.p.has_pending_block_frees()   # vLLM may preempt it for blocks
        pool = flow.p._kv_manager.block_pool
        assert pool.held() == src                 # the blocks the transfer reads are pinned
        step_all(prefill, plan)                   # forward + prefill_done: the WRITE goes
        plan = flow.p.build_plan(SimpleNamespace(num_scheduled_tokens={},
                                                 preempted_req_ids={rid}))
        assert plan.send_preempted == [(rid, f"{tid}#{48 * 32}")]
        start = time.monotonic()
        step_all(prefill, plan)                   # the abort: nothing waits for the WRITE
        assert time.monotonic() - start < 2.0
        assert flow.p.has_pending_block_frees() and pool.held() == src
        ended: list[str] = []
        deadline = time.monotonic() + 30
        while not ended:
            assert time.monotonic() < deadline, "the preempted transfer never ended"
            prefill[0].call("poll", set())
            ended = prefill[0].call("ended")
            time.sleep(0.01)
        assert ended == [plan.send_preempted[0][1]]
        assert prefill[0].call("pending") == 0    # reported once nothing reads the blocks
        flow.p.update_connector_output(SimpleNamespace(
            finished_sending=None, finished_recving=None,
            kv_connector_worker_meta=SimpleNamespace(ended={ended[0]: 1})))
        assert pool.held() == [] and not flow.p.has_pending_block_frees()
        prefill[0].call("scribble", src)          # vLLM hands them out again
        errors = wait_reported(dec, r.request_id, 1)
        if not errors[0]:                         # landed before the abort: the true bytes
            assert dec[0].call("check", (dst, src)) == []
        prefill[0].call("poll", {rid})
        assert rid not in prefill[0].reported[0]  # vLLM freed them itself: never reported
        # The request is recomputed and may hand off again, under a fresh source use.
        again = flow.p.build_plan(SimpleNamespace(num_scheduled_tokens={rid: 48 * 32}))
        assert [s.transfer_id for s in again.send] == [f"{tid}#{48 * 32}"]
        assert again.send[0].sid != plan.send[0].sid if plan.send else True
        assert not flow.p.has_pending_block_frees()
