"""The adapter where users deploy it, without servers: layouts read from what vLLM says
(backend, layout name, cache dtype) and refused when two instances differ, the
compatibility identity, rank addresses, vLLM's own ``kv_transfer_params`` driven by a
reimplementation of vLLM's toy proxy, failed loads as vLLM 0.32/0.33 want them, and the
vLLM versions accepted."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from test_adapter_units import Blocks, request, scheduler
from toy_proxy import decode_body_pull, decode_body_push, prefill_body

import kvpush
from kvpush import LayoutMismatch, check_compatible
from kvpush.integrations.vllm_common import (
    AdapterConfig,
    EngineFacts,
    RankCoords,
    RecvPlan,
    RemotePrefill,
    base_request_id,
    check_vllm_version,
    engine_identity,
)
from kvpush.integrations.vllm_scheduler import RankInfo
from kvpush.integrations.vllm_worker import KVPushWorker, layout_from_kv_caches

CPU = EngineFacts(attn_backend="CPU_ATTN", kv_cache_layout="LBHNC", cache_dtype="auto")


def ident(**over: Any) -> tuple[tuple[str, str], ...]:
    args: dict[str, Any] = dict(model="/models/tiny", revision=None, dtype="torch.bfloat16",
                                num_layers=2, num_kv_heads=2, head_size=64,
                                cache_dtype="auto", attn_backend="CPU_ATTN", protocol=2,
                                vllm_version=(0, 32))
    args.update(over)
    return engine_identity(**args)


def cpu_caches(block: int = 32, blocks: int = 64, dtype: torch.dtype = torch.bfloat16,
               layers: int = 2) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(blocks, 2, block, 128, dtype=dtype)
            for i in range(layers)}


def facts(**over: Any) -> EngineFacts:
    base = dict(attn_backend="CPU_ATTN", kv_cache_layout="LBHNC", cache_dtype="auto",
                identity=ident())
    base.update(over)
    return EngineFacts(**base)


# -- layouts from vLLM's word --------------------------------------------------------------
def test_cpu_backend_says_k_then_v_per_head() -> None:
    layout = layout_from_kv_caches(cpu_caches(), 32, 64, facts())
    assert (layout.block_order, layout.kernel_tokens, layout.dtype) == ("HKND", 32, "bfloat16")
    assert dict(layout.identity)["attn_backend"] == "CPU_ATTN"
    # Without vLLM's word the content is opaque: equal layouts only, nothing converted.
    assert layout_from_kv_caches(cpu_caches(), 32, 64).block_order == "HNC"


def test_cpu_block_sizes_convert_and_opaque_ones_are_refused() -> None:
    a = layout_from_kv_caches(cpu_caches(32), 32, 64, facts())
    b = layout_from_kv_caches(cpu_caches(64), 64, 64, facts())
    check_compatible(a, b)                      # token slots of each head's K and V halves
    assert a.token_units == 2 * a.num_kv_heads
    other = facts(attn_backend="FLASH_ATTN", identity=ident(attn_backend="FLASH_ATTN"))
    c = layout_from_kv_caches(cpu_caches(32), 32, 64, other)
    d = layout_from_kv_caches(cpu_caches(64), 64, 64, other)
    assert c.block_order == "HNC"
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(c, d)
    assert info.value.field == "tokens_per_block"


def test_token_major_split_cache_reads_its_order_from_strides_and_vllm() -> None:
    caches = {f"l.{i}": torch.zeros(2, 64, 16, 4, 64, dtype=torch.float16) for i in range(2)}
    nhd = layout_from_kv_caches(caches, 16, 64, facts(attn_backend="FLASH_ATTN",
                                                      kv_cache_layout="LBNHC"))
    assert (nhd.block_order, nhd.num_kv_heads, nhd.tokens_per_block) == ("NHD", 4, 16)
    # HND in memory: the same logical shape, strides permuted (vLLM's stride order).
    hnd_caches = {f"l.{i}": torch.zeros(2, 64, 4, 16, 64, dtype=torch.float16).transpose(2, 3)
                  for i in range(2)}
    hnd = layout_from_kv_caches(hnd_caches, 16, 64, facts(attn_backend="FLASH_ATTN",
                                                          kv_cache_layout="LBHNC"))
    assert hnd.block_order == "HND"
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(nhd, hnd)
    assert info.value.field == "block_order"
    # vLLM's layout name and the strides disagree: refused, not guessed.
    with pytest.raises(NotImplementedError, match="not guessing"):
        layout_from_kv_caches(caches, 16, 64, facts(kv_cache_layout="LBHNC"))


def test_block_size_mismatch_on_token_major_caches_converts_tokens_in_place() -> None:
    # NHD blocks: tokens outermost, so a token slot is one contiguous piece of a block.
    small = {f"l.{i}": torch.zeros(2, 64, 16, 4, 64, dtype=torch.float16) for i in range(2)}
    big = {f"l.{i}": torch.zeros(2, 64, 32, 4, 64, dtype=torch.float16) for i in range(2)}
    f = facts(attn_backend="FLASH_ATTN", kv_cache_layout="LBNHC")
    a, b = layout_from_kv_caches(small, 16, 64, f), layout_from_kv_caches(big, 32, 64, f)
    check_compatible(a, b)
    assert (a.token_units, b.token_units) == (1, 1)


def test_folded_kernel_blocks_only_meet_the_same_fold() -> None:
    folded = layout_from_kv_caches(cpu_caches(16, 128), 32, 64, facts())
    plain = layout_from_kv_caches(cpu_caches(32, 64), 32, 64, facts())
    assert (folded.kernel_tokens, folded.tokens_per_block) == (16, 32)
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(folded, plain)
    assert info.value.field == "kernel_tokens"
    check_compatible(folded, layout_from_kv_caches(cpu_caches(16, 256), 32, 128, facts()))


def test_fp8_variant_comes_from_the_cache_dtype_not_the_tensor() -> None:
    caches = cpu_caches(dtype=torch.uint8)
    e4m3 = layout_from_kv_caches(caches, 32, 64, facts(cache_dtype="fp8"))
    e5m2 = layout_from_kv_caches(caches, 32, 64, facts(cache_dtype="fp8_e5m2"))
    assert (e4m3.dtype, e5m2.dtype) == ("float8_e4m3fn", "float8_e5m2")
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(e4m3, e5m2)
    assert info.value.field == "dtype"
    with pytest.raises(NotImplementedError, match="fp8_inc"):
        layout_from_kv_caches(caches, 32, 64, facts(cache_dtype="fp8_inc"))


# -- the compatibility identity ------------------------------------------------------------
@pytest.mark.parametrize(("over", "field"), [
    (dict(model="/models/other"), "identity.model"),
    (dict(revision="v2"), "identity.revision"),
    (dict(cache_dtype="fp8_e4m3"), "identity.cache_dtype"),
    (dict(num_layers=4), "identity.num_layers"),
    (dict(attn_backend="TORCH_SDPA"), "identity.attn_backend"),
    (dict(protocol=1), "identity.kvpush_protocol"),
    (dict(vllm_version=(0, 33)), "identity.vllm"),
])
def test_instances_that_differ_are_refused_naming_what(over: dict, field: str) -> None:
    ours = layout_from_kv_caches(cpu_caches(), 32, 64, facts())
    theirs = layout_from_kv_caches(cpu_caches(), 32, 64, facts(identity=ident(**over)))
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(ours, theirs)
    assert info.value.field == field
    assert field.split(".")[1] in str(info.value)


# -- rank addresses ------------------------------------------------------------------------
def test_rank_ports_never_collide_across_dp_pp_tp() -> None:
    cfg = AdapterConfig(port=29600)
    ports = {cfg.rank_port(RankCoords(tp_rank=t, tp_size=4, pp_rank=p, pp_size=2, dp_rank=d))
             for d in range(3) for p in range(2) for t in range(4)}
    assert ports == set(range(29600, 29600 + 24))
    assert cfg.rank_port(RankCoords(tp_rank=1, tp_size=2, dp_rank=1)) == 29603
    assert AdapterConfig(port=0).rank_port(RankCoords(tp_rank=3, tp_size=4)) == 0
    with pytest.raises(ValueError, match="65535"):
        AdapterConfig(port=65530).rank_port(RankCoords(tp_rank=7, tp_size=8))
    with pytest.raises(ValueError, match="tp_rank"):
        RankCoords(tp_rank=2, tp_size=2)


def test_advertised_host() -> None:
    assert AdapterConfig(host="10.0.0.5").advertised_host("10.9.9.9") == "10.0.0.5"
    assert AdapterConfig(host="0.0.0.0").advertised_host("10.9.9.9") == "10.9.9.9"
    assert AdapterConfig(host="0.0.0.0", advertise_host="p0.example").advertised_host(
        "10.9.9.9") == "p0.example"
    with pytest.raises(ValueError, match="advertise_host"):
        AdapterConfig(host="0.0.0.0").advertised_host(None)


def test_worker_advertises_its_real_host_and_port() -> None:
    worker = KVPushWorker(AdapterConfig(host="0.0.0.0"), "kv_producer", "engine-1", 32, 16)
    try:
        worker.register_kv_caches(cpu_caches(blocks=16), coords=RankCoords(1, 2, 0, 1, 0),
                                  facts=facts(), host_ip="10.1.2.3")
        info = worker.handshake()
        assert info is not None
        assert info["host"] == "10.1.2.3" and info["port"] > 0
        assert info["address"] == f"tcp://10.1.2.3:{info['port']}"
        assert (info["tp_rank"], info["pp_rank"], info["dp_rank"]) == (1, 0, 0)
        assert worker.producer is not None and worker.producer.address.startswith(
            "tcp://0.0.0.0:")
    finally:
        worker.shutdown()


# -- vLLM's own kv_transfer_params, as vLLM's toy proxy sends them --------------------------
BODY = {"model": "tiny", "prompt": [5] * 100, "max_tokens": 16, "temperature": 0}


def prefill_scheduler(mode: str) -> Any:
    s = scheduler("kv_producer")
    s.config = AdapterConfig(mode=mode)
    s.set_handshake({0: RankInfo("producer", "p0", "tcp://10.0.0.1:29600", "10.0.0.1", 29600),
                     1: RankInfo("producer", "p1", "tcp://10.0.0.1:29601", "10.0.0.1", 29601)})
    return s


def run_prefill(s: Any, req_id: str, params: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    r = request(req_id, params, 100)
    s.on_new_request(r)
    s._kv_manager.blocks[req_id] = [3, 4, 5, 6]
    (send,) = s.build_plan(SimpleNamespace(num_scheduled_tokens={req_id: 100})).send
    r.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    delay, out = s.request_finished(r, [3, 4, 5, 6])
    assert delay and out is not None
    return send, out


def decode_plan(req_id: str, params: dict[str, Any], prompt: int = 100) -> RecvPlan:
    d = scheduler("kv_consumer")
    r = request(req_id, params, prompt)
    assert d.get_num_new_matched_tokens(r, 0) == (prompt, True)
    d.update_state_after_alloc(r, Blocks(list(range(20, 24))), prompt)
    (recv,) = d.build_plan(SimpleNamespace(num_scheduled_tokens={})).recv
    return recv


def test_toy_proxy_pull_by_what_the_prefill_returns() -> None:
    p = prefill_scheduler("pull")
    rid = "cmpl-6f1c0e2a-0"  # vLLM's request id for X-Request-Id 6f1c0e2a, prompt 0
    params = prefill_body(BODY)["kv_transfer_params"]
    send, returned = run_prefill(p, f"{rid}-1a2b3c4d", params)
    # kvpush's id: the pairing name and the prompt (here only its length: no token ids)
    assert (send.transfer_id, send.mode) == (f"{rid}#100", kvpush.TransferMode.PULL)
    # vLLM's keys, naming kvpush's endpoint of rank 0 and the blocks, beside kvpush's.
    assert returned["do_remote_prefill"] is True and returned["remote_host"] == "10.0.0.1"
    assert (returned["remote_port"], returned["tp_size"]) == (29600, 2)
    assert returned["remote_block_ids"] == [[3, 4, 5, 6]]
    assert returned["remote_request_id"] == f"{rid}-1a2b3c4d"
    recv = decode_plan(f"{rid}-99887766",
                       decode_body_pull(BODY, {"kv_transfer_params": returned})
                       ["kv_transfer_params"])
    assert recv.remote.mode is kvpush.TransferMode.PULL and recv.dst == [20, 21, 22, 23]
    tickets = [kvpush.PullTicket.from_bytes(t) for t in recv.remote.tickets]
    assert [(t.producer, t.address, t.request_id) for t in tickets] == \
        [("p0", "tcp://10.0.0.1:29600", f"{rid}#100"),
         ("p1", "tcp://10.0.0.1:29601", f"{rid}#100")]
    assert list(np.frombuffer(tickets[0].block_ids, "<i8")) == [3, 4, 5, 6]


def test_toy_proxy_pull_from_a_push_prefill_becomes_a_late_push() -> None:
    # A prefill in push mode (the default) keeps its blocks under the lease and answers its
    # address: the decode registers when the proxy forwards that answer, and the WRITE goes.
    p = prefill_scheduler("push")
    send, returned = run_prefill(p, "cmpl-1-0-1a2b3c4d", prefill_body(BODY)["kv_transfer_params"])
    recv = decode_plan("cmpl-1-0-aaaabbbb", decode_body_pull(BODY, {"kv_transfer_params":
                                                                     returned})
                       ["kv_transfer_params"])
    assert recv.remote.mode is kvpush.TransferMode.PUSH
    assert recv.remote.transfer_id == send.transfer_id == "cmpl-1-0#100"
    assert recv.remote.producers == ("tcp://10.0.0.1:29600", "tcp://10.0.0.1:29601")


def test_toy_proxy_push_pairs_the_halves_by_the_shared_request_id() -> None:
    p = prefill_scheduler("push")
    rid = "cmpl-77aa-0"
    send, _ = run_prefill(p, f"{rid}-0badf00d", prefill_body(BODY)["kv_transfer_params"])
    assert send.mode is kvpush.TransferMode.PUSH
    params = decode_body_push(BODY, engine_id="prefill-engine", host="10.0.0.1", port=29600,
                              tp_size=2, request_id="77aa")["kv_transfer_params"]
    recv = decode_plan(f"{rid}-deadbeef", params)
    assert recv.remote.transfer_id == send.transfer_id == f"{rid}#100"
    assert recv.remote.mode is kvpush.TransferMode.PUSH
    assert recv.remote.producers == ("tcp://10.0.0.1:29600", "tcp://10.0.0.1:29601")
    assert recv.remote.for_rank(1).producers == ("tcp://10.0.0.1:29601",)


def test_vllm_schema_edge_cases() -> None:
    assert base_request_id("cmpl-abc-0-1a2B3c4D") == "cmpl-abc-0"
    assert base_request_id("no-suffix") == "no-suffix"
    # kvpush's own key wins; vLLM's transfer_mode names the mode when kvpush's does not.
    remote = RemotePrefill.parse({"kvpush_id": "t", "transfer_mode": "push",
                                  "remote_host": "h", "remote_port": 5}, kvpush.TransferMode.PULL,
                                 "cmpl-x-11112222")
    assert (remote.transfer_id, remote.mode, remote.producers) == \
        ("t", kvpush.TransferMode.PUSH, ("tcp://h:5",))
    with pytest.raises(ValueError, match="remote_host"):
        RemotePrefill.parse({"do_remote_prefill": True}, kvpush.TransferMode.PUSH, "r-11112222")
    with pytest.raises(ValueError, match="tickets"):  # pull needs the prefill's response
        RemotePrefill.parse({"remote_host": "h", "remote_port": 5, "tp_size": 1},
                            kvpush.TransferMode.PULL, "r-11112222")
    with pytest.raises(ValueError, match="integers"):
        RemotePrefill.parse({"remote_host": "h", "remote_port": "x"},
                            kvpush.TransferMode.PUSH, "r")
    # An IPv6 host is bracketed in the address.
    six = RemotePrefill.parse({"remote_host": "fd00::1", "remote_port": 7},
                              kvpush.TransferMode.PUSH, "r")
    assert six.producers == ("tcp://[fd00::1]:7",)


# -- what vLLM 0.32/0.33 call ----------------------------------------------------------------
def test_a_failed_load_is_named_in_failed_recving() -> None:
    worker = KVPushWorker(AdapterConfig(), "kv_consumer", "e", 32, 16)
    worker.consumer = SimpleNamespace(get_finished=list)  # type: ignore[assignment]
    bad = RemotePrefill("t1", kvpush.TransferMode.PULL, (), (b"not a ticket",))
    worker._start_recv(RecvPlan("req-1", bad, [4, 5], report=True))
    sending, recving = worker.get_finished(set())
    assert recving == {"req-1"} and not sending
    assert worker.take_failed_recving(recving) == {"req-1"}
    assert worker.take_failed_recving(recving) == set()
    assert worker.take_load_errors() == {4, 5}


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1.dev3+g1234", "0.33.0", "0.33.2"])
def test_supported_vllm_versions(version: str) -> None:
    assert check_vllm_version(version) in ((0, 32), (0, 33))


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "dev"])
def test_other_vllm_versions_are_refused_clearly(version: str) -> None:
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32, 0\.33.*" + version[:4]):
        check_vllm_version(version)


def test_connector_answers_vllm_033_hooks_honestly() -> None:
    vllm_mod = pytest.importorskip("vllm")
    from kvpush.integrations.vllm import KVPushConnector

    # Sleep mode remaps the KV memory kvpush registered with NIXL: refused, not pretended.
    assert KVPushConnector.supports_sleep_mode(None) is False
    assert KVPushConnector._cache_hit_source.name == "P2P"  # vLLM's hit-source metrics
    assert check_vllm_version(vllm_mod.__version__)
    connector = object.__new__(KVPushConnector)
    worker = KVPushWorker(AdapterConfig(), "kv_consumer", "e", 32, 16)
    worker.consumer = SimpleNamespace(get_finished=list)  # type: ignore[assignment]
    worker._start_recv(RecvPlan("req-9", RemotePrefill("t9", kvpush.TransferMode.PULL, (),
                                                       (b"junk",)), [7], report=True))
    connector._worker = worker
    results = connector.get_transfer_results(set())
    assert results.finished_recving == {"req-9"} and results.failed_recving == {"req-9"}
    assert connector.get_block_ids_with_load_errors() == {7}


def test_two_workers_of_different_models_refuse_and_fail_the_load(
        caplog: pytest.LogCaptureFixture) -> None:
    import time

    prefill = KVPushWorker(AdapterConfig(), "kv_producer", "p", 32, 16)
    decode = KVPushWorker(AdapterConfig(connect_timeout_s=5.0), "kv_consumer", "d", 32, 16)
    try:
        prefill.register_kv_caches(cpu_caches(blocks=16), facts=facts())
        decode.register_kv_caches(cpu_caches(blocks=16),
                                  facts=facts(identity=ident(model="/models/other")))
        remote = RemotePrefill("t1", kvpush.TransferMode.PUSH, (prefill.address,), ())
        decode.bind(_plan(RecvPlan("req-1", remote, [1, 2], report=True)))
        deadline, recving = time.monotonic() + 10, set[str]()
        while not recving and time.monotonic() < deadline:
            time.sleep(0.05)
            _, recving = decode.get_finished(set())
        assert recving == {"req-1"}
        assert decode.take_failed_recving(recving) == {"req-1"}
        assert decode.take_load_errors() == {1, 2}
        assert "identity.model" in caplog.text and "/models/other" in caplog.text
    finally:
        decode.shutdown()
        prefill.shutdown()


def _plan(recv: RecvPlan) -> Any:
    from kvpush.integrations.vllm_common import StepPlan

    return StepPlan(recv=[recv])
