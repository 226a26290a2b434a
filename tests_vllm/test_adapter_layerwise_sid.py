"""Layer-wise push names its source use: each layer the prefill rank hands over goes to
``Producer.layer_done`` with the same ``sid`` its ``prefill_done`` gets, so the core binds
the layers and the whole request to one use (in-process, real Producer; the call is only
observed, then made)."""

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


def test_layer_done_passes_the_sends_sid() -> None:
    from kvpush.integrations.vllm_worker import KVPushWorker

    caches = {f"model.layers.{i}.self_attn.attn":
              torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16)
              for i in range(LAYERS)}
    facts = EngineFacts(attn_backend="CPU_ATTN", kv_cache_layout="LBHNC", cache_dtype="auto",
                        total_kv_heads=HEADS, identity=(("model", "tiny-sid"),))
    worker = KVPushWorker(AdapterConfig(layerwise=True), "kv_producer", "e-sid", BLOCK, BLOCKS)
    worker.register_kv_caches(caches, coords=RankCoords(), facts=facts)
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
