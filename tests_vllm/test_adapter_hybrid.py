"""Hybrid models (several KV cache groups, vLLM's hybrid memory allocator) without
servers: which blocks of which group move, the groups in the compatibility identity, the
start-up refusal of kinds kvpush cannot move (Mamba/SSM state), the scheduler halves'
bookkeeping against a stand-in of vLLM's block pool, and a push between two worker halves
(real kvpush endpoints in this process) over tensors laid out as vLLM 0.32 lays out a
hybrid cache: every group's layers are views into one allocation, overlaid from byte 0."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_adapter_units import request

import kvpush
from kvpush import LayoutMismatch, check_compatible
from kvpush.integrations.vllm_common import (
    AdapterConfig,
    EngineFacts,
    RankCoords,
    RecvPlan,
    RemotePrefill,
    StepPlan,
    decode_params,
    engine_identity,
    prefill_params,
)
from kvpush.integrations.vllm_hybrid import (
    FULL,
    MAMBA,
    SLIDING,
    CacheGroup,
    cache_groups_of,
    group_identity,
    state_backoff,
    transfer_blocks,
)
from kvpush.integrations.vllm_scheduler import KVPushScheduler, RankInfo
from kvpush.integrations.vllm_worker import KVPushWorker, layer_indices, layout_from_kv_caches

BLOCK = 32
WINDOW = 64
NULL = 0


# vLLM's spec classes, by name (the adapter reads the class name and a few attributes)
class FullAttentionSpec:
    block_size = BLOCK


class SlidingWindowSpec:
    block_size = BLOCK

    def __init__(self, window: int = WINDOW) -> None:
        self.sliding_window = window


class MambaSpec:
    block_size = 4096

    def __init__(self, mode: str = "none", spec_blocks: int = 0) -> None:
        self.mamba_cache_mode, self.num_speculative_blocks = mode, spec_blocks


class ChunkedLocalAttentionSpec:
    block_size = BLOCK


def kv_cache_config(*specs: Any) -> Any:
    """Gemma2-like: sliding layers 0, 2, ...; full layers 1, 3, ... (groups in vLLM's
    order: full first)."""
    groups = []
    for spec in specs:
        first = 1 if isinstance(spec, FullAttentionSpec) else 0
        groups.append(SimpleNamespace(
            kv_cache_spec=spec,
            layer_names=[f"model.layers.{first + 2 * j}.self_attn.attn" for j in range(2)]))
    return SimpleNamespace(kv_cache_groups=groups)


GROUPS = cache_groups_of(kv_cache_config(FullAttentionSpec(), SlidingWindowSpec()), BLOCK)


# -- which blocks move ---------------------------------------------------------------------
def test_full_groups_move_every_block_sliding_ones_only_the_window() -> None:
    assert [g.kind for g in GROUPS] == [FULL, SLIDING] and GROUPS[1].window == WINDOW
    full = list(range(100, 107))                          # 200 tokens: 7 blocks
    sliding = [NULL, NULL, 203, 204, 205, 206, 207]       # vLLM nulled the first two
    # the recomputed last token (199) sees tokens 136..199: blocks 4, 5, 6
    flat = transfer_blocks(GROUPS, (full, sliding), 200, 0, NULL)
    assert flat == [100, 101, 102, 103, 104, 205, 105, 206, 106, 207]
    # a window shorter than the prompt's first block: every sliding block moves
    assert transfer_blocks(GROUPS, ([1, 2], [3, 4]), 40, 0, NULL) == [1, 3, 2, 4]
    # block-aligned edge: 160 tokens, the window starts at token 96 = block 3 exactly
    assert transfer_blocks(GROUPS, (full[:5], [9, 9, 9, 13, 14]), 160, 0, NULL) == \
        [100, 101, 102, 103, 13, 104, 14]


@pytest.mark.parametrize("num_tokens", [40, 64, 65, 96, 97, 200, 650, 1500])
def test_a_decode_prefix_hit_needs_a_suffix_of_the_prefill_list(num_tokens: int) -> None:
    """kvpush's source_tail sends the last len(dst) source blocks: the decode side's list
    for any local hit of h blocks must be the prefill's list minus a prefix, entry for
    entry in the same (position, group) order."""
    n = -(-num_tokens // BLOCK)
    src_ids = ([1000 + p for p in range(n)], [2000 + p for p in range(n)])
    dst_ids = ([3000 + p for p in range(n)], [4000 + p for p in range(n)])
    src = transfer_blocks(GROUPS, src_ids, num_tokens, 0, NULL)

    def origin(b: int) -> tuple[int, int]:
        return (b // 1000) % 2, b % 1000          # (group, position)

    for h in range(n):
        dst = transfer_blocks(GROUPS, dst_ids, num_tokens, h, NULL)
        tail = src[len(src) - len(dst):] if dst else []
        assert [origin(b) for b in tail] == [origin(b) for b in dst], h
        assert all(p >= h for _, p in map(origin, dst))


def test_a_needed_null_block_is_an_error_not_a_transfer() -> None:
    with pytest.raises(ValueError, match="null block at position 5"):
        transfer_blocks(GROUPS, (list(range(1, 8)), [0, 0, 0, 0, 14, 0, 16]), 200, 0, NULL)
    with pytest.raises(ValueError, match="holds 3 blocks"):
        transfer_blocks(GROUPS, (list(range(1, 8)), [1, 2, 3]), 200, 0, NULL)


# -- groups at start-up and in the identity --------------------------------------------------
def test_kinds_kvpush_cannot_move_are_refused_at_start_up_naming_the_group() -> None:
    with pytest.raises(NotImplementedError,
                       match=r"group 1 \(MambaSpec.*mamba_cache_mode 'align'.*"
                             r"--no-enable-prefix-caching"):
        cache_groups_of(kv_cache_config(FullAttentionSpec(), MambaSpec("align")), BLOCK)
    with pytest.raises(NotImplementedError, match="speculative-decoding state slots"):
        cache_groups_of(kv_cache_config(FullAttentionSpec(), MambaSpec(spec_blocks=1)), BLOCK)
    with pytest.raises(NotImplementedError, match="group 1 is ChunkedLocalAttentionSpec"):
        cache_groups_of(kv_cache_config(FullAttentionSpec(), ChunkedLocalAttentionSpec()),
                        BLOCK)
    other = SlidingWindowSpec()
    other.block_size = 16
    with pytest.raises(NotImplementedError, match="blocks of 16 tokens"):
        cache_groups_of(kv_cache_config(FullAttentionSpec(), other), BLOCK)
    # the scheduler half refuses at construction, before vLLM serves anything
    ktc = SimpleNamespace(engine_id="e1", is_kv_producer=True, is_kv_consumer=False)
    cfg = SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=32))
    with pytest.raises(NotImplementedError, match="MambaSpec"):
        KVPushScheduler(cfg, kv_cache_config(FullAttentionSpec(), MambaSpec("align")),
                        AdapterConfig())
    # one group of any kind is what it was before hybrid support: not classified
    (one,) = cache_groups_of(kv_cache_config(ChunkedLocalAttentionSpec()), BLOCK)
    assert one.kind == "ChunkedLocalAttentionSpec"


MAMBA_GROUPS = cache_groups_of(kv_cache_config(FullAttentionSpec(), MambaSpec()), BLOCK)


def test_mamba_state_moves_once_after_the_attention_blocks() -> None:
    assert [g.kind for g in MAMBA_GROUPS] == [FULL, MAMBA]
    assert state_backoff(MAMBA_GROUPS) == 1 and state_backoff(GROUPS) == 0
    # 199 tokens computed by the prefill (200 less the backoff): 7 blocks, then the state
    assert transfer_blocks(MAMBA_GROUPS, (list(range(1, 8)), [9]), 199) == [1, 2, 3, 4, 5,
                                                                             6, 7, 9]
    # a decode-side prefix hit shortens the attention part only: still a suffix
    assert transfer_blocks(MAMBA_GROUPS, (list(range(11, 18)), [19]), 199, 5) == [16, 17, 19]
    with pytest.raises(ValueError, match="2 state slots"):
        transfer_blocks(MAMBA_GROUPS, (list(range(1, 8)), [9, 10]), 199)
    with pytest.raises(ValueError, match="0 state slots"):
        transfer_blocks(MAMBA_GROUPS, (list(range(1, 8)), [NULL]), 199, 0, NULL)


def test_with_mamba_state_the_prefill_stops_one_token_short() -> None:
    s = hybrid_scheduler("kv_producer", MambaSpec())
    ids = list(range(7, 207))
    r = request("p1", prefill_params("t1", "pull"), 200)
    r.prompt_token_ids, r._all_token_ids = list(ids), list(ids)
    s.on_new_request(r)
    assert (r.num_prompt_tokens, r.prompt_token_ids, r._all_token_ids) == \
        (199, ids[:-1], ids[:-1])
    s.on_new_request(r)                                     # not twice
    assert r.num_prompt_tokens == 199
    s._kv_manager.tables["p1"] = (list(range(1, 8)), [20])
    (send,) = s.build_plan(SimpleNamespace(num_scheduled_tokens={"p1": 199})).send
    assert send.src == [1, 2, 3, 4, 5, 6, 7, 20]
    r.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    _, params = s.request_finished(r, [])
    assert params is not None and params["kvpush_num_tokens"] == 200   # the whole prompt
    # the decode side claims all but the last token, and loads the state
    d = hybrid_scheduler("kv_consumer", MambaSpec())
    dr = request("d1", {**decode_params("t1", ["tcp://127.0.0.1:1"]), "kvpush_num_tokens": 200},
                 200)
    assert d.get_num_new_matched_tokens(dr, 0) == (199, True)
    d.update_state_after_alloc(dr, HybridBlocks(list(range(31, 38)), [40]), 199)
    (recv,) = d.build_plan(SimpleNamespace(num_scheduled_tokens={})).recv
    assert recv.dst == [31, 32, 33, 34, 35, 36, 37, 40]


def ident(groups: tuple[CacheGroup, ...]) -> tuple[tuple[str, str], ...]:
    return engine_identity(model="/m", revision=None, dtype="bfloat16", num_layers=4,
                           num_kv_heads=2, head_size=64, cache_dtype="auto",
                           attn_backend="CPU_ATTN", protocol=2, vllm_version=(0, 32),
                           extra=group_identity(groups))


def test_one_group_keeps_its_identity_and_two_that_differ_are_refused_by_field() -> None:
    (one,) = cache_groups_of(kv_cache_config(FullAttentionSpec()), BLOCK)
    assert group_identity((one,)) == {}
    assert ident((one,)) == ident(())            # single-group wire form unchanged
    theirs = cache_groups_of(kv_cache_config(FullAttentionSpec(), SlidingWindowSpec(128)),
                             BLOCK)
    caches = overlaid_caches(8)
    mine = layout_from_kv_caches(caches, BLOCK, 8, EngineFacts(identity=ident(GROUPS)))
    other = layout_from_kv_caches(caches, BLOCK, 8, EngineFacts(identity=ident(theirs)))
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(mine, other)
    assert info.value.field == "identity.kv_cache_group.1.window"
    off = layout_from_kv_caches(caches, BLOCK, 8, EngineFacts(identity=ident(())))
    with pytest.raises(LayoutMismatch, match="kv_cache_group"):
        check_compatible(mine, off)                  # one side with HMA off


# -- the cache vLLM 0.32 hands over: groups overlaid on one allocation -----------------------
def overlaid_caches(num_blocks: int, seed: int | None = None) -> dict[str, torch.Tensor]:
    """vLLM's ``allocate_kv_cache`` for 2 full + 2 sliding layers (layer-outer): one int8
    backing allocation; layer slot j of each group at ``j * layer_stride``, so layer 0
    (sliding) and layer 1 (full) are views of the same bytes, and layers 2 and 3."""
    page = 2 * BLOCK * 128                              # [H=2, N=32, C=2*64] bf16 elements
    buf = torch.zeros(2 * num_blocks * page, dtype=torch.bfloat16)
    if seed is not None:
        buf.copy_(torch.randn(buf.numel(), generator=torch.Generator().manual_seed(seed)))
    slots = [buf[j * num_blocks * page:(j + 1) * num_blocks * page].view(
        num_blocks, 2, BLOCK, 128) for j in range(2)]
    return {f"model.layers.{i}.self_attn.attn": slots[i // 2] for i in range(4)}


def test_overlaid_groups_are_one_region_per_layer_slot() -> None:
    caches = overlaid_caches(8)
    layout = layout_from_kv_caches(caches, BLOCK, 8)
    assert layout.num_regions == 2 and layout.num_layers == 2
    # layer-wise push hands a slot over after the *last* of its layers (both groups
    # written); one group keeps the first (a layer that only reads another's cache)
    names = sorted(caches)
    assert layer_indices(caches, overlaid=True) == {names[1]: 0, names[3]: 1}
    assert layer_indices(caches) == {names[0]: 0, names[2]: 1}


# -- the scheduler halves against vLLM's block pool -----------------------------------------
class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id, self.ref_cnt, self.is_null = block_id, 0, block_id == NULL


class Pool:
    def __init__(self, n: int) -> None:
        self.blocks = [Block(i) for i in range(n)]
        self.null_block = self.blocks[NULL]

    def touch(self, blocks: list[Block]) -> None:
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks: list[Block]) -> None:
        for b in blocks:
            assert b.ref_cnt > 0
            b.ref_cnt -= 1


class HybridManager:
    def __init__(self, n: int = 64) -> None:
        self.block_pool = Pool(n)
        self.tables: dict[str, tuple[list[int], list[int]]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return self.tables[req_id]


class HybridBlocks:
    def __init__(self, full: list[int], sliding: list[int]) -> None:
        self.ids = (full, sliding)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


def hybrid_scheduler(role: str, other: Any = None) -> KVPushScheduler:
    ktc = SimpleNamespace(engine_id="e1", is_kv_producer=role == "kv_producer",
                          is_kv_consumer=role == "kv_consumer")
    cfg = SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=32))
    s = KVPushScheduler(cfg, kv_cache_config(FullAttentionSpec(),
                                             other or SlidingWindowSpec()),
                        AdapterConfig())
    s.bind_kv_cache_manager(HybridManager())
    return s


def test_prefill_holds_the_window_blocks_vllm_frees_until_kvpush_hands_them_back() -> None:
    s = hybrid_scheduler("kv_producer")
    r = request("p1", prefill_params("t1", "push"), 200)
    s.on_new_request(r)
    s._kv_manager.tables["p1"] = (list(range(1, 8)), list(range(11, 18)))
    (send,) = s.build_plan(SimpleNamespace(num_scheduled_tokens={"p1": 200})).send
    assert send.src == [1, 2, 3, 4, 5, 15, 6, 16, 7, 17]
    pool = s._kv_manager.block_pool
    held = [b for b in pool.blocks if b.ref_cnt]
    # every block the transfer reads, the window's sliding blocks among them
    assert [b.block_id for b in held] == [1, 2, 3, 4, 5, 6, 7, 15, 16, 17]
    r.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    delay, params = s.request_finished(r, [1])
    assert delay and params is not None
    s.update_connector_output(SimpleNamespace(finished_sending={"p1"}, finished_recving=None))
    assert not any(b.ref_cnt for b in pool.blocks)
    # preempted after its send was planned: the worker ends the transfer, and the
    # references go once it reports that nothing reads the blocks
    r2 = request("p2", prefill_params("t2", "pull"), 100)
    s.on_new_request(r2)
    s._kv_manager.tables["p2"] = ([30, 31, 32, 33], [40, 41, 42, 43])
    (send,) = s.build_plan(SimpleNamespace(num_scheduled_tokens={"p2": 100})).send
    assert send.src == [30, 31, 41, 32, 42, 33, 43]     # tokens 36..99: blocks 1..3
    assert sorted(b.block_id for b in pool.blocks if b.ref_cnt) == [30, 31, 32, 33, 41, 42, 43]
    plan = s.build_plan(SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids={"p2"}))
    assert plan.send_preempted == [("p2", "t2#100")]
    assert sorted(b.block_id for b in pool.blocks if b.ref_cnt) == [30, 31, 32, 33, 41, 42, 43]
    s.update_connector_output(SimpleNamespace(
        finished_sending=None, finished_recving=None,
        kv_connector_worker_meta=SimpleNamespace(ended={"t2#100": 1})))
    assert not any(b.ref_cnt for b in pool.blocks)


def test_decode_registers_the_needed_blocks() -> None:
    s = hybrid_scheduler("kv_consumer")
    r = request("d1", decode_params("t1", ["tcp://127.0.0.1:1"]), 200)
    assert s.get_num_new_matched_tokens(r, 64) == (136, True)       # 2 blocks hit locally
    s.update_state_after_alloc(r, HybridBlocks(list(range(21, 28)), list(range(31, 38))), 136)
    (recv,) = s.build_plan(SimpleNamespace(num_scheduled_tokens={})).recv
    assert recv.dst == [23, 24, 25, 35, 26, 36, 27, 37] and recv.report


def test_a_failed_hybrid_load_is_reported_by_request_not_by_block() -> None:
    """vLLM 0.32 stops the engine on block-level load errors with several KV cache groups
    ("Connectors must report failed requests via KVConnectorTransferResults.failed_recving
    instead"): the request goes in failed_recving, no block id is reported."""
    vllm_mod = pytest.importorskip("vllm")
    del vllm_mod
    from kvpush.integrations.vllm import KVPushConnector

    worker = KVPushWorker(AdapterConfig(), "kv_consumer", "d", BLOCK, 8)
    try:
        worker.register_kv_caches(overlaid_caches(8), facts=EngineFacts(
            attn_backend="CPU_ATTN", kv_cache_layout="LBHNC", identity=ident(GROUPS),
            groups=GROUPS))
        bad = RemotePrefill("t1", kvpush.TransferMode.PULL, (), (b"not a ticket",))
        worker._start_recv(RecvPlan("req-1", bad, [4, 5], report=True))
        connector = object.__new__(KVPushConnector)
        connector._worker = worker
        results = connector.get_transfer_results(set())
        assert results.finished_recving == {"req-1"} and results.failed_recving == {"req-1"}
        assert connector.get_block_ids_with_load_errors() == set()
    finally:
        worker.shutdown()


# -- two worker halves, real endpoints: only the window moves -------------------------------
def wait_finished(worker: KVPushWorker, sending: bool, req: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done_s, done_r = worker.get_finished({req} if sending else set())
        if req in (done_s if sending else done_r):
            return
        time.sleep(0.02)
    raise AssertionError(f"{req} not finished")


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_worker_halves_move_full_blocks_and_only_the_window(mode: str) -> None:
    blocks, tokens = 32, 650                                  # 21 blocks, window = 3
    src_caches, dst_caches = overlaid_caches(blocks, seed=1), overlaid_caches(blocks)
    facts = EngineFacts(attn_backend="CPU_ATTN", kv_cache_layout="LBHNC",
                        identity=ident(GROUPS), groups=GROUPS)
    prefill = KVPushWorker(AdapterConfig(), "kv_producer", "p", BLOCK, blocks)
    decode = KVPushWorker(AdapterConfig(), "kv_consumer", "d", BLOCK, blocks)
    try:
        prefill.register_kv_caches(src_caches, facts=facts)
        decode.register_kv_caches(dst_caches, facts=facts)
        # one block pool: full blocks 1..21 on both sides, sliding ones after them (the
        # prefill's first 18 nulled by vLLM, the decode's never loaded)
        p_sched = hybrid_scheduler("kv_producer")
        info = prefill.handshake()
        assert info is not None
        p_sched.set_handshake({0: RankInfo(**info)})
        r = request("p1", prefill_params("t1", mode), tokens)
        p_sched.on_new_request(r)
        p_sched._kv_manager.tables["p1"] = (list(range(1, 22)),
                                            [NULL] * 18 + [22, 23, 24])
        (send,) = p_sched.build_plan(SimpleNamespace(num_scheduled_tokens={"p1": tokens})).send
        prefill.bind(StepPlan(send=[send]))
        prefill.after_forward()
        r.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
        _, params = p_sched.request_finished(r, [])
        assert params is not None
        remote = RemotePrefill.parse(params, kvpush.TransferMode.PUSH)
        d_sched = hybrid_scheduler("kv_consumer")
        dr = request("d1", decode_params("t1", [prefill.address]), tokens)
        d_sched.update_state_after_alloc(dr, HybridBlocks(list(range(1, 22)),
                                                          [28] * 18 + [25, 26, 27]), tokens)
        (recv,) = d_sched.build_plan(SimpleNamespace(num_scheduled_tokens={})).recv
        assert len(recv.dst) == len(send.src) == 21 + 3
        decode.bind(StepPlan(recv=[RecvPlan("d1", remote, recv.dst, report=True)]))
        wait_finished(decode, False, "d1")
        assert not decode.take_failed_recving({"d1"})
        stats = decode.take_stats()
        assert stats is not None
        page = 2 * BLOCK * 128 * 2                            # bytes per block per slot
        assert stats["bytes"] == [(21 + 3) * 2 * page]        # not 21 x 4 layers
        src_slots = [src_caches["model.layers.0.self_attn.attn"],
                     src_caches["model.layers.2.self_attn.attn"]]
        dst_slots = [dst_caches["model.layers.0.self_attn.attn"],
                     dst_caches["model.layers.2.self_attn.attn"]]
        for s_block, d_block in zip(send.src, recv.dst, strict=True):
            for s_slot, d_slot in zip(src_slots, dst_slots, strict=True):
                assert torch.equal(s_slot[s_block], d_slot[d_block])
        untouched = sorted(set(range(blocks)) - set(recv.dst))
        assert all(not d_slot[untouched].any() for d_slot in dst_slots)
        wait_finished(prefill, True, "p1")
    finally:
        decode.shutdown()
        prefill.shutdown()


def mamba_caches(num_blocks: int, seed: int | None = None) -> dict[str, torch.Tensor]:
    """vLLM 0.32's hybrid cache for one Mamba layer (0) and one attention layer (1): one
    backing allocation of attention pages; the Mamba layer's state is an int8
    ``[blocks, 1, 1, state]`` view of the same pages (the state padded to the page)."""
    page = 2 * BLOCK * 128 * 2                                 # bytes
    buf = torch.zeros(num_blocks * page, dtype=torch.int8)
    if seed is not None:
        buf.copy_(torch.randint(-128, 127, (buf.numel(),), dtype=torch.int8,
                                generator=torch.Generator().manual_seed(seed)))
    attn = buf.view(torch.bfloat16).view(num_blocks, 2, BLOCK, 128)
    state = torch.as_strided(buf, (num_blocks, 1, 1, page - 1000), (page, page, page, 1))
    return {"model.layers.0.mixer": state, "model.layers.1.self_attn.attn": attn}


MAMBA_FACT_GROUPS = (CacheGroup(MAMBA, ("model.layers.0.mixer",), 4096),
                     CacheGroup(FULL, ("model.layers.1.self_attn.attn",), BLOCK))


def test_mamba_state_must_lie_in_the_attention_pages() -> None:
    caches = mamba_caches(8)
    layout = layout_from_kv_caches(caches, BLOCK, 8, EngineFacts(groups=MAMBA_FACT_GROUPS))
    assert layout.num_regions == 1 and layout.num_layers == 1
    apart = dict(caches)
    apart["model.layers.0.mixer"] = torch.zeros(8, 1, 1, 100, dtype=torch.int8)
    with pytest.raises(NotImplementedError, match="does not lie in an attention layer"):
        layout_from_kv_caches(apart, BLOCK, 8, EngineFacts(groups=MAMBA_FACT_GROUPS))
    with pytest.raises(NotImplementedError, match="Mamba state under tensor parallelism"):
        layout_from_kv_caches(caches, BLOCK, 8, EngineFacts(groups=MAMBA_FACT_GROUPS),
                              RankCoords(tp_rank=0, tp_size=2))


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_worker_halves_move_the_mamba_state_once(mode: str) -> None:
    blocks, tokens = 16, 200                    # the prefill computes 199: 7 blocks + state
    src_caches, dst_caches = mamba_caches(blocks, seed=3), mamba_caches(blocks)
    facts = EngineFacts(attn_backend="CPU_ATTN", kv_cache_layout="LBHNC",
                        identity=ident(MAMBA_FACT_GROUPS), groups=MAMBA_FACT_GROUPS)
    prefill = KVPushWorker(AdapterConfig(), "kv_producer", "p", BLOCK, blocks)
    decode = KVPushWorker(AdapterConfig(), "kv_consumer", "d", BLOCK, blocks)
    try:
        prefill.register_kv_caches(src_caches, facts=facts)
        decode.register_kv_caches(dst_caches, facts=facts)
        p_sched = hybrid_scheduler("kv_producer", MambaSpec())
        info = prefill.handshake()
        assert info is not None
        p_sched.set_handshake({0: RankInfo(**info)})
        r = request("p1", prefill_params("t1", mode), tokens)
        r.prompt_token_ids, r._all_token_ids = list(range(tokens)), list(range(tokens))
        p_sched.on_new_request(r)
        p_sched._kv_manager.tables["p1"] = (list(range(1, 8)), [12])
        (send,) = p_sched.build_plan(
            SimpleNamespace(num_scheduled_tokens={"p1": tokens - 1})).send
        prefill.bind(StepPlan(send=[send]))
        prefill.after_forward()
        r.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
        _, params = p_sched.request_finished(r, [])
        assert params is not None
        remote = RemotePrefill.parse(params, kvpush.TransferMode.PUSH)
        d_sched = hybrid_scheduler("kv_consumer", MambaSpec())
        dr = request("d1", {**decode_params("t1", [prefill.address]),
                            "kvpush_num_tokens": tokens}, tokens)
        assert d_sched.get_num_new_matched_tokens(dr, 0) == (tokens - 1, True)
        d_sched.update_state_after_alloc(dr, HybridBlocks(list(range(8, 15)), [3]),
                                         tokens - 1)
        (recv,) = d_sched.build_plan(SimpleNamespace(num_scheduled_tokens={})).recv
        assert (send.src, recv.dst) == ([1, 2, 3, 4, 5, 6, 7, 12],
                                        [8, 9, 10, 11, 12, 13, 14, 3])
        decode.bind(StepPlan(recv=[RecvPlan("d1", remote, recv.dst, report=True)]))
        wait_finished(decode, False, "d1")
        assert not decode.take_failed_recving({"d1"})
        stats = decode.take_stats()
        assert stats is not None
        assert stats["bytes"] == [8 * 2 * BLOCK * 128 * 2]    # 7 attention blocks, 1 state
        s_state, d_state = src_caches["model.layers.0.mixer"], dst_caches["model.layers.0.mixer"]
        assert torch.equal(s_state[12], d_state[3])           # the state, whole
        s_attn = src_caches["model.layers.1.self_attn.attn"]
        d_attn = dst_caches["model.layers.1.self_attn.attn"]
        for s_block, d_block in zip(send.src[:-1], recv.dst[:-1], strict=True):
            assert torch.equal(s_attn[s_block].view(torch.int16),  # (random bits: NaNs)
                               d_attn[d_block].view(torch.int16))
        assert not d_attn[[0, 1, 2, 15]].view(torch.int16).any()
        wait_finished(prefill, True, "p1")
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_instances_that_group_differently_are_refused_at_the_handshake(
        caplog: pytest.LogCaptureFixture) -> None:
    """Real endpoints: a decode instance whose sliding window differs from the prefill's
    is refused at the handshake, the field named, and its load fails (by request)."""
    theirs = cache_groups_of(kv_cache_config(FullAttentionSpec(), SlidingWindowSpec(128)),
                             BLOCK)
    prefill = KVPushWorker(AdapterConfig(), "kv_producer", "p", BLOCK, 8)
    decode = KVPushWorker(AdapterConfig(connect_timeout_s=5.0), "kv_consumer", "d", BLOCK, 8)
    try:
        prefill.register_kv_caches(overlaid_caches(8), facts=EngineFacts(
            attn_backend="CPU_ATTN", kv_cache_layout="LBHNC", identity=ident(GROUPS),
            groups=GROUPS))
        decode.register_kv_caches(overlaid_caches(8), facts=EngineFacts(
            attn_backend="CPU_ATTN", kv_cache_layout="LBHNC", identity=ident(theirs),
            groups=theirs))
        remote = RemotePrefill("t1", kvpush.TransferMode.PUSH, (prefill.address,), ())
        decode.bind(StepPlan(recv=[RecvPlan("req-1", remote, [1, 2], report=True)]))
        wait_finished(decode, False, "req-1")
        assert decode.take_failed_recving({"req-1"}) == {"req-1"}
        assert decode.take_load_errors() == set()
        assert "identity.kv_cache_group.1.window" in caplog.text
    finally:
        decode.shutdown()
        prefill.shutdown()
