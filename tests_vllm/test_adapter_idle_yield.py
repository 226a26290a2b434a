"""An engine step with no forward pass yields the GIL to kvpush's loop, only while a
transfer is pending on that side (``AdapterConfig.idle_yield_s``; why, and its measured
effect: ``benchmarks/spinning_engine.py``)."""

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


def test_an_idle_step_yields_only_while_a_transfer_is_pending(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(vllm_worker, "_sleep", sleeps.append)
    prefill = KVPushWorker(AdapterConfig(), "kv_producer", "p", 32, 16)
    decode = KVPushWorker(AdapterConfig(), "kv_consumer", "d", 32, 16)
    quiet = KVPushWorker(AdapterConfig(idle_yield_s=0), "kv_consumer", "q", 32, 16)
    try:
        for w in (prefill, decode, quiet):
            w.register_kv_caches(cpu_caches(blocks=16), facts=facts())
        decode.bind(StepPlan(idle=True))
        decode.get_finished(set())
        assert sleeps == []                     # nothing pending: vLLM's step as it was
        remote = RemotePrefill("t1", kvpush.TransferMode.PUSH, (prefill.address,), ())
        decode.bind(StepPlan(recv=[RecvPlan("req-1", remote, [1, 2], report=True)],
                             idle=True))
        assert decode.consumer is not None
        deadline = time.monotonic() + 10
        while decode.consumer.pending != 1 and time.monotonic() < deadline:
            decode.get_finished(set())          # idle steps while the handshake runs
            time.sleep(0.01)
        assert decode.consumer.pending == 1     # registered: a push awaited
        sleeps.clear()
        decode.get_finished(set())
        assert sleeps == [50e-6]                # ... and no forward: this step yields once
        decode.bind(StepPlan(idle=False))
        decode.get_finished(set())
        assert sleeps == [50e-6]                # a forward pass lets go of the GIL itself
        quiet.bind(StepPlan(recv=[RecvPlan("req-2", RemotePrefill(
            "t2", kvpush.TransferMode.PUSH, (prefill.address,), ()), [3], report=True)],
            idle=True))
        quiet.get_finished(set())
        assert sleeps == [50e-6]                # turned off
    finally:
        for w in (quiet, decode, prefill):
            w.shutdown()


def test_idle_yield_is_bounded() -> None:
    with pytest.raises(ValueError, match="idle_yield_s"):
        AdapterConfig(idle_yield_s=0.5)
    with pytest.raises(ValueError, match="idle_yield_s"):
        AdapterConfig.from_extra_config({"idle_yield_s": -1})


@pytest.mark.parametrize(("output", "idle"), [
    (SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={}), True),
    (SimpleNamespace(total_num_scheduled_tokens=7, num_scheduled_tokens={"r": 7}), False),
    (SimpleNamespace(num_scheduled_tokens={}), True),
    (SimpleNamespace(num_scheduled_tokens={"r": 1}), False),
    (SimpleNamespace(), False),                 # not said: never assumed idle
])
def test_the_scheduler_marks_steps_without_tokens_idle(output: object, idle: bool) -> None:
    assert scheduler("kv_consumer").build_plan(output).idle is idle
