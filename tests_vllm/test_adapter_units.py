"""The adapter's pieces without servers: vLLM cache tensors -> KVLayout, the scheduler side's
decisions (with stand-ins for vLLM's request and block objects), and the tail alignment a
decode-side prefix hit needs in push mode (real kvpush endpoints in this process)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import kvpush
from kvpush.integrations.vllm_common import (
    AdapterConfig,
    RemotePrefill,
    decode_params,
    prefill_params,
)
from kvpush.integrations.vllm_scheduler import KVPushScheduler, RankInfo
from kvpush.integrations.vllm_worker import layout_from_kv_caches


# -- layouts ---------------------------------------------------------------------------------
def test_cpu_layout_one_packed_region_per_layer_in_layer_order() -> None:
    names = [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 10, 2)]
    caches = {n: torch.zeros(64, 2, 32, 128, dtype=torch.bfloat16) for n in names}
    layout = layout_from_kv_caches(caches, block_size=32, num_blocks=64)
    order = [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10)]
    assert [r.addr for r in layout.regions] == [caches[n].data_ptr() for n in order]
    assert (layout.num_layers, layout.kv_packed, layout.num_kv_heads, layout.head_size) == \
        (4, True, 2, 64)
    assert layout.block_bytes == layout.block_stride == 2 * 32 * 128 * 2
    assert layout.dtype == "bfloat16"


def test_separate_k_and_v_make_two_regions_per_layer() -> None:
    caches = {f"l.{i}": torch.zeros(2, 64, 32, 4, 64, dtype=torch.float16) for i in range(3)}
    layout = layout_from_kv_caches(caches, block_size=32, num_blocks=64)
    assert layout.num_regions == 6 and not layout.kv_packed
    assert layout.regions[1].addr == caches["l.0"][1].data_ptr()
    assert (layout.num_kv_heads, layout.head_size, layout.tokens_per_block) == (4, 64, 32)


def test_head_major_view_with_dense_blocks_is_accepted() -> None:
    base = torch.zeros(64, 32, 2, 128, dtype=torch.bfloat16)  # [B, N, H, C] in memory
    view = base.permute(0, 2, 1, 3)                           # logical [B, H, N, C]
    layout = layout_from_kv_caches({"l.0": view}, block_size=32, num_blocks=64)
    assert layout.block_bytes == 32 * 2 * 128 * 2


def test_block_major_allocation_is_one_region() -> None:
    big = torch.zeros(64, 3, 2, 32, 128, dtype=torch.bfloat16)  # layers inside blocks
    caches = {f"l.{i}": big[:, i] for i in range(3)}
    layout = layout_from_kv_caches(caches, block_size=32, num_blocks=64)
    assert layout.num_regions == 1 and layout.layers_per_region == 3
    assert layout.block_bytes == 3 * 2 * 32 * 128 * 2


def test_kernel_blocks_fold_into_logical_blocks() -> None:
    caches = {"l.0": torch.zeros(128, 2, 16, 128, dtype=torch.bfloat16)}
    layout = layout_from_kv_caches(caches, block_size=32, num_blocks=64)
    assert layout.num_blocks == 64 and layout.tokens_per_block == 32


def test_unsupported_shape_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="not supported"):
        layout_from_kv_caches({"l.0": torch.zeros(3, 64, 32, 2, 64)}, block_size=32)


# -- scheduler side --------------------------------------------------------------------------
class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


class PoolBlock:
    def __init__(self, block_id: int) -> None:
        self.block_id, self.ref_cnt, self.is_null = block_id, 0, block_id == 0


class Pool:
    """vLLM's block pool as the scheduler side uses it: references taken and dropped."""

    def __init__(self, n: int = 256) -> None:
        self.blocks = [PoolBlock(i) for i in range(n)]
        self.null_block = self.blocks[0]

    def touch(self, blocks: list[PoolBlock]) -> None:
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks: list[PoolBlock]) -> None:
        for b in blocks:
            assert b.ref_cnt > 0
            b.ref_cnt -= 1

    def held(self) -> list[int]:
        return [b.block_id for b in self.blocks if b.ref_cnt]


class Manager:
    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}
        self.block_pool = Pool()

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.blocks[req_id],)


def request(req_id: str, params: dict[str, Any] | None, num_prompt: int,
            status: str = "RUNNING") -> Any:
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params,
                           num_prompt_tokens=num_prompt, num_computed_tokens=0,
                           status=SimpleNamespace(name=status))


def scheduler(role: str) -> KVPushScheduler:
    ktc = SimpleNamespace(engine_id="e1", is_kv_producer=role in ("kv_producer", "kv_both"),
                          is_kv_consumer=role in ("kv_consumer", "kv_both"))
    cfg = SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=32))
    s = KVPushScheduler(cfg, SimpleNamespace(kv_cache_groups=[object()]), AdapterConfig())
    s.bind_kv_cache_manager(Manager())
    return s


def test_decode_moves_only_blocks_missing_locally() -> None:
    s = scheduler("kv_consumer")
    r = request("d1", decode_params("t1", ["tcp://127.0.0.1:1"]), 300)  # 10 blocks
    assert s.get_num_new_matched_tokens(r, 128) == (172, True)      # 4 blocks cached
    s.update_state_after_alloc(r, Blocks(list(range(100, 110))), 172)
    plan = s.build_plan(SimpleNamespace(num_scheduled_tokens={}))
    (recv,) = plan.recv
    assert recv.dst == list(range(104, 110)) and recv.report
    # kvpush's id names the prompt too (here only its length: no token ids)
    assert recv.remote.transfer_id == "t1#300" and recv.remote.mode is kvpush.TransferMode.PUSH
    # One transfer per request: asked again (e.g. after a preemption), it computes locally.
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    # Finishing while the KV may still land keeps the blocks until kvpush reports.
    assert s.request_finished(r, []) == (True, None)
    assert s.build_plan(SimpleNamespace(num_scheduled_tokens={})).recv_aborts == ["d1"]


