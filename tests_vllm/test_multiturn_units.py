"""Multi-turn reuse in the adapter's scheduler side, without servers (stand-ins for vLLM's
request and block objects): the decode instance keeps a finished turn and names it in both
schemas; the next turn's prefill loads only what its prefix cache lacks."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvpush.integrations.vllm_common import AdapterConfig, decode_params, prefill_params
from kvpush.integrations.vllm_reuse import PARAM_REUSE, ReuseCosts, kept_tokens, offer
from kvpush.integrations.vllm_scheduler import KVPushScheduler, RankInfo
from kvpush.request import TransferMode

BS = 32
STEP = SimpleNamespace(num_scheduled_tokens={})


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


def scheduler(reuse: bool = True) -> KVPushScheduler:
    ktc = SimpleNamespace(engine_id="e1", is_kv_producer=True, is_kv_consumer=True)
    cfg = SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=BS))
    s = KVPushScheduler(cfg, SimpleNamespace(kv_cache_groups=[object()]),
                        AdapterConfig(reuse=reuse, lease_s=30.0))
    s.bind_kv_cache_manager(SimpleNamespace())
    s.set_handshake({0: RankInfo("both", "d0", "tcp://127.0.0.1:7001")})
    return s


def finished_turn(tokens: list[int], computed: int, params: dict[str, Any]) -> Any:
    return SimpleNamespace(request_id="d1", kv_transfer_params=params, all_token_ids=tokens,
                           num_prompt_tokens=len(tokens) - 10, num_computed_tokens=computed,
                           prompt_token_ids=tokens[:-10],
                           status=SimpleNamespace(name="FINISHED_STOPPED"))


def next_turn(prompt: list[int], params: dict[str, Any]) -> Any:
    return SimpleNamespace(request_id="p2", kv_transfer_params=params,
                           prompt_token_ids=prompt, num_prompt_tokens=len(prompt),
                           num_computed_tokens=0, status=SimpleNamespace(name="RUNNING"))


def keep_turn(mode: str, history: list[int]) -> tuple[KVPushScheduler, dict[str, Any]]:
    """A decode instance finishes a turn over ``history`` (all but its last token have KV)."""
    d = scheduler()
    params = decode_params("t1", ["tcp://127.0.0.1:7000"]) | {"kvpush_mode": mode}
    params["do_remote_prefill"] = False          # its load is done
    r = finished_turn(history, len(history) - 1, params)
    hold, out = d.request_finished(r, list(range(10, 30)))
    assert hold and out is not None
    return d, out


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_decode_keeps_a_finished_turn_in_both_schemas(mode: str) -> None:
    history = list(range(1000, 1000 + 170))      # 169 tokens with KV: 5 full blocks
    d, out = keep_turn(mode, history)
    # vLLM's NixlConnector bidirectional keys, at the top
    assert out["do_remote_decode"] is True and out["do_remote_prefill"] is False
    assert out["remote_block_ids"] == [list(range(10, 15))]
    assert out["remote_num_tokens"] == 160 and out["remote_engine_id"] == "e1"
    assert out["remote_host"] == "127.0.0.1" and out["remote_port"] == 7001
    assert out["remote_blocks_expiry_time"] > 0 and out["transfer_mode"] == mode
    assert "kvpush_id" not in out                # the next turn's name is the proxy's
    inner = out[PARAM_REUSE]
    assert inner["kvpush_num_tokens"] == 160 and inner["kvpush_id"].startswith("reuse.")
    assert bool(inner.get("kvpush_tickets")) == (mode == "pull")
    # the worker hands the kept blocks to its Producer in the next step, no forward needed
    (send,) = d.build_plan(STEP).send
    assert send.computed and send.src == list(range(10, 15))
    assert send.mode is TransferMode(mode)
    # released once (the worker's finished_sending): vLLM frees the blocks then
    d.update_connector_output(SimpleNamespace(finished_sending={"d1"}))
    assert not d.build_plan(STEP).send


def test_reuse_off_keeps_nothing() -> None:
    d = scheduler(reuse=False)
    params = decode_params("t1", ["tcp://127.0.0.1:7000"]) | {"do_remote_prefill": False}
    r = finished_turn(list(range(200)), 199, params)
    assert d.request_finished(r, list(range(10, 20))) == (False, None)


def test_aborted_turn_keeps_nothing() -> None:
    d = scheduler()
    params = decode_params("t1", ["tcp://127.0.0.1:7000"]) | {"do_remote_prefill": False}
    r = finished_turn(list(range(200)), 199, params)
    r.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert d.request_finished(r, list(range(10, 20))) == (False, None)


def test_streamed_turn_keeps_nothing() -> None:
    """vLLM's OpenAI server streams with output kind DELTA and drops kv_transfer_params
    from the stream: a kept turn could never be named, so nothing is held."""
    d = scheduler()
    params = decode_params("t1", ["tcp://127.0.0.1:7000"]) | {"do_remote_prefill": False}
    r = finished_turn(list(range(200)), 199, params)
    r.sampling_params = SimpleNamespace(output_kind=SimpleNamespace(name="DELTA"))
    assert d.request_finished(r, list(range(10, 20))) == (False, None)
    assert not d.build_plan(STEP).send
    r.sampling_params = SimpleNamespace(output_kind=SimpleNamespace(name="FINAL_ONLY"))
    hold, out = d.request_finished(r, list(range(10, 20)))
    assert hold and out is not None


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_next_turn_loads_only_what_its_prefix_cache_lacks(mode: str) -> None:
    history = list(range(1000, 1170))
    _, out = keep_turn(mode, history)
    p = scheduler()
    prompt = history + list(range(5000, 5040))   # the answer's last token, then new text
    params = out | prefill_params("t2", mode)    # the proxy's keys for the new turn
    r = next_turn(prompt, params)
    # 2 blocks in the prefix cache: the 3 other kept blocks load
    assert p.get_num_new_matched_tokens(r, 64) == (96, True)
    p.update_state_after_alloc(r, Blocks(list(range(50, 57))), 96)
    (recv,) = p.build_plan(STEP).recv
    assert recv.dst == [52, 53, 54] and recv.report
    assert recv.remote.mode is TransferMode(mode)
    assert recv.remote.transfer_id.startswith(out[PARAM_REUSE]["kvpush_id"] + "#160.")
    # one load per request: asked again (after a preemption), it computes
    assert p.get_num_new_matched_tokens(r, 0) == (0, False)


def test_prefix_cache_holding_everything_moves_nothing() -> None:
    history = list(range(1000, 1170))
    _, out = keep_turn("pull", history)
    p = scheduler()
    r = next_turn(history + [7] * 40, out | prefill_params("t2", "pull"))
    assert p.get_num_new_matched_tokens(r, 160) == (0, False)
    p.update_state_after_alloc(r, Blocks(list(range(50, 57))), 0)
    # nothing moves and nothing is said: the decode instance lets the kept turn go when it
    # keeps the next one over the same blocks, or at its lease
    assert not p.build_plan(STEP).recv


def test_a_prompt_that_does_not_continue_the_conversation_computes() -> None:
    history = list(range(1000, 1170))
    _, out = keep_turn("pull", history)
    p = scheduler()
    other = [1] + history[1:] + [7] * 40
    r = next_turn(other, out | prefill_params("t2", "pull"))
    assert p.get_num_new_matched_tokens(r, 0) == (0, False)


def test_offer_needs_a_token_left_to_compute() -> None:
    history = list(range(1000, 1170))
    _, out = keep_turn("pull", history)
    assert offer(out, history[:160], 160, BS) is None
    assert offer(out, history[:161], 161, BS) is not None
    assert kept_tokens(169, BS) == 160 and kept_tokens(31, BS) == 0


def test_memory_pressure_gives_the_oldest_kept_turns_back_early() -> None:
    d = scheduler()
    pool = SimpleNamespace(num_gpu_blocks=100, free=50)
    pool.get_num_free_blocks = lambda: pool.free
    d.bind_kv_cache_manager(SimpleNamespace(block_pool=pool))
    kept = []
    for i in range(3):
        params = decode_params(f"t{i}", ["tcp://127.0.0.1:7000"]) | {"do_remote_prefill": False}
        r = finished_turn(list(range(1000 + i, 1170 + i)), 169, params)
        r.request_id = f"d{i}"
        kept.append(d.request_finished(r, list(range(10 * i, 10 * i + 6)))[1])
    assert not d.build_plan(STEP).send_aborts            # 50 % free: all kept
    pool.free = 4                                        # under the 10 % reserve
    aborts = d.build_plan(STEP).send_aborts
    # the oldest two go (5 blocks each): 4 + 5 + 5 >= 10
    names = [k["kvpush_reuse"]["kvpush_id"] for k in kept]
    assert [a.split("#")[0] for a, _ in aborts] == names[:2]
    assert all(sid for _, sid in aborts)                 # each names its kept use
    assert not d.build_plan(STEP).send_aborts            # each given back once
    with pytest.raises(ValueError, match="reuse_reserve"):
        AdapterConfig(reuse_reserve=1.0)


def test_a_kept_turn_goes_when_the_next_turn_is_kept_over_its_blocks() -> None:
    """The decode instance keeps turn 1 (blocks 10-14) and then turn 2, whose blocks begin
    with those (its prefix cache found them): turn 1 is released then, once, and not at its
    lease; a kept turn of another conversation (other blocks) stays."""
    d = scheduler()
    pool = SimpleNamespace(num_gpu_blocks=100, get_num_free_blocks=lambda: 90)
    d.bind_kv_cache_manager(SimpleNamespace(block_pool=pool))

    def finish(name: str, history: list[int], blocks: list[int]) -> dict[str, Any]:
        params = decode_params(name, ["tcp://127.0.0.1:7000"]) | {"do_remote_prefill": False}
        r = finished_turn(history, len(history) - 1, params)
        r.request_id = name
        hold, out = d.request_finished(r, blocks)
        assert hold and out is not None
        return out

    turn1 = list(range(1000, 1170))                   # 169 with KV: 5 full blocks
    first = finish("c1-t1", turn1, list(range(10, 16)))
    other = finish("c2-t1", list(range(5000, 5170)), list(range(40, 46)))
    assert not d.build_plan(STEP).send_aborts
    turn2 = turn1 + list(range(2000, 2060))           # 229 with KV: 7 full blocks
    finish("c1-t2", turn2, [*range(10, 15), 20, 21, 22])
    aborts = d.build_plan(STEP).send_aborts
    assert [(a.split("#")[0], bool(sid)) for a, sid in aborts] == [
        (first[PARAM_REUSE]["kvpush_id"], True)]           # named: its kept use
    assert other[PARAM_REUSE]["kvpush_id"] not in str(aborts)
    assert not d.build_plan(STEP).send_aborts         # once
    # a turn whose blocks only share a prefix with a kept one (a fork of the conversation
    # after it) does not supersede it
    finish("c2-fork", list(range(5000, 5100)) + list(range(9000, 9070)),
           [*range(40, 43), 60, 61, 62])
    assert not d.build_plan(STEP).send_aborts


# -- load or recompute, from measured costs ------------------------------------------------
MB = 1 << 20


def measured() -> ReuseCosts:
    """A link of 10 ms per load plus 2 ms per MB, an engine of 2 ms per step plus
    0.125 ms per token (the fits must find both terms from samples of several sizes; a
    token costs at least the steps' mean share, 112.125 ms / 833 tokens)."""
    c = ReuseCosts()
    for mb in (1, 2, 4, 8):
        c.observe_load(mb * MB, 0.010 + 0.002 * mb)
    for tokens in (1, 64, 256, 512):
        c.observe_step(tokens, 0.002 + 0.000125 * tokens)
    return c


def test_costs_fit_latency_and_bandwidth_from_samples() -> None:
    c = measured()
    assert c.load_s(3 * MB) == pytest.approx(0.016)
    assert c.recompute_s(100) == pytest.approx(0.112125 / 833 * 100)


def test_a_fit_tilted_by_noise_does_not_make_computing_look_cheap() -> None:
    """Steps slowed by other work (short ones slow, a long one fast) tilt the line to a
    slope a fifth of the mean per-token cost (19 ms for 896 tokens): computing them is
    still estimated at the steps' mean share (94 ms), above a 13.5 ms load."""
    c = ReuseCosts()
    for tokens, seconds in ((512, 0.036), (176, 0.030), (208, 0.028)):
        c.observe_step(tokens, seconds)
    c.observe_load(28 * MB, 0.0135)
    assert c.recompute_s(896) == pytest.approx(0.094)
    assert c.choose(896, 28 * MB).load


def test_costs_choose_recompute_for_a_small_answer_and_load_for_a_long_history() -> None:
    c = measured()
    # 48 tokens (1.5 MB): 13 ms to load, 6.5 ms to compute
    assert not c.choose(48, 1.5 * MB).load
    # 600 tokens (19 MB): 48 ms to load, 81 ms to compute
    assert c.choose(600, 19 * MB).load


def test_costs_load_until_a_load_is_measured_and_never_assume_small_loads_cheaper() -> None:
    c = ReuseCosts()
    assert c.choose(48, 1.5 * MB) == (True, None, None, "nothing measured yet")  # to learn
    c.observe_step(512, 0.066)
    assert c.choose(48, 1.5 * MB) == (True, None, 6188, "nothing measured yet")
    c.observe_load(19 * MB, 0.030)                  # one size of load: 30 ms
    assert c.load_s(1.5 * MB) == pytest.approx(0.030)   # not 30 ms x 1.5/19
    assert c.load_s(38 * MB) == pytest.approx(0.060)
    assert not c.choose(48, 1.5 * MB).load          # 30 ms against 6 ms
    # over twice the largest load measured: load it, to measure it (60 ms estimated
    # against 50 ms to compute, but the fit knows nothing there)
    assert c.load_s(39 * MB) > c.recompute_s(390)   # type: ignore[operator]
    assert c.choose(390, 39 * MB).why == "over twice the largest load measured"
    assert c.choose(390, 39 * MB).load
    assert c.choose(380, 38 * MB) == (False, 60000, 48984, "")


def costed(costs: ReuseCosts) -> KVPushScheduler:
    p = scheduler()
    p.costs = costs
    p._bytes_per_block = 0.5 * MB
    return p


@pytest.mark.parametrize("cached", [128, 0])
def test_prefill_decides_per_request_from_its_costs(cached: int) -> None:
    """The prefix cache holds the previous prompt (128 tokens): the 32 kept tokens past it
    (1 block, 0.5 MB: 11 ms to load, 4 ms to compute) are computed, and nothing is sent.
    It holds nothing: the 160 kept tokens (5 blocks, 2.5 MB: 15 ms to load, 20 ms to
    compute) load."""
    history = list(range(1000, 1170))
    _, out = keep_turn("push", history)
    p = costed(measured())
    r = next_turn(history + [7] * 40, out | prefill_params("t2", "push"))
    want = (0, False) if cached else (160, True)
    assert p.get_num_new_matched_tokens(r, cached) == want
    p.update_state_after_alloc(r, Blocks(list(range(50, 57))), want[0])
    recvs = p.build_plan(STEP).recv
    if cached:
        assert not recvs
    else:
        (recv,) = recvs
        assert recv.report and recv.dst == [50, 51, 52, 53, 54]


@pytest.mark.parametrize("load_s, logged", [
    (0.0048001, "computes the 32 kept tokens its prefix cache lacks (estimated load "
                "4.800 ms, compute 4.800 ms)"),
    (0.0047994, "loads the 32 kept tokens its prefix cache lacks (estimated load "
                "4.799 ms, compute 4.800 ms)")])
def test_a_choice_is_logged_with_the_figures_it_compared(
        caplog: pytest.LogCaptureFixture, load_s: float, logged: str) -> None:
    """A load estimated 0.3 us under the compute is no cheaper in the figures the log
    gives (4.800 ms each): it computes, and the line says what was compared."""
    history = list(range(1000, 1170))
    _, out = keep_turn("push", history)
    costs = ReuseCosts()
    costs.observe_load(0.5 * MB, load_s)
    costs.observe_step(32, 0.0048004)
    p = costed(costs)
    r = next_turn(history + [7] * 40, out | prefill_params("t2", "push"))
    want = (32, True) if logged.startswith("loads") else (0, False)
    with caplog.at_level(logging.INFO, logger="kvpush.vllm"):
        assert p.get_num_new_matched_tokens(r, 128) == want
        p.update_state_after_alloc(r, Blocks(list(range(50, 57))), want[0])
    assert f"request {r.request_id}: {logged}" in caplog.text


def test_scheduler_measures_its_steps_and_its_loads() -> None:
    """The first load from a decode instance waited for the connection to it too: no
    sample. The next one from it is, from its plan to the step that schedules its
    request's compute (what loading cost the request)."""
    history = list(range(1000, 1170))
    _, first = keep_turn("pull", history)
    _, out = keep_turn("pull", history)          # the same decode instance's address
    p = scheduler()
    p._bytes_per_block = 1000.0
    r = next_turn(history + [7] * 40, first | prefill_params("t1", "pull"))
    r.request_id = "p1"
    assert p.get_num_new_matched_tokens(r, 0) == (160, True)
    p.update_state_after_alloc(r, Blocks(list(range(50, 57))), 160)
    p.update_connector_output(SimpleNamespace(finished_recving={"p1"}))
    assert not p.costs._loads
    r = next_turn(history + [7] * 40, out | prefill_params("t2", "pull"))
    assert p.get_num_new_matched_tokens(r, 0) == (160, True)
    p.update_state_after_alloc(r, Blocks(list(range(50, 57))), 160)
    p.build_plan(SimpleNamespace(num_scheduled_tokens={"other": 300}))
    time.sleep(0.02)
    # the step's output: the load is not reported yet
    p.update_connector_output(SimpleNamespace(finished_recving=set()))
    p.build_plan(SimpleNamespace(num_scheduled_tokens={}))   # nothing runs: no sample
    time.sleep(0.01)
    p.update_connector_output(SimpleNamespace(finished_recving={"p2"}))
    (step,) = p.costs._steps
    assert step[0] == 300 and 0.02 <= step[1] < 0.5
    assert not p.costs._loads                    # its compute is not scheduled yet
    p.build_plan(SimpleNamespace(num_scheduled_tokens={}))
    time.sleep(0.01)
    p.build_plan(SimpleNamespace(num_scheduled_tokens={"p2": 50}))
    (load,) = p.costs._loads
    assert load[0] == 5000.0 and 0.04 <= load[1] < 0.5
    # a failed load is no sample of the link
    p2 = scheduler()
    p2._loaded_from.add(tuple(out[PARAM_REUSE]["kvpush_producers"]))
    r = next_turn(history + [7] * 40, out | prefill_params("t3", "pull"))
    p2.get_num_new_matched_tokens(r, 0)
    p2.update_state_after_alloc(r, Blocks(list(range(50, 57))), 160)
    p2.update_connector_output(SimpleNamespace(finished_recving={"p2"},
                                               invalid_block_ids={52}))
    assert not p2.costs._loads


def test_a_kept_turn_is_loaded_by_one_request_and_the_others_compute() -> None:
    """Two turns of one conversation carry the same kept turn (sent at once, or a client's
    retry): the first loads it; the second, in flight with it or after it, computes
    instead of waiting on a source its decode instance let go."""
    history = list(range(1000, 1170))
    _, out = keep_turn("push", history)
    p = scheduler()
    a = next_turn(history + [7] * 40, out | prefill_params("t2", "push"))
    b = next_turn(history + [8] * 40, out | prefill_params("t3", "push"))
    b.request_id = "p3"
    assert p.get_num_new_matched_tokens(a, 0) == (160, True)
    assert p.get_num_new_matched_tokens(b, 0) == (160, True)    # a not allocated yet
    p.update_state_after_alloc(a, Blocks(list(range(50, 57))), 160)
    assert p.get_num_new_matched_tokens(b, 0) == (0, False)
    p.update_state_after_alloc(b, Blocks(list(range(60, 67))), 0)
    (recv,) = p.build_plan(STEP).recv
    assert recv.req_id == "p2" and recv.report


def test_reuse_load_is_measured_or_always() -> None:
    assert AdapterConfig().reuse_load == "measured"
    with pytest.raises(ValueError, match="reuse_load"):
        AdapterConfig(reuse_load="sometimes")


def test_a_requests_kept_prefix_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM asks for a request's external tokens, then tells its allocation: the kept
    prefix's fingerprint (the dear part of the check) is taken once, and nothing of the
    request stays once it has been allocated or finished."""
    from kvpush.integrations import vllm_reuse

    history = list(range(1000, 1170))
    _, out = keep_turn("push", history)
    p = scheduler()
    taken: list[int] = []
    fingerprint = vllm_reuse.prompt_fingerprint

    def counted(num_tokens: int, token_ids: Any) -> str:
        taken.append(num_tokens)
        return fingerprint(num_tokens, token_ids)

    monkeypatch.setattr(vllm_reuse, "prompt_fingerprint", counted)
    a = next_turn(history + [7] * 40, out | prefill_params("t2", "push"))
    assert p.get_num_new_matched_tokens(a, 0) == (160, True)
    assert p.get_num_new_matched_tokens(a, 0) == (160, True)    # not allocated: asked again
    p.update_state_after_alloc(a, Blocks(list(range(50, 57))), 160)
    assert taken == [160]
    b = next_turn(history + [8] * 40, out | prefill_params("t3", "push"))
    b.request_id = "p3"
    assert p.get_num_new_matched_tokens(b, 0) == (0, False)      # a has loaded it
    p.request_finished(b, [])                                   # aborted while waiting
    assert taken == [160, 160] and not p._offers
