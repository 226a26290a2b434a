"""One worker rank of kvpush's vLLM adapter (no vLLM: CPU tensors shaped like vLLM's CPU
backend cache) with discovery configured, in this process (:func:`worker`) or as a child
process that runs until killed or its stdin closes (``python -m tests.discovery.vllm_rank
ROLE ETCD PREFIX INSTANCE``: prints the record's key and epoch once published)."""

from __future__ import annotations

import sys
from typing import Any

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 2, 16, 32, 2, 16


def worker(role: str, etcd: str, prefix: str, instance: str = "", **config: Any) -> Any:
    """A started :class:`~kvpush.integrations.vllm_worker.KVPushWorker` publishing in
    ``etcd`` under ``prefix`` (TTL 2 s, no drain grace unless ``config`` says)."""
    import torch

    from kvpush.integrations.vllm_common import AdapterConfig, EngineFacts, RankCoords
    from kvpush.integrations.vllm_worker import KVPushWorker

    caches = {f"model.layers.{i}.self_attn.attn":
              torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16)
              for i in range(LAYERS)}
    facts = EngineFacts(attn_backend="CPU_ATTN", kv_cache_layout="LBHNC", cache_dtype="auto",
                        total_kv_heads=HEADS, identity=(("model", "tiny-discovery"),))
    settings: dict[str, Any] = {"discovery_etcd": etcd, "discovery_prefix": prefix,
                                "discovery_instance": instance, "discovery_ttl_s": 2,
                                "discovery_drain_grace_s": 0.0, "lease_s": 30.0}
    settings.update(config)
    w = KVPushWorker(AdapterConfig(**settings), role, f"e-{role}", BLOCK, BLOCKS)
    w.caches = caches  # kept alive with the worker: kvpush registered their memory
    w.register_kv_caches(caches, coords=RankCoords(), facts=facts)
    return w


def main() -> None:
    role, etcd, prefix, instance = sys.argv[1:5]
    w = worker(role, etcd, prefix, instance)
    ad = w.discovery.publisher.advertisement
    print(w.discovery.publisher.key, ad.epoch, flush=True)
    try:
        sys.stdin.read()   # until the parent closes it (or kills this process)
    finally:
        w.shutdown()


if __name__ == "__main__":
    main()