def test_decode_with_nothing_to_move_still_completes_the_protocol() -> None:
    s = scheduler("kv_consumer")
    r = request("d2", decode_params("t2", ["tcp://127.0.0.1:1"]), 64)
    s.update_state_after_alloc(r, Blocks([1, 2]), 0)
    (recv,) = s.build_plan(SimpleNamespace(num_scheduled_tokens={})).recv
    assert recv.dst == [] and not recv.report
    # Finished before it was ever scheduled: the producer is told too.
    r2 = request("d3", decode_params("t3", ["tcp://127.0.0.1:1"]), 64)
    assert s.request_finished(r2, []) == (False, None)
    (recv,) = s.build_plan(SimpleNamespace(num_scheduled_tokens={})).recv
    assert recv.req_id == "d3" and recv.dst == [] and not recv.report


def test_decode_ignores_malformed_params() -> None:
    s = scheduler("kv_consumer")
    r = request("d4", {"do_remote_prefill": True, "kvpush_mode": "push"}, 64)  # no id
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_prefill_hands_over_after_its_last_chunk(mode: str) -> None:
    s = scheduler("kv_producer")
    s.set_handshake({0: RankInfo("producer", "p0", "tcp://127.0.0.1:9")})
    r = request("p1", prefill_params("t9", mode), 100)             # 4 blocks
    s.on_new_request(r)
    s._kv_manager.blocks["p1"] = [7, 8, 9, 10, 11]
    assert s.build_plan(SimpleNamespace(num_scheduled_tokens={"p1": 64})).send == []
    r.num_computed_tokens = 64                                     # second chunk: the last
    (send,) = s.build_plan(SimpleNamespace(num_scheduled_tokens={"p1": 36})).send
    assert (send.transfer_id, send.src, send.mode.value) == ("t9#100", [7, 8, 9, 10], mode)
    r.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    delay, params = s.request_finished(r, [7, 8, 9, 10])
    assert delay and params is not None
    assert params["do_remote_prefill"] and params["kvpush_id"] == "t9"
    remote = RemotePrefill.parse(params, kvpush.TransferMode.PUSH)
    if mode == "pull":
        ticket = kvpush.PullTicket.from_bytes(remote.tickets[0])
        assert (ticket.producer, ticket.address) == ("p0", "tcp://127.0.0.1:9")
        assert list(np.frombuffer(ticket.block_ids, "<i8")) == [7, 8, 9, 10]
    s.update_connector_output(SimpleNamespace(finished_sending={"p1"}, finished_recving=None))
    assert not s._sends


def test_prefill_abort_paths() -> None:
    s = scheduler("kv_producer")
    # Aborted before its prefill finished: nothing held, a waiting registration must fail.
    r = request("p2", prefill_params("t2", "push"), 40, status="FINISHED_ABORTED")
    s.on_new_request(r)
    assert s.request_finished(r, [1]) == (False, None)
    assert s.build_plan(SimpleNamespace(num_scheduled_tokens={})).send_aborts == [("t2#40", 0)]
    # Aborted after prefill_done was issued: blocks stay until kvpush releases them.
    r = request("p3", prefill_params("t3", "push"), 40)
    s.on_new_request(r)
    s._kv_manager.blocks["p3"] = [5, 6]
    (send,) = s.build_plan(SimpleNamespace(num_scheduled_tokens={"p3": 40})).send
    r.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert s.request_finished(r, [5, 6]) == (True, None)
    # named: the use whose prefill_done named the same sid, never a later use of "t3#40"
    assert s.build_plan(SimpleNamespace(num_scheduled_tokens={})).send_aborts == [
        ("t3#40", send.sid)] and send.sid


# -- push with a decode-side prefix hit: the producer moves the tail ------------------------
def _cache(num_blocks: int, seed: int) -> tuple[list[np.ndarray], kvpush.KVLayout]:
    bufs = [np.random.default_rng(seed + i).integers(0, 255, (num_blocks, 4096), np.uint8)
            for i in range(2)]
    layout = kvpush.KVLayout.from_buffers(bufs, num_layers=2, num_blocks=num_blocks,
                                          tokens_per_block=16, num_kv_heads=2, head_size=32,
                                          dtype="float16")
    return bufs, layout


def test_tail_alignment_for_partial_and_full_prefix_hits() -> None:
    src_bufs, src_layout = _cache(16, 1)
    dst_bufs, dst_layout = _cache(32, 7)
    with kvpush.Producer(src_layout) as producer, kvpush.Consumer(dst_layout) as consumer:
        name = consumer.connect(producer.address, timeout=10)
        producer.prefill_done("r1", np.arange(6))
        result = consumer.expect("r1", np.array([20, 21]), name, source_tail=True).wait(10)
        assert result.ok, result.error
        for buf_s, buf_d in zip(src_bufs, dst_bufs, strict=True):
            assert np.array_equal(buf_d[[20, 21]], buf_s[[4, 5]])
        producer.prefill_done("r2", np.array([8, 9]))
        result = consumer.expect("r2", np.array([], np.int64), name, source_tail=True).wait(10)
        assert result.ok, result.error                  # nothing moved, protocol complete
        deadline = time.monotonic() + 10
        released: list[kvpush.Release] = []
        while len(released) < 2 and time.monotonic() < deadline:
            released += producer.get_released()
            time.sleep(0.01)
        assert sorted((r.request_id, r.reason) for r in released) == \
            [("r1", kvpush.ReleaseReason.TRANSFERRED), ("r2", kvpush.ReleaseReason.TRANSFERRED)]
