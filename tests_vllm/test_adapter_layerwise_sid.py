"""The prefill worker names its source use in every Producer call: each layer it hands over
goes to ``Producer.layer_done`` with the same ``sid`` its ``prefill_done`` gets, so the core
binds the layers and the whole request to one use; an abort of a planned send names that
use too (in-process, real Producer; the calls are only observed, then made)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpush.integrations.vllm_common import (
    AdapterConfig,
    EngineFacts,
    RankCoords,
    SendPlan,
    StepPlan,
)
from kvpush.request import TransferMode

torch = pytest.importorskip("torch")

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 2, 8, 32, 2, 16


def _worker(layerwise: bool) -> Any:
    from kvpush.integrations.vllm_worker import KVPushWorker

    caches = {f"model.layers.{i}.self_attn.attn":
              torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16)
              for i in range(LAYERS)}
    facts = EngineFacts(attn_backend="CPU_ATTN", kv_cache_layout="LBHNC", cache_dtype="auto",
                        total_kv_heads=HEADS, identity=(("model", "tiny-sid"),))
    worker = KVPushWorker(AdapterConfig(layerwise=layerwise), "kv_producer", "e-sid", BLOCK,
                          BLOCKS)
    worker.register_kv_caches(caches, coords=RankCoords(), facts=facts)
    return worker, caches


def test_layer_done_passes_the_sends_sid() -> None:
    worker, caches = _worker(layerwise=True)
    try:
        assert worker.producer is not None
        calls: list[tuple[str, int, Any]] = []
        real = worker.producer.layer_done

        def observed(request_id: str, block_ids: Any, layer: int, *,
                     sid: int | None = None) -> None:
            calls.append((request_id, layer, sid))
            real(request_id, block_ids, layer, sid=sid)

        worker.producer.layer_done = observed  # type: ignore[method-assign]
        plan = StepPlan(send=[SendPlan("req-1", "t-1", TransferMode.PUSH, [3, 4], sid=987654)])
        worker.bind(plan)
        for name in caches:
            worker.save_layer(name)
        worker.after_forward()
        assert calls == [("t-1", 0, 987654), ("t-1", 1, 987654)]
    finally:
        worker.shutdown()


def test_an_abort_names_the_use_the_scheduler_planned() -> None:
    """A send the scheduler planned is aborted by its sid (a later use of its transfer id,
    a retry begun meanwhile, is left alone); one it never planned, by the id alone."""
    worker, _ = _worker(layerwise=False)
    try:
        assert worker.producer is not None
        calls: list[tuple[str, int | None]] = []
        real = worker.producer.abort

        def observed(request_id: str, reason: str = "", *, sid: int | None = None) -> None:
            calls.append((request_id, sid))
            real(request_id, reason, sid=sid)

        worker.producer.abort = observed  # type: ignore[method-assign]
        worker.bind(StepPlan(send_aborts=[("t-1", 987654), ("t-2", 0)]))
        assert calls == [("t-1", 987654), ("t-2", None)]
    finally:
        worker.shutdown()
