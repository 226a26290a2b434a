"""Preemption on the prefill instance: vLLM may preempt while kvpush holds hand-offs, the blocks
a transfer reads stay pinned in vLLM's block pool until every rank says nothing reads them,
and the worker never waits for a transfer to end (scheduler side with stand-ins for vLLM's
objects; worker side with a stand-in Producer that answers when the test says)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
from test_adapter_units import Manager, request, scheduler

import kvpush
from kvpush.integrations import vllm_scheduler
from kvpush.integrations.vllm import KVPushWorkerMetadata
from kvpush.integrations.vllm_common import AdapterConfig, StepPlan, prefill_params
from kvpush.integrations.vllm_scheduler import KVPushScheduler, RankInfo
from kvpush.integrations.vllm_worker import KVPushWorker

FINISHED = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")


def prefill_side(ranks: int = 1, **config: Any) -> KVPushScheduler:
    s = scheduler("kv_producer")
    s.config = AdapterConfig(**config)
    s.set_handshake({r: RankInfo("producer", f"p{r}", f"tcp://127.0.0.1:{9 + r}")
                     for r in range(ranks)})
    return s


def plan_send(s: KVPushScheduler, req_id: str, blocks: list[int], mode: str = "push") -> Any:
    r = request(req_id, prefill_params(f"t-{req_id}", mode), 32 * len(blocks))
    s.on_new_request(r)
    s._kv_manager.blocks[req_id] = blocks
    (send,) = s.build_plan(SimpleNamespace(num_scheduled_tokens={req_id: 32 * len(blocks)})
                           ).send
    return r, send


def preempt(s: KVPushScheduler, req_id: str) -> Any:
    return s.build_plan(SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids={req_id}))


def report(s: KVPushScheduler, *per_rank: list[str]) -> None:
    """What vLLM hands the scheduler side: every rank's worker metadata, aggregated."""
    metas = [KVPushWorkerMetadata({t: 1 for t in ended}) for ended in per_rank]
    meta = metas[0]
    for other in metas[1:]:
        meta = meta.aggregate(other)
    s.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving=None,
                                              kv_connector_worker_meta=meta))


# -- scheduler side --------------------------------------------------------------------------
def test_prefill_instance_may_preempt_while_it_holds_hand_offs() -> None:
    s = prefill_side()
    pool = s._kv_manager.block_pool
    plan_send(s, "p1", [1, 2, 3])                    # still running in vLLM
    leased, _ = plan_send(s, "p2", [4, 5], "pull")   # finished: waits for its decode
    leased.status = FINISHED
    assert s.request_finished(leased, [4, 5])[0]
    # Neither comes back soon on its own: vLLM preempts as it would without kvpush...
    assert not s.has_pending_block_frees()
    # ... and their blocks stay out of its free queue while a transfer may read them.
    assert pool.held() == [1, 2, 3, 4, 5]
    s.update_connector_output(SimpleNamespace(finished_sending={"p2"}, finished_recving=None))
    assert pool.held() == [1, 2, 3]


def test_preempted_send_stays_pinned_until_every_rank_reports_its_end() -> None:
    s = prefill_side(ranks=2)
    pool = s._kv_manager.block_pool
    r, send = plan_send(s, "p1", [7, 8, 9])
    plan = preempt(s, "p1")
    assert plan.send_preempted == [("p1", send.transfer_id)]
    # vLLM dropped the request's hold; kvpush's pin keeps the blocks until the end is known.
    assert pool.held() == [7, 8, 9] and s.has_pending_block_frees() and s.has_pending_work()
    # recomputed meanwhile: not exported again while the old transfer is ending
    assert s.build_plan(SimpleNamespace(num_scheduled_tokens={"p1": 96})).send == []
    report(s, [send.transfer_id], [])                # one rank of two
    assert pool.held() == [7, 8, 9]
    report(s, [], [send.transfer_id])
    assert pool.held() == [] and not s.has_pending_block_frees()
    # Later, recomputed again: it may hand off again.
    r.num_computed_tokens = 0
    s.on_new_request(r)
    (again,) = s.build_plan(SimpleNamespace(num_scheduled_tokens={"p1": 96})).send
    assert again.transfer_id == send.transfer_id and again.sid != send.sid


