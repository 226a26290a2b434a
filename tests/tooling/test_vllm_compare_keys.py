"""``benchmarks/vllm/compare.py``'s summary keys from synthetic runs (its servers need real
vLLM; the arithmetic that turns runs into the keys an issue names does not): the overhead
ratio at the worst rate against the best of vLLM's four set-ups, an anchor no slower than
colocated leaving the ratio undefined, the TPOT gaps to the do-nothing connector and to the
disaggregated set-up that moves nothing, and the TP-2 token match."""

from __future__ import annotations

from typing import Any

from benchmarks.vllm import compare as vc


def run(ttft: float, tpot: float = 3.0, same: int = 4, errors: int = 0) -> dict[str, Any]:
    return {"requests": 4, "errors": errors, "ttft_p50_ms": ttft, "ttft_p90_ms": ttft,
            "tpot_p50_ms": tpot, "tpot_p90_ms": tpot, "throughput_tok_s": 1.0,
            "tokens_identical": same, "first_token_identical": same,
            "by_length": {"128": {"requests": 4, "ttft_p50_ms": ttft, "ttft_p90_ms": ttft,
                                  "tpot_p50_ms": tpot, "tpot_p90_ms": tpot}},
            "ttft_ms": [ttft] * 4}


def results() -> dict[str, Any]:
    return {
        "colocated": {"2.0": run(30), "8.0": run(40)},
        "colocated_noop": {"2.0": run(30, tpot=2.5), "8.0": run(40, tpot=2.6)},
        "kvpush_push": {"2.0": run(36, tpot=2.7), "8.0": run(60, tpot=3.4)},
        "kvpush_pull": {"2.0": run(50, tpot=2.9), "8.0": run(70, tpot=3.0)},
        "vllm_nixl_pull": {"2.0": run(80), "8.0": run(200)},
        "vllm_nixl_push": {"2.0": run(90), "8.0": run(150)},
        "vllm_nixl_pull_nospin": {"2.0": run(42), "8.0": run(100)},
        "vllm_nixl_push_nospin": {"2.0": run(45), "8.0": run(80)},
        "colocated_fp32": {"0.25": run(100)},
        "kvpush_push_tp2": {"0.25": run(300)},
        "kvpush_pull_tp2": {"0.25": run(320)},
    }


def test_keys_take_the_worst_rate_against_the_best_anchor() -> None:
    r = results()
    vc.overheads(r)
    assert r["kvpush_push"]["8.0"]["ttft_p50_over_colocated_ms"] == 20
    assert r["kvpush_push_tp2"]["0.25"]["ttft_p50_over_colocated_ms"] == 200  # vs fp32 TP 1
    keys = vc.headline(r)
    # rate 2: 6 / 12 (pull, spin removed) = 0.5; rate 8: 20 / 40 (push, spin removed) = 0.5
    r["kvpush_push"]["8.0"]["ttft_p50_over_colocated_ms"] = 30
    assert keys["vllm_ttft_overhead_push_over_best_vllm"] == 0.5
    assert vc.headline(r)["vllm_ttft_overhead_push_over_best_vllm"] == 0.75
    assert keys["vllm_tpot_p50_kvpush_minus_noop_ms"] == 0.8      # push at rate 8
    assert keys["vllm_tpot_p50_kvpush_minus_nomove_ms"] is None    # disagg_nomove not run
    assert keys["vllm_tpot_p50_kvpush_minus_nomove_median_ms"] is None
    assert keys["vllm_tp2_tokens_match"] is True
    table = vc.markdown(r, {"keys": keys, "date": "d", "machine": "m", "command": "c"})
    assert "kvpush_push_tp2" in table and "**0.5**" in table


def test_an_anchor_without_overhead_leaves_the_ratio_undefined() -> None:
    r = results()
    for name in vc.VLLM_CONFIGS:
        r[name]["2.0"] = run(29)        # faster than colocated at that rate
    vc.overheads(r)
    keys = vc.headline(r)
    assert keys["vllm_ttft_overhead_by_rate"]["2.0"]["ratio"] is None
    assert keys["vllm_ttft_overhead_push_over_best_vllm"] == 0.5    # rate 8 still counts


def test_one_token_off_or_an_error_in_tp2_is_no_match() -> None:
    for bad in (run(300, same=3), run(300, errors=1)):
        r = results()
        r["kvpush_pull_tp2"]["0.25"] = bad
        vc.overheads(r)
        assert vc.headline(r)["vllm_tp2_tokens_match"] is False
    r = results()
    del r["kvpush_push_tp2"], r["kvpush_pull_tp2"]
    assert vc.headline(r)["vllm_tp2_tokens_match"] is None           # not run


def test_a_partial_run_keeps_the_keys_it_could_not_compute() -> None:
    kept = {"vllm_tp2_tokens_match": True, "vllm_layerwise_ttft_over_whole": 0.98,
            "vllm_ttft_overhead_push_over_best_vllm": 0.9, "meta": {"old": 1}}
    keys = {"vllm_tp2_tokens_match": None, "vllm_ttft_overhead_push_over_best_vllm": 0.5}
    out = vc.merge_results(kept, keys, {"command": "new"}, {"colocated": {}})
    assert out["vllm_ttft_overhead_push_over_best_vllm"] == 0.5       # this run's
    assert out["vllm_tp2_tokens_match"] is True                       # not run: kept
    assert out["vllm_layerwise_ttft_over_whole"] == 0.98              # another benchmark's
    assert out["meta"] == {"command": "new", "keys_kept": ["vllm_tp2_tokens_match"]}
    assert out["results"] == {"colocated": {}}
    fresh = vc.merge_results({}, keys, {}, {})
    assert fresh["vllm_tp2_tokens_match"] is None and fresh["meta"]["keys_kept"] == []


def test_the_tpot_gap_to_the_no_transfer_setup_takes_the_worst_rate_and_mode() -> None:
    r = results()
    r["disagg_nomove"] = {"2.0": run(20, tpot=2.8), "8.0": run(25, tpot=3.3)}
    vc.overheads(r)
    keys = vc.headline(r)
    # rate 2: push -0.1, pull +0.1; rate 8: push +0.1, pull -0.3 -> the worst is 0.1
    assert keys["vllm_tpot_p50_kvpush_minus_nomove_ms"] == 0.1
    assert keys["vllm_tpot_p50_kvpush_minus_nomove_median_ms"] == 0.0   # -0.1 +0.1 +0.1 -0.3
    r["kvpush_pull"]["2.0"]["tpot_p50_ms"] = 3.5
    assert vc.headline(r)["vllm_tpot_p50_kvpush_minus_nomove_ms"] == 0.7
    assert vc.headline(r)["vllm_tpot_p50_kvpush_minus_nomove_median_ms"] == 0.0
    table = vc.markdown(r, {"keys": keys, "date": "d", "machine": "m", "command": "c"})
    assert "| disagg_nomove | 2.0 |" in table and "`disagg_nomove`): **0.1 ms**" in table
