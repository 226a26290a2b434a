"""``AdapterConfig.stage_log``: one line per request stage on each rank, on the clock that
``benchmarks/vllm/stages.py`` lines up with the router's (``time.monotonic``); off by
default."""

from __future__ import annotations

import logging
import time

import pytest
from test_adapter_deploy import cpu_caches, facts

import kvpush
from kvpush.integrations.vllm_common import (
    AdapterConfig,
    RecvPlan,
    RemotePrefill,
    SendPlan,
    StepPlan,
)
from kvpush.integrations.vllm_worker import KVPushWorker


def _push(stage_log: bool, caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, float]]:
    """One push through two workers; the stage lines as (stage, id, time)."""
    prefill = KVPushWorker(AdapterConfig(stage_log=stage_log), "kv_producer", "p", 32, 16)
    decode = KVPushWorker(AdapterConfig(stage_log=stage_log), "kv_consumer", "d", 32, 16)
    caplog.set_level(logging.INFO, logger="kvpush.stages")
    try:
        for w in (prefill, decode):
            w.register_kv_caches(cpu_caches(blocks=16), facts=facts())
        remote = RemotePrefill("t1", kvpush.TransferMode.PUSH, (prefill.address,), ())
        decode.bind(StepPlan(recv=[RecvPlan("req-d", remote, [1, 2], report=True)]))
        deadline = time.monotonic() + 20
        assert decode.consumer is not None
        while decode.consumer.pending != 1 and time.monotonic() < deadline:
            decode.get_finished(set())          # the handshake, then the registration
            time.sleep(0.01)
        prefill.bind(StepPlan(send=[SendPlan("req-p", "t1", kvpush.TransferMode.PUSH,
                                             [3, 4])]))
        prefill.after_forward()
        loaded = sent = False
        while not (loaded and sent) and time.monotonic() < deadline:
            loaded = loaded or "req-d" in decode.get_finished(set())[1]
            sent = sent or "req-p" in prefill.get_finished({"req-p"})[0]
            time.sleep(0.01)
        assert loaded and sent
    finally:
        decode.shutdown()
        prefill.shutdown()
    out = []
    for rec in caplog.records:
        if rec.name == "kvpush.stages":
            words = rec.getMessage().split()
            assert words[:2] == ["kvpush", "stage"] and words[5] == "r0", words
            out.append((words[3], words[4], float(words[2])))
    return out


def test_each_stage_is_logged_once_in_order(caplog: pytest.LogCaptureFixture) -> None:
    lines = _push(True, caplog)
    stages = [s for s, _, _ in lines]
    for stage in ("registered", "send_planned", "prefill_done", "loaded", "reported",
                  "released"):
        assert stages.count(stage) == 1, lines
    at = {s: t for s, _, t in lines}
    assert at["send_planned"] <= at["prefill_done"] <= at["loaded"] <= at["reported"]
    assert at["registered"] <= at["loaded"]
    ids = {s: i for s, i, _ in lines}
    # kvpush's transfer id, except where vLLM is told: its own request id
    assert ids["loaded"] == ids["prefill_done"] == ids["released"] == "t1"
    assert ids["reported"] == "req-d"
    loaded = next(r.getMessage() for r in caplog.records if " loaded " in r.getMessage())
    assert "ready elapsed " in loaded and loaded.endswith("request req-d")


def test_off_by_default(caplog: pytest.LogCaptureFixture) -> None:
    assert AdapterConfig().stage_log is False
    assert _push(False, caplog) == []