def test_every_tensor_parallel_rank_reports_even_without_handshake_metadata() -> None:
    ktc = SimpleNamespace(engine_id="e1", is_kv_producer=True, is_kv_consumer=False)
    s = KVPushScheduler(SimpleNamespace(kv_transfer_config=ktc,
                                        cache_config=SimpleNamespace(block_size=32),
                                        parallel_config=SimpleNamespace(tensor_parallel_size=2)),
                        SimpleNamespace(kv_cache_groups=[object()]), AdapterConfig())
    s.bind_kv_cache_manager(Manager())
    pool = s._kv_manager.block_pool
    _, send = plan_send(s, "p1", [5, 6])
    preempt(s, "p1")
    report(s, [send.transfer_id])
    assert pool.held() == [5, 6]
    report(s, [send.transfer_id])
    assert pool.held() == []


def test_preempted_send_pins_are_bounded_when_a_rank_never_reports(monkeypatch: Any) -> None:
    monkeypatch.setattr(vllm_scheduler, "_ENDING_MARGIN_S", 0.0)
    s = prefill_side(transfer_timeout_s=0.05)
    pool = s._kv_manager.block_pool
    plan_send(s, "p1", [3, 4])
    preempt(s, "p1")
    assert pool.held() == [3, 4]
    time.sleep(0.1)
    s.build_plan(SimpleNamespace(num_scheduled_tokens={}))
    assert pool.held() == [] and not s.has_pending_block_frees()


# -- worker side -----------------------------------------------------------------------------
class SlowProducer:
    """A Producer whose aborted WRITE ends when the test says (``end``)."""

    pending = 1

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.released: list[kvpush.Release] = []

    def abort(self, request_id: str, reason: str = "") -> None:
        self.aborted.append(request_id)

    def get_released(self) -> list[kvpush.Release]:
        out, self.released = self.released, []
        return out

    def end(self, request_id: str, *, blocks_safe: bool = True, quarantine_s: float = 0.0
            ) -> None:
        self.released.append(kvpush.Release(request_id, kvpush.ReleaseReason.ABORTED,
                                            np.array([1, 2]), blocks_safe=blocks_safe,
                                            quarantine_s=quarantine_s))


def producer_worker(**config: Any) -> tuple[KVPushWorker, SlowProducer]:
    worker = KVPushWorker(AdapterConfig(**config), "kv_producer", "e1", 32, 16)
    producer = SlowProducer()
    worker.producer = producer  # type: ignore[assignment]
    return worker, producer


def hand_over(worker: KVPushWorker, req_id: str, transfer_id: str) -> None:
    """The state after_forward leaves a send in: handed to kvpush, not released."""
    worker._issued.add(req_id)
    worker._sending[transfer_id] = req_id


def test_handle_preemptions_never_waits_for_the_transfer() -> None:
    worker, producer = producer_worker(transfer_timeout_s=2.0)
    hand_over(worker, "r1", "t1#64")
    start = time.monotonic()
    worker.handle_preemptions(StepPlan(send_preempted=[("r1", "t1#64")]))
    assert time.monotonic() - start < 0.5          # the WRITE has not ended
    assert producer.aborted == ["t1#64"]
    assert worker.get_finished(set()) == (set(), set()) and worker.take_ended() == []
    producer.end("t1#64")
    sending, _ = worker.get_finished({"r1"})
    assert sending == set()                         # never reported finished_sending
    assert worker.take_ended() == ["t1#64"] and worker.take_ended() == []


def test_an_unsafe_release_of_a_preempted_send_is_reported_after_its_quarantine() -> None:
    worker, producer = producer_worker()
    hand_over(worker, "r1", "t1#64")
    worker.handle_preemptions(StepPlan(send_preempted=[("r1", "t1#64")]))
    producer.end("t1#64", blocks_safe=False, quarantine_s=0.2)
    worker.get_finished(set())
    assert worker.take_ended() == []
    time.sleep(0.25)
    assert worker.take_ended() == ["t1#64"]


def test_a_rank_with_nothing_in_flight_reports_the_end_at_once() -> None:
    worker, producer = producer_worker()
    worker._issued.add("r2")           # a replica rank: nobody reads its blocks
    worker._released.add("r2")
    worker.handle_preemptions(StepPlan(send_preempted=[("r2", "t2#64")]))
    assert producer.aborted == [] and worker.take_ended() == ["t2#64"]
    assert worker.get_finished({"r2"})[0] == set()
