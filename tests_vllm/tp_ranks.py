"""One vLLM worker rank of kvpush's adapter in its own process, for the TP tests without
servers (``test_adapter_tp.py``): the parent plays vLLM's scheduler (the connector's
scheduler halves) and sends each rank the plans of its steps, as vLLM's executor does.

A rank's KV cache is the CPU backend's ``[blocks, heads, 32, 2*64]`` bf16 tensor per layer,
sharded by TP rank as vLLM shards KV heads; or (``kind="mla"``) vLLM's MLA cache,
``[blocks, 32, 576]`` (kv_lora_rank 512 + rope 64) per layer, whole on every rank. A
prefill rank fills every (layer, block, head) with bytes that depend only on (layer, block,
*global* head), so replicas hold the same bytes and a decode rank can check each head it
received against what it should be.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.connection import Connection
from typing import Any

LAYERS, BLOCK, HEAD = 2, 32, 64
LATENT = 576                    # MLA: kv_lora_rank 512 + qk_rope_head_dim 64


def pattern(layer: int, block: int, head: int, kind: str = "kv") -> Any:
    """The bytes a prefill rank holds for one (layer, block, global head) (MLA: head 0,
    the latent vectors of the block's tokens)."""
    import torch

    g = torch.Generator().manual_seed((layer * 100_003 + block) * 1_009 + head + 1)
    width = LATENT if kind == "mla" else 2 * HEAD
    return torch.randn(BLOCK, width, generator=g).to(torch.bfloat16)


def _serve(conn: Connection, role: str, tp_rank: int, tp_size: int, total: int,
           blocks: int, config: dict[str, Any], kind: str = "kv") -> None:
    import logging

    import torch

    from kvpush.integrations.vllm_common import AdapterConfig, EngineFacts, RankCoords

    if os.environ.get("KVPUSH_TP_LOG"):
        logging.basicConfig(level=logging.INFO, filename=f"{os.environ['KVPUSH_TP_LOG']}-"
                            f"{role}-{tp_rank}.log", format="%(asctime)s %(name)s %(message)s")
    from kvpush.integrations.vllm_worker import KVPushWorker
    from kvpush.layout import tp_shard

    mla = kind == "mla"
    start, n = tp_shard(tp_size, tp_rank, total)
    shape = (blocks, BLOCK, LATENT) if mla else (blocks, n, BLOCK, 2 * HEAD)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(*shape, dtype=torch.bfloat16)
              for i in range(LAYERS)}

    def head(t: Any, b: int, h: int) -> Any:
        return t[b] if mla else t[b, h]

    if role == "kv_producer":
        for i, t in enumerate(caches.values()):
            for b in range(blocks):
                for h in range(n):
                    head(t, b, h).copy_(pattern(i, b, start + h, kind))
    facts = EngineFacts(attn_backend="CPU_MLA" if mla else "CPU_ATTN",
                        kv_cache_layout=None if mla else "LBHNC", cache_dtype="auto",
                        total_kv_heads=total, identity=(("model", "tiny-tp"),))
    worker = KVPushWorker(AdapterConfig(**config), role, f"e-{role}", BLOCK, blocks)
    worker.register_kv_caches(caches, coords=RankCoords(tp_rank=tp_rank, tp_size=tp_size),
                              facts=facts)
    conn.send(worker.handshake())
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "step":             # one engine step: (plan, finished_req_ids)
                plan, finished = arg
                worker.handle_preemptions(plan)
                worker.bind(plan)
                for name in caches:       # the forward pass, layer by layer
                    worker.save_layer(name)
                worker.after_forward()
                conn.send(worker.get_finished(finished))
            elif cmd == "forward_layers":  # the first arg[1] layers of a step's forward
                plan, layers = arg
                worker.handle_preemptions(plan)
                worker.bind(plan)
                for name in list(caches)[:layers]:
                    worker.save_layer(name)
                conn.send(None)
            elif cmd == "end_forward":    # the rest of that step: after_forward
                worker.after_forward()
                conn.send(worker.get_finished(arg))
            elif cmd == "errors":
                conn.send(worker.take_load_errors())
            elif cmd == "ended":          # preempted sends' transfers that ended
                conn.send(worker.take_ended())
            elif cmd == "poll":
                conn.send(worker.get_finished(arg))
            elif cmd == "check":          # (dst blocks, src blocks): heads that differ
                bad = []
                for i, t in enumerate(caches.values()):
                    for d, s in zip(*arg, strict=True):
                        for h in range(n):
                            if not torch.equal(head(t, d, h), pattern(i, s, start + h, kind)):
                                bad.append((i, d, start + h))
                conn.send(bad)
            elif cmd == "landed":         # (dst, src, layer): that layer's blocks are right
                dst, src, layer = arg
                t = list(caches.values())[layer]
                conn.send(all(torch.equal(head(t, d, h), pattern(layer, s_, start + h, kind))
                              for d, s_ in zip(dst, src, strict=True) for h in range(n)))
            elif cmd == "scribble":       # vLLM reused these blocks for another request
                for t in caches.values():
                    t[list(arg)] = -7.0
                conn.send(None)
            elif cmd == "pending":
                conn.send(worker.producer.pending if worker.producer else 0)
            elif cmd == "bytes_moved":    # prefill side: bytes this rank's producer sent
                conn.send(worker.producer.stats()["bytes_moved"] if worker.producer else 0)
            elif cmd == "block_bytes":    # bytes of one block id (every layer)
                assert worker.layout is not None
                conn.send(worker.layout.bytes_per_block_id)
            elif cmd == "stop":
                break
    finally:
        worker.shutdown()
        conn.send("stopped")


class Rank:
    """A rank process and the pipe to it."""

    def __init__(self, role: str, tp_rank: int, tp_size: int, total: int, blocks: int = 16,
                 kind: str = "kv", **config: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, role, tp_rank, tp_size, total,
                                                     blocks, config, kind), daemon=True)
        self.proc.start()
        self.role, self.tp_rank = role, tp_rank
        self.info: dict[str, Any] = self._recv(120)
        #: everything the rank reported to "vLLM" so far (finished_sending, _recving)
        self.reported: tuple[set[str], set[str]] = (set(), set())

    def _recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.role} rank {self.tp_rank} did not answer in {timeout} s")
        return self.conn.recv()

    def call(self, cmd: str, arg: Any = None, timeout: float = 60) -> Any:
        self.conn.send((cmd, arg))
        out = self._recv(timeout)
        if cmd in ("step", "poll", "end_forward"):
            self.reported[0].update(out[0])
            self.reported[1].update(out[1])
        return out

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=15)
            except (TimeoutError, OSError, EOFError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()

    def kill(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, 9)
        self.proc.join(10)
