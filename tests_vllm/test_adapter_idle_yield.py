"""An engine step with no forward pass waits for kvpush (a result or release queued, or
``AdapterConfig.idle_yield_s`` passed), only while a request is pending on that side; why,
and its measured effect: ``docs/VLLM.md`` ("Why ``idle_yield_s``")."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from test_adapter_deploy import cpu_caches, facts
from test_adapter_units import scheduler

import kvpush
from kvpush.integrations import vllm_worker
from kvpush.integrations.vllm_common import AdapterConfig, RecvPlan, RemotePrefill, StepPlan
from kvpush.integrations.vllm_worker import KVPushWorker


def test_an_idle_step_waits_only_while_a_request_is_pending(
        monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[tuple[int, float]] = []   # (descriptors waited on, bound)
    monkeypatch.setattr(vllm_worker, "_wait", lambda fds, t: waits.append((len(fds), t)))
    prefill = KVPushWorker(AdapterConfig(), "kv_producer", "p", 32, 16)
    decode = KVPushWorker(AdapterConfig(), "kv_consumer", "d", 32, 16)
    quiet = KVPushWorker(AdapterConfig(idle_yield_s=0), "kv_consumer", "q", 32, 16)
    try:
        for w in (prefill, decode, quiet):
            w.register_kv_caches(cpu_caches(blocks=16), facts=facts())
        decode.bind(StepPlan(idle=True))
        decode.get_finished(set())
        assert waits == []                      # nothing pending: vLLM's step as it was
        remote = RemotePrefill("t1", kvpush.TransferMode.PUSH, (prefill.address,), ())
        decode.bind(StepPlan(recv=[RecvPlan("req-1", remote, [1, 2], report=True)],
                             idle=True))
        assert decode.consumer is not None
        deadline = time.monotonic() + 10
        while decode.consumer.pending != 1 and time.monotonic() < deadline:
            decode.get_finished(set())          # idle steps while the handshake runs
            time.sleep(0.01)
        assert decode.consumer.pending == 1     # registered: a push awaited
        assert set(waits) <= {(0, vllm_worker.SHORT_YIELD_S)}  # handshake: short sleeps
        waits.clear()
        decode.get_finished(set())
        assert waits == [(1, 50e-6)]             # ... and no forward: wait for the result
        decode.bind(StepPlan(idle=False))
        decode.get_finished(set())
        assert waits == [(1, 50e-6)]             # a forward pass never waits
        quiet.bind(StepPlan(recv=[RecvPlan("req-2", RemotePrefill(
            "t2", kvpush.TransferMode.PUSH, (prefill.address,), ()), [3], report=True)],
            idle=True))
        quiet.get_finished(set())
        assert waits == [(1, 50e-6)]             # turned off
    finally:
        for w in (quiet, decode, prefill):
            w.shutdown()


@pytest.mark.parametrize("reuse_wait_s", [0.005, 0.0])
def test_an_idle_step_waits_longer_for_a_kept_turns_load(
        monkeypatch: pytest.MonkeyPatch, reuse_wait_s: float) -> None:
    """A kept turn's KV exists, so its load ends within a transfer's time: an idle step
    waits for it up to reuse_wait_s, and vLLM learns it ended in that step."""
    waits: list[tuple[int, float]] = []
    monkeypatch.setattr(vllm_worker, "_wait", lambda fds, t: waits.append((len(fds), t)))
    source = KVPushWorker(AdapterConfig(), "kv_producer", "d", 32, 16)
    prefill = KVPushWorker(AdapterConfig(reuse_wait_s=reuse_wait_s), "kv_consumer", "p",
                           32, 16)
    try:
        for w in (source, prefill):
            w.register_kv_caches(cpu_caches(blocks=16), facts=facts())
        remote = RemotePrefill("reuse.1", kvpush.TransferMode.PUSH, (source.address,), ())
        prefill.bind(StepPlan(recv=[RecvPlan("req-1", remote, [1, 2], report=True,
                                             kept=True)], idle=True))
        assert prefill.consumer is not None
        deadline = time.monotonic() + 10
        while prefill.consumer.pending != 1 and time.monotonic() < deadline:
            prefill.get_finished(set())
            time.sleep(0.01)
        assert prefill.consumer.pending == 1
        waits.clear()
        prefill.get_finished(set())
        assert waits == [(1, reuse_wait_s or 50e-6)]
        prefill.bind(StepPlan(idle=False))
        prefill.get_finished(set())
        assert waits == [(1, reuse_wait_s or 50e-6)]   # a forward pass never waits
    finally:
        for w in (prefill, source):
            w.shutdown()


def test_the_wait_ends_when_a_result_is_queued() -> None:
    """The descriptor an idle step waits on is an endpoint's: readable once something is
    queued, so the wait ends then, not at its bound (here far beyond the test's)."""
    from kvpush.aio import DrainQueue

    queue: DrainQueue[int] = DrainQueue()
    queue.put(1)
    t0 = time.monotonic()
    vllm_worker._wait([queue.fileno()], 30.0)
    assert time.monotonic() - t0 < 5.0
    assert queue.take() == [1]
    t0 = time.monotonic()
    vllm_worker._wait([queue.fileno()], 0.05)  # drained: nothing to wake it
    assert time.monotonic() - t0 >= 0.04


def test_idle_yield_is_bounded() -> None:
    with pytest.raises(ValueError, match="idle_yield_s"):
        AdapterConfig(idle_yield_s=0.5)
    with pytest.raises(ValueError, match="idle_yield_s"):
        AdapterConfig.from_extra_config({"idle_yield_s": -1})
    with pytest.raises(ValueError, match="reuse_wait_s"):
        AdapterConfig(reuse_wait_s=0.5)


@pytest.mark.parametrize(("output", "idle"), [
    (SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={}), True),
    (SimpleNamespace(total_num_scheduled_tokens=7, num_scheduled_tokens={"r": 7}), False),
    (SimpleNamespace(num_scheduled_tokens={}), True),
    (SimpleNamespace(num_scheduled_tokens={"r": 1}), False),
    (SimpleNamespace(), False),                 # not said: never assumed idle
])
def test_the_scheduler_marks_steps_without_tokens_idle(output: object, idle: bool) -> None:
    assert scheduler("kv_consumer").build_plan(output).idle is idle
