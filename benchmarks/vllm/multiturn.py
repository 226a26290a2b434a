"""Multi-turn reuse in real vLLM (CPU): time to first token of turns 2..T with the
conversation's KV moved back from the decode instance (``reuse``) and without it.

One prefill instance (core 0, prefix caching off: a prefill pool that does not keep
conversations, the "no affinity" scenario) and one decode instance (core 1), both
``kv_both`` with the adapter's ``reuse`` on, driven as a proxy for vLLM's
``NixlConnector`` ``bidirectional_kv_xfer`` drives them (the previous decode answer's
``kv_transfer_params`` go with the next prefill request). Each of C conversations of T turns
runs twice, alternating, on the same servers: with the kept turn passed on, and without (its
prefill computes the whole conversation). Each turn appends the previous answer and new user
tokens. TTFT of a turn: pull, the prefill leg's wall time plus the decode instance's own
TTFT (vLLM's ``time_to_first_token_seconds`` histogram, one request at a time); push, both
legs leave together and the decode's TTFT is the turn's. Then one colocated instance with prefix
caching (core 0) replays every conversation turn by turn: its TTFT, and every reused turn's
tokens must equal its (``vllm_mt_tokens_match``; turns without reuse are counted too: a
prefill that recomputes the previous answer in one batch may differ from the decode steps
that computed it in the last bits, and so in a token).

Writes ``vllm_mt_ttft_reuse_speedup_push`` / ``_pull`` (TTFT p50 over turns 2..T without
reuse / with; higher is better), ``vllm_mt_tokens_match`` and a ``vllm_multiturn`` section
into ``benchmarks/results/vllm_multiturn.json``, keeping every other key there. vLLM's own
connectors and the sticky scenario are not run here (yet).

Run: ``.venv-vllm/bin/python -m benchmarks.vllm.multiturn`` from the repository root
(``bash .ci/bootstrap-vllm`` first); ``--quick`` for a short smoke run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from examples.vllm import launch

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "vllm_multiturn.json"
TTFT = "vllm:time_to_first_token_seconds_sum"


def _post(url: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json",
                                                         "X-Request-Id": rid})
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def turn(prefill: launch.Process, decode: launch.Process, prefill_kv: int, prompt: list[int],
         mode: str, kept: dict[str, Any] | None, answer: int
         ) -> tuple[float, list[int], dict[str, Any] | None]:
    """(TTFT s, tokens, the decode's kv_transfer_params) of one turn."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": answer, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    rid = str(uuid.uuid4())
    params: dict[str, Any] = {**(kept or {}), "do_remote_decode": True,
                              "do_remote_prefill": False, "transfer_mode": mode}
    first = dict(body, max_tokens=1, kv_transfer_params=params)
    before = launch.metrics(decode.url).get(TTFT, 0.0)
    if mode == "pull":
        start = time.perf_counter()
        done = _post(prefill.url, first, rid)
        leg = time.perf_counter() - start
        out = _post(decode.url, dict(body, kv_transfer_params=done["kv_transfer_params"]), rid)
    else:
        leg = 0.0
        worker = threading.Thread(target=_post, args=(prefill.url, first, rid), daemon=True)
        worker.start()
        out = _post(decode.url, dict(body, kv_transfer_params={
            "do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push",
            "remote_engine_id": "prefill", "remote_host": "127.0.0.1",
            "remote_port": prefill_kv, "tp_size": 1, "remote_request_id": rid}), rid)
        worker.join(300)
    deadline = time.monotonic() + 10
    ttft = launch.metrics(decode.url).get(TTFT, 0.0) - before
    while ttft <= 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        ttft = launch.metrics(decode.url).get(TTFT, 0.0) - before
    return leg + ttft, list(out["choices"][0]["token_ids"]), out.get("kv_transfer_params")


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model) if args.model else None
    work = Path(tempfile.mkdtemp(prefix="kvpush-mt-"))
    if model is None:
        import subprocess
        import sys
        model = work / "tiny-llama"
        subprocess.run([sys.executable, str(REPO / "examples/vllm/make_tiny_model.py"),
                        str(model)], check=True, timeout=300)
    fleet = launch.Fleet()
    p_kv, d_kv, p_port, d_port = (launch.free_port() for _ in range(4))
    common = ["-O0", "--max-num-seqs", "8"]
    rng = np.random.default_rng(0)
    try:
        prefill = fleet.add(launch.start_vllm(
            model, p_port, name="prefill", cores="0", log_dir=work,
            extra_args=[*common, "--no-enable-prefix-caching"],
            kv_transfer_config=launch.kvpush_config(
                "kv_both", p_kv, reuse=True, request_timeout_s=10.0,
                kv_load_failure_policy="recompute")))
        decode = fleet.add(launch.start_vllm(
            model, d_port, name="decode", cores="1", log_dir=work,
            extra_args=common,
            kv_transfer_config=launch.kvpush_config("kv_both", d_kv, reuse=True,
                                                    lease_s=120.0)))
        launch.wait_healthy([prefill, decode], timeout_s=600)
        figures: dict[str, Any] = {}
        played: list[tuple[str, list[list[int]], dict[str, list[list[int]]]]] = []
        for mode in ("push", "pull"):
            ttft: dict[str, list[float]] = {"reuse": [], "none": []}
            for _ in range(args.conversations):
                first = [int(x) for x in rng.integers(10, 1000, args.first_tokens)]
                users = [[int(x) for x in rng.integers(10, 1000, args.user_tokens)]
                         for _ in range(args.turns)]
                answers: dict[str, list[list[int]]] = {}
                prompts: list[list[int]] = []
                for way in ("reuse", "none"):
                    prompt, kept, said = list(first), None, []
                    for k in range(args.turns):
                        t, tokens, params = turn(prefill, decode, p_kv, prompt, mode,
                                                 kept if way == "reuse" else None,
                                                 args.answer_tokens)
                        said.append(tokens)
                        if way == "reuse":
                            prompts.append(prompt)
                        if k:
                            ttft[way].append(t)
                        kept = params
                        prompt = prompt + tokens + users[k]
                    answers[way] = said
                played.append((mode, prompts, answers))
            p50 = {w: statistics.median(v) for w, v in ttft.items()}
            p90 = {w: float(np.percentile(v, 90)) for w, v in ttft.items()}
            figures[mode] = {"ttft_p50_ms": {w: round(v * 1e3, 2) for w, v in p50.items()},
                             "ttft_p90_ms": {w: round(v * 1e3, 2) for w, v in p90.items()},
                             "speedup": round(p50["none"] / p50["reuse"], 3)}
            print(f"{mode}: TTFT p50 turns 2..{args.turns}: without reuse "
                  f"{p50['none'] * 1e3:.1f} ms, with {p50['reuse'] * 1e3:.1f} ms "
                  f"({p50['none'] / p50['reuse']:.2f}x)", flush=True)
        fleet.stop()
        # The reference: one colocated instance with prefix caching, turn by turn (a
        # reused turn's answer KV was computed by decode steps, as a colocated instance's
        # cached answer is; recomputing it in one batch may differ in the last bits).
        colo = fleet.add(launch.start_vllm(model, launch.free_port(), name="colocated",
                                           cores="0", log_dir=work, extra_args=common))
        launch.wait_healthy([colo], timeout_s=600)
        equal = {"reuse": 0, "none": 0}
        colo_ttft: list[float] = []
        for _mode, prompts, answers in played:
            for k, prompt in enumerate(prompts):
                before = launch.metrics(colo.url).get(TTFT, 0.0)
                out = _post(colo.url, {"model": "tiny", "prompt": prompt, "temperature": 0,
                                       "max_tokens": args.answer_tokens, "ignore_eos": True,
                                       "return_token_ids": True}, str(uuid.uuid4()))
                if k:
                    colo_ttft.append(launch.metrics(colo.url).get(TTFT, 0.0) - before)
                ref = list(out["choices"][0]["token_ids"])
                for way in equal:
                    equal[way] += answers[way][k] == ref
        turns = len(played) * args.turns
        match = equal["reuse"] == turns
        print(f"turns equal to colocated: reuse {equal['reuse']}/{turns}, without reuse "
              f"{equal['none']}/{turns}; colocated TTFT p50 turns 2..{args.turns}: "
              f"{statistics.median(colo_ttft) * 1e3:.1f} ms", flush=True)
        figures["colocated_ttft_p50_ms"] = round(statistics.median(colo_ttft) * 1e3, 2)
        figures["turns_equal_to_colocated"] = {**equal, "of": turns}
        return {"vllm_mt_ttft_reuse_speedup_push": figures["push"]["speedup"],
                "vllm_mt_ttft_reuse_speedup_pull": figures["pull"]["speedup"],
                "vllm_mt_tokens_match": match,
                "vllm_multiturn": {"scenario": "no affinity (prefill without prefix caching)",
                                   "conversations": args.conversations,
                                   "turns": args.turns, "first_tokens": args.first_tokens,
                                   "user_tokens": args.user_tokens,
                                   "answer_tokens": args.answer_tokens,
                                   "machine": platform.machine(), **figures}}
    finally:
        fleet.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (default: the tiny Llama, made here)")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--first-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=128)
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--quick", action="store_true", help="2 conversations x 3 turns, shorter")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.first_tokens = 2, 3, 256
    out = run(args)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    old.update(out)
    RESULTS.write_text(json.dumps(old, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "vllm_multiturn"}))


if __name__ == "__main__":
    main()
